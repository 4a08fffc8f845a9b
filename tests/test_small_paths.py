"""Every kernel path once, on small shapes, against the float64 oracle.

The other test files cover these paths (and many more shapes) too; this one exists for
lanes where every call is slow: the arm64 lane runs the kernels under qemu-user, where
SVE code costs hundreds of times its native time (.ci/arm64 runs this file under each
emulated CPU).  Each case is a handful of small calls on every kernel this machine runs:
prefill and decode (L = 1, lengths off the block grid, odd D, Lq != Lk both ways, a
strided view, bshd), each variant, float64, float16 and bfloat16 K/V, bfloat16 q/k/v
on every bfloat16 path (forward and backward), the int8 cache, fastattn.KVCache of every dtype, the backward, the bits across thread
counts and call shapes, and arrays against guard pages.
"""
import numpy as np
import pytest

import fastattn
from fastattn import _kernels, reference
from conftest import BF16, TOL, rel_err
from guardpages import guarded


def _qkv(rng, B, H, Lq, Lk, D, dtype=np.float32, Hkv=None, Dv=None):
    Hkv = Hkv or H
    q = rng.standard_normal((B, H, Lq, D)).astype(dtype)
    k = rng.standard_normal((B, Hkv, Lk, D)).astype(dtype)
    v = rng.standard_normal((B, Hkv, Lk, Dv or D)).astype(dtype)
    return q, k, v


def _close(out, ref, dtype=np.float32):
    assert rel_err(np.asarray(out), ref) <= TOL[np.dtype(dtype)], rel_err(np.asarray(out), ref)


# (name, B, H, Hkv, Lq, Lk, D, keywords): prefill and decode shapes, each variant
CASES = [
    ("L1", 1, 2, 2, 1, 1, 8, {}),
    ("prefill odd", 1, 2, 2, 37, 37, 24, {"causal": True}),
    ("Lq<Lk", 2, 2, 2, 5, 70, 17, {"causal": True}),
    ("Lq>Lk", 1, 3, 3, 70, 9, 16, {}),
    ("decode", 2, 4, 4, 1, 83, 32, {"causal": True}),
    ("decode GQA", 1, 4, 2, 1, 65, 16, {}),
    ("prefill GQA", 1, 4, 1, 20, 33, 8, {"causal": True}),
    ("window", 1, 2, 2, 30, 30, 16, {"causal": True, "window": (7, 0)}),
    ("alibi", 1, 2, 2, 19, 29, 16, {"alibi_slopes": np.array([0.5, 0.25])}),
    ("softcap", 1, 2, 2, 21, 21, 16, {"softcap": 5.0}),
    ("top-left", 1, 2, 2, 9, 25, 16, {"causal": "top-left"}),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forward(kernel, rng, case, dtype):
    _, B, H, Hkv, Lq, Lk, D, kw = case
    q, k, v = _qkv(rng, B, H, Lq, Lk, D, dtype, Hkv)
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **kw)
    _close(out, ref, dtype)
    assert np.max(np.abs(lse - ref_lse)) <= 1e-4


def test_mask_bias_sinks_seqlens(kernel, rng):
    q, k, v = _qkv(rng, 2, 2, 11, 26, 16)
    mask = rng.random((2, 1, 11, 26)) > 0.3
    mask[..., 0] = True
    bias = rng.standard_normal((1, 2, 11, 26)).astype(np.float32)
    sinks = np.array([0.5, -1.0], np.float32)
    _close(fastattn.attention(q, k, v, mask=mask, bias=bias, sinks=sinks),
           reference.attention(q, k, v, mask=mask, bias=bias, sinks=sinks))
    out = fastattn.attention(q, k, v, seqlens_k=[26, 13])
    _close(out[1], reference.attention(q[1:], k[1:, :, :13], v[1:, :, :13])[0])


def test_strided_and_bshd(kernel, rng):
    qkv = rng.standard_normal((1, 23, 3, 2, 20)).astype(np.float32)  # fused (B, L, 3, H, D)
    q, k, v = (qkv[:, :, i] for i in range(3))                      # bshd views
    ref = reference.attention(q, k, v, causal=True, layout="bshd")
    _close(fastattn.attention(q, k, v, causal=True, layout="bshd"), ref)


