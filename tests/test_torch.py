"""fastattn.torch: the registered ops (opcheck), autograd (gradcheck, and against
PyTorch's SDPA), torch.compile without graph breaks, sdpa_kernel() routing and its
fallbacks, training a small GPT with and without it, zero copies, errors."""
import contextlib
import importlib
import math
import os
import sys
import tracemalloc

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fastattn  # noqa: E402
import fastattn.torch as ft  # noqa: E402

F = torch.nn.functional
TORCH_SDPA = F.scaled_dot_product_attention  # PyTorch's own, saved before any routing
F64, F32 = torch.float64, torch.float32
TOL = {F32: 1e-5, F64: 1e-10}  # relative to max |reference|, as the issue asks


@pytest.fixture(autouse=True)
def _restore_routing():
    """Every test starts and ends with PyTorch's own function in place."""
    assert F.scaled_dot_product_attention is TORCH_SDPA
    yield
    ft.disable()
    assert F.scaled_dot_product_attention is TORCH_SDPA


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    if b.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / max(float(b.abs().max()), 1e-300))


def randn(*shape, dtype=F64, grad=False, seed=None):
    g = None if seed is None else torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=dtype, generator=g).requires_grad_(grad)


def qkv(B=1, Hq=2, Hkv=None, Lq=5, Lk=7, D=4, Dv=None, dtype=F64, grad=True, seed=0):
    Hkv, Dv = Hkv or Hq, Dv or D
    return (randn(B, Hq, Lq, D, dtype=dtype, grad=grad, seed=seed),
            randn(B, Hkv, Lk, D, dtype=dtype, grad=grad, seed=seed + 1),
            randn(B, Hkv, Lk, Dv, dtype=dtype, grad=grad, seed=seed + 2))


# ---------------------------------------------------------------------------------------
# the module and the ops

def test_import_without_torch_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # "import torch" now raises ImportError
    monkeypatch.delitem(sys.modules, "fastattn.torch")
    with pytest.raises(ImportError, match=r"fastattn\.torch needs PyTorch: pip install torch==2\.13\.0"):
        importlib.import_module("fastattn.torch")
    importlib.import_module("fastattn")  # the core never needs torch


def test_ops_are_registered():
    assert isinstance(torch.ops.fastattn.attention_fwd.default, torch._ops.OpOverload)
    assert isinstance(torch.ops.fastattn.attention_bwd.default, torch._ops.OpOverload)


def _fwd_args(q, k, v, mask=None, bias=None, alibi=None, scale=0.5, causal=0, window=(-1, -1),
              softcap=0.0, dropout_p=0.0, seed=None):
    return (q, k, v, mask, bias, alibi, scale, causal, window[0], window[1], softcap,
            dropout_p, seed)


def test_opcheck_forward():
    q, k, v = qkv(B=2, Hq=4, Hkv=2, Lq=5, Lk=7)
    bias = randn(5, 7, grad=True, seed=9)
    torch.library.opcheck(torch.ops.fastattn.attention_fwd,
                          _fwd_args(q, k, v, bias=bias, causal=1, window=(3, -1)))
    mask = torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(1)) > 0.3
    torch.library.opcheck(torch.ops.fastattn.attention_fwd,
                          _fwd_args(q, k, v, mask=mask, alibi=torch.rand(4, dtype=F64), causal=2,
                                    softcap=3.0, dropout_p=0.25, seed=torch.tensor(123)))
    q3, k3, v3 = (t[0].detach().float() for t in qkv(Lq=6, Lk=6, Dv=3))  # 3-D, float32
    torch.library.opcheck(torch.ops.fastattn.attention_fwd, _fwd_args(q3, k3, v3))


def test_opcheck_backward():
    q, k, v = (t.detach() for t in qkv(B=2, Hq=4, Hkv=2))
    bias = randn(1, 4, 5, 7, seed=5)
    out, lse = torch.ops.fastattn.attention_fwd(*_fwd_args(q, k, v, bias=bias, causal=1))
    dout = randn(*out.shape, seed=6)
    torch.library.opcheck(torch.ops.fastattn.attention_bwd,
                          (dout, q, k, v, out, lse, None, bias, None, 0.5, 1, -1, -1, 0.0, 0.0,
                           None, True))


def test_op_matches_the_numpy_api():
    q, k, v = (t.detach() for t in qkv(B=2, Hq=4, Hkv=2))
    mask = torch.rand(5, 7, generator=torch.Generator().manual_seed(2)) > 0.2
    out, lse = torch.ops.fastattn.attention_fwd(
        *_fwd_args(q, k, v, mask=mask, causal=2, window=(2, 1), softcap=2.0, dropout_p=0.1,
                   seed=torch.tensor(77)))
    ref, ref_lse = fastattn.attention(q.numpy(), k.numpy(), v.numpy(), mask=mask.numpy(),
                                      scale=0.5, causal="top-left", window=(2, 1), softcap=2.0,
                                      dropout_p=0.1, seed=77, return_lse=True)
    np.testing.assert_array_equal(out.numpy(), ref)
    np.testing.assert_array_equal(lse.numpy(), ref_lse)
    dout = randn(*out.shape, seed=3)
    got = torch.ops.fastattn.attention_bwd(dout, q, k, v, out, lse, mask, None, None, 0.5, 2, 2,
                                           1, 2.0, 0.1, torch.tensor(77), False)
    want = fastattn.attention_backward(dout.numpy(), q.numpy(), k.numpy(), v.numpy(), ref, ref_lse,
                                       mask=mask.numpy(), scale=0.5, causal="top-left",
                                       window=(2, 1), softcap=2.0, dropout_p=0.1, seed=77)
    for g, w in zip(got[:3], want):
        np.testing.assert_array_equal(g.numpy(), w)
    assert got[3].numel() == 0  # no dbias asked for


# ---------------------------------------------------------------------------------------
# gradients: gradcheck in float64 on every variant

def _seeded(fn, seed=0):
    """fn with torch's generator reset before each call: dropout then drops the same
    weights on every evaluation, which gradcheck needs."""
    def g(*a):
        torch.manual_seed(seed)
        return fn(*a)
    return g


