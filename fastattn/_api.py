"""fastattn's public entry points: argument checking, shapes and strides, dtype,
thread count.  The maths is in C (src_c/), reached through fastattn._kernels."""

import math
import numbers

import numpy as np

from . import _kernels

__all__ = ["attention"]

_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
_CAUSAL = {"bottom-right": 1, "top-left": 2}


def _describe(**arrays):
    return ", ".join(f"{n}{tuple(a.shape)}" for n, a in arrays.items())


def _as_array(x, name):
    if type(x) is np.ndarray:
        return x
    try:
        return np.asarray(x)
    except Exception as e:  # noqa: BLE001 -- reported as a TypeError naming the argument
        raise TypeError(f"fastattn.attention: {name} must be an array, got {type(x).__name__}") from e


def _check_dtypes(q, k, v):
    dt = q.dtype
    if dt != _F32 and dt != _F64:
        raise TypeError(f"fastattn.attention: q has dtype {dt}; supported dtypes are float32 and "
                        "float64 (native byte order)")
    if k.dtype != dt or v.dtype != dt:
        raise TypeError(f"fastattn.attention: q, k and v must share one dtype, got "
                        f"q {dt}, k {k.dtype}, v {v.dtype}")


def _parse_causal(causal):
    if causal is False or causal is None:
        return 0
    if causal is True:
        return 1
    if isinstance(causal, np.bool_):
        return 1 if causal else 0
    if isinstance(causal, str) and causal in _CAUSAL:
        return _CAUSAL[causal]
    raise ValueError(
        f"fastattn.attention: causal must be False, True, 'bottom-right' or 'top-left', got {causal!r}")


def _parse_scale(scale, D):
    if scale is None:
        return 1.0 / math.sqrt(D) if D > 0 else 1.0
    if type(scale) is float and math.isfinite(scale):
        return scale
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"fastattn.attention: scale must be a real number, got {type(scale).__name__}")
    s = float(scale)
    if not math.isfinite(s):
        raise ValueError(f"fastattn.attention: scale must be finite, got {scale!r}")
    return s


def _parse_threads(num_threads):
    if num_threads is None:
        return 0
    if isinstance(num_threads, (bool, np.bool_)) or not isinstance(num_threads, numbers.Integral):
        raise TypeError(
            f"fastattn.attention: num_threads must be an int or None, got {type(num_threads).__name__}")
    n = int(num_threads)
    if n < 1:
        raise ValueError(f"fastattn.attention: num_threads must be >= 1, got {n}")
    return min(n, 1 << 16)


def _check_out(out, shape, dtype, inputs):
    if not isinstance(out, np.ndarray):
        raise TypeError(f"fastattn.attention: out must be a numpy array, got {type(out).__name__}")
    if out.shape != shape:
        raise ValueError(f"fastattn.attention: out has shape {out.shape}, expected {shape}")
    if out.dtype != dtype:
        raise TypeError(f"fastattn.attention: out has dtype {out.dtype}, expected {dtype}")
    if not out.flags.writeable:
        raise ValueError("fastattn.attention: out is read-only")
    item = dtype.itemsize
    if (shape[-1] > 1 and out.strides[-1] != item) or any(s % item for s in out.strides) \
            or not out.flags.aligned:
        raise ValueError("fastattn.attention: out must have a contiguous last axis, aligned, "
                         f"with strides that are whole elements; got strides {out.strides}")
    if any(s == 0 and n > 1 for s, n in zip(out.strides, out.shape)):
        raise ValueError(f"fastattn.attention: out has a zero stride (a broadcast view), strides {out.strides}")
    for name, a in inputs.items():
        if np.may_share_memory(out, a) and np.shares_memory(out, a, max_work=10_000):
            raise ValueError(f"fastattn.attention: out overlaps {name}; pass a separate output array")


