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

static inline int64_t FA_NAME(fa_round_up)(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* Block sizes come from the driver at run time (bl->q query rows, a multiple of
 * FA_VL, which is also the row stride "brp" of qt and s; bl->k keys).
 * Scratch, in FA_T elements, each piece starting on an FA_ALIGN boundary:
 *   qt    D    x brp   Q block, transposed and scaled
 *   s     bl.k x brp   logits of one key block, then its probabilities (key-major)
 *   o     brp  x dvp   running unnormalized output (dvp = Dv rounded up to FA_VL)
 *   m, l, alpha        brp each: running max, running sum, last rescale factor   */
#define FA_PIECE(n) FA_NAME(fa_round_up)((int64_t)(n), FA_ALIGN / (int64_t)sizeof(FA_T))

static size_t FA_NAME(fa_scratch_bytes)(const fa_params *p, const fa_blocks *bl)
{
    int64_t dvp = FA_NAME(fa_round_up)(p->Dv, FA_VL), brp = bl->q;
    int64_t n = FA_PIECE(p->D * brp) + FA_PIECE(bl->k * brp) + FA_PIECE(brp * dvp) +
                3 * FA_PIECE(brp);
    return (size_t)n * sizeof(FA_T);
}

/* qt[d*brp + i] = scale * q[i][d]; lanes nq up to the next vector boundary are zero
 * so padded queries give finite logits (never stored); lanes past it are never read. */
static void FA_NAME(fa_pack_q)(const FA_T *FA_RESTRICT q, int64_t q_sl, int64_t nq, int64_t D,
                               FA_T scale, FA_T *FA_RESTRICT qt, int64_t brp)
{
    const int64_t nqp = FA_NAME(fa_round_up)(nq, FA_VL);
    for (int64_t d = 0; d < D; d++) {
        FA_T *row = qt + d * brp;
        for (int64_t i = nq; i < nqp; i++) row[i] = (FA_T)0;
    }
    /* Row by row: each q row is read contiguously, once. */
    for (int64_t i = 0; i < nq; i++) {
        const FA_T *qi = q + i * q_sl;
        for (int64_t d = 0; d < D; d++) qt[d * brp + i] = scale * qi[d];
    }
}

/* S^T tile: s[j][c*VL ...] = sum_d k[j][d] * qt[d][c*VL ...] for R keys and NV query
 * vectors, accumulators in registers (R and NV are constants after inlining). */
FA_ALWAYS_INLINE void FA_NAME(fa_qk_micro)(const int R, const int NV, const FA_T *FA_RESTRICT qt,
                                           const FA_T *FA_RESTRICT k, int64_t k_sl, int64_t D,
                                           FA_T *FA_RESTRICT s, int64_t brp)
{
    FA_V acc[FA_QK_R][FA_QK_NV];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NV; c++) acc[r][c] = FA_VZERO();
    for (int64_t d = 0; d < D; d++) {
        FA_V qv[FA_QK_NV];
        for (int c = 0; c < NV; c++) qv[c] = FA_VLOAD(qt + d * brp + c * FA_VL);
        for (int r = 0; r < R; r++) {
            FA_V kb = FA_VSET1(k[r * k_sl + d]);
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
static void FA_NAME(fa_qk_tile)(const FA_T *FA_RESTRICT qt, int nv, const FA_T *FA_RESTRICT k,
                                int64_t k_sl, int64_t nk, int64_t D, FA_T *FA_RESTRICT s,
                                int64_t brp)
{
    /* Query-vector groups outer: their slice of qt (D x FA_QK_NV vectors) stays in L1
     * while the key tile streams past it. */
    for (int cv = 0; cv < nv; cv += FA_QK_NV) {
        int ncv = nv - cv < FA_QK_NV ? nv - cv : FA_QK_NV;
        for (int64_t j = 0; j < nk; j += FA_QK_R) {
            int r = (int)(nk - j < FA_QK_R ? nk - j : FA_QK_R);
            const FA_T *kj = k + j * k_sl;
            FA_T *sj = s + j * brp + cv * FA_VL;
            switch (r * 8 + ncv) {
                FA_TILE_ROWS(FA_QK_CASE)
                default: break;
            }
        }
    }
}
#undef FA_QK_CASE

/* Online-softmax step for one key block, vectorized over queries: new running max,
 * probabilities p = exp(s - m) written over s, running sum l rescaled by
 * alpha = exp(m_old - m_new) and increased by the block's row sums (exp fused with
 * the sum).  Rows that have seen no visible key keep m = -inf; they use 0 in place
 * of m so that exp(-inf - 0) = 0 and never exp(-inf + inf) = NaN. */
static void FA_NAME(fa_softmax_tile)(FA_T *FA_RESTRICT s, int64_t nk, int nv, FA_T *FA_RESTRICT m,
                                     FA_T *FA_RESTRICT l, FA_T *FA_RESTRICT alpha, int64_t brp)
{
    for (int c = 0; c < nv; c++) {
        FA_T *sc = s + c * FA_VL;
        FA_V m_old = FA_VLOAD(m + c * FA_VL);
        FA_V m_new = m_old;
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

/* o[i][c0 ...] = alpha[i] * o[i][c0 ...] + sum_j p[j][i] * v[j][c0 ...] for R query
 * rows and NC value vectors (the last one `tail` lanes wide when tail > 0).  The
 * rescale is skipped when no row's max changed (alpha == 1 for all R rows). */
FA_ALWAYS_INLINE void FA_NAME(fa_pv_micro)(const int R, const int NC, const FA_T *FA_RESTRICT p,
                                           const FA_T *FA_RESTRICT v, int64_t v_sl, int64_t nk,
                                           int tail, FA_T *FA_RESTRICT o, int64_t dvp,
                                           const FA_T *FA_RESTRICT alpha, int64_t brp)
{
    FA_V acc[FA_PV_R][FA_PV_NC];
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
            FA_V vv[FA_PV_NC];
            for (int c = 0; c < NC; c++) vv[c] = FA_VLOADU(v + j * v_sl + c * FA_VL);
            for (int r = 0; r < R; r++) {
                FA_V pb = FA_VSET1(p[j * brp + r]);
                for (int c = 0; c < NC; c++) acc[r][c] = FA_VFMA(pb, vv[c], acc[r][c]);
            }
        }
    } else {
        for (int64_t j = 0; j < nk; j++) {
            FA_V vv[FA_PV_NC];
            for (int c = 0; c < NC - 1; c++) vv[c] = FA_VLOADU(v + j * v_sl + c * FA_VL);
            vv[NC - 1] = FA_VLOADU_N(v + j * v_sl + (NC - 1) * FA_VL, tail);
            for (int r = 0; r < R; r++) {
                FA_V pb = FA_VSET1(p[j * brp + r]);
                for (int c = 0; c < NC; c++) acc[r][c] = FA_VFMA(pb, vv[c], acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++) FA_VSTORE(o + r * dvp + c * FA_VL, acc[r][c]);
}

#define FA_PV_CASE(R, NC)                                                                     \
    case (R) * 8 + (NC):                                                                      \
        if ((R) <= FA_PV_R && (NC) <= FA_PV_NC)                                               \
            FA_NAME(fa_pv_micro)(R, NC, p + i, vc, v_sl, nk, tail, o + i * dvp + c0, dvp, alpha + i, brp); \
        break;

/* Rescale the running output of nq rows and add this key block's P.V. */
static void FA_NAME(fa_pv_tile)(const FA_T *FA_RESTRICT p, int64_t nq, int64_t nk,
                                const FA_T *FA_RESTRICT v, int64_t v_sl, int64_t Dv,
                                FA_T *FA_RESTRICT o, int64_t dvp, const FA_T *FA_RESTRICT alpha,
                                int64_t brp)
{
    const int64_t chunk = (int64_t)FA_PV_NC * FA_VL;
    /* Value columns outer, query rows inner: one column chunk of the V tile stays in
     * L1 while every row group of the block streams it. */
    for (int64_t c0 = 0; c0 < Dv; c0 += chunk) {
        int64_t w = Dv - c0 < chunk ? Dv - c0 : chunk;
        int nc = (int)((w + FA_VL - 1) / FA_VL);
        int tail = (int)(w % FA_VL);
        const FA_T *vc = v + c0;
        for (int64_t i = 0; i < nq; i += FA_PV_R) {
            int r = (int)(nq - i < FA_PV_R ? nq - i : FA_PV_R);
            switch (r * 8 + nc) {
                FA_TILE_ROWS(FA_PV_CASE)
                default: break;
            }
        }
    }
}
#undef FA_PV_CASE

/* Hide the keys of a tile that causality hides from some of the block's rows:
 * row i (absolute q0 + i) sees key j (absolute j0 + jj) iff j0 + jj <= q0 + i + diag. */
static void FA_NAME(fa_causal_mask_tile)(FA_T *FA_RESTRICT s, int64_t nk, int nv, int64_t q0,
                                         int64_t j0, int64_t diag, int64_t brp)
{
    const int64_t lanes = (int64_t)nv * FA_VL;
    for (int64_t jj = 0; jj < nk; jj++) {
        int64_t first = j0 + jj - diag - q0; /* first row that sees this key */
        if (first <= 0) continue;
        if (first > lanes) first = lanes;
        FA_T *row = s + jj * brp;
        for (int64_t i = 0; i < first; i++) row[i] = -(FA_T)INFINITY;
    }
}

static void FA_NAME(fa_qblock)(const fa_params *p, const fa_blocks *bl, int64_t b, int64_t h,
                               int64_t q0, int64_t nq, int64_t kv_end, void *scratch)
{
    const int64_t brp = bl->q, bc = bl->k;
    const int64_t D = p->D, Dv = p->Dv;
    const int64_t g = h / (p->Hq / p->Hkv);
    const FA_T *q = (const FA_T *)p->q + b * p->q_sb + h * p->q_sh + q0 * p->q_sl;
    const FA_T *k = (const FA_T *)p->k + b * p->k_sb + g * p->k_sh;
    const FA_T *v = (const FA_T *)p->v + b * p->v_sb + g * p->v_sh;
    const int64_t dvp = FA_NAME(fa_round_up)(Dv, FA_VL);
    const int nv = (int)((nq + FA_VL - 1) / FA_VL);
    const int64_t diag = p->causal == FA_CAUSAL_BOTTOM_RIGHT ? p->Lk - p->Lq : 0;

    FA_T *qt = (FA_T *)scratch;
    FA_T *s = qt + FA_PIECE(D * brp);
    FA_T *o = s + FA_PIECE(bc * brp);
    FA_T *m = o + FA_PIECE(brp * dvp);
    FA_T *l = m + FA_PIECE(brp);
    FA_T *alpha = l + FA_PIECE(brp);

    FA_NAME(fa_pack_q)(q, p->q_sl, nq, D, (FA_T)p->scale, qt, brp);
    for (int64_t i = 0; i < nq * dvp; i++) o[i] = (FA_T)0;
    for (int64_t i = 0; i < (int64_t)nv * FA_VL; i++) {
        m[i] = -(FA_T)INFINITY;
        l[i] = (FA_T)0;
    }

    for (int64_t j0 = 0; j0 < kv_end; j0 += bc) {
        int64_t nk = kv_end - j0 < bc ? kv_end - j0 : bc;
        FA_NAME(fa_qk_tile)(qt, nv, k + j0 * p->k_sl, p->k_sl, nk, D, s, brp);
        if (p->causal != FA_CAUSAL_NONE && j0 + nk - 1 > q0 + diag)
            FA_NAME(fa_causal_mask_tile)(s, nk, nv, q0, j0, diag, brp);
        FA_NAME(fa_softmax_tile)(s, nk, nv, m, l, alpha, brp);
        FA_NAME(fa_pv_tile)(s, nq, nk, v + j0 * p->v_sl, p->v_sl, Dv, o, dvp, alpha, brp);
    }

    /* Normalize once.  A row that saw no visible key (l == 0) gives 0 and lse -inf;
     * a NaN row keeps its NaN in both. */
    FA_T *out = (FA_T *)p->out + b * p->o_sb + h * p->o_sh + q0 * p->o_sl;
    FA_T *lse = p->lse ? (FA_T *)p->lse + b * p->lse_sb + h * p->lse_sh + q0 * p->lse_sl : NULL;
    for (int64_t i = 0; i < nq; i++) {
        FA_T *orow = out + i * p->o_sl;
        const FA_T *acc = o + i * dvp;
        if (l[i] == (FA_T)0) {
            for (int64_t c = 0; c < Dv; c++) orow[c] = (FA_T)0;
            if (lse) lse[i * p->lse_sl] = -(FA_T)INFINITY;
        } else {
            /* one division per row, then multiplies (a vector divide costs ~10x) */
            const FA_T inv = (FA_T)1 / l[i];
            for (int64_t c = 0; c < Dv; c++) orow[c] = acc[c] * inv;
            if (lse) lse[i * p->lse_sl] = m[i] + (FA_T)log((double)l[i]);
        }
    }
}

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

#undef FA_PIECE
