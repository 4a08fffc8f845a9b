"""Every public function names itself and the argument in its errors, and the small
helpers around the kernel (show_config, the torch diagnosis, varlen's and merge's
plumbing) do what they say.  Written to kill the mutants mutmut found alive in
_api.py and _config.py (tests/README.md)."""
import io
import platform
import re

import numpy as np
import pytest

import fastattn
from fastattn import _config, reference

from conftest import TOL, rel_err


class NotAnArray:
    """Something np.asarray refuses."""

    def __array__(self, *args, **kwargs):
        raise RuntimeError("no array here")


f32 = np.float32
Q3 = np.ones((2, 5, 8), f32)
CU = np.array([0, 2, 5])
PK = np.ones((5, 2, 8), f32)   # packed (total, H, D)


def _raises(exc, pattern, fn, *args, **kw):
    with pytest.raises(exc) as info:
        fn(*args, **kw)
    assert re.match(pattern, str(info.value)), str(info.value)


# ------------------------------------------------------------------ attention_weights
@pytest.mark.parametrize("kw,exc,pattern", [
    (dict(q=NotAnArray()), TypeError, r"fastattn\.attention_weights: q must be an array .*NotAnArray"),
    (dict(k=NotAnArray()), TypeError, r"fastattn\.attention_weights: k must be an array .*NotAnArray"),
    (dict(causal="x"), ValueError, r"fastattn\.attention_weights: causal must be"),
    (dict(scale="x"), TypeError, r"fastattn\.attention_weights: scale must be a real number"),
    (dict(num_threads=0), ValueError, r"fastattn\.attention_weights: num_threads must be >= 1"),
    (dict(window=(-2, 0)), ValueError, r"fastattn\.attention_weights: window left size"),
    (dict(k=np.ones((2, 5, 7), f32)), ValueError, r"fastattn\.attention_weights: q has D=8 but k has D=7"),
])
def test_attention_weights_errors_name_the_function(kw, exc, pattern):
    args = dict(q=Q3, k=Q3)
    args.update(kw)
    q, k = args.pop("q"), args.pop("k")
    _raises(exc, pattern, fastattn.attention_weights, q, k, **args)


@pytest.mark.parametrize("shape", [(1, 1), (3, 1, 1), (2, 3, 1, 1), (4, 6), (2, 4, 6), (1, 2, 4, 6)])
def test_attention_weights_every_rank(kernel, shape):
    rng = np.random.default_rng(5)
    q = rng.standard_normal(shape).astype(f32)
    k = rng.standard_normal(shape[:-2] + (7, shape[-1])).astype(f32)
    w = fastattn.attention_weights(q, k, causal=True)
    ref = reference.attention_weights(q, k, causal=True)
    assert w.shape == ref.shape == shape[:-1] + (7,)
    assert rel_err(w, ref) <= TOL[np.dtype(f32)]
    np.testing.assert_allclose(w.sum(-1), 1, rtol=1e-6)


def test_attention_weights_single_key_is_one(kernel):
    q = np.full((1, 1), 3.0, f32)
    assert fastattn.attention_weights(q, q).tolist() == [[1.0]]


