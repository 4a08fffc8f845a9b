/*
 * kernels_sve128.c -- the SVE kernel at a vector length of 128 bits (AWS Graviton 4,
 * NVIDIA Grace, Google Axion: Neoverse V2), compiled with -march=armv8.2-a+sve
 * -msve-vector-bits=128 only; cpu.c chooses it where the process's SVE vector length is
 * 16 bytes.  The code is kernels_sve.h's: at this length the lanes are NEON's, and what
 * SVE adds is its instructions (FEXPA's exp in the softmax, FMAD, predicated tails).
 */
#define FA_SVE_BITS 128
#define FA_SVE_VL32 4
#define FA_SVE_VL64 2
#define FA_SVE_NAME(x) x##_sve128
#define FA_SVE_KERNEL_NAME "sve128"
#include "kernels_sve.h"
