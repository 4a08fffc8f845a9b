# Included by fastattn/_kernels.pyx (one extension: the cimports and the
# declarations of src_c/fastattn.h are there).
# The calls into the kernels (each kernel runs with the GIL released): forward, the
# common call decided at C speed, merge, backward and key_mass; with them the dropout
# decision of one weight, the bfloat16 type number and the XLA FFI handlers.

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


from libc.math cimport fmaf


def fma32(cnp.ndarray a, cnp.ndarray b, cnp.ndarray c, cnp.ndarray out):
    """out = fmaf(a, b, c) elementwise, one rounding (the dequantization of a
    fastattn.KVCache's quantized keys, as the kernels compute it): float32 C-contiguous
    arrays of one size, checked by the caller."""
    cdef const float *pa = <const float *>cnp.PyArray_DATA(a)
    cdef const float *pb = <const float *>cnp.PyArray_DATA(b)
    cdef const float *pc = <const float *>cnp.PyArray_DATA(c)
    cdef float *po = <float *>cnp.PyArray_DATA(out)
    cdef int64_t n = cnp.PyArray_SIZE(out), i
    with nogil:
        for i in range(n):
            po[i] = fmaf(pa[i], pb[i], pc[i])


def lanes_to_rows(cnp.ndarray k, cnp.ndarray scale, cnp.ndarray zero, cnp.ndarray out,
                  int64_t D, int64_t bs, int bits):
    """A fastattn.KVCache's keys from its blocks on the lanes to rows: k (N, blocks,
    D * bs) (int8 codes; with bits 4, ceil(D / 2) * bs bytes, byte (e, l) holding lane
    l's codes of channels 2e (low nibble) and 2e + 1 (high); or float32), scale and zero
    (N, blocks, D) float32 (codes only; else any array), out (N, blocks * bs, D)
    float32; element (n, j, d) = fmaf(code, scale, zero) (codes) or the value.
    C-contiguous arrays, checked by the caller."""
    cdef int64_t N = cnp.PyArray_DIM(out, 0), nb = cnp.PyArray_DIM(k, 1), n, b, d, l, j, at
    cdef int64_t kw = cnp.PyArray_DIM(k, 2)
    cdef const signed char *c8 = <const signed char *>cnp.PyArray_DATA(k)
    cdef const uint8_t *c4 = <const uint8_t *>cnp.PyArray_DATA(k)
    cdef const float *cf = <const float *>cnp.PyArray_DATA(k)
    cdef const float *s = <const float *>cnp.PyArray_DATA(scale)
    cdef const float *z = <const float *>cnp.PyArray_DATA(zero)
    cdef float *o = <float *>cnp.PyArray_DATA(out)
    cdef float sd, zd
    with nogil:
        for n in range(N):
            for b in range(nb):
                j = (n * nb + b) * bs
                at = (n * nb + b) * kw
                for d in range(D):
                    if bits == 0:
                        for l in range(bs):
                            o[(j + l) * D + d] = cf[at + d * bs + l]
                        continue
                    sd = s[(n * nb + b) * D + d]
                    zd = z[(n * nb + b) * D + d]
                    if bits == 8:
                        for l in range(bs):
                            o[(j + l) * D + d] = fmaf(<float>c8[at + d * bs + l], sd, zd)
                    else:
                        for l in range(bs):
                            o[(j + l) * D + d] = fmaf(
                                <float>((c4[at + (d >> 1) * bs + l] >> ((d & 1) << 2)) & 15), sd, zd)
