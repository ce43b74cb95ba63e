"""Flax Linen twins of the modules in :mod:`jaxpos.nnx`, derived from them.

Same names, same arguments (as dataclass fields), the same parameter tree, and the same
code: every computation (attention, the block, the stacks, decoding, building a scheme
from the registry) is the NNX module's, inherited from the ``*Core`` classes of
:mod:`jaxpos.layers.cores`; the fields are the option dataclasses of
:mod:`jaxpos.layers.spec` that the NNX constructors take as keywords, and a Linen module's
``setup`` builds the parts that :func:`jaxpos.layers.spec.attention_parts` /
``block_parts`` describe for both twins. Given the same weights a Linen module and its
NNX twin therefore produce the same outputs, and they accept the same position names
(:func:`jaxpos.nnx.stack_positions`, every registered scheme that implements
``from_params``). :func:`params_from_nnx` turns
an NNX model's parameters into the Linen ``params`` collection. The position modules live
in :mod:`jaxpos.layers.linen_positions` (as the NNX ones in
:mod:`jaxpos.layers.nnx_positions`) and are exported here.

Why not :func:`flax.nnx.bridge.to_linen` (as MaxText wraps its NNX layers): a bridged
``DecoderLM`` keeps NNX's parameter paths (``blocks/0/...`` instead of ``blocks_0/...``,
so the Linen tree changes), cannot take a position module defined in a Linen parent (a
stack's shared T5 table), and has no ``decode_step`` for ``apply(..., method=...)`` nor an
``init_cache`` without parameters (both raise ``CallCompactUnboundModuleError``, Flax
0.12); sharing the code and the option declarations keeps all of those.

Usage::

    model = jaxpos.linen.DecoderLM(vocab_size=256, d_model=64, num_layers=2,
                                   num_heads=4, position="alibi")
    params = model.init(jax.random.key(0), tokens)["params"]
    logits = model.apply({"params": params}, tokens)            # [B, T, vocab]
    cache = model.init_cache(batch, max_len)                    # no params needed
    logits, cache = model.apply({"params": params}, tokens[:, :1], cache,
                                method="decode_step")

See :mod:`jaxpos.nnx` for the architecture (pre-LN RMSNorm blocks, GELU MLP, tied
embeddings scaled by ``sqrt(d_model)``, ``scale = 1/sqrt(head_dim)`` for every scheme,
stack-level or per-layer scheme parameters) and for the KV-cache convention.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from jaxpos import _checks
from jaxpos.layers.cache import KVCache
from jaxpos.layers.cores import (
    AttentionCore,
    BlockCore,
    DecoderCore,
    EncoderCore,
    StackCore,
)
from jaxpos.layers.functional import (
    linear_params,
    norm_params,
    token_embedding_init,
)
from jaxpos.layers.linen_positions import (
    ALiBi,
    LearnedPositionalEmbedding,
    PositionModule,
    RotaryEmbedding,
    ShawRelativePosition,
    SinusoidalEmbedding,
    T5RelativeBias,
    make_position_module,
)
from jaxpos.layers.options import (
    ABSOLUTE_POSITIONS,
    attention_dims,
    attention_positions,
    check_position_name,
    module_scheme,
    stack_positions,
)
from jaxpos.layers.spec import (
    AttentionOptions,
    BlockOptions,
    StackOptions,
    attention_parts,
    block_parts,
    check_attention,
    check_block,
    check_stack_context,
)
from jaxpos.layers.stack import build_stack, stack_spec
from jaxpos.sharding import linen_init, retype

__all__ = [
    "ABSOLUTE_POSITIONS",
    "POSITIONS",
    "ALiBi",
    "DecoderLM",
    "Encoder",
    "KVCache",
    "LearnedPositionalEmbedding",
    "MultiHeadAttention",
    "PositionModule",
    "RotaryEmbedding",
    "ShawRelativePosition",
    "SinusoidalEmbedding",
    "T5RelativeBias",
    "TransformerBlock",
    "params_from_nnx",
]

Dtype = Any


def __getattr__(name: str):
    # POSITIONS / ATTENTION_POSITIONS as in jaxpos.nnx: derived from the registry.
    if name == "POSITIONS":
        return stack_positions()
    if name == "ATTENTION_POSITIONS":
        return attention_positions()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def params_from_nnx(model: Any) -> dict:
    """The Linen ``params`` dict holding the weights of an NNX twin (:mod:`jaxpos.nnx`).

    NNX keeps lists of layers as ``blocks/0/...``; Linen names them ``blocks_0/...``.
    Everything else already has the same path. Arrays are shared, not copied.

    Args:
      model: an :class:`flax.nnx.Module` from :mod:`jaxpos.nnx`, or an
        :class:`flax.nnx.State` of it (e.g. the gradients from ``nnx.grad``), or that
        state as a nested dict (``nnx.to_pure_dict``).

    Returns:
      nested dict of arrays, for ``linen_model.apply({"params": ...}, ...)``.

    Raises:
      TypeError: ``model`` is neither an NNX module nor a state.
    """
    from flax import nnx

    # nnx.to_pure_dict, not the State method that Flax 0.12 deprecates (Flax plans to
    # replace State by a plain dict: a nested dict of arrays is accepted as it is).
    if isinstance(model, nnx.Module):
        pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    elif isinstance(model, nnx.State):
        pure = nnx.to_pure_dict(model)
    elif isinstance(model, dict):
        pure = jax.tree_util.tree_map(
            lambda v: v.get_value() if isinstance(v, nnx.Variable) else v, model,
            is_leaf=lambda v: isinstance(v, nnx.Variable))
    else:
        raise TypeError(f"model must be a flax.nnx.Module or nnx.State; got "
                        f"{type(model).__name__}.")

    def convert(tree):
        if not isinstance(tree, dict):
            return tree
        out = {}
        for key, val in tree.items():
            if isinstance(val, dict) and val and all(isinstance(k, int) for k in val):
                for i, sub in val.items():
                    out[f"{key}_{i}"] = convert(sub)
            else:
                out[str(key)] = convert(val)
        return out

    return convert(pure)


# ================================================================== parameter holders

class _Params(nn.Module):
    """Parameters declared from a table ``((name, init, shape), ...)``, the tables of
    :func:`jaxpos.layers.functional.linear_params` / ``norm_params`` (the names and
    initialisers of :class:`flax.nnx.Linear` and :class:`flax.nnx.RMSNorm`), read by the
    shared code as attributes (``q_proj.kernel``, ``attn_norm.scale``); an entry whose
    init is None is the attribute None (a projection without bias)."""
    table: tuple
    param_dtype: Dtype = jnp.float32
    #: the logical axis names of each entry's parameter (:mod:`jaxpos.sharding`)
    axes: tuple = ()

    def setup(self) -> None:
        axes = self.axes or tuple((None,) * len(shape) for _, _, shape in self.table)
        for (name, init, shape), names in zip(self.table, axes, strict=True):
            setattr(self, name, None if init is None else self.param(
                name, linen_init(init, names), shape, self.param_dtype))


# ================================================================== attention

class _LinenDropout:
    """Flax Linen's dropout conventions: the call's ``deterministic`` when given, else
    the ``deterministic`` field (one of them must be set when ``dropout_rate > 0``); keys
    from ``self.make_rng("dropout")`` (``apply(..., rngs={"dropout": key})``)."""

    if TYPE_CHECKING:  # dropout_rate, deterministic, ... of the module mixing this in
        def __getattr__(self, name: str) -> Any: ...

    def _is_deterministic(self, deterministic) -> bool:
        if deterministic is not None:
            return bool(deterministic)
        if self.deterministic is not None:
            return bool(self.deterministic)
        raise ValueError(f"{type(self).__name__} has dropout_rate={self.dropout_rate}: pass "
                         f"deterministic=True (evaluation) or False (training, with "
                         f"apply(..., rngs={{'dropout': key}})) to the call, or set the "
                         f"deterministic field.")

    def _dropout_key(self, rngs):
        return self.make_rng("dropout")


class MultiHeadAttention(_LinenDropout, AttentionCore, AttentionOptions, nn.Module):
    """Linen twin of :class:`jaxpos.nnx.MultiHeadAttention`: grouped-query self- or
    cross-attention with any registered position scheme over :func:`jaxpos.attention`.

    Fields as the NNX arguments (``d_model``, ``num_heads``, ``num_kv_heads``, ``head_dim``,
    ``position`` (a registered name, or a Linen position module, shared if defined in a
    parent), ``causal``, ``rotary_dim``, ``rope_base``, ``num_buckets``, ``max_distance``,
    ``scale``, ``implementation``, ``use_bias``, ``dtype``, ``param_dtype``,
    ``scheme_options``, ``sinks``, ``mask_mod``, ``output_gate`` and ``output_gate_bias``
    (``gate_proj/kernel``, ``gate_proj/bias``), ``qk_norm``, ``qk_norm_offset`` and
    ``qk_norm_eps`` (``q_norm/scale``, ``k_norm/scale``), ``dropout_rate``: the fields of
    :class:`jaxpos.layers.spec.AttentionOptions`, with Linen's ``deterministic`` field /
    call keyword and ``make_rng("dropout")``). Parameters
    ``q_proj/k_proj/v_proj/o_proj.kernel`` (and ``.bias`` with ``use_bias``), ``sinks
    [num_heads]`` (zeros at init) with ``sinks=True``, and ``position_module/...`` for a
    position given by name. A
    position module passed in lives where it was defined: once in the parent that defined
    it in ``setup`` (shared by every layer it was passed to, like a stack's T5 table), or
    under ``position/...`` when it was created unbound for this layer.

    Call: ``x [B, T, D]`` -> ``[B, T, D]`` (keywords ``context``, ``positions``,
    ``kv_positions``, ``mask``, ``segment_ids``, ``kv_segment_ids``, ``scheme``,
    ``rope_scaling``, ``implementation``, ``mask_mod``, ``attention_mask``, as the NNX
    twin); ``decode(x, cache, ...)`` -> ``(y, cache)``; ``init_cache(batch, max_len)`` needs no
    parameters. Raises as the NNX twin.
    """

    deterministic: bool | None = None

    def _dims(self):
        return attention_dims(self.d_model, self.num_heads, self.num_kv_heads, self.head_dim)

    def _position(self):
        return self._pos

    def _cache_scheme(self):
        if isinstance(self.position, str):
            return self.position, check_attention(self).scheme_options
        return module_scheme(self.position)

    def _sinks(self):
        return retype(self._sink_logits)

    def setup(self) -> None:
        parts = attention_parts(self, check_attention(self), _LinenMaker(self))
        # The parameter is named "sinks" as in the NNX twin (the field of the same name is
        # the bool that asks for it).
        self._sink_logits = parts.pop("sinks")
        self._pos = parts.pop("position_module")
        for name, part in parts.items():
            setattr(self, name, part)

    __call__ = AttentionCore.__call__
    decode = AttentionCore.decode


# ================================================================== blocks and stacks

class TransformerBlock(_LinenDropout, BlockCore, BlockOptions, nn.Module):
    """Linen twin of :class:`jaxpos.nnx.TransformerBlock` (pre-LN, RMSNorm, GELU MLP).
    Fields as :class:`MultiHeadAttention` (``sinks``, ``mask_mod``, ``dropout_rate``,
    ``output_gate``, ``qk_norm``, ``deterministic`` included) plus ``mlp_dim`` (default
    ``4 * d_model``) and ``attention_dropout_rate`` (default: ``dropout_rate``): the fields
    of :class:`jaxpos.layers.spec.BlockOptions`."""

    deterministic: bool | None = None

    def setup(self) -> None:
        for name, part in block_parts(check_block(self), _LinenMaker(self)).items():
            setattr(self, name, part)

    __call__ = BlockCore.__call__
    decode = BlockCore.decode


class _LinenMaker:
    """The Linen constructors of a module's parts (:class:`jaxpos.layers.spec.Maker`),
    called in its ``setup`` and named as the NNX twin's attributes (``blocks_{i}`` for
    ``blocks/{i}``)."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.dtype, self.param_dtype = module.dtype, module.param_dtype  # type: ignore[attr-defined]

    def linear(self, in_features, out_features, use_bias, name, axes=(None, None)):
        return _Params(linear_params(in_features, out_features, use_bias), self.param_dtype,
                       (tuple(axes), tuple(axes[1:])), name=name)

    def norm(self, features, name, offset=False, axis="norm"):
        return _Params(norm_params(features, offset), self.param_dtype, ((axis,),), name=name)

    def zeros(self, name, shape, axes):
        return self.module.param(name, linen_init(nn.initializers.zeros, axes), shape,
                                 self.param_dtype)

    def position_module(self, position, name, **kwargs):
        return make_position_module(position, param_dtype=self.param_dtype, name=name,
                                    **kwargs)

    def attention(self, name, **options):
        return MultiHeadAttention(**options, deterministic=getattr(
            self.module, "deterministic", None), name=name)

    def embed(self, vocab_size, d_model):
        return nn.Embed(vocab_size, d_model, embedding_init=linen_init(
            token_embedding_init(d_model), ("vocab", "embed")),
            param_dtype=self.param_dtype, name="embed")

    def sinusoidal(self, d_model):
        return SinusoidalEmbedding(d_model, dtype=self.dtype, name="abs_position")

    def learned(self, max_len, d_model):
        return LearnedPositionalEmbedding(max_len, d_model, param_dtype=self.param_dtype,
                                          name="abs_position")

    def block(self, index, **options):
        return TransformerBlock(**options, name=f"blocks_{index}")

    def block_list(self, blocks):
        return blocks


