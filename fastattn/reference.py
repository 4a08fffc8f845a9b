"""Pure-NumPy float64 oracle for fastattn.

Deliberately naive and obviously right: it materialises the full ``(B, Hq, Lq, Lk)``
logits and follows the semantics (``docs/semantics.md``) step by step.  Everything is
computed in float64 whatever the input dtype.  The kernels are tested against this
module, so it depends on nothing but NumPy.

Conventions this module fixes:

- ``bias`` and ``mask`` always broadcast (right-aligned) against the logits shape
  ``(B, Hq, Lq, Lk)`` / ``(Hq, Lq, Lk)`` / ``(Lq, Lk)``, whatever the layout.
- ``lse`` is ``(..., Hq, Lq)`` whatever the layout (``(Lq,)`` for 2-D input);
  ``varlen_attention`` returns it as ``(Hq, total_q)``, like FlashAttention.
- A logit of -inf (e.g. from ``bias``) hides its key exactly like the mask does.
- With D = 0 the default scale is 1 (all logits are 0 anyway).
- Dropout (step 11) keeps weight (b, h, i, j) iff word ``j & 3`` of
  ``philox4x32((j >> 2, i, h, b), (seed & 0xFFFFFFFF, seed >> 32))`` is
  ``>= min(int(p * 2**32), 2**32 - 1)``; b is the batch (varlen: sequence) index, h the
  query head, i and j the query and key positions (within the sequence).  Kept weights
  are scaled by ``1 / (1 - p)``; ``lse`` is that of the undropped softmax.

The public functions are here; the forward's steps (logits, softmax, dropout, the
weighted values) are in ``fastattn/_ref_forward.py`` and the Philox generator with
the keep decisions in ``fastattn/_ref_dropout.py``.
"""
from __future__ import annotations

from typing import Any, Literal, Sequence, Tuple, Union, overload

import numpy as np

from ._ref_dropout import Seed, dropout_keep, philox4x32
from ._ref_forward import (F64, _as_float, _dropout_factor, _forward, _from_bhsd4, _logits,
                           _sink_column, _softmax, _to_bhsd4)
from ._typing import ArrayLike, Causal, Layout, Window

__all__ = ["attention_stats", "key_mass", "attention", "attention_backward", "attention_weights", "dropout_keep", "merge",
           "philox4x32", "varlen_attention"]

_NEG_INF = -np.inf


@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, scale: float | None = ...,
              causal: Causal = ..., window: Window = ..., mask: ArrayLike | None = ...,
              bias: ArrayLike | None = ..., alibi_slopes: ArrayLike | None = ...,
              softcap: float | None = ..., dropout_p: float = ..., seed: Seed = ...,
              layout: Layout = ..., return_lse: Literal[False] = ..., out: Any = ...,
              num_threads: Any = ..., q_offset: int | None = ...,
              k_offset: int | None = ..., sinks: ArrayLike | None = ...) -> F64: ...


@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, scale: float | None = ...,
              causal: Causal = ..., window: Window = ..., mask: ArrayLike | None = ...,
              bias: ArrayLike | None = ..., alibi_slopes: ArrayLike | None = ...,
              softcap: float | None = ..., dropout_p: float = ..., seed: Seed = ...,
              layout: Layout = ..., return_lse: Literal[True], out: Any = ...,
              num_threads: Any = ..., q_offset: int | None = ...,
              k_offset: int | None = ..., sinks: ArrayLike | None = ...) -> Tuple[F64, F64]: ...


