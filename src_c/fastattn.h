/*
 * fastattn.h -- the one C interface of fastattn (C11, no Python.h).
 *
 * Computes exact scaled dot-product attention
 *
 *     out[b, h, i, :] = sum_j softmax_j(scale * q[b,h,i,:] . k[b,g,j,:]) v[b,g,j,:],
 *     g = h / (Hq / Hkv)                          (grouped-query attention)
 *
 * with a blocked online softmax (FlashAttention-2 loop).  Memory used beyond the
 * caller's arrays is O(block sizes) per thread; an Lq x Lk buffer never exists.
 *
 * Every array is addressed as base + b*s_b + h*s_h + l*s_l + d, with strides counted
 * in ELEMENTS of that array (not bytes) and the last (feature) axis contiguous.  Strides may be 0
 * (broadcast) or negative; the caller guarantees that every addressed element lies
 * inside its buffer.  All sizes and index arithmetic are 64-bit.
 *
 * The library addresses no element outside those shapes: key rows [0, Lk) of each
 * sequence (its seqlens_k or cu_k range), query rows [0, Lq), whatever the window,
 * causal and mask rules make of them (an empty range of visible keys, a window past
 * the last key, more queries than keys: nothing is read).  tests/test_guard_pages.py
 * holds every entry point to it with the arrays against inaccessible pages.
 */
#ifndef FASTATTN_H
#define FASTATTN_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The compute type, which is also that of lse, bias and ALiBi slopes, and of q, k, v
 * and out unless their storage (below) says otherwise. */
enum fa_dtype { FA_F32 = 0, FA_F64 = 1 };

/* How the elements of q, of k and v, and of out are stored (fa_params.q_store,
 * kv_store, out_store).  FA_STORE_F32 / FA_STORE_F64: the compute type itself (it
 * must be dtype's).  The 16-bit types are read (and out written) converted to and
 * from float32, with dtype FA_F32 only; a 16-bit q or out needs k and v of the same
 * 16-bit type.  FA_STORE_I8: k and v are int8 with float32 scales (k_scale,
 * v_scale below), read as float32 data * scale and computed in float32 (dtype,
 * q_store and out_store FA_F32).  A paged cache (block_table) is not a storage type
 * but an addressing rule, combined with any of them. */
enum fa_storage {
    FA_STORE_F32 = 0,  /* float32 (= FA_F32)  */
    FA_STORE_F64 = 1,  /* float64 (= FA_F64)  */
    FA_STORE_F16 = 2,  /* IEEE half           */
    FA_STORE_BF16 = 3, /* bfloat16            */
    FA_STORE_I8 = 4    /* int8, one float32 scale per group of channels per row */
};

/* Causal convention (DESIGN.md, semantics 5). */
enum fa_causal {
    FA_CAUSAL_NONE = 0,
    FA_CAUSAL_BOTTOM_RIGHT = 1, /* key j visible iff j <= i + (Lk - Lq) */
    FA_CAUSAL_TOP_LEFT = 2      /* key j visible iff j <= i               */
};

/* Return codes of the entry points. */
enum fa_status {
    FA_OK = 0,
    FA_ERR_NOMEM = 1, /* a per-thread scratch allocation failed          */
    FA_ERR_ARG = 2    /* a size, dtype or mode the kernel cannot accept */
};

/* Instruction sets a kernel can be compiled for, lowest first. */
enum fa_isa { FA_ISA_GENERIC = 0, FA_ISA_AVX2 = 1, FA_ISA_AVX512 = 2, FA_ISA_NEON = 3, FA_ISA_SVE256 = 4,
              FA_ISA_SVE128 = 5, FA_ISA_COUNT = 6 };

