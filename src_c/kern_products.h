/*
 * kern_products.h -- part of the kernel template (kernels_tmpl.h): the tile products.
 *   fa_qk_tile       S^T = K qt for a block of query vectors (the query axis on the
 *                    lanes, one key element broadcast), register tiles FA_QK_R x FA_QK_NV
 *   fa_qk_keys       the same logits for a few rows (decoding) with the keys on the
 *                    lanes (K transposed in registers), adding the same products in the
 *                    same order, so a decoded row has a prefill row's bits
 *   fa_pv_tile, fa_pv_tile_rows, fa_pv_tile_strided
 *                    O = alpha O + P V (query-major, key-major, or any strides: the
 *                    backward's dK, dV and dQ are this product with other roles)
 *
 * Needs from the including ISA file: the vector operations (FA_VLOAD ... FA_VFMA),
 * FA_QK_R/FA_QK_NV, FA_PV_R/FA_PV_NC, the FA_KV_* loads, and FA_VTRANSPOSE where
 * FA_HAVE_TRANSPOSE is defined.
 */

/* Groups of FA_VL keys the keys-on-lanes QK^T takes at once for three or four rows
 * (fa_qk_lanes): FA_LANES_G34, the including file's choice by its vector registers (4
 * with 32: 16 accumulators), for keys of type Q (fa_lane_vec); 2 for 16-bit keys.
 * Four groups are four streams of keys instead of two: from memory (caches larger
 * than the L3 in turn), GQA 32/8 and Lq 4 at Lk 8192, 2 threads, on the Sapphire
 * Rapids class Xeon, int4 0.85x the time of two groups, int8 0.89-0.90x, float32
 * 0.97-0.99x, but float16 1.04-1.06x (so 16-bit keys keep two).  No bit changes:
 * each key's chain is the same. */
#ifndef FA_LANES_G34
#define FA_LANES_G34 2
#endif
#define FA_LANES_G34_OF(Q) ((Q) != 0 || sizeof(FA_KV) >= 4 ? FA_LANES_G34 : 2)
/* On AMD float32 keys of three or four rows take two groups (int8 and int4 ones keep
 * FA_LANES_G34): from memory (caches larger than the L3 in turn), B1 GQA 32/8 and Lq 4
 * at Lk 8192, 2 threads, AMD EPYC Zen 5 (family 26 model 2), separate processes
 * alternating, medians of 7-9 rounds, time of two groups against four: float32 GQA
 * 0.89-0.98 (seven runs, bound and unbound), Lq 4 0.91-0.97 (five); int4 GQA 0.93-1.10
 * (four), Lq 4 1.06; int8 GQA 1.25, Lq 4 1.27 (bench/NOTEBOOK.md, 2026-12-07, seventh
 * session).  fa_set_lane_groups (tests) forces either. */
#define FA_LANES_G34_AT(Q)                                                                          \
    (FA_LANES_G34 > 2 && (Q) == 0 && (fa_lane_groups_mode ? fa_lane_groups_mode == 2 : fa_cpu_amd()) \
         ? 2                                                                                         \
         : FA_LANES_G34_OF(Q))
#define FA_LANES_ACC (4 * FA_LANES_G34 > FA_DOT_ROWS ? 4 * FA_LANES_G34 : FA_DOT_ROWS)

/* A logit tile's R x NV accumulators stored at s (rows brp apart) and, with cm (not
 * NULL), each query vector's max over the R keys folded into cm. */
FA_ALWAYS_INLINE void FA_NAME(fa_qk_store)(const int R, const int NV, FA_V acc[FA_QK_R][FA_QK_NV],
                                           FA_T *FA_RESTRICT s, int64_t brp, FA_T *FA_RESTRICT cm)
{
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NV; c++) FA_VSTORE(s + r * brp + c * FA_VL, acc[r][c]);
    if (cm)
        for (int c = 0; c < NV; c++) {
            FA_V mx = FA_VLOAD(cm + c * FA_VL);
            for (int r = 0; r < R; r++) mx = FA_VMAX(mx, acc[r][c]);
            FA_VSTORE(cm + c * FA_VL, mx);
        }
}

/* S^T tile: s[j][c*VL ...] = sum_d k[j][d] * qt[d][c*VL ...] for R keys and NV query
 * vectors, accumulators in registers (R and NV are constants after inlining).  With
 * cm (not NULL), also cm[c*VL ...] = max(cm, the R logits) per lane, from the
 * registers: the softmax then needs no pass over the tile for its max. */
FA_ALWAYS_INLINE void FA_NAME(fa_qk_micro)(const int R, const int NV, const FA_T *FA_RESTRICT qt,
                                           const FA_KV *FA_RESTRICT k, int64_t k_sl, int64_t D,
                                           FA_T *FA_RESTRICT s, int64_t brp, FA_T *FA_RESTRICT cm)
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
    FA_NAME(fa_qk_store)(R, NV, acc, s, brp, cm);
}

#define FA_QK_CASE(R, NV)                                                                   \
    case (R) * 8 + (NV):                                                                    \
        if ((R) <= FA_QK_R && (NV) <= FA_QK_NV)                                             \
            FA_NAME(fa_qk_micro)(R, NV, qt + cv * FA_VL, kj, k_sl, D, sj, brp, cmj);             \
        break;

#if !(defined(FA_KV_HALF) && defined(FA_F32)) /* (16-bit K/V: the float32 one, on a float32 tile) */
/* The logits of nk keys (rows of k) against the packed query block (nv vectors);
 * with colmax (nv vectors, not NULL), also each lane's max over the keys, folded
 * into what colmax holds (the max of the same values in another order: the same
 * result but for the sign of a zero max and which NaN, neither of which reaches the
 * output or lse). */
static void FA_NAME(fa_qk_tile)(const FA_T *FA_RESTRICT qt, int nv, const FA_KV *FA_RESTRICT k,
                                int64_t k_sl, int64_t nk, int64_t D, FA_T *FA_RESTRICT s,
                                int64_t brp, FA_T *FA_RESTRICT colmax)
{
    /* Query-vector groups outer: their slice of qt (D x FA_QK_NV vectors) stays in L1
     * while the key tile streams past it. */
    for (int cv = 0; cv < nv; cv += FA_QK_NV) {
        int ncv = nv - cv < FA_QK_NV ? nv - cv : FA_QK_NV;
        for (int64_t j = 0; j < nk; j += FA_QK_R) {
            fa_pf_step(); /* the next item's rows, a few lines (fa_pf_now) */
            int r = (int)(nk - j < FA_QK_R ? nk - j : FA_QK_R);
            const FA_KV *kj = k + j * k_sl;
            FA_T *sj = s + j * brp + cv * FA_VL;
            FA_T *cmj = colmax ? colmax + cv * FA_VL : NULL;
            switch (r * 8 + ncv) {
                FA_TILE_ROWS(FA_QK_CASE)
                default: break;
            }
        }
    }
}
#endif
#undef FA_QK_CASE

/* The logits of a block of at most FA_DOT_ROWS rows (decoding: one position, or a
 * GQA group's heads at one position) with the keys on the lanes: lane i of a group
 * of FA_VL keys accumulates k[j0 + i][d] * qt[d][r] over d in order, starting from
 * 0 -- exactly the chain of fa_qk_micro, so a logit has the same bits whether its
 * row was decoded or part of a prefill block (fa_qk_tile on few rows would leave
 * most lanes empty: 4-5x slower decoding, measured).
 *
 * With a register transpose (FA_HAVE_TRANSPOSE), the group's FA_VL rows are loaded
 * FA_VL features at a time, transposed in registers and multiplied at once; nothing
 * goes through memory, and the rows two groups ahead are asked for whole, in address
 * order, a few at each feature chunk (fa_ask_rows: the hardware does not follow reads
 * spread over FA_VL rows on its own).  Measured on the AMD EPYC Zen 3, 1 thread, against
 * the product that stored the transposed rows (kt) and read them back: 1.4x faster
 * from L3 (B=1 H=1 Lk=8192 D=128); several groups side by side (more independent
 * chains) were slower both from L3 and from memory, the wider spread of rows
 * costing more than the FMA latency they hide.  Without a transpose (the generic
 * kernel), the group is transposed into kt element by element. */
/* FA_VL values of a K or V row from column c: FA_KV converted, or with I8 (a constant
 * after inlining) int8 times the scale of its channel group, srow[c >> gshift] (groups
 * of a power of two >= FA_VL channels): the float32 multiply of dequantize_kv, so the
 * products see the values a staged tile (kern_source.h) holds. */
#if defined(FA_HAVE_SSE2) && defined(FA_I8_CVT)
/* FA_VL int4 codes (two a byte, code 2i in byte i's low nibble) from byte b, minus
 * `sub`, as float32 lanes (exact), without leaving the registers. */
FA_ALWAYS_INLINE FA_V FA_NAME(fa_nibbles_v)(const uint8_t *b, int sub)
{
    __m128i x = FA_VL == 16 ? _mm_loadl_epi64((const __m128i *)(const void *)b)
                            : _mm_cvtsi32_si128(*(const int *)(const void *)b);
    const __m128i m = _mm_set1_epi8(15);
    x = _mm_unpacklo_epi8(_mm_and_si128(x, m), _mm_and_si128(_mm_srli_epi16(x, 4), m));
    return FA_I8_CVT(_mm_sub_epi8(x, _mm_set1_epi8((char)sub)));
}
#endif

/* FA_VL int4 codes (two a byte, code 2i in byte i's low nibble) from byte b, minus
 * `sub`, as int8 in c[0 .. FA_VL). */
FA_ALWAYS_INLINE void FA_NAME(fa_nibbles)(const uint8_t *b, int sub, int8_t *c)
{
#if defined(FA_HAVE_SSE2) && defined(FA_I8_LOADU)
    __m128i x = FA_VL == 16 ? _mm_loadl_epi64((const __m128i *)(const void *)b)
                            : _mm_cvtsi32_si128(*(const int *)(const void *)b);
    const __m128i m = _mm_set1_epi8(15);
    x = _mm_unpacklo_epi8(_mm_and_si128(x, m), _mm_and_si128(_mm_srli_epi16(x, 4), m));
    _mm_storeu_si128((__m128i *)(void *)c, _mm_sub_epi8(x, _mm_set1_epi8((char)sub)));
#else
    for (int i = 0; i < FA_VL / 2; i++) {
        c[2 * i] = (int8_t)((b[i] & 15) - sub);
        c[2 * i + 1] = (int8_t)((b[i] >> 4) - sub);
    }
#endif
}

/* FA_VL values of a row from channel c (a multiple of FA_VL): the stored values (I8
 * 0), int8 codes (1) or int4 codes (2: two a byte, nibble - 8) times the scale of
 * their group (srow[c >> gshift]) */
