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
import os
import platform
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

import fastattn
from fastattn import _kernels, reference
from fastattn._scalars import parse_causal, parse_threads, parse_window

TOL = {"float32": 3e-5, "float64": 1e-11, "float16": 1e-4}  # by K/V dtype
SCORE_LIMIT = 2**30  # skip naive NumPy beyond a 1 GiB score matrix
IMPLS = ("fastattn", "torch", "numpy")
NOISY_SPREAD = 0.10  # a cell whose interquartile range over the rounds exceeds this
                     # fraction of its median is marked "~" (noisy)
CEILING_GAP = 0.20   # report in-process vs child gemm throughputs that differ by more


def _shape(kind, L, D=None, H=None, dtype="float32", kv="float32", causal=False, series=True):
    """One benchmark shape; `series` marks the rows of the plotted sweeps."""
    d0, H, lq = (64, H or 8, L) if kind == "prefill" else (128, H or 32, 1)
    D = D or d0
    name = "".join([f"{kind} {'L' if kind == 'prefill' else 'Lk'}={L}", f" D={D}" * (D != d0),
                    " causal" * causal, " f64" * (dtype == "float64"), " f16 K/V" * (kv == "float16")])
    return dict(name=name, kind=kind, B=1, H=H, Lq=lq, Lk=L, D=D, dtype=dtype, kv_dtype=kv,
                causal=causal, series=series)


def grid(which):
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


# ---------------------------------------------------------------- machine and ceilings
def cpu_info():
    model, flags = None, set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key.strip() == "model name" and model is None:
                    model = val.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(val.split())
    except OSError:
        pass
    return (model or platform.processor() or platform.machine(),
            {f: f in flags for f in ("avx2", "avx512f", "fma", "f16c")})


def blas_limit(threads):
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(limits=threads, user_api="blas")


def blas_info():
    """The BLAS NumPy calls in this process and the kernels it picked, e.g.
    "openblas 0.3.31 Haswell" (None without threadpoolctl)."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return None
    libs = [" ".join(str(x) for x in (i.get("internal_api"), i.get("version"), i.get("architecture"))
                     if x) for i in threadpool_info() if i.get("user_api") == "blas"]
    return "; ".join(libs) or None


def _float_dtype(dtype, fn):
    """np.float32 or np.float64 from `dtype`; TypeError / ValueError naming `fn` else."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"fastattn.{fn}: dtype must be float32 or float64, got {dtype!r}") from None
    if dt not in (np.float32, np.float64):
        raise ValueError(f"fastattn.{fn}: dtype must be float32 or float64, got {dt}")
    return dt


def _kernel_arg(kernel, fn):
    """The kernel's name: the default one for None; ValueError if this CPU cannot run it."""
    kernel = _kernels.current_kernel() if kernel is None else kernel
    if kernel not in _kernels.supported_kernels():
        raise ValueError(f"fastattn.{fn}: kernel must be one of {_kernels.supported_kernels()} "
                         f"(what this CPU runs), got {kernel!r}")
    return kernel


def fma_peak(dtype="float32", num_threads=None, *, kernel=None):
    """The machine's FMA peak in GFLOP/s: `num_threads` threads (default: as many as a
    fastattn call would use) each run 12 independent vector FMA chains of `kernel`'s
    instruction set (default: the kernel fastattn runs), nothing else in the loop, for
    about 20 ms; the best of five rounds.  One FMA counts 2 flops a lane.  The generic
    kernel has no FMA instruction: its "FMA" is a multiply and an add (also 2 flops).

    dtype: "float32" or "float64".  This is the ceiling every GFLOP/s of the bench is
    quoted against (a BLAS sgemm reaches 60-85% of it)."""
    fn = "bench.fma_peak"
    dt = _float_dtype(dtype, fn)
    num_threads = parse_threads(num_threads, fn) or _kernels.max_threads()
    return _kernels.fma_peak(_kernel_arg(kernel, fn), dt == np.float64, num_threads)


