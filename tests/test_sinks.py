"""Attention sinks (gpt-oss): `sinks=` adds exp(sinks[h]) to every row's denominator.

Checked against the float64 oracle (which appends the sink as one more logit column
and drops its weight) on every kernel, every path that finishes a row (prefill
blocks, split-KV decoding, int8 and paged caches, 16-bit inputs, stats, weights),
through the backward with the sinks' own gradient, and bitwise across thread counts
and between decoding and prefill.
"""
import numpy as np
import pytest

import fastattn
from fastattn import reference as R

from conftest import BF16, TOL, assert_lse_close, rel_err

# (B, Hq, Hkv, Lq, Lk, D, Dv): L = 1, lengths off the block sizes, odd D, Lq > Lk and
# Lq < Lk, GQA, and a decode row over several key chunks (split-KV: Lk > 512)
SHAPES = [(1, 1, 1, 1, 1, 8, 8), (2, 4, 2, 33, 70, 16, 12), (1, 3, 1, 7, 5, 7, 9),
          (2, 2, 2, 130, 257, 64, 64), (1, 4, 2, 1, 1500, 32, 32), (2, 2, 1, 3, 2000, 48, 40)]


def _inputs(rng, shape, dtype):
    B, Hq, Hkv, Lq, Lk, D, Dv = shape
    q = rng.standard_normal((B, Hq, Lq, D)).astype(dtype)
    k = rng.standard_normal((B, Hkv, Lk, D)).astype(dtype)
    v = rng.standard_normal((B, Hkv, Lk, Dv)).astype(dtype)
    sinks = rng.standard_normal(Hq) * 2.0
    sinks[0] = -np.inf if Hq > 1 else sinks[0]  # a head without a sink
    return q, k, v, sinks


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_forward_and_lse_match_oracle(kernel, rng, shape, dtype, causal):
    q, k, v, sinks = _inputs(rng, shape, dtype)
    out, lse = fastattn.attention(q, k, v, causal=causal, sinks=sinks, return_lse=True)
    ref, ref_lse = R.attention(q, k, v, causal=causal, sinks=sinks, return_lse=True)
    assert rel_err(out, ref) <= TOL[np.dtype(dtype)]
    assert_lse_close(lse, ref_lse, dtype)
    # a sink takes mass from the keys; a head without one (-inf) has the plain bits
    plain = fastattn.attention(q, k, v, causal=causal)
    fin = np.isfinite(sinks)
    assert not np.allclose(out[:, fin], plain[:, fin])
    assert np.array_equal(out[:, ~fin], plain[:, ~fin])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_variants_layouts_and_views(kernel, rng, dtype):
    """Window, softcap, ALiBi, bias, mask, seqlens_k and a strided bshd view together."""
    B, Hq, Hkv, L, D = 2, 4, 2, 45, 24
    qkv = rng.standard_normal((B, L, 3, Hq, D)).astype(dtype)  # a fused projection
    q, k, v = qkv[:, :, 0], qkv[:, :, 1, :Hkv], qkv[:, :, 2, :Hkv]
    sinks = rng.standard_normal(Hq)
    bias = rng.standard_normal((1, Hq, L, L)).astype(dtype)
    mask = rng.random((L, L)) > 0.2
    kw = dict(causal=True, window=(20, 0), softcap=5.0, alibi_slopes=np.linspace(0.1, 0.4, Hq),
              bias=bias, mask=mask, layout="bshd")
    seq = np.array([L, 31])
    out, lse = fastattn.attention(q, k, v, sinks=sinks, seqlens_k=seq, return_lse=True, **kw)
    for b in range(B):
        n = seq[b]
        ref, ref_lse = R.attention(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], sinks=sinks,
                                   return_lse=True, **dict(kw, bias=bias[..., :n],
                                                           mask=mask[:, :n]))
        assert rel_err(out[b:b + 1], ref) <= TOL[np.dtype(dtype)]
        assert_lse_close(lse[b:b + 1], ref_lse, dtype)


