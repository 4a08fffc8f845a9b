/*
 * fa_internal.h -- what the driver (fa_*.c), the dispatcher (cpu.c) and the
 * per-instruction-set kernel files share.  Not part of the public interface.
 */
#ifndef FA_INTERNAL_H
#define FA_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "fastattn.h"

#if defined(__GNUC__) || defined(__clang__)
#define FA_ALWAYS_INLINE static inline __attribute__((always_inline))
#define FA_RESTRICT __restrict__
#else
#define FA_ALWAYS_INLINE static inline
#define FA_RESTRICT
#endif
#define FA_PRAGMA(x) _Pragma(#x)
#define FA_PRAGMA_UNROLL(n) FA_PRAGMA(GCC unroll n) /* (the pragma of GCC; others ignore it) */

/* IEEE half <-> float in portable C (round to nearest even), for float16 q and
 * outputs, which are converted once per row, and for the generic kernel's K/V; the
 * other ISAs convert K/V with their vector instructions (F16C, AVX-512).
 * half -> float without branches on the value, so that a loop of them vectorizes:
 * a normal half is its magnitude bits moved up 13 with the exponent rebiased by 112;
 * zero and subnormals (exponent 0) are 2^-14 (1 + m) - 2^-14, one exact subtraction
 * of normal floats (so flush-to-zero and denormals-are-zero modes change nothing);
 * inf and NaN keep their payload under an all-ones exponent.  The same bits as the
 * case-by-case conversion for all 65536 inputs (checked exhaustively, with and
 * without FTZ/DAZ). */
static inline float fa_half_to_float(uint16_t h)
{
    const uint32_t mag = (uint32_t)(h & 0x7fffu) << 13, e = mag & 0x0f800000u;
    uint32_t low = mag + (113u << 23);
    float f;
    memcpy(&f, &low, sizeof f);
    f -= 0x1p-14f;
    memcpy(&low, &f, sizeof low);
    /* the three cases chosen by masks (a ternary would become branches) */
    const uint32_t is_low = 0u - (uint32_t)(e == 0), is_top = 0u - (uint32_t)(e == 0x0f800000u);
    uint32_t bits = ((mag + (112u << 23)) & ~(is_low | is_top)) | (low & is_low) | ((mag | 0x7f800000u) & is_top);
    bits |= (uint32_t)(h & 0x8000u) << 16;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t fa_float_to_half(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65536: inf */
    if (ax < 0x38800000u) {                                     /* below 2^-14: subnormal */
        float a;
        memcpy(&a, &ax, sizeof a);
        const float m = a * 16777216.0f; /* in units of 2^-24, exact */
        uint32_t mi = (uint32_t)m;
        const float frac = m - (float)mi;
        if (frac > 0.5f || (frac == 0.5f && (mi & 1u))) mi++; /* to nearest even */
        return (uint16_t)(sign | mi);
    }
    const uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u); /* round to nearest even at bit 13 */
    return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
}

/* bfloat16 <-> float: the high half of the float's bits; to bfloat16 rounds to nearest
 * even and keeps NaN a (quiet) NaN. */
