/*
 * fa_common.c -- what the driver files share: the OpenMP shim (every omp_* call goes
 * through it, and it builds without OpenMP), the record of how many threads ran the
 * last call, the build string, scratch allocation, the vector exp entry point, the
 * merge of partial rows (fastattn.merge and split-KV decoding) and the dropout
 * decisions.  Below every other driver file: it calls none of them.
 */
#if defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* sched_getcpu, sched_setaffinity and cpu_set_t (fa_spread) */
#endif
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "fa_driver.h"
#if defined(__linux__) && defined(_OPENMP)
#include <sched.h>
#define FA_SPREAD_CAN 1
#else
#define FA_SPREAD_CAN 0
#endif

/* ---- OpenMP shim: every omp_* call goes through here; builds without OpenMP. ---- */
#ifdef _OPENMP
#include <omp.h>
int fa_openmp_enabled(void) { return 1; }
int fa_max_threads(void) { return omp_get_max_threads(); }
int fa_thread_num(void) { return omp_get_thread_num(); }
#define FA_OPENMP_VERSION _OPENMP
#else
int fa_openmp_enabled(void) { return 0; }
int fa_max_threads(void) { return 1; }
int fa_thread_num(void) { return 0; }
#define FA_OPENMP_VERSION 0
#endif

/* How many threads ran the calling thread's last forward call (each thread of
 * the parallel region adds one), for tests that check num_threads,
 * OMP_NUM_THREADS and threadpoolctl really reach the kernel.  Thread-local: a
 * Python thread reads what its own last call did, whatever other threads run. */
_Thread_local int fa_last_threads = 0;
int fa_last_num_threads(void) { return fa_last_threads; }

/* ---- A call's threads on distinct CPUs (fa_spread) ----
 * Unbound (no OMP_PROC_BIND), a thread of the pool woken after a pause is often put
 * on the CPU of the thread that woke it, while another CPU of the process idles: on
 * a 2-vCPU KVM guest 25 of 40 calls after 30 ms pauses began with both threads on one
 * vCPU and took 5x as long (likely: a guest's idle vCPU is a halted one, which its
 * scheduler may count as busy).  The balancer moves one only a tick or more later, after a short
 * call has ended.  So at a region's start each thread claims the CPU it runs on; one
 * that finds its CPU claimed by another thread of the call claims a free CPU of its own
 * affinity mask, moves there (pinned to it alone) and gets its mask back at once, which
 * leaves it there.  No thread's mask is changed after the call, none moves where the
 * threads are bound (libgomp's binding, or a mask of one CPU), and no bit depends on
 * where a thread runs.  FASTATTN_SPREAD=0 (read once) or fa_set_spread(0) turns it off. */
static int fa_spread_mode = -1; /* -1: not yet read from FASTATTN_SPREAD; 0 off; 1 on */
static long fa_spread_total = 0; /* threads moved since the library loaded */
long fa_spread_moves(void) { return __atomic_load_n(&fa_spread_total, __ATOMIC_RELAXED); }

int fa_set_spread(int mode)
{
    if (mode < -1 || mode > 1) return FA_ERR_ARG;
    __atomic_store_n(&fa_spread_mode, mode, __ATOMIC_RELAXED);
    return FA_OK;
}

static int fa_spread_on(void)
{
#if FA_SPREAD_CAN
    int m = __atomic_load_n(&fa_spread_mode, __ATOMIC_RELAXED);
    if (m < 0) {
        const char *e = getenv("FASTATTN_SPREAD");
        m = !(e && strcmp(e, "0") == 0);
        __atomic_store_n(&fa_spread_mode, m, __ATOMIC_RELAXED);
    }
    return m && omp_get_proc_bind() == omp_proc_bind_false;
#else
    return 0;
#endif
}

/* Claim cpu for this call: 1 if it was free. */
static int fa_spread_claim(fa_spread *sp, int cpu)
{
    const uint64_t bit = (uint64_t)1 << (cpu & 63);
    return !(__atomic_fetch_or(&sp->claimed[cpu >> 6], bit, __ATOMIC_RELAXED) & bit);
}

void fa_spread_begin(fa_spread *sp, int nth)
{
    memset(sp, 0, sizeof *sp);
    sp->nth = nth;
    sp->on = nth > 1 && fa_spread_on();
#if FA_SPREAD_CAN
    if (!sp->on) return;
    const int cpu = sched_getcpu();
    sp->home = cpu;
    if (cpu >= 0 && cpu < FA_SPREAD_MAX) fa_spread_claim(sp, cpu);
    else sp->on = 0;
#endif
}

#if FA_SPREAD_CAN
/* The calling thread pinned to cpu alone (the kernel moves it there before returning),
 * then given its mask `own` back, which leaves it there: the CPU it ran on between the
 * two (cpu), or -1 where it could not be pinned. */
