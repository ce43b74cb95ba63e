"""Flax NNX modules over the jaxpos functions: position modules, attention, blocks and
small decoder / encoder stacks.

Position modules (each wraps the pure functions of one scheme; those that act inside
attention also build the scheme object that :func:`jaxpos.attention` takes, with
``.scheme()``):

=============================  ============================  ==============================
module                         parameters                    enters the model
=============================  ============================  ==============================
:class:`SinusoidalEmbedding`   none (the table is computed)  added to the token embeddings
:class:`LearnedPositionalEmbedding`  ``table [max_len, d]``  added to the token embeddings
:class:`RotaryEmbedding`       none                          rotates q and k
:class:`ALiBi`                 none (fixed slopes)           score bias
:class:`T5RelativeBias`        ``table [num_buckets, N]``    score bias, one table per stack
:class:`ShawRelativePosition`  ``rel_k, rel_v [2K+1, H]``    key and value terms, per layer
=============================  ============================  ==============================

Then :class:`MultiHeadAttention` (``position=...``), :class:`TransformerBlock`,
:class:`DecoderLM` and :class:`Encoder`. The Linen twins in :mod:`jaxpos.linen` share the
parameter names and the numerics, so :func:`jaxpos.linen.params_from_nnx` moves weights
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
* Stack-level position modules (RoPE, ALiBi, T5) are owned by the stack and their
  scheme is built once per call and passed to every layer: the T5 table is one
  parameter shared by all layers, as in T5 (Raffel et al. 2020, §2.1). Shaw tables are
  per layer (Shaw et al. 2018, §3.1, share them across heads, not layers).

KV-cache decoding: ``cache = model.init_cache(batch, max_len)`` then
``logits, cache = model.decode_step(tokens, cache, positions=...)`` with any number of
new tokens per step. A cache (:class:`KVCache`) holds raw (unrotated) keys and values,
their positions and a per-row fill count, so rows may sit at different offsets and
positions are just integers: RoPE rotates cached keys from their stored positions, and
ALiBi / T5 / Shaw read offsets from them.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpos import _checks
from jaxpos import schemes as _schemes
from jaxpos.alibi import alibi_bias
from jaxpos.attention import IMPLEMENTATIONS, attention
from jaxpos.learned import learned_positions
from jaxpos.rope import apply_rope, check_rotary_dim
from jaxpos.sinusoidal import sinusoidal_pe
from jaxpos.t5 import check_bucket_args, t5_bias

__all__ = [
    "POSITIONS",
    "ALiBi",
    "DecoderLM",
    "Encoder",
    "KVCache",
    "LearnedPositionalEmbedding",
    "MultiHeadAttention",
    "RotaryEmbedding",
    "ShawRelativePosition",
    "SinusoidalEmbedding",
    "T5RelativeBias",
    "TransformerBlock",
    "rotate_at_write",
]

#: Position names accepted by the stacks.
POSITIONS = ("nope", "sinusoidal", "learned", "rope", "alibi", "t5", "shaw")
#: Position names accepted by :class:`MultiHeadAttention` (those that act in attention).
ATTENTION_POSITIONS = ("nope", "rope", "alibi", "t5", "shaw")


# ================================================================== shared helpers
# (pure functions used by the NNX and the Linen modules alike)

def token_embedding_init(d_model: int):
    """``N(0, 1/d_model)``: the scaled embedding ``sqrt(d_model) * E[t]`` has unit variance."""
    return jax.nn.initializers.normal(stddev=d_model ** -0.5)


def learned_table_init():
    """``N(0, 1/2)``: the same per-entry variance as the sinusoidal table (sin^2, cos^2)."""
    return jax.nn.initializers.normal(stddev=math.sqrt(0.5))


def t5_table_init(d_model: int):
    """``N(0, 1/d_model)``, as Hugging Face's T5 initialises ``relative_attention_bias``."""
    return jax.nn.initializers.normal(stddev=d_model ** -0.5)


def shaw_table_init():
    """Glorot uniform, the tensor2tensor default for Shaw's relative embeddings."""
    return jax.nn.initializers.glorot_uniform()


