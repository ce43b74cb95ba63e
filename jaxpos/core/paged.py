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

Paths:

* ``"chunked"`` (the CPU default) with at most :data:`jaxpos.core.decode.DECODE_MAX_Q`
  queries: :func:`jaxpos.core.decode.run_chunked_decode` walks the page table block by
  block (a block is a whole number of pages, gathered by one indexed load): blocks past
  the longest row's fill are skipped by ``lax.cond``, and a block no query can see (a
  sliding window, segments, causality) is decided from positions and never loaded. K/V
  heads are never repeated to the query heads.
* otherwise (``"reference"``, more queries, a block mask, dropout, a scheme whose
  per-call transform rewrites the keys, such as ``RoPE`` given raw keys): the pages are
  gathered and the dense call runs. Caches store RoPE keys rotated at write (then pass
  ``position=None``), or pass ``rope_tables`` to rotate each block on load.
* an engine with ``run_paged(call, k_pages, v_pages, page_table)`` reads the pages itself
  when that returns an output: ``"pallas"``'s is the kernel's paged entry (key tiles of
  one page read through the page table; forward only, for serving) when the page size is
  a power of two, the pages are in q's dtype and the call has no block mask, dropout or
  key-transforming scheme; otherwise (None) the engine runs on the gathered keys.

Bad input: page shapes that disagree with each other or with q, a page table or lengths of
the wrong shape or dtype raise ``ValueError`` / ``TypeError`` always; with concrete values,
a ``kv_lengths`` entry outside ``[0, pages_per_seq * page_size]`` or a page index that a
row reads outside ``[0, num_pages)`` raises ``ValueError``. Under ``jit`` (traced values)
such a row's output is NaN (the rule of an overflowing KV cache), and nothing is clamped
onto another page: the bad index is never used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos.core.call import AttentionCall, validate_call
from jaxpos.core.decode import DECODE_BLOCK_K, decode_shaped, run_chunked_decode
from jaxpos.schemes.base import PositionScheme

