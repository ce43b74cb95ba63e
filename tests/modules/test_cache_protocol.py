"""The modules' KV-cache protocol (:class:`jaxpos.layers.cache.Cache`): a cache type written
outside the library, one class and one ``register_cache`` call, is built by ``init_cache``
and decoded by ``decode_step`` with no change to the decode code. The one here is a rolling
buffer of the last ``W`` tokens (Mistral's rolling buffer cache, Jiang et al. 2023, §2):
slot ``i mod W`` holds token ``i``, so slot order is not position order once it wraps; with
a sliding window of ``W`` every step equals the full pass. Also: the caches stay pytrees a
jitted step may donate, and ``init_cache`` options select exactly one cache type.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxpos
from jaxpos.layers.cache import Cache, CacheRead, register_cache, rotate_at_write
from jaxpos.nnx import DecoderLM


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RollingCache(Cache):
    k: jax.Array
    v: jax.Array
    positions: jax.Array
    valid: jax.Array
    tokens: jax.Array

    @property
    def batch_size(self) -> int:
        return self.positions.shape[0]

    def token_count(self) -> jax.Array:
        return self.tokens[:, None]

    def write(self, scheme, q, k, v, positions, mask):
        q, k, scheme = rotate_at_write(scheme, q, k, positions)
        (B, W), T = self.positions.shape, q.shape[1]
        mask = jnp.ones((B, T), bool) if mask is None else mask
        idx = self.tokens[:, None] + jnp.cumsum(mask, axis=-1, dtype=jnp.int32) - 1
        slots = jnp.where(mask, jnp.mod(idx, W), W)  # padding: dropped
        rows = jnp.arange(B)[:, None]
        new = RollingCache(self.k.at[rows, slots].set(k, mode="drop"),
                           self.v.at[rows, slots].set(v, mode="drop"),
                           self.positions.at[rows, slots].set(positions, mode="drop"),
                           self.valid.at[rows, slots].set(1, mode="drop"),
                           self.tokens + mask.sum(-1, dtype=jnp.int32))
        return new, CacheRead(q, new.k, new.v, scheme, positions, new.positions,
                              mask.astype(jnp.int32), new.valid,
                              jnp.minimum(new.tokens, W), jnp.zeros((B,), bool))


def init_rolling(batch, max_len, num_kv_heads, head_dim, dtype, rolling):
    shape = (batch, max_len, num_kv_heads, head_dim)
    z = jnp.zeros((batch, max_len), jnp.int32)
    return RollingCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), z, z + 0,
                        jnp.zeros((batch,), jnp.int32))


register_cache(("rolling",), init_rolling)
W = 4


def _model(position="rope"):
    return DecoderLM(40, d_model=16, num_layers=1, num_heads=2, position=position,
                     mask_mod=jaxpos.SlidingWindowMask(W), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("position", ["rope", pytest.param("alibi", marks=pytest.mark.slow)])
def test_a_cache_type_defined_outside_decodes_as_the_full_pass(position):
    m = _model(position)
    toks = jax.random.randint(jax.random.key(2), (2, 10), 0, 40)
    step = nnx.jit(lambda m, t, c: m.decode_step(t, c))
    cache = m.init_cache(2, W, rolling=True)
    assert isinstance(cache[0], RollingCache)
    logits, cache = step(m, toks[:, :3], cache)
    outs = [logits]
    for t in range(3, 10):  # the buffer wraps at token 4
        logits, cache = step(m, toks[:, t:t + 1], cache)
        outs.append(logits)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), m(toks), atol=2e-5)


def test_a_streaming_cache_can_be_donated_to_a_jitted_step():
    m = _model("rope")
    graph, state = nnx.split(m)

    def step(state, tokens, cache):
        return nnx.merge(graph, state).decode_step(tokens, cache)

    toks = jnp.asarray([[1, 2, 3], [4, 5, 6]])
    want, _ = jax.jit(step)(state, toks, m.init_cache(2, 6, keep_first=2))
    got, cache = jax.jit(step, donate_argnums=(2,))(state, toks, m.init_cache(2, 6,
                                                                              keep_first=2))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(cache[0].tokens, [3, 3])


def test_init_cache_options_select_exactly_one_cache_type():
    m = _model()
    with pytest.raises(ValueError, match="keep_first.*rolling"):
        m.init_cache(1, 4, keep_first=1, rolling=True)
    with pytest.raises(ValueError, match="page_sz"):
        m.init_cache(1, 4, page_sz=2)
    with pytest.raises(ValueError, match="already owned"):
        register_cache(("rolling", "keep_first"), init_rolling)
