"""fastattn's public entry points: argument checking, broadcasting, layout and
strides, dtype, thread count.  The maths is in C (src_c/), reached through
fastattn._kernels; this module only decides what to pass."""

from __future__ import annotations

import math
import numbers
from typing import Any, Literal, NamedTuple, Sequence, Tuple, Union, overload

import numpy as np

from . import _kernels
from ._typing import Array, ArrayLike, Causal, FloatArray, Layout, Window

__all__ = ["attention", "attention_backward", "attention_weights", "key_mass", "merge",
           "varlen_attention", "AttentionStats"]


class AttentionStats(NamedTuple):
    """Per-row statistics of the weights (``attention(..., return_stats=True)``), each
    of shape ``(..., Hq, Lq)`` like lse, float64 for float64 inputs, else float32.

    entropy : ``H = -sum_j p_j log p_j`` in nats, computed in the online pass
        (``H = log l - sum_j e^(s_j - m) (s_j - m) / l``): 0 at a vertex of the
        simplex (one key takes all the weight), ``log n`` at its centre.
    effective_support : ``exp(H)``, how many keys the row really uses (1 .. n).
    max_weight : the row's largest weight ``exp(max_j s_j - lse)``.

    A row that sees no key has 0 in all three (it has no weights; 0 keeps means over
    rows finite).  With dropout they describe the weights before dropout, like lse."""
    entropy: Any
    effective_support: Any
    max_weight: Any


def _stats(entropy, max_weight, lse):
    none = np.isneginf(lse)
    support = np.exp(entropy)
    support[none] = 0
    return AttentionStats(entropy, support, max_weight)

_F16 = np.dtype(np.float16)
_F32 = np.dtype(np.float32)
try:  # bfloat16 arrays come from ml_dtypes (the dtype JAX and others use)
    import ml_dtypes as _ml_dtypes
    _BF16: np.dtype | None = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # then no array can have that dtype
    _BF16 = None
_F64 = np.dtype(np.float64)
_CAUSAL = {"bottom-right": 1, "top-left": 2}
_LAYOUTS = ("bhsd", "bshd")


def _describe(**arrays):
    return ", ".join(f"{n}{tuple(np.shape(a))}" for n, a in arrays.items())


def _torch_problem(x, name, fn):
    """Why NumPy could not view the torch tensor `x`, and the fix; None if `x` is not
    a torch tensor.  Called only after np.asarray(x) failed, which for a CPU tensor
    that does not require grad means its dtype has no NumPy equivalent."""
    if not type(x).__module__.startswith("torch"):
        return None
    device = x.device
    if device.type != "cpu":
        return (f"fastattn.{fn}: {name} is a torch tensor on device '{device}'; fastattn runs on "
                f"the CPU: pass {name}.cpu()")
    if x.requires_grad:
        return (f"fastattn.{fn}: {name} is a torch tensor that requires grad; the NumPy API "
                f"does not record gradients: pass {name}.detach() (gradients: "
                "fastattn.torch.scaled_dot_product_attention, or fastattn.attention_backward)")
    return (f"fastattn.{fn}: {name} is a torch tensor of dtype {x.dtype}; supported dtypes are "
            f"float32 and float64 (and float16 for k and v): convert it, e.g. {name}.float()")


def _as_array(x, name, fn="attention"):
    if type(x) is np.ndarray:
        return x
    try:
        return np.asarray(x)
    except Exception as e:  # noqa: BLE001 -- reported as a TypeError naming the argument
        why = _torch_problem(x, name, fn)
        if why is not None:
            raise TypeError(why) from e
        raise TypeError(f"fastattn.{fn}: {name} must be an array (or something NumPy can view "
                        f"as one), got {type(x).__name__}: {e}") from e


def _is_float(dt):
    """A float dtype fastattn reads: NumPy's, or ml_dtypes' bfloat16."""
    return dt.kind == "f" or (_BF16 is not None and dt == _BF16)


def _dtypes(fn, **arrays):
    """(compute, output, lse) dtypes of a call: all float32, all float64, or 16-bit
    K/V (float16, or bfloat16 from ml_dtypes) with float32 q or q of the same 16-bit
    type, which the kernel converts to float32 in registers; the output takes q's
    dtype, lse is float32 unless float64."""
    q = arrays["q"]
    dq, dkv = q.dtype, {a.dtype for n, a in arrays.items() if n != "q"}
    if dkv == {dq} and (dq == _F32 or dq == _F64):
        return dq, dq, dq
    for half in (_F16, _BF16):
        if half is not None and dkv == {half} and (dq == _F32 or dq == half):
            return _F32, dq, _F32
    if dq not in (_F32, _F64, _F16, _BF16):
        raise TypeError(f"fastattn.{fn}: q has dtype {dq}; supported dtypes are float32, float64 "
                        "and, for k and v (with float32 q or q of their dtype), float16 or "
                        "bfloat16 (ml_dtypes.bfloat16), native byte order")
    raise TypeError(f"fastattn.{fn}: unsupported dtype combination "
                    + ", ".join(f"{n} {a.dtype}" for n, a in arrays.items())
                    + "; q, k and v must share float32 or float64, or k and v be float16 (or "
                    "bfloat16) with float32 q or q of the same 16-bit type")


def _parse_causal(causal, fn="attention"):
    if causal is False or causal is None:
        return 0
    if causal is True:
        return 1
    if isinstance(causal, np.bool_):
        return 1 if causal else 0
    if isinstance(causal, str) and causal in _CAUSAL:
        return _CAUSAL[causal]
    raise ValueError(
        f"fastattn.{fn}: causal must be False, True, 'bottom-right' or 'top-left', got {causal!r}")


def _parse_scale(scale, D, fn="attention"):
    if scale is None:
        return 1.0 / math.sqrt(D) if D > 0 else 1.0
    if type(scale) is float and math.isfinite(scale):
        return scale
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"fastattn.{fn}: scale must be a real number, got {type(scale).__name__}")
    s = float(scale)
    if not math.isfinite(s):
        raise ValueError(f"fastattn.{fn}: scale must be finite, got {scale!r}")
    return s


