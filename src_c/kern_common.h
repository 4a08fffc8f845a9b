/*
 * kern_common.h -- part of the kernel template (kernels_tmpl.h): what every other
 * piece uses.  The K/V access macros' defaults (K/V stored as FA_T), the switch cases
 * that give each register-tile shape its own unrolled code, the decode-row thresholds
 * (FA_DOT_ROWS), and the forward's per-thread scratch: its layout
 * (fa_layout, fa_carve) and size (fa_scratch_bytes).
 *
 * Needs from the including ISA file: FA_T, FA_V, FA_VL, FA_NAME and, for 16-bit K/V,
 * FA_KV_HALF and the FA_KV_* loads (kernels_tmpl.h lists every macro).
 */

/* The row-major AMX block's (kern_amx_rows.h) row strides: its S and P rows FA_RA_PAD
 * elements longer than the key block (bcz), V's pair rows FA_RA_PAD / 2 words longer
 * than dvp, so that the 16 rows of a tile fall into different L1 sets.  fa_layout
 * carves by the same strides (V's pairs for every bfloat16 pair path: they share sc->vp). */
#ifndef FA_RA_PAD
#define FA_RA_PAD 32
#endif
#define FA_RA_SROW(bcz) ((bcz) + FA_RA_PAD)
#define FA_RA_VROW(dvp) ((dvp) + FA_RA_PAD / 2)

/* The switch cases of every register tile shape up to 6 rows x 4 vectors, so each
 * tail shape gets its own fully unrolled code; CASE(R, C) must ignore shapes
 * larger than the instantiation's tile (they are never selected at run time). */

#define FA_TILE_ROW(CASE, R) CASE(R, 1) CASE(R, 2) CASE(R, 3) CASE(R, 4)
#define FA_TILE_ROWS(CASE)                                                                     \
    FA_TILE_ROW(CASE, 1) FA_TILE_ROW(CASE, 2) FA_TILE_ROW(CASE, 3) FA_TILE_ROW(CASE, 4)          \
    FA_TILE_ROW(CASE, 5) FA_TILE_ROW(CASE, 6)

#ifndef FA_VEXP_LOGIT /* e^x of the softmax's logits: the ISA's exp unless it has a cheaper one */
#define FA_VEXP_LOGIT(x) FA_VEXP(x)
#endif
#ifndef FA_16_TO_FLOAT /* the 16-bit type of q and out with 16-bit K/V: IEEE half */
#define FA_16_TO_FLOAT(x) fa_half_to_float(x)
#define FA_FLOAT_TO_16(x) fa_float_to_half(x)
#endif
#ifndef FA_ROW_TO_16 /* n floats of a row to the 16-bit type */
#define FA_ROW_TO_16(d, s, n)                                                                  \
    for (int64_t c_ = 0; c_ < (n); c_++) (d)[c_] = FA_FLOAT_TO_16((float)(s)[c_])
#endif

#ifndef FA_KV
#define FA_KV FA_T
#define FA_KV_BCAST(p) FA_VSET1(*(p))
#define FA_KV_LOADU(p) FA_VLOADU(p)
#define FA_KV_LOADU_N(p, n) FA_VLOADU_N((p), (n))
#define FA_KV_SCALAR(x) (x)
#endif

