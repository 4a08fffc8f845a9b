/*
 * kernels_neon.c -- the micro-kernels for AArch64's Advanced SIMD (NEON), compiled
 * with -march=armv8-a only (NEON and its float16 conversions are part of every
 * AArch64 CPU; chosen at run time by cpu.c, FASTATTN_DISABLE_CPU_FEATURES=NEON turns
 * it off).  128-bit vectors: 4 float32 or 2 float64 lanes.
 *
 * Register tiles (32 vector registers): QK^T 5 keys x 4 query vectors (20
 * accumulators, 4 query vectors and 5 key values: 29 registers) and P.V 5 query rows x
 * 4 value vectors (20 accumulators).  6 x 4, as avx512 has, needs 34 registers: gcc
 * spilled two accumulators, and llvm-mca put the loop at 86-89% of the FMA rate on
 * Neoverse V1/V2, against 95% for 5 x 4 (four 128-bit FMA pipes: 20 FMAs against 9
 * loads a step; bench/mca_model.py, the bench guide's table).
 *
 * exp is the AVX2 kernel's scheme (fa_exp.h: the magic-constant rounding, the doubled
 * polynomial, one multiply by 2^(n-1)) in NEON instructions: the same operations, so
 * the same error bounds (tests/test_exp.py measures them on every kernel).
 *
 * kernels_neon_bf16.c compiles this file again with FA_ARM_BF16 (and +bf16): only the
 * bfloat16 instantiations, with the BFDOT pair operations below, and
 * kernels_arm_bf16.h's table.
 */
#include <arm_neon.h>
#include <math.h>
#include <string.h>
#include "fa_internal.h"
#include "fa_exp.h"

/* ---- float32 lane operations ---- */

/* exp for 4 floats (kernels_avx2.c: fa_exp_f32_avx2 has the scheme).  keep: lanes not
 * below FLUSH (NaN kept: vcltq is false for it); vminq keeps a NaN x NaN. */
static inline float32x4_t fa_exp_f32_neon(float32x4_t x)
{
    const uint32x4_t keep = vmvnq_u32(vcltq_f32(x, vdupq_n_f32(FA_EXP_F32_FLUSH)));
    const float32x4_t magic = vdupq_n_f32(FA_EXP_F32_MAGIC);
    x = vminq_f32(vdupq_n_f32(FA_EXP_F32_HI), x);
    const float32x4_t j = vfmaq_f32(magic, x, vdupq_n_f32(FA_LOG2E_F));
    const float32x4_t n = vsubq_f32(j, magic);
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(FA_LN2_HI_F));
    r = vfmsq_f32(r, n, vdupq_n_f32(FA_LN2_LO_F));
    float32x4_t y = vdupq_n_f32(2 * FA_EXP_F32_M6);
    y = vfmaq_f32(vdupq_n_f32(2 * FA_EXP_F32_M5), y, r);
    y = vfmaq_f32(vdupq_n_f32(2 * FA_EXP_F32_M4), y, r);
    y = vfmaq_f32(vdupq_n_f32(2 * FA_EXP_F32_M3), y, r);
    y = vfmaq_f32(vdupq_n_f32(2 * FA_EXP_F32_M2), y, r);
    y = vfmaq_f32(vdupq_n_f32(2.0f), y, r);
    y = vfmaq_f32(vdupq_n_f32(2.0f), y, r);
    const float32x4_t two_n = vreinterpretq_f32_s32(vshlq_n_s32(vreinterpretq_s32_f32(j), 23));
    return vreinterpretq_f32_u32(vandq_u32(keep, vreinterpretq_u32_f32(vmulq_f32(y, two_n))));
}

/* A constant in every lane (p: 4 copies, 16-byte aligned), loaded afresh where it is
 * asked for.  For an FMA's addend, which NEON's FMLA overwrites: a constant kept in a
 * register would cost a copy (a `mov`) on the vector pipes, which bind the softmax's
 * loop; the load pipes have room. */
