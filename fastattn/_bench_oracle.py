"""The benchmark's correctness check against the float64 oracle.

fastattn's output against :mod:`fastattn.reference` on a sample of query rows, and
the naive NumPy formula that the report times.

Private: :mod:`fastattn.bench` re-exports every public name.
"""
import numpy as np

from fastattn import reference


def naive(q, k, v, scale, causal):
    """Compute ``softmax(q k^T * scale) v`` in plain NumPy: the bench's naive column.

    Forms the whole score matrix, subtracts each row's maximum, and works in q's
    dtype throughout.

    Parameters
    ----------
    q : ndarray, shape (..., Lq, D)
        Queries.
    k : ndarray, shape (..., Lk, D)
        Keys.
    v : ndarray, shape (..., Lk, Dv)
        Values.
    scale : float
        Multiplies the scores.
    causal : bool
        Hide key j from query i when ``j > i + (Lk - Lq)`` (bottom-right, as
        fastattn's ``causal=True``).

    Returns
    -------
    ndarray, shape (..., Lq, Dv)
        The attention output.

    Examples
    --------
    >>> import numpy as np
    >>> import fastattn
    >>> from fastattn import bench
    >>> q, k, v = np.random.default_rng(0).standard_normal((3, 2, 16, 8))
    >>> out = bench.naive(q, k, v, 8 ** -0.5, causal=True)
    >>> bench.rel_err(out, fastattn.attention(q, k, v, causal=True)) < 1e-12
    True
    """
    s = q @ k.swapaxes(-1, -2)
    s *= s.dtype.type(scale)
    if causal:  # bottom-right, as fastattn's causal=True (same as top-left when Lq == Lk)
        lq, lk = s.shape[-2:]
        s[..., np.triu(np.ones((lq, lk), dtype=bool), k=1 + lk - lq)] = -np.inf
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s @ v


# ---------------------------------------------------------------- the oracle check
def sample_rows(lq, n_random=6, seed=0):
    """Choose the query rows to check: the first, the last and `n_random` others.

    Parameters
    ----------
    lq : int
        The number of query rows.
    n_random : int, default 6
        How many other rows to draw (all of them when there are fewer).
    seed : int, default 0
        Seed of the draw.

    Returns
    -------
    ndarray of intp
        The chosen rows, sorted and distinct; empty when ``lq <= 0``.

    Examples
    --------
    >>> from fastattn import bench
    >>> bench.sample_rows(3)
    array([0, 1, 2])
    >>> rows = bench.sample_rows(100)
    >>> len(rows), int(rows[0]), int(rows[-1])
    (8, 0, 99)
    """
    if lq <= 0:
        return np.arange(0)
    rng = np.random.default_rng(seed)
    extra = rng.choice(lq, size=min(n_random, lq), replace=False)
    return np.unique(np.concatenate(([0, lq - 1], extra))).astype(np.intp)


def rel_err(out, ref):
    """Compute the relative error ``max |out - ref| / max |ref|`` in float64.

    Parameters
    ----------
    out : array_like
        The result to judge.
    ref : array_like
        The reference, of `out`'s shape.

    Returns
    -------
    float
        The error; 0.0 for empty arrays, NaN where `out` has NaN.

    Examples
    --------
    >>> from fastattn import bench
    >>> bench.rel_err([1.0, 2.0], [1.0, 2.5])
    0.2
    """
    ref = np.asarray(ref, dtype=np.float64)
    if ref.size == 0:
        return 0.0
    return float(np.max(np.abs(np.asarray(out, dtype=np.float64) - ref))
                 / max(float(np.max(np.abs(ref))), 1e-300))


def _rows_of(a, rows, lq):
    """Rows `rows` of a mask/bias broadcast (right-aligned) against (..., Lq, Lk)."""
    a = np.asarray(a)
    return a[..., rows, :] if a.ndim >= 2 and a.shape[-2] == lq else a


