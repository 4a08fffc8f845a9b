"""The guides in docs/: every ```python block runs, in order, in one namespace per
guide, and the results the text describes are checked here; every relative link of the
README and the guides points at a file that exists.

A guide whose framework is not installed is skipped (pytest.importorskip).  Blocks that
must not run are fenced ```bash, ```console or ```text in the guides.
"""
import pathlib
import re

import numpy as np
import pytest

import fastattn
from fastattn import reference

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# The guides this file runs, and the modules each one's examples need.
NEEDS = {
    "decoding.md": (),
    "torch.md": ("torch",),
    "transformers.md": ("torch", "transformers"),
    "jax.md": ("jax",),
    "dask.md": ("dask", "distributed"),
    "geometry.md": (),   # its model example (block 2) runs in tests/test_transformers.py
    "semantics.md": (),
    "architecture.md": (),
    "troubleshooting.md": (),
}


def _doc(name):
    path = DOCS / name
    if not path.exists():
        pytest.skip(f"docs/{name} is not beside tests/ (tests copied without the repository)")
    return path


def blocks(name):
    """The ```python blocks of docs/<name>, with the line each starts on."""
    text = _doc(name).read_text()
    return [(text.count("\n", 0, m.start()) + 2, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)]


def run_guide(name, only=None):
    """Run docs/<name>'s python blocks (those numbered in `only`, else all) in order in
    one namespace and return it."""
    for mod in NEEDS[name]:
        pytest.importorskip(mod)
    ns = {"__name__": "guide_" + name.replace(".", "_")}
    found = blocks(name)
    for line, code in (found if only is None else [found[i] for i in only]):
        exec(compile("\n" * (line - 1) + code, str(DOCS / name), "exec"), ns)
    return ns


def test_every_guide_is_listed():
    """A new guide with examples must be added to NEEDS (so that its blocks run)."""
    if not DOCS.exists():
        pytest.skip("docs/ is not beside tests/")
    have = {p.name for p in DOCS.glob("*.md") if "```python" in p.read_text()}
    assert have <= set(NEEDS), f"guides with examples that no test runs: {have - set(NEEDS)}"


def test_pages_without_examples():
    for name in ("semantics.md", "architecture.md", "troubleshooting.md"):
        assert blocks(name) == [], f"docs/{name} has python blocks: add a test that runs them"


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", ["README.md"] + [f"docs/{n}" for n in NEEDS])
def test_relative_links_exist(page):
    path = ROOT / page
    if not path.exists():
        pytest.skip(f"{page} is not beside tests/")
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    missing = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        dest = (path.parent / target.split("#")[0]).resolve()
        if not dest.exists():
            missing.append(target)
    assert not missing, f"{page}: links to files that do not exist: {missing}"


def test_guides_link_only_inside_docs():
    """The Sphinx site is built from docs/: a guide's link outside it would not resolve."""
    for name in NEEDS:
        text = _doc(name).read_text()
        outside = [t for t in LINK.findall(text)
                   if not re.match(r"[a-z]+:", t) and t.startswith("..")]
        assert not outside, f"docs/{name} links outside docs/: {outside}"


