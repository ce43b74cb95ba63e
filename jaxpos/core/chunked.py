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
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxpos._util import match_vma, pad_axis, sink_gradient, zero_cotangent
from jaxpos.core.call import AttentionCall, apply_rope_tables
from jaxpos.core.decode import decode_shaped, run_chunked_decode
from jaxpos.core.dropout import Dropout, keep_tile
from jaxpos.core.reference import (
    Masking,
    Terms,
    heads_major,
    make_terms,
    tile_output,
    tile_scores,
    visible,
)
from jaxpos.mods import EMPTY, FULL, PARTIAL, BlockMask

__all__ = ["BLOCK_K", "BLOCK_Q", "NEG_INF", "ChunkCfg", "blocks", "chunk_inputs",
           "chunked_attention", "chunked_backward", "chunked_forward", "merge_terms",
           "run_chunked", "split_terms", "tile_kind", "unblocks",
           "varying_zero"]

NEG_INF = -jnp.inf
# Chunked tile sizes: measured on a 2-core x86 CPU (benchmarks/attention_cpu.py), 256 x 256
# float32 tiles of 8 heads (2 MiB of scores) were as fast as any other choice forward and
# waste little work on the diagonal of a causal mask.
BLOCK_Q = 256
BLOCK_K = 256


def blocks(x, axis, n):
    """Split ``axis`` into ``n`` blocks and move the block index to the front."""
    if x is None:
        return None
    if x.shape[axis] == 1:  # broadcast dimension: every block sees the same slice
        return jnp.broadcast_to(x[None], (n,) + x.shape)
    shp = x.shape[:axis] + (n, x.shape[axis] // n) + x.shape[axis + 1:]
    return jnp.moveaxis(x.reshape(shp), axis, 0)


def unblocks(x, axis):
    """Inverse of :func:`blocks` for a full (not broadcast) axis."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])


def tile_kind(causal: bool, always_mask: bool, qp, kp, kval, sq, skv, bm_kind):
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


class ChunkCfg(NamedTuple):
    causal: bool
    nq: int
    nk: int
    block_q: int
    block_k: int
    float_mask: tuple  # which leaves of the terms are floating (differentiable)
    terms_def: object  # treedef of the terms
    # attention dropout: (threshold, scale, broadcast) of a jaxpos.core.dropout.Dropout, whose
    # seed travels in the blocked inputs as "dropout_seed"; None without dropout
    dropout: tuple | None = None


def split_terms(terms: Terms):
    """Floating leaves (differentiable) and the rest (integer tables of a mod, ...)."""
    leaves, treedef = jax.tree_util.tree_flatten(terms)
    is_f = tuple(bool(jnp.issubdtype(jnp.result_type(x), jnp.inexact)) for x in leaves)
    return ([x for x, f in zip(leaves, is_f) if f], [x for x, f in zip(leaves, is_f) if not f],
            is_f, treedef)


def merge_terms(cfg: ChunkCfg, fl, il) -> Terms:
    fl, il = iter(fl), iter(il)
    leaves = [next(fl) if f else next(il) for f in cfg.float_mask]
    return jax.tree_util.tree_unflatten(cfg.terms_def, leaves)


def chunk_inputs(qs, k, v, m: Masking, block_q: int, block_k: int):
    _B, _N, Tq, _H = qs.shape
    Tk = k.shape[2]
    nq, nk = -(-Tq // block_q), -(-Tk // block_k)
    Tq_p, Tk_p = nq * block_q, nk * block_k
    kv_valid = m.kv_valid if m.kv_valid is not None else jnp.ones((1, Tk), bool)
    mask = m.mask
    if mask is not None:
        mask = mask if mask.shape[2] == 1 else pad_axis(mask, 2, Tq_p, False)
        mask = mask if mask.shape[3] == 1 else pad_axis(mask, 3, Tk_p, False)
    blocked = {
        "qs": blocks(pad_axis(qs, 2, Tq_p), 2, nq),
        "k": blocks(pad_axis(k, 2, Tk_p), 2, nk),
        "v": blocks(pad_axis(v, 2, Tk_p), 2, nk),
        "q_pos": blocks(pad_axis(m.q_pos, 1, Tq_p), 1, nq),
        "kv_pos": blocks(pad_axis(m.kv_pos, 1, Tk_p), 1, nk),
        "kv_valid": blocks(pad_axis(kv_valid, 1, Tk_p, False), 1, nk),
        "seg_q": blocks(pad_axis(m.seg_q, 1, Tq_p), 1, nq) if m.seg_q is not None else None,
        "seg_kv": blocks(pad_axis(m.seg_kv, 1, Tk_p, -1), 1, nk) if m.seg_kv is not None else None,
        "mask": mask,
    }
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


def _tile_visibility(cfg: ChunkCfg, terms: Terms, b, i, j, qp_i, kp_j, kval_j, sq_i, skv_j,
                     masked: bool):
    if not masked:
        return None
    heads = b["qs"].shape[1:3]
    return visible(cfg.causal, qp_i, kp_j, kval_j,
                    _mask_block(b["mask"], i, j, cfg.block_q, cfg.block_k), sq_i, skv_j,
                    terms.mask, heads)


def _tile_dropout(cfg: ChunkCfg, b, i, j):
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
        B, N = b["qs"].shape[1], b["qs"].shape[2]
        batch = jnp.arange(B, dtype=jnp.int32)[:, None, None, None]
        head = jnp.arange(N, dtype=jnp.int32)[None, :, None, None]
    keep = keep_tile(b["dropout_seed"], threshold, batch, head, q_index, kv_index)
    return jnp.where(keep, jnp.float32(scale), jnp.float32(0.0))


def _dropped(p, drop):
    return p if drop is None else p * drop


def _block_kind(b, i, j):
    bm = b.get("bm_kinds")
    return None if bm is None else bm[:, :, i, j]


def varying_zero(*trees):
    """A float32 scalar 0 that varies over every mesh axis any leaf of ``trees`` varies
    over under ``shard_map`` (``jnp.zeros_like`` carries the leaf's axes). Added to loop
    carries and skipped-tile outputs, it gives them the type of the computed values, as
    ``shard_map``'s default ``check_vma`` requires; elsewhere it is a constant 0."""
    z = jnp.zeros((), jnp.float32)
    for x in jax.tree_util.tree_leaves(trees):
        z = z + jnp.zeros_like(x, jnp.float32, shape=())
    return z


def _always_mask(b, terms: Terms) -> bool:
    return b["mask"] is not None or (terms.mask is not None and b.get("bm_kinds") is None)


def chunked_forward(terms: Terms, sinks, b, cfg: ChunkCfg):
    """Returns out ``[nq, B, N, bq, H]`` and lse ``[nq, B, N, bq]`` (``-inf`` on empty rows
    without sinks; the sink is part of the normaliser)."""
    B, N = b["qs"].shape[1], b["qs"].shape[2]
    H = b["v"].shape[-1]
    always = _always_mask(b, terms)

    def q_block(args):
        i, qs_i, qp_i, sq_i = args

        def k_step(carry, xs):
            j, k_j, v_j, kp_j, kval_j, skv_j = xs

            def compute(carry, masked):
                mx, l, acc = carry
                vis = _tile_visibility(cfg, terms, b, i, j, qp_i, kp_j, kval_j, sq_i, skv_j,
                                       masked)
                s = _tile(terms, qs_i, k_j, qp_i, kp_j, vis)
                m_new = jnp.maximum(mx, jnp.max(s, axis=-1))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                p = jnp.exp(s - m_safe[..., None])
                corr = jnp.exp(mx - m_safe)
                l = l * corr + jnp.sum(p, axis=-1)  # the normaliser: undropped
                p = _dropped(p, _tile_dropout(cfg, b, i, j))
                acc = acc * corr[..., None] + tile_output(terms, p, v_j, qp_i, kp_j)
                return m_new, l, acc

            kind = tile_kind(cfg.causal, always, qp_i, kp_j, kval_j, sq_i, skv_j,
                              _block_kind(b, i, j))
            branches = (lambda c: c, functools.partial(compute, masked=False),
                        functools.partial(compute, masked=True))
            return jax.lax.switch(kind, branches, carry), None

        z = varying_zero(b, terms, sinks, qs_i, qp_i, sq_i)
        if sinks is None:
            m0 = jnp.full((B, N, cfg.block_q), NEG_INF, jnp.float32)
            l0 = jnp.zeros((B, N, cfg.block_q), jnp.float32)
        else:  # the sink is a key every row sees: the softmax starts from it
            m0 = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None], (B, N, cfg.block_q))
            l0 = jnp.ones((B, N, cfg.block_q), jnp.float32)
        init = (m0 + z, l0 + z, jnp.zeros((B, N, cfg.block_q, H), jnp.float32) + z)
        xs = (jnp.arange(cfg.nk), b["k"], b["v"], b["kv_pos"], b["kv_valid"], b["seg_kv"])
        (mx, l, acc), _ = jax.lax.scan(k_step, init, xs)
        # l is exactly 0 for a row with no visible key; NaN (a NaN/inf input) must pass
        # through as NaN, as in the reference, never be mistaken for an empty row.
        nonempty = l != 0
        out = jnp.where(nonempty[..., None], acc / jnp.where(nonempty, l, 1.0)[..., None], 0.0)
        lse = jnp.where(nonempty, mx + jnp.log(jnp.where(nonempty, l, 1.0)), NEG_INF)
        return out, lse

    return jax.lax.map(q_block, (jnp.arange(cfg.nq), b["qs"], b["q_pos"], b["seg_q"]))


