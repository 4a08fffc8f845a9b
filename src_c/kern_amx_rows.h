/*
 * kern_amx_rows.h -- included by kernels_amx.c after the kernel template (FA_NAME
 * x##_amx): the AMX forward's row-major block, fa_qblock_rows, for the calls of
 * bfloat16 q, k and v that fa_rows_ok admits (no bias, mask, softcap, ALiBi, dropout,
 * statistics or attention weights; K/V a strided array; causal, windows, GQA, varlen,
 * seqlens_k, positions and sinks are fine).  The others take the template's fa_qblock
 * (key-major logits, kern_amx.h's products).
 *
 * Why a second block: in the template's block the queries are the vector lanes, so the
 * AMX logits come out key-major (S^T = K Q^T) and P must be transposed for P.V, and the
 * softmax runs as separate passes (scale and max, exp and sums, P's rounding).
 * Measured on one Sapphire Rapids class core (B1 H2 L4096 D64, 2.6 cycles a logit):
 * those passes took 11-14 of 23 ms, the tiles 8.  Here the queries are the tiles' rows:
 *   S = Q K^T      A = 16 query rows x 32 features (Q staged zero-padded to whole
 *                  32-feature rows, once per item), B = 32 features x 16 keys as pairs
 *                  (K packed once per key block, for all the items of the kv head
 *                  where the call shares its whole blocks: fa_share_slot), C = 16 x 16
 *                  logits, stored row-major into sr (32 rows x the block's keys);
 *   the softmax    one pass over each row (vectors of 16 keys): y = s c - m2 with
 *                  c = scale log2 e folded into one FMA, p = 2^y (a degree-4
 *                  polynomial: P is rounded to bfloat16, 2^-8, and the polynomial's
 *                  relative error is 2.7e-6, which the float32 sums and so the
 *                  lse need: docs/semantics.md), the lane sums, and P rounded to bfloat16
 *                  straight into the A rows of P.V (vcvtne2ps2bf16 keeps keys in order:
 *                  no transpose);
 *   O += P V       A = P (16 rows x 32 keys), B = V paired along the keys (packed with
 *                  K), C = the running output rows.
 * The reference max m2 is lazy (as FlashAttention 4 does): a row's first visible block
 * sets it to that block's max; later blocks keep it unless one of their logits exceeds
 * it by more than 2^8 (FA_RA_TH), in which case the row's block is redone against its
 * new max and its earlier sums and output rows are multiplied by 2^(old - new).  So
 * p <= 256 and the max needs no pass of its own after the first block; 2^8 keeps every
 * sum and product far from float32's range.  The result is exact attention: lse =
 * m2 ln 2 + log l, out = o / l, whatever reference was used.
 *
 * Bits: every logit is one tile element (its row of Q, its column of K, the features
 * in whole 32s), every product of P.V one element of a tile chain over the key block's
 * 32s in order; the reference max, the sums (lane = key mod 16, vectors in key order)
 * and the rescale are decided per row from its own logits; the key blocks and chunks
 * start at multiples of bc and FA_ROWS_CHUNK_KEYS from key 0.  So a row's bits do not
 * depend on the other rows of its item, the thread count or the call's shape.
 */

/* a product rounded on its own (vmulps with a rounding operand: the compiler does not
 * contract it into an FMA with the add that follows) */
#define FA_RA_RN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#ifdef FA_EMULATE_AMX
/* The test build over SIMDe, which lacks a few of these: the same values from what it
 * has (the product in a function the compiler may not contract into an FMA). */
__attribute__((noinline, optimize("fp-contract=off"))) static __m512 fa_ra_mul_rn(__m512 a, __m512 b)
{
    return _mm512_mul_ps(a, b);
}
#define FA_RA_MUL_RN(a, b) fa_ra_mul_rn((a), (b))
#define FA_RA_MASK_CMP(k, a, b, imm) ((__mmask16)((k) & _mm512_cmp_ps_mask((a), (b), (imm))))
/* (x1, x0) rounded to bfloat16: x0's 16 values in elements 0-15, x1's in 16-31 */
#define FA_RA_CVT2(x1, x0)                                                                       \
    _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(fa_bf16_round(x0))),          \
                       _mm512_cvtepi32_epi16(fa_bf16_round(x1)), 1)
