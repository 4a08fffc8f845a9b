/*
 * kernels_avx512.h -- the AVX-512F pieces that kernels_avx512.c and kernels_avx512bf16.c
 * share: the vector exp, masks, copysign and register transposes, the 16-bit loads,
 * and the float32 vector operations of the kernel template (FA_T ... FA_I8_LOADU;
 * the including file names its instantiation with FA_NAME).  Include it only from a
 * file compiled with AVX-512F flags (or, in the emulated test build, over SIMDe).
 */
#ifndef FA_KERNELS_AVX512_H
#define FA_KERNELS_AVX512_H
#if defined(FA_EMULATE_BF16) && !defined(__AVX512F__)
/* the emulated test build of kernels_avx512bf16.c (setup.py, FASTATTN_EMULATE_BF16):
 * compiled for AVX2, every AVX-512 operation from SIMDe, so it runs on any AVX2 CPU */
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <string.h>
/* What SIMDe 0.7.4 lacks of the operations used here, through memory (a test build) */
static inline __m512i fa_emu_cvtepu16_epi32(__m256i x)
{
    uint16_t a[16];
    int32_t b[16];
    memcpy(a, &x, sizeof a);
    for (int i = 0; i < 16; i++) b[i] = a[i];
    return _mm512_loadu_si512((const void *)b);
}
static inline __m512i fa_emu_cvtepu8_epi32(__m128i x)
{
    uint8_t a[16];
    int32_t b[16];
    memcpy(a, &x, sizeof a);
    for (int i = 0; i < 16; i++) b[i] = a[i];
    return _mm512_loadu_si512((const void *)b);
}
static inline __m512i fa_emu_cvtepi8_epi32(__m128i x)
{
    int8_t a[16];
    int32_t b[16];
    memcpy(a, &x, sizeof a);
    for (int i = 0; i < 16; i++) b[i] = a[i];
    return _mm512_loadu_si512((const void *)b);
}
static inline __m512 fa_emu_cvtepi32_ps(__m512i x)
{
    int32_t a[16];
    float b[16];
    memcpy(a, &x, sizeof a);
    for (int i = 0; i < 16; i++) b[i] = (float)a[i];
    return _mm512_loadu_ps(b);
}
static inline __m512i fa_emu_maskz_loadu_epi16(uint32_t m, const void *p)
{
    uint16_t a[32] = {0};
    for (int i = 0; i < 32; i++)
        if (m >> i & 1) memcpy(a + i, (const char *)p + 2 * i, 2);
    return _mm512_loadu_si512((const void *)a);
}
static inline __m512 fa_emu_maskz_loadu_ps(uint32_t m, const void *p)
{
    float a[16] = {0};
    for (int i = 0; i < 16; i++)
        if (m >> i & 1) memcpy(a + i, (const char *)p + 4 * i, 4);
    return _mm512_loadu_ps(a);
}
static inline float fa_emu_reduce_add_ps(__m512 x)
{
    float a[16];
    memcpy(a, &x, sizeof a);
    for (int w = 8; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) a[i] += a[i + w];
    return a[0];
}
static inline __m256i fa_emu_cvtepi32_epi16(__m512i x) /* vpmovdw: the low halves */
{
    uint32_t a[16];
    uint16_t b[16];
    __m256i y;
    memcpy(a, &x, sizeof a);
    for (int i = 0; i < 16; i++) b[i] = (uint16_t)a[i];
    memcpy(&y, b, sizeof y);
    return y;
}
#define _mm512_cvtepi32_epi16(x) fa_emu_cvtepi32_epi16(x)
#define _mm512_cvtepu16_epi32(x) fa_emu_cvtepu16_epi32(x)
#define _mm512_cvtepu8_epi32(x) fa_emu_cvtepu8_epi32(x)
#define _mm512_cvtepi8_epi32(x) fa_emu_cvtepi8_epi32(x)
#define _mm512_cvtepi32_ps(x) fa_emu_cvtepi32_ps(x)
#define _mm512_maskz_loadu_epi16(m, p) fa_emu_maskz_loadu_epi16((uint32_t)(m), (p))
#define _mm512_maskz_loadu_ps(m, p) fa_emu_maskz_loadu_ps((uint32_t)(m), (p))
#define _mm512_reduce_add_ps(x) fa_emu_reduce_add_ps(x)
#define _mm512_shuffle_f32x4(a, b, imm) simde_mm512_shuffle_f32x4((a), (b), (imm))
#define _mm512_shuffle_f64x2(a, b, imm) simde_mm512_shuffle_f64x2((a), (b), (imm))
#else
#include <immintrin.h>
#endif
#include <math.h>
#include <string.h>
#include "fa_internal.h"
#include "fa_exp.h"

