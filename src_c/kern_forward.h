/*
 * kern_forward.h -- part of the kernel template (kernels_tmpl.h): the forward block.
 *   fa_qblock        one work item (the rows of a few query heads that share a kv
 *                    head, against its visible keys): key chunks of FA_CHUNK_KEYS from
 *                    key 0, each by the online softmax over tiles aligned from key 0,
 *                    merged in order; the output rows, lse and stats; or, for
 *                    attention_weights, a second pass writing exp(s - lse).  Prefill
 *                    blocks and decode rows (a few rows: keys on the lanes, key-major
 *                    softmax, P.V checked after the fact) both go through it.
 *   fa_v_finite, fa_all_finite, fa_pv_tile_nonfinite   the careful P.V for a V tile
 *                    with an inf or NaN (0 * inf must not reach rows that hide the key)
 *   fa_dropout_apply the Philox keep/scale decisions on a tile of probabilities
 *   fa_exp_array     the vector exp over an array (for the ULP test)
 *   fa_fma_chains    FA_PEAK_CHAINS independent FMA chains (fastattn.bench.fma_peak)
 *   fa_read_streams  FA_READ_STREAMS runs read side by side (fastattn.bench.read_bandwidth)
 *
 * Needs from the including ISA file: everything the other pieces need, and FA_VSTOREU,
 * FA_VLOADU_N; for 16-bit outputs, FA_FLOAT_TO_16.
 */

#if !(defined(FA_KV_HALF) && defined(FA_F32)) /* (16-bit V: the float32 one, on a float32 tile) */
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
#endif

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

/* a * b + c as the kernel's P.V computes it (FA_VFMA: fused where the ISA file's is), so
 * that a row has the same bits through the careful path below as through the tile's,
 * whatever the compiler does with a scalar `c += a * b` (a sanitizer build left it unfused,
 * and rows whose tile was cut short of a NaN by a smaller block then differed by 1 ulp) */
static inline FA_T FA_NAME(fa_fma1)(FA_T a, FA_T b, FA_T c)
{
    FA_T t[FA_VL];
    FA_VSTOREU(t, FA_VFMA(FA_VSET1(a), FA_VSET1(b), FA_VSET1(c)));
    return t[0];
}

/* P.V for a tile whose V holds an inf or NaN.  A hidden key has p = 0, and 0 * inf
 * would put a NaN into rows that never see that value; so here only the visible
 * (row, key) pairs are added, visibility read from the tile's logits recomputed
 * into s2 (-inf = hidden).  Rare: the common path never comes here. */
