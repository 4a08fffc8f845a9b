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
static int fa_thread_num(void) { return omp_get_thread_num(); }
#define FA_OPENMP_VERSION _OPENMP
#else
int fa_openmp_enabled(void) { return 0; }
int fa_max_threads(void) { return 1; }
static int fa_thread_num(void) { return 0; }
#define FA_OPENMP_VERSION 0
#endif

/* How many threads ran the calling thread's last forward call (each thread of
 * the parallel region adds one), for tests that check num_threads,
 * OMP_NUM_THREADS and threadpoolctl really reach the kernel.  Thread-local: a
 * Python thread reads what its own last call did, whatever other threads run. */
static _Thread_local int fa_last_threads = 0;
int fa_last_num_threads(void) { return fa_last_threads; }

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
 * AMD EPYC, Zen 3 (family 25 model 1, 512 KiB L2/core read from CPUID 0x8000001D,
 * AVX2 only), 2 threads, medians of 9 interleaved rounds in shuffled order, on a
 * shared 2-vCPU guest (runs differ by 5-10%; the order held in three runs):
 *   avx2   f32 D=64  L=4096: q=192 k=64 113 | q=192 k=128 105 | q=96 k=128 103
 *   avx2   f32 D=128 L=2048: q=192 k=64 113 | q=192 k=128 112 | q=96 k=64 107
 *                            (another run: q=192 k=32 61 | q=96 k=64 59 | q=192 k=64 59)
 *   avx2   f64 D=64  L=2048: q=192 k=64 46  | q=192 k=128 45  | q=96 k=64 42
 *   avx2   f32 D=64  L=4096 causal: q=96 k=64 110 | q=192 k=64 109 | q=64 k=128 107
 *   avx2   f32 D=64  L=512 H=16 causal: q=64 k=128 89 | q=64 k=64 89 | q=96 k=64 86
 * The AVX2 kernel runs by default on CPUs without AVX-512 (Zen 2/3, client Intel),
 * so the Zen 3 figures decide its non-causal blocks (the Xeon rows above were taken
 * with AVX-512 disabled).  Zen 4/5 (AVX-512, 1 MiB L2) were not available to
 * re-measure when the L2 reading was fixed; their L2 now allows the 192 x 64 blocks
 * (an earlier session measured 192 x 64 5-9% faster there than the 96 x 32 that the
 * misread 256 KiB L2 forced).
 * So: 192 x 64 for AVX-512 and for AVX2 (64 x 64 causal or windowed on AVX-512, 64 x
 * 128 on AVX2: a window is a diagonal band too);
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
        bl.q = p->causal || p->window_left >= 0 || p->window_right >= 0 ? 64 : 192;
        bl.k = 64;
    } else if (kern == fa_kernel_for_isa(FA_ISA_AVX2)) {
        const int banded = p->causal || p->window_left >= 0 || p->window_right >= 0;
        bl.q = banded ? 64 : 192;
        bl.k = banded ? 128 : 64;
    }
    const int64_t budget = fa_cpu_l2_bytes() / 2;
    for (;;) {
        int64_t ws = item * (bl.q * (p->D + p->Dv) + bl.k * (p->D + p->Dv + bl.q));
        if (ws <= budget) break;
        if (bl.k > 32) bl.k /= 2;
        else if (bl.q > 2 * vl) bl.q = (bl.q / 2 + vl - 1) / vl * vl;
        else break;
    }
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
    if (!(p->softcap >= 0) || !isfinite(p->softcap)) return FA_ERR_ARG;
    if ((p->cu_q == NULL) != (p->cu_k == NULL)) return FA_ERR_ARG;
    if (p->seqlens_k) {
        if (p->cu_k) return FA_ERR_ARG;
        for (int64_t b = 0; b < p->B; b++)
            if (p->seqlens_k[b] < 0 || p->seqlens_k[b] > p->Lk) return FA_ERR_ARG;
    }
    if (p->kv_f16 && p->dtype != FA_F32) return FA_ERR_ARG;
    if ((p->q_f16 || p->out_f16 || p->bf16) && !p->kv_f16) return FA_ERR_ARG;
    if ((p->entropy == NULL) != (p->max_weight == NULL) || (p->entropy && !p->lse)) return FA_ERR_ARG;
    return FA_OK;
}