static inline float32x4_t fa_fresh_dup_neon(const float *p)
{
    /* (a plain 128-bit load of 4 copies in memory: LD1R would take a vector pipe too;
     * volatile, so that it is neither merged with the same load beside it nor hoisted) */
    float32x4_t v;
    __asm__ volatile("ldr %q0, %1" : "=w"(v) : "m"(*(const float32x4_t *)(const void *)p));
    return v;
}

/* e^x of the softmax's logits (kernels_avx2.c: fa_exp_logit_n_f32_avx2): f = x log2(e)
 * - n in one rounding (x log2 e + (MAGIC - j): the same sum as the other kernels'
 * n - x log2 e negated, so the same value), 2^f by the fitted polynomial; relative error
 * at most u (2 + |x| / 4), u = 2^-24; e^0 = 1 exactly.  nv vectors at once, each step
 * for all of them before the next; each FMA's addend a fresh load (fa_fresh_dup_neon). */
#define FA_X4(v) v, v, v, v
static const float fa_exp_logit_addends_neon[7 * 4] __attribute__((aligned(16))) = {
    FA_X4(FA_EXP_F32_MAGIC), FA_X4(2 * FA_EXP2_F32_P5), FA_X4(2 * FA_EXP2_F32_P4), FA_X4(2 * FA_EXP2_F32_P3),
    FA_X4(2 * FA_EXP2_F32_P2), FA_X4(2 * FA_EXP2_F32_P1), FA_X4(2.0f)};
#undef FA_X4
FA_ALWAYS_INLINE void fa_exp_logit_n_f32_neon(float32x4_t *x, const int nv)
{
    const float *c = fa_exp_logit_addends_neon;
    const float32x4_t magic = vdupq_n_f32(FA_EXP_F32_MAGIC), l2e = vdupq_n_f32(FA_LOG2E_F);
    uint32x4_t flush[4];
    float32x4_t j[4], f[4], y[4];
    FA_PRAGMA_UNROLL(4)
    for (int k = 0; k < nv; k++) {
        flush[k] = vcltq_f32(x[k], vdupq_n_f32(FA_EXP_F32_FLUSH));
        x[k] = vminq_f32(vdupq_n_f32(FA_EXP_F32_HI), x[k]);
    }
    FA_PRAGMA_UNROLL(4)
    for (int k = 0; k < nv; k++) j[k] = vfmaq_f32(fa_fresh_dup_neon(c), x[k], l2e);
    FA_PRAGMA_UNROLL(4)
    for (int k = 0; k < nv; k++) f[k] = vfmaq_f32(vsubq_f32(magic, j[k]), x[k], l2e);
    FA_PRAGMA_UNROLL(4)
    for (int k = 0; k < nv; k++) y[k] = vfmaq_f32(fa_fresh_dup_neon(c + 4), vdupq_n_f32(2 * FA_EXP2_F32_P6), f[k]);
    FA_PRAGMA_UNROLL(5)
    for (int i = 0; i < 5; i++) {
        FA_PRAGMA_UNROLL(4)
        for (int k = 0; k < nv; k++) y[k] = vfmaq_f32(fa_fresh_dup_neon(c + 4 * (2 + i)), y[k], f[k]);
    }
    FA_PRAGMA_UNROLL(4)
    for (int k = 0; k < nv; k++) {
        const float32x4_t two_n = vreinterpretq_f32_s32(vshlq_n_s32(vreinterpretq_s32_f32(j[k]), 23));
        x[k] = vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(vmulq_f32(y[k], two_n)), flush[k]));
    }
}
static inline float32x4_t fa_exp_logit_f32_neon(float32x4_t x)
{
    fa_exp_logit_n_f32_neon(&x, 1);
    return x;
}

