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

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike, DTypeLike

# Importing a scheme module registers its schemes; ``import jaxpos`` loads the built-in
# ones.
from jaxpos import _checks
from jaxpos.core.dropout import check_dropout_rate
from jaxpos.layers.cache import KVCache, StreamingKVCache, rotate_at_write
from jaxpos.layers.cores import (
    AttentionCore,
    BlockCore,
    DecoderCore,
    EncoderCore,
    LearnedCore,
    PositionCore,
    SinusoidalCore,
    position_scheme,
)
from jaxpos.layers.functional import learned_table_init, token_embedding_init
from jaxpos.layers.options import (
    ABSOLUTE_POSITIONS,
    attention_dims,
    attention_positions,
    check_attention_options,
    check_mask_mod,
    check_module_dims,
    check_options_read,
    check_output_gate,
    check_position_name,
    check_sinks_flag,
    collect_options,
    freeze_options,
    has_params,
    init_scheme_params,
    stack_positions,
)
from jaxpos.layers.stack import build_stack, stack_spec
from jaxpos.parallel.context import check_context_parallel, check_zigzag
from jaxpos.schemes.alibi import alibi_bias
from jaxpos.schemes.base import REGISTRY
from jaxpos.schemes.rope import apply_rope, check_rotary_dim
from jaxpos.schemes.t5 import check_bucket_args, t5_bias

if TYPE_CHECKING:
    from jaxpos.schemes.alibi import ALiBi as ALiBiScheme
    from jaxpos.schemes.rope import RoPE as RoPEScheme

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


# ================================================================== position modules

class SinusoidalEmbedding(SinusoidalCore, nnx.Module):
    """Sinusoidal absolute positions (Vaswani et al. 2017, §3.5), computed from the
    positions at every call: the table is **not** a parameter (the module has no state)
    and has no length limit.

    Args:
      d_model: width of the vectors.
      base: wavelength base (10000).
      layout: ``"interleaved"`` (the paper) or ``"concat"`` (tensor2tensor).
      dtype: output dtype (angles in float32).

    Call: ``positions`` int ``[T]`` or ``[B, T]`` -> ``[T, d_model]`` / ``[B, T, d_model]``.
    Raises ``TypeError`` for float positions, ``ValueError`` for bad ``d_model``/``layout``.
    """

    def __init__(self, d_model: int, *, base: float = 10000.0, layout: str = "interleaved",
                 dtype: DTypeLike = jnp.float32):
        self.d_model = _checks.check_positive_int("d_model", d_model)
        _checks.check_choice("layout", layout, ("interleaved", "concat"))
        self.base, self.layout, self.dtype = float(base), layout, dtype

class LearnedPositionalEmbedding(LearnedCore, nnx.Module):
    """Learned absolute positions (Gehring et al. 2017; GPT-2, BERT): a trained table
    ``[max_len, d_model]`` whose row ``t`` is added at position ``t``.

    Args:
      max_len: number of rows; there is no row for position ``max_len``.
      d_model: width.
      out_of_range: ``"error"`` (default: concrete positions outside the table and any
        sequence longer than ``max_len`` raise ``ValueError``; traced positions outside
        give NaN rows), ``"wrap"`` or ``"clip"`` (see :func:`jaxpos.learned_positions`).
      embedding_init: initialiser, default ``N(0, 1/2)`` (the sinusoidal table's variance).
      rngs: :class:`flax.nnx.Rngs` (uses the ``params`` stream).

    Call: ``positions`` int ``[T]`` or ``[B, T]`` -> ``[..., T, d_model]`` (param dtype).
    """

    def __init__(self, max_len: int, d_model: int, *, out_of_range: str = "error",
                 embedding_init: Callable[..., Any] | None = None,
                 param_dtype: DTypeLike = jnp.float32, rngs: nnx.Rngs):
        max_len = _checks.check_positive_int("max_len", max_len)
        d_model = _checks.check_positive_int("d_model", d_model)
        _checks.check_choice("out_of_range", out_of_range, ("error", "wrap", "clip"))
        init = embedding_init or learned_table_init()
        self.table = nnx.Param(init(rngs.params(), (max_len, d_model), param_dtype))
        self.max_len, self.d_model, self.out_of_range = max_len, d_model, out_of_range

