"""Sandwich (Chi et al. 2023): the bias against float64 inner products of sinusoidal
vectors ``p_m . p_n`` built from their sines and cosines, the per-head ratio, the
score_mod on tiles, attention in every implementation, shift invariance, gradients, and
bad input."""

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
from jaxpos.schemes.sandwich import Sandwich, sandwich_bias, sandwich_head_scales, sandwich_inv_freq

N = 4


def np_sinusoid(pos, d_bar, base=10000.0):
    """Sinusoidal vectors ``[..., d_bar]``: ``sin`` and ``cos`` of ``pos / base^(2i/d_bar)``,
    ``i = 1..d_bar/2`` (Chi et al. 2023's ``p_m``)."""
    w = base ** (-2.0 * np.arange(1, d_bar // 2 + 1) / d_bar)
    a = np.asarray(pos, np.float64)[..., None] * w
    return np.concatenate([np.sin(a), np.cos(a)], axis=-1)


def np_sandwich(q_pos, kv_pos, num_heads, d_bar):
    """``(p_m . p_n - d_bar/2) / (8h/H)``, ``h = 1..H``, as an explicit inner product of the
    sinusoidal vectors (not the cosine sum): float64 ``[..., H, Tq, Tk]``."""
    pm, pn = np_sinusoid(q_pos, d_bar), np_sinusoid(kv_pos, d_bar)
    dot = np.einsum("...qd,...kd->...qk", pm, pn) - d_bar / 2
    ratio = 8.0 * np.arange(1, num_heads + 1) / num_heads
    return dot[..., None, :, :] / ratio[:, None, None]


@pytest.mark.parametrize("d_bar", [2, 16, 128])
def test_bias_is_the_sinusoidal_inner_product(d_bar):
    q = np.array([[0, 3, 7, 40], [500, 600, 700, 800]])
    kv = np.array([[0, 1, 2, 3, 39, 100], [0, 20, 400, 600, 650, 1000]])
    b = sandwich_bias(q, kv, sandwich_head_scales(N), d_bar=d_bar)
    assert b.shape == (2, N, 4, 6) and b.dtype == jnp.float32
    # float32 cos arguments carry ~|m - n| * 6e-8 rad each, summed over d_bar/2 terms
    np.testing.assert_allclose(np.asarray(b), np_sandwich(q, kv, N, d_bar), atol=2e-6 * d_bar)


def test_written_out_values():
    # d_bar = 2: one frequency 1/10000; head 1 of 8 has ratio 8*1/8 = 1.
    assert np.allclose(np.asarray(sandwich_head_scales(8)), 1.0 / np.arange(1, 9), rtol=1e-7)
    np.testing.assert_allclose(np.asarray(sandwich_inv_freq(4)), [1e-2, 1e-4], rtol=1e-7)
    b = sandwich_bias(np.array([0]), np.array([0, 100, 5000]), sandwich_head_scales(8), d_bar=2)
    np.testing.assert_allclose(np.asarray(b[0, 0]), [0.0, math.cos(0.01) - 1, math.cos(0.5) - 1],
                               rtol=2e-4, atol=1e-9)
    np.testing.assert_allclose(np.asarray(b[3]), np.asarray(b[0]) / 4, rtol=1e-6)


def test_even_in_the_offset_and_zero_on_the_diagonal():
    pos = np.arange(20)
    b = np.asarray(sandwich_bias(pos, pos, sandwich_head_scales(N)))
    np.testing.assert_allclose(b, np.swapaxes(b, -1, -2), atol=0)
    np.testing.assert_array_equal(np.diagonal(b, axis1=-2, axis2=-1), 0.0)
    assert np.all(b[:, 5, :5] < 0)


def test_score_mod_on_a_tile_equals_float64():
    s = Sandwich(N)
    q_pos = np.array([[3, 4, 5, 6, 7], [100, 101, 102, 103, 104]])
    kv_pos = np.array([[0, 1, 2, 3, 4, 5, 6], [0, 9, 50, 99, 100, 101, 102]])
    got = tile_bias(s, q_pos, kv_pos, B=2, N=N)
    np.testing.assert_allclose(np.asarray(got), np_sandwich(q_pos, kv_pos, N, 128), atol=3e-4)


def test_registered():
    assert get_scheme("sandwich") is Sandwich
    s = Sandwich(N, d_bar=64)
    assert s.d_bar == 64 and s.head_scales.shape == (N,)


@pytest.mark.parametrize("impl", IMPLS)
def test_attention_matches_float64(impl):
    q, k, v = qkv(1, T=13, N=N, H=8, Nk=2)
    out = attn(impl, q, k, v, position=Sandwich(N, d_bar=32), causal=True)
    pos = np.arange(13)
    want = dense64(q, k, v, np_sandwich(pos, pos, N, 32)[None], causal=True)
    np.testing.assert_allclose(np.asarray(out), want, atol=3e-5)


@pytest.mark.parametrize("impl", IMPLS[1:])  # each compares with the reference
def test_implementations_agree_forward_and_gradients(impl):
    q, k, v = qkv(2, T=12, N=N, H=8)
    make = lambda p: Sandwich(head_scales=p, d_bar=32)
    assert_impl_agrees(impl, make, sandwich_head_scales(N), q, k, v, causal=True)


def test_translation_invariant():
    q, k, v = qkv(3, T=6, Tk=10, N=N)
    a, b = shifted_outputs(Sandwich(N, d_bar=32), q, k, v, shift=4321)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_gradient_matches_finite_differences():
    q, k, v = qkv(4, B=1, T=7, N=N, H=8)

    def loss(scales):
        s = Sandwich(head_scales=scales, d_bar=16)
        return jnp.sum(attn("chunked", q, k, v, position=s, causal=True) * v[:, :7])

    check_grads(jax.jit(loss), (sandwich_head_scales(N),), order=1, modes=["rev"], eps=1e-2,
                atol=1e-2, rtol=1e-2)


def test_bad_input():
    pos = np.arange(4)
    with pytest.raises(ValueError, match="d_bar must be even.*got 7"):
        sandwich_bias(pos, pos, sandwich_head_scales(N), d_bar=7)
    with pytest.raises(ValueError, match="d_bar must be a positive integer"):
        Sandwich(N, d_bar=0)
    with pytest.raises(TypeError, match="d_bar must be a Python int"):
        Sandwich(N, d_bar=16.0)
    with pytest.raises(ValueError, match="base must be a finite number > 0"):
        Sandwich(N, base=-1.0)
    with pytest.raises(TypeError, match="head_scales must be a floating-point array"):
        Sandwich(head_scales=np.ones(N, np.int32))
    with pytest.raises(ValueError, match="num_heads or head_scales"):
        Sandwich()
    with pytest.raises(TypeError, match="q_positions must hold integer"):
        sandwich_bias(pos * 1.0, pos, sandwich_head_scales(N))
    q, k, v = qkv(0, N=2)
    with pytest.raises(ValueError, match=r"head_scales must have shape \[2\].*\(4,\)"):
        jaxpos.attention(q, k, v, position=Sandwich(N), causal=True)


def test_scheme_bias_through_score_mod_matches_float64():
    q, kv = np.array([0, 3, 7, 40]), np.array([0, 1, 2, 3, 39, 100])
    b = Sandwich(N, d_bar=16).bias(q, kv)
    assert b.shape == (1, N, 4, 6) and b.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(b)[0], np_sandwich(q, kv, N, 16), atol=2e-6 * 16)
