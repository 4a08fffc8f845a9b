"""fastattn's public entry points (merge and varlen_attention are in fastattn._varlen):
what each passes to the kernel (layout and strides, dtype, thread count, the output
arrays).  The arguments are parsed and
checked by fastattn._args (what every function shares) and fastattn._checks (each
function's own); the maths is in C (src_c/), reached through fastattn._kernels."""

from __future__ import annotations

from typing import Any, Literal, NamedTuple, Tuple, Union, overload

import numpy as np

from . import _kernels
from ._args import F32, Problem, bf16, is_bf16, as_array, fresh, in_place, parse_flag, parse_threads
from ._cache import Source, kv_source
from ._kvcache import _DECODE_ROWS, KVCache
from ._checks import backward_flags, check_out, grad_inputs
from ._typing import Array, ArrayLike, Causal, FloatArray, Layout, Window

__all__ = ["attention", "attention_backward", "attention_weights", "key_mass", "AttentionStats",
           "attention_block"]


class AttentionStats(NamedTuple):
    """Per-row statistics of the attention weights, from ``attention(..., return_stats=True)``.

    Each field has shape ``(..., Hq, Lq)``, like lse, whatever the layout: float64 for
    float64 inputs, else float32.  They are computed in the forward's single pass, with
    one more accumulator and no ``Lq x Lk`` weights.

    Parameters
    ----------
    entropy : ndarray
        ``H = -sum_j p_j log p_j`` in nats, computed in the online pass as
        ``H = log l - sum_j e^(s_j - m) (s_j - m) / l``: 0 at a vertex of the simplex
        (one key takes all the weight), ``log n`` at its centre (n keys weighted
        equally).
    effective_support : ndarray
        ``exp(H)``: how many keys the row really uses, from 1 to n.
    max_weight : ndarray
        The row's largest weight, ``exp(max_j s_j - lse)``.

    See Also
    --------
    attention : Returns these with ``return_stats=True``.
    fastattn.reference.attention_stats : The same statistics in float64 NumPy.

    Notes
    -----
    A row that sees no key has 0 in all three fields: it has no weights, and 0 keeps
    means over rows finite.  With dropout the statistics describe the weights before
    dropout, like lse.  With `sinks` the distribution includes the sink: its weight
    counts in the entropy and the largest weight.

    Examples
    --------
    >>> import numpy as np
    >>> import fastattn
    >>> q = np.zeros((1, 4, 16), np.float32)         # every logit 0: uniform weights
    >>> k = v = np.ones((1, 8, 16), np.float32)
    >>> out, stats = fastattn.attention(q, k, v, return_stats=True)
    >>> stats.effective_support                      # all 8 keys used equally
    array([[8., 8., 8., 8.]], dtype=float32)
    >>> bool(np.allclose(stats.entropy, np.log(8)))
    True
    """
    entropy: Any
    effective_support: Any
    max_weight: Any


def _stats(entropy, max_weight, lse):
    none = np.isneginf(lse)
    support = np.exp(entropy)
    support[none] = 0
    return AttentionStats(entropy, support, max_weight)

@overload
def attention(q: ArrayLike, k: Any, v: ArrayLike | None = None, *, scale: float | None = ...,
              causal: Causal = ..., window: Window = ..., mask: ArrayLike | None = ...,
              bias: ArrayLike | None = ..., alibi_slopes: ArrayLike | None = ...,
              softcap: float | None = ..., dropout_p: float = ..., seed: int | None = ...,
              sinks: ArrayLike | None = ...,
              seqlens_k: ArrayLike | None = ..., q_offset: int | None = ...,
              k_offset: int | None = ..., block_table: ArrayLike | None = ...,
              layout: Layout = ..., return_lse: Literal[False] = ...,
              return_stats: Literal[False] = ...,
              out: Array | None = ..., num_threads: int | None = ...) -> FloatArray: ...


@overload
def attention(q: ArrayLike, k: Any, v: ArrayLike | None = None, *, scale: float | None = ...,
              causal: Causal = ..., window: Window = ..., mask: ArrayLike | None = ...,
              bias: ArrayLike | None = ..., alibi_slopes: ArrayLike | None = ...,
              softcap: float | None = ..., dropout_p: float = ..., seed: int | None = ...,
              sinks: ArrayLike | None = ...,
              seqlens_k: ArrayLike | None = ..., q_offset: int | None = ...,
              k_offset: int | None = ..., block_table: ArrayLike | None = ...,
              layout: Layout = ..., return_lse: Literal[True],
              return_stats: Literal[False] = ...,
              out: Array | None = ..., num_threads: int | None = ...
              ) -> Tuple[FloatArray, FloatArray]: ...


@overload
def attention(q: ArrayLike, k: Any, v: ArrayLike | None = None, *, scale: float | None = ...,
              causal: Causal = ..., window: Window = ..., mask: ArrayLike | None = ...,
              bias: ArrayLike | None = ..., alibi_slopes: ArrayLike | None = ...,
              softcap: float | None = ..., dropout_p: float = ..., seed: int | None = ...,
              sinks: ArrayLike | None = ...,
              seqlens_k: ArrayLike | None = ..., q_offset: int | None = ...,
              k_offset: int | None = ..., block_table: ArrayLike | None = ...,
              layout: Layout = ..., return_lse: bool = ...,
              return_stats: bool = ...,
              out: Array | None = ..., num_threads: int | None = ...
              ) -> Union[FloatArray, Tuple[Any, ...]]: ...


