"""Fastattn on PyTorch CPU tensors: registered ops, autograd and routing of SDPA.

- :func:`scaled_dot_product_attention` takes and returns torch tensors, with the
  semantics of ``torch.nn.functional.scaled_dot_product_attention`` for the
  arguments they share, plus fastattn's variants as keywords.
- :func:`sdpa_kernel` (a context manager), :func:`enable` and :func:`disable`
  route ``torch.nn.functional.scaled_dot_product_attention`` on CPU tensors through
  fastattn, so existing models switch with one line; anything fastattn does not
  take goes to PyTorch's own function, unchanged.  :func:`is_enabled` says whether
  routing is on.
- :func:`attention` and :func:`quantize_kv` are :func:`fastattn.attention` and
  :func:`fastattn.quantize_kv` on tensors, for inference against the caches servers
  keep (int8 :class:`fastattn.QuantizedKV` of tensors, paged pools with a block
  table), read in place.
- :func:`attention_fwd` and :func:`attention_bwd` are the registered ops
  ``torch.ops.fastattn.attention_fwd`` and ``torch.ops.fastattn.attention_bwd``
  (``torch.library.custom_op``, CPU), each with a fake implementation, so
  ``torch.compile(fullgraph=True)`` traces them without a graph break; the
  forward's autograd formula calls the backward op.

Dtypes: float32 and float64 are computed in their own precision; bfloat16 tensors
are read in place as ``ml_dtypes.bfloat16`` arrays and computed with float32
accumulation (their gradients too, rounded to bfloat16); float16 is read in place in
inference and computed on float32 copies when a gradient is needed.  :func:`attention`
also takes int8 :class:`fastattn.QuantizedKV` caches for the keys and values.

Tensors reach the kernel without a copy: ``Tensor.numpy()`` is a view of the
tensor's memory and fastattn reads any strides with a contiguous last axis in place;
the results are NumPy arrays the kernel wrote, wrapped by ``torch.from_numpy``.

Importing this module needs PyTorch (``pip install torch``); the rest of fastattn
does not.
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
    """Compute ``torch.nn.functional.scaled_dot_product_attention`` with fastattn.

    The arguments shared with PyTorch's function (`query` to `enable_gqa`) have
    PyTorch's meaning; the keyword-only ones are fastattn's variants (see
    :func:`fastattn.attention`).

    Parameters
    ----------
    query : Tensor, shape (..., L, E)
        CPU tensor of float32, float64, bfloat16 or float16.  float32 and float64 are
        computed in their own precision; bfloat16 is read in place (as
        ``ml_dtypes.bfloat16``) and accumulated in float32, its gradients computed
        with float32 accumulation and rounded to bfloat16; float16 is read in place
        in inference and computed on float32 copies when a gradient is needed.
    key : Tensor, shape (..., S, E)
        CPU tensor of the query's dtype.
    value : Tensor, shape (..., S, Ev)
        CPU tensor of the query's dtype.  The leading dims of `query`, `key` and
        `value` broadcast against each other as in PyTorch (any number of them; more
        than two are flattened into the batch).
    attn_mask : Tensor, optional
        Broadcastable to (..., L, S).  bool: True means attend.  float (float32 or
        the query's dtype): added to the scaled logits; if it requires grad, its
        gradient is computed (summed over the axes it was broadcast along).  A
        ``torch.nn.attention.bias.CausalBias`` stands for the causal mask it
        describes: ``causal_upper_left`` is `is_causal`, ``causal_lower_right`` is
        ``causal='bottom-right'`` (its lengths must be L and S); its memory, a
        placeholder, is never read.
    dropout_p : float, default 0.0
        Dropout probability in [0, 1), applied whenever it is > 0, as PyTorch's
        function does (modules pass 0 in eval mode).  The drop decisions come from a
        seed drawn from torch's default CPU generator, so ``torch.manual_seed`` makes
        a run reproducible; the backward drops the same weights.
    is_causal : bool, default False
        Top-left causal mask: key j is visible to query i iff j <= i.  With an
        `attn_mask` too, a key must pass both.
    scale : float, optional
        Multiplies the logits; default ``1 / sqrt(E)``.
    enable_gqa : bool, default False
        Let the key/value head count (axis -3) divide the query's: query head h reads
        key/value head ``h // (Hq / Hkv)``, without copying key and value.  Without
        it the head axes must broadcast, as in PyTorch.
    window : tuple of (int or None, int or None), optional
        Sliding window ``(left, right)`` around each query's diagonal; -1 or None
        means that side is unbounded.
    alibi_slopes : Tensor or sequence of float, shape (Hq,) or (B, Hq), optional
        ALiBi biases ``-slope * |i + S - L - j|``; they get no gradient.
    softcap : float, optional
        Logit soft-capping ``softcap * tanh(s / softcap)``, finite and > 0.
    causal : {None, False, True, 'bottom-right', 'top-left'}, optional
        fastattn's causal keyword: True or 'bottom-right' aligns the last query with
        the last key (decoding against a cache), 'top-left' is `is_causal`.
    sinks : Tensor, shape (Hq,), optional
        Attention sinks: one logit per query head (axis -3 of `query`), not scaled,
        that joins each row's softmax as a key with a zero value; differentiable.
    return_lse : bool, default False
        Also return the natural log of each row's softmax denominator.

    Returns
    -------
    out : Tensor, shape (..., L, Ev)
        The attention output in the query's dtype.  It shares memory with what the
        kernel wrote (no copy), except where a result computed on float32 copies is
        cast back.
    lse : Tensor, shape (..., L)
        Only with ``return_lse=True``: float32 (float64 for float64 inputs),
        differentiable.

    Raises
    ------
    TypeError
        If `query`, `key` or `value` is not a tensor, the dtypes differ or are not one
        of the four above, or `attn_mask`, `is_causal` or `scale` has the wrong type.
    ValueError
        If a tensor is not on the CPU, the shapes do not fit or broadcast,
        `dropout_p` is outside [0, 1), or an option is out of range.

    See Also
    --------
    sdpa_kernel : Route PyTorch's own function here inside a block.
    attention : Inference against int8 or paged caches.
    fastattn.attention : The same computation on NumPy arrays.

    Notes
    -----
    Differences from PyTorch 2.13's function (each checked on its CPU backends):

    - A row that sees no key (all masked) gives 0, as PyTorch does on the CPU, and
      lse -inf; its gradients are 0 too.
    - `is_causal` with `attn_mask` applies both.  PyTorch 2.13 does that in its CPU
      flash kernel (4-D inputs with L == S) and raises "Explicit attn_mask should not
      be set when is_causal=True" otherwise; :func:`sdpa_kernel` leaves such calls
      to PyTorch.
    - `dropout_p` must be < 1 (PyTorch also takes 1), and the dropped weights are
      fastattn's (Philox keyed by the seed drawn from torch's generator), not
      PyTorch's: the same probability, different draws.
    - `enable_gqa` with 2-D inputs is ignored (there is no head axis; PyTorch raises).
    - Errors are ``ValueError``/``TypeError`` naming the argument where PyTorch raises
      ``RuntimeError``; tensors must be on the CPU (:func:`sdpa_kernel` hands other
      devices to PyTorch instead).
    - No double backward: the backward op has no autograd formula of its own.

    ``torch.compile(fullgraph=True)`` traces the call without a graph break: the
    Python arguments become constants of the graph and the ops have fake
    implementations.  Calls whose work (B·Hq·L·S·2E multiply-adds) is under 2**19 run
    on one thread, as PyTorch's ``parallel_for`` does below its grain size; others on
    ``torch.get_num_threads()``.

    Examples
    --------
    >>> import torch
    >>> import fastattn.torch
    >>> g = torch.Generator().manual_seed(0)
    >>> q, k, v = (torch.randn(2, 4, 16, 32, generator=g) for _ in range(3))
    >>> out = fastattn.torch.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> out.shape, out.dtype
    (torch.Size([2, 4, 16, 32]), torch.float32)
    >>> ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> torch.allclose(out, ref, atol=1e-5)
    True

    Grouped-query attention in bfloat16, with the log-sum-exp:

    >>> kv = torch.randn(2, 1, 16, 32, generator=g).bfloat16()
    >>> out, lse = fastattn.torch.scaled_dot_product_attention(
    ...     q.bfloat16(), kv, kv, enable_gqa=True, return_lse=True)
    >>> out.dtype, lse.dtype, tuple(lse.shape)
    (torch.bfloat16, torch.float32, (2, 4, 16))
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
    """Say whether PyTorch's SDPA is routed through fastattn.

    Returns
    -------
    bool
        True while ``torch.nn.functional.scaled_dot_product_attention`` is fastattn's
        routing function (after :func:`enable`, or inside :func:`sdpa_kernel`).

    See Also
    --------
    enable, disable, sdpa_kernel

    Examples
    --------
    >>> import fastattn.torch
    >>> fastattn.torch.is_enabled()
    False
    >>> with fastattn.torch.sdpa_kernel():
    ...     fastattn.torch.is_enabled()
    True
    """
    return torch.nn.functional.scaled_dot_product_attention is _routed_sdpa