GRAD_VARIANTS = {
    "plain": dict(),
    "bool mask": dict(mask="bool"),
    "float mask (bias) with its grad": dict(mask="float"),
    "is_causal (top-left), L < S": dict(is_causal=True),
    "is_causal, L > S": dict(is_causal=True, Lq=7, Lk=5),
    "causal bottom-right, L < S": dict(causal="bottom-right"),
    "causal bottom-right, L > S (empty rows)": dict(causal=True, Lq=7, Lk=5),
    "window": dict(window=(2, 1)),
    "window + causal top-left": dict(window=(2, 0), causal="top-left"),
    "GQA": dict(Hq=4, Hkv=2, enable_gqa=True),
    "MQA by broadcasting": dict(Hq=4, Hkv=1),
    "softcap": dict(softcap=2.0),
    "ALiBi": dict(alibi=True),
    "scale": dict(scale=0.37),
    "dropout": dict(dropout_p=0.3),
    "everything": dict(mask="float", causal="bottom-right", window=(3, 1), Hq=4, Hkv=2,
                       enable_gqa=True, softcap=3.0, alibi=True, dropout_p=0.2),
}


def _variant_call(spec, dtype=F64, seed=0, grad=True):
    """(inputs, fn(*inputs) -> out): the call a GRAD_VARIANTS entry describes."""
    spec = dict(spec)
    B, Hq, Hkv = 2, spec.pop("Hq", 2), spec.pop("Hkv", None)
    Lq, Lk = spec.pop("Lq", 5), spec.pop("Lk", 7)
    q, k, v = qkv(B=B, Hq=Hq, Hkv=Hkv, Lq=Lq, Lk=Lk, D=4, Dv=3, dtype=dtype, grad=grad, seed=seed)
    inputs = [q, k, v]
    mask = spec.pop("mask", None)
    kw = {}
    if mask == "bool":
        kw["attn_mask"] = torch.rand(B, 1, Lq, Lk, generator=torch.Generator().manual_seed(seed)) > 0.3
    elif mask == "float":
        inputs.append(randn(1, Hq, Lq, Lk, dtype=dtype, grad=grad, seed=seed + 7))
    if spec.pop("alibi", False):
        kw["alibi_slopes"] = torch.linspace(0.1, 0.8, Hq, dtype=dtype)
    kw.update(spec)

    def fn(q, k, v, *bias):
        return ft.scaled_dot_product_attention(q, k, v, *bias, **kw)
    return inputs, _seeded(fn) if kw.get("dropout_p") else fn


@pytest.mark.parametrize("name", list(GRAD_VARIANTS))
def test_gradcheck(name):
    inputs, fn = _variant_call(GRAD_VARIANTS[name])
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_gradcheck_through_lse():
    """lse is an output too: its gradient (the softmax weights) flows back."""
    q, k, v = qkv(Hq=4, Hkv=2)

    def fn(q, k, v):
        out, lse = ft.scaled_dot_product_attention(q, k, v, enable_gqa=True, causal=True,
                                                   return_lse=True)
        return out, lse

    def lse_only(q, k, v):
        return fn(q, k, v)[1]
    assert torch.autograd.gradcheck(fn, (q, k, v))
    assert torch.autograd.gradcheck(lse_only, (q, k, v))
    assert torch.autograd.gradcheck(_seeded(lambda q, k, v: ft.scaled_dot_product_attention(
        q, k, v, dropout_p=0.4, enable_gqa=True, return_lse=True)), (q, k, v))


def test_gradcheck_ranks_and_broadcasting():
    q, k, v = (randn(5, 4, grad=True, seed=s) for s in range(3))  # 2-D
    assert torch.autograd.gradcheck(ft.scaled_dot_product_attention, (q, k, v))
    q5 = randn(2, 1, 2, 5, 4, grad=True, seed=4)  # 5-D, broadcast against 4-D k, v
    k4, v4 = randn(3, 2, 6, 4, grad=True, seed=5), randn(3, 2, 6, 4, grad=True, seed=6)
    bias = randn(3, 1, 5, 6, grad=True, seed=7)
    assert torch.autograd.gradcheck(ft.scaled_dot_product_attention, (q5, k4, v4, bias))


def test_float32_mask_with_float64_inputs_gets_a_float32_grad():
    q, k, v = qkv()
    bias = randn(5, 7, dtype=F32, grad=True, seed=8)  # torch takes a float32 mask here
    out = ft.scaled_dot_product_attention(q, k, v, bias)
    ref = TORCH_SDPA(q, k, v, bias)
    assert rel(out, ref) < 1e-6
    g, = torch.autograd.grad(out.sum(), bias)
    g_ref, = torch.autograd.grad(ref.sum(), bias)
    assert g.dtype == F32 and rel(g, g_ref) < 1e-5


# ---------------------------------------------------------------------------------------
# against PyTorch's SDPA: forward and gradients

TORCH_CASES = {  # (spec for qkv, kwargs of both calls)
    "plain": (dict(), dict()),
    "is_causal": (dict(Lq=7, Lk=7), dict(is_causal=True)),
    "is_causal L < S": (dict(Lq=5, Lk=9), dict(is_causal=True)),
    "bool mask": (dict(), dict(attn_mask="bool")),
    "float mask": (dict(), dict(attn_mask="float")),
    "GQA": (dict(Hq=6, Hkv=2), dict(enable_gqa=True)),
    "scale": (dict(), dict(scale=0.2)),
    "Dv != D": (dict(Dv=7), dict()),
}


def _torch_case(name, dtype, B=2, Hq=4, Lq=33, Lk=65, D=16):
    spec, kw = TORCH_CASES[name]
    spec = dict(dict(B=B, Hq=Hq, Lq=Lq, Lk=Lk, D=D), **spec)
    q, k, v = qkv(dtype=dtype, **spec)
    kw = dict(kw)
    inputs = [q, k, v]
    if kw.get("attn_mask") == "bool":
        kw["attn_mask"] = torch.rand(spec["B"], 1, spec["Lq"], spec["Lk"],
                                     generator=torch.Generator().manual_seed(3)) > 0.25
    elif kw.get("attn_mask") == "float":
        kw["attn_mask"] = randn(spec["Hq"], spec["Lq"], spec["Lk"], dtype=dtype, grad=True, seed=4)
        inputs.append(kw["attn_mask"])
    return inputs, kw


