"""fastattn.jax (an XLA FFI call) against JAX's own CPU attention.

``jax.jit(fastattn.jax.dot_product_attention)`` and ``jax.jit(jax.nn.dot_product_attention)``
(XLA's generic code on the CPU) on the same arrays, in alternating rounds (JAX's in
each round's set-up, 0.03 s idle between them), results compared once:

- forward at the report's shapes (layout (B, T, N, H)), float32, and bfloat16 at one;
- forward + backward (``jax.grad`` of a sum of squares) at B1 H8 L2048 D64;
- the call overhead at B=1 L=16 H=1 D=64 under jit, against fastattn's NumPy call.

JAX runs on its own thread pool (XLA's), fastattn on ``--bench-threads`` OpenMP threads;
XLA is given the same count with ``--xla_cpu_multi_thread_eigen`` left on and the
process' CPU set (2 cores here).  With ``--benchmark-disable`` each case runs once.
"""
import time

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
fj = pytest.importorskip("fastattn.jax")

import fastattn  # noqa: E402
from fastattn.bench import ratio_text  # noqa: E402

# name: (B, N, T, S, H, causal); decode: one query against a long cache
CASES = {
    "B1 H8 L4096 D64": (1, 8, 4096, 4096, 64, False),
    "B1 H8 L4096 D64 causal": (1, 8, 4096, 4096, 64, True),
    "B1 H8 L2048 D128": (1, 8, 2048, 2048, 128, False),
    "B4 H16 L256 D64": (4, 16, 256, 256, 64, False),
    "decode B1 H32 Lk8192 D128": (1, 32, 1, 8192, 128, False),
    "bf16 B1 H8 L2048 D64 causal": (1, 8, 2048, 2048, 64, True),
}


def summary_header():
    """The first line of the table bench/conftest.py's `summary` prints."""
    return (f"fastattn.jax vs jax.nn.dot_product_attention (jax {jax.__version__}, jit, "
            f"kernel={fastattn._kernels.current_kernel()}), interleaved, best / median:")


def _inputs(B, N, T, S, H, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(s, dtype=np.float32), dtype)
                 for s in ((B, T, N, H), (B, S, N, H), (B, S, N, H)))


def _alternate(benchmark, ours, theirs, rounds):
    times = []

    def setup():
        time.sleep(0.03)
        t = time.perf_counter()
        jax.block_until_ready(theirs())
        times.append(time.perf_counter() - t)
        time.sleep(0.03)

    out = benchmark.pedantic(lambda: jax.block_until_ready(ours()), setup=setup, rounds=rounds,
                             iterations=1, warmup_rounds=1)
    return out, times[-rounds:]


@pytest.mark.parametrize("name", list(CASES))
def test_forward(benchmark, bench_threads, summary, name):
    B, N, T, S, H, causal = CASES[name]
    dt = jnp.bfloat16 if name.startswith("bf16") else jnp.float32
    q, k, v = _inputs(B, N, T, S, H, dt)
    ours = jax.jit(lambda q, k, v: fj.dot_product_attention(q, k, v, is_causal=causal,
                                                             num_threads=bench_threads))
    theirs = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal))
    benchmark.group = "jax forward " + name
    out, their_t = _alternate(benchmark, lambda: ours(q, k, v), lambda: theirs(q, k, v),
                              3 if T * S * B * N > 2**27 else 9)
    ref = theirs(q, k, v)
    err = float(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32)).max()
                / jnp.abs(ref.astype(jnp.float32)).max())
    assert err <= (2e-2 if dt == jnp.bfloat16 else 1e-5), err
    benchmark.extra_info.update(case=name, rel_err_vs_jax=err)
    if benchmark.stats:
        ours_t = list(benchmark.stats.stats.data)
        summary.append(f"forward {name:<28} fastattn {min(ours_t) * 1e3:9.2f} ms, jax "
                       f"{min(their_t) * 1e3:9.2f} ms: jax / fastattn {ratio_text(their_t, ours_t)}")


