"""fastattn.jax: jax.nn.dot_product_attention computed by fastattn through XLA's FFI.

Equality with jax.nn.dot_product_attention on every option both have; fastattn's own
options against fastattn.reference; jit, vmap and grad; gradients checked by
jax.test_util.check_grads in float64 and against the oracle's backward to 1e-10; a
two-layer transformer trained a few steps with both gives the same losses; errors.
Skipped without jax (or a fastattn built without its FFI handlers).
"""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
fj = pytest.importorskip("fastattn.jax")

from jax.test_util import check_grads  # noqa: E402

import fastattn  # noqa: E402
from fastattn import reference as R  # noqa: E402


@pytest.fixture
def x64():
    """float64 arrays for the duration of a test."""
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", before)


def _qkv(B=2, T=37, S=53, N=4, K=2, H=16, Hv=None, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, N, H)).astype(dtype)
    k = rng.standard_normal((B, S, K, H)).astype(dtype)
    v = rng.standard_normal((B, S, K, Hv or H)).astype(dtype)
    return q, k, v


def _close(a, b, tol):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.max(np.abs(a - b)) <= tol * max(np.max(np.abs(b)), 1e-30)


JAX_OPTIONS = [dict(), dict(is_causal=True), dict(local_window_size=(5, 3)),
               dict(local_window_size=6), dict(is_causal=True, local_window_size=(4, 0)),
               dict(scale=0.3), dict(bias=True), dict(mask=True), dict(bias=True, mask=True),
               dict(key_value_seq_lengths=True), dict(query_seq_lengths=True, is_causal=True)]


def _jax_args(opts, q, k, rng):
    B, T, N, _ = q.shape
    S = k.shape[1]
    kw = dict(opts)
    if kw.pop("bias", False):
        kw["bias"] = rng.standard_normal((1, N, T, S)).astype(np.float32)
    if kw.pop("mask", False):
        m = rng.random((B, 1, T, S)) > 0.3
        m[..., 0] = True  # every row sees a key (jax gives the mean where none is seen)
        kw["mask"] = m
    if kw.pop("key_value_seq_lengths", False):
        kw["key_value_seq_lengths"] = np.array([S] + [max(S - 9, 1)] * (B - 1), np.int32)
    if kw.pop("query_seq_lengths", False):
        kw["query_seq_lengths"] = np.array([max(T - 5, 0)] + [T] * (B - 1), np.int32)
    return kw


@pytest.mark.parametrize("opts", JAX_OPTIONS, ids=lambda o: "-".join(o) or "plain")
@pytest.mark.parametrize("shape", [(2, 37, 53, 4, 2, 16), (1, 1, 700, 8, 8, 64),
                                   (3, 64, 9, 2, 1, 7), (1, 130, 130, 6, 3, 32)])
def test_equals_jax(opts, shape):
    B, T, S, N, K, H = shape
    q, k, v = _qkv(B, T, S, N, K, H)
    kw = _jax_args(opts, q, k, np.random.default_rng(1))
    got = fj.dot_product_attention(q, k, v, **kw)
    want = jax.nn.dot_product_attention(q, k, v, **kw)
    if "local_window_size" in kw:
        # rows that see no key: 0 here, the values' mean in jax's (documented)
        w = kw["local_window_size"]
        left, right = (w, w) if isinstance(w, int) else w
        t, s = np.arange(T)[:, None], np.arange(S)[None, :]
        vis = (s >= t - left) & (s <= t + right) & ((s <= t) if kw.get("is_causal") else True)
        seen = vis.any(-1)[None, :, None, None]
        got, want = np.where(seen, got, 0), np.where(seen, want, 0)
    _close(got, want, 3e-6)


