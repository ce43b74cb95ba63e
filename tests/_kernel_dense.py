"""A plain-JAX dense attention written from the definitions, the reference of the kernel
tests: every score materialised, float32 at HIGHEST precision.

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


def dense_attention(q, k, v, *, q_positions, kv_positions, score_mod=None, mask_mod=None,
                    sinks=None, causal=False, segment_ids=None, kv_segment_ids=None,
                    scale=None):
    B, Tq, N, H = q.shape
    Tk, Nk = k.shape[1], k.shape[2]
    g = N // Nk
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    scale = 1.0 / H ** 0.5 if scale is None else scale
    qp = jnp.broadcast_to(jnp.asarray(q_positions, jnp.int32).reshape(-1, Tq), (B, Tq))
    kp = jnp.broadcast_to(jnp.asarray(kv_positions, jnp.int32).reshape(-1, Tk), (B, Tk))
    s = jnp.einsum("bqnh,bknh->bnqk", q, k, precision="highest") * scale
    bs, hs = jnp.arange(B, dtype=jnp.int32), jnp.arange(N, dtype=jnp.int32)
    if score_mod is not None:
        f = lambda s, b, h, qp, kp: score_mod(s, b, h, qp[:, None], kp[None, :])
        f = jax.vmap(f, in_axes=(0, None, 0, None, None))
        s = jax.vmap(f, in_axes=(0, 0, None, 0, 0))(s, bs, hs, qp, kp)
    vis = jnp.ones((B, N, Tq, Tk), bool)
    if causal:
        vis = vis & (kp[:, None, None, :] <= qp[:, None, :, None])
    if segment_ids is not None:
        sq = jnp.broadcast_to(jnp.asarray(segment_ids).reshape(-1, Tq), (B, Tq))
        sk = jnp.broadcast_to(jnp.asarray(kv_segment_ids).reshape(-1, Tk), (B, Tk))
        vis = vis & (sq[:, None, :, None] == sk[:, None, None, :])
    if mask_mod is not None:
        f = lambda b, h, qp, kp: jnp.broadcast_to(mask_mod(b, h, qp[:, None], kp[None, :]),
                                                  (Tq, Tk))
        f = jax.vmap(f, in_axes=(None, 0, None, None))
        vis = vis & jax.vmap(f, in_axes=(0, None, 0, 0))(bs, hs, qp, kp)
    s = jnp.where(vis, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    if sinks is not None:
        m = jnp.maximum(m, jnp.asarray(sinks, jnp.float32)[None, :, None, None])
    m = jax.lax.stop_gradient(jnp.where(jnp.isneginf(m), 0.0, m))
    e = jnp.where(vis, jnp.exp(s - m), 0.0)
    den = jnp.sum(e, axis=-1, keepdims=True)
    if sinks is not None:
        den = den + jnp.exp(jnp.asarray(sinks, jnp.float32)[None, :, None, None] - m)
    p = e / jnp.where(den == 0.0, 1.0, den)
    return jnp.einsum("bnqk,bknh->bqnh", p, v, precision="highest")