@pytest.mark.parametrize("kvtype", ["float16", "bfloat16"])
def test_16bit_kv(kernel, rng, kvtype):
    if kvtype == "bfloat16" and BF16 is None:
        pytest.skip("ml_dtypes is not installed")
    t = np.float16 if kvtype == "float16" else BF16
    for Lq, Lk in ((1, 77), (18, 41)):
        q, k, v = _qkv(rng, 1, 2, Lq, Lk, 24)
        k16, v16 = k.astype(t), v.astype(t)
        ref = reference.attention(q, k16.astype(np.float64), v16.astype(np.float64), causal=True)
        _close(fastattn.attention(q, k16, v16, causal=True), ref)


@pytest.mark.parametrize("shape", [(1, 2, 2, 19, 35, 32, 32), (1, 4, 2, 37, 20, 9, 5), (2, 2, 1, 3, 70, 16, 24)],
                         ids=lambda s: "x".join(map(str, s)))
def test_bf16_qkv(bf16_kernel, rng, shape):
    """q, k, v bfloat16 on each (kernel, bfloat16 path): the float32 products and the
    pair paths (AVX512-BF16, AMX, BFDOT), odd D and Dv, GQA, Lq != Lk both ways; and
    the backward, its gradients bfloat16."""
    if BF16 is None:
        pytest.skip("ml_dtypes is not installed")
    B, H, Hkv, Lq, Lk, D, Dv = shape
    q, k, v = (x.astype(BF16) for x in _qkv(rng, B, H, Lq, Lk, D, Hkv=Hkv, Dv=Dv))
    ref, ref_lse = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), causal=True, return_lse=True)
    out, lse = fastattn.attention(q, k, v, causal=True, return_lse=True)
    assert out.dtype == BF16 and rel_err(out.astype(np.float64), ref) <= 1e-2
    dout = rng.standard_normal(out.shape).astype(BF16)
    got = fastattn.attention_backward(dout, q, k, v, out, lse, causal=True)
    f64 = [x.astype(np.float64) for x in (dout, q, k, v, out)]
    want = reference.attention_backward(*f64, lse.astype(np.float64), causal=True)
    for g, w in zip(got, want):
        assert g.dtype == BF16 and rel_err(g.astype(np.float64), w) <= 1e-2


def test_bf16_bits_across_threads(bf16_kernel, rng):
    """bfloat16 q, k, v on each path: the same bits on 1 and 2 threads, forward and
    backward; on a pair path not the float32 products' bits (P rounded to bfloat16:
    the pairs ran)."""
    if BF16 is None:
        pytest.skip("ml_dtypes is not installed")
    q, k, v = (x.astype(BF16) for x in _qkv(rng, 1, 4, 45, 45, 24, Hkv=2))
    dout = rng.standard_normal(q.shape).astype(BF16)

    def run(nth):
        out, lse = fastattn.attention(q, k, v, causal=True, return_lse=True, num_threads=nth)
        grads = fastattn.attention_backward(dout, q, k, v, out, lse, causal=True, num_threads=nth)
        return [a.tobytes() for a in (out, *grads)]

    runs = [run(1), run(2)]
    assert runs[0] == runs[1]
    if bf16_kernel[1] != "float32":
        path = _kernels.bf16_path()
        try:
            _kernels.set_bf16_path("float32")
            f32 = run(1)
        finally:
            _kernels.set_bf16_path(path)
        assert all(a != b for a, b in zip(runs[0], f32))


def test_int8_cache(kernel, rng):
    q, k, v = _qkv(rng, 1, 2, 1, 70, 32)
    kq, vq = fastattn.quantize_kv(k), fastattn.quantize_kv(v)
    ref = reference.attention(q, fastattn.dequantize_kv(kq), fastattn.dequantize_kv(vq))
    _close(fastattn.attention(q, kq, vq), ref)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8", "int4"])