def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, scale: float | None = None,
              causal: Causal = False, window: Window = None, mask: ArrayLike | None = None,
              bias: ArrayLike | None = None, alibi_slopes: ArrayLike | None = None,
              softcap: float | None = None, dropout_p: float = 0.0, seed: Seed = None,
              layout: Layout = "bhsd", return_lse: bool = False, out: Any = None,
              num_threads: Any = None, q_offset: int | None = None,
              k_offset: int | None = None,
              sinks: ArrayLike | None = None) -> Union[F64, Tuple[F64, F64]]:
    """Exact attention ``softmax(scale * q k^T + ...) v``, computed naively in float64.

    The oracle of :func:`fastattn.attention`: it forms the full logits and follows the
    semantics step by step.  Every input is converted to float64 first.

    Parameters
    ----------
    q : array_like
        ``(..., Hq, Lq, D)`` in layout ``"bhsd"``, ``(..., Lq, Hq, D)`` in ``"bshd"``;
        2-D ``(Lq, D)`` in either.  Any float dtype.
    k : array_like
        ``(..., Hkv, Lk, D)`` (layout as for q); ``Hq`` a multiple of ``Hkv``.
    v : array_like
        ``(..., Hkv, Lk, Dv)``.
    scale : float, optional
        Default ``1 / sqrt(D)`` (1 for ``D = 0``).
    causal : {False, True, 'bottom-right', 'top-left'}, optional
        As in :func:`fastattn.attention`.
    window : tuple of (int or None, int or None), optional
        As in :func:`fastattn.attention`.
    mask : array_like of bool, optional
        Broadcastable to ``(..., Hq, Lq, Lk)``; True = attend.
    bias : array_like of float, optional
        Broadcastable to ``(..., Hq, Lq, Lk)``.
    alibi_slopes : array_like of float, shape (Hq,) or (B, Hq), optional
        As in :func:`fastattn.attention`.
    softcap : float, optional
        Finite and > 0.
    dropout_p : float, optional
        The probability of dropping a weight, in [0, 1) (decided by
        :func:`dropout_keep`); kept weights are divided by ``1 - dropout_p``.
    seed : int, optional
        In [0, 2**64); required when ``dropout_p > 0``.
    layout : {'bhsd', 'bshd'}, optional
        The axis order of q, k, v and the output.
    return_lse : bool, optional
        Also return the log-sum-exp of each row.
    out : optional
        Accepted for the signature's sake and ignored.
    num_threads : optional
        Accepted for the signature's sake and ignored.
    q_offset, k_offset : int, optional
        The positions of the first query and the first key in one longer sequence (a
        missing one is 0): query ``i`` sits at ``q_offset + i``, key ``j`` at
        ``k_offset + j``, and the diagonal is ``a = q_offset + i - k_offset``: causal
        hides the keys ``j > a``, the window is around ``a``, the ALiBi distance is
        ``|a - j|``.  Not with ``causal='top-left'``.
    sinks : array_like of float, shape (Hq,), optional
        One more logit per head in each row's softmax (not scaled), a key whose value is
        zero; lse includes it.

    Returns
    -------
    out : ndarray of float64
        q's layout and ndim, with ``Dv`` last.
    lse : ndarray of float64
        With ``return_lse=True``: shape ``(..., Hq, Lq)``, that of the softmax before
        dropout.

    Raises
    ------
    TypeError, ValueError
        For arguments :func:`fastattn.attention` refuses too (the messages do not
        start with the function's name).

    See Also
    --------
    fastattn.attention : The compiled function this checks.

    Examples
    --------
    >>> import numpy as np
    >>> from fastattn import reference
    >>> q = np.zeros((3, 4)); k = np.zeros((3, 4)); v = np.arange(6.0).reshape(3, 2)
    >>> reference.attention(q, k, v, causal=True)      # row i: the mean of v[:i + 1]
    array([[0., 1.],
           [1., 2.],
           [2., 3.]])
    """
    o, lse = _forward(q, k, v, scale, causal, window, mask, bias, alibi_slopes, softcap,
                      dropout_p, seed, layout, num_threads, 0, q_offset, k_offset, sinks)
    return (o, lse) if return_lse else o


