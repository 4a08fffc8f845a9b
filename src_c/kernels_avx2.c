/*
 * kernels_avx2.c -- the micro-kernels for AVX2 + FMA + F16C (compiled with -mavx2
 * -mfma -mf16c only; chosen at run time by cpu.c).
 *
 * Register tiles (16 ymm registers): QK^T 4 keys x 3 query vectors (12 accumulators,
 * 3 loads, 1 broadcast) and P.V 6 query rows x 2 value vectors (12 accumulators, 2
 * loads, 1 broadcast).  QK^T's 4 x 3 replaced 6 x 2: 7 loads to 12 FMAs instead of 8,
 * and a 64-key tile in whole groups of 4, where 6 x 2 ended each tile on a 4-key
 * group of 8 accumulators (AMD EPYC with AVX2, 1 thread, perf samples: the QK^T
 * function 4% fewer in float32 L4096 D64, ~7% fewer against P.V's in float64; the
 * same products in the same order, so the same bits).  float64's prefill P.V runs in
 * QK^T's shape with the output transposed (FA_PV_T below, fa_pvt_tile).
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>
#include "fa_internal.h"
#include "fa_exp.h"

/* exp for 8 floats: the scheme, error and range of fa_exp.h.  n = round(x log2 e)
 * comes from one FMA against a magic constant (x log2 e + 1.5 * 2^23 + 126 rounds to
 * an integer, whose low mantissa bits are n + 126), so 2^(n-1) is that float's bits
 * shifted left by 23: no round instruction, no conversion.  The polynomial's
 * coefficients are doubled (exact), giving 2 exp(r), and 2 exp(r) * 2^(n-1) is one
 * multiply by a normal power of two for every n in [-125, 128]: exact, and it
 * overflows to +inf where exp does.  Lanes below FLUSH (-inf included; their n and r
 * are garbage or NaN) are masked to +0; a NaN x gives a NaN y and so a NaN result
 * (min keeps its second operand). */
static inline __m256 fa_exp_f32_avx2(__m256 x)
{
    const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(FA_EXP_F32_FLUSH), _CMP_NLT_UQ);
    const __m256 magic = _mm256_set1_ps(FA_EXP_F32_MAGIC);
    x = _mm256_min_ps(_mm256_set1_ps(FA_EXP_F32_HI), x);
    const __m256 j = _mm256_fmadd_ps(x, _mm256_set1_ps(FA_LOG2E_F), magic);
    const __m256 n = _mm256_sub_ps(j, magic);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(FA_LN2_HI_F), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(FA_LN2_LO_F), r);
    __m256 y = _mm256_set1_ps(2 * FA_EXP_F32_M6);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(2 * FA_EXP_F32_M5));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(2 * FA_EXP_F32_M4));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(2 * FA_EXP_F32_M3));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(2 * FA_EXP_F32_M2));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(2.0f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(2.0f));
    const __m256 two_n = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(j), 23));
    return _mm256_and_ps(keep, _mm256_mul_ps(y, two_n));
}

/* e^x for the softmax's logits (kernels_avx512.h: fa_exp_logit_f32_avx512): 2^y with
 * y = x log2(e), n = round(y) from the magic FMA as above, f = x log2(e) - n by one more
 * FMA (so y is rounded once, in f), 2^f by the same fitted polynomial in powers of f
 * (fa_exp.h, doubled): the two Cody-Waite steps become one (13 instructions, not 14);
 * relative error at most u (2 + |x| / 4), u = 2^-24 (tests/test_exp.py); e^0 = 1 exactly.
 *
 * For nv vectors at once (a constant after inlining), each step for all of them before
 * the next: the exp is one chain of ~11 dependent instructions, and written one vector
 * after another the chains' waiting tails fill the FP scheduler, so fewer of them
 * overlap than the ports could run (measured on the AMD EPYC with AVX2, the softmax's
 * loop over a 64-key tile in L1: 6.60 rdtsc ticks a vector one at a time, 5.84 four
 * at a time; the same instructions, so the same bits). */
