/*
 * kernels_tmpl.h -- the attention micro-kernels, written once over a small set of
 * vector operations and instantiated by each instruction-set file
 * (kernels_generic.c, kernels_avx2.c, kernels_avx512.c) for float32 and float64.
 * Each including file is compiled with its own flags only, so the operations below
 * become that file's instructions and nothing else.
 *
 * The including file defines, before each inclusion:
 *   FA_T          element type (float or double)
 *   FA_V          vector type, FA_VL lanes of FA_T
 *   FA_NAME(x)    name mangling, e.g. x##_f32_avx512
 *   FA_QK_R, FA_QK_NV   QK^T register tile: keys x query vectors
 *   FA_PV_R, FA_PV_NC   P.V register tile: query rows x value vectors
 *   FA_VLOAD(p) FA_VSTORE(p,v)  aligned (scratch) load/store
 *   FA_VLOADU(p)         unaligned load; FA_VLOADU_N(p, n) loads n < FA_VL lanes, rest 0
 *   FA_VSET1(x) FA_VZERO() FA_VADD FA_VSUB FA_VMUL FA_VFMA(a,b,c)=a*b+c
 *   FA_VMAX(a,b)         lane max; if b is NaN the result is NaN
 *   FA_VEXP(x)           lane exp; exp(-inf) = +0 exactly, NaN stays NaN
 *   FA_VNEGINF_TO_ZERO(x) lanes equal to -inf become 0, others unchanged
 *   FA_VABS(x) FA_VDIV(a,b) FA_VCOPYSIGN(mag, sgn)
 *   FA_VIN_RANGE(x, j, lo, hi)  x where lo <= j <= hi (j a broadcast), else -inf
 *   FA_VMASK_BYTES(x, p)        x where the byte p[lane] != 0, else -inf
 *   FA_VREDUCE(x)               the sum of the lanes
 * and, optionally, for K/V stored in another type FA_KV (float16 K/V: FA_KV_HALF,
 * computing in float32; default FA_KV = FA_T):
 *   FA_KV_BCAST(p) FA_KV_LOADU(p) FA_KV_LOADU_N(p, n)   converting loads
 * and, optionally (FA_HAVE_TRANSPOSE), a register transpose for bias tiles:
 *   FA_VTRANSPOSE(rows, off, dst, ds)  dst[t * ds + i] = rows[i][off + t] for
 *                               i, t < FA_VL (dst aligned; rows: FA_VL pointers)
 *
 * Layout: the query axis is the SIMD axis.  A query block is packed transposed
 * (qt[d][i], pre-multiplied by scale), so S^T = K qt is computed with one key
 * element broadcast against vectors of queries, and every softmax statistic (row
 * max m, row sum l, rescale factor alpha) is a vector over queries: no horizontal
 * reductions anywhere, and the key tile needs no transposition.  P.V then
 * broadcasts one probability against vectors of a value row.
 */

/* The switch cases of every register tile shape up to 6 rows x 4 vectors, so each
 * tail shape gets its own fully unrolled code; CASE(R, C) must ignore shapes
 * larger than the instantiation's tile (they are never selected at run time). */
#define FA_TILE_ROW(CASE, R) CASE(R, 1) CASE(R, 2) CASE(R, 3) CASE(R, 4)
#define FA_TILE_ROWS(CASE)                                                                     \
    FA_TILE_ROW(CASE, 1) FA_TILE_ROW(CASE, 2) FA_TILE_ROW(CASE, 3) FA_TILE_ROW(CASE, 4)          \
    FA_TILE_ROW(CASE, 5) FA_TILE_ROW(CASE, 6)

#ifndef FA_16_TO_FLOAT /* the 16-bit type of q and out with 16-bit K/V: IEEE half */
#define FA_16_TO_FLOAT(x) fa_half_to_float(x)
#define FA_FLOAT_TO_16(x) fa_float_to_half(x)
#endif

#ifndef FA_KV
#define FA_KV FA_T
#define FA_KV_BCAST(p) FA_VSET1(*(p))
#define FA_KV_LOADU(p) FA_VLOADU(p)
#define FA_KV_LOADU_N(p, n) FA_VLOADU_N((p), (n))
#define FA_KV_SCALAR(x) (x)
#endif

