"""FoX (Lin et al. 2025, §2) decodes from the modules' KV caches: the caches keep the
cumulative log forget gate ``c`` of every cached token, and a step's bias ``c_i - c_j``
reads it (``jaxpos/layers/cache/fox.py``). A left-padded full pass (padding gets no gate)
and decoding from the dense and the paged cache through a left-padded prefill give every
row the logits of its tokens run alone, unpadded (float32, ``1e-5``; the full pass is
checked against float64 NumPy in ``tests/schemes/test_fox.py``). Jitted: before, a padded
full pass read the gates at the padded positions under ``jit`` (0.005 off) and refused
them eagerly, and decoding was refused."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpos import nnx as jn

V, D, N = 24, 8, 2
MASK = np.array([[1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1]])  # row 1 left-padded by 2
REAL = MASK.astype(bool)


@functools.cache
def _model_and_tokens():
    m = jn.DecoderLM(V, d_model=D, num_layers=1, num_heads=N, position="fox", max_len=16,
                     rngs=nnx.Rngs(0))
    return m, jax.random.randint(jax.random.key(1), (2, 7), 0, V)


@functools.cache
def _alone_and_padded():
    """The logits of each row's tokens run alone (row 1's 5 tokens first, two tokens after
    them that a causal pass never shows them), ``[12, V]``, and the left-padded full
    pass's at the tokens, both jitted."""
    m, tokens = _model_and_tokens()
    full = nnx.jit(lambda m, t, a: m(t, attention_mask=a))
    unpadded = jnp.concatenate([tokens[:1], jnp.roll(tokens[1:], -2, axis=1)])
    alone = np.asarray(full(m, unpadded, jnp.ones((2, 7), bool)))
    padded = np.asarray(full(m, tokens, jnp.asarray(MASK)))
    return np.concatenate([alone[0], alone[1, :5]]), padded[REAL]


def test_a_left_padded_fox_full_pass_equals_each_row_run_alone():
    alone, padded = _alone_and_padded()
    np.testing.assert_allclose(padded, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_options", [{}, {"page_size": 2, "num_pages": 12}],
                         ids=["dense", "paged"])
def test_fox_decoding_through_a_left_padded_prefill_equals_each_row_run_alone(cache_options):
    m, tokens = _model_and_tokens()
    step = nnx.jit(lambda m, t, c, a: m.decode_step(t, c, attention_mask=a))
    cache = m.init_cache(2, 9, **cache_options)
    out = []
    logits, cache = step(m, tokens[:, :4], cache, jnp.asarray(MASK[:, :4]))
    out.append(logits)
    for t in range(4, 7):  # one token per step
        logits, cache = step(m, tokens[:, t:t + 1], cache, jnp.ones((2, 1), bool))
        out.append(logits)
    got = np.asarray(jnp.concatenate(out, axis=1))
    np.testing.assert_allclose(got[REAL], _alone_and_padded()[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache[0].token_count())[:, 0], [7, 5])


def test_a_fox_token_written_past_the_cache_slots_raises_or_gives_a_nan_row():
    m, _ = _model_and_tokens()
    tokens = jnp.zeros((2, 1), jnp.int32)
    positions = np.array([[0], [8]])  # the cache holds positions 0 .. 7
    with pytest.raises(ValueError, match="token 0 of row 1 is at position 8"):
        m.decode_step(tokens, m.init_cache(2, 8), positions=positions)
    logits, _ = nnx.jit(lambda m, t, c, p: m.decode_step(t, c, positions=p))(
        m, tokens, m.init_cache(2, 8), jnp.asarray(positions))
    assert np.isfinite(np.asarray(logits[0])).all() and np.isnan(np.asarray(logits[1])).all()


def test_a_streaming_cache_refuses_fox():
    m, _ = _model_and_tokens()
    with pytest.raises(ValueError, match="'fox'.*per text position.*StreamingKVCache"):
        m.init_cache(1, 8, keep_first=2)
