"""The Flax modules (jaxpos.nnx, jaxpos.linen) are driven by the scheme registry.

* Every registered name builds a :class:`jaxpos.nnx.DecoderLM` (and its Linen twin) that
  runs a forward pass, or, for a scheme class without ``from_params``, raises a
  ``ValueError`` that names the class (KV-cache decoding of every buildable name:
  ``tests/modules/test_decode_equals_full_pass.py``).
* A scheme registered from outside the library (here, in this file) enters every module
  with no change to them: its parameters (from ``init_params``, with the module's
  ``scheme_options``) become ``nnx.Param``s in the stack or in every layer as its
  ``params_per_layer`` says, ``from_params`` builds it per call (from the layer's input
  for a token-dependent scheme), and the attention output matches a float64 NumPy
  reference written from the papers: KERPLE's log kernel ``-r1 log(1 + r2 |m - n|)``
  (Chi et al. 2022, §4) and FoX's forget-gate bias ``c_i - c_j`` with
  ``c_i = sum_{l <= i} log sigmoid(w . x_l + b)`` (Lin et al. 2025, §2).

Sizes are tiny (d_model 16, 2 heads, T <= 6) and everything runs eagerly with the
reference implementation.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

from jaxpos import linen as jl
from jaxpos import nnx as jn
from jaxpos.layers.options import buildable
from jaxpos.schemes.base import REGISTRY, PositionScheme, register
from jaxpos.schemes.fox import FoX
from jaxpos.schemes.kerple import KERPLELog

V, D, N, H = 50, 16, 2, 8
NAMES = sorted(REGISTRY)  # every scheme registered once jaxpos.nnx is imported


def _decoder(position, **kw):
    return jn.DecoderLM(V, d_model=D, num_layers=kw.pop("num_layers", 1), num_heads=N,
                        position=position, implementation="reference", rngs=nnx.Rngs(0), **kw)


def _linen_decoder(position, **kw):
    return jl.DecoderLM(V, d_model=D, num_layers=kw.pop("num_layers", 1), num_heads=N,
                        position=position, implementation="reference", **kw)


# ------------------------------------------------------------ every registered name
@pytest.mark.parametrize("name", NAMES)
def test_decoder_builds_and_runs_for_every_registered_name(name):
    cls = REGISTRY[name]
    tokens = jax.random.randint(jax.random.key(0), (2, 5), 0, V)
    if not buildable(cls):
        # A registered scheme the modules cannot build: a clear error naming the class.
        for build in (lambda: _decoder(name),
                      lambda: _linen_decoder(name).init(jax.random.key(0), tokens)):
            with pytest.raises(ValueError, match=rf"'{name}'.*{cls.__name__}.*from_params"):
                build()
        assert name not in jn.POSITIONS and name not in jn.ATTENTION_POSITIONS
        return
    assert name in jn.POSITIONS and name in jn.ATTENTION_POSITIONS
    model = _decoder(name)
    logits = model(tokens)
    assert logits.shape == (2, 5, V) and np.isfinite(np.asarray(logits)).all()
    # The Linen twin accepts the same name and, with the NNX weights, gives the same logits.
    linen = _linen_decoder(name)
    got = linen.apply({"params": jl.params_from_nnx(model)}, tokens)
    np.testing.assert_allclose(got, logits, rtol=1e-6, atol=1e-6)


def test_positions_are_derived_from_the_registry():
    names = {n for n, c in REGISTRY.items() if buildable(c)}
    assert set(jn.ATTENTION_POSITIONS) == names
    assert set(jn.POSITIONS) == names | {"sinusoidal", "learned"}
    assert jn.POSITIONS[:3] == ("nope", "sinusoidal", "learned")
    assert {"rope", "alibi", "t5", "shaw"} <= names


# ------------------------------------------------------------ schemes registered here
class ModuleKERPLE(KERPLELog):
    """KERPLE-log with the module protocol: ``r1``, ``r2`` per head, initialised to the
    options ``r1_init`` / ``r2_init`` (scheme_options) or U(0.5, 2)."""

    @classmethod
    def init_params(cls, key, *, num_heads, param_dtype, options, **_):
        k1, k2 = jax.random.split(key)

        def init(k, name):
            if options.get(name) is not None:
                return jnp.full((num_heads,), options[name], param_dtype)
            return jax.random.uniform(k, (num_heads,), param_dtype, 0.5, 2.0)

        return {"r1": init(k1, "r1_init"), "r2": init(k2, "r2_init")}

    @classmethod
    def from_params(cls, params, **_):
        return cls(params["r1"], params["r2"])


class ModuleKERPLEPerLayer(ModuleKERPLE):
    params_per_layer = True


class ModuleFoX(FoX):
    """FoX with the module protocol: the gate projection ``w [D, N]``, ``b [N]`` per
    layer; the scheme is computed from the layer's input ``x`` at every call."""

    params_per_layer = True

    @classmethod
    def init_params(cls, key, *, num_heads, d_model, param_dtype, **_):
        k1, k2 = jax.random.split(key)
        return {"w": jax.random.normal(k1, (d_model, num_heads), param_dtype),
                "b": jax.random.normal(k2, (num_heads,), param_dtype)}

    @classmethod
    def from_params(cls, params, *, x, **_):
        if x is None:
            raise ValueError("ModuleFoX needs the layer input x")
        logit = jnp.einsum("btd,dn->btn", x.astype(jnp.float32), params["w"]) + params["b"]
        return cls(jax.nn.log_sigmoid(logit))