FA_ALWAYS_INLINE void fa_exp_logit_n_f32_avx2(__m256 *x, const int nv)
{
    const __m256 magic = _mm256_set1_ps(FA_EXP_F32_MAGIC), l2e = _mm256_set1_ps(FA_LOG2E_F);
    __m256 keep[4], j[4], f[4], y[4];
    FA_PRAGMA_UNROLL(4)
    for (int k = 0; k < nv; k++) {
        keep[k] = _mm256_cmp_ps(x[k], _mm256_set1_ps(FA_EXP_F32_FLUSH), _CMP_NLT_UQ);
        x[k] = _mm256_min_ps(_mm256_set1_ps(FA_EXP_F32_HI), x[k]);
    }
    FA_PRAGMA_UNROLL(4)
    for (int k = 0; k < nv; k++) j[k] = _mm256_fmadd_ps(x[k], l2e, magic);
    FA_PRAGMA_UNROLL(4)
    for (int k = 0; k < nv; k++) f[k] = _mm256_fmsub_ps(x[k], l2e, _mm256_sub_ps(j[k], magic));
    FA_PRAGMA_UNROLL(4)
    for (int k = 0; k < nv; k++)
        y[k] = _mm256_fmadd_ps(_mm256_set1_ps(2 * FA_EXP2_F32_P6), f[k], _mm256_set1_ps(2 * FA_EXP2_F32_P5));
    static const float coef[5] = {2 * FA_EXP2_F32_P4, 2 * FA_EXP2_F32_P3, 2 * FA_EXP2_F32_P2,
                                  2 * FA_EXP2_F32_P1, 2.0f};
    FA_PRAGMA_UNROLL(5)
    for (int i = 0; i < 5; i++) {
        FA_PRAGMA_UNROLL(4)
        for (int k = 0; k < nv; k++) y[k] = _mm256_fmadd_ps(y[k], f[k], _mm256_set1_ps(coef[i]));
    }
    FA_PRAGMA_UNROLL(4)
    for (int k = 0; k < nv; k++) {
        const __m256 two_n = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(j[k]), 23));
        x[k] = _mm256_and_ps(keep[k], _mm256_mul_ps(y[k], two_n));
    }
}
static inline __m256 fa_exp_logit_f32_avx2(__m256 x)
{
    fa_exp_logit_n_f32_avx2(&x, 1);
    return x;
}

/* The same for doubles (the float64 softmax's logits): the magic 1.5 * 2^52 + 1022,
 * and 2^f by the degree-11 fit of fa_exp.h (FA_EXP2_F64_FIT_DEG, doubled) instead of
 * fa_exp_f64_avx2's two Cody-Waite steps and degree-13 Taylor polynomial: 19
 * instructions, not 22; relative error at most u (2 + |x| / 4), u = 2^-53.  Four
 * vectors at a time, the float64 softmax's loop took 9.1-10.0 rdtsc ticks a vector,
 * against 13.7 for fa_exp_f64_avx2 one at a time (as above). */
FA_ALWAYS_INLINE void fa_exp_logit_n_f64_avx2(__m256d *x, const int nv)
{
    const __m256d magic = _mm256_set1_pd(FA_EXP_F64_MAGIC), l2e = _mm256_set1_pd(FA_LOG2E);
    __m256d keep[4], j[4], f[4], y[4];
    FA_PRAGMA_UNROLL(4)
    for (int k = 0; k < nv; k++) {
        keep[k] = _mm256_cmp_pd(x[k], _mm256_set1_pd(FA_EXP_F64_FLUSH), _CMP_NLT_UQ);
        x[k] = _mm256_min_pd(_mm256_set1_pd(FA_EXP_F64_HI), x[k]);
    }
    FA_PRAGMA_UNROLL(4)
    for (int k = 0; k < nv; k++) j[k] = _mm256_fmadd_pd(x[k], l2e, magic);
    FA_PRAGMA_UNROLL(4)
    for (int k = 0; k < nv; k++) {
        f[k] = _mm256_fmsub_pd(x[k], l2e, _mm256_sub_pd(j[k], magic));
        y[k] = _mm256_set1_pd(2 * fa_exp2_f64_fit[FA_EXP2_F64_FIT_DEG]);
    }
    FA_PRAGMA_UNROLL(11)
    for (int i = FA_EXP2_F64_FIT_DEG - 1; i >= 0; i--) {
        FA_PRAGMA_UNROLL(4)
        for (int k = 0; k < nv; k++) y[k] = _mm256_fmadd_pd(y[k], f[k], _mm256_set1_pd(2 * fa_exp2_f64_fit[i]));
    }
    FA_PRAGMA_UNROLL(4)
    for (int k = 0; k < nv; k++) {
        const __m256d two_n = _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_castpd_si256(j[k]), 52));
        x[k] = _mm256_and_pd(keep[k], _mm256_mul_pd(y[k], two_n));
    }
}
static inline __m256d fa_exp_logit_f64_avx2(__m256d x)
{
    fa_exp_logit_n_f64_avx2(&x, 1);
    return x;
}