def bf16_peak(num_threads=None, *, path=None):
    """The peak of a bfloat16 path's product instruction in GFLOP/s, as fma_peak measures
    the FMA: `num_threads` threads each run independent chains of it, nothing else in
    the loop; the best of five rounds.  "avx512-bf16": 12 chains of vdpbf16ps (16 lanes,
    each two products added to a float32 sum, 4 flops a lane); "amx-bf16": 4 tile
    accumulators of tdpbf16ps (16 x 16 x 32 multiply-adds, 16,384 flops each).  This is
    the ceiling of the bfloat16 forward on that path (each of its two products runs on
    that instruction).  In the emulated test build the figure is the emulation's.

    path: a bfloat16 path with a product instruction ("avx512-bf16", "amx-bf16";
    default the one fastattn takes); ValueError where none runs
    (fastattn._kernels.bf16_paths())."""
    fn = "bench.bf16_peak"
    num_threads = parse_threads(num_threads, fn) or _kernels.max_threads()
    path = _kernels.bf16_path() if path is None else path
    if path == "float32" or path not in _kernels.bf16_paths():
        raise ValueError(f"fastattn.{fn}: path must be a bfloat16 pair path this machine runs, one of "
                         f"{[p for p in _kernels.bf16_paths() if p != 'float32']}, got {path!r}")
    return _kernels.bf16_peak(path, num_threads)


def plan_balance(q_shape, k_shape, *, causal=False, num_threads=None, v_shape=None,
                 layout="bhsd", window=None, seqlens_k=None, dtype="float32", kernel=None,
                 return_work=False):
    """How evenly `fastattn.attention` would spread a call over `num_threads` threads:
    mean / max of the work per thread (1.0: every thread busy until the end), from the
    forward's own plan and schedule, without running anything.

    The work of an item is its flops, 2 (D + Dv) per visible (query, key) pair; each
    item goes to the thread that is free first, as the forward's dynamic scheduling
    does (for short items, which a thread claims one ahead, to the thread that starts
    its last claimed item first; and its head-major segments for strided K/V, its split
    over key chunks for decoding).  The threads' actual speeds (caches, memory) are not
    modelled: this is the balance of the schedule, the upper bound of the scaling it
    allows.

    q_shape, k_shape (and v_shape, default k's): 4-D shapes in `layout` ("bhsd":
    (B, H, L, D); "bshd": (B, L, H, D)), or 3-D without the batch.  causal, window,
    seqlens_k, dtype: as in fastattn.attention.  num_threads: default fastattn's.
    return_work: also return the per-thread work (flops) and the number of items, as
    (balance, work, items)."""
    fn = "bench.plan_balance"
    shapes = []
    for name, sh in (("q_shape", q_shape), ("k_shape", k_shape), ("v_shape", v_shape)):
        if sh is None:
            shapes.append(None)
            continue
        try:
            sh = tuple(sh)
        except TypeError:
            raise TypeError(f"fastattn.{fn}: {name} must be a tuple of ints, got {sh!r}") from None
        if not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in sh):
            raise TypeError(f"fastattn.{fn}: {name} must be a tuple of ints, got {sh!r}")
        if len(sh) not in (3, 4) or min(sh) < 0:
            raise ValueError(f"fastattn.{fn}: {name} must be 3-D or 4-D with sizes >= 0, got {sh}")
        shapes.append(sh)
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"fastattn.{fn}: layout must be 'bhsd' or 'bshd', got {layout!r}")
    qs, ks, vs = shapes
    vs = ks if vs is None else vs
    if not len(qs) == len(ks) == len(vs):
        raise ValueError(f"fastattn.{fn}: q_shape {qs}, k_shape {ks} and v_shape {vs} must have "
                         "the same number of dimensions")

    def bhsd(sh):
        sh = (1,) + sh if len(sh) == 3 else sh
        return (sh[0], sh[2], sh[1], sh[3]) if layout == "bshd" else sh
    (B, Hq, Lq, D), (Bk, Hkv, Lk, Dk), (Bv, Hv, Lv, Dv) = bhsd(qs), bhsd(ks), bhsd(vs)
    if (Bk, Dk) != (B, D) or (Bv, Hv, Lv) != (Bk, Hkv, Lk) or D < 1 or Dv < 1 or Hkv < 1 \
            or Hq % Hkv:
        raise ValueError(f"fastattn.{fn}: q_shape {qs}, k_shape {ks}, v_shape {vs} do not fit "
                         "(the same batch and D for q and k, the same keys for k and v, D >= 1, "
                         "and q's heads a multiple of k's)")
    code = parse_causal(causal, fn)
    wl, wr = parse_window(window, fn)
    nth = parse_threads(num_threads, fn) or _kernels.max_threads()
    dt = _float_dtype(dtype, fn)
    sk = None
    if seqlens_k is not None:
        sk = np.ascontiguousarray(seqlens_k)
        if sk.shape != (B,) or sk.dtype.kind not in "iu":
            raise ValueError(f"fastattn.{fn}: seqlens_k must be {B} ints (one per sequence of "
                             f"q_shape {qs}), got shape {sk.shape} dtype {sk.dtype}")
        if B and (sk.min() < 0 or sk.max() > Lk):
            raise ValueError(f"fastattn.{fn}: seqlens_k must be in [0, {Lk}] (k_shape {ks})")
        sk = sk.astype(np.int64)
    work, items = _kernels.plan_balance((B, Hq, Lq, D), (B, Hkv, Lk, D), Dv, dt == np.float64,
                                        code, wl, wr, layout == "bshd", sk, nth,
                                        _kernel_arg(kernel, fn))
    top = float(work.max()) if work.size else 0.0
    bal = float(work.mean()) / top if top > 0 else 1.0
    return (bal, work, items) if return_work else bal


