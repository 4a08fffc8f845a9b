"""`out=`: the plumbing, not only the maths.

Every `out=` call takes the checked Python path (the compiled fast path is only
taken with out=None), so each test compares three things: the array written into
`out` against the call without `out=` (bitwise) and against the float64 oracle,
the returned object (`is out`), and lse (returned next to `out`: its values, shape
and dtype).  `out` is pre-filled with NaN so that anything left unwritten fails, and
strided views check that nothing outside the view is touched.  Error cases must
name `out`, raise the documented exception type and leave `out` untouched.
"""
import numpy as np
import pytest

import fastattn
from fastattn import reference

from conftest import TOL, assert_lse_close, rel_err

# (q dtype, k/v dtype): the four supported combinations; the output takes q's dtype
DTYPES = [(np.float32, np.float32), (np.float64, np.float64),
          (np.float16, np.float16), (np.float32, np.float16)]
DT_IDS = ["f32", "f64", "f16q-f16kv", "f32q-f16kv"]


def _lse_dtype(qd):
    return np.dtype(np.float64 if np.dtype(qd) == np.float64 else np.float32)


def _make(rng, layout, nd, B, Hq, Hkv, Lq, Lk, D, Dv, qd, kvd):
    """q, k, v in the user's layout and ndim (contiguous in that layout)."""
    def mk(H, L, d, dt):
        a = rng.standard_normal((B, H, L, d))
        a = a[0, 0] if nd == 2 else (a[0] if nd == 3 else a)
        if layout == "bshd" and nd > 2:
            a = a.swapaxes(-2, -3)
        return np.ascontiguousarray(a.astype(dt))
    return mk(Hq, Lq, D, qd), mk(Hkv, Lk, D, kvd), mk(Hkv, Lk, Dv, kvd)


def _out_shape(layout, nd, B, Hq, Lq, Dv):
    shape = (B, Hq, Lq, Dv)[4 - nd:] if nd > 2 else (Lq, Dv)
    if layout == "bshd" and nd > 2:
        shape = shape[:-3] + (shape[-2], shape[-3], shape[-1])
    return shape


def _lse_shape(nd, B, Hq, Lq):
    return (B, Hq, Lq)[3 - (nd - 1):] if nd > 2 else (Lq,)


def _check_close(out, ref, kvd):
    """Against the float64 oracle (which reads the same float16 values)."""
    if out.dtype == np.float16:  # within one float16 rounding of the exact answer
        ref = np.asarray(ref, np.float64)
        err = np.abs(out.astype(np.float64) - ref)
        allowed = 0.5 * np.spacing(np.abs(ref).astype(np.float16)).astype(np.float64) \
            + 3e-5 * np.abs(ref).max()
        assert (err <= allowed).all(), float((err / allowed).max())
    else:
        tol = 3e-5 if np.dtype(kvd) == np.float16 else TOL[out.dtype]
        assert rel_err(out, ref) <= tol, rel_err(out, ref)


def _strided_out(shape, dtype, fill=np.nan):
    """A NaN-filled buffer and a view of it with `shape`: contiguous last axis,
    every other row of the second-last axis, an offset inside the last axis."""
    buf = np.full(shape[:-2] + (2 * shape[-2] + 1, shape[-1] + 7), fill, dtype)
    view = buf[..., 1::2, 3:3 + shape[-1]]
    assert view.shape == shape and not view.flags.c_contiguous
    return buf, view


def _untouched_outside(buf, view):
    inside = np.zeros(buf.shape, bool)
    inside[..., 1::2, 3:3 + view.shape[-1]] = True
    return np.isnan(buf[~inside]).all()


def _run_and_check(q, k, v, out, kvd, lse_shape, *, return_lse, **kw):
    """out= call vs plain call vs oracle; returns nothing, asserts everything."""
    base = fastattn.attention(q, k, v, return_lse=return_lse, **kw)
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, **kw)
    res = fastattn.attention(q, k, v, out=out, return_lse=return_lse, **kw)
    if return_lse:
        assert isinstance(res, tuple) and len(res) == 2
        got, lse = res
        base_out, base_lse = base
        assert got is out
        assert lse is not out and not np.may_share_memory(lse, out)
        assert lse.shape == lse_shape == ref_lse.shape
        assert lse.dtype == _lse_dtype(q.dtype)
        assert_lse_close(lse, ref_lse, lse.dtype)
        np.testing.assert_array_equal(lse, base_lse)
    else:
        assert res is out
        base_out = base
    assert out.dtype == np.dtype(q.dtype) and out.shape == ref_out.shape
    assert not np.isnan(out).any(), "out left (partly) unwritten"
    np.testing.assert_array_equal(out, base_out)
    _check_close(out, ref_out, kvd)


