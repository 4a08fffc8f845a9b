"""python -m fastattn.bench: the pure helpers on a fake result set, the ceilings' child
process and its clean environment, the sampled-row oracle check (and that it catches a
wrong head mapping), and one tiny subprocess run."""
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import fastattn
from fastattn import bench, reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))  # fastattn's parent
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout with bench/

CEIL = {"fma_peak_gflops": 200.0, "sgemm_gflops": 100.0, "read_gbps": 10.0}


def fake_result():
    """Two prefill rows and one decode row with made-up times (torch missing on one):
    three rounds each, the medians 10/20/40 ms etc.; fastattn's rounds on the causal row
    have an interquartile range of 20% of their median (noisy), the others 5%."""
    rows = []
    for sh, times in [(bench._shape("prefill", 512), (10.0, 20.0, 40.0)),
                      (bench._shape("prefill", 2048, causal=True, series=False), (50.0, None, 400.0)),
                      (bench._shape("decode", 2048), (2.0, 4.0, 8.0))]:
        flops = 4.0 * sh["B"] * sh["H"] * sh["Lq"] * sh["Lk"] * sh["D"] * (0.5 if sh["causal"] else 1)
        row = dict(sh, flops=flops, bytes=2 * sh["B"] * sh["H"] * sh["Lk"] * sh["D"] * 4, rounds=3,
                   rel_err=1e-6, tol=3e-5, check_ok=True, checked_rows=[0], score_bytes=0)
        for name, t in zip(bench.IMPLS, times):
            if t is None:
                row[name] = None
                continue
            # rounds: the median, then 5% slower, then 5% faster (40% apart: causal fastattn)
            d = 0.2 if sh["causal"] and name == "fastattn" else 0.05
            ts = [t, t * (1 + d), t * (1 - d)]
            row[name] = {"best_ms": min(ts), "median_ms": t, "times_ms": ts}
        row["derived"] = bench.derive(row, CEIL)
        rows.append(row)
    return dict(date="2024-01-01T00:00:00+00:00",
                machine=dict(cpu="Test CPU", cpu_flags={"avx2": True}, arch="x86_64", kernel="avx2",
                             kernel_reason="test", kernels_supported=["generic", "avx2"], threads=2,
                             l2_bytes=2**20, openmp=True, build="test"),
                versions=dict(fastattn="0.0", python="3", numpy=np.__version__, torch=None),
                env_note=None, ceilings=dict(CEIL), rows=rows)


def test_grids():
    full, quick, tiny = bench.grid("full"), bench.grid("quick"), bench.grid("tiny")
    assert len(full) == 13 and len(quick) == 5 and len(tiny) == 2
    for g in (full, quick, tiny):
        assert len({s["name"] for s in g}) == len(g)
    assert {s["Lk"] for s in quick if s["kind"] == "decode"} == {2048, 8192}
    f16 = [s for s in full if s["kv_dtype"] == "float16"]
    assert len(f16) == 1 and f16[0]["dtype"] == "float32" and f16[0]["Lk"] == 8192


