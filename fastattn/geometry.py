"""The geometry of attention, drawn from real numbers (see docs/geometry.md).

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
``plot_*`` function or the demo runs.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import math
import os
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

    A row at a vertex of the simplex has ``values[0] == 1``; at the centre all
    ``n`` weights are ``1/n``.
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
    """Per-row statistics of attention, shape (..., Hq, Lq) each (q's leading axes,
    the query heads, the query positions, in that order for either layout)."""

    entropy: F64
    """H = -sum_j p_ij log p_ij in nats (0 for a row that sees no key)."""
    effective_support: F64
    """exp(H), between 1 and n_visible (0 for a row that sees no key)."""
    max_weight: F64
    """The row's largest weight, between 1/n_visible and 1 (0 for a row that sees no key)."""
    n_visible: I64
    """How many keys the row sees (after causal, window, mask and -inf biases)."""
    source: str
    """"weights" (computed from attention_weights) or "stats" (from the kernel's
    streaming statistics, attention(..., return_stats=True))."""


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
    q, k : array_like
        ``(..., Hq, Lq, D)`` and ``(..., Hkv, Lk, D)`` (or ``bshd``), as for
        :func:`fastattn.attention`; GQA is allowed.
    scale, causal, window, mask, bias, alibi_slopes, softcap, layout, num_threads
        As for :func:`fastattn.attention`.
    source : {"auto", "weights", "stats"}
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


# ------------------------------------------------------------------------ drawing

def _import(name: str) -> Any:
    """A matplotlib module, imported on first use (matplotlib is the optional extra
    `plot`, not a dependency of fastattn)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise ImportError(f"fastattn.geometry: drawing needs matplotlib, which is not installed: "
                          f"{_PLOT_HINT} (or pip install matplotlib)") from None


def _axes(ax: Any, figsize: Tuple[float, float]) -> Any:
    if ax is not None:
        return ax
    plt = _import("matplotlib.pyplot")
    return plt.subplots(figsize=figsize)[1]


def plot_simplex_coordinates(weights_row: ArrayLike, top_k: int = 5, *, ax: Any = None,
                             key_labels: Optional[Sequence[str]] = None,
                             title: Optional[str] = None) -> Any:
    """Draw one row's simplex coordinates as bars: the ``top_k`` largest weights
    and one grey bar for the rest, with the centre's coordinate ``1/n`` dashed and
    the row's entropy, effective support and largest weight written in.

    ``key_labels`` (n strings) names the keys (default ``"key j"``).  Draws into
    ``ax`` (a new figure if None) and returns the axes.  Needs matplotlib.
    """
    fn = "plot_simplex_coordinates"
    idx, vals, rest = simplex_coordinates(weights_row, top_k)
    w = _row(weights_row, fn)
    n = w.size
    labels = _labels(key_labels, n, fn)
    ax = _axes(ax, (5.0, 4.0))
    names = [labels[j] for j in idx]
    heights = list(vals)
    colours = ["C0"] * len(names)
    if idx.size < n:
        names.append(f"rest\n({n - idx.size} keys)")
        heights.append(rest)
        colours.append("0.65")
    bars = ax.bar(range(len(names)), heights, color=colours, edgecolor="k", linewidth=0.6)
    ax.bar_label(bars, labels=[f"{hgt:.2f}" for hgt in heights], padding=2, fontsize=9)
    # the centre of the simplex for comparison: 1/n per key, (n - k)/n for the rest
    ax.axhline(1.0 / n, color="C3", linestyle="--", linewidth=1.2)
    if idx.size < n:
        ax.hlines((n - idx.size) / n, len(names) - 1.45, len(names) - 0.55, color="C3",
                  linestyle="--", linewidth=1.2, zorder=3)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=35, ha="right", rotation_mode="anchor", fontsize=9)
    ax.set_ylim(0, 1.3)
    ax.set_yticks([0, 0.25, 0.5, 0.75, 1.0])
    ax.set_ylabel("weight = coordinate on the simplex")
    h = float(_entropy_and_max(w)[0])
    ax.text(0.98, 0.97, f"H = {h:.2f} nats (log n = {math.log(n):.2f})\n"
            f"exp(H) = {math.exp(h):.2f} of n = {n} keys\nmax weight = {vals[0]:.2f}\n"
            f"dashed: the centre (1/n = {1.0 / n:.3g} each)",
            transform=ax.transAxes, ha="right", va="top", fontsize=9,
            bbox=dict(boxstyle="round", facecolor="white", edgecolor="0.7"))
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def _hull(points: F64) -> F64:
    """The convex hull of 2-D points, counter-clockwise (Andrew's monotone chain)."""
    pts = sorted(set(map(tuple, np.round(points, 12).tolist())))
    if len(pts) <= 2:
        return np.array(pts, dtype=np.float64).reshape(-1, 2)

    def cross(o: Sequence[float], a: Sequence[float], b: Sequence[float]) -> float:
        return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])

    lower: List[Tuple[float, ...]] = []
    upper: List[Tuple[float, ...]] = []
    for p in pts:
        while len(lower) >= 2 and cross(lower[-2], lower[-1], p) <= 0:
            lower.pop()
        lower.append(p)
    for p in reversed(pts):
        while len(upper) >= 2 and cross(upper[-2], upper[-1], p) <= 0:
            upper.pop()
        upper.append(p)
    return np.array(lower[:-1] + upper[:-1], dtype=np.float64)