def attention(q: ArrayLike, k: Any, v: ArrayLike | None = None, *, scale: float | None = None,
              causal: Causal = False, window: Window = None, mask: ArrayLike | None = None,
              bias: ArrayLike | None = None, alibi_slopes: ArrayLike | None = None,
              softcap: float | None = None, dropout_p: float = 0.0, seed: int | None = None,
              sinks: ArrayLike | None = None,
              seqlens_k: ArrayLike | None = None, q_offset: int | None = None,
              k_offset: int | None = None, block_table: ArrayLike | None = None,
              layout: Layout = "bhsd", return_lse: bool = False,
              return_stats: bool = False,
              out: Array | None = None, num_threads: int | None = None
              ) -> Union[FloatArray, Tuple[Any, ...]]:
    """Exact scaled dot-product attention, ``softmax(scale * q @ k^T + ...) @ v``.

    Computed by a blocked online softmax (the FlashAttention-2 loop) in C, parallel over
    OpenMP threads by (batch, head group, query block), with SIMD kernels chosen for this
    CPU at import.  Extra memory is O(block size) per thread: the ``Lq x Lk`` logits are
    never formed, and broadcast masks and biases are never expanded.

    Parameters
    ----------
    q : array_like, shape (Lq, D), (Hq, Lq, D) or (B, Hq, Lq, D)
        Queries (with ``layout="bshd"``: (Lq, Hq, D) or (B, Lq, Hq, D)).  float32 or
        float64; float16 or bfloat16 (``ml_dtypes.bfloat16``) with k and v of the same
        type.
    k : array_like, QuantizedKV or KVCache, shape (Lk, D), (Hkv, Lk, D) or (B, Hkv, Lk, D)
        Keys, of q's ndim and layout.  Their dtype is q's, or, for a KV cache read at
        fewer bytes, float16 or bfloat16 under a float32 q (converted to float32 in
        registers; everything accumulates in float32).  ``Hq`` must be a multiple of
        ``Hkv``: query head ``h`` reads key/value head ``h // (Hq // Hkv)``
        (grouped-query and multi-query attention, without copying k or v).  An int8
        cache is a :class:`QuantizedKV` (k and v both), read in place and dequantized
        a tile at a time: the result has the bits of attention over
        ``dequantize_kv(k)`` and ``dequantize_kv(v)``, and q may then be float32,
        float16 or bfloat16 (computed in float32, output in q's dtype).
        A :class:`KVCache` holds both keys and values (omit `v`): q, of shape
        ``(batch, Hq, Lq, head_dim)``, holds the queries of each slot's last ``Lq``
        tokens (bottom-right), each slot attends over its ``cache.lengths[b]`` keys
        (`mask` and `bias` then cover ``Lk = max(cache.lengths)`` keys, slot b's first
        ``lengths[b]``), and q may be float32, float16 or bfloat16 (with an int8 or
        int4 cache computed in float32, output in q's dtype; with a float16 or bfloat16
        cache float32 or the cache's type).  Every variant applies; not with
        `seqlens_k`, `block_table`, `q_offset`, `k_offset` or ``layout='bshd'``.
    v : array_like or QuantizedKV, shape (Lk, Dv), (Hkv, Lk, Dv) or (B, Hkv, Lk, Dv)
        Values, of k's dtype, ndim and layout; ``Dv`` may differ from ``D``.  Omitted
        when k is a :class:`KVCache`.
    scale : float, optional
        Multiplies ``q . k``; default ``1 / sqrt(D)``.  Any finite value: 0 gives the
        plain mean of the visible values, and negative values are allowed.
    causal : {False, True, 'bottom-right', 'top-left'}, optional
        ``True`` or ``'bottom-right'``: key ``j`` is visible to query ``i`` iff
        ``j <= i + (Lk - Lq)`` (the last query sees the last key, as when decoding
        against a cache).  ``'top-left'``: ``j <= i`` (PyTorch's ``is_causal``).
    window : tuple of (int or None, int or None), optional
        Sliding window ``(left, right)``: key ``j`` is visible iff
        ``a - left <= j <= a + right``, where ``a = i + (Lk - Lq)``, or ``a = i`` with
        ``causal='top-left'``.  ``None`` or -1 on a side means unbounded (``(-1, -1)``
        is no window, as in FlashAttention).  Combines with `causal` (both must allow
        a key).  Key blocks outside the band are never read, so the work is
        proportional to the visible keys.
    mask : array_like of bool, optional
        True = attend.  Broadcastable (right-aligned) to the logits' shape
        ``(B, Hq, Lq, Lk)`` (of the inputs' ndim) whatever the layout; broadcast axes
        are read with stride 0, and key tiles the mask hides from every row of a block
        are skipped.
    bias : array_like of float, optional
        Added to the logits; broadcastable like `mask`.  ``-inf`` hides a key.
    alibi_slopes : array_like, shape (Hq,) or (B, Hq), optional
        ALiBi: the logit loses ``slope[b, h] * |i + Lk - Lq - j|``, computed in the
        kernel.
    softcap : float, optional
        Logit soft-capping, ``s = softcap * tanh(s / softcap)`` after the scale and
        before ALiBi and the bias; finite and > 0.
    dropout_p : float, optional
        Attention dropout, in [0, 1): each weight is kept with probability
        ``1 - dropout_p`` and divided by it, or set to 0; lse stays that of the
        undropped softmax (as in FlashAttention).  The decision for (batch b, head h,
        query i, key j) is a function of ``(seed, b, h, i, j)`` alone
        (Philox-4x32-10, :func:`fastattn.reference.dropout_keep`), so it does not
        depend on threads or blocks, and :func:`attention_backward` with the same seed
        drops the same weights without storing them.
    seed : int, optional
        The dropout seed, in [0, 2**64); required when ``dropout_p > 0``.
    sinks : array_like of float, shape (Hq,), optional
        Attention sinks (gpt-oss; the learned form of StreamingLLM's): one logit per
        query head, not scaled, that joins every row's softmax as a key whose value is
        zero, so ``p_ij = exp(s_ij) / (exp(sinks[h]) + sum_j exp(s_ij))`` and a row's
        weights over the keys sum to less than 1.  lse includes it; a row that sees no
        key gives 0 and ``lse = sinks[h]``.  ``-inf`` means no sink for that head.
    seqlens_k : array_like of int, shape (B,), optional
        Per-sequence key lengths (FlashAttention's ``cache_seqlens``): sequence ``b``
        sees keys ``[0, seqlens_k[b])`` of its preallocated k and v, and causal,
        window and ALiBi align to that length.  Batched decoding of requests at
        different positions then needs no mask and reads only each request's keys.
        Entries in ``[0, Lk]``; 0 gives zero rows with lse -inf.
    q_offset, k_offset : int, optional
        Where the queries and keys sit in a longer sequence: query ``i`` at position
        ``q_offset + i``, key ``j`` at ``k_offset + j`` (a missing one is 0).  The
        diagonal is then ``a = q_offset + i - k_offset`` instead of the one the lengths
        give: causal hides the keys past it, the window is around it, and ALiBi
        measures ``|a - j|``.  For chunked prefill and for key chunks combined by
        :func:`merge`.  Not with ``causal='top-left'``.  With `seqlens_k`, sequence
        ``b`` still sees only keys below ``seqlens_k[b]``.  Dropout uses the call's own
        indices ``i, j``, not the positions.  Integers within ``+-2**53``.
    block_table : array_like of int, shape (B, max_blocks), optional
        A paged KV cache (vLLM's layout): k and v are pools of pages, shape
        ``(num_blocks, block_size, Hkv, D)`` and ``(num_blocks, block_size, Hkv, Dv)``
        (float arrays, or QuantizedKV of such data), q is 4-D, and key ``j`` of sequence
        ``b`` is row ``j % block_size`` of page ``block_table[b, j // block_size]``.
        Each sequence has ``max_blocks * block_size`` keys, or its `seqlens_k`.  The
        entries a sequence's keys fill must be pages of the pool; the others are never
        read.  The result has the bits of the same keys in a contiguous cache.
    layout : {'bhsd', 'bshd'}, optional
        The axis order of q, k, v and the output: (batch, heads, sequence, features) or
        (batch, sequence, heads, features).  Any strides with a contiguous last axis are
        read in place (e.g. slices of a fused QKV projection).
    return_lse : bool, optional
        Also return lse, the log-sum-exp of each row's logits.
    return_stats : bool, optional
        Also return an :class:`AttentionStats` (each row's entropy, effective support
        and largest weight), computed in the same pass.
    out : ndarray, optional
        Where to write the output: its shape and q's dtype, a contiguous last axis, not
        overlapping the inputs.
    num_threads : int, optional
        Threads to use; default OpenMP's (``OMP_NUM_THREADS``, or threadpoolctl's
        limit).  The result has the same bits for any value.

    Returns
    -------
    out : ndarray
        Shape ``(..., Hq, Lq, Dv)`` (``(..., Lq, Hq, Dv)`` for ``'bshd'``), q's dtype.
    lse : ndarray
        With ``return_lse=True``: ``log(sum_j exp(s_ij))`` (natural log) over the
        visible keys, shape ``(..., Hq, Lq)`` in either layout (heads before the
        sequence, as :func:`merge` takes it); float64 for float64 inputs, else float32.
    stats : AttentionStats
        With ``return_stats=True``, last in the tuple.

    Raises
    ------
    TypeError
        If an argument has the wrong type or dtype (the message names it and the
        dtypes allowed).
    ValueError
        If shapes do not agree, or a value is out of range (a negative window side
        other than -1, ``dropout_p`` outside [0, 1), a block table entry outside the
        pool, ...).

    See Also
    --------
    fastattn.reference.attention : The float64 NumPy oracle of the same function.
    attention_backward : The gradients.
    attention_weights : The weights themselves.
    merge : Combines attentions over disjoint key sets.
    varlen_attention : Ragged batches packed on one axis.

    Notes
    -----
    The logits are built in this order: scale, softcap, ALiBi, bias; then the mask, the
    causal rule and the window hide keys.  A query row that sees no key gives an output
    row of zeros and lse -inf, whatever hid the keys.  Large logits (``|s|`` around 1e4)
    do not overflow.  Inputs that cannot be read in place (a non-contiguous last axis,
    misaligned data) are copied once.  The GIL is released while the kernel runs.

    Examples
    --------
    >>> import numpy as np
    >>> import fastattn
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 8, 128, 64), dtype=np.float32)
    >>> k = rng.standard_normal((2, 2, 128, 64), dtype=np.float32)  # 2 key/value heads
    >>> v = rng.standard_normal((2, 2, 128, 64), dtype=np.float32)
    >>> out, lse = fastattn.attention(q, k, v, causal=True, return_lse=True)
    >>> out.shape, lse.shape
    ((2, 8, 128, 64), (2, 8, 128))
    >>> ref = fastattn.reference.attention(q, k, v, causal=True)
    >>> bool(np.max(np.abs(out - ref)) < 1e-5)
    True

    One decoding step against a bfloat16 cache:

    >>> import ml_dtypes
    >>> kc, vc = k.astype(ml_dtypes.bfloat16), v.astype(ml_dtypes.bfloat16)
    >>> fastattn.attention(q[:, :, -1:], kc, vc, causal=True).shape
    (2, 8, 1, 64)
    """
    if isinstance(k, KVCache):
        return _cache_call(q, k, v, scale, causal, window, mask, bias, alibi_slopes, softcap,
                           dropout_p, seed, seqlens_k, layout, return_lse, return_stats, out,
                           num_threads, q_offset, k_offset, sinks, block_table)
    if v is None:
        raise TypeError("fastattn.attention: v is required (only a fastattn.KVCache as k holds "
                        "the values too)")
    # The common call is checked and run in compiled code (a short call must cost a few
    # microseconds); anything else, and every error, takes _attention.
    if (out is None and scale is None and (causal is False or causal is True)
            and (return_lse is False or return_lse is True)
            and window is None and mask is None and bias is None and alibi_slopes is None
            and softcap is None and sinks is None and layout == "bhsd"
            and type(dropout_p) in (float, int) and dropout_p == 0 and return_stats is False
            and seqlens_k is None and q_offset is None and k_offset is None and block_table is None
            and (num_threads is None or type(num_threads) is int and num_threads >= 1)):
        res = _kernels.attention_common(q, k, v, causal, return_lse, num_threads or 0)
        if res is not None:
            return res

    src = kv_source("attention", q, k, v, block_table, seqlens_k, layout)
    if src is not None:
        return cache_attention(src, q, scale, causal, window, mask, bias, alibi_slopes, softcap,
                               dropout_p, seed, seqlens_k, layout, return_lse, return_stats, out,
                               num_threads, (q_offset, k_offset, 0), sinks)
    return _attention(q, k, v, scale, causal, window, mask, bias, alibi_slopes, softcap, dropout_p,
                      seed, seqlens_k, layout, return_lse, return_stats, out, num_threads,
                      (q_offset, k_offset, 0), sinks)


