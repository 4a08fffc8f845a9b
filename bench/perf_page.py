"""The performance page, from one run on one machine:

    python bench/perf_page.py                 # writes docs/performance.md, its figure,
                                              # bench/results/perf-<cpu>-<date>.json and
                                              # the README's headline table
    python bench/perf_page.py --quick --out /tmp/page.md --no-readme   # small shapes, seconds

Every case times fastattn and every peer installed (PyTorch's scaled_dot_product_attention,
ONNX Runtime's Attention operator, OpenVINO's ScaledDotProductAttention, jax.nn's
dot_product_attention under jit; in the decode rows llama.cpp's flash attention from the
ggml-python package, on the same cache type) interleaved in rounds, 30 ms of idle before each call so
that no library's spinning worker threads share the cores with the next call.  A ratio is
the median over the rounds of (the peer's time / fastattn's time in the same round): above
1, fastattn is faster.  Each figure is also quoted against the machine's own limit measured
in the same process: GFLOP/s against the FMA peak (fastattn.bench.fma_peak: independent FMA
chains of the kernel fastattn runs), the bfloat16 rows against the peak of the bfloat16
product instruction fastattn uses (bench.bf16_peak), decoding's GB/s of cache read against
the read bandwidth over an array as large as the cache (bench.read_bandwidth: the
extension's vector loads on the same threads).  fastattn's
output is checked against the float64 oracle on sampled rows of every case, and each
peer's output against fastattn's: a case whose check fails stops the run (exit code 1).
"""
import argparse
import contextlib
import datetime
import io
import json
import os
import pathlib
import platform
import re
import statistics
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAUSE_S = 0.03
PEERS = ("PyTorch", "ONNX Runtime", "OpenVINO", "JAX")
LLAMA = "llama.cpp"  # ggml's flash_attn_ext on the same cache type: the decode rows only
# its error against fastattn's float32 output on each cache type: it rounds q to the
# cache's type for the products (float16, bfloat16, or q8_0 for int8) and sums the values
# of a 16-bit cache in float16 (3.2e-2 at Lk 32768 with float16, Emerald Rapids): a check
# that it computes the same attention, not of its accuracy
GGML_TOL = {"float32": 1e-4, "float16": 8e-2, "bfloat16": 8e-2, "int8": 1.5e-1, "int4": 6e-1}
README_START, README_END = "<!-- performance:start -->", "<!-- performance:end -->"

# (label, B, Hq, Hkv, L, D, causal); the FLOP count is 4*B*Hq*Lq*Lk*D, halved for causal
PREFILL = [("B1 H8 L1024 D64", 1, 8, 8, 1024, 64, False),
           ("B1 H8 L4096 D64 causal", 1, 8, 8, 4096, 64, True),
           ("B1 H8 L2048 D128", 1, 8, 8, 2048, 128, False),
           ("B1 H32 Hkv8 L2048 D128 causal", 1, 32, 8, 2048, 128, True)]
SHORT = [("B32 H8 L64 D64", 32, 8, 8, 64, 64, False),
         ("B16 H16 L128 D64 causal", 16, 16, 16, 128, 64, True)]
# (label, B, Hq, Hkv, Lk, D): one query against a cache of 256 MiB in float32
DECODE = [("B1 H32 Lk8192 D128", 1, 32, 32, 8192, 128),
          ("B1 Hq32 Hkv8 Lk32768 D128", 1, 32, 8, 32768, 128)]
# fastattn.KVCache of each dtype; then today's path on caches the user holds: (B, H, T, D)
# float32 arrays, int8 QuantizedKV arrays, a paged pool
CACHES = ("float32", "float16", "bfloat16", "int8", "int4", "float32 arrays", "int8 arrays (QuantizedKV)",
          "paged float32, pages of 16")
BACKWARD = [("B1 H8 L1024 D64", 1, 8, 8, 1024, 64, False),
            ("B1 H8 L2048 D64 causal", 1, 8, 8, 2048, 64, True)]
BF16 = [("B1 H8 L2048 D128", 1, 8, 8, 2048, 128, False),
        ("B1 H8 L4096 D64 causal", 1, 8, 8, 4096, 64, True)]
