/*
 * fa_backward.c -- the backward pass (fa_attention_backward): the schedules below
 * over the kernels' fa_bwd_kv / fa_bwd_q / fa_bwd_reduce, on the forward's plan.
 */
#include <math.h>
#include <stdlib.h>
#include "fa_driver.h"

/*
 * The backward, in one of three schedules with the same arithmetic.  dQ is defined
 * as a sum over key chunks of kc keys (kc depends on Lk only): each chunk's chain
 * of products over its keys in ascending order, the chunks added in order.
 *  1. one pass per kv head, when there are enough heads to share among the threads:
 *     an item per (sequence, kv head) makes dK and dV over all its keys and each
 *     query item's dQ over the same tiles (5 tile products);
 *  2. one pass per key chunk, when heads are few: an item per (sequence, kv head,
 *     chunk) makes that chunk's dK, dV and each query row's chunk sum of dQ, kept
 *     in a (chunks, B, Hq, Lq, D) buffer; the sums are added in chunk order at the
 *     end (5 products; the buffer is capped at FA_BWD_PART_BYTES);
 *  3. two passes, otherwise: pass 1 (dK, dV) per (sequence, kv head, FA_BWD_CHUNK
 *     key blocks), pass 2 (dQ) per query item of the forward's plan (7 products).
 * No output element is written by two items and no atomics are used.  Every
 * element is one chain of sums in a fixed order (dQ as above; dK, dV: query items
 * in order, rows in order), the same in every schedule, so the result has the same
 * bits for any thread count.  Memory: O(B Hq Lq) for D_i, per-thread scratch and
 * dK/dV accumulators of the item's keys (all Lk in schedule 1, capped at
 * FA_BWD_ONE_PASS_BYTES), and schedule 2's buffer.
 *
 * Block sizes: 64 x 64 by default, shrunk to half the L2 for large head sizes
 * (a sweep of 16..128 x 32..128 on Zen 3 found no setting more than the noise,
 * ~5%, faster); a bfloat16 kernel may ask for other query rows (bwd_block_q: AMX's
 * tiles 192, see kernels_amx.c).
 */
#define FA_BWD_BLOCK_Q 64
#define FA_BWD_BLOCK_K 64
#define FA_BWD_MAX_CHUNKS 16
#define FA_BWD_ONE_PASS_BYTES ((int64_t)32 << 20)
#define FA_BWD_PART_BYTES ((int64_t)64 << 20)

static int fa_bwd_check(const fa_bwd_params *bp)
{
    const fa_params *p = &bp->f;
    int rc = fa_check(p);
    if (rc != FA_OK) return rc;
    if (fa_store16(p->kv_store) || fa_kv_staged(p) || fa_store16(p->q_store) || fa_store16(p->out_store) || p->weights ||
        p->cu_q || !p->lse || !p->out)
        return FA_ERR_ARG;
    if (!bp->dout || !bp->dq || !bp->dk || !bp->dv) return FA_ERR_ARG;
    if (!(p->dropout_p >= 0 && p->dropout_p < 1)) return FA_ERR_ARG;
    if (bp->passes < 0 || bp->passes > 2) return FA_ERR_ARG;
    if (bp->grad16 && (!bp->bf16 || p->dtype != FA_F32)) return FA_ERR_ARG;
    return FA_OK;
}

/* D_i = sum_c dout[i, c] * out[i, c] for every row, into delta (B, Hq, Lq). */
static void fa_bwd_delta(const fa_bwd_params *bp, void *delta, int nth)
{
    const fa_params *p = &bp->f;
    const int64_t rows = p->B * p->Hq * p->Lq;
#pragma omp parallel for num_threads(nth) if (nth > 1 && rows > 4096) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t b = r / (p->Hq * p->Lq), h = (r / p->Lq) % p->Hq, i = r % p->Lq;
        const int64_t od = b * bp->do_sb + h * bp->do_sh + i * bp->do_sl;
        const int64_t oo = b * p->o_sb + h * p->o_sh + i * p->o_sl;
        double acc = 0;
        if (p->dtype == FA_F64) {
            for (int64_t c = 0; c < p->Dv; c++)
                acc += ((const double *)bp->dout)[od + c] * ((const double *)p->out)[oo + c];
            ((double *)delta)[r] = acc;
        } else {
            for (int64_t c = 0; c < p->Dv; c++)
                acc += (double)((const float *)bp->dout)[od + c] * ((const float *)p->out)[oo + c];
            ((float *)delta)[r] = (float)acc;
        }
    }
}

