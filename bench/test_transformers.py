"""fastattn inside transformers (``attn_implementation="fastattn"``) against "sdpa".

A Llama-shaped model of ~110M parameters built from its config (random weights, no
download: hidden 768, 10 layers, 12 query and 4 key/value heads of 64, vocab 32000),
float32, on ``--bench-threads`` threads:

- one forward pass over 4096 tokens (B=1, causal prefill, the last position's
  logits; tokens/s);
- ``generate()``: a 2048-token prompt and 128 new tokens, greedy, dynamic cache
  (new tokens/s over the whole call, and the prefill alone).

The two implementations are one model switched with ``set_attn_implementation``,
timed in alternation (fastattn by pytest-benchmark, "sdpa" in each round's set-up,
0.03 s idle between them); their outputs must agree (logits to float32 attention's
accuracy, the same greedy tokens).  With ``--benchmark-disable`` the sizes shrink
(L 256, a 128-token prompt and 8 new tokens) and each runs once, as a check.

- The thread hand-over: an attention call between two PyTorch ops (a Linear before
  and after, as in a model, with no pause), fastattn.torch against PyTorch's SDPA, and
  fastattn's call after a 30 ms idle: the ratio of the two fastattn times is what
  sharing the cores with PyTorch's thread pool costs.
"""
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
fat = pytest.importorskip("fastattn.transformers")
ft = pytest.importorskip("fastattn.torch")

import fastattn  # noqa: E402
from fastattn.bench import ratio_text  # noqa: E402

SDPA = torch.nn.functional.scaled_dot_product_attention
MODEL = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=10,
             num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=8192)


def summary_header():
    """The first line of the table bench/conftest.py's `summary` prints."""
    return (f"transformers {transformers.__version__}, attn_implementation 'fastattn' vs 'sdpa' "
            f"(torch {torch.__version__}, threads={torch.get_num_threads()}, "
            f"kernel={fastattn._kernels.current_kernel()}), interleaved, best / median:")


@pytest.fixture(scope="module")
def model(bench_threads):
    torch.set_num_threads(bench_threads)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**MODEL)
    m = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa",
                                                   dtype=torch.float32).eval()
    return m


def _quick(request):
    return bool(request.config.getoption("benchmark_disable", False))


def _alternate(benchmark, model, fn, rounds):
    """fn() under "fastattn" timed by pytest-benchmark, under "sdpa" in each round's
    set-up; returns (fastattn's last result, sdpa's last result, sdpa's times)."""
    sdpa_times, sdpa_res = [], []

    def setup():
        model.set_attn_implementation("sdpa")
        time.sleep(0.03)
        t = time.perf_counter()
        sdpa_res.append(fn())
        sdpa_times.append(time.perf_counter() - t)
        model.set_attn_implementation("fastattn")
        time.sleep(0.03)

    with torch.no_grad():
        ours = benchmark.pedantic(fn, setup=setup, rounds=rounds, iterations=1, warmup_rounds=0)
    model.set_attn_implementation("sdpa")
    return ours, sdpa_res[-1], sdpa_times[-rounds:]


def test_forward_4096(benchmark, model, request, summary):
    L = 256 if _quick(request) else 4096
    ids = torch.randint(0, MODEL["vocab_size"], (1, L), generator=torch.Generator().manual_seed(1))
    benchmark.group = f"transformers forward L{L}"
    # a prefill: the last position's logits only (the 4096 x 32000 others would be half
    # a GB of page faults, and a quarter of the FLOPs, in neither attention)
    ours, ref, sdpa_t = _alternate(
        benchmark, model, lambda: model(ids, use_cache=False, logits_to_keep=1).logits, 5)
    err = float((ours - ref).abs().max()) / float(ref.abs().max())
    assert err <= 1e-4, err
    benchmark.extra_info.update(L=L, rel_err_vs_sdpa=err)
    if benchmark.stats:
        ours_t = list(benchmark.stats.stats.data)
        summary.append(f"forward B1 L{L} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M "
                       f"params): fastattn {L / min(ours_t):7.0f} tok/s, sdpa {L / min(sdpa_t):7.0f} "
                       f"tok/s; time sdpa / fastattn {ratio_text(sdpa_t, ours_t)}")


