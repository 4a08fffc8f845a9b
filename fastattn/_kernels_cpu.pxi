# Included by fastattn/_kernels.pyx (one extension: the cimports and the
# declarations of src_c/fastattn.h are there).
# The CPU side: which kernel and bfloat16 path run, the build's facts, and the
# measurements fastattn.bench reports (FMA peaks, the forward's schedule).

cdef str _why = ""


def select_kernel(disabled):
    """Choose the default kernel, honouring a FASTATTN_DISABLE_CPU_FEATURES list."""
    global _why
    cdef char buf[256]
    cdef bytes d = (disabled or "").encode()
    isa = fa_cpu_select(d, buf, 256)
    _why = buf.decode()
    return fa_isa_name(isa).decode()


def _isa_index(name):
    for i in range(FA_ISA_COUNT):
        if fa_isa_name(i).decode() == name:
            return i
    raise ValueError(f"unknown kernel {name!r}")


def supported_kernels():
    """Names of the kernels this CPU and OS can run, lowest first."""
    cdef unsigned have = fa_cpu_supported_isas()
    return [fa_isa_name(i).decode() for i in range(FA_ISA_COUNT) if have & (1u << i)]


def current_kernel():
    return fa_isa_name(fa_default_isa()).decode()


def set_kernel(name):
    """Make `name` the default kernel (tests use this to run every kernel)."""
    global _why
    if fa_set_default_isa(_isa_index(name)) != FA_OK:
        raise ValueError(f"kernel {name!r} cannot run on this CPU; it runs {supported_kernels()}")
    _why = "set by fastattn._kernels.set_kernel"


def kernel_reason():
    return _why


def bf16_paths():
    """How bfloat16 q/k/v can compute here: "float32" (converted in registers, every
    kernel) and, where the build and CPU have them, "avx512-bf16" (the products on
    vdpbf16ps pairs, avx512 kernel), "amx-bf16" (the products on AMX tiles) and, on
    AArch64, "bfdot" (the products on BFDOT pairs, neon, sve256 or sve128 kernel)."""
    cdef unsigned have = fa_bf16_paths()
    return [fa_bf16_path_name(i).decode() for i in range(FA_BF16_COUNT) if have & (1u << i)]


def bf16_paths_built():
    """The bfloat16 paths this build compiled, whether or not this CPU runs them."""
    cdef unsigned have = fa_bf16_paths_built()
    return [fa_bf16_path_name(i).decode() for i in range(FA_BF16_COUNT) if have & (1u << i)]


def amx_model_ops():
    """The emulated test build: the tdpbf16ps its AMX model has run since import (all
    threads); -1 in every other build."""
    return fa_amx_model_ops()


def bf16_model_check(long count):
    """The emulated test build: of `count` pair products of edge and pseudo-random
    bfloat16 operands, how many its 8-lane model of vdpbf16ps/tdpbf16ps gives other bits
    for than the scalar model (a NaN counts as any NaN); -1 in every other build."""
    return fa_bf16_model_check(count)


def bf16_path():
    return fa_bf16_path_name(fa_bf16_path()).decode()


def bf16_kernel():
    """The name of the bfloat16 kernel that calls with q, k and v bfloat16 take on the
    current kernel under the current path, or None where they convert to float32."""
    cdef const char *name = fa_bf16_kernel_name()
    return None if name == NULL else name.decode()


def set_bf16_path(name):
    """Make `name` (one of bf16_paths()) the bfloat16 path (tests use this)."""
    for i in range(FA_BF16_COUNT):
        if fa_bf16_path_name(i).decode() == name:
            if fa_set_bf16_path(i) != FA_OK:
                raise ValueError(f"bfloat16 path {name!r} cannot run here; it runs {bf16_paths()}")
            return
    raise ValueError(f"unknown bfloat16 path {name!r}")


_LOOKAHEAD = {"auto": 0, "all": 1, "stream": 2}


