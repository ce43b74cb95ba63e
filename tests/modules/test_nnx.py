"""Tests of the Flax NNX modules (jaxpos.nnx).

Sizes are tiny (d_model 16, 2 heads, T <= 8) and most tests run eagerly with the
reference implementation, which is cheap; the chunked path (compiled) is exercised where
the claim is about it (gradients, the default decode path).
"""

import math

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings

import jaxpos
from jaxpos import nnx as jn
from jaxpos.layers.functional import merge_heads

V, D, N, H, F = 50, 16, 2, 8, 64
SCHEMES = ("sinusoidal", "learned", "rope", "alibi", "t5", "shaw")
ALL = ("nope",) + SCHEMES


def make_decoder(position, *, num_layers=1, implementation="reference", seed=0, **kw):
    kw.setdefault("max_len", 16)
    return jn.DecoderLM(V, d_model=D, num_layers=num_layers, num_heads=N, position=position,
                        implementation=implementation, rngs=nnx.Rngs(seed), **kw)


def num_params(model):
    return sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))


# ------------------------------------------------------------ "dog bites man"
# the=0, dog=1, bites=2, man=3
DOG_BITES_MAN = [0, 1, 2, 0, 3]   # "the dog bites the man"
MAN_BITES_DOG = [0, 3, 2, 0, 1]   # "the man bites the dog"


def pooled(position, sentences):
    enc = jn.Encoder(V, d_model=D, num_layers=1, num_heads=N, position=position, max_len=8,
                     implementation="reference", rngs=nnx.Rngs(0))
    h = enc(jnp.asarray(sentences, jnp.int32))  # [2, T, D]
    return np.asarray(h.mean(axis=1), np.float64)


def test_encoder_without_positions_pools_both_orders_to_the_same_vector():
    a, b = pooled("nope", [DOG_BITES_MAN, MAN_BITES_DOG])
    # Unmasked attention, per-token norms and MLPs are permutation-equivariant, so the
    # mean over tokens is permutation-invariant: only float rounding differs.
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("position", SCHEMES)
def test_encoder_with_any_scheme_tells_the_orders_apart(position):
    a, b = pooled(position, [DOG_BITES_MAN, MAN_BITES_DOG])
    assert np.abs(a - b).max() > 1e-3, (position, np.abs(a - b).max())


def test_bidirectional_alibi_cannot_tell_a_sentence_from_its_reverse():
    # -m|i - j| is unchanged by i -> T-1-i, so a bidirectional ALiBi encoder maps the
    # reversed sentence to the reversed outputs and mean pooling cannot tell them apart.
    # "dog bites man" vs "man bites dog" is exactly that case; T5 buckets are signed.
    a, b = pooled("alibi", [[1, 2, 3], [3, 2, 1]])
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    a, b = pooled("t5", [[1, 2, 3], [3, 2, 1]])
    assert np.abs(a - b).max() > 1e-3


# ------------------------------------------------------------ KV-cache decoding
def test_jitted_default_decode_one_token_at_a_time_equals_full_forward():
    # The default path: implementation=None (chunked on CPU), default positions from the
    # cache's fill count, everything under nnx.jit.
    model = make_decoder("rope", implementation=None)
    tokens = jax.random.randint(jax.random.key(2), (2, 4), 0, V)
    full = model(tokens, implementation="reference")
    step = nnx.jit(lambda m, t, c: m.decode_step(t, c))
    cache = model.init_cache(2, 4)
    outs = []
    for t in range(4):
        lg, cache = step(model, tokens[:, t:t + 1], cache)
        outs.append(lg)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=1e-5, atol=1e-5)


def test_cache_overflow_raises_eagerly_and_poisons_rows_under_jit():
    model = make_decoder("alibi")
    tokens = jnp.zeros((2, 3), jnp.int32)
    cache = model.init_cache(2, 4)
    _, cache = model.decode_step(tokens, cache)
    with pytest.raises(ValueError, match="KV cache overflow"):
        model.decode_step(tokens, cache)
    lg, _ = nnx.jit(lambda m, t, c: m.decode_step(t, c))(model, tokens, cache)
    assert np.isnan(np.asarray(lg)).all()  # never silently written over other slots


# ------------------------------------------------------------ parameters
# Parameter count of the stack, by hand: tied embedding V*D; per block two RMSNorm scales
# (2D), q/k/v/o (4 * D * N*H with N*H = D), MLP 2 * D * F; final norm D.
PER_BLOCK = 2 * D + 4 * D * D + 2 * D * F  # 32 + 1024 + 2048 = 3104
BASE = V * D + D                           # 800 + 16