static inline float32x4_t fa_neginf_to_zero_f32_neon(float32x4_t x)
{
    const uint32x4_t inf = vceqq_f32(x, vdupq_n_f32(-INFINITY));
    return vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(x), inf));
}
static inline float32x4_t fa_loadu_n_f32_neon(const float *p, int n)
{
    float t[4] = {0, 0, 0, 0};
    memcpy(t, p, (size_t)n * sizeof(float));
    return vld1q_f32(t);
}
static inline float32x4_t fa_copysign_f32_neon(float32x4_t mag, float32x4_t sgn)
{
    return vbslq_f32(vdupq_n_u32(0x80000000u), sgn, mag);
}
static inline float32x4_t fa_in_range_f32_neon(float32x4_t x, float32x4_t j, float32x4_t lo, float32x4_t hi)
{
    const uint32x4_t in = vandq_u32(vcleq_f32(lo, j), vcleq_f32(j, hi));
    return vbslq_f32(in, x, vdupq_n_f32(-INFINITY));
}
/* x where the byte p[lane] != 0, else -inf (4 bytes) */
static inline float32x4_t fa_mask_bytes_f32_neon(float32x4_t x, const uint8_t *p)
{
    uint32_t four;
    memcpy(&four, p, sizeof four);
    const uint32x4_t b = vmovl_u16(vget_low_u16(vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(four)))));
    return vbslq_f32(vceqzq_u32(b), vdupq_n_f32(-INFINITY), x);
}
/* x[t] lane i <- x[i] lane t (4 x 4), in registers */
static inline void fa_transpose_regs_f32_neon(float32x4_t *x)
{
    const float32x4_t t0 = vtrn1q_f32(x[0], x[1]), t1 = vtrn2q_f32(x[0], x[1]);
    const float32x4_t t2 = vtrn1q_f32(x[2], x[3]), t3 = vtrn2q_f32(x[2], x[3]);
    x[0] = vreinterpretq_f32_f64(vtrn1q_f64(vreinterpretq_f64_f32(t0), vreinterpretq_f64_f32(t2)));
    x[1] = vreinterpretq_f32_f64(vtrn1q_f64(vreinterpretq_f64_f32(t1), vreinterpretq_f64_f32(t3)));
    x[2] = vreinterpretq_f32_f64(vtrn2q_f64(vreinterpretq_f64_f32(t0), vreinterpretq_f64_f32(t2)));
    x[3] = vreinterpretq_f32_f64(vtrn2q_f64(vreinterpretq_f64_f32(t1), vreinterpretq_f64_f32(t3)));
}
static inline void fa_transpose_f32_neon(const float *const *rows, int64_t off, float *dst, int64_t ds)
{
    float32x4_t a[4];
    for (int i = 0; i < 4; i++) a[i] = vld1q_f32(rows[i] + off);
    fa_transpose_regs_f32_neon(a);
    for (int t = 0; t < 4; t++) vst1q_f32(dst + t * ds, a[t]);
}
/* 4 int8 (an int8 cache's codes) as float32, exact */
static inline float32x4_t fa_i8_loadu_neon(const int8_t *p)
{
    int32_t w;
    memcpy(&w, p, sizeof w);
    const int16x8_t h = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(w)));
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(h)));
}

/* 4 int4 codes as float32 (exact, 0..15): the low nibbles (sh 0) or the high ones (sh 4)
 * of the 4 bytes at p, unpacked in registers */
static inline float32x4_t fa_u4_loadu_neon(const uint8_t *p, int sh)
{
    uint32_t w;
    memcpy(&w, p, sizeof w);
    uint8x8_t b = vreinterpret_u8_u32(vdup_n_u32(w));
    b = vand_u8(sh ? vshr_n_u8(b, 4) : b, vdup_n_u8(15));
    return vcvtq_f32_u32(vmovl_u16(vget_low_u16(vmovl_u8(b))));
}

/* ---- float64 lane operations ---- */

