"""The README's examples: kept verbatim in tests/readme_examples.py, type-checked with
mypy against fastattn's annotations (the package ships py.typed) and run."""
import os
import pathlib
import re
import runpy
import subprocess
import sys

import numpy as np
import pytest

import fastattn

HERE = pathlib.Path(__file__).resolve().parent
README = HERE.parent / "README.md"
EXAMPLES = HERE / "readme_examples.py"
SEP = "\n# ---- README block\n"


def readme_blocks():
    return [m.group(1) for m in re.finditer(r"```python\n(.*?)```", README.read_text(), re.S)]


def examples_blocks():
    return EXAMPLES.read_text().split(SEP)[1:]


def test_examples_file_is_the_readme():
    if not README.exists():
        pytest.skip("README.md is not beside tests/ (tests copied without the repository)")
    blocks = readme_blocks()
    assert blocks, "README.md has no ```python blocks"
    assert examples_blocks() == blocks, \
        "tests/readme_examples.py differs from README.md: run python tests/test_readme.py --write"


def test_examples_type_check(tmp_path):
    pytest.importorskip("mypy")
    env = dict(os.environ)
    pkg_root = pathlib.Path(fastattn.__file__).resolve().parent.parent
    if "site-packages" not in pkg_root.parts and "dist-packages" not in pkg_root.parts:
        env["MYPYPATH"] = str(pkg_root)  # a source-tree build: show mypy where it is
    r = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary", "--cache-dir",
                        str(tmp_path / "cache"), "--strict-optional", "--warn-unused-ignores",
                        str(EXAMPLES)], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_examples_run(capsys):
    ns = runpy.run_path(str(EXAMPLES))
    q, k, v, out, lse = ns["q"], ns["k"], ns["v"], ns["out"], ns["lse"]
    assert out.shape == (1, 8, 1024, 64) and lse.shape == (1, 8, 1024)
    # grouped-query heads: query head h reads K/V head h // 4; checked against the oracle
    want, want_lse = fastattn.reference.attention(q, k, v, causal=True, return_lse=True)
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6, atol=1e-5)
    w_want = fastattn.reference.attention(q, k, v, window=(255, 0), alibi_slopes=np.full(8, 0.1),
                                          mask=_readme_mask())
    np.testing.assert_allclose(ns["out_w"], w_want, rtol=0, atol=1e-5)
    # the gradients of sum(out): the oracle's backward
    dq, dk, dv = fastattn.reference.attention_backward(np.ones_like(out), q, k, v, out, lse,
                                                        causal=True)
    for got, ref in zip((ns["dq"], ns["dk"], ns["dv"]), (dq, dk, dv)):
        assert got.shape == ref.shape and got.dtype == np.float32
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * np.abs(ref).max())
    assert ns["ref"].dtype == np.float64 and ns["ref"].shape == (1, 1, 1024, 64)
    assert "kernel:" in capsys.readouterr().out


def _readme_mask():
    """The README's key mask: the generator's next draw after q, k and v."""
    rng = np.random.default_rng(0)
    for shape in ((1, 8, 1024, 64), (1, 2, 1024, 64), (1, 2, 1024, 64)):
        rng.standard_normal(shape, dtype=np.float32)
    return rng.random(1024) > 0.1


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    header = EXAMPLES.read_text().split(SEP)[0]
    EXAMPLES.write_text(header + "".join(SEP + b for b in readme_blocks()))