@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
@pytest.mark.parametrize("name", list(TORCH_CASES))
def test_matches_torch_sdpa(name, dtype):
    inputs, kw = _torch_case(name, dtype)
    out = ft.scaled_dot_product_attention(*inputs[:3], **kw)
    ref = TORCH_SDPA(*inputs[:3], **kw)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel(out, ref) <= TOL[dtype]
    dout = randn(*out.shape, dtype=dtype, seed=11)
    grads = torch.autograd.grad(out, inputs, dout)
    refs = torch.autograd.grad(ref, inputs, dout)
    for g, r in zip(grads, refs):
        assert g.shape == r.shape and rel(g, r) <= TOL[dtype], name


def _explicit(q, k, v, *, causal=None, window=None, alibi=None, softcap=None, scale=None):
    """fastattn's variants written out in plain torch ops (autograd through them)."""
    Lq, Lk, D = q.shape[-2], k.shape[-2], q.shape[-1]
    s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else 1 / math.sqrt(D))
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(Lq)[:, None]
    j = torch.arange(Lk)[None, :]
    diag = i if causal == "top-left" else i + (Lk - Lq)
    if alibi is not None:
        s = s - alibi[:, None, None] * (i + Lk - Lq - j).abs()
    visible = torch.ones(Lq, Lk, dtype=torch.bool)
    if causal:
        visible &= j <= diag
    if window is not None:
        visible &= (j >= diag - window[0]) & (j <= diag + window[1])
    s = s.masked_fill(~visible, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v


@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
@pytest.mark.parametrize("kw", [dict(causal="bottom-right"), dict(window=(4, 2)),
                                dict(window=(3, 0), causal="top-left"), dict(softcap=1.5),
                                dict(alibi=True), dict(causal=True, softcap=2.0, alibi=True)],
                         ids=["bottom-right", "window", "window top-left", "softcap", "alibi",
                              "combined"])
def test_fastattn_variants_match_explicit_torch(kw, dtype):
    q, k, v = qkv(B=2, Hq=3, Lq=9, Lk=17, D=8, dtype=dtype)
    kw = dict(kw)
    if kw.pop("alibi", False):
        kw["alibi"] = torch.tensor([0.1, 0.3, 0.7], dtype=dtype)
    ours = ft.scaled_dot_product_attention(
        q, k, v, causal=kw.get("causal"), window=kw.get("window"), softcap=kw.get("softcap"),
        alibi_slopes=kw.get("alibi"))
    ref = _explicit(q, k, v, **kw)
    assert rel(ours, ref) <= TOL[dtype]
    dout = randn(*ours.shape, dtype=dtype, seed=5)
    for g, r in zip(torch.autograd.grad(ours, (q, k, v), dout),
                    torch.autograd.grad(ref, (q, k, v), dout)):
        assert rel(g, r) <= 3 * TOL[dtype]


def test_fully_masked_rows_give_zero_like_torch():
    q, k, v = qkv(Lq=4, Lk=6)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1] = False
    for m in (mask, torch.zeros(4, 6, dtype=F64).masked_fill(~mask, float("-inf"))):
        out, lse = ft.scaled_dot_product_attention(q, k, v, m, return_lse=True)
        ref = TORCH_SDPA(q, k, v, m)
        assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
        assert torch.isneginf(lse[:, :, 1]).all()
        assert rel(out, ref) <= TOL[F64]  # PyTorch 2.13 gives 0 on the CPU as well
        for g, r in zip(torch.autograd.grad(out.sum(), (q, k, v)),
                        torch.autograd.grad(ref.sum(), (q, k, v))):
            assert rel(g, r) <= TOL[F64]


def test_shapes_like_torch():
    """Ranks and broadcasting of the leading dims as in PyTorch's function."""
    cases = [((5, 8), (7, 8), (7, 3)), ((3, 5, 8), (3, 7, 8), (3, 7, 3)),
             ((2, 3, 2, 5, 8), (2, 3, 2, 7, 8), (2, 3, 2, 7, 3)),  # 5-D
             ((2, 4, 5, 8), (1, 1, 7, 8), (2, 1, 7, 3)),  # broadcast batch and heads
             ((1, 4, 5, 8), (2, 4, 7, 8), (2, 4, 7, 8)),  # query broadcast over the batch
             ((2, 4, 0, 8), (2, 4, 7, 8), (2, 4, 7, 3)), ((2, 4, 3, 8), (2, 4, 0, 8), (2, 4, 0, 3))]
    for shapes in cases:
        q, k, v = (randn(*s, seed=i) for i, s in enumerate(shapes))
        out, ref = ft.scaled_dot_product_attention(q, k, v), TORCH_SDPA(q, k, v)
        assert out.shape == ref.shape and rel(out, ref) <= TOL[F64], shapes
    # enable_gqa with key and value head counts that differ (both divide query's)
    q, k, v = randn(2, 4, 5, 8, seed=1), randn(2, 2, 7, 8, seed=2), randn(2, 1, 7, 3, seed=3)
    assert rel(ft.scaled_dot_product_attention(q, k, v, enable_gqa=True),
               TORCH_SDPA(q, k, v, enable_gqa=True)) <= TOL[F64]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_dtypes(monkeypatch, dtype):
    """Computed in float32 from 16-bit inputs read in place (bfloat16 as ml_dtypes',
    float16 in inference); float16 with gradients on float32 copies."""
    calls = _spy(monkeypatch, "attention")
    q, k, v = qkv(B=1, Hq=2, Lq=16, Lk=16, D=16, dtype=dtype, grad=False)
    bias = randn(16, 16, dtype=dtype, seed=4)
    out = ft.scaled_dot_product_attention(q, k, v, bias)
    ref = TORCH_SDPA(q.float(), k.float(), v.float(), bias.float())
    assert out.dtype == dtype and rel(out, ref) < 1e-2
    (qa, _, _), _, out_a = calls[-1]
    assert qa.ctypes.data == q.data_ptr() and out.data_ptr() == out_a.ctypes.data
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    out = ft.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
    ref = TORCH_SDPA(q32, k32, v32, is_causal=True)
    assert out.dtype == dtype and rel(out, ref) < 1e-2
    dout = randn(*out.shape, dtype=F32, seed=5).to(dtype)
    for g, r in zip(torch.autograd.grad(out, (qg, kg, vg), dout),
                    torch.autograd.grad(ref, (q32, k32, v32), dout.float())):
        assert g.dtype == dtype and rel(g, r) < 2e-2


