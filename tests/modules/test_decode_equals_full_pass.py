"""KV-cache decoding equals the full causal pass, for every position the modules build
(``jaxpos.nnx.POSITIONS``: the registered schemes plus sinusoidal/learned embeddings)
and each module kind (the NNX ``DecoderLM`` and its Linen twin).

One shape for all: two layers, batch rows starting at different positions (offsets 0
and 4) and prefilling different prompt lengths (3 and 1 tokens, each row decoded on its
own and the two caches concatenated), then three tokens one at a time with both rows in
one call. Every step's logits equal the full pass's at those positions (float32, eager,
``2e-5``) and the cache counts the tokens written. FoX indexes its forget gates by token
position, so its full pass takes rows that start at position 0: both its rows do.

The default run decodes every scheme but FIRE, PoPE and PaTH with NNX (reference
implementation) and RoPE with Linen; those three, stick-breaking through the chunked
implementation and the Linen twins of the schemes whose decoding keeps state of its own
(PaTH, FoX, CoPE) run with ``-m slow`` (the twins share the cores,
``tests/modules/test_linen.py`` checks their logits are identical).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpos import linen as jl
from jaxpos import nnx as jn

V, D, N, T = 40, 16, 2, 7
OFFSETS = np.array([0, 4])  # row 1 starts at position 4
PROMPT = (3, 1)             # tokens each row prefills
FROM_ZERO = {"fox"}  # schemes whose rows must start at position 0
LINEN_DEFAULT = {"rope"}
# the Linen twins share the NNX modules' cores (tests/modules/test_linen.py checks their
# logits are identical): besides RoPE, the slow run decodes with Linen only the schemes
# whose decoding keeps state of its own in the cache (PaTH, FoX, CoPE)
LINEN_SLOW = {"path", "fox", "cope"}
NNX_SLOW = {"fire", "pope", "path", "path_fox"}  # the most expensive eager decodes (PaTH also in
# tests/modules/test_path_decoding.py); xPos stays (read-time transform)

CASES = (
    [pytest.param(p, "nnx", "reference", id=f"{p}-nnx",
                  marks=pytest.mark.slow if p in NNX_SLOW else ()) for p in jn.POSITIONS]
    + [pytest.param("stick_breaking", "nnx", "chunked", id="stick_breaking-nnx-chunked",
                    marks=pytest.mark.slow)]
    + [pytest.param(p, "linen", "reference", id=f"{p}-linen",
                    marks=() if p in LINEN_DEFAULT else pytest.mark.slow)
       for p in jn.POSITIONS if p in LINEN_DEFAULT | LINEN_SLOW]
)


def _model(position, kind, implementation):
    """``(full(tokens, positions), init_cache(B, L), decode(tokens, cache, positions))``."""
    args = dict(d_model=D, num_layers=2, num_heads=N, position=position, max_len=16,
                implementation=implementation)
    if kind == "nnx":
        m = jn.DecoderLM(V, rngs=nnx.Rngs(0), **args)
        return (lambda t, p: m(t, positions=p), m.init_cache,
                lambda t, c, p: m.decode_step(t, c, positions=p))
    m = jl.DecoderLM(V, **args)
    params = m.init(jax.random.key(0), jnp.zeros((1, T), jnp.int32))
    return (lambda t, p: m.apply(params, t, positions=p), m.init_cache,
            lambda t, c, p: m.apply(params, t, c, positions=p, method="decode_step"))


def _concat_rows(*caches):
    return jax.tree_util.tree_map(lambda *xs: jnp.concatenate(xs, axis=0), *caches)


@pytest.mark.parametrize(("position", "kind", "implementation"), CASES)
def test_kv_cache_decoding_equals_the_full_pass(position, kind, implementation):
    full_pass, init_cache, decode = _model(position, kind, implementation)
    tokens = jax.random.randint(jax.random.key(1), (2, T), 0, V)
    offsets = 0 * OFFSETS if position in FROM_ZERO else OFFSETS
    positions = offsets[:, None] + np.arange(T)
    full = np.asarray(full_pass(tokens, positions))  # [2, T, V]
    caches = []
    for b, n in enumerate(PROMPT):
        logits, cache = decode(tokens[b:b + 1, :n], init_cache(1, 8), positions[b:b + 1, :n])
        np.testing.assert_allclose(logits[0], full[b, :n], rtol=2e-5, atol=2e-5,
                                   err_msg=f"prefill of row {b}")
        caches.append(cache)
    cache = _concat_rows(*caches)
    np.testing.assert_array_equal(cache[0].token_count()[:, 0], PROMPT)
    rows = np.arange(2)
    for s in range(3):
        idx = np.array(PROMPT) + s
        logits, cache = decode(tokens[rows, idx][:, None], cache, positions[rows, idx][:, None])
        np.testing.assert_allclose(logits[:, 0], full[rows, idx], rtol=2e-5, atol=2e-5,
                                   err_msg=f"decode step {s}")
    np.testing.assert_array_equal(cache[-1].token_count()[:, 0], np.array(PROMPT) + 3)
