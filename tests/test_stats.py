"""attention(..., return_stats=True) (per-row entropy, effective support, max weight,
streamed in the kernel) and fastattn.key_mass (per-key column sums, a second pass),
against the float64 oracle computed naively from the weights, on every kernel; the
geometric bounds as properties (hypothesis); bitwise determinism across threads."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import fastattn
from fastattn import _kernels, reference
from conftest import TOL, rel_err


def abs_tol(dtype, scale=1.0):
    return TOL[np.dtype(dtype)] * max(1.0, scale)


def check(q, k, v, dtype, **kw):
    out, lse, stats = fastattn.attention(q, k, v, return_lse=True, return_stats=True, **kw)
    assert isinstance(stats, fastattn.AttentionStats)
    plain = fastattn.attention(q, k, v, **kw)
    if q.shape[-2] > 8:  # the same bits as a plain call (decoding takes another path with stats)
        np.testing.assert_array_equal(out, plain)
    assert rel_err(out, plain) <= TOL[np.dtype(dtype)]
    ent, sup, mw = reference.attention_stats(q, k, **kw)
    for got, ref in ((stats.entropy, ent), (stats.max_weight, mw)):
        assert got.shape == ref.shape and got.dtype == lse.dtype
        assert np.max(np.abs(got - ref), initial=0) <= abs_tol(dtype, np.log(max(k.shape[-2], 2)))
    assert rel_err(stats.effective_support, sup) <= 10 * TOL[np.dtype(dtype)]
    mass = fastattn.key_mass(q, k, **kw)
    ref_mass = reference.key_mass(q, k, **kw)
    assert mass.shape == ref_mass.shape and mass.dtype == np.dtype(dtype)
    assert np.max(np.abs(mass - ref_mass), initial=0) <= abs_tol(dtype, q.shape[-2])
    return stats, mass


CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "top_left_window": dict(causal="top-left", window=(6, None)),
    "mask_empty_row": "mask",
    "bias": "bias",
    "alibi_softcap": "alibi",
    "scale": dict(scale=3.0),
}


def kwargs(name, rng, B, H, Lq, Lk):
    c = CASES[name]
    if isinstance(c, dict):
        return dict(c)
    if c == "mask":
        m = rng.random((B, H, Lq, Lk)) > 0.4
        m[0, 0, min(1, Lq - 1)] = False
        return dict(mask=m)
    if c == "bias":
        return dict(bias=rng.standard_normal((Lq, Lk)))
    return dict(alibi_slopes=rng.random(H), softcap=2.0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("shape", [(2, 4, 2, 37, 53, 8), (1, 2, 1, 3, 700, 16), (1, 1, 1, 1, 1, 3)],
                         ids=["gqa", "decode", "tiny"])
def test_against_the_oracle(kernel, rng, name, dtype, shape):
    B, Hq, Hkv, Lq, Lk, D = shape
    q = rng.standard_normal((B, Hq, Lq, D)).astype(dtype)
    k, v = (rng.standard_normal((B, Hkv, Lk, D)).astype(dtype) for _ in range(2))
    check(q, k, v, dtype, **kwargs(name, rng, B, Hq, Lq, Lk))


def test_layouts_and_lower_ranks(rng):
    qkv = rng.standard_normal((2, 30, 3, 4, 8))
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    stats, mass = check(q, k, v, np.float64, layout="bshd", causal=True)
    assert stats.entropy.shape == (2, 4, 30) and mass.shape == (2, 4, 30)
    for shape in [(20, 8), (3, 20, 8)]:
        x = rng.standard_normal(shape)
        stats, mass = check(x, x, x, np.float64, causal=True)
        assert stats.entropy.shape == shape[:-1] and mass.shape == shape[:-1]


def test_16_bit_inputs(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for dt in (np.float16, ml_dtypes.bfloat16):
        q, k, v = (rng.standard_normal((1, 2, 40, 16)).astype(dt) for _ in range(3))
        _, stats = fastattn.attention(q, k, v, return_stats=True, causal=True)
        ent, _, mw = reference.attention_stats(q.astype(np.float32), k.astype(np.float32), causal=True)
        assert stats.entropy.dtype == np.float32
        assert np.max(np.abs(stats.entropy - ent)) <= 1e-4
        mass = fastattn.key_mass(q, k, causal=True)
        assert mass.dtype == np.float32
        assert np.max(np.abs(mass - reference.key_mass(q.astype(np.float32), k.astype(np.float32),
                                                       causal=True))) <= 1e-4


def test_rows_that_see_no_key_give_zeros(rng):
    q, k, v = (rng.standard_normal((1, 1, 4, 8)) for _ in range(3))
    mask = np.ones((4, 4), bool)
    mask[2] = False
    out, stats = fastattn.attention(q, k, v, mask=mask, return_stats=True)
    for a in stats:
        assert a[0, 0, 2] == 0
    assert np.all(np.isfinite(stats.entropy)) and stats.entropy.mean() >= 0
    mass = fastattn.key_mass(q, k, mask=mask)
    np.testing.assert_allclose(mass.sum(), 3.0, rtol=1e-12)  # the 3 rows that see a key


def test_identical_keys_sit_at_the_centre_and_a_sharp_query_at_a_vertex(rng):
    n, D = 37, 8
    k = np.tile(rng.standard_normal((1, D)), (n, 1))
    q = rng.standard_normal((5, D))
    _, stats = fastattn.attention(q, k, k, return_stats=True)
    np.testing.assert_allclose(stats.entropy, np.log(n), rtol=1e-12)
    np.testing.assert_allclose(stats.effective_support, n, rtol=1e-10)
    np.testing.assert_allclose(stats.max_weight, 1 / n, rtol=1e-12)
    k = rng.standard_normal((n, D))
    q = k[[3, 10]] * 1.0
    _, stats = fastattn.attention(q, k, k, scale=200.0, return_stats=True)
    assert np.all(stats.entropy < 1e-6) and np.all(stats.max_weight > 1 - 1e-6)
    # large logits do not cancel: lse ~ 1e4, entropy still exact to float32's relative eps
    _, stats32 = fastattn.attention(q.astype(np.float32), k.astype(np.float32), k.astype(np.float32),
                                    scale=2000.0, return_stats=True)
    assert np.all(np.abs(stats32.entropy) < 1e-4)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.integers(1, 60), st.integers(1, 9), st.sampled_from([False, True, "top-left"]),
       st.floats(0.01, 20.0), st.integers(0, 2**31))
def test_geometric_bounds(Lq, Lk, D, causal, scale, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, Lq, D))
    k = rng.standard_normal((2, Lk, D))
    out, lse, stats = fastattn.attention(q, k, k, causal=causal, scale=scale, return_lse=True,
                                         return_stats=True)
    # keys each row sees: all, or up to its causal diagonal
    i = np.arange(Lq)[:, None]
    diag = 0 if causal == "top-left" else Lk - Lq
    n_vis = np.where(causal, np.clip(i + diag + 1, 0, Lk), Lk)[:, 0] * np.ones((2, 1))
    seen = n_vis > 0
    eps = 1e-9
    H = stats.entropy
    assert np.all(H[seen] >= -eps) and np.all(H[seen] <= np.log(n_vis[seen]) + eps)
    assert np.all(stats.effective_support[seen] >= 1 - eps)
    assert np.all(stats.effective_support[seen] <= n_vis[seen] * (1 + eps))
    assert np.all(stats.max_weight[seen] >= 1 / n_vis[seen] - eps)
    assert np.all(stats.max_weight <= 1 + eps)
    mass = fastattn.key_mass(q, k, causal=causal, scale=scale)
    np.testing.assert_allclose(mass.sum(-1), seen.sum(-1), rtol=1e-10)  # one unit per row that sees a key
    assert np.all(mass >= 0)


def test_bitwise_across_threads(kernel, rng):
    q = rng.standard_normal((1, 4, 300, 16)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 900, 16)).astype(np.float32) for _ in range(2))
    base = fastattn.attention(q, k, v, causal=True, return_stats=True, num_threads=1)[1]
    mass1 = fastattn.key_mass(q, k, causal=True, num_threads=1)
    for nth in (2, 3, 8):
        again = fastattn.attention(q, k, v, causal=True, return_stats=True, num_threads=nth)[1]
        for x, y in zip(base, again):
            assert x.tobytes() == y.tobytes()
        assert fastattn.key_mass(q, k, causal=True, num_threads=nth).tobytes() == mass1.tobytes()
    fastattn.key_mass(q, k, num_threads=3)
    assert _kernels.last_num_threads() == 3  # a single kv head pair still splits into key chunks


def test_errors(rng):
    q = rng.standard_normal((2, 5, 8))
    with pytest.raises(TypeError, match="return_stats must be a bool"):
        fastattn.attention(q, q, q, return_stats="yes")
    with pytest.raises(ValueError, match="q has D=8 but k has D=7"):
        fastattn.key_mass(q, q[..., :7])
    with pytest.raises(ValueError, match="mask of shape"):
        fastattn.key_mass(q, q, mask=np.ones((3, 3), bool))
