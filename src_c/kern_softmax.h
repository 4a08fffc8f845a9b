/*
 * kern_softmax.h -- part of the kernel template (kernels_tmpl.h): the online softmax
 * and the merge of key chunks.
 *   fa_softmax_tile(_u)  one key tile of the online softmax over query vectors: the
 *                        running max, exp fused with the row sums, the rescale factor;
 *                        with return_stats (_u) the centred logit sum for the entropy
 *   fa_softmax_row       the same arithmetic for one contiguous row (decoding)
 *   fa_fold_chunk        the end of a FA_CHUNK_KEYS chunk: each row's normalized chunk
 *                        result merged in order by fa_merge_step (fa_internal.h, the
 *                        merge every path shares), the entropy by the chain rule
 *
 * Needs from the including ISA file: the vector operations, FA_VEXP (exp(-inf) = 0) and
 * optionally FA_VEXP_LOGIT (the logits' exp, kern_common.h),
 * FA_VMAX (NaN-propagating), FA_VNEGINF_TO_ZERO, FA_VREDUCE.
 */

/* The row sums of a key tile's p (query-major: row i's p of key j at s[j * brp + i],
 * FA_VL rows a vector): key j (counted from the tile's first key) goes to chain
 * j mod FA_VL, each chain adds its keys in order from 0, and the FA_VL chains are added
 * by halves (chain k + w into chain k, w = FA_VL / 2, ..., 1).  fa_softmax_row adds a
 * decode row's keys in the same chains, as the lanes of one vector over keys: the same
 * adds, so the same bits, at one vector add per FA_VL keys (the two scalar chains of
 * even and odd keys it had were 7-11% of a decode's samples, bound by the adds' latency).
 * Here one load and add per key a query vector, after the exps: next to the key's 2D
 * FMAs of the products, nothing. */
#if FA_VL > 16
#error "kern_softmax.h's halves start at FA_VL / 2 <= 8"
#endif
#ifndef FA_BY_HALVES
/* a[k] = OP(a[k], a[k + w]) for k < w, w = FA_VL / 2, ..., 2, 1: the chains (or lanes)
 * combined by halves, each step unrolled (w a constant in each) */
#define FA_HALF_STEP(a, OP, w)                \
    if (FA_VL >= 2 * (w))                     \
        FA_PRAGMA_UNROLL(8)                   \
        for (int k_ = 0; k_ < (w); k_++) (a)[k_] = OP((a)[k_], (a)[k_ + (w)]);
#define FA_BY_HALVES(a, OP)                                                                      \
    do {                                                                                         \
        FA_HALF_STEP(a, OP, 8) FA_HALF_STEP(a, OP, 4) FA_HALF_STEP(a, OP, 2) FA_HALF_STEP(a, OP, 1) \
    } while (0)
