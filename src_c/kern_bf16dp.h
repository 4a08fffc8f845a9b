/*
 * kern_bf16dp.h -- part of the kernel template (kernels_tmpl.h), only where the ISA file
 * defines FA_BF16_DP: the two products of a prefill block on bfloat16 pairs, for q, k
 * and v all bfloat16 (the AVX512-BF16 instruction vdpbf16ps, AArch64's BFDOT: each
 * 32-bit lane adds the products of one pair of bfloat16 values to a float32
 * accumulator).
 *   fa_pack_q_pairs  a block's Q rows as pairs of features, qp[t][r] = (q[r][2t],
 *                    q[r][2t+1]) as one 32-bit word (low half the first; 0 past D),
 *                    not scaled: the scale goes on the float32 logits
 *   fa_qk_tile_dp    S^T = K Q^T over the pairs: one key's pair broadcast (read in place
 *                    from its bfloat16 row) against FA_VL queries' pairs, then times the
 *                    scale (scale / softcap with a softcap), stored as float32 logits
 *   fa_pv_tile_dp    P rounded to bfloat16 (round to nearest even, as PyTorch and
 *                    FlashAttention do) and paired along the keys, V paired along the
 *                    keys once per tile, then O = alpha O + P V in float32
 *   fa_dp_chains     the instruction's peak loop (not in the AMX kernel)
 * The softmax, the logit steps, the merge and the statistics are the float32 ones.
 * Calls whose items have at most FA_DOT_ROWS rows (decoding) take the float32 products;
 * the others take the pairs in every block, however few rows it has (fa_few_rows).
 *
 * Needs from the ISA file, on FA_DP_V (FA_VL pairs of bfloat16, one a float32 lane):
 *   FA_DP_LOAD(p)         FA_VL pairs from aligned uint32 words
 *   FA_DP_BCAST(w)        a uint32 pair in every lane
 *   FA_DP_FMA(acc, a, b)  acc + a.lo * b.lo + a.hi * b.hi per lane (float32 acc; the
 *                         instruction's own rounding: vdpbf16ps's, BFDOT's)
 *   FA_DP_CVT2(x0, x1)    pairs (bf16(x0[i]), bf16(x1[i])) of two float32 vectors
 *   FA_DP_ZIP(a, b, n, lo, hi)  the first n (<= 2 FA_VL) bfloat16 values of rows a and
 *                         b (b NULL: zeros) as pairs: lo = channels 0 .. FA_VL-1, hi =
 *                         FA_VL .. 2 FA_VL-1
 *   FA_DP_STORE(p, x)     store FA_VL pairs (aligned)
 * and optionally FA_DP_K4 (a vector of 4 pairs), FA_DP_LOAD_K4(p) (8 bfloat16 values,
 * unaligned) and FA_DP_FMA_K4(acc, q, kv, u) (FA_DP_FMA with pair u of kv in every
 * lane: NEON's BFDOT by element), which QK^T (P.V for its first 4 rows, and the
 * backward's row-pair products, kern_bf16bwd.h) then take in place of a broadcast a pair
 * (AVX512-BF16: 16 pairs, kernels_avx512bf16.h; AArch64's BFDOT: 4 on NEON, 8 or 4 on
 * SVE, kernels_arm_bf16.h.)
 */

/* Q pairs of a block's rows (padded rows nr .. nvl-1 zero). */
static void FA_NAME(fa_pack_q_pairs)(const fa_params *p, const fa_item *it, int64_t nr, int64_t nvl,
                                     int64_t brp, uint32_t *FA_RESTRICT qp)
{
    const int64_t D = p->D, np = (D + 1) / 2;
    for (int64_t r = 0; r < nvl; r++) {
        if (r >= nr) {
            for (int64_t t = 0; t < np; t++) qp[t * brp + r] = 0;
            continue;
        }
        const int64_t h = it->h0 + r / it->nq, row = it->qoff + it->q0 + r % it->nq;
        const uint16_t *qh = (const uint16_t *)p->q + it->b * p->q_sb + h * p->q_sh + row * p->q_sl;
        for (int64_t t = 0; t < D / 2; t++) qp[t * brp + r] = (uint32_t)qh[2 * t] | (uint32_t)qh[2 * t + 1] << 16;
        if (D & 1) qp[(np - 1) * brp + r] = qh[D - 1];
    }
#ifdef FA_BF16_AMX /* the pair rows of whole tiles past D: zero */
    for (int64_t t = np; t < FA_NAME(fa_amx_dz)(D) / 2; t++)
        for (int64_t r = 0; r < nvl; r++) qp[t * brp + r] = 0;
#endif
}

