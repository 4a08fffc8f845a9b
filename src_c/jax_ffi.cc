/*
 * fastattn's XLA FFI handlers (fastattn.jax): typed handlers that XLA's CPU runtime calls
 * with its own buffers, which go to fastattn's C driver (fa_attention_forward /
 * fa_attention_backward) in place.  Compiled into fastattn._kernels only when the
 * headers jaxlib ships (jax.ffi.include_dir()) are found at build time (setup.py).
 *
 * Layout: JAX's (B, T, N, H) ("bshd"), row-major as XLA lays out arguments.  Inputs
 * absent from a call come as 0-element buffers.  Extra leading axes (vmap with
 * vmap_method="expand_dims") are a loop over the driver's calls, an input whose leading
 * axes are all 1 being shared by every step.
 *
 * Forward  fastattn_fwd(q, k, v, bias, mask, seqlens, sinks, alibi) -> (out, lse)
 *   q (.., B, T, N, H) f32/f64/bf16/f16; k, v (.., B, S, K, H/Hv), the same dtype;
 *   bias (.., b, n, t, s) in the compute dtype (f32, f64 for f64), each axis 1 or full;
 *   mask (.., b, n, t, s) bool, likewise; seqlens (.., B) int32; sinks (.., N) and
 *   alibi (.., N) or (.., B, N) in the compute dtype.  out like q with Hv, lse
 *   (.., B, N, T) in the compute dtype.
 * Backward fastattn_bwd(q, k, v, out, lse, dout, bias, mask, seqlens, sinks, alibi)
 *   -> (dq, dk, dv, ds): one compute dtype (f32/f64) throughout; ds (.., B, N, T, S)
 *   when the attribute need_ds is set (the bias's gradient), else 0 elements.
 * Attributes (both handlers, all of them): scale, softcap (f64); causal (0 none,
 *   1 bottom-right, 2 top-left), window_left, window_right (-1 unbounded), positions
 *   (0/1), q_offset, k_offset, num_threads (0: OpenMP's default), and the backward's
 *   bf16 (the products may take bfloat16 pairs: q, k, v hold bfloat16 values) and
 *   need_ds (i64; the forward ignores these two).
 */
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

extern "C" {
#include "fastattn.h"
}

namespace ffi = xla::ffi;

namespace {

struct Shape {
    const ffi::AnyBuffer *buf;
    int base;  // the rank of one call's array
};

int64_t prod(ffi::AnyBuffer::Dimensions d, size_t from, size_t to)
{
    int64_t n = 1;
    for (size_t i = from; i < to; i++) n *= d[i];
    return n;
}

// The number of leading (vmapped) steps of a buffer of one call's rank `base`.
int64_t steps(const ffi::AnyBuffer &b, int base)
{
    auto d = b.dimensions();
    return d.size() > (size_t)base ? prod(d, 0, d.size() - base) : 1;
}

// Element i from the end of the dimensions (1 = the last).
int64_t dim_back(const ffi::AnyBuffer &b, int i) { return b.dimensions()[b.dimensions().size() - i]; }

// The byte offset of step s of buffer b of one call's rank `base` (0 for a buffer whose
// leading axes are all 1: shared by every step).
size_t step_offset(const ffi::AnyBuffer &b, int base, int64_t s)
{
    if (b.element_count() == 0 || steps(b, base) == 1) return 0;
    auto d = b.dimensions();
    return (size_t)s * (size_t)prod(d, d.size() - base, d.size()) * ffi::ByteWidth(b.element_type());
}

const char *at(const ffi::AnyBuffer &b, int base, int64_t s)
{
    return static_cast<const char *>(b.untyped_data()) + step_offset(b, base, s);
}

char *at_out(ffi::AnyBuffer *b, int base, int64_t s)
{
    return static_cast<char *>(b->untyped_data()) + step_offset(*b, base, s);
}

int storage(ffi::DataType t)
{
    switch (t) {
    case ffi::DataType::F32: return FA_STORE_F32;
    case ffi::DataType::F64: return FA_STORE_F64;
    case ffi::DataType::F16: return FA_STORE_F16;
    case ffi::DataType::BF16: return FA_STORE_BF16;
    default: return -1;
    }
}

}  // namespace

