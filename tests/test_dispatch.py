"""Run-time kernel choice: FASTATTN_DISABLE_CPU_FEATURES forces a lower kernel and
show_config says which kernel runs and why."""
import os
import subprocess
import sys

import pytest

import fastattn
from fastattn import _kernels

SUPPORTED = _kernels.supported_kernels()


def _kernel_in_subprocess(disabled):
    env = dict(os.environ, FASTATTN_DISABLE_CPU_FEATURES=disabled)
    code = "import fastattn; fastattn.show_config(); print(fastattn._kernels.current_kernel())"
    # from a neutral directory, so the child imports the fastattn this process
    # tests, never a source tree in the working directory
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__))))
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines()


def test_generic_always_available():
    assert SUPPORTED[0] == "generic"


def test_best_kernel_chosen_by_default():
    lines = _kernel_in_subprocess("")
    assert lines[-1] == SUPPORTED[-1]


@pytest.mark.parametrize("disabled,expect", [
    ("AVX512F", "avx2"), ("avx512f", "avx2"), ("AVX512F,AVX2", "generic"), ("AVX2", "generic"),
    ("FMA", "generic"), ("SSE3, AVX512F", "avx2"),
])
def test_disable_features(disabled, expect):
    want = expect if expect in SUPPORTED else "generic"
    if expect == "avx2" and "avx2" not in SUPPORTED:
        want = "generic"
    lines = _kernel_in_subprocess(disabled)
    assert lines[-1] == want
    assert any(f"kernel:   {want}" in ln for ln in lines)


def test_set_kernel_rejects_unknown():
    with pytest.raises(ValueError, match="unknown kernel"):
        _kernels.set_kernel("sse9")


def test_show_config_mentions_kernel(capsys):
    fastattn.show_config()
    out = capsys.readouterr().out
    assert "kernel:" in out and _kernels.current_kernel() in out and "openmp" in out
