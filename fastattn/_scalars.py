"""The scalar arguments of fastattn's calls, each parsed as the kernel takes it (one
function per argument; fastattn._args re-exports them as part of the documented surface
the adapters use).  Every check raises the error its caller would: a TypeError or
ValueError whose message starts ``fastattn.<fn>:``."""

from __future__ import annotations

import math
import numbers

import numpy as np

__all__ = ["parse_causal", "parse_scale", "parse_softcap", "parse_window", "parse_dropout",
           "parse_threads", "parse_offsets", "parse_flag", "OFFSET_MAX"]

_CAUSAL = {"bottom-right": 1, "top-left": 2}


def _real(x):
    """Whether `x` is a real number and not a bool (numbers.Real, bools excluded)."""
    return not isinstance(x, (bool, np.bool_)) and isinstance(x, numbers.Real)


def _integral(x):
    """Whether `x` is an integer and not a bool (numbers.Integral, bools excluded)."""
    return not isinstance(x, (bool, np.bool_)) and isinstance(x, numbers.Integral)


def parse_causal(causal, fn="attention"):
    """The kernel's causal code of `causal`: 0 for False or None, 1 for True (a NumPy
    bool too) or 'bottom-right', 2 for 'top-left'.

    Raises
    ------
    ValueError
        For any other value (the message names the public function `fn`).
    """
    if causal is False or causal is None:
        return 0
    if causal is True:
        return 1
    if isinstance(causal, np.bool_):
        return 1 if causal else 0
    if isinstance(causal, str) and causal in _CAUSAL:
        return _CAUSAL[causal]
    raise ValueError(
        f"fastattn.{fn}: causal must be False, True, 'bottom-right' or 'top-left', got {causal!r}")


def parse_scale(scale, D, fn="attention"):
    """The logits' scale as a float: `scale`, or ``1 / sqrt(D)`` for None (1 for
    D = 0), D being the feature size of q and k.

    Raises
    ------
    TypeError
        If `scale` is not a real number (bools are not); `fn` names the function.
    ValueError
        If it is not finite.
    """
    if scale is None:
        return 1.0 / math.sqrt(D) if D > 0 else 1.0
    if type(scale) is float and math.isfinite(scale):
        return scale
    if not _real(scale):
        raise TypeError(f"fastattn.{fn}: scale must be a real number, got {type(scale).__name__}")
    s = float(scale)
    if not math.isfinite(s):
        raise ValueError(f"fastattn.{fn}: scale must be finite, got {scale!r}")
    return s


def parse_softcap(softcap, fn):
    """The soft-capping constant as a float, 0.0 (off) for None.

    Raises
    ------
    TypeError
        If it is not a real number (bools are not); `fn` names the function.
    ValueError
        If it is not finite and > 0.
    """
    if softcap is None:
        return 0.0
    if not _real(softcap):
        raise TypeError(f"fastattn.{fn}: softcap must be a real number or None, "
                        f"got {type(softcap).__name__}")
    c = float(softcap)
    if not (math.isfinite(c) and c > 0):
        raise ValueError(f"fastattn.{fn}: softcap must be finite and > 0, got {softcap!r}")
    return c


def parse_window(window, fn):
    """The window as ``(left, right)`` ints, -1 for an unbounded side: None, or None
    or -1 on a side, means unbounded (FlashAttention's convention); sizes are clamped
    to 2**62.

    Raises
    ------
    ValueError
        If `window` is not a pair, or a side is negative other than -1.
    TypeError
        If a side is neither an int nor None (bools are not ints here).
    """
    if window is None:
        return -1, -1
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"fastattn.{fn}: window must be a (left, right) pair, got {window!r}") from None
    sides = []
    for name, w in (("left", left), ("right", right)):
        if w is None:
            sides.append(-1)
            continue
        if not _integral(w):
            raise TypeError(f"fastattn.{fn}: window {name} size must be an int or None, got {w!r}")
        if w == -1:
            sides.append(-1)
            continue
        if w < 0:
            raise ValueError(f"fastattn.{fn}: window {name} size must be >= 0, or -1 or None "
                             f"for unbounded; got window={window!r}")
        sides.append(min(int(w), 2**62))
    return sides[0], sides[1]