def check_position_name(name: str, value: Any, choices=POSITIONS) -> str:
    """Lower-cased position name (``"none"`` means ``"nope"``); ``TypeError`` for a
    non-string, ``ValueError`` naming ``choices`` for an unknown name."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {choices} (a string); got "
                        f"{type(value).__name__} {value!r}.")
    value = value.lower()
    if value == "none":
        value = "nope"
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


def rope_scheme(rotary_dim: int, base: float, layout: str, scaling) -> _schemes.RoPE:
    """:class:`jaxpos.RoPE` with ``scaling`` (a :mod:`jaxpos.rope_scaling` dataclass or None)."""
    return _schemes.RoPE(rotary_dim=rotary_dim, base=base, layout=layout, scaling=scaling)


def no_rope_scaling(position: str, rope_scaling) -> None:
    """``ValueError`` when ``rope_scaling`` is given to a model without RoPE."""
    if rope_scaling is not None:
        raise ValueError(f"rope_scaling applies to RoPE models only; this model uses "
                         f"position={position!r}. Got rope_scaling={rope_scaling!r}.")


class KVCache(NamedTuple):
    """The KV cache of one attention layer (a pytree; pass it through ``jit``).

    Attributes:
      k: ``[B, S, N_kv, H]`` raw keys (not rotated: RoPE is applied from ``positions``
        inside :func:`jaxpos.attention` at every step).
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
    ``implementation`` ``None`` or one of :data:`jaxpos.IMPLEMENTATIONS`, ``use_bias`` a bool."""
    if implementation is not None:
        _checks.check_choice("implementation", implementation, IMPLEMENTATIONS)
    if not isinstance(use_bias, bool):
        raise TypeError(f"use_bias must be a bool; got {type(use_bias).__name__} {use_bias!r}.")


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

class SinusoidalEmbedding(nnx.Module):
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

    def __call__(self, positions) -> jax.Array:
        return sinusoidal_embedding(positions, self.d_model, self.base, self.layout, self.dtype)


class LearnedPositionalEmbedding(nnx.Module):
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

    def __call__(self, positions) -> jax.Array:
        return learned_positions(self.table[...], positions, out_of_range=self.out_of_range)


class RotaryEmbedding(nnx.Module):
    """Rotary position embedding (Su et al. 2024, §3.4); no parameters.

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
        self.rotary_dim = check_rotary_dim(rotary_dim)
        _checks.check_choice("layout", layout, ("half", "interleaved"))
        _checks.check_positive_float("base", base)
        self.base, self.layout, self.scaling = float(base), layout, scaling

    def scheme(self, scaling=None) -> _schemes.RoPE:
        """The RoPE scheme, with ``scaling`` (this call) or the module's default."""
        return rope_scheme(self.rotary_dim, self.base, self.layout,
                           self.scaling if scaling is None else scaling)

    def __call__(self, x, positions, *, scaling=None) -> jax.Array:
        s = self.scheme(scaling)
        pos = _checks.positions_2d("positions", positions, x.shape[0], x.shape[1])
        inv_freq, af = s.frequencies(pos, pos)
        return apply_rope(x, pos, inv_freq, layout=self.layout, attention_factor=af)


class ALiBi(nnx.Module):
    """ALiBi (Press et al. 2022, §3): fixed per-head slopes, a linear score bias; no
    parameters.

    Args:
      num_heads: query heads (slopes by :func:`jaxpos.alibi_slopes`).
      bidirectional: ``-m |kv - q|`` (encoders) instead of the causal ``m (kv - q)``.

    ``scheme()`` returns :class:`jaxpos.ALiBi`; calling the module returns the bias
    float32 ``[N, Tq, Tk]`` (``[B, N, Tq, Tk]`` for batched positions).
    """

    def __init__(self, num_heads: int, *, bidirectional: bool = False):
        self.num_heads = _checks.check_positive_int("num_heads", num_heads)
        self.bidirectional = bool(bidirectional)

    def scheme(self) -> _schemes.ALiBi:
        """The :class:`jaxpos.ALiBi` scheme with the paper's slopes."""
        return _schemes.ALiBi(self.num_heads, bidirectional=self.bidirectional)

    def __call__(self, q_positions, kv_positions) -> jax.Array:
        return alibi_bias(q_positions, kv_positions, self.scheme().slopes,
                          bidirectional=self.bidirectional)


