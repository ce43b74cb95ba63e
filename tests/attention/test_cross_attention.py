"""Cross-attention and projection biases in ``jaxpos.nnx.MultiHeadAttention`` and its Linen
twin: ``context=`` supplies keys and values (T5's decoder, encoder-decoder models), and
``use_bias=True`` adds the four projection biases of GPT-2/BLOOM/BERT-style layers.

The reference is Flax's own ``flax.nnx.MultiHeadAttention`` (an independent, published
implementation) given the same weights; the Linen twin must match NNX bit for bit. Bad
input (context width or batch, kv_positions without a context, use_bias) is in
tests/attention/test_bad_input.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

from jaxpos import linen as jl
from jaxpos import nnx as jn

B, TQ, TK, D, N = 2, 5, 7, 16, 4
H = D // N


def _inputs(seed=0):
    kx, kc, km = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (B, TQ, D))
    context = jax.random.normal(kc, (B, TK, D))
    mask = jax.random.bernoulli(km, 0.7, (B, 1, TQ, TK))
    return x, context, mask


def _ours(use_bias, seed=1, **kw):
    mha = jn.MultiHeadAttention(D, N, use_bias=use_bias, implementation="reference",
                                rngs=nnx.Rngs(seed), **kw)
    if use_bias:  # NNX initialises biases to zero: give them values so they are tested
        for i, layer in enumerate((mha.q_proj, mha.k_proj, mha.v_proj, mha.o_proj)):
            layer.bias[...] = jax.random.normal(jax.random.key(10 + i), layer.bias.shape)
    return mha


def _flax_twin(mha):
    """flax.nnx.MultiHeadAttention with ``mha``'s weights ([D, N*H] -> [D, N, H] etc.)."""
    ref = nnx.MultiHeadAttention(N, D, qkv_features=D, out_features=D, decode=False,
                                 use_bias=mha.q_proj.bias is not None, rngs=nnx.Rngs(0))
    for ours, theirs in ((mha.q_proj, ref.query), (mha.k_proj, ref.key), (mha.v_proj, ref.value)):
        theirs.kernel[...] = ours.kernel[...].reshape(D, N, H)
        if ours.bias is not None:
            theirs.bias[...] = ours.bias[...].reshape(N, H)
    ref.out.kernel[...] = mha.o_proj.kernel[...].reshape(N, H, D)
    if mha.o_proj.bias is not None:
        ref.out.bias[...] = mha.o_proj.bias[...]
    return ref


@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("implementation", ["reference", "chunked", "pallas"])
def test_cross_attention_matches_flax_multi_head_attention(use_bias, implementation):
    x, context, mask = _inputs()
    mha = _ours(use_bias)
    ref = _flax_twin(mha)
    want = ref(x, context, context, mask=mask, deterministic=True)
    got = mha(x, context=context, implementation=implementation,
              mask=None if implementation == "pallas" else mask)
    if implementation == "pallas":  # the kernel takes no boolean mask: compare unmasked
        want = ref(x, context, context, deterministic=True)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    # Control: self-attention on x is a different answer.
    assert np.abs(np.asarray(mha(x)) - np.asarray(want)).max() > 1e-2


def test_self_attention_with_biases_matches_flax():
    x, _, _ = _inputs(3)
    mha = _ours(True, causal=True)
    causal = jnp.tril(jnp.ones((TQ, TQ), bool))
    want = _flax_twin(mha)(x, mask=causal[None, None], deterministic=True)
    np.testing.assert_allclose(mha(x), want, rtol=2e-5, atol=2e-5)


def test_cross_attention_with_rope_uses_kv_positions():
    """Keys and values come from the context at ``kv_positions``: shifting both position
    arrays by the same amount leaves RoPE's output unchanged, shifting one does not."""
    x, context, _ = _inputs(4)
    mha = _ours(False, position="rope")
    qp, kp = np.arange(TQ) + 3, np.arange(TK)
    base = mha(x, context=context, positions=qp, kv_positions=kp)
    np.testing.assert_allclose(mha(x, context=context, positions=qp + 100, kv_positions=kp + 100),
                               base, rtol=1e-4, atol=1e-4)
    assert np.abs(np.asarray(mha(x, context=context, positions=qp, kv_positions=kp + 5))
                  - np.asarray(base)).max() > 1e-3


def test_cross_attention_segments():
    """kv_segment_ids: each query sees only the context rows of its own segment, which equals
    attending to that segment's rows alone."""
    x, context, _ = _inputs(5)
    mha = _ours(True)
    seg_q = np.array([[0] * 3 + [1] * 2] * B, np.int32)
    seg_k = np.array([[0] * 4 + [1] * 3] * B, np.int32)
    got = mha(x, context=context, segment_ids=seg_q, kv_segment_ids=seg_k)
    first = mha(x[:, :3], context=context[:, :4])
    second = mha(x[:, 3:], context=context[:, 4:], kv_positions=np.arange(4, 7),
                 positions=np.arange(3, 5))
    np.testing.assert_allclose(got, jnp.concatenate([first, second], 1), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("position", ["nope", "rope", "alibi", "t5"])
def test_linen_twin_is_identical_for_cross_attention_with_biases(position):
    x, context, mask = _inputs(6)
    nnx_mha = _ours(True, position=position)
    linen_mha = jl.MultiHeadAttention(d_model=D, num_heads=N, position=position, use_bias=True,
                                      implementation="reference")
    own = nn.unbox(jax.eval_shape(linen_mha.init, jax.random.key(0), x,
                                  context=context)["params"])
    params = jl.params_from_nnx(nnx_mha)
    assert jax.tree_util.tree_map(jnp.shape, own) == jax.tree_util.tree_map(jnp.shape, params)
    kw = dict(context=context, kv_positions=np.arange(TK) + 2, mask=mask)
    np.testing.assert_array_equal(linen_mha.apply({"params": params}, x, **kw), nnx_mha(x, **kw))
