"""Exact attention over dask arrays, on one machine or a cluster.

``fastattn.dask.attention(q, k, v, ...)`` takes the arguments of
:func:`fastattn.attention` as ``dask.array`` arrays (NumPy arrays are wrapped as one
chunk) and returns dask arrays.  Attention splits exactly:

- chunks along the batch and head axes are independent problems (one-to-one);
- chunks along the query axis are independent (each query row sees all keys);
- chunks along the key axis give partial ``(out, lse)`` pairs over disjoint key
  sets, combined by their log-sum-exp with :func:`fastattn.merge` in a fixed tree
  (``split_every`` parts per merge, in key order), so the bits do not depend on the
  number of workers, threads or the order in which tasks ran.

Each (query chunk, key chunk) block is a task of one :func:`fastattn.attention` call
(one per kv head when q's head chunks split a GQA group, one per stretch of sequences
with ``seqlens_k``) whose ``causal``, ``window`` and ALiBi are re-expressed in the
block's own coordinates (``fastattn._blocks.plan_block``), so every logit is the one the whole
problem defines.  Blocks that causal/window hide entirely are never put in the graph.

Requires the extra ``pip install "fastattn[dask]"`` (``dask[array]``,
``distributed`` for a cluster).
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import numpy as np

try:
    import dask.array as da
    from dask.base import tokenize
    from dask.highlevelgraph import HighLevelGraph
except ImportError as _exc:  # pragma: no cover - exercised only without dask
    raise ImportError(
        "fastattn.dask needs dask with its array extra (and distributed to run on a "
        "cluster): pip install \"fastattn[dask]\" (that is: pip install \"dask[array]\" "
        f"distributed); original error: {_exc}") from None

import fastattn
from . import _args
from ._api import attention_block as _attention_block
from ._blocks import Plan as _Plan, kv_partition as _kv_partition, plan_block as _plan_block, \
    starts as _starts, tree as _tree

__all__ = ["attention"]

_FN = "dask.attention"
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)


# ---------------------------------------------------------------------------------
# Tasks (run on the workers)
# ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Call:
    """What a block task needs besides its arrays (static, pickled into the graph).

    runs: (b0, b1, plan) over the block's batch entries: one run for the whole batch
    chunk, or, with seqlens_k, one per stretch of sequences that share a plan (None:
    those sequences see no key of this block)."""
    runs: Tuple[Tuple[int, int, Optional[_Plan]], ...]
    stats: bool
    layout: str
    nd: int
    scale: Optional[float]
    softcap: Optional[float]
    slopes: Optional[np.ndarray]   # this block's (Hb,) or (Bb, Hb) slopes, compute dtype
    groups: Optional[Tuple[Tuple[int, int, int], ...]]  # (qh0, qh1, g) per kernel call
    upcast: bool                   # 16-bit q: run on float32 q (a float32 partial)
    num_threads: int
    cdt: np.dtype                  # compute dtype (bias dtype)
    ldt: np.dtype                  # lse dtype


def _heads_axis(layout: str, nd: int) -> int:
    return (nd - 2 if layout == "bshd" else nd - 3) if nd > 2 else -1


def _one_call(q, k, v, mask, bias, slopes, p: _Plan, call: _Call):
    kk = p.keys
    kax = -2 if (call.layout == "bhsd" or call.nd == 2) else -3
    if kk != k.shape[kax]:
        sl = (Ellipsis, slice(0, kk)) + (slice(None),) * (-kax - 1)
        k, v = k[sl], v[sl]
        if mask is not None and mask.shape[-1] != 1:
            mask = mask[..., :kk]
        if bias is not None and bias.shape[-1] != 1:
            bias = bias[..., :kk]
    if call.upcast:
        q = q.astype(np.float32)
    kw = dict(scale=call.scale, causal=p.causal, window=p.window, mask=mask, bias=bias,
              alibi_slopes=slopes, softcap=call.softcap, layout=call.layout, return_lse=True,
              return_stats=call.stats, num_threads=call.num_threads)
    if p.positions is None:
        res = fastattn.attention(q, k, v, **kw)
    else:
        q_off, k_off, shift = p.positions
        res = _attention_block(q, k, v, q_offset=q_off, k_offset=k_off, alibi_shift=shift, **kw)
    if call.stats:
        out, lse, st = res
        return out, lse, st.entropy, st.max_weight
    return res


def _take(a, axis, start, stop):
    """a[start:stop] along `axis` (negative: from the end); a itself when a is None,
    has no such axis, or is broadcast (size 1) along it."""
    if a is None:
        return None
    ax = axis if axis >= 0 else a.ndim + axis
    if ax < 0 or ax >= a.ndim or a.shape[ax] == 1:
        return a
    idx = [slice(None)] * a.ndim
    idx[ax] = slice(start, stop)
    return a[tuple(idx)]


def _empty_part(q, k, v, call: _Call):
    """The (out, lse[, entropy, max_weight]) of rows that see no key of this block."""
    shape = q.shape[:-1] + (v.shape[-1],)
    swap = call.nd > 2 and call.layout == "bshd"
    lshape = q.shape[:-3] + (q.shape[-2], q.shape[-3]) if swap else q.shape[:-1]
    return _fill_task(shape, np.float32 if call.upcast else q.dtype, lshape, call.ldt,
                      call.stats)


def _concat(parts, axes):
    return tuple(np.concatenate([p[i] for p in parts], axis=ax) if len(parts) > 1
                 else parts[0][i] for i, ax in enumerate(axes))


def _heads_calls(q, k, v, mask, bias, slopes, plan, call: _Call):
    """One call, or with q heads that do not start and end on kv-group boundaries one
    call per kv head."""
    if call.groups is None:
        return _one_call(q, k, v, mask, bias, slopes, plan, call)
    hax = _heads_axis(call.layout, call.nd)
    lhax = -3  # heads axis of mask/bias in logits order (they have the inputs' ndim)
    parts = []
    for qh0, qh1, g in call.groups:
        parts.append(_one_call(
            _take(q, hax, qh0, qh1), _take(k, hax, g, g + 1), _take(v, hax, g, g + 1),
            _take(mask, lhax, qh0, qh1), _take(bias, lhax, qh0, qh1),
            None if slopes is None else slopes[..., qh0:qh1], plan, call))
    return _concat(parts, (hax,) + (call.nd - 3,) * (len(parts[0]) - 1))


def _block_task(q, ks, vs, mask, bias, call: _Call):
    """One (query chunk, key chunk) block: (out, lse[, entropy, max_weight]) over the
    block's keys."""
    hax = _heads_axis(call.layout, call.nd)
    k = ks[0] if len(ks) == 1 else np.concatenate(ks, axis=hax)
    v = vs[0] if len(vs) == 1 else np.concatenate(vs, axis=hax)
    if len(call.runs) == 1:
        b0, b1, plan = call.runs[0]
        if plan is None:  # pragma: no cover - such blocks are not scheduled
            return _empty_part(q, k, v, call)
        return _heads_calls(q, k, v, mask, bias, call.slopes, plan, call)
    parts = []  # seqlens_k: stretches of sequences (batch axis 0 of 4-D inputs)
    for b0, b1, plan in call.runs:
        qb, kb, vb = (_take(x, 0, b0, b1) for x in (q, k, v))
        if plan is None:
            parts.append(_empty_part(qb, kb, vb, call))
            continue
        sl = call.slopes
        if sl is not None and sl.ndim == 2:
            sl = sl[b0:b1]
        parts.append(_heads_calls(qb, kb, vb, _take(mask, 0, b0, b1), _take(bias, 0, b0, b1),
                                  sl, plan, call))
    return _concat(parts, (0,) * len(parts[0]))


