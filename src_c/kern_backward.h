/*
 * kern_backward.h -- part of the kernel template (kernels_tmpl.h): the backward and
 * key mass, on the forward's pieces (fa_scores for the logits, the tile products for
 * every accumulation).  Instantiated for float32 and float64 only (not with 16-bit
 * K/V: FA_KV_HALF).
 *   fa_bwd_kv        dK, dV (and dQ in the one-pass schedules) of a key range of one
 *                    kv head, from all of that head's query items in order
 *   fa_bwd_q         dQ of one query item (the two-pass schedule)
 *   fa_bwd_reduce    dQ from the per-chunk sums (the chunk-parallel schedule)
 *   fa_mass_kv       key_mass of a key range of one kv head, from the forward's lse
 *
 * Needs from the including ISA file: what kern_forward.h needs.
 */

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
 *   lsev dvec brp  each row's lse (+inf for a row that sees no key; the backward
 *                  keeps -lse there, -inf) and D_i
 *   ones           max(bc, brp) ones (the accumulations' "no rescale")
 *   qa   brp x dkp dQ accumulator of one key chunk, qs brp x dkp their running sum
 * (the dK and dV accumulators of a key range are the caller's). */
typedef struct FA_NAME(fa_bscratch) {
    FA_NAME(fa_scratch) f;
    FA_T *dot, *don, *qr, *dp, *pz, *sg, *lsev, *dvec, *ones, *qa, *qs;
    uint8_t *keep;
#ifdef FA_BF16_BWD
    /* the products on bfloat16 pairs (kern_bf16bwd.h): dO feature pairs
     * ((fa_bw_width(Dv)+1)/2 x brp), Q and dO row pairs (fa_bw_rpairs(brp) x dkp, x
     * dvp), a tile's W or dS rows as row pairs (bc x fa_bw_rpairs(brp)), the V tile as
     * bfloat16 rows (bc x fa_bw_width(Dv)), and dQ's key pairs of dS (bc/2 x brp; on
     * the tiles brp x fa_amx_kpp(bc), transposed) and of K (bc/2, or fa_amx_kpp(bc), x
     * dkp) */
    uint32_t *dop, *qz, *doz, *w16, *pp, *kp;
    uint16_t *vb;
#endif
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
#ifdef FA_BF16_BWD
    {
        const size_t w = sizeof(uint32_t), rp = (size_t)FA_NAME(fa_bw_rpairs)((int64_t)brp);
#ifdef FA_BF16_AMX
        const size_t kp = (size_t)FA_NAME(fa_amx_kpp)((int64_t)bc);
#else
        const size_t kp = (bc + 1) / 2;
#endif
        const size_t fq = (size_t)(FA_NAME(fa_bw_width)(p->D) + 1) / 2, fo = (size_t)(FA_NAME(fa_bw_width)(p->Dv) + 1) / 2;
        sc->dop = (uint32_t *)FA_NAME(fa_carve)(&cur, fo * brp * w);
        sc->qz = (uint32_t *)FA_NAME(fa_carve)(&cur, rp * dkp * w);
        sc->doz = (uint32_t *)FA_NAME(fa_carve)(&cur, rp * dvp * w);
        sc->w16 = (uint32_t *)FA_NAME(fa_carve)(&cur, bc * rp * w);
        sc->pp = (uint32_t *)FA_NAME(fa_carve)(&cur, kp * brp * w);
        sc->kp = (uint32_t *)FA_NAME(fa_carve)(&cur, kp * dkp * w);
        sc->vb = (uint16_t *)FA_NAME(fa_carve)(&cur, bc * (size_t)FA_NAME(fa_bw_width)(p->Dv) * sizeof(uint16_t));
        sc->f.kr = cx->kr > 0 ? (uint16_t *)FA_NAME(fa_carve)(&cur, (size_t)cx->kr * (size_t)FA_NAME(fa_bw_width)(p->D) *
                                                                         sizeof(uint16_t))
                              : NULL;
        sc->f.vr = cx->kr > 0 ? (uint16_t *)FA_NAME(fa_carve)(&cur, (size_t)cx->kr * (size_t)FA_NAME(fa_bw_width)(p->Dv) *
                                                                         sizeof(uint16_t))
                              : NULL;
        sc->f.kr_b = sc->f.kr_g = -1;
        sc->f.kr_koff = sc->f.kr_j0 = sc->f.kr_n = 0;
        if (base) { /* the feature pairs past D and Dv (whole tiles): zero, never written */
            const size_t q0 = (size_t)(p->D + 1) / 2, o0 = (size_t)(p->Dv + 1) / 2;
            memset(sc->f.qp + q0 * brp, 0, (fq - q0) * brp * w);
            memset(sc->dop + o0 * brp, 0, (fo - o0) * brp * w);
        }
    }
#endif
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
        sc->lsev[r] = -(FA_T)INFINITY; /* padded lanes (-lse): P = 0 */
        sc->dvec[r] = (FA_T)0;
    }
    *lo_max = INT64_MIN;
    *hi_min = INT64_MAX;
#ifdef FA_BF16_BWD
    /* the pairs: padded rows and columns 0 */
    sc->f.bw = 1;
    memset(sc->qz, 0, (size_t)(FA_NAME(fa_bw_rpairs)(nr) * dkp) * sizeof(uint32_t));
    memset(sc->doz, 0, (size_t)(FA_NAME(fa_bw_rpairs)(nr) * dvp) * sizeof(uint32_t));
    for (int64_t r = nr; r < nvl; r++) {
        for (int64_t t = 0; t < (D + 1) / 2; t++) sc->f.qp[t * brp + r] = 0;
        for (int64_t t = 0; t < (Dv + 1) / 2; t++) sc->dop[t * brp + r] = 0;
    }
#endif
    for (int64_t r = 0; r < nr; r++) {
        const int64_t h = it->h0 + r / it->nq, row = it->qoff + it->q0 + r % it->nq;
        const FA_T *dor = (const FA_T *)bp->dout + it->b * bp->do_sb + h * bp->do_sh + row * bp->do_sl;
        const FA_T *qi = (const FA_T *)p->q + it->b * p->q_sb + h * p->q_sh + row * p->q_sl;
#ifdef FA_BF16_BWD
        FA_NAME(fa_bw_pack_row)(qi, D, r, sc->f.qp, brp, sc->qz, dkp);
        FA_NAME(fa_bw_pack_row)(dor, Dv, r, sc->dop, brp, sc->doz, dvp);
#else /* (the float32 products' copies) */
        for (int64_t d = 0; d < Dv; d++) sc->dot[d * brp + r] = dor[d];
        for (int64_t d = 0; d < dvp; d++) sc->don[r * dvp + d] = d < Dv ? dor[d] : (FA_T)0;
        for (int64_t d = 0; d < dkp; d++) sc->qr[r * dkp + d] = d < D ? qi[d] : (FA_T)0;
#endif
        const FA_T l = ((const FA_T *)p->lse)[it->b * p->lse_sb + h * p->lse_sh + row * p->lse_sl];
        sc->lsev[r] = l == -(FA_T)INFINITY ? -(FA_T)INFINITY : -l; /* -lse: P = exp(S - lse) is one add */
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
#ifdef FA_BF16_BWD
    sc->f.pscale = (FA_T)1; /* (fa_scores sets it where it leaves S unscaled) */
#endif
    if (!FA_NAME(fa_scores)(p, it, nr, nv, j0, nk, lo_max, hi_min, brp, &sc->f, 0)) return 0;
    /* (the element-wise passes below run the tile's rows in memory order: a tile can be
     * larger than L1, and strided reads of it wait on L2) */
    if (p->softcap > 0) { /* s holds y = s_raw / c: the derivative of c tanh(y) is 1 - tanh^2 */
        const FA_V one = FA_VSET1((FA_T)1), m2 = FA_VSET1((FA_T)-2);
        for (int64_t jj = 0; jj < nk; jj++)
            for (int c = 0; c < nv; c++) {
                const int64_t o = jj * brp + (int64_t)c * FA_VL;
                const FA_V e = FA_VEXP(FA_VMUL(m2, FA_VABS(FA_VLOAD(s + o))));
                const FA_V th = FA_VDIV(FA_VSUB(one, e), FA_VADD(one, e));
                FA_VSTORE(sc->sg + o, FA_VSUB(one, FA_VMUL(th, th)));
            }
    }
    FA_NAME(fa_logit_tile)(p, s, nk, 0, nv, nr, j0, brp, &sc->f, NULL);
    const FA_T *v = (const FA_T *)p->v + it->b * p->v_sb + it->g * p->v_sh + (it->koff + j0) * p->v_sl;
#ifdef FA_BF16_BWD
    const uint16_t *vb = FA_NAME(fa_bw_cached)(&sc->f, sc->f.vr, it, j0, nk, p->Dv);
    if (!vb) vb = FA_NAME(fa_bw_rows16)(v, p->v_sl, nk, p->Dv, sc->vb);
#ifdef FA_BF16_AMX
    {
        const int64_t dz = FA_NAME(fa_bw_width)(p->Dv);
        FA_NAME(fa_qk_tile_amx)(sc->dop, nv, vb, dz, nk, dz, sc->dp, brp, (FA_T)1, NULL, NULL);
    }
#else
    FA_NAME(fa_qk_tile_dp)(sc->dop, nv, vb, p->Dv, nk, p->Dv, sc->dp, brp, (FA_T)1, NULL);
#endif
#else
    FA_NAME(fa_qk_tile)(sc->dot, nv, v, p->v_sl, nk, p->Dv, sc->dp, brp, NULL);
#endif
    /* P = exp(S - lse) (hidden keys and padded rows: 0) and, without dropout, in the same
     * pass dS = P (dP - D_i) */
#ifdef FA_BF16_BWD /* exp(S pscale - lse), one rounding (pscale 1: S - lse) */
    const FA_V ps = FA_VSET1(sc->f.pscale);
#define FA_BW_ARG(x, nl) FA_VFMA(x, ps, nl)
#else
#define FA_BW_ARG(x, nl) FA_VADD(x, nl)
#endif
    const int drop = p->dropout_p > 0;
    for (int64_t jj = 0; jj < nk; jj++) {
        FA_T *x = s + jj * brp, *d = sc->dp + jj * brp;
        if (drop)
            for (int64_t off = 0; off < (int64_t)nv * FA_VL; off += FA_VL)
                FA_VSTORE(x + off, FA_VEXP(FA_BW_ARG(FA_VLOAD(x + off), FA_VLOAD(sc->lsev + off))));
        else
            for (int64_t off = 0; off < (int64_t)nv * FA_VL; off += FA_VL) {
                const FA_V pv = FA_VEXP(FA_BW_ARG(FA_VLOAD(x + off), FA_VLOAD(sc->lsev + off)));
                FA_VSTORE(x + off, pv);
                FA_VSTORE(d + off, FA_VMUL(pv, FA_VSUB(FA_VLOAD(d + off), FA_VLOAD(sc->dvec + off))));
            }
    }
#undef FA_BW_ARG
    *pw = s;
    if (drop) { /* dV takes P z; dS takes z dP */
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
        for (int64_t jj = 0; jj < nk; jj++)
            for (int64_t off = 0; off < (int64_t)nv * FA_VL; off += FA_VL) {
                const int64_t o = jj * brp + off;
                FA_VSTORE(sc->dp + o, FA_VMUL(FA_VLOAD(s + o), FA_VSUB(FA_VLOAD(sc->dp + o), FA_VLOAD(sc->dvec + off))));
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
        if (want_dq) /* (the tiles add 0 to the padded rows: they are set too) */
            memset(sc->qa, 0, (size_t)((int64_t)nv * FA_VL * dkp) * sizeof(FA_T));
        for (int64_t j0 = lo; j0 < hi; j0 += bc) {
            const int64_t nk = hi - j0 < bc ? hi - j0 : bc;
            const FA_T *w;
            if (!FA_NAME(fa_bwd_tile)(cx, it, nr, nv, j0, nk, lo_max, hi_min, sc, &w,
                                      want_dq && bp->ds != NULL))
                continue;
#ifdef FA_BF16_BWD
            if (ka) { /* the same sums over pairs of rows, W and dS rounded to bfloat16 */
                const int64_t ws = FA_NAME(fa_bw_rpairs)(brp), npairs = FA_NAME(fa_bw_rpairs)(nr);
#ifdef FA_BF16_AMX
#define FA_BW_KV FA_NAME(fa_bw_kv_tile_amx)
#else
#define FA_BW_KV FA_NAME(fa_bw_kv_tile)
#endif
                FA_NAME(fa_bw_tile16)(w, nk, nr, brp, sc->w16, ws);
                FA_BW_KV(sc->w16, ws, nk, sc->doz, dvp, npairs, dvp, va + (j0 - k0) * dvp, dvp);
                FA_NAME(fa_bw_tile16)(sc->dp, nk, nr, brp, sc->w16, ws);
                FA_BW_KV(sc->w16, ws, nk, sc->qz, dkp, npairs, dkp, ka + (j0 - k0) * dkp, dkp);
#undef FA_BW_KV
            }
            if (want_dq) { /* dS and K paired along the keys (K's bfloat16 rows: S's, if it made them) */
                const FA_T *kj = k + j0 * p->k_sl;
                const uint16_t *kb = FA_NAME(fa_bw_cached)(&sc->f, sc->f.kr, it, j0, nk, D);
                if (!kb && (sc->f.kb_src != kj || sc->f.kb_n < nk)) {
                    FA_NAME(fa_bw_rows16)(kj, p->k_sl, nk, D, sc->f.kb);
                    sc->f.kb_src = kj;
                    sc->f.kb_n = nk;
                }
                if (!kb) kb = sc->f.kb;
#ifdef FA_BF16_AMX
                FA_NAME(fa_pv_tile_amx)(sc->dp, nv, nk, kb, FA_NAME(fa_bw_width)(D), D, sc->qa, dkp, sc->ones, brp,
                                        sc->pp, sc->kp);
#else
                FA_NAME(fa_pv_tile_dp)(sc->dp, nr, nv, nk, kb, D, D, sc->qa, dkp, sc->ones, brp, sc->pp, sc->kp);
#endif
            }
#else
            if (ka) {
                /* dV[j] += sum_r w[j][r] dO[r]; dK[j] += sum_r dS[j][r] Q[r]: output rows
                 * are keys (stride brp in the tile), the reduction runs over the rows */
                FA_NAME(fa_pv_tile_strided)(w, nk, nr, sc->don, dvp, Dv, va + (j0 - k0) * dvp, dvp,
                                            sc->ones, 1, brp, nr);
                FA_NAME(fa_pv_tile_strided)(sc->dp, nk, nr, sc->qr, dkp, D, ka + (j0 - k0) * dkp, dkp,
                                            sc->ones, 1, brp, nr);
            }
            if (want_dq)
                FA_NAME(fa_pv_tile)(sc->dp, nr, nk, k + j0 * p->k_sl, p->k_sl, D, sc->qa, dkp, sc->ones, brp);
#endif
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

/* Element i of a gradient array: x itself, or rounded to bfloat16 where the caller's
 * gradients are bfloat16 (fa_bwd_params.grad16; float32 calls only). */
static inline void FA_NAME(fa_bw_put)(void *g, int64_t i, FA_T x, int g16)
{
    if (g16)
        ((uint16_t *)g)[i] = fa_float_to_bf16((float)x);
    else
        ((FA_T *)g)[i] = x;
}

/* Writes dq = scale * qs for the rows of `it`. */
static void FA_NAME(fa_bwd_store_dq)(const fa_bwd_ctx *cx, const fa_item *it, const FA_T *qs)
{
    const fa_bwd_params *bp = cx->bp;
    const int64_t D = bp->f.D, dkp = FA_NAME(fa_round_up)(D, FA_VL), nr = it->nh * it->nq;
    const FA_T scale = (FA_T)bp->f.scale;
    for (int64_t r = 0; r < nr; r++) {
        const int64_t h = it->h0 + r / it->nq, row = it->qoff + it->q0 + r % it->nq;
        const int64_t o = it->b * bp->dq_sb + h * bp->dq_sh + row * bp->dq_sl;
        for (int64_t d = 0; d < D; d++) FA_NAME(fa_bw_put)(bp->dq, o + d, scale * qs[r * dkp + d], bp->grad16);
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
#ifdef FA_BF16_BWD
    if (sc.f.kr && nk_all <= cx->kr) { /* the range's K and V rows as bfloat16, once for every item */
        const fa_item *i0 = items;
        const int64_t base = i0->koff + k0;
        FA_NAME(fa_bw_rows16)((const FA_T *)p->k + i0->b * p->k_sb + i0->g * p->k_sh + base * p->k_sl, p->k_sl, nk_all,
                              D, sc.f.kr);
        FA_NAME(fa_bw_rows16)((const FA_T *)p->v + i0->b * p->v_sb + i0->g * p->v_sh + base * p->v_sl, p->v_sl, nk_all,
                              Dv, sc.f.vr);
        sc.f.kr_b = i0->b;
        sc.f.kr_g = i0->g;
        sc.f.kr_koff = i0->koff;
        sc.f.kr_j0 = k0;
        sc.f.kr_n = nk_all;
    }
#endif
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
        const int64_t ok = b * bp->dk_sb + g * bp->dk_sh + (koff + k0 + jj) * bp->dk_sl;
        const int64_t ov = b * bp->dv_sb + g * bp->dv_sh + (koff + k0 + jj) * bp->dv_sl;
        for (int64_t d = 0; d < D; d++) FA_NAME(fa_bw_put)(bp->dk, ok + d, scale * ka[jj * dkp + d], bp->grad16);
        if (bp->grad16)
            for (int64_t d = 0; d < Dv; d++) FA_NAME(fa_bw_put)(bp->dv, ov + d, va[jj * dvp + d], 1);
        else
            memcpy((FA_T *)bp->dv + ov, va + jj * dvp, (size_t)Dv * sizeof(FA_T));
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
        const int64_t o = b * bp->dq_sb + h * bp->dq_sh + i * bp->dq_sl;
        for (int64_t d0 = 0; d0 < D; d0 += 4 * FA_VL) {
            const int64_t n = D - d0 < 4 * FA_VL ? D - d0 : 4 * FA_VL;
            for (int64_t d = 0; d < n; d++) tot[d] = part[r * dkp + d0 + d];
            for (int64_t c = 1; c < nch; c++)
                for (int64_t d = 0; d < n; d++) tot[d] += part[c * cx->part_sc + r * dkp + d0 + d];
            for (int64_t d = 0; d < n; d++) FA_NAME(fa_bw_put)(bp->dq, o + d0 + d, scale * tot[d], bp->grad16);
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