/* Block sizes: see fa_default_blocks for the measurements behind the defaults. */
static fa_blocks fa_choose_blocks(const fa_kernel *kern, const fa_params *p)
{
    fa_blocks bl = fa_default_blocks(kern, p);
    if (p->block_q > 0) bl.q = p->block_q;
    if (p->block_k > 0) bl.k = p->block_k;
    if (bl.q > 1024) bl.q = 1024;
    if (bl.q < 1) bl.q = 1;
    if (bl.k > 1 << 16) bl.k = 1 << 16;
    if (bl.k < 1) bl.k = 1;
    return bl;
}

/* How a call is cut into work items (see fa_item). */
typedef struct fa_plan {
    fa_blocks bl;     /* bl.q: rows of an item rounded up to the vector width */
    int64_t G;        /* query heads per key/value head                      */
    int64_t nh;       /* query heads stacked in one item                     */
    int64_t nhc;      /* head chunks per key/value head: ceil(G / nh)        */
    int64_t nqp;      /* positions per item and head                         */
    int64_t per_seq;  /* fixed lengths: items per sequence                   */
    int64_t *start;   /* varlen: first item of each sequence (B+1), or NULL  */
    int64_t items;
} fa_plan;

static int64_t fa_seq_len(const int64_t *cu, int64_t b, int64_t fixed)
{
    return cu ? cu[b + 1] - cu[b] : fixed;
}

/* The keys sequence b sees: its varlen length, its seqlens_k entry, or Lk. */
static int64_t fa_key_len(const fa_params *p, int64_t b)
{
    return p->cu_k ? p->cu_k[b + 1] - p->cu_k[b] : p->seqlens_k ? p->seqlens_k[b] : p->Lk;
}

static int64_t fa_max_seq_len(const int64_t *cu, int64_t B, int64_t fixed)
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
static int fa_make_plan(const fa_kernel *kern, const fa_params *p, fa_plan *pl)
{
    const int64_t vl = kern->lanes[p->dtype];
    pl->bl = fa_choose_blocks(kern, p);
    pl->G = p->Hq / p->Hkv;
    pl->start = NULL;
    int64_t lmax = fa_max_seq_len(p->cu_q, p->B, p->Lq);
    if (lmax < 1) lmax = 1;
    if (pl->G > 1 && 2 * lmax <= pl->bl.q) {
        pl->nh = pl->bl.q / lmax < pl->G ? pl->bl.q / lmax : pl->G;
        pl->nqp = lmax;
    } else {
        /* equal blocks, each a whole number of vectors (no padded lanes but the last) */
        int64_t nblocks = (lmax + pl->bl.q - 1) / pl->bl.q;
        pl->nh = 1;
        pl->nqp = ((lmax + nblocks - 1) / nblocks + vl - 1) / vl * vl;
    }
    pl->nhc = (pl->G + pl->nh - 1) / pl->nh;
    pl->bl.q = (pl->nh * pl->nqp + vl - 1) / vl * vl;
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
    return FA_OK;
}

/* The item for query block qb of head chunk hc of kv head g in sequence b. */
static void fa_item_make(const fa_params *p, const fa_plan *pl, int64_t b, int64_t g, int64_t hc,
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
    /* keys visible to some row: row i sees a-left <= j <= a+right, a = i + diag */
    const int64_t diag = p->causal == FA_CAUSAL_TOP_LEFT ? 0 : Lk - Lq;
    const int64_t right = p->causal != FA_CAUSAL_NONE ? 0 : p->window_right; /* min(right, 0) */
    fa_key_range(p->window_left >= 0 ? it->q0 + diag - p->window_left : 0,
                 right >= 0 ? it->q0 + it->nq - 1 + diag + right + 1 : Lk, Lk, &it->kv0, &it->kv1);
}

static int64_t fa_qblocks(const fa_params *p, const fa_plan *pl, int64_t b)
{
    return (fa_seq_len(p->cu_q, b, p->Lq) + pl->nqp - 1) / pl->nqp;
}

/* Item t of the plan.  Within a sequence, query blocks run last first: with causal
 * masking the last blocks see the most keys, so the most expensive items start
 * first and dynamic scheduling balances the rest across threads. */
