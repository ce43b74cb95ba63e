"""The dense KV cache: ``[B, max_len]`` slots per row, the new tokens appended at each
row's fill count (padding stored as invisible slots)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpos import _checks
from jaxpos._util import over_blocks
from jaxpos.layers.cache.base import (
    Cache,
    CacheRead,
    read_positions,
    rotate_at_write,
    rotates_on_load,
)
from jaxpos.schemes.base import PositionScheme

__all__ = ["KEY_BLOCK", "KVCache", "check_new_keys", "init_kv_cache", "update_kv_cache"]

#: slots :meth:`KVCache.update_keys` moves at a time
KEY_BLOCK = 256


class _KVCacheFields(NamedTuple):
    k: jax.Array
    v: jax.Array
    positions: jax.Array
    length: jax.Array
    valid: jax.Array
    tokens: jax.Array


class KVCache(_KVCacheFields, Cache):
    """The KV cache of one attention layer (a pytree, a NamedTuple: pass it through
    ``jit``, donate it, ``_replace`` its fields).

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

    __slots__ = ()

    @property
    def batch_size(self) -> int:
        """``B``."""
        return self.positions.shape[0]

    def token_count(self) -> jax.Array:
        """int32 ``[B, 1]`` tokens held per row (padding excluded)."""
        return self.tokens[:, None]

    @property
    def slots_per_row(self) -> int:
        """``max_len``."""
        return self.k.shape[1]

    def update_keys(self, fn: Any, upto: Any = None) -> tuple[KVCache, jax.Array]:
        """:meth:`jaxpos.layers.cache.Cache.update_keys`: blocks of :data:`KEY_BLOCK`
        slots sliced from ``k``, ``fn`` applied (in float32, or float64 for a float64
        cache), written back in place in the cache's dtype."""
        ct = jnp.promote_types(self.k.dtype, jnp.float32)
        S = self.k.shape[1]
        n = min(S, KEY_BLOCK)

        def body(j, start, k):
            blk = jax.lax.dynamic_slice_in_dim(k, start, n, 1).astype(ct)
            slots = start + jnp.arange(n, dtype=jnp.int32)
            new = jnp.where((slots >= j * n)[None, :, None, None], fn(blk, slots), blk)
            return jax.lax.dynamic_update_slice_in_dim(k, new.astype(k.dtype), start, 1)

        k = over_blocks(S, n, S if upto is None else upto, body, self.k)
        return self._replace(k=k), k

    def write(self, scheme: PositionScheme, q: jax.Array, k: jax.Array, v: jax.Array,
              positions: jax.Array, mask: jax.Array | None) -> tuple[KVCache, CacheRead]:
        """:meth:`jaxpos.layers.cache.Cache.write`: the scheme's ``cache_write`` of the new
        tokens appended at each row's fill count (:func:`update_kv_cache`); read at the
        text's positions, RoPE rotated on load for ``cache_rotation="read"``."""
        q, k, scheme = rotate_at_write(scheme, q, k, positions)
        new, seg, kv_seg, overflow = update_kv_cache(self, k, v, positions, mask)
        scheme, q_pos, kv_pos, tables = read_positions(
            scheme, positions, new.positions, new.valid, mask,
            on_load=rotates_on_load(scheme))
        return new, CacheRead(q, new.k, new.v, scheme, q_pos, kv_pos, seg, kv_seg,
                              jnp.minimum(new.length, new.k.shape[1]), overflow, tables)


def init_kv_cache(batch: int, max_len: int, num_kv_heads: int, head_dim: int,
                  dtype: jnp.dtype | type | str | None) -> KVCache:
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


def check_new_keys(k: jax.Array, cache_k: jax.Array) -> None:
    """New keys ``[B, T, N_kv, H]`` must fit a cache of keys ``[B, S, N_kv, H]``.

    Raises:
      ValueError: naming both shapes.
    """
    B = cache_k.shape[0]
    if k.shape[0] != B or k.shape[2:] != cache_k.shape[2:]:
        raise ValueError(f"new keys {k.shape} do not fit the cache {cache_k.shape} "
                         f"(expected [{B}, T, {cache_k.shape[2]}, {cache_k.shape[3]}]).")


def update_kv_cache(cache: KVCache, k: jax.Array, v: jax.Array, positions: jax.Array,
                    mask: jax.Array | None = None
                    ) -> tuple[KVCache, jax.Array, jax.Array, jax.Array]:
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
    B, S = cache.positions.shape
    T = k.shape[1]
    check_new_keys(k, cache.k)
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
