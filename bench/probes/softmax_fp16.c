/* The AMX row block's softmax pass (32 logits a step: y = s c - m, p = 2^y, the lane
 * sums, P rounded to bfloat16), as src_c/kern_amx_rows.h does it in float32, against the
 * same pass with 2^y in AVX512-FP16 (32 lanes a vector: y converted to float16, vreduceph,
 * a degree-3 polynomial, vscalefph, float16 subnormals kept down to 2^-24, p converted back
 * to float32 for the sums and to bfloat16 for P).  Prints ns a logit (1 thread, best of 15,
 * a 1024-key row in L1, three runs) and the error of the row sum and of the bfloat16 P
 * against 2^y in double.  Needs a CPU with AVX512-FP16 and AVX512-BF16 (Sapphire Rapids on):
 *   gcc -O2 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mavx512fp16 softmax_fp16.c -o sm -lm
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#define N 1024
static float s[N] __attribute__((aligned(64)));
static uint16_t pr[N] __attribute__((aligned(64)));
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static inline __m512 exp2_f32(__m512 y)
{
    const __mmask16 live = _mm512_cmp_ps_mask(y, _mm512_set1_ps(-125.0f), _CMP_NLT_UQ);
    const __m512 f = _mm512_reduce_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(_mm512_set1_ps(0.013534137047827244f), f, _mm512_set1_ps(0.05201148986816406f));
    r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(0.24144276976585388f));
    r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(0.6930038332939148f));
    r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(1.0000026226043701f));
    return _mm512_maskz_scalef_ps(live, r, y);
}
__attribute__((noinline)) static __m512 pass_f32(float c, float nm)
{
    const __m512 cv = _mm512_set1_ps(c), nv = _mm512_set1_ps(nm);
    __m512 s0 = _mm512_setzero_ps(), s1 = s0;
    for (int v = 0; v < N / 16; v += 2) {
        __m512 p0 = exp2_f32(_mm512_fmadd_ps(_mm512_load_ps(s + 16 * v), cv, nv));
        __m512 p1 = exp2_f32(_mm512_fmadd_ps(_mm512_load_ps(s + 16 * v + 16), cv, nv));
        s0 = _mm512_add_ps(s0, p0);
        s1 = _mm512_add_ps(s1, p1);
        _mm512_store_si512(pr + 16 * v, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    return _mm512_add_ps(s0, s1);
}
/* 2^f on [0,1), degree 3 (about float16's precision) */
__attribute__((noinline)) static __m512 pass_fp16(float c, float nm)
{
    const __m512 cv = _mm512_set1_ps(c), nv = _mm512_set1_ps(nm);
    __m512 s0 = _mm512_setzero_ps(), s1 = s0;
    for (int v = 0; v < N / 16; v += 2) {
        __m512 y0 = _mm512_fmadd_ps(_mm512_load_ps(s + 16 * v), cv, nv);
        __m512 y1 = _mm512_fmadd_ps(_mm512_load_ps(s + 16 * v + 16), cv, nv);
        __m512h yh = _mm512_castsi512_ph(_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_castph_si256(_mm512_cvtxps_ph(y0))),
                                                            _mm256_castph_si256(_mm512_cvtxps_ph(y1)), 1));
        __mmask32 live = _mm512_cmp_ph_mask(yh, _mm512_set1_ph((_Float16)-24.0f), _CMP_NLT_UQ);
        __m512h f = _mm512_reduce_ph(yh, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        __m512h r = _mm512_fmadd_ph(_mm512_set1_ph((_Float16)0.0790209f), f, _mm512_set1_ph((_Float16)0.2249412f));
        r = _mm512_fmadd_ph(r, f, _mm512_set1_ph((_Float16)0.6960656f));
        r = _mm512_fmadd_ph(r, f, _mm512_set1_ph((_Float16)0.9999252f));
        r = _mm512_maskz_scalef_ph(live, r, yh);
        __m512 p0 = _mm512_cvtxph_ps(_mm256_castsi256_ph(_mm512_castsi512_si256(_mm512_castph_si512(r))));
        __m512 p1 = _mm512_cvtxph_ps(_mm256_castsi256_ph(_mm512_extracti64x4_epi64(_mm512_castph_si512(r), 1)));
        s0 = _mm512_add_ps(s0, p0);
        s1 = _mm512_add_ps(s1, p1);
        _mm512_store_si512(pr + 16 * v, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    return _mm512_add_ps(s0, s1);
}
static double hsum(__m512 x) { float t[16]; _mm512_storeu_ps(t, x); double a = 0; for (int i = 0; i < 16; i++) a += t[i]; return a; }
int main(void)
{
    srand(1);
    const float c = 0.125f * 1.4426950408889634f;
    for (int i = 0; i < N; i++) s[i] = 40.0f * ((float)rand() / RAND_MAX) - 48.0f; /* y in about [-9.7, 0.1] after c */
    float mx = -INFINITY;
    for (int i = 0; i < N; i++) mx = fmaxf(mx, s[i] * c);
    const float nm = -mx;
    double exact = 0, worst[2] = {0, 0}, sums[2];
    for (int i = 0; i < N; i++) exact += exp2(fma((double)s[i], c, nm));
    for (int k = 0; k < 2; k++) {
        sums[k] = hsum(k ? pass_fp16(c, nm) : pass_f32(c, nm));
        /* the bfloat16 P against 2^y (its rounding included) */
        for (int i = 0; i < N; i++) {
            union { uint32_t u; float f; } b = {.u = (uint32_t)pr[i] << 16};
            double e = exp2(fma((double)s[i], c, nm));
            double r = fabs(b.f - e) / e;
            if (r > worst[k]) worst[k] = r;
        }
    }
    for (int rep = 0; rep < 3; rep++) {
        double best[2] = {1e9, 1e9};
        for (int t = 0; t < 15; t++)
            for (int k = 0; k < 2; k++) {
                double t0 = now();
                for (int it = 0; it < 2000; it++) { __m512 r = k ? pass_fp16(c, nm) : pass_f32(c, nm); __asm__ volatile("" ::"v"(r)); }
                double d = (now() - t0) / 2000 / N * 1e9;
                if (d < best[k]) best[k] = d;
            }
        printf("ns a logit: float32 %.4f  fp16 %.4f  (fp16/f32 %.3f)\n", best[0], best[1], best[1] / best[0]);
    }
    printf("row sum rel error: float32 %.2e  fp16 %.2e; worst bf16 P rel error: float32 %.2e fp16 %.2e\n",
           fabs(sums[0] - exact) / exact, fabs(sums[1] - exact) / exact, worst[0], worst[1]);
    return 0;
}