class _Stack(StackCore, StackOptions, nn.Module):
    """The fields (:class:`jaxpos.layers.spec.StackOptions`) and ``setup`` of the Linen
    stacks."""

    _causal = True

    def __post_init__(self):
        # A list of per-layer mask_mods is kept as a tuple, so the module stays hashable.
        if isinstance(self.layer_mask_mods, list):
            object.__setattr__(self, "layer_mask_mods", tuple(self.layer_mask_mods))
        super().__post_init__()

    def _position_name(self):
        return check_position_name("position", self.position)

    def _cache_dims(self):
        _, _, Nk, H = attention_dims(self.d_model, self.num_heads, self.num_kv_heads, None)
        return _checks.check_positive_int("num_layers", self.num_layers), Nk, H

    def _cache_schemes(self):
        spec = stack_spec(self, causal=self._causal)
        plans = spec.layer_plans or (spec.plan,) * spec.num_layers
        return tuple((p.scheme, p.options, spec.num_heads) for p in plans)

    def setup(self) -> None:
        check_stack_context(self)
        parts = build_stack(stack_spec(self, causal=self._causal), _LinenMaker(self), self)
        self.embed, self.abs_position, self.rel_position, self.blocks, self.final_norm = parts


class DecoderLM(DecoderCore, _Stack):
    """Linen twin of :class:`jaxpos.nnx.DecoderLM`: a causal decoder-only language model
    with any registered position scheme (fields = the NNX constructor's arguments, with
    ``sinks``, ``mask_mod``, ``layer_mask_mods``, ``dropout_rate`` and
    ``attention_dropout_rate``; the sink logits are ``blocks_{i}/attn/sinks``). With
    dropout, the call takes ``deterministic`` (required) and the keys come from
    ``apply(..., rngs={"dropout": key})``.

    ``__call__(tokens [B, T], *, positions=None, rope_scaling=None, implementation=None,
    segment_ids=None, attention_mask=None)`` -> float32 logits ``[B, T, vocab_size]``;
    ``init_cache(batch, max_len)`` (no parameters needed) and
    ``apply(..., tokens, cache, method="decode_step")`` -> ``(logits, cache)``.
    Raises as the NNX twin (``"learned"`` past ``max_len`` raises ``ValueError``).
    """

    position: str = "rope"
    _causal = True

    __call__ = DecoderCore.__call__
    decode_step = DecoderCore.decode_step


class Encoder(EncoderCore, _Stack):
    """Linen twin of :class:`jaxpos.nnx.Encoder`: bidirectional stack, default
    ``position="nope"``; returns final-normalised hidden states ``[B, T, d_model]``."""

    position: str = "nope"
    _causal = False

    __call__ = EncoderCore.__call__