def test_generate(benchmark, model, request, summary):
    prompt, new = (128, 8) if _quick(request) else (2048, 128)
    ids = torch.randint(0, MODEL["vocab_size"], (1, prompt), generator=torch.Generator().manual_seed(2))

    def gen():
        return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)

    benchmark.group = f"transformers generate {prompt}+{new}"
    ours, ref, sdpa_t = _alternate(benchmark, model, gen, 3)
    assert torch.equal(ours, ref)  # the same greedy tokens
    benchmark.extra_info.update(prompt=prompt, new_tokens=new)
    if benchmark.stats:
        ours_t = list(benchmark.stats.stats.data)
        pre_ours, pre_sdpa = _prefill_times(model, ids)
        summary.append(f"generate {prompt}+{new}: fastattn {new / min(ours_t):6.1f} new tok/s "
                       f"({min(ours_t):.2f} s), sdpa {new / min(sdpa_t):6.1f} ({min(sdpa_t):.2f} s); "
                       f"time sdpa / fastattn {ratio_text(sdpa_t, ours_t)}; the prefill alone "
                       f"{ratio_text(pre_sdpa, pre_ours)}")


def _prefill_times(model, ids, rounds=3):
    times = {"sdpa": [], "fastattn": []}
    with torch.no_grad():
        for _ in range(rounds):
            for impl in ("sdpa", "fastattn"):
                model.set_attn_implementation(impl)
                time.sleep(0.03)
                t = time.perf_counter()
                model(ids)
                times[impl].append(time.perf_counter() - t)
    model.set_attn_implementation("sdpa")
    return times["fastattn"], times["sdpa"]


# name: (B, H, L, D) of the attention call between two Linear layers of width H * D
HANDOVER = {"B4 H16 L256 D64": (4, 16, 256, 64), "B32 H8 L64 D64": (32, 8, 64, 64),
            "B1 H12 L2048 D64 causal": (1, 12, 2048, 64)}


@pytest.mark.parametrize("name", list(HANDOVER))
def test_thread_handover(benchmark, bench_threads, summary, name):
    """Linear -> attention -> Linear with no pause, 20 times a round: the attention
    calls' own times, fastattn.torch against PyTorch's SDPA, and fastattn's after a
    30 ms idle (no other pool's threads left spinning)."""
    torch.set_num_threads(bench_threads)
    B, H, L, D = HANDOVER[name]
    causal = name.endswith("causal")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, L, H * D, generator=g)
    lin = torch.nn.Linear(H * D, 3 * H * D)
    out_lin = torch.nn.Linear(H * D, H * D)
    times = {"fastattn": [], "sdpa": [], "idle": []}

    def layer(attn, key):
        with torch.no_grad():
            qkv = lin(x).reshape(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
            t = time.perf_counter()
            o = attn(qkv[0], qkv[1], qkv[2], is_causal=causal)
            times[key].append(time.perf_counter() - t)
            return out_lin(o.transpose(1, 2).reshape(B, L, H * D))

    def run_others():
        for _ in range(20):
            ref = layer(SDPA, "sdpa")
        time.sleep(0.03)
        with torch.no_grad():  # fastattn alone after an idle: the same call
            qkv = lin(x).reshape(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
            time.sleep(0.03)
            t = time.perf_counter()
            ft.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=causal)
            times["idle"].append(time.perf_counter() - t)
        run_others.ref = ref

    def ours():
        for _ in range(20):
            res = layer(ft.scaled_dot_product_attention, "fastattn")
        return res

    benchmark.group = "thread hand-over " + name
    out = benchmark.pedantic(ours, setup=run_others, rounds=5, iterations=1, warmup_rounds=1)
    assert float((out - run_others.ref).abs().max()) <= 1e-4 * float(run_others.ref.abs().max())
    if benchmark.stats:
        fa, sd, idle = times["fastattn"][-100:], times["sdpa"][-100:], times["idle"][-5:]
        benchmark.extra_info.update(fastattn_median_s=float(np.median(fa)),
                                    sdpa_median_s=float(np.median(sd)),
                                    fastattn_after_idle_median_s=float(np.median(idle)))
        summary.append(f"between torch ops {name:<24} fastattn {np.median(fa) * 1e3:7.3f} ms, sdpa "
                       f"{np.median(sd) * 1e3:7.3f} ms: sdpa / fastattn {ratio_text(sd, fa)}; fastattn "
                       f"between ops / after 30 ms idle {np.median(fa) / np.median(idle):5.2f}x (median)")
