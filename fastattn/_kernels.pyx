# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Thin wrapper over src_c/fastattn.h: takes validated arrays from fastattn._api,
passes their pointers and element strides to C without the GIL, and turns C return
codes into exceptions.  No maths here."""

cimport numpy as cnp
from libc.math cimport sqrt
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memset

cnp.import_array()

cdef extern from "fastattn.h" nogil:
    ctypedef struct fa_params:
        int dtype
        const void *q
        const void *k
        const void *v
        void *out
        void *lse
        int64_t B, Hq, Hkv, Lq, Lk, D, Dv
        int64_t q_sb, q_sh, q_sl
        int64_t k_sb, k_sh, k_sl
        int64_t v_sb, v_sh, v_sl
        int64_t o_sb, o_sh, o_sl
        int64_t lse_sb, lse_sh, lse_sl
        double scale
        int causal
        int num_threads
        int isa
        int q_store, kv_store, out_store
        int64_t block_q, block_k
        double softcap
        const void *alibi
        int64_t alibi_sb, alibi_sh
        const void *bias
        int64_t bias_sb, bias_sh, bias_sq, bias_sk
        const uint8_t *mask
        int64_t mask_sb, mask_sh, mask_sq, mask_sk
        int64_t window_left, window_right
        const int64_t *cu_q
        const int64_t *cu_k
        int positions
        int64_t q_pos0, k_pos0, alibi_shift
        const int64_t *seqlens_k
        void *weights
        int64_t w_sb, w_sh, w_sq
        void *entropy
        void *max_weight
        const void *sinks
        double dropout_p
        uint64_t seed
        const float *k_scale
        const float *v_scale
        int64_t ks_sb, ks_sh, ks_sl, vs_sb, vs_sh, vs_sl, k_group, v_group
        const int32_t *block_table
        int64_t bt_sb, max_blocks, page_size, num_pages
    ctypedef struct fa_bwd_params:
        fa_params f
        const void *dout
        int64_t do_sb, do_sh, do_sl
        void *dq
        int64_t dq_sb, dq_sh, dq_sl
        void *dk
        int64_t dk_sb, dk_sh, dk_sl
        void *dv
        int64_t dv_sb, dv_sh, dv_sl
        void *ds
        int64_t ds_sb, ds_sh, ds_sq
        int passes
        int bf16
        int grad16
    int fa_attention_backward(const fa_bwd_params *bp)
    int fa_key_mass(const fa_params *p, void *mass, int64_t m_sb, int64_t m_sh)
    int fa_dropout_keep(uint64_t seed, uint32_t threshold, int64_t b, int64_t h, int64_t i, int64_t j)
    uint32_t fa_dropout_threshold(double p)
    int FA_OK, FA_ERR_NOMEM, FA_ERR_ARG, FA_F32, FA_F64, FA_ISA_COUNT
    int FA_STORE_F32, FA_STORE_F64, FA_STORE_F16, FA_STORE_BF16, FA_STORE_I8
    int fa_attention_forward(const fa_params *p)
    int fa_merge(int dtype, int64_t parts, int64_t rows, int64_t dv, const void *outs,
                 const void *lses, void *out, void *lse)
    unsigned fa_cpu_supported_isas()
    int fa_cpu_select(const char *disabled, char *why, int why_len)
    int fa_default_isa()
    int64_t fa_cpu_l2_bytes()
    const char *fa_cpu_l2_source()
    unsigned fa_cpu_bf16_features()
    int fa_bf16_path()
    unsigned fa_bf16_paths()
    unsigned fa_bf16_paths_built()
    long fa_amx_model_ops()
    long fa_bf16_model_check(long count)
    int fa_set_bf16_path(int path)
    const char *fa_bf16_path_name(int path)
    int FA_BF16_COUNT, FA_BF16_EMULATED
    int fa_set_default_isa(int isa)
    int fa_set_lookahead(int mode)
    const char *fa_isa_name(int isa)
    int fa_openmp_enabled()
    int fa_max_threads()
    int fa_last_num_threads()
    const char *fa_build_info()
    int fa_exp_array(int isa, int dtype, const void *x, void *y, int64_t n, int logit)
    void fa_bf16_to_f32(const uint16_t *src, uint32_t *dst, int64_t n, int nthreads)
    int fa_fma_peak(int isa, int dtype, int nthreads, double *gflops)
    int fa_bf16_peak(int path, int nthreads, double *gflops)
    int fa_plan_balance(const fa_params *p, int nthreads, double *work, int64_t *nitems)


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
    vdpbf16ps pairs, avx512 kernel) and "amx-bf16" (the products on AMX tiles)."""
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
            "bf16_pairs_slow": bool(fa_cpu_bf16_features() & 8)}


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


