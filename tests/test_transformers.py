"""fastattn as transformers' ``attn_implementation="fastattn"`` (fastattn.transformers).

Small models built from configs with random weights (no download): Llama, Qwen2 (a
sliding-window layer), Qwen3, Mistral (sliding window), Gemma 2 (softcap and
sliding windows), gpt-oss (sinks and sliding windows), GPT-2 and BERT (an encoder).
For each: logits equal to "eager" with and without (left) padding, greedy
generate() gives eager's tokens with dynamic and static caches, and a training step's
gradients match.  Skipped without transformers.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
fat = pytest.importorskip("fastattn.transformers")

import fastattn  # noqa: E402

C = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def _configs():
    t = transformers
    return {
        "llama": (t.LlamaForCausalLM, t.LlamaConfig(**C)),
        "qwen2": (t.Qwen2ForCausalLM, t.Qwen2Config(**C, use_sliding_window=True, sliding_window=4,
                                                     max_window_layers=1)),
        "qwen3": (t.Qwen3ForCausalLM, t.Qwen3Config(**C, head_dim=16)),
        "mistral": (t.MistralForCausalLM, t.MistralConfig(**C, sliding_window=4)),
        "gemma2": (t.Gemma2ForCausalLM, t.Gemma2Config(**C, head_dim=16, query_pre_attn_scalar=16,
                                                       sliding_window=4, attn_logit_softcapping=5.0)),
        "gpt_oss": (t.GptOssForCausalLM, t.GptOssConfig(**C, head_dim=16, num_local_experts=4,
                                                         num_experts_per_tok=2, sliding_window=4)),
        "gpt2": (t.GPT2LMHeadModel, t.GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4,
                                                 n_positions=128, bos_token_id=1, eos_token_id=2)),
        "bert": (t.BertModel, t.BertConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, intermediate_size=96,
                                           max_position_embeddings=128)),
    }


MODELS = list(_configs())
DECODERS = [m for m in MODELS if m != "bert"]


def _model(name, impl="eager"):
    cls, cfg = _configs()[name]
    torch.manual_seed(0)
    m = cls._from_config(cfg, attn_implementation=impl, dtype=torch.float32).eval()
    if name == "gpt_oss":  # the sinks are initialized to zero: make them matter
        with torch.no_grad():
            for layer in m.model.layers:
                layer.self_attn.sinks.normal_(0, 2)
    return m


def _inputs(B=2, L=11):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 96, (B, L), generator=g)
    pad = torch.ones(B, L, dtype=torch.long)
    if B > 1:
        pad[1, :3] = 0  # left padding, as for batched generation
    return ids, pad


def _out(o):
    return o.logits if hasattr(o, "logits") else o.last_hidden_state


def _both(m, fn):
    res = {}
    for impl in ("eager", "fastattn"):
        m.set_attn_implementation(impl)
        res[impl] = fn()
    return res["eager"], res["fastattn"]


@pytest.mark.parametrize("name", MODELS)
def test_logits_equal_eager(name):
    m = _model(name)
    ids, pad = _inputs()
    with torch.no_grad():
        e, f = _both(m, lambda: (_out(m(ids)), _out(m(ids, attention_mask=pad))))
    scale = e[0].abs().max().item()
    assert (e[0] - f[0]).abs().max().item() <= 1e-5 * scale
    tok = pad.bool()  # padded positions' outputs are garbage in both: not compared
    assert (e[1] - f[1])[tok].abs().max().item() <= 1e-5 * scale
    assert not torch.isnan(f[1]).any()  # rows that see no key give 0, not NaN


@pytest.mark.parametrize("name", ["mistral", "gemma2", "gpt_oss"])
def test_window_bites(name):
    """Longer than the sliding window (4) and than one key chunk: the window and sinks
    are what fastattn computes, not a mask."""
    m = _model(name)
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        e, f = _both(m, lambda: _out(m(ids)))
    assert (e - f).abs().max().item() <= 1e-5 * e.abs().max().item()


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", DECODERS)
def test_generate_same_tokens(name, cache):
    m = _model(name)
    ids, pad = _inputs()
    kw = dict(attention_mask=pad, max_new_tokens=6, do_sample=False)
    if cache == "static":
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        e, f = _both(m, lambda: m.generate(ids, **kw))
    assert torch.equal(e, f)


@pytest.mark.parametrize("name", MODELS)
def test_training_step_gradients(name):
    m = _model(name)
    m.train()
    for mod in m.modules():  # dropout off: the draws are the library's own
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    ids, pad = _inputs()

    def grads():
        m.zero_grad()
        out = _out(m(ids, attention_mask=pad))
        (out * pad[..., None]).square().mean().backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    e, f = _both(m, grads)
    assert e.keys() == f.keys() and e
    if name == "gpt_oss":
        assert any("sinks" in n for n in f)  # the sinks get their gradient
    for n in e:
        scale = e[n].abs().max().item()
        assert (e[n] - f[n]).abs().max().item() <= 1e-4 * scale + 1e-6, n


def test_compact_masks():
    """Causal, sliding-window and padding masks reach the attention function as
    AttentionMask (no Lq x Lk memory: a broadcast view); right padding as lengths."""
    seen = []
    real = fat.attention_forward

    def spy(module, q, k, v, mask, **kw):
        seen.append(mask)
        return real(module, q, k, v, mask, **kw)
    transformers.AttentionInterface.register("fastattn", spy)
    try:
        m = _model("mistral", "fastattn")
        ids, pad = _inputs()
        right = torch.ones_like(pad)
        right[1, -3:] = 0
        with torch.no_grad():
            m(ids)
            m(ids, attention_mask=pad)
            m(ids, attention_mask=right)
    finally:
        fat.register()
    assert len(seen) == 6 and all(isinstance(x, fat.AttentionMask) for x in seen)
    assert all(x.causal and x.window == 4 for x in seen)
    assert all(0 in x.stride() for x in seen)  # broadcast, not materialized
    assert seen[0].keys is None and seen[0].lengths is None
    assert seen[2].keys is not None and seen[4].lengths.tolist() == [11, 8]


def test_custom_mask_function_takes_the_general_path():
    """A mask function fastattn has no keyword for (an `and_mask_function` overlay)
    arrives as the dense mask of transformers' SDPA backend, and is applied as it is."""
    ids, _ = _inputs()
    cfg = transformers.LlamaConfig(**C)
    m = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="fastattn").eval()
    from transformers.masking_utils import create_causal_mask

    def even_keys(b, h, q, kv):
        return kv % 2 == 0
    emb = m.model.embed_tokens(ids)
    pos = torch.arange(ids.shape[1])[None]
    mask = create_causal_mask(config=m.config, inputs_embeds=emb, attention_mask=None, cache=None,
                              position_ids=pos, and_mask_function=even_keys)
    assert type(mask) is torch.Tensor and mask.dtype == torch.bool
    want = (torch.arange(11)[None, :] <= torch.arange(11)[:, None]) & (torch.arange(11) % 2 == 0)
    assert torch.equal(mask[0, 0], want)


