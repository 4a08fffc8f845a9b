"""The dropout draws of the float64 oracle (:mod:`fastattn.reference`): Philox-4x32-10
and the keep decisions fastattn's kernels make, in NumPy."""
from __future__ import annotations

import numbers
from typing import Any, Union

import numpy as np

from ._typing import ArrayLike

Seed = Union[int, "np.integer[Any]", None]

__all__ = ["philox4x32", "dropout_keep"]

# Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011;
# the Random123 library's philox4x32 with its default 10 rounds).
_PHILOX_M0, _PHILOX_M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_PHILOX_W0, _PHILOX_W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_U32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)


def _u32_words(name, x, n):
    """x as a uint64 array whose last axis has n entries, each in [0, 2**32)."""
    a = np.asarray(x)
    if not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name} must be an integer array, got dtype {a.dtype} with shape "
                        f"{a.shape}")
    if a.ndim < 1 or a.shape[-1] != n:
        raise ValueError(f"{name} must have a last axis of {n} words, got shape {a.shape}")
    if a.size and (a.min() < 0 or a.max() > 0xFFFFFFFF):
        raise ValueError(f"{name} words must be in [0, 2**32), got values in "
                         f"[{a.min()}, {a.max()}]")
    return a.astype(np.uint64)


def philox4x32(counter: ArrayLike, key: ArrayLike) -> np.ndarray:
    """Philox-4x32-10, vectorised: one block of four uint32 words per counter.

    Parameters
    ----------
    counter : integer array (..., 4), words (c0, c1, c2, c3) in [0, 2**32).
    key : integer array (2,) or (..., 2) broadcastable against counter's leading axes,
        words (k0, k1) in [0, 2**32).

    Returns
    -------
    uint32 array (..., 4): the output block of each counter.
    """
    c = _u32_words("counter", counter, 4)
    k = _u32_words("key", key, 2)
    c0, c1, c2, c3 = c[..., 0], c[..., 1], c[..., 2], c[..., 3]
    k0, k1 = k[..., 0], k[..., 1]
    for r in range(10):
        # 32x32 -> 64-bit products fit exactly in uint64
        p0, p1 = _PHILOX_M0 * c0, _PHILOX_M1 * c2
        c0, c1, c2, c3 = ((p1 >> _SHIFT32) ^ c1 ^ k0, p1 & _U32,
                          (p0 >> _SHIFT32) ^ c3 ^ k1, p0 & _U32)
        if r < 9:
            k0, k1 = (k0 + _PHILOX_W0) & _U32, (k1 + _PHILOX_W1) & _U32
    return np.stack(np.broadcast_arrays(c0, c1, c2, c3), axis=-1).astype(np.uint32)


def _check_dropout(dropout_p, seed, name="dropout_p"):
    """Validated (p as float, seed as int or None); name is what the caller calls p."""
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"{name} must be a real number in [0, 1), got {dropout_p!r}")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:         # also rejects NaN
        raise ValueError(f"{name} must be in [0, 1), got {dropout_p!r}")
    if seed is not None:
        if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"seed must be an int in [0, 2**64), got {seed!r}")
        seed = int(seed)
        if not 0 <= seed < 2 ** 64:
            raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    elif p > 0:
        raise ValueError(f"{name} > 0 needs a seed, got {name}={dropout_p!r} and "
                         f"seed=None")
    return p, seed


def _keep(seed, p, B, H, Lq, Lk, b0=0):
    """Keep mask (B, H, Lq, Lk) for batch indices b0 .. b0 + B - 1 (validated p, seed)."""
    t = min(int(p * 4294967296.0), 2 ** 32 - 1)
    if t == 0:
        return np.ones((B, H, Lq, Lk), dtype=bool)
    J = -(-Lk // 4)                       # one counter per 4 keys: word j & 3 of j >> 2
    c = np.empty((B, H, Lq, J, 4), dtype=np.uint64)
    c[..., 0] = np.arange(J)
    c[..., 1] = np.arange(Lq)[:, None]
    c[..., 2] = np.arange(H)[:, None, None]
    c[..., 3] = (b0 + np.arange(B))[:, None, None, None]
    words = philox4x32(c, [seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF])
    return words.reshape(B, H, Lq, 4 * J)[..., :Lk] >= np.uint32(t)


def dropout_keep(seed: Seed, p: float, B: int, H: int, Lq: int, Lk: int) -> np.ndarray:
    """fastattn's dropout decisions: bool array (B, H, Lq, Lk), True = kept.

    Entry (b, h, i, j) is kept iff word ``j & 3`` of
    ``philox4x32((j >> 2, i, h, b), (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF))``
    is ``>= min(int(p * 2**32), 2**32 - 1)``; so p = 0 keeps everything.

    Parameters
    ----------
    seed : int in [0, 2**64).
    p : float in [0, 1), the drop probability.
    B, H, Lq, Lk : ints >= 0, the batch, query-head, query and key counts.
    """
    p, seed = _check_dropout(p, seed, "p")
    for name, n in (("B", B), ("H", H), ("Lq", Lq), ("Lk", Lk)):
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {n!r}")
        if n < 0:
            raise ValueError(f"{name} must be >= 0, got {n!r}")
    if seed is None:                      # p == 0: no generator needed
        return np.ones((B, H, Lq, Lk), dtype=bool)
    return _keep(seed, p, int(B), int(H), int(Lq), int(Lk))