@pytest.mark.parametrize("num_layers", [2, 3])
def test_t5_table_is_one_parameter_shared_by_every_layer(num_layers):
    model = make_decoder("t5", num_layers=num_layers)
    assert num_params(make_decoder("nope", num_layers=num_layers)) == BASE + num_layers * PER_BLOCK
    # One [num_buckets=32, N] table for the whole stack, whatever the depth.
    assert num_params(model) == BASE + num_layers * PER_BLOCK + 32 * N
    tables = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_leaves_with_path(
        nnx.to_pure_dict(nnx.state(model, nnx.Param))) if x.shape == (32, N)]
    assert tables == ["['rel_position']['table']"], tables


def test_sinusoidal_table_is_not_a_parameter():
    emb = jn.SinusoidalEmbedding(4)
    assert jax.tree_util.tree_leaves(nnx.state(emb)) == []
    # Vaswani et al. 2017, §3.5 worked out for d = 4 (omega = 1, 0.01; 3 decimals).
    expected = [[0, 1, 0, 1], [0.841, 0.540, 0.010, 1.000], [0.909, -0.416, 0.020, 1.000],
                [0.141, -0.990, 0.030, 1.000]]
    np.testing.assert_allclose(emb(np.arange(4)), expected, atol=5e-4)
    # Batched, arbitrary positions: row p of the table.
    got = emb(np.array([[3, 0], [1, 2]]))
    np.testing.assert_allclose(got, np.array(expected)[[[3, 0], [1, 2]]], atol=5e-4)
    assert num_params(make_decoder("sinusoidal", num_layers=2)) == BASE + 2 * PER_BLOCK


def test_parameter_counts_of_learned_and_shaw():
    # learned: one [max_len, D] table; Shaw: [2K+1, H] keys and values per layer (K = 16).
    assert num_params(make_decoder("learned", max_len=8)) == BASE + PER_BLOCK + 8 * D
    assert num_params(make_decoder("shaw", num_layers=2)) == BASE + 2 * PER_BLOCK + 2 * 2 * 33 * H
    assert num_params(make_decoder("rope")) == num_params(make_decoder("alibi")) \
        == BASE + PER_BLOCK


# ------------------------------------------------------------ learned positions past the table
def test_learned_positions_past_the_table_raise():
    model = make_decoder("learned", max_len=8)
    ok = jnp.zeros((1, 8), jnp.int32)
    assert model(ok).shape == (1, 8, V)
    too_long = jnp.zeros((1, 9), jnp.int32)
    with pytest.raises(ValueError, match="max_len=8"):
        model(too_long)
    with pytest.raises(ValueError, match="max_len=8"):
        nnx.jit(lambda m, t: m(t))(model, too_long)
    with pytest.raises(ValueError, match=r"\[0, 8\)"):  # explicit positions 1..8
        model(ok, positions=np.arange(1, 9))
    with pytest.raises(ValueError, match="max_len"):
        jn.DecoderLM(V, d_model=D, num_layers=1, num_heads=N, position="learned",
                     rngs=nnx.Rngs(0))


def test_learned_module_lookup_and_traced_out_of_range_is_nan():
    emb = jn.LearnedPositionalEmbedding(4, 3, rngs=nnx.Rngs(0))
    table = np.asarray(emb.table[...])
    np.testing.assert_array_equal(emb(np.array([2, 0])), table[[2, 0]])
    out = jax.jit(lambda p: emb(p))(jnp.array([1, 4]))
    np.testing.assert_array_equal(out[0], table[1])
    assert np.isnan(np.asarray(out[1])).all()


# ------------------------------------------------------------ gradients to position params
@nnx.jit
def _grads_reference_and_chunked(model, tokens, weights):
    def grads(impl):
        return nnx.grad(lambda m: jnp.sum(m(tokens, implementation=impl) * weights))(model)

    return grads("reference"), grads("chunked")


def _position_grads(grads):
    flat = {jax.tree_util.keystr(p): np.asarray(g)
            for p, g in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(grads))}
    return {k: g for k, g in flat.items()
            if any(n in k for n in ("abs_position", "rel_position", "position_module"))}


