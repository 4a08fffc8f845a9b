"""The geometry of attention: simplex coordinates, barycentres and row entropy.

Row i of the attention weights, ``p_i = softmax(s_i)``, is a point of the
probability simplex (``p_ij >= 0``, ``sum_j p_ij = 1``): soft coordinates over
the keys the query sees.  The output ``o_i = sum_j p_ij v_j`` is the barycentre
of the values with those coordinates, so it lies in their convex hull.  This
module turns weights into the pictures of that view:

- :func:`simplex_coordinates`: one row's largest coordinates and "the rest";
- :func:`barycentre_projection`: the values and the output in 2-D (PCA), where
  the output is still the same barycentre of the projected values;
- :func:`row_entropy` and :func:`entropy_profile`: how spread each row is, per
  head along the sequence, with the effective support ``exp(H)``;
- ``plot_*`` functions that draw them (matplotlib, ``pip install fastattn[plot]``),
  and ``python -m fastattn.geometry --demo [--out DIR]``, which writes the figures
  of docs/geometry.md for a small built-in example.

The computing functions need only NumPy and return plain arrays, so they can be
tested (and used) without drawing anything; matplotlib is imported only when a
``plot_*`` function or the demo runs.  The arrays may be of any real dtype NumPy
converts to float64; :func:`entropy_profile` takes the dtypes of
:func:`fastattn.attention` (float32, float64, float16 keys, bfloat16 via
``ml_dtypes``).  docs/geometry.md explains the pictures.
"""
from __future__ import annotations

import inspect
import sys
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import numpy.typing as npt

import fastattn

from ._typing import ArrayLike, Causal, Layout, Window

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

__all__ = ["simplex_coordinates", "barycentre_projection", "row_entropy", "entropy_profile",
           "EntropyProfile", "plot_simplex_coordinates", "plot_barycentre", "plot_entropy_profile",
           "demo_example", "DemoExample", "write_demo_figures", "main"]

# A row whose sum is further than this from 1 is not a softmax row (float32 rows
# from the kernel sum to 1 within ~1e-6; dropout rows or logits are far off).
_SUM_TOL = 1e-3

_PLOT_HINT = "pip install fastattn[plot]"


# --------------------------------------------------------------------------- checks

def _row(weights_row: ArrayLike, fn: str, name: str = "weights_row") -> F64:
    """One row of attention weights as float64, divided by its sum (which removes
    the rounding of a float32 row's sum, so the coordinates sum to 1 in float64)."""
    try:
        a = np.asarray(weights_row, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"fastattn.geometry.{fn}: {name} must be a 1-D array of weights, "
                         f"got {type(weights_row).__name__}") from None
    if a.ndim != 1:
        raise ValueError(f"fastattn.geometry.{fn}: {name} must be one row of weights (1-D, "
                         f"one weight per key), got shape {a.shape}")
    if a.size == 0:
        raise ValueError(f"fastattn.geometry.{fn}: {name} is empty (a row over no keys)")
    if not np.isfinite(a).all():
        raise ValueError(f"fastattn.geometry.{fn}: {name} has NaN or inf entries")
    if (a < 0).any():
        raise ValueError(f"fastattn.geometry.{fn}: {name} has negative entries "
                         f"(min {a.min():.3g}); attention weights are >= 0")
    total = float(a.sum())
    if abs(total - 1.0) > _SUM_TOL:
        raise ValueError(f"fastattn.geometry.{fn}: {name} must lie on the probability simplex "
                         f"(sum to 1) but sums to {total:.6g}; a row that sees no key sums to 0, "
                         f"and rows of attention_weights(..., dropout_p > 0) do not sum to 1")
    return a / total


def _values(v: ArrayLike, n: int, fn: str) -> F64:
    try:
        a = np.asarray(v, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"fastattn.geometry.{fn}: v must be a 2-D array of values (n, Dv), "
                         f"got {type(v).__name__}") from None
    if a.ndim != 2:
        raise ValueError(f"fastattn.geometry.{fn}: v must be 2-D (one value row per key, "
                         f"shape (n, Dv)), got shape {a.shape}")
    if a.shape[0] != n:
        raise ValueError(f"fastattn.geometry.{fn}: v has {a.shape[0]} rows but weights_row has "
                         f"{n} weights (v shape {a.shape}, weights_row shape ({n},)); pass the "
                         f"values of the keys the row is over")
    if a.shape[1] == 0:
        raise ValueError(f"fastattn.geometry.{fn}: v has shape {a.shape}: values need at least "
                         f"one feature")
    if not np.isfinite(a).all():
        raise ValueError(f"fastattn.geometry.{fn}: v has NaN or inf entries")
    return a


