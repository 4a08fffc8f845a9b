/*
 * tiles_avx512.c -- the avx512 kernel's two float32 tile products (kern_products.h) outside
 * fastattn, in the kernel's loop orders and AMD block sizes (192 query rows, their row
 * stride padded to 208 floats as fa_make_plan pads it, 128-key tiles), against the same
 * register tiles with every operand in L1: what the tiles' memory traffic costs on an
 * AVX-512 machine, and whether K's and V's row stride matters.  Not built by setup.py; on
 * an x86-64 machine with AVX-512F:
 *
 *   gcc -O3 -mavx512f -mfma bench/probes/tiles_avx512.c -o /tmp/tiles512
 *   taskset -c 1 /tmp/tiles512 128 0      # D (a multiple of 64), floats added to a K/V row
 *   taskset -c 1 /tmp/tiles512 128 0 1    # the block's loop with the softmax itself
 *
 *   QK^T  6 keys x 4 query vectors (4 loads, 6 broadcasts, 24 FMAs a feature), query-vector
 *         groups outer, the key tile streaming past each (fa_qk_tile)
 *   P.V   6 query rows x 4 value vectors (4 loads, 6 broadcasts, 24 FMAs a key), value-
 *         column chunks outer, the row groups streaming each chunk (fa_pv_tile_strided),
 *         the output rows rescaled by alpha on the way in
 * K and V: one head of 2048 keys (8 MiB at D = 128 leaves L2; read tile by tile as the
 * kernel does, rows `D + pad` floats apart).  Each line: GFLOP/s (best of 15) and the
 * share of the L1-only figure.  The last line runs the block's loop: per key tile QK^T,
 * a pass over the logit tile, P.V; with a third argument the pass is the online
 * softmax (each query vector's max over the tile, exp(s - m) by the instructions of
 * fa_exp_logit_f32_avx512 with its coefficients, the sums, alpha), else a multiply.
 */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define NQ 192
#define BRP 208 /* NQ padded by a vector: 832 bytes, 13 lines */
#define NK 128
#define TILES 16
typedef __m512 V16;
static float *QT, *S, *P, *O, *K, *V;
static float ALPHA[NQ] __attribute__((aligned(64))), M[NQ] __attribute__((aligned(64))),
    L[NQ] __attribute__((aligned(64)));
static int SMX;

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static inline __attribute__((always_inline)) void qk64(const float *qt, const float *k, long ksl, int D, float *s)
{
    V16 a[6][4];
    for (int r = 0; r < 6; r++)
        for (int c = 0; c < 4; c++) a[r][c] = _mm512_setzero_ps();
    for (int d = 0; d < D; d++) {
        V16 q[4];
        for (int c = 0; c < 4; c++) q[c] = _mm512_load_ps(qt + d * BRP + c * 16);
        for (int r = 0; r < 6; r++) {
            const V16 b = _mm512_set1_ps(k[r * ksl + d]);
            for (int c = 0; c < 4; c++) a[r][c] = _mm512_fmadd_ps(b, q[c], a[r][c]);
        }
    }
    for (int r = 0; r < 6; r++)
        for (int c = 0; c < 4; c++) _mm512_store_ps(s + r * BRP + c * 16, a[r][c]);
}

static inline __attribute__((always_inline)) void pv64(const float *p, const float *v, long vsl, int nk, float *o,
                                                       int dvp, const float *al)
{
    V16 a[6][4];
    for (int r = 0; r < 6; r++)
        for (int c = 0; c < 4; c++) a[r][c] = _mm512_mul_ps(_mm512_load_ps(o + r * dvp + c * 16), _mm512_set1_ps(al[r]));
    for (int j = 0; j < nk; j++) {
        V16 x[4];
        for (int c = 0; c < 4; c++) x[c] = _mm512_loadu_ps(v + j * vsl + c * 16);
        for (int r = 0; r < 6; r++) {
            const V16 b = _mm512_set1_ps(p[j * BRP + r]);
            for (int c = 0; c < 4; c++) a[r][c] = _mm512_fmadd_ps(b, x[c], a[r][c]);
        }
    }
    for (int r = 0; r < 6; r++)
        for (int c = 0; c < 4; c++) _mm512_store_ps(o + r * dvp + c * 16, a[r][c]);
}

/* one key tile; `l1` keeps every operand at its first address */
__attribute__((noinline)) static void qk_tile(int D, const float *k, long ksl, int l1)
{
    for (int cv = 0; cv < NQ / 16; cv += 4)
        for (int j = 0; j + 6 <= NK; j += 6)
            qk64(QT + (l1 ? 0 : cv * 16), k + (l1 ? 0 : j * ksl), ksl, D, S + (l1 ? 0 : j * BRP + cv * 16));
}

__attribute__((noinline)) static void pv_tile(int D, const float *v, long vsl, int l1)
{
    for (int c0 = 0; c0 < D; c0 += 64)
        for (int i = 0; i < NQ; i += 6)
            pv64(P + (l1 ? 0 : i), v + (l1 ? 0 : c0), vsl, l1 ? 8 : NK, O + (l1 ? 0 : i * D + c0), D,
                 ALPHA + (l1 ? 0 : i));
}

/* fa_exp_logit_f32_avx512: 2^f (f = x log2(e) - n) by the degree-6 fit, scalef by n */
static inline __m512 exp_logit(__m512 x)
{
    const __m512 l2e = _mm512_set1_ps(1.44269504088896341f), y = _mm512_mul_ps(x, l2e);
    const __mmask16 live = _mm512_cmp_ps_mask(y, _mm512_set1_ps(-125.0f), _CMP_NLT_UQ);
    const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_fmsub_ps(x, l2e, n);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.535335614e-04f), f, _mm512_set1_ps(1.339887502e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618436918e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332740e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264774e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471825e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(live, p, n);
}