def attention_weights(q: ArrayLike, k: ArrayLike, *, scale: float | None = None,
                      causal: Causal = False, window: Window = None,
                      mask: ArrayLike | None = None, bias: ArrayLike | None = None,
                      alibi_slopes: ArrayLike | None = None, softcap: float | None = None,
                      dropout_p: float = 0.0, seed: Seed = None,
                      layout: Layout = "bhsd", q_offset: int | None = None,
                      k_offset: int | None = None, sinks: ArrayLike | None = None) -> F64:
    """The attention weights, float64, shape ``(..., Hq, Lq, Lk)`` in either layout.

    Parameters
    ----------
    q, k : array_like
        As in :func:`attention` (no values are needed).
    scale, causal, window, mask, bias, alibi_slopes, softcap : optional
        As in :func:`attention`.
    dropout_p, seed : optional
        As in :func:`attention`: with ``dropout_p > 0`` the weights are those after
        dropout (dropped entries 0, kept ones divided by ``1 - dropout_p``), so that
        ``attention(...) == attention_weights(...) @ v``.
    layout, q_offset, k_offset, sinks : optional
        As in :func:`attention`.

    Returns
    -------
    ndarray of float64
        Each row sums to 1 (1 minus the sink's weight with `sinks`); a row with no
        visible key is 0.

    See Also
    --------
    fastattn.attention_weights : The compiled function this checks.

    Examples
    --------
    >>> import numpy as np
    >>> from fastattn import reference
    >>> reference.attention_weights(np.zeros((2, 4)), np.zeros((2, 4)), causal=True)
    array([[1. , 0. ],
           [0.5, 0.5]])
    """
    lg = _logits(q, k, None, scale, causal, window, mask, bias, alibi_slopes, softcap,
                 layout, None, q_offset, k_offset)
    z = _dropout_factor(dropout_p, seed, lg.s.shape)
    w = _softmax(lg.s, sinks)[0]
    if z is not None:
        w = w * z
    return w.reshape(w.shape[4 - lg.ndim:])


def attention_stats(q: ArrayLike, k: ArrayLike, *, scale: float | None = None,
                    causal: Causal = False, window: Window = None,
                    mask: ArrayLike | None = None, bias: ArrayLike | None = None,
                    alibi_slopes: ArrayLike | None = None, softcap: float | None = None,
                    layout: Layout = "bhsd", q_offset: int | None = None,
                    k_offset: int | None = None,
                    sinks: ArrayLike | None = None) -> Tuple[F64, F64, F64]:
    """The statistics of :class:`fastattn.AttentionStats`, computed naively from the weights.

    Parameters
    ----------
    q, k : array_like
        As in :func:`attention`.
    scale, causal, window, mask, bias, alibi_slopes, softcap : optional
        As in :func:`attention`.
    layout, q_offset, k_offset : optional
        As in :func:`attention`.
    sinks : array_like of float, shape (Hq,), optional
        As in :func:`attention`: the sink's weight is one more entry of each row.

    Returns
    -------
    entropy : ndarray of float64
        ``H = -sum p log p`` over the row's weights (0 log 0 = 0), shape
        ``(..., Hq, Lq)``.
    effective_support : ndarray of float64
        ``exp(H)``.
    max_weight : ndarray of float64
        The row's largest weight.

    See Also
    --------
    fastattn.AttentionStats : What ``fastattn.attention(..., return_stats=True)`` returns.

    Notes
    -----
    A row with no visible key gets 0 in all three.

    Examples
    --------
    >>> import numpy as np
    >>> from fastattn import reference
    >>> H, support, top = reference.attention_stats(np.zeros((1, 4)), np.zeros((4, 4)))
    >>> support, top
    (array([4.]), array([0.25]))
    """
    w = attention_weights(q, k, scale=scale, causal=causal, window=window, mask=mask, bias=bias,
                          alibi_slopes=alibi_slopes, softcap=softcap, layout=layout,
                          q_offset=q_offset, k_offset=k_offset, sinks=sinks)
    if sinks is not None:  # the sink's weight as one more column
        w = np.concatenate([w, 1.0 - w.sum(axis=-1, keepdims=True)], axis=-1)
    logw = np.log(np.where(w > 0, w, 1.0))
    entropy = -np.sum(w * logw, axis=-1)
    empty = ~np.any(w > 0, axis=-1)
    support = np.where(empty, 0.0, np.exp(entropy))
    return entropy, support, np.max(w, axis=-1, initial=0.0)


