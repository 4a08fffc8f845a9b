# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Thin wrapper over src_c/fastattn.h: takes validated arrays from fastattn._api,
passes their pointers and element strides to C without the GIL, and turns C return
codes into exceptions.  No maths here."""

cimport numpy as cnp
from libc.stdint cimport int64_t

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
    int FA_OK, FA_ERR_NOMEM, FA_ERR_ARG, FA_F32, FA_F64, FA_ISA_COUNT
    int fa_attention_forward(const fa_params *p)
    unsigned fa_cpu_supported_isas()
    int fa_cpu_select(const char *disabled, char *why, int why_len)
    int fa_default_isa()
    int fa_set_default_isa(int isa)
    const char *fa_isa_name(int isa)
    int fa_openmp_enabled()
    int fa_max_threads()
    const char *fa_build_info()
    int fa_exp_array(int isa, int dtype, const void *x, void *y, int64_t n)


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


def build_info():
    return {"build": fa_build_info().decode(), "openmp": bool(fa_openmp_enabled()),
            "max_threads": fa_max_threads()}


def max_threads():
    return fa_max_threads()


def exp(cnp.ndarray x, kernel):
    """exp(x) computed by `kernel`'s vectorized exp (x: contiguous float32/float64)."""
    cdef cnp.ndarray y = cnp.PyArray_EMPTY(1, cnp.PyArray_DIMS(x), cnp.PyArray_TYPE(x), 0)
    cdef int dt = FA_F32 if cnp.PyArray_TYPE(x) == cnp.NPY_FLOAT32 else FA_F64
    if cnp.PyArray_NDIM(x) != 1 or not cnp.PyArray_IS_C_CONTIGUOUS(x) or \
            cnp.PyArray_TYPE(x) not in (cnp.NPY_FLOAT32, cnp.NPY_FLOAT64):
        raise TypeError("x must be a 1-D contiguous float32 or float64 array")
    cdef int isa = _isa_index(kernel)
    cdef int rc
    with nogil:
        rc = fa_exp_array(isa, dt, cnp.PyArray_DATA(x), cnp.PyArray_DATA(y), cnp.PyArray_SIZE(x))
    if rc != FA_OK:
        raise ValueError(f"kernel {kernel!r} cannot run on this CPU")
    return y


cdef inline int64_t _st(cnp.ndarray a, int axis, int64_t item):
    return cnp.PyArray_STRIDES(a)[axis] // item


def forward(cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, cnp.ndarray out, lse_obj,
            double scale, int causal, int num_threads):
    """q (B,Hq,Lq,D), k (B,Hkv,Lk,D), v (B,Hkv,Lk,Dv), out (B,Hq,Lq,Dv), lse (B,Hq,Lq)
    or None: 4-D/3-D arrays of one float dtype, checked by fastattn._api (strides
    multiples of the item size, last axis contiguous, aligned, out writeable)."""
    cdef fa_params p
    cdef cnp.ndarray lse
    cdef int64_t item = cnp.PyArray_ITEMSIZE(q)
    cdef int rc
    if (cnp.PyArray_NDIM(q) != 4 or cnp.PyArray_NDIM(k) != 4 or cnp.PyArray_NDIM(v) != 4
            or cnp.PyArray_NDIM(out) != 4):
        raise ValueError("forward expects 4-D arrays")
    p.dtype = FA_F32 if cnp.PyArray_TYPE(q) == cnp.NPY_FLOAT32 else FA_F64
    p.q = cnp.PyArray_DATA(q)
    p.k = cnp.PyArray_DATA(k)
    p.v = cnp.PyArray_DATA(v)
    p.out = cnp.PyArray_DATA(out)
    p.B = cnp.PyArray_DIM(q, 0)
    p.Hq = cnp.PyArray_DIM(q, 1)
    p.Lq = cnp.PyArray_DIM(q, 2)
    p.D = cnp.PyArray_DIM(q, 3)
    p.Hkv = cnp.PyArray_DIM(k, 1)
    p.Lk = cnp.PyArray_DIM(k, 2)
    p.Dv = cnp.PyArray_DIM(v, 3)
    p.q_sb = _st(q, 0, item); p.q_sh = _st(q, 1, item); p.q_sl = _st(q, 2, item)
    p.k_sb = _st(k, 0, item); p.k_sh = _st(k, 1, item); p.k_sl = _st(k, 2, item)
    p.v_sb = _st(v, 0, item); p.v_sh = _st(v, 1, item); p.v_sl = _st(v, 2, item)
    p.o_sb = _st(out, 0, item); p.o_sh = _st(out, 1, item); p.o_sl = _st(out, 2, item)
    if lse_obj is None:
        p.lse = NULL
        p.lse_sb = p.lse_sh = p.lse_sl = 0
    else:
        lse = <cnp.ndarray>lse_obj
        p.lse = cnp.PyArray_DATA(lse)
        p.lse_sb = _st(lse, 0, item); p.lse_sh = _st(lse, 1, item); p.lse_sl = _st(lse, 2, item)
    p.scale = scale
    p.causal = causal
    p.num_threads = num_threads
    p.isa = -1
    with nogil:
        rc = fa_attention_forward(&p)
    if rc == FA_ERR_NOMEM:
        raise MemoryError("fastattn: could not allocate the per-thread scratch")
    if rc != FA_OK:
        raise ValueError("fastattn: the kernel rejected the arguments "
                         f"(B={p.B}, Hq={p.Hq}, Hkv={p.Hkv}, Lq={p.Lq}, Lk={p.Lk}, D={p.D}, Dv={p.Dv})")
    return out
