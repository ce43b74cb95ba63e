"""Pure functions of the modules' model math on plain arrays (no parameters held here):
token embeddings and tied logits, projections to and from heads, RMSNorm, the MLP,
positions and input checks. Used by the ``*Core`` classes (:mod:`jaxpos.layers.cores`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from jaxpos import _checks
from jaxpos.schemes.sinusoidal import sinusoidal_pe

__all__ = [
    "PAD_POSITION",
    "BIAS_INIT",
    "KERNEL_INIT",
    "attention_inputs",
    "check_attention_mask",
    "check_attention_input",
    "check_tokens",
    "default_positions",
    "embed_tokens",
    "learned_table_init",
    "linear_params",
    "merge_heads",
    "fill_hidden_positions",
    "mlp",
    "norm_params",
    "padding_segment_ids",
    "positions_from_mask",
    "project_heads",
    "rms_norm",
    "sinusoidal_embedding",
    "tied_logits",
    "token_embedding_init",
    "visible_top",
]

def token_embedding_init(d_model: int) -> Callable[..., jax.Array]:
    """``N(0, 1/d_model)``: the scaled embedding ``sqrt(d_model) * E[t]`` has unit variance."""
    return jax.nn.initializers.normal(stddev=d_model ** -0.5)


def learned_table_init() -> Callable[..., jax.Array]:
    """``N(0, 1/2)``: the same per-entry variance as the sinusoidal table (sin^2, cos^2)."""
    return jax.nn.initializers.normal(stddev=math.sqrt(0.5))


def check_tokens(tokens: ArrayLike, vocab_size: int) -> jax.Array:
    """int ``[B, T]`` token ids; concrete ids outside ``[0, vocab_size)``, negative ones
    included, raise ``ValueError`` (a gather would otherwise fill or wrap them silently).
    Traced ids cannot be inspected: :func:`embed_tokens` gives them NaN rows."""
    _checks.check_rank("tokens", tokens, (2,), "[batch, seq] token ids")
    dt = _checks.dtype_of(tokens)
    if not jnp.issubdtype(dt, jnp.integer):
        raise TypeError(f"tokens must be integer token ids; got dtype {dt}.")
    if _checks.is_concrete(tokens):
        t = np.asarray(tokens)
        if t.size and (t.min() < 0 or t.max() >= vocab_size):
            raise ValueError(f"tokens must lie in [0, vocab_size={vocab_size}); got values from "
                             f"{t.min()} to {t.max()}.")
    tokens = jnp.asarray(tokens)
    if tokens.dtype.itemsize > 4:  # 64-bit ids (x64 mode): out of range before the int32 cast
        tokens = jnp.clip(tokens, -1, vocab_size)  # would wrap; -1 and vocab_size give NaN rows
    return tokens.astype(jnp.int32)


def embed_tokens(embedding: ArrayLike, tokens: jax.Array, d_model: int,
                 dtype: DTypeLike) -> jax.Array:
    """``sqrt(d_model) * embedding[tokens]``: ``[..., d_model]`` in ``dtype`` for int ids
    ``[...]``. An id outside ``[0, vocab_size)``, negative or ``>= vocab_size``, gives a
    NaN row (under ``jit``, where :func:`check_tokens` cannot see the values): never
    another token's row (``jnp.take`` would read ``-1`` as the last row)."""
    table = jnp.asarray(embedding)
    tokens = jnp.asarray(tokens)
    # jnp.take wraps negative ids NumPy-style before mode="fill" applies: send them past
    # the table, where the fill catches them like ids >= vocab_size
    tokens = jnp.where(tokens < 0, table.shape[0], tokens)
    rows = jnp.take(table, tokens, axis=0, mode="fill", fill_value=jnp.nan)
    return (rows * jnp.float32(math.sqrt(d_model))).astype(dtype)


def tied_logits(h: jax.Array, embedding: ArrayLike) -> jax.Array:
    """float32 logits ``h @ embedding^T`` (weights tied to the input embedding)."""
    return jnp.einsum("btd,vd->btv", h.astype(jnp.float32), jnp.asarray(embedding, jnp.float32))


def sinusoidal_embedding(positions: ArrayLike, d_model: int, base: float, layout: str,
                         dtype: DTypeLike) -> jax.Array:
    """:func:`jaxpos.sinusoidal_pe` rows at arbitrary integer positions ``[..., T]``."""
    _checks.check_integer_positions("positions", positions)
    pos = jnp.asarray(positions, jnp.int32)
    rows = sinusoidal_pe(1, d_model, base, offset=pos.reshape(-1), layout=layout, dtype=dtype)
    return rows.reshape(pos.shape + (d_model,))


