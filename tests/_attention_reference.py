"""Float64 NumPy ground truth for :func:`jaxpos.attention`, written from the papers
(not from jaxpos), shared by the attention test files.

* RoPE, ``rotate_half`` layout: Su et al. 2024, §3.4.2 (GPT-NeoX/Llama pairing).
* ALiBi: Press et al. 2022, §3: ``slopes[h] * (kv_pos - q_pos)``, slopes ``2**(-8(h+1)/N)``.
* T5: Raffel et al. 2020, §2.1 and Mesh TensorFlow's ``_relative_position_bucket``.
* Shaw et al. 2018, §3 (Eqs. 3-4): ``e = q.(k + a_K[r]) * scale``,
  ``z = sum p (v + a_V[r])``, ``r = clip(kv - q, -K, K)``.
"""

from __future__ import annotations

import numpy as np

import jaxpos

SCHEMES = ("nope", "rope", "alibi", "t5", "shaw")


def np_alibi_slopes(n: int) -> np.ndarray:
    """Power-of-two head counts only (the test shapes use 4 heads)."""
    assert n & (n - 1) == 0
    return 2.0 ** (-8.0 * np.arange(1, n + 1) / n)


def np_t5_bucket(rel, bidirectional, num_buckets=32, max_distance=128):
    rel = np.asarray(rel, np.int64)
    n = num_buckets
    ret = np.zeros_like(rel)
    if bidirectional:
        n //= 2
        ret += (rel > 0) * n
        d = np.abs(rel)
    else:
        d = -np.minimum(rel, 0)
    max_exact = n // 2
    large = max_exact + np.floor(
        np.log(np.maximum(d, 1) / max_exact) / np.log(max_distance / max_exact) * (n - max_exact)
    ).astype(np.int64)
    large = np.minimum(large, n - 1)
    return ret + np.where(d < max_exact, d, large)


def np_rope_half(x, pos, inv_freq):
    """x ``[B, T, N, H]``, pos ``[B|1, T]``: rotate the first ``2 * len(inv_freq)`` features."""
    half = len(inv_freq)
    ang = pos[..., None].astype(np.float64) * inv_freq  # [B, T, half]
    c, s = np.cos(ang)[:, :, None, :], np.sin(ang)[:, :, None, :]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, rest], axis=-1)


def make_params(name: str, num_heads: int, head_dim: int, rng: np.random.Generator,
                bidirectional: bool = True) -> dict:
    """Random (but fixed-seed) scheme parameters, float64."""
    if name == "nope":
        return {}
    if name == "rope":
        rd = head_dim // 2 if head_dim >= 8 else head_dim  # partial rotation when it can
        return {"inv_freq": 10000.0 ** (-np.arange(0, rd, 2) / rd)}
    if name == "alibi":
        return {"slopes": np_alibi_slopes(num_heads), "bidirectional": bidirectional}
    if name == "t5":
        return {"table": rng.normal(size=(32, num_heads)), "bidirectional": bidirectional}
    if name == "shaw":
        return {"rel_k": 0.5 * rng.normal(size=(7, head_dim)),
                "rel_v": 0.5 * rng.normal(size=(7, head_dim))}
    raise ValueError(name)


def make_scheme(name: str, params: dict):
    f32 = lambda x: np.asarray(x, np.float32)
    if name == "nope":
        return jaxpos.NoPE()
    if name == "rope":
        return jaxpos.RoPE(f32(params["inv_freq"]))
    if name == "alibi":
        return jaxpos.ALiBi(slopes=f32(params["slopes"]), bidirectional=params["bidirectional"])
    if name == "t5":
        return jaxpos.T5Bias(f32(params["table"]), bidirectional=params["bidirectional"])
    if name == "shaw":
        return jaxpos.Shaw(f32(params["rel_k"]), f32(params["rel_v"]))
    raise ValueError(name)


def np_attention(q, k, v, *, name="nope", params=None, q_positions=None, kv_positions=None,
                 causal=False, mask=None, segment_ids=None, kv_segment_ids=None, scale=None):
    """float64 ``[B, Tq, N, H_v]``; a query row with no visible key gives zeros."""
    params = params or {}
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, Tq, N, H = q.shape
    Tk, Nk = k.shape[1], k.shape[2]
    k = np.repeat(k, N // Nk, axis=2)
    v = np.repeat(v, N // Nk, axis=2)
    qp = np.arange(Tq) + max(Tk - Tq, 0) if q_positions is None else np.asarray(q_positions)
    kp = np.arange(Tk) if kv_positions is None else np.asarray(kv_positions)
    qp = np.broadcast_to(qp.reshape(-1, Tq), (B, Tq)).astype(np.int64)
    kp = np.broadcast_to(kp.reshape(-1, Tk), (B, Tk)).astype(np.int64)
    if name == "rope":
        q = np_rope_half(q, qp, params["inv_freq"])
        k = np_rope_half(k, kp, params["inv_freq"])
    scale = 1.0 / np.sqrt(H) if scale is None else scale
    s = np.einsum("bqnh,bknh->bnqk", q, k) * scale
    rel = kp[:, None, :] - qp[:, :, None]  # [B, Tq, Tk], key - query
    if name == "alibi":
        r = -np.abs(rel) if params["bidirectional"] else rel
        s = s + params["slopes"][None, :, None, None] * r[:, None]
    if name == "t5":
        bucket = np_t5_bucket(rel, params["bidirectional"])
        s = s + np.moveaxis(params["table"][bucket], -1, 1)
    if name == "shaw":
        K = (params["rel_k"].shape[0] - 1) // 2
        idx = np.clip(rel, -K, K) + K
        s = s + np.einsum("bqnh,bqkh->bnqk", q * scale, params["rel_k"][idx])
    vis = np.ones((B, N, Tq, Tk), bool)
    if causal:
        vis &= (kp[:, None, :] <= qp[:, :, None])[:, None]
    if segment_ids is not None:
        sk = segment_ids if kv_segment_ids is None else kv_segment_ids
        vis &= (np.asarray(segment_ids)[:, :, None] == np.asarray(sk)[:, None, :])[:, None]
    if mask is not None:
        vis &= np.broadcast_to(np.asarray(mask), vis.shape)
    s = np.where(vis, s, -np.inf)
    mx = np.max(s, axis=-1, keepdims=True)
    p = np.where(vis, np.exp(s - np.where(np.isfinite(mx), mx, 0.0)), 0.0)
    den = p.sum(-1, keepdims=True)
    p = np.where(den > 0, p / np.where(den > 0, den, 1.0), 0.0)
    out = np.einsum("bnqk,bknh->bqnh", p, v)
    if name == "shaw":
        out = out + np.einsum("bnqk,bqkh->bqnh", p, params["rel_v"][idx])
    return out
