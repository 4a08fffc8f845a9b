"""Shared set-up for the pytest-benchmark suites in bench/.

Run:
    pytest bench/ --benchmark-group-by=group --benchmark-columns=min,median   # timings
    pytest bench/ --benchmark-disable                                       # quick correctness run

Every implementation (fastattn, NumPy, PyTorch) runs with the same number of threads,
``--bench-threads`` (default 2, or $FASTATTN_BENCH_THREADS): fastattn through
``num_threads=``, NumPy's BLAS through threadpoolctl (if installed), PyTorch through
``torch.set_num_threads``.

Every benchmark checks its result once against ``fastattn.reference`` in every batch and
head, on a sample of query rows (``check_rows``: the first, the last and a few random
ones, the oracle computed on just those rows), or on the whole output for small shapes.

The summary quotes every GFLOP/s as a % of the machine's FMA peak
(``fastattn.bench.fma_peak``: independent FMA chains, nothing else in the loop), measured
at the start and at the end of the session on the same threads and kernel, the higher of
the two.  The sgemm stays as a second column: it is measured in a child process without the settings that make OpenBLAS pick slower kernels
(``fastattn.bench.child_ceilings``); the header says when such a setting
(OPENBLAS_CORETYPE, OPENBLAS_L2_SIZE) is set.
"""
import contextlib
import os

import numpy as np
import pytest

import fastattn
from fastattn import bench as _bench

# float32 results are checked against the float64 oracle to this relative error
# (max |err| / max |ref|), float64 results to 1e-11.
TOL = {np.dtype(np.float32): 3e-5, np.dtype(np.float64): 1e-11}


def pytest_report_header(config):
    """A note when the environment makes NumPy's BLAS run kernels it chose for it."""
    note = _bench.blas_env_note()
    return [note] if note else []


def pytest_addoption(parser):
    parser.addoption("--bench-threads", type=int,
                     default=int(os.environ.get("FASTATTN_BENCH_THREADS", "2")),
                     help="threads for every implementation benchmarked in bench/ (default 2)")


@pytest.fixture(scope="session")
def bench_threads(request):
    """The thread count; also caps NumPy's BLAS pool to it for the whole session."""
    n = request.config.getoption("--bench-threads")
    if n < 1:
        raise pytest.UsageError("--bench-threads must be >= 1")
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield n
        return
    with threadpool_limits(limits=n, user_api="blas"):
        yield n


@pytest.fixture
def record(benchmark, bench_threads):
    """record(flops, **info): store kernel, threads, flops (and gflops from the best round
    when the benchmark actually ran) in benchmark.extra_info. Call it after benchmark()."""
    def _record(flops=None, **info):
        extra = benchmark.extra_info
        extra["kernel"] = fastattn._kernels.current_kernel()
        extra["threads"] = bench_threads
        extra.update(info)
        if flops is not None:
            extra["flops"] = float(flops)
            stats = getattr(benchmark, "stats", None)
            if stats is not None and stats.stats.min > 0:
                extra["gflops"] = round(flops / stats.stats.min / 1e9, 2)
        return extra
    return _record


