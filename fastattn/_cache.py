"""KV caches beyond a plain float array: the int8 cache (:class:`QuantizedKV`,
:func:`quantize_kv`, :func:`dequantize_kv`) and paged caches (pools of pages and a
block table, vLLM's layout), and the parsing of such k/v arguments of
:func:`fastattn.attention` into what the kernel reads in place.

The kernel reads an int8 cache a key tile at a time, dequantized into float32 in the
thread's tile buffer (``data * scale``, one float32 multiply, the bits of
:func:`dequantize_kv`), and a paged cache through its block table, page by page (a
tile inside one page is read in place, else its rows are gathered).  So attention
over an int8 cache has the bits of attention over ``dequantize_kv`` of it, and a
paged cache the bits of the same keys in a contiguous cache.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import numpy as np

from ._args import F16, F32, F64, as_array, fresh, in_place, is_bf16
from ._qkv import QuantizedKV

__all__ = ["QuantizedKV", "quantize_kv", "dequantize_kv"]

I8 = np.dtype(np.int8)


def _group_size(group_size, D, fn):
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)):
        raise TypeError(f"fastattn.{fn}: group_size must be an int, got {type(group_size).__name__}")
    if group_size < 1 or D % group_size:
        raise ValueError(f"fastattn.{fn}: group_size={group_size} must be >= 1 and divide the "
                         f"channel axis D={D}")
    return int(group_size)


def quantize_kv(x, *, group_size: int = 32, out: Optional[QuantizedKV] = None) -> QuantizedKV:
    """Quantize a K or V cache to int8 with one float32 scale per group of channels per row.

    Each group of `group_size` channels of a row gets ``scale = max|x| / 127`` over the
    group (computed in float32), and ``data = round(x / scale)`` (to nearest even; 0
    where the group is all zero).

    Parameters
    ----------
    x : array_like, shape (..., D)
        The cache, float32, float64, float16 or bfloat16, in either layout (the channel
        axis is last).
    group_size : int, optional
        Channels per scale, >= 1, dividing ``D``; default 32.
    out : QuantizedKV, optional
        Where to write the result: data int8 of x's shape, scale float32 of shape
        ``x.shape[:-1] + (D // group_size,)``, e.g. a slice of a preallocated cache,
        ``out=cache[..., t0:t1, :]``.  It is returned.

    Returns
    -------
    QuantizedKV
        The int8 data and the float32 scales (`out` where it was given).

    Raises
    ------
    TypeError
        If x is not float32, float64, float16 or bfloat16, or `out` is not a
        QuantizedKV.
    ValueError
        If x holds values that are not finite (an int8 cache cannot hold them), if
        `group_size` does not divide ``D``, or if `out`'s arrays have the wrong shape or
        dtype.

    See Also
    --------
    QuantizedKV, dequantize_kv, attention

    Examples
    --------
    >>> import numpy as np
    >>> import fastattn
    >>> rng = np.random.default_rng(0)
    >>> k, v = (rng.standard_normal((1, 4, 256, 64), dtype=np.float32) for _ in range(2))
    >>> kq, vq = fastattn.quantize_kv(k), fastattn.quantize_kv(v)
    >>> kq.data.dtype, kq.scale.shape
    (dtype('int8'), (1, 4, 256, 2))
    >>> q = rng.standard_normal((1, 4, 1, 64), dtype=np.float32)
    >>> out = fastattn.attention(q, kq, vq)           # reads the int8 cache in place
    >>> same = fastattn.attention(q, fastattn.dequantize_kv(kq), fastattn.dequantize_kv(vq))
    >>> bool(np.array_equal(out, same))
    True
    """
    fn = "quantize_kv"
    a = as_array(x, "x", fn)
    if not (a.dtype in (F32, F64, F16) or is_bf16(a.dtype)):
        raise TypeError(f"fastattn.{fn}: x must be float32, float64, float16 or bfloat16, got "
                        f"dtype {a.dtype}")
    if a.ndim < 1:
        raise ValueError(f"fastattn.{fn}: x must have a channel axis, got shape {a.shape}")
    D = a.shape[-1]
    gs = _group_size(group_size, D, fn)
    groups = a.astype(F32).reshape(a.shape[:-1] + (D // gs, gs))
    amax = np.max(np.abs(groups), axis=-1) if groups.size else np.zeros(groups.shape[:-1], F32)
    if not np.all(np.isfinite(amax)):
        raise ValueError(f"fastattn.{fn}: x holds values that are not finite (inf or NaN), "
                         "which an int8 cache cannot hold")
    scale = (amax / np.float32(127)).astype(F32)
    safe = np.where(scale == 0, np.float32(1), scale)
    data = np.clip(np.rint(groups / safe[..., None]), -127, 127).astype(I8).reshape(a.shape)
    if out is None:
        return QuantizedKV(data, scale)
    if not isinstance(out, QuantizedKV):
        raise TypeError(f"fastattn.{fn}: out must be a fastattn.QuantizedKV, got {type(out).__name__}")
    for name, arr, want in (("data", out.data, data), ("scale", out.scale, scale)):
        if not isinstance(arr, np.ndarray) or arr.shape != want.shape or arr.dtype != want.dtype:
            got = (arr.shape, arr.dtype) if isinstance(arr, np.ndarray) else type(arr).__name__
            raise ValueError(f"fastattn.{fn}: out.{name} must be a {want.dtype} array of shape "
                             f"{want.shape} (x {a.shape}, group_size {gs}), got {got}")
        arr[...] = want
    return out


def _quantized(qkv, name, fn):
    """A QuantizedKV argument checked: (data int8, scale float32, the group size)."""
    data, scale = (as_array(a, f"{name}.{part}", fn) for a, part in zip(qkv, ("data", "scale")))
    if data.dtype != I8:
        raise TypeError(f"fastattn.{fn}: {name}.data must be int8, got dtype {data.dtype}")
    if scale.dtype != F32:
        raise TypeError(f"fastattn.{fn}: {name}.scale must be float32, got dtype {scale.dtype}")
    G = scale.shape[-1] if scale.ndim else 0
    if (data.ndim < 1 or scale.shape[:-1] != data.shape[:-1] or G < 1 or data.shape[-1] % G):
        raise ValueError(f"fastattn.{fn}: {name}.scale must have shape data.shape[:-1] + "
                         f"(D // group_size,) with a group size dividing D; got data "
                         f"{data.shape}, scale {scale.shape}")
    return data, scale


def dequantize_kv(qkv: QuantizedKV) -> np.ndarray:
    """The float32 cache a :class:`QuantizedKV` stands for.

    Parameters
    ----------
    qkv : QuantizedKV
        An int8 cache, as :func:`quantize_kv` makes it.

    Returns
    -------
    ndarray of float32
        ``data * scale`` per group, in data's shape: one float32 multiply per element,
        the values :func:`attention` reads from the int8 cache.

    Raises
    ------
    TypeError
        If data is not int8 or scale not float32.
    ValueError
        If scale's shape is not ``data.shape[:-1] + (D // group_size,)`` for a group
        size dividing ``D``.

    See Also
    --------
    QuantizedKV, quantize_kv

    Examples
    --------
    >>> import numpy as np
    >>> import fastattn
    >>> x = np.array([[0.5, -1.0, 0.25, 2.0]], np.float32)
    >>> np.round(fastattn.dequantize_kv(fastattn.quantize_kv(x, group_size=2)), 4)
    array([[ 0.5039, -1.    ,  0.252 ,  2.    ]], dtype=float32)
    """
    data, scale = _quantized(qkv, "qkv", "dequantize_kv")
    G = scale.shape[-1]
    groups = data.astype(F32).reshape(data.shape[:-1] + (G, data.shape[-1] // G))
    return (groups * scale[..., None]).reshape(data.shape)


class Source(NamedTuple):
    """What the kernel reads for a cache argument: k and v as stand-ins for the shape
    checks (float arrays of the logical shape, in the caller's layout, never read),
    the arrays passed to the kernel (bhsd views: (B, Hkv, L, D), or for a pool
    (pages, Hkv, page_size, D)), and the Variants fields to set."""
    k_shape: Any
    v_shape: Any
    k: Any
    v: Any
    fields: dict


def _standin(shape, dtype):
    return np.broadcast_to(np.zeros((), dtype), shape)


def kv_source(fn, q, k, v, block_table, seqlens_k, layout):
    """k, v of :func:`fastattn.attention` that are QuantizedKV or paged pools (with
    `block_table`), checked, as a :class:`Source`; None for plain arrays without a
    block table (the usual call)."""
    qk, qv = isinstance(k, QuantizedKV), isinstance(v, QuantizedKV)
    if qk != qv:
        raise TypeError(f"fastattn.{fn}: k and v must both be fastattn.QuantizedKV or both "
                        f"arrays, got k {type(k).__name__}, v {type(v).__name__}")
    if not qk and block_table is None:
        return None
    fields: dict = {}
    if qk:
        kd, ks = _quantized(k, "k", fn)
        vd, vs = _quantized(v, "v", fn)
        dtype = F32
    else:
        kd, vd = as_array(k, "k", fn), as_array(v, "v", fn)
        dtype = kd.dtype
    if kd.ndim < 1 or vd.ndim < 1 or kd.shape[-1] == 0 or vd.shape[-1] == 0:
        raise ValueError(f"fastattn.{fn}: a quantized or paged cache needs D >= 1 and Dv >= 1, got "
                         f"k {kd.shape}, v {vd.shape}")
    swap = layout == "bshd"
    if block_table is None:
        kd_, vd_ = (a.swapaxes(-2, -3) if swap and a.ndim > 2 else a for a in (kd, vd))
        if qk:
            fields["k_scale"], fields["v_scale"] = (
                in_place(a.swapaxes(-2, -3) if swap and a.ndim > 2 else a, F32) for a in (ks, vs))
        return Source(_standin(kd.shape, dtype), _standin(vd.shape, vd.dtype if not qk else F32),
                      in_place(kd_, kd.dtype), in_place(vd_, vd.dtype), fields)

    # paged: pools (pages, page_size, Hkv, D), block_table (B, max_blocks)
    if kd.ndim != 4 or vd.ndim != 4 or kd.shape[:3] != vd.shape[:3]:
        raise ValueError(f"fastattn.{fn}: with block_table, k and v must be pools of shape "
                         f"(num_blocks, block_size, Hkv, D) and (num_blocks, block_size, Hkv, "
                         f"Dv) that agree on the first three axes; got k {kd.shape}, v {vd.shape}")
    qa = as_array(q, "q", fn)
    if qa.ndim != 4:
        raise ValueError(f"fastattn.{fn}: with block_table, q must be 4-D (B, Hq, Lq, D) (or "
                         f"(B, Lq, Hq, D) for layout 'bshd'), got shape {qa.shape}")
    bt = as_array(block_table, "block_table", fn)
    if bt.dtype.kind not in "iu":
        raise TypeError(f"fastattn.{fn}: block_table must be an integer array (int32), got dtype "
                        f"{bt.dtype}")
    B = qa.shape[0]
    if bt.ndim != 2 or bt.shape[0] != B:
        raise ValueError(f"fastattn.{fn}: block_table must have shape (B, max_blocks) with B={B} "
                         f"(q's batch), got {bt.shape}")
    pages, page, hkv = kd.shape[:3]
    if page < 1:
        raise ValueError(f"fastattn.{fn}: the pools' block_size must be >= 1, got {kd.shape}")
    Lk = bt.shape[1] * page
    if seqlens_k is None:
        lens = np.full(B, Lk, np.int64)
    else:
        lens = np.asarray(as_array(seqlens_k, "seqlens_k", fn))
        if lens.shape == (B,) and lens.dtype.kind in "iu" and lens.size and lens.max() > Lk:
            b = int(np.argmax(lens))
            raise ValueError(f"fastattn.{fn}: seqlens_k[{b}] = {int(lens[b])} keys need "
                             f"{-(-int(lens[b]) // page)} blocks of {page}, past the "
                             f"{bt.shape[1]} entries of block_table's row {b}")
        lens = lens.astype(np.int64) if lens.shape == (B,) and lens.dtype.kind in "iu" else None
    if lens is not None:  # seqlens_k's own errors come from the shape checks
        # the entries each sequence's keys fill, and those of them outside the pool
        used = np.arange(bt.shape[1]) < ((np.maximum(lens, 0) + page - 1) // page)[:, None]
        bad = used & ((bt < 0) | (bt >= pages))
        if bad.any():
            b, e = (int(x) for x in np.argwhere(bad)[0])
            raise ValueError(f"fastattn.{fn}: block_table[{b}, {e}] = {int(bt[b, e])} is not a "
                             f"block of the pool (0 .. {pages - 1}); sequence {b} reads entries "
                             f"0 .. {int(used[b].sum()) - 1} for its {int(lens[b])} keys")
    fields["block_table"] = fresh(bt, np.int32)
    fields["num_pages"] = pages
    shape = lambda d: (B, Lk, hkv, d) if swap else (B, hkv, Lk, d)  # noqa: E731
    if qk:
        fields["k_scale"], fields["v_scale"] = (in_place(a.swapaxes(1, 2), F32) for a in (ks, vs))
    return Source(_standin(shape(kd.shape[3]), dtype), _standin(shape(vd.shape[3]), dtype if qk else vd.dtype),
                  in_place(kd.swapaxes(1, 2), kd.dtype), in_place(vd.swapaxes(1, 2), vd.dtype), fields)

