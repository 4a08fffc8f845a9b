"""Fuzzing fastattn.attention against a model of its rules.

Every drawn call (shapes, layouts, strides, dtypes and every keyword, valid and
invalid) is classified by `expected_errors`, a small model of the argument rules
written from docs/semantics.md and the attention docstring -- it never asks fastattn.

- A call the model calls valid must succeed, return the documented shapes and dtypes,
  and match the float64 oracle (fastattn.reference) within tolerance, lse included.
- A call the model calls invalid must raise the exception type the rules give
  (ValueError for a wrong value or shape, TypeError for a wrong type or dtype) with a
  message that starts with "fastattn.attention:" and names the offending argument.
  Where a call breaks several rules, the error must be one of them.

So a valid call that is wrongly rejected fails here, and so does an error of the
wrong type or one that blames the wrong argument.  Every array of a call (q, k, v,
mask, bias, slopes, out=) lies flush against an inaccessible page, the inputs
read-only (tests/guardpages.py), so a call that strays outside them faults where it
happens.  The run is seeded
(derandomize=True: the same examples on every run) and repeated under every CPU
kernel this machine can execute (the `kernel` fixture of conftest.py).
"""
import math
import numbers
import re
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

import fastattn
from fastattn import _kernels, reference

from conftest import KERNELS, TOL, rel_err
from guardpages import guarded

F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
FUZZ_EXAMPLES = 600  # per kernel; the whole file runs in well under a minute

# ---------------------------------------------------------------------------------
# The model of the rules (docs/semantics.md §1-§10, the attention docstring).
# It returns the list of broken rules as (exception type, regex the message must
# match, rule name); an empty list means the call is valid.


def _is_int(x):
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _is_real(x):
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _broadcasts(shape, full):
    """NumPy broadcasting of `shape` *to* `full`, axes aligned from the right (§4)."""
    if len(shape) > len(full):
        return False
    return all(s == f or s == 1 for s, f in zip(reversed(shape), reversed(full)))


def expected_errors(q, k, v, kw):
    errs = []

    def bad(exc, pattern, rule):
        errs.append((exc, pattern, rule))

    layout = kw.get("layout", "bhsd")
    if not (isinstance(layout, str) and layout in ("bhsd", "bshd")):        # §6
        bad(ValueError, r"layout", "layout")
        layout = "bhsd"
    dq, dk, dv = q.dtype, k.dtype, v.dtype                                    # §9
    if not ((dq == dk == dv and dq in (F32, F64)) or (dk == dv == F16 and dq in (F32, F16))):
        bad(TypeError, r"dtype", "dtype")

    full = None
    nd = q.ndim                                                               # §6
    if not (k.ndim == v.ndim == nd and 2 <= nd <= 4):
        bad(ValueError, r"q is \d-D", "ndim")
    else:
        def bhsd(s):  # (B, H, L, D), None for the axes 2-D/3-D inputs lack
            s = tuple(s)
            if layout == "bshd" and nd > 2:
                s = s[:-3] + (s[-2], s[-3], s[-1])
            return (None,) * (4 - nd) + s

        qB, qH, Lq, qD = bhsd(q.shape)
        kB, kH, Lk, kD = bhsd(k.shape)
        vB, vH, vL, _ = bhsd(v.shape)
        if qD != kD:
            bad(ValueError, r"q has D=\d+ but k has D=\d+", "D")
        if Lk != vL:
            bad(ValueError, r"k has Lk=\d+ but v has Lk=\d+", "Lk")
        if nd == 4 and not qB == kB == vB:
            bad(ValueError, r"has B=\d+ but \w has B=\d+", "B")
        if nd > 2:
            if kH != vH:
                bad(ValueError, r"k has Hkv=\d+ but v has Hkv=\d+", "Hkv")
            # §5: Hq a multiple of Hkv (0 heads of k/v only with 0 query heads)
            if (kH == 0 and qH != 0) or (kH and qH % kH):
                bad(ValueError, r"q has Hq=\d+ .*multiple", "Hq%Hkv")
        B, Hq = (qB if nd == 4 else 1), (qH if nd > 2 else 1)
        full = (B, Hq, Lq, Lk)[4 - nd:]  # the logits shape (§4), q's B/Hq/Lq, k's Lk

    rl = kw.get("return_lse", False)
    if not isinstance(rl, (bool, np.bool_)):
        bad(TypeError, r"return_lse", "return_lse")
    causal = kw.get("causal", False)                                          # §2
    if not (causal is False or causal is True or (isinstance(causal, str)
                                                 and causal in ("bottom-right", "top-left"))):
        bad(ValueError, r"causal", "causal")
    scale = kw.get("scale")                                                   # §1.1
    if scale is not None:
        if not _is_real(scale):
            bad(TypeError, r"scale", "scale-type")
        elif not math.isfinite(float(scale)):
            bad(ValueError, r"scale", "scale-value")
    window = kw.get("window")                                                 # §3
    if window is not None:
        if not (isinstance(window, (tuple, list)) and len(window) == 2):
            bad(ValueError, r"window", "window-pair")
        else:
            for side in window:
                if side is None:
                    continue
                if not _is_int(side):
                    bad(TypeError, r"window", "window-type")
                elif side < -1:
                    bad(ValueError, r"window", "window-value")
    softcap = kw.get("softcap")                                               # §1.2
    if softcap is not None:
        if not _is_real(softcap):
            bad(TypeError, r"softcap", "softcap-type")
        elif not (math.isfinite(float(softcap)) and softcap > 0):
            bad(ValueError, r"softcap", "softcap-value")
    nth = kw.get("num_threads")                                               # §11
    if nth is not None:
        if not _is_int(nth):
            bad(TypeError, r"num_threads", "num_threads-type")
        elif nth < 1:
            bad(ValueError, r"num_threads", "num_threads-value")
    if "mask" in kw:                                                          # §4
        m = kw["mask"]
        if m.dtype != np.bool_:
            bad(TypeError, r"mask", "mask-dtype")
        if full is not None and not _broadcasts(m.shape, full):
            bad(ValueError, r"mask", "mask-shape")
    if "bias" in kw:
        b = kw["bias"]
        if b.dtype.kind != "f":
            bad(TypeError, r"bias", "bias-dtype")
        if full is not None and not _broadcasts(b.shape, full):
            bad(ValueError, r"bias", "bias-shape")
    if "alibi_slopes" in kw and full is not None:                             # §1.3
        a = kw["alibi_slopes"]
        ok = [(Hq,)] + ([(B, Hq)] if nd == 4 else [])
        if a.shape not in ok:
            bad(ValueError, r"alibi_slopes", "alibi-shape")
    return errs


