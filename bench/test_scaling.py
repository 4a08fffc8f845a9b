"""Thread scaling of the forward: the same call on 1, 2, 4, ... threads up to the cores
of the machine (os.cpu_count()), each count's GFLOP/s against the FMA peak
measured on that many threads (fastattn.bench.fma_peak), its speed-up over one thread,
and the schedule's own balance for that count (fastattn.bench.plan_balance: the bound
the plan allows, mean / max of the work per thread).

    OMP_PROC_BIND=true pytest bench/test_scaling.py -s

Shapes: the long prefill (B1 H8 L4096 D64), a single long causal head (B1 H1 L16384,
the plan-balance test's hardest shape) and the same prefill in bfloat16 (ml_dtypes;
skipped without it).  --bench-threads does not apply here: the thread count is the
parameter.  Each case checks its output against the oracle on sampled rows.
"""
import os
import time

import numpy as np
import pytest

import fastattn
from fastattn import bench as fbench

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:
    BF16 = None

# every CPU of the machine (not this process's affinity: with OMP_PROC_BIND set, the
# OpenMP runtime has bound the main thread to one CPU by the time this module loads)
NCPU = os.cpu_count() or 1
THREADS = sorted({t for t in (1, 2, 4, 8, 16, 32, 64, 128) if t <= NCPU} | {NCPU})
SHAPES = {  # name: (B, H, L, D, dtype name, causal)
    "B1 H8 L4096 D64 float32": (1, 8, 4096, 64, "float32", False),
    "B1 H1 L16384 D64 causal float32": (1, 1, 16384, 64, "float32", True),
    "B1 H8 L4096 D64 bfloat16": (1, 8, 4096, 64, "bfloat16", False),
}
TOL = {"float32": 3e-5, "bfloat16": 2e-2}
CASES = [(name, t) for name in SHAPES for t in THREADS]
_ONE_THREAD = {}  # shape name -> best time on one thread
_PEAK = {}  # (path, threads) -> the highest peak measured this session (GFLOP/s)


def _peak(path, threads):
    """The path's peak on `threads` threads, measured before the case's calls (after a
    pause, so that no worker of the last call still spins) and kept at the session's
    highest reading (this shared machine's speed drifts)."""
    for _ in range(1 if (path, threads) in _PEAK else 2):  # twice at first: a new thread count's
        time.sleep(0.2)                                    # first reading was seen at half
        got = fbench.fma_peak("float32", threads) if path == "float32" else fbench.bf16_peak(threads)
        _PEAK[path, threads] = max(_PEAK.get((path, threads), 0.0), got)
    return _PEAK[path, threads]


def summary_header():
    return (f"thread scaling (kernel={fastattn._kernels.current_kernel()}, {NCPU} CPUs): "
            "GFLOP/s, % of the peak on as many threads (the float32 FMA, or the bfloat16 "
            "path's product instruction), speed-up over 1 thread, plan balance")


@pytest.mark.parametrize("name,threads", CASES, ids=[f"{n} T{t}" for n, t in CASES])
def test_scaling(benchmark, check_rows, summary, name, threads):
    b, h, l, d, dt, causal = SHAPES[name]
    if dt == "bfloat16" and BF16 is None:
        pytest.skip("ml_dtypes is not installed")
    dtype = BF16 if dt == "bfloat16" else np.dtype(dt)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((b, h, l, d), dtype=np.float32).astype(dtype) for _ in range(3))
    flops = 4.0 * b * h * l * l * d * (0.5 if causal else 1.0)
    # the ceiling of the path the call takes: the float32 FMA, or bfloat16's product instruction
    path = fastattn._kernels.bf16_path() if dt == "bfloat16" else "float32"
    peak = None if benchmark.disabled else _peak(path, threads)
    benchmark.group = "scaling " + name
    out = benchmark.pedantic(lambda: fastattn.attention(q, k, v, causal=causal, num_threads=threads),
                             rounds=5, iterations=1, warmup_rounds=1)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    err = check_rows(out.astype(np.float32), q64, k64, v64, causal=causal, tol=TOL[dt])
    if benchmark.stats is None:  # --benchmark-disable: the check only
        return
    best = benchmark.stats.stats.min
    if threads == 1:
        _ONE_THREAD[name] = best
    # (plan_balance models the float32 and float64 plans)
    balance = (fbench.plan_balance(q.shape, k.shape, causal=causal, num_threads=threads, dtype=dt)
               if dt != "bfloat16" else float("nan"))
    gflops = flops / best / 1e9
    speedup = _ONE_THREAD[name] / best if name in _ONE_THREAD else float("nan")
    benchmark.extra_info.update(threads=threads, kernel=fastattn._kernels.current_kernel(),
                                gflops=gflops, fma_peak_gflops=peak, speedup=speedup,
                                plan_balance=balance, rel_err=err, path=path)
    summary.append(f"{name:<34} T{threads:<4} {gflops:8.1f} GFLOP/s {100 * gflops / peak:4.0f}% of "
                   f"{peak:7.0f} ({path})   {speedup:5.2f}x 1 thread   balance {balance:.3f}")
