/*
 * kernels_tmpl.h -- the attention micro-kernels, written once over a small set of
 * vector operations and instantiated by each instruction-set file
 * (kernels_generic.c, kernels_avx2.c, kernels_avx512.c) for float32 and float64.
 * Each including file is compiled with its own flags only, so the operations below
 * become that file's instructions and nothing else.
 *
 * The including file defines, before each inclusion:
 *   FA_T          element type (float or double)
 *   FA_V          vector type, FA_VL lanes of FA_T
 *   FA_NAME(x)    name mangling, e.g. x##_f32_avx512
 *   FA_QK_R, FA_QK_NV   QK^T register tile: keys x query vectors
 *   FA_PV_R, FA_PV_NC   P.V register tile: query rows x value vectors
 *   FA_VLOAD(p) FA_VSTORE(p,v)  aligned (scratch) load/store
 *   FA_VLOADU(p)         unaligned load; FA_VLOADU_N(p, n) loads n < FA_VL lanes, rest 0
 *   FA_VSET1(x) FA_VZERO() FA_VADD FA_VSUB FA_VMUL FA_VFMA(a,b,c)=a*b+c
 *   FA_VMAX(a,b)         lane max; if b is NaN the result is NaN
 *   FA_VEXP(x)           lane exp; exp(-inf) = +0 exactly, NaN stays NaN
 *   FA_VEXP_LOGIT(x)     optional: a cheaper lane exp for the softmax's logits x <= 0
 *                        (its error stated beside it; default FA_VEXP), e^0 = 1 exactly
 *   FA_VEXP_LOGIT4(x)    optional: FA_VEXP_LOGIT of the 4 vectors x[0..3] in place, interleaved
 *   FA_VNEGINF_TO_ZERO(x) lanes equal to -inf become 0, others unchanged
 *   FA_VABS(x) FA_VDIV(a,b) FA_VCOPYSIGN(mag, sgn)
 *   FA_VIN_RANGE(x, j, lo, hi)  x where lo <= j <= hi (j a broadcast), else -inf
 *   FA_VMASK_BYTES(x, p)        x where the byte p[lane] != 0, else -inf
 *   FA_VREDUCE(x)               the sum of the lanes
 * and, optionally, for K/V stored in another type FA_KV (float16 K/V: FA_KV_HALF,
 * computing in float32; default FA_KV = FA_T):
 *   FA_KV_BCAST(p) FA_KV_LOADU(p) FA_KV_LOADU_N(p, n)   converting loads
 * and, optionally (FA_HAVE_TRANSPOSE), register transposes for bias tiles and the
 * decode product's key rows:
 *   FA_VTRANSPOSE(rows, off, dst, ds)  dst[t * ds + i] = rows[i][off + t] for
 *                               i, t < FA_VL (dst aligned; rows: FA_VL pointers)
 *   FA_VTRANSPOSE_REGS(x)       x[t] lane i <- x[i] lane t for FA_V x[FA_VL]
 *
 * Layout: the query axis is the SIMD axis.  A query block is packed transposed
 * (qt[d][i], pre-multiplied by scale), so S^T = K qt is computed with one key
 * element broadcast against vectors of queries, and every softmax statistic (row
 * max m, row sum l, rescale factor alpha) is a vector over queries: no horizontal
 * reductions anywhere, and the key tile needs no transposition.  P.V then
 * broadcasts one probability against vectors of a value row.
 */

/* The template is split by concern, one file a piece, included here in the order of
 * their dependencies (each file's opening comment says what it holds and what it
 * needs from the including file):
 *   kern_common.h    defaults, tile-shape switches, the forward's scratch layout
 *   kern_source.h    a key tile's K/V rows: in place, or staged (int8, paged)
 *   kern_products.h  QK^T tiles, the keys-on-lanes decode product, P.V tiles
 *   kern_bf16dp.h    (FA_BF16_DP, FA_BF16_BWD) both products on bfloat16 pairs
 *   kern_bf16bwd.h   (FA_BF16_BWD only) the backward's packing and row-pair products
 *   kern_amx.h       (FA_BF16_AMX only) both products on AMX tiles
 *   kern_softmax.h   the online softmax, the chunk merge and the statistics
 *   kern_logits.h    row set-up, mask/bias tiles, the logit steps, fa_scores
 *   kern_forward.h   the forward block (prefill and decode rows), exp
 *   kern_backward.h  the backward and key mass
 */
#include "kern_common.h"
#include "kern_source.h"
#include "kern_products.h"
#if defined(FA_BF16_DP) || defined(FA_BF16_BWD)
#include "kern_bf16dp.h"
#endif
#ifdef FA_BF16_BWD
#include "kern_bf16bwd.h"
#endif
#ifdef FA_BF16_AMX
#include "kern_amx.h"
#endif
#include "kern_softmax.h"
#include "kern_logits.h"
#include "kern_forward.h"
#include "kern_backward.h"
