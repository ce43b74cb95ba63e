"""PaTH (``position="path"``, ``"path_fox"``; Yang et al. 2025) and CoPE (``"cope"``;
Golovneva et al. 2024) in the Flax modules: the layer's transforms follow the paper's
parameterisation (a float64 NumPy rebuild of ``w`` = L2-normalised SiLU of a causal
depthwise convolution of a low-rank projection, ``beta = 2 sigmoid(.)``, FoX's gate),
padding and packing restart the convolution, grouped-query layers, NNX and Linen agree,
CoPE decodes from a KV cache as its full pass (with non-zero embeddings; PaTH's decoding:
``test_path_decoding.py``), and ``jaxpos.attention`` refuses both schemes naming the
functions that run them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxpos
from jaxpos import linen as jl
from jaxpos import nnx as jn
from jaxpos.schemes.cope import CoPE
from jaxpos.schemes.path import PaTH

D, N, T = 16, 2, 7


def _mha(position, **kw):
    return jn.MultiHeadAttention(D, N, position=position, causal=True,
                                 implementation=kw.pop("implementation", "reference"),
                                 rngs=nnx.Rngs(0), **kw)


def _np_directions(x, p, nk, H):
    """float64: ``w = l2(silu(conv(x W_down W_up)))``, ``beta = 2 sigmoid(x W_b + b)``."""
    x = np.asarray(x, np.float64)
    u = x @ np.asarray(p["w_down"], np.float64) @ np.asarray(p["w_up"], np.float64)
    K = p["conv"].shape[0]
    conv = np.asarray(p["conv"], np.float64)
    out = np.zeros_like(u)
    for t in range(u.shape[1]):
        for m in range(K):
            s = t - (K - 1) + m
            if s >= 0:
                out[:, t] += conv[m] * u[:, s]
    w = out / (1 + np.exp(-out))
    w = w.reshape(x.shape[0], x.shape[1], nk, H)
    w = w / np.sqrt((w * w).sum(-1, keepdims=True) + 1e-6)
    beta = 2 / (1 + np.exp(-(x @ np.asarray(p["beta_w"], np.float64) +
                             np.asarray(p["beta_b"], np.float64))))
    return w, beta


@pytest.mark.parametrize("position", [pytest.param("path", marks=pytest.mark.slow),
                                      "path_fox"])
def test_layer_follows_the_papers_parameterisation(position):
    m = _mha(position)
    x = jax.random.normal(jax.random.key(1), (2, T, D))
    params = {n: np.asarray(v[...]) for n, v in vars(m.position_module).items()
              if isinstance(v, nnx.Param)}
    w, beta = _np_directions(x, params, N, D // N)
    lf = None
    if position == "path_fox":
        logit = np.asarray(x, np.float64) @ params["forget_w"] + params["forget_b"]
        lf = -np.log1p(np.exp(-logit))
    q, k, v = m._qkv(x)
    o = jaxpos.path_attention(q, k, v, jnp.asarray(w, jnp.float32),
                              jnp.asarray(beta, jnp.float32),
                              log_forget=None if lf is None else jnp.asarray(lf, jnp.float32))
    np.testing.assert_allclose(np.asarray(m(x)), np.asarray(m._out(o)), atol=2e-5)


@pytest.mark.parametrize("position", ["path_fox", "cope"])
def test_left_padding_equals_the_unpadded_row(position):
    # the pads come first: PaTH's convolution must not read them (it restarts at the
    # padding's segment boundary), CoPE must not count them
    m = _mha(position)
    if position == "cope":
        m.position_module.pos_emb[...] = jax.random.normal(jax.random.key(3), (D // N, 65))
    x = jax.random.normal(jax.random.key(2), (1, T, D))
    pad = 3
    xp = jnp.concatenate([jax.random.normal(jax.random.key(4), (1, pad, D)), x], 1)
    mask = jnp.asarray([[0] * pad + [1] * T])
    got = m(xp, attention_mask=mask)[:, pad:]
    np.testing.assert_allclose(np.asarray(got), np.asarray(m(x)), atol=2e-5)


def test_grouped_query_path_layer_and_its_option():
    m = jn.MultiHeadAttention(D, 4, num_kv_heads=2, head_dim=4, position="path", causal=True,
                              scheme_options={"num_kv_heads": 2}, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, T, D))
    assert m(x).shape == (2, T, D)
    assert m.position_module.w_up[...].shape == (16, 2 * 4)
    bad = jn.MultiHeadAttention(D, 4, num_kv_heads=2, head_dim=4, position="path", causal=True,
                                rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_kv_heads"):
        bad(x)


@pytest.mark.slow
@pytest.mark.parametrize("position", ["path", "cope"])
def test_nnx_and_linen_decoders_agree_and_train(position):
    V = 30
    kw = dict(d_model=D, num_layers=2, num_heads=N, position=position,
              implementation="chunked")
    m = jn.DecoderLM(V, rngs=nnx.Rngs(0), **kw)
    tokens = jax.random.randint(jax.random.key(0), (2, T), 0, V)
    lin = jl.DecoderLM(V, **kw)
    np.testing.assert_allclose(lin.apply({"params": jl.params_from_nnx(m)}, tokens),
                               m(tokens), atol=2e-5)
    graphdef, params = nnx.split(m, nnx.Param)
    loss = lambda p: jnp.mean(nnx.merge(graphdef, p)(tokens) ** 2)
    grads = jax.grad(loss)(params)
    norms = {"/".join(map(str, k)): float(jnp.linalg.norm(v[...]))
             for k, v in nnx.to_flat_state(grads)}
    # every scheme parameter gets a gradient (CoPE's zero-initialised table too)
    scheme = [n for n in norms if "position_module" in n]
    assert scheme and all(norms[n] > 0 for n in scheme), norms


def test_cope_decoding_equals_the_full_pass():
    V = 30
    m = jn.DecoderLM(V, d_model=D, num_layers=2, num_heads=N, position="cope", max_len=16,
                     scheme_options={"cope_npos": 5}, implementation="reference",
                     rngs=nnx.Rngs(0))
    for i, blk in enumerate(m.blocks):
        shape = blk.attn.position_module.pos_emb[...].shape
        blk.attn.position_module.pos_emb[...] = jax.random.normal(jax.random.key(i), shape)
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, V)
    full = np.asarray(m(tokens))
    logits, cache = m.decode_step(tokens[:, :4], m.init_cache(2, 16))
    steps = [np.asarray(logits)]
    for i in range(4, 9):
        logits, cache = m.decode_step(tokens[:, i:i + 1], cache)
        steps.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(steps, 1), full, atol=2e-5)


@pytest.mark.parametrize("impl", ["reference", "chunked", "pallas", "xla"])
def test_jaxpos_attention_refuses_both_schemes_naming_their_functions(impl):
    q = jnp.ones((1, 4, 2, 4))
    cope = CoPE(jnp.zeros((4, 5)))
    path = PaTH(jnp.zeros((1, 4, 8)), jnp.zeros((3, 8)), jnp.ones((1, 4, 2)), num_kv_heads=2)
    with pytest.raises(ValueError, match="jaxpos.cope_attention.*'reference' or 'chunked'"):
        jaxpos.attention(q, q, q, position=cope, causal=True, implementation=impl)
    with pytest.raises(ValueError, match="jaxpos.path_attention.*'reference' or 'chunked'"):
        jaxpos.attention(q, q, q, position=path, causal=True, implementation=impl)
    if impl in ("pallas", "xla"):  # the modules' path: the scheme's own attention
        with pytest.raises(ValueError, match="'reference' or 'chunked'"):
            cope.attention(q, q, q, implementation=impl)
