/*
 * kernels_neon_bf16.c -- the neon kernel's bfloat16 pair products (BFDOT on 128-bit
 * vectors: Graviton 3 and 4, Grace, Axion, Neoverse N2, Apple M2 and later), compiled
 * with -march=armv8.2-a+bf16 only; cpu.c runs it on the "bfdot" path where the CPU
 * reports FEAT_BF16 (Linux: AT_HWCAP2's BF16; macOS: hw.optional.arm.FEAT_BF16) and the
 * neon kernel runs.  The code is kernels_neon.c's, compiled with FA_ARM_BF16: its
 * float32 operations, the bfloat16 pair operations there, and kernels_arm_bf16.h.
 *
 * Per 4 logits at head size D: D/2 BFDOTs for QK^T and Dv/2 for P.V, against D + Dv
 * FMLAs on the float32 path; LLVM's models of Neoverse V1, V2 and N2 issue BFDOT at
 * FMLA's rate (bench/mca_model.py).
 */
#define FA_ARM_BF16 1
#include "kernels_neon.c"
