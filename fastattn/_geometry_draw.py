"""Drawing for :mod:`fastattn.geometry`: the plots, the demo and its command line.

The ``plot_*`` functions, the built-in demo example and
``python -m fastattn.geometry``.

Private: :mod:`fastattn.geometry` re-exports every public name.  matplotlib (the
``plot`` extra) is imported only when a function draws.
"""
from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

import fastattn

from ._typing import ArrayLike

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
    """Draw one row's simplex coordinates as bars.

    The `top_k` largest weights and one grey bar for the rest, with the centre's
    coordinate ``1/n`` dashed and the row's entropy, effective support and largest
    weight written in.  Needs matplotlib (``pip install fastattn[plot]``).

    Parameters
    ----------
    weights_row : array_like, shape (n,)
        One row of attention weights (``>= 0``, summing to 1).
    top_k : int, default 5
        How many of the largest weights get their own bar.
    ax : matplotlib.axes.Axes, optional
        The axes to draw into; default a new figure's.
    key_labels : sequence of str, optional
        ``n`` names of the keys; default ``"key j"``.
    title : str, optional
        The axes' title.

    Returns
    -------
    matplotlib.axes.Axes
        The axes drawn into.

    Raises
    ------
    ValueError
        As :func:`simplex_coordinates`, or if `key_labels` does not have ``n`` labels.
    ImportError
        If matplotlib is not installed.

    See Also
    --------
    simplex_coordinates : The numbers drawn.

    Examples
    --------
    >>> import matplotlib
    >>> matplotlib.use("Agg")
    >>> import numpy as np
    >>> from fastattn.geometry import plot_simplex_coordinates
    >>> ax = plot_simplex_coordinates(np.array([0.5, 0.25, 0.125, 0.125]), top_k=2)
    >>> [t.get_text().splitlines()[0] for t in ax.get_xticklabels()]
    ['key 0', 'key 1', 'rest']
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
    """Draw the barycentre picture of one row.

    The values projected to 2-D (see :func:`barycentre_projection`), each point
    sized and coloured by its weight, their convex hull shaded, the mean of the
    values (the image of the simplex's centre) as a grey cross and the output
    ``w @ v`` as a red star.  Needs matplotlib (``pip install fastattn[plot]``).

    Parameters
    ----------
    weights_row : array_like, shape (n,)
        One row of attention weights (``>= 0``, summing to 1).
    v : array_like, shape (n, Dv)
        The values of the same ``n`` keys.
    ax : matplotlib.axes.Axes, optional
        The axes to draw into; default a new figure's.
    key_labels : sequence of str, optional
        ``n`` names of the keys; default ``"key j"``.
    title : str, optional
        The axes' title.
    annotate : int, default 3
        How many of the heaviest keys to number and list (keys at about the
        centre's weight ``1/n`` are not singled out).
    colorbar : bool, default True
        Draw a colour bar of the weights.

    Returns
    -------
    matplotlib.axes.Axes
        The axes drawn into.

    Raises
    ------
    ValueError
        As :func:`barycentre_projection`, or if `key_labels` does not have ``n``
        labels.
    ImportError
        If matplotlib is not installed.

    See Also
    --------
    barycentre_projection : The numbers drawn.

    Examples
    --------
    >>> import matplotlib
    >>> matplotlib.use("Agg")
    >>> import numpy as np
    >>> from fastattn.geometry import plot_barycentre
    >>> w = np.array([0.5, 0.25, 0.125, 0.125])
    >>> v = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    >>> ax = plot_barycentre(w, v, colorbar=False)
    >>> ax.get_xlabel()
    'value PC1 (50% of variance)'
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
    """Draw row entropy along the sequence, one line per head.

    Each head's line lies under its upper bound ``log(n_visible)`` (the centre of
    each row's simplex, dashed); a right axis reads the same heights as the
    effective support ``exp(H)`` in keys.  Needs matplotlib
    (``pip install fastattn[plot]``).

    Parameters
    ----------
    profile : EntropyProfile
        From :func:`entropy_profile`.
    heads : sequence of int, optional
        The heads to draw; default all.
    batch : int, default 0
        With leading batch axes, which one (in the flattened order).
    ax : matplotlib.axes.Axes, optional
        The axes to draw into; default a new figure's.
    head_labels : sequence of str, optional
        One name per head of the profile; default ``"head h"``.
    title : str, optional
        The axes' title.

    Returns
    -------
    matplotlib.axes.Axes
        The axes drawn into.

    Raises
    ------
    ValueError
        If `profile`'s arrays are not (..., Hq, Lq), or `batch`, `heads` or
        `head_labels` do not fit it.
    ImportError
        If matplotlib is not installed.

    See Also
    --------
    entropy_profile : The numbers drawn.

    Examples
    --------
    >>> import matplotlib
    >>> matplotlib.use("Agg")
    >>> import numpy as np
    >>> from fastattn.geometry import entropy_profile, plot_entropy_profile
    >>> q, k = np.random.default_rng(0).standard_normal((2, 2, 6, 8))
    >>> ax = plot_entropy_profile(entropy_profile(q, k, causal=True))
    >>> [t.get_text() for t in ax.get_legend().get_texts()]
    ['log(n visible): the centre', 'head 0', 'head 1']
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
    """The built-in example of the demo, as :func:`demo_example` returns it.

    One causal attention layer with 4 heads over a 20-word sentence said three
    times (60 tokens).

    Parameters
    ----------
    words : list of str
        The token of each position.
    q : ndarray of float64, shape (4, 60, 64)
        Queries.
    k : ndarray of float64, shape (4, 60, 64)
        Keys.
    v : ndarray of float64, shape (4, 60, 16)
        Values.
    alibi_slopes : ndarray of float64, shape (4,)
        ALiBi slopes (only head 3 has one).
    head_names : list of str
        A description of each head.
    rows : dict of str to tuple of (int, int)
        The (head, query position) of the rows the figures show: "vertex", "face",
        "centre".
    """

    words: List[str]
    q: F64
    k: F64
    v: F64
    alibi_slopes: F64
    head_names: List[str]
    rows: Dict[str, Tuple[int, int]]


def demo_example(seed: int = 17) -> DemoExample:
    """Build the demo's attention layer, whose heads sit at different places of the simplex.

    Parameters
    ----------
    seed : int, default 17
        Seed of the random embeddings and projections.

    Returns
    -------
    DemoExample
        The tokens, q, k, v, ALiBi slopes, head names and the rows the figures
        show.

    See Also
    --------
    write_demo_figures : Draw the demo's figures.

    Notes
    -----
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

    Examples
    --------
    >>> from fastattn.geometry import demo_example
    >>> ex = demo_example()
    >>> len(ex.words), ex.q.shape, ex.v.shape, ex.rows["face"]
    (60, (4, 60, 64), (4, 60, 16), (0, 59))
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
    """Write the demo's three figures as PNG files and return their paths.

    ``simplex_coordinates.png`` (three rows' coordinates), ``barycentre.png`` (the
    same rows in value space) and ``entropy_profile.png`` (every head's row entropy
    along the sequence).  Needs matplotlib (``pip install fastattn[plot]``).

    Parameters
    ----------
    out_dir : str, default "."
        The folder to write into, created if missing.
    dpi : int, default 110
        Resolution of the PNG files.

    Returns
    -------
    list of str
        The three files' paths, in the order above.

    Raises
    ------
    ImportError
        If matplotlib is not installed.

    See Also
    --------
    demo_example : The layer drawn.
    main : The same from the command line.

    Examples
    --------
    >>> import os, tempfile
    >>> import matplotlib  # (the plot extra)
    >>> from fastattn.geometry import write_demo_figures
    >>> with tempfile.TemporaryDirectory() as d:
    ...     [os.path.basename(p) for p in write_demo_figures(d, dpi=20)]
    ['simplex_coordinates.png', 'barycentre.png', 'entropy_profile.png']
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
    """Run ``python -m fastattn.geometry --demo [--out DIR] [--dpi N]``.

    Writes the demo's figures with :func:`write_demo_figures` and prints their
    paths, one a line.

    Parameters
    ----------
    argv : sequence of str, optional
        The command-line arguments; default ``sys.argv[1:]``.

    Returns
    -------
    int
        The exit status: 0 when the figures were written, 1 without matplotlib
        (the message says what to install), 2 without ``--demo``.

    Raises
    ------
    SystemExit
        From argparse, for unknown options or ``--dpi`` below 10.

    Examples
    --------
    >>> from fastattn.geometry import main
    >>> main([])
    2
    """
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


# Imported last: fastattn.geometry imports this module at its end, so whichever of the
# two is imported first, the other's names exist by the time these lines run.
from .geometry import (F64, _PLOT_HINT, EntropyProfile, _entropy_and_max, _labels,  # noqa: E402
                       _pca2, _row, _values, barycentre_projection, entropy_profile,
                       simplex_coordinates)
