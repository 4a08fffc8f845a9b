/*
 * fa_forward.c -- the forward pass (fa_attention_forward): the plan's items
 * (fa_plan.c) on OpenMP threads with per-thread scratch, in one of three runs:
 * dynamic scheduling over the items; head-major segments with per-thread K/V copies
 * for strided K/V (why: fa_plan.c); or, for decoding, split-KV over the key chunks
 * with an ordered merge.  Each item is the chosen kernel's qblock.
 *
 * Determinism: an item's result depends only on the inputs and the kernel, never
 * on which thread ran it or how many there were, so results are bitwise identical
 * for any thread count.
 */
#include <math.h>
#include <stdlib.h>
#include "fa_driver.h"

/* The next item for thread t: the front of its own segment [front, back), else the
 * back of the segment with the most left; -1 when none is left.  The caller holds
 * the lock. */
static int64_t fa_claim(int64_t *front, int64_t *back, int nseg, int t)
{
    if (front[t] < back[t]) return front[t]++;
    int best = -1;
    for (int s = 0; s < nseg; s++)
        if (back[s] > front[s] && (best < 0 || back[s] - front[s] > back[best] - front[best])) best = s;
    return best < 0 ? -1 : --back[best];
}

/* Thread t's own segment of the head-major items at the start: [front[t], back[t]). */
static void fa_segments(int64_t items, int nth, int64_t *front, int64_t *back)
{
    for (int t = 0; t < nth; t++) {
        front[t] = items * t / nth;
        back[t] = items * (t + 1) / nth;
    }
}

static int fa_run_head_items(const fa_params *p, const fa_plan *pl, fa_qblock_fn qblock,
                             size_t scratch_bytes, int nth)
{
    const int64_t items = pl->items;
    const size_t kv_bytes = (size_t)fa_max_seq_len(p->cu_k, p->B, p->Lk) * (size_t)(p->D + p->Dv) * fa_kv_item(p);
    int64_t *seg = (int64_t *)malloc(2 * (size_t)nth * sizeof(int64_t));
    if (!seg) return FA_ERR_NOMEM;
    int64_t *front = seg, *back = seg + nth;
    fa_segments(items, nth, front, back);
    int failed = 0, ran = 0;
    fa_spread sp;
    fa_spread_begin(&sp, nth);
#pragma omp parallel num_threads(nth) if (nth > 1) reduction(| : failed) reduction(+ : ran)
    {
        fa_spread_join(&sp);
        ran += 1;
        void *scratch = fa_scratch_alloc(scratch_bytes);
        char *kvbuf = (char *)fa_scratch_alloc(kv_bytes);
        const int t = fa_thread_num();
        int64_t have_b = -1, have_g = -1; /* the kv head in kvbuf */
        fa_params local;
        if (!scratch || !kvbuf) failed = 1; /* the others take this thread's items */
        while (scratch && kvbuf) {
            int64_t u;
#pragma omp critical(fa_head_claim)
            u = fa_claim(front, back, nth, t);
            if (u < 0) break;
            fa_item it;
            fa_head_item(p, pl, u, &it);
            if (it.b != have_b || it.g != have_g) {
                fa_copy_head(p, it.b, it.g, kvbuf, &local);
                have_b = it.b;
                have_g = it.g;
            }
            it.koff = 0;
            qblock(&local, &pl->bl, &it, scratch);
        }
        free(kvbuf);
        free(scratch);
    }
    free(seg);
    fa_last_threads = ran;
    return failed ? FA_ERR_NOMEM : FA_OK;
}

/*
 * Decoding (a few queries against a long KV cache): split-KV.  The keys are cut
 * into the chunks of fa_chunk_keys from key 0 that every path reduces separately;
 * every (sequence, kv head group, chunk) is a work item that writes that chunk's
 * partial (out, lse), and the partials are merged in chunk order by fa_merge_step,
 * exactly as a prefill block merges the same chunks of the same row.  So the
 * threads spread over chunks too (a handful of heads can use every core), and the
 * bits depend neither on how many threads there are nor on whether the row was
 * decoded or part of a prefill.  Used for fixed-length calls with Lq <=
 * FA_DECODE_MAX_LQ and more than one chunk (see fa_use_split).
 */
#define FA_DECODE_MAX_LQ 8