# ------------------------------------------------------------------ varlen_attention
@pytest.mark.parametrize("kw,exc,pattern", [
    (dict(q=NotAnArray()), TypeError, r"fastattn\.varlen_attention: q must be an array"),
    (dict(k=NotAnArray()), TypeError, r"fastattn\.varlen_attention: k must be an array"),
    (dict(v=NotAnArray()), TypeError, r"fastattn\.varlen_attention: v must be an array"),
    (dict(q=PK[0]), ValueError, r"fastattn\.varlen_attention: q must be 3-D \(total, H, D\), got shape \(2, 8\)"),
    (dict(k=PK[0]), ValueError, r"fastattn\.varlen_attention: k must be 3-D"),
    (dict(v=PK[0]), ValueError, r"fastattn\.varlen_attention: v must be 3-D"),
    (dict(k=PK[..., :7]), ValueError, r"fastattn\.varlen_attention: q has D=8 but k has D=7"),
    (dict(cu_seqlens_q=NotAnArray()), TypeError, r"fastattn\.varlen_attention: cu_seqlens_q must be an array"),
    (dict(cu_seqlens_q=CU.astype(float)), TypeError,
     r"fastattn\.varlen_attention: cu_seqlens_q must be an integer array, got dtype float64"),
    (dict(cu_seqlens_k=CU.astype(float)), TypeError, r"fastattn\.varlen_attention: cu_seqlens_k must be an integer"),
    (dict(cu_seqlens_q=np.array([1, 2, 5])), ValueError,
     r"fastattn\.varlen_attention: cu_seqlens_q must be 1-D, start at 0, be non-decreasing and end at "
     r"the packed length 5; got shape \(3,\): \[1, 2, 5\]"),
    (dict(cu_seqlens_q=np.array([0, 3, 2, 5])), ValueError, r"fastattn\.varlen_attention: cu_seqlens_q must be 1-D"),
    (dict(cu_seqlens_q=np.array([0, 2, 4])), ValueError, r".*end at the packed length 5; got shape \(3,\): \[0, 2, 4\]"),
    (dict(cu_seqlens_q=CU[None]), ValueError, r"fastattn\.varlen_attention: cu_seqlens_q must be 1-D"),
    (dict(cu_seqlens_q=np.array([], int)), ValueError, r"fastattn\.varlen_attention: cu_seqlens_q must be 1-D"),
    (dict(cu_seqlens_k=np.array([0, 5])), ValueError,
     r"fastattn\.varlen_attention: cu_seqlens_q \(3,\) and cu_seqlens_k \(2,\) must have the same length"),
    (dict(causal="x"), ValueError, r"fastattn\.varlen_attention: causal must be"),
    (dict(scale=np.inf), ValueError, r"fastattn\.varlen_attention: scale must be finite"),
    (dict(num_threads=-1), ValueError, r"fastattn\.varlen_attention: num_threads must be >= 1"),
    (dict(return_lse="yes"), TypeError, r"fastattn\.varlen_attention: return_lse must be a bool"),
    (dict(softcap=-1.0), ValueError, r"fastattn\.varlen_attention: softcap must be finite and > 0"),
    (dict(alibi_slopes=np.ones(3)), ValueError, r"fastattn\.varlen_attention: alibi_slopes must have shape \(2,\)"),
])
def test_varlen_errors_name_the_function_and_argument(kw, exc, pattern):
    args = dict(q=PK, k=PK, v=PK, cu_seqlens_q=CU, cu_seqlens_k=CU)
    args.update(kw)
    pos = [args.pop(n) for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")]
    _raises(exc, pattern, fastattn.varlen_attention, *pos, **args)


def test_varlen_cu_seqlens_long_list_is_abbreviated():
    cu = np.arange(0, 60, 2)
    with pytest.raises(ValueError, match=r"got shape \(30,\): \[0, 2, 4, .*, 38\]\.\.\.$"):
        fastattn.varlen_attention(PK, PK, PK, cu, cu)


def test_varlen_returns_lse_only_when_asked(kernel):
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((9, 2, 8)).astype(f32) for _ in range(3))
    cu = np.array([0, 4, 9])
    out = fastattn.varlen_attention(q, k, v, cu, cu, causal=True)
    assert isinstance(out, np.ndarray) and out.shape == (9, 2, 8)
    out2, lse = fastattn.varlen_attention(q, k, v, cu, cu, causal=True, return_lse=True)
    np.testing.assert_array_equal(out, out2)
    ref, ref_lse = reference.varlen_attention(q, k, v, cu, cu, causal=True, return_lse=True)
    assert rel_err(out, ref) <= TOL[np.dtype(f32)] and lse.shape == (2, 9)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_varlen_no_sequences_and_empty_sequences(kernel):
    cu0 = np.array([0])
    empty = np.zeros((0, 2, 8), f32)
    out, lse = fastattn.varlen_attention(empty, empty, empty, cu0, cu0, return_lse=True)
    assert out.shape == (0, 2, 8) and lse.shape == (2, 0)
    q = np.ones((3, 2, 8), f32)
    out, lse = fastattn.varlen_attention(q, q[:0], q[:0], np.array([0, 3]), np.array([0, 0]),
                                         return_lse=True)
    assert (out == 0).all() and np.isneginf(lse).all()   # a sequence with no keys


# ------------------------------------------------------------------ merge
O = np.ones((3, 4), f32)
L = np.zeros(3, f32)


