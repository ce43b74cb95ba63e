"""A stack's layout, shared by :class:`jaxpos.nnx.DecoderLM` / :class:`jaxpos.nnx.Encoder`
and their Linen twins: the stack's arguments validated once (:func:`stack_spec`), where
its position scheme lives (:func:`stack_plan`) and the one builder of its submodules
(:func:`build_stack`), which each twin calls with its own constructors
(:class:`jaxpos.layers.spec.Maker`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from jaxpos import _checks
from jaxpos.layers.options import (
    ABSOLUTE_POSITIONS,
    attention_dims,
    attention_positions,
    check_position_name,
    check_sinks_flag,
    layer_mask_mods_plan,
    stack_options,
)
from jaxpos.layers.spec import LAYER_OPTIONS, Maker, StackOptions
from jaxpos.schemes.base import REGISTRY

__all__ = ["StackMaker", "StackParts", "StackPlan", "StackSpec", "build_stack", "stack_plan",
           "stack_spec"]

class StackPlan(NamedTuple):
    """How a stack places its position scheme (:func:`stack_plan`)."""

    name: str            #: the stack's position name (absolute or registered)
    absolute: str | None  #: "sinusoidal" / "learned", or None
    scheme: str          #: the attention scheme's registered name ("nope" for absolute)
    per_layer: bool      #: the scheme's ``params_per_layer``: a module in every layer
    options: tuple       #: the scheme's options (:func:`stack_options`)


def stack_plan(position: Any, *, max_len: int | None, rope_base: float | None, prefixed: dict,
               scheme_options: Any) -> StackPlan:
    """Validate a stack's ``position`` and decide where its scheme lives: absolute
    positions add a module to the embeddings (attention then uses ``"nope"``); a
    registered scheme lives in every layer when its class says ``params_per_layer``,
    else once in the stack (its scheme built once per call and passed to every layer).

    Raises:
      ValueError: unknown name, a registered scheme without ``from_params``,
        ``"learned"`` without ``max_len``. TypeError: a bad ``scheme_options``.
    """
    name = check_position_name("position", position)
    absolute = name if name in ABSOLUTE_POSITIONS else None
    if name == "learned" and max_len is None:
        raise ValueError("position='learned' needs max_len (the number of table rows); "
                         "got max_len=None.")
    scheme = "nope" if absolute else name
    options = stack_options(scheme, rope_base=rope_base, prefixed=prefixed,
                            scheme_options=scheme_options)
    return StackPlan(name, absolute, scheme, bool(REGISTRY[scheme].params_per_layer), options)


class StackSpec(NamedTuple):
    """A stack's validated arguments (:func:`stack_spec`)."""

    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_len: int | None
    sinks: bool
    mask_mods: tuple     #: one mask_mod (or None) per layer
    plan: StackPlan
    causal: bool
    #: per-layer plans (``layer_positions``), or None: every layer uses ``plan``
    layer_plans: tuple | None = None


def stack_spec(o: StackOptions, *, causal: bool) -> StackSpec:
    """Validate the options of a stack (:class:`jaxpos.nnx.DecoderLM`,
    :class:`jaxpos.nnx.Encoder`, their Linen twins; ``o`` holds their arguments).

    Raises:
      ValueError / TypeError: as the stacks document (sizes, names, options, sinks,
        mask_mods), naming the argument.
    """
    vocab_size = _checks.check_positive_int("vocab_size", o.vocab_size)
    d_model, num_heads, num_kv_heads, head_dim = attention_dims(o.d_model, o.num_heads,
                                                                o.num_kv_heads, None)
    num_layers = _checks.check_positive_int("num_layers", o.num_layers)
    sinks = check_sinks_flag(o.sinks)
    mask_mods = layer_mask_mods_plan(num_layers, o.mask_mod, o.layer_mask_mods)
    if o.max_len is not None:
        _checks.check_positive_int("max_len", o.max_len)
    options = {"rope_base": o.rope_base, "scheme_options": o.scheme_options, "prefixed": {
        "t5_num_buckets": o.t5_num_buckets, "t5_max_distance": o.t5_max_distance,
        "shaw_max_distance": o.shaw_max_distance}}
    plan = stack_plan(o.position, max_len=o.max_len, **options)
    layer_plans = _layer_plans(o.layer_positions, num_layers, plan, **options)
    return StackSpec(vocab_size, d_model, num_layers, num_heads, num_kv_heads, head_dim,
                     o.max_len, sinks, mask_mods, plan, bool(causal), layer_plans)


