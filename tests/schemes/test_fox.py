"""FoX (Lin et al. 2025): the forget-gate bias against float64 NumPy written from the
paper's multiplicative form ``o_i = sum_j F_ij exp(q_i.k_j) v_j / sum_j F_ij exp(q_i.k_j)``
with ``F_ij`` an explicit product of gates, constant gates as ALiBi, the score_mod on
tiles, attention in every implementation, gradients to the gates and to a gate
projection, and bad input."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _scheme_checks import IMPLS, assert_impl_agrees, attn, qkv, tile_bias
from jax.test_util import check_grads

import jaxpos
from jaxpos.schemes.base import get_scheme
from jaxpos.schemes.fox import FoX, forget_gate, fox_bias, fox_cumulative

B, T, N, H = 2, 12, 4, 8


def gates(seed=0, B=B, T=T, N=N):
    """Log forget gates ``log sigmoid(logit)``, float32 ``[B, T, N]``."""
    logit = 2.0 * jax.random.normal(jax.random.PRNGKey(seed), (B, T, N)) + 1.0
    return jax.nn.log_sigmoid(logit)


def np_decay(log_forget, q_pos, kv_pos):
    """``F_ij = prod_{l=j+1}^{i} f_l`` for ``j <= i`` (0 otherwise), as an explicit product
    of the gates ``f = exp(log_forget)``: float64 ``[B, N, Tq, Tk]``."""
    f = np.exp(np.asarray(log_forget, np.float64))  # [B, T, N]
    Bf, _, Nf = f.shape
    out = np.zeros((Bf, Nf, len(q_pos), len(kv_pos)))
    for a, i in enumerate(q_pos):
        for b, j in enumerate(kv_pos):
            if j <= i:
                out[:, :, a, b] = np.prod(f[:, j + 1:i + 1, :], axis=1)
    return out


def np_fox_attention(q, k, v, log_forget):
    """Lin et al. 2025, §2: ``o_i = sum_j F_ij e^{q_i.k_j / sqrt(d)} v_j / sum_j F_ij
    e^{q_i.k_j / sqrt(d)}`` in float64 (causal through ``F_ij = 0`` for ``j > i``)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bqnh,bknh->bnqk", q, k) / math.sqrt(q.shape[-1])
    pos = np.arange(q.shape[1])
    w = np_decay(log_forget, pos, pos) * np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bnqk,bknh->bqnh", w / w.sum(-1, keepdims=True), v)


def test_bias_is_the_log_of_the_gate_product():
    lf = gates(1)
    q, kv = np.array([0, 3, 7, 11]), np.arange(12)
    d = np.asarray(fox_bias(lf, q, kv))
    assert d.shape == (B, N, 4, 12) and d.dtype == np.float32
    visible = kv[None, :] <= q[:, None]
    want = np.log(np.where(visible, np_decay(lf, q, kv), 1.0))
    np.testing.assert_allclose(np.where(visible, d, 0), np.where(visible, want, 0), atol=2e-5)
    c = np.asarray(fox_cumulative(lf))
    np.testing.assert_allclose(c, np.cumsum(np.swapaxes(np.asarray(lf, np.float64), 1, 2), -1),
                               atol=2e-5)


def test_the_first_gate_never_matters():
    # F_ij multiplies the gates after j: gate 0 enters no D_ij with j >= 0.
    lf = gates(2)
    pos = np.arange(T)
    a = fox_bias(lf, pos, pos)
    b = fox_bias(lf.at[:, 0].set(-30.0), pos, pos)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=3e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_constant_gates_are_alibi(impl):
    # f = 1/2 everywhere: D_ij = -(i - j) log 2, ALiBi (Press et al. 2022) with slope log 2.
    q, k, v = qkv(3, B=B, T=T, N=N, H=H)
    lf = jnp.full((1, T, N), math.log(0.5), jnp.float32)
    fox = attn(impl, q, k, v, position=FoX(lf), causal=True)
    alibi = attn(impl, q, k, v, position=jaxpos.ALiBi(slopes=jnp.full(N, math.log(2.0))),
                 causal=True)
    np.testing.assert_allclose(np.asarray(fox), np.asarray(alibi), atol=2e-5)


def test_score_mod_on_a_tile_equals_float64():
    lf = gates(4)
    q_pos = np.array([[3, 4, 5, 6, 7], [7, 8, 9, 10, 11]])
    kv_pos = np.array([[0, 1, 2, 3, 4, 5, 6], [5, 6, 7, 8, 9, 10, 11]])
    got = np.asarray(tile_bias(FoX(lf), q_pos, kv_pos, B=B, N=N))
    for b in range(B):
        vis = kv_pos[b][None, :] <= q_pos[b][:, None]
        want = np.log(np.where(vis, np_decay(lf[b:b + 1], q_pos[b], kv_pos[b])[0], 1.0))
        np.testing.assert_allclose(np.where(vis, got[b], 0), np.where(vis, want, 0), atol=2e-5)


