"""jaxpos.flax_attention_fn inside Flax's own attention modules: with no scheme it computes
what flax.nnx.dot_product_attention computes (masks, bias, is_causal, batch dims, grouped
heads, dtype); with a scheme, Flax's own decode=True cache gives the full pass's answer;
what it cannot honour it refuses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import jaxpos

B, T, N, H = 2, 5, 4, 8
D = 16  # model width of the module tests


def qkv(batch=(B,), Tq=T, Tk=T, Nq=N, Nk=N, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], batch + (Tq, Nq, H))
    k = jax.random.normal(ks[1], batch + (Tk, Nk, H))
    v = jax.random.normal(ks[2], batch + (Tk, Nk, H))
    return q, k, v


def padding_mask():
    """Flax's float padding mask [B, 1, T, T]: row 1 has two padded keys."""
    tokens = jnp.array([[1] * T, [1] * (T - 2) + [0] * 2])
    return nnx.make_attention_mask(tokens > 0, tokens > 0)


def flax_masks():
    causal = nnx.make_causal_mask(jnp.ones((B, T)))  # float32 [B, 1, T, T]
    bias = jax.random.normal(jax.random.key(7), (B, N, T, T))
    return {
        "none": {},
        "float causal mask": {"mask": causal},
        "bool padding mask": {"mask": padding_mask().astype(bool)},
        "combined float masks": {"mask": nnx.combine_masks(causal, padding_mask())},
        "bias": {"bias": bias},
        "bias [1, N, T, T]": {"bias": bias[:1]},
        "mask and bias": {"mask": causal, "bias": bias},
        "is_causal": {"is_causal": True},
        "is_causal and padding": {"is_causal": True, "mask": padding_mask()},
    }


@pytest.mark.parametrize("case", list(flax_masks()))
def test_no_scheme_equals_flax_dot_product_attention(case):
    kw = flax_masks()[case]
    q, k, v = qkv()
    got = jaxpos.flax_attention_fn()(q, k, v, **kw)
    want = nnx.dot_product_attention(q, k, v, **kw)
    assert got.dtype == want.dtype == jnp.float32
    assert_equal_where_a_key_is_visible(got, want, kw.get("mask"))


def assert_equal_where_a_key_is_visible(got, want, mask):
    """Equal on every query row that sees a key; zeros on a row that sees none (jaxpos's
    rule; Flax fills hidden scores with the dtype's minimum, so such a row averages all
    values). The padded query rows of make_attention_mask are such rows."""
    if mask is None:
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-6)
        return
    sees = np.broadcast_to(np.any(np.asarray(mask) != 0, axis=-1), (B, N, T))
    sees = np.swapaxes(sees, 1, 2)[..., None]  # [B, T, N, 1], like the outputs
    np.testing.assert_allclose(np.where(sees, got, 0.0), np.where(sees, want, 0.0), atol=2e-6,
                               rtol=2e-6)
    np.testing.assert_array_equal(np.where(sees, 0.0, got), 0.0)


@pytest.mark.parametrize("implementation", ["reference", "pallas", "xla"])
def test_every_implementation_takes_flax_masks_and_bias(implementation):
    kw = {"mask": padding_mask(), "bias": jax.random.normal(jax.random.key(7), (B, N, T, T)),
          "is_causal": True}
    q, k, v = qkv()
    got = jaxpos.flax_attention_fn(implementation=implementation)(q, k, v, **kw)
    assert_equal_where_a_key_is_visible(got, nnx.dot_product_attention(q, k, v, **kw),
                                        kw["mask"])


@pytest.mark.parametrize("batch", [(), (3, 2)], ids=["no batch dims", "two batch dims"])
def test_batch_dimensions_like_flax(batch):
    q, k, v = qkv(batch=batch)
    mask = jnp.tril(jnp.ones((T, T)))[None]  # [1, T, T], broadcast over batch and heads
    got = jaxpos.flax_attention_fn()(q, k, v, mask=mask)
    assert got.shape == batch + (T, N, H)
    np.testing.assert_allclose(got, nnx.dot_product_attention(q, k, v, mask=mask), atol=2e-6)


def test_grouped_query_heads_and_cross_lengths_like_flax():
    q, k, v = qkv(Tq=3, Tk=6, Nq=4, Nk=2)
    mask = jnp.ones((B, 1, 3, 6)).at[1, :, :, 4:].set(0.0)
    got = jaxpos.flax_attention_fn()(q, k, v, mask=mask)
    np.testing.assert_allclose(got, nnx.dot_product_attention(q, k, v, mask=mask), atol=2e-6)


