"""The documented contract of :func:`jaxpos.attention` (``docs/attention.md``) as one
float64 computation, written from the definitions and not from jaxpos.

The same code runs on NumPy (``xp=np``: the forward values) and on ``jax.numpy`` under
``jax.enable_x64`` (``xp=jnp``: the same float64 computation, differentiated by JAX for
the reference gradients). Per batch ``b``, query head ``h`` (key/value head
``h // (N / N_kv)``), query ``i`` and key ``j``::

    q, k      <- the scheme's per-token transform (RoPE, xPos) at the positions
    s[i, j]   = scale * q_i . k_j + scheme_bias(q_pos_i, kv_pos_j)[h]   (scheme's term first)
    s[i, j]   = score_mod(s[i, j], b, h, q_pos_i, kv_pos_j)            (the user's term)
    visible   = (not causal or kv_pos_j <= q_pos_i) and seg_i == kv_seg_j
                and mask_mod(b, h, q_pos_i, kv_pos_j) and s[i, j] != -inf
    out_i     = sum_j p_ij v_j,  p_ij = exp(s_ij) / (exp(sink_h) + sum_{visible j'} exp(s_ij'))
                over visible j; a row with no visible key (and a sink of -inf, or none)
                returns 0, with zero gradient.

Segment ids are ordinary integers: only equal ids attend, and id 0 is a segment like
any other (no id is reserved for padding). NaN: a NaN/inf in q, k, v or a NaN score of a
visible pair makes that row non-finite (the reference computes it that way; the suite
only asserts it for the rows that see the bad key).

Schemes (float64, from the papers):

* RoPE, ``rotate_half`` layout: Su et al. 2024, §3.4.2.
* ALiBi: Press et al. 2022, §3, ``slopes[h] * (kv_pos - q_pos)`` (``-slopes[h] |kv_pos -
  q_pos|`` with ``params["bidirectional"]``).
* T5: Raffel et al. 2020, §2.1 and Mesh TensorFlow's ``_relative_position_bucket``.
* Shaw et al. 2018, §3 (Eqs. 3-4): ``e = q.(k + a_K[r]) * scale``,
  ``z = sum p (v + a_V[r])``, ``r = clip(kv - q, -K, K)``.
* KERPLE (log): Chi et al. 2022, §3.2, ``-r1[h] * log(1 + r2[h] |q_pos - kv_pos|)``.
* xPos: Sun et al. 2022, §3: RoPE whose pair ``i`` of ``q_m . k_n`` is multiplied by
  ``zeta_i ** ((m - n) / scale_base)``, ``zeta_i = (2i/d + 0.4) / 1.4``.
* FIRE: Li et al. 2023, §3, ``MLP(log(|c (i - j)| + 1) / (log(|c max(L, i)| + 1) + eps))``.

This is the one dense reference attention of the tests: ``tests/_attention_reference.py``,
``tests/_scheme_checks.py`` and ``tests/attention/test_programmable.py`` call it with their
own argument names (a dense ``mask``, an additive ``bias``, precomputed ``scores``).
"""

from __future__ import annotations

import numpy as np

# --------------------------------------------------------------------------- schemes
#: Scheme names the reference knows (``tests/conformance/_conformance_cases.py`` builds
#: the matching jaxpos objects).
REFERENCE_SCHEMES = ("none", "rope", "alibi", "t5", "kerple", "xpos", "fire", "shaw")


def np_t5_bucket(rel, bidirectional, num_buckets=32, max_distance=128):
    """T5's bucket of ``rel = kv_pos - q_pos`` (Raffel et al. 2020, §2.1; Mesh
    TensorFlow's ``_relative_position_bucket``), int64."""
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


def _rotate_half(x, pos, inv_freq, xp):
    """x ``[B, T, N, H]``, pos ``[B, T]``: rotate the first ``2 * len(inv_freq)``
    features (GPT-NeoX pairing, feature ``i`` with ``i + d/2``)."""
    half = inv_freq.shape[0]
    ang = pos[..., None].astype(np.float64) * inv_freq  # [B, T, half]
    c, s = xp.cos(ang)[:, :, None, :], xp.sin(ang)[:, :, None, :]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return xp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, rest], axis=-1)


def _shaw_index(params, qp, kp):
    """Shaw's table row ``clip(kv_pos - q_pos, -K, K) + K`` ``[B, Tq, Tk]``."""
    K = (params["rel_k"].shape[0] - 1) // 2
    return np.clip(_rel(qp, kp)[:, 0], -K, K) + K


def _rel(qp, kp):
    """``kv_pos - q_pos`` ``[B, 1, Tq, Tk]`` (int64 NumPy; positions are never traced)."""
    return (kp[:, None, :] - qp[:, :, None])[:, None].astype(np.int64)