/* exp for 16 floats: Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, then
 * exp(r) by its degree-7 Taylor polynomial (truncation < 1e-8 relative) and
 * scalef (exact 2^n).  Error and range: fa_exp.h (max 0.91 ulp measured).  Lanes
 * below -86.5 (-inf included) are masked out of the final scalef, which zeroes
 * them without computing them (no subnormal, no assist; their n may be -inf and
 * r NaN, harmlessly).  The flush compare is true for NaN and min keeps a NaN input
 * (its second operand), so NaN stays NaN. */
static inline __m512 fa_exp_f32_avx512(__m512 x)
{
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(FA_EXP_F32_FLUSH), _CMP_NLT_UQ);
    x = _mm512_min_ps(_mm512_set1_ps(FA_EXP_F32_HI), x);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(FA_LOG2E_F)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(FA_LN2_HI_F), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(FA_LN2_LO_F), r);
    __m512 y = _mm512_set1_ps(FA_EXP_F32_C7);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(FA_EXP_F32_C6));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(FA_EXP_F32_C5));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(FA_EXP_F32_C4));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(FA_EXP_F32_C3));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(FA_EXP_F32_C2));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(keep, y, n); /* lanes below FLUSH: +0, never computed */
}

/* exp for 8 doubles: the same scheme with the degree-13 Taylor polynomial
 * (truncation < 6e-18 relative), range [-707, 710]. */