static void fa_item_of(const fa_params *p, const fa_plan *pl, int64_t t, fa_item *it)
{
    const int64_t per_qb = p->Hkv * pl->nhc;
    int64_t b, u;
    if (pl->start) {
        int64_t lo = 0, hi = p->B - 1; /* last b with start[b] <= t */
        while (lo < hi) {
            int64_t mid = (lo + hi + 1) / 2;
            if (pl->start[mid] <= t) lo = mid;
            else hi = mid - 1;
        }
        b = lo;
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
/* Bytes per element of K and V. */
static size_t fa_kv_item(const fa_params *p)
{
    return p->kv_f16 ? 2 : p->dtype == FA_F64 ? 8 : 4;
}

static int fa_use_head_tasks(const fa_params *p, const fa_plan *pl)
{
    if ((p->k_sl == p->D && p->v_sl == p->Dv) || p->weights) return 0;
    return pl->items >= 2 * p->B * p->Hkv * pl->nhc; /* some head has 2 or more blocks */
}

/* Item u in head-major order: sequence b, kv head g, head chunk hc, and its query
 * block (heavy first when causal). */
static void fa_head_item(const fa_params *p, const fa_plan *pl, int64_t u, fa_item *it)
{
    int64_t b, w;
    if (pl->start) {
        int64_t lo = 0, hi = p->B - 1; /* last b with start[b] <= u */
        while (lo < hi) {
            int64_t mid = (lo + hi + 1) / 2;
            if (pl->start[mid] <= u) lo = mid;
            else hi = mid - 1;
        }
        b = lo;
        w = u - pl->start[b];
    } else {
        b = u / pl->per_seq;
        w = u % pl->per_seq;
    }
    const int64_t nqb = fa_qblocks(p, pl, b), task = w / nqb, i = w % nqb;
    fa_item_make(p, pl, b, task / pl->nhc, task % pl->nhc, p->causal ? nqb - 1 - i : i, it);
}

/* The contiguous copy of kv head (b, g) in kvbuf, and the parameters that read it. */
static void fa_copy_head(const fa_params *p, int64_t b, int64_t g, char *kvbuf, fa_params *local)
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

static int fa_run_head_items(const fa_params *p, const fa_plan *pl, fa_qblock_fn qblock,
                             size_t scratch_bytes, int nth)
{
    const int64_t items = pl->items;
    const size_t kv_bytes = (size_t)fa_max_seq_len(p->cu_k, p->B, p->Lk) * (size_t)(p->D + p->Dv) * fa_kv_item(p);
    int64_t *seg = (int64_t *)malloc(2 * (size_t)nth * sizeof(int64_t));
    if (!seg) return FA_ERR_NOMEM;
    int64_t *front = seg, *back = seg + nth;
    for (int t = 0; t < nth; t++) {
        front[t] = items * t / nth;
        back[t] = items * (t + 1) / nth;
    }
    int failed = 0, ran = 0;
#pragma omp parallel num_threads(nth) if (nth > 1) reduction(| : failed) reduction(+ : ran)
    {
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

static void fa_merge_row_f32(int64_t parts, int64_t dv, const float *out, int64_t ostride,
                             const float *lse, int64_t lstride, float *dst, float *dst_lse);
static void fa_merge_row_f64(int64_t parts, int64_t dv, const double *out, int64_t ostride,
                             const double *lse, int64_t lstride, double *dst, double *dst_lse);

/*
 * Decoding (a few queries against a long KV cache): split-KV.  The keys are cut
 * into the chunks of FA_CHUNK_KEYS from key 0 that every path reduces separately;
 * every (sequence, kv head group, chunk) is a work item that writes that chunk's
 * partial (out, lse), and the partials are merged in chunk order by fa_merge_step,
 * exactly as a prefill block merges the same chunks of the same row.  So the
 * threads spread over chunks too (a handful of heads can use every core), and the
 * bits depend neither on how many threads there are nor on whether the row was
 * decoded or part of a prefill.  Used for fixed-length calls with Lq <=
 * FA_DECODE_MAX_LQ and more than one chunk (see fa_use_split).
 */
#define FA_DECODE_MAX_LQ 8

static int fa_use_split(const fa_params *p)
{
    return !p->cu_q && !p->weights && !p->entropy && p->Lq <= FA_DECODE_MAX_LQ &&
           p->Lk > FA_CHUNK_KEYS;
}

static int fa_decode_split(const fa_params *p, const fa_plan *pl, fa_qblock_fn qblock,
                           size_t scratch_bytes, int nth_req)
{
    const int64_t chunk = FA_CHUNK_KEYS, nch = (p->Lk + chunk - 1) / chunk;
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
    part.out_f16 = 0; /* partials stay in the compute dtype */
    part.o_sb = p->Hq * p->Lq * Dv;
    part.o_sh = p->Lq * Dv;
    part.o_sl = Dv;
    part.lse_sb = p->Hq * p->Lq;
    part.lse_sh = p->Lq;
    part.lse_sl = 1;
    const int64_t heads = p->B * p->Hkv * pl->nhc, items = heads * nch;
    const int chunk_major = p->k_sl != p->D || p->v_sl != p->Dv;
    int nth = nth_req;
    if ((int64_t)nth > items) nth = (int)items;
    int failed = 0, ran = 0;
#pragma omp parallel num_threads(nth) if (nth > 1) reduction(| : failed) reduction(+ : ran)
    {
        ran += 1;
        void *scratch = fa_scratch_alloc(scratch_bytes);
        if (!scratch) failed = 1;
        fa_params local = part;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < items; t++) {
            if (!scratch) continue;
            /* contiguous K/V: a head's chunks in a row; strided ("bshd"): a chunk's
             * heads in a row, which share the rows' pages (TLB entries) */
            const int64_t c = chunk_major ? t / heads : t % nch, h = chunk_major ? t % heads : t / nch;
            const int64_t b = h / (p->Hkv * pl->nhc), g = (h / pl->nhc) % p->Hkv, hc = h % pl->nhc;
            fa_item it;
            fa_item_make(p, pl, b, g, hc, 0, &it);
            fa_key_range(it.kv0 > c * chunk ? it.kv0 : c * chunk,
                         it.kv1 < (c + 1) * chunk ? it.kv1 : (c + 1) * chunk, it.Lk, &it.kv0, &it.kv1);
            local.out = pout + (size_t)(c * rows * Dv) * item;
            local.lse = plse + (size_t)(c * rows) * item;
            qblock(&local, &pl->bl, &it, scratch);
        }
        free(scratch);
        float *row16 = p->out_f16 ? (float *)malloc((size_t)Dv * sizeof(float)) : NULL;
        if (p->out_f16 && !row16) failed = 1;
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
            } else {
                float scratch_lse, *lse = p->lse ? (float *)p->lse + l : &scratch_lse;
                /* a float16 output is merged into a float row, then converted */
                float *dst = p->out_f16 ? row16 : (float *)p->out + o;
                fa_merge_row_f32(nch, Dv, (const float *)pout + r * Dv, rows * Dv,
                                 (const float *)plse + r, rows, dst, lse);
                if (p->out_f16)
                    for (int64_t c = 0; c < Dv; c++)
                        ((uint16_t *)p->out)[o + c] = p->bf16 ? fa_float_to_bf16(dst[c]) : fa_float_to_half(dst[c]);
            }
        }
        free(row16);
    }
    fa_last_threads = ran;
    free(pout);
    free(plse);
    return failed ? FA_ERR_NOMEM : FA_OK;
}

int fa_attention_forward(const fa_params *p)
{
    fa_last_threads = 0;
    int rc = fa_check(p);
    if (rc != FA_OK) return rc;
    const fa_kernel *kern = fa_kernel_for_isa(p->isa < 0 ? fa_default_isa() : p->isa);
    if (!kern || (p->isa >= 0 && !(fa_cpu_supported_isas() & (1u << p->isa)))) return FA_ERR_ARG;
    if (p->B == 0 || p->Hq == 0 || (!p->cu_q && p->Lq == 0)) return FA_OK;

    fa_plan pl;
    rc = fa_make_plan(kern, p, &pl);
    if (rc != FA_OK) return rc;
    const int ki = p->kv_f16 ? (p->bf16 ? FA_KVB16 : FA_KV16) : p->dtype;
    const fa_qblock_fn qblock = kern->qblock[ki];
    const size_t scratch_bytes = kern->scratch_bytes[ki](p, &pl.bl);
    const int64_t items = pl.items;

    int nth = p->num_threads > 0 ? p->num_threads : fa_max_threads();
    if ((int64_t)nth > items) nth = (int)items;
    if (nth < 1) nth = 1;

    if (fa_use_split(p)) {
        int nth_all = p->num_threads > 0 ? p->num_threads : fa_max_threads();
        rc = fa_decode_split(p, &pl, qblock, scratch_bytes, nth_all < 1 ? 1 : nth_all);
        free(pl.start);
        return rc;
    }
    int failed = 0;
    if (fa_use_head_tasks(p, &pl)) {
        failed = fa_run_head_items(p, &pl, qblock, scratch_bytes, nth) != FA_OK;
    } else if (nth == 1) {
        /* One thread: no parallel region at all (short calls stay cheap). */
        fa_last_threads = 1;
        void *scratch = fa_scratch_alloc(scratch_bytes);
        if (!scratch) failed = 1;
        for (int64_t t = 0; t < items && scratch; t++) {
            fa_item it;
            fa_item_of(p, &pl, t, &it);
            qblock(p, &pl.bl, &it, scratch);
        }
        free(scratch);
    } else {
        int ran = 0;
#pragma omp parallel num_threads(nth) reduction(| : failed) reduction(+ : ran)
        {
            ran += 1;
            void *scratch = fa_scratch_alloc(scratch_bytes);
            if (!scratch) failed = 1;
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < items; t++) {
                if (!scratch) continue;
                fa_item it;
                fa_item_of(p, &pl, t, &it);
                qblock(p, &pl.bl, &it, scratch);
            }
            free(scratch);
        }
        fa_last_threads = ran;
    }
    free(pl.start);
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

/* One merged row: parts in index order, part q's row at out + q*ostride, its lse at
 * lse[q*lstride] (the online merge of fa_internal.h). */
#define FA_MERGE_ROW(NAME, T, SUF)                                                           \
    static void NAME(int64_t parts, int64_t dv, const T *out, int64_t ostride, const T *lse,  \
                     int64_t lstride, T *dst, T *dst_lse)                                   \
    {                                                                                       \
        T M = -(T)INFINITY, tot = 0;                                                        \
        for (int64_t q = 0; q < parts; q++)                                                 \
            fa_merge_step_##SUF(&M, &tot, dst, lse[q * lstride], out + q * ostride, dv);    \
        *dst_lse = fa_merge_finish_##SUF(M, tot, dst, dv);                                  \
    }
FA_MERGE_ROW(fa_merge_row_f32, float, f32)
FA_MERGE_ROW(fa_merge_row_f64, double, f64)

int fa_merge(int dtype, int64_t parts, int64_t rows, int64_t dv, const void *outs,
             const void *lses, void *out, void *lse)
{
    if (parts < 1 || rows < 0 || dv < 0) return FA_ERR_ARG;
    for (int64_t r = 0; r < rows; r++) {
        if (dtype == FA_F32)
            fa_merge_row_f32(parts, dv, (const float *)outs + r * dv, rows * dv, (const float *)lses + r,
                             rows, (float *)out + r * dv, (float *)lse + r);
        else if (dtype == FA_F64)
            fa_merge_row_f64(parts, dv, (const double *)outs + r * dv, rows * dv,
                             (const double *)lses + r, rows, (double *)out + r * dv, (double *)lse + r);
        else
            return FA_ERR_ARG;
    }
    return FA_OK;
}

/* All the query items of kv head g of sequence b, in order (head chunks, then query
 * blocks): the rows a backward or key_mass item of that head goes through. */
static void fa_head_query_items(const fa_params *p, const fa_plan *pl, int64_t b, int64_t g,
                                fa_item *items)
{
    int64_t n = 0;
    for (int64_t hc = 0; hc < pl->nhc; hc++)
        for (int64_t qb = 0; qb < (p->Lq + pl->nqp - 1) / pl->nqp; qb++)
            fa_item_make(p, pl, b, g, hc, qb, &items[n++]);
}

/* ---- dropout (the generator is fa_dropout_row in fa_internal.h) ---- */
uint32_t fa_dropout_threshold(double p)
{
    if (!(p > 0)) return 0;
    const double t = p * 4294967296.0; /* exact: a power-of-two multiply */
    return t >= 4294967295.0 ? 0xFFFFFFFFu : (uint32_t)t;
}

int fa_dropout_keep(uint64_t seed, uint32_t threshold, int64_t b, int64_t h, int64_t i, int64_t j)
{
    uint8_t keep;
    fa_dropout_row(seed, threshold, b, h, i, j, 1, &keep, 1);
    return keep;
}

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
 * ~5%, faster).
 */
