"""Stick-breaking attention (Tan et al. 2025, §2, Eq. 1): weights written out by hand, values
of both implementations against a float64 NumPy loop over the product formula (the four
diagonal conventions, grouped-query heads, packed segments), gradients against float64
finite differences, decoding one query against the full pass, the chunked path's O(T)
intermediates, and bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpos
from jaxpos.core.stick_breaking import stick_breaking_attention, stick_breaking_weights

IMPLS = ["reference", "chunked"]
TILES = {"block_q": 4, "block_k": 3}  # several tiles per axis, lengths not multiples


def np_stick_breaking(q, k, v, *, attend_current=False, remainder=True, seg=None, pos=None):
    """float64, a loop over Eq. 1: ``A_ij = beta_ij prod_{j<m<i} (1 - beta_im)`` over the
    keys ``j`` the query sees (same segment, position before it, or equal with
    ``attend_current``), plus ``(1 - sum_j A_ij) v_i`` with ``remainder``."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, N, H = q.shape
    g = N // k.shape[2]
    k, v = np.repeat(k, g, 2), np.repeat(v, g, 2)
    seg = np.zeros((B, T), int) if seg is None else np.asarray(seg)
    pos = np.broadcast_to(np.arange(T) if pos is None else np.asarray(pos), (B, T))
    out = np.zeros((B, T, N, v.shape[-1]))
    for b in range(B):
        for n in range(N):
            for i in range(T):
                beta = 1.0 / (1.0 + np.exp(-(k[b, :, n] @ q[b, i, n]) / np.sqrt(H)))
                keys = [j for j in range(T) if seg[b, j] == seg[b, i] and (
                    pos[b, j] < pos[b, i] or (attend_current and pos[b, j] == pos[b, i]))]
                total = 0.0
                for j in keys:
                    a = beta[j] * np.prod([1.0 - beta[m] for m in keys if m > j])
                    out[b, i, n] += a * v[b, j, n]
                    total += a
                if remainder:
                    out[b, i, n] += (1.0 - total) * v[b, i, n]
    return out


def qkv(seed, B=2, T=10, N=4, Nk=2, H=8):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(ks[0], (B, T, N, H)), jax.random.normal(ks[1], (B, T, Nk, H)),
            jax.random.normal(ks[2], (B, T, Nk, H)))


