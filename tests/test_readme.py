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
    out, lse, ref = ns["out"], ns["lse"], ns["ref"]
    assert out.shape == (1, 8, 4096, 64) and lse.shape == (1, 8, 4096)
    # the int8 cache's first step: one key, all the weight on its dequantized value
    np.testing.assert_array_equal(ns["o_step"], fastattn.dequantize_kv(ns["vq"])[:, :, :1])
    full, full_lse = fastattn.attention(ns["q"], ns["k"], ns["v"], return_lse=True)
    np.testing.assert_allclose(out, full, rtol=0, atol=1e-5)   # the merge example
    np.testing.assert_allclose(lse, full_lse, rtol=1e-6, atol=1e-5)
    assert ref.dtype == np.float64
    q = np.ones((1, 32, 1, 128), np.float32)
    step = ns["decode_step"](q, 100)
    assert step.shape == (1, 32, 1, 128) and step.dtype == np.float32
    assert "kernel:" in capsys.readouterr().out


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    header = EXAMPLES.read_text().split(SEP)[0]
    EXAMPLES.write_text(header + "".join(SEP + b for b in readme_blocks()))