def parse_dropout(dropout_p, seed, fn):
    """Dropout's ``(p, seed)``: a float ``0 <= p < 1`` and the seed as an int in
    [0, 2**64), needed when p > 0 (0 when p = 0 and no seed is given).

    Raises
    ------
    TypeError
        If `dropout_p` is not a real number or `seed` not an int (bools are neither).
    ValueError
        If `dropout_p` is outside [0, 1), `seed` outside [0, 2**64), or missing with
        ``dropout_p > 0``.
    """
    if not _real(dropout_p):
        raise TypeError(f"fastattn.{fn}: dropout_p must be a real number in [0, 1), got "
                        f"{type(dropout_p).__name__}")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"fastattn.{fn}: dropout_p must be in [0, 1), got {dropout_p!r}")
    if seed is None:
        if p > 0:
            raise ValueError(f"fastattn.{fn}: dropout_p={dropout_p!r} > 0 needs a seed (an int "
                             "in [0, 2**64)): the same seed gives the same dropped weights in "
                             "the forward and the backward")
        return p, 0
    if not _integral(seed):
        raise TypeError(f"fastattn.{fn}: seed must be an int, got {type(seed).__name__}")
    if not 0 <= int(seed) < 2**64:
        raise ValueError(f"fastattn.{fn}: seed must be in [0, 2**64), got {seed!r}")
    return p, int(seed)


def parse_threads(num_threads, fn="attention"):
    """The thread count for the kernel: 0 (OpenMP's default) for None, else the int
    (>= 1) clamped to 2**16.

    Raises
    ------
    TypeError
        If it is neither an int nor None (bools are not ints here).
    ValueError
        If it is < 1.
    """
    if num_threads is None:
        return 0
    if not _integral(num_threads):
        raise TypeError(
            f"fastattn.{fn}: num_threads must be an int or None, got {type(num_threads).__name__}")
    n = int(num_threads)
    if n < 1:
        raise ValueError(f"fastattn.{fn}: num_threads must be >= 1, got {n}")
    return min(n, 1 << 16)


OFFSET_MAX = 1 << 53  # |q_offset|, |k_offset| bound: position arithmetic stays exact


def parse_offsets(q_offset, k_offset, causal, fn="attention"):
    """The positions of the first query and key, ``(q_offset, k_offset)`` as ints (a
    missing one is 0), or None when both are None (the lengths align the rows);
    `causal` is :func:`parse_causal`'s code.

    Raises
    ------
    TypeError
        For anything but an int (a NumPy integer too; not a bool) or None.
    ValueError
        Beyond ``+-2**53``, or with ``causal='top-left'`` (which aligns by the lengths).
    """
    if q_offset is None and k_offset is None:
        return None
    offs = []
    for name, x in (("q_offset", q_offset), ("k_offset", k_offset)):
        x = 0 if x is None else x
        if not _integral(x):
            raise TypeError(f"fastattn.{fn}: {name} must be an int or None, got "
                            f"{type(x).__name__}")
        if abs(int(x)) > OFFSET_MAX:
            raise ValueError(f"fastattn.{fn}: {name} must be in [-2**53, 2**53], got {int(x)}")
        offs.append(int(x))
    if causal == 2:
        raise ValueError(f"fastattn.{fn}: causal='top-left' aligns the rows by the lengths; "
                         f"with q_offset/k_offset the positions decide the diagonal, so pass "
                         f"causal=True (got q_offset={q_offset!r}, k_offset={k_offset!r})")
    return offs[0], offs[1]


def parse_flag(value, name, fn):
    """The bool argument `name` (``return_lse``...) of `fn` as a Python bool.

    Raises
    ------
    TypeError
        For anything but a bool or a NumPy bool (0 and 1 included).
    """
    if value is not False and value is not True and not isinstance(value, np.bool_):
        raise TypeError(f"fastattn.{fn}: {name} must be a bool, got {type(value).__name__}")
    return bool(value)