static int fa_move_to(int cpu, const cpu_set_t *own)
{
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    if (sched_setaffinity(0, sizeof one, &one) != 0) return -1;
    const int now = sched_getcpu();
    sched_setaffinity(0, sizeof *own, own);
    return now;
}
#endif

int fa_spread_join(fa_spread *sp)
{
#if FA_SPREAD_CAN
    if (!sp->on) return -1;
    const int cpu = sched_getcpu();
    if (fa_thread_num() == 0) {
        /* Its CPU was claimed in fa_spread_begin.  A thread woken onto this CPU waits
         * here, under the scheduler's run-to-parity, until this one's slice ends (up
         * to ~1.5 ms: the moved calls took 0.5-1.5 ms longer than the others); so
         * while some have not joined, give them the CPU once (a few hundred ns where
         * nothing waits) */
        if (__atomic_load_n(&sp->joined, __ATOMIC_ACQUIRE) < sp->nth - 1) sched_yield();
        return cpu;
    }
    int now = cpu;
    if (cpu >= 0 && cpu < FA_SPREAD_MAX && !fa_spread_claim(sp, cpu)) {
        cpu_set_t own;
        if (sched_getaffinity(0, sizeof own, &own) == 0)
            for (int c = 0; c < FA_SPREAD_MAX; c++) {
                if (c == cpu || !CPU_ISSET(c, &own) || !fa_spread_claim(sp, c)) continue;
                const int moved_to = fa_move_to(c, &own);
                if (moved_to >= 0) {
                    now = moved_to;
                    __atomic_fetch_add(&sp->moved, 1, __ATOMIC_RELAXED);
                    __atomic_fetch_add(&fa_spread_total, 1, __ATOMIC_RELAXED);
                }
                break;
            }
    }
    __atomic_fetch_add(&sp->joined, 1, __ATOMIC_RELEASE);
    return now;
#else
    (void)sp;
    return -1;
#endif
}

int fa_spread_probe(int nth, int herd, int *start, int *joined, int *moved)
{
    if (nth < 1 || nth > FA_SPREAD_MAX) return FA_ERR_ARG;
    fa_spread sp;
    fa_spread_begin(&sp, nth);
#if FA_SPREAD_CAN
    const int master = sp.on ? sp.home : sched_getcpu();
#endif
    int ran = 0;
#pragma omp parallel num_threads(nth) reduction(+ : ran)
    {
        const int t = fa_thread_num();
        ran += 1;
#if FA_SPREAD_CAN
        /* herd: each other thread onto the calling thread's CPU first (its mask then
         * given back), as the scheduler's wake-ups put them */
        cpu_set_t own;
        if (herd && t > 0 && master >= 0 && sched_getaffinity(0, sizeof own, &own) == 0 && CPU_ISSET(master, &own))
            fa_move_to(master, &own);
        start[t] = t == 0 ? master : sched_getcpu(); /* (the calling thread's: the CPU it claimed) */
#else
        start[t] = -1;
#endif
        joined[t] = fa_spread_join(&sp);
    }
    *moved = sp.moved;
    return ran;
}

#define FA_STR2(x) #x
#define FA_STR(x) FA_STR2(x)

const char *fa_build_info(void)
{
    return "compiler="
#if defined(__clang__)
           "clang "
#elif defined(__GNUC__)
           "gcc "
#endif
#ifdef __VERSION__
           __VERSION__
#endif
           "; openmp=" FA_STR(FA_OPENMP_VERSION);
}

void *fa_scratch_alloc(size_t bytes)
{
    size_t n = (bytes + FA_ALIGN - 1) / FA_ALIGN * FA_ALIGN;
    return aligned_alloc(FA_ALIGN, n ? n : FA_ALIGN);
}

/* One buffer kept between calls for the blocks a call's items share (fa_forward.c):
 * a fresh one of 16 MiB (float16 B1 H8 L4096 D64's float32 K and V) was the kernel's
 * page faults, 6.5% of the call's samples (clear_page), more than the conversions it
 * saves.  One call at a time holds it (taken and given back atomically); a concurrent
 * call, or one needing more than FA_KEEP_BYTES, allocates its own and frees it. */
#define FA_KEEP_BYTES ((size_t)64 << 20)
static char *fa_kept;
static size_t fa_kept_bytes;
static int fa_kept_busy;

void *fa_shared_take(size_t bytes, int *kept)
{
    *kept = 0;
    if (bytes <= FA_KEEP_BYTES && !__atomic_exchange_n(&fa_kept_busy, 1, __ATOMIC_ACQUIRE)) {
        if (fa_kept_bytes < bytes) {
            free(fa_kept);
            fa_kept = (char *)fa_scratch_alloc(bytes);
            fa_kept_bytes = fa_kept ? bytes : 0;
        }
        if (fa_kept) {
            *kept = 1;
            return fa_kept;
        }
        __atomic_store_n(&fa_kept_busy, 0, __ATOMIC_RELEASE);
    }
    return fa_scratch_alloc(bytes);
}