#else
#define FA_RA_MUL_RN(a, b) _mm512_mul_round_ps((a), (b), FA_RA_RN)
#define FA_RA_MASK_CMP(k, a, b, imm) _mm512_mask_cmp_ps_mask((k), (a), (b), (imm))
#define FA_RA_CVT2(x1, x0) ((__m512i)_mm512_cvtne2ps_pbh((x1), (x0)))
#endif

/* The largest of the 16 lanes (none NaN here) in registers (through memory, as a
 * chain of 15 dependent compares, it was 2.5% of a prefill's samples), and their sum
 * in lane order. */
static inline float fa_ra_hmax(__m512 x)
{
#ifdef FA_EMULATE_AMX /* (SIMDe has no reduce) */
    float t[16];
    _mm512_storeu_ps(t, x);
    for (int w = 8; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) t[i] = t[i + w] > t[i] ? t[i + w] : t[i];
    return t[0];
#else
    return _mm512_reduce_max_ps(x);
#endif
}
static inline float fa_ra_hsum(__m512 x)
{
    float t[16];
    _mm512_storeu_ps(t, x);
    float s = t[0];
    for (int i = 1; i < 16; i++) s += t[i];
    return s;
}
#define FA_RA_TH 8.0f /* a block's logit more than 2^8 above the reference: rescale */
/* 2^f on [0, 1), degree 4, fitted to the relative error (Lawson's iteration on 20001
 * points): 2.7e-6 with the coefficients rounded to float32.  (Degree 3, 7.5e-5, would
 * save one of the pass's ~11 instructions a vector, but the sums take p unrounded and
 * lse = m ln 2 + log l is held to float32's tolerance, 3e-5: it failed that.) */
#define FA_RA_E0 1.0000026226043701f
#define FA_RA_E1 0.6930038332939148f
#define FA_RA_E2 0.24144276976585388f
#define FA_RA_E3 0.05201148986816406f
#define FA_RA_E4 0.013534137047827244f

/* Does a call take the row-major block? */
static int FA_NAME(fa_rows_ok)(const fa_params *p, const fa_blocks *bl)
{
    return p->q_store == FA_STORE_BF16 && p->kv_store == FA_STORE_BF16 && bl->rows > FA_DOT_ROWS &&
           fa_amx_rows_call(p);
}

/* Lanes i with a <= i < b of a vector of 16 keys. */
static inline __mmask16 fa_ra_mask(int64_t a, int64_t b)
{
    if (a < 0) a = 0;
    if (b > 16) b = 16;
    if (b <= a) return 0;
    return (__mmask16)((0xFFFFu >> (16 - (b - a))) << a);
}

/* 2^y on the lanes of k where y >= -125 or y is NaN, 0 on the others: f = y - floor(y)
 * in [0, 1) by one vreduceps, 2^f by the polynomial, times 2^floor(y) by vscalefps
 * (which floors its exponent operand itself): 2 instructions fewer than rounding y,
 * subtracting and scaling by the rounded value.  A result is at least 2^-125, never
 * subnormal; masked lanes raise nothing. */
static inline __m512 fa_ra_exp2(__m512 y, __mmask16 k)
{
    const __mmask16 live = FA_RA_MASK_CMP(k, y, _mm512_set1_ps(-125.0f), _CMP_NLT_UQ);
#ifdef FA_EMULATE_AMX /* (SIMDe has no vreduceps; its vrndscaleps misreads _MM_FROUND_NO_EXC) */
    const __m512 n = _mm512_floor_ps(y);
    const __m512 f = _mm512_sub_ps(y, n);
#else
    const __m512 n = y, f = _mm512_reduce_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
#endif
    __m512 r = _mm512_fmadd_ps(_mm512_set1_ps(FA_RA_E4), f, _mm512_set1_ps(FA_RA_E3));
    r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(FA_RA_E2));
    r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(FA_RA_E1));
    r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(FA_RA_E0));
    return _mm512_maskz_scalef_ps(live, r, n);
}

/* The max of s c over the keys [a, b) of a row of nz (a multiple of 32); NaN logits
 * are skipped (max returns its second operand, the running max, when one is NaN: their
 * p is NaN whatever the max), -inf when there is none.  A whole row (most rows, the
 * first block of each chunk) without masks and in two chains: with a mask computed per
 * vector and one chain this pass and its lane max took 15% of the block's samples
 * (perf, B1 H2 L4096 D64, 1 thread), as much as half the softmax itself. */