def test_weights_written_out():
    # All scores 0: every beta is 1/2. Query 2 sees keys 0 and 1: A_21 = 1/2, A_20 = 1/2 *
    # (1 - 1/2) = 1/4, and the remainder 1/4 goes to its own key; query 0 keeps all of it.
    pos = jnp.arange(3, dtype=jnp.int32)[None]
    w = stick_breaking_weights(jnp.zeros((1, 1, 3, 3)), pos, pos)
    np.testing.assert_allclose(np.asarray(w)[0, 0], [[1, 0, 0], [0.5, 0.5, 0],
                                                     [0.25, 0.5, 0.25]], rtol=1e-6)
    # attend_current: the query's own key breaks first (1/2), the next 1/4, ...
    w = stick_breaking_weights(jnp.zeros((1, 1, 3, 3)), pos, pos, attend_current=True,
                               remainder=False)
    np.testing.assert_allclose(np.asarray(w)[0, 0], [[0.5, 0, 0], [0.25, 0.5, 0],
                                                     [0.125, 0.25, 0.5]], rtol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("attend_current,remainder", [
    (False, True), pytest.param(False, False, marks=pytest.mark.slow),
    pytest.param(True, True, marks=pytest.mark.slow), (True, False)])
def test_values_match_float64(impl, attend_current, remainder):
    q, k, v = qkv(0)
    out = stick_breaking_attention(q, k, v, attend_current=attend_current,
                                   remainder=remainder, implementation=impl, **TILES)
    ref = np_stick_breaking(q, k, v, attend_current=attend_current, remainder=remainder)
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_packed_segments(impl):
    q, k, v = qkv(1, B=1, T=11)
    seg = np.array([[0] * 4 + [1] * 7])
    pos = np.array([list(range(4)) + list(range(7))])  # positions restart per segment
    out = stick_breaking_attention(q, k, v, q_positions=pos, kv_positions=pos,
                                   segment_ids=seg, implementation=impl, **TILES)
    ref = np_stick_breaking(q, k, v, seg=seg, pos=pos)
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("attend_current", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_gradients_match_float64_finite_differences(impl, attend_current):
    q, k, v = qkv(2, B=1, T=7, N=2, Nk=1, H=4)
    seg = np.array([[0, 0, 0, 1, 1, 1, 1]])
    w = np.asarray(jax.random.normal(jax.random.PRNGKey(5), (1, 7, 2, 4)), np.float64)

    def loss64(q, k, v):
        return float(np.sum(w * np_stick_breaking(q, k, v, seg=seg,
                                                  attend_current=attend_current)))

    def loss(q, k, v):
        return jnp.sum(jnp.asarray(w, jnp.float32) * stick_breaking_attention(
            q, k, v, segment_ids=seg, attend_current=attend_current, implementation=impl,
            **TILES))

    g = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    args = [np.asarray(x, np.float64) for x in (q, k, v)]
    rng = np.random.default_rng(0)
    eps = 1e-6
    for i, name in enumerate("qkv"):
        d = rng.standard_normal(args[i].shape)
        hi, lo = list(args), list(args)
        hi[i], lo[i] = args[i] + eps * d, args[i] - eps * d
        fd = (loss64(*hi) - loss64(*lo)) / (2 * eps)
        got = float(np.sum(np.asarray(g[i], np.float64) * d))
        assert abs(got - fd) <= 1e-4 * max(1.0, abs(fd)), (name, got, fd)


@pytest.mark.parametrize("impl", IMPLS)
def test_one_query_against_cached_keys_equals_the_full_pass(impl):
    # Decoding: the last token's query against every key (its own included) at its position.
    q, k, v = qkv(3, B=2, T=9)
    full = stick_breaking_attention(q, k, v, implementation=impl, **TILES)
    last = stick_breaking_attention(q[:, -1:], k, v, q_positions=jnp.array([8]),
                                    implementation=impl, **TILES)
    np.testing.assert_allclose(np.asarray(last), np.asarray(full[:, -1:]), atol=1e-6)


def _intermediate_shapes(jaxpr):
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield getattr(var.aval, "shape", ())
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (list, tuple)) else [p]):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    yield from _intermediate_shapes(getattr(inner, "jaxpr", inner))


def test_chunked_forward_and_backward_hold_no_length_squared_array():
    T = 64
    q, k, v = qkv(4, B=1, T=T, N=2, Nk=2, H=4)
    f = lambda q, k, v: jnp.sum(stick_breaking_attention(q, k, v, implementation="chunked",
                                                         block_q=8, block_k=8))
    jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(q, k, v).jaxpr
    big = [s for s in _intermediate_shapes(jaxpr) if int(np.prod(s)) >= T * T]
    assert not big, big
    dense = jax.make_jaxpr(lambda q, k, v: stick_breaking_attention(
        q, k, v, implementation="reference"))(q, k, v).jaxpr
    assert any(int(np.prod(s)) >= T * T for s in _intermediate_shapes(dense))  # the check bites


def test_exported_and_bad_input():
    assert jaxpos.stick_breaking_attention is stick_breaking_attention
    q, k, v = qkv(5, B=1, T=4)
    with pytest.raises(ValueError, match="causal by definition"):
        stick_breaking_attention(q, k, v, causal=False)
    with pytest.raises(ValueError, match="implementation"):
        stick_breaking_attention(q, k, v, implementation="pallas")
    with pytest.raises(ValueError, match="segment_ids must have shape"):
        stick_breaking_attention(q, k, v, segment_ids=np.zeros((1, 3), np.int32))
    with pytest.raises(ValueError, match="q_positions"):
        stick_breaking_attention(q, k, v, q_positions=np.arange(5))
    with pytest.raises(ValueError, match="block_q"):
        stick_breaking_attention(q, k, v, block_q=0)
