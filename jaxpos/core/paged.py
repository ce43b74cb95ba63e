"""Paged attention: ``jaxpos.attention(q, k_pages, v_pages, *, page_table, kv_lengths, ...)``.

The keys and values of every sequence live in a shared pool of fixed-size pages (vLLM's
PagedAttention, Kwon et al. 2023, "Efficient Memory Management for Large Language Model
Serving with PagedAttention", §4.1-4.2; FlashAttention's ``flash_attn_with_kvcache`` with
a ``block_table``):

* ``k_pages [num_pages, page_size, N_kv, H]``, ``v_pages [num_pages, page_size, N_kv, H_v]``;
* ``page_table`` int ``[B, pages_per_seq]``: slot ``s`` of row ``b`` (its ``s``-th key) is
  offset ``s % page_size`` of page ``page_table[b, s // page_size]``;
* ``kv_lengths`` int ``[B]``: row ``b`` holds slots ``0 .. kv_lengths[b] - 1``; entries of
  the page table past ``ceil(kv_lengths[b] / page_size)`` are never read (they may hold
  anything, e.g. ``-1``);
* positions are per slot: ``kv_positions [B|1, pages_per_seq * page_size]`` (default
  ``arange``), and the queries sit at the end of each row's fill: ``q_positions``
  defaults to ``kv_lengths[b] - Tq + arange(Tq)`` (``flash_attn_with_kvcache``), the
  dense call's default with ``kv_lengths`` (:func:`jaxpos.attention`).

The call means exactly the dense call on the keys gathered from the pages
(:func:`gather_pages`, ``[B, pages_per_seq * page_size, N_kv, H]``) with ``kv_lengths``:
every position scheme, score_mod, mask_mod, sinks, causal, grouped-query attention,
segments and masks in the logical ``[B, pages_per_seq * page_size]`` slot space.

Paths (the engine protocol's ``run_paged``, :mod:`jaxpos.core.engines`): the call is
validated once (:func:`paged_call`), an engine is selected as for the dense call, and
:func:`run_paged` runs it:

* an engine with ``run_paged(call, k_pages, v_pages, page_table)`` reads the pages itself
  when that returns an output. ``"chunked"`` (the CPU default) walks the page table block
  by block for at most :data:`jaxpos.core.decode.DECODE_MAX_Q` queries
  (:func:`jaxpos.core.decode.run_paged_decode`; a block is a whole number of pages,
  gathered by one indexed load; blocks past the longest row's fill are skipped by
  ``lax.cond``, and a block no query can see is decided from positions and never loaded;
  K/V heads are never repeated to the query heads). ``"pallas"``'s is the kernel's paged
  entry (key tiles of one page read through the page table; forward only, for serving).
* otherwise (``"reference"``, more queries, a block mask, dropout, a scheme whose
  per-call transform rewrites the keys, such as ``RoPE`` given raw keys): the one gather
  fallback, the engine on the pages gathered into ``[B, pages_per_seq * page_size, ...]``.
  Caches store RoPE keys rotated at write (then pass ``position=None``), or pass
  ``rope_tables`` to rotate each block on load.

Bad input: page shapes that disagree with each other or with q, a page table or lengths of
the wrong shape or dtype raise ``ValueError`` / ``TypeError`` always; with concrete values,
a ``kv_lengths`` entry outside ``[0, pages_per_seq * page_size]`` or a page index that a
row reads outside ``[0, num_pages)`` raises ``ValueError``. Under ``jit`` (traced values)
such a row's output is NaN (the rule of an overflowing KV cache), and nothing is clamped
onto another page: the bad index is never used.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos.core import engines
from jaxpos.core.call import AttentionCall, transform_call, validate_call
from jaxpos.core.quantised import as_pool, check_quantised, is_quantised, take_pages

__all__ = ["PagedLayout", "check_paged_inputs", "gather_pages", "paged_attention",
           "paged_bad_rows", "paged_call", "run_paged", "safe_table"]


class PagedLayout:
    """The static shape of a paged call: ``num_pages``, ``page_size``, ``pages_per_seq``
    and the logical key length ``kv_len = pages_per_seq * page_size``."""

    def __init__(self, num_pages: int, page_size: int, pages_per_seq: int):
        self.num_pages, self.page_size, self.pages_per_seq = num_pages, page_size, pages_per_seq
        self.kv_len = pages_per_seq * page_size

    def __repr__(self):
        return (f"PagedLayout(num_pages={self.num_pages}, page_size={self.page_size}, "
                f"pages_per_seq={self.pages_per_seq})")


def check_paged_inputs(q: ArrayLike, k_pages: ArrayLike, v_pages: ArrayLike,
                       page_table: ArrayLike, kv_lengths: ArrayLike) -> PagedLayout:
    """Check the shapes and dtypes of a paged call, and its values when they are concrete.

    Args:
      q: ``[B, Tq, N, H]`` float.
      k_pages: ``[num_pages, page_size, N_kv, H]`` float; v_pages: ``[num_pages,
        page_size, N_kv, H_v]`` float; either may be a
        :class:`jaxpos.core.quantised.QuantisedPages` pool of that shape (its ``dtype``
        the float one it reads as).
      page_table: integer ``[B, pages_per_seq]``.
      kv_lengths: integer ``[B]``.

    Returns:
      The :class:`PagedLayout`.

    Raises:
      ValueError: a wrong rank; pages that disagree with each other (pool size, page size,
        heads) or with q (head_dim, heads not a multiple of N_kv); a page table not
        ``[B, pages_per_seq]``; kv_lengths not ``[B]``; concrete ``kv_lengths`` outside
        ``[0, pages_per_seq * page_size]`` (the page table is too short for them); a
        concrete page index that a row reads outside ``[0, num_pages)``.
      TypeError: non-floating q or pages; a non-integer page table or kv_lengths;
        quantised pages with values that are not int8 / float8_e4m3fn or scales that are
        not float32 (:func:`jaxpos.core.quantised.check_quantised`; its ``ValueError``
        for scales that are not ``[num_pages, page_size, N_kv, 1]``).
    """
    for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
        if is_quantised(x):
            check_quantised(name, x)
    for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        what = ("[batch, seq, heads, head_dim]" if name == "q"
                else "[num_pages, page_size, kv_heads, head_dim]")
        _checks.check_rank(name, x, (4,), what)
        _checks.check_floating(name, x)
    (B, _Tq, N, H), (P, ps, Nk, Hk) = _checks.shape_of(q), _checks.shape_of(k_pages)
    vs = _checks.shape_of(v_pages)
    if vs[:3] != (P, ps, Nk):
        raise ValueError(f"v_pages must match k_pages in pages, page size and heads "
                         f"[{P}, {ps}, {Nk}, H_v]; got k_pages {(P, ps, Nk, Hk)}, v_pages {vs}.")
    if Hk != H:
        raise ValueError(f"k_pages must have q's head_dim {H}; got k_pages {(P, ps, Nk, Hk)} "
                         f"and q {(B, _Tq, N, H)}.")
    if P == 0 or ps == 0:
        raise ValueError(f"k_pages must hold at least one page of at least one slot; got "
                         f"{(P, ps, Nk, Hk)}.")
    if N % Nk:
        raise ValueError(f"query heads ({N}) must be a multiple of the pages' key/value heads "
                         f"({Nk}); got q {(B, _Tq, N, H)}, k_pages {(P, ps, Nk, Hk)}.")
    _checks.check_rank("page_table", page_table, (2,), "[batch, pages_per_seq]")
    dt = _checks.dtype_of(page_table)
    if dt == np.bool_ or not jnp.issubdtype(dt, jnp.integer):
        raise TypeError(f"page_table must be an integer array [batch, pages_per_seq] (page "
                        f"indices); got dtype {dt}.")
    pt_shape = _checks.shape_of(page_table)
    if pt_shape[0] != B:
        raise ValueError(f"page_table must have shape [B, pages_per_seq] with B = {B} (q's "
                         f"batch); got {pt_shape}.")
    layout = PagedLayout(P, ps, pt_shape[1])
    shaped = (_checks.shape_of(kv_lengths) == (B,)
              and jnp.issubdtype(_checks.dtype_of(kv_lengths), jnp.integer))
    if shaped and _checks.is_concrete(kv_lengths):  # (check_kv_lengths names the rest)
        lens = np.asarray(kv_lengths).astype(np.int64)
        bad = (lens < 0) | (lens > layout.kv_len)
        if bad.any():
            b = int(np.argmax(bad))
            raise ValueError(
                f"kv_lengths must be in [0, pages_per_seq * page_size] = [0, {layout.kv_len}] "
                f"(page_table has {layout.pages_per_seq} pages of {ps} slots per row); got "
                f"kv_lengths[{b}] = {int(lens[b])}"
                + (": the page table is too short for it." if lens[b] > 0 else "."))
        if _checks.is_concrete(page_table):
            pt = np.asarray(page_table).astype(np.int64)
            used = np.arange(layout.pages_per_seq)[None, :] * ps < lens[:, None]
            wrong = used & ((pt < 0) | (pt >= P))
            if wrong.any():
                b, s = (int(i) for i in np.argwhere(wrong)[0])
                raise ValueError(
                    f"page_table[{b}, {s}] = {int(pt[b, s])} is outside [0, num_pages) = "
                    f"[0, {P}); row {b} reads pages 0 .. {-(-int(lens[b]) // ps) - 1} of its "
                    f"table (kv_lengths[{b}] = {int(lens[b])}, page_size {ps}).")
    _checks.check_kv_lengths(kv_lengths, B, layout.kv_len)  # rank, dtype, length
    return layout


def paged_bad_rows(page_table: ArrayLike, kv_lengths: ArrayLike,
                   layout: PagedLayout) -> jax.Array:
    """bool ``[B]``: rows whose ``kv_lengths`` lies outside ``[0, kv_len]`` or that read a
    page index outside ``[0, num_pages)`` (computed from the integers only; no key or
    value is read). Their outputs are NaN under ``jit``."""
    lens = jnp.asarray(kv_lengths, jnp.int32)
    pt = jnp.asarray(page_table, jnp.int32)
    used = (jnp.arange(layout.pages_per_seq, dtype=jnp.int32)[None, :] * layout.page_size
            < lens[:, None])
    wrong = used & ((pt < 0) | (pt >= layout.num_pages))
    return (lens < 0) | (lens > layout.kv_len) | jnp.any(wrong, axis=1)


def safe_table(page_table, num_pages: int) -> jax.Array:
    """int32 page table with every entry outside ``[0, num_pages)`` replaced by page 0: such
    an entry is either past its row's fill (its keys are invisible) or in a row that
    :func:`paged_bad_rows` flags and whose output is NaN; it never feeds a result."""
    pt = jnp.asarray(page_table, jnp.int32)
    return jnp.where((pt >= 0) & (pt < num_pages), pt, 0)


def gather_pages(pages: ArrayLike, page_table: ArrayLike) -> jax.Array:
    """The dense keys (or values) of every row: ``[B, pages_per_seq * page_size, N_kv, H]``
    with slot ``s`` of row ``b`` = ``pages[page_table[b, s // page_size], s % page_size]``.

    Args:
      pages: ``[num_pages, page_size, N_kv, H]``, or a
        :class:`jaxpos.core.quantised.QuantisedPages` pool (the gathered rows only are
        dequantised, to its ``dtype``).
      page_table: integer ``[B, pages_per_seq]``. Entries outside ``[0, num_pages)`` read
        page 0: use this only where such entries are past the row's fill (masked by
        ``kv_lengths``), as :func:`jaxpos.attention` does (it makes rows that read a bad
        entry NaN).

    Returns:
      ``[B, pages_per_seq * page_size, N_kv, H]`` in the pages' dtype.
    """
    pool: Any = as_pool(pages)
    pt = safe_table(page_table, pool.shape[0])
    B, n = pt.shape
    return take_pages(pool, pt).reshape((B, n * pool.shape[1]) + pool.shape[2:])


def _poison(out: jax.Array, bad: jax.Array | None) -> jax.Array:
    if bad is None:
        return out
    return jnp.where(bad[:, None, None, None], jnp.array(jnp.nan, out.dtype), out)


def paged_attention(q: ArrayLike, k_pages: ArrayLike, v_pages: ArrayLike, *,
                    page_table: ArrayLike, kv_lengths: ArrayLike | None,
                    q_positions: ArrayLike | None = None,
                    kv_positions: ArrayLike | None = None,
                    implementation: str | None = None, **options: Any) -> jax.Array:
    """Attention of ``q`` against keys and values stored in pages (see the module
    docstring for the layout and the paths); reached through :func:`jaxpos.attention`
    with ``page_table=``.

    Args:
      q: ``[B, Tq, N, H]`` float.
      k_pages, v_pages: ``[num_pages, page_size, N_kv, H]`` / ``[..., H_v]`` float, or
        :class:`jaxpos.core.quantised.QuantisedPages` pools (int8 / float8 values with a
        float32 scale per token and KV head, dequantised per key block by the engines
        that read pages, per gathered row by the fallback).
      page_table: integer ``[B, pages_per_seq]``.
      kv_lengths: integer ``[B]``, required: the filled slots of each row.
      q_positions: integer ``[Tq]`` or ``[B, Tq]``; default ``kv_lengths[b] - Tq +
        arange(Tq)`` (the queries are the last ``Tq`` tokens of each row's fill) when
        ``Tq < pages_per_seq * page_size``, as in the dense call.
      kv_positions: integer ``[S]`` or ``[B, S]`` with ``S = pages_per_seq * page_size``
        (slot order, not page order); default ``arange(S)``.
      implementation: as :func:`jaxpos.attention`.
      **options: every other keyword of :func:`jaxpos.attention` (``position``,
        ``score_mod``, ``mask_mod``, ``sinks``, ``causal``, ``mask`` and segment ids in the
        logical ``[B, S]`` slot space, ``scale``, ``block_q``, ``block_k`` (the chunked
        decode path rounds it down to whole pages, at least one), ``rope_tables``,
        dropout).

    Returns:
      ``[B, Tq, N, H_v]`` in q's dtype; NaN rows for traced bad lengths or page indices.

    Raises:
      ValueError / TypeError: :func:`check_paged_inputs`'s errors; ``kv_lengths`` missing;
        every error of the dense call (:func:`jaxpos.attention`).
    """
    if kv_lengths is None:
        raise ValueError("kv_lengths is required with page_table: integer [B], the number of "
                         "filled slots of each row (FlashAttention's cache_seqlens).")
    layout = check_paged_inputs(q, k_pages, v_pages, page_table, kv_lengths)
    q = jnp.asarray(q)
    k_pages, v_pages = as_pool(k_pages), as_pool(v_pages)
    concrete = _checks.is_concrete(kv_lengths) and _checks.is_concrete(page_table)
    bad = None if concrete else paged_bad_rows(page_table, kv_lengths, layout)
    call = paged_call(q, k_pages, v_pages, layout, kv_lengths, q_positions=q_positions,
                      kv_positions=kv_positions, **options)
    engine = engines.select_engine(call, implementation)
    table = safe_table(page_table, layout.num_pages)
    return _poison(run_paged(engine, call, k_pages, v_pages, table), bad)


def paged_call(q: jax.Array, k_pages: Any, v_pages: Any, layout: PagedLayout,
               kv_lengths: ArrayLike, **options: Any) -> AttentionCall:
    """The validated record of a checked paged call (:func:`check_paged_inputs`): its
    ``k`` and ``v`` are the logical ``[B, pages_per_seq * page_size, ...]`` shapes only
    (:class:`jax.ShapeDtypeStruct`; the validation reads shapes and dtypes), its
    ``kv_lengths`` clipped to ``[0, kv_len]`` (rows outside are the caller's NaN rows).
    ``options``: the dense call's keywords, positions in the logical slot space."""
    B, S = q.shape[0], layout.kv_len
    lens = jnp.clip(jnp.asarray(kv_lengths, jnp.int32), 0, S)
    # q_positions None: the dense call's default on the gathered keys (validate_call), the
    # queries at the end of each row's fill when Tq < S
    k_shape: Any = jax.ShapeDtypeStruct((B, S) + k_pages.shape[2:], k_pages.dtype)
    v_shape: Any = jax.ShapeDtypeStruct((B, S) + v_pages.shape[2:], v_pages.dtype)
    return validate_call(q, k_shape, v_shape, kv_lengths=lens, **options)


def run_paged(engine: engines.Engine, call: AttentionCall, k_pages: Any,
              v_pages: Any, table: jax.Array) -> jax.Array:
    """``engine`` on a validated paged call (:func:`paged_call`): its ``run_paged`` when it
    has one and takes the call, else (the one gather fallback for every engine) the
    engine on the keys and values gathered from the pages, the scheme's per-call
    transform applied. ``table``: int32 ``[B, pages_per_seq]``, valid page indices only
    (:func:`safe_table`). ``[B, Tq, N, H_v]`` in q's dtype."""
    if call.batch == 0 or call.q_len == 0 or call.kv_len == 0:
        return call.zeros()
    from jaxpos.core.partition import run_sharded  # per (batch, kv head) shard under a mesh

    return run_sharded(engine, call, functools.partial(_run_paged_here, engine),
                       pages=(k_pages, v_pages, table))


def _run_paged_here(engine: engines.Engine, call: AttentionCall, k_pages: jax.Array,
                    v_pages: jax.Array, table: jax.Array) -> jax.Array:
    """:func:`run_paged` on this device's rows and heads (inside a shard under a mesh)."""
    own = getattr(engine, "run_paged", None)  # an engine that reads the pages itself
    out = None if own is None else own(call, k_pages, v_pages, table)
    if out is not None:
        return out
    dense = transform_call(call.replace(k=gather_pages(k_pages, table),
                                        v=gather_pages(v_pages, table)))
    return engines.run(engine, dense)