def default_positions(tokens_shape: tuple[int, ...], positions: ArrayLike | None,
                      name: str = "positions") -> jax.Array:
    """``positions`` validated to int32 ``[B|1, T]`` (``arange(T)`` when ``None``); errors
    name the argument ``name``."""
    B, T = tokens_shape
    if positions is None:
        positions = jnp.arange(T, dtype=jnp.int32)
    return _checks.positions_2d(name, positions, B, T)


def project_heads(x: jax.Array, kernel: ArrayLike, num_heads: int, head_dim: int,
                  dtype: DTypeLike, bias: ArrayLike | None = None) -> jax.Array:
    """``x [B, T, D] @ kernel [D, num_heads * head_dim] (+ bias)`` ->
    ``[B, T, num_heads, head_dim]``."""
    y = jnp.einsum("btd,de->bte", x.astype(dtype), jnp.asarray(kernel, dtype))
    if bias is not None:
        y = y + jnp.asarray(bias, dtype)
    return y.reshape(x.shape[:2] + (num_heads, head_dim))


def merge_heads(o: jax.Array, kernel: ArrayLike, dtype: DTypeLike,
                bias: ArrayLike | None = None) -> jax.Array:
    """``o [B, T, N, H]`` -> ``[B, T, N * H] @ kernel [N * H, D] (+ bias)``."""
    y = jnp.einsum("bte,ed->btd", o.reshape(o.shape[:2] + (-1,)).astype(dtype),
                   jnp.asarray(kernel, dtype))
    return y if bias is None else y + jnp.asarray(bias, dtype)


def check_attention_input(name: str, x: Any, d_model: int, batch: int | None = None) -> None:
    """``x`` must be ``[B, T, d_model]`` (and have ``batch`` rows when given)."""
    _checks.check_rank(name, x, (3,), "[batch, seq, d_model]")
    if x.shape[-1] != d_model:
        raise ValueError(f"{name} must have shape [B, T, d_model={d_model}]; got {x.shape}.")
    if batch is not None and x.shape[0] != batch:
        raise ValueError(f"{name} must have the batch size of x ({batch}); got {x.shape}.")


def attention_inputs(x: jax.Array, context: jax.Array | None, positions: ArrayLike | None,
                     kv_positions: ArrayLike | None, kv_segment_ids: ArrayLike | None,
                     d_model: int) -> tuple[jax.Array, jax.Array]:
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


def rms_norm(x: jax.Array, scale: ArrayLike, eps: float = 1e-6, *,
             offset: bool = False) -> jax.Array:
    """RMSNorm (Zhang & Sennrich 2019), statistics in float32, cast back to ``x``'s dtype.

    ``x``: ``[..., D]``; ``scale``: ``[D]``, multiplied as ``scale`` or, with ``offset``,
    as ``1 + scale`` (Gemma's form: the weight is stored as an offset from 1, initialised
    to zeros; Hugging Face ``Gemma3RMSNorm``, ``Qwen3NextRMSNorm``). Raises ``ValueError``
    when the widths differ (the first thing a block does, so a wrong-width input is named
    here, not as an anonymous broadcasting error)."""
    if np.shape(x)[-1:] != np.shape(scale)[-1:]:
        raise ValueError(f"x must have shape [..., d_model={np.shape(scale)[-1]}]; "
                         f"got {np.shape(x)}.")
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    w = jnp.asarray(scale, jnp.float32)
    return (y * (1.0 + w if offset else w)).astype(x.dtype)


#: Initialisers of a projection, those of :class:`flax.nnx.Linear`: LeCun normal kernel,
#: zero bias.
KERNEL_INIT = jax.nn.initializers.lecun_normal()
BIAS_INIT = jax.nn.initializers.zeros


def linear_params(in_features: int, out_features: int, use_bias: bool) -> tuple:
    """The parameter table of a projection (:class:`flax.nnx.Linear`'s names and
    initialisers): ``(("kernel", init, (in, out)), ("bias", init or None, (out,)))``, the
    bias's init None without ``use_bias``."""
    return (("kernel", KERNEL_INIT, (in_features, out_features)),
            ("bias", BIAS_INIT if use_bias else None, (out_features,)))


def norm_params(features: int, offset: bool = False) -> tuple:
    """The parameter table of an RMSNorm: ``(("scale", init, (features,)),)``, ones (as
    :class:`flax.nnx.RMSNorm`) or, for the ``1 + scale`` form (:func:`rms_norm`'s
    ``offset``), zeros."""
    init = jax.nn.initializers.zeros if offset else jax.nn.initializers.ones
    return (("scale", init, (features,)),)


def mlp(x: jax.Array, w_in: ArrayLike, w_out: ArrayLike, dtype: DTypeLike) -> jax.Array:
    """``gelu(x W_in) W_out`` (tanh approximation)."""
    h = jax.nn.gelu(jnp.einsum("btd,df->btf", x.astype(dtype), jnp.asarray(w_in, dtype)))
    return jnp.einsum("btf,fd->btd", h, jnp.asarray(w_out, dtype))