def scheme_scores(name: str, params: dict, q, k, qp, kp, scale, xp):
    """float64 ``[B, N, Tq, Tk]``: ``scale * q . k`` after the scheme's transform plus
    the scheme's bias. ``q`` ``[B, Tq, N, H]``, ``k`` ``[B, Tk, N, H]`` (heads already
    repeated for GQA), positions int64 NumPy ``[B, T]``."""
    if name in ("rope", "xpos"):
        inv_freq = params["inv_freq"]
        q = _rotate_half(q, qp, inv_freq, xp)
        k = _rotate_half(k, kp, inv_freq, xp)
    if name == "xpos":
        half = inv_freq.shape[0]
        d = 2 * half
        zeta = (np.arange(0, d, 2) / d + 0.4) / 1.4  # [half]
        dist = -_rel(qp, kp)[..., None].astype(np.float64)  # m - n, [B, 1, Tq, Tk, 1]
        factor = zeta ** (dist / params["scale_base"])  # [B, 1, Tq, Tk, half]
        pair = lambda a, b: xp.einsum("bqnh,bknh->bnqkh", a, b)
        s = pair(q[..., :half], k[..., :half]) + pair(q[..., half:d], k[..., half:d])
        s = xp.sum(s * factor, axis=-1)
        s = s + xp.einsum("bqnh,bknh->bnqk", q[..., d:], k[..., d:])
        return s * scale
    s = xp.einsum("bqnh,bknh->bnqk", q, k) * scale
    rel = _rel(qp, kp)
    if name == "alibi":
        r = -np.abs(rel) if params.get("bidirectional", False) else rel
        s = s + params["slopes"][None, :, None, None] * r
    elif name == "t5":
        bucket = np_t5_bucket(rel[:, 0], params["bidirectional"])  # [B, Tq, Tk]
        s = s + xp.moveaxis(params["table"][bucket], -1, 1)
    elif name == "kerple":
        dist = np.abs(rel).astype(np.float64)
        r1 = params["r1"][None, :, None, None]
        r2 = params["r2"][None, :, None, None]
        s = s - r1 * xp.log1p(r2 * dist)
    elif name == "fire":
        i = qp[:, None, :, None].astype(np.float64)
        dist = (-rel).astype(np.float64)
        c = xp.abs(params["c"])
        L = xp.abs(params["L_multiplier"] * params["init_L"])
        x = xp.log1p(xp.abs(c * dist)) / (xp.log1p(xp.abs(c * xp.maximum(i, L))) + 1e-6)
        hidden = xp.maximum(x[..., None] * params["w1"] + params["b1"], 0.0)  # [B,1,Tq,Tk,W]
        bias = xp.einsum("bxqkw,wn->bnqk", hidden, params["w2"])
        s = s + bias + params["b2"][None, :, None, None]
    elif name == "shaw":
        idx = _shaw_index(params, qp, kp)
        s = s + xp.einsum("bqnh,bqkh->bnqk", q * scale, params["rel_k"][idx])
    elif name == "fox":  # Lin et al. 2025, §2: c_i - c_j, c the cumulative log forget gate
        c = xp.moveaxis(xp.cumsum(params["log_forget"], axis=1), -1, 1)  # [Bg, N, T]
        c = c[np.minimum(np.arange(qp.shape[0]), c.shape[0] - 1)]  # [B, N, T]
        at = lambda p: xp.take_along_axis(
            c, np.broadcast_to(p[:, None, :], (p.shape[0], c.shape[1], p.shape[1])), axis=2)
        s = s + at(qp)[..., :, None] - at(kp)[..., None, :]
    elif name not in ("none", "rope"):
        raise ValueError(f"unknown scheme {name!r}")
    return s


# ------------------------------------------------------------------------ the contract
def _positions(pos, B, T, default):
    p = default if pos is None else np.asarray(pos)
    return np.broadcast_to(p.reshape(-1, T), (B, T)).astype(np.int64)


