"""fastattn inside PyTorch: registered ops with autograd and ``torch.compile``
support, and a drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

- :func:`scaled_dot_product_attention` takes and returns torch tensors, with the
  semantics of ``torch.nn.functional.scaled_dot_product_attention`` for the
  arguments they share, plus fastattn's variants as keywords.
- :func:`sdpa_kernel` (a context manager), :func:`enable` and :func:`disable`
  route ``torch.nn.functional.scaled_dot_product_attention`` on CPU tensors through
  fastattn, so existing models switch with one line; anything fastattn does not
  take goes to PyTorch's own function, unchanged.
- :func:`attention` and :func:`quantize_kv` are :func:`fastattn.attention` and
  :func:`fastattn.quantize_kv` on tensors, for inference against the caches servers
  keep (int8 QuantizedKV of tensors, paged pools with a block table), read in place.
- ``torch.ops.fastattn.attention_fwd`` and ``torch.ops.fastattn.attention_bwd``
  are the registered ops (``torch.library.custom_op``, CPU), each with a fake
  implementation, so ``torch.compile(fullgraph=True)`` traces them without a graph
  break; the forward's autograd formula calls the backward op.

Tensors reach the kernel without a copy: ``Tensor.numpy()`` is a view of the
tensor's memory and fastattn reads any strides with a contiguous last axis in place;
the results are NumPy arrays the kernel wrote, wrapped by ``torch.from_numpy``.

Importing this module needs PyTorch; the rest of fastattn does not.
"""
from __future__ import annotations

import contextlib
import math
import numbers
import sys
import threading
from typing import Any, Iterator, Optional, Sequence, Tuple, Union

import numpy as np

try:
    import torch
except ImportError as _exc:  # torch stays an optional dependency of fastattn
    raise ImportError("fastattn.torch needs PyTorch: pip install torch==2.13.0 "
                      f"(importing torch failed: {_exc})") from _exc

from torch import Tensor

import fastattn
from . import _args

__all__ = ["scaled_dot_product_attention", "sdpa_kernel", "enable", "disable", "is_enabled",
           "attention_fwd", "attention_bwd", "attention", "quantize_kv"]

_FN = "fastattn.torch.scaled_dot_product_attention"
# causal codes of the ops: 0 none, 1 bottom-right, 2 top-left (PyTorch's is_causal)
_CAUSAL_CODES = {False: 0, True: 1, "bottom-right": 1, "top-left": 2}
_NATIVE = (torch.float32, torch.float64)
_HALF = (torch.float16, torch.bfloat16)
# ml_dtypes.bfloat16 where fastattn reads bfloat16 arrays (else bfloat16 is computed on
# float32 copies); float16 runs natively in inference, in float32 with gradients
_BF16_NP = _args.bf16(load=True)
_GRAIN = 1 << 19  # multiply-adds (B·Hq·Lq·Lk·2D) below which a call runs on one thread


# --------------------------------------------------------------------------------------
# The registered ops.  Their arguments are what torch.library schemas can carry: the
# causal mode as an int code, the window as two ints (-1 = unbounded), softcap 0 = off,
# and dropout's seed as an int64 tensor (drawn in the graph, so torch.compile needs no
# Python int from a tensor and torch.manual_seed makes runs reproducible).