typedef struct fa_params {
    int dtype;          /* enum fa_dtype                                          */
    const void *q;      /* (B, Hq,  Lq, D)                                        */
    const void *k;      /* (B, Hkv, Lk, D)                                        */
    const void *v;      /* (B, Hkv, Lk, Dv)                                       */
    void *out;          /* (B, Hq,  Lq, Dv), written; must not overlap q, k, v
                           (unused when weights is set)                           */
    void *lse;          /* (B, Hq,  Lq) natural-log sum of exp, or NULL           */
    int64_t B, Hq, Hkv; /* batch, query heads, key/value heads (Hq % Hkv == 0)    */
    int64_t Lq, Lk;     /* query and key lengths (>= 0)                           */
    int64_t D, Dv;      /* q/k feature size, v/out feature size (>= 1)            */
    int64_t q_sb, q_sh, q_sl;       /* element strides of q over b, h, l          */
    int64_t k_sb, k_sh, k_sl;       /* element strides of k                       */
    int64_t v_sb, v_sh, v_sl;       /* element strides of v                       */
    int64_t o_sb, o_sh, o_sl;       /* element strides of out                     */
    int64_t lse_sb, lse_sh, lse_sl; /* element strides of lse (ignored if NULL)   */
    double scale;       /* multiplies q.k; any finite value                       */
    int causal;         /* enum fa_causal                                         */
    int num_threads;    /* <= 0: OpenMP's default (OMP_NUM_THREADS, threadpoolctl) */
    int isa;            /* < 0: the kernel chosen at start-up; else an enum fa_isa */
    int q_store;        /* enum fa_storage of q                                   */
    int kv_store;       /* enum fa_storage of k and v                             */
    int out_store;      /* enum fa_storage of out (lse stays in the compute type) */
    int64_t block_q;    /* query rows per block; 0: chosen by the library (a value is  */
    int64_t block_k;    /* rounded up to the vector width); keys per block; 0: chosen */

    /* ---- variants; each is off when its pointer is NULL / its value is 0 or < 0 ---- */
    double softcap;     /* > 0: s = softcap * tanh(s / softcap) after scaling      */
    const void *alibi;  /* slopes, q's dtype: s -= slope[b,h] |i + Lk - Lq - j|     */
    int64_t alibi_sb, alibi_sh;     /* element strides (alibi_sb = 0 for (Hq,))   */
    const void *bias;   /* additive, q's dtype, addressed (b, h, i, j)             */
    int64_t bias_sb, bias_sh, bias_sq, bias_sk; /* element strides (0: broadcast)  */
    const uint8_t *mask;/* bool bytes, nonzero = attend, addressed (b, h, i, j)    */
    int64_t mask_sb, mask_sh, mask_sq, mask_sk; /* byte strides (0: broadcast)     */
    int64_t window_left, window_right; /* visible iff a-left <= j <= a+right, a the
                           causal convention's diagonal; < 0: unbounded side      */
    const int64_t *cu_q, *cu_k; /* varlen: B+1 offsets on the L axis of q/out/lse and
                           of k/v (sequence b is rows cu[b] .. cu[b+1]-1; the batch
                           strides q_sb, k_sb, ... must be 0); NULL: fixed Lq, Lk */
    int positions;      /* nonzero: query row i and key row j sit at positions
                           q_pos0 + i and k_pos0 + j of one sequence, and the positions
                           decide the diagonal (a = q_pos0 + i - k_pos0 in key rows:
                           causal hides keys past it, the window is around it) and
                           the ALiBi distance |a - j|, instead of Lq and Lk (a block
                           of a longer sequence: chunked prefill, fastattn.dask).
                           Not with causal top-left.                               */
    int64_t q_pos0, k_pos0;
    int64_t alibi_shift;/* with positions: ALiBi measures from the diagonal moved this
                           many keys right, |a + alibi_shift - j| (0 for a block of one
                           sequence; fastattn.dask passes Lk - Lq of the whole problem
                           for its blocks of a top-left causal one, since ALiBi aligns
                           bottom-right whatever the causal convention)             */
    const int64_t *seqlens_k; /* (B,): sequence b sees keys [0, seqlens_k[b]) of its
                           k and v (each in [0, Lk]); causal, window and ALiBi align to
                           that length; NULL: all Lk (not with cu_k)               */
    void *weights;      /* attention_weights: (B, Hq, Lq, Lk) output instead of out */
    int64_t w_sb, w_sh, w_sq;       /* element strides; the key axis is contiguous */
    void *entropy;      /* return_stats: (B, Hq, Lq) like lse (lse's strides; lse must
                           be set): each row's entropy -sum p log p in nats, or NULL */
    void *max_weight;   /* (B, Hq, Lq) each row's largest weight, or NULL (set with
                           entropy); a row that sees no key gets 0 in both            */
    const void *sinks;  /* (Hq,) in the compute dtype, or NULL: attention sinks (gpt-oss):
                           exp(sinks[h]) joins each row's denominator, a key with a
                           zero value; out and lse include it (fa_sink_fold), and so
                           do the stats.  -inf = no sink for that head              */
    double dropout_p;   /* in [0, 1): each weight is kept with probability 1 - p and
                           then scaled by 1 / (1 - p); lse stays that of the
                           undropped softmax.  The decision for (b, h, i, j) is
                           fa_dropout_keep(seed, ...), so it depends on nothing else */
    uint64_t seed;

    /* ---- K/V caches beyond a strided array of one float type ---- */
    const float *k_scale, *v_scale; /* kv_store FA_STORE_I8: element c of row j is
                           data[j][c] * scale[j][c / group], one float32 multiply (the
                           bits of fastattn.dequantize_kv); scales addressed like k and
                           v, (b or page, h, l, c / group), element strides below   */
    int64_t ks_sb, ks_sh, ks_sl, vs_sb, vs_sh, vs_sl;
    int64_t k_group, v_group; /* channels per scale; they divide D and Dv          */
    const int32_t *block_table; /* paged K/V (vLLM's pools): key j of sequence b is row
                           j % page_size of page block_table[b * bt_sb + j / page_size];
                           k, v (and the scales) are then addressed (page, h, row, d):
                           k_sb, v_sb, ks_sb, vs_sb step over pages.  Lk is
                           max_blocks * page_size; each sequence's pages below its key
                           length (seqlens_k, else Lk) must be in [0, num_pages)   */
    int64_t bt_sb, max_blocks, page_size, num_pages;
    int64_t k_lanes;    /* > 0: K stored in blocks of k_lanes keys with the keys on the
                           lanes (fastattn.KVCache): element d of key j of (b, g) is
                           element d * k_lanes + j % k_lanes of block j / k_lanes, the
                           block at k + b * k_sb + g * k_sh + (j / k_lanes) * k_sl (in
                           elements of k's storage; with k_bits 4, in bytes, two codes
                           a byte).  Lk is then the blocks times k_lanes; a multiple of
                           16.  0: K in rows, as above                              */
    const float *k_zero;/* with k_lanes and kv_store FA_STORE_I8: K's codes are per
                           channel within a block, element = fmaf(code, scale, zero)
                           (one rounding), scale and zero of (b, g, block, d) at
                           b * ks_sb + g * ks_sh + block * ks_sl + d; codes int8, or
                           with k_bits 4 unsigned 0..15, lanes 2i (low nibble) and
                           2i + 1 (high) in byte i of a channel's k_lanes / 2 bytes   */
    int k_bits, v_bits; /* kv_store FA_STORE_I8: 0 or 8, one code a byte; 4: two codes
                           a byte.  V with v_bits 4: channels 2c (low nibble) and 2c + 1
                           (high) in byte c of a row (ceil(Dv / 2) bytes, v_sl in bytes),
                           element = (nibble - 8) * scale                           */
} fa_params;