QUICK = dict(PREFILL=[("B1 H2 L256 D64", 1, 2, 2, 256, 64, False),
                      ("B1 H4 Hkv2 L200 D64 causal", 1, 4, 2, 200, 64, True)],
             SHORT=[("B4 H2 L64 D64", 4, 2, 2, 64, 64, False)],
             DECODE=[("B1 Hq4 Hkv2 Lk1024 D64", 1, 4, 2, 1024, 64)],
             BACKWARD=[("B1 H2 L128 D64 causal", 1, 2, 2, 128, 64, True)],
             BF16=[("B1 H2 L256 D64 causal", 1, 2, 2, 256, 64, True)])


class CheckFailed(RuntimeError):
    pass


# ---------------------------------------------------------------- timing
def interleave(impls, rounds):
    """{name: [seconds per round]}: every callable once a round, the order rotated each
    round, PAUSE_S of idle before each call; two untimed warm-up calls each first."""
    for f in impls.values():
        f()
        f()
    names = list(impls)
    times = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            time.sleep(PAUSE_S)
            t0 = time.perf_counter()
            impls[n]()
            times[n].append(time.perf_counter() - t0)
    return times


def rounds_for(seconds, quick):
    if quick:
        return 3
    return 7 if seconds > 0.3 else 11 if seconds > 0.03 else 21


def ratio(times, peer, ours):
    return statistics.median(p / o for p, o in zip(times[peer], times[ours]))


def quartile_spread(xs):
    q1, _, q3 = statistics.quantiles(xs, n=4) if len(xs) >= 2 else (xs[0],) * 3
    return (q3 - q1) / statistics.median(xs)


# ---------------------------------------------------------------- the peers
def _np_bf16(x):
    import ml_dtypes
    return x.astype(ml_dtypes.bfloat16)


class Peers:
    """The installed peers; each make_* returns a callable of no arguments that runs one
    call and returns its output as a NumPy array in fastattn's (B, H, L, D) layout, or
    None where the peer is not installed or cannot run the case."""

    def __init__(self, threads):
        self.threads = threads
        self.versions = {}
        self.torch = self._try("torch")
        if self.torch is not None:
            self.torch.set_num_threads(threads)
        self.ort = self._try("onnxruntime")
        self.ov = self._try("openvino")
        self.jax = self._try("jax")
        self.ggml = self._try("ggml")  # ggml-python: llama.cpp's kernels, for the decode rows
        if self.ggml is not None:
            from importlib import metadata
            with contextlib.suppress(metadata.PackageNotFoundError):
                self.versions["ggml"] = metadata.version("ggml-python")
        if self.jax is not None:
            self.jax.config.update("jax_platforms", "cpu")
        sys.path.insert(0, str(ROOT / "bench"))
        import peers as _peers  # bench/peers.py: the ONNX Runtime, OpenVINO and ggml graphs
        self.graphs = _peers

    def _try(self, name):
        try:
            mod = __import__(name)
        except ImportError:
            return None
        self.versions[name] = str(getattr(mod, "__version__", "?")).split("-")[0]
        return mod

    def available(self):
        mods = (self.torch, self.ort, self.ov, self.jax, self.ggml)
        return [p for p, m in zip(PEERS + (LLAMA,), mods) if m is not None]

    def make(self, peer, q, k, v, causal, *, grad=False, bf16=False):
        if peer == LLAMA:
            return None  # run_decode builds it for each cache type
        fn = {"PyTorch": self._torch, "ONNX Runtime": self._ort, "OpenVINO": self._ov,
              "JAX": self._jax}[peer]
        if peer in ("ONNX Runtime", "OpenVINO") and (grad or bf16):
            return None  # inference runtimes, timed on the float32 forward only
        return fn(q, k, v, causal, grad, bf16)

    def _torch(self, q, k, v, causal, grad, bf16):
        torch = self.torch
        if torch is None:
            return None
        F = torch.nn.functional.scaled_dot_product_attention

        def conv(x):
            t = torch.from_numpy(np.ascontiguousarray(x))
            return t.to(torch.bfloat16) if bf16 else t
        tq, tk, tv = (conv(x) for x in (q, k, v))
        # PyTorch's is_causal is top-left; for Lq == Lk it is fastattn's bottom-right
        causal = bool(causal) and q.shape[2] > 1
        gqa = q.shape[1] != k.shape[1]
        if not grad:
            def call():
                with torch.no_grad():
                    o = F(tq, tk, tv, is_causal=causal, enable_gqa=gqa)
                return (o.float() if bf16 else o).numpy()
            return call
        leaves = [x.clone().requires_grad_() for x in (tq, tk, tv)]
        dout = torch.ones_like(tq)

        def call():
            for x in leaves:
                x.grad = None
            F(*leaves, is_causal=causal, enable_gqa=gqa).backward(dout)
            return leaves[0].grad.float().numpy()
        return call

    def _graph(self, runtime, make, q, k, v, causal):
        """A one-node graph of an inference runtime for this shape (bench/peers.py)."""
        if runtime is None:
            return None
        B, Hq, Lq, D = q.shape
        run = make(B, Hq, k.shape[1], Lq, k.shape[2], D, self.threads, causal=causal)
        return lambda: np.asarray(run(q, k, v))

    def _ort(self, q, k, v, causal, grad, bf16):
        return self._graph(self.ort, self.graphs.make_onnxruntime, q, k, v, causal)

    def _ov(self, q, k, v, causal, grad, bf16):
        return self._graph(self.ov, self.graphs.make_openvino, q, k, v, causal)

    def _jax(self, q, k, v, causal, grad, bf16):
        jax = self.jax
        if jax is None:
            return None
        import jax.numpy as jnp
        dt = jnp.bfloat16 if bf16 else jnp.float32
        # jax's layout is (B, L, H, D)
        jq, jk, jv = (jax.device_put(jnp.asarray(np.ascontiguousarray(x.transpose(0, 2, 1, 3)), dtype=dt))
                      for x in (q, k, v))
        causal = bool(causal) and q.shape[2] > 1

        def f(a, b, c):
            return jax.nn.dot_product_attention(a, b, c, is_causal=causal, implementation="xla")
        if not grad:
            g = jax.jit(f)

            def call():
                return np.asarray(g(jq, jk, jv).block_until_ready().astype(jnp.float32)).transpose(0, 2, 1, 3)
            return call
        dout = jnp.ones_like(jq)
        g = jax.jit(lambda a, b, c: jax.vjp(f, a, b, c)[1](dout))

        def call():
            dq = g(jq, jk, jv)[0].block_until_ready()
            return np.asarray(dq.astype(jnp.float32)).transpose(0, 2, 1, 3)
        return call


