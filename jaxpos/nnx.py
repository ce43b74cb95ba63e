"""Flax NNX modules over the jaxpos functions: position modules, attention, blocks and
small decoder / encoder stacks.

Every attention-position scheme reaches the modules through the scheme registry
(:data:`jaxpos.REGISTRY`, :mod:`jaxpos.scheme`): a name such as ``"rope"``, ``"t5"`` or
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
The Linen twins in :mod:`jaxpos.linen` run the same code (the ``*Core`` classes here)
over Linen parameter declarations, so :func:`jaxpos.linen.params_from_nnx` moves weights
across and both give the same outputs.

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
:meth:`~jaxpos.PositionScheme.cache_write` stores (raw keys for every built-in scheme but
RoPE with a length-dependent scaling), their positions and a per-row fill count, so rows
may sit at different offsets and positions are just integers: RoPE rotates cached keys
from their stored positions, and ALiBi / T5 / Shaw read offsets from them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# Importing a scheme module registers its schemes; ``import jaxpos`` loads the built-in
# ones, these load the rest of the library's schemes.
from jaxpos import _checks
from jaxpos.alibi import alibi_bias
from jaxpos.attention import ALL_IMPLEMENTATIONS, attention
from jaxpos.learned import learned_positions
from jaxpos.rope import apply_rope, check_rotary_dim
from jaxpos.scheme import REGISTRY, NoPE, PositionScheme
from jaxpos.sinusoidal import sinusoidal_pe
from jaxpos.t5 import check_bucket_args, t5_bias

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
    "T5RelativeBias",
    "TransformerBlock",
    "attention_positions",
    "position_scheme",
    "rotate_at_write",
    "stack_positions",
]

#: Absolute position names: vectors added to the token embeddings, not attention schemes.
ABSOLUTE_POSITIONS = ("sinusoidal", "learned")


def buildable(cls) -> bool:
    """True when the Flax modules can build scheme class ``cls`` (it implements
    :meth:`jaxpos.PositionScheme.from_params`)."""
    return getattr(cls.from_params, "__func__", None) is not PositionScheme.from_params.__func__


def attention_positions() -> tuple[str, ...]:
    """The names :class:`MultiHeadAttention` accepts now: every registered scheme that
    implements ``from_params``, ``"nope"`` first, then sorted (the registry may grow after
    import: :func:`jaxpos.scheme.register`)."""
    names = sorted(n for n, cls in REGISTRY.items() if n != "nope" and buildable(cls))
    return ("nope", *names)


def stack_positions() -> tuple[str, ...]:
    """The names :class:`DecoderLM` / :class:`Encoder` accept now:
    :func:`attention_positions` plus :data:`ABSOLUTE_POSITIONS`."""
    nope, *rest = attention_positions()
    return (nope, *ABSOLUTE_POSITIONS, *rest)


def __getattr__(name: str):
    # POSITIONS / ATTENTION_POSITIONS are derived from the registry at each access (PEP 562).
    if name == "POSITIONS":
        return stack_positions()
    if name == "ATTENTION_POSITIONS":
        return attention_positions()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ================================================================== shared helpers
# (pure functions used by the NNX and the Linen modules alike)

def token_embedding_init(d_model: int):
    """``N(0, 1/d_model)``: the scaled embedding ``sqrt(d_model) * E[t]`` has unit variance."""
    return jax.nn.initializers.normal(stddev=d_model ** -0.5)


def learned_table_init():
    """``N(0, 1/2)``: the same per-entry variance as the sinusoidal table (sin^2, cos^2)."""
    return jax.nn.initializers.normal(stddev=math.sqrt(0.5))


def check_position_name(name: str, value: Any, choices=None) -> str:
    """Lower-cased position name (``"none"`` means ``"nope"``).

    ``choices`` defaults to :func:`stack_positions` (derived from the registry).

    Raises:
      TypeError: ``value`` is not a string.
      ValueError: an unknown name (the message lists ``choices``), or a registered scheme
        whose class does not implement ``from_params`` (the message names the class).
    """
    if choices is None:
        choices = stack_positions()
    choices = tuple(choices)
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {choices} (a string); got "
                        f"{type(value).__name__} {value!r}.")
    value = value.lower()
    if value == "none":
        value = "nope"
    if value not in choices and value in REGISTRY and not buildable(REGISTRY[value]):
        cls = REGISTRY[value]
        raise ValueError(
            f"{name}={value!r} is a registered scheme ({cls.__module__}.{cls.__name__}) that "
            f"the Flax modules cannot build: {cls.__name__} does not implement "
            f"from_params (and init_params, if it has learned parameters), the hooks of "
            f"jaxpos.PositionScheme that the modules call. Build the scheme yourself and "
            f"pass it at call time (scheme=...), or choose one of {choices}.")
    _checks.check_choice(name, value, choices)
    return value


def check_tokens(tokens, vocab_size: int) -> jax.Array:
    """int ``[B, T]`` token ids; concrete ids outside ``[0, vocab_size)`` raise (a gather
    would otherwise clamp or fill them silently)."""
    _checks.check_rank("tokens", tokens, (2,), "[batch, seq] token ids")
    dt = _checks.dtype_of(tokens)
    if not jnp.issubdtype(dt, jnp.integer):
        raise TypeError(f"tokens must be integer token ids; got dtype {dt}.")
    if _checks.is_concrete(tokens):
        t = np.asarray(tokens)
        if t.size and (t.min() < 0 or t.max() >= vocab_size):
            raise ValueError(f"tokens must lie in [0, vocab_size={vocab_size}); got values from "
                             f"{t.min()} to {t.max()}.")
    return jnp.asarray(tokens, jnp.int32)


def embed_tokens(embedding, tokens, d_model: int, dtype) -> jax.Array:
    """``sqrt(d_model) * embedding[tokens]``; traced out-of-range ids give NaN rows."""
    rows = jnp.take(jnp.asarray(embedding), tokens, axis=0, mode="fill", fill_value=jnp.nan)
    return (rows * jnp.float32(math.sqrt(d_model))).astype(dtype)


def tied_logits(h, embedding) -> jax.Array:
    """float32 logits ``h @ embedding^T`` (weights tied to the input embedding)."""
    return jnp.einsum("btd,vd->btv", h.astype(jnp.float32), jnp.asarray(embedding, jnp.float32))


def sinusoidal_embedding(positions, d_model: int, base: float, layout: str, dtype) -> jax.Array:
    """:func:`jaxpos.sinusoidal_pe` rows at arbitrary integer positions ``[..., T]``."""
    _checks.check_integer_positions("positions", positions)
    pos = jnp.asarray(positions, jnp.int32)
    rows = sinusoidal_pe(1, d_model, base, offset=pos.reshape(-1), layout=layout, dtype=dtype)
    return rows.reshape(pos.shape + (d_model,))


def default_positions(tokens_shape, positions, name: str = "positions") -> jax.Array:
    """``positions`` validated to int32 ``[B|1, T]`` (``arange(T)`` when ``None``); errors
    name the argument ``name``."""
    B, T = tokens_shape
    if positions is None:
        positions = jnp.arange(T, dtype=jnp.int32)
    return _checks.positions_2d(name, positions, B, T)


def check_learned_length(position: str, max_len, T: int, positions) -> None:
    """With default positions ``arange(T)``, a learned table of ``max_len`` rows cannot
    serve ``T > max_len`` (raised at trace time, inside ``jit`` too)."""
    if position == "learned" and positions is None and T > max_len:
        raise ValueError(f"tokens have length T={T} but the learned position table has "
                         f"max_len={max_len} rows (positions 0..{max_len - 1}); learned "
                         f"absolute positions cannot run past their table.")


def no_rope_scaling(position: str, rope_scaling) -> None:
    """``ValueError`` when ``rope_scaling`` is given to a model whose scheme ``position``
    (a name, for the message) does not take it."""
    if rope_scaling is not None:
        raise ValueError(f"rope_scaling applies to RoPE models only; this model uses "
                         f"position={position!r}. Got rope_scaling={rope_scaling!r}.")


def collect_options(*, rotary_dim=None, rope_base=None, num_buckets=None, max_distance=None,
                    scheme_options=None) -> tuple:
    """A module's scheme options: the named ones (``rotary_dim``, ``rope_base``,
    ``num_buckets``, ``max_distance``; None where unset), then ``scheme_options`` (a dict,
    or any mapping, with string keys, e.g. a new scheme's own options) on top.

    Returns a tuple of ``(name, value)`` pairs sorted by name: static, hashable module
    data; a scheme's ``init_params`` / ``from_params`` receive it as a dict.

    Raises:
      TypeError: ``scheme_options`` is not a dict with string keys; ``rotary_dim``,
        ``num_buckets``, ``max_distance`` not ints, ``rope_base`` not a real number.
      ValueError: those not > 0 (``rope_base`` also finite), when given.
    """
    opts = {"rotary_dim": rotary_dim, "rope_base": rope_base, "num_buckets": num_buckets,
            "max_distance": max_distance}
    if scheme_options is not None:
        if not isinstance(scheme_options, Mapping) or not all(
                isinstance(k, str) for k in scheme_options):
            raise TypeError(f"scheme_options must be a dict with string keys (a scheme's "
                            f"options) or None; got {type(scheme_options).__name__} "
                            f"{scheme_options!r}.")
        opts.update(scheme_options)
    # The named options mean the same for every scheme that reads them: sizes and a base.
    for key in ("rotary_dim", "num_buckets", "max_distance"):
        if opts[key] is not None:
            _checks.check_positive_int(key, opts[key])
    if opts["rope_base"] is not None:
        _checks.check_positive_float("rope_base", opts["rope_base"])
    return tuple(sorted(opts.items(), key=lambda kv: kv[0]))


def freeze_options(options) -> tuple:
    """``options`` (a dict, a tuple of pairs from :func:`collect_options`, or None) as a
    sorted tuple of ``(name, value)`` pairs. ``TypeError`` for anything else."""
    if options is None:
        return ()
    if isinstance(options, Mapping):
        return collect_options(scheme_options=options) if options else ()
    if isinstance(options, tuple) and all(
            isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in options):
        return tuple(sorted(options, key=lambda kv: kv[0]))
    raise TypeError(f"options must be a dict of scheme options or None; got "
                    f"{type(options).__name__} {options!r}.")


def stack_options(position: str, *, rope_base, prefixed: dict, scheme_options) -> tuple:
    """The scheme options of a stack (:class:`DecoderLM`, :class:`Encoder`).

    ``rope_base`` is passed as is; an argument of ``prefixed`` named
    ``<scheme>_<option>`` (the stacks' ``t5_num_buckets``, ``t5_max_distance``,
    ``shaw_max_distance``) is the option ``<option>`` of the scheme registered as
    ``<scheme>`` and is ignored by every other scheme; ``scheme_options`` go on top
    (:func:`collect_options`, which raises ``TypeError`` for a bad ``scheme_options``).
    """
    collect_options(scheme_options=scheme_options)  # validates it
    extra = {}
    for key, val in prefixed.items():
        scheme, _, option = key.partition("_")
        if scheme == position and val is not None:
            extra[option] = val
    extra.update(scheme_options or {})
    return collect_options(rope_base=rope_base, scheme_options=extra)


#: Options every attention layer passes (its constructor arguments), read or not.
NAMED_OPTIONS = ("rotary_dim", "rope_base", "num_buckets", "max_distance")


def check_options_read(name: str, options: tuple, params: dict, *, num_heads, head_dim,
                       d_model, causal, x, dtype) -> None:
    """Raise ``ValueError`` for a scheme option the scheme never reads (a typo such as
    ``{"rope_lyout": ...}``, or ``{"layout": ...}`` for RoPE's ``rope_layout``): its
    ``init_params`` and ``from_params`` run once with a dict that records each key read.
    The named options of :data:`NAMED_OPTIONS` are exempt (every layer passes them)."""
    read = set()

    class _Recording(dict):
        def get(self, key, default=None):
            read.add(key)
            return super().get(key, default)

        def __getitem__(self, key):
            read.add(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            read.add(key)
            return super().__contains__(key)

    cls = REGISTRY[name]
    given = dict(options)
    if has_params(cls):
        cls.init_params(jax.random.PRNGKey(0), num_heads=num_heads, head_dim=head_dim,
                        d_model=d_model, causal=causal, param_dtype=dtype,
                        options=_Recording(given))
    cls.from_params(params, num_heads=num_heads, head_dim=head_dim, causal=causal,
                    options=_Recording(given), x=x, positions=jnp.zeros((1, 1), jnp.int32))
    unknown = sorted(set(given) - read - set(NAMED_OPTIONS))
    if unknown:
        raise ValueError(f"scheme_options {unknown} are not options of {cls.__name__} "
                         f"(position={name!r}); it reads {sorted(read)}.")


def has_params(cls) -> bool:
    """True when scheme class ``cls`` declares learned parameters (overrides
    :meth:`jaxpos.PositionScheme.init_params`)."""
    return getattr(cls.init_params, "__func__", None) is not PositionScheme.init_params.__func__


def init_scheme_params(position: str, key, *, num_heads, head_dim, d_model, causal,
                       options: tuple, param_dtype) -> dict:
    """``REGISTRY[position].init_params(...)``: the scheme's initial parameters, a dict of
    arrays (``{}`` for none).

    Raises:
      TypeError: the scheme returned something other than a dict of arrays.
    """
    cls = REGISTRY[position]
    params = cls.init_params(key, num_heads=num_heads, head_dim=head_dim, d_model=d_model,
                             causal=causal, param_dtype=param_dtype, options=dict(options))
    if not isinstance(params, dict) or not all(
            isinstance(k, str) and hasattr(v, "shape") for k, v in params.items()):
        raise TypeError(f"{cls.__name__}.init_params must return a dict of arrays keyed by "
                        f"parameter name; got {params!r}.")
    return params


def build_scheme(position: str, params: dict, *, num_heads, head_dim, causal, options: tuple,
                 rope_scaling=None, x=None, positions=None) -> PositionScheme:
    """The scheme of one call: ``REGISTRY[position].from_params(params, ...)``.

    Args:
      position: a registered name. params: the module's parameter values.
      num_heads, head_dim, causal: the layer's (heads and width may be None for a module
        built without them). options: from :func:`collect_options`.
      rope_scaling: a :mod:`jaxpos.rope_scaling` dataclass for this call only, passed as
        option ``"rope_scaling"``.
      x: ``[B, T, D]`` the layer's input; positions: int32 ``[B|1, T]`` (for schemes
        computed from the tokens).

    Raises:
      ValueError: ``rope_scaling`` given to a scheme that does not take it (the scheme it
        built has no ``scaling`` holding it, e.g. ALiBi).
    """
    cls = REGISTRY[position]
    opts = dict(options)
    if rope_scaling is not None:
        opts["rope_scaling"] = rope_scaling
    scheme = cls.from_params(dict(params), num_heads=num_heads, head_dim=head_dim,
                             causal=causal, options=opts, x=x, positions=positions)
    if rope_scaling is not None and getattr(scheme, "scaling", None) is not rope_scaling:
        raise ValueError(f"rope_scaling applies to schemes that take a RoPE scaling (RoPE); "
                         f"this layer uses position={position!r} ({cls.__name__}), which does "
                         f"not. Got rope_scaling={rope_scaling!r}.")
    return scheme


class KVCache(NamedTuple):
    """The KV cache of one attention layer (a pytree; pass it through ``jit``).

    Attributes:
      k: ``[B, S, N_kv, H]`` keys as the scheme's ``cache_write`` stores them (raw for
        every built-in scheme but RoPE with a length-dependent scaling: RoPE is applied
        from ``positions`` inside :func:`jaxpos.attention` at every step).
      v: ``[B, S, N_kv, H]`` values.
      positions: int32 ``[B, S]`` position of each filled slot.
      length: int32 ``[B]`` number of filled slots per row; slots ``>= length`` are masked.
    """

    k: jax.Array
    v: jax.Array
    positions: jax.Array
    length: jax.Array


def init_kv_cache(batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype) -> KVCache:
    """An empty :class:`KVCache`: zeros ``[batch, max_len, num_kv_heads, head_dim]`` of
    ``dtype``, positions 0 and fill counts 0. ``ValueError``/``TypeError`` for sizes that
    are not positive ints."""
    _checks.check_positive_int("batch", batch)
    _checks.check_positive_int("max_len", max_len)
    z = jnp.zeros((batch, max_len, num_kv_heads, head_dim), dtype)
    return KVCache(z, z, jnp.zeros((batch, max_len), jnp.int32), jnp.zeros((batch,), jnp.int32))


def update_kv_cache(cache: KVCache, k, v, positions):
    """Append ``k, v`` ``[B, T, N_kv, H]`` at each row's fill count.

    Returns ``(cache, segment_ids, kv_segment_ids, overflow)``: the segment ids (int32
    ``[B, T]`` of ones, and ``[B, S]`` with 1 on filled slots, 0 on empty ones) hide the
    empty slots in every implementation, the Pallas kernel included (it takes no
    arbitrary mask); ``overflow`` bool ``[B]`` marks rows that ran past the cache. Concrete overflow raises
    ``ValueError``; traced overflow cannot raise, so the caller poisons those rows with NaN
    (writes past the end are dropped, never clamped onto other slots).
    """
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a jaxpos.nnx.KVCache (from init_cache); got "
                        f"{type(cache).__name__}.")
    B, S = cache.positions.shape
    T = k.shape[1]
    if k.shape[0] != B or k.shape[2:] != cache.k.shape[2:]:
        raise ValueError(f"new keys {k.shape} do not fit the cache {cache.k.shape} "
                         f"(expected [{B}, T, {cache.k.shape[2]}, {cache.k.shape[3]}]).")
    if _checks.is_concrete(cache.length):
        end = np.asarray(cache.length) + T
        if (end > S).any():
            raise ValueError(f"KV cache overflow: writing {T} token(s) after {np.asarray(cache.length)} "
                             f"filled slot(s) needs {int(end.max())} slots; the cache holds "
                             f"max_len={S}. Create it with a larger init_cache(batch, max_len).")
    slots = cache.length[:, None] + jnp.arange(T, dtype=jnp.int32)  # [B, T]
    rows = jnp.arange(B, dtype=jnp.int32)[:, None]
    pos = jnp.broadcast_to(positions, (B, T)).astype(jnp.int32)
    new = KVCache(
        cache.k.at[rows, slots].set(k.astype(cache.k.dtype), mode="drop"),
        cache.v.at[rows, slots].set(v.astype(cache.v.dtype), mode="drop"),
        cache.positions.at[rows, slots].set(pos, mode="drop"),
        cache.length + T,
    )
    kv_seg = (jnp.arange(S, dtype=jnp.int32)[None, :] < new.length[:, None]).astype(jnp.int32)
    return new, jnp.ones((B, T), jnp.int32), kv_seg, new.length > S


def poison_rows(x, overflow):
    """NaN for batch rows where ``overflow`` is True (traced KV-cache overflow)."""
    return jnp.where(overflow.reshape((-1,) + (1,) * (x.ndim - 1)), jnp.array(jnp.nan, x.dtype), x)


def project_heads(x, kernel, num_heads: int, head_dim: int, dtype, bias=None):
    """``x [B, T, D] @ kernel [D, num_heads * head_dim] (+ bias)`` ->
    ``[B, T, num_heads, head_dim]``."""
    y = jnp.einsum("btd,de->bte", x.astype(dtype), jnp.asarray(kernel, dtype))
    if bias is not None:
        y = y + jnp.asarray(bias, dtype)
    return y.reshape(x.shape[:2] + (num_heads, head_dim))


def merge_heads(o, kernel, dtype, bias=None):
    """``o [B, T, N, H]`` -> ``[B, T, N * H] @ kernel [N * H, D] (+ bias)``."""
    y = jnp.einsum("bte,ed->btd", o.reshape(o.shape[:2] + (-1,)).astype(dtype),
                   jnp.asarray(kernel, dtype))
    return y if bias is None else y + jnp.asarray(bias, dtype)


def check_attention_options(implementation, use_bias) -> None:
    """An attention layer's options, checked when it is built (not only at its first call):
    ``implementation`` ``None`` or one of :data:`jaxpos.ALL_IMPLEMENTATIONS`, ``use_bias`` a bool."""
    if implementation is not None:
        _checks.check_choice("implementation", implementation, ALL_IMPLEMENTATIONS)
    if not isinstance(use_bias, bool):
        raise TypeError(f"use_bias must be a bool; got {type(use_bias).__name__} {use_bias!r}.")


def check_sinks_flag(sinks) -> bool:
    """``sinks`` (a layer option: own a learned sink logit per head) must be a bool.
    ``TypeError`` otherwise (an array of logits belongs to :func:`jaxpos.attention`, not
    to a module, whose logits are its ``sinks`` parameter)."""
    if not isinstance(sinks, (bool, np.bool_)):
        raise TypeError(f"sinks must be a bool (True: the layer learns one sink logit per "
                        f"query head, a parameter 'sinks' [num_heads]); got "
                        f"{type(sinks).__name__} {sinks!r}.")
    return bool(sinks)


def check_mask_mod(name: str, mask_mod):
    """``mask_mod``: ``None`` or a callable ``(batch, head, q_pos, kv_pos) -> bool``
    (:mod:`jaxpos.mods`, e.g. :class:`jaxpos.SlidingWindowMask`). ``TypeError`` naming
    ``name`` otherwise. Returns it unchanged."""
    if mask_mod is not None and not callable(mask_mod):
        raise TypeError(f"{name} must be a mask_mod, a callable (batch, head, q_pos, kv_pos) "
                        f"-> bool such as jaxpos.SlidingWindowMask(window), or None; got "
                        f"{type(mask_mod).__name__} {mask_mod!r}.")
    return mask_mod


def layer_mask_mods_plan(num_layers: int, mask_mod, layer_mask_mods) -> tuple:
    """The mask_mod of each layer of a stack: ``layer_mask_mods`` (one mask_mod or None
    per layer, e.g. alternating sliding-window and full-attention layers as in Gemma 2/3
    and GPT-OSS, Hugging Face's ``layer_types``) when given, else ``mask_mod`` for every
    layer.

    Returns a tuple of ``num_layers`` entries (callables or None).

    Raises:
      TypeError: ``layer_mask_mods`` not a list or tuple, an entry (or ``mask_mod``)
        neither callable nor None.
      ValueError: ``layer_mask_mods`` of a length other than ``num_layers``, or given
        together with ``mask_mod`` (which would be ambiguous).
    """
    check_mask_mod("mask_mod", mask_mod)
    if layer_mask_mods is None:
        return (mask_mod,) * num_layers
    if not isinstance(layer_mask_mods, (list, tuple)):
        raise TypeError(f"layer_mask_mods must be a list or tuple of num_layers={num_layers} "
                        f"mask_mods (callables or None); got {type(layer_mask_mods).__name__} "
                        f"{layer_mask_mods!r}.")
    if len(layer_mask_mods) != num_layers:
        raise ValueError(f"layer_mask_mods must have one entry per layer (num_layers="
                         f"{num_layers}); got {len(layer_mask_mods)} entries.")
    if mask_mod is not None:
        raise ValueError("pass either mask_mod (every layer) or layer_mask_mods (one per "
                         "layer, None for full attention), not both.")
    for i, mod in enumerate(layer_mask_mods):
        check_mask_mod(f"layer_mask_mods[{i}]", mod)
    return tuple(layer_mask_mods)


def check_attention_input(name: str, x, d_model: int, batch: int | None = None) -> None:
    """``x`` must be ``[B, T, d_model]`` (and have ``batch`` rows when given)."""
    _checks.check_rank(name, x, (3,), "[batch, seq, d_model]")
    if x.shape[-1] != d_model:
        raise ValueError(f"{name} must have shape [B, T, d_model={d_model}]; got {x.shape}.")
    if batch is not None and x.shape[0] != batch:
        raise ValueError(f"{name} must have the batch size of x ({batch}); got {x.shape}.")


def attention_inputs(x, context, positions, kv_positions, kv_segment_ids, d_model: int):
    """Validate a self- or cross-attention call; returns ``(q_pos, kv_pos)``, int32
    ``[B|1, T]``. Self-attention (``context is None``) takes no ``kv_positions`` or
    ``kv_segment_ids``: the keys are ``x`` at ``positions``."""
    check_attention_input("x", x, d_model)
    pos = default_positions(x.shape[:2], positions)
    if context is None:
        for name, val in (("kv_positions", kv_positions), ("kv_segment_ids", kv_segment_ids)):
            if val is not None:
                raise ValueError(f"{name} applies to cross-attention (context=...) only; got "
                                 f"{name} without a context. Self-attention keys share the "
                                 f"queries' positions and segment_ids.")
        return pos, pos
    check_attention_input("context", context, d_model, batch=x.shape[0])
    return pos, default_positions(context.shape[:2], kv_positions, "kv_positions")


def rms_norm(x, scale, eps: float = 1e-6):
    """RMSNorm (Zhang & Sennrich 2019), statistics in float32, cast back to ``x``'s dtype.

    ``x``: ``[..., D]``; ``scale``: ``[D]``. Raises ``ValueError`` when the widths differ
    (the first thing a block does, so a wrong-width input is named here, not as an
    anonymous broadcasting error)."""
    if np.shape(x)[-1:] != np.shape(scale)[-1:]:
        raise ValueError(f"x must have shape [..., d_model={np.shape(scale)[-1]}]; "
                         f"got {np.shape(x)}.")
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * jnp.asarray(scale, jnp.float32)).astype(x.dtype)


def mlp(x, w_in, w_out, dtype):
    """``gelu(x W_in) W_out`` (tanh approximation)."""
    h = jax.nn.gelu(jnp.einsum("btd,df->btf", x.astype(dtype), jnp.asarray(w_in, dtype)))
    return jnp.einsum("btf,fd->btd", h, jnp.asarray(w_out, dtype))


def attention_dims(d_model, num_heads, num_kv_heads, head_dim):
    """Validated ``(d_model, num_heads, num_kv_heads, head_dim)``: ``num_kv_heads``
    defaults to ``num_heads`` and must divide it; ``head_dim`` defaults to
    ``d_model // num_heads`` (which must divide). Raises ``ValueError``/``TypeError``."""
    d_model = _checks.check_positive_int("d_model", d_model)
    num_heads = _checks.check_positive_int("num_heads", num_heads)
    num_kv_heads = num_heads if num_kv_heads is None else _checks.check_positive_int(
        "num_kv_heads", num_kv_heads)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads}).")
    if head_dim is None:
        if d_model % num_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads}) "
                             f"when head_dim is not given.")
        head_dim = d_model // num_heads
    head_dim = _checks.check_positive_int("head_dim", head_dim)
    return d_model, num_heads, num_kv_heads, head_dim


