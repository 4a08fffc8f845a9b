"""The checks of one public function each (fastattn._api's own): attention's `out=`,
merge's parts, varlen_attention's packed inputs, attention_backward's gradient
inputs.  The checks every function shares, and the adapters' surface, are in
fastattn._args; the messages here name their function as those do."""

from __future__ import annotations

from typing import Any, Tuple

import numpy as np

from ._args import (F16, F32, F64, LAYOUTS, Problem, abbreviated, as_array, fresh,
                    in_place, is_bf16, is_float, parse_flag)


def backward_flags(pr, return_dbias, bias):
    """attention_backward's own checks on its Problem `pr`: no float16 input (they have
    no gradients), and `return_dbias` a bool that needs a bias; returns it as a bool."""
    fn = pr.fn
    if F16 in (pr.q.dtype, pr.k.dtype, pr.v.dtype):
        raise TypeError(f"fastattn.{fn}: float16 inputs have no gradients (a float16 K/V cache "
                        f"is for inference); pass float32 or float64 q, k and v "
                        f"({pr.user_shapes} with dtypes {pr.q.dtype}, {pr.k.dtype}, {pr.v.dtype})")
    return_dbias = parse_flag(return_dbias, "return_dbias", fn)
    if return_dbias and bias is None:
        raise ValueError(f"fastattn.{fn}: return_dbias=True needs a bias")
    return return_dbias


def grad_inputs(pr, dout, out, lse, threads=1):
    """dout, out and lse of attention_backward checked against the forward's shapes of
    its Problem `pr`, as arrays in the compute dtype readable in place (dout and out in
    the "bhsd" order); a copy is made on `threads` threads where `fresh` can."""
    out_shape = pr.user(pr.q.shape[:-1] + (pr.v.shape[-1],))
    what = "the shape attention returned for these q, k, v"
    return (pr.bhsd(_grad_input(pr, dout, "dout", out_shape, what, threads)),
            pr.bhsd(_grad_input(pr, out, "out", out_shape, what, threads)),
            _grad_input(pr, lse, "lse", pr.q.shape[:-1],
                        "(..., Hq, Lq): what attention(..., return_lse=True) returned", threads))


def _grad_input(pr, x, name, shape, what, threads):
    """dout, out or lse of a backward call as an array of `shape` in the compute
    dtype, readable in place (copied only if it is not, on `threads` threads where
    `fresh` can)."""
    fn = pr.fn
    a = as_array(x, name, fn)
    if a.shape != shape:
        raise ValueError(f"fastattn.{fn}: {name} has shape {a.shape}, expected {shape} ({what})")
    if not is_float(a.dtype):
        raise TypeError(f"fastattn.{fn}: {name} must be a float array, got dtype {a.dtype}")
    return in_place(a, pr.dtype, threads)


def check_out(out, shape, dtype, inputs):
    """attention's `out=`: an ndarray of `shape` and `dtype`, writeable, with a
    contiguous last axis, aligned whole-element strides, no zero stride, and no memory
    shared with the arrays of `inputs` (a dict name -> array or None)."""
    if not isinstance(out, np.ndarray):
        raise TypeError(f"fastattn.attention: out must be a numpy array, got {type(out).__name__}")
    if out.shape != shape:
        raise ValueError(f"fastattn.attention: out has shape {out.shape}, expected {shape}")
    if out.dtype != dtype:
        raise TypeError(f"fastattn.attention: out has dtype {out.dtype}, expected {dtype}")
    if not out.flags.writeable:
        raise ValueError("fastattn.attention: out is read-only")
    item = dtype.itemsize
    if out.size and ((shape[-1] > 1 and out.strides[-1] != item)
                     or any(s % item for s in out.strides) or not out.flags.aligned):
        raise ValueError("fastattn.attention: out must have a contiguous last axis, aligned, "
                         f"with strides that are whole elements; got strides {out.strides}")
    if out.size and any(s == 0 and n > 1 for s, n in zip(out.strides, out.shape)):
        raise ValueError(f"fastattn.attention: out has a zero stride (a broadcast view), strides {out.strides}")
    for name, a in inputs.items():
        if a is not None and np.may_share_memory(out, a) and np.shares_memory(out, a, max_work=10_000):
            raise ValueError(f"fastattn.attention: out overlaps {name}; pass a separate output array")


