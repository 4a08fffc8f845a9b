/*
 * tiles_avx2.c -- the avx2 kernel's two float32 tile products (kern_products.h) outside
 * fastattn, in the kernel's loop orders and block sizes, against the same register
 * tiles with every operand in L1: how much the tiles' own memory traffic costs, the
 * numbers behind bench/NOTEBOOK.md's "The tiles outside the kernel" section.  Not built by
 * setup.py; on an x86-64 machine with AVX2 and FMA:
 *
 *   gcc -O3 -mavx2 -mfma bench/probes/tiles_avx2.c -o /tmp/tiles && taskset -c 1 /tmp/tiles 64
 *
 * (the argument: D = Dv, a multiple of 24 * 8 / 8 = 8).  A block of 192 queries against
 * 64-key tiles of a 4096-key head (K and V 1 MiB each at D = 64, read tile by tile as
 * the kernel does; rows 16 bytes past a 64-byte line, as NumPy's large arrays are):
 *   QK^T  4 keys x 3 query vectors (7 loads, 12 FMAs a feature), query-vector groups
 *         outer, the key tile streaming past each (fa_qk_tile)
 *   P.V   6 query rows x 2 value vectors (8 loads, 12 FMAs a key), value-column chunks
 *         outer, the row groups streaming each chunk (fa_pv_tile_strided), the output
 *         rows rescaled by alpha on the way in
 * Each line: rdtsc ticks per 12 FMAs (best of 30; 12 FMAs are 6 cycles at two FMA pipes)
 * and the share of the L1-only figure.
 */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <x86intrin.h>

#define NQ 192
#define NK 64
#define TILES 64
typedef __m256 V8;
static float *QT, *S, *P, *O, *K, *V, ALPHA[NQ];

static inline __attribute__((always_inline)) void qk43(const float *qt, const float *k, int D, float *s)
{
    V8 a[4][3];
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 3; c++) a[r][c] = _mm256_setzero_ps();
    for (int d = 0; d < D; d++) {
        const V8 q0 = _mm256_load_ps(qt + d * NQ), q1 = _mm256_load_ps(qt + d * NQ + 8),
                 q2 = _mm256_load_ps(qt + d * NQ + 16);
        for (int r = 0; r < 4; r++) {
            const V8 b = _mm256_broadcast_ss(k + r * D + d);
            a[r][0] = _mm256_fmadd_ps(b, q0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(b, q1, a[r][1]);
            a[r][2] = _mm256_fmadd_ps(b, q2, a[r][2]);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 3; c++) _mm256_store_ps(s + r * NQ + c * 8, a[r][c]);
}

static inline __attribute__((always_inline)) void pv62(const float *p, const float *v, int D, float *o,
                                                       const float *al)
{
    V8 a[6][2];
    int rescale = 0;
    for (int r = 0; r < 6; r++) rescale |= al[r] != 1.0f;
    for (int r = 0; r < 6; r++)
        for (int c = 0; c < 2; c++) a[r][c] = _mm256_load_ps(o + r * D + c * 8);
    if (rescale)
        for (int r = 0; r < 6; r++)
            for (int c = 0; c < 2; c++) a[r][c] = _mm256_mul_ps(a[r][c], _mm256_set1_ps(al[r]));
    for (int j = 0; j < NK; j++) {
        const V8 v0 = _mm256_loadu_ps(v + j * D), v1 = _mm256_loadu_ps(v + j * D + 8);
        for (int r = 0; r < 6; r++) {
            const V8 b = _mm256_broadcast_ss(p + j * NQ + r);
            a[r][0] = _mm256_fmadd_ps(b, v0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(b, v1, a[r][1]);
        }
    }
    for (int r = 0; r < 6; r++)
        for (int c = 0; c < 2; c++) _mm256_store_ps(o + r * D + c * 8, a[r][c]);
}

/* one key tile: `l1` keeps every operand at its first address */
__attribute__((noinline)) static void qk_tile(int D, const float *k, int l1)
{
    for (int cv = 0; cv < NQ / 8; cv += 3)
        for (int j = 0; j < NK; j += 4)
            qk43(QT + (l1 ? 0 : cv * 8), k + (l1 ? 0 : j * D), D, S + (l1 ? 0 : j * NQ + cv * 8));
}

__attribute__((noinline)) static void pv_tile(int D, const float *v, int l1)
{
    for (int c0 = 0; c0 < D; c0 += 16)
        for (int i = 0; i < NQ; i += 6)
            pv62(P + (l1 ? 0 : i), v + (l1 ? 0 : c0), D, O + (l1 ? 0 : i * D + c0), ALPHA + (l1 ? 0 : i));
}

int main(int argc, char **argv)
{
    const int D = argc > 1 ? atoi(argv[1]) : 64;
    if (D < 16 || D % 16) {
        fprintf(stderr, "D: a multiple of 16\n");
        return 1;
    }
    const size_t kv = (size_t)TILES * NK * D + 16;
    QT = aligned_alloc(64, sizeof(float) * D * NQ);
    S = aligned_alloc(64, sizeof(float) * NK * NQ);
    P = aligned_alloc(64, sizeof(float) * NK * NQ);
    O = aligned_alloc(64, sizeof(float) * NQ * D);
    K = aligned_alloc(64, sizeof(float) * kv);
    V = aligned_alloc(64, sizeof(float) * kv);
    if (!QT || !S || !P || !O || !K || !V) return 1;
    for (int i = 0; i < D * NQ; i++) QT[i] = 1e-3f * (float)(i % 7);
    for (int i = 0; i < NK * NQ; i++) P[i] = 1e-3f * (float)(i % 7);
    for (int i = 0; i < NQ * D; i++) O[i] = 0.0f;
    for (size_t i = 0; i < kv; i++) K[i] = V[i] = 1e-3f * (float)(i % 5);
    for (int i = 0; i < NQ; i++) ALPHA[i] = 0.5f;
    const double groups = (double)NQ * NK * D / 8 / 12 * TILES; /* 12-FMA groups a pass */
    for (int prod = 0; prod < 2; prod++) {
        double t[2];
        for (int l1 = 0; l1 < 2; l1++) {
            unsigned long long best = ~0ull;
            for (int rep = 0; rep < 30; rep++) {
                const unsigned long long t0 = __rdtsc();
                for (int it = 0; it < TILES; it++) {
                    const float *x = (prod ? V : K) + 4 + (size_t)it * NK * D; /* 16 bytes off a line */
                    if (prod)
                        pv_tile(D, x, l1);
                    else
                        qk_tile(D, x, l1);
                }
                const unsigned long long dt = __rdtsc() - t0;
                if (dt < best) best = dt;
            }
            t[l1] = (double)best / groups;
        }
        printf("D%d %s: %.2f ticks per 12 FMAs in the kernel's order, %.2f in L1: %.1f%%\n", D,
               prod ? "P.V 6x2  " : "QK^T 4x3 ", t[0], t[1], 100.0 * t[1] / t[0]);
    }
    return 0;
}
