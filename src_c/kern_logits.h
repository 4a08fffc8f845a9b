/*
 * kern_logits.h -- part of the kernel template (kernels_tmpl.h): the logits of a key
 * tile, steps 1-5 of the semantics (docs/semantics.md).
 *   fa_pack_q        a block's Q packed transposed and scaled (FA_VL rows at a time
 *                    through a register transpose where the ISA has one)
 *   fa_setup_rows    a block's rows: Q packed (fa_pack_q), each row's visible key
 *                    range (causal and window), ALiBi slope and position, and its
 *                    mask, bias and output row pointers
 *   fa_mask_tile     the mask of a tile transposed into bytes (skips hidden tiles)
 *   fa_bias_tile     the bias of a tile transposed
 *   fa_logit_tile    softcap, ALiBi, bias, mask, causal/window range, in that order
 *   fa_scores        one tile: QK^T (kern_products.h) and, if asked, the logit steps
 *
 * Needs from the including ISA file: the vector operations, FA_VEXP, FA_VABS,
 * FA_VDIV, FA_VCOPYSIGN, FA_VIN_RANGE, FA_VMASK_BYTES, and FA_VTRANSPOSE(_REGS) where
 * FA_HAVE_TRANSPOSE is defined; for 16-bit q, FA_16_TO_FLOAT.
 */

/* Row r of the item's block (query position q0 + r % nq of head h0 + r / nq), times
 * qscale, into column r of qt (qt[d * brp + r]); fa_setup_rows zeroes the padded
 * columns. */
