/*
 * kern_source.h -- part of the kernel template (kernels_tmpl.h): where a key tile's
 * K and V rows come from.
 *   fa_kv_tile       rows j0 .. j0+nk-1 of an item's K or V as the products read them
 *                    (a pointer and a row stride): in place for a strided array, and
 *                    for a paged pool of FA_KV whose page holds the whole tile; else
 *                    staged into the thread's tile buffer: an int8 cache dequantized
 *                    (data * scale, one float32 multiply per element, the bits of
 *                    fastattn.dequantize_kv), pages' rows gathered.
 *   fa_tile_f32      (16-bit K/V, where the ISA file names its float32 instantiation
 *                    FA_F32) a prefill tile's rows converted to float32 once, so that the
 *                    float32 products read them: the same values the converting loads
 *                    give, so the same bits, converted once a tile instead of once per
 *                    row group (a V element was converted 32 times by a 192-row block)
 *   fa_by_segment, fa_kv_segment   decode rows instead read a paged or int8 tile in
 *                    place, page by page (int8 in registers: fa_qk_keys_i8,
 *                    fa_pv_rows_i8 of kern_products.h): the same values, no staging
 *   fa_lanes_tile    K stored with the keys on the lanes (p->k_lanes, fastattn.KVCache)
 *                    as rows: float and 16-bit copied, int8 and int4 codes dequantized
 *                    (fmaf(code, scale, zero)); decode rows read the blocks in place
 *                    instead (fa_qk_lanes of kern_products.h), with the same values
 *
 * A staged tile holds exactly the values the in-place read would give (for int8: the
 * dequantized cache's), so the products, the softmax and the merge see the same
 * numbers in the same order: a paged cache gives the contiguous cache's bits, an int8
 * cache those of the float32 cache dequantize_kv returns.
 *
 * Needs from the including ISA file: FA_KV (float for int8, as the float32
 * instantiation has it).
 */

#ifndef FA_STAGE_AHEAD
#define FA_STAGE_AHEAD 16
#endif

/* Key rows j .. j+*len-1 of an item (its tile's rows from j to the end of j's page, at
 * most n of them): their first row in K/V (scale 0) or in its scales (scale 1), as a
 * byte pointer; rows are the array's row stride apart. */
static const char *FA_NAME(fa_kv_segment)(const fa_params *p, const fa_item *it, int64_t j, int64_t n,
                                          int kv, int scale, int64_t *len)
{
    const int64_t at = it->koff + j;
    *len = p->block_table && p->page_size - at % p->page_size < n ? p->page_size - at % p->page_size : n;
    if (scale)
        return (const char *)((kv ? p->v_scale : p->k_scale) +
                              fa_kv_row_at(p, it->b, it->g, at, kv ? p->vs_sb : p->ks_sb,
                                           kv ? p->vs_sh : p->ks_sh, kv ? p->vs_sl : p->ks_sl));
    const size_t item = p->kv_store == FA_STORE_I8 ? 1 : sizeof(FA_KV);
    return (const char *)(kv ? p->v : p->k) +
           (size_t)fa_kv_row_at(p, it->b, it->g, at, kv ? p->v_sb : p->k_sb, kv ? p->v_sh : p->k_sh,
                                kv ? p->v_sl : p->k_sl) * item;
}

/* Code l (0 .. 15) of a row of int4 codes, two a byte: l even in the low nibble. */
static inline int FA_NAME(fa_nibble)(const uint8_t *row, int64_t l)
{
    return (row[l >> 1] >> ((l & 1) << 2)) & 15;
}

/* The scale (zero: 1, the zero point) of channel d of the lanes block `blk` of the item
 * (K quantized on the lanes: per channel within a block). */
static inline const float *FA_NAME(fa_lanes_param)(const fa_params *p, const fa_item *it, int64_t blk, int zero)
{
    return (zero ? p->k_zero : p->k_scale) + it->b * p->ks_sb + it->g * p->ks_sh + blk * p->ks_sl;
}

/* Block `blk` of the item's K on the lanes: its first element (its codes' first byte). */
static inline const char *FA_NAME(fa_lanes_block)(const fa_params *p, const fa_item *it, int64_t blk)
{
    const size_t item = p->kv_store == FA_STORE_I8 ? 1 : sizeof(FA_KV);
    return (const char *)p->k + (size_t)(it->b * p->k_sb + it->g * p->k_sh + blk * p->k_sl) * item;
}

/* Rows j0 .. j0+nk-1 of an item's K stored on the lanes (p->k_lanes), as rows of D in
 * buf: float and 16-bit values copied, codes dequantized with one fmaf(code, scale,
 * zero) each (the values fa_qk_lanes computes in registers). */
