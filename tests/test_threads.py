"""Results are bitwise identical for any thread count and on every run; the thread
count asked for (num_threads, OMP_NUM_THREADS, threadpoolctl) is the one that runs."""
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import fastattn
from fastattn import _kernels, reference


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True, "top-left"])
def test_bitwise_equal_across_threads(kernel, rng, dtype, causal):
    q = rng.standard_normal((2, 3, 200, 40)).astype(dtype)
    k = rng.standard_normal((2, 3, 333, 40)).astype(dtype)
    v = rng.standard_normal((2, 3, 333, 24)).astype(dtype)
    base = fastattn.attention(q, k, v, causal=causal, return_lse=True, num_threads=1)
    # 16 and 64 threads: the plan cuts the query blocks smaller (fa_make_plan)
    for n in (2, 3, 1, 2, 16, 64):
        out, lse = fastattn.attention(q, k, v, causal=causal, return_lse=True, num_threads=n)
        assert np.array_equal(out, base[0]) and np.array_equal(lse, base[1]), n


def _paths(rng):
    """One call per driver path: plain blocks, strided K/V (head tasks), split-KV
    decoding, attention_weights, varlen; each has enough work for 4 threads."""
    q = rng.standard_normal((2, 4, 300, 32)).astype(np.float32)
    qs = np.ascontiguousarray(q.swapaxes(1, 2))
    qd = rng.standard_normal((1, 4, 1, 32)).astype(np.float32)
    kd = rng.standard_normal((1, 4, 5000, 32)).astype(np.float32)
    cu = np.array([0, 250, 600])
    qv = rng.standard_normal((600, 4, 32)).astype(np.float32)
    return {
        "prefill": lambda **kw: fastattn.attention(q, q, q, **kw),
        "prefill causal": lambda **kw: fastattn.attention(q, q, q, causal=True, **kw),
        "bshd": lambda **kw: fastattn.attention(qs, qs, qs, layout="bshd", **kw),
        "decode": lambda **kw: fastattn.attention(qd, kd, kd, **kw),
        "weights": lambda **kw: fastattn.attention_weights(q, q, **kw),
        "varlen": lambda **kw: fastattn.varlen_attention(qv, qv, qv, cu, cu, **kw),
    }


@pytest.mark.parametrize("path", list(_paths(np.random.default_rng(0))))
def test_num_threads_reaches_the_kernel(kernel, rng, path):
    """num_threads is the number of threads that run the call (not only a result
    that happens to be the same on any count)."""
    call = _paths(rng)[path]
    for n in (1, 2, 3, 1, 4):
        call(num_threads=n)
        assert _kernels.last_num_threads() == n, (path, n)
    call()
    assert _kernels.last_num_threads() == _kernels.max_threads()


def test_default_threads_follow_threadpoolctl(rng):
    threadpoolctl = pytest.importorskip("threadpoolctl")
    q = rng.standard_normal((4, 130, 32)).astype(np.float32)
    a = fastattn.attention(q, q, q)
    for n in (1, 3, 2):
        with threadpoolctl.threadpool_limits(n, user_api="openmp"):
            b = fastattn.attention(q, q, q)
            assert _kernels.last_num_threads() == n
            assert fastattn._config.config()["threads"] == n
        assert np.array_equal(a, b)