/* exp for 2 doubles (kernels_avx2.c: fa_exp_f64_avx2): magic 1.5 * 2^52 + 1022, the
 * exponent field 52 bits up, the degree-13 Taylor polynomial, doubled. */
static inline float64x2_t fa_exp_f64_neon(float64x2_t x)
{
    const uint64x2_t keep = vreinterpretq_u64_u32(vmvnq_u32(vreinterpretq_u32_u64(vcltq_f64(x, vdupq_n_f64(FA_EXP_F64_FLUSH)))));
    const float64x2_t magic = vdupq_n_f64(FA_EXP_F64_MAGIC);
    x = vminq_f64(vdupq_n_f64(FA_EXP_F64_HI), x);
    const float64x2_t j = vfmaq_f64(magic, x, vdupq_n_f64(FA_LOG2E));
    const float64x2_t n = vsubq_f64(j, magic);
    float64x2_t r = vfmsq_f64(x, n, vdupq_n_f64(FA_LN2_HI));
    r = vfmsq_f64(r, n, vdupq_n_f64(FA_LN2_LO));
    float64x2_t y = vdupq_n_f64(2 * fa_exp_f64_coef[FA_EXP_F64_DEG]);
    for (int i = FA_EXP_F64_DEG - 1; i >= 0; i--) y = vfmaq_f64(vdupq_n_f64(2 * fa_exp_f64_coef[i]), y, r);
    const float64x2_t two_n = vreinterpretq_f64_s64(vshlq_n_s64(vreinterpretq_s64_f64(j), 52));
    return vreinterpretq_f64_u64(vandq_u64(keep, vreinterpretq_u64_f64(vmulq_f64(y, two_n))));
}
/* e^x of float64 logits (kernels_avx2.c: fa_exp_logit_n_f64_avx2): 2^f by the degree-11
 * fit; relative error at most u (2 + |x| / 4), u = 2^-53 */