def _cache_call(q, cache, v, scale, causal, window, mask, bias, alibi_slopes, softcap, dropout_p,
                seed, seqlens_k, layout, return_lse, return_stats, out, num_threads, q_offset,
                k_offset, sinks, block_table):
    """:func:`attention` with a :class:`KVCache` as k."""
    given = [name for name, val in (("v", v), ("seqlens_k", seqlens_k), ("block_table", block_table),
                                    ("q_offset", q_offset), ("k_offset", k_offset)) if val is not None]
    if given:
        raise TypeError(f"fastattn.attention: with a KVCache as k, {', '.join(given)} must not be "
                        "given (the cache holds the values, the lengths and the positions)")
    if layout != "bhsd":
        raise ValueError(f"fastattn.attention: with a KVCache, layout must be 'bhsd', got {layout!r}")
    if (scale is None and (causal is True or causal is False) and window is None and mask is None
            and bias is None and alibi_slopes is None and softcap is None and sinks is None
            and type(dropout_p) in (float, int) and dropout_p == 0 and return_lse is False
            and return_stats is False and out is None
            and (num_threads is None or type(num_threads) is int and num_threads >= 1)):
        res = cache._decode(q, causal, num_threads or 0)  # the common call, few checks
        if res is not None:
            return res
    src = cache._source(q, "attention")
    qa = as_array(q, "q")
    if qa.shape[2] * (qa.shape[1] // cache.kv_heads) > _DECODE_ROWS and qa.shape[1] % cache.kv_heads == 0:
        # prefill rows: over the cache's keys and values as rows (the same values, so
        # the bits of the decode rows), at the speed of user-held arrays
        k_rows, v_rows = cache._rows(int(cache.lengths.max()))
        quant = cache.dtype in ("int8", "int4")
        if quant and not (qa.dtype == F32 or qa.dtype == np.float16 or is_bf16(qa.dtype)):
            raise TypeError(f"fastattn.attention: with an {cache.dtype} KVCache q must be float32, "
                            f"float16 or bfloat16, got dtype {qa.dtype}")
        q32 = fresh(qa, F32) if quant and qa.dtype != F32 else qa
        res = attention(q32, k_rows, v_rows, scale=scale, causal=causal, window=window, mask=mask,
                        bias=bias, alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p,
                        seed=seed, sinks=sinks, seqlens_k=cache.lengths, return_lse=return_lse,
                        return_stats=return_stats, out=out if q32 is qa else None,
                        num_threads=num_threads)
        if q32 is qa:
            return res
        o = res[0] if isinstance(res, tuple) else res
        if out is not None:
            check_out(out, o.shape, qa.dtype, {"q": q})
            out[...] = o
            o16 = out
        else:
            o16 = o.astype(qa.dtype)
        return (o16,) + res[1:] if isinstance(res, tuple) else o16
    return cache_attention(src, q, scale, causal, window, mask, bias, alibi_slopes, softcap,
                           dropout_p, seed, cache.lengths, layout, return_lse, return_stats, out,
                           num_threads, (None, None, 0), sinks)


def attention_block(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, q_offset: int, k_offset: int,
                    alibi_shift: int = 0, scale: float | None = None, causal: Causal = False,
                    window: Window = None, mask: ArrayLike | None = None,
                    bias: ArrayLike | None = None, alibi_slopes: ArrayLike | None = None,
                    softcap: float | None = None, layout: Layout = "bhsd",
                    return_lse: bool = False, return_stats: bool = False,
                    num_threads: int | None = None) -> Union[FloatArray, Tuple[Any, ...]]:
    """fastattn.dask's entry (a documented internal): :func:`attention` with
    `q_offset` and `k_offset`, where ALiBi measures from the diagonal moved
    `alibi_shift` keys right of the causal one, ``|a + alibi_shift - j|``: a block of
    a problem whose causal convention is top-left passes that problem's ``Lk - Lq``
    (ALiBi aligns bottom-right whatever the convention, semantics 3)."""
    return _attention(q, k, v, scale, causal, window, mask, bias, alibi_slopes, softcap, 0.0,
                      None, None, layout, return_lse, return_stats, None, num_threads,
                      (q_offset, k_offset, alibi_shift))


def cache_attention(src, q, scale, causal, window, mask, bias, alibi_slopes, softcap, dropout_p,
                    seed, seqlens_k, layout, return_lse, return_stats, out, num_threads, positions,
                    sinks=None):
    """:func:`attention` over an int8 or paged cache (a fastattn._cache.Source): q of
    a 16-bit type with an int8 cache is computed in float32 and the output converted."""
    qa = as_array(q, "q")
    int8 = src.k.dtype.itemsize == 1
    if int8 and not (qa.dtype == F32 or qa.dtype == np.float16 or is_bf16(qa.dtype)):
        raise TypeError(f"fastattn.attention: with an int8 cache (QuantizedKV k and v) q must be "
                        f"float32, float16 or bfloat16, got dtype {qa.dtype}")
    if int8 and qa.dtype != F32:
        res = _attention(fresh(qa, F32), src, None, scale, causal, window, mask, bias,
                         alibi_slopes, softcap, dropout_p, seed, seqlens_k, layout, return_lse,
                         return_stats, None, num_threads, positions, sinks)
        o = res[0] if isinstance(res, tuple) else res
        if out is not None:
            check_out(out, o.shape, qa.dtype, {"q": q})
        o16 = o.astype(qa.dtype) if out is None else out
        if out is not None:
            out[...] = o
        return (o16,) + res[1:] if isinstance(res, tuple) else o16
    return _attention(qa, src, None, scale, causal, window, mask, bias, alibi_slopes, softcap,
                      dropout_p, seed, seqlens_k, layout, return_lse, return_stats, out,
                      num_threads, positions, sinks)


def _attention(q, k, v, scale, causal, window, mask, bias, alibi_slopes, softcap, dropout_p,
               seed, seqlens_k, layout, return_lse, return_stats, out, num_threads, positions,
               sinks=None):
    """:func:`attention` past its compiled fast path: every argument checked, the
    output allocated (or `out` checked), the kernel run, the results assembled.
    `positions` is ``(q_offset, k_offset, alibi_shift)``; `k` may be a cache's
    fastattn._cache.Source (`v` None), whose arrays the kernel reads."""
    fn = "attention"
    src = k if isinstance(k, Source) else None
    if src is not None:
        k, v = src.k_shape, src.v_shape
    pr = Problem(fn, as_array(q, "q"), as_array(k, "k"), as_array(v, "v"), layout)
    return_lse = parse_flag(return_lse, "return_lse", fn)
    return_stats = parse_flag(return_stats, "return_stats", fn)
    opt = pr.options(causal, scale, num_threads, window, mask, bias, alibi_slopes, softcap,
                     dropout_p, seed, seqlens_k, False, *positions, sinks=sinks)
    variants = opt.variants
    user_shape = pr.user(pr.q.shape[:-1] + (pr.v.shape[-1],))
    if out is None:
        out = np.empty(user_shape, dtype=pr.out_dtype)
    else:
        check_out(out, user_shape, pr.out_dtype,  # (a cache's own arrays, not its stand-ins)
                  {"q": q, "k": k if src is None else src.k, "v": v if src is None else src.v,
                   "mask": mask, "bias": bias})
    lse = np.empty(pr.q.shape[:-1], dtype=pr.lse_dtype) if return_lse or return_stats else None
    if return_stats:
        variants = variants or _kernels.Variants()
        variants.entropy, variants.max_weight = (np.zeros(pr.q.shape[:-1], pr.lse_dtype)
                                                 for _ in range(2))
    kk, vv = (pr.k, pr.v) if src is None else (src.k, src.v)
    if src is not None:
        variants = variants or _kernels.Variants()
        for name, value in src.fields.items():
            setattr(variants, name, value)
    if out.size or lse is not None and lse.size:
        _run(pr.q, kk, vv, pr.bhsd(out), lse, opt.scale, opt.causal, opt.threads, variants)
    parts: Tuple[Any, ...] = (out,) + ((lse,) if return_lse else ())
    if return_stats:
        parts += (_stats(variants.entropy, variants.max_weight, lse),)
    return parts[0] if len(parts) == 1 else parts


def _run(q, k, v, out, lse, scale, causal, nth, variants=None):
    """Call the kernel on (…, H, L, D) views, copying an input it cannot read in place."""
    if q.shape[-1] == 0 or v.shape[-1] == 0:
        _run_degenerate(q, k, v, out, lse, scale, causal, nth, variants)
    elif not _kernels.forward(q, k, v, out, lse, scale, causal, nth, 0, 0, variants):
        # an input the kernel cannot read in place (misaligned, a non-contiguous last
        # axis, strides that are not whole elements): one fresh contiguous copy of each
        _forward_copies(q, k, v, out, lse, scale, causal, nth, variants)


def _forward_copies(q, k, v, out, lse, scale, causal, nth, variants):
    q, k, v = (fresh(a) for a in (q, k, v))
    if not _kernels.forward(q, k, v, out, lse, scale, causal, nth, 0, 0, variants):
        raise RuntimeError("fastattn: the kernel cannot read fresh contiguous copies")  # a bug


def _run_degenerate(q, k, v, out, lse, scale, causal, nth, variants):
    """D = 0 (every logit q.k is 0) or Dv = 0 (nothing to write but lse): run the kernel
    on feature size 1 (zero q/k, or a zero value column) and keep what is asked."""
    if q.shape[-1] == 0:
        q, k = _column(q), _column(k)
    if v.shape[-1] == 0:
        v, out = _column(v), _column(out, make=np.empty)
    _run(q, k, v, out, lse, scale, causal, nth, variants)


def attention_weights(q: ArrayLike, k: ArrayLike, *, scale: float | None = None,
                      causal: Causal = False, window: Window = None,
                      mask: ArrayLike | None = None, bias: ArrayLike | None = None,
                      alibi_slopes: ArrayLike | None = None, softcap: float | None = None,
                      dropout_p: float = 0.0, seed: int | None = None,
                      seqlens_k: ArrayLike | None = None, q_offset: int | None = None,
                      k_offset: int | None = None, layout: Layout = "bhsd",
                      num_threads: int | None = None, sinks: ArrayLike | None = None) -> FloatArray:
    """The exact attention weights ``softmax(logits)``, shape ``(..., Hq, Lq, Lk)``.

    Computed by the same logits code as :func:`attention`, with the same arguments and
    meaning, to see what each query reads: each row lies on the probability simplex
    (entries >= 0 that sum to 1), and a row that sees no key is all 0.  The memory is
    ``Lq x Lk`` by nature.

    Parameters
    ----------
    q, k : array_like
        Queries and keys as :func:`attention` takes them (no values are needed);
        float32, float64, float16 or bfloat16 in :func:`attention`'s combinations.
    scale, causal, window, mask, bias, alibi_slopes, softcap : optional
        As in :func:`attention`.
    dropout_p, seed : optional
        As in :func:`attention`: with ``dropout_p > 0`` these are the weights
        :func:`attention` multiplies v by for the same seed (kept weights divided by
        ``1 - dropout_p``, dropped ones 0), so rows no longer sum to 1.
    seqlens_k, q_offset, k_offset, layout, num_threads : optional
        As in :func:`attention`.
    sinks : array_like of float, shape (Hq,), optional
        As in :func:`attention`: the weights are those over the keys, and each row
        sums to 1 minus its sink's weight.

    Returns
    -------
    weights : ndarray
        Shape ``(..., Hq, Lq, Lk)`` whatever the layout; float64 for float64 inputs,
        else float32.

    Raises
    ------
    TypeError, ValueError
        As :func:`attention` raises them.

    See Also
    --------
    attention : The output these weights give.
    fastattn.reference.attention_weights : The float64 NumPy oracle.
    fastattn.geometry : The weights as points of a simplex.

    Examples
    --------
    >>> import numpy as np
    >>> import fastattn
    >>> rng = np.random.default_rng(0)
    >>> q, k = (rng.standard_normal((4, 8), dtype=np.float32) for _ in range(2))
    >>> w = fastattn.attention_weights(q, k, causal=True)
    >>> w.shape
    (4, 4)
    >>> bool(np.allclose(w.sum(axis=-1), 1)), float(w[0, 1])   # row 0 sees key 0 only
    (True, 0.0)
    """
    fn = "attention_weights"
    pr = Problem(fn, as_array(q, "q", fn), as_array(k, "k", fn), None, layout)
    opt = pr.options(causal, scale, num_threads, window, mask, bias, alibi_slopes, softcap,
                     dropout_p, seed, seqlens_k, q_offset=q_offset, k_offset=k_offset,
                     sinks=sinks)
    va = opt.variants
    # keys past a sequence's seqlens_k are never visited: their weights are the zeros here
    weights = (np.zeros if seqlens_k is not None else np.empty)(pr.logits_shape, dtype=pr.dtype)
    if weights.size == 0:
        return weights
    va.weights = weights.reshape((1,) * (4 - pr.nd) + pr.logits_shape)
    qk, kk = (_column(pr.q), _column(pr.k)) if pr.D == 0 else (pr.q, pr.k)
    unused_out = np.empty((1, 1, 1, 1), pr.out_dtype)  # the kernel writes only the weights
    if not _kernels.forward(qk, kk, kk, unused_out, None, opt.scale, opt.causal, opt.threads,
                            0, 0, va):
        _forward_copies(qk, kk, kk, unused_out, None, opt.scale, opt.causal, opt.threads, va)
    return weights


def _column(a, dtype=None, make=np.zeros):
    """A (..., 1) array of `make` (zeros, or np.empty) standing in for `a` (..., X), in
    `dtype` (default a's): the kernel runs on feature size 1 where X = 0 (a zero
    feature makes every logit q.k 0; a zero value column adds nothing)."""
    return make(a.shape[:-1] + (1,), a.dtype if dtype is None else dtype)


def _sum_to(g, shape):
    """g summed over the axes along which an array of `shape` was broadcast to g's shape."""
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape)
                                      if n == 1 and g.shape[lead + i] != 1)
    return g.sum(axis=axes).reshape(shape) if axes else g