static const FA_KV *FA_NAME(fa_lanes_tile)(const fa_params *p, const fa_item *it, int64_t j0, int64_t nk,
                                           FA_KV *FA_RESTRICT buf, int64_t *stride)
{
    const int64_t D = p->D, bs = p->k_lanes;
    *stride = D;
    for (int64_t r0 = 0, n; r0 < nk; r0 += n) {
        const int64_t j = it->koff + j0 + r0, blk = j / bs, lane0 = j % bs;
        n = bs - lane0 < nk - r0 ? bs - lane0 : nk - r0;
        FA_KV *FA_RESTRICT dst = buf + r0 * D;
        const char *base = FA_NAME(fa_lanes_block)(p, it, blk);
        if (p->kv_store != FA_STORE_I8) {
            const FA_KV *FA_RESTRICT src = (const FA_KV *)(const void *)base + lane0;
            for (int64_t d = 0; d < D; d++)
                for (int64_t l = 0; l < n; l++) dst[l * D + d] = src[d * bs + l];
            continue;
        }
        const float *sc = FA_NAME(fa_lanes_param)(p, it, blk, 0), *zp = FA_NAME(fa_lanes_param)(p, it, blk, 1);
        for (int64_t d = 0; d < D; d++) {
            const float s = sc[d], z = zp[d];
            if (p->k_bits == 4) { /* channels 2e and 2e + 1 in one byte a lane */
                const uint8_t *row = (const uint8_t *)base + (d >> 1) * bs + lane0;
                const int sh = (int)(d & 1) * 4;
                for (int64_t l = 0; l < n; l++) dst[l * D + d] = (FA_KV)fmaf((float)((row[l] >> sh) & 15), s, z);
            } else {
                const int8_t *row = (const int8_t *)base + d * bs + lane0;
                for (int64_t l = 0; l < n; l++) dst[l * D + d] = (FA_KV)fmaf((float)row[l], s, z);
            }
        }
    }
    return buf;
}

static const FA_KV *FA_NAME(fa_kv_tile)(const fa_params *p, const fa_item *it, int64_t j0,
                                        int64_t nk, int kv, FA_KV *FA_RESTRICT buf,
                                        int64_t *stride)
{
    if (!kv && p->k_lanes) return FA_NAME(fa_lanes_tile)(p, it, j0, nk, buf, stride);
    const int64_t width = kv ? p->Dv : p->D;
    const int quant = p->kv_store == FA_STORE_I8;
    int64_t len;
    const char *first = FA_NAME(fa_kv_segment)(p, it, j0, nk, kv, 0, &len);
    if (!quant && len == nk) { /* a strided array, or a page that holds the whole tile */
        *stride = kv ? p->v_sl : p->k_sl;
        return (const FA_KV *)(const void *)first;
    }
    *stride = width;
    /* row j0 + r + FA_STAGE_AHEAD is asked for as row j0 + r is copied (the rows of a
     * paged or strided cache are too far apart for the hardware to follow), and the
     * first FA_STAGE_AHEAD rows at the item's first tile */
    const size_t bytes = quant && kv && p->v_bits == 4 ? (size_t)(width + 1) / 2
                                                       : (size_t)width * (quant ? 1 : sizeof(FA_KV));
    for (int64_t r = j0 <= it->kv0 ? -FA_STAGE_AHEAD : 0; r < nk; r++) {
        const int64_t ja = j0 + r + FA_STAGE_AHEAD;
        if (ja < it->kv1) {
            const char *row = FA_NAME(fa_kv_segment)(p, it, ja, 1, kv, 0, &len);
            for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(row + off);
        }
        if (r < 0) continue;
        FA_KV *FA_RESTRICT dst = buf + r * width;
        const char *row = FA_NAME(fa_kv_segment)(p, it, j0 + r, 1, kv, 0, &len);
        if (!quant) { /* a loop, not memcpy: rows are short, the call costs more */
            const FA_KV *FA_RESTRICT src = (const FA_KV *)(const void *)row;
            for (int64_t c = 0; c < width; c++) dst[c] = src[c];
            continue;
        }
        const int8_t *FA_RESTRICT src = (const int8_t *)row;
        const float *FA_RESTRICT scale =
            (const float *)(const void *)FA_NAME(fa_kv_segment)(p, it, j0 + r, 1, kv, 1, &len);
        const int64_t group = kv ? p->v_group : p->k_group;
        if (kv && p->v_bits == 4) { /* two codes a byte, (nibble - 8) * scale */
            const uint8_t *u = (const uint8_t *)src;
            for (int64_t c = 0; c < width; c++) {
                /* groups of 32: byte i of a group holds channels i and i + 16 */
                const int code = group == 32 ? (u[(c >> 5) * 16 + (c & 15)] >> ((c & 16) ? 4 : 0)) & 15
                                             : FA_NAME(fa_nibble)(u, c);
                dst[c] = (FA_KV)((float)(code - 8) * scale[c / group]);
            }
            continue;
        }
        for (int64_t c0 = 0, gi = 0; c0 < width; c0 += group, gi++) {
            const float f = scale[gi];
            for (int64_t c = c0; c < c0 + group; c++) dst[c] = (FA_KV)((float)src[c] * f);
        }
    }
    return buf;
}

