"""PoPE (Gopalakrishnan et al. 2025, §3): the frequencies written out, the real features'
dot product against the paper's complex score ``Re[conj(q~) k~]`` in float64, attention in
every implementation (grouped-query heads, the clamped phase bias), translation
invariance, gradients with respect to q, k, v and the phase bias against float64 finite
differences, and bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _scheme_checks import attn, qkv, shifted_outputs

import jaxpos
from jaxpos.schemes.pope import PoPE, apply_pope, clamp_phase_bias, pope_frequencies

IMPLS = ["reference", "chunked", pytest.param("pallas", marks=pytest.mark.slow)]


def np_softplus(x):
    return np.logaddexp(0.0, x)


def np_pope_scores(q, k, q_pos, kv_pos, theta, delta=None):
    """float64 ``a_ts = Re[sum_c conj(q~_tc) k~_sc]`` with ``q~ = softplus(q) e^{i t theta}``
    and ``k~ = softplus(k) e^{i (s theta + delta)}`` (the paper's key-side bias, clamped to
    [-2 pi, 0]); ``[B, N, Tq, Tk]``, k's heads repeated to q's."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    k = np.repeat(k, q.shape[2] // k.shape[2], axis=2)
    theta = np.asarray(theta, np.float64)
    qp = np.asarray(q_pos, np.float64)[..., :, None]
    kp = np.asarray(kv_pos, np.float64)[..., :, None]
    qc = np_softplus(q) * np.exp(1j * qp[..., None, :] * theta)
    kphase = kp[..., None, :] * theta
    if delta is not None:
        kphase = kphase + np.clip(np.asarray(delta, np.float64), -2 * np.pi, 0)
    kc = np_softplus(k) * np.exp(1j * kphase)
    return np.einsum("bqnh,bknh->bnqk", np.conj(qc), kc).real


