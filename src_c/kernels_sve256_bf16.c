/*
 * kernels_sve256_bf16.c -- the sve256 kernel's bfloat16 pair products (SVE's BFDOT on
 * 256-bit vectors: Graviton 3), compiled with -march=armv8.2-a+sve+bf16
 * -msve-vector-bits=256 only; cpu.c runs it on the "bfdot" path where the CPU reports
 * SVE's bfloat16 instructions (AT_HWCAP2's SVEBF16) and the sve256 kernel runs.  The code
 * is kernels_sve.h's, compiled with FA_ARM_BF16, and kernels_arm_bf16.h.
 */
#define FA_SVE_BITS 256
#define FA_SVE_VL32 8
#define FA_SVE_VL64 4
#define FA_SVE_NAME(x) x##_sve256
#define FA_SVE_KERNEL_NAME "sve256-bfdot"
#define FA_ARM_BF16 1
#include "kernels_sve.h"