def _parse_softcap(softcap, fn):
    if softcap is None:
        return 0.0
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"fastattn.{fn}: softcap must be a real number or None, "
                        f"got {type(softcap).__name__}")
    c = float(softcap)
    if not (math.isfinite(c) and c > 0):
        raise ValueError(f"fastattn.{fn}: softcap must be finite and > 0, got {softcap!r}")
    return c


def _parse_window(window, fn):
    """(left, right) with -1 for an unbounded side; None or -1 on a side means
    unbounded (FlashAttention's convention)."""
    if window is None:
        return -1, -1
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"fastattn.{fn}: window must be a (left, right) pair, got {window!r}") from None
    sides = []
    for name, w in (("left", left), ("right", right)):
        if w is None:
            sides.append(-1)
            continue
        if isinstance(w, (bool, np.bool_)) or not isinstance(w, numbers.Integral):
            raise TypeError(f"fastattn.{fn}: window {name} size must be an int or None, got {w!r}")
        if w == -1:
            sides.append(-1)
            continue
        if w < 0:
            raise ValueError(f"fastattn.{fn}: window {name} size must be >= 0, or -1 or None "
                             f"for unbounded; got window={window!r}")
        sides.append(min(int(w), 2**62))
    return sides[0], sides[1]


def _parse_dropout(dropout_p, seed, fn):
    """(p, seed) of a call: 0 <= p < 1, and with p > 0 an int seed in [0, 2**64)."""
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"fastattn.{fn}: dropout_p must be a real number in [0, 1), got "
                        f"{type(dropout_p).__name__}")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"fastattn.{fn}: dropout_p must be in [0, 1), got {dropout_p!r}")
    if seed is None:
        if p > 0:
            raise ValueError(f"fastattn.{fn}: dropout_p={dropout_p!r} > 0 needs a seed (an int "
                             "in [0, 2**64)): the same seed gives the same dropped weights in "
                             "the forward and the backward")
        return p, 0
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"fastattn.{fn}: seed must be an int, got {type(seed).__name__}")
    if not 0 <= int(seed) < 2**64:
        raise ValueError(f"fastattn.{fn}: seed must be in [0, 2**64), got {seed!r}")
    return p, int(seed)


def _parse_threads(num_threads, fn="attention"):
    if num_threads is None:
        return 0
    if isinstance(num_threads, (bool, np.bool_)) or not isinstance(num_threads, numbers.Integral):
        raise TypeError(
            f"fastattn.{fn}: num_threads must be an int or None, got {type(num_threads).__name__}")
    n = int(num_threads)
    if n < 1:
        raise ValueError(f"fastattn.{fn}: num_threads must be >= 1, got {n}")
    return min(n, 1 << 16)


def _parse_flag(value, name, fn):
    if value is not False and value is not True and not isinstance(value, np.bool_):
        raise TypeError(f"fastattn.{fn}: {name} must be a bool, got {type(value).__name__}")
    return bool(value)


def _fresh(a, dtype=None):
    """A new C-contiguous copy: freshly allocated, so aligned (np.ascontiguousarray
    returns an unaligned array unchanged when it is already contiguous)."""
    return np.array(a, dtype=dtype, order="C", copy=True)


def _compact(a, dt):
    """`a` in dtype dt, aligned, with strides of whole elements: the kernel reads it in
    place.  Called on the caller's own (un-broadcast) array, so a copy is never larger
    than what the caller passed."""
    if a.dtype != dt or not a.flags.aligned or any(s % dt.itemsize for s in a.strides):
        return _fresh(a, dt)
    return a


def _in_place(a, dt):
    """`a` as the kernel reads it in place: dtype dt, aligned, whole-element strides and
    a contiguous last axis (the rule of _kernels' readable check); else a fresh copy."""
    a = _compact(a, dt)
    if a.size and a.shape[-1] > 1 and a.strides[-1] != dt.itemsize:
        return _fresh(a)
    return a


def _broadcast4(a, name, full, fn):
    """A (B, Hq, Lq, Lk) view of `a` broadcast (right-aligned, stride 0) against the
    logits shape `full` of the user's ndim; nothing is materialized."""
    try:
        ok = np.broadcast_shapes(a.shape, full) == full
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"fastattn.{fn}: {name} of shape {a.shape} does not broadcast to the "
                         f"logits shape {full} (B, Hq, Lq, Lk)")
    return np.broadcast_to(a, full).reshape((1,) * (4 - len(full)) + full)


def _check_axes(fn, layout, nd, qs, ks, vs, shapes):
    """Raise a ValueError naming the first axis on which q, k and v (as (..., H, L, D)
    shapes, already in the bhsd order) disagree."""
    order = "(..., L, H, D)" if layout == "bshd" and nd > 2 else "(..., H, L, D)"
    tail = f" (q, k, v are {order}; got {shapes})"

    def differ(what, a_name, a, b_name, b):
        if a != b:
            raise ValueError(f"fastattn.{fn}: {a_name} has {what}={a} but {b_name} has "
                             f"{what}={b}" + tail)

    differ("D", "q", qs[-1], "k", ks[-1])
    if vs is not None:
        differ("Lk", "k", ks[-2], "v", vs[-2])
    if nd == 4:
        differ("B", "q", qs[0], "k", ks[0])
        if vs is not None:
            differ("B", "k", ks[0], "v", vs[0])
    if nd > 2:
        if vs is not None:
            differ("Hkv", "k", ks[-3], "v", vs[-3])
        hq, hkv = qs[-3], ks[-3]
        if (hkv == 0 and hq != 0) or (hkv and hq % hkv):
            raise ValueError(f"fastattn.{fn}: q has Hq={hq} heads, which is not a multiple of "
                             f"the Hkv={hkv} heads of k and v (grouped-query attention needs "
                             f"Hq % Hkv == 0)" + tail)