def plot_barycentre(weights_row: ArrayLike, v: ArrayLike, *, ax: Any = None,
                    key_labels: Optional[Sequence[str]] = None, title: Optional[str] = None,
                    annotate: int = 3, colorbar: bool = True) -> Any:
    """Draw the barycentre picture of one row: the values projected to 2-D (see
    :func:`barycentre_projection`), each point sized and coloured by its weight,
    their convex hull shaded, the mean of the values (the image of the simplex's
    centre) as a grey cross and the output ``w @ v`` as a red star.

    The ``annotate`` heaviest keys are labelled (``key_labels``, default
    ``"key j"``).  Draws into ``ax`` (a new figure if None) and returns the axes.
    Needs matplotlib.
    """
    fn = "plot_barycentre"
    pts, out2 = barycentre_projection(weights_row, v)
    w = _row(weights_row, fn)
    vals = _values(v, w.size, fn)
    _, _, ratio = _pca2(vals)
    labels = _labels(key_labels, w.size, fn)
    ax = _axes(ax, (5.5, 4.5))
    hull = _hull(pts)
    if len(hull) >= 3:
        ax.fill(hull[:, 0], hull[:, 1], facecolor="0.93", edgecolor="0.6", linewidth=0.8,
                zorder=0, label="convex hull of the values")
    order = np.argsort(w, kind="stable")  # heavy points drawn last, on top
    sc = ax.scatter(pts[order, 0], pts[order, 1], s=12 + 400 * w[order], c=w[order],
                    cmap="viridis", vmin=0.0, vmax=max(float(w.max()), 1e-12),
                    edgecolors="k", linewidths=0.4, zorder=2)
    ax.scatter([0.0], [0.0], marker="P", s=80, color="0.35", edgecolors="white", zorder=6,
               label="mean of the values (weights 1/n)")
    ax.scatter([out2[0]], [out2[1]], marker="*", s=280, color="red", edgecolors="k",
               linewidths=0.8, zorder=5, label="output o = Σ w_j v_j")
    # number the heaviest keys on the plot and list them in a box (labels written
    # beside points that nearly coincide would overlap); keys at about the centre's
    # weight 1/n are not singled out
    heavy = [int(j) for j in np.argsort(-w, kind="stable")[:max(0, annotate)]
             if w[j] > 1.5 / w.size]
    for rank, j in enumerate(heavy, 1):
        ax.plot([out2[0], pts[j, 0]], [out2[1], pts[j, 1]], color="C3", linewidth=0.9,
                linestyle=":", zorder=1)
        ax.annotate(str(rank), (pts[j, 0], pts[j, 1]), xytext=(7, 5), textcoords="offset points",
                    fontsize=9, fontweight="bold", zorder=3)
    if heavy:
        ax.text(0.98, 0.98, "\n".join(f"{r}: {labels[j]}  w={w[j]:.2f}"
                                      for r, j in enumerate(heavy, 1)),
                transform=ax.transAxes, ha="right", va="top", fontsize=8, zorder=6,
                bbox=dict(boxstyle="round", facecolor="white", edgecolor="0.7", alpha=0.9))
    if colorbar:
        ax.figure.colorbar(sc, ax=ax, label="weight w_j", shrink=0.85)
    ax.set_aspect("equal", adjustable="datalim")
    ax.set_xlabel(f"value PC1 ({ratio[0]:.0%} of variance)")
    ax.set_ylabel(f"value PC2 ({ratio[1]:.0%} of variance)")
    ax.legend(loc="lower left", fontsize=7.5, framealpha=0.85)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def plot_entropy_profile(profile: EntropyProfile, *, heads: Optional[Sequence[int]] = None,
                         batch: int = 0, ax: Any = None,
                         head_labels: Optional[Sequence[str]] = None,
                         title: Optional[str] = None) -> Any:
    """Draw row entropy H along the sequence, one line per head, under its upper
    bound log(n_visible) (the centre of each row's simplex); a right axis reads
    the same heights as the effective support exp(H) in keys.

    ``profile`` comes from :func:`entropy_profile`; with leading batch axes,
    ``batch`` picks one (in the flattened order).  ``heads`` (default all) picks
    the heads and ``head_labels`` (one per head of the profile) names them.
    Draws into ``ax`` (a new figure if None) and returns the axes.  Needs matplotlib.
    """
    fn = "plot_entropy_profile"
    ent = np.asarray(profile.entropy, dtype=np.float64)
    nvis = np.asarray(profile.n_visible)
    if ent.ndim < 2 or nvis.shape != ent.shape:
        raise ValueError(f"fastattn.geometry.{fn}: profile must be an EntropyProfile with "
                         f"entropy and n_visible of one shape (..., Hq, Lq), got "
                         f"{ent.shape} and {nvis.shape}")
    ent = ent.reshape((-1,) + ent.shape[-2:])
    nvis = nvis.reshape((-1,) + nvis.shape[-2:])
    if not 0 <= batch < ent.shape[0]:
        raise ValueError(f"fastattn.geometry.{fn}: batch must be in [0, {ent.shape[0]}), "
                         f"got {batch}")
    ent, nvis = ent[batch], nvis[batch]
    n_heads, length = ent.shape
    sel = list(range(n_heads)) if heads is None else [int(h) for h in heads]
    if not sel or any(not 0 <= h < n_heads for h in sel):
        raise ValueError(f"fastattn.geometry.{fn}: heads must be indices in [0, {n_heads}), "
                         f"got {heads!r}")
    if head_labels is not None and len(head_labels) != n_heads:
        raise ValueError(f"fastattn.geometry.{fn}: head_labels has {len(head_labels)} labels "
                         f"for {n_heads} heads")
    names = [f"head {h}" for h in range(n_heads)] if head_labels is None else list(head_labels)
    ax = _axes(ax, (8.0, 4.0))
    pos = np.arange(length)
    bound = np.where(nvis > 0, np.log(np.maximum(nvis, 1)), np.nan)
    shared = bool(np.all(bound[sel] == bound[sel[0]]) or np.all(np.isnan(bound[sel])))
    if shared:  # drawn over the heads: a head at the centre would hide it
        ax.plot(pos, bound[sel[0]], color="k", linestyle="--", linewidth=1.3, zorder=4,
                label="log(n visible): the centre")
    for c, h in enumerate(sel):
        line = np.where(nvis[h] > 0, ent[h], np.nan)
        ax.plot(pos, line, color=f"C{c % 10}", linewidth=2.2, marker="o", markersize=2.5,
                label=names[h])
        if not shared:
            ax.plot(pos, bound[h], color=f"C{c % 10}", linestyle="--", linewidth=1.0, zorder=4)
    ax.axhline(0.0, color="0.5", linewidth=0.8)
    top = float(np.nanmax(bound[sel])) if np.isfinite(bound[sel]).any() else 1.0
    ax.set_ylim(-0.04 * max(top, 1.0), 1.05 * max(top, 1.0))
    ax.set_xlim(-0.5, length - 0.5)
    ax.set_xlabel("query position i")
    ax.set_ylabel("row entropy H (nats)")
    sec = ax.secondary_yaxis("right", functions=(np.exp, lambda x: np.log(np.maximum(x, 1e-300))))
    ticks = [t for t in (1, 2, 3, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000,
                         20000, 50000, 100000) if math.log(t) <= 1.05 * max(top, 1.0)]
    sec.set_yticks(ticks)
    sec.set_yticklabels([str(t) for t in ticks])
    sec.set_ylabel("effective support exp(H) (keys)")
    ax.legend(loc="upper left", fontsize=8, ncol=2, framealpha=0.9)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


