"""Nothing crashes, nothing leaks, the same bits on every thread count: input nobody
planned for (odd buffers, strided views, NaN/Inf, huge index products), concurrent
calls, 20,000 calls in a row -- each under every CPU kernel this machine can execute
(the `kernel` fixture of conftest.py).  The fuzzing of shapes, dtypes and keywords,
valid and invalid, is in test_fuzz.py."""
import gc
import os
import resource
import threading
import tracemalloc

import numpy as np
import pytest

import fastattn
from fastattn import _kernels, reference

from conftest import KERNELS, TOL, assert_lse_close, rel_err

# ---------------------------------------------------------------------------------
# Odd buffers.

def test_read_only_and_unaligned_buffers(kernel):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((3, 20, 8)).astype(np.float32)
    buf = bytearray(q.nbytes + 1)
    unaligned = np.frombuffer(buf, dtype=np.float32, count=q.size, offset=1).reshape(q.shape)
    unaligned[...] = q
    assert not unaligned.flags.aligned
    ro = np.frombuffer(q.tobytes(), dtype=np.float32).reshape(q.shape)
    assert not ro.flags.writeable
    want = fastattn.attention(q, q, q, causal=True)
    for a in (unaligned, ro):
        np.testing.assert_array_equal(fastattn.attention(a, a, a, causal=True), want)
    with pytest.raises(ValueError, match="out must have a contiguous last axis, aligned"):
        out_buf = bytearray(q.nbytes + 1)
        fastattn.attention(q, q, q, out=np.frombuffer(out_buf, np.float32, q.size, 1).reshape(q.shape))


def test_zero_and_negative_strides(kernel):
    rng = np.random.default_rng(1)
    row = rng.standard_normal(16).astype(np.float32)
    k = rng.standard_normal((50, 16)).astype(np.float32)
    q = np.broadcast_to(row, (30, 16))                       # stride 0 on the queries
    out = fastattn.attention(q, k[::-1], k[::-2][:25].repeat(2, 0))
    ref = reference.attention(q, k[::-1], k[::-2][:25].repeat(2, 0))
    assert rel_err(out, ref) <= TOL[np.dtype(np.float32)]
    assert (out == out[0]).all()                             # identical rows, identical bits


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fused_qkv_slices_bshd_gqa(kernel, dtype):
    """Slices of a fused projection (B, L, 3 or 2, H, D) read in place with
    layout='bshd': q from one buffer with Hq = 4, k and v from a packed KV buffer with
    Hkv = 2 (GQA), a cache longer than the queries, the lse in (B, Hq, Lq)."""
    rng = np.random.default_rng(7)
    qkv = rng.standard_normal((2, 37, 3, 4, 24)).astype(dtype)
    kv = rng.standard_normal((2, 301, 2, 2, 24)).astype(dtype)
    q, k, v = qkv[:, :, 0], kv[:, :, 0], kv[:, :, 1]
    assert not q.flags.c_contiguous and not k.flags.c_contiguous
    mask = rng.random((2, 1, 37, 301)) > 0.2
    for kw in (dict(causal=True), dict(window=(40, 3), mask=mask), dict(causal="top-left")):
        out, lse = fastattn.attention(q, k, v, layout="bshd", return_lse=True, **kw)
        ref, ref_lse = reference.attention(q, k, v, layout="bshd", return_lse=True, **kw)
        assert out.shape == (2, 37, 4, 24) and lse.shape == (2, 4, 37)
        assert rel_err(out, ref) <= TOL[np.dtype(dtype)]
        assert_lse_close(lse, ref_lse, dtype)
        # the same call on contiguous bhsd copies gives the same result
        bh = [np.ascontiguousarray(a.swapaxes(1, 2)) for a in (q, k, v)]
        out2 = fastattn.attention(*bh, return_lse=False, **kw)
        assert rel_err(out2.swapaxes(1, 2), ref) <= TOL[np.dtype(dtype)]