class _Problem:
    """q, k, v of one call as (…, H, L, D) views in the "bhsd" order, with the sizes."""

    def __init__(self, fn, q, k, v, layout):
        if layout not in _LAYOUTS:
            raise ValueError(f"fastattn.{fn}: layout must be 'bhsd' or 'bshd', got {layout!r}")
        arrays = {"q": q, "k": k} if v is None else {"q": q, "k": k, "v": v}
        self.dtype, self.out_dtype, self.lse_dtype = _dtypes(fn, **arrays)
        nd = q.ndim
        if nd < 2 or nd > 4 or any(a.ndim != nd for a in arrays.values()):
            odd = [f"{n} is {a.ndim}-D" for n, a in arrays.items() if a.ndim != nd]
            what = f"q is {nd}-D but " + ", ".join(odd) if odd else f"q is {nd}-D"
            raise ValueError(f"fastattn.{fn}: q, k and v must all be 2-D (L, D), 3-D (H, L, D) or "
                             f"4-D (B, H, L, D): {what}; got {_describe(**arrays)}")
        self.user_shapes = _describe(**arrays)
        if layout == "bshd" and nd > 2:
            q, k = q.swapaxes(-2, -3), k.swapaxes(-2, -3)
            v = None if v is None else v.swapaxes(-2, -3)
        _check_axes(fn, layout, nd, q.shape, k.shape, None if v is None else v.shape,
                    self.user_shapes)
        qs, ks = q.shape, k.shape
        self.Hq = qs[-3] if nd > 2 else 1
        self.Hkv = ks[-3] if nd > 2 else 1
        self.fn, self.nd, self.layout = fn, nd, layout
        self.q, self.k, self.v = q, k, v
        self.B = qs[0] if nd == 4 else 1
        self.Lq, self.D, self.Lk = qs[-2], qs[-1], ks[-2]
        self.logits_shape = (self.B, self.Hq, self.Lq, self.Lk)[4 - nd:]

    def seqlens(self, seqlens_k):
        """seqlens_k checked: an int array (B,) with entries in [0, Lk], as int64."""
        fn = self.fn
        a = _as_array(seqlens_k, "seqlens_k", fn)
        if a.dtype.kind not in "iu":
            raise TypeError(f"fastattn.{fn}: seqlens_k must be an integer array, got dtype {a.dtype}")
        if a.shape != (self.B,):
            raise ValueError(f"fastattn.{fn}: seqlens_k must have shape (B,) = ({self.B},), one key "
                             f"length per sequence, got {a.shape} ({self.user_shapes})")
        if a.size and (a.min() < 0 or a.max() > self.Lk):
            raise ValueError(f"fastattn.{fn}: seqlens_k must be in [0, Lk={self.Lk}], got "
                             f"{a.tolist() if a.size <= 20 else str(a[:20].tolist()) + '...'}")
        return _fresh(a, np.int64)

    def variants(self, window, mask, bias, alibi_slopes, softcap, dropout=(0.0, 0), seqlens_k=None):
        """The optional arguments as a _kernels.Variants (None if all are off);
        dropout is _parse_dropout's (p, seed)."""
        fn, dt = self.fn, self.dtype
        sl = None if seqlens_k is None else self.seqlens(seqlens_k)
        wl, wr = _parse_window(window, fn)
        cap = _parse_softcap(softcap, fn)
        m = b = al = None
        if mask is not None:
            m = _as_array(mask, "mask", fn)
            if m.dtype != np.bool_:
                raise TypeError(f"fastattn.{fn}: mask must be a bool array (True = attend), got "
                                f"dtype {m.dtype} with shape {m.shape}")
            m = _broadcast4(m, "mask", self.logits_shape, fn)
        if bias is not None:
            b = _as_array(bias, "bias", fn)
            if not _is_float(b.dtype):
                raise TypeError(f"fastattn.{fn}: bias must be a float array, got dtype {b.dtype} "
                                f"with shape {b.shape}")
            b = _broadcast4(_compact(b, dt), "bias", self.logits_shape, fn)
        if alibi_slopes is not None:
            al = _as_array(alibi_slopes, "alibi_slopes", fn)
            if al.dtype.kind not in "fiu" and not _is_float(al.dtype):
                raise TypeError(f"fastattn.{fn}: alibi_slopes must be a float array, got dtype "
                                f"{al.dtype}")
            shapes = [(self.Hq,)] + ([(self.B, self.Hq)] if self.nd == 4 else [])
            if al.shape not in shapes:
                raise ValueError(f"fastattn.{fn}: alibi_slopes must have shape "
                                 f"{' or '.join(map(str, shapes))}, got {al.shape} ({self.user_shapes})")
            al = np.broadcast_to(_compact(al, dt), (self.B, self.Hq))
        if m is None and b is None and al is None and cap == 0 and wl < 0 and wr < 0 \
                and dropout[0] == 0 and sl is None:
            return None
        va = _kernels.Variants(mask=m, bias=b, alibi=al, softcap=cap, window_left=wl,
                               window_right=wr, dropout_p=dropout[0], seed=dropout[1])
        va.seqlens_k = sl
        return va


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
    if out.size and ((shape[-1] > 1 and out.strides[-1] != item)
                     or any(s % item for s in out.strides) or not out.flags.aligned):
        raise ValueError("fastattn.attention: out must have a contiguous last axis, aligned, "
                         f"with strides that are whole elements; got strides {out.strides}")
    if out.size and any(s == 0 and n > 1 for s, n in zip(out.strides, out.shape)):
        raise ValueError(f"fastattn.attention: out has a zero stride (a broadcast view), strides {out.strides}")
    for name, a in inputs.items():
        if a is not None and np.may_share_memory(out, a) and np.shares_memory(out, a, max_work=10_000):
            raise ValueError(f"fastattn.attention: out overlaps {name}; pass a separate output array")


@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, scale: float | None = ...,
              causal: Causal = ..., window: Window = ..., mask: ArrayLike | None = ...,
              bias: ArrayLike | None = ..., alibi_slopes: ArrayLike | None = ...,
              softcap: float | None = ..., dropout_p: float = ..., seed: int | None = ...,
              seqlens_k: ArrayLike | None = ..., layout: Layout = ..., return_lse: Literal[False] = ...,
              return_stats: Literal[False] = ...,
              out: Array | None = ..., num_threads: int | None = ...) -> FloatArray: ...


