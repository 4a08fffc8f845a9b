/*
 * fa_plan.c -- planning and scheduling: the checks of a call's params, the block
 * sizes (from measurements, below), how a call is cut into work items (batch, kv
 * head, head chunk, query block) and each item's visible key range, the item order
 * (head-major; causal calls by query block, heavy blocks first), and the head-major
 * order with per-thread K/V copies for strided K/V.  Pure functions of the params:
 * which thread runs an item never changes its result, and block sizes never depend on
 * the thread count.
 */
#include <math.h>
#include <stdlib.h>
#include "fa_driver.h"

/*
 * Default block sizes, from measurement (best of 3 in one process, 2 threads,
 * GFLOP/s over a grid of q in {32,64,96,128,192,256} x k in {32,...,512}, on a
 * Xeon (Sapphire Rapids, 2 MB L2/core); the landscape is flat within ~5% near
 * the optimum, and falls off for k >= 256 (the S tile and V tile leave L1):
 *   avx512 f32 D=64  L=4096: q=192 k=64 266 | q=64 k=64 259 | q=192 k=256 253
 *   avx512 f32 D=128 L=2048: q=192 k=64 279 | q=96 k=64 270 | q=64 k=128 247
 *   avx512 f32 D=256 L=2048: q=192 k=32 275 | q=192 k=64 265 | q=64 k=64 244
 *   avx512 f64 D=64  L=2048: q=192 k=64 118 | q=64 k=64 116 | q=64 k=128 109
 *   avx512 f64 D=128 L=2048: q=96 k=32 123  | q=192 k=64 118 | q=64 k=64 114
 *   avx2   f32 D=64  L=4096: q=96 k=64 127  | q=128 k=128 123 | q=64 k=64 107
 *   avx2   f32 D=128 L=2048: q=64 k=128 135 | q=192 k=256 135 | q=128 k=64 114
 *   avx2   f64 D=64  L=2048: q=192 k=64 57  | q=96 k=256 56   | q=64 k=64 47
 * Causal (2 threads, best of 5, interleaved), smaller query blocks waste less
 * work on the partly masked tiles along the diagonal:
 *   avx512 f32 D=64  L=4096: q=96 k=128 223 | q=64 k=64 213 | q=192 k=64 ~200
 *   avx512 f32 D=64  L=512 (H=16): q=64 k=64 148 | q=96 k=64 131 | q=192 k=64 83
 *   avx512 f32 D=128 L=2048: q=64 k=64 228 | q=96 k=64 223 | q=96 k=128 215
 * AMD EPYC, Zen 3 (family 25 model 1, 512 KiB L2/core read from CPUID 0x8000001D,
 * AVX2 only), 2 threads, medians of 9 interleaved rounds in shuffled order, on a
 * shared 2-vCPU guest (runs differ by 5-10%; the order held in three runs):
 *   avx2   f32 D=64  L=4096: q=192 k=64 113 | q=192 k=128 105 | q=96 k=128 103
 *   avx2   f32 D=128 L=2048: q=192 k=64 113 | q=192 k=128 112 | q=96 k=64 107
 *                            (another run: q=192 k=32 61 | q=96 k=64 59 | q=192 k=64 59)
 *   avx2   f64 D=64  L=2048: q=192 k=64 46  | q=192 k=128 45  | q=96 k=64 42
 *   avx2   f32 D=64  L=4096 causal: q=96 k=64 110 | q=192 k=64 109 | q=64 k=128 107
 *   avx2   f32 D=64  L=512 H=16 causal: q=64 k=128 89 | q=64 k=64 89 | q=96 k=64 86
 * Causal over non-causal time, interleaved in one process (Zen 3, 2 threads, medians
 * of 11 rounds, two runs; the non-causal call at its default 192 x 64 blocks):
 *   avx2 f32 D=64  L=4096: q=96 k=64 0.525-0.548 | q=64 k=128 0.544-0.550 | q=64 k=64 0.536-0.564
 *   avx2 f32 D=128 L=2048: q=96 k=64 0.539-0.575 | q=64 k=128 0.570-0.593 | q=64 k=64 0.548-0.594
 *   avx2 f32 D=64  L=2048: q=96 k=64 0.533-0.547 | q=64 k=128 0.545-0.561 | q=64 k=64 0.532-0.548
 * The AVX2 kernel runs by default on CPUs without AVX-512 (Zen 2/3, client Intel),
 * so the Zen 3 figures decide its non-causal blocks (the Xeon rows above were taken
 * with AVX-512 disabled).  Zen 4/5 (AVX-512, 1 MiB L2) were not available to
 * re-measure when the L2 reading was fixed; their L2 now allows the 192 x 64 blocks
 * (an earlier session measured 192 x 64 5-9% faster there than the 96 x 32 that the
 * misread 256 KiB L2 forced).
 * AMD EPYC Zen 5 (family 26 model 2, 1 MiB L2), float32 avx512, 2 threads, medians of
 * 15 interleaved rounds (two more runs of 9-11 gave the same order):
 *   avx512 f32 D=64  L=4096: q=192 k=128 288 | q=192 k=64 284
 *   avx512 f32 D=128 L=2048: q=192 k=128 300 | q=192 k=64 292
 *   avx512 f32 D=64  L=4096 causal: q=192 k=128 277 | q=96 k=128 267 | q=64 k=64 249
 *   avx512 f32 D=128 L=2048 causal: q=192 k=128 271 | q=96 k=128 254 | q=64 k=64 236
 *   avx512 f32 D=64  L=256 (B=4 H=16) causal: q=192 k=128 84 | q=64 k=64 58
 * so on AMD's AVX-512 CPUs (Zen 4/5) 192 x 128 for every call; the Xeon keeps its own.
 * The bfloat16 pair products (AVX512-BF16; AMD EPYC Zen 5, 1 MiB L2, 2 threads, medians
 * of 9 interleaved rounds in shuffled order; a first run of 5 rounds over the whole grid
 * put k = 128 or 256 in front everywhere, and 64 x 64 at 460-550):
 *   avx512-bf16 D=64  L=4096: q=192 k=128 467 | q=128 k=256 463 | q=96 k=256 445 | q=192 k=64 444
 *   avx512-bf16 D=128 L=2048: q=192 k=128 548 | q=128 k=256 527 | q=192 k=64 519 | q=128 k=128 510
 *   avx512-bf16 D=64  L=4096 causal: q=192 k=128 424 | q=96 k=256 423 | q=128 k=256 417 | q=192 k=64 392
 *   avx512-bf16 D=64  L=256 (B=4 H=16): q=128 k=128 418 | q=96 k=128 411 | q=192 k=64 404 | q=192 k=128 402
 * (their tiles are half the bytes of float32's: the same L1 holds twice the keys).
 * So: 192 x 128 for the pairs, causal too; otherwise, on AMD's AVX-512, 192 x 128 (float64
 * 96 x 128, in fa_default_blocks);
 * otherwise 192 x 64 for AVX-512 and for AVX2 (64 x 64 causal or windowed on AVX-512: a
 * window is a diagonal band too); AVX2 64-key tiles (32 for large heads) and 384 query
 * rows (192 causal or windowed), halved while the block passes 5/4 of the L2 (measured
 * in fa_default_blocks);
 * the generic kernel (not tuned: the portable fallback) 64 x 128.  Then two
 * adjustments:
 *  - the query rows are split into equal blocks (Lq = 256 runs as 2 x 128, not
 *    192 + 64), so a short sequence does not end with a nearly empty block;
 *  - the per-block working set (Q block, output block, K, V and score tiles) is
 *    kept within half the L2 the CPU reports, shrinking k then q, so large head
 *    sizes on CPUs with small L2 caches do not spill.
 * Block sizes depend on the CPU and the shapes only, never on the thread count.
 *
 * What the blocks' loops allow, by a port model: bench/mca_model.py runs llvm-mca (LLVM
 * 19) on the compiled inner loops (the 6 x 4 QK^T and P.V tiles, the softmax) and
 * predicts a float32 avx512 block with every operand in L1 at 89% (192 x 64, D64) / 94%
 * (D128) of the FMA peak on an Intel Xeon and 93% / 96% on Zen 4; checked against the C
 * probe of the block (bench/probes/tiles_avx512.c): Zen 4 90% / 94%, Emerald Rapids 83% /
 * 79%, where the operands' feed binds, not the ports (bench/NOTEBOOK.md, "A port model of
 * the hot loops").  The Emerald Rapids sweep (lscpu family 6 model 207, 2 MiB L2, 1
 * thread, interleaved, % of the FMA peak) kept the Xeon's 192 x 64:
 *   avx512 f32 D=64  L=4096: q=384 k=64 78.1 | q=192 k=128 77.1 | q=192 k=64 77.0 | q=96 k=64 75.5
 *   avx512 f32 D=128 L=2048: q=384 k=64 80.8 | q=192 k=64 79.7 | q=96 k=64 78.1 | q=192 k=128 74.0
 * and 96- and 72-key blocks (192 x 96, 288 x 96, 192 x 72) behind 192 x 64 in a second run.
 */
