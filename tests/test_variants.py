"""Every attention variant against the oracle, alone and combined, in both layouts,
with GQA ratios 1, 2, 4, 8, lengths that are not multiples of a block and rows that
end up fully masked; attention_weights, merge and varlen_attention likewise."""
import numpy as np
import pytest

import fastattn
from fastattn import reference

from conftest import TOL, assert_lse_close, rel_err

DTYPES = [np.float32, np.float64]


def _problem(rng, dtype, B=2, Hq=4, Hkv=2, Lq=37, Lk=149, D=24, Dv=19):
    q = rng.standard_normal((B, Hq, Lq, D)).astype(dtype)
    k = rng.standard_normal((B, Hkv, Lk, D)).astype(dtype)
    v = rng.standard_normal((B, Hkv, Lk, Dv)).astype(dtype)
    return q, k, v


def _options(rng, dtype, B, Hq, Lq, Lk):
    return {
        "mask": rng.random((B, 1, Lq, Lk)) > 0.3,                   # broadcast over heads
        "mask_keys": rng.random((B, 1, 1, Lk)) > 0.2,               # key padding
        "bias": rng.standard_normal((1, Hq, 1, Lk)).astype(dtype),  # per head and key
        "bias_full": rng.standard_normal((Lq, Lk)).astype(dtype),   # one (Lq, Lk) for all
        "alibi": (2.0 ** -np.arange(1, Hq + 1)).astype(dtype),
        "alibi_b": rng.random((B, Hq)).astype(dtype) * 0.2,
    }


def _compare(q, k, v, dtype, layout="bhsd", **kw):
    out, lse = fastattn.attention(q, k, v, return_lse=True, layout=layout, **kw)
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, layout=layout, **kw)
    assert out.shape == ref_out.shape and out.dtype == dtype
    assert rel_err(out, ref_out) <= TOL[np.dtype(dtype)], (kw.keys(), rel_err(out, ref_out))
    assert_lse_close(lse, ref_lse, dtype)
    w = fastattn.attention_weights(q, k, layout=layout, **kw)
    ref_w = reference.attention_weights(q, k, layout=layout, **kw)
    assert w.dtype == dtype and w.shape == ref_w.shape
    assert np.max(np.abs(w - ref_w), initial=0) <= TOL[np.dtype(dtype)]
    return out, lse


def _cases(o):
    return {
        "mask": dict(mask=o["mask"]),
        "mask_keys": dict(mask=o["mask_keys"]),
        "bias": dict(bias=o["bias"]),
        "bias_full": dict(bias=o["bias_full"]),
        "alibi": dict(alibi_slopes=o["alibi"]),
        "alibi_b": dict(alibi_slopes=o["alibi_b"]),
        "softcap": dict(softcap=1.5),
        "window": dict(window=(9, 4)),
        "window_left": dict(window=(17, None)),
        "window_right": dict(window=(None, 2)),
        "window_causal": dict(window=(12, None), causal=True),
        "window_top_left": dict(window=(6, 3), causal="top-left"),
        "all": dict(mask=o["mask"], bias=o["bias"], alibi_slopes=o["alibi"], softcap=4.0,
                    window=(40, 3), causal=True, scale=0.3),
        "all_top_left": dict(mask=o["mask_keys"], bias=o["bias_full"], alibi_slopes=o["alibi_b"],
                             softcap=2.5, window=(None, 30), causal="top-left"),
    }