FA_ALWAYS_INLINE void fa_exp_logit_n_f64_neon(float64x2_t *x, const int nv)
{
    const float64x2_t magic = vdupq_n_f64(FA_EXP_F64_MAGIC), l2e = vdupq_n_f64(FA_LOG2E);
    uint64x2_t keep[4];
    float64x2_t j[4], f[4], y[4];
    FA_PRAGMA_UNROLL(4)
    for (int k = 0; k < nv; k++) {
        keep[k] = vreinterpretq_u64_u32(vmvnq_u32(vreinterpretq_u32_u64(vcltq_f64(x[k], vdupq_n_f64(FA_EXP_F64_FLUSH)))));
        x[k] = vminq_f64(vdupq_n_f64(FA_EXP_F64_HI), x[k]);
    }
    FA_PRAGMA_UNROLL(4)
    for (int k = 0; k < nv; k++) j[k] = vfmaq_f64(magic, x[k], l2e);
    FA_PRAGMA_UNROLL(4)
    for (int k = 0; k < nv; k++) {
        f[k] = vnegq_f64(vfmsq_f64(vsubq_f64(j[k], magic), x[k], l2e));
        y[k] = vdupq_n_f64(2 * fa_exp2_f64_fit[FA_EXP2_F64_FIT_DEG]);
    }
    FA_PRAGMA_UNROLL(11)
    for (int i = FA_EXP2_F64_FIT_DEG - 1; i >= 0; i--) {
        FA_PRAGMA_UNROLL(4)
        for (int k = 0; k < nv; k++) y[k] = vfmaq_f64(vdupq_n_f64(2 * fa_exp2_f64_fit[i]), y[k], f[k]);
    }
    FA_PRAGMA_UNROLL(4)
    for (int k = 0; k < nv; k++) {
        const float64x2_t two_n = vreinterpretq_f64_s64(vshlq_n_s64(vreinterpretq_s64_f64(j[k]), 52));
        x[k] = vreinterpretq_f64_u64(vandq_u64(keep[k], vreinterpretq_u64_f64(vmulq_f64(y[k], two_n))));
    }
}
static inline float64x2_t fa_exp_logit_f64_neon(float64x2_t x)
{
    fa_exp_logit_n_f64_neon(&x, 1);
    return x;
}
static inline float64x2_t fa_neginf_to_zero_f64_neon(float64x2_t x)
{
    const uint64x2_t inf = vceqq_f64(x, vdupq_n_f64(-INFINITY));
    return vreinterpretq_f64_u64(vbicq_u64(vreinterpretq_u64_f64(x), inf));
}
static inline float64x2_t fa_loadu_n_f64_neon(const double *p, int n)
{
    double t[2] = {0, 0};
    memcpy(t, p, (size_t)n * sizeof(double));
    return vld1q_f64(t);
}
static inline float64x2_t fa_copysign_f64_neon(float64x2_t mag, float64x2_t sgn)
{
    return vbslq_f64(vdupq_n_u64(0x8000000000000000ull), sgn, mag);
}
static inline float64x2_t fa_in_range_f64_neon(float64x2_t x, float64x2_t j, float64x2_t lo, float64x2_t hi)
{
    const uint64x2_t in = vandq_u64(vcleq_f64(lo, j), vcleq_f64(j, hi));
    return vbslq_f64(in, x, vdupq_n_f64(-INFINITY));
}
static inline float64x2_t fa_mask_bytes_f64_neon(float64x2_t x, const uint8_t *p)
{
    const uint64x2_t b = vcombine_u64(vdup_n_u64(p[0]), vdup_n_u64(p[1]));
    return vbslq_f64(vceqzq_u64(b), vdupq_n_f64(-INFINITY), x);
}
static inline void fa_transpose_regs_f64_neon(float64x2_t *x)
{
    const float64x2_t a = vtrn1q_f64(x[0], x[1]), b = vtrn2q_f64(x[0], x[1]);
    x[0] = a;
    x[1] = b;
}
static inline void fa_transpose_f64_neon(const double *const *rows, int64_t off, double *dst, int64_t ds)
{
    float64x2_t a[2] = {vld1q_f64(rows[0] + off), vld1q_f64(rows[1] + off)};
    fa_transpose_regs_f64_neon(a);
    vst1q_f64(dst, a[0]);
    vst1q_f64(dst + ds, a[1]);
}

#define FA_HAVE_TRANSPOSE 1

/* ---------------- float32 ---------------- */
#define FA_T float
#define FA_V float32x4_t
#define FA_VL 4
#define FA_NAME(x) x##_f32_neon
#define FA_QK_R 5
#define FA_QK_NV 4
#define FA_PV_R 5
#define FA_PV_NC 4
#define FA_VLOAD(p) vld1q_f32(p)
#define FA_VSTORE(p, x) vst1q_f32((p), (x))
#define FA_VLOADU(p) vld1q_f32(p)
#define FA_VSTOREU(p, x) vst1q_f32((p), (x))
#define FA_VLOADU_N(p, n) fa_loadu_n_f32_neon((p), (n))
#define FA_VSET1(x) vdupq_n_f32(x)
#define FA_VZERO() vdupq_n_f32(0.0f)
#define FA_VADD(a, b) vaddq_f32((a), (b))
#define FA_VSUB(a, b) vsubq_f32((a), (b))
#define FA_VMUL(a, b) vmulq_f32((a), (b))
#define FA_VFMA(a, b, c) vfmaq_f32((c), (a), (b))
#define FA_VMAX(a, b) vmaxq_f32((a), (b))
#define FA_VEXP(x) fa_exp_f32_neon(x)
#define FA_VEXP_LOGIT(x) fa_exp_logit_f32_neon(x)
#define FA_VEXP_LOGIT4(x) fa_exp_logit_n_f32_neon((x), 4)
#define FA_VNEGINF_TO_ZERO(x) fa_neginf_to_zero_f32_neon(x)
#define FA_VREDUCE(x) vaddvq_f32(x)
#define FA_VABS(x) vabsq_f32(x)
#define FA_VDIV(a, b) vdivq_f32((a), (b))
#define FA_VCOPYSIGN(m, s) fa_copysign_f32_neon((m), (s))
#define FA_VIN_RANGE(x, j, lo, hi) fa_in_range_f32_neon((x), (j), (lo), (hi))
#define FA_VMASK_BYTES(x, p) fa_mask_bytes_f32_neon((x), (p))
#define FA_VTRANSPOSE(r, o, d, s) fa_transpose_f32_neon((r), (o), (d), (s))
#define FA_VTRANSPOSE_REGS(x) fa_transpose_regs_f32_neon(x)
#define FA_I8_LOADU(p) fa_i8_loadu_neon((const int8_t *)(const void *)(p))
#define FA_U4_LOADU(p, sh) fa_u4_loadu_neon((const uint8_t *)(const void *)(p), (sh))
#ifndef FA_ARM_BF16 /* (kernels_neon_bf16.c: only the bfloat16 instantiations below) */
#include "kernels_tmpl.h"

