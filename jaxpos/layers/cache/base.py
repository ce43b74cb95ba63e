"""The KV-cache protocol of the modules (:mod:`jaxpos.nnx`, :mod:`jaxpos.linen`).

A cache type is a pytree (it passes through ``jit`` and may be donated) subclassing
:class:`Cache`. The decode code of the modules knows only this protocol: it asks the cache
for its rows' token counts, hands it the new tokens' projected queries, keys and values
with one :meth:`Cache.write` call, and runs one attention call on the :class:`CacheRead`
that comes back. It never asks which cache type it holds, so a new cache (the dense
:class:`~jaxpos.layers.cache.KVCache`, the StreamingLLM
:class:`~jaxpos.layers.cache.StreamingKVCache`, a paged cache) is one new file.

The scheme decides what is stored (:meth:`jaxpos.PositionScheme.cache_write`) and the
cache decides where; the helpers at the end of this file (:func:`rotate_at_write`,
:func:`read_positions`) are the one copy of the rules every cache applies to the scheme.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from jaxpos.core.paged import gather_pages
from jaxpos.layers.functional import fill_hidden_positions, visible_top
from jaxpos.schemes.base import NoPE, PositionScheme

__all__ = ["Cache", "CacheRead", "check_cache", "poison_rows", "read_positions",
           "rotate_at_write", "rotates_on_load"]


class CacheRead(NamedTuple):
    """What a cache hands attention after a :meth:`Cache.write`: the arguments of one
    :func:`jaxpos.attention` call (or of the scheme's own ``attention`` when it replaces
    softmax attention), plus the rows to poison.

    Attributes:
      q: ``[B, T, N, H]`` the new tokens' queries as attention takes them (RoPE-rotated
        when the scheme rotates at write).
      k, v: the keys and values to attend to: ``[B, S, N_kv, H]`` for a cache holding rows
        of slots (for a paged cache, its pages ``[num_pages, page_size, N_kv, H]``, with
        :attr:`page_table`). Any float dtype; attention casts them to ``q``'s.
      scheme: the :class:`jaxpos.PositionScheme` the keys are read with
        (:class:`jaxpos.NoPE` for keys rotated at write or rotated on load from
        :attr:`rope_tables`).
      q_positions: int32 ``[B, T]``; kv_positions: int32 ``[B, S]``: the positions
        attention sees (the text's, or StreamingLLM's places in the cache).
      segment_ids: int32 ``[B, T]``, 1 for a new token, 0 for new padding;
        kv_segment_ids: int32 ``[B, S]``, 1 for a slot holding a token, 0 for an empty or
        padding slot. Only equal ids attend, so no token sees an empty or padding slot on
        any path (the Pallas kernel takes no arbitrary mask).
      kv_lengths: int32 ``[B]`` slots ``>= kv_lengths[b]`` are never visited (passed as
        :func:`jaxpos.attention`'s ``kv_lengths`` where the engine takes it): a step costs
        the filled length, not ``S``.
      poison: bool ``[B]``, rows whose output must be NaN (traced overflow, a step that
        evicts keys its own queries need): such steps cannot raise under ``jit``.
      rope_tables: a :class:`jaxpos.schemes.rope.tables.RopeTables` rotating the raw
        queries and keys on load, or None.
      page_table: int32 ``[B, pages_per_seq]`` for a paged cache (slot ``s`` of row ``b``
        is ``k[page_table[b, s // page_size], s % page_size]``), or None.
      cu_q_lengths: int32 ``[R + 1]`` for a ragged step
        (:class:`jaxpos.layers.cache.ragged.RaggedPagedCache`): ``q [1, total, N, H]`` and
        ``q_positions [1, total]`` pack the new tokens of the ``R`` rows of
        :attr:`page_table` (``[R, pages_per_seq]``), ``kv_lengths`` is ``[R]``, and
        attention is the ragged call (:mod:`jaxpos.core.ragged`); None otherwise.
    """

    q: jax.Array
    k: jax.Array
    v: jax.Array
    scheme: PositionScheme
    q_positions: jax.Array
    kv_positions: jax.Array
    segment_ids: jax.Array
    kv_segment_ids: jax.Array
    kv_lengths: jax.Array
    poison: jax.Array
    rope_tables: Any = None
    page_table: jax.Array | None = None
    cu_q_lengths: jax.Array | None = None

    def keywords(self) -> dict[str, Any]:
        """The optional attention keywords this read sets (``rope_tables``,
        ``page_table``, ``cu_q_lengths``): ``{name: value}`` for those that are not None."""
        return {n: val for n, val in (("rope_tables", self.rope_tables),
                                      ("page_table", self.page_table),
                                      ("cu_q_lengths", self.cu_q_lengths)) if val is not None}

    def unpaged(self) -> CacheRead:
        """This read with a paged cache's pages gathered into rows of slots
        (``k``, ``v`` ``[B, pages_per_seq * page_size, N_kv, H]``, ``page_table`` None), for
        a scheme whose own ``attention`` replaces softmax attention and takes no
        ``page_table`` (stick-breaking, CoPE). Slots at or past a row's ``kv_lengths`` hold
        zeros, as the dense cache's empty slots do (a padding query, segment 0, sees them
        in both). Returns ``self`` for a read that holds no pages."""
        if self.page_table is None:
            return self
        k, v = (gather_pages(x, self.page_table) for x in (self.k, self.v))
        filled = (jnp.arange(k.shape[1])[None, :] < self.kv_lengths[:, None])[..., None, None]
        return self._replace(k=jnp.where(filled, k, 0), v=jnp.where(filled, v, 0),
                             page_table=None)


class Cache(abc.ABC):
    """The protocol of a module KV cache (one attention layer's; a model keeps a tuple,
    one per layer). An implementation is a pytree (``jax.tree_util.register_dataclass`` on
    a frozen dataclass, sizes such as ``keep_first`` or ``page_size`` static, or a
    NamedTuple subclass), built empty
    by a function the modules' ``init_cache`` calls, with every array field its own
    buffer so that a jitted step may donate it.

    Implement three members:

    * :attr:`batch_size` (``B``, a Python int from a static shape);
    * :meth:`token_count`: int32 ``[B, 1]`` tokens held per row (padding excluded, evicted
      tokens included), the next token's position in Hugging Face's convention;
    * :meth:`write`: store the new tokens and say how attention reads the cache.

    and, when attention must not see the text's positions, set
    :attr:`text_positions` to False.
    """

    #: True when attention sees the text's positions (the cache's ``kv_positions`` are
    #: the positions the tokens were written with). False for a cache that re-numbers its
    #: tokens at read (StreamingLLM's places in the cache): a model whose positions are
    #: added to the token embeddings (sinusoidal, learned) cannot use it.
    text_positions: ClassVar[bool] = True

    @property
    @abc.abstractmethod
    def batch_size(self) -> int:
        """The number of rows ``B`` the cache holds (static)."""

    @abc.abstractmethod
    def token_count(self) -> jax.Array:
        """int32 ``[B, 1]``: tokens written per row, padding excluded (the default
        position of the next token)."""

    @property
    def slots_per_row(self) -> int:
        """``S``, the slots of a row as :meth:`CacheRead.unpaged` lays them out (static):
        the size of a scheme's per-slot decode state
        (:mod:`jaxpos.layers.cache.scheme_state`).

        Raises:
          ValueError: a cache type that does not say (it cannot carry such state).
        """
        raise ValueError(f"{type(self).__name__} cannot carry a scheme's decode state (it "
                         f"does not give slots_per_row).")

    def update_keys(self, fn: Any, upto: Any = None) -> tuple[Cache, Any]:
        """The cache with its stored keys replaced by ``fn``, a block of slots at a time:
        ``fn(k, slots)`` gets the keys ``[B, n, N_kv, H]`` of the slots ``slots`` (int32
        ``[n]``, the same for every row; slot numbers of the row-of-slots layout of
        :meth:`CacheRead.unpaged`) in float32 (float64 for a float64 cache) and returns
        their new keys, the same shape; it must be slot by slot (a slot's new key depends
        on its old key and its number only). ``upto`` (int, may be traced): only the
        blocks covering slots ``[0, upto)`` are visited, so the cost follows the filled
        slots (``fn`` leaves the slots at or past a row's fill as they are); None: every
        slot. For a scheme whose decoding moves the cached keys at each step (PaTH's
        inference rule, Yang et al. 2025, §3.2).

        Returns:
          ``(cache, keys)``: the new cache and its keys as a :class:`CacheRead` of it
          holds them (rows of slots, or a paged cache's pool).

        Raises:
          ValueError: a cache type whose keys cannot be rewritten in place (the
            StreamingLLM cache re-places its tokens; the default).
        """
        raise ValueError(f"{type(self).__name__} cannot rewrite its stored keys in place, "
                         f"which decoding this scheme needs (PaTH moves every cached key by "
                         f"each new token's transform); use the dense cache (init_cache "
                         f"without options) or the paged one.")

    @abc.abstractmethod
    def write(self, scheme: PositionScheme, q: jax.Array, k: jax.Array, v: jax.Array,
              positions: jax.Array, mask: jax.Array | None) -> tuple[Cache, CacheRead]:
        """Store the new tokens and return ``(new_cache, read)``.

        Args:
          scheme: the layer's :class:`jaxpos.PositionScheme` for this call. What the cache
            stores is the scheme's :meth:`~jaxpos.PositionScheme.cache_write` (use
            :func:`rotate_at_write`); a cache whose positions change after the write (a
            ring buffer) stores raw keys instead when the scheme rotates on load
            (:func:`rotates_on_load`).
          q: ``[B, T, N, H]``; k, v: ``[B, T, N_kv, H]``: the new tokens' projections
            (raw: no position applied).
          positions: int32 ``[B, T]`` the new tokens' text positions (padding at 1).
          mask: bool ``[B, T]``, True for a token, False for padding; None: all tokens.
            Padding must never be visible to a later query (``kv_segment_ids`` 0, or not
            stored at all).

        Returns:
          ``(cache, read)``: the cache holding the new tokens (same pytree structure and
          shapes) and the :class:`CacheRead` for this step's attention call, whose
          queries attend to every stored token of their row up to their own position
          (the new tokens included).

        Raises:
          ValueError: when concrete counts show a write the cache cannot hold (overflow,
            an evicting step of several tokens); under ``jit`` set :attr:`CacheRead.poison`
            for those rows instead (never write onto another token's slot).
        """


def check_cache(cache: Any, batch: int | None = None) -> Cache:
    """``cache`` must be a module KV cache (a :class:`Cache`, from ``init_cache``) with
    ``batch`` rows when given.

    Raises:
      TypeError: not a :class:`Cache`.
      ValueError: ``batch`` differs from the cache's batch size.
    """
    if not isinstance(cache, Cache):
        raise TypeError(f"cache must be a jaxpos.nnx.KVCache (from init_cache); got "
                        f"{type(cache).__name__}.")
    B = cache.batch_size
    if batch is not None and batch != B:
        raise ValueError(f"the new tokens have batch size {batch} but the KV cache was made "
                         f"for batch size {B} (init_cache(batch={B}, ...)); decode the same "
                         f"rows the cache holds, or make a cache with init_cache({batch}, "
                         f"max_len).")
    return cache


def poison_rows(x: jax.Array, overflow: jax.Array) -> jax.Array:
    """``x`` ``[B, ...]`` with NaN in the batch rows where ``overflow`` (bool ``[B]``) is
    True (traced KV-cache overflow, an evicting multi-token step)."""
    return jnp.where(overflow.reshape((-1,) + (1,) * (x.ndim - 1)), jnp.array(jnp.nan, x.dtype), x)


def rotate_at_write(scheme: PositionScheme, q: jax.Array, k: jax.Array,
                    positions: jax.Array) -> tuple[jax.Array, jax.Array, PositionScheme]:
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


def rotates_on_load(scheme: PositionScheme) -> bool:
    """True for a scheme that can rotate raw keys as they are loaded from rope tables it
    builds for the read positions (RoPE, Su et al. 2024, §3.4:
    :meth:`jaxpos.PositionScheme.load_tables`). Exact
    dynamic NTK (``cache_rotation="read"``) and a cache whose positions change after the
    write (StreamingLLM's places) store raw keys and read them so."""
    return scheme.rotates_on_load


def read_positions(scheme: PositionScheme, q_positions: jax.Array, kv_positions: jax.Array,
                   kv_valid: jax.Array, q_visible: jax.Array | None,
                   on_load: bool = False) -> tuple[PositionScheme, jax.Array, jax.Array, Any]:
    """How a scheme reads a cache: ``(scheme, q_positions, kv_positions, rope_tables)``.

    * ``on_load`` (raw keys of a scheme that :func:`rotates_on_load`): rope tables for
      ``q_positions`` / ``kv_positions`` and :class:`jaxpos.NoPE` for the call; the
      engines rotate the query tile and each key block as they load it.
    * A scheme that transforms the whole call's q/k from its positions at once (xPos
      measures its scales from the centre of the call's positions; Sun et al. 2022, §3):
      the positions of hidden slots (empty, padding) are set to the row's largest visible
      one so they do not widen the call's range. Only such a scheme pays this pass.
    * Otherwise the positions as given.

    Args:
      scheme: the scheme the keys are read with; q_positions: int32 ``[B, T]``;
      kv_positions: int32 ``[B, S]``; kv_valid: int ``[B, S]`` nonzero on slots holding a
      token (only read by the xPos-like schemes: no pass over the cache for the others);
      q_visible: bool ``[B, T]`` new tokens (None: all); on_load: see above.
    """
    if on_load:
        return NoPE(), q_positions, kv_positions, scheme.load_tables(q_positions, kv_positions)
    if type(scheme).transform_qk is not PositionScheme.transform_qk:
        kv_visible = kv_valid != 0
        top = visible_top(kv_positions, kv_visible)
        kv_positions = fill_hidden_positions(kv_positions, kv_visible, top)
        if q_visible is not None:
            q_positions = fill_hidden_positions(q_positions, q_visible, top)
    return scheme, q_positions, kv_positions, None
