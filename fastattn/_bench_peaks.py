"""The machine's peaks and the balance of the forward's schedule, without attention.

The FMA peak, the bfloat16 product instruction's peak, and how evenly the forward's
plan spreads over the threads.

Private: :mod:`fastattn.bench` re-exports :func:`fma_peak`, :func:`read_bandwidth`,
:func:`bf16_peak` and :func:`plan_balance`.
"""
import numpy as np

from fastattn import _kernels
from fastattn._scalars import parse_causal, parse_threads, parse_window


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
    """Measure the machine's FMA peak in GFLOP/s.

    `num_threads` threads each run 12 independent vector FMA chains of `kernel`'s
    instruction set, nothing else in the loop, for about 20 ms; the result is the
    best of five rounds.  This is the ceiling every GFLOP/s of the bench is quoted
    against (a BLAS sgemm reaches 60-85% of it).

    Parameters
    ----------
    dtype : {"float32", "float64"} or numpy.dtype, default "float32"
        The precision of the FMA lanes.
    num_threads : int, optional
        Threads that run the chains; default as many as a fastattn call would use.
    kernel : {"generic", "avx2", "avx512", "neon", "sve256", "sve128"}, optional
        Whose instruction set runs the chains; default the kernel fastattn runs.
        It must be one this CPU runs.

    Returns
    -------
    float
        GFLOP/s over all the threads; one FMA counts 2 flops a lane.

    Raises
    ------
    TypeError
        If `dtype` is not a dtype, or `num_threads` is not an int.
    ValueError
        If `dtype` is not float32 or float64, ``num_threads < 1``, or this CPU cannot
        run `kernel`.

    See Also
    --------
    bf16_peak : The same for the bfloat16 product instructions.

    Notes
    -----
    The generic kernel has no FMA instruction: its "FMA" is a multiply and an add
    (also 2 flops).

    Examples
    --------
    >>> from fastattn import bench
    >>> bench.fma_peak("float32", 1) > 0
    True
    """
    fn = "bench.fma_peak"
    dt = _float_dtype(dtype, fn)
    num_threads = parse_threads(num_threads, fn) or _kernels.max_threads()
    return _kernels.fma_peak(_kernel_arg(kernel, fn), dt == np.float64, num_threads)