/* The backward pass: gradients of sum(dout * out) with respect to q, k, v (and the
 * logits, for the bias's gradient), where out, lse are what fa_attention_forward
 * returned for the same f.  f.out must point to that output and f.lse to its lse
 * (strides as in the forward); f.weights, 16-bit or int8 storage, paged K/V and varlen are not
 * allowed. */
typedef struct fa_bwd_params {
    fa_params f;
    const void *dout;   /* (B, Hq, Lq, Dv), the gradient of out                   */
    int64_t do_sb, do_sh, do_sl;
    void *dq;           /* (B, Hq, Lq, D),  written                                */
    int64_t dq_sb, dq_sh, dq_sl;
    void *dk;           /* (B, Hkv, Lk, D), written (summed over a group's heads)  */
    int64_t dk_sb, dk_sh, dk_sl;
    void *dv;           /* (B, Hkv, Lk, Dv), written                               */
    int64_t dv_sb, dv_sh, dv_sl;
    void *ds;           /* (B, Hq, Lq, Lk) gradient of the logits (after softcap: the
                           bias's gradient before any broadcast sum), or NULL.  Only
                           entries of tiles with a visible key are written: pass a
                           zeroed array.  The key axis is contiguous.             */
    int64_t ds_sb, ds_sh, ds_sq;
    int passes;         /* 0: chosen by the library; 1: one pass (dQ in the loop that
                           makes dK and dV: fewer products, parallel over kv heads only);
                           2: two passes (parallel over key and query blocks too).  The
                           result has the same bits either way. */
    int bf16;           /* q, k, v (float32) hold bfloat16 values, the float32 copies of
                           bfloat16 arrays: where a bfloat16 path runs (fa_bf16_path),
                           the products take bfloat16 pairs, with W, dS and dout rounded
                           to bfloat16 (0: float32 products)                       */
    int grad16;         /* with bf16: dq, dk and dv are bfloat16 arrays (their strides
                           in their own elements), each gradient rounded to nearest
                           even from its float32 sum, as a float32 result would be by
                           the caller (no float32 copy of the gradients is made)   */
} fa_bwd_params;

