"""Scalable-Softmax (Nakanishi 2025, Eq. 2): attention in every implementation against a
float64 NumPy attention written from ``softmax((s log n) z)``, with packed segments,
non-causal ``num_keys``, gradients with respect to q, k, v and s against float64 finite
differences, and bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _scheme_checks import attn, qkv

import jaxpos
from jaxpos.schemes.ssmax import SSMax, ssmax_multiplier

S = np.array([0.3, 0.9, 1.6, -0.2], np.float32)
# The kernel in interpret mode is the slowest path on CPU: its cases run in the slow run.
IMPLS = ["reference", "chunked", pytest.param("pallas", marks=pytest.mark.slow)]


def np_ssmax_attention(q, k, v, s, *, q_pos, kv_pos, causal=True, seg_q=None, seg_kv=None,
                       num_keys=None):
    """float64 ``softmax((s_h log n_i) * q_i.k_j / sqrt(H)) v`` over the visible keys;
    ``n_i = q_pos + 1`` (causal) or ``num_keys[b]``."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, Tq, N, H = q.shape
    g = N // k.shape[2]
    k, v = np.repeat(k, g, 2), np.repeat(v, g, 2)
    z = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(H)
    qp = np.broadcast_to(np.asarray(q_pos), (B, Tq))
    kp = np.broadcast_to(np.asarray(kv_pos), (B, k.shape[1]))
    n = qp + 1.0 if num_keys is None else np.broadcast_to(
        np.asarray(num_keys, np.float64).reshape(-1, 1), (B, Tq))
    z = z * np.asarray(s, np.float64)[None, :, None, None] * np.log(n)[:, None, :, None]
    vis = np.ones(z.shape, bool)
    if causal:
        vis &= kp[:, None, None, :] <= qp[:, None, :, None]
    if seg_q is not None:
        vis &= np.asarray(seg_q)[:, None, :, None] == np.asarray(seg_kv)[:, None, None, :]
    z = np.where(vis, z, -np.inf)
    w = np.exp(z - z.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("bnqk,bknh->bqnh", w, v)


def test_multiplier_written_out():
    # s log n: 0 for one key, s log 2 for two, and 0.43 log 10 = 0.990 (Figure 1's s).
    m = ssmax_multiplier(np.array([1, 2, 10]), np.array([0.43], np.float32))
    np.testing.assert_allclose(np.asarray(m)[0], [0.0, 0.43 * np.log(2), 0.43 * np.log(10)],
                               rtol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_causal_attention_matches_float64(impl):
    q, k, v = qkv(0, B=2, T=13, N=4, H=8, Nk=2)
    pos = np.arange(13)
    out = attn(impl, q, k, v, position=SSMax(S), causal=True)
    ref = np_ssmax_attention(q, k, v, S, q_pos=pos, kv_pos=pos)
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_packed_segments_count_keys_within_their_segment(impl):
    # Two sequences packed in one row: positions restart at 0, so n = 1, 2, ... again.
    q, k, v = qkv(1, B=1, T=11, N=4, H=8)
    seg = np.array([[0] * 5 + [1] * 6])
    pos = np.array([list(range(5)) + list(range(6))])
    out = attn(impl, q, k, v, position=SSMax(S), causal=True, q_positions=pos,
               kv_positions=pos, segment_ids=seg)
    ref = np_ssmax_attention(q, k, v, S, q_pos=pos, kv_pos=pos, seg_q=seg, seg_kv=seg)
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_non_causal_uses_num_keys_per_row(impl):
    q, k, v = qkv(2, B=2, T=9, N=4, H=8)
    nk = np.array([9, 5], np.int32)
    seg = (np.arange(9)[None] < nk[:, None]).astype(np.int32)  # row 1: 4 pads (id 0)
    out = attn(impl, q, k, v, position=SSMax(S, num_keys=nk), segment_ids=seg)
    ref = np_ssmax_attention(q, k, v, S, q_pos=np.arange(9), kv_pos=np.arange(9),
                             causal=False, seg_q=seg, seg_kv=seg, num_keys=nk)
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", ["reference", pytest.param("chunked", marks=pytest.mark.slow),
                                  pytest.param("pallas", marks=pytest.mark.slow)])