static inline float fa_ra_max(const float *s, int64_t a, int64_t b, int64_t nz, __m512 cv)
{
    __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0;
    if (a == 0 && b == nz) {
        for (int64_t v = 0; v < nz / 16; v += 2) {
            m0 = _mm512_max_ps(FA_RA_MUL_RN(_mm512_load_ps(s + 16 * v), cv), m0);
            m1 = _mm512_max_ps(FA_RA_MUL_RN(_mm512_load_ps(s + 16 * v + 16), cv), m1);
        }
    } else {
        for (int64_t v = a / 16; v * 16 < b; v++) {
            const __mmask16 k = fa_ra_mask(a - 16 * v, b - 16 * v);
            m0 = _mm512_mask_max_ps(m0, k, FA_RA_MUL_RN(_mm512_load_ps(s + 16 * v), cv), m0);
        }
    }
    return fa_ra_hmax(_mm512_max_ps(m0, m1));
}

/* y = s c - m (nm = -m) of a vector of logits; big: the product rounded first */
static inline __m512 fa_ra_y(const float *s, __m512 cv, __m512 nm, const int big)
{
    const __m512 x = _mm512_load_ps(s);
    return big ? _mm512_add_ps(FA_RA_MUL_RN(x, cv), nm) : _mm512_fmadd_ps(x, cv, nm);
}

/* One pass of fa_ra_row over a row: p = 2^y into the row's sums and, rounded, into
 * pr.  full: every key visible, nz = b (no masks). */
FA_ALWAYS_INLINE void fa_ra_pass(const float *FA_RESTRICT s, uint16_t *FA_RESTRICT pr, int64_t nz, int64_t a,
                                 int64_t b, __m512 cv, __m512 nm, __m512 *sum, const int full, const int big)
{
    /* the even and the odd vectors in sums of their own: two chains */
    const __m512 zero = _mm512_setzero_ps();
    __m512 s0 = zero, s1 = zero;
    for (int64_t v = 0; v < nz / 16; v += 2) {
        const __mmask16 k0 = full ? 0xFFFF : fa_ra_mask(a - 16 * v, b - 16 * v);
        const __mmask16 k1 = full ? 0xFFFF : fa_ra_mask(a - 16 * v - 16, b - 16 * v - 16);
        __m512 p0 = zero, p1 = zero;
        if (k0) {
            p0 = fa_ra_exp2(fa_ra_y(s + 16 * v, cv, nm, big), k0);
            s0 = _mm512_add_ps(s0, p0);
        }
        if (k1) {
            p1 = fa_ra_exp2(fa_ra_y(s + 16 * v + 16, cv, nm, big), k1);
            s1 = _mm512_add_ps(s1, p1);
        }
        _mm512_store_si512((void *)(pr + 16 * v), FA_RA_CVT2(p1, p0));
    }
    *sum = _mm512_add_ps(*sum, _mm512_add_ps(s0, s1));
}

/* The lanes' largest y of the visible keys (NaN skipped: max returns its second
 * operand, the running max, when one is NaN) */
static __m512 fa_ra_ymax(const float *s, int64_t nz, int64_t a, int64_t b, __m512 cv, __m512 nm, const int big)
{
    __m512 y0 = _mm512_set1_ps(-INFINITY);
    for (int64_t v = a / 16; v < nz / 16 && 16 * v < b; v++) {
        const __mmask16 k = fa_ra_mask(a - 16 * v, b - 16 * v);
        y0 = _mm512_mask_max_ps(y0, k, fa_ra_y(s + 16 * v, cv, nm, big), y0);
    }
    return y0;
}

/* One row of a block: logits s (keys [a, b) visible), P to pr (nz bfloat16, 0 outside
 * [a, b)), the block's p added to the row's lane sums lv, the reference max m2 set on
 * the row's first visible block (-inf until then).  Returns the factor the row's
 * earlier output must be multiplied by (1: none). */
