"""The tile library: the one online-softmax step, the one log-sum-exp merge and the one
fold of attention sinks, shared by every engine and by the kernel's tile code.

* :func:`softmax_start` / :func:`online_softmax_step` / :func:`softmax_finish`: the running
  maximum ``m``, sum ``l`` and unnormalised accumulator ``acc`` of one block of query
  rows over a sequence of key tiles (FlashAttention-2, Dao 2023, Alg. 1, lines 8-10 and
  12; Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"). Used by
  the chunked engine's forward pass, its decode path, the xla engine's dense attention
  (one step over all keys), the carried-state attentions of PaTH and CoPE
  (:mod:`jaxpos.core.carried`) and, inside the Pallas kernel, every key tile
  (``jaxpos.kernels.forward``).
* :func:`lse_merge`: the exact combination of two normalised partial outputs by their
  log-sum-exps (the key-split combine of Flash-Decoding, Dao et al. 2023, and of ring
  attention, Liu et al. 2023).
* :func:`fold_sinks`: attention sinks joined to finished outputs (after a ring or the
  kernel's key splits, where no loop state is left to start from them).

Conventions: scores ``s`` are float32 ``[..., tq, tk]`` with ``-inf`` where a pair is hidden;
``m``, ``l`` and an lse are ``[..., tq]`` (or ``[..., tq, 1]``, the kernel's 2-D tiles);
``acc`` and outputs ``[..., tq, H_v]``. A row with no visible key has ``l == 0`` exactly
and finishes as zeros with lse ``-inf``; a NaN score passes through as NaN (never mistaken
for an empty row). The functions are plain ``jax.numpy``, so a Pallas kernel body
(Triton, Mosaic) traces them as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["Running", "fold_sinks", "lse_merge", "online_softmax_step", "softmax_finish",
           "softmax_start"]


class Running(NamedTuple):
    """The online softmax's state for a block of query rows: float32 running maximum
    ``m [..., tq]`` (``-inf`` before any visible key), sum of ``exp(s - m)``
    ``l [..., tq]`` and accumulator ``acc [..., tq, H_v]`` (``sum exp(s - m) v``). ``m``
    and ``l`` may keep a trailing axis of 1 (``[..., tq, 1]``), as the kernel's 2-D tiles
    do; every function here keeps the form it is given."""

    m: jax.Array
    l: jax.Array
    acc: jax.Array


def softmax_start(rows: tuple[int, ...], width: int, sinks: jax.Array | None = None,
                  *, zero: jax.Array | float = 0.0, dtype: Any = jnp.float32) -> Running:
    """The state before any key: ``m = -inf``, ``l = 0``, ``acc = 0`` for ``rows`` (e.g.
    ``(B, N, tq)``) and values of ``width``. With ``sinks`` (float ``[N]``, ``rows[1] ==
    N``) the sink is a key every row sees with a zero value: ``m = sinks[h]``, ``l = 1``
    (attention sinks, as in GPT-OSS). ``zero`` is added to every leaf (a loop carry under
    ``shard_map`` must vary like the values it meets); ``dtype`` is the state's (float32;
    float64 for the carried attentions' float64 checks)."""
    if sinks is None:
        m = jnp.full(rows, -jnp.inf, dtype)
        l = jnp.zeros(rows, dtype)
    else:
        col = jnp.asarray(sinks, dtype).reshape((1, -1) + (1,) * (len(rows) - 2))
        m = jnp.broadcast_to(col, rows)
        l = jnp.ones(rows, dtype)
    acc = jnp.zeros(rows + (width,), dtype)
    return Running(m + zero, l + zero, acc + zero)