def test_row_with_no_visible_key(rng):
    """A row that sees no key: output 0 and lse = its sink (the sink takes all the mass);
    without a sink (-inf) lse stays -inf."""
    q, k, v = (rng.standard_normal((1, 2, n, 8)) for n in (4, 6, 6))
    mask = np.ones((4, 6), bool)
    mask[1] = False
    out, lse, st = fastattn.attention(q, k, v, mask=mask, sinks=[0.5, -np.inf], return_lse=True,
                                      return_stats=True)
    assert np.all(out[0, :, 1] == 0)
    assert lse[0, 0, 1] == 0.5 and lse[0, 1, 1] == -np.inf
    # all the mass on the sink: entropy 0, largest weight 1 (the sink's); no sink: 0, 0
    assert st.entropy[0, 0, 1] == 0 and st.max_weight[0, 0, 1] == 1
    assert st.entropy[0, 1, 1] == 0 and st.max_weight[0, 1, 1] == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_stats_and_weights_match_oracle(kernel, rng, dtype):
    q, k, v, sinks = _inputs(rng, (2, 3, 3, 40, 90, 16, 16), dtype)
    sinks[1] = 6.0  # a sink that takes most of the mass
    _, st = fastattn.attention(q, k, v, causal=True, sinks=sinks, return_stats=True)
    H, S, X = R.attention_stats(q, k, causal=True, sinks=sinks)
    tol = 1e-4 if dtype == np.float32 else 1e-10
    np.testing.assert_allclose(st.entropy, H, atol=tol)
    np.testing.assert_allclose(st.effective_support, S, rtol=tol)
    np.testing.assert_allclose(st.max_weight, X, atol=tol)
    w = fastattn.attention_weights(q, k, causal=True, sinks=sinks)
    np.testing.assert_allclose(w, R.attention_weights(q, k, causal=True, sinks=sinks), atol=tol)
    assert np.all(w.sum(-1)[:, 1] < 0.9)  # the sink's share is missing from each row
    np.testing.assert_allclose(fastattn.key_mass(q, k, causal=True, sinks=sinks),
                               R.key_mass(q, k, causal=True, sinks=sinks), atol=tol * 40)


def test_decode_bits_equal_prefill_and_threads(rng):
    """The split-KV decode path folds the sink into the merged row with the arithmetic
    of the prefill rows: the last row of a prefill has the bits of the decode call, and
    neither depends on the thread count."""
    q, k, v, sinks = _inputs(rng, (2, 4, 2, 64, 1600, 32, 32), np.float32)
    full = fastattn.attention(q, k, v, causal=True, sinks=sinks, num_threads=2)
    last = fastattn.attention(q[:, :, -1:], k, v, causal=True, sinks=sinks, num_threads=1)
    last3 = fastattn.attention(q[:, :, -1:], k, v, causal=True, sinks=sinks, num_threads=3)
    assert np.array_equal(full[:, :, -1:], last)
    assert np.array_equal(last, last3)
    one = fastattn.attention(q, k, v, causal=True, sinks=sinks, num_threads=1)
    assert np.array_equal(one, full)