def gemm_gflops(dtype, n=2048, repeats=3):
    """GFLOP/s of NumPy's n x n x n matmul in this process (best of `repeats`)."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n)).astype(dtype) for _ in range(2))
    c = np.matmul(a, b)
    _warm_up(lambda: np.matmul(a, b, out=c), min_s=0.3)  # idle cores take a while to ramp up
    best = min(_timed(lambda: np.matmul(a, b, out=c)) for _ in range(repeats))
    return 2.0 * n**3 / best / 1e9


# Environment variables that make the BLAS choose its kernels or blocking rather than
# what the CPU allows: removed for the ceilings' child process.  Every OPENBLAS_* and
# GOTO* variable goes (thread counts among them: the child gets the limit explicitly).
KERNEL_ENV_PREFIXES = ("OPENBLAS_", "GOTO")
KERNEL_ENV_NAMES = ("MKL_DEBUG_CPU_TYPE", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "BLIS_ARCH_TYPE")
# ... and those the report's header warns about (they slow down the NumPy column)
NOTE_ENV_NAMES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "MKL_DEBUG_CPU_TYPE",
                  "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "BLIS_ARCH_TYPE")


def _is_kernel_knob(name):
    return name.startswith(KERNEL_ENV_PREFIXES) or name in KERNEL_ENV_NAMES


def blas_env_note(environ=None):
    """One line naming the kernel-selecting BLAS settings of the environment (None if
    there are none): the report's and bench/'s pytest header print it."""
    environ = os.environ if environ is None else environ
    knobs = [f"{n}={environ[n]}" for n in NOTE_ENV_NAMES if environ.get(n)]
    if not knobs:
        return None
    one = len(knobs) == 1
    return (f"note: {', '.join(knobs)} {'is' if one else 'are'} set: NumPy's matmul (the naive "
            f"NumPy column) may run slower kernels than this CPU allows; ceilings are "
            f"measured without {'it' if one else 'them'}")


def clean_env(threads, environ=None):
    """The ceilings' child environment: `environ` without the kernel-selecting BLAS
    settings, with the thread limit, and this fastattn first on the path."""
    environ = os.environ if environ is None else environ
    env = {k: v for k, v in environ.items() if not _is_kernel_knob(k)}
    env.update(OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads))
    root = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, environ.get("PYTHONPATH", "")) if p)
    return env


def child_ceilings(threads, n32=2048, n64=0, timeout=120):
    """sgemm (and dgemm if n64) GFLOP/s measured by `python -m fastattn.bench --_ceilings`
    in clean_env(threads).  Returns (result dict, None), or (None, why it failed)."""
    env = clean_env(threads)
    root = env["PYTHONPATH"].split(os.pathsep)[0]
    args = [sys.executable, "-m", "fastattn.bench", "--_ceilings", f"{threads},{n32},{n64}"]
    try:  # cwd = fastattn's parent: -m puts the working directory first on sys.path
        p = subprocess.run(args, env=env, cwd=root, capture_output=True, text=True,
                           timeout=timeout)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{type(e).__name__}: {e}"
    if p.returncode != 0:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"exit status {p.returncode}: {tail}"
    try:
        res = json.loads(p.stdout.strip().splitlines()[-1])
        if not res["sgemm_gflops"] > 0:
            raise ValueError(res)
    except (ValueError, KeyError, IndexError, TypeError):
        return None, f"unreadable output {p.stdout[-200:]!r}"
    # (thread counts are replaced by the limit, not removed: not listed)
    res["env_removed"] = sorted(k for k in os.environ
                                if _is_kernel_knob(k) and not k.endswith("NUM_THREADS"))
    return res, None


def _ceilings_child(spec):
    """The child's side of child_ceilings: prints one JSON line."""
    threads, n32, n64 = (int(x) for x in spec.split(","))
    with blas_limit(threads):
        res = dict(sgemm_gflops=gemm_gflops(np.float32, n32), blas=blas_info())
        if n64:
            res["dgemm_gflops"] = gemm_gflops(np.float64, n64)
    print(json.dumps(res))
    return 0


