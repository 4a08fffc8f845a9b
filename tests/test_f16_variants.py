"""float16 K/V (with float32 or float16 q) combined with every variant, layout, GQA,
decode (split-KV) and prefill shapes, against the float64 oracle.

The oracle reads the very same float16 values and computes in float64, so the only
error left is the kernel's float32 arithmetic (and, for float16 q, the final rounding
of the output to float16): the tolerances are tight, so a variant that is plumbed
slightly wrong for float16 K/V (a slope, a bias, a window edge, an axis) fails.
"""
import functools
import zlib

import numpy as np
import pytest

import fastattn
from fastattn import reference

from conftest import CACHES16, assert_lse_close, rel_err

F32_TOL = 3e-5  # float32 output: relative to max |ref|, as for float32 inputs

# (B, Hq, Hkv, Lq, Lk, D, Dv, layout, ndim)
SHAPES = {
    # decode: Lq <= 8 and Lk > 512 take the split-KV path; Lk = 300 is one chunk
    "decode1-gqa-bhsd": (2, 6, 2, 1, 700, 64, 64, "bhsd", 4),
    "decode4-gqa-bshd": (2, 8, 2, 4, 1000, 40, 24, "bshd", 4),
    "decode2-mqa-bshd-3d": (1, 4, 1, 2, 613, 32, 48, "bshd", 3),
    "decode3-bhsd-3d": (1, 3, 3, 3, 300, 24, 24, "bhsd", 3),
    # prefill: Lq = Lk, odd D / Dv
    "prefill-gqa-bhsd": (1, 4, 2, 150, 150, 33, 20, "bhsd", 4),
    "prefill-gqa-bshd": (2, 6, 3, 131, 131, 17, 19, "bshd", 4),
    "prefill-2d": (1, 1, 1, 123, 123, 45, 45, "bhsd", 2),
}


def _variant(name, rng, nd, B, Hq, Lq, Lk):
    full = (B, Hq, Lq, Lk)[4 - nd:]
    mask = rng.random(full) > 0.4
    mask[..., -1] = True
    return {
        "plain": dict(),
        "alibi-h": dict(alibi_slopes=rng.uniform(0.02, 0.5, Hq)),
        "alibi-h-f16": dict(alibi_slopes=rng.uniform(0.02, 0.5, Hq).astype(np.float16)),
        "alibi-bh": dict(alibi_slopes=rng.uniform(0.02, 0.5, (B, Hq))),
        "softcap": dict(softcap=1.5, scale=1.3),
        "bias-bcast": dict(bias=rng.standard_normal(Lk).astype(np.float32)),
        "bias-full": dict(bias=2 * rng.standard_normal(full).astype(np.float32)),
        "bias-f16-head": dict(bias=rng.standard_normal((Hq, 1, Lk) if nd > 2 else (1, Lk))
                              .astype(np.float16)),
        "mask": dict(mask=mask),
        "mask-bcast-neginf-bias": dict(mask=rng.random(Lk) > 0.2,
                                       bias=np.where(rng.random((Lq, Lk)) > 0.9, -np.inf, 0.0)),
        "causal-br": dict(causal="bottom-right"),
        "causal-tl": dict(causal="top-left"),
        "window": dict(window=(37, 1)),
        "window-causal-tl": dict(window=(50, None), causal="top-left"),
        "everything": dict(causal=True, window=(200, 0), mask=mask, softcap=3.0,
                           alibi_slopes=rng.uniform(0.01, 0.1, (B, Hq) if nd == 4 else Hq),
                           bias=rng.standard_normal(full[-2:]).astype(np.float32), scale=0.7),
    }[name]


VARIANTS = ["plain", "alibi-h", "alibi-h-f16", "alibi-bh", "softcap", "bias-bcast", "bias-full",
            "bias-f16-head", "mask", "mask-bcast-neginf-bias", "causal-br", "causal-tl", "window",
            "window-causal-tl", "everything"]


def _qkv(rng, B, Hq, Hkv, Lq, Lk, D, Dv, layout, nd, q_dtype):
    def mk(H, L, d, dt):
        a = rng.standard_normal((B, H, L, d))
        a = a[0, 0] if nd == 2 else (a[0] if nd == 3 else a)
        if layout == "bshd" and nd > 2:
            a = a.swapaxes(-2, -3)   # a strided (B, L, H, d) view: read in place
        return a.astype(dt)
    return mk(Hq, Lq, D, q_dtype), mk(Hkv, Lk, D, np.float16), mk(Hkv, Lk, Dv, np.float16)