#if defined(FA_DP_K4) && !defined(FA_DP_K4_STEPS)
/* The 4 steps of a by-element loop at pair t: at step u, NV vectors of pairs loaded
 * from src + (t + u) * ld, and acc[r][c] += pair u of k4[r] against vector c (QK^T here,
 * the backward's row-pair products in kern_bf16bwd.h) */
#define FA_DP_K4_STEP(acc, R, NV, k4, src, ld, t, NVMAX, u)                                      \
    {                                                                                            \
        FA_DP_V v_[NVMAX];                                                                       \
        for (int c = 0; c < (NV); c++) v_[c] = FA_DP_LOAD((src) + ((t) + (u)) * (ld) + c * FA_VL); \
        for (int r = 0; r < (R); r++)                                                            \
            for (int c = 0; c < (NV); c++) (acc)[r][c] = FA_DP_FMA_K4((acc)[r][c], v_[c], (k4)[r], u); \
    }
#define FA_DP_K4_STEPS(acc, R, NV, k4, src, ld, t, NVMAX)  \
    FA_DP_K4_STEP(acc, R, NV, k4, src, ld, t, NVMAX, 0)    \
    FA_DP_K4_STEP(acc, R, NV, k4, src, ld, t, NVMAX, 1)    \
    FA_DP_K4_STEP(acc, R, NV, k4, src, ld, t, NVMAX, 2)    \
    FA_DP_K4_STEP(acc, R, NV, k4, src, ld, t, NVMAX, 3)
#endif

/* R keys x NV query vectors of logits, accumulators in registers; with cm, each
 * lane's max folded in (as fa_qk_micro). */
FA_ALWAYS_INLINE void FA_NAME(fa_qk_dp_micro)(const int R, const int NV, const uint32_t *FA_RESTRICT qp,
                                              const uint16_t *FA_RESTRICT k, int64_t k_sl, int64_t D,
                                              FA_T *FA_RESTRICT s, int64_t brp, FA_T scale,
                                              FA_T *FA_RESTRICT cm)
{
    FA_V acc[FA_QK_R][FA_QK_NV];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NV; c++) acc[r][c] = FA_VZERO();
    const int64_t full = D / 2;
    int64_t t = 0;
#ifdef FA_DP_K4
    /* four pairs of each key row in one vector, each used by its index (no broadcast);
     * the same products in the same order as below, so the same bits */
    for (; t + 4 <= full; t += 4) {
        FA_DP_K4 kv[FA_QK_R];
        for (int r = 0; r < R; r++) kv[r] = FA_DP_LOAD_K4(k + r * k_sl + 2 * t);
        FA_DP_K4_STEPS(acc, R, NV, kv, qp, brp, t, FA_QK_NV);
    }
#endif
    for (; t < full; t++) {
        FA_DP_V qv[FA_QK_NV];
        for (int c = 0; c < NV; c++) qv[c] = FA_DP_LOAD(qp + t * brp + c * FA_VL);
        for (int r = 0; r < R; r++) {
            uint32_t w;
            memcpy(&w, k + r * k_sl + 2 * t, sizeof w);
            const FA_DP_V kb = FA_DP_BCAST(w);
            for (int c = 0; c < NV; c++) acc[r][c] = FA_DP_FMA(acc[r][c], kb, qv[c]);
        }
    }
    if (D & 1) { /* the last feature alone: (k, 0) against (q, 0) */
        FA_DP_V qv[FA_QK_NV];
        for (int c = 0; c < NV; c++) qv[c] = FA_DP_LOAD(qp + full * brp + c * FA_VL);
        for (int r = 0; r < R; r++) {
            const FA_DP_V kb = FA_DP_BCAST((uint32_t)k[r * k_sl + D - 1]);
            for (int c = 0; c < NV; c++) acc[r][c] = FA_DP_FMA(acc[r][c], kb, qv[c]);
        }
    }
    const FA_V sv = FA_VSET1(scale);
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NV; c++) acc[r][c] = FA_VMUL(acc[r][c], sv);
    FA_NAME(fa_qk_store)(R, NV, acc, s, brp, cm);
}