def measure_ceilings(threads, n32=2048, n64=0, read_mib=256):
    """The ceilings dict of a report: the FMA peak (float32, and float64 if n64) on
    `threads` threads, gemm from the clean child process (or, if it fails, this process),
    the same gemms in this process, and the read bandwidth."""
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
    """Read bandwidth: `threads` Python threads each take np.max of a slice (GIL released)."""
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
    """Time `ours` with pytest-benchmark, running `base` (untimed by the benchmark,
    timed here) just before every round with 0.1 s idle around it, so both see the
    same machine.  Returns (ours' last result, base's best, base's median seconds)."""
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


def naive(q, k, v, scale, causal):
    """softmax(q k^T * scale) v in plain NumPy, max-subtracted, in q's dtype."""
    s = q @ k.swapaxes(-1, -2)
    s *= s.dtype.type(scale)
    if causal:  # bottom-right, as fastattn's causal=True (same as top-left when Lq == Lk)
        lq, lk = s.shape[-2:]
        s[..., np.triu(np.ones((lq, lk), dtype=bool), k=1 + lk - lq)] = -np.inf
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s @ v


# ---------------------------------------------------------------- the oracle check
def sample_rows(lq, n_random=6, seed=0):
    """Query rows to check: the first, the last and n_random others (fixed seed), sorted."""
    if lq <= 0:
        return np.arange(0)
    rng = np.random.default_rng(seed)
    extra = rng.choice(lq, size=min(n_random, lq), replace=False)
    return np.unique(np.concatenate(([0, lq - 1], extra))).astype(np.intp)


def rel_err(out, ref):
    """max |out - ref| / max |ref|, in float64."""
    ref = np.asarray(ref, dtype=np.float64)
    if ref.size == 0:
        return 0.0
    return float(np.max(np.abs(np.asarray(out, dtype=np.float64) - ref))
                 / max(float(np.max(np.abs(ref))), 1e-300))


def _rows_of(a, rows, lq):
    """Rows `rows` of a mask/bias broadcast (right-aligned) against (..., Lq, Lk)."""
    a = np.asarray(a)
    return a[..., rows, :] if a.ndim >= 2 and a.shape[-2] == lq else a


