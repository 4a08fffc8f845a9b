"""Fastattn for JAX: ``jax.nn.dot_product_attention`` computed by fastattn's kernels.

:func:`dot_product_attention` takes ``jax.nn.dot_product_attention``'s arguments with
their meaning (layout ``(B, T, N, H)``, grouped-query heads by head count, its mask,
bias, causal, window and sequence-length semantics), plus fastattn's keywords
(``causal="bottom-right"``, ``window``, ``alibi_slopes``, ``softcap``, ``sinks``,
``seqlens_k``).  It is an XLA FFI call, not a Python callback: XLA's CPU runtime hands
its own buffers to typed handlers compiled against jaxlib's headers
(``src_c/jax_ffi.cc``), which run fastattn's C driver on them in place.  It works under
``jit`` and ``vmap`` (the handlers loop over vmapped axes), in float32, float64,
bfloat16 and float16, and ``jax.grad`` goes through fastattn's backward
(``jax.custom_vjp``, the forward's lse kept as the residual).

The handlers are compiled into ``fastattn._kernels`` when jax is installed in the
environment fastattn is built for: install jax first (``pip install "jax[cpu]"``), then
fastattn (``pip install ".[jax]"`` installs both in one go only if jax was already
there when fastattn was built).
"""
from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple, Optional, Tuple, Union

import numpy as np

from . import _kernels

_JAX_REQUIREMENT = "jax[cpu]>=0.10.2"  # pyproject's `jax` extra


def _rebuild_command() -> str:
    """The one shell command that rebuilds this fastattn with its XLA FFI handlers from
    the source it was installed from (FASTATTN_JAX_FFI=1: the build gets jax into its
    own environment and fails without the handlers)."""
    import json
    import os
    import shlex
    import sys
    from importlib import metadata
    from urllib.parse import unquote, urlparse

    py = shlex.quote(sys.executable)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isfile(os.path.join(root, "setup.py")) and os.path.isdir(os.path.join(root, "src_c")):
        # imported from a source tree: an in-place build or an editable install
        return f"cd {shlex.quote(root)} && FASTATTN_JAX_FFI=1 {py} setup.py build_ext --inplace"
    try:
        dist = metadata.distribution("fastattn")
        source = shlex.quote(f"fastattn=={dist.version}")
        url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
    except (metadata.PackageNotFoundError, ValueError):
        source, url = "fastattn", ""
    if url.startswith("file://") and not url.endswith(".whl"):  # a local clone or sdist
        source = shlex.quote(unquote(urlparse(url).path))
    else:  # from an index or a wheel: the sdist, built here
        source = "--no-binary fastattn " + source
    # --no-cache-dir: not a wheel that pip built earlier from the same sdist and kept
    return (f"FASTATTN_JAX_FFI=1 {py} -m pip install --force-reinstall --no-deps --no-cache-dir "
            + source)


_TARGETS = _kernels.jax_ffi_targets()
try:
    import jax
    import jax.numpy as jnp
except ImportError as _exc:  # jax stays an optional dependency
    import shlex
    import sys
    _fix = f"{shlex.quote(sys.executable)} -m pip install '{_JAX_REQUIREMENT}'"
    if _TARGETS is None:
        _fix += " && " + _rebuild_command()
    raise ImportError(f"fastattn.jax needs JAX (importing jax failed: {_exc}); run: {_fix}") from _exc
if _TARGETS is None:
    raise ImportError(
        "fastattn.jax: this fastattn was built without its XLA FFI handlers (the build did not "
        "find jax: `pip install \".[jax]\"` builds fastattn before it installs jax); rebuild it "
        f"with them: {_rebuild_command()}")

__all__ = ["dot_product_attention"]

_FN = "fastattn.jax.dot_product_attention"
jax.ffi.register_ffi_target("fastattn_fwd", _TARGETS["forward"], platform="cpu")
jax.ffi.register_ffi_target("fastattn_bwd", _TARGETS["backward"], platform="cpu")

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(jnp.bfloat16),
           np.dtype(np.float16))


