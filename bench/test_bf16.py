"""bfloat16 and per-sequence cache lengths, interleaved with their baselines in one
process (each baseline call just before every timed round, 0.1 s idle around it).

- prefill float16 q/k/v against fastattn float32 on the same values;
- prefill bf16 (ml_dtypes.bfloat16 q/k/v) against PyTorch's bf16 SDPA, against
  fastattn float32 and, where the default bfloat16 path is a pair path (AVX512-BF16),
  against fastattn's bf16 on the float32 conversion path; its GFLOP/s and, on a pair
  path, its fraction of the pair instruction's peak (fastattn.bench.bf16_peak);
- decode against a bf16 K/V cache against the float32 cache, and the bytes read per
  second against the machine's read bandwidth;
- fwd+bwd bf16 against PyTorch's bf16 autograd, and the backward alone against
  PyTorch's and against fastattn's own backward on float32 products;
- seqlens_k: a batch of 4 decode rows at cache lengths [8192, 512, 512, 512] against
  4 x 8192 (the bytes read are ~0.31x).
Every case checks its result against the float64 oracle (sampled rows for big ones).
"""
import numpy as np
import pytest

import fastattn
from fastattn import reference
from fastattn.bench import interleaved

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)


def _torch_bf16(torch, x):
    return torch.from_numpy(x.view(np.uint16).astype(np.int16)).view(torch.bfloat16)


def _torch_grad_inputs(threads, q, k, v, dout):
    """PyTorch on `threads` threads and q, k, v (leaves that take gradients) and dout
    as bf16 tensors."""
    torch = pytest.importorskip("torch")
    torch.set_num_threads(threads)
    return torch, [_torch_bf16(torch, x).requires_grad_() for x in (q, k, v)], _torch_bf16(torch, dout)


PREFILL = {"B1 H8 L4096 D64": (1, 8, 4096, 64), "B1 H8 L2048 D128": (1, 8, 2048, 128),
           "B1 H8 L4096 D64 causal": (1, 8, 4096, 64), "B4 H16 L256 D64": (4, 16, 256, 64)}
PATH = fastattn._kernels.bf16_path()  # the path fastattn's bf16 calls take here
# against the float32 conversion path too where a pair path is the default
BASELINES = ("torch bf16", "fastattn float32") + (("fastattn bf16 on the float32 path",) if PATH != "float32" else ())
CASES = [(n, b) for n in PREFILL for b in BASELINES]


@pytest.mark.parametrize("name,baseline", CASES, ids=[f"{n.replace(' ', '-')}-vs-{b.replace(' ', '-')}"
                                                      for n, b in CASES])
def test_prefill_bf16(benchmark, bench_threads, name, baseline):
    _prefill16(benchmark, bench_threads, name, BF16, baseline)


@pytest.mark.parametrize("name", list(PREFILL), ids=[n.replace(' ', '-') for n in PREFILL])
def test_prefill_f16(benchmark, bench_threads, name):
    """float16 q/k/v (converted to float32 once per tile, issue 26's step 1) against
    fastattn's float32 on the same values."""
    _prefill16(benchmark, bench_threads, name, np.dtype(np.float16), "fastattn float32")


def _prefill16(benchmark, bench_threads, name, dt, baseline):
    """One prefill case of 16-bit q/k/v (dt) against `baseline`, interleaved."""
    B, H, L, D = PREFILL[name]
    causal = name.endswith("causal")
    if benchmark.disabled:
        L = 256
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, H, L, D), dtype=np.float32).astype(dt) for _ in range(3))
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))  # the same values
    if baseline == "torch bf16":
        torch = pytest.importorskip("torch")
        torch.set_num_threads(bench_threads)
        tq, tk, tv = (_torch_bf16(torch, x) for x in (q, k, v))

        def base():
            with torch.no_grad():
                return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
    elif baseline == "fastattn float32":
        def base():
            return fastattn.attention(q32, k32, v32, causal=causal, num_threads=bench_threads)
    else:
        def base():
            fastattn._kernels.set_bf16_path("float32")
            try:
                return fastattn.attention(q, k, v, causal=causal, num_threads=bench_threads)
            finally:
                fastattn._kernels.set_bf16_path(PATH)
    out, bmin, bmed = interleaved(
        benchmark, lambda: fastattn.attention(q, k, v, causal=causal, num_threads=bench_threads), base,
        3 if L >= 2048 else 11)
    rows = np.linspace(0, L - 1, 6).astype(int)
    ref = reference.attention(q.astype(np.float64)[0, 0], k.astype(np.float64)[0, 0],
                              v.astype(np.float64)[0, 0], causal=causal)[rows]
    err = float(np.max(np.abs(out[0, 0, rows].astype(np.float64) - ref)) / np.max(np.abs(ref)))
    assert err <= (5e-3 if dt == BF16 else 2e-3)
    st = benchmark.stats.stats if benchmark.stats else None
    benchmark.group = f"{dt.name} {name}"
    gflops = 4.0 * B * H * L * L * D * (0.5 if causal else 1.0) / st.min / 1e9 if st else None
    path = PATH if dt == BF16 else "float32"
    peak = fastattn.bench.bf16_peak(bench_threads) if st and path != "float32" else None
    label = f"prefill {name} vs {baseline}" if dt == BF16 else f"prefill {name} float16 vs {baseline}"
    benchmark.extra_info.update(bf16_case=label, baseline_min_s=bmin,
                                baseline_median_s=bmed, threads=bench_threads,
                                kernel=fastattn._kernels.current_kernel(), bf16_path=path,
                                gflops=gflops, pair_peak_gflops=peak)