static int fa_use_split(const fa_kernel *kern, const fa_params *p)
{
    return !p->cu_q && !p->weights && !p->entropy && p->Lq <= FA_DECODE_MAX_LQ &&
           p->Lk > fa_chunk_keys(kern, p);
}

/* What a call's items share: the V-tile flags and the packed key blocks
 * (fa_share_slot), n of each for every (sequence, kv head); NULL where the call has none. */
#define FA_PK_MAX_BYTES (256.0 * 1024 * 1024)
typedef struct fa_share {
    uint8_t *vfin;
    int64_t n;
    uint8_t *pkst;
    char *pkbuf;
    int64_t pk_bytes;
} fa_share;

/* An item's rows of them: its (sequence, kv head)'s. */
static void fa_share_attach(fa_item *it, const fa_share *sh, int64_t Hkv)
{
    const int64_t row = (it->b * Hkv + it->g) * sh->n;
    it->share_n = sh->n;
    if (sh->vfin) it->vfin = sh->vfin + row;
    if (sh->pkst) {
        it->pkst = sh->pkst + row;
        it->pkbuf = sh->pkbuf + row * sh->pk_bytes;
        it->pk_bytes = sh->pk_bytes;
    }
}

/* Split-KV items of up to FA_SPLIT_CHUNKS consecutive chunks of one (sequence, kv
 * head, head chunk), fewer where there would be fewer than FA_SPLIT_MIN_ITEMS items a
 * thread.  Each chunk still writes its own partial (fa_item's part_o): the bits of
 * one-chunk items, on any thread count.  A thread then reads a head's keys several
 * chunks in a row, an item's setup is paid once for them, and a float cache's fused
 * P.V and QK^T (fa_pv_qk) runs across the chunks' edges.  A test build with 2048-key
 * chunks (other bits), B1 H32 Lk8192 D128 KVCache from memory, 2 threads, Sapphire
 * Rapids class Xeon: float16 0.93x the time, float32 0.98x, GQA 32/8 float16 0.93x, Lq 4
 * 0.90x.  Not for the bfloat16 pairs' kernels (their AMX row-major block merges its
 * chunks itself). */
#define FA_SPLIT_CHUNKS 4
#define FA_SPLIT_MIN_ITEMS 8

static int64_t fa_split_per(const fa_kernel *kern, const fa_params *p, int64_t heads, int64_t nch, int nth)
{
    if (fa_bf16_pairs(kern, p)) return 1;
    int64_t per = FA_SPLIT_CHUNKS;
    while (per > 1 && heads * ((nch + per - 1) / per) < FA_SPLIT_MIN_ITEMS * (int64_t)nth) per /= 2;
    return per;
}

/* Split-KV item t of heads x ceil(nch / per) (sequence, kv head, head chunk; per chunks
 * from chunk *c0 to *c1 - 1): the item with its key range cut to those chunks.
 * Contiguous K/V: a head's items in a row; strided ("bshd"): the heads of the same
 * chunks in a row, which share the rows' pages (TLB entries). */
static void fa_split_item(const fa_params *p, const fa_plan *pl, int64_t t, int64_t heads, int64_t nch,
                          int64_t per, fa_item *it, int64_t *c0, int64_t *c1)
{
    const int64_t chunk = pl->bl.chunk, ng = (nch + per - 1) / per;
    const int chunk_major = p->k_sl != p->D || p->v_sl != p->Dv;
    const int64_t c = chunk_major ? t / heads : t % ng, h = chunk_major ? t % heads : t / ng;
    fa_item_make(p, pl, h / (p->Hkv * pl->nhc), (h / pl->nhc) % p->Hkv, h % pl->nhc, 0, it);
    *c0 = c * per;
    *c1 = nch - *c0 < per ? nch : *c0 + per;
    fa_key_range(it->kv0 > *c0 * chunk ? it->kv0 : *c0 * chunk, it->kv1 < *c1 * chunk ? it->kv1 : *c1 * chunk,
                 it->Lk, &it->kv0, &it->kv1);
}

/* The chunks [*ka, *kb) of a split item's [c0, c1) that hold visible keys (the rest
 * write an empty partial). */
static void fa_split_live(const fa_item *it, int64_t chunk, int64_t c1, int64_t *ka, int64_t *kb)
{
    *ka = it->kv1 > it->kv0 ? it->kv0 / chunk : c1;
    *kb = it->kv1 > it->kv0 ? (it->kv1 - 1) / chunk + 1 : c1;
}