def test_return_lse_matches_the_numpy_api():
    q, k, v = (t.detach() for t in qkv(Hq=4, Hkv=2))
    out, lse = ft.scaled_dot_product_attention(q, k, v, enable_gqa=True, causal=True,
                                               return_lse=True)
    ref, ref_lse = fastattn.attention(q.numpy(), k.numpy(), v.numpy(), causal=True,
                                      return_lse=True)
    np.testing.assert_array_equal(out.numpy(), ref)
    np.testing.assert_array_equal(lse.numpy(), ref_lse)
    assert lse.shape == (1, 4, 5) and lse.dtype == F64


def test_dropout_seed_comes_from_torchs_generator():
    q, k, v = (t.detach() for t in qkv(Lq=16, Lk=16, D=8))
    torch.manual_seed(42)
    a = ft.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(42)
    b = ft.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    c = ft.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b) and not torch.equal(a, c)
    torch.manual_seed(42)
    seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))  # what the call drew
    ref = fastattn.attention(q.numpy(), k.numpy(), v.numpy(), dropout_p=0.5, seed=seed)
    np.testing.assert_array_equal(a.numpy(), ref)
    # applied whenever dropout_p > 0, like torch's function (no training flag here)
    assert not torch.equal(a, ft.scaled_dot_product_attention(q, k, v))


def test_follows_torchs_thread_count():
    q, k, v = (t.detach().float() for t in qkv(B=2, Hq=4, Lq=256, Lk=256, D=32))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        ft.scaled_dot_product_attention(q, k, v)
        assert fastattn._kernels.last_num_threads() == 1
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------
# zero copies

def _spy(monkeypatch, name):
    """Record the arrays fastattn.<name> receives and returns when fastattn.torch calls it."""
    calls = []
    real = getattr(fastattn, name)

    def spy(*args, **kw):
        res = real(*args, **kw)
        calls.append((args, kw, res))
        return res
    monkeypatch.setattr(ft.fastattn, name, spy)
    return calls


def test_zero_copy_in_and_out(monkeypatch):
    calls = _spy(monkeypatch, "attention")
    B, L, H, D = 2, 64, 4, 32
    qkv_proj = torch.randn(B, L, 3, H, D)  # a fused projection: q, k, v are strided views
    q, k, v = (qkv_proj[:, :, i].transpose(1, 2) for i in range(3))
    assert not q.is_contiguous()
    out, lse = ft.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    (qa, ka, va), _, (out_a, lse_a) = calls[-1]
    for t, a in ((q, qa), (k, ka), (v, va)):
        assert a.ctypes.data == t.data_ptr() and a.strides == tuple(4 * s for s in t.stride())
    assert out.data_ptr() == out_a.ctypes.data and lse.data_ptr() == lse_a.ctypes.data
    # the same through the registered op (autograd on): inputs and outputs not copied
    qg = q.detach().requires_grad_()
    out = ft.scaled_dot_product_attention(qg, k, v, is_causal=True)
    (qa, _, _), _, (out_a, _) = calls[-1]
    assert qa.ctypes.data == q.data_ptr() and out.data_ptr() == out_a.ctypes.data


def test_zero_copy_measured_with_tracemalloc():
    """NumPy reports its allocations to tracemalloc: a call allocates its output and lse,
    never a copy of q, k or v (which are 16x larger than the output here)."""
    B, H, Lq, Lk, D = 1, 4, 16, 4096, 64
    q = torch.randn(B, H, Lq, D)
    kv = torch.randn(B, Lk, 2, H, D)  # strided k and v
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    expected = B * H * Lq * (D + 1) * 4  # out + lse
    ft.scaled_dot_product_attention(q, k, v)  # warm-up
    tracemalloc.start()
    try:
        ft.scaled_dot_product_attention(q, k, v)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        # the detector sees a copy: a last axis that is not contiguous is copied once
        ft.scaled_dot_product_attention(q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v)
        _, peak_copy = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < expected + 64 * 1024, (peak, expected)
    assert peak_copy > expected + k.numel() * 4


# ---------------------------------------------------------------------------------------
# errors

