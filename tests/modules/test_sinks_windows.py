"""Attention sinks and mask_mods in the Flax modules (jaxpos.nnx, jaxpos.linen).

``MultiHeadAttention(sinks=True, mask_mod=...)`` must compute the softmax with one extra
per-head logit in the denominator (GPT-OSS's learned sinks; Hugging Face
``eager_attention_forward`` of ``modeling_gpt_oss.py`` concatenates the sink to the
scores, softmaxes and drops that column) over the keys a mask_mod leaves visible (a
causal sliding window, Hugging Face ``sliding_window_overlay``: ``kv > q - window``). The
reference here is written from those definitions in float64 NumPy; the layer is also
checked against :func:`jaxpos.attention` called by hand with the layer's own weights.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import jaxpos
from jaxpos import linen as jl
from jaxpos import nnx as jn

B, T, D, N, NK = 2, 7, 16, 4, 2     # grouped-query: 2 query heads per key/value head
H = D // N
WINDOW = 3                           # smaller than T: the window hides keys
V = 31


def np_sink_window_attention(q, k, v, sinks, window, scale):
    """float64 reference: causal sliding-window attention with a sink logit per head.

    q ``[B, T, N, H]``, k/v ``[B, T, Nk, H]``, sinks ``[N]``; key ``j`` is visible from
    query ``i`` when ``j <= i`` and ``i - j < window``; weights
    ``exp(s_ij) / (exp(sink_h) + sum_visible exp(s_ij))``.
    """
    q, k, v, sinks = (np.asarray(a, np.float64) for a in (q, k, v, sinks))
    groups = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    s = np.einsum("bqnh,bknh->bnqk", q, k) * scale
    i = np.arange(q.shape[1])[:, None]
    j = np.arange(k.shape[1])[None, :]
    s = np.where((j <= i) & (i - j < window), s, -np.inf)
    sink = np.broadcast_to(sinks[None, :, None, None], s.shape[:3] + (1,))
    logits = np.concatenate([s, sink], axis=-1)
    m = logits.max(axis=-1, keepdims=True)
    e = np.exp(logits - m)
    p = (e / e.sum(axis=-1, keepdims=True))[..., :-1]   # the sink column is dropped
    return np.einsum("bnqk,bknh->bqnh", p, v)


def weights_of(mha):
    """The layer's projection kernels as NumPy arrays."""
    return {n: np.asarray(getattr(mha, n).kernel[...]) for n in
            ("q_proj", "k_proj", "v_proj", "o_proj")}


def set_sinks(mha, values):
    mha.sinks[...] = jnp.asarray(values, jnp.float32)


def make_mha(rngs_seed=0, **kw):
    kw.setdefault("causal", True)
    return jn.MultiHeadAttention(D, N, num_kv_heads=NK, rngs=nnx.Rngs(rngs_seed), **kw)


SINK_VALUES = np.array([0.7, -1.3, 2.1, 0.0], np.float32)


def inputs(seed=0):
    return jax.random.normal(jax.random.key(seed), (B, T, D), jnp.float32)


