"""Decoding at memory bandwidth: one query (or a few) against a KV cache.

Each benchmark times fastattn and, interleaved in its untimed set-up, a baseline (PyTorch
SDPA on the same data, or fastattn's own float32 call), so their ratio is measured under
the same machine state; the result is checked against the oracle in every batch and
head.  GB/s counts the K and V bytes read; the ceiling is the read
bandwidth measured in the same process (bench/conftest.py: read_bandwidth).

| case | need |
| B=1 H=32 Lq=1 Lk=8192 D=128 float32 | >= 1.5x PyTorch; >= 75% of the read bandwidth |
| the same with float16 K/V | >= 1.7x fastattn's own float32 time |
| B=1 Hq=32 Hkv=8 Lq=1 Lk=8192 D=128 | time <= 0.35x the Hkv=32 case |
| B=8 H=32 Lq=1 Lk=2048 D=128 | >= 1.5x PyTorch |
| Lq=4 (speculative decoding) Lk=8192 | >= 1.3x PyTorch |
| the four float32 shapes above (issue 24) | >= 1.15x PyTorch and ONNX Runtime; OpenVINO measured |

The peers (bench/peers.py) are skipped where they are not installed
(``pip install onnxruntime onnx openvino``).
"""
import time

import numpy as np
import pytest

import fastattn

# name: (B, Hq, Hkv, Lq, Lk, D, kv dtype, baseline)
CASES = {
    "B1 H32 Lq1 Lk8192 D128 f32": (1, 32, 32, 1, 8192, 128, np.float32, "torch"),
    "B1 H32 Lq1 Lk8192 D128 f16 K/V": (1, 32, 32, 1, 8192, 128, np.float16, "fastattn f32"),
    "B1 Hq32 Hkv8 Lq1 Lk8192 D128 f32": (1, 32, 8, 1, 8192, 128, np.float32, "fastattn Hkv=32"),
    "B8 H32 Lq1 Lk2048 D128 f32": (8, 32, 32, 1, 2048, 128, np.float32, "torch"),
    "B1 H32 Lq4 Lk8192 D128 f32": (1, 32, 32, 4, 8192, 128, np.float32, "torch"),
}
# the four float32 decode shapes of issue 24 against PyTorch SDPA (above, or here for
# GQA), ONNX Runtime's Attention op and OpenVINO's ScaledDotProductAttention
for _shape in ((1, 32, 32, 1, 8192), (8, 32, 32, 1, 2048), (1, 32, 8, 1, 8192), (1, 32, 32, 4, 8192)):
    _B, _Hq, _Hkv, _Lq, _Lk = _shape
    for _peer in ("torch", "onnxruntime", "openvino"):
        _name = f"B{_B} Hq{_Hq} Hkv{_Hkv} Lq{_Lq} Lk{_Lk} D128 f32 vs {_peer}"
        if _peer != "torch" or _Hkv != _Hq:
            CASES[_name] = (_B, _Hq, _Hkv, _Lq, _Lk, 128, np.float32, _peer)


def _baseline(kind, q, k, v, B, Hq, Lq, Lk, D, threads):
    rng = np.random.default_rng(1)
    if kind in ("onnxruntime", "openvino"):
        pytest.importorskip(kind)
        pytest.importorskip("onnx") if kind == "onnxruntime" else None
        import peers
        run = getattr(peers, "make_" + kind)(B, Hq, k.shape[1], Lq, Lk, D, threads)
        return lambda: run(q, k, v)
    if kind == "torch":
        torch = pytest.importorskip("torch")
        torch.set_num_threads(threads)
        tq, tk, tv = (torch.from_numpy(x.astype(np.float32)) for x in (q, k, v))
        if tk.shape[1] != tq.shape[1]:
            tk = tk.repeat_interleave(tq.shape[1] // tk.shape[1], 1)
            tv = tv.repeat_interleave(tq.shape[1] // tv.shape[1], 1)
        # bottom-right causal: each of the Lq new queries sees the cache and its own prefix
        mask = torch.from_numpy(np.tril(np.ones((Lq, Lk), bool), Lk - Lq)) if Lq > 1 else None
        sdpa = torch.nn.functional.scaled_dot_product_attention
        return lambda: sdpa(tq, tk, tv, attn_mask=mask)
    Hkv = Hq
    k32 = rng.standard_normal((B, Hkv, Lk, D), dtype=np.float32)
    v32 = rng.standard_normal((B, Hkv, Lk, D), dtype=np.float32)
    return lambda: fastattn.attention(q, k32, v32, causal=True, num_threads=threads)


@pytest.mark.parametrize("case", list(CASES))
def test_decode(benchmark, bench_threads, read_bandwidth, check_rows, case):
    B, Hq, Hkv, Lq, Lk, D, kv_dtype, kind = CASES[case]
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, Hq, Lq, D), dtype=np.float32)
    k = rng.standard_normal((B, Hkv, Lk, D), dtype=np.float32).astype(kv_dtype)
    v = rng.standard_normal((B, Hkv, Lk, D), dtype=np.float32).astype(kv_dtype)
    base = _baseline(kind, q, k, v, B, Hq, Lq, Lk, D, bench_threads)
    base_times = []

    def run_baseline():
        time.sleep(0.1)  # the same idle before the baseline's call
        t = time.perf_counter()
        base()
        base_times.append(time.perf_counter() - t)
        time.sleep(0.1)  # let its spinning worker threads go idle before the timed call

    benchmark.group = "decode " + case
    out = benchmark.pedantic(lambda: fastattn.attention(q, k, v, causal=True, num_threads=bench_threads),
                             setup=run_baseline, rounds=15, iterations=1, warmup_rounds=1)
    # every batch and head (each of the Lq queries: sample_rows takes all of so few)
    err = check_rows(out, q, k, v, causal=True, tol=1e-4 if kv_dtype == np.float16 else 3e-5)
    nbytes = k.nbytes + v.nbytes
    best = benchmark.stats.stats.min if benchmark.stats else None
    base_times = base_times[-15:]
    benchmark.extra_info.update(
        decode=case, baseline=kind, threads=bench_threads, rel_err=err,
        kernel=fastattn._kernels.current_kernel(), kv_bytes=nbytes,
        baseline_min_s=min(base_times), baseline_median_s=float(np.median(base_times)),
        gbps=round(nbytes / best / 1e9, 2) if best else None,
        read_bandwidth_gbps=round(read_bandwidth(nbytes) / 1e9, 2))
