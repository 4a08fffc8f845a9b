"""Memory: peak RSS growth of each implementation, in a fresh subprocess each.

A child process (fresh interpreter, so nothing else inflates the peak) imports the
implementation, allocates and touches q, k, v and the output, resets and records its
peak RSS (VmHWM), runs the call and records the peak again.  fastattn's growth stays O(block) -- under 64 MB
at L = 32768 (the naive formula would need 4 GiB for the float32 scores there) -- and
it runs at L = 65536, where the naive formula cannot (16 GiB of scores).  The same
child checks a few output rows against fastattn.reference (8 x L scores, cheap).
"""
import json
import os
import subprocess
import sys

import pytest

import fastattn
from fastattn.bench import RSS_CHILD_PRELUDE

B, H, D = 1, 1, 64
LIMIT_MB = 64

CHILD = RSS_CHILD_PRELUDE + r"""
import json, sys, time
import numpy as np
impl = sys.argv[1]
B, H, L, D, threads = (int(x) for x in sys.argv[2:7])
import fastattn
from fastattn import reference
if impl == "torch":
    import torch
    torch.set_num_threads(threads)
rng = np.random.default_rng(0)
q, k, v = (np.empty((B, H, L, D), dtype=np.float32) for _ in range(3))
for x in (q, k, v):
    rng.standard_normal(out=x, dtype=np.float32)   # in place: no float64 temporaries
out = np.empty_like(q)
out.fill(0.0)                                      # np.empty pages are lazy: touch them
scale = 1.0 / np.sqrt(D)


reset_peak()  # the peak RSS of this process from now on (see RSS_CHILD_PRELUDE)
before = status_kib("VmHWM:")
t0 = time.perf_counter()
if impl == "fastattn":
    fastattn.attention(q, k, v, out=out, num_threads=threads)
elif impl == "torch":
    with torch.no_grad():
        out[...] = torch.nn.functional.scaled_dot_product_attention(
            torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v)).numpy()
else:  # the naive formula
    s = q @ k.swapaxes(-1, -2)
    s *= np.float32(scale)
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    np.matmul(s, v, out=out)
    del s
seconds = time.perf_counter() - t0
after = status_kib("VmHWM:")

rows = slice(0, L, L // 8)
ref = reference.attention(q[0, 0, rows], k[0, 0], v[0, 0], scale=scale)
err = float(np.max(np.abs(out[0, 0, rows] - ref)) / np.max(np.abs(ref)))
print(json.dumps({"before_kib": before, "after_kib": after, "growth_kib": after - before,
                  "seconds": seconds, "rel_err": err,
                  "kernel": fastattn._kernels.current_kernel()}))
"""


def run_child(impl, L, threads):
    # inherit the environment; put the fastattn this process imported first on the path
    root = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [root, env.get("PYTHONPATH", "")] if p)
    # cwd = that directory too: `python -c` puts the working directory first on sys.path,
    # and a source checkout there would shadow the installed package
    proc = subprocess.run([sys.executable, "-c", CHILD, impl, str(B), str(H), str(L), str(D),
                           str(threads)], env=env, cwd=root, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


NAIVE_MAX_L = 16384  # 1 GiB of float32 scores; beyond it the naive formula is not run
CASES = [(impl, L) for L in (4096, 16384, 32768, 65536) for impl in ("fastattn", "torch", "numpy")
         if not (impl == "numpy" and L > NAIVE_MAX_L)]


@pytest.mark.parametrize("impl,L", CASES, ids=[f"{i}-L{L}" for i, L in CASES])
def test_peak_memory(benchmark, bench_threads, capsys, impl, L):
    if impl == "torch":
        pytest.importorskip("torch")
    benchmark.group = f"memory B={B} H={H} D={D} float32 L={L}"
    res = benchmark.pedantic(run_child, args=(impl, L, bench_threads), rounds=1, iterations=1)
    growth_mb = res["growth_kib"] / 1024
    benchmark.extra_info.update(
        impl=impl, kernel=res["kernel"], threads=bench_threads, shape=[B, H, L, D], dtype="float32",
        maxrss_before_mb=round(res["before_kib"] / 1024, 1),
        maxrss_after_mb=round(res["after_kib"] / 1024, 1),
        maxrss_growth_mb=round(growth_mb, 2), call_seconds=round(res["seconds"], 3),
        rel_err=res["rel_err"])
    with capsys.disabled():
        print(f"\n[memory] {impl:<8} B={B} H={H} L={L} D={D} float32: peak RSS "
              f"{res['before_kib'] / 1024:.1f} -> {res['after_kib'] / 1024:.1f} MiB "
              f"(+{growth_mb:.2f} MiB), call {res['seconds']:.2f} s, rel err {res['rel_err']:.1e}")
    assert res["rel_err"] <= 3e-5
    if impl == "fastattn":
        assert growth_mb < LIMIT_MB, f"peak RSS grew by {growth_mb:.1f} MiB (limit {LIMIT_MB})"
