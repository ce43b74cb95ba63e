"""SSMax and PoPE in the Flax modules (built from the registry by name): KV-cache decoding
token by token gives the logits of the full forward pass, and each layer owns its
learned parameters."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpos import nnx as jn

V, T = 40, 6


def _model(name, **kw):
    return jn.DecoderLM(V, d_model=16, num_layers=2, num_heads=2, position=name,
                        implementation="reference", rngs=nnx.Rngs(0), **kw)


@pytest.mark.parametrize("name", ["ssmax", "pope"])
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


def test_ssmax_scale_is_learned_per_layer_and_head():
    model = _model("ssmax", scheme_options={"s_init": 0.25})
    leaves = {jax.tree_util.keystr(p): np.asarray(x)
              for p, x in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
              if "['s']" in jax.tree_util.keystr(p)}
    assert len(leaves) == 2, leaves.keys()  # one per layer
    for x in leaves.values():
        np.testing.assert_array_equal(x, np.full(2, 0.25, np.float32))
