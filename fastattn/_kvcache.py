"""fastattn.KVCache: a key/value cache that fastattn owns, laid out the way the kernels
read it (keys on the SIMD lanes), in float32, float16, bfloat16, int8 or int4."""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence, Union

import numpy as np

from . import _kernels
from ._args import F16, F32, as_array, bf16, is_bf16
from ._cache import Source, _standin

__all__ = ["KVCache"]

I8 = np.dtype(np.int8)
# the most query rows a kv head of a call reads the blocks in place with (the kernel's
# decode rows, FA_DOT_ROWS); more take the prefill path (KVCache._rows)
_DECODE_ROWS = 8
_FLOAT = ("float32", "float16", "bfloat16")
_QUANT = ("int8", "int4")


def _dtype_name(dtype) -> str:
    if isinstance(dtype, str):
        name = dtype
    else:
        try:
            d = np.dtype(dtype)
        except TypeError:
            raise TypeError(f"fastattn.KVCache: dtype must be one of 'float32', 'float16', "
                            f"'bfloat16', 'int8', 'int4', got {dtype!r}") from None
        name = "bfloat16" if is_bf16(d) else d.name
    if name not in _FLOAT + _QUANT:
        raise ValueError(f"fastattn.KVCache: dtype must be one of 'float32', 'float16', "
                         f"'bfloat16', 'int8', 'int4', got {dtype!r}")
    return name


def _positive(x, name):
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"fastattn.KVCache: {name} must be an int, got {type(x).__name__}")
    if x < 1:
        raise ValueError(f"fastattn.KVCache: {name} must be >= 1, got {x}")
    return int(x)


def _v_group(Dv: int) -> int:
    """Channels per scale of a quantized value row: 32, or the largest power of two
    below it that divides Dv."""
    g = 32
    while Dv % g:
        g //= 2
    return g


def _fma(c, s, z):
    """fmaf(c, s, z) elementwise on float32 arrays that broadcast together: the one
    rounding the kernels dequantize keys with."""
    c, s, z = (np.ascontiguousarray(a, dtype=F32) for a in np.broadcast_arrays(c, s, z))
    out = np.empty(c.shape, F32)
    _kernels.fma32(c, s, z, out)
    return out