class PositionModule(PositionCore, nnx.Module):
    """The attention-position module of any registered scheme: holds the scheme's learned
    parameters (``init_params``) as :class:`flax.nnx.Param` attributes of the same names
    (``table`` for T5, ``rel_k``/``rel_v`` for Shaw, ...) and builds the scheme for each
    call with ``from_params`` (:meth:`scheme`).

    Args:
      position: a registered name (:func:`attention_positions`; ``"none"`` = ``"nope"``).
      num_heads, head_dim: the attention layer's query heads and head width (None where
        the scheme does not need them). d_model: model width (initialisers use it).
      causal: the layer is causal (T5 then uses causal buckets, ALiBi ``m (kv - q)``).
      options: the scheme's options, a dict (``rotary_dim``, ``rope_base``,
        ``rope_layout``, ``rope_scaling`` (the default for every call), ``num_buckets``,
        ``max_distance``, or a new scheme's own; None where unset).
      param_init: an initialiser ``(key, shape, dtype)`` replacing the scheme's for every
        parameter; default: the scheme's ``init_params``.
      param_dtype: parameter dtype. rngs: :class:`flax.nnx.Rngs` (``params`` stream),
        required when the scheme has parameters.

    The scheme is built once at construction (with a one-token input) so that bad
    options raise here, not at the first call.

    Raises:
      ValueError: unknown name, a registered scheme without ``from_params``, a scheme
        with parameters and no ``rngs``, options the scheme rejects (its own message).
      TypeError: non-int sizes, ``options`` not a dict.
    """

    def __init__(self, position: str, *, num_heads: int | None = None,
                 head_dim: int | None = None, d_model: int | None = None,
                 causal: bool = False, options: dict | None = None,
                 param_init: Callable[..., Any] | None = None,
                 param_dtype: DTypeLike = jnp.float32, rngs: nnx.Rngs | None = None):
        name = check_position_name("position", position, attention_positions())
        check_module_dims(num_heads, head_dim, d_model)
        frozen = freeze_options(options)
        self.position_name, self.num_heads, self.head_dim = name, num_heads, head_dim
        self.d_model, self.causal, self.options = d_model, bool(causal), frozen
        cls = REGISTRY[name]
        params = {}
        if has_params(cls):
            if rngs is None:
                raise ValueError(f"position={name!r} ({cls.__name__}) has learned parameters; "
                                 f"pass rngs=nnx.Rngs(...).")
            params = init_scheme_params(name, rngs.params(), num_heads=num_heads,
                                        head_dim=head_dim, d_model=d_model, causal=self.causal,
                                        options=frozen, param_dtype=param_dtype)
            if param_init is not None:
                params = {n: param_init(rngs.params(), v.shape, v.dtype)
                          for n, v in params.items()}
        for n, v in params.items():
            if hasattr(self, n):
                raise ValueError(f"{cls.__name__}.init_params returned a parameter named "
                                 f"{n!r}, which is an attribute of PositionModule; rename it.")
            setattr(self, n, nnx.Param(v))
        self.param_names = tuple(params)
        self._validate(param_dtype)

    def _spec(self):
        return (self.position_name, self.num_heads, self.head_dim, self.causal, self.options)

    def _scheme_params(self):
        return {n: getattr(self, n)[...] for n in self.param_names}

    def _validate(self, dtype: DTypeLike):
        x = None if self.d_model is None else jnp.zeros((1, 1, self.d_model), dtype)
        scheme = self.scheme(x=x, positions=jnp.zeros((1, 1), jnp.int32))
        check_options_read(self.position_name, self.options, self._scheme_params(),
                           num_heads=self.num_heads, head_dim=self.head_dim,
                           d_model=self.d_model, causal=self.causal, x=x, dtype=dtype)
        scheme.check_causal(self.causal)
        if self.num_heads is not None and self.head_dim is not None:
            scheme.check(self.num_heads, self.head_dim)


