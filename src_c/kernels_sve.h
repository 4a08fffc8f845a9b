/*
 * kernels_sve.h -- the micro-kernels for AArch64's SVE at one fixed vector length,
 * included by kernels_sve256.c (256 bits: AWS Graviton 3, Neoverse V1) and
 * kernels_sve128.c (128 bits: Graviton 4, NVIDIA Grace, Google Axion: Neoverse V2),
 * each compiled with -march=armv8.2-a+sve -msve-vector-bits=FA_SVE_BITS only and chosen
 * by cpu.c only where the CPU has SVE and the process's vector length is FA_SVE_BITS
 * (prctl PR_SVE_GET_VL).  One build per length, not vector-length-agnostic code, because
 * the kernel template keeps its register tiles in arrays of vectors, which SVE's sizeless
 * types cannot form; fixed-length types (arm_sve_vector_bits) can.  Other lengths
 * (512-bit A64FX) run the neon kernel.
 *
 * The including file defines FA_SVE_BITS, FA_SVE_VL32 and FA_SVE_VL64 (float32 and
 * float64 lanes: FA_SVE_BITS / 32 and / 64, as literals), FA_SVE_NAME(x) (x with the
 * kernel's suffix) and FA_SVE_KERNEL_NAME (its name as a string); with FA_ARM_BF16
 * (kernels_sve256_bf16.c, kernels_sve128_bf16.c, compiled with +bf16 too) the file is
 * the kernel's bfloat16 pair products on BFDOT instead: only the bfloat16
 * instantiations, with the pair operations below, and kernels_arm_bf16.h's table.
 *
 * Register tiles as the neon kernel's (5 x 4, 20 accumulators of the 32 registers).
 * The general exp is the scheme of the other kernels (fa_exp.h), its polynomial in
 * svmad/svmla with "don't care" predication, so the compiler picks the form that
 * overwrites the product's operand (FMAD) where the addend (a coefficient) must live
 * on: no register copy a step, which NEON's FMLA needs.  The softmax's float32 exp of
 * its logits is shorter: FEXPA (2^(i/64) from the architecture's table) and a degree-2
 * polynomial (fa_exp_logit_n_f32_sve below, with its error bound).
 */
#include <arm_sve.h>
#include <math.h>
#include <string.h>
#include "fa_internal.h"
#include "fa_exp.h"

#if !defined(__ARM_FEATURE_SVE_BITS) || __ARM_FEATURE_SVE_BITS != FA_SVE_BITS
#error "kernels_sve.h is compiled with -msve-vector-bits=FA_SVE_BITS"
#endif

typedef svfloat32_t fa_sf32 __attribute__((arm_sve_vector_bits(FA_SVE_BITS)));
typedef svfloat64_t fa_sf64 __attribute__((arm_sve_vector_bits(FA_SVE_BITS)));

#define FA_PT32 svptrue_b32()
#define FA_PT64 svptrue_b64()

/* ---- float32 lane operations ---- */

/* exp for a vector of floats (kernels_avx2.c: fa_exp_f32_avx2 has the scheme).  Lanes below
 * FLUSH (-inf included) become +0; a NaN x stays NaN (FMIN returns it; the compare
 * below is false for it). */
