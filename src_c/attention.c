/*
 * attention.c -- the driver: validates the params, splits the work into
 * (batch, head, query block) items, cuts off the key blocks causality hides, runs
 * the items on OpenMP threads with per-thread scratch, and calls the micro-kernels
 * of the chosen instruction set.
 *
 * Determinism: an item's result depends only on the inputs and the kernel, never
 * on which thread ran it or how many there were, so results are bitwise identical
 * for any thread count.
 */
#include <math.h>
#include <stdlib.h>
#include "fa_internal.h"

/* ---- OpenMP shim: every omp_* call goes through here; builds without OpenMP. ---- */
#ifdef _OPENMP
#include <omp.h>
int fa_openmp_enabled(void) { return 1; }
int fa_max_threads(void) { return omp_get_max_threads(); }
#define FA_OPENMP_VERSION _OPENMP
#else
int fa_openmp_enabled(void) { return 0; }
int fa_max_threads(void) { return 1; }
#define FA_OPENMP_VERSION 0
#endif

#define FA_STR2(x) #x
#define FA_STR(x) FA_STR2(x)

const char *fa_build_info(void)
{
    return "compiler="
#if defined(__clang__)
           "clang "
#elif defined(__GNUC__)
           "gcc "
#endif
#ifdef __VERSION__
           __VERSION__
#endif
           "; openmp=" FA_STR(FA_OPENMP_VERSION);
}

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
 * So: 192 x 64 for AVX-512 (64 x 64 causal), 96 x 128 for AVX2 (64 x 128 causal);
 * the generic kernel (not tuned: the portable fallback) 64 x 128.  Then two
 * adjustments:
 *  - the query rows are split into equal blocks (Lq = 256 runs as 2 x 128, not
 *    192 + 64), so a short sequence does not end with a nearly empty block;
 *  - the per-block working set (Q block, output block, K, V and score tiles) is
 *    kept within half the L2 the CPU reports, shrinking k then q, so large head
 *    sizes on CPUs with small L2 caches do not spill.
 * Block sizes depend on the CPU and the shapes only, never on the thread count.
 */
static fa_blocks fa_default_blocks(const fa_kernel *kern, const fa_params *p)
{
    const int64_t vl = kern->lanes[p->dtype];
    const int64_t item = p->dtype == FA_F64 ? 8 : 4;
    fa_blocks bl = {64, 128};
    if (kern == fa_kernel_for_isa(FA_ISA_AVX512)) {
        bl.q = p->causal ? 64 : 192;
        bl.k = 64;
    } else if (kern == fa_kernel_for_isa(FA_ISA_AVX2)) {
        bl.q = p->causal ? 64 : 96;
        bl.k = 128;
    }
    const int64_t budget = fa_cpu_l2_bytes() / 2;
    for (;;) {
        int64_t ws = item * (bl.q * (p->D + p->Dv) + bl.k * (p->D + p->Dv + bl.q));
        if (ws <= budget) break;
        if (bl.k > 32) bl.k /= 2;
        else if (bl.q > 2 * vl) bl.q = (bl.q / 2 + vl - 1) / vl * vl;
        else break;
    }
    int64_t nblocks = (p->Lq + bl.q - 1) / bl.q;
    if (nblocks > 0) bl.q = (p->Lq + nblocks - 1) / nblocks;
    return bl;
}

static void *fa_scratch_alloc(size_t bytes)
{
    size_t n = (bytes + FA_ALIGN - 1) / FA_ALIGN * FA_ALIGN;
    return aligned_alloc(FA_ALIGN, n ? n : FA_ALIGN);
}

static int fa_check(const fa_params *p)
{
    if (p->dtype != FA_F32 && p->dtype != FA_F64) return FA_ERR_ARG;
    if (p->B < 0 || p->Hq < 0 || p->Hkv < 1 || p->Lq < 0 || p->Lk < 0 || p->D < 1 || p->Dv < 1)
        return FA_ERR_ARG;
    if (p->Hq % p->Hkv != 0) return FA_ERR_ARG;
    if (p->causal < FA_CAUSAL_NONE || p->causal > FA_CAUSAL_TOP_LEFT) return FA_ERR_ARG;
    if (!isfinite(p->scale)) return FA_ERR_ARG;
    return FA_OK;
}

