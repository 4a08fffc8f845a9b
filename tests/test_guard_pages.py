"""No call reads or writes outside the caller's arrays: every public function, under
every CPU kernel this machine runs, with each array it is given placed against pages
the process may not touch (tests/guardpages.py), one worker process at a time so a
fault fails a test instead of ending the run (tests/guard_sweep.py draws the calls).

The sweep's size: FASTATTN_GUARD_CASES calls (default 6000), each made twice (arrays
flush against the page after them, then the page before them) and checked against the
float64 oracle; about a minute on 2 cores (AMD EPYC Zen 3).
"""
import os
import signal
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

import guard_sweep
from conftest import BF16_PATHS, KERNELS, PAIR_KERNELS

HERE = os.path.dirname(os.path.abspath(__file__))
N_CASES = int(os.environ.get("FASTATTN_GUARD_CASES", "6000"))
SEED = 20261201


def _child(code, timeout=120, raw_segv=False):
    """Runs `code` in a fresh interpreter beside guardpages.py (the installed fastattn).
    raw_segv: under AddressSanitizer (.ci/sanitize), let a SIGSEGV kill the child as it
    would without it, instead of ASan reporting it (an expected fault is no finding)."""
    env = dict(os.environ)
    if raw_segv and "ASAN_OPTIONS" in env:
        env["ASAN_OPTIONS"] = ":".join([o for o in env["ASAN_OPTIONS"].split(":")
                                        if not o.startswith("log_path=")] + ["handle_segv=0"])
    return subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True,
                          timeout=timeout, env=env)


def _why(rc):
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = str(-rc)
        return f"killed by {name}"
    return f"exit code {rc}"


# ---------------------------------------------------------------- the net itself

@pytest.mark.parametrize("place,index,what", [("end", "a.size", "read"), ("start", "-1", "read"),
                                              ("end", "0", "write")])
def test_the_guards_catch_a_stray_access(place, index, what):
    """One element past the end, one before the start, a write into an input: each is
    a SIGSEGV (so the sweep below can fail)."""
    code = f"""
import ctypes, numpy as np, guardpages
a = guardpages.guarded(np.ones(10, np.float32), {place!r})
p = ctypes.cast(a.ctypes.data, ctypes.POINTER(ctypes.c_float))
assert p[0] == 1.0 and p[a.size - 1] == 1.0   # the array itself is readable
if {what!r} == "read":
    print(p[{index}])
else:
    p[{index}] = 2.0
"""
    r = _child(code, raw_segv=True)
    assert r.returncode == -signal.SIGSEGV, (r.returncode, r.stderr[-2000:])


@pytest.mark.parametrize("how", ["contig", "rows", "swapped", "reversed"])
@pytest.mark.parametrize("place", ["end", "start"])
def test_guarded_copies_hold_the_values(place, how):
    a = np.arange(2 * 3 * 5 * 4, dtype=np.float32).reshape(2, 3, 5, 4)
    g = guard_sweep.guarded(a, place, how)
    np.testing.assert_array_equal(g, a)
    assert not g.flags.writeable
    if how != "contig":
        assert not g.flags.c_contiguous
    z = guard_sweep.guarded(np.zeros((0, 4), np.float32), place, how)
    assert z.shape == (0, 4)


# ---------------------------------------------------------------- the call

