/*
 * kernels_amx.c -- the forward for bfloat16 q, k and v on AMX-BF16 (Intel Xeon 4th
 * generation and later): the AVX512-BF16 kernel (kernels_avx512bf16.c) with both
 * products of a prefill block's whole 16 x 16 tiles on the tile unit (kern_amx.h).
 * Compiled with -mamx-tile -mamx-bf16 -mavx512bf16 -mavx512f -mavx512bw (and the
 * AVX2/FMA/F16C baseline); cpu.c offers it only where CPUID reports AMX-TILE,
 * AMX-BF16, AVX512-BF16 and AVX512BW, the OS enables the tile state (XCR0 bits 17 and
 * 18) and Linux grants this process the tile data (arch_prctl ARCH_REQ_XCOMP_PERM,
 * asked once; a refusal leaves the AVX512-BF16 path).
 *
 * Test-only build (FA_EMULATE_AMX, setup.py under FASTATTN_EMULATE_BF16=1, compiled
 * for AVX2 only): the tile operations come from amx_model.h (a software model of the
 * tiles and of tdpbf16ps) and the AVX-512 ones from SIMDe, as in the emulated
 * AVX512-BF16 build; so the same source runs against the oracle on any AVX2 CPU.
 * Never shipped.
 *
 * What the tiles should reach (Sapphire Rapids, per core and cycle): tdpbf16ps does
 * 16 x 16 x 32 multiply-adds (16,384 flops) in 16 cycles, 1,024 flops a cycle, 16x
 * the two 512-bit float32 FMA ports.  Per 16 x 16 logits at D = 128 the two products
 * take 8 tdpbf16ps (QK^T 4, P.V 4 at Dv = 128) = 128 cycles of the tile unit, while the
 * online softmax of those 256 logits takes about 16 x 15 = 240 AVX-512 instructions
 * (exp, max, rescale, sum) plus 16 for P's rounding and 64 for its transpose: about
 * 160 cycles on two ports.  The softmax is the bound; the tile unit runs beside the
 * vector ports, so at best the block costs max(128, 160) cycles: 16 x 16 x 2 x 2 x 128
 * flops / 160 = 819 flops a cycle, 80% of the AMX peak, and half of that (40%) where
 * the two do not overlap.
 */
#include "kernels_avx512.h"

#include "kernels_avx512bf16.h"

#ifdef FA_EMULATE_AMX
#include "amx_model.h"
#define FA_TILE_CONFIG(cfg) fa_amx_loadconfig(cfg)
#define FA_TILE_RELEASE() fa_amx_release()
#define FA_TILE_ZERO(t) fa_amx_zero(t)
#define FA_TILE_LOAD(t, p, stride) fa_amx_loadd((t), (p), (stride))
#define FA_TILE_STORE(t, p, stride) fa_amx_stored((t), (p), (stride))
#define FA_TILE_DP(c, a, b) fa_amx_dpbf16ps((c), (a), (b))
#else
#include <immintrin.h>
#define FA_TILE_CONFIG(cfg) _tile_loadconfig(cfg)
#define FA_TILE_RELEASE() _tile_release()
#define FA_TILE_ZERO(t) _tile_zero(t)
#define FA_TILE_LOAD(t, p, stride) _tile_loadd(t, (p), (stride))
#define FA_TILE_STORE(t, p, stride) _tile_stored(t, (p), (stride))
#define FA_TILE_DP(c, a, b) _tile_dpbf16ps(c, a, b)
#endif

#ifdef FA_EMULATE_AMX
long fa_amx_model_ops(void) { return __atomic_load_n(&fa_amx_dp_count, __ATOMIC_RELAXED); }
long fa_bf16_model_check(long count) { return fa_model_pair_check(count); }
#endif

/* 16 x 16 32-bit words transposed in registers (the float32 transpose moves bits) */
static inline void fa_dp_transpose(__m512i *x)
{
    __m512 f[16];
    for (int i = 0; i < 16; i++) f[i] = _mm512_castsi512_ps(x[i]);
    fa_transpose_regs_ps(f);
    for (int i = 0; i < 16; i++) x[i] = _mm512_castps_si512(f[i]);
}
#define FA_DP_TRANSPOSE(x) fa_dp_transpose(x)

#define FA_BF16_DP 1
#define FA_BF16_AMX 1
#include "kernels_avx512_kvb16.h"
#define FA_NAME(x) x##_amx
#include "kernels_tmpl.h"
#include "kern_amx_rows.h"