# ================================================================== position modules

def _value(v):
    """The array of an :class:`flax.nnx.Variable` (NNX) or the array itself (Linen)."""
    return v[...] if isinstance(v, nnx.Variable) else v


class SinusoidalCore:
    """The call of :class:`SinusoidalEmbedding` and its Linen twin (fields ``d_model``,
    ``base``, ``layout``, ``dtype``)."""

    def __call__(self, positions) -> jax.Array:
        return sinusoidal_embedding(positions, self.d_model, self.base, self.layout, self.dtype)


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
                 dtype=jnp.float32):
        self.d_model = _checks.check_positive_int("d_model", d_model)
        _checks.check_choice("layout", layout, ("interleaved", "concat"))
        self.base, self.layout, self.dtype = float(base), layout, dtype


class LearnedCore:
    """The call of :class:`LearnedPositionalEmbedding` and its Linen twin (``table``,
    ``out_of_range``)."""

    def __call__(self, positions) -> jax.Array:
        return learned_positions(_value(self.table), positions, out_of_range=self.out_of_range)


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
                 embedding_init=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
        max_len = _checks.check_positive_int("max_len", max_len)
        d_model = _checks.check_positive_int("d_model", d_model)
        _checks.check_choice("out_of_range", out_of_range, ("error", "wrap", "clip"))
        init = embedding_init or learned_table_init()
        self.table = nnx.Param(init(rngs.params(), (max_len, d_model), param_dtype))
        self.max_len, self.d_model, self.out_of_range = max_len, d_model, out_of_range