def test_decode_bf16_cache(benchmark, bench_threads, read_bandwidth):
    H, Lk, D = 32, 8192, 128
    if benchmark.disabled:
        Lk = 1024
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, H, 1, D), dtype=np.float32)
    k32, v32 = (rng.standard_normal((1, H, Lk, D), dtype=np.float32) for _ in range(2))
    k, v = k32.astype(BF16), v32.astype(BF16)
    out, bmin, bmed = interleaved(benchmark, lambda: fastattn.attention(q, k, v, num_threads=bench_threads),
                                   lambda: fastattn.attention(q, k32, v32, num_threads=bench_threads), 7)
    ref = reference.attention(q[0].astype(np.float64), k[0].astype(np.float64), v[0].astype(np.float64))
    assert np.max(np.abs(out[0] - ref)) <= 1e-5 * np.max(np.abs(ref))
    st = benchmark.stats.stats if benchmark.stats else None
    nbytes = k.nbytes + v.nbytes
    benchmark.group = "bf16 decode"
    benchmark.extra_info.update(bf16_case=f"decode H{H} Lk{Lk} D{D} bf16 K/V vs float32 K/V",
                                baseline_min_s=bmin, baseline_median_s=bmed, threads=bench_threads,
                                kernel=fastattn._kernels.current_kernel(),
                                gbps=nbytes / st.min / 1e9 if st else None,
                                read_bandwidth_gbps=read_bandwidth(nbytes) / 1e9 if st else None)


def test_fwd_bwd_bf16(benchmark, bench_threads):
    B, H, L, D = 1, 8, 2048, 64
    if benchmark.disabled:
        L = 256
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((B, H, L, D), dtype=np.float32).astype(BF16) for _ in range(4))
    torch, (tq, tk, tv), tdo = _torch_grad_inputs(bench_threads, q, k, v, dout)

    def base():
        for x in (tq, tk, tv):
            x.grad = None
        torch.nn.functional.scaled_dot_product_attention(tq, tk, tv).backward(tdo)

    def ours():
        out, lse = fastattn.attention(q, k, v, return_lse=True, num_threads=bench_threads)
        return fastattn.attention_backward(dout, q, k, v, out, lse, num_threads=bench_threads)
    grads, bmin, bmed = interleaved(benchmark, ours, base, 3)
    for g, t in zip(grads, (tq.grad, tk.grad, tv.grad)):
        t = t.float().numpy()
        assert np.max(np.abs(g.astype(np.float32) - t)) <= 3e-2 * np.max(np.abs(t))
    benchmark.group = "bf16 fwd+bwd"
    benchmark.extra_info.update(bf16_case=f"fwd+bwd B{B} H{H} L{L} D{D} bf16 vs torch bf16",
                                baseline_min_s=bmin, baseline_median_s=bmed, threads=bench_threads,
                                kernel=fastattn._kernels.current_kernel())


BWD = {"B1 H8 L2048 D64": (1, 8, 2048, 64, False), "B1 H8 L2048 D128": (1, 8, 2048, 128, False),
       "B1 H8 L4096 D64 causal": (1, 8, 4096, 64, True)}
BWD_BASELINES = ("torch bf16",) + (("fastattn bf16 on the float32 path",) if PATH != "float32" else ())
BWD_CASES = [(n, b) for n in BWD for b in BWD_BASELINES]