void fa_shared_give(void *buf, int kept)
{
    if (kept)
        __atomic_store_n(&fa_kept_busy, 0, __ATOMIC_RELEASE);
    else
        free(buf);
}

void fa_bf16_to_f32(const uint16_t *src, uint32_t *dst, int64_t n, int nthreads)
{
    const int64_t block = (int64_t)1 << 16; /* values a task: 256 KiB written */
    const int64_t nb = (n + block - 1) / block;
    int nth = nthreads > 0 ? nthreads : fa_max_threads();
    if ((int64_t)nth > nb) nth = (int)(nb > 0 ? nb : 1);
#pragma omp parallel for num_threads(nth) if (nth > 1) schedule(static)
    for (int64_t b = 0; b < nb; b++) {
        const int64_t i1 = (b + 1) * block < n ? (b + 1) * block : n;
        for (int64_t i = b * block; i < i1; i++) dst[i] = (uint32_t)src[i] << 16;
    }
}

int fa_exp_array(int isa, int dtype, const void *x, void *y, int64_t n, int logit)
{
    const fa_kernel *kern = fa_kernel_for_isa(isa);
    if (!kern || !(fa_cpu_supported_isas() & (1u << isa))) return FA_ERR_ARG;
    if (dtype != FA_F32 && dtype != FA_F64) return FA_ERR_ARG;
    kern->exp_array[dtype](x, y, n, logit);
    return FA_OK;
}

/* The FMA peak: nthreads threads each run the kernel's FMA chains (fa_fma_chains)
 * between two barriers; the rounds double until one takes 20 ms, then the best of
 * five such rounds.  *gflops = 2 * chains * lanes * iters * threads / seconds, from
 * the threads that really ran (1 without OpenMP). */
volatile double fa_peak_sink; /* the chains' sums are stored: the loops are kept */

/* Seconds on a monotonic clock.  (The wall clock's seconds since 1970 as a double keep
 * time only to 2^-22 s, about 0.24 us: a short read pass measured 0 s.) */
