"""FIRE (Li et al. 2023): the bias against float64 NumPy written from the paper's formula
``MLP(psi(i - j) / psi(max(L, i)))``, its progressive interpolation, the score_mod on
tiles, attention in every implementation, where shift invariance holds and where it does
not, gradients, and bad input."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _scheme_checks import IMPLS, assert_impl_agrees, attn, dense64, qkv, shifted_outputs, tile_bias
from jax.test_util import check_grads

import jaxpos
from jaxpos.schemes.base import get_scheme
from jaxpos.schemes.fire import FIRE, fire_bias

N, W = 4, 32


def np_fire(q_pos, kv_pos, w1, b1, w2, b2, c, L, eps=1e-6):
    """Li et al. 2023: ``b(i, j) = MLP(psi(i - j) / psi(max(L, i)))``, ``psi(x) = log(|c x|
    + 1)`` (the authors' code takes the magnitude), MLP 1 -> W -> N with ReLU; float64
    ``[..., N, Tq, Tk]``."""
    i = np.asarray(q_pos, np.float64)[..., :, None]
    j = np.asarray(kv_pos, np.float64)[..., None, :]
    psi = lambda x: np.log(np.abs(c * x) + 1.0)
    x = psi(i - j) / (psi(np.maximum(L, i)) + eps)
    h = np.maximum(x[..., None] * np.asarray(w1, np.float64) + np.asarray(b1, np.float64), 0)
    out = h @ np.asarray(w2, np.float64) + np.asarray(b2, np.float64)
    return np.moveaxis(out, -1, -3)


def params(seed=0):
    s = FIRE.init(N, key=jax.random.PRNGKey(seed), init_c=0.3, init_L=9.0)
    return s


def np_of(s):
    return (np.asarray(s.w1), np.asarray(s.b1), np.asarray(s.w2), np.asarray(s.b2),
            float(s.c), float(s.threshold))


def test_bias_matches_float64_formula():
    s = params()
    q = np.array([[0, 3, 7, 9, 15, 40], [2, 4, 6, 8, 10, 12]])  # below, at and above L = 9
    kv = np.array([[0, 1, 2, 3, 7, 15, 39], [0, 1, 2, 3, 4, 5, 6]])
    b = s.bias(q, kv)
    assert b.shape == (2, N, 6, 7) and b.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(b), np_fire(q, kv, *np_of(s)), rtol=1e-5, atol=1e-6)


def test_progressive_interpolation_written_out():
    # One head, MLP = identity on [0, inf) (w1 = 1, b1 = 0, w2 = 1, b2 = 0): the bias is the
    # normalised distance. c = 1, L = 3: for i <= 3 the normaliser is psi(3) = log 4; for
    # i > 3 it is psi(i), so the farthest key (j = 0) maps to 1 at every such query.
    one = np.ones(1, np.float32)
    b = np.asarray(fire_bias(np.arange(10), np.arange(10), one, 0 * one, one[:, None], 0 * one,
                             c=1.0, L=3.0, eps=0.0))[0]
    assert b[2, 0] == pytest.approx(math.log(3) / math.log(4), rel=1e-6)
    assert b[3, 0] == pytest.approx(1.0, rel=1e-6)
    np.testing.assert_allclose(b[4:, 0], 1.0, rtol=1e-6)
    assert b[9, 5] == pytest.approx(math.log(5) / math.log(10), rel=1e-6)
    np.testing.assert_allclose(np.diag(b), 0.0, atol=0)


def test_score_mod_on_a_tile_equals_float64():
    s = params(1)
    q_pos = np.array([[3, 4, 5, 6, 7, 30], [10, 11, 12, 13, 14, 15]])
    kv_pos = np.array([[0, 1, 2, 3, 4, 5, 6], [8, 9, 10, 11, 12, 13, 14]])
    got = tile_bias(s, q_pos, kv_pos, B=2, N=N)
    np.testing.assert_allclose(np.asarray(got), np_fire(q_pos, kv_pos, *np_of(s)), rtol=1e-5,
                               atol=2e-6)


def test_registered_and_init():
    assert get_scheme("fire") is FIRE
    s = FIRE.init(3, key=jax.random.PRNGKey(0))
    assert s.w1.shape == s.b1.shape == (32,) and s.w2.shape == (32, 3) and s.b2.shape == (3,)
    assert float(s.c) == pytest.approx(0.1) and float(s.threshold) == 512.0  # the paper's
    assert float(jnp.max(jnp.abs(s.w2))) <= 1 / math.sqrt(32)  # nn.Linear's U(+-1/sqrt(in))


@pytest.mark.parametrize("impl", IMPLS)
def test_attention_matches_float64(impl):
    q, k, v = qkv(1, T=13, N=N, H=8, Nk=2)
    s = params(2)
    out = attn(impl, q, k, v, position=s, causal=True)
    pos = np.arange(13)
    want = dense64(q, k, v, np_fire(pos, pos, *np_of(s))[None], causal=True)
    np.testing.assert_allclose(np.asarray(out), want, atol=3e-5)


@pytest.mark.slow  # FIRE's per-score MLP is the costliest score_mod to compile on CPU
@pytest.mark.parametrize("impl", IMPLS[1:])  # each compares with the reference
def test_implementations_agree_forward_and_gradients(impl):
    q, k, v = qkv(2, T=12, N=N, H=8)
    s = params(3)
    p = (s.w1, s.b1, s.w2, s.b2, s.c, s.L_multiplier)
    make = lambda p: FIRE(*p[:4], c=p[4], L_multiplier=p[5], init_L=9.0)
    assert_impl_agrees(impl, make, p, q, k, v, causal=True)


@pytest.mark.slow
def test_translation_invariant_only_below_the_threshold():
    q, k, v = qkv(3, T=6, Tk=10, N=N)
    # every query position stays <= L = 1000 before and after the shift: invariant
    s = FIRE.init(N, key=jax.random.PRNGKey(4), init_c=0.3, init_L=1000.0)
    a, b = shifted_outputs(s, q, k, v, shift=500)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    # past L the normaliser grows with the query position: not invariant (by design)
    s = FIRE.init(N, key=jax.random.PRNGKey(4), init_c=0.3, init_L=4.0)
    a, b = shifted_outputs(s, q, k, v, shift=500)
    assert float(jnp.max(jnp.abs(a - b))) > 1e-3


def test_gradient_matches_finite_differences():
    q, k, v = qkv(4, B=1, T=7, N=N, H=8)
    s = params(5)

    def loss(c, L_multiplier, w2, b2):
        scheme = FIRE(s.w1, s.b1, w2, b2, c=c, L_multiplier=L_multiplier, init_L=9.0)
        return jnp.sum(attn("chunked", q, k, v, position=scheme, causal=True) * v[:, :7])

    check_grads(jax.jit(loss), (s.c, s.L_multiplier, s.w2, s.b2), order=1, modes=["rev"], eps=1e-2,
                atol=1e-2, rtol=1e-2)


def test_bad_input():
    s = params()
    w1, b1, w2, b2 = s.w1, s.b1, s.w2, s.b2
    pos = np.arange(4)
    with pytest.raises(ValueError, match=r"w2 must have rank 2"):
        fire_bias(pos, pos, w1, b1, b2, b2, c=0.1, L=8.0)
    with pytest.raises(ValueError, match=r"w1 and b1 must have shape \[mlp_width\] = \[32\]"):
        fire_bias(pos, pos, w1[:5], b1, w2, b2, c=0.1, L=8.0)
    with pytest.raises(ValueError, match=r"b2 must have shape \[num_heads\] = \[4\].*\(3,\)"):
        fire_bias(pos, pos, w1, b1, w2, b2[:3], c=0.1, L=8.0)
    with pytest.raises(ValueError, match=r"L must be a finite number > 0; got -1"):
        fire_bias(pos, pos, w1, b1, w2, b2, c=0.1, L=-1.0)
    with pytest.raises(ValueError, match=r"c must be a scalar; got shape \(2,\)"):
        fire_bias(pos, pos, w1, b1, w2, b2, c=np.ones(2), L=8.0)
    with pytest.raises(TypeError, match="c must be a real number"):
        FIRE(w1, b1, w2, b2, c="0.1")
    with pytest.raises(ValueError, match="init_L must be a finite number > 0"):
        FIRE(w1, b1, w2, b2, init_L=0.0)
    with pytest.raises(TypeError, match="kv_positions must hold integer"):
        fire_bias(pos, pos * 1.0, w1, b1, w2, b2, c=0.1, L=8.0)
    q, k, v = qkv(0, N=2)
    with pytest.raises(ValueError, match="FIRE's MLP has 4 outputs.*2 query heads"):
        jaxpos.attention(q, k, v, position=s, causal=True)