# ---------------------------------------------------------------------------------
# The calls.  A drawn call is a dict of plain values (printed by hypothesis when a
# test fails); `build` turns it into arrays and keywords.

VALID_DTYPES = [("float32",) * 3] * 6 + [("float64",) * 3] * 4 + [
    ("float32", "float16", "float16")] * 2 + [("float16",) * 3]
ANY_DTYPE = ["float32", "float64", "float16", "int32", "complex64", "bool", ">f4"]
HOW = ["contig"] * 3 + ["rows", "swapped", "lastaxis"]

VALID_KW = {
    "causal": [False, True, "bottom-right", "top-left"],
    "scale": [None, 0.0, -1.3, 0.2, 3.0, 2, np.float32(0.5), np.float64(1.7)],
    "softcap": [None, 1.0, 30.0, 5, 0.5],
    "num_threads": [None, 1, 2, 3, 8, np.int64(2)],
    "return_lse": [False, True, True, np.True_],
}
INVALID_KW = {
    "causal": ["x", "Top-Left", 1, 0, "causal"],
    "scale": [float("nan"), float("inf"), -float("inf"), "s", 1j],
    "softcap": [0.0, -2.0, float("inf"), float("nan"), "c"],
    "num_threads": [0, -1, 2.5, "2"],
    "return_lse": ["yes"],
    "layout": ["BSHD", "nope", "bsdh"],
}
WINDOW_PAIRS = [(0, 0), (0, None), (None, 0), (-1, -1), (None, None), (3, -1), (-1, 2),
                (5, 2), (40, 0), (np.int64(4), 1), (2**40, 0)]
WINDOW_SIDES = [None, -1, 0, 0, 1, 3, 5, 40, -2, -5, 1.5, "a"]
WINDOW_NOT_PAIRS = [4, (1, 2, 3), (5,)]


def _one_in(draw, n):
    """True about once in n draws, shrinking to False.  (Not `integers(0, n - 1) == 0`:
    hypothesis draws small integers far more often than 1/n; sampled_from of a short
    list is close to uniform.)"""
    return draw(st.sampled_from(range(n))) == n - 1


