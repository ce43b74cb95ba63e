"""The fused attention kernel: FlashAttention-2 (Dao 2023, Alg. 1 and 2) forward and
backward as Pallas kernels, programmable by a score_mod and a mask_mod (FlexAttention,
Dong et al. 2024), with block-sparse tile skipping, attention sinks, per-row key lengths,
split-K decoding and RoPE applied to q and k as they are loaded.

Layout. The kernels read q, k, v and write the output and the gradients in the caller's
``[B, T, N, H]`` layout through their BlockSpecs (one head of one tile is a strided block,
as in JAX's ``pallas/ops/gpu/attention.py``): no transpose or padding copy of q, k, v, the
output or the gradients. Rows past ``T`` in a last partial tile and feature columns past
``H`` are handled in the kernel:

* Triton (CUDA / ROCm) blocks are powers of two: the feature block is
  ``next_pow2(max(H, 16))`` wide and every load / store of a tile is masked
  (``pl.load(..., mask=..., other=0)``) on the real rows and columns;
* interpret mode (CPU) and TPU take blocks of the exact width ``H``; rows past ``T`` of a
  last tile are zeroed with ``where`` after the load (those reads are padding) and their
  writes are dropped by Pallas;
* TPU (Mosaic) needs the last two block dims aligned to ``(8, 128)`` or whole, so one head
  of ``[B, T, N, H]`` is a block only through the free reshape ``[B, T, N * H]`` when
  ``H % 128 == 0``; for other head dims the TPU lowering keeps a ``[B, N, T, H]``
  transpose (a copy; TPU only).

Work layout (``B`` batch, ``N`` query heads, ``N_kv`` key/value heads, ``g = N / N_kv``,
``bq`` / ``bk`` tiles):

* forward, grid ``(B, N / G, Tq / bq[, S])``: one query tile of ``G`` query heads per
  program (``G = g`` for decode-shaped calls, where the ``g`` heads that share a KV head
  read each K/V tile once; else ``G = 1``), two loops over key tiles, first the PARTIAL
  tiles of its row of the tile schedule (masked), then the FULL ones (no masking at all),
  with the online softmax (Milakov & Gimelshein 2018). EMPTY tiles are never visited:
  with ``causal=True`` and monotone positions the loop of query tile ``i`` stops at the
  diagonal; with ``kv_lengths`` it stops at the row's filled length. With ``S > 1``
  key splits (flash decoding) each program covers a slice of the key tiles and writes a
  partial output with its log-sum-exp; the partials are combined outside by their
  log-sum-exps. Writes the output and the log-sum-exp ``lse``.
* backward ``dq``, grid ``(B, N, Tq / bq)``: the same loops, recomputing the
  probabilities from ``lse``.
* backward ``dk, dv``, grid ``(B, N_kv, Tk / bk)``: one key tile of one KV head per
  program, looping over the query tiles of its column of the schedule (with causal, from
  the diagonal down) for each of the ``g`` query heads of the group, so dk and dv are
  written once per KV head in k's layout (no per-query-head buffer, no group sum).

Scores are ``scale * q . k`` (float32 accumulation), then the score_mod, then ``-inf``
where hidden. RoPE (Su et al. 2024 §3.4, the ``"half"`` layout) is either applied to q and
k before the kernel, or, with ``rope_tables``, inside it: the kernel takes unrotated q and
k and cos/sin tables of their positions (computed once per call outside the kernels, no
sin/cos in a kernel body), rotates the query tile once per program and each key tile as
it is loaded; the backward rotates dq and dk back (the transpose of the rotation).

The score_mod / mask_mod are traced inside the kernel bodies (see
:mod:`jaxpos.kernels.modeval`): captured arrays are kernel inputs, indexing them becomes
indexed loads (one gather instruction per tile on GPU, whatever the table size), and the
mods see the program's batch and query head and the tile's positions.

Gradients of the captured arrays (and of nothing else) are computed *outside* the
kernels by a blockwise plain-JAX pass that recomputes the score tiles from the saved
``lse`` (:func:`_mod_const_grads`): exact, lowered by XLA on every backend (a gather's
transpose is a scatter-add, which neither Triton nor Mosaic lowers), and removed by
XLA's dead-code elimination under ``jit`` when no captured array needs a gradient, so
training ``q``, ``k``, ``v`` never pays for it. The sink gradient and the gradient
through a returned ``lse`` come from ``lse`` too: with ``dlse`` the cotangent of the
returned log-sum-exp, ``delta' = rowsum(dO * O) - dlse`` replaces ``delta`` in the
backward kernels (``d lse / d s = p``), and ``d sink_h = -sum_{b,i} exp(sink_h -
lse_bhi) * delta'_bhi``.

Nothing of size ``Tq x Tk`` is written by the kernels. The same kernel bodies are lowered
by Pallas to Triton (``platforms=["cuda"]``) and to Mosaic TPU (``["tpu"]``), and run on
CPU in interpret mode.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxpos import _checks
from jaxpos._util import (
    cast_varying,
    match_vma,
    pad_axis,
    pow2_at_least,
    sink_gradient,
    varying_axes,
    zero_cotangent,
)
from jaxpos.core.dropout import Dropout, keep_tile
from jaxpos.kernels import modeval
from jaxpos.kernels import schedule as sched_lib
from jaxpos.mods import BlockMask, convert_mod, is_additive
from jaxpos.schemes.rope.tables import RopeTables, check_rope_tables, rope_tables

__all__ = ["DEFAULT_BLOCK_K", "DEFAULT_BLOCK_Q", "RopeTables", "kernel_attention",
           "rope_tables"]

DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 128
_MIN_WIDTH = 16  # smallest feature width (Triton dots need K >= 16)
#: A forward program takes all ``g`` query heads of a KV head when ``block_q * g`` rows
#: fit this (decode-shaped calls); otherwise one query head per program.
GROUP_ROWS = 128
#: ``kv_splits=None`` splits the keys of a single-query-tile call until the forward grid
#: has about this many programs (flash decoding: a decode step has ``B * N_kv`` programs
#: otherwise, too few to fill a GPU).
SPLIT_PROGRAMS = 128

# Test hooks, read at trace time.
# POISON_OUTPUTS: every kernel output starts as NaN (aliased NaN-filled inputs), so an
# element a kernel fails to write shows up as NaN.
POISON_OUTPUTS = False
# INTERPRET_STYLE: how the interpreter reads captured arrays by index: "load" (indexed
# loads, the GPU form) or "loop" (the TPU form), so both forms are checked on CPU.
INTERPRET_STYLE = "load"
# Bytes of float32 score block the captured-array gradient pass holds per step.
CONST_GRAD_BLOCK_BYTES = 1 << 27


class _Cfg(NamedTuple):
    """Static configuration of one call (hashable: a ``custom_vjp`` nondiff argument)."""

    B: int
    N: int
    groups: int  # N // N_kv
    Tq: int  # real lengths
    Tk: int
    H: int
    Hv: int
    bq: int
    bk: int
    nq: int
    nk: int
    scale: float
    causal: bool
    has_segments: bool
    qpos_batched: bool
    kvpos_batched: bool
    sched_b: bool  # the schedule differs per batch row
    sched_h: bool  # ... per head
    has_sinks: bool
    additive: bool  # d score_mod / d score == 1 (or no score_mod)
    precise: bool  # float32 inputs: exact float32 dots
    mode: str  # "interpret", "compiled" or "auto"
    heads: int = 1  # query heads per forward program (1, or groups)
    splits: int = 1  # key splits of the forward (flash decoding)
    has_kv_len: bool = False
    rope_half: int = 0  # RoPE pairs rotated in the kernel (0: none)
    rope_qb: bool = False  # the query tables differ per batch row
    rope_kb: bool = False
    count_tiles: bool = False  # test hook: kernels also output their loop trip counts
    dropout_rate: float = 0.0  # attention dropout (0: none); the seed is ints["drop_seed"]
    dropout_broadcast: bool = False  # one [Tq, Tk] mask for every batch row and head


# ------------------------------------------------------------------- platform layouts
class _Plat(NamedTuple):
    """How one platform's kernels see ``[B, T, N, H]`` arrays: ``kind`` is ``"4d"`` (the
    array itself, one head a strided block), ``"flat"`` (``[B, T, N * H]``, TPU with
    ``H % 128 == 0``) or ``"bnth"`` (``[B, N, T, H]``, the TPU fallback); ``masked``:
    Triton, power-of-two feature blocks and masked loads / stores."""

    name: str
    kind: str
    masked: bool


def _plat(platform, cfg):
    if platform == "tpu":
        flat = cfg.H % 128 == 0 and cfg.Hv % 128 == 0
        return _Plat(platform, "flat" if flat else "bnth", False)
    return _Plat(platform, "4d", platform in ("cuda", "rocm"))


def _wb(plat, w):
    """Block width of a feature segment of width ``w``."""
    return pow2_at_least(w, _MIN_WIDTH) if plat.masked else w


def _qk_segs(cfg):
    """Feature segments ``(start, width)`` of q and k: the two RoPE halves and the
    pass-through rest with in-kernel RoPE, else the whole head."""
    if not cfg.rope_half:
        return ((0, cfg.H),)
    r = cfg.rope_half
    return ((0, r), (r, r)) + (((2 * r, cfg.H - 2 * r),) if cfg.H > 2 * r else ())


def _v_segs(cfg):
    return ((0, cfg.Hv),)


def _block_width(plat, segs, W):
    if plat.kind != "4d":
        return W
    return pow2_at_least(max(c0 + _wb(plat, w) for c0, w in segs), 1) if plat.masked else W


def _to_kernel(plat, x):
    """``[B, T, n, W]`` -> this platform's kernel array."""
    if plat.kind == "flat":
        return x.reshape(x.shape[:2] + (-1,))
    if plat.kind == "bnth":
        return jnp.swapaxes(x, 1, 2)
    return x


