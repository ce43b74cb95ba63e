"""Attention wrappers of single schemes: each builds the scheme from its tables and calls
:func:`jaxpos.attention` (the schemes' own modules never import the core).

* :func:`relative_bias_attention`: T5's bucketed relative bias (Raffel et al. 2020, §2.1);
* :func:`shaw_attention`: Shaw et al. 2018 relative keys and values;
* :func:`mla_attention`: DeepSeek-V2's multi-head latent attention with decoupled RoPE
  (DeepSeek-AI 2024, §2.1.3).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos.core.entry import attention
from jaxpos.schemes.base import PositionScheme
from jaxpos.schemes.mla import mla_qk
from jaxpos.schemes.shaw import Shaw, check_shaw_table
from jaxpos.schemes.t5 import T5Bias, transposed_hint

__all__ = ["mla_attention", "relative_bias_attention", "shaw_attention"]


def relative_bias_attention(Q: ArrayLike, K: ArrayLike, V: ArrayLike, bias_table: ArrayLike, *,
                            scale: float = 1.0, causal: bool = False) -> jax.Array:
    """Attention with the T5 bucketed bias in one call, bidirectional by default.

    ``softmax(scale * Q K^T + bias) V`` per head with ``bias[h, i, j] =
    bias_table[t5_bucket(j - i), h]`` (Raffel et al. 2020, §2.1), positions ``arange(T)``.

    Args:
      Q, K, V: float ``[..., T, N, H]`` (any leading axes, flattened into a batch).
      bias_table: float ``[num_buckets, N]`` (the T5 checkpoint layout, 32 buckets);
        ``max_distance`` is T5's 128.
      scale: score scale; T5 uses 1.0 (no ``1/sqrt(H)``), the default here.
      causal: use the causal (decoder) buckets and mask.

    Returns:
      ``[..., T, N, H]`` in Q's dtype (softmax in float32).

    Raises:
      ValueError: ``Q`` of rank < 3, ``bias_table`` not ``[num_buckets, N]``, an odd
        ``num_buckets`` when bidirectional, or shapes :func:`jaxpos.attention` rejects.
      TypeError: integer ``Q``, ``K`` or ``V``.
    """
    Q = jnp.asarray(Q)
    K = jnp.asarray(K)
    V = jnp.asarray(V)
    if Q.ndim < 3:
        raise ValueError(f"Q must have shape [..., T, N, H] (rank >= 3); got shape {Q.shape}.")
    _checks.check_rank("bias_table", bias_table, (2,), "[num_buckets, num_heads]")
    if _checks.shape_of(bias_table)[1] != Q.shape[-2]:
        raise ValueError(
            f"bias_table must have shape [num_buckets, N] = [num_buckets, {Q.shape[-2]}] (one "
            f"column per head of Q {Q.shape}); got shape {_checks.shape_of(bias_table)}."
            f"{transposed_hint(_checks.shape_of(bias_table), num_heads=Q.shape[-2])}"
        )
    lead = Q.shape[:-3]
    flat = lambda x: x.reshape((-1,) + x.shape[-3:])
    out = attention(
        flat(Q), flat(K), flat(V),
        position=T5Bias(bias_table, bidirectional=not causal,
                        num_buckets=_checks.shape_of(bias_table)[0]),
        causal=causal, scale=scale, implementation="reference",
    )
    return out.reshape(lead + out.shape[1:])


def shaw_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, rel_k: ArrayLike,
                   rel_v: ArrayLike | None, *, q_positions: ArrayLike | None = None,
                   kv_positions: ArrayLike | None = None, causal: bool = False,
                   scale: ArrayLike | None = None, implementation: str | None = None,
                   block_q: int | None = None, block_k: int | None = None) -> jax.Array:
    """Multi-head attention with Shaw et al. relative keys and values (Shaw et al. 2018, §3).

    ``e_mn = scale * q_m . (k_n + a_K[r])``, ``z_m = sum_n softmax(e)_mn (v_n + a_V[r])``
    with ``r = clip(n - m, -K, K)``, computed in the efficient form of §3.3.

    Args:
      q: float ``[B, Tq, N, H]``; k, v: float ``[B, Tk, N_kv, H]``.
      rel_k, rel_v: float ``[2K + 1, H]`` tables (row ``r + K`` is offset ``r``), shared
        by every head as in the paper; ``rel_v`` may be ``None`` (keys only).
      q_positions, kv_positions: integer ``[T]`` or ``[B, T]`` (default ``arange``).
      causal, scale, implementation, block_q, block_k: as :func:`jaxpos.attention`
        (``scale`` defaults to ``1/sqrt(H)``, as in the paper).

    Returns:
      ``[B, Tq, N, H]`` in q's dtype. A thin wrapper over :func:`jaxpos.attention` with
      ``position=Shaw(rel_k, rel_v)``.

    Raises:
      ValueError: a table without ``2K + 1`` rows of width ``H``, ``rel_v`` of another
        shape than ``rel_k``, positions whose shape does not match the sequence, and
        everything :func:`jaxpos.attention` rejects.
      TypeError: non-floating tables, float positions.
    """
    if rel_v is not None:
        check_shaw_table("rel_v", rel_v)
    return attention(q, k, v, position=Shaw(rel_k, rel_v), q_positions=q_positions,
                     kv_positions=kv_positions, causal=causal, scale=scale,
                     implementation=implementation, block_q=block_q, block_k=block_k)


def mla_attention(q_nope: jax.Array, q_rope: jax.Array, k_nope: jax.Array, k_rope: jax.Array,
                  v: jax.Array, *, rope: PositionScheme | None, scale: ArrayLike | None = None,
                  **attention_kwargs: Any) -> jax.Array:
    """Decoupled-RoPE multi-head latent attention (DeepSeek-V2 §2.1.3) on
    :func:`jaxpos.attention`.

    ``softmax(scale * [q_nope; R q_rope] . [k_nope; R k_rope]) v`` per head, ``R`` the
    rotation of ``rope`` at each token's position, ``k_rope`` shared by all heads.

    Args:
      q_nope, q_rope, k_nope, k_rope: as in :func:`jaxpos.schemes.mla.mla_qk` (unrotated).
      v: ``[B, Tk, N, Dv]``; ``Dv`` (``v_head_dim``) may differ from ``Dn + Dr``.
      rope: a :class:`jaxpos.RoPE` with ``rotary_dim == Dr`` (e.g.
        ``jaxpos.interop.hf.rope_from_hf_config(deepseek_config)``), or ``None`` for no rotation.
      scale: the softmax scale; default ``(Dn + Dr) ** -0.5``. With YaRN's
        ``mscale_all_dim`` pass :func:`jaxpos.schemes.mla.mla_softmax_scale`
        (``rope_parameters=...``).
      **attention_kwargs: passed to :func:`jaxpos.attention` (``q_positions``,
        ``kv_positions``, ``causal``, ``segment_ids``, ``kv_segment_ids``, ``mask_mod``,
        ``implementation``, ``block_q``, ``block_k``, ...).

    Returns:
      ``[B, Tq, N, Dv]``.

    Raises:
      TypeError: ``rope`` not a RoPE scheme or None; ``position`` given in
        ``attention_kwargs`` (the rope is the position).
      ValueError: ``rope.rotary_dim != Dr``; the errors of :func:`jaxpos.schemes.mla.mla_qk` and
        :func:`jaxpos.attention`.
    """
    if "position" in attention_kwargs:
        raise TypeError("mla_attention takes its position scheme as rope=; got position= too.")
    rotary_dim = getattr(rope, "rotary_dim", None)
    if rope is not None and not (isinstance(rope, PositionScheme) and isinstance(rotary_dim, int)):
        raise TypeError(f"rope must be a jaxpos.RoPE (rotary on the rope part of each head) "
                        f"or None; got {type(rope).__name__}.")
    dr = _checks.shape_of(q_rope)[-1] if _checks.shape_of(q_rope) else None
    if rope is not None and rotary_dim != dr:
        raise ValueError(f"rope.rotary_dim must equal qk_rope_head_dim = q_rope's width {dr} "
                         f"(only the rope part rotates); got rotary_dim={rotary_dim}.")
    q, k = mla_qk(q_nope, q_rope, k_nope, k_rope)
    return attention(q, k, v, position=rope, scale=scale, **attention_kwargs)
