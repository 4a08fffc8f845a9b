/*
 * bf16_model.h -- the emulated test build's (FA_EMULATE_BF16) arithmetic of one
 * bfloat16 pair product, shared by its vdpbf16ps (kernels_avx512bf16.h) and its model
 * of the AMX tiles' tdpbf16ps (amx_model.h), so the two emulated paths give the same
 * bits whenever they add the same products in the same order (tests/test_bf16.py
 * holds them to it).  Never shipped.
 *
 * acc + a0 b0 + a1 b1: the even product first, then the odd one, each a float32 FMA
 * rounded to nearest even (a product of two bfloat16 is exact in float32, so each
 * step is one rounding of the sum), input and output denormals flushed to zero, as
 * both instructions' descriptions say.  Intel's texts disagree on the order (the
 * Intrinsics Guide's tdpbf16ps takes the even product first, the SDM's vdpbf16ps the
 * odd one, and its newer tdpbf16ps sums the even and the odd products apart), so the
 * hardware's bits may differ from the model's in the last place; the oracle tests
 * hold both to the same tolerance.
 */
#ifndef FA_BF16_MODEL_H
#define FA_BF16_MODEL_H
/* (setup.py compiles the emulated files, the only ones that include this, with -mavx2
 * -mfma: the model's vector form below needs them) */
#if !defined(__AVX2__) || !defined(__FMA__)
#error "bf16_model.h: the emulated build needs -mavx2 -mfma"
#endif
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float fa_model_flush(float x) { return fabsf(x) < 1.17549435e-38f ? copysignf(0.0f, x) : x; }

static inline float fa_model_bf16(uint16_t h)
{
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return fa_model_flush(f);
}

/* acc plus the products of the pairs a = (a0, a1) and b = (b0, b1), each a uint32
 * holding its first element in the low half */
static inline float fa_model_pair_fma(float acc, uint32_t a, uint32_t b)
{
    acc = fa_model_flush(fmaf(fa_model_bf16((uint16_t)a), fa_model_bf16((uint16_t)b), fa_model_flush(acc)));
    return fa_model_flush(fmaf(fa_model_bf16((uint16_t)(a >> 16)), fa_model_bf16((uint16_t)(b >> 16)), acc));
}

/* The same on 8 lanes at once (AVX2, FMA): lane i is fa_model_pair_fma(acc[i], a[i],
 * b[i]), operation for operation (a bfloat16 is its bits moved up 16; the flush keeps
 * the sign and clears the rest where |x| < FLT_MIN, false for a NaN as fabsf's compare
 * is; vfmadd rounds once, as fmaf does), so its bits are the scalar model's but for a
 * NaN's payload: fa_model_pair_check compares the two.  The emulated build's vdpbf16ps
 * and tdpbf16ps run this one (lane by lane, the AMX model took 43% of the samples of
 * test_bf16's slowest emulated test, and 86 s of CI's 12-minute sanitized pass). */
#include <immintrin.h>
static inline __attribute__((always_inline)) __m256 fa_model_flush8(__m256 x)
{
    const __m256 mag = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256 tiny = _mm256_cmp_ps(_mm256_and_ps(x, mag), _mm256_set1_ps(1.17549435e-38f), _CMP_LT_OQ);
    return _mm256_andnot_ps(_mm256_and_ps(tiny, mag), x);
}

static inline __attribute__((always_inline)) __m256 fa_model_pair_fma8(__m256 acc, __m256i a, __m256i b)
{
    const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
    const __m256 a0 = fa_model_flush8(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)));
    const __m256 b0 = fa_model_flush8(_mm256_castsi256_ps(_mm256_slli_epi32(b, 16)));
    const __m256 a1 = fa_model_flush8(_mm256_castsi256_ps(_mm256_and_si256(a, hi)));
    const __m256 b1 = fa_model_flush8(_mm256_castsi256_ps(_mm256_and_si256(b, hi)));
    acc = fa_model_flush8(_mm256_fmadd_ps(a0, b0, fa_model_flush8(acc)));
    return fa_model_flush8(_mm256_fmadd_ps(a1, b1, acc));
}

/* n lanes (a multiple of 8) of pair products, the 8-lane model on each group of 8 */
static inline void fa_model_pair_fma_n(float *acc, const uint32_t *a, const uint32_t *b, int n)
{
    for (int i = 0; i < n; i += 8)
        _mm256_storeu_ps(acc + i, fa_model_pair_fma8(_mm256_loadu_ps(acc + i),
                                                     _mm256_loadu_si256((const __m256i *)(const void *)(a + i)),
                                                     _mm256_loadu_si256((const __m256i *)(const void *)(b + i))));
}

/* How many of `count` cases the 8-lane model and the scalar one disagree on (the
 * bits of the result; a NaN is any NaN: which operand's payload an FMA passes on
 * depends on the instruction form the compiler picks, for fmaf as for the vector),
 * over operands made of the edge patterns (zeros, denormals, the smallest normals,
 * infinities, NaNs, the largest finite values, ones) mixed with a fixed pseudo-random
 * stream.  0 or the model is broken. */
static inline long fa_model_pair_check(long count)
{
    static const uint16_t edge[] = {0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x807F, 0x0080, 0x8080,
                                    0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F7F, 0xFF7F, 0x3F80, 0xBF80};
    uint64_t st = 0x9E3779B97F4A7C15u;
    long bad = 0;
    for (long c = 0; c < count; c += 8) {
        uint32_t a[8], b[8], acc_bits[8];
        for (int i = 0; i < 8; i++) {
            uint16_t h[6];
            for (int j = 0; j < 6; j++) {
                st = st * 6364136223846793005u + 1442695040888963407u;
                const uint32_t r = (uint32_t)(st >> 32);
                h[j] = (r & 3) == 0 ? edge[(r >> 2) % 16] : (uint16_t)(r >> 8);
            }
            a[i] = h[0] | (uint32_t)h[1] << 16;
            b[i] = h[2] | (uint32_t)h[3] << 16;
            acc_bits[i] = (uint32_t)h[4] << 16 | h[5];
        }
        float acc[8], want[8];
        memcpy(acc, acc_bits, sizeof acc);
        for (int i = 0; i < 8; i++) want[i] = fa_model_pair_fma(acc[i], a[i], b[i]);
        fa_model_pair_fma_n(acc, a, b, 8);
        for (int i = 0; i < 8; i++)
            bad += memcmp(acc + i, want + i, sizeof *acc) != 0 && !(acc[i] != acc[i] && want[i] != want[i]);
    }
    return bad;
}

#endif /* FA_BF16_MODEL_H */
