"""The registered ops of :mod:`fastattn.torch`, their autograd, and tensor views.

``torch.ops.fastattn.attention_fwd`` and ``torch.ops.fastattn.attention_bwd``
(``torch.library.custom_op``, CPU), their fake implementations and the forward's
autograd formula, and the zero-copy conversions between CPU tensors and NumPy arrays
that every entry point of fastattn.torch uses.

Private: :mod:`fastattn.torch` imports it (after checking that PyTorch imports) and
re-exports ``attention_fwd`` and ``attention_bwd``.
"""
from __future__ import annotations

import inspect
import math
from typing import Any, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

import fastattn
from . import _args

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
    """Run :func:`fastattn.attention` on CPU tensors (the op ``fastattn::attention_fwd``).

    The op that :func:`fastattn.torch.scaled_dot_product_attention` calls when it needs
    the dispatcher (autograd, ``torch.compile``, tensor subclasses); its arguments are
    what a ``torch.library`` schema carries.

    Parameters
    ----------
    q : Tensor
        Queries as :func:`fastattn.attention` takes them in the "bhsd" layout:
        (L, D), (H, L, D) or (B, H, L, D); float32, float64, float16 or bfloat16.
    k : Tensor
        Keys, of q's dtype and number of dims (their heads may divide q's).
    v : Tensor
        Values, of q's dtype and number of dims.
    mask : Tensor or None
        A bool mask (True means attend), broadcastable to (B, H, L, S).
    bias : Tensor or None
        Float bias added to the logits, broadcastable like `mask`.
    alibi_slopes : Tensor or None
        ALiBi slopes, (H,) or (B, H).
    scale : float
        Multiplies ``q . k``.
    causal : int
        0 none, 1 bottom-right, 2 top-left.
    window_left : int
        Keys visible left of the diagonal; -1 means unbounded.
    window_right : int
        Keys visible right of the diagonal; -1 means unbounded.
    softcap : float
        Logit soft-capping; 0 means off.
    dropout_p : float
        Dropout probability in [0, 1).
    seed : Tensor or None
        An int64 tensor in [0, 2**63), needed when ``dropout_p > 0``.
    sinks : Tensor or None, optional
        Attention sinks, (H,): one logit per query head.

    Returns
    -------
    out : Tensor
        The attention output, shaped as q with v's last dim, written by the kernel.
    lse : Tensor
        The log of each row's softmax denominator, float32 (float64 for float64
        inputs).

    Raises
    ------
    ValueError
        If `causal` is not 0, 1 or 2, `dropout_p` > 0 without a `seed`, or as
        :func:`fastattn.attention` raises.

    See Also
    --------
    fastattn.torch.scaled_dot_product_attention : The user-facing function.
    attention_bwd : The backward op its autograd formula calls.

    Examples
    --------
    >>> import torch
    >>> import fastattn.torch
    >>> q = torch.ones(1, 2, 3, 4)
    >>> out, lse = torch.ops.fastattn.attention_fwd(q, q, q, None, None, None, 0.5, 1, -1, -1,
    ...                                             0.0, 0.0, None)
    >>> out.shape, lse.shape
    (torch.Size([1, 2, 3, 4]), torch.Size([1, 2, 3]))
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
    """Run :func:`fastattn.attention_backward` on CPU tensors (``fastattn::attention_bwd``).

    The backward of :func:`attention_fwd`, called by its autograd formula.

    Parameters
    ----------
    dout : Tensor
        Gradient of the output, shaped as `out`.
    q : Tensor
        The forward's queries.
    k : Tensor
        The forward's keys.
    v : Tensor
        The forward's values.
    out : Tensor
        The forward's output.
    lse : Tensor
        The forward's log-sum-exp.
    mask : Tensor or None
        As in :func:`attention_fwd`.
    bias : Tensor or None
        As in :func:`attention_fwd`.
    alibi_slopes : Tensor or None
        As in :func:`attention_fwd`.
    scale : float
        As in :func:`attention_fwd`.
    causal : int
        As in :func:`attention_fwd`.
    window_left : int
        As in :func:`attention_fwd`.
    window_right : int
        As in :func:`attention_fwd`.
    softcap : float
        As in :func:`attention_fwd`.
    dropout_p : float
        As in :func:`attention_fwd`; the same `seed` drops the same weights.
    seed : Tensor or None
        As in :func:`attention_fwd`.
    need_dbias : bool
        Compute the gradient of `bias`.
    sinks : Tensor or None, optional
        As in :func:`attention_fwd`.
    need_dsinks : bool, default False
        Compute the gradient of `sinks`.

    Returns
    -------
    dq, dk, dv : Tensor
        Gradients of q, k and v.
    dbias : Tensor
        Gradient of `bias` in its shape and dtype with `need_dbias`, else an empty
        tensor.
    dsinks : Tensor
        Gradient of `sinks` in their dtype with `need_dsinks`, else an empty tensor.

    See Also
    --------
    attention_fwd : The forward op.
    """
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

# help(), Sphinx and numpydoc read an op's docstring and signature from the CustomOpDef
# object, which otherwise shows its class's docstring and (*args, **kwargs): give each
# op those of the function it was made from (nothing else reads them)
for _op in (attention_fwd, attention_bwd):
    _op.__doc__ = _op._init_fn.__doc__
    _op.__signature__ = inspect.signature(_op._init_fn)
del _op