static inline int64_t FA_NAME(fa_round_up)(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

#ifndef FA_DOT_ROWS
#define FA_DOT_ROWS 8 /* blocks of up to this many rows take fa_qk_keys for QK^T */
#define FA_PV_SEQ_ROWS 4 /* P.V of up to this many rows: keys outermost (fa_pv_rows_seq) */
#endif

#ifdef FA_BF16_AMX
/* whole tiles: 16 keys (or queries) a tile, 32 bfloat16 a row */
#define FA_AMX_ROWS 16
#define FA_AMX_K 32

/* Feature pairs of Q (and of a staged K) in whole tiles: D rounded up to 32. */
static inline int64_t FA_NAME(fa_amx_dz)(int64_t D) { return (D + FA_AMX_K - 1) / FA_AMX_K * FA_AMX_K; }

/* Key pairs of a P.V tile in whole tiles: (nk + 1) / 2 rounded up to 16. */
static inline int64_t FA_NAME(fa_amx_kpp)(int64_t nk) { return ((nk + 1) / 2 + 15) / 16 * 16; }
#endif

#ifdef FA_BF16_BWD
/* The backward on bfloat16 pairs (kern_bf16bwd.h): a K or V tile's bfloat16 row of D
 * features is fa_bw_width(D) wide, and n rows make fa_bw_rpairs(n) row pairs; on the
 * tiles both are whole (32 features, 16 pairs), zero past the data. */
static inline int64_t FA_NAME(fa_bw_width)(int64_t D)
{
#ifdef FA_BF16_AMX
    return FA_NAME(fa_amx_dz)(D);
#else
    return D;
#endif
}

static inline int64_t FA_NAME(fa_bw_rpairs)(int64_t n)
{
#ifdef FA_BF16_AMX
    return ((n + 1) / 2 + 15) / 16 * 16;
#else
    return (n + 1) / 2;
#endif
}
#endif

/* The scratch of one thread, carved from one allocation into FA_ALIGN-aligned
 * pieces (brp = the block's query rows, a multiple of FA_VL; dvp = Dv rounded up
 * to FA_VL; bc = keys per block):
 *   qt      D  x brp   Q block, transposed, times scale (or scale/softcap)
 *   kt      dp x FA_VL a group of keys transposed (fa_qk_keys; dp = D rounded up
 *                      to FA_VL)
 *   s       bc x brp   logits of one key block, then its probabilities (key-major:
 *                      key j of query row i at s[j * brp + i]; for blocks of at
 *                      most FA_DOT_ROWS rows, row-major s[i * bcp + j] when no
 *                      logit step applies, bcp = bc rounded up to FA_VL)
 *   s2      bc x brp   the logits again, for a V tile with a NaN or inf in it
 *   o       brp x dvp  running unnormalized output, row-major
 *   ot      dvp x brp  the running output transposed (fa_pvt_tile; FA_PV_T only)
 *   o2      rows x dvp the same rows before the last P.V, for blocks of at most
 *                      FA_DOT_ROWS rows (restored if that P.V met an inf or NaN)
 *   m l alpha          brp each: running max, running sum, last rescale factor
 *   cmx                brp: the tile's max logit of each row, from its product
 *                      (fa_scores, when cmx_valid)
 *   rlo rhi            brp each: a row's visible keys relative to the tile
 *   slope apos         brp each: ALiBi slope and aligned position of a row
 *   lo hi              brp int64: a row's visible key range [lo, hi]
 *   bt      bc x brp   bias tile, transposed (with a bias only)
 *   mt      bc x brp   mask tile as bytes, transposed (with a mask only)
 *   mrow brow orow     brp pointers: a row's mask, bias and output rows
 *   kst vst bc x D, bc x Dv  FA_KV: a staged K and V tile (int8 or paged K/V only,
 *                      fa_kv_tile; vst not for attention_weights), else NULL
 *   ones    brp        ones: no rescale (with kst)
 *   kf vf   bc x D, bc x Dv  float32: a 16-bit prefill tile converted once (16-bit
 *                      K/V instantiations, FA_F32), where the call's shared block
 *                      (fa_f32_shared) is not there to read */
typedef struct FA_NAME(fa_scratch) {
    FA_T *qt, *kt, *s, *s2, *o, *m, *l, *alpha, *rlo, *rhi, *slope, *apos, *bt;
    FA_T *u; /* return_stats: sum_j p_j (s_j - m), rescaled with l; NULL otherwise */
    /* the running merge of a row's key chunks (fa_merge_step): out, M, tot, and for
     * return_stats the entropy sum G and the largest logit X */
    FA_T *mo, *mM, *mtot, *mG, *mX;
    int64_t *lo, *hi;
    int mask_state, need_range; /* of the current key tile (fa_scores) */
    int key_major;              /* the tile's logits are s[r * bcp + j] (fa_scores) */
    int cmx_valid;              /* cmx holds the tile's row maxima (fa_scores) */
    FA_T *cmx;
    int query_major;            /* never key-major (the backward's tiles) */
    /* the query vectors of the current key tile that see one of its keys (fa_qblock's
     * prefill tiles; the others 0 and nv): the products, the logit steps and the
     * softmax run on vectors vc0 .. vc1-1 only, the other rows' S, alpha untouched */
    int vc0, vc1, vlive;
    int q_own;                  /* the block lays Q out itself (AMX rows): fa_setup_rows
                                   packs none */
    int64_t bcp;                /* bc rounded up to FA_VL */
    FA_T *o2;
    FA_T *ot;
    uint8_t *mt;
    const uint8_t **mrow;
    const FA_T **brow;
    void **orow; /* FA_T, or float16 bits for a float16 output */
    FA_KV *kst, *vst;
    FA_T *ones; /* brp ones (no rescale), with kst */
#if defined(FA_KV_HALF) && defined(FA_F32)
    /* a prefill tile's 16-bit K and V rows as float32 (bc x D, bc x Dv; fa_tile_f32) */
    float *kf, *vf;
    /* the current tile's V as float32 in the call's shared block (fa_f32_shared), and
     * its flag (1 every value finite, 2 not); NULL: none */
    const float *vf_shared;
    int vf_flag;
#endif
    int64_t bc; /* the call's key block */
#ifdef FA_BF16_DP
    /* bfloat16 pairs (kern_bf16dp.h), one uint32 each: Q (D/2 rounded up) x brp, P
     * (bc/2 rounded up) x brp, V (bc/2 rounded up) x dvp; dp: the call's products
     * take them (q, k, v bfloat16 and items of more than FA_DOT_ROWS rows: decided for
     * the call, so a block of few rows at the end of a prefill takes them too) */
    uint32_t *qp, *pp, *vp;
    int dp;
#endif
#ifdef FA_BF16_BWD
    /* the backward on bfloat16 pairs (kern_bf16bwd.h): Q as feature pairs
     * ((fa_bw_width(D)+1)/2 x brp, unscaled; pair rows past D zero) and a K tile as
     * bfloat16 rows (bc x fa_bw_width(D)), for S = Q K^T on pairs (or tiles); bw: this
     * block's products take them (fa_bwd_rows) */
    uint32_t *qp;
    uint16_t *kb;
    const FA_KV *kb_src; /* kb holds kb_n K rows from kb_src (S's tile; dQ reuses them) */
    int64_t kb_n;
    int bw;
    /* the K and V rows of fa_bwd_kv's key range as bfloat16 (fa_bw_width wide), made
     * once for all of its items: keys kr_j0 .. kr_j0 + kr_n - 1 of kv head (kr_b, kr_g)
     * of the sequence at kr_koff (kr NULL: none) */
    uint16_t *kr, *vr;
    int64_t kr_b, kr_g, kr_koff, kr_j0, kr_n;
    /* S's factor still to apply (1, or the scale where a tile with no logit step left
     * S unscaled: P = exp(S pscale - lse) in one rounding, fa_bwd_tile) */
    FA_T pscale;
#endif
#ifdef FA_BF16_AMX
    /* AMX tiles (kern_amx.h): P as query rows of key pairs (brp x fa_amx_kpp(bc)),
     * and K staged zero-padded to whole 32-feature rows (bc x fa_amx_dz(D)); qp holds
     * fa_amx_dz(D) / 2 pair rows and vp fa_amx_kpp(bc) */
    uint32_t *pa;
    uint16_t *kz;
    /* the row-major block (kern_amx_rows.h): two groups of 32 rows of logits (32 x bcz
     * float32 each, bcz = bc rounded up to 32) and of probabilities (32 x bcz bfloat16
     * each), each row's lane sums (brp x 16 float32) and its reference max (brp, times
     * scale log2 e) */
    float *sr, *lv, *m2;
    uint16_t *pr;
#endif
} FA_NAME(fa_scratch);

/* The current key tile's live query vectors [*v0, *v1) of nv (sc->vc0 .. vc1-1 where
 * fa_qblock set sc->vlive, else all) and their rows [*r0, *r1) of nr, the last vector's
 * rows cut at nr: the one reading of the live range for the products, the logit steps,
 * the softmax and the careful P.V. */
static inline void FA_NAME(fa_live_range)(const FA_NAME(fa_scratch) *sc, int nv, int64_t nr, int *v0, int *v1,
                                          int64_t *r0, int64_t *r1)
{
    *v0 = sc->vlive ? sc->vc0 : 0;
    *v1 = sc->vlive ? sc->vc1 : nv;
    *r0 = (int64_t)*v0 * FA_VL;
    *r1 = (int64_t)*v1 * FA_VL < nr ? (int64_t)*v1 * FA_VL : nr;
}

static inline void *FA_NAME(fa_carve)(char **cur, size_t bytes)
{
    void *piece = *cur;
    *cur += (bytes + FA_ALIGN - 1) / FA_ALIGN * FA_ALIGN;
    return piece;
}

/* A block of a few rows (decoding) that takes the float32 products row by row (keys on
 * the lanes): never where the call's products are bfloat16 pairs, which every block
 * of the call takes, however few its rows. */
static inline int FA_NAME(fa_few_rows)(int64_t nr, const FA_NAME(fa_scratch) *sc)
{
#ifdef FA_BF16_DP
    if (sc->dp) return 0;
#endif
    (void)sc;
    return nr <= FA_DOT_ROWS;
}

/* Carves `base` (or, with base NULL, only measures) and returns the bytes used. */
static size_t FA_NAME(fa_layout)(const fa_params *p, const fa_blocks *bl, void *base,
                                 FA_NAME(fa_scratch) *sc)
{
    const size_t brp = (size_t)bl->q, bc = (size_t)bl->k, t = sizeof(FA_T);
    const size_t dvp = (size_t)FA_NAME(fa_round_up)(p->Dv, FA_VL);
    FA_NAME(fa_scratch) dummy;
    if (!sc) sc = &dummy;
    char *cur = base ? (char *)base : (char *)0 + FA_ALIGN;
    char *first = cur;
    sc->qt = (FA_T *)FA_NAME(fa_carve)(&cur, (size_t)p->D * brp * t);
    sc->kt = (FA_T *)FA_NAME(fa_carve)(&cur, (size_t)FA_NAME(fa_round_up)(p->D, FA_VL) * FA_VL * t);
    sc->bcp = FA_NAME(fa_round_up)((int64_t)bc, FA_VL);
    sc->bc = (int64_t)bc;
    sc->query_major = 0;
    sc->q_own = 0;
    sc->vlive = 0;
    {
        const size_t km = (size_t)FA_DOT_ROWS * (size_t)sc->bcp; /* key-major use */
        sc->s = (FA_T *)FA_NAME(fa_carve)(&cur, (bc * brp > km ? bc * brp : km) * t);
    }
    sc->s2 = (FA_T *)FA_NAME(fa_carve)(&cur, bc * brp * t);
    sc->o = (FA_T *)FA_NAME(fa_carve)(&cur, brp * dvp * t);
#ifdef FA_PV_T
    sc->ot = (FA_T *)FA_NAME(fa_carve)(&cur, brp * dvp * t);
#else
    sc->ot = NULL;
#endif
    sc->m = (FA_T *)FA_NAME(fa_carve)(&cur, brp * t);
    sc->l = (FA_T *)FA_NAME(fa_carve)(&cur, brp * t);
    sc->alpha = (FA_T *)FA_NAME(fa_carve)(&cur, brp * t);
    sc->cmx = (FA_T *)FA_NAME(fa_carve)(&cur, brp * t);
    sc->cmx_valid = 0;
    sc->u = p->entropy ? (FA_T *)FA_NAME(fa_carve)(&cur, brp * t) : NULL;
    sc->mo = (FA_T *)FA_NAME(fa_carve)(&cur, brp * dvp * t);
    sc->mM = (FA_T *)FA_NAME(fa_carve)(&cur, brp * t);
    sc->mtot = (FA_T *)FA_NAME(fa_carve)(&cur, brp * t);
    sc->mG = (FA_T *)FA_NAME(fa_carve)(&cur, brp * t);
    sc->mX = (FA_T *)FA_NAME(fa_carve)(&cur, brp * t);
    sc->rlo = (FA_T *)FA_NAME(fa_carve)(&cur, brp * t);
    sc->rhi = (FA_T *)FA_NAME(fa_carve)(&cur, brp * t);
    sc->slope = (FA_T *)FA_NAME(fa_carve)(&cur, brp * t);
    sc->apos = (FA_T *)FA_NAME(fa_carve)(&cur, brp * t);
    sc->lo = (int64_t *)FA_NAME(fa_carve)(&cur, brp * sizeof(int64_t));
    sc->hi = (int64_t *)FA_NAME(fa_carve)(&cur, brp * sizeof(int64_t));
    sc->bt = p->bias ? (FA_T *)FA_NAME(fa_carve)(&cur, bc * brp * t) : NULL;
    sc->mt = p->mask ? (uint8_t *)FA_NAME(fa_carve)(&cur, bc * brp) : NULL;
    sc->mrow = (const uint8_t **)FA_NAME(fa_carve)(&cur, brp * sizeof(void *));
    sc->brow = (const FA_T **)FA_NAME(fa_carve)(&cur, brp * sizeof(void *));
    sc->orow = (void **)FA_NAME(fa_carve)(&cur, brp * sizeof(void *));
    sc->o2 = (FA_T *)FA_NAME(fa_carve)(&cur, (size_t)FA_DOT_ROWS * dvp * t);
    sc->kst = fa_kv_staged(p) ? (FA_KV *)FA_NAME(fa_carve)(&cur, bc * (size_t)p->D * sizeof(FA_KV)) : NULL;
    sc->vst = fa_kv_staged(p) && !p->weights
                  ? (FA_KV *)FA_NAME(fa_carve)(&cur, bc * (size_t)p->Dv * sizeof(FA_KV))
                  : NULL;
    sc->ones = fa_kv_staged(p) ? (FA_T *)FA_NAME(fa_carve)(&cur, brp * t) : NULL;
#if defined(FA_KV_HALF) && defined(FA_F32)
    sc->kf = (float *)FA_NAME(fa_carve)(&cur, bc * (size_t)p->D * sizeof(float));
    sc->vf = (float *)FA_NAME(fa_carve)(&cur, bc * (size_t)p->Dv * sizeof(float));
#endif
#ifdef FA_BF16_DP
#ifdef FA_BF16_AMX /* whole tiles: Q pairs to D rounded up to 32, key pairs to 16 */
    const size_t qpairs = (size_t)FA_NAME(fa_amx_dz)(p->D) / 2, kpairs = (size_t)FA_NAME(fa_amx_kpp)((int64_t)bc);
#else
    const size_t qpairs = (size_t)(p->D + 1) / 2, kpairs = (bc + 1) / 2;
#endif
    sc->dp = p->q_store == FA_STORE_BF16 && p->kv_store == FA_STORE_BF16 && bl->rows > FA_DOT_ROWS;
    sc->qp = (uint32_t *)FA_NAME(fa_carve)(&cur, qpairs * brp * sizeof(uint32_t));
#ifdef FA_BF16_AMX
    sc->pp = NULL; /* P's pairs go to pa */
#else
    sc->pp = (uint32_t *)FA_NAME(fa_carve)(&cur, (bc + 1) / 2 * brp * sizeof(uint32_t));
#endif
    sc->vp = (uint32_t *)FA_NAME(fa_carve)(&cur, kpairs * FA_RA_VROW(dvp) * sizeof(uint32_t));
#ifdef FA_BF16_AMX
    sc->pa = (uint32_t *)FA_NAME(fa_carve)(&cur, brp * kpairs * sizeof(uint32_t));
    sc->kz = (uint16_t *)FA_NAME(fa_carve)(&cur, bc * (size_t)FA_NAME(fa_amx_dz)(p->D) * sizeof(uint16_t));
    {
        const size_t bcz = (size_t)FA_NAME(fa_round_up)((int64_t)bc, 2 * FA_AMX_ROWS);
        sc->sr = (float *)FA_NAME(fa_carve)(&cur, 4 * FA_AMX_ROWS * FA_RA_SROW(bcz) * sizeof(float));
        sc->pr = (uint16_t *)FA_NAME(fa_carve)(&cur, 4 * FA_AMX_ROWS * FA_RA_SROW(bcz) * sizeof(uint16_t));
        sc->lv = (float *)FA_NAME(fa_carve)(&cur, brp * FA_AMX_ROWS * sizeof(float));
        sc->m2 = (float *)FA_NAME(fa_carve)(&cur, brp * sizeof(float));
    }
#endif
#endif
#ifdef FA_BF16_BWD
    sc->bw = 0;
    sc->pscale = (FA_T)1;
    sc->kb_src = NULL;
    sc->kb_n = 0;
    sc->qp = (uint32_t *)FA_NAME(fa_carve)(&cur, (size_t)(FA_NAME(fa_bw_width)(p->D) + 1) / 2 * brp * sizeof(uint32_t));
    sc->kb = (uint16_t *)FA_NAME(fa_carve)(&cur, bc * (size_t)FA_NAME(fa_bw_width)(p->D) * sizeof(uint16_t));
#endif
    if (base && sc->ones)
        for (size_t i = 0; i < brp; i++) sc->ones[i] = (FA_T)1;
    return (size_t)(cur - first);
}

static size_t FA_NAME(fa_scratch_bytes)(const fa_params *p, const fa_blocks *bl)
{
    return FA_NAME(fa_layout)(p, bl, NULL, NULL);
}