def read_bandwidth(num_threads=None, *, mib=256, passes=5, kernel=None):
    """Measure the machine's streaming read bandwidth in GB/s.

    `num_threads` threads each read their share of a float32 array of `mib` MiB with
    `kernel`'s vector loads, four runs of the share side by side (as a decode call
    reads its K and V rows), nothing else in the loop: an untimed pass, then the best
    of `passes` timed ones.  This is the ceiling every decoding GB/s is quoted against
    (:func:`fma_peak` is the ceiling of the products).

    Parameters
    ----------
    num_threads : int, optional
        Threads that read; default as many as a fastattn call would use.
    mib : int, default 256
        The array's size in MiB, 1 to 2048: far more than the last-level cache a core
        sees, or the figure is the cache's.  NumPy allocates so large an array on huge pages
        where the kernel allows, as it does the arrays a decode call reads.
    passes : int, default 5
        Timed passes; the fastest counts.
    kernel : {"generic", "avx2", "avx512", "neon", "sve256", "sve128"}, optional
        Whose vector loads read; default the kernel fastattn runs.

    Returns
    -------
    float
        GB/s (10**9 bytes a second) over all the threads.

    Raises
    ------
    TypeError
        If `num_threads`, `mib` or `passes` is not an int.
    ValueError
        If ``num_threads < 1``, `mib` is not in 1 to 2048, ``passes < 1``, or this CPU
        cannot run `kernel`.

    See Also
    --------
    fma_peak : The ceiling of the products.

    Examples
    --------
    >>> from fastattn import bench
    >>> bench.read_bandwidth(1, mib=8, passes=1) > 0
    True
    """
    fn = "bench.read_bandwidth"
    num_threads = parse_threads(num_threads, fn) or _kernels.max_threads()
    # (at most 2048 MiB: each float32 lane of the loop then adds at most 2**24 ones, a
    # sum float32 holds exactly, so the check below is exact)
    for name, val, top in (("mib", mib, 2048), ("passes", passes, None)):
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)):
            raise TypeError(f"fastattn.{fn}: {name} must be an int, got {type(val).__name__}")
        if val < 1 or (top is not None and val > top):
            raise ValueError(f"fastattn.{fn}: {name} must be >= 1" + (f" and <= {top}" if top else "")
                             + f", got {val}")
    buf = np.ones(int(mib) * 2**20 // 4, dtype=np.float32)
    nbytes, seconds, total = _kernels.read_bandwidth(buf, _kernel_arg(kernel, fn), num_threads, int(passes))
    if total != nbytes // 4:  # every element read once in the pass that counts (they are all 1)
        raise RuntimeError(f"fastattn.{fn}: the pass read a sum of {total}, not {nbytes // 4}")
    return nbytes / seconds / 1e9


def bf16_peak(num_threads=None, *, path=None):
    """Measure the peak of a bfloat16 path's product instruction in GFLOP/s.

    As :func:`fma_peak` measures the FMA: `num_threads` threads each run independent
    chains of the instruction, nothing else in the loop; the best of five rounds.
    This is the ceiling of the bfloat16 forward on that path (each of its two
    products runs on that instruction).

    Parameters
    ----------
    num_threads : int, optional
        Threads that run the chains; default as many as a fastattn call would use.
    path : {"avx512-bf16", "amx-bf16"}, optional
        The bfloat16 path; default the one fastattn takes.  "avx512-bf16": 12 chains
        of ``vdpbf16ps`` (16 lanes, each two products added to a float32 sum, 4 flops
        a lane); "amx-bf16": 4 tile accumulators of ``tdpbf16ps`` (16 x 16 x 32
        multiply-adds, 16,384 flops each).

    Returns
    -------
    float
        GFLOP/s over all the threads.

    Raises
    ------
    ValueError
        If this machine does not run `path` (or, by default, any bfloat16 path with a
        product instruction), or ``num_threads < 1``.
    TypeError
        If `num_threads` is not an int.

    See Also
    --------
    fma_peak : The float32 and float64 ceiling.

    Notes
    -----
    In the emulated test build (built with ``FASTATTN_EMULATE_BF16=1``) the figure is the
    emulation's, not the hardware's.

    Examples
    --------
    Skipped in the doctests: it needs a CPU with AVX512-BF16 or AMX.

    >>> from fastattn import bench
    >>> bench.bf16_peak(1, path="avx512-bf16") > 0  # doctest: +SKIP
    True
    """
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
    """Compute how evenly :func:`fastattn.attention` would spread a call over its threads.

    From the forward's own plan and schedule, without running anything: the mean
    over the threads of their work divided by the largest (1.0: every thread busy
    until the end).

    Parameters
    ----------
    q_shape : tuple of int
        The queries' shape, 4-D in `layout` ("bhsd": (B, H, L, D); "bshd":
        (B, L, H, D)), or 3-D without the batch.
    k_shape : tuple of int
        The keys' shape, with q's number of dims.
    causal : {False, True, 'bottom-right', 'top-left'}, default False
        As in :func:`fastattn.attention`.
    num_threads : int, optional
        Threads of the call; default fastattn's.
    v_shape : tuple of int, optional
        The values' shape; default k's.
    layout : {"bhsd", "bshd"}, default "bhsd"
        The layout of the three shapes.
    window : tuple of (int or None, int or None), optional
        As in :func:`fastattn.attention`.
    seqlens_k : array_like of int, shape (B,), optional
        As in :func:`fastattn.attention`, each in [0, Lk].
    dtype : {"float32", "float64"}, default "float32"
        The dtype of the call.
    kernel : {"generic", "avx2", "avx512", "neon", "sve256", "sve128"}, optional
        Whose block sizes the plan takes; default the kernel fastattn runs.
    return_work : bool, default False
        Also return the per-thread work and the number of items.

    Returns
    -------
    balance : float
        Mean over max of the work per thread, in (0, 1]; 1.0 for a call with no work.
    work : ndarray of float
        Only with `return_work`: each thread's work in flops.
    items : int
        Only with `return_work`: the number of work items of the plan.

    Raises
    ------
    TypeError
        If a shape is not a tuple of ints.
    ValueError
        If the shapes do not fit together, or an option is out of range.

    Notes
    -----
    The work of an item is its flops, 2 (D + Dv) per visible (query, key) pair; each
    item goes to the thread that is free first, as the forward's dynamic scheduling
    does (for short items, which a thread claims one ahead, to the thread that starts
    its last claimed item first; and its head-major segments for strided K/V, its
    split over key chunks for decoding).  The threads' actual speeds (caches, memory)
    are not modelled: this is the balance of the schedule, the upper bound of the
    scaling it allows.

    Examples
    --------
    >>> from fastattn import bench
    >>> bench.plan_balance((1, 8, 256, 64), (1, 8, 256, 64), num_threads=2)
    1.0
    >>> bal, work, items = bench.plan_balance((1, 8, 256, 64), (1, 8, 256, 64), causal=True,
    ...                                       num_threads=3, return_work=True)
    >>> 0.9 < bal <= 1.0, work.shape
    (True, (3,))
    """
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
