"""``python -m fastattn.bench``: fastattn vs PyTorch SDPA vs naive NumPy, with measured ceilings.

    python -m fastattn.bench                      # full grid (a minute or two on 2 cores)
    python -m fastattn.bench --quick              # a subset (seconds)
    python -m fastattn.bench --threads 2 --json out.json --plot out.png --no-torch

Prefill rows report GFLOP/s (4*B*H*Lq*Lk*D, halved for causal) as a fraction of the
machine's FMA peak (fma_peak: independent FMA chains of the kernel fastattn runs, on the
same threads), with the sgemm (dgemm for float64) throughput as a second column: a BLAS
reaches 60-85% of the peak (OpenBLAS on Zen 3 60-74%, MKL on a Xeon 82%), so it is a
reference, not the ceiling.  Decode rows report GB/s of K/V read (k.nbytes + v.nbytes)
against a measured read bandwidth.

Ceilings are properties of the machine, so the environment must not lower them: sgemm and
dgemm are timed in a child process whose environment has the settings that make the BLAS
pick its kernels or blocking (OPENBLAS_CORETYPE, OPENBLAS_L2_SIZE, every other OPENBLAS_*
and GOTO* variable, MKL's and BLIS's instruction-set knobs) removed, with the same thread
limit.  The same products timed in this process (the BLAS that the NumPy column runs) are
kept in the JSON; the report says when they differ from the child's by more than 20%, when
such a setting is set, and when the child failed (the ceilings then come from this
process).

Every implementation runs interleaved (A, B, C, A, B, C, ...), 7 to 15 rounds, each call
after a short idle so no library's spinning worker threads share the cores with the next
one.  The table prints medians over the rounds with their interquartile range [Q1-Q3]:
fastattn's time, and each speed ratio taken round by round (the other's time / fastattn's
time in the same round, so both saw the same machine state).  A cell whose interquartile
range exceeds NOISY_SPREAD (10%) of its median is marked "~" (noisy): read it as rough.
The quartiles, unlike the range, neither grow with the number of rounds nor follow a
single hiccup of the shared machine.  Rates, % of the ceiling and the plot use the
medians; --json keeps every round's time (and the min-max ranges).

fastattn's output is checked once per shape against the float64 oracle in every batch
and head, on a sample of query rows (the first, the last and a few random ones, the
oracle computed on just those rows: check_rows); the exit code is 1 if a check fails.
"""
import argparse
import contextlib
import datetime
import json
import statistics
import subprocess  # noqa: F401 (bench.subprocess: the child process's runner, patched in tests)
import sys
import threading
import time

import numpy as np

import fastattn
from fastattn import _kernels
from fastattn._bench_machine import (KERNEL_ENV_NAMES, KERNEL_ENV_PREFIXES, NOTE_ENV_NAMES,
                                     _ceilings_child, _timed, _warm_up, blas_env_note, blas_info,
                                     blas_limit, child_ceilings, clean_env, cpu_info, gemm_gflops)
from fastattn._bench_oracle import check_rows, naive, rel_err, sample_rows
from fastattn._bench_peaks import bf16_peak, fma_peak, plan_balance, read_bandwidth
from fastattn._bench_report import (CEILING_GAP, CEILINGS, COLS, IMPLS, NOISY_SPREAD, ceiling_lines,
                                    derive, format_table, plot, progress, ratio_text, spread)

__all__ = [
    # the machine's peaks and the forward's schedule (fastattn._bench_peaks)
    "fma_peak", "read_bandwidth", "bf16_peak", "plan_balance",
    # the CPU, the BLAS and its clean child process (fastattn._bench_machine)
    "cpu_info", "blas_limit", "blas_info", "gemm_gflops", "blas_env_note", "clean_env",
    "child_ceilings",
    # the ceilings measured for the report
    "measure_ceilings", "read_gbps",
    # timing
    "grid", "run_shape", "interleaved", "RSS_CHILD_PRELUDE",
    # the oracle check (fastattn._bench_oracle)
    "naive", "sample_rows", "rel_err", "check_rows",
    # the report (fastattn._bench_report)
    "ratio_text", "spread", "derive", "ceiling_lines", "format_table", "plot", "progress",
    "main",
    # constants
    "TOL", "SCORE_LIMIT", "IMPLS", "NOISY_SPREAD", "CEILING_GAP", "CEILINGS", "COLS",
    "KERNEL_ENV_PREFIXES", "KERNEL_ENV_NAMES", "NOTE_ENV_NAMES", "SETTLE_S", "SETTLE_AFTER_NUMPY_S",
]