def _from_kernel(plat, y, n):
    if plat.kind == "flat":
        return y.reshape(y.shape[:2] + (n, -1))
    if plat.kind == "bnth":
        return jnp.swapaxes(y, 1, 2)
    return y


def _tok_spec(plat, rows, heads, W, Wb, imap):
    """BlockSpec of ``rows`` tokens of ``heads`` consecutive heads; ``imap(*grid) ->
    (batch, row block, head block)``."""
    hd = None if heads == 1 else heads
    if plat.kind == "4d":
        return pl.BlockSpec((None, rows, hd, Wb), lambda *g: (*imap(*g), 0))
    if plat.kind == "flat":
        return pl.BlockSpec((None, rows, heads * W), lambda *g: imap(*g))

    def bnth(*g):
        b, t, h = imap(*g)
        return b, h, t, 0

    return pl.BlockSpec((None, hd, rows, W), bnth)


def _view(ref, plat, heads, hi, W, rows, c0, w):
    """Kernel side: the ref view of head ``hi`` (of ``heads`` in the block), ``rows``,
    features ``[c0, c0 + block width)``."""
    if plat.kind == "flat":
        return ref.at[rows, pl.ds(hi * W + c0, w)]
    cols = pl.ds(c0, _wb(plat, w))
    if heads == 1:
        return ref.at[rows, cols]
    return ref.at[rows, hi, cols] if plat.kind == "4d" else ref.at[hi, rows, cols]


def _tile_mask(plat, shape, w, row_ok):
    """The mask of a masked (Triton) load / store: real rows and real columns."""
    mask = row_ok
    if plat.masked and shape[-1] != w:
        col = jax.lax.broadcasted_iota(jnp.int32, (1, shape[-1]), 1) < w
        mask = col if mask is None else mask & col
    return None if mask is None else jnp.broadcast_to(mask, shape)


def _load(view, plat, w, row_ok):
    """Load a tile; rows where ``row_ok`` ([r, 1] bool) is False and columns past ``w`` are
    zero (masked loads on Triton; ``where`` elsewhere)."""
    if plat.masked:
        mask = _tile_mask(plat, view.shape, w, row_ok)
        if mask is None:
            return view[...]
        from jax.experimental.pallas import triton as plgpu

        return plgpu.load(view, mask=mask, other=0)
    x = view[...]
    if row_ok is not None:
        x = jnp.where(row_ok, x, jnp.zeros((), x.dtype))
    return x


def _store(view, plat, w, row_ok, val):
    val = val.astype(view.dtype)
    if plat.masked:
        mask = _tile_mask(plat, view.shape, w, row_ok)
        if mask is not None:
            from jax.experimental.pallas import triton as plgpu

            plgpu.store(view, val, mask=mask)
            return
    view[...] = val


def _rows_ok(start, n, limit):
    return (start + jax.lax.broadcasted_iota(jnp.int32, (n, 1), 0)) < limit


def _load_feats(ref, plat, cfg, heads, hi, W, rows, segs, row_ok, tab):
    """The feature segments of one head's tile (rotated by ``tab = (cos, sin)`` when
    given), each ``[r, block width]`` in the input dtype."""
    xs = [_load(_view(ref, plat, heads, hi, W, rows, c0, w), plat, w, row_ok)
          for c0, w in segs]
    if tab is None:
        return xs
    c, s = tab
    dtype = xs[0].dtype
    x1, x2 = xs[0].astype(jnp.float32), xs[1].astype(jnp.float32)
    return [(x1 * c - x2 * s).astype(dtype), (x2 * c + x1 * s).astype(dtype)] + xs[2:]


def _unrotate(gs, tab):
    """Gradients with respect to the unrotated features (the rotation's transpose)."""
    if tab is None:
        return gs
    c, s = tab
    g1, g2 = gs[0], gs[1]
    return [g1 * c + g2 * s, g2 * c - g1 * s] + list(gs[2:])


def _store_feats(ref, plat, heads, hi, W, rows, segs, row_ok, vals):
    for (c0, w), val in zip(segs, vals):
        _store(_view(ref, plat, heads, hi, W, rows, c0, w), plat, w, row_ok, val)


# ------------------------------------------------------------------------ kernel pieces
def _dot(a, b, cfg, contract=((1,), (1,))):
    prec = jax.lax.Precision.HIGHEST if cfg.precise else None
    return jax.lax.dot_general(a, b, (contract, ((), ())), precision=prec,
                               preferred_element_type=jnp.float32)


def _dots(xs, ys, cfg):
    """``sum_seg xs[seg] . ys[seg]^T`` (the scores over feature segments)."""
    out = _dot(xs[0], ys[0], cfg)
    for x, y in zip(xs[1:], ys[1:]):
        out = out + _dot(x, y, cfg)
    return out


def _loader(style, refs):
    return (modeval.RefLoader if style == "load" else modeval.LoopLoader)(refs)


class _Mods:
    """The score_mod / mask_mod of one kernel body, reading captured arrays from refs."""

    def __init__(self, r, smod, mmod, style):
        self.score = self.mask = None
        if smod is not None:
            refs = [r[f"smod{i}"] for i in range(len(smod.consts))]
            self.score = modeval.mod_function(smod, _loader(style, refs))
        if mmod is not None:
            refs = [r[f"mmod{i}"] for i in range(len(mmod.consts))]
            self.mask = modeval.mod_function(mmod, _loader(style, refs))


def _scores(cfg, mods, b, h, q, k, q_pos, kv_pos):
    """``(s_raw, s)``: the scaled scores of a tile and the score_mod applied to them."""
    s_raw = _dots(q, k, cfg) * jnp.float32(cfg.scale)
    if mods.score is None:
        return s_raw, s_raw
    return s_raw, mods.score(s_raw, b, h, q_pos, kv_pos)


def _score_derivative(cfg, mods, b, h, s_raw, q_pos, kv_pos):
    """``d score_mod / d score`` on a tile (elementwise), or None when it is 1."""
    if cfg.additive or mods.score is None:
        return None
    _, t = jax.jvp(lambda s: mods.score(s, b, h, q_pos, kv_pos), (s_raw,),
                   (jnp.ones_like(s_raw),))
    return t


def _kv_padded(cfg):
    """Whether key tiles may hold keys that do not exist (past ``Tk`` or a row's length)."""
    return cfg.nk * cfg.bk != cfg.Tk or cfg.has_kv_len


def _visible(cfg, mods, b, h, q_pos, kv_pos, q_seg, kv_seg, j, kv_lim, shape):
    """bool ``shape`` visibility of a PARTIAL tile (key tile ``j``)."""
    vis = None

    def conj(a, x):
        return x if a is None else a & x

    if cfg.causal:
        vis = conj(vis, kv_pos <= q_pos)
    if _kv_padded(cfg):
        idx = j * cfg.bk + jax.lax.broadcasted_iota(jnp.int32, (1, cfg.bk), 1)
        vis = conj(vis, idx < kv_lim)
    if cfg.has_segments:
        vis = conj(vis, q_seg == kv_seg)
    if mods.mask is not None:
        vis = conj(vis, mods.mask(b, h, q_pos, kv_pos))
    if vis is None:
        return jnp.ones(shape, jnp.bool_)
    return jnp.broadcast_to(vis, shape)


def _loops(count, item, carry, tile, offset=0):
    """Run ``tile(index, carry, masked)`` over the PARTIAL then the FULL tiles of this
    program's schedule row (``count(row)``, ``item(row, t)``); each loop's trip count is
    the number of such tiles. ``offset`` is added to every index (a key split's start)."""

    def run(row, carry, masked):
        # The next tile's index is read one iteration ahead and carried (as FlexAttention's
        # kernels advance their pointers), so a tile's addresses never wait on a load
        # issued in the same iteration (what lets Triton pipeline the tile loads).
        def body(t, c):
            j, inner = c
            nxt = item(row, t + 1)
            return nxt, tile(j + offset, inner, masked)

        return jax.lax.fori_loop(0, count(row), body, (item(row, 0), carry))[1]

    return run(1, run(0, carry, True), False)


def _sched_fns(counts, lists, lead=()):
    """``count(row)`` / ``item(row, t)`` of a counts ref ``[*lead, 1, 2]`` and a lists ref
    ``[*lead, 2, L]`` (``lead``: static indices of a head inside the block)."""
    last = lists.shape[-1] - 1
    return (lambda row: counts[(*lead, 0, row)],
            lambda row, t: lists[(*lead, row, jnp.minimum(t, last))])


def _count(cfg, carry_cnt, masked):
    if not cfg.count_tiles:
        return carry_cnt
    return carry_cnt + jnp.where(jnp.arange(2) == (0 if masked else 1), 1, 0).astype(jnp.int32)


def _names(refs, names):
    assert len(refs) == len(names), "kernel argument list out of sync"
    return dict(zip(names, refs))


def _hd(heads, hi, *idx):
    """One index tuple (Triton takes a single indexer): head ``hi`` of a block of ``heads``
    heads (a leading block dim when ``heads > 1``), then ``idx``."""
    return idx if heads == 1 else (hi, *idx)


