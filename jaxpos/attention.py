"""One attention function for every position scheme, with interchangeable
implementations.

``"reference"`` materialises the ``[B, N, Tq, Tk]`` scores and bias: the ground truth.
``"chunked"`` is the memory-efficient online softmax over key blocks of Rabe & Staats
2021 ("Self-attention Does Not Need O(n^2) Memory") with the blockwise recomputing
backward of FlashAttention (Dao et al. 2022, Alg. 2): the scheme's bias is computed per
block from the position arrays, so no ``[Tq, Tk]`` array exists in the forward or the
backward pass, and causal blocks that are fully masked are skipped.
``"pallas"`` is the fused kernel in :mod:`jaxpos.kernels`.

All implementations ask a scheme the same questions (the protocol of
:mod:`jaxpos.scheme`): its per-token transform of q and k, applied once per call, and its
score term as a score_mod (:mod:`jaxpos.mods`), which the paths apply tile by tile with
the user's own ``score_mod`` and ``mask_mod``. Nothing here names a scheme.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpos import _checks
from jaxpos.mods import (
    EMPTY,
    FULL,
    BlockMask,
    ConvertedMod,
    apply_mod,
    compose_score_mods,
    convert_mod,
    varying_axes,
)
from jaxpos.scheme import PositionScheme, as_scheme

__all__ = ["ALL_IMPLEMENTATIONS", "IMPLEMENTATIONS", "attention", "default_implementation"]

#: The tiled implementations (every scheme, mask and feature; compared in the tests).
IMPLEMENTATIONS = ("reference", "chunked", "pallas")
#: Every value ``implementation=`` takes: the tiled ones and ``"xla"``, which hands the
#: transformed q and k to ``jax.nn.dot_product_attention`` (cuDNN on NVIDIA GPUs).
ALL_IMPLEMENTATIONS = IMPLEMENTATIONS + ("xla",)
_NEG_INF = -jnp.inf
# Chunked tile sizes: measured on a 2-core x86 CPU (benchmarks/attention_cpu.py), 256 x 256
# float32 tiles of 8 heads (2 MiB of scores) were as fast as any other choice forward and
# waste little work on the diagonal of a causal mask.
_BLOCK_Q = 256
_BLOCK_K = 256


def default_implementation(position: PositionScheme | None = None, *, score_mod=None,
                           mask_mod=None, q_len: int = 0, kv_len: int = 0, num_heads: int = 1,
                           batch: int = 1) -> str:
    """The implementation ``attention(implementation=None)`` runs, by the measured rule of
    :func:`jaxpos.kernels.choose_implementation` (``docs/kernel.md``): ``"chunked"`` on
    CPU and for schemes the kernel cannot fuse (Shaw); on an NVIDIA GPU ``"xla"``
    (``jax.nn.dot_product_attention``, cuDNN) when there is no score term, or while the
    dense bias of the score term fits the budget, else ``"pallas"``; ``"pallas"`` on TPU.

    Args:
      position: the scheme (its own score_mod counts as a score term).
      score_mod, mask_mod: the call's (``None`` if absent).
      q_len, kv_len, num_heads, batch: the call's shape (0 / 1 when unknown: the
        dense-bias budget is then not the deciding factor).

    Raises:
      TypeError: ``position`` is not a scheme, ``None`` or ``"none"`` (on every backend).
    """
    scheme = as_scheme(position)
    backend = jax.default_backend()
    if backend == "cpu":
        return "chunked"
    from jaxpos.kernels import choose_implementation

    has_score = score_mod is not None or scheme.score_mod() is not None
    return choose_implementation(backend=backend, fusable=scheme.fusable,
                                 has_score_mod=has_score, has_mask_mod=mask_mod is not None,
                                 Tq=q_len, Tk=kv_len, num_heads=num_heads, batch=batch)


class _Masking(NamedTuple):
    """Everything that decides visibility, in broadcastable form."""

    q_pos: jax.Array  # int32 [B|1, Tq]
    kv_pos: jax.Array  # int32 [B|1, Tk]
    kv_valid: jax.Array | None  # bool [B|1, Tk] (False for padding added by chunking)
    mask: jax.Array | None  # bool [B|1, N|1, Tq|1, Tk|1]
    seg_q: jax.Array | None  # int32 [B, Tq]
    seg_kv: jax.Array | None  # int32 [B, Tk]


class _Terms(NamedTuple):
    """What a tile adds to ``scale * q . k``: the scheme (for a content bias and a value
    term, Shaw's), the converted score_mod (the scheme's composed with the user's) and
    the converted mask_mod. A pytree: the mods' captured arrays are its leaves."""

    scheme: PositionScheme
    score: ConvertedMod | None
    mask: ConvertedMod | None


def _make_terms(scheme: PositionScheme, score_mod, mask_mod, tq: int, tk: int) -> _Terms:
    """The terms of a call, with the mods traced at a ``[tq, tk]`` tile."""
    conv = lambda fn, kind: None if fn is None else convert_mod(fn, kind, tq, tk)
    return _Terms(scheme, conv(score_mod, "score"), conv(mask_mod, "mask"))


def _visible(causal: bool, q_pos, kv_pos, kv_valid, mask, seg_q, seg_kv, mask_mod=None,
             heads=None):
    """bool ``[B|1, N|1, tq, tk]`` (or None when everything is visible).

    ``mask_mod``: a converted mask_mod evaluated on the tile for ``heads = (B, N)``."""
    vis = None

    def conj(a, b):
        return b if a is None else a & b

    if causal:
        vis = conj(vis, (kv_pos[:, None, :] <= q_pos[:, :, None])[:, None])
    if kv_valid is not None:
        vis = conj(vis, kv_valid[:, None, None, :])
    if seg_q is not None:
        vis = conj(vis, (seg_q[:, :, None] == seg_kv[:, None, :])[:, None])
    if mask is not None:
        vis = conj(vis, mask)
    if mask_mod is not None:
        vis = conj(vis, apply_mod(mask_mod, q_pos, kv_pos, batch_index=heads))
    return vis


def _scores(terms: _Terms, qs, k, q_pos, kv_pos):
    """Scaled scores, then the score_mod, then the scheme's content bias: float32
    ``[B, N, tq, tk]``. ``qs``: scaled queries ``[B, N, tq, H]``; ``k``: ``[B, N, tk, H]``
    (float32); positions int32 ``[B|1, t]``.
    """
    s = jnp.einsum("bnqh,bnkh->bnqk", qs, k, preferred_element_type=jnp.float32)
    if terms.score is not None:
        s = apply_mod(terms.score, q_pos, kv_pos, score=s)
    b = terms.scheme.content_bias(qs, q_pos, kv_pos)
    if b is not None:
        s = s + b
    return s


def _output(terms: _Terms, p, v, q_pos, kv_pos):
    """``p @ v`` plus the scheme's value term: float32 ``[B, N, tq, H]``."""
    o = jnp.einsum("bnqk,bnkh->bnqh", p, v, preferred_element_type=jnp.float32)
    t = terms.scheme.value_term(p, q_pos, kv_pos)
    if t is not None:
        o = o + t
    return o


def _sink_column(sinks, s):
    """The per-head sink logit as one more score column ``[B, N, tq, 1]`` (float32)."""
    col = jnp.asarray(sinks, jnp.float32)[None, :, None, None]
    return jnp.broadcast_to(col, s.shape[:3] + (1,))


# --------------------------------------------------------------------------- reference
def _reference(terms: _Terms, qs, k, v, m: _Masking, causal: bool, sinks):
    s = _scores(terms, qs, k, m.q_pos, m.kv_pos)
    vis = _visible(causal, m.q_pos, m.kv_pos, m.kv_valid, m.mask, m.seg_q, m.seg_kv,
                   terms.mask, s.shape[:2])
    # A score_mod may hide a pair with -inf: such a pair is hidden like a masked one (a row
    # hidden everywhere gives zeros, as in the tiled implementations, not 0/0).
    vis = s != -jnp.inf if vis is None else vis & (s != -jnp.inf)
    if vis is not None:
        vis = jnp.broadcast_to(vis, s.shape)
        # A finite fill keeps fully masked rows NaN-free in both passes; they are zeroed.
        s = jnp.where(vis, s, jnp.finfo(jnp.float32).min)
    if sinks is not None:  # the sink takes part in the normalisation only
        p = jax.nn.softmax(jnp.concatenate([s, _sink_column(sinks, s)], axis=-1), axis=-1)
        p = p[..., :-1]
    else:
        p = jax.nn.softmax(s, axis=-1)
    if vis is not None:
        p = jnp.where(vis, p, 0.0)
    return _output(terms, p, v, m.q_pos, m.kv_pos)


# ----------------------------------------------------------------------------- chunked
# Tile kinds, decided per (query block, key block) at run time from the position,
# padding and segment arrays and the block mask: a tile is skipped when nothing in it is
# visible, computed without any masking when everything is, and masked otherwise.
_SKIP, _FULL, _MASKED = 0, 1, 2


def _pad_to(x, axis, size, value=0, mode="constant"):
    """Pad ``axis`` of ``x`` at the end to ``size`` (with ``value``, or ``mode="edge"``)."""
    pad = size - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    if mode == "constant":
        return jnp.pad(x, widths, constant_values=value)
    return jnp.pad(x, widths, mode=mode)


def _blocks(x, axis, n):
    """Split ``axis`` into ``n`` blocks and move the block index to the front."""
    if x is None:
        return None
    if x.shape[axis] == 1:  # broadcast dimension: every block sees the same slice
        return jnp.broadcast_to(x[None], (n,) + x.shape)
    shp = x.shape[:axis] + (n, x.shape[axis] // n) + x.shape[axis + 1:]
    return jnp.moveaxis(x.reshape(shp), axis, 0)


def _unblocks(x, axis):
    """Inverse of :func:`_blocks` for a full (not broadcast) axis."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])


def _tile_kind(causal: bool, always_mask: bool, qp, kp, kval, sq, skv, bm_kind):
    """int32 scalar: ``_SKIP``, ``_FULL`` or ``_MASKED`` for one tile.

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
    return jnp.where(live, jnp.where(full, _FULL, _MASKED), _SKIP).astype(jnp.int32)


class _Cfg(NamedTuple):
    causal: bool
    nq: int
    nk: int
    block_q: int
    block_k: int
    float_mask: tuple  # which leaves of the terms are floating (differentiable)
    terms_def: object  # treedef of the terms


def _split_terms(terms: _Terms):
    """Floating leaves (differentiable) and the rest (integer tables of a mod, ...)."""
    leaves, treedef = jax.tree_util.tree_flatten(terms)
    is_f = tuple(bool(jnp.issubdtype(jnp.result_type(x), jnp.inexact)) for x in leaves)
    return ([x for x, f in zip(leaves, is_f) if f], [x for x, f in zip(leaves, is_f) if not f],
            is_f, treedef)


def _merge_terms(cfg: _Cfg, fl, il) -> _Terms:
    fl, il = iter(fl), iter(il)
    leaves = [next(fl) if f else next(il) for f in cfg.float_mask]
    return jax.tree_util.tree_unflatten(cfg.terms_def, leaves)


def _chunk_inputs(qs, k, v, m: _Masking, block_q: int, block_k: int):
    _B, _N, Tq, _H = qs.shape
    Tk = k.shape[2]
    nq, nk = -(-Tq // block_q), -(-Tk // block_k)
    Tq_p, Tk_p = nq * block_q, nk * block_k
    kv_valid = m.kv_valid if m.kv_valid is not None else jnp.ones((1, Tk), bool)
    mask = m.mask
    if mask is not None:
        mask = mask if mask.shape[2] == 1 else _pad_to(mask, 2, Tq_p, False)
        mask = mask if mask.shape[3] == 1 else _pad_to(mask, 3, Tk_p, False)
    blocked = {
        "qs": _blocks(_pad_to(qs, 2, Tq_p), 2, nq),
        "k": _blocks(_pad_to(k, 2, Tk_p), 2, nk),
        "v": _blocks(_pad_to(v, 2, Tk_p), 2, nk),
        "q_pos": _blocks(_pad_to(m.q_pos, 1, Tq_p), 1, nq),
        "kv_pos": _blocks(_pad_to(m.kv_pos, 1, Tk_p), 1, nk),
        "kv_valid": _blocks(_pad_to(kv_valid, 1, Tk_p, False), 1, nk),
        "seg_q": _blocks(_pad_to(m.seg_q, 1, Tq_p), 1, nq) if m.seg_q is not None else None,
        "seg_kv": _blocks(_pad_to(m.seg_kv, 1, Tk_p, -1), 1, nk) if m.seg_kv is not None else None,
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


def _tile(terms: _Terms, qs_i, k_j, qp_i, kp_j, vis):
    """Scores of one tile, ``-inf`` where ``vis`` is False. Differentiable in qs, k, terms."""
    s = _scores(terms, qs_i, k_j, qp_i, kp_j)
    return s if vis is None else jnp.where(vis, s, _NEG_INF)


def _tile_visibility(cfg: _Cfg, terms: _Terms, b, i, j, qp_i, kp_j, kval_j, sq_i, skv_j,
                     masked: bool):
    if not masked:
        return None
    heads = b["qs"].shape[1:3]
    return _visible(cfg.causal, qp_i, kp_j, kval_j,
                    _mask_block(b["mask"], i, j, cfg.block_q, cfg.block_k), sq_i, skv_j,
                    terms.mask, heads)


def _block_kind(b, i, j):
    bm = b.get("bm_kinds")
    return None if bm is None else bm[:, :, i, j]


def _varying_zero(*trees):
    """A float32 scalar 0 that varies over every mesh axis any leaf of ``trees`` varies
    over under ``shard_map`` (``jnp.zeros_like`` carries the leaf's axes). Added to loop
    carries and skipped-tile outputs, it gives them the type of the computed values, as
    ``shard_map``'s default ``check_vma`` requires; elsewhere it is a constant 0."""
    z = jnp.zeros((), jnp.float32)
    for x in jax.tree_util.tree_leaves(trees):
        z = z + jnp.zeros_like(x, jnp.float32, shape=())
    return z


def _always_mask(b, terms: _Terms) -> bool:
    return b["mask"] is not None or (terms.mask is not None and b.get("bm_kinds") is None)


def _chunked_forward(terms: _Terms, sinks, b, cfg: _Cfg):
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
                l = l * corr + jnp.sum(p, axis=-1)
                acc = acc * corr[..., None] + _output(terms, p, v_j, qp_i, kp_j)
                return m_new, l, acc

            kind = _tile_kind(cfg.causal, always, qp_i, kp_j, kval_j, sq_i, skv_j,
                              _block_kind(b, i, j))
            branches = (lambda c: c, functools.partial(compute, masked=False),
                        functools.partial(compute, masked=True))
            return jax.lax.switch(kind, branches, carry), None

        z = _varying_zero(b, terms, sinks, qs_i, qp_i, sq_i)
        if sinks is None:
            m0 = jnp.full((B, N, cfg.block_q), _NEG_INF, jnp.float32)
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
        lse = jnp.where(nonempty, mx + jnp.log(jnp.where(nonempty, l, 1.0)), _NEG_INF)
        return out, lse

    return jax.lax.map(q_block, (jnp.arange(cfg.nq), b["qs"], b["q_pos"], b["seg_q"]))


def _chunked_backward(cfg: _Cfg, fl, il, b, out, lse, dout):
    """FlashAttention-2 style recomputing backward (Dao 2023, Alg. 2), tile by tile.

    Returns ``dq, dk, dv`` (blocked) and the gradients of the floating leaves ``fl`` of
    the terms."""
    terms0 = _merge_terms(cfg, fl, il)
    always = _always_mask(b, terms0)
    delta = jnp.sum(dout * out, axis=-1)  # [nq, B, N, bq]
    z = _varying_zero(b, fl, lse, dout)
    # Under shard_map, differentiate w.r.t. copies that vary over every axis, so the tile
    # VJPs below never psum inside the (per-device) skip/compute switch; the one sum over
    # the axes a primal does not vary over happens in _chunked_core_bwd (_match_vma).
    vary = lambda x: x + z.astype(x.dtype)
    fl = [vary(x) for x in fl]
    b = dict(b, qs=vary(b["qs"]), k=vary(b["k"]), v=vary(b["v"]))
    dk0 = jnp.zeros(b["k"].shape, jnp.float32) + z
    dv0 = jnp.zeros(b["v"].shape, jnp.float32) + z
    dfl0 = [jnp.zeros(jnp.shape(x), jnp.float32) + z for x in fl]
    terms = _merge_terms(cfg, fl, il)

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
                tile = lambda qs_, k_, fl_: _tile(_merge_terms(cfg, fl_, il), qs_, k_, qp_i,
                                                   kp_j, vis)
                s, tile_vjp = jax.vjp(tile, qs_i, k_j, fl)
                p = jnp.exp(s - lse_safe[..., None])  # 0 where hidden (s = -inf)
                outf = lambda p_, v_, fl_: _output(_merge_terms(cfg, fl_, il), p_, v_, qp_i, kp_j)
                _, out_vjp = jax.vjp(outf, p, v_j, fl)
                dp, dv_j, dfl_v = out_vjp(do_i)
                ds = p * (dp - dl_i[..., None])
                dq_t, dk_j, dfl_s = tile_vjp(ds)
                dfl = [a + x + y for a, x, y in zip(dfl, dfl_v, dfl_s)]
                return (dq_i + dq_t, dfl), (dk_j, dv_j)

            def skip(carry):
                return carry, (jnp.zeros(k_j.shape, jnp.float32) + z,
                               jnp.zeros(v_j.shape, jnp.float32) + z)

            kind = _tile_kind(cfg.causal, always, qp_i, kp_j, kval_j, sq_i, skv_j,
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
    out, _ = _chunked_forward(_merge_terms(cfg, fl, il), sinks, _assemble(qs, k, v, ints), cfg)
    return out


def _chunked_core_fwd(cfg, fl, il, sinks, qs, k, v, ints):
    out, lse = _chunked_forward(_merge_terms(cfg, fl, il), sinks, _assemble(qs, k, v, ints), cfg)
    return out, (fl, il, sinks, qs, k, v, ints, out, lse)


def _match_vma(g, x):
    """Under ``shard_map``, sum the cotangent ``g`` over the mesh axes it varies over but
    its primal ``x`` does not: the gradient of a replicated input (a scheme table, or keys
    all-gathered for sequence parallelism) is the sum of the per-shard gradients."""
    extra = tuple(sorted(varying_axes(g) - varying_axes(x)))
    return jax.lax.psum(g, extra) if extra else g


def _zero_cotangent(x):
    """The zero cotangent of a non-differentiable input (float0 for integers and bools)."""
    if x is None:
        return None
    if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
        return jnp.zeros(jnp.shape(x), jnp.result_type(x))
    return np.zeros(jnp.shape(x), jax.dtypes.float0)


def sink_gradient(sinks, lse, delta, head_axis: int):
    """``d sink_h = -sum exp(sink_h - lse) * delta``, summed over every axis but
    ``head_axis`` of ``lse`` and ``delta`` (``rowsum(dout * out)``): the sink's softmax
    weight times ``delta`` is the whole gradient of a logit that carries no value vector.
    ``lse`` includes the sink. Returns float32 ``[N]``."""
    flat = lambda x: jnp.moveaxis(x, head_axis, 0).reshape(x.shape[head_axis], -1)
    w = jnp.exp(sinks.astype(jnp.float32)[:, None] - flat(lse))
    return -jnp.sum(jnp.where(jnp.isfinite(w), w, 0.0) * flat(delta), axis=1)


def _chunked_core_bwd(cfg, res, dout):
    fl, il, sinks, qs, k, v, ints, out, lse = res
    dq, dk, dv, dfl = _chunked_backward(cfg, fl, il, _assemble(qs, k, v, ints), out, lse, dout)
    dfl = [_match_vma(g.astype(jnp.result_type(x)), x) for g, x in zip(dfl, fl)]
    dq, dk, dv = _match_vma(dq, qs), _match_vma(dk, k), _match_vma(dv, v)
    dsinks = None
    if sinks is not None:  # lse/out: [nq, B, N, bq(, H)]; padded rows have dout = 0
        delta = jnp.sum(dout * out, axis=-1)
        dsinks = _match_vma(sink_gradient(sinks, lse, delta, 2).astype(sinks.dtype), sinks)
    dil = [_zero_cotangent(x) for x in il]
    dints = jax.tree_util.tree_map(_zero_cotangent, ints)
    return dfl, dil, dsinks, dq, dk, dv, dints


_chunked_core.defvjp(_chunked_core_fwd, _chunked_core_bwd)


def _chunked(terms_fn, qs, k, v, m: _Masking, causal: bool, block_q: int, block_k: int, sinks,
             block_mask: BlockMask | None):
    _B, _N, Tq, _H = qs.shape
    if block_mask is None:
        block_q = min(block_q, Tq)
        block_k = min(block_k, k.shape[2])
    terms = terms_fn(block_q, block_k)
    b, nq, nk = _chunk_inputs(qs, k, v, m, block_q, block_k)
    ints = {n: b[n] for n in ("q_pos", "kv_pos", "kv_valid", "seg_q", "seg_kv", "mask")}
    if block_mask is not None:
        ints["bm_kinds"] = block_mask.kinds
    fl, il, is_f, treedef = _split_terms(terms)
    cfg = _Cfg(causal, nq, nk, block_q, block_k, is_f, treedef)
    if sinks is not None:
        sinks = jnp.asarray(sinks)
    out = _chunked_core(cfg, fl, il, sinks, b["qs"], b["k"], b["v"], ints)
    return _unblocks(out, 2)[:, :, :Tq]


# ---------------------------------------------------------------------------- dispatch
def _check_inputs(q, k, v):
    for name, x in (("q", q), ("k", k), ("v", v)):
        _checks.check_rank(name, x, (4,), "[batch, seq, heads, head_dim]")
        _checks.check_floating(name, x)
    (B, Tq, N, H), (Bk, Tk, Nk, Hk), vs = q.shape, k.shape, v.shape
    if Bk != B or vs[0] != B:
        raise ValueError(f"q, k and v must share the batch size; got q {q.shape}, k {k.shape}, "
                         f"v {v.shape}.")
    if Hk != H:
        raise ValueError(f"k must have q's head_dim {H}; got k {k.shape}.")
    if vs[1] != Tk or vs[2] != Nk:
        raise ValueError(f"v must match k in sequence length and heads [B, {Tk}, {Nk}, H_v]; "
                         f"got v {v.shape}.")
    if N % Nk:
        raise ValueError(f"query heads ({N}) must be a multiple of key/value heads ({Nk}) "
                         f"for grouped-query attention; got q {q.shape}, k {k.shape}.")
    return B, Tq, Tk, N, Nk, H


def _normalize_mask(mask, B, N, Tq, Tk):
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise TypeError(f"mask must be boolean (True = may attend); got dtype {mask.dtype}.")
    if mask.ndim > 4:
        raise ValueError(f"mask must be broadcastable to [B, N, Tq, Tk] = {[B, N, Tq, Tk]}; "
                         f"got shape {mask.shape}.")
    given = mask.shape
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    for got, want in zip(mask.shape, (B, N, Tq, Tk)):
        if got not in (1, want):
            raise ValueError(f"mask must be broadcastable to [B, N, Tq, Tk] = {[B, N, Tq, Tk]}; "
                             f"got shape {given}.")
    return mask


def _segments(name, seg, B, T):
    if seg is None:
        return None
    _checks.check_integer_positions(name, seg)
    if _checks.shape_of(seg) != (B, T):
        raise ValueError(f"{name} must have shape [B, T] = [{B}, {T}]; got {_checks.shape_of(seg)}.")
    return jnp.asarray(seg, jnp.int32)


def default_positions(B: int, Tq: int, Tk: int):
    """``arange`` positions, queries aligned to the end of the keys (the decode convention):
    ``q_positions = arange(Tq) + (Tk - Tq)`` when ``Tk >= Tq``."""
    kv = jnp.arange(Tk, dtype=jnp.int32)
    q = jnp.arange(Tq, dtype=jnp.int32) + max(Tk - Tq, 0)
    return q, kv


def _layout_hint(q, *, heads=None, seq=None) -> str:
    """A sentence naming the likely ``[B, N, T, H]`` / ``[B, T, N, H]`` swap when axis 1 of
    ``q`` would fit what axis 2 failed (``heads``) or the other way (``seq``); else ''."""
    if q.ndim != 4:
        return ""
    if (heads is not None and q.shape[1] == heads and q.shape[2] != heads) or (
            seq is not None and q.shape[2] == seq and q.shape[1] != seq):
        return (f" q has shape {tuple(q.shape)}: jaxpos expects [B, T, N, H] (batch, sequence, "
                f"heads, head_dim); it looks like [B, N, T, H]. Swap axes 1 and 2 "
                f"(jnp.swapaxes(x, 1, 2)) for q, k and v.")
    return ""


def _nonfinite_values_to_keys(k, v):
    """Move a non-finite value row onto its key: ``v`` row set to 0 and the key row to NaN.

    A NaN (or inf) value of key ``j`` must make NaN exactly the outputs of the queries that
    see ``j``, as the scores' NaN do; left in ``v`` it would reach every query through
    ``0 * NaN`` in ``p @ v``, hidden pairs included. On its key it makes the scores of the
    visible pairs NaN, and hidden pairs are replaced before the softmax. ``O(T * H)``.
    """
    bad = ~jnp.all(jnp.isfinite(v), axis=-1, keepdims=True)  # [B, Tk, N_kv, 1]
    if bad.shape[-2] != k.shape[-2]:
        return k, v
    return jnp.where(bad, jnp.nan, k).astype(k.dtype), jnp.where(bad, 0, v).astype(v.dtype)


def _check_sinks(sinks, N):
    if sinks is None:
        return None
    _checks.check_floating("sinks", sinks)
    if _checks.shape_of(sinks) != (N,):
        raise ValueError(f"sinks must have shape [num_heads] = [{N}] (one logit per query "
                         f"head); got shape {_checks.shape_of(sinks)}.")
    return jnp.asarray(sinks)


def _check_causal(causal) -> bool:
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(
            f"causal must be a Python bool (it selects the computation, so it is static: under "
            f"jax.jit pass static_argnames=('causal',)); got {type(causal).__name__}.")
    return bool(causal)


def _check_scheme(position, q, v, causal: bool) -> PositionScheme:
    """The call's scheme, checked against q's heads (with a layout hint), ``causal`` and
    v's width (a value term adds vectors of q's head_dim)."""
    scheme = as_scheme(position)
    N, H = q.shape[2], q.shape[3]
    try:
        scheme.check(N, H)
    except ValueError as e:
        hint = ""
        try:
            scheme.check(q.shape[1], H)
            hint = _layout_hint(q, heads=q.shape[1])
        except ValueError:
            pass
        if hint:
            raise ValueError(f"{e}{hint}") from None
        raise
    scheme.check_causal(causal)
    if scheme.has_value_term and v.shape[-1] != H:
        raise ValueError(f"v must have head_dim {H}: {type(scheme).__name__}'s value term adds "
                         f"vectors of width {H} to the output; got v {v.shape}.")
    return scheme


def _segment_pair(segment_ids, kv_segment_ids, B, Tq, Tk):
    """int32 ``[B, Tq]``, ``[B, Tk]`` segment ids (or None, None); ``kv_segment_ids``
    defaults to ``segment_ids`` when the lengths agree."""
    if kv_segment_ids is None and segment_ids is not None:
        if Tq != Tk:
            raise ValueError(f"kv_segment_ids is required when Tq != Tk ({Tq} vs {Tk}).")
        kv_segment_ids = segment_ids
    if (segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("segment_ids and kv_segment_ids must be given together; got only "
                         + ("segment_ids." if kv_segment_ids is None else "kv_segment_ids."))
    return (_segments("segment_ids", segment_ids, B, Tq),
            _segments("kv_segment_ids", kv_segment_ids, B, Tk))


def _check_blocks(block_q, block_k) -> None:
    for name, blk in (("block_q", block_q), ("block_k", block_k)):
        if blk is not None:
            _checks.check_positive_int(name, blk)


def _check_scale(scale, H):
    """``scale`` (default ``1/sqrt(H)``): a real scalar."""
    if scale is None:
        return 1.0 / math.sqrt(H)
    if isinstance(scale, (str, bytes)) or (
            hasattr(scale, "dtype") and not jnp.issubdtype(scale.dtype, jnp.number)):
        raise TypeError(f"scale must be a real number (default 1/sqrt(head_dim)); got "
                        f"{type(scale).__name__} {scale!r}.")
    if np.ndim(scale) != 0:
        raise ValueError(f"scale must be a scalar (one factor for every score); got shape "
                         f"{np.shape(scale)}.")
    return scale


def _check_mods(scheme: PositionScheme, score_mod, mask_mod):
    """The scheme's score_mod composed with the user's; both mods traced once at a small
    tile, so a bad return shape or dtype is reported at the call whatever the
    implementation."""
    all_score_mods = compose_score_mods(scheme.score_mod(), score_mod)
    for fn, kind in ((all_score_mods, "score"), (mask_mod, "mask")):
        if fn is not None:
            convert_mod(fn, kind, 2, 3)
    return all_score_mods


def attention(
    q,
    k,
    v,
    *,
    position=None,
    score_mod=None,
    mask_mod=None,
    block_mask: BlockMask | None = None,
    sinks=None,
    q_positions=None,
    kv_positions=None,
    causal: bool = False,
    mask=None,
    segment_ids=None,
    kv_segment_ids=None,
    scale=None,
    implementation: str | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
):
    """Multi-head attention with any position scheme, score_mod and mask_mod.

    ``softmax(score_mod(scale * q k^T) + bias) v`` per head, where the scheme transforms q
    and k per token (RoPE), contributes a score_mod from positions (ALiBi, T5, KERPLE,
    ...; added after scaling, as ``jax.nn.dot_product_attention`` and BLOOM do), and may
    add a content bias and a value term (Shaw). The user's ``score_mod`` runs after the
    scheme's, the ``mask_mod`` and the other masks decide which pairs are visible.

    Args:
      q: ``[B, Tq, N, H]``; k: ``[B, Tk, N_kv, H]``; v: ``[B, Tk, N_kv, H_v]`` (float).
        ``N`` must be a multiple of ``N_kv`` (grouped-query / multi-query attention).
      position: a scheme (:class:`NoPE`, :class:`RoPE`, :class:`ALiBi`,
        :class:`T5Bias`, :class:`Shaw`, ... see ``jaxpos.scheme.REGISTRY``) or
        ``None``/``"none"``.
      score_mod: ``(score, batch, head, q_pos, kv_pos) -> score`` on float32 tiles, with
        global int32 positions ``q_pos [tq, 1]``, ``kv_pos [1, tk]`` and the query head
        (see :mod:`jaxpos.mods`); may capture arrays, which receive gradients.
      mask_mod: ``(batch, head, q_pos, kv_pos) -> bool``; True means "may attend".
      block_mask: a :class:`jaxpos.BlockMask` from :func:`jaxpos.create_block_mask` for
        these positions: empty tiles are skipped, full ones need no masking. Its
        ``mask_mod`` is used (``mask_mod`` may be omitted or must be the same function);
        its tile sizes are used by the chunked and Pallas paths.
      sinks: float ``[N]``, a learned logit per query head in the softmax denominator
        (attention sinks, as in GPT-OSS): weights ``exp(s_ij) / (exp(sink_h) + sum_j
        exp(s_ij))``. Differentiable.
      q_positions, kv_positions: integer ``[T]`` or ``[B, T]``. Default ``arange``, with
        queries aligned to the end of the keys when ``Tq < Tk`` (decoding). KV-cache
        offsets, left padding and packed sequences are all position arrays.
      causal: a query at position ``p`` sees keys at positions ``<= p``.
      mask: boolean, broadcastable to ``[B, N, Tq, Tk]``; True means "may attend".
      segment_ids, kv_segment_ids: integer ``[B, Tq]`` / ``[B, Tk]``; only equal ids
        attend (packed sequences). ``kv_segment_ids`` defaults to ``segment_ids``.
      scale: score scale, default ``1 / sqrt(H)``. T5 uses ``scale=1.0``.
      implementation: ``"reference"``, ``"chunked"``, ``"pallas"``, ``"xla"``
        (``jax.nn.dot_product_attention`` on the transformed q and k, with the score term
        materialised as a dense bias: cuDNN on NVIDIA GPUs), or ``None`` for
        :func:`default_implementation`.
      block_q, block_k: tile sizes for ``"chunked"`` (default 256 x 256; any positive size)
        and ``"pallas"`` (the kernel's 128 x 128 defaults; powers of two). T need not be a
        multiple.

    Returns:
      ``[B, Tq, N, H_v]`` in q's dtype (softmax and accumulation in float32). A query with
      no visible key returns zeros, with zero gradients.

    Raises:
      ValueError / TypeError: bad ranks, mismatched shapes (naming a likely
      ``[B, N, T, H]`` layout), float positions, a scheme that does not fit the heads or
      contradicts ``causal``, unknown implementation, bad masks, a score_mod returning
      the wrong shape or dtype, a mask_mod not returning bool, a block mask built for
      other lengths or blocks, sinks of the wrong shape.
    """
    B, Tq, Tk, N, Nk, H = _check_inputs(q, k, v)
    causal = _check_causal(causal)
    scheme = _check_scheme(position, q, v, causal)
    explicit = implementation is not None
    _checks.check_choice("implementation", implementation, ALL_IMPLEMENTATIONS + (None,))
    dq_pos, dkv_pos = default_positions(B, Tq, Tk)
    try:
        q_pos = _checks.positions_2d("q_positions", dq_pos if q_positions is None else q_positions,
                                     B, Tq)
        kv_pos = _checks.positions_2d("kv_positions",
                                      dkv_pos if kv_positions is None else kv_positions, B, Tk)
    except ValueError as e:
        given = q_positions if q_positions is not None else kv_positions
        shp = _checks.shape_of(given) if given is not None else ()
        hint = _layout_hint(q, seq=shp[-1]) if shp else ""
        raise ValueError(f"{e}{hint}") from None
    seg_q, seg_kv = _segment_pair(segment_ids, kv_segment_ids, B, Tq, Tk)
    mask4 = _normalize_mask(mask, B, N, Tq, Tk)
    _check_blocks(block_q, block_k)
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask must be a jaxpos.BlockMask (from "
                            f"jaxpos.create_block_mask); got {type(block_mask).__name__}.")
        block_mask.check(B, N, Tq, Tk, block_q, block_k, q_positions=q_pos, kv_positions=kv_pos)
        if mask_mod is not None and mask_mod is not block_mask.mask_mod:
            raise ValueError("mask_mod differs from block_mask.mask_mod; pass one of them (the "
                             "block mask carries its mask_mod).")
        mask_mod = block_mask.mask_mod
        block_q, block_k = block_mask.block_q, block_mask.block_k
    sinks = _check_sinks(sinks, N)
    scale = _check_scale(scale, H)
    all_score_mods = _check_mods(scheme, score_mod, mask_mod)
    if not explicit:
        implementation = default_implementation(scheme, score_mod=all_score_mods,
                                                mask_mod=mask_mod, q_len=Tq, kv_len=Tk,
                                                num_heads=N, batch=B)
        cannot = mask4 is not None or not (q.dtype == k.dtype == v.dtype) or not \
            _checks.is_concrete(scale) or (implementation == "xla" and v.shape[-1] != H)
        if implementation in ("xla", "pallas") and cannot:
            implementation = "chunked"  # what the kernel / dot_product_attention cannot take
    if implementation in ("xla", "pallas") and not _checks.is_concrete(scale):
        raise TypeError(f"implementation={implementation!r} needs a static scale (a Python or "
                        f"concrete number: it is compiled into the kernel); got a traced "
                        f"scale. Use implementation='chunked' or 'reference' to differentiate "
                        f"or trace the scale.")
    if B == 0 or Tq == 0 or Tk == 0:  # nothing to attend from, or no visible key: zeros
        return jnp.zeros((B, Tq, N, v.shape[-1]), q.dtype)

    q, k = scheme.transform_qk(q, k, q_pos, kv_pos)
    if not explicit and implementation == "xla" and q.shape[-1] != v.shape[-1]:
        implementation = "pallas"  # a transform that widens q and k (PoPE); cuDNN cannot
    k, v = _nonfinite_values_to_keys(k, v)
    if implementation in ("pallas", "xla") and not scheme.fusable:
        what = "the fused Pallas kernel" if implementation == "pallas" else \
            "implementation='xla' (jax.nn.dot_product_attention)"
        raise ValueError(
            f"{what} does not support the position scheme {type(scheme).__name__} (its "
            f"content bias or value term depends on the query content or the weights); use "
            f"implementation='chunked' or 'reference'.")
    if implementation == "xla":
        if mask4 is not None:
            raise ValueError(
                "implementation='xla' (jax.nn.dot_product_attention) does not take a boolean "
                "mask array; express the mask as a mask_mod, or use implementation='chunked'.")
        if v.shape[-1] != H:
            raise ValueError(
                f"implementation='xla' (jax.nn.dot_product_attention) needs v's head_dim to "
                f"equal q's ({H}); got v {v.shape}. Use implementation='chunked'.")
        from jaxpos.xla import attention_via_xla

        return attention_via_xla(q, k, v, score_mod=all_score_mods, mask_mod=mask_mod,
                                 q_positions=q_pos, kv_positions=kv_pos, causal=causal,
                                 segment_ids=seg_q, kv_segment_ids=seg_kv, scale=scale,
                                 sinks=sinks)
    if implementation == "pallas":
        if mask4 is not None:
            raise ValueError(
                f"implementation='pallas' does not take a boolean mask array (got shape "
                f"{tuple(mask4.shape)}): express it as a mask_mod from positions (with "
                f"jaxpos.create_block_mask to skip empty tiles), with causal=, positions or "
                f"segment_ids, or use implementation='chunked'.")
        from jaxpos.kernels import attention_via_kernel

        return attention_via_kernel(q, k, v, score_mod=all_score_mods, mask_mod=mask_mod,
                                    block_mask=block_mask, sinks=sinks, q_positions=q_pos,
                                    kv_positions=kv_pos, causal=causal,
                                    segment_ids=seg_q, kv_segment_ids=seg_kv, scale=scale,
                                    block_q=block_q, block_k=block_k)

    dtype = q.dtype
    groups = N // Nk
    to_bnth = lambda x: jnp.swapaxes(x.astype(jnp.float32), 1, 2)
    qs = to_bnth(q) * jnp.float32(scale)
    kk, vv = to_bnth(k), to_bnth(v)
    if groups > 1:
        kk = jnp.repeat(kk, groups, axis=1)
        vv = jnp.repeat(vv, groups, axis=1)
    m = _Masking(q_pos, kv_pos, None, mask4, seg_q, seg_kv)

    terms_at = functools.partial(_make_terms, scheme, all_score_mods, mask_mod)
    if implementation == "reference":
        out = _reference(terms_at(Tq, Tk), qs, kk, vv, m, causal, sinks)
    else:
        out = _chunked(terms_at, qs, kk, vv, m, causal, block_q or _BLOCK_Q, block_k or _BLOCK_K,
                       sinks, block_mask)
    return jnp.swapaxes(out, 1, 2).astype(dtype)