# ---------------------------------------------------------------- the machine
def machine(threads):
    import fastattn
    from fastattn import bench
    model, _ = bench.cpu_info()
    flags = set()
    fam = mod = None
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            key, _, val = line.partition(":")
            key = key.strip()
            if key == "flags" and not flags:
                flags = set(val.split())
            elif key == "cpu family" and fam is None:
                fam = val.strip()
            elif key == "model" and mod is None:
                mod = val.strip()
    wanted = ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16",
              "amx_tile", "amx_bf16"]
    cfg = io.StringIO()
    fastattn.show_config(file=cfg)
    return dict(cpu=model, family=fam, model=mod, flags=[f for f in wanted if f in flags],
                cores=len(os.sched_getaffinity(0)), threads=threads, bind=os.environ.get("OMP_PROC_BIND"),
                os=platform.platform(),
                python=platform.python_version(), numpy=np.__version__, fastattn=fastattn.__version__,
                config=cfg.getvalue())


def ceilings(threads, read_bytes):
    from fastattn import bench
    c = dict(fma_peak_gflops=max(bench.fma_peak("float32", threads) for _ in range(3)))
    try:
        c["bf16_peak_gflops"] = max(bench.bf16_peak(threads) for _ in range(3))
        from fastattn import _kernels
        c["bf16_path"] = _kernels.bf16_path()
    except ValueError:  # no bfloat16 product instruction here: bfloat16 runs on the float32 path
        c["bf16_peak_gflops"], c["bf16_path"] = c["fma_peak_gflops"], "float32"
    c["read_mib"] = min(2048, max(64, read_bytes // 2**20))
    c["read_gbps"] = max(bench.read_bandwidth(threads, mib=c["read_mib"]) for _ in range(3))
    return c


# ---------------------------------------------------------------- the cases
def _qkv(B, Hq, Hkv, Lq, Lk, D, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, Hq, Lq, D), dtype=np.float32),
            rng.standard_normal((B, Hkv, Lk, D), dtype=np.float32),
            rng.standard_normal((B, Hkv, Lk, D), dtype=np.float32))