static inline __m512d fa_exp_f64_avx512(__m512d x)
{
    const __mmask8 keep = _mm512_cmp_pd_mask(x, _mm512_set1_pd(FA_EXP_F64_FLUSH), _CMP_NLT_UQ);
    x = _mm512_min_pd(_mm512_set1_pd(FA_EXP_F64_HI), x);
    __m512d n = _mm512_roundscale_pd(_mm512_mul_pd(x, _mm512_set1_pd(FA_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512d r = _mm512_fnmadd_pd(n, _mm512_set1_pd(FA_LN2_HI), x);
    r = _mm512_fnmadd_pd(n, _mm512_set1_pd(FA_LN2_LO), r);
    __m512d y = _mm512_set1_pd(fa_exp_f64_coef[FA_EXP_F64_DEG]);
    for (int i = FA_EXP_F64_DEG - 1; i >= 0; i--)
        y = _mm512_fmadd_pd(y, r, _mm512_set1_pd(fa_exp_f64_coef[i]));
    return _mm512_maskz_scalef_pd(keep, y, n);
}

/* e^x for the softmax's logits (x = s - m: at most 0, or NaN) in fewer instructions than
 * fa_exp_f32_avx512: n = round(x log2(e)), f = x log2(e) - n by one FMA (x log2(e)
 * rounded once, in f), 2^f by the AVX2 kernel's fitted degree-6 polynomial in powers of
 * f (fa_exp.h), and scalef by n.  Against the Cody-Waite exp it drops the clamp (scalef
 * overflows to +inf by itself) and one FMA each of the reduction and of the polynomial
 * (11 instructions, not 14).  The price: f carries log2(e)'s float32 rounding times x,
 * a relative error of at most u (2 + |x| / 4) (u = 2^-24; tests/test_exp.py) against
 * the exp's 1 ulp: a weight e^x is off by at most (2 + |x| / 4) u e^x, under 2u of the
 * row's largest weight.  e^0 = 1 exactly (n = f = 0, the polynomial's constant term is 1): a row's
 * largest logit still weighs 1.  Lanes with x log2(e) < -125 (-inf included) give +0
 * and are never computed; NaN stays NaN. */
FA_ALWAYS_INLINE void fa_exp_logit_n_f32_avx512(__m512 *x, const int nv)
{
    /* nv (<= 4) vectors side by side, each through the same instructions as alone: the
     * exp's chain is ~40 cycles of latency, and independent chains next to each other
     * in the stream keep the FP scheduler fed */
    const __m512 l2e = _mm512_set1_ps(FA_LOG2E_F);
    __m512 n[4], f[4], p[4];
    __mmask16 live[4];
    FA_PRAGMA_UNROLL(4)
    for (int k = 0; k < nv; k++) {
        const __m512 y = _mm512_mul_ps(x[k], l2e);
        live[k] = _mm512_cmp_ps_mask(y, _mm512_set1_ps(FA_EXP2_F32_FLUSH), _CMP_NLT_UQ);
        n[k] = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    FA_PRAGMA_UNROLL(4)
    for (int k = 0; k < nv; k++) f[k] = _mm512_fmsub_ps(x[k], l2e, n[k]);
    FA_PRAGMA_UNROLL(4)
    for (int k = 0; k < nv; k++)
        p[k] = _mm512_fmadd_ps(_mm512_set1_ps(FA_EXP2_F32_P6), f[k], _mm512_set1_ps(FA_EXP2_F32_P5));
    static const float coef[5] = {FA_EXP2_F32_P4, FA_EXP2_F32_P3, FA_EXP2_F32_P2, FA_EXP2_F32_P1, 1.0f};
    FA_PRAGMA_UNROLL(5)
    for (int i = 0; i < 5; i++) {
        FA_PRAGMA_UNROLL(4)
        for (int k = 0; k < nv; k++) p[k] = _mm512_fmadd_ps(p[k], f[k], _mm512_set1_ps(coef[i]));
    }
    FA_PRAGMA_UNROLL(4)
    for (int k = 0; k < nv; k++) x[k] = _mm512_maskz_scalef_ps(live[k], p[k], n[k]);
}
static inline __m512 fa_exp_logit_f32_avx512(__m512 x)
{
    fa_exp_logit_n_f32_avx512(&x, 1);
    return x;
}

/* The same for 8 doubles: 2^f by the degree-11 fit of fa_exp.h (the AVX2 kernel's:
 * truncation 0.18 u over |f| <= 1/2, two dependent FMAs fewer than the degree-13 Taylor
 * polynomial, which the float64 softmax paid for in ~2% of a D=64 prefill: 1 thread,
 * B1 H8 L2048, 80.2% of the float64 FMA peak before, 81.7% after), +0 below
 * x log2(e) = -1021; relative error at most u (2 + |x| / 4), u = 2^-53 (measured: 0.92 of it). */
static inline __m512d fa_exp_logit_f64_avx512(__m512d x)
{
    const __m512d l2e = _mm512_set1_pd(FA_LOG2E), y = _mm512_mul_pd(x, l2e);
    const __mmask8 live = _mm512_cmp_pd_mask(y, _mm512_set1_pd(FA_EXP2_F64_FLUSH), _CMP_NLT_UQ);
    const __m512d n = _mm512_roundscale_pd(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512d f = _mm512_fmsub_pd(x, l2e, n);
    __m512d p = _mm512_set1_pd(fa_exp2_f64_fit[FA_EXP2_F64_FIT_DEG]);
    for (int i = FA_EXP2_F64_FIT_DEG - 1; i >= 0; i--)
        p = _mm512_fmadd_pd(p, f, _mm512_set1_pd(fa_exp2_f64_fit[i]));
    return _mm512_maskz_scalef_pd(live, p, n);
}

static inline __m512 fa_neginf_to_zero_ps(__m512 x)
{
    __mmask16 inf = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
    return _mm512_mask_blend_ps(inf, x, _mm512_setzero_ps());
}
static inline __m512d fa_neginf_to_zero_pd(__m512d x)
{
    __mmask8 inf = _mm512_cmp_pd_mask(x, _mm512_set1_pd(-INFINITY), _CMP_EQ_OQ);
    return _mm512_mask_blend_pd(inf, x, _mm512_setzero_pd());
}

static inline __m512 fa_copysign_ps(__m512 mag, __m512 sgn)
{
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_andnot_si512(sign, _mm512_castps_si512(mag)),
                                               _mm512_and_si512(sign, _mm512_castps_si512(sgn))));
}
static inline __m512d fa_copysign_pd(__m512d mag, __m512d sgn)
{
    const __m512i sign = _mm512_set1_epi64((long long)0x8000000000000000ull);
    return _mm512_castsi512_pd(_mm512_or_si512(_mm512_andnot_si512(sign, _mm512_castpd_si512(mag)),
                                               _mm512_and_si512(sign, _mm512_castpd_si512(sgn))));
}
static inline __m512 fa_in_range_ps(__m512 x, __m512 j, __m512 lo, __m512 hi)
{
    __mmask16 in = _mm512_cmp_ps_mask(lo, j, _CMP_LE_OQ) & _mm512_cmp_ps_mask(j, hi, _CMP_LE_OQ);
    return _mm512_mask_blend_ps(in, _mm512_set1_ps(-INFINITY), x);
}
static inline __m512d fa_in_range_pd(__m512d x, __m512d j, __m512d lo, __m512d hi)
{
    __mmask8 in = _mm512_cmp_pd_mask(lo, j, _CMP_LE_OQ) & _mm512_cmp_pd_mask(j, hi, _CMP_LE_OQ);
    return _mm512_mask_blend_pd(in, _mm512_set1_pd(-INFINITY), x);
}
static inline __m512 fa_mask_bytes_ps(__m512 x, const uint8_t *p)
{
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm512_mask_blend_ps(_mm512_test_epi32_mask(b, b), _mm512_set1_ps(-INFINITY), x);
}
static inline __m512d fa_mask_bytes_pd(__m512d x, const uint8_t *p)
{
    __m512i b = _mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i *)p));
    return _mm512_mask_blend_pd(_mm512_test_epi64_mask(b, b), _mm512_set1_pd(-INFINITY), x);
}

