/* kernels_avx512_kvb16.h -- after a float32 instantiation of kernels_tmpl.h on AVX-512F:
 * the access macros for bfloat16 K/V (computing in float32); the including file then
 * names the instantiation (FA_NAME) and includes kernels_tmpl.h. */
#include "kernels_kv16.h"
#define FA_KV_HALF 1
#define FA_KV uint16_t
#define FA_KV_BCAST(p) _mm512_set1_ps(fa_bf16_to_float(*(p)))
#define FA_KV_LOADU(p) fa_bf16_loadu(p)
#define FA_KV_LOADU_N(p, n) fa_bf16_loadu_n((p), (n))
#define FA_KV_SCALAR(x) fa_bf16_to_float(x)
#define FA_16_TO_FLOAT(x) fa_bf16_to_float(x)
#define FA_FLOAT_TO_16(x) fa_float_to_bf16(x)
#define FA_ROW_TO_16(d, s, n) fa_row_to_bf16((d), (s), (n))
