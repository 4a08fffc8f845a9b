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

#endif /* FA_BF16_MODEL_H */