def check_rows(out, q, k, v, rows=None, *, causal=False, window=None, mask=None, bias=None,
               alibi_slopes=None, layout="bhsd", **kw):
    """Relative error of `out` (fastattn.attention(q, k, v, ...)) on some query rows of
    every batch and every head, against fastattn.reference computed on just those rows.

    rows: query positions (default sample_rows(Lq)).  The oracle sees q[..., rows, :] and
    all the keys; the causal/window alignment, ALiBi's distances and the mask/bias rows
    of the original positions become an explicit mask and bias, so a query keeps the keys
    it had in the full problem (both causal alignments, Lq != Lk).  Other keywords
    (scale, softcap) pass through to the oracle.
    """
    def bhsd(a):  # a (B, H, L, D) view of a 2-D, 3-D or 4-D array in `layout`
        a = np.asarray(a)
        if layout == "bshd" and a.ndim >= 3:
            a = a.swapaxes(-3, -2)
        return a.reshape((1,) * (4 - a.ndim) + a.shape)

    q4, k4, v4, o4 = (bhsd(a) for a in (q, k, v, out))
    lq, lk = q4.shape[2], k4.shape[2]
    rows = sample_rows(lq) if rows is None else np.asarray(rows, dtype=np.intp)
    i, j = rows[:, None], np.arange(lk)[None, :]
    mode = None if causal is False or causal is None or (isinstance(causal, np.bool_) and not causal) \
        else "top-left" if causal == "top-left" else "bottom-right"
    diag = i if mode == "top-left" else i + (lk - lq)  # the diagonal of DESIGN.md's step 5
    vis = np.ones((rows.size, lk), dtype=bool)
    if mode is not None:
        vis &= j <= diag
    if window is not None:
        left, right = window
        if left is not None:
            vis &= j >= diag - left
        if right is not None:
            vis &= j <= diag + right
    if mask is not None:
        vis = vis & _rows_of(mask, rows, lq)
    b = None if bias is None else _rows_of(bias, rows, lq).astype(np.float64)
    if alibi_slopes is not None:
        sl = np.asarray(alibi_slopes, dtype=np.float64)
        dist = np.abs(i + (lk - lq) - j).astype(np.float64)
        ali = -sl[..., None, None] * dist  # (Hq, r, Lk) or (B, Hq, r, Lk)
        b = ali if b is None else b + ali
    B, hq, hkv = q4.shape[0], q4.shape[1], k4.shape[1]
    full = (B, hq, rows.size, lk)
    vis = np.broadcast_to(vis, full)
    b = None if b is None else np.broadcast_to(b, full)
    g = hq // hkv if hkv else 0
    num = den = 0.0
    # one (batch, K/V head) at a time: the oracle converts its K/V to float64, and a
    # whole decode cache would take gigabytes
    for bi in range(B):
        for h in range(hkv):
            hs = slice(h * g, (h + 1) * g)  # the query heads of K/V head h
            ref = reference.attention(q4[bi:bi + 1, hs][:, :, rows], k4[bi:bi + 1, h:h + 1],
                                      v4[bi:bi + 1, h:h + 1], mask=vis[bi:bi + 1, hs],
                                      bias=None if b is None else b[bi:bi + 1, hs], **kw)
            got = np.asarray(o4[bi:bi + 1, hs][:, :, rows], dtype=np.float64)
            if ref.size:
                d = float(np.max(np.abs(got - ref)))
                num = max(num, d) if np.isfinite(d) else np.inf  # a NaN fails the check
                den = max(den, float(np.max(np.abs(ref))))
    return num / max(den, 1e-300)


SETTLE_S = 0.1  # idle time before each timed call (see _timed)
# ... and after NumPy's call: OpenBLAS's worker threads spin for about 0.13 s after a
# matmul here (their CPU time, read from /proc), so a call started 0.1 s after the
# naive formula shared a core with them (measured: fastattn 42 ms after it against
# 35-37 ms otherwise, B=1 H=8 L=2048 D=64).
SETTLE_AFTER_NUMPY_S = 0.3