/* Block sizes: see fa_default_blocks for the measurements behind the defaults. */
static fa_blocks fa_choose_blocks(const fa_kernel *kern, const fa_params *p)
{
    const int64_t vl = kern->lanes[p->dtype];
    fa_blocks bl = fa_default_blocks(kern, p);
    if (p->block_q > 0) bl.q = p->block_q;
    if (p->block_k > 0) bl.k = p->block_k;
    if (bl.q > 1024) bl.q = 1024;
    if (bl.k > 1 << 16) bl.k = 1 << 16;
    /* a block never needs more rows than the queries there are */
    if (bl.q > p->Lq) bl.q = p->Lq;
    bl.q = (bl.q + vl - 1) / vl * vl;
    if (bl.q < vl) bl.q = vl;
    if (bl.k < 1) bl.k = 1;
    return bl;
}

/* Work item t of nbh * nqb.  With causal masking the last query blocks see the
 * most keys, so item t takes query block nqb-1 - t/nbh (the most expensive first). */
static void fa_run_item(const fa_params *p, fa_qblock_fn qblock, const fa_blocks *bl, int64_t nqb,
                        int64_t nbh, int64_t diag, int64_t t, void *scratch)
{
    const int64_t br = bl->q;
    int64_t qb = p->causal ? nqb - 1 - t / nbh : t / nbh;
    int64_t bh = t % nbh;
    int64_t q0 = qb * br;
    int64_t nq = p->Lq - q0 < br ? p->Lq - q0 : br;
    int64_t kv_end = p->Lk;
    if (p->causal) {
        int64_t last = q0 + nq + diag; /* keys visible to the block's last row */
        if (last < kv_end) kv_end = last;
        if (kv_end < 0) kv_end = 0;
    }
    qblock(p, bl, bh / p->Hq, bh % p->Hq, q0, nq, kv_end, scratch);
}

int fa_attention_forward(const fa_params *p)
{
    int rc = fa_check(p);
    if (rc != FA_OK) return rc;
    const fa_kernel *kern = fa_kernel_for_isa(p->isa < 0 ? fa_default_isa() : p->isa);
    if (!kern || (p->isa >= 0 && !(fa_cpu_supported_isas() & (1u << p->isa)))) return FA_ERR_ARG;
    if (p->B == 0 || p->Hq == 0 || p->Lq == 0) return FA_OK;

    const int dt = p->dtype;
    const fa_blocks bl = fa_choose_blocks(kern, p);
    const int64_t br = bl.q;
    const int64_t nqb = (p->Lq + br - 1) / br;
    const int64_t nbh = p->B * p->Hq;
    const int64_t items = nbh * nqb;
    /* Causal: the last visible key of row i is i + diag. */
    const int64_t diag = p->causal == FA_CAUSAL_BOTTOM_RIGHT ? p->Lk - p->Lq : 0;
    const fa_qblock_fn qblock = kern->qblock[dt];
    const size_t scratch_bytes = kern->scratch_bytes[dt](p, &bl);

    int nth = p->num_threads > 0 ? p->num_threads : fa_max_threads();
    if ((int64_t)nth > items) nth = (int)items;
    if (nth < 1) nth = 1;

    int failed = 0;
    if (nth == 1) {
        /* One thread: no parallel region at all (short calls stay cheap). */
        void *scratch = fa_scratch_alloc(scratch_bytes);
        if (!scratch) return FA_ERR_NOMEM;
        for (int64_t t = 0; t < items; t++) fa_run_item(p, qblock, &bl, nqb, nbh, diag, t, scratch);
        free(scratch);
        return FA_OK;
    }
    /* Items run most expensive first (see fa_run_item); dynamic scheduling hands the
     * cheap ones to whichever thread is free, so causal rows balance. */
#pragma omp parallel num_threads(nth) reduction(| : failed)
    {
        void *scratch = fa_scratch_alloc(scratch_bytes);
        if (!scratch) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < items; t++)
            if (scratch) fa_run_item(p, qblock, &bl, nqb, nbh, diag, t, scratch);
        free(scratch);
    }
    return failed ? FA_ERR_NOMEM : FA_OK;
}

int fa_exp_array(int isa, int dtype, const void *x, void *y, int64_t n)
{
    const fa_kernel *kern = fa_kernel_for_isa(isa);
    if (!kern || !(fa_cpu_supported_isas() & (1u << isa))) return FA_ERR_ARG;
    if (dtype != FA_F32 && dtype != FA_F64) return FA_ERR_ARG;
    kern->exp_array[dtype](x, y, n);
    return FA_OK;
}