static inline float fa_bf16_to_float(uint16_t h)
{
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t fa_float_to_bf16(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

#if defined(__SSE2__) || defined(_M_X64)
#include <emmintrin.h>
#define FA_HAVE_SSE2 1
/* Transposes a 16 x 16 byte block: dst[t * dstride + i] = rows[i][off + t] (16 source
 * rows, each read from byte `off`).  Four rounds of interleaving rows i and i + 8.
 * Also ORs the block into *any_v and ANDs "byte == 1" into *all_v. */
static inline void fa_transpose_u8_16x16(const uint8_t *const *rows, int64_t off, uint8_t *dst,
                                         int64_t dstride, __m128i *any_v, __m128i *all_v)
{
    const __m128i ones = _mm_set1_epi8(1);
    __m128i a[16], b[16];
    for (int i = 0; i < 16; i++) {
        a[i] = _mm_loadu_si128((const __m128i *)(const void *)(rows[i] + off));
        *any_v = _mm_or_si128(*any_v, a[i]);
        *all_v = _mm_and_si128(*all_v, _mm_cmpeq_epi8(a[i], ones));
    }
    for (int round = 0; round < 4; round++) {
        for (int i = 0; i < 8; i++) {
            b[2 * i] = _mm_unpacklo_epi8(a[i], a[i + 8]);
            b[2 * i + 1] = _mm_unpackhi_epi8(a[i], a[i + 8]);
        }
        for (int i = 0; i < 16; i++) a[i] = b[i];
    }
    for (int t = 0; t < 16; t++) _mm_storeu_si128((__m128i *)(void *)(dst + t * dstride), a[t]);
}
#endif

/* Philox-4x32-10 (Salmon et al., SC'11, as in Random123): 10 rounds of two 32x32->64
 * multiplies, the key bumped by the Weyl constants between rounds. */
static inline void fa_philox4x32_10(uint32_t c[4], uint32_t k0, uint32_t k1)
{
    for (int r = 0; r < 10; r++) {
        const uint64_t p0 = (uint64_t)0xD2511F53u * c[0], p1 = (uint64_t)0xCD9E8D57u * c[2];
        const uint32_t n0 = (uint32_t)(p1 >> 32) ^ c[1] ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c[3] ^ k1;
        c[0] = n0;
        c[1] = (uint32_t)p1;
        c[2] = n2;
        c[3] = (uint32_t)p0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
}

/* keep[jj * ks] = the dropout decision (1 = keep) of keys j0 .. j0+nk-1 of row
 * (b, h, i): one Philox call per 4 keys (see fa_dropout_keep in fastattn.h). */
static inline void fa_dropout_row(uint64_t seed, uint32_t thresh, int64_t b, int64_t h, int64_t i,
                                  int64_t j0, int64_t nk, uint8_t *keep, int64_t ks)
{
    uint32_t w[4];
    int64_t have = -1;
    for (int64_t jj = 0; jj < nk; jj++) {
        const int64_t j = j0 + jj;
        if ((j >> 2) != have) {
            have = j >> 2;
            w[0] = (uint32_t)have;
            w[1] = (uint32_t)i;
            w[2] = (uint32_t)h;
            w[3] = (uint32_t)b;
            fa_philox4x32_10(w, (uint32_t)seed, (uint32_t)(seed >> 32));
        }
        keep[jj * ks] = w[j & 3] >= thresh;
    }
}

/*
 * Merging partial attentions over disjoint key sets, online, one part at a time in
 * order (fastattn.merge, split-KV decoding, and the key chunks of every row in the
 * kernels: one code, so every path adds a row's chunks with the same arithmetic).
 * State: M (the largest lse so far, -inf before the first part), tot (the sum of
 * exp(lse_p - M)), dst (the sum of exp(lse_p - M) out_p).  A part with lse -inf has
 * no visible key and is skipped; a NaN lse makes the row NaN.  fma and the libm
 * exp/log: the same bits whatever instruction set the including file is compiled
 * for (no contraction can differ).
 */
#include <math.h>
#define FA_MERGE_FNS(SUF, T, EXP, LOG, FMA)                                                      \
    /* the part's output is src * inv (inv = 1: src itself; a kernel's chunk passes its \
     * unnormalized rows and 1 / l, the normalization fused into this one pass) */       \
    static inline void fa_merge_step_scaled_##SUF(T *M, T *tot, T *dst, T x, const T *src,   \
                                                  T inv, int64_t dv)                          \
    {                                                                                           \
        if (x == -(T)INFINITY) return;                                                          \
        if (*M == -(T)INFINITY) {                                                               \
            *M = x;                                                                             \
            *tot = (T)1;                                                                        \
            for (int64_t c = 0; c < dv; c++) dst[c] = src[c] * inv;                             \
            return;                                                                             \
        }                                                                                       \
        /* (one of the two differences is 0 unless a NaN is about: exp(0) is 1 exactly, so   \
         * skipping that call keeps the bits; the AMX prefill spent ~4% of its time in exp) */ \
        const T m = (x > *M || x != x) ? x : *M, da = *M - m, db = x - m;                       \
        const T a = da == (T)0 ? (T)1 : EXP(da), b = db == (T)0 ? (T)1 : EXP(db);               \
        *tot = FMA(*tot, a, b);                                                                 \
        for (int64_t c = 0; c < dv; c++) dst[c] = FMA(dst[c], a, b * (src[c] * inv));          \
        *M = m;                                                                                 \
    }                                                                                           \
    static inline void fa_merge_step_##SUF(T *M, T *tot, T *dst, T x, const T *src, int64_t dv)    \
    {                                                                                           \
        fa_merge_step_scaled_##SUF(M, tot, dst, x, src, (T)1, dv); /* (x * 1 = x exactly) */   \
    }                                                                                           \
    /* dst /= tot and the merged lse (0 and -inf when no part had a visible key) */            \
    static inline T fa_merge_finish_##SUF(T M, T tot, T *dst, int64_t dv)                       \
    {                                                                                           \
        if (M == -(T)INFINITY) {                                                                \
            for (int64_t c = 0; c < dv; c++) dst[c] = (T)0;                                     \
            return -(T)INFINITY;                                                                \
        }                                                                                       \
        const T inv = (T)1 / tot;                                                               \
        for (int64_t c = 0; c < dv; c++) dst[c] *= inv;                                         \
        return M + LOG(tot);                                                                    \
    }                                                                                           \
    /* An attention sink folded into a finished row (dst normalized, its lse): a part   \
     * with lse = sink and a zero output.  Returns the row's new lse; dst is scaled by   \
     * the keys' share of the mass.  The same arithmetic on every path (prefill rows,   \
     * split-KV decoding), after the keys' own merge, so the bits agree as they do       \
     * without a sink. */                                                                \
    static inline T fa_sink_fold_##SUF(T lse, T sink, T *dst, int64_t dv)                   \
    {                                                                                       \
        if (sink == -(T)INFINITY) return lse;                                               \
        if (lse == -(T)INFINITY) return sink; /* no visible key: dst is 0 already */        \
        const T m = (sink > lse || sink != sink) ? sink : lse, a = EXP(lse - m),            \
                b = EXP(sink - m), tot = a + b, f = a / tot;                                \
        for (int64_t c = 0; c < dv; c++) dst[c] *= f;                                       \
        return m + LOG(tot);                                                                \
    }
FA_MERGE_FNS(f32, float, expf, logf, fmaf)
FA_MERGE_FNS(f64, double, exp, log, fma)
#define fa_merge_step(M, tot, dst, x, src, dv)                                                  \
    _Generic((dst), float *: fa_merge_step_f32, double *: fa_merge_step_f64)(M, tot, dst, x, src, dv)
#define fa_merge_step_scaled(M, tot, dst, x, src, inv, dv)                                      \
    _Generic((dst), float *: fa_merge_step_scaled_f32, double *: fa_merge_step_scaled_f64)(M, tot, dst, x, src, inv, dv)
#define fa_merge_finish(M, tot, dst, dv)                                                        \
    _Generic((dst), float *: fa_merge_finish_f32, double *: fa_merge_finish_f64)(M, tot, dst, dv)
#define fa_sink_fold(lse, sink, dst, dv)                                                        \
    _Generic((dst), float *: fa_sink_fold_f32, double *: fa_sink_fold_f64)(lse, sink, dst, dv)

/* Keys are reduced in chunks of this many from key 0 (each by the online softmax over
 * its tiles), and the chunks merged in order with fa_merge_step: in prefill, in
 * split-KV decoding and in every block, so a row's bits do not depend on the call it
 * is part of.  A multiple of every default key block.  The calls of AMX's row-major
 * block (fa_amx_rows_call) take FA_ROWS_CHUNK_KEYS instead, in all their blocks and
 * splits (fa_chunk_keys, fa_blocks.chunk): its chunks restart the lazy reference max
 * (a pass of its own over a chunk's first key block) and end in a fold (libm's exp
 * and log a row, the output rows rescaled); measured on a Sapphire Rapids class
 * Xeon, 1 thread, bf16 B1 H2 L4096 D64: 19.0 ms with chunks of 512 keys, 16.0 with
 * 2048, 15.4 with one chunk.  2048 keeps 4 chunks a head to split at Lk = 8192. */
#define FA_CHUNK_KEYS 512
#define FA_ROWS_CHUNK_KEYS 2048

/* Alignment of every scratch piece: one cache line, enough for any vector load. */
#define FA_ALIGN 64

/* Block sizes of one call, chosen by the driver: q query rows (a multiple of the
 * kernel's vector width: also the row stride of its query-major scratch) and k keys;
 * rows: the most rows an item of the call has (heads stacked x positions, before the
 * rounding up to q), which decides a call's products, never one block's (a row's bits
 * do not depend on how the call's rows fall into blocks). */
typedef struct fa_blocks {
    int64_t q, k, rows;
    int64_t chunk; /* the call's key chunk (fa_chunk_keys): every block and split takes it */
} fa_blocks;

/* The aligned diagonal of query row 0 of a sequence with Lq queries and Lk keys, in
 * key rows (row i's is i + this): the causal convention's (bottom-right: Lk - Lq,
 * top-left: 0), or the given positions'.  The window is around it, causal hides the
 * keys past it. */
static inline int64_t fa_diag0(const fa_params *p, int64_t Lq, int64_t Lk)
{
    if (p->positions) return p->q_pos0 - p->k_pos0;
    return p->causal == FA_CAUSAL_TOP_LEFT ? 0 : Lk - Lq;
}

/* ALiBi's diagonal of row 0 (distance |i + this - j|): bottom-right whatever the
 * causal convention (semantics 3), or the given positions' moved by alibi_shift. */
static inline int64_t fa_alibi0(const fa_params *p, int64_t Lq, int64_t Lk)
{
    return p->positions ? p->q_pos0 - p->k_pos0 + p->alibi_shift : Lk - Lq;
}

/* Is an array stored in one of the 16-bit types (enum fa_storage)? */
static inline int fa_store16(int store) { return store == FA_STORE_F16 || store == FA_STORE_BF16; }

/* K/V that the kernels stage tile by tile rather than read in place: int8 (dequantized),
 * paged (rows gathered from pages) or K on the lanes (fastattn.KVCache), see
 * kern_source.h. */
static inline int fa_kv_staged(const fa_params *p)
{
    return p->kv_store == FA_STORE_I8 || p->block_table != NULL || p->k_lanes > 0;
}

/* Does a call's forward take AMX's row-major block (kern_amx_rows.h) when it runs on
 * the AMX path with bfloat16 q, k, v: no logit step (bias, mask, softcap, ALiBi), no
 * dropout, statistics or attention weights, K/V one strided array, a finite scale?
 * (The plan gives those calls longer key blocks.) */
static inline int fa_amx_rows_call(const fa_params *p)
{
    return !p->bias && !p->mask && !(p->softcap > 0) && !p->alibi && !(p->dropout_p > 0) && !p->weights &&
           !p->entropy && !fa_kv_staged(p) && isfinite(p->scale);
}

/* The element offset of key row j of sequence b, kv head g, in an array addressed
 * with strides (sb, sh, sl): of its page through the block table, or directly. */
static inline int64_t fa_kv_row_at(const fa_params *p, int64_t b, int64_t g, int64_t j, int64_t sb,
                                   int64_t sh, int64_t sl)
{
    if (p->block_table) {
        const int64_t page = p->block_table[b * p->bt_sb + j / p->page_size];
        return page * sb + g * sh + (j % p->page_size) * sl;
    }
    return b * sb + g * sh + j * sl;
}

/* The key range [lo, hi) that some row may see, made safe to index: within [0, Lk],
 * and an empty range (nothing visible: windows past the keys, more queries than keys
 * with a top-left diagonal, Lk = 0) always [0, 0), so that no rounding of lo down to
 * a tile start, and no tile loop "from lo", can reach a key outside K, V, the mask or
 * the bias.  Every item's [kv0, kv1) is made by this. */
static inline void fa_key_range(int64_t lo, int64_t hi, int64_t Lk, int64_t *kv0, int64_t *kv1)
{
    if (lo < 0) lo = 0;
    if (hi > Lk) hi = Lk;
    if (hi <= lo) lo = hi = 0;
    *kv0 = lo;
    *kv1 = hi;
}

/* One work item: the query rows of nh heads that share one key/value head, all
 * against the same key tiles (so a K/V tile is loaded once for the group). */
typedef struct fa_item {
    int64_t b, g;       /* batch (sequence), key/value head                       */
    int64_t h0, nh;     /* query heads h0 .. h0+nh-1, all reading kv head g       */
    int64_t q0, nq;     /* positions q0 .. q0+nq-1 of each of those heads         */
    int64_t Lq, Lk;     /* this sequence's lengths                                */
    int64_t qoff, koff; /* its first row on the L axis of q/out/lse and of k/v    */
    int64_t kv0, kv1;   /* keys that may be visible to some row: [kv0, kv1), inside
                           [0, Lk], and [0, 0) when none is (fa_key_range)       */
    int64_t share_n;    /* whole key blocks of this (b, g) the call shares (fa_share_slot) */
    uint8_t *vfin;      /* their V-tile flags, or NULL                            */
    uint8_t *pkst;      /* their packed K and V's states, or NULL                 */
    char *pkbuf;        /* the packed blocks, pk_bytes a block                    */
    int64_t pk_bytes;
    int64_t part_o, part_lse; /* nonzero: an item of split-KV partials (fa_decode_split):
                           each chunk c's rows written alone, as a one-chunk item's, c *
                           part_o elements past the output row and c * part_lse past
                           lse (in the compute dtype), not merged; 0: merged here      */
} fa_item;

/* The slot of the whole key block [j0, j0 + nk) of bk keys from key 0 among the
 * (sequence, kv head)'s shared ones, in `tab` (it->vfin, it->pkst), or -1: a partial
 * block, or nothing shared (tab NULL). */
static inline int64_t fa_share_slot(const fa_item *it, const void *tab, int64_t bk, int64_t j0, int64_t nk)
{
    if (!tab || nk != bk || j0 % bk) return -1;
    return j0 / bk < it->share_n ? j0 / bk : -1;
}
/* The call's V-tile flags (fa_forward.c): for each (sequence, kv head), a byte per whole
 * tile of bk keys from key 0: 0 not checked yet, 1 every V value finite, 2 not.  The
 * query blocks of a head, and the heads of a group, read the same V tiles, and each
 * checked every tile before its P.V (fa_v_finite): 4% of a float32 forward's kernel
 * time at D=128, 7% causal (64-row blocks: three times the items).  Now the first item
 * to reach a tile checks it and stores the answer; the others read it.  Items on other
 * threads may check one tile at the same time: each stores the same byte (relaxed
 * atomics), so the decision, and every bit of the result, is the check's whichever
 * item makes it.  A partial tile (a causal block's last, the keys' end) has no flag and
 * is checked by each item, as before. */
/* The tile's flag: 1 finite, 2 not, 0 unknown (or no slot) */
static inline int fa_vfin_read(const fa_item *it, int64_t slot)
{
    return slot < 0 ? 0 : __atomic_load_n(it->vfin + slot, __ATOMIC_RELAXED);
}
/* Record a check's answer (finite: nonzero) in the slot; returns the flag (1 or 2). */
static inline int fa_vfin_write(const fa_item *it, int64_t slot, int finite)
{
    const uint8_t f = finite ? 1 : 2;
    if (slot >= 0) __atomic_store_n(it->vfin + slot, f, __ATOMIC_RELAXED);
    return f;
}
/* The call's packed key blocks (a kernel's share_bytes, fa_forward.c): for each
 * (sequence, kv head), pk_bytes a whole block of bk keys from key 0, K and V laid out as
 * the kernel's tiles read them, and a state byte (it->pkst, fa_share_slot): 0 not
 * packed, 1 being packed, 2 packed with every V value finite, 3 packed with an inf or
 * NaN in V.  The first item to reach a block claims it (0 -> 1), packs it there and
 * publishes it (release); an item that finds it packed (acquire) uses it; one that finds
 * it being packed packs its own copy, as every item did before.  The same values either
 * way, so the same bits. */

/* Computes one item (rows r = hh*nq + i), writing its output rows and lse (or its
 * rows of attention weights).  `scratch` holds fa_kernel.scratch_bytes(p, bl) bytes,
 * FA_ALIGN-aligned, owned by the calling thread. */
typedef void (*fa_qblock_fn)(const fa_params *p, const fa_blocks *bl, const fa_item *it,
                             void *scratch);
typedef size_t (*fa_scratch_fn)(const fa_params *p, const fa_blocks *bl);

/* One backward call as the kernels see it: the arguments, the block sizes, each
 * row's D_i = sum(dout * out) (delta, compute dtype, addressed b * delta_sb +
 * h * delta_sh + row), the dropout threshold, and the key chunk kc of the dQ sums:
 * dq_i = scale * sum over chunks c in order of (the chain of dS_ij k_j over the
 * keys j of chunk c, ascending), in every schedule.  part_sc: elements per chunk
 * of the per-chunk dQ buffer (B, Hq, Lq, D rounded up to the vector width). */
typedef struct fa_bwd_ctx {
    const fa_bwd_params *bp;
    fa_blocks bl;
    const void *delta;
    int64_t delta_sb, delta_sh;
    uint32_t drop_thresh;
    int64_t kc, part_sc;
    int64_t kr; /* the most keys one fa_bwd_kv_fn call takes (its k1 - k0); 0: unknown */
} fa_bwd_ctx;
/* dK and dV of keys k0 .. k1-1 of kv head (items[0].b, items[0].g), from the query
 * items (all of that head's, in order; with dq_mode 0 those that see none of the
 * keys are skipped), accumulated in `acc` ((k1 - k0) x (D + Dv) rounded up to the
 * vector width, FA_ALIGN-aligned).  dq_mode 1 (k0 = 0, k1 = Lk): also each item's
 * dQ, written; dq_mode 2 (k0 .. k1 is one dQ chunk): also each item's chunk sum,
 * stored in `part` for fa_bwd_reduce_fn. */
typedef void (*fa_bwd_kv_fn)(const fa_bwd_ctx *cx, const fa_item *items, int64_t nitems,
                             int64_t k0, int64_t k1, int dq_mode, void *scratch, void *acc,
                             void *part);
/* Pass 2 of the two-pass schedule: dQ (and dS) of the rows of one item. */
typedef void (*fa_bwd_q_fn)(const fa_bwd_ctx *cx, const fa_item *it, void *scratch);
typedef size_t (*fa_bwd_scratch_fn)(const fa_bwd_ctx *cx);
/* key_mass of keys k0 .. k1-1 of one kv head (see fa_key_mass), the accumulators
 * in acc (G x (k1 - k0) compute-dtype elements), written to out. */
typedef void (*fa_mass_fn)(const fa_bwd_ctx *cx, const fa_item *items, int64_t nitems, int64_t k0,
                           int64_t k1, void *scratch, void *acc, void *out, int64_t m_sb,
                           int64_t m_sh);
/* dq of rows r0 .. r1-1 (of B Hq Lq) from the nch chunk sums in part. */
typedef void (*fa_bwd_reduce_fn)(const fa_bwd_ctx *cx, const void *part, int64_t nch, int64_t r0,
                                 int64_t r1);
typedef void (*fa_exp_fn)(const void *x, void *y, int64_t n, int logit);
/* iters rounds of FA_PEAK_CHAINS vector FMAs (fa_fma_peak) */
#define FA_PEAK_CHAINS 12
typedef double (*fa_peak_fn)(int64_t iters, double m, double a);
/* FA_READ_STREAMS runs of n elements, stride elements apart, read side by side; returns
 * their sum (fa_read_bandwidth).  n: a multiple of FA_READ_STEP, which covers two
 * vectors of every kernel's widest type. */
#define FA_READ_STREAMS 4
#define FA_READ_STEP 32
typedef double (*fa_read_fn)(const void *src, int64_t n, int64_t stride);

/* The micro-kernels of one instruction set, for each dtype (index enum fa_dtype;
 * FA_KV16 = float32 compute with float16 K/V, FA_KVB16 with bfloat16 K/V). */
#define FA_KV16 2
#define FA_KVB16 3
typedef struct fa_kernel {
    const char *name;
    int lanes[2];        /* vector width in elements */
    fa_qblock_fn qblock[4];        /* float32, float64, float32 with float16 / bfloat16 K/V */
    fa_scratch_fn scratch_bytes[4];
    fa_exp_fn exp_array[2];
    fa_peak_fn fma_chains[2];      /* float32, float64 */
    fa_read_fn read_streams[2];    /* float32, float64 */
    fa_bwd_kv_fn bwd_kv[2];        /* float32, float64 */
    fa_bwd_q_fn bwd_q[2];
    fa_bwd_scratch_fn bwd_scratch[2];
    fa_bwd_reduce_fn bwd_reduce[2];
    fa_mass_fn mass[2];
} fa_kernel;

extern const fa_kernel fa_kernel_generic;
#ifdef FA_HAVE_X86_KERNELS
extern const fa_kernel fa_kernel_avx2;
extern const fa_kernel fa_kernel_avx512;
#endif
#ifdef FA_HAVE_NEON_KERNELS
extern const fa_kernel fa_kernel_neon;
#endif
#ifdef FA_HAVE_SVE_KERNELS
extern const fa_kernel fa_kernel_sve256;
extern const fa_kernel fa_kernel_sve128;
#endif

/* Is this an AMD (or Hygon) CPU?  (cpu.c; the block sizes differ by vendor) */
int fa_cpu_amd(void);
/* Where a decode step's software prefetches put float K and V lines (the keys on the
 * lanes of a fastattn.KVCache, and the V rows of few-row P.V, a cache's or the caller's
 * arrays'): fa_cpu_pf_l2() is 1 on x86 CPUs other than AMD's, where they go into L2
 * (prefetcht1; the lanes' float32 keys are not asked for at all, kern_products.h); 0
 * elsewhere, into L1 (prefetcht0), as int8 and int4 lines everywhere.  On Intel a
 * prefetch into L1 holds one of the core's few line fill buffers until its line arrives,
 * and the lines in flight stop at that count.  Measured on a Sapphire-Rapids-class Xeon
 * (lscpu family 6 model 167, 2 threads bound, B1 Lk8192 D128): a float16 cache from L3
 * 1.15-1.25x as fast (H32, Lq 4), from memory (caches larger than the L3 in turn)
 * 1.05-1.1x; arrays and paged pools level (bench/NOTEBOOK.md, 2026-12-07).  AMD keeps L1: its
 * kernels were tuned there, and Zen 4 drops some prefetches into L2. */
int fa_cpu_pf_l2(void);
/* fa_set_lane_groups's mode (fa_forward.c): 0 by the CPU, 2 or 4 */
extern int fa_lane_groups_mode;
#define FA_PF_L1 0
#define FA_PF_L2 1
#define FA_PF_OFF 2 /* (not asked for: the caller skips FA_PF_KV, which would ask into L1) */
#define FA_PF_KV(a, to) ((to) == FA_PF_L2 ? __builtin_prefetch((a), 0, 2) : __builtin_prefetch((a), 0, 3))

/* The next item's rows, asked for a few lines at a time while this item's products run
 * (fa_forward.c, fa_pf_item on Intel): up to FA_PF_RANGES runs of rows, each `rows`
 * rows of `bytes` bytes, `stride` bytes apart; fa_pf_step, called once for each
 * register tile row group of the products (kern_products.h), asks for the next `per`
 * cache lines of them.  fa_pf_now is the running thread's stream, NULL outside such an
 * item (every other call of the products: decoding, the backward, ...). */
#define FA_PF_RANGES 8
typedef struct fa_pf_stream {
    const char *base[FA_PF_RANGES];
    int64_t stride[FA_PF_RANGES], bytes[FA_PF_RANGES], rows[FA_PF_RANGES];
    int n, i;           /* runs, the current run */
    int64_t row, off;   /* the current run's next row and byte */
    int64_t per;        /* lines a step */
} fa_pf_stream;
extern __thread fa_pf_stream *fa_pf_now;
static inline void fa_pf_step(void)
{
    fa_pf_stream *s = fa_pf_now;
    if (!s) return;
    for (int64_t lines = s->per; lines > 0 && s->i < s->n; lines--) {
        const int i = s->i;
        __builtin_prefetch(s->base[i] + s->row * s->stride[i] + s->off, 0, 2);
        s->off += 64;
        if (s->off >= s->bytes[i]) {
            s->off = 0;
            if (++s->row >= s->rows[i]) {
                s->row = 0;
                s->i++;
            }
        }
    }
    if (s->i >= s->n) fa_pf_now = NULL;
}

/* A bfloat16 path: the forward of q, k and v all bfloat16 with the products on
 * bfloat16 hardware (kernels_avx512bf16.c), in place of the avx512 kernel's
 * qblock[FA_KVB16] (which converts to float32) when fa_bf16_path() selects it
 * (fastattn.h). */
typedef struct fa_bf16_kernel {
    const char *name;
    fa_qblock_fn qblock;
    fa_scratch_fn scratch_bytes;
    fa_peak_fn dp_chains; /* the instruction's peak loop (fastattn.bench.bf16_peak) */
    double round_flops;   /* flops of one round of that loop, all threads' lanes apart */
    /* the float32 backward with its products on pairs (NULL: none), for calls whose
     * inputs hold bfloat16 values (fa_bwd_params.bf16); 16 lanes */
    fa_bwd_kv_fn bwd_kv;
    fa_bwd_q_fn bwd_q;
    fa_bwd_scratch_fn bwd_scratch;
    fa_bwd_reduce_fn bwd_reduce;
    int64_t bwd_block_q; /* the backward's query rows a block (0: fa_backward.c's default) */
    /* bytes of a whole key block packed for the call's blocks to share (fa_share_slot), 0
     * where the call's block does not share them; NULL: never */
    int64_t (*share_bytes)(const fa_params *p, const fa_blocks *bl);
    int64_t lanes; /* float32 lanes of its vectors: the call's blocks are made of them */
} fa_bf16_kernel;
#ifdef FA_HAVE_BF16_KERNELS
extern const fa_bf16_kernel fa_kernel_avx512_bf16;
#endif
#ifdef FA_HAVE_AMX_KERNELS
extern const fa_bf16_kernel fa_kernel_amx_bf16;
#endif
#ifdef FA_HAVE_ARM_BF16_KERNELS
extern const fa_bf16_kernel fa_kernel_bf16_neon;
#ifdef FA_HAVE_SVE_KERNELS
extern const fa_bf16_kernel fa_kernel_bf16_sve256;
extern const fa_bf16_kernel fa_kernel_bf16_sve128;
#endif
/* The BFDOT kernel of an AArch64 float32 kernel where the CPU has its instructions,
 * else NULL (cpu.c). */
const fa_bf16_kernel *fa_arm_bf16_kernel(const fa_kernel *kern);
#endif
#if defined(FA_HAVE_BF16_KERNELS) || defined(FA_HAVE_ARM_BF16_KERNELS)
#define FA_HAVE_PAIR_KERNELS 1 /* some bfloat16 pair (or tile) kernel is built */
#endif
/* The bfloat16 kernel of a path (fastattn.h), or NULL for FA_BF16_FLOAT32 and a path
 * this build lacks. */
const fa_bf16_kernel *fa_bf16_kernel_for_path(int path);

/* The table for an ISA, or NULL if it was not compiled in. */
const fa_kernel *fa_kernel_for_isa(int isa);

#endif /* FA_INTERNAL_H */