def test_decoding():
    ns = run_guide("decoding.md")
    # fastattn.KVCache: the prefill chunk and the last step against the oracle over the
    # cache's own keys and values
    cache = ns["cache"]
    assert cache.lengths.tolist() == [303, 123] and ns["o_step"].shape == (2, 8, 1, 64)
    for b in range(2):
        kb, vb = cache.keys(b)[None].astype(np.float64), cache.values(b)[None].astype(np.float64)
        want = reference.attention(ns["q_step"][b:b + 1].astype(np.float64), kb, vb, causal=True)
        np.testing.assert_allclose(ns["o_step"][b:b + 1], want, rtol=0, atol=1e-5)
    assert ns["prefill_rows"].shape == (2, 8, 120, 64) and ns["kv_bytes"] == cache.nbytes
    # the float16 cache: the last step equals the oracle over the views it read
    t = 3
    want = reference.attention(ns["q_t"].astype(np.float64), ns["k_cache"][:, :, :t + 1],
                               ns["v_cache"][:, :, :t + 1], causal=True)
    # (q_t was redrawn by the int8 loop: recompute the float16 step with it)
    got = fastattn.attention(ns["q_t"], ns["k_cache"][:, :, :t + 1], ns["v_cache"][:, :, :t + 1],
                             causal=True)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert ns["o_t"].shape == (1, 8, 1, 64) and ns["o_t"].dtype == np.float32
    # seqlens_k: each sequence alone on its own keys, and sequence 3 sees nothing
    ob, lens = ns["ob"], ns["lengths"]
    for b, n in enumerate(lens[:3]):
        alone = fastattn.attention(ns["qb"][b:b + 1], ns["kb"][b:b + 1, :, :n],
                                   ns["vb"][b:b + 1, :, :n], causal=True)
        np.testing.assert_array_equal(ob[b:b + 1], alone)
    assert np.all(ob[3] == 0) and np.all(ns["lse_b"][3] == -np.inf)
    # chunked prefill: the whole call's rows, bit for bit
    np.testing.assert_array_equal(ns["chunked"], ns["whole"])
    # int8: exact attention over the dequantized cache, and the cache holds 4 tokens
    np.testing.assert_array_equal(ns["o8"], ns["exact"])
    assert np.all(ns["kq"].scale[:, :, :4] > 0) and np.all(ns["kq"].scale[:, :, 4:] == 0)
    # paged: the bits of the same keys laid out contiguously
    np.testing.assert_array_equal(ns["paged"], ns["flat"])
    # merge over a split cache: the causal call over all the keys, to rounding
    np.testing.assert_allclose(ns["merged"], ns["whole"], rtol=0, atol=2e-6)
    _, whole_lse = fastattn.attention(ns["qp"], ns["kp"], ns["vp"], causal=True, return_lse=True)
    np.testing.assert_allclose(ns["merged_lse"], whole_lse, rtol=1e-6)


