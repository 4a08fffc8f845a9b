"""Issue 59's table: decoding through fastattn.KVCache, as a fraction of the read
bandwidth, against the float32 cache, llama.cpp (ggml flash_attn_ext, the same cache
type: q8_0 for int8, q4_0 for int4), PyTorch SDPA and ONNX Runtime (float32), and
against today's path (user-held (B, H, T, D) arrays).

    python bench/kvcache_table.py [--threads 2] [--reps 15] [--cases a,b,...] [--out FILE]

One process.  Two measurements a case:
- the fraction of the read bandwidth: each cache's decode calls back to back (no
  pause: a pause measures thread wake-ups and a cold cache, not the memory's speed),
  their median, against fastattn.bench.read_bandwidth() over a buffer of the same
  bytes on the same threads, measured right before (best of several passes; the host's
  bandwidth moves).  GB/s counts the bytes a call must read: each slot's keys and
  values (with their scales and zero points) up to its length;
- the ratios: every library's call interleaved (each in turn, a 30 ms pause between
  calls, as OpenMP threads spin after a call), medians.
Run it twice, with OMP_PROC_BIND=true and without, for the bound and unbound rows.
"""
import argparse
import datetime
import os
import sys
import time

import numpy as np

# the cores before fastattn loads libgomp, which under OMP_PROC_BIND binds this thread to
# one of them: ONNX Runtime's pool is made on all of them (its threads start from the
# creating thread's cores; on the one core, 1.9x the time: bench/NOTEBOOK.md, 2026-12-07,
# fifth session)
_CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
import fastattn  # noqa: E402
import fastattn.bench  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402

DTYPES = ("float32", "float16", "bfloat16", "int8", "int4")
CASES = {  # name: (B, Hq, Hkv, Lq, lengths)
    "B1 H32 Lk8192": (1, 32, 32, 1, [8192]),
    "B8 H32 Lk2048": (8, 32, 32, 1, [2048] * 8),
    "B1 GQA 32/8 Lk8192": (1, 32, 8, 1, [8192]),
    "B1 H32 Lq4 Lk8192": (1, 32, 32, 4, [8192]),
    "B8 H32 ragged 512..8192": (8, 32, 32, 1, [int(x) for x in np.linspace(512, 8192, 8)]),
}
D = 128


def token_bytes(dtype, bs):
    """Bytes a call reads per token and kv head: keys, values, scales, zero points."""
    if dtype == "float32":
        return 2 * D * 4
    if dtype in ("float16", "bfloat16"):
        return 2 * D * 2
    codes = 2 * D if dtype == "int8" else D
    return codes + 2 * 4 * D / bs + 4 * D / 32  # + per-channel (s, z) a block, a scale a 32-group


def _cpu():
    info = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, val = line.partition(":")
            info.setdefault(key.strip(), val.strip())
    return f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} model {info.get('model', '?')})"


def median_interleaved(fns, reps, pause=0.03):
    times = {n: [] for n in fns}
    for n, f in fns.items():  # one untimed call each
        f()
        time.sleep(pause)
    for _ in range(reps):
        for n, f in fns.items():
            t = time.perf_counter()
            f()
            times[n].append(time.perf_counter() - t)
            time.sleep(pause)
    return {n: float(np.median(t)) for n, t in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    nt = a.threads
    rng = np.random.default_rng(0)
    bound = os.environ.get("OMP_PROC_BIND", "") not in ("", "false")
    lines = [f"# fastattn.KVCache decoding, {datetime.date.today()}", "",
             f"Machine: {_cpu()}, {os.cpu_count()} CPUs",
             f"kernel {fastattn._kernels.current_kernel()}, {nt} threads, OMP_PROC_BIND="
             f"{os.environ.get('OMP_PROC_BIND', '(unset)')}, medians of {a.reps} interleaved calls, 30 ms pauses",
             "", "| case | cache | ms back to back | GB/s | read bw (same bytes) | % of it "
             "| ms interleaved | vs float32 cache | vs llama.cpp same type "
             "| vs arrays (today's path) | vs PyTorch SDPA | vs ONNX Runtime |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    print("\n".join(lines), flush=True)
    for case in a.cases.split(","):
        B, Hq, Hkv, Lq, lengths = CASES[case]
        L = max(lengths)
        k = rng.standard_normal((B, Hkv, L, D), dtype=np.float32)
        v = rng.standard_normal((B, Hkv, L, D), dtype=np.float32)
        q = rng.standard_normal((B, Hq, Lq, D), dtype=np.float32)
        lens = np.array(lengths)
        caches = {}
        for dt in a.dtypes.split(","):
            c = fastattn.KVCache(B, Hkv, D, L, dtype=dt)
            c.append(k, v, lengths=lens)
            caches[dt] = c
        fns = {f"kv {dt}": (lambda c=c: fastattn.attention(q, c, causal=True, num_threads=nt))
               for dt, c in caches.items()}
        ragged = len(set(lengths)) > 1
        fns["arrays"] = (lambda: fastattn.attention(q, k, v, causal=True, num_threads=nt,
                                                    seqlens_k=lens if ragged else None))
        if Lq == 1 and not ragged:
            for dt in caches:
                try:
                    fns[f"ggml {dt}"] = peers.make_ggml(q, k, v, nt, cache=dt)
                except ImportError:
                    pass
        if not ragged:
            try:
                import torch
                torch.set_num_threads(nt)
                tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
                mask = torch.from_numpy(np.tril(np.ones((Lq, L), bool), L - Lq))
                fns["torch"] = lambda: torch.nn.functional.scaled_dot_product_attention(
                    tq, tk, tv, attn_mask=mask if Lq > 1 else None, enable_gqa=Hq != Hkv)
            except ImportError:
                pass
            try:
                mine = os.sched_getaffinity(0) if _CORES else None
                if _CORES:
                    os.sched_setaffinity(0, _CORES)
                try:
                    ort = peers.make_onnxruntime(B, Hq, Hkv, Lq, L, D, nt)
                finally:
                    if mine:
                        os.sched_setaffinity(0, mine)
                fns["onnxruntime"] = lambda: ort(q, k, v)
            except ImportError:
                pass
        t = median_interleaved(fns, a.reps)
        for dt, c in caches.items():
            tb = token_bytes(dt, c.block_size) * Hkv * lens.sum()
            mib = max(1, min(2048, int(round(tb / 2**20))))
            bw = fastattn.bench.read_bandwidth(nt, mib=mib) * 1e9
            f = fns[f"kv {dt}"]
            f()
            runs = []
            for _ in range(a.reps):
                t0 = time.perf_counter()
                f()
                runs.append(time.perf_counter() - t0)
            bb = float(np.median(runs))
            ms = t[f"kv {dt}"]
            row = [case, dt, f"{bb * 1e3:.2f}", f"{tb / bb / 1e9:.1f}", f"{bw / 1e9:.1f}",
                   f"{100 * tb / bb / bw:.0f}%", f"{ms * 1e3:.2f}",
                   f"{t['kv float32'] / ms:.2f}x" if "kv float32" in t else "",
                   f"{t[f'ggml {dt}'] / ms:.2f}x" if f"ggml {dt}" in t else "-",
                   f"{t['arrays'] / ms:.2f}x" if dt == "float32" else "",
                   f"{t['torch'] / ms:.2f}x" if dt == "float32" and "torch" in t else "",
                   f"{t['onnxruntime'] / ms:.2f}x" if dt == "float32" and "onnxruntime" in t else ""]
            lines.append("| " + " | ".join(row) + " |")
            print(lines[-1], flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
