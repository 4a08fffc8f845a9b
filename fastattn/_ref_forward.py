"""The forward's steps of the float64 oracle (:mod:`fastattn.reference`): the arguments
checked and viewed as (B, H, L, D), the logits with every variant, the softmax (with
sinks), dropout and the weighted values.  Its public functions are in
fastattn/reference.py."""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import numpy as np

from ._ref_dropout import _check_dropout, _keep

F64 = np.ndarray  # float64 results (annotated loosely: NumPy's generics add nothing here)
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


class _Logits(NamedTuple):
    s: F64            # (B, Hq, Lq, Lk) logits after steps 1-5, -inf on hidden keys
    v4: Optional[F64]  # (B, Hq, Lk, Dv): v per query head, or None
    ndim: int         # the user's ndim
    q4: F64           # (B, Hq, Lq, D)
    k4: F64           # (B, Hq, Lk, D): k per query head
    raw: F64          # (B, Hq, Lq, Lk): scale * q.k, before the softcap
    scale: float      # resolved (the default applied)
    softcap: Optional[float]
    full: Tuple[int, ...]  # the logits shape in the user's ndim
    hkv: int          # kv heads; query head h reads kv head h // group
    group: int


def _check_offsets(q_offset, k_offset, mode):
    """(q_offset, k_offset) as ints, or None when both are None (the lengths decide)."""
    if q_offset is None and k_offset is None:
        return None
    offs = []
    for name, x in (("q_offset", q_offset), ("k_offset", k_offset)):
        x = 0 if x is None else x
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
            raise TypeError(f"{name} must be an int or None, got {x!r}")
        offs.append(int(x))
    if mode == "top-left":
        raise ValueError("causal='top-left' aligns by the lengths; with q_offset/k_offset the "
                         "positions decide the diagonal: pass causal=True")
    return offs[0], offs[1]


def _logits(q, k, v, scale, causal, window, mask, bias, alibi_slopes, softcap, layout,
            num_threads, q_offset=None, k_offset=None):
    """Steps 1-5: the logits and what the backward needs besides (see _Logits).  With
    q_offset/k_offset, query i and key j sit at positions q_offset + i and
    k_offset + j, which decide the diagonal and the ALiBi distance."""
    scale, mode, left, right, softcap = _check_options(scale, causal, window, softcap,
                                                       layout, num_threads)
    offsets = _check_offsets(q_offset, k_offset, mode)
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
    k4 = np.repeat(k4, group, axis=1)
    s = raw = scale * (q4 @ k4.swapaxes(-1, -2))                           # 1.
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
        apos = i + (offsets[0] - offsets[1] if offsets else Lk - Lq)
        s = s - sl * np.abs(apos - j)
    if bias is not None:                                                   # 4.
        b = _as_float("bias", bias)
        s = s + _broadcast("bias", b, full).reshape(B, Hq, Lq, Lk)
    vis = np.ones((Lq, Lk), dtype=bool)                                    # 5.
    if offsets:  # the positions' diagonal
        a = i + (offsets[0] - offsets[1])
    else:
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
    return _Logits(np.where(vis, s, _NEG_INF), v4, ndim, q4, k4, raw, scale, softcap, full,
                   Hkv, group)


def _broadcast(name, a, full):
    try:
        ok = np.broadcast_shapes(a.shape, full) == full
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{name} of shape {a.shape} does not broadcast to the logits "
                         f"shape {full}")
    return np.broadcast_to(a, full)


def _sink_column(sinks, s):
    """The sinks (Hq,) as one more logit column of s (B, Hq, Lq, Lk)."""
    a = _as_float("sinks", sinks)
    if a.shape != (s.shape[1],):
        raise ValueError(f"sinks must have shape (Hq,) = ({s.shape[1]},), got {a.shape}")
    return np.broadcast_to(a[None, :, None, None], s.shape[:-1] + (1,))


def _softmax(s, sinks=None):
    """Steps 6-7: (weights, lse, live) with live = keys not at -inf.  With sinks, the
    softmax is over the keys and one more logit per head, whose weight is dropped:
    lse includes it and the weights sum to 1 minus it."""
    if sinks is not None:
        w, lse, live = _softmax(np.concatenate([s, _sink_column(sinks, s)], axis=-1))
        return w[..., :-1], lse, live[..., :-1]
    live = s != _NEG_INF                     # NaN stays live: it must propagate
    any_live = live.any(axis=-1, keepdims=True)
    m = np.max(s, axis=-1, keepdims=True, initial=_NEG_INF)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        p = np.where(live, np.exp(s - np.where(any_live, m, 0.0)), 0.0)
        denom = p.sum(axis=-1, keepdims=True)
        lse = np.where(any_live, m + np.log(denom), _NEG_INF)[..., 0]
        w = np.divide(p, denom, out=np.zeros_like(p), where=any_live)
    return w, lse, live


def _dropout_factor(dropout_p, seed, shape, b0=0):
    """Step 11: keep / (1 - p) of shape (B, Hq, Lq, Lk), or None without dropout."""
    p, seed = _check_dropout(dropout_p, seed)
    if p == 0.0:
        return None
    return _keep(seed, p, *shape, b0=b0) / (1.0 - p)


def _weighted_values(w, live, v4):
    """out = w @ v, except that a non-finite value only reaches rows that see it."""
    fin = np.isfinite(v4)
    out = w @ np.where(fin, v4, 0.0)
    with np.errstate(invalid="ignore"):
        for c in np.nonzero(~fin.all(axis=(0, 1, 2)))[0]:
            out[..., c] = np.where(live, w * v4[:, :, None, :, c], 0.0).sum(axis=-1)
    return out


def _forward(q, k, v, scale, causal, window, mask, bias, alibi_slopes, softcap, dropout_p,
             seed, layout, num_threads, b0, q_offset=None, k_offset=None, sinks=None):
    """(out, lse) in the user's shapes; dropout batch indices start at b0."""
    lg = _logits(q, k, v, scale, causal, window, mask, bias, alibi_slopes, softcap, layout,
                 num_threads, q_offset, k_offset)
    z = _dropout_factor(dropout_p, seed, lg.s.shape, b0)
    w, lse, live = _softmax(lg.s, sinks)
    o = _from_bhsd4(_weighted_values(w if z is None else w * z, live, lg.v4), lg.ndim,
                    layout)
    return o, lse.reshape(lse.shape[4 - lg.ndim:])