def check_rows(out, q, k, v, rows=None, *, causal=False, window=None, mask=None, bias=None,
               alibi_slopes=None, layout="bhsd", **kw):
    """Check an attention output against the float64 oracle on a sample of query rows.

    The relative error of `out` (``fastattn.attention(q, k, v, ...)``) on some query
    rows of every batch and every head, against :func:`fastattn.reference.attention`
    computed on just those rows, one (batch, K/V head) at a time.

    Parameters
    ----------
    out : array_like
        The output to check, of q's shape with v's last dim.
    q : array_like
        Queries, 2-D, 3-D or 4-D in `layout`.
    k : array_like
        Keys.
    v : array_like
        Values.
    rows : array_like of int, optional
        Query positions to check; default ``sample_rows(Lq)``.
    causal : {False, True, 'bottom-right', 'top-left'}, default False
        As in :func:`fastattn.attention`.
    window : tuple of (int or None, int or None), optional
        As in :func:`fastattn.attention`.
    mask : array_like of bool, optional
        As in :func:`fastattn.attention`.
    bias : array_like, optional
        As in :func:`fastattn.attention`.
    alibi_slopes : array_like, optional
        As in :func:`fastattn.attention`.
    layout : {"bhsd", "bshd"}, default "bhsd"
        The layout of `out`, `q`, `k` and `v`.
    **kw
        Other keywords of the oracle (`scale`, `softcap`).

    Returns
    -------
    float
        ``max |out - ref| / max |ref|`` over the checked rows; inf if `out` has a NaN
        where the reference has a value.

    Notes
    -----
    The oracle sees ``q[..., rows, :]`` and all the keys; the causal/window
    alignment, ALiBi's distances and the mask/bias rows of the original positions
    become an explicit mask and bias, so a query keeps the keys it had in the full
    problem (both causal alignments, Lq != Lk).

    Examples
    --------
    >>> import numpy as np
    >>> import fastattn
    >>> from fastattn import bench
    >>> q, k, v = np.random.default_rng(0).standard_normal((3, 2, 64, 16)).astype(np.float32)
    >>> out = fastattn.attention(q, k, v, causal=True)
    >>> bench.check_rows(out, q, k, v, causal=True) < bench.TOL["float32"]
    True
    """
    def bhsd(a):  # a (B, H, L, D) view of a 2-D, 3-D or 4-D array in `layout`
        a = np.asarray(a)
        if layout == "bshd" and a.ndim >= 3:
            a = a.swapaxes(-3, -2)
        return a.reshape((1,) * (4 - a.ndim) + a.shape)

    q4, k4, v4, o4 = (bhsd(a) for a in (q, k, v, out))
    lq, lk = q4.shape[2], k4.shape[2]
    rows = sample_rows(lq) if rows is None else np.asarray(rows, dtype=np.intp)
    i, j = rows[:, None], np.arange(lk)[None, :]
    mode = None if causal is False or causal is None or (isinstance(causal, np.bool_) and not causal) \
        else "top-left" if causal == "top-left" else "bottom-right"
    diag = i if mode == "top-left" else i + (lk - lq)  # the diagonal of DESIGN.md's step 5
    vis = np.ones((rows.size, lk), dtype=bool)
    if mode is not None:
        vis &= j <= diag
    if window is not None:
        left, right = window
        if left is not None:
            vis &= j >= diag - left
        if right is not None:
            vis &= j <= diag + right
    if mask is not None:
        vis = vis & _rows_of(mask, rows, lq)
    b = None if bias is None else _rows_of(bias, rows, lq).astype(np.float64)
    if alibi_slopes is not None:
        sl = np.asarray(alibi_slopes, dtype=np.float64)
        dist = np.abs(i + (lk - lq) - j).astype(np.float64)
        ali = -sl[..., None, None] * dist  # (Hq, r, Lk) or (B, Hq, r, Lk)
        b = ali if b is None else b + ali
    B, hq, hkv = q4.shape[0], q4.shape[1], k4.shape[1]
    full = (B, hq, rows.size, lk)
    vis = np.broadcast_to(vis, full)
    b = None if b is None else np.broadcast_to(b, full)
    g = hq // hkv if hkv else 0
    num = den = 0.0
    # one (batch, K/V head) at a time: the oracle converts its K/V to float64, and a
    # whole decode cache would take gigabytes
    for bi in range(B):
        for h in range(hkv):
            hs = slice(h * g, (h + 1) * g)  # the query heads of K/V head h
            ref = reference.attention(q4[bi:bi + 1, hs][:, :, rows], k4[bi:bi + 1, h:h + 1],
                                      v4[bi:bi + 1, h:h + 1], mask=vis[bi:bi + 1, hs],
                                      bias=None if b is None else b[bi:bi + 1, hs], **kw)
            got = np.asarray(o4[bi:bi + 1, hs][:, :, rows], dtype=np.float64)
            if ref.size:
                d = float(np.max(np.abs(got - ref)))
                num = max(num, d) if np.isfinite(d) else np.inf  # a NaN fails the check
                den = max(den, float(np.max(np.abs(ref))))
    return num / max(den, 1e-300)