static float fa_ra_row(const float *FA_RESTRICT s, uint16_t *FA_RESTRICT pr, int64_t nz, int64_t a, int64_t b,
                       float c, float *FA_RESTRICT m2, float *FA_RESTRICT lv)
{
    const __m512 cv = _mm512_set1_ps(c), zero = _mm512_setzero_ps();
    float m = *m2, alpha = 1.0f;
    if (m == -INFINITY) {
        m = fa_ra_max(s, a, b, nz, cv);
        *m2 = m; /* stays -inf if every visible logit is -inf or NaN */
    }
    for (int redone = 0;; redone = 1) {
        /* y = s c - m in one FMA: s c exact, so y may exceed s c rounded - m by half an
         * ulp of m, which stays below 2 while |m| < 2^25; past that (absurd logits) the
         * product is rounded first, as the max's were, so that no y exceeds 0 after a
         * redo (without the rounding, logits of 5e29 exceeded the threshold again after
         * theirs; and written as a plain multiply and add, the compiler contracted the
         * two back into an FMA) */
        const int big = !(fabsf(m) < 0x1p25f) && m != -INFINITY;
        const __m512 nm = _mm512_set1_ps(m == -INFINITY ? 0.0f : -m);
        __m512 sum = zero;
        /* every key of the row visible and the rows whole 32s (most rows): no masks to
         * compute (they cost as much as the softmax itself, measured) */
        if (a == 0 && b == nz && !big)
            fa_ra_pass(s, pr, nz, a, b, cv, nm, &sum, 1, 0);
        else if (big)
            fa_ra_pass(s, pr, nz, a, b, cv, nm, &sum, 0, 1);
        else
            fa_ra_pass(s, pr, nz, a, b, cv, nm, &sum, 0, 0);
        /* Is a y above FA_RA_TH?  Not when every lane's sum is at most 2^7: a y > 8 has
         * p > 2^8 (1 - 2.7e-6), and the p are >= 0, so only rows with a lane sum above
         * 2^7 or NaN (rare after the first block, whose y are <= 0) take a pass for
         * their largest y, and the answer is the one a max kept in the pass would give
         * (the pass did that, one of its ~12 instructions a vector) */
        if (redone || _mm512_cmp_ps_mask(sum, _mm512_set1_ps(128.0f), _CMP_LE_OQ) == 0xFFFF ||
            !_mm512_cmp_ps_mask(fa_ra_ymax(s, nz, a, b, cv, nm, big), _mm512_set1_ps(FA_RA_TH), _CMP_GT_OQ)) {
            _mm512_store_ps(lv, _mm512_add_ps(_mm512_load_ps(lv), sum));
            return alpha;
        }
        /* a logit more than 2^8 above the reference (m is finite here: with m = -inf
         * every y is -inf or NaN): the block again against its max, once (against
         * its own max no y exceeds 2, see above) */
        const float mn = fa_ra_max(s, a, b, nz, cv), al = exp2f(m - mn);
        _mm512_store_ps(lv, _mm512_mul_ps(_mm512_load_ps(lv), _mm512_set1_ps(al)));
        alpha *= al;
        *m2 = m = mn;
    }
}

/* Are the bfloat16 values of nk rows (Dv of each) all finite (exponent not all ones)? */
static int fa_ra_finite(const uint16_t *v, int64_t v_sl, int64_t nk, int64_t Dv)
{
#ifdef FA_EMULATE_AMX /* (SIMDe has no 16-bit compare into a mask) */
    for (int64_t j = 0; j < nk; j++)
        for (int64_t c = 0; c < Dv; c++)
            if ((v[j * v_sl + c] & 0x7F80) == 0x7F80) return 0;
    return 1;
#else
    const __m512i ex = _mm512_set1_epi16(0x7F80);
    __mmask32 bad = 0;
    for (int64_t j = 0; j < nk; j++)
        for (int64_t c0 = 0; c0 < Dv; c0 += 32) {
            const int n = (int)(Dv - c0 < 32 ? Dv - c0 : 32);
            const __mmask32 m = n >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << n) - 1u);
            const __m512i x = _mm512_maskz_loadu_epi16(m, v + j * v_sl + c0);
            bad |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(x, ex), ex);
        }
    return bad == 0;
#endif
}

/* K rows (nk of k_sl, D wide) as the B tiles of S = Q K^T: for key tile t (16 keys)
 * and feature chunk cc (32 features), kq[((t * nch + cc) * 16 + u) * 16 + j] = the
 * pair (k[16t + j][32cc + 2u], k[16t + j][32cc + 2u + 1]); zero past D and nk. */