def test_forward_backward(benchmark, bench_threads, summary):
    B, N, T, H = 1, 8, 2048, 64
    q, k, v = _inputs(B, N, T, T, H)

    def grads(attn, **kw):
        return jax.jit(jax.grad(lambda q, k, v: (attn(q, k, v, is_causal=False, **kw) ** 2).sum(),
                                argnums=(0, 1, 2)))
    ours = grads(fj.dot_product_attention, num_threads=bench_threads)
    theirs = grads(jax.nn.dot_product_attention)
    benchmark.group = "jax fwd+bwd B1 H8 L2048 D64"
    got, their_t = _alternate(benchmark, lambda: ours(q, k, v), lambda: theirs(q, k, v), 3)
    for a, b in zip(got, theirs(q, k, v)):
        assert float(jnp.abs(a - b).max() / jnp.abs(b).max()) <= 1e-4
    if benchmark.stats:
        ours_t = list(benchmark.stats.stats.data)
        summary.append(f"fwd+bwd B1 H8 L2048 D64               fastattn {min(ours_t) * 1e3:9.2f} "
                       f"ms, jax {min(their_t) * 1e3:9.2f} ms: jax / fastattn {ratio_text(their_t, ours_t)}")


def test_call_overhead(benchmark, summary):
    """B=1 T=S=16 N=1 H=64 under jit, one thread (as fastattn.torch runs calls this small),
    against fastattn's NumPy call on the same data.

    Two figures: the FFI call inside a compiled program (a jitted ``lax.scan`` of 200
    chained calls, per call), which is what a model pays per attention, and a whole
    standalone jitted call, which includes JAX's dispatch of any jitted function
    (measured alongside as ``jax.jit(lambda q, k, v: q + 1)``)."""
    q, k, v = _inputs(1, 1, 16, 16, 64)
    qn, kn, vn = (np.asarray(x).transpose(0, 2, 1, 3).copy() for x in (q, k, v))
    n = 200

    def attn(q):
        return fj.dot_product_attention(q, k, v, num_threads=1)
    scanned = jax.jit(lambda q: jax.lax.scan(lambda c, _: (attn(c), None), q, None, length=n)[0])
    single = jax.jit(attn)
    noop = jax.jit(lambda q: q + 1)
    for f in (scanned, single, noop):
        jax.block_until_ready(f(q))
    numpy_t, single_t, noop_t = [], [], []

    def per_call(f, into):
        t = time.perf_counter()
        for _ in range(n):
            f()
        into.append((time.perf_counter() - t) / n)

    def setup():
        per_call(lambda: fastattn.attention(qn, kn, vn, num_threads=1), numpy_t)
        per_call(lambda: jax.block_until_ready(single(q)), single_t)
        per_call(lambda: jax.block_until_ready(noop(q)), noop_t)

    benchmark.group = "jax call overhead L16"
    out = benchmark.pedantic(lambda: jax.block_until_ready(scanned(q)), setup=setup, rounds=7,
                             iterations=1, warmup_rounds=1)
    ref = qn
    for _ in range(n):
        ref = fastattn.attention(ref, kn, vn, num_threads=1)
    np.testing.assert_allclose(np.asarray(out).transpose(0, 2, 1, 3), ref, rtol=1e-5, atol=1e-5)
    if benchmark.stats:
        ours_t = [t / n for t in benchmark.stats.stats.data]
        summary.append(f"call B1 H1 L16 D64: in a jitted scan {min(ours_t) * 1e6:5.2f} us/call, NumPy "
                       f"API {min(numpy_t) * 1e6:5.2f} us: ratio {ratio_text(ours_t, numpy_t)}")
        summary.append(f"  standalone jitted call {min(single_t) * 1e6:5.2f} us (jax.jit(q + 1) alone "
                       f"{min(noop_t) * 1e6:5.2f} us): ratio to NumPy {ratio_text(single_t, numpy_t)}")