/* The backward on the tiles (kern_bf16bwd.h with FA_BF16_AMX): the float32 backward, its
 * data float32 copies of bfloat16 arrays, with its five products on tdpbf16ps. */
#include "kernels_kv16.h" /* keeps the float32 operations */
#undef FA_KV_HALF
#undef FA_16_TO_FLOAT
#undef FA_FLOAT_TO_16
#undef FA_BF16_DP
#define FA_BF16_BWD 1
#define FA_NAME(x) x##_abw_amx
/* (of this instantiation only the backward is used: the forward's pieces go unused) */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#include "kernels_tmpl.h"
#pragma GCC diagnostic pop
#undef FA_BF16_BWD
#include "kernels_undef.h"

/* The tile unit's peak loop (fastattn.bench.bf16_peak): iters rounds of 4 tdpbf16ps
 * into 4 accumulator tiles (16 x 16 x 32 multiply-adds each), A all ones and B all a
 * (as bfloat16; the sums grow by 32 a a round, far from overflow), returning the sum
 * of one accumulator row. */
static double fa_amx_chains(int64_t iters, double m, double a)
{
    (void)m;
    uint16_t ab[16 * 32], ones[16 * 32];
    const uint16_t w = fa_float_to_bf16((float)a);
    for (int i = 0; i < 16 * 32; i++) {
        ab[i] = w;
        ones[i] = 0x3F80u;
    }
    float c[16 * 16];
    uint8_t cfg[64];
    memset(cfg, 0, sizeof cfg);
    cfg[0] = 1;
    for (int t = 0; t < 8; t++) {
        const uint16_t colsb = 64;
        memcpy(cfg + 16 + 2 * t, &colsb, sizeof colsb);
        cfg[48 + t] = 16;
    }
    FA_TILE_CONFIG(cfg);
    FA_TILE_ZERO(0);
    FA_TILE_ZERO(1);
    FA_TILE_ZERO(2);
    FA_TILE_ZERO(3);
    FA_TILE_LOAD(4, ones, 64);
    FA_TILE_LOAD(5, ones, 64);
    FA_TILE_LOAD(6, ab, 64);
    FA_TILE_LOAD(7, ab, 64);
    for (int64_t i = 0; i < iters; i++) {
        FA_TILE_DP(0, 4, 6);
        FA_TILE_DP(1, 4, 7);
        FA_TILE_DP(2, 5, 6);
        FA_TILE_DP(3, 5, 7);
    }
    FA_TILE_STORE(0, c, 64);
    FA_TILE_RELEASE();
    double sum = 0.0;
    for (int i = 0; i < 16; i++) sum += c[i];
    return sum;
}

/* The backward's blocks on the tiles: a sweep of query rows x keys, 1 thread, B1 H2 L2048,
 * medians of 5, GFLOP/s (2.5 x the forward's flops; a Sapphire Rapids class Xeon):
 *   D=64:  192x64 519 | 128x64 507 | 64x64 501 | 192x32 478 | 256x64 478 | 128x32 472
 *   D=128: 192x64 655 | 128x64 606 | 192x32 591 | 256x32 583 | 128x32 556
 * so 192 rows (the keys stay 64).  What bounds it: the tile products take half of the
 * time at about a quarter of the tile unit's rate (a profile puts its samples on the
 * first load of each dK/dV accumulator tile and on the first vector reads of stored S
 * and dP tiles, yet a timing probe that zeroed the accumulators instead of loading them
 * saved only 7-9%), the float32 exp and dS a fifth, bfloat16 packing the rest. */
const fa_bf16_kernel fa_kernel_amx_bf16 = {
#ifdef FA_EMULATE_AMX
    "amx-bf16 (a software model of the tiles: a test build)",
#else
    "amx-bf16",
#endif
    fa_qblock_any_amx,
    fa_scratch_bytes_amx,
    fa_amx_chains,
    4.0 * 16 * 16 * 32 * 2, /* flops a round: 4 tiles of 16 x 16 x 32 multiply-adds */
    fa_bwd_kv_abw_amx,
    fa_bwd_q_abw_amx,
    fa_bwd_scratch_bytes_abw_amx,
    fa_bwd_reduce_abw_amx,
    192, /* the backward's query rows: see the sweep above */
    fa_rows_share_bytes_amx,
    16,
};
