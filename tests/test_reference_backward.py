"""The oracle's dropout generator (Philox-4x32-10), dropout in its forward pass, and its
backward pass (reference.attention_backward): known answers, the exact keep/drop
definition, finite differences in float64 and torch.autograd."""
import math
import re

import numpy as np
import pytest

from fastattn import reference as ref

M32 = 0xFFFFFFFF


# ------------------------------------------------------------------ Philox-4x32-10
def philox_scalar(c, k):
    """Philox-4x32-10 on Python ints, written straight from Random123's definition."""
    c0, c1, c2, c3 = c
    k0, k1 = k
    for r in range(10):
        p0 = 0xD2511F53 * c0
        p1 = 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & M32, (p0 >> 32) ^ c3 ^ k1, p0 & M32
        if r < 9:
            k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    return c0, c1, c2, c3


KAT = [  # Random123's known-answer tests for philox4x32_10
    ((0, 0, 0, 0), (0, 0), (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
    ((M32,) * 4, (M32, M32), (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
    ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
     (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1)),
]


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_philox_known_answers(counter, key, expected):
    got = ref.philox4x32(np.array(counter, dtype=np.uint32), np.array(key, dtype=np.uint32))
    assert got.dtype == np.uint32 and got.shape == (4,)
    assert tuple(int(x) for x in got) == expected
    assert philox_scalar(counter, key) == expected       # the test's own copy is right too


def test_philox_known_answers_in_one_batch():
    c = np.array([kat[0] for kat in KAT], dtype=np.uint32)
    k = np.array([kat[1] for kat in KAT], dtype=np.uint32)
    np.testing.assert_array_equal(ref.philox4x32(c, k), np.array([kat[2] for kat in KAT]))


def test_philox_matches_scalar_on_random_inputs():
    rng = np.random.default_rng(0)
    c = rng.integers(0, 2 ** 32, size=(3, 5, 4), dtype=np.uint64)
    k = rng.integers(0, 2 ** 32, size=(2,), dtype=np.uint64)
    got = ref.philox4x32(c, k)                      # key (2,) shared by every counter
    assert got.shape == (3, 5, 4) and got.dtype == np.uint32
    for idx in np.ndindex(3, 5):
        assert tuple(int(x) for x in got[idx]) == philox_scalar(
            tuple(int(x) for x in c[idx]), tuple(int(x) for x in k))
    ks = rng.integers(0, 2 ** 32, size=(5, 2), dtype=np.uint64)
    got = ref.philox4x32(c, ks)                     # key per counter, broadcast over axis 0
    for a, b in np.ndindex(3, 5):
        assert tuple(int(x) for x in got[a, b]) == philox_scalar(
            tuple(int(x) for x in c[a, b]), tuple(int(x) for x in ks[b]))


@pytest.mark.parametrize("counter,key,exc,pattern", [
    (np.zeros(3, np.uint32), np.zeros(2, np.uint32), ValueError, "counter must have a last axis of 4"),
    (np.zeros(4, np.uint32), np.zeros(3, np.uint32), ValueError, "key must have a last axis of 2"),
    (np.zeros(4), np.zeros(2, np.uint32), TypeError, "counter must be an integer array"),
    ([0, 0, 0, -1], [0, 0], ValueError, r"counter words must be in \[0, 2\*\*32\)"),
    ([0, 0, 0, 0], [2 ** 32, 0], ValueError, r"key words must be in \[0, 2\*\*32\)"),
])
def test_philox_input_errors(counter, key, exc, pattern):
    with pytest.raises(exc, match=pattern):
        ref.philox4x32(counter, key)


# ------------------------------------------------------------------ dropout_keep
SEED = 0x0123456789ABCDEF      # both 32-bit halves non-zero and different


def test_dropout_keep_is_the_documented_definition():
    B, H, Lq, Lk, p = 3, 2, 5, 11, 0.37
    keep = ref.dropout_keep(SEED, p, B, H, Lq, Lk)
    assert keep.shape == (B, H, Lq, Lk) and keep.dtype == np.bool_
    t = min(int(p * 4294967296.0), 2 ** 32 - 1)
    key = (SEED & M32, (SEED >> 32) & M32)
    for b, h, i, j in np.ndindex(B, H, Lq, Lk):
        word = philox_scalar((j >> 2, i, h, b), key)[j & 3]
        assert keep[b, h, i, j] == (word >= t), (b, h, i, j)


def test_dropout_keep_threshold_is_inclusive():
    """keep iff word >= t: a p whose threshold is exactly some word keeps that entry, and
    the next threshold up drops it."""
    word = philox_scalar((0, 0, 0, 0), (SEED & M32, SEED >> 32))[0]
    assert 0 < word < M32
    assert ref.dropout_keep(SEED, word / 2 ** 32, 1, 1, 1, 1)[0, 0, 0, 0]
    assert not ref.dropout_keep(SEED, (word + 1) / 2 ** 32, 1, 1, 1, 1)[0, 0, 0, 0]


def test_dropout_keep_is_deterministic_and_prefix_stable():
    a = ref.dropout_keep(7, 0.5, 2, 3, 6, 9)
    np.testing.assert_array_equal(a, ref.dropout_keep(7, 0.5, 2, 3, 6, 9))
    # each entry depends only on (seed, b, h, i, j), not on the shape asked for
    np.testing.assert_array_equal(a[:1, :2, :4, :5], ref.dropout_keep(7, 0.5, 1, 2, 4, 5))
    assert ref.dropout_keep(7, 0.5, 0, 3, 6, 9).shape == (0, 3, 6, 9)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_keep_rate(p):
    keep = ref.dropout_keep(SEED, p, 4, 4, 250, 250)
    n = keep.size
    assert n >= 10 ** 6
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(keep.mean() - (1 - p)) <= 4 * sigma


def test_dropout_keep_p0_keeps_everything():
    assert ref.dropout_keep(SEED, 0.0, 2, 2, 3, 5).all()
    assert ref.dropout_keep(None, 0.0, 2, 2, 3, 5).all()


def test_different_seeds_give_different_masks():
    seeds = [0, 1, 2 ** 32, 1 + 2 ** 32, 2 ** 63, 2 ** 64 - 1]   # the high half matters too
    masks = [ref.dropout_keep(s, 0.5, 2, 2, 8, 8) for s in seeds]
    for a in range(len(seeds)):
        for b in range(a):
            assert (masks[a] != masks[b]).any(), (seeds[a], seeds[b])


@pytest.mark.parametrize("seed", [np.uint64(2 ** 64 - 1), np.int64(5), 2 ** 64 - 1, 0])
def test_dropout_keep_accepts_int_seeds(seed):
    np.testing.assert_array_equal(ref.dropout_keep(seed, 0.5, 1, 2, 3, 4),
                                  ref.dropout_keep(int(seed), 0.5, 1, 2, 3, 4))


@pytest.mark.parametrize("seed,exc,pattern", [
    (-1, ValueError, r"seed must be in \[0, 2\*\*64\), got -1"),
    (2 ** 64, ValueError, r"seed must be in \[0, 2\*\*64\), got 18446744073709551616"),
    (1.0, TypeError, r"seed must be an int .*got 1\.0"),
    ("3", TypeError, r"seed must be an int .*got '3'"),
    (True, TypeError, r"seed must be an int .*got True"),
    (np.array([1]), TypeError, r"seed must be an int"),
])
def test_seed_errors(seed, exc, pattern):
    with pytest.raises(exc, match=pattern):
        ref.dropout_keep(seed, 0.5, 1, 1, 2, 2)


@pytest.mark.parametrize("p,exc,pattern", [
    (-0.1, ValueError, r"p must be in \[0, 1\), got -0\.1"),
    (1.0, ValueError, r"p must be in \[0, 1\), got 1\.0"),
    (1.5, ValueError, r"p must be in \[0, 1\), got 1\.5"),
    (float("nan"), ValueError, r"p must be in \[0, 1\), got nan"),
    ("0.1", TypeError, r"p must be a real number .*got '0\.1'"),
    (None, TypeError, r"p must be a real number .*got None"),
    (True, TypeError, r"p must be a real number .*got True"),
])
def test_dropout_p_errors(p, exc, pattern):
    with pytest.raises(exc, match="^" + pattern):           # dropout_keep calls it p
        ref.dropout_keep(1, p, 1, 1, 2, 2)
    with pytest.raises(exc, match="^dropout_" + pattern):   # attention calls it dropout_p
        ref.attention(np.ones((2, 3)), np.ones((2, 3)), np.ones((2, 3)), dropout_p=p, seed=1)


def test_dropout_keep_needs_a_seed_for_p_above_0():
    with pytest.raises(ValueError, match=r"^p > 0 needs a seed, got p=0\.5 and seed=None"):
        ref.dropout_keep(None, 0.5, 1, 1, 2, 2)


@pytest.mark.parametrize("name,value,exc", [("B", -1, ValueError), ("Lk", 2.0, TypeError)])
def test_dropout_keep_size_errors(name, value, exc):
    sizes = dict(B=1, H=1, Lq=2, Lk=2)
    sizes[name] = value
    with pytest.raises(exc, match=name):
        ref.dropout_keep(1, 0.5, **sizes)


# ------------------------------------------------------------------ forward with dropout
def _qkv(rng, B=2, Hq=2, Hkv=2, Lq=5, Lk=7, D=3, Dv=4, layout="bhsd"):
    q = rng.standard_normal((B, Hq, Lq, D))
    k = rng.standard_normal((B, Hkv, Lk, D))
    v = rng.standard_normal((B, Hkv, Lk, Dv))
    if layout == "bshd":
        q, k, v = (x.swapaxes(1, 2) for x in (q, k, v))
    return q, k, v


def _plain_softmax_attention(q, k, v, scale):
    s = scale * q @ k.swapaxes(-1, -2)
    e = np.exp(s - s.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)) @ v


def test_dropout_p0_is_the_undropped_attention(rng):
    q, k, v = _qkv(rng)
    base = ref.attention(q, k, v)
    np.testing.assert_array_equal(ref.attention(q, k, v, dropout_p=0.0, seed=9), base)
    np.testing.assert_array_equal(ref.attention(q, k, v, dropout_p=0.0), base)
    np.testing.assert_allclose(base, _plain_softmax_attention(q, k, v, 1 / math.sqrt(3)),
                               rtol=0, atol=1e-14)


FWD_CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "top-left+window": dict(causal="top-left", window=(2, None)),
    "mask+bias+alibi+softcap": dict(mask="rowless", bias=(5, 7), alibi_slopes=[0.3, 0.7],
                                    softcap=1.5),
}


def _kw(rng, case, B=2, Hq=2, Lq=5, Lk=7):
    kw = dict(FWD_CASES[case])
    if kw.get("mask") == "rowless":
        m = rng.random((B, 1, Lq, Lk)) < 0.7
        m[1, 0, 2] = False                          # a query row with no visible key
        kw["mask"] = m
    if "bias" in kw:
        kw["bias"] = rng.standard_normal(kw["bias"])
    return kw


@pytest.mark.parametrize("case", list(FWD_CASES))
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_dropout_forward_is_dropped_weights_at_v(rng, case, layout):
    q, k, v = _qkv(rng, Hq=4, layout=layout)        # GQA 4 -> 2
    kw = _kw(rng, case)
    if "alibi_slopes" in kw:
        kw["alibi_slopes"] = [0.3, 0.7, 0.1, 0.2]
    p, seed = 0.4, 2 ** 40 + 3
    w0 = ref.attention_weights(q, k, layout=layout, **kw)
    w = ref.attention_weights(q, k, layout=layout, dropout_p=p, seed=seed, **kw)
    keep = ref.dropout_keep(seed, p, 2, 4, 5, 7)
    np.testing.assert_array_equal(w, w0 * keep / (1 - p))
    assert (~keep & (w0 > 0)).any()                 # some visible weight was dropped
    out, lse = ref.attention(q, k, v, layout=layout, dropout_p=p, seed=seed, return_lse=True,
                             **kw)
    v4 = v if layout == "bhsd" else v.swapaxes(1, 2)
    expect = w @ np.repeat(v4, 2, axis=1)
    if layout == "bshd":
        expect = expect.swapaxes(1, 2)
    np.testing.assert_allclose(out, expect, rtol=0, atol=1e-14)
    _, lse0 = ref.attention(q, k, v, layout=layout, return_lse=True, **kw)
    np.testing.assert_array_equal(lse, lse0)        # lse is that of the undropped softmax
    assert np.max(np.abs(out - ref.attention(q, k, v, layout=layout, **kw))) > 1e-3


@pytest.mark.parametrize("ndim", [2, 3])
def test_dropout_small_ranks_use_b0_h0(rng, ndim):
    q, k, v = (x[0, 0] if ndim == 2 else x[0] for x in _qkv(rng))
    p, seed = 0.5, 11
    keep = ref.dropout_keep(seed, p, 1, 1 if ndim == 2 else 2, 5, 7)
    keep = keep[0, 0] if ndim == 2 else keep[0]
    w = ref.attention_weights(q, k, dropout_p=p, seed=seed)
    np.testing.assert_array_equal(w, ref.attention_weights(q, k) * keep / (1 - p))
    np.testing.assert_allclose(ref.attention(q, k, v, dropout_p=p, seed=seed), w @ v,
                               rtol=0, atol=1e-14)
    # bshd 3-D: (L, H, D); the weights are (H, Lq, Lk) in both layouts
    if ndim == 3:
        wb = ref.attention_weights(q.swapaxes(0, 1), k.swapaxes(0, 1), dropout_p=p,
                                   seed=seed, layout="bshd")
        np.testing.assert_array_equal(wb, w)


def test_varlen_dropout_uses_the_sequence_index(rng):
    H, D, Dv, p, seed = 2, 3, 4, 0.3, 5
    cu_q, cu_k = np.array([0, 3, 3, 8]), np.array([0, 4, 6, 13])
    q = rng.standard_normal((8, H, D))
    k = rng.standard_normal((13, H, D))
    v = rng.standard_normal((13, H, Dv))
    out = ref.varlen_attention(q, k, v, cu_q, cu_k, causal=True, dropout_p=p, seed=seed)
    for s in range(3):
        qs, ks = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        Lq, Lk = qs.stop - qs.start, ks.stop - ks.start
        keep = ref.dropout_keep(seed, p, 3, H, Lq, Lk)[s]          # b = s, positions local
        w = ref.attention_weights(q[qs], k[ks], causal=True, layout="bshd") * keep / (1 - p)
        np.testing.assert_allclose(out[qs], (w @ v[ks].swapaxes(0, 1)).swapaxes(0, 1),
                                   rtol=0, atol=1e-14)
    assert np.max(np.abs(out - ref.varlen_attention(q, k, v, cu_q, cu_k, causal=True))) > 1e-3
    with pytest.raises(ValueError, match="dropout_p > 0 needs a seed"):
        ref.varlen_attention(q, k, v, cu_q, cu_k, dropout_p=p)


@pytest.mark.parametrize("fn", ["attention", "attention_weights", "attention_backward",
                                "varlen_attention"])
@pytest.mark.parametrize("kw,exc,pattern", [
    (dict(dropout_p=0.5), ValueError, r"dropout_p > 0 needs a seed"),
    (dict(dropout_p=1.0, seed=1), ValueError, r"dropout_p must be in \[0, 1\), got 1\.0"),
    (dict(dropout_p=-1e-3, seed=1), ValueError, r"dropout_p must be in \[0, 1\)"),
    (dict(dropout_p=0.5, seed=-2), ValueError, r"seed must be in \[0, 2\*\*64\), got -2"),
    (dict(dropout_p=0.5, seed=0.5), TypeError, r"seed must be an int"),
])
def test_dropout_argument_errors_everywhere(rng, fn, kw, exc, pattern):
    q, k, v = _qkv(rng, B=1)
    with pytest.raises(exc, match=pattern):
        if fn == "attention":
            ref.attention(q, k, v, **kw)
        elif fn == "attention_weights":
            ref.attention_weights(q, k, **kw)
        elif fn == "attention_backward":
            out, lse = ref.attention(q, k, v, return_lse=True)
            ref.attention_backward(out, q, k, v, out, lse, **kw)
        else:
            ref.varlen_attention(q[0].swapaxes(0, 1), k[0].swapaxes(0, 1),
                                 v[0].swapaxes(0, 1), [0, 5], [0, 7], **kw)


# ------------------------------------------------------------------ backward: finite differences
def _fd_grad(f, x, h=1e-6):
    """Central differences of the scalar f at every entry of x (perturbed in place)."""
    g = np.empty_like(x)
    for idx in np.ndindex(x.shape):
        x0 = x[idx]
        x[idx] = x0 + h
        up = f()
        x[idx] = x0 - h
        down = f()
        x[idx] = x0
        g[idx] = (up - down) / (2 * h)
    return g


def _check_grads_by_fd(q, k, v, kw, tol=1e-6):
    rng = np.random.default_rng(99)
    out, lse = ref.attention(q, k, v, return_lse=True, **kw)
    dout = rng.standard_normal(out.shape)
    with_bias = kw.get("bias") is not None
    grads = ref.attention_backward(dout, q, k, v, out, lse, return_dbias=with_bias, **kw)
    args = {"q": q, "k": k, "v": v}
    if with_bias:
        kw = dict(kw, bias=np.array(kw["bias"], dtype=np.float64))
        args["bias"] = kw["bias"]
    assert len(grads) == len(args)

    def loss():
        return float(np.sum(dout * ref.attention(q, k, v, **kw)))

    for (name, x), g in zip(args.items(), grads):
        assert g.shape == x.shape and g.dtype == np.float64, name
        num = _fd_grad(loss, x)
        size = np.max(np.abs(num))
        assert size > 1e-3, f"d{name} is ~0: the check would be vacuous"
        err = np.max(np.abs(g - num)) / size
        assert err <= tol, f"d{name}: relative error {err:.2e}"
    return grads


FD_CASES = {
    "plain": dict(),
    "scale": dict(scale=0.7),
    "causal bottom-right Lq<Lk": dict(causal=True),
    "causal top-left Lq<Lk": dict(causal="top-left"),
    "causal bottom-right Lq>Lk": dict(causal="bottom-right", Lq=7, Lk=5),
    "causal top-left Lq>Lk": dict(causal="top-left", Lq=7, Lk=5),
    "window": dict(window=(2, 1)),
    "window one-sided causal": dict(window=(1, None), causal=True),
    "mask with an empty row": dict(mask="rowless"),
    "bias (Lq, Lk)": dict(bias=(5, 7)),
    "bias (B, 1, 1, Lk)": dict(bias=(2, 1, 1, 7)),
    "bias (Hq, 1, Lk)": dict(bias=(2, 1, 7)),
    "alibi (Hq,)": dict(alibi_slopes=np.array([0.25, 0.6])),
    "alibi (B, Hq)": dict(alibi_slopes=np.array([[0.25, 0.6], [0.1, 0.9]])),
    "softcap": dict(softcap=1.2, scale=2.0),
    "gqa": dict(Hq=4, Hkv=2),
    "Dv != D": dict(D=2, Dv=5),
    "bshd": dict(layout="bshd", Hq=4, Hkv=2, causal=True),
    "3-D": dict(ndim=3),
    "2-D": dict(ndim=2, causal="top-left"),
    "dropout": dict(dropout_p=0.3, seed=2 ** 33 + 17),
    "combo": dict(layout="bshd", Hq=4, Hkv=2, causal="top-left", window=(3, 2), mask="rowless",
                  bias=(2, 1, 1, 7), alibi_slopes=np.array([0.2, 0.4, 0.1, 0.3]),
                  softcap=2.0, scale=1.5, dropout_p=0.25, seed=12345),
}


def _fd_case(case):
    kw = dict(FD_CASES[case])
    shape = {n: kw.pop(n) for n in ("B", "Hq", "Hkv", "Lq", "Lk", "D", "Dv", "ndim")
             if n in kw}
    ndim = shape.pop("ndim", 4)
    rng = np.random.default_rng(list(FD_CASES).index(case))
    layout = kw.get("layout", "bhsd")
    q, k, v = _qkv(rng, layout=layout, **shape)
    B, Hq, Lq, Lk = 2, shape.get("Hq", 2), shape.get("Lq", 5), shape.get("Lk", 7)
    if ndim < 4:
        q, k, v = (x[0] for x in (q, k, v))
    if ndim < 3:
        q, k, v = (x[0] for x in (q, k, v))
    if kw.get("mask") == "rowless":
        m = rng.random((B, 1, Lq, Lk)) < 0.7
        m[1, 0, 2] = False                          # query row 2 of batch 1 sees nothing
        kw["mask"] = m
    if "bias" in kw:
        kw["bias"] = rng.standard_normal(kw["bias"])
    return q, k, v, kw


@pytest.mark.parametrize("case", list(FD_CASES))
def test_backward_matches_finite_differences(case):
    q, k, v, kw = _fd_case(case)
    dq = _check_grads_by_fd(q, k, v, kw)[0]
    if isinstance(kw.get("mask"), np.ndarray):      # the row that sees no key has no gradient
        row = dq[1, :, 2] if kw.get("layout", "bhsd") == "bhsd" else dq[1, 2, :]
        assert not row.any()


def test_backward_dropout_needs_the_forward_seed():
    q, k, v, kw = _fd_case("dropout")
    out, lse = ref.attention(q, k, v, return_lse=True, **kw)
    dout = np.ones_like(out)
    g1 = ref.attention_backward(dout, q, k, v, out, lse, **kw)
    g2 = ref.attention_backward(dout, q, k, v, out, lse, **dict(kw, seed=kw["seed"] + 1))
    g0 = ref.attention_backward(dout, q, k, v, out, lse, **dict(kw, dropout_p=0.0))
    for a, b, c in zip(g1, g2, g0):
        assert np.max(np.abs(a - b)) > 1e-3 and np.max(np.abs(a - c)) > 1e-3


def test_backward_float32_inputs_give_float64_grads():
    q, k, v, kw = _fd_case("gqa")
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    out, lse = ref.attention(q32, k32, v32, return_lse=True)
    grads = ref.attention_backward(out.astype(np.float32), q32, k32, v32, out, lse)
    assert [g.dtype for g in grads] == [np.float64] * 3
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


# ------------------------------------------------------------------ backward: arguments
def test_backward_is_exported():
    assert "attention_backward" in ref.__all__
    assert {"dropout_keep", "philox4x32"} <= set(ref.__all__)


def _bwd_args(layout="bhsd"):
    q, k, v = _qkv(np.random.default_rng(3), layout=layout)
    out, lse = ref.attention(q, k, v, layout=layout, return_lse=True)
    return out, q, k, v, out, lse


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("which,bad,pattern", [
    ("out", lambda a: a[..., :3], r"out must have shape {out} .*got {bad}"),
    ("lse", lambda a: a[..., None], r"lse must have shape \(2, 2, 5\) .*got {bad}"),
    ("dout", lambda a: a[:1], r"dout must have the shape of out {out}, got {bad}"),
])
def test_backward_shape_errors_name_the_argument(layout, which, bad, pattern):
    dout, q, k, v, out, lse = _bwd_args(layout)
    args = dict(dout=dout, out=out, lse=lse)
    args[which] = bad(args[which])
    pattern = pattern.format(out=re.escape(str(out.shape)),
                             bad=re.escape(str(args[which].shape)))
    with pytest.raises(ValueError, match=pattern):
        ref.attention_backward(args["dout"], q, k, v, args["out"], args["lse"], layout=layout)


def test_backward_other_errors():
    dout, q, k, v, out, lse = _bwd_args()
    with pytest.raises(ValueError, match=r"return_dbias=True needs a bias"):
        ref.attention_backward(dout, q, k, v, out, lse, return_dbias=True)
    with pytest.raises(TypeError, match=r"dout must be a floating-point array"):
        ref.attention_backward(dout.astype(int), q, k, v, out, lse)
    with pytest.raises(ValueError, match=r"v must match k"):
        ref.attention_backward(dout, q, k, v[:, :, :3], out, lse)
    with pytest.raises(ValueError, match=r"bias of shape \(3, 7\) does not broadcast"):
        ref.attention_backward(dout, q, k, v, out, lse, bias=np.zeros((3, 7)))


def test_backward_without_dbias_returns_three():
    dout, q, k, v, out, lse = _bwd_args()
    assert len(ref.attention_backward(dout, q, k, v, out, lse, bias=np.zeros((5, 7)))) == 3
    g = ref.attention_backward(dout, q, k, v, out, lse, bias=np.zeros((5, 7)),
                               return_dbias=True)
    assert len(g) == 4 and g[3].shape == (5, 7)


# ------------------------------------------------------------------ backward: torch.autograd
TORCH_CASES = ["plain", "causal top-left", "float mask as bias", "bool mask", "gqa"]


@pytest.mark.parametrize("case", TORCH_CASES)
def test_backward_matches_torch_autograd(case):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    rng = np.random.default_rng(2024)
    Hq = 4 if case == "gqa" else 2
    q, k, v = _qkv(rng, Hq=Hq)
    dout = rng.standard_normal((2, Hq, 5, 4))
    kw, tkw = {}, {}
    if case == "causal top-left":
        kw, tkw = dict(causal="top-left"), dict(is_causal=True)
    elif case == "float mask as bias":
        bias = rng.standard_normal((2, 1, 5, 7))
        kw = dict(bias=bias)
        tkw = dict(attn_mask=torch.tensor(bias, requires_grad=True))
    elif case == "bool mask":
        m = rng.random((5, 7)) < 0.6
        m[:, 0] = True                    # torch gives NaN on rows that see no key
        kw, tkw = dict(mask=m), dict(attn_mask=torch.tensor(m))
    elif case == "gqa":
        tkw = dict(enable_gqa=True)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    tout = F.scaled_dot_product_attention(tq, tk, tv, scale=0.8, **tkw)
    tout.backward(torch.tensor(dout))
    out, lse = ref.attention(q, k, v, scale=0.8, return_lse=True, **kw)
    np.testing.assert_allclose(out, tout.detach().numpy(), rtol=0, atol=1e-13)
    grads = ref.attention_backward(dout, q, k, v, out, lse, scale=0.8,
                                   return_dbias="bias" in kw, **kw)
    expect = [tq.grad, tk.grad, tv.grad]
    if "bias" in kw:
        expect.append(tkw["attn_mask"].grad)
    assert len(grads) == len(expect)
    for g, t in zip(grads, expect):
        t = t.numpy()
        assert g.shape == t.shape
        assert np.max(np.abs(g - t)) <= 1e-12 * np.max(np.abs(t))
