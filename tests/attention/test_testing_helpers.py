"""jaxpos.testing: each assertion passes when its property holds, fails (AssertionError)
when it does not, and rejects bad arguments; attention_scores matches a float64 NumPy
computation of ``q k^T / sqrt(H) + ALiBi bias`` (Press et al. 2022, §3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpos
import jaxpos.testing as jt


def _x(seed, *shape):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


# ------------------------------------------------------------ permutation equivariance
def test_permutation_equivariant_passes_for_a_tokenwise_function():
    x = _x(0, 2, 5, 3)
    jt.assert_permutation_equivariant(lambda x: jnp.tanh(x) * 2.0, x)
    jt.assert_permutation_equivariant(lambda x: x - x.mean(axis=1, keepdims=True), x,
                                      perm=[4, 3, 2, 1, 0])


def test_permutation_equivariant_fails_for_an_order_dependent_function():
    x = _x(1, 2, 5, 3)
    with pytest.raises(AssertionError, match="permutation-equivariant"):
        jt.assert_permutation_equivariant(lambda x: jnp.cumsum(x, axis=1), x)


def test_permutation_equivariant_other_axis_and_pytree_outputs():
    x = _x(2, 5, 4)  # sequence on axis 0
    jt.assert_permutation_equivariant(lambda x: {"a": x * 3, "b": (x ** 2,)}, x, axis=0)


@pytest.mark.parametrize("kwargs, words", [
    ({"perm": [0, 1, 1, 2, 3]}, "permutation of range(5)"),
    ({"perm": [0, 1, 2]}, "permutation of range(5)"),
    ({"atol": -1.0}, "atol"),
])
def test_permutation_equivariant_bad_arguments(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        jt.assert_permutation_equivariant(lambda x: x, _x(3, 1, 5, 2), **kwargs)


def test_permutation_equivariant_needs_matching_lengths():
    with pytest.raises(ValueError, match="same length along axis 1"):
        jt.assert_permutation_equivariant(lambda a, b: a, _x(4, 1, 5, 2), _x(5, 1, 4, 2))
    with pytest.raises(ValueError, match="at least one array"):
        jt.assert_permutation_equivariant(lambda: 0)


# ------------------------------------------------------------ translation invariance
def test_translation_invariant_passes_for_offsets_and_fails_for_absolute_positions():
    rel = lambda qp, kp: jnp.cos(0.1 * (kp[None, :] - qp[:, None]).astype(jnp.float32))
    absolute = lambda qp, kp: jnp.cos(0.1 * (kp[None, :] + qp[:, None]).astype(jnp.float32))
    pos = np.arange(6)
    jt.assert_translation_invariant(rel, pos, pos, shift=1000)
    jt.assert_translation_invariant(rel, pos, pos, shift=-3)
    with pytest.raises(AssertionError, match="shift of all positions by 1000"):
        jt.assert_translation_invariant(absolute, pos, pos, shift=1000)


def test_translation_invariant_bad_arguments():
    f = lambda qp, kp: qp
    with pytest.raises(TypeError, match="q_positions must hold integer positions"):
        jt.assert_translation_invariant(f, np.arange(3.0), np.arange(3))
    with pytest.raises(TypeError, match="shift must be a Python int"):
        jt.assert_translation_invariant(f, np.arange(3), np.arange(3), shift=1.5)


# ------------------------------------------------------------ jit and vmap
def test_equal_under_jit_passes_and_fails():
    x = _x(6, 4, 3)
    jt.assert_equal_under_jit(lambda x, axis: jnp.sum(x, axis=axis), x, 1, static_argnums=1)
    jt.assert_equal_under_jit(lambda x, *, scale: x * scale, x, scale=2.0)
    # Python control flow on a value sees a concrete array eagerly and a tracer under jit:
    # a function that behaves differently when traced is caught.
    calls = []

    def differs(x):
        calls.append(isinstance(x, jax.core.Tracer))
        return x + (1.0 if calls[-1] else 0.0)

    with pytest.raises(AssertionError, match="jit"):
        jt.assert_equal_under_jit(differs, x)


def test_equal_under_vmap_passes_and_fails():
    xs = _x(7, 3, 4, 2)
    jt.assert_equal_under_vmap(lambda x: jnp.tanh(x) @ jnp.ones((2,)), xs)
    jt.assert_equal_under_vmap(lambda x, w: x * w, xs, np.float32(3.0), in_axes=(0, None))
    leaky = {"n": 0}

    def counts_calls(x):  # differs between the batched call and the per-example calls
        leaky["n"] += 1
        return x * leaky["n"]

    with pytest.raises(AssertionError, match="vmap"):
        jt.assert_equal_under_vmap(counts_calls, xs)


def test_equal_under_vmap_bad_arguments():
    with pytest.raises(ValueError, match="agree in size"):
        jt.assert_equal_under_vmap(lambda a, b: a + b, _x(8, 3, 2), _x(9, 4, 2))
    with pytest.raises(ValueError, match="one entry per argument"):
        jt.assert_equal_under_vmap(lambda a: a, _x(8, 3, 2), in_axes=(0, 0))


# ------------------------------------------------------------ attention_scores
def test_attention_scores_match_numpy_alibi():
    B, Tq, Tk, N, H = 2, 3, 5, 4, 8
    q, k = _x(10, B, Tq, N, H), _x(11, B, Tk, 2, H)  # grouped-query: 2 kv heads
    kv_pos = np.array([np.arange(Tk), np.arange(Tk) + 7])
    q_pos = kv_pos[:, -Tq:]
    got = jt.attention_scores(q, k, position=jaxpos.ALiBi(num_heads=N), q_positions=q_pos,
                              kv_positions=kv_pos)
    slopes = 2.0 ** (-8.0 * np.arange(1, N + 1) / N)  # 1/4, 1/16, 1/64, 1/256 for 4 heads
    kk = np.repeat(k.astype(np.float64), 2, axis=2)
    want = np.einsum("bqnh,bknh->bnqk", q.astype(np.float64), kk) / np.sqrt(H)
    want += slopes[None, :, None, None] * (kv_pos[:, None, None, :] - q_pos[:, None, :, None])
    assert got.shape == (B, N, Tq, Tk) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


def test_attention_scores_default_positions_and_scale():
    q, k = _x(12, 1, 2, 2, 4), _x(13, 1, 4, 2, 4)
    got = jt.attention_scores(q, k, scale=1.0)
    want = np.einsum("bqnh,bknh->bnqk", q.astype(np.float64), k.astype(np.float64))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


def test_attention_scores_rejects_bad_input():
    with pytest.raises(ValueError, match="q must have rank 4"):
        jt.attention_scores(_x(14, 2, 3, 4), _x(15, 1, 2, 3, 4))
