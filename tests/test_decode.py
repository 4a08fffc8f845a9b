"""Decoding: a few queries against a long KV cache.  Split-KV (chunks fixed by Lk,
partials merged in chunk order), GQA groups stacked, float16 K/V; against the oracle,
bitwise equal on any thread count."""
import numpy as np
import pytest

import fastattn
from fastattn import reference

from conftest import CACHES16, TOL, assert_lse_close, rel_err

LENGTHS = [1, 2, 511, 512, 513, 1500, 4100]


def _cache(rng, B, Hq, Hkv, Lq, Lk, D, Dv, dtype, kv_dtype=None):
    kv_dtype = kv_dtype or dtype
    q = rng.standard_normal((B, Hq, Lq, D)).astype(dtype)
    k = rng.standard_normal((B, Hkv, Lk, D)).astype(kv_dtype)
    v = rng.standard_normal((B, Hkv, Lk, Dv)).astype(kv_dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("Lk", LENGTHS)
@pytest.mark.parametrize("Lq", [1, 4, 8])
def test_decode_against_oracle(kernel, rng, dtype, Lk, Lq):
    q, k, v = _cache(rng, 2, 8, 2, Lq, Lk, 64, 48, dtype)
    for kw in (dict(causal=True), dict(), dict(window=(300, None), causal=True),
               dict(alibi_slopes=np.linspace(0.01, 0.2, 8), softcap=5.0)):
        out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
        ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, **kw)
        assert rel_err(out, ref_out) <= TOL[np.dtype(dtype)], kw
        assert_lse_close(lse, ref_lse, dtype)


@pytest.mark.parametrize("Lk", [513, 4100])
def test_decode_bitwise_across_threads(kernel, rng, Lk):
    q, k, v = _cache(rng, 2, 8, 2, 3, Lk, 40, 40, np.float32)
    mask = rng.random((2, 1, 3, Lk)) > 0.3
    for kw in (dict(causal=True), dict(mask=mask, bias=rng.standard_normal(Lk).astype(np.float32))):
        base = fastattn.attention(q, k, v, num_threads=1, return_lse=True, **kw)
        for n in (2, 3, 8, 2):
            out, lse = fastattn.attention(q, k, v, num_threads=n, return_lse=True, **kw)
            assert np.array_equal(out, base[0]) and np.array_equal(lse, base[1]), n


def test_mask_hiding_whole_chunks(kernel, rng):
    """Keys 0..1499 hidden (whole 512-key chunks and part of one), a row that sees
    nothing at all, and chunks with nothing visible merge as empty parts."""
    q, k, v = _cache(rng, 1, 4, 4, 2, 4100, 32, 32, np.float32)
    mask = np.ones((1, 4, 2, 4100), bool)
    mask[..., :1500] = False
    mask[0, 1, 1] = False                       # head 1, row 1: no visible key
    out, lse = fastattn.attention(q, k, v, mask=mask, return_lse=True)
    ref_out, ref_lse = reference.attention(q, k, v, mask=mask, return_lse=True)
    assert rel_err(out, ref_out) <= TOL[np.dtype(np.float32)]
    assert_lse_close(lse, ref_lse, np.float32)
    assert (out[0, 1, 1] == 0).all() and np.isneginf(lse[0, 1, 1])


@pytest.mark.parametrize("q_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("Lk", [1, 513, 3000])
@pytest.mark.parametrize("Lq", [1, 5, 70])
def test_float16_kv_against_oracle(kernel, rng, q_dtype, Lk, Lq):
    """float16 K/V (and q): against the oracle on the same float16 values; the output
    takes q's dtype, lse is float32."""
    q, k, v = _cache(rng, 2, 6, 3, Lq, Lk, 40, 24, q_dtype, np.float16)
    for kw in (dict(causal=True), dict(window=(100, None), mask=np.arange(Lk) % 5 != 1)):
        out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
        ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, **kw)
        assert out.dtype == q_dtype and lse.dtype == np.float32
        if q_dtype == np.float32:
            assert rel_err(out, ref_out) <= 1e-4
        else:  # within one float16 rounding of the oracle's answer
            np.testing.assert_allclose(out.astype(np.float64), ref_out,
                                       atol=np.abs(ref_out).max() * 2.0 ** -10, rtol=2.0 ** -10)
        assert_lse_close(lse, ref_lse, np.float32)
        for n in (1, 3):
            assert np.array_equal(fastattn.attention(q, k, v, num_threads=n, **kw), out)