@overload
def attention_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike, out: ArrayLike,
                       lse: ArrayLike, *, scale: float | None = ..., causal: Causal = ...,
                       window: Window = ..., mask: ArrayLike | None = ...,
                       bias: ArrayLike | None = ..., alibi_slopes: ArrayLike | None = ...,
                       softcap: float | None = ..., dropout_p: float = ..., seed: int | None = ...,
                       seqlens_k: ArrayLike | None = ..., q_offset: int | None = ...,
                       k_offset: int | None = ..., layout: Layout = ..., return_dbias: Literal[False] = ...,
                       num_threads: int | None = ..., sinks: ArrayLike | None = ...,
                       return_dsinks: Literal[False] = ...
                       ) -> Tuple[FloatArray, FloatArray, FloatArray]: ...


@overload
def attention_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike, out: ArrayLike,
                       lse: ArrayLike, *, scale: float | None = ..., causal: Causal = ...,
                       window: Window = ..., mask: ArrayLike | None = ...,
                       bias: ArrayLike | None = ..., alibi_slopes: ArrayLike | None = ...,
                       softcap: float | None = ..., dropout_p: float = ..., seed: int | None = ...,
                       seqlens_k: ArrayLike | None = ..., q_offset: int | None = ...,
                       k_offset: int | None = ..., layout: Layout = ..., return_dbias: Literal[True],
                       num_threads: int | None = ..., sinks: ArrayLike | None = ...,
                       return_dsinks: Literal[False] = ...
                       ) -> Tuple[FloatArray, FloatArray, FloatArray, FloatArray]: ...


