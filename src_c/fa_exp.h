/*
 * fa_exp.h -- constants of the vectorized exp shared by the SIMD kernel files.
 *
 * exp(x) = 2^n * exp(r), n = round(x / ln2), r = x - n*ln2 computed in two steps
 * (Cody-Waite: ln2 = LN2_HI + LN2_LO, LN2_HI with trailing zero bits so n*LN2_HI is
 * exact), |r| <= ln2/2.  exp(r) by its Taylor polynomial sum r^k/k!:
 *   float32, degree 7:  truncation |r|^8/8! * e^|r| < 7.3e-9 (0.06 ulp of 1);
 *   float64, degree 13: truncation |r|^14/14! * e^|r| < 6e-18 (0.03 ulp of 1).
 * The AVX2 kernel instead takes n from one FMA against a magic constant and 2^n from
 * that float's bits (FA_EXP_*_MAGIC below), and in float32 a degree-6 polynomial
 * fitted to exp (FA_EXP_F32_M*): 1.58x faster than the round/convert/two-multiply
 * version with the degree-7 polynomial (AMD EPYC Zen 3, an array in L1), forward
 * 1.05x faster (1 thread, B1 H8 L2048 D64, interleaved in one process).
 * What remains is the rounding of r and of Horner's steps.  Measured over 2e6 points
 * of [-86.5, 88.5] against np.exp (tests/test_exp.py): max 0.91 ulp in float32
 * (AVX-512, generic), 1.014 ulp (AVX2), 1.0 ulp in float64 (np.exp's own error
 * included); below -86.5 (float32) or -707
 * (float64) the result is +0 (see FLUSH below), exp(+inf) = +inf, NaN stays NaN.
 */
#ifndef FA_EXP_H
#define FA_EXP_H

#define FA_LOG2E_F 1.44269504088896341f
#define FA_LN2_HI_F 0.693145751953125f       /* 15 significant bits */
#define FA_LN2_LO_F 1.42860682030941723212e-6f
#define FA_LOG2E 1.44269504088896340736
#define FA_LN2_HI 6.93147180369123816490e-01 /* low 32 bits zero */
#define FA_LN2_LO 1.90821492927058770002e-10

/* Range.  Inputs below FLUSH give exactly +0 (also -inf); the others are clamped to
 * [FLUSH, HI] before the reduction, so 2^n stays a normal number and no result is
 * subnormal.  Subnormal results would cost a microcode assist of ~100+ cycles per
 * vector on x86 (a masked attention row is full of exp(-inf)); the softmax never
 * needs them: they are weights below 1e-37 (float32) / 1e-307 (float64) relative to
 * the row's largest, which is 1.  Above HI the result is +inf. */
#define FA_EXP_F32_FLUSH (-86.5f)  /* exp(-86.5) = 2.7e-38 > FLT_MIN; n >= -125 */
#define FA_EXP_F32_HI 89.0f
#define FA_EXP_F64_FLUSH (-707.0)  /* exp(-707) = 9.6e-308 > DBL_MIN; n >= -1021 */
#define FA_EXP_F64_HI 710.0

/* The AVX2 kernel's float32 polynomial: degree 6, 1 + r + sum_{k=2..6} M_k r^k, its
 * coefficients fitted (Lawson's iteration on 20001 points) to the relative error of
 * exp over [-ln2/2, ln2/2]: 2.0e-9 (0.017 ulp of 1) before rounding to float32, one
 * FMA fewer than the degree-7 Taylor polynomial at a smaller truncation error. */
#define FA_EXP_F32_M2 4.999999404e-01f
#define FA_EXP_F32_M3 1.666643173e-01f
#define FA_EXP_F32_M4 4.166800156e-02f
#define FA_EXP_F32_M5 8.374155499e-03f
#define FA_EXP_F32_M6 1.384364790e-03f

/* Magic constants of the AVX2 kernel's rounding: x log2 e + MAGIC rounds to an integer
 * (the float's ulp is 1 in [2^23, 2^24), resp. [2^52, 2^53)) whose low mantissa bits
 * are n + 126 (resp. n + 1022), the biased exponent of 2^(n-1); shifted left by 23
 * (52) they are 2^(n-1) itself. */
#define FA_EXP_F32_MAGIC 12583038.0f           /* 1.5 * 2^23 + 126 */
#define FA_EXP_F64_MAGIC 6755399441056766.0    /* 1.5 * 2^52 + 1022 */

/* 1/k! as float32 for k = 2..7 (k = 0, 1 are the literal 1). */
#define FA_EXP_F32_C2 0.5f
#define FA_EXP_F32_C3 0.16666666666666666f
#define FA_EXP_F32_C4 0.041666666666666664f
#define FA_EXP_F32_C5 0.008333333333333333f
#define FA_EXP_F32_C6 0.001388888888888889f
#define FA_EXP_F32_C7 0.0001984126984126984f

#define FA_EXP_F64_DEG 13
static const double fa_exp_f64_coef[FA_EXP_F64_DEG + 1] = {
    1.0,
    1.0,
    1.0 / 2,
    1.0 / 6,
    1.0 / 24,
    1.0 / 120,
    1.0 / 720,
    1.0 / 5040,
    1.0 / 40320,
    1.0 / 362880,
    1.0 / 3628800,
    1.0 / 39916800,
    1.0 / 479001600,
    1.0 / 6227020800.0,
};

/* The softmax's e^x as 2^y, y = x log2(e) (FA_VEXP_LOGIT of the AVX-512 and AVX2
 * kernels):
 * 2^f for |f| <= 1/2 by the AVX2 polynomial above in powers of f (M_k ln2^k, rounded to
 * float32; the fit's 2.0e-9 is unchanged, r = f ln2 being the same interval), and in
 * float64 by the fit below.  Below y = FLUSH the result is +0 (2^n stays normal). */
#define FA_EXP2_F32_FLUSH (-125.0f)
#define FA_EXP2_F64_FLUSH (-1021.0)
#define FA_EXP2_F32_P1 6.931471825e-01f
#define FA_EXP2_F32_P2 2.402264774e-01f
#define FA_EXP2_F32_P3 5.550332740e-02f
#define FA_EXP2_F32_P4 9.618436918e-03f
#define FA_EXP2_F32_P5 1.339887502e-03f
#define FA_EXP2_F32_P6 1.535335614e-04f
/* 2^f for |f| <= 1/2 in float64 (the AVX-512 and AVX2 kernels' logits): the
 * degree-11 polynomial 1 + f g(f), g the degree-10 Chebyshev fit of (2^f - 1) / f
 * (mpmath.chebyfit at 60 digits; c0 = 1, so e^0 = 1 exactly), coefficients rounded to
 * float64: truncation 2.0e-17 relative (0.18 u) over the interval, against 6e-18 for
 * the degree-13 Taylor polynomial of ln2^k / k!, which costs two more dependent FMAs
 * (the AVX-512 kernel's until it measured them: kernels_avx512.h). */
#define FA_EXP2_F64_FIT_DEG 11
static const double fa_exp2_f64_fit[FA_EXP2_F64_FIT_DEG + 1] = {
    1.0,
    0.6931471805599453,
    0.24022650695910097,
    0.0555041086648216,
    0.009618129107606888,
    0.0013333558146416936,
    0.0001540353044173605,
    1.525273382983612e-05,
    1.321544258792169e-06,
    1.0178062445845774e-07,
    7.072585949269223e-09,
    4.4549605981865186e-10,
};

#endif /* FA_EXP_H */