/* exp for 4 doubles: the same scheme (magic 1.5 * 2^52 + 1022, the exponent field
 * 52 bits up, n in [-1020, 1024]) with the degree-13 Taylor polynomial, doubled. */
static inline __m256d fa_exp_f64_avx2(__m256d x)
{
    const __m256d keep = _mm256_cmp_pd(x, _mm256_set1_pd(FA_EXP_F64_FLUSH), _CMP_NLT_UQ);
    const __m256d magic = _mm256_set1_pd(FA_EXP_F64_MAGIC);
    x = _mm256_min_pd(_mm256_set1_pd(FA_EXP_F64_HI), x);
    const __m256d j = _mm256_fmadd_pd(x, _mm256_set1_pd(FA_LOG2E), magic);
    const __m256d n = _mm256_sub_pd(j, magic);
    __m256d r = _mm256_fnmadd_pd(n, _mm256_set1_pd(FA_LN2_HI), x);
    r = _mm256_fnmadd_pd(n, _mm256_set1_pd(FA_LN2_LO), r);
    __m256d y = _mm256_set1_pd(2 * fa_exp_f64_coef[FA_EXP_F64_DEG]);
    for (int i = FA_EXP_F64_DEG - 1; i >= 0; i--)
        y = _mm256_fmadd_pd(y, r, _mm256_set1_pd(2 * fa_exp_f64_coef[i]));
    const __m256d two_n = _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_castpd_si256(j), 52));
    return _mm256_and_pd(keep, _mm256_mul_pd(y, two_n));
}

static inline __m256 fa_neginf_to_zero_ps(__m256 x)
{
    __m256 inf = _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
    return _mm256_andnot_ps(inf, x);
}
static inline __m256d fa_neginf_to_zero_pd(__m256d x)
{
    __m256d inf = _mm256_cmp_pd(x, _mm256_set1_pd(-INFINITY), _CMP_EQ_OQ);
    return _mm256_andnot_pd(inf, x);
}

static inline __m256 fa_loadu_n_ps(const float *p, int n)
{
    __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes));
}
static inline __m256d fa_loadu_n_pd(const double *p, int n)
{
    __m256i lanes = _mm256_setr_epi64x(0, 1, 2, 3);
    return _mm256_maskload_pd(p, _mm256_cmpgt_epi64(_mm256_set1_epi64x(n), lanes));
}

static inline __m256 fa_abs_ps(__m256 x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }
static inline __m256d fa_abs_pd(__m256d x) { return _mm256_andnot_pd(_mm256_set1_pd(-0.0), x); }
static inline __m256 fa_copysign_ps(__m256 mag, __m256 sgn)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    return _mm256_or_ps(_mm256_andnot_ps(sign, mag), _mm256_and_ps(sign, sgn));
}
static inline __m256d fa_copysign_pd(__m256d mag, __m256d sgn)
{
    const __m256d sign = _mm256_set1_pd(-0.0);
    return _mm256_or_pd(_mm256_andnot_pd(sign, mag), _mm256_and_pd(sign, sgn));
}
static inline __m256 fa_in_range_ps(__m256 x, __m256 j, __m256 lo, __m256 hi)
{
    __m256 in = _mm256_and_ps(_mm256_cmp_ps(lo, j, _CMP_LE_OQ), _mm256_cmp_ps(j, hi, _CMP_LE_OQ));
    return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), x, in);
}
static inline __m256d fa_in_range_pd(__m256d x, __m256d j, __m256d lo, __m256d hi)
{
    __m256d in = _mm256_and_pd(_mm256_cmp_pd(lo, j, _CMP_LE_OQ), _mm256_cmp_pd(j, hi, _CMP_LE_OQ));
    return _mm256_blendv_pd(_mm256_set1_pd(-INFINITY), x, in);
}
static inline __m256 fa_mask_bytes_ps(__m256 x, const uint8_t *p)
{
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256 hidden = _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, _mm256_setzero_si256()));
    return _mm256_blendv_ps(x, _mm256_set1_ps(-INFINITY), hidden);
}
static inline __m256d fa_mask_bytes_pd(__m256d x, const uint8_t *p)
{
    int32_t four;
    memcpy(&four, p, sizeof four);
    __m256i b = _mm256_cvtepu8_epi64(_mm_cvtsi32_si128(four));
    __m256d hidden = _mm256_castsi256_pd(_mm256_cmpeq_epi64(b, _mm256_setzero_si256()));
    return _mm256_blendv_pd(x, _mm256_set1_pd(-INFINITY), hidden);
}