static double fa_seconds(void)
{
    struct timespec ts;
#ifdef CLOCK_MONOTONIC
    clock_gettime(CLOCK_MONOTONIC, &ts);
#else
    timespec_get(&ts, TIME_UTC);
#endif
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The best of five timed rounds of `chains` on nthreads threads (each round about
 * 20 ms once the iteration count has grown to it), per_iter flops an iteration. */
static double fa_time_chains(fa_peak_fn chains, double per_iter, int nthreads)
{
    int64_t iters = 1 << 12;
    double best = 0.0;
    for (int timed = 0, round = 0; timed < 5 && round < 40; round++) {
        double t0 = 0.0, t1 = 0.0, s = 0.0;
        int ran = 0;
        fa_spread sp;
        fa_spread_begin(&sp, nthreads);
#pragma omp parallel num_threads(nthreads) reduction(+ : s, ran)
        {
            fa_spread_join(&sp);
#pragma omp barrier
#pragma omp master
            t0 = fa_seconds();
            s += chains(iters, 0.999, 1e-3);
            ran += 1;
#pragma omp barrier
#pragma omp master
            t1 = fa_seconds();
        }
        fa_peak_sink = s;
        if (t1 - t0 < 0.02 && timed == 0 && iters < ((int64_t)1 << 32)) {
            iters *= 2;
            continue;
        }
        const double rate = per_iter * (double)iters * ran / (t1 - t0) / 1e9;
        if (rate > best) best = rate;
        timed++;
    }
    return best;
}

int fa_fma_peak(int isa, int dtype, int nthreads, double *gflops)
{
    const fa_kernel *kern = fa_kernel_for_isa(isa);
    if (!kern || !(fa_cpu_supported_isas() & (1u << isa))) return FA_ERR_ARG;
    if ((dtype != FA_F32 && dtype != FA_F64) || nthreads < 1 || !gflops) return FA_ERR_ARG;
    *gflops = fa_time_chains(kern->fma_chains[dtype], 2.0 * FA_PEAK_CHAINS * kern->lanes[dtype], nthreads);
    return FA_OK;
}

int fa_bf16_peak(int path, int nthreads, double *gflops)
{
    if (nthreads < 1 || !gflops || !(fa_bf16_paths() & (1u << path))) return FA_ERR_ARG;
    const fa_bf16_kernel *bk = fa_bf16_kernel_for_path(path);
    if (!bk) return FA_ERR_ARG;
    *gflops = fa_time_chains(bk->dp_chains, bk->round_flops, nthreads);
    return FA_OK;
}

/* The read bandwidth: nthreads threads each read their share of the n elements of buf
 * (FA_READ_STREAMS runs side by side, fa_read_streams) between two barriers; a first
 * untimed pass, then the best of `passes`.  *bytes: what a pass reads (each thread's
 * share rounded down to FA_READ_STREAMS x FA_READ_STEP elements), *seconds: the best
 * pass, *sum: the sum of what the best pass read. */
int fa_read_bandwidth(int isa, int dtype, const void *buf, int64_t n, int nthreads, int passes,
                      int64_t *bytes, double *seconds, double *sum)
{
    const fa_kernel *kern = fa_kernel_for_isa(isa);
    if (!kern || !(fa_cpu_supported_isas() & (1u << isa))) return FA_ERR_ARG;
    if ((dtype != FA_F32 && dtype != FA_F64) || nthreads < 1 || passes < 1 || n < 0 || !buf)
        return FA_ERR_ARG;
    const size_t item = dtype == FA_F64 ? sizeof(double) : sizeof(float);
    const int64_t unit = (int64_t)FA_READ_STREAMS * FA_READ_STEP;
    const fa_read_fn read = kern->read_streams[dtype];
    double best = 0.0, best_sum = 0.0;
    int64_t share = 0;
    int ran_threads = 1;
    for (int pass = 0; pass <= passes; pass++) {
        double t0 = 0.0, t1 = 0.0, s = 0.0;
        int ran = 0;
        fa_spread sp;
        fa_spread_begin(&sp, nthreads);
#pragma omp parallel num_threads(nthreads) reduction(+ : s, ran)
        {
            fa_spread_join(&sp);
            int nt = 1, t = 0;
#ifdef _OPENMP
            nt = omp_get_num_threads();
            t = omp_get_thread_num();
#endif
            const int64_t per = n / nt / unit * unit;
#pragma omp barrier
#pragma omp master
            t0 = fa_seconds();
            s += read((const char *)buf + (size_t)(t * per) * item, per / FA_READ_STREAMS,
                      per / FA_READ_STREAMS);
            ran += 1;
#pragma omp barrier
#pragma omp master
            {
                t1 = fa_seconds();
                share = per;
            }
        }
        if (pass == 0) continue; /* first touch of the pages' translations */
        if (best == 0.0 || t1 - t0 < best) {
            best = t1 - t0;
            best_sum = s;
            ran_threads = ran;
        }
    }
    *bytes = share * ran_threads * (int64_t)item;
    *seconds = best;
    *sum = best_sum;
    return FA_OK;
}

/* One merged row: parts in index order, part q's row at out + q*ostride, its lse at
 * lse[q*lstride] (the online merge of fa_internal.h). */
#define FA_MERGE_ROW(NAME, T, SUF)                                                           \
    void NAME(int64_t parts, int64_t dv, const T *out, int64_t ostride, const T *lse,  \
                     int64_t lstride, T *dst, T *dst_lse)                                   \
    {                                                                                       \
        T M = -(T)INFINITY, tot = 0;                                                        \
        for (int64_t q = 0; q < parts; q++)                                                 \
            fa_merge_step_##SUF(&M, &tot, dst, lse[q * lstride], out + q * ostride, dv);    \
        *dst_lse = fa_merge_finish_##SUF(M, tot, dst, dv);                                  \
    }
FA_MERGE_ROW(fa_merge_row_f32, float, f32)
FA_MERGE_ROW(fa_merge_row_f64, double, f64)

int fa_merge(int dtype, int64_t parts, int64_t rows, int64_t dv, const void *outs,
             const void *lses, void *out, void *lse)
{
    if (parts < 1 || rows < 0 || dv < 0) return FA_ERR_ARG;
    for (int64_t r = 0; r < rows; r++) {
        if (dtype == FA_F32)
            fa_merge_row_f32(parts, dv, (const float *)outs + r * dv, rows * dv, (const float *)lses + r,
                             rows, (float *)out + r * dv, (float *)lse + r);
        else if (dtype == FA_F64)
            fa_merge_row_f64(parts, dv, (const double *)outs + r * dv, rows * dv,
                             (const double *)lses + r, rows, (double *)out + r * dv, (double *)lse + r);
        else
            return FA_ERR_ARG;
    }
    return FA_OK;
}

/* ---- dropout (the generator is fa_dropout_row in fa_internal.h) ---- */
uint32_t fa_dropout_threshold(double p)
{
    if (!(p > 0)) return 0;
    const double t = p * 4294967296.0; /* exact: a power-of-two multiply */
    return t >= 4294967295.0 ? 0xFFFFFFFFu : (uint32_t)t;
}

int fa_dropout_keep(uint64_t seed, uint32_t threshold, int64_t b, int64_t h, int64_t i, int64_t j)
{
    uint8_t keep;
    fa_dropout_row(seed, threshold, b, h, i, j, 1, &keep, 1);
    return keep;
}