@overload
def attention_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike, out: ArrayLike,
                       lse: ArrayLike, *, scale: float | None = ..., causal: Causal = ...,
                       window: Window = ..., mask: ArrayLike | None = ...,
                       bias: ArrayLike | None = ..., alibi_slopes: ArrayLike | None = ...,
                       softcap: float | None = ..., dropout_p: float = ..., seed: int | None = ...,
                       seqlens_k: ArrayLike | None = ..., q_offset: int | None = ...,
                       k_offset: int | None = ..., layout: Layout = ..., return_dbias: bool = ...,
                       num_threads: int | None = ..., sinks: ArrayLike | None = ...,
                       return_dsinks: bool = ...
                       ) -> Tuple[FloatArray, ...]: ...


def attention_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike, out: ArrayLike,
                       lse: ArrayLike, *, scale: float | None = None, causal: Causal = False,
                       window: Window = None, mask: ArrayLike | None = None,
                       bias: ArrayLike | None = None, alibi_slopes: ArrayLike | None = None,
                       softcap: float | None = None, dropout_p: float = 0.0,
                       seed: int | None = None, seqlens_k: ArrayLike | None = None,
                       q_offset: int | None = None, k_offset: int | None = None,
                       layout: Layout = "bhsd", return_dbias: bool = False, num_threads: int | None = None,
                       sinks: ArrayLike | None = None, return_dsinks: bool = False
                       ) -> Tuple[FloatArray, ...]:
    """Gradients of :func:`attention`, given ``dout``, the gradient of a loss with respect to its output.

    `out` and `lse` must be what ``attention(q, k, v, ..., return_lse=True)`` returned
    for the same arguments: the backward recomputes the weights from lse instead of
    storing them (FlashAttention-2's scheme).  Every keyword has :func:`attention`'s
    meaning and must have the value the forward call had; the same `seed` drops the same
    weights.

    Parameters
    ----------
    dout : array_like
        The gradient with respect to `out`, of out's shape; any float dtype
        (converted to the compute dtype, float64 for float64 inputs, else float32).
    q, k, v : array_like
        The forward's inputs, in any layout and strides :func:`attention` takes.  One
        float dtype, float32 or float64; or bfloat16 (``ml_dtypes.bfloat16``): all
        three, or k and v under a float32 q.  float16 inputs have no gradients (a
        float16 cache is for inference), nor has an int8 or paged cache.
    out : array_like
        The forward's output (any float dtype, converted like `dout`).
    lse : array_like
        The forward's lse, shape ``(..., Hq, Lq)``.
    scale, causal, window, mask, bias, alibi_slopes, softcap : optional
        As in :func:`attention`.
    dropout_p, seed : optional
        As in :func:`attention`: the same values give the same dropped weights.
    seqlens_k, q_offset, k_offset, layout : optional
        As in :func:`attention`.
    return_dbias : bool, optional
        Also return ``dbias`` (needs `bias`): the gradient of the logits summed over
        the axes along which the bias was broadcast, in the bias's own shape.
        Computing it materializes one ``(B, Hq, Lq, Lk)`` array.
    num_threads : int, optional
        As in :func:`attention`; the result has the same bits for any value.
    sinks : array_like of float, shape (Hq,), optional
        The forward's sinks (its lse includes them).
    return_dsinks : bool, optional
        Also return ``dsinks`` (needs `sinks`), shape ``(Hq,)``, float64 for float64
        inputs, else float32: ``-sum_{b,i} exp(sinks[h] - lse) * sum_c dout * out``,
        summed in float64.

    Returns
    -------
    dq, dk, dv : ndarray
        The shapes and layouts of q, k and v, each in its input's dtype.  With
        grouped-query attention dk and dv are summed over the query heads that read
        each key/value head.
    dbias : ndarray
        With ``return_dbias=True``, the bias's shape.
    dsinks : ndarray
        With ``return_dsinks=True``, last in the tuple.

    Raises
    ------
    TypeError
        If q, k and v have no gradients here (float16, an int8 cache), their dtypes do
        not combine, or dout, out or lse is not a float array.
    ValueError
        If a shape disagrees with the forward's (out, lse, dout), or an argument is out
        of range as in :func:`attention`.

    See Also
    --------
    attention : The forward.
    fastattn.reference.attention_backward : The float64 NumPy oracle.
    fastattn.torch.scaled_dot_product_attention : The same gradients through autograd.

    Notes
    -----
    Computed in C by FlashAttention-2's backward, parallel over (batch, head, key block)
    for dk and dv and over (batch, head, query block) for dq, so one head uses every
    thread; there are no atomics.  Extra memory is O(B Hq Lq) plus per-thread scratch:
    the weights are never stored (except the one array for dbias).  ALiBi slopes, masks
    and the window get no gradient.  With bfloat16 q, k and v the products take
    bfloat16 pairs where a bfloat16 path runs (``show_config()`` says which), and each
    gradient is rounded to bfloat16 from its float32 sum.

    Examples
    --------
    >>> import numpy as np
    >>> import fastattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 32, 16)) for _ in range(3))
    >>> out, lse = fastattn.attention(q, k, v, causal=True, return_lse=True)
    >>> dout = np.ones_like(out)
    >>> dq, dk, dv = fastattn.attention_backward(dout, q, k, v, out, lse, causal=True)
    >>> ref = fastattn.reference.attention_backward(dout, q, k, v, out, lse, causal=True)
    >>> all(np.allclose(a, b) for a, b in zip((dq, dk, dv), ref))
    True
    """
    fn = "attention_backward"
    qa_, ka_, va_ = as_array(q, "q", fn), as_array(k, "k", fn), as_array(v, "v", fn)
    pr = Problem(fn, qa_, ka_, va_, layout)  # the shapes and dtypes, checked once
    kw = dict(scale=scale, causal=causal, window=window, mask=mask, bias=bias,
              alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p, seed=seed,
              seqlens_k=seqlens_k, q_offset=q_offset, k_offset=k_offset, layout=layout,
              return_dbias=return_dbias, num_threads=num_threads, sinks=sinks,
              return_dsinks=return_dsinks)
    BF16 = bf16()
    if BF16 is not None and BF16 in (qa_.dtype, ka_.dtype, va_.dtype):
        # bfloat16: the float32 backward on float32 copies (exact), each gradient rounded
        # to its input's dtype; with q, k and v all bfloat16, its products take bfloat16
        # pairs where a bfloat16 path runs (semantics.md section 9), else float32
        pairs = qa_.dtype == ka_.dtype == va_.dtype == BF16
        # all three bfloat16 (and no empty feature axis): the kernel rounds each gradient
        # itself, into bfloat16 arrays (the same bits as rounding float32 ones here)
        g16 = pairs and pr.D > 0 and pr.v.shape[-1] > 0
        # the float32 copies on the call's threads (dout and out: grad_inputs, the same)
        nth = parse_threads(num_threads, fn)
        grads = _backward(fn, dout, fresh(qa_, F32, nth), fresh(ka_, F32, nth), fresh(va_, F32, nth), out, lse,
                          bf16=pairs, pr=None, grad_dt=BF16 if g16 else None, **kw)
        if g16:
            return grads
        return tuple(g.astype(x.dtype) for g, x in zip(grads, (qa_, ka_, va_))) + grads[3:]
    return _backward(fn, dout, qa_, ka_, va_, out, lse, bf16=False, pr=pr, **kw)


