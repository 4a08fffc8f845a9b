/*
 * amx_tiles.c -- what the tile unit costs on this machine, outside fastattn: the
 * numbers behind bench/NOTEBOOK.md's "The AMX forward's overheads" section.  Not built
 * by setup.py; on a Linux x86-64 machine with AMX-BF16:
 *
 *   gcc -O2 -mamx-tile -mamx-bf16 -mavx512f -mavx512bw -mavx512dq -mavx512bf16 \
 *       bench/probes/amx_tiles.c -o /tmp/amx_tiles -lm && taskset -c 1 /tmp/amx_tiles
 *
 * Each line is a best of 5 runs in nanoseconds.  The kernels mirror kern_amx_rows.h's
 * block at D = 64: a group of 32 query rows against a block of 256 keys (S = Q K^T as
 * 2 x 2 tiles of 16 x 16 over two 32-feature steps, each S tile stored row-major into a
 * 32 x 256 float32 buffer), its softmax (one pass a row: FMA, vreduceps, a degree-4
 * polynomial, vscalefps, sums, P rounded to bfloat16), and O += P V (2 x 2 accumulator
 * tiles loaded and stored once a block).  Then where the time of the kernel's step
 * goes: the softmax with its logits and P in L1 or not, the step with S and P in L1,
 * and the step with its tile work cut into 32 pieces (64 at D = 128), spread over the
 * softmax rows, one or two before each (or after its first few vector pairs), so that
 * the tile unit and the vector ports could work at the same time.  -DD=128 for D = 128;
 * -DPAD=16 makes the rows of S, O and V's pairs 16 elements and those of P 32 elements
 * (64 bytes each) longer, so that the 16 rows of a tile fall into different L1 sets.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define BC 256 /* keys a block */
#ifndef D
#define D 64 /* features (64 or 128) */
#endif
#define DV D
#define NQ 384 /* query rows an item */
#ifndef PAD /* (kern_amx_rows.h pads S by 32 floats, P by 32, V's pairs by 16, O not) */
#define PAD 0
#endif
#define SS (BC + PAD)
#define PS (BC + 2 * PAD)
#define OS (DV + PAD)
#define VS (DV + PAD)

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static uint16_t qa[NQ * D] __attribute__((aligned(64)));   /* Q rows, A tiles */
static uint32_t kq[BC * D / 2] __attribute__((aligned(64))); /* K as B tiles (pairs) */
static float sr[2 * 32 * SS] __attribute__((aligned(64)));  /* two groups' logits */
static uint16_t pr[2 * 32 * PS] __attribute__((aligned(64)));
static uint32_t vp[BC / 2 * VS] __attribute__((aligned(64)));
static float o[NQ * OS] __attribute__((aligned(64)));
static float small[1024] __attribute__((aligned(64))); /* 4 KiB: stays in L1 */
static uint16_t psmall[1024] __attribute__((aligned(64)));
static float sink;

/* One 2 x 2 tile piece of S = Q K^T for a 32-row group (i in 0 .. 2 BC / 32 - 1: key
 * tile pair i / (D / 32), feature step i % (D / 32)); the last step of a pair stores
 * its tiles: store 0 none (only the group's last piece, one tile), 1 into the group's
 * buffer s, 2 into a 4 KiB buffer. */
static inline void qk_piece(const uint16_t *q, float *s, int store, int i)
{
    const int t = 2 * (i / (D / 32)), cc = i % (D / 32);
    if (cc == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    const uint32_t *b0 = kq + (t * (D / 32) + cc) * 256, *b1 = b0 + (D / 32) * 256;
    _tile_loadd(4, q + 32 * cc, D * 2);
    _tile_loadd(6, b0, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b1, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, q + 16 * D + 32 * cc, D * 2);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    if (cc < D / 32 - 1) return;
    if (store == 1) {
        _tile_stored(0, s + 16 * t, SS * 4);
        _tile_stored(1, s + 16 * t + 16, SS * 4);
        _tile_stored(2, s + 16 * SS + 16 * t, SS * 4);
        _tile_stored(3, s + 16 * SS + 16 * t + 16, SS * 4);
    } else if (store == 2) {
        _tile_stored(0, small, 64);
        _tile_stored(1, small + 256, 64);
        _tile_stored(2, small + 512, 64);
        _tile_stored(3, small + 768, 64);
    } else if (t == BC / 16 - 2) {
        _tile_stored(0, small, 64);
    }
}
#define QK_PIECES (BC / 16 / 2 * (D / 32))

/* S of one 32-row group */
static void qk(const uint16_t *q, float *s, int store)
{
    for (int i = 0; i < QK_PIECES; i++) qk_piece(q, s, store, i);
}

/* One piece of O += P V for a 32-row group (i: output column pair i / (BC / 32), 16
 * key pairs from 16 (i % (BC / 32))): the first of a column pair loads its
 * accumulators, the last stores them. */
static inline void pv_piece(float *og, const uint16_t *p, int i)
{
    const int c0 = 32 * (i / (BC / 32)), t0 = 16 * (i % (BC / 32));
    float *o0 = og + c0, *o1 = o0 + 16 * OS;
    if (t0 == 0) {
        _tile_loadd(0, o0, OS * 4);
        _tile_loadd(1, o0 + 16, OS * 4);
        _tile_loadd(2, o1, OS * 4);
        _tile_loadd(3, o1 + 16, OS * 4);
    }
    _tile_loadd(4, (const uint32_t *)p + t0, PS * 2);
    _tile_loadd(6, vp + t0 * VS + c0, VS * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, vp + t0 * VS + c0 + 16, VS * 4);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, (const uint32_t *)(p + 16 * PS) + t0, PS * 2);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    if (t0 == BC / 2 - 16) {
        _tile_stored(0, o0, OS * 4);
        _tile_stored(1, o0 + 16, OS * 4);
        _tile_stored(2, o1, OS * 4);
        _tile_stored(3, o1 + 16, OS * 4);
    }
}
#define PV_PIECES (DV / 32 * (BC / 32))
#define NPR ((QK_PIECES + PV_PIECES) / 32) /* pieces before each of a group's 32 rows */