@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, scale: float | None = ...,
              causal: Causal = ..., window: Window = ..., mask: ArrayLike | None = ...,
              bias: ArrayLike | None = ..., alibi_slopes: ArrayLike | None = ...,
              softcap: float | None = ..., dropout_p: float = ..., seed: int | None = ...,
              seqlens_k: ArrayLike | None = ..., layout: Layout = ..., return_lse: Literal[True],
              return_stats: Literal[False] = ...,
              out: Array | None = ..., num_threads: int | None = ...
              ) -> Tuple[FloatArray, FloatArray]: ...


@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, scale: float | None = ...,
              causal: Causal = ..., window: Window = ..., mask: ArrayLike | None = ...,
              bias: ArrayLike | None = ..., alibi_slopes: ArrayLike | None = ...,
              softcap: float | None = ..., dropout_p: float = ..., seed: int | None = ...,
              seqlens_k: ArrayLike | None = ..., layout: Layout = ..., return_lse: bool = ...,
              return_stats: bool = ...,
              out: Array | None = ..., num_threads: int | None = ...
              ) -> Union[FloatArray, Tuple[Any, ...]]: ...


def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, scale: float | None = None,
              causal: Causal = False, window: Window = None, mask: ArrayLike | None = None,
              bias: ArrayLike | None = None, alibi_slopes: ArrayLike | None = None,
              softcap: float | None = None, dropout_p: float = 0.0, seed: int | None = None,
              seqlens_k: ArrayLike | None = None, layout: Layout = "bhsd", return_lse: bool = False,
              return_stats: bool = False,
              out: Array | None = None, num_threads: int | None = None
              ) -> Union[FloatArray, Tuple[Any, ...]]:
    """Exact scaled dot-product attention, ``softmax(scale * q @ k^T + ...) @ v``.

    Computed by a blocked online softmax (FlashAttention-2 loop) in C, OpenMP-parallel
    over (batch, head group, query block), with SIMD micro-kernels chosen for this
    CPU at import.  Extra memory is O(block size) per thread: the Lq x Lk score
    matrix is never formed, and broadcast masks and biases are never expanded.

    Parameters
    ----------
    q : ndarray, shape (Lq, D), (Hq, Lq, D) or (B, Hq, Lq, D)
        Queries, float32 or float64 (with ``layout="bshd"``: (Lq, Hq, D) or
        (B, Lq, Hq, D)); float16 with float16 k and v.
    k : ndarray, shape (Lk, D), (Hkv, Lk, D) or (B, Hkv, Lk, D)
        Keys, same dtype, ndim and layout as `q`, or float16 with a float32 (or
        float16) `q`: a float16 KV cache is read at half the bytes and converted to
        float32 in registers; everything accumulates in float32.  ``Hq`` must be a multiple of
        ``Hkv``: query head ``h`` reads key/value head ``h // (Hq // Hkv)``
        (grouped-query / multi-query attention; no copy of k or v is made, and the
        heads of a group share each K/V tile the kernel loads).
    v : ndarray, shape (Lk, Dv), (Hkv, Lk, Dv) or (B, Hkv, Lk, Dv)
        Values, same dtype, ndim and layout; ``Dv`` may differ from ``D``.
    scale : float, optional
        Multiplies ``q . k``.  Default ``1 / sqrt(D)``.  Any finite value: 0 gives
        the plain mean of the visible values, negative values are allowed.
    causal : {False, True, 'bottom-right', 'top-left'}, optional
        ``True`` or ``'bottom-right'``: key ``j`` is visible to query ``i`` iff
        ``j <= i + (Lk - Lq)`` (the last query sees the last key, right for decoding
        against a cache).  ``'top-left'``: ``j <= i`` (PyTorch's ``is_causal``).
    window : (int or None, int or None), optional
        Sliding window ``(left, right)``: key ``j`` is visible iff
        ``a - left <= j <= a + right`` where ``a = i + (Lk - Lq)``, or ``a = i``
        with ``causal='top-left'``; ``None`` or ``-1`` on a side means unbounded
        (``(-1, -1)`` is no window, as in FlashAttention).  Combines
        with ``causal`` (both must allow).  Key blocks outside the band are never
        touched, so the work is proportional to the visible keys.
    mask : ndarray of bool, optional
        True = attend.  Broadcastable (right-aligned) to the logits shape
        ``(B, Hq, Lq, Lk)`` (of the inputs' ndim) whatever the layout; broadcast axes
        are read with stride 0, and key tiles that the mask hides from every row of a
        block are skipped.
    bias : ndarray of float, optional
        Added to the logits; broadcastable like `mask`.  ``-inf`` hides a key.
    alibi_slopes : ndarray, shape (Hq,) or (B, Hq), optional
        ALiBi: ``s -= slope[b, h] * |i + Lk - Lq - j|``, computed in the kernel.
    softcap : float, optional
        Logit soft-capping ``s = softcap * tanh(s / softcap)`` (applied after the
        scale, before ALiBi and bias); finite and > 0.
    dropout_p : float in [0, 1), optional
        Attention dropout (training): each weight ``p_ij`` is kept with probability
        ``1 - dropout_p`` and then divided by ``1 - dropout_p``, or set to 0;
        ``lse`` stays that of the undropped softmax (as in FlashAttention).  The
        decision for (batch b, head h, query i, key j) is a pure function of
        ``(seed, b, h, i, j)`` (Philox-4x32-10, see ``docs/semantics.md``), so it
        does not depend on threads or blocks, and :func:`attention_backward` with
        the same seed sees the same mask without storing it.
    seed : int in [0, 2**64), optional
        Required when ``dropout_p > 0``.
    seqlens_k : int array (B,), optional
        Per-sequence key lengths (FlashAttention's ``cache_seqlens``): sequence ``b``
        sees keys ``[0, seqlens_k[b])`` of its (preallocated) k and v, and causal,
        window and ALiBi align to that length (bottom-right: its last query sees key
        ``seqlens_k[b] - 1``).  Batched decoding of requests at different positions
        then needs no mask and reads only each request's keys.  Entries in
        ``[0, Lk]``; 0 gives zero rows with lse -inf.
    layout : {'bhsd', 'bshd'}, optional
        Axis order of q, k, v and the output: (batch, heads, sequence, features) or
        (batch, sequence, heads, features).  Any strides with a contiguous last axis
        are used in place (e.g. slices of a fused QKV projection (B, L, 3, H, D)).
    return_stats : bool, optional
        Also return an :class:`AttentionStats` (last in the tuple): each row's entropy,
        effective support ``exp(entropy)`` and largest weight, computed in the same
        pass with one more accumulator (no Lq x Lk weights).
    return_lse : bool, optional
        Also return ``lse = log(sum_j exp(s_ij))`` (natural log) over visible keys,
        shape ``(..., Hq, Lq)`` in either layout: heads before the sequence even for
        ``layout="bshd"``, and :func:`merge` with the same `layout` takes it as is.
    out : ndarray, optional
        Where to write the output (its shape and q's dtype, contiguous last axis, not
        overlapping the inputs).
    num_threads : int, optional
        Threads to use; default OpenMP's (``OMP_NUM_THREADS``, threadpoolctl).
        Results are bitwise identical for any value.

    Returns
    -------
    out : ndarray, shape (..., Hq, Lq, Dv) (or (..., Lq, Hq, Dv) for 'bshd'), q's dtype
    lse : ndarray, shape (..., Hq, Lq)
        Only with ``return_lse=True``; float64 for float64 inputs, else float32.

    Notes
    -----
    The exact semantics are written down in ``docs/semantics.md`` of the source
    repository.  The logits are built in this order: scale, softcap, ALiBi, bias,
    then mask/causal/window hide keys.  A query row that sees no key gives an output row
    of zeros and ``lse = -inf``, whatever hid the keys.  Large logits (|s| ~ 1e4) do
    not overflow.  Inputs that cannot be read in place (a non-contiguous last axis,
    misaligned data) are copied once.  The GIL is released during the kernel.
    """
    # The common call is checked and run in compiled code (a short call must cost a
    # few microseconds); anything else, and every error, takes the path below.
    if (out is None and scale is None and (causal is False or causal is True)
            and (return_lse is False or return_lse is True)
            and window is None and mask is None and bias is None and alibi_slopes is None
            and softcap is None and layout == "bhsd"
            and type(dropout_p) in (float, int) and dropout_p == 0 and return_stats is False
            and seqlens_k is None
            and (num_threads is None or type(num_threads) is int and num_threads >= 1)):
        res = _kernels.attention_common(q, k, v, causal, return_lse, num_threads or 0)
        if res is not None:
            return res

    fn = "attention"
    pr = _Problem(fn, _as_array(q, "q"), _as_array(k, "k"), _as_array(v, "v"), layout)
    return_lse = _parse_flag(return_lse, "return_lse", fn)
    return_stats = _parse_flag(return_stats, "return_stats", fn)
    causal_code = _parse_causal(causal)
    scale_f = _parse_scale(scale, pr.D)
    nth = _parse_threads(num_threads)
    variants = pr.variants(window, mask, bias, alibi_slopes, softcap,
                           _parse_dropout(dropout_p, seed, fn), seqlens_k)

    out_shape = pr.q.shape[:-1] + (pr.v.shape[-1],)
    if layout == "bshd" and pr.nd > 2:
        user_shape = out_shape[:-3] + (out_shape[-2], out_shape[-3], out_shape[-1])
    else:
        user_shape = out_shape
    if out is None:
        out = np.empty(user_shape, dtype=pr.out_dtype)
    else:
        _check_out(out, user_shape, pr.out_dtype, {"q": q, "k": k, "v": v, "mask": mask, "bias": bias})
    out_bhsd = out.swapaxes(-2, -3) if layout == "bshd" and pr.nd > 2 else out
    lse = np.empty(pr.q.shape[:-1], dtype=pr.lse_dtype) if return_lse or return_stats else None
    if return_stats:
        variants = variants or _kernels.Variants()
        variants.entropy, variants.max_weight = (np.zeros(pr.q.shape[:-1], pr.lse_dtype)
                                                 for _ in range(2))
    if out.size or lse is not None and lse.size:
        _run(pr.q, pr.k, pr.v, out_bhsd, lse, scale_f, causal_code, nth, variants)
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
    q, k, v = (_fresh(a) for a in (q, k, v))
    if not _kernels.forward(q, k, v, out, lse, scale, causal, nth, 0, 0, variants):
        raise RuntimeError("fastattn: the kernel cannot read fresh contiguous copies")  # a bug


