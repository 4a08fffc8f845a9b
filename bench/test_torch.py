"""fastattn inside PyTorch (fastattn.torch) against PyTorch's own SDPA.

- Inference at the report's prefill and decode shapes: ``fastattn.torch.
  scaled_dot_product_attention`` timed with PyTorch's SDPA and the NumPy API
  (``fastattn.attention``) on the same data run just before each round (interleaved,
  0.1 s idle around each call, as in test_prefill.py), so the op's speed-up over PyTorch
  and its overhead over the NumPy API come from the same machine state.
- Per-call overhead at B=1 H=1 L=16 D=64: the wrapper, the registered op through the
  dispatcher, the routed ``torch.nn.functional.scaled_dot_product_attention``, PyTorch's
  SDPA and the NumPy API, in interleaved loops.
- Training: one step (forward, backward, SGD) of a small GPT (4 layers, d=256, 4 heads,
  L=1024, B=4) with and without ``fastattn.torch.sdpa_kernel()``, and the attention part
  alone (forward + backward of the step's SDPA call, times 4 layers).

Every result is checked: inference against the float64 oracle (sampled rows of every
batch and head), the training step's loss and gradients against PyTorch's step.  With
``--benchmark-disable`` each runs once (the training step: one step each way).
A table of the ratios is printed at the end when the benchmarks run.
"""
import time

import numpy as np
import pytest

import fastattn
from fastattn.bench import ratio_text  # noqa: E402

torch = pytest.importorskip("torch")
ft = pytest.importorskip("fastattn.torch")

TOL = {np.dtype(np.float32): 3e-5, np.dtype(np.float64): 1e-11}
SDPA = torch.nn.functional.scaled_dot_product_attention  # PyTorch's own


def summary_header():
    """The first line of the table bench/conftest.py's `summary` prints."""
    return (f"fastattn.torch vs PyTorch SDPA (torch {torch.__version__}, "
            f"threads={torch.get_num_threads()}, kernel={fastattn._kernels.current_kernel()}), "
            "interleaved, best / median rounds:")


def _idle_timed(f, times):
    """Run f between two 0.1 s idles (spinning worker threads settle), appending its time."""
    time.sleep(0.1)
    t = time.perf_counter()
    res = f()
    times.append(time.perf_counter() - t)
    time.sleep(0.1)
    return res


# ---------------------------------------------------------------------------------------
# inference: the report's prefill and decode shapes

# name: (B, Hq, Lq, Lk, D, causal); decode with Lq > 1 is bottom-right causal
INFERENCE = {
    "prefill B1 H8 L4096 D64": (1, 8, 4096, 4096, 64, False),
    "prefill B1 H8 L4096 D64 causal": (1, 8, 4096, 4096, 64, True),
    "prefill B1 H8 L2048 D128": (1, 8, 2048, 2048, 128, False),
    "prefill B4 H16 L256 D64": (4, 16, 256, 256, 64, False),
    "prefill B1 H16 L512 D64 causal": (1, 16, 512, 512, 64, True),
    "decode B1 H32 Lq1 Lk8192 D128": (1, 32, 1, 8192, 128, False),
    "decode B8 H32 Lq1 Lk2048 D128": (8, 32, 1, 2048, 128, False),
    "decode B1 H32 Lq4 Lk8192 D128": (1, 32, 4, 8192, 128, True),
}