/* O += P V of one 32-row group (accumulators loaded and stored once) */
static void pv(float *og, const uint16_t *p)
{
    for (int i = 0; i < PV_PIECES; i++) pv_piece(og, p, i);
}

static inline __m512 exp2v(__m512 y)
{
    const __m512 f = _mm512_reduce_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(_mm512_set1_ps(0.0135f), f, _mm512_set1_ps(0.052f));
    r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(0.2414f));
    r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(0.693f));
    r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(1.0f));
    const __mmask16 live = _mm512_cmp_ps_mask(y, _mm512_set1_ps(-125.0f), _CMP_NLT_UQ);
    return _mm512_maskz_scalef_ps(live, r, y);
}

/* The softmax pass over nv vectors of a row; with split >= 0, tile piece `piece` of
 * the step (QK^T of the group q into sq, then P.V of og and pp) runs before the row's
 * vector pair split / 2. */
static inline void softmax_row_il(const float *s, uint16_t *p, int nv, int split, const uint16_t *q, float *sq,
                                  float *og, const uint16_t *pp, int piece)
{
    const __m512 c = _mm512_set1_ps(0.18f), nm = _mm512_set1_ps(-1.0f);
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, y0 = _mm512_set1_ps(-INFINITY), y1 = y0;
    for (int v = 0; v < nv; v += 2) {
        if (v == split) {
            for (int j = piece * NPR; j < piece * NPR + NPR; j++) {
                if (j < QK_PIECES)
                    qk_piece(q, sq, 1, j);
                else
                    pv_piece(og, pp, j - QK_PIECES);
            }
        }
        const __m512 a = _mm512_fmadd_ps(_mm512_load_ps(s + 16 * v), c, nm);
        const __m512 b = _mm512_fmadd_ps(_mm512_load_ps(s + 16 * v + 16), c, nm);
        y0 = _mm512_max_ps(a, y0);
        y1 = _mm512_max_ps(b, y1);
        const __m512 p0 = exp2v(a), p1 = exp2v(b);
        s0 = _mm512_add_ps(s0, p0);
        s1 = _mm512_add_ps(s1, p1);
        _mm512_store_si512((void *)(p + 16 * v), (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    sink += _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)) + _mm512_reduce_max_ps(_mm512_max_ps(y0, y1));
}

static void softmax_row(const float *s, uint16_t *p, int nv)
{
    softmax_row_il(s, p, nv, -1, NULL, NULL, NULL, NULL, 0);
}

#define BEST(label, per, body)                                                                    \
    do {                                                                                          \
        double best = 1e9;                                                                        \
        for (int run = 0; run < 5; run++) {                                                       \
            const double t0 = now();                                                              \
            body;                                                                                 \
            const double dt = now() - t0;                                                         \
            if (dt < best) best = dt;                                                             \
        }                                                                                         \
        printf("%-62s %8.2f ns\n", label, best / (per)*1e9);                                       \
    } while (0)

int main(void)
{
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) {
        printf("no AMX permission\n");
        return 1;
    }
    uint8_t cfg[64];
    memset(cfg, 0, sizeof cfg);
    cfg[0] = 1;
    for (int t = 0; t < 8; t++) {
        cfg[16 + 2 * t] = 64;
        cfg[48 + t] = 16;
    }
    _tile_loadconfig(cfg);
    for (int i = 0; i < NQ * D; i++) qa[i] = 0x3C00;
    for (int i = 0; i < BC * D / 2; i++) kq[i] = 0x3C003C00u;
    for (int i = 0; i < BC / 2 * VS; i++) vp[i] = 0x3C003C00u;
    for (int i = 0; i < 2 * 32 * SS; i++) sr[i] = (float)(i % 37) * 0.1f;
    const long n = 1000000, groups = 20000;
    BEST("tdpbf16ps, 4 accumulators, operands in tiles (a product)", 4.0 * n, for (long i = 0; i < n; i++) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    });
    BEST("tilestored of 16 x 16 float32 into L1-resident lines (a store)", 1.0 * n,
         for (long i = 0; i < n; i++) _tile_stored(2, small + (i & 3) * 256, 64));
    BEST("QK^T of a group, S not stored (a group)", groups,
         for (long i = 0; i < groups; i++) qk(qa + (i % 12) * 32 * D, NULL, 0));
    BEST("QK^T of a group, S stored into 4 KiB (L1)", groups,
         for (long i = 0; i < groups; i++) qk(qa + (i % 12) * 32 * D, NULL, 2));
    BEST("QK^T of a group, S stored into its 32 KiB buffer (two, as the kernel)", groups,
         for (long i = 0; i < groups; i++) qk(qa + (i % 12) * 32 * D, sr + (i & 1) * 32 * SS, 1));
    BEST("O += P V of a group (accumulators loaded and stored once)", groups,
         for (long i = 0; i < groups; i++) pv(o + (i % 12) * 32 * OS, pr + (i & 1) * 32 * PS));
    BEST("softmax pass of a group's 32 rows x 256 keys, no tiles", groups, for (long i = 0; i < groups; i++) {
        for (int r = 0; r < 32; r++)
            softmax_row(sr + (i & 1) * 32 * SS + r * SS, pr + (i & 1) * 32 * PS + r * PS, BC / 16);
    });
    BEST("the kernel's step: QK^T g, softmax g-1, P.V g-2 (a group)", groups, for (long i = 0; i < groups; i++) {
        qk(qa + (i % 12) * 32 * D, sr + (i & 1) * 32 * SS, 1);
        for (int r = 0; r < 32; r++)
            softmax_row(sr + ((i - 1) & 1) * 32 * SS + r * SS, pr + ((i - 1) & 1) * 32 * PS + r * PS, BC / 16);
        pv(o + (i % 12) * 32 * OS, pr + (i & 1) * 32 * PS);
    });
    for (int split = 0; split <= 6; split += 2) {
        char lab[100]; snprintf(lab, sizeof lab, "interleaved step, tile piece after vector pair %d", split / 2);
        BEST(lab, groups, for (long i = 0; i < groups; i++) {
            for (int r = 0; r < 32; r++)
                softmax_row_il(sr + ((i - 1) & 1) * 32 * SS + r * SS, pr + ((i - 1) & 1) * 32 * PS + r * PS, BC / 16, split,
                               qa + (i % 12) * 32 * D, sr + (i & 1) * 32 * SS, o + (i % 12) * 32 * OS, pr + (i & 1) * 32 * PS, r);
        });
    }
    BEST("softmax of a group, S rows from 4 KiB (L1), P to 2 KiB (L1)", groups, for (long i = 0; i < groups; i++) {
        for (int r = 0; r < 32; r++)
            softmax_row(small + (r & 3) * 256, psmall + (r & 3) * 256, BC / 16);
    });
    BEST("softmax of a group, S from its buffer, P to 2 KiB (L1)", groups, for (long i = 0; i < groups; i++) {
        for (int r = 0; r < 32; r++)
            softmax_row(sr + ((i - 1) & 1) * 32 * SS + r * SS, psmall + (r & 3) * 256, BC / 16);
    });
    BEST("softmax of a group, S from 4 KiB (L1), P to its buffer", groups, for (long i = 0; i < groups; i++) {
        for (int r = 0; r < 32; r++)
            softmax_row(small + (r & 3) * 256, pr + ((i - 1) & 1) * 32 * PS + r * PS, BC / 16);
    });
    BEST("step with S and P in L1 (QK^T into 4 KiB, softmax from it, P.V)", groups, for (long i = 0; i < groups; i++) {
        qk(qa + (i % 12) * 32 * D, NULL, 2);
        for (int r = 0; r < 32; r++)
            softmax_row(small + (r & 3) * 256, psmall + (r & 3) * 256, BC / 16);
        pv(o + (i % 12) * 32 * OS, pr + (i & 1) * 32 * PS);
    });
    /* the clock: a chain of 1-cycle adds alone, then with one tile product now and then */
    uint64_t x = 1;
    const long m = 200000;
    BEST("400 dependent adds (ns; 400 / this = GHz)", m, for (long i = 0; i < m; i++) for (int k = 0; k < 400; k++)
        __asm__ volatile("add $1, %0" : "+r"(x)));
    BEST("the same with one tdpbf16ps every 64 chains", m, for (long i = 0; i < m; i++) {
        if (i % 64 == 0) _tile_dpbf16ps(0, 4, 6);
        for (int k = 0; k < 400; k++) __asm__ volatile("add $1, %0" : "+r"(x));
    });
    _tile_release();
    printf("(%g %lu)\n", (double)sink, (unsigned long)x);
    return 0;
}
