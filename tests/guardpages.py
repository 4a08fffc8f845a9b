"""Arrays placed against pages the process may not touch.

``guarded(a, place=...)`` copies `a` into its own anonymous mapping whose first and last
pages are PROT_NONE, with the array's bytes flush against one of them: ``place="end"``
puts its last byte just before the trailing guard page (a read or write one element
past the end faults), ``place="start"`` its first byte just after the leading one (one
element before the start faults).  Inputs are also made read-only at the page level
(PROT_READ), so a write into q, k, v, a mask... faults too; outputs (``writable=True``)
stay writable.  ``how`` lays the array out in memory as callers do: contiguous, rows of
the L axis strided (a slice of a fused projection), the head and sequence axes swapped
(a "bshd" buffer read as "bhsd"), the L axis reversed (a negative stride), or every
other element of the last axis (which the library copies); in each,
the view's extreme element is the buffer's, so nothing the view may address lies
between it and the guard.

A zero-size array is placed with its data pointer on the trailing guard page's first
byte ("end": reading anything through it faults) or just after the leading one
("start": reading anything before it faults).

The mapping lives as long as the array (NumPy keeps the buffer alive); a process may
hold a few thousand of them at once (each is three kernel mappings).
"""
import ctypes
import mmap

import numpy as np

PAGE = mmap.PAGESIZE
PROT_NONE = 0  # (the mmap module names PROT_READ and PROT_WRITE only)
PLACES = ("end", "start")
LAYOUTS = ("contig", "rows", "swapped", "reversed", "lastaxis")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mprotect.restype = ctypes.c_int


def _protect(addr, nbytes, prot):
    if nbytes and _libc.mprotect(addr, nbytes, prot) != 0:
        raise OSError(ctypes.get_errno(), "mprotect failed")


def _region(nbytes):
    """A mapping of [guard page][data pages holding nbytes][guard page] and the
    address of its first data byte."""
    data = max(1, -(-nbytes // PAGE)) * PAGE
    mm = mmap.mmap(-1, data + 2 * PAGE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    holder = ctypes.c_char.from_buffer(mm)
    base = ctypes.addressof(holder)
    del holder  # (an export of the mapping: it must not outlive this function)
    _protect(base, PAGE, PROT_NONE)
    _protect(base + PAGE + data, PAGE, PROT_NONE)
    return mm, base, data


def _memory_shape(shape, how):
    """The shape of the buffer behind a view of `shape` laid out as `how`, and the
    function that takes the view from it (for place 'end' and 'start')."""
    nd = len(shape)
    if how == "rows" and nd >= 2:
        L, D = shape[-2], shape[-1]
        mem = shape[:-2] + (2 * L, D + 3)
        return mem, {"end": lambda m: m[..., 1::2, 3:], "start": lambda m: m[..., ::2, :D]}
    if how == "swapped" and nd >= 3:
        mem = shape[:-3] + (shape[-2], shape[-3], shape[-1])
        view = lambda m: m.swapaxes(-2, -3)  # noqa: E731
        return mem, {"end": view, "start": view}
    if how == "lastaxis" and nd >= 1:  # every other element of the last axis
        mem = shape[:-1] + (2 * shape[-1],)
        return mem, {"end": lambda m: m[..., 1::2], "start": lambda m: m[..., ::2]}
    if how == "reversed" and nd >= 2:
        view = lambda m: m[..., ::-1, :]  # noqa: E731
        return shape, {"end": view, "start": view}
    ident = lambda m: m  # noqa: E731
    return shape, {"end": ident, "start": ident}


def guarded(a, place="end", how="contig", writable=False):
    """A copy of `a` (same values, shape and dtype) in guarded memory, laid out as
    `how` and flush against the guard page at its `place`."""
    a = np.asarray(a)
    dt = a.dtype
    mem_shape, views = _memory_shape(a.shape, how)
    n = int(np.prod(mem_shape, dtype=np.int64))
    nbytes = n * dt.itemsize
    mm, base, data = _region(nbytes)
    if nbytes == 0:  # the data pointer on the first byte of the trailing guard page
        off = PAGE + data if place == "end" else PAGE
        buf = np.frombuffer(mm, np.uint8, count=0, offset=min(off, len(mm) - 1))
        out = buf.view(dt).reshape(a.shape)
        out.flags.writeable = writable
        return out
    off = PAGE + data - nbytes if place == "end" else PAGE
    mem = np.frombuffer(mm, dt, count=n, offset=off).reshape(mem_shape)
    if how in ("rows", "lastaxis") and a.ndim >= 1:  # the gaps hold NaN: a read of one shows
        mem[...] = np.nan if dt.kind == "f" else 0
    view = views[place](mem)
    view[...] = a
    if not writable:
        first = base + off
        page0 = first // PAGE * PAGE
        _protect(page0, base + PAGE + data - page0, mmap.PROT_READ)
        view.flags.writeable = False
    return view


def guarded_like(a, place="end", how="contig"):
    """`guarded` for whatever `a` is: arrays are copied, None and scalars pass."""
    if a is None or np.isscalar(a):
        return a
    return guarded(a, place, how)