def _merge_task(parts, layout, final_dtype):
    out, lse = fastattn.merge([p[0] for p in parts], [p[1] for p in parts], layout=layout)
    if final_dtype is not None:
        out = out.astype(final_dtype)
    if len(parts[0]) == 2:
        return out, lse
    return (out, lse) + _merge_stats(parts, lse)


def _merge_stats(parts, lse):
    """Entropy and largest weight of the merged rows from the parts' (lse, entropy,
    max_weight), in float64: with a_p = exp(lse_p - lse) the share of part p,
    H = lse - sum_p a_p (lse_p - H_p) (each part's sum_j w_j s_j is lse_p - H_p) and
    max_weight = max_p a_p max_weight_p.  Rows that see no key: 0 and 0."""
    L = np.stack([np.asarray(p[1], np.float64) for p in parts])
    H = np.stack([np.asarray(p[2], np.float64) for p in parts])
    M = np.stack([np.asarray(p[3], np.float64) for p in parts])
    total = np.asarray(lse, np.float64)
    seen = np.isfinite(L)
    with np.errstate(invalid="ignore", over="ignore"):
        a = np.where(seen, np.exp(np.where(seen, L, 0.0) - total), 0.0)
        ent = total - np.sum(np.where(seen, a * (np.where(seen, L, 0.0) - H), 0.0), axis=0)
        mw = np.max(a * M, axis=0)
    none = ~np.isfinite(total)
    ent[none] = 0.0
    mw[none] = 0.0
    return ent.astype(lse.dtype), mw.astype(lse.dtype)