static int fa_decode_split(const fa_kernel *kern, const fa_params *p, const fa_plan *pl, fa_qblock_fn qblock,
                           size_t scratch_bytes, int nth_req)
{
    const int64_t chunk = pl->bl.chunk, nch = (p->Lk + chunk - 1) / chunk;
    const int64_t rows = p->B * p->Hq * p->Lq, Dv = p->Dv;
    const size_t item = p->dtype == FA_F64 ? 8 : 4;
    char *pout = (char *)fa_scratch_alloc((size_t)(nch * rows * Dv) * item);
    char *plse = (char *)fa_scratch_alloc((size_t)(nch * rows) * item);
    if (!pout || !plse) {
        free(pout);
        free(plse);
        return FA_ERR_NOMEM;
    }
    /* chunk c writes its partials as a contiguous (B, Hq, Lq, Dv) / (B, Hq, Lq) */
    fa_params part = *p;
    part.out_store = p->dtype; /* partials stay in the compute dtype */
    part.sinks = NULL;         /* folded into the merged rows, once */
    part.o_sb = p->Hq * p->Lq * Dv;
    part.o_sh = p->Lq * Dv;
    part.o_sl = Dv;
    part.lse_sb = p->Hq * p->Lq;
    part.lse_sh = p->Lq;
    part.lse_sl = 1;
    const int64_t heads = p->B * p->Hkv * pl->nhc, per = fa_split_per(kern, p, heads, nch, nth_req);
    const int64_t items = heads * ((nch + per - 1) / per);
    int nth = nth_req;
    if ((int64_t)nth > items) nth = (int)items;
    int failed = 0, ran = 0;
    fa_spread sp;
    fa_spread_begin(&sp, nth);
#pragma omp parallel num_threads(nth) if (nth > 1) reduction(| : failed) reduction(+ : ran)
    {
        fa_spread_join(&sp);
        ran += 1;
        void *scratch = fa_scratch_alloc(scratch_bytes);
        if (!scratch) failed = 1;
        fa_params local = part;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < items; t++) {
            if (!scratch) continue;
            fa_item it;
            int64_t c0, c1, ka, kb;
            fa_split_item(p, pl, t, heads, nch, per, &it, &c0, &c1);
            fa_split_live(&it, chunk, c1, &ka, &kb);
            /* each chunk with no key alone: 0 and lse -inf, as a one-chunk item leaves it */
            for (int64_t c = c0; c < c1; c++) {
                if (c >= ka && c < kb) continue;
                fa_item none = it;
                none.kv0 = none.kv1 = 0;
                local.out = pout + (size_t)(c * rows * Dv) * item;
                local.lse = plse + (size_t)(c * rows) * item;
                qblock(&local, &pl->bl, &none, scratch);
            }
            if (ka == kb) continue;
            /* the chunks with keys in one run, each to its own partial; one such chunk
             * straight to its partial, as before (so always for the bfloat16 pairs, whose
             * AMX row-major block takes no part_o: fa_split_per) */
            local.out = pout + (size_t)(ka * rows * Dv) * item;
            local.lse = plse + (size_t)(ka * rows) * item;
            if (kb - ka > 1) {
                it.part_o = rows * Dv;
                it.part_lse = rows;
                local.out = pout;
                local.lse = plse;
            }
            qblock(&local, &pl->bl, &it, scratch);
        }
        free(scratch);
        const int out16 = fa_store16(p->out_store);
        float *row16 = out16 ? (float *)malloc((size_t)Dv * sizeof(float)) : NULL;
        if (out16 && !row16) failed = 1;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (failed) continue;
            const int64_t b = r / (p->Hq * p->Lq), h = (r / p->Lq) % p->Hq, i = r % p->Lq;
            const int64_t o = b * p->o_sb + h * p->o_sh + i * p->o_sl;
            const int64_t l = b * p->lse_sb + h * p->lse_sh + i * p->lse_sl;
            if (p->dtype == FA_F64) {
                double scratch_lse, *lse = p->lse ? (double *)p->lse + l : &scratch_lse;
                fa_merge_row_f64(nch, Dv, (const double *)pout + r * Dv, rows * Dv,
                                 (const double *)plse + r, rows, (double *)p->out + o, lse);
                if (p->sinks) *lse = fa_sink_fold(*lse, ((const double *)p->sinks)[h], (double *)p->out + o, Dv);
            } else {
                float scratch_lse, *lse = p->lse ? (float *)p->lse + l : &scratch_lse;
                /* a float16 output is merged into a float row, then converted */
                float *dst = out16 ? row16 : (float *)p->out + o;
                fa_merge_row_f32(nch, Dv, (const float *)pout + r * Dv, rows * Dv,
                                 (const float *)plse + r, rows, dst, lse);
                if (p->sinks) *lse = fa_sink_fold(*lse, ((const float *)p->sinks)[h], dst, Dv);
                if (out16)
                    for (int64_t c = 0; c < Dv; c++)
                        ((uint16_t *)p->out)[o + c] = p->out_store == FA_STORE_BF16 ? fa_float_to_bf16(dst[c])
                                                                                    : fa_float_to_half(dst[c]);
            }
        }
        free(row16);
    }
    fa_last_threads = ran;
    free(pout);
    free(plse);
    return failed ? FA_ERR_NOMEM : FA_OK;
}