cdef inline bint _readable(cnp.ndarray a, int64_t item):
    """Can the kernel read `a` in place: aligned, whole-element strides, a
    contiguous last axis (or one of length <= 1)?"""
    cdef int nd = cnp.PyArray_NDIM(a), ax
    cdef cnp.npy_intp *st = cnp.PyArray_STRIDES(a)
    if cnp.PyArray_SIZE(a) == 0:
        return True  # nothing is read
    if not cnp.PyArray_ISALIGNED(a):
        return False
    if cnp.PyArray_DIM(a, nd - 1) > 1 and st[nd - 1] != item:
        return False
    for ax in range(nd):
        if st[ax] % item:
            return False
    return True


cdef inline void _dims(cnp.ndarray a, int64_t item, int64_t *shape, int64_t *strides):
    """The (B, H, L, D) sizes and element strides of a 2-, 3- or 4-D array, leading
    axes it lacks having size 1 and stride 0."""
    cdef int nd = cnp.PyArray_NDIM(a), ax, off = 4 - nd
    for ax in range(4):
        if ax < off:
            shape[ax] = 1
            strides[ax] = 0
        else:
            shape[ax] = cnp.PyArray_DIM(a, ax - off)
            strides[ax] = cnp.PyArray_STRIDES(a)[ax - off] // item


cdef object _launch(cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, cnp.ndarray out, object lse_obj,
                    double scale, int causal, int num_threads, int64_t block_q=0,
                    int64_t block_k=0, object variants=None):
    """Fill the params struct from readable arrays and run the kernel without the GIL."""
    cdef fa_params p
    cdef int rc
    _fill(&p, q, k, v, out, lse_obj, scale, causal, num_threads, block_q, block_k, variants)
    with nogil:
        rc = fa_attention_forward(&p)
    _check_rc(rc, &p)
    return None


cdef void _check_rc(int rc, fa_params *p) except *:
    if rc == FA_ERR_NOMEM:
        raise MemoryError("fastattn: could not allocate the per-thread scratch")
    if rc != FA_OK:
        raise ValueError("fastattn: the kernel rejected the arguments "
                         f"(B={p.B}, Hq={p.Hq}, Hkv={p.Hkv}, Lq={p.Lq}, Lk={p.Lk}, D={p.D}, Dv={p.Dv})")


cdef inline int _storage(cnp.ndarray a):
    """The enum fa_storage of an array: float32, float64, or a 16-bit type (float16, or
    bfloat16: ml_dtypes' 2-byte float, which NumPy knows only as a user type), whose
    bits the kernels read and compute with in float32."""
    if cnp.PyArray_TYPE(a) == cnp.NPY_FLOAT64:
        return FA_STORE_F64
    if cnp.PyArray_TYPE(a) == cnp.NPY_FLOAT16:
        return FA_STORE_F16
    if cnp.PyArray_TYPE(a) == cnp.NPY_INT8:
        return FA_STORE_I8
    if cnp.PyArray_ITEMSIZE(a) == 2:
        return FA_STORE_BF16
    return FA_STORE_F32


