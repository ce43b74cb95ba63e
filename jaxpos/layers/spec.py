"""The modules' options, declared once: the arguments of :class:`jaxpos.nnx.MultiHeadAttention`,
:class:`jaxpos.nnx.TransformerBlock` and the stacks (:class:`jaxpos.nnx.DecoderLM`,
:class:`jaxpos.nnx.Encoder`) with their defaults, read by both twins.

* :class:`AttentionOptions`, :class:`BlockOptions`, :class:`StackOptions`: dataclasses of
  the options. The NNX constructors take them as keywords (``**options``, validated by
  the dataclass: an unknown keyword raises ``TypeError``) and the Linen twins inherit them
  as their fields.
* :func:`check_attention` / :func:`check_block`: the checks of those options, in one
  place, returning the validated values (:class:`AttentionPlan`, :class:`BlockPlan`).
* :func:`attention_parts` / :func:`block_parts`: the submodules and parameters of a layer
  and a block, built by a twin's :class:`Maker` (its constructors), so both twins declare
  the same tree.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, NamedTuple, Protocol

import jax.numpy as jnp

from jaxpos import _checks
from jaxpos.core.dropout import check_dropout_rate
from jaxpos.layers.options import (
    attention_dims,
    check_attention_options,
    check_mask_mod,
    check_output_gate,
    check_qk_norm,
    check_sinks_flag,
    collect_options,
)
from jaxpos.parallel.context import check_context_parallel, check_zigzag

__all__ = [
    "LAYER_OPTIONS",
    "AttentionOptions",
    "AttentionPlan",
    "BlockOptions",
    "BlockPlan",
    "Maker",
    "StackOptions",
    "attention_parts",
    "block_parts",
    "check_attention",
    "check_block",
    "check_stack_context",
    "from_keywords",
    "options_signature",
]


@dataclasses.dataclass(eq=False, repr=False)
class AttentionOptions:
    """The options of :class:`jaxpos.nnx.MultiHeadAttention` (documented there)."""

    d_model: int                      #: input and output width D
    num_heads: int                    #: query heads N
    num_kv_heads: int | None = None   #: key/value heads (default N)
    head_dim: int | None = None       #: H (default d_model // num_heads)
    position: Any = "nope"            #: a registered name, a position module, or None
    causal: bool = False
    rotary_dim: int | None = None     #: RoPE: rotated features per head
    rope_base: float = 10000.0        #: RoPE: rope_theta
    num_buckets: int = 32             #: T5 buckets
    max_distance: int | None = None   #: T5's max distance or Shaw's K
    scale: float | None = None        #: score scale (default 1/sqrt(H))
    implementation: str | None = None  #: default jaxpos.attention backend
    dtype: Any = jnp.float32          #: compute dtype
    param_dtype: Any = jnp.float32
    scheme_options: Any = None        #: other scheme options, a dict
    sinks: bool = False               #: learn one sink logit per query head
    mask_mod: Any = None              #: a mask_mod for every call
    dropout_rate: float = 0.0         #: attention dropout
    use_bias: bool = False            #: biases on the four projections
    output_gate: Any = False          #: False, True / "elementwise", "headwise"
    output_gate_bias: bool = False    #: a bias on the gate projection
    qk_norm: str | None = None        #: None, "head" or "projection"
    qk_norm_offset: bool = False      #: the (1 + w) form of the q/k norms
    qk_norm_eps: float = 1e-6         #: the q/k norms' epsilon
    context_parallel: str | None = None  #: "ring", "ulysses" or None (jaxpos.parallel)
    context_axis: str = "seq"         #: the mesh axis of context parallelism


@dataclasses.dataclass(eq=False, repr=False)
class BlockOptions(AttentionOptions):
    """The options of :class:`jaxpos.nnx.TransformerBlock`: those of attention plus the
    MLP width and the attention dropout rate (default: ``dropout_rate``)."""

    mlp_dim: int | None = None
    attention_dropout_rate: float | None = None


#: Options a stack passes unchanged to the attention of every layer.
LAYER_OPTIONS = ("output_gate", "output_gate_bias", "qk_norm", "qk_norm_offset", "qk_norm_eps",
                 "context_parallel", "context_axis")


@dataclasses.dataclass(eq=False, repr=False)
class StackOptions:
    """The options of :class:`jaxpos.nnx.DecoderLM` and :class:`jaxpos.nnx.Encoder`
    (documented there)."""

    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    position: str = "rope"
    num_kv_heads: int | None = None
    mlp_dim: int | None = None
    max_len: int | None = None        #: rows of the "learned" table
    rope_base: float = 10000.0
    t5_num_buckets: int = 32
    t5_max_distance: int = 128
    shaw_max_distance: int = 16
    implementation: str | None = None
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    scheme_options: Any = None
    sinks: bool = False
    mask_mod: Any = None
    layer_mask_mods: Any = None       #: one mask_mod (or None) per layer
    layer_positions: Any = None       #: one attention position name per layer
    dropout_rate: float = 0.0
    attention_dropout_rate: float | None = None
    output_gate: Any = False
    output_gate_bias: bool = False
    qk_norm: str | None = None
    qk_norm_offset: bool = False
    qk_norm_eps: float = 1e-6
    context_parallel: str | None = None
    context_axis: str = "seq"
    context_zigzag: bool = False      #: tokens in the zigzag order of context_axis


def from_keywords(cls: type, owner: str, *args: Any, **kwargs: Any) -> Any:
    """``cls(*args, **kwargs)`` (an options dataclass), a ``TypeError`` for an unknown or
    missing keyword naming the module ``owner`` and listing the options."""
    try:
        return cls(*args, **kwargs)
    except TypeError as err:
        names = [f.name for f in dataclasses.fields(cls)]
        raise TypeError(f"{owner}: {err}. Its options are {names}.") from None


def options_signature(cls, positional: int, *, extra: tuple[str, ...] = ("rngs",),
                      defaults: dict | None = None) -> inspect.Signature:
    """The signature of an NNX constructor that takes the options of dataclass ``cls`` as
    keywords: ``self``, the first ``positional`` fields positional, every other field a
    keyword with its default (``defaults`` overriding), then the keywords ``extra``
    (required), so that ``help()`` and ``inspect.signature`` list every option."""
    P = inspect.Parameter
    defaults = defaults or {}
    params = [P("self", P.POSITIONAL_OR_KEYWORD)]
    for i, f in enumerate(dataclasses.fields(cls)):
        default = defaults.get(f.name, f.default)
        default = P.empty if default is dataclasses.MISSING else default
        kind = P.POSITIONAL_OR_KEYWORD if i < positional else P.KEYWORD_ONLY
        params.append(P(f.name, kind, default=default, annotation=f.type))
    params += [P(n, P.KEYWORD_ONLY) for n in extra]
    return inspect.Signature(params)


class AttentionPlan(NamedTuple):
    """An attention layer's validated options (:func:`check_attention`)."""

    dims: tuple          #: (d_model, num_heads, num_kv_heads, head_dim)
    dropout_rate: float
    sinks: bool
    mask_mod: Any
    scheme_options: tuple  #: (name, value) pairs (:func:`collect_options`)
    gate: str | None     #: None, "elementwise" or "headwise"
    qk_norm: str | None  #: None, "head" or "projection"
    context_parallel: str | None = None  #: None, "ring" or "ulysses"


