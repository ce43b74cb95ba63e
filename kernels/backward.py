"""The backward kernels (FlashAttention-2, Dao 2023, Alg. 2), recomputing the
probabilities from the saved log-sum-exp:

* ``dq``, grid ``(B, N, Tq / bq)``: the forward's loops over the key tiles of a query
  tile's schedule row;
* ``dk, dv``, grid ``(B, N_kv, Tk / bk)``: one key tile of one KV head per program,
  looping over the query tiles of its schedule column (with causal, from the diagonal
  down) for each of the ``g`` query heads of the group, so dk and dv are written once per
  KV head in k's layout (no per-query-head buffer, no group sum).

With ``dlse`` the cotangent of a returned log-sum-exp, ``delta' = rowsum(dO * O) - dlse``
replaces ``delta`` (``d lse / d s = p``): :func:`backward_rows`.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxpos._util import pad_axis
from jaxpos.kernels import layout, tiles
from jaxpos.kernels import plumbing as pb
from jaxpos.kernels.tiles import loops

if TYPE_CHECKING:
    from jaxpos.kernels.config import KernelConfig, Operands
    from jaxpos.kernels.layout import Plat


def backward_rows(cfg: KernelConfig, out: Any, lse: Any, dout: Any, dlse: Any) -> Any:
    """``(lse, delta)`` ``[B, N, Tq_p, 1]`` for the backward kernels: ``delta =
    rowsum(dO * O) - dlse``; rows past ``Tq`` get ``lse = +inf`` and ``delta = 0`` so their
    (padding) probabilities are 0."""
    Tq_p = cfg.nq * cfg.bq
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, Tq, N]
    delta = pad_axis(jnp.swapaxes(delta, 1, 2), 2, Tq_p)[..., None]
    delta = delta - dlse.astype(jnp.float32)
    real = (jnp.arange(Tq_p) < cfg.Tq)[None, None, :, None]
    return jnp.where(real, lse, jnp.inf), jnp.where(real, delta, 0.0)


def _ds(cfg, mods, r, b, h, i, j, q, k, v, do, q_pos, kv_pos, q_seg, kv_seg, kv_lim, lse,
        delta, masked):
    """``(p, ds)`` of one tile: the probabilities recomputed from ``lse`` (undropped) and
    the gradient of the raw scores (the score_mod's derivative applied)."""
    s_raw, s = tiles.scores(cfg, mods, b, h, q, k, q_pos, kv_pos)
    vis = None
    if masked:
        vis = tiles.visible(cfg, mods, b, h, q_pos, kv_pos, q_seg, kv_seg,
                            tiles.key_indices(j, cfg.bk), kv_lim, s.shape)
        s = jnp.where(vis, s, -jnp.inf)
    pr = jnp.exp(s - jnp.where(lse == -jnp.inf, 0.0, lse))  # 0 where hidden
    bq, bk = cfg.bq, cfg.bk
    dp = tiles.dropped(cfg, r, b, h, i * bq, bq, j * bk, bk, tiles.dot(do, v, cfg))
    ds = tiles.chain(cfg, mods, b, h, pr * (dp - delta), s_raw, q_pos, kv_pos, vis)
    return pr, ds.astype(q[0].dtype)


def dq_kernel(*refs: Any, cfg: KernelConfig, names: tuple[str, ...], smod: Any, mmod: Any,
              style: str, plat: Plat) -> None:
    """The dq kernel body (one query tile of one query head)."""
    r = tiles.named(refs, names)
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bq, bk = cfg.bq, cfg.bk
    mods = tiles.Mods(r, smod, mmod, style)
    segs, vsegs = layout.qk_segs(cfg), layout.v_segs(cfg)
    q_row = layout.rows_ok(i * bq, bq, cfg.Tq) if cfg.nq * bq != cfg.Tq else None
    q_tab = (r["q_cos"][...], r["q_sin"][...]) if cfg.rope_half else None
    q = layout.load_feats(r["q"], plat, 1, 0, cfg.H, slice(None), segs, q_row, q_tab)
    q_pos = r["q_pos"][...]
    q_seg = r["q_seg"][...] if cfg.has_segments else None
    (do,) = layout.load_feats(r["do"], plat, 1, 0, cfg.Hv, slice(None), vsegs, q_row, None)
    lse, delta = r["lse"][...], r["delta"][...]
    kv_lim = r["kv_len"][b] if cfg.has_kv_len else cfg.Tk

    def tile(j, dq, masked):
        rows = pl.ds(j * bk, bk)
        k_row = layout.rows_ok(j * bk, bk, kv_lim) if masked and tiles.kv_padded(cfg) else None
        k_tab = (r["k_cos"][rows, :], r["k_sin"][rows, :]) if cfg.rope_half else None
        k = layout.load_feats(r["k"], plat, 1, 0, cfg.H, rows, segs, k_row, k_tab)
        (v,) = layout.load_feats(r["v"], plat, 1, 0, cfg.Hv, rows, vsegs, k_row, None)
        kv_seg = r["kv_seg"][:, rows] if (masked and cfg.has_segments) else None
        _, ds = _ds(cfg, mods, r, b, h, i, j, q, k, v, do, q_pos, r["kv_pos"][:, rows], q_seg,
                    kv_seg, kv_lim, lse, delta, masked)
        return [a + tiles.dot(ds, kk, cfg, ((1,), (0,))) for a, kk in zip(dq, k)]

    count, item = tiles.sched_fns(r["counts"], r["lists"])
    dq = loops(count, item, [jnp.zeros(x.shape, jnp.float32) for x in q], tile)
    dq = layout.unrotate([x * jnp.float32(cfg.scale) for x in dq], q_tab)
    layout.store_feats(r["dq"], plat, 1, 0, cfg.H, slice(None), segs, q_row, dq)


def _dkv_tile(r, cfg, plat, mods, b, kh, j, kv, hi):
    """``tile(i, (dk, dv), masked)``: query tile ``i`` of query head ``hi`` of the group
    added to the key tile's gradients."""
    g, bq = cfg.groups, cfg.bq
    k, v, kv_pos, kv_seg, kv_lim = kv
    h = kh * g + hi
    segs, vsegs = layout.qk_segs(cfg), layout.v_segs(cfg)

    def tile(i, carry, masked):
        dk, dv = carry
        rows = pl.ds(i * bq, bq)
        q_row = layout.rows_ok(i * bq, bq, cfg.Tq) if cfg.nq * bq != cfg.Tq else None
        q_tab = (r["q_cos"][rows, :], r["q_sin"][rows, :]) if cfg.rope_half else None
        q = layout.load_feats(r["q"], plat, g, hi, cfg.H, rows, segs, q_row, q_tab)
        (do,) = layout.load_feats(r["do"], plat, g, hi, cfg.Hv, rows, vsegs, q_row, None)
        q_seg = r["q_seg"][rows, :] if (masked and cfg.has_segments) else None
        lse = r["lse"][tiles.hd(g, hi, rows, slice(None))]
        delta = r["delta"][tiles.hd(g, hi, rows, slice(None))]
        pr, ds = _ds(cfg, mods, r, b, h, i, j, q, k, v, do, r["q_pos"][rows, :], kv_pos, q_seg,
                     kv_seg, kv_lim, lse, delta, masked)
        pz = tiles.dropped(cfg, r, b, h, i * bq, bq, j * cfg.bk, cfg.bk, pr)
        dv = dv + tiles.dot(pz.astype(do.dtype), do, cfg, ((0,), (0,)))
        return [a + tiles.dot(ds, qq, cfg, ((0,), (0,))) for a, qq in zip(dk, q)], dv

    return tile


def dkv_kernel(*refs: Any, cfg: KernelConfig, names: tuple[str, ...], smod: Any, mmod: Any,
               style: str, plat: Plat) -> None:
    """The dk / dv kernel body (one key tile of one KV head, its group's query heads)."""
    r = tiles.named(refs, names)
    b, kh, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    g, bk = cfg.groups, cfg.bk
    mods = tiles.Mods(r, smod, mmod, style)
    segs, vsegs = layout.qk_segs(cfg), layout.v_segs(cfg)
    kv_lim = r["kv_len"][b] if cfg.has_kv_len else cfg.Tk
    k_row = layout.rows_ok(j * bk, bk, kv_lim) if tiles.kv_padded(cfg) else None
    k_real = layout.rows_ok(j * bk, bk, cfg.Tk) if cfg.nk * bk != cfg.Tk else None  # stores
    k_tab = (r["k_cos"][...], r["k_sin"][...]) if cfg.rope_half else None
    k = layout.load_feats(r["k"], plat, 1, 0, cfg.H, slice(None), segs, k_row, k_tab)
    (v,) = layout.load_feats(r["v"], plat, 1, 0, cfg.Hv, slice(None), vsegs, k_row, None)
    kv_seg = r["kv_seg"][...] if cfg.has_segments else None
    kv = (k, v, r["kv_pos"][...], kv_seg, kv_lim)
    tile_fns = [_dkv_tile(r, cfg, plat, mods, b, kh, j, kv, hi) for hi in range(g)]
    carry = ([jnp.zeros(x.shape, jnp.float32) for x in k], jnp.zeros(v.shape, jnp.float32))
    if cfg.sched_h:  # each head of the group has its own column of the schedule
        for hi in range(g):
            count, item = tiles.sched_fns(r["counts"], r["lists"], tiles.hd(g, hi))
            carry = loops(count, item, carry, tile_fns[hi])
    else:  # one column for all: each query tile is visited once for the g heads
        count, item = tiles.sched_fns(r["counts"], r["lists"])

        def tile(i, c, masked):
            for t in tile_fns:
                c = t(i, c, masked)
            return c

        carry = loops(count, item, carry, tile)
    dk, dv = carry
    dk = layout.unrotate([x * jnp.float32(cfg.scale) for x in dk], k_tab)
    layout.store_feats(r["dk"], plat, 1, 0, cfg.H, slice(None), segs, k_real, dk)
    layout.store_feats(r["dv"], plat, 1, 0, cfg.Hv, slice(None), vsegs, k_real, [dv])


def _tok_out(cfg, name, n, W, rows, imap, segs, dtype, T):
    def make(plat):
        spec = layout.tok_spec(plat, rows, 1, W, layout.block_width(plat, segs, W), imap)
        return (jax.ShapeDtypeStruct(layout.token_shape(plat, cfg.B, T, n, W), dtype), spec,
                lambda y: layout.from_kernel(plat, y, n))
    return pb.Out(name, make)


def _dq(cfg, ops, lse, delta, do):
    bq, Tk_p = cfg.bq, cfg.nk * cfg.bk
    sb, sh = pb.batch_map(cfg.sched_b), pb.batch_map(cfg.sched_h)
    segs, vsegs = layout.qk_segs(cfg), layout.v_segs(cfg)
    kvh = lambda h: jax.lax.div(h, jnp.asarray(cfg.groups, h.dtype))  # int32 under x64 too
    ins = [pb.In("q", ops.q, pb.tok(bq, 1, cfg.H, lambda b, h, i: (b, i, h), segs)),
           pb.In("k", ops.k, pb.tok(Tk_p, 1, cfg.H, lambda b, h, i: (b, 0, kvh(h)), segs)),
           pb.In("v", ops.v, pb.tok(Tk_p, 1, cfg.Hv, lambda b, h, i: (b, 0, kvh(h)), vsegs)),
           pb.In("do", do, pb.tok(bq, 1, cfg.Hv, lambda b, h, i: (b, i, h), vsegs)),
           pb.In("lse", lse, pb.fixed((None, None, bq, 1), lambda b, h, i: (b, h, i, 0))),
           pb.In("delta", delta, pb.fixed((None, None, bq, 1), lambda b, h, i: (b, h, i, 0)))]
    ins += pb.pos_inputs(cfg, ops, q_rows=bq, q_map=lambda b, h, i: (b, i),
                         k_rows=Tk_p, k_map=lambda b, h, i: (b, 0))
    ins += pb.sched_inputs(ops.sched.kv_counts, ops.sched.kv_lists, 1,
                           lambda b, h, i: (sb(b), sh(h), i))
    ins += pb.tail_inputs(cfg, ops)
    outs = [_tok_out(cfg, "dq", cfg.N, cfg.H, bq, lambda b, h, i: (b, i, h), segs, ops.q.dtype,
                     cfg.Tq)]
    kern = functools.partial(dq_kernel, cfg=cfg, smod=pb.mod_static(ops.smod),
                             mmod=pb.mod_static(ops.mmod))
    (dq,) = pb.run_pallas(kern, (cfg.B, cfg.N, cfg.nq), ins, outs, "jaxpos_attention_dq")
    return dq


def _dkv(cfg, ops, lse, delta, do):
    g, bk, Tq_p = cfg.groups, cfg.bk, cfg.nq * cfg.bq
    Nk, sb = cfg.N // g, pb.batch_map(cfg.sched_b)
    segs, vsegs = layout.qk_segs(cfg), layout.v_segs(cfg)
    gd = None if g == 1 else g
    ins = [pb.In("q", ops.q, pb.tok(Tq_p, g, cfg.H, lambda b, h, j: (b, 0, h), segs)),
           pb.In("k", ops.k, pb.tok(bk, 1, cfg.H, lambda b, h, j: (b, j, h), segs)),
           pb.In("v", ops.v, pb.tok(bk, 1, cfg.Hv, lambda b, h, j: (b, j, h), vsegs)),
           pb.In("do", do, pb.tok(Tq_p, g, cfg.Hv, lambda b, h, j: (b, 0, h), vsegs)),
           pb.In("lse", lse, pb.fixed((None, gd, Tq_p, 1), lambda b, h, j: (b, h, 0, 0))),
           pb.In("delta", delta, pb.fixed((None, gd, Tq_p, 1), lambda b, h, j: (b, h, 0, 0)))]
    ins += pb.pos_inputs(cfg, ops, q_rows=Tq_p, q_map=lambda b, h, j: (b, 0),
                         k_rows=bk, k_map=lambda b, h, j: (b, j))
    heads, hmap = (g, lambda h: h) if cfg.sched_h else (1, lambda h: 0)
    ins += pb.sched_inputs(ops.sched.q_counts, ops.sched.q_lists, heads,
                           lambda b, h, j: (sb(b), hmap(h), j))
    ins += pb.tail_inputs(cfg, ops)
    outs = [_tok_out(cfg, "dk", Nk, cfg.H, bk, lambda b, h, j: (b, j, h), segs, ops.k.dtype,
                     cfg.Tk),
            _tok_out(cfg, "dv", Nk, cfg.Hv, bk, lambda b, h, j: (b, j, h), vsegs, ops.v.dtype,
                     cfg.Tk)]
    kern = functools.partial(dkv_kernel, cfg=cfg, smod=pb.mod_static(ops.smod),
                             mmod=pb.mod_static(ops.mmod))
    dk, dv = pb.run_pallas(kern, (cfg.B, Nk, cfg.nk), ins, outs, "jaxpos_attention_dkv")
    return dk, dv


def backward(cfg: KernelConfig, ops: Operands, lse: Any, delta: Any, dout: Any) -> Any:
    """dq, dk, dv in the inputs' layout and dtypes; ``lse``, ``delta`` ``[B, N, Tq_p, 1]``
    from :func:`backward_rows`."""
    do = dout.astype(ops.v.dtype)
    dq = _dq(cfg, ops, lse, delta, do)
    dk, dv = _dkv(cfg, ops, lse, delta, do)
    return dq, dk, dv