def assert_f16_output_close(out, ref):
    """float16 output: within half a float16 ulp of the exact answer (plus the float32
    arithmetic's error, a few 1e-5 of the largest output)."""
    assert out.dtype == np.float16
    ref = np.asarray(ref, np.float64)
    err = np.abs(out.astype(np.float64) - ref)
    ulp = np.spacing(np.abs(ref).astype(np.float16)).astype(np.float64)
    allowed = 0.5 * ulp + 3e-5 * max(np.abs(ref).max(), 1e-30)
    worst = np.unravel_index(np.argmax(err - allowed), err.shape)
    assert (err <= allowed).all(), (f"at {worst}: got {out[worst]}, want {ref[worst]}, "
                                    f"|err| {err[worst]:.3g} > {allowed[worst]:.3g}")


@functools.lru_cache(maxsize=None)
def _case(variant, shape, q_dtype):
    """Inputs and the oracle's answer, computed once and shared by every kernel (the
    oracle is most of this file's run time); arrays are made read-only."""
    B, Hq, Hkv, Lq, Lk, D, Dv, layout, nd = SHAPES[shape]
    rng = np.random.default_rng(zlib.crc32(f"{variant}/{shape}/{q_dtype}".encode()))
    q, k, v = _qkv(rng, B, Hq, Hkv, Lq, Lk, D, Dv, layout, nd, q_dtype)
    kw = _variant(variant, rng, nd, B, Hq, Lq, Lk)
    kw["layout"] = layout
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, **kw)
    for a in (q, k, v, ref_out, ref_lse, *kw.values()):
        if isinstance(a, np.ndarray):
            a.flags.writeable = False
    return q, k, v, kw, ref_out, ref_lse


# (B, Hq) slopes exist only for 4-D inputs: those pairs are not generated
CASES = [(v, s) for v in VARIANTS for s in SHAPES if not (v == "alibi-bh" and SHAPES[s][-1] != 4)]


@pytest.mark.parametrize("q_dtype", [np.float32, np.float16], ids=["q32", "q16"])
@pytest.mark.parametrize("variant,shape", CASES, ids=[f"{v}-{s}" for v, s in CASES])
def test_f16_kv_variant_against_oracle(kernel, variant, shape, q_dtype):
    B, Hq, Hkv, Lq, Lk, D, Dv, layout, nd = SHAPES[shape]
    q, k, v, kw, ref_out, ref_lse = _case(variant, shape, q_dtype)

    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    assert out.dtype == q_dtype and out.shape == ref_out.shape
    assert lse.dtype == np.float32
    assert lse.shape == ref_lse.shape == ((B, Hq, Lq)[4 - nd:] if nd > 2 else (Lq,))
    if q_dtype == np.float16:
        assert_f16_output_close(out, ref_out)
    else:
        err = rel_err(out, ref_out)
        assert err <= F32_TOL, err
    assert_lse_close(lse, ref_lse, np.float32)

    # without lse (and, for the plain case, the compiled fast path): the same bits
    np.testing.assert_array_equal(fastattn.attention(q, k, v, **kw), out)


@pytest.mark.parametrize("q_dtype", [np.float32, np.float16], ids=["q32", "q16"])
def test_f16_kv_matches_f32_kv_computation(kernel, rng, q_dtype):
    """float16 K/V is converted to float32 in registers: the answer equals that of the
    same values passed as float32 K/V (to float32 rounding), for every variant at once,
    on the split-KV path and the prefill path."""
    for shape in ("decode4-gqa-bshd", "prefill-gqa-bshd"):
        B, Hq, Hkv, Lq, Lk, D, Dv, layout, nd = SHAPES[shape]
        q, k, v = _qkv(rng, B, Hq, Hkv, Lq, Lk, D, Dv, layout, nd, q_dtype)
        kw = _variant("everything", rng, nd, B, Hq, Lq, Lk)
        out16, lse16 = fastattn.attention(q, k, v, layout=layout, return_lse=True, **kw)
        out32, lse32 = fastattn.attention(q.astype(np.float32), k.astype(np.float32),
                                          v.astype(np.float32), layout=layout, return_lse=True,
                                          **kw)
        if q_dtype == np.float16:
            assert_f16_output_close(out16, out32)
        else:
            assert rel_err(out16, out32) <= F32_TOL
        assert_lse_close(lse16, lse32.astype(np.float64), np.float32)


def test_f16_kv_thread_counts_bitwise(kernel, rng):
    B, Hq, Hkv, Lq, Lk, D, Dv, layout, nd = SHAPES["decode4-gqa-bshd"]
    q, k, v = _qkv(rng, B, Hq, Hkv, Lq, Lk, D, Dv, layout, nd, np.float16)
    kw = _variant("everything", rng, nd, B, Hq, Lq, Lk)
    base = fastattn.attention(q, k, v, layout=layout, return_lse=True, num_threads=1, **kw)
    for n in (2, 3):
        got = fastattn.attention(q, k, v, layout=layout, return_lse=True, num_threads=n, **kw)
        np.testing.assert_array_equal(got[0], base[0])
        np.testing.assert_array_equal(got[1], base[1])