def test_derive():
    pre, causal, dec = (r["derived"] for r in fake_result()["rows"])
    flops = 4.0 * 8 * 512 * 512 * 64
    assert pre["unit"] == "GFLOP/s" and pre["rate"] == pytest.approx(flops / 0.010 / 1e9)
    assert pre["rate_best"] == pytest.approx(flops / 0.0095 / 1e9)
    # the ceiling is the FMA peak; the sgemm is the second column
    assert pre["ceiling"] == "FMA peak" and pre["pct_ceiling"] == pytest.approx(100 * pre["rate"] / 200.0)
    assert pre["gemm"] == "sgemm" and pre["pct_gemm"] == pytest.approx(100 * pre["rate"] / 100.0)
    # per-round ratios: the rounds move together here, so every round's ratio is 2 (4)
    assert pre["x_vs_torch"] == pytest.approx(2.0) and pre["x_vs_numpy"] == pytest.approx(4.0)
    assert pre["x_vs_torch_iqr"] == pytest.approx([2.0, 2.0])
    assert pre["x_vs_torch_range"] == pytest.approx([2.0, 2.0])
    assert pre["fastattn_ms"] == 10.0 and pre["fastattn_range_ms"] == pytest.approx([9.5, 10.5])
    assert pre["fastattn_iqr_ms"] == pytest.approx([9.75, 10.25])  # quartiles, interpolated
    assert pre["fastattn_spread"] == pytest.approx(0.05)
    assert pre["noisy"] == {"fastattn": False, "torch": False, "numpy": False}
    assert set(pre["rates"]) == {"fastattn", "torch", "numpy"}
    assert pre["rates"]["torch"] == pytest.approx(flops / 0.020 / 1e9)  # medians
    assert causal["x_vs_torch"] is None and causal["x_vs_torch_iqr"] is None
    # numpy's rounds 400, 420, 380 over fastattn's 50, 60, 40: ratios 8, 7, 9.5
    assert causal["x_vs_numpy"] == pytest.approx(8.0)
    assert causal["x_vs_numpy_range"] == pytest.approx([7.0, 9.5])
    assert causal["x_vs_numpy_iqr"] == pytest.approx([7.5, 8.75])
    assert causal["fastattn_spread"] == pytest.approx(0.2)
    assert causal["noisy"] == {"fastattn": True, "numpy": True}  # 1.25 / 8 > 10% too
    nbytes = 2 * 32 * 2048 * 128 * 4
    assert dec["unit"] == "GB/s" and dec["rate"] == pytest.approx(nbytes / 0.002 / 1e9)
    assert dec["ceiling"] == "read bw" and dec["pct_ceiling"] == pytest.approx(10 * dec["rate"])
    assert dec["pct_gemm"] is None


def test_spread_and_noisy_threshold():
    assert bench.spread([1.0, 2.0, 3.0]) == (2.0, 1.5, 2.5, 0.5)
    assert bench.spread([4.0]) == (4.0, 4.0, 4.0, 0.0)
    # one hiccup round in 9 moves neither the median nor the quartiles much
    med, q1, q3, sp = bench.spread([10.0, 10.2, 9.9, 10.1, 10.0, 30.0, 9.8, 10.1, 10.0])
    assert med == 10.0 and sp < 0.05
    row = fake_result()["rows"][0]
    for sp, noisy in ((0.09, False), (0.11, True)):  # (Q3 - Q1) / median vs NOISY_SPREAD
        row["fastattn"]["times_ms"] = [10.0, 10.0 * (1 + sp), 10.0 * (1 - sp)]
        row["torch"]["times_ms"] = [t * 2 for t in row["fastattn"]["times_ms"]]  # steady ratio
        d = bench.derive(row, CEIL)
        assert d["noisy"]["fastattn"] is noisy and d["noisy"]["torch"] is False
    assert bench.NOISY_SPREAD == 0.10


def test_format_table():
    text = bench.format_table(fake_result())
    lines = text.splitlines()
    assert "Test CPU" in text and "kernel: avx2" in text and "threads: 2" in text
    assert "torch -" in text and "sgemm 100.0 GFLOP/s" in text and "read bandwidth 10.0 GB/s" in text
    assert "ceilings (this run): FMA peak 200.0 GFLOP/s, sgemm" in text
    assert "medians of 3 interleaved rounds" in text
    assert not any(ln.startswith("note:") for ln in lines)
    header = next(ln for ln in lines if ln.startswith("shape"))
    for col in bench.COLS:
        assert col in header
    row = next(ln for ln in lines if ln.startswith("prefill L=512 "))
    assert "10.0 [9.75-10.2] " in row and row.split()[4:6] == ["20.0", "40.0"]
    assert "2.00x [2.00-2.00] " in row and "4.00x [4.00-4.00] " in row and "~" not in row
    causal = next(ln for ln in lines if ln.startswith("prefill L=2048 causal"))
    assert "50.0 [45.0-55.0]~" in causal and "8.00x [7.50-8.75]~" in causal
    assert " - " in causal
    assert "GB/s" in next(ln for ln in lines if ln.startswith("decode Lk=2048"))
    foot = next(ln for ln in lines if ln.startswith("~ noisy"))
    assert "over 10% of its median" in foot and "1 of 3 rows" in foot
    assert "all pass" in text and "every batch and head" in text
    bad = fake_result()
    bad["rows"][0].update(check_ok=False, rel_err=1.0)
    assert "ORACLE CHECK FAILED: prefill L=512" in bench.format_table(bad)