def _backward(fn, dout, qa_, ka_, va_, out, lse, *, scale, causal, window, mask, bias,
              alibi_slopes, softcap, dropout_p, seed, seqlens_k, q_offset, k_offset, layout,
              return_dbias, num_threads, sinks, return_dsinks, bf16, pr, grad_dt=None):
    """attention_backward on checked arrays (pr: their Problem, or None to make it); bf16:
    q, k, v hold bfloat16 values (the products may take bfloat16 pairs); grad_dt:
    bfloat16 to have the kernel write dq, dk, dv rounded to it (with bf16, D, Dv > 0)."""
    if pr is None:
        pr = Problem(fn, qa_, ka_, va_, layout)
    return_dbias = backward_flags(pr, return_dbias, bias)
    return_dsinks = parse_flag(return_dsinks, "return_dsinks", fn)
    if return_dsinks and sinks is None:
        raise ValueError(f"fastattn.{fn}: return_dsinks=True needs the forward's sinks")
    dt = pr.dtype
    opt = pr.options(causal, scale, num_threads, window, mask, bias, alibi_slopes, softcap,
                     dropout_p, seed, seqlens_k, q_offset=q_offset, k_offset=k_offset,
                     sinks=sinks)
    dout_a, out_a, lse_a = grad_inputs(pr, dout, out, lse, opt.threads)
    gdt = dt if grad_dt is None else grad_dt
    dq = np.empty(pr.user(pr.q.shape), gdt)
    dk = np.empty(pr.user(pr.k.shape), gdt)
    dv = np.empty(pr.user(pr.v.shape), gdt)
    ds = np.zeros(pr.logits_shape, dt) if return_dbias else None
    qa, ka, vv = pr.q, pr.k, pr.v
    dqa, dka, dva = pr.bhsd(dq), pr.bhsd(dk), pr.bhsd(dv)
    if pr.D == 0:  # every logit q.k is 0: run on one zero feature, keep dv
        qa, ka = _column(qa, dt), _column(ka, dt)
        dqa, dka = _column(qa, make=np.empty), _column(ka, make=np.empty)
    if pr.v.shape[-1] == 0:  # nothing flows back through an empty value
        vv, dout_a, out_a = (_column(a, dt) for a in (vv, dout_a, out_a))
        dva = np.empty(vv.shape, dt)
    qa, ka, vv = (in_place(a, dt) for a in (qa, ka, vv))
    if dq.size + dk.size + dv.size or ds is not None:
        _kernels.backward(qa, ka, vv, out_a, lse_a, dout_a, dqa, dka, dva,
                          None if ds is None else ds.reshape((1,) * (4 - pr.nd) + pr.logits_shape),
                          opt.scale, opt.causal, opt.threads, 0, 0, opt.variants, 0, int(bf16))
    grads: Tuple[Any, ...] = (dq, dk, dv)
    if ds is not None:
        grads += (_sum_to(ds, as_array(bias, "bias", fn).shape),)
    if return_dsinks:
        grads += (_dsinks(opt.variants.sinks, lse_a, dout_a, out_a),)
    return grads