def test_unbatched_and_jit_and_vmap():
    q, k, v = _qkv(1, 20, 30, 4, 2, 16)
    one = fj.dot_product_attention(q[0], k[0], v[0], is_causal=True)
    assert one.shape == (20, 4, 16)
    _close(one, jax.nn.dot_product_attention(q[0], k[0], v[0], is_causal=True), 3e-6)
    f = jax.jit(lambda q, k, v: fj.dot_product_attention(q, k, v, is_causal=True))
    _close(f(q, k, v), jax.nn.dot_product_attention(q, k, v, is_causal=True), 3e-6)
    qs = np.stack([q, 2 * q, -q])
    # vmap over query only (k, v unbatched: shared, not copied) and over all three
    got = jax.vmap(lambda x: fj.dot_product_attention(x, k, v))(qs)
    got2 = jax.jit(jax.vmap(fj.dot_product_attention))(qs, np.stack([k] * 3), np.stack([v] * 3))
    for i in range(3):
        want = fj.dot_product_attention(qs[i], k, v)
        np.testing.assert_array_equal(got[i], want)
        np.testing.assert_array_equal(got2[i], want)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit(dtype):
    q, k, v = _qkv(2, 40, 60, 4, 2, 32)
    dt = jnp.dtype(dtype)
    q16, k16, v16 = (jnp.asarray(x, dt) for x in (q, k, v))
    got = fj.dot_product_attention(q16, k16, v16, is_causal=True)
    assert got.dtype == dt
    ref = R.attention(*(np.asarray(x, np.float64) for x in (q16, k16, v16)), causal="top-left",
                      layout="bshd")
    _close(got, ref, 1e-2)
    g = jax.grad(lambda q: fj.dot_product_attention(q, k16, v16, is_causal=True)
                 .astype(jnp.float32).sum())(q16)
    assert g.dtype == dt
    g32 = jax.grad(lambda q: fj.dot_product_attention(q, k, v, is_causal=True).sum())(
        np.asarray(q16, np.float32))
    _close(g, g32, 3e-2)


def test_fastattn_options_against_oracle():
    q, k, v = _qkv(2, 30, 50, 4, 2, 16, Hv=12)
    rng = np.random.default_rng(2)
    sinks = rng.standard_normal(4)
    slopes = np.linspace(0.1, 0.4, 4)
    seq = np.array([50, 33])
    got = fj.dot_product_attention(q, k, v, causal="bottom-right", window=(12, 0), softcap=5.0,
                                   alibi_slopes=slopes, sinks=sinks, seqlens_k=seq)
    want = fastattn.attention(q, k, v, causal=True, window=(12, 0), softcap=5.0,
                              alibi_slopes=slopes, sinks=sinks, seqlens_k=seq, layout="bshd")
    np.testing.assert_array_equal(np.asarray(got), want)  # the same kernel, the same bits
    for b in range(2):
        ref = R.attention(q[b:b + 1], k[b:b + 1, :seq[b]], v[b:b + 1, :seq[b]], causal=True,
                          window=(12, 0), softcap=5.0, alibi_slopes=slopes, sinks=sinks,
                          layout="bshd")
        _close(got[b:b + 1], ref, 3e-6)


def test_gradients_check_grads_and_oracle(x64):
    q, k, v = _qkv(2, 9, 11, 4, 2, 5, dtype=np.float64)
    rng = np.random.default_rng(3)
    bias = rng.standard_normal((1, 4, 9, 11))
    sinks = rng.standard_normal(4)

    def f(q, k, v, bias, sinks):
        return fj.dot_product_attention(q, k, v, bias, is_causal=True, sinks=sinks, softcap=4.0)
    check_grads(f, (q, k, v, bias, sinks), order=1, modes=("rev",), atol=1e-6, rtol=1e-6)
    out = f(q, k, v, bias, sinks)
    dout = rng.standard_normal(out.shape)
    grads = jax.vjp(f, q, k, v, bias, sinks)[1](dout)
    ro, rl = R.attention(q, k, v, bias=bias, causal="top-left", sinks=sinks, softcap=4.0,
                         layout="bshd", return_lse=True)
    want = R.attention_backward(dout, q, k, v, ro, rl, bias=bias, causal="top-left", sinks=sinks,
                                softcap=4.0, layout="bshd", return_dbias=True, return_dsinks=True)
    for g, w in zip(grads, want):
        _close(g, w, 1e-10)