@pytest.mark.parametrize("outs,lses,kw,exc,pattern", [
    ([], [], {}, ValueError, r"fastattn\.merge: outs and lses must be non-empty and of equal length, got 0 outs and 0 lses"),
    ([O, O], [L], {}, ValueError, r"fastattn\.merge: outs and lses must be non-empty .* got 2 outs and 1 lses"),
    ([O, NotAnArray()], [L, L], {}, TypeError, r"fastattn\.merge: outs\[1\] must be an array"),
    ([O, O], [L, NotAnArray()], {}, TypeError, r"fastattn\.merge: lses\[1\] must be an array"),
    ([O.astype(np.float16)], [L.astype(np.float16)], {}, TypeError, r"fastattn\.merge: outs and lses must be float32 or float64, got \['float16'\]"),
    ([O.astype(complex)], [L], {}, TypeError, r"fastattn\.merge: outs and lses must be float32 or float64, got \['complex128', 'float32'\]"),
    ([O, O[:2]], [L, L[:2]], {}, ValueError,
     r"fastattn\.merge: outs\[1\] \(2, 4\) and lses\[1\] \(2,\) must have the shape of outs\[0\] \(3, 4\) and \(3,\) \(outs\[0\]\.shape\[:-1\], layout='bhsd'\)"),
    ([O, O], [L, L[:2]], {}, ValueError, r"fastattn\.merge: outs\[1\] \(3, 4\) and lses\[1\] \(2,\)"),
    ([O], [L], dict(layout="sbhd"), ValueError, r"fastattn\.merge: layout must be 'bhsd' or 'bshd', got 'sbhd'"),
])
def test_merge_errors(outs, lses, kw, exc, pattern):
    _raises(exc, pattern, fastattn.merge, outs, lses, **kw)