def test_registered():
    assert get_scheme("fox") is FoX


@pytest.mark.parametrize("impl", IMPLS)
def test_attention_matches_float64(impl):
    q, k, v = qkv(5, B=B, T=T, N=N, H=H, Nk=2)
    lf = gates(5)
    out = attn(impl, q, k, v, position=FoX(lf), causal=True)
    np.testing.assert_allclose(np.asarray(out), np_fox_attention(q, k, v, lf), atol=3e-5)


@pytest.mark.parametrize("impl", IMPLS[1:])  # each compares with the reference
def test_implementations_agree_forward_and_gradients(impl):
    q, k, v = qkv(6, B=B, T=T, N=N, H=H)
    assert_impl_agrees(impl, FoX, gates(6), q, k, v, causal=True)


def test_gradient_reaches_the_gate_projection():
    # log f = log_sigmoid(x @ w + b) (the authors' full forget gate), then FoX: the
    # gradient with respect to w and b matches finite differences.
    q, k, v = qkv(7, B=1, T=7, N=2, H=H)
    x = jax.random.normal(jax.random.PRNGKey(8), (1, 7, 6))
    w = 0.5 * jax.random.normal(jax.random.PRNGKey(9), (6, 2))
    b = jnp.array([1.0, -0.5])

    def loss(w, b):
        scheme = FoX(forget_gate(x, w, b))
        return jnp.sum(attn("chunked", q, k, v, position=scheme, causal=True) * v)

    check_grads(jax.jit(loss), (w, b), order=1, modes=["rev"], eps=1e-2, atol=1e-2, rtol=1e-2)
    lf = np.asarray(forget_gate(x, w, b), np.float64)
    logit = np.einsum("btd,dn->btn", np.asarray(x, np.float64), np.asarray(w, np.float64)) + \
        np.asarray(b, np.float64)
    np.testing.assert_allclose(lf, -np.log1p(np.exp(-logit)), atol=1e-6)


def test_broadcast_gates_and_decoding_positions():
    # B = 1 gates serve every row; a query block at the end of the sequence (decoding)
    # indexes the gates by its positions.
    q, k, v = qkv(10, B=B, T=T, N=N, H=H)
    lf = gates(10, B=1)
    full = jaxpos.attention(q, k, v, position=FoX(lf), causal=True,
                            implementation="reference")
    last = jaxpos.attention(q[:, -3:], k, v, position=FoX(lf), causal=True,
                            q_positions=jnp.arange(T - 3, T), implementation="chunked",
                            block_q=8, block_k=8)
    np.testing.assert_allclose(np.asarray(last), np.asarray(full[:, -3:]), atol=2e-5)


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_traced_positions_outside_the_gates_give_nan_rows_not_clamped_gates(impl):
    # Under jit a query at position 14 of 12 gates (or a key at -1) cannot raise; its row is
    # NaN (the overflow rule) instead of reading the last gate's c; the other rows exact.
    q, k, v = qkv(11, B=1, T=T, N=N, H=H)
    lf = gates(11, B=1)
    qpos = jnp.array([[3, 14, 11]])
    kvpos = jnp.arange(T)
    f = jax.jit(lambda qp, kp: jaxpos.attention(q[:, :3], k, v, position=FoX(lf), causal=True,
                                                q_positions=qp, kv_positions=kp,
                                                implementation=impl))
    out = np.asarray(f(qpos, kvpos))
    assert np.isnan(out[0, 1]).all()
    want = np.asarray(jaxpos.attention(q[:, :3], k, v, position=FoX(lf), causal=True,
                                       q_positions=np.array([3, 11, 11]),
                                       implementation="reference"))
    np.testing.assert_allclose(out[0, [0, 2]], want[0, [0, 2]], atol=2e-5)
    out = np.asarray(f(jnp.array([[3, 5, 11]]), kvpos.at[0].set(-1)))  # key 0 visible to all
    assert np.isnan(out).all()


def test_bad_input():
    lf = gates(0)
    q, k, v = qkv(0, B=B, T=T, N=N, H=H)
    with pytest.raises(ValueError, match="needs causal=True"):
        jaxpos.attention(q, k, v, position=FoX(lf))
    with pytest.raises(ValueError, match=r"log_forget must have rank 3.*\(12, 4\)"):
        FoX(lf[0])
    with pytest.raises(TypeError, match="log_forget must be a floating-point array"):
        FoX(np.zeros((B, T, N), np.int32))
    with pytest.raises(ValueError, match=r"log_forget must have shape \[B, T, 2\]"):
        jaxpos.attention(q[:, :, :2], k[:, :, :2], v[:, :, :2], position=FoX(lf), causal=True)
    with pytest.raises(ValueError, match="log_forget has batch 2; the attention call has batch 3"):
        q3 = jnp.concatenate([q, q[:1]])
        jaxpos.attention(q3, q3, q3, position=FoX(lf), causal=True)
    with pytest.raises(ValueError, match=r"kv_positions must lie in \[0, T\) = \[0, 12\).*12"):
        jaxpos.attention(q, k, v, position=FoX(lf), causal=True,
                         q_positions=jnp.arange(0, 12), kv_positions=jnp.arange(1, 13))
    with pytest.raises(ValueError, match=r"q_positions must lie in \[0, T\)"):
        fox_bias(lf, np.array([-1, 0]), np.arange(3))
    with pytest.raises(ValueError, match="forget_gate needs x"):
        forget_gate(jnp.ones((1, 3, 5)), jnp.ones((6, 2)), jnp.ones(2))