def check_attention(o: AttentionOptions) -> AttentionPlan:
    """Every check of an attention layer's options, at construction (NNX) or ``setup``
    (Linen). Raises ``ValueError`` / ``TypeError`` naming the option, as
    :class:`jaxpos.nnx.MultiHeadAttention` documents."""
    dims = attention_dims(o.d_model, o.num_heads, o.num_kv_heads, o.head_dim)
    rate = check_dropout_rate("dropout_rate", o.dropout_rate)
    check_attention_options(o.implementation, o.use_bias)
    sinks = check_sinks_flag(o.sinks)
    mask_mod = check_mask_mod("mask_mod", o.mask_mod)
    options = collect_options(rotary_dim=o.rotary_dim, rope_base=o.rope_base,
                              num_buckets=o.num_buckets, max_distance=o.max_distance,
                              scheme_options=o.scheme_options)
    gate = check_output_gate(o.output_gate, o.output_gate_bias)
    qk_norm = check_qk_norm(o.qk_norm, o.qk_norm_offset, o.qk_norm_eps)
    context = check_context_parallel(o.context_parallel, o.context_axis)
    return AttentionPlan(dims, rate, sinks, mask_mod, options, gate, qk_norm, context)


def check_stack_context(o: StackOptions) -> bool:
    """The stack's ``context_parallel`` / ``context_axis`` / ``context_zigzag`` checked;
    returns the zigzag flag."""
    return check_zigzag(o.context_zigzag, check_context_parallel(o.context_parallel,
                                                                 o.context_axis))


class BlockPlan(NamedTuple):
    """A block's validated widths and the keywords of its attention layer."""

    d_model: int
    mlp_dim: int
    dropout_rate: float  #: residual dropout
    attention: dict      #: the AttentionOptions of the block's attention, as keywords