def test_gradients_reach_query_key_value_and_bias_like_flax():
    q, k, v = qkv()
    bias = jax.random.normal(jax.random.key(7), (B, N, T, T))
    mask = nnx.make_causal_mask(jnp.ones((B, T)))
    fn = jaxpos.flax_attention_fn()

    def loss(attn):
        return lambda q, k, v, b: jnp.sum(jnp.sin(attn(q, k, v, bias=b, mask=mask)))

    got = jax.grad(loss(fn), argnums=(0, 1, 2, 3))(q, k, v, bias)
    want = jax.grad(loss(nnx.dot_product_attention), argnums=(0, 1, 2, 3))(q, k, v, bias)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)


def test_dtype_is_honoured():
    q, k, v = (x.astype(jnp.bfloat16) for x in qkv())
    fn = jaxpos.flax_attention_fn()
    assert fn(q, k, v).dtype == jnp.bfloat16  # default: the inputs' promoted dtype
    got = fn(q, k, v, dtype=jnp.float32)  # computed from the bf16 values cast to float32
    assert got.dtype == jnp.float32
    want = nnx.dot_product_attention(q, k, v, dtype=jnp.float32)
    np.testing.assert_allclose(got, want, atol=2e-6)


def test_precision_is_applied_or_refused():
    q, k, v = qkv()
    fn = jaxpos.flax_attention_fn()
    want = nnx.dot_product_attention(q, k, v)
    for precision in ("highest", jax.lax.Precision.HIGHEST, (jax.lax.Precision.HIGH,) * 2):
        np.testing.assert_allclose(fn(q, k, v, precision=precision), want, atol=2e-6)
    with pytest.raises(ValueError, match="one precision to both operands"):
        fn(q, k, v, precision=(jax.lax.Precision.HIGH, jax.lax.Precision.HIGHEST))


def test_mask_of_the_wrong_shape_is_refused_naming_it():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"mask must be broadcastable .* got shape \(2, 1, 5, 4\)"):
        jaxpos.flax_attention_fn()(q, k, v, mask=jnp.ones((B, 1, T, T - 1)))


def test_sow_weights_is_refused_in_nnx_and_linen():
    x = jax.random.normal(jax.random.key(1), (B, T, D))
    fn = jaxpos.flax_attention_fn()
    layer = nnx.MultiHeadAttention(num_heads=2, in_features=D, decode=False,
                                   rngs=nnx.Rngs(0), attention_fn=fn)
    with pytest.raises(ValueError, match="sow_weights"):
        layer(x, sow_weights=True)
    linen_layer = nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=fn)
    params = linen_layer.init(jax.random.key(0), x, x)
    with pytest.raises(ValueError, match="sow_weights"):
        linen_layer.apply(params, x, x, sow_weights=True)


def test_bad_factory_arguments_are_refused():
    with pytest.raises(ValueError, match="implementation"):
        jaxpos.flax_attention_fn(implementation="flash")
    with pytest.raises(TypeError, match="score_mod must be callable"):
        jaxpos.flax_attention_fn(score_mod=1.0)


def test_nnx_and_linen_modules_with_no_scheme_equal_their_default_attention():
    x = jax.random.normal(jax.random.key(1), (B, T, D))
    mask = nnx.make_causal_mask(jnp.ones((B, T)))
    fn = jaxpos.flax_attention_fn()
    ours = nnx.MultiHeadAttention(num_heads=2, in_features=D, decode=False, rngs=nnx.Rngs(0),
                                  attention_fn=fn)
    theirs = nnx.MultiHeadAttention(num_heads=2, in_features=D, decode=False, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(ours(x, mask=mask), theirs(x, mask=mask), atol=2e-6)

    ours_l = nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=fn)
    theirs_l = nn.MultiHeadDotProductAttention(num_heads=2)
    params = theirs_l.init(jax.random.key(0), x, x)
    np.testing.assert_allclose(ours_l.apply(params, x, x, mask=mask),
                               theirs_l.apply(params, x, x, mask=mask), atol=2e-6)


# ----------------------------------------------------------------------- decode=True
def schemes():
    return {
        "rope": jaxpos.RoPE(rotary_dim=8),
        "alibi": jaxpos.ALiBi(2),
        "t5": jaxpos.T5Bias(jax.random.normal(jax.random.key(2), (32, 2)), bidirectional=False),
    }