def _timed(f, settle=0.0):
    """Seconds one call of f takes.  `settle` idles first: after a call, OpenBLAS's and
    each OpenMP runtime's worker threads keep spinning for a while, and a call of
    another library that starts meanwhile shares the cores with them (measured here:
    +20-30% for fastattn and PyTorch right after a NumPy matmul)."""
    if settle:
        time.sleep(settle)
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def _warm_up(f, min_s=0.05, max_calls=50):
    """Call f for about min_s seconds, at least once (idle vCPUs and thread pools wake up
    slowly on a shared VM); returns the last call's time."""
    t_end, calls = time.perf_counter() + min_s, 0
    while calls < 1 or (time.perf_counter() < t_end and calls < max_calls):
        t, calls = _timed(f), calls + 1
    return t


def run_shape(sh, threads, torch=None, use_numpy=True, seed=0):
    """Time every implementation on one shape; returns the row dict."""
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


def _times_ms(r):
    """An implementation's times over the rounds (ms), in round order."""
    return list(r.get("times_ms") or [r["median_ms"]])


def ratio_text(num, den):
    """Two samples of times as 'best / median' ratios: min(num)/min(den) and the medians'."""
    return f"{min(num) / min(den):5.2f}x / {np.median(num) / np.median(den):5.2f}x"


def spread(xs):
    """(median, Q1, Q3, (Q3 - Q1) / median) of a list of positive numbers: the quartiles
    interpolated between the rounds (statistics.quantiles, "inclusive")."""
    med = statistics.median(xs)
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else xs * 3
    return med, q1, q3, (q3 - q1) / med if med > 0 else 0.0


def derive(row, ceil):
    """Throughput (of the median round), fraction of the ceiling and speed ratios (the
    median of the per-round ratios, with their quartiles and range) for one row (None
    where missing); `noisy` flags the cells whose interquartile range exceeds
    NOISY_SPREAD of their median."""
    fa_t = _times_ms(row["fastattn"])
    med, q1, q3, sp = spread(fa_t)
    f64 = row["dtype"] == "float64"
    gemm = None
    if row["kind"] == "prefill":
        work, unit = row["flops"] / 1e9, "GFLOP/s"
        c, cname = ceil.get("fma_peak_f64_gflops" if f64 else "fma_peak_gflops"), "FMA peak"
        gemm = ceil.get("dgemm_gflops" if f64 else "sgemm_gflops")
    else:
        work, unit = row["bytes"] / 1e9, "GB/s"
        c, cname = ceil.get("read_gbps"), "read bw"
    rate = work / (med / 1e3)
    d = dict(rate=rate, rate_best=work / (min(fa_t) / 1e3), unit=unit, ceiling=cname,
             rates={n: work / (row[n]["median_ms"] / 1e3) for n in IMPLS if row.get(n)},
             pct_ceiling=100.0 * rate / c if c else None,
             pct_gemm=100.0 * rate / gemm if gemm else None,
             gemm="dgemm" if f64 else "sgemm",
             fastattn_ms=med, fastattn_iqr_ms=[q1, q3], fastattn_range_ms=[min(fa_t), max(fa_t)],
             fastattn_spread=sp, noisy=dict(fastattn=sp > NOISY_SPREAD))
    for n in ("torch", "numpy"):
        if not row.get(n):
            d[f"x_vs_{n}"] = d[f"x_vs_{n}_iqr"] = d[f"x_vs_{n}_range"] = None
            continue
        # the same round's times: both calls saw the same machine state
        ratios = [t / f for t, f in zip(_times_ms(row[n]), fa_t)]
        rmed, rq1, rq3, rsp = spread(ratios)
        d[f"x_vs_{n}"], d[f"x_vs_{n}_iqr"] = rmed, [rq1, rq3]
        d[f"x_vs_{n}_range"] = [min(ratios), max(ratios)]
        d["noisy"][n] = rsp > NOISY_SPREAD
    return d


# ---------------------------------------------------------------- report
CEILINGS = (("fma_peak_gflops", "FMA peak", "GFLOP/s"),
            ("fma_peak_f64_gflops", "float64 FMA peak", "GFLOP/s"),
            ("sgemm_gflops", "sgemm", "GFLOP/s"), ("dgemm_gflops", "dgemm", "GFLOP/s"),
            ("read_gbps", "read bandwidth", "GB/s"))