/* The bfloat16 kernel that calls on `kern` with q, k and v bfloat16 take, or NULL: the
 * selected path's (not FA_BF16_FLOAT32) where `kern` is the kernel its pairs run from:
 * avx512 (the emulated test build's avx2 too) for the x86 paths; for BFDOT the
 * AArch64 kernel's own (fa_arm_bf16_kernel). */
const fa_bf16_kernel *fa_bf16_kernel_of(const fa_kernel *kern)
{
    const int path = fa_bf16_path();
    if (path == FA_BF16_FLOAT32) return NULL;
#ifdef FA_HAVE_ARM_BF16_KERNELS
    if (path == FA_BF16_BFDOT) return fa_arm_bf16_kernel(kern);
#endif
#ifdef FA_HAVE_BF16_KERNELS
    if (kern == fa_kernel_for_isa(FA_ISA_AVX512) || (FA_BF16_EMULATED && kern == fa_kernel_for_isa(FA_ISA_AVX2)))
        return fa_bf16_kernel_for_path(path);
#endif
    (void)kern;
    return NULL;
}

const char *fa_bf16_kernel_name(void)
{
    const fa_bf16_kernel *bk = fa_bf16_kernel_of(fa_kernel_for_isa(fa_default_isa()));
    return bk ? bk->name : NULL;
}

int fa_bf16_pairs(const fa_kernel *kern, const fa_params *p)
{
    return p->q_store == FA_STORE_BF16 && p->kv_store == FA_STORE_BF16 && fa_bf16_kernel_of(kern);
}

