"""Fastattn in Hugging Face transformers: ``attn_implementation="fastattn"``.

Importing this module registers the name ``"fastattn"`` with transformers'
``AttentionInterface`` (the attention function) and ``AttentionMaskInterface`` (the
mask the model builds for it), so that::

    import fastattn.transformers
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="fastattn")
    # or from_config(cfg, attn_implementation="fastattn"), or
    # model.set_attn_implementation("fastattn")

runs every attention layer on fastattn.  What the models pass is mapped onto fastattn's
keywords without an L x L mask where the mask has a shape fastattn knows:

- causal masks become ``causal`` with the positions of the queries and keys in the
  sequence (``q_offset``/``k_offset``: a cache's past, a static cache's unfilled slots);
- sliding windows (Mistral, Qwen2/3, Gemma 2, gpt-oss) become ``window=(w - 1, 0)``
  (a query sees ``w`` keys, itself included, as transformers' mask);
- padding masks become ``seqlens_k`` (right padding) or a (B, 1, 1, Lk) key mask read
  with stride 0 (left padding); bidirectional encoders (BERT) take the same;
- GQA heads are read without ``repeat_kv``; Gemma 2's ``softcap`` is fastattn's
  ``softcap``; gpt-oss' sinks (``s_aux``) are fastattn's ``sinks``.

Anything else (packed sequences, custom ``and``/``or`` mask functions, a 4-D mask the
caller built) goes through the general mask path: the mask transformers' SDPA
backend would build, applied as fastattn's ``mask``/``bias``; never a wrong answer.

Inference (no gradient) calls :func:`fastattn.attention` on the tensors' memory: the
KV cache is read in place, decoding takes fastattn's split-KV decode path, and the
calls run on ``torch.get_num_threads()`` threads (one below PyTorch's grain size)
in the same OpenMP runtime as PyTorch's own ops.  Training goes through the
registered ``torch.ops.fastattn`` ops (autograd, dropout, gradients of the sinks).

:func:`attention_stats` records each layer's and head's row entropy, effective
support and largest weight during a forward pass (from ``return_stats``, O(L)
memory), and the profiler shows every call as ``fastattn::attention_fwd`` /
``fastattn::attention_bwd``.

Tested with transformers 5.24; needs ``transformers >= 5.0`` (the attention and mask
interfaces) and PyTorch.  Dtypes are those of :func:`fastattn.torch.scaled_dot_product_attention`:
float32, float64, bfloat16 and float16 models (bfloat16 read in place; float16 and
bfloat16 packed sequences computed on float32 copies).

Examples
--------
A randomly initialised two-layer Llama (no download) on fastattn:

>>> import torch
>>> import transformers
>>> import fastattn.transformers
>>> cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
...                                num_hidden_layers=2, num_attention_heads=4,
...                                num_key_value_heads=2)
>>> model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="fastattn")
>>> with torch.no_grad():
...     logits = model(torch.tensor([[1, 2, 3, 4, 5]])).logits
>>> logits.shape
torch.Size([1, 5, 64])
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

try:
    import transformers
    from transformers import masking_utils as _mu
except ImportError as _exc:  # transformers stays an optional dependency
    raise ImportError("fastattn.transformers needs transformers: pip install 'fastattn[transformers]' "
                      f"(importing transformers failed: {_exc})") from _exc

import torch
from torch import Tensor

import fastattn

from . import torch as _ft
from . import _torch_ops

__all__ = ["NAME", "AttentionMask", "attention_forward", "attention_mask", "attention_stats",
           "LayerStats", "register", "KVCache"]

NAME = "fastattn"


# --------------------------------------------------------------------------------------
# The mask: what transformers' mask builders describe, kept compact

class AttentionMask(Tensor):
    """The mask of one layer type in fastattn's terms.

    What :func:`attention_mask` returns to transformers and the model hands to
    :func:`attention_forward`.  A 4-D bool tensor (B, 1, Lq, Lk), so that
    transformers passes it along as a prepared mask (``generate()`` builds static
    caches' masks ahead of the model): its values are the padding part only, a
    broadcast view (no Lq x Lk memory); the causal and window parts are in the
    attributes, which only :func:`attention_forward` reads.  Operations on it give
    plain tensors, except ``.contiguous()``, which returns it.

    Parameters
    ----------
    causal : bool
        Key j is visible to query i iff ``kv_offset + j <= q_offset + i``.
    window : int or None
        A sliding window of this many keys, the query's own included (with
        `causal`).
    q_offset : int
        The position of query row 0 in the sequence.
    kv_offset : int
        The position of key row 0 in the sequence.
    shape : tuple of int
        ``(B, 1, Lq, Lk)``.
    lengths : Tensor, shape (B,), int64, optional
        Right padding: sequence b sees keys [0, lengths[b]).
    keys : Tensor, shape (B, 1, 1, Lk), bool, optional
        Any other padding: True means the key is a token.
    device : str or torch.device, default "cpu"
        The device of the tensor's values.
    segments : Tensor, shape (B, L), optional
        Packed sequences (no padding, Lq = Lk): rows with equal numbers are one
        sequence, whose positions run consecutively; computed as
        :func:`fastattn.varlen_attention` over the flattened batch.

    Attributes
    ----------
    causal, window, q_offset, kv_offset, lengths, keys, segments
        The parameters of the same names (`causal` a bool, the offsets ints).

    See Also
    --------
    attention_mask : The builder that makes it.

    Examples
    --------
    >>> import torch
    >>> from fastattn.transformers import AttentionMask
    >>> m = AttentionMask(True, None, 0, 0, (2, 1, 3, 3), lengths=torch.tensor([3, 2]))
    >>> m  # doctest: +ELLIPSIS
    fastattn.transformers.AttentionMask(shape=(2, 1, 3, 3), causal=True, ..., padding=lengths)
    >>> m[1, 0, 0].tolist()  # the values are the padding part only
    [True, True, False]
    """
    causal: bool
    window: Optional[int]
    q_offset: int
    kv_offset: int
    lengths: Optional[Tensor]
    keys: Optional[Tensor]
    segments: Optional[Tensor]

    @staticmethod
    def __new__(cls, causal: bool, window: Optional[int], q_offset: int, kv_offset: int,
                shape: Tuple[int, int, int, int], lengths: Optional[Tensor] = None,
                keys: Optional[Tensor] = None, device: Any = "cpu",
                segments: Optional[Tensor] = None) -> "AttentionMask":
        B, _, Lq, Lk = shape
        if keys is not None:
            data = keys.expand(B, 1, Lq, Lk)
        elif lengths is not None:
            data = (torch.arange(Lk, device=device) < lengths[:, None])[:, None, None, :]
            data = data.expand(B, 1, Lq, Lk)
        else:
            data = torch.ones((), dtype=torch.bool, device=device).expand(B, 1, Lq, Lk)
        t = data.as_subclass(cls)
        t.causal, t.window = bool(causal), window
        t.q_offset, t.kv_offset = int(q_offset), int(kv_offset)
        t.lengths, t.keys, t.segments = lengths, keys, segments
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """Operations give plain tensors (no stale attributes), except the one that
        transformers applies to a prepared mask on its way to the layers:
        ``.contiguous()`` (generate(); it stays a broadcast view, not materialized)."""
        if func is Tensor.contiguous and type(args[0]) is cls:
            return args[0]
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    def __repr__(self, *args: Any, **kwargs: Any) -> str:
        pad = ("lengths" if self.lengths is not None else "keys" if self.keys is not None
               else "packed" if self.segments is not None else "none")
        return (f"fastattn.transformers.AttentionMask(shape={tuple(self.shape)}, causal="
                f"{self.causal}, window={self.window}, q_offset={self.q_offset}, "
                f"kv_offset={self.kv_offset}, padding={pad})")


def _closure(fn) -> Dict[str, Any]:
    code = getattr(fn, "__code__", None)
    cells = getattr(fn, "__closure__", None) or ()
    return dict(zip(code.co_freevars, (c.cell_contents for c in cells))) if code else {}


_AND_CODE = _mu.and_masks(_mu.causal_mask_function).__code__
_WINDOW_CODE = _mu.sliding_window_overlay(1).__code__
_REMAP_CODE = _mu.remap_positions_for_packed_sequence(_mu.causal_mask_function, None).__code__
_PACKED_CODE = _mu.packed_sequence_mask_function(None).__code__


def _code(fn) -> Any:
    return getattr(fn, "__code__", None)


def _pattern(fn) -> Optional[Tuple[bool, Optional[int], Optional[Tensor]]]:
    """(causal, window, segments) of a mask function transformers built, when it is
    exactly one of the shapes fastattn has keywords for: causal, sliding-window causal
    (``sliding_window_causal_mask_function(w)``) or bidirectional, alone or as packed
    sequences (``remap_positions_for_packed_sequence`` of one of them, and
    ``packed_sequence_mask_function(segments)``: segments (B, L) numbers the
    sequences, whose positions run consecutively); None for anything else."""
    if fn is _mu.causal_mask_function:
        return True, None, None
    if fn is _mu.bidirectional_mask_function:
        return False, None, None
    if _code(fn) is not _AND_CODE:
        return None
    parts = _closure(fn).get("mask_functions")
    if not (isinstance(parts, tuple) and len(parts) == 2):
        return None
    if parts[1] is _mu.causal_mask_function and _code(parts[0]) is _WINDOW_CODE:
        w = _closure(parts[0]).get("sliding_window")  # sliding_window_causal_mask_function(w)
        if isinstance(w, int) and not isinstance(w, bool) and w >= 1:
            return True, w, None
        return None
    if _code(parts[0]) is _REMAP_CODE and _code(parts[1]) is _PACKED_CODE:
        inner = _pattern(_closure(parts[0]).get("mask_function"))
        seg = _closure(parts[1]).get("packed_sequence_mask")
        if inner is not None and inner[2] is None and isinstance(seg, Tensor) and seg.dim() == 2:
            return inner[0], inner[1], seg
    return None


def _int(x: Any) -> Optional[int]:
    """An offset as an int: an int, or a one-element integer tensor outside tracing."""
    if isinstance(x, int) and not isinstance(x, bool):
        return x
    if isinstance(x, Tensor) and x.numel() == 1 and not x.is_floating_point() \
            and not torch.compiler.is_compiling():
        return int(x.item())
    return None


def attention_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
                   kv_offset: int = 0, mask_function: Any = _mu.causal_mask_function,
                   attention_mask: Optional[Tensor] = None, **kwargs: Any) -> Any:
    """Build the attention mask transformers hands to ``"fastattn"`` layers.

    Registered in transformers' ``AttentionMaskInterface`` under ``"fastattn"``;
    transformers calls it with the arguments of its own mask builders.

    Parameters
    ----------
    batch_size : int
        B.
    q_length : int
        Lq, the number of query rows.
    kv_length : int
        Lk, the number of key rows.
    q_offset : int or Tensor, default 0
        The position of query row 0 in the sequence (a one-element integer tensor
        for static caches).
    kv_offset : int or Tensor, default 0
        The position of key row 0 in the sequence.
    mask_function : callable, default transformers' ``causal_mask_function``
        The mask as transformers describes it, ``(b, h, q_idx, kv_idx) -> bool``.
    attention_mask : Tensor, shape (B, Lk), optional
        The 2-D padding mask of the inputs (1 marks a token).
    **kwargs
        The other arguments of transformers' ``sdpa_mask`` (``device``,
        ``cache_position``, ...), passed on to it on the general path.

    Returns
    -------
    AttentionMask or Tensor or None
        An :class:`AttentionMask` where `mask_function` is causal, sliding-window
        causal or bidirectional (alone or as packed sequences) and `attention_mask`
        only marks padding; otherwise the 4-D bool mask transformers' SDPA backend
        builds (``sdpa_mask`` with no causal skip), or None where that mask hides
        nothing.

    See Also
    --------
    attention_forward : The attention function that reads the mask.

    Examples
    --------
    Right padding becomes per-sequence key lengths, with no Lq x Lk mask:

    >>> import torch
    >>> import fastattn.transformers
    >>> pad = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    >>> m = fastattn.transformers.attention_mask(2, 4, 4, attention_mask=pad)
    >>> m.causal, m.lengths.tolist()
    (True, [4, 2])
    """
    pattern = _pattern(mask_function)
    q_offset, kv_offset = _int(q_offset), _int(kv_offset)  # (a static cache's are tensors)
    if pattern is None or q_offset is None or kv_offset is None:
        kwargs = dict(kwargs, allow_is_causal_skip=False)
        return _mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                             q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                             attention_mask=attention_mask, **kwargs)
    causal, window, segments = pattern
    lengths = keys = None
    if segments is not None:  # (transformers detects packing only without a padding mask)
        if attention_mask is not None or q_offset or kv_offset or \
                tuple(segments.shape) != (batch_size, q_length) or q_length != kv_length:
            return _mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                                 q_offset=q_offset, kv_offset=kv_offset,
                                 mask_function=mask_function, attention_mask=attention_mask,
                                 **dict(kwargs, allow_is_causal_skip=False))
    elif attention_mask is not None:
        pad = _mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)
        pad = pad[:, kv_offset:kv_offset + kv_length].to(torch.bool)
        if pad.shape != (batch_size, kv_length):  # (not a padding mask: the general path)
            return _mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                                 q_offset=q_offset, kv_offset=kv_offset,
                                 mask_function=mask_function, attention_mask=attention_mask,
                                 **dict(kwargs, allow_is_causal_skip=False))
        n = pad.sum(dim=1)
        if bool(pad.all()):
            pass
        elif torch.equal(pad, torch.arange(kv_length, device=pad.device)[None, :] < n[:, None]):
            lengths = n.to(torch.int64)
        else:
            keys = pad.reshape(batch_size, 1, 1, kv_length)
    return AttentionMask(causal, window, q_offset, kv_offset, (batch_size, 1, q_length, kv_length),
                         lengths, keys, kwargs.get("device", "cpu"), segments)


# --------------------------------------------------------------------------------------
# The attention function

class _Recorder:
    """What :func:`attention_stats` collects (one per `with` block)."""

    def __init__(self) -> None:
        self.calls: List[Tuple[int, Any]] = []


_recording = threading.local()


def _recorder() -> Optional[_Recorder]:
    return getattr(_recording, "current", None)


def _positions(m: AttentionMask, Lq: int, Lk: int) -> Optional[str]:
    """The causal code of fastattn.torch's ops that equals the mask's positions, or None."""
    d = m.q_offset - m.kv_offset
    if d == Lk - Lq:
        return "bottom-right"
    if d == 0:
        return "top-left"
    return None


def _dense(m: AttentionMask, B: int, Lq: int, Lk: int, device) -> Tensor:
    """The mask as a (B or 1, 1, Lq, Lk) bool tensor (the rare training call whose
    positions neither causal convention has)."""
    i = torch.arange(Lq, device=device)[:, None] + m.q_offset
    j = torch.arange(Lk, device=device)[None, :] + m.kv_offset
    vis = torch.ones(Lq, Lk, dtype=torch.bool, device=device)
    if m.causal:
        vis &= j <= i
        if m.window is not None:
            vis &= j > i - m.window
    vis = vis[None, None]
    if m.segments is not None:
        vis = vis & (m.segments[:, :, None] == m.segments[:, None, :])[:, None]
    if m.keys is not None:
        vis = vis & m.keys
    if m.lengths is not None:
        vis = vis & (torch.arange(Lk, device=device) < m.lengths[:, None])[:, None, None, :]
    return vis


def attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: Any, dropout: float = 0.0, scaling: Optional[float] = None,
                      softcap: Optional[float] = None, s_aux: Optional[Tensor] = None,
                      is_causal: Optional[bool] = None, **kwargs: Any) -> Tuple[Tensor, None]:
    """Compute one attention layer for transformers' ``"fastattn"`` implementation.

    Registered in transformers' ``AttentionInterface`` under ``"fastattn"``; the
    model's attention modules call it.  Inference (no gradient, no dropout) runs
    :func:`fastattn.torch.attention` on the tensors' memory (the KV cache read in
    place; packed sequences through :func:`fastattn.varlen_attention`); training
    runs :func:`fastattn.torch.scaled_dot_product_attention`.

    Parameters
    ----------
    module : torch.nn.Module
        The calling attention module (its ``is_causal`` and ``layer_idx`` are read).
    query : Tensor, shape (B, Hq, Lq, D)
        Queries as the attention modules pass them (views).
    key : Tensor, shape (B, Hkv, Lk, D)
        Keys; Hkv may divide Hq (read without ``repeat_kv``).
    value : Tensor, shape (B, Hkv, Lk, Dv)
        Values.
    attention_mask : AttentionMask or Tensor or None
        What :func:`attention_mask` built (an :class:`AttentionMask`, a 4-D bool mask,
        or None), or a 4-D mask the caller passed (bool: True means attend; float:
        added to the logits).
    dropout : float, default 0.0
        Attention dropout, applied when > 0 (fastattn's draws, not PyTorch's).
    scaling : float, optional
        Multiplies the logits; default ``1 / sqrt(D)``.
    softcap : float, optional
        Logit soft-capping (Gemma 2).
    s_aux : Tensor, shape (Hq,), optional
        Attention sinks (gpt-oss), fastattn's `sinks`.
    is_causal : bool, optional
        Used only when `attention_mask` is None, with SDPA's rule (causal top-left
        when Lq > 1); default ``module.is_causal``.
    **kwargs
        Other arguments of transformers' attention functions, ignored.

    Returns
    -------
    out : Tensor, shape (B, Lq, Hq, Dv)
        The attention output, in the query's dtype.
    weights : None
        Always None: fastattn computes no weight matrix.

    Raises
    ------
    TypeError
        If `attention_mask` is not a tensor, None or an :class:`AttentionMask`.

    See Also
    --------
    attention_mask : The mask builder registered with it.
    attention_stats : Record each call's row statistics.

    Examples
    --------
    >>> import torch
    >>> import fastattn.transformers
    >>> q = torch.randn(1, 4, 3, 8)
    >>> kv = torch.randn(1, 2, 3, 8)
    >>> layer = torch.nn.Module()
    >>> out, weights = fastattn.transformers.attention_forward(layer, q, kv, kv, None,
    ...                                                        is_causal=True)
    >>> out.shape, weights
    (torch.Size([1, 3, 4, 8]), None)
    """
    B, Hq, Lq, _ = query.shape
    Lk = key.shape[-2]
    kw: Dict[str, Any] = {n: x for n, x in (("scale", scaling), ("softcap", softcap))
                          if x is not None}
    m = attention_mask
    cache = getattr(key, "_fastattn_cache", None)
    if cache is not None:  # the keys of a fastattn.transformers.KVCache layer
        return _cache_forward(module, query, cache, m, dropout, kw, s_aux, is_causal), None
    causal: Any = False
    mask = bias = offsets = lengths = segments = None
    if isinstance(m, AttentionMask):
        causal, lengths, mask, segments = m.causal, m.lengths, m.keys, m.segments
        if m.window is not None:
            kw["window"] = (m.window - 1, 0)
        if causal:
            offsets = (m.q_offset, m.kv_offset)
    elif m is None:
        c = is_causal if is_causal is not None else getattr(module, "is_causal", False)
        causal = "top-left" if (c and Lq > 1) else False
    elif isinstance(m, Tensor):
        if m.dtype == torch.bool:
            mask = m
        else:
            bias = m
    else:
        raise TypeError(f"fastattn.transformers: attention_mask must be a tensor, None or a "
                        f"fastattn.transformers.AttentionMask, got {type(m).__name__}")
    sinks = s_aux
    rec = _recorder()
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, sinks, bias))
    nth = _torch_ops._threads(query.numel() * Lk * 2)
    if segments is not None and (grad or dropout or rec is not None):
        # packed sequences with gradients, dropout or stats: the dense mask (the ops
        # and return_stats have no varlen form)
        assert isinstance(m, AttentionMask)
        mask, causal, offsets, segments = _dense(m, B, Lq, Lk, query.device), False, None, None
        kw.pop("window", None)
    if not grad and not dropout:
        if segments is not None:
            return _packed(query, key, value, segments, causal, kw, sinks, nth), None
        # inference: fastattn.attention on the tensors' memory (the cache in place)
        args: Dict[str, Any] = dict(kw, causal=causal, mask=mask, bias=bias, sinks=sinks,
                                    seqlens_k=lengths, num_threads=nth)
        if offsets is not None:
            args["q_offset"], args["k_offset"] = offsets
        args = {n: x for n, x in args.items() if x is not None and x is not False}
        res = _ft.attention(query, key, value, return_stats=rec is not None, **args)
        if rec is not None:
            out, stats = res
            rec.calls.append((getattr(module, "layer_idx", None), stats))
        else:
            out = res
        return out.transpose(1, 2), None
    # training: the registered ops (autograd, dropout, the sinks' gradient)
    if lengths is not None:
        mask = (torch.arange(Lk, device=query.device) < lengths[:, None])[:, None, None, :]
    if offsets is not None:
        assert isinstance(m, AttentionMask)
        code = _positions(m, Lq, Lk)
        if code is None:
            mask, causal = _dense(m, B, Lq, Lk, query.device), False
            kw.pop("window", None)
        else:
            causal = code
    attn = bias if bias is not None else mask
    out = _ft.scaled_dot_product_attention(
        query, key, value, attn_mask=attn, dropout_p=float(dropout), enable_gqa=True,
        causal=causal if causal else None, sinks=sinks, **kw)
    if rec is not None:  # the stats from one more pass, without gradients
        with torch.no_grad():
            _, stats = _ft.attention(query.detach(), key.detach(), value.detach(),
                                     return_stats=True, **_stats_args(kw, causal, attn, sinks))
        rec.calls.append((getattr(module, "layer_idx", None), stats))
    return out.transpose(1, 2), None


def _cache_forward(module: torch.nn.Module, query: Tensor, cache: "fastattn.KVCache", m: Any,
                   dropout: float, kw: Dict[str, Any], sinks: Optional[Tensor],
                   is_causal: Optional[bool]) -> Tensor:
    """attention_forward over a fastattn.KVCache layer: the queries are each slot's last
    Lq tokens (bottom-right), the mask's padding part covers the cached keys."""
    if torch.is_grad_enabled() and query.requires_grad or dropout:
        raise ValueError("fastattn.transformers.KVCache is for inference: no gradients, no "
                         "attention dropout (run under torch.no_grad(), the model in eval mode)")
    Lk = int(cache.lengths.max())
    mask = bias = None
    if isinstance(m, AttentionMask):
        if m.segments is not None:
            raise ValueError("fastattn.transformers.KVCache does not take packed sequences")
        causal = m.causal
        if m.window is not None:
            kw["window"] = (m.window - 1, 0)
        if m.keys is not None:
            mask = m.keys[..., -Lk:] if m.keys.shape[-1] >= Lk else None
        elif m.lengths is not None:
            mask = (torch.arange(Lk, device=query.device) < m.lengths[:, None])[:, None, None, :]
    elif m is None:
        c = is_causal if is_causal is not None else getattr(module, "is_causal", False)
        causal = bool(c)
    elif isinstance(m, Tensor):
        if m.dtype == torch.bool:
            mask = m[..., -Lk:]
        else:
            bias = m[..., -Lk:]
        causal = False
    else:
        raise TypeError(f"fastattn.transformers: attention_mask must be a tensor, None or a "
                        f"fastattn.transformers.AttentionMask, got {type(m).__name__}")
    args = {n: x for n, x in dict(kw, mask=mask, bias=bias, sinks=sinks).items() if x is not None}
    nth = _torch_ops._threads(query.numel() * Lk * 2)
    rec = _recorder()
    res = _ft.attention(query, cache, causal=causal, num_threads=nth, return_stats=rec is not None, **args)
    if rec is not None:
        res, stats = res
        rec.calls.append((getattr(module, "layer_idx", None), stats))
    return res.transpose(1, 2)