def test_kvcache(kernel, rng, dtype):
    if dtype == "bfloat16" and BF16 is None:
        pytest.skip("ml_dtypes is not installed")
    B, Hkv, H, D = 2, 2, 4, 32
    cache = fastattn.KVCache(B, Hkv, D, 96, dtype=dtype)
    k, v = (rng.standard_normal((B, Hkv, 70, D)).astype(np.float32) for _ in range(2))
    cache.append(k, v)
    for Lq in (1, 3):
        q = rng.standard_normal((B, H, Lq, D)).astype(np.float32)
        out = fastattn.attention(q, cache, causal=True)
        for b in range(B):
            ref = reference.attention(q[b:b + 1], cache.keys(b)[None], cache.values(b)[None], causal=True)
            _close(out[b:b + 1], ref)


def test_backward(kernel, rng):
    for dtype in (np.float32, np.float64):
        q, k, v = _qkv(rng, 1, 2, 13, 21, 16, dtype)
        dout = rng.standard_normal(q.shape).astype(dtype)
        out, lse = fastattn.attention(q, k, v, causal=True, return_lse=True)
        ref_out, ref_lse = reference.attention(q, k, v, causal=True, return_lse=True)
        got = fastattn.attention_backward(dout, q, k, v, out, lse, causal=True)
        want = reference.attention_backward(dout, q, k, v, ref_out, ref_lse, causal=True)
        for g, w in zip(got, want):
            assert rel_err(g, w) <= (1e-4 if dtype == np.float32 else 1e-10)


def test_bits_across_threads_and_shapes(kernel, rng):
    """A row's bits on 1 and 2 threads, and decoded alone against the same row of a
    prefill (the docs promise both on every kernel)."""
    q, k, v = _qkv(rng, 1, 2, 40, 40, 24)
    one = fastattn.attention(q, k, v, causal=True, num_threads=1)
    two = fastattn.attention(q, k, v, causal=True, num_threads=2)
    np.testing.assert_array_equal(one, two)
    last = fastattn.attention(q[:, :, -1:], k, v, causal=True, num_threads=2)
    np.testing.assert_array_equal(last, one[:, :, -1:])


def test_guard_pages(kernel, rng):
    """q, k, v flush against PROT_NONE pages (before and after, read-only) and the
    output against one too: a stray read or write faults here."""
    for place in ("end", "start"):
        for Lq, Lk in ((1, 45), (29, 45)):
            q, k, v = _qkv(rng, 1, 2, Lq, Lk, 20)
            ref = reference.attention(q, k, v, causal=True)
            gq, gk, gv = (guarded(x, place=place) for x in (q, k, v))
            out = guarded(np.zeros_like(q), place=place, writable=True)
            fastattn.attention(gq, gk, gv, causal=True, out=out)
            _close(out, ref)


def test_bf16_guard_pages(bf16_kernel, rng):
    """bfloat16 q, k, v (odd D and Dv: the last feature alone in its pair) flush against
    PROT_NONE pages on each bfloat16 path, the output against one too, and the backward
    reading them: a stray read or write faults here."""
    if BF16 is None:
        pytest.skip("ml_dtypes is not installed")
    for place in ("end", "start"):
        for Lq, Lk in ((1, 45), (29, 45)):
            q, k, v = (x.astype(BF16) for x in _qkv(rng, 1, 2, Lq, Lk, 19, Dv=13))
            ref = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), causal=True)
            gq, gk, gv = (guarded(x, place=place) for x in (q, k, v))
            out = guarded(np.zeros((1, 2, Lq, 13), BF16), place=place, writable=True)
            _, lse = fastattn.attention(gq, gk, gv, causal=True, out=out, return_lse=True)
            assert rel_err(out.astype(np.float64), ref) <= 1e-2
            dout = guarded(rng.standard_normal(out.shape).astype(BF16), place=place)
            got = fastattn.attention_backward(dout, gq, gk, gv, guarded(np.array(out), place=place), lse,
                                              causal=True)
            assert all(np.isfinite(g.astype(np.float32)).all() for g in got)