def _layer_plans(layer_positions, num_layers, plan, **options) -> tuple | None:
    """One :class:`StackPlan` per layer from ``layer_positions`` (a list or tuple of
    ``num_layers`` attention position names), or None. Each layer then owns its scheme and
    its parameters (none for RoPE / NoPE); the stack's ``position`` may only be ``"nope"``
    or absolute (``"sinusoidal"`` / ``"learned"``, added to the embeddings).

    Raises:
      TypeError: not a list or tuple; an entry that is not a string.
      ValueError: a length other than ``num_layers``; an unknown name; a relative
        ``position`` given as well.
    """
    if layer_positions is None:
        return None
    if not isinstance(layer_positions, (list, tuple)):
        raise TypeError(f"layer_positions must be a list or tuple of {num_layers} position "
                        f"names (one per layer); got {type(layer_positions).__name__}.")
    if len(layer_positions) != num_layers:
        raise ValueError(f"layer_positions must have one entry per layer ({num_layers}); "
                         f"got {len(layer_positions)}.")
    if plan.scheme != "nope":
        raise ValueError(f"layer_positions sets each layer's scheme; position must then be "
                         f"'nope' or absolute ('sinusoidal', 'learned'); got position="
                         f"{plan.name!r}.")
    names = [check_position_name(f"layer_positions[{i}]", p, attention_positions())
             for i, p in enumerate(layer_positions)]
    return tuple(stack_plan(n, max_len=None, **options) for n in names)


#: The constructors a twin gives :func:`build_stack` (:class:`jaxpos.layers.spec.Maker`).
StackMaker = Maker


class StackParts(NamedTuple):
    """The submodules of a stack, as the ``*Core`` classes read them."""

    embed: Any
    abs_position: Any
    rel_position: Any
    blocks: Any
    final_norm: Any


def build_stack(spec: StackSpec, make: Maker, o: StackOptions) -> StackParts:
    """The submodules of a stack: the token embedding, the absolute position module (or
    None), the stack's position module (None when the scheme lives in every layer,
    ``params_per_layer``), ``num_layers`` blocks (with the stack's dropout rates and the
    options of :data:`jaxpos.layers.spec.LAYER_OPTIONS`) and the final norm, built by
    ``make`` in this order (NNX draws parameter keys in it)."""
    D, N, plan = spec.d_model, spec.num_heads, spec.plan
    embed = make.embed(spec.vocab_size, D)
    abs_position = None
    if plan.absolute == "sinusoidal":
        abs_position = make.sinusoidal(D)
    elif plan.absolute == "learned":
        assert spec.max_len is not None  # stack_plan refuses "learned" without max_len
        abs_position = make.learned(spec.max_len, D)
    per_layer = plan.per_layer or spec.layer_plans is not None
    rel_position = None if per_layer else make.position_module(
        plan.scheme, "rel_position", num_heads=N, head_dim=spec.head_dim, d_model=D,
        causal=spec.causal, options=plan.options)
    layer_plans = spec.layer_plans or (plan,) * spec.num_layers
    shared = {name: getattr(o, name) for name in LAYER_OPTIONS}
    blocks = make.block_list([
        make.block(i, d_model=D, num_heads=N, num_kv_heads=spec.num_kv_heads,
                   mlp_dim=o.mlp_dim, position=p.scheme if per_layer else "nope",
                   causal=spec.causal, scheme_options=dict(p.options) if per_layer else None,
                   implementation=o.implementation, sinks=spec.sinks,
                   mask_mod=spec.mask_mods[i], dropout_rate=o.dropout_rate,
                   attention_dropout_rate=o.attention_dropout_rate, dtype=o.dtype,
                   param_dtype=o.param_dtype, **shared)
        for i, p in enumerate(layer_plans)])
    return StackParts(embed, abs_position, rel_position, blocks, make.norm(D, "final_norm"))
