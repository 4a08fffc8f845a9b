"""The geometry of attention (DESIGN.md): each output row is a barycentre of the
visible values with weights on the probability simplex.  Property tests with
hypothesis (seeded: the same examples on every run), each run under every CPU kernel
this machine can execute (the `kernel` fixture of conftest.py), and the first two
also on the oracle."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import fastattn
from fastattn import _kernels, reference

from conftest import KERNELS

# derandomize: the same examples on every run; the `kernel` fixture is set once per
# test (for all its examples), which is what function_scoped_fixture warns about
SETTINGS = settings(max_examples=50, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(params=[f"fastattn-{k}" for k in KERNELS] + ["reference"])
def impl(request):
    """attention as computed by fastattn under each CPU kernel, and by the oracle (the
    `kernel` fixture's job, without running the oracle once per kernel)."""
    if request.param == "reference":
        yield reference.attention
        return
    before = _kernels.current_kernel()
    _kernels.set_kernel(request.param.split("-", 1)[1])
    yield fastattn.attention
    _kernels.set_kernel(before)


@st.composite
def problems(draw, max_len=70):
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    H = draw(st.integers(1, 3))
    Lq = draw(st.integers(1, max_len))
    Lk = draw(st.integers(1, max_len))
    D = draw(st.integers(1, 33))
    Dv = draw(st.integers(1, 20))
    causal = draw(st.sampled_from([False, "top-left", "bottom-right"]))
    seed = draw(st.integers(0, 2**32 - 1))
    mag = draw(st.sampled_from([0.1, 1.0, 5.0]))
    rng = np.random.default_rng(seed)
    q = (mag * rng.standard_normal((H, Lq, D))).astype(dtype)
    k = (mag * rng.standard_normal((H, Lk, D))).astype(dtype)
    v = rng.standard_normal((H, Lk, Dv)).astype(dtype)
    return q, k, v, causal


def _tol(dtype):
    return 1e-5 if dtype == np.float32 else 1e-12


def _visible(Lq, Lk, causal):
    i = np.arange(Lq)[:, None]
    j = np.arange(Lk)[None, :]
    if causal == "top-left":
        return j <= i
    if causal in (True, "bottom-right"):
        return j <= i + (Lk - Lq)
    return np.ones((Lq, Lk), bool)


@SETTINGS
@given(problems())
def test_weights_on_the_simplex(impl, prob):
    """Attending to v = identity returns the weight rows: >= 0, each summing to 1
    (rows that see no key give 0)."""
    q, k, _, causal = prob
    Lk = k.shape[1]
    eye = np.broadcast_to(np.eye(Lk, dtype=q.dtype), (q.shape[0], Lk, Lk))
    w = impl(q, k, np.ascontiguousarray(eye), causal=causal).astype(np.float64)
    assert (w >= 0).all()
    seen = _visible(q.shape[1], Lk, causal).any(axis=1)
    sums = w.sum(axis=-1)
    np.testing.assert_allclose(sums[:, seen], 1.0, atol=20 * _tol(q.dtype) * Lk)
    assert (w[:, ~seen] == 0).all()
    assert (w[:, ~_visible(q.shape[1], Lk, causal)] == 0).all()


@SETTINGS
@given(problems())
def test_output_in_convex_hull(impl, prob):
    q, k, v, causal = prob
    out = impl(q, k, v, causal=causal).astype(np.float64)
    vis = _visible(q.shape[1], k.shape[1], causal)
    v64 = v.astype(np.float64)
    slack = 10 * _tol(q.dtype) * max(1.0, np.abs(v64).max())
    for i in range(q.shape[1]):
        if not vis[i].any():
            assert (out[:, i] == 0).all()
            continue
        lo = v64[:, vis[i]].min(axis=1)
        hi = v64[:, vis[i]].max(axis=1)
        assert (out[:, i] >= lo - slack).all() and (out[:, i] <= hi + slack).all()


@SETTINGS
@given(problems(), st.floats(-50, 50))
def test_shift_invariance(kernel, prob, c):
    """Adding c to every logit of a row changes nothing: append a feature 1 to k
    and c/scale to q, which adds exactly c to all of row i's logits."""
    q, k, v, causal = prob
    D = q.shape[-1]
    scale = 1 / np.sqrt(D)
    q2 = np.concatenate([q, np.full(q.shape[:-1] + (1,), c / scale, q.dtype)], axis=-1)
    k2 = np.concatenate([k, np.ones(k.shape[:-1] + (1,), k.dtype)], axis=-1)
    a = fastattn.attention(q, k, v, causal=causal, scale=scale)
    b = fastattn.attention(q2, k2, v, causal=causal, scale=scale)
    err = np.abs(a.astype(np.float64) - b).max() / max(1.0, np.abs(a).max())
    # the appended logit is rounded in q's precision: scale the bound by |c|
    assert err <= 50 * _tol(q.dtype) * max(1.0, abs(c))


@SETTINGS
@given(problems())
def test_key_permutation_invariance(kernel, prob):
    """Attention is a set operation over keys (without causality, which orders them)."""
    q, k, v, _ = prob
    perm = np.random.default_rng(q.shape[1]).permutation(k.shape[1])
    a = fastattn.attention(q, k, v)
    b = fastattn.attention(q, k[:, perm], v[:, perm])
    err = np.abs(a.astype(np.float64) - b).max() / max(1.0, np.abs(a).max())
    assert err <= 10 * _tol(q.dtype)


@SETTINGS
@given(problems())
def test_zero_query_gives_mean(kernel, prob):
    q, k, v, causal = prob
    out = fastattn.attention(np.zeros_like(q), k, v, causal=causal).astype(np.float64)
    vis = _visible(q.shape[1], k.shape[1], causal)
    for i in range(q.shape[1]):
        want = v[:, vis[i]].astype(np.float64).mean(axis=1) if vis[i].any() else 0.0
        np.testing.assert_allclose(out[:, i], want, atol=10 * _tol(q.dtype), rtol=10 * _tol(q.dtype))


def test_scale_limits_hard_retrieval_and_mean(kernel, rng):
    """scale -> inf tends to argmax retrieval, scale -> 0 to the plain mean."""
    q = rng.standard_normal((20, 16))
    k = rng.standard_normal((50, 16))
    v = rng.standard_normal((50, 8))
    hard = fastattn.attention(q, k, v, scale=1e4)
    np.testing.assert_allclose(hard, v[np.argmax(q @ k.T, axis=1)], atol=1e-9)
    soft = fastattn.attention(q, k, v, scale=1e-12)
    np.testing.assert_allclose(soft, np.broadcast_to(v.mean(axis=0), soft.shape), atol=1e-9)