def key_mass(q: ArrayLike, k: ArrayLike, *, scale: float | None = None, causal: Causal = False,
             window: Window = None, mask: ArrayLike | None = None, bias: ArrayLike | None = None,
             alibi_slopes: ArrayLike | None = None, softcap: float | None = None,
             layout: Layout = "bhsd", q_offset: int | None = None,
             k_offset: int | None = None, sinks: ArrayLike | None = None) -> F64:
    """For each key, the sum of its weights over the query rows: the weights' column sums.

    Parameters
    ----------
    q, k : array_like
        As in :func:`attention`.
    scale, causal, window, mask, bias, alibi_slopes, softcap : optional
        As in :func:`attention`.
    layout, q_offset, k_offset, sinks : optional
        As in :func:`attention`.

    Returns
    -------
    ndarray of float64
        Shape ``(..., Hq, Lk)``; the weights are those without dropout.

    See Also
    --------
    fastattn.key_mass : The compiled function this checks.

    Examples
    --------
    >>> import numpy as np
    >>> from fastattn import reference
    >>> reference.key_mass(np.zeros((3, 4)), np.zeros((3, 4)), causal=True)
    array([1.83333333, 0.83333333, 0.33333333])
    """
    w = attention_weights(q, k, scale=scale, causal=causal, window=window, mask=mask, bias=bias,
                          alibi_slopes=alibi_slopes, softcap=softcap, layout=layout,
                          q_offset=q_offset, k_offset=k_offset, sinks=sinks)
    return w.sum(axis=-2)


def _sum_to_shape(g, shape):
    """Sum g (a broadcast of an array of the given shape) back to that shape."""
    g = g.sum(axis=tuple(range(g.ndim - len(shape))))
    g = g.sum(axis=tuple(a for a, n in enumerate(shape) if n == 1), keepdims=True)
    return g.reshape(shape)


@overload
def attention_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike,
                       out: ArrayLike, lse: ArrayLike, *, scale: float | None = ...,
                       causal: Causal = ..., window: Window = ...,
                       mask: ArrayLike | None = ..., bias: ArrayLike | None = ...,
                       alibi_slopes: ArrayLike | None = ..., softcap: float | None = ...,
                       dropout_p: float = ..., seed: Seed = ..., layout: Layout = ...,
                       return_dbias: Literal[False] = ..., num_threads: Any = ...,
                       q_offset: int | None = ..., k_offset: int | None = ...,
                       sinks: ArrayLike | None = ..., return_dsinks: Literal[False] = ...
                       ) -> Tuple[F64, F64, F64]: ...


@overload
def attention_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike,
                       out: ArrayLike, lse: ArrayLike, *, scale: float | None = ...,
                       causal: Causal = ..., window: Window = ...,
                       mask: ArrayLike | None = ..., bias: ArrayLike | None = ...,
                       alibi_slopes: ArrayLike | None = ..., softcap: float | None = ...,
                       dropout_p: float = ..., seed: Seed = ..., layout: Layout = ...,
                       return_dbias: Literal[True], num_threads: Any = ...,
                       q_offset: int | None = ..., k_offset: int | None = ...,
                       sinks: ArrayLike | None = ..., return_dsinks: Literal[False] = ...
                       ) -> Tuple[F64, F64, F64, F64]: ...