/* The backward of the selected bfloat16 path: the pairs' on a pair path, the tiles' on
 * the AMX path (kernels_amx.c). */
const fa_bf16_kernel *fa_bf16_bwd_kernel(const fa_kernel *kern, const fa_bwd_params *bp)
{
    const fa_bf16_kernel *bk = bp->bf16 && bp->f.dtype == FA_F32 ? fa_bf16_kernel_of(kern) : NULL;
    return bk && bk->bwd_kv ? bk : NULL;
}

/* The vector width a call's blocks are made of: the kernel's, or its pair products'
 * (16 float32 lanes on the x86 paths, which the emulated build also runs from the
 * 8-lane avx2 kernel; the float32 kernel's own on AArch64). */
static int64_t fa_plan_lanes(const fa_kernel *kern, const fa_params *p)
{
    return fa_bf16_pairs(kern, p) ? fa_bf16_kernel_of(kern)->lanes : kern->lanes[p->dtype];
}

static fa_blocks fa_default_blocks(const fa_kernel *kern, const fa_params *p)
{
    const int64_t vl = fa_plan_lanes(kern, p);
    const int64_t item = p->dtype == FA_F64 ? 8 : 4;
    fa_blocks bl = {64, 128, 0};
    if (kern == fa_kernel_for_isa(FA_ISA_AVX512) && fa_cpu_amd()) {
        /* Zen 4/5: causal and windowed too (see above); float64 half the rows, a block
         * row the same 768 bytes as float32's: AMD EPYC Zen 4, 2 threads, medians of
         * 9-15 interleaved rounds, four runs, time of 96 x 128 against 192 x 128: B1 H8
         * L2048 D64 0.98-1.00, D128 0.95-1.01 (three of four 0.95-0.96), B1 H8 L4096 D64
         * causal 0.96-0.98, B1 H16 L512 causal 0.92-0.95, B4 H16 L256 0.93-1.02 */
        bl.q = p->dtype == FA_F64 ? 96 : 192;
        bl.k = 128;
    } else if (kern == fa_kernel_for_isa(FA_ISA_AVX512)) {
        bl.q = p->causal || p->window_left >= 0 || p->window_right >= 0 ? 64 : 192;
        bl.k = 64;
    } else if (kern == fa_kernel_for_isa(FA_ISA_AVX2) && !fa_bf16_pairs(kern, p)) {
        /* The key tile from the head sizes alone (64 keys unless K's and V's 64-key
         * tiles pass L2 / 4), so a causal or windowed call and the others, a decoding
         * row and the prefill it continues, reduce a row's keys in the same tiles: the
         * same bits.  Then 384 query rows (192 causal or windowed), halved while the
         * block's working set passes 5/4 of the L2.
         * 384 rows: the K and V tiles serve twice the rows, and Q^T and the output
         * tile, read once a key tile, stream from L2 and L3 fast enough (~1 byte a
         * cycle).  AMD EPYC (family 25 model 17, AVX-512 hidden, 1 MiB L2), 2 threads,
         * medians of 9-21, time against 192 x 64 (all with the padded rows of
         * fa_make_plan): float32 B1 H8 L4096 D64 0.98-1.00 (327 KiB), L2048 D128
         * 0.95-0.98 (557 KiB), B4 H16 L256 (one block of 256 rows) 0.91-0.96; float64
         * D64 level (655 KiB); against the 192 x 32 that the L2 / 2 loop below had
         * made of them, float64 D128 (1.1 MiB) 0.95-0.97, float32 D256 (1.0 MiB) 0.92.
         * Causal or windowed: 192 rows since the tiles skip the query vectors that see
         * none of their keys (fa_qblock; 96 before: time against 96 x 64, float32 B1 H8
         * L4096 D64 1.00, L2048 D128 1.00, float64 D64 0.98, D128 0.95; 384 rows made B1
         * H8 L1024 1.07: too few unequal items on 2 threads). */
        const int banded = p->causal || p->window_left >= 0 || p->window_right >= 0;
        const int64_t cap = fa_cpu_l2_bytes() / 4 * 5;
        bl.k = item * 64 * (p->D + p->Dv) <= fa_cpu_l2_bytes() / 4 ? 64 : 32;
        bl.q = banded ? 192 : 384;
        while (bl.q > 2 * vl && item * (bl.q * (p->D + p->Dv) + bl.k * (p->D + p->Dv + bl.q)) > cap)
            bl.q = (bl.q / 2 + vl - 1) / vl * vl;
        return bl;
    }
    /* causal too: see above.  AMX's row-major block (kern_amx_rows.h) 768 x 256; its
     * key-major one, for the other calls, keeps the pairs' 192 x 128 and with them their
     * bits in the emulated build.  On a Sapphire Rapids class Xeon, 1 thread, B1 H2
     * L4096, medians of 5 (ms, lower is better; these runs vary by 5-10%): D=64 q=192 k=256 20.3 | q=384 k=64 21.4 |
     * q=192 k=128 21.6 | q=192 k=64 24.0; D=128 q=384 k=64 30.2 | q=192 k=256 30.8 |
     * q=192 k=64 35.2 | q=192 k=128 36.9 (the P.V output tiles load and store once a
     * key block: longer blocks, fewer of them).  A later sweep of the query rows at k=256
     * (the same call, medians of 7; each item packs the K and V it reads, ~13% of the
     * block's samples at q=192): D=64 q=192 20.5 | 256 19.9 | 320 19.5 | 384 19.2 | 512
     * 19.5; D=128 29.1 | 28.9 | 28.0 | 27.3 | 27.7; on 2 threads q=384 against q=192
     * (medians of 9): B1 H8 L4096 D64 0.93x the time, causal 0.92x, L2048 D128 0.92x,
     * B4 H16 L256 0.85x, L1024 causal 0.95x.  With the block's chunks of 2048 keys
     * (FA_ROWS_CHUNK_KEYS) longer items gained again: 2 threads, k=256, medians of 7,
     * ms, q = 384 | 512 | 768 | 1024: B1 H8 L4096 D64 33.1 | 31.9 | 31.9 | 31.6; causal
     * 17.5 | 17.0 | 16.7 | 16.4; L2048 D128 12.4 | 11.6 | 11.4 | 11.4. */
    const int64_t budget = fa_cpu_l2_bytes() / 2;
    if (fa_bf16_pairs(kern, p)) {
        if (fa_bf16_path() == FA_BF16_AMX && fa_amx_rows_call(p)) {
            /* the row-major block's own working set: Q's rows (bfloat16, padded to 32
             * features) and the output rows (float32) of the item, K and V packed
             * (bfloat16), two groups of 32 rows' logits and P: 768 rows at D <= 128 */
            const int64_t dz = (p->D + 31) / 32 * 32, dvp = (p->Dv + 15) / 16 * 16;
            bl = (fa_blocks){768, 256, 0, 0};
            while (bl.q > 128 && bl.q * (2 * dz + 4 * dvp) + bl.k * (2 * dz + 2 * dvp + 12 * 32) > budget)
                bl.q /= 2;
            return bl;
        }
        bl = (fa_blocks){192, 128, 0, 0};
    }
    for (;;) {
        int64_t ws = item * (bl.q * (p->D + p->Dv) + bl.k * (p->D + p->Dv + bl.q));
        if (ws <= budget) break;
        if (bl.k > 32) bl.k /= 2;
        else if (bl.q > 2 * vl) bl.q = (bl.q / 2 + vl - 1) / vl * vl;
        else break;
    }
    return bl;
}