def check_block(o: BlockOptions) -> BlockPlan:
    """The block's own checks (``d_model``, ``mlp_dim``, both dropout rates); the
    attention layer checks the rest when it is built."""
    D = _checks.check_positive_int("d_model", o.d_model)
    F = 4 * D if o.mlp_dim is None else _checks.check_positive_int("mlp_dim", o.mlp_dim)
    rate = check_dropout_rate("dropout_rate", o.dropout_rate)
    attn_rate = rate if o.attention_dropout_rate is None else check_dropout_rate(
        "attention_dropout_rate", o.attention_dropout_rate)
    attention = {f.name: getattr(o, f.name) for f in dataclasses.fields(AttentionOptions)}
    attention.update(d_model=D, dropout_rate=attn_rate)
    return BlockPlan(D, F, rate, attention)


class Maker(Protocol):
    """The constructors of one twin (NNX or Linen) that :func:`attention_parts`,
    :func:`block_parts` and :func:`jaxpos.layers.stack.build_stack` call. NNX draws
    parameter keys in the order of the calls. ``axes`` are the logical names of a
    parameter's axes (:mod:`jaxpos.sharding`): ``linear``'s are the kernel's ``(in,
    out)``, its bias takes ``out``'s."""

    def linear(self, in_features: int, out_features: int, use_bias: bool, name: str,
               axes: tuple = (None, None)) -> Any: ...
    def norm(self, features: int, name: str, offset: bool = False,
             axis: str = "norm") -> Any: ...
    def zeros(self, name: str, shape: tuple, axes: tuple) -> Any: ...
    def position_module(self, position: Any, name: str, **kwargs: Any) -> Any: ...
    def attention(self, name: str, **options: Any) -> Any: ...
    def embed(self, vocab_size: int, d_model: int) -> Any: ...
    def sinusoidal(self, d_model: int) -> Any: ...
    def learned(self, max_len: int, d_model: int) -> Any: ...
    def block(self, index: int, **options: Any) -> Any: ...
    def block_list(self, blocks: list) -> Any: ...


def attention_parts(o: AttentionOptions, plan: AttentionPlan, make: Maker) -> dict[str, Any]:
    """The submodules and parameters of an attention layer, by attribute name:
    ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``sinks`` (zeros ``[N]``, or None),
    ``gate_proj`` (``[D, N*H]`` elementwise or ``[D, N]`` headwise, or None),
    ``position_module`` (or None), ``q_norm``/``k_norm`` (over ``H``, or over ``N*H`` /
    ``N_kv*H`` for ``qk_norm="projection"``; None without)."""
    D, N, Nk, H = plan.dims
    parts: dict[str, Any] = {
        name: make.linear(i, out, o.use_bias, name, axes) for name, i, out, axes in (
            ("q_proj", D, N * H, ("embed", "heads")),
            ("k_proj", D, Nk * H, ("embed", "kv_heads")),
            ("v_proj", D, Nk * H, ("embed", "kv_heads")),
            ("o_proj", N * H, D, ("heads", "embed")))}
    parts["sinks"] = make.zeros("sinks", (N,), ("heads",)) if plan.sinks else None
    parts["gate_proj"] = None if plan.gate is None else make.linear(
        D, N * H if plan.gate == "elementwise" else N, bool(o.output_gate_bias), "gate_proj",
        ("embed", "heads"))
    parts["position_module"] = make.position_module(
        o.position, "position_module", num_heads=N, head_dim=H, d_model=D,
        causal=bool(o.causal), options=plan.scheme_options)
    per_head = plan.qk_norm == "head"
    for name, heads, axis in (("q_norm", N, "heads"), ("k_norm", Nk, "kv_heads")):
        parts[name] = None if plan.qk_norm is None else make.norm(
            H if per_head else heads * H, name, bool(o.qk_norm_offset),
            "head_dim" if per_head else axis)
    return parts


def block_parts(plan: BlockPlan, make: Maker) -> dict[str, Any]:
    """The submodules of a block, by attribute name: ``attn_norm``, ``attn``,
    ``mlp_norm``, ``mlp_in [D, F]``, ``mlp_out [F, D]``."""
    D, F = plan.d_model, plan.mlp_dim
    return {"attn_norm": make.norm(D, "attn_norm"),
            "attn": make.attention("attn", **plan.attention),
            "mlp_norm": make.norm(D, "mlp_norm"),
            "mlp_in": make.linear(D, F, False, "mlp_in", ("embed", "mlp")),
            "mlp_out": make.linear(F, D, False, "mlp_out", ("mlp", "embed"))}
