"""The kernels' vectorized exp, in ULPs against np.exp."""
import numpy as np
import pytest

from fastattn import _kernels

# Bounds just above the measured maxima (float32 0.91 ulp with the degree-7 Taylor
# polynomial of the generic and AVX-512 kernels, 1.014 ulp with the AVX2 kernel's
# degree-6 fitted one; float64 1.0 ulp against np.exp, which is itself not exact in
# float64).  fa_exp.h gives the polynomials' truncation bounds; these measured
# figures include the rounding of the reduced argument and of Horner's steps.
MAX_ULP = {np.float32: 1.05, np.float64: 1.5}


def _ulp_err(y, x, dtype):
    want = np.exp(x.astype(np.float64))  # float32: exact to << 1 ulp of float32
    if dtype == np.float64:
        want = np.exp(x)
    spacing = np.spacing(np.abs(want.astype(dtype)))
    return np.abs(y.astype(np.float64) - want) / spacing


# Below FLUSH the SIMD kernels return +0 rather than a subnormal (fa_exp.h: forming
# subnormals costs a microcode assist per vector, and the softmax never needs them).
FLUSH = {np.float32: -86.5, np.float64: -707.0}


@pytest.mark.parametrize("name", _kernels.supported_kernels())
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exp_ulp(name, dtype):
    """ULP error over [FLUSH, 88] (every result there is a normal number), and the
    absolute error below it, over the whole range [-104, 88] a float32 exp covers."""
    rng = np.random.default_rng(7)
    x = np.concatenate([np.linspace(-104, 88, 400_001), rng.uniform(-104, 88, 100_001),
                        np.arange(-104, 89, 0.5)]).astype(dtype)
    y = _kernels.exp(x, name)
    assert y.dtype == dtype
    normal = x >= FLUSH[dtype]
    err = _ulp_err(y[normal], x[normal], dtype)
    assert err.max() <= MAX_ULP[dtype], (name, float(err.max()), float(x[normal][np.argmax(err)]))
    low = y[~normal].astype(np.float64)
    assert (low >= 0).all()
    assert (np.abs(low - np.exp(x[~normal].astype(np.float64))) <= np.exp(FLUSH[dtype])).all()


@pytest.mark.parametrize("name", _kernels.supported_kernels())
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exp_special_values(name, dtype):
    under = -120 if dtype == np.float32 else -750  # below the smallest subnormal
    x = np.array([-np.inf, -1e30, -800, under, 0.0, -0.0, 1e30, np.inf, np.nan, 5.0], dtype)
    y = _kernels.exp(x, name)
    assert y[0] == 0 and not np.signbit(y[0])  # exactly +0 for -inf
    assert (y[1:4] == 0).all()
    assert y[4] == 1 and y[5] == 1
    assert np.isposinf(y[6]) and np.isposinf(y[7])
    assert np.isnan(y[8])
    # lengths that leave a partial vector
    for n in range(1, 19):
        z = np.linspace(-3, 3, n).astype(dtype)
        np.testing.assert_allclose(_kernels.exp(z, name), np.exp(z), rtol=4 * np.finfo(dtype).eps)


# The online softmax's exp of its logits x = s - m <= 0 (FA_VEXP_LOGIT: 2^y with y =
# x log2(e), two Cody-Waite steps fewer on AVX2 and AVX-512, and in their float64 a
# polynomial two degrees shorter; the generic kernel uses the exp above).  y's rounding
# costs up to |x| / 4 units in the last place more: relative error <= u (2 + |x| / 4),
# u = 2^-24 (float32), 2^-53 (float64).  Measured maxima on a Xeon: 0.88 (float32) and
# 0.92 (float64) of that bound; AVX2 on an AMD EPYC 0.88 and 0.92 (the shorter fit),
# AVX-512's float64 with that fit on an AMD EPYC (Zen 4) 0.92; the SVE kernels' float32
# (FEXPA and a degree-2 polynomial, src_c/kernels_sve.h) under qemu 0.98.
@pytest.mark.parametrize("name", _kernels.supported_kernels())
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exp_logit_error(name, dtype):
    rng = np.random.default_rng(11)
    x = np.concatenate([np.linspace(-104, 0, 400_001), rng.uniform(-104, 0, 100_001),
                        -np.abs(rng.standard_normal(100_001)) * 3]).astype(dtype)
    y = _kernels.exp(x, name, logit=True).astype(np.float64)
    want = np.exp(x.astype(np.float64))
    u = np.finfo(dtype).eps / 2
    normal = x >= FLUSH[dtype]
    rel = np.abs(y[normal] - want[normal]) / want[normal]
    bound = u * (2 + np.abs(x[normal].astype(np.float64)) / 4)
    worst = np.argmax(rel / bound)
    assert (rel <= bound).all(), (name, float(rel[worst]), float(x[normal][worst]))
    low = y[~normal]
    assert (low >= 0).all() and (np.abs(low - want[~normal]) <= np.exp(FLUSH[dtype])).all()


@pytest.mark.parametrize("name", _kernels.supported_kernels())
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exp_logit_special_values(name, dtype):
    """e^0 = 1 exactly (a row's largest logit weighs 1), -inf and far below give +0,
    NaN stays NaN, +inf gives +inf, and partial vectors read only their lanes."""
    x = np.array([-np.inf, -1e30, -800, 0.0, -0.0, np.nan, np.inf, -1e-30], dtype)
    y = _kernels.exp(x, name, logit=True)
    assert y[0] == 0 and not np.signbit(y[0]) and (y[1:3] == 0).all()
    assert y[3] == 1 and y[4] == 1 and y[7] == 1
    assert np.isnan(y[5]) and np.isposinf(y[6])
    for n in range(1, 19):
        z = np.linspace(-3, 0, n).astype(dtype)
        np.testing.assert_allclose(_kernels.exp(z, name, logit=True), np.exp(z), rtol=4 * np.finfo(dtype).eps)