def _top_k(top_k: Any, fn: str) -> int:
    if isinstance(top_k, (bool, np.bool_)) or not isinstance(top_k, (int, np.integer)) \
            or top_k < 1:
        raise ValueError(f"fastattn.geometry.{fn}: top_k must be an integer >= 1, got {top_k!r}")
    return int(top_k)


def _labels(key_labels: Optional[Sequence[str]], n: int, fn: str) -> List[str]:
    if key_labels is None:
        return [f"key {j}" for j in range(n)]
    labels = [str(s) for s in key_labels]
    if len(labels) != n:
        raise ValueError(f"fastattn.geometry.{fn}: key_labels has {len(labels)} labels for a "
                         f"row of {n} weights")
    return labels


# ------------------------------------------------------------- the numbers (no drawing)

def simplex_coordinates(weights_row: ArrayLike, top_k: int = 5) -> Tuple[I64, F64, float]:
    """A row's coordinates on the simplex: its ``top_k`` largest weights and the rest.

    Parameters
    ----------
    weights_row : array_like, shape (n,)
        One row of attention weights (``>= 0``, summing to 1), e.g.
        ``fastattn.attention_weights(q, k)[h, i]``; for a causal row ``i`` the
        keys it cannot see are 0 and may be left in or cut off.
    top_k : int, default 5
        How many coordinates to report separately; larger than ``n`` is allowed
        (all ``n`` are returned and the rest is 0).

    Returns
    -------
    indices : ndarray of int64, shape (min(top_k, n),)
        The keys with the largest weights, largest first (ties: lower index first).
    values : ndarray of float64, shape (min(top_k, n),)
        Their weights, non-increasing.  The row is divided by its sum in float64
        first, so ``values.sum() + rest == 1`` to float64 rounding.
    rest : float
        The total weight of all other keys (0 when ``top_k >= n``).

    Raises
    ------
    ValueError
        If `weights_row` is not one row of finite weights ``>= 0`` summing to 1
        (within 1e-3), or `top_k` is not an integer ``>= 1``.

    See Also
    --------
    plot_simplex_coordinates : Draw them.
    row_entropy : How spread the row is.

    Notes
    -----
    A row at a vertex of the simplex has ``values[0] == 1``; at the centre all
    ``n`` weights are ``1/n``.

    Examples
    --------
    >>> import numpy as np
    >>> from fastattn.geometry import simplex_coordinates
    >>> simplex_coordinates(np.array([0.5, 0.25, 0.125, 0.125]), top_k=2)
    (array([0, 1]), array([0.5 , 0.25]), 0.25)
    """
    fn = "simplex_coordinates"
    k = _top_k(top_k, fn)
    w = _row(weights_row, fn)
    order = np.argsort(-w, kind="stable")
    top = order[:k]
    rest = float(np.sum(w[order[k:]])) if k < w.size else 0.0
    return top.astype(np.int64), w[top], rest


def _pca2(v: F64) -> Tuple[F64, F64, F64]:
    """The mean of the value rows, the two principal directions (2, Dv) and the
    fraction of the variance along each.  Directions are made deterministic (the
    largest loading positive); missing ones (n == 1 or Dv == 1) are zero rows."""
    mean = v.mean(axis=0)
    x = v - mean
    comps = np.zeros((2, v.shape[1]))
    ratio = np.zeros(2)
    _, sing, vt = np.linalg.svd(x, full_matrices=False)
    total = float(np.sum(sing ** 2))
    m = min(2, vt.shape[0])
    if total > 0:
        comps[:m] = vt[:m]
        ratio[:m] = sing[:m] ** 2 / total
    for c in comps:
        j = int(np.argmax(np.abs(c)))
        if c[j] < 0:
            c *= -1
    return mean, comps, ratio


