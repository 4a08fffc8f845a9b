"""Pure-NumPy float64 oracle for fastattn.

Deliberately naive and obviously right: it materialises the full ``(B, Hq, Lq, Lk)``
logits and follows the "Semantics (exact, in this order)" section of DESIGN.md step by
step (``docs/semantics.md`` writes the same rules out for users).  Everything is computed in float64 whatever the input dtype.  The kernels are
tested against this module, so it depends on nothing but NumPy.

Conventions beyond DESIGN.md that this module fixes:

- ``bias`` and ``mask`` always broadcast (right-aligned) against the logits shape
  ``(B, Hq, Lq, Lk)`` / ``(Hq, Lq, Lk)`` / ``(Lq, Lk)``, whatever the layout.
- ``lse`` is ``(..., Hq, Lq)`` whatever the layout (``(Lq,)`` for 2-D input);
  ``varlen_attention`` returns it as ``(Hq, total_q)``, like FlashAttention.
- A logit of -inf (e.g. from ``bias``) hides its key exactly like the mask does.
- With D = 0 the default scale is 1 (all logits are 0 anyway).
- Dropout (step 11) keeps weight (b, h, i, j) iff word ``j & 3`` of
  ``philox4x32((j >> 2, i, h, b), (seed & 0xFFFFFFFF, seed >> 32))`` is
  ``>= min(int(p * 2**32), 2**32 - 1)``; b is the batch (varlen: sequence) index, h the
  query head, i and j the query and key positions (within the sequence).  Kept weights
  are scaled by ``1 / (1 - p)``; ``lse`` is that of the undropped softmax.

The public functions are here; the forward's steps (logits, softmax, dropout, the
weighted values) are in ``fastattn/_ref_forward.py`` and the Philox generator with
the keep decisions in ``fastattn/_ref_dropout.py``.
"""
from __future__ import annotations

from typing import Any, Literal, Sequence, Tuple, Union, overload

import numpy as np

from ._ref_dropout import Seed, dropout_keep, philox4x32
from ._ref_forward import (F64, _as_float, _dropout_factor, _forward, _from_bhsd4, _logits,
                           _sink_column, _softmax, _to_bhsd4)
from ._typing import ArrayLike, Causal, Layout, Window

__all__ = ["attention_stats", "key_mass", "attention", "attention_backward", "attention_weights", "dropout_keep", "merge",
           "philox4x32", "varlen_attention"]

_NEG_INF = -np.inf


@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, scale: float | None = ...,
              causal: Causal = ..., window: Window = ..., mask: ArrayLike | None = ...,
              bias: ArrayLike | None = ..., alibi_slopes: ArrayLike | None = ...,
              softcap: float | None = ..., dropout_p: float = ..., seed: Seed = ...,
              layout: Layout = ..., return_lse: Literal[False] = ..., out: Any = ...,
              num_threads: Any = ..., q_offset: int | None = ...,
              k_offset: int | None = ..., sinks: ArrayLike | None = ...) -> F64: ...


@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, scale: float | None = ...,
              causal: Causal = ..., window: Window = ..., mask: ArrayLike | None = ...,
              bias: ArrayLike | None = ..., alibi_slopes: ArrayLike | None = ...,
              softcap: float | None = ..., dropout_p: float = ..., seed: Seed = ...,
              layout: Layout = ..., return_lse: Literal[True], out: Any = ...,
              num_threads: Any = ..., q_offset: int | None = ...,
              k_offset: int | None = ..., sinks: ArrayLike | None = ...) -> Tuple[F64, F64]: ...


