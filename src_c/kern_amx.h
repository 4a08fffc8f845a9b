/*
 * kern_amx.h -- part of the kernel template (kernels_tmpl.h), only where the ISA file
 * defines FA_BF16_AMX (kernels_amx.c): the two products of a prefill block on AMX
 * tiles (tdpbf16ps: a 16 x 16 float32 tile += a 16 x 32 bfloat16 tile times a 32 x 16
 * one in pairs), for q, k and v all bfloat16.  The rest of the block (the softmax, the
 * logit steps, the merge, decode rows, the tails below) is kern_bf16dp.h's.
 *   fa_qk_tile_amx  S^T = K Q^T: A = 16 keys x 32 features read in place from K (a
 *                   staged copy, zero-padded, when D is not a multiple of 32), B = 32
 *                   features x 16 queries as the block's Q pairs (fa_pack_q_pairs,
 *                   zero past D), C = 16 keys x 16 queries of logits stored straight
 *                   into the key-major tile, then times the scale with each query's
 *                   max folded in.  Keys past the last whole 16 take tiles of fewer
 *                   rows (a logit's bits never depend on where its key falls).
 *   fa_pv_tile_amx  O = alpha O + P V: A = P as 16 queries x 32 keys (the float32
 *                   probabilities rounded to bfloat16 pairs of keys and transposed in
 *                   registers), B = V paired along the keys (32 keys x 16 channels),
 *                   C = the running output rows, loaded after the rescale and stored
 *                   after the tile's last key; pairs past the tile's keys are zero.
 * Tiles: 0-3 accumulators (2 x 2 blocks of 16 x 16), 4-5 the A tiles, 6-7 the B
 * tiles; every tile configured 16 rows x 64 bytes, once per call (fa_amx_begin) and
 * released at its end, so no tile state outlives a call.
 *
 * Needs from the ISA file: the FA_DP_* operations (kern_bf16dp.h) and
 *   FA_TILE_CONFIG(cfg) FA_TILE_RELEASE() FA_TILE_ZERO(t) FA_TILE_LOAD(t, p, stride)
 *   FA_TILE_STORE(t, p, stride) FA_TILE_DP(c, a, b)   (t, c, a, b literal numbers)
 *   FA_DP_TRANSPOSE(x)   16 FA_DP_V: x[t] lane i <- x[i] lane t
 */


/* Palette 1, every tile 64 bytes a row; the accumulators (0-3) and A tiles (4-5)
 * `rows` rows (16, or a key tail's fewer), the B tiles (6-7) 16. */
static inline void FA_NAME(fa_amx_config)(int rows)
{
    uint8_t cfg[64];
    memset(cfg, 0, sizeof cfg);
    cfg[0] = 1; /* palette 1 */
    for (int t = 0; t < 8; t++) {
        const uint16_t colsb = 64;
        memcpy(cfg + 16 + 2 * t, &colsb, sizeof colsb);
        cfg[48 + t] = (uint8_t)(t < 6 ? rows : FA_AMX_ROWS);
    }
    /* every byte stored before ldtilecfg reads them: in a function that configured the
     * tiles twice, GCC 12 dropped the second configuration's column-byte stores
     * (ldtilecfg then faulted: #GP on tiles of 0 columns), so the buffer goes through
     * a barrier the compiler cannot see into */
    __asm__ __volatile__("" : : "r"(cfg) : "memory");
    FA_TILE_CONFIG(cfg);
}

static inline void FA_NAME(fa_amx_begin)(void) { FA_NAME(fa_amx_config)(FA_AMX_ROWS); }

/* Logits of 16 keys (a0; with two_k 16 more at a1) against every query vector, on the
 * tiles as configured (the keys' tile rows: 16, or a tail's fewer), stored to s at sj0. */
