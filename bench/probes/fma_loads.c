/*
 * fma_loads.c -- how close an AVX-512 float32 FMA loop that reads its operands from L1
 * comes to the register-only FMA rate on this machine, outside fastattn: the numbers
 * behind bench/NOTEBOOK.md's "The float32 ceiling on the Xeon" section.  Not built by
 * setup.py; on an x86-64 machine with AVX-512F:
 *
 *   gcc -O3 -mavx512f -mfma bench/probes/fma_loads.c -o /tmp/fma_loads && taskset -c 1 /tmp/fma_loads
 *
 * Each line: GFLOP/s (best of 5) and its share of the first line.
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static float buf[4096] __attribute__((aligned(64)));
static float out[24 * 16] __attribute__((aligned(64)));

/* 24 accumulators, 6 "keys" x 4 "query vectors"; loads: 0 none (operands in registers),
 * 1 four vector loads and six broadcasts a step from an 8 KiB window of L1 */
__attribute__((noinline)) static void steps(long n, int loads)
{
    __m512 acc[24];
    for (int i = 0; i < 24; i++) acc[i] = _mm512_setzero_ps();
    __m512 q0 = _mm512_set1_ps(1e-9f), q1 = q0, q2 = q0, q3 = q0, kb = _mm512_set1_ps(1.0f);
    const float *p = buf;
    for (long i = 0; i < n; i++) {
        if (loads) {
            q0 = _mm512_load_ps(p);
            q1 = _mm512_load_ps(p + 16);
            q2 = _mm512_load_ps(p + 32);
            q3 = _mm512_load_ps(p + 48);
        }
        for (int r = 0; r < 6; r++) {
            if (loads)
                kb = _mm512_set1_ps(buf[2048 + r * 64 + (i & 63)]);
            else
                __asm__("" : "+v"(kb));
            acc[4 * r] = _mm512_fmadd_ps(kb, q0, acc[4 * r]);
            acc[4 * r + 1] = _mm512_fmadd_ps(kb, q1, acc[4 * r + 1]);
            acc[4 * r + 2] = _mm512_fmadd_ps(kb, q2, acc[4 * r + 2]);
            acc[4 * r + 3] = _mm512_fmadd_ps(kb, q3, acc[4 * r + 3]);
        }
        if (loads) p = buf + ((i + 1) & 31) * 64;
    }
    for (int i = 0; i < 24; i++) _mm512_store_ps(out + 16 * i, acc[i]);
}

/* fastattn's QK^T micro-kernel (kern_products.h fa_qk_micro at R = 6, NV = 4): keys
 * broadcast from K rows (k_sl = D), query vectors from Q^T rows (brp = nq), logits
 * stored; nq x nk logits over D features, every operand in L1 */
#define NQ 64
#define NK 60
#define DD 64
static float qt[DD * NQ] __attribute__((aligned(64)));
static float kk[NK * DD] __attribute__((aligned(64)));
static float ss[NK * NQ] __attribute__((aligned(64)));
__attribute__((noinline)) static void qk_tile(void)
{
    for (int cv = 0; cv < NQ / 16; cv += 4)
        for (int j = 0; j < NK; j += 6) {
            __m512 acc[6][4];
            for (int r = 0; r < 6; r++)
                for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
            for (int d = 0; d < DD; d++) {
                __m512 qv[4];
                for (int c = 0; c < 4; c++) qv[c] = _mm512_load_ps(qt + d * NQ + (cv + c) * 16);
                for (int r = 0; r < 6; r++) {
                    const __m512 kb = _mm512_set1_ps(kk[(j + r) * DD + d]);
                    for (int c = 0; c < 4; c++) acc[r][c] = _mm512_fmadd_ps(kb, qv[c], acc[r][c]);
                }
            }
            for (int r = 0; r < 6; r++)
                for (int c = 0; c < 4; c++) _mm512_store_ps(ss + (j + r) * NQ + (cv + c) * 16, acc[r][c]);
        }
}

int main(void)
{
    for (int i = 0; i < 4096; i++) buf[i] = 1e-6f;
    for (int i = 0; i < DD * NQ; i++) qt[i] = 1e-3f * (float)(i % 7);
    for (int i = 0; i < NK * DD; i++) kk[i] = 1e-3f * (float)(i % 5);
    const long n = 20000000;
    double g[3];
    const char *name[3] = {"24 FMAs a step, operands in registers",
                           "24 FMAs, 4 vector loads and 6 broadcasts a step (L1)",
                           "fastattn's QK^T micro-kernel 6 x 4, D = 64 (L1)"};
    for (int k = 0; k < 3; k++) {
        double best = 1e9, flops;
        const long reps = 20000;
        for (int run = 0; run < 5; run++) {
            const double t0 = now();
            if (k < 2)
                steps(n, k);
            else
                for (long i = 0; i < reps; i++) qk_tile();
            const double dt = now() - t0;
            if (dt < best) best = dt;
        }
        flops = k < 2 ? 2.0 * 16 * 24 * n : 2.0 * NQ * NK * DD * reps;
        g[k] = flops / best * 1e-9;
        printf("%-56s %7.1f GFLOP/s  %5.1f%%\n", name[k], g[k], 100.0 * g[k] / g[0]);
    }
    printf("(%g %g)\n", (double)out[0], (double)ss[0]);
    return 0;
}