def merge_inputs(outs, lses, layout):
    """merge's parts checked: ``(outs, lses, dtype, swap)`` with the parts as arrays
    (the lses with their last two axes swapped for a "bshd" layout, so that their rows
    are in the order of the out rows), the float dtype they merge in, and whether the
    layout swapped them."""
    fn = "merge"
    if layout not in LAYOUTS:
        raise ValueError(f"fastattn.merge: layout must be 'bhsd' or 'bshd', got {layout!r}")
    if not len(outs) or len(outs) != len(lses):
        raise ValueError(f"fastattn.merge: outs and lses must be non-empty and of equal length, "
                         f"got {len(outs)} outs and {len(lses)} lses")
    outs_a = [as_array(o, f"outs[{i}]", fn) for i, o in enumerate(outs)]
    lses_a = [as_array(x, f"lses[{i}]", fn) for i, x in enumerate(lses)]
    dt = np.result_type(*outs_a, *lses_a)
    if is_bf16(dt):  # bfloat16 parts: merged in float32
        dt = F32
    if dt != F32 and dt != F64:
        raise TypeError(f"fastattn.merge: outs and lses must be float32 or float64, got "
                        f"{sorted({str(a.dtype) for a in outs_a + lses_a})}")
    shape = outs_a[0].shape
    swap = layout == "bshd" and len(shape) >= 3
    lse_shape = shape[:-3] + (shape[-2], shape[-3]) if swap else shape[:-1]
    where = "(..., Hq, Lq) for outs (..., Lq, Hq, Dv)" if swap else "outs[0].shape[:-1]"
    for i, (o, x) in enumerate(zip(outs_a, lses_a)):
        if o.ndim < 1 or o.shape != shape or x.shape != lse_shape:
            raise ValueError(f"fastattn.merge: outs[{i}] {o.shape} and lses[{i}] {x.shape} must "
                             f"have the shape of outs[0] {shape} and {lse_shape} ({where}, "
                             f"layout={layout!r})")
    if swap:  # lse rows in the order of the out rows
        lses_a = [x.swapaxes(-1, -2) for x in lses_a]
    return outs_a, lses_a, dt, swap


def _cu_seqlens(a, name, total):
    a = as_array(a, name, "varlen_attention")
    if a.dtype.kind not in "iu":
        raise TypeError(f"fastattn.varlen_attention: {name} must be an integer array, got dtype {a.dtype}")
    if a.ndim != 1 or a.size < 1 or a[0] != 0 or np.any(np.diff(a) < 0) or a[-1] != total:
        raise ValueError(f"fastattn.varlen_attention: {name} must be 1-D, start at 0, be "
                         f"non-decreasing and end at the packed length {total}; got shape "
                         f"{a.shape}: {abbreviated(a)}")
    return fresh(a, np.int64)


def varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k) -> Tuple[Problem, Any, Any]:
    """varlen_attention's packed q, k, v (3-D, "bshd") and cumulative lengths checked:
    ``(problem, cu_q, cu_k)``, the lengths as int64 arrays of one size."""
    fn = "varlen_attention"
    qa, ka, va = (as_array(a, n, fn) for a, n in ((q, "q"), (k, "k"), (v, "v")))
    for name, a in (("q", qa), ("k", ka), ("v", va)):
        if a.ndim != 3:
            raise ValueError(f"fastattn.{fn}: {name} must be 3-D (total, H, D), got shape {a.shape}")
    pr = Problem(fn, qa, ka, va, "bshd")
    cq = _cu_seqlens(cu_seqlens_q, "cu_seqlens_q", qa.shape[0])
    ck = _cu_seqlens(cu_seqlens_k, "cu_seqlens_k", ka.shape[0])
    if cq.shape != ck.shape:
        raise ValueError(f"fastattn.{fn}: cu_seqlens_q {cq.shape} and cu_seqlens_k {ck.shape} "
                         "must have the same length (one entry per sequence, plus one)")
    return pr, cq, ck