def _run_degenerate(q, k, v, out, lse, scale, causal, nth, variants):
    """D = 0 (every logit q.k is 0) or Dv = 0 (nothing to write but lse): run the kernel
    on feature size 1 (zero q/k, or a zero value column) and keep what is asked."""
    if q.shape[-1] == 0:
        q = np.zeros(q.shape[:-1] + (1,), q.dtype)
        k = np.zeros(k.shape[:-1] + (1,), k.dtype)
    if v.shape[-1] == 0:
        v = np.zeros(v.shape[:-1] + (1,), v.dtype)
        out = np.empty(out.shape[:-1] + (1,), out.dtype)
    _run(q, k, v, out, lse, scale, causal, nth, variants)


def attention_weights(q: ArrayLike, k: ArrayLike, *, scale: float | None = None,
                      causal: Causal = False, window: Window = None,
                      mask: ArrayLike | None = None, bias: ArrayLike | None = None,
                      alibi_slopes: ArrayLike | None = None, softcap: float | None = None,
                      dropout_p: float = 0.0, seed: int | None = None,
                      seqlens_k: ArrayLike | None = None,
                      layout: Layout = "bhsd", num_threads: int | None = None) -> FloatArray:
    """The exact attention weights ``softmax(logits)``, shape (..., Hq, Lq, Lk).

    Computed by the same logits code as :func:`attention` (same arguments and
    semantics), for analysis of what each query reads: each row is on the
    probability simplex (>= 0, sums to 1); a row with no visible key is all 0.
    Memory is Lq x Lk by nature.  Returned in q's dtype, in the (..., Hq, Lq, Lk)
    order whatever the layout.  With ``dropout_p > 0`` these are the weights
    :func:`attention` multiplies V by for the same seed: kept weights divided by
    ``1 - dropout_p``, dropped ones 0 (rows then no longer sum to 1).
    """
    fn = "attention_weights"
    pr = _Problem(fn, _as_array(q, "q", fn), _as_array(k, "k", fn), None, layout)
    causal_code = _parse_causal(causal, fn)
    scale_f = _parse_scale(scale, pr.D, fn)
    nth = _parse_threads(num_threads, fn)
    va = pr.variants(window, mask, bias, alibi_slopes, softcap,
                     _parse_dropout(dropout_p, seed, fn), seqlens_k) or _kernels.Variants()
    # keys past a sequence's seqlens_k are never visited: their weights are the zeros here
    weights = (np.zeros if seqlens_k is not None else np.empty)(pr.logits_shape, dtype=pr.dtype)
    if weights.size == 0:
        return weights
    va.weights = weights.reshape((1,) * (4 - pr.nd) + pr.logits_shape)
    qk, kk = pr.q, pr.k
    if pr.D == 0:
        qk = np.zeros(qk.shape[:-1] + (1,), qk.dtype)
        kk = np.zeros(kk.shape[:-1] + (1,), kk.dtype)
    unused_out = np.empty((1, 1, 1, 1), pr.out_dtype)  # the kernel writes only the weights
    if not _kernels.forward(qk, kk, kk, unused_out, None, scale_f, causal_code, nth, 0, 0, va):
        _forward_copies(qk, kk, kk, unused_out, None, scale_f, causal_code, nth, va)
    return weights


