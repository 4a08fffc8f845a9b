"""fastattn.dask on a local cluster against fastattn.attention in one process.

Three measurements (each run interleaved with its baseline, best and median of the
rounds; the summary lines are printed at the end of the module and kept in
``benchmark.extra_info``):

- **overhead**: ``fastattn.dask.attention`` on a cluster of 2 worker processes of one
  thread each (``LocalCluster(n_workers=2, threads_per_worker=1)``), keys sharded into
  chunks and merged, against ``fastattn.attention(num_threads=2)`` in this process on
  the same data.  The inputs are already on the workers (persisted before timing), the
  result stays there (``persist`` + ``wait``), as in a pipeline whose data lives on the
  cluster; the time to gather the result to the client is reported beside it.
- **time split**: one more run under ``distributed.get_task_stream``: the seconds the
  workers spent computing blocks, merging partials, and transferring data between
  workers (the scheduler's task stream), and what the rest of the wall time was.
- **1 -> 2 workers**: the same compute-bound graph (head and query chunks, keys whole:
  no merge) on a 1-worker and a 2-worker cluster.

The large target case, B=1 H=8 L=131072 D=64 float32, is 3.5e13 flop: about 6 minutes
per run on 2 cores, so a few interleaved rounds of it take most of an hour.  The default
here is L=16384 (5.5e11 flop, ~5 s per run on the 2-core benchmark machine); set
FASTATTN_BENCH_DASK_L=131072 (and a long timeout) for that size (measured once, with
other jobs on the machine: 594 s against 501 s, +18%).  Key chunks are L/4 (4 chunks,
16 blocks) at any L.  With ``--benchmark-disable`` (CI's correctness run)
every case runs once at L=1024, H=2, and checks its result.
"""
import os
import time

import numpy as np
import pytest

dask = pytest.importorskip("dask")
distributed = pytest.importorskip("distributed")
import dask.array as da  # noqa: E402

import fastattn  # noqa: E402
import fastattn.dask as fdask  # noqa: E402

TOL = 3e-5
SUMMARY = []


def _sizes(benchmark):
    if benchmark.disabled:
        return 1, 2, 1024, 32
    return 1, 8, int(os.environ.get("FASTATTN_BENCH_DASK_L", "16384")), 64


def _cluster(n):
    return distributed.LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                                    host="127.0.0.1", dashboard_address=None)


class _Summary:
    """A plugin registered by the client2 fixture: the lines of SUMMARY at the end of the
    session, beside the other suites' summaries."""

    def pytest_terminal_summary(self, terminalreporter):
        if not SUMMARY:
            return
        w = terminalreporter.write_line
        w("")
        w("fastattn.dask on a LocalCluster (1-thread workers) vs fastattn.attention in one "
          f"process; kernel={fastattn._kernels.current_kernel()}:")
        for line in SUMMARY:
            w("  " + line)


@pytest.fixture(scope="module")
def client2(request):
    if not request.config.pluginmanager.has_plugin("fastattn-dask-summary"):
        request.config.pluginmanager.register(_Summary(), "fastattn-dask-summary")
    with _cluster(2) as cluster, distributed.Client(cluster, set_as_default=False) as c:
        yield c


def _inputs(b, h, l, d, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((b, h, l, d), dtype=np.float32) for _ in range(3))


def _on_cluster(client, arrays, chunks):
    """The arrays as dask arrays whose chunks are already held by the workers, scattered
    (not embedded in a graph): chunk n of every array on worker n mod the worker count,
    so the k and v chunks of one key range (and q's chunk of the same index) share a
    worker, as in a KV cache sharded by position."""
    workers = sorted(client.scheduler_info()["workers"])
    out = []
    for a, ch in zip(arrays, chunks):
        x = da.from_array(a, chunks=ch)
        index = list(np.ndindex(*x.numblocks))
        blocks = np.empty(x.numblocks, dtype=object)
        for n, ix in enumerate(index):
            s = tuple(slice(sum(c[:i]), sum(c[:i + 1])) for c, i in zip(x.chunks, ix))
            f = client.scatter(np.ascontiguousarray(a[s]), workers=[workers[n % len(workers)]])
            blocks[ix] = da.from_delayed(f, tuple(sl.stop - sl.start for sl in s), a.dtype)
        out.append(da.block(blocks.tolist()))
    return out


