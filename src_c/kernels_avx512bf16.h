/*
 * kernels_avx512bf16.h -- the bfloat16 pair operations (FA_DP_*, kern_bf16dp.h) on
 * AVX512-BF16 that kernels_avx512bf16.c and kernels_amx.c share: vdpbf16ps, the
 * rounding of float32 to bfloat16 pairs, the pair loads and the V row zip.  Include it
 * after kernels_avx512.h, from a file compiled with -mavx512bf16 (or, in the emulated
 * test build, FA_EMULATE_BF16, over SIMDe).
 */
#ifndef FA_KERNELS_AVX512BF16_H
#define FA_KERNELS_AVX512BF16_H
#define FA_DP_V __m512i
#define FA_DP_LOAD(p) _mm512_load_si512((const void *)(p))
#define FA_DP_STORE(p, x) _mm512_store_si512((void *)(p), (x))
#define FA_DP_BCAST(w) _mm512_set1_epi32((int)(w))
#define FA_DP_ZERO() _mm512_setzero_si512()

/* Two rows' first n (<= 32) bfloat16 values as pairs: lo holds channels 0-15, hi
 * 16-31, lane c = (a[c], b[c]) (b NULL: 0). */
#define FA_DP_ZIP(a, b, n, lo, hi) fa_dp_zip((a), (b), (n), &(lo), &(hi))
static inline void fa_dp_zip(const uint16_t *a, const uint16_t *b, int n, __m512i *lo, __m512i *hi)
{
    const __mmask32 m = n >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << n) - 1u);
    const __m512i x = _mm512_maskz_loadu_epi16(m, a);
    const __m512i y = b ? _mm512_maskz_loadu_epi16(m, b) : _mm512_setzero_si512();
    /* 16-bit element 2c takes x[c], 2c + 1 takes y[c] (index 32 + c) */
    const __m512i ilo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                         38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i ihi = _mm512_add_epi16(ilo, _mm512_set1_epi16(16));
    *lo = _mm512_permutex2var_epi16(x, ilo, y);
    *hi = _mm512_permutex2var_epi16(x, ihi, y);
}

#ifdef FA_EMULATE_BF16
#include "bf16_model.h"
/* vdpbf16ps lane by lane (bf16_model.h, 8 lanes at a time;
 * not SIMDe's, whose loop under OpenMP's simd pragma adds a pair's two products in an
 * order of the compiler's choosing) */
static inline __m512 fa_dp_fma(__m512 acc, __m512i a, __m512i b)
{
    float s[16];
    uint32_t x[16], y[16];
    memcpy(s, &acc, sizeof s);
    memcpy(x, &a, sizeof x);
    memcpy(y, &b, sizeof y);
    fa_model_pair_fma_n(s, x, y, 16);
    return _mm512_loadu_ps(s);
}
#define FA_DP_FMA(acc, a, b) fa_dp_fma((acc), (a), (b))
#define FA_DP_CVT2(x0, x1) _mm512_or_si512(fa_bf16_round(x0), _mm512_slli_epi32(fa_bf16_round(x1), 16))
#define FA_DP_CVT1(x) _mm512_cvtepi32_epi16(fa_bf16_round(x))
#else
#define FA_DP_FMA(acc, a, b) _mm512_dpbf16_ps((acc), (__m512bh)(a), (__m512bh)(b))
/* vcvtne2ps2bf16 puts x0's 16 values in elements 0-15 and x1's in 16-31; the permute
 * interleaves them into pairs */
static inline __m512i fa_dp_cvt2(__m512 x0, __m512 x1)
{
    const __m512i y = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                         22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(idx, y);
}
#define FA_DP_CVT2(x0, x1) fa_dp_cvt2((x0), (x1))
/* 16 float32 values as 16 bfloat16 (vcvtneps2bf16), in order */
#define FA_DP_CVT1(x) ((__m256i)_mm512_cvtneps_pbh(x))
#endif
/* 16 float32 values stored as 16 bfloat16 (kern_bf16bwd.h) */
#define FA_DP_STORE16(y, x) _mm256_storeu_si256((__m256i *)(void *)(y), FA_DP_CVT1(x))

#endif /* FA_KERNELS_AVX512BF16_H */
