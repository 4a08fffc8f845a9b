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
"""
from __future__ import annotations

import math
from typing import Any, Literal, Sequence, Tuple, Union, overload

import numpy as np

from ._typing import ArrayLike, Causal, Layout, Window

F64 = np.ndarray  # float64 results (annotated loosely: NumPy's generics add nothing here)

__all__ = ["attention", "attention_weights", "merge", "varlen_attention"]

_NEG_INF = -np.inf


def _as_float(name, x):
    a = np.asarray(x)
    if not np.issubdtype(a.dtype, np.floating):
        raise TypeError(f"{name} must be a floating-point array, got dtype {a.dtype} "
                        f"with shape {a.shape}")
    return a.astype(np.float64)


def _to_bhsd4(name, a, layout):
    """View a 2-D/3-D/4-D array in either layout as (B, H, L, D)."""
    if a.ndim not in (2, 3, 4):
        raise ValueError(f"{name} must be 2-D, 3-D or 4-D, got shape {a.shape}")
    if a.ndim == 2:
        return a[None, None]
    if layout == "bshd":
        a = a.swapaxes(-3, -2)
    return a if a.ndim == 4 else a[None]


def _from_bhsd4(a, ndim, layout):
    """Inverse of _to_bhsd4 for an output (B, H, L, Dv)."""
    if ndim == 2:
        return a[0, 0]
    if ndim == 3:
        a = a[0]
    return a.swapaxes(-3, -2) if layout == "bshd" else a


def _check_options(scale, causal, window, softcap, layout, num_threads):
    if not isinstance(layout, str) or layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    if num_threads is not None:
        if isinstance(num_threads, (bool, np.bool_)) or not isinstance(
                num_threads, (int, np.integer)):
            raise TypeError(f"num_threads must be an int, got {num_threads!r}")
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads!r}")
    if scale is not None:
        try:
            scale = float(scale)
        except (TypeError, ValueError):
            raise TypeError(f"scale must be a real number, got {scale!r}") from None
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale!r}")
    if softcap is not None:
        try:
            softcap = float(softcap)
        except (TypeError, ValueError):
            raise TypeError(f"softcap must be a real number, got {softcap!r}") from None
        if not (math.isfinite(softcap) and softcap > 0):
            raise ValueError(f"softcap must be finite and > 0, got {softcap!r}")
    if causal is None or causal is False or (isinstance(causal, np.bool_) and not causal):
        mode = None
    elif causal is True or isinstance(causal, np.bool_) or causal == "bottom-right":
        mode = "bottom-right"
    elif causal == "top-left":
        mode = "top-left"
    else:
        raise ValueError(f"causal must be False, True, 'bottom-right' or 'top-left', "
                         f"got {causal!r}")
    if window is None:
        left = right = None
    else:
        try:
            left, right = window
        except (TypeError, ValueError):
            raise ValueError(f"window must be a (left, right) pair, got {window!r}") from None
        for side, w in (("left", left), ("right", right)):
            if w is None:
                continue
            if isinstance(w, (bool, np.bool_)) or not isinstance(w, (int, np.integer)):
                raise TypeError(f"window {side} size must be an int or None, got {w!r}")
            if w < -1:
                raise ValueError(f"window {side} size must be >= 0, or -1 or None for "
                                 f"unbounded; got {window!r}")
        # -1 means unbounded, as None does (FlashAttention's convention)
        left = None if left is None or left == -1 else left
        right = None if right is None or right == -1 else right
    return scale, mode, left, right, softcap


def _logits(q, k, v, scale, causal, window, mask, bias, alibi_slopes, softcap, layout,
            num_threads):
    """Steps 1-5: returns s (B, Hq, Lq, Lk) with -inf on hidden keys, v4 per query head,
    and the user's ndim."""
    scale, mode, left, right, softcap = _check_options(scale, causal, window, softcap,
                                                       layout, num_threads)
    q = _as_float("q", q)
    k = _as_float("k", k)
    arrs = {"q": q, "k": k}
    if v is not None:
        v = _as_float("v", v)
        arrs["v"] = v
    ndim = q.ndim
    if any(a.ndim != ndim for a in arrs.values()):
        raise ValueError("q, k, v must have the same ndim, got shapes "
                         + ", ".join(f"{n}={a.shape}" for n, a in arrs.items()))
    q4, k4 = _to_bhsd4("q", q, layout), _to_bhsd4("k", k, layout)
    B, Hq, Lq, D = q4.shape
    Bk, Hkv, Lk, Dk = k4.shape
    if Bk != B:
        raise ValueError(f"q and k batch sizes differ: q {q.shape}, k {k.shape}")
    if Dk != D:
        raise ValueError(f"q and k head dims differ: q {q.shape}, k {k.shape}")
    if (Hkv == 0 and Hq != 0) or (Hkv != 0 and Hq % Hkv != 0):
        raise ValueError(f"query heads must be a multiple of k heads: q {q.shape}, "
                         f"k {k.shape}")
    group = Hq // Hkv if Hkv else 1
    v4 = None
    if v is not None:
        v4 = _to_bhsd4("v", v, layout)
        if v4.shape[:3] != (B, Hkv, Lk):
            raise ValueError(f"v must match k in batch, heads and length: k {k.shape}, "
                             f"v {v.shape}")
        v4 = np.repeat(v4, group, axis=1)
    full = (B, Hq, Lq, Lk)[4 - ndim:]  # the logits shape in the user's ndim

    if scale is None:
        scale = 1.0 / math.sqrt(D) if D > 0 else 1.0
    s = scale * (q4 @ np.repeat(k4, group, axis=1).swapaxes(-1, -2))       # 1.
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)                                 # 2.
    i = np.arange(Lq)[:, None]
    j = np.arange(Lk)[None, :]
    if alibi_slopes is not None:                                           # 3.
        sl = _as_float("alibi_slopes", alibi_slopes)
        if sl.shape == (Hq,):
            sl = sl[None, :, None, None]
        elif ndim == 4 and sl.shape == (B, Hq):
            sl = sl[:, :, None, None]
        else:
            raise ValueError(f"alibi_slopes must have shape (Hq,) or (B, Hq) = "
                             f"{(Hq,)} or {(B, Hq)}, got {sl.shape} (q {q.shape})")
        s = s - sl * np.abs(i + Lk - Lq - j)
    if bias is not None:                                                   # 4.
        b = _as_float("bias", bias)
        s = s + _broadcast("bias", b, full).reshape(B, Hq, Lq, Lk)
    vis = np.ones((Lq, Lk), dtype=bool)                                    # 5.
    a = i if mode == "top-left" else i + (Lk - Lq)
    if mode is not None:
        vis &= j <= a
    if left is not None:
        vis &= j >= a - left
    if right is not None:
        vis &= j <= a + right
    if mask is not None:
        m = np.asarray(mask)
        if m.dtype != np.bool_:
            raise TypeError(f"mask must be a bool array, got dtype {m.dtype} with shape "
                            f"{m.shape}")
        vis = vis & _broadcast("mask", m, full).reshape(B, Hq, Lq, Lk)
    return np.where(vis, s, _NEG_INF), v4, ndim