def attention_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike,
                       out: ArrayLike, lse: ArrayLike, *, scale: float | None = None,
                       causal: Causal = False, window: Window = None,
                       mask: ArrayLike | None = None, bias: ArrayLike | None = None,
                       alibi_slopes: ArrayLike | None = None, softcap: float | None = None,
                       dropout_p: float = 0.0, seed: Seed = None, layout: Layout = "bhsd",
                       return_dbias: bool = False, num_threads: Any = None,
                       q_offset: int | None = None, k_offset: int | None = None,
                       sinks: ArrayLike | None = None, return_dsinks: bool = False
                       ) -> Tuple[F64, ...]:
    """Gradients of :func:`attention`, computed naively in float64.

    Recomputes the logits S and the weights P = softmax(S) (0 on rows with no visible
    key), Z = keep / (1 - dropout_p) (or 1), and with dO = dout:
    dV = (P Z)^T dO, dP = (dO V^T) Z, dS = P (dP - rowsum(P dP)),
    dS_raw = dS (1 - tanh(scale q.k / softcap)**2) (dS_raw = dS without softcap),
    dQ = scale dS_raw K, dK = scale dS_raw^T Q; with grouped-query attention dK and dV
    are summed over the query heads that share a key/value head.  ALiBi, the mask, causal
    and the window pass dS through.

    Parameters
    ----------
    dout : array_like
        The gradient of the loss with respect to out, of out's shape.
    q, k, v : array_like
        As in :func:`attention`.
    out : array_like
        The forward's output (its shape is checked; otherwise unused).
    lse : array_like
        The forward's lse, ``(..., Hq, Lq)`` (its shape is checked; otherwise unused).
    scale, causal, window, mask, bias, alibi_slopes, softcap : optional
        As in :func:`attention`.
    dropout_p, seed : optional
        Those of the forward.
    layout : {'bhsd', 'bshd'}, optional
        As in :func:`attention`.
    return_dbias : bool, optional
        Also return the gradient with respect to `bias` (which must be given): dS summed
        over the axes along which the bias was broadcast, in the bias's own shape.
    num_threads : optional
        Accepted for the signature's sake and ignored.
    q_offset, k_offset, sinks : optional
        As in :func:`attention` (with sinks, P is the softmax with the sink's logit).
    return_dsinks : bool, optional
        Also return the sinks' gradient ``-sum_{b,i} p_sink * rowsum(P dP)``, shape
        ``(Hq,)`` (needs `sinks`).

    Returns
    -------
    dq, dk, dv : ndarray of float64
        The shapes of q, k and v.
    dbias : ndarray of float64
        With ``return_dbias=True``: the shape of bias.
    dsinks : ndarray of float64
        With ``return_dsinks=True``: shape ``(Hq,)``.

    Raises
    ------
    ValueError
        If out, lse or dout has the wrong shape, or ``return_dbias`` / ``return_dsinks``
        is asked without a bias / sinks.

    See Also
    --------
    fastattn.attention_backward : The compiled function this checks.

    Examples
    --------
    >>> import numpy as np
    >>> from fastattn import reference
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((5, 4)) for _ in range(3))
    >>> out, lse = reference.attention(q, k, v, return_lse=True)
    >>> dq, dk, dv = reference.attention_backward(np.ones_like(out), q, k, v, out, lse)
    >>> bool(np.allclose(dv.sum(axis=0), 5.0))          # every row's weights sum to 1
    True
    """
    if return_dbias and bias is None:
        raise ValueError("return_dbias=True needs a bias, got bias=None")
    if return_dsinks and sinks is None:
        raise ValueError("return_dsinks=True needs sinks, got sinks=None")
    lg = _logits(q, k, v, scale, causal, window, mask, bias, alibi_slopes, softcap, layout,
                 num_threads, q_offset, k_offset)
    assert lg.v4 is not None
    B, Hq, Lq, Lk = lg.s.shape
    Dv = lg.v4.shape[-1]
    out_shape = _from_bhsd4(np.broadcast_to(0.0, (B, Hq, Lq, Dv)), lg.ndim, layout).shape
    lse_shape = (B, Hq, Lq)[4 - lg.ndim:]
    out_a, lse_a = np.asarray(out), np.asarray(lse)
    if out_a.shape != out_shape:
        raise ValueError(f"out must have shape {out_shape} (attention's output for q "
                         f"{np.shape(q)}, v {np.shape(v)}), got {out_a.shape}")
    if lse_a.shape != lse_shape:
        raise ValueError(f"lse must have shape {lse_shape} (attention's lse for q "
                         f"{np.shape(q)}), got {lse_a.shape}")
    do = _as_float("dout", dout)
    if do.shape != out_shape:
        raise ValueError(f"dout must have the shape of out {out_shape}, got {do.shape}")
    do4 = _to_bhsd4("dout", do, layout)
    z = _dropout_factor(dropout_p, seed, lg.s.shape)
    p, lse_r, live = _softmax(lg.s, sinks)
    pz = p if z is None else p * z
    dv = pz.swapaxes(-1, -2) @ do4                                     # (B, Hq, Lk, Dv)
    # (B, Hq, Lq, Lk); hidden keys zeroed so a non-finite v row only reaches rows seeing it
    dp = np.where(live, do4 @ lg.v4.swapaxes(-1, -2), 0.0)
    if z is not None:
        dp = dp * z
    rowsum = (p * dp).sum(axis=-1, keepdims=True)
    ds = p * (dp - rowsum)
    ds_raw = ds
    if lg.softcap is not None:
        ds_raw = ds * (1.0 - np.tanh(lg.raw / lg.softcap) ** 2)
    dq = lg.scale * (ds_raw @ lg.k4)                                   # (B, Hq, Lq, D)
    dk = lg.scale * (ds_raw.swapaxes(-1, -2) @ lg.q4)                  # (B, Hq, Lk, D)
    dk = dk.reshape(B, lg.hkv, lg.group, Lk, dk.shape[-1]).sum(axis=2)
    dv = dv.reshape(B, lg.hkv, lg.group, Lk, Dv).sum(axis=2)
    grads = tuple(_from_bhsd4(g, lg.ndim, layout) for g in (dq, dk, dv))
    if return_dbias:
        assert bias is not None                        # checked on entry
        grads += (_sum_to_shape(ds.reshape(lg.full), np.shape(bias)),)
    if return_dsinks:  # the sink's weight exp(sink - lse), its logit's gradient -p_sink D_i
        col = _sink_column(sinks, lg.s)[..., 0]
        with np.errstate(invalid="ignore"):
            psink = np.where(col == _NEG_INF, 0.0, np.exp(col - lse_r))
        grads += (-(psink * rowsum[..., 0]).sum(axis=(0, 2)),)
    return grads


