"""The StreamingLLM KV cache (Xiao et al. 2024, "Efficient Streaming Language Models with
Attention Sinks", §3.2): each row keeps its first ``keep_first`` tokens (the attention
sinks) and a ring buffer of its most recent ones; attention sees places in the cache."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxpos import _checks
from jaxpos.layers.cache.base import (
    Cache,
    CacheRead,
    read_positions,
    rotate_at_write,
    rotates_on_load,
)
from jaxpos.layers.cache.dense import check_new_keys, init_kv_cache
from jaxpos.schemes.base import PositionScheme

__all__ = ["StreamingKVCache", "init_streaming_cache", "place_order", "streaming_ranks",
           "update_streaming_cache"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StreamingKVCache(Cache):
    """A StreamingLLM KV cache (Xiao et al. 2024, "Efficient Streaming Language Models with
    Attention Sinks", §3.2): the first ``keep_first`` tokens of each row (the attention
    sinks) stay, the other ``S - keep_first`` slots are a ring buffer of the row's most
    recent tokens, so generation runs unboundedly in a fixed ``[B, S, N_kv, H]``.

    Only tokens take slots: padding (an ``attention_mask`` of 0, e.g. a left-padded
    prompt) is never stored, so the sinks are each row's first ``keep_first`` *tokens*.
    Positions are places in the cache, not in the text (§3.2): the kept tokens of a row,
    in order, are at ``0 .. count - 1``, so the sinks sit at ``0 .. keep_first - 1`` and
    the newest token at the last place; RoPE keys are stored raw and rotated on load with
    these places, as the paper caches keys before the rotation. A pytree (``keep_first``
    is static).

    Attributes:
      k, v: ``[B, S, N_kv, H]`` keys (raw for RoPE) and values.
      positions: int32 ``[B, S]`` position in the text of the token in each slot.
      length: int32 ``[B]`` filled slots (``min(tokens, S)``).
      valid: int32 ``[B, S]`` 1 for a slot holding a token, 0 for an empty one.
      tokens: int32 ``[B]`` tokens written so far (padding excluded), evicted ones included.
      keep_first: the number of sink tokens kept.
    """

    k: jax.Array
    v: jax.Array
    positions: jax.Array
    length: jax.Array
    valid: jax.Array
    tokens: jax.Array
    keep_first: int = dataclasses.field(metadata={"static": True})

    #: attention sees places in the cache, not the text's positions
    text_positions = False

    @property
    def batch_size(self) -> int:
        """``B``."""
        return self.positions.shape[0]

    def token_count(self) -> jax.Array:
        """int32 ``[B, 1]`` tokens written per row (padding excluded, evicted included)."""
        return self.tokens[:, None]

    def write(self, scheme: PositionScheme, q: jax.Array, k: jax.Array, v: jax.Array,
              positions: jax.Array, mask: jax.Array | None
              ) -> tuple[StreamingKVCache, CacheRead]:
        """:meth:`jaxpos.layers.cache.Cache.write` (:func:`update_streaming_cache`): read at
        places in the cache; a scheme that rotates on load (RoPE) stores raw keys and
        rotates them with the places, others store their ``cache_write``. A scheme that
        replaces softmax attention (``replaces_softmax``: stick-breaking, whose weights
        follow the order of the keys along their axis) reads the keys in place order (a
        gather of the cache per step); softmax attention reads them in slot order, since
        it depends on the keys' positions, not on their order."""
        on_load = rotates_on_load(scheme)
        if not on_load:
            q, k, scheme = rotate_at_write(scheme, q, k, positions)
        new, seg, q_pos, kv_pos, evicting = update_streaming_cache(self, k, v, positions, mask)
        ck, cv, valid = new.k, new.v, new.valid
        if getattr(scheme, "replaces_softmax", False):
            order = place_order(kv_pos)
            ck, cv, valid, kv_pos = (jnp.take_along_axis(a, order.reshape(order.shape + (1,)
                                                                          * (a.ndim - 2)), 1)
                                     for a in (ck, cv, valid, kv_pos))
        scheme, q_pos, kv_pos, tables = read_positions(scheme, q_pos, kv_pos, valid,
                                                       mask, on_load=on_load)
        return new, CacheRead(q, ck, cv, scheme, q_pos, kv_pos, seg, valid, new.length,
                              evicting, tables)


def init_streaming_cache(batch: int, max_len: int, num_kv_heads: int, head_dim: int,
                         dtype: jnp.dtype | type | str | None,
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
                            int(keep_first))


