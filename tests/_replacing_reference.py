"""float64 NumPy references of the schemes that replace softmax attention's scores, written
from the papers: PaTH (Yang et al. 2025, arXiv:2505.16381, Eq. 2, the Householder
products formed as matrices; PaTH-FoX's gate, §3.3, scaled with the logit as the authors'
``naive_path_attn``) and CoPE (Golovneva et al. 2024, arXiv:2405.18719, Eqs. 3-5, as the
authors' ``ContextPosSelfAttn``: gates of the scaled logits, reverse cumulative sum over
the visible keys, clamp at ``npos - 1``, interpolation, the position logit scaled with
the logit). Loops over every query, key and head: for tiny inputs only."""

from __future__ import annotations

import numpy as np


def path_inputs(seed, B=2, T=7, N=4, Nk=2, H=4, Hv=3):
    """Random PaTH inputs as float32 NumPy arrays ``(q, k, v, w, beta, log_forget)``: ``w``
    unit rows, ``beta = 2 sigmoid(normal)``, ``log_forget = -0.3 |normal|``."""
    r = np.random.default_rng(seed)
    q = r.standard_normal((B, T, N, H))
    k = r.standard_normal((B, T, Nk, H))
    v = r.standard_normal((B, T, Nk, Hv))
    w = r.standard_normal((B, T, Nk, H))
    w /= np.linalg.norm(w, axis=-1, keepdims=True)
    beta = 2.0 / (1.0 + np.exp(-r.standard_normal((B, T, Nk))))
    log_forget = -0.3 * np.abs(r.standard_normal((B, T, N)))
    return tuple(np.asarray(x, np.float32) for x in (q, k, v, w, beta, log_forget))


def _softmax_out(s, v):
    if not np.isfinite(s).any():
        return np.zeros(v.shape[-1])
    w = np.exp(s - s.max())
    return (w / w.sum()) @ v


def np_path(q, k, v, w, beta, log_forget=None, seg=None, scale=None):
    """``[B, T, N, Hv]``: causal self-attention, ``softmax_j(scale * (q_i^T H_i ... H_{j+1}
    k_j + c_i - c_j)) v_j`` over ``j <= i`` of ``i``'s segment, ``c = cumsum(log_forget)``."""
    q, k, v, w, beta = (np.asarray(x, np.float64) for x in (q, k, v, w, beta))
    B, T, N, H = q.shape
    g = N // k.shape[2]
    scale = H ** -0.5 if scale is None else scale
    c = np.zeros((B, T, N)) if log_forget is None else np.cumsum(log_forget, 1)
    seg = np.zeros((B, T), int) if seg is None else np.asarray(seg)
    out = np.zeros((B, T, N, v.shape[-1]))
    for b in range(B):
        for n in range(N):
            h = n // g
            for i in range(T):
                s = np.full(T, -np.inf)
                for j in range(i + 1):
                    if seg[b, j] != seg[b, i]:
                        continue
                    P = np.eye(H)
                    for t in range(j + 1, i + 1):
                        P = (np.eye(H) - beta[b, t, h] * np.outer(w[b, t, h], w[b, t, h])) @ P
                    s[j] = scale * (q[b, i, n] @ P @ k[b, j, h] + c[b, i, n] - c[b, j, n])
                out[b, i, n] = _softmax_out(s, v[b, :, h])
    return out


def np_cope(q, k, v, E, *, q_positions=None, kv_positions=None, segment_ids=None,
            kv_segment_ids=None, scale=None):
    """``[B, Tq, N, Hv]``: CoPE attention; ``E`` ``[H, npos]``; a key is visible to a query
    of its segment at a position ``>=`` its own; positions default to ``arange`` with the
    queries aligned to the end of the keys."""
    q, k, v, E = (np.asarray(x, np.float64) for x in (q, k, v, E))
    B, Tq, N, H = q.shape
    Tk = k.shape[1]
    g = N // k.shape[2]
    scale = H ** -0.5 if scale is None else scale
    npos = E.shape[-1]
    qp = np.arange(Tq) + Tk - Tq if q_positions is None else q_positions
    kp = np.arange(Tk) if kv_positions is None else kv_positions
    qp, kp = np.broadcast_to(qp, (B, Tq)), np.broadcast_to(kp, (B, Tk))
    kv_segment_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
    qs = np.zeros((B, Tq), int) if segment_ids is None else np.asarray(segment_ids)
    ks = np.zeros((B, Tk), int) if kv_segment_ids is None else np.asarray(kv_segment_ids)
    out = np.zeros((B, Tq, N, v.shape[-1]))
    for b in range(B):
        for n in range(N):
            h = n // g
            for i in range(Tq):
                vis = (kp[b] <= qp[b, i]) & (ks[b] == qs[b, i])
                raw = k[b, :, h] @ q[b, i, n]
                gate = np.where(vis, 1 / (1 + np.exp(-scale * raw)), 0.0)
                p = np.minimum(np.cumsum(gate[::-1])[::-1], npos - 1)
                lo, hi = np.floor(p).astype(int), np.ceil(p).astype(int)
                logit = q[b, i, n] @ E
                e = logit[lo] * (1 - (p - lo)) + logit[hi] * (p - lo)
                out[b, i, n] = _softmax_out(np.where(vis, scale * (raw + e), -np.inf),
                                            v[b, :, h])
    return out