def _pick(draw, key, one_in=10):
    """A keyword value: mostly valid, invalid about once in `one_in` draws."""
    if key in INVALID_KW and _one_in(draw, one_in):
        return draw(st.sampled_from(INVALID_KW[key]))
    return draw(st.sampled_from(VALID_KW[key]))


def _bshape(draw, full):
    """A mask/bias shape: mostly broadcastable to `full` (right-aligned), sometimes not."""
    n = len(full)
    n = draw(st.sampled_from([n, n, n, 1, min(2, n), 0])) if not _one_in(draw, 40) else n + 1
    shape = []
    for i in range(n):  # from the right
        f = full[-1 - i] if i < len(full) else 1
        r = draw(st.sampled_from(range(30)))  # the axis: full, broadcast or wrong
        shape.insert(0, f if r < 20 else 1 if r < 29 else (f + 1 if f else 2))
    return tuple(shape)


@st.composite
def calls(draw):
    nd = draw(st.sampled_from([2, 3, 3, 4, 4, 4]))
    nds = [nd] * 3
    if _one_in(draw, 40):  # a wrong number of dimensions
        if draw(st.booleans()):
            nds = [draw(st.sampled_from([1, 5]))] * 3
        else:
            nds[draw(st.integers(0, 2))] = draw(st.sampled_from([1, 2, 3, 4, 5]))
    Hkv, G = draw(st.sampled_from([1, 1, 2, 3, 0])), draw(st.sampled_from([1, 2, 3]))
    B = draw(st.sampled_from([1, 1, 2, 2, 0]))
    Lq, Lk = draw(st.integers(0, 40)), draw(st.integers(0, 150))
    D, Dv = draw(st.integers(0, 20)), draw(st.integers(0, 12))
    sizes = dict(qB=B, kB=B, vB=B, Hq=Hkv * G, kH=Hkv, vH=Hkv, Lq=Lq, kL=Lk, vL=Lk,
                 qD=D, kD=D, Dv=Dv)
    if _one_in(draw, 6):  # one size drawn on its own (often a mismatch)
        key = draw(st.sampled_from(["qB", "kB", "vB", "Hq", "Hq", "kH", "vH", "kL", "vL",
                                    "qD", "kD"]))
        sizes[key] = draw(st.integers(0, 7))
    dtypes = draw(st.sampled_from(VALID_DTYPES))
    if _one_in(draw, 24):
        dtypes = tuple(draw(st.sampled_from(ANY_DTYPE)) for _ in range(3))
    c = dict(nds=tuple(nds), sizes=sizes, dtypes=dtypes,
             how=tuple(draw(st.sampled_from(HOW)) for _ in range(3)),
             seed=draw(st.integers(0, 2**32 - 1)), kw={})
    kw = c["kw"]
    kw["return_lse"] = _pick(draw, "return_lse", 60)
    if _one_in(draw, 3):
        kw["layout"] = draw(st.sampled_from(["bshd", "bshd", "bshd", "bhsd"]))
    if _one_in(draw, 60):
        kw["layout"] = draw(st.sampled_from(INVALID_KW["layout"]))
    for key in ("causal", "scale", "softcap", "num_threads"):
        if _one_in(draw, 3):
            kw[key] = _pick(draw, key)
    if _one_in(draw, 3):
        r = draw(st.sampled_from(range(20)))
        kw["window"] = (draw(st.sampled_from(WINDOW_PAIRS)) if r < 13 else
                        draw(st.sampled_from(WINDOW_NOT_PAIRS)) if r == 19 else
                        (draw(st.sampled_from(WINDOW_SIDES)), draw(st.sampled_from(WINDOW_SIDES))))
    # the logits shape as fastattn reads it (q's B, Hq, Lq; k's Lk) for the user's ndim
    qn = nds[0]
    full = (sizes["qB"], sizes["Hq"], sizes["Lq"], sizes["kL"])[4 - min(max(qn, 2), 4):]
    if _one_in(draw, 4):
        c["mask"] = (_bshape(draw, full), "int8" if _one_in(draw, 12) else "bool")
    if _one_in(draw, 5):
        dt = ("int32" if _one_in(draw, 12) else
              draw(st.sampled_from(["float32", "float64", "float16"])))
        c["bias"] = (_bshape(draw, full), dt, draw(st.booleans()))  # with some -inf entries
    if _one_in(draw, 5):
        Hq, Bq = (sizes["Hq"] if qn > 2 else 1), sizes["qB"]
        c["alibi"] = (draw(st.sampled_from([(1, Hq), (Hq + 1,), (Hq, 1), (Bq, Hq)]))
                      if _one_in(draw, 6) else
                      draw(st.sampled_from([(Hq,), (Bq, Hq) if qn == 4 else (Hq,)])))
    c["out"] = _one_in(draw, 8)  # pass a preallocated out= (valid calls only)
    return c


