"""Speed A/B of two builds of fastattn, interleaved: the bench's prefill, decode and
backward cases timed in two worker processes, one importing each build, taking turns
call by call (30 ms apart, so neither build's OpenMP threads spin into the other's
turn), medians and the per-round ratio B/A reported.

    python bench/ab_speed.py OLD_TREE NEW_TREE [--rounds 15] [--threads 2] [--only decode]
                             [--pairs 2]

A tree is a source checkout with its extension built in place (``python setup.py
build_ext --inplace``).  With the same code in both trees, the ratios show the
noise of the machine.  A worker process can run a case up to 5% apart from another
worker of the same build, whatever it loads (its arrays land elsewhere in memory), so
the rounds take turns over --pairs pairs of workers (each pair for two rounds, one in
each order); the last column is the B/A median of each pair, whose spread is that
per-worker offset.
"""
import argparse
import json
import os
import subprocess
import sys
import time

CASES = {
    "prefill B1 H8 L4096 D64": dict(fn="fwd", B=1, H=8, Lq=4096, Lk=4096, D=64),
    "prefill B1 H8 L4096 D64 causal": dict(fn="fwd", B=1, H=8, Lq=4096, Lk=4096, D=64, causal=True),
    "prefill B1 H8 L2048 D128": dict(fn="fwd", B=1, H=8, Lq=2048, Lk=2048, D=128),
    "prefill B4 H16 L256 D64": dict(fn="fwd", B=4, H=16, Lq=256, Lk=256, D=64),
    "prefill B8 H32 L128 D64": dict(fn="fwd", B=8, H=32, Lq=128, Lk=128, D=64),
    "prefill B32 H8 L64 D64": dict(fn="fwd", B=32, H=8, Lq=64, Lk=64, D=64),
    "prefill B1 H8 L2048 D64 float64": dict(fn="fwd", B=1, H=8, Lq=2048, Lk=2048, D=64, dtype="float64"),
    "prefill B1 H8 L2048 D128 float64": dict(fn="fwd", B=1, H=8, Lq=2048, Lk=2048, D=128, dtype="float64"),
    "decode B1 H32 Lk8192 D128": dict(fn="fwd", B=1, H=32, Lq=1, Lk=8192, D=128),
    "decode B8 H32 Lk2048 D128": dict(fn="fwd", B=8, H=32, Lq=1, Lk=2048, D=128),
    "decode B1 Hq32 Hkv8 Lk8192 D128": dict(fn="fwd", B=1, H=32, Hkv=8, Lq=1, Lk=8192, D=128),
    "decode B1 H32 Lq4 Lk8192 D128": dict(fn="fwd", B=1, H=32, Lq=4, Lk=8192, D=128, causal=True),
    "decode B1 H32 Lk8192 D128 f16 K/V": dict(fn="fwd", B=1, H=32, Lq=1, Lk=8192, D=128, kv="float16"),
    "decode B1 H32 Lk8192 D128 bf16 K/V": dict(fn="fwd", B=1, H=32, Lq=1, Lk=8192, D=128, kv="bfloat16"),
    "decode B1 Hq32 Hkv8 Lk8192 D128 f16 K/V": dict(fn="fwd", B=1, H=32, Hkv=8, Lq=1, Lk=8192, D=128,
                                                   kv="float16"),
    "decode B1 H32 Lk8192 D128 int8 K/V": dict(fn="fwd", B=1, H=32, Lq=1, Lk=8192, D=128, kv="int8"),
    "decode B1 H32 Lk8192 D128 paged16": dict(fn="fwd", B=1, H=32, Lq=1, Lk=8192, D=128, page=16),
    "decode B1 H32 Lk8192 D128 paged128": dict(fn="fwd", B=1, H=32, Lq=1, Lk=8192, D=128, page=128),
    "backward B1 H8 L2048 D64": dict(fn="bwd", B=1, H=8, Lq=2048, Lk=2048, D=64),
    "prefill B1 H8 L4096 D64 bf16": dict(fn="fwd", B=1, H=8, Lq=4096, Lk=4096, D=64, kv="bfloat16", q16=True),
    "prefill B1 H8 L2048 D128 bf16": dict(fn="fwd", B=1, H=8, Lq=2048, Lk=2048, D=128, kv="bfloat16", q16=True),
    "prefill B1 H8 L4096 D64 causal bf16": dict(fn="fwd", B=1, H=8, Lq=4096, Lk=4096, D=64, causal=True,
                                                kv="bfloat16", q16=True),
    "prefill B4 H16 L256 D64 bf16": dict(fn="fwd", B=4, H=16, Lq=256, Lk=256, D=64, kv="bfloat16", q16=True),
    "prefill B1 H8 L4096 D64 f16": dict(fn="fwd", B=1, H=8, Lq=4096, Lk=4096, D=64, kv="float16", q16=True),
    "prefill B4 H16 L256 D64 f16": dict(fn="fwd", B=4, H=16, Lq=256, Lk=256, D=64, kv="float16", q16=True),
    "backward B1 H8 L2048 D64 bf16": dict(fn="bwd", B=1, H=8, Lq=2048, Lk=2048, D=64, kv="bfloat16", q16=True),
    "backward B1 H8 L2048 D128 bf16": dict(fn="bwd", B=1, H=8, Lq=2048, Lk=2048, D=128, kv="bfloat16", q16=True),
    "backward B1 H8 L4096 D64 causal bf16": dict(fn="bwd", B=1, H=8, Lq=4096, Lk=4096, D=64, causal=True,
                                                 kv="bfloat16", q16=True),
}
for _dt in ("float32", "float16", "int8", "int4"):  # decoding through fastattn.KVCache
    CASES[f"kvcache {_dt} B1 H32 Lk8192 D128"] = dict(fn="fwd", B=1, H=32, Lq=1, Lk=8192, D=128, cache=_dt)
    CASES[f"kvcache {_dt} B1 Hq32 Hkv8 Lk8192 D128"] = dict(fn="fwd", B=1, H=32, Hkv=8, Lq=1, Lk=8192, D=128,
                                                           cache=_dt)

