"""fastattn.geometry: the numbers behind the essay's pictures (simplex coordinates,
barycentre projection, entropy profile), checked without drawing; the drawing and the
demo checked with matplotlib's Agg backend when matplotlib is installed."""
import math
import sys

import numpy as np
import pytest

import fastattn
from fastattn import geometry


def _softmax(s):
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# ------------------------------------------------------------ simplex_coordinates

def test_simplex_coordinates_sorted_and_sum_to_one(rng):
    w = _softmax(rng.standard_normal(40) * 3)
    idx, vals, rest = geometry.simplex_coordinates(w, top_k=5)
    assert idx.shape == vals.shape == (5,) and idx.dtype == np.int64
    assert np.all(np.diff(vals) <= 0)                       # largest first
    np.testing.assert_array_equal(idx, np.argsort(-w, kind="stable")[:5])
    np.testing.assert_allclose(vals, w[idx], rtol=1e-14)
    assert rest >= 0 and abs(vals.sum() + rest - 1.0) <= 1e-14
    assert rest == pytest.approx(np.delete(w, idx).sum(), rel=1e-13)


def test_simplex_coordinates_float32_row_is_renormalised(rng):
    """A float32 row sums to 1 only to ~1e-7; the coordinates sum to 1 in float64."""
    q = rng.standard_normal((1, 9, 16)).astype(np.float32)
    k = rng.standard_normal((1, 300, 16)).astype(np.float32)
    w = fastattn.attention_weights(q, k)[0, 3]
    idx, vals, rest = geometry.simplex_coordinates(w, top_k=7)
    assert abs(vals.sum() + rest - 1.0) <= 1e-14


def test_simplex_coordinates_ties_and_top_k_larger_than_n():
    w = np.array([0.25, 0.25, 0.5])
    idx, vals, rest = geometry.simplex_coordinates(w, top_k=10)
    np.testing.assert_array_equal(idx, [2, 0, 1])            # ties: lower index first
    np.testing.assert_array_equal(vals, [0.5, 0.25, 0.25])
    assert rest == 0.0
    idx, vals, rest = geometry.simplex_coordinates(w, top_k=3)
    assert idx.size == 3 and rest == 0.0
    idx, vals, rest = geometry.simplex_coordinates([1.0], top_k=1)   # n = 1: the only vertex
    assert idx.tolist() == [0] and vals.tolist() == [1.0] and rest == 0.0


def test_simplex_coordinates_vertex_and_centre():
    idx, vals, rest = geometry.simplex_coordinates(np.eye(8)[5], top_k=3)
    assert idx[0] == 5 and vals[0] == 1.0 and rest == 0.0
    idx, vals, rest = geometry.simplex_coordinates(np.full(8, 1 / 8), top_k=3)
    np.testing.assert_allclose(vals, 1 / 8)
    assert rest == pytest.approx(5 / 8, rel=1e-14)


@pytest.mark.parametrize("top_k", [0, -1, 2.5, "3", None, True])
def test_simplex_coordinates_bad_top_k(top_k):
    with pytest.raises(ValueError, match="top_k"):
        geometry.simplex_coordinates(np.full(4, 0.25), top_k=top_k)


@pytest.mark.parametrize("row, what", [
    (np.full((2, 2), 0.25), "1-D"),
    (np.array([]), "empty"),
    (np.array([0.5, np.nan, 0.5]), "NaN"),
    (np.array([1.5, -0.5]), "negative"),
    (np.array([0.2, 0.2]), "simplex"),
    (np.zeros(4), "simplex"),
])
def test_simplex_coordinates_bad_row(row, what):
    with pytest.raises(ValueError, match="weights_row") as info:
        geometry.simplex_coordinates(row)
    assert what in str(info.value)


# ---------------------------------------------------------- barycentre_projection

@pytest.mark.parametrize("n, dv", [(30, 16), (5, 2), (1, 4), (7, 1), (3, 50)])
def test_barycentre_projection_commutes(rng, n, dv):
    """The projected output is the same weighted mean of the projected values."""
    w = _softmax(rng.standard_normal(n) * 2)
    v = rng.standard_normal((n, dv)) * 3 + 5          # an offset: the map is affine, not linear
    pts, out2 = geometry.barycentre_projection(w, v)
    assert pts.shape == (n, 2) and out2.shape == (2,)
    np.testing.assert_allclose(out2, w @ pts, rtol=0, atol=1e-12)
    # the output of the kernel, projected the same way, is the same point
    out = fastattn.attention(np.zeros((1, 4)), np.zeros((n, 4)), v)[0]
    np.testing.assert_allclose(geometry.barycentre_projection(np.full(n, 1 / n), v)[1],
                               (out - v.mean(axis=0)) @ _pca_dirs(v).T, atol=1e-12)