def test_errors_name_the_problem():
    q, k, v = (t.detach() for t in qkv())
    sdpa = ft.scaled_dot_product_attention
    meta = torch.empty(1, 2, 5, 4, device="meta")
    with pytest.raises(ValueError, match=r"query on 'meta'.*fastattn runs on the CPU"):
        sdpa(meta, meta, meta)
    with pytest.raises(ValueError, match=r"different devices.*key on 'meta'"):
        sdpa(q, torch.empty(1, 2, 7, 4, device="meta"), v)
    with pytest.raises(ValueError, match="attn_mask on 'meta'"):
        sdpa(q, k, v, torch.ones(5, 7, dtype=torch.bool, device="meta"))
    with pytest.raises(TypeError, match="unsupported dtype torch.int64"):
        sdpa(q.long(), k.long(), v.long())
    with pytest.raises(TypeError, match="unsupported dtype torch.complex128"):
        sdpa(*(t.to(torch.complex128) for t in (q, k, v)))
    with pytest.raises(TypeError, match="same dtype"):
        sdpa(q, k.float(), v)
    with pytest.raises(TypeError, match="attn_mask must be bool .* got torch.int64"):
        sdpa(q, k, v, torch.ones(5, 7, dtype=torch.int64))
    with pytest.raises(TypeError, match="attn_mask must be bool"):
        sdpa(q.float(), k.float(), v.float(), torch.ones(5, 7, dtype=F64))  # as torch: no
    with pytest.raises(ValueError, match=r"attn_mask of shape \(5, 6\) does not broadcast"):
        sdpa(q, k, v, torch.ones(5, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="need enable_gqa"):
        sdpa(randn(1, 4, 5, 4), randn(1, 2, 7, 4), randn(1, 2, 7, 4))
    with pytest.raises(ValueError, match="must divide"):
        sdpa(randn(1, 3, 5, 4), randn(1, 2, 7, 4), randn(1, 2, 7, 4), enable_gqa=True)
    with pytest.raises(ValueError, match="feature size"):
        sdpa(q, k[..., :3], v)
    with pytest.raises(ValueError, match="at least 2-D"):
        sdpa(q[0, 0, 0], k[0, 0, 0], v[0, 0, 0])
    with pytest.raises(ValueError, match=r"dropout_p must be a float in \[0, 1\)"):
        sdpa(q, k, v, dropout_p=1.0)
    with pytest.raises(ValueError, match="scale must be finite"):
        sdpa(q, k, v, scale=float("inf"))
    with pytest.raises(ValueError, match="window"):
        sdpa(q, k, v, window=(-2, 0))
    with pytest.raises(ValueError, match="causal must be"):
        sdpa(q, k, v, causal="diagonal")
    with pytest.raises(ValueError, match="disagree"):
        sdpa(q, k, v, is_causal=True, causal="bottom-right")
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        sdpa(q, k, v, alibi_slopes=torch.ones(3))
    qg = q.clone().requires_grad_()
    with pytest.raises(ValueError, match=r"alibi_slopes gets no gradient.*detach"):
        sdpa(qg, k, v, alibi_slopes=torch.ones(2, requires_grad=True))
    with pytest.raises(TypeError, match="query must be a torch.Tensor"):
        sdpa(q.numpy(), k, v)


def test_a_cuda_tensor_is_refused_and_routed_to_torch(monkeypatch):
    """No CUDA here: a CPU tensor that says it is on cuda:0 takes the same path."""
    class OnCuda(torch.Tensor):
        is_cpu = property(lambda self: False)
        device = property(lambda self: torch.device("cuda", 0))

    q, k, v = (t.detach().float() for t in qkv())
    qc = q.as_subclass(OnCuda)
    with pytest.raises(ValueError, match=r"query on 'cuda:0'.*different devices|different devices.*query on 'cuda:0'"):
        ft.scaled_dot_product_attention(qc, k, v)
    calls = _spy(monkeypatch, "attention")
    seen = []
    # stands in for torch's function, which would run on the CPU data of this stand-in
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **kw: seen.append((a, kw)) or "torch")
    with ft.sdpa_kernel():
        assert F.scaled_dot_product_attention(qc, k, v, is_causal=True) == "torch"
    assert not calls and seen[0][0][0] is qc and seen[0][1] == {"is_causal": True}


# ---------------------------------------------------------------------------------------
# routing torch.nn.functional.scaled_dot_product_attention

def test_sdpa_kernel_nests_and_restores():
    assert not ft.is_enabled()
    with ft.sdpa_kernel():
        assert ft.is_enabled() and F.scaled_dot_product_attention is not TORCH_SDPA
        with ft.sdpa_kernel():
            assert ft.is_enabled()
        assert ft.is_enabled()
        with ft.sdpa_kernel(False):
            assert F.scaled_dot_product_attention is TORCH_SDPA
        assert ft.is_enabled()
    assert F.scaled_dot_product_attention is TORCH_SDPA
    with pytest.raises(KeyError):
        with ft.sdpa_kernel():
            raise KeyError("restored on the way out")
    assert F.scaled_dot_product_attention is TORCH_SDPA
    ft.enable()
    ft.enable()
    assert ft.is_enabled()
    ft.disable()
    assert F.scaled_dot_product_attention is TORCH_SDPA
    ft.disable()
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_routed_calls_use_fastattn(monkeypatch):
    calls = _spy(monkeypatch, "attention")
    q, k, v = (t.detach().float() for t in qkv(B=2, Hq=4, Hkv=2, Lq=9, Lk=9))
    mask = torch.rand(9, 9, generator=torch.Generator().manual_seed(0)) > 0.5
    with ft.sdpa_kernel():
        for args, kw in [((q, k, v), dict(enable_gqa=True)),
                         ((q, k, v, mask), dict(enable_gqa=True)),
                         ((q, k, v, None, 0.0, True), dict(scale=0.3, enable_gqa=True)),
                         ((q, k, v), dict(attn_mask=mask.float(), enable_gqa=True))]:
            n = len(calls)
            out = F.scaled_dot_product_attention(*args, **kw)
            assert len(calls) == n + 1
            assert rel(out, TORCH_SDPA(*args, **kw)) <= TOL[F32]


def test_routed_fallbacks_reach_torch_unchanged(monkeypatch):
    calls = _spy(monkeypatch, "attention")
    q, k, v = (t.detach().float() for t in qkv(Lq=7, Lk=7))
    meta = [torch.empty(t.shape, device="meta") for t in (q, k, v)]
    mask = torch.ones(7, 7, dtype=torch.bool)
    fallbacks = [
        (tuple(meta), {}),                                   # not on the CPU
        ((q.long(), k.long(), v.long()), {}),                # dtype
        ((q, k, v, mask, 0.0, True), {}),                    # is_causal with a mask
        ((q, k, v, None, 1.0), {}),                          # dropout_p = 1
        ((q, k[..., :3], v), {}),                            # shapes that do not fit
        ((q, k, v, None, 0.0, False, 0.5), {}),              # scale passed by position
        ((q, k, v), {"bogus": 1}),                           # an argument it does not know
        ((q, k), {}),                                        # too few arguments
    ]
    with ft.sdpa_kernel():
        for args, kw in fallbacks:
            try:
                want = TORCH_SDPA(*args, **kw)
            except Exception as e:  # noqa: BLE001 -- the same exception must come back
                with pytest.raises(type(e)) as got:
                    F.scaled_dot_product_attention(*args, **kw)
                assert str(got.value) == str(e)
            else:
                got = F.scaled_dot_product_attention(*args, **kw)
                assert got.device == want.device and got.shape == want.shape
                if got.device.type == "cpu" and not got.isnan().any():
                    assert torch.equal(got, want)
    assert not calls


