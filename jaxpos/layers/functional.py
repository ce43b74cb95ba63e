"""Pure functions of the modules' model math on plain arrays (no parameters held here):
token embeddings and tied logits, projections to and from heads, RMSNorm, the MLP,
positions and input checks. Used by the ``*Core`` classes (:mod:`jaxpos.layers.cores`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpos import _checks
from jaxpos.sinusoidal import sinusoidal_pe

__all__ = [
    "attention_inputs",
    "check_attention_input",
    "check_tokens",
    "default_positions",
    "embed_tokens",
    "learned_table_init",
    "merge_heads",
    "mlp",
    "project_heads",
    "rms_norm",
    "sinusoidal_embedding",
    "tied_logits",
    "token_embedding_init",
]

def token_embedding_init(d_model: int):
    """``N(0, 1/d_model)``: the scaled embedding ``sqrt(d_model) * E[t]`` has unit variance."""
    return jax.nn.initializers.normal(stddev=d_model ** -0.5)


def learned_table_init():
    """``N(0, 1/2)``: the same per-entry variance as the sinusoidal table (sin^2, cos^2)."""
    return jax.nn.initializers.normal(stddev=math.sqrt(0.5))


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