def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, scale: float | None = None,
              causal: Causal = False, window: Window = None, mask: ArrayLike | None = None,
              bias: ArrayLike | None = None, alibi_slopes: ArrayLike | None = None,
              softcap: float | None = None, dropout_p: float = 0.0, seed: Seed = None,
              layout: Layout = "bhsd", return_lse: bool = False, out: Any = None,
              num_threads: Any = None, q_offset: int | None = None,
              k_offset: int | None = None,
              sinks: ArrayLike | None = None) -> Union[F64, Tuple[F64, F64]]:
    """Exact attention ``softmax(scale * q k^T + ...) v`` in float64.

    Parameters
    ----------
    q : array, (..., Hq, Lq, D) in layout "bhsd", (..., Lq, Hq, D) in "bshd"; 2-D (Lq, D).
    k : array, (..., Hkv, Lk, D) (layout as for q).
    v : array, (..., Hkv, Lk, Dv).
    scale : float, default 1/sqrt(D).
    causal : False, True, "bottom-right" or "top-left".
    window : (left, right) pair of ints or None.
    mask : bool array broadcastable to (..., Hq, Lq, Lk), True = attend.
    bias : float array broadcastable to (..., Hq, Lq, Lk).
    alibi_slopes : float array (Hq,) or (B, Hq).
    softcap : float > 0.
    dropout_p : float in [0, 1), the probability of dropping a weight (see
        :func:`dropout_keep`); kept weights are scaled by 1 / (1 - dropout_p).
    seed : int in [0, 2**64), required when dropout_p > 0.
    layout : "bhsd" or "bshd".
    return_lse : bool, also return the log-sum-exp.
    out, num_threads : accepted for signature compatibility; ``out`` is ignored.
    q_offset, k_offset : int, optional: the positions of the first query and the first
        key in one longer sequence (a block of it: chunked prefill).  Given (a missing
        one is 0), query i sits at q_offset + i and key j at k_offset + j, and the
        positions decide the diagonal ``a = q_offset + i - k_offset``: causal hides the
        keys j > a, the window is around a, the ALiBi distance is |a - j|.  causal may
        then be True (or "bottom-right"), not "top-left".
    sinks : float array (Hq,), optional: one more logit per head in each row's softmax
        (not scaled), a key with a zero value; lse includes it.

    Returns
    -------
    out : float64 array, same layout and ndim as q with Dv last.
    lse : float64 array (..., Hq, Lq), only if ``return_lse``; that of the softmax
        before dropout.
    """
    o, lse = _forward(q, k, v, scale, causal, window, mask, bias, alibi_slopes, softcap,
                      dropout_p, seed, layout, num_threads, 0, q_offset, k_offset, sinks)
    return (o, lse) if return_lse else o


def attention_weights(q: ArrayLike, k: ArrayLike, *, scale: float | None = None,
                      causal: Causal = False, window: Window = None,
                      mask: ArrayLike | None = None, bias: ArrayLike | None = None,
                      alibi_slopes: ArrayLike | None = None, softcap: float | None = None,
                      dropout_p: float = 0.0, seed: Seed = None,
                      layout: Layout = "bhsd", q_offset: int | None = None,
                      k_offset: int | None = None, sinks: ArrayLike | None = None) -> F64:
    """The attention weight matrix, float64, shape (..., Hq, Lq, Lk) in any layout.

    Arguments as for :func:`attention`.  Rows sum to 1; rows with no visible key are 0.
    With dropout_p > 0 the weights are those after dropout: dropped entries 0, kept ones
    scaled by 1 / (1 - dropout_p), so that ``attention(...) == attention_weights(...) @ v``.
    """
    lg = _logits(q, k, None, scale, causal, window, mask, bias, alibi_slopes, softcap,
                 layout, None, q_offset, k_offset)
    z = _dropout_factor(dropout_p, seed, lg.s.shape)
    w = _softmax(lg.s, sinks)[0]
    if z is not None:
        w = w * z
    return w.reshape(w.shape[4 - lg.ndim:])


def attention_stats(q: ArrayLike, k: ArrayLike, *, scale: float | None = None,
                    causal: Causal = False, window: Window = None,
                    mask: ArrayLike | None = None, bias: ArrayLike | None = None,
                    alibi_slopes: ArrayLike | None = None, softcap: float | None = None,
                    layout: Layout = "bhsd", q_offset: int | None = None,
                    k_offset: int | None = None,
                    sinks: ArrayLike | None = None) -> Tuple[F64, F64, F64]:
    """(entropy, effective_support, max_weight), each (..., Hq, Lq), float64, computed
    naively from the weights: ``H = -sum p log p`` over the row's weights (0 log 0 = 0),
    ``exp(H)``, ``max p``; a row with no visible key gets 0 in all three (what
    ``fastattn.attention(..., return_stats=True)`` documents).  With `sinks`, over the
    keys and the sink: the sink's weight is one more entry of each row."""
    w = attention_weights(q, k, scale=scale, causal=causal, window=window, mask=mask, bias=bias,
                          alibi_slopes=alibi_slopes, softcap=softcap, layout=layout,
                          q_offset=q_offset, k_offset=k_offset, sinks=sinks)
    if sinks is not None:  # the sink's weight as one more column
        w = np.concatenate([w, 1.0 - w.sum(axis=-1, keepdims=True)], axis=-1)
    logw = np.log(np.where(w > 0, w, 1.0))
    entropy = -np.sum(w * logw, axis=-1)
    empty = ~np.any(w > 0, axis=-1)
    support = np.where(empty, 0.0, np.exp(entropy))
    return entropy, support, np.max(w, axis=-1, initial=0.0)


