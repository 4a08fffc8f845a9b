"""What the machine and fastattn's schedule allow, measured without running attention:
the FMA peak, the bfloat16 product instruction's peak, and the balance of the forward's
plan over the threads.

Private: :mod:`fastattn.bench` re-exports :func:`fma_peak`, :func:`bf16_peak` and
:func:`plan_balance`.
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