def _flops(B, Hq, Lq, Lk, D, causal):
    return 4.0 * B * Hq * Lq * Lk * D / (2 if causal else 1)


def _check_peers(label, outs, ref, tol):
    """Each peer's output against fastattn's (its output in float32, `ref`)."""
    from fastattn.bench import rel_err
    for name, o in outs.items():
        err = rel_err(o, ref)
        if not err <= tol:
            raise CheckFailed(f"{label}: {name}'s output differs from fastattn's by {err:.2e} (> {tol:g})")


def _row(label, times, peers, **extra):
    ours = statistics.median(times["fastattn"])
    row = dict(case=label, ms=ours * 1e3, spread=quartile_spread(times["fastattn"]),
               ratios={p: ratio(times, p, "fastattn") for p in peers if p in times}, **extra)
    return row


def run_forward(section, cases, peers, threads, limit, quick, *, bf16=False):
    import fastattn
    from fastattn.bench import check_rows
    rows = []
    for label, B, Hq, Hkv, L, D, causal in cases:
        q, k, v = _qkv(B, Hq, Hkv, L, L, D)
        if bf16:  # the problem is the bfloat16 one: the oracle and the peers see its values
            q, k, v = (_np_bf16(x) for x in (q, k, v))
        f32 = tuple(x.astype(np.float32) for x in (q, k, v))
        impls = {"fastattn": lambda: fastattn.attention(q, k, v, causal=causal, num_threads=threads)}
        out = impls["fastattn"]()
        err = check_rows(out, *f32, causal=causal)
        tol = 1e-2 if bf16 else 3e-5
        if not err <= tol:
            raise CheckFailed(f"{section} {label}: fastattn's error {err:.2e} > {tol:g}")
        ref = out.astype(np.float32)
        outs = {}
        for p in peers:
            call = peers_obj.make(p, *f32, causal, bf16=bf16)
            if call is not None:
                impls[p] = call
                outs[p] = call()
        _check_peers(f"{section} {label}", outs, ref, 2e-2 if bf16 else 1e-3)
        times = interleave(impls, rounds_for(_timed_once(impls["fastattn"]), quick))
        gflops = _flops(B, Hq, L, L, D, causal) / statistics.median(times["fastattn"]) / 1e9
        rows.append(_row(label, times, peers, rate=gflops, unit="GFLOP/s", pct=gflops / limit,
                         err=err))
        progress(section, label)
    return rows


def run_backward(cases, peers, threads, limit, quick):
    import fastattn
    from fastattn import reference
    from fastattn.bench import rel_err
    rows = []
    for label, B, Hq, Hkv, L, D, causal in cases:
        q, k, v = _qkv(B, Hq, Hkv, L, L, D)
        dout = np.ones_like(q)

        def ours():
            out, lse = fastattn.attention(q, k, v, causal=causal, return_lse=True, num_threads=threads)
            return fastattn.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                               num_threads=threads)[0]
        dq = ours()
        # the oracle's gradient on the first batch and head (the whole problem in float64
        # is small at these shapes)
        rq, rk, rv, rdo = (x[:1, :1].astype(np.float64) for x in (q, k, v, dout))
        rout, rlse = reference.attention(rq, rk, rv, causal=causal, return_lse=True)
        rdq = reference.attention_backward(rdo, rq, rk, rv, rout, rlse, causal=causal)[0]
        err = rel_err(dq[:1, :1], rdq)
        if not err <= 1e-4:
            raise CheckFailed(f"backward {label}: fastattn's dq error {err:.2e} > 1e-4")
        impls, outs = {"fastattn": ours}, {}
        for p in peers:
            call = peers_obj.make(p, q, k, v, causal, grad=True)
            if call is not None:
                impls[p] = call
                outs[p] = call()
        _check_peers(f"backward {label}", outs, dq, 1e-3)
        times = interleave(impls, rounds_for(_timed_once(ours), quick))
        # forward (4 B H L L D) + backward (10 B H L L D: five products), halved for causal
        flops = _flops(B, Hq, L, L, D, causal) * 14 / 4
        gflops = flops / statistics.median(times["fastattn"]) / 1e9
        rows.append(_row(label, times, peers, rate=gflops, unit="GFLOP/s", pct=gflops / limit, err=err))
        progress("backward", label)
    return rows


