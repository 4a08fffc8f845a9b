/*
 * kernels_generic.c -- the micro-kernels in portable C for any CPU, compiled with
 * the baseline flags only.  Vectors are GNU C vector extensions of 16 bytes (GCC
 * and Clang lower them to SSE2 on x86-64, NEON on AArch64, scalar code elsewhere);
 * exp is the C library's, lane by lane, so this kernel is also the accuracy
 * baseline the SIMD kernels are compared with.
 *
 * Register tiles: 4 x 2 vectors for QK^T and P.V (8 accumulators), which fit the
 * 16 registers of SSE2 and NEON's 32.
 */
#include <math.h>
#include <string.h>
#include "fa_internal.h"

typedef float fa_v4f __attribute__((vector_size(16)));
typedef int32_t fa_v4i __attribute__((vector_size(16)));
typedef double fa_v2d __attribute__((vector_size(16)));
typedef int64_t fa_v2l __attribute__((vector_size(16)));

static inline fa_v4f fa_loadu_v4f(const float *p) { fa_v4f x; memcpy(&x, p, sizeof x); return x; }
static inline void fa_storeu_v4f(float *p, fa_v4f x) { memcpy(p, &x, sizeof x); }
static inline fa_v4f fa_loadu_n_v4f(const float *p, int n)
{
    fa_v4f x = {0, 0, 0, 0};
    for (int i = 0; i < n; i++) x[i] = p[i];
    return x;
}
static inline fa_v4f fa_set1_v4f(float a) { fa_v4f x = {a, a, a, a}; return x; }
/* (a > b) ? a : b lane by lane: a NaN in b is returned. */
static inline fa_v4f fa_max_v4f(fa_v4f a, fa_v4f b)
{
    fa_v4i gt = a > b;
    return (fa_v4f)(((fa_v4i)a & gt) | ((fa_v4i)b & ~gt));
}
static inline fa_v4f fa_exp_v4f(fa_v4f x)
{
    for (int i = 0; i < 4; i++) x[i] = expf(x[i]);
    return x;
}
static inline fa_v4f fa_neginf_to_zero_v4f(fa_v4f x)
{
    fa_v4i inf = x == fa_set1_v4f(-INFINITY);
    return (fa_v4f)((fa_v4i)x & ~inf);
}

static inline fa_v2d fa_loadu_v2d(const double *p) { fa_v2d x; memcpy(&x, p, sizeof x); return x; }
static inline void fa_storeu_v2d(double *p, fa_v2d x) { memcpy(p, &x, sizeof x); }
static inline fa_v2d fa_loadu_n_v2d(const double *p, int n)
{
    fa_v2d x = {0, 0};
    for (int i = 0; i < n; i++) x[i] = p[i];
    return x;
}
static inline fa_v2d fa_set1_v2d(double a) { fa_v2d x = {a, a}; return x; }
static inline fa_v2d fa_max_v2d(fa_v2d a, fa_v2d b)
{
    fa_v2l gt = a > b;
    return (fa_v2d)(((fa_v2l)a & gt) | ((fa_v2l)b & ~gt));
}
static inline fa_v2d fa_exp_v2d(fa_v2d x)
{
    for (int i = 0; i < 2; i++) x[i] = exp(x[i]);
    return x;
}
static inline fa_v2d fa_neginf_to_zero_v2d(fa_v2d x)
{
    fa_v2l inf = x == fa_set1_v2d(-INFINITY);
    return (fa_v2d)((fa_v2l)x & ~inf);
}

/* Lane-by-lane helpers for the variants (softcap, ALiBi, masks), one per element type. */
#define FA_GENERIC_LANE_OPS(V, T, N, ABS, COPYSIGN)                                          \
    static inline V fa_abs_##V(V x)                                                          \
    {                                                                                        \
        for (int i = 0; i < N; i++) x[i] = ABS(x[i]);                                        \
        return x;                                                                            \
    }                                                                                        \
    static inline V fa_copysign_##V(V m, V s)                                                \
    {                                                                                        \
        for (int i = 0; i < N; i++) m[i] = COPYSIGN(m[i], s[i]);                             \
        return m;                                                                            \
    }                                                                                        \
    static inline V fa_in_range_##V(V x, V j, V lo, V hi)                                    \
    {                                                                                        \
        for (int i = 0; i < N; i++)                                                          \
            if (!(lo[i] <= j[i] && j[i] <= hi[i])) x[i] = -(T)INFINITY;                      \
        return x;                                                                            \
    }                                                                                        \
    static inline V fa_mask_bytes_##V(V x, const uint8_t *p)                                 \
    {                                                                                        \
        for (int i = 0; i < N; i++)                                                          \
            if (!p[i]) x[i] = -(T)INFINITY;                                                  \
        return x;                                                                            \
    }
