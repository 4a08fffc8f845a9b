"""Prefill (full-sequence) attention: fastattn vs naive NumPy vs PyTorch SDPA.

All implementations of one shape share a ``benchmark.group``, so
``--benchmark-group-by=group`` prints them side by side; ``extra_info`` holds the
CPU kernel, thread count and GFLOP/s (4·B·H·Lq·Lk·D, halved for causal) of each.
Each benchmark checks its own result once against ``fastattn.reference``, in every
batch and head: the whole output for small shapes, a sample of query rows (the first,
the last and a few random ones, the oracle computed on just those rows) for big ones, to
keep the float64 oracle cheap; so ``pytest bench/ --benchmark-disable`` is a quick
correctness run.

test_prefill_interleaved times fastattn against a baseline called just before every
round: PyTorch SDPA, ONNX Runtime's Attention op and OpenVINO's SDPA (bench/peers.py;
skipped where they are not installed: ``pip install onnxruntime onnx openvino``), the
causal call against the non-causal one, 2 threads against 1, float64 against float32.
"""
import numpy as np
import pytest

import fastattn
from fastattn import reference
from fastattn.bench import child_ceilings, naive  # the naive formula, in one place

TOL = {np.dtype(np.float32): 3e-5, np.dtype(np.float64): 1e-11}

# (B, H, L, D, dtype, causal, implementations); "fastattn-1t" is fastattn on one
# thread, for the thread scaling figure.
ALL = ("fastattn", "numpy", "torch")
SHAPES = [
    (1, 8, 4096, 64, np.float32, False, ALL + ("fastattn-1t",)),
    (1, 8, 4096, 64, np.float32, True, ALL),
    (1, 8, 2048, 128, np.float32, False, ALL),
    (4, 16, 256, 64, np.float32, False, ALL),
    (1, 16, 512, 64, np.float32, True, ALL),
    (1, 8, 2048, 64, np.float32, False, ("fastattn",)),
    (1, 8, 2048, 64, np.float64, False, ("fastattn",)),
]

NAIVE_MAX_SCORE_BYTES = 2 * 2**30  # skip the naive formula above this score-matrix size
HEAVY_FLOPS = 2e9                  # above this, a fixed 1 warm-up + 3 rounds (pedantic)
FULL_CHECK_MAX = 2**24             # B*H*Lq*Lk above which sampled rows of each head are checked


def _group(b, h, l, d, dtype, causal):
    return f"B{b} H{h} L{l} D{d} {np.dtype(dtype).name}{' causal' if causal else ''}"


PARAMS = [pytest.param(s[:6], impl, id=f"{_group(*s[:6]).replace(' ', '-')}-{impl}")
          for s in SHAPES for impl in s[6]]


def flops_of(b, h, lq, lk, d, causal):
    return 4.0 * b * h * lq * lk * d * (0.5 if causal else 1.0)


def make_inputs(b, h, l, d, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((b, h, l, d), dtype=np.float32).astype(dtype, copy=False)
                 for _ in range(3))


def _import_torch():
    """torch, or a clean skip when it is absent (or only half-installed)."""
    try:
        return pytest.importorskip("torch")
    except pytest.skip.Exception:
        raise
    except Exception as exc:  # e.g. a broken/in-progress install
        pytest.skip(f"torch not usable: {type(exc).__name__}: {exc}")


def run(benchmark, f, flops):
    """Time f: heavy cases a fixed 1 warm-up + 3 rounds, light ones calibrated."""
    if flops > HEAVY_FLOPS:
        return benchmark.pedantic(f, rounds=3, iterations=1, warmup_rounds=1)
    return benchmark(f)


