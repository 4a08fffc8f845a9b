"""A newcomer's first hour (issue 11): the import from a source tree explains itself,
show_config says where fastattn came from and where its CPU facts came from, errors
name the real cause, window=-1 and merge(layout=) behave as documented."""
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

import fastattn
from fastattn import _kernels, reference

from conftest import TOL, assert_lse_close, rel_err

PKG = pathlib.Path(fastattn.__file__).resolve().parent


# ------------------------------------------------------------------ import and config
def _fake_source_tree(tmp_path):
    """A copy of the package's Python files laid out like the clone (setup.py, src_c/,
    fastattn/) without a built extension."""
    root = tmp_path / "clone"
    (root / "src_c").mkdir(parents=True)
    (root / "setup.py").write_text("# stands for the clone's setup.py\n")
    shutil.copytree(PKG, root / "fastattn",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
    return root


def _run_py(args, cwd, path=None):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if path:
        env["PYTHONPATH"] = str(path)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("args", [["-c", "import fastattn"], ["-m", "fastattn", "--quick"]])
def test_source_tree_import_explains_itself(tmp_path, args):
    root = _fake_source_tree(tmp_path)
    r = _run_py(args, root)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: fastattn: importing fastattn from its source tree"), r.stderr
    assert "pip install -e ." in last and "another directory" in last
    assert "circular import" not in last.split("(Original error")[0]


def test_runs_from_another_directory(tmp_path):
    """`python -m fastattn` away from the source tree runs the installed package."""
    r = _run_py(["-m", "fastattn", "--quick"], tmp_path, PKG.parent)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Self-check: all PASS" in r.stdout
    assert f"imported: {PKG}" in r.stdout


def test_show_config_names_the_import_path_and_l2_source(capsys):
    fastattn.show_config()
    text = capsys.readouterr().out
    assert f"imported: {PKG}\n" in text
    assert f"library:  {pathlib.Path(_kernels.__file__).resolve()}" in text
    cfg = fastattn._config.config()
    assert cfg["l2_source"] in text
    assert cfg["l2_source"].startswith(("CPUID", "/sys", "not readable"))


def test_console_script_is_declared():
    """`pip install .` puts a `fastattn` command on PATH that runs __main__.main."""
    from importlib import metadata
    try:
        dist = metadata.distribution("fastattn")
    except metadata.PackageNotFoundError:
        pytest.skip("fastattn is not installed as a distribution (a bare source-tree build)")
    eps = [e for e in dist.entry_points if e.group == "console_scripts" and e.name == "fastattn"]
    assert [e.value for e in eps] == ["fastattn.__main__:main"]


def _sysfs_l2():
    base = pathlib.Path("/sys/devices/system/cpu/cpu0/cache")
    for d in sorted(base.glob("index*")):
        try:
            if (d / "level").read_text().strip() == "2" and \
                    (d / "type").read_text().strip() in ("Unified", "Data"):
                size = (d / "size").read_text().strip()
        except OSError:
            continue
        else:
            if (d / "level").read_text().strip() == "2":
                mult = {"K": 1024, "M": 2**20}.get(size[-1], 1)
                return int(size.rstrip("KM")) * mult
    return None


def test_l2_size_matches_the_operating_system():
    """CPUID leaf 4 is Intel's; on AMD it reads nothing and the old code assumed
    256 KiB on machines with 512 KiB - 2 MiB.  Linux's own figure must agree."""
    sysfs = _sysfs_l2()
    if sysfs is None:
        pytest.skip("no /sys/devices/system/cpu/cpu0/cache on this system")
    assert _kernels.build_info()["l2_bytes"] == sysfs


def test_l2_source_by_vendor():
    info = _kernels.build_info()
    try:
        vendor = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                      if line.startswith("vendor_id"))
    except (OSError, StopIteration):
        pytest.skip("no /proc/cpuinfo")
    if vendor in ("AuthenticAMD", "HygonGenuine"):
        assert "(AMD)" in info["l2_source"]
    elif vendor == "GenuineIntel":
        assert info["l2_source"] == "CPUID leaf 4"


# ------------------------------------------------------------------ torch errors
def test_torch_tensor_requiring_grad_says_detach():
    torch = pytest.importorskip("torch")
    q = torch.randn(2, 5, 8, requires_grad=True)
    k = torch.randn(2, 5, 8)
    with pytest.raises(TypeError, match=r"q is a torch tensor that requires grad.*q\.detach\(\)"):
        fastattn.attention(q, k, k)
    out = fastattn.attention(q.detach(), k, k)  # the fix works
    ref = reference.attention(q.detach().numpy(), k.numpy(), k.numpy())
    assert rel_err(out, ref) <= TOL[np.dtype(np.float32)]


def test_torch_bfloat16_says_which_dtypes():
    torch = pytest.importorskip("torch")
    q = torch.randn(2, 5, 8)
    k = torch.randn(2, 5, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"k is a torch tensor of dtype torch\.bfloat16; "
                                        r"supported dtypes are float32 and float64"):
        fastattn.attention(q, k, q)
    with pytest.raises(TypeError, match=r"bias is a torch tensor that requires grad"):
        fastattn.attention(q, q, q, bias=torch.zeros(5, 5, requires_grad=True))