def test_merge_dtypes_and_order():
    rng = np.random.default_rng(4)
    o = [rng.standard_normal((2, 3, 5, 4)) for _ in range(3)]
    lse = [rng.standard_normal((2, 3, 5)) for _ in range(3)]
    lse[1][0, 0, 0] = -np.inf
    out, l_ = fastattn.merge(o, lse)
    assert out.dtype == np.float64 and out.shape == (2, 3, 5, 4) and l_.shape == (2, 3, 5)
    r_out, r_lse = reference.merge(o, lse)
    np.testing.assert_allclose(out, r_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(l_, r_lse, rtol=1e-12)
    out32, _ = fastattn.merge([a.astype(f32) for a in o], [a.astype(f32) for a in lse])
    assert out32.dtype == f32
    np.testing.assert_allclose(out32, r_out, rtol=1e-5, atol=1e-5)
    # bshd parts: the same rows, lse (.., H, L) as attention returns it
    out_s, lse_s = fastattn.merge([a.swapaxes(1, 2) for a in o], lse, layout="bshd")
    np.testing.assert_array_equal(out_s, out.swapaxes(1, 2))
    np.testing.assert_array_equal(lse_s, l_)
    assert lse_s.flags.c_contiguous


# ------------------------------------------------------------------ torch diagnosis
def test_torch_diagnosis_of_each_cause():
    torch = pytest.importorskip("torch")
    q = torch.randn(2, 5, 8)
    cases = [
        (torch.empty(2, 5, 8, device="meta"), r"fastattn\.attention: k is a torch tensor on device 'meta'; "
                                              r"fastattn runs on the CPU: pass k\.cpu\(\)$"),
        (torch.randn(2, 5, 8, requires_grad=True), r"fastattn\.attention: k is a torch tensor that requires "
                                                  r"grad; the NumPy API does not record gradients: pass k\.detach\(\) \(gradients: "
                                                  r"fastattn\.torch\.scaled_dot_product_attention, or "
                                                  r"fastattn\.attention_backward\)$"),
        (q.bfloat16(), r"fastattn\.attention: k is a torch tensor of dtype torch\.bfloat16; supported dtypes "
                       r"are float32 and float64 \(and float16 for k and v\): convert it, e\.g\. k\.float\(\)$"),
    ]
    for k, pattern in cases:
        _raises(TypeError, pattern, fastattn.attention, q, k, q)
    # the same diagnosis in the other functions, naming them
    _raises(TypeError, r"fastattn\.attention_weights: q is a torch tensor that requires grad",
            fastattn.attention_weights, torch.randn(2, 5, 8, requires_grad=True), q)
    _raises(TypeError, r"fastattn\.merge: lses\[0\] is a torch tensor of dtype torch\.bfloat16",
            fastattn.merge, [np.ones((5, 8), f32)], [torch.zeros(5, dtype=torch.bfloat16)])


def test_not_torch_and_not_an_array():
    _raises(TypeError, r"fastattn\.attention: v must be an array \(or something NumPy can view as "
                       r"one\), got NotAnArray: no array here$", fastattn.attention, Q3, Q3, NotAnArray())


# ------------------------------------------------------------------ show_config
@pytest.mark.parametrize("n,text", [(48 * 1024, "48 KiB"), (512 * 1024, "512 KiB"), (2**20, "1 MiB"),
                                    (2 * 2**20, "2 MiB"), (5 * 2**19, "2560 KiB"), (1023 * 1024, "1023 KiB"),
                                    (3 * 2**20 + 1024, "3073 KiB")])
def test_size_text(n, text):
    assert _config._size(n) == text


def test_config_facts():
    c = _config.config()
    assert c["python"] == platform.python_version()
    assert c["numpy"] == np.__version__ and c["fastattn"] == fastattn.__version__
    assert c["machine"] == platform.machine()
    assert c["kernels_supported"][0] == "generic" and c["kernel"] in c["kernels_supported"]


def test_show_config_writes_to_the_file_given(capsys, monkeypatch):
    buf = io.StringIO()
    fastattn.show_config(file=buf)
    assert capsys.readouterr().out == ""
    text = buf.getvalue()
    c = _config.config()
    assert f"  can run:  {', '.join(c['kernels_supported'])}  (FASTATTN" in text
    assert ("  openmp:   yes\n" if c["openmp"] else "  openmp:   no (serial kernel)\n") in text
    fastattn.show_config()
    assert capsys.readouterr().out == text
    monkeypatch.setattr(_config, "config", lambda: dict(c, openmp=False, kernels_supported=["generic", "x"]))
    buf = io.StringIO()
    fastattn.show_config(file=buf)
    assert "  openmp:   no (serial kernel)\n" in buf.getvalue()
    assert "  can run:  generic, x  (FASTATTN" in buf.getvalue()


def test_merge_mixed_dtypes_promote():
    """float32 parts with float64 lses merge in float64 (np.result_type of all)."""
    rng = np.random.default_rng(8)
    o = [rng.standard_normal((3, 5, 4)).astype(f32) for _ in range(2)]
    lse = [rng.standard_normal((3, 5)) for _ in range(2)]
    out, l_ = fastattn.merge(o, lse)
    assert out.dtype == l_.dtype == np.float64
    r_out, r_lse = reference.merge(o, lse)
    np.testing.assert_allclose(out, r_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(l_, r_lse, rtol=1e-12)


def test_merge_single_row_parts():
    """1-D parts: one row of Dv values each, lse a 0-d array."""
    o = [np.array([1.0, 2.0]), np.array([3.0, 6.0])]
    lse = [np.array(0.0), np.array(np.log(3.0))]
    out, l_ = fastattn.merge(o, lse)
    np.testing.assert_allclose(out, [2.5, 5.0])
    np.testing.assert_allclose(l_, np.log(4.0))


def test_merge_bshd_error_says_where_lse_axes_go():
    o = np.ones((2, 5, 3, 4), f32)
    with pytest.raises(ValueError, match=r"\(2, 3, 5\) \(\(\.\.\., Hq, Lq\) for outs \(\.\.\., Lq, Hq, Dv\), "
                                         r"layout='bshd'\)"):
        fastattn.merge([o], [np.ones((2, 5, 3), f32)], layout="bshd")


@pytest.mark.parametrize("dtype", [np.int32, np.uint16, np.int64])
def test_varlen_any_integer_cu_seqlens(kernel, dtype):
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((9, 2, 8)).astype(f32) for _ in range(3))
    cu = np.array([0, 4, 9], dtype)
    out = fastattn.varlen_attention(q, k, v, cu, cu, causal=True)
    ref = reference.varlen_attention(q, k, v, cu, cu, causal=True)
    assert rel_err(out, ref) <= TOL[np.dtype(f32)]


@pytest.mark.parametrize("n,shown", [(20, "[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]"),
                                     (21, "[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]...")])
def test_varlen_cu_seqlens_shown_up_to_20(n, shown):
    cu = np.arange(1, n + 1)
    with pytest.raises(ValueError) as info:
        fastattn.varlen_attention(PK, PK, PK, cu, cu)
    assert str(info.value).endswith(f"got shape ({n},): {shown}")