def online_softmax_step(state: Running, s: jax.Array,
                        values: Callable[[jax.Array], jax.Array]) -> Running:
    """One key tile: ``m' = max(m, rowmax(s))``, ``l' = l e^(m - m') + rowsum(e^(s - m'))``,
    ``acc' = acc e^(m - m') + values(e^(s - m'))`` (FlashAttention-2, Alg. 1).

    ``values(p)`` maps the tile's unnormalised probabilities ``p [..., tq, tk]`` (float32,
    0 where ``s`` is ``-inf``) to their contribution ``[..., tq, H_v]`` (``p @ v``, with a
    dropout mask or a value term if the engine has one). The normaliser ``l`` counts ``p``
    as given to ``values`` before any dropout. A row whose maximum is still ``-inf`` is
    computed against 0, so no ``-inf - -inf`` arises. ``m`` and ``l`` of the form
    ``[..., tq, 1]`` stay in that form (the kernel's tiles)."""
    keep = state.m.ndim == s.ndim  # m [..., tq, 1]: reduce keeping the axis
    col = (lambda x: x) if keep else (lambda x: x[..., None])
    m_new = jnp.maximum(state.m, jnp.max(s, axis=-1, keepdims=keep))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - col(m_safe))
    corr = jnp.exp(state.m - m_safe)
    l = state.l * corr + jnp.sum(p, axis=-1, keepdims=keep)
    acc = state.acc * col(corr) + values(p)
    return Running(m_new, l, acc)


def softmax_finish(state: Running) -> tuple[jax.Array, jax.Array]:
    """``(out [..., tq, H_v], lse [..., tq])`` in the state's dtype: ``acc / l`` and ``m +
    log l``; a row with ``l == 0`` (no visible key, no sink) gives zeros and ``-inf``
    (``lse [..., tq, 1]`` for a state of that form)."""
    col = (lambda x: x) if state.m.ndim == state.acc.ndim else (lambda x: x[..., None])
    nonempty = state.l != 0
    l_safe = jnp.where(nonempty, state.l, 1.0)
    out = jnp.where(col(nonempty), state.acc / col(l_safe), 0.0)
    lse = jnp.where(nonempty, state.m + jnp.log(l_safe), -jnp.inf)
    return out, lse


def lse_merge(o1: jax.Array, l1: jax.Array, o2: jax.Array,
              l2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The exact softmax over the union of two disjoint key sets from their normalised
    partial outputs ``o1``, ``o2`` ``[..., H_v]`` and log-sum-exps ``l1``, ``l2`` ``[...]``
    (``-inf`` for a part with no visible key): ``lse = logaddexp(l1, l2)``, ``out =
    o1 e^(l1 - lse) + o2 e^(l2 - lse)``. Both parts empty gives ``(0, -inf)``."""
    lse = jnp.logaddexp(l1, l2)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    w1, w2 = jnp.exp(l1 - safe), jnp.exp(l2 - safe)
    return o1 * w1[..., None] + o2 * w2[..., None], lse


def fold_sinks(out: jax.Array, lse: jax.Array, sinks: jax.Array,
               head_axis: int) -> tuple[jax.Array, jax.Array]:
    """Attention sinks (a learned logit per query head in every row's softmax denominator,
    with no value vector; as in GPT-OSS) joined to finished outputs: the sink is one more
    part of the row with output 0 and log-sum-exp ``sinks[h]``, merged by
    :func:`lse_merge`, so ``lse' = logaddexp(lse, sink_h)`` and ``out' = out e^(lse -
    lse')``. Used where no loop state is left to start from the sinks
    (:func:`softmax_start`): after a ring's last step, after the kernel's key splits.

    Args:
      out: normalised outputs ``[..., H_v]`` whose leading axes are ``lse``'s.
      lse: float32 log-sum-exps, ``-inf`` for a row with no visible key.
      sinks: float ``[N]``; ``lse.shape[head_axis] == N``.
      head_axis: the axis of ``lse`` that indexes the query heads.

    Returns:
      ``(out, lse)`` with the sinks; a row with no key and a sink of ``-inf`` stays
      ``(0, -inf)``.
    """
    shape = [1] * lse.ndim
    shape[head_axis] = -1
    sink = jnp.broadcast_to(jnp.asarray(sinks, jnp.float32).reshape(shape), lse.shape)
    return lse_merge(out, lse, jnp.zeros_like(out), sink)