int fa_check(const fa_params *p)
{
    if (p->dtype != FA_F32 && p->dtype != FA_F64) return FA_ERR_ARG;
    if (p->B < 0 || p->Hq < 0 || p->Hkv < 1 || p->Lq < 0 || p->Lk < 0 || p->D < 1 || p->Dv < 1)
        return FA_ERR_ARG;
    if (p->Hq % p->Hkv != 0) return FA_ERR_ARG;
    if (p->causal < FA_CAUSAL_NONE || p->causal > FA_CAUSAL_TOP_LEFT) return FA_ERR_ARG;
    if (p->positions && p->causal == FA_CAUSAL_TOP_LEFT) return FA_ERR_ARG;
    if (!isfinite(p->scale)) return FA_ERR_ARG;
    if (!(p->softcap >= 0) || !isfinite(p->softcap)) return FA_ERR_ARG;
    if ((p->cu_q == NULL) != (p->cu_k == NULL)) return FA_ERR_ARG;
    if (p->seqlens_k) {
        if (p->cu_k) return FA_ERR_ARG;
        for (int64_t b = 0; b < p->B; b++)
            if (p->seqlens_k[b] < 0 || p->seqlens_k[b] > p->Lk) return FA_ERR_ARG;
    }
    /* each array in the compute type, or (float32 compute only) in the 16-bit type
     * of k and v */
    const int stores[3] = {p->q_store, p->kv_store, p->out_store};
    if (p->kv_store == FA_STORE_I8) { /* float32 q, out and scales */
        if (p->dtype != FA_F32 || p->q_store != FA_STORE_F32 || p->out_store != FA_STORE_F32 ||
            !p->k_scale || !p->v_scale || p->k_group < 1 || p->v_group < 1 || p->D % p->k_group ||
            p->Dv % p->v_group)
            return FA_ERR_ARG;
    } else
        for (int a = 0; a < 3; a++)
            if (stores[a] != p->dtype &&
                !(p->dtype == FA_F32 && fa_store16(stores[a]) && stores[a] == p->kv_store))
                return FA_ERR_ARG;
    if (p->k_bits != 0 && p->k_bits != 8 && p->k_bits != 4) return FA_ERR_ARG;
    if (p->v_bits != 0 && p->v_bits != 8 && p->v_bits != 4) return FA_ERR_ARG;
    if ((p->k_bits == 4 || p->v_bits == 4) && p->kv_store != FA_STORE_I8) return FA_ERR_ARG;
    if (p->k_lanes) { /* K on the lanes: whole blocks of a multiple of 16 keys, no pages */
        if (p->k_lanes < 0 || p->k_lanes % 16 || p->Lk % p->k_lanes || p->block_table || p->cu_k)
            return FA_ERR_ARG;
        if (p->kv_store == FA_STORE_I8 && !p->k_zero) return FA_ERR_ARG;
    } else if (p->k_zero || p->k_bits == 4)
        return FA_ERR_ARG;
    if (p->block_table) { /* every page a sequence reads is in the pool */
        if (p->cu_k || p->page_size < 1 || p->max_blocks < 0 || p->Lk != p->max_blocks * p->page_size)
            return FA_ERR_ARG;
        for (int64_t b = 0; b < p->B; b++) {
            const int64_t used = (fa_key_len(p, b) + p->page_size - 1) / p->page_size;
            for (int64_t e = 0; e < used; e++)
                if (p->block_table[b * p->bt_sb + e] < 0 || p->block_table[b * p->bt_sb + e] >= p->num_pages)
                    return FA_ERR_ARG;
        }
    }
    if ((p->entropy == NULL) != (p->max_weight == NULL) || (p->entropy && !p->lse)) return FA_ERR_ARG;
    return FA_OK;
}