@pytest.mark.parametrize("omp", ["1", "3"])
def test_default_threads_follow_omp_num_threads(omp):
    code = ("import numpy as np, fastattn; from fastattn import _kernels as K; "
            "q = np.ones((4, 130, 32), np.float32); fastattn.attention(q, q, q); "
            "print(K.last_num_threads(), K.max_threads())")
    pkg_root = pathlib.Path(fastattn.__file__).resolve().parent.parent
    env = dict(os.environ, OMP_NUM_THREADS=omp, PYTHONPATH=str(pkg_root))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       cwd=tempfile.gettempdir(), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [omp, omp]


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


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
def test_short_items_claimed_ahead(kernel, rng, kv_dtype):
    """Many short items (a few rows against a few dozen keys): each thread claims its
    next item as it starts one and asks for that item's rows (fa_use_lookahead).  Every
    item runs exactly once, whatever the thread count: the output and lse agree with the
    oracle and have the same bits on 1-4 threads; GQA, a strided q view, float16 K/V,
    causal, and packed variable lengths."""
    qf = rng.standard_normal((6, 47, 8, 20)).astype(np.float32)
    q = qf.swapaxes(1, 2)[:, :, ::2]  # (6, 8, 24, 20), rows and heads strided
    k = rng.standard_normal((6, 2, 37, 20)).astype(kv_dtype)
    v = rng.standard_normal((6, 2, 37, 12)).astype(kv_dtype)
    tol = 2e-6 if kv_dtype == np.float32 else 4e-6
    for causal in (False, True):
        want, want_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
        base = fastattn.attention(q, k, v, causal=causal, return_lse=True, num_threads=1)
        np.testing.assert_allclose(base[0], want, rtol=0, atol=tol)
        np.testing.assert_allclose(base[1], want_lse, rtol=0, atol=tol)
        for n in (2, 3, 4):
            out, lse = fastattn.attention(q, k, v, causal=causal, return_lse=True, num_threads=n)
            assert np.array_equal(out, base[0]) and np.array_equal(lse, base[1]), (causal, n)
    cu_q, cu_k = np.array([0, 5, 5, 40, 41, 90]), np.array([0, 9, 30, 31, 75, 90])
    qv = rng.standard_normal((90, 4, 16)).astype(np.float32)
    kv = rng.standard_normal((90, 2, 16)).astype(kv_dtype)
    want = reference.varlen_attention(qv, kv, kv, cu_q, cu_k, causal=True)
    base = fastattn.varlen_attention(qv, kv, kv, cu_q, cu_k, causal=True, num_threads=1)
    np.testing.assert_allclose(base, want, rtol=0, atol=tol)
    for n in (2, 3, 4):
        assert np.array_equal(fastattn.varlen_attention(qv, kv, kv, cu_q, cu_k, causal=True, num_threads=n), base)


@pytest.mark.parametrize("mode", ["all", "stream"])
def test_lookahead_modes(kernel, rng, mode):
    """Both ways the look-ahead asks for the next short item's rows (all at once, AMD's;
    the Q and output rows as a stream paced by the running item's products, Intel's),
    forced on whatever machine runs the tests: items of several key blocks (L=200),
    GQA groups stacked in an item, causal; against the oracle, and the same bits as the
    CPU's own choice, on 1-4 threads."""
    q = rng.standard_normal((8, 8, 200, 32)).astype(np.float32)
    k = rng.standard_normal((8, 2, 200, 32)).astype(np.float32)
    v = rng.standard_normal((8, 2, 200, 24)).astype(np.float32)
    for causal in (False, True):
        want = reference.attention(q, k, v, causal=causal)
        base = fastattn.attention(q, k, v, causal=causal, return_lse=True, num_threads=1)
        np.testing.assert_allclose(base[0], want, rtol=0, atol=2e-6)
        try:
            fastattn._kernels.set_lookahead(mode)
            for n in (1, 2, 3, 4):
                out, lse = fastattn.attention(q, k, v, causal=causal, return_lse=True, num_threads=n)
                assert np.array_equal(out, base[0]) and np.array_equal(lse, base[1]), (causal, n)
        finally:
            fastattn._kernels.set_lookahead("auto")
    with pytest.raises(ValueError, match="look-ahead mode"):
        fastattn._kernels.set_lookahead("sometimes")


def _spread_run(code, **env_set):
    """code in a fresh interpreter whose threads are not bound (OMP_PROC_BIND and the
    other binding variables removed, then env_set), its stdout."""
    pkg_root = pathlib.Path(fastattn.__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "FASTATTN_SPREAD")}
    env.update(PYTHONPATH=str(pkg_root), **env_set)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       cwd=tempfile.gettempdir(), timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


