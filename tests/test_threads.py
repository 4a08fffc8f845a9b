"""Results are bitwise identical for any thread count and on every run."""
import numpy as np
import pytest

import fastattn


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True, "top-left"])
def test_bitwise_equal_across_threads(kernel, rng, dtype, causal):
    q = rng.standard_normal((2, 3, 200, 40)).astype(dtype)
    k = rng.standard_normal((2, 3, 333, 40)).astype(dtype)
    v = rng.standard_normal((2, 3, 333, 24)).astype(dtype)
    base = fastattn.attention(q, k, v, causal=causal, return_lse=True, num_threads=1)
    for n in (2, 3, 1, 2):
        out, lse = fastattn.attention(q, k, v, causal=causal, return_lse=True, num_threads=n)
        assert np.array_equal(out, base[0]) and np.array_equal(lse, base[1]), n


def test_default_threads_follow_threadpoolctl(rng):
    threadpoolctl = pytest.importorskip("threadpoolctl")
    q = rng.standard_normal((4, 130, 32)).astype(np.float32)
    a = fastattn.attention(q, q, q)
    with threadpoolctl.threadpool_limits(1, user_api="openmp"):
        b = fastattn.attention(q, q, q)
    assert np.array_equal(a, b)


def test_gil_released_concurrent_calls(rng):
    """Calls from several Python threads at once (the GIL is released) stay correct."""
    from concurrent.futures import ThreadPoolExecutor
    shapes = [(2, 50 + 13 * i, 8 + i) for i in range(8)]
    args = [tuple(rng.standard_normal(s).astype(np.float32) for _ in range(3)) for s in shapes]
    want = [fastattn.attention(*a, causal=True, num_threads=1) for a in args]
    with ThreadPoolExecutor(8) as ex:
        for _ in range(3):
            got = list(ex.map(lambda a: fastattn.attention(*a, causal=True, num_threads=2), args))
            for g, w in zip(got, want):
                assert np.array_equal(g, w)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bitwise_equal_across_threads_strided_kv(kernel, rng, dtype):
    """bshd K/V: each thread copies the K/V of the heads whose query blocks it runs
    and takes the other threads' last blocks when done; the bits do not depend on
    the thread count."""
    q = rng.standard_normal((2, 300, 6, 24)).astype(dtype)
    k = rng.standard_normal((2, 280, 3, 24)).astype(dtype)
    v = rng.standard_normal((2, 280, 3, 16)).astype(dtype)
    for kw in (dict(causal=True), dict(window=(40, 5)), dict()):
        base = fastattn.attention(q, k, v, layout="bshd", num_threads=1, **kw)
        for n in (2, 3, 8):
            assert np.array_equal(fastattn.attention(q, k, v, layout="bshd", num_threads=n, **kw), base)
