"""The ring over an engine that returns its log-sum-exp (the fused kernel on GPU/TPU).

:func:`jaxpos.parallel.ring_attention` with the ``"chunked"`` engine (the CPU default)
runs each (local queries, passing block) pair through the chunked path's tiles, forward
and backward. With another engine (any registered engine with ``run_with_lse``, see
:mod:`jaxpos.core.engines`), :func:`engine_ring` runs each pair as one attention call of
that engine, asking it for the block's output and log-sum-exp, and merges the blocks
by their log-sum-exps (:func:`jaxpos.core.tiles.lse_merge`: the online softmax across
blocks, Milakov & Gimelshein 2018; Liu,
Zaharia & Abbeel 2023, §3), the sinks joining the normaliser once at the end.

The backward pass is a ``jax.custom_vjp`` with the ring's memory: each device keeps only
its queries, the global output ``O`` and log-sum-exp ``L``; every passing block's
gradients come from the engine's own backward (its VJP of ``(O_b, l_b)``) with the
cotangents that make it the block's share of the global gradient::

    dO_b = w_b dO,   dl_b = w_b (rowsum(dO * O_b) - rowsum(dO * O)),   w_b = exp(l_b - L)

(``O = sum_b w_b O_b``; then the engine's ``dS = P_b (dP_b - delta_b + dl_b)`` is the
global ``P (dP - rowsum(dO * O))`` of FlashAttention-2's backward, Dao 2023, Alg. 2).
The block's forward is recomputed inside the backward (as FlashAttention recomputes its
tiles); ``dk``/``dv`` travel with their block and arrive at its owner after ``P`` hops.

A mod's captured arrays (a T5 table, a per-head bias) are explicit inputs of the
``custom_vjp``: the engine receives the mod with them substituted (:class:`Rebound`),
traced again at whatever tile shape the engine uses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxpos import _checks
from jaxpos._util import match_vma, ring_shift, sink_gradient, zero_cotangent
from jaxpos.core import engines
from jaxpos.core.call import AttentionCall
from jaxpos.core.chunked import tile_kind, varying_zero
from jaxpos.core.tiles import fold_sinks, lse_merge
from jaxpos.mods import EMPTY, ConvertedMod, convert_mod

__all__ = ["Rebound", "engine_ring", "lse_engines", "lse_runner", "ring_engine"]

_NEG_INF = -jnp.inf


def lse_engines() -> tuple[str, ...]:
    """The registered engines that return their log-sum-exp (``run_with_lse``)."""
    return tuple(n for n in engines.engine_names()
                 if hasattr(engines.get_engine(n), "run_with_lse"))


def ring_engine(call: AttentionCall, implementation: str | None) -> str:
    """The engine of the ring's blocks: ``implementation`` (checked: registered, returns its
    log-sum-exp, does not refuse the call), or for ``None`` the first engine of the
    backend's preference list that returns its log-sum-exp and takes the call (the fused
    kernel on GPU/TPU, ``"chunked"`` on CPU).

    Raises:
      ValueError: an unknown engine, one without ``run_with_lse``, or one that refuses the
        call (its reason); TypeError: one that refuses a value of the wrong kind.
    """
    with_lse = lse_engines()
    if implementation is None:
        for name in engines.preference():
            engine = engines.get_engine(name)
            if name in with_lse and engine.refuses(call) is None and \
                    getattr(engine, "prefers", lambda c: True)(call):
                return name
        # none of the list's engines takes it (a list edited by hand): any that does
        for name in with_lse:
            if engines.get_engine(name).refuses(call) is None:
                return name
        raise ValueError(f"no engine that returns its log-sum-exp ({list(with_lse)}) runs "
                         f"this call.")
    _checks.check_choice("implementation", implementation, engines.engine_names())
    if implementation not in with_lse:
        raise ValueError(f"implementation={implementation!r} cannot run the ring's blocks: it "
                         f"does not return its log-sum-exp (no run_with_lse); engines that "
                         f"do: {list(with_lse)}.")
    engines.select_engine(call, implementation)  # raises the engine's refusal
    return implementation


def lse_runner(implementation: str) -> Callable[[AttentionCall], tuple[jax.Array, jax.Array]]:
    """``call -> (out float32 [B, Tq, N, H_v], lse float32 [B, N, Tq])`` of the engine
    ``implementation`` (its ``run_with_lse``), differentiable."""

    def run(call: AttentionCall) -> tuple[jax.Array, jax.Array]:
        out, lse = engines.run_with_lse(call, implementation)
        return out.astype(jnp.float32), lse

    return run


class Rebound:
    """A score_mod / mask_mod with its captured arrays replaced by other values, callable
    at any tile shape: each call traces ``fn`` there and substitutes, by identity, the
    arrays of ``captured`` with ``values``."""

    def __init__(self, fn: Callable, kind: str, captured: tuple, values: tuple):
        self.fn, self.kind, self.captured, self.values = fn, kind, captured, tuple(values)
        self.__name__ = getattr(fn, "__name__", "mod")

    def __call__(self, *args: Any) -> jax.Array:
        closed = jax.make_jaxpr(self.fn)(*args)
        consts = []
        for c in closed.consts:
            hit = [val for orig, val in zip(self.captured, self.values) if c is orig]
            consts.append(hit[0] if hit else c)
        return ConvertedMod(closed.jaxpr, consts, self.kind, self.__name__)(*args)


class _Cfg(NamedTuple):
    axis_name: str
    size: int
    run: Callable  # lse_runner(...)
    template: Any  # _Template (static parts of the call)


class _Template:
    """What a block's call needs besides the arrays: the mods, their captured arrays
    (identity keys, never computed with), the scheme's treedef and the static options."""

    def __init__(self, call: AttentionCall):
        self.score_mod, self.mask_mod = call.score_mod, call.mask_mod
        conv = lambda fn, kind: () if fn is None else convert_mod(fn, kind, 2, 3).consts
        self.score_captured = conv(call.score_mod, "score")
        self.mask_captured = conv(call.mask_mod, "mask")
        self.scheme_leaves, self.scheme_def = jax.tree_util.tree_flatten(call.scheme)
        self.causal, self.scale = call.causal, call.scale
        self.block_q, self.block_k = call.block_q, call.block_k

    def params(self) -> list:
        """The differentiable inputs: the scheme's leaves and the mods' captured arrays."""
        return [*self.scheme_leaves, *self.score_captured, *self.mask_captured]

    def call(self, params, q, k, v, q_pos, kv_pos, seg_q, seg_kv) -> AttentionCall:
        ns, nm = len(self.scheme_leaves), len(self.score_captured)
        scheme = jax.tree_util.tree_unflatten(self.scheme_def, params[:ns])
        score = None if self.score_mod is None else Rebound(
            self.score_mod, "score", self.score_captured, params[ns:ns + nm])
        mask = None if self.mask_mod is None else Rebound(
            self.mask_mod, "mask", self.mask_captured, params[ns + nm:])
        return AttentionCall(q=q, k=k, v=v, scheme=scheme, score_mod=score, mask_mod=mask,
                             block_mask=None, sinks=None, q_positions=q_pos,
                             kv_positions=kv_pos, segment_ids=seg_q, kv_segment_ids=seg_kv,
                             mask=None, causal=self.causal, scale=self.scale,
                             block_q=self.block_q, block_k=self.block_k)