/* ---------------- float32 with float16 K/V: converted in registers (FCVTL) ---------------- */
static inline float32x4_t fa_half_loadu_neon(const uint16_t *p)
{
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
}
static inline float32x4_t fa_half_loadu_n_neon(const uint16_t *p, int n)
{
    uint16_t t[4] = {0, 0, 0, 0};
    memcpy(t, p, (size_t)n * sizeof(uint16_t));
    return fa_half_loadu_neon(t);
}
/* n floats to float16, 4 at a time by FCVTN (round to nearest even under the default
 * FPCR, as fa_float_to_half); a group of 4 holding a NaN goes through
 * fa_float_to_half, whose NaN keeps no payload. */
static inline void fa_row_to_half_neon(uint16_t *d, const float *s, int64_t n)
{
    int64_t c = 0;
    for (; c + 4 <= n; c += 4) {
        const float32x4_t x = vld1q_f32(s + c);
        if (vminvq_u32(vceqq_f32(x, x)) == 0) {
            for (int i = 0; i < 4; i++) d[c + i] = fa_float_to_half(s[c + i]);
            continue;
        }
        vst1_u16(d + c, vreinterpret_u16_f16(vcvt_f16_f32(x)));
    }
    for (; c < n; c++) d[c] = fa_float_to_half(s[c]);
}
#include "kernels_kv16.h"
#define FA_F32(x) x##_f32_neon
#define FA_NAME(x) x##_kv16_neon
#define FA_KV_HALF 1
#define FA_KV uint16_t
#define FA_KV_BCAST(p) vdupq_n_f32(fa_half_to_float(*(p)))
#define FA_KV_LOADU(p) fa_half_loadu_neon(p)
#define FA_KV_LOADU_N(p, n) fa_half_loadu_n_neon((p), (n))
#define FA_KV_SCALAR(x) fa_half_to_float(x)
#define FA_ROW_TO_16(d, s, n) fa_row_to_half_neon((d), (s), (n))
#include "kernels_tmpl.h"
#endif /* FA_ARM_BF16 */

/* ---------------- float32 with bfloat16 K/V: a bfloat16 is a float's high half ---------------- */
static inline float32x4_t fa_bf16_loadu_neon(const uint16_t *p)
{
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
}
static inline float32x4_t fa_bf16_loadu_n_neon(const uint16_t *p, int n)
{
    uint16_t t[4] = {0, 0, 0, 0};
    memcpy(t, p, (size_t)n * sizeof(uint16_t));
    return fa_bf16_loadu_neon(t);
}
#include "kernels_kv16.h"
#ifdef FA_ARM_BF16
/* q, k and v bfloat16 with both products on BFDOT pairs (kern_bf16dp.h): 4 pairs a
 * vector, one a float32 lane */
