"""q_offset / k_offset: queries and keys placed in a longer sequence (chunked prefill,
blocked schedules).  Every public function that takes them, under every kernel, against
the float64 oracle with the same offsets; the chunked-prefill identities the docstring
states; and the errors."""
import itertools

import numpy as np
import pytest

import fastattn
from fastattn import reference
from conftest import TOL, assert_lse_close, rel_err

F32, F64 = np.dtype(np.float32), np.dtype(np.float64)

# (Lq, Lk, q_offset, k_offset): Lq = 1, lengths off the block multiples, Lq != Lk both
# ways, negative offsets, and placements where some or all rows see no key
PLACES = [(1, 1, 0, 0), (1, 300, 299, 0), (37, 90, 53, 0), (90, 37, 0, 10), (64, 64, 100, 30),
          (33, 129, 5, 200), (50, 20, -7, 0), (17, 40, 0, 60), (1, 1000, 700, 0)]
VARIANTS = {
    "causal": dict(causal=True),
    "window": dict(window=(9, 4)),
    "causal+window": dict(causal=True, window=(20, 0)),
    "alibi": dict(alibi_slopes="slopes"),
    "alibi+causal+softcap": dict(alibi_slopes="slopes", causal=True, softcap=8.0),
    "bias+mask+causal": dict(causal=True, mask="mask", bias="bias"),
    "none": dict(),
}


def _inputs(rng, dt, Lq, Lk, Hq=4, Hkv=2, D=19, Dv=12, B=2):
    q = rng.standard_normal((B, Hq, Lq, D)).astype(dt)
    k = rng.standard_normal((B, Hkv, Lk, D)).astype(dt)
    v = rng.standard_normal((B, Hkv, Lk, Dv)).astype(dt)
    return q, k, v


def _kw(rng, variant, dt, Hq, Lq, Lk):
    kw = dict(VARIANTS[variant])
    if kw.get("alibi_slopes") == "slopes":
        kw["alibi_slopes"] = rng.uniform(0.02, 0.3, Hq).astype(dt)
    if kw.get("mask") == "mask":
        kw["mask"] = rng.random((1, Hq, Lq, Lk)) < 0.8
    if kw.get("bias") == "bias":
        kw["bias"] = rng.standard_normal((Lq, Lk)).astype(dt)
    return kw