def _dropped(cfg, r, b, h, q0, rq, k0, rk, x):
    """``x`` (a ``[rq, rk]`` tile of probabilities or of ``dO V^T``) times the dropout
    factor ``keep / (1 - rate)`` of query rows ``q0 + [0, rq)`` and key columns
    ``k0 + [0, rk)`` (indices along the call's sequences), the keep decisions of
    :func:`jaxpos.core.dropout.keep_tile` for batch row ``b`` and query head ``h`` (both 0 with a
    broadcast mask): the same pairs as the reference and chunked paths. ``x`` unchanged
    without dropout."""
    if not cfg.dropout_rate:
        return x
    drop = Dropout(cfg.dropout_rate, None, cfg.dropout_broadcast)  # type: ignore[arg-type]
    if cfg.dropout_broadcast:
        b = h = 0
    qi = q0 + jax.lax.broadcasted_iota(jnp.int32, (rq, 1), 0)
    ki = k0 + jax.lax.broadcasted_iota(jnp.int32, (1, rk), 1)
    keep = keep_tile((r["drop_seed"][0], r["drop_seed"][1]), drop.threshold, b, h, qi, ki)
    return jnp.where(keep, x * jnp.float32(drop.scale), 0.0)


# ------------------------------------------------------------------------------ forward
def _fwd_kernel(*refs, cfg, names, smod, mmod, style, plat):
    r = _names(refs, names)
    b, p, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    split = pl.program_id(3) if cfg.splits > 1 else None
    G, bq, bk = cfg.heads, cfg.bq, cfg.bk
    mods = _Mods(r, smod, mmod, style)
    segs, vsegs = _qk_segs(cfg), _v_segs(cfg)
    q_pos = r["q_pos"][...]  # [bq, 1]
    q_seg = r["q_seg"][...] if cfg.has_segments else None
    q_row = _rows_ok(i * bq, bq, cfg.Tq) if cfg.nq * bq != cfg.Tq else None
    q_tab = (r["q_cos"][...], r["q_sin"][...]) if cfg.rope_half else None
    qs = [_load_feats(r["q"], plat, cfg, G, hi, cfg.H, slice(None), segs, q_row, q_tab)
          for hi in range(G)]
    kv_lim = r["kv_len"][b] if cfg.has_kv_len else cfg.Tk
    wv = _wb(plat, cfg.Hv)
    if cfg.has_sinks and cfg.splits == 1:
        init_ml = [(jnp.full((bq, 1), r["sinks"][p * G + hi], jnp.float32),
                    jnp.ones((bq, 1), jnp.float32)) for hi in range(G)]
    else:
        init_ml = [(jnp.full((bq, 1), -jnp.inf, jnp.float32), jnp.zeros((bq, 1), jnp.float32))
                   for _ in range(G)]

    def tile(j, carry, masked):
        state, cnt = carry
        rows = pl.ds(j * bk, bk)
        kv_pos = r["kv_pos"][:, rows]  # [1, bk]
        k_row = _rows_ok(j * bk, bk, kv_lim) if masked and _kv_padded(cfg) else None
        k_tab = (r["k_cos"][rows, :], r["k_sin"][rows, :]) if cfg.rope_half else None
        k = _load_feats(r["k"], plat, cfg, 1, 0, cfg.H, rows, segs, k_row, k_tab)
        (v,) = _load_feats(r["v"], plat, cfg, 1, 0, cfg.Hv, rows, vsegs, k_row, None)
        kv_seg = r["kv_seg"][:, rows] if (masked and cfg.has_segments) else None
        new = []
        for hi in range(G):
            h = p * G + hi
            m, l, acc = state[hi]
            _, s = _scores(cfg, mods, b, h, qs[hi], k, q_pos, kv_pos)
            if masked:
                vis = _visible(cfg, mods, b, h, q_pos, kv_pos, q_seg, kv_seg, j, kv_lim, s.shape)
                s = jnp.where(vis, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            pr = jnp.exp(s - m_safe)
            corr = jnp.exp(m - m_safe)
            l = l * corr + jnp.sum(pr, axis=1, keepdims=True)  # undropped normaliser
            pr = _dropped(cfg, r, b, h, i * bq, bq, j * bk, bk, pr)
            acc = acc * corr + _dot(pr.astype(v.dtype), v, cfg, ((1,), (0,)))
            new.append((m_new, l, acc))
        return new, _count(cfg, cnt, masked)

    init = ([(m0, l0, jnp.zeros((bq, wv), jnp.float32)) for m0, l0 in init_ml],
            jnp.zeros((2,), jnp.int32))
    count, item = _sched_fns(r["counts"], r["lists"])
    offset = 0 if split is None else split * _split_len(cfg)
    state, cnt = _loops(count, item, init, tile, offset)
    for hi, (m, l, acc) in enumerate(state):
        l_safe = jnp.where(l == 0.0, 1.0, l)
        lse = jnp.where(l == 0.0, -jnp.inf, m + jnp.log(l_safe))
        if cfg.splits == 1:
            _store_feats(r["out"], plat, G, hi, cfg.Hv, slice(None), vsegs, q_row,
                         [acc / l_safe])
        else:
            r["out"][_hd(G, hi, slice(None), slice(None))] = acc / l_safe
        r["lse"][_hd(G, hi, slice(None), slice(None))] = lse
    if cfg.count_tiles:
        r["visits"][...] = cnt[None, :]


# ----------------------------------------------------------------------------- backward
def _chain(cfg, mods, b, h, ds, s_raw, q_pos, kv_pos, vis):
    """The gradient with respect to the raw score: ``ds * d score_mod / d score``."""
    d = _score_derivative(cfg, mods, b, h, s_raw, q_pos, kv_pos)
    if d is None:
        return ds
    ds = ds * d
    return ds if vis is None else jnp.where(vis, ds, 0.0)


def _dq_kernel(*refs, cfg, names, smod, mmod, style, plat):
    r = _names(refs, names)
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bq, bk = cfg.bq, cfg.bk
    mods = _Mods(r, smod, mmod, style)
    segs, vsegs = _qk_segs(cfg), _v_segs(cfg)
    q_row = _rows_ok(i * bq, bq, cfg.Tq) if cfg.nq * bq != cfg.Tq else None
    q_tab = (r["q_cos"][...], r["q_sin"][...]) if cfg.rope_half else None
    q = _load_feats(r["q"], plat, cfg, 1, 0, cfg.H, slice(None), segs, q_row, q_tab)
    dtype = q[0].dtype
    q_pos = r["q_pos"][...]
    q_seg = r["q_seg"][...] if cfg.has_segments else None
    (do,) = _load_feats(r["do"], plat, cfg, 1, 0, cfg.Hv, slice(None), vsegs, q_row, None)
    lse = r["lse"][...]
    lse_safe = jnp.where(lse == -jnp.inf, 0.0, lse)
    delta = r["delta"][...]
    kv_lim = r["kv_len"][b] if cfg.has_kv_len else cfg.Tk

    def tile(j, carry, masked):
        dq, cnt = carry
        rows = pl.ds(j * bk, bk)
        kv_pos = r["kv_pos"][:, rows]
        k_row = _rows_ok(j * bk, bk, kv_lim) if masked and _kv_padded(cfg) else None
        k_tab = (r["k_cos"][rows, :], r["k_sin"][rows, :]) if cfg.rope_half else None
        k = _load_feats(r["k"], plat, cfg, 1, 0, cfg.H, rows, segs, k_row, k_tab)
        (v,) = _load_feats(r["v"], plat, cfg, 1, 0, cfg.Hv, rows, vsegs, k_row, None)
        s_raw, s = _scores(cfg, mods, b, h, q, k, q_pos, kv_pos)
        vis = None
        if masked:
            kv_seg = r["kv_seg"][:, rows] if cfg.has_segments else None
            vis = _visible(cfg, mods, b, h, q_pos, kv_pos, q_seg, kv_seg, j, kv_lim, s.shape)
            s = jnp.where(vis, s, -jnp.inf)
        pr = jnp.exp(s - lse_safe)  # 0 where hidden
        dp = _dropped(cfg, r, b, h, i * bq, bq, j * bk, bk, _dot(do, v, cfg))
        ds = pr * (dp - delta)
        ds = _chain(cfg, mods, b, h, ds, s_raw, q_pos, kv_pos, vis).astype(dtype)
        dq = [a + _dot(ds, kk, cfg, ((1,), (0,))) for a, kk in zip(dq, k)]
        return dq, _count(cfg, cnt, masked)

    count, item = _sched_fns(r["counts"], r["lists"])
    init = ([jnp.zeros(x.shape, jnp.float32) for x in q], jnp.zeros((2,), jnp.int32))
    dq, _ = _loops(count, item, init, tile)
    dq = _unrotate([x * jnp.float32(cfg.scale) for x in dq], q_tab)
    _store_feats(r["dq"], plat, 1, 0, cfg.H, slice(None), segs, q_row, dq)


def _dkv_kernel(*refs, cfg, names, smod, mmod, style, plat):
    r = _names(refs, names)
    b, kh, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    g, bq, bk = cfg.groups, cfg.bq, cfg.bk
    mods = _Mods(r, smod, mmod, style)
    segs, vsegs = _qk_segs(cfg), _v_segs(cfg)
    kv_lim = r["kv_len"][b] if cfg.has_kv_len else cfg.Tk
    k_row = _rows_ok(j * bk, bk, kv_lim) if _kv_padded(cfg) else None
    k_real = _rows_ok(j * bk, bk, cfg.Tk) if cfg.nk * bk != cfg.Tk else None  # stores
    k_tab = (r["k_cos"][...], r["k_sin"][...]) if cfg.rope_half else None
    k = _load_feats(r["k"], plat, cfg, 1, 0, cfg.H, slice(None), segs, k_row, k_tab)
    (v,) = _load_feats(r["v"], plat, cfg, 1, 0, cfg.Hv, slice(None), vsegs, k_row, None)
    dtype = k[0].dtype
    kv_pos = r["kv_pos"][...]  # [1, bk]
    kv_seg = r["kv_seg"][...] if cfg.has_segments else None
    q_pad = cfg.nq * bq != cfg.Tq

    def tile_for(hi):
        h = kh * g + hi

        def tile(i, carry, masked):
            dk, dv, cnt = carry
            rows = pl.ds(i * bq, bq)
            q_row = _rows_ok(i * bq, bq, cfg.Tq) if q_pad else None
            q_tab = (r["q_cos"][rows, :], r["q_sin"][rows, :]) if cfg.rope_half else None
            q = _load_feats(r["q"], plat, cfg, g, hi, cfg.H, rows, segs, q_row, q_tab)
            (do,) = _load_feats(r["do"], plat, cfg, g, hi, cfg.Hv, rows, vsegs, q_row, None)
            q_pos = r["q_pos"][rows, :]
            s_raw, s = _scores(cfg, mods, b, h, q, k, q_pos, kv_pos)
            vis = None
            if masked:
                q_seg = r["q_seg"][rows, :] if cfg.has_segments else None
                vis = _visible(cfg, mods, b, h, q_pos, kv_pos, q_seg, kv_seg, j, kv_lim,
                               s.shape)
                s = jnp.where(vis, s, -jnp.inf)
            lse = r["lse"][_hd(g, hi, rows, slice(None))]
            pr = jnp.exp(s - jnp.where(lse == -jnp.inf, 0.0, lse))
            pz = _dropped(cfg, r, b, h, i * bq, bq, j * bk, bk, pr)
            dv = dv + _dot(pz.astype(do.dtype), do, cfg, ((0,), (0,)))
            dp = _dropped(cfg, r, b, h, i * bq, bq, j * bk, bk, _dot(do, v, cfg))
            ds = pr * (dp - r["delta"][_hd(g, hi, rows, slice(None))])
            ds = _chain(cfg, mods, b, h, ds, s_raw, q_pos, kv_pos, vis).astype(dtype)
            dk = [a + _dot(ds, qq, cfg, ((0,), (0,))) for a, qq in zip(dk, q)]
            return dk, dv, _count(cfg, cnt, masked)

        return tile

    carry = ([jnp.zeros(x.shape, jnp.float32) for x in k], jnp.zeros(v.shape, jnp.float32),
             jnp.zeros((2,), jnp.int32))
    if cfg.sched_h:  # each head of the group has its own column of the schedule
        for hi in range(g):
            count, item = _sched_fns(r["counts"], r["lists"], _hd(g, hi))
            carry = _loops(count, item, carry, tile_for(hi))
    else:  # one column for all: each query tile is visited once for the g heads
        count, item = _sched_fns(r["counts"], r["lists"])
        tiles = [tile_for(hi) for hi in range(g)]

        def tile(i, c, masked):
            for t in tiles:
                c = t(i, c, masked)
            return c

        carry = _loops(count, item, carry, tile)
    dk, dv, cnt = carry
    dk = _unrotate([x * jnp.float32(cfg.scale) for x in dk], k_tab)
    _store_feats(r["dk"], plat, 1, 0, cfg.H, slice(None), segs, k_real, dk)
    _store_feats(r["dv"], plat, 1, 0, cfg.Hv, slice(None), vsegs, k_real, [dv])
    if cfg.count_tiles:
        r["visits"][...] = cnt[None, :]


# ------------------------------------------------------------------------ pallas plumbing
def _declare_axes(out_shape, axes, like):
    """``ShapeDtypeStruct`` outputs declared to vary over the manual mesh ``axes`` (inside
    ``shard_map`` with ``check_vma=True``)."""
    if not axes:
        return out_shape
    params = inspect.signature(jax.ShapeDtypeStruct).parameters
    aval = jax.typeof(like)
    mat = getattr(aval, "manual_axis_type", None) or getattr(aval, "mat", None)
    if "manual_axis_type" in params and mat is not None and hasattr(mat, "update"):  # JAX 0.10
        declare = {"manual_axis_type": mat.update(varying=axes)}
    elif "vma" in params:
        declare = {"vma": axes}
    else:
        return out_shape
    return tuple(jax.ShapeDtypeStruct(o.shape, o.dtype, **declare) for o in out_shape)


def _match_manual_axes(args):
    """Make a ``pallas_call`` valid inside ``shard_map`` with ``check_vma=True`` (its
    default): every input must vary over the same manual mesh axes and each output's
    ``ShapeDtypeStruct`` must say which axes it varies over. The kernel mixes sharded
    arrays (q, k, v) with replicated ones (positions, captured arrays, the schedule), so
    inputs are cast to the union of their axes and the outputs declared to vary over it
    (:func:`_declare_axes`). Outside ``shard_map`` the union is empty and nothing changes.
    Returns ``(args, axes)``."""
    vary = [varying_axes(a) for a in args]
    axes = frozenset().union(*vary)
    if not axes:
        return args, axes
    return tuple(a if v == axes else cast_varying(a, axes) for a, v in zip(args, vary)), axes


class _In(NamedTuple):
    """One kernel input. ``spec(plat, x)`` gives ``(array, BlockSpec)`` for a platform (the
    array may be reshaped there: a layout change or power-of-two padding); ``smem`` puts
    it in TPU scalar memory (whole array, or blocks of ``spec``)."""

    name: str
    array: Any
    spec: Any
    smem: bool = False


class _Out(NamedTuple):
    """One kernel output: ``make(plat) -> (ShapeDtypeStruct, BlockSpec, post)``; ``post``
    maps the kernel's array back to the canonical layout."""

    name: str
    make: Any


def _whole(pow2=False):
    """The whole array in every program (captured arrays, sinks; Triton: every dim padded
    to a power of two when ``pow2``)."""

    def spec(plat, x):
        if pow2 and plat.masked:
            for ax in range(x.ndim):
                x = pad_axis(x, ax, pow2_at_least(x.shape[ax]))
        return x, pl.BlockSpec(tuple(x.shape), lambda *_: (0,) * x.ndim)

    spec.whole = True
    return spec


def _fixed(shape, index_map):
    return lambda plat, x: (x, pl.BlockSpec(shape, index_map))


def _smem_spec(block_spec, whole):
    from jax.experimental.pallas import tpu as pltpu

    if whole:
        return pl.BlockSpec(memory_space=pltpu.SMEM)
    return pl.BlockSpec(block_spec.block_shape, block_spec.index_map, memory_space=pltpu.SMEM)


def _pallas(kernel, cfg, grid, ins: list[_In], outs: list[_Out], name):
    """Run ``kernel(style=..., plat=...)`` (a factory of kernel bodies) in interpret mode,
    or compiled by Triton (CUDA/ROCm) / Mosaic (TPU)."""
    names = tuple(i.name for i in ins) + tuple(o.name for o in outs)
    args, manual_axes = _match_manual_axes(tuple(i.array for i in ins))
    under_vma = bool(manual_axes)
    if under_vma and (cfg.mode == "interpret"
                      or (cfg.mode == "auto" and jax.default_backend() == "cpu")):
        raise ValueError(
            "implementation='pallas' in interpret mode (the CPU path) cannot run inside "
            "shard_map with check_vma=True: JAX's Pallas interpreter does not track varying "
            "mesh axes. Pass check_vma=False to shard_map, or use implementation='chunked' "
            "(the CPU default). Compiled kernels (GPU, TPU) need neither.")
    n_in = len(args)

    def build(platform, interpret, compiler_params=None):
        style = {"tpu": "loop", "cpu": INTERPRET_STYLE}.get(platform, "load")
        plat = _plat(platform, cfg)

        def f(*a):
            a = list(a[:n_in])
            specs = []
            for idx, inp in enumerate(ins):
                a[idx], spec = inp.spec(plat, a[idx])
                if inp.smem and platform == "tpu":
                    spec = _smem_spec(spec, getattr(inp.spec, "whole", False))
                specs.append(spec)
            made = [o.make(plat) for o in outs]
            out_shape = _declare_axes(tuple(m[0] for m in made), manual_axes, a[0])
            out_specs = [m[1] for m in made]
            body = functools.partial(kernel, names=names, style=style, plat=plat)
            aliases = {}
            if POISON_OUTPUTS:
                poison = [jnp.full(o.shape, jnp.nan if jnp.issubdtype(o.dtype, jnp.inexact)
                                   else -1, o.dtype) for o in out_shape]
                inner = body
                n_out = len(out_shape)

                def body(*refs):  # the aliased NaN inputs are the outputs' initial contents
                    return inner(*refs[:n_in], *refs[n_in + n_out:])

                a = a + poison
                specs = specs + out_specs
                aliases = {n_in + i: i for i in range(n_out)}
            res = pl.pallas_call(body, grid=grid, in_specs=specs, out_specs=out_specs,
                                 out_shape=out_shape, interpret=interpret,
                                 input_output_aliases=aliases,
                                 compiler_params=compiler_params, name=name)(*a)
            return tuple(m[2](x) for m, x in zip(made, res))

        return f

    if cfg.mode == "interpret":
        return build("cpu", True)(*args)
    from jax.experimental.pallas import triton as pltriton

    warps = 8 if cfg.bq * cfg.bk >= 128 * 128 else 4
    params = pltriton.CompilerParams(num_warps=warps, num_stages=2)
    compiled = {"cuda": build("cuda", False, params), "rocm": build("rocm", False, params),
                "tpu": build("tpu", False)}
    if cfg.mode == "auto" and not under_vma:  # (the interpreter cannot lower under vma)
        compiled["cpu"] = build("cpu", True)
    return jax.lax.platform_dependent(*args, **compiled)


def _const_inputs(prefix, conv, smem_ok):
    """Kernel inputs for a converted mod's captured arrays (0-d ones as ``[1]``)."""
    if conv is None:
        return []
    out = []
    for i, c in enumerate(conv.consts):
        x = jnp.asarray(c)
        # Captured arrays travel at least 2-D (leading 1s): TPU blocks of rank < 2 need
        # device information to check; the kernel indexes the added axes with 0.
        x = x.reshape((1,) * (2 - x.ndim) + x.shape) if x.ndim < 2 else x
        out.append(_In(f"{prefix}{i}", x, _whole(pow2=True), smem=smem_ok[i]))
    return out


def _smem_ok(conv):
    """Per captured array: True when the mod only reads it by scalar or indexed loads (it
    may then live in TPU scalar memory)."""
    if conv is None:
        return []
    rec = modeval.UsageRecorder([(np.shape(c), jnp.result_type(c)) for c in conv.consts])
    args = _abstract_mod_args(conv)
    jax.eval_shape(lambda *a: modeval.eval_converted(conv, a, rec), *args)
    return [not d for d in rec.dense]


def _abstract_mod_args(conv):
    v = conv.jaxpr.invars
    return tuple(jax.ShapeDtypeStruct(x.aval.shape, x.aval.dtype) for x in v)


def _mod_static(conv):
    """The mod with its captured arrays replaced by their shapes (the kernel's static
    copy: values come from refs)."""
    if conv is None:
        return None
    return conv.with_consts(tuple(jax.ShapeDtypeStruct(np.shape(c), jnp.result_type(c))
                                  for c in conv.consts))


def _batch_map(batched):
    return (lambda b: b) if batched else (lambda b: 0)


def _tok(x, rows, heads, W, imap, segs):
    """An ``[B, T, n, W]`` token input (q, k, v, do) in the platform's layout."""
    def spec(plat, arr):
        return _to_kernel(plat, arr), _tok_spec(plat, rows, heads, W,
                                                _block_width(plat, segs, W), imap)
    return spec


def _tables(cfg, which, rows, imap):
    """RoPE table inputs (``q_cos``/``q_sin`` or ``k_cos``/``k_sin``): ``[Bt, T_p, half]``,
    Triton: the width padded to a power of two (zeros: padded columns rotate to 0)."""
    def spec(plat, x):
        x = pad_axis(x, 2, _wb(plat, x.shape[2]))
        return x, pl.BlockSpec((None, rows, x.shape[2]), lambda *g: (*imap(*g), 0))
    return spec


def _pos_inputs(cfg, ints, tabs, *, q_rows, q_map, k_rows, k_map):
    """Positions, segments and RoPE tables; ``q_map(*grid) -> (batch, row block)``."""
    qb, kb = _batch_map(cfg.qpos_batched), _batch_map(cfg.kvpos_batched)
    ins = [_In("q_pos", ints["q_pos"], _fixed((None, q_rows, 1), lambda *g: (
               qb(q_map(*g)[0]), q_map(*g)[1], 0))),
           _In("kv_pos", ints["kv_pos"], _fixed((None, 1, k_rows), lambda *g: (
               kb(k_map(*g)[0]), 0, k_map(*g)[1])))]
    if cfg.has_segments:
        ins += [_In("q_seg", ints["q_seg"], _fixed((None, q_rows, 1), lambda *g: (
                    q_map(*g)[0], q_map(*g)[1], 0))),
                _In("kv_seg", ints["kv_seg"], _fixed((None, 1, k_rows), lambda *g: (
                    k_map(*g)[0], 0, k_map(*g)[1])))]
    if cfg.rope_half:
        tqb, tkb = _batch_map(cfg.rope_qb), _batch_map(cfg.rope_kb)
        qm = lambda *g: (tqb(q_map(*g)[0]), q_map(*g)[1])
        km = lambda *g: (tkb(k_map(*g)[0]), k_map(*g)[1])
        ins += [_In("q_cos", tabs[0], _tables(cfg, "q", q_rows, qm)),
                _In("q_sin", tabs[1], _tables(cfg, "q", q_rows, qm)),
                _In("k_cos", tabs[2], _tables(cfg, "k", k_rows, km)),
                _In("k_sin", tabs[3], _tables(cfg, "k", k_rows, km))]
    return ins


def _tail_inputs(cfg, smod, mmod, kv_len, ints):
    ins = []
    if cfg.has_kv_len:
        ins.append(_In("kv_len", kv_len, _whole(pow2=True), smem=True))
    if cfg.dropout_rate:
        ins.append(_In("drop_seed", ints["drop_seed"], _whole(), smem=True))
    ins += _const_inputs("smod", smod, _smem_ok(smod))
    ins += _const_inputs("mmod", mmod, _smem_ok(mmod))
    return ins


def _sched_inputs(counts, lists, heads, imap):
    """Schedule rows: ``imap(*grid) -> (S_b index, S_h index, row[, split])``."""
    hd = None if heads == 1 else heads
    extra = counts.ndim - 5  # a split axis
    lead = (None,) * extra
    c_shape = (None, hd, None) + lead + (1, 2)
    l_shape = (None, hd, None) + lead + (2, lists.shape[-1])
    return [_In("counts", counts, _fixed(c_shape, lambda *g: (*imap(*g), 0, 0)), smem=True),
            _In("lists", lists, _fixed(l_shape, lambda *g: (*imap(*g), 0, 0)), smem=True)]


def _forward(cfg, q, k, v, ints, sched, smod, mmod, sinks, kv_len, tabs):
    """``(out [B, Tq, N, Hv] (or split partials), lse [B, N, Tq_p, 1], visits)``."""
    B, N, G, S, bq = cfg.B, cfg.N, cfg.heads, cfg.splits, cfg.bq
    g, Tq_p, Tk_p = cfg.groups, cfg.nq * bq, cfg.nk * cfg.bk
    NP = N // G
    sb = _batch_map(cfg.sched_b)
    sh = _batch_map(cfg.sched_h)
    kvh = lambda p: jax.lax.div(p * G, g)
    grid = (B, NP, cfg.nq) + ((S,) if S > 1 else ())
    segs, vsegs = _qk_segs(cfg), _v_segs(cfg)
    ins = [_In("q", q, _tok(q, bq, G, cfg.H, lambda b, p, i, *s: (b, i, p), segs)),
           _In("k", k, _tok(k, Tk_p, 1, cfg.H, lambda b, p, i, *s: (b, 0, kvh(p)), segs)),
           _In("v", v, _tok(v, Tk_p, 1, cfg.Hv, lambda b, p, i, *s: (b, 0, kvh(p)), vsegs))]
    ins += _pos_inputs(cfg, ints, tabs, q_rows=bq, q_map=lambda b, p, i, *s: (b, i),
                       k_rows=Tk_p, k_map=lambda b, p, i, *s: (b, 0))
    if S > 1:
        counts, lists = sched.split_counts, sched.split_lists
        smap = lambda b, p, i, s: (sb(b), sh(p), i, s)
    else:
        counts, lists = sched.kv_counts, sched.kv_lists
        smap = lambda b, p, i: (sb(b), sh(p), i)
    ins += _sched_inputs(counts, lists, 1, smap)
    ins += _tail_inputs(cfg, smod, mmod, kv_len, ints)
    if cfg.has_sinks:
        ins.append(_In("sinks", sinks, _whole(pow2=True), smem=True))
    hd = None if G == 1 else G
    dtype = v.dtype

    def out_make(plat):
        if S > 1:  # partial outputs, float32, in the kernel's own padded layout
            wv = _wb(plat, cfg.Hv)
            sds = jax.ShapeDtypeStruct((S, B, N, Tq_p, wv), jnp.float32)
            spec = pl.BlockSpec((None, None, hd, bq, wv), lambda b, p, i, s: (s, b, p, i, 0))
            return sds, spec, lambda y: y[..., :cfg.Hv]
        shape = {"4d": (B, cfg.Tq, N, cfg.Hv), "flat": (B, cfg.Tq, N * cfg.Hv),
                 "bnth": (B, N, cfg.Tq, cfg.Hv)}[plat.kind]
        spec = _tok_spec(plat, bq, G, cfg.Hv, _block_width(plat, vsegs, cfg.Hv),
                         lambda b, p, i: (b, i, p))
        return jax.ShapeDtypeStruct(shape, dtype), spec, lambda y: _from_kernel(plat, y, N)

    def lse_make(plat):
        if S > 1:
            return (jax.ShapeDtypeStruct((S, B, N, Tq_p, 1), jnp.float32),
                    pl.BlockSpec((None, None, hd, bq, 1), lambda b, p, i, s: (s, b, p, i, 0)),
                    lambda y: y)
        return (jax.ShapeDtypeStruct((B, N, Tq_p, 1), jnp.float32),
                pl.BlockSpec((None, hd, bq, 1), lambda b, p, i: (b, p, i, 0)), lambda y: y)

    outs = [_Out("out", out_make), _Out("lse", lse_make)]
    if cfg.count_tiles:
        outs.append(_Out("visits", lambda plat: (
            jax.ShapeDtypeStruct((B, NP, cfg.nq, S, 1, 2), jnp.int32),
            pl.BlockSpec((None, None, None, None, 1, 2),
                         lambda b, p, i, *s: (b, p, i, s[0] if s else 0, 0, 0)),
            lambda y: y)))
    kern = functools.partial(_fwd_kernel, cfg=cfg, smod=_mod_static(smod), mmod=_mod_static(mmod))
    res = _pallas(kern, cfg, grid, ins, outs, "jaxpos_attention_fwd")
    out, lse = res[0], res[1]
    if S > 1:
        out, lse = _combine_splits(cfg, out, lse, sinks, dtype)
    return out, lse, (res[2] if cfg.count_tiles else None)


def _combine_splits(cfg, out_s, lse_s, sinks, dtype):
    """Flash decoding's combine: ``lse = logsumexp_s lse_s`` (and the sink), ``out = sum_s
    exp(lse_s - lse) out_s``. ``out_s`` ``[S, B, N, Tq_p, Hv]``, ``lse_s``
    ``[S, B, N, Tq_p, 1]``."""
    parts = lse_s
    if sinks is not None:
        parts = jnp.concatenate([lse_s, jnp.broadcast_to(
            sinks[None, None, :, None, None], (1,) + lse_s.shape[1:])], axis=0)
    m = jnp.max(parts, axis=0)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    tot = jnp.sum(jnp.exp(parts - m_safe), axis=0)
    lse = jnp.where(tot == 0.0, -jnp.inf, m_safe + jnp.log(jnp.where(tot == 0.0, 1.0, tot)))
    w = jnp.exp(lse_s - jnp.where(lse == -jnp.inf, 0.0, lse))  # [S, B, N, Tq_p, 1]
    out = jnp.sum(out_s * w, axis=0)[:, :, :cfg.Tq]  # [B, N, Tq, Hv]
    return jnp.swapaxes(out, 1, 2).astype(dtype), lse


def _split_len(cfg):
    """Key tiles per split."""
    return -(-cfg.nk // cfg.splits)


def _backward_kernels(cfg, q, k, v, ints, sched, smod, mmod, kv_len, tabs, lse, delta, dout):
    """dq, dk, dv in the inputs' layout and dtypes; ``lse``, ``delta`` ``[B, N, Tq_p, 1]``
    (rows past Tq: lse +inf, delta 0, so they contribute nothing)."""
    B, N, g, bq, bk = cfg.B, cfg.N, cfg.groups, cfg.bq, cfg.bk
    Nk = N // g
    Tq_p, Tk_p = cfg.nq * bq, cfg.nk * bk
    sb, sh = _batch_map(cfg.sched_b), _batch_map(cfg.sched_h)
    segs, vsegs = _qk_segs(cfg), _v_segs(cfg)
    do = dout.astype(v.dtype)
    smod_s, mmod_s = _mod_static(smod), _mod_static(mmod)
    kvh = lambda h: jax.lax.div(h, g)
    # dq: one query tile of one query head per program
    ins = [_In("q", q, _tok(q, bq, 1, cfg.H, lambda b, h, i: (b, i, h), segs)),
           _In("k", k, _tok(k, Tk_p, 1, cfg.H, lambda b, h, i: (b, 0, kvh(h)), segs)),
           _In("v", v, _tok(v, Tk_p, 1, cfg.Hv, lambda b, h, i: (b, 0, kvh(h)), vsegs)),
           _In("do", do, _tok(do, bq, 1, cfg.Hv, lambda b, h, i: (b, i, h), vsegs)),
           _In("lse", lse, _fixed((None, None, bq, 1), lambda b, h, i: (b, h, i, 0))),
           _In("delta", delta, _fixed((None, None, bq, 1), lambda b, h, i: (b, h, i, 0)))]
    ins += _pos_inputs(cfg, ints, tabs, q_rows=bq, q_map=lambda b, h, i: (b, i),
                       k_rows=Tk_p, k_map=lambda b, h, i: (b, 0))
    ins += _sched_inputs(sched.kv_counts, sched.kv_lists, 1, lambda b, h, i: (sb(b), sh(h), i))
    ins += _tail_inputs(cfg, smod, mmod, kv_len, ints)

    def tok_out(name, n, W, rows, imap, seg, dtype, T):
        def make(plat):
            shape = {"4d": (B, T, n, W), "flat": (B, T, n * W), "bnth": (B, n, T, W)}[plat.kind]
            spec = _tok_spec(plat, rows, 1, W, _block_width(plat, seg, W), imap)
            return jax.ShapeDtypeStruct(shape, dtype), spec, lambda y: _from_kernel(plat, y, n)
        return _Out(name, make)

    outs = [tok_out("dq", N, cfg.H, bq, lambda b, h, i: (b, i, h), segs, q.dtype, cfg.Tq)]
    kern = functools.partial(_dq_kernel, cfg=cfg, smod=smod_s, mmod=mmod_s)
    (dq,) = _pallas(kern, cfg, (B, N, cfg.nq), ins, outs, "jaxpos_attention_dq")
    # dk, dv: one key tile of one KV head per program, the group's query heads inside
    ins = [_In("q", q, _tok(q, Tq_p, g, cfg.H, lambda b, h, j: (b, 0, h), segs)),
           _In("k", k, _tok(k, bk, 1, cfg.H, lambda b, h, j: (b, j, h), segs)),
           _In("v", v, _tok(v, bk, 1, cfg.Hv, lambda b, h, j: (b, j, h), vsegs)),
           _In("do", do, _tok(do, Tq_p, g, cfg.Hv, lambda b, h, j: (b, 0, h), vsegs))]
    gd = None if g == 1 else g
    ins += [_In("lse", lse, _fixed((None, gd, Tq_p, 1), lambda b, h, j: (b, h, 0, 0))),
            _In("delta", delta, _fixed((None, gd, Tq_p, 1), lambda b, h, j: (b, h, 0, 0)))]
    ins += _pos_inputs(cfg, ints, tabs, q_rows=Tq_p, q_map=lambda b, h, j: (b, 0),
                       k_rows=bk, k_map=lambda b, h, j: (b, j))
    if cfg.sched_h:
        ins += _sched_inputs(sched.q_counts, sched.q_lists, g, lambda b, h, j: (sb(b), h, j))
    else:
        ins += _sched_inputs(sched.q_counts, sched.q_lists, 1, lambda b, h, j: (sb(b), 0, j))
    ins += _tail_inputs(cfg, smod, mmod, kv_len, ints)
    outs = [tok_out("dk", Nk, cfg.H, bk, lambda b, h, j: (b, j, h), segs, k.dtype, cfg.Tk),
            tok_out("dv", Nk, cfg.Hv, bk, lambda b, h, j: (b, j, h), vsegs, v.dtype, cfg.Tk)]
    if cfg.count_tiles:
        outs.append(_Out("visits", lambda plat: (
            jax.ShapeDtypeStruct((B, Nk, cfg.nk, 1, 2), jnp.int32),
            pl.BlockSpec((None, None, None, 1, 2), lambda b, h, j: (b, h, j, 0, 0)),
            lambda y: y)))
    kern = functools.partial(_dkv_kernel, cfg=cfg, smod=smod_s, mmod=mmod_s)
    res = _pallas(kern, cfg, (B, Nk, cfg.nk), ins, outs, "jaxpos_attention_dkv")
    return dq, res[0], res[1], (res[2] if cfg.count_tiles else None)


# ------------------------------------------------- captured-array gradients (outside)
def _tiles_apply(conv, x, q_pos_t, kv_pos_t, kind):
    """Apply a converted mod to every tile: ``x`` ``[B, N, G, nk, bq, bk]`` (scores) or
    None (a mask: then ``kind`` = (B, N, G, nk)); ``q_pos_t`` ``[Bq, G, bq]``,
    ``kv_pos_t`` ``[Bk, nk, bk]``."""
    B, N = x.shape[:2] if x is not None else kind[:2]

    def one(s, b, h, qp, kp):
        args = (b, h, qp[:, None], kp[None, :])
        if s is None:
            return jnp.broadcast_to(conv(*args), (qp.shape[0], kp.shape[0]))
        return conv(s, *args)

    sa = None if x is None else 0
    f = jax.vmap(one, in_axes=(sa, None, None, None, 0))  # key tiles
    f = jax.vmap(f, in_axes=(sa, None, None, 0, None))  # query tiles
    f = jax.vmap(f, in_axes=(sa, None, 0, None, None))  # heads
    qa = 0 if q_pos_t.shape[0] > 1 else None
    ka = 0 if kv_pos_t.shape[0] > 1 else None
    f = jax.vmap(f, in_axes=(sa, 0, None, qa, ka))  # batch
    qp = q_pos_t if qa == 0 else q_pos_t[0]
    kp = kv_pos_t if ka == 0 else kv_pos_t[0]
    return f(x, jnp.arange(B, dtype=jnp.int32), jnp.arange(N, dtype=jnp.int32), qp, kp)


def _rows_per_step(cfg, width):
    per_tile_row = cfg.B * cfg.N * cfg.bq * width * 4
    G = max(1, min(cfg.nq, CONST_GRAD_BLOCK_BYTES // max(per_tile_row, 1)))
    while cfg.nq % G:
        G -= 1
    return G


def _mod_const_grads(cfg, q, k, v, ints, smod, mmod, lse, do, delta, kv_len, tabs):
    """Gradients of the score_mod's floating captured arrays: ``sum over tiles of
    VJP(score_mod)(dS)``, recomputing each score tile from ``lse`` in plain JAX (a scan
    over groups of query tiles, ``CONST_GRAD_BLOCK_BYTES`` of scores per step). Exact,
    lowered by XLA everywhere, and dead code under ``jit`` when unused (the transposes and
    pads below belong to this pass only)."""
    consts = list(smod.consts)
    diff = [i for i, c in enumerate(consts) if jnp.issubdtype(jnp.result_type(c), jnp.inexact)]
    if not diff:
        return [None] * len(consts)
    B, N, g, bq, bk, nq, nk = cfg.B, cfg.N, cfg.groups, cfg.bq, cfg.bk, cfg.nq, cfg.nk
    Nk = N // g
    Tq_p, Tk_p = nq * bq, nk * bk
    if cfg.rope_half:
        from jaxpos.schemes.rope import rotate

        q = rotate(q, tabs[0][:, :cfg.Tq], tabs[1][:, :cfg.Tq], layout="half")
        k = rotate(k, tabs[2][:, :cfg.Tk], tabs[3][:, :cfg.Tk], layout="half")
    lay = lambda x, T_p: pad_axis(jnp.swapaxes(x, 1, 2), 2, T_p)
    q, k, v, do = lay(q, Tq_p), lay(k, Tk_p), lay(v, Tk_p), lay(do, Tq_p)
    G = _rows_per_step(cfg, Tk_p)
    steps, rows = nq // G, G * bq

    def split_rows(x):  # [B, N, Tq_p, w] -> [steps, B, N, rows, w]
        return jnp.moveaxis(x.reshape(x.shape[:2] + (steps, rows) + x.shape[3:]), 2, 0)

    prec = jax.lax.Precision.HIGHEST if cfg.precise else None
    q_pos = ints["q_pos"][..., 0]  # [Bq, Tq_p]
    kv_pos = ints["kv_pos"][:, 0, :]  # [Bk, Tk_p]
    kv_pos_t = kv_pos.reshape(kv_pos.shape[0], nk, bk)
    q_pos_s = jnp.moveaxis(q_pos.reshape(q_pos.shape[0], steps, G, bq), 1, 0)
    xs = {"q": split_rows(q), "do": split_rows(do), "lse": split_rows(lse),
          "delta": split_rows(delta), "q_pos": q_pos_s,
          "step": jnp.arange(steps, dtype=jnp.int32)}
    if cfg.has_segments:
        xs["q_seg"] = jnp.moveaxis(ints["q_seg"][..., 0].reshape(B, steps, G, bq), 1, 0)
    lim = cfg.Tk if kv_len is None else kv_len[:, None]
    kv_real = jnp.arange(Tk_p)[None, :] < lim  # [1|B, Tk_p]

    def to_tiles(x):  # [B, N, rows, Tk_p] -> [B, N, G, nk, bq, bk]
        x = x.reshape(x.shape[:2] + (G, bq, nk, bk))
        return jnp.swapaxes(x, 3, 4)

    def step(acc, x):
        qi = x["q"].reshape(B, Nk, g, rows, -1)
        doi = x["do"].reshape(B, Nk, g, rows, -1)
        s_raw = jnp.einsum("bkgqh,bkth->bkgqt", qi, k, precision=prec,
                           preferred_element_type=jnp.float32) * jnp.float32(cfg.scale)
        dp = jnp.einsum("bkgqh,bkth->bkgqt", doi, v, precision=prec,
                        preferred_element_type=jnp.float32)
        s_raw = to_tiles(s_raw.reshape(B, N, rows, Tk_p))
        dp = to_tiles(dp.reshape(B, N, rows, Tk_p))
        if cfg.dropout_rate:  # the kernels' keep decisions, on [B, N, G, nk, bq, bk]
            drop = Dropout(cfg.dropout_rate, ints["drop_seed"], cfg.dropout_broadcast)
            qi = x["step"] * rows + (jnp.arange(G, dtype=jnp.int32)[:, None] * bq
                                     + jnp.arange(bq, dtype=jnp.int32)[None, :])
            ki = (jnp.arange(nk, dtype=jnp.int32)[:, None] * bk
                  + jnp.arange(bk, dtype=jnp.int32)[None, :])
            bi = jnp.arange(B, dtype=jnp.int32).reshape(B, 1, 1, 1, 1, 1)
            hi = jnp.arange(N, dtype=jnp.int32).reshape(1, N, 1, 1, 1, 1)
            if drop.broadcast:
                bi, hi = bi * 0, hi * 0
            keep = keep_tile(drop.seed, drop.threshold, bi, hi,
                             qi.reshape(1, 1, G, 1, bq, 1), ki.reshape(1, 1, 1, nk, 1, bk))
            dp = jnp.where(keep, dp * jnp.float32(drop.scale), 0.0)
        lse_t = x["lse"].reshape(B, N, G, 1, bq, 1)
        delta_t = x["delta"].reshape(B, N, G, 1, bq, 1)
        qp = x["q_pos"]  # [Bq, G, bq]
        vis = kv_real.reshape(-1, 1, 1, nk, 1, bk)
        if cfg.causal:
            vis = vis & (kv_pos_t[:, None, None, :, None, :] <= qp[:, None, :, None, :, None])
        if cfg.has_segments:
            kv_seg = ints["kv_seg"][:, 0, :].reshape(B, nk, bk)
            vis = vis & (x["q_seg"][:, None, :, None, :, None] == kv_seg[:, None, None, :, None, :])
        if mmod is not None:
            vis = vis & _tiles_apply(mmod, None, qp, kv_pos_t, (B, N, G, nk))

        def scores(dc):
            cs = list(consts)
            for i, c in zip(diff, dc):
                cs[i] = c
            return _tiles_apply(smod.with_consts(cs), s_raw, qp, kv_pos_t, None)

        s, vjp = jax.vjp(scores, [consts[i] for i in diff])
        lse_safe = jnp.where(lse_t == -jnp.inf, 0.0, lse_t)
        p = jnp.where(vis, jnp.exp(s - lse_safe), 0.0)
        ds = jnp.where(vis, p * (dp - delta_t), 0.0)
        (dc,) = vjp(ds)
        return [a + d for a, d in zip(acc, dc)], None

    acc0 = [jnp.zeros(np.shape(consts[i]), jnp.result_type(consts[i])) for i in diff]
    acc, _ = jax.lax.scan(step, acc0, xs)
    out: list[Any] = [None] * len(consts)
    for i, a in zip(diff, acc):
        out[i] = a
    return out


# ----------------------------------------------------------------------- custom VJP core
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfg, q, k, v, ints, sched, smod, mmod, sinks, kv_len, tabs):
    out, lse, _ = _forward(cfg, q, k, v, ints, sched, smod, mmod, sinks, kv_len, tabs)
    return out, lse


def _core_fwd(cfg, q, k, v, ints, sched, smod, mmod, sinks, kv_len, tabs):
    out, lse, _ = _forward(cfg, q, k, v, ints, sched, smod, mmod, sinks, kv_len, tabs)
    return (out, lse), (q, k, v, ints, sched, smod, mmod, sinks, kv_len, tabs, out, lse)


def _backward_rows(cfg, out, lse, dout, dlse):
    """``(lse, delta)`` ``[B, N, Tq_p, 1]`` for the backward kernels: ``delta =
    rowsum(dO * O) - dlse``; rows past ``Tq`` get ``lse = +inf`` and ``delta = 0`` so their
    (padding) probabilities are 0."""
    Tq_p = cfg.nq * cfg.bq
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, Tq, N]
    delta = pad_axis(jnp.swapaxes(delta, 1, 2), 2, Tq_p)[..., None]
    delta = delta - dlse.astype(jnp.float32)
    real = (jnp.arange(Tq_p) < cfg.Tq)[None, None, :, None]
    return jnp.where(real, lse, jnp.inf), jnp.where(real, delta, 0.0)


def _core_bwd(cfg, res, cts):
    q, k, v, ints, sched, smod, mmod, sinks, kv_len, tabs, out, lse = res
    dout, dlse = cts
    lse_b, delta = _backward_rows(cfg, out, lse, dout, dlse)
    dq, dk, dv, _ = _backward_kernels(cfg, q, k, v, ints, sched, smod, mmod, kv_len, tabs,
                                      lse_b, delta, dout)
    # Under shard_map, a cotangent varies over every axis the kernel's inputs did; a primal
    # that was replicated over some of them (captured arrays, sinks, all-gathered keys) gets
    # the sum of the per-shard gradients (match_vma), as in the chunked path.
    dq = match_vma(dq.astype(q.dtype), q)
    dk = match_vma(dk.astype(k.dtype), k)
    dv = match_vma(dv.astype(v.dtype), v)
    zeros = lambda tree: jax.tree_util.tree_map(zero_cotangent, tree)
    dsmod = None
    if smod is not None:
        grads = _mod_const_grads(cfg, q, k, v, ints, smod, mmod, lse_b, dout.astype(v.dtype),
                                 delta, kv_len, tabs)
        cts_c = [zero_cotangent(jnp.asarray(c)) if gr is None else match_vma(gr.astype(
            jnp.result_type(c)), c) for c, gr in zip(smod.consts, grads)]
        dsmod = smod.with_consts(cts_c)
    dsinks = None
    if sinks is not None:
        # lse_b, delta: [B, N, Tq_p, 1]; a row with no visible key and a sink of -inf
        # weighs 0
        dsinks = match_vma(sink_gradient(sinks, lse_b, delta, 1).astype(sinks.dtype), sinks)
    return (dq, dk, dv, zeros(ints), zeros(sched), dsmod,
            None if mmod is None else zeros(mmod), dsinks,
            None if kv_len is None else zeros(kv_len), None if tabs is None else zeros(tabs))


_core.defvjp(_core_fwd, _core_bwd)


# --------------------------------------------------------------------------- the call
def _check_block(name, blk):
    blk = _checks.check_positive_int(name, blk)
    if blk & (blk - 1):
        raise ValueError(f"{name} must be a power of two (Triton tiles; TPU needs block_q a "
                         f"multiple of 8 and block_k a multiple of 128); got {blk}.")
    return blk


def resolve_mode(interpret):
    """``interpret`` (True / False / None) as the kernel's mode string."""
    if interpret is None:
        return "auto"
    if not isinstance(interpret, bool):
        raise TypeError(f"interpret must be True, False or None; got {interpret!r}.")
    return "interpret" if interpret else "compiled"


def _prepare(q, k, v, *, q_positions, kv_positions, score_mod=None, mask_mod=None,
             block_mask=None, sinks=None, causal=False, segment_ids=None, kv_segment_ids=None,
             scale=None, block_q=None, block_k=None, mode="auto", count_tiles=False,
             kv_lengths=None, rope_tables=None, kv_splits=None, dropout=None):
    """Validate and classify: ``(cfg, q, k, v, ints, sched, smod, mmod, sinks, kv_len,
    tabs)``; q, k, v keep the caller's ``[B, T, N, H]`` layout (no copies); positions,
    segments and tables (``O(T)``) are padded to whole tiles."""
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    B, Tq, N, H = q.shape
    _, Tk, Nk, _ = k.shape
    Hv = v.shape[3]
    g = N // Nk
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask must be a jaxpos.mods.BlockMask (create_block_mask); "
                            f"got {type(block_mask).__name__}.")
        block_mask.check(B, N, Tq, Tk, block_q, block_k)
        bq = _check_block("block_mask.block_q", block_mask.block_q)
        bk = _check_block("block_mask.block_k", block_mask.block_k)
        if mask_mod is None:
            mask_mod = block_mask.mask_mod
    else:
        bq = _check_block("block_q", DEFAULT_BLOCK_Q if block_q is None else block_q)
        bk = _check_block("block_k", DEFAULT_BLOCK_K if block_k is None else block_k)
        bq = min(bq, pow2_at_least(Tq, 8))
        bk = min(bk, pow2_at_least(Tk, 8))
    nq, nk = max(1, -(-Tq // bq)), max(1, -(-Tk // bk))
    Tq_p, Tk_p = nq * bq, nk * bk
    q_pos = _checks.positions_2d("q_positions", q_positions, B, Tq)
    kv_pos = _checks.positions_2d("kv_positions", kv_positions, B, Tk)
    if (segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("segment_ids and kv_segment_ids must be given together; got one.")
    if scale is None:
        scale = 1.0 / math.sqrt(H)
    smod = convert_mod(score_mod, "score", bq, bk) if score_mod is not None else None
    mmod = convert_mod(mask_mod, "mask", bq, bk) if mask_mod is not None else None
    if sinks is not None:
        _checks.check_rank("sinks", sinks, (1,), "[num_heads]")
        _checks.check_floating("sinks", sinks)
        if _checks.shape_of(sinks)[0] != N:
            raise ValueError(f"sinks must have shape [{N}] (one logit per query head); got "
                             f"{_checks.shape_of(sinks)}.")
        sinks = jnp.asarray(sinks, jnp.float32)
    kv_len = None if kv_lengths is None else _checks.check_kv_lengths(kv_lengths, B, Tk)
    tabs, half = None, 0
    if rope_tables is not None:
        tabs, half = check_rope_tables(rope_tables, B, Tq, Tk, H)
        tabs = (pad_axis(tabs[0], 1, Tq_p), pad_axis(tabs[1], 1, Tq_p),
                pad_axis(tabs[2], 1, Tk_p), pad_axis(tabs[3], 1, Tk_p))
    qp = pad_axis(q_pos, 1, Tq_p, mode="edge")
    kp = pad_axis(kv_pos, 1, Tk_p, mode="edge")
    ints = {"q_pos": qp[:, :, None], "kv_pos": kp[:, None, :]}
    if dropout is not None:
        if not isinstance(dropout, Dropout):
            raise TypeError(f"dropout must be a jaxpos.core.dropout.Dropout or None; got "
                            f"{type(dropout).__name__}.")
        ints["drop_seed"] = jnp.asarray(dropout.seed).astype(jnp.uint32).reshape(2)
    seg_q = seg_kv = None
    if segment_ids is not None:
        sq = _checks.positions_2d("segment_ids", segment_ids, B, Tq)
        skv = _checks.positions_2d("kv_segment_ids", kv_segment_ids, B, Tk)
        seg_q = jnp.broadcast_to(pad_axis(sq, 1, Tq_p), (B, Tq_p))
        seg_kv = jnp.broadcast_to(pad_axis(skv, 1, Tk_p), (B, Tk_p))
        ints["q_seg"] = seg_q[:, :, None]
        ints["kv_seg"] = seg_kv[:, None, :]
    kinds = sched_lib.structural_kinds(causal=bool(causal), q_pos=qp, kv_pos=kp, seg_q=seg_q,
                                       seg_kv=seg_kv, Tq=Tq, Tk=Tk, bq=bq, bk=bk, nq=nq, nk=nk,
                                       kv_len=kv_len)
    if block_mask is not None:
        kinds = sched_lib.combine(kinds, block_mask.kinds)
    elif mmod is not None:
        kinds = jnp.where(kinds == sched_lib.FULL, sched_lib.PARTIAL, kinds)
    sched_h = kinds.shape[1] > 1
    heads = g if (g > 1 and nq == 1 and not sched_h and bq * g <= GROUP_ROWS) else 1
    if kv_splits is None:
        splits = min(nk, max(1, SPLIT_PROGRAMS // (B * (N // heads)))) if nq == 1 else 1
    else:
        splits = min(nk, _checks.check_positive_int("kv_splits", kv_splits))
    splits = -(-nk // -(-nk // splits))  # no empty split
    sched = sched_lib.build(kinds, splits=splits)
    cfg = _Cfg(B=B, N=N, groups=g, Tq=Tq, Tk=Tk, H=H, Hv=Hv, bq=bq, bk=bk, nq=nq, nk=nk,
               scale=float(scale), causal=bool(causal), has_segments=segment_ids is not None,
               qpos_batched=qp.shape[0] > 1, kvpos_batched=kp.shape[0] > 1,
               sched_b=kinds.shape[0] > 1, sched_h=sched_h,
               has_sinks=sinks is not None, additive=is_additive(smod),
               precise=q.dtype == jnp.float32, mode=mode, heads=heads, splits=splits,
               has_kv_len=kv_len is not None, rope_half=half,
               rope_qb=tabs is not None and tabs[0].shape[0] > 1,
               rope_kb=tabs is not None and tabs[2].shape[0] > 1, count_tiles=count_tiles,
               dropout_rate=0.0 if dropout is None else float(dropout.rate),
               dropout_broadcast=dropout is not None and bool(dropout.broadcast))
    return cfg, q, k, v, ints, sched, smod, mmod, sinks, kv_len, tabs


def kernel_attention(q, k, v, *, score_mod=None, mask_mod=None, block_mask=None, sinks=None,
                     q_positions, kv_positions, causal=False, segment_ids=None,
                     kv_segment_ids=None, scale=None, block_q=None, block_k=None,
                     interpret=None, kv_lengths=None, rope_tables=None, kv_splits=None,
                     return_lse=False, dropout=None):
    """The fused kernel (see :func:`jaxpos.kernels.attention_via_kernel` for the contract
    of the shared arguments).

    Args (beyond the shared ones):
      kv_lengths: integer ``[B]`` or None: keys at index ``>= kv_lengths[b]`` are invisible
        to every query of row ``b`` and their tiles are never visited (a KV cache's fill
        counts: a decode step costs the filled length, not the cache's size).
      rope_tables: :class:`RopeTables` or None: q and k are unrotated and the kernel
        rotates them as they are loaded (``"half"`` layout), forward and backward.
      kv_splits: key splits of the forward (flash decoding), or None: split a call with a
        single query tile until about :data:`SPLIT_PROGRAMS` programs run.
      dropout: a :class:`jaxpos.core.dropout.Dropout` (rate, uint32 ``[2]`` seed, broadcast) or
        None: attention dropout (FlashAttention, Dao et al. 2022, Alg. 2): each tile's
        probabilities are multiplied by ``keep / (1 - rate)`` after the (undropped)
        normaliser is updated, the keep decisions computed in the tile from the seed and the
        tile's query / key indices (:func:`jaxpos.core.dropout.keep_tile`, the reference and
        chunked paths' mask, bit for bit; no ``[Tq, Tk]`` mask is stored); the backward
        kernels recompute them. Key splits are compatible (a split's tiles keep their
        global key indices).
      return_lse: also return the log-sum-exp of each query row's scores (the sinks
        included), float32 ``[B, N, Tq]``, ``-inf`` for a row with no visible key;
        differentiable.

    Returns:
      ``[B, Tq, N, H_v]`` in q's dtype, or ``(out, lse)`` with ``return_lse``.
    """
    cfg, q, k, v, ints, sched, smod, mmod, sinks, kv_len, tabs = _prepare(
        q, k, v, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask, sinks=sinks,
        q_positions=q_positions, kv_positions=kv_positions, causal=causal,
        segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, scale=scale, block_q=block_q,
        block_k=block_k, mode=resolve_mode(interpret), kv_lengths=kv_lengths,
        rope_tables=rope_tables, kv_splits=kv_splits, dropout=dropout)
    # (custom_vjp through functools.partial hides the return type from type checkers)
    out, lse = cast("tuple[jax.Array, jax.Array]",
                    _core(cfg, q, k, v, ints, sched, smod, mmod, sinks, kv_len, tabs))
    out = out.astype(q.dtype)
    if return_lse:
        return out, lse[:, :, :cfg.Tq, 0]
    return out


def tile_visits(q, k, v, **kw):
    """Test hook: how many key tiles each forward program and how many query tiles each
    dk/dv program visit, as ``(fwd [B, N / G, nq, 2] (or [B, N / G, nq, S, 2] with key
    splits), dkv [B, N_kv, nk, 2])`` (column 0: masked PARTIAL tiles, column 1: unmasked
    FULL tiles), counted inside the kernels' loops (interpret mode)."""
    cfg, q, k, v, ints, sched, smod, mmod, sinks, kv_len, tabs = _prepare(
        q, k, v, mode="interpret", count_tiles=True, **kw)
    out, lse, fwd = _forward(cfg, q, k, v, ints, sched, smod, mmod, sinks, kv_len, tabs)
    lse_b, delta = _backward_rows(cfg, out, lse, jnp.zeros_like(out), jnp.zeros_like(lse))
    *_, dkv = _backward_kernels(cfg, q, k, v, ints, sched, smod, mmod, kv_len, tabs, lse_b,
                                delta, jnp.zeros_like(out))
    assert fwd is not None and dkv is not None  # counted: count_tiles=True
    fwd = fwd[..., 0, :]
    return (fwd[:, :, :, 0] if cfg.splits == 1 else fwd), dkv[..., 0, :]