#define FA_DP_V bfloat16x8_t
#define FA_DP_LOAD(p) vreinterpretq_bf16_u32(vld1q_u32((const uint32_t *)(const void *)(p)))
#define FA_DP_STORE(p, x) vst1q_u32((uint32_t *)(void *)(p), vreinterpretq_u32_bf16(x))
#define FA_DP_BCAST(w) vreinterpretq_bf16_u32(vdupq_n_u32(w))
#define FA_DP_ZERO() vreinterpretq_bf16_u32(vdupq_n_u32(0))
#define FA_DP_FMA(acc, a, b) vbfdotq_f32((acc), (a), (b))
/* QK^T by element: a key row's 4 pairs loaded once, pair u of them against every lane
 * (a broadcast is LDR + DUP, the DUP on a vector pipe: 25 vector instructions for 20
 * BFDOT in the 5 x 4 tile) */
#define FA_DP_K4 bfloat16x8_t
#define FA_DP_LOAD_K4(p) vreinterpretq_bf16_u16(vld1q_u16(p))
#define FA_DP_FMA_K4(acc, q, kv, u) vbfdotq_laneq_f32((acc), (q), (kv), (u))
/* BFCVTN puts x0's 4 values (rounded to nearest even) in elements 0-3, x1's likewise;
 * ZIP1 interleaves them into pairs */
static inline bfloat16x8_t fa_dp_cvt2_neon(float32x4_t x0, float32x4_t x1)
{
    const uint16x8_t a = vreinterpretq_u16_bf16(vcvtq_low_bf16_f32(x0));
    const uint16x8_t b = vreinterpretq_u16_bf16(vcvtq_low_bf16_f32(x1));
    return vreinterpretq_bf16_u16(vzip1q_u16(a, b));
}
#define FA_DP_CVT2(x0, x1) fa_dp_cvt2_neon((x0), (x1))
#define FA_DP_STORE16(y, x) vst1_u16((y), vreinterpret_u16_bf16(vcvt_bf16_f32(x)))
/* the first n (<= 8) values of rows a and b (b NULL: zeros) as pairs: lo channels 0-3,
 * hi 4-7 */
static inline uint16x8_t fa_dp_load8_neon(const uint16_t *a, int n)
{
    if (!a) return vdupq_n_u16(0);
    if (n >= 8) return vld1q_u16(a);
    uint16_t t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    memcpy(t, a, (size_t)n * sizeof(uint16_t));
    return vld1q_u16(t);
}
static inline void fa_dp_zip_neon(const uint16_t *a, const uint16_t *b, int n, bfloat16x8_t *lo, bfloat16x8_t *hi)
{
    const uint16x8_t x = fa_dp_load8_neon(a, n), y = fa_dp_load8_neon(b, n);
    *lo = vreinterpretq_bf16_u16(vzip1q_u16(x, y));
    *hi = vreinterpretq_bf16_u16(vzip2q_u16(x, y));
}
#define FA_DP_ZIP(a, b, n, lo, hi) fa_dp_zip_neon((a), (b), (n), &(lo), &(hi))
#define FA_BF16_DP 1
#define FA_NAME(x) x##_bdp_neon
#else
#define FA_NAME(x) x##_kvb16_neon
#endif
#define FA_KV_HALF 1
#define FA_KV uint16_t
#define FA_KV_BCAST(p) vdupq_n_f32(fa_bf16_to_float(*(p)))
#define FA_KV_LOADU(p) fa_bf16_loadu_neon(p)
#define FA_KV_LOADU_N(p, n) fa_bf16_loadu_n_neon((p), (n))
#define FA_KV_SCALAR(x) fa_bf16_to_float(x)
#define FA_16_TO_FLOAT(x) fa_bf16_to_float(x)
#define FA_FLOAT_TO_16(x) fa_float_to_bf16(x)
#include "kernels_tmpl.h"
#ifdef FA_ARM_BF16
#define FA_ARM_BF16_NAME(x) x##_neon
#define FA_ARM_BF16_KERNEL_NAME "neon-bfdot"
#include "kernels_arm_bf16.h"
#else
#include "kernels_undef.h"