/* Bias tiles are read row by row and transposed in registers (fa_bias_tile):
 * dst[t * ds + i] = rows[i][off + t] for an 8 x 8 float or 4 x 4 double block
 * (unpacks within 128-bit halves, then the halves exchanged). */
#define FA_HAVE_TRANSPOSE 1
/* x[t] lane i <- x[i] lane t, in registers (the decode product transposes key rows
 * this way; fa_transpose_ps stores the same for bias tiles). */
static inline void fa_transpose_regs_ps(__m256 *x)
{
    __m256 b[8], c[8];
    for (int i = 0; i < 4; i++) { /* half H: rows 2i, 2i+1 at columns 4H, 4H+1 | 4H+2, 4H+3 */
        b[2 * i] = _mm256_unpacklo_ps(x[2 * i], x[2 * i + 1]);
        b[2 * i + 1] = _mm256_unpackhi_ps(x[2 * i], x[2 * i + 1]);
    }
    for (int g = 0; g < 2; g++) { /* c[4g + m], half H: column 4H + m of rows 4g .. 4g+3 */
        const __m256d x0 = _mm256_castps_pd(b[4 * g]), x1 = _mm256_castps_pd(b[4 * g + 1]),
                      x2 = _mm256_castps_pd(b[4 * g + 2]), x3 = _mm256_castps_pd(b[4 * g + 3]);
        c[4 * g] = _mm256_castpd_ps(_mm256_unpacklo_pd(x0, x2));
        c[4 * g + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(x0, x2));
        c[4 * g + 2] = _mm256_castpd_ps(_mm256_unpacklo_pd(x1, x3));
        c[4 * g + 3] = _mm256_castpd_ps(_mm256_unpackhi_pd(x1, x3));
    }
    for (int m = 0; m < 4; m++) {
        x[m] = _mm256_permute2f128_ps(c[m], c[4 + m], 0x20);
        x[4 + m] = _mm256_permute2f128_ps(c[m], c[4 + m], 0x31);
    }
}
static inline void fa_transpose_ps(const float *const *rows, int64_t off, float *dst, int64_t ds)
{
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_loadu_ps(rows[i] + off);
    fa_transpose_regs_ps(a);
    for (int t = 0; t < 8; t++) _mm256_store_ps(dst + t * ds, a[t]);
}
static inline void fa_transpose_regs_pd(__m256d *x)
{
    __m256d b[4];
    for (int i = 0; i < 2; i++) { /* half H: column 2H (lo) or 2H+1 (hi) of rows 2i, 2i+1 */
        b[2 * i] = _mm256_unpacklo_pd(x[2 * i], x[2 * i + 1]);
        b[2 * i + 1] = _mm256_unpackhi_pd(x[2 * i], x[2 * i + 1]);
    }
    for (int m = 0; m < 2; m++) {
        x[m] = _mm256_permute2f128_pd(b[m], b[2 + m], 0x20);
        x[2 + m] = _mm256_permute2f128_pd(b[m], b[2 + m], 0x31);
    }
}
static inline void fa_transpose_pd(const double *const *rows, int64_t off, double *dst, int64_t ds)
{
    __m256d a[4];
    for (int i = 0; i < 4; i++) a[i] = _mm256_loadu_pd(rows[i] + off);
    fa_transpose_regs_pd(a);
    for (int t = 0; t < 4; t++) _mm256_store_pd(dst + t * ds, a[t]);
}
static inline float fa_reduce_ps(__m256 x)
{
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
    return _mm_cvtss_f32(h);
}
static inline double fa_reduce_pd(__m256d x)
{
    __m128d h = _mm_add_pd(_mm256_castpd256_pd128(x), _mm256_extractf128_pd(x, 1));
    return _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
}

