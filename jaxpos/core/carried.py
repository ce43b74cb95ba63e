"""Softmax attention over key blocks whose scores need a state carried along the key axis.

Some position schemes score a query against a key with something that accumulates over
the keys between them: PaTH (Yang et al. 2025) multiplies the query by the Householder
transforms of every block it passes (:mod:`jaxpos.core.path`), CoPE (Golovneva et al.
2024) counts the gates of the keys to the right (:mod:`jaxpos.core.cope`). Neither is a
score_mod of positions, so neither runs in :func:`jaxpos.attention`'s engines. This module
is their shared tiled engine:

* the forward pass visits, for each query block, the key blocks from the last to the
  first, carrying the scheme's state and the online softmax (running maximum, sum and
  weighted values; Rabe & Staats 2021, "Self-attention Does Not Need O(n^2) Memory";
  Milakov & Gimelshein 2018; the step of :mod:`jaxpos.core.tiles`), so memory is
  ``O(T)`` (one tile at a time);
* the backward pass (a custom VJP) recomputes one query block at a time: with the saved
  log-sum-exp ``lse_i`` and ``delta_i = do_i . o_i`` (FlashAttention's, Dao et al. 2022,
  Alg. 4), the surrogate ``psi = sum_ij exp(s_ij - lse_i) (do_i . v_j - delta_i)`` has the
  true gradient of ``sum(do * o)`` with respect to every score and value, so
  differentiating ``psi`` through the carried key loop of one query block gives that
  block's share of every gradient, ``O(T * block)`` memory at a time.

The scheme gives ``tile(q_blk, kv_blk, state, qi, kj) -> (scores, state)`` (float32
``[B, N, bq, bk]`` with ``-inf`` where the pair is invisible) and ``init(q_blk) -> state``;
its per-block inputs are pytrees of float arrays (differentiated) and int arrays
(positions, segments: not differentiated), blocked along a leading block axis.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpos import _checks
from jaxpos.core.tiles import online_softmax_step, softmax_finish, softmax_start

__all__ = ["carried_attention", "to_blocks", "from_blocks"]


def to_blocks(x: jax.Array, size: int, axis: int) -> jax.Array:
    """Split ``axis`` of ``x`` (a multiple of ``size`` long) into a leading block axis:
    ``[n, ..., size, ...]``."""
    n = x.shape[axis] // size
    x = jnp.moveaxis(x, axis, 0).reshape((n, size) + tuple(np.delete(x.shape, axis)))
    return jnp.moveaxis(x, 1, axis + 1)


def from_blocks(x: jax.Array, axis: int) -> jax.Array:
    """Inverse of :func:`to_blocks` (``axis`` is the within-block axis of the unblocked
    array)."""
    x = jnp.moveaxis(x, 0, axis)
    shape = x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:]
    return x.reshape(shape)


def _forward_block(tile, init, block_q, q_blk, kv_all, v_all, qi):
    """Online softmax (the tile library's step, :mod:`jaxpos.core.tiles`) over the key
    blocks of one query block, last block first, in v's dtype. Returns ``(o [B, N, bq,
    Hv], lse [B, N, bq])``."""

    def step(carry, xs):
        st, running = carry
        kj, kv_blk, vj = xs
        s, st = tile(q_blk, kv_blk, st, qi, kj)
        values = lambda p: jnp.einsum("bnqk,bnkh->bnqh", p, vj)
        return (st, online_softmax_step(running, s, values)), None

    nk, B, N, _, Hv = v_all.shape
    start = softmax_start((B, N, block_q), Hv, dtype=v_all.dtype)
    (_, running), _ = jax.lax.scan(step, (init(q_blk), start),
                                   (jnp.arange(nk), kv_all, v_all), reverse=True)
    return softmax_finish(running)


def _surrogate(tile, init, q_blk, kv_all, v_all, qi, lse, do, delta):
    """``psi`` of the module docstring for one query block (its gradient is the block's
    share of the gradient of ``sum(do * o)``)."""
    state = init(q_blk)
    seen = jnp.isfinite(lse)
    lse_safe = jnp.where(seen, lse, 0.0)

    def step(carry, xs):
        st, acc = carry
        kj, kv_blk, vj = xs
        s, st = tile(q_blk, kv_blk, st, qi, kj)
        p = jnp.where(seen[..., None], jnp.exp(s - lse_safe[..., None]), 0.0)
        g = jnp.einsum("bnqh,bnkh->bnqk", do, vj) - delta[..., None]
        return (st, acc + jnp.sum(p * g)), None

    nk = v_all.shape[0]
    (_, psi), _ = jax.lax.scan(step, (state, jnp.zeros((), v_all.dtype)),
                               (jnp.arange(nk), kv_all, v_all), reverse=True)
    return psi


def _split(tree):
    """``(float leaves as a list, rebuild(float_leaves, int_leaves), int leaves)``."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    is_f = [jnp.issubdtype(x.dtype, jnp.floating) for x in leaves]
    fl = [x for x, f in zip(leaves, is_f) if f]
    il = [x for x, f in zip(leaves, is_f) if not f]

    def rebuild(fl, il):
        fi, ii = iter(fl), iter(il)
        return jax.tree_util.tree_unflatten(treedef, [next(fi) if f else next(ii)
                                                      for f in is_f])

    return fl, il, rebuild


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(fns, qf, qi_, kf, ki, v):
    tile, init, block_q, rq, rk = fns
    q_all, kv_all = rq(qf, qi_), rk(kf, ki)
    nq = jax.tree_util.tree_leaves(q_all)[0].shape[0]

    def per_q(args):
        qi, q_blk = args
        return _forward_block(tile, init, block_q, q_blk, kv_all, v, qi)

    return jax.lax.map(per_q, (jnp.arange(nq), q_all))