def test_module_hooks_gates_from_the_layer_input_placed_at_their_positions():
    # from_params: log f = log_sigmoid(x @ w + b) from the layer input (Lin et al. 2025, §2);
    # the authors' initialisation w ~ N(0, 0.02^2), b = 0; each token's gate sits at its
    # position and padding (a negative position) gives none; packed positions are refused
    # (the gates are indexed by token position), and so is a bare cache (no gates kept).
    params = FoX.init_params(jax.random.PRNGKey(0), num_heads=N, d_model=6)
    assert params["w"].shape == (6, N) and float(jnp.std(params["w"])) < 0.05
    np.testing.assert_array_equal(np.asarray(params["b"]), 0.0)
    x = jax.random.normal(jax.random.PRNGKey(1), (1, 5, 6))
    lf = np.asarray(forget_gate(x, **params))
    s = FoX.from_params(params, x=x, positions=jnp.arange(5)[None])
    np.testing.assert_allclose(np.asarray(s.log_forget), lf)
    padded = FoX.from_params(params, x=x, positions=jnp.array([[-1, -1, 0, 1, 2]]))
    np.testing.assert_allclose(np.asarray(padded.log_forget)[0],
                               np.concatenate([lf[0, 2:], np.zeros((2, N))]))
    with pytest.raises(ValueError, match=r"tokens must sit at positions 0 .. n-1"):
        FoX.from_params(params, x=x, positions=jnp.array([[0, 1, 0, 1, 2]]))
    with pytest.raises(ValueError, match="layer's input"):
        FoX.from_params(params, x=None)
    with pytest.raises(ValueError, match="init_cache, not a bare KVCache"):
        s.cache_write(None, None, None)


def test_scheme_bias_through_score_mod_is_the_log_of_the_gate_product():
    lf = gates(3)
    q, kv = np.array([0, 3, 7, 11]), np.arange(12)
    d = np.asarray(FoX(lf).bias(q, kv))
    assert d.shape == (B, N, 4, 12) and d.dtype == np.float32  # the gates' batch
    visible = kv[None, :] <= q[:, None]
    want = np.log(np.where(visible, np_decay(lf, q, kv), 1.0))
    np.testing.assert_allclose(np.where(visible, d, 0), np.where(visible, want, 0), atol=2e-5)


def test_packed_segments_use_arange_positions_and_restarting_positions_raise():
    # Packing two sequences in one row: with arange positions and segment_ids each segment
    # gets the output it gets alone (c_i - c_j sums only the gates between two tokens of
    # a segment); positions restarting per segment would read the first segment's gates
    # for the second, so concrete non-rising positions are refused.
    q, k, v = qkv(B=1, T=8, N=2, H=H)
    lf = gates(3, B=1, T=8, N=2)
    seg = jnp.asarray([[1, 1, 1, 1, 2, 2, 2, 2]])
    packed = jaxpos.attention(q, k, v, position=FoX(lf), causal=True, segment_ids=seg,
                              kv_segment_ids=seg)
    for s in (slice(0, 4), slice(4, 8)):
        alone = jaxpos.attention(q[:, s], k[:, s], v[:, s], position=FoX(lf[:, s]),
                                 causal=True)
        np.testing.assert_allclose(packed[:, s], alone, rtol=1e-5, atol=1e-6)
    # the modules give hidden padding the row's largest visible position: accepted
    for pos, seg_pad, s in (([0, 1, 2, 3, 3, 3, 3, 3], [1, 1, 1, 1, 0, 0, 0, 0], slice(0, 4)),
                            ([7, 7, 7, 7, 4, 5, 6, 7], [0, 0, 0, 0, 1, 1, 1, 1], slice(4, 8))):
        pads = jaxpos.attention(q, k, v, position=FoX(lf), causal=True,
                                q_positions=jnp.asarray([pos]), kv_positions=jnp.asarray([pos]),
                                segment_ids=jnp.asarray([seg_pad]))
        np.testing.assert_allclose(pads[:, s], packed[:, s], rtol=1e-5, atol=1e-6)
    restart = jnp.asarray([[0, 1, 2, 3, 0, 1, 2, 3]])
    with pytest.raises(ValueError, match=r"q_positions must not decrease.*segment_ids"):
        jaxpos.attention(q, k, v, position=FoX(lf), causal=True, q_positions=restart,
                         kv_positions=restart, segment_ids=seg, kv_segment_ids=seg)
