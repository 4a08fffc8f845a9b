"""The machine under the benchmark: its CPU and BLAS, their settings and gemm speed.

The CPU and BLAS the report names, the BLAS settings that choose kernels, the gemm
throughput, the clean child process that times it, and the timing helpers every
measurement uses.

Private: :mod:`fastattn.bench` re-exports every public name.
"""
import contextlib
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

import fastattn


def cpu_info():
    """Read the CPU's model name and the instruction-set flags the report shows.

    Returns
    -------
    model : str
        The model name of /proc/cpuinfo, else what ``platform`` says.
    flags : dict of str to bool
        Whether the CPU has ``avx2``, ``avx512f``, ``fma`` and ``f16c`` (all False
        where /proc/cpuinfo cannot be read).

    Examples
    --------
    >>> from fastattn import bench
    >>> model, flags = bench.cpu_info()
    >>> sorted(flags)
    ['avx2', 'avx512f', 'f16c', 'fma']
    """
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
    """Limit the threads of NumPy's BLAS inside a ``with`` block.

    Parameters
    ----------
    threads : int
        The BLAS thread limit.

    Returns
    -------
    contextlib.AbstractContextManager
        ``threadpoolctl.threadpool_limits`` for the BLAS, or a context that does
        nothing where threadpoolctl is not installed.

    Examples
    --------
    >>> import numpy as np
    >>> from fastattn import bench
    >>> with bench.blas_limit(1):
    ...     float(np.ones((2, 2)) @ np.ones(2) @ np.ones(2))
    4.0
    """
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(limits=threads, user_api="blas")


def blas_info():
    """Name the BLAS NumPy calls in this process and the kernels it picked.

    Returns
    -------
    str or None
        E.g. "openblas 0.3.31 Haswell" (several libraries joined by "; "); None
        without threadpoolctl or when it finds no BLAS.
    """
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return None
    libs = [" ".join(str(x) for x in (i.get("internal_api"), i.get("version"), i.get("architecture"))
                     if x) for i in threadpool_info() if i.get("user_api") == "blas"]
    return "; ".join(libs) or None


def gemm_gflops(dtype, n=2048, repeats=3):
    """Measure the GFLOP/s of NumPy's n x n x n matmul in this process.

    Parameters
    ----------
    dtype : numpy.dtype or type
        The matrices' dtype (float32 for sgemm, float64 for dgemm).
    n : int, default 2048
        The matrices' size.
    repeats : int, default 3
        Timed calls after a warm-up of about 0.3 s; the best counts.

    Returns
    -------
    float
        ``2 n**3`` flops over the best call's time, in GFLOP/s.

    Examples
    --------
    >>> import numpy as np
    >>> from fastattn import bench
    >>> bench.gemm_gflops(np.float32, n=64, repeats=1) > 0
    True
    """
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
    """Name the kernel-selecting BLAS settings of the environment in one line.

    The report's header and bench/'s pytest header print it.

    Parameters
    ----------
    environ : mapping of str to str, optional
        The environment; default ``os.environ``.

    Returns
    -------
    str or None
        The note, or None when none of ``NOTE_ENV_NAMES`` is set.

    Examples
    --------
    >>> from fastattn import bench
    >>> bench.blas_env_note({"OPENBLAS_CORETYPE": "Haswell"})[:41]
    'note: OPENBLAS_CORETYPE=Haswell is set: N'
    >>> bench.blas_env_note({}) is None
    True
    """
    environ = os.environ if environ is None else environ
    knobs = [f"{n}={environ[n]}" for n in NOTE_ENV_NAMES if environ.get(n)]
    if not knobs:
        return None
    one = len(knobs) == 1
    return (f"note: {', '.join(knobs)} {'is' if one else 'are'} set: NumPy's matmul (the naive "
            f"NumPy column) may run slower kernels than this CPU allows; ceilings are "
            f"measured without {'it' if one else 'them'}")


def clean_env(threads, environ=None):
    """Make the environment of the ceilings' child process.

    Parameters
    ----------
    threads : int
        The thread limit, set for OpenBLAS, OpenMP and MKL.
    environ : mapping of str to str, optional
        The environment to start from; default ``os.environ``.

    Returns
    -------
    dict of str to str
        `environ` without the kernel-selecting BLAS settings (every ``OPENBLAS_*``
        and ``GOTO*`` variable and ``KERNEL_ENV_NAMES``), with the thread limits, and
        the folder above this fastattn first on ``PYTHONPATH``.

    Examples
    --------
    >>> from fastattn import bench
    >>> env = bench.clean_env(2, {"OPENBLAS_CORETYPE": "Haswell", "HOME": "/root"})
    >>> "OPENBLAS_CORETYPE" in env, env["OMP_NUM_THREADS"], env["HOME"]
    (False, '2', '/root')
    """
    environ = os.environ if environ is None else environ
    env = {k: v for k, v in environ.items() if not _is_kernel_knob(k)}
    env.update(OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads))
    root = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, environ.get("PYTHONPATH", "")) if p)
    return env


def child_ceilings(threads, n32=2048, n64=0, timeout=120):
    """Measure sgemm (and dgemm) GFLOP/s in a child process with a clean environment.

    Runs ``python -m fastattn.bench --_ceilings`` in ``clean_env(threads)``.

    Parameters
    ----------
    threads : int
        The child's thread limit.
    n32 : int, default 2048
        The sgemm's size.
    n64 : int, default 0
        The dgemm's size; 0 skips it.
    timeout : float, default 120
        Seconds the child may run.

    Returns
    -------
    result : dict or None
        ``sgemm_gflops``, ``blas`` (see :func:`blas_info`), ``dgemm_gflops`` (with
        `n64`) and ``env_removed`` (the settings the child ran without); None if the
        child failed.
    why : str or None
        None on success, else why the child failed (the exception, its exit status
        and last line of stderr, or its unreadable output).
    """
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