/* ---------------- float32 ---------------- */
#define FA_T float
#define FA_V __m256
#define FA_VL 8
#define FA_NAME(x) x##_f32_avx2
#define FA_QK_R 4
#define FA_QK_NV 3
#define FA_PV_R 6
#define FA_PV_NC 2
#define FA_VLOAD(p) _mm256_load_ps(p)
#define FA_VSTORE(p, x) _mm256_store_ps((p), (x))
#define FA_VLOADU(p) _mm256_loadu_ps(p)
#define FA_VSTOREU(p, x) _mm256_storeu_ps((p), (x))
#define FA_VLOADU_N(p, n) fa_loadu_n_ps((p), (n))
#define FA_VSET1(x) _mm256_set1_ps(x)
#define FA_VZERO() _mm256_setzero_ps()
#define FA_VADD(a, b) _mm256_add_ps((a), (b))
#define FA_VSUB(a, b) _mm256_sub_ps((a), (b))
#define FA_VMUL(a, b) _mm256_mul_ps((a), (b))
#define FA_VFMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define FA_VMAX(a, b) _mm256_max_ps((a), (b))
#define FA_VEXP(x) fa_exp_f32_avx2(x)
#define FA_VEXP_LOGIT(x) fa_exp_logit_f32_avx2(x)
#define FA_VEXP_LOGIT4(x) fa_exp_logit_n_f32_avx2((x), 4)
#define FA_VNEGINF_TO_ZERO(x) fa_neginf_to_zero_ps(x)
#define FA_VREDUCE(x) fa_reduce_ps(x)
#define FA_VABS(x) fa_abs_ps(x)
#define FA_VDIV(a, b) _mm256_div_ps((a), (b))
#define FA_VCOPYSIGN(m, s) fa_copysign_ps((m), (s))
#define FA_VIN_RANGE(x, j, lo, hi) fa_in_range_ps((x), (j), (lo), (hi))
#define FA_VMASK_BYTES(x, p) fa_mask_bytes_ps((x), (p))
#define FA_VTRANSPOSE(r, o, d, s) fa_transpose_ps((r), (o), (d), (s))
#define FA_VTRANSPOSE_REGS(x) fa_transpose_regs_ps(x)
/* 8 int8 of an int8 cache as float32 (exact) */
#define FA_I8_LOADU(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(p))))
/* the low 8 int8 of a register as float32 (exact) */
#define FA_I8_CVT(x) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x))
#include "kernels_tmpl.h"

/* ---------------- float32 with float16 K/V (decoding caches) ---------------- */
static inline __m256 fa_half_loadu_n(const uint16_t *p, int n)
{
    uint16_t tmp[8] = {0};
    memcpy(tmp, p, (size_t)n * sizeof(uint16_t));
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)tmp));
}
/* v[e] <- features e (low lane) and 8 + e (high lane) of the 8 rows at kd, kd + row,
 * ...: 16 values of each row loaded at once and transposed as 16-bit integers, each
 * lane an 8 x 8 transpose (24 shuffles for 16 features, where transposing each
 * chunk's floats takes 48). */
