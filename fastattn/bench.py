"""``python -m fastattn.bench``: fastattn vs PyTorch SDPA vs naive NumPy, with measured ceilings.

    python -m fastattn.bench                      # full grid (about a minute on 2 cores)
    python -m fastattn.bench --quick              # a subset (seconds)
    python -m fastattn.bench --threads 2 --json out.json --plot out.png --no-torch

Prefill rows report GFLOP/s (4*B*H*Lq*Lk*D, halved for causal) against a NumPy sgemm
ceiling; decode rows report GB/s of K/V read (k.nbytes + v.nbytes) against a measured
read bandwidth. Every implementation runs interleaved (A, B, C, A, B, C, ...), each call
after a short idle so no library's spinning worker threads share the cores with the next
one; the best round is reported. fastattn's output is checked once per shape against the float64 oracle
on one head; the exit code is 1 if a check fails.
"""
import argparse
import contextlib
import datetime
import json
import platform
import statistics
import sys
import threading
import time

import numpy as np

import fastattn
from fastattn import _kernels, reference

TOL = {"float32": 3e-5, "float64": 1e-11, "float16": 1e-4}  # by K/V dtype
SCORE_LIMIT = 2**30  # skip naive NumPy beyond a 1 GiB score matrix
IMPLS = ("fastattn", "torch", "numpy")


def _shape(kind, L, D=None, H=None, dtype="float32", kv="float32", causal=False, series=True):
    """One benchmark shape; `series` marks the rows of the plotted sweeps."""
    d0, H, lq = (64, H or 8, L) if kind == "prefill" else (128, H or 32, 1)
    D = D or d0
    name = "".join([f"{kind} {'L' if kind == 'prefill' else 'Lk'}={L}", f" D={D}" * (D != d0),
                    " causal" * causal, " f64" * (dtype == "float64"), " f16 K/V" * (kv == "float16")])
    return dict(name=name, kind=kind, B=1, H=H, Lq=lq, Lk=L, D=D, dtype=dtype, kv_dtype=kv,
                causal=causal, series=series)


def grid(which):
    if which == "tiny":
        return [_shape("prefill", 64), _shape("decode", 128)]
    if which == "quick":
        return ([_shape("prefill", L) for L in (512, 2048)]
                + [_shape("prefill", 2048, causal=True, series=False)]
                + [_shape("decode", L) for L in (2048, 8192)])
    return ([_shape("prefill", L) for L in (256, 512, 1024, 2048, 4096)]
            + [_shape("prefill", 4096, causal=True, series=False),
               _shape("prefill", 2048, D=128, series=False),
               _shape("prefill", 2048, dtype="float64", kv="float64", series=False)]
            + [_shape("decode", L) for L in (1024, 2048, 4096, 8192)]
            + [_shape("decode", 8192, kv="float16", series=False)])


# ---------------------------------------------------------------- machine and ceilings
def cpu_info():
    model, flags = None, set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key.strip() == "model name" and model is None:
                    model = val.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(val.split())
    except OSError:
        pass
    return (model or platform.processor() or platform.machine(),
            {f: f in flags for f in ("avx2", "avx512f", "fma", "f16c")})


def blas_limit(threads):
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(limits=threads, user_api="blas")


def gemm_gflops(dtype, n=2048, repeats=3):
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n)).astype(dtype) for _ in range(2))
    c = np.matmul(a, b)
    _warm_up(lambda: np.matmul(a, b, out=c), min_s=0.3)  # idle cores take a while to ramp up
    best = min(_timed(lambda: np.matmul(a, b, out=c)) for _ in range(repeats))
    return 2.0 * n**3 / best / 1e9