def test_env_note(monkeypatch):
    for name in bench.NOTE_ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    assert bench.blas_env_note() is None
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    note = bench.blas_env_note()
    assert note.startswith("note: OPENBLAS_CORETYPE=Haswell is set: NumPy's matmul (the naive "
                           "NumPy column)") and note.endswith("ceilings are measured without it")
    monkeypatch.setenv("OPENBLAS_L2_SIZE", "262144")
    note = bench.blas_env_note()
    assert "OPENBLAS_CORETYPE=Haswell, OPENBLAS_L2_SIZE=262144 are set" in note
    assert note.endswith("without them")
    res = fake_result()
    res["env_note"] = note
    lines = bench.format_table(res).splitlines()
    assert lines[3] == note  # in the header, before the ceilings
    # the pytest header of bench/ prints the same line
    spec = importlib.util.spec_from_file_location(
        "bench_conftest", os.path.join(REPO, "bench", "conftest.py"))
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    assert note in conftest.pytest_report_header(None)
    monkeypatch.delenv("OPENBLAS_CORETYPE")
    monkeypatch.delenv("OPENBLAS_L2_SIZE")
    assert not conftest.pytest_report_header(None)


def test_clean_env():
    env = bench.clean_env(3, {"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_L2_SIZE": "1",
                              "OPENBLAS_NUM_THREADS": "8", "GOTO_NUM_THREADS": "8",
                              "MKL_ENABLE_INSTRUCTIONS": "AVX2", "PATH": "/bin", "PYTHONPATH": "/x"})
    assert "OPENBLAS_CORETYPE" not in env and "OPENBLAS_L2_SIZE" not in env
    assert "GOTO_NUM_THREADS" not in env and "MKL_ENABLE_INSTRUCTIONS" not in env
    assert env["OPENBLAS_NUM_THREADS"] == env["OMP_NUM_THREADS"] == "3" and env["PATH"] == "/bin"
    assert env["PYTHONPATH"] == os.pathsep.join([ROOT, "/x"])


def test_ceiling_lines():
    c = dict(CEIL, source="child", blas="openblas 0.3 SkylakeX", env_removed=["OPENBLAS_CORETYPE"],
             in_process=dict(sgemm_gflops=50.0, blas="openblas 0.3 Haswell"))
    lines = bench.ceiling_lines(c)
    assert lines[0] == ("ceilings (this run): FMA peak 200.0 GFLOP/s, sgemm 100.0 GFLOP/s, read "
                        "bandwidth 10.0 GB/s; gemm "
                        "timed in a child process without OPENBLAS_CORETYPE (openblas 0.3 SkylakeX "
                        "kernels)")
    assert lines[1] == ("note: sgemm in this process (the BLAS the NumPy column runs, openblas 0.3 "
                        "Haswell): 50.0 GFLOP/s, 50% below the child's")
    c["in_process"]["sgemm_gflops"] = 85.0  # within 20%: no note
    assert len(bench.ceiling_lines(c)) == 1
    del c["env_removed"]
    assert bench.ceiling_lines(c)[0].endswith("; gemm timed in a child process (openblas 0.3 "
                                              "SkylakeX kernels)")
    c["in_process"]["sgemm_gflops"] = 125.0
    assert "25% above the child's" in bench.ceiling_lines(c)[1]


@pytest.mark.parametrize("kernel", fastattn._kernels.supported_kernels())
def test_read_bandwidth_reads_every_element_once(kernel):
    """The read loop of each kernel, float32 and float64, on 1 to 3 threads (3: shares
    that are not the array's halves), sums exactly the elements of each thread's share,
    once each: the shares are the first `bytes` of the array."""
    from fastattn import _kernels
    for dt in (np.float64, np.float32):
        for n in (128, 128 * 3 + 5, 100_003, 1_000_000):
            buf = (np.arange(n) % 7).astype(dt)   # small integers: every sum exact
            for t in (1, 2, 3):
                nbytes, seconds, total = _kernels.read_bandwidth(buf, kernel, t, 2)
                item = buf.itemsize
                ran = nbytes // item
                assert nbytes % item == 0 and seconds > 0 and ran <= n
                assert n - ran < t * 4 * 32  # at most a step of 4 x 32 elements a thread left out
                assert total == float(buf[:ran].astype(np.float64).sum())
    g = bench.read_bandwidth(2, mib=4, passes=2, kernel=kernel)
    assert isinstance(g, float) and np.isfinite(g) and g > 0