FA_GENERIC_LANE_OPS(fa_v4f, float, 4, fabsf, copysignf)
static inline float fa_reduce_fa_v4f(fa_v4f x) { return (x[0] + x[2]) + (x[1] + x[3]); }
static inline double fa_reduce_fa_v2d(fa_v2d x) { return x[0] + x[1]; }
FA_GENERIC_LANE_OPS(fa_v2d, double, 2, fabs, copysign)

/* ---------------- float32 ---------------- */
#define FA_T float
#define FA_V fa_v4f
#define FA_VL 4
#define FA_NAME(x) x##_f32_generic
#define FA_QK_R 4
#define FA_QK_NV 2
#define FA_PV_R 4
#define FA_PV_NC 2
#define FA_VLOAD(p) (*(const fa_v4f *)(p))
#define FA_VSTORE(p, x) (*(fa_v4f *)(p) = (x))
#define FA_VLOADU(p) fa_loadu_v4f(p)
#define FA_VSTOREU(p, x) fa_storeu_v4f((p), (x))
#define FA_VLOADU_N(p, n) fa_loadu_n_v4f((p), (n))
#define FA_VSET1(x) fa_set1_v4f(x)
#define FA_VZERO() fa_set1_v4f(0.0f)
#define FA_VADD(a, b) ((a) + (b))
#define FA_VSUB(a, b) ((a) - (b))
#define FA_VMUL(a, b) ((a) * (b))
#define FA_VFMA(a, b, c) ((a) * (b) + (c))
#define FA_VMAX(a, b) fa_max_v4f((a), (b))
#define FA_VEXP(x) fa_exp_v4f(x)
#define FA_VNEGINF_TO_ZERO(x) fa_neginf_to_zero_v4f(x)
#define FA_VREDUCE(x) fa_reduce_fa_v4f(x)
#define FA_VABS(x) fa_abs_fa_v4f(x)
#define FA_VDIV(a, b) ((a) / (b))
#define FA_VCOPYSIGN(m, s) fa_copysign_fa_v4f((m), (s))
#define FA_VIN_RANGE(x, j, lo, hi) fa_in_range_fa_v4f((x), (j), (lo), (hi))
#define FA_VMASK_BYTES(x, p) fa_mask_bytes_fa_v4f((x), (p))
#include "kernels_tmpl.h"

/* ---------------- float32 with float16 K/V (converted in scalar C) ---------------- */
static inline fa_v4f fa_half_loadu_n(const uint16_t *p, int n)
{
    fa_v4f x = {0, 0, 0, 0};
    for (int i = 0; i < n; i++) x[i] = fa_half_to_float(p[i]);
    return x;
}
/* The same float32 operations, K and V read as float16. */
#include "kernels_kv16.h"
/* the float32 instantiation's functions, which the 16-bit ones call on float32 copies
 * of their prefill tiles (kern_source.h, fa_tile_f32) */
#define FA_F32(x) x##_f32_generic
#define FA_NAME(x) x##_kv16_generic
#define FA_KV_HALF 1
#define FA_KV uint16_t
#define FA_KV_BCAST(p) fa_set1_v4f(fa_half_to_float(*(p)))
#define FA_KV_LOADU(p) fa_half_loadu_n((p), 4)
#define FA_KV_LOADU_N(p, n) fa_half_loadu_n((p), (n))
#define FA_KV_SCALAR(x) fa_half_to_float(x)
#define FA_KV_TILE_SCALAR 1
#include "kernels_tmpl.h"