def _grad_input(x, name, shape, what, dt, fn):
    """dout, out or lse of a backward call as an array of `shape` in the compute
    dtype, readable in place (copied only if it is not)."""
    a = _as_array(x, name, fn)
    if a.shape != shape:
        raise ValueError(f"fastattn.{fn}: {name} has shape {a.shape}, expected {shape} ({what})")
    if not _is_float(a.dtype):
        raise TypeError(f"fastattn.{fn}: {name} must be a float array, got dtype {a.dtype}")
    return _in_place(a, dt)


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
                       seqlens_k: ArrayLike | None = ..., layout: Layout = ..., return_dbias: Literal[False] = ...,
                       num_threads: int | None = ...
                       ) -> Tuple[FloatArray, FloatArray, FloatArray]: ...


@overload
def attention_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike, out: ArrayLike,
                       lse: ArrayLike, *, scale: float | None = ..., causal: Causal = ...,
                       window: Window = ..., mask: ArrayLike | None = ...,
                       bias: ArrayLike | None = ..., alibi_slopes: ArrayLike | None = ...,
                       softcap: float | None = ..., dropout_p: float = ..., seed: int | None = ...,
                       seqlens_k: ArrayLike | None = ..., layout: Layout = ..., return_dbias: Literal[True],
                       num_threads: int | None = ...
                       ) -> Tuple[FloatArray, FloatArray, FloatArray, FloatArray]: ...


@overload
def attention_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike, out: ArrayLike,
                       lse: ArrayLike, *, scale: float | None = ..., causal: Causal = ...,
                       window: Window = ..., mask: ArrayLike | None = ...,
                       bias: ArrayLike | None = ..., alibi_slopes: ArrayLike | None = ...,
                       softcap: float | None = ..., dropout_p: float = ..., seed: int | None = ...,
                       seqlens_k: ArrayLike | None = ..., layout: Layout = ..., return_dbias: bool = ...,
                       num_threads: int | None = ...
                       ) -> Tuple[FloatArray, ...]: ...