def test_read_bandwidth_arguments():
    from fastattn import _kernels
    assert bench.read_bandwidth(mib=8, passes=1) > 0  # the default kernel and thread count
    with pytest.raises(ValueError, match="num_threads must be >= 1, got 0"):
        bench.read_bandwidth(0)
    for bad in (1.5, True, "2"):
        with pytest.raises(TypeError, match="num_threads must be an int"):
            bench.read_bandwidth(bad)
    for name in ("mib", "passes"):
        with pytest.raises(ValueError, match=f"{name} must be >= 1"):
            bench.read_bandwidth(1, **{name: 0})
        with pytest.raises(TypeError, match=f"{name} must be an int"):
            bench.read_bandwidth(1, **{name: 2.0})
    with pytest.raises(ValueError, match="mib must be >= 1 and <= 2048, got 2049"):
        bench.read_bandwidth(1, mib=2049)
    with pytest.raises(ValueError, match="kernel must be one of"):
        bench.read_bandwidth(1, mib=1, kernel="sse9")
    with pytest.raises(TypeError, match="1-D contiguous float32 or float64"):
        _kernels.read_bandwidth(np.ones(256, np.int32), "generic", 1, 1)
    with pytest.raises(TypeError, match="1-D contiguous float32 or float64"):
        _kernels.read_bandwidth(np.ones(512, np.float32)[::2], "generic", 1, 1)
    with pytest.raises(ValueError, match="num_threads/passes < 1"):
        _kernels.read_bandwidth(np.ones(256, np.float32), "generic", 1, 0)


@pytest.mark.parametrize("kernel", fastattn._kernels.supported_kernels())
def test_fma_peak_every_kernel(kernel):
    """Each kernel's FMA chains run, on 1 and 2 threads, float32 and float64."""
    for dtype in ("float32", np.float64):
        for t in (1, 2):
            g = bench.fma_peak(dtype, t, kernel=kernel)
            assert isinstance(g, float) and np.isfinite(g) and g > 0


def test_fma_peak_arguments():
    assert bench.fma_peak() > 0  # the default kernel and thread count
    with pytest.raises(ValueError, match="dtype must be float32 or float64, got float16"):
        bench.fma_peak("float16")
    with pytest.raises(TypeError, match="dtype must be float32 or float64"):
        bench.fma_peak("not a dtype")
    with pytest.raises(ValueError, match="num_threads must be >= 1, got 0"):
        bench.fma_peak("float32", 0)
    for bad in (1.5, True, "2"):
        with pytest.raises(TypeError, match="num_threads must be an int"):
            bench.fma_peak("float32", bad)
    with pytest.raises(ValueError, match="kernel must be one of"):
        bench.fma_peak("float32", 1, kernel="sse9")
    missing = [k for k in ("generic", "avx2", "avx512") if k not in fastattn._kernels.supported_kernels()]
    for k in missing:  # compiled, but this CPU cannot run it
        with pytest.raises(ValueError, match="what this CPU runs"):
            bench.fma_peak("float32", 1, kernel=k)


def test_child_ceilings_fallback(monkeypatch):
    """The child fails: the ceilings come from this process and the report says why."""
    def broken(*a, **k):
        raise OSError("no such interpreter")
    monkeypatch.setattr(bench.subprocess, "run", broken)
    monkeypatch.setattr(bench, "read_gbps", lambda threads, mib: 7.0)
    monkeypatch.setattr(bench, "SETTLE_AFTER_NUMPY_S", 0.0)
    c = bench.measure_ceilings(1, n32=64, n64=64)
    assert c["source"] == "in-process" and "no such interpreter" in c["child_error"]
    assert c["sgemm_gflops"] == c["in_process"]["sgemm_gflops"] > 0
    assert c["dgemm_gflops"] == c["in_process"]["dgemm_gflops"] > 0 and c["read_gbps"] == 7.0
    assert c["fma_peak_gflops"] > 0 and c["fma_peak_f64_gflops"] > 0
    line = bench.ceiling_lines(c)[0]
    assert "; gemm timed in this process" in line
    assert line.endswith(": the child process failed: OSError: no such interpreter")