/* the online softmax over one logit tile S into P (fa_softmax_tile's loop) */
__attribute__((noinline)) static void softmax_tile(void)
{
    for (int i = 0; i < NQ; i += 16) {
        const V16 mo = _mm512_load_ps(M + i);
        V16 mn = mo;
        for (int j = 0; j < NK; j++) mn = _mm512_max_ps(mn, _mm512_load_ps(S + j * BRP + i));
        const V16 a = exp_logit(_mm512_sub_ps(mo, mn));
        V16 s0 = _mm512_setzero_ps(), s1 = s0;
        for (int j = 0; j < NK; j += 2) {
            const V16 e0 = exp_logit(_mm512_sub_ps(_mm512_load_ps(S + j * BRP + i), mn));
            const V16 e1 = exp_logit(_mm512_sub_ps(_mm512_load_ps(S + (j + 1) * BRP + i), mn));
            _mm512_store_ps(P + j * BRP + i, e0);
            _mm512_store_ps(P + (j + 1) * BRP + i, e1);
            s0 = _mm512_add_ps(s0, e0);
            s1 = _mm512_add_ps(s1, e1);
        }
        _mm512_store_ps(L + i, _mm512_fmadd_ps(_mm512_load_ps(L + i), a, _mm512_add_ps(s0, s1)));
        _mm512_store_ps(M + i, mn);
        _mm512_store_ps(ALPHA + i, a);
    }
}

int main(int argc, char **argv)
{
    const int D = argc > 1 ? atoi(argv[1]) : 64;
    const long pad = argc > 2 ? atol(argv[2]) : 0, sl = D + pad;
    SMX = argc > 3;
    if (D < 64 || D % 64) {
        fprintf(stderr, "D: a multiple of 64\n");
        return 1;
    }
    const size_t kv = (size_t)TILES * NK * sl + 64;
    QT = aligned_alloc(64, sizeof(float) * D * BRP);
    S = aligned_alloc(64, sizeof(float) * NK * BRP);
    P = aligned_alloc(64, sizeof(float) * NK * BRP);
    O = aligned_alloc(64, sizeof(float) * NQ * D);
    K = aligned_alloc(64, sizeof(float) * kv);
    V = aligned_alloc(64, sizeof(float) * kv);
    if (!QT || !S || !P || !O || !K || !V) return 1;
    for (int i = 0; i < D * BRP; i++) QT[i] = 1e-3f * (float)(i % 7);
    for (int i = 0; i < NK * BRP; i++) P[i] = 1e-3f * (float)(i % 7);
    for (int i = 0; i < NQ * D; i++) O[i] = 0.0f;
    for (size_t i = 0; i < kv; i++) K[i] = V[i] = 1e-3f * (float)(i % 5);
    for (int i = 0; i < NQ; i++) ALPHA[i] = 1.0f, M[i] = -1e30f, L[i] = 0.0f;
    for (int prod = 0; prod < 2; prod++) {
        double g[2];
        for (int l1 = 0; l1 < 2; l1++) {
            double best = 1e9;
            for (int rep = 0; rep < 15; rep++) {
                const double t0 = now();
                for (int it = 0; it < TILES; it++) {
                    const float *x = (prod ? V : K) + 4 + (size_t)it * NK * sl; /* 16 bytes off a line */
                    if (prod)
                        pv_tile(D, x, sl, l1);
                    else
                        qk_tile(D, x, sl, l1);
                }
                const double dt = now() - t0;
                if (dt < best) best = dt;
            }
            /* QK^T runs 126 of the 128 keys (whole 6-key tiles); P.V in L1 8 keys a group */
            const double fl = 2.0 * NQ * D * TILES * (prod ? (l1 ? 8 : NK) : 126);
            g[l1] = fl / best * 1e-9;
        }
        printf("D%d pad %ld %s: %6.1f GFLOP/s in the kernel's order, %6.1f in L1: %.1f%%\n", D, pad,
               prod ? "P.V 6x4 " : "QK^T 6x4", g[0], g[1], 100.0 * g[0] / g[1]);
    }
    /* the block's loop: per key tile QK^T, a pass over the logit tile (a stand-in for the
     * softmax: read and write every logit), then P.V on it */
    double best = 1e9;
    for (int rep = 0; rep < 15; rep++) {
        const double t0 = now();
        for (int it = 0; it < TILES; it++) {
            qk_tile(D, K + 4 + (size_t)it * NK * sl, sl, 0);
            if (SMX)
                softmax_tile();
            else
                for (int j = 0; j < NK; j++)
                    for (int i = 0; i < NQ; i += 16) {
                        const V16 x = _mm512_load_ps(S + j * BRP + i);
                        _mm512_store_ps(P + j * BRP + i, _mm512_mul_ps(x, _mm512_set1_ps(1e-3f)));
                    }
            pv_tile(D, V + 4 + (size_t)it * NK * sl, sl, 0);
        }
        const double dt = now() - t0;
        if (dt < best) best = dt;
    }
    printf("D%d pad %ld QK^T, %s, P.V a tile: %6.1f GFLOP/s (products only)\n", D, pad,
           SMX ? "the softmax" : "a pass over S",
           2.0 * NQ * D * TILES * (126 + NK) / best * 1e-9);
    return 0;
}