def test_torch(monkeypatch):
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F
    calls = []
    real = fastattn.attention_backward
    monkeypatch.setattr(fastattn, "attention_backward",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    ns = run_guide("torch.md")
    assert calls, "the routed backward did not run fastattn's attention_backward"
    q, k, v = (ns[n].detach() for n in "qkv")
    # the routed call is PyTorch's function's result, computed by fastattn
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(ns["out"].detach(), want, rtol=1e-5, atol=1e-5)
    assert ns["out2"].shape == (2, 8, 256, 64) and ns["lse"].shape == (2, 8, 256)
    assert ns["q"].grad is not None and ns["k"].grad.shape == (2, 2, 256, 64)
    # the compiled layer equals the same layer run eagerly
    x, wq, wk, wv = ns["x"], ns["wq"], ns["wk"], ns["wv"]
    eager = F.scaled_dot_product_attention(x @ wq, x @ wk, x @ wv, is_causal=True)
    torch.testing.assert_close(ns["compiled"], eager, rtol=1e-5, atol=1e-5)
    # the int8 cache: exact attention over the dequantized cache
    k8 = ns["k8"]
    deq = torch.from_numpy(fastattn.dequantize_kv(fastattn.QuantizedKV(k8.data.numpy(),
                                                                       k8.scale.numpy())))
    assert k8.data.dtype == torch.int8 and ns["step"].shape == (1, 8, 1, 64)
    assert not ns["step"].requires_grad
    qs = torch.zeros(1, 8, 1, 64)
    np.testing.assert_array_equal(fastattn.torch.attention(qs, k8, k8, causal=True).numpy(),
                                  fastattn.attention(qs.numpy(), deq.numpy(), deq.numpy(), causal=True))


def test_transformers():
    torch = pytest.importorskip("torch")
    ns = run_guide("transformers.md")
    assert ns["model"].config._attn_implementation == "fastattn"
    assert ns["logits"].shape == (2, 24, 128) and ns["tokens"].shape == (2, 32)
    torch.testing.assert_close(ns["logits"], ns["eager_logits"], rtol=1e-4, atol=1e-4)
    with torch.no_grad():   # greedy decoding gives the eager model's tokens
        eager_tokens = ns["eager"].generate(ns["ids"], attention_mask=torch.ones_like(ns["ids"]),
                                            max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(ns["tokens"], eager_tokens)
    assert ns["model"].config._attn_implementation == "fastattn"
    assert [i for i, _ in ns["st"].calls] == [0, 1]   # one call a layer, both recorded
    # fastattn.transformers.KVCache: 24 prompt tokens and 7 appended, two layers' caches
    assert ns["tokens_int8"].shape == (2, 32) and ns["held"][0] == 31 and ns["held"][1] > 0
    ent, sup = ns["entropy"], ns["support"]
    assert ent.shape == (2, 2, 4, 24) and sup.shape == (2, 4)
    # the last query sees all 24 keys: support between 1 and 24; the first sees one key
    assert np.all((sup >= 1) & (sup <= 24 + 1e-3)) and np.all(ent[..., 0] == 0)


def test_jax():
    pytest.importorskip("jax")
    pytest.importorskip("fastattn.jax", reason="fastattn was built without its XLA handlers")
    ns = run_guide("jax.md")
    # all-ones inputs: every output row is the value row (ones), and the gradients of
    # q and k are 0 (every logit of a row is equal); dv[s] sums the weights key s gets:
    # 4 query heads a K/V head x sum over the queries t >= s of 1 / (t + 1)
    np.testing.assert_allclose(np.asarray(ns["out"]), 1.0, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(ns["dq"]), 0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ns["dk"]), 0, atol=1e-5)
    t = np.arange(512)
    per_key = np.array([np.sum(1.0 / (t[s:] + 1)) for s in range(512)])
    np.testing.assert_allclose(np.asarray(ns["dv"])[0, :, 0, 0], 4 * per_key, rtol=1e-4)
    outs, qs, kv = (np.asarray(ns[n], np.float64) for n in ("outs", "qs", "kv"))
    assert outs.shape == (3, 2, 64, 8, 32)
    kv_heads = np.repeat(kv, 4, axis=2).transpose(0, 2, 1, 3)      # (B, N, S, H)
    for i in range(3):
        want = reference.attention(qs[i].transpose(0, 2, 1, 3), kv_heads, kv_heads, causal=True)
        np.testing.assert_allclose(outs[i], want.transpose(0, 2, 1, 3), rtol=0, atol=2e-5)


def test_dask():
    ns = run_guide("dask.md")
    qn, kn, vn = ns["qn"], ns["kn"], ns["vn"]
    whole, whole_lse = fastattn.attention(qn, kn, vn, causal=True, return_lse=True)
    # two key chunks: the whole call to rounding
    np.testing.assert_allclose(ns["out_np"], whole, rtol=0, atol=2e-6)
    np.testing.assert_allclose(ns["lse_np"], whole_lse, rtol=1e-6)
    # the cluster's rows are the threaded scheduler's, bit for bit
    np.testing.assert_array_equal(ns["rows"], ns["out_np"][0, :, -4:])
    # causal over 4 query chunks x 2 key chunks: query chunks 0 and 1 (rows < 512) see
    # only key chunk 0, so the graph has 6 blocks, not 8
    blocks = [key for key in dict(ns["out"].__dask_graph__())
              if isinstance(key, tuple) and key[0].startswith("fastattn-block-")]
    assert len(blocks) == 6


def test_geometry():
    found = blocks("geometry.md")
    # block 2 (a gpt-oss model's per-layer statistics) is run, and its printed output
    # compared with the page, by tests/test_transformers.py::test_geometry_doc_example
    assert len(found) == 2 and "import transformers" in found[1][1]
    ns = run_guide("geometry.md", only=[0])
    prof, row = ns["prof"], ns["row"]
    assert prof.entropy.shape == (4, 256)
    # causal: row i sees i + 1 keys, so 1 <= exp(H) <= i + 1
    assert np.all(prof.n_visible[0] == np.arange(1, 257))
    assert np.all(prof.effective_support >= 1 - 1e-9)
    assert np.all(prof.effective_support <= prof.n_visible + 1e-9)
    np.testing.assert_allclose(prof.effective_support, np.exp(prof.entropy), rtol=1e-12)
    coords, rest = ns["coords"], ns["rest"]
    assert len(ns["keys"]) == 5 and np.all(np.diff(coords) <= 0)
    np.testing.assert_allclose(coords.sum() + rest, 1.0, rtol=0, atol=1e-12)
    np.testing.assert_allclose(ns["output_2d"], row @ ns["points_2d"], rtol=0, atol=1e-12)
    # key mass: each head's masses sum to its rows (all 256 see a key)
    np.testing.assert_allclose(ns["mass"].sum(axis=-1), 256, rtol=1e-9)