def test_gradients_match_jax():
    q, k, v = _qkv(2, 33, 47, 4, 2, 16)
    rng = np.random.default_rng(4)
    bias = rng.standard_normal((2, 1, 33, 47)).astype(np.float32)
    kw = dict(is_causal=True, local_window_size=(10, 0), key_value_seq_lengths=np.array([47, 30],
                                                                                        np.int32))

    def loss(fn):
        return lambda q, k, v, b: (fn(q, k, v, b, **kw) ** 2).sum()
    g1 = jax.grad(loss(fj.dot_product_attention), argnums=(0, 1, 2, 3))(q, k, v, bias)
    g2 = jax.grad(loss(jax.nn.dot_product_attention), argnums=(0, 1, 2, 3))(q, k, v, bias)
    for a, b in zip(g1, g2):
        _close(a, b, 3e-5)


@pytest.mark.parametrize("bias_shape,mask_shape", [
    ((47,), (1, 1, 47)),            # jax's nn_test: a (1, 1, S) key mask with batched inputs
    ((33, 47), (33, 47)),           # (T, S): every batch's and head's
    ((4, 33, 47), (1, 33, 47)),     # (N, T, S) and (1, T, S)
    ((2, 4, 33, 47), (2, 1, 1, 47)),
])
def test_masks_and_biases_of_fewer_dims_broadcast_as_jaxs(bias_shape, mask_shape):
    """jax.nn.dot_product_attention gives masks and biases of fewer than 4 dims leading
    axes of 1 (right-aligned broadcasting): fastattn takes the same shapes, with the
    same output and gradients (the bias's summed back to its own shape).  jax's own
    nn_test (testDotProductAttentionBiasGradient) passes such a mask."""
    q, k, v = _qkv(2, 33, 47, 4, 2, 16)
    rng = np.random.default_rng(7)
    bias = rng.standard_normal(bias_shape).astype(np.float32)
    mask = rng.random(mask_shape) > 0.3
    mask[..., 0] = True  # every row sees a key (jax gives the mean where none is seen)

    def loss(fn):
        return lambda q, k, v, b: (fn(q, k, v, b, mask) ** 2).sum()
    _close(fj.dot_product_attention(q, k, v, bias, mask),
           jax.nn.dot_product_attention(q, k, v, bias, mask), 2e-6)
    g1 = jax.grad(loss(fj.dot_product_attention), argnums=(0, 1, 2, 3))(q, k, v, bias)
    g2 = jax.grad(loss(jax.nn.dot_product_attention), argnums=(0, 1, 2, 3))(q, k, v, bias)
    assert g1[3].shape == bias.shape
    for a, b in zip(g1, g2):
        _close(a, b, 3e-5)
    with pytest.raises(ValueError, match="at most 4 dims"):
        fj.dot_product_attention(q, k, v, mask=np.ones((1, 1, 1, 1, 33, 47), bool))
    with pytest.raises(ValueError, match="does not broadcast"):
        fj.dot_product_attention(q, k, v, mask=np.ones((5, 47), bool))


@pytest.mark.parametrize("use_vmap", [False, True])
def test_bias_gradient_with_a_shared_key_mask(use_vmap):
    """jax's testDotProductAttentionBiasGradient on fastattn: a (B, N, S, S) bias and a
    (1, 1, S) mask, batched or vmapped over the batch with the mask shared; the bias
    gradient for any batch size (cuDNN's implementation raises for B > 1, fastattn
    computes it)."""
    B, S, N, H = 3, 40, 4, 16
    rng = np.random.default_rng(2)
    x = rng.standard_normal((B, S, N, H)).astype(np.float32)
    bias = rng.standard_normal((B, N, S, S)).astype(np.float32)
    mask = np.ones((1, 1, S), bool)

    def grads(fn):
        def attention(x, bias, mask):
            return fn(x, x, x, bias=bias, mask=mask)
        f = jax.vmap(attention, in_axes=(0, 0, None)) if use_vmap else attention
        out, vjp = jax.vjp(f, x, bias, mask)
        return (out,) + tuple(vjp(x)[:2])
    for a, b in zip(grads(jax.jit(fj.dot_product_attention)), grads(jax.nn.dot_product_attention)):
        _close(a, b, 3e-5)