def _broadcast(name, a, full):
    try:
        ok = np.broadcast_shapes(a.shape, full) == full
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{name} of shape {a.shape} does not broadcast to the logits "
                         f"shape {full}")
    return np.broadcast_to(a, full)


def _softmax(s):
    """Steps 6-7: (weights, lse, live) with live = keys not at -inf."""
    live = s != _NEG_INF                     # NaN stays live: it must propagate
    any_live = live.any(axis=-1, keepdims=True)
    m = np.max(s, axis=-1, keepdims=True, initial=_NEG_INF)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        p = np.where(live, np.exp(s - np.where(any_live, m, 0.0)), 0.0)
        denom = p.sum(axis=-1, keepdims=True)
        lse = np.where(any_live, m + np.log(denom), _NEG_INF)[..., 0]
        w = np.divide(p, denom, out=np.zeros_like(p), where=any_live)
    return w, lse, live


def _weighted_values(w, live, v4):
    """out = w @ v, except that a non-finite value only reaches rows that see it."""
    fin = np.isfinite(v4)
    out = w @ np.where(fin, v4, 0.0)
    with np.errstate(invalid="ignore"):
        for c in np.nonzero(~fin.all(axis=(0, 1, 2)))[0]:
            out[..., c] = np.where(live, w * v4[:, :, None, :, c], 0.0).sum(axis=-1)
    return out