/* Thread-safe; the result is bitwise identical for any thread count.  Memory beyond
 * the arrays: O(B Hq Lq) plus per-thread scratch.  Returns an enum fa_status. */
int fa_attention_backward(const fa_bwd_params *bp);

/* key_mass: mass[b, h, j] = sum_i p_ij, the total weight the queries of head h give
 * key j (B, Hq, Lk; element strides m_sb, m_sh, keys contiguous), computed from
 * p->lse (required: the forward's lse for the same arguments), deterministic.  p->v,
 * p->out, dropout and stats are ignored; 16-bit or int8 storage, paged K/V, varlen and weights are
 * refused. */
int fa_key_mass(const fa_params *p, void *mass, int64_t m_sb, int64_t m_sh);

/* The dropout decision (1 = keep) of weight (b, h, i, j) for a threshold
 * t = min(floor(p * 2^32), 2^32 - 1): Philox-4x32-10 with key (seed low 32 bits,
 * seed high 32 bits) and counter (j / 4, i, h, b) gives four words; word j % 4 >= t
 * keeps.  Exported for tests. */
int fa_dropout_keep(uint64_t seed, uint32_t threshold, int64_t b, int64_t h, int64_t i, int64_t j);
uint32_t fa_dropout_threshold(double p);

/* The forward pass.  Thread-safe: no global mutable state is touched.
 * Returns an enum fa_status. */
int fa_attention_forward(const fa_params *p);

/* Combine partial attentions over disjoint key sets (fastattn.merge): outs
 * (parts, rows, dv) and lses (parts, rows) contiguous, into out (rows, dv) and lse
 * (rows).  Parts merge in index order, so the result does not depend on threads. */
int fa_merge(int dtype, int64_t parts, int64_t rows, int64_t dv, const void *outs,
             const void *lses, void *out, void *lse);

/* ---- CPU dispatch (cpu.c) ---- */

/* Which instruction sets this CPU and OS can execute (bit i set = enum fa_isa i). */
unsigned fa_cpu_supported_isas(void);

/* Chooses the kernel once: the best supported ISA that is not disabled by the
 * comma-separated feature list `disabled` (e.g. "AVX512F,AVX2"; may be NULL).
 * Writes a human-readable reason into `why` (size `why_len`).  Returns the ISA. */
int fa_cpu_select(const char *disabled, char *why, int why_len);

/* The ISA used when fa_params.isa < 0, and a setter (not thread-safe: call it at
 * start-up or from tests only).  fa_set_default_isa returns FA_ERR_ARG if the CPU
 * cannot run `isa`. */