def _pool(x, block):
    """x (B, H, L, D) as a paged pool (pages, block_table), the pages shuffled"""
    B, H, L, D = x.shape
    n = B * (L // block)
    pages = x.reshape(B, H, L // block, block, D).transpose(0, 2, 3, 1, 4).reshape(n, block, H, D)
    order = np.random.default_rng(0).permutation(n)
    pool = np.empty_like(pages)
    pool[order] = pages
    return pool, order.reshape(B, L // block).astype(np.int32)


def run_decode(cases, peers, threads, bandwidth, quick):
    import fastattn
    from fastattn.bench import check_rows
    rows = []
    for label, B, Hq, Hkv, Lk, D in cases:
        q, k, v = _qkv(B, Hq, Hkv, 1, Lk, D)
        impls, nbytes, kv_of = {}, {}, {}
        for cache in CACHES:
            if cache in ("float32", "float16", "bfloat16", "int8", "int4"):  # fastattn.KVCache
                kvc = fastattn.KVCache(B, Hkv, D, Lk, dtype=cache)
                kvc.append(k, v)
                kv_of[cache] = (np.stack([kvc.keys(b) for b in range(B)]),
                                np.stack([kvc.values(b) for b in range(B)]))
                # the bytes a call reads: all but the partial block's float32 copies
                nbytes[cache] = kvc.nbytes - (kvc._kf.nbytes if kvc._kf is not None else 0)
                impls[cache] = (lambda kvc=kvc: fastattn.attention(q, kvc, num_threads=threads))
                err = check_rows(impls[cache](), q, *kv_of[cache])
                if not err <= 3e-5:
                    raise CheckFailed(f"decode {label} {cache}: fastattn's error {err:.2e} > 3e-5")
                continue
            if cache == "int8 arrays (QuantizedKV)":
                kc, vc = fastattn.quantize_kv(k), fastattn.quantize_kv(v)
                kw = {}
                kv_of[cache] = (fastattn.dequantize_kv(kc), fastattn.dequantize_kv(vc))
                nbytes[cache] = sum(a.nbytes for a in (*kc, *vc))
            elif cache.startswith("paged"):
                (kc, table), (vc, _) = _pool(k, 16), _pool(v, 16)
                kw = dict(block_table=table, seqlens_k=np.full(B, Lk))
                kv_of[cache] = (k, v)
                nbytes[cache] = kc.nbytes + vc.nbytes
            else:
                kc, vc, kw = k, v, {}
                kv_of[cache] = (k, v)
                nbytes[cache] = k.nbytes + v.nbytes
            impls[cache] = (lambda kc=kc, vc=vc, kw=kw:
                            fastattn.attention(q, kc, vc, num_threads=threads, **kw))
            err = check_rows(impls[cache](), q, *kv_of[cache])
            if not err <= 3e-5:
                raise CheckFailed(f"decode {label} {cache}: fastattn's error {err:.2e} > 3e-5")
        ref = impls["float32"]()
        outs = {}
        for p in peers:  # the peers read the float32 cache: none of them reads int8 or pages
            call = peers_obj.make(p, q, k, v, False)
            if call is not None:
                impls[p] = call
                outs[p] = call()
        _check_peers(f"decode {label}", outs, ref, 1e-3)
        same = {}  # llama.cpp on the same cache type: its own quantization of the same values
        if LLAMA in peers:
            for cache, tol in GGML_TOL.items():
                impls[f"{LLAMA} {cache}"] = peers_obj.graphs.make_ggml(q, k, v, threads, cache)
                _check_peers(f"decode {label} {cache}", {LLAMA: impls[f"{LLAMA} {cache}"]()}, ref, tol)
                same[cache] = f"{LLAMA} {cache}"
        times = interleave(impls, rounds_for(_timed_once(impls["float32"]), quick))
        for cache in CACHES:
            t = statistics.median(times[cache])
            gbps = nbytes[cache] / t / 1e9
            ratios = {p: ratio(times, p, cache) for p in peers if p in times}
            if cache in same:
                ratios[LLAMA] = ratio(times, same[cache], cache)
            rows.append(dict(case=label, cache=cache, ms=t * 1e3, spread=quartile_spread(times[cache]),
                             rate=gbps, unit="GB/s", pct=gbps / bandwidth, mib=nbytes[cache] / 2**20,
                             ratios=ratios))
        progress("decode", label)
    return rows


def _timed_once(f):
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def progress(section, label):
    print(f"  {section}: {label}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the page
def _x(r):
    return f"{r:.2f}x"


def _cell(row, peer):
    return _x(row["ratios"][peer]) if peer in row["ratios"] else "-"


def _table(rows, peers, first_cols, limit_name):
    head = first_cols + ["time", "rate", f"% of {limit_name}"] + [f"vs {p}" for p in peers]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ms = f"{r['ms']:.3g} ms" + (" ~" if r["spread"] > 0.10 else "")
        cells = [r["case"]] + ([r["cache"]] if "cache" in r else [])
        cells += [ms, f"{r['rate']:.1f} {r['unit']}", f"{100 * r['pct']:.0f}%"]
        cells += [_cell(r, p) for p in peers]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def page(result, figure_rel):
    m, c, peers = result["machine"], result["ceilings"], result["peers"]
    fwd = [p for p in peers if p != LLAMA]
    vers = ", ".join(f"{k} {v}" for k, v in
                     [("fastattn", m["fastattn"]), ("Python", m["python"]), ("NumPy", m["numpy"])]
                     + sorted(result["peer_versions"].items()))
    fam = f" (family {m['family']}, model {m['model']})" if m["family"] else ""
    missing = [p for p in PEERS + (LLAMA,) if p not in peers]
    out = [
        "# Performance",
        "",
        "Generated by `python bench/perf_page.py` from one run on one machine; do not edit by hand.",
        "Tables from other machines and dates are kept apart in `bench/results/`.",
        "",
        f"- **Machine:** {m['cpu']}{fam}, {m['cores']} cores available, {m['threads']} threads used "
        f"({'OMP_PROC_BIND=' + m['bind'] if m.get('bind') else 'not bound to cores: no OMP_PROC_BIND'}); "
        f"instruction sets: {', '.join(m['flags'])}; {m['os']}",
        f"- **Date:** {result['date']}",
        f"- **Versions:** {vers}",
        f"- **Limits measured in the same process** (the best of three passes): FMA peak "
        f"{c['fma_peak_gflops']:.0f} GFLOP/s (float32, {m['threads']} threads); bfloat16 product peak "
        f"{c['bf16_peak_gflops']:.0f} GFLOP/s ({c['bf16_path']} path); read bandwidth "
        f"{c['read_gbps']:.1f} GB/s (over {c['read_mib']} MiB).",
        "",
        "How to read the tables: *time* is fastattn's median over the interleaved rounds (~ marks an",
        "interquartile range over 10% of it: a noisy figure); *rate* is GFLOP/s (4·B·H·Lq·Lk·D for",
        "the forward, 14·B·H·Lq·Lk·D for forward and backward, halved for causal) or, for decoding,",
        "GB/s of cache read; *% of* quotes the rate against the machine's limit above; *vs X* is the",
        "median of X's time / fastattn's time in the same round (above 1: fastattn is faster).",
        "fastattn's output is checked against the float64 oracle, and every peer's against",
        "fastattn's, in each case." + (f" Not installed here: {', '.join(missing)}." if missing else ""),
        "",
        f"![fastattn against its peers]({figure_rel})",
        "",
        "## Prefill, float32",
        "",
        _table(result["prefill"], fwd, ["case"], "FMA peak"),
        "",
        "## Short sequences, many heads (float32)",
        "",
        _table(result["short"], fwd, ["case"], "FMA peak"),
        "",
        "## Decoding: one query against a cache",
        "",
        "The rows named by a dtype are `fastattn.KVCache` of that dtype (keys on the SIMD lanes;",
        "int8 and int4 keys per channel within a block of 64, values per token in groups of 32);",
        "then today's path on caches the user holds: float32 (B, H, T, D) arrays, int8",
        "`QuantizedKV` arrays, a paged pool. PyTorch, ONNX Runtime, OpenVINO and JAX read the",
        "float32 cache (none of them reads a quantized or a paged cache), so their column",
        "compares their float32 call with fastattn's call on that cache. llama.cpp (ggml's",
        "`flash_attn_ext`, built from source by the `ggml-python` package) reads the same cache",
        "type, quantized by ggml itself from the same values (int8: its q8_0, blocks of 32 with",
        "a float16 scale; int4: q4_0); it has no row for the arrays or the pool. GB/s counts",
        "the bytes the call reads (codes, scales and zero points). The whole of issue 59's",
        "table (more shapes, back-to-back against the read bandwidth of as many bytes, bound",
        "and unbound threads) is `bench/kvcache_table.py`; `generate()` at 8k context is",
        "`bench/kvcache_generate.py` (results in `bench/results/`).",
        "",
        _table(result["decode"], peers, ["case", "cache"], "read bandwidth"),
        "",
        "## Forward and backward, float32",
        "",
        "fastattn: `attention(..., return_lse=True)` then `attention_backward`; PyTorch: the",
        "forward and `.backward()`; JAX: `jax.vjp` under jit. The inference runtimes have no",
        "backward.",
        "",
        _table(result["backward"], [p for p in peers if p in ("PyTorch", "JAX")], ["case"], "FMA peak"),
        "",
        "## bfloat16 forward",
        "",
        f"bfloat16 q, k, v and output; fastattn takes the {c['bf16_path']} path, quoted against that",
        "path's product peak. The peers compute on the same bfloat16 values.",
        "",
        _table(result["bf16"], [p for p in peers if p in ("PyTorch", "JAX")], ["case"], "bf16 peak"),
        "",
        "## The configuration",
        "",
        "```text",
        m["config"].rstrip(),
        "```",
        "",
    ]
    return "\n".join(out)


def headline(result, page_rel, figure_rel):
    """The README's table and the page's figure: rows of each section, from the same run."""
    m = result["machine"]
    peers = [p for p in result["peers"] if p in ("PyTorch", "ONNX Runtime", "OpenVINO", LLAMA)]
    picks = [("prefill", result["prefill"], lambda r: "causal" in r["case"]),
             ("short", result["short"], lambda r: True),
             ("decode", result["decode"], lambda r: r["cache"] in ("float32", "int8")),
             ("fwd+bwd", result["backward"], lambda r: "causal" in r["case"]),
             ("bf16", result["bf16"], lambda r: "causal" in r["case"])]
    head = ["case", "time", "% of the machine's limit"] + [f"vs {p}" for p in peers]
    lines = [f"{m['cpu']}, {m['threads']} threads, {result['date']} "
             f"([the whole page]({page_rel})):", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for section, rows, keep in picks:
        for r in rows:
            if not keep(r):
                continue
            name = f"{section} {r['case']}" + (f", {r['cache']} cache" if "cache" in r else "")
            limit = "read bandwidth" if r["unit"] == "GB/s" else \
                "bf16 peak" if section == "bf16" else "FMA peak"
            lines.append("| " + " | ".join([name, f"{r['ms']:.3g} ms", f"{100 * r['pct']:.0f}% of {limit}"]
                                           + [_cell(r, p) for p in peers]) + " |")
    lines += ["", "*vs X*: X's time / fastattn's time, the median over interleaved rounds (above 1: "
              "fastattn is faster).", "", f"![fastattn against its peers]({figure_rel})"]
    return "\n".join(lines)


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = ([("prefill " + r["case"], r) for r in result["prefill"]]
            + [("short " + r["case"], r) for r in result["short"]]
            + [(f"decode {r['case']} {r['cache'].split(',')[0]}", r) for r in result["decode"]]
            + [("fwd+bwd " + r["case"], r) for r in result["backward"]]
            + [("bf16 " + r["case"], r) for r in result["bf16"]])
    peers = result["peers"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 0.32 * len(rows) + 1.6), sharey=True)
    y = np.arange(len(rows))
    a.barh(y, [100 * r["pct"] for _, r in rows], color="tab:orange")
    a.set_yticks(y, [n for n, _ in rows], fontsize=8)
    a.invert_yaxis()
    a.set_xlabel("fastattn, % of the machine's limit\n(FMA peak; read bandwidth for decode; bf16 product peak for bf16)")
    w = 0.8 / max(1, len(peers))
    for i, p in enumerate(peers):
        b.barh(y - 0.4 + w * (i + 0.5), [r["ratios"].get(p, np.nan) for _, r in rows], height=w, label=p)
    b.axvline(1, color="k", lw=0.8)
    b.set_xscale("log")
    b.set_xlabel("peer's time / fastattn's time (above 1: fastattn faster)")
    b.legend(fontsize=8, loc="lower right")
    m = result["machine"]
    fig.suptitle(f"{m['cpu']}, {m['threads']} threads, {result['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replace_headline(readme, text):
    s = readme.read_text()
    i, j = s.find(README_START), s.find(README_END)
    if i < 0 or j < i:
        return False
    readme.write_text(s[:i + len(README_START)] + "\n" + text + "\n" + s[j:])
    return True


def _slug(s):
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-")[:40]


peers_obj = None


def main(argv=None):
    global peers_obj
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None,
                    help="threads for every library (default: the cores this process may use)")
    ap.add_argument("--quick", action="store_true", help="small shapes and 3 rounds: a check, not figures")
    ap.add_argument("--out", default=str(ROOT / "docs" / "performance.md"), help="the page to write")
    ap.add_argument("--json", default=None,
                    help="the raw results (default bench/results/perf-<cpu>-<date>.json; none with --quick)")
    ap.add_argument("--no-readme", action="store_true", help="leave README.md's headline table alone")
    ap.add_argument("--peers", default=",".join(PEERS + (LLAMA,)),
                    help=f"comma-separated subset of {', '.join(PEERS + (LLAMA,))} (default: every one "
                         "installed)")
    args = ap.parse_args(argv)
    threads = args.threads or len(os.sched_getaffinity(0))
    # every library sees the same cores: JAX's and OpenVINO's pools size themselves from them
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:threads])
    cases = dict(PREFILL=PREFILL, SHORT=SHORT, DECODE=DECODE, BACKWARD=BACKWARD, BF16=BF16)
    if args.quick:
        cases.update(QUICK)
    peers_obj = Peers(threads)
    wanted = [p.strip() for p in args.peers.split(",") if p.strip()]
    peers = [p for p in peers_obj.available() if p in wanted]
    big = max(B * Hkv * Lk * D * 4 * 2 for _, B, Hq, Hkv, Lk, D in cases["DECODE"])
    print(f"measuring the limits ({threads} threads) ...", file=sys.stderr)
    ceil = ceilings(threads, big)
    t0 = time.time()
    result = dict(date=datetime.date.today().isoformat(), machine=machine(threads), ceilings=ceil,
                  peers=peers, peer_versions={k: v for k, v in peers_obj.versions.items()},
                  quick=args.quick)
    try:
        result["prefill"] = run_forward("prefill", cases["PREFILL"], peers, threads,
                                        ceil["fma_peak_gflops"], args.quick)
        result["short"] = run_forward("short", cases["SHORT"], peers, threads,
                                      ceil["fma_peak_gflops"], args.quick)
        result["decode"] = run_decode(cases["DECODE"], peers, threads, ceil["read_gbps"], args.quick)
        result["backward"] = run_backward(cases["BACKWARD"], peers, threads, ceil["fma_peak_gflops"],
                                          args.quick)
        result["bf16"] = run_forward("bf16", cases["BF16"], peers, threads, ceil["bf16_peak_gflops"],
                                     args.quick, bf16=True)
    except CheckFailed as e:
        print(f"check failed: {e}", file=sys.stderr)
        return 1
    result["seconds"] = time.time() - t0
    out = pathlib.Path(args.out)
    fig = out.parent / "figures" / (out.stem + ".png")
    fig.parent.mkdir(parents=True, exist_ok=True)
    plot(result, fig)
    out.write_text(page(result, os.path.relpath(fig, out.parent)))
    js = args.json or (None if args.quick else
                       str(ROOT / "bench" / "results" / f"perf-{_slug(result['machine']['cpu'])}-{result['date']}.json"))
    if js:
        pathlib.Path(js).write_text(json.dumps(result, indent=1, default=float))
    if not args.no_readme:
        readme = ROOT / "README.md"
        ok = replace_headline(readme, headline(result, os.path.relpath(out, ROOT), os.path.relpath(fig, ROOT)))
        print("README.md's headline table " + ("rewritten" if ok else
              f"not written: README.md has no {README_START} ... {README_END} block"), file=sys.stderr)
    print(f"wrote {out} and {fig}" + (f" and {js}" if js else "") + f" ({result['seconds']:.0f} s)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