def streaming_ranks(written: jax.Array, S: int, keep_first: int) -> jax.Array:
    """Place in the cache (StreamingLLM's position) of each slot after ``written`` [B]
    tokens were written: int32 ``[B, S]``. Sinks are at their slot; the ring's oldest held
    token is at ``keep_first``, the newest at ``min(written, S) - 1``; empty slots (only
    before the ring wraps) keep their slot index."""
    k, W = keep_first, S - keep_first
    s = jnp.arange(S, dtype=jnp.int32)[None, :]
    n = written[:, None]
    held = jnp.minimum(jnp.maximum(n - k, 0), W)  # ring tokens held
    oldest = k + jnp.mod(n - held - k, W)  # slot of the oldest held ring token
    ring = k + jnp.mod(s - oldest, W)
    return jnp.where(s < k, s, jnp.where(n - k >= W, ring, s))


def place_order(places: jax.Array) -> jax.Array:
    """The inverse of a permutation of slots to places (:func:`streaming_ranks`): int32
    ``[B, S]``, ``order[b, r]`` is the slot holding place ``r``."""
    B, S = places.shape
    rows = jnp.arange(B, dtype=jnp.int32)[:, None]
    return jnp.zeros((B, S), jnp.int32).at[rows, places].set(
        jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S)))


def _check_no_evicting_step(cache: StreamingKVCache, mask: jax.Array, S: int) -> None:
    """A concrete step of several tokens must not evict (its queries need every key)."""
    if not (_checks.is_concrete(cache.tokens) and _checks.is_concrete(mask)):
        return
    n = np.asarray(mask).sum(-1)
    end = np.asarray(cache.tokens) + n
    if ((n > 1) & (end > S)).any():
        raise ValueError(f"a streaming cache step of {int(n.max())} tokens after "
                         f"{np.asarray(cache.tokens)} held would evict tokens that its own "
                         f"queries need (max_len={S}); write at most "
                         f"{int(S - np.asarray(cache.tokens).max())} tokens at once, then "
                         f"one token per step.")


def update_streaming_cache(cache: StreamingKVCache, k: jax.Array, v: jax.Array,
                           positions: jax.Array, mask: jax.Array | None = None
                           ) -> tuple[StreamingKVCache, jax.Array, jax.Array, jax.Array,
                                      jax.Array]:
    """Write the tokens of ``k, v`` ``[B, T, N_kv, H]`` into a :class:`StreamingKVCache`:
    the row's ``i``-th token (padding not counted) goes to slot ``i`` while
    ``i < keep_first``, else to the ring slot ``keep_first + (i - keep_first) mod
    (S - keep_first)``, overwriting the oldest recent token. Padding (``mask`` False) is
    not stored.

    Returns ``(cache, segment_ids [B, T], q_places [B, T], kv_places [B, S], evicting
    [B])``: the places in the cache (:func:`streaming_ranks`) are the positions attention
    uses (padding's place is 0; its segment id 0 hides it); ``evicting`` (bool) marks rows
    whose step of several tokens evicts keys its own queries need: concrete ones raise,
    traced ones cannot, so the caller poisons those rows with NaN
    (:func:`jaxpos.layers.cache.poison_rows`), as for KV-cache overflow.

    Raises:
      ValueError: new keys that do not fit the cache, or (concrete) a step of several
        tokens that evicts tokens: each of its queries would need keys that later tokens
        of the same step overwrite; feed such tokens one step at a time.
    """
    B, S = cache.positions.shape
    T = k.shape[1]
    kf, W = cache.keep_first, S - cache.keep_first
    check_new_keys(k, cache.k)
    mask = jnp.ones((B, T), bool) if mask is None else jnp.asarray(mask, bool)
    _check_no_evicting_step(cache, mask, S)
    idx = cache.tokens[:, None] + jnp.cumsum(mask, axis=-1, dtype=jnp.int32) - 1  # in text
    slots = jnp.where(mask, jnp.where(idx < kf, idx, kf + jnp.mod(idx - kf, W)), S)
    rows = jnp.arange(B, dtype=jnp.int32)[:, None]
    pos = jnp.broadcast_to(positions, (B, T)).astype(jnp.int32)
    n_new = jnp.sum(mask, axis=-1, dtype=jnp.int32)
    tokens = cache.tokens + n_new
    new = StreamingKVCache(
        cache.k.at[rows, slots].set(k.astype(cache.k.dtype), mode="drop"),
        cache.v.at[rows, slots].set(v.astype(cache.v.dtype), mode="drop"),
        cache.positions.at[rows, slots].set(pos, mode="drop"),
        jnp.minimum(tokens, S),
        cache.valid.at[rows, slots].set(1, mode="drop"),
        tokens,
        kf,
    )
    kv_places = streaming_ranks(tokens, S, kf)
    q_places = jnp.where(mask, jnp.take_along_axis(kv_places, jnp.minimum(slots, S - 1),
                                                   axis=1), 0)
    evicting = (n_new > 1) & (tokens > S)
    return new, mask.astype(jnp.int32), q_places, kv_places, evicting