@pytest.mark.parametrize("name,baseline", BWD_CASES,
                         ids=[f"{n.replace(' ', '-')}-vs-{b.replace(' ', '-')}" for n, b in BWD_CASES])
def test_bwd_bf16(benchmark, bench_threads, name, baseline):
    """The backward alone (attention_backward of bfloat16 q, k, v: on a pair path its
    products take the pairs) against PyTorch's bf16 backward (o.backward on a graph made
    in the set-up) and against fastattn's own float32 products; GFLOP/s count the five
    products, 10 B H L^2 D (half of it causal)."""
    B, H, L, D, causal = BWD[name]
    if benchmark.disabled:
        L = 256
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((B, H, L, D), dtype=np.float32).astype(BF16) for _ in range(4))
    out, lse = fastattn.attention(q, k, v, causal=causal, return_lse=True, num_threads=bench_threads)
    if baseline == "torch bf16":
        torch, (tq, tk, tv), tdo = _torch_grad_inputs(bench_threads, q, k, v, dout)
        graph = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)  # once, untimed

        def base():  # the backward alone, as ours
            for x in (tq, tk, tv):
                x.grad = None
            graph.backward(tdo, retain_graph=True)
    else:
        def base():
            fastattn._kernels.set_bf16_path("float32")
            try:
                return fastattn.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                                   num_threads=bench_threads)
            finally:
                fastattn._kernels.set_bf16_path(PATH)
    grads, bmin, bmed = interleaved(
        benchmark, lambda: fastattn.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                                       num_threads=bench_threads),
        base, 3 if L >= 2048 else 11)
    # sampled rows of dq and keys of dk, dv of the first head, from the definitions
    f = np.float64
    qh, kh, vh, doh, oh = (x[0, 0].astype(f) for x in (q, k, v, dout, out))
    s = qh @ kh.T / np.sqrt(D)
    if causal:
        s[np.triu_indices(L, 1)] = -np.inf
    p = np.exp(s - lse[0, 0].astype(f)[:, None])
    ds = p * (doh @ vh.T - np.sum(doh * oh, axis=1)[:, None])
    idx = np.linspace(0, L - 1, 6).astype(int)
    for g, r in ((grads[0][0, 0][idx], (ds @ kh / np.sqrt(D))[idx]), (grads[1][0, 0][idx], (ds.T @ qh / np.sqrt(D))[idx]),
                 (grads[2][0, 0][idx], (p.T @ doh)[idx])):
        assert np.max(np.abs(g.astype(f) - r)) <= 2e-2 * np.max(np.abs(r))
    st = benchmark.stats.stats if benchmark.stats else None
    benchmark.group = f"bf16 bwd {name}"
    gflops = 10.0 * B * H * L * L * D / (2 if causal else 1) / st.min / 1e9 if st else None
    peak = fastattn.bench.bf16_peak(bench_threads) if st and PATH != "float32" else None
    benchmark.extra_info.update(bf16_case=f"bwd {name} vs {baseline}", baseline_min_s=bmin,
                                baseline_median_s=bmed, threads=bench_threads,
                                kernel=fastattn._kernels.current_kernel(), bf16_path=PATH,
                                gflops=gflops, pair_peak_gflops=peak)


def test_seqlens_k_decode(benchmark, bench_threads):
    B, H, Lk, D = 4, 8, 8192, 128
    if benchmark.disabled:
        Lk = 2048
    lens = np.array([Lk, Lk // 16, Lk // 16, Lk // 16])
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, H, 1, D), dtype=np.float32)
    k, v = (rng.standard_normal((B, H, Lk, D), dtype=np.float32) for _ in range(2))
    out, bmin, bmed = interleaved(
        benchmark, lambda: fastattn.attention(q, k, v, seqlens_k=lens, num_threads=bench_threads),
        lambda: fastattn.attention(q, k, v, num_threads=bench_threads), 7)
    for b in (0, 1):
        ref = reference.attention(q[b], k[b, :, :lens[b]], v[b, :, :lens[b]])
        assert np.max(np.abs(out[b] - ref)) <= 3e-5 * np.max(np.abs(ref))
    benchmark.group = "seqlens_k decode"
    benchmark.extra_info.update(bf16_case=f"decode B{B} H{H} seqlens_k {lens.tolist()} vs all {Lk}",
                                baseline_min_s=bmin, baseline_median_s=bmed, threads=bench_threads,
                                kernel=fastattn._kernels.current_kernel(),
                                bytes_ratio=float(lens.sum() / (B * Lk)))
