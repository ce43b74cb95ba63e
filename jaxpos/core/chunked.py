"""``jaxpos.attention(..., implementation="chunked")``: the memory-efficient online
softmax over key blocks of Rabe & Staats 2021 ("Self-attention Does Not Need O(n^2)
Memory") with the blockwise recomputing backward of FlashAttention (Dao et al. 2022,
Alg. 2; FlashAttention-2, Dao 2023, Alg. 2) as a ``jax.custom_vjp``.

The scheme's score term, the user's score_mod and mask_mod, Shaw's content bias and value
term are computed per ``block_q x block_k`` tile from the position arrays
(:mod:`jaxpos.core.reference`'s tile math), so no ``[Tq, Tk]`` array exists in the forward or
the backward pass. Tiles are classified at run time (``jaxpos.mods.EMPTY`` / ``FULL`` /
``PARTIAL``, from the positions, padding, segments and block mask): empty tiles are
skipped, full ones computed without masking. :mod:`jaxpos.parallel.ring`'s ring attention runs
the same forward and backward per passing key/value block.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp

from jaxpos._util import match_vma, pad_axis, sink_gradient, zero_cotangent
from jaxpos.core.call import AttentionCall, apply_rope_tables
from jaxpos.core.decode import decode_shaped, run_chunked_decode, run_paged_decode
from jaxpos.core.dropout import Dropout, keep_tile
from jaxpos.core.engines import register_engine
from jaxpos.core.reference import (
    Masking,
    Terms,
    call_terms,
    heads_major,
    tile_output,
    tile_scores,
    visible,
)
from jaxpos.core.tiles import online_softmax_step, softmax_finish, softmax_start
from jaxpos.mods import EMPTY, FULL, PARTIAL, BlockMask
from jaxpos.schemes.base import PositionScheme

__all__ = ["BLOCK_K", "BLOCK_Q", "NEG_INF", "Blocked", "ChunkCfg", "ChunkedEngine", "blocks",
           "chunk_inputs", "chunked_attention", "chunked_backward", "chunked_forward",
           "merge_terms", "run_chunked", "split_terms", "tile_kind", "unblocks",
           "varying_zero"]

NEG_INF = -jnp.inf
# Chunked tile sizes: measured on a 2-core x86 CPU (benchmarks/attention_cpu.py), 256 x 256
# float32 tiles of 8 heads (2 MiB of scores) were as fast as any other choice forward and
# waste little work on the diagonal of a causal mask.
BLOCK_Q = 256
BLOCK_K = 256


def blocks(x: jax.Array | None, axis: int, n: int) -> jax.Array | None:
    """Split ``axis`` into ``n`` blocks and move the block index to the front."""
    if x is None:
        return None
    if x.shape[axis] == 1:  # broadcast dimension: every block sees the same slice
        return jnp.broadcast_to(x[None], (n,) + x.shape)
    shp = x.shape[:axis] + (n, x.shape[axis] // n) + x.shape[axis + 1:]
    return jnp.moveaxis(x.reshape(shp), axis, 0)


def unblocks(x: Any, axis: int) -> jax.Array:
    """Inverse of :func:`blocks` for a full (not broadcast) axis."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])