@pytest.mark.parametrize("kernel_name", KERNELS)
def test_more_queries_than_keys_top_left_window(kernel_name):
    """Issue 22: causal='top-left', a window, Lq > Lk read past the end of k (and,
    for the rows that see no key, of v, the mask and the bias) in every kernel, on
    every path: forward, weights, stats, backward, key mass.  k, v, mask and bias end
    against an unreadable page here."""
    code = f"""
import numpy as np, fastattn, guardpages
from fastattn import _kernels, reference
_kernels.set_kernel({kernel_name!r})
rng = np.random.default_rng(0)
for dt in (np.float32, np.float64):
    q = rng.standard_normal((2, 4, 150, 24)).astype(dt)
    k = rng.standard_normal((2, 2, 41, 24)).astype(dt)
    v = rng.standard_normal((2, 2, 41, 19)).astype(dt)
    mask = rng.random((150, 41)) > 0.2
    bias = rng.standard_normal((2, 1, 150, 41)).astype(dt)
    dout = rng.standard_normal((2, 4, 150, 19)).astype(dt)
    gq, gk, gv, gm, gb, gd = (guardpages.guarded(a) for a in (q, k, v, mask, bias, dout))
    for kw in (dict(), dict(mask=gm), dict(bias=gb)):
        ref = dict(kw, mask=mask) if "mask" in kw else dict(kw, bias=bias) if "bias" in kw else kw
        o, lse = fastattn.attention(gq, gk, gv, window=(6, 3), causal="top-left", return_lse=True, **kw)
        r, rl = reference.attention(q, k, v, window=(6, 3), causal="top-left", return_lse=True, **ref)
        assert np.max(np.abs(o - r)) < 1e-4 and np.isneginf(lse).sum() == np.isneginf(rl).sum() > 0
        w = fastattn.attention_weights(gq, gk, window=(6, 3), causal="top-left", **kw)
        assert np.max(np.abs(w - reference.attention_weights(q, k, window=(6, 3), causal="top-left", **ref))) < 1e-4
        fastattn.attention(gq, gk, gv, window=(6, 3), causal="top-left", return_stats=True, **kw)
        g = fastattn.attention_backward(gd, gq, gk, gv, guardpages.guarded(o), guardpages.guarded(lse),
                                        window=(6, 3), causal="top-left", **kw)
        rg = reference.attention_backward(dout, q, k, v, o, lse, window=(6, 3), causal="top-left", **ref)
        for x, y in zip(g, rg):
            assert np.max(np.abs(x - y)) < 1e-3
        m = fastattn.key_mass(gq, gk, window=(6, 3), causal="top-left", **kw)
        assert np.max(np.abs(m - reference.key_mass(q, k, window=(6, 3), causal="top-left", **ref))) < 1e-3
print("done")
"""
    r = _child(code, timeout=300)
    assert r.returncode == 0 and "done" in r.stdout, (_why(r.returncode), r.stderr[-3000:])


# ---------------------------------------------------------------- the sweep

def _sweep(n, seed):
    """Runs cases 0..n-1 in worker processes; returns (outcomes, failures)."""
    first, failures, done = 0, [], Counter()
    while first < n:
        p = subprocess.run([sys.executable, os.path.join(HERE, "guard_sweep.py"), str(n), str(seed),
                            str(first)], cwd=HERE, capture_output=True, text=True, timeout=1800)
        started = None
        for line in p.stdout.splitlines():
            word, _, rest = line.partition(" ")
            if word == "start":
                started = int(rest)
            elif word == "ok":
                done["ok"] += 1
                started = None
            elif word == "fail":
                done["fail"] += 1
                failures.append(rest)
                started = None
        if p.returncode == 0 and started is None:
            break
        if started is None:  # died between cases: not a case's fault, but a failure all the same
            failures.append(f"worker {_why(p.returncode)} outside a case: {p.stderr[-1500:]}")
            break
        done["crash"] += 1
        case = guard_sweep.cases(n, seed)[started]
        failures.append(f"{started}: {_why(p.returncode)} in {guard_sweep.describe(case)}\n"
                        f"{p.stderr[-1500:]}")
        first = started + 1
    return done, failures


def test_guard_page_sweep(capsys):
    cs = guard_sweep.cases(N_CASES, SEED)
    done, failures = _sweep(N_CASES, SEED)
    by_fn = Counter(c["fn"] for c in cs)
    by_kernel = Counter(c["kernel"] for c in cs)
    with capsys.disabled():
        print(f"\n[guard pages] {N_CASES} calls x 2 placements: {dict(done)}; by function "
              f"{dict(by_fn)}; by kernel {dict(by_kernel)}")
    assert not failures, f"{len(failures)} of {N_CASES} calls failed:\n" + "\n".join(failures[:20])
    assert done["ok"] == N_CASES