class _CacheLayer(transformers.cache_utils.CacheLayerMixin):
    """One model layer's fastattn.KVCache, made at the layer's first update (its batch,
    heads and head sizes from the first key and value states)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, capacity: int, dtype: str, block_size: Optional[int]) -> None:
        super().__init__()
        self.capacity, self.cache_dtype, self.block_size = capacity, dtype, block_size
        self.cache: Optional[fastattn.KVCache] = None

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        B, H, _, D = key_states.shape
        self.cache = fastattn.KVCache(B, H, D, self.capacity, dtype=self.cache_dtype,
                                      v_head_dim=value_states.shape[-1], block_size=self.block_size)
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any,
               **kwargs: Any) -> Tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.cache is not None
        self.cache.append(key_states, value_states)
        B, H, _, D = key_states.shape
        L = int(self.cache.lengths.max())
        # stand-ins of the layer's keys and values (B, H, L, D): NaN (any attention but
        # fastattn's would give NaN, not a plausible wrong answer), no memory of their
        # own, carrying the cache to attention_forward
        refs = []
        for width in (D, value_states.shape[-1]):
            t = torch.full((1, 1, 1, 1), float("nan"), dtype=key_states.dtype).expand(B, H, L, width)
            t._fastattn_cache = self.cache
            refs.append(t)
        return refs[0], refs[1]

    def get_mask_sizes(self, query_length: int) -> Tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return int(self.cache.lengths.max()) if self.cache is not None else 0

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        if self.cache is not None:
            self.cache.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("fastattn.transformers.KVCache does not reorder (beam search); "
                                  "use it with greedy or sampled decoding")

    def offload(self) -> None:  # (a CPU cache: nothing to move)
        return None

    def prefetch(self) -> None:
        return None


class KVCache(transformers.cache_utils.Cache):
    """A transformers ``Cache`` whose layers are :class:`fastattn.KVCache` objects.

    Pass it to ``generate(..., past_key_values=cache)`` (or a forward call) of a model
    loaded with ``attn_implementation="fastattn"`` (see :func:`register`): each layer's
    keys and values are appended into a :class:`fastattn.KVCache` (keys on the SIMD
    lanes, float32, float16, bfloat16, int8 or int4), quantized on the way in, and
    attention reads it in place.  No layer's cache is ever re-concatenated or copied.

    Parameters
    ----------
    capacity : int
        Tokens each sequence can hold (prompt and generated tokens).
    dtype : {"float32", "float16", "bfloat16", "int8", "int4"}, optional
        What each layer stores (default "float32"); see :class:`fastattn.KVCache`.
    block_size : int, optional
        Tokens per key block (see :class:`fastattn.KVCache`).

    Notes
    -----
    For inference only (no gradients), with greedy or sampled decoding (no beam
    search: the cache does not reorder).  The layers are made at the model's first
    forward, from its key and value states.  The tensors a layer's ``update`` returns
    are stand-ins (NaN, no memory of their own) that only fastattn's attention reads:
    any other ``attn_implementation`` would give NaN, never a quiet wrong answer.

    Examples
    --------
    >>> import torch, transformers
    >>> import fastattn.transformers
    >>> fastattn.transformers.register()
    >>> cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...                                num_hidden_layers=2, num_attention_heads=4,
    ...                                num_key_value_heads=2)
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> model = transformers.LlamaForCausalLM(cfg).eval()
    >>> model.config._attn_implementation = "fastattn"
    >>> ids = torch.tensor([[1, 5, 9, 3]])
    >>> cache = fastattn.transformers.KVCache(capacity=64)
    >>> out = model.generate(ids, past_key_values=cache, max_new_tokens=5, do_sample=False)
    >>> out.shape, cache.get_seq_length()
    (torch.Size([1, 9]), 8)
    """

    def __init__(self, capacity: int, *, dtype: str = "float32", block_size: Optional[int] = None) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"fastattn.transformers.KVCache: capacity must be an int >= 1, got {capacity!r}")
        fastattn.KVCache(1, 1, 1, 1, dtype=dtype, block_size=block_size)  # (checks dtype, block_size)
        self.capacity, self.cache_dtype, self.block_size = capacity, dtype, block_size
        super().__init__(layer_class_to_replicate=lambda: _CacheLayer(capacity, dtype, block_size))

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's cache."""
        return sum(layer.cache.nbytes for layer in self.layers
                   if isinstance(layer, _CacheLayer) and layer.cache is not None)