def tile_kind(causal: bool, always_mask: bool, qp: Any, kp: Any, kval: Any, sq: Any, skv: Any,
              bm_kind: Any) -> jax.Array:
    """int32 scalar: ``EMPTY``, ``FULL`` or ``PARTIAL`` for one tile.

    Conservative: a tile is only skipped when no pair in it can be visible, and only
    called full when every pair is. ``qp`` ``[B|1, tq]`` (padded query rows may make a
    tile look partly visible, never the reverse), ``kp``/``kval`` ``[B|1, tk]``,
    ``sq``/``skv`` ``[B, tq]``/``[B, tk]`` or None; ``bm_kind``: the block mask's kinds of
    this tile ``[B|1, N|1]`` or None; ``always_mask``: a mask array or a mask_mod without
    a block mask (every tile must be masked).
    """
    imax, imin = jnp.iinfo(jnp.int32).max, jnp.iinfo(jnp.int32).min
    live = jnp.any(kval, axis=-1)  # per batch row
    full = jnp.all(kval, axis=-1)
    if causal:
        kv_min = jnp.min(jnp.where(kval, kp, imax), axis=-1)
        kv_max = jnp.max(jnp.where(kval, kp, imin), axis=-1)
        live = live & (kv_min <= jnp.max(qp, axis=-1))
        full = full & (kv_max <= jnp.min(qp, axis=-1))
    if sq is not None:
        kv_smin = jnp.min(jnp.where(kval, skv, imax), axis=-1)
        kv_smax = jnp.max(jnp.where(kval, skv, imin), axis=-1)
        q_smin, q_smax = jnp.min(sq, axis=-1), jnp.max(sq, axis=-1)
        live = live & (kv_smin <= q_smax) & (q_smin <= kv_smax)  # id ranges overlap
        full = full & (q_smin == q_smax) & (kv_smin == kv_smax) & (q_smin == kv_smin)
    live, full = jnp.any(live), jnp.all(full)
    if bm_kind is not None:
        live = live & jnp.any(bm_kind != EMPTY)
        full = full & jnp.all(bm_kind == FULL)
    if always_mask:
        full = jnp.zeros((), bool)
    return jnp.where(live, jnp.where(full, FULL, PARTIAL), EMPTY).astype(jnp.int32)


class Blocked(NamedTuple):
    """The chunked engine's inputs cut into tiles (block index first; an axis of size 1
    broadcast to every block), a pytree. The field names are the Pallas kernel's
    operands' (``q_seg``, ``kv_seg``, ``drop_seed``).

    Fields: ``qs`` scaled queries float32 ``[nq, B, N, bq, H]``; ``k`` ``[nk, B, N, bk, H]``,
    ``v`` ``[nk, B, N, bk, H_v]``; ``q_pos`` int32 ``[nq, B|1, bq]``, ``kv_pos`` ``[nk, B|1,
    bk]``; ``kv_valid`` bool ``[nk, B|1, bk]`` (False on padding and unfilled slots);
    ``q_seg`` / ``kv_seg`` int32 ``[nq, B, bq]`` / ``[nk, B, bk]`` or None; ``mask`` bool
    ``[B|1, N|1, Tq_p|1, Tk_p|1]`` (padded, not blocked) or None; ``bm_kinds`` the block
    mask's tile kinds ``[B|1, N|1, nq, nk]`` or None; ``drop_seed`` the dropout seed or
    None. ``qs``, ``k`` and ``v`` are None in the integer part handed around separately."""

    qs: Any
    k: Any
    v: Any
    q_pos: Any
    kv_pos: Any
    kv_valid: Any
    q_seg: Any = None
    kv_seg: Any = None
    mask: Any = None
    bm_kinds: Any = None
    drop_seed: Any = None


class ChunkCfg(NamedTuple):
    causal: bool
    nq: int
    nk: int
    block_q: int
    block_k: int
    float_mask: tuple  # which leaves of the terms are floating (differentiable)
    terms_def: object  # treedef of the terms
    # attention dropout: (threshold, scale, broadcast) of a jaxpos.core.dropout.Dropout, whose
    # seed travels in the blocked inputs as drop_seed; None without dropout
    dropout: tuple | None = None


def split_terms(terms: Terms) -> tuple[list, list, tuple, Any]:
    """Floating leaves (differentiable) and the rest (integer tables of a mod, ...)."""
    leaves, treedef = jax.tree_util.tree_flatten(terms)
    is_f = tuple(bool(jnp.issubdtype(jnp.result_type(x), jnp.inexact)) for x in leaves)
    return ([x for x, f in zip(leaves, is_f) if f], [x for x, f in zip(leaves, is_f) if not f],
            is_f, treedef)


