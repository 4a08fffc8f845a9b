"""Attention variants at the speed of the plain kernel (issue: every variant in the
fast kernel).  Each group holds a variant and the call it is measured against, side
by side in one process; the terminal summary prints their time ratios:

- causal at L=8192 vs a sliding window (255, 0): the window must be >= 8x faster
  (work proportional to the visible keys);
- a random bool mask (B, 1, L, L) at L=2048: <= 1.3x the unmasked call;
- a float bias broadcast over heads (B, 1, L, L): <= 1.3x the plain call;
- GQA Hq=32, Hkv=4: at least as fast as the same call with K/V repeated to 32 heads;
- layout "bshd": within 5% of "bhsd".

Every benchmark checks its result once against fastattn.reference, in every batch and
head on a sample of query rows (fastattn.bench.check_rows, the variant's arguments
sliced alike), so ``pytest bench/ --benchmark-disable`` is a correctness run.
"""
import numpy as np
import pytest

import fastattn
from fastattn.bench import check_rows

F32 = np.float32


def _rand(rng, *shape):
    return rng.standard_normal(shape, dtype=F32)


def _check(out, q, k, v, **kw):
    """Sampled query rows of every batch and head against the oracle on just those rows
    (the variant's arguments -- causal, window, mask/bias rows, layout -- applied alike)."""
    err = check_rows(out, q, k, v, **kw)
    assert err <= 3e-5, err
    return float(err)


CASES = {
    # group: (shape B, Hq, Hkv, L, D), {name: (kwargs builder, is the baseline)}
    "causal vs window B1 H4 L8192 D64": ((1, 4, 4, 8192, 64), {
        "causal": (lambda rng: dict(causal=True), True),
        "window (255, 0)": (lambda rng: dict(window=(255, 0)), False),
    }),
    "random mask B1 H8 L2048 D64": ((1, 8, 8, 2048, 64), {
        "plain": (lambda rng: {}, True),
        "mask (B,1,L,L)": (lambda rng: dict(mask=rng.random((1, 1, 2048, 2048)) > 0.5), False),
    }),
    "bias over heads B1 H8 L2048 D64": ((1, 8, 8, 2048, 64), {
        "plain": (lambda rng: {}, True),
        "bias (B,1,L,L)": (lambda rng: dict(bias=_rand(rng, 1, 1, 2048, 2048)), False),
    }),
    "GQA Hq32 Hkv4 L1024 D64": ((1, 32, 4, 1024, 64), {
        "K/V repeated to 32 heads": (lambda rng: dict(repeat=8), True),
        "GQA Hkv=4": (lambda rng: {}, False),
    }),
    "layout B1 H8 L2048 D64": ((1, 8, 8, 2048, 64), {
        "bhsd": (lambda rng: {}, True),
        "bshd": (lambda rng: dict(layout="bshd"), False),
    }),
}


def _setup(rng, shape, build):
    B, Hq, Hkv, L, D = shape
    kw = build(rng)
    q, k, v = _rand(rng, B, Hq, L, D), _rand(rng, B, Hkv, L, D), _rand(rng, B, Hkv, L, D)
    if "repeat" in kw:
        r = kw.pop("repeat")
        k, v = np.repeat(k, r, axis=1), np.repeat(v, r, axis=1)
    if kw.get("layout") == "bshd":
        q, k, v = (np.ascontiguousarray(a.transpose(0, 2, 1, 3)) for a in (q, k, v))
    return q, k, v, kw


@pytest.mark.parametrize("group", list(CASES))
def test_variant(benchmark, bench_threads, group):
    """Times the variant; its baseline runs (and is timed) just before each round, in
    the benchmark's untimed set-up, so the two are interleaved and share the
    machine's state: their ratio is what the summary prints."""
    import time
    shape, impls = CASES[group]
    (vname, (vbuild, _)), = [(n, x) for n, x in impls.items() if not x[1]]
    (bname, (bbuild, _)), = [(n, x) for n, x in impls.items() if x[1]]
    rng = np.random.default_rng(0)
    q, k, v, kw = _setup(rng, shape, vbuild)
    bq, bk, bv, bkw = _setup(np.random.default_rng(0), shape, bbuild)
    base_times = []

    def run_baseline():
        time.sleep(0.1)  # the same idle before the baseline's call
        t = time.perf_counter()
        fastattn.attention(bq, bk, bv, num_threads=bench_threads, **bkw)
        base_times.append(time.perf_counter() - t)
        time.sleep(0.1)  # let its spinning worker threads go idle before the timed call

    benchmark.group = group
    out = benchmark.pedantic(lambda: fastattn.attention(q, k, v, num_threads=bench_threads, **kw),
                             setup=run_baseline, rounds=7, iterations=1, warmup_rounds=1)
    err = _check(out, q, k, v, **kw)
    base_times = base_times[-7:]
    benchmark.extra_info.update(variant=vname, baseline=bname, threads=bench_threads,
                                kernel=fastattn._kernels.current_kernel(), rel_err=err,
                                baseline_min_s=min(base_times),
                                baseline_median_s=float(np.median(base_times)))
