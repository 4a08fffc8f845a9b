/* kernels_kv16.h -- included between an ISA file's float32 instantiation of
 * kernels_tmpl.h and its float16-K/V one: keeps the float32 vector operations and
 * clears the name and the K/V access macros, which the including file then defines
 * for float16 K/V (FA_NAME, FA_KV_HALF, FA_KV, FA_KV_BCAST, FA_KV_LOADU,
 * FA_KV_LOADU_N, FA_KV_SCALAR, and optionally the FA_KV16_* pair transpose). */
#undef FA_NAME
#undef FA_KV
#undef FA_KV_BCAST
#undef FA_KV_LOADU
#undef FA_KV_LOADU_N
#undef FA_KV_SCALAR
#undef FA_KV_TILE_SCALAR
#undef FA_16_TO_FLOAT
#undef FA_FLOAT_TO_16
#undef FA_ROW_TO_16
#undef FA_I8_LOADU
#undef FA_HAVE_I8_PRODUCTS
#undef FA_KV16_V
#undef FA_KV16_PAIR
#undef FA_KV16_LO
#undef FA_KV16_HI
