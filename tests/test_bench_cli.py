"""python -m fastattn.bench: the pure helpers on a fake result set, and one tiny subprocess run."""
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import fastattn
from fastattn import bench, reference

CEIL = {"sgemm_gflops": 100.0, "read_gbps": 10.0}


def fake_result():
    """Two prefill rows and one decode row with made-up times (torch missing on one)."""
    rows = []
    for sh, times in [(bench._shape("prefill", 512), (10.0, 20.0, 40.0)),
                      (bench._shape("prefill", 2048, causal=True, series=False), (50.0, None, 400.0)),
                      (bench._shape("decode", 2048), (2.0, 4.0, 8.0))]:
        flops = 4.0 * sh["B"] * sh["H"] * sh["Lq"] * sh["Lk"] * sh["D"] * (0.5 if sh["causal"] else 1)
        row = dict(sh, flops=flops, bytes=2 * sh["B"] * sh["H"] * sh["Lk"] * sh["D"] * 4, rounds=3,
                   rel_err=1e-6, tol=3e-5, check_ok=True, score_bytes=0)
        for name, t in zip(bench.IMPLS, times):
            row[name] = None if t is None else {"best_ms": t, "median_ms": t * 1.1}
        row["derived"] = bench.derive(row, CEIL)
        rows.append(row)
    return dict(date="2024-01-01T00:00:00+00:00",
                machine=dict(cpu="Test CPU", cpu_flags={"avx2": True}, arch="x86_64", kernel="avx2",
                             kernel_reason="test", kernels_supported=["generic", "avx2"], threads=2,
                             l2_bytes=2**20, openmp=True, build="test"),
                versions=dict(fastattn="0.0", python="3", numpy=np.__version__, torch=None),
                ceilings=dict(CEIL), rows=rows)


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
    assert pre["pct_ceiling"] == pytest.approx(100 * pre["rate"] / 100.0)
    assert pre["x_vs_torch"] == pytest.approx(2.0) and pre["x_vs_numpy"] == pytest.approx(4.0)
    assert set(pre["rates"]) == {"fastattn", "torch", "numpy"}
    assert causal["x_vs_torch"] is None and causal["x_vs_numpy"] == pytest.approx(8.0)
    nbytes = 2 * 32 * 2048 * 128 * 4
    assert dec["unit"] == "GB/s" and dec["rate"] == pytest.approx(nbytes / 0.002 / 1e9)
    assert dec["ceiling"] == "read bw" and dec["pct_ceiling"] == pytest.approx(10 * dec["rate"])


def test_format_table():
    text = bench.format_table(fake_result())
    lines = text.splitlines()
    assert "Test CPU" in text and "kernel: avx2" in text and "threads: 2" in text
    assert "torch -" in text and "sgemm 100.0 GFLOP/s" in text and "read bandwidth 10.0 GB/s" in text
    header = next(ln for ln in lines if ln.startswith("shape"))
    for col in bench.COLS:
        assert col in header
    row = next(ln for ln in lines if ln.startswith("prefill L=512 "))
    assert row.split()[2:5] == ["10.0", "20.0", "40.0"] and "2.00x" in row and "4.00x" in row
    causal = next(ln for ln in lines if ln.startswith("prefill L=2048 causal"))
    assert " - " in causal and "8.00x" in causal
    assert "GB/s" in next(ln for ln in lines if ln.startswith("decode Lk=2048"))
    assert "all pass" in text
    bad = fake_result()
    bad["rows"][0].update(check_ok=False, rel_err=1.0)
    assert "ORACLE CHECK FAILED: prefill L=512" in bench.format_table(bad)


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
    root = os.path.dirname(os.path.dirname(fastattn.__file__))
    # cwd first on sys.path with -m: the subprocess imports the fastattn imported here
    p = subprocess.run(args, cwd=root, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "prefill L=64" in p.stdout and "decode Lk=128" in p.stdout
    res = json.loads(out.read_text())
    assert set(res) == {"date", "machine", "versions", "ceilings", "rows"}
    assert {"cpu", "cpu_flags", "kernel", "kernel_reason", "threads", "l2_bytes"} <= set(res["machine"])
    assert set(res["machine"]["cpu_flags"]) == {"avx2", "avx512f", "fma", "f16c"}
    assert res["machine"]["threads"] == 1
    assert {"fastattn", "numpy", "torch"} <= set(res["versions"])
    assert res["ceilings"]["sgemm_gflops"] > 0 and res["ceilings"]["read_gbps"] > 0
    assert [r["name"] for r in res["rows"]] == ["prefill L=64", "decode Lk=128"]
    for r in res["rows"]:
        assert r["check_ok"] and r["fastattn"]["best_ms"] > 0 and r["numpy"]["best_ms"] > 0
        assert {"rate", "unit", "pct_ceiling", "x_vs_torch", "x_vs_numpy"} <= set(r["derived"])
    if "--plot" in args:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