def _dsinks(sk, lse, dout, out):
    """The sinks' gradient: -sum over (b, i) of exp(sink_h - lse) * (dout . out), in
    float64, returned in the sinks' (compute) dtype; a head without a sink gets 0."""
    hq = sk.shape[0]
    col = sk.astype(np.float64).reshape(hq, 1)
    with np.errstate(invalid="ignore", over="ignore"):
        w = np.where(np.isneginf(col), 0.0, np.exp(col - lse))
    d = np.einsum("...c,...c->...", dout, out, dtype=np.float64)
    g = w * d  # (..., Hq, Lq); (1, Lq) for 2-D inputs
    return (-g.sum(axis=tuple(i for i in range(g.ndim) if i != g.ndim - 2))).astype(sk.dtype)


def key_mass(q: ArrayLike, k: ArrayLike, *, scale: float | None = None, causal: Causal = False,
             window: Window = None, mask: ArrayLike | None = None, bias: ArrayLike | None = None,
             alibi_slopes: ArrayLike | None = None, softcap: float | None = None,
             seqlens_k: ArrayLike | None = None, q_offset: int | None = None,
             k_offset: int | None = None, layout: Layout = "bhsd",
             num_threads: int | None = None, sinks: ArrayLike | None = None) -> FloatArray:
    """For each key, the total weight the queries of each head give it.

    ``mass[..., h, j] = sum_i p_hij``: the mass each value receives in the weighted sums
    of all the rows, a heavy-hitter score (as in H2O or SnapKV) for evicting keys from a
    KV cache.  Computed without the weights, in two passes: the forward's lse, then a
    pass over (key/value head, key chunk) items that recomputes each weight as
    ``exp(s - lse)`` and adds the query rows in order.

    Parameters
    ----------
    q, k : array_like
        Queries and keys as :func:`attention` takes them (no values are needed);
        float32, float64, float16 or bfloat16 in :func:`attention`'s combinations
        (16-bit inputs are computed in float32).
    scale, causal, window, mask, bias, alibi_slopes, softcap : optional
        As in :func:`attention`.
    seqlens_k, q_offset, k_offset, layout, num_threads : optional
        As in :func:`attention`.
    sinks : array_like of float, shape (Hq,), optional
        As in :func:`attention`; the sink's share is in no key's mass.

    Returns
    -------
    mass : ndarray
        Shape ``(..., Hq, Lk)`` in either layout; float64 for float64 inputs, else
        float32.  The masses of a head sum to the number of its rows that see at least
        one key.

    Raises
    ------
    TypeError, ValueError
        As :func:`attention` raises them.

    See Also
    --------
    fastattn.reference.key_mass : The float64 NumPy oracle.

    Notes
    -----
    The weights are those before any dropout.  The memory is O(L), and the result has
    the same bits for any thread count.

    Examples
    --------
    >>> import numpy as np
    >>> import fastattn
    >>> rng = np.random.default_rng(0)
    >>> q, k = (rng.standard_normal((2, 16, 8)) for _ in range(2))
    >>> m = fastattn.key_mass(q, k, causal=True)
    >>> m.shape, m.sum(axis=-1)
    ((2, 16), array([16., 16.]))
    """
    fn = "key_mass"
    pr = Problem(fn, as_array(q, "q", fn), as_array(k, "k", fn), None, layout)
    opt = pr.options(causal, scale, num_threads, window, mask, bias, alibi_slopes, softcap,
                     seqlens_k=seqlens_k, q_offset=q_offset, k_offset=k_offset, sinks=sinks)
    dt = pr.dtype
    qa, ka = (_column(pr.q, dt), _column(pr.k, dt)) if pr.D == 0 else (pr.q, pr.k)
    qa, ka = (in_place(a, dt) for a in (qa, ka))  # 16-bit inputs: float32 copies
    mass = np.empty(pr.logits_shape[:-2] + (pr.Lk,), dt)
    if mass.size == 0:
        return mass
    lse = np.empty(qa.shape[:-1], dt)
    v0 = _column(ka, dt)   # the forward for lse only: one zero value column
    out0 = _column(qa, dt, np.empty)
    _run(qa, ka, v0, out0, lse, opt.scale, opt.causal, opt.threads, opt.variants)
    _kernels.key_mass(qa, ka, lse, mass.reshape((pr.B, pr.Hq, pr.Lk)), opt.scale, opt.causal,
                      opt.threads, opt.variants)
    return mass