@pytest.mark.parametrize("implementation", ["reference", "chunked"])
def test_sinks_and_sliding_window_match_numpy_and_attention_by_hand(implementation):
    mha = make_mha(sinks=True, mask_mod=jaxpos.SlidingWindowMask(WINDOW),
                   implementation=implementation)
    assert mha.sinks[...].shape == (N,) and not np.any(np.asarray(mha.sinks[...]))  # zeros
    set_sinks(mha, SINK_VALUES)
    x = inputs()
    got = np.asarray(mha(x))

    w = weights_of(mha)
    xn = np.asarray(x, np.float64)
    q = (xn @ w["q_proj"]).reshape(B, T, N, H)
    k = (xn @ w["k_proj"]).reshape(B, T, NK, H)
    v = (xn @ w["v_proj"]).reshape(B, T, NK, H)

    # float64 NumPy reference from the definitions.
    o = np_sink_window_attention(q, k, v, SINK_VALUES, WINDOW, 1 / np.sqrt(H))
    want = o.reshape(B, T, N * H) @ w["o_proj"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    # jaxpos.attention called by hand with the same projections.
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    o2 = jaxpos.attention(f32(q), f32(k), f32(v), causal=True, sinks=SINK_VALUES,
                          mask_mod=jaxpos.SlidingWindowMask(WINDOW),
                          implementation=implementation)
    by_hand = np.asarray(o2).reshape(B, T, N * H) @ w["o_proj"]
    np.testing.assert_allclose(got, by_hand, rtol=1e-5, atol=1e-6)

    # Neither term is vacuous: without the sinks, or without the window, the output moves.
    no_sink = np_sink_window_attention(q, k, v, np.full(N, -np.inf), WINDOW, 1 / np.sqrt(H))
    no_window = np_sink_window_attention(q, k, v, SINK_VALUES, T, 1 / np.sqrt(H))
    for other in (no_sink, no_window):
        assert np.abs(other.reshape(B, T, N * H) @ w["o_proj"] - want).max() > 1e-2


def test_rope_layer_with_sinks_and_window_equals_attention_by_hand():
    mha = make_mha(position="rope", sinks=True, mask_mod=jaxpos.SlidingWindowMask(WINDOW))
    set_sinks(mha, SINK_VALUES)
    x = inputs(1)
    positions = np.array([[0, 1, 2, 3, 4, 5, 6], [4, 5, 6, 7, 8, 9, 10]])  # row offsets
    w = weights_of(mha)
    q = jnp.asarray((np.asarray(x) @ w["q_proj"]).reshape(B, T, N, H))
    k = jnp.asarray((np.asarray(x) @ w["k_proj"]).reshape(B, T, NK, H))
    v = jnp.asarray((np.asarray(x) @ w["v_proj"]).reshape(B, T, NK, H))
    o = jaxpos.attention(q, k, v, position=mha.position_module.scheme(), causal=True,
                         sinks=SINK_VALUES, mask_mod=jaxpos.SlidingWindowMask(WINDOW),
                         q_positions=positions, kv_positions=positions,
                         implementation="reference")
    want = np.asarray(o).reshape(B, T, N * H) @ w["o_proj"]
    np.testing.assert_allclose(mha(x, positions=positions), want, rtol=1e-5, atol=1e-5)


def jnp_reference_loss(sinks, q, k, v, weights):
    """The NumPy reference's formula in jax.numpy (float32), for an independent gradient."""
    groups = N // NK
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    s = jnp.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(H)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    s = jnp.where((j <= i) & (i - j < WINDOW), s, -jnp.inf)
    sink = jnp.broadcast_to(sinks[None, :, None, None], s.shape[:3] + (1,))
    p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]
    return jnp.sum(jnp.einsum("bnqk,bknh->bqnh", p, v) * weights)


@pytest.mark.parametrize("implementation", ["reference", "chunked"])
def test_gradient_reaches_sinks(implementation):
    mha = make_mha(sinks=True, mask_mod=jaxpos.SlidingWindowMask(WINDOW),
                   implementation=implementation)
    set_sinks(mha, SINK_VALUES)
    x = inputs(2)
    cot = jax.random.normal(jax.random.key(3), (B, T, D))
    grads = nnx.grad(lambda m: jnp.sum(m(x) * cot))(mha)
    g = np.asarray(grads["sinks"][...])
    assert g.shape == (N,) and np.all(np.abs(g) > 1e-4)

    # d loss / d sinks from the written-out formula (the output projection folded into
    # the cotangent of the attention output).
    w = weights_of(mha)
    q = jnp.asarray((np.asarray(x) @ w["q_proj"]).reshape(B, T, N, H))
    k = jnp.asarray((np.asarray(x) @ w["k_proj"]).reshape(B, T, NK, H))
    v = jnp.asarray((np.asarray(x) @ w["v_proj"]).reshape(B, T, NK, H))
    cot_o = (np.asarray(cot) @ w["o_proj"].T).reshape(B, T, N, H)
    want = jax.grad(jnp_reference_loss)(jnp.asarray(SINK_VALUES), q, k, v, cot_o)
    np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("position", ["nope", "rope"])