int fa_default_isa(void);
/* Per-core L2 cache size in bytes, which bounds the default block sizes: CPUID
 * leaf 4 on Intel, leaf 0x8000001D or 0x80000006 on AMD, else Linux's sysfs, else
 * a 256 KiB guess.  fa_cpu_l2_source says which (a static string). */
int64_t fa_cpu_l2_bytes(void);
const char *fa_cpu_l2_source(void);
/* bfloat16 instructions of this CPU: bit 0 AVX512-BF16, bit 1 AMX-BF16 (with AMX-TILE,
 * the OS's tile state and Linux's permission for it; bit 2 set where the permission
 * was refused), bit 3 AVX512-BF16 at half the float32 FMA rate (not an AMD CPU: on
 * Intel's cores the pairs are never the default, for the forward or the backward);
 * AArch64: bit 4 FEAT_BF16 (NEON's BFDOT), bit 5 SVE's BFDOT too. */
unsigned fa_cpu_bf16_features(void);
/* How calls with q, k and v all bfloat16 compute: FA_BF16_FLOAT32 converts to float32
 * in registers (every kernel does, and the generic and avx2 kernels always);
 * FA_BF16_AVX512 takes the products on AVX512-BF16 (vdpbf16ps) pairs on the avx512
 * kernel; FA_BF16_AMX on AMX tiles (tdpbf16ps), its tails on the pairs; FA_BF16_BFDOT
 * (AArch64) on BFDOT pairs on the neon, sve256 or sve128 kernel, whichever runs, where
 * the CPU has the instruction for it.  fa_cpu_select picks the best this build and CPU
 * run, unless its list names AVX512_BF16 (both x86 paths), AMX, or BF16 (BFDOT);
 * fa_bf16_paths has bit `path` set for each one that can run; fa_set_bf16_path
 * (tests, start-up) returns FA_ERR_ARG for one that cannot. */
enum fa_bf16_path { FA_BF16_FLOAT32 = 0, FA_BF16_AVX512 = 1, FA_BF16_AMX = 2, FA_BF16_BFDOT = 3,
                    FA_BF16_COUNT = 4 };
#ifdef FA_EMULATE_BF16 /* a test build: the bfloat16 products over SIMDe and the AMX model (setup.py) */
#define FA_BF16_EMULATED 1
#else
#define FA_BF16_EMULATED 0
#endif
int fa_bf16_path(void);
unsigned fa_bf16_paths(void);
/* The name of the bfloat16 kernel that calls with q, k and v bfloat16 take on the
 * default kernel under the selected path, or NULL where they convert to float32. */
const char *fa_bf16_kernel_name(void);
/* The paths this build compiled, whatever the CPU (bit `path` each). */
unsigned fa_bf16_paths_built(void);
/* The emulated test build: how many tdpbf16ps the AMX model has run (all threads, since
 * import); -1 in every other build. */
long fa_amx_model_ops(void);
/* The emulated test build: of `count` pair products of edge and pseudo-random bfloat16
 * operands, how many the 8-lane model its vdpbf16ps and tdpbf16ps run gives other bits
 * than the scalar model (bf16_model.h) for (0: they agree); -1 in every other build. */
long fa_bf16_model_check(long count);
int fa_set_bf16_path(int path);
const char *fa_bf16_path_name(int path);
int fa_set_default_isa(int isa);
const char *fa_isa_name(int isa);
/* How the forward's look-ahead (short items claimed one ahead) asks for the next item's
 * rows: FA_LOOKAHEAD_AUTO by the CPU (AMD: all of them at once before the item; others:
 * FA_LOOKAHEAD_STREAM, the Q and output rows only, items of several key blocks a few
 * lines at a time during the running item's products), or either one forced (tests:
 * both run on every machine).  Never changes a bit.  Returns FA_ERR_ARG for an unknown
 * mode. */
enum fa_lookahead_mode { FA_LOOKAHEAD_AUTO = 0, FA_LOOKAHEAD_ALL = 1, FA_LOOKAHEAD_STREAM = 2 };
int fa_set_lookahead(int mode);
/* Key groups the keys-on-lanes QK^T of three or four rows takes for float32 keys where
 * the ISA allows four (AVX-512; kern_products.h, FA_LANES_G34_AT; for tests): 0 by the CPU
 * (two on AMD, four elsewhere), 2 or 4.  Never changes a bit.  FA_ERR_ARG for another. */
