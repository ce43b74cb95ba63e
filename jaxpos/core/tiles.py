"""The tile library: the one online-softmax step and the one log-sum-exp merge every
engine in plain JAX shares.

* :func:`softmax_start` / :func:`online_softmax_step` / :func:`softmax_finish`: the running
  maximum ``m``, sum ``l`` and unnormalised accumulator ``acc`` of one block of query
  rows over a sequence of key tiles (FlashAttention-2, Dao 2023, Alg. 1, lines 8-10 and
  12; Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"). Used by
  the chunked engine's forward pass, its decode path and the xla engine's dense
  attention (one step over all keys).
* :func:`lse_merge`: the exact combination of two normalised partial outputs by their
  log-sum-exps (the key-split combine of Flash-Decoding, Dao et al. 2023, and of ring
  attention, Liu et al. 2023).

Conventions: scores ``s`` are float32 ``[..., tq, tk]`` with ``-inf`` where a pair is hidden;
``m``, ``l`` and an lse are ``[..., tq]``; ``acc`` and outputs ``[..., tq, H_v]``. A row with no
visible key has ``l == 0`` exactly and finishes as zeros with lse ``-inf``; a NaN score
passes through as NaN (never mistaken for an empty row).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["Running", "lse_merge", "online_softmax_step", "softmax_finish", "softmax_start"]


class Running(NamedTuple):
    """The online softmax's state for a block of query rows: float32 running maximum
    ``m [..., tq]`` (``-inf`` before any visible key), sum of ``exp(s - m)``
    ``l [..., tq]`` and accumulator ``acc [..., tq, H_v]`` (``sum exp(s - m) v``)."""

    m: jax.Array
    l: jax.Array
    acc: jax.Array


def softmax_start(rows: tuple[int, ...], width: int, sinks: jax.Array | None = None,
                  *, zero: jax.Array | float = 0.0) -> Running:
    """The state before any key: ``m = -inf``, ``l = 0``, ``acc = 0`` for ``rows`` (e.g.
    ``(B, N, tq)``) and values of ``width``. With ``sinks`` (float ``[N]``, ``rows[1] ==
    N``) the sink is a key every row sees with a zero value: ``m = sinks[h]``, ``l = 1``
    (attention sinks, as in GPT-OSS). ``zero`` is added to every leaf (a loop carry under
    ``shard_map`` must vary like the values it meets)."""
    if sinks is None:
        m = jnp.full(rows, -jnp.inf, jnp.float32)
        l = jnp.zeros(rows, jnp.float32)
    else:
        col = jnp.asarray(sinks, jnp.float32).reshape((1, -1) + (1,) * (len(rows) - 2))
        m = jnp.broadcast_to(col, rows)
        l = jnp.ones(rows, jnp.float32)
    acc = jnp.zeros(rows + (width,), jnp.float32)
    return Running(m + zero, l + zero, acc + zero)


def online_softmax_step(state: Running, s: jax.Array,
                        values: Callable[[jax.Array], jax.Array]) -> Running:
    """One key tile: ``m' = max(m, rowmax(s))``, ``l' = l e^(m - m') + rowsum(e^(s - m'))``,
    ``acc' = acc e^(m - m') + values(e^(s - m'))`` (FlashAttention-2, Alg. 1).

    ``values(p)`` maps the tile's unnormalised probabilities ``p [..., tq, tk]`` (float32,
    0 where ``s`` is ``-inf``) to their contribution ``[..., tq, H_v]`` (``p @ v``, with a
    dropout mask or a value term if the engine has one). The normaliser ``l`` counts ``p``
    as given to ``values`` before any dropout. A row whose maximum is still ``-inf`` is
    computed against 0, so no ``-inf - -inf`` arises."""
    m_new = jnp.maximum(state.m, jnp.max(s, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    corr = jnp.exp(state.m - m_safe)
    l = state.l * corr + jnp.sum(p, axis=-1)
    acc = state.acc * corr[..., None] + values(p)
    return Running(m_new, l, acc)


def softmax_finish(state: Running) -> tuple[jax.Array, jax.Array]:
    """``(out [..., tq, H_v], lse [..., tq])``, float32: ``acc / l`` and ``m + log l``; a
    row with ``l == 0`` (no visible key, no sink) gives zeros and ``-inf``."""
    nonempty = state.l != 0
    l_safe = jnp.where(nonempty, state.l, 1.0)
    out = jnp.where(nonempty[..., None], state.acc / l_safe[..., None], 0.0)
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
