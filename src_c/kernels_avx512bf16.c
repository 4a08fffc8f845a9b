/*
 * kernels_avx512bf16.c -- the forward for bfloat16 q, k and v on AVX512-BF16
 * (vdpbf16ps): the float32 AVX-512 kernel (kernels_avx512.h) with both products of a
 * prefill block on bfloat16 pairs (kern_bf16dp.h).  Compiled with -mavx512f -mavx512bw
 * -mavx512bf16 (and the AVX2/FMA/F16C baseline); cpu.c offers it only where CPUID
 * reports AVX512-BF16 and AVX512BW and the avx512 kernel runs.
 *
 * Test-only build (FA_EMULATE_BF16, setup.py under FASTATTN_EMULATE_BF16=1, compiled
 * for AVX2 only): every AVX-512 operation comes from SIMDe (Debian's libsimde-dev,
 * header only), vdpbf16ps from bf16_model.h (lane by lane: the even product, then the
 * odd one, each rounded, denormals flushed; the AMX model's arithmetic too), and the
 * float32 -> bfloat16 rounding is done with integer operations; so the same source runs against the oracle on any AVX2 or
 * AVX-512 CPU, called from the avx2 or the avx512 kernel.  Never shipped.
 *
 * The backward of such calls (fa_bf16_bwd_kernel) takes the same pairs for its five
 * products: the template instantiated a second time, for float32, with FA_BF16_BWD.
 *
 * Per 16 logits at head size D: D/2 vdpbf16ps for QK^T and Dv/2 for P.V, each with
 * the work of two float32 FMAs, against D + Dv FMAs on the float32 path; the softmax
 * (about 15 vector instructions) is unchanged.
 */
#include "kernels_avx512.h"

#include "kernels_avx512bf16.h"

#define FA_BF16_DP 1
#include "kernels_avx512_kvb16.h"
#define FA_NAME(x) x##_bdp_avx512
#include "kernels_tmpl.h"

/* The backward on pairs (kern_bf16bwd.h): the float32 backward, its data float32 copies
 * of bfloat16 arrays, with the five products on vdpbf16ps. */
#include "kernels_kv16.h" /* keeps the float32 operations */
#undef FA_KV_HALF
#undef FA_16_TO_FLOAT
#undef FA_FLOAT_TO_16
#undef FA_BF16_DP
#define FA_BF16_BWD 1
#define FA_NAME(x) x##_bbw_avx512
/* (of this instantiation only the backward is used: the forward's pieces go unused) */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#include "kernels_tmpl.h"
#pragma GCC diagnostic pop
#undef FA_BF16_BWD
#include "kernels_undef.h"

const fa_bf16_kernel fa_kernel_avx512_bf16 = {
#ifdef FA_EMULATE_BF16
    "avx512-bf16 (emulated over SIMDe: a test build)",
#else
    "avx512-bf16",
#endif
    fa_qblock_bdp_avx512,
    fa_scratch_bytes_bdp_avx512,
    fa_dp_chains_bdp_avx512,
    4.0 * FA_PEAK_CHAINS * 16, /* 16 lanes, each two products and two adds */
    fa_bwd_kv_bbw_avx512,
    fa_bwd_q_bbw_avx512,
    fa_bwd_scratch_bytes_bbw_avx512,
    fa_bwd_reduce_bbw_avx512,
    0,
    NULL,
    16,
};