/* The keys a call's blocks and splits reduce as one chunk (see FA_CHUNK_KEYS): the
 * row-major AMX block's calls FA_ROWS_CHUNK_KEYS, the others FA_CHUNK_KEYS. */
int64_t fa_chunk_keys(const fa_kernel *kern, const fa_params *p)
{
#ifdef FA_HAVE_BF16_KERNELS
    if (fa_bf16_pairs(kern, p) && fa_bf16_path() == FA_BF16_AMX && fa_amx_rows_call(p)) return FA_ROWS_CHUNK_KEYS;
#else
    (void)kern;
    (void)p;
#endif
    return FA_CHUNK_KEYS;
}

/* Block sizes: see fa_default_blocks for the measurements behind the defaults. */
static fa_blocks fa_choose_blocks(const fa_kernel *kern, const fa_params *p)
{
    fa_blocks bl = fa_default_blocks(kern, p);
    bl.chunk = fa_chunk_keys(kern, p);
    if (p->block_q > 0) bl.q = p->block_q;
    if (p->block_k > 0) bl.k = p->block_k;
    if (bl.q > 1024) bl.q = 1024;
    if (bl.q < 1) bl.q = 1;
    if (bl.k > 1 << 16) bl.k = 1 << 16;
    if (bl.k < 1) bl.k = 1;
    return bl;
}

int64_t fa_seq_len(const int64_t *cu, int64_t b, int64_t fixed)
{
    return cu ? cu[b + 1] - cu[b] : fixed;
}

/* The keys sequence b sees: its varlen length, its seqlens_k entry, or Lk. */
int64_t fa_key_len(const fa_params *p, int64_t b)
{
    return p->cu_k ? p->cu_k[b + 1] - p->cu_k[b] : p->seqlens_k ? p->seqlens_k[b] : p->Lk;
}

int64_t fa_max_key_len(const fa_params *p)
{
    int64_t m = 0;
    for (int64_t b = 0; b < p->B; b++)
        if (fa_key_len(p, b) > m) m = fa_key_len(p, b);
    return m;
}

int64_t fa_max_seq_len(const int64_t *cu, int64_t B, int64_t fixed)
{
    int64_t m = cu ? 0 : fixed;
    for (int64_t b = 0; cu && b < B; b++)
        if (cu[b + 1] - cu[b] > m) m = cu[b + 1] - cu[b];
    return m;
}

/*
 * Queries of heads that share a key/value head are stacked into one item when a
 * head has fewer positions than a block has rows (short prefill, decoding): the
 * group then reads each K/V tile once.  Otherwise an item is one head's block of
 * positions, the positions split evenly into blocks of at most bl.q.
 */
/* Items of a plan whose nh, nhc and nqp are set. */
static int64_t fa_count_items(const fa_params *p, const fa_plan *pl)
{
    const int64_t per_qb = p->Hkv * pl->nhc;
    if (!p->cu_q) return p->B * ((p->Lq + pl->nqp - 1) / pl->nqp) * per_qb;
    int64_t n = 0;
    for (int64_t b = 0; b < p->B; b++) n += (fa_seq_len(p->cu_q, b, 0) + pl->nqp - 1) / pl->nqp * per_qb;
    return n;
}

/*
 * With many threads and few items the threads wait on the last ones (B1 H8 L4096:
 * 176 items of 192 rows, on 128 threads two items for some, one for others: 0.67 of
 * the work a thread could do).  So for nth threads the query blocks are cut smaller,
 * equal blocks again, until there are FA_ITEMS_PER_THREAD items a thread or a block
 * is down to FA_MIN_BLOCK_VECS vectors or FA_MIN_BLOCK_ROWS rows, whichever is fewer
 * (at least one vector): dynamic scheduling then ends within a small
 * item of the mean (fastattn.bench.plan_balance measures it).  A row's bits do not
 * depend on the rows that share its block (tests/test_invariance.py), so the thread
 * count still changes no result; the key block never depends on it.
 */
#define FA_ITEMS_PER_THREAD 12
#define FA_MIN_BLOCK_VECS 4
/* 16-lane vectors (avx512 float32) stop at 2 vectors, not 4: B1 H16 L512 causal has
 * 8 blocks of 64 rows a head, 128 items, whose work grows along the diagonal; on 128
 * threads the heaviest bound the call at 0.53 of the mean (measured with plan_balance
 * on the AMD EPYC Zen 5), and 32-row blocks pair a heavy and a light one per thread */
