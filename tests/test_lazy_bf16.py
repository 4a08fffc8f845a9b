"""ml_dtypes is found, not imported, by `import fastattn` (its import was 0.57 of
fastattn's 0.66 s): a bfloat16 array cannot exist before ml_dtypes is imported, so
fastattn recognizes one from the first call after it, whoever imported it."""
import importlib.util
import os
import subprocess
import sys

import pytest

HAVE_ML_DTYPES = importlib.util.find_spec("ml_dtypes") is not None


HERE = os.path.dirname(os.path.abspath(__file__))


def _run(code):
    # (from tests/, as the other subprocess tests: in the clone's root `-c` would find the
    # source folder before the installed package)
    r = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_import_leaves_ml_dtypes_alone():
    assert _run("import sys, fastattn; print('ml_dtypes' in sys.modules, fastattn._args.bf16())") == [
        "False", "None"]


@pytest.mark.skipif(not HAVE_ML_DTYPES, reason="ml_dtypes is not installed")
def test_bf16_recognized_when_imported_after_fastattn():
    """bfloat16 prefill and a float32 query against a bfloat16 cache (the compiled fast
    path's case once the type is known), ml_dtypes imported after fastattn: right
    dtypes, results close to the float64 oracle on the same values, and the second
    decode call (after the first told the extension the type) bit-identical to the first."""
    out = _run("""
import numpy as np, fastattn, ml_dtypes
from fastattn.reference import attention as ref
rng = np.random.default_rng(0)
bf = np.dtype(ml_dtypes.bfloat16)
q, k, v = (rng.standard_normal((1, 2, 70, 32)).astype(bf) for _ in range(3))
o = fastattn.attention(q, k, v)
r = ref(*(x.astype(np.float64) for x in (q, k, v)))
print(o.dtype == bf, float(np.abs(o.astype(np.float64) - r).max()) < 2e-2)
q1 = rng.standard_normal((1, 2, 1, 32)).astype(np.float32)
kc, vc = (rng.standard_normal((1, 2, 700, 32)).astype(bf) for _ in range(2))
a = fastattn.attention(q1, kc, vc)
b = fastattn.attention(q1, kc, vc)
r1 = ref(q1.astype(np.float64), kc.astype(np.float64), vc.astype(np.float64))
print(a.dtype == np.float32, float(np.abs(a - r1).max()) < 1e-5, np.array_equal(a, b),
      fastattn._args.bf16() == bf)
""")
    assert out == ["True"] * 6
