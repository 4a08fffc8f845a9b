"""The planner's query blocks against others, interleaved: each case's forward with the
blocks the planner picks (fastattn.attention) against the same call with the query rows
of a block forced to 64, 192 or 384 (fastattn._kernels.forward's block_q, a knob for
measurements only), time against the planner's, best / median rounds.

    OMP_PROC_BIND=true pytest bench/test_blocks.py -s --bench-threads 2

So a machine met once (bench/machine_check.sh, phase `blocks`) tells whether its
kernel's rule in fa_default_blocks (src_c/fa_plan.c) holds there.  Written for the rule
still unmeasured on its own hardware: causal blocks of 64 rows on Intel's AVX-512, chosen
before the forward skipped the query vectors that see none of a tile's keys (AVX2's went
from 96 to 192 rows with that).  A ratio below 1 is a block size faster than the
planner's.  Each case checks its output against the oracle on sampled rows.
"""
import numpy as np
import pytest

import fastattn
from fastattn import _kernels
from fastattn import bench as fbench

SHAPES = {  # name: (B, H, L, D, causal)
    "B1 H8 L4096 D64": (1, 8, 4096, 64, False),
    "B1 H8 L4096 D64 causal": (1, 8, 4096, 64, True),
    "B1 H8 L2048 D128": (1, 8, 2048, 128, False),
    "B1 H8 L2048 D128 causal": (1, 8, 2048, 128, True),
}
BLOCK_Q = (64, 192, 384)
CASES = [(name, bq) for name in SHAPES for bq in BLOCK_Q]


def summary_header():
    return (f"query blocks against the planner's (threads from --bench-threads, kernel="
            f"{_kernels.current_kernel()}): time with block_q forced / time with the "
            "planner's blocks (best / median rounds; below 1: faster than the planner's)")


@pytest.mark.parametrize("name,block_q", CASES, ids=[f"{n} q{b}" for n, b in CASES])
def test_blocks(benchmark, bench_threads, check_rows, summary, name, block_q):
    b, h, l, d, causal = SHAPES[name]
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((b, h, l, d), dtype=np.float32) for _ in range(3))
    out = np.empty_like(q)
    scale = d ** -0.5
    # causal 1: the bottom-right diagonal of fastattn.attention's causal=True (Lq = Lk here)
    forced = lambda: _kernels.forward(q, k, v, out, None, scale, int(causal), bench_threads,
                                      block_q, 0, None)
    planner = lambda: fastattn.attention(q, k, v, causal=causal, num_threads=bench_threads)
    benchmark.group = "blocks " + name
    _, base_best, base_median = fbench.interleaved(benchmark, forced, planner, rounds=7)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    err = check_rows(out, q64, k64, v64, causal=causal, tol=3e-5)
    if benchmark.stats is None:  # --benchmark-disable: the check only
        return
    st = benchmark.stats.stats
    benchmark.extra_info.update(block_q=block_q, kernel=_kernels.current_kernel(), rel_err=err,
                                planner_min_s=base_best, planner_median_s=base_median)
    summary.append(f"{name:<26} block_q {block_q:<4} {st.min / base_best:6.3f} / "
                   f"{st.median / base_median:6.3f}")