class _Opts(NamedTuple):
    """The static options of one call (hashable: custom_vjp's nondiff argument)."""
    scale: float
    softcap: float
    causal: int          # 0 none, 1 bottom-right, 2 top-left (fastattn.h's codes)
    window_left: int
    window_right: int
    positions: int       # 1: queries and keys at positions q_offset + i, k_offset + j
    q_offset: int
    k_offset: int
    num_threads: int
    need_ds: int         # the bias gets a gradient


def _compute_dtype(dt):
    return jnp.float64 if dt == jnp.float64 else jnp.float32


def _empty(dt):
    return jnp.zeros((0,), dt)


def _attrs(o: _Opts) -> dict:
    return dict(scale=np.float64(o.scale), softcap=np.float64(o.softcap),
                causal=np.int64(o.causal), window_left=np.int64(o.window_left),
                window_right=np.int64(o.window_right), positions=np.int64(o.positions),
                q_offset=np.int64(o.q_offset), k_offset=np.int64(o.k_offset),
                num_threads=np.int64(o.num_threads), need_ds=np.int64(o.need_ds), bf16=np.int64(0))


def _extras(q, bias, mask, seqlens, sinks, alibi):
    """The optional inputs as the handlers take them: absent ones as 0-element arrays."""
    cd = _compute_dtype(q.dtype)
    return (_empty(cd) if bias is None else bias,
            _empty(jnp.bool_) if mask is None else mask,
            _empty(jnp.int32) if seqlens is None else seqlens,
            _empty(cd) if sinks is None else sinks,
            _empty(cd) if alibi is None else alibi)


def _forward(q, k, v, bias, mask, seqlens, sinks, alibi, o: _Opts):
    B, T, N, _ = q.shape
    cd = _compute_dtype(q.dtype)
    out_t = jax.ShapeDtypeStruct(q.shape[:-1] + (v.shape[-1],), q.dtype)
    lse_t = jax.ShapeDtypeStruct((B, N, T), cd)
    call = jax.ffi.ffi_call("fastattn_fwd", (out_t, lse_t), vmap_method="expand_dims")
    return call(q, k, v, *_extras(q, bias, mask, seqlens, sinks, alibi), **_attrs(o))


def _backward(q, k, v, out, lse, dout, bias, mask, seqlens, sinks, alibi, o: _Opts):
    """(dq, dk, dv, ds) in q's dtype (computed in float32 for 16-bit inputs)."""
    dt = q.dtype
    bf16 = dt == jnp.bfloat16
    if dt in (jnp.bfloat16, jnp.float16):  # exact float32 copies; 16-bit grads at the end
        q, k, v, out, dout = (x.astype(jnp.float32) for x in (q, k, v, out, dout))
    cd = q.dtype
    B, T, N, _ = q.shape
    S = k.shape[1]
    shapes = (jax.ShapeDtypeStruct(q.shape, cd), jax.ShapeDtypeStruct(k.shape, cd),
              jax.ShapeDtypeStruct(v.shape, cd),
              jax.ShapeDtypeStruct((B, N, T, S) if o.need_ds else (0,), cd))
    call = jax.ffi.ffi_call("fastattn_bwd", shapes, vmap_method="expand_dims")
    dq, dk, dv, ds = call(q, k, v, out, lse.astype(cd), dout,
                          *_extras(q, bias, mask, seqlens, sinks, alibi),
                          **{**_attrs(o), "bf16": np.int64(bf16)})
    return dq.astype(dt), dk.astype(dt), dv.astype(dt), ds


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _attention(q, k, v, bias, mask, seqlens, sinks, alibi, o: _Opts):
    return _forward(q, k, v, bias, mask, seqlens, sinks, alibi, o)[0]


def _attention_fwd(q, k, v, bias, mask, seqlens, sinks, alibi, o: _Opts):
    out, lse = _forward(q, k, v, bias, mask, seqlens, sinks, alibi, o)
    return out, (q, k, v, bias, mask, seqlens, sinks, alibi, out, lse)