HELD = []


def _run(client, lazy):
    """Compute on the cluster, keep the result there; returns the persisted array.  The
    graph's keys are the same every round (fastattn.dask names them from its inputs),
    so the previous round's result must be gone first (_forget), or it is reused."""
    res = client.persist(lazy)
    with client.as_current():
        distributed.wait(res)
    HELD.append((client, [f.key for f in distributed.futures_of(res)]))
    return res


def _forget():
    """Wait until the scheduler has released every result _run returned before."""
    while HELD:
        client, keys = HELD.pop()
        for _ in range(200):
            left = client.run_on_scheduler(
                lambda dask_scheduler, keys=keys: sum(k in dask_scheduler.tasks for k in keys))
            if not left:
                break
            time.sleep(0.05)


def _split(records, wall):
    """Seconds of compute (by kind of task), transfer and the rest, from a task stream."""
    out = {"block": 0.0, "merge": 0.0, "other compute": 0.0, "transfer": 0.0}
    for r in records:
        name = r["key"][0] if isinstance(r["key"], tuple) else str(r["key"])
        for ss in r["startstops"]:
            dt = ss["stop"] - ss["start"]
            if ss["action"] == "compute":
                kind = ("block" if "fastattn-block" in name else
                        "merge" if "fastattn-merge" in name else "other compute")
                out[kind] += dt
            elif ss["action"] == "transfer":
                out["transfer"] += dt
    out["wall"] = wall
    return out


def test_dask_overhead(benchmark, bench_threads, check_rows, client2):
    b, h, l, d = _sizes(benchmark)
    c = l // 4
    q, k, v = _inputs(b, h, l, d)
    qd, kd, vd = _on_cluster(client2, (q, k, v), [(1, h, c, d)] * 3)

    def lazy():
        return fdask.attention(qd, kd, vd)

    base_times = []

    last = {}

    def timed():
        last["res"] = _run(client2, lazy())

    def run_baseline():
        last.clear()
        _forget()
        time.sleep(0.1)
        t = time.perf_counter()
        fastattn.attention(q, k, v, num_threads=bench_threads)
        base_times.append(time.perf_counter() - t)
        time.sleep(0.1)

    rounds = 1 if benchmark.disabled else 3
    benchmark.group = f"dask B{b} H{h} L{l} D{d} keys in 4 chunks"
    benchmark.pedantic(timed, setup=run_baseline, rounds=rounds, iterations=1,
                       warmup_rounds=0 if benchmark.disabled else 1)
    t = time.perf_counter()
    out = client2.compute(last["res"], sync=True)
    gather = time.perf_counter() - t
    err = check_rows(out, q, k, v, tol=TOL)
    last.clear()
    _forget()
    with distributed.get_task_stream(client2) as ts:
        t = time.perf_counter()
        _run(client2, lazy())
        wall = time.perf_counter() - t
    split = _split(ts.data, wall)
    if benchmark.disabled:
        return
    st = benchmark.stats.stats
    base_min, base_med = min(base_times[-rounds:]), float(np.median(base_times[-rounds:]))
    flops = 4.0 * b * h * l * l * d
    benchmark.extra_info.update(dask_min_s=st.min, dask_median_s=st.median,
                                local_min_s=base_min, local_median_s=base_med,
                                overhead_min=st.min / base_min - 1,
                                overhead_median=st.median / base_med - 1,
                                gather_s=gather, split=split, rel_err=err,
                                gflops_dask=flops / st.min / 1e9, threads=bench_threads)
    busy = 2 * wall
    idle = busy - split["block"] - split["merge"] - split["other compute"]
    SUMMARY.append(f"B{b} H{h} L{l} D{d} float32, keys in 4 chunks (16 blocks, 4 merges of 4): "
                   f"dask 2 workers {st.min:.2f} s (median {st.median:.2f}), one process "
                   f"{bench_threads} threads {base_min:.2f} s (median {base_med:.2f}): overhead "
                   f"{100 * (st.min / base_min - 1):+.0f}% best, "
                   f"{100 * (st.median / base_med - 1):+.0f}% median; gathering the "
                   f"{out.nbytes / 1e6:.0f} MB result to the client {gather:.2f} s more")
    SUMMARY.append(f"  task stream of one run ({wall:.2f} s wall, {busy:.2f} worker-s): blocks "
                   f"{split['block']:.2f} s, merges {split['merge']:.2f} s, transfers "
                   f"{split['transfer']:.2f} s, other tasks {split['other compute']:.2f} s, "
                   f"idle/scheduling {idle:.2f} worker-s")


