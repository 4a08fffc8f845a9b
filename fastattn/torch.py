"""fastattn inside PyTorch: registered ops with autograd and ``torch.compile``
support, and a drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

- :func:`scaled_dot_product_attention` takes and returns torch tensors, with the
  semantics of ``torch.nn.functional.scaled_dot_product_attention`` for the
  arguments they share, plus fastattn's variants as keywords.
- :func:`sdpa_kernel` (a context manager), :func:`enable` and :func:`disable`
  route ``torch.nn.functional.scaled_dot_product_attention`` on CPU tensors through
  fastattn, so existing models switch with one line; anything fastattn does not
  take goes to PyTorch's own function, unchanged.
- :func:`attention` and :func:`quantize_kv` are :func:`fastattn.attention` and
  :func:`fastattn.quantize_kv` on tensors, for inference against the caches servers
  keep (int8 QuantizedKV of tensors, paged pools with a block table), read in place.
- ``torch.ops.fastattn.attention_fwd`` and ``torch.ops.fastattn.attention_bwd``
  are the registered ops (``torch.library.custom_op``, CPU), each with a fake
  implementation, so ``torch.compile(fullgraph=True)`` traces them without a graph
  break; the forward's autograd formula calls the backward op.

Tensors reach the kernel without a copy: ``Tensor.numpy()`` is a view of the
tensor's memory and fastattn reads any strides with a contiguous last axis in place;
the results are NumPy arrays the kernel wrote, wrapped by ``torch.from_numpy``.

Importing this module needs PyTorch; the rest of fastattn does not.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Sequence, Tuple, Union

import numpy as np

try:
    import torch
except ImportError as _exc:  # torch stays an optional dependency of fastattn
    raise ImportError("fastattn.torch needs PyTorch: pip install torch==2.13.0 "
                      f"(importing torch failed: {_exc})") from _exc

from torch import Tensor

import fastattn
from . import _torch_route
from ._torch_ops import _BF16_NP, _labelled, _np, _pt, attention_bwd, attention_fwd
from ._torch_plan import _FN, _Plan, _plan
from ._torch_route import _causal_bias_mode, _is_causal_bias, _routed_sdpa

__all__ = ["scaled_dot_product_attention", "sdpa_kernel", "enable", "disable", "is_enabled",
           "attention_fwd", "attention_bwd", "attention", "quantize_kv"]


def scaled_dot_product_attention(
        query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
        dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
        enable_gqa: bool = False, *, window: Optional[Tuple[Optional[int], Optional[int]]] = None,
        alibi_slopes: Union[Tensor, Sequence[float], None] = None, softcap: Optional[float] = None,
        causal: Union[bool, str, None] = None, sinks: Optional[Tensor] = None,
        return_lse: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """``torch.nn.functional.scaled_dot_product_attention`` computed by fastattn.

    The arguments it shares with PyTorch's function have PyTorch's meaning:

    Parameters
    ----------
    query : Tensor (..., L, E)
    key : Tensor (..., S, E)
    value : Tensor (..., S, Ev)
        CPU tensors of one dtype: float32, float64, bfloat16 (read natively, computed
        in float32, its gradients through float32 copies) or float16 (native in
        inference; with gradients computed on float32 copies).  The
        leading dims broadcast against each other as in PyTorch (any number of them;
        more than two are flattened into the batch).
    attn_mask : Tensor, optional
        Broadcastable to (..., L, S).  bool: True = attend.  float (float32 or the
        query's dtype): added to the scaled logits; if it requires grad, its gradient
        is computed (summed over the axes it was broadcast along).
    dropout_p : float in [0, 1)
        Applied whenever > 0, as PyTorch's function does (modules pass 0 in eval
        mode).  The drop decisions come from a seed drawn from torch's default CPU
        generator, so ``torch.manual_seed`` makes a run reproducible; the backward
        drops the same weights.  (The dropped weights differ from PyTorch's.)
    is_causal : bool
        Top-left causal mask: key j is visible to query i iff j <= i.  With an
        `attn_mask` too, a key must pass both.  (PyTorch 2.13 does that in its CPU
        flash kernel, 4-D inputs with L == S, and raises "Explicit attn_mask should not
        be set when is_causal=True" otherwise; :func:`sdpa_kernel` leaves such calls
        to PyTorch.)
    scale : float, optional
        Default ``1 / sqrt(E)``.
    enable_gqa : bool
        Key/value heads (axis -3) may divide query's: query head h reads key/value head
        h // (Hq / Hkv), without copying key and value.  Without it the head axes must
        broadcast, as in PyTorch.

    fastattn's variants, as keywords (see ``fastattn.attention``):

    window : (left, right), optional
        Sliding window around each query's diagonal; -1 or None = unbounded side.
    alibi_slopes : Tensor (Hq,) or (B, Hq), optional
        ALiBi biases ``-slope * |i + S - L - j|`` (no gradient).
    softcap : float, optional
        Logit soft-capping ``softcap * tanh(s / softcap)``.
    causal : bool or {'bottom-right', 'top-left'}, optional
        fastattn's causal keyword: True or 'bottom-right' aligns the last query with the
        last key (decoding against a cache), 'top-left' is ``is_causal``.
    sinks : Tensor (Hq,), optional
        Attention sinks (gpt-oss): one logit per query head, not scaled, that joins
        each row's softmax as a key with a zero value (``fastattn.attention``'s
        `sinks`); differentiable.  Hq is the head axis (-3) of query.
    return_lse : bool
        Also return ``lse`` (..., L), the natural log of each row's softmax
        denominator (float32, float64 for float64 inputs); it is differentiable too.

    Returns
    -------
    out : Tensor (..., L, Ev), in the query's dtype; it shares memory with what the
        kernel wrote (no copy), except where a float16 result is cast back.
    lse : Tensor (..., L), only with ``return_lse=True``.

    Notes
    -----
    Differences from PyTorch 2.13's function (each checked on its CPU backends):

    - A row that sees no key (all masked) gives 0, as PyTorch does on the CPU, and
      lse -inf; its gradients are 0 too.
    - ``is_causal`` with `attn_mask` applies both (see above).
    - ``dropout_p`` must be < 1 (PyTorch also takes 1), and the dropped weights are
      fastattn's (Philox keyed by the seed drawn from torch's generator), not
      PyTorch's: the same probability, different draws.
    - ``enable_gqa`` with 2-D inputs is ignored (there is no head axis; PyTorch raises).
    - Errors are ``ValueError``/``TypeError`` naming the argument where PyTorch raises
      ``RuntimeError``; tensors must be on the CPU (:func:`sdpa_kernel` hands other
      devices to PyTorch instead).
    - No double backward: the backward op has no autograd formula of its own.
    - ``attn_mask`` may be a ``torch.nn.attention.bias.CausalBias``: ``causal_upper_left``
      is ``is_causal``, ``causal_lower_right`` is ``causal='bottom-right'`` (its lengths
      must be L and S); its memory, a placeholder, is never read.

    docs/semantics.md §19 lists these differences with their reasons, and what routing
    does with CausalBias, ``__torch_function__`` subclasses, TorchScript and export.

    ``torch.compile(fullgraph=True)`` traces the call without a graph break: the Python
    arguments become constants of the graph and the ops have fake implementations.
    Calls whose work (B·Hq·L·S·2E multiply-adds) is under 2**19 run on one thread, as
    PyTorch's ``parallel_for`` does below its grain size; others on
    ``torch.get_num_threads()``.
    """
    if attn_mask is not None and _is_causal_bias(attn_mask):
        # its memory is a placeholder: the causal mask it stands for instead
        if is_causal:
            raise ValueError("CausalBias should not be used with causal=True")
        if causal not in (None, False):
            raise ValueError(f"{_FN}: attn_mask is a CausalBias, a causal mask itself; pass "
                             f"it or causal={causal!r}, not both")
        if isinstance(query, Tensor) and isinstance(key, Tensor) and query.dim() >= 2 \
                and key.dim() >= 2:
            causal = _causal_bias_mode(attn_mask, query, key)
            if causal is None:
                raise ValueError(
                    f"{_FN}: attn_mask is causal_lower_right({attn_mask.seq_len_q}, "
                    f"{attn_mask.seq_len_kv}) but query and key have lengths L={query.shape[-2]}"
                    f" and S={key.shape[-2]}")
        attn_mask = None
    plan = _plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                 window, alibi_slopes, softcap, causal, return_lse, sinks)
    if not isinstance(plan, _Plan):
        raise plan[0](plan[1])
    return plan.run()



def is_enabled() -> bool:
    """Whether torch.nn.functional.scaled_dot_product_attention is routed through fastattn."""
    return torch.nn.functional.scaled_dot_product_attention is _routed_sdpa


def enable() -> None:
    """Route ``torch.nn.functional.scaled_dot_product_attention`` through fastattn
    (process-wide) until :func:`disable`: calls on CPU tensors that fastattn takes run
    :func:`scaled_dot_product_attention`; the others (CUDA or meta tensors, other dtypes,
    arguments it does not take) run PyTorch's function unchanged.  Code that looks the
    function up when it calls it (``torch.nn.functional.scaled_dot_product_attention``,
    ``F.scaled_dot_product_attention``, ``torch.nn.MultiheadAttention`` outside its fast
    path, ``transformers``' SDPA attention) is routed; a reference taken before (``from
    torch.nn.functional import scaled_dot_product_attention``) is not.

    A ``torch.nn.attention.bias.CausalBias`` mask runs as fastattn's causal mask
    (upper-left: top-left, lower-right: bottom-right; with gradients); other tensor
    subclasses that override ``__torch_function__`` go to PyTorch's function, which
    dispatches them as without routing; a ``TorchFunctionMode`` sees the routed function
    as ``func``.  ``torch.jit.script`` compiles routed calls to PyTorch's op (scripted
    code does not use fastattn), and ``torch.export``/``torch.compile`` hand calls with
    data-dependent sizes to PyTorch.  Dropout draws differ from PyTorch's
    (docs/semantics.md §19)."""
    with _torch_route._lock:
        if not is_enabled():
            _torch_route._original = torch.nn.functional.scaled_dot_product_attention
            torch.nn.functional.scaled_dot_product_attention = _routed_sdpa


def disable() -> None:
    """Put back the function :func:`enable` replaced."""
    with _torch_route._lock:
        if is_enabled():
            torch.nn.functional.scaled_dot_product_attention = _torch_route._original


@contextlib.contextmanager
def sdpa_kernel(enabled: bool = True) -> Iterator[None]:
    """Route ``torch.nn.functional.scaled_dot_product_attention`` through fastattn inside
    the block (see :func:`enable`); ``sdpa_kernel(False)`` turns routing off inside an
    enclosing block.  Blocks nest; on exit the routing is as it was on entry.  The switch
    is process-wide (a module attribute), not per thread.

    >>> with fastattn.torch.sdpa_kernel():
    ...     logits = model(tokens)
    """
    with _torch_route._lock:
        was = is_enabled()
        (enable if enabled else disable)()
    try:
        yield
    finally:
        with _torch_route._lock:
            (enable if was else disable)()


# --------------------------------------------------------------------------------------
# Serving caches: fastattn.attention and fastattn.quantize_kv on tensors (inference).

def _cache_np(x: Any, name: str) -> Any:
    """A tensor (or a QuantizedKV of tensors) as NumPy views of the same memory."""
    if isinstance(x, fastattn.QuantizedKV):
        return fastattn.QuantizedKV(_cache_np(x.data, f"{name}.data"), _cache_np(x.scale, f"{name}.scale"))
    if x is None or not isinstance(x, Tensor):
        return x
    if x.device.type != "cpu":
        raise ValueError(f"fastattn.torch.attention: {name} is on {x.device}; fastattn runs on CPU tensors")
    if x.dtype == torch.bfloat16 and _BF16_NP is None:
        raise TypeError("fastattn.torch.attention: bfloat16 tensors need ml_dtypes (pip install ml_dtypes)")
    return _np(x)


def attention(query: Tensor, key: Any, value: Any, **kwargs: Any) -> Any:
    """:func:`fastattn.attention` on CPU tensors, for inference: `key` and `value` are
    tensors, :class:`fastattn.QuantizedKV` of tensors (int8 data, float32 scale; see
    :func:`quantize_kv`), or pools ``(num_blocks, block_size, Hkv, D)`` with
    ``block_table=`` an int32 tensor (B, max_blocks) and ``seqlens_k=`` a tensor, as
    :func:`fastattn.attention` takes them.  Every array is read in place (no copy);
    every other keyword is :func:`fastattn.attention`'s.  The result is a tensor (with
    ``return_lse``, a tuple of tensors) that does not require grad: use
    :func:`scaled_dot_product_attention` to train."""
    args = {n: _cache_np(x, n) for n, x in (("query", query), ("key", key), ("value", value))}
    kw = {n: _cache_np(x, n) for n, x in kwargs.items()}
    res = _labelled(fastattn.attention, args["query"], args["key"], args["value"], **kw)
    if isinstance(res, tuple):
        return tuple(_pt(r) if isinstance(r, np.ndarray) else r for r in res)
    return _pt(res)


def quantize_kv(x: Tensor, *, group_size: int = 32,
                out: Optional[fastattn.QuantizedKV] = None) -> fastattn.QuantizedKV:
    """:func:`fastattn.quantize_kv` of a CPU tensor: a QuantizedKV of tensors (int8
    data, float32 scale), or written into `out` (a QuantizedKV of tensors, e.g. a
    slice of a preallocated cache, ``out=cache[..., t0:t1, :]``) and returned."""
    res = fastattn.quantize_kv(_cache_np(x, "x"), group_size=group_size,
                               out=None if out is None else _cache_np(out, "out"))
    return out if out is not None else fastattn.QuantizedKV(_pt(res.data), _pt(res.scale))