@pytest.mark.parametrize("case, impl", PARAMS)
def test_prefill(benchmark, record, check_close, check_rows, bench_threads, case, impl):
    b, h, l, d, dtype, causal = case
    flops = flops_of(b, h, l, l, d, causal)
    benchmark.group = _group(*case)
    scale = 1.0 / np.sqrt(d)

    if impl == "torch":
        torch = _import_torch()
    if impl == "numpy" and b * h * l * l * np.dtype(dtype).itemsize > NAIVE_MAX_SCORE_BYTES:
        pytest.skip("naive score matrix would exceed 2 GiB")

    q, k, v = make_inputs(b, h, l, d, dtype)

    if impl.startswith("fastattn"):
        out = np.empty_like(q)
        nth = 1 if impl == "fastattn-1t" else bench_threads

        def f():
            return fastattn.attention(q, k, v, causal=causal, out=out, num_threads=nth)
    elif impl == "numpy":
        def f():
            return naive(q, k, v, scale, causal)
    else:
        torch.set_num_threads(bench_threads)
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def f():
            with torch.no_grad():
                return sdpa(tq, tk, tv, is_causal=causal)

    result = run(benchmark, f, flops)
    if impl == "torch":
        result = result.numpy()

    assert result.shape == q.shape and result.dtype == q.dtype
    if b * h * l * l <= FULL_CHECK_MAX:
        err = check_close(result, reference.attention(q, k, v, causal=causal), dtype)
    else:
        err = check_rows(result, q, k, v, causal=causal, tol=TOL[np.dtype(dtype)])
    record(flops, impl=impl, shape=[b, h, l, d], dtype=np.dtype(dtype).name,
           causal=causal, rel_err=err)


@pytest.mark.benchmark(group="sgemm")
def test_sgemm_ceiling(benchmark, record, check_close, bench_threads):
    """NumPy float32 2048^3 matmul: the BLAS throughput ceiling on this machine.  The
    benchmark is NumPy's in this process (the BLAS the NumPy rows run); the ceiling the
    summary uses is the same product in a child process without OPENBLAS_CORETYPE and the
    like (fastattn.bench.child_ceilings), which an environment setting cannot lower."""
    n = 2048
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    bm = rng.standard_normal((n, n), dtype=np.float32)
    c = np.empty((n, n), dtype=np.float32)
    result = benchmark.pedantic(lambda: np.matmul(a, bm, out=c), rounds=3, iterations=1,
                                warmup_rounds=1)
    check_close(result[:8], a[:8].astype(np.float64) @ bm.astype(np.float64), np.float32)
    clean = {}
    if not benchmark.disabled:
        child, why = child_ceilings(bench_threads, n)
        clean = (dict(clean_gflops=round(child["sgemm_gflops"], 2), clean_blas=child["blas"],
                      env_removed=child["env_removed"]) if child else dict(child_error=why))
    record(2.0 * n ** 3, impl="numpy sgemm", shape=[n, n, n], dtype="float32", **clean)


@pytest.mark.parametrize("impl", ["fastattn", "torch"])
def test_call_overhead(benchmark, record, bench_threads, impl):
    """The whole call from Python at B=1 H=1 L=16 D=64 float32: the cost of a short
    sequence (argument checks, dispatch, the kernel), fastattn vs PyTorch."""
    benchmark.group = "call overhead B1 H1 L16 D64 float32"
    q, k, v = make_inputs(1, 1, 16, 64, np.float32)
    if impl == "torch":
        torch = _import_torch()
        torch.set_num_threads(bench_threads)
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        with torch.no_grad():
            result = benchmark(sdpa, tq, tk, tv).numpy()
    else:
        result = benchmark(fastattn.attention, q, k, v)
    assert np.abs(result - reference.attention(q, k, v)).max() <= 3e-5 * np.abs(result).max()
    record(flops_of(1, 1, 16, 16, 64, False), impl=impl, microseconds=benchmark.stats.stats.min * 1e6
           if benchmark.stats else None)