/* Do decode rows (blocks of at most FA_DOT_ROWS rows) read this cache's K (kv 0) or V
 * (kv 1) in place, a page at a time (fa_kv_segment), rather than staged?  A paged float
 * cache whose pages hold at least FA_VL rows; an int8 cache (paged or not) where the ISA
 * file reads int8 in registers (FA_I8_LOADU and a register transpose), the width is a
 * multiple of FA_VL and the group a power of two of at least FA_VL channels (the
 * default 32 with D = 64 or 128: every such cache).  The products then see the values
 * a staged tile would hold, in the same order, so the bits do not change. */
static int FA_NAME(fa_by_segment)(const fa_params *p, int kv)
{
    if (!kv && p->k_lanes > 0) return 0; /* (K on the lanes: fa_qk_lanes) */
    if (p->block_table && p->page_size < FA_VL) return 0;
    if (p->kv_store != FA_STORE_I8) return p->block_table != NULL;
#if defined(FA_I8_LOADU) && defined(FA_HAVE_TRANSPOSE)
    const int64_t width = kv ? p->Dv : p->D, group = kv ? p->v_group : p->k_group;
    return width % FA_VL == 0 && group % FA_VL == 0 && (group & (group - 1)) == 0;
#else
    (void)kv;
    return 0;
#endif
}

/* log2 of an int8 cache's channel group (a power of two where fa_by_segment holds) */
static inline int FA_NAME(fa_group_shift)(const fa_params *p, int kv)
{
    return __builtin_ctzll((unsigned long long)(kv ? p->v_group : p->k_group));
}

#if defined(FA_KV_HALF) && defined(FA_F32)
/* nk rows of `width` 16-bit values, row stride sl, as float32 rows of `width` in buf. */
static const float *FA_NAME(fa_tile_f32)(const FA_KV *FA_RESTRICT t, int64_t sl, int64_t nk, int64_t width,
                                         float *FA_RESTRICT buf)
{
    const int64_t full = width / FA_VL * FA_VL;
    for (int64_t j = 0; j < nk; j++) {
        const FA_KV *row = t + j * sl;
        float *dst = buf + j * width;
#ifdef FA_KV_TILE_SCALAR /* a plain loop of the branch-free conversion: the compiler vectorizes it */
        (void)full;
        for (int64_t c = 0; c < width; c++) dst[c] = FA_KV_SCALAR(row[c]);
#else
        for (int64_t c = 0; c < full; c += FA_VL) FA_VSTOREU(dst + c, FA_KV_LOADU(row + c));
        for (int64_t c = full; c < width; c++) dst[c] = FA_KV_SCALAR(row[c]);
#endif
    }
    return buf;
}

/* The whole key block [j0, j0 + nk) of the item's (sequence, kv head) as float32, for the
 * call's prefill items to share (fa_share_slot: it->pkst, it->pkbuf; K's nk x D floats,
 * then V's nk x Dv): converted once a call, by the first item to claim it (state 0 -> 1,
 * then 2 with every V value finite or 3 with an inf or NaN, published with release),
 * not by every query block of the head (2.8% of a float16 B1 H8 L4096 D64 forward, AMD
 * EPYC Zen 4).  Returns the block's K (its V follows; *vflag 1 finite, 2 not), or NULL:
 * a partial block, nothing shared, or another item converting it now (the caller then
 * converts its own tile, as before: the same values, so the same bits). */
static const float *FA_NAME(fa_f32_shared)(const fa_params *p, const fa_item *it, int64_t j0, int64_t nk,
                                           const FA_KV *k, int64_t k_sl, FA_NAME(fa_scratch) *sc,
                                           int *vflag)
{
    /* (not for attention_weights, which reads no V: its V staging buffer is not there) */
    const int64_t slot = p->weights ? -1 : fa_share_slot(it, it->pkst, sc->bc, j0, nk);
    /* (the call's blocks are float32 ones: not a bfloat16 path's packed pairs) */
    if (slot < 0 || it->pk_bytes != sc->bc * (p->D + p->Dv) * (int64_t)sizeof(float)) return NULL;
    float *buf = (float *)(void *)(it->pkbuf + slot * it->pk_bytes);
    int st = __atomic_load_n(it->pkst + slot, __ATOMIC_ACQUIRE);
    if (st < 2) {
        uint8_t zero = 0;
        if (st != 0 || !__atomic_compare_exchange_n(it->pkst + slot, &zero, 1, 0, __ATOMIC_ACQUIRE,
                                                    __ATOMIC_RELAXED))
            return NULL;
        int64_t v_sl;
        const FA_KV *v = FA_NAME(fa_kv_tile)(p, it, j0, nk, 1, sc->vst, &v_sl);
        FA_NAME(fa_tile_f32)(k, k_sl, nk, p->D, buf);
        FA_NAME(fa_tile_f32)(v, v_sl, nk, p->Dv, buf + nk * p->D);
        st = FA_F32(fa_v_finite)(buf + nk * p->D, p->Dv, nk, p->Dv) ? 2 : 3;
        __atomic_store_n(it->pkst + slot, (uint8_t)st, __ATOMIC_RELEASE);
    }
    *vflag = st - 1;
    return buf;
}
#endif
