"""fastattn.attention_backward (and dropout in the forward) against the float64 oracle
fastattn.reference, on every kernel this CPU runs: edge shapes, every variant alone
and combined, layouts, strides, GQA; bitwise determinism across thread counts; the
dropout generator; errors.  (The oracle's own gradients are checked by finite
differences and against torch in tests/test_reference_backward.py.)"""
import numpy as np
import pytest

import fastattn
from fastattn import _kernels, reference
from conftest import rel_err

# Relative error (to the largest |gradient| of the oracle) allowed per dtype.
GTOL = {np.float32: 1e-4, np.float64: 1e-10}


def make(rng, B, Hq, Hkv, Lq, Lk, D, Dv, dtype, layout="bhsd"):
    def arr(H, L, E):
        shape = (B, H, L, E) if layout == "bhsd" else (B, L, H, E)
        return rng.standard_normal(shape).astype(dtype)
    q, k, v = arr(Hq, Lq, D), arr(Hkv, Lk, D), arr(Hkv, Lk, Dv)
    dout = arr(Hq, Lq, Dv)
    return q, k, v, dout


def check(q, k, v, dout, dtype, **kw):
    """Forward with lse, backward, both against the oracle; returns the grads."""
    return_dbias = kw.pop("return_dbias", False)
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    got = fastattn.attention_backward(dout, q, k, v, out, lse, return_dbias=return_dbias, **kw)
    ref = reference.attention_backward(dout, q, k, v, out, lse, return_dbias=return_dbias, **kw)
    assert len(got) == len(ref)
    # relative to the largest gradient of all: one that is exactly 0 in exact arithmetic
    # (dq and dk with a single visible key) is a sum of terms that cancel
    big = max([float(np.max(np.abs(r))) for r in ref if r.size] + [1e-300])
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), got, ref):
        assert g.shape == r.shape, name
        assert g.dtype == np.dtype(dtype), name
        assert np.all(np.isfinite(g)), name
        err = float(np.max(np.abs(g - r))) / big if r.size else 0.0
        assert err <= GTOL[dtype], f"{name}: relative error {err:.3g}"
    return got