def test_gradients_match_float64_finite_differences(impl):
    q, k, v = qkv(3, B=1, T=10, N=4, H=8)
    pos = np.arange(10)
    w = np.asarray(jax.random.normal(jax.random.PRNGKey(9), (1, 10, 4, 8)), np.float64)

    def loss64(q, k, v, s):
        return float(np.sum(w * np_ssmax_attention(q, k, v, s, q_pos=pos, kv_pos=pos)))

    def loss(q, k, v, s):
        return jnp.sum(jnp.asarray(w, jnp.float32) *
                       attn(impl, q, k, v, position=SSMax(s), causal=True))

    g = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, jnp.asarray(S))
    args = [np.asarray(x, np.float64) for x in (q, k, v, S)]
    eps = 1e-6
    rng = np.random.default_rng(0)
    for i, name in enumerate("qkvs"):
        d = rng.standard_normal(args[i].shape)  # a directional derivative per argument
        hi = list(args)
        lo = list(args)
        hi[i] = args[i] + eps * d
        lo[i] = args[i] - eps * d
        fd = (loss64(*hi) - loss64(*lo)) / (2 * eps)
        got = float(np.sum(np.asarray(g[i], np.float64) * d))
        assert abs(got - fd) <= 1e-4 * max(1.0, abs(fd)), (name, got, fd)


def test_scheme_is_registered_and_jit_traceable():
    assert jaxpos.get_scheme("ssmax") is SSMax
    q, k, v = qkv(4, B=1, T=6, N=4, H=8)
    f = jax.jit(lambda s: jaxpos.attention(q, k, v, position=SSMax(s), causal=True))
    np.testing.assert_allclose(np.asarray(f(jnp.asarray(S))),
                               np.asarray(jaxpos.attention(q, k, v, position=SSMax(S),
                                                           causal=True)), atol=1e-6)


def test_bad_input():
    with pytest.raises(TypeError, match="s"):
        SSMax(np.array([1, 2]))
    with pytest.raises(ValueError, match="num_heads"):
        SSMax(np.ones((2, 2), np.float32))
    with pytest.raises(ValueError, match="num_keys must be >= 1"):
        SSMax(S, num_keys=np.array([3, 0]))
    with pytest.raises(TypeError, match="num_keys"):
        SSMax(S, num_keys=np.array([3.0]))
    q, k, v = qkv(5, B=1, T=4, N=4, H=8)
    with pytest.raises(ValueError, match="non-causal call needs num_keys"):
        jaxpos.attention(q, k, v, position=SSMax(S))
    with pytest.raises(ValueError, match=r"shape \[2\]"):
        jaxpos.attention(q[:, :, :2], k[:, :, :2], v[:, :, :2], position=SSMax(S),
                         causal=True)


def test_bias_is_refused_for_a_scaling_and_for_transform_only_schemes():
    # SSMax multiplies the score: no added term to show as an array; RoPE / NoPE act
    # through transform_qk only.
    for scheme in (SSMax(np.ones(2, np.float32)), jaxpos.RoPE(rotary_dim=4), jaxpos.NoPE()):
        with pytest.raises(TypeError, match="bias"):
            scheme.bias(np.arange(3), np.arange(3))


