"""xPos (Sun et al. 2022): per-token transforms and scores against float64 complex
arithmetic written from the paper (pair ``i`` of a vector as the complex number
``x_i + i x_{i + d/2}``, rotated by ``e^{i n theta_i}`` and scaled by
``zeta_i^(n / scale_base)``), attention in every implementation, shift invariance at
large positions, layouts, gradients, and bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _scheme_checks import IMPLS, assert_impl_agrees, attn, dense64, qkv, shifted_outputs
from jax.test_util import check_grads

import jaxpos
from jaxpos.schemes.base import get_scheme
from jaxpos.schemes.rope import interleaved_to_half
from jaxpos.schemes.xpos import XPos, apply_xpos, xpos_scale, xpos_zeta

SB = 16.0  # a small scale_base, so the decay is visible over a few positions


def np_theta(d, base=10000.0):
    return base ** (-np.arange(0, d, 2) / d)


def np_zeta(d, gamma=0.4):
    """Sun et al. 2022, §3: ``zeta_i = (i / (d/2) + gamma) / (1 + gamma)``."""
    return (np.arange(d // 2) / (d / 2) + gamma) / (1 + gamma)


def complex_pairs(x):
    """``[..., d]`` (half layout) -> complex ``[..., d/2]``."""
    x = np.asarray(x, np.float64)
    h = x.shape[-1] // 2
    return x[..., :h] + 1j * x[..., h:]


def np_xpos_scores(q, k, q_pos, kv_pos, scale_base=SB):
    """``Re sum_i q_i conj(k_i) e^{i (m - n) theta_i} zeta_i^((m - n) / scale_base)``:
    float64 ``[B, N, Tq, Tk]`` (k repeated over query groups)."""
    d = q.shape[-1]
    g = q.shape[2] // k.shape[2]
    qc, kc = complex_pairs(q), complex_pairs(np.repeat(np.asarray(k), g, axis=2))
    rel = np.asarray(q_pos, np.float64)[..., :, None] - np.asarray(kv_pos, np.float64)[..., None, :]
    rel = np.broadcast_to(rel, (q.shape[0],) + rel.shape[-2:])
    phase = np.exp(1j * rel[..., None] * np_theta(d)) * np_zeta(d) ** (rel[..., None] / scale_base)
    return np.real(np.einsum("bqni,bkni,bqki->bnqk", qc, np.conj(kc), phase))


def test_zeta_written_out():
    # torchscale: (arange(0, d, 2) + 0.4 d) / (1.4 d); d = 8: (0, 2, 4, 6) + 3.2 over 11.2
    np.testing.assert_allclose(xpos_zeta(8), np.array([3.2, 5.2, 7.2, 9.2]) / 11.2, rtol=1e-7)
    np.testing.assert_allclose(xpos_zeta(64), np_zeta(64), rtol=1e-7)
    s = np.asarray(xpos_scale(np.array([0, 512, -1024]), 8))
    np.testing.assert_allclose(s, np_zeta(8)[None, :] ** np.array([0, 1, -2])[:, None], rtol=2e-6)


@pytest.mark.parametrize("downscale", [False, True])
def test_apply_xpos_is_a_scaled_complex_rotation(downscale):
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 3, 8))
    pos = np.array([[0, 1, 2, 3, 4], [7, 20, 21, 40, 41]])
    got = apply_xpos(x, pos, jnp.asarray(np_theta(8), jnp.float32), scale_base=SB,
                     downscale=downscale, scale_offset=3)
    sign = -1 if downscale else 1
    e = (pos - 3)[..., None, None] / SB
    want = complex_pairs(x) * np.exp(1j * pos[..., None, None] * np_theta(8)) * \
        np_zeta(8) ** (sign * e)
    np.testing.assert_allclose(complex_pairs(got), want, rtol=2e-5, atol=2e-6)


def test_partial_rotary_passes_the_rest_through():
    x = jax.random.normal(jax.random.PRNGKey(1), (1, 4, 2, 12))
    got = apply_xpos(x, np.arange(4), jnp.asarray(np_theta(8), jnp.float32), scale_base=SB)
    np.testing.assert_array_equal(np.asarray(got[..., 8:]), np.asarray(x[..., 8:]))


def test_scores_equal_float64_at_any_offset():
    q, k, _ = qkv(2, B=2, T=6, Tk=9, N=4, H=8, Nk=2)
    s = XPos(8, scale_base=SB)
    qp = np.array([[3, 4, 5, 6, 7, 8], [103, 104, 105, 106, 107, 108]])
    kp = np.array([np.arange(9), np.arange(100, 109)])
    a, b = s.transform_qk(q, k, jnp.asarray(qp), jnp.asarray(kp))
    got = np.einsum("bqnh,bknh->bnqk", np.asarray(a, np.float64),
                    np.repeat(np.asarray(b, np.float64), 2, axis=2))
    want = np_xpos_scores(q, k, qp, kp)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_decay_with_distance():
    # q = k with every pair (1, 0): the score of a key d positions back is
    # sum_i cos(d theta_i) zeta_i^(d / scale_base), bounded by sum_i zeta_i^(d / scale_base),
    # which decays with d (RoPE's bound stays d/2 at every distance).
    H, T = 8, 40
    x = jnp.zeros((1, T, 1, H)).at[..., : H // 2].set(1.0)
    pos = jnp.arange(T)[None]
    a, b = XPos(H, scale_base=SB).transform_qk(x, x, pos, pos)
    last = np.asarray(jnp.einsum("h,th->t", a[0, -1, 0], b[0, :, 0]), np.float64)
    d = T - 1 - np.arange(T)
    envelope = (np_zeta(H) ** (d[:, None] / SB)).sum(-1)
    want = (np.cos(d[:, None] * np_theta(H)) * np_zeta(H) ** (d[:, None] / SB)).sum(-1)
    np.testing.assert_allclose(last, want, rtol=1e-5, atol=1e-5)
    assert np.all(np.abs(last) <= envelope + 1e-5)
    assert envelope[-1] == pytest.approx(H / 2) and envelope[0] < 0.3 * H / 2


def test_registered():
    assert get_scheme("xpos") is XPos
    s = XPos(16)
    assert s.rotary_dim == 16 and s.scale_base == 512.0 and s.inv_freq.shape == (8,)


@pytest.mark.parametrize("impl", IMPLS)
def test_attention_matches_float64(impl):
    q, k, v = qkv(3, T=13, N=4, H=8, Nk=2)
    out = attn(impl, q, k, v, position=XPos(8, scale_base=SB), causal=True)
    pos = np.arange(13)
    want = dense64(q, k, v, causal=True, scores=np_xpos_scores(q, k, pos, pos))
    np.testing.assert_allclose(np.asarray(out), want, atol=3e-5)


@pytest.mark.parametrize("impl", IMPLS[1:])  # each compares with the reference
def test_implementations_agree_forward_and_gradients(impl):
    q, k, v = qkv(4, T=12, N=4, H=8)
    make = lambda p: XPos(inv_freq=p, scale_base=SB)
    assert_impl_agrees(impl, make, jnp.asarray(np_theta(8), jnp.float32), q, k, v, causal=True)


def test_translation_invariant_far_from_zero():
    # Scores depend on m - n only. Centring the exponents at the call's positions keeps
    # the factors near 1 even at position 10**6, where zeta_0^(10**6 / 16) underflows.
    q, k, v = qkv(5, T=6, Tk=10, N=4, H=8)
    a, b = shifted_outputs(XPos(8, scale_base=SB), q, k, v, shift=1_000_000)
    assert np.all(np.isfinite(np.asarray(b)))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-4)


def test_interleaved_layout_equals_half_on_permuted_features():
    q, k, v = qkv(6, T=8, N=2, H=8)
    out_i = jaxpos.attention(q, k, v, position=XPos(8, layout="interleaved", scale_base=SB),
                             causal=True, implementation="reference")
    perm = lambda x: interleaved_to_half(x, head_dim=8)
    out_h = jaxpos.attention(perm(q), perm(k), v, position=XPos(8, scale_base=SB), causal=True,
                             implementation="reference")
    np.testing.assert_allclose(np.asarray(out_i), np.asarray(out_h), atol=1e-6)


def test_gradient_matches_finite_differences():
    q, k, v = qkv(7, B=1, T=7, N=2, H=8)

    def loss(q, k):
        return jnp.sum(attn("chunked", q, k, v, position=XPos(8, scale_base=SB), causal=True)
                       * v)

    check_grads(jax.jit(loss), (q, k), order=1, modes=["rev"], eps=1e-2, atol=1e-2, rtol=1e-2)


def test_bad_input():
    with pytest.raises(ValueError, match=r"rotary_dim must be even.*got 7"):
        XPos(7)
    with pytest.raises(ValueError, match="needs rotary_dim"):
        XPos()
    with pytest.raises(ValueError, match="rotary_dim=8 does not match inv_freq of length 2"):
        XPos(8, inv_freq=np.ones(2, np.float32))
    with pytest.raises(ValueError, match="gamma must be a finite number > 0"):
        XPos(8, gamma=0.0)
    with pytest.raises(ValueError, match="scale_base must be a finite number > 0"):
        XPos(8, scale_base=-512)
    with pytest.raises(ValueError, match="layout must be one of"):
        XPos(8, layout="pairs")
    with pytest.raises(TypeError, match="positions must hold integer"):
        apply_xpos(jnp.ones((1, 3, 1, 8)), np.arange(3.0), np_theta(8).astype(np.float32))
    with pytest.raises(TypeError, match="scale_offset must hold integer"):
        apply_xpos(jnp.ones((1, 3, 1, 8)), np.arange(3), np_theta(8).astype(np.float32),
                   scale_offset=0.5)
    q, k, v = qkv(0, H=8)
    with pytest.raises(ValueError, match="rotary_dim must be <= head_dim=8; got 16"):
        jaxpos.attention(q, k, v, position=XPos(16))