def _support_task(part):
    """effective_support = exp(entropy), 0 for rows that see no key."""
    lse, ent = part[1], part[2]
    sup = np.exp(ent)
    sup[np.isneginf(lse)] = 0
    return sup


def _identity(part):
    return part


def _cast_task(part, dtype):
    return (part[0].astype(dtype),) + tuple(part[1:])


def _fill_task(out_shape, out_dtype, lse_shape, lse_dtype, stats):
    """A block whose rows see no key: output 0, lse -inf (semantics 7), stats 0."""
    part = (np.zeros(out_shape, out_dtype), np.full(lse_shape, -np.inf, lse_dtype))
    if stats:
        part += (np.zeros(lse_shape, lse_dtype), np.zeros(lse_shape, lse_dtype))
    return part


# ---------------------------------------------------------------------------------
# The public function
# ---------------------------------------------------------------------------------

def _as_dask(x, name):
    if isinstance(x, da.Array):
        return x
    if hasattr(x, "__dask_graph__"):
        raise TypeError(f"fastattn.{_FN}: {name} is a {type(x).__name__}; pass a dask.array "
                        "Array (or a NumPy array)")
    a = _args.as_array(x, name, _FN)
    return da.from_array(a, chunks=a.shape if a.ndim else (), name=False)


def _check_chunks(x, name):
    for ax, c in enumerate(x.chunks):
        if any(isinstance(n, float) and math.isnan(n) for n in c):
            raise ValueError(f"fastattn.{_FN}: {name} has unknown chunk sizes along axis {ax} "
                             f"(chunks {x.chunks}); call {name}.compute_chunk_sizes() first")


def _dummy(shape, dtype):
    """A zero-memory stand-in with this shape and dtype, for the argument checks."""
    return np.broadcast_to(np.zeros((), dtype), tuple(int(n) for n in shape))


def _small(x, name):
    """alibi_slopes: a small array, brought to the client if it is a dask array."""
    if x is None:
        return None
    if isinstance(x, da.Array):
        x = x.compute()
    return _args.as_array(x, name, _FN)


