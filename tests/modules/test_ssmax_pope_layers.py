"""SSMax and PoPE in the Flax modules (built from the registry by name): each layer owns
its learned parameters (their KV-cache decoding:
``tests/modules/test_decode_equals_full_pass.py``)."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from jaxpos import nnx as jn

V, T = 40, 6


def _model(name, **kw):
    return jn.DecoderLM(V, d_model=16, num_layers=2, num_heads=2, position=name,
                        implementation="reference", rngs=nnx.Rngs(0), **kw)


def test_ssmax_scale_is_learned_per_layer_and_head():
    model = _model("ssmax", scheme_options={"s_init": 0.25})
    leaves = {jax.tree_util.keystr(p): np.asarray(x)
              for p, x in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
              if "['s']" in jax.tree_util.keystr(p)}
    assert len(leaves) == 2, leaves.keys()  # one per layer
    for x in leaves.values():
        np.testing.assert_array_equal(x, np.full(2, 0.25, np.float32))
