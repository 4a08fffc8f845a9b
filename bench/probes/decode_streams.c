/*
 * decode_streams.c -- how fast this machine's cores stream a decode cache's bytes
 * through the loops a decode runs, outside fastattn: the ceilings behind
 * bench/NOTEBOOK.md's "2026-12-07 (third session)" entry.  Not built by setup.py; on an
 * x86-64 machine with AVX-512F and F16C:
 *
 *   gcc -O2 -mavx512f -mf16c -mfma -fopenmp bench/probes/decode_streams.c -o /tmp/decode_streams
 *   OMP_PROC_BIND=true OMP_NUM_THREADS=2 /tmp/decode_streams 3072
 *
 * The argument: MiB read (1024 by default; make it several times the L3 to read memory).
 * The buffer is asked for on huge pages (madvise), as NumPy's large arrays and
 * fastattn.KVCache's storage are; each thread reads its own half (or, for the "pieces"
 * lines, alternate pieces), and each line is the best of 6 passes, in GB/s.  The loops:
 *
 *   f32 stream        float32 vectors FMA'd into four accumulators, in address order
 *   f16 stream        float16 vectors converted (vcvtph2ps) and FMA'd, in address order
 *   f16 lanes16       the order fastattn's QK^T reads a float16 KVCache of 16-key blocks
 *                     ([D][16] each, 4 KiB at D 128): four consecutive blocks at once,
 *                     32 bytes of each a feature, one accumulator a block
 *   f16 lanes64       the same 64 keys from one [D][64] block: 128 contiguous bytes a feature
 *   f32 lanes16       lanes16 for a float32 cache: four 8 KiB blocks, a line of each a feature
 *   +pf N             prefetcht1 of the bytes N ahead, a line for each one read (for
 *                     lanes16, 16K is one set of 64 keys ahead, as fastattn asks on Intel)
 *   K then V          a float16 decode's two streams as fastattn read them before
 *                     fa_pv_qk: K in the first half, V in the second; 64 keys of K in the
 *                     lanes16 order (16 KiB, +pf 16K), then the same 64 keys' V rows (256
 *                     bytes each, converted and FMA'd in order, prefetcht1 4 KiB ahead)
 *   K with V          the same bytes as fa_pv_qk reads them: each V row of a tile with
 *                     two features of the next tile's keys, both streams at once (V rows
 *                     prefetched 4 KiB ahead, keys not)
 *
 * A variant with no huge pages: NOHUGE=1 in the environment.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

enum { F32, F16, LANES16, LANES64, LANES16_F32, K_THEN_V, K_WITH_V };

static inline __m512 h2f(const char *a) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)a)); }

/* n bytes from a (a multiple of 32 KiB) in the loop's order; the four sums, added */
static float pass(const char *a, size_t n, int loop, long pf)
{
    const __m512 w = _mm512_set1_ps(1.0f);
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    if (loop == F32 || loop == F16) {
        for (size_t o = 0; o < n; o += 256) {
            if (pf)
                for (int l = 0; l < 4; l++) _mm_prefetch(a + o + pf + 64 * l, _MM_HINT_T1);
            if (loop == F32) {
                s0 = _mm512_fmadd_ps(_mm512_loadu_ps((const float *)(const void *)(a + o)), w, s0);
                s1 = _mm512_fmadd_ps(_mm512_loadu_ps((const float *)(const void *)(a + o + 64)), w, s1);
                s2 = _mm512_fmadd_ps(_mm512_loadu_ps((const float *)(const void *)(a + o + 128)), w, s2);
                s3 = _mm512_fmadd_ps(_mm512_loadu_ps((const float *)(const void *)(a + o + 192)), w, s3);
            } else
                for (int i = 0; i < 8; i += 4) {
                    s0 = _mm512_fmadd_ps(h2f(a + o + 32 * i), w, s0);
                    s1 = _mm512_fmadd_ps(h2f(a + o + 32 * i + 32), w, s1);
                    s2 = _mm512_fmadd_ps(h2f(a + o + 32 * i + 64), w, s2);
                    s3 = _mm512_fmadd_ps(h2f(a + o + 32 * i + 96), w, s3);
                }
        }
    } else if (loop == LANES16_F32) {
        for (size_t o = 0; o < n; o += 32768) {
            const char *set = a + o;
            for (int d = 0; d < 128; d++) {
                const __m512 q = _mm512_set1_ps(1.0f + (float)d * 0x1p-20f);
                s0 = _mm512_fmadd_ps(_mm512_loadu_ps((const float *)(const void *)(set + 64 * d)), q, s0);
                s1 = _mm512_fmadd_ps(_mm512_loadu_ps((const float *)(const void *)(set + 8192 + 64 * d)), q, s1);
                s2 = _mm512_fmadd_ps(_mm512_loadu_ps((const float *)(const void *)(set + 16384 + 64 * d)), q, s2);
                s3 = _mm512_fmadd_ps(_mm512_loadu_ps((const float *)(const void *)(set + 24576 + 64 * d)), q, s3);
            }
        }
    } else {
        /* a set of 64 keys x 128 features of float16: 16 KiB */
        const long g_off = loop == LANES16 ? 4096 : 32, d_off = loop == LANES16 ? 32 : 128;
        for (size_t o = 0; o < n; o += 16384) {
            const char *set = a + o;
            for (int d = 0; d < 128; d++) {
                const __m512 q = _mm512_set1_ps(1.0f + (float)d * 0x1p-20f);
                if (pf) {
                    _mm_prefetch(set + pf + 128 * d, _MM_HINT_T1);
                    _mm_prefetch(set + pf + 128 * d + 64, _MM_HINT_T1);
                }
                s0 = _mm512_fmadd_ps(h2f(set + d * d_off), q, s0);
                s1 = _mm512_fmadd_ps(h2f(set + g_off + d * d_off), q, s1);
                s2 = _mm512_fmadd_ps(h2f(set + 2 * g_off + d * d_off), q, s2);
                s3 = _mm512_fmadd_ps(h2f(set + 3 * g_off + d * d_off), q, s3);
            }
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
}

/* One feature d of 64 float16 keys in the lanes16 order (set: the 16 KiB of 4 blocks) */
#define LANES16_FEATURE(set, d)                                                                \
    do {                                                                                       \
        const __m512 q_ = _mm512_set1_ps(1.0f + (float)(d) * 0x1p-20f);                        \
        s0 = _mm512_fmadd_ps(h2f((set) + (d) * 32), q_, s0);                                   \
        s1 = _mm512_fmadd_ps(h2f((set) + 4096 + (d) * 32), q_, s1);                            \
        s2 = _mm512_fmadd_ps(h2f((set) + 8192 + (d) * 32), q_, s2);                            \
        s3 = _mm512_fmadd_ps(h2f((set) + 12288 + (d) * 32), q_, s3);                           \
    } while (0)
/* One V row of 128 float16 values times p into the eight accumulators o */
#define V_ROW(row, p)                                                                          \
    do {                                                                                       \
        _mm_prefetch((row) + 4096, _MM_HINT_T1);                                               \
        _mm_prefetch((row) + 4096 + 64, _MM_HINT_T1);                                          \
        _mm_prefetch((row) + 4096 + 128, _MM_HINT_T1);                                         \
        _mm_prefetch((row) + 4096 + 192, _MM_HINT_T1);                                         \
        for (int c_ = 0; c_ < 8; c_++) o[c_] = _mm512_fmadd_ps(h2f((row) + 32 * c_), (p), o[c_]); \
    } while (0)

/* n bytes of K at k and n of V at v (multiples of 16 KiB), a decode's two streams: K
 * then V a tile at a time, or (fused) a tile's V rows with the next tile's keys */
static float pass_kv(const char *k, const char *v, size_t n, int fused)
{
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, o[8];
    for (int c = 0; c < 8; c++) o[c] = s0;
    const __m512 p = _mm512_set1_ps(0x1p-30f);
    for (size_t t = 0; t < n; t += 16384) {
        const char *set = k + t, *vt = v + t;
        if (!fused) {
            for (int d = 0; d < 128; d++) {
                _mm_prefetch(set + 16384 + 128 * d, _MM_HINT_T1);
                _mm_prefetch(set + 16384 + 128 * d + 64, _MM_HINT_T1);
                LANES16_FEATURE(set, d);
            }
            for (int j = 0; j < 64; j++) V_ROW(vt + 256 * j, p);
            continue;
        }
        if (t == 0) /* the first tile's keys alone */
            for (int d = 0; d < 128; d++) LANES16_FEATURE(set, d);
        const char *next = set + 16384;
        const int more = t + 16384 < n;
        for (int j = 0; j < 64; j++) {
            V_ROW(vt + 256 * j, p);
            if (more) {
                LANES16_FEATURE(next, 2 * j);
                LANES16_FEATURE(next, 2 * j + 1);
            }
        }
    }
    for (int c = 0; c < 8; c++) s0 = _mm512_add_ps(s0, o[c]);
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
}

/* best GB/s of 6 passes; piece > 0: thread i reads pieces i, i + nt, ... of that size */
static double rate(const char *a, size_t n, int loop, long pf, size_t piece, float *sink)
{
    double best = 1e30;
    for (int r = 0; r < 6; r++) {
        float s = 0;
        const double t0 = now();
#pragma omp parallel reduction(+ : s)
        {
            const int i = omp_get_thread_num(), nt = omp_get_num_threads();
            if (loop == K_THEN_V || loop == K_WITH_V)
                s += pass_kv(a + (size_t)i * (n / 2 / nt), a + n / 2 + (size_t)i * (n / 2 / nt), n / 2 / nt,
                             loop == K_WITH_V);
            else if (piece)
                for (size_t o = (size_t)i * piece; o + piece <= n; o += (size_t)nt * piece) s += pass(a + o, piece, loop, pf);
            else
                s += pass(a + (size_t)i * (n / nt), n / nt, loop, pf);
        }
        const double t = now() - t0;
        if (t < best) best = t;
        *sink += s;
    }
    return n / best / 1e9;
}

int main(int argc, char **argv)
{
    const size_t mib = argc > 1 ? (size_t)atol(argv[1]) : 1024;
    const size_t n = mib << 20, extra = 1 << 22; /* (room for the prefetches past the end) */
    char *a = mmap(NULL, n + extra, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (a == MAP_FAILED) return 1;
    madvise(a, n + extra, getenv("NOHUGE") ? MADV_NOHUGEPAGE : MADV_HUGEPAGE);
    memset(a, 0, n + extra);
    float sink = 0;
    printf("%zu MiB, %d threads, %s pages\n", mib, omp_get_max_threads(), getenv("NOHUGE") ? "4 KiB" : "huge");
    printf("f32 stream          %5.1f GB/s\n", rate(a, n, F32, 0, 0, &sink));
    printf("f32 lanes16         %5.1f GB/s\n", rate(a, n, LANES16_F32, 0, 0, &sink));
    printf("f16 stream          %5.1f GB/s\n", rate(a, n, F16, 0, 0, &sink));
    printf("f16 stream +pf 4K   %5.1f GB/s\n", rate(a, n, F16, 4096, 0, &sink));
    printf("f16 stream +pf 16K  %5.1f GB/s\n", rate(a, n, F16, 16384, 0, &sink));
    printf("f16 lanes16         %5.1f GB/s\n", rate(a, n, LANES16, 0, 0, &sink));
    printf("f16 lanes16 +pf 8K  %5.1f GB/s\n", rate(a, n, LANES16, 8192, 0, &sink));
    printf("f16 lanes16 +pf 16K %5.1f GB/s\n", rate(a, n, LANES16, 16384, 0, &sink));
    printf("f16 lanes16 +pf 32K %5.1f GB/s\n", rate(a, n, LANES16, 32768, 0, &sink));
    printf("f16 lanes64         %5.1f GB/s\n", rate(a, n, LANES64, 0, 0, &sink));
    printf("f16 stream, 128 KiB pieces  %5.1f GB/s\n", rate(a, n, F16, 0, 128 << 10, &sink));
    printf("f16 stream, 1 MiB pieces    %5.1f GB/s\n", rate(a, n, F16, 0, 1 << 20, &sink));
    printf("f16 lanes16, 128 KiB pieces %5.1f GB/s\n", rate(a, n, LANES16, 0, 128 << 10, &sink));
    printf("f16 K then V        %5.1f GB/s\n", rate(a, n, K_THEN_V, 0, 0, &sink));
    printf("f16 K with V        %5.1f GB/s\n", rate(a, n, K_WITH_V, 0, 0, &sink));
    printf("(%g)\n", (double)sink);
    return 0;
}