def merge(outs: Sequence[ArrayLike], lses: Sequence[ArrayLike], *,
          layout: Layout = "bhsd") -> Tuple[F64, F64]:
    """Combine partial attentions computed over disjoint key sets.

    Parameters
    ----------
    outs : sequence of array_like
        All of one shape: ``(..., H, Lq, Dv)`` for layout ``"bhsd"``,
        ``(..., Lq, H, Dv)`` for ``"bshd"``, ``(Lq, Dv)`` in either.
    lses : sequence of array_like
        ``(..., H, Lq)`` in both layouts, as :func:`attention` returns lse.
    layout : {'bhsd', 'bshd'}, optional
        The layout the parts were computed with.

    Returns
    -------
    out : ndarray of float64
        ``sum_p exp(lse_p - lse) out_p``, shape of ``outs[0]``; 0 where every part's lse
        is -inf.
    lse : ndarray of float64
        ``log(sum_p exp(lse_p))``.

    See Also
    --------
    fastattn.merge : The compiled function this checks.

    Examples
    --------
    >>> import numpy as np
    >>> from fastattn import reference
    >>> q = np.zeros((1, 2)); k = np.zeros((4, 2)); v = np.arange(4.0)[:, None]
    >>> a = reference.attention(q, k[:1], v[:1], return_lse=True)
    >>> b = reference.attention(q, k[1:], v[1:], return_lse=True)
    >>> reference.merge([a[0], b[0]], [a[1], b[1]])[0]   # the mean of all four values
    array([[1.5]])
    """
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    if layout == "bshd" and len(outs) and np.ndim(outs[0]) >= 3:
        # lse (..., H, Lq) -> (..., Lq, H), the order of the out rows; back at the end
        out, lse = merge(outs, [np.swapaxes(x, -1, -2) for x in lses])
        return out, np.swapaxes(lse, -1, -2)
    if not len(outs) or len(outs) != len(lses):
        raise ValueError(f"outs and lses must be non-empty and of equal length, got "
                         f"{len(outs)} outs and {len(lses)} lses")
    os_ = [_as_float(f"outs[{p}]", o) for p, o in enumerate(outs)]
    ls_ = [_as_float(f"lses[{p}]", x) for p, x in enumerate(lses)]
    for p, (o, x) in enumerate(zip(os_, ls_)):
        if o.ndim < 1 or o.shape != os_[0].shape or x.shape != o.shape[:-1]:
            raise ValueError(f"outs[{p}] {o.shape} and lses[{p}] {x.shape} must match "
                             f"outs[0] {os_[0].shape} and lses = outs[:-1]")
    O, L = np.stack(os_), np.stack(ls_)
    part_live = L != _NEG_INF
    M = np.max(L, axis=0)
    alive = M != _NEG_INF
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        w = np.where(part_live, np.exp(L - np.where(alive, M, 0.0)), 0.0)
        total = w.sum(axis=0)
        lse = np.where(alive, M + np.log(total), _NEG_INF)
        num = np.where(part_live[..., None], w[..., None] * O, 0.0).sum(axis=0)
        out = np.where(alive[..., None], num / np.where(alive, total, 1.0)[..., None], 0.0)
    return out, lse