/* ---------------- float64 ---------------- */
#define FA_T double
#define FA_V float64x2_t
#define FA_VL 2
#define FA_NAME(x) x##_f64_neon
#define FA_QK_R 5
#define FA_QK_NV 4
#define FA_PV_R 5
#define FA_PV_NC 4
#define FA_VLOAD(p) vld1q_f64(p)
#define FA_VSTORE(p, x) vst1q_f64((p), (x))
#define FA_VLOADU(p) vld1q_f64(p)
#define FA_VSTOREU(p, x) vst1q_f64((p), (x))
#define FA_VLOADU_N(p, n) fa_loadu_n_f64_neon((p), (n))
#define FA_VSET1(x) vdupq_n_f64(x)
#define FA_VZERO() vdupq_n_f64(0.0)
#define FA_VADD(a, b) vaddq_f64((a), (b))
#define FA_VSUB(a, b) vsubq_f64((a), (b))
#define FA_VMUL(a, b) vmulq_f64((a), (b))
#define FA_VFMA(a, b, c) vfmaq_f64((c), (a), (b))
#define FA_VMAX(a, b) vmaxq_f64((a), (b))
#define FA_VEXP(x) fa_exp_f64_neon(x)
#define FA_VEXP_LOGIT(x) fa_exp_logit_f64_neon(x)
#define FA_VEXP_LOGIT4(x) fa_exp_logit_n_f64_neon((x), 4)
#define FA_VNEGINF_TO_ZERO(x) fa_neginf_to_zero_f64_neon(x)
#define FA_VREDUCE(x) vaddvq_f64(x)
#define FA_VABS(x) vabsq_f64(x)
#define FA_VDIV(a, b) vdivq_f64((a), (b))
#define FA_VCOPYSIGN(m, s) fa_copysign_f64_neon((m), (s))
#define FA_VIN_RANGE(x, j, lo, hi) fa_in_range_f64_neon((x), (j), (lo), (hi))
#define FA_VMASK_BYTES(x, p) fa_mask_bytes_f64_neon((x), (p))
#define FA_VTRANSPOSE(r, o, d, s) fa_transpose_f64_neon((r), (o), (d), (s))
#define FA_VTRANSPOSE_REGS(x) fa_transpose_regs_f64_neon(x)
#include "kernels_tmpl.h"
#include "kernels_undef.h"

const fa_kernel fa_kernel_neon = {
    "neon",
    {4, 2},
    {fa_qblock_f32_neon, fa_qblock_f64_neon, fa_qblock_kv16_neon, fa_qblock_kvb16_neon},
    {fa_scratch_bytes_f32_neon, fa_scratch_bytes_f64_neon, fa_scratch_bytes_kv16_neon,
     fa_scratch_bytes_kvb16_neon},
    {fa_exp_array_f32_neon, fa_exp_array_f64_neon},
    {fa_fma_chains_f32_neon, fa_fma_chains_f64_neon},
    {fa_read_streams_f32_neon, fa_read_streams_f64_neon},
    {fa_bwd_kv_f32_neon, fa_bwd_kv_f64_neon},
    {fa_bwd_q_f32_neon, fa_bwd_q_f64_neon},
    {fa_bwd_scratch_bytes_f32_neon, fa_bwd_scratch_bytes_f64_neon},
    {fa_bwd_reduce_f32_neon, fa_bwd_reduce_f64_neon},
    {fa_mass_kv_f32_neon, fa_mass_kv_f64_neon},
};
#endif /* FA_ARM_BF16 */