def attention(q, k, v, *, scale: float | None = None, causal=False, window=None, mask=None,
              bias=None, alibi_slopes=None, softcap: float | None = None,
              dropout_p: float = 0.0, seed: int | None = None, seqlens_k=None,
              layout: str = "bhsd", return_lse: bool = False, return_stats: bool = False,
              out=None, num_threads: int | None = None, split_every: int = 4):
    """Exact attention over dask arrays: :func:`fastattn.attention`, split into blocks.

    Parameters
    ----------
    q, k, v : dask.array.Array or numpy.ndarray
        Shapes, dtypes and layouts as for :func:`fastattn.attention` (float32,
        float64, float16 K/V with float32 or float16 q, bfloat16 via ``ml_dtypes``;
        not the int8 :class:`fastattn.QuantizedKV` cache, which raises TypeError:
        pass ``fastattn.dequantize_kv(k)``).  NumPy arrays are wrapped as one chunk
        each.  Chunks:

        - the feature axes (D, Dv) must be one chunk each (a ValueError otherwise);
        - q's chunks along batch, heads and queries define the output's chunks;
        - k's chunks along the key axis define the key split; v is rechunked to k's
          key chunks;
        - k and v are rechunked to q's batch chunks, and along heads so that the kv
          heads each q head chunk reads (``h // (Hq // Hkv)``) form whole chunks:
          one-to-one when q's head chunk boundaries are multiples of ``Hq // Hkv``.
    scale : float, optional
        As for :func:`fastattn.attention`; default ``1 / sqrt(D)``.
    causal : {False, True, 'bottom-right', 'top-left'}, default False
        As for :func:`fastattn.attention`.  Causal, window and ALiBi align on the
        whole problem's ``Lq`` and ``Lk``.
    window : tuple of (int or None, int or None), optional
        As for :func:`fastattn.attention`.
    mask, bias : dask.array.Array or numpy.ndarray, optional
        As for :func:`fastattn.attention` (broadcastable to ``(B, Hq, Lq, Lk)`` of
        the inputs' ndim); rechunked to the logits' blocks along their full-size axes
        (q's batch, head and query chunks, k's key chunks); broadcast axes stay
        size 1 and are never expanded.
    alibi_slopes : array, shape (Hq,) or (B, Hq), optional
        Small; a dask array is computed when the graph is built.
    softcap : float, optional
        As for :func:`fastattn.attention`.
    dropout_p : float, default 0.0
        Must be 0.  Dropout's keep decisions are keyed by positions within one call;
        the blocks' calls have no way to key them by global positions, so
        ``dropout_p > 0`` raises NotImplementedError.
    seed : int, optional
        Checked as :func:`fastattn.attention` checks it; unused, as there is no
        dropout.
    seqlens_k : int array (B,), optional
        As for :func:`fastattn.attention` (sequence b sees keys [0, seqlens_k[b]),
        causal/window/ALiBi aligned to that length); known when the graph is built
        (a dask array is computed), so key chunks past a sequence's length are not
        scheduled for it.
    layout : {"bhsd", "bshd"}, default "bhsd"
        As for :func:`fastattn.attention`.
    return_lse : bool, default False
        Also return the lse as a dask array ``(..., Hq, Lq)`` (chunked like q's
        batch, head and query axes).
    return_stats : bool, default False
        Also return a :class:`fastattn.AttentionStats` of dask arrays shaped like the
        lse: the blocks' entropies and largest weights are merged across key chunks
        exactly (``H = lse - sum_p a_p (lse_p - H_p)``, ``a_p = exp(lse_p - lse)``),
        in float64.
    out : None
        Must be None (a TypeError otherwise): dask arrays are immutable; store
        results with ``dask.array.store``.
    num_threads : int, optional
        OpenMP threads of each block's call; default 1 (run one worker thread per core
        and let dask spread the blocks).  The bits do not depend on it.
    split_every : int, default 4
        Partial results merged per task of the key reduction tree, >= 2.

    Returns
    -------
    out : dask.array.Array
        The attention output: q's shape with the last axis Dv, in q's dtype,
        chunked like q along the batch, head and query axes.
    lse : dask.array.Array
        The log-sum-exp ``(..., Hq, Lq)``, only with ``return_lse=True``.
    stats : fastattn.AttentionStats
        The row statistics, only with ``return_stats=True``: its fields are dask
        arrays shaped like the lse.

    Raises
    ------
    TypeError
        If an input is not a dask or NumPy array (a QuantizedKV among them), `out`
        is given, or as :func:`fastattn.attention` raises.
    ValueError
        If a feature axis is split into several chunks, chunk sizes are unknown,
        `split_every` is not an int >= 2, or as :func:`fastattn.attention` raises.
    NotImplementedError
        If ``dropout_p > 0``.

    See Also
    --------
    fastattn.attention : The call each block runs.
    fastattn.merge : How the key chunks' partial results combine.

    Notes
    -----
    Deterministic: for given chunks the bits are the same whatever the scheduler,
    workers, threads or task order (the blocks' calls are deterministic and the
    merge tree is fixed).  With k and v in one chunk along the key axis the output
    and lse equal :func:`fastattn.attention`'s bitwise (fastattn's batch invariance:
    a row's bits do not depend on which rows share its call), whatever the batch,
    head and query chunks; with key chunks they agree within rounding (float32:
    ~1e-7 relative).  Blocks that causal/window hide entirely are not in the graph.

    Each block task holds its q chunk, its K and V chunks and one output chunk (plus
    a chunk of the user's mask or bias).  A block's call is told where its queries
    and keys sit in the whole problem (``q_offset``/``k_offset``), so the kernel
    applies causal, the window and ALiBi as it does on the whole problem: no mask or
    bias is made for them.

    Examples
    --------
    Queries in chunks of 32 rows, keys in chunks of 16, on the synchronous scheduler
    (a ``distributed.Client`` runs the same graph on a cluster):

    >>> import numpy as np
    >>> import dask.array as da
    >>> import fastattn
    >>> import fastattn.dask
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 4, 64, 16)).astype(np.float32)
    >>> kv = rng.standard_normal((2, 2, 64, 16)).astype(np.float32)
    >>> out = fastattn.dask.attention(da.from_array(q, chunks=(1, 4, 32, 16)),
    ...                               da.from_array(kv, chunks=(1, 2, 16, 16)),
    ...                               da.from_array(kv, chunks=(1, 2, 16, 16)), causal=True)
    >>> out.chunks
    ((1, 1), (4,), (32, 32), (16,))
    >>> ref = fastattn.attention(q, kv, kv, causal=True)
    >>> bool(np.allclose(out.compute(scheduler="sync"), ref, atol=1e-6))
    True
    """
    c = _check_args(q, k, v, scale, causal, window, mask, bias, alibi_slopes, softcap,
                    dropout_p, seed, seqlens_k, layout, return_lse, return_stats, out,
                    num_threads, split_every)
    return _Graph(c, layout, scale, softcap, split_every).arrays()


