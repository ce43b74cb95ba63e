"""Dropout in jaxpos's Flax modules (dropout_rate, attention_dropout_rate): attention
dropout is jaxpos.attention's (the same mask for the same key), residual dropout has its
rate and 1 / (1 - rate) scaling, Flax's conventions hold (NNX: train()/eval(), the call's
deterministic and rngs; Linen: deterministic and make_rng("dropout")), the NNX and Linen
twins agree without dropout, decoding never drops, and a training step runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxpos
from jaxpos import linen as jl
from jaxpos import nnx as jn

B, T, D, N = 2, 6, 16, 2


def x_input():
    return jax.random.normal(jax.random.key(1), (B, T, D))


def test_attention_dropout_is_jaxpos_attention_with_the_stream_key():
    layer = jn.MultiHeadAttention(D, N, position="alibi", causal=True, dropout_rate=0.4,
                                  rngs=nnx.Rngs(0, dropout=3))
    x = x_input()
    got = layer(x, rngs=nnx.Rngs(dropout=7))
    # by hand: the projections, jaxpos.attention with the key the stream gives, o_proj
    key = nnx.Rngs(dropout=7).dropout()
    heads = lambda p, n: (x @ p.kernel[...]).reshape(B, T, n, D // N)
    o = jaxpos.attention(heads(layer.q_proj, N), heads(layer.k_proj, N),
                         heads(layer.v_proj, N), position=jaxpos.ALiBi(N), causal=True,
                         dropout_rate=0.4, dropout_rng=key)
    want = o.reshape(B, T, D) @ layer.o_proj.kernel[...]
    np.testing.assert_allclose(got, want, atol=2e-6)
    no_drop = layer(x, deterministic=True)
    assert float(jnp.max(jnp.abs(got - no_drop))) > 1e-2


def test_residual_dropout_rate_and_scaling():
    """A block whose MLP output is zero and without attention dropout: ``y - x`` is the
    attention branch dropped at the block's rate, each element 0 or ``a / (1 - rate)``."""
    rate = 0.3
    block = jn.TransformerBlock(D, N, causal=True, dropout_rate=rate, attention_dropout_rate=0.0,
                                rngs=nnx.Rngs(0))
    block.mlp_out.kernel[...] = jnp.zeros_like(block.mlp_out.kernel[...])
    x = jax.random.normal(jax.random.key(1), (8, 16, D))
    a = block(x, deterministic=True) - x  # the undropped attention branch
    y = block(x) - x  # training mode (deterministic=False at construction)
    kept = np.isclose(np.asarray(y), np.asarray(a) / (1 - rate), atol=1e-5)
    dropped = np.asarray(y) == 0
    assert np.all(kept | dropped)
    n = y.size  # 2048 elements: the kept fraction within 5 binomial standard deviations
    assert abs(kept.sum() - n * (1 - rate)) <= 5 * np.sqrt(n * rate * (1 - rate))


def test_nnx_train_eval_deterministic_and_rngs_conventions():
    model = jn.DecoderLM(50, d_model=D, num_layers=1, num_heads=N, position="rope",
                         dropout_rate=0.2, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(0), (B, T), 0, 50)
    a, b = model(tokens), model(tokens)  # the streams advance: two masks
    assert float(jnp.max(jnp.abs(a - b))) > 1e-2
    c = model(tokens, rngs=nnx.Rngs(dropout=5))
    np.testing.assert_array_equal(c, model(tokens, rngs=nnx.Rngs(dropout=5)))
    model.eval()
    evaluated = model(tokens)
    np.testing.assert_array_equal(evaluated, model(tokens))
    model.train()
    np.testing.assert_array_equal(model(tokens, deterministic=True), evaluated)
    # evaluation equals the same weights without dropout
    plain = jn.DecoderLM(50, d_model=D, num_layers=1, num_heads=N, position="rope",
                         rngs=nnx.Rngs(1))
    nnx.update(plain, nnx.state(model, nnx.Param))
    np.testing.assert_allclose(plain(tokens), evaluated, atol=1e-5)


def test_linen_twin_conventions_and_agreement_without_dropout():
    kw = dict(d_model=D, num_layers=1, num_heads=N, position="t5", dropout_rate=0.2)
    model = jn.DecoderLM(50, rngs=nnx.Rngs(0), **kw)
    twin = jl.DecoderLM(50, **kw)
    tokens = jax.random.randint(jax.random.key(0), (B, T), 0, 50)
    params = {"params": jl.params_from_nnx(model)}
    evaluated = twin.apply(params, tokens, deterministic=True)
    np.testing.assert_allclose(evaluated, model(tokens, deterministic=True), atol=1e-6)
    trained = twin.apply(params, tokens, deterministic=False,
                         rngs={"dropout": jax.random.key(2)})
    assert float(jnp.max(jnp.abs(trained - evaluated))) > 1e-2
    with pytest.raises(ValueError, match="deterministic"):
        twin.apply(params, tokens)


def test_decoding_never_drops():
    model = jn.DecoderLM(50, d_model=D, num_layers=1, num_heads=N, position="alibi",
                         dropout_rate=0.5, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(0), (B, T), 0, 50)
    logits, _ = model.decode_step(tokens, model.init_cache(batch=B, max_len=8))
    np.testing.assert_allclose(logits, model(tokens, deterministic=True), atol=1e-5)


def test_a_training_step_with_dropout_lowers_the_loss():
    optax = pytest.importorskip("optax")
    model = jn.DecoderLM(16, d_model=D, num_layers=1, num_heads=N, position="alibi",
                         dropout_rate=0.1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    tokens = jnp.tile(jnp.arange(4), (4, 3))  # a repeated pattern

    @nnx.jit
    def step(model, optimizer):
        def loss_fn(model):
            logits = model(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer)) for _ in range(6)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_bad_rates_are_refused():
    with pytest.raises(ValueError, match=r"dropout_rate must be in \[0, 1\)"):
        jn.MultiHeadAttention(D, N, dropout_rate=1.0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"attention_dropout_rate must be in \[0, 1\)"):
        jn.TransformerBlock(D, N, attention_dropout_rate=-0.5, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="dropout_rate must be a Python float"):
        jn.DecoderLM(50, d_model=D, num_layers=1, num_heads=N, dropout_rate="0.1",
                     rngs=nnx.Rngs(0))