def spec(**over):
    """A call given by hand (for @example): 4-D float32 GQA defaults, overridden."""
    sizes = dict(qB=2, kB=2, vB=2, Hq=4, kH=2, vH=2, Lq=9, kL=37, vL=37, qD=8, kD=8, Dv=5)
    sizes.update(over.pop("sizes", {}))
    c = dict(nds=(4, 4, 4), sizes=sizes, dtypes=("float32",) * 3, how=("contig",) * 3,
             seed=7, kw={}, out=False, handmade=True)
    c["kw"].update(over.pop("kw", {}))
    c.update(over)
    return c


def _logical(nd, s, which, layout):
    """The user-order shape of q, k or v for ndim `nd` from the (B, H, L, D) sizes."""
    b, h, l, d = {"q": (s["qB"], s["Hq"], s["Lq"], s["qD"]),
                  "k": (s["kB"], s["kH"], s["kL"], s["kD"]),
                  "v": (s["vB"], s["vH"], s["vL"], s["Dv"])}[which]
    if nd == 1:
        return (d,)
    shape = ((1, b, h, l, d) if nd == 5 else (b, h, l, d))[-nd:]
    if layout == "bshd" and nd > 2:
        shape = shape[:-3] + (shape[-2], shape[-3], shape[-1])
    return shape


def _values(shape, dtype, rng):
    if dtype == np.bool_:
        return rng.random(shape) > 0.5
    with np.errstate(invalid="ignore"):
        return (2 * rng.standard_normal(shape)).astype(dtype)


def _array(shape, dtype, rng, how):
    """An input of `shape`: contiguous, or a strided view (rows strided with an offset
    start, the two middle axes swapped in memory, or a non-contiguous last axis)."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape))
    if how == "rows" and len(shape) >= 2 and size:
        big = np.zeros(shape[:-2] + (2 * shape[-2], shape[-1] + 3), dtype)
        big[..., ::2, 1:shape[-1] + 1] = _values(shape, dtype, rng)
        return big[..., ::2, 1:shape[-1] + 1]
    if how == "swapped" and len(shape) >= 3:
        mem = shape[:-3] + (shape[-2], shape[-3], shape[-1])
        return _values(mem, dtype, rng).swapaxes(-2, -3)
    if how == "lastaxis" and len(shape) >= 1 and size:
        big = np.zeros(shape[:-1] + (2 * shape[-1],), dtype)
        big[..., ::2] = _values(shape, dtype, rng)
        return big[..., ::2]
    return _values(shape, dtype, rng)


def _place(c):
    """Which guard page a call's arrays are flush against (tests/guardpages.py)."""
    return "end" if c["seed"] % 2 else "start"


def build(c):
    """The call's arrays, each in guarded memory (flush against an inaccessible page,
    inputs read-only), in the memory layout drawn for it: a call that reads or writes
    outside them faults at that access (pytest's faulthandler prints where)."""
    rng = np.random.default_rng(c["seed"])
    kw = dict(c["kw"])
    layout = kw.get("layout", "bhsd")
    place = _place(c)
    q, k, v = (guarded(_array(_logical(n, c["sizes"], w, layout), dt, rng, how), place, how)
               for n, w, dt, how in zip(c["nds"], "qkv", c["dtypes"], c["how"]))
    if "mask" in c:
        shape, dt = c["mask"]
        kw["mask"] = np.asarray(rng.random(shape) > 0.25).astype(dt)
    if "bias" in c:
        shape, dt, neginf = c["bias"]
        b = rng.standard_normal(shape)
        if neginf and b.size:
            b[rng.random(shape) < 0.2] = -np.inf
        kw["bias"] = b.astype(dt) if np.dtype(dt).kind == "f" else (3 * b.clip(-1, 1)).astype(dt)
    if "alibi" in c:
        shape = c["alibi"]
        kw["alibi_slopes"] = np.linspace(0.05, 0.6, int(np.prod(shape))).reshape(shape)
    for name in ("mask", "bias", "alibi_slopes"):
        if name in kw:
            kw[name] = guarded(kw[name], place)
    return q, k, v, kw