def np_pope_attention(q, k, v, theta, delta=None, *, pos):
    H = q.shape[-1]
    s = np_pope_scores(q, k, pos, pos, theta, delta) / np.sqrt(H)
    s = np.where(np.asarray(pos)[:, None] >= np.asarray(pos)[None, :], s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    v = np.repeat(np.asarray(v, np.float64), q.shape[2] // v.shape[2], axis=2)
    return np.einsum("bnqk,bknh->bqnh", w, v)


# Phase biases inside and outside [-2 pi, 0] (the latter clamp).
DELTA = np.linspace(-8.0, 1.0, 4 * 8).reshape(4, 8).astype(np.float32)


def test_frequencies_written_out():
    # theta_c = base^(-c/d), one per feature: d = 4, base 10^4 -> 1, 0.1, 0.01, 0.001.
    np.testing.assert_allclose(pope_frequencies(4), [1.0, 0.1, 0.01, 0.001], rtol=1e-6)


def test_clamp_written_out():
    d = jnp.array([-7.0, -2 * np.pi, -1.0, 0.0, 0.5])
    np.testing.assert_allclose(np.asarray(clamp_phase_bias(d)),
                               [-2 * np.pi, -2 * np.pi, -1.0, 0.0, 0.0], rtol=1e-7)
    g = jax.grad(lambda x: jnp.sum(clamp_phase_bias(x)))(d)
    np.testing.assert_array_equal(np.asarray(g), [0, 1, 1, 1, 0])


def test_features_give_the_complex_score():
    q, k, _ = qkv(0, B=2, T=5, N=4, H=8, Tk=7)
    qp = np.array([[0, 3, 4, 9, 20], [5, 6, 7, 8, 9]])
    kp = np.array([[0, 1, 2, 3, 4, 5, 6], [1, 3, 5, 7, 9, 11, 13]])
    theta = pope_frequencies(8)
    fq = apply_pope(q, qp, theta, phase_bias=clamp_phase_bias(DELTA))
    fk = apply_pope(k, kp, theta)
    assert fq.shape == (2, 5, 4, 16) and fq.dtype == jnp.float32
    got = np.einsum("bqnh,bknh->bnqk", np.asarray(fq, np.float64), np.asarray(fk, np.float64))
    np.testing.assert_allclose(got, np_pope_scores(q, k, qp, kp, theta, DELTA), atol=2e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_attention_matches_float64(impl):
    q, k, v = qkv(1, B=2, T=11, N=4, H=8, Nk=2)
    out = attn(impl, q, k, v, position=PoPE(8, phase_bias=DELTA), causal=True)
    assert out.shape == (2, 11, 4, 8)
    ref = np_pope_attention(q, k, v, pope_frequencies(8), DELTA, pos=np.arange(11))
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_translation_invariance(impl):
    q, k, v = qkv(2, B=1, T=9, N=4, H=8)
    a, b = shifted_outputs(PoPE(8, phase_bias=DELTA), q, k, v, 37, impl=impl)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("impl", ["reference", pytest.param("chunked", marks=pytest.mark.slow),
                                  pytest.param("pallas", marks=pytest.mark.slow)])
def test_gradients_match_float64_finite_differences(impl):
    q, k, v = qkv(3, B=1, T=8, N=4, H=8)
    theta = pope_frequencies(8)
    delta = np.linspace(-5.0, -0.5, 32).reshape(4, 8).astype(np.float32)  # inside the range
    w = np.asarray(jax.random.normal(jax.random.PRNGKey(9), (1, 8, 4, 8)), np.float64)

    def loss64(q, k, v, d):
        return float(np.sum(w * np_pope_attention(q, k, v, theta, d, pos=np.arange(8))))

    def loss(q, k, v, d):
        return jnp.sum(jnp.asarray(w, jnp.float32) *
                       attn(impl, q, k, v, position=PoPE(8, phase_bias=d), causal=True))

    g = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, jnp.asarray(delta))
    args = [np.asarray(x, np.float64) for x in (q, k, v, delta)]
    eps = 1e-6
    rng = np.random.default_rng(0)
    for i, name in enumerate(("q", "k", "v", "phase_bias")):
        d = rng.standard_normal(args[i].shape)  # a directional derivative per argument
        hi, lo = list(args), list(args)
        hi[i] = args[i] + eps * d
        lo[i] = args[i] - eps * d
        fd = (loss64(*hi) - loss64(*lo)) / (2 * eps)
        got = float(np.sum(np.asarray(g[i], np.float64) * d))
        assert abs(got - fd) <= 1e-4 * max(1.0, abs(fd)), (name, got, fd)


def test_without_bias_and_registered():
    assert jaxpos.get_scheme("pope") is PoPE
    q, k, v = qkv(4, B=1, T=6, N=4, H=8)
    out = attn("reference", q, k, v, position=PoPE(8), causal=True)
    ref = np_pope_attention(q, k, v, pope_frequencies(8), None, pos=np.arange(6))
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=2e-5)


def test_bad_input():
    with pytest.raises(ValueError, match="head_dim"):
        PoPE()
    with pytest.raises(ValueError, match="does not match"):
        PoPE(8, inv_freq=np.ones(4, np.float32))
    with pytest.raises(TypeError, match="phase_bias"):
        PoPE(8, phase_bias=np.zeros((4, 8), np.int32))
    q, k, v = qkv(5, B=1, T=4, N=4, H=8)
    with pytest.raises(ValueError, match="frequencies"):
        jaxpos.attention(q, k, v, position=PoPE(16))
    with pytest.raises(ValueError, match=r"phase_bias must have shape \[4, 8\]"):
        jaxpos.attention(q, k, v, position=PoPE(8, phase_bias=np.zeros((2, 8), np.float32)))
    with pytest.raises(ValueError, match="inv_freq"):
        apply_pope(q, np.arange(4), np.ones(3, np.float32))


# Positions far from the origin: a float32 ``pos * theta`` is off by up to pos * 6e-8 rad
# there (9e-5 relative in the outputs at 1e5, 2e-3 at 1e6); PoPE's phases are reduced
# exactly, as RoPE's angles.
FAR = [123_457, 987_651]


def _max_rel(got, ref):
    return float(np.max(np.abs(np.asarray(got, np.float64) - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("offset", FAR)
def test_features_far_from_the_origin_match_float64(offset):
    x, _, _ = qkv(5, B=1, T=6, N=4, H=8)
    pos = np.arange(6) * 1009 + offset
    theta = pope_frequencies(8)
    got = apply_pope(x, pos, theta, phase_bias=clamp_phase_bias(DELTA))
    phase = pos[None, :, None, None] * theta.astype(np.float64) - np.clip(DELTA, -2 * np.pi, 0)
    mu = np_softplus(np.asarray(x, np.float64))
    ref = np.concatenate([mu * np.cos(phase), mu * np.sin(phase)], axis=-1)
    assert _max_rel(got, ref) <= 2e-5


@pytest.mark.parametrize("impl", ["reference", "chunked"])
@pytest.mark.parametrize("offset", FAR)
def test_attention_far_from_the_origin_matches_float64(impl, offset):
    q, k, v = qkv(6, B=1, T=9, N=4, H=8, Nk=2)
    pos = np.arange(9) * 977 + offset
    out = attn(impl, q, k, v, position=PoPE(8, phase_bias=DELTA), causal=True,
               q_positions=pos, kv_positions=pos)
    ref = np_pope_attention(q, k, v, pope_frequencies(8), DELTA, pos=pos)
    assert _max_rel(out, ref) <= 2e-5


def test_gradients_far_from_the_origin_match_float64():
    q, k, v = qkv(7, B=1, T=6, N=4, H=8)
    pos = np.arange(6) * 1013 + FAR[1]
    theta = pope_frequencies(8)
    delta = np.linspace(-5.0, -0.5, 32).reshape(4, 8).astype(np.float32)
    w = np.asarray(jax.random.normal(jax.random.PRNGKey(3), (1, 6, 4, 8)), np.float64)

    def loss64(q, k, d):
        return float(np.sum(w * np_pope_attention(q, k, v, theta, d, pos=pos)))

    def loss(q, k, d):
        return jnp.sum(jnp.asarray(w, jnp.float32) * attn(
            "reference", q, k, v, position=PoPE(8, phase_bias=d), causal=True,
            q_positions=pos, kv_positions=pos))

    g = jax.grad(loss, argnums=(0, 1, 2))(q, k, jnp.asarray(delta))
    args = [np.asarray(x, np.float64) for x in (q, k, delta)]
    eps = 1e-6
    for i, name in enumerate(("q", "k", "phase_bias")):
        fd = np.zeros(args[i].size)
        for j in range(args[i].size):  # every entry: the relative error of the gradient
            hi, lo = list(args), list(args)
            hi[i] = args[i].copy()
            lo[i] = args[i].copy()
            hi[i].flat[j] += eps
            lo[i].flat[j] -= eps
            fd[j] = (loss64(*hi) - loss64(*lo)) / (2 * eps)
        got = np.asarray(g[i], np.float64).ravel()
        assert np.max(np.abs(got - fd)) <= 2e-5 * np.max(np.abs(fd)) + 1e-7, name