def set_lookahead(mode):
    """How the forward's look-ahead asks for the next short item's rows (tests use this):
    "auto" (by the CPU: "all" on AMD, "stream" elsewhere), "all" (every row at once
    before the item) or "stream" (the Q and output rows, a few lines at a time during
    the running item's products where it reads several key blocks).  No bit depends on
    it."""
    if mode not in _LOOKAHEAD:
        raise ValueError(f"unknown look-ahead mode {mode!r}; one of {sorted(_LOOKAHEAD)}")
    fa_set_lookahead(_LOOKAHEAD[mode])


_LANE_GROUPS = {"auto": 0, 2: 2, 4: 4}


def set_lane_groups(mode):
    """How many groups of keys the keys-on-lanes QK^T of a fastattn.KVCache takes at once
    for three or four query rows a kv head over float32 keys, where the kernel allows
    four (AVX-512) (tests use this): "auto" (by the CPU: 2 on AMD, 4 elsewhere), 2 or 4.
    No bit depends on it."""
    if mode not in _LANE_GROUPS:
        raise ValueError(f"unknown lane groups mode {mode!r}; one of 'auto', 2, 4")
    fa_set_lane_groups(_LANE_GROUPS[mode])


_SPREAD = {"auto": -1, "off": 0, "on": 1}


def set_spread(mode):
    """Whether a call's threads, where they are not bound, move to distinct CPUs at the
    call's start (tests use this): "on", "off", or "auto" (as FASTATTN_SPREAD says;
    unset: on).  No bit depends on it."""
    if mode not in _SPREAD:
        raise ValueError(f"unknown spread mode {mode!r}; one of {sorted(_SPREAD)}")
    fa_set_spread(_SPREAD[mode])


def spread_moves():
    """How many threads the spread has moved to a free CPU since fastattn loaded: how
    often the scheduler had put two of a call's threads on one CPU."""
    return fa_spread_moves()


def spread_probe(int num_threads, bint herd=False):
    """A parallel region of num_threads threads that spreads as a call's does; herd: every
    thread but the caller put on the caller's CPU first.  Returns (start, joined, moved):
    each thread's CPU before and after the spread (-1 where unknown or the spread is off)
    and how many threads moved."""
    if num_threads < 1 or num_threads > 1024:
        raise ValueError(f"num_threads must be in 1..1024, got {num_threads}")
    cdef int start[1024]
    cdef int joined[1024]
    cdef int moved = 0, ran
    with nogil:
        ran = fa_spread_probe(num_threads, herd, start, joined, &moved)
    return [start[i] for i in range(ran)], [joined[i] for i in range(ran)], moved


def bf16_emulated():
    """Is this a test build whose bfloat16 products are emulated (FASTATTN_EMULATE_BF16)?"""
    return bool(FA_BF16_EMULATED)


def build_info():
    return {"build": fa_build_info().decode(), "openmp": bool(fa_openmp_enabled()),
            "max_threads": fa_max_threads(), "l2_bytes": fa_cpu_l2_bytes(),
            "l2_source": fa_cpu_l2_source().decode(),
            "bf16_avx512": bool(fa_cpu_bf16_features() & 1),
            "bf16_amx": bool(fa_cpu_bf16_features() & 2),
            "bf16_amx_refused": bool(fa_cpu_bf16_features() & 4),
            "bf16_pairs_slow": bool(fa_cpu_bf16_features() & 8),
            "bf16_bfdot": bool(fa_cpu_bf16_features() & 16),
            "bf16_sve": bool(fa_cpu_bf16_features() & 32)}


def max_threads():
    return fa_max_threads()


def last_num_threads():
    """How many threads ran this Python thread's last kernel call (for tests: it
    shows num_threads, OMP_NUM_THREADS and threadpoolctl reach the kernel)."""
    return fa_last_num_threads()