# ---------------------------------------------------------------------------------
# The test.

COUNTS = Counter()  # what the fuzz test ran, by outcome (checked by test_fuzz_coverage)
DRAWN = Counter()   # the same for the drawn calls only (not the explicit EXAMPLES)

EXAMPLES = [  # edge cases run first, whatever hypothesis draws
    spec(kw=dict(window=(0, 0))),                                   # each query: one key
    spec(kw=dict(window=(0, 0), layout="bshd", return_lse=True), how=("swapped",) * 3),
    spec(kw=dict(layout="bshd", causal="top-left", return_lse=True),
         how=("rows", "swapped", "contig")),
    spec(sizes=dict(Hq=0, kH=0, vH=0)),                             # no heads at all
    spec(sizes=dict(kL=0, vL=0), kw=dict(return_lse=True)),   # no keys: 0, lse -inf
    spec(sizes=dict(qD=0, kD=0), kw=dict(causal=True)),             # D = 0: the mean
    spec(sizes=dict(Dv=0, Lq=0)),
    spec(kw=dict(scale=0.0, softcap=2.0, num_threads=np.int64(3))),
    spec(dtypes=("float16",) * 3, kw=dict(return_lse=True, window=(4, None))),
    spec(dtypes=("float32", "float16", "float16"), kw=dict(layout="bshd"), alibi=(2, 4)),
    spec(nds=(2, 2, 2), alibi=(1,), mask=((), "bool"), kw=dict(return_lse=True)),
    spec(nds=(3, 3, 3), bias=((4, 1, 37), "float16", True), out=True),
    # issue 22: more queries than keys, top-left diagonal and a window (several query
    # blocks, the later ones see no key): once read past the end of k
    spec(sizes=dict(Lq=150, kL=41, vL=41, qD=24, kD=24, Dv=19),
         kw=dict(window=(6, 3), causal="top-left", return_lse=True), seed=8),
    spec(sizes=dict(Lq=150, kL=41, vL=41, qD=24, kD=24, Dv=19),
         kw=dict(window=(6, 3), causal="top-left"), seed=9, mask=((150, 41), "bool")),
    # invalid, one rule each
    spec(kw=dict(window=(-2, 0))),
    spec(kw=dict(window=(1.5, 0))),
    spec(kw=dict(window=3)),
    spec(kw=dict(num_threads=0)),
    spec(kw=dict(num_threads=2.5)),
    spec(kw=dict(layout="BSHD")),
    spec(kw=dict(causal=1)),
    spec(kw=dict(scale="s")),
    spec(kw=dict(scale=float("nan"))),
    spec(kw=dict(softcap=0.0)),
    spec(kw=dict(softcap="c")),
    spec(kw=dict(return_lse="yes")),
    spec(mask=((9, 37), "int8")),
    spec(mask=((9, 36), "bool")),
    spec(bias=((9, 37), "int32", False)),
    spec(bias=((3, 1, 37), "float32", False)),
    spec(alibi=(1, 4)),
    spec(sizes=dict(Hq=3)),
    spec(sizes=dict(kD=7)),
    spec(sizes=dict(vL=36)),
    spec(sizes=dict(kB=1)),
    spec(sizes=dict(vH=1)),
    spec(nds=(4, 3, 4)),
    spec(dtypes=("float16", "float32", "float32")),
    spec(dtypes=(">f4",) * 3),
]