def _cu(name, cu, total):
    a = np.asarray(cu)
    if not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name} must be an integer array, got dtype {a.dtype}")
    if a.ndim != 1 or a.size < 1 or a[0] != 0 or np.any(np.diff(a) < 0) or a[-1] != total:
        raise ValueError(f"{name} must be 1-D, start at 0, be non-decreasing and end at "
                         f"{total}, got shape {a.shape}: {a.tolist()}")
    return a


def varlen_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike,
                     cu_seqlens_k: ArrayLike, *, scale: float | None = None,
                     causal: Causal = False, window: Window = None,
                     alibi_slopes: ArrayLike | None = None, softcap: float | None = None,
                     dropout_p: float = 0.0, seed: Seed = None,
                     return_lse: bool = False) -> Union[F64, Tuple[F64, F64]]:
    """Attention over a packed ragged batch, one independent problem per sequence.

    Parameters
    ----------
    q : array_like, shape (total_q, Hq, D)
        The queries of every sequence, packed.
    k : array_like, shape (total_k, Hkv, D)
        The keys, packed.
    v : array_like, shape (total_k, Hkv, Dv)
        The values, packed.
    cu_seqlens_q, cu_seqlens_k : array_like of int, shape (nseq + 1,)
        Cumulative lengths, starting at 0, non-decreasing, ending at ``total_q`` and
        ``total_k``.  Sequence ``s`` uses q rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``
        and key rows ``cu_seqlens_k[s]:cu_seqlens_k[s+1]``.
    scale : float, optional
        As in :func:`attention`.
    causal, window : optional
        As in :func:`attention`, aligned per sequence.
    alibi_slopes : array_like of float, shape (Hq,), optional
        As in :func:`attention`.
    softcap : float, optional
        As in :func:`attention`.
    dropout_p, seed : optional
        As in :func:`attention`, with ``b`` the sequence's index and ``i, j`` the query
        and key positions within the sequence.
    return_lse : bool, optional
        Also return lse.

    Returns
    -------
    out : ndarray of float64
        Shape ``(total_q, Hq, Dv)``.
    lse : ndarray of float64
        With ``return_lse=True``: shape ``(Hq, total_q)``.

    Raises
    ------
    TypeError, ValueError
        If the cumulative lengths are not integers valid for the packed arrays, or as
        :func:`attention` raises them.

    See Also
    --------
    fastattn.varlen_attention : The compiled function this checks.

    Examples
    --------
    >>> import numpy as np
    >>> from fastattn import reference
    >>> x = np.zeros((3, 1, 2)); v = np.arange(3.0).reshape(3, 1, 1)
    >>> reference.varlen_attention(x, x, v, [0, 1, 3], [0, 1, 3])[:, 0, 0]
    array([0. , 1.5, 1.5])
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    for name, a in (("q", q), ("k", k), ("v", v)):
        if np.ndim(a) != 3:
            raise ValueError(f"{name} must be 3-D (total, H, D), got shape {np.shape(a)}")
    kw: dict[str, Any] = dict(scale=scale, causal=causal, window=window, mask=None,
                              bias=None, alibi_slopes=alibi_slopes, softcap=softcap,
                              dropout_p=dropout_p, seed=seed, layout="bshd",
                              num_threads=None)
    o0, _ = _forward(q[:0], k[:0], v[:0], b0=0, **kw)    # validates everything cheaply
    cq = _cu("cu_seqlens_q", cu_seqlens_q, np.shape(q)[0])
    ck = _cu("cu_seqlens_k", cu_seqlens_k, np.shape(k)[0])
    if cq.shape != ck.shape:
        raise ValueError(f"cu_seqlens_q {cq.shape} and cu_seqlens_k {ck.shape} must have "
                         f"the same length")
    Hq, Dv = o0.shape[1:]
    out = np.zeros((np.shape(q)[0], Hq, Dv))
    lse = np.full((Hq, np.shape(q)[0]), _NEG_INF)
    for s in range(cq.size - 1):
        qs, qe, ks, ke = cq[s], cq[s + 1], ck[s], ck[s + 1]
        out[qs:qe], lse[:, qs:qe] = _forward(q[qs:qe], k[ks:ke], v[ks:ke], b0=s, **kw)
    return (out, lse) if return_lse else out