static inline void FA_NAME(fa_qk_amx_keys)(const uint32_t *FA_RESTRICT qp, int nv, const uint16_t *a0,
                                           const uint16_t *a1, int two_k, int64_t as, int64_t dz, int64_t brp,
                                           FA_T *FA_RESTRICT sj0)
{
    const int64_t bs = brp * (int64_t)sizeof(uint32_t), cs = brp * (int64_t)sizeof(FA_T);
    for (int cv = 0; cv < nv; cv += 2) {
        const int two_q = cv + 1 < nv;
        const uint32_t *b0 = qp + cv * FA_VL, *b1 = b0 + FA_VL;
        FA_TILE_ZERO(0);
        FA_TILE_ZERO(1);
        FA_TILE_ZERO(2);
        FA_TILE_ZERO(3);
        for (int64_t d = 0; d < dz; d += FA_AMX_K) {
            FA_TILE_LOAD(4, a0 + d, as);
            FA_TILE_LOAD(6, b0 + d / 2 * brp, bs);
            FA_TILE_DP(0, 4, 6);
            if (two_q) {
                FA_TILE_LOAD(7, b1 + d / 2 * brp, bs);
                FA_TILE_DP(1, 4, 7);
            }
            if (two_k) {
                FA_TILE_LOAD(5, a1 + d, as);
                FA_TILE_DP(2, 5, 6);
                if (two_q) FA_TILE_DP(3, 5, 7);
            }
        }
        FA_T *sj = sj0 + cv * FA_VL;
        FA_TILE_STORE(0, sj, cs);
        if (two_q) FA_TILE_STORE(1, sj + FA_VL, cs);
        if (two_k) {
            FA_TILE_STORE(2, sj + FA_AMX_ROWS * brp, cs);
            if (two_q) FA_TILE_STORE(3, sj + FA_AMX_ROWS * brp + FA_VL, cs);
        }
    }
}

/* The logits of nk keys against a block's Q pairs (nv vectors of 16 queries), as
 * fa_qk_tile_dp, every one on the tiles: the whole 16s of keys, then the last fewer
 * on tiles configured with that many rows, so that a logit's bits never depend on
 * where its key falls in the call's tiles (tdpbf16ps and vdpbf16ps may round
 * differently).  kz: room for bc x fa_amx_dz(D) bfloat16 (K staged zero-padded to
 * whole 32-feature rows when D is not a multiple of 32). */
static void FA_NAME(fa_qk_tile_amx)(const uint32_t *FA_RESTRICT qp, int nv, const uint16_t *FA_RESTRICT k,
                                    int64_t k_sl, int64_t nk, int64_t D, FA_T *FA_RESTRICT s, int64_t brp,
                                    FA_T scale, FA_T *FA_RESTRICT colmax, uint16_t *FA_RESTRICT kz)
{
    const int64_t nk16 = nk / FA_AMX_ROWS * FA_AMX_ROWS, dz = FA_NAME(fa_amx_dz)(D);
    if (nk <= 0) return;
    const uint16_t *a = k;
    int64_t a_sl = k_sl;
    if (D % FA_AMX_K) { /* a row's last chunk would run past it: a zero-padded copy */
        for (int64_t j = 0; j < nk; j++) {
            memcpy(kz + j * dz, k + j * k_sl, (size_t)D * sizeof(uint16_t));
            memset(kz + j * dz + D, 0, (size_t)(dz - D) * sizeof(uint16_t));
        }
        a = kz;
        a_sl = dz;
    }
    const int64_t as = a_sl * (int64_t)sizeof(uint16_t);
    if (nk16 > 0) {
        FA_NAME(fa_amx_begin)();
        for (int64_t j = 0; j < nk16; j += 2 * FA_AMX_ROWS)
            FA_NAME(fa_qk_amx_keys)(qp, nv, a + j * a_sl, a + (j + FA_AMX_ROWS) * a_sl, j + FA_AMX_ROWS < nk16,
                                    as, dz, brp, s + j * brp);
    }
    if (nk > nk16) { /* the last nk - nk16 keys: tiles of that many rows */
        FA_NAME(fa_amx_config)((int)(nk - nk16));
        FA_NAME(fa_qk_amx_keys)(qp, nv, a + nk16 * a_sl, NULL, 0, as, dz, brp, s + nk16 * brp);
    }
    FA_TILE_RELEASE();
    if (scale == (FA_T)1 && !colmax) return; /* (the backward's dP, and its S left unscaled) */
    /* the scale on the float32 sums, each query's max folded in (as fa_qk_store) */
    const FA_V sv = FA_VSET1(scale);
    for (int c = 0; c < nv; c++) {
        FA_V mx = colmax ? FA_VLOAD(colmax + c * FA_VL) : FA_VZERO();
        for (int64_t j = 0; j < nk; j++) {
            const FA_V x = FA_VMUL(FA_VLOAD(s + j * brp + c * FA_VL), sv);
            FA_VSTORE(s + j * brp + c * FA_VL, x);
            mx = FA_VMAX(mx, x);
        }
        if (colmax) FA_VSTORE(colmax + c * FA_VL, mx);
    }
}