def merge_terms(cfg: ChunkCfg, fl: list, il: list) -> Terms:
    """The terms from their floating and other leaves (the inverse of :func:`split_terms`)."""
    fi, ii = iter(fl), iter(il)
    leaves = [next(fi) if f else next(ii) for f in cfg.float_mask]
    return jax.tree_util.tree_unflatten(cfg.terms_def, leaves)


def chunk_inputs(qs: jax.Array, k: jax.Array, v: jax.Array, m: Masking, block_q: int,
                 block_k: int) -> tuple[Blocked, int, int]:
    """The heads-major inputs padded to whole tiles and blocked: ``(Blocked, nq, nk)``."""
    _B, _N, Tq, _H = qs.shape
    Tk = k.shape[2]
    nq, nk = -(-Tq // block_q), -(-Tk // block_k)
    Tq_p, Tk_p = nq * block_q, nk * block_k
    kv_valid = m.kv_valid if m.kv_valid is not None else jnp.ones((1, Tk), bool)
    mask = m.mask
    if mask is not None:
        mask = mask if mask.shape[2] == 1 else pad_axis(mask, 2, Tq_p, False)
        mask = mask if mask.shape[3] == 1 else pad_axis(mask, 3, Tk_p, False)
    blocked = Blocked(
        qs=blocks(pad_axis(qs, 2, Tq_p), 2, nq),
        k=blocks(pad_axis(k, 2, Tk_p), 2, nk),
        v=blocks(pad_axis(v, 2, Tk_p), 2, nk),
        q_pos=blocks(pad_axis(m.q_pos, 1, Tq_p), 1, nq),
        kv_pos=blocks(pad_axis(m.kv_pos, 1, Tk_p), 1, nk),
        kv_valid=blocks(pad_axis(kv_valid, 1, Tk_p, False), 1, nk),
        q_seg=blocks(pad_axis(m.seg_q, 1, Tq_p), 1, nq) if m.seg_q is not None else None,
        kv_seg=blocks(pad_axis(m.seg_kv, 1, Tk_p, -1), 1, nk) if m.seg_kv is not None else None,
        mask=mask,
    )
    return blocked, nq, nk


def _mask_block(mask, i, j, block_q, block_k):
    if mask is None:
        return None
    if mask.shape[2] != 1:
        mask = jax.lax.dynamic_slice_in_dim(mask, i * block_q, block_q, axis=2)
    if mask.shape[3] != 1:
        mask = jax.lax.dynamic_slice_in_dim(mask, j * block_k, block_k, axis=3)
    return mask


def _tile(terms: Terms, qs_i, k_j, qp_i, kp_j, vis):
    """Scores of one tile, ``-inf`` where ``vis`` is False. Differentiable in qs, k, terms."""
    s = tile_scores(terms, qs_i, k_j, qp_i, kp_j)
    return s if vis is None else jnp.where(vis, s, NEG_INF)


def _tile_visibility(cfg: ChunkCfg, terms: Terms, b: Blocked, i, j, qp_i, kp_j, kval_j, sq_i, skv_j,
                     masked: bool):
    if not masked:
        return None
    heads = b.qs.shape[1:3]
    return visible(cfg.causal, qp_i, kp_j, kval_j,
                   _mask_block(b.mask, i, j, cfg.block_q, cfg.block_k), sq_i, skv_j,
                   terms.mask, heads)


def _tile_dropout(cfg: ChunkCfg, b: Blocked, i, j):
    """float32 ``[B|1, N|1, bq, bk]``: ``keep / (1 - rate)`` on tile ``(i, j)``, from the
    counter-based keep decisions of :func:`jaxpos.core.dropout.keep_tile` at the tile's global
    query and key indices (the reference's mask, tile by tile); None without dropout."""
    if cfg.dropout is None:
        return None
    threshold, scale, broadcast = cfg.dropout
    q_index = i * cfg.block_q + jnp.arange(cfg.block_q, dtype=jnp.int32)[:, None]
    kv_index = j * cfg.block_k + jnp.arange(cfg.block_k, dtype=jnp.int32)[None, :]
    if broadcast:
        batch = head = jnp.zeros((1, 1, 1, 1), jnp.int32)
    else:
        B, N = b.qs.shape[1], b.qs.shape[2]
        batch = jnp.arange(B, dtype=jnp.int32)[:, None, None, None]
        head = jnp.arange(N, dtype=jnp.int32)[None, :, None, None]
    keep = keep_tile(b.drop_seed, threshold, batch, head, q_index, kv_index)
    return jnp.where(keep, jnp.float32(scale), jnp.float32(0.0))


def _dropped(p, drop):
    return p if drop is None else p * drop


def _block_kind(b: Blocked, i, j):
    return None if b.bm_kinds is None else b.bm_kinds[:, :, i, j]


def varying_zero(*trees: Any) -> jax.Array:
    """A float32 scalar 0 that varies over every mesh axis any leaf of ``trees`` varies
    over under ``shard_map`` (``jnp.zeros_like`` carries the leaf's axes). Added to loop
    carries and skipped-tile outputs, it gives them the type of the computed values, as
    ``shard_map``'s default ``check_vma`` requires; elsewhere it is a constant 0."""
    z = jnp.zeros((), jnp.float32)
    for x in jax.tree_util.tree_leaves(trees):
        z = z + jnp.zeros_like(x, jnp.float32, shape=())
    return z


def _always_mask(b: Blocked, terms: Terms) -> bool:
    return b.mask is not None or (terms.mask is not None and b.bm_kinds is None)


def chunked_forward(terms: Terms, sinks: jax.Array | None, b: Blocked,
                    cfg: ChunkCfg) -> tuple[jax.Array, jax.Array]:
    """Returns out ``[nq, B, N, bq, H]`` and lse ``[nq, B, N, bq]`` (``-inf`` on empty rows
    without sinks; the sink is part of the normaliser): the tile library's online softmax
    (:mod:`jaxpos.core.tiles`) over the key tiles of each query tile, EMPTY tiles skipped."""
    B, N = b.qs.shape[1], b.qs.shape[2]
    always = _always_mask(b, terms)

    def q_block(args):
        i, qs_i, qp_i, sq_i = args

        def k_step(carry, xs):
            j, k_j, v_j, kp_j, kval_j, skv_j = xs

            def compute(state, masked):
                vis = _tile_visibility(cfg, terms, b, i, j, qp_i, kp_j, kval_j, sq_i, skv_j,
                                       masked)
                s = _tile(terms, qs_i, k_j, qp_i, kp_j, vis)
                drop = _tile_dropout(cfg, b, i, j)  # the normaliser stays undropped
                return online_softmax_step(
                    state, s, lambda p: tile_output(terms, _dropped(p, drop), v_j, qp_i, kp_j))

            kind = tile_kind(cfg.causal, always, qp_i, kp_j, kval_j, sq_i, skv_j,
                             _block_kind(b, i, j))
            branches = (lambda c: c, functools.partial(compute, masked=False),
                        functools.partial(compute, masked=True))
            return jax.lax.switch(kind, branches, carry), None

        z = varying_zero(b, terms, sinks, qs_i, qp_i, sq_i)
        init = softmax_start((B, N, cfg.block_q), b.v.shape[-1], sinks, zero=z)
        xs = (jnp.arange(cfg.nk), b.k, b.v, b.kv_pos, b.kv_valid, b.kv_seg)
        state, _ = jax.lax.scan(k_step, init, xs)
        return softmax_finish(state)

    return jax.lax.map(q_block, (jnp.arange(cfg.nq), b.qs, b.q_pos, b.q_seg))


def chunked_backward(cfg: ChunkCfg, fl: list, il: list, b: Blocked, out: jax.Array,
                     lse: jax.Array, dout: jax.Array, dlse: jax.Array | None = None) -> tuple:
    """FlashAttention-2 style recomputing backward (Dao 2023, Alg. 2), tile by tile.

    ``dlse`` (or None): the cotangent of the lse output; since ``d lse / d s = p``, it
    enters as ``ds = p (dp - (rowsum(dout o out) - dlse))``.

    Returns ``dq, dk, dv`` (blocked) and the gradients of the floating leaves ``fl`` of
    the terms."""
    terms0 = merge_terms(cfg, fl, il)
    always = _always_mask(b, terms0)
    delta = _delta(out, dout, dlse)  # [nq, B, N, bq]
    z = varying_zero(b, fl, lse, dout)
    # Under shard_map, differentiate w.r.t. copies that vary over every axis, so the tile
    # VJPs below never psum inside the (per-device) skip/compute switch; the one sum over
    # the axes a primal does not vary over happens in _chunked_core_bwd (match_vma).
    vary = lambda x: x + z.astype(x.dtype)
    fl = [vary(x) for x in fl]
    b = b._replace(qs=vary(b.qs), k=vary(b.k), v=vary(b.v))
    dk0 = jnp.zeros(b.k.shape, jnp.float32) + z
    dv0 = jnp.zeros(b.v.shape, jnp.float32) + z
    dfl0 = [jnp.zeros(jnp.shape(x), jnp.float32) + z for x in fl]
    terms = merge_terms(cfg, fl, il)

    def q_step(carry, xs):
        dk_all, dv_all, dfl = carry
        i, qs_i, qp_i, sq_i, lse_i, do_i, dl_i = xs
        lse_safe = jnp.where(jnp.isfinite(lse_i), lse_i, 0.0)

        def k_step(carry, ys):
            j, k_j, v_j, kp_j, kval_j, skv_j = ys

            def compute(carry, masked):
                dq_i, dfl = carry
                vis = _tile_visibility(cfg, terms, b, i, j, qp_i, kp_j, kval_j, sq_i, skv_j,
                                       masked)
                tile = lambda qs_, k_, fl_: _tile(merge_terms(cfg, fl_, il), qs_, k_, qp_i,
                                                   kp_j, vis)
                s, tile_vjp = jax.vjp(tile, qs_i, k_j, fl)
                p = jnp.exp(s - lse_safe[..., None])  # 0 where hidden (s = -inf)
                drop = _tile_dropout(cfg, b, i, j)  # the forward's mask, recomputed
                outf = lambda p_, v_, fl_: tile_output(merge_terms(cfg, fl_, il),
                                                       _dropped(p_, drop), v_, qp_i, kp_j)
                _, out_vjp = jax.vjp(outf, p, v_j, fl)
                dp, dv_j, dfl_v = out_vjp(do_i)
                ds = p * (dp - dl_i[..., None])
                dq_t, dk_j, dfl_s = tile_vjp(ds)
                dfl = [a + x + y for a, x, y in zip(dfl, dfl_v, dfl_s)]
                return (dq_i + dq_t, dfl), (dk_j, dv_j)

            def skip(carry):
                return carry, (jnp.zeros(k_j.shape, jnp.float32) + z,
                               jnp.zeros(v_j.shape, jnp.float32) + z)

            kind = tile_kind(cfg.causal, always, qp_i, kp_j, kval_j, sq_i, skv_j,
                              _block_kind(b, i, j))
            branches = (skip, functools.partial(compute, masked=False),
                        functools.partial(compute, masked=True))
            return jax.lax.switch(kind, branches, carry)

        ys = (jnp.arange(cfg.nk), b.k, b.v, b.kv_pos, b.kv_valid, b.kv_seg)
        (dq_i, dfl), (dk_i, dv_i) = jax.lax.scan(
            k_step, (jnp.zeros(qs_i.shape, jnp.float32) + z, dfl), ys)
        return (dk_all + dk_i, dv_all + dv_i, dfl), dq_i

    xs = (jnp.arange(cfg.nq), b.qs, b.q_pos, b.q_seg, lse, dout, delta)
    (dk, dv, dfl), dq = jax.lax.scan(q_step, (dk0, dv0, dfl0), xs)
    return dq, dk, dv, dfl


def _delta(out, dout, dlse):
    """``rowsum(dout o out) - dlse``: the backward pass's per-row term (``dlse`` may be None
    or a symbolic zero's materialisation)."""
    delta = jnp.sum(dout * out, axis=-1)
    return delta if dlse is None else delta - dlse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked_core(cfg, fl, il, sinks, qs, k, v, ints: Blocked):
    return chunked_forward(merge_terms(cfg, fl, il), sinks, ints._replace(qs=qs, k=k, v=v), cfg)


def _chunked_core_fwd(cfg, fl, il, sinks, qs, k, v, ints: Blocked):
    out, lse = chunked_forward(merge_terms(cfg, fl, il), sinks, ints._replace(qs=qs, k=k, v=v),
                               cfg)
    return (out, lse), (fl, il, sinks, qs, k, v, ints, out, lse)


def _chunked_core_bwd(cfg, res, cotangents):
    fl, il, sinks, qs, k, v, ints, out, lse = res
    dout, dlse = cotangents
    dlse = jnp.where(jnp.isfinite(lse), dlse, 0.0)  # an empty row's -inf is a constant
    dq, dk, dv, dfl = chunked_backward(cfg, fl, il, ints._replace(qs=qs, k=k, v=v), out, lse,
                                       dout, dlse)
    dfl = [match_vma(g.astype(jnp.result_type(x)), x) for g, x in zip(dfl, fl)]
    dq, dk, dv = match_vma(dq, qs), match_vma(dk, k), match_vma(dv, v)
    dsinks = None
    if sinks is not None:  # lse/out: [nq, B, N, bq(, H)]; padded rows have dout = 0
        dsinks = match_vma(sink_gradient(sinks, lse, _delta(out, dout, dlse), 2)
                           .astype(sinks.dtype), sinks)
    dil = [zero_cotangent(x) for x in il]
    dints = jax.tree_util.tree_map(zero_cotangent, ints)
    return dfl, dil, dsinks, dq, dk, dv, dints


_chunked_core.defvjp(_chunked_core_fwd, _chunked_core_bwd)


def chunked_attention(terms_fn: Callable[[int, int], Terms], qs: jax.Array, k: jax.Array,
                      v: jax.Array, m: Masking, causal: bool, block_q: int, block_k: int,
                      sinks: jax.Array | None, block_mask: BlockMask | None,
                      dropout: Dropout | None = None) -> tuple[jax.Array, jax.Array]:
    """Chunked attention in the heads-major layout: ``(out float32 [B, N, Tq, H_v], lse
    float32 [B, N, Tq])`` from the inputs of
    :func:`jaxpos.core.reference.reference_attention`, both differentiable;
    ``terms_fn(tq, tk)`` builds the terms at the tile shape. ``dropout``: the reference's
    keep mask, generated per tile in the forward pass and again in the backward pass
    (FlashAttention, Dao et al. 2022, Alg. 2 with dropout: ``dV = (P o Z)^T dO``, ``dP = Z
    o (dO V^T)``)."""
    _B, _N, Tq, _H = qs.shape
    if block_mask is None:
        block_q = min(block_q, Tq)
        block_k = min(block_k, k.shape[2])
    terms = terms_fn(block_q, block_k)
    b, nq, nk = chunk_inputs(qs, k, v, m, block_q, block_k)
    ints = b._replace(qs=None, k=None, v=None,
                      bm_kinds=None if block_mask is None else block_mask.kinds,
                      drop_seed=None if dropout is None else dropout.seed)
    drop_cfg = None if dropout is None else (dropout.threshold, dropout.scale,
                                             dropout.broadcast)
    fl, il, is_f, treedef = split_terms(terms)
    cfg = ChunkCfg(causal, nq, nk, block_q, block_k, is_f, treedef, drop_cfg)
    if sinks is not None:
        sinks = jnp.asarray(sinks)
    # (custom_vjp hides the return type from type checkers)
    out, lse = cast("tuple[jax.Array, jax.Array]",
                    _chunked_core(cfg, fl, il, sinks, b.qs, b.k, b.v, ints))
    return unblocks(out, 2)[:, :, :Tq], unblocks(lse, 2)[:, :, :Tq]


def _tiled(call: AttentionCall):
    """``(out [B, N, Tq, H_v], lse [B, N, Tq])`` float32 of the tiled path; ``rope_tables``
    rotate q and k once before the loops (training shapes)."""
    call = apply_rope_tables(call)
    qs, kk, vv, m = heads_major(call)
    terms_at = functools.partial(call_terms, call)
    return chunked_attention(terms_at, qs, kk, vv, m, call.causal, call.block_q or BLOCK_Q,
                             call.block_k or BLOCK_K, call.sinks, call.block_mask,
                             call.dropout)


def run_chunked(call: AttentionCall) -> jax.Array:
    """The ``"chunked"`` engine: ``[B, Tq, N, H_v]`` in q's dtype from a transformed call
    (:func:`jaxpos.core.call.transform_call`); tiles of ``block_q x block_k`` (default
    :data:`BLOCK_Q` x :data:`BLOCK_K`; the block mask's when given). A decode-shaped call
    with ``kv_lengths`` or ``rope_tables`` runs :func:`jaxpos.core.decode.run_chunked_decode`;
    otherwise ``rope_tables`` rotate q and k once before the loops and ``kv_lengths`` make
    the key blocks past each row's length EMPTY."""
    if decode_shaped(call):  # a few queries against a cache
        return run_chunked_decode(call)
    return jnp.swapaxes(_tiled(call)[0], 1, 2).astype(call.q.dtype)


class ChunkedEngine:
    """``implementation="chunked"``: the online softmax over ``block_q x block_k`` tiles
    with FlashAttention's recomputing backward (every feature, ``O(T)`` memory), and its
    decode path for a few queries against a filled cache. The default on CPU."""

    name = "chunked"
    # Not left to the compiler under Auto axes: its tile loop folds batch and heads into
    # scanned slices, and XLA's partitioner all-gathered q, k and v on a (8,) data mesh
    # (ALiBi); per shard it keeps them local.
    compiler_partitioned = False
    rotates_on_load = True  # the decode path rotates each key block as it slices it
    replacing_form = "blocked"  # stick-breaking, PaTH, CoPE: key blocks, O(T) memory

    def refuses(self, call: AttentionCall) -> None:
        """Nothing: the chunked engine runs every validated call."""
        return None

    def run(self, call: AttentionCall) -> jax.Array:
        """:func:`run_chunked`."""
        return run_chunked(call)

    def run_with_lse(self, call: AttentionCall) -> tuple[jax.Array, jax.Array]:
        """``(out [B, Tq, N, H_v], lse float32 [B, N, Tq])`` by the tiled path (the sinks
        in the lse; both differentiable)."""
        out, lse = _tiled(call)
        return jnp.swapaxes(out, 1, 2).astype(call.q.dtype), lse

    def ring_tile(self, call: AttentionCall) -> tuple[int, int]:
        """The ring runs this engine's tiles itself: ``block_q x block_k`` (default
        :data:`BLOCK_Q` x :data:`BLOCK_K`), at most the call's lengths."""
        return (min(call.block_q or BLOCK_Q, call.q_len),
                min(call.block_k or BLOCK_K, call.kv_len))

    def run_paged(self, call: AttentionCall, k_pages: jax.Array, v_pages: jax.Array,
                  page_table: jax.Array) -> jax.Array | None:
        """A decode-shaped paged call (:func:`jaxpos.core.decode.decode_shaped`) walks the
        page table block by block (:func:`jaxpos.core.decode.run_paged_decode`); None
        (run on the gathered keys) for longer calls and for a scheme that transforms keys
        per call (cached keys are read as stored)."""
        if not decode_shaped(call) or \
                type(call.scheme).transform_qk is not PositionScheme.transform_qk:
            return None
        return run_paged_decode(call, k_pages, v_pages, page_table)


register_engine(ChunkedEngine())