/* Ask for item it's Q rows, its output rows and, where it sees at most kmax keys (one
 * key block: too few for the hardware's stream prefetch to follow; on B4 H16 L256,
 * two blocks, asking for them was 0.97-0.98x as fast), its K and V rows, into L2
 * (prefetcht1: a line that no other core holds arrives exclusive, so the output
 * row's stores then find it writable in L2), while the item before it runs
 * (fa_use_lookahead).  In-place arrays only; a prefetch never faults, and the rows it
 * asks for are the ones the item reads and writes (not for attention_weights calls,
 * which fa_use_lookahead leaves out: their out is a stand-in). */
static void fa_prefetch_item(const fa_params *p, const fa_item *it, int64_t kmax)
{
    const size_t qsz = fa_store_item(p, p->q_store), ksz = fa_kv_item(p), osz = fa_store_item(p, p->out_store);
    const size_t qb = (size_t)p->D * qsz, kb = (size_t)p->D * ksz, vb = (size_t)p->Dv * ksz, ob = (size_t)p->Dv * osz;
    for (int64_t r = 0; r < it->nh * it->nq; r++) {
        const int64_t h = it->h0 + r / it->nq, row = it->qoff + it->q0 + r % it->nq;
        const char *a = (const char *)p->q + (it->b * p->q_sb + h * p->q_sh + row * p->q_sl) * (int64_t)qsz;
        for (size_t o = 0; o < qb; o += 64) __builtin_prefetch(a + o, 0, 2);
        /* (in a B32 H8 L64 call the row writes waited on the output's lines: 10% of
         * the samples.  In one process, interleaved, medians of 60, AMD EPYC Zen 4, the
         * time without these against with, 1 / 2 threads: B32 H8 L64 1.058x / 1.051x,
         * B8 H32 L128 1.032x / 1.023x, B4 H16 L256 1.017x / 1.011x) */
        a = (const char *)p->out + (it->b * p->o_sb + h * p->o_sh + row * p->o_sl) * (int64_t)osz;
        for (size_t o = 0; o < ob; o += 64) __builtin_prefetch(a + o, 0, 2);
    }
    if (it->kv1 - it->kv0 > kmax || p->k_lanes) return; /* (K on the lanes: no rows k_sl apart) */
    for (int64_t j = it->kv0; j < it->kv1; j++) {
        const int64_t kr = it->koff + j;
        const char *a = (const char *)p->k + (it->b * p->k_sb + it->g * p->k_sh + kr * p->k_sl) * (int64_t)ksz;
        for (size_t o = 0; o < kb; o += 64) __builtin_prefetch(a + o, 0, 2);
        a = (const char *)p->v + (it->b * p->v_sb + it->g * p->v_sh + kr * p->v_sl) * (int64_t)ksz;
        for (size_t o = 0; o < vb; o += 64) __builtin_prefetch(a + o, 0, 2);
    }
}

__thread fa_pf_stream *fa_pf_now;

static int fa_lookahead_mode = FA_LOOKAHEAD_AUTO;

int fa_set_lookahead(int mode)
{
    if (mode < FA_LOOKAHEAD_AUTO || mode > FA_LOOKAHEAD_STREAM) return FA_ERR_ARG;
    fa_lookahead_mode = mode;
    return FA_OK;
}