def bf16_to_f32(cnp.ndarray src, cnp.ndarray dst, int num_threads=0):
    """dst (uint32, C-contiguous) = the float32 bits of src's bfloat16 values (uint16,
    C-contiguous, as many), on num_threads threads (0 or less: OpenMP's default)."""
    if (cnp.PyArray_TYPE(src) != cnp.NPY_UINT16 or cnp.PyArray_TYPE(dst) != cnp.NPY_UINT32 or
            not cnp.PyArray_IS_C_CONTIGUOUS(src) or not cnp.PyArray_IS_C_CONTIGUOUS(dst) or
            cnp.PyArray_SIZE(src) != cnp.PyArray_SIZE(dst)):
        raise TypeError("bf16_to_f32: src uint16 and dst uint32, C-contiguous, of one size")
    with nogil:
        fa_bf16_to_f32(<const uint16_t *>cnp.PyArray_DATA(src), <uint32_t *>cnp.PyArray_DATA(dst),
                       cnp.PyArray_SIZE(src), num_threads)


def exp(cnp.ndarray x, kernel, bint logit=False):
    """exp(x) computed by `kernel`'s vectorized exp (x: contiguous float32/float64); with
    `logit`, by the cheaper exp its online softmax takes for the logits (FA_VEXP_LOGIT)."""
    cdef cnp.ndarray y = cnp.PyArray_EMPTY(1, cnp.PyArray_DIMS(x), cnp.PyArray_TYPE(x), 0)
    cdef int dt = FA_F32 if cnp.PyArray_TYPE(x) == cnp.NPY_FLOAT32 else FA_F64
    if cnp.PyArray_NDIM(x) != 1 or not cnp.PyArray_IS_C_CONTIGUOUS(x) or \
            cnp.PyArray_TYPE(x) not in (cnp.NPY_FLOAT32, cnp.NPY_FLOAT64):
        raise TypeError("x must be a 1-D contiguous float32 or float64 array")
    cdef int isa = _isa_index(kernel)
    cdef int rc
    with nogil:
        rc = fa_exp_array(isa, dt, cnp.PyArray_DATA(x), cnp.PyArray_DATA(y), cnp.PyArray_SIZE(x), logit)
    if rc != FA_OK:
        raise ValueError(f"kernel {kernel!r} cannot run on this CPU")
    return y


def fma_peak(kernel, bint float64, int num_threads):
    """GFLOP/s of `kernel`'s independent FMA chains (float32, or float64 if `float64`) on
    `num_threads` OpenMP threads, GIL released (fastattn.bench.fma_peak checks the
    arguments)."""
    cdef int isa = _isa_index(kernel)
    cdef double gf = 0.0
    cdef int rc
    with nogil:
        rc = fa_fma_peak(isa, FA_F64 if float64 else FA_F32, num_threads, &gf)
    if rc != FA_OK:
        raise ValueError(f"kernel {kernel!r} cannot run on this CPU")
    return gf


def read_bandwidth(cnp.ndarray buf, kernel, int num_threads, int passes):
    """(bytes a pass reads, the fastest pass's seconds, the sum of what it read) of
    `kernel`'s vector loads over the 1-D contiguous float32 or float64 array `buf`, on
    `num_threads` OpenMP threads: an untimed pass, then `passes` timed ones, GIL
    released (fastattn.bench.read_bandwidth checks the arguments)."""
    if cnp.PyArray_NDIM(buf) != 1 or not cnp.PyArray_IS_C_CONTIGUOUS(buf) or \
            cnp.PyArray_TYPE(buf) not in (cnp.NPY_FLOAT32, cnp.NPY_FLOAT64):
        raise TypeError("buf must be a 1-D contiguous float32 or float64 array")
    cdef int dt = FA_F32 if cnp.PyArray_TYPE(buf) == cnp.NPY_FLOAT32 else FA_F64
    cdef int isa = _isa_index(kernel)
    cdef int64_t nbytes = 0
    cdef double seconds = 0.0, total = 0.0
    cdef int rc
    with nogil:
        rc = fa_read_bandwidth(isa, dt, cnp.PyArray_DATA(buf), cnp.PyArray_SIZE(buf), num_threads, passes,
                               &nbytes, &seconds, &total)
    if rc != FA_OK:
        raise ValueError(f"kernel {kernel!r} cannot run on this CPU, or num_threads/passes < 1")
    return nbytes, seconds, total