def test_multihead_attention_is_routed(monkeypatch):
    calls = _spy(monkeypatch, "attention")
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True).train()  # no fast path
    x = torch.randn(2, 10, 32)
    ref, _ = mha(x, x, x, need_weights=False)
    with ft.sdpa_kernel():
        out, _ = mha(x, x, x, need_weights=False)
    assert calls and rel(out, ref) <= TOL[F32]


# ---------------------------------------------------------------------------------------
# What PyTorch's own SDPA tests (test/test_transformers.py) found with routing on (issue 57)

from torch.nn.attention import SDPBackend, sdpa_kernel as torch_sdpa_kernel  # noqa: E402
from torch.nn.attention.bias import causal_lower_right, causal_upper_left  # noqa: E402


def _math_sdpa(*args, **kw):
    """PyTorch's math kernel (the reference upstream's tests compare against)."""
    with torch_sdpa_kernel([SDPBackend.MATH]):
        return TORCH_SDPA(*args, **kw)


_CAUSAL_BIAS_CASES = [(causal_upper_left, 23, 56), (causal_upper_left, 56, 23),
                      (causal_upper_left, 16, 16), (causal_lower_right, 23, 56),
                      (causal_lower_right, 56, 23), (causal_lower_right, 16, 16)]


@pytest.mark.parametrize("make,Lq,Lk", _CAUSAL_BIAS_CASES)
@pytest.mark.parametrize("dtype", [F64, F32])
def test_causal_bias_is_fastattns_causal_mask_with_gradients(monkeypatch, make, Lq, Lk, dtype):
    """CausalBias is a tensor subclass whose memory is a placeholder: upper-left is
    fastattn's top-left causal mask, lower-right its bottom-right one (rows that see no
    key give 0, as PyTorch's math kernel does), forward and backward; no mask or bias
    array reaches the kernel."""
    calls = _spy(monkeypatch, "attention")
    with pytest.warns(UserWarning) if make is causal_lower_right and Lq > Lk else \
            contextlib.nullcontext():
        bias = make(Lq, Lk)
    q, k, v = qkv(B=2, Hq=3, Lq=Lq, Lk=Lk, D=8, dtype=dtype)
    ref = _math_sdpa(q, k, v, attn_mask=bias._materialize())
    dout = randn(*ref.shape, dtype=dtype, seed=5)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    with ft.sdpa_kernel():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    assert calls, "the call did not reach fastattn"
    for _, kw, _ in calls:
        assert "mask" not in kw and "bias" not in kw
        assert kw.get("causal") == ("top-left" if make is causal_upper_left and Lq != Lk
                                    else True)
    tol = TOL[dtype] * (10 if dtype == F32 else 1)
    assert rel(out, ref) <= tol
    for g, r in zip(grads, ref_grads):
        assert rel(g, r) <= tol


def test_causal_bias_inference_and_is_causal_like_torch():
    q, k, v = qkv(B=1, Hq=2, Lq=23, Lk=56, D=15, dtype=F32, grad=False)
    with ft.sdpa_kernel():
        for make in (causal_upper_left, causal_lower_right):
            bias = make(23, 56)
            got = F.scaled_dot_product_attention(q, k, v, bias)
            assert rel(got, _math_sdpa(q, k, v, bias._materialize())) <= 1e-5
        # upper-left is is_causal=True
        assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=causal_upper_left(23, 56)),
                           F.scaled_dot_product_attention(q, k, v, is_causal=True))
        # CausalBias's own rule: not with is_causal=True (PyTorch raises the same)
        with pytest.raises(ValueError, match="CausalBias should not be used with causal=True"):
            F.scaled_dot_product_attention(q, k, v, attn_mask=causal_upper_left(23, 56),
                                           is_causal=True)


@pytest.mark.parametrize("make", [causal_upper_left, causal_lower_right])
def test_direct_call_takes_causal_bias_as_its_causal_mask(monkeypatch, make):
    """fastattn.torch.scaled_dot_product_attention itself (no routing) reads a CausalBias
    as the causal mask it stands for, never its placeholder memory."""
    calls = _spy(monkeypatch, "attention")
    q, k, v = qkv(B=2, Hq=3, Lq=23, Lk=56, D=8, dtype=F64)
    bias = make(23, 56)
    ref = _math_sdpa(q, k, v, attn_mask=bias._materialize())
    out = ft.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    assert rel(out, ref) <= TOL[F64]
    assert all("mask" not in kw and "bias" not in kw for _, kw, _ in calls)
    with pytest.raises(ValueError, match="CausalBias should not be used with causal=True"):
        ft.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=True)
    with pytest.raises(ValueError, match="not both"):
        ft.scaled_dot_product_attention(q, k, v, attn_mask=bias, causal="bottom-right")
    with pytest.raises(ValueError, match=r"causal_lower_right\(9, 56\) but query and key"):
        ft.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(9, 56))


def test_causal_bias_of_other_lengths_goes_pytorchs_way():
    """A lower-right bias whose lengths are not the call's is materialized by PyTorch's
    CausalBias and broadcast (here (1, S) over the rows): the same as without routing,
    eager and compiled."""
    q, k, v = qkv(B=2, Hq=3, Lq=23, Lk=56, D=16, dtype=F32, grad=False)
    bias = causal_lower_right(1, 56)
    ref = TORCH_SDPA(q, k, v, bias)
    with ft.sdpa_kernel():
        assert rel(F.scaled_dot_product_attention(q, k, v, bias), ref) <= 1e-5
        torch._dynamo.reset()
        fn = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, bias),
                           backend="aot_eager", fullgraph=True)
        assert rel(fn(q, k, v), ref) <= 1e-5