#define FA_ADD1(x, y) ((x) + (y))
/* NaN wins, as in FA_VMAX */
#define FA_MAX1(x, y) ((y) > (x) || (y) != (y) ? (y) : (x))
#endif
FA_ALWAYS_INLINE FA_V FA_NAME(fa_tile_sums)(const FA_T *FA_RESTRICT sc, int64_t nk, int64_t brp)
{
    FA_V acc[FA_VL];
    FA_PRAGMA_UNROLL(16)
    for (int k = 0; k < FA_VL; k++) acc[k] = FA_VZERO();
    int64_t j = 0;
    for (; j + FA_VL <= nk; j += FA_VL)
        FA_PRAGMA_UNROLL(16)
        for (int k = 0; k < FA_VL; k++) acc[k] = FA_VADD(acc[k], FA_VLOAD(sc + (j + k) * brp));
    FA_PRAGMA_UNROLL(16)
    for (int k = 0; k < FA_VL; k++)
        if (j + k < nk) acc[k] = FA_VADD(acc[k], FA_VLOAD(sc + (j + k) * brp));
    FA_BY_HALVES(acc, FA_VADD);
    return acc[0];
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
        FA_V us = FA_VZERO();
        for (int64_t j = 0; j < nk; j++) {
            const FA_V x = FA_VSUB(FA_VLOAD(sc + j * brp), m_use);
            const FA_V e = FA_VEXP_LOGIT(x);
            FA_VSTORE(sc + j * brp, e);
            us = FA_VFMA(e, FA_VNEGINF_TO_ZERO(x), us);
        }
        /* the row sums as fa_softmax_tile's: the output and lse of a call do not
         * change when the statistics are asked for */
        const FA_V sum = FA_NAME(fa_tile_sums)(sc, nk, brp);
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
        int64_t j = 0;
#ifdef FA_VEXP_LOGIT4
        /* four keys at a time through the ISA's interleaved exp (the values of
         * FA_VEXP_LOGIT one by one) */
        for (; j + 3 < nk; j += 4) {
            FA_V e[4];
            for (int k = 0; k < 4; k++) e[k] = FA_VSUB(FA_VLOAD(sc + (j + k) * brp), m_use);
            FA_VEXP_LOGIT4(e);
            for (int k = 0; k < 4; k++) FA_VSTORE(sc + (j + k) * brp, e[k]);
        }
#endif
        for (; j < nk; j++) FA_VSTORE(sc + j * brp, FA_VEXP_LOGIT(FA_VSUB(FA_VLOAD(sc + j * brp), m_use)));
        const FA_V sum = FA_NAME(fa_tile_sums)(sc, nk, brp);
        FA_VSTORE(l + c * FA_VL, FA_VFMA(FA_VLOAD(l + c * FA_VL), a, sum));
        FA_VSTORE(m + c * FA_VL, m_new);
        FA_VSTORE(alpha + c * FA_VL, a);
    }
}

/* fa_softmax_tile for one row whose logits are contiguous, s[j] (s has room for nk
 * rounded up to FA_VL), with vectors over keys, so the exp of FA_VL keys costs one
 * vector exp, not FA_VL exps of which one lane is used (decoding).  The same bits
 * as fa_softmax_tile gives the row in a query-major tile: the same max, the same
 * exp of each logit (lane-wise), the sums in fa_tile_sums's chains, and alpha and
 * the new sum by the same vector operations. */