@dataclass
class _Checked:
    """dask.attention's arguments after fastattn.attention's checks (run on zero-memory
    stand-ins of the same shapes): the arrays as dask arrays, the options parsed."""
    q: Any
    k: Any
    v: Any
    mask: Any                   # dask arrays (None when not given)
    bias: Any
    pr: _args.Problem           # the stand-ins' Problem: sizes, dtypes, layout
    return_lse: bool
    return_stats: bool
    causal: int                 # 0 none, 1 bottom-right, 2 top-left
    threads: int
    slopes: Optional[np.ndarray]
    seqlens: Optional[np.ndarray]  # int64 (B,) or None
    wl: int                     # the window's sides, -1 = unbounded
    wr: int


def _check_args(q, k, v, scale, causal, window, mask, bias, alibi_slopes, softcap, dropout_p,
                seed, seqlens_k, layout, return_lse, return_stats, out, num_threads,
                split_every) -> _Checked:
    """Every argument of :func:`attention` checked as :func:`fastattn.attention` checks
    it (the same messages, naming ``dask.attention``), plus what dask adds: no `out`,
    known chunk sizes, one chunk along the feature axes, `split_every` >= 2, no dropout.
    Nothing is computed but the small `alibi_slopes` and `seqlens_k`."""
    if out is not None:
        raise TypeError(f"fastattn.{_FN}: out= is not supported (dask arrays are immutable); "
                        "store the result with dask.array.store(result, target)")
    q, k, v = _as_dask(q, "q"), _as_dask(k, "k"), _as_dask(v, "v")
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_chunks(x, name)
    pr = _args.Problem(_FN, _dummy(q.shape, q.dtype), _dummy(k.shape, k.dtype),
                       _dummy(v.shape, v.dtype), layout)
    return_lse = _args.parse_flag(return_lse, "return_lse", _FN)
    return_stats = _args.parse_flag(return_stats, "return_stats", _FN)
    causal_code = _args.parse_causal(causal, _FN)
    _args.parse_scale(scale, pr.D, _FN)
    nth = _args.parse_threads(num_threads, _FN) or 1
    if isinstance(split_every, (bool, np.bool_)) or not isinstance(split_every, (int, np.integer)) \
            or split_every < 2:
        raise ValueError(f"fastattn.{_FN}: split_every must be an int >= 2, got {split_every!r}")
    p_drop, _ = _args.parse_dropout(dropout_p, seed, _FN)
    if p_drop > 0:
        raise NotImplementedError(
            f"fastattn.{_FN}: dropout_p > 0 is not supported: the keep decision of weight "
            "(b, h, i, j) is keyed by the batch, head, row and key indices within one "
            "fastattn.attention call (not by q_offset/k_offset), so a block's call would "
            "drop other weights than the whole call; apply dropout with fastattn.attention "
            "on whole sequences")
    maskd = biasd = None
    if mask is not None:
        maskd = _as_dask(mask, "mask")
        _check_chunks(maskd, "mask")
    if bias is not None:
        biasd = _as_dask(bias, "bias")
        _check_chunks(biasd, "bias")
    slopes = _small(alibi_slopes, "alibi_slopes")
    seqlens = _small(seqlens_k, "seqlens_k")
    wl, wr = _args.parse_window(window, _FN)
    # the checks of fastattn.attention, on zero-memory stand-ins of the same shapes
    mdummy = None if maskd is None else _dummy(maskd.shape, maskd.dtype)
    bdummy = None
    if biasd is not None:
        if biasd.dtype != pr.dtype:  # the dtype check on a tiny array (no conversion copy)
            pr.variants(None, None, _dummy((1,) * biasd.ndim, biasd.dtype), None, None)
        bdummy = _dummy(biasd.shape, pr.dtype)
    if seqlens is None:
        pr.variants(window, mdummy, bdummy, slopes, softcap)
    else:
        pr.variants(window, mdummy, bdummy, slopes, softcap, seqlens_k=seqlens)
        seqlens = np.asarray(seqlens, np.int64).reshape(-1)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if len(x.chunks[-1]) > 1:
            raise ValueError(f"fastattn.{_FN}: {name} is chunked along its feature axis (chunks "
                             f"{x.chunks[-1]}); each row's features must be one chunk: pass "
                             f"{name}.rechunk({{{x.ndim - 1}: -1}})")
    return _Checked(q, k, v, maskd, biasd, pr, return_lse, return_stats, causal_code, nth,
                    slopes, seqlens, wl, wr)