@pytest.mark.parametrize("name", ["llama", "mistral"])  # (gpt-oss' masks take no position_ids)
def test_packed_sequences_match_separate_ones(name):
    """Packed sequences (position_ids restart, no cache): transformers' packing mask
    reaches fastattn as segments (varlen_attention, no L x L mask) and gives what the
    sequences give alone; with gradients, through the dense mask."""
    seen = []
    real = fat.attention_forward

    def spy(module, q, k, v, mask, **kw):
        seen.append(mask)
        return real(module, q, k, v, mask, **kw)
    m = _model(name, "fastattn")
    ids, _ = _inputs(2, 12)
    pos = torch.cat([torch.arange(5), torch.arange(7)])[None].expand(2, -1)
    transformers.AttentionInterface.register("fastattn", spy)
    try:
        with torch.no_grad():
            packed = m(ids, position_ids=pos, use_cache=False).logits  # (a cache turns packing off)
    finally:
        fat.register()
    assert isinstance(seen[0], fat.AttentionMask) and seen[0].segments is not None
    with torch.no_grad():
        apart = torch.cat([m(ids[:, :5]).logits, m(ids[:, 5:]).logits], 1)
    assert (packed - apart).abs().max().item() <= 1e-5 * apart.abs().max().item()
    m.train()
    packed_grad = m(ids, position_ids=pos, use_cache=False).logits
    assert (packed_grad - apart).abs().max().item() <= 1e-5 * apart.abs().max().item()


def test_from_config_and_from_pretrained(tmp_path):
    cfg = transformers.LlamaConfig(**C)
    m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="fastattn")
    assert m.config._attn_implementation == "fastattn"
    m.save_pretrained(tmp_path)
    m2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="fastattn")
    assert m2.config._attn_implementation == "fastattn"
    ids, _ = _inputs()
    with torch.no_grad():
        assert torch.allclose(m.eval()(ids).logits, m2.eval()(ids).logits)


def test_bfloat16_model_matches_float32():
    m = _model("llama", "fastattn")
    ids, pad = _inputs()
    with torch.no_grad():
        f32 = m(ids, attention_mask=pad).logits
        b16 = m.to(torch.bfloat16)(ids, attention_mask=pad).logits
    assert b16.dtype == torch.bfloat16
    err = (b16.float() - f32)[pad.bool()].abs().max().item()
    assert err <= 0.05 * f32.abs().max().item()


