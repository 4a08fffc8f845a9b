"""Routing ``torch.nn.functional.scaled_dot_product_attention`` through fastattn.

The function that stands in for PyTorch's while routing is on, its TorchScript
registration, and how it treats CausalBias masks, ``__torch_function__`` subclasses
and unbacked sizes.

Private: :func:`fastattn.torch.enable`, :func:`~fastattn.torch.disable` and
:func:`~fastattn.torch.sdpa_kernel` switch it on and off.
"""
from __future__ import annotations

import sys
import threading
from typing import Any, Optional

import torch
from torch import Tensor

from ._torch_plan import _Plan, _plan

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
