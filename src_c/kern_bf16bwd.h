/*
 * kern_bf16bwd.h -- part of the kernel template (kernels_tmpl.h), only where the ISA file
 * defines FA_BF16_BWD: the pieces of the backward on bfloat16 pairs.  That instantiation is
 * the float32 backward (kern_backward.h) for calls whose q, k, v and dout hold bfloat16
 * values (float32 copies of bfloat16 arrays, so every conversion below of them is exact);
 * its five products take vdpbf16ps pairs with float32 sums, as PyTorch's and
 * FlashAttention's bf16 backward do with their bf16 GEMMs:
 *   S  = Q K^T    Q feature pairs against the K tile's bfloat16 rows (fa_qk_tile_dp, via
 *                 fa_scores), times the scale in float32
 *   dP = dO V^T   dO feature pairs against the V tile's bfloat16 rows (fa_qk_tile_dp)
 *   dV += W^T dO  W (P, or P z with dropout) rounded to bfloat16, pairs of query rows
 *   dK += dS^T Q  dS rounded to bfloat16, pairs of query rows (fa_bw_kv_tile)
 *   dQ += dS K    dS rounded and paired along the keys, K paired along the keys
 *                 (the forward's fa_pv_tile_dp)
 * P = exp(S - lse), dS = P (dP - D_i) and every accumulator stay float32; dq, dk, dv are
 * rounded to bfloat16 by the caller.  Pairs run along each product's reduction axis in
 * a fixed order (an item's rows in order for dK and dV, keys from the tile's first for
 * dQ), so the bits depend neither on the thread count nor on the schedule.
 *   fa_bw_rows16     float32 rows -> bfloat16 rows (a K or V tile)
 *   fa_bw_pack_row   one row into its feature pairs and its half of the row pairs
 *   fa_bw_tile16     a key-major float32 tile's rows (nr values each) as bfloat16
 *                    pairs of query rows
 *   fa_bw_kv_tile    acc[j][c] += sum_t w[j][t] . z[t][c] (dV and dK)
 *
 * The AMX kernel (kernels_amx.c) instantiates the same backward with FA_BF16_AMX: its
 * five products on the tiles (kern_amx.h: fa_qk_tile_amx for S and dP, fa_bw_kv_tile_amx
 * for dV and dK, fa_pv_tile_amx for dQ), on the same packed operands, which are the
 * tiles' layouts already (feature pairs of Q and dO are B tiles of 16 queries, rows
 * pairs of W, dS, Q and dO A and B tiles of 32 rows), only padded to whole tiles:
 * K and V rows to 32 features, row pairs to 16 (fa_bw_width, fa_bw_rpairs), zero.
 *
 * Needs from the ISA file: FA_DP_* (kern_bf16dp.h) and FA_DP_STORE16(y, x), a vector's
 * FA_VL float32 values stored at y (uint16_t *, unaligned) as FA_VL bfloat16 in order
 * (round to nearest even).
 */

/* n rows of `width` float32 values (row stride sl) as bfloat16 rows fa_bw_width(width)
 * apart in dst (zero past width); returns dst. */
static const uint16_t *FA_NAME(fa_bw_rows16)(const FA_T *FA_RESTRICT src, int64_t sl, int64_t n, int64_t width,
                                             uint16_t *FA_RESTRICT dst)
{
    const int64_t full = width / FA_VL * FA_VL, ds = FA_NAME(fa_bw_width)(width);
    for (int64_t j = 0; j < n; j++) {
        const FA_T *x = src + j * sl;
        uint16_t *y = dst + j * ds;
        int64_t c = 0;
        for (; c < full; c += FA_VL) FA_DP_STORE16(y + c, FA_VLOADU(x + c));
        for (; c < width; c++) y[c] = fa_float_to_bf16(x[c]);
        for (; c < ds; c++) y[c] = 0;
    }
    return dst;
}

/* The bfloat16 rows (rows: sc->kr or sc->vr, `width` features) of keys j0 .. j0+nk-1 of
 * item it's kv head where fa_bwd_kv made them for its key range, else NULL. */
static inline const uint16_t *FA_NAME(fa_bw_cached)(const FA_NAME(fa_scratch) *sc, const uint16_t *rows,
                                                    const fa_item *it, int64_t j0, int64_t nk, int64_t width)
{
    if (!rows || it->b != sc->kr_b || it->g != sc->kr_g || it->koff != sc->kr_koff || j0 < sc->kr_j0 ||
        j0 + nk > sc->kr_j0 + sc->kr_n)
        return NULL;
    return rows + (j0 - sc->kr_j0) * FA_NAME(fa_bw_width)(width);
}

/* Row r of a block (n values at x) as bfloat16: into the feature pairs fp[t * brp + r]
 * (the last alone when n is odd) and, as the low (r even) or high (r odd) half of
 * each word, into the row pairs zp[(r / 2) * zs + c]. */