def _packed(query: Tensor, key: Tensor, value: Tensor, segments: Tensor, causal: bool,
            kw: Dict[str, Any], sinks: Optional[Tensor], nth: int) -> Tensor:
    """Packed sequences (inference): fastattn.varlen_attention over the batch flattened
    into one run of sequences; returns (B, L, Hq, Dv)."""
    B, Hq, L, _ = query.shape
    seg = segments.to(torch.int64)
    # numbers distinct across the batch rows, so that no sequence spans two rows
    ids = (seg + torch.arange(B)[:, None] * (int(seg.max() - seg.min()) + 1)).reshape(-1)
    starts = torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1
    cu = torch.cat([starts.new_zeros(1), starts, starts.new_full((1,), B * L)]).numpy()
    dt = query.dtype
    flat = []
    for t in (query, key, value):  # (B, H, L, D) -> (B * L, H, D): a view of the projections
        t = t.transpose(1, 2).reshape(B * L, t.shape[1], t.shape[-1])
        flat.append(_torch_ops._np(t if dt in (torch.float32, torch.float64) else t.float()))
    out = fastattn.varlen_attention(*flat, cu, cu, causal=causal, num_threads=nth,
                                    sinks=None if sinks is None else _torch_ops._np(sinks), **kw)
    return torch.from_numpy(out).to(dt).reshape(B, L, Hq, out.shape[-1])


