"""KERPLE, FIRE, Sandwich, xPos and FoX in the Flax modules (built from the scheme
registry by name): KV-cache decoding token by token gives the logits of the full
forward pass (the cache keeps raw keys and positions; each scheme is applied at read
time, xPos with the centre of the positions of each call), and FoX, whose bias needs
the forget gates of every cached token, refuses to decode instead of giving other
numbers.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpos import nnx as jn

V, T = 40, 6


def _model(name):
    return jn.DecoderLM(V, d_model=16, num_layers=2, num_heads=2, position=name,
                        implementation="reference", rngs=nnx.Rngs(0))


@pytest.mark.parametrize("name", ["kerple_log", "kerple_power", "fire", "sandwich", "xpos"])
def test_cached_decoding_equals_the_full_pass(name):
    model = _model(name)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, T), 0, V)
    full = np.asarray(model(tokens))
    cache = model.init_cache(2, T)
    logits, cache = model.decode_step(tokens[:, :2], cache)  # a prefill of two tokens
    steps = [np.asarray(logits)]
    for t in range(2, T):
        logits, cache = model.decode_step(tokens[:, t:t + 1], cache)
        steps.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=2e-5, atol=2e-5)


def test_fox_refuses_cached_decoding():
    model = _model("fox")
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, T), 0, V)
    assert np.isfinite(np.asarray(model(tokens))).all()
    with pytest.raises(ValueError, match="KV cache"):
        model.decode_step(tokens[:, :1], model.init_cache(2, T))