static void FA_NAME(fa_bw_pack_row)(const FA_T *FA_RESTRICT x, int64_t n, int64_t r, uint32_t *FA_RESTRICT fp,
                                    int64_t brp, uint32_t *FA_RESTRICT zp, int64_t zs)
{
    uint16_t *z = (uint16_t *)(void *)(zp + (r / 2) * zs) + (r & 1);
    int64_t c = 0;
    for (; c + 1 < n; c += 2) {
        const uint16_t a = fa_float_to_bf16(x[c]), b = fa_float_to_bf16(x[c + 1]);
        fp[(c / 2) * brp + r] = (uint32_t)a | (uint32_t)b << 16;
        z[2 * c] = a;
        z[2 * c + 2] = b;
    }
    if (c < n) {
        const uint16_t a = fa_float_to_bf16(x[c]);
        fp[(c / 2) * brp + r] = a;
        z[2 * c] = a;
    }
}

/* Rows 0 .. nk-1 of a key-major tile (t[j * brp + r]) as bfloat16 pairs of query rows,
 * w[j * ws + q] = (t[j][2q], t[j][2q + 1]) for the nr rows (the second half 0 past
 * them; whole pairs 0 up to fa_bw_rpairs(nr)). */
static void FA_NAME(fa_bw_tile16)(const FA_T *FA_RESTRICT t, int64_t nk, int64_t nr, int64_t brp,
                                  uint32_t *FA_RESTRICT w, int64_t ws)
{
    const int64_t full = nr / FA_VL * FA_VL;
    for (int64_t j = 0; j < nk; j++) {
        const FA_T *x = t + j * brp;
        uint16_t *y = (uint16_t *)(void *)(w + j * ws);
        int64_t c = 0;
        for (; c < full; c += FA_VL) FA_DP_STORE16(y + c, FA_VLOAD(x + c));
        for (; c < nr; c++) y[c] = fa_float_to_bf16(x[c]);
        for (; c < 2 * FA_NAME(fa_bw_rpairs)(nr); c++) y[c] = 0;
    }
}

/* R output rows x NC vectors: o[j][c ...] += sum_t (w pair t of row j) . (z pair t). */
FA_ALWAYS_INLINE void FA_NAME(fa_bw_kv_micro)(const int R, const int NC, const uint32_t *FA_RESTRICT w, int64_t ws,
                                              const uint32_t *FA_RESTRICT z, int64_t zs, int64_t npairs,
                                              FA_T *FA_RESTRICT o, int64_t os)
{
    FA_V acc[FA_PV_R][FA_PV_NC];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = FA_VLOAD(o + r * os + c * FA_VL);
    int64_t t = 0;
#ifdef FA_DP_K4
    /* four pairs of each output row's w in one vector, each used by its index (no
     * broadcast; the same products in the same order, so the same bits) */
    for (; t + 4 <= npairs; t += 4) {
        FA_DP_K4 w4[FA_PV_R];
        for (int r = 0; r < R; r++) w4[r] = FA_DP_LOAD_K4((const uint16_t *)(const void *)(w + r * ws + t));
        FA_DP_K4_STEPS(acc, R, NC, w4, z, zs, t, FA_PV_NC);
    }
#endif
    for (; t < npairs; t++) {
        FA_DP_V zv[FA_PV_NC];
        for (int c = 0; c < NC; c++) zv[c] = FA_DP_LOAD(z + t * zs + c * FA_VL);
        for (int r = 0; r < R; r++) {
            const FA_DP_V wb = FA_DP_BCAST(w[r * ws + t]);
            for (int c = 0; c < NC; c++) acc[r][c] = FA_DP_FMA(acc[r][c], wb, zv[c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++) FA_VSTORE(o + r * os + c * FA_VL, acc[r][c]);
}

#define FA_BW_KV_CASE(R, NC)                                                                         \
    case (R) * 16 + (NC):                                                                            \
        if ((R) <= FA_PV_R && (NC) <= FA_PV_NC)                                                      \
            FA_NAME(fa_bw_kv_micro)(R, NC, w + j * ws, ws, z + c0, zs, npairs, o + j * os + c0, os); \
        break;

/* o[j][...] += sum over query-row pairs t of w[j][t] . z[t][...] for nk output rows
 * (keys) and wp (a multiple of FA_VL) columns: dV += W^T dO, dK += dS^T Q. */
static void FA_NAME(fa_bw_kv_tile)(const uint32_t *FA_RESTRICT w, int64_t ws, int64_t nk,
                                   const uint32_t *FA_RESTRICT z, int64_t zs, int64_t npairs, int64_t wp,
                                   FA_T *FA_RESTRICT o, int64_t os)
{
    const int64_t chunk = (int64_t)FA_PV_NC * FA_VL;
    for (int64_t c0 = 0; c0 < wp; c0 += chunk) {
        const int nc = (int)((wp - c0 < chunk ? wp - c0 : chunk) / FA_VL);
        for (int64_t j = 0; j < nk; j += FA_PV_R) {
            const int r = (int)(nk - j < FA_PV_R ? nk - j : FA_PV_R);
            switch (r * 16 + nc) {
                FA_TILE_ROWS(FA_BW_KV_CASE)
                default: break;
            }
        }
    }
}
#undef FA_BW_KV_CASE