def key_mass(q: ArrayLike, k: ArrayLike, *, scale: float | None = None, causal: Causal = False,
             window: Window = None, mask: ArrayLike | None = None, bias: ArrayLike | None = None,
             alibi_slopes: ArrayLike | None = None, softcap: float | None = None,
             layout: Layout = "bhsd", q_offset: int | None = None,
             k_offset: int | None = None, sinks: ArrayLike | None = None) -> F64:
    """For each key the sum of its weights over the query rows, (..., Hq, Lk), float64:
    the weights' column sums (no dropout)."""
    w = attention_weights(q, k, scale=scale, causal=causal, window=window, mask=mask, bias=bias,
                          alibi_slopes=alibi_slopes, softcap=softcap, layout=layout,
                          q_offset=q_offset, k_offset=k_offset, sinks=sinks)
    return w.sum(axis=-2)


def _sum_to_shape(g, shape):
    """Sum g (a broadcast of an array of the given shape) back to that shape."""
    g = g.sum(axis=tuple(range(g.ndim - len(shape))))
    g = g.sum(axis=tuple(a for a, n in enumerate(shape) if n == 1), keepdims=True)
    return g.reshape(shape)


@overload
def attention_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike,
                       out: ArrayLike, lse: ArrayLike, *, scale: float | None = ...,
                       causal: Causal = ..., window: Window = ...,
                       mask: ArrayLike | None = ..., bias: ArrayLike | None = ...,
                       alibi_slopes: ArrayLike | None = ..., softcap: float | None = ...,
                       dropout_p: float = ..., seed: Seed = ..., layout: Layout = ...,
                       return_dbias: Literal[False] = ..., num_threads: Any = ...,
                       q_offset: int | None = ..., k_offset: int | None = ...,
                       sinks: ArrayLike | None = ..., return_dsinks: Literal[False] = ...
                       ) -> Tuple[F64, F64, F64]: ...


@overload
def attention_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike,
                       out: ArrayLike, lse: ArrayLike, *, scale: float | None = ...,
                       causal: Causal = ..., window: Window = ...,
                       mask: ArrayLike | None = ..., bias: ArrayLike | None = ...,
                       alibi_slopes: ArrayLike | None = ..., softcap: float | None = ...,
                       dropout_p: float = ..., seed: Seed = ..., layout: Layout = ...,
                       return_dbias: Literal[True], num_threads: Any = ...,
                       q_offset: int | None = ..., k_offset: int | None = ...,
                       sinks: ArrayLike | None = ..., return_dsinks: Literal[False] = ...
                       ) -> Tuple[F64, F64, F64, F64]: ...