# ---- n is the number of keys in the query's softmax (Nakanishi 2025, Eq. 2), masks included
def np_ssmax_counted(q, k, v, s, vis, n=None):
    """float64 SSMax attention over the bool visibility ``vis`` ``[B, Tq, Tk]``, with
    ``n_i = sum_j vis_ij`` counted from it (the paper's n, whatever hides the keys), or the
    given ``n`` ``[B, Tq]``."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, 2), np.repeat(v, g, 2)
    z = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(q.shape[-1])
    n = np.maximum(vis.sum(-1) if n is None else n, 1).astype(np.float64)  # [B, Tq]
    z = z * np.asarray(s, np.float64)[None, :, None, None] * np.log(n)[:, None, :, None]
    z = np.where(vis[:, None], z, -np.inf)
    w = np.exp(z - z.max(-1, keepdims=True))
    return np.einsum("bnqk,bknh->bqnh", w / w.sum(-1, keepdims=True), v)


def _rel(out, ref):
    return float(np.max(np.abs(np.asarray(out, np.float64) - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_sliding_window_counts_the_window(impl):
    T = 64
    q, k, v = qkv(11, B=1, T=T, N=4, H=8, Nk=2)
    q = q * 3.0  # sharp scores: the count's log(n) matters
    pos = np.arange(T)
    vis = (pos[None, :, None] >= pos[None, None, :]) & (pos[None, :, None] - pos[None, None, :] < 4)
    out = attn(impl, q, k, v, position=SSMax(S), causal=True,
               mask_mod=jaxpos.SlidingWindowMask(4))
    ref = np_ssmax_counted(q, k, v, S, vis)
    assert _rel(out, ref) <= 2e-5
    # control: n = q_pos + 1 under the same window (the count that ignores it) is far off
    # at position 63
    stale = np_ssmax_counted(q, k, v, S, vis, n=pos[None] + 1)
    assert _rel(stale[:, 63], ref[:, 63]) > 0.05


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_chunked_mask_counts_the_chunk(impl):
    T = 13
    q, k, v = qkv(12, B=2, T=T, N=4, H=8)
    pos = np.arange(T)
    vis = (pos[:, None] >= pos[None, :]) & (pos[:, None] // 5 == pos[None, :] // 5)
    out = attn(impl, q, k, v, position=SSMax(S), causal=True,
               mask_mod=jaxpos.ChunkedAttentionMask(5))
    ref = np_ssmax_counted(q, k, v, S, np.broadcast_to(vis, (2, T, T)))
    assert _rel(out, ref) <= 2e-5


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_kv_lengths_hide_slots_and_n_follows_positions(impl):
    # a decode step against a cache of 16 slots: row 0 filled to 13, row 1 to 7
    q, k, v = qkv(13, B=2, T=1, N=4, H=8, Tk=16)
    lens = np.array([13, 7])
    q_pos = np.array([[12], [12]])
    vis = (np.arange(16)[None, None, :] < lens[:, None, None]) & \
        (np.arange(16)[None, None, :] <= q_pos[:, :, None])
    out = jaxpos.attention(q, k, v, position=SSMax(S), causal=True, q_positions=q_pos,
                           kv_positions=np.arange(16), kv_lengths=lens, implementation=impl)
    # n = q_pos + 1 = 13 on both rows: the count a full pass over these positions uses
    assert _rel(out, np_ssmax_counted(q, k, v, S, vis, n=q_pos + 1)) <= 2e-5


def test_masks_whose_count_is_unknown_are_refused():
    q, k, v = qkv(14, B=1, T=6, N=4, H=8)
    with pytest.raises(ValueError, match="SSMax counts the keys"):
        jaxpos.attention(q, k, v, position=SSMax(S), causal=True,
                         mask_mod=lambda b, h, qp, kp: (qp - kp) % 2 == 0)
    with pytest.raises(ValueError, match="SSMax counts the keys"):
        jaxpos.attention(q, k, v, position=SSMax(S), causal=True,
                         mask=np.tril(np.ones((6, 6), bool)))
    with pytest.raises(ValueError, match="SSMax counts the keys"):
        jaxpos.attention(q, k, v, position=SSMax(S, num_keys=6), causal=False,
                         mask_mod=jaxpos.PrefixLMMask(2))


def test_flax_adapter_mask_counts_the_keys_it_leaves():
    # Flax's causal mask combined with padding (row 1's first two keys are pads): n is the
    # number of keys the mask leaves each query, pads excluded.
    nnx = pytest.importorskip("flax.nnx")
    q, k, v = qkv(15, B=2, T=6, N=4, H=8)
    pad = np.array([[1] * 6, [0, 0, 1, 1, 1, 1]], np.float32)
    mask = nnx.combine_masks(nnx.make_causal_mask(jnp.ones((2, 6))),
                             nnx.make_attention_mask(jnp.ones((2, 6)), pad))
    out = jaxpos.flax_attention_fn(SSMax(S))(q, k, v, mask=mask)
    vis = np.asarray(mask[:, 0] != 0)
    rows = vis.any(-1)  # row 1's pad queries see nothing: compare the real rows
    ref = np_ssmax_counted(q, k, v, S, vis | ~rows[..., None])
    np.testing.assert_allclose(np.asarray(out)[rows], ref[rows], atol=2e-5, rtol=2e-5)
