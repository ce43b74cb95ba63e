"""Relative position representations of Shaw, Uszkoreit & Vaswani 2018 ("Self-Attention
with Relative Position Representations", §3).

For the clipped offset ``r = clip(n - m, -K, K)`` between key ``n`` and query ``m``,
two learned tables of ``2K + 1`` vectors of head width, ``a_K`` and ``a_V``, enter
attention as

    e_mn   = q_m . (k_n + a_K[r]) * scale
    z_m    = sum_n alpha_mn (v_n + a_V[r])

The efficient form (§3.3) never builds a ``[T, T, H]`` tensor: the queries are
multiplied with the ``2K + 1`` key vectors once (``[T, 2K+1]`` per head) and the scores
gathered from that; the value term sums the attention weights that fall in each
offset bucket (``[T, 2K+1]`` per head) and multiplies by the ``2K + 1`` value vectors.
Row ``r + K`` of a table is offset ``r``; offsets are clipped explicitly (JAX would wrap
a negative index).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpos import _checks
from jaxpos.alibi import relative_offsets

__all__ = ["shaw_clipped_index", "shaw_logits", "shaw_values", "shaw_attention", "check_shaw_table"]


def check_shaw_table(name: str, table, head_dim: int | None = None) -> int:
    """Validate a ``[2K + 1, H]`` Shaw table and return ``K``."""
    _checks.check_rank(name, table, (2,), "[2 * max_distance + 1, head_dim]")
    rows, h = _checks.shape_of(table)
    if rows % 2 == 0:
        raise ValueError(
            f"{name} must have an odd number of rows 2K + 1 (offsets -K..K); got shape "
            f"{_checks.shape_of(table)}."
        )
    if head_dim is not None and h != head_dim:
        raise ValueError(f"{name} must have shape [2K + 1, {head_dim}]; got {_checks.shape_of(table)}.")
    return (rows - 1) // 2


def shaw_clipped_index(q_positions, kv_positions, max_distance: int) -> jax.Array:
    """Row index ``clip(kv - q, -K, K) + K`` into a ``[2K + 1, H]`` table (int32 ``[..., Tq, Tk]``)."""
    rel = relative_offsets(q_positions, kv_positions)
    return jnp.clip(rel, -max_distance, max_distance) + max_distance


def shaw_logits(q, idx, rel_k) -> jax.Array:
    """Relative key term ``q_m . a_K[r]`` in the efficient form.

    Args:
      q: ``[B, N, Tq, H]`` (already scaled).
      idx: int ``[B|1, Tq, Tk]`` from :func:`shaw_clipped_index`.
      rel_k: ``[2K + 1, H]``.

    Returns:
      float32 ``[B, N, Tq, Tk]``.
    """
    qa = jnp.einsum("bnqh,rh->bnqr", q.astype(jnp.float32), rel_k.astype(jnp.float32))
    B, N, Tq, _ = qa.shape
    ix = jnp.broadcast_to(idx[:, None], (B, N, Tq, idx.shape[-1]))
    return jnp.take_along_axis(qa, ix, axis=-1)


def shaw_values(p, idx, rel_v) -> jax.Array:
    """Relative value term ``sum_n p_mn a_V[r_mn]`` -> float32 ``[B, N, Tq, H]``.

    ``p``: weights ``[B, N, Tq, Tk]`` (need not be normalised: the term is linear in p).
    The weights are summed per offset bucket (``[B, N, Tq, 2K+1]``) before touching
    the value vectors, so no ``[Tq, Tk, H]`` tensor is formed.
    """
    R = rel_v.shape[0]
    onehot = jax.nn.one_hot(idx, R, dtype=jnp.float32)  # [B|1, Tq, Tk, R]
    w = jnp.einsum("bnqk,bqkr->bnqr", p.astype(jnp.float32), onehot)
    return jnp.einsum("bnqr,rh->bnqh", w, rel_v.astype(jnp.float32))


def shaw_attention(q, k, v, rel_k, rel_v, *, q_positions=None, kv_positions=None,
                   causal: bool = False, scale=None, implementation=None):
    """Multi-head attention with Shaw et al. relative keys and values.

    Args:
      q: ``[B, Tq, N, H]``; k, v: ``[B, Tk, N_kv, H]``.
      rel_k, rel_v: ``[2K + 1, H]`` tables (row ``r + K`` is offset ``r``), shared by
        every head as in the paper.

    Returns ``[B, Tq, N, H]``. A thin wrapper over :func:`jaxpos.attention` with
    ``position=Shaw(rel_k, rel_v)``.
    """
    from jaxpos.attention import attention
    from jaxpos.schemes import Shaw

    return attention(q, k, v, position=Shaw(rel_k, rel_v), q_positions=q_positions,
                     kv_positions=kv_positions, causal=causal, scale=scale,
                     implementation=implementation)