int fa_set_lane_groups(int mode);

/* ---- OpenMP shim (fa_common.c) ---- */
int fa_openmp_enabled(void);
int fa_max_threads(void);
/* Threads that ran the calling thread's last fa_attention_forward (for tests). */
int fa_last_num_threads(void);
/* Unbound threads spread over distinct CPUs at each call's start (fa_common.c):
 * 1 on, 0 off, -1 as FASTATTN_SPREAD says (unset: on).  Never changes a bit.
 * FA_ERR_ARG for another mode. */
int fa_set_spread(int mode);
/* Threads fa_spread has moved since the library loaded (every call's and probe's). */
long fa_spread_moves(void);
/* For tests: a parallel region of nth threads that spreads as a call's does; herd
 * first puts every other thread on the calling thread's CPU.  start[t] / joined[t]:
 * thread t's CPU before and after (-1: unknown or off; start[0]: the CPU the calling
 * thread claimed when the spread began), *moved: threads moved.
 * Returns the threads that ran. */
int fa_spread_probe(int nth, int herd, int *start, int *joined, int *moved);
/* "compiler=<name version>; openmp=<_OPENMP date or 0>" */
const char *fa_build_info(void);

/* ---- bfloat16 to float32: dst[i] = the float32 bits of bfloat16 src[i] (its bits moved
 * up 16: exact), n values, split among nthreads threads (0: OpenMP's default); the
 * Python side's float32 copies of bfloat16 arrays (fastattn._args.fresh). ---- */
void fa_bf16_to_f32(const uint16_t *src, uint32_t *dst, int64_t n, int nthreads);

/* ---- exp, exported for the ULP test: y[i] = exp(x[i]) computed by the kernel's
 * vectorized exp of the given ISA and dtype. Returns FA_ERR_ARG for an ISA this
 * CPU cannot run. ---- */
int fa_exp_array(int isa, int dtype, const void *x, void *y, int64_t n, int logit);

/* ---- the FMA peak of an ISA's kernel file, float32 or float64, on nthreads OpenMP
 * threads: *gflops from independent FMA chains (fa_common.c).  FA_ERR_ARG for an ISA
 * this CPU cannot run, another dtype or nthreads < 1. ---- */
int fa_fma_peak(int isa, int dtype, int nthreads, double *gflops);
/* The same for a bfloat16 pair path's instruction (FA_BF16_AVX512: vdpbf16ps chains,
 * 4 flops a lane); FA_ERR_ARG for FA_BF16_FLOAT32 or a path that cannot run here. */
int fa_bf16_peak(int path, int nthreads, double *gflops);
/* The read bandwidth with an ISA's vector loads: nthreads OpenMP threads each read a
 * share of the n float32 or float64 elements of buf (4 runs side by side), an untimed
 * pass and then `passes` timed ones.  *bytes: read by a pass (each share rounded down to
 * 128 elements), *seconds: the fastest pass, *sum: the sum of what it read.  FA_ERR_ARG
 * for an ISA this CPU cannot run, another dtype, nthreads or passes < 1, n < 0. */
int fa_read_bandwidth(int isa, int dtype, const void *buf, int64_t n, int nthreads, int passes,
                      int64_t *bytes, double *seconds, double *sum);

/* ---- the forward's load balance on nthreads threads, without running it
 * (fa_forward.c): work[t] for t < nthreads, the flops (2 (D + Dv) per visible
 * query-key pair) of the items thread t would run under the forward's schedule;
 * *nitems its items.  The data pointers of p are not read (cu_q, cu_k, seqlens_k and
 * block_table are).  FA_ERR_ARG for params fa_attention_forward refuses. ---- */
int fa_plan_balance(const fa_params *p, int nthreads, double *work, int64_t *nitems);

#ifdef __cplusplus
}
#endif
#endif /* FASTATTN_H */
