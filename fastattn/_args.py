"""Argument parsing and checking of fastattn's calls, apart from the calls themselves.

Every check raises the error its caller would (a TypeError or ValueError whose
message starts ``fastattn.<fn>:``, `fn` being the public function's name), so that
fastattn._api and the adapters report a wrong argument in the same words.

The surface fastattn.dask and fastattn.torch use (documented, no leading underscore;
the adapters import nothing else from here, and from fastattn._api only
:func:`fastattn._api.attention_block`, dask's call of a block placed by offsets):

- :func:`as_array`: an argument as an ndarray, or a TypeError naming it;
- :class:`Problem`: q, k, v of one call checked (dtypes, ranks, axes, layout) and
  viewed in the "bhsd" order, with :meth:`Problem.variants` for the optional
  arguments;
- :func:`parse_flag`, :func:`parse_causal`, :func:`parse_scale`,
  :func:`parse_threads`, :func:`parse_dropout`, :func:`parse_window`,
  :func:`parse_softcap`, :func:`parse_offsets`: one scalar argument each (two for
  the offsets), as the kernel takes it (defined in fastattn._scalars);
- :func:`bf16` / :func:`is_bf16`: ml_dtypes' bfloat16 dtype, once ml_dtypes is imported
  (``BF16``, the attribute, imports it: for readers that want the dtype itself).

fastattn._api and fastattn._checks (the checks of one public function each) also use
``F16``, ``F32``, ``F64``, ``LAYOUTS``, :meth:`Problem.options` (the options every
public function parses, in one order), :meth:`Problem.user` / :meth:`Problem.bhsd`
(layouts), :func:`is_float`, :func:`abbreviated`, and :func:`fresh` / :func:`in_place`
(copies the kernel can read).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import sys

import numpy as np

from . import _kernels
from ._qkv import QuantizedKV
from ._scalars import (parse_causal, parse_dropout, parse_flag, parse_offsets,
                       parse_scale, parse_softcap, parse_threads, parse_window)

__all__ = ["as_array", "Problem", "parse_flag", "parse_causal", "parse_scale", "parse_threads",
           "parse_dropout", "parse_window", "parse_softcap", "parse_offsets", "bf16", "is_bf16"]

F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
_BF16: np.dtype | None = None


def bf16(load: bool = False) -> np.dtype | None:
    """ml_dtypes' bfloat16 dtype (the one JAX and others use), or None.  Found once
    ml_dtypes is imported, by the caller or, with load, here; not imported to recognize
    an array: no array can have that dtype before ml_dtypes is imported, and importing
    it took 0.57 of `import fastattn`'s 0.66 s (AMD EPYC Zen 4).  The first time it is
    found, the extension is told its type number (for the compiled fast path's
    decode-cache check)."""
    global _BF16
    if _BF16 is None:
        mod = sys.modules.get("ml_dtypes")
        if mod is None and load:
            try:
                import ml_dtypes as mod
            except ImportError:
                return None
        bt = getattr(mod, "bfloat16", None) if mod is not None else None  # (None mid-import)
        if bt is not None:
            _BF16 = np.dtype(bt)
            _kernels.set_bf16_dtype(_BF16)
    return _BF16


def is_bf16(dt) -> bool:
    """Is dt ml_dtypes' bfloat16?"""
    b = bf16()
    return b is not None and dt == b


def __getattr__(name):
    if name == "BF16":  # the dtype itself, ml_dtypes imported for it (None without ml_dtypes)
        return bf16(load=True)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


F64 = np.dtype(np.float64)
LAYOUTS = ("bhsd", "bshd")
# bfloat16 arrays of at least this many values are copied to float32 on every thread
# (fa_bf16_to_f32); smaller ones by NumPy's shift, where starting threads costs more
BF16_THREADED = 1 << 18


def _describe(**arrays):
    return ", ".join(f"{n}{tuple(np.shape(a))}" for n, a in arrays.items())


def abbreviated(a):
    """An int array's entries for a message: all of them up to 20, else the first 20."""
    return a.tolist() if a.size <= 20 else str(a[:20].tolist()) + '...'


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