def test_dask_one_to_two_workers(benchmark, check_rows, client2):
    b, h, l, d = _sizes(benchmark)
    q, k, v = _inputs(b, h, l, d, seed=1)
    hc = max(1, h // 4)   # 16 blocks of (heads, queries); keys whole: no merge
    chunks = [(1, hc, l // 4, d), (1, hc, l, d), (1, hc, l, d)]
    with _cluster(1) as cluster, distributed.Client(cluster, set_as_default=False) as client1:
        d2 = _on_cluster(client2, (q, k, v), chunks)
        d1 = _on_cluster(client1, (q, k, v), chunks)
        one_times = []

        last = {}

        def timed():
            last["res"] = _run(client2, fdask.attention(*d2))

        def run_one():
            last.clear()
            _forget()
            time.sleep(0.1)
            t = time.perf_counter()
            _run(client1, fdask.attention(*d1))
            one_times.append(time.perf_counter() - t)
            _forget()
            time.sleep(0.1)

        rounds = 1 if benchmark.disabled else 3
        benchmark.group = f"dask B{b} H{h} L{l} D{d} 1 vs 2 workers"
        benchmark.pedantic(timed, setup=run_one, rounds=rounds, iterations=1,
                           warmup_rounds=0 if benchmark.disabled else 1)
        out = client2.compute(last["res"], sync=True)
        last.clear()
        _forget()
    check_rows(out, q, k, v, tol=TOL)
    if benchmark.disabled:
        return
    st = benchmark.stats.stats
    one_min, one_med = min(one_times[-rounds:]), float(np.median(one_times[-rounds:]))
    benchmark.extra_info.update(one_worker_min_s=one_min, one_worker_median_s=one_med,
                                speedup_min=one_min / st.min, speedup_median=one_med / st.median)
    SUMMARY.append(f"B{b} H{h} L{l} D{d} float32, 16 blocks (head x query chunks, keys whole): "
                   f"1 worker {one_min:.2f} s, 2 workers {st.min:.2f} s: speed-up "
                   f"{one_min / st.min:.2f}x best, {one_med / st.median:.2f}x median")


def test_dask_decode_sharded_cache(benchmark, bench_threads, check_rows, client2):
    """One decode step (Lq=1, B=1 H=32 D=128) against a cache sharded in 4 key chunks
    on the workers, against fastattn.attention on the whole cache in this process: the
    latency a sharded cache adds (scheduling and 4 partials merged)."""
    lk = 4096 if benchmark.disabled else 16384
    rng = np.random.default_rng(2)
    k, v = (rng.standard_normal((1, 32, lk, 128), dtype=np.float32) for _ in range(2))
    q = rng.standard_normal((1, 32, 1, 128), dtype=np.float32)
    kd, vd = _on_cluster(client2, (k, v), [(1, 32, lk // 4, 128)] * 2)
    base_times = []

    def run_baseline():
        t = time.perf_counter()
        fastattn.attention(q, k, v, causal=True, num_threads=bench_threads)
        base_times.append(time.perf_counter() - t)

    rounds = 1 if benchmark.disabled else 9
    benchmark.group = f"dask decode B1 H32 Lk{lk} D128 cache in 4 chunks"
    out = benchmark.pedantic(lambda: client2.compute(fdask.attention(q, kd, vd, causal=True),
                                                     sync=True),
                             setup=run_baseline, rounds=rounds, iterations=1,
                             warmup_rounds=0 if benchmark.disabled else 1)
    check_rows(out, q, k, v, causal=True, tol=TOL)
    if benchmark.disabled:
        return
    st = benchmark.stats.stats
    SUMMARY.append(f"decode B1 H32 Lq1 Lk{lk} D128, cache in 4 chunks on 2 workers: "
                   f"{1e3 * st.min:.1f} ms (median {1e3 * st.median:.1f}) against "
                   f"{1e3 * min(base_times[-rounds:]):.1f} ms for fastattn.attention in one "
                   f"process (whole cache, {bench_threads} threads)")