# ---------------------------------------------------------------------------- demo

_WORDS = ("attention reads each context through soft coordinates on a simplex then rebuilds "
          "its output as the barycentre of visible values").split()


class DemoExample(NamedTuple):
    """The built-in example of the demo: one causal attention layer with 4 heads
    over a 20-word sentence said three times (60 tokens)."""

    words: List[str]
    """The token of each position."""
    q: F64
    """(4, 60, 64) queries."""
    k: F64
    """(4, 60, 64) keys."""
    v: F64
    """(4, 60, 16) values."""
    alibi_slopes: F64
    """(4,) ALiBi slopes (only head 3 has one)."""
    head_names: List[str]
    rows: Dict[str, Tuple[int, int]]
    """The (head, query position) of the rows the figures show: "vertex", "face", "centre"."""


def demo_example(seed: int = 17) -> DemoExample:
    """The demo's attention layer (random weights, fixed seed), built so that its
    heads sit at different places of the simplex.

    Tokens are random 48-dimensional embeddings of the words plus a random
    16-dimensional position code, and every projection is random (entries of
    variance 1/64).  Head 0 has tied projections, ``W_K = W_Q`` on the word part
    only, sharpened 3x: its bilinear form ``W_Q W_K^T`` is positive
    semi-definite, so each token matches itself and the earlier copies of its
    word far above anything else.  Its row at a word's first occurrence is a
    vertex of the simplex; at the c-th occurrence it splits evenly over the c
    copies (the centre of a face, effective support c).  Head 1 is left random;
    head 2's queries are scaled by 0.1 (logits near 0, rows near the centre of
    the simplex); head 3 has queries scaled by 0.3 and an ALiBi slope of 0.7 (a
    local head that reads the last few tokens, like a convolution).
    """
    rng = np.random.default_rng(seed)
    d_word, d_pos, d_head, d_value, n_heads = 48, 16, 64, 16, 4
    words = _WORDS * 3
    vocab = {w: i for i, w in enumerate(_WORDS)}
    emb = rng.standard_normal((len(vocab), d_word))
    x = np.concatenate([emb[[vocab[w] for w in words]],
                        2.0 * rng.standard_normal((len(words), d_pos))], axis=1)
    d_model = x.shape[1]
    wq = rng.standard_normal((n_heads, d_model, d_head)) / math.sqrt(d_model)
    wk = rng.standard_normal((n_heads, d_model, d_head)) / math.sqrt(d_model)
    wv = rng.standard_normal((n_heads, d_model, d_value)) / math.sqrt(d_model)
    wq[0, d_word:] = 0.0      # head 0 reads the word, not the position ...
    wk[0] = wq[0]             # ... with tied query and key maps ...
    wq[0] *= 3.0              # ... sharpened
    wq[2] *= 0.1
    wq[3] *= 0.3
    q = np.einsum("ld,hde->hle", x, wq)
    k = np.einsum("ld,hde->hle", x, wk)
    v = np.einsum("ld,hde->hle", x, wv)
    last = len(words) - 1
    first_of_last_word = _WORDS.index(words[last])
    return DemoExample(
        words=words, q=q, k=k, v=v, alibi_slopes=np.array([0.0, 0.0, 0.0, 0.7]),
        head_names=["head 0: tied W_Q = W_K (matches its word)", "head 1: random",
                    "head 2: small logits (near uniform)", "head 3: ALiBi 0.7 (local)"],
        rows={"vertex": (0, first_of_last_word), "face": (0, last), "centre": (2, last)})


