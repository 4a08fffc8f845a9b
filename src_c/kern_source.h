/*
 * kern_source.h -- part of the kernel template (kernels_tmpl.h): where a key tile's
 * K and V rows come from.
 *   fa_kv_tile       rows j0 .. j0+nk-1 of an item's K or V as the products read them
 *                    (a pointer and a row stride): in place for a strided array, and
 *                    for a paged pool of FA_KV whose page holds the whole tile; else
 *                    staged into the thread's tile buffer: an int8 cache dequantized
 *                    (data * scale, one float32 multiply per element, the bits of
 *                    fastattn.dequantize_kv), pages' rows gathered.
 *   fa_i8_tile       where an int8 tile's rows and scales are, when the decode
 *                    products can read it in registers instead (fa_qk_keys_i8,
 *                    fa_pv_rows_i8 of kern_products.h: the same values, no staging)
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

static const FA_KV *FA_NAME(fa_kv_tile)(const fa_params *p, const fa_item *it, int64_t j0,
                                        int64_t nk, int kv, FA_KV *FA_RESTRICT buf,
                                        int64_t *stride)
{
    const int64_t sb = kv ? p->v_sb : p->k_sb, sh = kv ? p->v_sh : p->k_sh;
    const int64_t sl = kv ? p->v_sl : p->k_sl, width = kv ? p->Dv : p->D;
    const int64_t j = it->koff + j0;
    const int quant = p->kv_store == FA_STORE_I8;
    if (!quant && (!p->block_table || j % p->page_size + nk <= p->page_size)) {
        *stride = sl;
        return (const FA_KV *)(kv ? p->v : p->k) + fa_kv_row_at(p, it->b, it->g, j, sb, sh, sl);
    }
    *stride = width;
    /* row j0 + r + FA_STAGE_AHEAD is asked for as row j0 + r is copied (the rows of a
     * paged or strided cache are too far apart for the hardware to follow), and the
     * first FA_STAGE_AHEAD rows at the item's first tile */
    const size_t item = quant ? 1 : sizeof(FA_KV), bytes = (size_t)width * item;
    const char *base = (const char *)(kv ? p->v : p->k);
    for (int64_t r = j0 <= it->kv0 ? -FA_STAGE_AHEAD : 0; r < nk; r++) {
        const int64_t ja = j0 + r + FA_STAGE_AHEAD;
        if (ja < it->kv1) {
            const char *row = base + (size_t)fa_kv_row_at(p, it->b, it->g, it->koff + ja, sb, sh, sl) * item;
            for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(row + off);
        }
        if (r < 0) continue;
        FA_KV *FA_RESTRICT dst = buf + r * width;
        const int64_t at = fa_kv_row_at(p, it->b, it->g, j + r, sb, sh, sl);
        if (!quant) { /* a loop, not memcpy: rows are short, the call costs more */
            const FA_KV *FA_RESTRICT src = (const FA_KV *)(kv ? p->v : p->k) + at;
            for (int64_t c = 0; c < width; c++) dst[c] = src[c];
            continue;
        }
        const int8_t *FA_RESTRICT src = (const int8_t *)(kv ? p->v : p->k) + at;
        const float *FA_RESTRICT scale =
            (kv ? p->v_scale : p->k_scale) +
            fa_kv_row_at(p, it->b, it->g, j + r, kv ? p->vs_sb : p->ks_sb, kv ? p->vs_sh : p->ks_sh,
                         kv ? p->vs_sl : p->ks_sl);
        const int64_t group = kv ? p->v_group : p->k_group;
        for (int64_t c0 = 0, gi = 0; c0 < width; c0 += group, gi++) {
            const float f = scale[gi];
            for (int64_t c = c0; c < c0 + group; c++) dst[c] = (FA_KV)((float)src[c] * f);
        }
    }
    return buf;
}

/* Can the decode products read rows j0 .. j0+nk-1 of an int8 K (kv 0) or V (kv 1) in
 * registers?  Yes where the ISA file has FA_I8_LOADU and a register transpose, the
 * width is a multiple of FA_VL and the group a power of two of at least FA_VL
 * channels (the default 32, with D = 64 or 128: every such cache), and, paged, the
 * tile is inside one page.  Then *rows and *scale point at the tile's first row and
 * its scales, with the arrays' row strides (*sl bytes, *ssl floats), and *gshift is
 * log2 of the group. */
static int FA_NAME(fa_i8_tile)(const fa_params *p, const fa_item *it, int64_t j0, int64_t nk, int kv,
                               const int8_t **rows, int64_t *sl, const float **scale,
                               int64_t *ssl, int *gshift)
{
#if defined(FA_I8_LOADU) && defined(FA_HAVE_TRANSPOSE)
    const int64_t width = kv ? p->Dv : p->D, group = kv ? p->v_group : p->k_group;
    const int64_t j = it->koff + j0;
    if (p->kv_store != FA_STORE_I8 || width % FA_VL || group % FA_VL || (group & (group - 1)) ||
        (p->block_table && j % p->page_size + nk > p->page_size))
        return 0;
    *rows = (const int8_t *)(kv ? p->v : p->k) +
            fa_kv_row_at(p, it->b, it->g, j, kv ? p->v_sb : p->k_sb, kv ? p->v_sh : p->k_sh,
                         kv ? p->v_sl : p->k_sl);
    *sl = kv ? p->v_sl : p->k_sl;
    *scale = (kv ? p->v_scale : p->k_scale) +
             fa_kv_row_at(p, it->b, it->g, j, kv ? p->vs_sb : p->ks_sb, kv ? p->vs_sh : p->ks_sh,
                          kv ? p->vs_sl : p->ks_sl);
    *ssl = kv ? p->vs_sl : p->ks_sl;
    *gshift = __builtin_ctzll((unsigned long long)group);
    return 1;
#else
    (void)p, (void)it, (void)j0, (void)nk, (void)kv, (void)rows, (void)sl, (void)scale, (void)ssl,
        (void)gshift;
    return 0;
#endif
}
