/*
 * kernels_sve128_bf16.c -- the sve128 kernel's bfloat16 pair products (SVE's BFDOT on
 * 128-bit vectors: Graviton 4, Grace, Axion), compiled with -march=armv8.2-a+sve+bf16
 * -msve-vector-bits=128 only; cpu.c runs it on the "bfdot" path where the CPU reports
 * SVE's bfloat16 instructions (AT_HWCAP2's SVEBF16) and the sve128 kernel runs.  The code
 * is kernels_sve.h's, compiled with FA_ARM_BF16, and kernels_arm_bf16.h.
 */
#define FA_SVE_BITS 128
#define FA_SVE_VL32 4
#define FA_SVE_VL64 2
#define FA_SVE_NAME(x) x##_sve128
#define FA_SVE_KERNEL_NAME "sve128-bfdot"
#define FA_ARM_BF16 1
#include "kernels_sve.h"
