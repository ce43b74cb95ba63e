"""PaTH attention (Yang et al. 2025, arXiv:2505.16381): both implementations of
:func:`jaxpos.path_attention` against a float64 NumPy loop over Eq. 2 that multiplies the
Householder matrices ``H_t = I - beta_t w_t w_t^T`` explicitly (grouped-query heads, the
PaTH-FoX gate, packed segments), against numbers of the authors' PyTorch reference
(flash-linear-attention ``naive_path_attn``), gradients against float64 finite
differences of the NumPy loop, and the refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _replacing_reference import np_path, path_inputs

import jaxpos
from jaxpos import path_attention

IMPLS = ("reference", "chunked")


def inputs(seed, **sizes):
    return tuple(jnp.asarray(x) for x in path_inputs(seed, **sizes))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fox", [pytest.param(False, marks=pytest.mark.slow), True])
def test_values_match_the_float64_householder_products(impl, fox):
    q, k, v, w, beta, lf = inputs(0)
    seg = np.array([[0] * 7, [0, 0, 0, 1, 1, 1, 1]])
    got = path_attention(q, k, v, w, beta, log_forget=lf if fox else None, segment_ids=seg,
                         implementation=impl, block_size=3)
    want = np_path(q, k, v, w, beta, lf if fox else None, seg)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6)


@pytest.mark.parametrize("block_size", [pytest.param(1, marks=pytest.mark.slow),
                                        pytest.param(2, marks=pytest.mark.slow), 4, 16])
def test_chunked_equals_reference_for_every_block_size(block_size):
    q, k, v, w, beta, lf = inputs(1, T=9)
    ref = path_attention(q, k, v, w, beta, log_forget=lf, implementation="reference")
    got = path_attention(q, k, v, w, beta, log_forget=lf, implementation="chunked",
                         block_size=block_size)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-6)


# flash-linear-attention fla/ops/path_attn/naive.py, naive_path_attn(q, k, v, w, beta, g,
# scale=0.5, chunk_size=4) in float64 PyTorch on the inputs of _fla_inputs (one query
# block of 4 and a second one of 2: the inter-chunk loop runs); output [T, N, Hv].
FLA_OUT = np.array([
    [[-0.4631699, -0.0972869], [-0.4631699, -0.0972869]],
    [[0.5965931, 0.3873736], [0.9641562, 0.555471]],
    [[0.1059311, 0.1090142], [0.4909898, 0.2603469]],
    [[0.3807074, 0.9238473], [0.2570717, 0.7928095]],
    [[-0.2228732, 0.2319308], [-0.0291141, 0.2649537]],
    [[0.166911, 0.3693287], [-0.0460031, 0.2641907]],
])


def _fla_inputs():
    r = np.random.default_rng(7)
    q = r.normal(size=(1, 6, 2, 4))
    k = r.normal(size=(1, 6, 1, 4))
    v = r.normal(size=(1, 6, 1, 2))
    w = r.normal(size=(1, 6, 1, 4))
    w /= np.linalg.norm(w, axis=-1, keepdims=True)
    beta = 2 / (1 + np.exp(-r.normal(size=(1, 6, 1))))
    g = -np.abs(r.normal(size=(1, 6, 2))) * 0.5
    return q, k, v, w, beta, g


@pytest.mark.parametrize("impl", IMPLS)
def test_values_match_the_authors_pytorch_reference(impl):
    q, k, v, w, beta, g = (jnp.asarray(x, jnp.float32) for x in _fla_inputs())
    got = path_attention(q, k, v, w, beta, log_forget=g, scale=0.5, implementation=impl,
                         block_size=4)
    np.testing.assert_allclose(np.asarray(got[0]), FLA_OUT, atol=2e-6)
    # ... and the NumPy loop agrees with the same numbers (the forget term scaled too)
    np.testing.assert_allclose(np_path(*_fla_inputs()[:5], _fla_inputs()[5], scale=0.5)[0],
                               FLA_OUT, atol=1e-6)


def test_zero_beta_is_causal_softmax_attention():
    # H_t = I: no position information, the causal NoPE attention of jaxpos.attention.
    q, k, v, w, beta, _ = inputs(2)
    got = path_attention(q, k, v, w, jnp.zeros_like(beta))
    want = jaxpos.attention(q, k, v, causal=True, implementation="reference")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6)


@pytest.mark.parametrize("impl", [pytest.param("reference", marks=pytest.mark.slow),
                                  "chunked"])
def test_gradients_match_float64_finite_differences(impl):
    q, k, v, w, beta, lf = inputs(3, B=1, T=7, N=2, Nk=1, H=3)
    seg = np.array([[0, 0, 0, 1, 1, 1, 1]])
    ct = np.random.default_rng(4).standard_normal((1, 7, 2, 3))
    args = [np.asarray(x, np.float64) for x in (q, k, v, w, beta, lf)]

    def loss64(*a):
        return float(np.sum(ct * np_path(*a[:5], a[5], seg)))

    def loss(*a):
        return jnp.sum(jnp.asarray(ct, jnp.float32) * path_attention(
            *a[:5], log_forget=a[5], segment_ids=seg, implementation=impl, block_size=3))

    g = jax.grad(loss, argnums=tuple(range(6)))(q, k, v, w, beta, lf)
    rng = np.random.default_rng(0)
    eps = 1e-6
    for i, name in enumerate(("q", "k", "v", "w", "beta", "log_forget")):
        d = rng.standard_normal(args[i].shape)
        hi, lo = list(args), list(args)
        hi[i], lo[i] = args[i] + eps * d, args[i] - eps * d
        fd = (loss64(*hi) - loss64(*lo)) / (2 * eps)
        got = float(np.sum(np.asarray(g[i], np.float64) * d))
        assert abs(got - fd) <= 1e-4 * max(1.0, abs(fd)), (name, got, fd)


@pytest.mark.slow
def test_chunked_under_jit_and_vmap_equals_eager():
    q, k, v, w, beta, lf = inputs(5)
    f = lambda *a: path_attention(*a[:5], log_forget=a[5], block_size=4)
    eager = f(q, k, v, w, beta, lf)
    np.testing.assert_allclose(np.asarray(jax.jit(f)(q, k, v, w, beta, lf)), np.asarray(eager),
                               atol=1e-6)
    per_row = jax.vmap(lambda *a: f(*(x[None] for x in a))[0])(q, k, v, w, beta, lf)
    np.testing.assert_allclose(np.asarray(per_row), np.asarray(eager), atol=1e-6)


def test_bad_inputs_are_refused_naming_the_argument():
    q, k, v, w, beta, lf = inputs(6)
    with pytest.raises(ValueError, match="causal"):
        path_attention(q, k, v, w, beta, causal=False)
    with pytest.raises(ValueError, match="'reference' or 'chunked'.*got implementation='pallas'"):
        path_attention(q, k, v, w, beta, implementation="pallas")
    with pytest.raises(ValueError, match="w must have"):
        path_attention(q, k, v, w[:, :, :1], beta)
    with pytest.raises(ValueError, match="beta must have"):
        path_attention(q, k, v, w, beta[..., None])
    with pytest.raises(ValueError, match="log_forget must have"):
        path_attention(q, k, v, w, beta, log_forget=lf[:, :, :2])
    with pytest.raises(ValueError, match="same length"):
        path_attention(q[:, :3], k, v, w, beta)
    with pytest.raises(ValueError, match="segment_ids must have"):
        path_attention(q, k, v, w, beta, segment_ids=np.zeros((2, 3), int))
    with pytest.raises(ValueError, match="block_size"):
        path_attention(q, k, v, w, beta, block_size=0)


def test_segments_that_come_back_are_refused_when_concrete():
    """PaTH moves a key through the transforms of every token between it and its query:
    a segment that comes back after another one would pick up the other's transforms."""
    q, k, v, w, beta, _ = inputs(7)
    B, T = q.shape[:2]
    alternating = np.tile(np.arange(T) % 2, (B, 1))  # [0, 1, 0, 1, ...]
    for seg in (alternating, jnp.asarray(alternating)):
        with pytest.raises(ValueError, match=r"segment_ids must keep each segment's tokens "
                                             r"together.*row 0.*id 0 comes back at token 2"):
            path_attention(q, k, v, w, beta, segment_ids=seg)
    late = np.array([[0, 0, 1, 1, 1, 1, 0]] + [[0] * T] * (B - 1))
    with pytest.raises(ValueError, match="id 0 comes back at token 6"):
        path_attention(q, k, v, w, beta, segment_ids=late)
    # under jit, the documented precondition; the numbers it gives are not those of each
    # segment's tokens on their own (the float64 products over the even, then odd tokens)
    got = jax.jit(lambda s: path_attention(q, k, v, w, beta, segment_ids=s,
                                           implementation="reference"))(alternating)
    for r in (0, 1):
        own = np_path(*(x[:, r::2] for x in (q, k, v, w, beta)))
        assert np.abs(np.asarray(got)[:, r + 2::2] - own[:, 1:]).max() > 1e-2
        np.testing.assert_allclose(np.asarray(got)[:, r], own[:, 0], atol=2e-6)
    # one run per id, in any order of ids, passes
    ok = np.array([[2, 2, 0, 0, 0, 1, 1]] * B)
    got = path_attention(q, k, v, w, beta, segment_ids=ok, implementation="reference")
    np.testing.assert_allclose(np.asarray(got), np_path(q, k, v, w, beta, None, ok), atol=2e-6)