def chunked_backward(cfg: ChunkCfg, fl, il, b, out, lse, dout):
    """FlashAttention-2 style recomputing backward (Dao 2023, Alg. 2), tile by tile.

    Returns ``dq, dk, dv`` (blocked) and the gradients of the floating leaves ``fl`` of
    the terms."""
    terms0 = merge_terms(cfg, fl, il)
    always = _always_mask(b, terms0)
    delta = jnp.sum(dout * out, axis=-1)  # [nq, B, N, bq]
    z = varying_zero(b, fl, lse, dout)
    # Under shard_map, differentiate w.r.t. copies that vary over every axis, so the tile
    # VJPs below never psum inside the (per-device) skip/compute switch; the one sum over
    # the axes a primal does not vary over happens in _chunked_core_bwd (match_vma).
    vary = lambda x: x + z.astype(x.dtype)
    fl = [vary(x) for x in fl]
    b = dict(b, qs=vary(b["qs"]), k=vary(b["k"]), v=vary(b["v"]))
    dk0 = jnp.zeros(b["k"].shape, jnp.float32) + z
    dv0 = jnp.zeros(b["v"].shape, jnp.float32) + z
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

        ys = (jnp.arange(cfg.nk), b["k"], b["v"], b["kv_pos"], b["kv_valid"], b["seg_kv"])
        (dq_i, dfl), (dk_i, dv_i) = jax.lax.scan(
            k_step, (jnp.zeros(qs_i.shape, jnp.float32) + z, dfl), ys)
        return (dk_all + dk_i, dv_all + dv_i, dfl), dq_i

    xs = (jnp.arange(cfg.nq), b["qs"], b["q_pos"], b["seg_q"], lse, dout, delta)
    (dk, dv, dfl), dq = jax.lax.scan(q_step, (dk0, dv0, dfl0), xs)
    return dq, dk, dv, dfl


