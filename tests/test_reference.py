"""Tests of the float64 oracle itself against an independent triple-loop brute force."""
import math

import numpy as np
import pytest

from fastattn import reference as ref

B, HQ, HKV, D, DV = 2, 4, 2, 3, 5


def brute(q, k, v, scale=None, causal=False, window=None, mask=None, bias=None,
          alibi_slopes=None, softcap=None):
    """Per (b, h, i): gather the visible keys, then exp/sum with the math module.
    Takes 4-D bhsd arrays; returns (out (B,Hq,Lq,Dv), lse (B,Hq,Lq))."""
    Bq, Hq, Lq, d = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    sc = 1.0 / math.sqrt(d) if scale is None else scale
    full = (Bq, Hq, Lq, Lk)
    mask = None if mask is None else np.broadcast_to(mask, full)
    bias = None if bias is None else np.broadcast_to(bias, full)
    left, right = (None, None) if window is None else window
    out = np.zeros((Bq, Hq, Lq, Dv))
    lse = np.full((Bq, Hq, Lq), -math.inf)
    for b in range(Bq):
        for h in range(Hq):
            hk = h // (Hq // Hkv)
            for i in range(Lq):
                a = i if causal == "top-left" else i + Lk - Lq
                seen = []
                for j in range(Lk):
                    if causal and j > a:
                        continue
                    if left is not None and j < a - left:
                        continue
                    if right is not None and j > a + right:
                        continue
                    if mask is not None and not mask[b, h, i, j]:
                        continue
                    x = sc * sum(float(q[b, h, i, t]) * float(k[b, hk, j, t])
                                 for t in range(d))
                    if softcap is not None:
                        x = softcap * math.tanh(x / softcap)
                    if alibi_slopes is not None:
                        sl = np.asarray(alibi_slopes)
                        slope = sl[h] if sl.ndim == 1 else sl[b, h]
                        x -= float(slope) * abs(i + Lk - Lq - j)
                    if bias is not None:
                        x += float(bias[b, h, i, j])
                    seen.append((j, x))
                if not seen:
                    continue
                m = max(x for _, x in seen)
                es = [(j, math.exp(x - m)) for j, x in seen]
                tot = sum(e for _, e in es)
                lse[b, h, i] = m + math.log(tot)
                for c in range(Dv):
                    out[b, h, i, c] = sum(e * float(v[b, hk, j, c]) for j, e in es) / tot
    return out, lse


def qkv(Lq, Lk, seed=0, b=B, hq=HQ, hkv=HKV, d=D, dv=DV):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((b, hq, Lq, d)), rng.standard_normal((b, hkv, Lk, d)),
            rng.standard_normal((b, hkv, Lk, dv)))


def options(Lq, Lk):
    rng = np.random.default_rng(123)
    mask = rng.random((1, HQ, Lq, Lk)) < 0.7
    return {
        "none": {},
        "scale": dict(scale=0.37),
        "scale0": dict(scale=0.0),
        "scale_neg": dict(scale=-1.3),
        "softcap": dict(softcap=0.8),
        "alibi_h": dict(alibi_slopes=rng.random(HQ)),
        "alibi_bh": dict(alibi_slopes=rng.random((B, HQ))),
        "bias_full": dict(bias=rng.standard_normal((B, HQ, Lq, Lk))),
        "bias_bcast": dict(bias=rng.standard_normal((HQ, 1, Lk))),
        "bias_row": dict(bias=rng.standard_normal((Lk,))),
        "mask": dict(mask=mask),
        "mask_bcast": dict(mask=rng.random((Lq, 1)) < 0.7),
        "causal_true": dict(causal=True),
        "causal_br": dict(causal="bottom-right"),
        "causal_tl": dict(causal="top-left"),
        "window": dict(window=(2, 1)),
        "window_left": dict(window=(1, None)),
        "window_right": dict(window=(None, 0)),
        "window_none": dict(window=(None, None)),
        "causal_window": dict(causal=True, window=(2, 0)),
        "tl_window": dict(causal="top-left", window=(1, 2)),
        "all": dict(scale=0.9, softcap=1.5, alibi_slopes=rng.random((B, HQ)),
                    bias=rng.standard_normal((1, HQ, Lq, Lk)), mask=mask,
                    causal="top-left", window=(3, None)),
        "all_br": dict(softcap=2.0, alibi_slopes=rng.random(HQ),
                       bias=rng.standard_normal((Lq, Lk)), causal=True, window=(2, 1)),
    }


LENGTHS = [(5, 7), (7, 5), (6, 6), (1, 4)]