TOL = {"float32": 3e-5, "float64": 1e-11, "float16": 1e-4}  # by K/V dtype
SCORE_LIMIT = 2**30  # skip naive NumPy beyond a 1 GiB score matrix


def _shape(kind, L, D=None, H=None, dtype="float32", kv="float32", causal=False, series=True):
    """One benchmark shape; `series` marks the rows of the plotted sweeps."""
    d0, H, lq = (64, H or 8, L) if kind == "prefill" else (128, H or 32, 1)
    D = D or d0
    name = "".join([f"{kind} {'L' if kind == 'prefill' else 'Lk'}={L}", f" D={D}" * (D != d0),
                    " causal" * causal, " f64" * (dtype == "float64"), " f16 K/V" * (kv == "float16")])
    return dict(name=name, kind=kind, B=1, H=H, Lq=lq, Lk=L, D=D, dtype=dtype, kv_dtype=kv,
                causal=causal, series=series)


def grid(which):
    """List the benchmark's shapes.

    Parameters
    ----------
    which : {"full", "quick", "tiny"}
        "full": prefill L = 256 to 4096, causal, D=128 and float64 variants, decode
        Lk = 1024 to 8192 and a float16 K/V one; "quick" (``--quick``): a subset that
        runs in seconds; "tiny": one prefill and one decode shape (tests).  Any other
        value gives the full grid.

    Returns
    -------
    list of dict
        One dict a shape: ``name``, ``kind`` ("prefill" or "decode"), ``B``, ``H``,
        ``Lq``, ``Lk``, ``D``, ``dtype``, ``kv_dtype``, ``causal`` and ``series``
        (whether the row belongs to the plotted sweeps).

    Examples
    --------
    >>> from fastattn import bench
    >>> [s["name"] for s in bench.grid("tiny")]
    ['prefill L=64', 'decode Lk=128']
    """
    if which == "tiny":
        return [_shape("prefill", 64), _shape("decode", 128)]
    if which == "quick":
        return ([_shape("prefill", L) for L in (512, 2048)]
                + [_shape("prefill", 2048, causal=True, series=False)]
                + [_shape("decode", L) for L in (2048, 8192)])
    return ([_shape("prefill", L) for L in (256, 512, 1024, 2048, 4096)]
            + [_shape("prefill", 4096, causal=True, series=False),
               _shape("prefill", 2048, D=128, series=False),
               _shape("prefill", 2048, dtype="float64", kv="float64", series=False)]
            + [_shape("decode", L) for L in (1024, 2048, 4096, 8192)]
            + [_shape("decode", 8192, kv="float16", series=False)])


# ---------------------------------------------------------------- ceilings
def measure_ceilings(threads, n32=2048, n64=0, read_mib=256):
    """Measure the ceilings of a report.

    Parameters
    ----------
    threads : int
        Threads of every measurement.
    n32 : int, default 2048
        The sgemm's size.
    n64 : int, default 0
        The dgemm's size; 0 skips dgemm and the float64 FMA peak.
    read_mib : int, default 256
        MiB read by :func:`read_gbps`.

    Returns
    -------
    dict
        ``fma_peak_gflops`` (and ``fma_peak_f64_gflops``), ``fma_kernel``,
        ``sgemm_gflops`` (and ``dgemm_gflops``) from the clean child process of
        :func:`child_ceilings` (or, if it fails, from this process, with
        ``child_error``), ``source`` ("child" or "in-process"), ``blas``,
        ``in_process`` (the same gemms timed in this process), ``gemm_n`` and
        ``read_gbps``.
    """
    child, why = child_ceilings(threads, n32, n64)
    c = dict(gemm_n=dict(float32=n32, float64=n64 or None))
    inproc = dict(sgemm_gflops=gemm_gflops(np.float32, n32), blas=blas_info())
    if n64:
        inproc["dgemm_gflops"] = gemm_gflops(np.float64, n64)
    c["in_process"] = inproc
    src = child if child is not None else inproc
    c.update({k: src[k] for k in ("sgemm_gflops", "dgemm_gflops") if k in src})
    if child is not None:
        c.update(source="child", blas=child.get("blas"), env_removed=child["env_removed"])
    else:
        c.update(source="in-process", blas=inproc["blas"], child_error=why)
    time.sleep(SETTLE_AFTER_NUMPY_S)  # OpenBLAS's workers spin a while after a matmul
    c["fma_peak_gflops"] = fma_peak("float32", threads)
    if n64:
        c["fma_peak_f64_gflops"] = fma_peak("float64", threads)
    c["fma_kernel"] = _kernels.current_kernel()
    c["read_gbps"] = read_gbps(threads, read_mib)
    return c