def test_child_ceilings_env(monkeypatch):
    """The child really runs without OPENBLAS_CORETYPE (its BLAS reports its own kernels)."""
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Sandybridge")
    res, why = bench.child_ceilings(1, n32=64, n64=64)
    assert why is None, why
    assert res["sgemm_gflops"] > 0 and res["dgemm_gflops"] > 0
    assert res["env_removed"] == ["OPENBLAS_CORETYPE"] or "OPENBLAS_CORETYPE" in res["env_removed"]
    if "openblas" in (res["blas"] or "") and bench.cpu_info()[1]["avx2"]:
        assert "Sandybridge" not in res["blas"]  # OpenBLAS's own choice for an AVX2 CPU


def _check_inputs(B=2, Hq=4, Hkv=2, Lq=37, Lk=53, D=16, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, Hq, Lq, D)).astype(np.float32),
            rng.standard_normal((B, Hkv, Lk, D)).astype(np.float32),
            rng.standard_normal((B, Hkv, Lk, D)).astype(np.float32))


VARIANTS = [dict(), dict(causal=True), dict(causal="top-left"), dict(window=(5, 3)),
            dict(causal=True, window=(7, None)), dict(window=(None, 0), causal="top-left"),
            dict(mask="rows"), dict(bias="rows"), dict(mask="heads"), dict(alibi_slopes=True),
            dict(softcap=2.0, causal=True), dict(scale=0.3), dict(layout="bshd", causal=True)]


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: ",".join(kw) or "plain")
@pytest.mark.parametrize("lq", [37, 53, 1])
def test_check_rows_matches_the_full_oracle(kw, lq):
    """check_rows's oracle on a sample of rows is the full oracle's rows (alignments with
    Lq != Lk, window, mask and bias rows, ALiBi distances, GQA, layout), and fastattn passes."""
    q, k, v = _check_inputs(Lq=lq)
    rng = np.random.default_rng(1)
    kw = dict(kw)
    if kw.get("mask") == "rows":
        kw["mask"] = rng.random((2, 1, lq, 53)) > 0.3
    elif kw.get("mask") == "heads":
        kw["mask"] = rng.random((4, 1, 53)) > 0.3
    if kw.get("bias") == "rows":
        kw["bias"] = rng.standard_normal((1, 4, lq, 53)).astype(np.float32)
    if kw.get("alibi_slopes"):
        kw["alibi_slopes"] = np.array([0.5, 0.25, 0.125, 0.0625])
    if kw.get("layout") == "bshd":
        q, k, v = (np.ascontiguousarray(a.swapaxes(1, 2)) for a in (q, k, v))
    full = reference.attention(q, k, v, **kw)
    for rows in (None, np.arange(lq)):
        assert bench.check_rows(full, q, k, v, rows, **kw) < 1e-13
    out = fastattn.attention(q, k, v, **kw)
    assert bench.check_rows(out, q, k, v, **kw) < 3e-5


def test_sample_rows():
    r = bench.sample_rows(100)
    assert r[0] == 0 and r[-1] == 99 and len(r) == 8 and list(r) == sorted(set(r))
    assert list(bench.sample_rows(1)) == [0] and list(bench.sample_rows(3)) == [0, 1, 2]
    assert list(bench.sample_rows(100)) == list(r)  # reproducible


@pytest.mark.parametrize("causal", [False, True])
def test_check_rows_catches_a_wrong_head(causal):
    """A kernel that used batch 0 / head 0's K/V for another (batch, head) fails the check,
    wherever that head is; so does one that wrote a head's rows into another."""
    q, k, v = _check_inputs(Hkv=4)
    out = fastattn.attention(q, k, v, causal=causal)
    assert bench.check_rows(out, q, k, v, causal=causal) < 3e-5
    for b, h in [(0, 1), (0, 3), (1, 0), (1, 2)]:
        k_bad, v_bad = k.copy(), v.copy()  # what such a kernel would have read for (b, h)
        k_bad[b, h], v_bad[b, h] = k[0, 0], v[0, 0]
        assert bench.check_rows(out, q, k_bad, v_bad, causal=causal) > 1e-2
    perm = [1, 2, 3, 0]  # every head's K/V shifted by one
    assert bench.check_rows(out, q, k[:, perm], v[:, perm], causal=causal) > 1e-2
    out_bad = out.copy()
    out_bad[1, 3] = out[1, 2]
    assert bench.check_rows(out_bad, q, k, v, causal=causal) > 1e-2