def attention_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike, out: ArrayLike,
                       lse: ArrayLike, *, scale: float | None = None, causal: Causal = False,
                       window: Window = None, mask: ArrayLike | None = None,
                       bias: ArrayLike | None = None, alibi_slopes: ArrayLike | None = None,
                       softcap: float | None = None, dropout_p: float = 0.0,
                       seed: int | None = None, seqlens_k: ArrayLike | None = None,
                       layout: Layout = "bhsd",
                       return_dbias: bool = False, num_threads: int | None = None
                       ) -> Tuple[FloatArray, ...]:
    """Gradients of :func:`attention`: given ``dout = dL/d(out)``, returns
    ``(dq, dk, dv)``, or ``(dq, dk, dv, dbias)`` with ``return_dbias=True``.

    `out` and `lse` must be what ``attention(q, k, v, ..., return_lse=True)``
    returned for the same arguments (the backward recomputes the weights from
    ``lse`` instead of storing them, FlashAttention-2's scheme).  Every keyword has
    :func:`attention`'s meaning, and must be passed with the same values as in the
    forward call (the same `seed` reproduces the same dropped weights).

    q, k, v, out, dout: float32 or float64 (one dtype; float16 K/V caches have no
    gradients), any layout and strides :func:`attention` takes; lse as `attention`
    returned it, ``(..., Hq, Lq)``.  Results have the shapes, layout and dtype of
    q, k and v.  With grouped-query attention, dk and dv are summed over the query
    heads that read each key/value head.  ``dbias`` (needs `bias`) has the
    bias's own shape: the logits' gradient summed over the axes along which the
    bias was broadcast; computing it materializes one (B, Hq, Lq, Lk) array.
    ALiBi slopes, masks and the window get no gradient.

    Computed in C by FlashAttention-2's backward, parallel over (batch, head, key
    block) for dk/dv and (batch, head, query block) for dq, so a single head uses
    every thread; no atomics, and the result is bitwise identical for any
    `num_threads`.  Extra memory is O(B Hq Lq) plus per-thread scratch: the
    Lq x Lk weights are never stored (except the one array for ``dbias``).
    """
    fn = "attention_backward"
    qa_, ka_, va_ = _as_array(q, "q", fn), _as_array(k, "k", fn), _as_array(v, "v", fn)
    pr = _Problem(fn, qa_, ka_, va_, layout)
    if _BF16 is not None and _BF16 in (qa_.dtype, ka_.dtype, va_.dtype):
        # bfloat16: the float32 backward on float32 copies (float32 accumulation, as the
        # forward), each gradient rounded to its input's dtype
        grads = attention_backward(
            dout, qa_.astype(_F32), ka_.astype(_F32), va_.astype(_F32), out, lse, scale=scale,
            causal=causal, window=window, mask=mask, bias=bias, alibi_slopes=alibi_slopes,
            softcap=softcap, dropout_p=dropout_p, seed=seed, seqlens_k=seqlens_k, layout=layout,
            return_dbias=return_dbias, num_threads=num_threads)
        return tuple(g.astype(x.dtype) for g, x in zip(grads, (qa_, ka_, va_))) + grads[3:]
    if _F16 in (pr.q.dtype, pr.k.dtype, pr.v.dtype):
        raise TypeError(f"fastattn.{fn}: float16 inputs have no gradients (a float16 K/V cache "
                        f"is for inference); pass float32 or float64 q, k and v "
                        f"({pr.user_shapes} with dtypes {pr.q.dtype}, {pr.k.dtype}, {pr.v.dtype})")
    dt = pr.dtype
    return_dbias = _parse_flag(return_dbias, "return_dbias", fn)
    if return_dbias and bias is None:
        raise ValueError(f"fastattn.{fn}: return_dbias=True needs a bias")
    causal_code = _parse_causal(causal, fn)
    scale_f = _parse_scale(scale, pr.D, fn)
    nth = _parse_threads(num_threads, fn)
    va = pr.variants(window, mask, bias, alibi_slopes, softcap,
                     _parse_dropout(dropout_p, seed, fn), seqlens_k) or _kernels.Variants()
    swap = layout == "bshd" and pr.nd > 2

    def user(shape):  # a (..., H, L, X) shape in the caller's layout
        return shape[:-3] + (shape[-2], shape[-3], shape[-1]) if swap else shape

    def bhsd(a):
        return a.swapaxes(-2, -3) if swap else a

    out_shape = user(pr.q.shape[:-1] + (pr.v.shape[-1],))
    what = "the shape attention returned for these q, k, v"
    dout_a = bhsd(_grad_input(dout, "dout", out_shape, what, dt, fn))
    out_a = bhsd(_grad_input(out, "out", out_shape, what, dt, fn))
    lse_a = _grad_input(lse, "lse", pr.q.shape[:-1],
                        "(..., Hq, Lq): what attention(..., return_lse=True) returned", dt, fn)
    dq = np.empty(user(pr.q.shape), dt)
    dk = np.empty(user(pr.k.shape), dt)
    dv = np.empty(user(pr.v.shape), dt)
    ds = np.zeros(pr.logits_shape, dt) if return_dbias else None
    qa, ka, vv = pr.q, pr.k, pr.v
    dqa, dka, dva = bhsd(dq), bhsd(dk), bhsd(dv)
    if pr.D == 0:  # every logit q.k is 0: run on one zero feature, keep dv
        qa, ka = (np.zeros(a.shape[:-1] + (1,), dt) for a in (qa, ka))
        dqa, dka = (np.empty(a.shape[:-1] + (1,), dt) for a in (qa, ka))
    if pr.v.shape[-1] == 0:  # nothing flows back through an empty value
        vv, dout_a, out_a = (np.zeros(a.shape[:-1] + (1,), dt) for a in (vv, dout_a, out_a))
        dva = np.empty(vv.shape, dt)
    qa, ka, vv = (_in_place(a, dt) for a in (qa, ka, vv))
    if dq.size + dk.size + dv.size or ds is not None:
        _kernels.backward(qa, ka, vv, out_a, lse_a, dout_a, dqa, dka, dva,
                          None if ds is None else ds.reshape((1,) * (4 - pr.nd) + pr.logits_shape),
                          scale_f, causal_code, nth, 0, 0, va)
    if ds is None:
        return dq, dk, dv
    return dq, dk, dv, _sum_to(ds, _as_array(bias, "bias", fn).shape)


def key_mass(q: ArrayLike, k: ArrayLike, *, scale: float | None = None, causal: Causal = False,
             window: Window = None, mask: ArrayLike | None = None, bias: ArrayLike | None = None,
             alibi_slopes: ArrayLike | None = None, softcap: float | None = None,
             seqlens_k: ArrayLike | None = None, layout: Layout = "bhsd",
             num_threads: int | None = None) -> FloatArray:
    """For each key, the total weight the queries of each head give it:
    ``mass[..., h, j] = sum_i p_hij``, shape ``(..., Hq, Lk)`` in either layout.

    The mass each value vertex receives in the barycentres of all the rows (a
    heavy-hitter / SnapKV-style score for KV-cache eviction).  The arguments are
    :func:`attention`'s (no values needed).  Computed in two passes without the
    weights: the forward's lse, then a pass over (key/value head, key chunk) items
    that recomputes each weight as ``exp(s - lse)`` and adds the query rows in order:
    O(L) memory, bitwise identical for any thread count.  The masses of a head sum
    to the number of its rows that see at least one key.  float32 or float64 (16-bit
    inputs are computed in float32); the weights are those before any dropout.
    """
    fn = "key_mass"
    pr = _Problem(fn, _as_array(q, "q", fn), _as_array(k, "k", fn), None, layout)
    causal_code = _parse_causal(causal, fn)
    scale_f = _parse_scale(scale, pr.D, fn)
    nth = _parse_threads(num_threads, fn)
    va = pr.variants(window, mask, bias, alibi_slopes, softcap, seqlens_k=seqlens_k) \
        or _kernels.Variants()
    dt = pr.dtype
    qa, ka = pr.q, pr.k
    if pr.D == 0:
        qa, ka = (np.zeros(a.shape[:-1] + (1,), dt) for a in (qa, ka))
    qa, ka = (_in_place(a, dt) for a in (qa, ka))  # 16-bit inputs: float32 copies
    mass = np.empty(pr.logits_shape[:-2] + (pr.Lk,), dt)
    if mass.size == 0:
        return mass
    lse = np.empty(qa.shape[:-1], dt)
    v0 = np.zeros(ka.shape[:-1] + (1,), dt)   # the forward for lse only: one zero value column
    out0 = np.empty(qa.shape[:-1] + (1,), dt)
    _run(qa, ka, v0, out0, lse, scale_f, causal_code, nth, va)
    _kernels.key_mass(qa, ka, lse, mass.reshape((pr.B, pr.Hq, pr.Lk)), scale_f, causal_code, nth, va)
    return mass


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
    fn = "merge"
    if layout not in _LAYOUTS:
        raise ValueError(f"fastattn.merge: layout must be 'bhsd' or 'bshd', got {layout!r}")
    if not len(outs) or len(outs) != len(lses):
        raise ValueError(f"fastattn.merge: outs and lses must be non-empty and of equal length, "
                         f"got {len(outs)} outs and {len(lses)} lses")
    outs_a = [_as_array(o, f"outs[{i}]", fn) for i, o in enumerate(outs)]
    lses_a = [_as_array(x, f"lses[{i}]", fn) for i, x in enumerate(lses)]
    dt = np.result_type(*outs_a, *lses_a)
    if _BF16 is not None and dt == _BF16:  # bfloat16 parts: merged in float32
        dt = _F32
    if dt != _F32 and dt != _F64:
        raise TypeError(f"fastattn.merge: outs and lses must be float32 or float64, got "
                        f"{sorted({str(a.dtype) for a in outs_a + lses_a})}")
    shape = outs_a[0].shape
    swap = layout == "bshd" and len(shape) >= 3
    lse_shape = shape[:-3] + (shape[-2], shape[-3]) if swap else shape[:-1]
    where = "(..., Hq, Lq) for outs (..., Lq, Hq, Dv)" if swap else "outs[0].shape[:-1]"
    for i, (o, x) in enumerate(zip(outs_a, lses_a)):
        if o.ndim < 1 or o.shape != shape or x.shape != lse_shape:
            raise ValueError(f"fastattn.merge: outs[{i}] {o.shape} and lses[{i}] {x.shape} must "
                             f"have the shape of outs[0] {shape} and {lse_shape} ({where}, "
                             f"layout={layout!r})")
    if swap:  # lse rows in the order of the out rows
        lses_a = [x.swapaxes(-1, -2) for x in lses_a]
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