def _pack4(codes):
    """Codes 0..15 along the last axis (even length), two a byte: code 2i in the low
    nibble of byte i."""
    c = codes.astype(np.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(I8)


def _pack4_pairs(lanes):
    """Key codes 0..15 (..., D, bs) on the lanes as feature pairs: byte (e, l) holds
    feature 2e's code of lane l in its low nibble and feature 2e + 1's in its high one
    (D odd: the last high nibble 0), (..., ceil(D / 2), bs)."""
    c = lanes.astype(np.uint8)
    if c.shape[-2] % 2:
        c = np.concatenate([c, np.zeros(c.shape[:-2] + (1, c.shape[-1]), np.uint8)], axis=-2)
    return (c[..., 0::2, :] | (c[..., 1::2, :] << 4)).view(I8)


def _unpack4_pairs(data, D):
    """The (..., D, bs) codes of blocks packed by _pack4_pairs, as uint8 0..15."""
    b = data.view(np.uint8)
    out = np.empty(b.shape[:-2] + (2 * b.shape[-2], b.shape[-1]), np.uint8)
    out[..., 0::2, :] = b & 15
    out[..., 1::2, :] = b >> 4
    return out[..., :D, :]


def _pack4_values(codes, g):
    """Value codes 0..15 (..., Dv) as stored: in groups of g = 32 channels, byte i of a
    group holds channels i (low nibble) and i + 16 (high), so a load of 16 bytes gives
    either half of the group; other g as _pack4."""
    if g != 32:
        return _pack4(codes)
    c = codes.astype(np.uint8).reshape(codes.shape[:-1] + (codes.shape[-1] // 32, 2, 16))
    return (c[..., 0, :] | (c[..., 1, :] << 4)).reshape(codes.shape[:-1] + (codes.shape[-1] // 2,)).view(I8)


def _unpack4_values(data, n, g):
    """The n codes of value rows packed by _pack4_values, as uint8 0..15."""
    if g != 32:
        return _unpack4(data, n)
    b = data.view(np.uint8).reshape(data.shape[:-1] + (n // 32, 1, 16))
    out = np.concatenate([b & 15, b >> 4], axis=-2)
    return out.reshape(data.shape[:-1] + (n,))


def _unpack4(data, n):
    """The first n codes of rows packed by _pack4, as uint8 0..15."""
    b = data.view(np.uint8)
    out = np.empty(b.shape[:-1] + (2 * b.shape[-1],), np.uint8)
    out[..., 0::2] = b & 15
    out[..., 1::2] = b >> 4
    return out[..., :n]


class KVCache:
    """A KV cache that fastattn owns: ``batch`` sequence slots of up to ``capacity``
    tokens each, stored the way the kernels read them.

    Keys are stored in blocks of ``block_size`` tokens per slot and kv head, each block
    laid out ``[head_dim][block_size]``: the keys on the SIMD lanes, as vLLM's CPU
    backend stores them.  A decode step then reads each block as it is, with no
    transpose, and its logits are the same FMA chains (and bits) as a prefill's over
    the same keys.  Values are stored in rows ``(token, v_head_dim)``.  The storage is
    allocated once, for ``capacity`` tokens per slot (rounded up to whole blocks).

    Parameters
    ----------
    batch : int
        Sequence slots.
    kv_heads : int
        Key/value heads (queries may have a multiple of them: GQA, MQA).
    head_dim : int
        Channels of a key (D).
    capacity : int
        Tokens each slot can hold.
    dtype : {"float32", "float16", "bfloat16", "int8", "int4"}, optional
        What is stored (default "float32").  The float types hold the appended values
        converted to that type (round to nearest even).  The quantized ones store, as
        KIVI and OpenVINO's default cache do:

        - **keys per channel within a block**: for each block, kv head and channel,
          a float32 scale ``s`` and zero point ``z`` over the block's tokens; a code
          ``c`` (int8: -128..127; int4: 0..15, two a byte: channels 2e and 2e + 1 of
          a token in the low and high nibbles of one byte) stands for
          ``fmaf(c, s, z)`` (one rounding).  A block whose tokens have not all arrived
          is quantized over those present, from float32 copies of them kept beside it,
          and quantized again as each token arrives, until it is full;
        - **values per token in groups** of 32 channels (or the largest power of two
          dividing ``v_head_dim``): a float32 scale ``s`` per group; int8 codes
          ``round(x / s)`` with ``s = max|x| / 127``, ``c * s``; int4 codes as
          llama.cpp's q4_0 (the group's value of largest magnitude ``m``,
          ``s = m / -8``, codes ``clip(round(x / s), -8, 7)``), ``c * s``, two a byte
          (in a group of 32, byte i holds channels i and i + 16, plus 8, in its low and
          high nibbles; in smaller groups channels 2i and 2i + 1).

    v_head_dim : int, optional
        Channels of a value (Dv); default ``head_dim``.
    block_size : int, optional
        Tokens per key block, a multiple of 16; default 16 for the float types, 64 for
        int8 and int4 (whose per-channel scale and zero point then cost 1 bit a key
        element).

    Attributes
    ----------
    lengths : ndarray of int64, shape (batch,)
        Tokens each slot holds (a copy).
    nbytes : int
        Bytes of every array the cache holds.

    Notes
    -----
    Pass the cache as ``k`` to :func:`fastattn.attention` (``v`` omitted): ``q`` of
    shape ``(batch, Hq, Lq, head_dim)`` holds the queries of each slot's last ``Lq``
    tokens (bottom-right), so a decode step is ``Lq = 1`` after appending the token,
    and a chunk of prefill is ``Lq = n`` after appending its ``n`` tokens.  The keys a
    slot attends over are ``cache.keys(slot)``, exactly: the result is attention over
    ``cache.keys(b)`` and ``cache.values(b)`` for each slot b.

    Examples
    --------
    >>> import numpy as np
    >>> import fastattn
    >>> rng = np.random.default_rng(0)
    >>> cache = fastattn.KVCache(2, 4, 64, capacity=1024, dtype="int8")
    >>> k, v = (rng.standard_normal((2, 4, 100, 64), dtype=np.float32) for _ in range(2))
    >>> cache.append(k, v)                              # a prompt of 100 tokens a slot
    >>> q = rng.standard_normal((2, 8, 1, 64), dtype=np.float32)
    >>> cache.append(k[:, :, :1], v[:, :, :1])          # the next token's k, v
    >>> out = fastattn.attention(q, cache, causal=True)  # its decode step
    >>> out.shape, cache.lengths.tolist()
    ((2, 8, 1, 64), [101, 101])
    >>> ref = fastattn.reference.attention(q[:1], cache.keys(0)[None], cache.values(0)[None])
    >>> bool(np.allclose(out[:1], ref, atol=1e-5))
    True
    """

    # the arrays (scales, zero points and the partial block's float32 keys: None for the
    # float types)
    _k: np.ndarray
    _v: np.ndarray
    _ks: Any
    _kz: Any
    _vs: Any
    _kf: Any

    def __init__(self, batch: int, kv_heads: int, head_dim: int, capacity: int, *,
                 dtype: Any = "float32", v_head_dim: Optional[int] = None,
                 block_size: Optional[int] = None) -> None:
        B = _positive(batch, "batch")
        H = _positive(kv_heads, "kv_heads")
        D = _positive(head_dim, "head_dim")
        cap = _positive(capacity, "capacity")
        Dv = D if v_head_dim is None else _positive(v_head_dim, "v_head_dim")
        name = _dtype_name(dtype)
        quant = name in _QUANT
        bs = (64 if quant else 16) if block_size is None else _positive(block_size, "block_size")
        if bs % 16:
            raise ValueError(f"fastattn.KVCache: block_size must be a multiple of 16, got {bs}")
        self._B, self._H, self._D, self._Dv, self._cap, self._bs = B, H, D, Dv, cap, bs
        self._name = name
        nblk = -(-cap // bs)
        self._nblk = nblk
        self._len = np.zeros(B, np.int64)
        if not quant:
            # (ml_dtypes imported only for a bfloat16 cache: `import fastattn` leaves it alone)
            st: Any = {"float32": F32, "float16": F16}[name] if name != "bfloat16" else bf16(load=True)
            if st is None:
                raise TypeError("fastattn.KVCache: dtype 'bfloat16' needs ml_dtypes "
                                "(pip install ml_dtypes)")
            self._store = np.dtype(st)
            self._k = np.zeros((B, H, nblk, D * bs), self._store)
            self._v = np.zeros((B, H, nblk * bs, Dv), self._store)
            self._ks = self._kz = self._vs = self._kf = None
            self._vg = 0
        else:
            self._store = I8
            kw = D * bs if name == "int8" else (D + 1) // 2 * bs
            self._k = np.zeros((B, H, nblk, kw), I8)
            self._ks = np.zeros((B, H, nblk, D), F32)
            self._kz = np.zeros((B, H, nblk, D), F32)
            self._kf = np.zeros((B, H, bs, D), F32)  # the partial block's keys, float32
            self._vg = _v_group(Dv)
            vw = Dv if name == "int8" else (Dv + 1) // 2
            self._v = np.zeros((B, H, nblk * bs, vw), I8)
            self._vs = np.zeros((B, H, nblk * bs, Dv // self._vg), F32)

    # ---- what the cache is ----
    @property
    def batch(self) -> int:
        """Sequence slots."""
        return self._B

    @property
    def kv_heads(self) -> int:
        """Key/value heads."""
        return self._H

    @property
    def head_dim(self) -> int:
        """Channels of a key."""
        return self._D

    @property
    def v_head_dim(self) -> int:
        """Channels of a value."""
        return self._Dv

    @property
    def capacity(self) -> int:
        """Tokens each slot can hold."""
        return self._cap

    @property
    def block_size(self) -> int:
        """Tokens per key block."""
        return self._bs

    @property
    def dtype(self) -> str:
        """What is stored: 'float32', 'float16', 'bfloat16', 'int8' or 'int4'."""
        return self._name

    @property
    def lengths(self) -> np.ndarray:
        """Tokens each slot holds, int64 (batch,) (a copy)."""
        return self._len.copy()

    @property
    def nbytes(self) -> int:
        """Bytes of every array the cache holds (keys, values, scales, zero points,
        the float32 copies of partial key blocks)."""
        arrs = (self._k, self._v, self._ks, self._kz, self._vs, self._kf)
        return int(sum(a.nbytes for a in arrs if a is not None))

    def __repr__(self) -> str:
        return (f"fastattn.KVCache(batch={self._B}, kv_heads={self._H}, head_dim={self._D}, "
                f"capacity={self._cap}, dtype={self._name!r}, v_head_dim={self._Dv}, "
                f"block_size={self._bs}; lengths {self._len.tolist()})")

    # ---- writing ----
    def _slots(self, slots, fn) -> np.ndarray:
        if slots is None:
            return np.arange(self._B)
        s = np.asarray(slots)
        if s.ndim == 0:
            s = s.reshape(1)
        if s.dtype.kind not in "iu" or s.ndim != 1:
            raise TypeError(f"fastattn.KVCache.{fn}: slots must be an int or a 1-D sequence of "
                            f"ints, got {slots!r}")
        if s.size and (s.min() < 0 or s.max() >= self._B):
            raise ValueError(f"fastattn.KVCache.{fn}: slots must be in [0, {self._B}), got "
                             f"{s.tolist()}")
        if np.unique(s).size != s.size:
            raise ValueError(f"fastattn.KVCache.{fn}: slots must not repeat, got {s.tolist()}")
        return s.astype(np.int64)

    def _input(self, x, name, width, n_slots):
        if type(x).__module__.startswith("torch"):  # a CPU tensor: a view of its memory
            if x.device.type != "cpu":
                raise ValueError(f"fastattn.KVCache.append: {name} is on {x.device}; fastattn runs "
                                 "on CPU tensors")
            x = x.detach()
            if str(x.dtype) == "torch.bfloat16":  # (NumPy has no bfloat16: ml_dtypes' view)
                b16 = bf16(load=True)
                if b16 is None:
                    raise TypeError(f"fastattn.KVCache.append: {name} is bfloat16, which needs "
                                    "ml_dtypes (pip install ml_dtypes)")
                x = x.view(sys.modules["torch"].int16).numpy().view(b16)
            else:
                x = x.numpy()
        a = np.asarray(as_array(x, name, "KVCache.append"))
        if not (a.dtype == F32 or a.dtype == F16 or is_bf16(a.dtype)):
            raise TypeError(f"fastattn.KVCache.append: {name} must be float32, float16 or "
                            f"bfloat16, got dtype {a.dtype}")
        if a.ndim != 4 or a.shape[0] != n_slots or a.shape[1] != self._H or a.shape[3] != width:
            raise ValueError(f"fastattn.KVCache.append: {name} must have shape ({n_slots}, "
                             f"{self._H}, n, {width}) (slots, kv_heads, new tokens, channels), "
                             f"got {a.shape}")
        return a

    def append(self, k: Any, v: Any, *, slots: Union[int, Sequence[int], None] = None,
               lengths: Optional[Sequence[int]] = None) -> None:
        """Append new tokens' keys and values at each slot's current length.

        Parameters
        ----------
        k : array_like, shape (S, kv_heads, n, head_dim)
            float32, float16 or bfloat16 (arrays, or CPU torch tensors, read in place);
            S = ``len(slots)`` (or ``batch``).
        v : array_like, shape (S, kv_heads, n, v_head_dim)
            Likewise.
        slots : int or sequence of int, optional
            The slots row i of k and v goes to (distinct); default every slot in order.
        lengths : sequence of int, optional
            Ragged new tokens: slot ``slots[i]`` takes the first ``lengths[i]`` (0 .. n)
            of its n rows; default n each.

        Raises
        ------
        TypeError
            If k or v is not float32, float16 or bfloat16, or slots are not ints.
        ValueError
            If a shape is wrong, a slot repeats or is out of range, a length is outside
            [0, n], a slot would pass its capacity, or (int8, int4) a value is not
            finite.  Nothing in the cache changes when an error is raised.
        """
        s = self._slots(slots, "append")
        ka = self._input(k, "k", self._D, s.size)
        va = self._input(v, "v", self._Dv, s.size)
        n = ka.shape[2]
        if va.shape[2] != n:
            raise ValueError(f"fastattn.KVCache.append: k and v must have the same number of new "
                             f"tokens, got k {ka.shape}, v {va.shape}")
        if lengths is None:
            add = np.full(s.size, n, np.int64)
        else:
            add = np.asarray(lengths)
            if add.dtype.kind not in "iu" or add.shape != (s.size,):
                raise ValueError(f"fastattn.KVCache.append: lengths must be {s.size} ints (one a "
                                 f"slot), got {lengths!r}")
            if add.size and (add.min() < 0 or add.max() > n):
                raise ValueError(f"fastattn.KVCache.append: lengths must be in [0, {n}] (the new "
                                 f"tokens given), got {add.tolist()}")
            add = add.astype(np.int64)
        full = self._len[s] + add > self._cap
        if full.any():
            i = int(np.argmax(full))
            raise ValueError(f"fastattn.KVCache.append: slot {int(s[i])} holds {int(self._len[s[i]])} "
                             f"tokens; {int(add[i])} more would pass its capacity {self._cap}")
        kf, vf = ka.astype(F32, copy=False), va.astype(F32, copy=False)
        if self._name in _QUANT:
            for name, a in (("k", kf), ("v", vf)):
                rows = np.arange(n) < add[:, None]
                if not np.isfinite(a[rows.nonzero()[0], :, rows.nonzero()[1]]).all():
                    raise ValueError(f"fastattn.KVCache.append: {name} holds values that are not "
                                     f"finite (inf or NaN), which an {self._name} cache cannot hold")
        for i, slot in enumerate(s.tolist()):
            m = int(add[i])
            if m:
                self._write(slot, kf[i, :, :m], vf[i, :, :m], ka[i, :, :m], va[i, :, :m])
                self._len[slot] += m

    def _write(self, b, kf, vf, kraw, vraw):
        """Tokens L .. L+m-1 of slot b (kf, vf: float32 (H, m, D)/(H, m, Dv))."""
        L, m, bs, H, D = int(self._len[b]), kf.shape[1], self._bs, self._H, self._D
        if self._name in _FLOAT:
            pos = np.arange(L, L + m)
            kv = self._k[b].reshape(H, self._nblk, D, bs)
            kv[:, pos // bs, :, pos % bs] = kraw.astype(self._store).transpose(1, 0, 2)
            self._v[b, :, L:L + m] = vraw.astype(self._store)
            return
        # values: per token, in groups
        g = self._vg
        grp = vf.reshape(H, m, self._Dv // g, g)
        if self._name == "int8":
            scale = (np.max(np.abs(grp), axis=-1) / np.float32(127)).astype(F32)
            safe = np.where(scale == 0, np.float32(1), scale)
            codes = np.clip(np.rint(grp / safe[..., None]), -127, 127).astype(I8)
            self._v[b, :, L:L + m] = codes.reshape(H, m, self._Dv)
        else:
            idx = np.argmax(np.abs(grp), axis=-1)[..., None]
            ext = np.take_along_axis(grp, idx, axis=-1)[..., 0]
            scale = (ext / np.float32(-8)).astype(F32)
            safe = np.where(scale == 0, np.float32(1), scale)
            codes = np.clip(np.rint(grp / safe[..., None]), -8, 7).astype(np.int16) + 8
            codes = codes.reshape(H, m, self._Dv)
            if self._Dv % 2:
                codes = np.concatenate([codes, np.full((H, m, 1), 8, np.int16)], axis=-1)
            self._v[b, :, L:L + m] = _pack4_values(codes, self._vg)
        self._vs[b, :, L:L + m] = scale
        # keys: per channel within each block the new tokens touch, over its tokens so far
        first = L // bs
        keys = kf if L % bs == 0 else np.concatenate([self._kf[b, :, :L % bs], kf], axis=1)
        start = first * bs
        for blk in range(first, (L + m - 1) // bs + 1):
            part = keys[:, blk * bs - start:(blk + 1) * bs - start]  # (H, t, D), t <= bs
            self._quantize_block(b, blk, part)
            if part.shape[1] < bs:
                self._kf[b, :, :part.shape[1]] = part

    def _quantize_block(self, b, blk, part):
        H, t, D = part.shape
        bs = self._bs
        lo = part.min(axis=1).astype(np.float64)
        hi = part.max(axis=1).astype(np.float64)
        top = 255 if self._name == "int8" else 15
        s = ((hi - lo) / top).astype(F32)
        base = np.float64(128) if self._name == "int8" else np.float64(0)
        z = (lo + base * s.astype(np.float64)).astype(F32)  # code c stands for c * s + z
        s64, z64 = s.astype(np.float64)[:, None, :], z.astype(np.float64)[:, None, :]
        lo_c = -128 if self._name == "int8" else 0
        # (s == 0, a constant channel: z is its value and every code 0)
        codes = np.where(s64 == 0, 0, np.clip(np.rint((part - z64) / np.where(s64 == 0, 1.0, s64)),
                                              lo_c, lo_c + top))
        lanes = np.zeros((H, D, bs), np.int16)
        lanes[:, :, :t] = codes.transpose(0, 2, 1)
        if self._name == "int8":
            self._k[b, :, blk] = lanes.astype(I8).reshape(H, D * bs)
        else:
            self._k[b, :, blk] = _pack4_pairs(lanes).reshape(H, (D + 1) // 2 * bs)
        self._ks[b, :, blk] = s
        self._kz[b, :, blk] = z

    def reset(self, slots: Union[int, Sequence[int], None] = None) -> None:
        """Empty the given slots (default: all): their lengths become 0.

        Raises
        ------
        TypeError, ValueError
            If slots are not distinct ints in [0, batch).
        """
        s = self._slots(slots, "reset")
        self._len[s] = 0

    # ---- reading ----
    def _slot(self, slot, fn) -> int:
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)):
            raise TypeError(f"fastattn.KVCache.{fn}: slot must be an int, got {type(slot).__name__}")
        if not 0 <= slot < self._B:
            raise ValueError(f"fastattn.KVCache.{fn}: slot must be in [0, {self._B}), got {slot}")
        return int(slot)

    def keys(self, slot: int) -> np.ndarray:
        """The keys slot `slot` holds, as the kernels attend over them: a float32
        (kv_heads, length, head_dim) copy (int8 and int4 dequantized,
        ``fmaf(code, scale, zero)``)."""
        b = self._slot(slot, "keys")
        L, H, D, bs = int(self._len[b]), self._H, self._D, self._bs
        nb = -(-L // bs)
        if self._name in _FLOAT:
            blocks = self._k[b, :, :nb].reshape(H, nb, D, bs).astype(F32)
        else:
            if self._name == "int8":
                codes = self._k[b, :, :nb].reshape(H, nb, D, bs).astype(F32)
            else:
                codes = _unpack4_pairs(self._k[b, :, :nb].reshape(H, nb, -1, bs), D).astype(F32)
            blocks = _fma(codes, self._ks[b, :, :nb, :, None], self._kz[b, :, :nb, :, None])
        return np.ascontiguousarray(blocks.transpose(0, 1, 3, 2).reshape(H, nb * bs, D)[:, :L])

    def values(self, slot: int) -> np.ndarray:
        """The values slot `slot` holds, as the kernels attend over them: a float32
        (kv_heads, length, v_head_dim) copy (int8 and int4: ``code * scale``)."""
        b = self._slot(slot, "values")
        L, H, Dv = int(self._len[b]), self._H, self._Dv
        if self._name in _FLOAT:
            return self._v[b, :, :L].astype(F32)
        raw = self._v[b, :, :L]
        codes = raw.astype(F32) if self._name == "int8" else (
            _unpack4_values(raw, Dv, self._vg).astype(np.int16) - 8).astype(F32)
        g = self._vg
        out = codes.reshape(H, L, Dv // g, g) * self._vs[b, :, :L, :, None]
        return out.reshape(H, L, Dv)

    def _decode(self, q, causal, nth):
        """fastattn.attention(q, self, causal=causal) for the common call (no variant,
        q an ndarray of float32, or of the cache's 16-bit type): the kernel's
        parameters built here, without the general path's checks, which run instead
        (and raise) for anything else: returns None then."""
        if type(q) is not np.ndarray or q.ndim != 4:
            return None
        B, Hq, Lq, D = q.shape
        st = q.dtype
        if (B != self._B or D != self._D or Hq % self._H or Lq * (Hq // self._H) > _DECODE_ROWS
                or Lq < 1 or not (st == F32 or st == self._store)
                or not q.flags.aligned or q.strides[3] != st.itemsize or self._len.min() < Lq):
            return None
        nb = -(-int(self._len.max()) // self._bs)
        va = _kernels.Variants()
        for name, val in self._source_fields(nb).items():
            setattr(va, name, val)
        va.seqlens_k = self._len
        out = np.empty((B, Hq, Lq, self._Dv), st)
        if not _kernels.forward(q, self._k[:, :, :nb], self._v, out, None, 1.0 / np.sqrt(D), int(causal),
                                nth, 0, 0, va):
            return None
        return out

    def _rows(self, L):
        """Every slot's first L keys and values as (B, kv_heads, L, D) arrays (float32
        for int8 and int4, else the stored type): the values the kernel reads, for a
        prefill call, which then reads them as user-held arrays do (its key tiles
        staged once a call here, not once a query block)."""
        B, H, D, bs = self._B, self._H, self._D, self._bs
        nb = -(-L // bs)
        if self._name in _FLOAT:
            k = self._k[:, :, :nb].reshape(B, H, nb, D, bs).transpose(0, 1, 2, 4, 3).reshape(B, H, nb * bs, D)
            k = np.ascontiguousarray(k[:, :, :L])
            return k, self._v[:, :, :L]
        k = np.empty((B * H, nb * bs, D), F32)
        kk = np.ascontiguousarray(self._k[:, :, :nb]).reshape(B * H, nb, -1)
        ks = np.ascontiguousarray(self._ks[:, :, :nb]).reshape(B * H, nb, D)
        kz = np.ascontiguousarray(self._kz[:, :, :nb]).reshape(B * H, nb, D)
        _kernels.lanes_to_rows(kk, ks, kz, k, D, bs, 8 if self._name == "int8" else 4)
        raw = self._v[:, :, :L]
        codes = raw.astype(F32) if self._name == "int8" else (
            _unpack4_values(raw, self._Dv, self._vg).astype(np.int16) - 8).astype(F32)
        g = self._vg
        v = (codes.reshape(B, H, L, self._Dv // g, g) * self._vs[:, :, :L, :, None]).reshape(B, H, L, self._Dv)
        return k.reshape(B, H, nb * bs, D)[:, :, :L], v

    def _source_fields(self, nb):
        """The Variants fields that describe the cache to the kernel (its blocks up to
        nb)."""
        fields = {"k_lanes": self._bs}
        if self._name in _QUANT:
            bits = 8 if self._name == "int8" else 4
            fields.update(k_scale=self._ks[:, :, :nb], k_zero=self._kz[:, :, :nb],
                          v_scale=self._vs, k_bits=bits, v_bits=bits, v_dim=self._Dv)
        return fields

    def _source(self, q, fn):
        """What fastattn.attention's kernel reads, a fastattn._cache.Source (the
        slots' lengths go as its seqlens_k)."""
        qa = as_array(q, "q", fn)
        if qa.ndim != 4 or qa.shape[0] != self._B or qa.shape[3] != self._D:
            raise ValueError(f"fastattn.{fn}: with a KVCache, q must have shape ({self._B}, Hq, Lq, "
                             f"{self._D}) (the cache's batch and head_dim), got {qa.shape}")
        Lq = qa.shape[2]
        short = self._len < max(Lq, 1)
        if short.any():
            b = int(np.argmax(short))
            what = "holds no tokens" if self._len[b] == 0 else f"holds {int(self._len[b])} tokens"
            raise ValueError(f"fastattn.{fn}: slot {b} {what}; q's {Lq} queries are the last "
                             f"{Lq} tokens of every slot (append them first)")
        Lk = int(self._len.max())
        nb = -(-Lk // self._bs)
        quant = self._name in _QUANT
        sd = F32 if quant else self._store
        fields = self._source_fields(nb)
        src = Source(_standin((self._B, self._H, Lk, self._D), sd),
                     _standin((self._B, self._H, Lk, self._Dv), sd),
                     self._k[:, :, :nb], self._v, fields)
        return src