cdef void _fill(fa_params *pp, cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, cnp.ndarray out,
                object lse_obj, double scale, int causal, int num_threads, int64_t block_q,
                int64_t block_k, object variants) except *:
    """The params struct of readable arrays q, k, v, out (and lse)."""
    cdef fa_params p
    cdef cnp.ndarray lse
    cdef int64_t item = 8 if cnp.PyArray_TYPE(q) == cnp.NPY_FLOAT64 else 4  # compute dtype
    cdef int64_t sh[4]
    cdef int64_t st[4]
    memset(&p, 0, sizeof(p))
    p.q_store = _storage(q)
    p.kv_store = _storage(k)
    p.out_store = _storage(out)
    p.dtype = FA_F64 if cnp.PyArray_TYPE(q) == cnp.NPY_FLOAT64 else FA_F32
    p.q = cnp.PyArray_DATA(q)
    p.k = cnp.PyArray_DATA(k)
    p.v = cnp.PyArray_DATA(v)
    p.out = cnp.PyArray_DATA(out)
    _dims(q, cnp.PyArray_ITEMSIZE(q), sh, st)
    p.B = sh[0]; p.Hq = sh[1]; p.Lq = sh[2]; p.D = sh[3]
    p.q_sb = st[0]; p.q_sh = st[1]; p.q_sl = st[2]
    _dims(k, cnp.PyArray_ITEMSIZE(k), sh, st)
    p.Hkv = sh[1]; p.Lk = sh[2]
    p.k_sb = st[0]; p.k_sh = st[1]; p.k_sl = st[2]
    _dims(v, cnp.PyArray_ITEMSIZE(v), sh, st)
    p.Dv = sh[3]
    p.v_sb = st[0]; p.v_sh = st[1]; p.v_sl = st[2]
    _dims(out, cnp.PyArray_ITEMSIZE(out), sh, st)
    p.o_sb = st[0]; p.o_sh = st[1]; p.o_sl = st[2]
    if lse_obj is not None:
        lse = <cnp.ndarray>lse_obj
        p.lse = cnp.PyArray_DATA(lse)
        _dims(lse, cnp.PyArray_ITEMSIZE(lse), sh, st)  # (B, Hq, Lq) right-aligned: strides in st[1:]
        p.lse_sb = st[1]; p.lse_sh = st[2]; p.lse_sl = st[3]
    p.scale = scale
    p.causal = causal
    p.num_threads = num_threads
    p.isa = -1
    p.block_q = block_q
    p.block_k = block_k
    p.window_left = -1
    p.window_right = -1
    if variants is not None:
        _set_variants(&p, <Variants>variants, item)
    pp[0] = p


cdef class Variants:
    """The optional arguments of one call, already checked and shaped by
    fastattn._api: mask (B, Hq, Lq, Lk) bool and bias (B, Hq, Lq, Lk) in q's dtype
    (broadcast views, strides 0 allowed), alibi (B, Hq) in q's dtype, softcap (0 =
    off), window sides (-1 = unbounded), cu_q/cu_k int64 (varlen; q, k, v are then
    (1, H, total, D) views and the sequence count is len(cu_q) - 1), weights
    (B, Hq, Lq, Lk) output for attention_weights, sinks (Hq,) contiguous in the
    compute dtype, dropout_p in [0, 1) and its seed
    (an int in [0, 2**64)); k_scale, v_scale (float32, int8 K/V: laid out like k and
    v with the group axis last) and block_table (int32 (B, max_blocks), contiguous
    rows; k and v are then (pages, Hkv, page_size, D) views of the pools) with the
    pool's page count num_pages, all checked by fastattn._cache."""
    cdef public object mask, bias, alibi, cu_q, cu_k, weights, entropy, max_weight, seqlens_k
    cdef public object sinks
    cdef public object k_scale, v_scale, block_table
    cdef public int64_t num_pages
    cdef public double softcap, dropout_p
    cdef public int64_t window_left, window_right, q_pos0, k_pos0, alibi_shift
    cdef public bint positions
    cdef public uint64_t seed

    def __init__(self, mask=None, bias=None, alibi=None, softcap=0.0, window_left=-1,
                 window_right=-1, cu_q=None, cu_k=None, weights=None, dropout_p=0.0, seed=0):
        self.dropout_p = dropout_p
        self.seed = seed
        self.entropy = None
        self.max_weight = None
        self.seqlens_k = None
        self.sinks = None
        self.k_scale = self.v_scale = self.block_table = None
        self.num_pages = 0
        self.positions = False  # q_pos0, k_pos0 give the positions (fastattn.h)
        self.q_pos0 = self.k_pos0 = self.alibi_shift = 0
        self.mask = mask
        self.bias = bias
        self.alibi = alibi
        self.softcap = softcap
        self.window_left = window_left
        self.window_right = window_right
        self.cu_q = cu_q
        self.cu_k = cu_k
        self.weights = weights