def nnx_full_and_decoded(attention_fn, x):
    layer = nnx.MultiHeadAttention(num_heads=2, in_features=D, decode=False, rngs=nnx.Rngs(0),
                                   attention_fn=attention_fn)
    full = nnx.jit(lambda m, x: m(x, mask=nnx.make_causal_mask(jnp.ones(x.shape[:2]))))(layer, x)
    layer.init_cache(x.shape)
    step = nnx.jit(lambda m, xt: m(xt, decode=True))
    decoded = jnp.concatenate([step(layer, x[:, t:t + 1]) for t in range(x.shape[1])], axis=1)
    return full, decoded


@pytest.mark.parametrize("name", ["rope", "alibi", "t5"])
def test_nnx_decode_cache_equals_the_full_pass(name):
    x = jax.random.normal(jax.random.key(1), (B, 6, D))
    full, decoded = nnx_full_and_decoded(jaxpos.flax_attention_fn(schemes()[name]), x)
    np.testing.assert_allclose(decoded, full, atol=2e-6)


def test_nnx_decode_with_a_score_mod_and_a_mask_mod_equals_the_full_pass():
    window = jaxpos.SlidingWindowMask(2)
    fn = jaxpos.flax_attention_fn(score_mod=lambda s, b, h, q, k: s - 0.3 * (q - k),
                                  mask_mod=window)
    x = jax.random.normal(jax.random.key(1), (B, 6, D))
    full, decoded = nnx_full_and_decoded(fn, x)
    np.testing.assert_allclose(decoded, full, atol=2e-6)


def test_flax_decode_without_the_adapter_positions_would_differ():
    # The control: the same RoPE with the query placed at the end of the cache (what a
    # function that ignores the decode mask sees) does not reproduce the full pass.
    rope = schemes()["rope"]

    def end_aligned(query, key, value, mask=None, **_):
        return jaxpos.attention(query, key, value, position=rope,
                                mask=None if mask is None else mask.astype(bool))

    x = jax.random.normal(jax.random.key(1), (B, 6, D))
    full, decoded = nnx_full_and_decoded(end_aligned, x)
    assert float(jnp.max(jnp.abs(decoded - full))) > 1e-2


@pytest.mark.parametrize("name", ["rope", pytest.param("t5", marks=pytest.mark.slow)])
def test_linen_decode_cache_equals_the_full_pass(name):
    x = jax.random.normal(jax.random.key(1), (B, 5, D))
    fn = jaxpos.flax_attention_fn(schemes()[name])
    full_layer = nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=fn)
    params = full_layer.init(jax.random.key(0), x, x)["params"]
    full = full_layer.apply({"params": params}, x, x, mask=nn.make_causal_mask(jnp.ones((B, 5))))
    dec_layer = nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=fn, decode=True)
    cache = dec_layer.init(jax.random.key(0), x, x)["cache"]

    @jax.jit
    def step(cache, xt):
        out, mutated = dec_layer.apply({"params": params, "cache": cache}, xt, xt,
                                       mutable=["cache"])
        return out, mutated["cache"]

    outs = []
    for t in range(5):
        out, cache = step(cache, x[:, t:t + 1])
        outs.append(out)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, atol=2e-6)


# ----------------------------------------------------------------------------- dropout
def one_hot_values(Tk=T):
    """q = 0 gives every key the weight 1/Tk; v = the one-hot key index then shows the
    dropout multiplier of every pair: output (i, j) * Tk = keep_ij / (1 - rate)."""
    q = jnp.zeros((B, T, N, H))
    k = jax.random.normal(jax.random.key(1), (B, Tk, N, H))
    v = jnp.broadcast_to(jnp.eye(Tk)[None, :, None, :], (B, Tk, N, Tk))
    return q, k, v


@pytest.mark.parametrize("broadcast", [True, False])
def test_dropout_has_flax_rate_scaling_and_broadcasting(broadcast):
    from jaxpos.core.dropout import Dropout, dropout_seed, keep_mask

    rate, key = 0.25, jax.random.key(3)
    q, k, v = one_hot_values()
    kw = dict(dropout_rate=rate, dropout_rng=key, broadcast_dropout=broadcast)
    ours = np.swapaxes(np.asarray(jaxpos.flax_attention_fn()(q, k, v, **kw)), 1, 2) * T
    flax = np.swapaxes(np.asarray(nnx.dot_product_attention(q, k, v, **kw)), 1, 2) * T
    for shown in (ours, flax):  # [B, N, Tq, Tk]: 0 or 1 / (1 - rate), as in Flax
        np.testing.assert_allclose(shown * (1 - rate), np.round(shown * (1 - rate)), atol=1e-5)
        kept = np.round(shown * (1 - rate))
        if broadcast:  # one [Tq, Tk] mask for every batch row and head
            assert np.array_equal(kept, np.broadcast_to(kept[:1, :1], kept.shape))
        n = kept[:1, :1].size if broadcast else kept.size
        keep_count = kept[:1, :1].sum() if broadcast else kept.sum()
        assert abs(keep_count - n * (1 - rate)) <= 5 * np.sqrt(n * rate * (1 - rate))
    # ours is jaxpos's counter-based mask (Flax's own bits come from jax.random.bernoulli)
    want = keep_mask(Dropout(rate, dropout_seed(key), broadcast), B, N, T, T)
    np.testing.assert_allclose(ours * (1 - rate), np.broadcast_to(want, ours.shape), atol=1e-5)