def test_every_float16_value_reads_exactly(kernel):
    """Each of the 65536 float16 bit patterns, as a V value seen through one visible key
    (weight exactly 1, Lk = 1) by a 16-row prefill block, comes out as its exact float32
    value (NumPy's conversion): the 16-bit tile conversion (fa_tile_f32, on the generic
    kernel the branch-free fa_half_to_float) loses nothing, subnormals and the largest
    values included (-0 comes out +0: the sum starts at +0); inf and NaN in V give inf
    and NaN (the careful P.V)."""
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    h = bits.view(np.float16)
    finite = np.isfinite(h)
    for vals in (h[finite], h[~finite]):
        n = -(-vals.size // 64) * 64
        v = np.zeros(n, np.float16)
        v[:vals.size] = vals
        v = v.reshape(n // 64, 1, 1, 64)         # (B, Hkv, Lk=1, Dv=64)
        k = np.ones((n // 64, 1, 1, 8), np.float16)
        q = np.ones((n // 64, 1, 16, 8), np.float32)
        out = fastattn.attention(q, k, v)
        want = np.broadcast_to(v.astype(np.float32), out.shape)
        same = (out == want) | (np.isnan(out) & np.isnan(want))
        assert same.all(), (kernel, np.flatnonzero(~same.ravel())[:5])


@pytest.mark.parametrize("Lq", [1, 70])
def test_float16_output_rounds_to_nearest_even(kernel, rng, Lq):
    """A float16 q gives a float16 output: the float32 result (the same values passed
    as float32 give it bit for bit) rounded to nearest even exactly as NumPy rounds it,
    in every column: magnitudes from float16's subnormals to its largest values, a row
    length that leaves a partial group of 8, and rows made NaN by a NaN in V (sign |
    0x7e00, as NumPy writes that NaN).  The kernels with F16C convert 8 at a time."""
    B, H, Lk, D, Dv = 2, 3, 90, 24, 45
    q = rng.standard_normal((B, H, Lq, D)).astype(np.float16)
    k = rng.standard_normal((B, H, Lk, D)).astype(np.float16)
    expo = np.linspace(-26, 15.9, Dv)              # column c holds values near 2^expo[c]
    v = (rng.uniform(0.5, 1.0, (B, H, Lk, Dv)) * rng.choice([-1, 1], (B, H, Lk, Dv))
         * np.exp2(expo)).astype(np.float16)
    v[1, 2, 7, 3] = np.nan                         # every row of (1, 2) sees key 7
    out = fastattn.attention(q, k, v)
    assert out.dtype == np.float16
    out32 = fastattn.attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32))
    want = out32.astype(np.float16)
    assert np.isnan(out[1, 2, :, 3]).all() and np.isnan(want[1, 2, :, 3]).all()
    assert (np.abs(want[..., :5]) < np.float16(2.0 ** -14)).any()  # subnormal outputs
    np.testing.assert_array_equal(out.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("kv_dtype", CACHES16)
def test_f16_kv_blocks_shared_across_query_blocks(kernel, rng, kv_dtype):
    """A prefill whose heads have several query blocks converts each whole 16-bit key
    block to float32 once a call, for all of them (fa_f32_shared; the first item to reach
    a block converts it, the others read it, or convert their own while it is being
    converted): the output has the bits of the same values passed as float32 K/V, on 1-3
    threads, causal or not, GQA, with an inf and a NaN in V (a whole shared block's and
    the last, partial block's), and the rows a chunked prefill computes have them too."""
    q = rng.standard_normal((1, 4, 700, 40)).astype(np.float32)
    k = rng.standard_normal((1, 2, 700, 40)).astype(kv_dtype)
    v = rng.standard_normal((1, 2, 700, 24)).astype(kv_dtype)
    v[0, 1, 300, 5] = np.inf
    v[0, 0, 650, 0] = np.nan
    k32, v32 = k.astype(np.float32), v.astype(np.float32)
    for causal in (False, True):
        want = fastattn.attention(q, k32, v32, causal=causal, num_threads=1)
        assert np.isnan(want).any() and np.isinf(want).any()
        for n in (1, 2, 3):
            np.testing.assert_array_equal(fastattn.attention(q, k, v, causal=causal, num_threads=n), want)
    part = fastattn.attention(q[:, :, 250:], k, v, causal=True, q_offset=250, num_threads=2)
    np.testing.assert_array_equal(part, want[:, :, 250:])
