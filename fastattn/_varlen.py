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
    """Combine partial attentions over disjoint key sets into the attention over all of them.

    If ``out_p, lse_p = attention(q, k_p, v_p, layout=layout, return_lse=True)`` for key
    sets ``p = 1..P`` that partition the keys, the merge is the attention over all of
    them: ``lse = log(sum_p exp(lse_p))`` and ``out = sum_p exp(lse_p - lse) out_p``.
    Pass the parts exactly as :func:`attention` returned them, with the same `layout`.

    Parameters
    ----------
    outs : sequence of array_like
        The parts' outputs, all of one shape: ``(..., Hq, Lq, Dv)`` for
        ``layout="bhsd"``, ``(..., Lq, Hq, Dv)`` for ``"bshd"``; 2-D ``(Lq, Dv)`` in
        either layout.
    lses : sequence of array_like
        The parts' lse, ``(..., Hq, Lq)`` in both layouts (:func:`attention` puts the
        heads before the sequence in lse whatever the layout); ``(Lq,)`` for 2-D outs.
    layout : {'bhsd', 'bshd'}, optional
        The layout the parts were computed with.

    Returns
    -------
    out : ndarray
        The merged output, in the shape of ``outs[0]``.
    lse : ndarray
        The merged lse, in the shape of ``lses[0]``.  Both have the inputs' common
        dtype (NumPy's ``result_type``), float32 or float64; bfloat16 parts merge in
        float32.

    Raises
    ------
    TypeError
        If the common dtype is another (integer or complex parts, or float16 ones
        whose lse is float16 too).
    ValueError
        If the parts' shapes disagree with each other or with the layout.

    See Also
    --------
    attention : Gives the parts, with ``return_lse=True``.
    fastattn.reference.merge : The float64 NumPy oracle.

    Notes
    -----
    Parts with ``lse = -inf`` (rows that saw no key) contribute nothing; a row that is
    -inf in every part is 0 with lse -inf.  The parts are added in the order given.

    Examples
    --------
    >>> import numpy as np
    >>> import fastattn
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((4, 16, 32))
    >>> k, v = (rng.standard_normal((4, 100, 32)) for _ in range(2))
    >>> parts = [fastattn.attention(q, k[:, s], v[:, s], return_lse=True)
    ...          for s in (slice(0, 60), slice(60, 100))]
    >>> out, lse = fastattn.merge([o for o, _ in parts], [l for _, l in parts])
    >>> bool(np.allclose(out, fastattn.attention(q, k, v)))
    True
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

    The sequences are packed one after another on the first axis (FlashAttention's
    ``varlen`` layout), so a batch of different lengths needs no padding and no mask.

    Parameters
    ----------
    q : array_like, shape (total_q, Hq, D)
        The queries of every sequence, packed.  float32 or float64; float16 or
        bfloat16 with k and v of the same type (computed in float32).
    k : array_like, shape (total_k, Hkv, D)
        The keys, packed; of q's dtype.  ``Hq`` must be a multiple of ``Hkv``.
    v : array_like, shape (total_k, Hkv, Dv)
        The values, packed; of q's dtype.
    cu_seqlens_q, cu_seqlens_k : array_like of int, shape (nseq + 1,)
        Cumulative lengths: they start at 0, do not decrease, end at ``total_q`` and
        ``total_k``, and have the same count.  Sequence ``s`` is q's rows
        ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` against k's and v's rows
        ``cu_seqlens_k[s]:cu_seqlens_k[s+1]``.
    scale : float, optional
        As in :func:`attention`.
    causal, window : optional
        As in :func:`attention`, aligned per sequence (bottom-right: each sequence's
        last query sees its last key).
    alibi_slopes : array_like, shape (Hq,), optional
        As in :func:`attention`, per sequence.
    softcap : float, optional
        As in :func:`attention`.
    dropout_p, seed : optional
        As in :func:`attention`, with ``b`` the sequence's index and ``i, j`` the
        positions within the sequence.
    return_lse : bool, optional
        Also return lse.
    num_threads : int, optional
        As in :func:`attention`.
    sinks : array_like of float, shape (Hq,), optional
        Attention sinks, as in :func:`attention`.

    Returns
    -------
    out : ndarray
        Shape ``(total_q, Hq, Dv)``, q's dtype.
    lse : ndarray
        With ``return_lse=True``: shape ``(Hq, total_q)`` (as FlashAttention returns
        it), float64 for float64 inputs, else float32.

    Raises
    ------
    TypeError, ValueError
        If the cumulative lengths are not valid for the packed arrays, or as
        :func:`attention` raises them.

    See Also
    --------
    fastattn.reference.varlen_attention : The float64 NumPy oracle.

    Examples
    --------
    >>> import numpy as np
    >>> import fastattn
    >>> rng = np.random.default_rng(0)
    >>> cu = np.array([0, 5, 12])                   # two sequences: 5 and 7 tokens
    >>> q, k, v = (rng.standard_normal((12, 4, 16), dtype=np.float32) for _ in range(3))
    >>> out = fastattn.varlen_attention(q, k, v, cu, cu, causal=True)
    >>> second = fastattn.attention(q[5:], k[5:], v[5:], causal=True, layout="bshd")
    >>> bool(np.allclose(out[5:], second, atol=1e-6))
    True
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