static void FA_NAME(fa_pv_tile_nonfinite)(const fa_params *p, const fa_item *it, int64_t nr, int nv,
                                          int64_t j0, int64_t nk, int64_t lo_max, int64_t hi_min,
                                          int64_t brp, FA_NAME(fa_scratch) *sc, const FA_KV *v,
                                          int64_t v_sl, int64_t dvp, int pvt)
{
    /* the running output row-major (sc->o, rows dvp apart) or, pvt, transposed (sc->ot,
     * fa_pvt_tile's layout: a row's channels brp apart) */
    FA_T *const obase = pvt ? sc->ot : sc->o;
    const int64_t ors = pvt ? 1 : dvp, ocs = pvt ? brp : 1;
    FA_T *prob = sc->s;
    const int64_t pk = sc->key_major ? 1 : brp, pr = sc->key_major ? sc->bcp : 1;
    sc->s = sc->s2;
    FA_NAME(fa_scores)(p, it, nr, nv, j0, nk, lo_max, hi_min, brp, sc, 1);
    sc->s = prob;
    /* the tile's live rows (fa_qblock): the others' logits and alpha are not this tile's */
    int v0, v1;
    int64_t r0, r1;
    FA_NAME(fa_live_range)(sc, nv, nr, &v0, &v1, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        FA_T *o = obase + r * ors;
        if (sc->alpha[r] != (FA_T)1)
            for (int64_t c = 0; c < p->Dv; c++) o[c * ocs] *= sc->alpha[r];
        for (int64_t jj = 0; jj < nk; jj++) {
            if (sc->s2[jj * brp + r] == -(FA_T)INFINITY) continue;
            const FA_T pj = prob[jj * pk + r * pr];
            const FA_KV *vr = v + jj * v_sl;
            for (int64_t c = 0; c < p->Dv; c++)
                o[c * ocs] = FA_NAME(fa_fma1)(pj, (FA_T)FA_KV_SCALAR(vr[c]), o[c * ocs]);
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

/* The end of a block: each row's merged result (or, single, its one chunk: sc->o, m, l)
 * normalized, the sinks folded in, lse and the statistics written, and the output row
 * stored (unless attention_weights are wanted).  A row that saw no visible key gives 0
 * and lse -inf; a NaN row keeps its NaN in both.  mM is left holding each row's lse.
 * For an item of split-KV partials (it->part_o, fa_decode_split), single, the rows of
 * chunk c (from key 0): c * part_o elements past the output row, c * part_lse past lse. */
static void FA_NAME(fa_write_rows)(const fa_params *p, const fa_item *it, int64_t nr, int single,
                                   int64_t dvp, FA_NAME(fa_scratch) *sc, int64_t c)
{
    const int64_t Dv = p->Dv, o_at = c * it->part_o, lse_at = c * it->part_lse;
    /* whether anything reads a row's lse: without, a one-chunk row skips its log (1.9%
     * of a short AMX prefill's samples; the output is the same o / l) */
    const int want_lse = p->lse || p->sinks || p->entropy || p->weights;
    /* a one-chunk row goes to the output normalized in one pass (o / l: the bits of
     * normalizing it in place and copying it), where nothing rewrites it after: no
     * sink to fold, no weights, no 16-bit output (for B32 H8 L64, 1 thread, the pass
     * in place and the copy were 5.5% and 3.2% of the samples; in one process,
     * interleaved, medians of 60, AMD EPYC Zen 4, the time without against with:
     * B32 H8 L64 1.02x on 1 and 2 threads, B8 H32 L128 1.016x / 1.009x, B4 H16 L256
     * 1.005x / 1.011x) */
    int direct = single && !p->sinks && !p->weights;
#ifdef FA_KV_HALF
    if (fa_store16(p->out_store)) direct = 0;
#endif
    for (int64_t r = 0; r < nr; r++) {
        const int64_t h = it->h0 + r / it->nq, row = it->qoff + it->q0 + r % it->nq;
        const int64_t lo_ = it->b * p->lse_sb + h * p->lse_sh + row * p->lse_sl + lse_at;
        /* (a partial's rows are FA_T: the split's partials are in the compute dtype) */
        void *orow = o_at ? (void *)((FA_T *)sc->orow[r] + o_at) : sc->orow[r];
        FA_T *acc = single ? sc->o + r * dvp : sc->mo + r * dvp;
        const FA_T tot = sc->mtot[r];
        FA_T lse_r;
        if (!single)
            lse_r = fa_merge_finish(sc->mM[r], tot, acc, Dv);
        else if (sc->l[r] == (FA_T)0) { /* no visible key */
            for (int64_t c = 0; c < Dv; c++) acc[c] = (FA_T)0;
            lse_r = -(FA_T)INFINITY;
        } else if (direct) {
            FA_NAME(fa_chunk_norm)((FA_T *)orow, acc, sc->l[r], Dv);
            lse_r = want_lse ? FA_NAME(fa_chunk_lse)(sc->m[r], sc->l[r]) : (FA_T)0; /* (0: read by nothing) */
        } else if (want_lse)
            lse_r = FA_NAME(fa_chunk_row)(acc, sc->m[r], sc->l[r], Dv);
        else {
            FA_NAME(fa_chunk_norm)(acc, acc, sc->l[r], Dv);
            lse_r = (FA_T)0; /* (read by nothing) */
        }
        const FA_T lse_k = lse_r, sink = p->sinks ? ((const FA_T *)p->sinks)[h] : -(FA_T)INFINITY;
        if (p->sinks) lse_r = fa_sink_fold(lse_k, sink, acc, Dv);
        if (p->lse) ((FA_T *)p->lse)[lo_] = lse_r;
        if (p->entropy) { /* H = G / tot + log tot; the largest weight exp(X - lse) */
            const int none = lse_k == -(FA_T)INFINITY;
            FA_T H = none ? (FA_T)0 : sc->mG[r] / tot + (FA_T)log((double)tot);
            FA_T X = none ? (FA_T)0 : (FA_T)exp((double)(sc->mX[r] - lse_k));
            if (sink != -(FA_T)INFINITY) {
                /* over the keys and the sink: the keys hold c = exp(lse_k - lse) of the
                 * mass, the sink s = exp(sink - lse), so H = c (H_k - log c) - s log s */
                const double lc = (double)lse_k - (double)lse_r, ls = (double)sink - (double)lse_r;
                const double c = exp(lc), sw = exp(ls);
                H = (FA_T)((none ? 0.0 : c * ((double)H - lc)) - sw * ls);
                X = (FA_T)(c * (double)X > sw ? c * (double)X : sw);
            }
            ((FA_T *)p->entropy)[lo_] = H;
            ((FA_T *)p->max_weight)[lo_] = X;
        }
        sc->mM[r] = lse_r;
        if (p->weights || (direct && sc->l[r] != (FA_T)0)) continue; /* (written above) */
#ifdef FA_KV_HALF
        if (fa_store16(p->out_store)) {
            FA_ROW_TO_16((uint16_t *)orow, acc, Dv);
            continue;
        }
#endif
        memcpy(orow, acc, (size_t)Dv * sizeof(FA_T));
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

    int64_t lo_max = INT64_MIN, hi_min = INT64_MAX;
    for (int64_t r = 0; r < nr; r++) {
        if (sc.lo[r] > lo_max) lo_max = sc.lo[r];
        if (sc.hi[r] < hi_min) hi_min = sc.hi[r];
    }
    for (int64_t i = 0; i < nvl; i++) {
        sc.mM[i] = sc.mX[i] = -(FA_T)INFINITY;
        sc.mtot[i] = sc.mG[i] = (FA_T)0;
    }

    /* The visible keys in chunks of ck (FA_CHUNK_KEYS, see fa_chunk_keys) from key 0,
     * each by the online softmax over its tiles (and P.V unless only the weights are
     * wanted), then merged into the running result.  Tiles start at multiples of bc
     * from key 0 (not at this block's first visible key), so a row meets the same
     * tiles and chunks in every call it is part of. */
    const int64_t kv0 = it->kv0 / bc * bc, ck = bl->chunk;
    /* One chunk (at most ck keys, short sequences): merging it alone only
     * copies it, so its rows go from sc.o to the output as fa_fold_chunk and
     * fa_merge_finish would leave them (fa_chunk_row: o / l, lse = m + log l, the
     * same bits), without the merge's two passes over the rows. */
    const int single = it->kv1 > kv0 && kv0 / ck == (it->kv1 - 1) / ck && !sc.u &&
                       !p->weights;
    /* split-KV partials (it->part_o: fa_decode_split): each chunk's rows go out as a
     * one-chunk item's would, to that chunk's partial, instead of merged here */
    const int parts = it->part_o != 0;
    /* pvt: this block's P.V runs with the output transposed (fa_pvt_tile, on the ISAs
     * that define FA_PV_T: prefill blocks, not the pairs), into sc.ot, turned back into
     * sc.o's rows at each chunk's end (fa_pvt_rows) */
#ifdef FA_PV_T
    int pvt = !FA_NAME(fa_few_rows)(nr, &sc) && !p->weights;
#ifdef FA_BF16_DP
    if (sc.dp) pvt = 0;
#endif
#else
    const int pvt = 0;
#endif
    /* the live query vectors of each tile (below): prefill tiles of the float32 and
     * float64 products, not the pairs, and not the weights' pass, which reads them all */
    int live_rows = !FA_NAME(fa_few_rows)(nr, &sc) && !p->weights;
#ifdef FA_BF16_DP
    if (sc.dp) live_rows = 0;
#endif
    /* A decode block's P.V of one tile and QK^T of the next in one loop (fa_pv_qk) on
     * x86 CPUs other than AMD's (fa_cpu_pf_l2), where it was measured (Sapphire Rapids
     * class Xeon); next_ready: the tile's logits came with the last tile's P.V, in sc.s's
     * rows from FA_PVQK_ROW.  The next tile may be the next chunk's first (a logit does
     * not depend on the chunk's softmax). */
    const int fuse = FA_NAME(fa_few_rows)(nr, &sc) && nr <= 2 && p->k_lanes && !p->mask && fa_cpu_pf_l2();
    int next_ready = 0;
    for (int64_t c0 = kv0 / ck * ck; c0 < it->kv1; c0 += ck) {
        const int64_t lo = kv0 > c0 ? kv0 : c0, hi = it->kv1 - c0 < ck ? it->kv1 : c0 + ck;
        if (pvt)
            for (int64_t d = 0; d < dvp; d++)
                for (int64_t i = 0; i < nvl; i++) sc.ot[d * brp + i] = (FA_T)0;
        else
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
             * QK^T and the softmax run (measured on AMD: 3-7% faster; for float32 V, twice
             * the bytes, the same prefetches were 9% slower than the hardware's).  Not on
             * Intel: there the instructions behind a burst of prefetches wait for the
             * line fill buffers (Emerald Rapids, a float16 KVCache, B1 H32 Lk8192 D128,
             * 1 thread: the loop held 21% of the call's samples) */
            if (FA_NAME(fa_few_rows)(nr, &sc) && (!sc.vst || (p->k_lanes && p->kv_store != FA_STORE_I8)) &&
                fa_cpu_amd()) {
                const FA_KV *v = (const FA_KV *)p->v + it->b * p->v_sb + it->g * p->v_sh +
                                 (it->koff + j0) * p->v_sl;
                for (int64_t j = 0; j < nk; j++)
                    for (int64_t c = 0; c < Dv; c += 64 / (int64_t)sizeof(FA_KV))
                        __builtin_prefetch(v + j * p->v_sl + c);
            }
#endif
            /* a paged cache's V rows, page by page, the same way (the pages' rows are
             * not where the hardware looks next); on AMD, as the burst above */
            if (FA_NAME(fa_few_rows)(nr, &sc) && sc.vst && p->block_table && FA_NAME(fa_by_segment)(p, 1) &&
                fa_cpu_amd()) {
                const int64_t esz = p->kv_store == FA_STORE_I8 ? 1 : (int64_t)sizeof(FA_KV);
                for (int64_t a = 0, len; a < nk; a += len) {
                    const char *vr = FA_NAME(fa_kv_segment)(p, it, j0 + a, nk - a, 1, 0, &len);
                    for (int64_t j = 0; j < len; j++)
                        for (int64_t c = 0; c < Dv * esz; c += 64) __builtin_prefetch(vr + j * p->v_sl * esz + c);
                }
            }
            /* A prefill tile where some rows see none of its keys (the diagonal of a
             * causal block, a window's edges): the products and the softmax run on the
             * query vectors from the first to the last that see one (vc0 .. vc1-1).  A
             * row outside them would have had p = 0 for every key and alpha = 1: its m,
             * l and output stay as they are. */
            sc.vlive = 0;
            if (live_rows && (lo_max > j0 || hi_min < j0 + nk - 1)) {
                int64_t first = -1, last = -1;
                for (int64_t r = 0; r < nr; r++)
                    if (sc.lo[r] <= sc.hi[r] && sc.lo[r] < j0 + nk && sc.hi[r] >= j0) {
                        if (first < 0) first = r;
                        last = r;
                    }
                if (first < 0) continue; /* no row sees the tile */
                sc.vc0 = (int)(first / FA_VL);
                sc.vc1 = (int)(last / FA_VL + 1);
                sc.vlive = sc.vc0 > 0 || sc.vc1 < nv;
            }
            int vc0, vc1;
            int64_t lr0, lr1;
            FA_NAME(fa_live_range)(&sc, nv, nr, &vc0, &vc1, &lr0, &lr1);
            const int64_t lnr = lr1 - lr0;
            if (next_ready) { /* (fa_scores's key-major logits, as it leaves them) */
                FA_NAME(fa_scores_taken)(&sc, nr, sc.s + FA_PVQK_ROW * sc.bcp);
                next_ready = 0;
            } else if (!FA_NAME(fa_scores)(p, it, nr, nv, j0, nk, lo_max, hi_min, brp, &sc, 0))
                continue;
            if (sc.key_major)
                for (int64_t r = 0; r < nr; r++)
                    FA_NAME(fa_softmax_row)(sc.s + r * sc.bcp, nk, sc.m + r, sc.l + r, sc.alpha + r);
            else if (!FA_NAME(fa_has_logit_steps)(p, &sc))
                FA_NAME(fa_softmax_tile)(sc.s, nk, vc0, vc1, sc.m, sc.l, sc.alpha, brp,
                                         sc.cmx_valid ? (const FA_V *)(const void *)(sc.cmx + lr0) : NULL, sc.u);
            else /* column by column, each column's logits in L1 for its softmax */
                for (int c = vc0; c < vc1; c++) {
                    FA_V colmax;
                    const int known = FA_NAME(fa_logit_tile)(p, sc.s, nk, c, c + 1, nr, j0, brp, &sc, &colmax);
                    FA_NAME(fa_softmax_tile)(sc.s, nk, c, c + 1, sc.m, sc.l, sc.alpha, brp,
                                             known ? &colmax : NULL, sc.u);
                }
            if (p->weights) continue;
            if (p->dropout_p > 0) /* after the softmax's sums: lse is that of the undropped weights */
                FA_NAME(fa_dropout_apply)(p, it, nr, j0, nk, sc.s, sc.key_major ? 1 : brp,
                                          sc.key_major ? sc.bcp : 1);
            if (FA_NAME(fa_few_rows)(nr, &sc) && sc.vst && FA_NAME(fa_by_segment)(p, 1) &&
                (p->kv_store != FA_STORE_I8 || nr <= FA_PV_SEQ_ROWS)) {
                /* a paged or int8 cache's V tile, page by page in place (int8 in
                 * registers), checked like the in-place tiles below; the rescale by
                 * alpha once, with the first page */
                const int64_t ksx = sc.key_major ? 1 : brp, rsx = sc.key_major ? sc.bcp : 1;
                memcpy(sc.o2, sc.o, (size_t)(nr * dvp) * sizeof(FA_T));
                for (int64_t a = 0, len; a < nk; a += len) {
                    const char *vr = FA_NAME(fa_kv_segment)(p, it, j0 + a, nk - a, 1, 0, &len);
                    const FA_T *al = a == 0 ? sc.alpha : sc.ones;
#ifdef FA_HAVE_I8_PRODUCTS
                    if (p->kv_store == FA_STORE_I8) {
                        const float *sr = (const float *)(const void *)FA_NAME(fa_kv_segment)(p, it, j0 + a, nk - a, 1, 1, &len);
                        FA_NAME(fa_pv_rows_i8)(sc.s + a * ksx, nr, len, (const int8_t *)vr, p->v_sl, sr,
                                               p->vs_sl, FA_NAME(fa_group_shift)(p, 1), Dv, sc.o, dvp, al,
                                               ksx, rsx, p->v_bits, p->block_table ? len : INT64_MAX);
                        continue;
                    }
#endif
                    FA_NAME(fa_pv_tile_strided)(sc.s + a * ksx, nr, len, (const FA_KV *)(const void *)vr,
                                                p->v_sl, Dv, sc.o, dvp, al, ksx, rsx, p->block_table ? len : INT64_MAX);
                }
                if (FA_NAME(fa_all_finite)(sc.o, nr * dvp)) continue;
                memcpy(sc.o, sc.o2, (size_t)(nr * dvp) * sizeof(FA_T)); /* staged, careful */
            }
            int64_t v_sl;
            const FA_KV *vt = FA_NAME(fa_kv_tile)(p, it, j0, nk, 1, sc.vst, &v_sl);
            if (FA_NAME(fa_few_rows)(nr, &sc)) {
                /* Few rows: a check of V before P.V would cost as much as P.V itself.  So
                 * P.V runs first, and if the rows it produced are not all finite (an inf
                 * or NaN in V, or rows that were not finite already) they are restored
                 * and the tile goes through the careful path. */
                memcpy(sc.o2, sc.o, (size_t)(nr * dvp) * sizeof(FA_T));
                /* the next tile of this chunk or, after its last, the next chunk's
                 * first, if key-major as fa_scores would make it (every row sees all its
                 * keys; the call-wide conditions are this tile's) */
                const int64_t j1 = j0 + bc < hi ? j0 + bc : hi;
                const int64_t hi1 = j1 < hi ? hi : it->kv1 - j1 < ck ? it->kv1 : j1 + ck;
                const int64_t nk1 = hi1 - j1 < bc ? hi1 - j1 : bc;
                if (sc.key_major && fuse && j1 < hi1 && lo_max <= j1 && hi_min >= j1 + nk1 - 1 &&
                    FA_NAME(fa_pv_qk)(p, it, sc.qt, brp, nr, sc.s, sc.bcp, nk, vt, v_sl, sc.o, dvp, sc.alpha, j1,
                                      nk1, sc.s + FA_PVQK_ROW * sc.bcp))
                    next_ready = 1;
                else if (sc.key_major)
                    FA_NAME(fa_pv_tile_rows)(sc.s, nr, nk, vt, v_sl, Dv, sc.o, dvp, sc.alpha, sc.bcp);
                else
                    FA_NAME(fa_pv_tile)(sc.s, nr, nk, vt, v_sl, Dv, sc.o, dvp, sc.alpha, brp);
                if (!FA_NAME(fa_all_finite)(sc.o, nr * dvp)) {
                    memcpy(sc.o, sc.o2, (size_t)(nr * dvp) * sizeof(FA_T));
                    FA_NAME(fa_pv_tile_nonfinite)(p, it, nr, nv, j0, nk, lo_max, hi_min, brp, &sc, vt,
                                                  v_sl, dvp, 0);
                }
            } else {
#if defined(FA_KV_HALF) && defined(FA_F32)
                /* 16-bit V: the tile as float32 once, checked and multiplied by the float32
                 * functions (the same values, so the same decision and the same bits) */
                const float *vf = sc.vf_shared ? sc.vf_shared : FA_NAME(fa_tile_f32)(vt, v_sl, nk, Dv, sc.vf);
                const int64_t vslot = fa_share_slot(it, it->vfin, bc, j0, nk);
                int vok = sc.vf_shared ? sc.vf_flag : fa_vfin_read(it, vslot);
                if (!vok) vok = fa_vfin_write(it, vslot, FA_F32(fa_v_finite)(vf, Dv, nk, Dv));
#ifdef FA_PV_T
                if (vok == 1 && pvt)
                    FA_F32(fa_pvt_tile)(sc.s + lr0, vc1 - vc0, nk, vf, Dv, Dv, sc.ot + lr0, brp, sc.alpha + lr0);
                else
#endif
                if (vok == 1)
                    FA_F32(fa_pv_tile)(sc.s + lr0, lnr, nk, vf, Dv, Dv, sc.o + lr0 * dvp, dvp, sc.alpha + lr0, brp);
#else
                /* checked once a call where another item has not (fa_vfin_read) */
                const int64_t vslot = fa_share_slot(it, it->vfin, bc, j0, nk);
                int vok = fa_vfin_read(it, vslot);
                if (!vok) vok = fa_vfin_write(it, vslot, FA_NAME(fa_v_finite)(vt, v_sl, nk, Dv));
                if (vok == 1) {
#ifdef FA_BF16_DP
                    if (sc.dp)
#ifdef FA_BF16_AMX
                        FA_NAME(fa_pv_tile_amx)(sc.s, nv, nk, vt, v_sl, Dv, sc.o, dvp, sc.alpha, brp, sc.pa, sc.vp);
#else
                        FA_NAME(fa_pv_tile_dp)(sc.s, nr, nv, nk, vt, v_sl, Dv, sc.o, dvp, sc.alpha, brp, sc.pp,
                                               sc.vp);
#endif
                    else
#endif
#ifdef FA_PV_T
                    if (pvt)
                        FA_NAME(fa_pvt_tile)(sc.s + lr0, vc1 - vc0, nk, vt, v_sl, Dv, sc.ot + lr0, brp,
                                             sc.alpha + lr0);
                    else
#endif
                        FA_NAME(fa_pv_tile)(sc.s + lr0, lnr, nk, vt, v_sl, Dv, sc.o + lr0 * dvp, dvp,
                                            sc.alpha + lr0, brp);
                }
#endif
                else
                    FA_NAME(fa_pv_tile_nonfinite)(p, it, nr, nv, j0, nk, lo_max, hi_min, brp, &sc, vt, v_sl,
                                                  dvp, pvt);
            }
        }
#ifdef FA_PV_T
        if (pvt) FA_NAME(fa_pvt_rows)(sc.ot, brp, nvl, dvp, sc.o);
#endif
        if (parts)
            FA_NAME(fa_write_rows)(p, it, nr, 1, dvp, &sc, c0 / ck);
        else if (!single)
            FA_NAME(fa_fold_chunk)(&sc, nr, Dv, dvp);
    }

    if (!parts) FA_NAME(fa_write_rows)(p, it, nr, single, dvp, &sc, 0);
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
                FA_VSTORE(sp, FA_VMUL(FA_VEXP_LOGIT(FA_VSUB(FA_VLOAD(sp), mv)), inv));
            }
        }
        if (p->dropout_p > 0) FA_NAME(fa_dropout_apply)(p, it, nr, j0, nk, sc.s, brp, 1);
        for (int64_t r = 0; r < nr; r++)
            for (int64_t jj = 0; jj < nk; jj++) wrow[r][j0 + jj] = sc.s[jj * brp + r];
    }
}

#ifndef FA_KV_HALF
/* y = exp(x) with this file's vector exp, or with logit its softmax's FA_VEXP_LOGIT (the
 * ULP tests call them through fa_exp_array). */
static void FA_NAME(fa_exp_array)(const void *xv, void *yv, int64_t n, int logit)
{
    const FA_T *x = (const FA_T *)xv;
    FA_T *y = (FA_T *)yv;
    int64_t i = 0;
    for (; i + FA_VL <= n; i += FA_VL) {
        const FA_V v = FA_VLOADU(x + i);
        FA_VSTOREU(y + i, logit ? FA_VEXP_LOGIT(v) : FA_VEXP(v));
    }
    if (i < n) {
        FA_T tmp[FA_VL];
        const FA_V v = FA_VLOADU_N(x + i, (int)(n - i));
        FA_VSTOREU(tmp, logit ? FA_VEXP_LOGIT(v) : FA_VEXP(v));
        for (int64_t t = 0; t < n - i; t++) y[i + t] = tmp[t];
    }
}

/* The FMA peak's loop: iters rounds of FA_PEAK_CHAINS independent vector FMAs
 * (acc = acc * m + a: nothing else in the loop, enough chains to cover the FMA
 * latency on every port), returning the lanes' sum so the loop cannot be dropped.
 * With 0 < m < 1 the chains settle at a / (1 - m): no overflow, no subnormals. */
static double FA_NAME(fa_fma_chains)(int64_t iters, double m, double a)
{
    const FA_V mv = FA_VSET1((FA_T)m), av = FA_VSET1((FA_T)a);
    FA_V acc[FA_PEAK_CHAINS];
    for (int c = 0; c < FA_PEAK_CHAINS; c++) acc[c] = FA_VSET1((FA_T)c);
    for (int64_t i = 0; i < iters; i++)
        for (int c = 0; c < FA_PEAK_CHAINS; c++) acc[c] = FA_VFMA(acc[c], mv, av);
    FA_V s = acc[0];
    for (int c = 1; c < FA_PEAK_CHAINS; c++) s = FA_VADD(s, acc[c]);
    return (double)FA_VREDUCE(s);
}

/* The read bandwidth's loop (fa_read_bandwidth): FA_READ_STREAMS runs of n elements,
 * `stride` elements apart, read side by side with the ISA's vector loads (two
 * accumulators a run: the adds never wait on each other), returning the sum of every
 * element read, so the loads are kept and a test can see that each was read once.
 * n is a multiple of FA_READ_STEP. */
static double FA_NAME(fa_read_streams)(const void *src, int64_t n, int64_t stride)
{
    const FA_T *p = (const FA_T *)src;
    FA_V acc[2 * FA_READ_STREAMS];
    for (int c = 0; c < 2 * FA_READ_STREAMS; c++) acc[c] = FA_VZERO();
    for (int64_t i = 0; i < n; i += 2 * FA_VL)
        for (int r = 0; r < FA_READ_STREAMS; r++) {
            acc[2 * r] = FA_VADD(acc[2 * r], FA_VLOADU(p + r * stride + i));
            acc[2 * r + 1] = FA_VADD(acc[2 * r + 1], FA_VLOADU(p + r * stride + i + FA_VL));
        }
    double s = 0.0;
    for (int c = 0; c < 2 * FA_READ_STREAMS; c++) s += (double)FA_VREDUCE(acc[c]);
    return s;
}
#endif
