"""Flax NNX modules over the jaxpos functions: position modules, attention, blocks and
small decoder / encoder stacks.

Every attention-position scheme reaches the modules through the scheme registry
(:data:`jaxpos.REGISTRY`, :mod:`jaxpos.schemes.base`): a name such as ``"rope"``, ``"t5"`` or
``"kerple_log"`` selects a scheme class, whose ``init_params`` gives the learned
parameters that :class:`PositionModule` holds (as :class:`flax.nnx.Param` attributes)
and whose ``from_params`` builds the scheme object that :func:`jaxpos.attention` takes,
once per call. No attention, block or stack code here names a scheme: a scheme
registered anywhere (one file, see ``docs/architecture.md``) is accepted by
:class:`MultiHeadAttention`, :class:`TransformerBlock`, :class:`DecoderLM` and
:class:`Encoder`.

=============================  ============================  ==============================
module                         parameters                    enters the model
=============================  ============================  ==============================
:class:`SinusoidalEmbedding`   none (the table is computed)  added to the token embeddings
:class:`LearnedPositionalEmbedding`  ``table [max_len, d]``  added to the token embeddings
:class:`PositionModule`        the scheme's ``init_params``  inside attention (any scheme)
:class:`RotaryEmbedding`       none                          rotates q and k
:class:`ALiBi`                 none (fixed slopes)           score bias
:class:`T5RelativeBias`        ``table [num_buckets, N]``    score bias, one table per stack
:class:`ShawRelativePosition`  ``rel_k, rel_v [2K+1, H]``    key and value terms, per layer
=============================  ============================  ==============================

The last four are :class:`PositionModule` for ``"rope"``, ``"alibi"``, ``"t5"`` and
``"shaw"`` with their classic constructor arguments. Then :class:`MultiHeadAttention`
(``position=...``), :class:`TransformerBlock`, :class:`DecoderLM` and :class:`Encoder`.
The Linen twins in :mod:`jaxpos.linen` run the same code (the ``*Core`` classes of
:mod:`jaxpos.layers.cores`) over Linen parameter declarations, so
:func:`jaxpos.linen.params_from_nnx` moves weights across and both give the same outputs.

Design choices of the stacks (documented once here, used by both twins):

* Pre-LN blocks (Xiong et al. 2020): ``x + attn(rms_norm(x))`` then
  ``x + mlp(rms_norm(x))``, RMSNorm (Zhang & Sennrich 2019), a final RMSNorm.
* The MLP is ``gelu(x W_in) W_out`` (tanh GELU, GPT-2 style), ``mlp_dim = 4 * d_model``
  by default, no biases anywhere.
* Token embeddings are multiplied by ``sqrt(d_model)`` and tied to the output layer
  (Vaswani et al. 2017, §3.4); they are initialised ``N(0, 1/d_model)``, so the scaled
  embedding has unit variance, like the sinusoidal table's entries.
* Every scheme uses the usual ``scale = 1/sqrt(head_dim)``, T5 included (T5 itself uses
  1.0 with unscaled initialisation); a comparison between schemes then differs in the
  position term only. :class:`MultiHeadAttention` takes ``scale=`` to change it.
* A scheme whose class says ``params_per_layer = False`` (RoPE, ALiBi, T5, every scheme
  without parameters) is owned by the stack (``rel_position``): its scheme is built once
  per call and passed to every layer, so the T5 table is one parameter shared by all
  layers, as in T5 (Raffel et al. 2020, §2.1). ``params_per_layer = True`` (Shaw et al.
  2018, §3.1, whose tables are shared across heads, not layers) gives each layer its own
  :class:`PositionModule` (``blocks[i].attn.position_module``).

Attention sinks and mask_mods: ``MultiHeadAttention(sinks=True)`` learns a sink logit per
query head (parameter ``sinks [num_heads]``, GPT-OSS) and ``mask_mod=`` (e.g.
``jaxpos.SlidingWindowMask(w)``) restricts every call and every decoding step; blocks
and stacks pass both through, and ``DecoderLM(layer_mask_mods=[...])`` gives each layer
its own (alternating sliding-window and full layers).

KV-cache decoding: ``cache = model.init_cache(batch, max_len)`` then
``logits, cache = model.decode_step(tokens, cache, positions=...)`` with any number of
new tokens per step. A cache (:class:`KVCache`) holds what the scheme's
:meth:`~jaxpos.PositionScheme.cache_write` stores (RoPE keys rotated once, when written;
raw keys for the other built-in schemes), their positions, a per-row fill count and which
slots hold tokens (``valid``), so rows may sit at different offsets and positions are
just integers: ALiBi / T5 / Shaw read offsets from them. A step costs the filled length
(the fill counts bound the attention); ``init_cache(batch, max_len, keep_first=k)`` gives
a StreamingLLM cache (:class:`StreamingKVCache`).

Padding: ``model(tokens, attention_mask=...)`` and ``decode_step(tokens, cache,
attention_mask=...)`` take Hugging Face's mask (``[B, T]``, 1 = token, 0 = padding);
positions then default to Hugging Face's ``cumsum - 1``, no token attends to padding and
the cache remembers padded slots, so a left-padded batch gives every token the logits of
its sequence run alone, in the full pass, the prefill and every later step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

# Importing a scheme module registers its schemes; ``import jaxpos`` loads the built-in
# ones.
from jaxpos.layers.cache import KVCache, StreamingKVCache, rotate_at_write
from jaxpos.layers.cores import (
    AttentionCore,
    BlockCore,
    DecoderCore,
    EncoderCore,
    position_scheme,
)
from jaxpos.layers.functional import BIAS_INIT, linear_params, norm_params, token_embedding_init
from jaxpos.layers.nnx_positions import (
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
    attention_positions,
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
    from_keywords,
    options_signature,
)
from jaxpos.layers.stack import build_stack, stack_spec
from jaxpos.sharding import nnx_init, nnx_param, retype

__all__ = [
    "ABSOLUTE_POSITIONS",
    "ATTENTION_POSITIONS",
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
    "StreamingKVCache",
    "T5RelativeBias",
    "TransformerBlock",
    "attention_positions",
    "position_scheme",
    "rotate_at_write",
    "stack_positions",
]

def __getattr__(name: str):
    # POSITIONS / ATTENTION_POSITIONS are derived from the registry at each access (PEP 562).
    if name == "POSITIONS":
        return stack_positions()
    if name == "ATTENTION_POSITIONS":
        return attention_positions()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ================================================================== attention

class _NnxDropout:
    """Flax NNX's dropout conventions (those of ``nnx.Dropout`` and
    ``nnx.MultiHeadAttention``): the call's ``deterministic`` when given, else the
    module's ``deterministic`` attribute (False at construction; ``model.train()`` and
    ``model.eval()`` set it); keys from the call's ``rngs`` (an :class:`flax.nnx.Rngs`,
    its ``dropout`` stream, or a stream), else from the ``dropout`` stream the module
    forked at construction (``self.rngs``)."""

    if TYPE_CHECKING:  # dropout_rate, deterministic, ... of the module mixing this in
        def __getattr__(self, name: str) -> Any: ...

    def _is_deterministic(self, deterministic) -> bool:
        return bool(self.deterministic if deterministic is None else deterministic)

    def _dropout_key(self, rngs):
        stream = rngs.dropout if isinstance(rngs, nnx.Rngs) else rngs
        if stream is None:
            stream = self.rngs
        if stream is None:
            raise ValueError(f"{type(self).__name__} has dropout_rate={self.dropout_rate} and "
                             f"no dropout stream: pass rngs=nnx.Rngs(dropout=...) to the call.")
        return stream()

    def _keep_dropout_stream(self, rngs: nnx.Rngs):
        """After the parameters: the module's own dropout stream (``rngs.dropout``
        forked), kept only when it drops something."""
        self.deterministic = False
        self.rngs = rngs.dropout.fork() if self.dropout_rate > 0 else None


class MultiHeadAttention(_NnxDropout, AttentionCore, nnx.Module):
    """Multi-head (grouped-query) self- or cross-attention with any position scheme, over
    :func:`jaxpos.attention`.

    Args:
      d_model: input and output width ``D``.
      num_heads: query heads ``N``; num_kv_heads: key/value heads (default ``N``; a
        divisor of ``N`` gives grouped-query attention, Ainslie et al. 2023).
      head_dim: ``H``, default ``d_model // num_heads``.
      position: ``"nope"`` / ``None``, any registered scheme name
        (:func:`attention_positions`: ``"rope"``, ``"alibi"``, ``"t5"``, ``"shaw"``,
        ``"kerple_log"``, ...), or a :class:`PositionModule` (e.g.
        :class:`RotaryEmbedding`, :class:`T5RelativeBias`); a module passed here is shared
        by reference. A scheme object (e.g. ``jaxpos.RoPE(inv_freq)`` from a checkpoint)
        goes in at call time instead, as ``scheme=``.
      causal: causal self-attention (by positions: a query at ``p`` sees keys ``<= p``).
      rotary_dim, rope_base: RoPE options (default ``head_dim``, 10000).
      num_buckets, max_distance: T5 options (32, 128), or ``max_distance`` = Shaw's K (16).
      scheme_options: other scheme options, a dict (e.g. ``{"rope_layout":
        "interleaved"}``); they override the named ones.
      scale: score scale, default ``1/sqrt(head_dim)``.
      implementation: default backend of :func:`jaxpos.attention` (``None`` = best).
      use_bias: add biases to the four projections (GPT-2, BLOOM, BERT); default False
        (Llama, T5).
      output_gate: the output gate of Qiu et al. 2025 ("Gated Attention for Large
        Language Models", §2.2): each head's attention output, before ``o_proj``, times
        ``sigmoid(x W_g (+ b_g))`` computed from the layer input. ``True`` or
        ``"elementwise"`` (their G1: one gate per head and feature, ``gate_proj.kernel
        [D, N*H]``; Qwen3-Next, whose ``q_proj`` packs it beside each head's query),
        ``"headwise"`` (one scalar per head, ``gate_proj.kernel [D, N]``), or False
        (default). output_gate_bias: a bias ``gate_proj.bias`` (zeros at init) on the gate
        projection (Qwen3-Next with ``attention_bias``). Default False.
      qk_norm: RMSNorm of the queries and keys after their projections and before the
        position transform: ``"head"`` over each head's ``H`` features (parameters
        ``q_norm.scale``/``k_norm.scale [H]``, shared by the heads; Qwen3, Gemma 3,
        Qwen3-Next), ``"projection"`` over the whole projection (``q_norm.scale [N*H]``,
        ``k_norm.scale [N_kv*H]``; OLMo 2), or None (default). qk_norm_offset: the
        ``(1 + w)`` form, weights initialised to zeros (Gemma 3, Qwen3-Next); default
        False (``w``, ones). qk_norm_eps: their epsilon, default 1e-6.
      sinks: a bool; True gives the layer a learned attention-sink logit per query head,
        parameter ``sinks`` float ``[num_heads]`` (``param_dtype``, initialised to zeros),
        passed as ``sinks=`` to :func:`jaxpos.attention`: the softmax denominator gains
        ``exp(sinks[h])``, so a head may put weight on "no token" (Xiao et al. 2024,
        "Efficient Streaming Language Models with Attention Sinks", §3; the learned
        per-head form of OpenAI's GPT-OSS, Hugging Face ``GptOssAttention.sinks``). Zero
        logits already add 1 to the denominator. Default False (no parameter, the
        plain softmax).
      mask_mod: a mask_mod ``(batch, head, q_pos, kv_pos) -> bool`` applied in every call
        and in :meth:`decode` (:mod:`jaxpos.mods`; e.g. ``jaxpos.SlidingWindowMask(w)``
        for Mistral / Gemma / GPT-OSS sliding-window layers with ``causal=True``,
        ``jaxpos.ChunkedAttentionMask(c)`` for Llama 4's chunked layers); it is static
        module data, not a parameter. Default None.
      dropout_rate: attention dropout, the rate at which softmax probabilities are
        dropped (the kept ones scaled by ``1 / (1 - rate)``; :func:`jaxpos.attention`'s
        ``dropout_rate``, run by the chunked or reference path). Default 0. Dropout follows
        Flax NNX: on unless ``deterministic`` (the call's keyword, else the attribute that
        ``model.eval()`` / ``model.train()`` set), keys from the call's ``rngs`` or the
        ``dropout`` stream of ``rngs`` forked at construction. :meth:`decode` never drops.
      context_parallel: ``"ring"``, ``"ulysses"`` or None (default): under
        ``jax.set_mesh(mesh)`` the layer's attention runs sequence-parallel over the mesh
        axis ``context_axis`` (default ``"seq"``) with global positions
        (:func:`jaxpos.parallel.ring_attention` / :func:`jaxpos.parallel.ulysses_attention`
        in ``shard_map``: :func:`jaxpos.parallel.context.context_attention`); the sequence
        length must be divisible by the axis size (Ulysses: the heads too). No dense
        ``mask`` or attention dropout then. :meth:`decode` runs the ordinary path (one
        query per step needs no sequence parallelism).
      dtype: compute dtype; param_dtype: parameter dtype. rngs: :class:`flax.nnx.Rngs`.

    Parameters: ``q_proj.kernel [D, N*H]``, ``k_proj.kernel``/``v_proj.kernel [D, N_kv*H]``,
    ``o_proj.kernel [N*H, D]`` (and ``*.bias`` with ``use_bias``), ``sinks [N]`` with
    ``sinks=True`` (attribute ``sinks``, None otherwise), ``gate_proj``, ``q_norm`` and
    ``k_norm`` (None when off), plus those of the position module (attribute
    ``position_module``, e.g. ``position_module.rel_k`` for Shaw). Options are keywords
    (:class:`jaxpos.layers.spec.AttentionOptions`: an unknown one raises ``TypeError``).

    Call: ``x [B, T, D]`` -> ``[B, T, D]``, keyword ``positions`` (int ``[T]``/``[B, T]``,
    default ``arange``), ``context`` (``[B, Tk, D]``: cross-attention, keys and values
    from ``context`` at ``kv_positions``, default ``arange(Tk)``, with ``kv_segment_ids``;
    T5's decoder uses ``position="nope"`` there), ``mask``/``segment_ids`` as in
    :func:`jaxpos.attention`,
    ``scheme`` (a scheme object that replaces this layer's own, e.g. a stack's shared T5
    bias), ``rope_scaling`` (this call only; ``ValueError`` for a scheme that does not
    take it), ``implementation``, ``mask_mod`` (this call only; replaces the layer's),
    ``attention_mask`` (self-attention: bool or int ``[B, T]``, 1 = token, 0 = padding,
    Hugging Face's convention; no token attends to padding, and positions default to
    ``cumsum(attention_mask) - 1``). The layer's scheme is built per call by the position
    module (:meth:`PositionModule.scheme`, from the call's ``x`` and ``positions``).
    ``decode(x, cache, ..., attention_mask=None)`` appends to a :class:`KVCache` from
    ``init_cache(batch, max_len)`` and returns ``(y, cache)``; the cache remembers padded
    slots.

    Raises: ``ValueError`` for bad sizes, names (a registered scheme without
    ``from_params`` is named), positions or cache overflow; ``TypeError`` for float
    positions, a non-bool ``sinks``, a ``mask_mod`` that is not callable.
    """

    def __init__(self, d_model: int, num_heads: int, *, rngs: nnx.Rngs, **options: Any):
        o = from_keywords(AttentionOptions, "MultiHeadAttention", d_model, num_heads, **options)
        plan = check_attention(o)
        self.d_model, self.num_heads, self.num_kv_heads, self.head_dim = plan.dims
        self.dropout_rate, self.mask_mod = plan.dropout_rate, plan.mask_mod
        self.causal, self.scale, self.implementation, self.dtype = (
            bool(o.causal), o.scale, o.implementation, o.dtype)
        self.qk_norm_offset, self.qk_norm_eps = bool(o.qk_norm_offset), float(o.qk_norm_eps)
        self.context_parallel, self.context_axis = plan.context_parallel, o.context_axis
        for name, part in attention_parts(o, plan, _NnxMaker(o.dtype, o.param_dtype,
                                                              rngs)).items():
            setattr(self, name, part)
        self._keep_dropout_stream(rngs)

    def _dims(self):
        return self.d_model, self.num_heads, self.num_kv_heads, self.head_dim

    def _position(self):
        return self.position_module

    def _cache_scheme(self):
        return module_scheme(self.position_module)

    def _sinks(self):
        return None if self.sinks is None else retype(self.sinks[...])

# ================================================================== blocks and stacks

class TransformerBlock(_NnxDropout, BlockCore, nnx.Module):
    """A pre-LN transformer block: ``x + attn(rms_norm(x))``, then ``x + mlp(rms_norm(x))``
    (Xiong et al. 2020; RMSNorm, Zhang & Sennrich 2019; GELU MLP).

    Args: as :class:`MultiHeadAttention` (``sinks``, ``mask_mod``, ``use_bias``,
    ``output_gate``, ``qk_norm`` and their options included), plus
    ``mlp_dim`` (default ``4 * d_model``); ``dropout_rate`` is residual dropout on the
    attention and MLP branches before they are added (Vaswani et al. 2017, Sec. 5.4) and,
    unless ``attention_dropout_rate`` is given, attention dropout too.
    Parameters: ``attn_norm.scale``, ``attn.*``, ``mlp_norm.scale``, ``mlp_in.kernel
    [D, F]``, ``mlp_out.kernel [F, D]``.

    Call: ``x [B, T, D]`` -> ``[B, T, D]`` with the keywords of
    :meth:`MultiHeadAttention.__call__`; ``decode(x, cache, ...)`` -> ``(y, cache)``.
    """

    def __init__(self, d_model: int, num_heads: int, *, rngs: nnx.Rngs, **options: Any):
        o = from_keywords(BlockOptions, "TransformerBlock", d_model, num_heads, **options)
        plan = check_block(o)
        self.dropout_rate, self.dtype = plan.dropout_rate, o.dtype
        for name, part in block_parts(plan, _NnxMaker(o.dtype, o.param_dtype, rngs)).items():
            setattr(self, name, part)
        self._keep_dropout_stream(rngs)


class _NnxMaker:
    """The NNX constructors of the modules' parts (:class:`jaxpos.layers.spec.Maker`)."""

    def __init__(self, dtype: DTypeLike, param_dtype: DTypeLike, rngs: nnx.Rngs):
        self.dtype, self.param_dtype, self.rngs = dtype, param_dtype, rngs

    def linear(self, in_features, out_features, use_bias, name, axes=(None, None)):
        (_, kernel_init, _), (_, bias_init, _) = linear_params(in_features, out_features,
                                                               use_bias)
        return nnx.Linear(in_features, out_features, use_bias=use_bias,
                          kernel_init=nnx_init(kernel_init, axes),
                          bias_init=nnx_init(bias_init or BIAS_INIT, axes[1:]),
                          param_dtype=self.param_dtype, rngs=self.rngs)

    def norm(self, features, name, offset=False, axis="norm"):
        ((_, init, _),) = norm_params(features, offset)
        return nnx.RMSNorm(features, scale_init=nnx_init(init, (axis,)),
                           param_dtype=self.param_dtype, rngs=self.rngs)

    def zeros(self, name, shape, axes):
        return nnx_param(jnp.zeros(shape, self.param_dtype), axes)

    def position_module(self, position, name, **kwargs):
        return make_position_module(position, param_dtype=self.param_dtype, rngs=self.rngs,
                                    **kwargs)

    def attention(self, name, **options):
        return MultiHeadAttention(rngs=self.rngs, **options)

    def embed(self, vocab_size, d_model):
        return nnx.Embed(vocab_size, d_model, param_dtype=self.param_dtype,
                         embedding_init=nnx_init(token_embedding_init(d_model),
                                                 ("vocab", "embed")), rngs=self.rngs)

    def sinusoidal(self, d_model):
        return SinusoidalEmbedding(d_model, dtype=self.dtype)

    def learned(self, max_len, d_model):
        return LearnedPositionalEmbedding(max_len, d_model, param_dtype=self.param_dtype,
                                          rngs=self.rngs)

    def block(self, index, **options):
        return TransformerBlock(rngs=self.rngs, **options)

    def block_list(self, blocks):
        return nnx.List(blocks)


class _Stack(nnx.Module):
    """Shared constructor of :class:`DecoderLM` and :class:`Encoder` (options:
    :class:`jaxpos.layers.spec.StackOptions`)."""

    _causal = True

    def __init__(self, vocab_size: int, *, rngs: nnx.Rngs, **options: Any):
        o = from_keywords(StackOptions, type(self).__name__, vocab_size, **options)
        self.context_zigzag, self.context_axis = check_stack_context(o), o.context_axis
        self.context_parallel = o.context_parallel
        spec = stack_spec(o, causal=self._causal)
        self.vocab_size, self.position_name = spec.vocab_size, spec.plan.name
        self.d_model, self.num_layers, self.max_len = spec.d_model, spec.num_layers, o.max_len
        self.num_kv_heads, self.head_dim = spec.num_kv_heads, spec.head_dim
        self.implementation, self.dtype = o.implementation, o.dtype
        parts = build_stack(spec, _NnxMaker(o.dtype, o.param_dtype, rngs), o)
        self.embed, self.abs_position, self.rel_position, self.blocks, self.final_norm = parts

    def _position_name(self):
        return self.position_name

    def _cache_dims(self):
        return self.num_layers, self.num_kv_heads, self.head_dim

    def _cache_schemes(self):
        N = self.blocks[0].attn.num_heads
        if self.rel_position is not None:  # one scheme for the stack, passed to every layer
            return ((*(module_scheme(self.rel_position) or ("nope", ())), N),) * \
                self.num_layers
        return tuple((*(module_scheme(b.attn.position_module) or ("nope", ())), N)
                     for b in self.blocks)


class DecoderLM(DecoderCore, _Stack):
    """A causal decoder-only language model with any position scheme.

    Args:
      vocab_size: number of token ids.
      d_model, num_layers, num_heads: width, depth, query heads (``head_dim = d_model //
        num_heads``).
      position: ``"nope"`` (causal mask only; Haviv et al. 2022), ``"sinusoidal"``
        (Vaswani et al. 2017, §3.5) or ``"learned"`` (added to the token embeddings), or
        any registered scheme (:func:`stack_positions`), e.g. ``"rope"`` (Su et al. 2024),
        ``"alibi"`` (Press et al. 2022), ``"t5"`` (Raffel et al. 2020, causal buckets, one
        table for the stack), ``"shaw"`` (Shaw et al. 2018, keys and values, tables per
        layer), ``"kerple_log"`` (Chi et al. 2022), which act in attention.
      num_kv_heads: key/value heads for grouped-query attention (default ``num_heads``).
      mlp_dim: MLP width (default ``4 * d_model``).
      max_len: rows of the ``"learned"`` table (required there, ignored otherwise).
      rope_base: ``rope_theta``; t5_num_buckets, t5_max_distance: T5's 32 and 128;
      shaw_max_distance: Shaw's clipping distance K (an argument ``<scheme>_<option>``
        is the option ``<option>`` of that scheme only: :func:`stack_options`).
      scheme_options: other options of the scheme, a dict (override the above).
      implementation: default :func:`jaxpos.attention` backend (``None`` = the backend's
        best: chunked on CPU, the Pallas kernel on GPU/TPU where it fuses the scheme).
      context_parallel, context_axis: every layer's attention sequence-parallel
        (``"ring"`` or ``"ulysses"``) over the mesh axis ``context_axis`` of the mesh set
        with ``jax.set_mesh`` (:class:`MultiHeadAttention`); default None (off).
      context_zigzag: True (with ``context_parallel``) keeps the tokens in the zigzag
        order of ``context_axis`` from the embedding to the logits (returned in the
        tokens' own order), so every device of a causal ring has the same work
        (:func:`jaxpos.parallel.zigzag_permutation`); ``T`` a multiple of twice the axis
        size. Default False.
      sinks: True gives every layer learned attention-sink logits, parameter
        ``blocks[i].attn.sinks [num_heads]`` (zeros at init; GPT-OSS;
        :class:`MultiHeadAttention`). Default False.
      mask_mod: one mask_mod for every layer (e.g. ``jaxpos.SlidingWindowMask(w)``),
        applied in the forward pass and in :meth:`decode_step`. Default None.
      layer_mask_mods: a list or tuple of ``num_layers`` entries, a mask_mod or None
        (full attention) per layer, e.g. ``[jaxpos.SlidingWindowMask(128), None] *
        (num_layers // 2)`` for the alternating sliding / full layers of GPT-OSS and
        Gemma 2 (Hugging Face ``layer_types``). Exclusive with ``mask_mod``.
      layer_positions: a list or tuple of ``num_layers`` attention position names, one
        scheme per layer (each layer then owns its scheme's parameters); ``position``
        must be ``"nope"`` (or absolute). E.g. the RNoPE-SWA layout of Yang et al. 2025:
        :func:`jaxpos.schemes.rnope.rnope_swa_layers` gives ``position``, ``layer_positions``
        and ``layer_mask_mods``.
      dropout_rate: residual dropout in every block and, unless
        ``attention_dropout_rate`` is given, attention dropout (:class:`TransformerBlock`);
        default 0. NNX conventions: on until ``model.eval()`` (or a call's
        ``deterministic=True``), keys from the call's ``rngs`` or each layer's ``dropout``
        stream forked from ``rngs`` at construction; :meth:`decode_step` never drops.
      output_gate, output_gate_bias: every layer's output gate (elementwise or headwise,
        Qiu et al. 2025; :class:`MultiHeadAttention`). Default False.
      qk_norm, qk_norm_offset, qk_norm_eps: every layer's q/k RMSNorm (``"head"``: Qwen3,
        Gemma 3 with the ``(1 + w)`` offset; ``"projection"``: OLMo 2;
        :class:`MultiHeadAttention`). Default None.
      dtype: compute dtype (logits are float32); param_dtype: parameter dtype.
      rngs: :class:`flax.nnx.Rngs` (``params`` stream).

    The architecture (pre-LN RMSNorm, GELU MLP, tied embeddings scaled by
    ``sqrt(d_model)``, ``scale = 1/sqrt(head_dim)`` for every scheme) and where a scheme's
    parameters live (stack or layer) are described in the module docstring.

    Raises:
      ValueError: unknown ``position`` (a registered scheme without ``from_params`` is
        named), ``"learned"`` without ``max_len``, sizes that do not divide, options the
        scheme rejects, ``layer_mask_mods`` of a length other than ``num_layers`` or
        given with ``mask_mod``. TypeError: non-int sizes, a non-bool ``sinks``, a
        ``mask_mod`` or ``layer_mask_mods`` entry that is neither callable nor None.
    """

    _causal = True

    def __init__(self, vocab_size: int, *, position: str = "rope", **kwargs: Any):
        """Arguments as the class docstring says (the other keywords and their defaults
        are those of the shared stack constructor)."""
        super().__init__(vocab_size, position=position, **kwargs)


class Encoder(EncoderCore, _Stack):
    """A bidirectional encoder stack (no causal mask) with any position scheme.

    Arguments as :class:`DecoderLM` (default ``position="nope"``; ``sinks``, ``mask_mod``
    and ``layer_mask_mods`` too, e.g. ``jaxpos.PrefixLMMask(n)``); relative schemes use
    their bidirectional forms (ALiBi ``-m|i - j|``, T5's two-sided buckets; a scheme that
    needs a causal mask, such as FoX, raises ``ValueError``). There is no output head: the
    call returns the final-normalised hidden states.

    Call: ``tokens`` int ``[B, T]``; keywords ``positions``, ``attention_mask`` (padding,
    Hugging Face's ``[B, T]``, 1 = token, 0 = padding: no token attends to padding, on
    every implementation), ``mask`` (bool, broadcastable to ``[B, N, T, T]``; the Pallas
    kernel takes no arbitrary mask), ``segment_ids``, ``rope_scaling``,
    ``implementation``. Returns ``[B, T, d_model]`` in ``dtype``.
    """

    _causal = False

    def __init__(self, vocab_size: int, *, position: str = "nope", **kwargs: Any):
        """Arguments as the class docstring says (the other keywords and their defaults
        are those of the shared stack constructor)."""
        super().__init__(vocab_size, position=position, **kwargs)


# help() and inspect.signature list every option of the keyword constructors.
MultiHeadAttention.__init__.__signature__ = options_signature(AttentionOptions, 2)
TransformerBlock.__init__.__signature__ = options_signature(BlockOptions, 2)
DecoderLM.__init__.__signature__ = options_signature(StackOptions, 1,
                                                     defaults={"position": "rope"})
Encoder.__init__.__signature__ = options_signature(StackOptions, 1,
                                                   defaults={"position": "nope"})
