"""fastattn.attention against the float64 oracle, under every CPU kernel."""
import numpy as np
import pytest

import fastattn
from fastattn import reference

from conftest import TOL, assert_lse_close, rel_err

DS = [1, 3, 16, 17, 64, 80, 128, 256]
# (Lq, Lk): ones, lengths that are no multiple of any block (blocks are 32/64 rows,
# 128 keys), Lq < Lk and Lq > Lk.
LENGTHS = [(1, 1), (1, 300), (300, 1), (5, 9), (65, 129), (129, 65), (200, 200)]
CAUSAL = [False, True, "bottom-right", "top-left"]


def _inputs(rng, shape_q, shape_k, Dv, dtype):
    q = rng.standard_normal(shape_q).astype(dtype)
    k = rng.standard_normal(shape_k).astype(dtype)
    v = rng.standard_normal(shape_k[:-1] + (Dv,)).astype(dtype)
    return q, k, v


def _check(q, k, v, **kw):
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, **kw)
    assert out.dtype == q.dtype and out.shape == ref_out.shape
    assert lse.dtype == q.dtype and lse.shape == ref_lse.shape
    assert rel_err(out, ref_out) <= TOL[q.dtype], rel_err(out, ref_out)
    assert_lse_close(lse, ref_lse, q.dtype)
    return out, lse


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("D", DS)
@pytest.mark.parametrize("Lq,Lk", LENGTHS)
def test_sizes_all_causal_modes(kernel, rng, dtype, D, Lq, Lk):
    Dv = D if D % 2 else D + 3  # Dv != D half the time, odd Dv for the SIMD tails
    q, k, v = _inputs(rng, (1, 2, Lq, D), (1, 2, Lk, D), Dv, dtype)
    for causal in CAUSAL:
        _check(q, k, v, causal=causal)


# The planner's largest query blocks and its padded row strides (fa_make_plan): 768
# rows are two blocks of 384 on AVX2 (a 1536-byte float32 stride, padded by a vector),
# 769 three of 257, 256 one block whose float32 stride (1 KiB) is padded, 128 float64
# rows likewise; the rows of a block are read only up to its own count, never into the
# padding, and a row's bits do not depend on the rows beside it.
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("D", [17, 64])
@pytest.mark.parametrize("Lq,Lk", [(768, 768), (769, 700), (256, 256), (128, 300)])
def test_large_and_padded_blocks(kernel, rng, dtype, D, Lq, Lk):
    q, k, v = _inputs(rng, (1, 2, Lq, D), (1, 2, Lk, D), D, dtype)
    for causal in (False, True):
        out, lse = _check(q, k, v, causal=causal)
        for thr in (1, 2):
            part = fastattn.attention(q[:, :, 100:137], k, v, num_threads=thr)
            if not causal:
                assert np.array_equal(part, out[:, :, 100:137])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("scale", [0.0, -0.7, 0.01, 3.0])