@pytest.mark.parametrize("name", list(INFERENCE))
def test_torch_inference(benchmark, bench_threads, check_rows, summary, name):
    B, H, Lq, Lk, D, causal = INFERENCE[name]
    torch.set_num_threads(bench_threads)  # fastattn.torch runs on torch's thread count
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, H, Lq, D), dtype=np.float32)
    k = rng.standard_normal((B, H, Lk, D), dtype=np.float32)
    v = rng.standard_normal((B, H, Lk, D), dtype=np.float32)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    if causal and Lq != Lk:  # decoding: the new queries see the cache and their own prefix
        mask = torch.from_numpy(np.tril(np.ones((Lq, Lk), bool), Lk - Lq))
        torch_kw, ours_kw = dict(attn_mask=mask), dict(causal="bottom-right")
    else:
        torch_kw = ours_kw = dict(is_causal=causal)
    fa_causal = bool(causal)  # the NumPy API: bottom-right, the same as top-left when Lq == Lk
    torch_times, numpy_times = [], []

    def run_baselines():
        with torch.no_grad():
            _idle_timed(lambda: SDPA(tq, tk, tv, **torch_kw), torch_times)
        _idle_timed(lambda: fastattn.attention(q, k, v, causal=fa_causal,
                                               num_threads=bench_threads), numpy_times)

    def ours():
        with torch.no_grad():
            return ft.scaled_dot_product_attention(tq, tk, tv, **ours_kw)

    rounds = 5 if name.startswith("prefill") and B * H * Lq * Lk * D > 2**30 else 11
    benchmark.group = "torch op " + name
    out = benchmark.pedantic(ours, setup=run_baselines, rounds=rounds, iterations=1,
                             warmup_rounds=1)
    assert isinstance(out, torch.Tensor) and out.shape == (B, H, Lq, D)
    err = check_rows(out.numpy(), q, k, v, causal=fa_causal, tol=TOL[np.dtype(np.float32)])
    with torch.no_grad():
        assert float((out - SDPA(tq, tk, tv, **torch_kw)).abs().max()) <= 1e-4 * float(out.abs().max())
    benchmark.extra_info.update(torch_op=name, threads=bench_threads, rel_err=err,
                                kernel=fastattn._kernels.current_kernel())
    if benchmark.stats:
        ours_t = list(benchmark.stats.stats.data)
        torch_t, numpy_t = torch_times[-rounds:], numpy_times[-rounds:]
        benchmark.extra_info.update(torch_min_s=min(torch_t), numpy_api_min_s=min(numpy_t),
                                    torch_median_s=float(np.median(torch_t)),
                                    numpy_api_median_s=float(np.median(numpy_t)))
        summary.append(f"{name:<32} {min(ours_t) * 1e3:8.2f} ms   vs torch {ratio_text(torch_t, ours_t)}"
                       f"   (NumPy API vs torch {ratio_text(torch_t, numpy_t)};"
                       f" op / NumPy API time {ratio_text(ours_t, numpy_t)})")


# ---------------------------------------------------------------------------------------
# per-call overhead

def test_torch_call_overhead(benchmark, bench_threads, summary):
    """B=1 H=1 L=16 D=64 float32 under torch.no_grad(): fastattn.torch's function (timed
    by pytest-benchmark), and in interleaved loops the registered op called through the
    dispatcher, the routed torch.nn.functional function, PyTorch's SDPA and the NumPy
    API."""
    torch.set_num_threads(bench_threads)
    q, k, v = (torch.randn(1, 1, 16, 64, generator=torch.Generator().manual_seed(i)) for i in range(3))
    qn, kn, vn = q.numpy(), k.numpy(), v.numpy()
    op = torch.ops.fastattn.attention_fwd
    routed = ft._routed_sdpa
    ft.enable()  # the routed function needs the original saved
    try:
        calls = {
            "fastattn.torch.scaled_dot_product_attention": lambda: ft.scaled_dot_product_attention(q, k, v),
            "torch.ops.fastattn.attention_fwd (dispatcher)": lambda: op(
                q, k, v, None, None, None, 0.125, 0, -1, -1, 0.0, 0.0, None),
            "F.scaled_dot_product_attention in sdpa_kernel()": lambda: routed(q, k, v),
            "torch SDPA": lambda: SDPA(q, k, v),
            "fastattn.attention (NumPy API)": lambda: fastattn.attention(qn, kn, vn),
        }
        with torch.no_grad():
            ref = SDPA(q, k, v)
            for f in calls.values():
                out = f()
                out = out[0] if isinstance(out, tuple) else out
                assert float((torch.as_tensor(out) - ref).abs().max()) <= 1e-5
            benchmark.group = "torch op call overhead B1 H1 L16 D64 float32"
            benchmark(calls["fastattn.torch.scaled_dot_product_attention"])
            if not benchmark.stats:
                return
            best = {name: float("inf") for name in calls}
            loops = 2000
            for _ in range(9):  # interleaved: each round times every call in turn
                for name, f in calls.items():
                    t = time.perf_counter()
                    for _ in range(loops):
                        f()
                    best[name] = min(best[name], (time.perf_counter() - t) / loops)
    finally:
        ft.disable()
    us = {name: t * 1e6 for name, t in best.items()}
    benchmark.extra_info.update(microseconds=us, threads=bench_threads)
    summary.append("call overhead B1 H1 L16 D64 float32, us per call (best of 9 interleaved "
                   "loops of 2000):")
    for name, t in us.items():
        summary.append(f"  {name:<50} {t:7.1f} us   {t / us['torch SDPA']:5.2f}x torch SDPA")


# ---------------------------------------------------------------------------------------
# training: a small GPT

VOCAB = 256


class Block(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
                                       torch.nn.Linear(4 * d, d))

    def forward(self, x):
        B, L, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, L, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, L, d))
        return x + self.mlp(self.ln2(x))


class GPT(torch.nn.Module):
    def __init__(self, d=256, heads=4, layers=4, L=1024):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(VOCAB, d), torch.nn.Embedding(L, d)
        self.blocks = torch.nn.Sequential(*(Block(d, heads) for _ in range(layers)))
        self.ln, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.ln(self.blocks(x)))