@pytest.mark.parametrize("make", [causal_upper_left, causal_lower_right])
def test_causal_bias_compiles_to_fastattns_op_without_graph_break(make):
    """torch.compile (PyTorch's test_causal_variants_compile): one graph, fastattn's op,
    output and gradients those of PyTorch's math kernel."""
    torch._dynamo.reset()
    bias = make(23, 56)
    q, k, v = qkv(B=2, Hq=3, Lq=23, Lk=56, D=16, dtype=F32)
    ref = _math_sdpa(q, k, v, attn_mask=bias._materialize())
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    with ft.sdpa_kernel():
        fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=bias)  # noqa: E731
        explanation = torch._dynamo.explain(fn)(q, k, v)
        assert explanation.graph_count == 1 and explanation.graph_break_count == 0
        assert "fastattn.attention_fwd" in _graph_targets(explanation)
        out = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert rel(out, ref) <= 1e-5
    for g, r in zip(grads, ref_grads):
        assert rel(g, r) <= 1e-5


class _Logged(torch.Tensor):
    """An attn_mask subclass that overrides __torch_function__, records the functions it
    sees and, for PyTorch's SDPA, unwraps its mask and calls on."""
    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        cls.seen.append(func)
        if func is TORCH_SDPA:
            def plain(x):
                return x.as_subclass(torch.Tensor) if isinstance(x, _Logged) else x
            return func(*map(plain, args), **{n: plain(x) for n, x in kwargs.items()})
        return super().__torch_function__(func, types, args, kwargs)


def test_torch_function_subclasses_see_the_call_as_without_routing(monkeypatch):
    """A tensor subclass that overrides __torch_function__ gets the call from PyTorch's
    own function, with the func it gets without routing; fastattn never reads it."""
    calls = _spy(monkeypatch, "attention")
    q, k, v = qkv(B=2, Hq=3, Lq=9, Lk=11, D=8, dtype=F32, grad=False)
    plain = torch.randn(9, 11, generator=torch.Generator().manual_seed(3))
    runs = []
    for routed in (False, True):
        _Logged.seen.clear()
        with ft.sdpa_kernel(routed):
            out = F.scaled_dot_product_attention(q, k, v, plain.as_subclass(_Logged))
        runs.append((list(_Logged.seen), out))
    assert runs[0][0] == runs[1][0] == [TORCH_SDPA]
    assert torch.equal(runs[0][1], runs[1][1]) and not calls


def test_nested_jagged_tensors_as_without_routing():
    """Nested jagged tensors (a __torch_function__ subclass that recognises PyTorch's own
    function) compute as without routing."""
    g = torch.Generator().manual_seed(0)
    nt = torch.nested.nested_tensor([torch.randn(n, 4, 8, generator=g) for n in (3, 5)],
                                    layout=torch.jagged).transpose(1, 2)
    ref = TORCH_SDPA(nt, nt, nt)
    with ft.sdpa_kernel():
        out = F.scaled_dot_product_attention(nt, nt, nt)
    for a, b in zip(out.unbind(), ref.unbind()):
        assert torch.equal(a, b)


def test_torch_function_mode_is_honoured(monkeypatch):
    """A TorchFunctionMode sees the call (func is the public function) and the call it
    lets through is computed by fastattn."""
    calls = _spy(monkeypatch, "attention")
    seen = []

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))
    q, k, v = qkv(B=1, Hq=2, Lq=6, Lk=6, D=8, dtype=F32, grad=False)
    with ft.sdpa_kernel(), Mode():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert F.scaled_dot_product_attention in seen
    assert calls and rel(out, TORCH_SDPA(q, k, v, is_causal=True)) <= 1e-5


_SCRIPTED = r"""
import sys, warnings
import torch
import fastattn.torch as ft
warnings.simplefilter("ignore")
torch.set_num_threads(1)
torch.manual_seed(0)

class MyLayer(torch.nn.TransformerEncoderLayer):
    pass

x = torch.randn(2, 9, 16)
mask = torch.rand(9, 9, generator=torch.Generator().manual_seed(1)) > 0.7
runs = [(torch.nn.MultiheadAttention(16, 4, batch_first=True),
         lambda m: m(x, x, x, attn_mask=mask, need_weights=False)[0]),
        (torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True),
         lambda m: m(x, src_mask=mask)),
        (torch.nn.TransformerEncoder(MyLayer(16, 4, 32, dropout=0.0), 2,
                                     enable_nested_tensor=False),
         lambda m: m(x.transpose(0, 1), mask=mask))]
# scripted first with routing on: TorchScript caches what it compiles, per process
ft.enable()
on = [[run(torch.jit.script(m.train(t))) for t in (True, False)] for m, run in runs]
ft.disable()
for (m, run), outs in zip(runs, on):
    for t, out in zip((True, False), outs):
        m.train(t)
        assert torch.equal(out, run(torch.jit.script(m))), (type(m).__name__, t)
        ref = run(m)
        err = float((out - ref).abs().max())
        assert err <= 1e-5 * float(ref.abs().max()), (type(m).__name__, t, err)
print("ok")
"""


def test_torchscript_modules_with_routing_on_equal_routing_off():
    """torch.jit.script of nn.MultiheadAttention / nn.TransformerEncoderLayer (and an
    encoder of a subclassed layer), train and eval, while routing is on compiles (the
    router is TorchScript's builtin aten::scaled_dot_product_attention) and computes what
    the module computes without routing.  In a fresh process: TorchScript caches the
    functions it compiled, so scripting there first is what a user's first script does."""
    import subprocess
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # from tests/: in the clone's root (where CI runs the suite) `python -c` would find
    # the source folder, which has no built extension, before the installed package
    res = subprocess.run([sys.executable, "-c", _SCRIPTED], capture_output=True, text=True,
                         env=env, timeout=300, cwd=os.path.dirname(os.path.abspath(__file__)))
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]