def barycentre_projection(weights_row: ArrayLike, v: ArrayLike) -> Tuple[F64, F64]:
    """The values and the attention output of one row, projected to 2-D by PCA.

    The output ``o = sum_j w_j v_j`` is a barycentre (weighted mean) of the
    values.  The projection ``P(x) = C (x - mean)``, with ``C`` the two principal
    directions of the value rows (an SVD of the centred values, no sklearn), is
    affine, and an affine map commutes with barycentres because the weights sum
    to 1: ``P(o) = sum_j w_j P(v_j)``.  So the picture is faithful: the projected
    output is the same weighted mean of the projected values, and it lies in
    their convex hull.

    Parameters
    ----------
    weights_row : array_like, shape (n,)
        One row of attention weights (``>= 0``, summing to 1).
    v : array_like, shape (n, Dv)
        The values of the same ``n`` keys (for a causal row ``i``, ``v[:i + 1]``
        with ``weights_row[:i + 1]``).

    Returns
    -------
    points_2d : ndarray of float64, shape (n, 2)
        ``P(v_j)``: the values in the plane of their two largest principal
        directions (a second coordinate of 0 when ``n == 1`` or ``Dv == 1``).
    output_2d : ndarray of float64, shape (2,)
        ``P(w @ v)``: the output projected with the same map; equal to
        ``w @ points_2d`` up to rounding.

    Raises
    ------
    ValueError
        If `weights_row` is not a row of weights on the simplex, or `v` is not a
        finite (n, Dv) array with ``Dv >= 1``.

    See Also
    --------
    plot_barycentre : Draw the picture.

    Examples
    --------
    >>> import numpy as np
    >>> from fastattn.geometry import barycentre_projection
    >>> w = np.array([0.5, 0.25, 0.125, 0.125])
    >>> v = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    >>> points, output = barycentre_projection(w, v)
    >>> points.shape, bool(np.allclose(output, w @ points))
    ((4, 2), True)
    """
    fn = "barycentre_projection"
    w = _row(weights_row, fn)
    vals = _values(v, w.size, fn)
    mean, comps, _ = _pca2(vals)
    points = (vals - mean) @ comps.T
    output = w @ vals
    return points, (output - mean) @ comps.T


def _entropy_and_max(weights: F64) -> Tuple[F64, F64]:
    total = weights.sum(axis=-1, keepdims=True)
    p = np.divide(weights, total, out=np.zeros_like(weights), where=total > 0)
    safe = np.where(p > 0, p, 1.0)
    # 0 log 0 = 0; p <= 1 after the division, so every term is <= 0 and H >= 0
    h = -np.sum(p * np.log(safe), axis=-1)
    return np.maximum(h, 0.0), (p.max(axis=-1) if p.shape[-1] else np.zeros(p.shape[:-1]))


def row_entropy(weights: ArrayLike) -> F64:
    """The entropy ``H = -sum_j p_j log p_j`` (nats) of each row of ``weights``.

    Parameters
    ----------
    weights : array_like, shape (..., n)
        Rows of attention weights, e.g. ``fastattn.attention_weights(q, k)``
        (shape (..., Hq, Lq, Lk)).  Each row is divided by its sum in float64
        first; ``0 log 0 = 0``; a row of zeros (a query that sees no key) gives 0.

    Returns
    -------
    ndarray of float64, shape (...,)
        ``0 <= H <= log(n_nonzero)``: 0 at a vertex of the simplex (one key takes
        all the weight), ``log n`` at its centre (``n`` equal weights).
        ``exp(H)``, the effective support, counts the keys the row really uses.

    Raises
    ------
    ValueError
        If `weights` is a scalar or has NaN, inf or negative entries.

    See Also
    --------
    entropy_profile : The same per head along the sequence, in O(L) memory.

    Examples
    --------
    >>> import numpy as np
    >>> from fastattn.geometry import row_entropy
    >>> row_entropy(np.array([[1.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3]]))  # vertex, centre
    array([0.        , 1.09861229])
    """
    a = np.asarray(weights, dtype=np.float64)
    if a.ndim == 0:
        raise ValueError("fastattn.geometry.row_entropy: weights must have at least one axis "
                         "(the keys), got a scalar")
    if not np.isfinite(a).all():
        raise ValueError("fastattn.geometry.row_entropy: weights has NaN or inf entries")
    if (a < 0).any():
        raise ValueError("fastattn.geometry.row_entropy: weights has negative entries; "
                         "attention weights are >= 0")
    return _entropy_and_max(a)[0]


