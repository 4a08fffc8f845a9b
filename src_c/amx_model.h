/*
 * amx_model.h -- a software model of the AMX tile operations that kernels_amx.c uses,
 * for the test build only (FA_EMULATE_AMX: setup.py under FASTATTN_EMULATE_BF16=1), so
 * the AMX kernel's own source (its packing, tile shapes, tails and variants) runs
 * against the oracle on a CPU without AMX.  Never shipped.
 *
 * The state of each thread: a palette-1 configuration (rows and bytes a row of each of
 * the 8 tiles) and the 8 tiles of 16 rows x 64 bytes.  As the hardware does:
 *   load config  palette 1 only; every tile zeroed; rows <= 16, colsb <= 64, colsb a
 *                multiple of 4
 *   tile load    rows x colsb bytes read from base + r * stride, the rest of the tile
 *                zeroed (the model reads exactly those bytes, so the guard-page harness
 *                and the sanitizers see any load past an array)
 *   tile store   rows x colsb bytes written
 *   tdpbf16ps    C[m][n] += A[m][2k] B[k][2n] + A[m][2k+1] B[k][2n+1] over the pairs k
 *                of A's row, in order of k, each pair by fa_model_pair_fma
 *                (bf16_model.h: even product first, one rounding each, denormals
 *                flushed): the Intrinsics Guide's pseudo-code.  Intel's SDM describes
 *                the hardware's sums in another order, so the model's bits and a real
 *                AMX unit's may differ in the last place; the tests hold both to the
 *                oracle with the same tolerance.
 * A use the hardware would fault on (no configuration, shapes that do not agree, a
 * tile number past 7) aborts with a message: a kernel bug, never a user's error.
 */
#ifndef FA_AMX_MODEL_H
#define FA_AMX_MODEL_H
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "bf16_model.h"

typedef struct fa_amx_state {
    int configured;
    uint16_t colsb[8];
    uint8_t rows[8];
    uint8_t data[8][16][64];
} fa_amx_state;

static __thread fa_amx_state fa_amx_tiles;
static long fa_amx_dp_count; /* tdpbf16ps run, all threads (fa_amx_model_ops) */

static void fa_amx_fault(const char *what, int t)
{
    fprintf(stderr, "fastattn: AMX model: %s (tile %d)\n", what, t);
    abort();
}

static void fa_amx_check(int t)
{
    if (t < 0 || t > 7) fa_amx_fault("tile number out of range", t);
    if (!fa_amx_tiles.configured) fa_amx_fault("tile used with no configuration loaded", t);
}

static void fa_amx_loadconfig(const void *cfg)
{
    const uint8_t *c = (const uint8_t *)cfg;
    if (c[0] != 1) fa_amx_fault("palette other than 1", -1);
    if (c[1] != 0) fa_amx_fault("start_row other than 0", -1);
    for (int t = 0; t < 8; t++) {
        uint16_t cb;
        memcpy(&cb, c + 16 + 2 * t, sizeof cb);
        const uint8_t r = c[48 + t];
        if (cb > 64 || cb % 4 || r > 16 || (cb == 0) != (r == 0)) fa_amx_fault("bad tile shape", t);
        fa_amx_tiles.colsb[t] = cb;
        fa_amx_tiles.rows[t] = r;
    }
    memset(fa_amx_tiles.data, 0, sizeof fa_amx_tiles.data);
    fa_amx_tiles.configured = 1;
}

static void fa_amx_release(void)
{
    memset(&fa_amx_tiles, 0, sizeof fa_amx_tiles);
}

static void fa_amx_zero(int t)
{
    fa_amx_check(t);
    memset(fa_amx_tiles.data[t], 0, sizeof fa_amx_tiles.data[t]);
}

static void fa_amx_loadd(int t, const void *base, int64_t stride)
{
    fa_amx_check(t);
    memset(fa_amx_tiles.data[t], 0, sizeof fa_amx_tiles.data[t]);
    for (int r = 0; r < fa_amx_tiles.rows[t]; r++)
        memcpy(fa_amx_tiles.data[t][r], (const char *)base + r * stride, fa_amx_tiles.colsb[t]);
}

static void fa_amx_stored(int t, void *base, int64_t stride)
{
    fa_amx_check(t);
    for (int r = 0; r < fa_amx_tiles.rows[t]; r++)
        memcpy((char *)base + r * stride, fa_amx_tiles.data[t][r], fa_amx_tiles.colsb[t]);
}

static void fa_amx_dpbf16ps(int c, int a, int b)
{
    fa_amx_check(c);
    fa_amx_check(a);
    fa_amx_check(b);
    const fa_amx_state *s = &fa_amx_tiles;
    if (c == a || c == b || a == b) fa_amx_fault("tdpbf16ps with a tile used twice", c);
    if (s->rows[a] != s->rows[c] || s->colsb[b] != s->colsb[c] || s->rows[b] != s->colsb[a] / 4)
        fa_amx_fault("tdpbf16ps shapes do not agree", c);
    const int M = s->rows[c], N = s->colsb[c] / 4, K = s->colsb[a] / 4;
    __atomic_add_fetch(&fa_amx_dp_count, 1, __ATOMIC_RELAXED);
    /* a row of C at once, 16 lanes (the tile row's 64 bytes; lanes past N computed on
     * whatever they hold and not stored), pair k of A's row m against B's row k, k in
     * order: each C[m][n] sees the chain of fa_model_pair_fma over k, as the scalar
     * model adds it (fa_model_pair_fma8's lanes are that function's operations) */
    for (int m = 0; m < M; m++) {
        float acc[16];
        memcpy(acc, fa_amx_tiles.data[c][m], sizeof acc);
        __m256 lo = _mm256_loadu_ps(acc), hi = _mm256_loadu_ps(acc + 8);
        for (int k = 0; k < K; k++) {
            uint32_t x;
            memcpy(&x, s->data[a][m] + 4 * k, sizeof x);
            const __m256i xa = _mm256_set1_epi32((int)x);
            lo = fa_model_pair_fma8(lo, xa, _mm256_loadu_si256((const __m256i *)(const void *)s->data[b][k]));
            hi = fa_model_pair_fma8(hi, xa, _mm256_loadu_si256((const __m256i *)(const void *)(s->data[b][k] + 32)));
        }
        _mm256_storeu_ps(acc, lo);
        _mm256_storeu_ps(acc + 8, hi);
        memcpy(fa_amx_tiles.data[c][m], acc, 4 * (size_t)N);
    }
}

#endif /* FA_AMX_MODEL_H */