@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, scale: float | None = ...,
              causal: Causal = ..., window: Window = ..., mask: ArrayLike | None = ...,
              bias: ArrayLike | None = ..., alibi_slopes: ArrayLike | None = ...,
              softcap: float | None = ..., layout: Layout = ...,
              return_lse: Literal[False] = ..., out: Any = ..., num_threads: Any = ...) -> F64: ...


@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, scale: float | None = ...,
              causal: Causal = ..., window: Window = ..., mask: ArrayLike | None = ...,
              bias: ArrayLike | None = ..., alibi_slopes: ArrayLike | None = ...,
              softcap: float | None = ..., layout: Layout = ...,
              return_lse: Literal[True], out: Any = ..., num_threads: Any = ...
              ) -> Tuple[F64, F64]: ...


def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, scale: float | None = None,
              causal: Causal = False, window: Window = None, mask: ArrayLike | None = None,
              bias: ArrayLike | None = None, alibi_slopes: ArrayLike | None = None,
              softcap: float | None = None, layout: Layout = "bhsd",
              return_lse: bool = False, out: Any = None, num_threads: Any = None
              ) -> Union[F64, Tuple[F64, F64]]:
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
    layout : "bhsd" or "bshd".
    return_lse : bool, also return the log-sum-exp.
    out, num_threads : accepted for signature compatibility; ``out`` is ignored.

    Returns
    -------
    out : float64 array, same layout and ndim as q with Dv last.
    lse : float64 array (..., Hq, Lq), only if ``return_lse``.
    """
    s, v4, ndim = _logits(q, k, v, scale, causal, window, mask, bias, alibi_slopes,
                          softcap, layout, num_threads)
    w, lse, live = _softmax(s)
    o = _from_bhsd4(_weighted_values(w, live, v4), ndim, layout)
    if return_lse:
        return o, lse.reshape(lse.shape[4 - ndim:])
    return o


def attention_weights(q: ArrayLike, k: ArrayLike, *, scale: float | None = None,
                      causal: Causal = False, window: Window = None,
                      mask: ArrayLike | None = None, bias: ArrayLike | None = None,
                      alibi_slopes: ArrayLike | None = None, softcap: float | None = None,
                      layout: Layout = "bhsd") -> F64:
    """The attention weight matrix, float64, shape (..., Hq, Lq, Lk) in any layout.

    Arguments as for :func:`attention`.  Rows sum to 1; rows with no visible key are 0.
    """
    s, _, ndim = _logits(q, k, None, scale, causal, window, mask, bias, alibi_slopes,
                         softcap, layout, None)
    w = _softmax(s)[0]
    return w.reshape(w.shape[4 - ndim:])


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
                     return_lse: bool = False) -> Union[F64, Tuple[F64, F64]]:
    """Attention over packed ragged batches, one independent problem per sequence.

    Parameters
    ----------
    q : array (total_q, Hq, D); k : (total_k, Hkv, D); v : (total_k, Hkv, Dv).
    cu_seqlens_q, cu_seqlens_k : int arrays (nseq + 1,), starting at 0, non-decreasing,
        ending at total_q / total_k.  Sequence s uses q rows cu_q[s]:cu_q[s+1] and key
        rows cu_k[s]:cu_k[s+1]; causal and window are aligned per sequence.
    alibi_slopes : float array (Hq,).
    Other arguments as for :func:`attention`.

    Returns
    -------
    out : float64 (total_q, Hq, Dv); lse : float64 (Hq, total_q), only if ``return_lse``.
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    for name, a in (("q", q), ("k", k), ("v", v)):
        if np.ndim(a) != 3:
            raise ValueError(f"{name} must be 3-D (total, H, D), got shape {np.shape(a)}")
    kw: dict[str, Any] = dict(scale=scale, causal=causal, window=window,
                              alibi_slopes=alibi_slopes, softcap=softcap, layout="bshd")
    o0, _ = attention(q[:0], k[:0], v[:0], return_lse=True, **kw)    # validates everything cheaply
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
        out[qs:qe], lse[:, qs:qe] = attention(q[qs:qe], k[ks:ke], v[ks:ke], return_lse=True,
                                              **kw)
    return (out, lse) if return_lse else out
