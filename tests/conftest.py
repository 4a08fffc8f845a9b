import numpy as np
import pytest

import fastattn
from fastattn import _kernels

# Relative error (to max |reference output|) allowed per dtype, against the float64 oracle.
TOL = {np.dtype(np.float32): 3e-5, np.dtype(np.float64): 1e-11}
KERNELS = _kernels.supported_kernels()

try:  # bfloat16 arrays come from ml_dtypes (an optional extra)
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # bfloat16 cases skip
    BF16 = None
# the 16-bit cache dtypes, for parametrize: float16, and bfloat16 (skipped without ml_dtypes)
CACHES16 = [pytest.param(np.dtype(np.float16), id="float16"),
            pytest.param(BF16, id="bfloat16",
                         marks=pytest.mark.skipif(BF16 is None, reason="ml_dtypes is not installed"))]


def rel_err(out, ref):
    ref = np.asarray(ref, dtype=np.float64)
    scale = np.max(np.abs(ref)) if ref.size else 0.0
    if ref.size == 0:
        return 0.0
    return float(np.max(np.abs(out.astype(np.float64) - ref)) / max(scale, 1e-300))


def assert_lse_close(lse, ref_lse, dtype):
    """Same -inf pattern, finite entries close in absolute terms (lse is a log)."""
    lse = np.asarray(lse, dtype=np.float64)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    if fin.any():
        tol = TOL[np.dtype(dtype)] * max(1.0, float(np.max(np.abs(ref_lse[fin]))))
        assert np.max(np.abs(lse[fin] - ref_lse[fin])) <= tol


@pytest.fixture(params=KERNELS)
def kernel(request):
    """Run the test under each CPU kernel this machine can execute."""
    before = _kernels.current_kernel()
    _kernels.set_kernel(request.param)
    yield request.param
    _kernels.set_kernel(before)


# bfloat16 q/k/v compute either converted to float32 (every kernel) or, on the avx512
# kernel where the build and CPU have it, on AVX512-BF16 pairs or AMX tiles (the emulated
# test build, FASTATTN_EMULATE_BF16, runs them from the avx2 kernel too), or on AArch64's
# neon, sve256 and sve128 kernels on BFDOT pairs where the CPU has FEAT_BF16 (every CPU
# with SVE and FEAT_BF16 has SVE's BFDOT too: Neoverse V1, V2, N2, qemu's "max"): each
# kernel with the float32 path, and each kernel that runs a pair path with it.
BF16_PATHS = _kernels.bf16_paths()
if "bfdot" in BF16_PATHS:
    PAIR_KERNELS = [k for k in ("neon", "sve256", "sve128") if k in KERNELS]
else:
    PAIR_KERNELS = [k for k in (("avx2", "avx512") if _kernels.bf16_emulated() else ("avx512",))
                    if k in KERNELS and len(BF16_PATHS) > 1]
BF16_KERNELS = [(k, "float32") for k in KERNELS] + \
    [(k, p) for k in PAIR_KERNELS for p in BF16_PATHS if p != "float32"]


@pytest.fixture(params=BF16_KERNELS, ids=[f"{k}-{p}" for k, p in BF16_KERNELS])
def bf16_kernel(request):
    """Run the test under each (kernel, bfloat16 path) pair this machine can execute."""
    before = _kernels.current_kernel(), _kernels.bf16_path()
    _kernels.set_kernel(request.param[0])
    _kernels.set_bf16_path(request.param[1])
    yield request.param
    _kernels.set_kernel(before[0])
    _kernels.set_bf16_path(before[1])


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def pytest_report_header(config):
    return (f"fastattn {fastattn.__version__} from {fastattn.__file__}; "
            f"kernels {KERNELS}, default {_kernels.current_kernel()}; bfloat16 paths {BF16_PATHS}"
            + (" (emulated: a test build)" if _kernels.bf16_emulated() else ""))


def pytest_configure(config):
    import os
    import pathlib
    if os.environ.get("FASTATTN_EXPECT_INSTALLED"):
        src = pathlib.Path(__file__).resolve().parent.parent / "fastattn"
        if pathlib.Path(fastattn.__file__).resolve().parent == src:
            raise RuntimeError(f"testing the source tree ({src}), not the installed package")
