"""The forward kernel (FlashAttention-2, Dao 2023, Alg. 1) and flash decoding's key
splits: grid ``(B, N / G, Tq / bq[, S])``, one query tile of ``G`` query heads per
program (``G = g`` for decode-shaped calls, where the ``g`` heads that share a KV head
read each K/V tile once; else 1), the PARTIAL then the FULL key tiles of its schedule row
with the online softmax. With ``S > 1`` key splits each program covers a slice of the key
tiles and writes a partial output with its log-sum-exp; :func:`combine_splits` merges
them. Writes the output and the log-sum-exp ``lse``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxpos.core.tiles import fold_sinks, lse_merge, online_softmax_step, softmax_finish
from jaxpos.kernels import layout, tiles
from jaxpos.kernels import plumbing as pb
from jaxpos.kernels.tiles import loops

if TYPE_CHECKING:
    from jaxpos.kernels.config import KernelConfig, Operands
    from jaxpos.kernels.layout import Plat
    from jaxpos.kernels.tiles import Mods


def split_len(cfg: KernelConfig) -> int:
    """Key tiles per split."""
    return -(-cfg.nk // cfg.splits)


class _QueryTile:
    """What a forward program reads once: its query tile(s), positions, segments."""

    def __init__(self, r: dict[str, Any], cfg: KernelConfig, plat: Plat, i: Any):
        self.pos = r["q_pos"][...]  # [bq, 1]
        self.seg = r["q_seg"][...] if cfg.has_segments else None
        self.row = layout.rows_ok(i * cfg.bq, cfg.bq, cfg.Tq) if cfg.nq * cfg.bq != cfg.Tq \
            else None
        tab = (r["q_cos"][...], r["q_sin"][...]) if cfg.rope_half else None
        segs = layout.qk_segs(cfg)
        self.qs = [layout.load_feats(r["q"], plat, cfg.heads, hi, cfg.H, slice(None), segs,
                                     self.row, tab) for hi in range(cfg.heads)]


def load_kv(r: dict[str, Any], cfg: KernelConfig, plat: Plat, b: Any, j: Any, kv_lim: Any,
            masked: bool) -> Any:
    """``(k segments, v, kv_pos, kv_seg)`` of key tile ``j`` of batch row ``b``: rows
    ``[j * bk, (j + 1) * bk)`` of the row's keys, or with paged keys the whole page
    ``page_table[b, j]`` (``bk`` is the page size)."""
    bk = cfg.bk
    rows = pl.ds(j * bk, bk)
    kv_rows, lead = (slice(None), (r["page_table"][b, j],)) if cfg.paged else (rows, ())
    kv_pos = r["kv_pos"][:, rows]  # [1, bk]
    k_row = layout.rows_ok(j * bk, bk, kv_lim) if masked and tiles.kv_padded(cfg) else None
    k_tab = (r["k_cos"][rows, :], r["k_sin"][rows, :]) if cfg.rope_half else None
    k_dq = v_dq = None
    if cfg.quantised:  # each page dequantised as it is loaded, to q's dtype
        k_dq = (page_scales(r["k_scale"], plat, kv_rows, k_row, lead), r["q"].dtype)
        v_dq = (page_scales(r["v_scale"], plat, kv_rows, k_row, lead), r["q"].dtype)
    k = layout.load_feats(r["k"], plat, 1, 0, cfg.H, kv_rows, layout.qk_segs(cfg), k_row,
                          k_tab, lead, k_dq)
    (v,) = layout.load_feats(r["v"], plat, 1, 0, cfg.Hv, kv_rows, layout.v_segs(cfg), k_row,
                             None, lead, v_dq)
    kv_seg = r["kv_seg"][:, rows] if (masked and cfg.has_segments) else None
    return k, v, kv_pos, kv_seg


def _scale_plat(plat: Plat) -> Plat:
    """The layout of a scale pool ``[num_pages, page_size, N_kv, 1]``: TPU's ``[.., N, T,
    1]`` (a block's last two dims whole) whatever the values' layout; elsewhere the
    values'."""
    return plat._replace(kind="bnth") if plat.kind == "flat" else plat


def page_scales(ref: Any, plat: Plat, kv_rows: Any, row_ok: Any, lead: tuple) -> Any:
    """float32 ``[page_size, 1]``: the scales of one page of a quantised pool (Triton's
    masked load is a power-of-two block wide, zero past the one real column: summed)."""
    (s,) = layout.load_feats(ref, _scale_plat(plat), 1, 0, 1, kv_rows, ((0, 1),), row_ok,
                             None, lead)
    return jnp.sum(s, axis=1, keepdims=True) if s.shape[1] != 1 else s


def _scale_pool(kv_head):
    spec = pb.pool(1, kv_head, ((0, 1),))
    return lambda plat, arr: spec(_scale_plat(plat), arr)


def attend_tile(r: dict[str, Any], cfg: KernelConfig, mods: Mods, qt: Any, b: Any, p: Any, i: Any,
                j: Any, kv_lim: Any, masked: bool, state: Any, kv: Any) -> Any:
    """The online-softmax update (the core's step,
    :func:`jaxpos.core.tiles.online_softmax_step`) of each query head of the program by
    key tile ``j``; the dropout mask applies to the probabilities that meet ``v``, not to
    the normaliser."""
    k, v, kv_pos, kv_seg = kv
    new = []
    for hi in range(cfg.heads):
        h = p * cfg.heads + hi
        _, s = tiles.scores(cfg, mods, b, h, qt.qs[hi], k, qt.pos, kv_pos)
        if masked:
            vis = tiles.visible(cfg, mods, b, h, qt.pos, kv_pos, qt.seg, kv_seg,
                                tiles.key_indices(j, cfg.bk), kv_lim, s.shape)
            s = jnp.where(vis, s, -jnp.inf)

        def values(pr, h=h):
            pr = tiles.dropped(cfg, r, b, h, i * cfg.bq, cfg.bq, j * cfg.bk, cfg.bk, pr)
            return tiles.dot(pr.astype(v.dtype), v, cfg, ((1,), (0,)))

        new.append(online_softmax_step(state[hi], s, values))
    return new


def write_rows(r: dict[str, Any], cfg: KernelConfig, plat: Plat, row: Any, state: Any) -> None:
    """Store each head's output (or split partial) and log-sum-exp."""
    G = cfg.heads
    for hi, running in enumerate(state):
        out, lse = softmax_finish(running)
        if cfg.splits == 1:
            layout.store_feats(r["out"], plat, G, hi, cfg.Hv, slice(None), layout.v_segs(cfg),
                               row, [out])
        else:
            r["out"][tiles.hd(G, hi, slice(None), slice(None))] = out
        r["lse"][tiles.hd(G, hi, slice(None), slice(None))] = lse


def fwd_kernel(*refs: Any, cfg: KernelConfig, names: tuple[str, ...], smod: Any, mmod: Any,
               style: str, plat: Plat) -> None:
    """The forward kernel body (one query tile of ``cfg.heads`` heads)."""
    r = tiles.named(refs, names)
    b, p, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    split = pl.program_id(3) if cfg.splits > 1 else None
    mods = tiles.Mods(r, smod, mmod, style)
    qt = _QueryTile(r, cfg, plat, i)
    kv_lim = r["kv_len"][b] if cfg.has_kv_len else cfg.Tk

    def tile(j, state, masked):
        kv = load_kv(r, cfg, plat, b, j, kv_lim, masked)
        return attend_tile(r, cfg, mods, qt, b, p, i, j, kv_lim, masked, state, kv)

    init = tiles.init_state(r, cfg, cfg.heads, p, layout.wb(plat, cfg.Hv))
    count, item = tiles.sched_fns(r["counts"], r["lists"])
    offset = 0 if split is None else split * split_len(cfg)
    write_rows(r, cfg, plat, qt.row, loops(count, item, init, tile, offset))


def out_makers(cfg: KernelConfig, dtype: Any) -> list[pb.Out]:
    """The ``out`` and ``lse`` outputs of the forward (split partials with ``S > 1``:
    float32, in the kernel's own padded layout)."""
    B, N, G, S, bq = cfg.B, cfg.N, cfg.heads, cfg.splits, cfg.bq
    Tq_p, hd = cfg.nq * bq, None if G == 1 else G

    def out_make(plat):
        if S > 1:
            wv = layout.wb(plat, cfg.Hv)
            sds = jax.ShapeDtypeStruct((S, B, N, Tq_p, wv), jnp.float32)
            spec = pl.BlockSpec((None, None, hd, bq, wv), lambda b, p, i, s: (s, b, p, i, 0))
            return sds, spec, lambda y: y[..., :cfg.Hv]
        shape = layout.token_shape(plat, B, cfg.Tq, N, cfg.Hv)
        spec = layout.tok_spec(plat, bq, G, cfg.Hv,
                               layout.block_width(plat, layout.v_segs(cfg), cfg.Hv),
                               lambda b, p, i, *_: (b, i, p))
        return jax.ShapeDtypeStruct(shape, dtype), spec, lambda y: layout.from_kernel(plat, y, N)

    def lse_make(plat):
        if S > 1:
            return (jax.ShapeDtypeStruct((S, B, N, Tq_p, 1), jnp.float32),
                    pl.BlockSpec((None, None, hd, bq, 1), lambda b, p, i, s: (s, b, p, i, 0)),
                    lambda y: y)
        return (jax.ShapeDtypeStruct((B, N, Tq_p, 1), jnp.float32),
                pl.BlockSpec((None, hd, bq, 1), lambda b, p, i, *_: (b, p, i, 0)), lambda y: y)

    return [pb.Out("out", out_make), pb.Out("lse", lse_make)]


def _kv_inputs(cfg, ops):
    """k and v: each batch row's keys of one KV head, or the whole page pools of one KV
    head and the page table (paged keys)."""
    G, g, Tk_p = cfg.heads, cfg.groups, cfg.nk * cfg.bk
    kvh = lambda p: jax.lax.div(p * G, jnp.asarray(g, p.dtype))  # int32 under x64 too
    segs, vsegs = layout.qk_segs(cfg), layout.v_segs(cfg)
    if cfg.paged:
        ins = [pb.In("k", ops.k, pb.pool(cfg.H, lambda b, p, i, *s: kvh(p), segs)),
               pb.In("v", ops.v, pb.pool(cfg.Hv, lambda b, p, i, *s: kvh(p), vsegs)),
               pb.In("page_table", ops.page_table, pb.whole(pow2=True), smem=True)]
        if cfg.quantised:
            ins += [pb.In("k_scale", ops.k_scale, _scale_pool(lambda b, p, i, *s: kvh(p))),
                    pb.In("v_scale", ops.v_scale, _scale_pool(lambda b, p, i, *s: kvh(p)))]
        return ins
    return [pb.In("k", ops.k, pb.tok(Tk_p, 1, cfg.H, lambda b, p, i, *s: (b, 0, kvh(p)), segs)),
            pb.In("v", ops.v, pb.tok(Tk_p, 1, cfg.Hv, lambda b, p, i, *s: (b, 0, kvh(p)),
                                     vsegs))]


def _inputs(cfg, ops):
    G, bq, Tk_p = cfg.heads, cfg.bq, cfg.nk * cfg.bk
    sb, sh = pb.batch_map(cfg.sched_b), pb.batch_map(cfg.sched_h)
    segs = layout.qk_segs(cfg)
    ins = [pb.In("q", ops.q, pb.tok(bq, G, cfg.H, lambda b, p, i, *s: (b, i, p), segs))]
    ins += _kv_inputs(cfg, ops)
    ins += pb.pos_inputs(cfg, ops, q_rows=bq, q_map=lambda b, p, i, *s: (b, i),
                         k_rows=Tk_p, k_map=lambda b, p, i, *s: (b, 0))
    if cfg.splits > 1:
        counts, lists = ops.sched.split_counts, ops.sched.split_lists
        smap = lambda b, p, i, s: (sb(b), sh(p), i, s)
    else:
        counts, lists = ops.sched.kv_counts, ops.sched.kv_lists
        smap = lambda b, p, i: (sb(b), sh(p), i)
    ins += pb.sched_inputs(counts, lists, 1, smap)
    ins += pb.tail_inputs(cfg, ops)
    if cfg.has_sinks:
        ins.append(pb.In("sinks", ops.sinks, pb.whole(pow2=True), smem=True))
    return ins


def forward(cfg: KernelConfig, ops: Operands) -> Any:
    """``(out [B, Tq, N, Hv], lse [B, N, Tq_p, 1])`` (the key splits combined)."""
    grid = (cfg.B, cfg.N // cfg.heads, cfg.nq) + ((cfg.splits,) if cfg.splits > 1 else ())
    kern = functools.partial(fwd_kernel, cfg=cfg, smod=pb.mod_static(ops.smod),
                             mmod=pb.mod_static(ops.mmod))
    dtype = ops.q.dtype if cfg.quantised else ops.v.dtype  # (quantised v: int8 / float8)
    out, lse = pb.run_pallas(kern, grid, _inputs(cfg, ops), out_makers(cfg, dtype),
                             "jaxpos_attention_fwd")
    if cfg.splits > 1:
        out, lse = combine_splits(cfg, out, lse, ops.sinks, dtype)
    return out, lse


def combine_splits(cfg: KernelConfig, out_s: Any, lse_s: Any, sinks: Any, dtype: Any) -> Any:
    """Flash decoding's combine (Dao et al. 2023): the splits' partial outputs merged by
    their log-sum-exps one after the other with the core's one merge
    (:func:`jaxpos.core.tiles.lse_merge`), then the sinks by the core's one fold
    (:func:`jaxpos.core.tiles.fold_sinks`). ``out_s`` ``[S, B, N, Tq_p, Hv]``, ``lse_s``
    ``[S, B, N, Tq_p, 1]``; returns ``out [B, Tq, N, Hv]`` in ``dtype`` and ``lse
    [B, N, Tq_p, 1]``."""
    def merge(acc, part):
        return lse_merge(*acc, *part), None

    lse_parts = lse_s[..., 0]
    (out, lse), _ = jax.lax.scan(merge, (out_s[0], lse_parts[0]), (out_s[1:], lse_parts[1:]))
    if sinks is not None:
        out, lse = fold_sinks(out, lse, sinks, head_axis=1)
    out = out[:, :, :cfg.Tq]  # [B, N, Tq, Hv]
    return jnp.swapaxes(out, 1, 2).astype(dtype), lse[..., None]