class RotaryEmbedding(PositionModule):
    """Rotary position embedding (Su et al. 2024, §3.4); no parameters. The
    :class:`PositionModule` of ``"rope"``.

    Args:
      rotary_dim: rotated features per head (even); the rest pass through.
      base: ``rope_theta``.
      layout: ``"half"`` (Llama/NeoX) or ``"interleaved"`` (GPT-J/RoFormer).
      scaling: default context-extension dataclass (:mod:`jaxpos.schemes.rope.scaling`) or None.

    ``scheme(scaling=...)`` returns the :class:`jaxpos.RoPE` scheme for attention; calling
    the module rotates one tensor: ``x [B, T, N, H]``, ``positions [T] | [B, T]`` -> ``x``'s
    shape and dtype.
    """

    def __init__(self, rotary_dim: int, *, base: float = 10000.0, layout: str = "half",
                 scaling: Any = None):
        rotary_dim = check_rotary_dim(rotary_dim)
        _checks.check_choice("layout", layout, ("half", "interleaved"))
        base = _checks.check_positive_float("base", base)
        self.rotary_dim, self.base, self.layout, self.scaling = rotary_dim, base, layout, scaling
        super().__init__("rope", head_dim=rotary_dim, options={
            "rotary_dim": rotary_dim, "rope_base": base, "rope_layout": layout,
            "rope_scaling": scaling})

    def scheme(self, scaling: Any = None, *, x: jax.Array | None = None,
               positions: ArrayLike | None = None):
        """The RoPE scheme, with ``scaling`` (this call) or the module's default."""
        return super().scheme(scaling, x=x, positions=positions)

    def __call__(self, x: jax.Array, positions: ArrayLike, *, scaling: Any = None) -> jax.Array:
        s = cast("RoPEScheme", self.scheme(scaling))
        pos = _checks.positions_2d("positions", positions, x.shape[0], x.shape[1])
        inv_freq, af = s.frequencies(pos, pos)
        return apply_rope(x, pos, inv_freq, layout=self.layout, attention_factor=af)


class ALiBi(PositionModule):
    """ALiBi (Press et al. 2022, §3): fixed per-head slopes, a linear score bias; no
    parameters. The :class:`PositionModule` of ``"alibi"``.

    Args:
      num_heads: query heads (slopes by :func:`jaxpos.alibi_slopes`).
      bidirectional: ``-m |kv - q|`` (encoders) instead of the causal ``m (kv - q)``.

    ``scheme()`` returns :class:`jaxpos.ALiBi`; calling the module returns the bias
    float32 ``[N, Tq, Tk]`` (``[B, N, Tq, Tk]`` for batched positions).
    """

    def __init__(self, num_heads: int, *, bidirectional: bool = False):
        num_heads = _checks.check_positive_int("num_heads", num_heads)
        self.bidirectional = bool(bidirectional)
        super().__init__("alibi", num_heads=num_heads, causal=not self.bidirectional)

    def __call__(self, q_positions: ArrayLike, kv_positions: ArrayLike) -> jax.Array:
        return alibi_bias(q_positions, kv_positions, cast("ALiBiScheme", self.scheme()).slopes,
                          bidirectional=self.bidirectional)