GPT_SHAPE = dict(B=4, L=1024, d=256, heads=4, layers=4)


def _gpt_and_step():
    """Two identical GPTs, a batch and step(model, opt, routed) -> (loss, seconds)."""
    s = GPT_SHAPE
    torch.manual_seed(0)
    models = [GPT(s["d"], s["heads"], s["layers"], s["L"]) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in models]
    batch = torch.randint(0, VOCAB, (s["B"], s["L"] + 1), generator=torch.Generator().manual_seed(0))

    def step(model, opt, routed):
        with ft.sdpa_kernel(routed):
            t = time.perf_counter()
            logits = model(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                                     batch[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.item(), time.perf_counter() - t
    return models, opts, step


def test_torch_training_step(benchmark, bench_threads, summary):
    """Whole step, fastattn (sdpa_kernel) timed, PyTorch's step on an identical model in
    the set-up of each round; both models see the same batch, so their losses stay equal."""
    torch.set_num_threads(bench_threads)
    (m_torch, m_ours), (o_torch, o_ours), step = _gpt_and_step()
    torch_times, losses = [], []

    def run_torch():
        time.sleep(0.1)
        loss, t = step(m_torch, o_torch, False)
        torch_times.append(t)
        losses.append(loss)
        time.sleep(0.1)

    def ours():
        return step(m_ours, o_ours, True)[0]

    benchmark.group = "torch op GPT training step"
    rounds = 3
    loss = benchmark.pedantic(ours, setup=run_torch, rounds=rounds, iterations=1, warmup_rounds=1)
    assert abs(loss - losses[-1]) <= 1e-4 * abs(losses[-1]), (loss, losses[-1])  # same step count
    with torch.no_grad():
        for p, r in zip(m_ours.parameters(), m_torch.parameters()):
            assert float((p - r).abs().max()) <= 1e-4 * max(float(r.abs().max()), 1e-6)
    benchmark.extra_info.update(gpt=GPT_SHAPE, threads=bench_threads, loss=loss)
    if benchmark.stats:
        ours_t, torch_t = list(benchmark.stats.stats.data), torch_times[-rounds:]
        benchmark.extra_info.update(torch_min_s=min(torch_t), torch_median_s=float(np.median(torch_t)))
        summary.append(f"{'GPT training step (whole)':<32} {min(ours_t) * 1e3:8.1f} ms   vs torch "
                       f"{ratio_text(torch_t, ours_t)}   (torch {min(torch_t) * 1e3:.1f} ms)")


def test_torch_training_attention(benchmark, bench_threads, summary):
    """The attention part of that step: forward + backward of its SDPA call (B=4 H=4
    L=1024 D=64 causal float32, q/k/v strided views of the fused projection), fastattn vs
    PyTorch interleaved; the summary gives it times the 4 layers."""
    s = GPT_SHAPE
    B, L, H, D = s["B"], s["L"], s["heads"], s["d"] // s["heads"]
    torch.set_num_threads(bench_threads)
    g = torch.Generator().manual_seed(0)
    proj = torch.randn(B, L, 3, H, D, generator=g).requires_grad_()
    dout = torch.randn(B, H, L, D, generator=g)

    def fwd_bwd(sdpa):
        q, k, v = proj.permute(2, 0, 3, 1, 4)
        out = sdpa(q, k, v, is_causal=True)
        grad, = torch.autograd.grad(out, proj, dout)
        return out.detach(), grad

    torch_times = []
    ref = []

    def run_torch():
        ref[:] = _idle_timed(lambda: fwd_bwd(SDPA), torch_times)

    benchmark.group = "torch op GPT attention forward+backward"
    rounds = 5
    out, grad = benchmark.pedantic(lambda: fwd_bwd(ft.scaled_dot_product_attention),
                                   setup=run_torch, rounds=rounds, iterations=1, warmup_rounds=1)
    assert float((out - ref[0]).abs().max()) <= 1e-5 * float(ref[0].abs().max())
    assert float((grad - ref[1]).abs().max()) <= 1e-4 * float(ref[1].abs().max())
    benchmark.extra_info.update(shape=[B, H, L, D], threads=bench_threads)
    if benchmark.stats:
        ours_t, torch_t = list(benchmark.stats.stats.data), torch_times[-rounds:]
        layers = s["layers"]
        benchmark.extra_info.update(torch_min_s=min(torch_t), torch_median_s=float(np.median(torch_t)))
        summary.append(f"{'GPT attention fwd+bwd x4 layers':<32} {min(ours_t) * layers * 1e3:8.1f} ms"
                       f"   vs torch {ratio_text(torch_t, ours_t)}   (torch "
                       f"{min(torch_t) * layers * 1e3:.1f} ms)")