SHAPES = [  # B, Hq, Hkv, Lq, Lk, D, Dv
    (1, 1, 1, 1, 1, 1, 1),
    (1, 1, 1, 1, 300, 8, 8),        # decode: one query, keys not a multiple of a block
    (1, 1, 1, 300, 1, 8, 8),        # one key
    (2, 3, 3, 37, 53, 5, 7),        # odd D, Dv != D, Lq < Lk
    (1, 2, 2, 130, 70, 16, 16),     # Lq > Lk
    (1, 2, 2, 129, 129, 64, 64),    # one past two 64-blocks
    (1, 8, 1, 33, 65, 12, 20),      # GQA 8 (MQA)
    (2, 6, 2, 20, 90, 9, 9),        # GQA 3, rows stacked over heads
    (1, 4, 4, 3, 200, 32, 32),      # a few queries (decode-like)
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_shapes(kernel, rng, shape, dtype):
    q, k, v, dout = make(rng, *shape, dtype)
    check(q, k, v, dout, dtype)
    check(q, k, v, dout, dtype, causal=True)


VARIANTS = {
    "causal_br": dict(causal="bottom-right"),
    "causal_tl": dict(causal="top-left"),
    "window": dict(window=(7, 3)),
    "window_causal": dict(window=(10, None), causal=True),
    "mask": "mask",
    "bias": "bias",
    "bias_keys": "bias_keys",
    "alibi": "alibi",
    "softcap": dict(softcap=2.5),
    "scale": dict(scale=0.7),
    "dropout": dict(dropout_p=0.3, seed=12345),
    "combined": "combined",
}


def variant_kwargs(name, rng, B, Hq, Lq, Lk, dtype):
    v = VARIANTS[name]
    if isinstance(v, dict):
        return dict(v)
    if v == "mask":
        m = rng.random((B, Hq, Lq, Lk)) > 0.3
        m[0, 0, min(2, Lq - 1)] = False  # a fully masked row
        return dict(mask=m)
    if v == "bias":
        return dict(bias=rng.standard_normal((Lq, Lk)).astype(dtype), return_dbias=True)
    if v == "bias_keys":
        return dict(bias=rng.standard_normal((B, 1, 1, Lk)).astype(dtype), return_dbias=True)
    if v == "alibi":
        return dict(alibi_slopes=rng.random(Hq).astype(dtype))
    return dict(causal=True, window=(40, None), softcap=3.0, alibi_slopes=rng.random(Hq).astype(dtype),
                bias=rng.standard_normal((B, Hq, Lq, Lk)).astype(dtype), return_dbias=True,
                mask=rng.random((1, 1, Lq, Lk)) > 0.2, dropout_p=0.2, seed=7)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("shape", [(2, 4, 2, 45, 77, 16, 12), (1, 2, 1, 100, 60, 8, 8),
                                   (1, 2, 2, 4, 150, 8, 8)], ids=["a", "b", "decode"])
def test_variants(kernel, rng, name, dtype, shape):
    B, Hq, Hkv, Lq, Lk, D, Dv = shape
    q, k, v, dout = make(rng, *shape, dtype)
    check(q, k, v, dout, dtype, **variant_kwargs(name, rng, B, Hq, Lq, Lk, dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bshd_layout_and_strided_views(rng, dtype):
    B, H, L, D = 2, 4, 70, 16
    qkv = rng.standard_normal((B, L, 3, H, D)).astype(dtype)  # a fused projection
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    dout = rng.standard_normal((B, L, H, D)).astype(dtype)
    grads = check(q, k, v, dout, dtype, layout="bshd", causal=True)
    assert grads[0].shape == q.shape
    # a strided, non-contiguous dout and out give the same bits as contiguous ones
    out, lse = fastattn.attention(q, k, v, layout="bshd", return_lse=True)
    big = np.zeros((B, L, H, 2 * D), dtype)
    big[..., ::2] = dout
    a = fastattn.attention_backward(big[..., ::2], q, k, v, out, lse, layout="bshd")
    b = fastattn.attention_backward(np.ascontiguousarray(dout), q, k, v, out, lse, layout="bshd")
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("ndim", [2, 3])
def test_lower_ranks(rng, ndim):
    shape = (31, 8) if ndim == 2 else (3, 31, 8)
    q, k, v, dout = (rng.standard_normal(shape) for _ in range(4))
    check(q, k, v, dout, np.float64, causal=True)


def test_empty_and_degenerate_sizes(rng):
    for Lq, Lk in [(0, 5), (5, 0), (0, 0)]:
        q, k, v, dout = make(rng, 1, 2, 2, Lq, Lk, 4, 3, np.float64)
        out, lse = fastattn.attention(q, k, v, return_lse=True)
        dq, dk, dv = fastattn.attention_backward(dout, q, k, v, out, lse)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        for g in (dq, dk, dv):
            np.testing.assert_array_equal(g, 0)
    for D, Dv in [(0, 4), (4, 0)]:
        q, k, v, dout = make(rng, 1, 2, 1, 6, 9, D, Dv, np.float64)
        check(q, k, v, dout, np.float64, causal=True)


def run_grads(args, kw, nth):
    q, k, v, dout = args
    kw = dict(kw)
    dbias = kw.pop("return_dbias", False)
    out, lse = fastattn.attention(q, k, v, return_lse=True, num_threads=nth, **kw)
    return (out,) + tuple(fastattn.attention_backward(dout, q, k, v, out, lse, num_threads=nth,
                                                      return_dbias=dbias, **kw))


@pytest.mark.parametrize("case", ["plain", "causal", "one_head_long", "gqa_bias_dropout"])
def test_bitwise_identical_across_threads(kernel, rng, case):
    kw = {}
    if case == "plain":
        args = make(rng, 2, 3, 3, 150, 170, 16, 16, np.float32)
    elif case == "causal":
        args = make(rng, 1, 2, 2, 300, 300, 32, 32, np.float32)
        kw = dict(causal=True)
    elif case == "one_head_long":
        args = make(rng, 1, 1, 1, 700, 700, 16, 16, np.float64)
    else:
        args = make(rng, 2, 4, 2, 90, 130, 8, 8, np.float32)
        kw = dict(bias=rng.standard_normal((90, 130)).astype(np.float32), return_dbias=True,
                  dropout_p=0.25, seed=99, causal=True)
    base = run_grads(args, kw, 1)
    for nth in (2, 3, 8):
        again = run_grads(args, kw, nth)
        for x, y in zip(base, again):
            assert x.tobytes() == y.tobytes(), f"{nth} threads differ"
    assert _kernels.last_num_threads() >= 1


def test_backward_uses_every_thread_on_one_head(rng):
    # one head of 2048 keys: 8 key chunks of work items (and with 16 threads, 16 chunks
    # of 512 keys are cut from 8192 keys)
    args = make(rng, 1, 1, 1, 256, 2048, 16, 16, np.float32)
    run_grads(args, {}, 3)
    assert _kernels.last_num_threads() == 3
    run_grads(make(rng, 1, 1, 1, 64, 8192, 8, 8, np.float32), {}, 16)
    assert _kernels.last_num_threads() == 16


# ---------------------------------------------------------------- dropout

def test_kernel_dropout_decisions_are_the_oracles(rng):
    seed, p = 0xDEADBEEF12345678, 0.37
    keep = reference.dropout_keep(seed, p, 3, 2, 5, 11)
    for b, h, i, j in [(0, 0, 0, 0), (2, 1, 4, 10), (1, 0, 3, 7), (2, 1, 0, 5)]:
        assert _kernels.dropout_keep(seed, p, b, h, i, j) == bool(keep[b, h, i, j])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_dropout_weights_and_forward_match_the_oracle(kernel, rng, dtype, layout):
    q, k, v, _ = make(rng, 2, 4, 2, 40, 300, 8, 8, dtype, layout)
    kw = dict(dropout_p=0.4, seed=2024, layout=layout, causal=True)
    w = fastattn.attention_weights(q, k, **kw)
    wr = reference.attention_weights(q, k, **kw)
    np.testing.assert_array_equal(w == 0, wr == 0)  # the same weights dropped
    assert rel_err(w, wr) <= 10 * GTOL[dtype]
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    out_r, lse_r = reference.attention(q, k, v, return_lse=True, **kw)
    assert rel_err(out, out_r) <= 10 * GTOL[dtype]
    lse0 = fastattn.attention(q, k, v, return_lse=True, layout=layout, causal=True)[1]
    np.testing.assert_allclose(lse, lse0, rtol=1e-6)  # lse is that of the undropped softmax


def test_dropout_in_decode_and_varlen(rng):
    # one query against a long cache (the split-KV path) and a ragged batch
    q, k, v, _ = make(rng, 1, 4, 4, 1, 3000, 16, 16, np.float32)
    kw = dict(dropout_p=0.5, seed=5)
    assert rel_err(fastattn.attention(q, k, v, **kw), reference.attention(q, k, v, **kw)) <= 1e-5
    cu = np.array([0, 5, 40, 41])
    qv = rng.standard_normal((41, 2, 8)).astype(np.float32)
    kv = rng.standard_normal((41, 2, 8)).astype(np.float32)
    got = fastattn.varlen_attention(qv, kv, kv, cu, cu, causal=True, **kw)
    ref = reference.varlen_attention(qv, kv, kv, cu, cu, causal=True, **kw)
    assert rel_err(got, ref) <= 1e-5


def test_dropout_keep_rate_over_a_million_weights(rng):
    p = 0.3
    q = rng.standard_normal((4, 8, 128, 8)).astype(np.float32) * 0
    k = rng.standard_normal((4, 8, 256, 8)).astype(np.float32)
    w = fastattn.attention_weights(q, k, dropout_p=p, seed=31337)  # uniform rows: 1/256 each
    n = w.size
    assert n >= 10**6
    kept = np.count_nonzero(w)
    sigma = np.sqrt(n * p * (1 - p))
    assert abs(kept - n * (1 - p)) <= 4 * sigma
    np.testing.assert_allclose(w[w != 0], 1 / 256 / (1 - p), rtol=1e-6)


def test_dropout_seeds_differ_and_repeat(rng):
    q, k, v, _ = make(rng, 1, 2, 2, 30, 40, 8, 8, np.float32)
    a = fastattn.attention(q, k, v, dropout_p=0.5, seed=1)
    b = fastattn.attention(q, k, v, dropout_p=0.5, seed=2)
    c = fastattn.attention(q, k, v, dropout_p=0.5, seed=1)
    assert not np.array_equal(a, b)
    np.testing.assert_array_equal(a, c)
    np.testing.assert_array_equal(fastattn.attention(q, k, v, dropout_p=0.0, seed=3),
                                  fastattn.attention(q, k, v))


def test_dropout_gradient_sees_the_forward_mask(rng):
    # Finite differences of L = sum(dout * attention(..., seed)) in float64 agree with the
    # kernel's gradient only if the backward drops exactly the forward's weights.
    q, k, v, dout = make(rng, 1, 2, 2, 6, 9, 4, 3, np.float64)
    kw = dict(dropout_p=0.5, seed=77, causal=True)
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    dq, dk, dv = fastattn.attention_backward(dout, q, k, v, out, lse, **kw)
    eps = 1e-6
    for x, g in ((q, dq), (k, dk), (v, dv)):
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            old = x[idx]
            x[idx] = old + eps
            fp = np.sum(dout * fastattn.attention(q, k, v, **kw))
            x[idx] = old - eps
            fm = np.sum(dout * fastattn.attention(q, k, v, **kw))
            x[idx] = old
            num[idx] = (fp - fm) / (2 * eps)
        assert np.max(np.abs(num - g)) <= 1e-6 * max(1.0, np.max(np.abs(g)))
    wrong = fastattn.attention_backward(dout, q, k, v, out, lse, **dict(kw, seed=78))[0]
    assert not np.allclose(wrong, dq)


# ---------------------------------------------------------------- torch

@pytest.mark.parametrize("case", ["plain", "causal", "gqa", "float_mask", "bool_mask"])
def test_equal_to_torch_autograd_in_float64(rng, case):
    torch = pytest.importorskip("torch")
    B, Hq, Hkv, L, D = 2, 4, 4 if case != "gqa" else 2, 33, 8
    q, k, v, dout = make(rng, B, Hq, Hkv, L, L, D, D, np.float64)
    kw, tkw = {}, {}
    if case == "causal":
        kw, tkw = dict(causal="top-left"), dict(is_causal=True)
    elif case == "gqa":
        tkw = dict(enable_gqa=True)
    elif case == "float_mask":
        m = rng.standard_normal((L, L))
        kw, tkw = dict(bias=m), dict(attn_mask=torch.from_numpy(m))
    elif case == "bool_mask":
        m = rng.random((B, 1, L, L)) > 0.3
        kw, tkw = dict(mask=m), dict(attn_mask=torch.from_numpy(m))
    tq, tk, tv = (torch.from_numpy(x.copy()).requires_grad_() for x in (q, k, v))
    to = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, **tkw)
    to.backward(torch.from_numpy(dout))
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    got = fastattn.attention_backward(dout, q, k, v, out, lse, **kw)
    for g, t in zip(got, (tq.grad, tk.grad, tv.grad)):
        assert rel_err(g, t.numpy()) <= 1e-10


# ---------------------------------------------------------------- errors

def test_errors_name_the_argument(rng):
    q, k, v, dout = make(rng, 1, 2, 2, 5, 6, 4, 4, np.float32)
    out, lse = fastattn.attention(q, k, v, return_lse=True)
    bw = fastattn.attention_backward
    with pytest.raises(ValueError, match=r"dout has shape \(1, 2, 5, 3\), expected \(1, 2, 5, 4\)"):
        bw(dout[..., :3], q, k, v, out, lse)
    with pytest.raises(ValueError, match=r"out has shape"):
        bw(dout, q, k, v, out[:, :1], lse)
    with pytest.raises(ValueError, match=r"lse has shape \(1, 2, 4\), expected \(1, 2, 5\)"):
        bw(dout, q, k, v, out, lse[..., :4])
    with pytest.raises(ValueError, match="q has D=4 but k has D=3"):
        bw(dout, q, k[..., :3], v, out, lse)
    with pytest.raises(TypeError, match="float16 inputs have no gradients"):
        bw(dout, q, k.astype(np.float16), v.astype(np.float16), out, lse)
    with pytest.raises(ValueError, match="return_dbias=True needs a bias"):
        bw(dout, q, k, v, out, lse, return_dbias=True)
    with pytest.raises(ValueError, match="needs a seed"):
        bw(dout, q, k, v, out, lse, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        fastattn.attention(q, k, v, dropout_p=1.0, seed=1)
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*64\)"):
        fastattn.attention(q, k, v, dropout_p=0.5, seed=-1)
    with pytest.raises(TypeError, match="seed must be an int"):
        fastattn.attention_weights(q, k, dropout_p=0.5, seed=1.5)
    with pytest.raises(TypeError, match="dout must be a float array"):
        bw(dout.astype(np.int32), q, k, v, out, lse)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", ["plain", "causal_gqa_dropout", "long_one_head", "bias_window"])
def test_every_schedule_gives_the_same_bits(kernel, rng, case, dtype):
    """One pass per head, one pass per key chunk (dQ chunk sums added at the end) and
    two passes: the library picks by thread count and memory; the bits must not care."""
    B, Hq, Hkv, Lq, Lk, D = {"plain": (2, 2, 2, 70, 90, 8), "causal_gqa_dropout": (1, 4, 2, 100, 300, 8),
                             "long_one_head": (1, 1, 1, 40, 1500, 16),
                             "bias_window": (2, 2, 1, 50, 400, 12)}[case]
    q, k, v, dout = make(rng, B, Hq, Hkv, Lq, Lk, D, D, dtype)
    kw, ds_shape = {}, None
    if case == "causal_gqa_dropout":
        kw = dict(causal=True, dropout_p=0.3, seed=11)
    elif case == "bias_window":
        kw = dict(bias=rng.standard_normal((1, Hq, Lq, Lk)).astype(dtype), window=(60, 5))
        ds_shape = (B, Hq, Lq, Lk)
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    va = fastattn._args.Problem("t", q, k, v, "bhsd").variants(
        kw.get("window"), None, kw.get("bias"), None, None, (kw.get("dropout_p", 0.0), kw.get("seed", 0)))
    results = []
    for passes in (0, 1, 2):
        for nth in (1, 3):
            grads = [np.empty_like(a) for a in (q, k, v)]
            ds = None if ds_shape is None else np.zeros(ds_shape, dtype)
            _kernels.backward(q, k, v, out, lse, dout, *grads, ds, D ** -0.5, 1 if kw.get("causal") else 0,
                              nth, 0, 0, va, passes)
            results.append(grads + ([] if ds is None else [ds]))
    for other in results[1:]:
        for x, y in zip(results[0], other):
            assert x.tobytes() == y.tobytes()
    ref = reference.attention_backward(dout, q, k, v, out, lse, **kw)
    for g, r in zip(results[0], ref):
        assert rel_err(g, r) <= GTOL[dtype]