def _live(cfg: _Cfg, loc, kv):
    """May any local query see any key of the passing block (conservative)?"""
    kind = tile_kind(cfg.template.causal, cfg.template.mask_mod is not None, loc["q_pos"],
                     kv["kv_pos"], jnp.ones(kv["kv_pos"].shape, bool), loc["seg_q"],
                     kv["seg_kv"], None)
    return kind != EMPTY


def _block_fn(cfg: _Cfg, loc, kv_meta):
    """(params, q, k, v) -> (out, lse) of the local queries against one block."""
    def f(params, q, k, v):
        return cfg.run(cfg.template.call(params, q, k, v, loc["q_pos"], kv_meta["kv_pos"],
                                         loc["seg_q"], kv_meta["seg_kv"]))
    return f


def _forward(cfg: _Cfg, params, sinks, q, loc, kv):
    B, Tq, N = q.shape[:3]
    Hv = kv["v"].shape[-1]
    z = varying_zero(params, q, loc, kv)
    empty = (jnp.zeros((B, Tq, N, Hv), jnp.float32) + z,
             jnp.full((B, N, Tq), _NEG_INF, jnp.float32) + z)

    def step(carry, _):
        kv, out, lse = carry

        def run(_):
            o, l = _block_fn(cfg, loc, kv)(params, q, kv["k"], kv["v"])
            return o + z, l + z

        o, l = jax.lax.cond(_live(cfg, loc, kv), run, lambda _: empty, None)
        nxt = ring_shift(kv, cfg.axis_name, cfg.size)
        o_bn = jnp.swapaxes(out, 1, 2)  # merge in [B, N, Tq, Hv]
        merged, lse = lse_merge(o_bn, lse, jnp.swapaxes(o, 1, 2), l)
        return (nxt, jnp.swapaxes(merged, 1, 2), lse), None

    (_, out, lse), _ = jax.lax.scan(step, (kv,) + empty, None, length=cfg.size)
    if sinks is not None:  # folded in [B, N, Tq, Hv], lse's layout
        o_bn, lse = fold_sinks(jnp.swapaxes(out, 1, 2), lse, sinks, head_axis=1)
        out = jnp.swapaxes(o_bn, 1, 2)
    return out, lse


