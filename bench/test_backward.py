"""Gradients: fastattn.attention_backward against PyTorch's CPU backward of
scaled_dot_product_attention (requires_grad), float32, interleaved in one process.

Each case times fastattn with PyTorch's call just before every round (in the untimed
set-up, with 0.1 s idle around it, as bench/test_prefill.py's interleaved cases), so
the two see the same machine; the summary prints PyTorch time / fastattn time (best
and median rounds) and the backward's GFLOP/s, counting 10·B·H·Lq·Lk·D (five
products; halved for causal) as FlashAttention does, as a % of the sgemm ceiling.

Every case checks fastattn's gradients once, in float64, on sampled rows of dq and
sampled keys of dk and dv of every head, from the definitions (P_ij = exp(s_ij - lse_i),
dS = P (dP - D)) with the forward's lse and out: exact per sample, never Lq x Lk.

The memory case runs a B=1 H=1 L=32768 D=64 backward in a fresh child process and
reports its peak RSS growth beyond the inputs and the gradients (the weights would
need 4 GiB in float32).
"""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import fastattn
from fastattn.bench import RSS_CHILD_PRELUDE

F32 = np.float32
# name: (B, H, L, D, causal, what): "fwd+bwd" times forward + backward of both,
# "bwd" the backward alone (torch: o.backward on a graph built in the set-up).
CASES = {
    "fwd+bwd B1 H8 L2048 D64": (1, 8, 2048, 64, False, "fwd+bwd"),
    "bwd B1 H8 L2048 D64": (1, 8, 2048, 64, False, "bwd"),
    "fwd+bwd B1 H8 L4096 D64 causal": (1, 8, 4096, 64, True, "fwd+bwd"),
    "fwd+bwd B4 H16 L512 D64": (4, 16, 512, 64, False, "fwd+bwd"),
    "fwd+bwd B1 H1 L8192 D64": (1, 1, 8192, 64, False, "fwd+bwd"),
    "fwd+bwd B1 H8 L2048 D128": (1, 8, 2048, 128, False, "fwd+bwd"),
}


def bwd_flops(b, h, l, d, causal):
    return 10.0 * b * h * l * l * d * (0.5 if causal else 1.0)


def check_grad_samples(q, k, v, dout, out, lse, dq, dk, dv, causal, scale, n=6, seed=0):
    """Max relative error of sampled dq rows and dk/dv keys of every (batch, head),
    computed in float64 from their definitions with the forward's out and lse."""
    rng = np.random.default_rng(seed)
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    f = np.float64
    worst = 0.0
    for b in range(B):
        for h in range(H):
            qh, kh, vh, doh = (x[b, h].astype(f) for x in (q, k, v, dout))
            lh = lse[b, h].astype(f)
            delta = np.sum(doh * out[b, h].astype(f), axis=1)          # D_i
            rows = np.unique(np.r_[0, Lq - 1, rng.integers(0, Lq, n)])
            keys = np.unique(np.r_[0, Lk - 1, rng.integers(0, Lk, n)])
            i_all, j_all = np.arange(Lq), np.arange(Lk)
            # dq_i = scale * sum_j dS_ij k_j over the whole row i
            s = scale * qh[rows] @ kh.T
            if causal:
                s = np.where(j_all[None, :] <= rows[:, None] + Lk - Lq, s, -np.inf)
            p = np.exp(s - lh[rows, None])
            ds = p * (doh[rows] @ vh.T - delta[rows, None])
            ref_dq = scale * ds @ kh
            # dk_j, dv_j over the whole column j
            s = scale * qh @ kh[keys].T
            if causal:
                s = np.where(keys[None, :] <= i_all[:, None] + Lk - Lq, s, -np.inf)
            p = np.exp(s - lh[:, None])
            ref_dv = p.T @ doh
            ds = p * (doh @ vh[keys].T - delta[:, None])
            ref_dk = scale * ds.T @ qh
            for got, ref in ((dq[b, h, rows], ref_dq), (dk[b, h, keys], ref_dk),
                             (dv[b, h, keys], ref_dv)):
                worst = max(worst, float(np.max(np.abs(got - ref)) / np.max(np.abs(ref))))
    return worst


