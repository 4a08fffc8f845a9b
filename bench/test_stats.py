"""The geometry's statistics: ``attention(..., return_stats=True)`` against the plain
call (need: at most 1.05x its time) and ``fastattn.key_mass`` against the plain forward
(at most 1.6x), each timed with its baseline's call just before every round (0.1 s idle
around it), float32, at the report's prefill shapes; and the entropy of a B=1 H=8
L=32768 D=64 call in a child process, whose peak RSS growth must stay under 64 MB (the
weights would need 32 GiB).  Every case checks its result on sampled rows against the
float64 oracle."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import fastattn
from fastattn.bench import RSS_CHILD_PRELUDE, interleaved
from fastattn import reference

SHAPES = {
    "B1 H8 L4096 D64": (1, 8, 4096, 64, False),
    "B1 H8 L4096 D64 causal": (1, 8, 4096, 64, True),
    "B4 H16 L256 D64": (4, 16, 256, 64, False),
}
CASES = [(shape, what) for shape in SHAPES for what in ("return_stats", "key_mass")]


def _sample_check(q, k, causal, stats=None, mass=None):
    """Entropy and max weight of a few rows of head 0, or the key mass of a few keys of
    head 0 (all rows), against the oracle's weights of just those rows/keys."""
    rows = np.unique(np.r_[0, q.shape[2] - 1, np.linspace(0, q.shape[2] - 1, 5).astype(int)])
    kw = dict(causal=causal)
    if stats is not None:
        Lq, Lk = q.shape[2], k.shape[2]
        mask = np.ones((len(rows), Lk), bool)
        if causal:
            mask = np.arange(Lk)[None, :] <= rows[:, None] + Lk - Lq
        w = reference.attention_weights(q[0, 0, rows], k[0, 0], mask=mask)
        ent = -np.sum(np.where(w > 0, w * np.log(np.where(w > 0, w, 1)), 0), -1)
        assert np.max(np.abs(stats.entropy[0, 0, rows] - ent)) <= 1e-4 * np.log(Lk)
        assert np.max(np.abs(stats.max_weight[0, 0, rows] - w.max(-1))) <= 1e-5
    if mass is not None:
        w = reference.attention_weights(q[0, 0], k[0, 0], **kw)
        assert np.max(np.abs(mass[0, 0] - w.sum(0))) <= 1e-4 * max(1.0, float(w.sum(0).max()))


@pytest.mark.parametrize("shape,what", CASES, ids=[f"{s.replace(' ', '-')}-{w}" for s, w in CASES])
def test_stats_cost(benchmark, bench_threads, shape, what):
    b, h, l, d, causal = SHAPES[shape]
    if benchmark.disabled:  # the correctness run of CI: the same code on a smaller problem
        l = min(l, 512)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((b, h, l, d), dtype=np.float32) for _ in range(3))
    nth = bench_threads

    def base():
        return fastattn.attention(q, k, v, causal=causal, num_threads=nth)

    if what == "return_stats":
        def ours():
            return fastattn.attention(q, k, v, causal=causal, return_stats=True, num_threads=nth)
    else:
        def ours():
            return fastattn.key_mass(q, k, causal=causal, num_threads=nth)
    rounds = 5
    benchmark.group = f"stats {shape}"
    res, base_min, base_median = interleaved(benchmark, ours, base, rounds)
    if what == "return_stats":
        _sample_check(q, k, causal, stats=res[1])
    else:
        _sample_check(q, k, causal, mass=res)
    st = benchmark.stats.stats if benchmark.stats else None
    benchmark.extra_info.update(stats_case=f"{shape} {what}", threads=nth,
                                kernel=fastattn._kernels.current_kernel(),
                                baseline_min_s=base_min,
                                baseline_median_s=base_median,
                                ratio_min=(st.min / base_min) if st else None)


CHILD = RSS_CHILD_PRELUDE + r"""
import json, sys, time
import numpy as np
import fastattn
B, H, L, D, threads = (int(x) for x in sys.argv[1:6])
rng = np.random.default_rng(0)
q, k, v = (np.empty((B, H, L, D), dtype=np.float32) for _ in range(3))
for x in (q, k, v):
    rng.standard_normal(out=x, dtype=np.float32)
out = np.zeros_like(q)


reset_peak()  # the peak RSS of this process from now on (see RSS_CHILD_PRELUDE)
before = status_kib("VmHWM:")
t0 = time.perf_counter()
_, stats = fastattn.attention(q, k, v, out=out, return_stats=True, num_threads=threads)
seconds = time.perf_counter() - t0
after = status_kib("VmHWM:")
print(json.dumps({"growth_kib": after - before, "seconds": seconds,
                  "mean_entropy": float(stats.entropy.mean()), "log_L": float(np.log(L))}))
"""


def test_entropy_memory(benchmark, bench_threads, capsys):
    """The entropy of every row of a B=1 H=8 L=32768 D=64 call: peak RSS growth < 64 MB."""
    L = 4096 if benchmark.disabled else 32768
    root = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [root, env.get("PYTHONPATH", "")] if p)

    def child():
        proc = subprocess.run([sys.executable, "-c", CHILD, "1", "8", str(L), "64", str(bench_threads)],
                              env=env, cwd=root, capture_output=True, text=True, timeout=1800)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])

    benchmark.group = f"memory entropy B=1 H=8 L={L} D=64"
    res = benchmark.pedantic(child, rounds=1, iterations=1)
    growth_mb = res["growth_kib"] / 1024
    benchmark.extra_info.update(stats_memory=True, growth_mb=round(growth_mb, 2),
                                call_seconds=round(res["seconds"], 2))
    with capsys.disabled():
        print(f"\n[memory] return_stats B=1 H=8 L={L} D=64 float32: peak RSS +{growth_mb:.1f} MiB "
              f"(stats {8 * L * 4 * 3 / 2**20:.1f} MiB of it), call {res['seconds']:.1f} s, mean "
              f"entropy {res['mean_entropy']:.2f} nats (log L = {res['log_L']:.2f})")
    assert growth_mb < 64
    # random q, k: the rows are spread, close to the centre of the simplex
    assert 0.5 * res["log_L"] < res["mean_entropy"] <= res["log_L"]
