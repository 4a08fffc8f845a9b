"""Decoding from the caches servers keep: int8 (QuantizedKV) and paged (block tables).

Each benchmark times fastattn on the cache and, interleaved in its untimed set-up (a
pause before and after, so neither call's spinning threads steal the other's cores),
fastattn on the plain cache it stands for (fastattn.bench.interleaved): the float32
cache for int8, the same keys in a contiguous (B, Hkv, Lk, D) cache for a paged one.  The ratio of their medians is
the figure (extra_info speedup_vs_baseline).  GB/s counts the bytes the call reads
(int8 data and scales; a pool's pages), against the read bandwidth measured in the
same process.  Every result is checked against the oracle on sampled rows.

| case | need (issue 24) |
| int8 cache | >= 3x fastattn's float32 cache |
| paged cache, block 16 and 128 | within 5% of the contiguous cache |
"""
import functools

import numpy as np
import pytest

import fastattn
from fastattn.bench import interleaved

SHAPES = {  # B, Hq, Hkv, Lq, Lk, D
    "B1 H32 Lk8192": (1, 32, 32, 1, 8192, 128),
    "B8 H32 Lk2048": (8, 32, 32, 1, 2048, 128),
    "B1 Hq32 Hkv8 Lk8192": (1, 32, 8, 1, 8192, 128),
    "B1 H32 Lq4 Lk8192": (1, 32, 32, 4, 8192, 128),
}
CACHES = ["int8", "paged16", "paged128"]


def _pool(x, block):
    B, H, L, D = x.shape
    pool = np.ascontiguousarray(x.reshape(B, H, L // block, block, D).transpose(0, 2, 3, 1, 4))
    table = np.arange(B * (L // block), dtype=np.int32).reshape(B, L // block)
    # pages in a shuffled order, as an allocator leaves them
    order = np.random.default_rng(0).permutation(B * (L // block))
    pages = np.empty_like(pool.reshape(-1, block, H, D))
    pages[order] = pool.reshape(-1, block, H, D)
    return pages, order[table].astype(np.int32)


@functools.lru_cache(maxsize=1)
def _inputs(shape):
    """q, k, v of a shape, drawn once for its three caches (they are 268 MB)"""
    B, Hq, Hkv, Lq, Lk, D = SHAPES[shape]
    rng = np.random.default_rng(0)
    return (rng.standard_normal((B, Hq, Lq, D), dtype=np.float32),
            rng.standard_normal((B, Hkv, Lk, D), dtype=np.float32),
            rng.standard_normal((B, Hkv, Lk, D), dtype=np.float32))


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_cache_decode(benchmark, bench_threads, read_bandwidth, check_rows, shape, cache):
    B, Hq, Hkv, Lq, Lk, D = SHAPES[shape]
    q, k, v = _inputs(shape)
    nth = bench_threads
    if cache == "int8":
        kq, vq = fastattn.quantize_kv(k), fastattn.quantize_kv(v)
        call = lambda: fastattn.attention(q, kq, vq, causal=True, num_threads=nth)  # noqa: E731
        nbytes = sum(a.nbytes for a in (*kq, *vq))
        k_ref, v_ref = fastattn.dequantize_kv(kq), fastattn.dequantize_kv(vq)
        base = lambda: fastattn.attention(q, k, v, causal=True, num_threads=nth)  # noqa: E731
    else:
        block = int(cache[len("paged"):])
        (kp, table), (vp, _) = _pool(k, block), _pool(v, block)
        sl = np.full(B, Lk)
        call = lambda: fastattn.attention(q, kp, vp, block_table=table, seqlens_k=sl,  # noqa: E731
                                          causal=True, num_threads=nth)
        nbytes = k.nbytes + v.nbytes
        k_ref, v_ref = k, v
        base = lambda: fastattn.attention(q, k, v, seqlens_k=sl, causal=True,  # noqa: E731
                                          num_threads=nth)
    benchmark.group = f"cache {cache} {shape}"
    out, _, base_median = interleaved(benchmark, call, base, 11)
    err = check_rows(out, q, k_ref, v_ref, causal=True, tol=3e-5)
    if cache != "int8":  # the contiguous cache's bits
        np.testing.assert_array_equal(out, base())
    stats = benchmark.stats.stats if benchmark.stats else None
    info = dict(cache=cache, shape=shape, threads=nth, rel_err=err, kv_bytes=nbytes,
                kernel=fastattn._kernels.current_kernel(),
                baseline="fastattn float32" if cache == "int8" else "fastattn contiguous",
                baseline_median_s=base_median,
                read_bandwidth_gbps=round(read_bandwidth(k.nbytes + v.nbytes) / 1e9, 2))
    if stats:
        info.update(median_s=stats.median, gbps=round(nbytes / stats.median / 1e9, 2),
                    speedup_vs_baseline=round(info["baseline_median_s"] / stats.median, 3))
    benchmark.extra_info.update(info)