def test_json_round_trip():
    res = fake_result()
    back = json.loads(json.dumps(res))
    assert back == res


def test_naive_matches_oracle():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 33, 16)).astype(np.float32) for _ in range(3))
    for causal in (False, True):
        ref = reference.attention(q, k, v, causal=causal, scale=0.25)
        assert np.max(np.abs(bench.naive(q, k, v, 0.25, causal) - ref)) < 1e-5


def test_plot_missing_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit, match=r"pip install 'fastattn\[bench\]'"):
        bench.plot(fake_result(), str(tmp_path / "x.png"))


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "x.png"
    bench.plot(fake_result(), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_tiny(tmp_path):
    out = tmp_path / "bench.json"
    args = [sys.executable, "-m", "fastattn.bench", "--shapes", "tiny", "--threads", "1",
            "--json", str(out)]
    png = tmp_path / "bench.png"
    if importlib.util.find_spec("matplotlib") is not None:
        args += ["--plot", str(png)]
    # with the setting that slowed NumPy's matmul (Sandybridge: AVX without FMA)
    env = dict(os.environ, OPENBLAS_CORETYPE="Sandybridge")
    env.pop("OPENBLAS_L2_SIZE", None)
    # cwd first on sys.path with -m: the subprocess imports the fastattn imported here
    p = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "prefill L=64" in p.stdout and "decode Lk=128" in p.stdout
    lines = p.stdout.splitlines()
    assert "note: OPENBLAS_CORETYPE=Sandybridge is set: NumPy's matmul (the naive NumPy column) " \
        "may run slower kernels than this CPU allows; ceilings are measured without it" in lines
    ceil = next(ln for ln in lines if ln.startswith("ceilings (this run"))
    assert "gemm timed in a child process without OPENBLAS_CORETYPE" in ceil
    assert "~ noisy" in p.stdout and "every batch and head" in p.stdout
    res = json.loads(out.read_text())
    assert set(res) == {"date", "machine", "versions", "env_note", "ceilings", "rows"}
    assert {"cpu", "cpu_flags", "kernel", "kernel_reason", "threads", "l2_bytes"} <= set(res["machine"])
    assert set(res["machine"]["cpu_flags"]) == {"avx2", "avx512f", "fma", "f16c"}
    assert res["machine"]["threads"] == 1
    assert {"fastattn", "numpy", "torch"} <= set(res["versions"])
    c = res["ceilings"]
    assert c["sgemm_gflops"] > 0 and c["read_gbps"] > 0 and c["source"] == "child"
    assert c["fma_peak_gflops"] > 0 and c["fma_kernel"] == res["machine"]["kernel"]
    assert c["env_removed"] == ["OPENBLAS_CORETYPE"] and c["in_process"]["sgemm_gflops"] > 0
    assert res["env_note"].startswith("note: OPENBLAS_CORETYPE=Sandybridge is set")
    assert [r["name"] for r in res["rows"]] == ["prefill L=64", "decode Lk=128"]
    for r in res["rows"]:
        assert r["check_ok"] and r["fastattn"]["best_ms"] > 0 and r["numpy"]["best_ms"] > 0
        assert r["rounds"] >= 7 and r["checked_rows"][0] == 0
        for impl in ("fastattn", "numpy"):  # every round's time
            assert len(r[impl]["times_ms"]) == r["rounds"]
            assert min(r[impl]["times_ms"]) == r[impl]["best_ms"]
        assert {"rate", "unit", "pct_ceiling", "pct_gemm", "x_vs_torch", "x_vs_numpy", "x_vs_numpy_iqr",
                "x_vs_numpy_range", "fastattn_iqr_ms", "fastattn_range_ms", "noisy"} <= set(r["derived"])
    if "--plot" in args:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