static inline fa_sf32 fa_exp_f32_sve(fa_sf32 x)
{
    const svbool_t pg = FA_PT32;
    const svbool_t flush = svcmplt_n_f32(pg, x, FA_EXP_F32_FLUSH);
    const svfloat32_t magic = svdup_n_f32(FA_EXP_F32_MAGIC);
    x = svmin_n_f32_x(pg, x, FA_EXP_F32_HI);
    const svfloat32_t j = svmla_n_f32_x(pg, magic, x, FA_LOG2E_F);
    const svfloat32_t n = svsub_f32_x(pg, j, magic);
    svfloat32_t r = svmls_n_f32_x(pg, x, n, FA_LN2_HI_F);
    r = svmls_n_f32_x(pg, r, n, FA_LN2_LO_F);
    svfloat32_t y = svdup_n_f32(2 * FA_EXP_F32_M6);
    y = svmad_n_f32_x(pg, y, r, 2 * FA_EXP_F32_M5);
    y = svmad_n_f32_x(pg, y, r, 2 * FA_EXP_F32_M4);
    y = svmad_n_f32_x(pg, y, r, 2 * FA_EXP_F32_M3);
    y = svmad_n_f32_x(pg, y, r, 2 * FA_EXP_F32_M2);
    y = svmad_n_f32_x(pg, y, r, 2.0f);
    y = svmad_n_f32_x(pg, y, r, 2.0f);
    const svfloat32_t two_n = svreinterpret_f32_s32(svlsl_n_s32_x(pg, svreinterpret_s32_f32(j), 23));
    return svsel_f32(flush, svdup_n_f32(0.0f), svmul_f32_x(pg, y, two_n));
}

/* e^x of the softmax's logits x = s - m <= 0 (any x: a lane with |x| > 86.5 or +-inf
 * goes to fa_exp_f32_sve above), by FEXPA.  e^x = 2^t, t = x log2(e):
 *   z = x log2e + SHIFT (one rounding; SHIFT = 1.5 2^17 + 127, so z's last place is
 *       2^-6): N = z - SHIFT is t rounded to a multiple of 1/64 (exact), and z's bits
 *       [5:0] hold 64 frac(N), bits [13:6] floor(N) + 127, in 2..251 for |x| <= 86.5;
 *   T = FEXPA(z) = 2^N: the exponent field from bits [13:6], the fraction 2^(i/64) from
 *       the architecture's 64-entry table (its 23 bits rounded to nearest: at most
 *       0.933 u relative, u = 2^-24, i = 0 exact);
 *   f = x log2e - N in one rounding (FNMLS), |f| <= 1/128;
 *   2^f = 1 + f (C1 + C2 f), the minimax degree-2 fit of 2^f over [-1/128, 1/128] in
 *       relative error (0.113 u with C1, C2 rounded to float32), as T + (T f)(C1 + C2 f):
 *       one rounding of the result; those of T f, C1 + C2 f and f at most 0.015 u.
 * Relative error, entry i of the table: e_i (its rounding, relative) + 1 / (2^(i/64)
 * (1 - 0.0055)) u (the result's rounding, whose mantissa is 2^(i/64) (1 + q), |q| <=
 * 0.0055) + 0.113 u (the fit) + 0.015 u (the other roundings) + 0.224 u |x| (log2e's
 * rounding to float32, times ln 2 |x|).  The other kernels' bound, u (2 + |x| / 4)
 * (fa_exp.h, tests/test_exp.py), holds for every x <= 0: the entries whose e_i is large
 * are reached only from |x| >= (63.5 - i) ln2 / 64, where |x| / 4 - 0.224 |x| pays for
 * them (the closest, i = 6: e_6 = 0.933 u, |x| >= 0.623, 2.143 u against 2.156 u).
 * Measured under qemu (4.7 million x in [-86.5, 0]): at most 0.983 of that bound, 2.43 u
 * for |x| < 2.3.  e^0 = 1 exactly (N = 0, f = 0, T = 1, q = 0).  A NaN x gives NaN
 * (through f).  Per vector: 8 operations (the |x| test, z, N, f, FEXPA, the
 * polynomial's three) against the general scheme's 15; the special lanes cost a test a
 * call and, where there are any (masked or underflowing logits), the general exp of
 * those vectors.  nv vectors at once, each step for all of them. */