def test_plain_torch_tensors_still_work():
    torch = pytest.importorskip("torch")
    q, k, v = (torch.randn(2, 7, 8) for _ in range(3))
    out = fastattn.attention(q, k, v, causal=True)
    assert rel_err(out, reference.attention(q.numpy(), k.numpy(), v.numpy(), causal=True)) \
        <= TOL[np.dtype(np.float32)]


# ------------------------------------------------------------------ window = -1
@pytest.mark.parametrize("causal", [False, True, "top-left"])
@pytest.mark.parametrize("w,same_as", [((-1, -1), None), ((-1, 3), (None, 3)), ((4, -1), (4, None)),
                                       ((-1, None), None)])
def test_window_minus_one_is_unbounded(kernel, causal, w, same_as):
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 19, 16)).astype(np.float32)
    k = rng.standard_normal((2, 33, 16)).astype(np.float32)
    v = rng.standard_normal((2, 33, 16)).astype(np.float32)
    got = fastattn.attention(q, k, v, causal=causal, window=w)
    want = fastattn.attention(q, k, v, causal=causal, window=same_as)
    np.testing.assert_array_equal(got, want)
    ref = reference.attention(q, k, v, causal=causal, window=w)
    np.testing.assert_array_equal(ref, reference.attention(q, k, v, causal=causal, window=same_as))
    assert rel_err(got, ref) <= TOL[np.dtype(np.float32)]
    wts = fastattn.attention_weights(q, k, causal=causal, window=w)
    np.testing.assert_array_equal(wts, fastattn.attention_weights(q, k, causal=causal, window=same_as))


@pytest.mark.parametrize("w", [(-2, 0), (0, -5), (-1, -2)])
def test_window_below_minus_one_is_an_error(w):
    q = np.ones((3, 4), np.float32)
    with pytest.raises(ValueError, match=r"window (left|right) size must be >= 0, or -1 or None"):
        fastattn.attention(q, q, q, window=w)
    with pytest.raises(ValueError, match="window"):
        reference.attention(q, q, q, window=w)


# ------------------------------------------------------------------ merge(layout=)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("shape", [(2, 3, 11, 8), (3, 11, 8), (11, 8)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_merge_round_trip_in_each_layout(layout, shape, dtype):
    """Keys split in three parts: merging the parts, exactly as attention returned
    them in that layout, gives the attention over all keys."""
    rng = np.random.default_rng(3)
    lk = 29
    qs = shape
    ks = shape[:-2] + (lk, shape[-1])
    if layout == "bshd" and len(shape) > 2:
        qs = qs[:-3] + (qs[-2], qs[-3], qs[-1])
        ks = ks[:-3] + (ks[-2], ks[-3], ks[-1])
    q = rng.standard_normal(qs).astype(dtype)
    k = rng.standard_normal(ks).astype(dtype)
    v = rng.standard_normal(ks).astype(dtype)
    seq_axis = -3 if layout == "bshd" and len(shape) > 2 else -2
    cuts = [0, 5, 17, lk]
    parts = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        sl = [slice(None)] * k.ndim
        sl[seq_axis] = slice(a, b)
        parts.append(fastattn.attention(q, k[tuple(sl)], v[tuple(sl)], layout=layout, return_lse=True))
    outs, lses = [p[0] for p in parts], [p[1] for p in parts]
    out, lse = fastattn.merge(outs, lses, layout=layout)
    full_out, full_lse = fastattn.attention(q, k, v, layout=layout, return_lse=True)
    assert out.shape == full_out.shape and lse.shape == full_lse.shape
    assert rel_err(out, full_out.astype(np.float64)) <= 4 * TOL[np.dtype(dtype)]
    ref_out, ref_lse = reference.attention(q, k, v, layout=layout, return_lse=True)
    assert rel_err(out, ref_out) <= 4 * TOL[np.dtype(dtype)]
    assert_lse_close(lse, ref_lse, dtype)
    r_out, r_lse = reference.merge(outs, lses, layout=layout)
    assert rel_err(out, r_out) <= 4 * TOL[np.dtype(dtype)]
    assert_lse_close(r_lse, ref_lse, dtype)


def test_merge_bshd_rejects_a_bhsd_shaped_lse():
    out = np.zeros((2, 5, 3, 8), np.float32)   # (B, L, H, Dv)
    lse_bshd_rows = np.zeros((2, 5, 3), np.float32)  # (B, L, H): not how attention returns it
    with pytest.raises(ValueError, match=r"lses\[0\] \(2, 5, 3\).*\(2, 3, 5\).*layout='bshd'"):
        fastattn.merge([out, out], [lse_bshd_rows, lse_bshd_rows], layout="bshd")
    with pytest.raises(ValueError, match="layout must be"):
        fastattn.merge([out], [lse_bshd_rows], layout="sbhd")