def as_array(x, name, fn="attention"):
    """`x` as an ndarray (itself if it is one, else ``np.asarray(x)``); `name` is the
    argument's name and `fn` the public function's, both for the message.

    Raises
    ------
    TypeError
        If NumPy cannot view `x`; for a torch tensor the message says why (device,
        requires_grad, dtype) and what to pass instead.
    """
    if type(x) is np.ndarray:
        return x
    if isinstance(x, QuantizedKV):  # np.asarray would stack data and scale
        raise TypeError(f"fastattn.{fn}: {name} is a fastattn.QuantizedKV (an int8 cache), which "
                        f"only fastattn.attention reads (with a QuantizedKV for both k and v); pass "
                        f"fastattn.dequantize_kv({name}) here")
    try:
        return np.asarray(x)
    except Exception as e:  # noqa: BLE001 -- reported as a TypeError naming the argument
        why = _torch_problem(x, name, fn)
        if why is not None:
            raise TypeError(why) from e
        raise TypeError(f"fastattn.{fn}: {name} must be an array (or something NumPy can view "
                        f"as one), got {type(x).__name__}: {e}") from e


def is_float(dt):
    """A float dtype fastattn reads: NumPy's, or ml_dtypes' bfloat16."""
    return dt.kind == "f" or is_bf16(dt)


def _dtypes(fn, **arrays):
    """(compute, output, lse) dtypes of a call: all float32, all float64, or 16-bit
    K/V (float16, or bfloat16 from ml_dtypes) with float32 q or q of the same 16-bit
    type, which the kernel converts to float32 in registers; the output takes q's
    dtype, lse is float32 unless float64."""
    q = arrays["q"]
    dq, dkv = q.dtype, {a.dtype for n, a in arrays.items() if n != "q"}
    if dkv == {dq} and (dq == F32 or dq == F64):
        return dq, dq, dq
    BF16 = bf16()
    for half in (F16, BF16):
        if half is not None and dkv == {half} and (dq == F32 or dq == half):
            return F32, dq, F32
    if dq not in (F32, F64, F16) and not is_bf16(dq):
        raise TypeError(f"fastattn.{fn}: q has dtype {dq}; supported dtypes are float32, float64 "
                        "and, for k and v (with float32 q or q of their dtype), float16 or "
                        "bfloat16 (ml_dtypes.bfloat16), native byte order")
    raise TypeError(f"fastattn.{fn}: unsupported dtype combination "
                    + ", ".join(f"{n} {a.dtype}" for n, a in arrays.items())
                    + "; q, k and v must share float32 or float64, or k and v be float16 (or "
                    "bfloat16) with float32 q or q of the same 16-bit type")


def fresh(a, dtype=None, threads=1):
    """A new C-contiguous copy: freshly allocated, so aligned (np.ascontiguousarray
    returns an unaligned array unchanged when it is already contiguous).  bfloat16 to
    float32 (exact: the bits moved up 16) by an integer shift, 5-9x faster than
    ml_dtypes' cast (0.5 against 2.5-4.9 ms for 4 MiB, one thread); with threads other
    than 1 (a call's thread count as parse_threads gives it; 0: OpenMP's default) a large
    contiguous, aligned array (BF16_THREADED values and up) by the extension's shift on
    that many threads."""
    if dtype is not None and is_bf16(a.dtype) and np.dtype(dtype) == F32:
        out = np.empty(a.shape, np.uint32)
        if threads != 1 and a.size >= BF16_THREADED and a.flags.c_contiguous and a.flags.aligned:
            _kernels.bf16_to_f32(a.view(np.uint16), out, threads)
        else:
            np.left_shift(a.view(np.uint16), 16, out=out, dtype=np.uint32)
        return out.view(np.float32)
    return np.array(a, dtype=dtype, order="C", copy=True)


def _compact(a, dt, threads=1):
    """`a` in dtype dt, aligned, with strides of whole elements: the kernel reads it in
    place.  Called on the caller's own (un-broadcast) array, so a copy is never larger
    than what the caller passed.  threads: for `fresh`."""
    if a.dtype != dt or not a.flags.aligned or any(s % dt.itemsize for s in a.strides):
        return fresh(a, dt, threads)
    return a