def enable() -> None:
    """Route ``torch.nn.functional.scaled_dot_product_attention`` through fastattn.

    The switch is process-wide and lasts until :func:`disable`; calling it while
    routing is on does nothing.  Calls on CPU tensors that fastattn takes run
    :func:`scaled_dot_product_attention`; the others (CUDA or meta tensors, other
    dtypes, arguments it does not take) run PyTorch's function unchanged.

    See Also
    --------
    disable : Undo it.
    sdpa_kernel : The same inside a ``with`` block.
    is_enabled : Whether routing is on.

    Notes
    -----
    Code that looks the function up when it calls it
    (``torch.nn.functional.scaled_dot_product_attention``,
    ``F.scaled_dot_product_attention``, ``torch.nn.MultiheadAttention`` outside its
    fast path, ``transformers``' SDPA attention) is routed; a reference taken before
    (``from torch.nn.functional import scaled_dot_product_attention``) is not.

    A ``torch.nn.attention.bias.CausalBias`` mask runs as fastattn's causal mask
    (upper-left: top-left, lower-right: bottom-right; with gradients); other tensor
    subclasses that override ``__torch_function__`` go to PyTorch's function, which
    dispatches them as without routing; a ``TorchFunctionMode`` sees the routed
    function as ``func``.  A call with both `is_causal` and an `attn_mask` goes to
    PyTorch, whose kernels differ on it.  ``torch.jit.script`` compiles routed calls
    to PyTorch's op (scripted code does not use fastattn), and
    ``torch.export``/``torch.compile`` hand calls with data-dependent sizes to
    PyTorch.  Dropout draws differ from PyTorch's.

    Examples
    --------
    >>> import torch
    >>> import fastattn.torch
    >>> fastattn.torch.enable()
    >>> q = torch.randn(1, 2, 8, 16)
    >>> out = torch.nn.functional.scaled_dot_product_attention(q, q, q)  # fastattn
    >>> fastattn.torch.disable()
    >>> fastattn.torch.is_enabled()
    False
    """
    with _torch_route._lock:
        if not is_enabled():
            _torch_route._original = torch.nn.functional.scaled_dot_product_attention
            torch.nn.functional.scaled_dot_product_attention = _routed_sdpa