#define FA_FEXPA_SHIFT 196735.0f /* 1.5 * 2^17 + 127 */
#define FA_FEXPA_C1 6.931497455e-01f
#define FA_FEXPA_C2 2.402265221e-01f
#define FA_FEXPA_LIMIT 86.5f     /* -FA_EXP_F32_FLUSH */
static const float fa_fexpa_shift = FA_FEXPA_SHIFT;
/* T + (T f) (C1 + C2 f), T = FEXPA(z): each operation's result in a register it may
 * overwrite (T f in a new one, then FMAD over f, FMLA over T), so no copies */
static inline fa_sf32 fa_fexpa_poly_sve(fa_sf32 z, fa_sf32 f)
{
    const svbool_t pg = FA_PT32;
    const svfloat32_t t = svexpa_f32(svreinterpret_u32_f32(z));
    const svfloat32_t tf = svmul_f32_x(pg, t, f);
    return svmla_f32_x(pg, t, tf, svmad_n_f32_x(pg, f, svdup_n_f32(FA_FEXPA_C2), FA_FEXPA_C1));
}
FA_ALWAYS_INLINE void fa_exp_logit_n_f32_sve(fa_sf32 *x, const int nv)
{
    const svbool_t pg = FA_PT32;
    const svfloat32_t shift = svdup_n_f32(FA_FEXPA_SHIFT);
    fa_sf32 z[4], f[4];
    svbool_t special = svpfalse_b();
    FA_PRAGMA_UNROLL(4)
    for (int k = 0; k < nv; k++) special = svorr_b_z(pg, special, svacgt_n_f32(pg, x[k], FA_FEXPA_LIMIT));
    /* z's addend, SHIFT, a fresh broadcast load each time (the empty asm makes the
     * address look new, so the load stays in the loop): FMLA overwrites it, where a
     * constant kept in a register would cost a copy (MOVPRFX) on the vector pipes, the
     * ones the loop is bound by; the load pipes have room */
    const float *sp = &fa_fexpa_shift;
    FA_PRAGMA_UNROLL(4)
    for (int k = 0; k < nv; k++) {
        __asm__("" : "+r"(sp));
        z[k] = svmla_n_f32_x(pg, svdup_n_f32(*sp), x[k], FA_LOG2E_F);
    }
    FA_PRAGMA_UNROLL(4)
    for (int k = 0; k < nv; k++) f[k] = svnmls_n_f32_x(pg, svsub_f32_x(pg, z[k], shift), x[k], FA_LOG2E_F);
    if (__builtin_expect(svptest_any(pg, special), 0)) {
        FA_PRAGMA_UNROLL(4)
        for (int k = 0; k < nv; k++) {
            const svbool_t sk = svacgt_n_f32(pg, x[k], FA_FEXPA_LIMIT);
            x[k] = svsel_f32(sk, fa_exp_f32_sve(x[k]), fa_fexpa_poly_sve(z[k], f[k]));
        }
        return;
    }
    FA_PRAGMA_UNROLL(4)
    for (int k = 0; k < nv; k++) x[k] = fa_fexpa_poly_sve(z[k], f[k]);
}
static inline fa_sf32 fa_exp_logit_f32_sve(fa_sf32 x)
{
    fa_exp_logit_n_f32_sve(&x, 1);
    return x;
}
static inline fa_sf32 fa_neginf_to_zero_f32_sve(fa_sf32 x)
{
    return svsel_f32(svcmpeq_n_f32(FA_PT32, x, -INFINITY), svdup_n_f32(0.0f), x);
}
static inline fa_sf32 fa_loadu_n_f32_sve(const float *p, int n)
{
    return svld1_f32(svwhilelt_b32_s32(0, n), p); /* (inactive lanes load 0, and nothing) */
}
static inline fa_sf32 fa_copysign_f32_sve(fa_sf32 mag, fa_sf32 sgn)
{
    const svbool_t pg = FA_PT32;
    const svuint32_t m = svand_n_u32_x(pg, svreinterpret_u32_f32(mag), 0x7fffffffu);
    const svuint32_t s = svand_n_u32_x(pg, svreinterpret_u32_f32(sgn), 0x80000000u);
    return svreinterpret_f32_u32(svorr_u32_x(pg, m, s));
}
static inline fa_sf32 fa_in_range_f32_sve(fa_sf32 x, fa_sf32 j, fa_sf32 lo, fa_sf32 hi)
{
    const svbool_t pg = FA_PT32;
    const svbool_t in = svand_b_z(pg, svcmple_f32(pg, lo, j), svcmple_f32(pg, j, hi));
    return svsel_f32(in, x, svdup_n_f32(-INFINITY));
}
/* x where the byte p[lane] != 0, else -inf (a byte a lane, each widened to it) */
static inline fa_sf32 fa_mask_bytes_f32_sve(fa_sf32 x, const uint8_t *p)
{
    const svbool_t pg = FA_PT32;
    return svsel_f32(svcmpeq_n_u32(pg, svld1ub_u32(pg, p), 0), svdup_n_f32(-INFINITY), x);
}
/* A vector of int8 (an int8 cache's codes) as float32, exact: a sign-extending load */
static inline fa_sf32 fa_i8_loadu_sve(const int8_t *p)
{
    return svcvt_f32_s32_x(FA_PT32, svld1sb_s32(FA_PT32, p));
}