# The ratios the issue asks for, measured interleaved: on this shared machine the
# separate benchmarks above run seconds apart and the machine's speed moves by
# 20-30% in between, so each of these times fastattn with its baseline's call just
# before every round (in the untimed set-up, 0.1 s idle around it), like
# bench/test_variants.py.  The summary prints baseline time / fastattn time.
F32, F64 = np.float32, np.float64
INTERLEAVED = {
    "B1 H8 L4096 D64 vs torch": ((1, 8, 4096, 64, F32, False), "torch"),
    "B1 H8 L4096 D64 causal vs torch": ((1, 8, 4096, 64, F32, True), "torch"),
    "B1 H8 L2048 D128 vs torch": ((1, 8, 2048, 128, F32, False), "torch"),
    "B4 H16 L256 D64 vs torch": ((4, 16, 256, 64, F32, False), "torch"),
    "B1 H16 L512 D64 causal vs torch": ((1, 16, 512, 64, F32, True), "torch"),
    "B1 H8 L4096 D64 2 threads vs 1": ((1, 8, 4096, 64, F32, False), "fastattn 1 thread"),
    "B1 H8 L2048 D64 float64 vs float32": ((1, 8, 2048, 64, F64, False), "fastattn float32"),
    "B8 H32 L128 D64 vs torch": ((8, 32, 128, 64, F32, False), "torch"),
    "B32 H8 L64 D64 vs torch": ((32, 8, 64, 64, F32, False), "torch"),
    # causal over non-causal: the summary's x is non-causal time / causal time (need >= 1.82,
    # i.e. causal <= 0.55 of the non-causal time)
    "B1 H8 L4096 D64 causal vs non-causal": ((1, 8, 4096, 64, F32, True), "fastattn non-causal"),
    "B1 H8 L2048 D128 causal vs non-causal": ((1, 8, 2048, 128, F32, True), "fastattn non-causal"),
}
# the other CPU runtimes (bench/peers.py; skipped when not installed), on the shapes
for _shape, _causal in (((1, 8, 4096, 64), False), ((1, 8, 4096, 64), True), ((1, 8, 2048, 128), False),
                        ((4, 16, 256, 64), False), ((8, 32, 128, 64), False), ((32, 8, 64, 64), False)):
    for _peer in ("onnxruntime", "openvino"):
        _b, _h, _l, _d = _shape
        INTERLEAVED[f"B{_b} H{_h} L{_l} D{_d}{' causal' if _causal else ''} vs {_peer}"] = (
            (_b, _h, _l, _d, F32, _causal), _peer)


@pytest.mark.parametrize("name", list(INTERLEAVED))
def test_prefill_interleaved(benchmark, bench_threads, check_rows, name):
    import time
    (b, h, l, d, dtype, causal), baseline = INTERLEAVED[name]
    q, k, v = make_inputs(b, h, l, d, dtype)
    if baseline == "torch":
        torch = _import_torch()
        torch.set_num_threads(bench_threads)
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def base():
            with torch.no_grad():
                return sdpa(tq, tk, tv, is_causal=causal)
    elif baseline == "fastattn 1 thread":
        def base():
            return fastattn.attention(q, k, v, causal=causal, num_threads=1)
    elif baseline in ("onnxruntime", "openvino"):
        import peers
        for mod in ("onnxruntime", "onnx") if baseline == "onnxruntime" else ("openvino",):
            pytest.importorskip(mod)
        make = peers.make_onnxruntime if baseline == "onnxruntime" else peers.make_openvino
        peer = make(b, h, h, l, l, d, bench_threads, causal=causal)

        def base():
            return peer(q, k, v)
        assert np.allclose(base(), fastattn.attention(q, k, v, causal=causal), atol=1e-4)
    elif baseline == "fastattn non-causal":
        def base():
            return fastattn.attention(q, k, v, causal=False, num_threads=bench_threads)
    else:  # the same shape in float32
        q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))

        def base():
            return fastattn.attention(q32, k32, v32, causal=causal, num_threads=bench_threads)
    base_times = []

    def run_baseline():
        time.sleep(0.1)  # the same idle before the baseline's call
        t = time.perf_counter()
        base()
        base_times.append(time.perf_counter() - t)
        time.sleep(0.1)  # let its spinning worker threads go idle before the timed call

    flops = flops_of(b, h, l, l, d, causal)
    rounds = 5 if flops > 8e9 else 9
    benchmark.group = "interleaved " + name
    out = benchmark.pedantic(lambda: fastattn.attention(q, k, v, causal=causal,
                                                        num_threads=bench_threads),
                             setup=run_baseline, rounds=rounds, iterations=1, warmup_rounds=1)
    err = check_rows(out, q, k, v, causal=causal, tol=TOL[np.dtype(dtype)])  # every head
    base_times = base_times[-rounds:]
    benchmark.extra_info.update(interleaved=name, baseline=baseline, threads=bench_threads,
                                kernel=fastattn._kernels.current_kernel(), rel_err=err,
                                dtype=np.dtype(dtype).name,
                                gflops=flops / (benchmark.stats.stats.min if benchmark.stats else 1) / 1e9,
                                baseline_min_s=min(base_times),
                                baseline_median_s=float(np.median(base_times)))