class _Graph:
    """The task graph of one call, built from its checked arguments.

    The block plan: the output's chunks are q's (batch, head, query) chunks; k and v
    are rechunked to q's batch chunks, to kv head chunks that whole q head chunks read
    (:func:`_kv_partition`) and v to k's key chunks; a mask or bias to the logits'
    chunks along its full-size axes.  Each (batch, head, query) chunk gets one block
    task per key chunk that some row of it sees (:meth:`add_rows`), their partial
    results merged in a fixed tree (:meth:`add_tree`); :meth:`arrays` wraps the
    graph as the dask arrays returned.
    """

    def __init__(self, c: _Checked, layout, scale, softcap, split_every):
        pr, q = c.pr, c.q
        nd = self.nd = pr.nd
        self.c, self.layout, self.split_every = c, layout, split_every
        # axes in the user's layout
        self.ax_l = nd - 3 if pr.swap else nd - 2
        self.ax_h = (nd - 2 if pr.swap else nd - 3) if nd > 2 else None
        self.ax_b = 0 if nd == 4 else None
        self.G = pr.Hq // pr.Hkv if pr.Hkv else 1
        self.b_chunks = q.chunks[self.ax_b] if self.ax_b is not None else (1,)
        self.h_chunks = q.chunks[self.ax_h] if self.ax_h is not None else (1,)
        self.lq_chunks = q.chunks[self.ax_l]
        self.lk_chunks = c.k.chunks[self.ax_l]
        self.kv_h_chunks = _kv_partition(self.h_chunks, pr.Hkv, self.G) \
            if self.ax_h is not None and pr.Hkv else None
        self.k, self.v = self._rechunk_kv(c.k, c.v)
        # mask / bias: logits order (B, Hq, Lq, Lk)[4 - nd:]; full axes chunked like the logits
        self.logit_chunks = self.row_chunks() + [self.lk_chunks]
        self.mask, self.bias = self._align(c.mask), self._align(c.bias)
        self.lse_dtype = np.dtype(pr.lse_dtype)
        self.out_dtype = pr.out_dtype
        self.cdt = np.dtype(pr.dtype)
        self.sixteen = np.dtype(self.out_dtype).itemsize == 2   # float16 / bfloat16 q
        self.scale = None if scale is None else float(scale)
        self.softcap = None if softcap is None else float(softcap)
        self.slopes = None if c.slopes is None else np.asarray(c.slopes).astype(self.cdt)
        token = tokenize(q.name, self.k.name, self.v.name,
                         None if self.mask is None else self.mask.name,
                         None if self.bias is None else self.bias.name, self.slopes, self.scale,
                         self.softcap, c.causal, c.wl, c.wr, layout, c.threads, split_every,
                         c.seqlens, c.return_stats, "fastattn.dask-1")
        self.blk_name = "fastattn-block-" + token
        self.mrg_name = "fastattn-merge-" + token
        self.out_name = "fastattn-out-" + token
        self.lse_name = "fastattn-lse-" + token
        self.stat_names = tuple("fastattn-" + n + "-" + token
                                for n in ("entropy", "support", "maxweight"))
        self.blocks: dict = {}
        self.merges: dict = {}
        self.outl: dict = {}
        self.lsel: dict = {}
        self.statl: dict = {}
        self.qs_b, self.qs_h = _starts(self.b_chunks), _starts(self.h_chunks)
        self.qs_l, self.ks_l = _starts(self.lq_chunks), _starts(self.lk_chunks)
        self.kvs_h = _starts(self.kv_h_chunks) if self.kv_h_chunks is not None else [0, 1]
        for bi in range(len(self.b_chunks)):
            for hi in range(len(self.h_chunks)):
                heads = self._heads(hi)
                for li in range(len(self.lq_chunks)):
                    self.add_rows(bi, hi, li, heads)

    def row_chunks(self) -> List[Tuple[int, ...]]:
        """The chunks of the lse's axes (B, Hq, Lq)[3 - (nd - 1):]: q's."""
        nd = self.nd
        return ([self.b_chunks] if nd == 4 else []) + ([self.h_chunks] if nd >= 3 else []) \
            + [self.lq_chunks]

    def _rechunk_kv(self, k, v):
        """k and v: q's batch chunks, kv heads grouped by q's head chunks, v like k on keys."""
        k_target, v_target = dict(), dict()
        if self.ax_b is not None:
            k_target[self.ax_b] = v_target[self.ax_b] = self.b_chunks
        if self.kv_h_chunks is not None:
            k_target[self.ax_h] = v_target[self.ax_h] = self.kv_h_chunks
        v_target[self.ax_l] = self.lk_chunks
        nd = self.nd
        k = k.rechunk({**{a: c for a, c in k_target.items()}, nd - 1: -1})
        v = v.rechunk({**{a: c for a, c in v_target.items()}, nd - 1: -1})
        return k, v

    def _align(self, x):
        """x with the logits' ndim, chunked like the logits on its full-size axes."""
        if x is None:
            return None
        if x.ndim < self.nd:
            x = x[(None,) * (self.nd - x.ndim)]
        return x.rechunk({a: (c if x.shape[a] == sum(c) else (x.shape[a],))
                          for a, c in enumerate(self.logit_chunks)})

    def _heads(self, hi):
        """q head chunk hi: (h0, h1, the kv chunks it reads, the kernel calls' head
        groups or None when it starts and ends on kv-group boundaries)."""
        h0, h1 = self.qs_h[hi], self.qs_h[hi + 1]
        G, kvs_h = self.G, self.kvs_h
        if self.ax_h is not None and h1 - h0 > 0 and self.c.pr.Hkv:
            g0, g1 = h0 // G, -(-h1 // G)
            kv_idx = [i for i in range(len(kvs_h) - 1) if kvs_h[i] >= g0 and kvs_h[i + 1] <= g1]
            aligned = h0 % G == 0 and h1 % G == 0
            groups = None if aligned else tuple(
                (max(h0, g * G) - h0, min(h1, (g + 1) * G) - h0, g - g0) for g in range(g0, g1))
        else:
            kv_idx, groups = [0], None
        return h0, h1, kv_idx, groups

    def runs_for(self, q0, q1, k0, k1, b0, b1):
        """The block's runs of batch entries b0..b1-1 with one plan each (see _Call),
        or None when no entry sees any key of it."""
        c, pr = self.c, self.c.pr
        alibi = c.slopes is not None
        if c.seqlens is None:
            pl = _plan_block(q0, q1, k0, k1, pr.Lq, pr.Lk, c.causal, c.wl, c.wr, alibi)
            return None if pl is None else ((0, b1 - b0, pl),)
        runs: List[List[Any]] = []
        for b in range(b0, b1):
            S = int(c.seqlens[b if self.nd == 4 else 0])   # sequence b is its first S keys
            pl = None if k0 >= S else _plan_block(q0, q1, k0, min(k1, S), pr.Lq, S,
                                                   c.causal, c.wl, c.wr, alibi)
            if runs and runs[-1][2] == pl:
                runs[-1][1] += 1
            else:
                runs.append([b - b0, b - b0 + 1, pl])
        if all(r[2] is None for r in runs):
            return None
        return tuple((r[0], r[1], r[2]) for r in runs)

    def user_index(self, bi, hi, li, last):
        """A block index in the user's layout and ndim."""
        idx = {}
        if self.ax_b is not None:
            idx[self.ax_b] = bi
        if self.ax_h is not None:
            idx[self.ax_h] = hi
        idx[self.ax_l] = li
        idx[self.nd - 1] = last
        return tuple(idx[a] for a in range(self.nd))

    def row_index(self, bi, hi, li):
        """A block index of the lse's (and stats') axes."""
        nd = self.nd
        return tuple(([bi] if nd == 4 else []) + ([hi] if nd >= 3 else []) + [li])

    def logits_index(self, x, bi, hi, li, ki):
        """The key of the chunk of a mask or bias `x` (logits order) block (bi, hi, li, ki) reads."""
        full = self.row_index(bi, hi, li) + (ki,)
        return (x.name,) + tuple(0 if len(c) == 1 else i for c, i in zip(x.chunks, full))

    def add_rows(self, bi, hi, li, heads):
        """The tasks of output chunk (bi, hi, li): a block task per key chunk its rows
        see (a fill task if none), the merge tree over them, and the output's getters."""
        h0, h1, kv_idx, groups = heads
        c, nd = self.c, self.nd
        bsz, hsz, lsz = self.b_chunks[bi], self.h_chunks[hi], self.lq_chunks[li]
        q0, q1 = self.qs_l[li], self.qs_l[li + 1]
        qkey = (c.q.name,) + self.user_index(bi, hi, li, 0)
        oshape = [0] * nd
        if self.ax_b is not None:
            oshape[self.ax_b] = bsz
        if self.ax_h is not None:
            oshape[self.ax_h] = hsz
        oshape[self.ax_l] = lsz
        oshape[nd - 1] = self.v.shape[-1]
        lshape = tuple(([bsz] if nd == 4 else []) + ([hsz] if nd >= 3 else []) + [lsz])
        empty = bsz == 0 or hsz == 0 or lsz == 0
        plans = []
        if not empty:
            for ki in range(len(self.lk_chunks)):
                runs = self.runs_for(q0, q1, self.ks_l[ki], self.ks_l[ki + 1], self.qs_b[bi],
                                     self.qs_b[bi + 1])
                if runs is not None:
                    plans.append((ki, runs))
        final = (self.mrg_name, bi, hi, li)
        blk = self.blk_name
        if not plans:
            self.blocks[(blk, bi, hi, li, 0)] = (_fill_task, tuple(oshape), self.out_dtype,
                                                 lshape, self.lse_dtype, c.return_stats)
            self.merges[final] = (_identity, (blk, bi, hi, li, 0))
        else:
            upcast = self.sixteen and len(plans) > 1
            sl = None
            if self.slopes is not None:
                sl = self.slopes[..., h0:h1] if self.slopes.ndim == 1 else \
                    self.slopes[self.qs_b[bi]:self.qs_b[bi + 1], h0:h1]
            keys = []
            for ki, runs in plans:
                call = _Call(runs, c.return_stats, self.layout, nd, self.scale, self.softcap, sl,
                             groups, upcast, c.threads, self.cdt, self.lse_dtype)
                kk = [(self.k.name,) + self.user_index(bi, g, ki, 0) for g in kv_idx]
                vk = [(self.v.name,) + self.user_index(bi, g, ki, 0) for g in kv_idx]
                mk = None if self.mask is None else self.logits_index(self.mask, bi, hi, li, ki)
                bk = None if self.bias is None else self.logits_index(self.bias, bi, hi, li, ki)
                key = (blk, bi, hi, li, ki)
                self.blocks[key] = (_block_task, qkey, kk, vk, mk, bk, call)
                keys.append(key)
            self.add_tree(final, keys, upcast, (bi, hi, li))
        self.outl[(self.out_name,) + self.user_index(bi, hi, li, 0)] = (operator.getitem, final, 0)
        lidx = self.row_index(bi, hi, li)
        self.lsel[(self.lse_name,) + lidx] = (operator.getitem, final, 1)
        if c.return_stats:
            ent_name, sup_name, mw_name = self.stat_names
            self.statl[(ent_name,) + lidx] = (operator.getitem, final, 2)
            self.statl[(sup_name,) + lidx] = (_support_task, final)
            self.statl[(mw_name,) + lidx] = (operator.getitem, final, 3)

    def add_tree(self, final, keys, upcast, where):
        """The merge tasks over the block results `keys` (in key order, split_every per
        task, :func:`_tree`), the last one named `final`; `where` is (bi, hi, li)."""
        levels = _tree(keys, self.split_every)
        if not levels:
            if upcast:  # pragma: no cover - one part is never upcast
                self.merges[final] = (_cast_task, keys[0], self.out_dtype)
            else:
                self.merges[final] = (_identity, keys[0])
            return
        below = keys
        for lev, groups_ in enumerate(levels):
            top = lev == len(levels) - 1
            names = []
            pos = 0
            for gi, grp in enumerate(groups_):
                members = below[pos:pos + len(grp)]
                pos += len(grp)
                mkey = final if top else (self.mrg_name,) + where + (lev, gi)
                if len(members) == 1:
                    names.append(members[0])
                    continue
                self.merges[mkey] = (_merge_task, members, self.layout,
                                     self.out_dtype if (top and upcast) else None)
                names.append(mkey)
            below = names

    def arrays(self):
        """The graph's layers as dask arrays: out, then lse and the stats if asked."""
        c, nd = self.c, self.nd
        blk_name, mrg_name = self.blk_name, self.mrg_name
        deps = [c.q, self.k, self.v] + [x for x in (self.mask, self.bias) if x is not None]
        g = HighLevelGraph.from_collections(blk_name, self.blocks, dependencies=deps)
        layers, dependencies = dict(g.layers), dict(g.dependencies)
        layers[mrg_name], dependencies[mrg_name] = self.merges, {blk_name}
        layers[self.out_name], dependencies[self.out_name] = self.outl, {mrg_name}
        layers[self.lse_name], dependencies[self.lse_name] = self.lsel, {mrg_name}
        for name in self.stat_names if c.return_stats else ():
            layers[name] = {key: t for key, t in self.statl.items() if key[0] == name}
            dependencies[name] = {mrg_name}
        graph = HighLevelGraph(layers, dependencies)
        out_chunks = list(c.q.chunks)
        out_chunks[-1] = (self.v.shape[-1],)
        result = da.Array(graph, self.out_name, chunks=tuple(out_chunks),
                          meta=np.empty((0,) * nd, self.out_dtype))
        lse_chunks = tuple(self.row_chunks())

        def row_array(name):
            return da.Array(graph, name, chunks=lse_chunks,
                            meta=np.empty((0,) * (nd - 1), self.lse_dtype))

        parts: Tuple[Any, ...] = (result,)
        if c.return_lse:
            parts += (row_array(self.lse_name),)
        if c.return_stats:
            parts += (fastattn.AttentionStats(*(row_array(n) for n in self.stat_names)),)
        return parts[0] if len(parts) == 1 else parts
