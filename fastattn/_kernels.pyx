# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Thin wrapper over src_c/fastattn.h: takes validated arrays from fastattn._api,
passes their pointers and element strides to C without the GIL, and turns C return
codes into exceptions.  No maths here.

One extension built from this file and the three it includes at its end:
_kernels_cpu.pxi (kernel and bfloat16-path selection, build facts, measurements),
_kernels_params.pxi (arrays into the fa_params struct, the Variants of a call) and
_kernels_calls.pxi (forward, backward, merge, key_mass and the common call)."""

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
        int64_t k_lanes
        const float *k_zero
        int k_bits, v_bits
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
    const char *fa_bf16_kernel_name()
    int FA_BF16_COUNT, FA_BF16_EMULATED
    int fa_set_default_isa(int isa)
    int fa_set_lookahead(int mode)
    int fa_set_lane_groups(int mode)
    const char *fa_isa_name(int isa)
    int fa_openmp_enabled()
    int fa_max_threads()
    int fa_last_num_threads()
    int fa_set_spread(int mode)
    long fa_spread_moves()
    int fa_spread_probe(int nth, int herd, int *start, int *joined, int *moved) nogil
    const char *fa_build_info()
    int fa_exp_array(int isa, int dtype, const void *x, void *y, int64_t n, int logit)
    void fa_bf16_to_f32(const uint16_t *src, uint32_t *dst, int64_t n, int nthreads)
    int fa_fma_peak(int isa, int dtype, int nthreads, double *gflops)
    int fa_bf16_peak(int path, int nthreads, double *gflops)
    int fa_read_bandwidth(int isa, int dtype, const void *buf, int64_t n, int nthreads, int passes,
                          int64_t *bytes, double *seconds, double *sum)
    int fa_plan_balance(const fa_params *p, int nthreads, double *work, int64_t *nitems)


include "_kernels_cpu.pxi"
include "_kernels_params.pxi"
include "_kernels_calls.pxi"
