/*
 * kernels_sve256.c -- the SVE kernel at a vector length of 256 bits (AWS Graviton 3:
 * Neoverse V1), compiled with -march=armv8.2-a+sve -msve-vector-bits=256 only; cpu.c
 * chooses it where the process's SVE vector length is 32 bytes.  The code is
 * kernels_sve.h's.
 */
#define FA_SVE_BITS 256
#define FA_SVE_VL32 8
#define FA_SVE_VL64 4
#define FA_SVE_NAME(x) x##_sve256
#define FA_SVE_KERNEL_NAME "sve256"
#include "kernels_sve.h"