def _assemble(qs, k, v, ints):
    b = dict(ints)
    b.update(qs=qs, k=k, v=v)
    return b


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked_core(cfg, fl, il, sinks, qs, k, v, ints):
    out, _ = chunked_forward(merge_terms(cfg, fl, il), sinks, _assemble(qs, k, v, ints), cfg)
    return out


def _chunked_core_fwd(cfg, fl, il, sinks, qs, k, v, ints):
    out, lse = chunked_forward(merge_terms(cfg, fl, il), sinks, _assemble(qs, k, v, ints), cfg)
    return out, (fl, il, sinks, qs, k, v, ints, out, lse)


def _chunked_core_bwd(cfg, res, dout):
    fl, il, sinks, qs, k, v, ints, out, lse = res
    dq, dk, dv, dfl = chunked_backward(cfg, fl, il, _assemble(qs, k, v, ints), out, lse, dout)
    dfl = [match_vma(g.astype(jnp.result_type(x)), x) for g, x in zip(dfl, fl)]
    dq, dk, dv = match_vma(dq, qs), match_vma(dk, k), match_vma(dv, v)
    dsinks = None
    if sinks is not None:  # lse/out: [nq, B, N, bq(, H)]; padded rows have dout = 0
        delta = jnp.sum(dout * out, axis=-1)
        dsinks = match_vma(sink_gradient(sinks, lse, delta, 2).astype(sinks.dtype), sinks)
    dil = [zero_cotangent(x) for x in il]
    dints = jax.tree_util.tree_map(zero_cotangent, ints)
    return dfl, dil, dsinks, dq, dk, dv, dints