WORKER = r"""
import json, sys, time
import numpy as np
import fastattn
cases = json.loads(sys.argv[1])
nth = int(sys.argv[2])
rng = np.random.default_rng(0)
data = {}
for name, c in cases.items():
    dt = c.get("dtype", "float32")  # q's (and, unless kv says otherwise, K/V's)
    q = rng.standard_normal((c["B"], c["H"], c["Lq"], c["D"])).astype(dt)
    hkv, kv = c.get("Hkv", c["H"]), c.get("kv", dt)
    if kv == "bfloat16":
        import ml_dtypes
        kv = ml_dtypes.bfloat16
    k = rng.standard_normal((c["B"], hkv, c["Lk"], c["D"])).astype(np.float32 if kv == "int8" else kv)
    v = rng.standard_normal((c["B"], hkv, c["Lk"], c["D"])).astype(np.float32 if kv == "int8" else kv)
    kw = dict(causal=c.get("causal", False), num_threads=nth)
    if kv == "int8":
        k, v = fastattn.quantize_kv(k), fastattn.quantize_kv(v)
    if c.get("page"):  # the same keys in shuffled pages of a vLLM-layout pool
        bs, n = c["page"], c["B"] * c["Lk"] // c["page"]
        order = rng.permutation(n)
        pool = lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(n, bs, hkv, c["D"])[np.argsort(order)])
        k, v = pool(k), pool(v)
        kw.update(block_table=order.reshape(c["B"], -1).astype(np.int32),
                  seqlens_k=np.full(c["B"], c["Lk"], np.int32))
    if c.get("cache"):  # a fastattn.KVCache of that dtype holding the same keys and values
        kc = fastattn.KVCache(c["B"], hkv, c["D"], c["Lk"], dtype=c["cache"])
        kc.append(k, v)
        k, v = kc, None
    if c.get("q16"):  # q (and dout) of K/V's 16-bit type too
        q = q.astype(kv)
    if c["fn"] == "bwd":
        o, l = fastattn.attention(q, k, v, return_lse=True, **kw)
        d = rng.standard_normal(o.shape).astype(q.dtype)
        f = lambda q=q, k=k, v=v, o=o, l=l, d=d, kw=kw: fastattn.attention_backward(d, q, k, v, o, l, **kw)
    else:
        f = lambda q=q, k=k, v=v, kw=kw: fastattn.attention(q, k, v, **kw)
    f()
    data[name] = f
print("ready " + fastattn.__file__, flush=True)
for line in sys.stdin:
    name = line.strip()
    t = time.perf_counter()
    data[name]()
    print(time.perf_counter() - t, flush=True)
"""


def start(tree, threads, cases):
    env = dict(os.environ, PYTHONPATH=tree)
    p = subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(cases), str(threads)], env=env,
                         cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ready = p.stdout.readline().strip()
    if not ready.startswith("ready"):
        raise RuntimeError(f"worker for {tree} did not start")
    return p, ready.split(" ", 1)[1]


def ask(p, name):
    p.stdin.write(name + "\n")
    p.stdin.flush()
    return float(p.stdout.readline())


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="", help="run the cases whose name contains this")
    ap.add_argument("--pairs", type=int, default=2, help="pairs of worker processes to take turns")
    args = ap.parse_args(argv)
    cases = {n: c for n, c in CASES.items() if args.only in n}
    if not cases:
        ap.error(f"no case name contains {args.only!r}")
    pairs = []
    for i in range(max(1, args.pairs)):  # every other pair started B first
        if i % 2 == 0:
            a, fa = start(os.path.abspath(args.old), args.threads, cases)
            b, fb = start(os.path.abspath(args.new), args.threads, cases)
        else:
            b, fb = start(os.path.abspath(args.new), args.threads, cases)
            a, fa = start(os.path.abspath(args.old), args.threads, cases)
        pairs.append((a, b))
    print(f"A: {fa}\nB: {fb}\n{args.rounds} rounds, {args.threads} threads, alternating A/B "
          f"(B/A per round), {len(pairs)} pair(s) of workers taking turns")
    print(f"{'case':34s} {'A median ms':>12s} {'B median ms':>12s} {'B/A median':>11s} {'B/A IQR':>16s}"
          f"  B/A by pair")
    for name in cases:
        ta, tb, ratio = [], [], []
        by_pair = [[] for _ in pairs]
        for r in range(args.rounds):
            i = (r // 2) % len(pairs)
            a, b = pairs[i]
            order = (a, b) if r % 2 == 0 else (b, a)
            got = {}
            for w in order:
                got[w is a] = ask(w, name)
                time.sleep(0.03)
            ta.append(got[True])
            tb.append(got[False])
            ratio.append(got[False] / got[True])
            by_pair[i].append(ratio[-1])
        ta.sort(), tb.sort(), ratio.sort()
        n = len(ratio)
        pair_medians = " ".join(f"{sorted(x)[len(x) // 2]:.3f}" for x in by_pair if x)
        print(f"{name:34s} {1e3 * ta[n // 2]:12.2f} {1e3 * tb[n // 2]:12.2f} {ratio[n // 2]:11.3f} "
              f"{ratio[n // 4]:7.3f}-{ratio[3 * n // 4]:.3f}  {pair_medians}")
    for pair in pairs:
        for w in pair:
            w.stdin.close()
            w.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