static void FA_NAME(fa_softmax_row)(FA_T *FA_RESTRICT s, int64_t nk, FA_T *FA_RESTRICT m,
                                    FA_T *FA_RESTRICT l, FA_T *FA_RESTRICT alpha)
{
    const int64_t nkv = FA_NAME(fa_round_up)(nk, FA_VL);
    for (int64_t j = nk; j < nkv; j++) s[j] = -(FA_T)INFINITY; /* padding: p = 0 */
    FA_V mx = FA_VLOAD(s);
    for (int64_t j = FA_VL; j < nkv; j += FA_VL) mx = FA_VMAX(mx, FA_VLOAD(s + j));
    FA_T lanes[FA_VL];
#ifdef FA_VHMAX_NAN
    const FA_T mx1 = FA_VHMAX_NAN(mx);
#else
    FA_VSTOREU(lanes, mx);
    /* the lanes' max by halves (4 steps at 16 lanes, not a chain of 16: NaN wins, as in
     * FA_VMAX; the max's value does not depend on the order, up to a zero's sign,
     * which no result sees: s - m and exp(m - m') are the same for -0 and +0) */
    FA_BY_HALVES(lanes, FA_MAX1);
    const FA_T mx1 = lanes[0];
#endif
    FA_T m_new = m[0];
    if (mx1 > m_new || mx1 != mx1) m_new = mx1;
    const FA_T m_use = m_new == -(FA_T)INFINITY ? (FA_T)0 : m_new;
    const FA_V mu = FA_VSET1(m_use);
    /* lane k sums keys k, k + FA_VL, ... in order: fa_tile_sums's chains (the padding's
     * p are 0, and x + 0 is x) */
    FA_V sv = FA_VZERO();
    int64_t j = 0;
#ifdef FA_VEXP_LOGIT4
    for (; j + 4 * FA_VL <= nkv; j += 4 * FA_VL) { /* (the same values, interleaved) */
        FA_V e[4];
        for (int k = 0; k < 4; k++) e[k] = FA_VSUB(FA_VLOAD(s + j + k * FA_VL), mu);
        FA_VEXP_LOGIT4(e);
        for (int k = 0; k < 4; k++) {
            FA_VSTORE(s + j + k * FA_VL, e[k]);
            sv = FA_VADD(sv, e[k]);
        }
    }
#endif
    for (; j < nkv; j += FA_VL) {
        const FA_V e = FA_VEXP_LOGIT(FA_VSUB(FA_VLOAD(s + j), mu));
        FA_VSTORE(s + j, e);
        sv = FA_VADD(sv, e);
    }
#ifdef FA_VHSUM_HALVES
    const FA_T sum = FA_VHSUM_HALVES(sv);
#else
    FA_VSTOREU(lanes, sv);
    FA_BY_HALVES(lanes, FA_ADD1); /* the chains by halves, as fa_tile_sums */
    const FA_T sum = lanes[0];
#endif
    const FA_V a = FA_VEXP(FA_VSUB(FA_VSET1(m[0]), mu));
    FA_VSTOREU(lanes, FA_VFMA(FA_VSET1(l[0]), a, FA_VSET1(sum)));
    l[0] = lanes[0];
    FA_VSTOREU(lanes, a);
    alpha[0] = lanes[0];
    m[0] = m_new;
}

/* The end of a key chunk: each row's chunk result, normalized (out_c = o / l,
 * lse_c = m + log l, exactly what a split-KV decode item writes for that chunk), is
 * merged into the row's running merge; with return_stats the entropy too, by the
 * chain rule H = sum_c pi_c (h_c - log pi_c), kept relative to the running M. */
/* A chunk's row normalized (dst = o / l, l > 0; dst may be o), and with its lse_c =
 * m + log l. */
static inline void FA_NAME(fa_chunk_norm)(FA_T *dst, const FA_T *o, FA_T l, int64_t Dv)
{
    const FA_T inv = (FA_T)1 / l;
    for (int64_t c = 0; c < Dv; c++) dst[c] = o[c] * inv;
}
/* A chunk's lse_c = m + log l: one expression for every path that ends a chunk (its
 * bits are what the merge of the chunks, prefill or split-KV, adds by) */
static inline FA_T FA_NAME(fa_chunk_lse)(FA_T m, FA_T l)
{
    return m + (FA_T)log((double)l);
}
static inline FA_T FA_NAME(fa_chunk_row)(FA_T *o, FA_T m, FA_T l, int64_t Dv)
{
    FA_NAME(fa_chunk_norm)(o, o, l, Dv);
    return FA_NAME(fa_chunk_lse)(m, l);
}

__attribute__((noinline)) static void FA_NAME(fa_fold_chunk)(FA_NAME(fa_scratch) *sc, int64_t nr, int64_t Dv, int64_t dvp)
{
    for (int64_t r = 0; r < nr; r++) {
        const FA_T l = sc->l[r];
        FA_T *o = sc->o + r * dvp;
        if (l == (FA_T)0) continue; /* no visible key in this chunk: lse_c = -inf, skipped */
        /* lse_c = m + log l and the rows o / l, as fa_chunk_row gives them, the division
         * fused into the merge's pass over the row */
        const FA_T x = FA_NAME(fa_chunk_lse)(sc->m[r], l), inv = (FA_T)1 / l;
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
        fa_merge_step_scaled(&sc->mM[r], &sc->mtot[r], sc->mo + r * dvp, x, o, inv, Dv);
    }
}