#define FA_BWD_BLOCK_Q 64
#define FA_BWD_BLOCK_K 64
#define FA_BWD_CHUNK 4
#define FA_BWD_MAX_CHUNKS 16
#define FA_BWD_ONE_PASS_BYTES ((int64_t)32 << 20)
#define FA_BWD_PART_BYTES ((int64_t)64 << 20)

static int fa_bwd_check(const fa_bwd_params *bp)
{
    const fa_params *p = &bp->f;
    int rc = fa_check(p);
    if (rc != FA_OK) return rc;
    if (p->kv_f16 || p->q_f16 || p->out_f16 || p->weights || p->cu_q || !p->lse || !p->out)
        return FA_ERR_ARG;
    if (!bp->dout || !bp->dq || !bp->dk || !bp->dv) return FA_ERR_ARG;
    if (!(p->dropout_p >= 0 && p->dropout_p < 1)) return FA_ERR_ARG;
    if (bp->passes < 0 || bp->passes > 2) return FA_ERR_ARG;
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
    const int64_t item = p->dtype == FA_F64 ? 8 : 4;
    if (p->block_q <= 0 || p->block_k <= 0) {
        const int64_t budget = fa_cpu_l2_bytes() / 2;
        int64_t bk = FA_BWD_BLOCK_K;
        /* Q and dO (twice each), K and V tiles, and the S, dP, P z tiles */
        while (item * (2 * FA_BWD_BLOCK_Q * (p->D + p->Dv) + bk * (p->D + p->Dv + 3 * FA_BWD_BLOCK_Q)) > budget &&
               bk > 16)
            bk /= 2;
        if (p->block_q <= 0) p->block_q = FA_BWD_BLOCK_Q;
        if (p->block_k <= 0) p->block_k = bk;
    }
    const int nth_req = p->num_threads > 0 ? p->num_threads : fa_max_threads();
    void *delta = fa_scratch_alloc((size_t)(p->B * p->Hq * (p->Lq > 0 ? p->Lq : 1)) * (size_t)item);
    if (!delta) return FA_ERR_NOMEM;
    fa_bwd_delta(&bpl, delta, nth_req < 1 ? 1 : nth_req);

    fa_plan pl;
    rc = fa_make_plan(kern, p, &pl);
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
    const int64_t vl = kern->lanes[ki];
    const int64_t bk = cx.bl.k, heads = p->B * p->Hkv, nth1 = nth_req < 1 ? 1 : nth_req;
    {   /* the dQ chunk: at least FA_BWD_CHUNK blocks, at most FA_BWD_MAX_CHUNKS chunks */
        const int64_t nkb = (p->Lk + bk - 1) / bk;
        int64_t per = (nkb + FA_BWD_MAX_CHUNKS - 1) / FA_BWD_MAX_CHUNKS;
        cx.kc = (per > FA_BWD_CHUNK ? per : FA_BWD_CHUNK) * bk;
    }
    const int64_t nchq = (p->Lk + cx.kc - 1) / cx.kc;
    const int64_t dkp = (p->D + vl - 1) / vl * vl;
    cx.part_sc = p->B * p->Hq * p->Lq * dkp;
    const size_t scratch_bytes = kern->bwd_scratch[ki](&cx);
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
#pragma omp parallel num_threads(nth) if (nth > 1) reduction(| : failed) reduction(+ : ran)
    {
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
                kern->bwd_q[ki](&cx, &it, scratch);
                continue;
            }
            const int64_t u = t - n2, b = u / (p->Hkv * nch), g = (u / nch) % p->Hkv, c = u % nch;
            const int64_t k0 = c * chunk, k1 = p->Lk - k0 < chunk ? p->Lk : k0 + chunk;
            if (per_head == 0) { /* Lq = 0: no query reads these keys */
                for (int64_t j = k0; j < k1; j++) {
                    memset((char *)bpl.dk + (size_t)((b * bpl.dk_sb + g * bpl.dk_sh + j * bpl.dk_sl) * item), 0,
                           (size_t)(p->D * item));
                    memset((char *)bpl.dv + (size_t)((b * bpl.dv_sb + g * bpl.dv_sh + j * bpl.dv_sl) * item), 0,
                           (size_t)(p->Dv * item));
                }
                continue;
            }
            if (b != have_b || g != have_g) {
                fa_head_query_items(p, &pl, b, g, items);
                have_b = b;
                have_g = g;
            }
            kern->bwd_kv[ki](&cx, items, per_head, k0, k1, sched == 1 ? 1 : sched == 2 ? 2 : 0, scratch,
                             acc, part);
        }
        free(items);
        free(acc);
        free(scratch);
        if (sched == 2) { /* after the loop's barrier: every chunk sum is in (every thread
                             meets this loop; after a failed allocation the result is
                             not used) */
#pragma omp for schedule(static)
            for (int64_t r0 = 0; r0 < rows; r0 += 64)
                kern->bwd_reduce[ki](&cx, part, nchq, r0, rows - r0 < 64 ? rows : r0 + 64);
        }
    }
    free(part);
    fa_last_threads = ran;
    free(pl.start);
    free(delta);
    return failed ? FA_ERR_NOMEM : FA_OK;
}