def test_sweep_reaches_every_path():
    """The drawn calls cover what the net must: every function and kernel, every dtype
    pair, both layouts and every memory layout, each variant, the edge lengths, the
    decode split path, the rows that see no key."""
    cs = guard_sweep.cases(N_CASES, SEED)
    have = Counter()
    for c in cs:
        have["fn " + c["fn"]] += 1
        have["kernel " + c["kernel"]] += 1
        have[f"dtypes {c['dq']}/{c['dkv']}"] += 1
        have["layout " + c["layout"]] += 1
        for h in c["how"][:3]:
            have["how " + h] += 1
        for key in ("mask", "bias", "alibi", "seqlens_k", "out", "sinks"):
            have[key] += key in c
        for key in ("causal", "window", "softcap", "dropout_p", "return_lse", "q_offset"):
            have[key] += key in c["kw"]
        have["Lq>Lk"] += c["Lq"] > c["Lk"]
        have["Lq<Lk"] += c["Lq"] < c["Lk"]
        have["L=0"] += 0 in (c["Lq"], c["Lk"])
        have["L=1"] += 1 in (c["Lq"], c["Lk"])
        have["decode split"] += c["Lq"] <= 8 and c["Lk"] > 512 and c["fn"] in ("attention", "stats")
        have["GQA"] += c["Hq"] > c["Hkv"]
        have["top-left window Lq>Lk"] += (c["kw"].get("causal") == "top-left" and "window" in c["kw"]
                                          and c["Lq"] > c["Lk"])
        have[f"threads {c['threads']}"] += 1
        if c["kernel"] in PAIR_KERNELS and c["dq"] == "bf16":
            have[f"bf16 {c['bf16_path']} on {c['kernel']}"] += 1
    want = ([f"fn {f}" for f in set(guard_sweep.FUNCTIONS)] + [f"kernel {k}" for k in KERNELS]
            + ["dtypes f32/f32", "dtypes f64/f64", "dtypes f32/f16", "dtypes f16/f16", "dtypes bf16/bf16",
               "dtypes f32/bf16", "layout bhsd", "layout bshd"]
            + [f"how {h}" for h in ("contig", "rows", "swapped", "reversed")]
            + ["mask", "bias", "alibi", "seqlens_k", "out", "sinks", "causal", "window", "softcap", "dropout_p",
               "return_lse", "q_offset", "Lq>Lk", "Lq<Lk", "L=0", "L=1", "decode split", "GQA",
               "top-left window Lq>Lk", "threads 1", "threads 2", "threads 3"]
            + [f"bf16 {p} on {k}" for k in PAIR_KERNELS for p in BF16_PATHS])
    thin = {w: have[w] for w in want if have[w] < 10}
    assert not thin, f"the sweep barely reaches {thin}"


# ---------------------------------------------------------------- the A/B of two builds

def test_ab_bits_records_the_same_bits_twice_and_sees_a_change(tmp_path):
    """tests/ab_bits.py (the bit-for-bit A/B of two builds over the sweep's calls):
    two recordings under one build agree, a changed output is reported, and the
    script's own record/compare commands work end to end."""
    import ab_bits
    a = ab_bits.record(120, 7)
    assert a == ab_bits.record(120, 7)
    assert sum(len(d) for d in a.values()) > 200
    b = {i: dict(d) for i, d in a.items()}
    name = sorted(b["5"])[0]
    b["5"][name] = "0" * 64
    assert ab_bits.compare(a, b) == [("5", [name])]
    files = [str(tmp_path / f"{x}.json") for x in "ab"]
    for f in files:
        r = subprocess.run([sys.executable, os.path.join(HERE, "ab_bits.py"), "record", f,
                            "--cases", "40"], cwd=HERE, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run([sys.executable, os.path.join(HERE, "ab_bits.py"), "compare", *files],
                       cwd=HERE, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "0 of 40 calls differ" in r.stdout, (r.stdout, r.stderr[-2000:])
