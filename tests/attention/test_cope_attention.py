"""CoPE (Golovneva et al. 2024, arXiv:2405.18719): both implementations of
:func:`jaxpos.cope_attention` against a float64 NumPy loop written from Eqs. 3-5 and the
authors' ``ContextPosSelfAttn`` (facebookresearch/RAM ``projects/cope``: gates of the
scaled logits, reverse cumulative sum, clamp at ``npos - 1``, interpolation, the position
logit added before the scale), hand-computed numbers, gradients against float64 finite
differences, one query against cached keys, and the refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _replacing_reference import np_cope

from jaxpos import cope_attention

IMPLS = ("reference", "chunked")


def inputs(seed, B=2, T=9, N=4, Nk=2, H=4, npos=5):
    r = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)
    return f(B, T, N, H), f(B, T, Nk, H), f(B, T, Nk, 3), f(H, npos)


@pytest.mark.parametrize("impl", IMPLS)
def test_values_match_the_float64_loop(impl):
    q, k, v, E = inputs(0)
    seg = np.array([[0] * 9, [0, 0, 0, 0, 1, 1, 1, 1, 1]])
    got = cope_attention(q, k, v, E, segment_ids=seg, implementation=impl, block_size=4)
    np.testing.assert_allclose(np.asarray(got), np_cope(q, k, v, E, segment_ids=seg), atol=2e-6)


def test_hand_computed_two_tokens():
    # H = 1, q = k = 0: every gate is sigmoid(0) = 1/2. Query 1 sees key 1 at p = 1/2
    # and key 0 at p = 1; q . e = 0 (q = 0), so the logits tie and the output is the mean
    # of the values. With q = 1, k = 0 the gates stay 1/2 and the position logits are
    # e[p]: e = [0, 2] -> key 1 at 0.5 * 0 + 0.5 * 2 = 1, key 0 at e[1] = 2; scale 1:
    # weights softmax([2, 1]) on values [10, 20].
    v = jnp.asarray([[[[10.0]], [[20.0]]]])
    zeros = jnp.zeros((1, 2, 1, 1))
    E = jnp.asarray([[0.0, 2.0]])
    out = cope_attention(zeros, zeros, v, E, scale=1.0)
    np.testing.assert_allclose(np.asarray(out)[0, 1, 0, 0], 15.0, rtol=1e-6)
    out = cope_attention(jnp.ones((1, 2, 1, 1)), zeros, v, E, scale=1.0)
    w = np.exp([2.0, 1.0]) / np.exp([2.0, 1.0]).sum()
    np.testing.assert_allclose(np.asarray(out)[0, 1, 0, 0], w @ [10.0, 20.0], rtol=1e-6)
    # past the last embedding the position is clamped: p(key 0) = 1 = npos - 1 here
    np.testing.assert_allclose(np.asarray(out)[0, 0, 0, 0], 10.0, rtol=1e-6)


@pytest.mark.parametrize("impl", [pytest.param("reference", marks=pytest.mark.slow),
                                  "chunked"])
def test_gradients_match_float64_finite_differences(impl):
    q, k, v, E = inputs(1, B=1, T=6, N=2, Nk=1, H=3, npos=4)
    ct = np.random.default_rng(2).standard_normal((1, 6, 2, 3))
    args = [np.asarray(x, np.float64) for x in (q, k, v, E)]

    def loss(*a):
        return jnp.sum(jnp.asarray(ct, jnp.float32) * cope_attention(
            *a, implementation=impl, block_size=2))

    g = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, E)
    rng = np.random.default_rng(0)
    eps = 1e-6
    for i, name in enumerate(("q", "k", "v", "pos_emb")):
        d = rng.standard_normal(args[i].shape)
        hi, lo = list(args), list(args)
        hi[i], lo[i] = args[i] + eps * d, args[i] - eps * d
        fd = (np.sum(ct * np_cope(*hi)) - np.sum(ct * np_cope(*lo))) / (2 * eps)
        got = float(np.sum(np.asarray(g[i], np.float64) * d))
        assert abs(got - fd) <= 1e-4 * max(1.0, abs(fd)), (name, got, fd)


@pytest.mark.parametrize("impl", IMPLS)
def test_one_query_against_cached_keys_equals_the_full_pass(impl):
    q, k, v, E = inputs(3)
    full = cope_attention(q, k, v, E, implementation=impl, block_size=4)
    last = cope_attention(q[:, -1:], k, v, E, q_positions=jnp.array([8]), implementation=impl,
                          block_size=4)
    np.testing.assert_allclose(np.asarray(last), np.asarray(full[:, -1:]), atol=1e-6)


def test_bad_inputs_are_refused_naming_the_argument():
    q, k, v, E = inputs(4)
    with pytest.raises(ValueError, match="causal"):
        cope_attention(q, k, v, E, causal=False)
    with pytest.raises(ValueError, match="'reference' or 'chunked'.*got implementation='pallas'"):
        cope_attention(q, k, v, E, implementation="pallas")
    with pytest.raises(ValueError, match="pos_emb must have shape"):
        cope_attention(q, k, v, E[:2])
    with pytest.raises(ValueError, match="segment_ids must have"):
        cope_attention(q, k, v, E, segment_ids=np.zeros((2, 3), int))
    with pytest.raises(TypeError, match="q_positions"):
        cope_attention(q, k, v, E, q_positions=np.arange(9.0))


def test_unsorted_concrete_kv_positions_are_refused():
    """CoPE sums the gates of the keys between a key and its query on the key axis: keys
    out of position order give other numbers than the same keys sorted."""
    q, k, v, E = inputs(5, B=1, T=6)
    perm = np.array([0, 2, 1, 3, 4, 5])
    sorted_out = cope_attention(q, k, v, E)
    for kvp in (perm, jnp.asarray(perm), perm[None]):
        with pytest.raises(ValueError, match=r"kv_positions must be sorted.*key 1 at "
                                             r"position 2 before key 2 at position 1"):
            cope_attention(q, k[:, perm], v[:, perm], E, kv_positions=kvp)
    # under jit the values are unknown: the documented precondition, and why it matters
    f = jax.jit(lambda k, v, p: cope_attention(q, k, v, E, kv_positions=p))
    traced = f(k[:, perm], v[:, perm], jnp.asarray(perm))
    assert float(jnp.max(jnp.abs(traced - sorted_out))) > 0.1
    # unsorted in a segment no query has is fine
    seg = np.zeros((1, 6), int)
    kv_seg = np.array([[1, 1, 1, 0, 0, 0]])
    kvp = np.array([[5, 4, 3, 0, 1, 2]])
    got = cope_attention(q, k, v, E, kv_positions=kvp, segment_ids=seg, kv_segment_ids=kv_seg,
                         q_positions=np.arange(6))
    want = np_cope(q, k, v, E, q_positions=np.arange(6), kv_positions=kvp, segment_ids=seg,
                   kv_segment_ids=kv_seg)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_keys_no_query_sees_may_hold_any_position(impl):
    """Keys no query sees (a position past every query of their segment; a cache's empty
    slots: a segment no query has) are not checked, and the values equal the float64
    loop; once a query sees them, their order counts."""
    q, k, v, E = inputs(6, B=1, T=6)
    kvp = np.array([[0, 1, 9, 2, 0, 0]])  # slot 2 past every query, 4-5 empty slots
    kv_seg = np.array([[0, 0, 0, 0, 1, 1]])
    qp = np.array([[0, 1, 2]])
    got = cope_attention(q[:, :3], k, v, E, q_positions=qp, kv_positions=kvp,
                         segment_ids=np.zeros((1, 3), int), kv_segment_ids=kv_seg,
                         implementation=impl, block_size=2)
    want = np_cope(q[:, :3], k, v, E, q_positions=qp, kv_positions=kvp,
                   segment_ids=np.zeros((1, 3), int), kv_segment_ids=kv_seg)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6)
    qp = np.array([[0, 1, 9]])
    with pytest.raises(ValueError, match="key 2 at position 9 before key 3 at position 2"):
        cope_attention(q[:, :3], k, v, E, q_positions=qp, kv_positions=kvp,
                       segment_ids=np.zeros((1, 3), int), kv_segment_ids=kv_seg)
    out = cope_attention(q[:, :3], k, v, E, q_positions=qp, kv_positions=kvp,
                         segment_ids=np.zeros((1, 3), int), kv_segment_ids=kv_seg,
                         check_order=False)
    assert np.isfinite(np.asarray(out)).all()