__all__ = ["PagedLayout", "check_paged_inputs", "gather_pages", "paged_attention",
           "paged_bad_rows"]


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
        page_size, N_kv, H_v]`` float.
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
      TypeError: non-floating q or pages; a non-integer page table or kv_lengths.
    """
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


def _safe_table(page_table, num_pages: int) -> jax.Array:
    """int32 page table with every entry outside ``[0, num_pages)`` replaced by page 0: such
    an entry is either past its row's fill (its keys are invisible) or in a row that
    :func:`paged_bad_rows` flags and whose output is NaN; it never feeds a result."""
    pt = jnp.asarray(page_table, jnp.int32)
    return jnp.where((pt >= 0) & (pt < num_pages), pt, 0)


def gather_pages(pages: ArrayLike, page_table: ArrayLike) -> jax.Array:
    """The dense keys (or values) of every row: ``[B, pages_per_seq * page_size, N_kv, H]``
    with slot ``s`` of row ``b`` = ``pages[page_table[b, s // page_size], s % page_size]``.

    Args:
      pages: ``[num_pages, page_size, N_kv, H]``.
      page_table: integer ``[B, pages_per_seq]``. Entries outside ``[0, num_pages)`` read
        page 0: use this only where such entries are past the row's fill (masked by
        ``kv_lengths``), as :func:`jaxpos.attention` does (it makes rows that read a bad
        entry NaN).

    Returns:
      ``[B, pages_per_seq * page_size, N_kv, H]`` in the pages' dtype.
    """
    pages = jnp.asarray(pages)
    pt = _safe_table(page_table, pages.shape[0])
    B, n = pt.shape
    return pages[pt].reshape((B, n * pages.shape[1]) + pages.shape[2:])


def _page_loader(k_pages, v_pages, table: jax.Array, page_size: int,
                 buffered: bool) -> Callable:
    """``load(start, size) -> (k, v)`` ``[B, size, N_kv, H]``: slots ``start .. start +
    size - 1`` of every row (page-aligned ``start`` and ``size``), one indexed load of
    ``size // page_size`` pages per row; ``buffered``: into a buffer (for keys that are
    read more than once, e.g. rotated on load)."""
    B = table.shape[0]

    def load(start, size):
        n = size // page_size
        k_shape, v_shape = (B, size) + k_pages.shape[2:], (B, size) + v_pages.shape[2:]

        def gather(start):
            pt = jax.lax.dynamic_slice_in_dim(table, start // page_size, n, axis=1)  # [B, n]
            # the table is safe (_safe_table): every index is in bounds
            k = k_pages.at[pt].get(mode="promise_in_bounds")
            v = v_pages.at[pt].get(mode="promise_in_bounds")
            return k.reshape(k_shape), v.reshape(v_shape)

        if not buffered:  # fused into its one consumer
            return gather(start)
        # Gathered once into a buffer (a conditional's results are buffers): fused into
        # its consumers, XLA would gather each element once per use (RoPE on load reads
        # each key twice). The other branch is never taken (start >= 0).
        return jax.lax.cond(start >= 0, gather,
                            lambda _: (jnp.zeros(k_shape, k_pages.dtype),
                                       jnp.zeros(v_shape, v_pages.dtype)), start)

    return load


def _transforms_keys(scheme: PositionScheme) -> bool:
    return type(scheme).transform_qk is not PositionScheme.transform_qk


def _poison(out: jax.Array, bad: jax.Array | None) -> jax.Array:
    if bad is None:
        return out
    return jnp.where(bad[:, None, None, None], jnp.array(jnp.nan, out.dtype), out)


def paged_attention(attention: Callable[..., jax.Array], q: ArrayLike, k_pages: ArrayLike,
                    v_pages: ArrayLike, *, page_table: ArrayLike, kv_lengths: ArrayLike | None,
                    q_positions: ArrayLike | None = None,
                    kv_positions: ArrayLike | None = None,
                    implementation: str | None = None, block_q: int | None = None,
                    block_k: int | None = None, **options: Any) -> jax.Array:
    """Attention of ``q`` against keys and values stored in pages (see the module
    docstring for the layout and the paths); reached through :func:`jaxpos.attention`
    with ``page_table=``.

    Args:
      attention: :func:`jaxpos.attention` (its entry passes itself), which runs the call on
        the gathered keys when the paged kernel does not take it.
      q: ``[B, Tq, N, H]`` float.
      k_pages, v_pages: ``[num_pages, page_size, N_kv, H]`` / ``[..., H_v]`` float.
      page_table: integer ``[B, pages_per_seq]``.
      kv_lengths: integer ``[B]``, required: the filled slots of each row.
      q_positions: integer ``[Tq]`` or ``[B, Tq]``; default ``kv_lengths[b] - Tq +
        arange(Tq)`` (the queries are the last ``Tq`` tokens of each row's fill) when
        ``Tq < pages_per_seq * page_size``, as in the dense call.
      kv_positions: integer ``[S]`` or ``[B, S]`` with ``S = pages_per_seq * page_size``
        (slot order, not page order); default ``arange(S)``.
      implementation, block_q, block_k: as :func:`jaxpos.attention`; the chunked path's
        ``block_k`` is rounded down to whole pages (at least one).
      **options: every other keyword of :func:`jaxpos.attention` (``position``,
        ``score_mod``, ``mask_mod``, ``sinks``, ``causal``, ``mask`` and segment ids in the
        logical ``[B, S]`` slot space, ``scale``, ``rope_tables``, dropout).

    Returns:
      ``[B, Tq, N, H_v]`` in q's dtype; NaN rows for traced bad lengths or page indices.

    Raises:
      ValueError / TypeError: :func:`check_paged_inputs`'s errors; ``kv_lengths`` missing;
        every error of the dense call (:func:`jaxpos.attention`).
    """
    from jaxpos.core import engines

    if kv_lengths is None:
        raise ValueError("kv_lengths is required with page_table: integer [B], the number of "
                         "filled slots of each row (FlashAttention's cache_seqlens).")
    layout = check_paged_inputs(q, k_pages, v_pages, page_table, kv_lengths)
    q, k_pages, v_pages = jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages)
    B, Tq = q.shape[:2]
    S, ps = layout.kv_len, layout.page_size
    concrete = _checks.is_concrete(kv_lengths) and _checks.is_concrete(page_table)
    bad = None if concrete else paged_bad_rows(page_table, kv_lengths, layout)
    lens = jnp.clip(jnp.asarray(kv_lengths, jnp.int32), 0, S)
    # q_positions None: the dense call's default on the gathered keys (validate_call), the
    # queries at the end of each row's fill when Tq < S
    # the logical [B, S] keys and values, shapes only: validate_call reads shapes and dtypes
    k_shape: Any = jax.ShapeDtypeStruct((B, S) + k_pages.shape[2:], k_pages.dtype)
    v_shape: Any = jax.ShapeDtypeStruct((B, S) + v_pages.shape[2:], v_pages.dtype)
    call = validate_call(q, k_shape, v_shape, q_positions=q_positions,
                         kv_positions=kv_positions, block_q=block_q, block_k=block_k,
                         kv_lengths=lens, **options)
    engine = engines.select_engine(call, implementation)
    name = engine.name
    if B == 0 or Tq == 0:
        return call.zeros()
    table = _safe_table(page_table, layout.num_pages)
    if name == "chunked" and decode_shaped(call) and not _transforms_keys(call.scheme):
        pages_per_block = max(1, (block_k or DECODE_BLOCK_K) // ps)
        bk = min(pages_per_block, layout.pages_per_seq) * ps
        load = _page_loader(k_pages, v_pages, table, ps,
                            buffered=call.rope_tables is not None)
        out = run_chunked_decode(call, load_kv=load, block_k=bk)
        return _poison(out, bad)
    run_paged = getattr(engine, "run_paged", None)  # an engine that reads pages itself
    out = None if run_paged is None else run_paged(call, k_pages, v_pages, table)
    if out is not None:
        return _poison(out, bad)
    out = _dense(attention, call, name, gather_pages(k_pages, table),
                 gather_pages(v_pages, table), options, block_q, block_k)
    return _poison(out, bad)


def _dense(attention: Callable, call: AttentionCall, name: str, k, v, options, block_q,
           block_k) -> jax.Array:
    """The dense call on the gathered keys and values, with the validated positions and
    lengths (the reference of the paged call)."""
    return attention(call.q, k, v, q_positions=call.q_positions,
                     kv_positions=call.kv_positions, kv_lengths=call.kv_lengths,
                     implementation=name, block_q=block_q, block_k=block_k, **options)