#ifndef FA_BF16_AMX /* (the AMX kernel's QK^T is fa_qk_tile_amx, every key on the tiles) */
#define FA_QK_DP_CASE(R, NV)                                                                 \
    case (R) * 8 + (NV):                                                                     \
        if ((R) <= FA_QK_R && (NV) <= FA_QK_NV)                                              \
            FA_NAME(fa_qk_dp_micro)(R, NV, qp + cv * FA_VL, kj, k_sl, D, sj, brp, scale, cmj); \
        break;

/* The logits of nk bfloat16 keys against a block's Q pairs (nv vectors), as fa_qk_tile. */
static void FA_NAME(fa_qk_tile_dp)(const uint32_t *FA_RESTRICT qp, int nv, const uint16_t *FA_RESTRICT k,
                                   int64_t k_sl, int64_t nk, int64_t D, FA_T *FA_RESTRICT s, int64_t brp,
                                   FA_T scale, FA_T *FA_RESTRICT colmax)
{
    for (int cv = 0; cv < nv; cv += FA_QK_NV) {
        const int ncv = nv - cv < FA_QK_NV ? nv - cv : FA_QK_NV;
        for (int64_t j = 0; j < nk; j += FA_QK_R) {
            const int r = (int)(nk - j < FA_QK_R ? nk - j : FA_QK_R);
            const uint16_t *kj = k + j * k_sl;
            FA_T *sj = s + j * brp + cv * FA_VL;
            FA_T *cmj = colmax ? colmax + cv * FA_VL : NULL;
            switch (r * 8 + ncv) {
                FA_TILE_ROWS(FA_QK_DP_CASE)
                default: break;
            }
        }
    }
}
#undef FA_QK_DP_CASE
#endif /* FA_BF16_AMX */

#ifndef FA_BF16_AMX /* (the AMX kernel's P.V is fa_pv_tile_amx) */
/* o[i][c0 ...] = alpha[i] o[i][c0 ...] + sum_t (p pair t of row i) . (v pair t) for R
 * rows and NC value vectors; pp[t * brp + i], vp[t * dvp + c]. */