@pytest.mark.parametrize("cache", ["int8", "paged", "float16"])
def test_caches(rng, cache):
    """The int8 and paged caches and a float16 cache finish rows the same way."""
    q, k, v, sinks = _inputs(rng, (2, 4, 2, 1, 700, 32, 32), np.float32)
    if cache == "int8":
        kq, vq = fastattn.quantize_kv(k), fastattn.quantize_kv(v)
        out = fastattn.attention(q, kq, vq, causal=True, sinks=sinks)
        ref = R.attention(q, fastattn.dequantize_kv(kq), fastattn.dequantize_kv(vq), causal=True,
                          sinks=sinks)
    elif cache == "paged":
        page = 64
        nb = 700 // page + 1
        kp = np.zeros((2 * nb, page, 2, 32), np.float32)
        vp = np.zeros_like(kp)
        table = np.arange(2 * nb, dtype=np.int32)[::-1].reshape(2, nb).copy()
        for b in range(2):
            for j in range(700):
                kp[table[b, j // page], j % page] = k[b, :, j]
                vp[table[b, j // page], j % page] = v[b, :, j]
        out = fastattn.attention(q, kp, vp, block_table=table, seqlens_k=np.array([700, 700]),
                                 causal=True, sinks=sinks)
        ref = R.attention(q, k, v, causal=True, sinks=sinks)
    else:
        k16, v16 = k.astype(np.float16), v.astype(np.float16)
        out = fastattn.attention(q, k16, v16, causal=True, sinks=sinks)
        ref = R.attention(q, k16, v16, causal=True, sinks=sinks)
    assert rel_err(out, ref) <= 3e-5


@pytest.mark.skipif(BF16 is None, reason="ml_dtypes is not installed")
def test_bfloat16(bf16_kernel, rng):
    q, k, v, sinks = _inputs(rng, (1, 4, 2, 100, 300, 64, 64), np.float32)
    qb, kb, vb = (a.astype(BF16) for a in (q, k, v))
    out, lse = fastattn.attention(qb, kb, vb, causal=True, sinks=sinks, return_lse=True)
    q64, k64, v64 = (a.astype(np.float64) for a in (qb, kb, vb))
    ref, ref_lse = R.attention(q64, k64, v64, causal=True, sinks=sinks, return_lse=True)
    assert rel_err(out, ref) <= 1e-2
    np.testing.assert_allclose(lse, ref_lse, atol=1e-2)
    dout = rng.standard_normal(out.shape).astype(BF16)
    g = fastattn.attention_backward(dout, qb, kb, vb, out, lse, causal=True, sinks=sinks,
                                    return_dsinks=True)
    rg = R.attention_backward(dout.astype(np.float64), q64, k64, v64, ref, ref_lse,
                              causal=True, sinks=sinks,
                              return_dsinks=True)
    for a, b in zip(g, rg):
        assert rel_err(a, b) <= 2e-2


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_backward_and_dsinks_match_oracle(kernel, rng, dtype, dropout_p):
    q, k, v, sinks = _inputs(rng, (2, 4, 2, 37, 53, 16, 8), dtype)
    kw = dict(causal=True, sinks=sinks, dropout_p=dropout_p, seed=7 if dropout_p else None)
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    dout = rng.standard_normal(out.shape).astype(dtype)
    got = fastattn.attention_backward(dout, q, k, v, out, lse, return_dsinks=True, **kw)
    ref_out, ref_lse = R.attention(q, k, v, return_lse=True, **kw)
    want = R.attention_backward(dout, q, k, v, ref_out, ref_lse, return_dsinks=True, **kw)
    assert len(got) == 4 and got[3].shape == (4,) and got[3][0] == 0  # head 0: no sink
    tol = 1e-4 if dtype == np.float32 else 1e-10
    for a, b in zip(got, want):
        assert rel_err(a, b) <= tol


def test_dsinks_is_the_derivative(rng):
    """dsinks against central differences of sum(dout * out), float64."""
    q, k, v, sinks = _inputs(rng, (1, 3, 3, 6, 9, 4, 4), np.float64)
    sinks[0] = 0.3
    dout = rng.standard_normal((1, 3, 6, 4))
    out, lse = fastattn.attention(q, k, v, sinks=sinks, return_lse=True)
    ds = fastattn.attention_backward(dout, q, k, v, out, lse, sinks=sinks, return_dsinks=True)[3]
    for h in range(3):
        e = np.zeros(3)
        e[h] = 1e-6
        f = [np.sum(dout * fastattn.attention(q, k, v, sinks=sinks + s * e)) for s in (1, -1)]
        assert abs((f[0] - f[1]) / 2e-6 - ds[h]) < 1e-7


def test_errors(rng):
    q, k, v, _ = _inputs(rng, (1, 4, 2, 5, 6, 8, 8), np.float32)
    with pytest.raises(ValueError, match=r"sinks must have shape \(Hq,\) = \(4,\)"):
        fastattn.attention(q, k, v, sinks=np.zeros(2))
    with pytest.raises(TypeError, match="sinks must be a float array"):
        fastattn.attention(q, k, v, sinks=np.array(["a"] * 4))
    with pytest.raises(ValueError, match="sinks must be finite or -inf"):
        fastattn.attention(q, k, v, sinks=np.array([0, np.nan, 0, 0]))
    out, lse = fastattn.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="return_dsinks=True needs the forward's sinks"):
        fastattn.attention_backward(out, q, k, v, out, lse, return_dsinks=True)


def test_torch_gradients():
    torch = pytest.importorskip("torch")
    import fastattn.torch as ft
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 9, 16, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 12, 16, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 12, 8, dtype=torch.float64, generator=g, requires_grad=True)
    sk = torch.randn(4, dtype=torch.float64, generator=g, requires_grad=True)

    def f(q, k, v, sk):  # lse too: its gradient reaches the sinks as well
        return ft.scaled_dot_product_attention(q, k, v, enable_gqa=True, causal=True, sinks=sk,
                                               return_lse=True)
    assert torch.autograd.gradcheck(f, (q, k, v, sk))
    out = ft.scaled_dot_product_attention(q, k, v, enable_gqa=True, causal=True, sinks=sk)
    ref = R.attention(*(t.detach().numpy() for t in (q, k, v)), causal=True,
                      sinks=sk.detach().numpy())
    assert rel_err(out.detach().numpy(), ref) <= 1e-11
    with pytest.raises(ValueError, match="sinks must be a CPU tensor of shape"):
        ft.scaled_dot_product_attention(q, k, v, enable_gqa=True, sinks=sk[:2])
