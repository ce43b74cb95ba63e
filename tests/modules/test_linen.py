"""Tests of the Flax Linen twins (jaxpos.linen): same parameter trees and the same outputs
as the NNX modules given the same weights, plus the Linen-specific entry points
(``init``/``apply``, ``method="decode_step"``, parameter-free ``init_cache``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

from jaxpos import linen as jl
from jaxpos import nnx as jn

V, D, N = 50, 16, 2
ALL = ("nope", "sinusoidal", "learned", "rope", "alibi", "t5", "shaw")


def twins(position, cls="DecoderLM", num_layers=1, **kw):
    kw.setdefault("max_len", 16)
    args = dict(d_model=D, num_layers=num_layers, num_heads=N, position=position,
                implementation="reference", **kw)
    nnx_model = getattr(jn, cls)(V, rngs=nnx.Rngs(0), **args)
    linen_model = getattr(jl, cls)(V, **args)
    return nnx_model, linen_model


@pytest.mark.parametrize("position", ALL)
def test_nnx_and_linen_decoders_give_identical_logits_with_the_same_weights(position):
    nnx_model, linen_model = twins(position)
    tokens = jax.random.randint(jax.random.key(0), (2, 6), 0, V)
    positions = np.array([[0, 1, 2, 3, 4, 5], [3, 4, 5, 6, 7, 8]])
    own = nn.unbox(jax.eval_shape(linen_model.init, jax.random.key(1), tokens)["params"])
    params = jl.params_from_nnx(nnx_model)
    # Same tree (names and shapes) as Linen's own initialisation...
    assert jax.tree_util.tree_structure(own) == jax.tree_util.tree_structure(params)
    assert jax.tree_util.tree_map(jnp.shape, own) == jax.tree_util.tree_map(jnp.shape, params)
    # ...and, given NNX's weights, bit-identical outputs (same functions underneath).
    got = linen_model.apply({"params": params}, tokens, positions=positions)
    np.testing.assert_array_equal(got, nnx_model(tokens, positions=positions))


@pytest.mark.parametrize("position", ["alibi", "t5"])
def test_nnx_and_linen_encoders_agree(position):
    nnx_model, linen_model = twins(position, cls="Encoder")
    tokens = jax.random.randint(jax.random.key(2), (2, 5), 0, V)
    mask = jnp.array([[True] * 5, [True] * 3 + [False] * 2])[:, None, None, :]  # padding
    got = linen_model.apply({"params": jl.params_from_nnx(nnx_model)}, tokens, mask=mask)
    np.testing.assert_array_equal(got, nnx_model(tokens, mask=mask))


def test_linen_t5_table_is_one_parameter_and_sinusoidal_has_none():
    _, t5 = twins("t5", num_layers=3)
    tokens = jnp.zeros((1, 4), jnp.int32)
    params = nn.unbox(jax.eval_shape(t5.init, jax.random.key(0), tokens)["params"])
    tables = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_leaves_with_path(params)
              if x.shape == (32, N)]
    assert tables == ["['rel_position']['table']"]
    _, sin = twins("sinusoidal")
    _, nope = twins("nope")
    count = lambda m: sum(x.size for x in jax.tree_util.tree_leaves(
        nn.unbox(jax.eval_shape(m.init, jax.random.key(0), tokens)["params"])))
    assert count(sin) == count(nope)


def test_linen_learned_positions_past_the_table_raise():
    nnx_model, model = twins("learned", max_len=4)
    params = {"params": jl.params_from_nnx(nnx_model)}
    with pytest.raises(ValueError, match="max_len=4"):
        model.apply(params, jnp.zeros((1, 5), jnp.int32))
    with pytest.raises(ValueError, match="max_len"):
        jl.DecoderLM(V, d_model=D, num_layers=1, num_heads=N, position="learned").init(
            jax.random.key(0), jnp.zeros((1, 4), jnp.int32))


# Slow: the twins' forward passes are already bit-identical with the same weights.
@pytest.mark.slow
@pytest.mark.parametrize("position,names", [
    ("t5", [("rel_position", "table")]),
    ("shaw", [("blocks_0", "attn", "position_module", "rel_k"),
              ("blocks_0", "attn", "position_module", "rel_v")]),
])
def test_linen_gradients_reach_position_parameters_as_in_nnx(position, names):
    nnx_model, linen_model = twins(position)
    tokens = jax.random.randint(jax.random.key(4), (2, 6), 0, V)
    weights = jax.random.normal(jax.random.key(5), (2, 6, V))

    @jax.jit
    def grads(params):
        return jax.grad(lambda p: jnp.sum(linen_model.apply({"params": p}, tokens) * weights))(
            params)

    g_linen = grads(jl.params_from_nnx(nnx_model))
    g_nnx = jl.params_from_nnx(nnx.jit(nnx.grad(lambda m: jnp.sum(m(tokens) * weights)))(
        nnx_model))
    for path in names:
        a, b = g_linen, g_nnx
        for key in path:
            a, b = a[key], b[key]
        assert np.abs(np.asarray(a)).max() > 1e-4, path
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=str(path))


@pytest.mark.slow  # GQA itself is covered by tests/attention/test_attention.py
def test_linen_multi_head_attention_matches_nnx_with_grouped_query_heads():
    nnx_mha = jn.MultiHeadAttention(D, 4, num_kv_heads=2, position="rope", causal=True,
                                    implementation="reference", rngs=nnx.Rngs(0))
    linen_mha = jl.MultiHeadAttention(D, 4, num_kv_heads=2, position="rope", causal=True,
                                      implementation="reference")
    x = jax.random.normal(jax.random.key(6), (2, 5, D))
    params = jl.params_from_nnx(nnx_mha)
    assert jax.tree_util.tree_map(jnp.shape, params) == jax.tree_util.tree_map(
        jnp.shape, nn.unbox(jax.eval_shape(linen_mha.init, jax.random.key(0), x)["params"]))
    np.testing.assert_array_equal(linen_mha.apply({"params": params}, x), nnx_mha(x))


def test_linen_position_module_defined_in_a_parent_is_shared():
    class TwoLayers(nn.Module):
        def setup(self):
            self.t5 = jl.T5RelativeBias(N, bidirectional=False)
            self.layers = [jl.MultiHeadAttention(D, N, position=self.t5, causal=True,
                                                 implementation="reference") for _ in range(2)]

        def __call__(self, x):
            return self.layers[1](self.layers[0](x))

    params = nn.unbox(TwoLayers().init(jax.random.key(0), jnp.ones((1, 4, D)))["params"])
    assert params["t5"]["table"].shape == (32, N)
    assert sum(x.size for x in jax.tree_util.tree_leaves(params)) == 2 * 4 * D * D + 32 * N
