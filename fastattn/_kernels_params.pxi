# Included by fastattn/_kernels.pyx (one extension: the cimports and the
# declarations of src_c/fastattn.h are there).
# Arrays into the C parameter struct fa_params: what the kernel can read in place,
# shapes and element strides, and the optional arguments of a call (Variants).

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
    pool's page count num_pages, all checked by fastattn._cache; k_lanes, k_zero,
    k_bits, v_bits (fastattn.KVCache: K in blocks of k_lanes keys on the lanes, k a
    (B, Hkv, blocks, D * k_lanes) view of them (int4: half the bytes), its zero points
    laid out as k_scale; int4 V rows of ceil(Dv / 2) bytes, v_dim then Dv), checked by
    fastattn._kvcache."""
    cdef public object mask, bias, alibi, cu_q, cu_k, weights, entropy, max_weight, seqlens_k
    cdef public object sinks
    cdef public object k_scale, v_scale, block_table, k_zero
    cdef public int64_t num_pages, k_lanes, v_dim
    cdef public int k_bits, v_bits
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
        self.k_scale = self.v_scale = self.block_table = self.k_zero = None
        self.num_pages = self.k_lanes = self.v_dim = 0
        self.k_bits = self.v_bits = 0
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
        p.k_bits = va.k_bits
        p.v_bits = va.v_bits
        if va.v_bits == 4:  # two channels a byte: v's last axis is ceil(Dv / 2) bytes
            p.Dv = va.v_dim
        p.v_group = p.Dv // sh[3]
    if va.k_zero is not None:  # float32, laid out as k_scale
        p.k_zero = <const float *>cnp.PyArray_DATA(<cnp.ndarray>va.k_zero)
    if va.k_lanes:  # k: (B, Hkv, blocks, D * k_lanes) on the lanes
        p.k_lanes = va.k_lanes
        p.Lk = p.Lk * p.k_lanes
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