static void FA_NAME(fa_pack_q)(const fa_params *p, const fa_item *it, int64_t nr, int64_t brp,
                               FA_T qscale, FA_T *FA_RESTRICT qt)
{
    const int64_t D = p->D;
    const void *rows[FA_VL];
    for (int64_t r0 = 0; r0 < nr; r0 += FA_VL) {
        const int n = (int)(nr - r0 < FA_VL ? nr - r0 : FA_VL);
        for (int t = 0; t < n; t++) {
            const int64_t r = r0 + t, h = it->h0 + r / it->nq, row = it->qoff + it->q0 + r % it->nq;
            const int64_t off = it->b * p->q_sb + h * p->q_sh + row * p->q_sl;
            rows[t] = fa_store16(p->q_store) ? (const void *)((const uint16_t *)p->q + off)
                                             : (const void *)((const FA_T *)p->q + off);
        }
        int64_t d = 0;
#ifdef FA_HAVE_TRANSPOSE
        /* a whole group: FA_VL features of each row loaded, transposed in registers and
         * stored as whole vectors (the same products as the scalar loop, which made
         * D strided stores a row: 10% of a B32 H8 L64 call, AMD EPYC Zen 3).  A 16-bit
         * q (16-bit K/V's type) is converted as it is loaded, as K/V's rows are (the
         * scalar conversion was 6% of a float16 B4 H16 L256 call, AMD EPYC with AVX2) */
        const int q16 = fa_store16(p->q_store);
#ifdef FA_KV_HALF
#define FA_Q_LOADU(t, e) (q16 ? FA_KV_LOADU((const FA_KV *)rows[t] + (e)) : FA_VLOADU((const FA_T *)rows[t] + (e)))
#define FA_Q16_VEC 1
#else
#define FA_Q_LOADU(t, e) FA_VLOADU((const FA_T *)rows[t] + (e))
#define FA_Q16_VEC 0
#endif
        if (n == FA_VL && (FA_Q16_VEC || !q16)) {
            const FA_V qs = FA_VSET1(qscale);
            for (; d + FA_VL <= D; d += FA_VL) {
                FA_V x[FA_VL];
                for (int t = 0; t < FA_VL; t++) x[t] = FA_Q_LOADU(t, d);
                FA_VTRANSPOSE_REGS(x);
                for (int t = 0; t < FA_VL; t++) FA_VSTORE(qt + (d + t) * brp + r0, FA_VMUL(qs, x[t]));
            }
        }
#undef FA_Q_LOADU
#undef FA_Q16_VEC
#endif
        for (int t = 0; t < n; t++) {
#ifdef FA_KV_HALF
            if (fa_store16(p->q_store)) {
                const uint16_t *qh = (const uint16_t *)rows[t];
                for (int64_t e = d; e < D; e++) qt[e * brp + r0 + t] = qscale * (FA_T)FA_16_TO_FLOAT(qh[e]);
                continue;
            }
#endif
            const FA_T *qi = (const FA_T *)rows[t];
            for (int64_t e = d; e < D; e++) qt[e * brp + r0 + t] = qscale * qi[e];
        }
    }
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
    const int64_t diag = fa_diag0(p, Lq, Lk), adiag = fa_alibi0(p, Lq, Lk);
    const int64_t left = p->window_left, right = p->window_right;
    const int causal = p->causal != FA_CAUSAL_NONE;
    /* the padding rows nr .. nvl: zero, a run of nvl - nr elements in each of the
     * transposed tiles' rows (element by element down the rows, a decode item's 15
     * padding rows of Q took 9% of an int4 cache's decode time, Emerald Rapids) */
    const size_t pad = (size_t)(nvl - nr);
    for (int64_t r = nr; r < nvl; r++) {
        sc->lo[r] = 0;
        sc->hi[r] = -1;
        sc->slope[r] = sc->apos[r] = (FA_T)0;
    }
    if (pad) {
        if (!sc->q_own)
            for (int64_t d = 0; d < D; d++) memset(sc->qt + d * brp + nr, 0, pad * sizeof(FA_T));
        if (sc->mt)
            for (int64_t j = 0; j < bc; j++) memset(sc->mt + j * brp + nr, 0, pad * sizeof(*sc->mt));
        if (sc->bt)
            for (int64_t j = 0; j < bc; j++) memset(sc->bt + j * brp + nr, 0, pad * sizeof(FA_T));
    }
    /* Q packed, unless the block lays Q out itself (the AMX rows block's short calls
     * spent 7% of their samples packing Q pairs it then overwrote) */
    if (!sc->q_own) {
#ifdef FA_BF16_DP
        /* bfloat16 q, k, v and a prefill call: the products take bfloat16 pairs */
        if (sc->dp)
            FA_NAME(fa_pack_q_pairs)(p, it, nr, nvl, brp, sc->qp);
        else
#endif
            FA_NAME(fa_pack_q)(p, it, nr, brp, qscale, sc->qt);
    }
    for (int64_t r = 0; r < nr; r++) {
        const int64_t h = it->h0 + r / it->nq, i = it->q0 + r % it->nq, row = it->qoff + i;
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
        sc->apos[r] = (FA_T)(i + adiag); /* ALiBi distance is |apos - j| */
        if (p->mask) sc->mrow[r] = p->mask + it->b * p->mask_sb + h * p->mask_sh + row * p->mask_sq;
        if (p->bias)
            sc->brow[r] = (const FA_T *)p->bias + it->b * p->bias_sb + h * p->bias_sh + row * p->bias_sq;
        if (!p->weights) {
            const int64_t o = it->b * p->o_sb + h * p->o_sh + row * p->o_sl;
            sc->orow[r] = fa_store16(p->out_store) ? (void *)((uint16_t *)p->out + o) : (void *)((FA_T *)p->out + o);
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

/* A decode tile whose key-major logits (row r at from + r * bcp) came with the last
 * tile's P.V (fa_pv_qk, where fa_scores would have made them key-major): into sc->s,
 * and the tile's state as fa_scores leaves it for them. */
static void FA_NAME(fa_scores_taken)(FA_NAME(fa_scratch) *sc, int64_t nr, const FA_T *from)
{
    sc->cmx_valid = 0;
#if defined(FA_KV_HALF) && defined(FA_F32)
    sc->vf_shared = NULL;
#endif
    sc->mask_state = 2;
    sc->need_range = 0;
    sc->key_major = 1;
    memcpy(sc->s, from, (size_t)(nr * sc->bcp) * sizeof(FA_T));
}

/* One key tile through step 1 (QK^T), and through steps 2-5 (fa_logit_tile) too if
 * `logits`; otherwise the caller applies fa_logit_tile column by column, while each
 * column is in L1 for its softmax.  Returns 0 if the mask hides the whole tile
 * (nothing was computed). */
static int FA_NAME(fa_scores)(const fa_params *p, const fa_item *it, int64_t nr, int nv,
                              int64_t j0, int64_t nk, int64_t lo_max, int64_t hi_min,
                              int64_t brp, FA_NAME(fa_scratch) *sc, int logits)
{
    sc->cmx_valid = 0;
#if defined(FA_KV_HALF) && defined(FA_F32)
    sc->vf_shared = NULL;
#endif
    sc->mask_state = p->mask ? FA_NAME(fa_mask_tile)(p, nr, j0, nk, brp, sc) : 2;
    if (sc->mask_state == 0) return 0;
    sc->need_range = lo_max > j0 || hi_min < j0 + nk - 1;
    /* A few rows (decoding) and no logit step on this tile: the logits are stored
     * key-major, row r at s + r * bcp, for fa_softmax_row (the same bits). */
    sc->key_major = FA_NAME(fa_few_rows)(nr, sc) && !logits && !sc->query_major && !p->weights && !p->entropy &&
                    sc->mask_state == 2 && !sc->need_range && !(p->softcap > 0) && !p->alibi &&
                    !p->bias;
    const int64_t ksx = sc->key_major ? 1 : brp; /* where logit (row r, key j) goes */
    const int64_t rsx = sc->key_major ? sc->bcp : 1;
    if (FA_NAME(fa_few_rows)(nr, sc) && p->k_lanes && (it->koff + j0) % FA_VL == 0) {
        /* K on the lanes (fastattn.KVCache): the blocks read in place, as they are */
        FA_NAME(fa_qk_lanes)(p, it, sc->qt, brp, nr, j0, nk, sc->s, ksx, rsx);
    } else if (FA_NAME(fa_few_rows)(nr, sc) && sc->kst && FA_NAME(fa_by_segment)(p, 0)) {
        /* a paged or int8 cache's tile, page by page in place */
        int64_t len, next_len = 0;
        const char *kr = FA_NAME(fa_kv_segment)(p, it, j0, nk, 0, 0, &len);
        for (int64_t a = 0; a < nk; a += len, len = next_len) {
            /* the segment after this one (past this tile's end, the next tile's first):
             * its rows are prefetched as this one's are read */
            const int64_t b = j0 + a + len;
            const char *after = b < it->kv1 ? FA_NAME(fa_kv_segment)(p, it, b, b < j0 + nk ? j0 + nk - b : 1,
                                                                      0, 0, &next_len)
                                            : NULL;
#ifdef FA_HAVE_I8_PRODUCTS
            if (p->kv_store == FA_STORE_I8) {
                int64_t slen;
                const float *sr = (const float *)(const void *)FA_NAME(fa_kv_segment)(p, it, j0 + a, len, 0, 1, &slen);
                FA_NAME(fa_qk_keys_i8)(sc->qt, brp, nr, (const int8_t *)kr, p->k_sl, sr, p->ks_sl,
                                       FA_NAME(fa_group_shift)(p, 0), after, len, p->D, sc->s + a * ksx,
                                       ksx, rsx);
            } else
#endif
                FA_NAME(fa_qk_keys)(sc->qt, brp, nr, (const FA_KV *)(const void *)kr, p->k_sl, after,
                                    len, p->D, sc->s + a * ksx, sc->kt, ksx, rsx);
            kr = after;
        }
    } else { /* in place, or staged (fa_kv_tile) */
        int64_t k_sl;
        const FA_KV *k = FA_NAME(fa_kv_tile)(p, it, j0, nk, 0, sc->kst, &k_sl);
        if (FA_NAME(fa_few_rows)(nr, sc)) /* a few rows (decoding): keys on the lanes, the same bits */
            FA_NAME(fa_qk_keys)(sc->qt, brp, nr, k, k_sl, NULL, nk, p->D, sc->s, sc->kt, ksx, rsx);
        else {
            /* a forward tile with no logit step: its max comes with the product
             * (sc->cmx, for fa_softmax_tile), and the softmax reads the tile once */
            sc->cmx_valid = !logits && !sc->query_major && !FA_NAME(fa_has_logit_steps)(p, sc);
            if (sc->cmx_valid)
                for (int64_t i = 0; i < (int64_t)nv * FA_VL; i++) sc->cmx[i] = -(FA_T)INFINITY;
            /* only the query vectors that see a key of the tile (sc->vlive: fa_qblock's
             * float32 and float64 tiles; the pairs and the backward take all) */
            int lc0, lc1;
            int64_t lv0, lv1;
            FA_NAME(fa_live_range)(sc, nv, nr, &lc0, &lc1, &lv0, &lv1);
            const int lnv = lc1 - lc0;
#ifdef FA_BF16_BWD
            if (sc->bw) { /* the backward on pairs: the K tile as bfloat16 rows, then pairs */
                /* with no logit step the scale waits for P's exponent (one pass less) */
                const int fold = !FA_NAME(fa_has_logit_steps)(p, sc);
                const FA_T scale = fold ? (FA_T)1 : (FA_T)(p->softcap > 0 ? p->scale / p->softcap : p->scale);
                sc->pscale = fold ? (FA_T)p->scale : (FA_T)1;
                const uint16_t *kb = FA_NAME(fa_bw_cached)(sc, sc->kr, it, j0, nk, p->D);
                if (!kb) {
                    kb = FA_NAME(fa_bw_rows16)(k, k_sl, nk, p->D, sc->kb);
                    sc->kb_src = k;
                    sc->kb_n = nk;
                }
#ifdef FA_BF16_AMX /* (rows and Q's pairs zero past D to whole tiles: no staging) */
                const int64_t dz = FA_NAME(fa_bw_width)(p->D);
                FA_NAME(fa_qk_tile_amx)(sc->qp, nv, kb, dz, nk, dz, sc->s, brp, scale, NULL, NULL);
#else
                FA_NAME(fa_qk_tile_dp)(sc->qp, nv, kb, p->D, nk, p->D, sc->s, brp, scale, NULL);
#endif
            } else
#endif
#ifdef FA_BF16_DP
            if (sc->dp)
#ifdef FA_BF16_AMX
                FA_NAME(fa_qk_tile_amx)(sc->qp, nv, k, k_sl, nk, p->D, sc->s, brp,
                                        (FA_T)(p->softcap > 0 ? p->scale / p->softcap : p->scale),
                                        sc->cmx_valid ? sc->cmx : NULL, sc->kz);
#else
                FA_NAME(fa_qk_tile_dp)(sc->qp, nv, k, k_sl, nk, p->D, sc->s, brp,
                                       (FA_T)(p->softcap > 0 ? p->scale / p->softcap : p->scale),
                                       sc->cmx_valid ? sc->cmx : NULL);
#endif
            else
#endif
#if defined(FA_KV_HALF) && defined(FA_F32)
            {
                /* 16-bit K: the tile as float32 once, for the float32 product; a whole
                 * block from the call's shared ones (with V) where it has them */
                const float *kf = logits ? NULL : FA_NAME(fa_f32_shared)(p, it, j0, nk, k, k_sl, sc, &sc->vf_flag);
                if (kf) sc->vf_shared = kf + nk * p->D;
                FA_F32(fa_qk_tile)(sc->qt + lv0, lnv, kf ? kf : FA_NAME(fa_tile_f32)(k, k_sl, nk, p->D, sc->kf),
                                   p->D, nk, p->D, sc->s + lv0, brp, sc->cmx_valid ? sc->cmx + lv0 : NULL);
            }
#else
                FA_NAME(fa_qk_tile)(sc->qt + lv0, lnv, k, k_sl, nk, p->D, sc->s + lv0, brp,
                                    sc->cmx_valid ? sc->cmx + lv0 : NULL);
#endif
        }
    }
    if (sc->need_range) {
        const int64_t nvl = (int64_t)nv * FA_VL;
        for (int64_t r = 0; r < nvl; r++) { /* exact small integers in FA_T */
            int64_t a = sc->lo[r] - j0, z = sc->hi[r] - j0;
            sc->rlo[r] = (FA_T)(a < -1 ? -1 : a > nk ? nk : a);
            sc->rhi[r] = (FA_T)(z < -1 ? -1 : z > nk ? nk : z);
        }
    }
    if (logits) {
        int lc0, lc1;
        int64_t lr0, lr1;
        FA_NAME(fa_live_range)(sc, nv, nr, &lc0, &lc1, &lr0, &lr1);
        FA_NAME(fa_logit_tile)(p, sc->s, nk, lc0, lc1, nr, j0, brp, sc, NULL);
    }
    return 1;
}