def read_gbps(threads, mib=256, repeats=5):
    """Measure the read bandwidth in GB/s.

    `threads` Python threads each take ``np.max`` of their slice of one float32
    array (NumPy releases the GIL), after one warm-up pass.

    Parameters
    ----------
    threads : int
        Threads reading, each its own slice.
    mib : int, default 256
        Size of the array read, in MiB.
    repeats : int, default 5
        Timed passes; the best counts.

    Returns
    -------
    float
        Bytes read over the best pass's time, in GB/s.

    Examples
    --------
    >>> from fastattn import bench
    >>> bench.read_gbps(1, mib=1, repeats=1) > 0
    True
    """
    a = np.ones(mib * 2**20 // 4, dtype=np.float32)
    parts = np.array_split(a, threads)

    def once():
        go = threading.Barrier(len(parts) + 1)
        workers = [threading.Thread(target=lambda p=p: (go.wait(), np.max(p))) for p in parts]
        for w in workers:
            w.start()
        go.wait()
        t0 = time.perf_counter()
        for w in workers:
            w.join()
        return time.perf_counter() - t0

    once()  # warm-up
    return a.nbytes / min(once() for _ in range(repeats)) / 1e9


# ---------------------------------------------------------------- implementations
def interleaved(benchmark, ours, base, rounds):
    """Time two callables in alternation with pytest-benchmark, for bench/'s tests.

    `ours` is timed by the benchmark; `base` runs (timed here) just before every
    round with 0.1 s idle around it, so both see the same machine.

    Parameters
    ----------
    benchmark : pytest_benchmark.fixture.BenchmarkFixture
        The ``benchmark`` fixture.
    ours : callable
        Timed by the benchmark, called without arguments.
    base : callable
        The comparison, called without arguments.
    rounds : int
        Rounds of each (plus one warm-up round).

    Returns
    -------
    result : object
        What `ours` returned last.
    best : float
        `base`'s best time in seconds.
    median : float
        `base`'s median time in seconds.
    """
    import time
    times = []

    def run_base():
        time.sleep(0.1)
        t = time.perf_counter()
        base()
        times.append(time.perf_counter() - t)
        time.sleep(0.1)  # its worker threads go idle before the timed call
    res = benchmark.pedantic(ours, setup=run_base, rounds=rounds, iterations=1, warmup_rounds=1)
    times = times[-rounds:]
    return res, min(times), float(np.median(times))


# The start of a child script that measures a call's peak RSS (bench/test_memory.py,
# test_backward.py, test_stats.py): status_kib(field) reads /proc/self/status, and
# reset_peak() makes VmHWM the current RSS (clear_refs 5), since ru_maxrss would carry
# the forking parent's peak across exec.
RSS_CHILD_PRELUDE = r"""
def status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])

def reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
"""



SETTLE_S = 0.1  # idle time before each timed call (see _timed)
# ... and after NumPy's call: OpenBLAS's worker threads spin for about 0.13 s after a
# matmul here (their CPU time, read from /proc), so a call started 0.1 s after the
# naive formula shared a core with them (measured: fastattn 42 ms after it against
# 35-37 ms otherwise, B=1 H=8 L=2048 D=64).
SETTLE_AFTER_NUMPY_S = 0.3


def run_shape(sh, threads, torch=None, use_numpy=True, seed=0):
    """Time every implementation on one shape and check fastattn's output.

    The implementations run interleaved, 7 to 15 rounds (fewer for slow shapes),
    each call after an idle of ``SETTLE_S`` (``SETTLE_AFTER_NUMPY_S`` after NumPy's);
    fastattn's output is checked with :func:`check_rows`.

    Parameters
    ----------
    sh : dict
        A shape of :func:`grid`.
    threads : int
        Threads of fastattn's calls (PyTorch's are set by the caller).
    torch : module, optional
        The imported ``torch`` module to time its SDPA; None skips it.
    use_numpy : bool, default True
        Time :func:`naive` too (skipped beyond a ``SCORE_LIMIT``-byte score matrix).
    seed : int, default 0
        Seed of the random inputs and the checked rows.

    Returns
    -------
    dict
        The shape's keys plus ``flops``, ``bytes`` (of K and V), ``rounds``,
        ``rel_err``, ``tol``, ``check_ok``, ``checked_rows``, ``score_bytes`` and,
        per implementation, its ``best_ms``, ``median_ms`` and ``times_ms`` (None
        where it did not run).

    Examples
    --------
    >>> from fastattn import bench
    >>> row = bench.run_shape(bench.grid("tiny")[0], 1)
    >>> row["check_ok"], row["torch"], len(row["fastattn"]["times_ms"]) == row["rounds"]
    (True, None, True)
    """
    rng = np.random.default_rng(seed)
    qs, ks = (sh["B"], sh["H"], sh["Lq"], sh["D"]), (sh["B"], sh["H"], sh["Lk"], sh["D"])
    q = rng.standard_normal(qs).astype(sh["dtype"])
    k, v = (rng.standard_normal(ks).astype(sh["kv_dtype"]) for _ in range(2))
    scale, causal = 1.0 / np.sqrt(sh["D"]), sh["causal"]
    fns = {"fastattn": lambda: fastattn.attention(q, k, v, causal=causal, num_threads=threads)}
    if torch is not None:
        tdt = torch.float16 if sh["kv_dtype"] == "float16" else None  # SDPA needs one dtype
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        tq = tq.to(tdt) if tdt else tq
        sdpa = torch.nn.functional.scaled_dot_product_attention
        fns["torch"] = lambda: sdpa(tq, tk, tv, is_causal=causal)
    score_bytes = sh["B"] * sh["H"] * sh["Lq"] * sh["Lk"] * q.itemsize
    if use_numpy and score_bytes <= SCORE_LIMIT:
        fns["numpy"] = lambda: naive(q, k, v, scale, causal)
    ctx = torch.inference_mode() if torch is not None else contextlib.nullcontext()
    with ctx:
        out = fns["fastattn"]()  # the result checked below
        warm = max(_warm_up(f) for f in fns.values())
        # a noisy shared machine: enough rounds for a median and a range that mean something
        rounds = 7 if warm > 0.2 else 9 if warm > 0.02 else 15
        times = {name: [] for name in fns}
        prev = list(fns)[-1]  # the warm-up's last call
        for _ in range(rounds):
            for name, f in fns.items():
                times[name].append(_timed(f, SETTLE_AFTER_NUMPY_S if prev == "numpy" else SETTLE_S))
                prev = name
    rows = sample_rows(sh["Lq"], seed=seed)
    err = check_rows(out, q, k, v, rows, causal=causal)  # every batch and head
    tol = TOL[sh["kv_dtype"]]
    flops = 4.0 * sh["B"] * sh["H"] * sh["Lq"] * sh["Lk"] * sh["D"] * (0.5 if causal else 1.0)
    row = dict(sh, flops=flops, bytes=k.nbytes + v.nbytes, rounds=rounds, rel_err=err, tol=tol,
               check_ok=bool(err <= tol), checked_rows=rows.tolist(), score_bytes=score_bytes)
    for name in IMPLS:
        t = times.get(name)
        row[name] = dict(best_ms=min(t) * 1e3, median_ms=statistics.median(t) * 1e3,
                         times_ms=[x * 1e3 for x in t]) if t else None
    return row


def main(argv=None):
    """Run ``python -m fastattn.bench``: measure, print the report, write JSON and plot.

    Parameters
    ----------
    argv : sequence of str, optional
        The command-line arguments; default ``sys.argv[1:]``.  ``--quick``,
        ``--threads N``, ``--json FILE``, ``--plot FILE.png``, ``--no-torch``,
        ``--no-numpy`` (``python -m fastattn.bench --help`` describes them).

    Returns
    -------
    int
        The exit status: 0, or 1 if fastattn's output failed the oracle check on
        some shape.

    Raises
    ------
    SystemExit
        From argparse for bad options, and from :func:`plot` without matplotlib.
    """
    p = argparse.ArgumentParser(prog="python -m fastattn.bench", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a subset of the grid (seconds)")
    p.add_argument("--threads", type=int, default=_kernels.max_threads(),
                   help="threads for every implementation (default: fastattn's, %(default)s)")
    p.add_argument("--json", metavar="FILE", help="write everything measured to FILE")
    p.add_argument("--plot", metavar="FILE.png", help="throughput plot (needs matplotlib)")
    p.add_argument("--no-torch", action="store_true", help="skip PyTorch SDPA")
    p.add_argument("--no-numpy", action="store_true", help="skip the naive NumPy formula")
    p.add_argument("--shapes", choices=("full", "quick", "tiny"), help=argparse.SUPPRESS)
    p.add_argument("--_ceilings", metavar="THREADS,N32,N64", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a._ceilings:  # the child process of child_ceilings
        return _ceilings_child(a._ceilings)
    if a.threads < 1:
        p.error("--threads must be >= 1")
    shapes = grid(a.shapes or ("quick" if a.quick else "full"))
    torch = None
    if not a.no_torch:
        with contextlib.suppress(ImportError):
            import torch
            torch.set_num_threads(a.threads)
    cfg = fastattn._config.config()
    cpu, flags = cpu_info()
    result = dict(
        date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        machine=dict(cpu=cpu, cpu_flags=flags, arch=cfg["machine"], kernel=cfg["kernel"],
                     kernel_reason=cfg["kernel_reason"], kernels_supported=cfg["kernels_supported"],
                     threads=a.threads, l2_bytes=cfg["l2_bytes"], openmp=cfg["openmp"],
                     build=cfg["build"]),
        versions=dict(fastattn=cfg["fastattn"], python=cfg["python"], numpy=cfg["numpy"],
                      torch=torch.__version__ if torch is not None else None),
        env_note=blas_env_note(), ceilings={}, rows=[])
    tiny = a.shapes == "tiny"
    n = len(shapes) + 1
    with blas_limit(a.threads):
        progress(0, n, "ceilings (FMA peak, sgemm, read bandwidth)")
        f64 = any(s["dtype"] == "float64" for s in shapes)
        c = result["ceilings"] = measure_ceilings(
            a.threads, n32=512 if tiny else 2048, n64=(512 if tiny else 2048) if f64 else 0,
            read_mib=16 if tiny else 256)
        for i, sh in enumerate(shapes, 1):
            progress(i, n, sh["name"])  # i steps done (the ceilings count as one)
            row = run_shape(sh, a.threads, torch, not a.no_numpy)
            row["derived"] = derive(row, c)
            result["rows"].append(row)
        progress(n, n, "done")
    print(format_table(result))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    if a.plot:
        plot(result, a.plot)
    return 0 if all(r["check_ok"] for r in result["rows"]) else 1


# the re-exported functions are documented, pickled and shown as fastattn.bench's
for _f in (cpu_info, blas_limit, blas_info, gemm_gflops, blas_env_note, clean_env, child_ceilings,
           fma_peak, bf16_peak, plan_balance, naive, sample_rows, rel_err, check_rows, ratio_text,
           spread, derive, ceiling_lines, format_table, plot, progress):
    _f.__module__ = "fastattn.bench"
del _f

if __name__ == "__main__":
    sys.exit(main())