cdef void _set_variants(fa_params *p, Variants va, int64_t item) except *:
    cdef cnp.ndarray a
    cdef int64_t sh[4]
    cdef int64_t st[4]
    p.softcap = va.softcap
    p.dropout_p = va.dropout_p
    p.seed = va.seed
    p.window_left = va.window_left
    p.window_right = va.window_right
    p.positions = va.positions
    p.q_pos0 = va.q_pos0
    p.k_pos0 = va.k_pos0
    p.alibi_shift = va.alibi_shift
    if va.mask is not None:
        a = <cnp.ndarray>va.mask
        p.mask = <const uint8_t *>cnp.PyArray_DATA(a)
        _dims(a, 1, sh, st)
        p.mask_sb = st[0]; p.mask_sh = st[1]; p.mask_sq = st[2]; p.mask_sk = st[3]

    if va.bias is not None:
        a = <cnp.ndarray>va.bias
        p.bias = cnp.PyArray_DATA(a)
        _dims(a, item, sh, st)
        p.bias_sb = st[0]; p.bias_sh = st[1]; p.bias_sq = st[2]; p.bias_sk = st[3]
    if va.alibi is not None:
        a = <cnp.ndarray>va.alibi
        p.alibi = cnp.PyArray_DATA(a)
        p.alibi_sb = cnp.PyArray_STRIDES(a)[0] // item
        p.alibi_sh = cnp.PyArray_STRIDES(a)[1] // item
    if va.cu_q is not None:
        a = <cnp.ndarray>va.cu_q
        p.cu_q = <const int64_t *>cnp.PyArray_DATA(a)
        p.B = cnp.PyArray_DIM(a, 0) - 1
        a = <cnp.ndarray>va.cu_k
        p.cu_k = <const int64_t *>cnp.PyArray_DATA(a)
        # the sequences are offsets on the L axis: no batch axis to step along
        p.q_sb = p.k_sb = p.v_sb = p.o_sb = p.lse_sb = 0
    if va.sinks is not None:  # (Hq,) contiguous, in the compute dtype, checked by _args
        p.sinks = cnp.PyArray_DATA(<cnp.ndarray>va.sinks)
    if va.seqlens_k is not None:  # int64, (B,), contiguous, checked by fastattn._api
        p.seqlens_k = <const int64_t *>cnp.PyArray_DATA(<cnp.ndarray>va.seqlens_k)
    if va.k_scale is not None:  # float32, (B or pages, Hkv, L, groups), group axis contiguous
        a = <cnp.ndarray>va.k_scale
        p.k_scale = <const float *>cnp.PyArray_DATA(a)
        _dims(a, 4, sh, st)
        p.ks_sb = st[0]; p.ks_sh = st[1]; p.ks_sl = st[2]
        p.k_group = p.D // sh[3]
        a = <cnp.ndarray>va.v_scale
        p.v_scale = <const float *>cnp.PyArray_DATA(a)
        _dims(a, 4, sh, st)
        p.vs_sb = st[0]; p.vs_sh = st[1]; p.vs_sl = st[2]
        p.v_group = p.Dv // sh[3]
    if va.block_table is not None:  # int32 (B, max_blocks): k, v are the pools' pages
        a = <cnp.ndarray>va.block_table
        p.block_table = <const int32_t *>cnp.PyArray_DATA(a)
        p.bt_sb = cnp.PyArray_STRIDES(a)[0] // 4
        p.max_blocks = cnp.PyArray_DIM(a, 1)
        p.page_size = p.Lk
        p.Lk = p.max_blocks * p.page_size
        p.num_pages = va.num_pages
    if va.entropy is not None:  # laid out like lse (the kernel uses lse's strides)
        p.entropy = cnp.PyArray_DATA(<cnp.ndarray>va.entropy)
        p.max_weight = cnp.PyArray_DATA(<cnp.ndarray>va.max_weight)
    if va.weights is not None:
        a = <cnp.ndarray>va.weights
        p.weights = cnp.PyArray_DATA(a)
        _dims(a, item, sh, st)
        p.w_sb = st[0]; p.w_sh = st[1]; p.w_sq = st[2]


