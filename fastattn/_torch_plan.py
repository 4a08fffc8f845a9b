"""The checks of :func:`fastattn.torch.scaled_dot_product_attention`.

A call's arguments made into a :class:`_Plan` in the ops' terms (broadcast leading
dims, the mask split into a bool mask or a float bias, the options parsed, float32
copies where fastattn does not compute in the dtype), or the exception that describes
what is wrong with it.

Private: used by :mod:`fastattn.torch` and by the routing in :mod:`fastattn._torch_route`.
"""
from __future__ import annotations

import math
import numbers
from typing import Optional, Tuple, Union

import numpy as np
import torch
from torch import Tensor

import fastattn
from . import _args
from ._torch_ops import _BF16_NP, _labelled, _np, _options, _pt

_FN = "fastattn.torch.scaled_dot_product_attention"
# causal codes of the ops: 0 none, 1 bottom-right, 2 top-left (PyTorch's is_causal)
_CAUSAL_CODES = {False: 0, True: 1, "bottom-right": 1, "top-left": 2}
_NATIVE = (torch.float32, torch.float64)
_HALF = (torch.float16, torch.bfloat16)

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
