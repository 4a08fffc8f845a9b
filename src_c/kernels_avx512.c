/*
 * kernels_avx512.c -- the micro-kernels for AVX-512F (compiled with -mavx512f -mfma
 * -mavx2 -mf16c only; chosen at run time by cpu.c when CPUID and XGETBV allow it).
 *
 * Register tiles (32 zmm registers): QK^T 6 keys x 4 query vectors (24 accumulators,
 * 4 query loads, broadcasts folded into the FMAs); P.V 6 query rows x 4 value vectors.
 */
#include "kernels_avx512.h"

/* ---------------- float32 ---------------- */
#define FA_NAME(x) x##_f32_avx512
#include "kernels_tmpl.h"

/* ---------------- float32 with float16 K/V (decoding caches) ---------------- */
static inline __m512 fa_half_loadu_n(const uint16_t *p, int n)
{
    uint16_t tmp[16] = {0};
    memcpy(tmp, p, (size_t)n * sizeof(uint16_t));
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)tmp));
}
/* n floats to float16 (a float16 output), 16 at a time by vcvtps2ph (round to nearest
 * even, as fa_float_to_half: the same bits for every number); a group of 16 holding a
 * NaN goes through fa_float_to_half, whose NaN (sign | 0x7e00) keeps no payload.  (The
 * scalar loop of kern_common.h took 9% of a float16 B4 H16 L256 forward, AMD EPYC Zen 4.) */
static inline void fa_row_to_half_avx512(uint16_t *d, const float *s, int64_t n)
{
    int64_t c = 0;
    for (; c + 16 <= n; c += 16) {
        const __m512 x = _mm512_loadu_ps(s + c);
        if (_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q)) {
            for (int i = 0; i < 16; i++) d[c + i] = fa_float_to_half(s[c + i]);
            continue;
        }
        _mm256_storeu_si256((__m256i *)(void *)(d + c),
                            _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    for (; c < n; c++) d[c] = fa_float_to_half(s[c]);
}
/* The same float32 operations, K and V read as float16. */
#include "kernels_kv16.h"
/* the float32 instantiation's functions, which the 16-bit ones call on float32 copies
 * of their prefill tiles (kern_source.h, fa_tile_f32) */
#define FA_F32(x) x##_f32_avx512
#define FA_NAME(x) x##_kv16_avx512
#define FA_KV_HALF 1
#define FA_KV uint16_t
#define FA_KV_BCAST(p) _mm512_set1_ps(_cvtsh_ss(*(p)))
#define FA_KV_LOADU(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define FA_KV_LOADU_N(p, n) fa_half_loadu_n((p), (n))
#define FA_KV_SCALAR(x) fa_half_to_float(x)
#define FA_ROW_TO_16(d, s, n) fa_row_to_half_avx512((d), (s), (n))
#include "kernels_tmpl.h"

/* ---------------- float32 with bfloat16 K/V: a bfloat16 is a float's high half ---------------- */
#include "kernels_avx512_kvb16.h"
#define FA_NAME(x) x##_kvb16_avx512
#include "kernels_tmpl.h"
#include "kernels_undef.h"

/* ---------------- float64 ---------------- */
#define FA_T double
#define FA_V __m512d
#define FA_VL 8
#define FA_NAME(x) x##_f64_avx512
#define FA_QK_R 6
#define FA_QK_NV 4
#define FA_PV_R 6
#define FA_LANES_G34 4 /* 16 accumulators: 32 registers */
#define FA_PV_NC 4
#define FA_VLOAD(p) _mm512_load_pd(p)
#define FA_VSTORE(p, x) _mm512_store_pd((p), (x))
#define FA_VLOADU(p) _mm512_loadu_pd(p)
#define FA_VSTOREU(p, x) _mm512_storeu_pd((p), (x))
#define FA_VLOADU_N(p, n) _mm512_maskz_loadu_pd((__mmask8)((1u << (n)) - 1u), (p))
#define FA_VSET1(x) _mm512_set1_pd(x)
#define FA_VZERO() _mm512_setzero_pd()
#define FA_VADD(a, b) _mm512_add_pd((a), (b))
#define FA_VSUB(a, b) _mm512_sub_pd((a), (b))
#define FA_VMUL(a, b) _mm512_mul_pd((a), (b))
#define FA_VFMA(a, b, c) _mm512_fmadd_pd((a), (b), (c))
#define FA_VMAX(a, b) _mm512_max_pd((a), (b))
#define FA_VEXP(x) fa_exp_f64_avx512(x)
#define FA_VEXP_LOGIT(x) fa_exp_logit_f64_avx512(x)
#define FA_VNEGINF_TO_ZERO(x) fa_neginf_to_zero_pd(x)
#define FA_VREDUCE(x) _mm512_reduce_add_pd(x)
#define FA_VABS(x) _mm512_abs_pd(x)
#define FA_VDIV(a, b) _mm512_div_pd((a), (b))
#define FA_VCOPYSIGN(m, s) fa_copysign_pd((m), (s))
#define FA_VIN_RANGE(x, j, lo, hi) fa_in_range_pd((x), (j), (lo), (hi))
#define FA_VMASK_BYTES(x, p) fa_mask_bytes_pd((x), (p))
#define FA_VTRANSPOSE(r, o, d, s) fa_transpose_pd((r), (o), (d), (s))
#define FA_VTRANSPOSE_REGS(x) fa_transpose_regs_pd(x)
#include "kernels_tmpl.h"
#include "kernels_undef.h"

const fa_kernel fa_kernel_avx512 = {
    "avx512",
    {16, 8},
    {fa_qblock_f32_avx512, fa_qblock_f64_avx512, fa_qblock_kv16_avx512, fa_qblock_kvb16_avx512},
    {fa_scratch_bytes_f32_avx512, fa_scratch_bytes_f64_avx512, fa_scratch_bytes_kv16_avx512,
     fa_scratch_bytes_kvb16_avx512},
    {fa_exp_array_f32_avx512, fa_exp_array_f64_avx512},
    {fa_fma_chains_f32_avx512, fa_fma_chains_f64_avx512},
    {fa_read_streams_f32_avx512, fa_read_streams_f64_avx512},
    {fa_bwd_kv_f32_avx512, fa_bwd_kv_f64_avx512},
    {fa_bwd_q_f32_avx512, fa_bwd_q_f64_avx512},
    {fa_bwd_scratch_bytes_f32_avx512, fa_bwd_scratch_bytes_f64_avx512},
    {fa_bwd_reduce_f32_avx512, fa_bwd_reduce_f64_avx512},
    {fa_mass_kv_f32_avx512, fa_mass_kv_f64_avx512},
};