class T5RelativeBias(PositionModule):
    """T5 bucketed relative bias (Raffel et al. 2020, §2.1): one learned scalar per
    (bucket, head), one table shared by every layer of a stack. The
    :class:`PositionModule` of ``"t5"``.

    Args:
      num_heads: query heads.
      num_buckets, max_distance: 32 and 128 as in T5.
      bidirectional: True for encoders, False for causal decoders.
      d_model: model width, for the default initialiser ``N(0, 1/d_model)`` (Hugging
        Face's T5 initialisation; ``N(0, 1/num_heads)`` when not given).
      embedding_init: another initialiser.
      rngs: :class:`flax.nnx.Rngs`.

    Parameter ``table`` float ``[num_buckets, num_heads]`` (the T5 checkpoint layout).
    ``scheme()`` returns :class:`jaxpos.T5Bias`; calling the module returns the bias
    float32 ``[N, Tq, Tk]``.
    """

    def __init__(self, num_heads: int, *, num_buckets: int = 32, max_distance: int = 128,
                 bidirectional: bool = True, d_model: int | None = None,
                 embedding_init: Callable[..., Any] | None = None,
                 param_dtype: DTypeLike = jnp.float32, rngs: nnx.Rngs):
        num_heads = _checks.check_positive_int("num_heads", num_heads)
        check_bucket_args(num_buckets, max_distance, bidirectional)
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.bidirectional = bool(bidirectional)
        super().__init__("t5", num_heads=num_heads, d_model=d_model or num_heads,
                         causal=not self.bidirectional,
                         options={"num_buckets": num_buckets, "max_distance": max_distance},
                         param_init=embedding_init, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, q_positions: ArrayLike, kv_positions: ArrayLike) -> jax.Array:
        return t5_bias(q_positions, kv_positions, self.table[...], bidirectional=self.bidirectional,
                       num_buckets=self.num_buckets, max_distance=self.max_distance)


class ShawRelativePosition(PositionModule):
    """Relative keys and values of Shaw et al. 2018, §3: ``2K + 1`` learned vectors of head
    width per table, for clipped offsets ``clip(kv - q, -K, K)``, shared by the heads. The
    :class:`PositionModule` of ``"shaw"``.

    Args:
      head_dim: width of each vector.
      max_distance: the clipping distance ``K`` (the paper finds ``K >= 2`` enough).
      values: also learn the value table ``rel_v`` (the paper's full form).
      embedding_init: another initialiser (default Glorot uniform, tensor2tensor's).
      rngs: :class:`flax.nnx.Rngs`.

    Parameters ``rel_k`` (and ``rel_v``, else ``rel_v is None``) float ``[2K + 1,
    head_dim]``; row ``r + K`` is offset ``r``. ``scheme()`` returns :class:`jaxpos.Shaw`.
    """

    def __init__(self, head_dim: int, *, max_distance: int = 16, values: bool = True,
                 embedding_init: Callable[..., Any] | None = None,
                 param_dtype: DTypeLike = jnp.float32, rngs: nnx.Rngs):
        head_dim = _checks.check_positive_int("head_dim", head_dim)
        K = _checks.check_positive_int("max_distance", max_distance)
        self.max_distance = K
        super().__init__("shaw", head_dim=head_dim,
                         options={"max_distance": K, "values": bool(values)},
                         param_init=embedding_init, param_dtype=param_dtype, rngs=rngs)
        if "rel_v" not in self.param_names:
            self.rel_v = None