def _cu_seqlens(a, name, total):
    a = _as_array(a, name, "varlen_attention")
    if a.dtype.kind not in "iu":
        raise TypeError(f"fastattn.varlen_attention: {name} must be an integer array, got dtype {a.dtype}")
    if a.ndim != 1 or a.size < 1 or a[0] != 0 or np.any(np.diff(a) < 0) or a[-1] != total:
        raise ValueError(f"fastattn.varlen_attention: {name} must be 1-D, start at 0, be "
                         f"non-decreasing and end at the packed length {total}; got shape "
                         f"{a.shape}: {a.tolist() if a.size <= 20 else str(a[:20].tolist()) + '...'}")
    return _fresh(a, np.int64)


@overload
def varlen_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike,
                     cu_seqlens_k: ArrayLike, *, scale: float | None = ...,
                     causal: Causal = ..., window: Window = ...,
                     alibi_slopes: ArrayLike | None = ..., softcap: float | None = ...,
                     dropout_p: float = ..., seed: int | None = ...,
                     return_lse: Literal[False] = ..., num_threads: int | None = ...
                     ) -> FloatArray: ...


@overload
def varlen_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike,
                     cu_seqlens_k: ArrayLike, *, scale: float | None = ...,
                     causal: Causal = ..., window: Window = ...,
                     alibi_slopes: ArrayLike | None = ..., softcap: float | None = ...,
                     dropout_p: float = ..., seed: int | None = ...,
                     return_lse: Literal[True], num_threads: int | None = ...
                     ) -> Tuple[FloatArray, FloatArray]: ...


@overload
def varlen_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike,
                     cu_seqlens_k: ArrayLike, *, scale: float | None = ...,
                     causal: Causal = ..., window: Window = ...,
                     alibi_slopes: ArrayLike | None = ..., softcap: float | None = ...,
                     dropout_p: float = ..., seed: int | None = ...,
                     return_lse: bool = ..., num_threads: int | None = ...
                     ) -> Union[FloatArray, Tuple[FloatArray, FloatArray]]: ...


def varlen_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike,
                     cu_seqlens_k: ArrayLike, *, scale: float | None = None,
                     causal: Causal = False, window: Window = None,
                     alibi_slopes: ArrayLike | None = None, softcap: float | None = None,
                     dropout_p: float = 0.0, seed: int | None = None,
                     return_lse: bool = False, num_threads: int | None = None
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
    return_lse : bool
        Also return lse of shape (Hq, total_q).

    Returns
    -------
    out : ndarray (total_q, Hq, Dv); lse : (Hq, total_q) with ``return_lse``.
    """
    fn = "varlen_attention"
    qa, ka, va_ = (_as_array(a, n, fn) for a, n in ((q, "q"), (k, "k"), (v, "v")))
    for name, a in (("q", qa), ("k", ka), ("v", va_)):
        if a.ndim != 3:
            raise ValueError(f"fastattn.{fn}: {name} must be 3-D (total, H, D), got shape {a.shape}")
    pr = _Problem(fn, qa, ka, va_, "bshd")
    cq = _cu_seqlens(cu_seqlens_q, "cu_seqlens_q", qa.shape[0])
    ck = _cu_seqlens(cu_seqlens_k, "cu_seqlens_k", ka.shape[0])
    if cq.shape != ck.shape:
        raise ValueError(f"fastattn.{fn}: cu_seqlens_q {cq.shape} and cu_seqlens_k {ck.shape} "
                         "must have the same length (one entry per sequence, plus one)")
    return_lse = _parse_flag(return_lse, "return_lse", fn)
    causal_code = _parse_causal(causal, fn)
    scale_f = _parse_scale(scale, pr.D, fn)
    nth = _parse_threads(num_threads, fn)
    va = pr.variants(window, None, None, alibi_slopes, softcap,
                     _parse_dropout(dropout_p, seed, fn)) or _kernels.Variants()
    va.cu_q, va.cu_k = cq, ck
    out = np.empty(qa.shape[:-1] + (va_.shape[-1],), pr.out_dtype)
    lse = np.empty((pr.Hq, qa.shape[0]), pr.lse_dtype) if return_lse else None
    if cq.size > 1 and (out.size or lse is not None and lse.size):
        # (1, H, total, D) views: the sequences are offsets on the L axis
        _run(pr.q[None], pr.k[None], pr.v[None], out.swapaxes(0, 1)[None],
             None if lse is None else lse[None], scale_f, causal_code, nth, va)
    return out if lse is None else (out, lse)