class T5RelativeBias(nnx.Module):
    """T5 bucketed relative bias (Raffel et al. 2020, §2.1): one learned scalar per
    (bucket, head), one table shared by every layer of a stack.

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
        init = embedding_init or t5_table_init(d_model or num_heads)
        self.table = nnx.Param(init(rngs.params(), (num_buckets, num_heads), param_dtype))
        self.num_heads, self.num_buckets, self.max_distance = num_heads, num_buckets, max_distance
        self.bidirectional = bool(bidirectional)

    def scheme(self) -> _schemes.T5Bias:
        """The :class:`jaxpos.T5Bias` scheme holding this table (gradients flow to it)."""
        return _schemes.T5Bias(self.table[...], bidirectional=self.bidirectional,
                               num_buckets=self.num_buckets, max_distance=self.max_distance)

    def __call__(self, q_positions, kv_positions) -> jax.Array:
        return t5_bias(q_positions, kv_positions, self.table[...], bidirectional=self.bidirectional,
                       num_buckets=self.num_buckets, max_distance=self.max_distance)


class ShawRelativePosition(nnx.Module):
    """Relative keys and values of Shaw et al. 2018, §3: ``2K + 1`` learned vectors of head
    width per table, for clipped offsets ``clip(kv - q, -K, K)``, shared by the heads.

    Args:
      head_dim: width of each vector.
      max_distance: the clipping distance ``K`` (the paper finds ``K >= 2`` enough).
      values: also learn the value table ``rel_v`` (the paper's full form).
      rngs: :class:`flax.nnx.Rngs`.

    Parameters ``rel_k`` (and ``rel_v``) float ``[2K + 1, head_dim]``; row ``r + K`` is
    offset ``r``. ``scheme()`` returns :class:`jaxpos.Shaw`.
    """

    def __init__(self, head_dim: int, *, max_distance: int = 16, values: bool = True,
                 embedding_init=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
        head_dim = _checks.check_positive_int("head_dim", head_dim)
        K = _checks.check_positive_int("max_distance", max_distance)
        init = embedding_init or shaw_table_init()
        self.rel_k = nnx.Param(init(rngs.params(), (2 * K + 1, head_dim), param_dtype))
        self.rel_v = (nnx.Param(init(rngs.params(), (2 * K + 1, head_dim), param_dtype))
                      if values else None)
        self.head_dim, self.max_distance = head_dim, K

    def scheme(self) -> _schemes.Shaw:
        """The :class:`jaxpos.Shaw` scheme holding these tables (gradients flow to them)."""
        return _schemes.Shaw(self.rel_k[...], None if self.rel_v is None else self.rel_v[...])


def _make_attention_position(position, *, num_heads, head_dim, causal, rotary_dim, rope_base,
                             num_buckets, max_distance, d_model, param_dtype, rngs):
    """An attention-position module from a name (or pass a module through)."""
    if isinstance(position, (RotaryEmbedding, ALiBi, T5RelativeBias, ShawRelativePosition)):
        return position
    if position is None:
        return None
    name = check_position_name("position", position, ATTENTION_POSITIONS)
    if name == "nope":
        return None
    if name == "rope":
        return RotaryEmbedding(head_dim if rotary_dim is None else rotary_dim, base=rope_base)
    if name == "alibi":
        return ALiBi(num_heads, bidirectional=not causal)
    if name == "t5":
        return T5RelativeBias(num_heads, num_buckets=num_buckets,
                              max_distance=128 if max_distance is None else max_distance,
                              bidirectional=not causal, d_model=d_model,
                              param_dtype=param_dtype, rngs=rngs)
    return ShawRelativePosition(head_dim, max_distance=16 if max_distance is None else max_distance,
                                param_dtype=param_dtype, rngs=rngs)


def rotate_at_write(scheme, q, k, positions):
    """``(q, k, scheme)`` for a KV-cache write: RoPE with a length-dependent scaling
    (dynamic NTK, LongRoPE) rotates ``q`` and ``k`` here, with the frequencies of this call
    (``max(positions) + 1``), and returns :class:`jaxpos.NoPE` for the attention call, so
    each cached key keeps the rotation of the call that wrote it. That is Hugging Face's
    decoding (its cache holds rotated keys; ``dynamic_rope_update``), which jaxpos's Llama
    port matches step by step. Any other scheme is returned unchanged, to be applied inside
    attention (and inside the fused kernel) from the cached positions. Dynamic NTK: bloc97
    2023 / HF ``_compute_dynamic_ntk_parameters``; LongRoPE: Ding et al. 2024, §3.

    Args:
      scheme: a :class:`jaxpos.PositionScheme`.
      q: ``[B, T, N, H]``; k: ``[B, T, N_kv, H]``, the new tokens only (any float dtype;
        rotated in float32 and cast back).
      positions: int ``[B|1, T]``, the new tokens' positions.

    Returns:
      ``(q, k, scheme)``: rotated ``q`` and ``k`` with :class:`jaxpos.NoPE`, or the inputs
      unchanged.

    Raises:
      TypeError: ``scheme`` is not a :class:`jaxpos.PositionScheme`.
    """
    if not isinstance(scheme, _schemes.PositionScheme):
        raise TypeError(f"scheme must be a jaxpos PositionScheme; got {type(scheme).__name__} "
                        f"{scheme!r}.")
    if isinstance(scheme, _schemes.RoPE) and scheme.scaling is not None:
        from jaxpos import rope_scaling as _rs

        if _rs.depends_on_length(scheme.scaling):
            return scheme.rotate(q, positions), scheme.rotate(k, positions), _schemes.NoPE()
    return q, k, scheme


def position_scheme(module, rope_scaling=None):
    """The scheme object of an attention-position module (``None`` -> :class:`jaxpos.NoPE`)."""
    if module is None:
        no_rope_scaling("nope", rope_scaling)
        return _schemes.NoPE()
    if isinstance(module, RotaryEmbedding):
        return module.scheme(rope_scaling)
    if rope_scaling is not None:
        no_rope_scaling(type(module).__name__, rope_scaling)
    return module.scheme()


# ================================================================== attention

class MultiHeadAttention(nnx.Module):
    """Multi-head (grouped-query) self- or cross-attention with any position scheme, over
    :func:`jaxpos.attention`.

    Args:
      d_model: input and output width ``D``.
      num_heads: query heads ``N``; num_kv_heads: key/value heads (default ``N``; a
        divisor of ``N`` gives grouped-query attention, Ainslie et al. 2023).
      head_dim: ``H``, default ``d_model // num_heads``.
      position: ``"nope"`` / ``None``, ``"rope"``, ``"alibi"``, ``"t5"``, ``"shaw"``, or a
        position module (:class:`RotaryEmbedding`, :class:`ALiBi`, :class:`T5RelativeBias`,
        :class:`ShawRelativePosition`); a module passed here is shared by reference. A
        scheme object (e.g. ``jaxpos.RoPE(inv_freq)`` from a checkpoint) goes in at call
        time instead, as ``scheme=``.
      causal: causal self-attention (by positions: a query at ``p`` sees keys ``<= p``).
      rotary_dim, rope_base: RoPE options (default ``head_dim``, 10000).
      num_buckets, max_distance: T5 options (32, 128), or ``max_distance`` = Shaw's K (16).
      scale: score scale, default ``1/sqrt(head_dim)``.
      implementation: default backend of :func:`jaxpos.attention` (``None`` = best).
      use_bias: add biases to the four projections (GPT-2, BLOOM, BERT); default False
        (Llama, T5).
      dtype: compute dtype; param_dtype: parameter dtype. rngs: :class:`flax.nnx.Rngs`.

    Parameters: ``q_proj.kernel [D, N*H]``, ``k_proj.kernel``/``v_proj.kernel [D, N_kv*H]``,
    ``o_proj.kernel [N*H, D]`` (and ``*.bias`` with ``use_bias``), plus those of the
    position module (attribute ``position_module``, e.g. ``position_module.rel_k`` for Shaw).

    Call: ``x [B, T, D]`` -> ``[B, T, D]``, keyword ``positions`` (int ``[T]``/``[B, T]``,
    default ``arange``), ``context`` (``[B, Tk, D]``: cross-attention, keys and values
    from ``context`` at ``kv_positions``, default ``arange(Tk)``, with ``kv_segment_ids``;
    T5's decoder uses ``position="nope"`` there), ``mask``/``segment_ids`` as in
    :func:`jaxpos.attention`,
    ``scheme`` (a scheme object that replaces this layer's own, e.g. a stack's shared T5
    bias), ``rope_scaling`` (this call only; ``ValueError`` for a non-RoPE layer),
    ``implementation``. ``decode(x, cache, ...)`` appends to a :class:`KVCache` from
    ``init_cache(batch, max_len)`` and returns ``(y, cache)``.

    Raises: ``ValueError`` for bad sizes, names, positions or cache overflow; ``TypeError``
    for float positions.
    """

    def __init__(self, d_model: int, num_heads: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, position: Any = "nope", causal: bool = False,
                 rotary_dim: int | None = None, rope_base: float = 10000.0,
                 num_buckets: int = 32, max_distance: int | None = None, scale: float | None = None,
                 implementation: str | None = None, use_bias: bool = False, dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        d_model, num_heads, num_kv_heads, head_dim = attention_dims(d_model, num_heads,
                                                                    num_kv_heads, head_dim)
        check_attention_options(implementation, use_bias)
        self.d_model, self.num_heads, self.num_kv_heads, self.head_dim = (
            d_model, num_heads, num_kv_heads, head_dim)
        self.causal, self.scale, self.implementation, self.dtype = (
            bool(causal), scale, implementation, dtype)
        lin = lambda i, o: nnx.Linear(i, o, use_bias=use_bias, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = lin(d_model, num_heads * head_dim)
        self.k_proj = lin(d_model, num_kv_heads * head_dim)
        self.v_proj = lin(d_model, num_kv_heads * head_dim)
        self.o_proj = lin(num_heads * head_dim, d_model)
        self.position_module = _make_attention_position(
            position, num_heads=num_heads, head_dim=head_dim, causal=causal,
            rotary_dim=rotary_dim, rope_base=rope_base, num_buckets=num_buckets,
            max_distance=max_distance, d_model=d_model, param_dtype=param_dtype, rngs=rngs)

    def _proj(self, layer, x, heads):
        bias = None if layer.bias is None else layer.bias[...]
        return project_heads(x, layer.kernel[...], heads, self.head_dim, self.dtype, bias)

    def _out(self, o):
        bias = None if self.o_proj.bias is None else self.o_proj.bias[...]
        return merge_heads(o, self.o_proj.kernel[...], self.dtype, bias)

    def _qkv(self, x, context=None):
        check_attention_input("x", x, self.d_model)
        src = x if context is None else context
        return (self._proj(self.q_proj, x, self.num_heads),
                self._proj(self.k_proj, src, self.num_kv_heads),
                self._proj(self.v_proj, src, self.num_kv_heads))

    def __call__(self, x, *, context=None, positions=None, kv_positions=None, mask=None,
                 segment_ids=None, kv_segment_ids=None, scheme=None, rope_scaling=None,
                 implementation=None) -> jax.Array:
        pos, kv_pos = attention_inputs(x, context, positions, kv_positions, kv_segment_ids,
                                       self.d_model)
        q, k, v = self._qkv(x, context)
        if scheme is None:
            scheme = position_scheme(self.position_module, rope_scaling)
        o = attention(q, k, v, position=scheme, q_positions=pos, kv_positions=kv_pos,
                      causal=self.causal, mask=mask, segment_ids=segment_ids,
                      kv_segment_ids=kv_segment_ids, scale=self.scale,
                      implementation=implementation or self.implementation)
        return self._out(o)

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        """An empty :class:`KVCache` of ``max_len`` slots for ``batch`` rows."""
        return init_kv_cache(batch, max_len, self.num_kv_heads, self.head_dim, dtype or self.dtype)

    def decode(self, x, cache: KVCache, *, positions=None, scheme=None, rope_scaling=None,
               implementation=None):
        """Attend from ``x [B, T, D]`` (new tokens) to the cache plus themselves.

        ``positions`` default to each row's fill count ``+ arange(T)``. Keys are cached
        before rotation and the scheme is applied inside attention, except for RoPE with a
        length-dependent scaling (dynamic NTK, LongRoPE): see :func:`rotate_at_write`. Returns
        ``(y [B, T, D], cache)``. Raises ``ValueError`` when concrete fill counts would
        overflow the cache; traced overflow gives NaN for the rows concerned.
        """
        q, k, v = self._qkv(x)
        B, T = x.shape[:2]
        if positions is None:
            positions = cache.length[:, None] + jnp.arange(T, dtype=jnp.int32)
        pos = _checks.positions_2d("positions", positions, B, T)
        if scheme is None:
            scheme = position_scheme(self.position_module, rope_scaling)
        q, k, scheme = rotate_at_write(scheme, q, k, pos)
        cache, seg, kv_seg, overflow = update_kv_cache(cache, k, v, pos)
        o = attention(q, cache.k.astype(q.dtype), cache.v.astype(q.dtype), position=scheme,
                      q_positions=pos, kv_positions=cache.positions, causal=self.causal,
                      segment_ids=seg, kv_segment_ids=kv_seg, scale=self.scale,
                      implementation=implementation or self.implementation)
        return poison_rows(self._out(o), overflow), cache


# ================================================================== blocks and stacks

class TransformerBlock(nnx.Module):
    """A pre-LN transformer block: ``x + attn(rms_norm(x))``, then ``x + mlp(rms_norm(x))``
    (Xiong et al. 2020; RMSNorm, Zhang & Sennrich 2019; GELU MLP).

    Args: as :class:`MultiHeadAttention`, plus ``mlp_dim`` (default ``4 * d_model``).
    Parameters: ``attn_norm.scale``, ``attn.*``, ``mlp_norm.scale``, ``mlp_in.kernel
    [D, F]``, ``mlp_out.kernel [F, D]``.

    Call: ``x [B, T, D]`` -> ``[B, T, D]`` with the keywords of
    :meth:`MultiHeadAttention.__call__`; ``decode(x, cache, ...)`` -> ``(y, cache)``.
    """

    def __init__(self, d_model: int, num_heads: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, mlp_dim: int | None = None,
                 position: Any = "nope", causal: bool = False, rotary_dim: int | None = None,
                 rope_base: float = 10000.0, num_buckets: int = 32,
                 max_distance: int | None = None, scale: float | None = None,
                 implementation: str | None = None, dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        d_model = _checks.check_positive_int("d_model", d_model)
        mlp_dim = 4 * d_model if mlp_dim is None else _checks.check_positive_int("mlp_dim", mlp_dim)
        self.dtype = dtype
        self.attn_norm = nnx.RMSNorm(d_model, param_dtype=param_dtype, rngs=rngs)
        self.attn = MultiHeadAttention(
            d_model, num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, position=position,
            causal=causal, rotary_dim=rotary_dim, rope_base=rope_base, num_buckets=num_buckets,
            max_distance=max_distance, scale=scale, implementation=implementation, dtype=dtype,
            param_dtype=param_dtype, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(d_model, param_dtype=param_dtype, rngs=rngs)
        lin = lambda i, o: nnx.Linear(i, o, use_bias=False, param_dtype=param_dtype, rngs=rngs)
        self.mlp_in = lin(d_model, mlp_dim)
        self.mlp_out = lin(mlp_dim, d_model)

    def _mlp(self, x):
        h = rms_norm(x, self.mlp_norm.scale[...])
        return x + mlp(h, self.mlp_in.kernel[...], self.mlp_out.kernel[...], self.dtype)

    def __call__(self, x, **kw) -> jax.Array:
        x = x + self.attn(rms_norm(x, self.attn_norm.scale[...]), **kw)
        return self._mlp(x)

    def decode(self, x, cache: KVCache, **kw):
        a, cache = self.attn.decode(rms_norm(x, self.attn_norm.scale[...]), cache, **kw)
        return self._mlp(x + a), cache


def _stack_position(position, *, num_heads, head_dim, d_model, max_len, causal, rope_base,
                    t5_num_buckets, t5_max_distance, param_dtype, dtype, rngs):
    """(absolute module or None, stack-level attention module or None, per-layer name)."""
    if position == "sinusoidal":
        return SinusoidalEmbedding(d_model, dtype=dtype), None, "nope"
    if position == "learned":
        if max_len is None:
            raise ValueError("position='learned' needs max_len (the number of table rows); "
                             "got max_len=None.")
        return LearnedPositionalEmbedding(max_len, d_model, param_dtype=param_dtype,
                                          rngs=rngs), None, "nope"
    if position == "rope":
        return None, RotaryEmbedding(head_dim, base=rope_base), "nope"
    if position == "alibi":
        return None, ALiBi(num_heads, bidirectional=not causal), "nope"
    if position == "t5":
        return None, T5RelativeBias(num_heads, num_buckets=t5_num_buckets,
                                    max_distance=t5_max_distance, bidirectional=not causal,
                                    d_model=d_model, param_dtype=param_dtype, rngs=rngs), "nope"
    return None, None, position  # "nope" or per-layer "shaw"


class _Stack(nnx.Module):
    """Shared body of :class:`DecoderLM` and :class:`Encoder`."""

    _causal = True

    def __init__(self, vocab_size: int, *, d_model: int, num_layers: int, num_heads: int,
                 position: str, num_kv_heads: int | None, mlp_dim: int | None,
                 max_len: int | None, rope_base: float, t5_num_buckets: int, t5_max_distance: int,
                 shaw_max_distance: int, implementation: str | None, dtype, param_dtype,
                 rngs: nnx.Rngs):
        self.vocab_size = _checks.check_positive_int("vocab_size", vocab_size)
        d_model, num_heads, num_kv_heads, head_dim = attention_dims(d_model, num_heads,
                                                                    num_kv_heads, None)
        num_layers = _checks.check_positive_int("num_layers", num_layers)
        self.position_name = check_position_name("position", position)
        if max_len is not None:
            _checks.check_positive_int("max_len", max_len)
        self.d_model, self.num_layers, self.max_len = d_model, num_layers, max_len
        self.implementation, self.dtype = implementation, dtype
        self.embed = nnx.Embed(vocab_size, d_model, param_dtype=param_dtype,
                               embedding_init=token_embedding_init(d_model), rngs=rngs)
        self.abs_position, self.rel_position, layer_pos = _stack_position(
            self.position_name, num_heads=num_heads, head_dim=head_dim, d_model=d_model,
            max_len=max_len, causal=self._causal, rope_base=rope_base,
            t5_num_buckets=t5_num_buckets, t5_max_distance=t5_max_distance,
            param_dtype=param_dtype, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([
            TransformerBlock(d_model, num_heads, num_kv_heads=num_kv_heads, mlp_dim=mlp_dim,
                             position=layer_pos, causal=self._causal,
                             max_distance=shaw_max_distance if layer_pos == "shaw" else None,
                             implementation=implementation, dtype=dtype,
                             param_dtype=param_dtype, rngs=rngs)
            for _ in range(num_layers)])
        self.final_norm = nnx.RMSNorm(d_model, param_dtype=param_dtype, rngs=rngs)

    def _embed(self, tokens, pos):
        tokens = check_tokens(tokens, self.vocab_size)
        x = embed_tokens(self.embed.embedding[...], tokens, self.d_model, self.dtype)
        if self.abs_position is not None:
            x = x + self.abs_position(pos).astype(self.dtype)
        return x

    def _scheme(self, rope_scaling):
        if self.position_name == "shaw":
            no_rope_scaling("shaw", rope_scaling)
            return None  # each layer uses its own tables
        if self.rel_position is None:
            no_rope_scaling(self.position_name, rope_scaling)
            return _schemes.NoPE()
        return position_scheme(self.rel_position, rope_scaling)

    def _hidden(self, tokens, positions, rope_scaling, implementation, mask=None,
                segment_ids=None):
        _checks.check_rank("tokens", tokens, (2,), "[batch, seq] token ids")
        check_learned_length(self.position_name, self.max_len, _checks.shape_of(tokens)[1],
                             positions)
        pos = default_positions(_checks.shape_of(tokens), positions)
        x = self._embed(tokens, pos)
        scheme = self._scheme(rope_scaling)
        impl = implementation or self.implementation
        for block in self.blocks:
            x = block(x, positions=pos, mask=mask, segment_ids=segment_ids, scheme=scheme,
                      implementation=impl)
        return rms_norm(x, self.final_norm.scale[...])


class DecoderLM(_Stack):
    """A causal decoder-only language model with any position scheme.

    Args:
      vocab_size: number of token ids.
      d_model, num_layers, num_heads: width, depth, query heads (``head_dim = d_model //
        num_heads``).
      position: ``"nope"`` (causal mask only; Haviv et al. 2022), ``"sinusoidal"``
        (Vaswani et al. 2017, §3.5) or ``"learned"`` (added to the token embeddings),
        ``"rope"`` (Su et al. 2024), ``"alibi"`` (Press et al. 2022), ``"t5"`` (Raffel et
        al. 2020, causal buckets, one table for the stack) or ``"shaw"`` (Shaw et al. 2018,
        keys and values, tables per layer); the last four act in attention.
      num_kv_heads: key/value heads for grouped-query attention (default ``num_heads``).
      mlp_dim: MLP width (default ``4 * d_model``).
      max_len: rows of the ``"learned"`` table (required there, ignored otherwise).
      rope_base: ``rope_theta``; t5_num_buckets, t5_max_distance: T5's 32 and 128;
      shaw_max_distance: Shaw's clipping distance K.
      implementation: default :func:`jaxpos.attention` backend (``None`` = the backend's
        best: chunked on CPU, the Pallas kernel on GPU/TPU where it fuses the scheme).
      dtype: compute dtype (logits are float32); param_dtype: parameter dtype.
      rngs: :class:`flax.nnx.Rngs` (``params`` stream).

    The architecture (pre-LN RMSNorm, GELU MLP, tied embeddings scaled by
    ``sqrt(d_model)``, ``scale = 1/sqrt(head_dim)`` for every scheme) is described in the
    module docstring.

    Raises:
      ValueError: unknown ``position``, ``"learned"`` without ``max_len``, sizes that do
        not divide. TypeError: non-int sizes.
    """

    _causal = True

    def __init__(self, vocab_size: int, *, d_model: int, num_layers: int, num_heads: int,
                 position: str = "rope", num_kv_heads: int | None = None,
                 mlp_dim: int | None = None, max_len: int | None = None,
                 rope_base: float = 10000.0, t5_num_buckets: int = 32, t5_max_distance: int = 128,
                 shaw_max_distance: int = 16, implementation: str | None = None,
                 dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(vocab_size, d_model=d_model, num_layers=num_layers, num_heads=num_heads,
                         position=position, num_kv_heads=num_kv_heads, mlp_dim=mlp_dim,
                         max_len=max_len, rope_base=rope_base, t5_num_buckets=t5_num_buckets,
                         t5_max_distance=t5_max_distance, shaw_max_distance=shaw_max_distance,
                         implementation=implementation, dtype=dtype, param_dtype=param_dtype,
                         rngs=rngs)

    def __call__(self, tokens, *, positions=None, rope_scaling=None, implementation=None,
                 segment_ids=None) -> jax.Array:
        """Causal forward pass.

        Args:
          tokens: int ``[B, T]`` in ``[0, vocab_size)`` (concrete ids outside raise).
          positions: int ``[T]`` or ``[B, T]``, default ``arange(T)``; offsets, left
            padding and packing are all position arrays.
          rope_scaling: a :mod:`jaxpos.rope_scaling` dataclass applied for this call only;
            ``ValueError`` for a model whose position is not ``"rope"``.
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
        return tied_logits(h, self.embed.embedding[...])

    def init_cache(self, batch: int, max_len: int, dtype=None) -> tuple[KVCache, ...]:
        """One empty :class:`KVCache` per layer, ``max_len`` slots for ``batch`` rows."""
        return tuple(b.attn.init_cache(batch, max_len, dtype) for b in self.blocks)

    def decode_step(self, tokens, cache, *, positions=None, rope_scaling=None,
                    implementation=None):
        """Run ``tokens [B, T]`` (one or more new tokens per row) against the cache.

        ``positions`` default to each row's fill count ``+ arange(T)``; give them to put
        rows at different offsets. Returns ``(logits float32 [B, T, vocab_size], cache)``.
        Decoding a sequence token by token gives the logits of the full forward pass with
        the same positions, except with a length-dependent ``rope_scaling`` (dynamic NTK,
        LongRoPE): cached keys keep the rotation of the call that wrote them, as in Hugging
        Face's decoding (:func:`rotate_at_write`). Raises as :meth:`__call__`, and ``ValueError`` on concrete
        cache overflow (traced overflow gives NaN rows).
        """
        if not isinstance(cache, (tuple, list)) or len(cache) != self.num_layers:
            raise ValueError(f"cache must be a tuple of {self.num_layers} KVCache (from "
                             f"init_cache); got {type(cache).__name__}.")
        _checks.check_rank("tokens", tokens, (2,), "[batch, seq] token ids")
        B, T = _checks.shape_of(tokens)
        if positions is None:
            positions = cache[0].length[:, None] + jnp.arange(T, dtype=jnp.int32)
        pos = _checks.positions_2d("positions", positions, B, T)
        x = self._embed(tokens, pos)
        scheme = self._scheme(rope_scaling)
        impl = implementation or self.implementation
        new = []
        for block, c in zip(self.blocks, cache):
            x, c = block.decode(x, c, positions=pos, scheme=scheme, implementation=impl)
            new.append(c)
        h = rms_norm(x, self.final_norm.scale[...])
        return tied_logits(h, self.embed.embedding[...]), tuple(new)


class Encoder(_Stack):
    """A bidirectional encoder stack (no causal mask) with any position scheme.

    Arguments as :class:`DecoderLM` (default ``position="nope"``); relative schemes use
    their bidirectional forms (ALiBi ``-m|i - j|``, T5's two-sided buckets). There is no
    output head: the call returns the final-normalised hidden states.

    Call: ``tokens`` int ``[B, T]``; keywords ``positions``, ``mask`` (bool, broadcastable
    to ``[B, N, T, T]``, e.g. ``valid[:, None, None, :]`` for padding; the Pallas kernel
    takes no arbitrary mask, so on GPU/TPU express padding with ``segment_ids`` instead,
    e.g. 1 for real tokens and 0 for padding), ``segment_ids``, ``rope_scaling``,
    ``implementation``. Returns ``[B, T, d_model]`` in ``dtype``.
    """

    _causal = False

    def __init__(self, vocab_size: int, *, d_model: int, num_layers: int, num_heads: int,
                 position: str = "nope", num_kv_heads: int | None = None,
                 mlp_dim: int | None = None, max_len: int | None = None,
                 rope_base: float = 10000.0, t5_num_buckets: int = 32, t5_max_distance: int = 128,
                 shaw_max_distance: int = 16, implementation: str | None = None,
                 dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(vocab_size, d_model=d_model, num_layers=num_layers, num_heads=num_heads,
                         position=position, num_kv_heads=num_kv_heads, mlp_dim=mlp_dim,
                         max_len=max_len, rope_base=rope_base, t5_num_buckets=t5_num_buckets,
                         t5_max_distance=t5_max_distance, shaw_max_distance=shaw_max_distance,
                         implementation=implementation, dtype=dtype, param_dtype=param_dtype,
                         rngs=rngs)

    def __call__(self, tokens, *, positions=None, mask=None, segment_ids=None,
                 rope_scaling=None, implementation=None) -> jax.Array:
        return self._hidden(tokens, positions, rope_scaling, implementation, mask=mask,
                            segment_ids=segment_ids)