/* Bias tiles are read row by row and transposed in registers (fa_bias_tile):
 * dst[t * ds + i] = rows[i][off + t] for a 16 x 16 float or 8 x 8 double block.
 * Element unpacks within 128-bit lanes, then a 4 x 4 transpose of the lanes:
 * 64 shuffles per 256 floats, 24 per 64 doubles (a gather cost far more). */
#define FA_HAVE_TRANSPOSE 1
/* out[l] = lane l of g0, g1, g2, g3 (a 4 x 4 transpose of 128-bit lanes). */
#define FA_LANES_4X4(sh, g0, g1, g2, g3, o0, o1, o2, o3)                                         \
    do {                                                                                         \
        const __typeof__(g0) u0 = sh(g0, g1, 0x44), u1 = sh(g0, g1, 0xEE), u2 = sh(g2, g3, 0x44), \
                             u3 = sh(g2, g3, 0xEE);                                              \
        o0 = sh(u0, u2, 0x88);                                                                   \
        o1 = sh(u0, u2, 0xDD);                                                                   \
        o2 = sh(u1, u3, 0x88);                                                                   \
        o3 = sh(u1, u3, 0xDD);                                                                   \
    } while (0)
static inline void fa_transpose_regs_ps(__m512 *x)
{
    __m512 b[16], c[16];
    for (int i = 0; i < 8; i++) { /* lane L: row 2i, 2i+1 at columns 4L, 4L+1 | 4L+2, 4L+3 */
        b[2 * i] = _mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]);
        b[2 * i + 1] = _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]);
    }
    for (int g = 0; g < 4; g++) { /* c[4g + m], lane L: column 4L + m of rows 4g .. 4g+3 */
        const __m512d x0 = _mm512_castps_pd(b[4 * g]), x1 = _mm512_castps_pd(b[4 * g + 1]),
                      x2 = _mm512_castps_pd(b[4 * g + 2]), x3 = _mm512_castps_pd(b[4 * g + 3]);
        c[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(x0, x2));
        c[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(x0, x2));
        c[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(x1, x3));
        c[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(x1, x3));
    }
    for (int m = 0; m < 4; m++)
        FA_LANES_4X4(_mm512_shuffle_f32x4, c[m], c[4 + m], c[8 + m], c[12 + m], x[m], x[4 + m],
                     x[8 + m], x[12 + m]);
}
static inline void fa_transpose_ps(const float *const *rows, int64_t off, float *dst, int64_t ds)
{
    __m512 a[16];
    for (int i = 0; i < 16; i++) a[i] = _mm512_loadu_ps(rows[i] + off);
    fa_transpose_regs_ps(a);
    for (int t = 0; t < 16; t++) _mm512_store_ps(dst + t * ds, a[t]);
}
static inline void fa_transpose_regs_pd(__m512d *x)
{
    __m512d b[8];
    for (int i = 0; i < 4; i++) { /* lane L: column 2L (lo) or 2L+1 (hi) of rows 2i, 2i+1 */
        b[2 * i] = _mm512_unpacklo_pd(x[2 * i], x[2 * i + 1]);
        b[2 * i + 1] = _mm512_unpackhi_pd(x[2 * i], x[2 * i + 1]);
    }
    for (int m = 0; m < 2; m++)
        FA_LANES_4X4(_mm512_shuffle_f64x2, b[m], b[2 + m], b[4 + m], b[6 + m], x[m], x[2 + m],
                     x[4 + m], x[6 + m]);
}
static inline void fa_transpose_pd(const double *const *rows, int64_t off, double *dst, int64_t ds)
{
    __m512d a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm512_loadu_pd(rows[i] + off);
    fa_transpose_regs_pd(a);
    for (int t = 0; t < 8; t++) _mm512_store_pd(dst + t * ds, a[t]);
}