FA_ALWAYS_INLINE void FA_NAME(fa_pv_dp_micro)(const int R, const int NC, const uint32_t *FA_RESTRICT pp,
                                              const uint32_t *FA_RESTRICT vp, int64_t npairs,
                                              FA_T *FA_RESTRICT o, int64_t dvp,
                                              const FA_T *FA_RESTRICT alpha, int64_t brp)
{
    FA_V acc[FA_PV_R][2 * FA_PV_NC];
    FA_NAME(fa_pv_load)(R, NC, acc, o, dvp, alpha);
#ifdef FA_DP_K4
    /* rows 0-3's pairs of P at step t are adjacent words: one vector, each row's pair
     * used by its index (the same products in the same order: the same bits) */
    if (R >= 4) {
        for (int64_t t = 0; t < npairs; t++) {
            FA_DP_V vv[FA_PV_NC];
            for (int c = 0; c < NC; c++) vv[c] = FA_DP_LOAD(vp + t * dvp + c * FA_VL);
            const FA_DP_K4 p4 = FA_DP_LOAD_K4((const uint16_t *)(const void *)(pp + t * brp));
            for (int c = 0; c < NC; c++) {
                acc[0][c] = FA_DP_FMA_K4(acc[0][c], vv[c], p4, 0);
                acc[1][c] = FA_DP_FMA_K4(acc[1][c], vv[c], p4, 1);
                acc[2][c] = FA_DP_FMA_K4(acc[2][c], vv[c], p4, 2);
                acc[3][c] = FA_DP_FMA_K4(acc[3][c], vv[c], p4, 3);
            }
            for (int r = 4; r < R; r++) {
                const FA_DP_V pb = FA_DP_BCAST(pp[t * brp + r]);
                for (int c = 0; c < NC; c++) acc[r][c] = FA_DP_FMA(acc[r][c], pb, vv[c]);
            }
        }
    } else
#endif
    for (int64_t t = 0; t < npairs; t++) {
        FA_DP_V vv[FA_PV_NC];
        for (int c = 0; c < NC; c++) vv[c] = FA_DP_LOAD(vp + t * dvp + c * FA_VL);
        for (int r = 0; r < R; r++) {
            const FA_DP_V pb = FA_DP_BCAST(pp[t * brp + r]);
            for (int c = 0; c < NC; c++) acc[r][c] = FA_DP_FMA(acc[r][c], pb, vv[c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++) FA_VSTORE(o + r * dvp + c * FA_VL, acc[r][c]);
}

#define FA_PV_DP_CASE(R, NC)                                                                \
    case (R) * 16 + (NC):                                                                   \
        if ((R) <= FA_PV_R && (NC) <= FA_PV_NC)                                             \
            FA_NAME(fa_pv_dp_micro)(R, NC, pp + i, vp + c0, npairs, o + i * dvp + c0, dvp, alpha + i, brp); \
        break;

/* A tile's P.V on bfloat16 pairs: P (s[jj * brp + i], float32 probabilities of nv
 * query vectors) rounded and paired into pp, the V tile (nk rows of v_sl, Dv wide)
 * paired into vp, then the rows' products. */
static void FA_NAME(fa_pv_tile_dp)(const FA_T *FA_RESTRICT s, int64_t nq, int nv, int64_t nk,
                                   const uint16_t *FA_RESTRICT v, int64_t v_sl, int64_t Dv,
                                   FA_T *FA_RESTRICT o, int64_t dvp, const FA_T *FA_RESTRICT alpha,
                                   int64_t brp, uint32_t *FA_RESTRICT pp, uint32_t *FA_RESTRICT vp)
{
    const int64_t npairs = (nk + 1) / 2;
    for (int64_t t = 0; t < npairs; t++) {
        const int two = 2 * t + 1 < nk;
        const FA_T *s0 = s + 2 * t * brp, *s1 = s0 + brp;
        for (int c = 0; c < nv; c++) {
            const FA_V x0 = FA_VLOAD(s0 + c * FA_VL), x1 = two ? FA_VLOAD(s1 + c * FA_VL) : FA_VZERO();
            FA_DP_STORE(pp + t * brp + c * FA_VL, FA_DP_CVT2(x0, x1));
        }
        const uint16_t *v0 = v + 2 * t * v_sl, *v1 = two ? v0 + v_sl : NULL;
        for (int64_t c0 = 0; c0 < dvp; c0 += 2 * FA_VL) {
            const int n = (int)(Dv - c0 < 2 * FA_VL ? Dv - c0 : 2 * FA_VL);
            FA_DP_V lo, hi;
            FA_DP_ZIP(v0 + c0, v1 ? v1 + c0 : NULL, n, lo, hi);
            FA_DP_STORE(vp + t * dvp + c0, lo);
            if (c0 + FA_VL < dvp) FA_DP_STORE(vp + t * dvp + c0 + FA_VL, hi);
        }
    }
    const int64_t chunk = (int64_t)FA_PV_NC * FA_VL;
    for (int64_t c0 = 0; c0 < dvp; c0 += chunk) {
        const int nc = (int)((dvp - c0 < chunk ? dvp - c0 : chunk) / FA_VL);
        for (int64_t i = 0; i < nq; i += FA_PV_R) {
            const int r = (int)(nq - i < FA_PV_R ? nq - i : FA_PV_R);
            switch (r * 16 + nc) {
                FA_TILE_ROWS(FA_PV_DP_CASE)
                default: break;
            }
        }
    }
}
#undef FA_PV_DP_CASE
#endif /* FA_BF16_AMX */

#if defined(FA_BF16_DP) && !defined(FA_BF16_AMX)
/* The pair instruction's peak loop (fastattn.bench.bf16_peak): iters rounds of
 * FA_PEAK_CHAINS independent FA_DP_FMA, acc += 1 * a + 1 * a (a as bfloat16; the chains
 * grow by 2a a round, far from overflow), returning the lanes' sum. */
static double FA_NAME(fa_dp_chains)(int64_t iters, double m, double a)
{
    (void)m;
    uint32_t ones = 0x3F803F80u; /* (two bfloat16 1s) */
    const uint32_t ab = fa_float_to_bf16((float)a);
    /* (the empty asm hides the constant: AArch64's gcc 12 otherwise materializes the
     * vector of bfloat16 1s as FMOV .8h #1.0, an FP16 instruction with FP16's bits) */
    __asm__("" : "+r"(ones));
    const FA_DP_V x = FA_DP_BCAST(ones), y = FA_DP_BCAST(ab | ab << 16);
    FA_V acc[FA_PEAK_CHAINS];
    for (int c = 0; c < FA_PEAK_CHAINS; c++) acc[c] = FA_VSET1((float)c);
    for (int64_t i = 0; i < iters; i++)
        for (int c = 0; c < FA_PEAK_CHAINS; c++) acc[c] = FA_DP_FMA(acc[c], x, y);
    FA_V s = acc[0];
    for (int c = 1; c < FA_PEAK_CHAINS; c++) s = FA_VADD(s, acc[c]);
    return (double)FA_VREDUCE(s);
}
#endif