int fa_lane_groups_mode = 0;

int fa_set_lane_groups(int mode)
{
    if (mode != 0 && mode != 2 && mode != 4) return FA_ERR_ARG;
    fa_lane_groups_mode = mode;
    return FA_OK;
}

/* The Q and output rows of fa_prefetch_item as a stream that the products of the
 * running item ask for a few lines at a time (fa_pf_step), for Intel: there, asked for
 * all at once before the item, they held it up (each software prefetch that misses L1
 * takes one of the core's few line fill buffers, and the instructions behind the
 * prefetches waited for them).  `per` spreads the lines over the row groups of the
 * item's products, as counted for its shape (6-row groups, 64-lane vector groups; a
 * remainder is asked for at the item's end).  K and V are not in it: the stream with
 * them was 1.035x slower at B32 H8 L64 and level at B8 H32 L128. */
static void fa_pf_item(const fa_params *p, const fa_plan *pl, const fa_item *it, fa_pf_stream *st)
{
    const size_t qsz = fa_store_item(p, p->q_store), osz = fa_store_item(p, p->out_store);
    int64_t lines = 0;
    st->n = st->i = 0;
    st->row = st->off = 0;
    for (int64_t h = it->h0; h < it->h0 + it->nh && st->n + 2 <= FA_PF_RANGES; h++) {
        const int64_t row = it->qoff + it->q0;
        st->base[st->n] = (const char *)p->q + (it->b * p->q_sb + h * p->q_sh + row * p->q_sl) * (int64_t)qsz;
        st->stride[st->n] = p->q_sl * (int64_t)qsz;
        st->bytes[st->n] = p->D * (int64_t)qsz;
        st->rows[st->n++] = it->nq;
        st->base[st->n] = (const char *)p->out + (it->b * p->o_sb + h * p->o_sh + row * p->o_sl) * (int64_t)osz;
        st->stride[st->n] = p->o_sl * (int64_t)osz;
        st->bytes[st->n] = p->Dv * (int64_t)osz;
        st->rows[st->n++] = it->nq;
        lines += it->nq * ((p->D * (int64_t)qsz + 63) / 64 + (p->Dv * (int64_t)osz + 63) / 64);
    }
    /* the steps of an item of this shape (the running one, of the same call): QK^T's
     * 6-key groups for each 4-vector group of rows, P.V's 6-row groups for each
     * 64-column chunk, for each of its key blocks */
    const int64_t rows = it->nh * it->nq, nk = it->kv1 - it->kv0 > 0 ? it->kv1 - it->kv0 : 1;
    const int64_t tiles = (nk + pl->bl.k - 1) / pl->bl.k;
    const int64_t steps = tiles * (((pl->bl.k + 5) / 6) * ((rows + 63) / 64) + ((rows + 5) / 6) * ((p->Dv + 63) / 64));
    st->per = (lines + steps - 1) / (steps > 0 ? steps : 1) + 1;
}

/* Item t of the plan, with the call's shared blocks; with nxt >= 0, item nxt's rows
 * asked for too (the thread runs it next: fa_use_lookahead): first on AMD, a few lines
 * at a time during this item's products elsewhere (fa_pf_item). */
static void fa_run_item(const fa_params *p, const fa_plan *pl, const fa_share *sh, fa_qblock_fn qblock,
                        void *scratch, int64_t t, int64_t nxt)
{
    fa_item it;
    fa_pf_stream st;
    if (nxt >= 0 && nxt < pl->items) {
        fa_item_of(p, pl, nxt, &it);
        /* AMD: every row at once.  Intel: not K's and V's rows (the item's K and V
         * lines, asked for all at once, held up the item before it instead: Emerald
         * Rapids, lscpu model 207, 1 thread, in one process, interleaved, medians of
         * 40-100: B32 H8 L64 1.05-1.06x faster without them, three runs; B8 H32 L128
         * 1.01x; without the Q and output rows too it was no faster); items of one key
         * block all at once (B32 H8 L64: the stream was 1.01x slower), longer ones as a
         * stream (paired calls, medians of 100, time of the stream against all at once:
         * B8 H32 L128 0.937x, B4 H16 L256 0.984x) */
        const int all = fa_lookahead_mode == FA_LOOKAHEAD_AUTO ? fa_cpu_amd()
                                                               : fa_lookahead_mode == FA_LOOKAHEAD_ALL;
        if (all || it.kv1 - it.kv0 <= pl->bl.k) {
            fa_prefetch_item(p, &it, all ? pl->bl.k : 0);
        } else {
            fa_pf_item(p, pl, &it, &st);
            fa_pf_now = &st;
        }
    }
    fa_item_of(p, pl, t, &it);
    fa_share_attach(&it, sh, p->Hkv);
    qblock(p, &pl->bl, &it, scratch);
    if (fa_pf_now) { /* what the products did not ask for */
        st.per = INT64_MAX;
        fa_pf_step();
    }
    fa_pf_now = NULL;
}