FA_ALWAYS_INLINE FA_V FA_NAME(fa_row_load)(const int I8, const void *row, int64_t c,
                                           const float *srow, int gshift)
{
#ifdef FA_LUT16_WIDEN
    if (I8 == 2 && gshift == 5) { /* the table of the group's 16 values (c - 8) * s */
        const __m128i x = _mm_loadu_si128((const __m128i *)(const void *)((const uint8_t *)row + (c >> 5) * 16));
        const FA_V t = FA_VMUL(FA_VSUB(FA_LUT16_IOTA(), FA_VSET1(8.f)), FA_VSET1(srow[c >> 5]));
        return (c & 16) ? FA_LUT16_HI(FA_LUT16_WIDEN(x), t) : FA_LUT16_LO(FA_LUT16_WIDEN(x), t);
    }
#endif
#if defined(FA_HAVE_SSE2) && defined(FA_I8_CVT)
    if (I8 == 2 && gshift == 5) { /* groups of 32: byte i holds channels i and i + 16 */
        const uint8_t *b = (const uint8_t *)row + (c >> 5) * 16 + (c & 15);
        __m128i x = FA_VL == 16 ? _mm_loadu_si128((const __m128i *)(const void *)b)
                                : _mm_loadl_epi64((const __m128i *)(const void *)b);
        if (c & 16) x = _mm_srli_epi16(x, 4);
        x = _mm_sub_epi8(_mm_and_si128(x, _mm_set1_epi8(15)), _mm_set1_epi8(8));
        return FA_VMUL(FA_I8_CVT(x), FA_VSET1(srow[c >> 5]));
    }
    if (I8 == 2) return FA_VMUL(FA_NAME(fa_nibbles_v)((const uint8_t *)row + c / 2, 8), FA_VSET1(srow[c >> gshift]));
#endif
#ifdef FA_U4_LOADU
    if (I8 == 2 && gshift == 5) { /* the codes unpacked in registers: (c - 8) * s, exactly as below */
        const uint8_t *b = (const uint8_t *)row + (c >> 5) * 16 + (c & 15);
        return FA_VMUL(FA_VSUB(FA_U4_LOADU(b, (c & 16) ? 4 : 0), FA_VSET1(8.f)), FA_VSET1(srow[c >> 5]));
    }
#endif
#ifdef FA_I8_LOADU
    if (I8 == 2) {
        int8_t codes[16];
        if (gshift == 5) {
            const uint8_t *b = (const uint8_t *)row + (c >> 5) * 16 + (c & 15);
            for (int i = 0; i < FA_VL; i++) codes[i] = (int8_t)(((b[i] >> ((c & 16) ? 4 : 0)) & 15) - 8);
        } else {
            FA_NAME(fa_nibbles)((const uint8_t *)row + c / 2, 8, codes);
        }
        return FA_VMUL(FA_I8_LOADU(codes), FA_VSET1(srow[c >> gshift]));
    }
    if (I8) return FA_VMUL(FA_I8_LOADU((const int8_t *)row + c), FA_VSET1(srow[c >> gshift]));
#endif
    (void)I8;
    (void)srow;
    (void)gshift;
    return FA_KV_LOADU((const FA_KV *)row + c);
}

#ifdef FA_HAVE_TRANSPOSE
/* The prefetches of a group's product: the `rows` rows (rb bytes each, `row` bytes
 * apart) that a later call reads, asked for whole and in address order, rows / nch of
 * them at each of the product's nch feature chunks (*r: the next row to ask for, *acc
 * the running remainder).  The products read a group's rows across, FA_VL features of
 * each in turn, which the hardware's stream prefetcher does not follow.  In a C model
 * of the decode loop (the AMD EPYC Zen 3, 1 thread, B=1 H=32 Lk=8192 D=128, from
 * memory), K and V took 1.4x the time of a sequential read of the same bytes with the
 * rows asked for line by line in that same across-rows order, 1.2-1.25x asked for
 * in address order; in fastattn, 0.67-0.80x the decode time of the line-by-line asks
 * (float32 caches, 1 and 2 threads, interleaved). */
FA_ALWAYS_INLINE void FA_NAME(fa_ask_rows)(const char *pf, int64_t rows, int64_t row, int64_t rb,
                                           int64_t *r, int64_t *acc, int64_t nch)
{
    for (*acc += rows; *acc >= nch; *acc -= nch, (*r)++)
        for (int64_t off = 0; off < rb; off += 64) __builtin_prefetch((const void *)(pf + *r * row + off));
}

