"""Memory: fastattn's peak RSS growth at L = 32768 stays O(L), not O(L^2).

A child process (fresh interpreter, so nothing else inflates the peak) allocates and
touches q, k, v and the output, records ru_maxrss, runs fastattn.attention(..., out=out)
and records ru_maxrss again.  The naive formula would need 4 GiB for the float32 score
matrix at this length; fastattn must stay under 64 MB of growth.  The same child checks
a few output rows against fastattn.reference (8 x 32768 scores, cheap).
"""
import json
import os
import subprocess
import sys

import pytest

import fastattn

B, H, L, D = 1, 1, 32768, 64
LIMIT_MB = 64

CHILD = r"""
import json, resource, sys, time
import numpy as np
import fastattn
from fastattn import reference

B, H, L, D, threads = (int(x) for x in sys.argv[1:6])
rng = np.random.default_rng(0)
q, k, v = (np.empty((B, H, L, D), dtype=np.float32) for _ in range(3))
for x in (q, k, v):
    rng.standard_normal(out=x, dtype=np.float32)   # in place: no float64 temporaries
out = np.empty_like(q)
out.fill(0.0)                                      # np.empty pages are lazy: touch them

def maxrss_kib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux

before = maxrss_kib()
t0 = time.perf_counter()
fastattn.attention(q, k, v, out=out, num_threads=threads)
seconds = time.perf_counter() - t0
after = maxrss_kib()

rows = slice(0, L, L // 8)
ref = reference.attention(q[0, 0, rows], k[0, 0], v[0, 0], scale=1.0 / np.sqrt(D))
err = float(np.max(np.abs(out[0, 0, rows] - ref)) / np.max(np.abs(ref)))
print(json.dumps({"before_kib": before, "after_kib": after, "growth_kib": after - before,
                  "seconds": seconds, "rel_err": err,
                  "kernel": fastattn._kernels.current_kernel()}))
"""


def run_child(threads):
    # inherit the environment; put the fastattn this process imported first on the path
    root = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [root, env.get("PYTHONPATH", "")] if p)
    proc = subprocess.run([sys.executable, "-c", CHILD, str(B), str(H), str(L), str(D), str(threads)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.benchmark(group="memory")
def test_peak_memory_L32768(benchmark, bench_threads, capsys):
    res = benchmark.pedantic(run_child, args=(bench_threads,), rounds=1, iterations=1)
    growth_mb = res["growth_kib"] / 1024
    benchmark.extra_info.update(
        kernel=res["kernel"], threads=bench_threads, shape=[B, H, L, D], dtype="float32",
        maxrss_before_mb=round(res["before_kib"] / 1024, 1),
        maxrss_after_mb=round(res["after_kib"] / 1024, 1),
        maxrss_growth_mb=round(growth_mb, 2), call_seconds=round(res["seconds"], 3),
        gflops=round(4.0 * B * H * L * L * D / res["seconds"] / 1e9, 2), rel_err=res["rel_err"])
    with capsys.disabled():
        print(f"\n[memory] fastattn B={B} H={H} L={L} D={D} float32: peak RSS "
              f"{res['before_kib'] / 1024:.1f} -> {res['after_kib'] / 1024:.1f} MiB "
              f"(+{growth_mb:.2f} MiB, limit {LIMIT_MB}), call {res['seconds']:.2f} s, "
              f"rel err {res['rel_err']:.1e}")
    assert res["rel_err"] <= 3e-5
    assert growth_mb < LIMIT_MB, f"peak RSS grew by {growth_mb:.1f} MiB (limit {LIMIT_MB})"
