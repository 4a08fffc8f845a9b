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

    The counter-based generator of Salmon et al. (SC 2011), with the Random123 library's
    default 10 rounds; fastattn's dropout draws from it.

    Parameters
    ----------
    counter : array_like of int, shape (..., 4)
        Words ``(c0, c1, c2, c3)``, each in [0, 2**32).
    key : array_like of int, shape (2,) or (..., 2)
        Words ``(k0, k1)``, each in [0, 2**32), broadcastable against counter's leading
        axes.

    Returns
    -------
    ndarray of uint32
        Shape ``(..., 4)``: the output block of each counter.

    Raises
    ------
    TypeError
        If counter or key is not an integer array.
    ValueError
        If a last axis has the wrong length or a word is outside [0, 2**32).

    Examples
    --------
    Random123's known-answer test (counter and key all zero):

    >>> from fastattn import reference
    >>> [hex(w) for w in reference.philox4x32([0, 0, 0, 0], [0, 0])]
    ['0x6627e8d5', '0xe169c58d', '0xbc57ac4c', '0x9b00dbd8']
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
    """fastattn's dropout decisions, as a boolean array (True = kept).

    Entry ``(b, h, i, j)`` is kept iff word ``j & 3`` of
    ``philox4x32((j >> 2, i, h, b), (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF))`` is
    ``>= min(int(p * 2**32), 2**32 - 1)``, so ``p = 0`` keeps everything.  The kernels
    make the same decisions, whatever the threads and blocks.

    Parameters
    ----------
    seed : int
        In [0, 2**64); may be None when ``p = 0``.
    p : float
        The drop probability, in [0, 1).
    B, H, Lq, Lk : int
        The batch, query-head, query and key counts, >= 0.

    Returns
    -------
    ndarray of bool
        Shape ``(B, H, Lq, Lk)``.

    Raises
    ------
    TypeError, ValueError
        If `seed`, `p` or a count is of the wrong type or out of range.

    See Also
    --------
    philox4x32 : The generator.

    Examples
    --------
    >>> from fastattn import reference
    >>> keep = reference.dropout_keep(1234, 0.25, 1, 2, 64, 64)
    >>> keep.shape, bool(0.7 < keep.mean() < 0.8)
    ((1, 2, 64, 64), True)
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