int fa_attention_forward(const fa_params *p)
{
    fa_last_threads = 0;
    int rc = fa_check(p);
    if (rc != FA_OK) return rc;
    const fa_kernel *kern = fa_kernel_for_isa(p->isa < 0 ? fa_default_isa() : p->isa);
    if (!kern || (p->isa >= 0 && !(fa_cpu_supported_isas() & (1u << p->isa)))) return FA_ERR_ARG;
    if (p->B == 0 || p->Hq == 0 || (!p->cu_q && p->Lq == 0)) return FA_OK;

    const int nth_req = p->num_threads > 0 ? p->num_threads : fa_max_threads(), split = fa_use_split(kern, p);
    fa_plan pl;
    rc = fa_make_plan(kern, p, split ? 0 : nth_req, &pl);
    if (rc != FA_OK) return rc;
    /* int8 K/V are dequantized into float32 tiles: the float32 kernel reads them */
    const int ki = p->kv_store == FA_STORE_BF16 ? FA_KVB16 : p->kv_store == FA_STORE_F16 ? FA_KV16 : p->dtype;
    fa_qblock_fn qblock = kern->qblock[ki];
    size_t scratch_bytes = kern->scratch_bytes[ki](p, &pl.bl);
    /* q, k and v bfloat16 on a kernel with a bfloat16 path selected: the products on
     * AVX512-BF16 or BFDOT pairs, or AMX tiles */
    if (fa_bf16_pairs(kern, p)) {
        const fa_bf16_kernel *bk = fa_bf16_kernel_of(kern);
        qblock = bk->qblock;
        scratch_bytes = bk->scratch_bytes(p, &pl.bl);
    }
    const int64_t items = pl.items;

    int nth = nth_req;
    if ((int64_t)nth > items) nth = (int)items;
    if (nth < 1) nth = 1;

    if (split) {
        rc = fa_decode_split(kern, p, &pl, qblock, scratch_bytes, nth_req < 1 ? 1 : nth_req);
        free(pl.start);
        return rc;
    }
    int failed = 0;
    if (fa_use_head_tasks(p, &pl)) {
        failed = fa_run_head_items(p, &pl, qblock, scratch_bytes, nth) != FA_OK;
        free(pl.start);
        return failed ? FA_ERR_NOMEM : FA_OK;
    }
    /* The V-tile flags (fa_share_slot), where some (sequence, kv head) has several items;
     * without the memory each item checks its tiles itself (the same decisions). */
    int64_t share_n = 0;
    uint8_t *vfin = NULL;
    if (items > p->B * p->Hkv && pl.bl.k > 0) {
        share_n = (fa_max_key_len(p) + pl.bl.k - 1) / pl.bl.k;
        vfin = (uint8_t *)calloc((size_t)(p->B * p->Hkv * share_n) + 1, 1);
    }
    /* The packed key blocks the items share (fa_share_slot), where the call's block packs
     * K and V (a bfloat16 kernel's share_bytes), or where float32 products read 16-bit K/V
     * (float16, or bfloat16 off the pair paths: the whole blocks as float32, converted once
     * a call for every query block of a head, fa_f32_shared, not once a block), and they
     * fit in FA_PK_MAX_BYTES; without the memory each item packs its own, as before (the
     * same values). */
    fa_share sh = {NULL, share_n, NULL, NULL, 0};
    sh.vfin = vfin;
    int64_t per = 0;
    int pk_kept = 0;
    if (vfin && fa_bf16_pairs(kern, p)) {
        const fa_bf16_kernel *bk = fa_bf16_kernel_of(kern);
        per = bk && bk->share_bytes ? bk->share_bytes(p, &pl.bl) : 0;
    } else if (vfin && p->dtype == FA_F32 && fa_store16(p->kv_store))
        per = pl.bl.k * (p->D + p->Dv) * (int64_t)sizeof(float);
    if (per > 0 && (double)(p->B * p->Hkv * share_n) * (double)per <= FA_PK_MAX_BYTES) {
        sh.pkst = (uint8_t *)calloc((size_t)(p->B * p->Hkv * share_n) + 1, 1);
        sh.pkbuf = (char *)fa_shared_take((size_t)(p->B * p->Hkv * share_n * per), &pk_kept);
        sh.pk_bytes = per;
        if (!sh.pkst || !sh.pkbuf) {
            free(sh.pkst);
            if (sh.pkbuf) fa_shared_give(sh.pkbuf, pk_kept);
            sh.pkst = NULL;
            sh.pkbuf = NULL;
        }
    }
    const int ahead = fa_use_lookahead(p, &pl, nth);
    if (nth == 1) {
        /* One thread: no parallel region at all (short calls stay cheap). */
        fa_last_threads = 1;
        void *scratch = fa_scratch_alloc(scratch_bytes);
        if (!scratch) failed = 1;
        for (int64_t t = 0; t < items && scratch; t++)
            fa_run_item(p, &pl, &sh, qblock, scratch, t, ahead ? t + 1 : -1);
        free(scratch);
    } else if (ahead) {
        /* short items: dynamic scheduling with each thread's next item claimed as it
         * starts one, so that its rows arrive while this one runs (fa_use_lookahead) */
        int64_t next = 0;
        int ran = 0;
        fa_spread sp;
        fa_spread_begin(&sp, nth);
#pragma omp parallel num_threads(nth) reduction(| : failed) reduction(+ : ran)
        {
            fa_spread_join(&sp);
            ran += 1;
            void *scratch = fa_scratch_alloc(scratch_bytes);
            if (!scratch) failed = 1; /* (the other threads take every item) */
            int64_t t = scratch ? __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED) : items;
            while (t < items) {
                const int64_t nxt = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED);
                fa_run_item(p, &pl, &sh, qblock, scratch, t, nxt);
                t = nxt;
            }
            free(scratch);
        }
        fa_last_threads = ran;
    } else {
        int ran = 0;
        fa_spread sp;
        fa_spread_begin(&sp, nth);
#pragma omp parallel num_threads(nth) reduction(| : failed) reduction(+ : ran)
        {
            fa_spread_join(&sp);
            ran += 1;
            void *scratch = fa_scratch_alloc(scratch_bytes);
            if (!scratch) failed = 1;
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < items; t++)
                if (scratch) fa_run_item(p, &pl, &sh, qblock, scratch, t, -1);
            free(scratch);
        }
        fa_last_threads = ran;
    }
    free(vfin);
    free(sh.pkst);
    if (sh.pkbuf) fa_shared_give(sh.pkbuf, pk_kept);
    free(pl.start);
    return failed ? FA_ERR_NOMEM : FA_OK;
}

