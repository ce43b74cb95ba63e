"""The ragged call: prefill chunks and decode tokens of different rows in one call,
``jaxpos.attention(q, k_pages, v_pages, *, page_table, kv_lengths, cu_q_lengths, ...)``.

The layout is JAX's ``ragged_paged_attention`` (and vLLM's TPU kernel's): the queries of
every row are packed along one axis, ``q [total_q, N, H]``, and ``cu_q_lengths [B + 1]``
(``cu_q_lens``) cuts them into rows: row ``b``'s queries are
``q[cu_q_lengths[b]:cu_q_lengths[b + 1]]``, its ``n_b`` newest tokens, already written
into its pages and counted in ``kv_lengths[b]``. The pages, ``page_table`` and
``kv_lengths`` are the paged call's (:mod:`jaxpos.core.paged`).

Positions are data: ``q_positions`` int ``[total_q]`` (default: each row's queries at the
end of its fill, token ``t`` of row ``b`` at ``kv_lengths[b] - n_b + (t -
cu_q_lengths[b])``, as in ``flash_attn_with_kvcache``) and ``kv_positions`` int ``[S]`` or
``[B, S]`` per slot (``S = pages_per_seq * page_size``; default ``arange(S)``), so a row's
tokens may sit anywhere (a shifted shared prefix, tree or speculative branches, a
StreamingLLM window).

Meaning: each row's output equals the dense call of that row, ``jaxpos.attention(q_b[None],
k_b, v_b, kv_lengths=kv_lengths[b:b+1], q_positions=..., kv_positions=..., **same
keywords)`` on its gathered keys, with every scheme, score_mod, mask_mod (their ``batch``
argument is the row ``b``), sinks, window and ``causal`` as given (pass ``causal=True`` for
the usual step: causal among the new tokens and over the cache). A row with no new
queries contributes nothing.

How it runs: the packed queries are cut into blocks of ``block_q`` queries that never
straddle rows (static shapes: at most ``total_q // block_q + B`` blocks, ``block_q`` the
mean new queries per row, at most 16; slots past a row's end repeat its last query and are
dropped), and the blocks are run as one paged call ``[blocks, block_q, N, H]``, each with
its row's page table, fill and key positions, so a prefill chunk reads its row's pages
once per block, not once per query (a step of one token per row has ``block_q = 1``: one
query per row). Every engine runs it through the engine protocol
(:func:`jaxpos.core.paged.run_paged`): the chunked engine's paged decode path walks each
block's pages, the Pallas kernel's paged entry reads them per block, and the others take
the one gather fallback.

Bad input: shapes and dtypes always; with concrete values, ``cu_q_lengths`` not starting
at 0, decreasing or not ending at ``total_q``, and a row with more new queries than filled
slots (``n_b > kv_lengths[b]``) raise ``ValueError``, as do the paged call's bad lengths
and page indices. Under ``jit`` (traced values) the queries of such a row are NaN, and
every query is NaN when ``cu_q_lengths`` itself is malformed (the rule of an overflowing
KV cache); nothing is clamped onto another row.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos.core import engines
from jaxpos.core.decode import DECODE_MAX_Q
from jaxpos.core.paged import (
    check_paged_inputs,
    paged_bad_rows,
    paged_call,
    run_paged,
    safe_table,
)
from jaxpos.core.quantised import as_pool

__all__ = ["check_cu_q_lengths", "ragged_attention"]

#: Keywords of the dense call a ragged call does not take (they are laid out per row of a
#: ``[B, Tq]`` call): what to use instead.
_REFUSED = {
    "mask": "express it as a mask_mod of positions",
    "segment_ids": "rows are the segments of a ragged call; use a mask_mod for more",
    "kv_segment_ids": "rows are the segments of a ragged call; use a mask_mod for more",
    "block_mask": "a block mask is built for a [B, N, Tq, Tk] call",
}


def check_cu_q_lengths(cu_q_lengths: ArrayLike, batch: int, total_q: int,
                       kv_lengths: ArrayLike) -> None:
    """Check ``cu_q_lengths``: integer ``[batch + 1]``; when concrete, starting at 0,
    non-decreasing, ending at ``total_q``, and no row with more new queries than filled
    slots (``kv_lengths`` concrete).

    Raises:
      ValueError: a wrong shape or one of the value rules above (naming the row).
      TypeError: not an integer array.
    """
    _checks.check_rank("cu_q_lengths", cu_q_lengths, (1,), "[batch + 1]")
    dt = _checks.dtype_of(cu_q_lengths)
    if dt == np.bool_ or not jnp.issubdtype(dt, jnp.integer):
        raise TypeError(f"cu_q_lengths must be an integer array [batch + 1] (cumulative query "
                        f"counts); got dtype {dt}.")
    if _checks.shape_of(cu_q_lengths) != (batch + 1,):
        raise ValueError(f"cu_q_lengths must have shape [batch + 1] = [{batch + 1}] (page_table "
                         f"has {batch} rows); got {_checks.shape_of(cu_q_lengths)}.")
    if not _checks.is_concrete(cu_q_lengths):
        return
    cu = np.asarray(cu_q_lengths).astype(np.int64)
    if cu[0] != 0:
        raise ValueError(f"cu_q_lengths must start at 0; got cu_q_lengths[0] = {int(cu[0])}.")
    n = np.diff(cu)
    if (n < 0).any():
        b = int(np.argmax(n < 0))
        raise ValueError(f"cu_q_lengths must not decrease; got cu_q_lengths[{b}] = "
                         f"{int(cu[b])} > cu_q_lengths[{b + 1}] = {int(cu[b + 1])}.")
    if cu[-1] != total_q:
        raise ValueError(f"cu_q_lengths must end at total_q = {total_q} (q's first axis); got "
                         f"cu_q_lengths[{batch}] = {int(cu[-1])}.")
    if _checks.is_concrete(kv_lengths):
        lens = np.asarray(kv_lengths).astype(np.int64)
        over = n > lens
        if over.any():
            b = int(np.argmax(over))
            raise ValueError(
                f"row {b} has {int(n[b])} new queries (cu_q_lengths[{b + 1}] - "
                f"cu_q_lengths[{b}]) but kv_lengths[{b}] = {int(lens[b])} filled slots: its "
                f"queries are the last tokens of its fill, written into its pages first.")


def _rows(cu, total_q: int, B: int):
    """``(row_of [total_q], offset [total_q])``: each query's row and its index in the
    row; NumPy when ``cu`` is concrete (positions stay known under ``jit``)."""
    if _checks.is_concrete(cu):
        c = np.asarray(cu).astype(np.int64)
        row = np.repeat(np.arange(B), np.diff(c)).astype(np.int32)
        return row, (np.arange(total_q) - c[row]).astype(np.int32)
    c = jnp.asarray(cu, jnp.int32)
    t = jnp.arange(total_q, dtype=jnp.int32)
    row = jnp.clip(jnp.searchsorted(c[1:], t, side="right"), 0, max(B - 1, 0)).astype(jnp.int32)
    return row, t - c[row]


def _take(x, row):
    """``x[row]`` in NumPy when both are NumPy, else in JAX."""
    if isinstance(x, np.ndarray) and isinstance(row, np.ndarray):
        return x[row]
    return jnp.asarray(x)[row]


def _bad_queries(cu, kv_lengths, page_table, layout, row, total_q: int):
    """bool ``[total_q]``: queries whose row is malformed (traced values only): the row's
    lengths or page indices (:func:`jaxpos.core.paged.paged_bad_rows`), more new queries
    than filled slots, and every query when ``cu_q_lengths`` is malformed."""
    c = jnp.asarray(cu, jnp.int32)
    n = jnp.diff(c)
    bad_rows = paged_bad_rows(page_table, kv_lengths, layout) | \
        (n > jnp.asarray(kv_lengths, jnp.int32))
    malformed = (c[0] != 0) | jnp.any(n < 0) | (c[-1] != total_q)
    return bad_rows[row] | malformed


def ragged_attention(q: ArrayLike, k_pages: ArrayLike, v_pages: ArrayLike, *,
                     page_table: ArrayLike, kv_lengths: ArrayLike | None,
                     cu_q_lengths: ArrayLike, q_positions: ArrayLike | None = None,
                     kv_positions: ArrayLike | None = None,
                     implementation: str | None = None, rope_tables: Any = None,
                     **options: Any) -> jax.Array:
    """The ragged call (see the module docstring); reached through
    :func:`jaxpos.attention` with ``page_table=`` and ``cu_q_lengths=``.

    Args:
      q: ``[total_q, N, H]`` float, the packed queries of every row.
      k_pages, v_pages: ``[num_pages, page_size, N_kv, H]`` / ``[..., H_v]`` in q's dtype.
      page_table: integer ``[B, pages_per_seq]``.
      kv_lengths: integer ``[B]``, required: each row's filled slots, its new tokens
        included.
      cu_q_lengths: integer ``[B + 1]``: row ``b``'s queries are
        ``q[cu_q_lengths[b]:cu_q_lengths[b + 1]]``.
      q_positions: integer ``[total_q]`` or None (each row's queries at the end of its
        fill).
      kv_positions: integer ``[S]`` or ``[B, S]`` (slot order) or None (``arange(S)``).
      implementation: as :func:`jaxpos.attention`.
      rope_tables: :class:`jaxpos.schemes.rope.tables.RopeTables` whose query tables are
        ``[1, total_q, half]`` (``rope_tables(q_positions [total_q], kv_positions)``) and
        key tables ``[B|1, S, half]``, or None.
      **options: ``position``, ``score_mod``, ``mask_mod``, ``sinks``, ``causal``,
        ``scale``, ``block_q``, ``block_k`` as in the dense call. Not taken: ``mask``,
        segment ids, ``block_mask``, dropout.

    Returns:
      ``[total_q, N, H_v]`` in q's dtype (NaN queries under ``jit`` as the module
      docstring says).

    Raises:
      ValueError / TypeError: :func:`check_cu_q_lengths`'s and the paged call's
        (:func:`jaxpos.core.paged.check_paged_inputs`) errors; a keyword the ragged call
        does not take; every error of the dense call.
    """
    if kv_lengths is None:
        raise ValueError("kv_lengths is required with page_table: integer [B], the number of "
                         "filled slots of each row, its new queries included.")
    for name, instead in _REFUSED.items():
        if options.get(name) is not None:
            raise ValueError(f"the ragged call (cu_q_lengths) does not take {name}: {instead}.")
    if options.get("dropout_rate", 0.0):
        raise ValueError("the ragged call (cu_q_lengths) applies no attention dropout (it "
                         "serves); pass dropout_rate=0.")
    options = {n: x for n, x in options.items() if n not in _REFUSED and
               n not in ("dropout_rate", "dropout_rng", "broadcast_dropout")}
    _checks.check_rank("q", q, (3,), "[total_q, heads, head_dim] (packed queries)")
    _checks.check_floating("q", q)
    total_q, N, H = _checks.shape_of(q)
    B = _checks.shape_of(page_table)[0] if len(_checks.shape_of(page_table)) == 2 else -1
    q_rows: Any = jax.ShapeDtypeStruct((max(B, 0), 1, N, H), _checks.dtype_of(q))
    layout = check_paged_inputs(q_rows, k_pages, v_pages, page_table, kv_lengths)
    check_cu_q_lengths(cu_q_lengths, B, total_q, kv_lengths)
    S = layout.kv_len
    kv_pos = None if kv_positions is None else \
        _checks.positions_2d("kv_positions", kv_positions, B, S)
    if q_positions is not None:
        _checks.positions_2d("q_positions", q_positions, 1, total_q)
        if len(_checks.shape_of(q_positions)) != 1:
            raise ValueError(f"q_positions of a ragged call must have shape [total_q] = "
                             f"[{total_q}]; got {_checks.shape_of(q_positions)}.")
    q = jnp.asarray(q)
    Hv = _checks.shape_of(v_pages)[-1]
    if total_q == 0 or B == 0:
        return jnp.zeros((total_q, N, Hv), q.dtype)
    k_pages, v_pages = as_pool(k_pages), as_pool(v_pages)  # (QuantisedPages as they are)
    row, offset = _rows(cu_q_lengths, total_q, B)
    lens, cu = _ints(kv_lengths), _ints(cu_q_lengths)
    qp = _take(lens, row) - _take(cu[1:] - cu[:-1], row) + offset if q_positions is None \
        else _ints(q_positions)
    bq = query_block(total_q, B)
    brow, qidx, flat = _blocks(cu, row, offset, total_q, B, bq)
    if kv_pos is not None and kv_pos.shape[0] > 1:
        kv_pos = _take(kv_pos, brow)
    call = paged_call(
        _take(q, qidx), k_pages, v_pages, layout, _take(lens, brow),
        q_positions=_take(qp, qidx), kv_positions=kv_pos,
        rope_tables=None if rope_tables is None else
        _block_tables(rope_tables, brow, qidx, total_q),
        rows=(jnp.asarray(brow, jnp.int32), jnp.clip(jnp.asarray(lens, jnp.int32), 0, S)),
        **options)
    engine = engines.select_engine(call, implementation)
    table = safe_table(_take(_ints(page_table), brow), layout.num_pages)
    out = run_paged(engine, call, k_pages, v_pages, table)
    out = _take(out.reshape((-1,) + out.shape[2:]), flat)
    if all(_checks.is_concrete(x) for x in (kv_lengths, page_table, cu_q_lengths)):
        return out  # (concrete values were checked)
    bad = _bad_queries(cu_q_lengths, kv_lengths, page_table, layout, row, total_q)
    return jnp.where(bad[:, None, None], jnp.array(jnp.nan, out.dtype), out)


def _ints(x):
    """int32 ``x``: NumPy for concrete non-JAX values (positions stay known under
    ``jit``), else a ``jax.Array``."""
    if _checks.is_concrete(x) and not isinstance(x, jax.Array):
        return np.asarray(x).astype(np.int32)
    return jnp.asarray(x, jnp.int32)


def query_block(total_q: int, batch: int) -> int:
    """Queries per block of a ragged call (static): the mean queries per row, at most
    :data:`jaxpos.core.decode.DECODE_MAX_Q` (the chunked engine's page walk takes a block
    whole), at least 1 (one query per row: a decode-only step pays no padding)."""
    return int(max(1, min(DECODE_MAX_Q, total_q // max(batch, 1))))


def _blocks(cu, row, offset, total_q: int, B: int, bq: int):
    """Cut the packed queries into blocks of ``bq`` that never straddle rows; static
    shapes: ``M = min(total_q, (total_q + B (bq - 1)) // bq)`` blocks (a row of ``n``
    queries takes ``ceil(n / bq)``; the spare blocks and the slots past a row's end repeat
    the row's last query and are dropped).

    Returns ``(brow [M], qidx [M, bq], flat [total_q])``: each block's row, the query each
    slot reads (in its row), and each query's slot in the flattened ``[M * bq]`` output.
    NumPy when ``cu`` is concrete, else JAX; malformed traced ``cu_q_lengths`` gives
    indices kept in bounds (those queries are NaN, :func:`_bad_queries`).
    """
    M = min(total_q, (total_q + B * (bq - 1)) // bq)
    xp = np if all(isinstance(x, np.ndarray) for x in (cu, row, offset)) else jnp
    n = cu[1:] - cu[:-1]
    cb = xp.concatenate([xp.zeros((1,), xp.int32),
                         xp.cumsum((n + bq - 1) // bq).astype(xp.int32)])
    i = xp.arange(M, dtype=xp.int32)
    brow = xp.clip(xp.searchsorted(cb[1:], i, side="right"), 0, B - 1).astype(xp.int32)
    slot = (i - cb[brow])[:, None] * bq + xp.arange(bq, dtype=xp.int32)[None]
    last = xp.maximum(n[brow] - 1, 0)[:, None]
    qidx = xp.clip(cu[brow][:, None] + xp.minimum(slot, last), 0, total_q - 1)
    flat = xp.clip((cb[row] + offset // bq) * bq + offset % bq, 0, M * bq - 1)
    return brow, qidx.astype(xp.int32), flat.astype(xp.int32)


def _block_tables(tabs: Any, brow, qidx, total_q: int) -> Any:
    """The ragged call's RoPE tables as the blocked call takes them: query tables
    ``[1, total_q, half]`` -> ``[M, bq, half]`` (each slot's query's), key tables
    ``[B, S, half]`` -> each block's row's (``[1, S, half]`` as they are)."""
    qc = _checks.shape_of(tabs.q_cos)
    if len(qc) != 3 or qc[0] != 1 or qc[1] != total_q:
        raise ValueError(f"rope_tables of a ragged call need query tables [1, total_q, half] = "
                         f"[1, {total_q}, half] (rope_tables(q_positions [total_q], ...)); got "
                         f"q_cos {qc}.")
    per_slot = lambda x: jnp.asarray(x)[0][jnp.asarray(qidx)]
    per_row = lambda x: x if _checks.shape_of(x)[0] == 1 else jnp.asarray(x)[brow]
    return type(tabs)(per_slot(tabs.q_cos), per_slot(tabs.q_sin), per_row(tabs.k_cos),
                      per_row(tabs.k_sin))
