/*
 * fa_driver.h -- what the driver files share.  fa_common.c (the OpenMP shim, the
 * thread count record, the row merge, scratch) is below all of them, fa_plan.c below
 * the three entry points (fa_forward.c, fa_backward.c, fa_mass.c), which call neither
 * each other nor anything above them: no two files call each other in a circle.
 */
#ifndef FA_DRIVER_H
#define FA_DRIVER_H

#include "fa_internal.h"

/* ---- fa_common.c ---- */
int fa_thread_num(void); /* omp_get_thread_num(), or 0 without OpenMP */
/* How many threads ran the calling thread's last call (each thread of its parallel
 * region adds one); fa_last_num_threads reads it. */
extern _Thread_local int fa_last_threads;
void *fa_scratch_alloc(size_t bytes); /* FA_ALIGN-aligned; free() it */
/* A call's threads on distinct CPUs where they are not bound (fa_common.c): the calling
 * thread fa_spread_begin before its parallel region, each thread of the region
 * fa_spread_join first (the CPU it runs on after, or -1 where it is off). */
#define FA_SPREAD_MAX 1024
typedef struct fa_spread {
    uint64_t claimed[FA_SPREAD_MAX / 64]; /* the CPUs the call's threads hold */
    int on, nth, moved, joined; /* joined: the other threads past fa_spread_join */
    int home;                   /* the calling thread's CPU, claimed in fa_spread_begin */
} fa_spread;
void fa_spread_begin(fa_spread *sp, int nth);
int fa_spread_join(fa_spread *sp);
/* The buffer of a call's shared blocks: the one kept between calls where it is free and
 * large enough (*kept 1), else a new one; fa_shared_give returns or frees it. */
void *fa_shared_take(size_t bytes, int *kept);
void fa_shared_give(void *buf, int kept);
/* One merged row: parts in index order, part q's row at out + q*ostride, its lse at
 * lse[q*lstride] (fa_merge_step of fa_internal.h). */
void fa_merge_row_f32(int64_t parts, int64_t dv, const float *out, int64_t ostride,
                      const float *lse, int64_t lstride, float *dst, float *dst_lse);
void fa_merge_row_f64(int64_t parts, int64_t dv, const double *out, int64_t ostride,
                      const double *lse, int64_t lstride, double *dst, double *dst_lse);

/* Key blocks in one item of the backward's dK/dV pass (fa_backward.c) and of key
 * mass (fa_mass.c). */
#define FA_BWD_CHUNK 4

/* ---- fa_plan.c ---- */
/* How a call is cut into work items (see fa_item). */
typedef struct fa_plan {
    fa_blocks bl;     /* bl.q: rows of an item rounded up to the vector width */
    int64_t G;        /* query heads per key/value head                      */
    int64_t nh;       /* query heads stacked in one item                     */
    int64_t nhc;      /* head chunks per key/value head: ceil(G / nh)        */
    int64_t nqp;      /* positions per item and head                         */
    int64_t per_seq;  /* fixed lengths: items per sequence                   */
    int64_t *start;   /* varlen: first item of each sequence (B+1), or NULL  */
    int64_t items;
    int head_major;   /* items in fa_head_item's order (fa_item_of)          */
} fa_plan;

int fa_check(const fa_params *p); /* FA_OK, or FA_ERR_ARG for params no kernel accepts */
int64_t fa_seq_len(const int64_t *cu, int64_t b, int64_t fixed);
int64_t fa_key_len(const fa_params *p, int64_t b); /* the keys sequence b sees */
int64_t fa_max_key_len(const fa_params *p);       /* the most any sequence sees */
int64_t fa_max_seq_len(const int64_t *cu, int64_t B, int64_t fixed);
/* The plan of a call (pl->start, when set, is the caller's to free).  nth > 1: the
 * forward's thread count, for which the query blocks may be cut smaller (never the
 * key blocks: no result changes); 0 or 1 keeps the default blocks. */
int fa_make_plan(const fa_kernel *kern, const fa_params *p, int nth, fa_plan *pl);
int64_t fa_chunk_keys(const fa_kernel *kern, const fa_params *p);
/* Does a forward call on `kern` take the bfloat16 pair products (fa_bf16_kernel):
 * q, k and v bfloat16, and a bfloat16 path selected that runs from `kern` (avx512's
 * pairs or tiles, an AArch64 kernel's BFDOT)? */
int fa_bf16_pairs(const fa_kernel *kern, const fa_params *p);
/* The bfloat16 kernel of the selected path for calls on `kern`, or NULL (fa_plan.c). */
const fa_bf16_kernel *fa_bf16_kernel_of(const fa_kernel *kern);
/* The bfloat16 backward for this call (a bfloat16 path selected, bp->bf16, float32, on
 * the kernel fa_bf16_pairs takes): the selected path's kernel (pairs or AMX tiles), or
 * NULL. */
const fa_bf16_kernel *fa_bf16_bwd_kernel(const fa_kernel *kern, const fa_bwd_params *bp);
/* The item for query block qb of head chunk hc of kv head g in sequence b. */
void fa_item_make(const fa_params *p, const fa_plan *pl, int64_t b, int64_t g, int64_t hc,
                  int64_t qb, fa_item *it);
int64_t fa_qblocks(const fa_params *p, const fa_plan *pl, int64_t b);
void fa_item_of(const fa_params *p, const fa_plan *pl, int64_t t, fa_item *it); /* item t */
size_t fa_store_item(const fa_params *p, int store); /* bytes per element stored as store */
size_t fa_kv_item(const fa_params *p); /* bytes per element of K and V */
int fa_use_head_tasks(const fa_params *p, const fa_plan *pl);
int fa_use_lookahead(const fa_params *p, const fa_plan *pl, int nth);
void fa_head_item(const fa_params *p, const fa_plan *pl, int64_t u, fa_item *it);
void fa_copy_head(const fa_params *p, int64_t b, int64_t g, char *kvbuf, fa_params *local);
void fa_head_query_items(const fa_params *p, const fa_plan *pl, int64_t b, int64_t g,
                         fa_item *items);

#endif /* FA_DRIVER_H */
