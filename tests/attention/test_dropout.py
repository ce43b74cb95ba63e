"""Attention dropout (jaxpos.attention's dropout_rate / dropout_rng / broadcast_dropout):
the keep fraction within binomial bounds, the 1 / (1 - rate) scaling (exactly, against a
float64 NumPy attention with the same mask, and in expectation over keys), the same mask
in the forward and backward pass (gradients against hand-derived float64 gradients with
that mask), the reference and chunked paths dropping the same pairs, and the refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpos
from jaxpos.core.dropout import Dropout, dropout_seed, keep_mask

B, T, N, H = 2, 12, 3, 8


def qkv(seed=0, Tq=T, Tk=T, Nk=N):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], (B, Tq, N, H)), jax.random.normal(ks[1], (B, Tk, Nk, H)),
            jax.random.normal(ks[2], (B, Tk, Nk, H)))


def mask_of(rate, key, broadcast=False, shape=(B, N, T, T)):
    return np.asarray(keep_mask(Dropout(rate, dropout_seed(key), broadcast), *shape))


def binomial_ok(kept: int, n: int, p: float, z: float = 5.0) -> bool:
    """|kept - n p| within z standard deviations of Binomial(n, p)."""
    return abs(kept - n * p) <= z * np.sqrt(n * p * (1 - p))


# ------------------------------------------------------------------------- the rate
@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_keep_fraction_is_within_binomial_bounds(rate):
    shape = (4, 8, 64, 64)  # 131072 pairs
    keep = mask_of(rate, jax.random.key(3), shape=shape)
    n = keep.size
    assert binomial_ok(int(keep.sum()), n, 1 - rate)
    # and per row and per column of the score grid, pooled over batch and heads
    # (4 * 8 * 64 = 2048 pairs each): no position is favoured
    for axis in ((0, 1, 3), (0, 1, 2)):
        per = keep.sum(axis=axis)
        m = n // per.size
        sd = np.sqrt(m * rate * (1 - rate))
        assert np.all(np.abs(per - m * (1 - rate)) <= 5 * sd)


def test_neighbouring_decisions_are_uncorrelated():
    keep = mask_of(0.5, jax.random.key(4), shape=(4, 8, 64, 64)).astype(np.float64)
    for a, b in ((keep[..., 1:], keep[..., :-1]),  # next key
                 (keep[:, :, 1:], keep[:, :, :-1]),  # next query
                 (keep[:, 1:], keep[:, :-1]),  # next head
                 (keep[1:], keep[:-1])):  # next batch row
        r = np.corrcoef(a.ravel(), b.ravel())[0, 1]
        assert abs(r) < 5 / np.sqrt(a.size), r  # |r| ~ N(0, 1/n) for independent bits


def test_keys_give_different_masks_and_a_key_the_same_one():
    a = mask_of(0.5, jax.random.key(0))
    assert np.array_equal(a, mask_of(0.5, jax.random.key(0)))
    assert np.array_equal(a, mask_of(0.5, jax.random.PRNGKey(0)))  # raw keys, same bits
    assert np.mean(a != mask_of(0.5, jax.random.key(1))) > 0.3
    broadcast = mask_of(0.5, jax.random.key(0), broadcast=True)
    assert broadcast.shape == (1, 1, T, T)


# ---------------------------------------------------- the mask attention actually applies
@pytest.mark.parametrize("implementation,blocks", [("reference", None), ("chunked", (4, 5)),
                                                   ("chunked", (16, 16))])
def test_attention_applies_the_keep_mask_scaled(implementation, blocks):
    """With q = 0 every weight is 1/Tk, and with v the one-hot key index the output entry
    (i, j) is ``keep_ij / ((1 - rate) Tk)``: attention shows its mask."""
    rate, key = 0.25, jax.random.key(8)
    q = jnp.zeros((B, T, N, H))
    k = jax.random.normal(jax.random.key(1), (B, T, N, H))
    v = jnp.broadcast_to(jnp.eye(T)[None, :, None, :], (B, T, N, T))
    bq, bk = blocks or (None, None)
    out = jaxpos.attention(q, k, v, dropout_rate=rate, dropout_rng=key,
                           implementation=implementation, block_q=bq, block_k=bk)
    shown = np.swapaxes(np.asarray(out), 1, 2) * (1 - rate) * T  # [B, N, Tq, Tk]
    np.testing.assert_allclose(shown, mask_of(rate, key), atol=1e-5)


def np_dropout_attention(q, k, v, keep, rate, causal):
    """Float64 ``softmax(q k^T / sqrt(H)) * keep / (1 - rate) @ v`` and its pieces."""
    q, k, v = (np.swapaxes(np.asarray(x, np.float64), 1, 2) for x in (q, k, v))
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    z = keep / (1 - rate)
    return np.swapaxes((p * z) @ v, 1, 2), (q, k, v, p, z)


@pytest.mark.parametrize("broadcast", [False, True])
@pytest.mark.parametrize("implementation", ["reference", "chunked"])
def test_output_equals_float64_attention_with_the_same_mask(implementation, broadcast):
    q, k, v = qkv()
    rate, key = 0.3, jax.random.key(2)
    keep = mask_of(rate, key, broadcast)
    want, _ = np_dropout_attention(q, k, v, keep, rate, causal=True)
    got = jaxpos.attention(q, k, v, causal=True, dropout_rate=rate, dropout_rng=key,
                           broadcast_dropout=broadcast, implementation=implementation,
                           block_q=4, block_k=8)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("implementation", ["reference", "chunked"])
def test_gradients_use_the_forward_mask(implementation):
    """Gradients of ``sum(O * W)`` against the float64 derivation with the same mask Z:
    dV = (P o Z)^T W, dP = Z o (W V^T), dS = P o (dP - rowsum(P o dP)), dQ = dS K / sqrt(H),
    dK = dS^T Q / sqrt(H). A backward pass drawing another mask would differ in dV at
    every dropped pair."""
    q, k, v = qkv(seed=1)
    w = jax.random.normal(jax.random.key(9), q.shape)
    rate, key = 0.4, jax.random.key(5)
    _, (q64, k64, v64, p, z) = np_dropout_attention(q, k, v, mask_of(rate, key), rate, True)
    w64 = np.swapaxes(np.asarray(w, np.float64), 1, 2)
    dv = np.swapaxes(p * z, -1, -2) @ w64
    dp = z * (w64 @ np.swapaxes(v64, -1, -2))
    ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))
    dq = ds @ k64 / np.sqrt(H)
    dk = np.swapaxes(ds, -1, -2) @ q64 / np.sqrt(H)

    def loss(q, k, v):
        out = jaxpos.attention(q, k, v, causal=True, dropout_rate=rate, dropout_rng=key,
                               implementation=implementation, block_q=4, block_k=8)
        return jnp.sum(out * w)

    got = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for g, want in zip(got, (dq, dk, dv)):
        np.testing.assert_allclose(np.swapaxes(np.asarray(g), 1, 2), want, atol=2e-5,
                                   rtol=1e-4)


def test_expected_output_is_the_output_without_dropout():
    """The mean over 256 keys approaches the undropped output: every entry within 5
    standard errors (the spread measured over the same keys)."""
    q, k, v = qkv(seed=2)
    rate = 0.5
    keys = jax.random.split(jax.random.key(11), 256)
    run = jax.jit(jax.vmap(lambda key: jaxpos.attention(
        q, k, v, causal=True, dropout_rate=rate, dropout_rng=key, implementation="reference")))
    outs = np.asarray(run(keys), np.float64)
    base = np.asarray(jaxpos.attention(q, k, v, causal=True, implementation="reference"))
    se = outs.std(axis=0, ddof=1) / np.sqrt(len(keys))
    # the first query sees one key, kept or dropped: mean value * 2 * keep-fraction
    assert np.all(np.abs(outs.mean(axis=0) - base) <= 5 * se + 1e-6)
    # and the spread is real: dropout changes the outputs
    assert np.median(se) > 1e-3


# ----------------------------------------------------------- the implementations agree
@pytest.mark.parametrize("case", ["gqa and sinks", "segments and alibi", "shaw value term",
                                  "mask_mod and cross lengths"])
def test_reference_and_chunked_drop_the_same_pairs(case):
    rate, key = 0.2, jax.random.key(6)
    kw, (q, k, v) = {}, qkv(seed=3)
    if case == "gqa and sinks":
        q, k, v = qkv(seed=3, Nk=1)
        kw = dict(sinks=jnp.array([0.5, -1.0, 2.0]), causal=True)
    elif case == "segments and alibi":
        seg = jnp.array([[0] * 5 + [1] * 7, [0] * 12])
        kw = dict(segment_ids=seg, position=jaxpos.ALiBi(N), causal=True)
    elif case == "shaw value term":
        table = jax.random.normal(jax.random.key(4), (9, H)) * 0.3
        kw = dict(position=jaxpos.Shaw(table, table))  # K = 4
    else:
        q, k, v = qkv(seed=3, Tq=7, Tk=12)
        kw = dict(mask_mod=jaxpos.SlidingWindowMask(4), causal=True)
    ref = jaxpos.attention(q, k, v, dropout_rate=rate, dropout_rng=key,
                           implementation="reference", **kw)
    chk = jaxpos.attention(q, k, v, dropout_rate=rate, dropout_rng=key,
                           implementation="chunked", block_q=4, block_k=4, **kw)
    np.testing.assert_allclose(chk, ref, atol=2e-6, rtol=1e-5)
    undropped = jaxpos.attention(q, k, v, implementation="reference", **kw)
    assert float(jnp.max(jnp.abs(ref - undropped))) > 1e-2


def test_default_implementation_runs_chunked_and_jit_matches_eager():
    q, k, v = qkv()
    key = jax.random.key(1)
    kw = dict(causal=True, dropout_rate=0.1, dropout_rng=key)
    eager = jaxpos.attention(q, k, v, **kw)
    np.testing.assert_array_equal(eager, jaxpos.attention(q, k, v, implementation="chunked",
                                                          **kw))
    jitted = jax.jit(lambda key: jaxpos.attention(q, k, v, causal=True, dropout_rate=0.1,
                                                  dropout_rng=key))(key)
    np.testing.assert_allclose(jitted, eager, atol=1e-6)


def test_zero_rate_is_no_dropout():
    q, k, v = qkv()
    np.testing.assert_array_equal(
        jaxpos.attention(q, k, v, dropout_rate=0.0, dropout_rng=jax.random.key(0)),
        jaxpos.attention(q, k, v))


# ---------------------------------------------------------------------------- refusals
def test_xla_refuses_dropout_naming_chunked():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="dropout.*implementation='chunked'"):
        jaxpos.attention(q, k, v, dropout_rate=0.1, dropout_rng=jax.random.key(0),
                         implementation="xla")


def test_bad_dropout_arguments_are_refused():
    q, k, v = qkv()
    key = jax.random.key(0)
    with pytest.raises(ValueError, match=r"dropout_rate must be in \[0, 1\)"):
        jaxpos.attention(q, k, v, dropout_rate=1.0, dropout_rng=key)
    with pytest.raises(ValueError, match=r"dropout_rate must be in \[0, 1\)"):
        jaxpos.attention(q, k, v, dropout_rate=-0.1, dropout_rng=key)
    with pytest.raises(ValueError, match="needs dropout_rng"):
        jaxpos.attention(q, k, v, dropout_rate=0.1)
    with pytest.raises(TypeError, match="dropout_rng must be a JAX PRNG key"):
        jaxpos.attention(q, k, v, dropout_rate=0.1, dropout_rng=0)
    with pytest.raises(TypeError, match="dropout_rate must be a Python float"):
        jax.jit(lambda r: jaxpos.attention(q, k, v, dropout_rate=r, dropout_rng=key))(0.1)
