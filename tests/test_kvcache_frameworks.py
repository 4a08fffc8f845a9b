"""fastattn.KVCache from PyTorch (tensors in place) and as a transformers Cache
(fastattn.transformers.KVCache in generate()): float32 gives the greedy tokens of a
DynamicCache run; int8 and int4 those of eager attention over the dequantized cache."""
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
fat = pytest.importorskip("fastattn.transformers")

import fastattn  # noqa: E402
import fastattn.torch  # noqa: E402
from fastattn import reference  # noqa: E402


def test_torch_tensors_in_place():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 2, 50, 32, generator=g), torch.randn(2, 2, 50, 32, generator=g)
    for dtype in ("float32", "int8"):
        c = fastattn.KVCache(2, 2, 32, 64, dtype=dtype)
        c.append(k, v, lengths=[50, 31])
        q = torch.randn(2, 4, 1, 32, generator=g)
        out = fastattn.torch.attention(q, c, causal=True)
        assert isinstance(out, torch.Tensor) and out.shape == (2, 4, 1, 32)
        for b, L in ((0, 50), (1, 31)):
            ref = reference.attention(q[b:b + 1].numpy().astype(np.float64),
                                      c.keys(b)[None].astype(np.float64), c.values(b)[None].astype(np.float64))
            assert np.abs(out[b:b + 1].numpy() - ref).max() < 1e-5
    bf = fastattn.KVCache(1, 2, 32, 64, dtype="bfloat16")
    bf.append(k[:1].bfloat16(), v[:1].bfloat16())
    np.testing.assert_array_equal(bf.keys(0), k[0].bfloat16().float().numpy())
    out = fastattn.torch.attention(torch.randn(1, 2, 1, 32, generator=g).bfloat16(), bf)
    assert out.dtype == torch.bfloat16


def _model(seed=0, layers=2, heads=4, kv_heads=2, hidden=64):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=heads,
                                   num_key_value_heads=kv_heads, max_position_embeddings=512)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def _generate(model, ids, cache, n=24, mask=None):
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        return model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=n,
                              do_sample=False, pad_token_id=0)


class _Dequantized(fat._CacheLayer):
    """A reference layer: the same fastattn.KVCache, its update returning the keys and
    values it holds (dequantized, as real tensors) for eager attention."""

    def update(self, key_states, value_states, *args, **kwargs):
        super().update(key_states, value_states)
        ks = [torch.from_numpy(self.cache.keys(b)) for b in range(self.cache.batch)]
        vs = [torch.from_numpy(self.cache.values(b)) for b in range(self.cache.batch)]
        return torch.stack(ks), torch.stack(vs)


class _DequantizedCache(transformers.cache_utils.Cache):
    def __init__(self, capacity, dtype):
        super().__init__(layer_class_to_replicate=lambda: _Dequantized(capacity, dtype, None))


def test_generate_float32_equals_dynamic_cache():
    fat.register()
    model = _model()
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    ref = _generate(model, ids, transformers.DynamicCache())
    model.config._attn_implementation = "fastattn"
    cache = fat.KVCache(capacity=128)
    out = _generate(model, ids, cache)
    assert torch.equal(out, ref)
    assert cache.get_seq_length() == 40 + 24 - 1 and cache.nbytes > 0
    assert all(isinstance(layer.cache, fastattn.KVCache) for layer in cache.layers)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_generate_quantized_equals_eager_over_the_dequantized_cache(dtype):
    fat.register()
    model = _model(seed=2)
    ids = torch.randint(1, 128, (2, 70), generator=torch.Generator().manual_seed(3))
    model.config._attn_implementation = "eager"
    ref = _generate(model, ids, _DequantizedCache(160, dtype))
    model.config._attn_implementation = "fastattn"
    out = _generate(model, ids, fat.KVCache(capacity=160, dtype=dtype))
    assert torch.equal(out, ref)


def test_generate_with_left_padding():
    """Two prompts of different lengths, left-padded: the padding mask covers the
    cached keys; tokens equal the DynamicCache run's."""
    fat.register()
    model = _model(seed=4)
    ids = torch.randint(1, 128, (2, 30), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, :9] = 0
    ids[1, :9] = 0
    ref = _generate(model, ids, transformers.DynamicCache(), mask=mask)
    model.config._attn_implementation = "fastattn"
    out = _generate(model, ids, fat.KVCache(capacity=64), mask=mask)
    assert torch.equal(out, ref)


def test_cache_errors():
    with pytest.raises(ValueError, match="capacity must be an int >= 1"):
        fat.KVCache(capacity=0)
    with pytest.raises(ValueError, match="dtype must be one of"):
        fat.KVCache(capacity=8, dtype="int3")
    fat.register()
    model = _model()
    model.config._attn_implementation = "fastattn"
    cache = fat.KVCache(capacity=16)
    ids = torch.randint(1, 128, (1, 10))
    with pytest.raises(ValueError, match="would pass its capacity 16"):
        _generate(model, ids, cache, n=10)
    cache = fat.KVCache(capacity=64)
    with pytest.raises(ValueError, match="for inference"):
        model(ids, past_key_values=cache).logits.sum().backward()