def test_kv_cache_decoding_with_window_and_sinks_equals_full_pass(position):
    mha = make_mha(position=position, sinks=True, mask_mod=jaxpos.SlidingWindowMask(WINDOW),
                   implementation="reference")
    set_sinks(mha, SINK_VALUES)
    x = inputs(4)
    full = np.asarray(mha(x))
    cache = mha.init_cache(B, T)
    decode = nnx.jit(lambda m, xt, c: m.decode(xt, c))   # positions from the fill counts
    outs = []
    y, cache = decode(mha, x[:, :2], cache)      # a two-token prefill, then one at a time
    outs.append(y)
    for t in range(2, T):
        y, cache = decode(mha, x[:, t:t + 1], cache)
        outs.append(y)
    np.testing.assert_allclose(np.concatenate(outs, axis=1), full, rtol=1e-5, atol=1e-5)
    # The window bites while decoding: a layer without it differs at the last step.
    plain = make_mha(position=position, sinks=True)
    set_sinks(plain, SINK_VALUES)
    assert np.abs(np.asarray(plain(x))[:, -1] - full[:, -1]).max() > 1e-3


def test_decoder_lm_decode_step_with_layer_mask_mods_equals_full_pass():
    model = jn.DecoderLM(V, d_model=D, num_layers=2, num_heads=N, num_kv_heads=NK,
                         sinks=True, layer_mask_mods=[jaxpos.SlidingWindowMask(WINDOW), None],
                         implementation="reference", rngs=nnx.Rngs(0))
    for i, block in enumerate(model.blocks):
        set_sinks(block.attn, SINK_VALUES * (i + 1))
    assert model.blocks[0].attn.mask_mod == jaxpos.SlidingWindowMask(WINDOW)
    assert model.blocks[1].attn.mask_mod is None
    tokens = jax.random.randint(jax.random.key(5), (B, T), 0, V)
    full = np.asarray(model(tokens))
    cache = model.init_cache(B, T)
    step = nnx.jit(lambda m, tok, c: m.decode_step(tok, c))
    steps = []
    for t in range(T):
        lg, cache = step(model, tokens[:, t:t + 1], cache)
        steps.append(lg)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=1e-4, atol=1e-4)


def nnx_and_linen_mha(**kw):
    args = dict(num_kv_heads=NK, causal=True, implementation="reference", **kw)
    return jn.MultiHeadAttention(D, N, rngs=nnx.Rngs(0), **args), jl.MultiHeadAttention(D, N,
                                                                                         **args)


def test_linen_twin_equals_nnx_with_sinks_and_window():
    nnx_mha, linen_mha = nnx_and_linen_mha(position="rope", sinks=True,
                                           mask_mod=jaxpos.SlidingWindowMask(WINDOW))
    set_sinks(nnx_mha, SINK_VALUES)
    x = inputs(6)
    own = nn.unbox(linen_mha.init(jax.random.key(1), x)["params"])
    assert own["sinks"].shape == (N,) and not np.any(np.asarray(own["sinks"]))  # zeros
    params = jl.params_from_nnx(nnx_mha)
    assert jax.tree_util.tree_map(jnp.shape, own) == jax.tree_util.tree_map(jnp.shape, params)
    np.testing.assert_array_equal(linen_mha.apply({"params": params}, x), nnx_mha(x))
    # Decoding through the Linen twin, too.
    cache = linen_mha.init_cache(B, T)
    y, cache = linen_mha.apply({"params": params}, x[:, :4], cache, method="decode")
    np.testing.assert_allclose(y, nnx_mha(x)[:, :4], rtol=1e-5, atol=1e-5)


def test_linen_decoder_twin_equals_nnx_with_layer_mask_mods_and_sinks():
    args = dict(d_model=D, num_layers=2, num_heads=N, num_kv_heads=NK, sinks=True,
                layer_mask_mods=[None, jaxpos.SlidingWindowMask(2)], implementation="reference")
    nnx_model = jn.DecoderLM(V, rngs=nnx.Rngs(0), **args)
    linen_model = jl.DecoderLM(V, **args)
    for i, block in enumerate(nnx_model.blocks):
        set_sinks(block.attn, SINK_VALUES - i)
    tokens = jax.random.randint(jax.random.key(7), (B, T), 0, V)
    params = jl.params_from_nnx(nnx_model)
    np.testing.assert_array_equal(params["blocks_1"]["attn"]["sinks"], SINK_VALUES - 1)
    np.testing.assert_array_equal(linen_model.apply({"params": params}, tokens),
                                  nnx_model(tokens))