def _stats_args(kw, causal, attn, sinks) -> Dict[str, Any]:
    args = {n: x for n, x in kw.items() if x is not None}
    if causal:
        args["causal"] = "top-left" if causal == "top-left" else True
    if attn is not None:
        args["mask" if attn.dtype == torch.bool else "bias"] = attn
    if sinks is not None:
        args["sinks"] = sinks.detach()
    return args


# --------------------------------------------------------------------------------------
# Per-layer statistics

class LayerStats:
    """The row statistics :func:`attention_stats` recorded.

    Attributes
    ----------
    calls : list of tuple
        ``(layer_idx, fastattn.AttentionStats)`` for each call, in call order.

    See Also
    --------
    attention_stats : The context manager that fills it.
    fastattn.AttentionStats : One call's statistics.

    Notes
    -----
    The array properties join each layer's calls along the query axis (a forward
    pass: one call a layer; ``generate()``: the prefill and then one row a step),
    layers in index order.  Rows are those of the distribution over the keys (and the
    sink, with sinks); a row that sees nothing has 0 in all three.  Reading one raises
    ``ValueError`` if no call was recorded.
    """

    def __init__(self) -> None:
        self.calls: List[Tuple[Any, Any]] = []

    def _stacked(self, field: str) -> np.ndarray:
        if not self.calls:
            raise ValueError("fastattn.transformers.attention_stats: no attention call was "
                             "recorded (is the model's attn_implementation 'fastattn'?)")
        layers: Dict[Any, List[np.ndarray]] = {}
        for idx, st in self.calls:
            layers.setdefault(idx, []).append(np.asarray(getattr(st, field)))
        order = sorted(layers, key=lambda i: (i is None, i))
        return np.stack([np.concatenate(layers[i], axis=-1) for i in order])

    @property
    def layers(self) -> List[Any]:
        """The recorded layers' ``layer_idx`` values, sorted (None last)."""
        return sorted({i for i, _ in self.calls}, key=lambda i: (i is None, i))

    @property
    def entropy(self) -> np.ndarray:
        """Row entropies (nats), an ndarray (layers, B, Hq, Lq_total)."""
        return self._stacked("entropy")

    @property
    def effective_support(self) -> np.ndarray:
        """Effective supports ``exp(entropy)``, an ndarray (layers, B, Hq, Lq_total)."""
        return self._stacked("effective_support")

    @property
    def max_weight(self) -> np.ndarray:
        """Each row's largest weight, an ndarray (layers, B, Hq, Lq_total)."""
        return self._stacked("max_weight")