class PositionCore:
    """``scheme()`` of :class:`PositionModule` and its Linen twin. Subclasses give
    ``_spec()`` -> ``(position, num_heads, head_dim, causal, options)`` and
    ``_scheme_params()`` -> ``{name: array}``."""

    def scheme(self, rope_scaling=None, *, x=None, positions=None) -> PositionScheme:
        """The scheme object for one call (:func:`build_scheme`): built from the module's
        parameters by the scheme class's ``from_params`` (gradients flow to them).

        Args:
          rope_scaling: a :mod:`jaxpos.rope_scaling` dataclass for this call only
            (``ValueError`` for a scheme that does not take it).
          x: ``[B, T, D]`` the layer's input; positions: int ``[B|1, T]``; both optional,
            for schemes computed from the tokens (FoX's forget gates).

        Returns:
          a :class:`jaxpos.PositionScheme`.
        """
        position, num_heads, head_dim, causal, options = self._spec()
        return build_scheme(position, self._scheme_params(), num_heads=num_heads,
                            head_dim=head_dim, causal=causal, options=options,
                            rope_scaling=rope_scaling, x=x, positions=positions)


def check_module_dims(num_heads, head_dim, d_model) -> None:
    """``num_heads``, ``head_dim``, ``d_model``: positive ints or None (unknown to a
    module built for one scheme, e.g. ALiBi needs no ``head_dim``)."""
    for arg, val in (("num_heads", num_heads), ("head_dim", head_dim), ("d_model", d_model)):
        if val is not None:
            _checks.check_positive_int(arg, val)


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
                 causal: bool = False, options: dict | None = None, param_init=None,
                 param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        name = check_position_name("position", position, attention_positions())
        check_module_dims(num_heads, head_dim, d_model)
        options = freeze_options(options)
        self.position_name, self.num_heads, self.head_dim = name, num_heads, head_dim
        self.d_model, self.causal, self.options = d_model, bool(causal), options
        cls = REGISTRY[name]
        params = {}
        if has_params(cls):
            if rngs is None:
                raise ValueError(f"position={name!r} ({cls.__name__}) has learned parameters; "
                                 f"pass rngs=nnx.Rngs(...).")
            params = init_scheme_params(name, rngs.params(), num_heads=num_heads,
                                        head_dim=head_dim, d_model=d_model, causal=self.causal,
                                        options=options, param_dtype=param_dtype)
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

    def _validate(self, dtype):
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
      scaling: default context-extension dataclass (:mod:`jaxpos.rope_scaling`) or None.

    ``scheme(scaling=...)`` returns the :class:`jaxpos.RoPE` scheme for attention; calling
    the module rotates one tensor: ``x [B, T, N, H]``, ``positions [T] | [B, T]`` -> ``x``'s
    shape and dtype.
    """

    def __init__(self, rotary_dim: int, *, base: float = 10000.0, layout: str = "half",
                 scaling=None):
        rotary_dim = check_rotary_dim(rotary_dim)
        _checks.check_choice("layout", layout, ("half", "interleaved"))
        base = _checks.check_positive_float("base", base)
        self.rotary_dim, self.base, self.layout, self.scaling = rotary_dim, base, layout, scaling
        super().__init__("rope", head_dim=rotary_dim, options={
            "rotary_dim": rotary_dim, "rope_base": base, "rope_layout": layout,
            "rope_scaling": scaling})

    def scheme(self, scaling=None, *, x=None, positions=None):
        """The RoPE scheme, with ``scaling`` (this call) or the module's default."""
        return super().scheme(scaling, x=x, positions=positions)

    def __call__(self, x, positions, *, scaling=None) -> jax.Array:
        s = self.scheme(scaling)
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

    def __call__(self, q_positions, kv_positions) -> jax.Array:
        return alibi_bias(q_positions, kv_positions, self.scheme().slopes,
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
                 bidirectional: bool = True, d_model: int | None = None, embedding_init=None,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        num_heads = _checks.check_positive_int("num_heads", num_heads)
        check_bucket_args(num_buckets, max_distance, bidirectional)
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.bidirectional = bool(bidirectional)
        super().__init__("t5", num_heads=num_heads, d_model=d_model or num_heads,
                         causal=not self.bidirectional,
                         options={"num_buckets": num_buckets, "max_distance": max_distance},
                         param_init=embedding_init, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, q_positions, kv_positions) -> jax.Array:
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
                 embedding_init=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
        head_dim = _checks.check_positive_int("head_dim", head_dim)
        K = _checks.check_positive_int("max_distance", max_distance)
        self.max_distance = K
        super().__init__("shaw", head_dim=head_dim,
                         options={"max_distance": K, "values": bool(values)},
                         param_init=embedding_init, param_dtype=param_dtype, rngs=rngs)
        if "rel_v" not in self.param_names:
            self.rel_v = None


def make_position_module(position, *, num_heads, head_dim, d_model, causal, options,
                         param_dtype, rngs):
    """The attention-position module of a layer: a :class:`PositionModule` for a name
    (``"nope"`` included), a module passed in as it is (shared by reference), None for
    None."""
    if position is None or isinstance(position, PositionModule):
        return position
    name = check_position_name("position", position, attention_positions())
    return PositionModule(name, num_heads=num_heads, head_dim=head_dim, d_model=d_model,
                          causal=causal, options=options, param_dtype=param_dtype, rngs=rngs)


def rotate_at_write(scheme, q, k, positions):
    """``scheme.cache_write(q, k, positions)`` (:meth:`jaxpos.PositionScheme.cache_write`):
    what a KV cache stores for the new tokens and the scheme that reads it.

    For RoPE with a length-dependent scaling (dynamic NTK, LongRoPE) that rotates ``q``
    and ``k`` here, with the frequencies of this call (``max(positions) + 1``), and
    returns :class:`jaxpos.NoPE` for the attention call, so each cached key keeps the
    rotation of the call that wrote it: Hugging Face's decoding (its cache holds rotated
    keys; ``dynamic_rope_update``), which jaxpos's Llama port matches step by step. The
    built-in schemes otherwise return the inputs and themselves, applied inside attention
    (and inside the fused kernel) from the cached positions. Dynamic NTK: bloc97 2023 /
    HF ``_compute_dynamic_ntk_parameters``; LongRoPE: Ding et al. 2024, §3.

    Args:
      scheme: a :class:`jaxpos.PositionScheme`.
      q: ``[B, T, N, H]``; k: ``[B, T, N_kv, H]``, the new tokens only (any float dtype;
        RoPE rotates in float32 and casts back).
      positions: int ``[B|1, T]``, the new tokens' positions.

    Returns:
      ``(q, k, scheme_for_reading)``.

    Raises:
      TypeError: ``scheme`` is not a :class:`jaxpos.PositionScheme`.
    """
    if not isinstance(scheme, PositionScheme):
        raise TypeError(f"scheme must be a jaxpos PositionScheme; got {type(scheme).__name__} "
                        f"{scheme!r}.")
    return scheme.cache_write(q, k, positions)


def position_scheme(module, rope_scaling=None, *, x=None, positions=None):
    """The scheme object of an attention-position module for one call: ``module.scheme(
    rope_scaling, x=x, positions=positions)``; ``None`` -> :class:`jaxpos.NoPE`.

    Raises:
      ValueError: ``rope_scaling`` for a scheme that does not take it.
    """
    if module is None:
        no_rope_scaling("nope", rope_scaling)
        return NoPE()
    return module.scheme(rope_scaling, x=x, positions=positions)


# ================================================================== attention

class AttentionCore:
    """The computation of :class:`MultiHeadAttention` and its Linen twin. Subclasses
    declare ``q_proj``/``k_proj``/``v_proj``/``o_proj`` (``kernel``, ``bias``), fields
    ``causal``, ``scale``, ``implementation``, ``dtype``, ``mask_mod`` (a callable or
    None), and give ``_dims()`` -> ``(d_model, num_heads, num_kv_heads, head_dim)``,
    ``_position()`` (the position module or None) and ``_sinks()`` (the sink logits
    ``[num_heads]``, or None for a layer without sinks)."""

    def _proj(self, layer, x, heads):
        return project_heads(x, _value(layer.kernel), heads, self._dims()[3], self.dtype,
                             _value(layer.bias))

    def _out(self, o):
        return merge_heads(o, _value(self.o_proj.kernel), self.dtype, _value(self.o_proj.bias))

    def _qkv(self, x, context=None):
        D, N, Nk, _ = self._dims()
        check_attention_input("x", x, D)
        src = x if context is None else context
        return (self._proj(self.q_proj, x, N), self._proj(self.k_proj, src, Nk),
                self._proj(self.v_proj, src, Nk))

    def _scheme(self, scheme, rope_scaling, x, positions):
        if scheme is not None:
            return scheme
        return position_scheme(self._position(), rope_scaling, x=x, positions=positions)

    def _mask_mod(self, mask_mod):
        """The call's mask_mod when given (it replaces the layer's), else the layer's."""
        if mask_mod is None:
            return self.mask_mod
        return check_mask_mod("mask_mod", mask_mod)

    def __call__(self, x, *, context=None, positions=None, kv_positions=None, mask=None,
                 segment_ids=None, kv_segment_ids=None, scheme=None, rope_scaling=None,
                 implementation=None, mask_mod=None) -> jax.Array:
        pos, kv_pos = attention_inputs(x, context, positions, kv_positions, kv_segment_ids,
                                       self._dims()[0])
        q, k, v = self._qkv(x, context)
        scheme = self._scheme(scheme, rope_scaling, x, pos)
        o = attention(q, k, v, position=scheme, q_positions=pos, kv_positions=kv_pos,
                      causal=self.causal, mask=mask, segment_ids=segment_ids,
                      kv_segment_ids=kv_segment_ids, scale=self.scale,
                      mask_mod=self._mask_mod(mask_mod), sinks=self._sinks(),
                      implementation=implementation or self.implementation)
        return self._out(o)

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        """An empty :class:`KVCache` of ``max_len`` slots for ``batch`` rows (no parameters
        needed)."""
        _, _, Nk, H = self._dims()
        return init_kv_cache(batch, max_len, Nk, H, dtype or self.dtype)

    def decode(self, x, cache: KVCache, *, positions=None, scheme=None, rope_scaling=None,
               implementation=None, mask_mod=None):
        """Attend from ``x [B, T, D]`` (new tokens) to the cache plus themselves.

        ``positions`` default to each row's fill count ``+ arange(T)``. The layer's
        mask_mod (or the call's ``mask_mod``) and sinks apply as in the full pass: the
        mask_mod sees the global positions of the new tokens and of the cached keys, so a
        sliding window keeps its width at every step. The scheme's
        :meth:`~jaxpos.PositionScheme.cache_write` decides what the cache stores (raw keys,
        the scheme applied inside attention from the cached positions, except RoPE with a
        length-dependent scaling: see :func:`rotate_at_write`). Returns ``(y [B, T, D],
        cache)``. Raises ``ValueError`` when concrete fill counts would overflow the cache;
        traced overflow gives NaN for the rows concerned.
        """
        q, k, v = self._qkv(x)
        B, T = x.shape[:2]
        if positions is None:
            positions = cache.length[:, None] + jnp.arange(T, dtype=jnp.int32)
        pos = _checks.positions_2d("positions", positions, B, T)
        scheme = self._scheme(scheme, rope_scaling, x, pos)
        q, k, scheme = rotate_at_write(scheme, q, k, pos)
        cache, seg, kv_seg, overflow = update_kv_cache(cache, k, v, pos)
        o = attention(q, cache.k.astype(q.dtype), cache.v.astype(q.dtype), position=scheme,
                      q_positions=pos, kv_positions=cache.positions, causal=self.causal,
                      segment_ids=seg, kv_segment_ids=kv_seg, scale=self.scale,
                      mask_mod=self._mask_mod(mask_mod), sinks=self._sinks(),
                      implementation=implementation or self.implementation)
        return poison_rows(self._out(o), overflow), cache


class MultiHeadAttention(AttentionCore, nnx.Module):
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
    take it), ``implementation``, ``mask_mod`` (this call only; replaces the layer's).
    The layer's scheme is built per call by the position
    module (:meth:`PositionModule.scheme`, from the call's ``x`` and ``positions``).
    ``decode(x, cache, ...)`` appends to a :class:`KVCache` from
    ``init_cache(batch, max_len)`` and returns ``(y, cache)``.

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
                 sinks: bool = False, mask_mod=None, dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        d_model, num_heads, num_kv_heads, head_dim = attention_dims(d_model, num_heads,
                                                                    num_kv_heads, head_dim)
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
        self.position_module = make_position_module(
            position, num_heads=num_heads, head_dim=head_dim, d_model=d_model,
            causal=self.causal, options=options, param_dtype=param_dtype, rngs=rngs)

    def _dims(self):
        return self.d_model, self.num_heads, self.num_kv_heads, self.head_dim

    def _position(self):
        return self.position_module

    def _sinks(self):
        return None if self.sinks is None else self.sinks[...]


# ================================================================== blocks and stacks

class BlockCore:
    """The computation of :class:`TransformerBlock` and its Linen twin (``attn_norm``,
    ``attn``, ``mlp_norm``, ``mlp_in``, ``mlp_out``, ``dtype``)."""

    def _mlp(self, x):
        h = rms_norm(x, _value(self.mlp_norm.scale))
        return x + mlp(h, _value(self.mlp_in.kernel), _value(self.mlp_out.kernel), self.dtype)

    def __call__(self, x, **kw) -> jax.Array:
        x = x + self.attn(rms_norm(x, _value(self.attn_norm.scale)), **kw)
        return self._mlp(x)

    def decode(self, x, cache: KVCache, **kw):
        """As :meth:`MultiHeadAttention.decode`, then the MLP: ``(y, cache)``."""
        a, cache = self.attn.decode(rms_norm(x, _value(self.attn_norm.scale)), cache, **kw)
        return self._mlp(x + a), cache


class TransformerBlock(BlockCore, nnx.Module):
    """A pre-LN transformer block: ``x + attn(rms_norm(x))``, then ``x + mlp(rms_norm(x))``
    (Xiong et al. 2020; RMSNorm, Zhang & Sennrich 2019; GELU MLP).

    Args: as :class:`MultiHeadAttention` (``sinks``, ``mask_mod`` included), plus
    ``mlp_dim`` (default ``4 * d_model``).
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
                 sinks: bool = False, mask_mod=None, dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        d_model = _checks.check_positive_int("d_model", d_model)
        mlp_dim = 4 * d_model if mlp_dim is None else _checks.check_positive_int("mlp_dim", mlp_dim)
        self.dtype = dtype
        self.attn_norm = nnx.RMSNorm(d_model, param_dtype=param_dtype, rngs=rngs)
        self.attn = MultiHeadAttention(
            d_model, num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, position=position,
            causal=causal, rotary_dim=rotary_dim, rope_base=rope_base, num_buckets=num_buckets,
            max_distance=max_distance, scheme_options=scheme_options, scale=scale,
            implementation=implementation, sinks=sinks, mask_mod=mask_mod, dtype=dtype,
            param_dtype=param_dtype, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(d_model, param_dtype=param_dtype, rngs=rngs)
        lin = lambda i, o: nnx.Linear(i, o, use_bias=False, param_dtype=param_dtype, rngs=rngs)
        self.mlp_in = lin(d_model, mlp_dim)
        self.mlp_out = lin(mlp_dim, d_model)


class StackPlan(NamedTuple):
    """How a stack places its position scheme (:func:`stack_plan`)."""

    name: str            #: the stack's position name (absolute or registered)
    absolute: str | None  #: "sinusoidal" / "learned", or None
    scheme: str          #: the attention scheme's registered name ("nope" for absolute)
    per_layer: bool      #: the scheme's ``params_per_layer``: a module in every layer
    options: tuple       #: the scheme's options (:func:`stack_options`)


def stack_plan(position, *, max_len, rope_base, prefixed: dict, scheme_options) -> StackPlan:
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


class StackCore:
    """The computation shared by :class:`DecoderLM`, :class:`Encoder` and their Linen
    twins. Subclasses declare ``embed`` (``embedding``), ``abs_position``,
    ``rel_position`` (the stack's :class:`PositionModule`, or None when the scheme lives in
    every layer), ``blocks``, ``final_norm`` and fields ``vocab_size``, ``d_model``,
    ``max_len``, ``implementation``, ``dtype``; and give ``_position_name()`` and
    ``_cache_dims()`` -> ``(num_layers, num_kv_heads, head_dim)``."""

    def _embed(self, tokens, pos):
        tokens = check_tokens(tokens, self.vocab_size)
        x = embed_tokens(_value(self.embed.embedding), tokens, self.d_model, self.dtype)
        if self.abs_position is not None:
            x = x + self.abs_position(pos).astype(self.dtype)
        return x

    def _scheme(self, rope_scaling, x, pos):
        """``(scheme for every layer, rope_scaling left for the layers)``: the stack's
        scheme, or ``(None, rope_scaling)`` when each layer builds its own."""
        if self.rel_position is None:
            return None, rope_scaling
        return position_scheme(self.rel_position, rope_scaling, x=x, positions=pos), None

    def _hidden(self, tokens, positions, rope_scaling, implementation, mask=None,
                segment_ids=None):
        _checks.check_rank("tokens", tokens, (2,), "[batch, seq] token ids")
        check_learned_length(self._position_name(), self.max_len, _checks.shape_of(tokens)[1],
                             positions)
        pos = default_positions(_checks.shape_of(tokens), positions)
        x = self._embed(tokens, pos)
        scheme, layer_scaling = self._scheme(rope_scaling, x, pos)
        impl = implementation or self.implementation
        for block in self.blocks:
            x = block(x, positions=pos, mask=mask, segment_ids=segment_ids, scheme=scheme,
                      rope_scaling=layer_scaling, implementation=impl)
        return rms_norm(x, _value(self.final_norm.scale))


class DecoderCore(StackCore):
    """The calls of :class:`DecoderLM` and its Linen twin."""

    def __call__(self, tokens, *, positions=None, rope_scaling=None, implementation=None,
                 segment_ids=None) -> jax.Array:
        """Causal forward pass.

        Args:
          tokens: int ``[B, T]`` in ``[0, vocab_size)`` (concrete ids outside raise).
          positions: int ``[T]`` or ``[B, T]``, default ``arange(T)``; offsets, left
            padding and packing are all position arrays.
          rope_scaling: a :mod:`jaxpos.rope_scaling` dataclass applied for this call only;
            ``ValueError`` for a model whose scheme does not take it (not ``"rope"``).
          implementation: overrides the model's attention backend for this call.
          segment_ids: int ``[B, T]`` for packed sequences (optional).

        Returns:
          float32 logits ``[B, T, vocab_size]``.

        Raises:
          ValueError: ``"learned"`` with ``T > max_len`` or concrete positions outside the
            table (never clamped), bad shapes; TypeError: float tokens/positions.
        """
        h = self._hidden(tokens, positions, rope_scaling, implementation,
                         segment_ids=segment_ids)
        return tied_logits(h, _value(self.embed.embedding))

    def init_cache(self, batch: int, max_len: int, dtype=None) -> tuple[KVCache, ...]:
        """One empty :class:`KVCache` per layer, ``max_len`` slots for ``batch`` rows (no
        parameters needed)."""
        L, Nk, H = self._cache_dims()
        return tuple(init_kv_cache(batch, max_len, Nk, H, dtype or self.dtype)
                     for _ in range(L))

    def decode_step(self, tokens, cache, *, positions=None, rope_scaling=None,
                    implementation=None):
        """Run ``tokens [B, T]`` (one or more new tokens per row) against the cache.

        ``positions`` default to each row's fill count ``+ arange(T)``; give them to put
        rows at different offsets. Returns ``(logits float32 [B, T, vocab_size], cache)``.
        Decoding a sequence token by token gives the logits of the full forward pass with
        the same positions, except with a length-dependent ``rope_scaling`` (dynamic NTK,
        LongRoPE): cached keys keep the rotation of the call that wrote them, as in Hugging
        Face's decoding (:func:`rotate_at_write`). Raises as :meth:`__call__`, and
        ``ValueError`` on concrete cache overflow (traced overflow gives NaN rows).
        """
        L = self._cache_dims()[0]
        if not isinstance(cache, (tuple, list)) or len(cache) != L:
            raise ValueError(f"cache must be a tuple of {L} KVCache (from init_cache); got "
                             f"{type(cache).__name__}.")
        _checks.check_rank("tokens", tokens, (2,), "[batch, seq] token ids")
        B, T = _checks.shape_of(tokens)
        if positions is None:
            positions = cache[0].length[:, None] + jnp.arange(T, dtype=jnp.int32)
        pos = _checks.positions_2d("positions", positions, B, T)
        x = self._embed(tokens, pos)
        scheme, layer_scaling = self._scheme(rope_scaling, x, pos)
        impl = implementation or self.implementation
        new = []
        for block, c in zip(self.blocks, cache):
            x, c = block.decode(x, c, positions=pos, scheme=scheme, rope_scaling=layer_scaling,
                                implementation=impl)
            new.append(c)
        h = rms_norm(x, _value(self.final_norm.scale))
        return tied_logits(h, _value(self.embed.embedding)), tuple(new)


class EncoderCore(StackCore):
    """The call of :class:`Encoder` and its Linen twin."""

    def __call__(self, tokens, *, positions=None, mask=None, segment_ids=None,
                 rope_scaling=None, implementation=None) -> jax.Array:
        """Bidirectional forward pass: final-normalised hidden states ``[B, T, d_model]``
        (``dtype``); keywords as :meth:`DecoderLM.__call__` plus ``mask``."""
        return self._hidden(tokens, positions, rope_scaling, implementation, mask=mask,
                            segment_ids=segment_ids)


class _Stack(nnx.Module):
    """Shared constructor of :class:`DecoderLM` and :class:`Encoder`."""

    _causal = True

    def __init__(self, vocab_size: int, *, d_model: int, num_layers: int, num_heads: int,
                 position: str, num_kv_heads: int | None = None, mlp_dim: int | None = None,
                 max_len: int | None = None, rope_base: float = 10000.0,
                 t5_num_buckets: int = 32, t5_max_distance: int = 128,
                 shaw_max_distance: int = 16, scheme_options: dict | None = None,
                 implementation: str | None = None, sinks: bool = False, mask_mod=None,
                 layer_mask_mods=None, dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        self.vocab_size = _checks.check_positive_int("vocab_size", vocab_size)
        d_model, num_heads, num_kv_heads, head_dim = attention_dims(d_model, num_heads,
                                                                    num_kv_heads, None)
        num_layers = _checks.check_positive_int("num_layers", num_layers)
        sinks = check_sinks_flag(sinks)
        mask_mods = layer_mask_mods_plan(num_layers, mask_mod, layer_mask_mods)
        if max_len is not None:
            _checks.check_positive_int("max_len", max_len)
        plan = stack_plan(position, max_len=max_len, rope_base=rope_base, prefixed={
            "t5_num_buckets": t5_num_buckets, "t5_max_distance": t5_max_distance,
            "shaw_max_distance": shaw_max_distance}, scheme_options=scheme_options)
        self.position_name = plan.name
        self.d_model, self.num_layers, self.max_len = d_model, num_layers, max_len
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.implementation, self.dtype = implementation, dtype
        causal = self._causal
        self.embed = nnx.Embed(vocab_size, d_model, param_dtype=param_dtype,
                               embedding_init=token_embedding_init(d_model), rngs=rngs)
        abs_position = None
        if plan.absolute == "sinusoidal":
            abs_position = SinusoidalEmbedding(d_model, dtype=dtype)
        elif plan.absolute == "learned":
            abs_position = LearnedPositionalEmbedding(max_len, d_model, param_dtype=param_dtype,
                                                      rngs=rngs)
        self.abs_position = abs_position
        self.rel_position = None if plan.per_layer else PositionModule(
            plan.scheme, num_heads=num_heads, head_dim=head_dim, d_model=d_model, causal=causal,
            options=dict(plan.options), param_dtype=param_dtype, rngs=rngs)
        layer_position = plan.scheme if plan.per_layer else "nope"
        layer_options = dict(plan.options) if plan.per_layer else None
        self.blocks = nnx.List([
            TransformerBlock(d_model, num_heads, num_kv_heads=num_kv_heads, mlp_dim=mlp_dim,
                             position=layer_position, causal=causal,
                             scheme_options=layer_options, implementation=implementation,
                             sinks=sinks, mask_mod=mask_mods[i], dtype=dtype,
                             param_dtype=param_dtype, rngs=rngs)
            for i in range(num_layers)])
        self.final_norm = nnx.RMSNorm(d_model, param_dtype=param_dtype, rngs=rngs)

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
      sinks: True gives every layer learned attention-sink logits, parameter
        ``blocks[i].attn.sinks [num_heads]`` (zeros at init; GPT-OSS;
        :class:`MultiHeadAttention`). Default False.
      mask_mod: one mask_mod for every layer (e.g. ``jaxpos.SlidingWindowMask(w)``),
        applied in the forward pass and in :meth:`decode_step`. Default None.
      layer_mask_mods: a list or tuple of ``num_layers`` entries, a mask_mod or None
        (full attention) per layer, e.g. ``[jaxpos.SlidingWindowMask(128), None] *
        (num_layers // 2)`` for the alternating sliding / full layers of GPT-OSS and
        Gemma 2 (Hugging Face ``layer_types``). Exclusive with ``mask_mod``.
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

    Call: ``tokens`` int ``[B, T]``; keywords ``positions``, ``mask`` (bool, broadcastable
    to ``[B, N, T, T]``, e.g. ``valid[:, None, None, :]`` for padding; the Pallas kernel
    takes no arbitrary mask, so on GPU/TPU express padding with ``segment_ids`` instead,
    e.g. 1 for real tokens and 0 for padding), ``segment_ids``, ``rope_scaling``,
    ``implementation``. Returns ``[B, T, d_model]`` in ``dtype``.
    """

    _causal = False

    def __init__(self, vocab_size: int, *, position: str = "nope", **kwargs):
        """Arguments as the class docstring says (the other keywords and their defaults
        are those of the shared stack constructor)."""
        super().__init__(vocab_size, position=position, **kwargs)