def test_dropout_off_when_deterministic_or_rate_zero_like_flax():
    q, k, v = qkv()
    fn = jaxpos.flax_attention_fn()
    want = nnx.dot_product_attention(q, k, v)
    np.testing.assert_allclose(fn(q, k, v, dropout_rate=0.5, deterministic=True), want,
                               atol=2e-6)
    np.testing.assert_allclose(fn(q, k, v, dropout_rate=0.0, dropout_rng=jax.random.key(0)),
                               want, atol=2e-6)


def test_nnx_and_linen_modules_train_with_dropout_and_evaluate_without():
    x = jax.random.normal(jax.random.key(1), (B, T, D))
    fn = jaxpos.flax_attention_fn(jaxpos.ALiBi(2))
    mask = nnx.make_causal_mask(jnp.ones((B, T)))
    layer = nnx.MultiHeadAttention(num_heads=2, in_features=D, decode=False, dropout_rate=0.3,
                                   rngs=nnx.Rngs(0, dropout=1), attention_fn=fn)
    no_drop = nnx.MultiHeadAttention(num_heads=2, in_features=D, decode=False,
                                     rngs=nnx.Rngs(0, dropout=1), attention_fn=fn)
    train_a = layer(x, mask=mask, deterministic=False)
    train_b = layer(x, mask=mask, deterministic=False)  # the stream advances: a new mask
    evaluated = layer(x, mask=mask, deterministic=True)
    np.testing.assert_allclose(evaluated, no_drop(x, mask=mask), atol=2e-6)
    assert float(jnp.max(jnp.abs(train_a - evaluated))) > 1e-2
    assert float(jnp.max(jnp.abs(train_a - train_b))) > 1e-2

    linen_layer = nn.MultiHeadDotProductAttention(num_heads=2, dropout_rate=0.3, attention_fn=fn)
    params = linen_layer.init(jax.random.key(0), x, x, deterministic=True)
    trained = linen_layer.apply(params, x, x, mask=mask, deterministic=False,
                                rngs={"dropout": jax.random.key(2)})
    evaluated = linen_layer.apply(params, x, x, mask=mask, deterministic=True)
    assert float(jnp.max(jnp.abs(trained - evaluated))) > 1e-2


def _np_ssmax(q, k, v, s, q_pos):
    """Causal SSMax (Nakanishi 2025, §3) in float64: scores ``q.k / sqrt(H) * s_h *
    log(q_pos + 1)``, keys at ``arange(Tk)`` after the query hidden. ``[B, Tq, N, H]``."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    sc = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(q.shape[-1])
    sc = sc * np.asarray(s, np.float64)[None, :, None, None] * np.log(q_pos + 1.0)[:, None]
    sc = np.where(np.arange(k.shape[1])[None, :] > q_pos[:, None], -np.inf, sc)
    w = np.exp(sc - sc.max(-1, keepdims=True))
    return np.einsum("bnqk,bknh->bqnh", w / w.sum(-1, keepdims=True), v)


def test_ssmax_under_flax_causal_mask_counts_q_pos_plus_one_keys():
    # Flax's make_causal_mask (no is_causal) and a decode=True step's cache mask are
    # causal, so SSMax counts n = q_pos + 1 keys instead of asking for num_keys.
    s = jnp.asarray([0.5, 1.5])
    fn = jaxpos.flax_attention_fn(jaxpos.SSMax(s))
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(kk, (2, 6, 2, 4)) for kk in ks)
    out = fn(q, k, v, mask=nnx.make_causal_mask(jnp.ones((2, 6))))
    np.testing.assert_allclose(out, _np_ssmax(q, k, v, s, np.arange(6)), rtol=1e-5,
                               atol=1e-5)
    # one query at cache index 3 over a cache of 6 slots (Flax: arange(6) <= 3)
    mask = (jnp.arange(6) <= 3)[None, None, None, :]
    out = fn(q[:, 3:4], k, v, mask=mask)
    np.testing.assert_allclose(out, _np_ssmax(q[:, 3:4], k, v, s, np.array([3])),
                               rtol=1e-5, atol=1e-5)