def _core_fwd(fns, qf, qi_, kf, ki, v):
    o, lse = _core(fns, qf, qi_, kf, ki, v)  # pyright: ignore[reportGeneralTypeIssues]
    return (o, lse), (qf, qi_, kf, ki, v, o, lse)


def _core_bwd(fns, res, cts):
    tile, init, _, rq, rk = fns
    qf, qi_, kf, ki, v, o, lse = res
    do, _ = cts  # lse is an output for the callers' convenience, not differentiated
    delta = jnp.sum(do * o, -1)
    nq = o.shape[0]

    def per_q(acc, args):
        qi, qf_blk, qi_blk, do_b, delta_b, lse_b = args

        def psi(qf_b, kf_all, v_all):
            q_blk = rq(qf_b, qi_blk)
            return _surrogate(tile, init, q_blk, rk(kf_all, ki), v_all, qi, lse_b, do_b,
                              delta_b)

        dq_b, dk, dv = jax.grad(psi, argnums=(0, 1, 2))(qf_blk, kf, v)
        acc = (jax.tree_util.tree_map(jnp.add, acc[0], dk), acc[1] + dv)
        return acc, dq_b

    zeros = (jax.tree_util.tree_map(jnp.zeros_like, kf), jnp.zeros_like(v))
    # rq rebuilds one query block from leaves without their block axis, too
    (dkf, dv), dqf = jax.lax.scan(per_q, zeros, (jnp.arange(nq), qf, qi_, do, delta, lse))
    zero_int = lambda xs: [np.zeros(x.shape, jax.dtypes.float0) for x in xs]
    return dqf, zero_int(qi_), dkf, zero_int(ki), dv


_core.defvjp(_core_fwd, _core_bwd)


def carried_attention(tile: Callable, init: Callable, q_blocks: Any, kv_blocks: Any,
                      v_blocks: jax.Array, *, block_q: int) -> tuple[jax.Array, jax.Array]:
    """Softmax attention whose scores come from ``tile``, carried over key blocks.

    Args:
      tile: ``tile(q_blk, kv_blk, state, qi, kj) -> (scores, state)``: the float32 scores
        ``[B, N, bq, bk]`` of query block ``qi`` against key block ``kj`` (``-inf`` for
        invisible pairs) and the state after that key block. Key blocks are visited from
        the last to the first. A static function (hashable).
      init: ``init(q_blk) -> state`` before the last key block.
      q_blocks: a pytree of arrays with a leading query-block axis ``nq`` (float leaves
        are differentiated, integer ones are not).
      kv_blocks: a pytree of arrays with a leading key-block axis ``nk``.
      v_blocks: float ``[nk, B, N, bk, Hv]`` (float32, or float64 for checks: the
        computation runs in its dtype).
      block_q: the query block size ``bq``.

    Returns:
      ``(o, lse)``: ``[nq, B, N, bq, Hv]`` in v's dtype (zeros for a query that sees no key)
      and the log-sum-exp ``[nq, B, N, bq]`` (``-inf`` there). Differentiable in the
      float leaves and ``v_blocks`` (the custom VJP of the module docstring).
    """
    qf, qi_, rq = _split(q_blocks)
    kf, ki, rk = _split(kv_blocks)
    return _core((tile, init, int(block_q), rq, rk), qf, qi_, kf, ki, v_blocks)


def static_scale(fn: str, scale: Any, H: int) -> float:
    """The score scale of the carried-state attentions (``fn`` names the caller):
    ``1 / sqrt(H)`` by default, else the given static number.

    Raises:
      TypeError: a traced scale (the blocked algorithms compile it in).
      ValueError: a scale that is not a real number.
    """
    if scale is None:
        return 1.0 / float(np.sqrt(H))
    if not _checks.is_concrete(scale):
        raise TypeError(f"{fn} needs a static scale (a Python or concrete number); "
                        f"got a traced one.")
    return _checks.check_real("scale", scale)
