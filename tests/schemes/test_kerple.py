"""KERPLE (Chi et al. 2022): the log and power kernels against float64 NumPy written from
the paper's formulas, the score_mod on tiles, attention in every implementation, shift
invariance, gradients, the authors' clamp, and bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _scheme_checks import IMPLS, assert_impl_agrees, attn, dense64, qkv, shifted_outputs, tile_bias
from jax.test_util import check_grads

import jaxpos
from jaxpos.schemes.base import get_scheme
from jaxpos.schemes.kerple import KERPLE, KERPLELog, KERPLEPower, kerple_bias


def np_kerple(q_pos, kv_pos, r1, r2, kind):
    """Chi et al. 2022: log ``-r1 log(1 + r2 |m - n|)``, power ``-r1 |m - n|^r2``;
    float64 ``[..., N, Tq, Tk]``."""
    d = np.abs(np.asarray(kv_pos, np.float64)[..., None, :] -
               np.asarray(q_pos, np.float64)[..., :, None])[..., None, :, :]
    r1 = np.asarray(r1, np.float64)[:, None, None]
    r2 = np.asarray(r2, np.float64)[:, None, None]
    return -r1 * np.log1p(r2 * d) if kind == "log" else -r1 * d ** r2


R1 = np.array([0.3, 1.0, 1.7, 0.05], np.float32)
R2 = np.array([0.8, 0.1, 1.5, 2.0], np.float32)


@pytest.mark.parametrize("kind", ["log", "power"])
def test_bias_matches_float64_formula(kind):
    q = np.array([[0, 3, 7, 40], [5, 6, 7, 8]])
    kv = np.array([[0, 1, 2, 3, 39, 100], [0, 2, 4, 6, 8, 10]])
    b = kerple_bias(q, kv, R1, R2, kind=kind)
    assert b.shape == (2, 4, 4, 6) and b.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(b), np_kerple(q, kv, R1, R2, kind), rtol=2e-6,
                               atol=1e-6)


def test_written_out_values():
    # log, r1 = r2 = 1: -log(1 + d); power, r1 = 1/2, r2 = 1: ALiBi's -d/2 (Press et al.
    # 2022, slope 1/2), and r2 = 2: -d^2/2.
    d = np.arange(5)
    one = np.ones(1, np.float32)
    b = kerple_bias(d[:1], d, one, one, kind="log")[0, 0]
    np.testing.assert_allclose(np.asarray(b), -np.log([1, 2, 3, 4, 5]), rtol=1e-6)
    half = np.full(1, 0.5, np.float32)
    b = kerple_bias(d[:1], d, half, one, kind="power")[0, 0]
    np.testing.assert_allclose(np.asarray(b), [0, -0.5, -1.0, -1.5, -2.0], rtol=1e-7)
    alibi = jaxpos.alibi_bias(d[:1], d, half, bidirectional=True)[0, 0]
    np.testing.assert_allclose(np.asarray(b), np.asarray(alibi), rtol=1e-7)
    b = kerple_bias(d[:1], d, half, 2 * one, kind="power")[0, 0]
    np.testing.assert_allclose(np.asarray(b), [0, -0.5, -2.0, -4.5, -8.0], rtol=1e-7)


@pytest.mark.parametrize("cls,kind", [(KERPLELog, "log"), (KERPLEPower, "power")])
def test_score_mod_on_a_tile_equals_float64(cls, kind):
    scheme = cls(R1, R2)
    q_pos = np.array([[3, 4, 5, 6, 7], [10, 11, 12, 13, 14]])
    kv_pos = np.array([[0, 1, 2, 3, 4, 5, 6], [8, 9, 10, 11, 12, 13, 14]])
    got = tile_bias(scheme, q_pos, kv_pos, B=2, N=4)
    np.testing.assert_allclose(np.asarray(got), np_kerple(q_pos, kv_pos, R1, R2, kind),
                               rtol=2e-6, atol=1e-6)


def test_registered_names():
    assert get_scheme("kerple_log") is KERPLELog
    assert get_scheme("kerple_power") is KERPLEPower
    s = KERPLEPower.init(4, key=jax.random.PRNGKey(0))
    assert s.kind == "power" and s.r1.shape == s.r2.shape == (4,)
    # the authors' initialisation ranges: exponent in (0, 2], multiplier in (0, 1]
    assert np.all(np.asarray(s.r2) <= 2) and np.all(np.asarray(s.r1) <= 1)
    assert np.all(np.asarray(s.r1) >= 1e-2) and np.all(np.asarray(s.r2) >= 1e-2)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["log", "power"])
def test_attention_matches_float64(impl, kind):
    q, k, v = qkv(1, T=13, N=4, H=8, Nk=2)
    scheme = KERPLE(R1, R2, kind=kind)
    out = attn(impl, q, k, v, position=scheme, causal=True)
    pos = np.arange(13)
    want = dense64(q, k, v, np_kerple(pos, pos, R1, R2, kind)[None], causal=True)
    np.testing.assert_allclose(np.asarray(out), want, atol=3e-5)


@pytest.mark.parametrize("impl", IMPLS[1:])  # each compares with the reference
@pytest.mark.parametrize("kind", ["log", "power"])
def test_implementations_agree_forward_and_gradients(impl, kind):
    q, k, v = qkv(2, T=12, N=4, H=8)
    params = (jnp.asarray(R1), jnp.asarray(R2))
    assert_impl_agrees(impl, lambda p: KERPLE(*p, kind=kind), params, q, k, v, causal=True)


@pytest.mark.parametrize("impl", IMPLS)
def test_position_equals_a_hand_written_score_mod(impl):
    """KERPLE through ``position=`` and written by hand as a
    ``score_mod=`` capturing r1 and r2 give the same numbers, forward and gradients (in
    the clamp's range, where its straight-through gradient is the identity)."""
    q, k, v = qkv(6, T=12, N=4, H=8)

    def by_hand(r1, r2):
        return lambda s, b, h, qp, kp: s - r1[h] * jnp.log1p(
            r2[h] * jnp.abs(kp - qp).astype(jnp.float32))

    f_pos = lambda r1, r2, q: attn(impl, q, k, v, position=KERPLELog(r1, r2), causal=True)
    f_mod = lambda r1, r2, q: attn(impl, q, k, v, score_mod=by_hand(r1, r2), causal=True)
    args = (jnp.asarray(R1), jnp.asarray(R2), q)
    np.testing.assert_allclose(np.asarray(f_pos(*args)), np.asarray(f_mod(*args)), atol=2e-6)
    loss = lambda f: (lambda *a: jnp.sum(jnp.sin(f(*a))))
    g_pos = jax.grad(loss(f_pos), argnums=(0, 1, 2))(*args)
    g_mod = jax.grad(loss(f_mod), argnums=(0, 1, 2))(*args)
    for a, b in zip(g_pos, g_mod):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["log", "power"])
