"""The modules' KV-cache decode path at the cost of the cache's filled length:

* RoPE keys are rotated once, when written (the cache holds rotated keys, read with no
  position transform), and decoding equals the full pass;
* exact dynamic NTK (``rope_cache_rotation="read"``): every cached key rotated with the
  current length's base, so each step equals the full pass at that length; Hugging Face's
  rotate-at-write rule (the default) gives something else once the length passes
  ``original_max_position_embeddings``;
* a decode step's jaxpr holds no array with an axis of ``max_len`` besides the cache update
  (no positions, masks, segment ids, rotation or count over the whole cache).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpos.layers.functional import rms_norm
from jaxpos.nnx import DecoderLM
from jaxpos.schemes.rope import apply_rope
from jaxpos.schemes.rope.scaling import DynamicNTKScaling


def _model(position="rope", **kw):
    return DecoderLM(48, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2,
                     position=position, rngs=nnx.Rngs(0), **kw)


def _tokens(B=2, T=10, seed=1):
    return jax.random.randint(jax.random.key(seed), (B, T), 0, 48)


def test_rope_cache_holds_keys_rotated_at_their_positions():
    """The cache's keys are the projected keys rotated at their positions (RoPE applied
    once, at write); a decode step never rotates them again."""
    m = _model()
    toks = _tokens(T=6)
    _, cache = m.decode_step(toks, m.init_cache(2, 8))
    block = m.blocks[0]
    x = m._embed(toks, jnp.arange(6)[None])
    _, k, _ = block.attn._qkv(rms_norm(x, block.attn_norm.scale[...]))  # [2, 6, 2, 8] raw
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8)
    want = apply_rope(k, jnp.arange(6), jnp.asarray(inv_freq, jnp.float32))
    np.testing.assert_allclose(cache[0].k[:, :6], want, atol=1e-5)
    np.testing.assert_array_equal(cache[0].k[:, 6:], 0.0)


@pytest.mark.parametrize("position", ["nope", "rope", "alibi", "t5"])
def test_decode_one_token_at_a_time_equals_the_full_pass(position):
    m = _model(position, max_len=16)
    toks = _tokens()
    full = m(toks)
    step = nnx.jit(lambda model, t, c: model.decode_step(t, c))
    logits, cache = step(m, toks[:, :4], m.init_cache(2, 16))
    outs = [logits]
    for i in range(4, 10):
        logits, cache = step(m, toks[:, i:i + 1], cache)
        outs.append(logits)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=2e-5)


def test_exact_dynamic_ntk_decode_equals_the_full_pass_at_each_length():
    """Raw keys in the cache, every key rotated at read with the current length's base:
    the logits of step ``t`` are those of the full pass over the first ``t + 1`` tokens
    (whose dynamic NTK base is that length's). Past ``original_max_position_embeddings``
    the rotate-at-write default differs from it."""
    scaling = DynamicNTKScaling(factor=4.0, original_max_position_embeddings=4)
    exact = _model(scheme_options={"rope_scaling": scaling, "rope_cache_rotation": "read"})
    written = _model(scheme_options={"rope_scaling": scaling})
    toks = _tokens(T=10)
    ce, cw = exact.init_cache(2, 16), written.init_cache(2, 16)
    _, ce = exact.decode_step(toks[:, :2], ce)
    _, cw = written.decode_step(toks[:, :2], cw)
    gap = 0.0
    for t in range(2, 10):
        le, ce = exact.decode_step(toks[:, t:t + 1], ce)
        lw, cw = written.decode_step(toks[:, t:t + 1], cw)
        want = exact(toks[:, :t + 1])[:, -1:]
        np.testing.assert_allclose(le, want, atol=2e-5)
        gap = max(gap, float(jnp.abs(lw - want).max()))
    assert gap > 1e-3  # HF's rule keeps each key's old base


def _outputs_with_axis(jaxpr, size, acc):
    """(primitive, shape) of every equation output (loops and calls included) with an
    axis of ``size``."""
    for e in jaxpr.eqns:
        for o in e.outvars:
            shp = getattr(o.aval, "shape", ())
            if size in shp:
                acc.append((e.primitive.name, tuple(shp)))
        for p in e.params.values():
            for s in (p if isinstance(p, (list, tuple)) else [p]):
                inner = getattr(s, "jaxpr", None)
                if inner is not None:
                    _outputs_with_axis(inner if hasattr(inner, "eqns") else inner.jaxpr, size,
                                       acc)
    return acc


@pytest.mark.parametrize("position", ["nope", "rope", "alibi", "t5"])
def test_decode_step_makes_no_pass_over_the_cache(position):
    """Against a cache of 4099 slots, the only equations producing an array with an axis of
    4099 are the scatters writing the new token (keys, values, positions, segment ids):
    no mask, position, segment-id, rotation, count or dtype pass over the whole cache; the
    attention slices blocks of the filled part (``kv_lengths``)."""
    S = 4099
    m = _model(position)
    cache = m.init_cache(2, S)
    graph, state = nnx.split(m)

    def step(state, tokens, cache):
        return nnx.merge(graph, state).decode_step(tokens, cache)

    jaxpr = jax.make_jaxpr(step)(state, _tokens(T=1), cache).jaxpr
    found = _outputs_with_axis(jaxpr, S, [])
    assert found and all(p == "scatter" for p, _ in found), found


def test_a_fresh_cache_can_be_donated_to_a_jitted_step():
    """init_cache gives every field its own buffer, so a step that donates the cache
    (updated in place, as generation runs) accepts a fresh one; the result equals the
    undonated step."""
    m = _model("rope")
    graph, state = nnx.split(m)

    def step(state, tokens, cache):
        return nnx.merge(graph, state).decode_step(tokens, cache)

    toks = _tokens(T=3)
    want, _ = jax.jit(step)(state, toks, m.init_cache(2, 8))
    got, cache = jax.jit(step, donate_argnums=(2,))(state, toks, m.init_cache(2, 8))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(cache[0].length, [3, 3])