/* A vector of int4 codes as float32 (exact, 0..15): the low nibbles (sh 0) or the high ones (sh 4)
 * of the bytes at p (one a lane), each loaded into its 32-bit lane */
static inline fa_sf32 fa_u4_loadu_sve(const uint8_t *p, int sh)
{
    svuint32_t w = svld1ub_u32(FA_PT32, p);
    if (sh) w = svlsr_n_u32_x(FA_PT32, w, 4);
    return svcvt_f32_u32_x(FA_PT32, svand_n_u32_x(FA_PT32, w, 15));
}

/* ---- float64 lane operations ---- */

static inline fa_sf64 fa_exp_f64_sve(fa_sf64 x)
{
    const svbool_t pg = FA_PT64;
    const svbool_t flush = svcmplt_n_f64(pg, x, FA_EXP_F64_FLUSH);
    const svfloat64_t magic = svdup_n_f64(FA_EXP_F64_MAGIC);
    x = svmin_n_f64_x(pg, x, FA_EXP_F64_HI);
    const svfloat64_t j = svmla_n_f64_x(pg, magic, x, FA_LOG2E);
    const svfloat64_t n = svsub_f64_x(pg, j, magic);
    svfloat64_t r = svmls_n_f64_x(pg, x, n, FA_LN2_HI);
    r = svmls_n_f64_x(pg, r, n, FA_LN2_LO);
    svfloat64_t y = svdup_n_f64(2 * fa_exp_f64_coef[FA_EXP_F64_DEG]);
    for (int i = FA_EXP_F64_DEG - 1; i >= 0; i--) y = svmad_n_f64_x(pg, y, r, 2 * fa_exp_f64_coef[i]);
    const svfloat64_t two_n = svreinterpret_f64_s64(svlsl_n_s64_x(pg, svreinterpret_s64_f64(j), 52));
    return svsel_f64(flush, svdup_n_f64(0.0), svmul_f64_x(pg, y, two_n));
}
FA_ALWAYS_INLINE void fa_exp_logit_n_f64_sve(fa_sf64 *x, const int nv)
{
    const svbool_t pg = FA_PT64;
    const svfloat64_t magic = svdup_n_f64(FA_EXP_F64_MAGIC);
    fa_sf64 x0[4], j[4], f[4], y[4];
    FA_PRAGMA_UNROLL(4)
    for (int k = 0; k < nv; k++) {
        x0[k] = x[k];
        x[k] = svmin_n_f64_x(pg, x[k], FA_EXP_F64_HI);
    }
    FA_PRAGMA_UNROLL(4)
    for (int k = 0; k < nv; k++) j[k] = svmla_n_f64_x(pg, magic, x[k], FA_LOG2E);
    FA_PRAGMA_UNROLL(4)
    for (int k = 0; k < nv; k++) {
        f[k] = svneg_f64_x(pg, svmls_n_f64_x(pg, svsub_f64_x(pg, j[k], magic), x[k], FA_LOG2E));
        y[k] = svdup_n_f64(2 * fa_exp2_f64_fit[FA_EXP2_F64_FIT_DEG]);
    }
    FA_PRAGMA_UNROLL(11)
    for (int i = FA_EXP2_F64_FIT_DEG - 1; i >= 0; i--) {
        FA_PRAGMA_UNROLL(4)
        for (int k = 0; k < nv; k++) y[k] = svmad_n_f64_x(pg, y[k], f[k], 2 * fa_exp2_f64_fit[i]);
    }
    FA_PRAGMA_UNROLL(4)
    for (int k = 0; k < nv; k++) {
        const svfloat64_t two_n = svreinterpret_f64_s64(svlsl_n_s64_x(pg, svreinterpret_s64_f64(j[k]), 52));
        x[k] = svsel_f64(svcmplt_n_f64(pg, x0[k], FA_EXP_F64_FLUSH), svdup_n_f64(0.0), svmul_f64_x(pg, y[k], two_n));
    }
}
static inline fa_sf64 fa_exp_logit_f64_sve(fa_sf64 x)
{
    fa_exp_logit_n_f64_sve(&x, 1);
    return x;
}
static inline fa_sf64 fa_neginf_to_zero_f64_sve(fa_sf64 x)
{
    return svsel_f64(svcmpeq_n_f64(FA_PT64, x, -INFINITY), svdup_n_f64(0.0), x);
}
static inline fa_sf64 fa_loadu_n_f64_sve(const double *p, int n)
{
    return svld1_f64(svwhilelt_b64_s32(0, n), p);
}
static inline fa_sf64 fa_copysign_f64_sve(fa_sf64 mag, fa_sf64 sgn)
{
    const svbool_t pg = FA_PT64;
    const svuint64_t m = svand_n_u64_x(pg, svreinterpret_u64_f64(mag), 0x7fffffffffffffffull);
    const svuint64_t s = svand_n_u64_x(pg, svreinterpret_u64_f64(sgn), 0x8000000000000000ull);
    return svreinterpret_f64_u64(svorr_u64_x(pg, m, s));
}
static inline fa_sf64 fa_in_range_f64_sve(fa_sf64 x, fa_sf64 j, fa_sf64 lo, fa_sf64 hi)
{
    const svbool_t pg = FA_PT64;
    const svbool_t in = svand_b_z(pg, svcmple_f64(pg, lo, j), svcmple_f64(pg, j, hi));
    return svsel_f64(in, x, svdup_n_f64(-INFINITY));
}
static inline fa_sf64 fa_mask_bytes_f64_sve(fa_sf64 x, const uint8_t *p)
{
    const svbool_t pg = FA_PT64;
    return svsel_f64(svcmpeq_n_u64(pg, svld1ub_u64(pg, p), 0), svdup_n_f64(-INFINITY), x);
}

