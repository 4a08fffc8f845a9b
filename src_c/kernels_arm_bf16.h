/*
 * kernels_arm_bf16.h -- the end of an AArch64 bfloat16 pair kernel: kernels_neon.c or
 * kernels_sve.h compiled a second time with FA_ARM_BF16 (kernels_neon_bf16.c,
 * kernels_sve256_bf16.c, kernels_sve128_bf16.c, each with +bf16 added to its kernel's
 * flags) instantiates the float32 template for bfloat16 q, k and v with both products
 * of a prefill block on BFDOT pairs (FA_BF16_DP, kern_bf16dp.h), then includes this
 * file, which adds
 *   the backward on the same pairs (FA_BF16_BWD, kern_bf16bwd.h: its five products),
 *   the fa_bf16_kernel table (with kern_bf16dp.h's peak loop of BFDOT chains), FA_ARM_BF16_NAME(fa_kernel_bf16),
 * for cpu.c's "bfdot" path, which runs the table of the float32 kernel that runs.
 *
 * The includer defines the FA_DP_* pair operations (kern_bf16dp.h, kern_bf16bwd.h) on
 * its vectors, FA_ARM_BF16_NAME(x) (x with the kernel's suffix) and
 * FA_ARM_BF16_KERNEL_NAME, and leaves the float32 vector operations (FA_V, FA_VL, ...)
 * defined.
 *
 * BFDOT's arithmetic (the Arm ARM's BFDotAdd without FEAT_EBF16, or with FPCR.EBF 0,
 * as Linux leaves it): a lane's two products (exact in float32) are added and rounded
 * to odd, then added to the accumulator and rounded to odd, denormal inputs and results
 * flushed to zero; vdpbf16ps rounds each of its two additions to nearest even.  Both
 * are float32 sums of bfloat16 products, within the tolerance the tests hold every
 * bfloat16 path to; their bits differ.
 */

/* The backward on pairs: the float32 backward, its data float32 copies of bfloat16
 * arrays, with the five products on BFDOT. */
#include "kernels_kv16.h" /* keeps the float32 operations */
#undef FA_KV_HALF
#undef FA_16_TO_FLOAT
#undef FA_FLOAT_TO_16
#undef FA_BF16_DP
#define FA_BF16_BWD 1
#define FA_NAME(x) FA_ARM_BF16_NAME(x##_bbw)
/* (of this instantiation only the backward is used: the forward's pieces go unused) */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#include "kernels_tmpl.h"
#pragma GCC diagnostic pop
#undef FA_BF16_BWD

const fa_bf16_kernel FA_ARM_BF16_NAME(fa_kernel_bf16) = {
    FA_ARM_BF16_KERNEL_NAME,
    FA_ARM_BF16_NAME(fa_qblock_bdp),
    FA_ARM_BF16_NAME(fa_scratch_bytes_bdp),
    FA_ARM_BF16_NAME(fa_dp_chains_bdp),
    4.0 * FA_PEAK_CHAINS * FA_VL, /* FA_VL lanes, each two products and two adds */
    FA_ARM_BF16_NAME(fa_bwd_kv_bbw),
    FA_ARM_BF16_NAME(fa_bwd_q_bbw),
    FA_ARM_BF16_NAME(fa_bwd_scratch_bytes_bbw),
    FA_ARM_BF16_NAME(fa_bwd_reduce_bbw),
    0,
    NULL,
    FA_VL,
};
#include "kernels_undef.h"
