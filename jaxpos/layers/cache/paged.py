"""The paged KV cache (Kwon et al. 2023, "Efficient Memory Management for Large Language
Model Serving with PagedAttention", §4.2): every row's keys and values live in fixed-size
pages of one pool, found through a per-row page table; a row takes pages as it grows, so
the pool can hold fewer pages than ``batch x max_len`` needs.

Selected by ``init_cache(batch, max_len, page_size=..., num_pages=...)``; attention reads it
through :func:`jaxpos.attention`'s ``page_table=`` (:mod:`jaxpos.core.paged`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpos import _checks
from jaxpos._util import over_blocks
from jaxpos.core.paged import gather_pages
from jaxpos.core.quantised import (
    QuantisedPages,
    empty_quantised_pages,
    kv_storage_dtype,
    set_pages,
    write_tokens,
)
from jaxpos.layers.cache.base import (
    Cache,
    CacheRead,
    read_positions,
    rotate_at_write,
    rotates_on_load,
)
from jaxpos.layers.cache.dense import KEY_BLOCK
from jaxpos.schemes.base import PositionScheme

__all__ = ["PagedKVCache", "assign_pages", "init_paged_cache", "pages_for", "paged_view",
           "write_pages"]

#: Slots per page when ``init_cache`` is given ``num_pages`` only (vLLM's default block size).
DEFAULT_PAGE_SIZE = 16


def pages_for(tokens: Any, page_size: int) -> Any:
    """Pages needed to hold ``tokens`` slots: ``ceil(tokens / page_size)`` (ints or int
    arrays)."""
    return -(-tokens // page_size)


def write_pages(k_pages: Any, v_pages: Any, k: jax.Array, v: jax.Array,
                page_table: jax.Array, lengths: jax.Array, mask: jax.Array | None = None
                ) -> tuple[Any, Any, jax.Array, jax.Array]:
    """Write the new tokens' keys and values at each row's fill: token ``t`` of row ``b``
    goes to slot ``lengths[b] + t``, i.e. page ``page_table[b, slot // page_size]``, offset
    ``slot % page_size``.

    Args:
      k_pages, v_pages: ``[num_pages, page_size, N_kv, H]`` / ``[..., H_v]``, or
        :class:`jaxpos.core.quantised.QuantisedPages` pools.
      k, v: ``[B, T, N_kv, H]`` / ``[B, T, N_kv, H_v]`` (cast to the pages' dtype, or
        quantised with a scale per token and KV head).
      page_table: int ``[B, pages_per_seq]``.
      lengths: int ``[B]`` slots filled before this write (a negative length is a bad
        fill: that row writes nothing and is flagged, see Returns).
      mask: bool ``[B, T]`` (True = write) or None (all). A masked token is not written
        and takes no slot, so masked tokens must come after the row's written ones (the
        padding at the end of a prefill chunk).

    Returns:
      ``(k_pages, v_pages, new_lengths [B], overflow [B] bool)``: ``new_lengths = lengths +
      mask.sum(1)``; ``overflow`` marks rows a token of which found no page (a slot past
      the table, or an entry outside ``[0, num_pages)``): that token is not written (never
      clamped onto another page) and the caller makes the row's output NaN. A row with a
      negative length is flagged the same way and none of its tokens is written (its
      slots would otherwise wrap into its own pages).
    """
    P, ps = k_pages.shape[:2]
    B, T = k.shape[:2]
    pps = page_table.shape[1]
    mask = jnp.ones((B, T), bool) if mask is None else jnp.asarray(mask, bool)
    lengths = jnp.asarray(lengths, jnp.int32)
    slot = lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    col = slot // ps
    # the column is clipped for the lookup only: a column past the table is flagged below
    entry = jnp.take_along_axis(jnp.asarray(page_table, jnp.int32),
                                jnp.clip(col, 0, pps - 1), axis=1)
    ok = (lengths[:, None] >= 0) & (col < pps) & (entry >= 0) & (entry < P)
    page = jnp.where(mask & ok, entry, P)  # P: out of range, dropped by the scatter
    off = slot % ps
    k_pages = write_tokens(k_pages, page, off, k)  # quantised here for QuantisedPages
    v_pages = write_tokens(v_pages, page, off, v)
    new_lengths = lengths + jnp.sum(mask, axis=1, dtype=jnp.int32)
    return k_pages, v_pages, new_lengths, jnp.any(mask & ~ok, axis=1)


def assign_pages(page_table: jax.Array, next_page: jax.Array, new_lengths: jax.Array,
                 page_size: int, num_pages: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Give each row the pages its new fill needs: the table's unassigned entries (< 0)
    among columns ``< ceil(new_lengths / page_size)`` take the pool's next free pages, rows
    in order, from ``next_page`` up. Entries already assigned (by a serving loop's
    allocator) are kept.

    Returns ``(page_table, next_page, short [B] bool)``: ``short`` marks rows that asked for
    pages past the pool (those entries stay unassigned: the write flags the row).
    """
    pps = page_table.shape[1]
    cols = jnp.arange(pps, dtype=jnp.int32)[None, :]
    need = (cols < pages_for(new_lengths, page_size)[:, None]) & (page_table < 0)
    flat = need.reshape(-1)
    offset = jnp.cumsum(flat.astype(jnp.int32)) - 1
    pages = (next_page + offset).reshape(page_table.shape)
    fits = pages < num_pages
    table = jnp.where(need & fits, pages, page_table)
    used = jnp.sum(flat, dtype=jnp.int32)
    short = jnp.any(need & ~fits, axis=1)
    return table, jnp.minimum(next_page + used, num_pages), short


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache(Cache):
    """A paged KV cache of one attention layer (a pytree; pass it through ``jit``).

    Attributes:
      k_pages, v_pages: ``[num_pages, page_size, N_kv, H]`` the pool (keys as the scheme's
        ``cache_write`` stores them: RoPE rotated at write, raw for the schemes applied in
        attention from positions); with ``init_cache(..., kv_dtype="int8")`` (or
        ``"float8_e4m3fn"``) :class:`jaxpos.core.quantised.QuantisedPages`, each token
        quantised as it is written with a float32 scale per KV head.
      page_table: int32 ``[B, pages_per_seq]``, ``-1`` for an entry no page is assigned to
        yet: slot ``s`` of row ``b`` is offset ``s % page_size`` of page ``page_table[b, s
        // page_size]``.
      next_page: int32 ``[]`` the first pool page no row holds (pages are handed out in
        order as rows grow; a serving loop may assign table entries itself instead).
      positions: int32 ``[B, S]`` position of each slot (``S = pages_per_seq *
        page_size``); valid: int32 ``[B, S]`` 1 for a slot holding a token, 0 for empty
        or padding; length: int32 ``[B]`` filled slots; tokens: int32 ``[B]`` tokens held
        (padding excluded).

    The per-slot integers are dense ``[B, S]`` (8 bytes a slot); the keys and values,
    ``2 x N_kv x H`` numbers a slot and layer, are paged.
    """

    k_pages: jax.Array | QuantisedPages
    v_pages: jax.Array | QuantisedPages
    page_table: jax.Array
    next_page: jax.Array
    positions: jax.Array
    valid: jax.Array
    length: jax.Array
    tokens: jax.Array

    @property
    def batch_size(self) -> int:
        """``B``."""
        return self.page_table.shape[0]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[1]

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[0]

    def token_count(self) -> jax.Array:
        """int32 ``[B, 1]`` tokens held per row (padding excluded)."""
        return self.tokens[:, None]

    @property
    def slots_per_row(self) -> int:
        """``S = pages_per_seq * page_size``."""
        return self.positions.shape[1]

    def update_keys(self, fn: Any, upto: Any = None) -> tuple[PagedKVCache, Any]:
        """:meth:`jaxpos.layers.cache.Cache.update_keys`: blocks of whole pages (about
        :data:`~jaxpos.layers.cache.dense.KEY_BLOCK` slots) gathered through the table,
        ``fn`` applied, written back to the same pages (entries without a page are
        dropped). A page must belong to one row (as the pages this cache hands out do): a
        page two rows share would be written twice."""
        B, pps = self.page_table.shape
        ps, P = self.page_size, self.num_pages
        ct = jnp.promote_types(self.k_pages.dtype, jnp.float32)
        n = max(1, min(pps, KEY_BLOCK // ps))  # pages per block

        def body(j, start, pool):
            cols = jax.lax.dynamic_slice_in_dim(self.page_table, start, n, 1)
            blk = gather_pages(pool, cols).astype(ct)
            slots = start * ps + jnp.arange(n * ps, dtype=jnp.int32)
            new = jnp.where((slots >= j * n * ps)[None, :, None, None], fn(blk, slots), blk)
            index = jnp.where((cols >= 0) & (cols < P), cols, P)  # P: out of range, dropped
            # quantised pages are quantised again (a scale per token and head)
            return set_pages(pool, index.reshape(-1),
                             new.reshape((B * n, ps) + self.k_pages.shape[2:]))

        upto = pps if upto is None else (upto + (ps - 1)) // ps
        pool = over_blocks(pps, n, upto, body, self.k_pages)
        return dataclasses.replace(self, k_pages=pool), pool

    def write(self, scheme: PositionScheme, q: jax.Array, k: jax.Array, v: jax.Array,
              positions: jax.Array, mask: jax.Array | None) -> tuple[PagedKVCache, CacheRead]:
        """:meth:`jaxpos.layers.cache.Cache.write`: the scheme's ``cache_write`` of the new
        tokens written at each row's fill, into pages assigned as the row grows
        (:func:`assign_pages`); padding takes a slot that no query sees
        (``kv_segment_ids`` 0), as in the dense cache.

        Raises:
          ValueError: concrete fills that would need more slots than ``max_len`` or more
            pages than the pool, or a negative length (a :func:`paged_view` over bad
            lengths); under ``jit`` those rows are NaN and a negative row writes nothing.
        """
        B, S = self.positions.shape
        T = k.shape[1]
        if k.shape[0] != B or k.shape[2:] != self.k_pages.shape[2:]:
            raise ValueError(f"new keys {k.shape} do not fit the paged cache (expected "
                             f"[{B}, T, {self.k_pages.shape[2]}, {self.k_pages.shape[3]}]).")
        keep = jnp.ones((B, T), bool) if mask is None else jnp.asarray(mask, bool)
        new_len = self.length + T
        needed = new_len  # padding takes a slot (and its page), as in the dense cache
        if all(_checks.is_concrete(x) for x in (self.length, self.page_table, self.next_page)):
            if (np.asarray(self.length) < 0).any():
                raise ValueError(f"paged KV cache lengths must be >= 0 (slots filled per "
                                 f"row); got {np.asarray(self.length).tolist()}.")
            end = np.asarray(needed)
            if (end > S).any():
                raise ValueError(f"KV cache overflow: writing {T} token(s) after "
                                 f"{np.asarray(self.length)} filled slot(s) needs "
                                 f"{int(end.max())} slots; the paged cache holds max_len="
                                 f"{S} per row. Create it with a larger init_cache(batch, "
                                 f"max_len, ...).")
            table = np.asarray(self.page_table)
            need = ((np.arange(table.shape[1])[None, :] < -(-end // self.page_size)[:, None])
                    & (table < 0)).sum()
            if int(self.next_page) + need > self.num_pages:
                raise ValueError(f"paged KV cache out of pages: this write needs {need} more "
                                 f"page(s), {self.num_pages - int(self.next_page)} of "
                                 f"num_pages={self.num_pages} are free. Create the cache with "
                                 f"more pages (init_cache(..., num_pages=)).")
        q, k, scheme = rotate_at_write(scheme, q, k, positions)
        table, next_page, short = assign_pages(self.page_table, self.next_page, needed,
                                               self.page_size, self.num_pages)
        k_pages, v_pages, _, overflow = write_pages(self.k_pages, self.v_pages, k, v, table,
                                                    self.length)
        slots = self.length[:, None] + jnp.arange(T, dtype=jnp.int32)
        # a negative fill (write_pages flags it) writes nothing: S is dropped, where a
        # negative slot would wrap to the row's end
        slots = jnp.where(self.length[:, None] >= 0, slots, S)
        rows = jnp.arange(B, dtype=jnp.int32)[:, None]
        pos = jnp.broadcast_to(positions, (B, T)).astype(jnp.int32)
        new = PagedKVCache(
            k_pages, v_pages, table, next_page,
            self.positions.at[rows, slots].set(pos, mode="drop"),
            self.valid.at[rows, slots].set(keep.astype(jnp.int32), mode="drop"),
            new_len, self.tokens + jnp.sum(keep, axis=-1, dtype=jnp.int32))
        scheme, q_pos, kv_pos, tables = read_positions(
            scheme, positions, new.positions, new.valid, mask, on_load=rotates_on_load(scheme))
        poison = overflow | short | (needed > S)
        return new, CacheRead(q, k_pages, v_pages, scheme, q_pos, kv_pos,
                              keep.astype(jnp.int32), new.valid, jnp.minimum(new_len, S),
                              poison, tables, table)


def init_paged_cache(batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype: Any,
                     page_size: int | None = None, num_pages: int | None = None,
                     kv_dtype: Any = None) -> PagedKVCache:
    """An empty :class:`PagedKVCache`: a pool of ``num_pages`` zero pages of ``page_size``
    slots (default 16), page tables of ``ceil(max_len / page_size)`` unassigned entries
    per row. ``num_pages`` defaults to what every row filled to ``max_len`` needs
    (``batch * ceil(max_len / page_size)``); give fewer when rows hold fewer tokens.

    ``kv_dtype``: ``"int8"`` or ``"float8_e4m3fn"`` (where JAX has it) for quantised pages
    (:class:`jaxpos.core.quantised.QuantisedPages`: symmetric, a float32 scale per token
    and KV head, quantised at write, dequantised per key block inside attention; read as
    ``dtype``), a float dtype for pages of that dtype, None for ``dtype``.

    Raises:
      ValueError / TypeError: sizes that are not positive ints; a ``kv_dtype`` that is
        neither quantised nor floating.
    """
    _checks.check_positive_int("batch", batch)
    _checks.check_positive_int("max_len", max_len)
    ps = _checks.check_positive_int("page_size",
                                    DEFAULT_PAGE_SIZE if page_size is None else page_size)
    pps = pages_for(max_len, ps)
    P = _checks.check_positive_int("num_pages", batch * pps if num_pages is None else num_pages)
    S = pps * ps
    shape = (P, ps, num_kv_heads, head_dim)
    if kv_dtype is not None and kv_storage_dtype(kv_dtype) is not None:
        pools: tuple[Any, Any] = (empty_quantised_pages(shape, kv_dtype, dtype),
                                  empty_quantised_pages(shape, kv_dtype, dtype))
    else:
        dt = dtype if kv_dtype is None else kv_dtype
        pools = (jnp.zeros(shape, dt), jnp.zeros(shape, dt))
    return PagedKVCache(*pools,
                        jnp.full((batch, pps), -1, jnp.int32), jnp.zeros((), jnp.int32),
                        jnp.zeros((batch, S), jnp.int32), jnp.zeros((batch, S), jnp.int32),
                        jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), jnp.int32))


def paged_view(k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
               lengths: jax.Array) -> PagedKVCache:
    """A :class:`PagedKVCache` over pages a serving loop owns: its rows hold slots ``0 ..
    lengths[b] - 1`` of their ``page_table`` rows (tokens at positions equal to their slots,
    no padding); the loop assigns every page the next write needs (the cache hands out
    none of its own: a missing page gives a NaN row).

    Args:
      k_pages, v_pages: ``[num_pages, page_size, N_kv, H]`` (or
        :class:`jaxpos.core.quantised.QuantisedPages`).
      page_table: int32 ``[B, pages_per_seq]`` (``-1`` where unassigned).
      lengths: int32 ``[B]``.
    """
    B, pps = page_table.shape
    S = pps * k_pages.shape[1]
    slots = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    lengths = jnp.asarray(lengths, jnp.int32)
    valid = (slots < lengths[:, None]).astype(jnp.int32)
    return PagedKVCache(k_pages, v_pages, jnp.asarray(page_table, jnp.int32),
                        jnp.asarray(k_pages.shape[0], jnp.int32), slots, valid, lengths, lengths)
