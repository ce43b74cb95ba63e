"""RNoPE-SWA layouts (Yang et al. 2025, §5): the helper's layout written out, a DecoderLM
built from it runs RoPE with a sliding window in the local layers and NoPE full attention
in the global ones (each layer against jaxpos.attention on its own projections), KV-cache
decoding equals the full pass, the Linen twin gives the same logits, and bad
``layer_positions`` are refused."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import jaxpos
from jaxpos import linen as jl
from jaxpos import nnx as jn
from jaxpos.schemes.rnope import rnope_swa_layers

V, D, N, T, W = 40, 16, 2, 9, 3


def _model(**kw):
    return jn.DecoderLM(V, d_model=D, num_layers=4, num_heads=N, implementation="reference",
                        rngs=nnx.Rngs(0), **rnope_swa_layers(4, W), **kw)


def test_layout_written_out():
    lay = rnope_swa_layers(8, 5)
    assert lay["position"] == "nope"
    assert lay["layer_positions"] == ["rope", "rope", "rope", "nope"] * 2
    assert lay["layer_mask_mods"] == [jaxpos.SlidingWindowMask(5)] * 3 + [None] + \
        [jaxpos.SlidingWindowMask(5)] * 3 + [None]
    assert rnope_swa_layers(3, 2, global_every=1)["layer_positions"] == ["nope"] * 3


def test_local_layers_are_windowed_rope_and_global_layers_full_nope():
    model = _model()
    x = jax.random.normal(jax.random.PRNGKey(1), (2, T, D))
    proj = lambda m: (x @ m.kernel[...]).reshape(2, T, N, D // N)
    for i, (scheme, mask_mod) in enumerate([(jaxpos.RoPE(rotary_dim=D // N),
                                             jaxpos.SlidingWindowMask(W)),
                                            (None, None)]):
        attn = model.blocks[0 if i == 0 else 3].attn
        o = jaxpos.attention(proj(attn.q_proj), proj(attn.k_proj), proj(attn.v_proj),
                             position=scheme, causal=True, mask_mod=mask_mod,
                             implementation="reference")
        want = o.reshape(2, T, D) @ attn.o_proj.kernel[...]
        np.testing.assert_allclose(np.asarray(attn(x)), np.asarray(want), atol=2e-5,
                                   rtol=2e-5)


def test_decoding_equals_the_full_pass_and_the_linen_twin_agrees():
    model = _model()
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, T), 0, V)
    full = np.asarray(model(tokens))
    cache = model.init_cache(2, T)
    logits, cache = model.decode_step(tokens[:, :4], cache)
    steps = [np.asarray(logits)]
    for t in range(4, T):
        logits, cache = model.decode_step(tokens[:, t:t + 1], cache)
        steps.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(steps, 1), full, rtol=2e-5, atol=2e-5)
    twin = jl.DecoderLM(V, d_model=D, num_layers=4, num_heads=N, implementation="reference",
                        **rnope_swa_layers(4, W))
    got = twin.apply({"params": jl.params_from_nnx(model)}, tokens)
    np.testing.assert_allclose(np.asarray(got), full, rtol=1e-6, atol=1e-6)


def test_bad_layer_positions():
    with pytest.raises(ValueError, match="position must then be 'nope'"):
        jn.DecoderLM(V, d_model=D, num_layers=2, num_heads=N, position="rope",
                     layer_positions=["rope", "nope"], rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="one entry per layer"):
        jn.DecoderLM(V, d_model=D, num_layers=2, num_heads=N, position="nope",
                     layer_positions=["rope"], rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="layer_positions\\[1\\]"):
        jn.DecoderLM(V, d_model=D, num_layers=2, num_heads=N, position="nope",
                     layer_positions=["rope", "nonesuch"], rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="sliding_window"):
        rnope_swa_layers(4, 0)