def _check_valid(q, k, v, kw, use_out, place="end"):
    layout = kw.get("layout", "bhsd")
    nd = q.ndim
    out_shape = q.shape[:-1] + (v.shape[-1],)
    lse_shape = (q.shape[:-3] + (q.shape[-2], q.shape[-3])
                 if layout == "bshd" and nd > 2 else q.shape[:-1])
    call_kw = dict(kw)
    out = None
    if use_out and np.prod(out_shape):  # an empty out: see test_empty_out_from_np_empty
        out = call_kw["out"] = guarded(np.full(out_shape, np.nan, q.dtype), place, writable=True)
    res = fastattn.attention(q, k, v, **call_kw)
    want_lse = bool(kw.get("return_lse", False))
    if want_lse:
        assert isinstance(res, tuple) and len(res) == 2
        o, lse = res
    else:
        assert isinstance(res, np.ndarray)
        o, lse = res, None
    if out is not None:
        assert o is out
    assert o.shape == out_shape and o.dtype == q.dtype
    ref_kw = {n: a for n, a in kw.items() if n != "return_lse"}
    ref_o, ref_lse = reference.attention(q, k, v, return_lse=True, **ref_kw)
    if q.dtype == F16:
        tol, ltol = 1e-3, 1e-4        # float16 output: rounded to half precision
    elif k.dtype == F16:
        tol, ltol = 1e-4, 1e-4        # float16 K/V, against the oracle on those values
    else:
        tol = ltol = TOL[q.dtype]
    assert rel_err(o, ref_o) <= tol, rel_err(o, ref_o)
    if lse is not None:
        assert lse.shape == lse_shape
        assert lse.dtype == (F64 if q.dtype == F64 else F32)
        lse = lse.astype(np.float64)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
        fin = np.isfinite(ref_lse)
        if fin.any():
            err = np.max(np.abs(lse[fin] - ref_lse[fin]))
            assert err <= ltol * max(1.0, float(np.max(np.abs(ref_lse[fin])))), err


@settings(max_examples=FUZZ_EXAMPLES, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(call=calls())
def _fuzz(kernel, call):
    assert _kernels.current_kernel() == kernel
    q, k, v, kw = build(call)
    errs = expected_errors(q, k, v, kw)
    outcome = "valid" if not errs else "only " + errs[0][2] if len(errs) == 1 else "several"
    COUNTS[outcome] += 1
    if errs:
        COUNTS["invalid"] += 1
    if not call.get("handmade"):
        DRAWN[outcome] += 1
    if not errs:
        _check_valid(q, k, v, kw, call.get("out", False), _place(call))
        return
    with pytest.raises((ValueError, TypeError)) as info:
        fastattn.attention(q, k, v, **kw)
    e, msg = info.value, str(info.value)
    assert msg.startswith("fastattn.attention:"), msg
    assert any(isinstance(e, exc) and re.search(pat, msg) for exc, pat, _ in errs), \
        f"raised {type(e).__name__}: {msg}\nexpected one of {[(x.__name__, p) for x, p, _ in errs]}"


for _c in reversed(EXAMPLES):
    _fuzz = example(call=_c)(_fuzz)
DONE = set()  # the kernels under which the whole fuzz run passed


def test_fuzz_attention(kernel):
    """The EXAMPLES, then FUZZ_EXAMPLES drawn calls (the same on every run), under
    `kernel`.  (Hypothesis runs inside the test, so the kernel is set once for all of
    them and DONE records a complete run for test_fuzz_coverage.)"""
    _fuzz(kernel)
    DONE.add(kernel)


def test_fuzz_coverage(capsys):
    """The fuzz run above (seeded, so the same on every run) exercised valid calls and
    every rule of the model on its own."""
    if DONE != set(KERNELS):
        pytest.skip(f"test_fuzz_attention did not pass under every kernel (only {sorted(DONE)})")
    total = COUNTS["valid"] + COUNTS["invalid"]
    with capsys.disabled():
        print(f"\n[fuzz] {total} calls under the kernels {KERNELS}: {dict(sorted(COUNTS.items()))}"
              f"\n[fuzz] of which drawn by hypothesis: {dict(sorted(DRAWN.items()))}")
    assert COUNTS["valid"] >= 0.5 * total
    rules = ["layout", "dtype", "ndim", "D", "Lk", "B", "Hkv", "Hq%Hkv", "return_lse", "causal",
             "scale-type", "scale-value", "window-pair", "window-type", "window-value",
             "softcap-type", "softcap-value", "num_threads-type", "num_threads-value",
             "mask-dtype", "mask-shape", "bias-dtype", "bias-shape", "alibi-shape"]
    missing = [r for r in rules if not COUNTS["only " + r]]
    assert not missing, f"no fuzzed call broke only the rule(s) {missing}"


def test_empty_out_from_np_empty():
    """out= preallocated with np.empty of the output's (empty) shape is accepted."""
    q = np.zeros((2, 4), np.float32)
    k = np.zeros((3, 4), np.float32)
    v = np.zeros((3, 0), np.float32)                # Dv = 0: the output (2, 0) is empty
    out = np.empty((2, 0), np.float32)              # NumPy >= 2: strides (0, 0)
    assert fastattn.attention(q, k, v, out=out) is out