def _sum_to(g, shape):
    """g (B, N, T, S) summed over the axes a bias of `shape` was broadcast along."""
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    return jnp.sum(g, axis=axes, keepdims=True).reshape(shape) if axes else g


def _attention_bwd(o: _Opts, res, dout):
    q, k, v, bias, mask, seqlens, sinks, alibi, out, lse = res
    dq, dk, dv, ds = _backward(q, k, v, out, lse, dout, bias, mask, seqlens, sinks, alibi, o)
    dbias = None if bias is None else _sum_to(ds, bias.shape).astype(bias.dtype)
    dsinks = None
    if sinks is not None:  # -sum over (b, t) of exp(sink - lse) * (dout . out)
        cd = sinks.dtype
        d = jnp.einsum("btnc,btnc->bnt", dout.astype(cd), out.astype(cd))
        w = jnp.where(jnp.isneginf(sinks)[None, :, None], 0.0,
                      jnp.exp(sinks[None, :, None] - lse))
        dsinks = -(w * d).sum(axis=(0, 2))
    return dq, dk, dv, dbias, None, None, dsinks, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _as(x, name):
    if x is None:
        return None
    try:
        return jnp.asarray(x)
    except TypeError as e:
        raise TypeError(f"{_FN}: {name} must be an array, got {type(x).__name__}") from e