def in_place(a, dt, threads=1):
    """`a` as the kernel reads it in place: dtype dt, aligned, whole-element strides and
    a contiguous last axis (the rule of _kernels' readable check); else a fresh copy
    (on `threads` threads where `fresh` can)."""
    a = _compact(a, dt, threads)
    if a.size and a.shape[-1] > 1 and a.strides[-1] != dt.itemsize:
        return fresh(a)
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


class Options(NamedTuple):
    """What :meth:`Problem.options` parsed: the kernel's causal code, the scale as a
    float, the thread count (0 = OpenMP's default) and the _kernels.Variants (None
    when every optional argument is off)."""
    causal: int
    scale: float
    threads: int
    variants: Any


class Problem:
    """q, k, v of one call checked and viewed as (…, H, L, D) arrays in the "bhsd" order.

    Parameters
    ----------
    fn : str
        The public function, as it is named in messages.
    q, k, v : ndarray (v may be None: the functions without values)
        (L, D), (H, L, D) or (B, H, L, D) in `layout`, through :func:`as_array` first.
    layout : {'bhsd', 'bshd'}

    Raises
    ------
    ValueError
        For another layout, ranks other than 2-4 or that differ, or axes that disagree
        (the message names the first such axis).
    TypeError
        For dtypes fastattn does not take together.

    Attributes
    ----------
    q, k, v : the arrays as (…, H, L, D) views (v None if not given)
    dtype, out_dtype, lse_dtype : numpy dtypes of the computation, output and lse
    B, Hq, Hkv, Lq, Lk, D : the sizes (B and H are 1 where the rank has no such axis)
    nd, layout, fn : the rank, the layout and the function name
    logits_shape : (B, Hq, Lq, Lk) cut to the inputs' rank
    user_shapes : "q(…), k(…), v(…)" as the caller passed them, for messages
    """

    def __init__(self, fn, q, k, v, layout):
        if layout not in LAYOUTS:
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
        self.swap = layout == "bshd" and nd > 2
        if self.swap:
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

    def user(self, shape):
        """A (…, H, L, X) shape in the caller's layout."""
        return shape[:-3] + (shape[-2], shape[-3], shape[-1]) if self.swap else shape

    def bhsd(self, a):
        """An array of the caller's layout viewed in the "bhsd" order."""
        return a.swapaxes(-2, -3) if self.swap else a

    def seqlens(self, seqlens_k):
        """seqlens_k checked: an int array (B,) with entries in [0, Lk], as int64."""
        fn = self.fn
        a = as_array(seqlens_k, "seqlens_k", fn)
        if a.dtype.kind not in "iu":
            raise TypeError(f"fastattn.{fn}: seqlens_k must be an integer array, got dtype {a.dtype}")
        if a.shape != (self.B,):
            raise ValueError(f"fastattn.{fn}: seqlens_k must have shape (B,) = ({self.B},), one key "
                             f"length per sequence, got {a.shape} ({self.user_shapes})")
        if a.size and (a.min() < 0 or a.max() > self.Lk):
            raise ValueError(f"fastattn.{fn}: seqlens_k must be in [0, Lk={self.Lk}], got "
                             f"{abbreviated(a)}")
        return fresh(a, np.int64)

    def variants(self, window, mask, bias, alibi_slopes, softcap, dropout=(0.0, 0), seqlens_k=None,
                 positions=None, sinks=None):
        """The optional arguments, as :func:`fastattn.attention` takes them, checked and
        made a _kernels.Variants (None if all are off); `dropout` is
        :func:`parse_dropout`'s ``(p, seed)``, `positions` None or ``(q_offset,
        k_offset, alibi_shift)`` (offsets from :func:`parse_offsets`; alibi_shift moves
        ALiBi's diagonal right of the causal one, fastattn.h).  Mask and bias are
        broadcast to the logits shape without a copy; bias and slopes are in the compute
        dtype.

        Raises
        ------
        TypeError, ValueError
            Naming the argument, as :func:`fastattn.attention` does.
        """
        fn, dt = self.fn, self.dtype
        sl = None if seqlens_k is None else self.seqlens(seqlens_k)
        wl, wr = parse_window(window, fn)
        cap = parse_softcap(softcap, fn)
        m = b = al = None
        if mask is not None:
            m = as_array(mask, "mask", fn)
            if m.dtype != np.bool_:
                raise TypeError(f"fastattn.{fn}: mask must be a bool array (True = attend), got "
                                f"dtype {m.dtype} with shape {m.shape}")
            m = _broadcast4(m, "mask", self.logits_shape, fn)
        if bias is not None:
            b = as_array(bias, "bias", fn)
            if not is_float(b.dtype):
                raise TypeError(f"fastattn.{fn}: bias must be a float array, got dtype {b.dtype} "
                                f"with shape {b.shape}")
            b = _broadcast4(_compact(b, dt), "bias", self.logits_shape, fn)
        if alibi_slopes is not None:
            al = as_array(alibi_slopes, "alibi_slopes", fn)
            if al.dtype.kind not in "fiu" and not is_float(al.dtype):
                raise TypeError(f"fastattn.{fn}: alibi_slopes must be a float array, got dtype "
                                f"{al.dtype}")
            shapes = [(self.Hq,)] + ([(self.B, self.Hq)] if self.nd == 4 else [])
            if al.shape not in shapes:
                raise ValueError(f"fastattn.{fn}: alibi_slopes must have shape "
                                 f"{' or '.join(map(str, shapes))}, got {al.shape} ({self.user_shapes})")
            al = np.broadcast_to(_compact(al, dt), (self.B, self.Hq))
        sk = None if sinks is None else self.sinks(sinks)
        if m is None and b is None and al is None and cap == 0 and wl < 0 and wr < 0 \
                and dropout[0] == 0 and sl is None and positions is None and sk is None:
            return None
        va = _kernels.Variants(mask=m, bias=b, alibi=al, softcap=cap, window_left=wl,
                               window_right=wr, dropout_p=dropout[0], seed=dropout[1])
        va.seqlens_k = sl
        va.sinks = sk
        if positions is not None:
            va.positions = True
            va.q_pos0, va.k_pos0, va.alibi_shift = positions
        return va

    def sinks(self, sinks):
        """`sinks` checked: a real array of shape (Hq,), no NaN or +inf (-inf: that head
        has no sink), as a fresh contiguous array in the compute dtype."""
        fn = self.fn
        a = as_array(sinks, "sinks", fn)
        if a.dtype.kind not in "fiu" and not is_float(a.dtype):
            raise TypeError(f"fastattn.{fn}: sinks must be a float array, got dtype {a.dtype}")
        if a.shape != (self.Hq,):
            raise ValueError(f"fastattn.{fn}: sinks must have shape (Hq,) = ({self.Hq},), one "
                             f"logit per query head, got {a.shape} ({self.user_shapes})")
        a = fresh(a, self.dtype)
        if np.isnan(a).any() or (a == np.inf).any():
            raise ValueError(f"fastattn.{fn}: sinks must be finite or -inf (no sink), got "
                             f"{abbreviated(a)}")
        return a

    def options(self, causal, scale, num_threads, window, mask, bias, alibi_slopes, softcap,
                dropout_p=0.0, seed=None, seqlens_k=None, always=True, q_offset=None,
                k_offset=None, alibi_shift=0, sinks=None):
        """The options of a call parsed in the order every public function checks them
        (causal, scale, num_threads, the offsets, dropout, then :meth:`variants`), as an
        :class:`Options`; its variants are an empty _kernels.Variants rather than None
        when `always`.  `alibi_shift` (an int, with offsets only) is fastattn.dask's."""
        fn = self.fn
        code = parse_causal(causal, fn)
        scale_f = parse_scale(scale, self.D, fn)
        nth = parse_threads(num_threads, fn)
        offs = parse_offsets(q_offset, k_offset, code, fn)
        va = self.variants(window, mask, bias, alibi_slopes, softcap,
                           parse_dropout(dropout_p, seed, fn), seqlens_k,
                           None if offs is None else offs + (int(alibi_shift),), sinks)
        return Options(code, scale_f, nth, va or _kernels.Variants() if always else va)