/* ---------------- float32 ---------------- */
#define FA_T float
#define FA_V fa_sf32
#define FA_VL FA_SVE_VL32
#define FA_NAME(x) FA_SVE_NAME(x##_f32)
#define FA_QK_R 5
#define FA_QK_NV 4
#define FA_PV_R 5
#define FA_PV_NC 4
#define FA_VLOAD(p) svld1_f32(FA_PT32, (p))
#define FA_VSTORE(p, x) svst1_f32(FA_PT32, (p), (x))
#define FA_VLOADU(p) svld1_f32(FA_PT32, (p))
#define FA_VSTOREU(p, x) svst1_f32(FA_PT32, (p), (x))
#define FA_VLOADU_N(p, n) fa_loadu_n_f32_sve((p), (n))
#define FA_VSET1(x) svdup_n_f32(x)
#define FA_VZERO() svdup_n_f32(0.0f)
#define FA_VADD(a, b) svadd_f32_x(FA_PT32, (a), (b))
#define FA_VSUB(a, b) svsub_f32_x(FA_PT32, (a), (b))
#define FA_VMUL(a, b) svmul_f32_x(FA_PT32, (a), (b))
#define FA_VFMA(a, b, c) svmla_f32_x(FA_PT32, (c), (a), (b))
#define FA_VMAX(a, b) svmax_f32_x(FA_PT32, (a), (b))
#define FA_VEXP(x) fa_exp_f32_sve(x)
#define FA_VEXP_LOGIT(x) fa_exp_logit_f32_sve(x)
#define FA_VEXP_LOGIT4(x) fa_exp_logit_n_f32_sve((x), 4)
#define FA_VNEGINF_TO_ZERO(x) fa_neginf_to_zero_f32_sve(x)
#define FA_VREDUCE(x) svaddv_f32(FA_PT32, (x))
#define FA_VABS(x) svabs_f32_x(FA_PT32, (x))
#define FA_VDIV(a, b) svdiv_f32_x(FA_PT32, (a), (b))
#define FA_VCOPYSIGN(m, s) fa_copysign_f32_sve((m), (s))
#define FA_VIN_RANGE(x, j, lo, hi) fa_in_range_f32_sve((x), (j), (lo), (hi))
#define FA_VMASK_BYTES(x, p) fa_mask_bytes_f32_sve((x), (p))
#define FA_I8_LOADU(p) fa_i8_loadu_sve((const int8_t *)(const void *)(p))
#define FA_U4_LOADU(p, sh) fa_u4_loadu_sve((const uint8_t *)(const void *)(p), (sh))
#ifndef FA_ARM_BF16 /* (kernels_sve*_bf16.c: only the bfloat16 instantiations below) */
#include "kernels_tmpl.h"