@pytest.mark.parametrize("name", list(CASES))
def test_backward_interleaved(benchmark, bench_threads, name):
    torch = pytest.importorskip("torch")
    torch.set_num_threads(bench_threads)
    b, h, l, d, causal, what = CASES[name]
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((b, h, l, d), dtype=np.float32) for _ in range(4))
    scale = 1.0 / np.sqrt(d)
    tq, tk, tv = (torch.from_numpy(x.copy()).requires_grad_() for x in (q, k, v))
    tdout = torch.from_numpy(dout)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out, lse = fastattn.attention(q, k, v, causal=causal, return_lse=True, num_threads=bench_threads)
    graph = {}

    def torch_fwd_bwd():
        for x in (tq, tk, tv):
            x.grad = None
        sdpa(tq, tk, tv, is_causal=causal).backward(tdout)

    def torch_bwd():
        graph["o"].backward(tdout)

    base_times = []

    def run_baseline():
        for x in (tq, tk, tv):
            x.grad = None
        if what == "bwd":
            graph["o"] = sdpa(tq, tk, tv, is_causal=causal)
        time.sleep(0.1)
        t = time.perf_counter()
        (torch_bwd if what == "bwd" else torch_fwd_bwd)()
        base_times.append(time.perf_counter() - t)
        time.sleep(0.1)  # its worker threads go idle before the timed call

    def ours():
        if what == "bwd":
            return fastattn.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                               num_threads=bench_threads)
        o, lse_ = fastattn.attention(q, k, v, causal=causal, return_lse=True,
                                     num_threads=bench_threads)
        return fastattn.attention_backward(dout, q, k, v, o, lse_, causal=causal,
                                           num_threads=bench_threads)

    rounds = 3 if bwd_flops(b, h, l, d, causal) > 3e10 else 5
    benchmark.group = "backward " + name
    dq, dk, dv = benchmark.pedantic(ours, setup=run_baseline, rounds=rounds, iterations=1,
                                    warmup_rounds=1)
    err = check_grad_samples(q, k, v, dout, out, lse, dq, dk, dv, causal, scale)
    assert err <= 1e-4, f"sampled gradients: rel err {err:.2e}"
    # and PyTorch's own gradients agree (float32 both)
    for ours_g, theirs in ((dq, tq.grad), (dk, tk.grad), (dv, tv.grad)):
        t = theirs.numpy()
        assert np.max(np.abs(ours_g - t)) <= 1e-3 * np.max(np.abs(t))
    base_times = base_times[-rounds:]
    st = benchmark.stats.stats if benchmark.stats else None
    benchmark.extra_info.update(
        backward=name, what=what, threads=bench_threads, kernel=fastattn._kernels.current_kernel(),
        rel_err=err, bwd_flops=bwd_flops(b, h, l, d, causal),
        baseline_min_s=min(base_times), baseline_median_s=float(np.median(base_times)),
        ours_min_s=st.min if st else None)


CHILD = RSS_CHILD_PRELUDE + r"""
import json, sys, time
import numpy as np
import fastattn
B, H, L, D, threads = (int(x) for x in sys.argv[1:6])
rng = np.random.default_rng(0)
q, k, v, dout = (np.empty((B, H, L, D), dtype=np.float32) for _ in range(4))
for x in (q, k, v, dout):
    rng.standard_normal(out=x, dtype=np.float32)
out, lse = fastattn.attention(q, k, v, return_lse=True, num_threads=threads)


reset_peak()  # the peak RSS of this process from now on (see RSS_CHILD_PRELUDE)
before = status_kib("VmHWM:")
t0 = time.perf_counter()
dq, dk, dv = fastattn.attention_backward(dout, q, k, v, out, lse, num_threads=threads)
seconds = time.perf_counter() - t0
after = status_kib("VmHWM:")
grads_kib = (dq.nbytes + dk.nbytes + dv.nbytes) // 1024
print(json.dumps({"before_kib": before, "after_kib": after, "grads_kib": grads_kib,
                  "seconds": seconds, "finite": bool(np.isfinite(dq).all() and np.isfinite(dk).all())}))
"""


def test_backward_peak_memory(benchmark, bench_threads, capsys):
    """Peak RSS growth of a B=1 H=1 L=32768 D=64 backward beyond its gradients: < 64 MB."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [root, env.get("PYTHONPATH", "")] if p)
    L = 32768

    def child():
        proc = subprocess.run([sys.executable, "-c", CHILD, "1", "1", str(L), "64", str(bench_threads)],
                              env=env, cwd=root, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])

    benchmark.group = f"memory backward B=1 H=1 L={L} D=64 float32"
    res = benchmark.pedantic(child, rounds=1, iterations=1)
    extra_mb = (res["after_kib"] - res["before_kib"] - res["grads_kib"]) / 1024
    benchmark.extra_info.update(backward_memory=True, extra_mb=round(extra_mb, 2),
                                grads_mb=round(res["grads_kib"] / 1024, 1),
                                call_seconds=round(res["seconds"], 2), threads=bench_threads)
    with capsys.disabled():
        print(f"\n[memory] backward B=1 H=1 L={L} D=64 float32: peak RSS +"
              f"{(res['after_kib'] - res['before_kib']) / 1024:.1f} MiB, of which gradients "
              f"{res['grads_kib'] / 1024:.1f} MiB: {extra_mb:.1f} MiB beyond them; "
              f"call {res['seconds']:.2f} s")
    assert res["finite"]
    assert extra_mb < 64, f"the backward needed {extra_mb:.1f} MiB beyond its gradients"