/* float32 -> bfloat16 bits in the low half of each lane, fa_float_to_bf16's: round to
 * nearest even, NaN stays a (quiet) NaN, subnormals kept (vcvtneps2bf16 flushes them) */
static inline __m512i fa_bf16_round(__m512 x)
{
    const __m512i b = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_blend_epi32(nan, r, _mm512_or_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x40)));
}
/* n floats to bfloat16 (fa_float_to_bf16's bits), 16 at a time: the output rows of a
 * bfloat16 call (as a scalar loop, 4% of a short AMX prefill's samples).  In the files
 * built for AVX512-BF16 a vector without subnormals takes vcvtneps2bf16, whose bits are
 * fa_float_to_bf16's everywhere but there (it flushes them; 2e7 random patterns with
 * ties, infs and NaN payloads compared on a Sapphire Rapids class Xeon): four
 * instructions rather than nine, where 8% of a short AMX prefill went to its rows. */
static inline void fa_row_to_bf16(uint16_t *d, const float *s, int64_t n)
{
    int64_t c = 0;
    for (; c + 16 <= n; c += 16) {
        const __m512 x = _mm512_loadu_ps(s + c);
#if defined(__AVX512BF16__) && !defined(FA_EMULATE_BF16)
        /* subnormal: 1 <= |bits| <= 0x7FFFFF, as (|bits| - 1) < 0x7FFFFF unsigned */
        const __m512i m1 = _mm512_sub_epi32(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF)),
                                            _mm512_set1_epi32(1));
        if (!_mm512_cmplt_epu32_mask(m1, _mm512_set1_epi32(0x7FFFFF))) {
            _mm256_storeu_si256((__m256i *)(void *)(d + c), (__m256i)_mm512_cvtneps_pbh(x));
            continue;
        }
#endif
        _mm256_storeu_si256((__m256i *)(void *)(d + c), _mm512_cvtepi32_epi16(fa_bf16_round(x)));
    }
    for (; c < n; c++) d[c] = fa_float_to_bf16(s[c]);
}
/* a bfloat16 is a float's high half */
static inline __m512 fa_bf16_loadu(const uint16_t *p)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline __m512 fa_bf16_loadu_n(const uint16_t *p, int n)
{
    uint16_t tmp[16] = {0};
    memcpy(tmp, p, (size_t)n * sizeof(uint16_t));
    return fa_bf16_loadu(tmp);
}

/* x's lanes added by halves (lane k + 8 into lane k, then + 4, + 2, + 1): the chains of
 * kern_softmax.h's fa_tile_sums, in three shuffles and four adds */
