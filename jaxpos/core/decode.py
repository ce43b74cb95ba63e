"""The chunked engine's decode path: a few queries against a KV cache whose rows are
filled to ``kv_lengths``, at a cost that follows the filled length.

Used by :func:`jaxpos.core.chunked.run_chunked` when the call carries ``kv_lengths`` or
``rope_tables`` and has at most :data:`DECODE_MAX_Q` queries (and no block mask):

* the queries are not padded to a tile (the tile is ``[Tq, block_k]``);
* the ``g`` query heads that share a KV head are one grouped matrix
  (``[B, N_kv, g * Tq, H]``): each K/V block is read once per KV head, never repeated to
  the query heads;
* the loop runs over key blocks ``j`` with ``j * block_k < max_b kv_lengths[b]`` only:
  each block is a ``dynamic_slice`` of the cache (no padded or blocked copy of the whole
  cache per step), blocks past the longest filled row are skipped by ``lax.cond`` (a
  step of a 32k cache filled to 1k computes 1k), and keys at index ``>= kv_lengths[b]``
  are invisible to row ``b``;
* with ``rope_tables`` the queries are rotated once and each key block as it is sliced
  (no pass over the unfilled cache, no sin/cos: the tables are computed once per call).

The online softmax is the tile library's (:mod:`jaxpos.core.tiles`; Rabe & Staats 2021;
Milakov & Gimelshein 2018); the score_mod, mask_mod, masks, segments, sinks and a scheme's
content bias and value term are applied per block by :mod:`jaxpos.core.reference`'s tile functions.
Differentiable (``lax.scan`` over ``lax.cond``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxpos.core.call import AttentionCall
from jaxpos.core.quantised import take_pages
from jaxpos.core.reference import Terms, call_terms, visible
from jaxpos.core.tiles import online_softmax_step, softmax_finish, softmax_start
from jaxpos.mods import apply_mod
from jaxpos.schemes.rope import rotate

__all__ = ["DECODE_BLOCK_K", "DECODE_MAX_Q", "decode_shaped", "page_loader",
           "run_chunked_decode", "run_paged_decode"]

#: Most queries per row the decode path takes (longer calls use the tiled chunked path).
DECODE_MAX_Q = 16
#: Keys per block of the decode path (``block_k`` overrides it): with a few queries a
#: block's scores are small, and fewer, longer blocks cost less loop overhead.
DECODE_BLOCK_K = 512


def decode_shaped(call: AttentionCall) -> bool:
    """Whether :func:`run_chunked_decode` runs ``call``."""
    return (call.q_len <= DECODE_MAX_Q and call.block_mask is None
            and getattr(call, "dropout", None) is None  # dropout: the tiled path's keep mask
            and (call.kv_lengths is not None or call.rope_tables is not None))


def _slice(x: jax.Array, start, size: int, axis: int) -> jax.Array:
    """``size`` entries of ``x`` from ``start`` along ``axis`` (a broadcast axis as is)."""
    if x.shape[axis] == 1:
        return x
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _maybe_slice(x, start, size: int, axis: int):
    return None if x is None else _slice(x, start, size, axis)


def _block_scores(call: AttentionCall, terms: Terms, qs: jax.Array, qg: jax.Array,
                  k_j: jax.Array, kp_j: jax.Array, vis: jax.Array) -> jax.Array:
    """float32 ``[B, N, Tq, bk]`` scores of one key block: the grouped queries ``qg [B,
    N_kv, g Tq, H]`` against ``k_j [B, bk, N_kv, H]``, the score_mod, the scheme's content
    bias (from ``qs [B, N, Tq, H]``), ``-inf`` where ``vis`` is False or a mod hid the
    pair."""
    B, N, Tq, _ = qs.shape
    kg = jnp.swapaxes(k_j.astype(jnp.float32), 1, 2)  # [B, Nk, bk, H]
    s = jnp.einsum("bkqh,bkth->bkqt", qg, kg, preferred_element_type=jnp.float32)
    s = s.reshape(B, N, Tq, k_j.shape[1])
    if terms.score is not None:
        s = apply_mod(terms.score, call.q_positions, kp_j, score=s)
    cb = call.scheme.content_bias(qs, call.q_positions, kp_j)
    if cb is not None:
        s = s + cb
    return jnp.where(vis & (s != -jnp.inf), s, -jnp.inf)


def _block_visibility(call: AttentionCall, terms, lim: jax.Array, bk: int, j: jax.Array):
    """``(start, kv positions [B|1, bk], vis [B|1, N|1, Tq, bk])`` of key block ``j`` of
    ``bk`` slots (rows filled to ``lim``), from positions, masks and segments only: no key
    or value is read."""
    Tk = call.k.shape[1]
    start = jnp.minimum(j * bk, Tk - bk)  # the last block may overlap the one before
    idx = start + jnp.arange(bk, dtype=jnp.int32)
    valid = (idx >= j * bk)[None, :] & (idx[None, :] < lim[:, None])  # [B, bk]
    kp_j = _slice(call.kv_positions, start, bk, 1)
    mask_j = _maybe_slice(call.mask, start, bk, 3)
    seg_kv = _maybe_slice(call.kv_segment_ids, start, bk, 1)
    vis = visible(call.causal, call.q_positions, kp_j, valid, mask_j, call.segment_ids, seg_kv,
                  terms.mask, (call.batch, call.num_heads))
    assert vis is not None  # (valid is always given)
    return start, kp_j, vis


def run_chunked_decode(call: AttentionCall, load_kv: Callable | None = None,
                       block_k: int | None = None) -> jax.Array:
    """``[B, Tq, N, H_v]`` in q's dtype for a transformed, decode-shaped call
    (:func:`decode_shaped`); q and k unrotated when the call has ``rope_tables``.

    ``load_kv(start, size) -> (k_j, v_j)``, ``[B, size, N_kv, H]`` / ``[B, size, N_kv, H_v]``:
    the keys and values of slots ``start .. start + size - 1`` (default: slices of
    ``call.k`` and ``call.v``; :mod:`jaxpos.core.paged` gathers them from pages, when
    ``call.k`` / ``call.v`` only carry the shapes). ``block_k`` overrides the block size;
    a block start is ``min(j * block_k, Tk - block_k)``, so a page-aligned size gives
    page-aligned starts. A block none of whose pairs is visible (past every row's fill,
    outside a sliding window, another segment, ...) is decided from positions alone and
    never loaded; in a loaded block, the keys and values of slots no query of a row sees
    are zeroed for that row, so they never reach its result or its gradients (not even
    as ``0 * NaN``)."""
    B, Tq, N, H = call.q.shape
    Tk, Nk = call.k.shape[1], call.k.shape[2]
    g, Hv = N // Nk, call.v.shape[3]
    bk = block_k or min(call.block_k or DECODE_BLOCK_K, Tk)
    nb = -(-Tk // bk)
    if load_kv is None:
        load_kv = lambda start, size: (_slice(call.k, start, size, 1),
                                       _slice(call.v, start, size, 1))
    tabs = call.rope_tables
    q = call.q if tabs is None else rotate(call.q, tabs.q_cos, tabs.q_sin, layout="half")
    qs = jnp.swapaxes(q.astype(jnp.float32), 1, 2) * jnp.float32(call.scale)  # [B, N, Tq, H]
    qg = qs.reshape(B, Nk, g * Tq, H)
    lim = (jnp.full((B,), Tk, jnp.int32) if call.kv_lengths is None
           else call.kv_lengths.astype(jnp.int32))
    stop = jnp.max(lim)
    terms = call_terms(call, Tq, bk)
    q_pos = call.q_positions

    def block(carry, start, kp_j, vis):
        k_j, v_j = load_kv(start, bk)
        if tabs is not None:
            k_j = rotate(k_j, _slice(tabs.k_cos, start, bk, 1), _slice(tabs.k_sin, start, bk, 1),
                         layout="half")
        seen = jnp.any(vis, axis=(1, 2))  # [B|1, bk]: slots some query of the row sees
        # keys too: dq = ds @ k meets a zero ds there (0 * NaN = NaN in the gradient)
        k_j = jnp.where(seen[:, :, None, None], k_j, jnp.zeros((), k_j.dtype))
        v_j = jnp.where(seen[:, :, None, None], v_j, jnp.zeros((), v_j.dtype))
        vg = jnp.swapaxes(v_j.astype(jnp.float32), 1, 2)  # [B, Nk, bk, H_v]
        s = _block_scores(call, terms, qs, qg, k_j, kp_j, vis)

        def values(p):
            o = jnp.einsum("bkqt,bkth->bkqh", p.reshape(B, Nk, g * Tq, bk), vg,
                           preferred_element_type=jnp.float32).reshape(B, N, Tq, Hv)
            vt = call.scheme.value_term(p, q_pos, kp_j)
            return o if vt is None else o + vt

        return online_softmax_step(carry, s, values)

    def visit(j, carry):
        start, kp_j, vis = _block_visibility(call, terms, lim, bk, j)
        return jax.lax.cond(jnp.any(vis), block, lambda c, *_: c, carry, start, kp_j, vis)

    def step(carry, j):
        return jax.lax.cond(j * bk < stop, visit, lambda j, c: c, j, carry), None

    init = softmax_start((B, N, Tq), Hv, call.sinks)
    state, _ = jax.lax.scan(step, init, jnp.arange(nb, dtype=jnp.int32))
    return jnp.swapaxes(softmax_finish(state)[0], 1, 2).astype(call.q.dtype)


def page_loader(k_pages: jax.Array, v_pages: jax.Array, table: jax.Array, page_size: int,
                buffered: bool) -> Callable:
    """``load(start, size) -> (k, v)`` ``[B, size, N_kv, H]``: slots ``start .. start +
    size - 1`` of every row (page-aligned ``start`` and ``size``), one indexed load of
    ``size // page_size`` pages per row from a page table ``table`` int32 ``[B,
    pages_per_seq]`` whose entries are all in ``[0, num_pages)``; ``buffered``: into a
    buffer for the keys (read more than once, e.g. rotated on load). Quantised pages
    (:class:`jaxpos.core.quantised.QuantisedPages`) are dequantised as the block is
    loaded: values and scales of its pages gathered, multiplied in float32."""
    B = table.shape[0]

    def load(start, size):
        n = size // page_size
        k_shape, v_shape = (B, size) + k_pages.shape[2:], (B, size) + v_pages.shape[2:]

        def gather(pages, shape, start):
            pt = jax.lax.dynamic_slice_in_dim(table, start // page_size, n, axis=1)  # [B, n]
            # the table is safe (every index in bounds, the caller's promise); quantised
            # pages are dequantised here, this block's pages only
            return take_pages(pages, pt, mode="promise_in_bounds").reshape(shape)

        v = gather(v_pages, v_shape, start)  # read once: fused into its one consumer
        if not buffered:
            return gather(k_pages, k_shape, start), v
        # The keys gathered once into a buffer (a conditional's results are buffers): fused
        # into their consumers, XLA would gather each element once per use (RoPE on load
        # reads each key twice). The other branch is never taken (start >= 0).
        k = jax.lax.cond(start >= 0, functools.partial(gather, k_pages, k_shape),
                         lambda _: jnp.zeros(k_shape, k_pages.dtype), start)
        return k, v

    return load


def run_paged_decode(call: AttentionCall, k_pages: jax.Array, v_pages: jax.Array,
                     page_table: jax.Array) -> jax.Array:
    """:func:`run_chunked_decode` reading key blocks from pages: a block is a whole number
    of pages (``call.block_k`` or :data:`DECODE_BLOCK_K` rounded down to whole pages, at
    least one), gathered by one indexed load per row. ``call`` is decode-shaped
    (:func:`decode_shaped`) with no per-call key transform; its ``k`` and ``v`` carry the
    logical ``[B, pages_per_seq * page_size, ...]`` shapes only. ``page_table`` int32
    ``[B, pages_per_seq]`` holds valid page indices only."""
    ps = k_pages.shape[1]
    pages_per_block = max(1, (call.block_k or DECODE_BLOCK_K) // ps)
    bk = min(pages_per_block, page_table.shape[1]) * ps
    load = page_loader(k_pages, v_pages, page_table, ps, buffered=call.rope_tables is not None)
    return run_chunked_decode(call, load_kv=load, block_k=bk)
