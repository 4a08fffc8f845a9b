/*
 * fa_internal.h -- what the driver (attention.c), the dispatcher (cpu.c) and the
 * per-instruction-set kernel files share.  Not part of the public interface.
 */
#ifndef FA_INTERNAL_H
#define FA_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "fastattn.h"

#if defined(__GNUC__) || defined(__clang__)
#define FA_ALWAYS_INLINE static inline __attribute__((always_inline))
#define FA_RESTRICT __restrict__
#else
#define FA_ALWAYS_INLINE static inline
#define FA_RESTRICT
#endif

/* Alignment of every scratch piece: one cache line, enough for any vector load. */
#define FA_ALIGN 64

/* Block sizes of one call, chosen by the driver: q query rows (a multiple of the
 * kernel's vector width: also the row stride of its query-major scratch) and k keys. */
typedef struct fa_blocks {
    int64_t q, k;
} fa_blocks;

/* One work item: the query rows of nh heads that share one key/value head, all
 * against the same key tiles (so a K/V tile is loaded once for the group). */
typedef struct fa_item {
    int64_t b, g;       /* batch (sequence), key/value head                       */
    int64_t h0, nh;     /* query heads h0 .. h0+nh-1, all reading kv head g       */
    int64_t q0, nq;     /* positions q0 .. q0+nq-1 of each of those heads         */
    int64_t Lq, Lk;     /* this sequence's lengths                                */
    int64_t qoff, koff; /* its first row on the L axis of q/out/lse and of k/v    */
    int64_t kv0, kv1;   /* keys that may be visible to some row: [kv0, kv1)       */
} fa_item;

/* Computes one item (rows r = hh*nq + i), writing its output rows and lse (or its
 * rows of attention weights).  `scratch` holds fa_kernel.scratch_bytes(p, bl) bytes,
 * FA_ALIGN-aligned, owned by the calling thread. */
typedef void (*fa_qblock_fn)(const fa_params *p, const fa_blocks *bl, const fa_item *it,
                             void *scratch);
typedef size_t (*fa_scratch_fn)(const fa_params *p, const fa_blocks *bl);
typedef void (*fa_exp_fn)(const void *x, void *y, int64_t n);

/* The micro-kernels of one instruction set, for each dtype (index enum fa_dtype). */
typedef struct fa_kernel {
    const char *name;
    int lanes[2];        /* vector width in elements */
    fa_qblock_fn qblock[2];
    fa_scratch_fn scratch_bytes[2];
    fa_exp_fn exp_array[2];
} fa_kernel;

extern const fa_kernel fa_kernel_generic;
#ifdef FA_HAVE_X86_KERNELS
extern const fa_kernel fa_kernel_avx2;
extern const fa_kernel fa_kernel_avx512;
#endif

/* The table for an ISA, or NULL if it was not compiled in. */
const fa_kernel *fa_kernel_for_isa(int isa);

#endif /* FA_INTERNAL_H */
