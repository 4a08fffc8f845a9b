"""transformers generate() at a long context: tokens/s and cache memory of
fastattn.transformers.KVCache (float32, int8, int4) against "sdpa" and fastattn with
a DynamicCache, and against transformers' QuantizedCache (quanto backend, int4 and
int2... where optimum-quanto installs).

    python bench/kvcache_generate.py [--context 8192] [--tokens 32] [--threads 2] [--out FILE]

A Llama of hidden 512, 6 layers, 8 heads of 64 (issue 59's model), random weights,
float32.  Each configuration prefills the same prompt of --context tokens (untimed),
then decodes --tokens tokens greedily, one forward a token with the cache, timed; the
configurations take turns token by token (a 30 ms pause between), and the figure is
the median step's tokens/s.  The K/V bytes a step must read (float32: 2 x 6 layers x
8 heads x context x 64 x 4 bytes) over the step's time is shown beside the read
bandwidth measured in the same process over as many bytes.
"""
import argparse
import datetime
import time
import warnings

import numpy as np
import torch
import transformers

import fastattn
import fastattn.bench
import fastattn.transformers


def model(attn):
    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1376,
                                   num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8,
                                   max_position_embeddings=32768)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).eval()
    m.config._attn_implementation = attn
    return m


def quanto_cache(m, nbits):
    return transformers.cache_utils.QuantizedCache(backend="quanto", config=m.config, nbits=nbits)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    fastattn.transformers.register()
    warnings.simplefilter("ignore")
    cap = a.context + a.tokens + 8
    configs = {
        "sdpa, DynamicCache": ("sdpa", lambda m: transformers.DynamicCache()),
        "fastattn, DynamicCache": ("fastattn", lambda m: transformers.DynamicCache()),
        "fastattn, KVCache float32": ("fastattn", lambda m: fastattn.transformers.KVCache(cap)),
        "fastattn, KVCache int8": ("fastattn", lambda m: fastattn.transformers.KVCache(cap, dtype="int8")),
        "fastattn, KVCache int4": ("fastattn", lambda m: fastattn.transformers.KVCache(cap, dtype="int4")),
    }
    try:
        import optimum.quanto  # noqa: F401
        configs["sdpa, QuantizedCache quanto int4"] = ("sdpa", lambda m: quanto_cache(m, 4))
        configs["sdpa, QuantizedCache quanto int2"] = ("sdpa", lambda m: quanto_cache(m, 2))
    except ImportError:
        print("transformers' QuantizedCache: optimum-quanto is not installed (pip install optimum-quanto)")
    ids = torch.randint(1, 1024, (1, a.context), generator=torch.Generator().manual_seed(1))
    state = {}
    with torch.no_grad():
        for name, (attn, make) in configs.items():
            m = model(attn)
            cache = make(m)
            t = time.perf_counter()
            logits = m(ids, past_key_values=cache, use_cache=True).logits
            state[name] = dict(m=m, cache=cache, tok=logits[:, -1:].argmax(-1), steps=[],
                               prefill=time.perf_counter() - t, tokens=[])
            print(f"{name}: prefill {state[name]['prefill']:.2f} s", flush=True)
        for _ in range(a.tokens):
            for name, st in state.items():
                time.sleep(0.03)
                t = time.perf_counter()
                logits = st["m"](st["tok"], past_key_values=st["cache"], use_cache=True).logits
                st["steps"].append(time.perf_counter() - t)
                st["tok"] = logits[:, -1:].argmax(-1)
                st["tokens"].append(int(st["tok"]))
    kv_bytes = 2 * 6 * 8 * a.context * 64 * 4
    bw = fastattn.bench.read_bandwidth(a.threads, mib=min(2048, kv_bytes // 2**20)) * 1e9
    lines = [f"# generate() at {a.context} tokens of context, {datetime.date.today()}", "",
             f"Llama hidden 512, 6 layers, 8 heads of 64, float32; {a.threads} threads; median of "
             f"{a.tokens} decode steps, configurations taking turns; read bandwidth over "
             f"{kv_bytes / 1e6:.0f} MB: {bw / 1e9:.1f} GB/s", "",
             "| configuration | tokens/s | ms a token | cache MB | float32 K/V bytes / step time | "
             "greedy tokens = sdpa's |", "| --- | --- | --- | --- | --- | --- |"]
    ref = state["sdpa, DynamicCache"]["tokens"]
    for name, st in state.items():
        step = float(np.median(st["steps"]))
        cache = st["cache"]
        if isinstance(cache, fastattn.transformers.KVCache):
            mb = cache.nbytes / 1e6
        elif isinstance(cache, transformers.DynamicCache):
            mb = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers) / 1e6
        else:  # a QuantizedCache: its quantized tensors and its float residual
            mb = float("nan")
        lines.append(f"| {name} | {1 / step:.1f} | {step * 1e3:.2f} | {'n/a' if mb != mb else f'{mb:.0f}'} | "
                     f"{kv_bytes / step / 1e9:.1f} GB/s | {st['tokens'] == ref} |")
    print("\n".join(lines))
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