def attention_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike,
                       out: ArrayLike, lse: ArrayLike, *, scale: float | None = None,
                       causal: Causal = False, window: Window = None,
                       mask: ArrayLike | None = None, bias: ArrayLike | None = None,
                       alibi_slopes: ArrayLike | None = None, softcap: float | None = None,
                       dropout_p: float = 0.0, seed: Seed = None, layout: Layout = "bhsd",
                       return_dbias: bool = False, num_threads: Any = None,
                       q_offset: int | None = None, k_offset: int | None = None,
                       sinks: ArrayLike | None = None, return_dsinks: bool = False
                       ) -> Tuple[F64, ...]:
    """Gradients of :func:`attention` with respect to q, k, v (and bias), float64.

    Recomputes the logits S and the weights P = softmax(S) (0 on rows with no visible
    key), Z = keep / (1 - dropout_p) (or 1), and with dO = dout:
    dV = (P Z)^T dO, dP = (dO V^T) Z, dS = P (dP - rowsum(P dP)),
    dS_raw = dS (1 - tanh(scale q.k / softcap)**2) (dS_raw = dS without softcap),
    dQ = scale dS_raw K, dK = scale dS_raw^T Q; with GQA dK and dV are summed over the
    query heads that share a kv head.  ALiBi, mask, causal and window pass dS through.

    Parameters
    ----------
    dout : float array, the shape of ``out``: the gradient of the loss w.r.t. out.
    q, k, v : as for :func:`attention`.
    out : array, attention's output (its shape is checked; otherwise unused).
    lse : array (..., Hq, Lq), attention's lse (its shape is checked; otherwise unused).
    return_dbias : bool, also return the gradient w.r.t. ``bias`` (which must be given):
        dS summed over the axes the bias was broadcast along, in the bias's own shape.
    sinks : as for :func:`attention` (P is then the softmax with the sink's logit);
    return_dsinks : bool, also return the sinks' gradient
        ``-sum_{b,i} p_sink * rowsum(P dP)``, (Hq,).
    Other arguments as for :func:`attention`; dropout_p and seed must be those of the
    forward pass.

    Returns
    -------
    dq, dk, dv : float64, the shapes of q, k, v.
    dbias : float64, the shape of bias, only if ``return_dbias``.
    dsinks : float64 (Hq,), only if ``return_dsinks``.
    """
    if return_dbias and bias is None:
        raise ValueError("return_dbias=True needs a bias, got bias=None")
    if return_dsinks and sinks is None:
        raise ValueError("return_dsinks=True needs sinks, got sinks=None")
    lg = _logits(q, k, v, scale, causal, window, mask, bias, alibi_slopes, softcap, layout,
                 num_threads, q_offset, k_offset)
    assert lg.v4 is not None
    B, Hq, Lq, Lk = lg.s.shape
    Dv = lg.v4.shape[-1]
    out_shape = _from_bhsd4(np.broadcast_to(0.0, (B, Hq, Lq, Dv)), lg.ndim, layout).shape
    lse_shape = (B, Hq, Lq)[4 - lg.ndim:]
    out_a, lse_a = np.asarray(out), np.asarray(lse)
    if out_a.shape != out_shape:
        raise ValueError(f"out must have shape {out_shape} (attention's output for q "
                         f"{np.shape(q)}, v {np.shape(v)}), got {out_a.shape}")
    if lse_a.shape != lse_shape:
        raise ValueError(f"lse must have shape {lse_shape} (attention's lse for q "
                         f"{np.shape(q)}), got {lse_a.shape}")
    do = _as_float("dout", dout)
    if do.shape != out_shape:
        raise ValueError(f"dout must have the shape of out {out_shape}, got {do.shape}")
    do4 = _to_bhsd4("dout", do, layout)
    z = _dropout_factor(dropout_p, seed, lg.s.shape)
    p, lse_r, live = _softmax(lg.s, sinks)
    pz = p if z is None else p * z
    dv = pz.swapaxes(-1, -2) @ do4                                     # (B, Hq, Lk, Dv)
    # (B, Hq, Lq, Lk); hidden keys zeroed so a non-finite v row only reaches rows seeing it
    dp = np.where(live, do4 @ lg.v4.swapaxes(-1, -2), 0.0)
    if z is not None:
        dp = dp * z
    rowsum = (p * dp).sum(axis=-1, keepdims=True)
    ds = p * (dp - rowsum)
    ds_raw = ds
    if lg.softcap is not None:
        ds_raw = ds * (1.0 - np.tanh(lg.raw / lg.softcap) ** 2)
    dq = lg.scale * (ds_raw @ lg.k4)                                   # (B, Hq, Lq, D)
    dk = lg.scale * (ds_raw.swapaxes(-1, -2) @ lg.q4)                  # (B, Hq, Lk, D)
    dk = dk.reshape(B, lg.hkv, lg.group, Lk, dk.shape[-1]).sum(axis=2)
    dv = dv.reshape(B, lg.hkv, lg.group, Lk, Dv).sum(axis=2)
    grads = tuple(_from_bhsd4(g, lg.ndim, layout) for g in (dq, dk, dv))
    if return_dbias:
        assert bias is not None                        # checked on entry
        grads += (_sum_to_shape(ds.reshape(lg.full), np.shape(bias)),)
    if return_dsinks:  # the sink's weight exp(sink - lse), its logit's gradient -p_sink D_i
        col = _sink_column(sinks, lg.s)[..., 0]
        with np.errstate(invalid="ignore"):
            psink = np.where(col == _NEG_INF, 0.0, np.exp(col - lse_r))
        grads += (-(psink * rowsum[..., 0]).sum(axis=(0, 2)),)
    return grads