def forward(cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, cnp.ndarray out, lse_obj,
            double scale, int causal, int num_threads, int64_t block_q=0, int64_t block_k=0,
            Variants variants=None):
    """Run the kernel.  q (..., Hq, Lq, D), k (..., Hkv, Lk, D), v (..., Hkv, Lk, Dv),
    out (..., Hq, Lq, Dv): 2-, 3- or 4-D arrays with matching shapes (checked by
    fastattn._api), all float32, all float64, or float16 k/v with float32 q/out, or
    all float16; lse (..., Hq, Lq) or None, float64 for float64, else float32; the
    variants' arrays in the compute dtype (float64, else float32).  Returns False,
    without running, if q, k or v cannot be read in place (the caller copies them).
    block_q, block_k: block sizes for measurements (0: the library's choice).
    variants: the optional arguments (a Variants), or None."""
    if not (_readable(q, cnp.PyArray_ITEMSIZE(q)) and _readable(k, cnp.PyArray_ITEMSIZE(k))
            and _readable(v, cnp.PyArray_ITEMSIZE(v))):
        return False
    if not _readable(out, cnp.PyArray_ITEMSIZE(out)) or not cnp.PyArray_ISWRITEABLE(out):
        raise ValueError("out must be writeable, aligned, with a contiguous last axis")
    _launch(q, k, v, out, lse_obj, scale, causal, num_threads, block_q, block_k, variants)
    return True


cdef int _bf16_num = -1  # NumPy's type number of ml_dtypes.bfloat16, where it is installed


cdef extern from *:
    """
    #ifdef FA_HAVE_JAX_FFI
    void *fa_jax_ffi_forward(void);
    void *fa_jax_ffi_backward(void);
    #define FA_JAX_FFI 1
    #else
    static void *fa_jax_ffi_forward(void) { return 0; }
    static void *fa_jax_ffi_backward(void) { return 0; }
    #define FA_JAX_FFI 0
    #endif
    """
    void *fa_jax_ffi_forward()
    void *fa_jax_ffi_backward()
    int FA_JAX_FFI

from cpython.pycapsule cimport PyCapsule_New


def jax_ffi_targets():
    """The XLA FFI handlers (src_c/jax_ffi.cc) as PyCapsules, {"forward": ..,
    "backward": ..}, for jax.ffi.register_ffi_target; None where the build found no
    jaxlib headers."""
    if not FA_JAX_FFI:
        return None
    return {"forward": PyCapsule_New(fa_jax_ffi_forward(), NULL, NULL),
            "backward": PyCapsule_New(fa_jax_ffi_backward(), NULL, NULL)}


def set_bf16_dtype(object dtype):
    """Tell attention_common which user type number is bfloat16 (fastattn._args, at import)."""
    global _bf16_num
    _bf16_num = (<cnp.dtype>dtype).type_num


def attention_common(object q, object k, object v, bint causal, bint return_lse, int num_threads):
    """The common call -- ndarrays of one native float dtype (or float32 q against a
    float16 or bfloat16 cache: a decode step), consistent non-empty shapes, readable
    in place, default scale, no out -- decided and run at C speed.  Returns None,
    having done nothing, for anything else: the caller (fastattn._api.attention) then
    checks everything and explains errors."""
    cdef cnp.ndarray a, b, c
    if type(q) is not cnp.ndarray or type(k) is not cnp.ndarray or type(v) is not cnp.ndarray:
        return None
    a = <cnp.ndarray>q
    b = <cnp.ndarray>k
    c = <cnp.ndarray>v
    cdef int nd = cnp.PyArray_NDIM(a)
    cdef int t = cnp.PyArray_TYPE(a)
    if nd < 2 or nd > 4 or cnp.PyArray_NDIM(b) != nd or cnp.PyArray_NDIM(c) != nd:
        return None
    cdef int tk = cnp.PyArray_TYPE(b)
    cdef bint cache16 = (t == cnp.NPY_FLOAT32 and cnp.PyArray_TYPE(c) == tk and
                         (tk == cnp.NPY_FLOAT16 or (tk == _bf16_num and _bf16_num >= 0)))
    if not cache16 and ((t != cnp.NPY_FLOAT32 and t != cnp.NPY_FLOAT64) or tk != t
                        or cnp.PyArray_TYPE(c) != t):
        return None
    if not (cnp.PyArray_ISNOTSWAPPED(a) and cnp.PyArray_ISNOTSWAPPED(b) and cnp.PyArray_ISNOTSWAPPED(c)):
        return None
    cdef cnp.npy_intp *qd = cnp.PyArray_DIMS(a)
    cdef cnp.npy_intp *kd = cnp.PyArray_DIMS(b)
    cdef cnp.npy_intp *vd = cnp.PyArray_DIMS(c)
    cdef cnp.npy_intp D = qd[nd - 1], Lk = kd[nd - 2]
    if kd[nd - 1] != D or vd[nd - 2] != Lk or D == 0 or vd[nd - 1] == 0 or qd[nd - 2] == 0:
        return None
    if nd == 4 and (qd[0] != kd[0] or vd[0] != kd[0] or qd[0] == 0):
        return None
    if nd >= 3 and (vd[nd - 3] != kd[nd - 3] or kd[nd - 3] == 0 or qd[nd - 3] % kd[nd - 3] != 0
                    or qd[nd - 3] == 0):
        return None
    cdef int64_t item = cnp.PyArray_ITEMSIZE(a), kv_item = cnp.PyArray_ITEMSIZE(b)
    if not (_readable(a, item) and _readable(b, kv_item) and _readable(c, kv_item)):
        return None
    cdef cnp.npy_intp od[4]
    cdef int ax
    for ax in range(nd - 1):
        od[ax] = qd[ax]
    od[nd - 1] = vd[nd - 1]
    cdef cnp.ndarray out = cnp.PyArray_EMPTY(nd, od, t, 0)
    cdef object lse = cnp.PyArray_EMPTY(nd - 1, qd, t, 0) if return_lse else None
    _launch(a, b, c, out, lse, 1.0 / sqrt(<double>D), 1 if causal else 0, num_threads)
    return (out, lse) if return_lse else out