class NoFromParams(PositionScheme):
    """A registered scheme that the modules cannot build (no from_params)."""

    def __init__(self):
        pass


TEST_SCHEMES = {"test_kerple": ModuleKERPLE, "test_kerple_per_layer": ModuleKERPLEPerLayer,
                "test_fox": ModuleFoX, "test_no_from_params": NoFromParams}


@pytest.fixture(scope="module", autouse=True)
def registered():
    for name, cls in TEST_SCHEMES.items():
        register(name)(cls)
    yield
    for name in TEST_SCHEMES:
        REGISTRY.pop(name, None)


def _param_paths(model):
    state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_leaves_with_path(state)}


def _np_attention(mha, x, bias):
    """float64 causal attention of ``mha``'s weights on ``x [1, T, D]`` with a score bias
    ``bias(h) -> [T, T]``: scores ``q_i . k_j / sqrt(H) + bias``, softmax, ``@ v``,
    output projection."""
    w = {n: np.asarray(getattr(mha, n).kernel[...], np.float64)
         for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    xx = np.asarray(x, np.float64)[0]
    T = xx.shape[0]
    q, k, v = ((xx @ w[n]).reshape(T, N, H) for n in ("q_proj", "k_proj", "v_proj"))
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    out = np.zeros((T, N, H))
    for h in range(N):
        s = q[:, h] @ k[:, h].T / math.sqrt(H) + bias(h)
        s = np.where(j <= i, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[:, h] = (p / p.sum(-1, keepdims=True)) @ v[:, h]
    return out.reshape(T, N * H) @ w["o_proj"]


def test_attention_with_a_scheme_registered_elsewhere_matches_float64_kerple():
    mha = jn.MultiHeadAttention(D, N, position="test_kerple", causal=True,
                                implementation="reference", rngs=nnx.Rngs(1))
    x = jax.random.normal(jax.random.key(2), (1, 6, D))
    r1 = np.asarray(mha.position_module.r1[...], np.float64)
    r2 = np.asarray(mha.position_module.r2[...], np.float64)
    dist = np.abs(np.arange(6)[:, None] - np.arange(6)[None, :])
    # Chi et al. 2022, §4, the logarithmic kernel: -r1 log(1 + r2 |m - n|).
    want = _np_attention(mha, x, lambda h: -r1[h] * np.log1p(r2[h] * dist))
    np.testing.assert_allclose(mha(x)[0], want, rtol=1e-5, atol=1e-5)


def test_token_dependent_scheme_gets_the_layer_input_and_matches_float64_fox():
    mha = jn.MultiHeadAttention(D, N, position="test_fox", causal=True,
                                implementation="reference", rngs=nnx.Rngs(3))
    x = jax.random.normal(jax.random.key(4), (1, 6, D))
    w = np.asarray(mha.position_module.w[...], np.float64)
    b = np.asarray(mha.position_module.b[...], np.float64)
    logit = np.asarray(x, np.float64)[0] @ w + b            # [T, N]
    c = np.cumsum(-np.log1p(np.exp(-logit)), axis=0)         # sum of log sigmoid
    # Lin et al. 2025, §2: D_ij = c_i - c_j.
    want = _np_attention(mha, x, lambda h: c[:, h][:, None] - c[:, h][None, :])
    np.testing.assert_allclose(mha(x)[0], want, rtol=1e-5, atol=1e-5)
    # A FoX layer refuses a bidirectional (encoder) layer when it is built.
    with pytest.raises(ValueError, match="causal"):
        jn.MultiHeadAttention(D, N, position="test_fox", causal=False, rngs=nnx.Rngs(0))


def test_params_live_in_the_stack_or_in_every_layer_as_params_per_layer_says():
    shared = _param_paths(_decoder("test_kerple", num_layers=2))
    per_layer = _param_paths(_decoder("test_kerple_per_layer", num_layers=2))
    fox = _param_paths(_decoder("test_fox", num_layers=2))
    pos = lambda paths: sorted(p for p in paths if "position" in p)
    assert pos(shared) == ["['rel_position']['r1']", "['rel_position']['r2']"]
    assert pos(per_layer) == [f"['blocks'][{i}]['attn']['position_module']['{r}']"
                              for i in (0, 1) for r in ("r1", "r2")]
    assert pos(fox) == [f"['blocks'][{i}]['attn']['position_module']['{r}']"
                        for i in (0, 1) for r in ("b", "w")]


def test_scheme_options_reach_init_params_in_nnx_and_linen():
    model = _decoder("test_kerple", scheme_options={"r1_init": 1.5, "r2_init": 0.25})
    np.testing.assert_array_equal(model.rel_position.r1[...], [1.5, 1.5])
    np.testing.assert_array_equal(model.rel_position.r2[...], [0.25, 0.25])
    tokens = jnp.zeros((1, 4), jnp.int32)
    linen = _linen_decoder("test_kerple_per_layer", scheme_options={"r1_init": 1.5})
    params = nn.unbox(linen.init(jax.random.key(0), tokens)["params"])
    np.testing.assert_array_equal(params["blocks_0"]["attn"]["position_module"]["r1"],
                                  [1.5, 1.5])
    with pytest.raises(TypeError, match="scheme_options"):
        _decoder("test_kerple", scheme_options=[("r1_init", 1.5)])


def test_gradient_reaches_a_registered_schemes_params_as_finite_differences_say():
    model = _decoder("test_kerple")
    tokens = jax.random.randint(jax.random.key(5), (2, 6), 0, V)
    weights = jax.random.normal(jax.random.key(6), (2, 6, V))
    graphdef, params = nnx.split(model, nnx.Param)

    @jax.jit
    def loss(r1, params):
        params["rel_position"]["r1"] = r1
        return jnp.sum(nnx.merge(graphdef, params)(tokens) * weights)

    params = nnx.to_pure_dict(params)
    r1 = params["rel_position"]["r1"]
    g = jax.jit(jax.grad(loss))(r1, params)
    eps, e0 = 1e-2, jnp.array([1.0, 0.0])
    fd = (loss(r1 + eps * e0, params) - loss(r1 - eps * e0, params)) / (2 * eps)
    assert abs(float(g[0])) > 1e-3
    np.testing.assert_allclose(float(g[0]), float(fd), rtol=2e-2, atol=1e-3)


def test_scheme_without_from_params_gives_a_clear_error_everywhere():
    match = r"'test_no_from_params'.*NoFromParams.*from_params"
    with pytest.raises(ValueError, match=match):
        _decoder("test_no_from_params")
    with pytest.raises(ValueError, match=match):
        jn.Encoder(V, d_model=D, num_layers=1, num_heads=N, position="test_no_from_params",
                   rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=match):
        jn.MultiHeadAttention(D, N, position="test_no_from_params", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=match):
        jl.MultiHeadAttention(D, N, position="test_no_from_params").init(
            jax.random.key(0), jnp.ones((1, 3, D)))
    assert "test_no_from_params" not in jn.POSITIONS
    # An unknown name lists the names the modules accept, derived from the registry.
    with pytest.raises(ValueError, match=r"position must be one of .*'test_kerple'"):
        _decoder("no_such_scheme")


@pytest.mark.parametrize("kw,error,words", [
    (dict(position="shaw", max_distance=0), ValueError, ("max_distance", "0")),
    (dict(position="t5", num_buckets=0), ValueError, ("num_buckets", "0")),
    (dict(position="rope", rope_base=-1.0), ValueError, ("rope_base", "-1.0")),
    (dict(position="rope", rotary_dim=4.0), TypeError, ("rotary_dim", "4.0")),
    (dict(position="alibi", scheme_options={1: 2}), TypeError, ("scheme_options", "string keys")),
])
def test_bad_scheme_options_raise_when_the_layer_is_built(kw, error, words):
    pattern = ".*".join(map(re.escape, words))
    with pytest.raises(error, match=pattern):
        jn.MultiHeadAttention(D, N, rngs=nnx.Rngs(0), **kw)
    with pytest.raises(error, match=pattern):
        jl.MultiHeadAttention(D, N, **kw).init(jax.random.key(0), jnp.ones((1, 3, D)))


def test_unknown_scheme_options_are_refused_when_the_model_is_built():
    """A typo in scheme_options used to be dropped silently (``{"layout": ...}`` for RoPE's
    ``rope_layout``): every option must be one the scheme reads."""
    from flax import nnx as _nnx

    from jaxpos.nnx import DecoderLM

    kw = dict(d_model=32, num_layers=1, num_heads=4, rngs=_nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"scheme_options \['layout'\] are not options of RoPE"):
        DecoderLM(64, position="rope", scheme_options={"layout": "interleaved"}, **kw)
    with pytest.raises(ValueError, match=r"scheme_options \['num_bucket'\] are not options of T5"):
        DecoderLM(64, position="t5", scheme_options={"num_bucket": 8}, **kw)
    DecoderLM(64, position="rope", scheme_options={"rope_layout": "interleaved"}, **kw)


def test_nope_temperature_builds_from_scheme_options_and_scales_queries():
    # The Llama 4 temperature 1 + attn_scale * log1p(floor((p + 1) / floor_scale)) from
    # scheme_options: the layer equals the same weights called with the scheme built by
    # hand, and differs from plain NoPE once the temperature departs from 1 (p >= 1 here).
    from jaxpos.schemes.base import NoPE
    from jaxpos.schemes.irope import TemperatureTunedNoPE
    layer = jn.MultiHeadAttention(16, 2, position="nope_temperature",
                                  scheme_options={"attn_scale": 0.5, "floor_scale": 2.0},
                                  rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (1, 6, 16))
    by_hand = layer(x, scheme=TemperatureTunedNoPE(0.5, 2.0))
    np.testing.assert_allclose(layer(x), by_hand, rtol=1e-6, atol=1e-6)
    assert np.abs(np.asarray(layer(x, scheme=NoPE()) - by_hand)).max() > 1e-3
    with pytest.raises(ValueError, match="floor_scale"):
        jn.MultiHeadAttention(16, 2, position="nope_temperature",
                              scheme_options={"floor_scale": 0.0}, rngs=nnx.Rngs(0))(x)