@contextlib.contextmanager
def attention_stats() -> Iterator[LayerStats]:
    """Record the row statistics of every ``"fastattn"`` attention call in this thread.

    A context manager; the statistics of calls made inside the block are in the
    :class:`LayerStats` it yields.  Blocks nest: the innermost one records.

    Yields
    ------
    LayerStats
        Filled as the calls run; read its arrays after the forward pass.

    See Also
    --------
    fastattn.attention : Its ``return_stats`` gives the statistics of one call.

    Notes
    -----
    The stats come from the kernel's ``return_stats`` in the same pass (inference) or
    one more pass without gradients (training): no L x L weights at any length.

    Examples
    --------
    >>> import torch
    >>> import transformers
    >>> import fastattn.transformers
    >>> cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...                                num_hidden_layers=2, num_attention_heads=4,
    ...                                num_key_value_heads=2)
    >>> model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="fastattn")
    >>> with torch.no_grad(), fastattn.transformers.attention_stats() as st:
    ...     _ = model(torch.tensor([[1, 2, 3, 4, 5]]))
    >>> st.layers, st.entropy.shape
    ([0, 1], (2, 1, 4, 5))
    >>> float(st.entropy[0, 0, 0, 0])  # the first token sees only itself
    0.0
    """
    rec = LayerStats()
    before = _recorder()
    _recording.current = rec
    try:
        yield rec
    finally:
        _recording.current = before


def register(name: str = NAME) -> None:
    """Register fastattn's attention and mask functions with transformers.

    Importing :mod:`fastattn.transformers` registers them under ``"fastattn"``;
    call it to register them under another name too.

    Parameters
    ----------
    name : str, default "fastattn"
        The ``attn_implementation`` name.

    Raises
    ------
    ValueError
        If `name` contains "flash" or "/" (transformers reads such names as
        FlashAttention requests or Hub kernels).

    Examples
    --------
    >>> import transformers
    >>> import fastattn.transformers
    >>> fastattn.transformers.register("fastattn-cpu")
    >>> "fastattn-cpu" in transformers.AttentionInterface()
    True
    """
    if "flash" in name or "/" in name:
        raise ValueError(f"fastattn.transformers.register: transformers reads a name with "
                         f"'flash' or '/' as another backend, got {name!r}")
    transformers.AttentionInterface.register(name, attention_forward)
    transformers.AttentionMaskInterface.register(name, attention_mask)


register()