/* A V tile (nk rows of v_sl, Dv wide) paired along the keys for the B tiles of P.V:
 * vp[t * vs + c] = (v[2t][c], v[2t+1][c]) for c < dvp, fa_amx_kpp(nk) pair rows, zero
 * past the keys and past Dv. */
static void FA_NAME(fa_amx_pack_v)(const uint16_t *FA_RESTRICT v, int64_t v_sl, int64_t nk, int64_t Dv,
                                   int64_t dvp, int64_t vs, uint32_t *FA_RESTRICT vp)
{
    const int64_t npairs = (nk + 1) / 2, kpp = FA_NAME(fa_amx_kpp)(nk);
    for (int64_t t = 0; t < kpp; t++) { /* V pairs; rows past the keys zero */
        if (t >= npairs) {
            for (int64_t c0 = 0; c0 < dvp; c0 += FA_VL) FA_DP_STORE(vp + t * vs + c0, FA_DP_ZERO());
            continue;
        }
        const uint16_t *v0 = v + 2 * t * v_sl, *v1 = 2 * t + 1 < nk ? v0 + v_sl : NULL;
        for (int64_t c0 = 0; c0 < dvp; c0 += 2 * FA_VL) {
            const int n = (int)(Dv - c0 < 2 * FA_VL ? Dv - c0 : 2 * FA_VL);
            FA_DP_V lo, hi;
            FA_DP_ZIP(v0 + c0, v1 ? v1 + c0 : NULL, n, lo, hi);
            FA_DP_STORE(vp + t * vs + c0, lo);
            if (c0 + FA_VL < dvp) FA_DP_STORE(vp + t * vs + c0 + FA_VL, hi);
        }
    }
}

/* The output rows of one or two tiles of 16 (o, o + 16 dvp; two_q), dvp float32
 * channels a row, += their P rows (a0, a1: kpp pairs of keys a row, as bytes apart)
 * times V's pairs (vp, kpp rows of dvp, vs apart), in 2 x 2 tiles of 16 x 16 over 32
 * keys at a time; the tiles as fa_amx_begin configures them. */
static void FA_NAME(fa_amx_pv_rows)(FA_T *FA_RESTRICT o, const void *a0, const void *a1, int64_t as, int64_t kpp,
                                    const uint32_t *FA_RESTRICT vp, int64_t vs, int64_t dvp, int two_q)
{
    const int64_t bs = vs * (int64_t)sizeof(uint32_t), cs = dvp * (int64_t)sizeof(FA_T);
    for (int64_t c0 = 0; c0 < dvp; c0 += 2 * FA_VL) {
        const int two_c = c0 + FA_VL < dvp;
        FA_T *o0 = o + c0, *o1 = o0 + FA_AMX_ROWS * dvp;
        FA_TILE_LOAD(0, o0, cs);
        if (two_c) FA_TILE_LOAD(1, o0 + FA_VL, cs);
        if (two_q) {
            FA_TILE_LOAD(2, o1, cs);
            if (two_c) FA_TILE_LOAD(3, o1 + FA_VL, cs);
        }
        for (int64_t t0 = 0; t0 < kpp; t0 += 16) {
            FA_TILE_LOAD(4, (const uint32_t *)a0 + t0, as);
            FA_TILE_LOAD(6, vp + t0 * vs + c0, bs);
            FA_TILE_DP(0, 4, 6);
            if (two_c) {
                FA_TILE_LOAD(7, vp + t0 * vs + c0 + FA_VL, bs);
                FA_TILE_DP(1, 4, 7);
            }
            if (two_q) {
                FA_TILE_LOAD(5, (const uint32_t *)a1 + t0, as);
                FA_TILE_DP(2, 5, 6);
                if (two_c) FA_TILE_DP(3, 5, 7);
            }
        }
        FA_TILE_STORE(0, o0, cs);
        if (two_c) FA_TILE_STORE(1, o0 + FA_VL, cs);
        if (two_q) {
            FA_TILE_STORE(2, o1, cs);
            if (two_c) FA_TILE_STORE(3, o1 + FA_VL, cs);
        }
    }
}

/* A tile's P.V on AMX: P (s[jj * brp + i], float32 probabilities of nv query vectors)
 * rounded, paired along the keys and transposed into pa (query rows of kpp pairs),
 * the V tile (nk rows of v_sl, Dv wide) paired into vp (kpp rows of dvp), then the
 * output rows (o, brp x dvp) rescaled by alpha and accumulated in tiles. */
