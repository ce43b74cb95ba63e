"""Padding masks in the modules (Hugging Face's ``attention_mask``: ``[B, T]``, 1 = token,
0 = padding) and the KV cache's bookkeeping of padded and empty slots.

The reference for a padded batch is the definition of padding: every token of a padded
row must get the output of its sequence run alone (no padding, positions ``0..n-1``), in
the full pass, in a padded prefill and in every later decode step. Positions follow
Hugging Face's ``cumsum(attention_mask) - 1`` with padding at 1
(``GenerationMixin.prepare_inputs_for_generation``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpos import linen as jl
from jaxpos import nnx as jn
from jaxpos.layers.functional import positions_from_mask

V, D, N = 32, 16, 2
# Rows of different lengths, left-padded to T = 5 (row 1: two pads).
SEQS = (np.array([3, 4, 5, 6, 7]), np.array([8, 9, 10]))
T = 5
TOL = dict(rtol=1e-5, atol=1e-5)


def _left_padded(seqs=SEQS, width=T):
    tokens = np.zeros((len(seqs), width), np.int32)
    mask = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, width - len(s):] = s
        mask[i, width - len(s):] = 1
    return jnp.asarray(tokens), jnp.asarray(mask)


def _decoder(position, **kw):
    return jn.DecoderLM(V, d_model=D, num_layers=1, num_heads=N, position=position,
                        max_len=16, implementation="chunked", rngs=nnx.Rngs(0), **kw)


def test_positions_from_mask_are_hugging_faces():
    mask = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [0, 1, 0, 1, 1]], bool)
    # HF: position_ids = cumsum(mask) - 1, then masked_fill(mask == 0, 1)
    want = np.array([[1, 1, 0, 1, 2], [0, 1, 2, 1, 1], [1, 0, 1, 1, 2]])
    np.testing.assert_array_equal(positions_from_mask(mask), want)
    np.testing.assert_array_equal(positions_from_mask(mask, jnp.array([[4], [0], [7]])),
                                  np.where(np.asarray(mask), want + [[4], [0], [7]], 1))


@pytest.mark.parametrize("position", [
    pytest.param(p, marks=pytest.mark.slow) if p in ("nope", "sinusoidal") else p
    for p in ("rope", "alibi", "t5", "nope", "sinusoidal")])
def test_left_padded_batch_gives_each_sequence_its_own_logits(position):
    """Full pass, padded prefill into a cache, then three decode steps: every token's
    logits equal those of its sequence run alone (one causal pass over the sequence and
    its continuation gives them all)."""
    model = _decoder(position)
    tokens, mask = _left_padded()
    more = np.array([[11, 13, 15], [12, 14, 16]], np.int32)
    alone = [model(jnp.asarray(np.concatenate([s, more[i]])[None]))[0]
             for i, s in enumerate(SEQS)]
    full = model(tokens, attention_mask=mask)
    cache = model.init_cache(2, 8)
    prefill, cache = model.decode_step(tokens, cache, attention_mask=mask)
    np.testing.assert_array_equal(cache[0].valid[:, :T], np.asarray(mask, bool))
    for i, s in enumerate(SEQS):
        np.testing.assert_allclose(full[i, T - len(s):], alone[i][:len(s)], **TOL)
        np.testing.assert_allclose(prefill[i, T - len(s):], alone[i][:len(s)], **TOL)
    for t in range(more.shape[1]):
        logits, cache = model.decode_step(jnp.asarray(more[:, t:t + 1]), cache)
        for i, s in enumerate(SEQS):
            np.testing.assert_allclose(logits[i, 0], alone[i][len(s) + t], **TOL)


def test_without_the_mask_left_padding_changes_the_logits():
    """The mask is needed: HF positions alone let real tokens attend to the pads."""
    model = _decoder("rope")
    tokens, mask = _left_padded()
    alone = model(jnp.asarray(SEQS[1][None]))[0]
    unmasked = model(tokens, positions=positions_from_mask(jnp.asarray(mask, bool)))
    assert np.abs(unmasked[1, 2:] - alone).max() > 1e-2


def test_padding_inside_a_decode_step_is_remembered_by_the_cache():
    """A decode step whose new tokens include padding: later steps never see it."""
    model = _decoder("alibi")
    cache = model.init_cache(1, 8)
    _, cache = model.decode_step(jnp.array([[3, 4]]), cache)
    _, cache = model.decode_step(jnp.array([[0, 5]]), cache, attention_mask=jnp.array([[0, 1]]))
    np.testing.assert_array_equal(cache[0].valid[0, :4], [True, True, False, True])
    logits, cache = model.decode_step(jnp.array([[6]]), cache)
    want = model(jnp.array([[3, 4, 5, 6]]))[0, -1]
    np.testing.assert_allclose(logits[0, 0], want, **TOL)


def test_linen_twin_takes_the_same_padding_mask():
    nnx_model = _decoder("t5")
    lin = jl.DecoderLM(V, d_model=D, num_layers=1, num_heads=N, position="t5",
                       implementation="chunked")
    params = {"params": jl.params_from_nnx(nnx_model)}
    tokens, mask = _left_padded()
    np.testing.assert_allclose(lin.apply(params, tokens, attention_mask=mask),
                               nnx_model(tokens, attention_mask=mask), **TOL)
    cache = lin.init_cache(2, 8)
    got, cache = lin.apply(params, tokens, cache, attention_mask=mask, method="decode_step")
    for i, s in enumerate(SEQS):
        np.testing.assert_allclose(got[i, T - len(s):], nnx_model(jnp.asarray(s[None]))[0],
                                   **TOL)


def test_multi_head_attention_and_encoder_ignore_padding():
    mha = jn.MultiHeadAttention(D, N, position="rope", causal=True,
                                implementation="reference", rngs=nnx.Rngs(1))
    x = jax.random.normal(jax.random.key(0), (2, T, D))
    mask = jnp.array([[0, 0, 1, 1, 1], [1] * T])
    y = mha(x, attention_mask=mask)
    np.testing.assert_allclose(y[0, 2:], mha(x[:1, 2:])[0], **TOL)
    np.testing.assert_allclose(y[1], mha(x[1:])[0], **TOL)
    cache = mha.init_cache(2, 8)
    y_dec, cache = mha.decode(x, cache, attention_mask=mask)
    np.testing.assert_allclose(y_dec[0, 2:], y[0, 2:], **TOL)
    enc = jn.Encoder(V, d_model=D, num_layers=1, num_heads=N, position="alibi",
                     implementation="chunked", rngs=nnx.Rngs(2))
    tokens, mask = _left_padded()
    h = enc(tokens, attention_mask=mask)
    np.testing.assert_allclose(h[1, 2:], enc(jnp.asarray(SEQS[1][None]))[0], **TOL)


def test_padding_mask_combines_with_packed_segments():
    """Row 0 packs two sequences [3, 4] and [5, 6] after one pad."""
    model = _decoder("rope")
    tokens = jnp.array([[0, 3, 4, 5, 6]])
    mask = jnp.array([[0, 1, 1, 1, 1]])
    seg = jnp.array([[0, 0, 0, 1, 1]])
    got = model(tokens, positions=jnp.array([[1, 0, 1, 0, 1]]), segment_ids=seg,
                attention_mask=mask)
    np.testing.assert_allclose(got[0, 1:3], model(jnp.array([[3, 4]]))[0], **TOL)
    np.testing.assert_allclose(got[0, 3:], model(jnp.array([[5, 6]]))[0], **TOL)


@pytest.mark.parametrize("bad, err, match", [
    (jnp.ones((2, T), jnp.float32), TypeError, "bool or integer"),
    (jnp.full((2, T), 2), ValueError, "1 .token. and 0 .padding. only"),
    (jnp.ones((2, T + 1), jnp.int32), ValueError, r"\[B, T\] = \[2, 5\]"),
])
def test_bad_attention_mask_is_named(bad, err, match):
    model = _decoder("nope")
    tokens, _ = _left_padded()
    with pytest.raises(err, match=match):
        model(tokens, attention_mask=bad)
    with pytest.raises(err, match=match):
        model.decode_step(tokens, model.init_cache(2, 8), attention_mask=bad)


def test_decode_with_another_batch_size_names_the_caches():
    model = _decoder("rope")
    cache = model.init_cache(3, 8)
    with pytest.raises(ValueError, match=r"batch size 2 .*made for batch size 3"):
        model.decode_step(jnp.zeros((2, 1), jnp.int32), cache)
    mha = jn.MultiHeadAttention(D, N, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="made for batch size 3"):
        mha.decode(jnp.zeros((1, 1, D)), mha.init_cache(3, 4))


def test_xpos_decoding_far_from_the_origin_equals_the_full_pass():
    """Positions ~1e5: empty cache slots (position 0) must not enter xPos's centre (they
    made the float32 scales overflow to NaN)."""
    model = _decoder("xpos")
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, V, (2, 5)), jnp.int32)
    pos = 100_000 + jnp.arange(5)
    full = model(tokens, positions=pos)
    cache = model.init_cache(2, 16)
    steps = []
    logits, cache = model.decode_step(tokens[:, :3], cache, positions=pos[:3])
    steps.append(logits)
    for t in range(3, 5):
        logits, cache = model.decode_step(tokens[:, t:t + 1], cache, positions=pos[t:t + 1])
        steps.append(logits)
    got = jnp.concatenate(steps, axis=1)
    assert bool(jnp.isfinite(full).all()) and bool(jnp.isfinite(got).all())
    np.testing.assert_allclose(got, full, **TOL)