def test_translation_invariant(kind):
    # The kernel depends on |m - n| only (Chi et al. 2022): shifting every position by the
    # same amount leaves the attention output unchanged.
    q, k, v = qkv(3, T=6, Tk=10)
    a, b = shifted_outputs(KERPLE(R1, R2, kind=kind), q, k, v, shift=12345)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


@pytest.mark.parametrize("kind", ["log", "power"])
def test_gradient_matches_finite_differences(kind):
    q, k, v = qkv(4, B=1, T=7, N=4, H=8)

    def loss(r1, r2):
        out = attn("chunked", q, k, v, position=KERPLE(r1, r2, kind=kind), causal=True)
        return jnp.sum(out * v[:, :7])

    r1, r2 = jnp.asarray(R1), jnp.asarray(jnp.minimum(R2, 1.9))  # inside the clamp
    check_grads(jax.jit(loss), (r1, r2), order=1, modes=["rev"], eps=1e-2, atol=1e-2,
                rtol=1e-2)


def test_pure_function_gradient_matches_finite_differences():
    # check_grads on the bias itself (no softmax): the power kernel's gradient with
    # respect to r2 is -r1 d^r2 log d, finite (0) at d = 0.
    q, kv = np.arange(5), np.arange(7)

    def f(r1, r2):
        return jnp.sum(jnp.cos(kerple_bias(q, kv, r1, r2, kind="power")))

    g = jax.grad(f, argnums=(0, 1))(jnp.asarray(R1), jnp.asarray(np.minimum(R2, 1.9)))
    assert all(np.all(np.isfinite(np.asarray(x))) for x in g)
    check_grads(f, (jnp.asarray(R1), jnp.asarray(np.minimum(R2, 1.9))), order=1,
                modes=["rev"], eps=1e-3, atol=2e-2, rtol=2e-2)