static void fa_ra_pack_k(const uint16_t *FA_RESTRICT k, int64_t k_sl, int64_t nk, int64_t D, int64_t nch,
                         uint32_t *FA_RESTRICT kq)
{
    for (int64_t t = 0; t * 16 < nk; t++)
        for (int64_t cc = 0; cc < nch; cc++) {
            const int64_t d0 = 32 * cc;
            const int n = (int)(D - d0 < 32 ? D - d0 : 32);
            const __mmask32 m = n >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << n) - 1u);
            __m512i x[16];
            for (int u = 0; u < 16; u++)
                x[u] = 16 * t + u < nk ? _mm512_maskz_loadu_epi16(m, k + (16 * t + u) * k_sl + d0)
                                       : _mm512_setzero_si512();
            fa_dp_transpose(x);
            for (int u = 0; u < 16; u++) _mm512_store_si512((void *)(kq + ((t * nch + cc) * 16 + u) * 16), x[u]);
        }
}

/* Row R's visible keys of a block (from j0, nkg of them) as [*a, *b), relative. */
static inline void fa_ra_range_any(const int64_t *lo, const int64_t *hi, int64_t R, int64_t nr, int64_t j0,
                                   int64_t nkg, int64_t *a, int64_t *b)
{
    *a = *b = 0;
    if (R >= nr) return;
    *a = lo[R] - j0 > 0 ? lo[R] - j0 : 0;
    *b = hi[R] + 1 - j0 < nkg ? hi[R] + 1 - j0 : nkg;
}
#define fa_ra_range(sc, R, nr, j0, nkg, a, b) fa_ra_range_any((sc)->lo, (sc)->hi, R, nr, j0, nkg, a, b)

/* The keys of a block (j0, nk of them) that group g0's 32 rows need: up to the last
 * one any of them sees (0: none). */
static inline int64_t fa_ra_keys_any(const int64_t *lo, const int64_t *hi, int64_t g0, int64_t nr, int64_t j0,
                                     int64_t nk)
{
    int64_t last = -1;
    for (int64_t r = g0; r < g0 + 2 * FA_AMX_ROWS && r < nr; r++) {
        const int64_t a = lo[r] > j0 ? lo[r] : j0, b = hi[r] < j0 + nk - 1 ? hi[r] : j0 + nk - 1;
        if (b >= a && b > last) last = b;
    }
    return last + 1 - j0 > 0 ? last + 1 - j0 : 0;
}
#define fa_ra_keys(sc, g0, nr, j0, nk) fa_ra_keys_any((sc)->lo, (sc)->hi, g0, nr, j0, nk)

/* uint32 words of a key block's K packed by fa_ra_pack_k (nk keys, nch feature chunks) */
static inline int64_t fa_ra_kwords(int64_t nk, int64_t nch) { return (nk + 15) / 16 * nch * 256; }

/* Bytes of a whole key block of the call, K and V packed as fa_qblock_rows packs them,
 * for the call's items to share (fa_share_slot); 0 where the call takes the other block. */
static int64_t FA_NAME(fa_rows_share_bytes)(const fa_params *p, const fa_blocks *bl)
{
    if (!FA_NAME(fa_rows_ok)(p, bl)) return 0;
    const int64_t nch = FA_NAME(fa_amx_dz)(p->D) / FA_AMX_K;
    const int64_t vs = FA_RA_VROW(FA_NAME(fa_round_up)(p->Dv, FA_VL));
    return (fa_ra_kwords(bl->k, nch) + FA_NAME(fa_amx_kpp)(bl->k) * vs) * (int64_t)sizeof(uint32_t);
}