// The attributes of both handlers, decoded by name from the call's attribute dictionary.
struct Options {
    double scale, softcap;
    int64_t causal, window_left, window_right, positions, q_offset, k_offset, num_threads;
    int64_t bf16, need_ds;  // the backward's (the forward ignores them)
};

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    Options, xla::ffi::StructMember<double>("scale"), xla::ffi::StructMember<double>("softcap"),
    xla::ffi::StructMember<int64_t>("causal"), xla::ffi::StructMember<int64_t>("window_left"),
    xla::ffi::StructMember<int64_t>("window_right"), xla::ffi::StructMember<int64_t>("positions"),
    xla::ffi::StructMember<int64_t>("q_offset"), xla::ffi::StructMember<int64_t>("k_offset"),
    xla::ffi::StructMember<int64_t>("num_threads"), xla::ffi::StructMember<int64_t>("bf16"),
    xla::ffi::StructMember<int64_t>("need_ds"));

namespace {

// A 4-D broadcastable array's element strides (0 along axes of size 1).
void strides4(const ffi::AnyBuffer &b, int64_t *sb, int64_t *sh, int64_t *sq, int64_t *sk)
{
    const int64_t n = dim_back(b, 3), t = dim_back(b, 2), s = dim_back(b, 1);
    *sk = s == 1 ? 0 : 1;
    *sq = t == 1 ? 0 : s;
    *sh = n == 1 ? 0 : t * s;
    *sb = dim_back(b, 4) == 1 ? 0 : n * t * s;
}

// The call's params for step s (everything but the outputs); the seqlens' int64 copy
// goes to `lens`.
ffi::Error fill(fa_params *p, const Options &c, const ffi::AnyBuffer &q, const ffi::AnyBuffer &k,
                const ffi::AnyBuffer &v, const ffi::AnyBuffer &bias, const ffi::AnyBuffer &mask,
                const ffi::AnyBuffer &seqlens, const ffi::AnyBuffer &sinks,
                const ffi::AnyBuffer &alibi, int64_t s, std::vector<int64_t> &lens)
{
    std::memset(p, 0, sizeof(*p));
    const int qs = storage(q.element_type());
    if (qs < 0 || storage(k.element_type()) != qs || storage(v.element_type()) != qs)
        return ffi::Error::InvalidArgument("fastattn: q, k and v must share one float dtype");
    p->dtype = qs == FA_STORE_F64 ? FA_F64 : FA_F32;
    p->q_store = p->kv_store = p->out_store = qs;
    p->B = dim_back(q, 4);
    p->Lq = dim_back(q, 3);
    p->Hq = dim_back(q, 2);
    p->D = dim_back(q, 1);
    p->Lk = dim_back(k, 3);
    p->Hkv = dim_back(k, 2);
    p->Dv = dim_back(v, 1);
    p->q = at(q, 4, s);
    p->k = at(k, 4, s);
    p->v = at(v, 4, s);
    // (B, L, H, D) row-major
    p->q_sb = p->Lq * p->Hq * p->D, p->q_sh = p->D, p->q_sl = p->Hq * p->D;
    p->k_sb = p->Lk * p->Hkv * p->D, p->k_sh = p->D, p->k_sl = p->Hkv * p->D;
    p->v_sb = p->Lk * p->Hkv * p->Dv, p->v_sh = p->Dv, p->v_sl = p->Hkv * p->Dv;
    p->o_sb = p->Lq * p->Hq * p->Dv, p->o_sh = p->Dv, p->o_sl = p->Hq * p->Dv;
    p->lse_sb = p->Hq * p->Lq, p->lse_sh = p->Lq, p->lse_sl = 1;
    p->scale = c.scale;
    p->causal = (int)c.causal;
    p->num_threads = (int)c.num_threads;
    p->isa = -1;
    p->softcap = c.softcap;
    p->window_left = c.window_left;
    p->window_right = c.window_right;
    p->positions = (int)c.positions;
    p->q_pos0 = c.q_offset;
    p->k_pos0 = c.k_offset;
    if (bias.element_count()) {
        p->bias = at(bias, 4, s);
        strides4(bias, &p->bias_sb, &p->bias_sh, &p->bias_sq, &p->bias_sk);
    }
    if (mask.element_count()) {
        p->mask = reinterpret_cast<const uint8_t *>(at(mask, 4, s));
        strides4(mask, &p->mask_sb, &p->mask_sh, &p->mask_sq, &p->mask_sk);
    }
    if (seqlens.element_count()) {
        const int32_t *l = reinterpret_cast<const int32_t *>(at(seqlens, 1, s));
        lens.assign(l, l + p->B);
        for (int64_t x : lens)
            if (x < 0 || x > p->Lk) return ffi::Error::InvalidArgument("fastattn: seqlens_k out of [0, Lk]");
        p->seqlens_k = lens.data();
    }
    if (sinks.element_count()) p->sinks = at(sinks, 1, s);
    if (alibi.element_count()) {
        const bool per_batch = alibi.dimensions().size() >= 2 && steps(alibi, 1) == p->B * steps(q, 4);
        // (N,) shared by the batch, or (B, N)
        p->alibi = per_batch ? at(alibi, 2, s) : at(alibi, 1, s);
        p->alibi_sb = per_batch ? p->Hq : 0;
        p->alibi_sh = 1;
    }
    return ffi::Error::Success();
}

ffi::Error status(int rc)
{
    if (rc == FA_OK) return ffi::Error::Success();
    if (rc == FA_ERR_NOMEM) return ffi::Error(ffi::ErrorCode::kResourceExhausted, "fastattn: out of memory");
    return ffi::Error::InvalidArgument("fastattn: the kernel refused the arguments");
}

ffi::Error forward_impl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer bias,
                        ffi::AnyBuffer mask, ffi::AnyBuffer seqlens, ffi::AnyBuffer sinks,
                        ffi::AnyBuffer alibi, ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::AnyBuffer> lse, Options c)
{
    if (q.dimensions().size() < 4) return ffi::Error::InvalidArgument("fastattn: q must be (B, T, N, H)");
    std::vector<int64_t> lens;
    const int64_t n = steps(q, 4);
    for (int64_t s = 0; s < n; s++) {
        fa_params p;
        ffi::Error e = fill(&p, c, q, k, v, bias, mask, seqlens, sinks, alibi, s, lens);
        if (e.failure()) return e;
        p.out = at_out(&*out, 4, s);
        p.lse = at_out(&*lse, 3, s);
        if (p.B * p.Hq * p.Lq == 0) continue;
        const int rc = fa_attention_forward(&p);
        if (rc != FA_OK) return status(rc);
    }
    return ffi::Error::Success();
}

