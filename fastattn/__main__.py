"""``python -m fastattn``: configuration, a self-check against the oracle, and a timing.

    python -m fastattn                      # config + self-check + timing (B=1 H=8 L=2048 D=64)
    python -m fastattn --quick              # config + self-check only
    python -m fastattn --shape 2 16 1024 128 --causal --threads 2

Exit code 1 if any self-check case fails.
"""
import argparse
import sys
import time

import numpy as np

import fastattn
from fastattn import reference
from fastattn.bench import fma_peak, naive

TOL = {np.float32: 3e-5, np.float64: 1e-11}

# (label, q shape, k/v shape, dtype, causal)
CASES = [
    ("4-D float32", (2, 3, 77, 64), (2, 3, 77, 64), np.float32, False),
    ("4-D float32 causal", (2, 3, 77, 64), (2, 3, 77, 64), np.float32, True),
    ("4-D float64", (2, 3, 77, 64), (2, 3, 77, 64), np.float64, False),
    ("4-D float64 causal", (2, 3, 77, 64), (2, 3, 77, 64), np.float64, True),
    ("3-D odd D=37 float32", (4, 65, 37), (4, 65, 37), np.float32, False),
    ("3-D odd D=37 float64 causal", (4, 65, 37), (4, 65, 37), np.float64, True),
    ("Lq=40 < Lk=300 float32 causal", (2, 40, 64), (2, 300, 64), np.float32, True),
    ("Lq=300 > Lk=40 float64", (2, 300, 64), (2, 40, 64), np.float64, False),
    ("2-D (L, D) float32", (129, 128), (129, 128), np.float32, False),
    ("2-D (L, D) float64 causal", (129, 128), (129, 128), np.float64, True),
]


def self_check(seed=0):
    rng = np.random.default_rng(seed)
    ok = True
    print("Self-check against fastattn.reference (max |err| / max |ref|):")
    for label, qs, ks, dt, causal in CASES:
        q = rng.standard_normal(qs).astype(dt)
        k = rng.standard_normal(ks).astype(dt)
        v = rng.standard_normal(ks).astype(dt)
        try:
            out = fastattn.attention(q, k, v, causal=causal)
            ref = reference.attention(q, k, v, causal=causal)
            err = float(np.max(np.abs(out.astype(np.float64) - ref)) / max(np.max(np.abs(ref)), 1e-300))
            passed = out.dtype == dt and out.shape == ref.shape and err <= TOL[dt]
            msg = f"{err:.2e}"
        except Exception as exc:  # report, don't crash: this is a diagnostic
            passed, msg = False, f"{type(exc).__name__}: {exc}"
        ok &= passed
        print(f"  {'PASS' if passed else 'FAIL'}  {label:<32s} {msg}  (tol {TOL[dt]:.0e})")
    return ok


def best_of(f, n=3):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times)


def timing(shape, causal, threads):
    b, h, l, d = shape
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((b, h, l, d), dtype=np.float32) for _ in range(3))
    scale = 1.0 / np.sqrt(d)
    flops = 4.0 * b * h * l * l * d * (0.5 if causal else 1.0)
    out = np.empty_like(q)
    print(f"\nTiming B={b} H={h} L={l} D={d} float32{' causal' if causal else ''}, best of 3"
          f" (fastattn threads={threads or fastattn._config.config().get('threads')}):")
    fastattn.attention(q, k, v, causal=causal, out=out, num_threads=threads)  # warm-up
    t_fa = best_of(lambda: fastattn.attention(q, k, v, causal=causal, out=out, num_threads=threads))
    peak = fma_peak("float32", threads)
    print(f"  fastattn        {t_fa * 1e3:10.2f} ms  {flops / t_fa / 1e9:8.1f} GFLOP/s"
          f"  ({100 * flops / t_fa / 1e9 / peak:.0f}% of the FMA peak, {peak:.0f} GFLOP/s)")
    score_bytes = b * h * l * l * 4
    if score_bytes > 2 * 2**30:
        print(f"  numpy naive     skipped (score matrix {score_bytes / 2**30:.1f} GiB > 2 GiB)")
        return
    t_np = best_of(lambda: naive(q, k, v, scale, causal))
    print(f"  numpy naive     {t_np * 1e3:10.2f} ms  {flops / t_np / 1e9:8.1f} GFLOP/s")
    print(f"  speed-up        {t_np / t_fa:10.2f}x")


def parser():
    """The command line's parser (docs/cli.md lists its options)."""
    p = argparse.ArgumentParser(prog="python -m fastattn", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="skip the timing")
    p.add_argument("--shape", nargs=4, type=int, metavar=("B", "H", "L", "D"),
                   default=[1, 8, 2048, 64], help="timing shape (default 1 8 2048 64)")
    p.add_argument("--causal", action="store_true", help="time causal attention")
    p.add_argument("--threads", type=int, default=None, help="fastattn num_threads for the timing")
    return p


def main(argv=None):
    """Run the command: the configuration, the self-check, then the timing unless
    ``--quick``; returns the exit code (1 if a self-check case failed)."""
    args = parser().parse_args(argv)

    fastattn.show_config()
    print()
    ok = self_check()
    print("Self-check:", "all PASS" if ok else "FAILED")
    if not args.quick:
        timing(tuple(args.shape), args.causal, args.threads)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
