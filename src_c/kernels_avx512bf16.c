/*
 * kernels_avx512bf16.c -- the forward for bfloat16 q, k and v on AVX512-BF16
 * (vdpbf16ps): the float32 AVX-512 kernel (kernels_avx512.h) with both products of a
 * prefill block on bfloat16 pairs (kern_bf16dp.h).  Compiled with -mavx512f -mavx512bw
 * -mavx512bf16 (and the AVX2/FMA/F16C baseline); cpu.c offers it only where CPUID
 * reports AVX512-BF16 and AVX512BW and the avx512 kernel runs.
 *
 * Test-only build (FA_EMULATE_BF16, setup.py under FASTATTN_EMULATE_BF16=1, compiled
 * for AVX2 only): every AVX-512 operation and vdpbf16ps come from SIMDe (Debian's
 * libsimde-dev, header only; its vdpbf16ps adds the two products of a pair to the
 * accumulator in order, each rounded), and the float32 -> bfloat16 rounding is done
 * with integer operations; so the same source runs against the oracle on any AVX2 or
 * AVX-512 CPU, called from the avx2 or the avx512 kernel.  Never shipped.
 *
 * Per 16 logits at head size D: D/2 vdpbf16ps for QK^T and Dv/2 for P.V, each with
 * the work of two float32 FMAs, against D + Dv FMAs on the float32 path; the softmax
 * (about 15 vector instructions) is unchanged.
 */
#include "kernels_avx512.h"

#define FA_DP_V __m512i
#define FA_DP_LOAD(p) _mm512_load_si512((const void *)(p))
#define FA_DP_STORE(p, x) _mm512_store_si512((void *)(p), (x))
#define FA_DP_BCAST(w) _mm512_set1_epi32((int)(w))

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
#include <simde/x86/avx512.h>
static inline __m512 fa_dp_fma(__m512 acc, __m512i a, __m512i b)
{
    simde__m512bh x, y;
    memcpy(&x, &a, sizeof x);
    memcpy(&y, &b, sizeof y);
    return simde_mm512_dpbf16_ps(acc, x, y);
}
/* float32 -> bfloat16 bits in the low half of each lane, round to nearest even; NaN
 * stays a (quiet) NaN */
static inline __m512i fa_bf16_round(__m512 x)
{
    const __m512i b = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_blend_epi32(nan, r, _mm512_or_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x40)));
}
#define FA_DP_FMA(acc, a, b) fa_dp_fma((acc), (a), (b))
#define FA_DP_CVT2(x0, x1) _mm512_or_si512(fa_bf16_round(x0), _mm512_slli_epi32(fa_bf16_round(x1), 16))
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
#endif

#define FA_BF16_DP 1
#include "kernels_avx512_kvb16.h"
#define FA_NAME(x) x##_bdp_avx512
#include "kernels_tmpl.h"
#include "kernels_undef.h"

/* The pair instruction's peak loop (fastattn.bench.bf16_peak): iters rounds of
 * FA_PEAK_CHAINS independent vdpbf16ps, acc += 1 * a + 1 * a (a as bfloat16; the
 * chains grow by 2a a round, far from overflow), returning the lanes' sum. */
static double fa_dp_chains(int64_t iters, double m, double a)
{
    (void)m;
    const uint32_t one = 0x3F80u, ab = fa_float_to_bf16((float)a);
    const __m512i x = _mm512_set1_epi32((int)(one | one << 16)), y = _mm512_set1_epi32((int)(ab | ab << 16));
    __m512 acc[FA_PEAK_CHAINS];
    for (int c = 0; c < FA_PEAK_CHAINS; c++) acc[c] = _mm512_set1_ps((float)c);
    for (int64_t i = 0; i < iters; i++)
        for (int c = 0; c < FA_PEAK_CHAINS; c++) acc[c] = FA_DP_FMA(acc[c], x, y);
    __m512 s = acc[0];
    for (int c = 1; c < FA_PEAK_CHAINS; c++) s = _mm512_add_ps(s, acc[c]);
    return (double)_mm512_reduce_add_ps(s);
}

const fa_bf16_kernel fa_kernel_avx512_bf16 = {
#ifdef FA_EMULATE_BF16
    "avx512-bf16 (emulated by SIMDe: a test build)",
#else
    "avx512-bf16",
#endif
    fa_qblock_bdp_avx512,
    fa_scratch_bytes_bdp_avx512,
    fa_dp_chains,
};