def bf16_peak(path, int num_threads):
    """GFLOP/s of the bfloat16 pair path's independent chains (4 flops a lane) on
    `num_threads` threads, GIL released."""
    cdef int i, rc = FA_ERR_ARG
    cdef double gf = 0.0
    for i in range(FA_BF16_COUNT):
        if fa_bf16_path_name(i).decode() == path:
            with nogil:
                rc = fa_bf16_peak(i, num_threads, &gf)
    if rc != FA_OK:
        raise ValueError(f"bfloat16 path {path!r} has no pair instruction here; the paths are {bf16_paths()}")
    return gf


def plan_balance(tuple qshape, tuple kshape, int64_t Dv, bint float64, int causal,
                 int64_t window_left, int64_t window_right, bint bshd, seqlens_k,
                 int num_threads, kernel):
    """(work of each of num_threads threads, items) of the forward's schedule for
    q (B, Hq, Lq, D) and k (B, Hkv, Lk, D) in bhsd or bshd memory order, contiguous,
    without running it (fastattn.bench.plan_balance checks the arguments; seqlens_k:
    a contiguous int64 array of B entries or None)."""
    cdef fa_params p
    memset(&p, 0, sizeof(p))
    cdef int64_t B = qshape[0], Hq = qshape[1], Lq = qshape[2], D = qshape[3]
    cdef int64_t Hkv = kshape[1], Lk = kshape[2]
    cdef cnp.ndarray sk
    p.dtype = FA_F64 if float64 else FA_F32
    p.q_store = p.kv_store = p.out_store = p.dtype
    p.B, p.Hq, p.Hkv, p.Lq, p.Lk, p.D, p.Dv = B, Hq, Hkv, Lq, Lk, D, Dv
    if bshd:  # (B, L, H, D) in memory
        p.q_sb, p.q_sh, p.q_sl = Lq * Hq * D, D, Hq * D
        p.k_sb, p.k_sh, p.k_sl = Lk * Hkv * D, D, Hkv * D
        p.v_sb, p.v_sh, p.v_sl = Lk * Hkv * Dv, Dv, Hkv * Dv
        p.o_sb, p.o_sh, p.o_sl = Lq * Hq * Dv, Dv, Hq * Dv
    else:
        p.q_sb, p.q_sh, p.q_sl = Hq * Lq * D, Lq * D, D
        p.k_sb, p.k_sh, p.k_sl = Hkv * Lk * D, Lk * D, D
        p.v_sb, p.v_sh, p.v_sl = Hkv * Lk * Dv, Lk * Dv, Dv
        p.o_sb, p.o_sh, p.o_sl = Hq * Lq * Dv, Lq * Dv, Dv
    p.scale = 1.0
    p.causal = causal
    p.num_threads = num_threads
    p.isa = _isa_index(kernel)
    p.window_left, p.window_right = window_left, window_right
    if seqlens_k is not None:
        sk = seqlens_k
        p.seqlens_k = <const int64_t *>cnp.PyArray_DATA(sk)
    cdef cnp.ndarray work = cnp.PyArray_ZEROS(1, [max(num_threads, 1)], cnp.NPY_FLOAT64, 0)
    cdef int64_t nitems = 0
    cdef int rc
    with nogil:
        rc = fa_plan_balance(&p, num_threads, <double *>cnp.PyArray_DATA(work), &nitems)
    if rc != FA_OK:
        raise ValueError(f"the forward refuses these shapes: q {qshape}, k {kshape}")
    return work, nitems
