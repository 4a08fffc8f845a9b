"""Decoding through fastattn.KVCache (keys on the lanes; float32, float16, bfloat16,
int8, int4) against its own float32 cache and against today's path (user-held
(B, H, T, D) float32 arrays).

Each benchmark times the cache's decode call and, interleaved in its untimed set-up
(fastattn.bench.interleaved: a pause before and after), the baseline call: the float32
KVCache for the other dtypes, the float32 arrays for the float32 KVCache.  GB/s counts
the bytes a call reads (codes, scales and zero points up to each slot's length), against
the read bandwidth measured in the same process.  Every result is checked against the
oracle over the cache's own keys and values on sampled rows.  The whole table of issue
59 (llama.cpp, PyTorch, ONNX Runtime, bound and unbound threads) is
bench/kvcache_table.py.

| case (D=128) | need (issue 59) |
| every dtype: B1 H32 Lk8192, B8 H32 Lk2048, GQA 32/8, Lq=4 | >= 90% of the read bandwidth |
| float16/bfloat16, int8, int4 against the float32 cache | >= 1.85x, >= 3.3x, >= 5x |
| float32 KVCache against the arrays | no slower |
"""
import functools

import numpy as np
import pytest

import fastattn
from fastattn.bench import interleaved

SHAPES = {  # B, Hq, Hkv, Lq, Lk
    "B1 H32 Lk8192": (1, 32, 32, 1, 8192),
    "B8 H32 Lk2048": (8, 32, 32, 1, 2048),
    "B1 Hq32 Hkv8 Lk8192": (1, 32, 8, 1, 8192),
    "B1 H32 Lq4 Lk8192": (1, 32, 32, 4, 8192),
}
DTYPES = ["float32", "float16", "bfloat16", "int8", "int4"]
D = 128


@functools.lru_cache(maxsize=1)
def _inputs(shape):
    """q, k, v and the float32 cache of a shape (drawn once for its dtypes)"""
    B, Hq, Hkv, Lq, Lk = SHAPES[shape]
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, Hq, Lq, D), dtype=np.float32)
    k = rng.standard_normal((B, Hkv, Lk, D), dtype=np.float32)
    v = rng.standard_normal((B, Hkv, Lk, D), dtype=np.float32)
    f32 = fastattn.KVCache(B, Hkv, D, Lk)
    f32.append(k, v)
    return q, k, v, f32


def _read_bytes(c):
    """Bytes a decode call reads: every array of the cache but the partial block's
    float32 copies, over the slots' lengths."""
    per_token = (c.nbytes - (0 if c._kf is None else c._kf.nbytes)) / (c.batch * c._nblk * c.block_size)
    return per_token * int(c.lengths.sum())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_kvcache_decode(benchmark, bench_threads, read_bandwidth, check_rows, shape, dtype):
    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    B, Hq, Hkv, Lq, Lk = SHAPES[shape]
    q, k, v, f32 = _inputs(shape)
    nth = bench_threads
    if dtype == "float32":
        cache = f32
        base = lambda: fastattn.attention(q, k, v, causal=True, num_threads=nth)  # noqa: E731
        baseline = "fastattn arrays float32"
    else:
        cache = fastattn.KVCache(B, Hkv, D, Lk, dtype=dtype)
        cache.append(k, v)
        base = lambda: fastattn.attention(q, f32, causal=True, num_threads=nth)  # noqa: E731
        baseline = "fastattn KVCache float32"
    call = lambda: fastattn.attention(q, cache, causal=True, num_threads=nth)  # noqa: E731
    benchmark.group = f"kvcache {dtype} {shape}"
    out, _, base_median = interleaved(benchmark, call, base, 11)
    kd = np.stack([cache.keys(b) for b in range(B)])
    vd = np.stack([cache.values(b) for b in range(B)])
    err = check_rows(out, q, kd, vd, causal=True, tol=3e-5)
    nbytes = _read_bytes(cache)
    stats = benchmark.stats.stats if benchmark.stats else None
    info = dict(cache=dtype, shape=shape, threads=nth, rel_err=err, kv_bytes=nbytes,
                kernel=fastattn._kernels.current_kernel(), baseline=baseline,
                baseline_median_s=base_median,
                read_bandwidth_gbps=round(read_bandwidth(k.nbytes + v.nbytes) / 1e9, 2))
    if stats:
        info.update(median_s=stats.median, gbps=round(nbytes / stats.median / 1e9, 2),
                    speedup_vs_baseline=round(info["baseline_median_s"] / stats.median, 3))
    benchmark.extra_info.update(info)