def test_profiler_labels_every_call():
    m = _model("llama", "fastattn")
    ids, _ = _inputs()
    with torch.profiler.profile() as prof:
        with torch.no_grad():
            m(ids)  # inference: the direct calls
        m.train()
        m(ids).logits.sum().backward()  # training: the ops, forward and backward
    names = [e.name for e in prof.events()]
    assert names.count("fastattn::attention_fwd") >= 4
    assert names.count("fastattn::attention_bwd") >= 2


def test_attention_stats_per_layer():
    m = _model("gpt_oss", "fastattn")
    ids, _ = _inputs(1, 9)
    with fat.attention_stats() as st, torch.no_grad():
        m(ids)
    assert st.layers == [0, 1]
    H, S, X = st.entropy, st.effective_support, st.max_weight
    assert H.shape == S.shape == X.shape == (2, 1, 4, 9)
    np.testing.assert_allclose(S, np.exp(H), rtol=1e-6)
    assert np.all((X > 0) & (X <= 1)) and np.all(H >= -1e-6)
    # generate: the prefill's rows and then one row per step, per layer
    with fat.attention_stats() as st2, torch.no_grad():
        m.generate(ids, max_new_tokens=3, do_sample=False)
    assert st2.entropy.shape == (2, 1, 4, 9 + 2)
    # training calls record too (one more pass without gradients)
    m.train()
    with fat.attention_stats() as st3:
        m(ids)
    np.testing.assert_allclose(st3.entropy, H, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="no attention call was recorded"):
        with fat.attention_stats() as st4:
            pass
        st4.entropy


def test_register_rejects_names_transformers_reads_otherwise():
    with pytest.raises(ValueError, match="'flash' or '/'"):
        fat.register("myflash")


def test_attention_mask_object_is_a_tensor_view():
    am = fat.attention_mask(2, 5, 7, q_offset=2, kv_offset=0,
                            attention_mask=torch.tensor([[1] * 7, [0, 0] + [1] * 5]))
    assert isinstance(am, fat.AttentionMask) and am.shape == (2, 1, 5, 7)
    assert am.contiguous() is am  # generate() makes prepared masks contiguous
    plain = am & True
    assert type(plain) is torch.Tensor  # other operations give plain tensors
    assert "causal=True" in repr(am) and "padding=keys" in repr(am)
    assert fastattn.attention is not None


def test_geometry_doc_example(capsys):
    """docs/geometry.md's per-layer statistics example runs as written."""
    import pathlib
    doc = pathlib.Path(__file__).resolve().parent.parent / "docs" / "geometry.md"
    if not doc.exists():
        pytest.skip("docs/geometry.md is not beside tests/ (tests copied without the repository)")
    text = doc.read_text()
    start = text.index("```python\n", text.index("### Every layer and head of a model")) + 10
    code = text[start:text.index("```", start)]
    exec(compile(code, str(doc), "exec"), {"__name__": "geometry_example"})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "[0, 1, 2, 3] (4, 1, 8, 2048)" and len(lines) == 5
    after = text.index("prints (", start + len(code))
    printed = text[text.index("```\n", after) + 4:]
    assert printed.startswith(lines[0] + "\n")


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_decode_reads_the_cache_in_place(monkeypatch, cache):
    """Each generate() step's attention is one fastattn call on the cache's own tensors
    (no copy of K/V), with the step's positions, without an L x L mask."""
    calls = []
    real = fastattn.torch.attention
    m = _model("llama", "fastattn")
    past = transformers.StaticCache(config=m.config, max_cache_len=20) if cache == "static" \
        else transformers.DynamicCache(config=m.config)

    def spy(q, k, v, **kw):  # the cache's tensors at the time of the call
        held = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in past.layers
                if layer.keys is not None]
        calls.append((q.shape[-2], k, (k.data_ptr(), v.data_ptr()) in held, kw))
        return real(q, k, v, **kw)
    monkeypatch.setattr(fastattn.torch, "attention", spy)
    ids, _ = _inputs(1, 9)
    with torch.no_grad():
        m.generate(ids, max_new_tokens=4, do_sample=False, cache=past)
    steps = [c for c in calls if c[0] == 1]
    assert len(steps) == 3 * 2  # 3 decode steps x 2 layers
    for _, _, in_cache, args in steps:
        assert in_cache
        assert args.get("mask") is None and args.get("causal") is True and "q_offset" in args
    if cache == "static":
        assert all(k.shape[-2] == 20 for _, k, _, _ in steps)  # unfilled slots hidden by position
