/*
 * tile_shapes.c -- the QK^T register tile in other shapes: R keys (broadcast from K rows)
 * x NV query vectors (loaded from Q^T rows), R * NV accumulators, over D = 32 features
 * with every operand in L1 (Q^T 192 queries x 32 features, 24 KiB; K 48 keys), against
 * the same tile with its operands in registers.  Each logit is the same chain of FMAs
 * over the features in every shape, so a shape is free to choose per CPU; the question is
 * what each costs on the machine at hand: R broadcasts and NV loads a feature for R * NV
 * FMAs.  Not built by setup.py; on an x86-64 machine with AVX-512F:
 *
 *   gcc -O3 -mavx512f -mfma bench/probes/tile_shapes.c -o /tmp/tile_shapes
 *   taskset -c 0 /tmp/tile_shapes
 *
 * Each line: GFLOP/s (best of 7) and its share of the register-only 6 x 4 loop.
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define NQ 192
#define NK 48
#define DD 32
static float qt[DD * NQ] __attribute__((aligned(64)));
static float kk[NK * DD] __attribute__((aligned(64)));
static float ss[64 * 16] __attribute__((aligned(64)));

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* one pass over the 48 keys and 192 queries in R x NV tiles; REG: operands in registers */
#define TILE(R, NV, REG)                                                                        \
    __attribute__((noinline)) static void tile_##R##x##NV##_##REG(void)                         \
    {                                                                                           \
        for (int cv = 0; cv + NV <= NQ / 16; cv += NV)                                          \
            for (int j = 0; j + R <= NK; j += R) {                                              \
                __m512 acc[R][NV];                                                              \
                __m512 qv[NV], kb = _mm512_set1_ps(1.0f);                                       \
                for (int c = 0; c < NV; c++) qv[c] = _mm512_load_ps(qt + (cv + c) * 16);        \
                for (int r = 0; r < R; r++)                                                     \
                    for (int c = 0; c < NV; c++) acc[r][c] = _mm512_setzero_ps();               \
                for (int d = 0; d < DD; d++) {                                                  \
                    if (!REG)                                                                   \
                        for (int c = 0; c < NV; c++) qv[c] = _mm512_load_ps(qt + d * NQ + (cv + c) * 16); \
                    for (int r = 0; r < R; r++) {                                               \
                        if (!REG)                                                               \
                            kb = _mm512_set1_ps(kk[(j + r) * DD + d]);                          \
                        else                                                                    \
                            __asm__("" : "+v"(kb));                                             \
                        for (int c = 0; c < NV; c++) acc[r][c] = _mm512_fmadd_ps(kb, qv[c], acc[r][c]); \
                    }                                                                           \
                }                                                                               \
                for (int r = 0; r < R; r++)                                                     \
                    for (int c = 0; c < NV; c++)                                                \
                        _mm512_store_ps(ss + ((r * NV + c) & 63) * 16, acc[r][c]);              \
            }                                                                                   \
    }
TILE(6, 4, 1)
TILE(6, 4, 0)
TILE(4, 6, 0)
TILE(3, 8, 0)
TILE(8, 3, 0)
TILE(4, 4, 0)
TILE(2, 12, 0)
TILE(12, 2, 0)

static double gflops(void (*f)(void), int R, int NV)
{
    const long reps = 20000;
    double best = 1e9;
    for (int run = 0; run < 7; run++) {
        const double t0 = now();
        for (long i = 0; i < reps; i++) f();
        const double dt = now() - t0;
        if (dt < best) best = dt;
    }
    const double fl = 2.0 * 16 * DD * (double)((NQ / 16) / NV * NV) * (NK / R * R) * reps;
    return fl / best * 1e-9;
}

int main(void)
{
    for (int i = 0; i < DD * NQ; i++) qt[i] = 1e-3f * (float)(i % 7);
    for (int i = 0; i < NK * DD; i++) kk[i] = 1e-3f * (float)(i % 5);
    const double g0 = gflops(tile_6x4_1, 6, 4);
    printf("%-44s %7.1f GFLOP/s  100.0%%\n", "6 x 4, operands in registers", g0);
#define ROW(R, NV, what)                                                                        \
    {                                                                                           \
        const double g = gflops(tile_##R##x##NV##_0, R, NV);                                    \
        printf("%-44s %7.1f GFLOP/s  %5.1f%%\n", what, g, 100.0 * g / g0);                      \
    }
    ROW(6, 4, "6 x 4: 4 loads, 6 broadcasts, 24 FMAs");
    ROW(4, 6, "4 x 6: 6 loads, 4 broadcasts, 24 FMAs");
    ROW(3, 8, "3 x 8: 8 loads, 3 broadcasts, 24 FMAs");
    ROW(8, 3, "8 x 3: 3 loads, 8 broadcasts, 24 FMAs");
    ROW(4, 4, "4 x 4: 4 loads, 4 broadcasts, 16 FMAs");
    ROW(2, 12, "2 x 12: 12 loads, 2 broadcasts, 24 FMAs");
    ROW(12, 2, "12 x 2: 2 loads, 12 broadcasts, 24 FMAs");
    printf("(%g)\n", (double)ss[0]);
    return 0;
}