#define FA_MIN_BLOCK_ROWS 32
/* a causal call's items run head-major (fa_item_of) from this many items a thread */
#define FA_HEAD_MAJOR_ITEMS 16

int fa_make_plan(const fa_kernel *kern, const fa_params *p, int nth, fa_plan *pl)
{
    const int64_t vl = fa_plan_lanes(kern, p);
    pl->bl = fa_choose_blocks(kern, p);
    pl->G = p->Hq / p->Hkv;
    pl->start = NULL;
    int64_t lmax = fa_max_seq_len(p->cu_q, p->B, p->Lq);
    if (lmax < 1) lmax = 1;
    if (pl->G > 1 && 2 * lmax <= pl->bl.q) {
        pl->nh = pl->bl.q / lmax < pl->G ? pl->bl.q / lmax : pl->G;
        pl->nqp = lmax;
        pl->nhc = (pl->G + pl->nh - 1) / pl->nh;
    } else {
        /* equal blocks, each a whole number of vectors (no padded lanes but the last) */
        int64_t nblocks = (lmax + pl->bl.q - 1) / pl->bl.q;
        pl->nh = 1;
        pl->nhc = pl->G;
        pl->nqp = ((lmax + nblocks - 1) / nblocks + vl - 1) / vl * vl;
        int64_t floor = FA_MIN_BLOCK_VECS * vl < FA_MIN_BLOCK_ROWS ? FA_MIN_BLOCK_VECS * vl : FA_MIN_BLOCK_ROWS;
        if (floor < vl) floor = vl;
        if (floor > pl->nqp) floor = pl->nqp;
        /* each step: equal blocks of at most one vector fewer (nqp falls every step) */
        while (nth > 1 && pl->nqp - vl >= floor &&
               fa_count_items(p, pl) < (int64_t)FA_ITEMS_PER_THREAD * nth) {
            nblocks = (lmax + pl->nqp - vl - 1) / (pl->nqp - vl);
            pl->nqp = ((lmax + nblocks - 1) / nblocks + vl - 1) / vl * vl;
        }
    }
    pl->bl.q = (pl->nh * pl->nqp + vl - 1) / vl * vl;
    /* bl.q is also the row stride of the block's Q^T, logit and transposed-output
     * tiles (D, bc and Dv rows of it).  A stride that is a multiple of 128 bytes puts
     * those rows in a fraction of the L1's 64 sets (128 rows of a float32 block: 512
     * bytes, 8 sets; float64 256 rows: 2 KiB, 2 sets), where a tile's column of
     * vectors evicts itself; one vector more makes it an odd number of half lines
     * (32-byte vectors) or lines (64-byte), which reaches all sets.  The padded lanes
     * are never read as rows (the items' rows are bl.rows).  AMD EPYC with AVX2, 2
     * threads, medians of 21, time against the unpadded stride: float32 B4 H16 L256
     * 0.94-0.95, float64 0.90-0.94, float32 B1 H8 L2048 D128 0.97-0.98, L4096 D64
     * 0.98-1.01, float64 L2048 0.99-1.03.  (The pairs lay their blocks out
     * themselves: kern_bf16dp.h, kern_amx_rows.h.) */
    if (!fa_bf16_pairs(kern, p)) {
        const int64_t item = p->dtype == FA_F64 ? 8 : 4;
        while ((pl->bl.q * item) % 128 == 0) pl->bl.q += vl;
    }
    pl->bl.rows = pl->nh * (pl->nqp < lmax ? pl->nqp : lmax); /* (nqp is rounded up to a vector) */
    const int64_t per_qb = p->Hkv * pl->nhc;
    if (p->cu_q) {
        pl->start = (int64_t *)malloc((size_t)(p->B + 1) * sizeof(int64_t));
        if (!pl->start) return FA_ERR_NOMEM;
        pl->start[0] = 0;
        for (int64_t b = 0; b < p->B; b++) {
            int64_t nqb = (fa_seq_len(p->cu_q, b, 0) + pl->nqp - 1) / pl->nqp;
            pl->start[b + 1] = pl->start[b] + nqb * per_qb;
        }
        pl->items = pl->start[p->B];
        pl->per_seq = 0;
    } else {
        pl->per_seq = (p->Lq + pl->nqp - 1) / pl->nqp * per_qb;
        pl->items = p->B * pl->per_seq;
    }
    /* fa_item_of's order: head-major, but a causal call's only with many items a thread */
    pl->head_major = !p->causal || (nth > 0 && pl->items >= FA_HEAD_MAJOR_ITEMS * (int64_t)nth);
    return FA_OK;
}