/* ---------------- float32 with bfloat16 K/V: a bfloat16 is a float's high half ---------------- */
static inline fa_v4f fa_bf16_loadu_n(const uint16_t *p, int n)
{
    fa_v4f x = {0, 0, 0, 0};
    for (int i = 0; i < n; i++) x[i] = fa_bf16_to_float(p[i]);
    return x;
}
#define fa_bf16_loadu(p) fa_bf16_loadu_n((p), 4)
#include "kernels_kv16.h"
#define FA_NAME(x) x##_kvb16_generic
#define FA_KV_HALF 1
#define FA_KV uint16_t
#define FA_KV_BCAST(p) fa_set1_v4f(fa_bf16_to_float(*(p)))
#define FA_KV_LOADU(p) fa_bf16_loadu(p)
#define FA_KV_LOADU_N(p, n) fa_bf16_loadu_n((p), (n))
#define FA_KV_SCALAR(x) fa_bf16_to_float(x)
#define FA_KV_TILE_SCALAR 1
#define FA_16_TO_FLOAT(x) fa_bf16_to_float(x)
#define FA_FLOAT_TO_16(x) fa_float_to_bf16(x)
#include "kernels_tmpl.h"
#include "kernels_undef.h"

/* ---------------- float64 ---------------- */
#define FA_T double
#define FA_V fa_v2d
#define FA_VL 2
#define FA_NAME(x) x##_f64_generic
#define FA_QK_R 4
#define FA_QK_NV 2
#define FA_PV_R 4
#define FA_PV_NC 2
#define FA_VLOAD(p) (*(const fa_v2d *)(p))
#define FA_VSTORE(p, x) (*(fa_v2d *)(p) = (x))
#define FA_VLOADU(p) fa_loadu_v2d(p)
#define FA_VSTOREU(p, x) fa_storeu_v2d((p), (x))
#define FA_VLOADU_N(p, n) fa_loadu_n_v2d((p), (n))
#define FA_VSET1(x) fa_set1_v2d(x)
#define FA_VZERO() fa_set1_v2d(0.0)
#define FA_VADD(a, b) ((a) + (b))
#define FA_VSUB(a, b) ((a) - (b))
#define FA_VMUL(a, b) ((a) * (b))
#define FA_VFMA(a, b, c) ((a) * (b) + (c))
#define FA_VMAX(a, b) fa_max_v2d((a), (b))
#define FA_VEXP(x) fa_exp_v2d(x)
#define FA_VNEGINF_TO_ZERO(x) fa_neginf_to_zero_v2d(x)
#define FA_VREDUCE(x) fa_reduce_fa_v2d(x)
#define FA_VABS(x) fa_abs_fa_v2d(x)
#define FA_VDIV(a, b) ((a) / (b))
#define FA_VCOPYSIGN(m, s) fa_copysign_fa_v2d((m), (s))
#define FA_VIN_RANGE(x, j, lo, hi) fa_in_range_fa_v2d((x), (j), (lo), (hi))
#define FA_VMASK_BYTES(x, p) fa_mask_bytes_fa_v2d((x), (p))
#include "kernels_tmpl.h"
#include "kernels_undef.h"

const fa_kernel fa_kernel_generic = {
    "generic",
    {4, 2},
    {fa_qblock_f32_generic, fa_qblock_f64_generic, fa_qblock_kv16_generic, fa_qblock_kvb16_generic},
    {fa_scratch_bytes_f32_generic, fa_scratch_bytes_f64_generic, fa_scratch_bytes_kv16_generic,
     fa_scratch_bytes_kvb16_generic},
    {fa_exp_array_f32_generic, fa_exp_array_f64_generic},
    {fa_fma_chains_f32_generic, fa_fma_chains_f64_generic},
    {fa_read_streams_f32_generic, fa_read_streams_f64_generic},
    {fa_bwd_kv_f32_generic, fa_bwd_kv_f64_generic},
    {fa_bwd_q_f32_generic, fa_bwd_q_f64_generic},
    {fa_bwd_scratch_bytes_f32_generic, fa_bwd_scratch_bytes_f64_generic},
    {fa_bwd_reduce_f32_generic, fa_bwd_reduce_f64_generic},
    {fa_mass_kv_f32_generic, fa_mass_kv_f64_generic},
};