COLS = ("shape", "fastattn ms", "PyTorch ms", "NumPy ms", "fastattn rate", "% ceiling",
        "% gemm", "x vs PyTorch", "x vs NumPy")


def _day(iso):
    return iso[:16].replace("T", " ")  # 2024-01-31 12:34


def _num(m):
    return f"{m:.1f}" if m >= 10 else f"{m:.2f}" if m >= 0.1 else f"{m:.3f}"


def _ms(r):
    return "-" if not r else _num(r["median_ms"])


def _cell(med, iqr, noisy, x=""):
    """'median [Q1-Q3]', with '~' for a noisy one (' ' keeps the columns aligned)."""
    if med is None:
        return "- "
    f = (lambda y: f"{y:.2f}") if x else _num
    return f"{f(med)}{x} [{f(iqr[0])}-{f(iqr[1])}]{'~' if noisy else ' '}"


def ceiling_lines(c):
    """The report's lines about the ceilings: where and how they were measured."""
    vals = ", ".join(f"{label} {c[k]:.1f} {unit}" for k, label, unit in CEILINGS if c.get(k))
    blas = f" ({c['blas']} kernels)" if c.get("blas") else ""
    src = c.get("source")
    if src == "child":
        removed = c.get("env_removed")
        how = f"; gemm timed in a child process{' without ' + ', '.join(removed) if removed else ''}{blas}"
    elif src == "in-process":
        how = f"; gemm timed in this process{blas}: the child process failed: {c.get('child_error')}"
    else:
        how = ""
    fk = f" (FMA peak: the {c['fma_kernel']} kernel's FMA chains)" if c.get("fma_kernel") else ""
    lines = [f"ceilings (this run): {vals}{fk}{how}"]
    inp = c.get("in_process") or {}
    if src == "child":
        for k, label in (("sgemm_gflops", "sgemm"), ("dgemm_gflops", "dgemm")):
            if inp.get(k) and c.get(k):
                gap = inp[k] / c[k] - 1.0
                if abs(gap) > CEILING_GAP:
                    lines.append(
                        f"note: {label} in this process (the BLAS the NumPy column runs"
                        f"{', ' + inp['blas'] if inp.get('blas') else ''}): {inp[k]:.1f} GFLOP/s, "
                        f"{abs(gap) * 100:.0f}% {'below' if gap < 0 else 'above'} the child's"
                        + ("" if gap < 0 else " (the machine's speed moved between the two)"))
    return lines