def make_position_module(position, *, num_heads, head_dim, d_model, causal, options,
                         param_dtype: DTypeLike, rngs):
    """The attention-position module of a layer: a :class:`PositionModule` for a name
    (``"nope"`` included), a module passed in as it is (shared by reference), None for
    None."""
    if position is None or isinstance(position, PositionModule):
        return position
    name = check_position_name("position", position, attention_positions())
    return PositionModule(name, num_heads=num_heads, head_dim=head_dim, d_model=d_model,
                          causal=causal, options=options, param_dtype=param_dtype, rngs=rngs)

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
      output_gate: a bool; True multiplies each head's attention output, before
        ``o_proj``, by ``sigmoid(x @ gate_proj.kernel)`` (elementwise, head-specific,
        from the layer input: G1 of Qiu et al. 2025, "Gated Attention for Large Language
        Models", §2.2), parameter ``gate_proj.kernel [D, N*H]`` (no bias). Default False.
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
        in ``shard_map``, :func:`jaxpos.parallel.context.context_attention`); the sequence
        length must be divisible by the axis size (Ulysses: the heads too). No dense
        ``mask`` or attention dropout then. :meth:`decode` runs the ordinary path (one
        query per step needs no sequence parallelism).
      dtype: compute dtype; param_dtype: parameter dtype. rngs: :class:`flax.nnx.Rngs`.

    Parameters: ``q_proj.kernel [D, N*H]``, ``k_proj.kernel``/``v_proj.kernel [D, N_kv*H]``,
    ``o_proj.kernel [N*H, D]`` (and ``*.bias`` with ``use_bias``), ``sinks [N]`` with
    ``sinks=True`` (attribute ``sinks``, None otherwise), plus those of the position
    module (attribute ``position_module``, e.g. ``position_module.rel_k`` for Shaw).

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

    def __init__(self, d_model: int, num_heads: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, position: Any = "nope", causal: bool = False,
                 rotary_dim: int | None = None, rope_base: float = 10000.0,
                 num_buckets: int = 32, max_distance: int | None = None,
                 scheme_options: dict | None = None, scale: float | None = None,
                 implementation: str | None = None, use_bias: bool = False,
                 output_gate: bool = False,
                 sinks: bool = False, mask_mod: Callable[..., Any] | None = None,
                 dropout_rate: float = 0.0, context_parallel: str | None = None,
                 context_axis: str = "seq",
                 dtype: DTypeLike = jnp.float32, param_dtype: DTypeLike = jnp.float32,
                 rngs: nnx.Rngs):
        d_model, num_heads, num_kv_heads, head_dim = attention_dims(d_model, num_heads,
                                                                    num_kv_heads, head_dim)
        self.context_parallel = check_context_parallel(context_parallel, context_axis)
        self.context_axis = context_axis
        self.dropout_rate = check_dropout_rate("dropout_rate", dropout_rate)
        check_attention_options(implementation, use_bias)
        sinks = check_sinks_flag(sinks)
        self.mask_mod = check_mask_mod("mask_mod", mask_mod)
        options = collect_options(rotary_dim=rotary_dim, rope_base=rope_base,
                                  num_buckets=num_buckets, max_distance=max_distance,
                                  scheme_options=scheme_options)
        self.d_model, self.num_heads, self.num_kv_heads, self.head_dim = (
            d_model, num_heads, num_kv_heads, head_dim)
        self.causal, self.scale, self.implementation, self.dtype = (
            bool(causal), scale, implementation, dtype)
        lin = lambda i, o: nnx.Linear(i, o, use_bias=use_bias, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = lin(d_model, num_heads * head_dim)
        self.k_proj = lin(d_model, num_kv_heads * head_dim)
        self.v_proj = lin(d_model, num_kv_heads * head_dim)
        self.o_proj = lin(num_heads * head_dim, d_model)
        self.sinks = nnx.Param(jnp.zeros((num_heads,), param_dtype)) if sinks else None
        self.gate_proj = nnx.Linear(d_model, num_heads * head_dim, use_bias=False,
                                    param_dtype=param_dtype, rngs=rngs) if check_output_gate(
            output_gate) else None
        self.position_module = make_position_module(
            position, num_heads=num_heads, head_dim=head_dim, d_model=d_model,
            causal=self.causal, options=options, param_dtype=param_dtype, rngs=rngs)
        self._keep_dropout_stream(rngs)

    def _dims(self):
        return self.d_model, self.num_heads, self.num_kv_heads, self.head_dim

    def _position(self):
        return self.position_module

    def _sinks(self):
        return None if self.sinks is None else self.sinks[...]

# ================================================================== blocks and stacks

class TransformerBlock(_NnxDropout, BlockCore, nnx.Module):
    """A pre-LN transformer block: ``x + attn(rms_norm(x))``, then ``x + mlp(rms_norm(x))``
    (Xiong et al. 2020; RMSNorm, Zhang & Sennrich 2019; GELU MLP).

    Args: as :class:`MultiHeadAttention` (``sinks``, ``mask_mod``, ``context_parallel``,
    ``context_axis`` included), plus
    ``mlp_dim`` (default ``4 * d_model``); ``dropout_rate`` is residual dropout on the
    attention and MLP branches before they are added (Vaswani et al. 2017, Sec. 5.4) and,
    unless ``attention_dropout_rate`` is given, attention dropout too.
    Parameters: ``attn_norm.scale``, ``attn.*``, ``mlp_norm.scale``, ``mlp_in.kernel
    [D, F]``, ``mlp_out.kernel [F, D]``.

    Call: ``x [B, T, D]`` -> ``[B, T, D]`` with the keywords of
    :meth:`MultiHeadAttention.__call__`; ``decode(x, cache, ...)`` -> ``(y, cache)``.
    """

    def __init__(self, d_model: int, num_heads: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, mlp_dim: int | None = None,
                 position: Any = "nope", causal: bool = False, rotary_dim: int | None = None,
                 rope_base: float = 10000.0, num_buckets: int = 32,
                 max_distance: int | None = None, scheme_options: dict | None = None,
                 scale: float | None = None, implementation: str | None = None,
                 sinks: bool = False, mask_mod: Callable[..., Any] | None = None,
                 dropout_rate: float = 0.0,
                 attention_dropout_rate: float | None = None,
                 context_parallel: str | None = None, context_axis: str = "seq",
                 dtype: DTypeLike = jnp.float32,
                 param_dtype: DTypeLike = jnp.float32, rngs: nnx.Rngs):
        d_model = _checks.check_positive_int("d_model", d_model)
        self.dropout_rate = check_dropout_rate("dropout_rate", dropout_rate)
        attn_rate = self.dropout_rate if attention_dropout_rate is None else \
            check_dropout_rate("attention_dropout_rate", attention_dropout_rate)
        mlp_dim = 4 * d_model if mlp_dim is None else _checks.check_positive_int("mlp_dim", mlp_dim)
        self.dtype = dtype
        self.attn_norm = nnx.RMSNorm(d_model, param_dtype=param_dtype, rngs=rngs)
        self.attn = MultiHeadAttention(
            d_model, num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, position=position,
            causal=causal, rotary_dim=rotary_dim, rope_base=rope_base, num_buckets=num_buckets,
            max_distance=max_distance, scheme_options=scheme_options, scale=scale,
            implementation=implementation, sinks=sinks, mask_mod=mask_mod,
            dropout_rate=attn_rate, context_parallel=context_parallel,
            context_axis=context_axis, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(d_model, param_dtype=param_dtype, rngs=rngs)
        lin = lambda i, o: nnx.Linear(i, o, use_bias=False, param_dtype=param_dtype, rngs=rngs)
        self.mlp_in = lin(d_model, mlp_dim)
        self.mlp_out = lin(mlp_dim, d_model)
        self._keep_dropout_stream(rngs)

class _NnxMaker:
    """The NNX constructors of a stack's submodules (:func:`jaxpos.layers.stack.build_stack`)."""

    def __init__(self, dtype: DTypeLike, param_dtype: DTypeLike, rngs: nnx.Rngs,
                 block_options: dict | None = None):
        self.dtype, self.param_dtype, self.rngs = dtype, param_dtype, rngs
        self.block_options = block_options or {}

    def embed(self, vocab_size, d_model):
        return nnx.Embed(vocab_size, d_model, param_dtype=self.param_dtype,
                         embedding_init=token_embedding_init(d_model), rngs=self.rngs)

    def sinusoidal(self, d_model):
        return SinusoidalEmbedding(d_model, dtype=self.dtype)

    def learned(self, max_len, d_model):
        return LearnedPositionalEmbedding(max_len, d_model, param_dtype=self.param_dtype,
                                          rngs=self.rngs)

    def position_module(self, position, **kwargs):
        return PositionModule(position, param_dtype=self.param_dtype, rngs=self.rngs, **kwargs)

    def block(self, index, d_model, num_heads, **kwargs):
        return TransformerBlock(d_model, num_heads, param_dtype=self.param_dtype,
                                rngs=self.rngs, **kwargs, **self.block_options)

    def block_list(self, blocks):
        return nnx.List(blocks)

    def norm(self, d_model):
        return nnx.RMSNorm(d_model, param_dtype=self.param_dtype, rngs=self.rngs)


class _Stack(nnx.Module):
    """Shared constructor of :class:`DecoderLM` and :class:`Encoder`."""

    _causal = True

    def __init__(self, vocab_size: int, *, d_model: int, num_layers: int, num_heads: int,
                 position: str, num_kv_heads: int | None = None, mlp_dim: int | None = None,
                 max_len: int | None = None, rope_base: float = 10000.0,
                 t5_num_buckets: int = 32, t5_max_distance: int = 128,
                 shaw_max_distance: int = 16, scheme_options: dict | None = None,
                 implementation: str | None = None, sinks: bool = False,
                 mask_mod: Callable[..., Any] | None = None,
                 layer_mask_mods=None, layer_positions=None, dropout_rate: float = 0.0,
                 attention_dropout_rate: float | None = None,
                 context_parallel: str | None = None, context_axis: str = "seq",
                 context_zigzag: bool = False, dtype: DTypeLike = jnp.float32,
                 param_dtype: DTypeLike = jnp.float32,
                 rngs: nnx.Rngs):
        self.context_parallel = check_context_parallel(context_parallel, context_axis)
        self.context_axis, self.context_zigzag = context_axis, check_zigzag(
            context_zigzag, self.context_parallel)
        spec = stack_spec(vocab_size, d_model=d_model, num_layers=num_layers,
                          num_heads=num_heads, num_kv_heads=num_kv_heads, max_len=max_len,
                          position=position, rope_base=rope_base,
                          t5_num_buckets=t5_num_buckets, t5_max_distance=t5_max_distance,
                          shaw_max_distance=shaw_max_distance, scheme_options=scheme_options,
                          sinks=sinks, mask_mod=mask_mod, layer_mask_mods=layer_mask_mods,
                          layer_positions=layer_positions,
                          causal=self._causal)
        self.vocab_size, self.position_name = spec.vocab_size, spec.plan.name
        self.d_model, self.num_layers, self.max_len = spec.d_model, spec.num_layers, max_len
        self.num_kv_heads, self.head_dim = spec.num_kv_heads, spec.head_dim
        self.implementation, self.dtype = implementation, dtype
        block_options = {"context_parallel": self.context_parallel,
                         "context_axis": context_axis}
        parts = build_stack(spec, _NnxMaker(dtype, param_dtype, rngs, block_options),
                            mlp_dim=mlp_dim,
                            implementation=implementation, dtype=dtype,
                            dropout_rate=dropout_rate,
                            attention_dropout_rate=attention_dropout_rate)
        self.embed, self.abs_position, self.rel_position, self.blocks, self.final_norm = parts

    def _position_name(self):
        return self.position_name

    def _cache_dims(self):
        return self.num_layers, self.num_kv_heads, self.head_dim


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

    def __init__(self, vocab_size: int, *, position: str = "rope", **kwargs):
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

    def __init__(self, vocab_size: int, *, position: str = "nope", **kwargs):
        """Arguments as the class docstring says (the other keywords and their defaults
        are those of the shared stack constructor)."""
        super().__init__(vocab_size, position=position, **kwargs)