def _pca_dirs(v):
    return geometry._pca2(np.asarray(v, dtype=np.float64))[1]


def test_barycentre_projection_is_pca(rng):
    """The plane is the values' first two principal directions: projected points are
    centred, uncorrelated, with variances the two largest of the values'."""
    v = rng.standard_normal((50, 6)) @ np.diag([5.0, 3.0, 1.0, 0.5, 0.2, 0.1])
    pts, _ = geometry.barycentre_projection(np.full(50, 1 / 50), v)
    np.testing.assert_allclose(pts.mean(axis=0), 0, atol=1e-12)
    cov = np.cov(pts.T)
    assert abs(cov[0, 1]) <= 1e-10 * cov[0, 0]
    top = np.sort(np.linalg.eigvalsh(np.cov(v.T)))[::-1][:2]
    np.testing.assert_allclose(np.diag(cov), top, rtol=1e-10)


def test_barycentre_projection_vertex_and_centre(rng):
    v = rng.standard_normal((12, 8))
    pts, out2 = geometry.barycentre_projection(np.eye(12)[4], v)
    np.testing.assert_allclose(out2, pts[4], atol=1e-12)            # a vertex: that value
    pts, out2 = geometry.barycentre_projection(np.full(12, 1 / 12), v)
    np.testing.assert_allclose(out2, 0.0, atol=1e-12)               # the centre: the mean


def test_barycentre_projection_errors(rng):
    w = np.full(4, 0.25)
    with pytest.raises(ValueError, match=r"v has 5 rows but weights_row has 4"):
        geometry.barycentre_projection(w, rng.standard_normal((5, 3)))
    with pytest.raises(ValueError, match="v must be 2-D"):
        geometry.barycentre_projection(w, rng.standard_normal(4))
    with pytest.raises(ValueError, match="v has shape"):
        geometry.barycentre_projection(w, np.zeros((4, 0)))
    with pytest.raises(ValueError, match="weights_row"):
        geometry.barycentre_projection(np.full((2, 2), 0.25), rng.standard_normal((4, 3)))


# ------------------------------------------------------------- entropies

def test_row_entropy_values():
    assert geometry.row_entropy(np.eye(5)[2]) == 0.0
    np.testing.assert_allclose(geometry.row_entropy(np.full((3, 7), 1 / 7)), math.log(7),
                               rtol=1e-15)
    assert geometry.row_entropy(np.zeros(4)) == 0.0                # a row that sees no key
    p = np.array([0.5, 0.25, 0.25])
    assert geometry.row_entropy(p) == pytest.approx(-(p * np.log(p)).sum(), rel=1e-15)
    with pytest.raises(ValueError, match="negative"):
        geometry.row_entropy(np.array([1.5, -0.5]))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [True, "top-left", False])
def test_entropy_profile_bounds(rng, dtype, causal):
    H, L, D = 3, 37, 16
    q = (rng.standard_normal((2, H, L, D)) * 2).astype(dtype)
    k = (rng.standard_normal((2, H, L, D)) * 2).astype(dtype)
    prof = geometry.entropy_profile(q, k, causal=causal)
    assert prof.entropy.shape == prof.n_visible.shape == (2, H, L)
    want = np.arange(1, L + 1) if causal else np.full(L, L)
    np.testing.assert_array_equal(prof.n_visible, np.broadcast_to(want, (2, H, L)))
    logn = np.log(prof.n_visible)
    assert (prof.entropy >= 0).all() and (prof.entropy <= logn).all()   # exact: clipped
    assert (prof.effective_support >= 1 - 1e-12).all()
    assert (prof.effective_support <= prof.n_visible * (1 + 1e-12)).all()
    assert (prof.max_weight >= 1 / prof.n_visible).all() and (prof.max_weight <= 1).all()
    np.testing.assert_allclose(prof.effective_support, np.exp(prof.entropy), rtol=1e-15)
    # against the definition, from the float64 oracle's weights
    w = fastattn.reference.attention_weights(q.astype(np.float64), k.astype(np.float64),
                                             causal=causal)
    with np.errstate(divide="ignore", invalid="ignore"):
        h_ref = -np.where(w > 0, w * np.log(w), 0.0).sum(axis=-1)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(prof.entropy, h_ref, atol=tol * math.log(L))
    if causal:
        assert (prof.entropy[..., 0] == 0).all()                    # row 0 sees one key