# ------------------------------------------------------------------ every layout/rank/dtype

SHAPES = {  # (B, Hq, Hkv, Lq, Lk, D, Dv)
    "prefill": (2, 6, 2, 37, 45, 24, 19),
    "decode": (2, 6, 2, 3, 700, 32, 20),     # Lq <= 8, Lk > 512: the split-KV path
}


@pytest.mark.parametrize("return_lse", [False, True], ids=["no-lse", "lse"])
@pytest.mark.parametrize("strided", [False, True], ids=["contig", "strided"])
@pytest.mark.parametrize("dts", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("nd", [2, 3, 4])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("shape", ["prefill", "decode"])
def test_out_every_layout_rank_dtype(kernel, rng, shape, layout, nd, dts, strided, return_lse):
    qd, kvd = dts
    B, Hq, Hkv, Lq, Lk, D, Dv = SHAPES[shape]
    if nd < 4:
        B = 1
    if nd == 2:
        Hq = Hkv = 1
    q, k, v = _make(rng, layout, nd, B, Hq, Hkv, Lq, Lk, D, Dv, qd, kvd)
    oshape = _out_shape(layout, nd, B, Hq, Lq, Dv)
    if strided:
        buf, out = _strided_out(oshape, qd)
    else:
        buf = out = np.full(oshape, np.nan, qd)
    _run_and_check(q, k, v, out, kvd, _lse_shape(nd, B, Hq, Lq), return_lse=return_lse,
                   causal=True, layout=layout)
    if strided:
        assert _untouched_outside(buf, out)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_out_prefilled_with_the_answer_of_another_layout_is_overwritten(kernel, rng, layout):
    """A bshd `out` is written in (B, Lq, Hq, Dv) order, not as (B, Hq, Lq, Dv) data
    poured into the same buffer: with Lq == Hq a missing axis swap still fits the shape."""
    B, H, L, D = 2, 5, 5, 16
    q, k, v = _make(rng, layout, 4, B, H, H, L, L, D, D, np.float32, np.float32)
    out = np.full(_out_shape(layout, 4, B, H, L, D), np.nan, np.float32)
    _run_and_check(q, k, v, out, np.float32, (B, H, L), return_lse=True, causal=True,
                   layout=layout)


# ------------------------------------------------------------------ variants and GQA with out=

def _variants(rng, nd, B, Hq, Lq, Lk, dt):
    ft = np.float64 if np.dtype(dt) == np.float64 else np.float32
    full = (B, Hq, Lq, Lk)[4 - nd:]
    mask = rng.random(full) > 0.3
    mask[..., 0] = True
    table = {
        "causal-br": dict(causal="bottom-right"),
        "causal-tl": dict(causal="top-left"),
        "causal-true": dict(causal=True),
        "window": dict(window=(7, 3)),
        "window-causal": dict(window=(20, None), causal=True),
        "mask-full": dict(mask=mask),
        "mask-bcast": dict(mask=rng.random((Lq, Lk)) > 0.5),
        "bias-full": dict(bias=rng.standard_normal(full).astype(ft)),
        "bias-bcast": dict(bias=rng.standard_normal(Lk).astype(ft)),
        "alibi-h": dict(alibi_slopes=np.linspace(0.05, 0.4, Hq)),
        "softcap": dict(softcap=2.5, scale=0.9),
        "all": dict(causal="top-left", window=(30, 2), bias=rng.standard_normal(full).astype(ft),
                    mask=mask, alibi_slopes=np.linspace(0.02, 0.1, Hq), softcap=4.0),
    }
    if nd == 4:
        table["alibi-bh"] = dict(alibi_slopes=rng.uniform(0.01, 0.3, (B, Hq)))
    return table


VARIANT_NAMES = ["causal-br", "causal-tl", "causal-true", "window", "window-causal", "mask-full",
                 "mask-bcast", "bias-full", "bias-bcast", "alibi-h", "alibi-bh", "softcap", "all"]


@pytest.mark.parametrize("variant", VARIANT_NAMES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("shape", ["prefill", "decode"])
def test_out_with_variants_and_gqa(kernel, rng, shape, layout, variant):
    B, Hq, Hkv, Lq, Lk, D, Dv = SHAPES[shape]
    q, k, v = _make(rng, layout, 4, B, Hq, Hkv, Lq, Lk, D, Dv, np.float32, np.float32)
    kw = _variants(rng, 4, B, Hq, Lq, Lk, np.float32)[variant]
    buf, out = _strided_out(_out_shape(layout, 4, B, Hq, Lq, Dv), np.float32)
    _run_and_check(q, k, v, out, np.float32, (B, Hq, Lq), return_lse=True, layout=layout, **kw)
    assert _untouched_outside(buf, out)


@pytest.mark.parametrize("dts", DTYPES[1:], ids=DT_IDS[1:])
@pytest.mark.parametrize("variant", ["causal-tl", "window", "mask-full", "bias-full", "alibi-h",
                                     "softcap", "all"])
def test_out_with_variants_other_dtypes(kernel, rng, variant, dts):
    """3-D bshd GQA, float64 and float16 K/V with the variants and out=."""
    qd, kvd = dts
    Hq, Hkv, Lq, Lk, D, Dv = 6, 3, 21, 33, 17, 12
    q, k, v = _make(rng, "bshd", 3, 1, Hq, Hkv, Lq, Lk, D, Dv, qd, kvd)
    kw = _variants(rng, 3, 1, Hq, Lq, Lk, qd)[variant]
    out = np.full((Lq, Hq, Dv), np.nan, qd)
    _run_and_check(q, k, v, out, kvd, (Hq, Lq), return_lse=True, layout="bshd", **kw)


@pytest.mark.parametrize("Hq,Hkv", [(6, 2), (8, 1), (4, 4)])
@pytest.mark.parametrize("Lq,Lk", [(1, 300), (2, 513), (5, 1000), (8, 640), (64, 90)])
def test_out_gqa_decode_shapes(kernel, rng, Hq, Hkv, Lq, Lk):
    """Decode shapes (Lq = 1..8 against hundreds of keys: split-KV) with out=, bshd and
    bhsd, lse both ways."""
    for layout in ("bhsd", "bshd"):
        q, k, v = _make(rng, layout, 4, 2, Hq, Hkv, Lq, Lk, 40, 24, np.float32, np.float32)
        buf, out = _strided_out(_out_shape(layout, 4, 2, Hq, Lq, 24), np.float32)
        _run_and_check(q, k, v, out, np.float32, (2, Hq, Lq), return_lse=True, layout=layout,
                       causal=True)
        assert _untouched_outside(buf, out)
        out2 = np.full(out.shape, np.nan, np.float32)
        _run_and_check(q, k, v, out2, np.float32, (2, Hq, Lq), return_lse=False, layout=layout)


def test_out_reused_across_calls(kernel, rng):
    """The same `out` passed again is overwritten with the new answer (nothing left over
    from the previous call, e.g. a fully masked row is zeroed, not kept)."""
    q, k, v = _make(rng, "bhsd", 3, 1, 4, 2, 6, 40, 16, 16, np.float32, np.float32)
    out = np.full((4, 6, 16), np.nan, np.float32)
    fastattn.attention(q, k, v, out=out)
    mask = np.ones((4, 6, 40), bool)
    mask[1, 2] = False
    res, lse = fastattn.attention(q, k, v, out=out, mask=mask, return_lse=True)
    assert res is out
    assert (out[1, 2] == 0).all() and np.isneginf(lse[1, 2])
    np.testing.assert_array_equal(out, fastattn.attention(q, k, v, mask=mask))


@pytest.mark.parametrize("Lq,Dv", [(5, 0), (0, 3)])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_out_zero_size(kernel, rng, layout, Lq, Dv):
    """A zero-size out of the right shape (freshly allocated) is accepted, though NumPy 2
    gives empty arrays zero strides; with Dv = 0 there is nothing to write into out,
    but lse is still computed."""
    q, k, v = _make(rng, layout, 4, 1, 2, 2, Lq, 9, 8, Dv, np.float32, np.float32)
    out = np.empty(_out_shape(layout, 4, 1, 2, Lq, Dv), np.float32)
    res, lse = fastattn.attention(q, k, v, out=out, return_lse=True, layout=layout)
    ref_lse = reference.attention(q, k, v, return_lse=True, layout=layout)[1]
    assert res is out and lse.shape == (1, 2, Lq)
    assert_lse_close(lse, ref_lse, np.float32)


def test_out_thread_counts_bitwise(kernel, rng):
    q, k, v = _make(rng, "bshd", 4, 2, 6, 2, 4, 1100, 32, 32, np.float32, np.float16)
    want = fastattn.attention(q, k, v, layout="bshd", causal=True, return_lse=True)
    for n in (1, 2, 3):
        out = np.full(want[0].shape, np.nan, np.float32)
        res, lse = fastattn.attention(q, k, v, layout="bshd", causal=True, return_lse=True,
                                      out=out, num_threads=n)
        assert res is out
        np.testing.assert_array_equal(out, want[0])
        np.testing.assert_array_equal(lse, want[1])


# ------------------------------------------------------------------ errors

def _err_inputs(rng):
    """3-D float32 (H=2, Lq=4, Lk=6, D=8, Dv=5): out shape (2, 4, 5)."""
    return _make(rng, "bhsd", 3, 1, 2, 2, 4, 6, 8, 5, np.float32, np.float32)


def _zero_stride_writeable(shape, dtype):
    base = np.full(shape[1:], np.nan, dtype)
    return np.lib.stride_tricks.as_strided(base, shape, (0,) + base.strides, writeable=True)


def _misaligned(shape, dtype):
    item = np.dtype(dtype).itemsize
    raw = np.zeros(int(np.prod(shape)) * item + item, np.uint8)
    a = raw[1:1 + int(np.prod(shape)) * item].view(dtype).reshape(shape)
    assert not a.flags.aligned
    return a


def _read_only(shape, dtype):
    a = np.full(shape, np.nan, dtype)
    a.flags.writeable = False
    return a


ERROR_CASES = [
    # (id, builder(q, k, v) -> (call kwargs incl. out), exception, message regex)
    ("shape-lq", lambda q, k, v: dict(out=np.full((2, 5, 5), np.nan, np.float32)),
     ValueError, r"out has shape \(2, 5, 5\), expected \(2, 4, 5\)"),
    ("shape-dv-is-d", lambda q, k, v: dict(out=np.full((2, 4, 8), np.nan, np.float32)),
     ValueError, r"out has shape \(2, 4, 8\), expected \(2, 4, 5\)"),
    ("shape-ndim", lambda q, k, v: dict(out=np.full((1, 2, 4, 5), np.nan, np.float32)),
     ValueError, r"out has shape \(1, 2, 4, 5\)"),
    ("shape-bhsd-for-bshd", lambda q, k, v: dict(
        q=np.ascontiguousarray(q.swapaxes(0, 1)), k=np.ascontiguousarray(k.swapaxes(0, 1)),
        v=np.ascontiguousarray(v.swapaxes(0, 1)), layout="bshd",
        out=np.full((2, 4, 5), np.nan, np.float32)),
     ValueError, r"out has shape \(2, 4, 5\), expected \(4, 2, 5\)"),
    ("dtype-f64", lambda q, k, v: dict(out=np.full((2, 4, 5), np.nan, np.float64)),
     TypeError, r"out has dtype float64, expected float32"),
    ("dtype-f16-for-f32q-f16kv", lambda q, k, v: dict(
        k=k.astype(np.float16), v=v.astype(np.float16), out=np.full((2, 4, 5), np.nan, np.float16)),
     TypeError, r"out has dtype float16, expected float32"),
    ("dtype-f32-for-f16q", lambda q, k, v: dict(
        q=q.astype(np.float16), k=k.astype(np.float16), v=v.astype(np.float16),
        out=np.full((2, 4, 5), np.nan, np.float32)),
     TypeError, r"out has dtype float32, expected float16"),
    ("not-an-array", lambda q, k, v: dict(out=np.full((2, 4, 5), np.nan).tolist()),
     TypeError, r"out must be a numpy array, got list"),
    ("last-axis-strided", lambda q, k, v: dict(out=np.full((2, 4, 10), np.nan, np.float32)[..., ::2]),
     ValueError, r"out must have a contiguous last axis"),
    ("last-axis-reversed", lambda q, k, v: dict(out=np.full((2, 4, 5), np.nan, np.float32)[..., ::-1]),
     ValueError, r"out must have a contiguous last axis"),
    ("fortran-order", lambda q, k, v: dict(out=np.asfortranarray(np.full((2, 4, 5), np.nan, np.float32))),
     ValueError, r"out must have a contiguous last axis"),
    ("misaligned", lambda q, k, v: dict(out=_misaligned((2, 4, 5), np.float32)),
     ValueError, r"out must have a contiguous last axis, aligned"),
    ("read-only", lambda q, k, v: dict(out=_read_only((2, 4, 5), np.float32)),
     ValueError, r"out is read-only"),
    ("broadcast-read-only", lambda q, k, v: dict(
        out=np.broadcast_to(np.full((4, 5), np.nan, np.float32), (2, 4, 5))),
     ValueError, r"out is read-only"),
    ("zero-stride-writeable", lambda q, k, v: dict(out=_zero_stride_writeable((2, 4, 5), np.float32)),
     ValueError, r"out has a zero stride \(a broadcast view\)"),
]


@pytest.mark.parametrize("case", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
@pytest.mark.parametrize("return_lse", [False, True], ids=["no-lse", "lse"])
def test_out_errors(rng, case, return_lse):
    _, build, exc, msg = case
    q, k, v = _err_inputs(rng)
    kw = dict(q=q, k=k, v=v)
    kw.update(build(q, k, v))
    out = kw["out"]
    before = np.array(out, copy=True) if isinstance(out, np.ndarray) else None
    with pytest.raises(exc, match=msg) as info:
        fastattn.attention(return_lse=return_lse, **kw)
    assert "out" in str(info.value) and str(info.value).startswith("fastattn.attention:")
    if before is not None:  # nothing written before the error
        np.testing.assert_array_equal(out, before)


def _overlap_case(rng, what):
    """q, k, v, mask, bias and out carved out of one float32 buffer so that out
    overlaps exactly `what` (and nothing else)."""
    H, Lq, Lk, D, Dv = 2, 4, 6, 8, 5
    n_out = H * Lq * Dv
    # regions in floats; the mask's bytes use the start of a region as long as out
    sizes = {"q": H * Lq * D, "k": H * Lk * D, "v": H * Lk * Dv, "mask": n_out + 8,
             "bias": Lq * Lk}
    buf = np.zeros(sum(sizes.values()) + n_out + 8, np.float32)
    arrs, starts, off = {}, {}, 0
    for name in ("q", "k", "v", "mask", "bias"):
        arrs[name], starts[name] = buf[off:off + sizes[name]], off
        off += sizes[name]
    arrs["q"] = arrs["q"].reshape(H, Lq, D)
    arrs["k"] = arrs["k"].reshape(H, Lk, D)
    arrs["v"] = arrs["v"].reshape(H, Lk, Dv)
    arrs["bias"] = arrs["bias"].reshape(Lq, Lk)
    mask_bytes = arrs["mask"].view(np.uint8)[:Lq * Lk]
    arrs["mask"] = mask_bytes.view(np.bool_).reshape(Lq, Lk)
    for name in ("q", "k", "v", "bias"):
        arrs[name][...] = rng.standard_normal(arrs[name].shape)
    mask_bytes[...] = 1
    # out starts a little inside `what` and stays inside its region (or the padding)
    start = starts[what] + {"q": 3, "k": 5, "v": 1, "mask": 2, "bias": 2}[what]
    sizes["out"] = n_out
    out = buf[start:start + sizes["out"]].reshape(H, Lq, Dv)
    return arrs, out


@pytest.mark.parametrize("what", ["q", "k", "v", "mask", "bias"])
@pytest.mark.parametrize("return_lse", [False, True], ids=["no-lse", "lse"])
def test_out_overlapping_an_input(rng, what, return_lse):
    arrs, out = _overlap_case(rng, what)
    assert np.shares_memory(out, arrs[what])
    assert not any(np.shares_memory(out, a) for n, a in arrs.items() if n != what)
    before = {n: a.copy() for n, a in arrs.items()}
    with pytest.raises(ValueError, match=rf"fastattn\.attention: out overlaps {what}; "):
        fastattn.attention(arrs["q"], arrs["k"], arrs["v"], mask=arrs["mask"], bias=arrs["bias"],
                           out=out, return_lse=return_lse)
    for n, a in arrs.items():  # no input was written
        np.testing.assert_array_equal(a, before[n])


def test_out_adjacent_to_inputs_is_fine(rng):
    """Views of one buffer that touch but do not overlap are accepted."""
    H, Lq, Lk, D = 2, 4, 6, 8
    n_q, n_kv, n_o = H * Lq * D, H * Lk * D, H * Lq * D
    buf = rng.standard_normal(n_q + 2 * n_kv + n_o).astype(np.float32)
    q = buf[:n_q].reshape(H, Lq, D)
    k = buf[n_q:n_q + n_kv].reshape(H, Lk, D)
    v = buf[n_q + n_kv:n_q + 2 * n_kv].reshape(H, Lk, D)
    out = buf[n_q + 2 * n_kv:].reshape(H, Lq, D)
    want = fastattn.attention(q, k, v)
    out[...] = np.nan
    assert fastattn.attention(q, k, v, out=out) is out
    np.testing.assert_array_equal(out, want)