def test_scale_override(kernel, rng, dtype, scale):
    q, k, v = _inputs(rng, (2, 70, 24), (2, 90, 24), 24, dtype)
    out, _ = _check(q, k, v, scale=scale, causal=True)
    if scale == 0.0:  # all logits equal: the mean of the visible values
        for i in range(70):
            np.testing.assert_allclose(out[:, i], v[:, : i + 21].astype(np.float64).mean(axis=1),
                                       rtol=TOL[np.dtype(dtype)] * 10, atol=TOL[np.dtype(dtype)] * 10)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_2d_3d_4d(kernel, rng, dtype):
    q, k, v = _inputs(rng, (2, 3, 33, 20), (2, 3, 47, 20), 12, dtype)
    out4 = _check(q, k, v, causal="top-left")[0]
    out3 = _check(q[1], k[1], v[1], causal="top-left")[0]
    out2 = _check(q[1, 2], k[1, 2], v[1, 2], causal="top-left")[0]
    np.testing.assert_array_equal(out3, out4[1])
    np.testing.assert_array_equal(out2, out4[1, 2])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gqa(kernel, rng, dtype):
    q, k, v = _inputs(rng, (2, 8, 40, 16), (2, 2, 50, 16), 16, dtype)
    out = _check(q, k, v, causal=True)[0]
    rep = fastattn.attention(q, np.repeat(k, 4, axis=1), np.repeat(v, 4, axis=1), causal=True)
    np.testing.assert_array_equal(out, rep)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_strided_views_used_in_place(kernel, rng, dtype):
    """Slices of a fused QKV projection (B, L, 3, H, D), transposed to (B, H, L, D)."""
    B, L, H, D = 2, 77, 3, 40
    qkv = rng.standard_normal((B, L, 3, H, D)).astype(dtype)
    q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    assert not q.flags.c_contiguous and q.strides[-1] == q.itemsize
    out, _ = _check(q, k, v, causal=True)
    dense = fastattn.attention(*(np.ascontiguousarray(a) for a in (q, k, v)), causal=True)
    np.testing.assert_array_equal(out, dense)
    # every other key, every other head (strides that skip), a reversed query axis
    _check(q[:, ::2, ::-1], k[:, ::2, ::2], v[:, ::2, ::2])
    # a non-contiguous last axis is copied, not misread
    _check(q[..., ::2], k[..., ::2], v[..., ::3])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_out_argument(kernel, rng, dtype):
    q, k, v = _inputs(rng, (2, 19, 8), (2, 23, 8), 5, dtype)
    buf = np.full((2, 19, 10), np.nan, dtype)
    out = buf[:, :, 2:7]  # strided destination
    res = fastattn.attention(q, k, v, out=out)
    assert res is out
    np.testing.assert_array_equal(out, fastattn.attention(q, k, v))
    assert np.isnan(buf[:, :, :2]).all() and np.isnan(buf[:, :, 7:]).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fully_masked_rows(kernel, rng, dtype):
    """Bottom-right causal with Lq > Lk: the first Lq - Lk rows see no key."""
    q, k, v = _inputs(rng, (2, 150, 16), (2, 40, 16), 16, dtype)
    out, lse = _check(q, k, v, causal=True)
    assert (out[:, :110] == 0).all() and np.isneginf(lse[:, :110]).all()
    assert np.isfinite(lse[:, 110:]).all()
    out, lse = fastattn.attention(q, k[:, :0], v[:, :0], return_lse=True)  # Lk = 0
    assert (out == 0).all() and np.isneginf(lse).all()
    # Lk = 0 and Dv = 0 together (found by the fuzz test): only lse is left to write
    out, lse = fastattn.attention(q, k[:, :0], v[:, :0, :0], return_lse=True, window=(3, None))
    assert out.shape == (2, 150, 0) and np.isneginf(lse).all() and lse.shape == (2, 150)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_empty(kernel, dtype):
    z = np.zeros((2, 0, 8), dtype)
    out, lse = fastattn.attention(z, np.zeros((2, 5, 8), dtype), np.zeros((2, 5, 3), dtype),
                                  return_lse=True)
    assert out.shape == (2, 0, 3) and lse.shape == (2, 0)
    assert fastattn.attention(np.zeros((0, 4, 8), dtype), np.zeros((0, 4, 8), dtype),
                              np.zeros((0, 4, 8), dtype)).shape == (0, 4, 8)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_zero_feature_sizes(rng, dtype):
    q, k, v = _inputs(rng, (2, 6, 0), (2, 9, 0), 4, dtype)
    _check(q, k, v, causal=True)
    q, k, v = _inputs(rng, (2, 6, 5), (2, 9, 5), 0, dtype)
    out, lse = _check(q, k, v)
    assert out.shape == (2, 6, 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_large_logits_stay_finite(kernel, rng, dtype):
    """|s| ~ 1e4: the running max keeps every exp in range."""
    q, k, v = _inputs(rng, (2, 100, 16), (2, 300, 16), 16, dtype)
    q *= 100
    k *= 100
    out, lse = _check(q, k, v, scale=1.0)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    assert np.max(np.abs(lse)) > 1e3


def test_kernels_agree(rng):
    """Every kernel this CPU runs gives the oracle's answer, so they agree with each
    other to the oracle tolerance."""
    from fastattn import _kernels
    q, k, v = _inputs(rng, (1, 4, 333, 72), (1, 4, 257, 72), 72, np.float32)
    before = _kernels.current_kernel()
    outs = {}
    try:
        for name in _kernels.supported_kernels():
            _kernels.set_kernel(name)
            outs[name] = fastattn.attention(q, k, v, causal=True)
    finally:
        _kernels.set_kernel(before)
    base = outs["generic"]
    for name, o in outs.items():
        assert rel_err(o, base) <= 2 * TOL[np.dtype(np.float32)], name


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("block_q,block_k", [(1, 1), (8, 7), (16, 300), (48, 33), (200, 64), (1000, 5)])
def test_any_block_sizes(kernel, rng, dtype, block_q, block_k):
    """The micro-kernels are right for any block sizes the driver may choose (block_q
    is rounded up to the vector width): the private hook used for tuning."""
    from fastattn import _kernels
    q, k, v = _inputs(rng, (2, 2, 203, 19), (2, 2, 171, 19), 21, dtype)
    for causal in (0, 1, 2):
        out = np.empty(q.shape[:-1] + (21,), dtype)
        lse = np.empty(q.shape[:-1], dtype)
        assert _kernels.forward(q, k, v, out, lse, 0.3, causal, 2, block_q, block_k)
        mode = [False, "bottom-right", "top-left"][causal]
        ref_out, ref_lse = reference.attention(q, k, v, scale=0.3, causal=mode, return_lse=True)
        assert rel_err(out, ref_out) <= TOL[np.dtype(dtype)]
        assert_lse_close(lse, ref_lse, dtype)