def attention(q, k, v, *, scale=None, causal=False, return_lse=False, out=None, num_threads=None):
    """Exact scaled dot-product attention, ``softmax(scale * q @ k^T) @ v``.

    Computed by a blocked online softmax (FlashAttention-2 loop) in C, OpenMP-parallel
    over (batch, head, query block), with SIMD micro-kernels chosen for this CPU at
    import.  Extra memory is O(block size) per thread: the Lq x Lk score matrix is
    never formed.

    Parameters
    ----------
    q : ndarray, shape (Lq, D), (Hq, Lq, D) or (B, Hq, Lq, D)
        Queries, float32 or float64.
    k : ndarray, shape (Lk, D), (Hkv, Lk, D) or (B, Hkv, Lk, D)
        Keys, same dtype and ndim as `q`.  ``Hq`` must be a multiple of ``Hkv``:
        query head ``h`` reads key/value head ``h // (Hq // Hkv)`` (grouped-query
        attention; no copy of k or v is made).
    v : ndarray, shape (Lk, Dv), (Hkv, Lk, Dv) or (B, Hkv, Lk, Dv)
        Values, same dtype and ndim; ``Dv`` may differ from ``D``.
    scale : float, optional
        Multiplies ``q . k``.  Default ``1 / sqrt(D)``.  Any finite value: 0 gives
        the plain mean of the visible values, negative values are allowed.
    causal : {False, True, 'bottom-right', 'top-left'}, optional
        ``True`` or ``'bottom-right'``: key ``j`` is visible to query ``i`` iff
        ``j <= i + (Lk - Lq)`` (the last query sees the last key, right for decoding
        against a cache).  ``'top-left'``: ``j <= i`` (PyTorch's ``is_causal``).
        Equal lengths: the same.
    return_lse : bool, optional
        Also return ``lse = log(sum_j exp(s_ij))`` (natural log) over visible keys.
    out : ndarray, optional
        Where to write the output: shape ``(..., Hq, Lq, Dv)``, ``q``'s dtype,
        contiguous last axis, not overlapping ``q``, ``k`` or ``v``.
    num_threads : int, optional
        Threads to use; default OpenMP's (``OMP_NUM_THREADS``, threadpoolctl).
        Results are bitwise identical for any value.

    Returns
    -------
    out : ndarray, shape (..., Hq, Lq, Dv), q's dtype
    lse : ndarray, shape (..., Hq, Lq), q's dtype
        Only with ``return_lse=True``.

    Notes
    -----
    A query row that sees no key (causal with ``Lq > Lk``, or ``Lk = 0``) gives an
    output row of zeros and ``lse = -inf``.  Inputs may be any strided views whose
    last axis is contiguous (e.g. slices of a fused QKV projection); they are used in
    place.  Other layouts are copied once.  The GIL is released during the kernel.
    """
    # The common call is checked and run in compiled code (a short call must cost a
    # few microseconds); anything else, and every error, takes the path below.
    if (out is None and scale is None and (causal is False or causal is True)
            and (return_lse is False or return_lse is True)
            and (num_threads is None or type(num_threads) is int and num_threads >= 1)):
        res = _kernels.attention_common(q, k, v, causal, return_lse, num_threads or 0)
        if res is not None:
            return res
    if type(q) is not np.ndarray:
        q = _as_array(q, "q")
    if type(k) is not np.ndarray:
        k = _as_array(k, "k")
    if type(v) is not np.ndarray:
        v = _as_array(v, "v")
    dt = q.dtype
    if dt is not _F32 and dt is not _F64:
        _check_dtypes(q, k, v)
    if k.dtype is not dt or v.dtype is not dt:
        _check_dtypes(q, k, v)
    nd = q.ndim
    if nd < 2 or nd > 4 or k.ndim != nd or v.ndim != nd:
        raise ValueError("fastattn.attention: q, k and v must all be 2-D (L, D), 3-D (H, L, D) or "
                         f"4-D (B, H, L, D); got {_describe(q=q, k=k, v=v)}")
    qs, ks, vs = q.shape, k.shape, v.shape
    D = qs[-1]
    Lk = ks[-2]
    if ks[-1] != D or vs[-2] != Lk or qs[:-3] != ks[:-3] or ks[:-1] != vs[:-1]:
        raise ValueError("fastattn.attention: shapes do not match: need q (..., Hq, Lq, D), "
                         f"k (..., Hkv, Lk, D), v (..., Hkv, Lk, Dv); got {_describe(q=q, k=k, v=v)}")
    if nd > 2:
        Hq, Hkv = qs[-3], ks[-3]
        if Hkv == 0 and Hq != 0 or Hkv and Hq % Hkv:
            raise ValueError("fastattn.attention: the number of query heads must be a multiple of "
                             f"the number of key/value heads; got {_describe(q=q, k=k, v=v)}")
    if return_lse is not False and return_lse is not True and not isinstance(return_lse, np.bool_):
        raise TypeError(f"fastattn.attention: return_lse must be a bool, got {type(return_lse).__name__}")
    causal_code = 0 if causal is False else 1 if causal is True else _parse_causal(causal)
    scale_f = _parse_scale(scale, D)
    nth = 0 if num_threads is None else _parse_threads(num_threads)

    out_shape = qs[:-1] + (vs[-1],)
    if out is None:
        out = np.empty(out_shape, dtype=dt)
    else:
        _check_out(out, out_shape, dt, {"q": q, "k": k, "v": v})
    lse = np.empty(qs[:-1], dtype=dt) if return_lse else None

    if out.size or lse is not None and lse.size:
        _run(q, k, v, out, lse, scale_f, causal_code, nth)
    return (out, lse) if return_lse else out


def _run(q, k, v, out, lse, scale, causal, nth):
    if q.shape[-1] == 0 or k.shape[-2] and v.shape[-1] == 0:
        _run_degenerate(q, k, v, out, lse, scale, causal, nth)
    elif not _kernels.forward(q, k, v, out, lse, scale, causal, nth):
        # an input the kernel cannot read in place (misaligned, a non-contiguous last
        # axis, strides that are not whole elements): one contiguous copy of each
        q, k, v = (np.ascontiguousarray(a) for a in (q, k, v))
        _kernels.forward(q, k, v, out, lse, scale, causal, nth)


def _run_degenerate(q, k, v, out, lse, scale, causal, nth):
    """D = 0 (every logit is 0) or Dv = 0 (nothing to write but lse): run the kernel
    on feature size 1 (zero q/k, or a zero value column) and keep what is asked."""
    dt = q.dtype
    if q.shape[-1] == 0:
        q = np.zeros(q.shape[:-1] + (1,), dt)
        k = np.zeros(k.shape[:-1] + (1,), dt)
    if v.shape[-1] == 0:
        v = np.zeros(v.shape[:-1] + (1,), dt)
        tmp = np.empty(out.shape[:-1] + (1,), dt)
        _run(q, k, v, tmp, lse, scale, causal, nth)
        return
    _run(q, k, v, out, lse, scale, causal, nth)