/* The item for query block qb of head chunk hc of kv head g in sequence b. */
void fa_item_make(const fa_params *p, const fa_plan *pl, int64_t b, int64_t g, int64_t hc,
                         int64_t qb, fa_item *it)
{
    const int64_t Lq = fa_seq_len(p->cu_q, b, p->Lq), Lk = fa_key_len(p, b);
    it->b = b;
    it->g = g;
    it->h0 = g * pl->G + hc * pl->nh;
    it->nh = pl->G - hc * pl->nh < pl->nh ? pl->G - hc * pl->nh : pl->nh;
    it->q0 = qb * pl->nqp;
    it->nq = Lq - it->q0 < pl->nqp ? Lq - it->q0 : pl->nqp;
    it->Lq = Lq;
    it->Lk = Lk;
    it->qoff = p->cu_q ? p->cu_q[b] : 0;
    it->koff = p->cu_k ? p->cu_k[b] : 0;
    it->share_n = 0; /* (fa_forward.c attaches the call's V-tile flags and packed blocks) */
    it->vfin = NULL;
    it->pkst = NULL;
    it->pkbuf = NULL;
    it->pk_bytes = 0;
    it->part_o = it->part_lse = 0; /* (fa_decode_split sets them) */
    /* keys visible to some row: row i sees a-left <= j <= a+right, a = i + diag */
    const int64_t diag = fa_diag0(p, Lq, Lk);
    const int64_t right = p->causal != FA_CAUSAL_NONE ? 0 : p->window_right; /* min(right, 0) */
    fa_key_range(p->window_left >= 0 ? it->q0 + diag - p->window_left : 0,
                 right >= 0 ? it->q0 + it->nq - 1 + diag + right + 1 : Lk, Lk, &it->kv0, &it->kv1);
}

int64_t fa_qblocks(const fa_params *p, const fa_plan *pl, int64_t b)
{
    return (fa_seq_len(p->cu_q, b, p->Lq) + pl->nqp - 1) / pl->nqp;
}

/* Varlen: the sequence whose items start at or before item t (the last b with
 * pl->start[b] <= t), by bisection. */