def _np(t: Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor's memory (no copy); bfloat16 as ml_dtypes'."""
    if t.requires_grad:
        t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_BF16_NP)
    return t.numpy()


def _pt(a: np.ndarray) -> Tensor:
    """The tensor of a NumPy array's memory (no copy)."""
    if a.dtype == _BF16_NP:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _options(q: Tensor, k: Tensor, mask: Optional[Tensor], bias: Optional[Tensor],
             alibi_slopes: Optional[Tensor], scale: float, causal: int, window_left: int,
             window_right: int, softcap: float, dropout_p: float,
             seed: Optional[Tensor], sinks: Optional[Tensor] = None) -> dict:
    """The keywords of fastattn.attention / attention_backward for the ops' arguments.
    Only what differs from the defaults is passed, so a plain call takes fastattn's
    short compiled path."""
    D, Lq, Lk = q.shape[-1], q.shape[-2], k.shape[-2]
    kw: dict = {"num_threads": _threads(q.numel() * Lk * 2)}
    if scale != (1.0 / math.sqrt(D) if D > 0 else 1.0):
        kw["scale"] = scale
    if causal == 1 or (causal == 2 and Lq == Lk):  # equal lengths: the same alignment
        kw["causal"] = True
    elif causal == 2:
        kw["causal"] = "top-left"
    elif causal != 0:
        raise ValueError(f"fastattn.torch: causal code must be 0 (none), 1 (bottom-right) "
                         f"or 2 (top-left), got {causal}")
    if window_left != -1 or window_right != -1:
        kw["window"] = (window_left, window_right)
    if mask is not None:
        kw["mask"] = _np(mask)
    if bias is not None:
        kw["bias"] = _np(bias)
    if alibi_slopes is not None:
        kw["alibi_slopes"] = _np(alibi_slopes)
    if softcap != 0.0:
        kw["softcap"] = softcap
    if dropout_p != 0.0:
        if seed is None:
            raise ValueError("fastattn.torch: dropout_p > 0 needs a seed tensor")
        kw["dropout_p"] = dropout_p
        kw["seed"] = int(seed)
    if sinks is not None:
        kw["sinks"] = _np(sinks)
    return kw


@torch.library.custom_op("fastattn::attention_fwd", mutates_args=(), device_types="cpu")
def attention_fwd(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], bias: Optional[Tensor],
                  alibi_slopes: Optional[Tensor], scale: float, causal: int, window_left: int,
                  window_right: int, softcap: float, dropout_p: float,
                  seed: Optional[Tensor], sinks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """fastattn.attention on CPU tensors (q, k, v as fastattn takes them: (L, D),
    (H, L, D) or (B, H, L, D), "bhsd"); returns (out, lse), both written by the kernel.

    causal: 0 none, 1 bottom-right, 2 top-left; window_left/right: -1 = unbounded;
    softcap: 0 = off; seed: an int64 tensor in [0, 2**63), needed when dropout_p > 0;
    sinks: (Hq,) attention sinks or None.
    """
    kw = _options(q, k, mask, bias, alibi_slopes, scale, causal, window_left, window_right,
                  softcap, dropout_p, seed, sinks)
    out, lse = fastattn.attention(_np(q), _np(k), _np(v), return_lse=True, **kw)
    return _pt(out), _pt(lse)


def _threads(work: int) -> int:
    """torch's thread count, but one thread for a small call (`work` multiply-adds), as
    torch's parallel_for does below its grain size: waking a second thread costs more
    than it saves (tens of microseconds on an idle machine, milliseconds on a busy
    one)."""
    return torch.get_num_threads() if work >= _GRAIN else 1


# torch.profiler shows the registered ops by themselves; the calls that bypass the
# dispatcher (eager inference) are labelled here, at the cost of one check (~70 ns)
# when no profiler runs
_profiling = torch._C._autograd._profiler_enabled


def _labelled(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs), inside a ``fastattn::attention_fwd`` profiler range when a
    profiler runs."""
    if _profiling():
        with torch.profiler.record_function("fastattn::attention_fwd"):
            return fn(*args, **kwargs)
    return fn(*args, **kwargs)


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, mask, bias, alibi_slopes, scale, causal, window_left,
                        window_right, softcap, dropout_p, seed, sinks=None):
    out = q.new_empty(tuple(q.shape[:-1]) + (v.shape[-1],))
    lse = q.new_empty(tuple(q.shape[:-1]), dtype=_lse_dtype(q.dtype))
    return out, lse


@torch.library.custom_op("fastattn::attention_bwd", mutates_args=(), device_types="cpu")
def attention_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                  mask: Optional[Tensor], bias: Optional[Tensor], alibi_slopes: Optional[Tensor],
                  scale: float, causal: int, window_left: int, window_right: int, softcap: float,
                  dropout_p: float, seed: Optional[Tensor],
                  need_dbias: bool, sinks: Optional[Tensor] = None,
                  need_dsinks: bool = False) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """fastattn.attention_backward on CPU tensors: (dq, dk, dv, dbias, dsinks); dbias has
    the bias's shape and dtype with ``need_dbias``, dsinks the sinks' with
    ``need_dsinks``; else each is an empty tensor."""
    kw = _options(q, k, mask, bias, alibi_slopes, scale, causal, window_left, window_right,
                  softcap, dropout_p, seed, sinks)
    res = list(fastattn.attention_backward(_np(dout), _np(q), _np(k), _np(v), _np(out), _np(lse),
                                           return_dbias=need_dbias, return_dsinks=need_dsinks,
                                           **kw))
    dsinks = q.new_empty((0,))
    if need_dsinks:
        assert sinks is not None
        dsinks = torch.from_numpy(res.pop()).to(sinks.dtype)
    if need_dbias:
        assert bias is not None
        dbias = _pt(res[3].astype(_np(bias).dtype, copy=False))
    else:
        dbias = q.new_empty((0,))
    return _pt(res[0]), _pt(res[1]), _pt(res[2]), dbias, dsinks


@attention_bwd.register_fake
def _attention_bwd_fake(dout, q, k, v, out, lse, mask, bias, alibi_slopes, scale, causal,
                        window_left, window_right, softcap, dropout_p, seed, need_dbias,
                        sinks=None, need_dsinks=False):
    dbias = bias.new_empty(bias.shape) if need_dbias and bias is not None else q.new_empty((0,))
    dsinks = sinks.new_empty(sinks.shape) if need_dsinks and sinks is not None else q.new_empty((0,))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias, dsinks


def _setup_context(ctx, inputs, output):
    q, k, v, mask, bias, alibi_slopes, *opts, seed, sinks = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, mask, bias, alibi_slopes, seed, sinks)
    ctx.opts = tuple(opts)  # scale, causal, window_left, window_right, softcap, dropout_p
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, mask, bias, alibi_slopes, seed, sinks = ctx.saved_tensors
    if dout is None and dlse is None:
        return (None,) * 14
    if dout is None:
        dout = torch.zeros_like(out)
    extra = dlse is not None
    if extra:
        # d lse_i / d s_ij is the weight p_ij.  The backward subtracts the row term
        # D_i = sum(dout_i * out_i) from dP_ij = dout_i . v_j; one more value column,
        # 0 in v, 1 in dout and -dlse_i in out, leaves dP unchanged and turns D_i into
        # D_i - dlse_i, which adds p_ij * dlse_i to the logits' gradient.
        v = torch.cat([v, v.new_zeros(tuple(v.shape[:-1]) + (1,))], -1)
        dout = torch.cat([dout, dout.new_ones(tuple(dout.shape[:-1]) + (1,))], -1)
        out = torch.cat([out, -dlse.to(out.dtype).unsqueeze(-1)], -1)
    need_dbias = bias is not None and ctx.needs_input_grad[4]
    need_dsinks = sinks is not None and ctx.needs_input_grad[13]
    dq, dk, dv, dbias, dsinks = torch.ops.fastattn.attention_bwd(
        dout, q, k, v, out, lse, mask, bias, alibi_slopes, *ctx.opts, seed, need_dbias, sinks,
        need_dsinks)
    if extra:
        dv = dv[..., :-1]
    return ((dq, dk, dv, None, dbias if need_dbias else None) + (None,) * 8
            + (dsinks if need_dsinks else None,))


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------
# scaled_dot_product_attention

class _Plan:
    """One call, checked and in the ops' terms; run() does the work."""
    __slots__ = ("q", "k", "v", "mask", "bias", "alibi", "scale", "causal", "window",
                 "softcap", "dropout_p", "dtype", "lead", "return_lse", "logits", "sinks")

    def run(self):
        q, k, v, mask, bias, alibi = self.q, self.k, self.v, self.mask, self.bias, self.alibi
        seed = None
        if self.dropout_p > 0:
            # from torch's default CPU generator: torch.manual_seed makes runs reproducible
            seed = torch.randint(0, 2**62, (), dtype=torch.int64)
        args = (q, k, v, mask, bias, alibi, self.scale, self.causal, self.window[0],
                self.window[1], self.softcap, self.dropout_p, seed, self.sinks)
        if _direct(q, k, v, bias, self.sinks, (mask, alibi)):
            # eager inference on plain tensors: the op's own function, without the
            # dispatcher's ~40 us (the same code and results as the registered op)
            kw = _options(q, k, mask, bias, alibi, *args[6:])
            res = _labelled(fastattn.attention, _np(q), _np(k), _np(v), return_lse=self.return_lse,
                            **kw)
            if self.return_lse:
                out, lse = _pt(res[0]), _pt(res[1])
            else:
                out, lse = _pt(res), None
        else:
            out, lse = torch.ops.fastattn.attention_fwd(*args)
        if self.lead is not None:  # more than 4 dims, flattened into the batch
            out = out.reshape(self.lead + tuple(out.shape[-2:]))
            if lse is not None:
                lse = lse.reshape(self.lead + (lse.shape[-1],))
        if out.dtype != self.dtype:  # computed on float32 copies
            out = out.to(self.dtype)
        return (out, lse) if self.return_lse else out


def _direct(q, k, v, bias, sinks=None, others=()) -> bool:
    """True where calling the op's Python function directly is the same as calling the
    op: eager mode, plain CPU tensors (q, k, v, bias, sinks and the `others`, each a
    tensor or None), no autograd, no dispatch or function modes and no functorch
    transform."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (bias is not None and bias.requires_grad)
                                    or (sinks is not None and sinks.requires_grad)):
        return False
    return (type(q) is Tensor and type(k) is Tensor and type(v) is Tensor
            and all(t is None or type(t) is Tensor for t in (bias, sinks) + tuple(others))
            and not torch.compiler.is_compiling()
            and torch._C._len_torch_dispatch_stack() == 0
            and not torch._C._is_torch_function_mode_enabled()
            and torch._C._functorch.peek_interpreter_stack() is None)


def _device_problem(tensors) -> Optional[Tuple[type, str]]:
    if all(t is None or t.is_cpu for _, t in tensors):
        return None
    devices = {name: t.device for name, t in tensors if t is not None}
    desc = ", ".join(f"{n} on '{d}'" for n, d in devices.items())
    if any(d.type == "cpu" for d in devices.values()):
        return ValueError, (f"{_FN}: tensors on different devices ({desc}); fastattn runs on "
                            f"the CPU: move them all there")
    return ValueError, (f"{_FN}: {desc}; fastattn runs on the CPU: move the tensors there "
                        f"with .cpu(), or use torch.nn.functional.scaled_dot_product_attention "
                        f"(fastattn.torch.sdpa_kernel() falls back to it by itself)")


def _broadcast(*shapes) -> Optional[tuple]:
    """The shape the given shapes broadcast to (right-aligned, NumPy's rules), or None."""
    first = tuple(shapes[0])
    if all(tuple(s) == first for s in shapes[1:]):
        return first
    n = max(len(s) for s in shapes)
    out = []
    for i in range(n, 0, -1):
        size = 1
        for s in shapes:
            if len(s) >= i:
                d = s[len(s) - i]
                if d != 1:
                    if size != 1 and size != d:
                        return None
                    size = d
        out.append(size)
    return tuple(out)


def _shape_str(*named) -> str:
    return ", ".join(f"{n} {tuple(t.shape)}" for n, t in named)


def _plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window,
          alibi_slopes, softcap, causal, return_lse,
          sinks=None) -> Union[_Plan, Tuple[type, str]]:
    """The checked call, or (exception type, message) of what is wrong with it.  Does no
    work beyond views, so a caller can still hand the call to PyTorch instead.  The
    checks run in this order: the arguments' types, the tensors (devices, dtypes, ranks),
    the leading dims, attn_mask, the options, alibi_slopes."""
    problem = _type_problem(query, key, value, attn_mask)
    if problem is None:
        if alibi_slopes is not None and not isinstance(alibi_slopes, Tensor):
            alibi_slopes = torch.as_tensor(np.asarray(alibi_slopes))
        problem = _tensor_problem(query, key, value, attn_mask, alibi_slopes)
    if problem is not None:
        return problem
    plan = _Plan()
    problem = (_broadcast_inputs(plan, query, key, value, enable_gqa)
               or _split_mask(plan, attn_mask, query.dtype)
               or _parse_options(plan, query, key, dropout_p, is_causal, causal, scale, window,
                                 softcap)
               or _alibi_problem(alibi_slopes, plan.logits))
    if problem is not None:
        return problem
    if sinks is not None:
        if not isinstance(sinks, Tensor):
            sinks = torch.as_tensor(np.asarray(sinks))
        hq = plan.logits[-3] if len(plan.logits) >= 3 else 1
        if tuple(sinks.shape) != (hq,) or not sinks.is_cpu:
            return ValueError, (f"{_FN}: sinks must be a CPU tensor of shape (Hq,) = ({hq},), "
                                f"one logit per query head, got {tuple(sinks.shape)} on {sinks.device}")
        if not sinks.dtype.is_floating_point:
            sinks = sinks.double()
    plan.sinks = sinks
    _finish(plan, alibi_slopes, query.dtype, return_lse)
    return plan


def _type_problem(query, key, value, attn_mask) -> Optional[Tuple[type, str]]:
    """query, key and value must be tensors, attn_mask a tensor or None."""
    if not (isinstance(query, Tensor) and isinstance(key, Tensor) and isinstance(value, Tensor)):
        name, t = next((n, t) for n, t in (("query", query), ("key", key), ("value", value))
                       if not isinstance(t, Tensor))
        return TypeError, f"{_FN}: {name} must be a torch.Tensor, got {type(t).__name__}"
    if attn_mask is not None and not isinstance(attn_mask, Tensor):
        return TypeError, (f"{_FN}: attn_mask must be a torch.Tensor or None, got "
                           f"{type(attn_mask).__name__}")
    return None


def _tensor_problem(query, key, value, attn_mask, alibi_slopes) -> Optional[Tuple[type, str]]:
    """The tensors on the CPU, not nested, of one supported dtype, at least 2-D, with
    the feature size E of query and key and the length S of key and value equal."""
    problem = _device_problem((("query", query), ("key", key), ("value", value),
                               ("attn_mask", attn_mask), ("alibi_slopes", alibi_slopes)))
    if problem is not None:
        return problem
    if query.is_nested or key.is_nested or value.is_nested:
        return TypeError, f"{_FN}: nested tensors are not supported"
    dt = query.dtype
    if key.dtype != dt or value.dtype != dt:
        return TypeError, (f"{_FN}: query, key and value must have the same dtype, got "
                           f"{query.dtype}, {key.dtype} and {value.dtype}")
    if dt not in _NATIVE and dt not in _HALF:
        return TypeError, (f"{_FN}: unsupported dtype {dt}; fastattn computes in float32 and "
                           f"float64, and float16 and bfloat16 with float32 accumulation")
    qs, ks, vs = query.shape, key.shape, value.shape
    if len(qs) < 2 or len(ks) < 2 or len(vs) < 2:
        return ValueError, (f"{_FN}: query, key and value must be at least 2-D (..., L, E), "
                            f"got " + _shape_str(("query", query), ("key", key), ("value", value)))
    if ks[-1] != qs[-1] or vs[-2] != ks[-2]:
        return ValueError, (f"{_FN}: query and key must share the feature size E and key and "
                            f"value the length S; got " +
                            _shape_str(("query", query), ("key", key), ("value", value)))
    return None


def _broadcast_inputs(plan: _Plan, query, key, value, enable_gqa) -> Optional[Tuple[type, str]]:
    """plan.q, k, v with their leading dims broadcast as in torch's function (with
    enable_gqa the head axis (-3) of key/value may divide query's instead, which fastattn
    reads without copying), and plan.logits, the weights' shape (..., L, S)."""
    qs, ks, vs = query.shape, key.shape, value.shape
    q, k, v = query, key, value
    axes = 2
    if enable_gqa and len(qs) >= 3 and len(ks) >= 3 and len(vs) >= 3 \
            and (ks[-3] != qs[-3] or vs[-3] != qs[-3]):
        hq, hk, hv = qs[-3], ks[-3], vs[-3]
        if hk == 0 or hv == 0 or hq % hk or hq % hv:
            return ValueError, (f"{_FN}: with enable_gqa the number of heads of key ({hk}) "
                                f"and value ({hv}) must divide query's ({hq})")
        if hk != hv:  # rare: bring both to query's heads (a copy), as torch does
            k = k.repeat_interleave(hq // hk, -3)
            v = v.repeat_interleave(hq // hv, -3)
            ks, vs = k.shape, v.shape
        else:
            axes = 3
    lead = _broadcast(qs[:-axes], ks[:-axes], vs[:-axes])
    if lead is None:
        return ValueError, (f"{_FN}: the leading (batch, head) dims of query, key and value do "
                            "not broadcast" + (" (with enable_gqa, key/value heads must divide "
                                               "query's)" if enable_gqa else
                                               " (different head counts need enable_gqa=True)")
                            + "; got " + _shape_str(("query", query), ("key", key), ("value", value)))
    if qs[:-axes] != lead:
        q = q.expand(lead + tuple(qs[-axes:]))
    if ks[:-axes] != lead:
        k = k.expand(lead + tuple(ks[-axes:]))
    if vs[:-axes] != lead:
        v = v.expand(lead + tuple(vs[-axes:]))
    plan.q, plan.k, plan.v = q, k, v
    plan.logits = lead + tuple(qs[-axes:-1]) + (key.shape[-2],)
    return None


def _split_mask(plan: _Plan, attn_mask, dt) -> Optional[Tuple[type, str]]:
    """plan.mask (a bool attn_mask) or plan.bias (a float one, float32 or query's dtype
    `dt`, torch's rule), checked to broadcast to plan.logits."""
    plan.mask = plan.bias = None
    if attn_mask is not None:
        md = attn_mask.dtype
        if md == torch.bool:
            plan.mask = attn_mask
        elif md == dt or md == torch.float32:  # torch's rule: bool, float, or query's dtype
            plan.bias = attn_mask
        else:
            return TypeError, (f"{_FN}: attn_mask must be bool (True = attend) or a float mask "
                               f"in float32 or the query's dtype ({dt}), got {md}")
        if _broadcast(attn_mask.shape, plan.logits) != plan.logits:
            return ValueError, (f"{_FN}: attn_mask of shape {tuple(attn_mask.shape)} does not "
                                f"broadcast to the attention weights' shape {plan.logits}")
    return None


def _parse_options(plan: _Plan, query, key, dropout_p, is_causal, causal, scale, window,
                   softcap) -> Optional[Tuple[type, str]]:
    """plan.dropout_p, causal (the ops' code: is_causal and fastattn's causal combined),
    scale, window and softcap, checked."""
    E, Lq, Lk = query.shape[-1], query.shape[-2], key.shape[-2]
    if not (type(dropout_p) is float or type(dropout_p) is int
            or isinstance(dropout_p, numbers.Real) and not isinstance(dropout_p, bool)) \
            or not 0.0 <= float(dropout_p) < 1.0:
        return ValueError, f"{_FN}: dropout_p must be a float in [0, 1), got {dropout_p!r}"
    if isinstance(is_causal, bool):
        code = 2 if is_causal else 0
    else:
        return TypeError, f"{_FN}: is_causal must be a bool, got {type(is_causal).__name__}"
    if causal is not None:
        if isinstance(causal, np.bool_):
            causal = bool(causal)
        if not isinstance(causal, (bool, str)) or causal not in _CAUSAL_CODES:
            return ValueError, (f"{_FN}: causal must be None, False, True, 'bottom-right' or "
                                f"'top-left', got {causal!r}")
        c = _CAUSAL_CODES[causal]
        if is_causal and c not in (0, 2) and Lq != Lk:
            return ValueError, (f"{_FN}: is_causal=True (top-left) and causal={causal!r} "
                                "(bottom-right) disagree when L != S; pass one of them")
        code = max(code, c)
    if scale is None:
        scale_f = 1.0 / math.sqrt(E) if E > 0 else 1.0
    else:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            return TypeError, f"{_FN}: scale must be a float or None, got {type(scale).__name__}"
        scale_f = float(scale)
        if not math.isfinite(scale_f):
            return ValueError, f"{_FN}: scale must be finite, got {scale!r}"
    try:
        wl, wr = _args.parse_window(window, "torch.scaled_dot_product_attention")
        cap = _args.parse_softcap(softcap, "torch.scaled_dot_product_attention")
    except (ValueError, TypeError) as e:
        return type(e), str(e)
    plan.scale, plan.causal, plan.window, plan.softcap = scale_f, code, (wl, wr), cap
    plan.dropout_p = float(dropout_p)
    return None


def _alibi_problem(alibi_slopes, logits) -> Optional[Tuple[type, str]]:
    """alibi_slopes (Hq,) or (..., Hq) of the leading dims, real, with no gradient."""
    nd = len(logits)
    if alibi_slopes is not None:
        hq = logits[-3] if nd >= 3 else 1
        shapes_ok = [(hq,)] + ([logits[:-3] + (hq,)] if nd >= 4 else [])
        if tuple(alibi_slopes.shape) not in shapes_ok:
            return ValueError, (f"{_FN}: alibi_slopes must have shape "
                                f"{' or '.join(map(str, shapes_ok))}, got {tuple(alibi_slopes.shape)}")
        if alibi_slopes.dtype.is_complex or alibi_slopes.dtype == torch.bool:
            return TypeError, f"{_FN}: alibi_slopes must be real, got {alibi_slopes.dtype}"
        if alibi_slopes.requires_grad and torch.is_grad_enabled():
            return ValueError, (f"{_FN}: alibi_slopes gets no gradient from fastattn; pass "
                                "alibi_slopes.detach()")
    return None


def _finish(plan: _Plan, alibi_slopes, dt, return_lse) -> None:
    """The checked plan made what the ops take: float32 copies where fastattn does not
    compute in `dt`, more than 4 dims flattened into the batch."""
    q, k, v, mask, bias, logits = plan.q, plan.k, plan.v, plan.mask, plan.bias, plan.logits
    # float16 in training (fastattn has no float16 backward), and bfloat16 where fastattn
    # does not read it: computed on float32 copies, the output cast back
    if (dt == torch.bfloat16 and _BF16_NP is None) or (
            dt == torch.float16 and torch.is_grad_enabled()
            and any(t is not None and t.requires_grad for t in (q, k, v, bias, plan.sinks))):
        q, k, v = q.float(), k.float(), v.float()
        if bias is not None:
            bias = bias.float()
    plan.lead = None
    if len(logits) > 4:  # fastattn takes (B, H, L, E): the leading dims become the batch
        plan.lead = logits[:-2]
        q, k, v = (t.reshape((-1,) + tuple(t.shape[-3:])) for t in (q, k, v))
        if mask is not None and mask.dim() > 3:
            mask = mask.expand(logits).reshape((-1,) + logits[-3:])
        if bias is not None and bias.dim() > 3:
            bias = bias.expand(logits).reshape((-1,) + logits[-3:])
        if alibi_slopes is not None and alibi_slopes.dim() > 1:
            alibi_slopes = alibi_slopes.reshape(-1, alibi_slopes.shape[-1])
    plan.q, plan.k, plan.v, plan.mask, plan.bias, plan.alibi = q, k, v, mask, bias, alibi_slopes
    plan.dtype, plan.return_lse = dt, bool(return_lse)


def scaled_dot_product_attention(
        query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
        dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
        enable_gqa: bool = False, *, window: Optional[Tuple[Optional[int], Optional[int]]] = None,
        alibi_slopes: Union[Tensor, Sequence[float], None] = None, softcap: Optional[float] = None,
        causal: Union[bool, str, None] = None, sinks: Optional[Tensor] = None,
        return_lse: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """``torch.nn.functional.scaled_dot_product_attention`` computed by fastattn.

    The arguments it shares with PyTorch's function have PyTorch's meaning:

    Parameters
    ----------
    query : Tensor (..., L, E)
    key : Tensor (..., S, E)
    value : Tensor (..., S, Ev)
        CPU tensors of one dtype: float32, float64, bfloat16 (read natively, computed
        in float32, its gradients through float32 copies) or float16 (native in
        inference; with gradients computed on float32 copies).  The
        leading dims broadcast against each other as in PyTorch (any number of them;
        more than two are flattened into the batch).
    attn_mask : Tensor, optional
        Broadcastable to (..., L, S).  bool: True = attend.  float (float32 or the
        query's dtype): added to the scaled logits; if it requires grad, its gradient
        is computed (summed over the axes it was broadcast along).
    dropout_p : float in [0, 1)
        Applied whenever > 0, as PyTorch's function does (modules pass 0 in eval
        mode).  The drop decisions come from a seed drawn from torch's default CPU
        generator, so ``torch.manual_seed`` makes a run reproducible; the backward
        drops the same weights.  (The dropped weights differ from PyTorch's.)
    is_causal : bool
        Top-left causal mask: key j is visible to query i iff j <= i.  With an
        `attn_mask` too, a key must pass both.  (PyTorch 2.13 does that in its CPU
        flash kernel, 4-D inputs with L == S, and raises "Explicit attn_mask should not
        be set when is_causal=True" otherwise; :func:`sdpa_kernel` leaves such calls
        to PyTorch.)
    scale : float, optional
        Default ``1 / sqrt(E)``.
    enable_gqa : bool
        Key/value heads (axis -3) may divide query's: query head h reads key/value head
        h // (Hq / Hkv), without copying key and value.  Without it the head axes must
        broadcast, as in PyTorch.

    fastattn's variants, as keywords (see ``fastattn.attention``):

    window : (left, right), optional
        Sliding window around each query's diagonal; -1 or None = unbounded side.
    alibi_slopes : Tensor (Hq,) or (B, Hq), optional
        ALiBi biases ``-slope * |i + S - L - j|`` (no gradient).
    softcap : float, optional
        Logit soft-capping ``softcap * tanh(s / softcap)``.
    causal : bool or {'bottom-right', 'top-left'}, optional
        fastattn's causal keyword: True or 'bottom-right' aligns the last query with the
        last key (decoding against a cache), 'top-left' is ``is_causal``.
    sinks : Tensor (Hq,), optional
        Attention sinks (gpt-oss): one logit per query head, not scaled, that joins
        each row's softmax as a key with a zero value (``fastattn.attention``'s
        `sinks`); differentiable.  Hq is the head axis (-3) of query.
    return_lse : bool
        Also return ``lse`` (..., L), the natural log of each row's softmax
        denominator (float32, float64 for float64 inputs); it is differentiable too.

    Returns
    -------
    out : Tensor (..., L, Ev), in the query's dtype; it shares memory with what the
        kernel wrote (no copy), except where a float16 result is cast back.
    lse : Tensor (..., L), only with ``return_lse=True``.

    Notes
    -----
    Differences from PyTorch 2.13's function (each checked on its CPU backends):

    - A row that sees no key (all masked) gives 0, as PyTorch does on the CPU, and
      lse -inf; its gradients are 0 too.
    - ``is_causal`` with `attn_mask` applies both (see above).
    - ``dropout_p`` must be < 1 (PyTorch also takes 1), and the dropped weights are
      fastattn's (Philox keyed by the seed drawn from torch's generator), not
      PyTorch's: the same probability, different draws.
    - ``enable_gqa`` with 2-D inputs is ignored (there is no head axis; PyTorch raises).
    - Errors are ``ValueError``/``TypeError`` naming the argument where PyTorch raises
      ``RuntimeError``; tensors must be on the CPU (:func:`sdpa_kernel` hands other
      devices to PyTorch instead).
    - No double backward: the backward op has no autograd formula of its own.
    - ``attn_mask`` may be a ``torch.nn.attention.bias.CausalBias``: ``causal_upper_left``
      is ``is_causal``, ``causal_lower_right`` is ``causal='bottom-right'`` (its lengths
      must be L and S); its memory, a placeholder, is never read.

    docs/semantics.md §19 lists these differences with their reasons, and what routing
    does with CausalBias, ``__torch_function__`` subclasses, TorchScript and export.

    ``torch.compile(fullgraph=True)`` traces the call without a graph break: the Python
    arguments become constants of the graph and the ops have fake implementations.
    Calls whose work (B·Hq·L·S·2E multiply-adds) is under 2**19 run on one thread, as
    PyTorch's ``parallel_for`` does below its grain size; others on
    ``torch.get_num_threads()``.
    """
    if attn_mask is not None and _is_causal_bias(attn_mask):
        # its memory is a placeholder: the causal mask it stands for instead
        if is_causal:
            raise ValueError("CausalBias should not be used with causal=True")
        if causal not in (None, False):
            raise ValueError(f"{_FN}: attn_mask is a CausalBias, a causal mask itself; pass "
                             f"it or causal={causal!r}, not both")
        if isinstance(query, Tensor) and isinstance(key, Tensor) and query.dim() >= 2 \
                and key.dim() >= 2:
            causal = _causal_bias_mode(attn_mask, query, key)
            if causal is None:
                raise ValueError(
                    f"{_FN}: attn_mask is causal_lower_right({attn_mask.seq_len_q}, "
                    f"{attn_mask.seq_len_kv}) but query and key have lengths L={query.shape[-2]}"
                    f" and S={key.shape[-2]}")
        attn_mask = None
    plan = _plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                 window, alibi_slopes, softcap, causal, return_lse, sinks)
    if not isinstance(plan, _Plan):
        raise plan[0](plan[1])
    return plan.run()


# --------------------------------------------------------------------------------------
# Routing torch.nn.functional.scaled_dot_product_attention

_POSITIONAL = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
_KEYWORDS = frozenset(_POSITIONAL + ("scale", "enable_gqa"))
_lock = threading.RLock()
_original: Any = None  # torch's function, saved when routing is switched on


def _routed_sdpa(*args: Any, **kwargs: Any) -> Any:
    """torch.nn.functional.scaled_dot_product_attention while routing is on: fastattn
    for what it takes, PyTorch's own function (called as it was called) for the rest.

    Three kinds of call step aside rather than being read as plain tensors:

    - A ``torch.nn.attention.bias.CausalBias`` mask is taken for what it means:
      ``causal_upper_left`` is fastattn's top-left causal mask (``is_causal``),
      ``causal_lower_right`` its bottom-right one; the placeholder tensor's memory is
      never read.
    - Any other tensor subclass that overrides ``__torch_function__`` goes to PyTorch's
      function, which dispatches it as without routing (``func`` is PyTorch's function,
      what nested jagged tensors look for).  An active ``TorchFunctionMode`` gets the
      protocol with this function as ``func``; the call it lets through runs here.
    - Under ``torch.export``/``torch.compile``, sizes that depend on data (unbacked
      symbols) go to PyTorch's function, which records its own op.

    TorchScript never runs this function: it is registered as the builtin
    ``aten::scaled_dot_product_attention``, so scripted code calls PyTorch's op.
    """
    original = _original
    if 3 <= len(args) <= 6 and _KEYWORDS.issuperset(kwargs):
        call = dict(zip(_POSITIONAL, args))
        if len(call) + len(kwargs) == len(set(call) | set(kwargs)):  # nothing passed twice
            call.update(kwargs)
            q, k, v, mask = call["query"], call["key"], call["value"], call.get("attn_mask")
            compiling = torch.compiler.is_compiling()
            if mask is not None and _is_causal_bias(mask):
                out = _causal_bias_call(call)
                if out is not None:
                    return out
            tensors = tuple(t for t in (q, k, v, mask) if isinstance(t, Tensor))
            if torch.overrides.has_torch_function(tensors):
                if any(_overrides_torch_function(t) for t in tensors) \
                        and not (mask is not None and _is_causal_bias(mask)):
                    # a __torch_function__ subclass: PyTorch's function dispatches it,
                    # with func the function PyTorch's own subclasses (nested jagged
                    # tensors) look for
                    return original(*args, **kwargs)
                # a TorchFunctionMode, or a CausalBias that fastattn does not take: the
                # protocol with func the public function (CausalBias looks for it), which
                # comes back here once the mode or subclass has done its part
                return torch.overrides.handle_torch_function(
                    torch.nn.functional.scaled_dot_product_attention, tensors, *args, **kwargs)
            if (compiling or any(type(t) is not Tensor for t in tensors)) \
                    and _unbacked(tensors):
                return original(*args, **kwargs)
            # is_causal with a mask: PyTorch's kernels disagree (one applies both, the
            # math backend raises), so PyTorch decides
            if call.get("is_causal") and mask is not None:
                return original(*args, **kwargs)
            plan = _plan(q, k, v, mask, call.get("dropout_p", 0.0), call.get("is_causal", False),
                         call.get("scale"), call.get("enable_gqa", False),
                         None, None, None, None, False)
            if isinstance(plan, _Plan):
                return plan.run()
    return original(*args, **kwargs)


# TorchScript resolves a Python function it calls through this table (by the object's
# id) before compiling its source: scripted code that reaches
# torch.nn.functional.scaled_dot_product_attention while routing is on (nn.MultiheadAttention,
# nn.TransformerEncoderLayer) compiles to PyTorch's op, as it does without routing.
try:
    torch.jit._builtins._register_builtin(_routed_sdpa, "aten::scaled_dot_product_attention")
except AttributeError:  # a PyTorch without this private table: scripting a routed call
    pass                # then fails to compile, as it did before the registration


def _overrides_torch_function(t: Tensor) -> bool:
    """Whether t's class overrides __torch_function__ (plain tensors, nn.Parameter,
    FakeTensor and the classes that disable it do not)."""
    cls = type(t)
    if cls is Tensor:
        return False
    tf = getattr(cls, "__torch_function__", None)
    if tf is torch._C._disabled_torch_function_impl:
        return False
    return getattr(tf, "__func__", tf) is not Tensor.__torch_function__.__func__


def _unbacked(tensors) -> bool:
    """Whether any size of the tensors is a data-dependent (unbacked) symbol, as
    torch.export makes of sizes that come from data (boolean indexing, .item()).
    (torch.compile answers has_free_unbacked_symbols from the traced example values.)"""
    # imported here: symbolic_shapes loads sympy, which plain eager use never needs
    from torch.fx.experimental.symbolic_shapes import has_free_unbacked_symbols
    return any(has_free_unbacked_symbols(t) for t in tensors)


def _is_causal_bias(mask: Any) -> bool:
    """Whether mask is a torch.nn.attention.bias.CausalBias.  Looked up in sys.modules:
    importing that module loads torch._dynamo (about a second), and a CausalBias exists
    only once it has been imported."""
    if type(mask) is Tensor:
        return False
    bias_module = sys.modules.get("torch.nn.attention.bias")
    return bias_module is not None and isinstance(mask, bias_module.CausalBias)


def _causal_bias_mode(bias: Any, q: Tensor, k: Tensor) -> Optional[str]:
    """fastattn's `causal` for a CausalBias on these query and key tensors, by
    CausalBias's own rules: equal lengths or the upper-left variant are PyTorch's
    is_causal ('top-left'); lower-right aligns the last query with the last key
    ('bottom-right') and its lengths must be the call's (else None: PyTorch
    materializes such a bias and broadcasts it)."""
    from torch.nn.attention.bias import CausalVariant
    if bias.variant == CausalVariant.UPPER_LEFT or bias.seq_len_q == bias.seq_len_kv:
        return "top-left"
    if bias.variant == CausalVariant.LOWER_RIGHT \
            and (bias.seq_len_q, bias.seq_len_kv) == (q.shape[-2], k.shape[-2]):
        return "bottom-right"
    return None


def _causal_bias_call(call: dict) -> Any:
    """A routed call with a CausalBias mask computed by fastattn as the causal mask it
    stands for, or None where fastattn does not take it (PyTorch's protocol decides
    then).  is_causal=True with a CausalBias is an error, as in PyTorch."""
    if call.get("is_causal"):
        raise ValueError("CausalBias should not be used with causal=True")
    q, k = call["query"], call["key"]
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and q.dim() >= 2 and k.dim() >= 2):
        return None
    causal = _causal_bias_mode(call["attn_mask"], q, k)
    if causal is None:
        return None
    plan = _plan(q, k, call["value"], None, call.get("dropout_p", 0.0), False, call.get("scale"),
                 call.get("enable_gqa", False), None, None, None, causal, False)
    return plan.run() if isinstance(plan, _Plan) else None


def is_enabled() -> bool:
    """Whether torch.nn.functional.scaled_dot_product_attention is routed through fastattn."""
    return torch.nn.functional.scaled_dot_product_attention is _routed_sdpa


def enable() -> None:
    """Route ``torch.nn.functional.scaled_dot_product_attention`` through fastattn
    (process-wide) until :func:`disable`: calls on CPU tensors that fastattn takes run
    :func:`scaled_dot_product_attention`; the others (CUDA or meta tensors, other dtypes,
    arguments it does not take) run PyTorch's function unchanged.  Code that looks the
    function up when it calls it (``torch.nn.functional.scaled_dot_product_attention``,
    ``F.scaled_dot_product_attention``, ``torch.nn.MultiheadAttention`` outside its fast
    path, ``transformers``' SDPA attention) is routed; a reference taken before (``from
    torch.nn.functional import scaled_dot_product_attention``) is not.

    A ``torch.nn.attention.bias.CausalBias`` mask runs as fastattn's causal mask
    (upper-left: top-left, lower-right: bottom-right; with gradients); other tensor
    subclasses that override ``__torch_function__`` go to PyTorch's function, which
    dispatches them as without routing; a ``TorchFunctionMode`` sees the routed function
    as ``func``.  ``torch.jit.script`` compiles routed calls to PyTorch's op (scripted
    code does not use fastattn), and ``torch.export``/``torch.compile`` hand calls with
    data-dependent sizes to PyTorch.  Dropout draws differ from PyTorch's
    (docs/semantics.md §19)."""
    global _original
    with _lock:
        if not is_enabled():
            _original = torch.nn.functional.scaled_dot_product_attention
            torch.nn.functional.scaled_dot_product_attention = _routed_sdpa


def disable() -> None:
    """Put back the function :func:`enable` replaced."""
    with _lock:
        if is_enabled():
            torch.nn.functional.scaled_dot_product_attention = _original


@contextlib.contextmanager
def sdpa_kernel(enabled: bool = True) -> Iterator[None]:
    """Route ``torch.nn.functional.scaled_dot_product_attention`` through fastattn inside
    the block (see :func:`enable`); ``sdpa_kernel(False)`` turns routing off inside an
    enclosing block.  Blocks nest; on exit the routing is as it was on entry.  The switch
    is process-wide (a module attribute), not per thread.

    >>> with fastattn.torch.sdpa_kernel():
    ...     logits = model(tokens)
    """
    with _lock:
        was = is_enabled()
        (enable if enabled else disable)()
    try:
        yield
    finally:
        with _lock:
            (enable if was else disable)()


# --------------------------------------------------------------------------------------
# Serving caches: fastattn.attention and fastattn.quantize_kv on tensors (inference).

def _cache_np(x: Any, name: str) -> Any:
    """A tensor (or a QuantizedKV of tensors) as NumPy views of the same memory."""
    if isinstance(x, fastattn.QuantizedKV):
        return fastattn.QuantizedKV(_cache_np(x.data, f"{name}.data"), _cache_np(x.scale, f"{name}.scale"))
    if x is None or not isinstance(x, Tensor):
        return x
    if x.device.type != "cpu":
        raise ValueError(f"fastattn.torch.attention: {name} is on {x.device}; fastattn runs on CPU tensors")
    if x.dtype == torch.bfloat16 and _BF16_NP is None:
        raise TypeError("fastattn.torch.attention: bfloat16 tensors need ml_dtypes (pip install ml_dtypes)")
    return _np(x)


def attention(query: Tensor, key: Any, value: Any, **kwargs: Any) -> Any:
    """:func:`fastattn.attention` on CPU tensors, for inference: `key` and `value` are
    tensors, :class:`fastattn.QuantizedKV` of tensors (int8 data, float32 scale; see
    :func:`quantize_kv`), or pools ``(num_blocks, block_size, Hkv, D)`` with
    ``block_table=`` an int32 tensor (B, max_blocks) and ``seqlens_k=`` a tensor, as
    :func:`fastattn.attention` takes them.  Every array is read in place (no copy);
    every other keyword is :func:`fastattn.attention`'s.  The result is a tensor (with
    ``return_lse``, a tuple of tensors) that does not require grad: use
    :func:`scaled_dot_product_attention` to train."""
    args = {n: _cache_np(x, n) for n, x in (("query", query), ("key", key), ("value", value))}
    kw = {n: _cache_np(x, n) for n, x in kwargs.items()}
    res = _labelled(fastattn.attention, args["query"], args["key"], args["value"], **kw)
    if isinstance(res, tuple):
        return tuple(_pt(r) if isinstance(r, np.ndarray) else r for r in res)
    return _pt(res)


def quantize_kv(x: Tensor, *, group_size: int = 32,
                out: Optional[fastattn.QuantizedKV] = None) -> fastattn.QuantizedKV:
    """:func:`fastattn.quantize_kv` of a CPU tensor: a QuantizedKV of tensors (int8
    data, float32 scale), or written into `out` (a QuantizedKV of tensors, e.g. a
    slice of a preallocated cache, ``out=cache[..., t0:t1, :]``) and returned."""
    res = fastattn.quantize_kv(_cache_np(x, "x"), group_size=group_size,
                               out=None if out is None else _cache_np(out, "out"))
    return out if out is not None else fastattn.QuantizedKV(_pt(res.data), _pt(res.scale))