static inline int64_t FA_NAME(fa_round_up)(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

#ifndef FA_DOT_PREFETCH
#define FA_DOT_PREFETCH 16 /* key rows ahead */
#endif
#ifndef FA_DOT_ROWS
#define FA_DOT_ROWS 8 /* blocks of up to this many rows take fa_qk_keys for QK^T */
#endif

/* The scratch of one thread, carved from one allocation into FA_ALIGN-aligned
 * pieces (brp = the block's query rows, a multiple of FA_VL; dvp = Dv rounded up
 * to FA_VL; bc = keys per block):
 *   qt      D  x brp   Q block, transposed, times scale (or scale/softcap)
 *   kt      dp x FA_VL a group of keys transposed (fa_qk_keys; dp = D rounded up
 *                      to FA_VL)
 *   s       bc x brp   logits of one key block, then its probabilities (key-major:
 *                      key j of query row i at s[j * brp + i]; for blocks of at
 *                      most FA_DOT_ROWS rows, row-major s[i * bcp + j] when no
 *                      logit step applies, bcp = bc rounded up to FA_VL)
 *   s2      bc x brp   the logits again, for a V tile with a NaN or inf in it
 *   o       brp x dvp  running unnormalized output, row-major
 *   o2      rows x dvp the same rows before the last P.V, for blocks of at most
 *                      FA_DOT_ROWS rows (restored if that P.V met an inf or NaN)
 *   m l alpha          brp each: running max, running sum, last rescale factor
 *   rlo rhi            brp each: a row's visible keys relative to the tile
 *   slope apos         brp each: ALiBi slope and aligned position of a row
 *   lo hi              brp int64: a row's visible key range [lo, hi]
 *   bt      bc x brp   bias tile, transposed (with a bias only)
 *   mt      bc x brp   mask tile as bytes, transposed (with a mask only)
 *   mrow brow orow     brp pointers: a row's mask, bias and output rows */
typedef struct FA_NAME(fa_scratch) {
    FA_T *qt, *kt, *s, *s2, *o, *m, *l, *alpha, *rlo, *rhi, *slope, *apos, *bt;
    FA_T *u; /* return_stats: sum_j p_j (s_j - m), rescaled with l; NULL otherwise */
    /* the running merge of a row's key chunks (fa_merge_step): out, M, tot, and for
     * return_stats the entropy sum G and the largest logit X */
    FA_T *mo, *mM, *mtot, *mG, *mX;
    int64_t *lo, *hi;
    int mask_state, need_range; /* of the current key tile (fa_scores) */
    int key_major;              /* the tile's logits are s[r * bcp + j] (fa_scores) */
    int query_major;            /* never key-major (the backward's tiles) */
    int64_t bcp;                /* bc rounded up to FA_VL */
    FA_T *o2;
    uint8_t *mt;
    const uint8_t **mrow;
    const FA_T **brow;
    void **orow; /* FA_T, or float16 bits for a float16 output */
} FA_NAME(fa_scratch);

static inline void *FA_NAME(fa_carve)(char **cur, size_t bytes)
{
    void *piece = *cur;
    *cur += (bytes + FA_ALIGN - 1) / FA_ALIGN * FA_ALIGN;
    return piece;
}

/* Carves `base` (or, with base NULL, only measures) and returns the bytes used. */
static size_t FA_NAME(fa_layout)(const fa_params *p, const fa_blocks *bl, void *base,
                                 FA_NAME(fa_scratch) *sc)
{
    const size_t brp = (size_t)bl->q, bc = (size_t)bl->k, t = sizeof(FA_T);
    const size_t dvp = (size_t)FA_NAME(fa_round_up)(p->Dv, FA_VL);
    FA_NAME(fa_scratch) dummy;
    if (!sc) sc = &dummy;
    char *cur = base ? (char *)base : (char *)0 + FA_ALIGN;
    char *first = cur;
    sc->qt = (FA_T *)FA_NAME(fa_carve)(&cur, (size_t)p->D * brp * t);
    sc->kt = (FA_T *)FA_NAME(fa_carve)(&cur, (size_t)FA_NAME(fa_round_up)(p->D, FA_VL) * FA_VL * t);
    sc->bcp = FA_NAME(fa_round_up)((int64_t)bc, FA_VL);
    sc->query_major = 0;
    {
        const size_t km = (size_t)FA_DOT_ROWS * (size_t)sc->bcp; /* key-major use */
        sc->s = (FA_T *)FA_NAME(fa_carve)(&cur, (bc * brp > km ? bc * brp : km) * t);
    }
    sc->s2 = (FA_T *)FA_NAME(fa_carve)(&cur, bc * brp * t);
    sc->o = (FA_T *)FA_NAME(fa_carve)(&cur, brp * dvp * t);
    sc->m = (FA_T *)FA_NAME(fa_carve)(&cur, brp * t);
    sc->l = (FA_T *)FA_NAME(fa_carve)(&cur, brp * t);
    sc->alpha = (FA_T *)FA_NAME(fa_carve)(&cur, brp * t);
    sc->u = p->entropy ? (FA_T *)FA_NAME(fa_carve)(&cur, brp * t) : NULL;
    sc->mo = (FA_T *)FA_NAME(fa_carve)(&cur, brp * dvp * t);
    sc->mM = (FA_T *)FA_NAME(fa_carve)(&cur, brp * t);
    sc->mtot = (FA_T *)FA_NAME(fa_carve)(&cur, brp * t);
    sc->mG = (FA_T *)FA_NAME(fa_carve)(&cur, brp * t);
    sc->mX = (FA_T *)FA_NAME(fa_carve)(&cur, brp * t);
    sc->rlo = (FA_T *)FA_NAME(fa_carve)(&cur, brp * t);
    sc->rhi = (FA_T *)FA_NAME(fa_carve)(&cur, brp * t);
    sc->slope = (FA_T *)FA_NAME(fa_carve)(&cur, brp * t);
    sc->apos = (FA_T *)FA_NAME(fa_carve)(&cur, brp * t);
    sc->lo = (int64_t *)FA_NAME(fa_carve)(&cur, brp * sizeof(int64_t));
    sc->hi = (int64_t *)FA_NAME(fa_carve)(&cur, brp * sizeof(int64_t));
    sc->bt = p->bias ? (FA_T *)FA_NAME(fa_carve)(&cur, bc * brp * t) : NULL;
    sc->mt = p->mask ? (uint8_t *)FA_NAME(fa_carve)(&cur, bc * brp) : NULL;
    sc->mrow = (const uint8_t **)FA_NAME(fa_carve)(&cur, brp * sizeof(void *));
    sc->brow = (const FA_T **)FA_NAME(fa_carve)(&cur, brp * sizeof(void *));
    sc->orow = (void **)FA_NAME(fa_carve)(&cur, brp * sizeof(void *));
    sc->o2 = (FA_T *)FA_NAME(fa_carve)(&cur, (size_t)FA_DOT_ROWS * dvp * t);
    return (size_t)(cur - first);
}

static size_t FA_NAME(fa_scratch_bytes)(const fa_params *p, const fa_blocks *bl)
{
    return FA_NAME(fa_layout)(p, bl, NULL, NULL);
}

/* S^T tile: s[j][c*VL ...] = sum_d k[j][d] * qt[d][c*VL ...] for R keys and NV query
 * vectors, accumulators in registers (R and NV are constants after inlining). */
FA_ALWAYS_INLINE void FA_NAME(fa_qk_micro)(const int R, const int NV, const FA_T *FA_RESTRICT qt,
                                           const FA_KV *FA_RESTRICT k, int64_t k_sl, int64_t D,
                                           FA_T *FA_RESTRICT s, int64_t brp)
{
    FA_V acc[FA_QK_R][FA_QK_NV];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NV; c++) acc[r][c] = FA_VZERO();
    for (int64_t d = 0; d < D; d++) {
        FA_V qv[FA_QK_NV];
        for (int c = 0; c < NV; c++) qv[c] = FA_VLOAD(qt + d * brp + c * FA_VL);
        for (int r = 0; r < R; r++) {
            FA_V kb = FA_KV_BCAST(k + r * k_sl + d);
            for (int c = 0; c < NV; c++) acc[r][c] = FA_VFMA(kb, qv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NV; c++) FA_VSTORE(s + r * brp + c * FA_VL, acc[r][c]);
}

#define FA_QK_CASE(R, NV)                                                                   \
    case (R) * 8 + (NV):                                                                    \
        if ((R) <= FA_QK_R && (NV) <= FA_QK_NV)                                             \
            FA_NAME(fa_qk_micro)(R, NV, qt + cv * FA_VL, kj, k_sl, D, sj, brp);                  \
        break;

/* The logits of nk keys (rows of k) against the packed query block (nv vectors). */
static void FA_NAME(fa_qk_tile)(const FA_T *FA_RESTRICT qt, int nv, const FA_KV *FA_RESTRICT k,
                                int64_t k_sl, int64_t nk, int64_t D, FA_T *FA_RESTRICT s,
                                int64_t brp)
{
    /* Query-vector groups outer: their slice of qt (D x FA_QK_NV vectors) stays in L1
     * while the key tile streams past it. */
    for (int cv = 0; cv < nv; cv += FA_QK_NV) {
        int ncv = nv - cv < FA_QK_NV ? nv - cv : FA_QK_NV;
        for (int64_t j = 0; j < nk; j += FA_QK_R) {
            int r = (int)(nk - j < FA_QK_R ? nk - j : FA_QK_R);
            const FA_KV *kj = k + j * k_sl;
            FA_T *sj = s + j * brp + cv * FA_VL;
            switch (r * 8 + ncv) {
                FA_TILE_ROWS(FA_QK_CASE)
                default: break;
            }
        }
    }
}
#undef FA_QK_CASE

/* The logits of a block of at most FA_DOT_ROWS rows (decoding: one position, or a
 * GQA group's heads at one position) with the keys on the lanes: each group of
 * FA_VL keys is transposed (kt[d][lane] = k[j0 + lane][d]) and s[j][r] accumulates
 * k[j][d] * qt[d][r] over d in order, starting from 0 -- exactly the chain of
 * fa_qk_micro, so a logit has the same bits whether its row was decoded or part of
 * a prefill block (fa_qk_tile on few rows would leave most lanes empty: 4-5x
 * slower decoding, measured).  The K stream is the cost here: rows a few groups
 * ahead are prefetched. */
/* R rows (a constant after inlining) of one transposed key group: lane i of acc[r]
 * accumulates kt[d][i] * qt[d][r] over d in order; each kt vector is loaded once
 * for all the rows. */
FA_ALWAYS_INLINE void FA_NAME(fa_qk_keys_micro)(const int R, const FA_T *FA_RESTRICT qt, int64_t brp,
                                                const FA_T *FA_RESTRICT kt, int64_t D,
                                                FA_T *FA_RESTRICT s, int64_t nj, int64_t ks,
                                                int64_t rs)
{
    FA_V acc[FA_DOT_ROWS];
    for (int r = 0; r < R; r++) acc[r] = FA_VZERO();
    for (int64_t d = 0; d < D; d++) {
        const FA_V kv = FA_VLOAD(kt + d * FA_VL);
        for (int r = 0; r < R; r++) acc[r] = FA_VFMA(kv, FA_VSET1(qt[d * brp + r]), acc[r]);
    }
    for (int r = 0; r < R; r++) {
        if (ks == 1 && nj == FA_VL) { /* key-major: the lanes are the row's next keys */
            FA_VSTOREU(s + r * rs, acc[r]);
            continue;
        }
        FA_T lanes[FA_VL];
        FA_VSTOREU(lanes, acc[r]);
        for (int64_t i = 0; i < nj; i++) s[i * ks + r * rs] = lanes[i];
    }
}

/* ... logit (row r, key j) stored at s[j * ks + r * rs]: query-major (ks = brp, rs =
 * 1) or key-major (ks = 1, rs = the row stride). */
static void FA_NAME(fa_qk_keys)(const FA_T *FA_RESTRICT qt, int64_t brp, int64_t nr,
                                const FA_KV *FA_RESTRICT k, int64_t k_sl, int64_t nk, int64_t D,
                                FA_T *FA_RESTRICT s, FA_T *FA_RESTRICT kt, int64_t ks, int64_t rs)
{
    for (int64_t j0 = 0; j0 < nk; j0 += FA_VL) {
        const int64_t nj = nk - j0 < FA_VL ? nk - j0 : FA_VL;
        for (int64_t i = 0; i < nj; i++)
            for (int64_t c = 0; c < D; c += 64 / (int64_t)sizeof(FA_KV))
                __builtin_prefetch((const void *)(k + (j0 + i + FA_DOT_PREFETCH) * k_sl + c));
#ifdef FA_HAVE_TRANSPOSE
        for (int64_t d0 = 0; d0 < D; d0 += FA_VL) {
            const int nd = (int)(D - d0 < FA_VL ? D - d0 : FA_VL);
            const FA_T *rows[FA_VL];
#ifndef FA_KV_HALF
            if (nj == FA_VL && nd == FA_VL) { /* whole float rows: transposed in place */
                for (int64_t i = 0; i < FA_VL; i++) rows[i] = k + (j0 + i) * k_sl;
                FA_VTRANSPOSE(rows, d0, kt + d0 * FA_VL, FA_VL);
                continue;
            }
#endif
            FA_T tmp[FA_VL * FA_VL];
            for (int64_t i = 0; i < FA_VL; i++) {
                const FA_KV *kr = k + (j0 + i) * k_sl + d0;
                const FA_V x = i >= nj ? FA_VZERO() : nd == FA_VL ? FA_KV_LOADU(kr) : FA_KV_LOADU_N(kr, nd);
                FA_VSTOREU(tmp + i * FA_VL, x);
                rows[i] = tmp + i * FA_VL;
            }
            FA_VTRANSPOSE(rows, 0, kt + d0 * FA_VL, FA_VL);
        }
#else
        for (int64_t d = 0; d < D; d++)
            for (int64_t i = 0; i < FA_VL; i++)
                kt[d * FA_VL + i] = i < nj ? (FA_T)FA_KV_SCALAR(k[(j0 + i) * k_sl + d]) : (FA_T)0;
#endif
        FA_T *sj = s + j0 * ks;
        switch (nr) {
#define FA_KEYS_CASE(R) \
    case R: FA_NAME(fa_qk_keys_micro)(R, qt, brp, kt, D, sj, nj, ks, rs); break;
            FA_KEYS_CASE(1) FA_KEYS_CASE(2) FA_KEYS_CASE(3) FA_KEYS_CASE(4)
            FA_KEYS_CASE(5) FA_KEYS_CASE(6) FA_KEYS_CASE(7) FA_KEYS_CASE(8)
#undef FA_KEYS_CASE
            default: break;
        }
    }
}

/* Online-softmax step for one key block, vectorized over queries: new running max,
 * probabilities p = exp(s - m) written over s, running sum l rescaled by
 * alpha = exp(m_old - m_new) and increased by the block's row sums (exp fused with
 * the sum).  Rows that have seen no visible key keep m = -inf; they use 0 in place
 * of m so that exp(-inf - 0) = 0 and never exp(-inf + inf) = NaN.  Query vectors
 * c0 .. c1-1; colmax, if not NULL, holds their maxima over the block's keys. */
/* With u (return_stats): also u = sum_j e^(s_j - m) (s_j - m), the row's centred
 * logit sum, rescaled when m grows: u' = alpha (u + (m_old - m_new) l), so that
 * the entropy is log l - u / l at the end without the cancellation of lse - E[s].
 * Hidden keys (s = -inf, e = 0) and a row still at m = -inf add 0. */
static void FA_NAME(fa_softmax_tile_u)(FA_T *FA_RESTRICT s, int64_t nk, int c0, int c1,
                                       FA_T *FA_RESTRICT m, FA_T *FA_RESTRICT l,
                                       FA_T *FA_RESTRICT alpha, int64_t brp,
                                       const FA_V *FA_RESTRICT colmax, FA_T *FA_RESTRICT u)
{
    for (int c = c0; c < c1; c++) {
        FA_T *sc = s + c * FA_VL;
        const FA_V m_old = FA_VLOAD(m + c * FA_VL);
        FA_V m_new = m_old;
        if (colmax)
            m_new = FA_VMAX(m_new, colmax[c - c0]);
        else
            for (int64_t j = 0; j < nk; j++) m_new = FA_VMAX(m_new, FA_VLOAD(sc + j * brp));
        const FA_V m_use = FA_VNEGINF_TO_ZERO(m_new);
        const FA_V a = FA_VEXP(FA_VSUB(m_old, m_use));
        /* the row sums pair up exactly as in fa_softmax_tile: the output and lse of
         * a call do not change when the statistics are asked for */
        FA_V sum0 = FA_VZERO(), sum1 = FA_VZERO(), us = FA_VZERO();
        for (int64_t j = 0; j < nk; j++) {
            const FA_V x = FA_VSUB(FA_VLOAD(sc + j * brp), m_use);
            const FA_V e = FA_VEXP(x);
            FA_VSTORE(sc + j * brp, e);
            if (j & 1)
                sum1 = FA_VADD(sum1, e);
            else
                sum0 = FA_VADD(sum0, e);
            us = FA_VFMA(e, FA_VNEGINF_TO_ZERO(x), us);
        }
        const FA_V sum = FA_VADD(sum0, sum1);
        const FA_V l_old = FA_VLOAD(l + c * FA_VL);
        const FA_V shift = FA_VMUL(FA_VNEGINF_TO_ZERO(FA_VSUB(m_old, m_use)), l_old);
        FA_VSTORE(u + c * FA_VL, FA_VFMA(a, FA_VADD(FA_VLOAD(u + c * FA_VL), shift), us));
        FA_VSTORE(l + c * FA_VL, FA_VFMA(l_old, a, sum));
        FA_VSTORE(m + c * FA_VL, m_new);
        FA_VSTORE(alpha + c * FA_VL, a);
    }
}

static void FA_NAME(fa_softmax_tile)(FA_T *FA_RESTRICT s, int64_t nk, int c0, int c1,
                                     FA_T *FA_RESTRICT m, FA_T *FA_RESTRICT l,
                                     FA_T *FA_RESTRICT alpha, int64_t brp,
                                     const FA_V *FA_RESTRICT colmax, FA_T *FA_RESTRICT u)
{
    if (u) {
        FA_NAME(fa_softmax_tile_u)(s, nk, c0, c1, m, l, alpha, brp, colmax, u);
        return;
    }
    for (int c = c0; c < c1; c++) {
        FA_T *sc = s + c * FA_VL;
        FA_V m_old = FA_VLOAD(m + c * FA_VL);
        FA_V m_new = m_old;
        if (colmax) /* the tile's max, found by fa_logit_tile */
            m_new = FA_VMAX(m_new, colmax[c - c0]);
        else
            for (int64_t j = 0; j < nk; j++) m_new = FA_VMAX(m_new, FA_VLOAD(sc + j * brp));
        FA_V m_use = FA_VNEGINF_TO_ZERO(m_new);
        FA_V a = FA_VEXP(FA_VSUB(m_old, m_use));
        FA_V sum0 = FA_VZERO(), sum1 = FA_VZERO();
        int64_t j = 0;
        for (; j + 1 < nk; j += 2) {
            FA_V e0 = FA_VEXP(FA_VSUB(FA_VLOAD(sc + j * brp), m_use));
            FA_V e1 = FA_VEXP(FA_VSUB(FA_VLOAD(sc + (j + 1) * brp), m_use));
            FA_VSTORE(sc + j * brp, e0);
            FA_VSTORE(sc + (j + 1) * brp, e1);
            sum0 = FA_VADD(sum0, e0);
            sum1 = FA_VADD(sum1, e1);
        }
        if (j < nk) {
            FA_V e0 = FA_VEXP(FA_VSUB(FA_VLOAD(sc + j * brp), m_use));
            FA_VSTORE(sc + j * brp, e0);
            sum0 = FA_VADD(sum0, e0);
        }
        FA_VSTORE(l + c * FA_VL, FA_VFMA(FA_VLOAD(l + c * FA_VL), a, FA_VADD(sum0, sum1)));
        FA_VSTORE(m + c * FA_VL, m_new);
        FA_VSTORE(alpha + c * FA_VL, a);
    }
}

/* fa_softmax_tile for one row whose logits are contiguous, s[j] (s has room for nk
 * rounded up to FA_VL), with vectors over keys, so the exp of FA_VL keys costs one
 * vector exp, not FA_VL exps of which one lane is used (decoding).  The same bits
 * as fa_softmax_tile gives the row in a query-major tile: the same max, the same
 * exp of each logit (lane-wise), the even and odd keys' sums added one by one in
 * key order, and alpha and the new sum by the same vector operations. */
static void FA_NAME(fa_softmax_row)(FA_T *FA_RESTRICT s, int64_t nk, FA_T *FA_RESTRICT m,
                                    FA_T *FA_RESTRICT l, FA_T *FA_RESTRICT alpha)
{
    const int64_t nkv = FA_NAME(fa_round_up)(nk, FA_VL);
    for (int64_t j = nk; j < nkv; j++) s[j] = -(FA_T)INFINITY; /* padding: p = 0 */
    FA_V mx = FA_VLOAD(s);
    for (int64_t j = FA_VL; j < nkv; j += FA_VL) mx = FA_VMAX(mx, FA_VLOAD(s + j));
    FA_T lanes[FA_VL], m_new = m[0];
    FA_VSTOREU(lanes, mx);
    for (int i = 0; i < FA_VL; i++)
        if (lanes[i] > m_new || lanes[i] != lanes[i]) m_new = lanes[i];
    const FA_T m_use = m_new == -(FA_T)INFINITY ? (FA_T)0 : m_new;
    const FA_V mu = FA_VSET1(m_use);
    for (int64_t j = 0; j < nkv; j += FA_VL) FA_VSTORE(s + j, FA_VEXP(FA_VSUB(FA_VLOAD(s + j), mu)));
    FA_T sum0 = 0, sum1 = 0;
    int64_t j = 0;
    for (; j + 1 < nk; j += 2) {
        sum0 += s[j];
        sum1 += s[j + 1];
    }
    if (j < nk) sum0 += s[j];
    const FA_V a = FA_VEXP(FA_VSUB(FA_VSET1(m[0]), mu));
    FA_VSTOREU(lanes, FA_VFMA(FA_VSET1(l[0]), a, FA_VSET1(sum0 + sum1)));
    l[0] = lanes[0];
    FA_VSTOREU(lanes, a);
    alpha[0] = lanes[0];
    m[0] = m_new;
}

/* o[i][c0 ...] = alpha[i] * o[i][c0 ...] + sum_j p[j][i] * v[j][c0 ...] for R query
 * rows and NC value vectors (the last one `tail` lanes wide when tail > 0), with
 * p[j][i] at p[j * ks + i * rs] (ks = brp, rs = 1 query-major; ks = 1 key-major).
 * The rescale is skipped when no row's max changed (alpha == 1 for all R rows). */
FA_ALWAYS_INLINE void FA_NAME(fa_pv_micro)(const int R, const int NC, const FA_T *FA_RESTRICT p,
                                           const FA_KV *FA_RESTRICT v, int64_t v_sl, int64_t nk,
                                           int tail, FA_T *FA_RESTRICT o, int64_t dvp,
                                           const FA_T *FA_RESTRICT alpha, int64_t ks, int64_t rs)
{
    FA_V acc[FA_PV_R][2 * FA_PV_NC];
    int rescale = 0;
    for (int r = 0; r < R; r++) rescale |= alpha[r] != (FA_T)1;
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = FA_VLOAD(o + r * dvp + c * FA_VL);
    if (rescale)
        for (int r = 0; r < R; r++) {
            FA_V a = FA_VSET1(alpha[r]);
            for (int c = 0; c < NC; c++) acc[r][c] = FA_VMUL(acc[r][c], a);
        }
    if (tail == 0) {
        for (int64_t j = 0; j < nk; j++) {
            FA_V vv[2 * FA_PV_NC];
            for (int c = 0; c < NC; c++) vv[c] = FA_KV_LOADU(v + j * v_sl + c * FA_VL);
            for (int r = 0; r < R; r++) {
                FA_V pb = FA_VSET1(p[j * ks + r * rs]);
                for (int c = 0; c < NC; c++) acc[r][c] = FA_VFMA(pb, vv[c], acc[r][c]);
            }
        }
    } else {
        for (int64_t j = 0; j < nk; j++) {
            FA_V vv[2 * FA_PV_NC];
            for (int c = 0; c < NC - 1; c++) vv[c] = FA_KV_LOADU(v + j * v_sl + c * FA_VL);
            vv[NC - 1] = FA_KV_LOADU_N(v + j * v_sl + (NC - 1) * FA_VL, tail);
            for (int r = 0; r < R; r++) {
                FA_V pb = FA_VSET1(p[j * ks + r * rs]);
                for (int c = 0; c < NC; c++) acc[r][c] = FA_VFMA(pb, vv[c], acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++) FA_VSTORE(o + r * dvp + c * FA_VL, acc[r][c]);
}

#define FA_PV_CASE(R, NC)                                                                     \
    case (R) * 16 + (NC):                                                                     \
        if ((R) <= FA_PV_R && ((NC) <= FA_PV_NC || ((R) <= 2 && (NC) <= 2 * FA_PV_NC)))      \
            FA_NAME(fa_pv_micro)(R, NC, p + i * rs, vc, v_sl, nk, tail, o + i * dvp + c0, dvp, alpha + i, ks, rs); \
        break;

/* Rescale the running output of nq rows and add this key block's P.V.  Blocks of
 * one or two rows (decoding) take twice as many value vectors per pass, since
 * their accumulators leave registers free: fewer passes over the V tile. */
FA_ALWAYS_INLINE void FA_NAME(fa_pv_tile_strided)(const FA_T *FA_RESTRICT p, int64_t nq, int64_t nk,
                                                  const FA_KV *FA_RESTRICT v, int64_t v_sl,
                                                  int64_t Dv, FA_T *FA_RESTRICT o, int64_t dvp,
                                                  const FA_T *FA_RESTRICT alpha, int64_t ks,
                                                  int64_t rs)
{
    const int64_t chunk = (int64_t)(nq <= 2 ? 2 * FA_PV_NC : FA_PV_NC) * FA_VL;
    /* Value columns outer, query rows inner: one column chunk of the V tile stays in
     * L1 while every row group of the block streams it. */
    for (int64_t c0 = 0; c0 < Dv; c0 += chunk) {
        int64_t w = Dv - c0 < chunk ? Dv - c0 : chunk;
        int nc = (int)((w + FA_VL - 1) / FA_VL);
        int tail = (int)(w % FA_VL);
        const FA_KV *vc = v + c0;
        for (int64_t i = 0; i < nq; i += FA_PV_R) {
            int r = (int)(nq - i < FA_PV_R ? nq - i : FA_PV_R);
            switch (r * 16 + nc) {
                FA_TILE_ROWS(FA_PV_CASE)
                FA_PV_CASE(1, 5) FA_PV_CASE(1, 6) FA_PV_CASE(1, 7) FA_PV_CASE(1, 8)
                FA_PV_CASE(2, 5) FA_PV_CASE(2, 6) FA_PV_CASE(2, 7) FA_PV_CASE(2, 8)
                default: break;
            }
        }
    }
}
#undef FA_PV_CASE

/* Query-major probabilities, p[j][i] at p[j * brp + i]: the row offsets are
 * constants in the unrolled code (a run-time row stride made prefill 3-10% slower). */
static void FA_NAME(fa_pv_tile)(const FA_T *FA_RESTRICT p, int64_t nq, int64_t nk,
                                const FA_KV *FA_RESTRICT v, int64_t v_sl, int64_t Dv,
                                FA_T *FA_RESTRICT o, int64_t dvp, const FA_T *FA_RESTRICT alpha,
                                int64_t brp)
{
    FA_NAME(fa_pv_tile_strided)(p, nq, nk, v, v_sl, Dv, o, dvp, alpha, brp, 1);
}

/* Key-major probabilities of a few rows (decoding), row i at p + i * rs. */
static void FA_NAME(fa_pv_tile_rows)(const FA_T *FA_RESTRICT p, int64_t nq, int64_t nk,
                                     const FA_KV *FA_RESTRICT v, int64_t v_sl, int64_t Dv,
                                     FA_T *FA_RESTRICT o, int64_t dvp,
                                     const FA_T *FA_RESTRICT alpha, int64_t rs)
{
    FA_NAME(fa_pv_tile_strided)(p, nq, nk, v, v_sl, Dv, o, dvp, alpha, 1, rs);
}

/* Per-row set-up of a block: row r is query position i = q0 + r % nq of head
 * h = h0 + r / nq.  Packs Q transposed and scaled (for the tile path, padded lanes
 * zero, so padded rows give finite logits that are never stored) and fills each
 * row's visible key range, ALiBi slope and position, and its mask, bias and output
 * row pointers. */
static void FA_NAME(fa_setup_rows)(const fa_params *p, const fa_item *it, int64_t nr,
                                   int64_t nvl, int64_t brp, int64_t bc, FA_NAME(fa_scratch) *sc)
{
    const int64_t D = p->D, Lq = it->Lq, Lk = it->Lk;
    const FA_T qscale = (FA_T)(p->softcap > 0 ? p->scale / p->softcap : p->scale);
    const int64_t diag = p->causal == FA_CAUSAL_TOP_LEFT ? 0 : Lk - Lq;
    const int64_t left = p->window_left, right = p->window_right;
    const int causal = p->causal != FA_CAUSAL_NONE;
    for (int64_t r = nr; r < nvl; r++) {
        for (int64_t d = 0; d < D; d++) sc->qt[d * brp + r] = (FA_T)0;
        sc->lo[r] = 0;
        sc->hi[r] = -1;
        sc->slope[r] = sc->apos[r] = (FA_T)0;
        if (sc->mt)
            for (int64_t j = 0; j < bc; j++) sc->mt[j * brp + r] = 0;
        if (sc->bt)
            for (int64_t j = 0; j < bc; j++) sc->bt[j * brp + r] = (FA_T)0;
    }
    for (int64_t r = 0; r < nr; r++) {
        const int64_t h = it->h0 + r / it->nq, i = it->q0 + r % it->nq, row = it->qoff + i;
        const int64_t qoff = it->b * p->q_sb + h * p->q_sh + row * p->q_sl;
#ifdef FA_KV_HALF
        if (p->q_f16) {
            const uint16_t *qh = (const uint16_t *)p->q + qoff;
            for (int64_t d = 0; d < D; d++) sc->qt[d * brp + r] = qscale * (FA_T)FA_16_TO_FLOAT(qh[d]);
        } else
#endif
        {
            const FA_T *qi = (const FA_T *)p->q + qoff;
            for (int64_t d = 0; d < D; d++) sc->qt[d * brp + r] = qscale * qi[d];
        }
        const int64_t a = i + diag; /* the aligned diagonal of this row */
        int64_t lo = 0, hi = Lk - 1;
        if (left >= 0 && a - left > lo) lo = a - left;
        if (right >= 0 && a + right < hi) hi = a + right;
        if (causal && a < hi) hi = a;
        if (hi < lo) { /* sees no key: the empty range of the padded rows */
            lo = 0;
            hi = -1;
        }
        sc->lo[r] = lo;
        sc->hi[r] = hi;
        sc->slope[r] = p->alibi ? ((const FA_T *)p->alibi)[it->b * p->alibi_sb + h * p->alibi_sh]
                                : (FA_T)0;
        sc->apos[r] = (FA_T)(i + Lk - Lq); /* ALiBi distance is |apos - j| */
        if (p->mask) sc->mrow[r] = p->mask + it->b * p->mask_sb + h * p->mask_sh + row * p->mask_sq;
        if (p->bias)
            sc->brow[r] = (const FA_T *)p->bias + it->b * p->bias_sb + h * p->bias_sh + row * p->bias_sq;
        if (!p->weights) {
            const int64_t o = it->b * p->o_sb + h * p->o_sh + row * p->o_sl;
            sc->orow[r] = p->out_f16 ? (void *)((uint16_t *)p->out + o) : (void *)((FA_T *)p->out + o);
        }
    }
}

/* The mask of keys j0 .. j0+nk-1 for every row, transposed into bytes mt[jj][r] (1 =
 * visible).  Returns 0 if no key of the tile is visible to any row (the tile is
 * skipped), 1 if some are hidden, 2 if all are visible (nothing to apply).  Rows
 * whose keys are contiguous go 16 x 16 bytes at a time through SIMD transposes. */
static int FA_NAME(fa_mask_tile)(const fa_params *p, int64_t nr, int64_t j0, int64_t nk,
                                 int64_t brp, FA_NAME(fa_scratch) *sc)
{
    const int64_t sk = p->mask_sk;
    unsigned any = 0, all = 1;
    int64_t rdone = 0, kdone = 0;
#ifdef FA_HAVE_SSE2
    if (sk == 1 && nr >= 16 && nk >= 16) {
        __m128i any_v = _mm_setzero_si128(), all_v = _mm_set1_epi8(-1);
        rdone = nr / 16 * 16;
        kdone = nk / 16 * 16;
        for (int64_t r0 = 0; r0 < rdone; r0 += 16)
            for (int64_t k0 = 0; k0 < kdone; k0 += 16)
                fa_transpose_u8_16x16(sc->mrow + r0, j0 + k0, sc->mt + k0 * brp + r0, brp, &any_v,
                                      &all_v);
        any = _mm_movemask_epi8(_mm_cmpeq_epi8(any_v, _mm_setzero_si128())) != 0xFFFF;
        all = _mm_movemask_epi8(all_v) == 0xFFFF;
    }
#endif
    /* the rest, one byte at a time: rows past the last full block of 16 for every key,
     * and keys past the last full block for the rows done above */
    for (int64_t r = 0; r < nr; r++) {
        const uint8_t *row = sc->mrow[r] + j0 * sk;
        uint8_t *col = sc->mt + r;
        for (int64_t jj = r < rdone ? kdone : 0; jj < nk; jj++) {
            uint8_t bit = row[jj * sk] != 0;
            col[jj * brp] = bit;
            any |= bit;
            all &= bit;
        }
    }
    return any ? (all ? 2 : 1) : 0;
}

/* bt[jj][r] = bias(row r, key j0 + jj) for rows r0 .. r1-1.  Rows whose keys are
 * contiguous go FA_VL x FA_VL at a time through register transposes; the rest one
 * element at a time. */
static void FA_NAME(fa_bias_tile)(const fa_params *p, int64_t r0, int64_t r1, int64_t j0,
                                  int64_t nk, int64_t brp, FA_NAME(fa_scratch) *sc)
{
    const int64_t sk = p->bias_sk;
    int64_t rdone = r0, kdone = 0;
#ifdef FA_HAVE_TRANSPOSE
    if (sk == 1) {
        rdone = r0 + (r1 - r0) / FA_VL * FA_VL;
        kdone = nk / FA_VL * FA_VL;
        for (int64_t rb = r0; rb < rdone; rb += FA_VL)
            for (int64_t k0 = 0; k0 < kdone; k0 += FA_VL)
                FA_VTRANSPOSE(sc->brow + rb, j0 + k0, sc->bt + k0 * brp + rb, brp);
    }
#endif
    for (int64_t r = r0; r < r1; r++) {
        const FA_T *row = sc->brow[r] + j0 * sk;
        FA_T *col = sc->bt + r;
        for (int64_t jj = r < rdone ? kdone : 0; jj < nk; jj++) col[jj * brp] = row[jj * sk];
        /* Each row is a separate stream the hardware does not follow across rows:
         * fetch the next tile's piece of it now (prefetches never fault). */
        if (sk == 1)
            for (int64_t jj = 0; jj < nk; jj += 64 / (int64_t)sizeof(FA_T))
                __builtin_prefetch(row + nk + jj);
    }
}

/* Does some step of fa_logit_tile apply to the current tile? */
static inline int FA_NAME(fa_has_logit_steps)(const fa_params *p, const FA_NAME(fa_scratch) *sc)
{
    return p->softcap > 0 || p->alibi || p->bias || sc->mask_state == 1 || sc->need_range;
}

/* Steps 2-5 of the semantics on query vectors c0 .. c1-1 of a tile of logits, in
 * order: softcap, ALiBi, bias, mask, causal/window range (nr: the block's rows).
 * From fa_scores: sc->need_range (some row hides some key of the tile by
 * position) and sc->mask_state (fa_mask_tile's, or 2 without a mask).  Returns 0
 * if no step applies (s unchanged); otherwise 1, with each vector's max over the
 * tile's keys in colmax[c - c0] (NaN if any is NaN) unless colmax is NULL. */

static int FA_NAME(fa_logit_tile)(const fa_params *p, FA_T *FA_RESTRICT s, int64_t nk, int c0,
                                  int c1, int64_t nr, int64_t j0, int64_t brp,
                                  FA_NAME(fa_scratch) *sc, FA_V *FA_RESTRICT colmax)
{
    const int softcap = p->softcap > 0, alibi = p->alibi != NULL, bias = p->bias != NULL;
    const int mask = sc->mask_state == 1, need_range = sc->need_range;
    if (!FA_NAME(fa_has_logit_steps)(p, sc)) return 0;
    if (bias) {
        const int64_t r1 = (int64_t)c1 * FA_VL;
        FA_NAME(fa_bias_tile)(p, (int64_t)c0 * FA_VL, r1 < nr ? r1 : nr, j0, nk, brp, sc);
    }
    const FA_V cap = FA_VSET1((FA_T)p->softcap), one = FA_VSET1((FA_T)1),
               m2 = FA_VSET1((FA_T)-2);
    for (int c = c0; c < c1; c++) {
        const int64_t off = (int64_t)c * FA_VL;
        FA_V mx = FA_VSET1(-(FA_T)INFINITY);
        if (bias && !(softcap || alibi || mask || need_range)) { /* the common bias-only case */
            for (int64_t jj = 0; jj < nk; jj++) {
                FA_T *sp = s + jj * brp + off;
                const FA_V x = FA_VADD(FA_VLOAD(sp), FA_VLOAD(sc->bt + jj * brp + off));
                FA_VSTORE(sp, x);
                mx = FA_VMAX(mx, x);
            }
            if (colmax) colmax[c - c0] = mx;
            continue;
        }
        const FA_V slope = FA_VLOAD(sc->slope + off);
        const FA_V apos = FA_VSUB(FA_VLOAD(sc->apos + off), FA_VSET1((FA_T)j0));
        const FA_V rlo = FA_VLOAD(sc->rlo + off), rhi = FA_VLOAD(sc->rhi + off);
        for (int64_t jj = 0; jj < nk; jj++) {
            FA_T *sp = s + jj * brp + off;
            const FA_V jf = FA_VSET1((FA_T)jj);
            FA_V x = FA_VLOAD(sp);
            if (softcap) { /* c * tanh(y), y = s / c: tanh = sign(y) (1 - e) / (1 + e), e = exp(-2|y|) */
                FA_V e = FA_VEXP(FA_VMUL(m2, FA_VABS(x)));
                x = FA_VMUL(cap, FA_VCOPYSIGN(FA_VDIV(FA_VSUB(one, e), FA_VADD(one, e)), x));
            }
            if (alibi) x = FA_VSUB(x, FA_VMUL(slope, FA_VABS(FA_VSUB(apos, jf))));
            if (bias) x = FA_VADD(x, FA_VLOAD(sc->bt + jj * brp + off));
            if (mask) x = FA_VMASK_BYTES(x, sc->mt + jj * brp + off);
            if (need_range) x = FA_VIN_RANGE(x, jf, rlo, rhi);
            FA_VSTORE(sp, x);
            mx = FA_VMAX(mx, x);
        }
        if (colmax) colmax[c - c0] = mx;
    }
    return 1;
}

/* One key tile through step 1 (QK^T), and through steps 2-5 (fa_logit_tile) too if
 * `logits`; otherwise the caller applies fa_logit_tile column by column, while each
 * column is in L1 for its softmax.  Returns 0 if the mask hides the whole tile
 * (nothing was computed). */
static int FA_NAME(fa_scores)(const fa_params *p, const fa_item *it, int64_t nr, int nv,
                              int64_t j0, int64_t nk, int64_t lo_max, int64_t hi_min,
                              int64_t brp, FA_NAME(fa_scratch) *sc, int logits)
{
    const FA_KV *k = (const FA_KV *)p->k + it->b * p->k_sb + it->g * p->k_sh + it->koff * p->k_sl;
    sc->mask_state = p->mask ? FA_NAME(fa_mask_tile)(p, nr, j0, nk, brp, sc) : 2;
    if (sc->mask_state == 0) return 0;
    sc->need_range = lo_max > j0 || hi_min < j0 + nk - 1;
    /* A few rows (decoding) and no logit step on this tile: the logits are stored
     * key-major, row r at s + r * bcp, for fa_softmax_row (the same bits). */
    sc->key_major = nr <= FA_DOT_ROWS && !logits && !sc->query_major && !p->weights && !p->entropy &&
                    sc->mask_state == 2 && !sc->need_range && !(p->softcap > 0) && !p->alibi &&
                    !p->bias;
    if (nr <= FA_DOT_ROWS) /* a few rows (decoding): keys on the lanes, the same bits */
        FA_NAME(fa_qk_keys)(sc->qt, brp, nr, k + j0 * p->k_sl, p->k_sl, nk, p->D, sc->s, sc->kt,
                            sc->key_major ? 1 : brp, sc->key_major ? sc->bcp : 1);
    else
        FA_NAME(fa_qk_tile)(sc->qt, nv, k + j0 * p->k_sl, p->k_sl, nk, p->D, sc->s, brp);
    if (sc->need_range) {
        const int64_t nvl = (int64_t)nv * FA_VL;
        for (int64_t r = 0; r < nvl; r++) { /* exact small integers in FA_T */
            int64_t a = sc->lo[r] - j0, z = sc->hi[r] - j0;
            sc->rlo[r] = (FA_T)(a < -1 ? -1 : a > nk ? nk : a);
            sc->rhi[r] = (FA_T)(z < -1 ? -1 : z > nk ? nk : z);
        }
    }
    if (logits) FA_NAME(fa_logit_tile)(p, sc->s, nk, 0, nv, nr, j0, brp, sc, NULL);
    return 1;
}

/* Is every value of a V tile finite?  v * 0 is 0 for a finite v and NaN for an inf
 * or NaN, so the tile's sum of them is 0 exactly when all are finite. */
static int FA_NAME(fa_v_finite)(const FA_KV *FA_RESTRICT v, int64_t v_sl, int64_t nk, int64_t Dv)
{
    const FA_V zero = FA_VZERO();
    const int64_t full = Dv / FA_VL * FA_VL;
    FA_V acc0 = FA_VZERO(), acc1 = FA_VZERO(); /* two chains: the adds are not serialized */
    for (int64_t j = 0; j < nk; j++) {
        const FA_KV *vj = v + j * v_sl;
        int64_t c = 0;
        for (; c + 2 * FA_VL <= full; c += 2 * FA_VL) {
            acc0 = FA_VFMA(FA_KV_LOADU(vj + c), zero, acc0);
            acc1 = FA_VFMA(FA_KV_LOADU(vj + c + FA_VL), zero, acc1);
        }
        if (c < full) acc0 = FA_VFMA(FA_KV_LOADU(vj + c), zero, acc0);
        if (full < Dv) acc1 = FA_VFMA(FA_KV_LOADU_N(vj + full, (int)(Dv - full)), zero, acc1);
    }
    return FA_VREDUCE(FA_VADD(acc0, acc1)) == (FA_T)0;
}

/* Are the n (a multiple of FA_VL) values at x, FA_VL-aligned, all finite? */
static int FA_NAME(fa_all_finite)(const FA_T *FA_RESTRICT x, int64_t n)
{
    const FA_V zero = FA_VZERO();
    FA_V acc0 = FA_VZERO(), acc1 = FA_VZERO();
    int64_t i = 0;
    for (; i + 2 * FA_VL <= n; i += 2 * FA_VL) {
        acc0 = FA_VFMA(FA_VLOAD(x + i), zero, acc0);
        acc1 = FA_VFMA(FA_VLOAD(x + i + FA_VL), zero, acc1);
    }
    if (i < n) acc0 = FA_VFMA(FA_VLOAD(x + i), zero, acc0);
    return FA_VREDUCE(FA_VADD(acc0, acc1)) == (FA_T)0;
}

/* P.V for a tile whose V holds an inf or NaN.  A hidden key has p = 0, and 0 * inf
 * would put a NaN into rows that never see that value; so here only the visible
 * (row, key) pairs are added, visibility read from the tile's logits recomputed
 * into s2 (-inf = hidden).  Rare: the common path never comes here. */
static void FA_NAME(fa_pv_tile_nonfinite)(const fa_params *p, const fa_item *it, int64_t nr, int nv,
                                          int64_t j0, int64_t nk, int64_t lo_max, int64_t hi_min,
                                          int64_t brp, FA_NAME(fa_scratch) *sc, const FA_KV *v,
                                          int64_t dvp)
{
    FA_T *prob = sc->s;
    const int64_t pk = sc->key_major ? 1 : brp, pr = sc->key_major ? sc->bcp : 1;
    sc->s = sc->s2;
    FA_NAME(fa_scores)(p, it, nr, nv, j0, nk, lo_max, hi_min, brp, sc, 1);
    sc->s = prob;
    for (int64_t r = 0; r < nr; r++) {
        FA_T *o = sc->o + r * dvp;
        if (sc->alpha[r] != (FA_T)1)
            for (int64_t c = 0; c < p->Dv; c++) o[c] *= sc->alpha[r];
        for (int64_t jj = 0; jj < nk; jj++) {
            if (sc->s2[jj * brp + r] == -(FA_T)INFINITY) continue;
            const FA_T pj = prob[jj * pk + r * pr];
            const FA_KV *vr = v + jj * p->v_sl;
            for (int64_t c = 0; c < p->Dv; c++) o[c] += pj * (FA_T)FA_KV_SCALAR(vr[c]);
        }
    }
}

/* Dropout on a tile of probabilities: p[jj * ks + r * rs] of rows r < nr (row r is
 * head h0 + r / nq, position q0 + r % nq) and keys j0 + jj is kept and scaled by
 * 1 / (1 - dropout_p), or set to 0. */
static void FA_NAME(fa_dropout_apply)(const fa_params *p, const fa_item *it, int64_t nr, int64_t j0,
                                      int64_t nk, FA_T *FA_RESTRICT s, int64_t ks, int64_t rs)
{
    const uint32_t thresh = fa_dropout_threshold(p->dropout_p);
    const FA_T inv = (FA_T)(1.0 / (1.0 - p->dropout_p));
    uint8_t keep[256];
    for (int64_t r = 0; r < nr; r++) {
        const int64_t h = it->h0 + r / it->nq, i = it->q0 + r % it->nq;
        for (int64_t c0 = 0; c0 < nk; c0 += 256) {
            const int64_t n = nk - c0 < 256 ? nk - c0 : 256;
            fa_dropout_row(p->seed, thresh, it->b, h, i, j0 + c0, n, keep, 1);
            for (int64_t jj = 0; jj < n; jj++) {
                FA_T *x = s + (c0 + jj) * ks + r * rs;
                *x = keep[jj] ? *x * inv : (FA_T)0;
            }
        }
    }
}

/* The end of a key chunk: each row's chunk result, normalized (out_c = o / l,
 * lse_c = m + log l, exactly what a split-KV decode item writes for that chunk), is
 * merged into the row's running merge; with return_stats the entropy too, by the
 * chain rule H = sum_c pi_c (h_c - log pi_c), kept relative to the running M. */
static void FA_NAME(fa_fold_chunk)(FA_NAME(fa_scratch) *sc, int64_t nr, int64_t Dv, int64_t dvp)
{
    for (int64_t r = 0; r < nr; r++) {
        const FA_T l = sc->l[r];
        FA_T *o = sc->o + r * dvp;
        if (l == (FA_T)0) continue; /* no visible key in this chunk: lse_c = -inf, skipped */
        const FA_T x = sc->m[r] + (FA_T)log((double)l);
        const FA_T inv = (FA_T)1 / l;
        for (int64_t c = 0; c < Dv; c++) o[c] *= inv;
        if (sc->u) {
            const FA_T hc = (FA_T)(log((double)l) - (double)sc->u[r] / (double)l);
            if (sc->mM[r] == -(FA_T)INFINITY) {
                sc->mG[r] = hc;
                sc->mX[r] = sc->m[r];
            } else {
                const FA_T M = sc->mM[r], mn = (x > M || x != x) ? x : M;
                const FA_T a = (FA_T)exp((double)(M - mn)), b = (FA_T)exp((double)(x - mn));
                sc->mG[r] = a * (sc->mG[r] + (mn - M) * sc->mtot[r]) + b * (hc - (x - mn));
                if (sc->m[r] > sc->mX[r]) sc->mX[r] = sc->m[r];
            }
        }
        fa_merge_step(&sc->mM[r], &sc->mtot[r], sc->mo + r * dvp, x, o, Dv);
    }
}

/* One work item: nr = nh * nq rows against the keys [kv0, kv1) of one kv head. */
static void FA_NAME(fa_qblock)(const fa_params *p, const fa_blocks *bl, const fa_item *it,
                               void *scratch)
{
    const int64_t brp = bl->q, bc = bl->k, Dv = p->Dv;
    const int64_t nr = it->nh * it->nq;
    const int nv = (int)((nr + FA_VL - 1) / FA_VL);
    const int64_t nvl = (int64_t)nv * FA_VL;
    const int64_t dvp = FA_NAME(fa_round_up)(Dv, FA_VL);
    FA_NAME(fa_scratch) sc;
    FA_NAME(fa_layout)(p, bl, scratch, &sc);
    FA_NAME(fa_setup_rows)(p, it, nr, nvl, brp, bc, &sc);
    const FA_KV *v = (const FA_KV *)p->v + it->b * p->v_sb + it->g * p->v_sh + it->koff * p->v_sl;

    int64_t lo_max = INT64_MIN, hi_min = INT64_MAX;
    for (int64_t r = 0; r < nr; r++) {
        if (sc.lo[r] > lo_max) lo_max = sc.lo[r];
        if (sc.hi[r] < hi_min) hi_min = sc.hi[r];
    }
    for (int64_t i = 0; i < nvl; i++) {
        sc.mM[i] = sc.mX[i] = -(FA_T)INFINITY;
        sc.mtot[i] = sc.mG[i] = (FA_T)0;
    }

    /* The visible keys in chunks of FA_CHUNK_KEYS from key 0, each by the online
     * softmax over its tiles (and P.V unless only the weights are wanted), then
     * merged into the running result.  Tiles start at multiples of bc from key 0
     * (not at this block's first visible key), so a row meets the same tiles and
     * chunks in every call it is part of. */
    const int64_t kv0 = it->kv0 / bc * bc;
    for (int64_t c0 = kv0 / FA_CHUNK_KEYS * FA_CHUNK_KEYS; c0 < it->kv1; c0 += FA_CHUNK_KEYS) {
        const int64_t lo = kv0 > c0 ? kv0 : c0, hi = it->kv1 - c0 < FA_CHUNK_KEYS ? it->kv1 : c0 + FA_CHUNK_KEYS;
        for (int64_t i = 0; i < nr * dvp; i++) sc.o[i] = (FA_T)0;
        for (int64_t i = 0; i < nvl; i++) {
            sc.m[i] = -(FA_T)INFINITY;
            sc.l[i] = (FA_T)0;
            if (sc.u) sc.u[i] = (FA_T)0;
        }
        for (int64_t j0 = lo; j0 < hi; j0 += bc) {
            const int64_t nk = hi - j0 < bc ? hi - j0 : bc;
#ifdef FA_KV_HALF
            /* float16 decoding: ask for this tile's V rows now, so that they arrive while
             * QK^T and the softmax run (measured: 3-7% faster; for float32 V, twice the
             * bytes, the same prefetches were 9% slower than the hardware's) */
            if (nr <= FA_DOT_ROWS)
                for (int64_t j = 0; j < nk; j++)
                    for (int64_t c = 0; c < Dv; c += 64 / (int64_t)sizeof(FA_KV))
                        __builtin_prefetch(v + (j0 + j) * p->v_sl + c);
#endif
            if (!FA_NAME(fa_scores)(p, it, nr, nv, j0, nk, lo_max, hi_min, brp, &sc, 0)) continue;
            if (sc.key_major)
                for (int64_t r = 0; r < nr; r++)
                    FA_NAME(fa_softmax_row)(sc.s + r * sc.bcp, nk, sc.m + r, sc.l + r, sc.alpha + r);
            else if (!FA_NAME(fa_has_logit_steps)(p, &sc))
                FA_NAME(fa_softmax_tile)(sc.s, nk, 0, nv, sc.m, sc.l, sc.alpha, brp, NULL, sc.u);
            else /* column by column, each column's logits in L1 for its softmax */
                for (int c = 0; c < nv; c++) {
                    FA_V colmax;
                    const int known = FA_NAME(fa_logit_tile)(p, sc.s, nk, c, c + 1, nr, j0, brp, &sc, &colmax);
                    FA_NAME(fa_softmax_tile)(sc.s, nk, c, c + 1, sc.m, sc.l, sc.alpha, brp,
                                             known ? &colmax : NULL, sc.u);
                }
            if (p->weights) continue;
            if (p->dropout_p > 0) /* after the softmax's sums: lse is that of the undropped weights */
                FA_NAME(fa_dropout_apply)(p, it, nr, j0, nk, sc.s, sc.key_major ? 1 : brp,
                                          sc.key_major ? sc.bcp : 1);
            const FA_KV *vt = v + j0 * p->v_sl;
            if (nr <= FA_DOT_ROWS) {
                /* Few rows: a check of V before P.V would cost as much as P.V itself.  So
                 * P.V runs first, and if the rows it produced are not all finite (an inf
                 * or NaN in V, or rows that were not finite already) they are restored
                 * and the tile goes through the careful path. */
                memcpy(sc.o2, sc.o, (size_t)(nr * dvp) * sizeof(FA_T));
                if (sc.key_major)
                    FA_NAME(fa_pv_tile_rows)(sc.s, nr, nk, vt, p->v_sl, Dv, sc.o, dvp, sc.alpha, sc.bcp);
                else
                    FA_NAME(fa_pv_tile)(sc.s, nr, nk, vt, p->v_sl, Dv, sc.o, dvp, sc.alpha, brp);
                if (!FA_NAME(fa_all_finite)(sc.o, nr * dvp)) {
                    memcpy(sc.o, sc.o2, (size_t)(nr * dvp) * sizeof(FA_T));
                    FA_NAME(fa_pv_tile_nonfinite)(p, it, nr, nv, j0, nk, lo_max, hi_min, brp, &sc, vt, dvp);
                }
            } else if (FA_NAME(fa_v_finite)(vt, p->v_sl, nk, Dv))
                FA_NAME(fa_pv_tile)(sc.s, nr, nk, vt, p->v_sl, Dv, sc.o, dvp, sc.alpha, brp);
            else
                FA_NAME(fa_pv_tile_nonfinite)(p, it, nr, nv, j0, nk, lo_max, hi_min, brp, &sc, vt, dvp);
        }
        FA_NAME(fa_fold_chunk)(&sc, nr, Dv, dvp);
    }

    /* The merged rows.  A row that saw no visible key gives 0 and lse -inf; a NaN
     * row keeps its NaN in both.  mM is left holding each row's lse. */
    for (int64_t r = 0; r < nr; r++) {
        const int64_t h = it->h0 + r / it->nq, row = it->qoff + it->q0 + r % it->nq;
        const int64_t lo_ = it->b * p->lse_sb + h * p->lse_sh + row * p->lse_sl;
        FA_T *acc = sc.mo + r * dvp;
        const FA_T tot = sc.mtot[r], lse_r = fa_merge_finish(sc.mM[r], tot, acc, Dv);
        if (p->lse) ((FA_T *)p->lse)[lo_] = lse_r;
        if (p->entropy) { /* H = G / tot + log tot; the largest weight exp(X - lse) */
            const int none = lse_r == -(FA_T)INFINITY;
            ((FA_T *)p->entropy)[lo_] = none ? (FA_T)0 : sc.mG[r] / tot + (FA_T)log((double)tot);
            ((FA_T *)p->max_weight)[lo_] = none ? (FA_T)0 : (FA_T)exp((double)(sc.mX[r] - lse_r));
        }
        sc.mM[r] = lse_r;
        if (p->weights) continue;
#ifdef FA_KV_HALF
        if (p->out_f16) {
            uint16_t *orow = (uint16_t *)sc.orow[r];
            for (int64_t c = 0; c < Dv; c++) orow[c] = FA_FLOAT_TO_16((float)acc[c]);
            continue;
        }
#endif
        memcpy(sc.orow[r], acc, (size_t)Dv * sizeof(FA_T));
    }
    if (!p->weights) return;

    /* attention_weights: a second pass recomputes each tile's logits with the same
     * code and writes exp(s - m) / l, transposed into the (Lq, Lk) rows; keys no
     * row can see are written as 0. */
    for (int64_t i = 0; i < nvl; i++) { /* weights = exp(s - lse) */
        const int none = i >= nr || sc.mM[i] == -(FA_T)INFINITY;
        sc.alpha[i] = none ? (FA_T)0 : (FA_T)1;
        sc.m[i] = none ? (FA_T)0 : sc.mM[i];
    }
    for (int64_t r = 0; r < nr; r++) {
        const int64_t h = it->h0 + r / it->nq, row = it->qoff + it->q0 + r % it->nq;
        sc.orow[r] = (FA_T *)p->weights + it->b * p->w_sb + h * p->w_sh + row * p->w_sq;
    }
    FA_T **wrow = (FA_T **)sc.orow;
    for (int64_t j0 = 0; j0 < it->Lk; j0 += bc) {
        const int64_t nk = it->Lk - j0 < bc ? it->Lk - j0 : bc;
        const int live = j0 + nk > it->kv0 && j0 < it->kv1 &&
                         FA_NAME(fa_scores)(p, it, nr, nv, j0, nk, lo_max, hi_min, brp, &sc, 1);
        if (!live) {
            for (int64_t r = 0; r < nr; r++)
                for (int64_t jj = 0; jj < nk; jj++) wrow[r][j0 + jj] = (FA_T)0;
            continue;
        }
        /* keys outside a row's range are -inf here already, so exp gives them 0 */
        for (int64_t c = 0; c < nv; c++) {
            const FA_V mv = FA_VLOAD(sc.m + c * FA_VL), inv = FA_VLOAD(sc.alpha + c * FA_VL);
            for (int64_t jj = 0; jj < nk; jj++) {
                FA_T *sp = sc.s + jj * brp + c * FA_VL;
                FA_VSTORE(sp, FA_VMUL(FA_VEXP(FA_VSUB(FA_VLOAD(sp), mv)), inv));
            }
        }
        if (p->dropout_p > 0) FA_NAME(fa_dropout_apply)(p, it, nr, j0, nk, sc.s, brp, 1);
        for (int64_t r = 0; r < nr; r++)
            for (int64_t jj = 0; jj < nk; jj++) wrow[r][j0 + jj] = sc.s[jj * brp + r];
    }
}

#ifndef FA_KV_HALF
/* y = exp(x) with this file's vector exp (the ULP test calls it through fa_exp_array). */
static void FA_NAME(fa_exp_array)(const void *xv, void *yv, int64_t n)
{
    const FA_T *x = (const FA_T *)xv;
    FA_T *y = (FA_T *)yv;
    int64_t i = 0;
    for (; i + FA_VL <= n; i += FA_VL) FA_VSTOREU(y + i, FA_VEXP(FA_VLOADU(x + i)));
    if (i < n) {
        FA_T tmp[FA_VL];
        FA_VSTOREU(tmp, FA_VEXP(FA_VLOADU_N(x + i, (int)(n - i))));
        for (int64_t t = 0; t < n - i; t++) y[i + t] = tmp[t];
    }
}
#endif

#ifndef FA_KV_HALF
/* ============================== the backward ==============================
 *
 * FlashAttention-2's backward over the same tiles as the forward: for a block of
 * query rows against a block of keys, recompute the logits S (the forward's own
 * code, every variant), P = exp(S - lse), dP = dO V^T, and
 *     dS = P * (dP * z - D_i) [* (1 - tanh^2) with softcap],  D_i = sum(dO_i * O_i),
 * z the dropout factor (0 or 1 / (1 - p)).  Then dV += (P z)^T dO, dK += dS^T Q
 * (pass 1, one item per key block) and dQ += dS K (pass 2, one item per query
 * block).  Every product reuses a forward micro-kernel: S and dP are fa_qk_tile
 * (query vectors on the lanes), the three accumulations are fa_pv_tile_strided
 * with the roles of rows and keys chosen by the strides.
 *
 * Determinism: each output row is one chain of fused multiply-adds over the
 * reduction index in ascending order (keys for dQ; item by item, row by row for
 * dK and dV), so neither the thread count nor the tiling of the other axis
 * changes a bit; S and dP are the forward's logits, the same bits for any block
 * (fa_qk_tile, or fa_qk_keys for a few rows, add the same products in the same
 * order). */

/* The scratch of the backward: the forward's (fa_layout), then
 *   dot  Dv x brp  dO block, transposed         don  brp x dvp  dO block, rows
 *   qr   brp x dkp Q block (unscaled), rows     dp   bc x brp   dP, then dS
 *   pz   bc x brp  P times the dropout factor (dropout only)
 *   sg   bc x brp  the softcap's derivative 1 - tanh^2 (softcap only)
 *   lsev dvec brp  each row's lse (+inf for a row that sees no key) and D_i
 *   ones           max(bc, brp) ones (the accumulations' "no rescale")
 *   qa   brp x dkp dQ accumulator of one key chunk, qs brp x dkp their running sum
 * (the dK and dV accumulators of a key range are the caller's). */
typedef struct FA_NAME(fa_bscratch) {
    FA_NAME(fa_scratch) f;
    FA_T *dot, *don, *qr, *dp, *pz, *sg, *lsev, *dvec, *ones, *qa, *qs;
    uint8_t *keep;
} FA_NAME(fa_bscratch);

static size_t FA_NAME(fa_blayout)(const fa_bwd_ctx *cx, void *base, FA_NAME(fa_bscratch) *sc)
{
    const fa_params *p = &cx->bp->f;
    const size_t brp = (size_t)cx->bl.q, bc = (size_t)cx->bl.k, t = sizeof(FA_T);
    const size_t dkp = (size_t)FA_NAME(fa_round_up)(p->D, FA_VL);
    const size_t dvp = (size_t)FA_NAME(fa_round_up)(p->Dv, FA_VL);
    FA_NAME(fa_bscratch) dummy;
    if (!sc) sc = &dummy;
    char *first = base ? (char *)base : (char *)0 + FA_ALIGN;
    char *cur = first + FA_NAME(fa_layout)(p, &cx->bl, base, &sc->f);
    sc->f.query_major = 1;
    sc->dot = (FA_T *)FA_NAME(fa_carve)(&cur, (size_t)p->Dv * brp * t);
    sc->don = (FA_T *)FA_NAME(fa_carve)(&cur, brp * dvp * t);
    sc->qr = (FA_T *)FA_NAME(fa_carve)(&cur, brp * dkp * t);
    sc->dp = (FA_T *)FA_NAME(fa_carve)(&cur, bc * brp * t);
    sc->pz = p->dropout_p > 0 ? (FA_T *)FA_NAME(fa_carve)(&cur, bc * brp * t) : NULL;
    sc->keep = p->dropout_p > 0 ? (uint8_t *)FA_NAME(fa_carve)(&cur, bc * brp) : NULL;
    sc->sg = p->softcap > 0 ? (FA_T *)FA_NAME(fa_carve)(&cur, bc * brp * t) : NULL;
    sc->lsev = (FA_T *)FA_NAME(fa_carve)(&cur, brp * t);
    sc->dvec = (FA_T *)FA_NAME(fa_carve)(&cur, brp * t);
    sc->ones = (FA_T *)FA_NAME(fa_carve)(&cur, (bc > brp ? bc : brp) * t);
    sc->qa = (FA_T *)FA_NAME(fa_carve)(&cur, brp * dkp * t);
    sc->qs = (FA_T *)FA_NAME(fa_carve)(&cur, brp * dkp * t);
    if (base)
        for (size_t i = 0; i < (bc > brp ? bc : brp); i++) sc->ones[i] = (FA_T)1;
    return (size_t)(cur - first);
}

static size_t FA_NAME(fa_bwd_scratch_bytes)(const fa_bwd_ctx *cx)
{
    return FA_NAME(fa_blayout)(cx, NULL, NULL);
}

/* The rows of item `it`: the forward's set-up (Q transposed and scaled, visible
 * ranges, mask and bias rows), then dO transposed and as rows, Q as rows, lse, D. */
static void FA_NAME(fa_bwd_rows)(const fa_bwd_ctx *cx, const fa_item *it, int64_t nr, int64_t nvl,
                                 FA_NAME(fa_bscratch) *sc, int64_t *lo_max, int64_t *hi_min)
{
    const fa_bwd_params *bp = cx->bp;
    const fa_params *p = &bp->f;
    const int64_t brp = cx->bl.q, D = p->D, Dv = p->Dv;
    const int64_t dkp = FA_NAME(fa_round_up)(D, FA_VL), dvp = FA_NAME(fa_round_up)(Dv, FA_VL);
    FA_NAME(fa_setup_rows)(p, it, nr, nvl, brp, cx->bl.k, &sc->f);
    for (int64_t r = nr; r < nvl; r++) {
        for (int64_t d = 0; d < Dv; d++) sc->dot[d * brp + r] = (FA_T)0;
        sc->lsev[r] = (FA_T)INFINITY; /* padded lanes: P = 0 */
        sc->dvec[r] = (FA_T)0;
    }
    *lo_max = INT64_MIN;
    *hi_min = INT64_MAX;
    for (int64_t r = 0; r < nr; r++) {
        const int64_t h = it->h0 + r / it->nq, row = it->qoff + it->q0 + r % it->nq;
        const FA_T *dor = (const FA_T *)bp->dout + it->b * bp->do_sb + h * bp->do_sh + row * bp->do_sl;
        const FA_T *qi = (const FA_T *)p->q + it->b * p->q_sb + h * p->q_sh + row * p->q_sl;
        for (int64_t d = 0; d < Dv; d++) sc->dot[d * brp + r] = dor[d];
        for (int64_t d = 0; d < dvp; d++) sc->don[r * dvp + d] = d < Dv ? dor[d] : (FA_T)0;
        for (int64_t d = 0; d < dkp; d++) sc->qr[r * dkp + d] = d < D ? qi[d] : (FA_T)0;
        const FA_T l = ((const FA_T *)p->lse)[it->b * p->lse_sb + h * p->lse_sh + row * p->lse_sl];
        sc->lsev[r] = l == -(FA_T)INFINITY ? (FA_T)INFINITY : l;
        sc->dvec[r] = ((const FA_T *)cx->delta)[it->b * cx->delta_sb + h * cx->delta_sh + row];
        if (sc->f.lo[r] > *lo_max) *lo_max = sc->f.lo[r];
        if (sc->f.hi[r] < *hi_min) *hi_min = sc->f.hi[r];
    }
}

/* One tile, rows of `it` against keys j0 .. j0+nk-1: dS (times the softcap's
 * derivative) into sc->dp, and the weights dV needs (P, or P z with dropout) at
 * *pw.  With write_ds, dS is also stored into bp->ds.  Returns 0 if no key of the
 * tile is visible (nothing computed). */
static int FA_NAME(fa_bwd_tile)(const fa_bwd_ctx *cx, const fa_item *it, int64_t nr, int nv,
                                int64_t j0, int64_t nk, int64_t lo_max, int64_t hi_min,
                                FA_NAME(fa_bscratch) *sc, const FA_T **pw, int write_ds)
{
    const fa_bwd_params *bp = cx->bp;
    const fa_params *p = &bp->f;
    const int64_t brp = cx->bl.q;
    FA_T *s = sc->f.s;
    if (!FA_NAME(fa_scores)(p, it, nr, nv, j0, nk, lo_max, hi_min, brp, &sc->f, 0)) return 0;
    if (p->softcap > 0) { /* s holds y = s_raw / c: the derivative of c tanh(y) is 1 - tanh^2 */
        const FA_V one = FA_VSET1((FA_T)1), m2 = FA_VSET1((FA_T)-2);
        for (int c = 0; c < nv; c++)
            for (int64_t jj = 0; jj < nk; jj++) {
                const int64_t o = jj * brp + (int64_t)c * FA_VL;
                const FA_V e = FA_VEXP(FA_VMUL(m2, FA_VABS(FA_VLOAD(s + o))));
                const FA_V th = FA_VDIV(FA_VSUB(one, e), FA_VADD(one, e));
                FA_VSTORE(sc->sg + o, FA_VSUB(one, FA_VMUL(th, th)));
            }
    }
    FA_NAME(fa_logit_tile)(p, s, nk, 0, nv, nr, j0, brp, &sc->f, NULL);
    for (int c = 0; c < nv; c++) { /* P = exp(S - lse); hidden keys and padded rows: 0 */
        const FA_V l = FA_VLOAD(sc->lsev + (int64_t)c * FA_VL);
        for (int64_t jj = 0; jj < nk; jj++) {
            FA_T *x = s + jj * brp + (int64_t)c * FA_VL;
            FA_VSTORE(x, FA_VEXP(FA_VSUB(FA_VLOAD(x), l)));
        }
    }
    const FA_T *v = (const FA_T *)p->v + it->b * p->v_sb + it->g * p->v_sh + (it->koff + j0) * p->v_sl;
    FA_NAME(fa_qk_tile)(sc->dot, nv, v, p->v_sl, nk, p->Dv, sc->dp, brp);
    *pw = s;
    if (p->dropout_p > 0) { /* dV takes P z; dS takes z dP */
        const FA_T inv = (FA_T)(1.0 / (1.0 - p->dropout_p));
        for (int64_t r = 0; r < nr; r++)
            fa_dropout_row(p->seed, cx->drop_thresh, it->b, it->h0 + r / it->nq, it->q0 + r % it->nq,
                           j0, nk, sc->keep + r, brp);
        for (int64_t jj = 0; jj < nk; jj++)
            for (int64_t r = 0; r < nr; r++) {
                const int64_t o = jj * brp + r;
                const FA_T z = sc->keep[o] ? inv : (FA_T)0;
                sc->pz[o] = s[o] * z;
                sc->dp[o] *= z;
            }
        *pw = sc->pz;
    }
    for (int c = 0; c < nv; c++) {
        const int64_t off = (int64_t)c * FA_VL;
        const FA_V dv = FA_VLOAD(sc->dvec + off);
        for (int64_t jj = 0; jj < nk; jj++) {
            const int64_t o = jj * brp + off;
            FA_VSTORE(sc->dp + o, FA_VMUL(FA_VLOAD(s + o), FA_VSUB(FA_VLOAD(sc->dp + o), dv)));
        }
    }
    if (write_ds) /* the logits' gradient, before the softcap's derivative */
        for (int64_t r = 0; r < nr; r++) {
            const int64_t h = it->h0 + r / it->nq, row = it->qoff + it->q0 + r % it->nq;
            FA_T *dst = (FA_T *)bp->ds + it->b * bp->ds_sb + h * bp->ds_sh + row * bp->ds_sq + j0;
            for (int64_t jj = 0; jj < nk; jj++) dst[jj] = sc->dp[jj * brp + r];
        }
    if (p->softcap > 0)
        for (int64_t jj = 0; jj < nk; jj++)
            for (int c = 0; c < nv; c++) {
                const int64_t o = jj * brp + (int64_t)c * FA_VL;
                FA_VSTORE(sc->dp + o, FA_VMUL(FA_VLOAD(sc->dp + o), FA_VLOAD(sc->sg + o)));
            }
    return 1;
}

/* dQ of the rows of `it` over the key chunks that start at k0 and end at k1 (kc
 * keys each, the last maybe fewer): qa holds one chunk's chain of sums (keys
 * ascending), qs their sum in chunk order (started by a copy of the first).  With
 * kv accumulators (ka, va, from key k0), dK and dV of the same tiles too.  With
 * part, each chunk's qa is stored there instead (chunk c's rows at part + c *
 * part_sc); with qs_out, the final sum is left in qs. */
static void FA_NAME(fa_bwd_chunks)(const fa_bwd_ctx *cx, const fa_item *it, int64_t k0, int64_t k1,
                                   int64_t kc, int want_dq, FA_T *ka, FA_T *va,
                                   FA_NAME(fa_bscratch) *sc, FA_T *part, int64_t part_sc)
{
    const fa_bwd_params *bp = cx->bp;
    const fa_params *p = &bp->f;
    const int64_t bc = cx->bl.k, brp = cx->bl.q, D = p->D, Dv = p->Dv;
    const int64_t dkp = FA_NAME(fa_round_up)(D, FA_VL), dvp = FA_NAME(fa_round_up)(Dv, FA_VL);
    const int64_t nr = it->nh * it->nq;
    const int nv = (int)((nr + FA_VL - 1) / FA_VL);
    const FA_T *k = (const FA_T *)p->k + it->b * p->k_sb + it->g * p->k_sh + it->koff * p->k_sl;
    int64_t lo_max, hi_min;
    FA_NAME(fa_bwd_rows)(cx, it, nr, (int64_t)nv * FA_VL, sc, &lo_max, &hi_min);
    if (want_dq && !part && k0 >= k1) memset(sc->qs, 0, (size_t)(nr * dkp) * sizeof(FA_T)); /* no keys */
    for (int64_t c0 = k0; c0 < k1; c0 += kc) {
        const int64_t c1 = k1 - c0 < kc ? k1 : c0 + kc;
        const int64_t lo = it->kv0 > c0 ? it->kv0 : c0, hi = it->kv1 < c1 ? it->kv1 : c1;
        if (want_dq) memset(sc->qa, 0, (size_t)(nr * dkp) * sizeof(FA_T));
        for (int64_t j0 = lo; j0 < hi; j0 += bc) {
            const int64_t nk = hi - j0 < bc ? hi - j0 : bc;
            const FA_T *w;
            if (!FA_NAME(fa_bwd_tile)(cx, it, nr, nv, j0, nk, lo_max, hi_min, sc, &w,
                                      want_dq && bp->ds != NULL))
                continue;
            if (ka) {
                /* dV[j] += sum_r w[j][r] dO[r]; dK[j] += sum_r dS[j][r] Q[r]: output rows
                 * are keys (stride brp in the tile), the reduction runs over the rows */
                FA_NAME(fa_pv_tile_strided)(w, nk, nr, sc->don, dvp, Dv, va + (j0 - k0) * dvp, dvp,
                                            sc->ones, 1, brp);
                FA_NAME(fa_pv_tile_strided)(sc->dp, nk, nr, sc->qr, dkp, D, ka + (j0 - k0) * dkp, dkp,
                                            sc->ones, 1, brp);
            }
            if (want_dq)
                FA_NAME(fa_pv_tile)(sc->dp, nr, nk, k + j0 * p->k_sl, p->k_sl, D, sc->qa, dkp, sc->ones, brp);
        }
        if (!want_dq) continue;
        if (part) {
            FA_T *dst = part + (c0 / kc) * part_sc;
            for (int64_t r = 0; r < nr; r++) {
                const int64_t h = it->h0 + r / it->nq, row = it->qoff + it->q0 + r % it->nq;
                memcpy(dst + (it->b * p->Hq + h) * p->Lq * dkp + row * dkp, sc->qa + r * dkp,
                       (size_t)dkp * sizeof(FA_T));
            }
        } else if (c0 == k0) {
            memcpy(sc->qs, sc->qa, (size_t)(nr * dkp) * sizeof(FA_T));
        } else {
            for (int64_t x = 0; x < nr * dkp; x += FA_VL)
                FA_VSTORE(sc->qs + x, FA_VADD(FA_VLOAD(sc->qs + x), FA_VLOAD(sc->qa + x)));
        }
    }
}

/* Writes dq = scale * qs for the rows of `it`. */
static void FA_NAME(fa_bwd_store_dq)(const fa_bwd_ctx *cx, const fa_item *it, const FA_T *qs)
{
    const fa_bwd_params *bp = cx->bp;
    const int64_t D = bp->f.D, dkp = FA_NAME(fa_round_up)(D, FA_VL), nr = it->nh * it->nq;
    const FA_T scale = (FA_T)bp->f.scale;
    for (int64_t r = 0; r < nr; r++) {
        const int64_t h = it->h0 + r / it->nq, row = it->qoff + it->q0 + r % it->nq;
        FA_T *dq = (FA_T *)bp->dq + it->b * bp->dq_sb + h * bp->dq_sh + row * bp->dq_sl;
        for (int64_t d = 0; d < D; d++) dq[d] = scale * qs[r * dkp + d];
    }
}

/* dK and dV of keys k0 .. k1-1 of one kv head (see fa_bwd_kv_fn). */
static void FA_NAME(fa_bwd_kv)(const fa_bwd_ctx *cx, const fa_item *items, int64_t nitems, int64_t k0,
                               int64_t k1, int dq_mode, void *scratch, void *acc, void *part)
{
    const fa_bwd_params *bp = cx->bp;
    const fa_params *p = &bp->f;
    const int64_t D = p->D, Dv = p->Dv, nk_all = k1 - k0;
    const int64_t dkp = FA_NAME(fa_round_up)(D, FA_VL), dvp = FA_NAME(fa_round_up)(Dv, FA_VL);
    FA_NAME(fa_bscratch) sc;
    FA_NAME(fa_blayout)(cx, scratch, &sc);
    FA_T *ka = (FA_T *)acc, *va = ka + nk_all * dkp;
    memset(acc, 0, (size_t)(nk_all * (dkp + dvp)) * sizeof(FA_T));
    const int64_t kc = dq_mode ? cx->kc : nk_all;
    for (int64_t t = 0; t < nitems; t++) {
        const fa_item *it = items + t;
        if (it->nh * it->nq <= 0) continue;
        if (dq_mode != 1 && (it->kv0 >= k1 || it->kv1 <= k0)) {
            if (dq_mode == 2) /* rows that see none of this chunk: a sum of 0 */
                for (int64_t r = 0; r < it->nh * it->nq; r++) {
                    const int64_t h = it->h0 + r / it->nq, row = it->qoff + it->q0 + r % it->nq;
                    memset((FA_T *)part + (k0 / cx->kc) * cx->part_sc + (it->b * p->Hq + h) * p->Lq * dkp + row * dkp,
                           0, (size_t)dkp * sizeof(FA_T));
                }
            continue;
        }
        FA_NAME(fa_bwd_chunks)(cx, it, k0, k1, kc, dq_mode != 0, ka, va, &sc,
                               dq_mode == 2 ? (FA_T *)part : NULL, cx->part_sc);
        if (dq_mode == 1) FA_NAME(fa_bwd_store_dq)(cx, it, sc.qs);
    }
    const int64_t b = items[0].b, g = items[0].g, koff = items[0].koff;
    const FA_T scale = (FA_T)p->scale;
    for (int64_t jj = 0; jj < nk_all; jj++) {
        FA_T *dk = (FA_T *)bp->dk + b * bp->dk_sb + g * bp->dk_sh + (koff + k0 + jj) * bp->dk_sl;
        FA_T *dv = (FA_T *)bp->dv + b * bp->dv_sb + g * bp->dv_sh + (koff + k0 + jj) * bp->dv_sl;
        for (int64_t d = 0; d < D; d++) dk[d] = scale * ka[jj * dkp + d];
        memcpy(dv, va + jj * dvp, (size_t)Dv * sizeof(FA_T));
    }
}

/* Pass 2 of the two-pass schedule: dQ (and dS) of the rows of one item. */
static void FA_NAME(fa_bwd_q)(const fa_bwd_ctx *cx, const fa_item *it, void *scratch)
{
    FA_NAME(fa_bscratch) sc;
    FA_NAME(fa_blayout)(cx, scratch, &sc);
    if (it->nh * it->nq <= 0) return;
    /* all of the call's key chunks (zeros past this sequence's keys), as the other
     * schedules add them */
    FA_NAME(fa_bwd_chunks)(cx, it, 0, cx->bp->f.Lk, cx->kc, 1, NULL, NULL, &sc, NULL, 0);
    FA_NAME(fa_bwd_store_dq)(cx, it, sc.qs);
}

/* dq = scale * (part[0] + part[1] + ...) of rows r0 .. r1-1 of (B, Hq, Lq), the
 * chunks' sums in order, as fa_bwd_chunks adds them. */
static void FA_NAME(fa_bwd_reduce)(const fa_bwd_ctx *cx, const void *partv, int64_t nch, int64_t r0,
                                   int64_t r1)
{
    const fa_bwd_params *bp = cx->bp;
    const fa_params *p = &bp->f;
    const int64_t D = p->D, dkp = FA_NAME(fa_round_up)(D, FA_VL);
    const FA_T *part = (const FA_T *)partv, scale = (FA_T)p->scale;
    FA_T tot[4 * FA_VL];
    for (int64_t r = r0; r < r1; r++) {
        const int64_t b = r / (p->Hq * p->Lq), h = (r / p->Lq) % p->Hq, i = r % p->Lq;
        FA_T *dq = (FA_T *)bp->dq + b * bp->dq_sb + h * bp->dq_sh + i * bp->dq_sl;
        for (int64_t d0 = 0; d0 < D; d0 += 4 * FA_VL) {
            const int64_t n = D - d0 < 4 * FA_VL ? D - d0 : 4 * FA_VL;
            for (int64_t d = 0; d < n; d++) tot[d] = part[r * dkp + d0 + d];
            for (int64_t c = 1; c < nch; c++)
                for (int64_t d = 0; d < n; d++) tot[d] += part[c * cx->part_sc + r * dkp + d0 + d];
            for (int64_t d = 0; d < n; d++) dq[d0 + d] = scale * tot[d];
        }
    }
}
/* key_mass: acc[(h - h_first) * (k1 - k0) + j - k0] = sum over the rows i of query head
 * h of p_ij = exp(s_ij - lse_i), for keys k0 .. k1-1 of one kv head, from the query
 * items in order (rows in order within each): the same sums for any thread count.
 * Then written to out[b, h, j] (strides m_sb, m_sh; keys contiguous). */
static void FA_NAME(fa_mass_kv)(const fa_bwd_ctx *cx, const fa_item *items, int64_t nitems, int64_t k0,
                                int64_t k1, void *scratch, void *accv, void *out, int64_t m_sb,
                                int64_t m_sh)
{
    const fa_params *p = &cx->bp->f;
    const int64_t brp = cx->bl.q, bc = cx->bl.k, nk_all = k1 - k0, G = p->Hq / p->Hkv;
    FA_NAME(fa_bscratch) sc;
    FA_NAME(fa_blayout)(cx, scratch, &sc);
    FA_T *acc = (FA_T *)accv;
    memset(acc, 0, (size_t)(G * nk_all) * sizeof(FA_T));
    const int64_t b = items[0].b, g = items[0].g;
    for (int64_t t = 0; t < nitems; t++) {
        const fa_item *it = items + t;
        const int64_t lo = it->kv0 > k0 ? it->kv0 : k0, hi = it->kv1 < k1 ? it->kv1 : k1;
        const int64_t nr = it->nh * it->nq;
        if (nr <= 0 || lo >= hi) continue;
        const int nv = (int)((nr + FA_VL - 1) / FA_VL);
        const int64_t nvl = (int64_t)nv * FA_VL;
        FA_NAME(fa_setup_rows)(p, it, nr, nvl, brp, bc, &sc.f);
        int64_t lo_max = INT64_MIN, hi_min = INT64_MAX;
        for (int64_t r = 0; r < nvl; r++) {
            if (r >= nr) {
                sc.lsev[r] = (FA_T)INFINITY;
                continue;
            }
            const int64_t h = it->h0 + r / it->nq, row = it->qoff + it->q0 + r % it->nq;
            const FA_T l = ((const FA_T *)p->lse)[it->b * p->lse_sb + h * p->lse_sh + row * p->lse_sl];
            sc.lsev[r] = l == -(FA_T)INFINITY ? (FA_T)INFINITY : l;
            if (sc.f.lo[r] > lo_max) lo_max = sc.f.lo[r];
            if (sc.f.hi[r] < hi_min) hi_min = sc.f.hi[r];
        }
        for (int64_t j0 = lo; j0 < hi; j0 += bc) {
            const int64_t nk = hi - j0 < bc ? hi - j0 : bc;
            FA_T *s = sc.f.s;
            if (!FA_NAME(fa_scores)(p, it, nr, nv, j0, nk, lo_max, hi_min, brp, &sc.f, 1)) continue;
            for (int c = 0; c < nv; c++) {
                const FA_V lv = FA_VLOAD(sc.lsev + (int64_t)c * FA_VL);
                for (int64_t jj = 0; jj < nk; jj++) {
                    FA_T *x = s + jj * brp + (int64_t)c * FA_VL;
                    FA_VSTORE(x, FA_VEXP(FA_VSUB(FA_VLOAD(x), lv)));
                }
            }
            for (int64_t r = 0; r < nr; r++) {
                FA_T *a = acc + (it->h0 + r / it->nq - g * G) * nk_all + (j0 - k0);
                for (int64_t jj = 0; jj < nk; jj++) a[jj] += s[jj * brp + r];
            }
        }
    }
    for (int64_t hh = 0; hh < G; hh++)
        memcpy((FA_T *)out + b * m_sb + (g * G + hh) * m_sh + k0, acc + hh * nk_all,
               (size_t)nk_all * sizeof(FA_T));
}
#endif /* FA_KV_HALF */