@pytest.mark.parametrize("Lq,Lk", LENGTHS)
@pytest.mark.parametrize("name", list(options(1, 1)))
def test_against_brute(Lq, Lk, name):
    opts = options(Lq, Lk)[name]
    q, k, v = qkv(Lq, Lk, seed=Lq * 10 + Lk)
    out, lse = ref.attention(q, k, v, return_lse=True, **opts)
    bo, bl = brute(q, k, v, **opts)
    assert out.dtype == lse.dtype == np.float64
    assert out.shape == (B, HQ, Lq, DV) and lse.shape == (B, HQ, Lq)
    np.testing.assert_allclose(out, bo, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(bl))
    np.testing.assert_allclose(lse, bl, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(ref.attention(q, k, v, **opts), out)


@pytest.mark.parametrize("name", ["none", "all", "all_br", "causal_tl", "bias_bcast"])
def test_bshd_layout_is_transposed_bhsd(name):
    opts = options(5, 7)[name]
    q, k, v = qkv(5, 7, seed=3)
    out, lse = ref.attention(q, k, v, return_lse=True, **opts)
    t = lambda a: a.swapaxes(1, 2)
    out2, lse2 = ref.attention(t(q), t(k), t(v), layout="bshd", return_lse=True, **opts)
    assert out2.shape == (B, 5, HQ, DV) and lse2.shape == (B, HQ, 5)
    np.testing.assert_array_equal(out2, t(out))
    np.testing.assert_array_equal(lse2, lse)
    w = ref.attention_weights(t(q), t(k), layout="bshd", **opts)
    np.testing.assert_array_equal(w, ref.attention_weights(q, k, **opts))
    # 3-D bshd is (L, H, D)
    opts3 = {kk: (vv[-1] if kk in ("bias", "mask") and np.ndim(vv) == 4 else vv)
             for kk, vv in opts.items() if not (kk == "alibi_slopes" and np.ndim(vv) == 2)}
    o3, l3 = ref.attention(t(q)[1], t(k)[1], t(v)[1], layout="bshd", return_lse=True, **opts3)
    ob, lb = brute(q[1:], k[1:], v[1:], **opts3)
    np.testing.assert_allclose(o3, ob[0].swapaxes(0, 1), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(l3, lb[0], rtol=1e-12, atol=1e-12)


def test_low_ndim_inputs():
    q, k, v = qkv(4, 6, seed=5, b=1, hq=2, hkv=1)
    opts = dict(causal=True, window=(2, None), bias=np.linspace(0, 1, 6))
    bo, bl = brute(q, k, v, **opts)
    o3, l3 = ref.attention(q[0], k[0], v[0], alibi_slopes=None, return_lse=True, **opts)
    np.testing.assert_allclose(o3, bo[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(l3, bl[0], rtol=1e-12, atol=1e-12)
    o2, l2 = ref.attention(q[0, 0], k[0, 0], v[0, 0], return_lse=True, **opts)
    assert o2.shape == (4, DV) and l2.shape == (4,)
    np.testing.assert_allclose(o2, bo[0, 0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(l2, bl[0, 0], rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(ref.attention(q[0, 0], k[0, 0], v[0, 0], layout="bshd",
                                                **opts), o2)
    w2 = ref.attention_weights(q[0, 0], k[0, 0], alibi_slopes=[0.5], **opts)
    assert w2.shape == (4, 6)


def test_gqa_equals_repeated_kv():
    q, k, v = qkv(5, 6, seed=7, hq=6, hkv=2)
    o = ref.attention(q, k, v, causal=True)
    o_rep = ref.attention(q, np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1), causal=True)
    np.testing.assert_allclose(o, o_rep, rtol=0, atol=1e-15)
    np.testing.assert_allclose(o, brute(q, k, v, causal=True)[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["none", "causal_br", "all", "all_br", "mask"])
def test_weights_are_softmax(name):
    opts = options(5, 7)[name]
    q, k, v = qkv(5, 7, seed=11)
    w = ref.attention_weights(q, k, **opts)
    out, lse = ref.attention(q, k, v, return_lse=True, **opts)
    assert w.shape == (B, HQ, 5, 7) and w.dtype == np.float64
    assert np.all(w >= 0)
    rows = w.sum(-1)
    np.testing.assert_allclose(rows[np.isfinite(lse)], 1.0, rtol=1e-13)
    assert np.all(rows[np.isneginf(lse)] == 0)
    np.testing.assert_allclose(w @ np.repeat(v, HQ // HKV, axis=1), out, rtol=1e-12,
                               atol=1e-14)


def test_weights_equal_exp_logits_minus_lse():
    q, k, v = qkv(6, 6, seed=13)
    w = ref.attention_weights(q, k, causal=True, scale=0.5)
    _, lse = ref.attention(q, k, v, causal=True, scale=0.5, return_lse=True)
    s = 0.5 * q @ np.repeat(k, 2, axis=1).swapaxes(-1, -2)
    vis = np.tril(np.ones((6, 6), bool))
    np.testing.assert_allclose(w, np.where(vis, np.exp(s - lse[..., None]), 0), rtol=1e-13)


def test_merge_of_key_split_equals_whole():
    q, k, v = qkv(5, 9, seed=17)
    rng = np.random.default_rng(0)
    bias = rng.standard_normal((B, HQ, 5, 9))
    mask = np.ones((5, 9), bool)
    mask[:, 3:6] = False           # the middle part is entirely masked
    mask[2, :] = False             # and one query row sees nothing at all
    whole, lse = ref.attention(q, k, v, bias=bias, mask=mask, return_lse=True)
    parts = [slice(0, 3), slice(3, 6), slice(6, 9)]
    outs, lses = zip(*[ref.attention(q, k[:, :, p], v[:, :, p], bias=bias[..., p],
                                     mask=mask[:, p], return_lse=True) for p in parts])
    assert np.all(np.isneginf(lses[1]))
    mo, ml = ref.merge(outs, lses)
    np.testing.assert_allclose(mo, whole, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(ml, lse, rtol=1e-12)
    assert np.all(mo[:, :, 2] == 0) and np.all(np.isneginf(ml[:, :, 2]))
    # bshd outputs merge the same way once lse is aligned to (..., Lq, Hq)
    mo2, _ = ref.merge([o.swapaxes(1, 2) for o in outs], [x.swapaxes(1, 2) for x in lses])
    np.testing.assert_array_equal(mo2, mo.swapaxes(1, 2))


def test_merge_dead_parts():
    o = np.full((3, 4), np.nan)
    dead = np.full(3, -np.inf)
    mo, ml = ref.merge([o, o], [dead, dead])
    assert np.all(mo == 0) and np.all(np.isneginf(ml))
    live = np.arange(12.0).reshape(3, 4)
    mo, ml = ref.merge([o, live], [dead, np.array([0.0, 1e4, -1e4])])
    np.testing.assert_array_equal(mo, live)
    np.testing.assert_array_equal(ml, [0.0, 1e4, -1e4])
    mo, ml = ref.merge([live], [np.zeros(3)])
    np.testing.assert_array_equal(mo, live)


def test_varlen_equals_per_sequence():
    rng = np.random.default_rng(19)
    cu_q = np.array([0, 3, 3, 8, 10], dtype=np.int32)
    cu_k = np.array([0, 4, 6, 11, 11], dtype=np.int64)   # seq 1: no queries, seq 3: no keys
    q = rng.standard_normal((10, HQ, D))
    k = rng.standard_normal((11, HKV, D))
    v = rng.standard_normal((11, HKV, DV))
    opts = dict(causal=True, window=(2, None), alibi_slopes=rng.random(HQ), softcap=3.0)
    out, lse = ref.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True, **opts)
    assert out.shape == (10, HQ, DV) and lse.shape == (HQ, 10)
    for s in range(4):
        qs, ks = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        bo, bl = brute(q[None, qs].swapaxes(1, 2), k[None, ks].swapaxes(1, 2),
                       v[None, ks].swapaxes(1, 2), **opts)
        np.testing.assert_allclose(out[qs], bo[0].swapaxes(0, 1), rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(lse[:, qs], bl[0], rtol=1e-12)
    assert np.all(out[8:] == 0) and np.all(np.isneginf(lse[:, 8:]))
    np.testing.assert_array_equal(ref.varlen_attention(q, k, v, cu_q, cu_k, **opts), out)


def test_fully_masked_rows():
    q, k, v = qkv(4, 3, seed=23)
    mask = np.ones((4, 3), bool)
    mask[1] = False
    bias = np.zeros((4, 3))
    bias[2] = -np.inf
    out, lse = ref.attention(q, k, v, mask=mask, bias=bias, return_lse=True)
    for r in (1, 2):
        assert np.all(out[:, :, r] == 0) and np.all(np.isneginf(lse[:, :, r]))
    assert np.all(np.isfinite(out[:, :, [0, 3]]))
    # bottom-right causal with Lq > Lk: the first Lq - Lk queries see nothing
    out, lse = ref.attention(q, k, v, causal=True, return_lse=True)
    assert np.all(out[:, :, 0] == 0) and np.all(np.isneginf(lse[:, :, 0]))
    assert np.all(np.isfinite(lse[:, :, 1:]))
    w = ref.attention_weights(q, k, window=(0, 0), causal="top-left")
    np.testing.assert_array_equal(w[..., 3, :], 0)


def test_empty_inputs():
    q, k, v = qkv(0, 4, seed=29)
    out, lse = ref.attention(q, k, v, return_lse=True)
    assert out.shape == (B, HQ, 0, DV) and lse.shape == (B, HQ, 0)
    q, k, v = qkv(3, 0, seed=29)
    out, lse = ref.attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == (B, HQ, 3, DV) and np.all(out == 0) and np.all(np.isneginf(lse))
    assert ref.attention_weights(q, k).shape == (B, HQ, 3, 0)
    out = ref.attention(np.zeros((0, 2, 3, 4)), np.zeros((0, 1, 5, 4)), np.zeros((0, 1, 5, 2)))
    assert out.shape == (0, 2, 3, 2)


def test_big_logits_do_not_overflow():
    q, k, v = qkv(5, 6, seed=31)
    out, lse = ref.attention(q, k, v, scale=1e4, return_lse=True)
    bo, bl = brute(q, k, v, scale=1e4)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
    assert np.abs(lse).max() > 1e3
    np.testing.assert_allclose(out, bo, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(lse, bl, rtol=1e-12)
    out = ref.attention(q, k, v, bias=np.full((5, 6), -1e4), mask=np.eye(5, 6, dtype=bool))
    np.testing.assert_allclose(out, np.repeat(v, 2, axis=1)[:, :, :5], rtol=1e-15)


def test_nan_propagation():
    q, k, v = qkv(4, 4, seed=37)
    q[0, 0, 1, 0] = np.nan
    out = ref.attention(q, k, v)
    assert np.all(np.isnan(out[0, 0, 1]))
    assert np.isnan(out).sum() == DV
    q, k, v = qkv(4, 4, seed=37)
    v[0, 0, 2, 1] = np.nan                   # kv head 0 -> query heads 0, 1
    k[1, 1, 3, 0] = np.nan                   # kv head 1 -> query heads 2, 3
    out = ref.attention(q, k, v, causal=True)
    assert np.all(np.isnan(out[0, :2, 2:, 1]))       # queries 2, 3 see value row 2
    assert not np.isnan(out[0, :2, 2:, [0, 2, 3, 4]]).any()
    assert not np.isnan(out[0, :2, :2]).any()        # queries 0, 1 do not
    assert np.all(np.isnan(out[1, 2:, 3]))           # only query 3 sees key 3
    assert np.isnan(out).sum() == 2 * 2 + 2 * DV
    m = np.ones((4, 4), bool)
    m[:, 2] = False
    assert not np.isnan(ref.attention(q, k, v, mask=m)[0]).any()


def test_float_dtypes_are_converted():
    q, k, v = qkv(3, 5, seed=41)
    for dt in (np.float16, np.float32):
        qd, kd, vd = (a.astype(dt) for a in (q, k, v))
        out, lse = ref.attention(qd, kd, vd, return_lse=True)
        assert out.dtype == lse.dtype == np.float64
        np.testing.assert_allclose(out, brute(*(a.astype(np.float64) for a in (qd, kd, vd)))[0],
                                   rtol=1e-12, atol=1e-12)
    out = ref.attention(q, k, v, out=np.empty(1), num_threads=3)   # accepted, ignored
    np.testing.assert_array_equal(out, ref.attention(q, k, v))


def test_scale_zero_is_mean_of_visible():
    q, k, v = qkv(4, 4, seed=43)
    out = ref.attention(q, k, v, scale=0.0, causal=True)
    vr = np.repeat(v, 2, axis=1)
    mean = np.cumsum(vr, axis=2) / np.arange(1, 5)[:, None]
    np.testing.assert_allclose(out, mean, rtol=1e-13)


q0, k0, v0 = qkv(3, 4, seed=0)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(k=k0[..., :2]), ValueError, "head dims"),
    (dict(q=q0[:, :3]), ValueError, "multiple"),
    (dict(k=k0[:1], v=v0[:1]), ValueError, "batch"),
    (dict(v=v0[:, :, :3]), ValueError, "v"),
    (dict(q=q0[0]), ValueError, "ndim"),
    (dict(q=q0[None]), ValueError, "q"),
    (dict(causal="left"), ValueError, "causal"),
    (dict(layout="bsdh"), ValueError, "layout"),
    (dict(window=(-2, 2)), ValueError, "window"),
    (dict(window=(1, -2)), ValueError, "window"),
    (dict(window=3), ValueError, "window"),
    (dict(window=(1.5, 2)), TypeError, "window"),
    (dict(scale=np.inf), ValueError, "scale"),
    (dict(scale=np.nan), ValueError, "scale"),
    (dict(scale="a"), TypeError, "scale"),
    (dict(softcap=0.0), ValueError, "softcap"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap=np.inf), ValueError, "softcap"),
    (dict(num_threads=0), ValueError, "num_threads"),
    (dict(num_threads=1.5), TypeError, "num_threads"),
    (dict(q=q0.astype(np.int32)), TypeError, "q"),
    (dict(v=v0.astype(np.complex128)), TypeError, "v"),
    (dict(mask=np.ones((3, 4), np.int8)), TypeError, "mask"),
    (dict(mask=np.ones((3, 5), bool)), ValueError, r"mask .*\(3, 5\)"),
    (dict(bias=np.ones((3, 4), np.int64)), TypeError, "bias"),
    (dict(bias=np.ones((4, 4))), ValueError, r"bias .*\(4, 4\)"),
    (dict(bias=np.ones((1, 1, 1, 3, 4))), ValueError, "bias"),
    (dict(alibi_slopes=np.ones(3)), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=np.ones((1, HQ))), ValueError, "alibi_slopes"),
])
def test_errors(kwargs, exc, match):
    args, kwargs = dict(q=q0, k=k0, v=v0), dict(kwargs)
    args.update({n: kwargs.pop(n) for n in ("q", "k", "v") if n in kwargs})
    with pytest.raises(exc, match=match):
        ref.attention(args["q"], args["k"], args["v"], **kwargs)


def test_merge_and_varlen_errors():
    with pytest.raises(ValueError, match="lses"):
        ref.merge([np.zeros((3, 4))], [np.zeros(4)])
    with pytest.raises(ValueError, match="outs"):
        ref.merge([], [])
    q, k, v = np.zeros((5, 2, 3)), np.zeros((6, 1, 3)), np.zeros((6, 1, 2))
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        ref.varlen_attention(q, k, v, np.array([0, 2, 4]), np.array([0, 3, 6]))
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        ref.varlen_attention(q, k, v, np.array([0, 2, 5]), np.array([0, 4, 3, 6]))
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        ref.varlen_attention(q, k, v, np.array([0.0, 5.0]), np.array([0, 6]))
    with pytest.raises(ValueError, match="same length"):
        ref.varlen_attention(q, k, v, np.array([0, 5]), np.array([0, 3, 6]))
    with pytest.raises(ValueError, match="q"):
        ref.varlen_attention(q[None], k, v, np.array([0, 5]), np.array([0, 6]))


def test_offsets_are_positions_in_one_longer_sequence():
    """q_offset/k_offset: a block of queries and keys of a longer sequence, with the
    positions deciding causal, window and ALiBi, gives the full call's rows when the
    block holds every key those rows see."""
    rng = np.random.default_rng(5)
    H, L, D = 2, 40, 8
    q, k, v = (rng.standard_normal((H, L, D)) for _ in range(3))
    slopes = np.array([0.2, 0.7])
    cases = [(dict(causal=True), (30, 40, 0, 40)), (dict(causal=True), (0, 1, 0, 1)),
             (dict(causal=True, window=(5, 0)), (30, 40, 25, 40)),
             (dict(window=(3, 2)), (10, 17, 7, 19)),
             (dict(causal="bottom-right", alibi_slopes=slopes, window=(6, None)), (20, 30, 14, 30))]
    for kw, (q0, q1, k0, k1) in cases:
        full, full_lse = ref.attention(q, k, v, return_lse=True, **kw)
        blk, lse = ref.attention(q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], q_offset=q0, k_offset=k0,
                                 return_lse=True, **kw)
        np.testing.assert_allclose(blk, full[:, q0:q1], atol=1e-13)
        np.testing.assert_allclose(lse, full_lse[:, q0:q1], atol=1e-13)
    # without the offsets the same block is aligned by its own lengths: different rows
    blk = ref.attention(q[:, 10:17], k[:, 7:19], v[:, 7:19], window=(3, 2))
    assert np.abs(blk - ref.attention(q, k, v, window=(3, 2))[:, 10:17]).max() > 1e-3
    with pytest.raises(ValueError, match="top-left"):
        ref.attention(q, k, v, causal="top-left", q_offset=3)
    with pytest.raises(TypeError, match="q_offset"):
        ref.attention(q, k, v, q_offset=1.5)