int fa_key_mass(const fa_params *p_in, void *mass, int64_t m_sb, int64_t m_sh)
{
    fa_last_threads = 0;
    int rc = fa_check(p_in);
    if (rc != FA_OK) return rc;
    if (p_in->kv_f16 || p_in->weights || p_in->cu_q || !p_in->lse || !mass) return FA_ERR_ARG;
    const fa_kernel *kern = fa_kernel_for_isa(p_in->isa < 0 ? fa_default_isa() : p_in->isa);
    if (!kern || (p_in->isa >= 0 && !(fa_cpu_supported_isas() & (1u << p_in->isa)))) return FA_ERR_ARG;
    if (p_in->B == 0 || p_in->Hq == 0 || p_in->Lk == 0) return FA_OK;
    fa_bwd_params bp;
    memset(&bp, 0, sizeof bp);
    bp.f = *p_in;
    fa_params *p = &bp.f;
    p->entropy = p->max_weight = NULL;
    p->dropout_p = 0;
    p->Dv = 1; /* the scratch's value pieces are unused */
    const int64_t item = p->dtype == FA_F64 ? 8 : 4;
    const int64_t G = p->Hq / p->Hkv;
    if (p->Lq == 0) { /* no query: every key gets 0 */
        for (int64_t b = 0; b < p->B; b++)
            for (int64_t h = 0; h < p->Hq; h++)
                memset((char *)mass + (size_t)((b * m_sb + h * m_sh) * item), 0, (size_t)(p->Lk * item));
        return FA_OK;
    }
    fa_plan pl;
    rc = fa_make_plan(kern, p, &pl);
    if (rc != FA_OK) return rc;
    fa_bwd_ctx cx;
    memset(&cx, 0, sizeof cx);
    cx.bp = &bp;
    cx.bl = pl.bl;
    const int ki = p->dtype;
    const size_t scratch_bytes = kern->bwd_scratch[ki](&cx);
    const int64_t chunk = FA_BWD_CHUNK * cx.bl.k, nch = (p->Lk + chunk - 1) / chunk;
    const int64_t n1 = p->B * p->Hkv * nch, per_head = pl.nhc * ((p->Lq + pl.nqp - 1) / pl.nqp);
    int nth = p->num_threads > 0 ? p->num_threads : fa_max_threads();
    if ((int64_t)nth > n1) nth = (int)n1;
    if (nth < 1) nth = 1;
    int failed = 0, ran = 0;
#pragma omp parallel num_threads(nth) if (nth > 1) reduction(| : failed) reduction(+ : ran)
    {
        ran += 1;
        void *scratch = fa_scratch_alloc(scratch_bytes);
        void *acc = fa_scratch_alloc((size_t)(G * chunk * item));
        fa_item *items = (fa_item *)malloc((size_t)per_head * sizeof(fa_item));
        int64_t have_b = -1, have_g = -1;
        if (!scratch || !acc || !items) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < n1; t++) {
            if (!scratch || !acc || !items) continue;
            const int64_t b = t / (p->Hkv * nch), g = (t / nch) % p->Hkv, c = t % nch;
            if (b != have_b || g != have_g) {
                fa_head_query_items(p, &pl, b, g, items);
                have_b = b;
                have_g = g;
            }
            const int64_t k0 = c * chunk, k1 = p->Lk - k0 < chunk ? p->Lk : k0 + chunk;
            kern->mass[ki](&cx, items, per_head, k0, k1, scratch, acc, mass, m_sb, m_sh);
        }
        free(items);
        free(acc);
        free(scratch);
    }
    fa_last_threads = ran;
    free(pl.start);
    return failed ? FA_ERR_NOMEM : FA_OK;
}