def merge(cnp.ndarray outs, cnp.ndarray lses, cnp.ndarray out, cnp.ndarray lse):
    """outs (P, rows, Dv), lses (P, rows), out (rows, Dv), lse (rows): C-contiguous,
    one float dtype (checked by fastattn._api.merge)."""
    cdef int dt = FA_F32 if cnp.PyArray_TYPE(outs) == cnp.NPY_FLOAT32 else FA_F64
    cdef int rc
    for a in (outs, lses, out, lse):
        if not cnp.PyArray_IS_C_CONTIGUOUS(a) or cnp.PyArray_TYPE(a) != cnp.PyArray_TYPE(outs):
            raise ValueError("merge expects C-contiguous arrays of one dtype")
    if (cnp.PyArray_NDIM(outs) != 3 or cnp.PyArray_NDIM(lses) != 2 or cnp.PyArray_NDIM(out) != 2
            or cnp.PyArray_NDIM(lse) != 1 or lses.shape[0] != outs.shape[0]
            or lses.shape[1] != outs.shape[1] or out.shape[0] != outs.shape[1]
            or out.shape[1] != outs.shape[2] or lse.shape[0] != outs.shape[1]):
        raise ValueError("merge: inconsistent shapes")
    cdef int64_t P = outs.shape[0], rows = outs.shape[1], dv = outs.shape[2]
    with nogil:
        rc = fa_merge(dt, P, rows, dv, cnp.PyArray_DATA(outs), cnp.PyArray_DATA(lses),
                      cnp.PyArray_DATA(out), cnp.PyArray_DATA(lse))
    if rc != FA_OK:
        raise ValueError("merge: the kernel rejected the arguments")


