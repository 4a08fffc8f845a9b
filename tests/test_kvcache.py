"""fastattn.KVCache: a cache fastattn owns, keys stored on the SIMD lanes in blocks.

Attention over a cache is exact attention over ``cache.keys(b)`` and
``cache.values(b)`` of each slot (the float64 oracle), under every kernel, every
dtype, every variant, for decoding, speculative rows and prefill chunks; a decode row
has the bits of the same row of a prefill over the same cache, on any thread count
and batch composition; quantization stores what the docstring says, with errors no
worse than llama.cpp's q8_0 / q4_0 on the same data; bad calls raise and change
nothing; the kernels read nothing outside the cache's arrays (guard pages)."""
import os
import subprocess
import sys

import numpy as np
import pytest

import fastattn
from fastattn import KVCache, reference
from conftest import BF16, KERNELS, rel_err

HERE = os.path.dirname(os.path.abspath(__file__))
DTYPES = ["float32", "float16",
          pytest.param("bfloat16", marks=pytest.mark.skipif(BF16 is None, reason="ml_dtypes is not installed")),
          "int8", "int4"]
QUANT = ("int8", "int4")


def _normal(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def _filled(rng, B, H, D, Dv, lengths, dtype, capacity=None, block_size=None, chunks=1):
    """A cache with lengths[b] tokens in slot b, appended in `chunks` ragged pieces; the
    float32 keys and values appended."""
    L = max(lengths)
    cap = capacity or L + 40
    c = KVCache(B, H, D, cap, dtype=dtype, v_head_dim=Dv, block_size=block_size)
    k, v = _normal(rng, (B, H, L, D)), _normal(rng, (B, H, L, Dv))
    lengths = np.asarray(lengths)
    cuts = np.linspace(0, 1, chunks + 1)
    for a, b in zip(cuts[:-1], cuts[1:]):
        lo, hi = np.floor(a * lengths).astype(int), np.floor(b * lengths).astype(int)
        n = int((hi - lo).max())
        if n == 0:
            continue
        kk = np.zeros((B, H, n, D), np.float32)
        vv = np.zeros((B, H, n, Dv), np.float32)
        for s in range(B):
            kk[s, :, :hi[s] - lo[s]] = k[s, :, lo[s]:hi[s]]
            vv[s, :, :hi[s] - lo[s]] = v[s, :, lo[s]:hi[s]]
        c.append(kk, vv, lengths=hi - lo)
    np.testing.assert_array_equal(c.lengths, lengths)
    return c, k, v


def _oracle(q, c, **kw):
    """Each slot's rows by the float64 oracle over cache.keys(b) and cache.values(b)."""
    outs, lses = [], []
    for b in range(c.batch):
        kb, vb = c.keys(b)[None].astype(np.float64), c.values(b)[None].astype(np.float64)
        extra = {name: (val[b:b + 1] if name in ("mask", "bias") and np.ndim(val) == 4 else val)
                 for name, val in kw.items()}
        if "mask" in extra and np.ndim(extra["mask"]) == 4:
            extra["mask"] = extra["mask"][..., :kb.shape[2]]
        if "bias" in extra and np.ndim(extra["bias"]) == 4:
            extra["bias"] = extra["bias"][..., :kb.shape[2]]
        o, lse = reference.attention(q[b:b + 1].astype(np.float64), kb, vb, return_lse=True, **extra)
        outs.append(o)
        lses.append(lse)
    return np.concatenate(outs), np.concatenate(lses)


# ---------------------------------------------------------------- against the oracle

SHAPES = [  # B, Hq, Hkv, D, Dv, lengths, Lq, block_size
    (1, 4, 4, 64, 64, [1], 1, None),                 # one token
    (2, 8, 2, 64, 64, [300, 77], 1, None),           # GQA decode, ragged, not block multiples
    (2, 4, 1, 37, 21, [129, 64], 3, None),           # MQA, odd D and Dv, speculative rows
    (3, 6, 3, 128, 96, [700, 1, 513], 1, 32),        # split-KV decode, a slot of one token
    (1, 2, 2, 48, 48, [200], 40, None),              # a prefill chunk
    (2, 2, 2, 16, 16, [90, 90], 90, 16),             # a whole prefill, Lq = Lk
    (1, 3, 1, 128, 128, [1000], 1, None),            # three rows a kv head (four key groups
    (1, 6, 2, 64, 64, [611], 1, 32),                 # at once on avx512), one a block of 32
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"B{s[0]}Hq{s[1]}Hkv{s[2]}D{s[3]}Lq{s[6]}")
def test_cache_against_the_oracle(rng, kernel, dtype, shape):
    B, Hq, Hkv, D, Dv, lengths, Lq, bs = shape
    c, _, _ = _filled(rng, B, Hkv, D, Dv, lengths, dtype, block_size=bs, chunks=2)
    q = _normal(rng, (B, Hq, Lq, D))
    for causal in (True, False):
        out, lse = fastattn.attention(q, c, causal=causal, return_lse=True)
        ref, ref_lse = _oracle(q, c, causal=causal)
        assert out.dtype == np.float32 and out.shape == (B, Hq, Lq, Dv)
        assert rel_err(out, ref) < 3e-5, (dtype, causal)
        np.testing.assert_allclose(lse, ref_lse, atol=3e-5 * max(1, np.abs(ref_lse).max()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_variant(rng, kernel, dtype):
    B, Hq, Hkv, D = 2, 4, 2, 32
    c, _, _ = _filled(rng, B, Hkv, D, D, [150, 97], dtype)
    Lk = 150
    for Lq in (1, 5):
        q = _normal(rng, (B, Hq, Lq, D))
        mask = rng.random((B, 1, Lq, Lk)) < 0.8
        mask[..., 0] = True
        bias = _normal(rng, (B, Hq, Lq, Lk))
        cases = [dict(causal=True, window=(40, 0)), dict(causal=True, alibi_slopes=np.array([0.5, 0.25, 0.1, 0.05])),
                 dict(causal=True, softcap=3.0), dict(causal=True, sinks=np.array([0.0, 1.0, -1.0, 2.0], np.float32)),
                 dict(mask=mask), dict(bias=bias), dict(causal=True, scale=0.3), dict(window=(10, 10))]
        for kw in cases:
            out = fastattn.attention(q, c, **kw)
            ref, _ = _oracle(q, c, **kw)
            assert rel_err(out, ref) < 3e-5, (dtype, Lq, sorted(kw))
        out, lse, stats = fastattn.attention(q, c, causal=True, return_lse=True, return_stats=True)
        for b in range(B):
            want = fastattn.attention(q[b:b + 1], c.keys(b)[None], c.values(b)[None], causal=True,
                                      return_stats=True)[1]
            np.testing.assert_allclose(stats.entropy[b:b + 1], want.entropy, atol=1e-5)
            np.testing.assert_allclose(stats.max_weight[b:b + 1], want.max_weight, atol=1e-6)


@pytest.mark.parametrize("dtype", ["int8", "int4", "float16"])
@pytest.mark.parametrize("qdt", [np.float16, "bfloat16"])
def test_16_bit_queries(rng, dtype, qdt):
    if qdt == "bfloat16":
        if BF16 is None:
            pytest.skip("ml_dtypes is not installed")
        qdt = BF16
    if dtype == "float16" and qdt == BF16:
        dtype = "bfloat16"
    c, _, _ = _filled(rng, 1, 2, 64, 64, [100], dtype)
    q = _normal(rng, (1, 4, 1, 64)).astype(qdt)
    out = fastattn.attention(q, c, causal=True)
    assert out.dtype == np.dtype(qdt)
    ref, _ = _oracle(q.astype(np.float32), c, causal=True)
    assert rel_err(out.astype(np.float32), ref) < 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_staging_of_the_lanes_equals_the_rows(rng, kernel, dtype):
    """Prefill rows reach the kernel as rows (KVCache._rows); the kernel's own staging
    of the blocks (fa_lanes_tile: a prefill tile over K on the lanes, the fallback of
    every path that is not a decode row) gives the same bits, under every kernel."""
    from fastattn._api import _attention
    c, _, _ = _filled(rng, 2, 2, 48, 40, [140, 77], dtype)
    q = _normal(rng, (2, 4, 60, 48))
    for causal in (True, False):
        want = fastattn.attention(q, c, causal=causal)
        src = c._source(q, "attention")
        got = _attention(q, src, None, None, causal, None, None, None, None, None, 0.0, None,
                         c.lengths, "bhsd", False, False, None, None, (None, None, 0))
        assert np.array_equal(got, want), causal


@pytest.mark.parametrize("dtype", DTYPES)
def test_common_call_equals_the_general_path(rng, dtype):
    """The common call (no variant: parameters built in KVCache._decode) and the
    general path (here through return_lse) give the same bits, float32 and 16-bit q."""
    c, _, _ = _filled(rng, 2, 2, 64, 64, [130, 70], dtype)
    qs = [_normal(rng, (2, 4, 3, 64))]
    if dtype in ("float16", "bfloat16"):
        qs.append(qs[0].astype(np.float16 if dtype == "float16" else BF16))
    for q in qs:
        for causal in (True, False):
            fast = fastattn.attention(q, c, causal=causal)
            general, _ = fastattn.attention(q, c, causal=causal, return_lse=True)
            assert fast.dtype == q.dtype and np.array_equal(fast, general)


def test_strided_queries_and_out(rng):
    c, _, _ = _filled(rng, 2, 2, 32, 32, [70, 40], "int8")
    big = _normal(rng, (2, 4, 3, 64))
    q = big[:, :, :, ::2]  # a non-contiguous last axis: copied
    q2 = big[:, :, 1:2, 32:]  # a strided view read in place
    for qq in (q, q2):
        ref, _ = _oracle(np.ascontiguousarray(qq), c, causal=True)
        assert rel_err(fastattn.attention(qq, c, causal=True), ref) < 3e-5
    out = np.zeros((2, 4, 1, 32), np.float32)
    res = fastattn.attention(q2, c, causal=True, out=out)
    assert res is out and np.array_equal(out, fastattn.attention(np.ascontiguousarray(q2), c, causal=True))


# ---------------------------------------------------------------- bits

@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_row_has_the_bits_of_the_prefill_row(rng, kernel, dtype):
    """The last row of a prefill over the cache, the same row decoded alone (Lq = 1), on
    1, 2 and 3 threads, in a batch of 3 slots and alone in a batch of 1: all one bits."""
    B, Hq, Hkv, D = 3, 8, 2, 64
    c, k, v = _filled(rng, B, Hkv, D, D, [1100, 37, 600], dtype, chunks=3)
    q = _normal(rng, (B, Hq, 37, D))
    prefill = fastattn.attention(q, c, causal=True, num_threads=2)
    for nt in (1, 2, 3):
        dec = fastattn.attention(q[:, :, -1:], c, causal=True, num_threads=nt)
        assert np.array_equal(dec, prefill[:, :, -1:]), nt
        again = fastattn.attention(q, c, causal=True, num_threads=nt)
        assert np.array_equal(again, prefill), nt
    # slot 0 alone, the same tokens appended the same way
    alone = KVCache(1, Hkv, D, c.capacity, dtype=dtype)
    alone.append(k[:1, :, :1100 // 3], v[:1, :, :1100 // 3])
    alone.append(k[:1, :, 1100 // 3:1100], v[:1, :, 1100 // 3:1100])
    assert np.array_equal(alone.keys(0), c.keys(0)) and np.array_equal(alone.values(0), c.values(0))
    assert np.array_equal(fastattn.attention(q[:1, :, -1:], alone, causal=True), prefill[:1, :, -1:])


FUSED = [  # Hq, Hkv, D, Dv, lengths, block_size: one or two query heads a kv head, output
    # rows of 2, 4 and 8 vectors of either x86 kernel's width, odd and wide D, every block size
    (4, 4, 64, 64, [1100, 777], None),
    (4, 2, 128, 128, [600, 1025], 16),
    (2, 2, 37, 32, [900, 300], None),
    (2, 1, 256, 128, [700, 513], 64),
    (2, 2, 64, 16, [520, 1000], 32),
]


@pytest.mark.parametrize("dtype", ["float32", "float16",
                                   pytest.param("bfloat16", marks=pytest.mark.skipif(
                                       BF16 is None, reason="ml_dtypes is not installed"))])
@pytest.mark.parametrize("shape", FUSED, ids=lambda s: f"Hq{s[0]}Hkv{s[1]}D{s[2]}Dv{s[3]}bs{s[5]}")
def test_decode_rows_with_the_next_tiles_products_fused(rng, kernel, dtype, shape):
    """Decode blocks of one or two rows over a float cache, where a tile's P.V runs in
    one loop with QK^T of the next tile (fa_pv_qk, on Intel's x86 CPUs; elsewhere, and
    for more rows, the loops apart): the rows of Lq 1 to 4 have the bits of the same rows
    of a prefill, on 1, 2 and 3 threads; against the oracle with a window and sinks; a V
    row with an inf (the careful P.V after a fused one) and a K row with a NaN give the
    oracle's rows."""
    Hq, Hkv, D, Dv, lengths, bs = shape
    B = len(lengths)
    c, k, v = _filled(rng, B, Hkv, D, Dv, lengths, dtype, block_size=bs, chunks=2)
    q = _normal(rng, (B, Hq, 6, D))
    prefill = fastattn.attention(q, c, causal=True)
    for nt in (1, 2, 3):
        for lq in (1, 2, 3, 4):
            dec = fastattn.attention(q[:, :, -lq:], c, causal=True, num_threads=nt)
            assert np.array_equal(dec, prefill[:, :, -lq:]), (nt, lq)
    qd = q[:, :, -1:]
    sinks = np.linspace(-1, 1, Hq).astype(np.float32)
    for kw in (dict(causal=True), dict(causal=True, window=(300, 0)), dict(causal=True, sinks=sinks)):
        out, lse = fastattn.attention(qd, c, return_lse=True, **kw)
        ref, ref_lse = _oracle(qd, c, **kw)
        assert rel_err(out, ref) < 3e-5, sorted(kw)
        np.testing.assert_allclose(lse, ref_lse, atol=3e-5 * max(1, np.abs(ref_lse).max()))
    # a non-finite V value in slot 0's keys 130..: the tile's P.V (fused with the next
    # tile's QK^T) is redone by the careful path; a NaN key gives NaN rows, as the oracle
    for j, val, which in ((130, np.inf, "v"), (200, np.nan, "k")):
        odd = KVCache(B, Hkv, D, c.capacity, dtype=dtype, v_head_dim=Dv, block_size=bs)
        kk, vv = k.copy(), v.copy()
        (vv if which == "v" else kk)[0, :, j, 3] = val
        for b in range(B):
            odd.append(kk[b:b + 1, :, :lengths[b]], vv[b:b + 1, :, :lengths[b]], slots=[b])
        out = fastattn.attention(qd, odd, causal=True)
        ref, _ = _oracle(qd, odd, causal=True)
        np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
        np.testing.assert_array_equal(np.isinf(out), np.isinf(ref))
        fin = np.isfinite(ref)
        assert rel_err(out[fin], ref[fin]) < 3e-5, which


@pytest.mark.parametrize("groups", [2, 4])
def test_three_and_four_rows_in_two_or_four_key_groups(rng, kernel, groups):
    """The keys-on-lanes QK^T of three or four rows a kv head over float32 keys takes two
    groups of keys at once on AMD and four elsewhere (AVX-512; other kernels two), forced
    either way on whatever machine runs the tests: GQA 3 and 4 rows a kv head, Lq 3 and
    4 of MHA, blocks of 16 and 32, a slot whose keys end inside a group set; against the
    oracle, and the same bits as the CPU's own choice and as a prefill's rows, on 1-3
    threads."""
    shapes = [(6, 2, 64, [1100, 37], None), (8, 2, 128, [700, 333], 32), (2, 2, 37, [515, 64], 16)]
    for Hq, Hkv, D, lengths, bs in shapes:
        c, _, _ = _filled(rng, len(lengths), Hkv, D, D, lengths, "float32", block_size=bs, chunks=2)
        q = _normal(rng, (len(lengths), Hq, 6, D))
        prefill = fastattn.attention(q, c, causal=True)
        rows = (1,) if Hq // Hkv >= 3 else (3, 4)
        auto = {lq: fastattn.attention(q[:, :, -lq:], c, causal=True) for lq in rows}
        try:
            fastattn._kernels.set_lane_groups(groups)
            for lq in rows:
                for nt in (1, 2, 3):
                    dec, lse = fastattn.attention(q[:, :, -lq:], c, causal=True, return_lse=True, num_threads=nt)
                    assert np.array_equal(dec, auto[lq]) and np.array_equal(dec, prefill[:, :, -lq:]), (Hq, lq, nt)
                ref, ref_lse = _oracle(q[:, :, -lq:], c, causal=True)
                assert rel_err(dec, ref) < 3e-5, (Hq, lq)
                np.testing.assert_allclose(lse, ref_lse, atol=3e-5 * max(1, np.abs(ref_lse).max()))
        finally:
            fastattn._kernels.set_lane_groups("auto")
    with pytest.raises(ValueError, match="lane groups mode"):
        fastattn._kernels.set_lane_groups(3)


SPLIT = [  # Hq, Hkv, D, lengths, block_size: slots of 10, 5 and 1 chunks of 512 keys; a
    # GQA group; blocks of 64 keys, where the avx2 and generic kernels fuse too
    (4, 2, 64, [5000, 2100, 300], None),
    (8, 2, 40, [4100], None),
    (2, 2, 32, [4700, 1500], 64),
    (6, 2, 64, [2100], 32),                          # three rows a kv head, blocks of 32
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SPLIT, ids=lambda s: f"Hq{s[0]}Hkv{s[1]}D{s[2]}B{len(s[3])}bs{s[4]}")
def test_split_items_of_several_chunks_keep_the_prefills_bits(rng, kernel, dtype, shape):
    """Split-KV decoding gives a thread up to four consecutive 512-key chunks of a head as
    one item (fewer where the threads would get under 8 items each: here 4, 2 or 1 by the
    thread count), each chunk still written as its own partial, and a float cache's
    fused P.V and QK^T runs across the chunks' edges: decode rows (Lq 1, 2 and 5) have
    the bits of the same rows of a prefill (12 rows, one block: no split) on 1 to 4
    threads; so do rows with a window whose first chunks hold no visible key (empty
    partials inside an item's chunks), and the ragged slots' last chunks hold none;
    against the oracle, output and lse.  The same for (B, H, T, D) arrays."""
    Hq, Hkv, D, lengths, bs = shape
    B = len(lengths)
    c, k, v = _filled(rng, B, Hkv, D, D, lengths, dtype, block_size=bs, chunks=2)
    q = _normal(rng, (B, Hq, 12, D))
    for kw in (dict(causal=True), dict(causal=True, window=(1300, 0))):
        prefill, plse = fastattn.attention(q, c, return_lse=True, num_threads=2, **kw)
        for nt in (1, 2, 3, 4):
            for lq in (1, 2, 5):
                dec, dlse = fastattn.attention(q[:, :, -lq:], c, return_lse=True, num_threads=nt, **kw)
                assert np.array_equal(dec, prefill[:, :, -lq:]), (nt, lq, sorted(kw))
                assert np.array_equal(dlse, plse[:, :, -lq:]), (nt, lq, sorted(kw))
        ref, ref_lse = _oracle(q[:, :, -2:], c, **kw)
        tol = 3e-5 if dtype == "float32" else 1e-4
        assert rel_err(prefill[:, :, -2:], ref) < tol, sorted(kw)
        np.testing.assert_allclose(plse[:, :, -2:], ref_lse, atol=tol * max(1, np.abs(ref_lse).max()))
    if B == 1:  # user-held arrays, the cache's values
        ka, va = c.keys(0)[None], c.values(0)[None]
        whole = fastattn.attention(q, ka, va, causal=True)
        for nt in (1, 2, 3, 4):
            dec = fastattn.attention(q[:, :, -1:], ka, va, causal=True, num_threads=nt)
            assert np.array_equal(dec, whole[:, :, -1:]), nt


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_chunked_prefill_and_decode_steps_equal_the_whole_prefill(rng, kernel, dtype):
    """A float cache filled in chunks, each chunk's queries attended as it is appended,
    then token by token decoding: every row has the bits of one whole prefill over the
    final cache (a float cache's keys never change once appended)."""
    B, Hq, Hkv, D, L = 2, 4, 2, 48, 300
    k, v, q = _normal(rng, (B, Hkv, L, D)), _normal(rng, (B, Hkv, L, D)), _normal(rng, (B, Hq, L, D))
    c = KVCache(B, Hkv, D, L, dtype=dtype)
    rows = []
    for a, b in ((0, 128), (128, 250), (250, 251)):
        c.append(k[:, :, a:b], v[:, :, a:b])
        rows.append(fastattn.attention(q[:, :, a:b], c, causal=True))
    for t in range(251, L):
        c.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        rows.append(fastattn.attention(q[:, :, t:t + 1], c, causal=True))
    whole = fastattn.attention(q, c, causal=True)
    assert np.array_equal(np.concatenate(rows, axis=2), whole)


@pytest.mark.parametrize("dtype", QUANT)
def test_a_block_is_quantized_over_the_tokens_it_holds(rng, dtype):
    """Token by token or all at once, the cache stores the same codes: a block is
    quantized over the tokens present (again as each arrives), so appends in any
    pieces give the same keys, values and outputs."""
    k, v = _normal(rng, (1, 2, 200, 32)), _normal(rng, (1, 2, 200, 32))
    a, b = KVCache(1, 2, 32, 256, dtype=dtype), KVCache(1, 2, 32, 256, dtype=dtype)
    a.append(k, v)
    for t in range(0, 200, 7):
        b.append(k[:, :, t:t + 7], v[:, :, t:t + 7])
    assert np.array_equal(a.keys(0), b.keys(0)) and np.array_equal(a.values(0), b.values(0))
    q = _normal(rng, (1, 4, 1, 32))
    assert np.array_equal(fastattn.attention(q, a), fastattn.attention(q, b))


# ---------------------------------------------------------------- what is stored

@pytest.mark.parametrize("dtype", ["float32", "float16", pytest.param("bfloat16", marks=pytest.mark.skipif(
    BF16 is None, reason="ml_dtypes is not installed"))])
def test_float_caches_hold_the_values_rounded(rng, dtype):
    c, k, v = _filled(rng, 2, 3, 24, 40, [50, 19], dtype, chunks=3)
    st = np.dtype(BF16) if dtype == "bfloat16" else np.dtype(dtype)
    for b, L in ((0, 50), (1, 19)):
        assert np.array_equal(c.keys(b), k[b, :, :L].astype(st).astype(np.float32))
        assert np.array_equal(c.values(b), v[b, :, :L].astype(st).astype(np.float32))
    n = c.nbytes
    blocks = -(-c.capacity // 16)
    assert n == 2 * 3 * blocks * 16 * (24 + 40) * st.itemsize


def test_quantized_keys_per_channel_within_a_block(rng):
    """int8 keys: per block and channel, s = (max - min) / 255, z = min + 128 s, codes
    round((x - z) / s) in -128..127, the key fmaf(c, s, z); int4: s = (max - min) / 15,
    z = min, codes 0..15.  Each element within half a step (plus the float32
    roundings) of the value appended; a constant channel exact."""
    k = _normal(rng, (1, 2, 100, 16)) * np.exp(rng.normal(0, 1.5, 16)).astype(np.float32)
    k[0, 0, :64, 3] = 0.75  # a constant channel within the first block
    v = _normal(rng, (1, 2, 100, 16))
    for dtype, levels in (("int8", 255), ("int4", 15)):
        c = KVCache(1, 2, 16, 128, dtype=dtype)
        c.append(k, v)
        got = c.keys(0).astype(np.float64)
        for blk in range(2):
            part = k[0, :, blk * 64:(blk + 1) * 64].astype(np.float64)
            step = (part.max(axis=1) - part.min(axis=1)) / levels
            err = np.abs(got[:, blk * 64:(blk + 1) * 64] - part)
            assert np.all(err <= 0.5 * step[:, None, :] * (1 + 1e-4) + 1e-6 * np.abs(part).max()), dtype
        assert np.all(got[0, :64, 3] == np.float32(0.75))


def test_quantized_values_per_token_in_groups(rng):
    v = _normal(rng, (1, 1, 30, 64)) * 3
    v[0, 0, 0, :32] = 0
    c8, c4 = KVCache(1, 1, 8, 64, dtype="int8", v_head_dim=64), KVCache(1, 1, 8, 64, dtype="int4", v_head_dim=64)
    k = _normal(rng, (1, 1, 30, 8))
    c8.append(k, v)
    c4.append(k, v)
    g = v[0, 0].reshape(30, 2, 32).astype(np.float64)
    amax = np.abs(g).max(-1)
    e8 = np.abs(c8.values(0)[0].reshape(30, 2, 32) - g)
    assert np.all(e8 <= 0.5 * amax[..., None] / 127 * (1 + 1e-4) + 1e-7)
    # int4 as q4_0: step |m| / 8, codes -8..7 with m at -8: half a step, except values
    # of m's opposite sign beyond 7 steps, clipped there (up to one step)
    e4 = np.abs(c4.values(0)[0].reshape(30, 2, 32) - g)
    step = amax[..., None] / 8
    inside = np.abs(g) <= 7 * step
    assert np.all(e4 <= np.where(inside, 0.5, 1.0) * step * (1 + 1e-4) + 1e-7)
    assert not c8.values(0)[0, 0, :32].any() and not c4.values(0)[0, 0, :32].any()


def _q8_0(x):
    b = x.reshape(x.shape[:-1] + (-1, 32)).astype(np.float32)
    d = (np.abs(b).max(-1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
    return (np.round(b / np.where(d == 0, 1, d)).clip(-127, 127) * d).reshape(x.shape)


def _q4_0(x):
    """llama.cpp's q4_0: blocks of 32, d = m / -8 (m the value of largest magnitude,
    float16), codes clip(round(x / d + 8), 0, 15), x = (code - 8) d."""
    b = x.reshape(x.shape[:-1] + (-1, 32)).astype(np.float32)
    m = np.take_along_axis(b, np.abs(b).argmax(-1)[..., None], -1)
    d = (m / -8).astype(np.float16).astype(np.float32)
    c = np.clip(np.floor(b / np.where(d == 0, 1, d) + 8.5), 0, 15)
    return ((c - 8) * d).reshape(x.shape)


@pytest.mark.parametrize("keys", ["random", "outlier channels"])
def test_error_no_worse_than_llama_cpp(rng, keys):
    """Attention's error against the unquantized cache, ours (int8, int4) next to
    llama.cpp's q8_0 and q4_0 (which quantize keys per token in blocks of 32) on the
    same data; with keys whose channels have log-normal scales (as real models' keys
    have), ours is far ahead, and on plain random data no worse."""
    B, H, L, D = 1, 4, 1024, 128
    k, v = _normal(rng, (B, H, L, D)), _normal(rng, (B, H, L, D))
    if keys == "outlier channels":
        k *= np.exp(rng.normal(0, 1.0, D)).astype(np.float32)
    q = _normal(rng, (B, H, 1, D)) * 0.5
    exact = reference.attention(q, k, v)
    for dtype, theirs_fn in (("int8", _q8_0), ("int4", _q4_0)):
        c = KVCache(B, H, D, L, dtype=dtype)
        c.append(k, v)
        ours = rel_err(fastattn.attention(q, c), exact)
        theirs = rel_err(fastattn.attention(q, theirs_fn(k), theirs_fn(v)), exact)
        assert ours <= theirs * 1.05, (dtype, keys, ours, theirs)


# ---------------------------------------------------------------- the object

def test_append_subsets_ragged_reset(rng):
    c = KVCache(3, 2, 16, 64, dtype="float32")
    k, v = _normal(rng, (2, 2, 5, 16)), _normal(rng, (2, 2, 5, 16))
    c.append(k, v, slots=[2, 0], lengths=[5, 3])
    assert c.lengths.tolist() == [3, 0, 5]
    np.testing.assert_array_equal(c.keys(2), k[0])
    np.testing.assert_array_equal(c.keys(0), k[1, :, :3])
    c.append(k[:1, :, :2], v[:1, :, :2], slots=1)
    assert c.lengths.tolist() == [3, 2, 5]
    lens = c.lengths
    lens[0] = 99  # a copy
    assert c.lengths[0] == 3
    c.reset([2])
    assert c.lengths.tolist() == [3, 2, 0] and c.keys(2).shape == (2, 0, 16)
    c.append(k[:1], v[:1], slots=[2])
    np.testing.assert_array_equal(c.keys(2), k[0])
    c.reset()
    assert c.lengths.tolist() == [0, 0, 0]
    assert "KVCache(batch=3" in repr(c)
    assert (c.batch, c.kv_heads, c.head_dim, c.v_head_dim, c.capacity, c.dtype, c.block_size) == \
        (3, 2, 16, 16, 64, "float32", 16)


def test_nbytes_of_quantized_caches():
    c8 = KVCache(2, 4, 128, 1000, dtype="int8")
    c4 = KVCache(2, 4, 128, 1000, dtype="int4")
    f = KVCache(2, 4, 128, 1000, dtype="float32")
    blocks, tok = -(-1000 // 64), -(-1000 // 64) * 64
    keys8 = 2 * 4 * (blocks * 128 * 64 + 2 * blocks * 128 * 4 + 64 * 128 * 4)
    assert c8.nbytes == keys8 + 2 * 4 * tok * (128 + 4 * 4)
    assert c4.nbytes == keys8 - 2 * 4 * blocks * 128 * 32 + 2 * 4 * tok * (64 + 4 * 4)
    # per token and kv head at D = 128: 1024 bytes float32, 288 int8, 160 int4 (the
    # partial block's float32 copy amortized over a long capacity)
    f, c8, c4 = (KVCache(1, 8, 128, 8192, dtype=d) for d in ("float32", "int8", "int4"))
    assert 3.5 < f.nbytes / c8.nbytes < 3.56 and 6.2 < f.nbytes / c4.nbytes < 6.4


def test_errors_change_nothing(rng):
    c = KVCache(2, 2, 16, 40, dtype="int8")
    k, v = _normal(rng, (2, 2, 30, 16)), _normal(rng, (2, 2, 30, 16))
    c.append(k, v)
    before = [c.keys(0), c.values(0), c.keys(1), c.values(1)]

    def same():
        assert c.lengths.tolist() == [30, 30]
        after = [c.keys(0), c.values(0), c.keys(1), c.values(1)]
        assert all(np.array_equal(a, b) for a, b in zip(before, after))

    bad = [
        (ValueError, "would pass its capacity 40", lambda: c.append(k[:, :, :11], v[:, :, :11])),
        (TypeError, "k must be float32, float16 or bfloat16", lambda: c.append(k.astype(np.float64), v)),
        (ValueError, r"k must have shape \(2, 2, n, 16\)", lambda: c.append(k[:, :1], v)),
        (ValueError, r"v must have shape \(1, 2, n, 16\)", lambda: c.append(k[:1], v, slots=[0])),
        (ValueError, "same number of new tokens", lambda: c.append(k[:, :, :2], v[:, :, :3])),
        (ValueError, "slots must not repeat", lambda: c.append(k, v, slots=[0, 0])),
        (ValueError, r"slots must be in \[0, 2\)", lambda: c.append(k[:1], v[:1], slots=[2])),
        (ValueError, r"lengths must be in \[0, 30\]", lambda: c.append(k, v, lengths=[31, 0])),
        (ValueError, "lengths must be 2 ints", lambda: c.append(k, v, lengths=[1])),
    ]
    knan = k[:, :, :2].copy()
    knan[1, 0, 1, 3] = np.nan
    bad.append((ValueError, "not finite", lambda: c.append(knan, v[:, :, :2])))
    vinf = v[:, :, :2].copy()
    vinf[0, 1, 0, 0] = np.inf
    bad.append((ValueError, "v holds values that are not finite", lambda: c.append(k[:, :, :2], vinf)))
    for exc, msg, call in bad:
        with pytest.raises(exc, match=msg):
            call()
        same()
    # an inf past a ragged length is never stored, so it is no error
    c.append(knan, v[:, :, :2], lengths=[2, 1])
    assert c.lengths.tolist() == [32, 31]


def test_attention_errors(rng):
    c = KVCache(2, 2, 16, 40)
    q = _normal(rng, (2, 4, 1, 16))
    with pytest.raises(ValueError, match="slot 0 holds no tokens"):
        fastattn.attention(q, c)
    c.append(_normal(rng, (2, 2, 3, 16)), _normal(rng, (2, 2, 3, 16)), lengths=[3, 2])
    with pytest.raises(ValueError, match="slot 1 holds 2 tokens; q's 3 queries"):
        fastattn.attention(_normal(rng, (2, 4, 3, 16)), c)
    with pytest.raises(ValueError, match=r"q must have shape \(2, Hq, Lq, 16\)"):
        fastattn.attention(_normal(rng, (1, 4, 1, 16)), c)
    with pytest.raises(TypeError, match="v, seqlens_k must not be given"):
        fastattn.attention(q, c, q, seqlens_k=[1, 1])
    with pytest.raises(ValueError, match="layout must be 'bhsd'"):
        fastattn.attention(q, c, layout="bshd")
    with pytest.raises(ValueError, match="Hq=3 heads, which is not a multiple of the Hkv=2"):
        fastattn.attention(_normal(rng, (2, 3, 1, 16)), c)
    with pytest.raises(TypeError, match="v is required"):
        fastattn.attention(q, q)
    for kw, exc, msg in ((dict(dtype="int2"), ValueError, "dtype must be one of"),
                         (dict(block_size=24), ValueError, "multiple of 16"),
                         (dict(block_size=0), ValueError, "block_size must be >= 1"),
                         (dict(v_head_dim=1.5), TypeError, "v_head_dim must be an int")):
        with pytest.raises(exc, match=msg):
            KVCache(1, 1, 8, 8, **kw)
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        KVCache(1, 1, 8, 0)
    with pytest.raises(ValueError, match=r"slot must be in \[0, 2\)"):
        c.keys(2)


GUARDED = """
import numpy as np, fastattn, guardpages
from fastattn import _kernels
_kernels.set_kernel({kernel!r})
rng = np.random.default_rng(0)
# (D 32, Dv 32, one query row a kv head: the decode's fused P.V and QK^T, fa_pv_qk; 1 to
# 10 rows a kv head, three and four in two and in four key groups: set_lane_groups)
for dtype, (D, Dv, Hq) in [(t, s) for t in ("float32", "float16", "int8", "int4")
                           for s in ((24, 20, 4), (32, 32, 2))]:
    for place, groups in (("end", 2), ("start", 4)):
        _kernels.set_lane_groups(groups)
        c = fastattn.KVCache(2, 2, D, 256, dtype=dtype, v_head_dim=Dv)
        k = rng.standard_normal((2, 2, 256, D)).astype(np.float32)
        v = rng.standard_normal((2, 2, 256, Dv)).astype(np.float32)
        c.append(k, v, lengths=[256, 200])
        q = rng.standard_normal((2, Hq, 5, D)).astype(np.float32)
        want = [fastattn.attention(q[:, :, :lq], c, causal=True) for lq in (1, 2, 3, 5)]
        for name in ("_k", "_v", "_ks", "_kz", "_vs"):
            if getattr(c, name) is not None:
                setattr(c, name, guardpages.guarded(getattr(c, name), place))
        for lq, w in zip((1, 2, 3, 5), want):
            got = fastattn.attention(guardpages.guarded(q[:, :, :lq], place), c, causal=True)
            assert np.array_equal(got, w), (dtype, place, lq)
_kernels.set_lane_groups("auto")
# split-KV items of several chunks (6 chunks of 512 keys, 2 slots x 4 kv heads: items of
# chunks 0-3 and 4-5 on 1 or 2 threads), fused across the chunks' edges, a slot whose last
# chunks and (with the window) first chunks hold no visible key
for dtype, place in [(t, p) for t in ("float32", "float16", "int8", "int4") for p in ("end", "start")]:
    c = fastattn.KVCache(2, 4, 32, 2600, dtype=dtype)
    k = rng.standard_normal((2, 4, 2600, 32)).astype(np.float32)
    v = rng.standard_normal((2, 4, 2600, 32)).astype(np.float32)
    c.append(k, v, lengths=[2600, 1100])
    q = rng.standard_normal((2, 4, 1, 32)).astype(np.float32)
    kws = (dict(causal=True), dict(causal=True, window=(700, 0)))
    want = [fastattn.attention(q, c, num_threads=nt, **kw) for kw in kws for nt in (1, 2)]
    for name in ("_k", "_v", "_ks", "_kz", "_vs"):
        if getattr(c, name) is not None:
            setattr(c, name, guardpages.guarded(getattr(c, name), place))
    got = [fastattn.attention(q, c, num_threads=nt, **kw) for kw in kws for nt in (1, 2)]
    assert all(np.array_equal(g, w) for g, w in zip(got, want)), (dtype, place)
print("done")
"""


@pytest.mark.parametrize("kernel_name", KERNELS)
def test_cache_reads_nothing_outside_its_arrays(kernel_name):
    """The cache's arrays (keys on the lanes, values, scales, zero points) flush
    against pages the process may not touch, both sides, under each kernel, in a child
    process: decode and prefill rows read only what they should."""
    r = subprocess.run([sys.executable, "-c", GUARDED.format(kernel=kernel_name)], cwd=HERE,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "done" in r.stdout, (r.returncode, r.stderr[-3000:])