def merge(outs: Sequence[ArrayLike], lses: Sequence[ArrayLike], *,
          layout: Layout = "bhsd") -> Tuple[F64, F64]:
    """Combine partial attentions computed over disjoint key sets.

    Parameters
    ----------
    outs : sequence of arrays, all the same shape: (..., H, Lq, Dv) for layout
        "bhsd", (..., Lq, H, Dv) for "bshd", (Lq, Dv) in either.
    lses : sequence of arrays (..., H, Lq) in both layouts (as attention returns
        them); (Lq,) for 2-D outs.

    Returns
    -------
    out : float64, the shape of outs[0]; lse : float64, the shape of lses[0].  A part
    with lse = -inf contributes nothing; if every part is -inf, out = 0 and lse = -inf.
    """
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    if layout == "bshd" and len(outs) and np.ndim(outs[0]) >= 3:
        # lse (..., H, Lq) -> (..., Lq, H), the order of the out rows; back at the end
        out, lse = merge(outs, [np.swapaxes(x, -1, -2) for x in lses])
        return out, np.swapaxes(lse, -1, -2)
    if not len(outs) or len(outs) != len(lses):
        raise ValueError(f"outs and lses must be non-empty and of equal length, got "
                         f"{len(outs)} outs and {len(lses)} lses")
    os_ = [_as_float(f"outs[{p}]", o) for p, o in enumerate(outs)]
    ls_ = [_as_float(f"lses[{p}]", x) for p, x in enumerate(lses)]
    for p, (o, x) in enumerate(zip(os_, ls_)):
        if o.ndim < 1 or o.shape != os_[0].shape or x.shape != o.shape[:-1]:
            raise ValueError(f"outs[{p}] {o.shape} and lses[{p}] {x.shape} must match "
                             f"outs[0] {os_[0].shape} and lses = outs[:-1]")
    O, L = np.stack(os_), np.stack(ls_)
    part_live = L != _NEG_INF
    M = np.max(L, axis=0)
    alive = M != _NEG_INF
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        w = np.where(part_live, np.exp(L - np.where(alive, M, 0.0)), 0.0)
        total = w.sum(axis=0)
        lse = np.where(alive, M + np.log(total), _NEG_INF)
        num = np.where(part_live[..., None], w[..., None] * O, 0.0).sum(axis=0)
        out = np.where(alive[..., None], num / np.where(alive, total, 1.0)[..., None], 0.0)
    return out, lse


def _cu(name, cu, total):
    a = np.asarray(cu)
    if not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name} must be an integer array, got dtype {a.dtype}")
    if a.ndim != 1 or a.size < 1 or a[0] != 0 or np.any(np.diff(a) < 0) or a[-1] != total:
        raise ValueError(f"{name} must be 1-D, start at 0, be non-decreasing and end at "
                         f"{total}, got shape {a.shape}: {a.tolist()}")
    return a


def varlen_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike,
                     cu_seqlens_k: ArrayLike, *, scale: float | None = None,
                     causal: Causal = False, window: Window = None,
                     alibi_slopes: ArrayLike | None = None, softcap: float | None = None,
                     dropout_p: float = 0.0, seed: Seed = None,
                     return_lse: bool = False) -> Union[F64, Tuple[F64, F64]]:
    """Attention over packed ragged batches, one independent problem per sequence.

    Parameters
    ----------
    q : array (total_q, Hq, D); k : (total_k, Hkv, D); v : (total_k, Hkv, Dv).
    cu_seqlens_q, cu_seqlens_k : int arrays (nseq + 1,), starting at 0, non-decreasing,
        ending at total_q / total_k.  Sequence s uses q rows cu_q[s]:cu_q[s+1] and key
        rows cu_k[s]:cu_k[s+1]; causal and window are aligned per sequence.
    alibi_slopes : float array (Hq,).
    dropout_p, seed : as for :func:`attention`, with b = the sequence index s and i, j
        the query and key positions within sequence s.
    Other arguments as for :func:`attention`.

    Returns
    -------
    out : float64 (total_q, Hq, Dv); lse : float64 (Hq, total_q), only if ``return_lse``.
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    for name, a in (("q", q), ("k", k), ("v", v)):
        if np.ndim(a) != 3:
            raise ValueError(f"{name} must be 3-D (total, H, D), got shape {np.shape(a)}")
    kw: dict[str, Any] = dict(scale=scale, causal=causal, window=window, mask=None,
                              bias=None, alibi_slopes=alibi_slopes, softcap=softcap,
                              dropout_p=dropout_p, seed=seed, layout="bshd",
                              num_threads=None)
    o0, _ = _forward(q[:0], k[:0], v[:0], b0=0, **kw)    # validates everything cheaply
    cq = _cu("cu_seqlens_q", cu_seqlens_q, np.shape(q)[0])
    ck = _cu("cu_seqlens_k", cu_seqlens_k, np.shape(k)[0])
    if cq.shape != ck.shape:
        raise ValueError(f"cu_seqlens_q {cq.shape} and cu_seqlens_k {ck.shape} must have "
                         f"the same length")
    Hq, Dv = o0.shape[1:]
    out = np.zeros((np.shape(q)[0], Hq, Dv))
    lse = np.full((Hq, np.shape(q)[0]), _NEG_INF)
    for s in range(cq.size - 1):
        qs, qe, ks, ke = cq[s], cq[s + 1], ck[s], ck[s + 1]
        out[qs:qe], lse[:, qs:qe] = _forward(q[qs:qe], k[ks:ke], v[ks:ke], b0=s, **kw)
    return (out, lse) if return_lse else out
