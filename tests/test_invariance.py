"""Batch invariance: a query row's output and lse are the same bits whatever call it
is computed in (single queries, chunks of a chunked prefill with the matching causal
offset, sub-batches, head subsets, bshd, strided views, varlen, torch), on every CPU
kernel this machine runs and for 1, 2 and 3 threads; and seqlens_k (per-sequence key
lengths) against the oracle and bitwise against each sequence alone on its keys."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import fastattn
from fastattn import reference
from conftest import CACHES16, TOL, assert_lse_close, rel_err

F32 = np.float32


def same_bits(a, b):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    assert a.shape == b.shape
    assert a.tobytes() == b.tobytes(), f"max |diff| {np.max(np.abs(a.astype(np.float64) - b))}"


def big(rng, B, Hq, Hkv, L, D, dtype=F32):
    q = rng.standard_normal((B, Hq, L, D)).astype(dtype)
    k, v = (rng.standard_normal((B, Hkv, L, D)).astype(dtype) for _ in range(2))
    return q, k, v


VARIANTS = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window=(70, 0)),
    "window_both": dict(window=(40, 25)),
    "alibi_causal": "alibi",
    "softcap": dict(softcap=5.0, causal=True),
}


def kw_for(name, B, H):
    v = VARIANTS[name]
    if isinstance(v, dict):
        return dict(v)
    return dict(causal=True, alibi_slopes=np.linspace(0.05, 0.5, H).astype(F32))


def sub_kw(kw, b=slice(None), h=slice(None)):
    """Keywords for a sub-batch / head subset (ALiBi slopes sliced with the heads)."""
    out = dict(kw)
    if "alibi_slopes" in kw:
        out["alibi_slopes"] = kw["alibi_slopes"][h]
    return out


@pytest.mark.parametrize("name,dtype", [(n, F32) for n in VARIANTS] +
                         [(n, np.float64) for n in ("plain", "causal", "softcap")])
@pytest.mark.parametrize("nth", [1, 2, 3])
def test_rows_do_not_depend_on_the_call(kernel, rng, name, dtype, nth):
    """(float64 too: on AVX2 its prefill blocks run P.V with the output transposed,
    fa_pvt_tile, and its decode rows the row-major product: the same bits)"""
    B, H, Hkv, L, D = 3, 4, 2, 1100, 32  # keys past two 512-key chunks
    q, k, v = big(rng, B, H, Hkv, L, D, dtype)
    kw = kw_for(name, B, H)
    full, lse = fastattn.attention(q, k, v, return_lse=True, num_threads=nth, **kw)
    causal = kw.get("causal", False)
    # the last n queries alone (decoding and chunked prefill: bottom-right alignment
    # is kept because the key length is the same), any n
    for n in (1, 2, 3, 8, 9, 64, 200, 333):
        o, l = fastattn.attention(q[:, :, -n:], k, v, return_lse=True, num_threads=nth, **kw)
        same_bits(o, full[:, :, -n:])
        same_bits(l, lse[:, :, -n:])
    # a chunk in the middle of a chunked prefill: its keys end at its last query
    if causal and "window" not in kw:
        i0, i1 = 300, 700
        o, l = fastattn.attention(q[:, :, i0:i1], k[:, :, :i1], v[:, :, :i1], return_lse=True,
                                  num_threads=nth, **kw)
        same_bits(o, full[:, :, i0:i1])
        same_bits(l, lse[:, :, i0:i1])
    # sub-batches and head subsets (a whole GQA group)
    o = fastattn.attention(q[1:2], k[1:2], v[1:2], num_threads=nth, **kw)
    same_bits(o, full[1:2])
    o = fastattn.attention(q[:, 2:4], k[:, 1:2], v[:, 1:2], num_threads=nth, **sub_kw(kw, h=slice(2, 4)))
    same_bits(o, full[:, 2:4])


@pytest.mark.parametrize("dtype,D", [(F32, 64), (F32, 128), (F32, 256), (np.float64, 64),
                                     (np.float64, 128)])
def test_decoded_rows_without_causal_are_the_causal_prefill_rows(kernel, rng, dtype, D):
    """A row decoded with causal=False (one query against the keys up to its position,
    as transformers passes a decoding step) has the bits of the same row in the causal
    prefill: the kernel's key tiles do not depend on the causal flag (fa_default_blocks;
    on AVX2 float64 D128 and float32 D256 they once did through the L2 budget)."""
    q, k, v = big(rng, 1, 2, 2, 900, D, dtype)
    full, lse = fastattn.attention(q, k, v, causal=True, return_lse=True)
    for i in (0, 63, 64, 500, 899):
        o, l = fastattn.attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], return_lse=True)
        same_bits(o, full[:, :, i:i + 1])
        same_bits(l, lse[:, :, i:i + 1])


def test_layouts_strides_and_varlen(rng):
    B, H, L, D = 2, 2, 700, 16
    q, k, v = big(rng, B, H, H, L, D)
    full, lse = fastattn.attention(q, k, v, causal=True, return_lse=True)
    # bshd views of a fused projection (strided rows)
    qkv = np.stack([x.swapaxes(1, 2) for x in (q, k, v)], axis=2)  # (B, L, 3, H, D)
    o = fastattn.attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True, layout="bshd")
    same_bits(o.swapaxes(1, 2), full)
    # strided (every other head of a bigger array)
    q2, k2, v2 = (np.repeat(x, 2, axis=1) for x in (q, k, v))
    same_bits(fastattn.attention(q2[:, ::2], k2[:, ::2], v2[:, ::2], causal=True), full)
    # padded batch versus varlen: sequences of different lengths, each one alone
    lens = [700, 300, 1]
    cu = np.r_[0, np.cumsum(lens)]
    qs = np.concatenate([q[b % B, :, :n].swapaxes(0, 1) for b, n in enumerate(lens)])
    ks = np.concatenate([k[b % B, :, :n].swapaxes(0, 1) for b, n in enumerate(lens)])
    vs = np.concatenate([v[b % B, :, :n].swapaxes(0, 1) for b, n in enumerate(lens)])
    out, vl = fastattn.varlen_attention(qs, ks, vs, cu, cu, causal=True, return_lse=True)
    for b, n in enumerate(lens):
        alone, al = fastattn.attention(q[b % B, :, :n], k[b % B, :, :n], v[b % B, :, :n], causal=True,
                                       return_lse=True)
        same_bits(out[cu[b]:cu[b + 1]].swapaxes(0, 1), alone)
        same_bits(vl[:, cu[b]:cu[b + 1]], al)


@pytest.mark.parametrize("kv_dtype", CACHES16)
@pytest.mark.parametrize("Hq,Hkv,D", [(8, 2, 64), (2, 2, 40), (3, 1, 48), (1, 1, 7)])
def test_16bit_cache_and_stats_paths(kernel, rng, kv_dtype, Hq, Hkv, D):
    """A decode row against a float16 / bfloat16 cache has its prefill row's bits: one
    row or a GQA group's, D a multiple of two chunks or not (the 16-bit transposes of
    two chunks at once, then single chunks), on every kernel."""
    q = rng.standard_normal((1, Hq, 600, D)).astype(F32)
    k, v = (rng.standard_normal((1, Hkv, 1500, D)).astype(kv_dtype) for _ in range(2))
    full, lse = fastattn.attention(q, k, v, causal=True, return_lse=True)
    o, l = fastattn.attention(q[:, :, -1:], k, v, causal=True, return_lse=True)
    same_bits(o, full[:, :, -1:])
    # asking for statistics takes the one-pass path for a decode row: the same bits
    o2, l2, _ = fastattn.attention(q[:, :, -1:], k, v, causal=True, return_lse=True, return_stats=True)
    same_bits(o2, o)
    same_bits(l2, l)


def test_torch_tensors_give_the_numpy_bits(rng):
    torch = pytest.importorskip("torch")
    q, k, v = big(rng, 1, 2, 2, 600, 16)
    full = fastattn.attention(q, k, v, causal=True)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    same_bits(fastattn.attention(tq[:, :, -1:], tk, tv, causal=True), full[:, :, -1:])


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 1300), st.integers(1, 300),
       st.sampled_from([False, True]), st.integers(0, 2**31))
def test_random_chunks(B, H, Lk, n, causal, seed):
    """Random shapes: the last n queries of an Lq = min(Lk, ...) prefill alone."""
    rng = np.random.default_rng(seed)
    Lq = min(Lk, 1 + seed % 400)
    n = min(n, Lq)
    q = rng.standard_normal((B, H, Lq, 8)).astype(F32)
    k, v = (rng.standard_normal((B, H, Lk, 8)).astype(F32) for _ in range(2))
    full = fastattn.attention(q, k, v, causal=causal)
    same_bits(fastattn.attention(q[:, :, -n:], k, v, causal=causal), full[:, :, -n:])


# ---------------------------------------------------------------- seqlens_k

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window=(20, 3)),
                                dict(causal=True, alibi_slopes=None)], ids=["plain", "causal", "window", "alibi"])
def test_seqlens_k(kernel, rng, dtype, kw):
    B, Hq, Hkv, Lq, Lk, D = 4, 4, 2, 5, 900, 16
    q = rng.standard_normal((B, Hq, Lq, D)).astype(dtype)
    k, v = (rng.standard_normal((B, Hkv, Lk, D)).astype(dtype) for _ in range(2))
    kw = dict(kw)
    if "alibi_slopes" in kw:
        kw["alibi_slopes"] = rng.random(Hq).astype(dtype)
    lens = np.array([900, 513, 7, 0])
    out, lse = fastattn.attention(q, k, v, seqlens_k=lens, return_lse=True, **kw)
    for b, n in enumerate(lens):
        alone, al = fastattn.attention(q[b], k[b, :, :n], v[b, :, :n], return_lse=True, **kw)
        same_bits(out[b], alone)  # the same bits as the sequence alone on its keys
        same_bits(lse[b], al)
        # the oracle with the equivalent explicit mask: keys >= n hidden, causal aligned to n
        mask = np.zeros((Lq, Lk), bool)
        ref_kw = dict(kw)
        if n:
            vis = reference.attention_weights(np.ones((Hq, Lq, 1)), np.ones((Hkv, n, 1)), **ref_kw) > 0
            mask[:, :n] = vis[0]
        ref_kw.pop("causal", None), ref_kw.pop("window", None)
        if "alibi_slopes" in kw and n:
            ref, rl = reference.attention(q[b], k[b, :, :n], v[b, :, :n], return_lse=True, **kw)
        else:
            ref, rl = reference.attention(q[b], k[b], v[b], mask=mask, return_lse=True,
                                          **{a: c for a, c in ref_kw.items() if a != "alibi_slopes"})
        assert rel_err(out[b], ref) <= TOL[np.dtype(dtype)] or n == 0
        assert_lse_close(lse[b], rl, dtype)
    np.testing.assert_array_equal(out[3], 0)
    assert np.all(np.isneginf(lse[3]))


def test_seqlens_k_everywhere(rng):
    B, H, Lq, Lk, D = 3, 2, 4, 300, 8
    q = rng.standard_normal((B, H, Lq, D))
    k, v = (rng.standard_normal((B, H, Lk, D)) for _ in range(2))
    dout = rng.standard_normal((B, H, Lq, D))
    lens = np.array([300, 100, 1])
    w = fastattn.attention_weights(q, k, seqlens_k=lens, causal=True)
    out, lse = fastattn.attention(q, k, v, seqlens_k=lens, causal=True, return_lse=True)
    grads = fastattn.attention_backward(dout, q, k, v, out, lse, seqlens_k=lens, causal=True)
    mass = fastattn.key_mass(q, k, seqlens_k=lens, causal=True)
    _, stats = fastattn.attention(q, k, v, seqlens_k=lens, causal=True, return_stats=True)
    for b, n in enumerate(lens):
        kb, vb = k[b, :, :n], v[b, :, :n]
        np.testing.assert_allclose(w[b, :, :, :n], fastattn.attention_weights(q[b], kb, causal=True), atol=1e-15)
        np.testing.assert_array_equal(w[b, :, :, n:], 0)
        ob, lb = fastattn.attention(q[b], kb, vb, causal=True, return_lse=True)
        gb = fastattn.attention_backward(dout[b], q[b], kb, vb, ob, lb, causal=True)
        np.testing.assert_allclose(grads[0][b], gb[0], atol=1e-13)
        np.testing.assert_allclose(grads[1][b, :, :n], gb[1], atol=1e-13)
        np.testing.assert_array_equal(grads[1][b, :, n:], 0)
        np.testing.assert_array_equal(grads[2][b, :, n:], 0)
        np.testing.assert_allclose(mass[b, :, :n], fastattn.key_mass(q[b], kb, causal=True), atol=1e-13)
        np.testing.assert_array_equal(mass[b, :, n:], 0)
        _, sb = fastattn.attention(q[b], kb, vb, causal=True, return_stats=True)
        np.testing.assert_allclose(stats.entropy[b], sb.entropy, atol=1e-13)


def test_seqlens_k_errors(rng):
    q = rng.standard_normal((2, 2, 3, 8))
    k = rng.standard_normal((2, 2, 10, 8))
    with pytest.raises(ValueError, match=r"seqlens_k must be in \[0, Lk=10\], got \[11, 2\]"):
        fastattn.attention(q, k, k, seqlens_k=[11, 2])
    with pytest.raises(ValueError, match=r"seqlens_k must be in \[0, Lk=10\], got \[-1, 2\]"):
        fastattn.attention(q, k, k, seqlens_k=np.array([-1, 2]))
    with pytest.raises(ValueError, match=r"seqlens_k must have shape \(B,\) = \(2,\)"):
        fastattn.attention(q, k, k, seqlens_k=[3])
    with pytest.raises(TypeError, match="seqlens_k must be an integer array"):
        fastattn.attention(q, k, k, seqlens_k=[3.0, 2.0])


def test_seqlens_k_reads_only_the_keys_it_needs(rng):
    """A batch of decode rows at different positions: keys past each length are never
    read (they hold NaN here, which would poison any row that touched them)."""
    B, H, Lk, D = 4, 4, 3000, 16
    q = rng.standard_normal((B, H, 1, D)).astype(F32)
    k, v = (rng.standard_normal((B, H, Lk, D)).astype(F32) for _ in range(2))
    lens = np.array([3000, 700, 513, 1])
    for b, n in enumerate(lens):
        k[b, :, n:] = np.nan
        v[b, :, n:] = np.nan
    out = fastattn.attention(q, k, v, seqlens_k=lens)
    assert np.all(np.isfinite(out))