/* ---------------- float32 with float16 K/V: converted in registers ---------------- */
/* float16 values widened to their 32-bit lanes (the low half of each), then converted */
static inline fa_sf32 fa_half_loadu_sve(const uint16_t *p)
{
    return svcvt_f32_f16_x(FA_PT32, svreinterpret_f16_u32(svld1uh_u32(FA_PT32, p)));
}
static inline fa_sf32 fa_half_loadu_n_sve(const uint16_t *p, int n)
{
    const svbool_t pn = svwhilelt_b32_s32(0, n);
    return svcvt_f32_f16_z(pn, svreinterpret_f16_u32(svld1uh_u32(pn, p)));
}
#include "kernels_kv16.h"
#define FA_F32(x) FA_SVE_NAME(x##_f32)
#define FA_NAME(x) FA_SVE_NAME(x##_kv16)
#define FA_KV_HALF 1
#define FA_KV uint16_t
#define FA_KV_BCAST(p) svdup_n_f32(fa_half_to_float(*(p)))
#define FA_KV_LOADU(p) fa_half_loadu_sve(p)
#define FA_KV_LOADU_N(p, n) fa_half_loadu_n_sve((p), (n))
#define FA_KV_SCALAR(x) fa_half_to_float(x)
#include "kernels_tmpl.h"
#endif /* FA_ARM_BF16 */

/* ---------------- float32 with bfloat16 K/V: a bfloat16 is a float's high half ---------------- */
static inline fa_sf32 fa_bf16_loadu_sve(const uint16_t *p)
{
    return svreinterpret_f32_u32(svlsl_n_u32_x(FA_PT32, svld1uh_u32(FA_PT32, p), 16));
}
static inline fa_sf32 fa_bf16_loadu_n_sve(const uint16_t *p, int n)
{
    const svbool_t pn = svwhilelt_b32_s32(0, n);
    return svreinterpret_f32_u32(svlsl_n_u32_z(pn, svld1uh_u32(pn, p), 16));
}
#include "kernels_kv16.h"
#ifdef FA_ARM_BF16
/* q, k and v bfloat16 with both products on BFDOT pairs (kern_bf16dp.h): FA_SVE_VL32
 * pairs a vector, one a float32 lane */
