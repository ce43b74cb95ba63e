"""Logical axis names of the modules' parameters and the rules table (jaxpos.sharding),
on one device; the 8-device training step is in tests/parallel/test_logical_axes.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

import jaxpos.linen as jl
import jaxpos.nnx as jn
from jaxpos import sharding

V, D, N, NK = 32, 16, 4, 2
STACK = dict(d_model=D, num_layers=2, num_heads=N, num_kv_heads=NK, sinks=True,
             qk_norm="head", output_gate=True, output_gate_bias=True)


def _nnx_names(model):
    """{path: (logical names, shape)} of every nnx.Param."""
    state = nnx.state(model, nnx.Param)
    return {jax.tree_util.keystr(p): (sharding.param_axes(v), np.shape(v.get_value()))
            for p, v in jax.tree_util.tree_leaves_with_path(
                state, is_leaf=lambda x: isinstance(x, nnx.Variable))}


def _linen_names(params):
    return {jax.tree_util.keystr(p).replace("['blocks_", "['blocks'][").replace(
        "']['attn']", "]['attn']").replace("']['mlp", "]['mlp").replace(
        "']['attn_norm']", "]['attn_norm']"): (sharding.param_axes(b), np.shape(b.value))
        for p, b in jax.tree_util.tree_leaves_with_path(
            params, is_leaf=lambda x: isinstance(x, nn.Partitioned))}


def _check_all_named(names):
    assert names
    for path, (axes, shape) in names.items():
        assert axes is not None, path
        assert len(axes) == len(shape), (path, axes, shape)
        assert all(a in sharding.LOGICAL_NAMES for a in axes), (path, axes)


@pytest.mark.parametrize("position", ["t5", "fox", "learned"])
def test_every_decoder_parameter_has_logical_names_in_both_twins(position):
    model = jn.DecoderLM(V, position=position, max_len=8, rngs=nnx.Rngs(0), **STACK)
    got = _nnx_names(model)
    _check_all_named(got)
    assert got["['embed']['embedding']"][0] == ("vocab", "embed")
    attn = "['blocks'][0]['attn']"
    assert got[f"{attn}['q_proj']['kernel']"][0] == ("embed", "heads")
    assert got[f"{attn}['k_proj']['kernel']"][0] == ("embed", "kv_heads")
    assert got[f"{attn}['o_proj']['kernel']"][0] == ("heads", "embed")
    assert got[f"{attn}['sinks']"][0] == ("heads",)
    assert got[f"{attn}['q_norm']['scale']"][0] == ("head_dim",)
    assert got[f"{attn}['gate_proj']['bias']"][0] == ("heads",)
    assert got["['blocks'][0]['mlp_in']['kernel']"][0] == ("embed", "mlp")
    if position == "t5":
        assert got["['rel_position']['table']"][0] == ("position_rows", "heads")
    # nnx.get_partition_spec names every axis of every parameter
    specs = jax.tree.leaves(nnx.get_partition_spec(nnx.state(model, nnx.Param)),
                            is_leaf=lambda x: isinstance(x, P))
    assert len(specs) == len(got)
    assert all(len(s) == 0 or all(isinstance(a, str) for a in s) for s in specs)
    # The Linen twin boxes the same names on the same parameters
    lm = jl.DecoderLM(V, position=position, max_len=8, **STACK)
    params = lm.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    assert _linen_names(params) == got


def test_attention_parameters_with_biases_are_named_in_both_twins():
    kw = dict(num_kv_heads=NK, position="kerple_log", use_bias=True, qk_norm="projection")
    mha = jn.MultiHeadAttention(D, N, rngs=nnx.Rngs(0), **kw)
    got = _nnx_names(mha)
    _check_all_named(got)
    assert got["['k_proj']['bias']"][0] == ("kv_heads",)
    assert got["['q_norm']['scale']"][0] == ("heads",)
    assert got["['position_module']['r1']"][0] == ("heads",)
    linen = jl.MultiHeadAttention(D, N, **kw).init(jax.random.key(0), jnp.ones((1, 3, D)))
    assert _linen_names(linen["params"]) == got


def test_without_a_mesh_no_constraint_is_traced():
    model = jn.DecoderLM(V, position="rope", rngs=nnx.Rngs(0), **STACK)
    jaxpr = str(jax.make_jaxpr(lambda t: model(t))(jnp.zeros((2, 4), jnp.int32)))
    assert "sharding_constraint" not in jaxpr and "reshard" not in jaxpr
    x = jnp.ones((2, 4, 8))
    assert sharding.constrain(x, ("batch", None, "heads")) is x


MESH = AbstractMesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
MESH3 = AbstractMesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)


def test_rules_skip_the_mesh_axes_the_mesh_lacks():
    assert sharding.logical_spec(("batch", None, "embed"), MESH) == P("data", None, None)
    # a mesh axis serves one dimension: batch takes fsdp first, embed gets none
    assert sharding.logical_spec(("batch", "embed"), MESH3) == P(("data", "fsdp"), None)
    assert sharding.logical_spec(("embed", "heads"), MESH3) == P("fsdp", "tensor")
    assert sharding.logical_spec(("vocab", "embed"), MESH) == P("tensor", None)
    # an axis whose size does not divide the dimension is skipped
    assert sharding.logical_spec(("batch", "heads"), MESH, shape=(3, 8)) == P(None, "tensor")
    assert sharding.logical_spec(("heads",), MESH, shape=(2,)) == P(None)
    assert sharding.logical_spec(("heads",), None) == P()  # no mesh


def test_rules_are_overridden_by_flax_context_or_argument():
    mine = (("heads", "data"), ("batch", None))
    assert sharding.logical_spec(("batch", "heads"), MESH, rules=mine) == P(None, "data")
    with nn.logical_axis_rules(mine):
        assert sharding.active_rules() == mine
        assert sharding.logical_spec(("batch", "heads"), MESH) == P(None, "data")
    assert sharding.active_rules() == sharding.DEFAULT_RULES
    with pytest.raises(TypeError, match="rules"):
        sharding.active_rules([("heads",)])


def test_rules_for_a_mesh_give_flax_the_same_partition_specs():
    model = jn.DecoderLM(V, position="t5", rngs=nnx.Rngs(0), **STACK)
    state = nnx.state(model, nnx.Param)
    with nn.logical_axis_rules(sharding.rules_for(MESH)):
        specs = nnx.get_partition_spec(state)
    kernel = specs["blocks"][0]["attn"]["q_proj"]["kernel"].get_value()
    assert kernel == P(None, "tensor")
    assert specs["rel_position"]["table"].get_value() == P(None, "tensor")
    assert specs["embed"]["embedding"].get_value() == P("tensor", None)
    assert dict(sharding.rules_for(MESH))["batch"] == "data"


def test_place_on_a_one_device_mesh_keeps_the_values():
    model = jn.DecoderLM(V, position="alibi", rngs=nnx.Rngs(0), **STACK)
    mesh = jax.make_mesh((1, 1), ("data", "tensor"))
    placed = sharding.place(model, mesh)
    for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(nnx.state(model))):
        np.testing.assert_array_equal(a, b)
    kernel = placed["blocks"][0]["attn"]["q_proj"]["kernel"].get_value()
    assert kernel.sharding.spec == P(None, "tensor")