ffi::Error backward_impl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out,
                         ffi::AnyBuffer lse, ffi::AnyBuffer dout, ffi::AnyBuffer bias, ffi::AnyBuffer mask,
                         ffi::AnyBuffer seqlens, ffi::AnyBuffer sinks, ffi::AnyBuffer alibi,
                         ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                         ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> ds, Options c)
{
    if (q.dimensions().size() < 4) return ffi::Error::InvalidArgument("fastattn: q must be (B, T, N, H)");
    if (q.element_type() != ffi::DataType::F32 && q.element_type() != ffi::DataType::F64)
        return ffi::Error::InvalidArgument("fastattn: the backward computes in float32 or float64");
    std::vector<int64_t> lens;
    const int64_t n = steps(q, 4);
    for (int64_t s = 0; s < n; s++) {
        fa_bwd_params bp;
        std::memset(&bp, 0, sizeof(bp));
        ffi::Error e = fill(&bp.f, c, q, k, v, bias, mask, seqlens, sinks, alibi, s, lens);
        if (e.failure()) return e;
        fa_params &p = bp.f;
        p.out = const_cast<char *>(at(out, 4, s));
        p.lse = const_cast<char *>(at(lse, 3, s));
        bp.dout = at(dout, 4, s);
        bp.do_sb = p.o_sb, bp.do_sh = p.o_sh, bp.do_sl = p.o_sl;
        bp.dq = at_out(&*dq, 4, s);
        bp.dq_sb = p.q_sb, bp.dq_sh = p.q_sh, bp.dq_sl = p.q_sl;
        bp.dk = at_out(&*dk, 4, s);
        bp.dk_sb = p.k_sb, bp.dk_sh = p.k_sh, bp.dk_sl = p.k_sl;
        bp.dv = at_out(&*dv, 4, s);
        bp.dv_sb = p.v_sb, bp.dv_sh = p.v_sh, bp.dv_sl = p.v_sl;
        if (c.need_ds) {  // (B, N, T, S), zeroed: the kernel adds the visible entries
            char *d = at_out(&*ds, 4, s);
            std::memset(d, 0, (size_t)(p.B * p.Hq * p.Lq * p.Lk) * ffi::ByteWidth(q.element_type()));
            bp.ds = d;
            bp.ds_sb = p.Hq * p.Lq * p.Lk, bp.ds_sh = p.Lq * p.Lk, bp.ds_sq = p.Lk;
        }
        bp.bf16 = (int)c.bf16;
        const size_t item = ffi::ByteWidth(q.element_type());
        if (p.B * p.Hq * p.Lq * p.D == 0 && p.B * p.Hkv * p.Lk == 0) continue;
        if (p.B * p.Hq * p.Lq == 0) {  // no queries: the gradients of k and v are 0
            std::memset(bp.dk, 0, (size_t)(p.B * p.Lk * p.Hkv * p.D) * item);
            std::memset(bp.dv, 0, (size_t)(p.B * p.Lk * p.Hkv * p.Dv) * item);
            continue;
        }
        const int rc = fa_attention_backward(&bp);
        if (rc != FA_OK) return status(rc);
    }
    return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(fastattn_jax_fwd, forward_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // v
                                  .Arg<ffi::AnyBuffer>()  // bias
                                  .Arg<ffi::AnyBuffer>()  // mask
                                  .Arg<ffi::AnyBuffer>()  // seqlens
                                  .Arg<ffi::AnyBuffer>()  // sinks
                                  .Arg<ffi::AnyBuffer>()  // alibi
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Ret<ffi::AnyBuffer>()  // lse
                                  .Attrs<Options>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(fastattn_jax_bwd, backward_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // v
                                  .Arg<ffi::AnyBuffer>()  // out
                                  .Arg<ffi::AnyBuffer>()  // lse
                                  .Arg<ffi::AnyBuffer>()  // dout
                                  .Arg<ffi::AnyBuffer>()  // bias
                                  .Arg<ffi::AnyBuffer>()  // mask
                                  .Arg<ffi::AnyBuffer>()  // seqlens
                                  .Arg<ffi::AnyBuffer>()  // sinks
                                  .Arg<ffi::AnyBuffer>()  // alibi
                                  .Ret<ffi::AnyBuffer>()  // dq
                                  .Ret<ffi::AnyBuffer>()  // dk
                                  .Ret<ffi::AnyBuffer>()  // dv
                                  .Ret<ffi::AnyBuffer>()  // ds
                                  .Attrs<Options>());

// The handlers' addresses, for fastattn._kernels.jax_ffi_targets().
extern "C" void *fa_jax_ffi_forward(void) { return reinterpret_cast<void *>(fastattn_jax_fwd); }
extern "C" void *fa_jax_ffi_backward(void) { return reinterpret_cast<void *>(fastattn_jax_bwd); }