static void FA_NAME(fa_pv_tile_amx)(const FA_T *FA_RESTRICT s, int nv, int64_t nk, const uint16_t *FA_RESTRICT v,
                                    int64_t v_sl, int64_t Dv, FA_T *FA_RESTRICT o, int64_t dvp,
                                    const FA_T *FA_RESTRICT alpha, int64_t brp, uint32_t *FA_RESTRICT pa,
                                    uint32_t *FA_RESTRICT vp)
{
    const int64_t npairs = (nk + 1) / 2, kpp = FA_NAME(fa_amx_kpp)(nk), nq = (int64_t)nv * FA_VL;
    FA_NAME(fa_amx_pack_v)(v, v_sl, nk, Dv, dvp, dvp, vp);
    for (int c = 0; c < nv; c++) /* P pairs, 16 queries x 16 pairs at a time */
        for (int64_t t0 = 0; t0 < kpp; t0 += 16) {
            FA_DP_V x[16];
            for (int u = 0; u < 16; u++) {
                const int64_t t = t0 + u;
                if (t >= npairs) {
                    x[u] = FA_DP_ZERO();
                    continue;
                }
                const FA_T *s0 = s + 2 * t * brp + c * FA_VL;
                x[u] = FA_DP_CVT2(FA_VLOAD(s0), 2 * t + 1 < nk ? FA_VLOAD(s0 + brp) : FA_VZERO());
            }
            FA_DP_TRANSPOSE(x);
            for (int u = 0; u < 16; u++) FA_DP_STORE(pa + (c * FA_VL + u) * kpp + t0, x[u]);
        }
    for (int64_t i = 0; i < nq; i++) { /* the rescale, before the tiles take the rows */
        if (alpha[i] == (FA_T)1) continue;
        const FA_V al = FA_VSET1(alpha[i]);
        for (int64_t c0 = 0; c0 < dvp; c0 += FA_VL) FA_VSTORE(o + i * dvp + c0, FA_VMUL(FA_VLOAD(o + i * dvp + c0), al));
    }
    const int64_t as = kpp * (int64_t)sizeof(uint32_t);
    FA_NAME(fa_amx_begin)();
    for (int64_t i0 = 0; i0 < nq; i0 += 2 * FA_AMX_ROWS)
        FA_NAME(fa_amx_pv_rows)(o + i0 * dvp, pa + i0 * kpp, pa + (i0 + FA_AMX_ROWS) * kpp, as, kpp, vp, dvp, dvp,
                                i0 + FA_AMX_ROWS < nq);
    FA_TILE_RELEASE();
}

#ifdef FA_BF16_BWD
/* The backward's dV += W^T dO and dK += dS^T Q on the tiles (as fa_bw_kv_tile): nk output
 * rows (keys; o, os floats a row, wp columns, os = zs = wp) += their row pairs of W or
 * dS (w, ws pairs a row, fa_bw_rpairs(nr) of them filled, zero past the rows) times the
 * row pairs of dO or Q (z, zs a row: npairs of them, a multiple of 16, zero past the
 * rows), the keys past the last whole 16 on tiles of that many rows. */
static void FA_NAME(fa_bw_kv_tile_amx)(const uint32_t *FA_RESTRICT w, int64_t ws, int64_t nk,
                                       const uint32_t *FA_RESTRICT z, int64_t zs, int64_t npairs, int64_t wp,
                                       FA_T *FA_RESTRICT o, int64_t os)
{
    const int64_t nk16 = nk / FA_AMX_ROWS * FA_AMX_ROWS, as = ws * (int64_t)sizeof(uint32_t);
    (void)os; /* (= zs = wp: fa_amx_pv_rows takes the output's width as its row stride) */
    (void)wp;
    if (nk <= 0 || npairs <= 0) return;
    if (nk16 > 0) {
        FA_NAME(fa_amx_begin)();
        for (int64_t j = 0; j < nk16; j += 2 * FA_AMX_ROWS)
            FA_NAME(fa_amx_pv_rows)(o + j * zs, w + j * ws, w + (j + FA_AMX_ROWS) * ws, as, npairs, z, zs, zs,
                                    j + FA_AMX_ROWS < nk16);
    }
    if (nk > nk16) {
        FA_NAME(fa_amx_config)((int)(nk - nk16));
        FA_NAME(fa_amx_pv_rows)(o + nk16 * zs, w + nk16 * ws, NULL, as, npairs, z, zs, zs, 0);
    }
    FA_TILE_RELEASE();
}
#endif
