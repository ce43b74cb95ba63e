"""Gated attention (Qiu et al. 2025, "Gated Attention for Large Language Models", §2.2,
variant G1): ``MultiHeadAttention(output_gate=True)`` against a float64 NumPy computation
of ``(softmax attention * sigmoid(x W_g)) W_o``, the Linen twin with the same weights, and
KV-cache decoding against the full pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpos import linen as jl
from jaxpos import nnx as jn

B, T, D, N, NK, H = 2, 7, 16, 4, 2, 4


def _layer():
    return jn.MultiHeadAttention(D, N, num_kv_heads=NK, position="nope", causal=True,
                                 output_gate=True, implementation="reference",
                                 rngs=nnx.Rngs(0))


def np_gated_attention(x, wq, wk, wv, wg, wo, bg=0.0):
    """float64: causal softmax attention per head (grouped-query), each head's output times
    ``sigmoid(x W_g + b_g)`` (elementwise for ``W_g [D, N*H]``, one scalar per head for
    ``W_g [D, N]``: Qiu et al. 2025, §2.2 / Table 1), then the output projection."""
    x, wq, wk, wv, wg, wo = (np.asarray(a, np.float64) for a in (x, wq, wk, wv, wg, wo))
    q = (x @ wq).reshape(B, T, N, H)
    k = np.repeat((x @ wk).reshape(B, T, NK, H), N // NK, axis=2)
    v = np.repeat((x @ wv).reshape(B, T, NK, H), N // NK, axis=2)
    s = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(H)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("bnqk,bknh->bqnh", p, v)
    gate = 1.0 / (1.0 + np.exp(-(x @ wg + np.asarray(bg, np.float64)).reshape(B, T, N, -1)))
    return (o * gate).reshape(B, T, N * H) @ wo


def test_gated_output_matches_float64():
    layer = _layer()
    x = jax.random.normal(jax.random.PRNGKey(1), (B, T, D))
    assert layer.gate_proj.kernel[...].shape == (D, N * H) and layer.gate_proj.bias is None
    want = np_gated_attention(x, *(m.kernel[...] for m in (
        layer.q_proj, layer.k_proj, layer.v_proj, layer.gate_proj, layer.o_proj)))
    np.testing.assert_allclose(np.asarray(layer(x)), want, atol=2e-5, rtol=2e-5)
    # The gate is not the identity: without it the output differs.
    plain = jn.MultiHeadAttention(D, N, num_kv_heads=NK, position="nope", causal=True,
                                  implementation="reference", rngs=nnx.Rngs(0))
    assert plain.gate_proj is None
    assert np.abs(np.asarray(plain(x)) - want).max() > 1e-2


def test_headwise_gate_with_bias_matches_float64_and_its_linen_twin():
    kw = dict(num_kv_heads=NK, position="nope", causal=True, output_gate="headwise",
              output_gate_bias=True, implementation="reference")
    layer = jn.MultiHeadAttention(D, N, rngs=nnx.Rngs(3), **kw)
    assert layer.gate_proj.kernel[...].shape == (D, N)
    layer.gate_proj.bias[...] = jnp.linspace(-1.0, 1.0, N)
    x = jax.random.normal(jax.random.PRNGKey(4), (B, T, D))
    want = np_gated_attention(x, *(m.kernel[...] for m in (
        layer.q_proj, layer.k_proj, layer.v_proj, layer.gate_proj, layer.o_proj)),
        bg=layer.gate_proj.bias[...])
    np.testing.assert_allclose(np.asarray(layer(x)), want, atol=2e-5, rtol=2e-5)
    twin = jl.MultiHeadAttention(D, N, **kw)
    got = twin.apply({"params": jl.params_from_nnx(layer)}, x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(layer(x)))


def test_linen_twin_and_decoding():
    layer = _layer()
    x = jax.random.normal(jax.random.PRNGKey(2), (B, T, D))
    full = np.asarray(layer(x))
    twin = jl.MultiHeadAttention(D, N, num_kv_heads=NK, position="nope", causal=True,
                                 output_gate=True, implementation="reference")
    got = twin.apply({"params": jl.params_from_nnx(layer)}, x)
    np.testing.assert_allclose(np.asarray(got), full, atol=1e-6, rtol=1e-6)
    cache = layer.init_cache(B, T)
    y, cache = layer.decode(x[:, :3], cache)
    steps = [np.asarray(y)]
    for t in range(3, T):
        y, cache = layer.decode(x[:, t:t + 1], cache)
        steps.append(np.asarray(y))
    np.testing.assert_allclose(np.concatenate(steps, 1), full, atol=2e-5, rtol=2e-5)


def test_output_gate_must_be_a_bool_or_a_gate_form():
    with pytest.raises(TypeError, match="output_gate must be a bool"):
        jn.MultiHeadAttention(D, N, output_gate=1, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="output_gate must be one of"):
        jl.MultiHeadAttention(D, N, output_gate="yes").init(jax.random.PRNGKey(0),
                                                           jnp.ones((1, 2, D)))
    with pytest.raises(ValueError, match="output_gate_bias=True needs an output gate"):
        jn.MultiHeadAttention(D, N, output_gate_bias=True, rngs=nnx.Rngs(0))