@pytest.mark.parametrize("position,expected", [
    ("learned", ["['abs_position']['table']"]),
    ("t5", ["['rel_position']['table']"]),
    ("shaw", [f"['blocks'][0]['attn']['position_module']['{t}']" for t in ("rel_k", "rel_v")]),
])
def test_gradients_reach_position_parameters_equally_through_chunked_and_reference(
        position, expected):
    # T5: two layers, whose gradients meet in the one table; Shaw: one layer's tables.
    model = make_decoder(position, num_layers=2 if position == "t5" else 1)
    tokens = jax.random.randint(jax.random.key(3), (2, 6), 0, V)
    weights = jax.random.normal(jax.random.key(4), (2, 6, V))
    ref, chk = map(_position_grads, _grads_reference_and_chunked(model, tokens, weights))
    assert sorted(ref) == sorted(expected)
    for name in expected:
        assert np.abs(ref[name]).max() > 1e-4, name
        np.testing.assert_allclose(chk[name], ref[name], rtol=1e-4, atol=1e-6, err_msg=name)
    if position == "learned":  # positions 0..5 only: rows 6.. get exactly zero
        g = ref[expected[0]]
        assert np.abs(g[:6]).min() > 0 and (g[6:] == 0).all()


# ------------------------------------------------------------ attention against NumPy
class TestMultiHeadAttention(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_alibi_attention_matches_float64_numpy(self):
        mha = jn.MultiHeadAttention(D, N, position="alibi", causal=True,
                                    implementation="reference", rngs=nnx.Rngs(0))
        x = jax.random.normal(jax.random.key(5), (1, 5, D))
        got = self.variant(lambda x: mha(x))(x)

        w = {n: np.asarray(getattr(mha, n).kernel[...], np.float64)
             for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
        xx = np.asarray(x, np.float64)[0]
        q, k, v = ((xx @ w[n]).reshape(5, N, H) for n in ("q_proj", "k_proj", "v_proj"))
        slopes = [2 ** -4, 2 ** -8]  # Press et al. 2022: 2^(-8/n) * ratio 2^(-8/n), n = 2
        i, j = np.arange(5)[:, None], np.arange(5)[None, :]
        out = np.zeros((5, N, H))
        for h in range(N):
            s = q[:, h] @ k[:, h].T / math.sqrt(H) - slopes[h] * (i - j)
            s = np.where(j <= i, s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[:, h] = (p / p.sum(-1, keepdims=True)) @ v[:, h]
        np.testing.assert_allclose(got[0], out.reshape(5, D) @ w["o_proj"], rtol=1e-5, atol=1e-5)

    @pytest.mark.slow
    def test_grouped_query_attention_decode(self):
        mha = jn.MultiHeadAttention(D, 4, num_kv_heads=2, position="rope", causal=True,
                                    implementation="reference", rngs=nnx.Rngs(0))
        assert mha.k_proj.kernel.shape == (D, 2 * 4) and mha.q_proj.kernel.shape == (D, 4 * 4)
        cache = mha.init_cache(2, 6)
        assert cache.k.shape == (2, 6, 2, 4)
        x = jax.random.normal(jax.random.key(6), (2, 3, D))
        y, cache = mha.decode(x, cache)
        np.testing.assert_allclose(y, mha(x), rtol=1e-5, atol=1e-5)

    def test_shared_position_module_is_one_parameter(self):
        t5 = jn.T5RelativeBias(N, bidirectional=False, rngs=nnx.Rngs(0))
        layers = nnx.List([jn.MultiHeadAttention(D, N, position=t5, causal=True,
                                                 rngs=nnx.Rngs(i)) for i in range(2)])
        assert layers[0].position_module is layers[1].position_module
        n = sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(layers, nnx.Param)))
        assert n == 2 * 4 * D * D + 32 * N


# ------------------------------------------------------------ RoPE module property
@pytest.mark.slow  # the scheme-level property is in tests/attention/test_attention_properties.py
@settings(max_examples=5, deadline=None)
@given(m=st.integers(0, 500), n=st.integers(0, 500), shift=st.integers(-200, 200))
def test_rotary_module_scores_depend_on_offset_only(m, n, shift):
    # Su et al. 2024, §3.4: <R_m q, R_n k> depends on n - m only.
    rope = jn.RotaryEmbedding(8)
    q = jax.random.normal(jax.random.key(7), (1, 1, 1, 8))
    k = jax.random.normal(jax.random.key(8), (1, 1, 1, 8))
    m2, n2 = m + shift + 200, n + shift + 200
    s1 = jnp.sum(rope(q, np.array([m])) * rope(k, np.array([n])))
    s2 = jnp.sum(rope(q, np.array([m2])) * rope(k, np.array([n2])))
    np.testing.assert_allclose(s1, s2, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------ rope_scaling per call
def test_rope_scaling_applies_to_one_call_only():
    from jaxpos.schemes.rope.scaling import LinearScaling

    # Linear scaling divides inv_freq by the factor (Chen et al. 2023), so positions 2t
    # with factor 2 rotate exactly as positions t without scaling.
    model = make_decoder("rope")
    tokens = jax.random.randint(jax.random.key(9), (1, 6), 0, V)
    plain = model(tokens)
    scaled = model(tokens, positions=2 * np.arange(6), rope_scaling=LinearScaling(factor=2.0))
    np.testing.assert_allclose(scaled, plain, rtol=1e-5, atol=1e-5)
    # Control: without the scaling (and after the scaled call), positions 2t differ.
    assert np.abs(model(tokens, positions=2 * np.arange(6)) - plain).max() > 1e-3


@pytest.mark.parametrize("implementation", ["reference", "chunked"])
def test_dynamic_ntk_decode_keeps_each_key_rotated_as_written(implementation):
    """With dynamic NTK (a base that grows with each call's max(position) + 1), decode
    caches keys rotated with the frequencies of the call that wrote them, as HF's cache
    does (the Llama port checks this against HF in tests/parity/test_parity_models.py). Here the
    reference is built by hand from the public pure functions: keys 0..P-1 rotated with
    the frequencies for length P, key and query P with those for length P + 1."""
    from jaxpos.schemes.rope.scaling import DynamicNTKScaling

    scaling = DynamicNTKScaling(factor=4.0, original_max_position_embeddings=3)
    mha = jn.MultiHeadAttention(D, N, position="rope", causal=True, rngs=nnx.Rngs(3))
    P = 5
    x = jax.random.normal(jax.random.key(4), (2, P + 1, D))
    cache = mha.init_cache(2, P + 1)
    _, cache = mha.decode(x[:, :P], cache, rope_scaling=scaling, implementation=implementation)
    y, cache = mha.decode(x[:, P:], cache, rope_scaling=scaling, implementation=implementation)

    q, k, v = mha._qkv(x)
    rope = mha.position_module.scheme()  # the jaxpos.RoPE the layer built
    rd, base = rope.rotary_dim, rope.base
    f_prefill, _ = jaxpos.rope_frequencies(rd, base, scaling=scaling, seq_len=P)
    f_step, _ = jaxpos.rope_frequencies(rd, base, scaling=scaling, seq_len=P + 1)
    pos = np.arange(P + 1)
    k_rot = jnp.concatenate([jaxpos.apply_rope(k[:, :P], pos[:P], f_prefill),
                             jaxpos.apply_rope(k[:, P:], pos[P:], f_step)], axis=1)
    q_rot = jaxpos.apply_rope(q[:, P:], pos[P:], f_step)
    o = jaxpos.attention(q_rot, k_rot, v, q_positions=pos[P:], kv_positions=pos, causal=True,
                         implementation="reference")
    want = merge_heads(o, mha.o_proj.kernel[...], jnp.float32)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    # Control: re-rotating the cached keys with the newest frequencies is a different answer.
    k_new = jaxpos.apply_rope(k, pos, f_step)
    o_new = jaxpos.attention(q_rot, k_new, v, q_positions=pos[P:], kv_positions=pos, causal=True,
                             implementation="reference")
    assert np.abs(merge_heads(o_new, mha.o_proj.kernel[...], jnp.float32) - y).max() > 1e-3


# ------------------------------------------------------------ bad input
def test_bad_arguments_raise_with_names():
    with pytest.raises(ValueError, match="position"):
        make_decoder("no_such_scheme")  # unknown to the registry
    with pytest.raises(ValueError, match="num_kv_heads"):
        jn.DecoderLM(V, d_model=D, num_layers=1, num_heads=2, num_kv_heads=3,
                     rngs=nnx.Rngs(0))
    model = make_decoder("alibi")
    with pytest.raises(ValueError, match="vocab_size"):
        model(jnp.array([[0, V]]))
    with pytest.raises(TypeError, match="tokens"):
        model(jnp.zeros((1, 3)))
    with pytest.raises(ValueError, match="rope_scaling"):
        model(jnp.zeros((1, 3), jnp.int32), rope_scaling=object())
    with pytest.raises(TypeError, match="positions"):
        model(jnp.zeros((1, 3), jnp.int32), positions=jnp.arange(3.0))


# ------------------------------------------------------------ the README example runs
@pytest.mark.slow
def test_readme_decoder_example_runs_and_is_short():
    import pathlib
    import re

    readme = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    block = re.search(r"<!-- decoder-example -->\n```python\n(.*?)```", readme, re.DOTALL)
    assert block is not None, "README section 'Build a decoder in a few lines' is missing"
    code = block.group(1)
    assert len([ln for ln in code.splitlines() if ln.strip()]) < 20  # "a few lines": under 20
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 (our own README)
    assert np.isfinite(float(scope["loss"]))
    assert scope["logits"].shape == (8, 1, 256)
    np.testing.assert_array_equal(scope["cache"][0].length, 17)