static inline void fa_kv16_pair_avx2(const char *kd, int64_t row, __m256i *v)
{
    __m256i a[8], b[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_loadu_si256((const __m256i *)(const void *)(kd + i * row));
    for (int i = 0; i < 4; i++) { /* rows 2i, 2i+1 interleaved: features 0-3 | 4-7 */
        b[2 * i] = _mm256_unpacklo_epi16(a[2 * i], a[2 * i + 1]);
        b[2 * i + 1] = _mm256_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
    }
    for (int g = 0; g < 2; g++) { /* rows 4g .. 4g+3: a[4g + m] features 2m, 2m+1 */
        a[4 * g] = _mm256_unpacklo_epi32(b[4 * g], b[4 * g + 2]);
        a[4 * g + 1] = _mm256_unpackhi_epi32(b[4 * g], b[4 * g + 2]);
        a[4 * g + 2] = _mm256_unpacklo_epi32(b[4 * g + 1], b[4 * g + 3]);
        a[4 * g + 3] = _mm256_unpackhi_epi32(b[4 * g + 1], b[4 * g + 3]);
    }
    for (int m = 0; m < 4; m++) { /* feature 2m and 2m+1 of all 8 rows */
        v[2 * m] = _mm256_unpacklo_epi64(a[m], a[4 + m]);
        v[2 * m + 1] = _mm256_unpackhi_epi64(a[m], a[4 + m]);
    }
}
/* n floats to float16, 8 at a time by F16C (round to nearest even, as
 * fa_float_to_half: the same bits for every number); a group of 8 holding a NaN goes
 * through fa_float_to_half, whose NaN (sign | 0x7e00) keeps no payload. */
static inline void fa_row_to_half_avx2(uint16_t *d, const float *s, int64_t n)
{
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) {
        const __m256 x = _mm256_loadu_ps(s + c);
        if (_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q))) {
            for (int i = 0; i < 8; i++) d[c + i] = fa_float_to_half(s[c + i]);
            continue;
        }
        _mm_storeu_si128((__m128i *)(void *)(d + c), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    for (; c < n; c++) d[c] = fa_float_to_half(s[c]);
}
/* The same float32 operations, K and V read as float16. */
#include "kernels_kv16.h"
/* the float32 instantiation's functions, which the 16-bit ones call on float32 copies
 * of their prefill tiles (kern_source.h, fa_tile_f32) */
#define FA_F32(x) x##_f32_avx2
#define FA_NAME(x) x##_kv16_avx2
#define FA_KV_HALF 1
#define FA_KV uint16_t
#define FA_KV_BCAST(p) _mm256_set1_ps(_cvtsh_ss(*(p)))
#define FA_KV_LOADU(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define FA_KV_LOADU_N(p, n) fa_half_loadu_n((p), (n))
#define FA_KV_SCALAR(x) fa_half_to_float(x)
#define FA_KV16_V __m256i
#define FA_KV16_PAIR(kd, row, v) fa_kv16_pair_avx2((kd), (row), (v))
#define FA_KV16_LO(x) _mm256_cvtph_ps(_mm256_castsi256_si128(x))
#define FA_KV16_HI(x) _mm256_cvtph_ps(_mm256_extracti128_si256((x), 1))
#define FA_ROW_TO_16(d, s, n) fa_row_to_half_avx2((d), (s), (n))
#include "kernels_tmpl.h"

/* ---------------- float32 with bfloat16 K/V: a bfloat16 is a float's high half ---------------- */
static inline __m256 fa_bf16_loadu(const uint16_t *p)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline __m256 fa_bf16_loadu_n(const uint16_t *p, int n)
{
    uint16_t tmp[8] = {0};
    memcpy(tmp, p, (size_t)n * sizeof(uint16_t));
    return fa_bf16_loadu(tmp);
}
#include "kernels_kv16.h"
#define FA_NAME(x) x##_kvb16_avx2
#define FA_KV_HALF 1
#define FA_KV uint16_t
#define FA_KV_BCAST(p) _mm256_set1_ps(fa_bf16_to_float(*(p)))
#define FA_KV_LOADU(p) fa_bf16_loadu(p)
#define FA_KV_LOADU_N(p, n) fa_bf16_loadu_n((p), (n))
#define FA_KV_SCALAR(x) fa_bf16_to_float(x)
#define FA_KV16_V __m256i
#define FA_KV16_PAIR(kd, row, v) fa_kv16_pair_avx2((kd), (row), (v))
#define FA_KV16_LO(x) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(x)), 16))
#define FA_KV16_HI(x) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256((x), 1)), 16))
#define FA_16_TO_FLOAT(x) fa_bf16_to_float(x)
#define FA_FLOAT_TO_16(x) fa_float_to_bf16(x)
#include "kernels_tmpl.h"
#include "kernels_undef.h"