@pytest.mark.parametrize("dt", [F32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_attention_with_offsets_matches_the_oracle(kernel, rng, dt, variant):
    for Lq, Lk, qo, ko in PLACES:
        q, k, v = _inputs(rng, dt, Lq, Lk)
        kw = _kw(rng, variant, dt, q.shape[1], Lq, Lk)
        out, lse, st = fastattn.attention(q, k, v, q_offset=qo, k_offset=ko, return_lse=True,
                                          return_stats=True, **kw)
        ro, rl = reference.attention(q, k, v, q_offset=qo, k_offset=ko, return_lse=True, **kw)
        what = (variant, Lq, Lk, qo, ko)
        assert rel_err(out, ro) <= TOL[dt], what
        assert_lse_close(lse, rl, dt)
        ent, _, mx = reference.attention_stats(q, k, q_offset=qo, k_offset=ko, **kw)
        assert np.max(np.abs(st.entropy - ent), initial=0) <= 100 * TOL[dt], what
        assert np.max(np.abs(st.max_weight - mx), initial=0) <= 10 * TOL[dt], what
        w = fastattn.attention_weights(q, k, q_offset=qo, k_offset=ko, **kw)
        assert rel_err(w, reference.attention_weights(q, k, q_offset=qo, k_offset=ko, **kw)) \
            <= TOL[dt], what
        m = fastattn.key_mass(q, k, q_offset=qo, k_offset=ko, **kw)
        rm = reference.key_mass(q, k, q_offset=qo, k_offset=ko, **kw)
        assert np.max(np.abs(m - rm), initial=0) <= 10 * TOL[dt] * max(1, Lq), what


@pytest.mark.parametrize("variant", ["causal+window", "alibi+causal+softcap", "bias+mask+causal"])
def test_backward_with_offsets_matches_the_oracle(kernel, rng, variant):
    dt = F64
    for Lq, Lk, qo, ko in PLACES:
        q, k, v = _inputs(rng, dt, Lq, Lk)
        kw = _kw(rng, variant, dt, q.shape[1], Lq, Lk)
        out, lse = fastattn.attention(q, k, v, q_offset=qo, k_offset=ko, return_lse=True, **kw)
        dout = rng.standard_normal(out.shape)
        got = fastattn.attention_backward(dout, q, k, v, out, lse, q_offset=qo, k_offset=ko,
                                          return_dbias="bias" in kw, **kw)
        want = reference.attention_backward(dout, q, k, v, out, lse, q_offset=qo, k_offset=ko,
                                            return_dbias="bias" in kw, **kw)
        for name, g, r in zip(("dq", "dk", "dv", "dbias"), got, want):
            err = np.max(np.abs(g - r), initial=0) / max(1.0, np.max(np.abs(r), initial=0))
            assert err <= 1e-10, (variant, Lq, Lk, qo, ko, name)   # (a zero gradient: absolute)


def test_offsets_in_bshd_float16_cache_and_seqlens_k(kernel, rng):
    """A float16 KV cache in the "bshd" layout, with seqlens_k: each sequence sees only
    its first seqlens_k[b] keys, on the diagonal the positions give."""
    B, Hq, Hkv, Lq, Lk, D = 3, 4, 1, 9, 70, 16
    q = rng.standard_normal((B, Lq, Hq, D)).astype(F32)
    k = rng.standard_normal((B, Lk, Hkv, D)).astype(np.float16)
    v = rng.standard_normal((B, Lk, Hkv, D)).astype(np.float16)
    sl = np.array([70, 0, 41])
    slopes = rng.uniform(0.05, 0.2, Hq).astype(F32)
    kw = dict(causal=True, window=(30, None), alibi_slopes=slopes, layout="bshd")
    out, lse = fastattn.attention(q, k, v, q_offset=40, seqlens_k=sl, return_lse=True, **kw)
    keys = np.arange(Lk) < sl[:, None]                       # (B, Lk)
    mask = np.broadcast_to(keys[:, None, None, :], (B, Hq, Lq, Lk))
    ro, rl = reference.attention(q, k, v, q_offset=40, mask=mask, return_lse=True, **kw)
    assert rel_err(out, ro) <= TOL[F32]
    assert_lse_close(lse, rl, F32)
    assert np.all(np.isneginf(lse[1])) and not np.any(out[1])


def test_chunked_prefill_equals_the_whole_call_bitwise(kernel, rng):
    """Query chunks against the whole cache, each told where it starts, give the rows of
    the whole causal call bit for bit (a row's bits do not depend on the rows beside it,
    and the chunk's diagonal is the whole call's)."""
    for dt in (F32, F64):
        q, k, v = _inputs(rng, dt, 150, 150)
        slopes = rng.uniform(0.02, 0.3, 4).astype(dt)
        for kw in (dict(causal=True), dict(causal=True, window=(33, 0), alibi_slopes=slopes),
                   dict(window=(10, 10), alibi_slopes=slopes)):
            whole, wl = fastattn.attention(q, k, v, return_lse=True, **kw)
            for s, e in [(0, 1), (1, 64), (64, 150), (77, 78)]:
                o, l_ = fastattn.attention(q[:, :, s:e], k, v, q_offset=s, return_lse=True, **kw)
                np.testing.assert_array_equal(o, whole[:, :, s:e])
                np.testing.assert_array_equal(l_, wl[:, :, s:e])
                if kw.get("causal"):  # the cache filled only up to the chunk's end
                    o, l_ = fastattn.attention(q[:, :, s:e], k[:, :, :e], v[:, :, :e],
                                               q_offset=s, return_lse=True, **kw)
                    np.testing.assert_array_equal(o, whole[:, :, s:e])
                    np.testing.assert_array_equal(l_, wl[:, :, s:e])


def test_key_chunks_with_k_offset_merge_to_the_whole(kernel, rng):
    """A cache split into key chunks, each told where its keys start, merged by
    fastattn.merge: the whole causal call within rounding."""
    q, k, v = _inputs(rng, F64, 40, 200)
    kw = dict(causal=True, alibi_slopes=np.linspace(0.05, 0.2, 4))
    want, wl = fastattn.attention(q, k, v, return_lse=True, **kw)
    parts = [fastattn.attention(q, k[:, :, a:b], v[:, :, a:b], q_offset=160, k_offset=a,
                                return_lse=True, **kw) for a, b in [(0, 64), (64, 129), (129, 200)]]
    out, lse = fastattn.merge([p[0] for p in parts], [p[1] for p in parts])
    assert rel_err(out, want) <= 1e-12
    np.testing.assert_allclose(lse, wl, rtol=0, atol=1e-12)


def test_offsets_bitwise_across_threads(rng):
    q, k, v = _inputs(rng, F32, 70, 300)
    kw = dict(causal=True, window=(100, 0), q_offset=230, k_offset=0, return_lse=True)
    one = fastattn.attention(q, k, v, num_threads=1, **kw)
    for n in (2, 3, 7):
        for a, b in zip(one, fastattn.attention(q, k, v, num_threads=n, **kw)):
            np.testing.assert_array_equal(a, b)


def test_offsets_that_equal_the_lengths_change_no_bit(rng):
    """q_offset = Lk - Lq, k_offset = 0 is the bottom-right alignment: the same bits as
    without offsets, on the compiled fast path's shapes too."""
    for Lq, Lk in [(1, 513), (40, 40), (70, 33), (33, 70)]:
        q, k, v = _inputs(rng, F32, Lq, Lk)
        for causal in (False, True):
            a = fastattn.attention(q, k, v, causal=causal, return_lse=True)
            b = fastattn.attention(q, k, v, causal=causal, return_lse=True, q_offset=Lk - Lq,
                                   k_offset=0)
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("fn", ["attention", "attention_weights", "key_mass", "attention_backward"])
def test_offset_errors_name_the_argument(rng, fn):
    q, k, v = _inputs(rng, F32, 5, 6)

    def call(**kw):
        if fn == "attention":
            return fastattn.attention(q, k, v, **kw)
        if fn == "attention_backward":
            out, lse = fastattn.attention(q, k, v, return_lse=True)
            return fastattn.attention_backward(out, q, k, v, out, lse, **kw)
        return getattr(fastattn, fn)(q, k, **kw)

    for bad in (1.5, "3", True, np.array([2])):
        with pytest.raises(TypeError, match=f"fastattn.{fn}: q_offset must be an int"):
            call(q_offset=bad)
        with pytest.raises(TypeError, match=f"fastattn.{fn}: k_offset must be an int"):
            call(q_offset=0, k_offset=bad)
    with pytest.raises(ValueError, match=r"q_offset must be in \[-2\*\*53, 2\*\*53\]"):
        call(q_offset=2 ** 60)
    with pytest.raises(ValueError, match="causal='top-left' aligns the rows by the lengths"):
        call(k_offset=np.int64(3), causal="top-left")
    call(q_offset=np.int32(4), k_offset=-(2 ** 53))  # NumPy ints and the bound itself pass


def test_offsets_in_the_bshd_layout(rng):
    """Offsets with causal and windows on both sides, in the "bshd" layout (strided
    views into (B, L, H, D)), against the oracle."""
    q, k, v = (x.swapaxes(1, 2) for x in _inputs(rng, F64, 6, 11, D=8, Dv=8))  # bshd
    for causal, window, qo in itertools.product((False, True), (None, (2, 3)), (0, 9, -3)):
        kw = dict(causal=causal, window=window, q_offset=qo, k_offset=2)
        out = fastattn.attention(q, k, v, layout="bshd", **kw)
        assert rel_err(out, reference.attention(q, k, v, layout="bshd", **kw)) <= 1e-12