def test_clamp_is_the_authors_with_a_straight_through_gradient():
    # Raw values outside the range are used clamped (r >= 1e-2; power r2 <= 2), as the
    # authors' in-place clamp does, and still receive a gradient.
    s = KERPLEPower(R1, R2).replace(r1=jnp.array([-1.0, 1, 1, 1]), r2=jnp.array([3.0, 1, 1, 1]))
    pos = np.arange(6)
    got = tile_bias(s, pos[None], pos[None], B=1, N=4)[0]
    want = np_kerple(pos, pos, [1e-2, 1, 1, 1], [2.0, 1, 1, 1], "power")
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-7)
    g = jax.grad(lambda s: jnp.sum(tile_bias(s, pos[None], pos[None], B=1, N=4)))(s)
    assert float(g.r1[0]) != 0.0 and float(g.r2[0]) != 0.0


def test_bad_input():
    with pytest.raises(ValueError, match="kind"):
        kerple_bias(np.arange(3), np.arange(3), R1, R2, kind="linear")
    with pytest.raises(ValueError, match=r"r1 must be finite and > 0.*-0\.5"):
        kerple_bias(np.arange(3), np.arange(3), np.array([-0.5, 1, 1, 1], np.float32), R2)
    with pytest.raises(ValueError, match=r"r2 must be finite and > 0"):
        KERPLELog(R1, np.zeros(4, np.float32))
    with pytest.raises(ValueError, match=r"r2 must be <= 2.*2\.5"):
        KERPLEPower(R1, np.array([2.5, 1, 1, 1], np.float32))
    with pytest.raises(ValueError, match=r"r1 must have rank 1.*\(2, 2\)"):
        KERPLELog(np.ones((2, 2), np.float32), np.ones((2, 2), np.float32))
    with pytest.raises(ValueError, match=r"same shape.*\(4,\).*\(3,\)"):
        KERPLELog(R1, R2[:3])
    with pytest.raises(TypeError, match="r1 must be a floating-point array"):
        KERPLELog(np.ones(4, np.int32), R2)
    with pytest.raises(TypeError, match="q_positions must hold integer"):
        kerple_bias(np.arange(3.0), np.arange(3), R1, R2)
    with pytest.raises(ValueError, match="KERPLELog is KERPLE's 'log' variant; got kind='power'"):
        KERPLELog(R1, R2, kind="power")
    with pytest.raises(ValueError, match="eps must be a finite number > 0"):
        KERPLELog(R1, R2, eps=0.0)
    q, k, v = qkv(0, N=3)
    with pytest.raises(ValueError, match=r"r1 and r2 must have shape \[3\].*\(4,\)"):
        jaxpos.attention(q, k, v, position=KERPLELog(R1, R2))


def test_jit_traces_the_parameters():
    # r1, r2 are pytree children: new values under jit reuse one compiled program.
    q, k, v = qkv(5, B=1, T=6)
    f = jax.jit(lambda s: jaxpos.attention(q, k, v, position=s, causal=True))
    a = f(KERPLELog(R1, R2))
    b = f(KERPLELog(R1 * 2, R2))
    assert f._cache_size() == 1
    assert float(jnp.max(jnp.abs(a - b))) > 1e-4


def test_module_hooks_keep_raw_values():
    # init_params draws the authors' ranges; from_params accepts stored raw values that
    # training moved out of range (the forward pass clamps them) but still checks shapes.
    p = KERPLEPower.init_params(jax.random.PRNGKey(0), num_heads=4, options={})
    assert set(p) == {"r1", "r2"} and p["r2"].shape == (4,)
    s = KERPLEPower.from_params({"r1": jnp.array([-0.1, 1, 1, 1]), "r2": p["r2"]}, options={})
    pos = np.arange(4)
    got = tile_bias(s, pos[None], pos[None], B=1, N=4)[0, 0]
    np.testing.assert_allclose(np.asarray(got), -1e-2 * np.abs(pos - pos[:, None]) **
                               float(p["r2"][0]), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="same shape"):
        KERPLELog.from_params({"r1": R1, "r2": R2[:2]}, options={})


@pytest.mark.parametrize("kind", ["log", "power"])
def test_scheme_bias_through_score_mod_matches_float64(kind):
    q = np.array([[0, 3, 7, 40], [5, 6, 7, 8]])
    kv = np.array([[0, 1, 2, 3, 39, 100], [0, 2, 4, 6, 8, 10]])
    b = KERPLE(R1, R2, kind=kind).bias(q, kv)
    assert b.shape == (2, 4, 4, 6) and b.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(b), np_kerple(q, kv, R1, R2, kind), rtol=2e-6,
                               atol=1e-6)