static inline float fa_hsum_halves_ps(__m512 x)
{
    const __m256 y = _mm256_add_ps(_mm512_castps512_ps256(x),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    const __m128 z = _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
    const __m128 w = _mm_add_ps(z, _mm_movehl_ps(z, z));
    return _mm_cvtss_f32(_mm_add_ss(w, _mm_shuffle_ps(w, w, 1)));
}
/* x's largest lane, or a NaN lane where there is one (a max's value does not depend on
 * the order, but for a zero's sign) */
static inline float fa_hmax_nan_ps(__m512 x)
{
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    if (nan) {
        float lanes[16];
        _mm512_storeu_ps(lanes, x);
        return lanes[__builtin_ctz(nan)];
    }
    const __m256 y = _mm256_max_ps(_mm512_castps512_ps256(x),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    const __m128 z = _mm_max_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
    const __m128 w = _mm_max_ps(z, _mm_movehl_ps(z, z));
    return _mm_cvtss_f32(_mm_max_ss(w, _mm_shuffle_ps(w, w, 1)));
}

/* ---------------- the float32 vector operations (kernels_tmpl.h lists them) ---------------- */
#define FA_T float
#define FA_V __m512
#define FA_VL 16
#define FA_QK_R 6
#define FA_QK_NV 4
#define FA_PV_R 6
#define FA_LANES_G34 4 /* 16 accumulators: 32 registers */
#define FA_PV_NC 4
#define FA_VLOAD(p) _mm512_load_ps(p)
#define FA_VSTORE(p, x) _mm512_store_ps((p), (x))
#define FA_VLOADU(p) _mm512_loadu_ps(p)
#define FA_VSTOREU(p, x) _mm512_storeu_ps((p), (x))
#define FA_VLOADU_N(p, n) _mm512_maskz_loadu_ps((__mmask16)((1u << (n)) - 1u), (p))
#define FA_VSET1(x) _mm512_set1_ps(x)
#define FA_VZERO() _mm512_setzero_ps()
#define FA_VADD(a, b) _mm512_add_ps((a), (b))
#define FA_VSUB(a, b) _mm512_sub_ps((a), (b))
#define FA_VMUL(a, b) _mm512_mul_ps((a), (b))
#define FA_VFMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define FA_VMAX(a, b) _mm512_max_ps((a), (b))
#define FA_VEXP(x) fa_exp_f32_avx512(x)
#define FA_VEXP_LOGIT(x) fa_exp_logit_f32_avx512(x)
#define FA_VEXP_LOGIT4(x) fa_exp_logit_n_f32_avx512((x), 4)
#define FA_VNEGINF_TO_ZERO(x) fa_neginf_to_zero_ps(x)
#define FA_VREDUCE(x) _mm512_reduce_add_ps(x)
#define FA_VHSUM_HALVES(x) fa_hsum_halves_ps(x)
#define FA_VHMAX_NAN(x) fa_hmax_nan_ps(x)
#define FA_VABS(x) _mm512_abs_ps(x)
#define FA_VDIV(a, b) _mm512_div_ps((a), (b))
#define FA_VCOPYSIGN(m, s) fa_copysign_ps((m), (s))
#define FA_VIN_RANGE(x, j, lo, hi) fa_in_range_ps((x), (j), (lo), (hi))
#define FA_VMASK_BYTES(x, p) fa_mask_bytes_ps((x), (p))
#define FA_VTRANSPOSE(r, o, d, s) fa_transpose_ps((r), (o), (d), (s))
#define FA_VTRANSPOSE_REGS(x) fa_transpose_regs_ps(x)
/* 16 int8 of an int8 cache as float32 (exact) */
#define FA_I8_LOADU(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(p))))
/* 16 int8 in a register as float32 (exact) */
#define FA_I8_CVT(x) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(x))
/* int4 codes through a table of their 16 values: vpermps reads only an index's low 4
 * bits, so 16 bytes widened to 32 bits index the table with their low nibbles as they
 * are and with their high nibbles after one shift; no masks, no conversions, and the
 * table (16 values computed as the conversions would) gives the same bits */
#define FA_LUT16_I __m512i
#define FA_LUT16_WIDEN(x) _mm512_cvtepu8_epi32(x)
#define FA_LUT16_LO(w, t) _mm512_permutexvar_ps((w), (t))
#define FA_LUT16_HI(w, t) _mm512_permutexvar_ps(_mm512_srli_epi32((w), 4), (t))
#define FA_LUT16_IOTA() _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f, 14.f, 15.f)
#endif /* FA_KERNELS_AVX512_H */