/* One work item on the row-major block (see the top of this file). */
static void FA_NAME(fa_qblock_rows)(const fa_params *p, const fa_blocks *bl, const fa_item *it, void *scratch)
{
    const int64_t brp = bl->q, bc = bl->k, D = p->D, Dv = p->Dv, nr = it->nh * it->nq;
    const int64_t nvl = FA_NAME(fa_round_up)(nr, FA_AMX_ROWS), dvp = FA_NAME(fa_round_up)(Dv, FA_VL);
    const int64_t dz = FA_NAME(fa_amx_dz)(D), nch = dz / FA_AMX_K, bcz = FA_NAME(fa_round_up)(bc, 2 * FA_AMX_ROWS);
    const int64_t rs = FA_RA_SROW(bcz), vs = FA_RA_VROW(dvp); /* S and P rows, V pairs apart */
    FA_NAME(fa_scratch) sc;
    FA_NAME(fa_layout)(p, bl, scratch, &sc);
    sc.q_own = 1; /* (Q's rows below, not fa_setup_rows' pairs) */
    FA_NAME(fa_setup_rows)(p, it, nr, nvl, brp, bc, &sc);
    /* Q's rows zero-padded to dz (in the room of the pairs, which fa_setup_rows left) */
    uint16_t *qa = (uint16_t *)sc.qp;
    uint32_t *const kq_own = (uint32_t *)(void *)sc.kz;
    for (int64_t r = 0; r < nvl; r++) {
        uint16_t *d = qa + r * dz;
        int64_t n = 0;
        if (r < nr) {
            const int64_t h = it->h0 + r / it->nq, row = it->qoff + it->q0 + r % it->nq;
            memcpy(d, (const uint16_t *)p->q + it->b * p->q_sb + h * p->q_sh + row * p->q_sl,
                   (size_t)D * sizeof(uint16_t));
            n = D;
        }
        memset(d + n, 0, (size_t)(dz - n) * sizeof(uint16_t));
    }
    for (int64_t i = 0; i < nvl; i++) {
        sc.mM[i] = sc.mX[i] = -(FA_T)INFINITY;
        sc.mtot[i] = sc.mG[i] = (FA_T)0;
    }
    const float c = (float)(p->scale * FA_LOG2E);
    const int64_t ss = rs * (int64_t)sizeof(float), ps = rs * (int64_t)sizeof(uint16_t);
    const int64_t qs = dz * (int64_t)sizeof(uint16_t);
    const int64_t kv0 = it->kv0 / bc * bc, ck = bl->chunk; /* FA_ROWS_CHUNK_KEYS */
    const int single = it->kv1 > kv0 && kv0 / ck == (it->kv1 - 1) / ck;
    FA_NAME(fa_amx_begin)();
    for (int64_t c0 = kv0 / ck * ck; c0 < it->kv1; c0 += ck) {
        const int64_t lo = kv0 > c0 ? kv0 : c0, hi = it->kv1 - c0 < ck ? it->kv1 : c0 + ck;
        memset(sc.o, 0, (size_t)(nvl * dvp) * sizeof(float));
        for (int64_t i = 0; i < nvl; i++) {
            sc.m2[i] = -INFINITY;
            _mm512_store_ps(sc.lv + i * 16, _mm512_setzero_ps());
        }
        for (int64_t j0 = lo; j0 < hi; j0 += bc) {
            const int64_t nk = hi - j0 < bc ? hi - j0 : bc;
            int packed = 0, vfin = 1;
            const uint16_t *vt = NULL;
            const uint32_t *kq = kq_own, *vq = sc.vp; /* K and V packed: this item's or shared */
            int64_t v_sl = 0;
            /* A pipeline over the groups of 32 rows: step g runs S = Q K^T of group g,
             * the softmax of group g - 1 and P.V of group g - 2, each group's logits and
             * probabilities in buffers of their own (g & 1), so that no tile load reads
             * lines vector stores have just written, nor a vector load lines just stored
             * from tiles (neither is forwarded from the store buffer).  Measured against
             * the plain order (1 thread, B1 H2 L4096 D64): level, 22.4 against 22.6 ms;
             * kept because it costs nothing.  What the block spends (the same call, each
             * stage timed by leaving it out): the softmax pass ~10 ms (~15 cycles a
             * vector of 16 logits in place, 9 in a loop by itself: the tile instructions
             * between them do not overlap it), the tile stages ~9 ms, packing and the
             * rest ~1.5 ms.  The tiles outside the kernel (bench/probes/amx_tiles.c):
             * a 16 x 16 float32 tile stored into lines not in L1 takes ~17 ns, three
             * products' worth, so at D = 64 storing S costs more than computing it
             * (QK^T of a group: 417 ns without the stores, 983 with them). */
            const int64_t ng = (nvl + 2 * FA_AMX_ROWS - 1) / (2 * FA_AMX_ROWS);
            int64_t kg[3] = {0, 0, 0}; /* the keys group g needs (fa_ra_keys), at g % 3 */
            for (int64_t step = 0; step < ng + 2; step++) {
                /* S = Q K^T of group step, 2 x 2 tiles of 16 x 16 at a time */
                int64_t g0 = step * 2 * FA_AMX_ROWS;
                int64_t nkg = kg[step % 3] = g0 < nvl ? fa_ra_keys(&sc, g0, nr, j0, nk) : 0;
                if (nkg > 0) {
                    if (!packed) {
                        /* a whole block another item has packed (fa_share_slot), or packed
                         * here: into the call's block if this item claims it, else into
                         * the item's own scratch */
                        const int64_t slot = fa_share_slot(it, it->pkst, bc, j0, nk);
                        int st = slot >= 0 ? __atomic_load_n(it->pkst + slot, __ATOMIC_ACQUIRE) : 0;
                        uint32_t *shk = slot >= 0 ? (uint32_t *)(void *)(it->pkbuf + slot * it->pk_bytes) : NULL;
                        vt = FA_NAME(fa_kv_tile)(p, it, j0, nk, 1, sc.vst, &v_sl);
                        if (st >= 2) {
                            kq = shk;
                            vq = shk + fa_ra_kwords(bc, nch);
                            vfin = st == 2;
                        } else {
                            uint8_t zero = 0;
                            const int mine = st == 0 && slot >= 0 &&
                                             __atomic_compare_exchange_n(it->pkst + slot, &zero, 1, 0,
                                                                         __ATOMIC_ACQUIRE, __ATOMIC_RELAXED);
                            uint32_t *kw = mine ? shk : kq_own, *vw = mine ? shk + fa_ra_kwords(bc, nch) : sc.vp;
                            int64_t k_sl;
                            const uint16_t *kt = FA_NAME(fa_kv_tile)(p, it, j0, nk, 0, sc.kst, &k_sl);
                            fa_ra_pack_k(kt, k_sl, nk, D, nch, kw);
                            FA_NAME(fa_amx_pack_v)(vt, v_sl, nk, Dv, dvp, vs, vw);
                            vfin = fa_ra_finite(vt, v_sl, nk, Dv);
                            if (mine) __atomic_store_n(it->pkst + slot, (uint8_t)(vfin ? 2 : 3), __ATOMIC_RELEASE);
                            kq = kw;
                            vq = vw;
                        }
                        packed = 1;
                    }
                    const int two_q = g0 + FA_AMX_ROWS < nvl;
                    const int64_t nkt = (nkg + FA_AMX_ROWS - 1) / FA_AMX_ROWS;
                    const uint16_t *q0p = qa + g0 * dz, *q1p = q0p + FA_AMX_ROWS * dz;
                    float *s0 = sc.sr + (step & 1) * 2 * FA_AMX_ROWS * rs, *s1 = s0 + FA_AMX_ROWS * rs;
                    for (int64_t t = 0; t < nkt; t += 2) {
                        const int two_k = t + 1 < nkt;
                        FA_TILE_ZERO(0);
                        if (two_k) FA_TILE_ZERO(1);
                        if (two_q) {
                            FA_TILE_ZERO(2);
                            if (two_k) FA_TILE_ZERO(3);
                        }
                        for (int64_t cc = 0; cc < nch; cc++) {
                            const uint32_t *b0 = kq + (t * nch + cc) * 256, *b1 = b0 + nch * 256;
                            FA_TILE_LOAD(4, q0p + FA_AMX_K * cc, qs);
                            FA_TILE_LOAD(6, b0, 64);
                            FA_TILE_DP(0, 4, 6);
                            if (two_k) {
                                FA_TILE_LOAD(7, b1, 64);
                                FA_TILE_DP(1, 4, 7);
                            }
                            if (two_q) {
                                FA_TILE_LOAD(5, q1p + FA_AMX_K * cc, qs);
                                FA_TILE_DP(2, 5, 6);
                                if (two_k) FA_TILE_DP(3, 5, 7);
                            }
                        }
                        FA_TILE_STORE(0, s0 + 16 * t, ss);
                        if (two_k) FA_TILE_STORE(1, s0 + 16 * t + 16, ss);
                        if (two_q) {
                            FA_TILE_STORE(2, s1 + 16 * t, ss);
                            if (two_k) FA_TILE_STORE(3, s1 + 16 * t + 16, ss);
                        }
                    }
                }
                /* the softmax of group step - 1, row by row; P straight into the A rows */
                g0 = (step - 1) * 2 * FA_AMX_ROWS;
                nkg = step >= 1 ? kg[(step - 1) % 3] : 0;
                if (nkg > 0) {
                    const int64_t nz = FA_NAME(fa_round_up)(nkg, 2 * FA_AMX_ROWS);
                    const int64_t gr = g0 + FA_AMX_ROWS < nvl ? 2 * FA_AMX_ROWS : FA_AMX_ROWS;
                    const float *sg = sc.sr + ((step - 1) & 1) * 2 * FA_AMX_ROWS * rs;
                    uint16_t *pg = sc.pr + ((step - 1) & 1) * 2 * FA_AMX_ROWS * rs;
                    for (int64_t r = 0; r < gr; r++) {
                        const int64_t R = g0 + r;
                        int64_t a = 0, b = 0;
                        fa_ra_range(&sc, R, nr, j0, nkg, &a, &b);
                        if (b <= a) {
                            memset(pg + r * rs, 0, (size_t)nz * sizeof(uint16_t));
                            continue;
                        }
                        const float al = fa_ra_row(sg + r * rs, pg + r * rs, nz, a, b, c, sc.m2 + R, sc.lv + R * 16);
                        if (al != 1.0f) { /* a new reference max: the row's output so far */
                            float *o = sc.o + R * dvp;
                            for (int64_t cv = 0; cv < dvp; cv += 16)
                                _mm512_store_ps(o + cv, _mm512_mul_ps(_mm512_load_ps(o + cv), _mm512_set1_ps(al)));
                        }
                    }
                }
                /* O += P V of group step - 2, 2 x 2 tiles of 16 x 16 over the pairs of keys */
                g0 = (step - 2) * 2 * FA_AMX_ROWS;
                nkg = step >= 2 ? kg[(step - 2) % 3] : 0;
                if (nkg <= 0) continue;
                const int two_q = g0 + FA_AMX_ROWS < nvl;
                const uint16_t *pg = sc.pr + (step & 1) * 2 * FA_AMX_ROWS * rs;
                if (!vfin) { /* an inf or NaN in V: only the visible (row, key) pairs, in float32 */
                    for (int64_t R = g0; R < g0 + 2 * FA_AMX_ROWS && R < nr; R++) {
                        int64_t a, b;
                        fa_ra_range(&sc, R, nr, j0, nkg, &a, &b);
                        const uint16_t *prow = pg + (R - g0) * rs;
                        float *o = sc.o + R * dvp;
                        for (int64_t jj = a; jj < b; jj++) {
                            const float pj = fa_bf16_to_float(prow[jj]);
                            const uint16_t *vr = vt + jj * v_sl;
                            for (int64_t cv = 0; cv < Dv; cv++) o[cv] += pj * fa_bf16_to_float(vr[cv]);
                        }
                    }
                    continue;
                }
                FA_NAME(fa_amx_pv_rows)(sc.o + g0 * dvp, pg, pg + FA_AMX_ROWS * rs, ps,
                                        FA_NAME(fa_round_up)(nkg, 2 * FA_AMX_ROWS) / 2, vq, vs, dvp, two_q);
            }
        }
        /* the chunk's rows as the fold expects them: m in natural log units, l summed */
        for (int64_t r = 0; r < nr; r++) {
            sc.l[r] = fa_ra_hsum(_mm512_load_ps(sc.lv + r * 16));
            sc.m[r] = sc.m2[r] == -INFINITY ? -INFINITY : (float)((double)sc.m2[r] * M_LN2);
        }
        if (!single) FA_NAME(fa_fold_chunk)(&sc, nr, Dv, dvp);
    }
    FA_TILE_RELEASE();
    FA_NAME(fa_write_rows)(p, it, nr, single, dvp, &sc, 0);
}

/* The kernel table's forward block: the row-major one where the call allows. */
static void FA_NAME(fa_qblock_any)(const fa_params *p, const fa_blocks *bl, const fa_item *it, void *scratch)
{
    if (FA_NAME(fa_rows_ok)(p, bl))
        FA_NAME(fa_qblock_rows)(p, bl, it, scratch);
    else
        FA_NAME(fa_qblock)(p, bl, it, scratch);
}