def disable() -> None:
    """Put back PyTorch's SDPA function that :func:`enable` replaced.

    Calling it while routing is off does nothing.

    See Also
    --------
    enable, sdpa_kernel, is_enabled

    Examples
    --------
    >>> import torch
    >>> import fastattn.torch
    >>> original = torch.nn.functional.scaled_dot_product_attention
    >>> fastattn.torch.enable()
    >>> fastattn.torch.disable()
    >>> torch.nn.functional.scaled_dot_product_attention is original
    True
    """
    with _torch_route._lock:
        if is_enabled():
            torch.nn.functional.scaled_dot_product_attention = _torch_route._original


@contextlib.contextmanager
def sdpa_kernel(enabled: bool = True) -> Iterator[None]:
    """Route ``torch.nn.functional.scaled_dot_product_attention`` inside a block.

    A context manager: routing as :func:`enable` does while the block runs, or, with
    ``enabled=False``, turned off inside an enclosing block.  Blocks nest; on exit
    routing is as it was on entry, also when the block raises.

    Parameters
    ----------
    enabled : bool, default True
        True to route calls through fastattn inside the block, False to leave them
        to PyTorch's function.

    Yields
    ------
    None
        The block runs with routing switched as asked.

    See Also
    --------
    enable : Route for the rest of the process.
    scaled_dot_product_attention : The function routed calls run.

    Notes
    -----
    The switch is process-wide (a module attribute of ``torch.nn.functional``), not
    per thread: other threads see it while the block runs.

    Examples
    --------
    >>> import torch
    >>> import fastattn.torch
    >>> layer = torch.nn.TransformerEncoderLayer(d_model=16, nhead=2, batch_first=True)
    >>> x = torch.randn(1, 5, 16)
    >>> with torch.no_grad(), fastattn.torch.sdpa_kernel():
    ...     y = layer(x)
    >>> y.shape
    torch.Size([1, 5, 16])
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


def attention(query: Tensor, key: Any, value: Any = None, **kwargs: Any) -> Any:
    """Run :func:`fastattn.attention` on CPU tensors, for inference against caches.

    Parameters
    ----------
    query : Tensor
        CPU tensor, shaped as :func:`fastattn.attention` takes `q`: float32, float64,
        float16 or bfloat16 (bfloat16 needs ``ml_dtypes``).
    key : Tensor, fastattn.QuantizedKV or fastattn.KVCache
        A CPU tensor shaped as :func:`fastattn.attention` takes `k`; a
        :class:`fastattn.QuantizedKV` of tensors (int8 data, float32 scale, see
        :func:`quantize_kv`), with a float32, float16 or bfloat16 `query`; a paged
        pool ``(num_blocks, block_size, Hkv, D)`` with ``block_table=``; or a
        :class:`fastattn.KVCache` (`value` omitted; its ``append`` takes CPU tensors).
    value : Tensor or fastattn.QuantizedKV, optional
        As `key`, with the values; omitted with a :class:`fastattn.KVCache`.
    **kwargs
        Any keyword of :func:`fastattn.attention` (`causal`, `seqlens_k`,
        `block_table`, `return_lse`, ...); tensor values (a ``block_table`` int32
        tensor (B, max_blocks), ``seqlens_k``, a mask or bias) are read as NumPy
        views of their memory.

    Returns
    -------
    Tensor or tuple
        The output tensor, in `query`'s dtype; with `return_lse` or `return_stats`
        the tuple :func:`fastattn.attention` returns, its arrays as tensors.  No
        result requires grad: use :func:`scaled_dot_product_attention` to train.

    Raises
    ------
    ValueError
        If a tensor is not on the CPU, or as :func:`fastattn.attention` raises.
    TypeError
        If a tensor is bfloat16 and ``ml_dtypes`` cannot be imported, or as
        :func:`fastattn.attention` raises.

    See Also
    --------
    quantize_kv : Make an int8 cache of tensors.
    fastattn.attention : The same on NumPy arrays.

    Notes
    -----
    Every tensor is read in place (no copy): ``Tensor.numpy()`` views, bfloat16
    viewed as ``ml_dtypes.bfloat16``.

    Examples
    --------
    Decoding one token against an int8 cache of 64 positions:

    >>> import torch
    >>> import fastattn.torch
    >>> g = torch.Generator().manual_seed(0)
    >>> k, v = (torch.randn(1, 2, 64, 32, generator=g) for _ in range(2))
    >>> q = torch.randn(1, 2, 1, 32, generator=g)
    >>> qk, qv = fastattn.torch.quantize_kv(k), fastattn.torch.quantize_kv(v)
    >>> out = fastattn.torch.attention(q, qk, qv)
    >>> out.shape, out.dtype
    (torch.Size([1, 2, 1, 32]), torch.float32)
    >>> exact = fastattn.torch.attention(q, k, v)
    >>> bool((out - exact).abs().max() < 0.05)
    True
    """
    args = {n: _cache_np(x, n) for n, x in (("query", query), ("key", key), ("value", value))}
    kw = {n: _cache_np(x, n) for n, x in kwargs.items()}
    res = _labelled(fastattn.attention, args["query"], args["key"], args["value"], **kw)
    if isinstance(res, tuple):
        return tuple(_pt(r) if isinstance(r, np.ndarray) else r for r in res)
    return _pt(res)


def quantize_kv(x: Tensor, *, group_size: int = 32,
                out: Optional[fastattn.QuantizedKV] = None) -> fastattn.QuantizedKV:
    """Quantize a K or V cache tensor to int8 with :func:`fastattn.quantize_kv`.

    Parameters
    ----------
    x : Tensor, shape (..., D)
        CPU tensor of float32, float64, float16 or bfloat16 values, all finite.
    group_size : int, default 32
        Channels that share one float32 scale; it must divide D.
    out : fastattn.QuantizedKV, optional
        A QuantizedKV of tensors to write into in place (int8 data of `x`'s shape,
        float32 scale of shape ``x.shape[:-1] + (D // group_size,)``), e.g. a slice
        of a preallocated cache, ``out=cache[..., t0:t1, :]``.

    Returns
    -------
    fastattn.QuantizedKV
        `out` if given, else a new QuantizedKV of tensors: int8 ``data`` and float32
        ``scale = max|x| / 127`` per group.

    Raises
    ------
    ValueError
        If `x` holds values that are not finite, `group_size` does not divide D, a
        tensor is not on the CPU or `out` has the wrong shapes.
    TypeError
        If `x` has another dtype, or `out` is not a QuantizedKV.

    See Also
    --------
    attention : Read such a cache.
    fastattn.dequantize_kv : The float32 values a QuantizedKV stands for.

    Examples
    --------
    >>> import torch
    >>> import fastattn.torch
    >>> cache = fastattn.torch.quantize_kv(torch.zeros(1, 2, 16, 64))
    >>> cache.data.dtype, tuple(cache.scale.shape)
    (torch.int8, (1, 2, 16, 2))
    >>> new = torch.ones(1, 2, 4, 64)
    >>> _ = fastattn.torch.quantize_kv(new, out=cache[..., 8:12, :])
    >>> cache.data[0, 0, 8, :4].tolist(), cache.scale[0, 0, 8].tolist()
    ([127, 127, 127, 127], [0.007874015718698502, 0.007874015718698502])
    """
    res = fastattn.quantize_kv(_cache_np(x, "x"), group_size=group_size,
                               out=None if out is None else _cache_np(out, "out"))
    return out if out is not None else fastattn.QuantizedKV(_pt(res.data), _pt(res.scale))