def dot_product_attention(query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None, *,
                          scale: Optional[float] = None, is_causal: bool = False,
                          query_seq_lengths: Any = None, key_value_seq_lengths: Any = None,
                          local_window_size: Union[int, Tuple[int, int], None] = None,
                          implementation: Optional[str] = None,
                          causal: Union[bool, str, None] = None,
                          window: Optional[Tuple[Optional[int], Optional[int]]] = None,
                          alibi_slopes: Any = None, softcap: Optional[float] = None,
                          sinks: Any = None, seqlens_k: Any = None,
                          num_threads: Optional[int] = None) -> Any:
    """Compute ``jax.nn.dot_product_attention`` with fastattn (an XLA FFI call).

    The arguments shared with ``jax.nn.dot_product_attention`` (`query` to
    `implementation`) have its meaning; the keyword-only ones after them are
    fastattn's (see :func:`fastattn.attention`) and combine with the above.

    Parameters
    ----------
    query : array_like, shape (B, T, N, H) or (T, N, H)
        Queries of float32, float64 (with ``jax_enable_x64``), bfloat16 or float16;
        the 16-bit types are computed in float32, their gradients too.
    key : array_like, shape (B, S, K, H) or (S, K, H)
        Keys of the query's dtype.  N must be a multiple of K (grouped-query heads:
        query head n reads key/value head ``n // (N / K)``, without repeating them).
    value : array_like, shape (B, S, K, Hv) or (S, K, Hv)
        Values of the query's dtype; Hv may differ from H.
    bias : array_like, optional
        Float, broadcastable to (B, N, T, S): added to the scaled logits;
        differentiable (its gradient is summed over the axes it was broadcast along).
        Fewer than 4 dims are right-aligned, as jax's (a (T, S) bias is every batch's
        and head's).
    mask : array_like of bool, optional
        Broadcastable to (B, N, T, S), True means attend; fewer than 4 dims are
        right-aligned too (``(1, 1, S)`` masks keys).
    scale : float, optional
        Multiplies the logits; default ``1 / sqrt(H)``.
    is_causal : bool, default False
        Key s is visible to query t iff s <= t (top-left, as jax's).
    query_seq_lengths : array_like of int32, shape (B,), optional
        Padding: query rows t >= ``query_seq_lengths[b]`` give 0 (as jax's).
    key_value_seq_lengths : array_like of int32, shape (B,), optional
        Padding: keys s >= ``key_value_seq_lengths[b]`` are hidden and never read.
    local_window_size : int or tuple of (int, int), optional
        Query t sees keys ``t - left <= s <= t + right``; an int w is ``(w, w)``.
    implementation : {None, 'xla', 'cudnn'}, optional
        None runs fastattn; 'xla' or 'cudnn' hand the call to
        ``jax.nn.dot_product_attention``.
    causal : {None, True, 'bottom-right', 'top-left'}, optional
        fastattn's causal keyword ('bottom-right' aligns the last query with the last
        key: decoding against a cache).  Not with `is_causal` or
        `local_window_size`, which are top-left.
    window : tuple of (int or None, int or None), optional
        The sliding window ``(left, right)`` of :func:`fastattn.attention`, around
        the diagonal of `causal`'s convention.
    alibi_slopes : array_like, shape (N,) or (B, N), optional
        ALiBi slopes, as in :func:`fastattn.attention`.
    softcap : float, optional
        Logit soft-capping, finite and > 0.
    sinks : array_like, shape (N,), optional
        Attention sinks (gpt-oss): one logit per query head; differentiable.
    seqlens_k : array_like of int, shape (B,), optional
        Per-sequence key lengths, as in :func:`fastattn.attention` (causal and
        window align to them); not with `key_value_seq_lengths`.
    num_threads : int, optional
        Threads of the call (default OpenMP's).

    Returns
    -------
    jax.Array
        The output: the query's shape with Hv last, in the query's dtype.

    Raises
    ------
    TypeError
        If an argument is not an array, the dtypes differ or are not among the four
        above, `bias` is not float or `mask` not bool, or `scale` or `is_causal` has
        the wrong type.
    ValueError
        If the shapes do not fit or broadcast, an option is out of range, fastattn's
        `causal` or `window` is combined with `is_causal` or `local_window_size`, or
        `implementation` is another string.

    See Also
    --------
    fastattn.attention : The same computation on NumPy arrays (layout "bhsd").

    Notes
    -----
    - A query row that sees no key gives 0 (jax's XLA implementation gives the mean
      of the values there, from a large negative logit instead of -inf).
    - The bias's gradient is computed for any batch size (jax's cuDNN implementation
      raises for B > 1).
    - ``return_residual`` is not taken.
    - ``jit``, ``vmap`` (the FFI handlers loop over the vmapped axes; unbatched
      arguments are not copied) and ``grad`` work; contiguous inputs reach the kernel
      in place.
    - Results are bitwise identical for any thread count.

    Examples
    --------
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import fastattn.jax
    >>> kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    >>> q = jax.random.normal(kq, (2, 8, 4, 16))
    >>> k = jax.random.normal(kk, (2, 8, 2, 16))
    >>> v = jax.random.normal(kv, (2, 8, 2, 16))
    >>> out = jax.jit(fastattn.jax.dot_product_attention, static_argnames="is_causal")(
    ...     q, k, v, is_causal=True)
    >>> out.shape, out.dtype
    ((2, 8, 4, 16), dtype('float32'))
    >>> ref = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    >>> bool(jnp.allclose(out, ref, atol=1e-5))
    True
    >>> grad = jax.grad(lambda q: fastattn.jax.dot_product_attention(q, k, v).sum())(q)
    >>> grad.shape
    (2, 8, 4, 16)
    """
    if implementation is not None:
        if implementation in ("xla", "cudnn"):
            return jax.nn.dot_product_attention(
                query, key, value, bias, mask, scale=scale, is_causal=is_causal,
                query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
                local_window_size=local_window_size, implementation=implementation)
        raise ValueError(f"{_FN}: implementation must be None (fastattn), 'xla' or 'cudnn', got "
                         f"{implementation!r}")
    q, k, v = _as(query, "query"), _as(key, "key"), _as(value, "value")
    bias, mask = _as(bias, "bias"), _as(mask, "mask")
    if q.ndim != k.ndim or q.ndim != v.ndim or q.ndim not in (3, 4):
        raise ValueError(f"{_FN}: query, key and value must all be (B, T, N, H) or (T, N, H), got "
                         f"query {q.shape}, key {k.shape}, value {v.shape}")
    unbatched = q.ndim == 3
    if unbatched:
        q, k, v = q[None], k[None], v[None]
    dt = q.dtype
    if dt not in _FLOATS or k.dtype != dt or v.dtype != dt:
        raise TypeError(f"{_FN}: query, key and value must have one dtype among float32, float64, "
                        f"bfloat16 and float16, got {q.dtype}, {k.dtype} and {v.dtype}")
    B, T, N, H = q.shape
    _, S, K, _ = k.shape
    if k.shape[0] != B or v.shape[:3] != k.shape[:3] or k.shape[3] != H:
        raise ValueError(f"{_FN}: key must be (B, S, K, H) and value (B, S, K, Hv) for query "
                         f"(B, T, N, H) = {q.shape}; got key {k.shape}, value {v.shape}")
    if K == 0 or N % K:
        raise ValueError(f"{_FN}: the query heads N={N} must be a multiple of the key/value heads "
                         f"K={K} (query {q.shape}, key {k.shape})")
    if H == 0 or v.shape[3] == 0:
        raise ValueError(f"{_FN}: the feature sizes must be >= 1, got query {q.shape}, "
                         f"value {v.shape}")
    cd = _compute_dtype(dt)
    full = (B, N, T, S)
    bias = _broadcastable(bias, "bias", full, unbatched)
    if bias is not None:
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            raise TypeError(f"{_FN}: bias must be a float array, got {bias.dtype}")
        bias = bias.astype(cd)
    mask = _broadcastable(mask, "mask", full, unbatched)
    if mask is not None and mask.dtype != jnp.bool_:
        raise TypeError(f"{_FN}: mask must be a bool array (True = attend), got {mask.dtype}")
    qlen = _lengths(query_seq_lengths, "query_seq_lengths", B)
    klen = _lengths(key_value_seq_lengths, "key_value_seq_lengths", B)
    slen = _lengths(seqlens_k, "seqlens_k", B)
    if klen is not None and slen is not None:
        raise ValueError(f"{_FN}: pass key_value_seq_lengths or seqlens_k, not both")
    o = _options(scale, H, is_causal, causal, local_window_size, window, softcap, num_threads,
                 bias is not None, T, S, slen is not None)
    sk = None
    if sinks is not None:
        sk = jnp.asarray(sinks)
        if sk.shape != (N,) or not jnp.issubdtype(sk.dtype, jnp.floating):
            raise ValueError(f"{_FN}: sinks must be a float array of shape (N,) = ({N},), got "
                             f"{sk.dtype} {sk.shape}")
        sk = sk.astype(cd)
    al = None
    if alibi_slopes is not None:
        al = jnp.asarray(alibi_slopes)
        if al.shape not in ((N,), (B, N)) or not jnp.issubdtype(al.dtype, jnp.floating):
            raise ValueError(f"{_FN}: alibi_slopes must be a float array of shape (N,) or (B, N) "
                             f"= ({B}, {N}), got {al.dtype} {al.shape}")
        al = jnp.broadcast_to(jax.lax.stop_gradient(al).astype(cd), (B, N))
    lens = klen if klen is not None else slen
    out = _attention(q, k, v, bias, mask, lens, sk, al, o)
    if qlen is not None:  # padded query rows give 0, as jax's
        out = jnp.where((jnp.arange(T)[None, :] < qlen[:, None])[:, :, None, None], out, 0)
    return out[0] if unbatched else out