def test_index_products_beyond_int32(kernel):
    """Lq * Lk = 46341^2 > 2^31 with D = 1 and a broadcast mask: every index in the C
    code is 64-bit (a 32-bit product would wrap and read out of bounds).  The key mask
    keeps three runs of keys (at the start, the middle and the end), so the rows and
    keys still span the whole Lq x Lk range while the key tiles in between are skipped:
    a few seconds under the generic kernel instead of half a minute."""
    L = 46341
    rng = np.random.default_rng(2)
    q = rng.standard_normal((L, 1)).astype(np.float32)
    k = rng.standard_normal((L, 1)).astype(np.float32)
    v = rng.standard_normal((L, 1)).astype(np.float32)
    j = np.arange(L)
    keys = (j % 3 != 0) & ((j < 1024) | (np.abs(j - L // 2) < 512) | (j >= L - 1024))
    mask = np.broadcast_to(keys, (L, L))
    out, lse = fastattn.attention(q, k, v, mask=mask, window=(L // 2, None), return_lse=True)
    for i in (0, 1, 2000, L // 2, L // 2 + 1500, L - 2, L - 1):
        vis = keys & (j >= i - L // 2)
        s = q[i, 0] * k[vis, 0].astype(np.float64)
        w = np.exp(s - s.max())
        np.testing.assert_allclose(out[i, 0], (w * v[vis, 0]).sum() / w.sum(), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(lse[i], s.max() + np.log(w.sum()), rtol=1e-5)


# ---------------------------------------------------------------------------------
# NaN / Inf semantics (DESIGN.md 7).

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nan_stays_in_its_rows(kernel, dtype):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 60, 16)).astype(dtype)
    k = rng.standard_normal((2, 200, 16)).astype(dtype)
    v = rng.standard_normal((2, 200, 8)).astype(dtype)
    q[0, 7, 3] = np.nan           # a query row: only that output row
    k[1, 150, 0] = np.nan         # a key: the rows that see it (causal: rows >= 10)
    v[0, 30, 5] = np.inf          # a value: the rows that see it
    for kw in (dict(causal="top-left"), dict(causal=True), dict(window=(5, 5))):
        out = fastattn.attention(q, k, v, **kw)
        ref = reference.attention(q, k, v, **kw)
        np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
        np.testing.assert_array_equal(np.isinf(out), np.isinf(ref))
        fin = np.isfinite(ref)
        assert np.abs(out[fin] - ref[fin]).max() <= TOL[np.dtype(dtype)] * np.abs(ref[fin]).max()
    out = fastattn.attention(q, k, v, causal="top-left")
    assert np.isnan(out[0, 7]).all() and np.isfinite(out[0, :7]).all()
    assert np.isfinite(out[1, :150]).all() and np.isnan(out[1, 150:]).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_inf_in_v_tiles_shared_by_many_blocks(kernel, dtype):
    """A V tile is checked for inf/NaN once a call, by whichever item reaches it first
    (fa_vfin_read): many query blocks and grouped heads over the same tiles, an inf in a
    whole tile and a NaN in the keys' last partial one, hidden from some rows by a mask,
    the causal diagonal or a window.  The rows that see them, and only those, are not
    finite, as the oracle says, and every thread count gives the same bits."""
    rng = np.random.default_rng(8)
    q = rng.standard_normal((1, 6, 700, 16)).astype(dtype)
    k = rng.standard_normal((1, 3, 700, 16)).astype(dtype)
    v = rng.standard_normal((1, 3, 700, 8)).astype(dtype)
    v[0, 1, 130, 2] = np.inf      # a whole tile of kv head 1 (query heads 2, 3)
    v[0, 2, 697, 5] = np.nan      # the last, partial tile of kv head 2
    mask = np.ones((700, 700), bool)
    mask[::2, 120:140] = False    # even rows never see key 130
    for kw in ({}, dict(causal=True), dict(window=(50, 50)), dict(mask=mask)):
        outs = [fastattn.attention(q, k, v, num_threads=t, **kw) for t in (1, 2, 3)]
        ref = reference.attention(q, k, v, **kw)
        np.testing.assert_array_equal(np.isnan(outs[0]), np.isnan(ref))
        np.testing.assert_array_equal(np.isinf(outs[0]), np.isinf(ref))
        fin = np.isfinite(ref)
        assert np.abs(outs[0][fin] - ref[fin]).max() <= TOL[np.dtype(dtype)] * np.abs(ref[fin]).max()
        for o in outs[1:]:
            np.testing.assert_array_equal(o, outs[0])
    out = fastattn.attention(q, k, v, mask=mask)
    assert np.isinf(out[0, 2:4, 1::2, 2]).all() and np.isfinite(out[0, 2:4, ::2]).all()
    assert np.isnan(out[0, 4:6, :, 5]).all() and np.isfinite(out[0, :2]).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("Lq", [1, 4])
def test_nan_inf_in_decode_blocks(kernel, dtype, Lq):
    """Blocks of a few rows (decoding, split-KV) run P.V before looking at V; rows it
    left not finite are restored and that tile is redone adding visible pairs only."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 3, Lq, 16)).astype(dtype)
    k = rng.standard_normal((1, 3, 1100, 16)).astype(dtype)
    v = rng.standard_normal((1, 3, 1100, 8)).astype(dtype)
    q[0, 0, 0, 2] = np.nan        # head 0: its row 0 only
    k[0, 1, 700, 1] = np.nan      # head 1: every row that sees key 700
    v[0, 2, 40, 3] = np.inf       # head 2: rows that see key 40, column 3
    mask = np.ones((Lq, 1100), bool)
    mask[:, 30:50] = False        # hides key 40 (and key 700 stays visible)
    for kw in ({}, dict(window=(100, None)), dict(causal=True), dict(mask=mask)):
        out = fastattn.attention(q, k, v, **kw)
        ref = reference.attention(q, k, v, **kw)
        np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
        np.testing.assert_array_equal(np.isinf(out), np.isinf(ref))
        fin = np.isfinite(ref)
        assert np.abs(out[fin] - ref[fin]).max() <= TOL[np.dtype(dtype)] * np.abs(ref[fin]).max()
    assert np.isinf(fastattn.attention(q, k, v)[0, 2, :, 3]).all()
    assert np.isfinite(fastattn.attention(q, k, v, mask=mask)[0, 2]).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_infinite_logits(kernel, dtype):
    q = np.ones((4, 8), dtype)
    k = np.ones((10, 8), dtype)
    v = np.arange(20, dtype=dtype).reshape(10, 2)
    bias = np.zeros((4, 10), dtype)
    bias[0, 3] = np.inf           # +inf logit: the row is NaN (inf - inf), as in the oracle
    bias[1] = -np.inf             # -inf everywhere: no visible key, 0 and lse -inf
    out, lse = fastattn.attention(q, k, v, bias=bias, return_lse=True)
    ref, ref_lse = reference.attention(q, k, v, bias=bias, return_lse=True)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    assert (out[1] == 0).all() and np.isneginf(lse[1])
    np.testing.assert_allclose(out[2:], ref[2:], rtol=TOL[np.dtype(dtype)])


# ---------------------------------------------------------------------------------
# Concurrency, determinism, leaks.

def test_concurrent_calls_every_path(kernel):
    """8 Python threads at once (the GIL is released; the C code has no shared mutable
    state): prefill, variants, decode (split-KV), float16 K/V, bshd, errors.  The
    kernel is process-global: the fixture sets it before the threads start."""
    rng = np.random.default_rng(4)
    jobs = []
    for i in range(8):
        Lq = [3, 70, 1, 130, 5, 40, 1, 200][i]
        Lk = [900, 150, 2000, 130, 700, 40, 5000, 260][i]
        q = rng.standard_normal((2, 4, Lq, 24)).astype(np.float32)
        kvd = np.float16 if i % 3 == 0 else np.float32
        k = rng.standard_normal((2, 2, Lk, 24)).astype(kvd)
        v = rng.standard_normal((2, 2, Lk, 16)).astype(kvd)
        kw = [dict(causal=True), dict(mask=rng.random((Lq, Lk)) > 0.5), dict(window=(64, 0)),
              dict(softcap=3.0, alibi_slopes=np.ones(4) * 0.1), dict(bias=rng.random(Lk)),
              dict(layout="bshd"), dict(), dict(causal="top-left")][i]
        if kw.get("layout") == "bshd":
            q, k, v = (a.swapaxes(1, 2) for a in (q, k, v))
        jobs.append((q, k, v, kw))
    want = [fastattn.attention(q, k, v, num_threads=1, **kw) for q, k, v, kw in jobs]
    errors = []

    def worker(t):
        try:
            for _ in range(5):
                assert _kernels.current_kernel() == kernel
                q, k, v, kw = jobs[t]
                assert np.array_equal(fastattn.attention(q, k, v, num_threads=2, **kw), want[t])
                with pytest.raises(ValueError):
                    fastattn.attention(q, k, v, window=(-3, 0))
        except BaseException as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert _kernels.current_kernel() == kernel


@pytest.mark.parametrize("Lq,Lk", [(300, 333), (2, 3000)])
def test_bitwise_equal_threads_1_2_3_8_and_repeated(kernel, Lq, Lk):
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 4, Lq, 32)).astype(np.float32)
    k = rng.standard_normal((1, 4, Lk, 32)).astype(np.float32)
    v = rng.standard_normal((1, 4, Lk, 32)).astype(np.float32)
    base = fastattn.attention(q, k, v, causal=True, num_threads=1, return_lse=True)
    for n in (1, 2, 3, 8, 8, 2):
        out, lse = fastattn.attention(q, k, v, causal=True, num_threads=n, return_lse=True)
        assert np.array_equal(out, base[0]) and np.array_equal(lse, base[1])


def _rss_kib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (resource.getpagesize() // 1024)


def test_no_leaks_over_20000_calls():
    """20,000 calls (lse, masks, decode, errors raised), the CPU kernels taking turns
    (every kernel this machine runs, in one run of 20,000 rather than one per kernel,
    to keep the time): RSS and Python allocations stay flat."""
    rng = np.random.default_rng(6)
    q = rng.standard_normal((2, 17, 16)).astype(np.float32)
    k = rng.standard_normal((2, 600, 16)).astype(np.float32)
    mask = rng.random(600) > 0.5
    q1 = q[:, :1]

    def batch(n):
        for i in range(n):
            _kernels.set_kernel(KERNELS[i % len(KERNELS)])
            fastattn.attention(q, k, k, return_lse=True, mask=mask, causal=bool(i % 2), num_threads=1)
            fastattn.attention(q1, k, k, window=(100, None), num_threads=1 + i % 2)
            try:
                fastattn.attention(q, k, k[:, :5])
            except ValueError:
                pass

    before = _kernels.current_kernel()
    try:
        batch(500)  # warm up allocator pools and caches
        gc.collect()
        tracemalloc.start()
        rss0 = _rss_kib()
        snap0 = tracemalloc.take_snapshot()
        batch(20_000 // 3)
        gc.collect()
        snap1 = tracemalloc.take_snapshot()
        rss1 = _rss_kib()
        tracemalloc.stop()
    finally:
        _kernels.set_kernel(before)
    grown = sum(s.size_diff for s in snap1.compare_to(snap0, "filename") if s.size_diff > 0)
    assert grown < 256 * 1024, f"Python allocations grew by {grown} bytes"
    if os.environ.get("FASTATTN_SANITIZE"):
        # AddressSanitizer keeps freed blocks in a quarantine (256 MB by default), so
        # RSS grows by design there; its own checks cover these calls instead
        return
    assert rss1 - rss0 < 8 * 1024, f"RSS grew by {rss1 - rss0} KiB"