def test_float16_views_of_a_preallocated_cache(rng):
    """The README's decode loop: k_cache[:, :, :t] views, float16, no copies."""
    B, H, T, D = 1, 4, 600, 32
    k_cache = np.zeros((B, H, T, D), np.float16)
    v_cache = np.zeros((B, H, T, D), np.float16)
    k_cache[:] = rng.standard_normal(k_cache.shape)
    v_cache[:] = rng.standard_normal(v_cache.shape)
    for t in (1, 300, 513, 600):
        q = rng.standard_normal((B, H, 1, D)).astype(np.float32)
        out = fastattn.attention(q, k_cache[:, :, :t], v_cache[:, :, :t], causal=True)
        ref = reference.attention(q, k_cache[:, :, :t], v_cache[:, :, :t], causal=True)
        assert rel_err(out, ref) <= 1e-4


@pytest.mark.parametrize("q_dtype,kv_dtype", [(np.float64, np.float16), (np.float16, np.float32),
                                              (np.float32, np.float64)])
def test_unsupported_dtype_mixes(rng, q_dtype, kv_dtype):
    q, k, v = _cache(rng, 1, 2, 2, 1, 10, 8, 8, q_dtype, kv_dtype)
    with pytest.raises(TypeError, match="dtype"):
        fastattn.attention(q, k, v)


@pytest.mark.parametrize("kv_dtype", CACHES16)
@pytest.mark.parametrize("shape", [(1, 4, 2, 1, 300, 128), (2, 3, 3, 4, 17, 40), (1, 1, 1, 1, 1, 8)])
def test_16bit_cache_takes_the_compiled_path(rng, monkeypatch, kv_dtype, shape):
    """float32 q against a float16 or bfloat16 cache (a decode step) is the common call:
    run without the Python checks (fastattn._api._attention made to fail, as proof),
    with the bits of the checked path (an explicit scale takes that one) and the
    oracle's values; for 3-D and 2-D arrays too."""
    B, Hq, Hkv, Lq, Lk, D = shape
    q, k, v = _cache(rng, B, Hq, Hkv, Lq, Lk, D, D, np.float32, kv_dtype)
    checked = fastattn.attention(q, k, v, causal=True, scale=1 / np.sqrt(D))
    checked3 = fastattn.attention(q[0], k[0], v[0], scale=1 / np.sqrt(D))
    checked2 = fastattn.attention(q[0, 0], k[0, 0], v[0, 0], scale=1 / np.sqrt(D))

    def no_checked_path(*a, **kw):
        raise AssertionError("took the checked path")

    monkeypatch.setattr(fastattn._api, "_attention", no_checked_path)
    out = fastattn.attention(q, k, v, causal=True)
    assert out.dtype == np.float32 and np.array_equal(out, checked)
    assert np.array_equal(fastattn.attention(q[0], k[0], v[0]), checked3)
    assert np.array_equal(fastattn.attention(q[0, 0], k[0, 0], v[0, 0]), checked2)
    ref = reference.attention(q, k.astype(np.float64), v.astype(np.float64), causal=True)
    assert rel_err(out, ref) <= 1e-4
    # mixed or look-alike caches are not the common call: the checked path answers them
    with pytest.raises(AssertionError, match="checked path"):
        fastattn.attention(q, k, v.astype(np.float32))
    with pytest.raises(AssertionError, match="checked path"):
        fastattn.attention(q, k.view(np.int16), v.view(np.int16))
    monkeypatch.undo()
    with pytest.raises(TypeError, match="dtype"):
        fastattn.attention(q, k.view(np.int16), v.view(np.int16))