def backward(cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, cnp.ndarray out, cnp.ndarray lse,
             cnp.ndarray dout, cnp.ndarray dq, cnp.ndarray dk, cnp.ndarray dv, object ds_obj,
             double scale, int causal, int num_threads, int64_t block_q=0, int64_t block_k=0,
             Variants variants=None, int passes=0, int bf16=0):
    """Gradients of attention (fa_attention_backward): q, k, v, out, lse as for
    forward (the forward's output and lse), dout like out; dq, dk, dv written, with
    q's, k's, v's shapes; ds_obj (B, Hq, Lq, Lk) zeroed, key axis contiguous, or
    None.  One float dtype (float32 or float64) throughout, every array readable in
    place (checked by fastattn._api, which copies what is not).  passes: 0 the
    library's choice, 1 or 2 to force a schedule (tests: the bits are the same).
    bf16: q, k, v are float32 copies of bfloat16 arrays, so where a bfloat16 path runs
    the products take bfloat16 pairs (dout and the weights rounded to bfloat16); then
    dq, dk, dv may be bfloat16 arrays (2-byte items, all three), each gradient rounded
    from its float32 sum by the kernel."""
    cdef fa_bwd_params bp
    cdef int64_t item = cnp.PyArray_ITEMSIZE(q)
    cdef int64_t gitem = cnp.PyArray_ITEMSIZE(dq)
    cdef int64_t sh[4]
    cdef int64_t st[4]
    cdef cnp.ndarray a
    cdef int rc
    cdef int grad16 = bf16 != 0 and item == 4 and gitem == 2
    for a in (q, k, v, out, lse, dout):
        if not _readable(a, item) or cnp.PyArray_TYPE(a) != cnp.PyArray_TYPE(q):
            raise ValueError("backward: every array must be readable in place, of one dtype")
    for a in (dq, dk, dv):
        if not _readable(a, gitem) or (cnp.PyArray_ITEMSIZE(a) != 2 if grad16 else
                                       cnp.PyArray_TYPE(a) != cnp.PyArray_TYPE(q)):
            raise ValueError("backward: dq, dk, dv must be writable in place, of q's dtype "
                             "(or all bfloat16 with bf16)")
    memset(&bp, 0, sizeof(bp))
    _fill(&bp.f, q, k, v, out, lse, scale, causal, num_threads, block_q, block_k, variants)
    bp.dout = cnp.PyArray_DATA(dout)
    _dims(dout, item, sh, st)
    bp.do_sb = st[0]; bp.do_sh = st[1]; bp.do_sl = st[2]
    bp.dq = cnp.PyArray_DATA(dq)
    _dims(dq, gitem, sh, st)
    bp.dq_sb = st[0]; bp.dq_sh = st[1]; bp.dq_sl = st[2]
    bp.dk = cnp.PyArray_DATA(dk)
    _dims(dk, gitem, sh, st)
    bp.dk_sb = st[0]; bp.dk_sh = st[1]; bp.dk_sl = st[2]
    bp.dv = cnp.PyArray_DATA(dv)
    _dims(dv, gitem, sh, st)
    bp.dv_sb = st[0]; bp.dv_sh = st[1]; bp.dv_sl = st[2]
    if ds_obj is not None:
        a = <cnp.ndarray>ds_obj
        bp.ds = cnp.PyArray_DATA(a)
        _dims(a, item, sh, st)
        bp.ds_sb = st[0]; bp.ds_sh = st[1]; bp.ds_sq = st[2]
    bp.passes = passes
    bp.bf16 = bf16
    bp.grad16 = grad16
    with nogil:
        rc = fa_attention_backward(&bp)
    _check_rc(rc, &bp.f)


def dropout_keep(uint64_t seed, double p, int64_t b, int64_t h, int64_t i, int64_t j):
    """The kernel's dropout decision for weight (b, h, i, j) (True = kept)."""
    return bool(fa_dropout_keep(seed, fa_dropout_threshold(p), b, h, i, j))


def key_mass(cnp.ndarray q, cnp.ndarray k, cnp.ndarray lse, cnp.ndarray mass, double scale,
             int causal, int num_threads, Variants variants=None):
    """mass (B, Hq, Lk), keys contiguous, written: sum over the queries of each head of
    its weights, from the forward's lse.  q, k readable in place, float32 or float64
    (one dtype, with lse and mass)."""
    cdef fa_params p
    cdef int64_t item = cnp.PyArray_ITEMSIZE(q)
    cdef int64_t sh[4]
    cdef int64_t st[4]
    cdef int rc
    for a in (q, k, lse, mass):
        if not _readable(a, item) or cnp.PyArray_TYPE(a) != cnp.PyArray_TYPE(q):
            raise ValueError("key_mass: every array must be readable in place, of one dtype")
    if cnp.PyArray_NDIM(mass) != 3:
        raise ValueError("key_mass: mass must be (B, Hq, Lk)")
    _fill(&p, q, k, k, q, lse, scale, causal, num_threads, 0, 0, variants)
    with nogil:
        rc = fa_key_mass(&p, cnp.PyArray_DATA(mass), cnp.PyArray_STRIDES(mass)[0] // item,
                         cnp.PyArray_STRIDES(mass)[1] // item)
    _check_rc(rc, &p)
