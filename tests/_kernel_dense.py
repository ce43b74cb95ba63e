"""The kernel tests' dense attention: the tests' one dense reference
(``tests/_contract_reference.py``) run in float32 with ``jax.numpy`` (differentiable and
jittable, float32 dots at HIGHEST precision, set in ``tests/conftest.py``), taking
:func:`jaxpos.attention`'s score_mod / mask_mod forms:

    s[b, h, i, j] = score_mod(scale * q_i . k_j, b, h, q_pos_i, kv_pos_j)
    visible(i, j) = (kv_pos_j <= q_pos_i if causal) & (seg_i == seg_j) & mask_mod(...)
    p[i, j]       = exp(s_ij) / (exp(sinks[h]) + sum_{visible j} exp(s_ij))  (visible j)
    out_i         = sum_j p_ij v_j          (zeros for a row with no visible key)

The score_mod / mask_mod are applied with ``jax.vmap`` over batch and head on the whole
``[Tq, Tk]`` matrix (FlexAttention's semantics, Dong et al. 2024); the sink is the
GPT-OSS attention sink (a per-head logit in the softmax denominator).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from _contract_reference import contract_attention


def dense_attention(q, k, v, *, q_positions, kv_positions, score_mod=None, mask_mod=None,
                    sinks=None, causal=False, segment_ids=None, kv_segment_ids=None,
                    scale=None):
    B, Tq, N, _ = q.shape
    Tk = k.shape[1]
    qp = jnp.broadcast_to(jnp.asarray(q_positions, jnp.int32).reshape(-1, Tq), (B, Tq))
    kp = jnp.broadcast_to(jnp.asarray(kv_positions, jnp.int32).reshape(-1, Tk), (B, Tk))
    bs, hs = jnp.arange(B, dtype=jnp.int32), jnp.arange(N, dtype=jnp.int32)
    mod = None
    if score_mod is not None:
        g = lambda s, b, h, qp, kp: score_mod(s, b, h, qp[:, None], kp[None, :])
        g = jax.vmap(jax.vmap(g, in_axes=(0, None, 0, None, None)),
                     in_axes=(0, 0, None, 0, 0))
        mod = lambda s, *_, **__: g(s, bs, hs, qp, kp)
    # The positions and segment ids may be traced: the visibility is computed here in
    # jax.numpy and passed as the reference's dense mask.
    mask = jnp.ones((B, N, Tq, Tk), bool)
    if causal:
        mask = mask & (kp[:, None, None, :] <= qp[:, None, :, None])
    if segment_ids is not None:
        kv_segment_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
        sq = jnp.broadcast_to(jnp.asarray(segment_ids).reshape(-1, Tq), (B, Tq))
        sk = jnp.broadcast_to(jnp.asarray(kv_segment_ids).reshape(-1, Tk), (B, Tk))
        mask = mask & (sq[:, None, :, None] == sk[:, None, None, :])
    if mask_mod is not None:
        f = lambda b, h, qp, kp: jnp.broadcast_to(mask_mod(b, h, qp[:, None], kp[None, :]),
                                                  (Tq, Tk))
        f = jax.vmap(jax.vmap(f, in_axes=(None, 0, None, None)), in_axes=(0, None, 0, 0))
        mask = mask & f(bs, hs, qp, kp)
    return contract_attention(
        q, k, v, xp=jnp, dtype=jnp.float32, finite_values=True, score_mod=mod, mask=mask,
        sinks=sinks, q_positions=np.arange(Tq), kv_positions=np.arange(Tk), scale=scale,
        stop_gradient=jax.lax.stop_gradient)