/* One pass when it keeps the threads about as busy as two would: the slowest
 * thread's ceil(heads / nth) heads within 1.3x of the average (two passes do 7/5
 * of the work, perfectly shared). */
static int fa_bwd_one_pass(int64_t heads, int nth)
{
    const int64_t rounds = (heads + nth - 1) / nth;
    return heads >= 1 && 10 * rounds * (int64_t)nth <= 13 * heads;
}

int fa_attention_backward(const fa_bwd_params *bp_in)
{
    fa_last_threads = 0;
    int rc = fa_bwd_check(bp_in);
    if (rc != FA_OK) return rc;
    const fa_params *p0 = &bp_in->f;
    const fa_kernel *kern = fa_kernel_for_isa(p0->isa < 0 ? fa_default_isa() : p0->isa);
    if (!kern || (p0->isa >= 0 && !(fa_cpu_supported_isas() & (1u << p0->isa)))) return FA_ERR_ARG;
    if (p0->B == 0 || p0->Hq == 0 || (p0->Lq == 0 && p0->Lk == 0)) return FA_OK;

    fa_bwd_params bpl = *bp_in; /* with the backward's default block sizes */
    fa_params *p = &bpl.f;
    const int64_t item = p->dtype == FA_F64 ? 8 : 4, gitem = bpl.grad16 ? 2 : item; /* (the gradients') */
    /* bfloat16 inputs where a bfloat16 path runs: the products on pairs or tiles (16 lanes) */
    const fa_bf16_kernel *pk = fa_bf16_bwd_kernel(kern, &bpl);
    if (p->block_q <= 0 || p->block_k <= 0) {
        const int64_t budget = fa_cpu_l2_bytes() / 2, bq = pk && pk->bwd_block_q > 0 ? pk->bwd_block_q : FA_BWD_BLOCK_Q;
        int64_t bk = FA_BWD_BLOCK_K;
        /* Q and dO (twice each), K and V tiles, and the S, dP, P z tiles */
        while (item * (2 * bq * (p->D + p->Dv) + bk * (p->D + p->Dv + 3 * bq)) > budget && bk > 16) bk /= 2;
        if (p->block_q <= 0) p->block_q = bq;
        if (p->block_k <= 0) p->block_k = bk;
    }
    const int nth_req = p->num_threads > 0 ? p->num_threads : fa_max_threads();
    void *delta = fa_scratch_alloc((size_t)(p->B * p->Hq * (p->Lq > 0 ? p->Lq : 1)) * (size_t)item);
    if (!delta) return FA_ERR_NOMEM;
    fa_bwd_delta(&bpl, delta, nth_req < 1 ? 1 : nth_req);

    fa_plan pl;
    rc = fa_make_plan(kern, p, 0, &pl);
    if (rc != FA_OK) {
        free(delta);
        return rc;
    }
    fa_bwd_ctx cx;
    cx.bp = &bpl;
    cx.bl = pl.bl;
    cx.delta = delta;
    cx.delta_sb = p->Hq * p->Lq;
    cx.delta_sh = p->Lq;
    cx.drop_thresh = fa_dropout_threshold(p->dropout_p);
    const int ki = p->dtype;
    fa_bwd_kv_fn bwd_kv = pk ? pk->bwd_kv : kern->bwd_kv[ki];
    fa_bwd_q_fn bwd_q = pk ? pk->bwd_q : kern->bwd_q[ki];
    fa_bwd_reduce_fn bwd_reduce = pk ? pk->bwd_reduce : kern->bwd_reduce[ki];
    const int64_t vl = pk ? 16 : kern->lanes[ki];
    if (pk) /* whole 16-lane vectors of rows (the emulated build's avx2 plan has 8) */
        cx.bl.q = (cx.bl.q + 15) / 16 * 16;
    const int64_t bk = cx.bl.k, heads = p->B * p->Hkv, nth1 = nth_req < 1 ? 1 : nth_req;
    {   /* the dQ chunk: at least FA_BWD_CHUNK blocks, at most FA_BWD_MAX_CHUNKS chunks */
        const int64_t nkb = (p->Lk + bk - 1) / bk;
        int64_t per = (nkb + FA_BWD_MAX_CHUNKS - 1) / FA_BWD_MAX_CHUNKS;
        cx.kc = (per > FA_BWD_CHUNK ? per : FA_BWD_CHUNK) * bk;
    }
    const int64_t nchq = (p->Lk + cx.kc - 1) / cx.kc;
    const int64_t dkp = (p->D + vl - 1) / vl * vl;
    cx.part_sc = p->B * p->Hq * p->Lq * dkp;
    const int64_t per_head = pl.nhc * ((p->Lq + pl.nqp - 1) / pl.nqp);
    const int64_t row_bytes = (dkp + (p->Dv + vl - 1) / vl * vl) * item;
    int sched = bpl.passes == 2 ? 3 : 0;
    if (p->Lq == 0 || p->Lk == 0) sched = 3;
    if (!sched && (bpl.passes == 1 || fa_bwd_one_pass(heads, (int)nth1)) &&
        p->Lk * row_bytes <= FA_BWD_ONE_PASS_BYTES)
        sched = 1;
    if (!sched && nchq >= 2 && nchq * cx.part_sc * item <= FA_BWD_PART_BYTES) sched = 2;
    if (!sched && bpl.passes == 1) sched = 1; /* forced, whatever the memory */
    if (!sched) sched = 3;
    const int64_t chunk = sched == 1 ? p->Lk : sched == 2 ? cx.kc : FA_BWD_CHUNK * bk;
    const int64_t nch = (p->Lk + chunk - 1) / chunk;
    cx.kr = chunk < p->Lk ? chunk : p->Lk; /* (the bfloat16 backward keeps a range's K and V rows) */
    const size_t scratch_bytes = pk ? pk->bwd_scratch(&cx) : kern->bwd_scratch[ki](&cx);
    const int64_t n1 = heads * nch, n2 = sched == 3 && p->Lq > 0 ? pl.items : 0;
    const size_t acc_bytes = (size_t)((chunk < p->Lk ? chunk : p->Lk) * row_bytes);
    void *part = NULL;
    if (sched == 2 && !(part = fa_scratch_alloc((size_t)(nchq * cx.part_sc * item)))) {
        free(pl.start);
        free(delta);
        return FA_ERR_NOMEM;
    }
    int nth = nth_req;
    if ((int64_t)nth > n1 + n2) nth = (int)(n1 + n2);
    if (nth < 1) nth = 1;
    int failed = 0, ran = 0;
    const int64_t rows = p->B * p->Hq * p->Lq;
    fa_spread sp;
    fa_spread_begin(&sp, nth);
#pragma omp parallel num_threads(nth) if (nth > 1) reduction(| : failed) reduction(+ : ran)
    {
        fa_spread_join(&sp);
        ran += 1;
        void *scratch = fa_scratch_alloc(scratch_bytes);
        void *acc = fa_scratch_alloc(acc_bytes);
        fa_item *items = (fa_item *)malloc((size_t)(per_head > 0 ? per_head : 1) * sizeof(fa_item));
        int64_t have_b = -1, have_g = -1;
        if (!scratch || !items || !acc) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < n1 + n2; t++) {
            if (!scratch || !items || !acc) continue;
            if (t < n2) { /* dQ items first: each is a whole query block's row of tiles */
                fa_item it;
                fa_item_of(p, &pl, t, &it);
                bwd_q(&cx, &it, scratch);
                continue;
            }
            const int64_t u = t - n2, b = u / (p->Hkv * nch), g = (u / nch) % p->Hkv, c = u % nch;
            const int64_t k0 = c * chunk, k1 = p->Lk - k0 < chunk ? p->Lk : k0 + chunk;
            if (per_head == 0) { /* Lq = 0: no query reads these keys */
                for (int64_t j = k0; j < k1; j++) {
                    memset((char *)bpl.dk + (size_t)((b * bpl.dk_sb + g * bpl.dk_sh + j * bpl.dk_sl) * gitem), 0,
                           (size_t)(p->D * gitem));
                    memset((char *)bpl.dv + (size_t)((b * bpl.dv_sb + g * bpl.dv_sh + j * bpl.dv_sl) * gitem), 0,
                           (size_t)(p->Dv * gitem));
                }
                continue;
            }
            if (b != have_b || g != have_g) {
                fa_head_query_items(p, &pl, b, g, items);
                have_b = b;
                have_g = g;
            }
            bwd_kv(&cx, items, per_head, k0, k1, sched == 1 ? 1 : sched == 2 ? 2 : 0, scratch, acc, part);
        }
        free(items);
        free(acc);
        free(scratch);
        if (sched == 2) { /* after the loop's barrier: every chunk sum is in (every thread
                             meets this loop; after a failed allocation the result is
                             not used) */
#pragma omp for schedule(static)
            for (int64_t r0 = 0; r0 < rows; r0 += 64)
                bwd_reduce(&cx, part, nchq, r0, rows - r0 < 64 ? rows : r0 + 64);
        }
    }
    free(part);
    fa_last_threads = ran;
    free(pl.start);
    free(delta);
    return failed ? FA_ERR_NOMEM : FA_OK;
}