/* ---- the schedule's load balance, without running it (fastattn.bench.plan_balance) ---- */

/* The work of an item over keys [kv0, kv1): 2 (D + Dv) flops per visible (query, key)
 * pair of its rows, each row's visible keys from the causal convention and window. */
static double fa_item_work(const fa_params *p, const fa_item *it, int64_t kv0, int64_t kv1)
{
    const int64_t diag = fa_diag0(p, it->Lq, it->Lk);
    double pairs = 0.0;
    for (int64_t i = it->q0; i < it->q0 + it->nq; i++) {
        const int64_t a = i + diag;
        int64_t lo = p->window_left >= 0 ? a - p->window_left : 0;
        int64_t hi = p->causal != FA_CAUSAL_NONE ? a : p->window_right >= 0 ? a + p->window_right : it->Lk - 1;
        if (lo < kv0) lo = kv0;
        if (hi > kv1 - 1) hi = kv1 - 1;
        if (hi >= lo) pairs += (double)(hi - lo + 1);
    }
    return pairs * (double)it->nh * 2.0 * (double)(p->D + p->Dv);
}

/* The thread that is free first: the least work so far (the lowest index on a tie). */
static int fa_first_free(const double *work, int nth)
{
    int t = 0;
    for (int u = 1; u < nth; u++)
        if (work[u] < work[t]) t = u;
    return t;
}