def _demo_rows(ex: DemoExample) -> Tuple[F64, Dict[str, Tuple[F64, F64, List[str], str]]]:
    """The demo's weights and, per shown row, its visible weights, values, key labels
    and panel title."""
    w = np.asarray(fastattn.attention_weights(ex.q, ex.k, causal=True,
                                              alibi_slopes=ex.alibi_slopes), dtype=np.float64)
    what = {"vertex": "first time this word is seen: near a vertex",
            "face": "3rd copy of the word: centre of a face",
            "centre": "near the centre of the simplex"}
    rows = {}
    for name, (h, i) in ex.rows.items():
        labels = [f"{j} {ex.words[j]}" for j in range(i + 1)]
        title = f"head {h}, query {i} '{ex.words[i]}'\n{what[name]}"
        rows[name] = (w[h, i, :i + 1], ex.v[h, :i + 1], labels, title)
    return w, rows


def write_demo_figures(out_dir: str = ".", *, dpi: int = 110) -> List[str]:
    """Write the demo's three figures into ``out_dir`` (created if missing) and
    return their paths: ``simplex_coordinates.png`` (three rows' coordinates),
    ``barycentre.png`` (the same rows in value space) and ``entropy_profile.png``
    (every head's row entropy along the sequence).  Needs matplotlib.
    """
    figure = _import("matplotlib.figure")
    os.makedirs(out_dir, exist_ok=True)
    ex = demo_example()
    _, rows = _demo_rows(ex)
    order = ("vertex", "face", "centre")
    paths = []

    fig = figure.Figure(figsize=(13.5, 4.6), layout="constrained")
    axes = fig.subplots(1, 3)
    for ax, name in zip(axes, order):
        row, _, labels, title = rows[name]
        plot_simplex_coordinates(row, 5, ax=ax, key_labels=labels, title=title)
    fig.suptitle("A row of attention weights is a point of the simplex: its largest "
                 "coordinates and the rest", fontsize=12)
    paths.append(os.path.join(out_dir, "simplex_coordinates.png"))
    fig.savefig(paths[-1], dpi=dpi)

    fig = figure.Figure(figsize=(15, 5.4), layout="constrained")
    axes = fig.subplots(1, 3)
    for ax, name in zip(axes, order):
        row, vals, labels, title = rows[name]
        plot_barycentre(row, vals, ax=ax, key_labels=labels, title=title)
    fig.suptitle("The output is the barycentre of the values with those coordinates "
                 "(values projected to 2-D by PCA; the projection keeps barycentres)",
                 fontsize=12)
    paths.append(os.path.join(out_dir, "barycentre.png"))
    fig.savefig(paths[-1], dpi=dpi)

    prof = entropy_profile(ex.q, ex.k, causal=True, alibi_slopes=ex.alibi_slopes)
    fig = figure.Figure(figsize=(10, 5), layout="constrained")
    ax = fig.subplots()
    plot_entropy_profile(prof, ax=ax, head_labels=ex.head_names,
                         title="Row entropy along the sequence, per head (causal: row i sees "
                               "i + 1 keys); the 20-word sentence is said three times")
    n_words = len(_WORDS)
    for c in (1, 2):
        ax.axvline(c * n_words - 0.5, color="0.6", linestyle=":", linewidth=1)
        ax.text(c * n_words, 0.02, f"copy {c + 1} begins", transform=ax.get_xaxis_transform(),
                fontsize=8, color="0.35")
    paths.append(os.path.join(out_dir, "entropy_profile.png"))
    fig.savefig(paths[-1], dpi=dpi)
    return paths


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m fastattn.geometry --demo [--out DIR]``: write the demo's figures
    and print their paths.  Returns the exit status."""
    p = argparse.ArgumentParser(
        prog="python -m fastattn.geometry",
        description="Draw the geometry of attention (docs/geometry.md) for a built-in "
                    "example: simplex coordinates of three rows, their barycentres in value "
                    "space, and each head's row entropy along the sequence. Needs matplotlib: "
                    f"{_PLOT_HINT}.")
    p.add_argument("--demo", action="store_true", help="write the demo's PNG figures")
    p.add_argument("--out", metavar="DIR", default=".",
                   help="folder for the PNG files (created if missing; default: the current one)")
    p.add_argument("--dpi", type=int, default=110, help="resolution (default %(default)s)")
    a = p.parse_args(None if argv is None else list(argv))
    if not a.demo:
        p.print_usage(sys.stderr)
        print("python -m fastattn.geometry: nothing to do; pass --demo to write the figures",
              file=sys.stderr)
        return 2
    if a.dpi < 10:
        p.error("--dpi must be >= 10")
    try:
        paths = write_demo_figures(a.out, dpi=a.dpi)
    except ImportError as exc:
        print(exc, file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