/* ---------------- float64 ---------------- */
#define FA_T double
#define FA_V __m256d
#define FA_VL 4
#define FA_NAME(x) x##_f64_avx2
#define FA_QK_R 4
#define FA_QK_NV 3
#define FA_PV_R 6
#define FA_PV_NC 2
/* prefill P.V with the output transposed, in QK^T's 4 x 3 tile (fa_pvt_tile): float64
 * only.  AMD EPYC (Zen 4 part, AVX2), 2 threads, bench/ab_speed.py, B/A median time
 * against the 6 x 2 tile of fa_pv_tile, two runs of 7 and 9 rounds: float64 B1 H8 L2048
 * D64 0.95 / 0.97, D128 0.95 / 0.92; float32 level (L4096 D64 1.03 / 1.02, L2048 D128
 * 1.00 / 0.99, causal 0.93 / 1.01), so float32 keeps fa_pv_tile.  (Defined for float32
 * too, its 16-bit instantiations would take FA_F32(fa_pvt_tile) on their converted tiles:
 * built that way once (2026-12-04), 304 outputs, float16 and bfloat16 among them, had the same
 * bits.) */
#define FA_PV_T 1
#define FA_VLOAD(p) _mm256_load_pd(p)
#define FA_VSTORE(p, x) _mm256_store_pd((p), (x))
#define FA_VLOADU(p) _mm256_loadu_pd(p)
#define FA_VSTOREU(p, x) _mm256_storeu_pd((p), (x))
#define FA_VLOADU_N(p, n) fa_loadu_n_pd((p), (n))
#define FA_VSET1(x) _mm256_set1_pd(x)
#define FA_VZERO() _mm256_setzero_pd()
#define FA_VADD(a, b) _mm256_add_pd((a), (b))
#define FA_VSUB(a, b) _mm256_sub_pd((a), (b))
#define FA_VMUL(a, b) _mm256_mul_pd((a), (b))
#define FA_VFMA(a, b, c) _mm256_fmadd_pd((a), (b), (c))
#define FA_VMAX(a, b) _mm256_max_pd((a), (b))
#define FA_VEXP(x) fa_exp_f64_avx2(x)
#define FA_VEXP_LOGIT(x) fa_exp_logit_f64_avx2(x)
#define FA_VEXP_LOGIT4(x) fa_exp_logit_n_f64_avx2((x), 4)
#define FA_VNEGINF_TO_ZERO(x) fa_neginf_to_zero_pd(x)
#define FA_VREDUCE(x) fa_reduce_pd(x)
#define FA_VABS(x) fa_abs_pd(x)
#define FA_VDIV(a, b) _mm256_div_pd((a), (b))
#define FA_VCOPYSIGN(m, s) fa_copysign_pd((m), (s))
#define FA_VIN_RANGE(x, j, lo, hi) fa_in_range_pd((x), (j), (lo), (hi))
#define FA_VMASK_BYTES(x, p) fa_mask_bytes_pd((x), (p))
#define FA_VTRANSPOSE(r, o, d, s) fa_transpose_pd((r), (o), (d), (s))
#define FA_VTRANSPOSE_REGS(x) fa_transpose_regs_pd(x)
#include "kernels_tmpl.h"
#include "kernels_undef.h"

const fa_kernel fa_kernel_avx2 = {
    "avx2",
    {8, 4},
    {fa_qblock_f32_avx2, fa_qblock_f64_avx2, fa_qblock_kv16_avx2, fa_qblock_kvb16_avx2},
    {fa_scratch_bytes_f32_avx2, fa_scratch_bytes_f64_avx2, fa_scratch_bytes_kv16_avx2,
     fa_scratch_bytes_kvb16_avx2},
    {fa_exp_array_f32_avx2, fa_exp_array_f64_avx2},
    {fa_fma_chains_f32_avx2, fa_fma_chains_f64_avx2},
    {fa_read_streams_f32_avx2, fa_read_streams_f64_avx2},
    {fa_bwd_kv_f32_avx2, fa_bwd_kv_f64_avx2},
    {fa_bwd_q_f32_avx2, fa_bwd_q_f64_avx2},
    {fa_bwd_scratch_bytes_f32_avx2, fa_bwd_scratch_bytes_f64_avx2},
    {fa_bwd_reduce_f32_avx2, fa_bwd_reduce_f64_avx2},
    {fa_mass_kv_f32_avx2, fa_mass_kv_f64_avx2},
};