CASE_NAMES = list(_cases(_options(np.random.default_rng(0), np.float32, 2, 4, 37, 149)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASE_NAMES)
def test_variant_against_oracle(kernel, rng, dtype, case):
    q, k, v = _problem(rng, dtype)
    kw = _cases(_options(rng, dtype, 2, 4, 37, 149))[case]
    _compare(q, k, v, dtype, **kw)
    # Lq > Lk: bottom-right rows before the diagonal end up fully masked
    q2, k2, v2 = _problem(rng, dtype, Lq=150, Lk=41)
    kw2 = _cases(_options(rng, dtype, 2, 4, 150, 41))[case]
    _compare(q2, k2, v2, dtype, **kw2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["mask", "bias_full", "alibi", "window_causal", "all"])
def test_variants_in_bshd_layout(kernel, rng, dtype, case):
    q, k, v = _problem(rng, dtype)
    kw = _cases(_options(rng, dtype, 2, 4, 37, 149))[case]
    want = fastattn.attention(q, k, v, **kw)
    t = [a.transpose(0, 2, 1, 3) for a in (q, k, v)]
    out, _ = _compare(*t, dtype, layout="bshd", **kw)
    np.testing.assert_array_equal(out.transpose(0, 2, 1, 3), want)


def test_bshd_fused_qkv_views(kernel, rng):
    """Slices of a fused (B, L, 3, H, D) projection, used in place in 'bshd'."""
    qkv = rng.standard_normal((2, 53, 3, 4, 16)).astype(np.float32)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    _compare(q, k, v, np.float32, layout="bshd", causal=True, window=(10, None))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("Lq", [1, 3, 70])
def test_gqa_ratios(kernel, rng, dtype, group, Lq):
    """Query heads of a group stack into one work item when Lq is short."""
    q, k, v = _problem(rng, dtype, Hq=8, Hkv=8 // group, Lq=Lq, Lk=133)
    o = _options(rng, dtype, 2, 8, Lq, 133)
    _compare(q, k, v, dtype, causal=True, alibi_slopes=o["alibi"], mask=o["mask_keys"])
    _compare(q, k, v, dtype, window=(20, 0), bias=o["bias"])
    rep = fastattn.attention(q, np.repeat(k, group, axis=1), np.repeat(v, group, axis=1), causal=True)
    np.testing.assert_allclose(fastattn.attention(q, k, v, causal=True), rep,
                               rtol=0, atol=TOL[np.dtype(dtype)] * 10)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows_any_cause(kernel, rng, dtype):
    """Rows with no visible key give 0 and lse -inf, whatever hid the keys."""
    q, k, v = _problem(rng, dtype, Lq=20, Lk=30)
    mask = np.ones((20, 30), bool)
    mask[3] = False
    bias = np.zeros((20, 30), dtype)
    bias[5] = -np.inf
    out, lse = _compare(q, k, v, dtype, mask=mask, bias=bias, window=(0, 0), causal="top-left")
    for r in (3, 5):
        assert (out[:, :, r] == 0).all() and np.isneginf(lse[:, :, r]).all()
    out, lse = _compare(q, k, v, dtype, mask=np.zeros(30, bool))
    assert (out == 0).all() and np.isneginf(lse).all()
    w = fastattn.attention_weights(q, k, mask=np.zeros(30, bool))
    assert (w == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_window_is_a_moving_average(kernel, dtype):
    """q = 0 with a sliding window: attention degenerates to a moving average (a
    convolution) of the values."""
    L, w = 50, 4
    v = np.arange(L * 3, dtype=dtype).reshape(L, 3) ** 1.5
    q = np.zeros((L, 8), dtype)
    out = fastattn.attention(q, q, v, window=(w, 0))
    for i in range(L):
        np.testing.assert_allclose(out[i], v[max(0, i - w): i + 1].mean(axis=0), rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_weights_rows_are_stochastic(kernel, rng, dtype):
    q, k, _ = _problem(rng, dtype)
    w = fastattn.attention_weights(q, k, causal=True, softcap=3.0)
    assert (w >= 0).all()
    np.testing.assert_allclose(w.sum(axis=-1), 1.0, atol=50 * TOL[np.dtype(dtype)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nparts", [1, 2, 5])
def test_merge_of_key_splits_is_the_whole(kernel, rng, dtype, nparts):
    q, k, v = _problem(rng, dtype, Lk=160)
    mask = rng.random((2, 1, 37, 160)) > 0.5
    mask[..., 40:80] = False  # one part entirely hidden: lse -inf there
    cuts = np.linspace(0, 160, nparts + 1).astype(int) if nparts != 5 else [0, 10, 40, 80, 81, 160]
    outs, lses = [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        o, l = fastattn.attention(q, k[:, :, a:b], v[:, :, a:b], mask=mask[..., a:b], return_lse=True)
        outs.append(o)
        lses.append(l)
    out, lse = fastattn.merge(outs, lses)
    ref_out, ref_lse = reference.attention(q, k, v, mask=mask, return_lse=True)
    assert out.dtype == dtype and rel_err(out, ref_out) <= TOL[np.dtype(dtype)] * 4
    assert_lse_close(lse, ref_lse, dtype)
    ref_m = reference.merge(outs, lses)
    assert rel_err(out, ref_m[0]) <= TOL[np.dtype(dtype)]


def test_merge_all_parts_empty_and_nan_parts():
    outs = [np.full((3, 4), np.nan), np.ones((3, 4))]
    lses = [np.full(3, -np.inf), np.array([-np.inf, 0.0, 1.0])]
    out, lse = fastattn.merge(outs, lses)
    assert (out[0] == 0).all() and np.isneginf(lse[0])  # both parts empty
    np.testing.assert_array_equal(out[1:], 1.0)          # the NaN part is empty: no leak
    np.testing.assert_allclose(lse[1:], [0.0, 1.0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True, "top-left"])
def test_varlen_against_oracle(kernel, rng, dtype, causal):
    cq = np.array([0, 1, 1, 70, 75, 200])
    ck = np.array([0, 9, 30, 100, 100, 333])
    q = rng.standard_normal((200, 4, 16)).astype(dtype)
    k = rng.standard_normal((333, 2, 16)).astype(dtype)
    v = rng.standard_normal((333, 2, 12)).astype(dtype)
    al = np.array([0.1, 0.2, 0.3, 0.4], dtype)
    for kw in (dict(), dict(window=(15, 2)), dict(alibi_slopes=al, softcap=2.0)):
        out, lse = fastattn.varlen_attention(q, k, v, cq, ck, causal=causal, return_lse=True, **kw)
        ref_out, ref_lse = reference.varlen_attention(q, k, v, cq, ck, causal=causal,
                                                      return_lse=True, **kw)
        assert out.shape == (200, 4, 12) and lse.shape == (4, 200)
        assert rel_err(out, ref_out) <= TOL[np.dtype(dtype)]
        assert_lse_close(lse, ref_lse, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_long_sequences_copy_kv_heads(kernel, rng, dtype):
    """Packed K/V rows are strided by Hkv * D, so sequences with several query blocks
    have their heads copied (fa_forward.c, fa_run_head_items), items ordered by
    sequence and head, with an empty sequence among them; the bits do not depend on
    the thread count (threads steal each other's items at the end)."""
    cq = np.array([0, 700, 700, 720, 1300])  # at least 2 blocks per head on average
    ck = np.array([0, 650, 660, 900, 1500])
    q = rng.standard_normal((1300, 4, 16)).astype(dtype)
    k = rng.standard_normal((1500, 2, 16)).astype(dtype)
    v = rng.standard_normal((1500, 2, 12)).astype(dtype)
    for kw in (dict(causal=True), dict(window=(40, 3), causal="top-left"), dict()):
        out, lse = fastattn.varlen_attention(q, k, v, cq, ck, return_lse=True, num_threads=1, **kw)
        ref_out, ref_lse = reference.varlen_attention(q, k, v, cq, ck, return_lse=True, **kw)
        assert rel_err(out, ref_out) <= TOL[np.dtype(dtype)]
        assert_lse_close(lse, ref_lse, dtype)
        for n in (2, 3, 8):
            got = fastattn.varlen_attention(q, k, v, cq, ck, return_lse=True, num_threads=n, **kw)
            assert np.array_equal(got[0], out) and np.array_equal(got[1], lse)


VARIANT_ERRORS = [
    (dict(mask=np.ones((37, 149), np.int8)), TypeError, r"mask must be a bool array.*int8.*\(37, 149\)"),
    (dict(mask=np.ones((5, 149), bool)), ValueError, r"mask of shape \(5, 149\) does not broadcast.*\(2, 4, 37, 149\)"),
    (dict(bias=np.ones((37, 148))), ValueError, r"bias of shape \(37, 148\) does not broadcast"),
    (dict(bias=np.ones((37, 149), np.int32)), TypeError, r"bias must be a float array"),
    (dict(window=(-2, 3)), ValueError, r"window left size must be >= 0, or -1 or None for unbounded"),
    (dict(window=(3, -2)), ValueError, r"window right size must be >= 0"),
    (dict(window=5), ValueError, r"window must be a \(left, right\) pair"),
    (dict(window=(1.5, 2)), TypeError, r"window left size must be an int"),
    (dict(softcap=0.0), ValueError, r"softcap must be finite and > 0"),
    (dict(softcap=float("inf")), ValueError, r"softcap must be finite and > 0"),
    (dict(softcap="x"), TypeError, r"softcap must be a real number"),
    (dict(alibi_slopes=np.ones(3)), ValueError, r"alibi_slopes must have shape \(4,\) or \(2, 4\), got \(3,\)"),
    (dict(layout="sbhd"), ValueError, r"layout must be 'bhsd' or 'bshd'"),
]


@pytest.mark.parametrize("kw,exc,match", VARIANT_ERRORS)
def test_variant_errors(rng, kw, exc, match):
    q, k, v = _problem(rng, np.float32)
    with pytest.raises(exc, match=match):
        fastattn.attention(q, k, v, **kw)
    if "layout" not in kw:
        with pytest.raises(exc, match=match):
            fastattn.attention_weights(q, k, **kw)


def test_gqa_error_names_shapes(rng):
    q, k, v = _problem(rng, np.float32, Hq=6, Hkv=4)
    with pytest.raises(ValueError, match=r"multiple.*q\(2, 6, 37, 24\), k\(2, 4, 149, 24\)"):
        fastattn.attention(q, k, v)


@pytest.mark.parametrize("cq,ck,exc,match", [
    ([0, 5, 3, 10], [0, 2, 4, 20], ValueError, r"cu_seqlens_q must be 1-D, start at 0, be non-decreasing"),
    ([0, 5, 10], [0, 4, 19], ValueError, r"cu_seqlens_k .* end at the packed length 20"),
    ([1, 5, 10], [0, 4, 20], ValueError, r"cu_seqlens_q must be 1-D, start at 0"),
    ([0, 5, 10], [0, 2, 4, 20], ValueError, r"same length"),
    (np.array([0.0, 10.0]), [0, 20], TypeError, r"cu_seqlens_q must be an integer array"),
])
def test_varlen_errors(rng, cq, ck, exc, match):
    q = rng.standard_normal((10, 2, 8)).astype(np.float32)
    k = rng.standard_normal((20, 2, 8)).astype(np.float32)
    with pytest.raises(exc, match=match):
        fastattn.varlen_attention(q, k, k, cq, ck)


def test_merge_errors():
    with pytest.raises(ValueError, match="non-empty and of equal length"):
        fastattn.merge([], [])
    with pytest.raises(ValueError, match=r"outs\[1\] \(3, 5\)"):
        fastattn.merge([np.ones((3, 4)), np.ones((3, 5))], [np.ones(3), np.ones(3)])
    with pytest.raises(TypeError, match="float32 or float64"):
        fastattn.merge([np.ones((3, 4), np.int64)], [np.ones(3, np.int64)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_kv_long_enough_to_be_copied(kernel, rng, dtype):
    """Strided K/V read by several query blocks are copied once into a contiguous
    buffer (fa_forward.c, fa_run_head_items): same answers as in place."""
    qkv = rng.standard_normal((2, 450, 3, 4, 20)).astype(dtype)
    q, k, v = qkv[:, :, 0], qkv[:, 5:, 1], qkv[:, 5:, 2, :, :13]
    for kw in (dict(causal=True), dict(window=(30, 10), mask=rng.random((450, 445)) > 0.2)):
        out, _ = _compare(q, k, v, dtype, layout="bshd", **kw)
        dense = fastattn.attention(*(np.ascontiguousarray(a) for a in (q, k, v)), layout="bshd", **kw)
        np.testing.assert_array_equal(out, dense)
