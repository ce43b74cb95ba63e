"""A ragged step over pages a serving loop owns: the prefill chunks and decode tokens of
many rows packed along one token axis, written at each row's fill and read by the ragged
call (:mod:`jaxpos.core.ragged`; JAX's ``ragged_paged_attention`` layout).

A module sees the packed tokens as one batch row, ``x [1, total, D]``: embeddings,
projections, RoPE's rotation and the MLP are per token, so only the cache write and the
attention call need to know which row a token belongs to. :class:`RaggedPagedCache` is the
:class:`~jaxpos.layers.cache.Cache` that knows: it holds the pool, the rows' page tables,
their fills before the step and ``cu_q_lengths``; its :meth:`~RaggedPagedCache.write` puts
token ``t`` of row ``b`` at slot ``lengths[b] + t`` and hands attention a read carrying
``cu_q_lengths`` (the modules then make the ragged call). :func:`write_ragged` is the same
write for a functional model (:class:`jaxpos.serving.PagedDecoder`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpos.layers.cache.base import (
    Cache,
    CacheRead,
    read_positions,
    rotate_at_write,
    rotates_on_load,
)
from jaxpos.layers.cache.paged import write_pages
from jaxpos.schemes.base import PositionScheme

__all__ = ["RaggedPagedCache", "ragged_rows", "ragged_view", "write_ragged"]


def ragged_rows(cu_q_lengths: jax.Array, total: int) -> tuple[jax.Array, jax.Array]:
    """``(row [total], offset [total])`` int32: each packed token's row (``b`` with
    ``cu_q_lengths[b] <= t < cu_q_lengths[b + 1]``) and its index within the row."""
    cu = jnp.asarray(cu_q_lengths, jnp.int32)
    t = jnp.arange(total, dtype=jnp.int32)
    row = jnp.clip(jnp.searchsorted(cu[1:], t, side="right"), 0, cu.shape[0] - 2)
    return row.astype(jnp.int32), t - cu[row]


def write_ragged(k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array,
                 page_table: jax.Array, lengths: jax.Array, cu_q_lengths: jax.Array,
                 mask: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Write packed new tokens at their rows' fills: token ``t`` of row ``b`` (packed index
    ``cu_q_lengths[b] + t``) goes to slot ``lengths[b] + t`` of row ``b``'s pages.

    Args:
      k_pages, v_pages: ``[num_pages, page_size, N_kv, H]`` / ``[..., H_v]``.
      k, v: ``[total, N_kv, H]`` / ``[total, N_kv, H_v]`` packed (cast to the pages' dtype).
      page_table: int ``[R, pages_per_seq]``; lengths: int ``[R]`` slots filled before.
      cu_q_lengths: int ``[R + 1]`` cutting the packed axis into rows (ending at ``total``).
      mask: bool ``[total]`` (False: a padding token, not written) or None.

    Returns:
      ``(k_pages, v_pages, kv_lengths [R], overflow [total])``: ``kv_lengths = lengths +
      cu_q_lengths[1:] - cu_q_lengths[:-1]`` (every packed token of a row counts: the
      ragged call's queries are the last tokens of the fill); ``overflow`` marks tokens
      that found no page (not written, never clamped; the ragged call reading that row
      flags it: its queries are NaN under ``jit``).
    """
    total = k.shape[0]
    row, offset = ragged_rows(cu_q_lengths, total)
    lengths = jnp.asarray(lengths, jnp.int32)
    table = jnp.asarray(page_table, jnp.int32)[row]  # [total, pages_per_seq]
    keep = None if mask is None else jnp.asarray(mask, bool)[:, None]
    k_pages, v_pages, _, over = write_pages(k_pages, v_pages, k[:, None], v[:, None], table,
                                            lengths[row] + offset, keep)
    cu = jnp.asarray(cu_q_lengths, jnp.int32)
    return k_pages, v_pages, lengths + (cu[1:] - cu[:-1]), over


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedPagedCache(Cache):
    """One layer's pages seen by a ragged step (a pytree): the module's batch is one row of
    ``total`` packed tokens, cut into the loop's ``R`` rows by :attr:`cu_q_lengths`.

    Attributes:
      k_pages, v_pages: ``[num_pages, page_size, N_kv, H]`` the pool.
      page_table: int32 ``[R, pages_per_seq]``; lengths: int32 ``[R]`` slots filled before
        the step (after :meth:`write`, the fills with the new tokens); cu_q_lengths:
        int32 ``[R + 1]``. A row's slots hold its tokens at positions equal to the slots
        (no padding), as :func:`jaxpos.layers.cache.paged.paged_view` has them.

    The step's positions must be given (``decode_step(..., positions=)``: the token count
    of one batch row means nothing here); :meth:`token_count` returns zeros.
    """

    k_pages: jax.Array
    v_pages: jax.Array
    page_table: jax.Array
    lengths: jax.Array
    cu_q_lengths: jax.Array

    @property
    def batch_size(self) -> int:
        return 1

    @property
    def slots_per_row(self) -> int:
        return self.page_table.shape[1] * self.k_pages.shape[1]

    def token_count(self) -> jax.Array:
        return jnp.zeros((1, 1), jnp.int32)

    def write(self, scheme: PositionScheme, q: jax.Array, k: jax.Array, v: jax.Array,
              positions: jax.Array, mask: jax.Array | None
              ) -> tuple[RaggedPagedCache, CacheRead]:
        """:meth:`jaxpos.layers.cache.Cache.write` for packed tokens ``q [1, total, N, H]``,
        ``k, v [1, total, N_kv, H]``, ``positions [1, total]``, ``mask [1, total]`` (False:
        padding, not written): the scheme's ``cache_write`` per token, :func:`write_ragged`,
        and a read whose :attr:`~jaxpos.layers.cache.CacheRead.cu_q_lengths` asks for the
        ragged call (key positions: the slots; RoPE stored raw is rotated on load).

        Raises:
          ValueError: a batch other than one packed row; a scheme with its own
            ``transform_qk`` (not rotated on load): some (xPos) scale q and k from the whole
            call's positions at once, which packed rows at unrelated positions cannot
            share, so every such scheme is refused, Llama 4's ``TemperatureTunedNoPE``
            (a per-query temperature) included.
        """
        if q.shape[0] != 1:
            raise ValueError(f"a ragged step packs every row's tokens into one batch row "
                             f"[1, total, ...]; got new queries of shape {q.shape}.")
        q, k, scheme = rotate_at_write(scheme, q, k, positions)
        on_load = rotates_on_load(scheme)
        if not on_load and type(scheme).transform_qk is not PositionScheme.transform_qk:
            raise ValueError(f"{type(scheme).__name__} has its own transform_qk, which a "
                             f"ragged step refuses for every scheme (some, like xPos, scale "
                             f"q and k from the whole call's positions, which rows packed "
                             f"at unrelated positions cannot share); a token-budget "
                             f"ServingEngine runs this model in padded steps.")
        keep = None if mask is None else jnp.asarray(mask, bool)[0]
        kp, vp, kv_lengths, _ = write_ragged(self.k_pages, self.v_pages, k[0], v[0],
                                             self.page_table, self.lengths,
                                             self.cu_q_lengths, keep)
        S = self.slots_per_row
        kv_pos = jnp.arange(S, dtype=jnp.int32)[None]
        pos = jnp.asarray(positions, jnp.int32).reshape(1, -1)
        scheme, q_pos, kv_pos, tables = read_positions(scheme, pos, kv_pos, kv_pos, None,
                                                       on_load=on_load)
        total = q.shape[1]
        seg = jnp.ones((1, total), jnp.int32) if keep is None else keep[None].astype(jnp.int32)
        new = dataclasses.replace(self, k_pages=kp, v_pages=vp, lengths=kv_lengths)
        # a token without a page is caught by the ragged call (its row reads an unassigned
        # entry: NaN queries), so no row of the module's batch is poisoned here
        return new, CacheRead(q, kp, vp, scheme, q_pos, kv_pos, seg,
                              jnp.ones((1, S), jnp.int32), kv_lengths, jnp.zeros((1,), bool),
                              tables, jnp.asarray(self.page_table, jnp.int32),
                              jnp.asarray(self.cu_q_lengths, jnp.int32))


def ragged_view(k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                lengths: jax.Array, cu_q_lengths: jax.Array) -> RaggedPagedCache:
    """A :class:`RaggedPagedCache` over a serving loop's pages (``lengths`` filled slots
    per row before the step; the loop has assigned every page the step writes)."""
    return RaggedPagedCache(k_pages, v_pages, jnp.asarray(page_table, jnp.int32),
                            jnp.asarray(lengths, jnp.int32),
                            jnp.asarray(cu_q_lengths, jnp.int32))