def _broadcastable(x, name, full, unbatched):
    """x as a 4-D array that broadcasts to the logits' shape `full` (B, N, T, S).  Fewer
    dims get leading axes of 1, as jax.nn.dot_product_attention's do (right-aligned
    broadcasting: a (T, S) mask is every batch's and head's, (1, 1, S) masks keys);
    `unbatched` calls are those with B = 1 added, which this rule covers too."""
    if x is None:
        return None
    if x.ndim > 4:
        raise ValueError(f"{_FN}: {name} must have at most 4 dims, broadcastable to the "
                         f"logits' shape (B, N, T, S) = {full}; got shape {x.shape}")
    if x.ndim < 4:
        x = x.reshape((1,) * (4 - x.ndim) + tuple(x.shape))
    if any(a not in (1, f) for a, f in zip(x.shape, full)):
        raise ValueError(f"{_FN}: {name} of shape {x.shape} does not broadcast to the logits' "
                         f"shape (B, N, T, S) = {full}")
    return x


def _lengths(x, name, B):
    if x is None:
        return None
    a = jnp.asarray(x)
    if a.shape != (B,) or not jnp.issubdtype(a.dtype, jnp.integer):
        raise ValueError(f"{_FN}: {name} must be an integer array of shape (B,) = ({B},), got "
                         f"{a.dtype} {a.shape}")
    return jnp.clip(a, 0, None).astype(jnp.int32)


