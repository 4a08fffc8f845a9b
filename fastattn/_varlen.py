"""Attention assembled from pieces: partial results over disjoint key sets combined
(:func:`merge`), and ragged batches packed on one axis (:func:`varlen_attention`).
Their arguments are checked by fastattn._checks; the kernel call is fastattn._api's."""

from __future__ import annotations

from typing import Literal, Sequence, Tuple, Union, overload

import numpy as np

from . import _kernels
from ._api import _run
from ._args import parse_flag
from ._checks import merge_inputs, varlen_problem
from ._typing import ArrayLike, Causal, FloatArray, Layout, Window

__all__ = ["merge", "varlen_attention"]


def merge(outs: Sequence[ArrayLike], lses: Sequence[ArrayLike], *,
          layout: Layout = "bhsd") -> Tuple[FloatArray, FloatArray]:
    """Combine partial attentions over disjoint key sets into the whole.

    If ``out_p, lse_p = attention(q, k_p, v_p, layout=layout, return_lse=True)`` for
    key sets ``p = 1..P`` that partition the keys, the merge equals the attention
    over all of them: ``lse = log(sum_p exp(lse_p))`` and
    ``out = sum_p exp(lse_p - lse) out_p``.  Pass the parts exactly as
    :func:`attention` returned them, with the same `layout`.

    Parameters
    ----------
    outs : sequence of ndarray, all of one shape
        ``(..., Hq, Lq, Dv)`` for ``layout="bhsd"``, ``(..., Lq, Hq, Dv)`` for
        ``"bshd"``; 2-D ``(Lq, Dv)`` in either layout.
    lses : sequence of ndarray
        ``(..., Hq, Lq)`` in both layouts: :func:`attention` always puts the heads
        before the sequence in lse (for ``"bshd"`` that is ``outs[p]`` with its last
        axis dropped and the next two swapped); 2-D outs take ``(Lq,)``.
    layout : {'bhsd', 'bshd'}, optional
        The layout the parts were computed with.

    Returns
    -------
    out, lse : ndarrays in the common float dtype of the inputs, in the shapes of
        ``outs[0]`` and ``lses[0]``.  Stable for parts with ``lse = -inf`` (no
        visible key: they contribute nothing); if every part is -inf the row is 0
        with lse -inf.  Parts merge in the order given.
    """
    outs_a, lses_a, dt, swap = merge_inputs(outs, lses, layout)
    shape = outs_a[0].shape
    rows = int(np.prod(shape[:-1]))
    O = np.stack([np.ascontiguousarray(o, dtype=dt).reshape(rows, shape[-1]) for o in outs_a])
    L = np.stack([np.ascontiguousarray(x, dtype=dt).reshape(rows) for x in lses_a])
    out = np.empty((rows, shape[-1]), dt)
    lse = np.empty(rows, dt)
    _kernels.merge(O, L, out, lse)
    lse_out = lse.reshape(shape[:-1])
    if swap:
        lse_out = np.ascontiguousarray(lse_out.swapaxes(-1, -2))
    return out.reshape(shape), lse_out


@overload
def varlen_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike,
                     cu_seqlens_k: ArrayLike, *, scale: float | None = ...,
                     causal: Causal = ..., window: Window = ...,
                     alibi_slopes: ArrayLike | None = ..., softcap: float | None = ...,
                     dropout_p: float = ..., seed: int | None = ...,
                     return_lse: Literal[False] = ..., num_threads: int | None = ...,
                     sinks: ArrayLike | None = ...
                     ) -> FloatArray: ...


@overload
def varlen_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike,
                     cu_seqlens_k: ArrayLike, *, scale: float | None = ...,
                     causal: Causal = ..., window: Window = ...,
                     alibi_slopes: ArrayLike | None = ..., softcap: float | None = ...,
                     dropout_p: float = ..., seed: int | None = ...,
                     return_lse: Literal[True], num_threads: int | None = ...,
                     sinks: ArrayLike | None = ...
                     ) -> Tuple[FloatArray, FloatArray]: ...


@overload
def varlen_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike,
                     cu_seqlens_k: ArrayLike, *, scale: float | None = ...,
                     causal: Causal = ..., window: Window = ...,
                     alibi_slopes: ArrayLike | None = ..., softcap: float | None = ...,
                     dropout_p: float = ..., seed: int | None = ...,
                     return_lse: bool = ..., num_threads: int | None = ...,
                     sinks: ArrayLike | None = ...
                     ) -> Union[FloatArray, Tuple[FloatArray, FloatArray]]: ...


def varlen_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike,
                     cu_seqlens_k: ArrayLike, *, scale: float | None = None,
                     causal: Causal = False, window: Window = None,
                     alibi_slopes: ArrayLike | None = None, softcap: float | None = None,
                     dropout_p: float = 0.0, seed: int | None = None,
                     return_lse: bool = False, num_threads: int | None = None,
                     sinks: ArrayLike | None = None
                     ) -> Union[FloatArray, Tuple[FloatArray, FloatArray]]:
    """Attention over a packed ragged batch: each sequence attends only to its own keys.

    Parameters
    ----------
    q : ndarray (total_q, Hq, D); k : (total_k, Hkv, D); v : (total_k, Hkv, Dv)
        The sequences packed one after another (float32 or float64).
    cu_seqlens_q, cu_seqlens_k : int arrays (nseq + 1,)
        Cumulative lengths: start at 0, non-decreasing, end at total_q / total_k,
        the same count.  Sequence s is q rows ``cu_q[s]:cu_q[s+1]`` against key rows
        ``cu_k[s]:cu_k[s+1]``.
    scale, causal, window, alibi_slopes (Hq,), softcap, num_threads
        As for :func:`attention`; causal and window are aligned per sequence
        (bottom-right: each sequence's last query sees its last key).
    dropout_p, seed
        As for :func:`attention`, with b the sequence's index and i, j positions
        within the sequence.
    sinks : float array (Hq,), optional
        Attention sinks, as for :func:`attention`.
    return_lse : bool
        Also return lse of shape (Hq, total_q).

    Returns
    -------
    out : ndarray (total_q, Hq, Dv); lse : (Hq, total_q) with ``return_lse``.
    """
    pr, cq, ck = varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k)
    return_lse = parse_flag(return_lse, "return_lse", "varlen_attention")
    opt = pr.options(causal, scale, num_threads, window, None, None, alibi_slopes, softcap,
                     dropout_p, seed, sinks=sinks)
    va = opt.variants
    va.cu_q, va.cu_k = cq, ck
    total_q = pr.q.shape[-2]
    out = np.empty((total_q, pr.Hq, pr.v.shape[-1]), pr.out_dtype)
    lse = np.empty((pr.Hq, total_q), pr.lse_dtype) if return_lse else None
    if cq.size > 1 and (out.size or lse is not None and lse.size):
        # (1, H, total, D) views: the sequences are offsets on the L axis
        _run(pr.q[None], pr.k[None], pr.v[None], out.swapaxes(0, 1)[None],
             None if lse is None else lse[None], opt.scale, opt.causal, opt.threads, va)
    return out if lse is None else (out, lse)