_chunked_core.defvjp(_chunked_core_fwd, _chunked_core_bwd)


def chunked_attention(terms_fn, qs, k, v, m: Masking, causal: bool, block_q: int, block_k: int,
                      sinks, block_mask: BlockMask | None, dropout: Dropout | None = None):
    """Chunked attention in the heads-major layout: float32 ``[B, N, Tq, H_v]`` from the
    inputs of :func:`jaxpos.core.reference.reference_attention`; ``terms_fn(tq, tk)`` builds
    the terms at the tile shape. ``dropout``: the reference's keep mask, generated per
    tile in the forward pass and again in the backward pass (FlashAttention, Dao et al.
    2022, Alg. 2 with dropout: ``dV = (P o Z)^T dO``, ``dP = Z o (dO V^T)``)."""
    _B, _N, Tq, _H = qs.shape
    if block_mask is None:
        block_q = min(block_q, Tq)
        block_k = min(block_k, k.shape[2])
    terms = terms_fn(block_q, block_k)
    b, nq, nk = chunk_inputs(qs, k, v, m, block_q, block_k)
    ints = {n: b[n] for n in ("q_pos", "kv_pos", "kv_valid", "seg_q", "seg_kv", "mask")}
    if block_mask is not None:
        ints["bm_kinds"] = block_mask.kinds
    drop_cfg = None
    if dropout is not None:
        ints["dropout_seed"] = dropout.seed
        drop_cfg = (dropout.threshold, dropout.scale, dropout.broadcast)
    fl, il, is_f, treedef = split_terms(terms)
    cfg = ChunkCfg(causal, nq, nk, block_q, block_k, is_f, treedef, drop_cfg)
    if sinks is not None:
        sinks = jnp.asarray(sinks)
    out = _chunked_core(cfg, fl, il, sinks, b["qs"], b["k"], b["v"], ints)
    return unblocks(out, 2)[:, :, :Tq]


def run_chunked(call: AttentionCall) -> jax.Array:
    """The ``"chunked"`` runner: ``[B, Tq, N, H_v]`` in q's dtype from a transformed call
    (:func:`jaxpos.core.call.transform_call`); tiles of ``block_q x block_k`` (default
    :data:`BLOCK_Q` x :data:`BLOCK_K`; the block mask's when given). A decode-shaped call
    with ``kv_lengths`` or ``rope_tables`` runs :func:`jaxpos.core.decode.run_chunked_decode`;
    otherwise ``rope_tables`` rotate q and k once before the loops and ``kv_lengths`` make
    the key blocks past each row's length EMPTY."""
    if decode_shaped(call) and call.dropout is None:  # a few queries against a cache
        return run_chunked_decode(call)
    call = apply_rope_tables(call)  # training shapes: once per call, before the loops
    qs, kk, vv, m = heads_major(call)
    terms_at = functools.partial(make_terms, call.scheme, call.score_mod, call.mask_mod)
    out = chunked_attention(terms_at, qs, kk, vv, m, call.causal, call.block_q or BLOCK_Q,
                            call.block_k or BLOCK_K, call.sinks, call.block_mask, call.dropout)
    return jnp.swapaxes(out, 1, 2).astype(call.q.dtype)