def _options(scale, H, is_causal, causal, local_window_size, window, softcap, num_threads,
             has_bias, T, S, has_seqlens_k) -> _Opts:
    if scale is None:
        scale_f = 1.0 / math.sqrt(H)
    else:
        if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
            raise TypeError(f"{_FN}: scale must be a float or None, got {type(scale).__name__}")
        scale_f = float(scale)
        if not math.isfinite(scale_f):
            raise ValueError(f"{_FN}: scale must be finite, got {scale!r}")
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"{_FN}: is_causal must be a bool, got {type(is_causal).__name__}")
    code, positions = 0, 0
    wl = wr = -1
    jax_style = bool(is_causal) or local_window_size is not None
    if causal is not None and causal is not False:
        if jax_style:
            raise ValueError(f"{_FN}: causal= (fastattn's) does not combine with is_causal or "
                             "local_window_size (jax's, top-left); pass one convention")
        if causal not in (True, "bottom-right", "top-left"):
            raise ValueError(f"{_FN}: causal must be None, False, True, 'bottom-right' or "
                             f"'top-left', got {causal!r}")
        code = 2 if causal == "top-left" else 1
    if window is not None:
        if jax_style:
            raise ValueError(f"{_FN}: window= (fastattn's) does not combine with is_causal or "
                             "local_window_size; pass one convention")
        if not (isinstance(window, (tuple, list)) and len(window) == 2):
            raise ValueError(f"{_FN}: window must be a (left, right) pair, got {window!r}")
        wl, wr = (-1 if x is None else int(x) for x in window)
    if jax_style:
        # jax's conventions are top-left: the diagonal a = t (positions 0 and 0), which
        # fastattn's seqlens_k does not move
        positions = 1
        code = 1 if is_causal else 0
        if local_window_size is not None:
            lw = local_window_size
            if isinstance(lw, (int, np.integer)) and not isinstance(lw, bool):
                lw = (int(lw), int(lw))
            if not (isinstance(lw, (tuple, list)) and len(lw) == 2
                    and all(isinstance(x, (int, np.integer)) and x >= 0 for x in lw)):
                raise ValueError(f"{_FN}: local_window_size must be an int or a (left, right) pair "
                                 f"of ints >= 0, got {local_window_size!r}")
            wl, wr = int(lw[0]), int(lw[1])
    cap = 0.0
    if softcap is not None:
        cap = float(softcap)
        if not (math.isfinite(cap) and cap > 0):
            raise ValueError(f"{_FN}: softcap must be finite and > 0, got {softcap!r}")
    nth = 0
    if num_threads is not None:
        if isinstance(num_threads, bool) or not isinstance(num_threads, (int, np.integer)) \
                or num_threads < 1:
            raise ValueError(f"{_FN}: num_threads must be an int >= 1, got {num_threads!r}")
        nth = int(num_threads)
    return _Opts(scale_f, cap, code, wl, wr, positions, 0, 0, nth, int(has_bias))