def test_two_layer_transformer_trains_the_same():
    """A two-layer transformer, a few SGD steps with each attention: the same losses."""
    rng = np.random.default_rng(5)
    V, E, N, L, B = 50, 32, 4, 24, 3
    H = E // N
    params0 = {"emb": rng.standard_normal((V, E)) * 0.1,
               "out": rng.standard_normal((E, V)) * 0.1}
    for i in range(2):
        params0[f"qkv{i}"] = rng.standard_normal((E, 3 * E)) * 0.1
        params0[f"o{i}"] = rng.standard_normal((E, E)) * 0.1
    params0 = {n: jnp.asarray(p, jnp.float32) for n, p in params0.items()}
    tokens = jnp.asarray(rng.integers(0, V, (B, L + 1)))

    def model(params, attn):
        x = params["emb"][tokens[:, :-1]]
        for i in range(2):
            qkv = (x @ params[f"qkv{i}"]).reshape(B, L, 3, N, H)
            a = attn(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True)
            x = x + a.reshape(B, L, E) @ params[f"o{i}"]
        logits = x @ params["out"]
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(B)[:, None], jnp.arange(L),
                                                     tokens[:, 1:]])

    losses = {}
    for name, attn in (("fastattn", fj.dot_product_attention),
                       ("jax", jax.nn.dot_product_attention)):
        params, seen = params0, []
        step = jax.jit(jax.value_and_grad(lambda p: model(p, attn)))
        for _ in range(5):
            loss, g = step(params)
            seen.append(float(loss))
            params = {n: params[n] - 0.5 * g[n] for n in params}
        losses[name] = seen
    np.testing.assert_allclose(losses["fastattn"], losses["jax"], rtol=1e-5)
    assert losses["jax"][-1] < losses["jax"][0]


def test_errors():
    q, k, v = _qkv(2, 5, 6, 4, 2, 8)
    f = fj.dot_product_attention
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        f(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2))
    with pytest.raises(TypeError, match="one dtype"):
        f(q, k.astype(np.float16), v)
    with pytest.raises(ValueError, match=r"key must be \(B, S, K, H\)"):
        f(q, k[:, :, :, :4], v)
    with pytest.raises(ValueError, match="mask of shape"):
        f(q, k, v, mask=np.ones((2, 1, 5, 7), bool))
    with pytest.raises(TypeError, match="mask must be a bool array"):
        f(q, k, v, mask=np.ones((2, 1, 5, 6)))
    with pytest.raises(ValueError, match="key_value_seq_lengths must be an integer array"):
        f(q, k, v, key_value_seq_lengths=np.array([1, 2, 3]))
    with pytest.raises(ValueError, match="does not combine with is_causal"):
        f(q, k, v, is_causal=True, causal="bottom-right")
    with pytest.raises(ValueError, match="sinks must be a float array of shape"):
        f(q, k, v, sinks=np.zeros(3))
    with pytest.raises(ValueError, match="implementation must be None"):
        f(q, k, v, implementation="pallas")
    with pytest.raises(ValueError, match="all be"):
        f(q[0, 0], k, v)
    _close(f(q, k, v, implementation="xla"), jax.nn.dot_product_attention(q, k, v), 0)


def test_no_copies_of_contiguous_inputs():
    """XLA hands the FFI handler its own buffers: under jit, the program has no copy of
    q, k or v before the custom call (the HLO has only the call and its operands)."""
    q, k, v = _qkv(1, 16, 16, 2, 2, 8)
    hlo = jax.jit(lambda q, k, v: fj.dot_product_attention(q, k, v)).lower(q, k, v).as_text()
    assert "fastattn_fwd" in hlo and "copy" not in hlo and "transpose" not in hlo