def read_gbps(threads, mib=256, repeats=5):
    """Read bandwidth: `threads` Python threads each take np.max of a slice (GIL released)."""
    a = np.ones(mib * 2**20 // 4, dtype=np.float32)
    parts = np.array_split(a, threads)

    def once():
        go = threading.Barrier(len(parts) + 1)
        workers = [threading.Thread(target=lambda p=p: (go.wait(), np.max(p))) for p in parts]
        for w in workers:
            w.start()
        go.wait()
        t0 = time.perf_counter()
        for w in workers:
            w.join()
        return time.perf_counter() - t0

    once()  # warm-up
    return a.nbytes / min(once() for _ in range(repeats)) / 1e9


# ---------------------------------------------------------------- implementations
def naive(q, k, v, scale, causal):
    """softmax(q k^T * scale) v in plain NumPy, max-subtracted, in q's dtype."""
    s = q @ k.swapaxes(-1, -2)
    s *= s.dtype.type(scale)
    if causal:  # bottom-right, as fastattn's causal=True (same as top-left when Lq == Lk)
        lq, lk = s.shape[-2:]
        s[..., np.triu(np.ones((lq, lk), dtype=bool), k=1 + lk - lq)] = -np.inf
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s @ v


SETTLE_S = 0.1  # idle time before each timed call (see _timed)
# ... and after NumPy's call: OpenBLAS's worker threads spin for about 0.13 s after a
# matmul here (their CPU time, read from /proc), so a call started 0.1 s after the
# naive formula shared a core with them (measured: fastattn 42 ms after it against
# 35-37 ms otherwise, B=1 H=8 L=2048 D=64).
SETTLE_AFTER_NUMPY_S = 0.3


def _timed(f, settle=0.0):
    """Seconds one call of f takes.  `settle` idles first: after a call, OpenBLAS's and
    each OpenMP runtime's worker threads keep spinning for a while, and a call of
    another library that starts meanwhile shares the cores with them (measured here:
    +20-30% for fastattn and PyTorch right after a NumPy matmul)."""
    if settle:
        time.sleep(settle)
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def _warm_up(f, min_s=0.05, max_calls=50):
    """Call f for about min_s seconds, at least once (idle vCPUs and thread pools wake up
    slowly on a shared VM); returns the last call's time."""
    t_end, calls = time.perf_counter() + min_s, 0
    while calls < 1 or (time.perf_counter() < t_end and calls < max_calls):
        t, calls = _timed(f), calls + 1
    return t


def run_shape(sh, threads, torch=None, use_numpy=True, seed=0):
    """Time every implementation on one shape; returns the row dict."""
    rng = np.random.default_rng(seed)
    qs, ks = (sh["B"], sh["H"], sh["Lq"], sh["D"]), (sh["B"], sh["H"], sh["Lk"], sh["D"])
    q = rng.standard_normal(qs).astype(sh["dtype"])
    k, v = (rng.standard_normal(ks).astype(sh["kv_dtype"]) for _ in range(2))
    scale, causal = 1.0 / np.sqrt(sh["D"]), sh["causal"]
    fns = {"fastattn": lambda: fastattn.attention(q, k, v, causal=causal, num_threads=threads)}
    if torch is not None:
        tdt = torch.float16 if sh["kv_dtype"] == "float16" else None  # SDPA needs one dtype
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        tq = tq.to(tdt) if tdt else tq
        sdpa = torch.nn.functional.scaled_dot_product_attention
        fns["torch"] = lambda: sdpa(tq, tk, tv, is_causal=causal)
    score_bytes = sh["B"] * sh["H"] * sh["Lq"] * sh["Lk"] * q.itemsize
    if use_numpy and score_bytes <= SCORE_LIMIT:
        fns["numpy"] = lambda: naive(q, k, v, scale, causal)
    ctx = torch.inference_mode() if torch is not None else contextlib.nullcontext()
    with ctx:
        out = fns["fastattn"]()  # the result checked below
        warm = max(_warm_up(f) for f in fns.values())
        rounds = 5 if warm > 0.2 else 9 if warm > 0.02 else 15  # a noisy shared machine
        times = {name: [] for name in fns}
        prev = list(fns)[-1]  # the warm-up's last call
        for _ in range(rounds):
            for name, f in fns.items():
                times[name].append(_timed(f, SETTLE_AFTER_NUMPY_S if prev == "numpy" else SETTLE_S))
                prev = name
    ref = reference.attention(q[:, :1], k[:, :1], v[:, :1], causal=causal)
    err = float(np.max(np.abs(out[:, :1] - ref)) / max(np.max(np.abs(ref)), 1e-300))
    tol = TOL[sh["kv_dtype"]]
    flops = 4.0 * sh["B"] * sh["H"] * sh["Lq"] * sh["Lk"] * sh["D"] * (0.5 if causal else 1.0)
    row = dict(sh, flops=flops, bytes=k.nbytes + v.nbytes, rounds=rounds, rel_err=err, tol=tol,
               check_ok=bool(err <= tol), score_bytes=score_bytes)
    for name in IMPLS:
        t = times.get(name)
        row[name] = dict(best_ms=min(t) * 1e3, median_ms=statistics.median(t) * 1e3) if t else None
    return row


def derive(row, ceil):
    """Throughput, fraction of the ceiling and speed-ups for one row (None where missing)."""
    fa = row["fastattn"]["best_ms"] / 1e3
    if row["kind"] == "prefill":
        rate, unit = row["flops"] / fa / 1e9, "GFLOP/s"
        c, cname = (ceil.get("dgemm_gflops"), "dgemm") if row["dtype"] == "float64" \
            else (ceil.get("sgemm_gflops"), "sgemm")
    else:
        rate, unit = row["bytes"] / fa / 1e9, "GB/s"
        c, cname = ceil.get("read_gbps"), "read bw"
    rates = {n: (row["flops"] if unit == "GFLOP/s" else row["bytes"]) / (row[n]["best_ms"] / 1e3) / 1e9
             for n in IMPLS if row.get(n)}
    return dict(rate=rate, unit=unit, rates=rates, ceiling=cname,
                pct_ceiling=100.0 * rate / c if c else None,
                **{f"x_vs_{n}": row[n]["best_ms"] / row["fastattn"]["best_ms"] if row.get(n) else None
                   for n in ("torch", "numpy")})


# ---------------------------------------------------------------- report
CEILINGS = (("sgemm_gflops", "sgemm", "GFLOP/s"), ("dgemm_gflops", "dgemm", "GFLOP/s"),
            ("read_gbps", "read bandwidth", "GB/s"))
COLS = ("shape", "fastattn ms", "PyTorch ms", "NumPy ms", "fastattn rate", "% ceiling",
        "x vs PyTorch", "x vs NumPy")


def _day(iso):
    return iso[:16].replace("T", " ")  # 2024-01-31 12:34


def _ms(r):
    if not r:
        return "-"
    m = r["best_ms"]
    return f"{m:.1f}" if m >= 10 else f"{m:.2f}" if m >= 0.1 else f"{m:.3f}"


def format_table(result):
    """The printed report: a header, the ceilings and one line per row."""
    m, c = result["machine"], result["ceilings"]
    ver = result["versions"]
    lines = [f"fastattn.bench  {_day(result['date'])}",
             f"CPU: {m['cpu']}  kernel: {m['kernel']}  threads: {m['threads']}",
             f"fastattn {ver['fastattn']}  numpy {ver['numpy']}  torch {ver['torch'] or '-'}",
             "ceilings (this run): " + ", ".join(
                 f"{label} {c[k]:.1f} {unit}" for k, label, unit in CEILINGS if c.get(k)),
             "prefill: B=1 H=8 D=64 float32; decode: B=1 H=32 Lq=1 D=128 float32 (unless noted)", ""]
    cells = [COLS]
    for row in result["rows"]:
        d = row["derived"]
        cells.append((row["name"], _ms(row["fastattn"]), _ms(row["torch"]), _ms(row["numpy"]),
                      f"{d['rate']:.1f} {d['unit']}",
                      "-" if d["pct_ceiling"] is None else f"{d['pct_ceiling']:.0f}% {d['ceiling']}",
                      "-" if d["x_vs_torch"] is None else f"{d['x_vs_torch']:.2f}x",
                      "-" if d["x_vs_numpy"] is None else f"{d['x_vs_numpy']:.2f}x"))
    w = [max(len(r[i]) for r in cells) for i in range(len(COLS))]
    fmt = lambda r: "  ".join(s.ljust(w[0]) if i == 0 else s.rjust(w[i]) for i, s in enumerate(r))
    lines += [fmt(cells[0]), "  ".join("-" * x for x in w)] + [fmt(r) for r in cells[1:]]
    bad = [f"{r['name']} (rel err {r['rel_err']:.1e} > {r['tol']:.0e})"
           for r in result["rows"] if not r["check_ok"]]
    worst = max((r["rel_err"] / r["tol"] for r in result["rows"]), default=0.0)
    lines += ["", f"ORACLE CHECK FAILED: {'; '.join(bad)}" if bad else
              f"oracle check (one head per shape): all pass, worst rel err {worst:.2g} x tolerance"]
    return "\n".join(lines)


def plot(result, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'fastattn[bench]'") from None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), dpi=120)
    panels = [("prefill", "prefill (float32, B=1 H=8 D=64)", "L", "GFLOP/s", "sgemm_gflops", "sgemm"),
              ("decode", "decode (float32, B=1 H=32 D=128, Lq=1)", "Lk", "GB/s", "read_gbps",
               "read bandwidth")]
    style = {"fastattn": ("C0", "o", "fastattn"), "torch": ("C1", "s", "PyTorch SDPA"),
             "numpy": ("C2", "^", "NumPy naive")}
    for ax, (kind, title, xl, yl, ckey, cname) in zip(axes, panels):
        rows = sorted((r for r in result["rows"] if r["kind"] == kind and r["series"]),
                      key=lambda r: r["Lk"])
        for n, (col, mk, label) in style.items():
            pts = [(r["Lk"], r["derived"]["rates"][n]) for r in rows if n in r["derived"]["rates"]]
            if pts:
                ax.plot(*zip(*pts), color=col, marker=mk, label=label)
        top = max([r["derived"]["rates"].get(n, 0) for r in rows for n in style] + [1.0])
        if result["ceilings"].get(ckey):
            c = result["ceilings"][ckey]
            top = max(top, c)
            ax.axhline(c, color="0.4", ls="--", lw=1, label=f"{cname} ceiling")
            ax.annotate(f"{cname} {c:.0f} {yl}", xy=(0.01, c), xycoords=("axes fraction", "data"),
                        xytext=(0, 2), textcoords="offset points", fontsize=8, color="0.3")
        ax.set_xscale("log", base=2)
        if rows:
            ax.set_xticks([r["Lk"] for r in rows], [str(r["Lk"]) for r in rows])
        ax.set(title=title, xlabel=xl, ylabel=yl)
        ax.set_ylim(0, 1.15 * top)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    m = result["machine"]
    fig.suptitle(f"fastattn  |  {m['cpu']}  |  {m['threads']} threads  |  {_day(result['date'])}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def progress(i, n, label, stream=sys.stderr):
    bar = "=" * round(20 * i / n)
    line = f"[{bar:<20}] {i}/{n} {label}"
    tty = stream.isatty()
    stream.write(f"\r{line:<60}" + "\n" * (i == n) if tty else line + "\n")
    stream.flush()


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m fastattn.bench", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a subset of the grid (seconds)")
    p.add_argument("--threads", type=int, default=_kernels.max_threads(),
                   help="threads for every implementation (default: fastattn's, %(default)s)")
    p.add_argument("--json", metavar="FILE", help="write everything measured to FILE")
    p.add_argument("--plot", metavar="FILE.png", help="throughput plot (needs matplotlib)")
    p.add_argument("--no-torch", action="store_true", help="skip PyTorch SDPA")
    p.add_argument("--no-numpy", action="store_true", help="skip the naive NumPy formula")
    p.add_argument("--shapes", choices=("full", "quick", "tiny"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.threads < 1:
        p.error("--threads must be >= 1")
    shapes = grid(a.shapes or ("quick" if a.quick else "full"))
    torch = None
    if not a.no_torch:
        with contextlib.suppress(ImportError):
            import torch
            torch.set_num_threads(a.threads)
    cfg = fastattn._config.config()
    cpu, flags = cpu_info()
    result = dict(
        date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        machine=dict(cpu=cpu, cpu_flags=flags, arch=cfg["machine"], kernel=cfg["kernel"],
                     kernel_reason=cfg["kernel_reason"], kernels_supported=cfg["kernels_supported"],
                     threads=a.threads, l2_bytes=cfg["l2_bytes"], openmp=cfg["openmp"],
                     build=cfg["build"]),
        versions=dict(fastattn=cfg["fastattn"], python=cfg["python"], numpy=cfg["numpy"],
                      torch=torch.__version__ if torch is not None else None),
        ceilings={}, rows=[])
    tiny = a.shapes == "tiny"
    n = len(shapes) + 1
    with blas_limit(a.threads):
        progress(0, n, "ceilings (sgemm, read bandwidth)")
        c = result["ceilings"]
        c["sgemm_gflops"] = gemm_gflops(np.float32, 256 if tiny else 2048)
        if any(s["dtype"] == "float64" for s in shapes):
            c["dgemm_gflops"] = gemm_gflops(np.float64)
        c["read_gbps"] = read_gbps(a.threads, 16 if tiny else 256)
        for i, sh in enumerate(shapes, 1):
            progress(i, n, sh["name"])  # i steps done (the ceilings count as one)
            row = run_shape(sh, a.threads, torch, not a.no_numpy)
            row["derived"] = derive(row, c)
            result["rows"].append(row)
        progress(n, n, "done")
    print(format_table(result))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    if a.plot:
        plot(result, a.plot)
    return 0 if all(r["check_ok"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