def test_entropy_profile_identical_keys_is_log_n(rng):
    q = rng.standard_normal((2, 10, 8))
    k = np.broadcast_to(rng.standard_normal(8), (2, 25, 8))
    prof = geometry.entropy_profile(q, k)
    np.testing.assert_allclose(prof.entropy, math.log(25), rtol=1e-13)
    np.testing.assert_allclose(prof.effective_support, 25, rtol=1e-12)
    # causal: each row at the centre of its own (smaller) simplex
    prof = geometry.entropy_profile(q, k, causal=True, scale=3.0)
    np.testing.assert_allclose(prof.entropy, np.log(np.arange(16, 26))[None].repeat(2, 0),
                               rtol=1e-13)


def test_entropy_profile_one_hot_row_is_near_zero(rng):
    """A query aligned with one key at large scale: the row is at a vertex."""
    k = rng.standard_normal((30, 16))
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    q = k[[3, 17]]
    prof = geometry.entropy_profile(q, k, scale=200.0)
    assert (prof.entropy < 1e-6).all()
    assert np.allclose(prof.max_weight, 1.0, atol=1e-6)
    np.testing.assert_allclose(prof.effective_support, 1.0, atol=1e-5)


def test_entropy_profile_masks_windows_gqa_layout(rng):
    B, Hq, Hkv, L, D = 2, 4, 2, 20, 8
    q = rng.standard_normal((B, Hq, L, D))
    k = rng.standard_normal((B, Hkv, L, D))
    mask = rng.random((B, 1, 1, L)) > 0.3
    mask[1] = False                                   # batch 1 sees no key at all
    bias = np.zeros((1, 1, L, L))
    bias[..., 5] = -np.inf                            # key 5 hidden by the bias
    prof = geometry.entropy_profile(q, k, causal=True, window=(4, 0), mask=mask, bias=bias,
                                    alibi_slopes=np.full(Hq, 0.3), softcap=20.0)
    w = fastattn.attention_weights(q, k, causal=True, window=(4, 0), mask=mask, bias=bias,
                                   alibi_slopes=np.full(Hq, 0.3), softcap=20.0)
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    vis = (j <= i) & (j >= i - 4) & (j != 5) & mask[:, :, 0, None, :]   # (B, 1, L, L)
    np.testing.assert_array_equal(prof.n_visible, np.broadcast_to(vis.sum(-1), (B, Hq, L)))
    np.testing.assert_allclose(prof.entropy, geometry.row_entropy(w), atol=1e-13)
    assert (prof.entropy[1] == 0).all() and (prof.effective_support[1] == 0).all()
    assert (prof.max_weight[1] == 0).all()
    # bshd gives the same profile in the (..., Hq, Lq) order
    prof2 = geometry.entropy_profile(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3),
                                     causal=True, window=(4, 0), mask=mask, bias=bias,
                                     alibi_slopes=np.full(Hq, 0.3), softcap=20.0, layout="bshd")
    np.testing.assert_allclose(prof2.entropy, prof.entropy, atol=1e-13)
    np.testing.assert_array_equal(prof2.n_visible, prof.n_visible)


def test_entropy_profile_source(rng, monkeypatch):
    q = rng.standard_normal((2, 6, 8))
    k = rng.standard_normal((2, 9, 8))
    with pytest.raises(ValueError, match="source"):
        geometry.entropy_profile(q, k, source="kernel")
    prof = geometry.entropy_profile(q, k, source="weights")
    assert prof.source == "weights"
    auto = geometry.entropy_profile(q, k)
    if geometry._has_stats():
        assert auto.source == "stats"
        np.testing.assert_allclose(auto.entropy, prof.entropy, atol=1e-10)
        np.testing.assert_allclose(auto.max_weight, prof.max_weight, atol=1e-10)
    else:
        assert auto.source == "weights"
        with pytest.raises(ValueError, match="return_stats"):
            geometry.entropy_profile(q, k, source="stats")
    # the stats path as the kernel will provide it (issue 17): (out, stats) with
    # per-row entropy and max_weight attributes
    calls = []

    class Stats:
        def __init__(self, w):
            self.entropy = geometry.row_entropy(w)
            self.max_weight = w.max(axis=-1)

    def attention(q, k, v, *, return_stats=False, **kw):
        calls.append(return_stats)
        if not return_stats:
            return fastattn._api.attention(q, k, v, **kw)
        return np.zeros(1), Stats(fastattn.attention_weights(q, k, **kw))

    monkeypatch.setattr(fastattn, "attention", attention)
    got = geometry.entropy_profile(q, k, source="stats")
    assert got.source == "stats" and True in calls
    np.testing.assert_allclose(got.entropy, prof.entropy, atol=1e-12)
    assert geometry.entropy_profile(q, k).source == "stats"