class EntropyProfile(NamedTuple):
    """Per-row statistics of attention, as :func:`entropy_profile` returns them.

    Each array has shape (..., Hq, Lq): q's leading axes, the query heads and the
    query positions, in that order for either layout.

    Parameters
    ----------
    entropy : ndarray of float64
        ``H = -sum_j p_ij log p_ij`` in nats (0 for a row that sees no key).
    effective_support : ndarray of float64
        ``exp(H)``, between 1 and `n_visible` (0 for a row that sees no key).
    max_weight : ndarray of float64
        The row's largest weight, between ``1/n_visible`` and 1 (0 for a row that
        sees no key).
    n_visible : ndarray of int64
        How many keys the row sees (after causal, window, mask and -inf biases).
    source : {"weights", "stats"}
        "weights" (computed from :func:`fastattn.attention_weights`) or "stats"
        (from the kernel's streaming statistics,
        ``fastattn.attention(..., return_stats=True)``).
    """

    entropy: F64
    effective_support: F64
    max_weight: F64
    n_visible: I64
    source: str


def _has_stats() -> bool:
    """Whether this fastattn's attention() returns streaming row statistics."""
    try:
        return "return_stats" in inspect.signature(fastattn.attention).parameters
    except (TypeError, ValueError):
        return False


def _n_visible(q: ArrayLike, k: ArrayLike, causal: Causal, window: Window,
               mask: Optional[ArrayLike], bias: Optional[ArrayLike], layout: Layout,
               num_threads: Optional[int]) -> I64:
    """Keys each query row sees, in O(L) memory: attention with every logit 0 on
    the keys the masking leaves visible has lse = log(n_visible) exactly."""
    qa, ka = np.asarray(q), np.asarray(k)
    q0 = np.zeros(qa.shape[:-1] + (1,))
    k0 = np.zeros(ka.shape[:-1] + (1,))
    hidden = None
    if bias is not None:  # only what the bias hides matters: -inf stays, the rest becomes 0
        hidden = np.where(np.isneginf(np.asarray(bias, dtype=np.float64)), -np.inf, 0.0)
    _, lse = fastattn.attention(q0, k0, k0, scale=1.0, causal=causal, window=window, mask=mask,
                                bias=hidden, layout=layout, return_lse=True,
                                num_threads=num_threads)
    lse = np.asarray(lse, dtype=np.float64)
    count = np.rint(np.exp(np.where(np.isneginf(lse), 0.0, lse)))
    return np.where(np.isneginf(lse), 0, count).astype(np.int64)