static int64_t fa_seq_of_item(const fa_plan *pl, int64_t B, int64_t t)
{
    int64_t lo = 0, hi = B - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (pl->start[mid] <= t) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/*
 * K and V whose rows are strided (layout "bshd", slices of a fused projection) and
 * that several query blocks read: read in place, rows a power-of-two apart fall into
 * a few L1 sets and evict each other, and the TLB sees a page per row or two
 * (measured on "bshd" B=1 H=8 L=2048 D=64: 1.16-1.22x the "bhsd" time).  So a thread
 * first copies the head's K and V rows into a contiguous per-thread buffer (O(Lk),
 * never O(Lq Lk)), which its query blocks of that head then read from L2.
 *
 * To copy each head about once, the items are ordered head by head and each thread
 * owns a contiguous segment of them (about B Hkv / nth heads); a thread that has
 * finished its own segment takes items from the end of the fullest remaining one
 * (one more copy of that head).  Whole heads as tasks balanced badly: with 8 heads
 * on 2 threads one late head left a thread idle (1.10-1.15x "bhsd" against 1.03x on
 * one thread).  Which thread runs an item never changes its result.
 */
/* Bytes per element of an array stored as `store` (enum fa_storage), and of K and V. */
size_t fa_store_item(const fa_params *p, int store)
{
    return store == FA_STORE_I8 ? 1 : fa_store16(store) ? 2 : p->dtype == FA_F64 ? 8 : 4;
}

size_t fa_kv_item(const fa_params *p) { return fa_store_item(p, p->kv_store); }

int fa_use_head_tasks(const fa_params *p, const fa_plan *pl)
{
    /* staged K/V (int8, paged) are read a tile at a time, never copied whole */
    if ((p->k_sl == p->D && p->v_sl == p->Dv) || p->weights || fa_kv_staged(p)) return 0;
    return pl->items >= 2 * p->B * p->Hkv * pl->nhc; /* some head has 2 or more blocks */
}

/*
 * Short items (a few query rows against a few hundred keys: B32 H8 L64, B8 H32 L128):
 * an item reads its Q rows, K and V once, from L3 or memory, at the start of its
 * products (Q's packing was 14.5% of a B32 H8 L64 call, 1 thread, its loads waiting
 * on L3).  So each thread claims its next item as it starts one and asks for that
 * item's rows (fa_prefetch_item): they arrive while this one runs.  Only where an
 * item's rows fit in a quarter of L2 beside the running one's, where the arrays are
 * read in place (not int8 or paged), and where there are at least 4 items a thread,
 * 8 where they are unequal (causal or windowed) (a claimed item waits for its thread:
 * at most one item of imbalance at the end, as with dynamic scheduling).  Measured on an AMD EPYC (Zen 4), in one process,
 * interleaved, the data evicted from the caches before each call, medians of 50-60,
 * the time without against with, 1 / 2 threads: B32 H8 L64 D64 1.128x / 1.125x, B8 H32
 * L128 1.046x / 1.037x, B4 H16 L256 1.024x / 1.014x.
 */
int fa_use_lookahead(const fa_params *p, const fa_plan *pl, int nth)
{
    /* unequal items (causal or windowed: heavy first) need more of them a thread: at 4, the
     * generic kernel's B1 H16 L512 causal at 128 threads (16-row blocks, 512 items) kept
     * its threads busy to 0.896 of the call, below the 0.9 of tests/test_plan_balance.py,
     * on a 2 MiB L2 (Emerald Rapids), where those rows fit L2 / 4 */
    const int banded = p->causal || p->window_left >= 0 || p->window_right >= 0;
    if (fa_kv_staged(p) || p->weights || pl->items < (banded ? 8 : 4) * (int64_t)nth) return 0;
    const int64_t qsz = (int64_t)fa_store_item(p, p->q_store), ksz = (int64_t)fa_kv_item(p);
    const int64_t lq = fa_max_seq_len(p->cu_q, p->B, p->Lq), rows = pl->nh * (pl->nqp < lq ? pl->nqp : lq);
    return rows * p->D * qsz + fa_max_key_len(p) * (p->D + p->Dv) * ksz <= fa_cpu_l2_bytes() / 4;
}

/* Item t in block-major order: query block by query block (the last first when causal),
 * the heads of a block index together.  With causal masking the last blocks see the
 * most keys, so every head's most expensive items start first and dynamic scheduling
 * balances the rest across threads: a causal call with few items a thread keeps this
 * order (the bench shapes at 64 and 128 threads: plan_balance >= 0.9, where head-major
 * order gave 0.62-0.90 for B1 H16 L512). */
static void fa_qb_item(const fa_params *p, const fa_plan *pl, int64_t t, fa_item *it)
{
    const int64_t per_qb = p->Hkv * pl->nhc;
    int64_t b, u;
    if (pl->start) {
        b = fa_seq_of_item(pl, p->B, t);
        u = t - pl->start[b];
    } else {
        const int64_t nbk = p->B * per_qb; /* items per query block index */
        b = (t % nbk) / per_qb;
        u = (t / nbk) * per_qb + t % per_qb;
    }
    const int64_t nqb = fa_qblocks(p, pl, b);
    const int64_t qb = p->causal ? nqb - 1 - u / per_qb : u / per_qb;
    fa_item_make(p, pl, b, (u % per_qb) / pl->nhc, u % pl->nhc, qb, it);
}

/* Item t of the plan, in the order pl->head_major picks (fa_make_plan): head-major
 * (fa_head_item) unless the call is causal with fewer than FA_HEAD_MAJOR_ITEMS items a
 * thread, so the items that follow each other, on one thread or on several, read the
 * same kv head's K and V.  (Block-major, consecutive items read another head's K and V
 * each time, 16 MiB of them for B1 H8 L2048 D128, from memory rather than L3.
 * Head-major, interleaved in one process, AMD EPYC Zen 4 with AVX-512, 2 threads,
 * medians of 7-9, time against block-major: B1 H8 L2048 D128 0.96-0.97, L4096 D64
 * 0.98, B8 H32 L128 0.98, float64 L2048 D64 and D128 0.95, causal L4096 D64 0.98-0.99,
 * L2048 D128 0.97; 1 thread 0.95-0.98.)  Which thread runs an item, and when, never
 * changes its result. */
void fa_item_of(const fa_params *p, const fa_plan *pl, int64_t t, fa_item *it)
{
    if (pl->head_major) fa_head_item(p, pl, t, it);
    else fa_qb_item(p, pl, t, it);
}

/* Item u in head-major order: sequence b, kv head g, head chunk hc, and its query
 * block (heavy first when causal). */
void fa_head_item(const fa_params *p, const fa_plan *pl, int64_t u, fa_item *it)
{
    int64_t b, w;
    if (pl->start) {
        b = fa_seq_of_item(pl, p->B, u);
        w = u - pl->start[b];
    } else {
        b = u / pl->per_seq;
        w = u % pl->per_seq;
    }
    const int64_t nqb = fa_qblocks(p, pl, b), task = w / nqb, i = w % nqb;
    fa_item_make(p, pl, b, task / pl->nhc, task % pl->nhc, p->causal ? nqb - 1 - i : i, it);
}

/* The contiguous copy of kv head (b, g) in kvbuf, and the parameters that read it. */
void fa_copy_head(const fa_params *p, int64_t b, int64_t g, char *kvbuf, fa_params *local)
{
    const size_t item = fa_kv_item(p);
    const int64_t Lk = fa_key_len(p, b), koff = p->cu_k ? p->cu_k[b] : 0;
    char *kc = kvbuf, *vc = kvbuf + (size_t)Lk * (size_t)p->D * item;
    const char *k = (const char *)p->k + (size_t)((b * p->k_sb + g * p->k_sh + koff * p->k_sl) * (int64_t)item);
    const char *v = (const char *)p->v + (size_t)((b * p->v_sb + g * p->v_sh + koff * p->v_sl) * (int64_t)item);
    for (int64_t j = 0; j < Lk; j++) {
        memcpy(kc + (size_t)j * (size_t)p->D * item, k + (size_t)(j * p->k_sl * (int64_t)item), (size_t)p->D * item);
        memcpy(vc + (size_t)j * (size_t)p->Dv * item, v + (size_t)(j * p->v_sl * (int64_t)item), (size_t)p->Dv * item);
    }
    *local = *p; /* this head's K/V, contiguous, at b = g = koff = 0 offsets */
    local->k = kc;
    local->v = vc;
    local->k_sb = local->k_sh = local->v_sb = local->v_sh = 0;
    local->k_sl = p->D;
    local->v_sl = p->Dv;
}

/* All the query items of kv head g of sequence b, in order (head chunks, then query
 * blocks): the rows a backward or key_mass item of that head goes through. */
void fa_head_query_items(const fa_params *p, const fa_plan *pl, int64_t b, int64_t g,
                                fa_item *items)
{
    int64_t n = 0;
    for (int64_t hc = 0; hc < pl->nhc; hc++)
        for (int64_t qb = 0; qb < (p->Lq + pl->nqp - 1) / pl->nqp; qb++)
            fa_item_make(p, pl, b, g, hc, qb, &items[n++]);
}
