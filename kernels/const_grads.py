"""Gradients of the score_mod's captured arrays, computed *outside* the kernels by a
blockwise plain-JAX pass that recomputes the score tiles from the saved log-sum-exp:
``sum over tiles of VJP(score_mod)(dS)``. Exact, lowered by XLA on every backend (a
gather's transpose is a scatter-add, which neither Triton nor Mosaic lowers), and dead
code under ``jit`` when no captured array needs a gradient (the transposes and pads here
belong to this pass only), so training q, k, v never pays for it.

The pass scans groups of query tiles, holding :data:`CONST_GRAD_BLOCK_BYTES` of float32
scores per step; every array is cut into the kernels' tiles ``[B, N, G, nk, bq, bk]`` so
the mods see exactly the tiles' positions, and dropout's keep decisions are the kernels'.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpos._util import pad_axis
from jaxpos.core.dropout import Dropout, keep_tile

if TYPE_CHECKING:
    from jaxpos.kernels.config import KernelConfig, Operands

#: Bytes of float32 score block the captured-array gradient pass holds per step.
CONST_GRAD_BLOCK_BYTES = 1 << 27


def tiles_apply(conv: Any, x: Any, q_pos_t: Any, kv_pos_t: Any, kind: Any) -> Any:
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


def rows_per_step(cfg: KernelConfig, width: int) -> int:
    """Query tiles per scan step (a divisor of ``nq``) within the byte budget."""
    per_tile_row = cfg.B * cfg.N * cfg.bq * width * 4
    G = max(1, min(cfg.nq, CONST_GRAD_BLOCK_BYTES // max(per_tile_row, 1)))
    while cfg.nq % G:
        G -= 1
    return G


class _Pass(NamedTuple):
    """The static shape of the pass: ``G`` query tiles per step, ``steps`` steps."""

    G: int
    steps: int
    rows: int


def _scan_inputs(cfg, ops, ps, lse, do, delta):
    """The per-step inputs (query rows, positions, segments) and the whole keys."""
    q, k = ops.q, ops.k
    if cfg.rope_half:
        from jaxpos.schemes.rope import rotate

        t = ops.tabs
        q = rotate(q, t[0][:, :cfg.Tq], t[1][:, :cfg.Tq], layout="half")
        k = rotate(k, t[2][:, :cfg.Tk], t[3][:, :cfg.Tk], layout="half")
    Tq_p, Tk_p = cfg.nq * cfg.bq, cfg.nk * cfg.bk
    lay = lambda x, T_p: pad_axis(jnp.swapaxes(x, 1, 2), 2, T_p)

    def split_rows(x):  # [B, N, Tq_p, w] -> [steps, B, N, rows, w]
        return jnp.moveaxis(x.reshape(x.shape[:2] + (ps.steps, ps.rows) + x.shape[3:]), 2, 0)

    q_pos = ops.q_pos[..., 0]  # [Bq, Tq_p]
    xs = {"q": split_rows(lay(q, Tq_p)), "do": split_rows(lay(do, Tq_p)),
          "lse": split_rows(lse), "delta": split_rows(delta),
          "q_pos": jnp.moveaxis(q_pos.reshape(q_pos.shape[0], ps.steps, ps.G, cfg.bq), 1, 0),
          "step": jnp.arange(ps.steps, dtype=jnp.int32)}
    if cfg.has_segments:
        xs["q_seg"] = jnp.moveaxis(
            ops.q_seg[..., 0].reshape(cfg.B, ps.steps, ps.G, cfg.bq), 1, 0)
    return xs, lay(k, Tk_p), lay(ops.v, Tk_p)


def _to_tiles(cfg, ps, x):
    """``[B, N, rows, Tk_p]`` -> ``[B, N, G, nk, bq, bk]``."""
    x = x.reshape(x.shape[:2] + (ps.G, cfg.bq, cfg.nk, cfg.bk))
    return jnp.swapaxes(x, 3, 4)


def _raw_scores(cfg, ps, x, k, v):
    """The raw scores and ``dO V^T`` of one step's query rows, as tiles."""
    B, N, g = cfg.B, cfg.N, cfg.groups
    prec = jax.lax.Precision.HIGHEST if cfg.precise else None
    qi = x["q"].reshape(B, N // g, g, ps.rows, -1)
    doi = x["do"].reshape(B, N // g, g, ps.rows, -1)
    s_raw = jnp.einsum("bkgqh,bkth->bkgqt", qi, k, precision=prec,
                       preferred_element_type=jnp.float32) * jnp.float32(cfg.scale)
    dp = jnp.einsum("bkgqh,bkth->bkgqt", doi, v, precision=prec,
                    preferred_element_type=jnp.float32)
    Tk_p = cfg.nk * cfg.bk
    return (_to_tiles(cfg, ps, s_raw.reshape(B, N, ps.rows, Tk_p)),
            _to_tiles(cfg, ps, dp.reshape(B, N, ps.rows, Tk_p)))


def _dropped(cfg, ops, ps, step, dp):
    """``dp`` times the kernels' dropout factors (keep decisions of the same pairs)."""
    if not cfg.dropout_rate:
        return dp
    B, N, G, bq, nk, bk = cfg.B, cfg.N, ps.G, cfg.bq, cfg.nk, cfg.bk
    drop = Dropout(cfg.dropout_rate, ops.drop_seed, cfg.dropout_broadcast)
    qi = step * ps.rows + (jnp.arange(G, dtype=jnp.int32)[:, None] * bq
                           + jnp.arange(bq, dtype=jnp.int32)[None, :])
    ki = jnp.arange(nk, dtype=jnp.int32)[:, None] * bk + jnp.arange(bk, dtype=jnp.int32)[None, :]
    bi = jnp.arange(B, dtype=jnp.int32).reshape(B, 1, 1, 1, 1, 1)
    hi = jnp.arange(N, dtype=jnp.int32).reshape(1, N, 1, 1, 1, 1)
    if drop.broadcast:
        bi, hi = bi * 0, hi * 0
    keep = keep_tile(drop.seed, drop.threshold, bi, hi, qi.reshape(1, 1, G, 1, bq, 1),
                     ki.reshape(1, 1, 1, nk, 1, bk))
    return jnp.where(keep, dp * jnp.float32(drop.scale), 0.0)


def _visibility(cfg, ops, ps, x, kv_pos_t):
    """bool tiles ``[B|1, 1|N, G, nk, bq, bk]``: which scores are visible."""
    Tk_p, nk, bk = cfg.nk * cfg.bk, cfg.nk, cfg.bk
    lim = cfg.Tk if ops.kv_len is None else ops.kv_len[:, None]
    vis = (jnp.arange(Tk_p)[None, :] < lim).reshape(-1, 1, 1, nk, 1, bk)
    qp = x["q_pos"]  # [Bq, G, bq]
    if cfg.causal:
        vis = vis & (kv_pos_t[:, None, None, :, None, :] <= qp[:, None, :, None, :, None])
    if cfg.has_segments:
        kv_seg = ops.kv_seg[:, 0, :].reshape(cfg.B, nk, bk)
        vis = vis & (x["q_seg"][:, None, :, None, :, None] == kv_seg[:, None, None, :, None, :])
    if ops.mmod is not None:
        vis = vis & tiles_apply(ops.mmod, None, qp, kv_pos_t, (cfg.B, cfg.N, ps.G, nk))
    return vis


def _step_fn(cfg, ops, ps, diff, k, v):
    """One scan step: the captured arrays' gradients of ``G`` query tiles' scores."""
    smod, consts = ops.smod, list(ops.smod.consts)
    kv_pos_t = ops.kv_pos[:, 0, :].reshape(ops.kv_pos.shape[0], cfg.nk, cfg.bk)

    def step(acc, x):
        s_raw, dp = _raw_scores(cfg, ps, x, k, v)
        dp = _dropped(cfg, ops, ps, x["step"], dp)
        vis = _visibility(cfg, ops, ps, x, kv_pos_t)

        def scores(dc):
            cs = list(consts)
            for i, c in zip(diff, dc):
                cs[i] = c
            return tiles_apply(smod.with_consts(cs), s_raw, x["q_pos"], kv_pos_t, None)

        s, vjp = jax.vjp(scores, [consts[i] for i in diff])
        lse_t = x["lse"].reshape(cfg.B, cfg.N, ps.G, 1, cfg.bq, 1)
        delta_t = x["delta"].reshape(cfg.B, cfg.N, ps.G, 1, cfg.bq, 1)
        p = jnp.where(vis, jnp.exp(s - jnp.where(lse_t == -jnp.inf, 0.0, lse_t)), 0.0)
        (dc,) = vjp(jnp.where(vis, p * (dp - delta_t), 0.0))
        return [a + d for a, d in zip(acc, dc)], None

    return step


def mod_const_grads(cfg: KernelConfig, ops: Operands, lse: Any, do: Any, delta: Any) -> list[Any]:
    """Gradients of ``ops.smod``'s floating captured arrays (None for the others), from
    the backward rows ``lse``, ``delta`` ``[B, N, Tq_p, 1]`` and ``do`` ``[B, Tq, N, Hv]``."""
    consts = list(ops.smod.consts)
    diff = [i for i, c in enumerate(consts) if jnp.issubdtype(jnp.result_type(c), jnp.inexact)]
    if not diff:
        return [None] * len(consts)
    G = rows_per_step(cfg, cfg.nk * cfg.bk)
    ps = _Pass(G, cfg.nq // G, G * cfg.bq)
    xs, k, v = _scan_inputs(cfg, ops, ps, lse, do, delta)
    acc0 = [jnp.zeros(np.shape(consts[i]), jnp.result_type(consts[i])) for i in diff]
    acc, _ = jax.lax.scan(_step_fn(cfg, ops, ps, diff, k, v), acc0, xs)
    out: list[Any] = [None] * len(consts)
    for i, a in zip(diff, acc):
        out[i] = a
    return out