def test_entropy_profile_shape_errors_name_the_arguments(rng):
    with pytest.raises(ValueError, match=r"\bq\b.*\bk\b"):   # the real call's message
        geometry.entropy_profile(rng.standard_normal((2, 5, 8)), rng.standard_normal((2, 5, 4)))


# ------------------------------------------------------------------ the demo data

def test_demo_example_has_the_structure_the_figures_claim():
    ex = geometry.demo_example()
    w = fastattn.attention_weights(ex.q, ex.k, causal=True, alibi_slopes=ex.alibi_slopes)
    h, i = ex.rows["vertex"]
    assert w[h, i].max() > 0.99                                   # near a vertex
    h, i = ex.rows["face"]
    idx, vals, rest = geometry.simplex_coordinates(w[h, i, :i + 1], top_k=3)
    assert sorted(ex.words[j] for j in idx) == [ex.words[i]] * 3  # the three copies
    np.testing.assert_allclose(vals, 1 / 3, atol=0.01)
    h, i = ex.rows["centre"]
    assert math.exp(geometry.row_entropy(w[h, i])) > 0.95 * (i + 1)   # near the centre
    prof = geometry.entropy_profile(ex.q, ex.k, causal=True, alibi_slopes=ex.alibi_slopes)
    eff0 = prof.effective_support[0]                              # head 0: 1, 2, 3 copies
    np.testing.assert_allclose(eff0[:20], 1, atol=0.05)
    np.testing.assert_allclose(eff0[20:40], 2, atol=0.05)
    np.testing.assert_allclose(eff0[40:], 3, atol=0.05)


# ----------------------------------------------------------- drawing (matplotlib)

@pytest.fixture
def agg():
    mpl = pytest.importorskip("matplotlib")
    mpl.use("Agg")
    return mpl


def _is_png(path):
    with open(path, "rb") as f:
        head = f.read(8)
    return head == b"\x89PNG\r\n\x1a\n"


def test_demo_writes_pngs(agg, tmp_path, capsys):
    out = tmp_path / "figs"
    assert geometry.main(["--demo", "--out", str(out), "--dpi", "40"]) == 0
    printed = capsys.readouterr().out.split()
    names = ["simplex_coordinates.png", "barycentre.png", "entropy_profile.png"]
    assert printed == [str(out / n) for n in names]
    image = pytest.importorskip("matplotlib.image")
    for n in names:
        p = out / n
        assert p.stat().st_size > 1000 and _is_png(p)
        assert image.imread(str(p)).ndim == 3


def test_main_without_demo_says_what_to_do(capsys):
    assert geometry.main([]) == 2
    assert "--demo" in capsys.readouterr().err


def test_plot_functions_draw(agg, rng):
    from matplotlib.figure import Figure
    fig = Figure()
    ax1, ax2, ax3 = fig.subplots(1, 3)
    w = _softmax(rng.standard_normal(12) * 3)
    v = rng.standard_normal((12, 5))
    assert geometry.plot_simplex_coordinates(w, 4, ax=ax1, title="row") is ax1
    assert len(ax1.patches) == 5                                  # 4 keys + the rest
    assert geometry.plot_barycentre(w, v, ax=ax2, key_labels=list("abcdefghijkl")) is ax2
    prof = geometry.entropy_profile(rng.standard_normal((2, 12, 4)),
                                    rng.standard_normal((2, 12, 4)), causal=True)
    assert geometry.plot_entropy_profile(prof, ax=ax3, heads=[1]) is ax3
    with pytest.raises(ValueError, match="heads"):
        geometry.plot_entropy_profile(prof, ax=ax3, heads=[2])
    with pytest.raises(ValueError, match="key_labels"):
        geometry.plot_barycentre(w, v, ax=ax2, key_labels=["a"])
    with pytest.raises(ValueError, match="top_k"):
        geometry.plot_simplex_coordinates(w, 0, ax=ax1)


def test_missing_matplotlib_says_which_extra(monkeypatch):
    for name in ("matplotlib", "matplotlib.pyplot", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r"pip install fastattn\[plot\]"):
        geometry.plot_simplex_coordinates(np.full(4, 0.25))
    with pytest.raises(ImportError, match=r"fastattn\[plot\]"):
        geometry.write_demo_figures("unused")