class _MaskedBatch(torch.nn.Module):
    """Batch rows chosen by a boolean tensor: the batch size is data-dependent (an
    unbacked symbol under torch.export), and so is the float mask's first dim."""

    def forward(self, q, k, v, keep):
        q, k, v = q[keep], k[keep], v[keep]
        mask = torch.zeros(q.shape[0], 1, q.shape[2], k.shape[2], dtype=q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("strict", [False, True])
def test_export_with_an_unbacked_mask_size(strict):
    """torch.export of a call whose sizes depend on data: fastattn's checks would guard
    on them (GuardOnDataDependentSymNode "Ne(u0, 1)"), so routing hands the call to
    PyTorch's function, which exports its own op."""
    q, k, v = qkv(B=4, Hq=2, Lq=6, Lk=6, D=8, dtype=F32, grad=False)
    keep = torch.tensor([True, False, True, True])
    with ft.sdpa_kernel():
        ep = torch.export.export(_MaskedBatch(), (q, k, v, keep), strict=strict)
    targets = {str(n.target) for n in ep.graph.nodes}
    assert "aten.scaled_dot_product_attention.default" in targets
    assert rel(ep.module()(q, k, v, keep), TORCH_SDPA(q[keep], k[keep], v[keep])) <= 1e-6


@pytest.mark.parametrize("strict", [False, True])
def test_export_with_dynamic_shapes_uses_fastattn(strict):
    from torch.export import Dim

    class M(torch.nn.Module):
        def forward(self, q, k, v, mask):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    q, k, v = qkv(B=2, Hq=3, Lq=8, Lk=12, D=16, dtype=F32, grad=False)
    mask = torch.rand(8, 12, generator=torch.Generator().manual_seed(0)) > 0.3
    B, L, S = Dim("B", min=2, max=8), Dim("L", min=2, max=64), Dim("S", min=2, max=64)
    with ft.sdpa_kernel():
        ep = torch.export.export(M(), (q, k, v, mask), strict=strict, dynamic_shapes={
            "q": {0: B, 2: L}, "k": {0: B, 2: S}, "v": {0: B, 2: S}, "mask": {0: L, 1: S}})
    assert "fastattn.attention_fwd.default" in {str(n.target) for n in ep.graph.nodes}
    q2, k2, v2 = qkv(B=3, Hq=3, Lq=5, Lk=7, D=16, dtype=F32, grad=False, seed=4)
    m2 = torch.rand(5, 7, generator=torch.Generator().manual_seed(1)) > 0.3
    assert rel(ep.module()(q2, k2, v2, m2), TORCH_SDPA(q2, k2, v2, m2)) <= 1e-5


# ---------------------------------------------------------------------------------------
# torch.compile

class Block(torch.nn.Module):
    """A pre-norm transformer block; attention through `attend(q, k, v)`."""

    def __init__(self, d, heads, attend):
        super().__init__()
        self.heads, self.attend = heads, attend
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
                                       torch.nn.Linear(4 * d, d))

    def forward(self, x):
        B, L, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, L, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = self.attend(q, k, v)
        x = x + self.proj(a.transpose(1, 2).reshape(B, L, d))
        return x + self.mlp(self.ln2(x))


def _graph_targets(explanation):
    return {str(n.target) for g in explanation.graphs for n in g.graph.nodes}


def _compile_check(block, x, backend):
    ref = block(x)
    ref_grads = torch.autograd.grad(ref.square().sum(), list(block.parameters()))
    explanation = torch._dynamo.explain(block)(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    assert "fastattn.attention_fwd" in _graph_targets(explanation)
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    out = compiled(x)
    grads = torch.autograd.grad(out.square().sum(), list(block.parameters()))
    assert rel(out, ref) <= 1e-5
    for g, r in zip(grads, ref_grads):
        assert rel(g, r) <= 1e-4


def test_compile_fullgraph_no_graph_break():
    """aot_eager: dynamo, the fake implementations, AOT autograd and the backward op;
    the variants' Python arguments go through the trace as constants."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = Block(32, 4, lambda q, k, v: ft.scaled_dot_product_attention(
        q, k, v, is_causal=True, window=(6, 0), softcap=20.0, dropout_p=0.0))
    _compile_check(block, torch.randn(2, 24, 32), "aot_eager")


def test_compile_routed_sdpa_no_graph_break():
    torch._dynamo.reset()
    torch.manual_seed(1)
    block = Block(32, 4, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    with ft.sdpa_kernel():
        _compile_check(block, torch.randn(2, 16, 32), "aot_eager")


@pytest.mark.skipif(not os.environ.get("FASTATTN_TEST_INDUCTOR"),
                    reason="inductor compiles C++ (~40 s here): set FASTATTN_TEST_INDUCTOR=1")
def test_compile_inductor():
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = Block(32, 4, lambda q, k, v: ft.scaled_dot_product_attention(q, k, v, is_causal=True))
    _compile_check(block, torch.randn(2, 24, 32), "inductor")


# ---------------------------------------------------------------------------------------
# training a small GPT with and without sdpa_kernel()

class GPT(torch.nn.Module):
    def __init__(self, vocab=64, d=128, heads=4, layers=2, L=256):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(L, d)
        attend = self.attend
        self.blocks = torch.nn.ModuleList(Block(d, heads, attend) for _ in range(layers))
        self.ln, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, vocab, bias=False)

    @staticmethod
    def attend(q, k, v):  # looked up at call time: sdpa_kernel() reroutes it
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def train_losses(dtype, steps, routed, B=1, L=256, seed=0):
    torch.manual_seed(seed)
    model = GPT(L=L).to(dtype)
    # one batch of random tokens, seen at every step: the loss falls as it is memorized
    batch = torch.randint(0, 64, (B, L + 1), generator=torch.Generator().manual_seed(seed))
    data = batch.expand(steps, B, L + 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    with ft.sdpa_kernel(routed):
        for batch in data:
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, 64), batch[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return np.array(losses)


@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
def test_gpt_training_matches_torch(monkeypatch, dtype):
    calls = _spy(monkeypatch, "attention_backward")
    ref = train_losses(dtype, 30, routed=False)
    assert not calls
    ours = train_losses(dtype, 30, routed=True)
    assert len(calls) == 30 * 2  # every layer's backward ran in fastattn
    assert ref[-5:].mean() < ref[:5].mean() - 0.1  # it learns
    tol = 1e-4 if dtype == F32 else 1e-10
    np.testing.assert_allclose(ours, ref, rtol=tol, atol=0)
