"""The modules' options are declared once (jaxpos.layers.spec): the NNX constructors take
exactly those keywords (an unknown one raises, naming the module) and the Linen twins
have exactly those fields, with the same defaults."""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import pytest
from flax import linen as nn
from flax import nnx

from jaxpos import linen as jl
from jaxpos import nnx as jn
from jaxpos.layers.spec import AttentionOptions, BlockOptions, StackOptions

PAIRS = [("MultiHeadAttention", AttentionOptions, 2), ("TransformerBlock", BlockOptions, 2),
         ("DecoderLM", StackOptions, 1), ("Encoder", StackOptions, 1)]


@pytest.mark.parametrize("name,spec,positional", PAIRS)
def test_nnx_signature_and_linen_fields_are_the_option_table(name, spec, positional):
    fields = {f.name: f.default for f in dataclasses.fields(spec)}
    own_default = {"DecoderLM": "rope", "Encoder": "nope"}.get(name)
    if own_default:
        fields["position"] = own_default
    sig = inspect.signature(getattr(jn, name).__init__).parameters
    assert list(sig)[1:] == [*fields, "rngs"]
    for arg, default in fields.items():
        want = inspect.Parameter.empty if default is dataclasses.MISSING else default
        assert sig[arg].default == want, arg
    linen = {f.name: f.default for f in dataclasses.fields(getattr(jl, name))
             if f.name not in ("parent", "name", "deterministic")}
    assert linen == fields


def test_unknown_option_raises_type_error_naming_the_module():
    with pytest.raises(TypeError, match="MultiHeadAttention.*rotary_dims"):
        jn.MultiHeadAttention(16, 2, rotary_dims=4, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="DecoderLM.*num_layer"):
        jn.DecoderLM(32, d_model=16, num_layer=2, num_heads=2, rngs=nnx.Rngs(0))


def test_stacks_pass_the_gate_and_qk_norm_to_every_layer():
    kw = dict(d_model=16, num_layers=2, num_heads=4, num_kv_heads=2, position="rope",
              output_gate="headwise", output_gate_bias=True, qk_norm="projection",
              qk_norm_offset=True)
    model = jn.DecoderLM(32, rngs=nnx.Rngs(0), **kw)
    for block in model.blocks:
        attn = block.attn
        assert attn.gate_proj.kernel[...].shape == (16, 4)
        assert attn.gate_proj.bias[...].shape == (4,)
        assert attn.q_norm.scale[...].shape == (16,) and attn.k_norm.scale[...].shape == (8,)
        assert not attn.q_norm.scale[...].any()  # the (1 + w) form starts at w = 0
    tokens = jnp.zeros((1, 3), jnp.int32)
    linen = nn.unbox(jax.eval_shape(jl.DecoderLM(32, **kw).init, jax.random.key(0),
                                    tokens)["params"])
    nnx_tree = jl.params_from_nnx(model)
    assert jax.tree_util.tree_map(jnp.shape, linen) == jax.tree_util.tree_map(jnp.shape,
                                                                              nnx_tree)
