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

    data : int8 array, the cache's shape ``(..., L, D)`` (any layout: the channel axis
        is last)
    scale : float32 array, shape ``data.shape[:-1] + (D // group_size,)``

    Channel ``c`` of a row is ``data[..., c] * scale[..., c // group_size]``
    (symmetric, as llama.cpp's q8_0 and OpenVINO's u8 caches with group scales).

    Indexing with anything but an int selects rows of both arrays, so a slice of a
    preallocated cache is a cache too: ``quantize_kv(x_new, out=cache[..., t0:t1, :])``
    writes tokens ``t0 .. t1-1`` in place (the index must leave the channel axis whole).
    An int index is the tuple's: ``cache[0]`` is `data`, ``cache[1]`` `scale`.
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