def test_call_time_mask_mod_overrides_the_layers():
    x = inputs(8)
    narrow = make_mha(mask_mod=jaxpos.SlidingWindowMask(2))
    wide = make_mha(mask_mod=jaxpos.SlidingWindowMask(WINDOW))   # same seed: same weights
    plain = make_mha()
    np.testing.assert_array_equal(narrow(x, mask_mod=jaxpos.SlidingWindowMask(WINDOW)), wide(x))
    np.testing.assert_array_equal(plain(x, mask_mod=jaxpos.SlidingWindowMask(WINDOW)), wide(x))
    cache = plain.init_cache(B, T)
    y, _ = plain.decode(x, cache, mask_mod=jaxpos.SlidingWindowMask(WINDOW))
    np.testing.assert_allclose(y, wide(x), rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="mask_mod"):
        plain(x, mask_mod=3)


def test_sinks_default_false_leaves_outputs_and_parameters_unchanged():
    x = inputs(9)
    before = make_mha(position="rope")          # built without the new options
    explicit = make_mha(position="rope", sinks=False, mask_mod=None)
    assert explicit.sinks is None
    np.testing.assert_array_equal(explicit(x), before(x))
    assert (jax.tree_util.tree_map(jnp.shape, nnx.to_pure_dict(nnx.state(explicit, nnx.Param)))
            == jax.tree_util.tree_map(jnp.shape, nnx.to_pure_dict(nnx.state(before,
                                                                            nnx.Param))))
    # Stacks: the default builds the same parameters and logits as before.
    tokens = jax.random.randint(jax.random.key(10), (B, T), 0, V)
    lm_before = jn.DecoderLM(V, d_model=D, num_layers=2, num_heads=N, rngs=nnx.Rngs(0))
    lm_explicit = jn.DecoderLM(V, d_model=D, num_layers=2, num_heads=N, sinks=False,
                               mask_mod=None, layer_mask_mods=None, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(lm_explicit(tokens), lm_before(tokens))
    # A sink logit of -inf adds exp(-inf) = 0 to the denominator: the plain softmax.
    with_sinks = make_mha(position="rope", sinks=True)   # the sinks take no random draws
    set_sinks(with_sinks, np.full(N, -np.inf))
    np.testing.assert_allclose(with_sinks(x), before(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cls", [jn.DecoderLM, jn.Encoder])
def test_layer_mask_mods_validation(cls):
    build = lambda **kw: cls(V, d_model=D, num_layers=2, num_heads=N, rngs=nnx.Rngs(0), **kw)
    with pytest.raises(ValueError, match="layer_mask_mods"):
        build(layer_mask_mods=[jaxpos.SlidingWindowMask(2)])          # 1 entry, 2 layers
    with pytest.raises(TypeError, match=r"layer_mask_mods\[1\]"):
        build(layer_mask_mods=[None, 4])                              # not a callable
    with pytest.raises(TypeError, match="layer_mask_mods"):
        build(layer_mask_mods=jaxpos.SlidingWindowMask(2))            # not a list
    with pytest.raises(ValueError, match="layer_mask_mods"):
        build(mask_mod=jaxpos.SlidingWindowMask(2), layer_mask_mods=[None, None])
    with pytest.raises(TypeError, match="mask_mod"):
        build(mask_mod="sliding")
    with pytest.raises(TypeError, match="sinks"):
        build(sinks=1.0)


def test_linen_layer_mask_mods_validation_and_bad_options():
    tokens = jnp.zeros((1, 4), jnp.int32)
    bad = jl.DecoderLM(V, D, 2, N, layer_mask_mods=(None, None, None))
    with pytest.raises(ValueError, match="layer_mask_mods"):
        bad.init(jax.random.key(0), tokens)
    bad = jl.DecoderLM(V, D, 2, N, layer_mask_mods=[None, "window"])
    with pytest.raises(TypeError, match=r"layer_mask_mods\[1\]"):
        bad.init(jax.random.key(0), tokens)
    with pytest.raises(TypeError, match="sinks"):
        jl.MultiHeadAttention(D, N, sinks="yes").init(jax.random.key(0), inputs())
    with pytest.raises(TypeError, match="mask_mod"):
        make_mha(mask_mod=WINDOW)