/* (I8: k is int8 with scales ks8 (row stride ks8_sl), D a multiple of FA_VL) */
FA_ALWAYS_INLINE void FA_NAME(fa_qk_keys_micro)(const int R, const int I8, const FA_T *FA_RESTRICT qt,
                                                int64_t brp, const void *FA_RESTRICT k, int64_t k_sl,
                                                const float *ks8, int64_t ks8_sl, int gshift,
                                                const char *pf, int64_t nj, int64_t D,
                                                FA_T *FA_RESTRICT s, int64_t ks, int64_t rs,
                                                FA_T *FA_RESTRICT kt)
{
    (void)kt;
    const int64_t esz = I8 ? 1 : (int64_t)sizeof(FA_KV), row = k_sl * esz;
    const int64_t nch = (D + FA_VL - 1) / FA_VL;
    int64_t pfr = 0, pfacc = 0;
    /* (unrolled by pragmas: left to GCC's heuristics the accumulators went through
     * memory, measured) */
    FA_V acc[FA_DOT_ROWS];
    FA_PRAGMA_UNROLL(8)
    for (int r = 0; r < R; r++) acc[r] = FA_VZERO();
    int64_t d0 = 0;
#ifdef FA_KV16_PAIR
    /* 16-bit K, a whole group: two feature chunks at once, transposed as 16-bit values
     * and converted after (FA_KV16_PAIR, from the ISA file: v[e] holds features d0 + e
     * and d0 + FA_VL + e of the group's keys, FA_KV16_LO / _HI convert them), half the
     * shuffles of transposing each chunk's converted floats; the same values and the
     * same FMAs in the same order as the loop below */
    for (; !I8 && nj == FA_VL && d0 + 2 * FA_VL <= D; d0 += 2 * FA_VL) {
        const FA_T *q = qt + d0 * brp;
        FA_NAME(fa_ask_rows)(pf, FA_VL, row, D * esz, &pfr, &pfacc, nch);
        FA_NAME(fa_ask_rows)(pf, FA_VL, row, D * esz, &pfr, &pfacc, nch);
        FA_KV16_V v[FA_VL];
        FA_KV16_PAIR((const char *)k + d0 * esz, row, v);
        FA_PRAGMA_UNROLL(16)
        for (int e = 0; e < FA_VL; e++) {
            const FA_V x = FA_KV16_LO(v[e]);
            FA_PRAGMA_UNROLL(8)
            for (int r = 0; r < R; r++) acc[r] = FA_VFMA(x, FA_VSET1(q[e * brp + r]), acc[r]);
        }
        FA_PRAGMA_UNROLL(16)
        for (int e = 0; e < FA_VL; e++) {
            const FA_V x = FA_KV16_HI(v[e]);
            FA_PRAGMA_UNROLL(8)
            for (int r = 0; r < R; r++) acc[r] = FA_VFMA(x, FA_VSET1(q[(FA_VL + e) * brp + r]), acc[r]);
        }
    }
#endif
    for (; d0 < D; d0 += FA_VL) {
        const int nd = (int)(D - d0 < FA_VL ? D - d0 : FA_VL);
        const FA_T *q = qt + d0 * brp;
        const char *kd = (const char *)k + d0 * esz;
        FA_V t[FA_VL];
        FA_NAME(fa_ask_rows)(pf, FA_VL, row, D * esz, &pfr, &pfacc, nch);
        if (I8 && d0 == 0)
            for (int i = 0; i < FA_VL; i++) __builtin_prefetch((const void *)(ks8 + (2 * FA_VL + i) * ks8_sl));
        if (nj == FA_VL && nd == FA_VL) {
            FA_PRAGMA_UNROLL(16)
            for (int i = 0; i < FA_VL; i++)
                t[i] = FA_NAME(fa_row_load)(I8, kd + i * row, 0, I8 ? ks8 + i * ks8_sl + (d0 >> gshift) : ks8, 0);
        } else {
            for (int i = 0; i < FA_VL; i++)
                t[i] = i >= nj ? FA_VZERO()
                       : nd == FA_VL ? FA_NAME(fa_row_load)(I8, kd + i * row, 0,
                                                            I8 ? ks8 + i * ks8_sl + (d0 >> gshift) : ks8, 0)
                                     : FA_KV_LOADU_N((const FA_KV *)(const void *)(kd + i * row), nd);
        }
        FA_VTRANSPOSE_REGS(t); /* t[e] lane i: feature d0 + e of key i */
        if (nd == FA_VL) {
            FA_PRAGMA_UNROLL(16)
            for (int e = 0; e < FA_VL; e++) {
                FA_PRAGMA_UNROLL(8)
                for (int r = 0; r < R; r++) acc[r] = FA_VFMA(t[e], FA_VSET1(q[e * brp + r]), acc[r]);
            }
        } else {
            for (int e = 0; e < nd; e++) {
                FA_PRAGMA_UNROLL(8)
                for (int r = 0; r < R; r++) acc[r] = FA_VFMA(t[e], FA_VSET1(q[e * brp + r]), acc[r]);
            }
        }
    }
    FA_PRAGMA_UNROLL(8)
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

#else
/* R rows (a constant after inlining) of one key group, transposed into kt first:
 * lane i of acc[r] accumulates kt[d][i] * qt[d][r] over d in order; each kt vector
 * is loaded once for all the rows. */
FA_ALWAYS_INLINE void FA_NAME(fa_qk_keys_micro)(const int R, const int I8, const FA_T *FA_RESTRICT qt,
                                                int64_t brp, const void *FA_RESTRICT kv, int64_t k_sl,
                                                const float *ks8, int64_t ks8_sl, int gshift,
                                                const char *pf, int64_t nj, int64_t D,
                                                FA_T *FA_RESTRICT s, int64_t ks, int64_t rs,
                                                FA_T *FA_RESTRICT kt)
{
    const FA_KV *k = (const FA_KV *)kv; /* (no int8 here: I8 is 0) */
    (void)pf;
    (void)I8;
    (void)ks8;
    (void)ks8_sl;
    (void)gshift;
    for (int64_t d = 0; d < D; d++)
        for (int64_t i = 0; i < FA_VL; i++)
            kt[d * FA_VL + i] = i < nj ? (FA_T)FA_KV_SCALAR(k[i * k_sl + d]) : (FA_T)0;
    FA_V acc[FA_DOT_ROWS];
    for (int r = 0; r < R; r++) acc[r] = FA_VZERO();
    for (int64_t d = 0; d < D; d++) {
        const FA_V kv = FA_VLOAD(kt + d * FA_VL);
        for (int r = 0; r < R; r++) acc[r] = FA_VFMA(kv, FA_VSET1(qt[d * brp + r]), acc[r]);
    }
    for (int r = 0; r < R; r++) {
        FA_T lanes[FA_VL];
        FA_VSTOREU(lanes, acc[r]);
        for (int64_t i = 0; i < nj; i++) s[i * ks + r * rs] = lanes[i];
    }
}

#endif

/* ... logit (row r, key j) stored at s[j * ks + r * rs]: query-major (ks = brp, rs =
 * 1) or key-major (ks = 1, rs = the row stride); kt (D x FA_VL) is the scratch of the
 * kernels without a register transpose; `after` (or NULL: further on in k) is where
 * the rows that follow k's nk rows are, for the prefetches (a paged cache's next page). */
FA_ALWAYS_INLINE void FA_NAME(fa_qk_keys_any)(const int I8, const FA_T *FA_RESTRICT qt, int64_t brp,
                                              int64_t nr, const void *FA_RESTRICT k, int64_t k_sl,
                                              const float *ks8, int64_t ks8_sl, int gshift,
                                              const char *after, int64_t nk, int64_t D,
                                              FA_T *FA_RESTRICT s, FA_T *FA_RESTRICT kt, int64_t ks,
                                              int64_t rs)
{
    const int64_t row = k_sl * (I8 ? 1 : (int64_t)sizeof(FA_KV));
    for (int64_t j0 = 0; j0 < nk; j0 += FA_VL) {
        const int64_t nj = nk - j0 < FA_VL ? nk - j0 : FA_VL;
        const char *kj = (const char *)k + j0 * row;
        /* the rows two groups ahead, asked for as this group is read: further on in k,
         * or (past its nk rows) in the rows that follow them elsewhere (`after`: the
         * next page of a paged cache) */
        const char *pf = j0 + 2 * FA_VL < nk || !after ? kj + 2 * FA_VL * row
                                                       : after + (j0 + 2 * FA_VL - nk) * row;
        const float *sj8 = I8 ? ks8 + j0 * ks8_sl : ks8;
        FA_T *sj = s + j0 * ks;
        switch (nr) {
#define FA_KEYS_CASE(R) \
    case R: FA_NAME(fa_qk_keys_micro)(R, I8, qt, brp, kj, k_sl, sj8, ks8_sl, gshift, pf, nj, D, sj, ks, rs, kt); break;
            FA_KEYS_CASE(1) FA_KEYS_CASE(2) FA_KEYS_CASE(3) FA_KEYS_CASE(4)
            FA_KEYS_CASE(5) FA_KEYS_CASE(6) FA_KEYS_CASE(7) FA_KEYS_CASE(8)
#undef FA_KEYS_CASE
            default: break;
        }
    }
}

static void FA_NAME(fa_qk_keys)(const FA_T *FA_RESTRICT qt, int64_t brp, int64_t nr,
                                const FA_KV *FA_RESTRICT k, int64_t k_sl, const char *after,
                                int64_t nk, int64_t D, FA_T *FA_RESTRICT s, FA_T *FA_RESTRICT kt,
                                int64_t ks, int64_t rs)
{
    FA_NAME(fa_qk_keys_any)(0, qt, brp, nr, k, k_sl, NULL, 0, 0, after, nk, D, s, kt, ks, rs);
}

#if defined(FA_I8_LOADU) && defined(FA_HAVE_TRANSPOSE)
#define FA_HAVE_I8_PRODUCTS 1
/* The decode products reading an int8 tile in registers (fa_row_load): the logits of
 * fa_qk_keys and the P.V of fa_pv_rows_seq, with the same bits as on the tile
 * dequantized (k8 and v8 rows of k_sl / v_sl bytes, their scales' rows ks8_sl / vs8_sl
 * floats apart; D, Dv multiples of FA_VL). */
static void FA_NAME(fa_qk_keys_i8)(const FA_T *FA_RESTRICT qt, int64_t brp, int64_t nr,
                                   const int8_t *FA_RESTRICT k8, int64_t k_sl, const float *ks8,
                                   int64_t ks8_sl, int gshift, const char *after, int64_t nk,
                                   int64_t D, FA_T *FA_RESTRICT s, int64_t ks, int64_t rs)
{
    FA_NAME(fa_qk_keys_any)(1, qt, brp, nr, k8, k_sl, ks8, ks8_sl, gshift, after, nk, D, s, NULL, ks, rs);
}
#endif

/* One vector of K stored on the lanes (p->k_lanes, fastattn.KVCache): one channel of
 * FA_VL keys from `at`, its first lane's element (lanes a multiple of FA_VL, blocks a
 * multiple of 16, so every lane read is in the block).  Q 0: the stored values (float
 * or 16-bit); 8: int8 codes; 4: int4 codes, a byte a lane holding two channels (the
 * low nibble, or the high one with hi), so FA_VL of them are one load, a shift and a
 * mask.  Codes dequantized as fmaf(code, *s, *z): one rounding, the value fa_lanes_tile
 * stages. */
FA_ALWAYS_INLINE FA_V FA_NAME(fa_lane_vec)(const int Q, const char *at, int hi, const float *s, const float *z)
{
    if (Q == 0) return FA_KV_LOADU((const FA_KV *)(const void *)at);
#ifdef FA_LUT16_WIDEN
    if (Q == 4) { /* the table of the channel's 16 values fmaf(c, s, z) */
        const FA_LUT16_I w = FA_LUT16_WIDEN(_mm_loadu_si128((const __m128i *)(const void *)at));
        const FA_V t = FA_VFMA(FA_LUT16_IOTA(), FA_VSET1(*s), FA_VSET1(*z));
        return hi ? FA_LUT16_HI(w, t) : FA_LUT16_LO(w, t);
    }
#endif
#if defined(FA_HAVE_SSE2) && defined(FA_I8_CVT)
    if (Q == 4) {
        __m128i x = FA_VL == 16 ? _mm_loadu_si128((const __m128i *)(const void *)at)
                                : _mm_loadl_epi64((const __m128i *)(const void *)at);
        if (hi) x = _mm_srli_epi16(x, 4);
        return FA_VFMA(FA_I8_CVT(_mm_and_si128(x, _mm_set1_epi8(15))), FA_VSET1(*s), FA_VSET1(*z));
    }
#endif
#ifdef FA_U4_LOADU
    if (Q == 4) return FA_VFMA(FA_U4_LOADU(at, hi ? 4 : 0), FA_VSET1(*s), FA_VSET1(*z));
#endif
    int8_t c[16];
    const int8_t *cp = (const int8_t *)at;
    if (Q == 4) {
        for (int i = 0; i < FA_VL; i++) c[i] = (int8_t)((((const uint8_t *)at)[i] >> (hi ? 4 : 0)) & 15);
        cp = c;
    }
#if defined(FA_I8_LOADU)
    return FA_VFMA(FA_I8_LOADU(cp), FA_VSET1(*s), FA_VSET1(*z));
#else
    FA_T t[FA_VL];
    for (int i = 0; i < FA_VL; i++) t[i] = (FA_T)fmaf((float)cp[i], *s, *z);
    return FA_VLOADU(t);
#endif
}

/* Channel d's row of a lanes block from lane `lane`: bytes from the block's start. */
FA_ALWAYS_INLINE int64_t FA_NAME(fa_lane_off)(const int Q, int64_t d, int64_t lane, int64_t bs)
{
    return Q == 4 ? (d >> 1) * bs + lane : Q == 8 ? d * bs + lane : (d * bs + lane) * (int64_t)sizeof(FA_KV);
}

/* The lines of pf whose starts lie in [a, b): b - a is a group set's bytes a feature
 * (G FA_VL keys of type Q), so at most maxl of them, asked for without a loop (a loop
 * of unknown count inside the feature loop made GCC keep accumulators on the stack) */
FA_ALWAYS_INLINE void FA_NAME(fa_lanes_pf)(const int G, const int Q, const char *pf, int64_t a, int64_t b, int pf_to)
{
    if (pf_to == FA_PF_OFF) return;
    const int maxl = (int)((G * FA_VL * (Q == 4 ? 1 : Q == 8 ? 2 : 2 * (int)sizeof(FA_KV)) / 2 + 63) / 64) + 1;
    int64_t o = (a + 63) & ~(int64_t)63;
    FA_PRAGMA_UNROLL(16)
    for (int i = 0; i < maxl; i++, o += 64)
        if (o < b) FA_PF_KV(pf + o, pf_to);
}

/* The logits of R rows x G groups of FA_VL keys on the lanes (acc[g * R + r]) to s: key i of
 * group g at (g * FA_VL + i) * ks, row r at r * rs, the group's first nj[g] lanes. */
FA_ALWAYS_INLINE void FA_NAME(fa_lanes_store)(const int R, const int G, const FA_V *acc,
                                              const int64_t *nj, FA_T *FA_RESTRICT s, int64_t ks, int64_t rs)
{
    FA_PRAGMA_UNROLL(4)
    for (int g = 0; g < G; g++)
        FA_PRAGMA_UNROLL(8)
        for (int r = 0; r < R; r++) {
            FA_T *dst = s + g * FA_VL * ks + r * rs;
            if (ks == 1 && nj[g] == FA_VL) {
                FA_VSTOREU(dst, acc[g * R + r]);
                continue;
            }
            FA_T lanes[FA_VL];
            FA_VSTOREU(lanes, acc[g * R + r]);
            for (int64_t i = 0; i < nj[g]; i++) dst[i * ks] = lanes[i];
        }
}

/* R rows x G groups of FA_VL keys on the lanes: lane i of acc[g * R + r] accumulates feature
 * d of key i of group g times qt[d][r], d in order (one FMA chain a key and a row, as
 * fa_qk_keys after its transpose: the same bits).  The G groups' chains are
 * independent: interleaved, each hides the latency of the others.  Group g's keys go
 * to s (key i at i * ks, row r at r * rs) for its first nj[g] lanes. */
FA_ALWAYS_INLINE void FA_NAME(fa_qk_lanes_micro)(const int R, const int G, const int Q, const FA_T *FA_RESTRICT qt,
                                                 int64_t brp, const char *const *blk, const int64_t *lane,
                                                 const float *const *sp, const float *const *zp, int64_t bs,
                                                 int64_t D, const int64_t *nj, FA_T *FA_RESTRICT s, int64_t ks,
                                                 int64_t rs, const char *pf, int64_t pf_step, int pf_to)
{
    FA_V acc[FA_LANES_ACC]; /* acc[g * R + r]: G R <= FA_LANES_ACC */
    FA_PRAGMA_UNROLL(4)
    for (int g = 0; g < G; g++)
        FA_PRAGMA_UNROLL(8)
        for (int r = 0; r < R; r++) acc[g * R + r] = FA_VZERO();
    for (int64_t d = 0; d < D; d++) {
        const FA_T *q = qt + d * brp;
        /* the blocks two group sets ahead, a line or a few at each feature (they are
         * contiguous: a slot's blocks of a kv head follow one another) */
        FA_NAME(fa_lanes_pf)(G, Q, pf, d * pf_step, (d + 1) * pf_step, pf_to);
        FA_PRAGMA_UNROLL(4)
        for (int g = 0; g < G; g++) {
            const FA_V x = FA_NAME(fa_lane_vec)(Q, blk[g] + FA_NAME(fa_lane_off)(Q, d, lane[g], bs), (int)(d & 1),
                                                Q ? sp[g] + d : NULL, Q ? zp[g] + d : NULL);
            FA_PRAGMA_UNROLL(8)
            for (int r = 0; r < R; r++) acc[g * R + r] = FA_VFMA(x, FA_VSET1(q[r]), acc[g * R + r]);
        }
    }
    FA_NAME(fa_lanes_store)(R, G, acc, nj, s, ks, rs);
}

#ifdef FA_LUT16_WIDEN
/* fa_qk_lanes_uni's int4 features d (and d + 1 where TWO) from one widened load a group,
 * each channel through the table of its 16 values fmaf(c, s, z) (the values the
 * conversions give, so the same bits): a widening, a shift and two table reads a byte
 * where masks and conversions took nine operations.  SH: the groups share one block's
 * scales (sstride 0), one pair of tables for all. */
FA_ALWAYS_INLINE void FA_NAME(fa_uni4_step)(const int R, const int G, const int SH, const int TWO, int64_t d,
                                            const FA_T *FA_RESTRICT qt, int64_t brp, const char *base,
                                            int64_t gstride, const float *sp, const float *zp, int64_t sstride,
                                            int64_t bs, FA_V acc[FA_LANES_ACC])
{
    const FA_V iota = FA_LUT16_IOTA();
    const FA_T *q = qt + d * brp;
    const char *bd = base + FA_NAME(fa_lane_off)(4, d, 0, bs);
    FA_V tl = FA_VZERO(), th = FA_VZERO();
    if (SH) {
        tl = FA_VFMA(iota, FA_VSET1(sp[d]), FA_VSET1(zp[d]));
        if (TWO) th = FA_VFMA(iota, FA_VSET1(sp[d + 1]), FA_VSET1(zp[d + 1]));
    }
    FA_PRAGMA_UNROLL(4)
    for (int g = 0; g < G; g++) {
        if (!SH) {
            const float *sg = sp + g * sstride + d, *zg = zp + g * sstride + d;
            tl = FA_VFMA(iota, FA_VSET1(sg[0]), FA_VSET1(zg[0]));
            if (TWO) th = FA_VFMA(iota, FA_VSET1(sg[1]), FA_VSET1(zg[1]));
        }
        const FA_LUT16_I w = FA_LUT16_WIDEN(_mm_loadu_si128((const __m128i *)(const void *)(bd + g * gstride)));
        const FA_V lo = FA_LUT16_LO(w, tl);
        FA_PRAGMA_UNROLL(8)
        for (int r = 0; r < R; r++) acc[g * R + r] = FA_VFMA(lo, FA_VSET1(q[r]), acc[g * R + r]);
        if (TWO) {
            const FA_V hi = FA_LUT16_HI(w, th);
            FA_PRAGMA_UNROLL(8)
            for (int r = 0; r < R; r++) acc[g * R + r] = FA_VFMA(hi, FA_VSET1(q[brp + r]), acc[g * R + r]);
        }
    }
}

FA_ALWAYS_INLINE void FA_NAME(fa_qk_uni4_lut)(const int R, const int G, const int SH, const FA_T *FA_RESTRICT qt,
                                              int64_t brp, const char *base, int64_t gstride, const float *sp,
                                              const float *zp, int64_t sstride, int64_t bs, int64_t D,
                                              FA_V acc[FA_LANES_ACC], const char *pf, int64_t pf_step, int pf_to)
{
    int64_t d = 0;
    for (; d + 1 < D; d += 2) {
        FA_NAME(fa_lanes_pf)(G, 8, pf, d * pf_step, (d + 2) * pf_step, pf_to);
        FA_NAME(fa_uni4_step)(R, G, SH, 1, d, qt, brp, base, gstride, sp, zp, sstride, bs, acc);
    }
    if (d < D) { /* an odd D's last channel, a low nibble */
        FA_NAME(fa_lanes_pf)(G, 8, pf, d * pf_step, (d + 2) * pf_step, pf_to);
        FA_NAME(fa_uni4_step)(R, G, SH, 0, d, qt, brp, base, gstride, sp, zp, sstride, bs, acc);
    }
}
#endif

/* fa_qk_lanes_micro where the G groups are evenly spaced: group g's block data at
 * base + g * gstride bytes, its scales and zero points at sp, zp + g * sstride: all G
 * groups in one block (gstride FA_VL lanes), or one group a block in
 * consecutive blocks (block_size FA_VL).  One base pointer instead of G of each kind:
 * the general micro-kernel's 12 pointers of an int8 set did not fit the registers
 * (spilled and reloaded in the feature loop). */
FA_ALWAYS_INLINE void FA_NAME(fa_qk_lanes_uni)(const int R, const int G, const int Q, const FA_T *FA_RESTRICT qt,
                                               int64_t brp, const char *base, int64_t gstride, const float *sp,
                                               const float *zp, int64_t sstride, int64_t bs, int64_t D,
                                               const int64_t *nj, FA_T *FA_RESTRICT s, int64_t ks, int64_t rs,
                                               const char *pf, int64_t pf_step, int pf_to)
{
    FA_V acc[FA_LANES_ACC]; /* acc[g * R + r]: G R <= FA_LANES_ACC */
    FA_PRAGMA_UNROLL(4)
    for (int g = 0; g < G; g++)
        FA_PRAGMA_UNROLL(8)
        for (int r = 0; r < R; r++) acc[g * R + r] = FA_VZERO();
#ifdef FA_LUT16_WIDEN
    if (Q == 4) {
        if (sstride == 0)
            FA_NAME(fa_qk_uni4_lut)(R, G, 1, qt, brp, base, gstride, sp, zp, sstride, bs, D, acc, pf, pf_step, pf_to);
        else
            FA_NAME(fa_qk_uni4_lut)(R, G, 0, qt, brp, base, gstride, sp, zp, sstride, bs, D, acc, pf, pf_step, pf_to);
        FA_NAME(fa_lanes_store)(R, G, acc, nj, s, ks, rs);
        return;
    }
#endif
#if defined(FA_HAVE_SSE2) && defined(FA_I8_CVT)
    if (Q == 4) {
        /* int4: the two channels of a byte together, from one load (a shift and two
         * masks for FA_VL keys of both); each accumulator still takes d, then d + 1 */
        for (int64_t d = 0; d < D; d += 2) {
            const FA_T *q = qt + d * brp;
            FA_NAME(fa_lanes_pf)(G, 8, pf, d * pf_step, (d + 2) * pf_step, pf_to);
            const char *bd = base + FA_NAME(fa_lane_off)(4, d, 0, bs);
            const __m128i m = _mm_set1_epi8(15);
            FA_PRAGMA_UNROLL(4)
            for (int g = 0; g < G; g++) {
                const char *at = bd + g * gstride;
                const __m128i x = FA_VL == 16 ? _mm_loadu_si128((const __m128i *)(const void *)at)
                                              : _mm_loadl_epi64((const __m128i *)(const void *)at);
                const float *sg = sp + g * sstride + d, *zg = zp + g * sstride + d;
                const FA_V lo = FA_VFMA(FA_I8_CVT(_mm_and_si128(x, m)), FA_VSET1(sg[0]), FA_VSET1(zg[0]));
                FA_PRAGMA_UNROLL(8)
                for (int r = 0; r < R; r++) acc[g * R + r] = FA_VFMA(lo, FA_VSET1(q[r]), acc[g * R + r]);
                if (d + 1 < D) {
                    const FA_V hi = FA_VFMA(FA_I8_CVT(_mm_and_si128(_mm_srli_epi16(x, 4), m)), FA_VSET1(sg[1]),
                                            FA_VSET1(zg[1]));
                    FA_PRAGMA_UNROLL(8)
                    for (int r = 0; r < R; r++) acc[g * R + r] = FA_VFMA(hi, FA_VSET1(q[brp + r]), acc[g * R + r]);
                }
            }
        }
        FA_NAME(fa_lanes_store)(R, G, acc, nj, s, ks, rs);
        return;
    }
#endif
    for (int64_t d = 0; d < D; d++) {
        const FA_T *q = qt + d * brp;
        FA_NAME(fa_lanes_pf)(G, Q, pf, d * pf_step, (d + 1) * pf_step, pf_to);
        const char *bd = base + FA_NAME(fa_lane_off)(Q, d, 0, bs);
        FA_PRAGMA_UNROLL(4)
        for (int g = 0; g < G; g++) {
            const FA_V x = FA_NAME(fa_lane_vec)(Q, bd + g * gstride, (int)(d & 1), Q ? sp + g * sstride + d : NULL,
                                                Q ? zp + g * sstride + d : NULL);
            FA_PRAGMA_UNROLL(8)
            for (int r = 0; r < R; r++) acc[g * R + r] = FA_VFMA(x, FA_VSET1(q[r]), acc[g * R + r]);
        }
    }
    FA_NAME(fa_lanes_store)(R, G, acc, nj, s, ks, rs);
}

/* Each (rows, groups, key type) of the two lanes micro-kernels as a function of its own:
 * inlined all into fa_qk_lanes (48 loops in one function), GCC (12) kept most of their
 * accumulators on the stack, loaded and stored at every feature (78-102 FMAs from
 * memory in each ISA's function); apart, and with fa_lanes_pf, 2-6 in the one-row ones
 * under Python's -fwrapv, none since setup.py compiles these files with -fno-wrapv. */
#define FA_QKL_FNS_N(N, R, G, Q)                                                                              \
    static __attribute__((noinline)) void FA_NAME(fa_qk_uni_##N##_##Q)(                                       \
        const FA_T *FA_RESTRICT qt, int64_t brp, const char *base, int64_t gstride, const float *sp,          \
        const float *zp, int64_t sstride, int64_t bs, int64_t D, const int64_t *nj, FA_T *FA_RESTRICT s,      \
        int64_t ks, int64_t rs, const char *pf, int64_t pf_step, int pf_to)                                   \
    {                                                                                                         \
        FA_NAME(fa_qk_lanes_uni)(R, G, Q, qt, brp, base, gstride, sp, zp, sstride, bs, D, nj, s, ks, rs, pf,  \
                                 pf_step, pf_to);                                                             \
    }                                                                                                         \
    static __attribute__((noinline)) void FA_NAME(fa_qk_micro_##N##_##Q)(                                     \
        const FA_T *FA_RESTRICT qt, int64_t brp, const char *const *blk, const int64_t *lane,                 \
        const float *const *sp, const float *const *zp, int64_t bs, int64_t D, const int64_t *nj,             \
        FA_T *FA_RESTRICT s, int64_t ks, int64_t rs, const char *pf, int64_t pf_step, int pf_to)              \
    {                                                                                                         \
        FA_NAME(fa_qk_lanes_micro)(R, G, Q, qt, brp, blk, lane, sp, zp, bs, D, nj, s, ks, rs, pf, pf_step,    \
                                   pf_to);                                                                \
    }
#define FA_QKL_FNS(R, G, Q) FA_QKL_FNS_N(R, R, G, Q)
#define FA_QKL_ROWS(Q)                                                                                        \
    FA_QKL_FNS(1, 4, Q)                                                                                       \
    FA_QKL_FNS(2, 4, Q)                                                                                       \
    FA_QKL_FNS(3, FA_LANES_G34_OF(Q), Q)                                                                      \
    FA_QKL_FNS(4, FA_LANES_G34_OF(Q), Q)                                                                      \
    FA_QKL_FNS(5, 1, Q)                                                                                       \
    FA_QKL_FNS(6, 1, Q)                                                                                       \
    FA_QKL_FNS(7, 1, Q)                                                                                       \
    FA_QKL_FNS(8, 1, Q)
FA_QKL_ROWS(0)
FA_QKL_ROWS(4)
FA_QKL_ROWS(8)
/* two groups for three or four rows where FA_LANES_G34 is more (FA_LANES_G34_AT: float32
 * keys on AMD) */
#if FA_LANES_G34 > 2 && !(defined(FA_KV_HALF) && defined(FA_F32))
#define FA_QKL_HAVE_G2
FA_QKL_FNS_N(3g2, 3, 2, 0)
FA_QKL_FNS_N(4g2, 4, 2, 0)
#endif
#undef FA_QKL_ROWS
#undef FA_QKL_FNS
#undef FA_QKL_FNS_N

/* fa_qk_lanes's call of the FN ("uni" or "micro") kernel for its key type Q and nr rows */
#define FA_QKL_CALL(FN, R, Q_, ...) \
    case R: FA_NAME(fa_qk_##FN##_##R##_##Q_)(__VA_ARGS__); break;
#ifdef FA_QKL_HAVE_G2 /* (rows 3 and 4 of float32 keys: G of FA_LANES_G34_AT) */
#define FA_QKL_CALL34(FN, R, Q_, ...)                                     \
    case R:                                                               \
        if (G != FA_LANES_G34_OF(Q_)) FA_NAME(fa_qk_##FN##_##R##g2_##Q_)(__VA_ARGS__); \
        else FA_NAME(fa_qk_##FN##_##R##_##Q_)(__VA_ARGS__);               \
        break;
#else
#define FA_QKL_CALL34 FA_QKL_CALL
#endif
#define FA_QKL_SWITCH(FN, Q_, C34, ...)                                                            \
    switch (nr) {                                                                                  \
        FA_QKL_CALL(FN, 1, Q_, __VA_ARGS__) FA_QKL_CALL(FN, 2, Q_, __VA_ARGS__)                     \
        C34(FN, 3, Q_, __VA_ARGS__) C34(FN, 4, Q_, __VA_ARGS__)                                     \
        FA_QKL_CALL(FN, 5, Q_, __VA_ARGS__) FA_QKL_CALL(FN, 6, Q_, __VA_ARGS__)                     \
        FA_QKL_CALL(FN, 7, Q_, __VA_ARGS__) FA_QKL_CALL(FN, 8, Q_, __VA_ARGS__)                     \
        default: break;                                                                            \
    }
#define FA_QKL_BY_Q(FN, ...)                 \
    if (Q == 0) {                                           \
        FA_QKL_SWITCH(FN, 0, FA_QKL_CALL34, __VA_ARGS__)    \
    } else if (Q == 8) {                                    \
        FA_QKL_SWITCH(FN, 8, FA_QKL_CALL, __VA_ARGS__)      \
    } else {                                                \
        FA_QKL_SWITCH(FN, 4, FA_QKL_CALL, __VA_ARGS__)      \
    }

/* The G groups of FA_VL keys from key a of the tile of nk keys at j0: each group's block
 * and first lane, scales and zero points (Q), and keys (nj; 0 past the tile's end, where
 * the group repeats the first, computed, not stored).  Returns whether the set's groups
 * are evenly spaced (fa_qk_lanes_uni): all in one block (FA_VL lanes apart) or one a
 * block in consecutive blocks (block_size FA_VL); then *base, *gstride and, for the
 * consecutive blocks' scales, *sstride. */
FA_ALWAYS_INLINE int FA_NAME(fa_lanes_set)(const fa_params *p, const fa_item *it, const int G, const int Q,
                                           int64_t j0, int64_t a, int64_t nk, const char **blk, int64_t *lane,
                                           const float **sp, const float **zp, int64_t *nj, const char **base,
                                           int64_t *gstride, int64_t *sstride)
{
    const int64_t bs = p->k_lanes;
    for (int g = 0; g < G; g++) {
        const int64_t off = a + g * FA_VL < nk ? a + g * FA_VL : a;
        const int64_t j = it->koff + j0 + off, b = j / bs;
        blk[g] = FA_NAME(fa_lanes_block)(p, it, b);
        lane[g] = j % bs;
        if (Q) {
            sp[g] = FA_NAME(fa_lanes_param)(p, it, b, 0);
            zp[g] = FA_NAME(fa_lanes_param)(p, it, b, 1);
        }
        nj[g] = a + g * FA_VL >= nk ? 0 : nk - off < FA_VL ? nk - off : FA_VL;
    }
    const int same = bs % (G * FA_VL) == 0 && lane[0] % (G * FA_VL) == 0, next = bs == FA_VL;
    *base = blk[0] + FA_NAME(fa_lane_off)(Q, 0, lane[0], bs);
    *gstride = same ? FA_NAME(fa_lane_off)(Q, 0, FA_VL, bs) : (blk[G > 1 ? 1 : 0] - blk[0]);
    *sstride = Q && !same && G > 1 ? sp[1] - sp[0] : 0;
    return (same || next) && nj[G - 1] > 0;
}

/* The decode logits of keys j0 .. j0+nk-1 of the item (nr <= FA_DOT_ROWS rows, K on the
 * lanes, j0 a multiple of FA_VL) from the blocks in place: no transpose, no staging.
 * Groups of FA_VL keys, up to 4 at once (fewer with more rows: the accumulators stay in
 * registers); a missing group repeats the first (computed, not stored). */
static void FA_NAME(fa_qk_lanes)(const fa_params *p, const fa_item *it, const FA_T *FA_RESTRICT qt, int64_t brp,
                                 int64_t nr, int64_t j0, int64_t nk, FA_T *FA_RESTRICT s, int64_t ks, int64_t rs)
{
    const int Q = p->kv_store != FA_STORE_I8 ? 0 : p->k_bits == 4 ? 4 : 8;
    const int G = nr <= 2 ? 4 : nr <= 4 ? FA_LANES_G34_AT(Q) : 1;
    const int64_t bs = p->k_lanes;
    /* bytes of K a group set reads (G * FA_VL keys of D features): contiguous where the
     * set starts a block; those pf_sets sets ahead are prefetched, pf_step bytes a feature */
    const int64_t set_bytes = (int64_t)G * FA_VL * p->D * (Q == 4 ? 1 : Q == 8 ? 2 : 2 * (int64_t)sizeof(FA_KV)) / 2;
    const int64_t pf_step = set_bytes / p->D;
    /* on Intel, 16-bit keys into L2, float32 keys not asked for: from memory (caches
     * larger than the L3 in turn, as a model's layers are) the hardware's streams alone
     * read them faster (B1 H32 Lk8192 0.82-0.85x the time of asking for them into L2,
     * GQA 32/8 0.95x; from L3 level); int8 and int4 keys into L1 as before (into L2:
     * level to 1.05x slower).  Into L2 one set ahead, not two: from memory 0.93-0.97x
     * the time (float16 and bfloat16, B1 H32 and Lq 4), GQA 32/8 and from L3 level;
     * 1.5 sets 1.03x, four (V rows 32 ahead) 1.4x the time of one; int8 and int4 keys
     * one set ahead were 0.97x (H32) but 1.04-1.1x (GQA), and stay two sets ahead
     * (bench/NOTEBOOK.md, 2026-12-07, third session) */
    const int pf_to = !fa_cpu_pf_l2() || Q ? FA_PF_L1 : sizeof(FA_KV) >= 4 ? FA_PF_OFF : FA_PF_L2;
    const int64_t pf_sets = pf_to == FA_PF_L2 ? 1 : 2;
    for (int64_t a = 0; a < nk; a += G * FA_VL) {
        const char *blk[4], *base;
        const float *sp[4] = {NULL, NULL, NULL, NULL}, *zp[4] = {NULL, NULL, NULL, NULL};
        int64_t lane[4], nj[4], gstride, sstride;
        const int uni = FA_NAME(fa_lanes_set)(p, it, G, Q, j0, a, nk, blk, lane, sp, zp, nj, &base, &gstride, &sstride);
        FA_T *sa = s + a * ks;
        /* (blk[0] is its block's start: lane[0] 0 where a set starts a block) */
        const char *pf = blk[0] + pf_sets * set_bytes;
        if (uni) { /* a whole set of evenly spaced groups: one base pointer */
            FA_QKL_BY_Q(uni, qt, brp, base, gstride, sp[0], zp[0], sstride, bs, p->D, nj, sa, ks, rs, pf, pf_step, pf_to)
            continue;
        }
        FA_QKL_BY_Q(micro, qt, brp, blk, lane, (const float *const *)sp, (const float *const *)zp, bs, p->D, nj, sa,
                    ks, rs, pf, pf_step, pf_to)
    }
}
#undef FA_QKL_BY_Q
#undef FA_QKL_SWITCH
#undef FA_QKL_CALL34
#undef FA_QKL_CALL
#undef FA_QKL_HAVE_G2

/* R rows x NC vectors of the running output o (rows dvp apart) into acc, times each
 * row's alpha unless every alpha is 1 (no row's max changed). */
FA_ALWAYS_INLINE void FA_NAME(fa_pv_load)(const int R, const int NC, FA_V acc[FA_PV_R][2 * FA_PV_NC],
                                          const FA_T *FA_RESTRICT o, int64_t dvp, const FA_T *FA_RESTRICT alpha)
{
    int rescale = 0;
    for (int r = 0; r < R; r++) rescale |= alpha[r] != (FA_T)1;
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = FA_VLOAD(o + r * dvp + c * FA_VL);
    if (rescale)
        for (int r = 0; r < R; r++) {
            FA_V a = FA_VSET1(alpha[r]);
            for (int c = 0; c < NC; c++) acc[r][c] = FA_VMUL(acc[r][c], a);
        }
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
    FA_NAME(fa_pv_load)(R, NC, acc, o, dvp, alpha);
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

/* P.V of a few rows (decoding) with the keys outermost: each V row is read once, whole
 * and in order, and every row's output is updated from it in place (o stays in L1).
 * The same operations per output element as fa_pv_micro: one rescale by alpha, then
 * o = p * v + o key after key.  Column chunks over the tile (fa_pv_micro's order)
 * read the V rows in strided pieces, which the hardware prefetchers follow poorly:
 * 30% slower at the memory's speed on the AMD EPYC Zen 3 (a C model of the loop,
 * B=1 H=32 Lk=8192 D=128), and 1.1-1.2x slower decoding in fastattn itself. */
#ifndef FA_PV_AHEAD
#define FA_PV_AHEAD 16
#endif
/* The rows a P.V of few rows asks for ahead end before pf_end; for 16-bit V on AMD at
 * none, as fa_qblock asked for the whole tile before QK^T there (both together were
 * 1.07-1.09x slower, GQA 32/8 float16, AMD EPYC).  On Intel that burst held up the
 * instructions behind it, so there the rows are asked for here, as for the others. */
FA_ALWAYS_INLINE int64_t FA_NAME(fa_pv_pf_end)(int64_t pf_end)
{
#ifdef FA_KV_HALF
    if (fa_cpu_amd()) return INT64_MIN + FA_PV_AHEAD + 4;
#endif
    return pf_end;
}

/* Where a P.V of few rows asks for its V rows ahead: float rows into L2 on Intel, int8
 * and int4 rows (and every row elsewhere) into L1 (fa_cpu_pf_l2, fa_internal.h) */
FA_ALWAYS_INLINE int FA_NAME(fa_pv_pf_to)(const int I8)
{
    return fa_cpu_pf_l2() && !I8 ? FA_PF_L2 : FA_PF_L1;
}

/* P.V of R <= 2 rows whose output row is NC whole vectors (a constant): the rows'
 * outputs stay in registers over the keys, each V vector loaded (dequantized) once and
 * FMA'd into each row, key after key: the operations per output element of
 * fa_pv_rows_seq_r (o = p * v + o in key order), without its loads and stores of the
 * output for each key (or four). */
FA_ALWAYS_INLINE void FA_NAME(fa_pv_rows_reg)(const int R, const int NC, const int I8, const FA_T *FA_RESTRICT p,
                                              int64_t nk, const char *FA_RESTRICT v, int64_t row,
                                              const float *vs8, int64_t vs8_sl, int gshift, FA_T *FA_RESTRICT o,
                                              int64_t dvp, int64_t ks, int64_t rs, int64_t pf_end)
{
    FA_V acc[2][8];
    FA_PRAGMA_UNROLL(2)
    for (int r = 0; r < R; r++)
        FA_PRAGMA_UNROLL(8)
        for (int c = 0; c < NC; c++) acc[r][c] = FA_VLOAD(o + r * dvp + c * FA_VL);
    /* the bytes of a V row, asked for FA_PV_AHEAD rows ahead (the loop waited on the
     * rows' loads: int8 B1 H32 Lk8192, half its samples on the instructions after them) */
    const int64_t rb = (int64_t)NC * FA_VL * (I8 == 2 ? 1 : I8 ? 2 : 2 * (int64_t)sizeof(FA_KV)) / 2;
    const int64_t pf_lim = FA_NAME(fa_pv_pf_end)(pf_end);
    const int pf_to = FA_NAME(fa_pv_pf_to)(I8);
    for (int64_t j = 0; j < nk; j++) {
        const char *vj = v + j * row;
        const float *sj = I8 ? vs8 + j * vs8_sl : vs8;
        if (j + FA_PV_AHEAD < pf_lim) { /* (rows at v's stride: a page's are its own) */
            for (int64_t b = 0; b < rb; b += 64) FA_PF_KV(vj + FA_PV_AHEAD * row + b, pf_to);
            if (I8) FA_PF_KV(sj + FA_PV_AHEAD * vs8_sl, pf_to);
        }
        FA_V pb[2];
        FA_PRAGMA_UNROLL(2)
        for (int r = 0; r < R; r++) pb[r] = FA_VSET1(p[j * ks + r * rs]);
        FA_PRAGMA_UNROLL(8)
        for (int c = 0; c < NC; c++) {
            const FA_V x = FA_NAME(fa_row_load)(I8, vj, (int64_t)c * FA_VL, sj, gshift);
            FA_PRAGMA_UNROLL(2)
            for (int r = 0; r < R; r++) acc[r][c] = FA_VFMA(pb[r], x, acc[r][c]);
        }
    }
    FA_PRAGMA_UNROLL(2)
    for (int r = 0; r < R; r++)
        FA_PRAGMA_UNROLL(8)
        for (int c = 0; c < NC; c++) FA_VSTORE(o + r * dvp + c * FA_VL, acc[r][c]);
}

/* The running output's R rows (dvp apart) times their alpha, those whose alpha is not 1
 * (the rescale before a decode tile's P.V: fa_pv_rows_seq_r, fa_pv_qk) */
FA_ALWAYS_INLINE void FA_NAME(fa_pv_rescale)(int64_t R, FA_T *FA_RESTRICT o, int64_t dvp, const FA_T *FA_RESTRICT alpha)
{
    for (int64_t r = 0; r < R; r++)
        if (alpha[r] != (FA_T)1) {
            const FA_V a = FA_VSET1(alpha[r]);
            for (int64_t c = 0; c < dvp; c += FA_VL)
                FA_VSTORE(o + r * dvp + c, FA_VMUL(FA_VLOAD(o + r * dvp + c), a));
        }
}

FA_ALWAYS_INLINE void FA_NAME(fa_pv_rows_seq_r)(const int R, const int I8, const FA_T *FA_RESTRICT p,
                                                int64_t nk, const void *FA_RESTRICT v, int64_t v_sl,
                                                const float *vs8, int64_t vs8_sl, int gshift,
                                                int64_t Dv, FA_T *FA_RESTRICT o, int64_t dvp,
                                                const FA_T *FA_RESTRICT alpha, int64_t ks,
                                                int64_t rs, int64_t pf_end)
{
    const int64_t row = v_sl * (I8 ? 1 : (int64_t)sizeof(FA_KV));
#define FA_VROW(j) ((const char *)v + (j) * row)
#define FA_SROW(j) (I8 ? vs8 + (j) * vs8_sl : vs8)
#define FA_LD(r, sr, c) FA_NAME(fa_row_load)(I8, (r), (c), (sr), gshift)
#define FA_LDN(r, c) FA_KV_LOADU_N((const FA_KV *)(const void *)(r) + (c), tail)
    const int64_t full = Dv / FA_VL * FA_VL;
    const int tail = (int)(Dv - full);
    FA_NAME(fa_pv_rescale)(R, o, dvp, alpha);
    if (R <= 2 && !tail && (Dv == 2 * FA_VL || Dv == 4 * FA_VL || Dv == 8 * FA_VL)) {
        /* one or two rows of up to 8 vectors: the outputs in registers over the keys */
        if (Dv == 8 * FA_VL)
            FA_NAME(fa_pv_rows_reg)(R < 2 ? 1 : 2, 8, I8, p, nk, (const char *)v, row, vs8, vs8_sl, gshift, o, dvp, ks, rs, pf_end);
        else if (Dv == 4 * FA_VL)
            FA_NAME(fa_pv_rows_reg)(R < 2 ? 1 : 2, 4, I8, p, nk, (const char *)v, row, vs8, vs8_sl, gshift, o, dvp, ks, rs, pf_end);
        else
            FA_NAME(fa_pv_rows_reg)(R < 2 ? 1 : 2, 2, I8, p, nk, (const char *)v, row, vs8, vs8_sl, gshift, o, dvp, ks, rs,
                                    pf_end);
        return;
    }
    int64_t j = 0;
    /* Two or more rows: four keys at a time, each output vector loaded and stored once
     * per four keys (its four FMAs in key order, the sums between them kept in a
     * register, which rounds nothing).  Key by key, GQA's four rows were bound by the
     * stores (this: 0.94x the time there, B=1 Hq=32 Hkv=8 Lk=8192); one row is not,
     * and reads four V rows at once 1.09x slower (both on the AMD EPYC Zen 3).  Each V
     * vector is loaded (an int8 or int4 one dequantized) once for all the rows, and
     * the rows' probabilities are broadcast once per four keys: GQA's four rows over
     * an int8 cache dequantized every vector four times, 38% of the decode time
     * (Emerald Rapids, B1 Hq32 Hkv8 Lk8192). */
    FA_V pb[FA_PV_SEQ_ROWS][4];
    const int64_t rb = (I8 == 2 ? (Dv + 1) / 2 : I8 ? Dv : Dv * (int64_t)sizeof(FA_KV)); /* V row bytes */
    const int64_t pf_lim = FA_NAME(fa_pv_pf_end)(pf_end);
    const int pf_to = FA_NAME(fa_pv_pf_to)(I8);
    /* float32 rows on Intel 4 rows ahead, not FA_PV_AHEAD: from memory (caches larger
     * than the L3 in turn) GQA 32/8 and Lq 4 at Lk 8192, 2 threads, on the Sapphire
     * Rapids class Xeon, 0.89-0.90x the time (none asked for: 0.91-0.94x, 8 ahead
     * 0.91-0.94x; from L3 0.93-0.99x); float16 and bfloat16 level, int8 and int4 level
     * to 1.07x slower, so they stay at FA_PV_AHEAD */
    const int64_t ahead = !I8 && sizeof(FA_KV) >= 4 && fa_cpu_pf_l2() ? 4 : FA_PV_AHEAD;
    for (; (R >= 2 || I8) && j + 4 <= nk; j += 4) {
        const char *v0 = FA_VROW(j), *v1 = FA_VROW(j + 1), *v2 = FA_VROW(j + 2), *v3 = FA_VROW(j + 3);
        const float *s0 = FA_SROW(j), *s1 = FA_SROW(j + 1), *s2 = FA_SROW(j + 2), *s3 = FA_SROW(j + 3);
        /* the four rows `ahead` ahead, asked for as these are read (as fa_pv_rows_reg) */
        if (j + 4 + ahead <= pf_lim) { /* (rows at v's stride: a page's are its own) */
            for (int t = 0; t < 4; t++)
                for (int64_t b = 0; b < rb; b += 64) FA_PF_KV(FA_VROW(j + t + ahead) + b, pf_to);
            if (I8) FA_PF_KV(FA_SROW(j + ahead), pf_to);
        }
        FA_PRAGMA_UNROLL(4)
        for (int r = 0; r < R; r++) {
            const FA_T *pr = p + j * ks + r * rs;
            pb[r][0] = FA_VSET1(pr[0]);
            pb[r][1] = FA_VSET1(pr[ks]);
            pb[r][2] = FA_VSET1(pr[2 * ks]);
            pb[r][3] = FA_VSET1(pr[3 * ks]);
        }
        int64_t c = 0;
        for (; c < full; c += FA_VL) {
            const FA_V x0 = FA_LD(v0, s0, c), x1 = FA_LD(v1, s1, c), x2 = FA_LD(v2, s2, c), x3 = FA_LD(v3, s3, c);
            FA_PRAGMA_UNROLL(4)
            for (int r = 0; r < R; r++) {
                FA_T *orow = o + r * dvp;
                FA_V x = FA_VFMA(pb[r][0], x0, FA_VLOAD(orow + c));
                x = FA_VFMA(pb[r][1], x1, x);
                x = FA_VFMA(pb[r][2], x2, x);
                FA_VSTORE(orow + c, FA_VFMA(pb[r][3], x3, x));
            }
        }
        if (tail) { /* (not with I8: Dv is a multiple of FA_VL there) */
            const FA_V x0 = FA_LDN(v0, c), x1 = FA_LDN(v1, c), x2 = FA_LDN(v2, c), x3 = FA_LDN(v3, c);
            for (int r = 0; r < R; r++) {
                FA_T *orow = o + r * dvp;
                FA_V x = FA_VFMA(pb[r][0], x0, FA_VLOAD(orow + c));
                x = FA_VFMA(pb[r][1], x1, x);
                x = FA_VFMA(pb[r][2], x2, x);
                FA_VSTORE(orow + c, FA_VFMA(pb[r][3], x3, x));
            }
        }
    }
    for (; j < nk; j++) {
        const char *vj = FA_VROW(j);
        const float *sj = FA_SROW(j);
        FA_PRAGMA_UNROLL(4)
        for (int r = 0; r < R; r++) pb[r][0] = FA_VSET1(p[j * ks + r * rs]);
        int64_t c = 0;
        for (; c < full; c += FA_VL) {
            const FA_V x = FA_LD(vj, sj, c);
            FA_PRAGMA_UNROLL(4)
            for (int r = 0; r < R; r++)
                FA_VSTORE(o + r * dvp + c, FA_VFMA(pb[r][0], x, FA_VLOAD(o + r * dvp + c)));
        }
        if (tail) {
            const FA_V x = FA_LDN(vj, c);
            for (int r = 0; r < R; r++)
                FA_VSTORE(o + r * dvp + c, FA_VFMA(pb[r][0], x, FA_VLOAD(o + r * dvp + c)));
        }
    }
#undef FA_VROW
#undef FA_SROW
#undef FA_LD
#undef FA_LDN
}

/* fa_pv_rows_seq_r for nq <= FA_PV_SEQ_ROWS rows (a constant in each case) */
FA_ALWAYS_INLINE void FA_NAME(fa_pv_rows_seq)(const int I8, const FA_T *FA_RESTRICT p, int64_t nq,
                                              int64_t nk, const void *FA_RESTRICT v, int64_t v_sl,
                                              const float *vs8, int64_t vs8_sl, int gshift,
                                              int64_t Dv, FA_T *FA_RESTRICT o, int64_t dvp,
                                              const FA_T *FA_RESTRICT alpha, int64_t ks,
                                              int64_t rs, int64_t pf_end)
{
    switch (nq) {
#define FA_SEQ_CASE(R) \
    case R: FA_NAME(fa_pv_rows_seq_r)(R, I8, p, nk, v, v_sl, vs8, vs8_sl, gshift, Dv, o, dvp, alpha, ks, rs, pf_end); break;
        FA_SEQ_CASE(1) FA_SEQ_CASE(2) FA_SEQ_CASE(3) FA_SEQ_CASE(4)
#undef FA_SEQ_CASE
        default: break;
    }
}

#ifdef FA_HAVE_I8_PRODUCTS
static void FA_NAME(fa_pv_rows_i8)(const FA_T *FA_RESTRICT p, int64_t nq, int64_t nk,
                                   const int8_t *FA_RESTRICT v8, int64_t v_sl, const float *vs8,
                                   int64_t vs8_sl, int gshift, int64_t Dv, FA_T *FA_RESTRICT o,
                                   int64_t dvp, const FA_T *FA_RESTRICT alpha, int64_t ks, int64_t rs,
                                   int bits, int64_t pf_end)
{
    if (bits == 4) /* int4 rows (fastattn.KVCache's values) */
        FA_NAME(fa_pv_rows_seq)(2, p, nq, nk, v8, v_sl, vs8, vs8_sl, gshift, Dv, o, dvp, alpha, ks, rs, pf_end);
    else
        FA_NAME(fa_pv_rows_seq)(1, p, nq, nk, v8, v_sl, vs8, vs8_sl, gshift, Dv, o, dvp, alpha, ks, rs, pf_end);
}
#endif

/* Rescale the running output of nq rows and add this key block's P.V.  Blocks of
 * one or two rows (decoding) take twice as many value vectors per pass, since
 * their accumulators leave registers free: fewer passes over the V tile.  pf_end: the
 * rows at v's stride from v (a page's own, or INT64_MAX), those the decode rows'
 * prefetches may ask for. */
FA_ALWAYS_INLINE void FA_NAME(fa_pv_tile_strided)(const FA_T *FA_RESTRICT p, int64_t nq, int64_t nk,
                                                  const FA_KV *FA_RESTRICT v, int64_t v_sl,
                                                  int64_t Dv, FA_T *FA_RESTRICT o, int64_t dvp,
                                                  const FA_T *FA_RESTRICT alpha, int64_t ks,
                                                  int64_t rs, int64_t pf_end)
{
    if (nq <= FA_PV_SEQ_ROWS) {
        FA_NAME(fa_pv_rows_seq)(0, p, nq, nk, v, v_sl, NULL, 0, 0, Dv, o, dvp, alpha, ks, rs, pf_end);
        return;
    }
    const int64_t chunk = (int64_t)(nq <= 2 ? 2 * FA_PV_NC : FA_PV_NC) * FA_VL;
    /* Value columns outer, query rows inner: one column chunk of the V tile stays in
     * L1 while every row group of the block streams it. */
    for (int64_t c0 = 0; c0 < Dv; c0 += chunk) {
        int64_t w = Dv - c0 < chunk ? Dv - c0 : chunk;
        int nc = (int)((w + FA_VL - 1) / FA_VL);
        int tail = (int)(w % FA_VL);
        const FA_KV *vc = v + c0;
        for (int64_t i = 0; i < nq; i += FA_PV_R) {
            fa_pf_step();
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
    FA_NAME(fa_pv_tile_strided)(p, nq, nk, v, v_sl, Dv, o, dvp, alpha, brp, 1, INT64_MAX);
}

/* Key-major probabilities of a few rows (decoding), row i at p + i * rs. */
static void FA_NAME(fa_pv_tile_rows)(const FA_T *FA_RESTRICT p, int64_t nq, int64_t nk,
                                     const FA_KV *FA_RESTRICT v, int64_t v_sl, int64_t Dv,
                                     FA_T *FA_RESTRICT o, int64_t dvp,
                                     const FA_T *FA_RESTRICT alpha, int64_t rs)
{
    FA_NAME(fa_pv_tile_strided)(p, nq, nk, v, v_sl, Dv, o, dvp, alpha, 1, rs, INT64_MAX);
}

/* Feature d of QK^T for R rows and one evenly spaced set of 4 groups of FA_VL float keys
 * on the lanes (fa_qk_lanes_uni's step for Q 0, nothing asked for ahead): group g's keys
 * at base + g * gstride, row r's chain in sa[g * R + r]. */
FA_ALWAYS_INLINE void FA_NAME(fa_lanes_feature)(const int R, FA_V *sa, const FA_T *FA_RESTRICT qt, int64_t brp,
                                                const char *base, int64_t gstride, int64_t bs, int64_t d)
{
    const FA_T *q = qt + d * brp;
    const char *bd = base + FA_NAME(fa_lane_off)(0, d, 0, bs);
    FA_PRAGMA_UNROLL(4)
    for (int g = 0; g < 4; g++) {
        const FA_V x = FA_NAME(fa_lane_vec)(0, bd + g * gstride, (int)(d & 1), NULL, NULL);
        FA_PRAGMA_UNROLL(2)
        for (int r = 0; r < R; r++) sa[g * R + r] = FA_VFMA(x, FA_VSET1(q[r]), sa[g * R + r]);
    }
}

/* P.V of R <= 2 rows of a decode tile (fa_pv_rows_reg's loop: the rows' NC output vectors
 * in registers, o = p * v + o key after key, the rescale by alpha done before) and QK^T of
 * one set of a later tile (fa_lanes_feature: one FMA chain a key and a row, features in
 * order) in one loop: after each of the nk V rows FPR features of the set, after the last
 * row the features left.  Each output and each logit takes the operations of the two
 * loops apart in the same order: the same bits.  What it is for: the two apart read 16
 * KiB of K, then 16 KiB of V (float16, D 128, a 64-key tile), and from memory lose a
 * tenth of the bandwidth to the changes of stream; here both streams run all the time.
 * The V rows are asked for ahead as in fa_pv_rows_reg (without: 1.05x the time), the keys
 * not (asked for as fa_qk_lanes asks: 1.05x the time, float16 and bfloat16, B1 H32
 * Lk8192 from memory on the Sapphire Rapids class Xeon; float32 keys are not asked for
 * there either). */
FA_ALWAYS_INLINE void FA_NAME(fa_pv_qk_set)(const int R, const int NC, const int FPR, const FA_T *FA_RESTRICT p,
                                            int64_t rs_p, int64_t nk, const char *FA_RESTRICT v, int64_t row,
                                            FA_T *FA_RESTRICT o, int64_t dvp, const FA_T *FA_RESTRICT qt,
                                            int64_t brp, const char *base, int64_t gstride, int64_t bs, int64_t D,
                                            FA_T *FA_RESTRICT s, int64_t rs_s)
{
    FA_V acc[2][8], sa[8];
    FA_PRAGMA_UNROLL(2)
    for (int r = 0; r < R; r++)
        FA_PRAGMA_UNROLL(8)
        for (int c = 0; c < NC; c++) acc[r][c] = FA_VLOAD(o + r * dvp + c * FA_VL);
    FA_PRAGMA_UNROLL(8)
    for (int i = 0; i < 4 * R; i++) sa[i] = FA_VZERO();
    /* the V rows asked for FA_PV_AHEAD ahead, as fa_pv_rows_reg asks */
    const int64_t rb = (int64_t)NC * FA_VL * (int64_t)sizeof(FA_KV);
    const int64_t pf_lim = FA_NAME(fa_pv_pf_end)(INT64_MAX);
    const int vpf_to = FA_NAME(fa_pv_pf_to)(0);
    int64_t d = 0;
    for (int64_t j = 0; j < nk; j++) {
        const char *vj = v + j * row;
        if (j + FA_PV_AHEAD < pf_lim)
            for (int64_t b = 0; b < rb; b += 64) FA_PF_KV(vj + FA_PV_AHEAD * row + b, vpf_to);
        FA_V pb[2];
        FA_PRAGMA_UNROLL(2)
        for (int r = 0; r < R; r++) pb[r] = FA_VSET1(p[j + r * rs_p]);
        FA_PRAGMA_UNROLL(8)
        for (int c = 0; c < NC; c++) {
            const FA_V x = FA_NAME(fa_row_load)(0, vj, (int64_t)c * FA_VL, NULL, 0);
            FA_PRAGMA_UNROLL(2)
            for (int r = 0; r < R; r++) acc[r][c] = FA_VFMA(pb[r], x, acc[r][c]);
        }
        FA_PRAGMA_UNROLL(4)
        for (int k = 0; k < FPR; k++)
            if (d < D) FA_NAME(fa_lanes_feature)(R, sa, qt, brp, base, gstride, bs, d++);
    }
    for (; d < D; d++) FA_NAME(fa_lanes_feature)(R, sa, qt, brp, base, gstride, bs, d);
    FA_PRAGMA_UNROLL(2)
    for (int r = 0; r < R; r++)
        FA_PRAGMA_UNROLL(8)
        for (int c = 0; c < NC; c++) FA_VSTORE(o + r * dvp + c * FA_VL, acc[r][c]);
    const int64_t nj[4] = {FA_VL, FA_VL, FA_VL, FA_VL};
    FA_NAME(fa_lanes_store)(R, 4, sa, nj, s, 1, rs_s);
}

/* Each (rows, output vectors, features a V row) of fa_pv_qk_set as a function of its own
 * (its accumulators in registers, as the lanes kernels above) */
#define FA_PVQK_FN(R, NC, FPR)                                                                                  \
    static __attribute__((noinline)) void FA_NAME(fa_pv_qk_##R##_##NC##_##FPR)(                                 \
        const FA_T *FA_RESTRICT p, int64_t rs_p, int64_t nk, const char *FA_RESTRICT v, int64_t row,            \
        FA_T *FA_RESTRICT o, int64_t dvp, const FA_T *FA_RESTRICT qt, int64_t brp, const char *base,            \
        int64_t gstride, int64_t bs, int64_t D, FA_T *FA_RESTRICT s, int64_t rs_s)                              \
    {                                                                                                           \
        FA_NAME(fa_pv_qk_set)(R, NC, FPR, p, rs_p, nk, v, row, o, dvp, qt, brp, base, gstride, bs, D, s, rs_s);  \
    }
#define FA_PVQK_FPR(R, NC) FA_PVQK_FN(R, NC, 1) FA_PVQK_FN(R, NC, 2) FA_PVQK_FN(R, NC, 4)
FA_PVQK_FPR(1, 2)
FA_PVQK_FPR(1, 4)
FA_PVQK_FPR(1, 8)
FA_PVQK_FPR(2, 2)
FA_PVQK_FPR(2, 4)
FA_PVQK_FPR(2, 8)
#undef FA_PVQK_FPR
#undef FA_PVQK_FN

/* The rows of sc->s where fa_pv_qk leaves the next tile's logits (key-major, row r at
 * FA_PVQK_ROW + r): past the two rows it runs for, inside the FA_DOT_ROWS rows of
 * key-major logits the scratch holds (fa_layout) */
#define FA_PVQK_ROW 4
#if FA_PVQK_ROW + 2 > FA_DOT_ROWS
#error "fa_pv_qk's logits need FA_PVQK_ROW + 2 <= FA_DOT_ROWS rows"
#endif

/* A decode tile's P.V (nr <= 2 rows, key-major probabilities prob, row r at prob + r *
 * bcp; nk keys; V rows vt, v_sl elements apart) and QK^T of the next tile's keys j1 ..
 * j1+nk1-1 (into s1, key-major, row r at s1 + r * bcp), fused (fa_pv_qk_set): the tile's
 * V rows split evenly over the next tile's group sets (4 groups of FA_VL keys, as
 * fa_qk_lanes takes for 1 or 2 rows).  Where the next tile is not whole sets of float
 * keys evenly spaced on the lanes, or the output row is not 2, 4 or 8 vectors, returns 0
 * and does nothing; else 1.  Not for 3 or 4 rows (GQA 32/8, Lq 4): P.V four keys at a
 * time with QK^T of 2-group sets in one loop was 1.05-1.3x the time from L3 and level
 * to 1.1x from memory, float16 and bfloat16 (bench/NOTEBOOK.md, 2026-12-07, fourth
 * session). */
static int FA_NAME(fa_pv_qk)(const fa_params *p, const fa_item *it, const FA_T *FA_RESTRICT qt, int64_t brp,
                             int64_t nr, const FA_T *FA_RESTRICT prob, int64_t bcp, int64_t nk,
                             const FA_KV *FA_RESTRICT vt, int64_t v_sl, FA_T *FA_RESTRICT o, int64_t dvp,
                             const FA_T *FA_RESTRICT alpha, int64_t j1, int64_t nk1, FA_T *FA_RESTRICT s1)
{
    const int G = 4; /* (the groups fa_qk_lanes takes for 1 or 2 rows) */
    const int64_t setk = G * FA_VL, Dv = p->Dv, D = p->D;
    const int NC = (int)(Dv / FA_VL);
    if (nr < 1 || nr > 2 || p->kv_store == FA_STORE_I8 || !p->k_lanes || Dv % FA_VL || (NC != 2 && NC != 4 && NC != 8) ||
        nk < 1 || nk1 < setk || nk1 % setk || nk1 > 8 * setk || (it->koff + j1) % FA_VL)
        return 0;
    const int64_t nsets = nk1 / setk;
    const char *base[8];
    int64_t gstride[8];
    for (int64_t t = 0; t < nsets; t++) {
        const char *blk[4];
        const float *sp[4] = {NULL, NULL, NULL, NULL}, *zp[4] = {NULL, NULL, NULL, NULL};
        int64_t lane[4], nj[4], sstride;
        if (!FA_NAME(fa_lanes_set)(p, it, G, 0, j1, t * setk, nk1, blk, lane, sp, zp, nj, &base[t], &gstride[t],
                                   &sstride))
            return 0;
    }
    /* the rescale of fa_pv_rows_seq_r, then each set with its share of the V rows, FPR
     * features after each */
    FA_NAME(fa_pv_rescale)(nr, o, dvp, alpha);
    const int64_t per = (nk + nsets - 1) / nsets, need = (D + per - 1) / per, row = v_sl * (int64_t)sizeof(FA_KV);
    const int fpr = need <= 1 ? 1 : need <= 2 ? 2 : 4;
    for (int64_t t = 0; t < nsets; t++) {
        const int64_t a = t * per < nk ? t * per : nk, n = nk - a < per ? nk - a : per;
        const char *v = (const char *)(const void *)(vt + a * v_sl);
#define FA_PVQK_CALL(R, NC_, FPR)                                                                                   \
    FA_NAME(fa_pv_qk_##R##_##NC_##_##FPR)(prob + a, bcp, n, v, row, o, dvp, qt, brp, base[t], gstride[t], p->k_lanes, \
                                          D, s1 + t * setk, bcp)
#define FA_PVQK_BY_FPR(R, NC_)        \
    if (fpr == 1)                     \
        FA_PVQK_CALL(R, NC_, 1);      \
    else if (fpr == 2)                \
        FA_PVQK_CALL(R, NC_, 2);      \
    else                              \
        FA_PVQK_CALL(R, NC_, 4);
#define FA_PVQK_BY_NC(R)              \
    if (NC == 2) {                    \
        FA_PVQK_BY_FPR(R, 2)          \
    } else if (NC == 4) {             \
        FA_PVQK_BY_FPR(R, 4)          \
    } else {                          \
        FA_PVQK_BY_FPR(R, 8)          \
    }
        if (nr == 1) {
            FA_PVQK_BY_NC(1)
        } else {
            FA_PVQK_BY_NC(2)
        }
#undef FA_PVQK_BY_NC
#undef FA_PVQK_BY_FPR
#undef FA_PVQK_CALL
    }
    return 1;
}

#ifdef FA_PV_T
#ifndef FA_HAVE_TRANSPOSE
#error "FA_PV_T needs FA_VTRANSPOSE"
#endif
/* The transposed running output ot (rows of nvl query lanes, brp apart; dvp rows)
 * back into o's rows (nvl rows, dvp apart), FA_VL x FA_VL blocks transposed in
 * registers. */
static void FA_NAME(fa_pvt_rows)(const FA_T *FA_RESTRICT ot, int64_t brp, int64_t nvl, int64_t dvp,
                                 FA_T *FA_RESTRICT o)
{
    for (int64_t d = 0; d < dvp; d += FA_VL) {
        const FA_T *rows[FA_VL];
        for (int i = 0; i < FA_VL; i++) rows[i] = ot + (d + i) * brp;
        for (int64_t r = 0; r < nvl; r += FA_VL) FA_VTRANSPOSE(rows, r, o + r * dvp + d, dvp);
    }
}
#endif

#if defined(FA_PV_T) && !(defined(FA_KV_HALF) && defined(FA_F32))
/* P.V with the output transposed, for prefill blocks on the ISAs that define FA_PV_T:
 * ot[d][i] = alpha[i] * ot[d][i] + sum_j p[j][i] * v[j][d], ot's rows (value channels)
 * brp apart, the query rows on the lanes.  The same operations per output element as
 * fa_pv_micro (one rescale by alpha, then v * p + o key after key), so the same bits;
 * but the register tile is fa_qk_micro's shape, FA_QK_R channels (broadcast from a V
 * row) by FA_QK_NV query vectors (loaded from the P tile, already query-major): on
 * AVX2 4 broadcasts and 3 loads per 12 FMAs, where fa_pv_micro's 6 x 2 tile needs 6
 * and 2.  (With scale, the accumulators are first multiplied by alpha: skipped when
 * every alpha of the tile's query vectors is 1, which changes no bit.) */
FA_ALWAYS_INLINE void FA_NAME(fa_pvt_micro)(const int R, const int NV, int scale,
                                            const FA_T *FA_RESTRICT p, const FA_KV *FA_RESTRICT v,
                                            int64_t v_sl, int64_t nk, FA_T *FA_RESTRICT ot,
                                            int64_t brp, const FA_T *FA_RESTRICT alpha)
{
    FA_V acc[FA_QK_R][FA_QK_NV];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NV; c++) acc[r][c] = FA_VLOAD(ot + r * brp + c * FA_VL);
    if (scale)
        for (int c = 0; c < NV; c++) {
            const FA_V a = FA_VLOAD(alpha + c * FA_VL);
            for (int r = 0; r < R; r++) acc[r][c] = FA_VMUL(acc[r][c], a);
        }
    for (int64_t j = 0; j < nk; j++) {
        FA_V pv[FA_QK_NV];
        for (int c = 0; c < NV; c++) pv[c] = FA_VLOAD(p + j * brp + c * FA_VL);
        for (int r = 0; r < R; r++) {
            const FA_V vb = FA_KV_BCAST(v + j * v_sl + r);
            for (int c = 0; c < NV; c++) acc[r][c] = FA_VFMA(vb, pv[c], acc[r][c]);
        }
    }
    FA_NAME(fa_qk_store)(R, NV, acc, ot, brp, NULL);
}

#define FA_PVT_CASE(R, NV)                                                                  \
    case (R) * 8 + (NV):                                                                    \
        if ((R) <= FA_QK_R && (NV) <= FA_QK_NV)                                             \
            FA_NAME(fa_pvt_micro)(R, NV, scale, p + cv * FA_VL, v + d, v_sl, nk,            \
                                  ot + d * brp + cv * FA_VL, brp, alpha + cv * FA_VL);      \
        break;

/* The tile's P.V into the transposed output ot (Dv rows of nv query vectors, brp
 * apart; see fa_pvt_micro).  Query-vector groups outer, as in fa_qk_tile: their
 * slice of the P tile (nk x FA_QK_NV vectors) stays in L1 while V streams past. */
static void FA_NAME(fa_pvt_tile)(const FA_T *FA_RESTRICT p, int nv, int64_t nk,
                                 const FA_KV *FA_RESTRICT v, int64_t v_sl, int64_t Dv,
                                 FA_T *FA_RESTRICT ot, int64_t brp, const FA_T *FA_RESTRICT alpha)
{
    for (int cv = 0, ncv; cv < nv; cv += ncv) {
        /* groups of FA_QK_NV vectors; a remainder of one vector is taken with the
         * group before it as two of two (a single vector leaves FA_QK_R chains, too
         * few to cover the FMA latency) */
        ncv = nv - cv < FA_QK_NV ? nv - cv : FA_QK_NV;
        if (FA_QK_NV >= 3 && nv - cv == FA_QK_NV + 1) ncv = (FA_QK_NV + 1) / 2;
        int scale = 0;
        for (int64_t i = (int64_t)cv * FA_VL; i < (int64_t)(cv + ncv) * FA_VL; i++)
            scale |= alpha[i] != (FA_T)1;
        for (int64_t d = 0; d < Dv; d += FA_QK_R) {
            const int r = (int)(Dv - d < FA_QK_R ? Dv - d : FA_QK_R);
            switch (r * 8 + ncv) {
                FA_TILE_ROWS(FA_PVT_CASE)
                default: break;
            }
        }
    }
}
#undef FA_PVT_CASE
#endif