def _core(cfg, params, sinks, q, loc, kv):
    return _forward(cfg, params, sinks, q, loc, kv)[0]


def _core_fwd(cfg, params, sinks, q, loc, kv):
    out, lse = _forward(cfg, params, sinks, q, loc, kv)
    return out, (params, sinks, q, loc, kv, out, lse)


def _core_bwd(cfg: _Cfg, res, dout):
    params, sinks, q, loc, kv, out, L = res
    z = varying_zero(params, q, loc, kv, out, L, dout)
    zeros = lambda x: jnp.zeros(jnp.shape(x), jnp.float32) + z
    dout = dout.astype(jnp.float32)
    delta = jnp.swapaxes(jnp.sum(dout * out, axis=-1), 1, 2)  # [B, N, Tq]
    fparams = [jnp.issubdtype(jnp.result_type(p), jnp.inexact) for p in params]

    def grads(kv):
        def run(_):
            f = _block_fn(cfg, loc, kv)
            (o_b, l_b), vjp = jax.vjp(f, params, q, kv["k"], kv["v"])
            ok = jnp.isfinite(l_b) & jnp.isfinite(L)
            w = jnp.where(ok, jnp.exp(jnp.where(ok, l_b - L, 0.0)), 0.0)  # [B, N, Tq]
            do_b = dout * jnp.swapaxes(w, 1, 2)[..., None]
            dl_b = w * (jnp.swapaxes(jnp.sum(dout * o_b, axis=-1), 1, 2) - delta)
            dp, dq, dk, dv = vjp((do_b, dl_b))
            dp = [zeros(p) if not isf else g.astype(jnp.float32) + z
                  for p, g, isf in zip(params, dp, fparams)]
            return dp, dq.astype(jnp.float32) + z, dk.astype(jnp.float32) + z, \
                dv.astype(jnp.float32) + z

        def skip(_):
            return [zeros(p) for p in params], zeros(q), zeros(kv["k"]), zeros(kv["v"])

        return jax.lax.cond(_live(cfg, loc, kv), run, skip, None)

    def step(carry, _):
        kv, (dk, dv), dq, dp = carry
        gp, gq, gk, gv = grads(kv)
        dq, dp = dq + gq, [a + b for a, b in zip(dp, gp)]
        kv, dkv = ring_shift((kv, (dk + gk, dv + gv)), cfg.axis_name, cfg.size)
        return (kv, dkv, dq, dp), None

    init = (kv, (zeros(kv["k"]), zeros(kv["v"])), zeros(q), [zeros(p) for p in params])
    (_, (dk, dv), dq, dp), _ = jax.lax.scan(step, init, None, length=cfg.size)
    dparams = [match_vma(g.astype(jnp.result_type(p)), p) if isf else zero_cotangent(p)
               for g, p, isf in zip(dp, params, fparams)]
    dsinks = None
    if sinks is not None:
        dsinks = match_vma(sink_gradient(sinks, L, delta, 1).astype(sinks.dtype), sinks)
    dkv = dict(kv, k=match_vma(dk.astype(kv["k"].dtype), kv["k"]),
               v=match_vma(dv.astype(kv["v"].dtype), kv["v"]),
               kv_pos=zero_cotangent(kv["kv_pos"]), seg_kv=zero_cotangent(kv["seg_kv"]))
    return (dparams, dsinks, match_vma(dq.astype(q.dtype), q),
            jax.tree_util.tree_map(zero_cotangent, loc), dkv)


_core_vjp = jax.custom_vjp(_core, nondiff_argnums=(0,))
_core_vjp.defvjp(_core_fwd, _core_bwd)


def engine_ring(call: AttentionCall, axis_name: str, P: int, implementation: str) -> jax.Array:
    """The ring of a validated, transformed call whose blocks run on ``implementation``
    (see the module docstring): this device's ``[B, Tq, N, H_v]`` rows in q's dtype.

    Raises:
      ValueError: the engine cannot return its log-sum-exp (see :func:`ring_engine`).
    """
    cfg = _Cfg(axis_name, P, lse_runner(implementation), _Template(call))
    every = (call.q, call.k, call.q_positions, call.kv_positions)
    vary = lambda t: jax.tree_util.tree_map(
        lambda x: None if x is None else x + varying_zero(every).astype(x.dtype), t)
    loc = vary({"q_pos": call.q_positions, "seg_q": call.segment_ids})
    kv = vary({"k": call.k, "v": call.v, "kv_pos": call.kv_positions,
               "seg_kv": call.kv_segment_ids})
    out = _core_vjp(cfg, cfg.template.params(), call.sinks, call.q, loc, kv)
    return out.astype(call.q.dtype)