_SPREAD_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
_spread_needs = pytest.mark.skipif(
    not sys.platform.startswith("linux") or _SPREAD_CPUS < 2 or not _kernels.build_info()["openmp"],
    reason="the spread moves threads on Linux builds with OpenMP, in a process with 2 or more CPUs")


@_spread_needs
def test_spread_moves_a_thread_off_a_taken_cpu():
    """Unbound, a thread of a call that starts on a CPU another of the call's threads
    holds moves to a free CPU of its mask (the probe first puts the second thread on
    the first's CPU, as the scheduler's wake-ups did): it moves, to another CPU, the
    count says so, and its affinity mask afterwards is what it was.  Turned off, by
    set_spread or FASTATTN_SPREAD=0, or with the threads bound, nothing moves."""
    code = ("import os, json, fastattn; K = fastattn._kernels; out = {}\n"
            "m0 = K.spread_moves(); reps = [K.spread_probe(2, herd=True) for _ in range(12)]\n"
            "out['reps'] = reps; out['moves'] = K.spread_moves() - m0\n"
            "out['free'] = K.spread_probe(2)\n"
            "K.set_spread('off'); out['off'] = K.spread_probe(2, herd=True); K.set_spread('auto')\n"
            "out['mask'] = sorted(os.sched_getaffinity(0))\n"
            "print(json.dumps(out))")
    import json
    out = json.loads(_spread_run(code))
    moved_total = 0
    for start, joined, moved in out["reps"]:
        assert len(start) == len(joined) == 2 and moved in (0, 1)
        assert -1 not in joined
        if moved:
            # the second thread left the first's CPU for another one of the mask
            assert joined[1] != start[0] and joined[1] in out["mask"], (start, joined)
        else:
            # (the scheduler itself had moved it before the spread looked)
            assert start[1] != start[0], (start, joined)
        moved_total += moved
    assert moved_total >= 1, out["reps"]
    assert out["moves"] == moved_total
    assert -1 not in out["free"][1]
    assert out["off"] == [out["off"][0], [-1, -1], 0]
    assert out["mask"] == sorted(os.sched_getaffinity(0))
    for env_set in ({"FASTATTN_SPREAD": "0"}, {"OMP_PROC_BIND": "true"}):
        start, joined, moved = json.loads(_spread_run(
            "import json, fastattn; print(json.dumps(fastattn._kernels.spread_probe(2, herd=True)))",
            **env_set))
        assert joined == [-1, -1] and moved == 0, env_set


@_spread_needs
def test_spread_keeps_the_bits():
    """Decoding and prefill calls with the spread on and off, unbound, in one process:
    the same bits (no result depends on where a thread runs)."""
    code = ("import numpy as np, fastattn, time; K = fastattn._kernels\n"
            "r = np.random.default_rng(3)\n"
            "q = r.standard_normal((2, 8, 1, 64), dtype=np.float32)\n"
            "k = r.standard_normal((2, 2, 1500, 64), dtype=np.float32)\n"
            "c = fastattn.KVCache(2, 2, 64, 1500, dtype='float16'); c.append(k, k)\n"
            "p = r.standard_normal((2, 4, 300, 32), dtype=np.float32)\n"
            "res = {}\n"
            "for mode in ('on', 'off', 'on'):\n"
            "    K.set_spread(mode); time.sleep(0.03)\n"
            "    res.setdefault(mode, []).append((fastattn.attention(q, c, num_threads=2), "
            "fastattn.attention(p, p, p, causal=True, num_threads=2)))\n"
            "a, b, d = res['on'][0], res['off'][0], res['on'][1]\n"
            "print(all(np.array_equal(x, y) and np.array_equal(x, z) for x, y, z in zip(a, b, d)))")
    assert _spread_run(code).split() == ["True"]


def test_spread_modes():
    with pytest.raises(ValueError, match="spread mode"):
        _kernels.set_spread("sometimes")
    with pytest.raises(ValueError, match="num_threads"):
        _kernels.spread_probe(0)
    start, joined, moved = _kernels.spread_probe(1)
    assert len(start) == len(joined) == 1 and moved == 0
