"""The KV cache of the modules (:mod:`jaxpos.nnx`, :mod:`jaxpos.linen`): the cache
pytree, empty caches, appending the new tokens' keys and values at each row's fill count,
and the scheme's ``cache_write`` (what the cache stores for the new tokens).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpos import _checks
from jaxpos.scheme import PositionScheme

__all__ = ["KVCache", "cache_token_count", "check_cache", "init_kv_cache", "poison_rows",
           "rotate_at_write", "update_kv_cache"]

class KVCache(NamedTuple):
    """The KV cache of one attention layer (a pytree; pass it through ``jit``).

    Attributes:
      k: ``[B, S, N_kv, H]`` keys as the scheme's ``cache_write`` stores them (raw for
        every built-in scheme but RoPE with a length-dependent scaling: RoPE is applied
        from ``positions`` inside :func:`jaxpos.attention` at every step).
      v: ``[B, S, N_kv, H]`` values.
      positions: int32 ``[B, S]`` position of each filled slot.
      length: int32 ``[B]`` number of filled slots per row; slots ``>= length`` are masked.
      valid: bool ``[B, S]``, True for a slot holding a token, False for an empty slot or
        one holding padding (a written ``attention_mask`` of 0): later steps mask it.
    """

    k: jax.Array
    v: jax.Array
    positions: jax.Array
    length: jax.Array
    valid: jax.Array


def init_kv_cache(batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype) -> KVCache:
    """An empty :class:`KVCache`: zeros ``[batch, max_len, num_kv_heads, head_dim]`` of
    ``dtype``, positions 0, fill counts 0, no valid slot. ``ValueError``/``TypeError`` for
    sizes that are not positive ints."""
    _checks.check_positive_int("batch", batch)
    _checks.check_positive_int("max_len", max_len)
    z = jnp.zeros((batch, max_len, num_kv_heads, head_dim), dtype)
    return KVCache(z, z, jnp.zeros((batch, max_len), jnp.int32), jnp.zeros((batch,), jnp.int32),
                   jnp.zeros((batch, max_len), bool))


def check_cache(cache, batch: int | None = None) -> KVCache:
    """``cache`` must be a :class:`KVCache` (from ``init_cache``) with ``batch`` rows when
    given. ``TypeError`` / ``ValueError`` (naming the cache's batch size) otherwise."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a jaxpos.nnx.KVCache (from init_cache); got "
                        f"{type(cache).__name__}.")
    B = cache.positions.shape[0]
    if batch is not None and batch != B:
        raise ValueError(f"the new tokens have batch size {batch} but the KV cache was made "
                         f"for batch size {B} (init_cache(batch={B}, ...)); decode the same "
                         f"rows the cache holds, or make a cache with init_cache({batch}, "
                         f"max_len).")
    return cache


def cache_token_count(cache: KVCache) -> jax.Array:
    """int32 ``[B, 1]``: the tokens (valid slots, padding excluded) a cache holds per row,
    the position of the next token in Hugging Face's convention."""
    return jnp.sum(cache.valid, axis=-1, keepdims=True, dtype=jnp.int32)


def update_kv_cache(cache: KVCache, k, v, positions, mask=None):
    """Append ``k, v`` ``[B, T, N_kv, H]`` at each row's fill count.

    ``mask`` (bool ``[B, T]``, True = token, False = padding; None = all tokens) is stored
    in ``valid``. Returns ``(cache, segment_ids, kv_segment_ids, overflow)``: the segment
    ids (int32 ``[B, T]``, 1 for a new token and 0 for new padding, and ``[B, S]``, 1 on
    slots holding a token, 0 on empty and padding slots) keep tokens away from empty and
    padding slots in every implementation, the Pallas kernel included (it takes no
    arbitrary mask); ``overflow`` bool ``[B]`` marks rows that ran past the cache.
    Concrete overflow raises ``ValueError``; traced overflow cannot raise, so the caller
    poisons those rows with NaN (writes past the end are dropped, never clamped onto
    other slots).
    """
    check_cache(cache)
    B, S = cache.positions.shape
    T = k.shape[1]
    if k.shape[0] != B or k.shape[2:] != cache.k.shape[2:]:
        raise ValueError(f"new keys {k.shape} do not fit the cache {cache.k.shape} "
                         f"(expected [{B}, T, {cache.k.shape[2]}, {cache.k.shape[3]}]).")
    if _checks.is_concrete(cache.length):
        end = np.asarray(cache.length) + T
        if (end > S).any():
            raise ValueError(f"KV cache overflow: writing {T} token(s) after "
                             f"{np.asarray(cache.length)} filled slot(s) needs "
                             f"{int(end.max())} slots; the cache holds max_len={S}. Create "
                             f"it with a larger init_cache(batch, max_len).")
    slots = cache.length[:, None] + jnp.arange(T, dtype=jnp.int32)  # [B, T]
    rows = jnp.arange(B, dtype=jnp.int32)[:, None]
    pos = jnp.broadcast_to(positions, (B, T)).astype(jnp.int32)
    mask = jnp.ones((B, T), bool) if mask is None else jnp.asarray(mask, bool)
    new = KVCache(
        cache.k.at[rows, slots].set(k.astype(cache.k.dtype), mode="drop"),
        cache.v.at[rows, slots].set(v.astype(cache.v.dtype), mode="drop"),
        cache.positions.at[rows, slots].set(pos, mode="drop"),
        cache.length + T,
        cache.valid.at[rows, slots].set(mask, mode="drop"),
    )
    return new, mask.astype(jnp.int32), new.valid.astype(jnp.int32), new.length > S


def poison_rows(x, overflow):
    """NaN for batch rows where ``overflow`` is True (traced KV-cache overflow)."""
    return jnp.where(overflow.reshape((-1,) + (1,) * (x.ndim - 1)), jnp.array(jnp.nan, x.dtype), x)


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