/* The thread that claims next under look-ahead: the one whose work before its last
 * claimed item is the least (the lowest index on a tie). */
static int fa_first_claim(const double *work, const double *last, int nth)
{
    int t = 0;
    for (int u = 1; u < nth; u++)
        if (work[u] - last[u] < work[t] - last[t]) t = u;
    return t;
}

/*
 * work[t] (nthreads entries): the work thread t would run in fa_attention_forward
 * on nthreads threads, item costs from fa_item_work, each item taken by the thread
 * that is free first, as dynamic scheduling does (or, with look-ahead, claimed as
 * fa_first_claim says); the head-major segments and their
 * stealing for strided K/V (fa_run_head_items) and split-KV decoding as they run.
 * Threads beyond the items get 0.  *nitems: the items of the schedule.
 */
int fa_plan_balance(const fa_params *p, int nthreads, double *work, int64_t *nitems)
{
    int rc = fa_check(p);
    if (rc != FA_OK) return rc;
    if (nthreads < 1 || !work || !nitems) return FA_ERR_ARG;
    const fa_kernel *kern = fa_kernel_for_isa(p->isa < 0 ? fa_default_isa() : p->isa);
    if (!kern || (p->isa >= 0 && !(fa_cpu_supported_isas() & (1u << p->isa)))) return FA_ERR_ARG;
    for (int t = 0; t < nthreads; t++) work[t] = 0.0;
    *nitems = 0;
    if (p->B == 0 || p->Hq == 0 || (!p->cu_q && p->Lq == 0)) return FA_OK;
    const int split = fa_use_split(kern, p);
    fa_plan pl;
    rc = fa_make_plan(kern, p, split ? 0 : nthreads, &pl);
    if (rc != FA_OK) return rc;
    int nth = nthreads;
    if (split) {
        const int64_t nch = (p->Lk + pl.bl.chunk - 1) / pl.bl.chunk;
        const int64_t heads = p->B * p->Hkv * pl.nhc, per = fa_split_per(kern, p, heads, nch, nthreads);
        const int64_t items = heads * ((nch + per - 1) / per);
        if ((int64_t)nth > items) nth = (int)items;
        for (int64_t t = 0; t < items; t++) {
            fa_item it;
            int64_t c0, c1;
            fa_split_item(p, &pl, t, heads, nch, per, &it, &c0, &c1);
            work[fa_first_free(work, nth)] += fa_item_work(p, &it, it.kv0, it.kv1);
        }
        *nitems = items;
    } else {
        const int64_t items = pl.items;
        if ((int64_t)nth > items) nth = (int)items;
        if (fa_use_head_tasks(p, &pl)) {
            int64_t *seg = (int64_t *)malloc(2 * (size_t)nth * sizeof(int64_t));
            if (!seg) {
                free(pl.start);
                return FA_ERR_NOMEM;
            }
            int64_t *front = seg, *back = seg + nth;
            fa_segments(items, nth, front, back);
            for (;;) {
                const int t = fa_first_free(work, nth);
                const int64_t u = fa_claim(front, back, nth, t);
                if (u < 0) break;
                fa_item it;
                fa_head_item(p, &pl, u, &it);
                work[t] += fa_item_work(p, &it, it.kv0, it.kv1);
            }
            free(seg);
        } else {
            /* with look-ahead a thread claims its next item when it starts one: when the
             * work before its last claimed item is done (the lowest such time first; at
             * the start, every thread claims two) */
            const int ahead = fa_use_lookahead(p, &pl, nth);
            double *last = ahead ? (double *)calloc((size_t)nth, sizeof(double)) : NULL;
            if (ahead && !last) {
                free(pl.start);
                return FA_ERR_NOMEM;
            }
            for (int64_t t = 0; t < items; t++) {
                fa_item it;
                fa_item_of(p, &pl, t, &it);
                const double w = fa_item_work(p, &it, it.kv0, it.kv1);
                const int u = ahead ? fa_first_claim(work, last, nth) : fa_first_free(work, nth);
                work[u] += w;
                if (last) last[u] = w;
            }
            free(last);
        }
        *nitems = items;
    }
    free(pl.start);
    return FA_OK;
}