def contract_attention(q, k, v, *, xp=np, scheme="none", params=None, score_mod=None,
                       mask_mod=None, causal=False, q_positions=None, kv_positions=None,
                       segment_ids=None, kv_segment_ids=None, sinks=None, scale=None,
                       stop_gradient=None, mask=None, bias=None, scores=None,
                       dtype=np.float64, finite_values=False):
    """float64 ``[B, Tq, N, H_v]`` of the contract (module docstring).

    ``mask``: bool, broadcastable to ``[B, N, Tq, Tk]`` (True = visible), and-ed with the
    other masks. ``bias``: float, broadcastable to ``[B, N, Tq, Tk]``, added after the
    scheme's term. ``scores``: ``[B, N, Tq, Tk]`` used in place of ``q . k`` (scheme
    ``"none"`` only; a transform of q and k computed by the caller), times ``scale``.
    ``dtype``: the computation's dtype (float64; ``tests/_kernel_dense.py`` runs the same
    code in float32 under ``jax.jit``). ``finite_values``: the caller promises finite
    ``v``, so the output is ``p @ v`` (no ``[B, N, Tq, Tk, H]`` masked copy of the values).

    ``score_mod(s, b, h, qp, kp)`` and ``mask_mod(b, h, qp, kp)`` are the reference's
    own broadcasting forms: ``s`` ``[B, N, Tq, Tk]``, ``b`` ``[B, 1, 1, 1]``, ``h``
    ``[1, N, 1, 1]``, ``qp`` ``[B, 1, Tq, 1]``, ``kp`` ``[B, 1, 1, Tk]`` (int64), ``xp``
    and ``stop_gradient`` as keywords. ``params``: the scheme's float64 arrays.
    """
    params = params or {}
    stop_gradient = stop_gradient or (lambda x: x)
    q, k, v = (xp.asarray(x, dtype) for x in (q, k, v))
    B, Tq, N, H = q.shape
    Tk, Nk = k.shape[1], k.shape[2]
    k = xp.repeat(k, N // Nk, axis=2)
    v = xp.repeat(v, N // Nk, axis=2)
    qp = _positions(q_positions, B, Tq, np.arange(Tq) + max(Tk - Tq, 0))
    kp = _positions(kv_positions, B, Tk, np.arange(Tk))
    scale = 1.0 / np.sqrt(H) if scale is None else scale
    if scores is None:
        s = scheme_scores(scheme, params, q, k, qp, kp, scale, xp)
    else:
        assert scheme == "none", "scores= replaces q.k of scheme 'none' only"
        s = xp.asarray(scores, dtype) * scale
    if bias is not None:
        s = s + xp.asarray(bias, dtype)
    b_idx = np.arange(B)[:, None, None, None]
    h_idx = np.arange(N)[None, :, None, None]
    qp4, kp4 = qp[:, None, :, None], kp[:, None, None, :]
    if score_mod is not None:
        s = score_mod(s, b_idx, h_idx, qp4, kp4, xp=xp, stop_gradient=stop_gradient)
    vis = np.ones((B, N, Tq, Tk), bool)
    if causal:
        vis = vis & (kp4 <= qp4)
    if segment_ids is not None:
        sk = segment_ids if kv_segment_ids is None else kv_segment_ids
        vis = vis & (np.asarray(segment_ids)[:, None, :, None] == np.asarray(sk)[:, None, None, :])
    if mask_mod is not None:
        vis = vis & np.broadcast_to(np.asarray(mask_mod(b_idx, h_idx, qp4, kp4)), vis.shape)
    vis = xp.asarray(vis) & (s != -np.inf)  # a score_mod's -inf hides the pair
    if mask is not None:
        vis = vis & xp.broadcast_to(xp.asarray(mask, bool), vis.shape)
    safe = xp.where(vis, s, 0.0)
    mx = xp.max(xp.where(vis, safe, -np.inf), axis=-1, keepdims=True)
    if sinks is not None:
        sk4 = xp.asarray(sinks, dtype)[None, :, None, None]
        mx = xp.maximum(mx, sk4)
    mx = stop_gradient(xp.where(xp.isfinite(mx), mx, 0.0))
    e = xp.where(vis, xp.exp(safe - mx), 0.0)
    den = xp.sum(e, axis=-1, keepdims=True)
    if sinks is not None:
        den = den + xp.exp(sk4 - mx)
    live = den > 0
    p = xp.where(live, e / xp.where(live, den, 1.0), 0.0)
    if finite_values:
        out = xp.einsum("bnqk,bknh->bqnh", p, v)
    else:  # hidden pairs contribute nothing, not 0 * v (a NaN value reaches only its viewers)
        vv = xp.where(vis[..., None], xp.swapaxes(v, 1, 2)[:, :, None], 0.0)  # [B,N,Tq,Tk,H]
        out = xp.einsum("bnqk,bnqkh->bqnh", p, vv)
    if scheme == "shaw":  # Shaw's value term: sum_j p_ij a_V[r_ij]
        out = out + xp.einsum("bnqk,bqkh->bqnh", p, params["rel_v"][_shaw_index(params, qp, kp)])
    return out


def visible_any(B, N, Tq, Tk, *, causal=False, q_positions=None, kv_positions=None,
                segment_ids=None, kv_segment_ids=None, mask_mod=None):
    """bool ``[B, N, Tq, Tk]``: the pairs the masks (not the scores) leave visible."""
    qp = _positions(q_positions, B, Tq, np.arange(Tq) + max(Tk - Tq, 0))
    kp = _positions(kv_positions, B, Tk, np.arange(Tk))
    qp4, kp4 = qp[:, None, :, None], kp[:, None, None, :]
    vis = np.ones((B, N, Tq, Tk), bool)
    if causal:
        vis &= kp4 <= qp4
    if segment_ids is not None:
        sk = segment_ids if kv_segment_ids is None else kv_segment_ids
        vis &= np.asarray(segment_ids)[:, None, :, None] == np.asarray(sk)[:, None, None, :]
    if mask_mod is not None:
        vis &= np.broadcast_to(np.asarray(mask_mod(np.arange(B)[:, None, None, None],
                                                   np.arange(N)[None, :, None, None],
                                                   qp4, kp4)), vis.shape)
    return vis
