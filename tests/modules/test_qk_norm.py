"""Per-head and projection-wide q/k RMSNorm (``MultiHeadAttention(qk_norm=...)``): a
float64 NumPy layer, the ``(1 + w)`` form, KV-cache decoding against the full pass and
the Linen twin. Parity with Qwen3, Gemma 3, OLMo 2 and Qwen3-Next is in
tests/parity/test_parity_qk_norm_gate.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpos import linen as jl
from jaxpos import nnx as jn

B, T, D, N, NK, H = 2, 6, 16, 4, 2, 4
EPS = 1e-5


def np_rms(t, w, offset):
    t = np.asarray(t, np.float64)
    y = t / np.sqrt(np.mean(t * t, -1, keepdims=True) + EPS)
    return y * ((1.0 + w) if offset else w)


def np_layer(x, layer, over, offset):
    """float64: q and k normalised per head (``over="head"``) or over the projection,
    then causal softmax attention (no positions)."""
    f = lambda m: np.asarray(m.kernel[...], np.float64)
    x = np.asarray(x, np.float64)
    wq, wk = (np.asarray(m.scale[...], np.float64) for m in (layer.q_norm, layer.k_norm))
    q, k, v = x @ f(layer.q_proj), x @ f(layer.k_proj), x @ f(layer.v_proj)
    if over == "projection":
        q, k = np_rms(q, wq, offset), np_rms(k, wk, offset)
    q, k, v = q.reshape(B, T, N, H), k.reshape(B, T, NK, H), v.reshape(B, T, NK, H)
    if over == "head":
        q, k = np_rms(q, wq, offset), np_rms(k, wk, offset)
    k, v = np.repeat(k, N // NK, 2), np.repeat(v, N // NK, 2)
    s = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(H)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bnqk,bknh->bqnh", p, v).reshape(B, T, N * H) @ f(layer.o_proj)


@pytest.mark.parametrize("over,offset", [("head", False), ("projection", True)])
def test_qk_norm_matches_float64(over, offset):
    layer = jn.MultiHeadAttention(D, N, num_kv_heads=NK, causal=True, qk_norm=over,
                                  qk_norm_offset=offset, qk_norm_eps=EPS,
                                  implementation="reference", rngs=nnx.Rngs(0))
    width = H if over == "head" else N * H
    assert layer.q_norm.scale[...].shape == (width,)
    assert float(layer.q_norm.scale[...].mean()) == (0.0 if offset else 1.0)
    rs = np.random.RandomState(0)
    for m in (layer.q_norm, layer.k_norm):
        m.scale[...] = rs.randn(*m.scale[...].shape).astype(np.float32)
    x = rs.randn(B, T, D).astype(np.float32)
    np.testing.assert_allclose(np.asarray(layer(x)), np_layer(x, layer, over, offset),
                               atol=2e-5, rtol=2e-5)


@pytest.mark.slow  # ~4 s: a chunked prefill and two steps compile
def test_qk_norm_decoding_equals_the_full_pass_and_the_linen_twin():
    kw = dict(num_kv_heads=NK, position="rope", causal=True, qk_norm="head",
              qk_norm_offset=True, implementation="chunked")
    layer = jn.MultiHeadAttention(D, N, rngs=nnx.Rngs(1), **kw)
    layer.k_norm.scale[...] = jnp.linspace(-0.5, 0.5, H)
    x = jax.random.normal(jax.random.PRNGKey(2), (B, T, D))
    full = np.asarray(layer(x))
    cache = layer.init_cache(B, T)
    y, cache = layer.decode(x[:, :4], cache)
    steps = [np.asarray(y)]
    for t in range(4, T):
        y, cache = layer.decode(x[:, t:t + 1], cache)
        steps.append(np.asarray(y))
    np.testing.assert_allclose(np.concatenate(steps, 1), full, atol=2e-5, rtol=2e-5)
    twin = jl.MultiHeadAttention(D, N, **kw)
    got = twin.apply({"params": jl.params_from_nnx(layer)}, x)
    np.testing.assert_array_equal(np.asarray(got), full)


def test_qk_norm_options_are_checked():
    with pytest.raises(ValueError, match="qk_norm must be one of"):
        jn.MultiHeadAttention(D, N, qk_norm="rms", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="qk_norm_offset=True needs qk_norm"):
        jn.MultiHeadAttention(D, N, qk_norm_offset=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="qk_norm_eps"):
        jl.MultiHeadAttention(D, N, qk_norm="head", qk_norm_eps=0.0).init(
            jax.random.PRNGKey(0), jnp.ones((1, 2, D)))
