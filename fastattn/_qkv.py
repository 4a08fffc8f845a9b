"""The int8 cache's type, :class:`QuantizedKV`, in a module of its own.

fastattn._args recognizes it (to refuse it where only fastattn.attention reads it) and
fastattn._cache makes and reads it; both import it from here, and this module imports
neither, so the two import in one direction only (_cache from _args).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

__all__ = ["QuantizedKV"]


class QuantizedKV(NamedTuple):
    """An int8 K or V cache with one float32 scale per group of channels per token.

    A :class:`~typing.NamedTuple` of two arrays.  Channel ``c`` of a row stands for
    ``data[..., c] * scale[..., c // group_size]``: symmetric quantization, as
    llama.cpp's q8_0 and OpenVINO's u8 caches with group scales.  Made by
    :func:`quantize_kv`; :func:`attention` reads it in place (a QuantizedKV for both k
    and v), and :func:`dequantize_kv` gives the float32 cache it stands for.

    Parameters
    ----------
    data : ndarray of int8
        The cache's values, shape ``(..., L, D)`` in either layout (the channel axis is
        last).
    scale : ndarray of float32
        Shape ``data.shape[:-1] + (D // group_size,)``.

    See Also
    --------
    quantize_kv, dequantize_kv

    Notes
    -----
    Indexing with anything but an int selects rows of both arrays, so a slice of a
    preallocated cache is a cache too: ``quantize_kv(x_new, out=cache[..., t0:t1, :])``
    writes tokens ``t0 .. t1-1`` in place (the index must leave the channel axis whole,
    else IndexError).  An int index is the tuple's: ``cache[0]`` is `data`, ``cache[1]``
    `scale`.

    Examples
    --------
    >>> import numpy as np
    >>> import fastattn
    >>> cache = fastattn.QuantizedKV(np.zeros((2, 64, 32), np.int8),
    ...                              np.zeros((2, 64, 1), np.float32))  # 64 tokens
    >>> x = np.random.default_rng(0).standard_normal((2, 4, 32), dtype=np.float32)
    >>> _ = fastattn.quantize_kv(x, out=cache[:, 8:12])                  # tokens 8 .. 11
    >>> bool(np.allclose(fastattn.dequantize_kv(cache[:, 8:12]), x, atol=0.02))
    True
    """
    data: Any
    scale: Any

    def __getitem__(self, key):
        if isinstance(key, (int, np.integer)):
            return tuple.__getitem__(self, key)
        data, scale = self.data[key], self.scale[key]
        if (data.ndim != scale.ndim or data.shape[:-1] != scale.shape[:-1]
                or data.shape[-1] != self.data.shape[-1] or scale.shape[-1] != self.scale.shape[-1]):
            raise IndexError(f"fastattn.QuantizedKV: index {key!r} must select rows and keep the "
                             f"channel axis whole (data {self.data.shape} -> {data.shape}, scale "
                             f"{self.scale.shape} -> {scale.shape})")
        return QuantizedKV(data, scale)