def format_table(result):
    """The printed report: a header, the ceilings and one line per row."""
    m, c = result["machine"], result["ceilings"]
    ver = result["versions"]
    env_note = result.get("env_note")
    lines = [f"fastattn.bench  {_day(result['date'])}",
             f"CPU: {m['cpu']}  kernel: {m['kernel']}  threads: {m['threads']}",
             f"fastattn {ver['fastattn']}  numpy {ver['numpy']}  torch {ver['torch'] or '-'}"]
    lines += [env_note] if env_note else []
    lines += ceiling_lines(c)
    rounds = sorted({r["rounds"] for r in result["rows"]})
    nr = f"{rounds[0]}-{rounds[-1]}" if len(rounds) > 1 else f"{rounds[0]}" if rounds else "-"
    lines += ["prefill: B=1 H=8 D=64 float32; decode: B=1 H=32 Lq=1 D=128 float32 (unless noted)",
              f"times: medians of {nr} interleaved rounds, fastattn's with its interquartile "
              "range [Q1-Q3]; x: the other's time / fastattn's in the same round, median [Q1-Q3]",
              ""]
    cells = [COLS]
    for row in result["rows"]:
        d = row["derived"]
        noisy = d.get("noisy", {})
        cells.append((row["name"],
                      _cell(d["fastattn_ms"], d["fastattn_iqr_ms"], noisy.get("fastattn")),
                      _ms(row["torch"]), _ms(row["numpy"]),
                      f"{d['rate']:.1f} {d['unit']}",
                      "-" if d["pct_ceiling"] is None else f"{d['pct_ceiling']:.0f}% {d['ceiling']}",
                      "-" if d.get("pct_gemm") is None else f"{d['pct_gemm']:.0f}% {d['gemm']}",
                      _cell(d["x_vs_torch"], d["x_vs_torch_iqr"], noisy.get("torch"), "x"),
                      _cell(d["x_vs_numpy"], d["x_vs_numpy_iqr"], noisy.get("numpy"), "x")))
    w = [max(len(r[i]) for r in cells) for i in range(len(COLS))]
    fmt = lambda r: "  ".join(s.ljust(w[0]) if i == 0 else s.rjust(w[i]) for i, s in enumerate(r))
    lines += [fmt(cells[0]), "  ".join("-" * x for x in w)] + [fmt(r) for r in cells[1:]]
    n_noisy = sum(any(r["derived"].get("noisy", {}).values()) for r in result["rows"])
    lines += ["", f"~ noisy: the cell's interquartile range is over {NOISY_SPREAD:.0%} of its "
              f"median ((Q3-Q1)/median); {n_noisy} of {len(result['rows'])} rows have one: read "
              "them as rough (rate and % ceiling come from fastattn's median; --json has every "
              "round)."]
    bad = [f"{r['name']} (rel err {r['rel_err']:.1e} > {r['tol']:.0e})"
           for r in result["rows"] if not r["check_ok"]]
    worst = max((r["rel_err"] / r["tol"] for r in result["rows"]), default=0.0)
    lines += [f"ORACLE CHECK FAILED: {'; '.join(bad)}" if bad else
              "oracle check (every batch and head; query rows first, last and up to 6 others): "
              f"all pass, worst rel err {worst:.2g} x tolerance"]
    return "\n".join(lines)


def plot(result, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'fastattn[bench]'") from None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), dpi=120)
    panels = [("prefill", "prefill (float32, B=1 H=8 D=64)", "L", "GFLOP/s", "fma_peak_gflops",
               "FMA peak"),
              ("decode", "decode (float32, B=1 H=32 D=128, Lq=1)", "Lk", "GB/s", "read_gbps",
               "read bandwidth")]
    style = {"fastattn": ("C0", "o", "fastattn"), "torch": ("C1", "s", "PyTorch SDPA"),
             "numpy": ("C2", "^", "NumPy naive")}
    for ax, (kind, title, xl, yl, ckey, cname) in zip(axes, panels):
        rows = sorted((r for r in result["rows"] if r["kind"] == kind and r["series"]),
                      key=lambda r: r["Lk"])
        for n, (col, mk, label) in style.items():
            pts = [(r["Lk"], r["derived"]["rates"][n]) for r in rows if n in r["derived"]["rates"]]
            if pts:
                ax.plot(*zip(*pts), color=col, marker=mk, label=label)
        top = max([r["derived"]["rates"].get(n, 0) for r in rows for n in style] + [1.0])
        if result["ceilings"].get(ckey):
            c = result["ceilings"][ckey]
            top = max(top, c)
            ax.axhline(c, color="0.4", ls="--", lw=1, label=f"{cname} ceiling")
            ax.annotate(f"{cname} {c:.0f} {yl}", xy=(0.01, c), xycoords=("axes fraction", "data"),
                        xytext=(0, 2), textcoords="offset points", fontsize=8, color="0.3")
        ax.set_xscale("log", base=2)
        if rows:
            ax.set_xticks([r["Lk"] for r in rows], [str(r["Lk"]) for r in rows])
        ax.set(title=title, xlabel=xl, ylabel=yl)
        ax.set_ylim(0, 1.15 * top)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    m = result["machine"]
    fig.suptitle(f"fastattn  |  {m['cpu']}  |  {m['threads']} threads  |  {_day(result['date'])}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def progress(i, n, label, stream=sys.stderr):
    bar = "=" * round(20 * i / n)
    line = f"[{bar:<20}] {i}/{n} {label}"
    tty = stream.isatty()
    stream.write(f"\r{line:<60}" + "\n" * (i == n) if tty else line + "\n")
    stream.flush()


def main(argv=None):
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


if __name__ == "__main__":
    sys.exit(main())