def entropy_profile(q: ArrayLike, k: ArrayLike, *, scale: Optional[float] = None,
                    causal: Causal = False, window: Window = None,
                    mask: Optional[ArrayLike] = None, bias: Optional[ArrayLike] = None,
                    alibi_slopes: Optional[ArrayLike] = None, softcap: Optional[float] = None,
                    layout: Layout = "bhsd", num_threads: Optional[int] = None,
                    source: str = "auto") -> EntropyProfile:
    """Row entropy along the sequence, per head: how spread each query's reading is.

    The arguments are those of :func:`fastattn.attention` (no values: a row's
    weights do not depend on them; no dropout: dropped rows leave the simplex).

    Parameters
    ----------
    q : array_like, shape (..., Hq, Lq, D)
        Queries as for :func:`fastattn.attention` (or ``bshd``): float32, float64,
        float16 with float16 keys, or bfloat16.
    k : array_like, shape (..., Hkv, Lk, D)
        Keys; GQA is allowed (Hkv divides Hq).
    scale : float, optional
        As for :func:`fastattn.attention`.
    causal : {False, True, 'bottom-right', 'top-left'}, default False
        As for :func:`fastattn.attention`.
    window : tuple of (int or None, int or None), optional
        As for :func:`fastattn.attention`.
    mask : array_like of bool, optional
        As for :func:`fastattn.attention`.
    bias : array_like, optional
        As for :func:`fastattn.attention`.
    alibi_slopes : array_like, optional
        As for :func:`fastattn.attention`.
    softcap : float, optional
        As for :func:`fastattn.attention`.
    layout : {"bhsd", "bshd"}, default "bhsd"
        As for :func:`fastattn.attention`.
    num_threads : int, optional
        As for :func:`fastattn.attention`.
    source : {"auto", "weights", "stats"}, default "auto"
        ``"weights"``: from :func:`fastattn.attention_weights` (exact, float64
        sums, but Lq x Lk memory).  ``"stats"``: from the kernel's streaming
        statistics, ``fastattn.attention(..., return_stats=True)`` (O(L) memory;
        a ValueError if this fastattn does not have them).  ``"auto"`` (default):
        the statistics when available, else the weights.

    Returns
    -------
    EntropyProfile
        ``entropy`` H (nats), ``effective_support`` exp(H), ``max_weight`` and
        ``n_visible`` (int), each of shape (..., Hq, Lq), and ``source``.  For
        every row that sees a key, ``0 <= H <= log(n_visible)``,
        ``1 <= exp(H) <= n_visible`` and ``1/n_visible <= max_weight <= 1`` (values
        that rounding puts a few ulps outside are clipped to the bounds); rows
        that see no key give 0 everywhere.

    Raises
    ------
    ValueError
        If `source` is not one of the three, or as :func:`fastattn.attention` raises.

    See Also
    --------
    plot_entropy_profile : Draw it.
    row_entropy : The entropy of given weights.

    Examples
    --------
    >>> import numpy as np
    >>> from fastattn.geometry import entropy_profile
    >>> rng = np.random.default_rng(0)
    >>> q, k = rng.standard_normal((2, 2, 6, 8))
    >>> p = entropy_profile(q, k, causal=True)
    >>> p.entropy.shape, p.n_visible[0].tolist()
    ((2, 6), [1, 2, 3, 4, 5, 6])
    >>> float(p.entropy[0, 0])  # the first query sees only the first key
    0.0
    """
    fn = "entropy_profile"
    if source not in ("auto", "weights", "stats"):
        raise ValueError(f"fastattn.geometry.{fn}: source must be 'auto', 'weights' or 'stats', "
                         f"got {source!r}")
    has_stats = _has_stats()
    if source == "stats" and not has_stats:
        raise ValueError(f"fastattn.geometry.{fn}: source='stats' needs "
                         f"fastattn.attention(..., return_stats=True), which this fastattn "
                         f"does not have; use source='weights' (or 'auto')")
    use = "stats" if source == "stats" or (source == "auto" and has_stats) else "weights"
    kw: Dict[str, Any] = dict(scale=scale, causal=causal, window=window, mask=mask, bias=bias,
                              alibi_slopes=alibi_slopes, softcap=softcap, layout=layout,
                              num_threads=num_threads)
    if use == "weights":
        w = fastattn.attention_weights(q, k, **kw)
        h, max_w = _entropy_and_max(np.asarray(w, dtype=np.float64))
    else:
        ka = np.asarray(k)
        v_unused = np.zeros(ka.shape[:-1] + (1,), ka.dtype)  # the statistics ignore V
        attention: Any = fastattn.attention
        res = attention(q, k, v_unused, return_stats=True, **kw)
        stats = res[-1]
        h = np.asarray(stats.entropy, dtype=np.float64)
        max_w = np.asarray(stats.max_weight, dtype=np.float64)
    n_vis = _n_visible(q, k, causal, window, mask, bias, layout, num_threads)
    seen = n_vis > 0
    n_safe = np.maximum(n_vis, 1)
    # rounding (a float32 row, or lse - t/l in the kernel) can cross the exact bounds
    # by a few ulps; the true values cannot
    h = np.where(seen, np.clip(h, 0.0, np.log(n_safe)), 0.0)
    max_w = np.where(seen, np.clip(max_w, 1.0 / n_safe, 1.0), 0.0)
    return EntropyProfile(entropy=h, effective_support=np.where(seen, np.exp(h), 0.0),
                          max_weight=max_w, n_visible=n_vis, source=use)


# The drawing and the demo (fastattn/_geometry_draw.py), imported last: that module takes
# the names above from this one.
from ._geometry_draw import (DemoExample, demo_example, main, plot_barycentre,  # noqa: E402
                             plot_entropy_profile, plot_simplex_coordinates, write_demo_figures)

for _obj in (DemoExample, demo_example, main, plot_barycentre, plot_entropy_profile,
             plot_simplex_coordinates, write_demo_figures):
    _obj.__module__ = "fastattn.geometry"  # documented and pickled as this module's
del _obj

if __name__ == "__main__":
    sys.exit(main())
