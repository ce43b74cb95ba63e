"""The KV cache of the modules (:mod:`jaxpos.nnx`, :mod:`jaxpos.linen`): the cache
pytree, empty caches, appending the new tokens' keys and values at each row's fill count,
and the scheme's ``cache_write`` (what the cache stores for the new tokens).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpos import _checks
from jaxpos.schemes.base import PositionScheme

__all__ = ["KVCache", "StreamingKVCache", "cache_token_count", "check_cache", "init_kv_cache",
           "init_streaming_cache", "poison_rows", "rotate_at_write", "streaming_ranks",
           "update_kv_cache", "update_streaming_cache"]

class KVCache(NamedTuple):
    """The KV cache of one attention layer (a pytree; pass it through ``jit``).

    Attributes:
      k: ``[B, S, N_kv, H]`` keys as the scheme's ``cache_write`` stores them: RoPE keys
        rotated once, when written (raw with ``cache_rotation="read"``, rotated on load
        at every step); raw for the other built-in schemes, applied inside
        :func:`jaxpos.attention` from ``positions``.
      v: ``[B, S, N_kv, H]`` values.
      positions: int32 ``[B, S]`` position of each filled slot.
      length: int32 ``[B]`` number of filled slots per row; slots ``>= length`` are never
        visited (passed to :func:`jaxpos.attention` as ``kv_lengths``: a step costs the
        filled length, not ``S``).
      valid: int32 ``[B, S]``, 1 for a slot holding a token, 0 for an empty slot or one
        holding padding (a written ``attention_mask`` of 0): later steps mask it (it is
        the keys' segment ids as stored, so a step makes no pass over it).
      tokens: int32 ``[B]`` tokens held per row (padding excluded), kept at write so a
        step needs no count over the cache.
    """

    k: jax.Array
    v: jax.Array
    positions: jax.Array
    length: jax.Array
    valid: jax.Array
    tokens: jax.Array


def init_kv_cache(batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype) -> KVCache:
    """An empty :class:`KVCache`: zeros ``[batch, max_len, num_kv_heads, head_dim]`` of
    ``dtype``, positions 0, fill counts 0, no valid slot. ``ValueError``/``TypeError`` for
    sizes that are not positive ints."""
    _checks.check_positive_int("batch", batch)
    _checks.check_positive_int("max_len", max_len)
    shape = (batch, max_len, num_kv_heads, head_dim)
    # distinct buffers for every field, so a jitted step may donate the cache
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                   jnp.zeros((batch, max_len), jnp.int32), jnp.zeros((batch,), jnp.int32),
                   jnp.zeros((batch, max_len), jnp.int32), jnp.zeros((batch,), jnp.int32))


def check_cache(cache, batch: int | None = None) -> KVCache | StreamingKVCache:
    """``cache`` must be a :class:`KVCache` (from ``init_cache``) with ``batch`` rows when
    given. ``TypeError`` / ``ValueError`` (naming the cache's batch size) otherwise."""
    if not isinstance(cache, (KVCache, StreamingKVCache)):
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
    return cache.tokens[:, None]


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
        cache.valid.at[rows, slots].set(mask.astype(jnp.int32), mode="drop"),
        cache.tokens + jnp.sum(mask, axis=-1, dtype=jnp.int32),
    )
    return new, mask.astype(jnp.int32), new.valid, new.length > S


def poison_rows(x, overflow):
    """NaN for batch rows where ``overflow`` is True (traced KV-cache overflow)."""
    return jnp.where(overflow.reshape((-1,) + (1,) * (x.ndim - 1)), jnp.array(jnp.nan, x.dtype), x)


def rotate_at_write(scheme, q, k, positions):
    """``scheme.cache_write(q, k, positions)`` (:meth:`jaxpos.PositionScheme.cache_write`):
    what a KV cache stores for the new tokens and the scheme that reads it.

    For RoPE that rotates ``q`` and ``k`` here, with the frequencies of this call (fixed,
    or from ``max(positions) + 1`` for a length-dependent scaling), and returns
    :class:`jaxpos.NoPE` for the attention call: a decode step rotates the new tokens only,
    and with dynamic NTK / LongRoPE each cached key keeps the rotation of the call that
    wrote it: Hugging Face's decoding (its cache holds rotated keys;
    ``dynamic_rope_update``), which jaxpos's Llama port matches step by step. With
    ``RoPE(cache_rotation="read")`` the keys stay raw and the scheme is returned (the
    modules rotate every cached key on load with the current frequencies). The other
    built-in schemes return the inputs and themselves, applied inside attention (and
    inside the fused kernel) from the cached positions. Dynamic NTK: bloc97 2023 / HF
    ``_compute_dynamic_ntk_parameters``; LongRoPE: Ding et al. 2024, §3.

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


# ------------------------------------------------------------- StreamingLLM cache
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StreamingKVCache:
    """A StreamingLLM KV cache (Xiao et al. 2024, "Efficient Streaming Language Models with
    Attention Sinks", §3.2): the first ``keep_first`` tokens (the attention sinks) stay, the
    other ``S - keep_first`` slots are a ring buffer of the most recent tokens, so
    generation runs unboundedly in a fixed ``[B, S, N_kv, H]``.

    Positions are places in the cache, not in the text (§3.2): the kept tokens, in order,
    are at ``0 .. count - 1``, so the sinks sit at ``0 .. keep_first - 1`` and the newest
    token at the last place; keys are stored raw and RoPE rotates them at read with these
    positions (:func:`jaxpos.schemes.rope.tables.rope_tables`), as the paper caches keys before the
    rotation. A pytree (``keep_first`` is static).

    Attributes:
      k, v: ``[B, S, N_kv, H]`` raw keys and values.
      positions: int32 ``[B, S]`` index in the text of the token in each slot.
      length: int32 ``[B]`` filled slots (``min(written, S)``).
      valid: int32 ``[B, S]`` 1 for a slot holding a token, 0 for padding or empty.
      tokens: int32 ``[B]`` tokens written so far (padding excluded), evicted ones included.
      written: int32 ``[B]`` slots written so far (padding included), evicted ones included.
      keep_first: the number of sink tokens kept.
    """

    k: jax.Array
    v: jax.Array
    positions: jax.Array
    length: jax.Array
    valid: jax.Array
    tokens: jax.Array
    written: jax.Array
    keep_first: int = dataclasses.field(metadata={"static": True})


def init_streaming_cache(batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype,
                         keep_first: int) -> StreamingKVCache:
    """An empty :class:`StreamingKVCache` of ``max_len`` slots keeping ``keep_first`` sinks.

    Raises:
      ValueError / TypeError: sizes that are not positive ints; ``keep_first`` not an int in
        ``[0, max_len)`` (at least one ring slot is needed).
    """
    c = init_kv_cache(batch, max_len, num_kv_heads, head_dim, dtype)
    if isinstance(keep_first, bool) or not isinstance(keep_first, (int, np.integer)):
        raise TypeError(f"keep_first must be an int (the attention sinks kept); got "
                        f"{type(keep_first).__name__} {keep_first!r}.")
    if not 0 <= keep_first < max_len:
        raise ValueError(f"keep_first must be in [0, max_len={max_len}) (the cache needs at "
                         f"least one slot for recent tokens); got {keep_first}.")
    return StreamingKVCache(c.k, c.v, c.positions, c.length, c.valid, c.tokens,
                            jnp.zeros((batch,), jnp.int32), int(keep_first))


def streaming_ranks(written, S: int, keep_first: int):
    """Place in the cache (StreamingLLM's position) of each slot after ``written`` [B]
    slots were written: int32 ``[B, S]``. Sinks are at their slot; the ring's oldest held
    token is at ``keep_first``, the newest at ``min(written, S) - 1``; empty slots (only
    before the ring wraps) keep their slot index."""
    k, W = keep_first, S - keep_first
    s = jnp.arange(S, dtype=jnp.int32)[None, :]
    n = written[:, None]
    held = jnp.minimum(jnp.maximum(n - k, 0), W)  # ring tokens held
    oldest = k + jnp.mod(n - held - k, W)  # slot of the oldest held ring token
    ring = k + jnp.mod(s - oldest, W)
    return jnp.where(s < k, s, jnp.where(n - k >= W, ring, s))


def update_streaming_cache(cache: StreamingKVCache, k, v, positions, mask=None):
    """Write ``k, v`` ``[B, T, N_kv, H]`` into a :class:`StreamingKVCache`: token ``i`` of
    the row's text goes to slot ``i`` while ``i < keep_first``, else to the ring slot
    ``keep_first + (i - keep_first) mod (S - keep_first)``, overwriting the oldest recent
    token.

    Returns ``(cache, segment_ids [B, T], kv_segment_ids [B, S], q_places [B, T],
    kv_places [B, S], evicting [B])``: the places in the cache (:func:`streaming_ranks`)
    are the positions attention uses; ``evicting`` (bool) marks rows whose step of several
    tokens evicts keys its own queries need: concrete ones raise, traced ones cannot, so
    the caller poisons those rows with NaN (:func:`poison_rows`), as for KV-cache overflow.

    Raises:
      ValueError: ``T`` larger than the ring (``S - keep_first``), or (concrete) a step of
        several tokens that evicts tokens: each of its queries would need keys that later
        tokens of the same step overwrite; feed such tokens one step at a time.
    """
    B, S = cache.positions.shape
    T = k.shape[1]
    kf, W = cache.keep_first, S - cache.keep_first
    if k.shape[0] != B or k.shape[2:] != cache.k.shape[2:]:
        raise ValueError(f"new keys {k.shape} do not fit the cache {cache.k.shape} "
                         f"(expected [{B}, T, {cache.k.shape[2]}, {cache.k.shape[3]}]).")
    if T > 1 and _checks.is_concrete(cache.written):
        end = np.asarray(cache.written) + T
        if (end > S).any():
            raise ValueError(f"a streaming cache step of {T} tokens after "
                             f"{np.asarray(cache.written)} written would evict tokens that "
                             f"its own queries need (max_len={S}); write at most "
                             f"{int(S - np.asarray(cache.written).max())} tokens at once, "
                             f"then one token per step.")
    idx = cache.written[:, None] + jnp.arange(T, dtype=jnp.int32)  # [B, T] in the text
    slots = jnp.where(idx < kf, idx, kf + jnp.mod(idx - kf, max(W, 1)))
    rows = jnp.arange(B, dtype=jnp.int32)[:, None]
    pos = jnp.broadcast_to(positions, (B, T)).astype(jnp.int32)
    mask = jnp.ones((B, T), bool) if mask is None else jnp.asarray(mask, bool)
    written = cache.written + T
    new = StreamingKVCache(
        cache.k.at[rows, slots].set(k.astype(cache.k.dtype), mode="drop"),
        cache.v.at[rows, slots].set(v.astype(cache.v.dtype), mode="drop"),
        cache.positions.at[rows, slots].set(pos, mode="drop"),
        jnp.minimum(written, S),
        cache.valid.at[rows, slots].set(mask.astype(jnp.int32), mode="drop"),
        cache.tokens + jnp.sum(mask, axis=-1, dtype=jnp.int32),
        written,
        kf,
    )
    kv_places = streaming_ranks(written, S, kf)
    q_places = jnp.take_along_axis(kv_places, slots, axis=1)
    evicting = (written > S) if T > 1 else jnp.zeros((B,), bool)
    return new, mask.astype(jnp.int32), new.valid, q_places, kv_places, evicting