typedef svbfloat16_t fa_sbf16 __attribute__((arm_sve_vector_bits(FA_SVE_BITS)));
#define FA_DP_V fa_sbf16
#define FA_DP_LOAD(p) svreinterpret_bf16_u32(svld1_u32(FA_PT32, (const uint32_t *)(const void *)(p)))
#define FA_DP_STORE(p, x) svst1_u32(FA_PT32, (uint32_t *)(void *)(p), svreinterpret_u32_bf16(x))
#define FA_DP_BCAST(w) svreinterpret_bf16_u32(svdup_n_u32(w))
#define FA_DP_ZERO() svreinterpret_bf16_u32(svdup_n_u32(0))
#define FA_DP_FMA(acc, a, b) svbfdot_f32((acc), (a), (b))
/* BFCVT rounds x0 (to nearest even) into each lane's low half, BFCVTNT x1 into its high
 * half: the pairs, in two instructions */
#define FA_DP_CVT2(x0, x1) svcvtnt_bf16_f32_x(svcvt_bf16_f32_x(FA_PT32, (x0)), FA_PT32, (x1))
/* a vector's values as bfloat16 in order: BFCVT, then ST1H stores each lane's low half */
#define FA_DP_STORE16(y, x) \
    svst1h_u32(FA_PT32, (uint16_t *)(y), svreinterpret_u32_bf16(svcvt_bf16_f32_x(FA_PT32, (x))))
/* the first n (<= 2 FA_SVE_VL32) values of rows a and b (b NULL: zeros) as pairs: ZIP1
 * the first FA_SVE_VL32 channels, ZIP2 the rest */
static inline void fa_dp_zip_sve(const uint16_t *a, const uint16_t *b, int n, fa_sbf16 *lo, fa_sbf16 *hi)
{
    const svbool_t pn = svwhilelt_b16_s32(0, n);
    const svuint16_t x = svld1_u16(pn, a), y = b ? svld1_u16(pn, b) : svdup_n_u16(0);
    *lo = svreinterpret_bf16_u16(svzip1_u16(x, y));
    *hi = svreinterpret_bf16_u16(svzip2_u16(x, y));
}
#define FA_DP_ZIP(a, b, n, lo, hi) fa_dp_zip_sve((a), (b), (n), &(lo), &(hi))
#define FA_BF16_DP 1
#define FA_NAME(x) FA_SVE_NAME(x##_bdp)
#else
#define FA_NAME(x) FA_SVE_NAME(x##_kvb16)
#endif
#define FA_KV_HALF 1
#define FA_KV uint16_t
#define FA_KV_BCAST(p) svdup_n_f32(fa_bf16_to_float(*(p)))
#define FA_KV_LOADU(p) fa_bf16_loadu_sve(p)
#define FA_KV_LOADU_N(p, n) fa_bf16_loadu_n_sve((p), (n))
#define FA_KV_SCALAR(x) fa_bf16_to_float(x)
#define FA_16_TO_FLOAT(x) fa_bf16_to_float(x)
#define FA_FLOAT_TO_16(x) fa_float_to_bf16(x)
#include "kernels_tmpl.h"
#ifdef FA_ARM_BF16
#define FA_ARM_BF16_NAME(x) FA_SVE_NAME(x)
#define FA_ARM_BF16_KERNEL_NAME FA_SVE_KERNEL_NAME
#include "kernels_arm_bf16.h"
#else
#include "kernels_undef.h"