@pytest.fixture(scope="session")
def read_bandwidth(bench_threads):
    """read_bandwidth(nbytes) -> bytes/s: the best of several multi-threaded reductions
    over a float32 array of nbytes (one np.max per thread, each over its own slice;
    NumPy releases the GIL in them): the memory-read ceiling for decoding.  np.max,
    not np.sum: NumPy's pairwise float sum is compute-bound at ~60% of the bandwidth
    here, while max runs at the speed of the reads (as fast as PyTorch's sum)."""
    from concurrent.futures import ThreadPoolExecutor
    import time
    cache = {}

    def measure(nbytes):
        if nbytes not in cache:
            a = np.ones(nbytes // 4, dtype=np.float32)
            parts = np.array_split(a, bench_threads)
            with ThreadPoolExecutor(bench_threads) as ex:
                best = float("inf")
                for _ in range(7):
                    t = time.perf_counter()
                    list(ex.map(np.max, parts))
                    best = min(best, time.perf_counter() - t)
            cache[nbytes] = a.nbytes / best
        return cache[nbytes]
    return measure


rel_err = _bench.rel_err  # max |out - ref| / max |ref|, in float64


@pytest.fixture(scope="session")
def check_close():
    """check_close(out, ref, dtype) -> rel err; asserts it is within TOL[dtype]."""
    def _check(out, ref, dtype):
        err = rel_err(out, ref)
        tol = TOL[np.dtype(dtype)]
        assert err <= tol, f"rel err {err:.3e} > {tol:.0e}"
        return err
    return _check


@pytest.fixture(scope="session")
def check_rows():
    """check_rows(out, q, k, v, tol=..., **attention keywords) -> rel err:
    fastattn.bench.check_rows (sampled query rows of every batch and head against the
    oracle on just those rows); asserts it is within tol."""
    def _check(out, q, k, v, *, tol, **kw):
        err = _bench.check_rows(out, q, k, v, **kw)
        assert err <= tol, f"rel err {err:.3e} > {tol:.0e} (sampled rows of every batch and head)"
        return err
    return _check


def _rows(benchmarks):
    """{group: {impl: (seconds_min, extra_info)}} from this session's benchmarks."""
    rows = {}
    for bm in benchmarks:
        info = getattr(bm, "extra_info", {}) or {}
        stats = getattr(bm, "stats", None)
        if stats is None or "impl" not in info or "flops" not in info:
            continue  # e.g. the memory benchmarks, which measure RSS, not throughput
        rows.setdefault(bm.group, {})[info["impl"]] = (stats.min, info)
    return rows


_PEAKS = {}


def pytest_sessionstart(session):
    """The FMA peaks at the start of the session (the summary measures them again);
    not with --benchmark-disable, which prints no summary."""
    n = session.config.getoption("--bench-threads")
    if n >= 1 and not session.config.getoption("benchmark_disable", False):
        for dt in ("float32", "float64"):
            _PEAKS[dt] = [_bench.fma_peak(dt, n)]


def fma_peak(config, dtype="float32"):
    """The FMA peak (GFLOP/s) on --bench-threads threads: the higher of the session's
    start and its end (this shared machine's speed drifts by 20-30% over minutes; a
    fraction of a peak measured at a slow moment would flatter the kernels)."""
    got = _PEAKS.setdefault(dtype, [])
    if len(got) < 2:
        got.append(_bench.fma_peak(dtype, config.getoption("--bench-threads")))
    return max(got)


def pytest_terminal_summary(terminalreporter, config):
    """The table the closing notes quote: GFLOP/s of each implementation, fastattn's
    % of the FMA peak and of the sgemm throughput measured in the same session, and its
    speed ratio to PyTorch and NumPy (best of the rounds each)."""
    session = getattr(config, "_benchmarksession", None)
    if session is None or getattr(session, "disabled", True):
        return
    _variant_summary(terminalreporter, session.benchmarks)
    _decode_summary(terminalreporter, session.benchmarks)
    _interleaved_summary(terminalreporter, session.benchmarks, config)
    _backward_summary(terminalreporter, session.benchmarks, config)
    _stats_summary(terminalreporter, session.benchmarks)
    _bf16_summary(terminalreporter, session.benchmarks)
    rows = _rows(session.benchmarks)
    sgemm = rows.pop("sgemm", {}).get("numpy sgemm")
    sgemm_np = sgemm[1]["flops"] / sgemm[0] / 1e9 if sgemm else None
    # the ceiling: the clean child's sgemm when it ran, else NumPy's in this process
    sgemm_gf = (sgemm[1].get("clean_gflops") or sgemm_np) if sgemm else None
    if not rows:
        return
    w = terminalreporter.write_line
    w("")
    ceiling = ""
    if sgemm and sgemm[1].get("clean_gflops"):
        removed = ", ".join(sgemm[1]["env_removed"])
        ceiling = (f", sgemm ceiling {sgemm_gf:.0f} GFLOP/s (in a child process"
                   f"{' without ' + removed if removed else ''}; NumPy's in this process "
                   f"{sgemm_np:.0f})")
    elif sgemm:
        ceiling = f", NumPy sgemm {sgemm_gf:.0f} GFLOP/s" + (
            f" (in this process: the child failed: {sgemm[1]['child_error']})"
            if sgemm[1].get("child_error") else "")
    peak = {dt: fma_peak(config, dt) for dt in ("float32", "float64")}
    w(f"fastattn vs peers, GFLOP/s (best round), threads={config.getoption('--bench-threads')}, "
      f"kernel={fastattn._kernels.current_kernel()}, FMA peak {peak['float32']:.0f} GFLOP/s "
      f"(float64 {peak['float64']:.0f})" + ceiling)
    w(f"{'shape':<34} {'fastattn':>9} {'1 thread':>9} {'PyTorch':>8} {'NumPy':>8} "
      f"{'%peak':>6} {'%sgemm':>7} {'vs torch':>9} {'vs numpy':>9} {'2t/1t':>6}")
    for group, impls in rows.items():
        fa = impls.get("fastattn")
        if fa is None:
            continue
        gf = {name: info["flops"] / t / 1e9 for name, (t, info) in impls.items()}

        def cell(name, width):
            return f"{gf[name]:>{width}.1f}" if name in gf else f"{'-':>{width}}"

        def ratio(name):
            return f"{impls[name][0] / fa[0]:>8.2f}x" if name in impls else f"{'-':>9}"
        pct = f"{100 * gf['fastattn'] / sgemm_gf:>6.0f}%" if sgemm_gf else f"{'-':>7}"
        f64 = fa[1].get("dtype") == "float64"
        pk = f"{100 * gf['fastattn'] / peak['float64' if f64 else 'float32']:>5.0f}%"
        scale = (f"{impls['fastattn-1t'][0] / fa[0]:>5.2f}x" if "fastattn-1t" in impls
                 else f"{'-':>6}")
        w(f"{group:<34} {cell('fastattn', 9)} {cell('fastattn-1t', 9)} {cell('torch', 8)} "
          f"{cell('numpy', 8)} {pk} {pct} {ratio('torch')} {ratio('numpy')} {scale}")


def _variant_summary(terminalreporter, benchmarks):
    """Each variant's time over its baseline's, measured interleaved (bench/test_variants.py)."""
    rows = [(bm.group, bm.extra_info, bm.stats) for bm in benchmarks
            if "variant" in (getattr(bm, "extra_info", {}) or {}) and getattr(bm, "stats", None)]
    if not rows:
        return
    w = terminalreporter.write_line
    w("")
    w("variants vs their baseline, run interleaved (time ratio: best rounds / median rounds):")
    for group, info, st in rows:
        w(f"  {group:<36} {info['variant']} / {info['baseline']}: "
          f"{st.min / info['baseline_min_s']:.3f}x / {st.median / info['baseline_median_s']:.3f}x")


def _decode_summary(terminalreporter, benchmarks):
    """Decode: GB/s of K/V read, % of the measured read bandwidth, speed-up over the
    baseline measured interleaved (bench/test_decode.py)."""
    rows = [(bm.extra_info, bm.stats) for bm in benchmarks
            if "decode" in (getattr(bm, "extra_info", {}) or {}) and getattr(bm, "stats", None)]
    if not rows:
        return
    w = terminalreporter.write_line
    w("")
    w(f"decode (threads={rows[0][0]['threads']}, kernel={rows[0][0]['kernel']}): "
      "ms best, GB/s, % of read bandwidth, speed-up over the baseline (best / median)")
    for info, st in rows:
        gbps = info["kv_bytes"] / st.min / 1e9
        w(f"  {info['decode']:<34} {st.min * 1e3:7.2f} ms {gbps:6.1f} GB/s "
          f"{100 * gbps / info['read_bandwidth_gbps']:4.0f}%   vs {info['baseline']:<16} "
          f"{info['baseline_min_s'] / st.min:5.2f}x / {info['baseline_median_s'] / st.median:5.2f}x")


def _interleaved_summary(terminalreporter, benchmarks, config):
    """Prefill against a baseline timed just before each round (bench/test_prefill.py,
    test_prefill_interleaved): baseline time / fastattn time, best and median rounds."""
    rows = [(bm.extra_info, bm.stats) for bm in benchmarks
            if "interleaved" in (getattr(bm, "extra_info", {}) or {}) and getattr(bm, "stats", None)]
    if not rows:
        return
    w = terminalreporter.write_line
    w("")
    w(f"prefill, interleaved with its baseline (threads={rows[0][0]['threads']}, "
      f"kernel={rows[0][0]['kernel']}): fastattn GFLOP/s and % of the FMA peak "
      f"({fma_peak(config):.0f} GFLOP/s), baseline time / fastattn time (best / median rounds)")
    for info, st in rows:
        w(f"  {info['interleaved']:<38} {info['gflops']:6.1f} GFLOP/s "
          f"{100 * info['gflops'] / fma_peak(config, info.get('dtype', 'float32')):3.0f}%   "
          f"{info['baseline_min_s'] / st.min:5.2f}x / {info['baseline_median_s'] / st.median:5.2f}x")


def _backward_summary(terminalreporter, benchmarks, config):
    """Gradients against PyTorch's backward, interleaved (bench/test_backward.py):
    PyTorch time / fastattn time (best / median rounds), and for the backward alone its
    GFLOP/s (10·B·H·L²·D, halved for causal), % of the FMA peak and % of the sgemm of
    this run."""
    rows = [(bm.extra_info, bm.stats) for bm in benchmarks
            if "backward" in (getattr(bm, "extra_info", {}) or {}) and getattr(bm, "stats", None)]
    if not rows:
        return
    sgemm = [bm for bm in benchmarks if bm.group == "sgemm" and getattr(bm, "stats", None)]
    sgemm_gf = None
    if sgemm:
        info = sgemm[0].extra_info
        sgemm_gf = info.get("clean_gflops") or info["flops"] / sgemm[0].stats.min / 1e9
    w = terminalreporter.write_line
    w("")
    w(f"gradients vs PyTorch, interleaved (threads={rows[0][0]['threads']}, "
      f"kernel={rows[0][0]['kernel']}): PyTorch time / fastattn time (best / median), "
      f"backward GFLOP/s, % of the FMA peak ({fma_peak(config):.0f} GFLOP/s)"
      + (f" and % of sgemm ({sgemm_gf:.0f} GFLOP/s)" if sgemm_gf else ""))
    for info, st in rows:
        line = (f"  {info['backward']:<34} {info['baseline_min_s'] / st.min:5.2f}x / "
                f"{info['baseline_median_s'] / st.median:5.2f}x")
        if info["what"] == "bwd":
            gf = info["bwd_flops"] / st.min / 1e9
            line += (f"   {gf:6.1f} GFLOP/s {100 * gf / fma_peak(config):4.0f}% peak"
                     + (f" {100 * gf / sgemm_gf:4.0f}% sgemm" if sgemm_gf else ""))
        w(line)


def _stats_summary(terminalreporter, benchmarks):
    """return_stats / key_mass time over the plain call's, interleaved (bench/test_stats.py)."""
    rows = [(bm.extra_info, bm.stats) for bm in benchmarks
            if "stats_case" in (getattr(bm, "extra_info", {}) or {}) and getattr(bm, "stats", None)]
    if not rows:
        return
    w = terminalreporter.write_line
    w("")
    w(f"statistics vs the plain call, interleaved (threads={rows[0][0]['threads']}, "
      f"kernel={rows[0][0]['kernel']}): time / plain time (best / median rounds); "
      "need <= 1.05 (return_stats), <= 1.6 (key_mass)")
    for info, st in rows:
        w(f"  {info['stats_case']:<40} {st.min / info['baseline_min_s']:5.3f}x / "
          f"{st.median / info['baseline_median_s']:5.3f}x")


def _bf16_summary(terminalreporter, benchmarks):
    """bfloat16 and seqlens_k cases (bench/test_bf16.py): baseline time / fastattn time."""
    rows = [(bm.extra_info, bm.stats) for bm in benchmarks
            if "bf16_case" in (getattr(bm, "extra_info", {}) or {}) and getattr(bm, "stats", None)]
    if not rows:
        return
    # the pair peak: the highest of the cases' measurements (this shared machine's speed
    # drifts; a fraction of a peak taken at a slow moment would flatter the kernel)
    peaks = [info["pair_peak_gflops"] for info, _ in rows if info.get("pair_peak_gflops")]
    peak = max(peaks) if peaks else None
    w = terminalreporter.write_line
    w("")
    w(f"bfloat16 and seqlens_k, interleaved (threads={rows[0][0]['threads']}, "
      f"kernel={rows[0][0]['kernel']}, bfloat16 path="
      f"{next((i['bf16_path'] for i, _ in rows if i.get('bf16_path') not in (None, 'float32')), 'float32')}): "
      "baseline time / fastattn time (best / median rounds)")
    for info, st in rows:
        extra = ""
        if info.get("gflops"):
            extra = f"   {info['gflops']:.1f} GFLOP/s"
            if peak and info.get("pair_peak_gflops"):
                extra += f", {100 * info['gflops'] / peak:.0f}% of the {info['bf16_path']} peak {peak:.0f}"
        if info.get("gbps"):
            extra = (f"   {info['gbps']:.1f} GB/s, {100 * info['gbps'] / info['read_bandwidth_gbps']:.0f}% "
                     "of the read bandwidth")
        if info.get("bytes_ratio"):
            extra = f"   (time ratio {st.min / info['baseline_min_s']:.2f}, bytes ratio {info['bytes_ratio']:.2f})"
        w(f"  {info['bf16_case']:<52} {info['baseline_min_s'] / st.min:5.2f}x / "
          f"{info['baseline_median_s'] / st.median:5.2f}x{extra}")


@pytest.fixture(scope="module")
def summary(request):
    """Rows for a table printed at the end of a module whose benchmarks ran (none with
    --benchmark-disable); the module's ``summary_header()`` gives its first line."""
    rows = []
    yield rows
    plugins = request.config.pluginmanager
    tr, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    if not rows or tr is None:
        return
    lines = ["", request.module.summary_header()] + ["  " + line for line in rows]
    # a fixture's teardown runs under output capture: write past it
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        for line in lines:
            tr.write_line(line)
