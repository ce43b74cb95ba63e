"""Stick-breaking attention in the Flax modules (``position="stick_breaking"``): a layer's
output is the output projection of :func:`jaxpos.stick_breaking_attention` on its
projections (its KV-cache decoding: ``tests/modules/test_decode_equals_full_pass.py``),
and the softmax path, an encoder and softmax-only options are refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxpos
from jaxpos import nnx as jn
from jaxpos.schemes.stick_breaking import StickBreaking

V, T = 40, 6


def test_layer_is_stick_breaking_attention_of_its_projections():
    layer = jn.MultiHeadAttention(16, 2, position="stick_breaking", causal=True,
                                  rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (2, T, 16))
    proj = lambda m: (x @ m.kernel[...]).reshape(2, T, 2, 8)
    o = jaxpos.stick_breaking_attention(proj(layer.q_proj), proj(layer.k_proj),
                                        proj(layer.v_proj), implementation="reference")
    want = o.reshape(2, T, 16) @ layer.o_proj.kernel[...]
    np.testing.assert_allclose(np.asarray(layer(x)), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_refusals():
    q = jnp.ones((1, 3, 2, 8))
    with pytest.raises(ValueError, match="replaces softmax attention"):
        jaxpos.attention(q, q, q, position=StickBreaking(), causal=True)
    with pytest.raises(ValueError, match="causal by definition"):
        jn.Encoder(V, d_model=16, num_layers=1, num_heads=2, position="stick_breaking",
                   rngs=nnx.Rngs(0))(jnp.zeros((1, 3), jnp.int32))
    with pytest.raises(ValueError, match="takes no sinks"):
        jn.MultiHeadAttention(16, 2, position="stick_breaking", causal=True, sinks=True,
                              rngs=nnx.Rngs(0))(jnp.ones((1, 3, 16)))