# ------------------------------------------------------------------ padding masks
# Hugging Face's convention: attention_mask [B, T], 1 = token, 0 = padding.

#: The position Hugging Face gives padding tokens (``position_ids.masked_fill_(
#: attention_mask == 0, 1)`` in ``GenerationMixin.prepare_inputs_for_generation``).
PAD_POSITION = 1


def check_attention_mask(attention_mask: ArrayLike | None, batch: int,
                         length: int) -> jax.Array | None:
    """``attention_mask`` (Hugging Face's padding mask) as bool ``[batch, length]``, True
    for a token and False for padding; None stays None.

    Args:
      attention_mask: bool or integer ``[B, T]`` of 1 (token) and 0 (padding), or None.
      batch, length: the tokens' ``B`` and ``T``.

    Raises:
      TypeError: a float (or other non-integer, non-bool) dtype.
      ValueError: a shape other than ``[batch, length]``; concrete values other than 0/1.
    """
    if attention_mask is None:
        return None
    shp = _checks.shape_of(attention_mask)
    if shp != (batch, length):
        raise ValueError(f"attention_mask must have shape [B, T] = [{batch}, {length}] (1 for a "
                         f"token, 0 for padding, as in Hugging Face); got shape {shp}.")
    dt = _checks.dtype_of(attention_mask)
    if dt != np.bool_ and not np.issubdtype(dt, np.integer):
        raise TypeError(f"attention_mask must be bool or integer (1 for a token, 0 for "
                        f"padding); got dtype {dt}.")
    if _checks.is_concrete(attention_mask) and dt != np.bool_:
        vals = np.unique(np.asarray(attention_mask))
        if not set(vals.tolist()) <= {0, 1}:
            raise ValueError(f"attention_mask must hold 1 (token) and 0 (padding) only; got "
                             f"values {vals.tolist()}.")
    return jnp.asarray(attention_mask) != 0


def positions_from_mask(mask: ArrayLike, start: ArrayLike = 0) -> jax.Array:
    """Hugging Face's positions for a padded batch: ``start + cumsum(mask) - 1`` for
    tokens (the ``i``-th token of a row at ``start + i``), :data:`PAD_POSITION` for padding
    (``GenerationMixin.prepare_inputs_for_generation``).

    Args:
      mask: bool ``[B, T]`` (True = token). start: int ``[B, 1]`` or scalar, the number of
        tokens before these (those held by a KV cache).

    Returns:
      int32 ``[B, T]``.
    """
    pos = jnp.asarray(start, jnp.int32) + jnp.cumsum(mask, axis=-1, dtype=jnp.int32) - 1
    return jnp.where(mask, pos, jnp.int32(PAD_POSITION))


def padding_segment_ids(mask: jax.Array, segment_ids: ArrayLike | None = None) -> jax.Array:
    """Segment ids that keep tokens and padding apart: int32 ``[B, T]``, ``mask`` as 1/0
    when ``segment_ids`` is None, else ``segment_ids`` on tokens and ``min(segment_ids) - 1``
    (an id no token has) on padding. Only equal ids attend (:func:`jaxpos.attention`), so a
    token never sees padding, and padding sees only padding (its rows stay finite)."""
    if segment_ids is None:
        return mask.astype(jnp.int32)
    seg = jnp.asarray(segment_ids, jnp.int32)
    return jnp.where(mask, seg, jnp.min(seg) - 1)


def visible_top(positions: ArrayLike, visible: jax.Array) -> jax.Array:
    """int32 ``[B, 1]``: each row's largest position where ``visible`` (bool ``[B, S]``) is
    True, 0 for a row with none."""
    low = jnp.iinfo(jnp.int32).min
    top = jnp.max(jnp.where(visible, jnp.asarray(positions, jnp.int32), low), axis=-1,
                  keepdims=True)
    return jnp.where(top == low, 0, top)


def fill_hidden_positions(positions: ArrayLike, visible: jax.Array,
                          top: jax.Array | None = None) -> jax.Array:
    """``positions`` int32 ``[B|1, S]`` with every slot where ``visible`` (bool ``[B, S]``)
    is False replaced by ``top`` (int32 ``[B, 1]``; default :func:`visible_top`, the row's
    largest visible position).

    A slot no token sees (padding, an empty KV-cache slot) changes no token's output, but
    its position still enters functions of the whole call such as xPos's centre (the
    midpoint of the call's positions; Sun et al. 2022, §3): an empty slot at position 0
    beside tokens at 1e5 would move that centre 5e4 away and overflow xPos's float32
    scales. Filled with a visible position, such slots keep the call's positions within
    the range of its tokens'. Returns int32 ``[B, S]``."""
    if top is None:
        top = visible_top(positions, visible)
    return jnp.where(visible, jnp.asarray(positions, jnp.int32), top)
