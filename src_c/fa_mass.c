/*
 * fa_mass.c -- key_mass (fa_key_mass): a pass over (sequence, kv head, key chunk)
 * items of the kernels' fa_mass_kv, from the forward's lse.
 */
#include <math.h>
#include <stdlib.h>
#include "fa_driver.h"

int fa_key_mass(const fa_params *p_in, void *mass, int64_t m_sb, int64_t m_sh)
{
    fa_last_threads = 0;
    int rc = fa_check(p_in);
    if (rc != FA_OK) return rc;
    if (fa_store16(p_in->kv_store) || fa_kv_staged(p_in) || p_in->weights || p_in->cu_q || !p_in->lse || !mass) return FA_ERR_ARG;
    const fa_kernel *kern = fa_kernel_for_isa(p_in->isa < 0 ? fa_default_isa() : p_in->isa);
    if (!kern || (p_in->isa >= 0 && !(fa_cpu_supported_isas() & (1u << p_in->isa)))) return FA_ERR_ARG;
    if (p_in->B == 0 || p_in->Hq == 0 || p_in->Lk == 0) return FA_OK;
    fa_bwd_params bp;
    memset(&bp, 0, sizeof bp);
    bp.f = *p_in;
    fa_params *p = &bp.f;
    p->entropy = p->max_weight = NULL;
    p->dropout_p = 0;
    p->Dv = 1; /* the scratch's value pieces are unused */
    const int64_t item = p->dtype == FA_F64 ? 8 : 4;
    const int64_t G = p->Hq / p->Hkv;
    if (p->Lq == 0) { /* no query: every key gets 0 */
        for (int64_t b = 0; b < p->B; b++)
            for (int64_t h = 0; h < p->Hq; h++)
                memset((char *)mass + (size_t)((b * m_sb + h * m_sh) * item), 0, (size_t)(p->Lk * item));
        return FA_OK;
    }
    fa_plan pl;
    rc = fa_make_plan(kern, p, 0, &pl);
    if (rc != FA_OK) return rc;
    fa_bwd_ctx cx;
    memset(&cx, 0, sizeof cx);
    cx.bp = &bp;
    cx.bl = pl.bl;
    const int ki = p->dtype;
    const size_t scratch_bytes = kern->bwd_scratch[ki](&cx);
    const int64_t chunk = FA_BWD_CHUNK * cx.bl.k, nch = (p->Lk + chunk - 1) / chunk;
    const int64_t n1 = p->B * p->Hkv * nch, per_head = pl.nhc * ((p->Lq + pl.nqp - 1) / pl.nqp);
    int nth = p->num_threads > 0 ? p->num_threads : fa_max_threads();
    if ((int64_t)nth > n1) nth = (int)n1;
    if (nth < 1) nth = 1;
    int failed = 0, ran = 0;
    fa_spread sp;
    fa_spread_begin(&sp, nth);
#pragma omp parallel num_threads(nth) if (nth > 1) reduction(| : failed) reduction(+ : ran)
    {
        fa_spread_join(&sp);
        ran += 1;
        void *scratch = fa_scratch_alloc(scratch_bytes);
        void *acc = fa_scratch_alloc((size_t)(G * chunk * item));
        fa_item *items = (fa_item *)malloc((size_t)per_head * sizeof(fa_item));
        int64_t have_b = -1, have_g = -1;
        if (!scratch || !acc || !items) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < n1; t++) {
            if (!scratch || !acc || !items) continue;
            const int64_t b = t / (p->Hkv * nch), g = (t / nch) % p->Hkv, c = t % nch;
            if (b != have_b || g != have_g) {
                fa_head_query_items(p, &pl, b, g, items);
                have_b = b;
                have_g = g;
            }
            const int64_t k0 = c * chunk, k1 = p->Lk - k0 < chunk ? p->Lk : k0 + chunk;
            kern->mass[ki](&cx, items, per_head, k0, k1, scratch, acc, mass, m_sb, m_sh);
        }
        free(items);
        free(acc);
        free(scratch);
    }
    fa_last_threads = ran;
    free(pl.start);
    return failed ? FA_ERR_NOMEM : FA_OK;
}