/* ---------------- float64 ---------------- */
#define FA_T double
#define FA_V fa_sf64
#define FA_VL FA_SVE_VL64
#define FA_NAME(x) FA_SVE_NAME(x##_f64)
#define FA_QK_R 5
#define FA_QK_NV 4
#define FA_PV_R 5
#define FA_PV_NC 4
#define FA_VLOAD(p) svld1_f64(FA_PT64, (p))
#define FA_VSTORE(p, x) svst1_f64(FA_PT64, (p), (x))
#define FA_VLOADU(p) svld1_f64(FA_PT64, (p))
#define FA_VSTOREU(p, x) svst1_f64(FA_PT64, (p), (x))
#define FA_VLOADU_N(p, n) fa_loadu_n_f64_sve((p), (n))
#define FA_VSET1(x) svdup_n_f64(x)
#define FA_VZERO() svdup_n_f64(0.0)
#define FA_VADD(a, b) svadd_f64_x(FA_PT64, (a), (b))
#define FA_VSUB(a, b) svsub_f64_x(FA_PT64, (a), (b))
#define FA_VMUL(a, b) svmul_f64_x(FA_PT64, (a), (b))
#define FA_VFMA(a, b, c) svmla_f64_x(FA_PT64, (c), (a), (b))
#define FA_VMAX(a, b) svmax_f64_x(FA_PT64, (a), (b))
#define FA_VEXP(x) fa_exp_f64_sve(x)
#define FA_VEXP_LOGIT(x) fa_exp_logit_f64_sve(x)
#define FA_VEXP_LOGIT4(x) fa_exp_logit_n_f64_sve((x), 4)
#define FA_VNEGINF_TO_ZERO(x) fa_neginf_to_zero_f64_sve(x)
#define FA_VREDUCE(x) svaddv_f64(FA_PT64, (x))
#define FA_VABS(x) svabs_f64_x(FA_PT64, (x))
#define FA_VDIV(a, b) svdiv_f64_x(FA_PT64, (a), (b))
#define FA_VCOPYSIGN(m, s) fa_copysign_f64_sve((m), (s))
#define FA_VIN_RANGE(x, j, lo, hi) fa_in_range_f64_sve((x), (j), (lo), (hi))
#define FA_VMASK_BYTES(x, p) fa_mask_bytes_f64_sve((x), (p))
#include "kernels_tmpl.h"
#include "kernels_undef.h"

const fa_kernel FA_SVE_NAME(fa_kernel) = {
    FA_SVE_KERNEL_NAME,
    {FA_SVE_VL32, FA_SVE_VL64},
    {FA_SVE_NAME(fa_qblock_f32), FA_SVE_NAME(fa_qblock_f64), FA_SVE_NAME(fa_qblock_kv16), FA_SVE_NAME(fa_qblock_kvb16)},
    {FA_SVE_NAME(fa_scratch_bytes_f32), FA_SVE_NAME(fa_scratch_bytes_f64), FA_SVE_NAME(fa_scratch_bytes_kv16),
     FA_SVE_NAME(fa_scratch_bytes_kvb16)},
    {FA_SVE_NAME(fa_exp_array_f32), FA_SVE_NAME(fa_exp_array_f64)},
    {FA_SVE_NAME(fa_fma_chains_f32), FA_SVE_NAME(fa_fma_chains_f64)},
    {FA_SVE_NAME(fa_read_streams_f32), FA_SVE_NAME(fa_read_streams_f64)},
    {FA_SVE_NAME(fa_bwd_kv_f32), FA_SVE_NAME(fa_bwd_kv_f64)},
    {FA_SVE_NAME(fa_bwd_q_f32), FA_SVE_NAME(fa_bwd_q_f64)},
    {FA_SVE_NAME(fa_bwd_scratch_bytes_f32), FA_SVE_NAME(fa_bwd_scratch_bytes_f64)},
    {FA_SVE_NAME(fa_bwd_reduce_f32), FA_SVE_NAME(fa_bwd_reduce_f64)},
    {FA_SVE_NAME(fa_mass_kv_f32), FA_SVE_NAME(fa_mass_kv_f64)},
};
#endif /* FA_ARM_BF16 */
