"""T5 relative position buckets and bias (Raffel et al. 2020, §2.1).

The expected bucket ranges are worked out by hand from the bucket rule of §2.1 as
Mesh TensorFlow and Hugging Face's ``T5Attention._relative_position_bucket`` implement
it (half the buckets exact, the rest logarithmic up to ``max_distance``; the exhaustive
comparison with HF is in test_parity_t5_bucket.py).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import jaxpos
from jaxpos import relative_bias_attention, t5_bias, t5_bucket

# num_buckets=32, max_distance=128, bidirectional: 16 buckets per direction; distances
# 0..7 have their own bucket, then bucket 8 + floor(8 * log(n / 8) / log(128 / 8)):
# 8-11, 12-15, 16-22, 23-31, 32-45, 46-63, 64-90, 91+.
BIDIRECTIONAL_STARTS = [0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 23, 32, 46, 64, 91]
# Causal: 32 buckets for keys at or before the query, 0..15 exact, then 16 logarithmic
# buckets starting at these distances (Hugging Face transformers 5.x / T5).
CAUSAL_STARTS = list(range(16)) + [16, 19, 21, 24, 27, 31, 35, 40, 46, 52, 59, 67, 77, 87, 99, 113]


def bucket_from_ranges(rel, bidirectional=True):
    """Reference bucket of ``rel = kv - q`` from the written-out ranges above."""
    rel = np.asarray(rel, np.int64)
    if bidirectional:
        dist = np.abs(rel)
        b = np.searchsorted(BIDIRECTIONAL_STARTS, dist, side="right") - 1
        return b + 16 * (rel > 0)
    dist = np.maximum(-rel, 0)
    return np.searchsorted(CAUSAL_STARTS, dist, side="right") - 1


def test_bidirectional_ranges_both_directions():
    dist = np.arange(0, 3001)
    before = t5_bucket(-dist)  # keys before the query
    after = t5_bucket(dist)  # keys after the query
    for b, start in enumerate(BIDIRECTIONAL_STARTS):
        end = BIDIRECTIONAL_STARTS[b + 1] - 1 if b + 1 < 16 else 3000
        assert set(before[start:end + 1].tolist()) == {b}, (b, start, end)
        if end > 0:  # offset 0 is not "after"
            assert set(after[max(start, 1):end + 1].tolist()) == {16 + b}, (b, start, end)
    assert after[0] == 0  # offset 0 belongs to the lower half
    np.testing.assert_array_equal(before, bucket_from_ranges(-dist))
    np.testing.assert_array_equal(after, bucket_from_ranges(dist))


def test_causal_ranges():
    dist = np.arange(0, 3001)
    before = t5_bucket(-dist, bidirectional=False)
    np.testing.assert_array_equal(before[:16], np.arange(16))  # 16 exact buckets
    np.testing.assert_array_equal(before, bucket_from_ranges(-dist, bidirectional=False))
    assert sorted(set(before.tolist())) == list(range(32))  # all 32 buckets used
    np.testing.assert_array_equal(t5_bucket(dist[1:], bidirectional=False), 0)  # future keys


def test_numpy_in_numpy_out_jax_in_jax_out():
    rel = np.arange(-200, 201, dtype=np.int32)
    out_np = t5_bucket(rel)
    assert type(out_np) is np.ndarray and out_np.dtype == np.int32
    out_jax = t5_bucket(jnp.asarray(rel))
    assert isinstance(out_jax, jax.Array) and out_jax.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(out_jax), out_np)
    np.testing.assert_array_equal(t5_bucket(rel[:399].reshape(3, 7, 19)),
                                  out_np[:399].reshape(3, 7, 19))
    assert int(t5_bucket(-20)) == 10 and int(t5_bucket(20)) == 26


def test_t5_bias_values():
    rng = np.random.default_rng(1)
    table = rng.standard_normal((32, 3)).astype(np.float32)
    q, kv = np.array([0, 5, 120]), np.arange(0, 300, 7)
    b = np.asarray(t5_bias(q, kv, table))
    assert b.shape == (3, 3, len(kv)) and b.dtype == np.float32
    rel = kv[None, :] - q[:, None]
    np.testing.assert_array_equal(b, np.moveaxis(table[bucket_from_ranges(rel)], -1, 0))
    bc = np.asarray(t5_bias(q, kv, table, bidirectional=False))
    np.testing.assert_array_equal(bc, np.moveaxis(table[bucket_from_ranges(rel, False)], -1, 0))


def test_t5_bias_batched_translation_invariant():
    table = np.arange(64, dtype=np.float32).reshape(32, 2)
    pos = np.array([[0, 1, 2, 3], [50, 51, 52, 53]])
    b = np.asarray(t5_bias(pos, pos, table))
    assert b.shape == (2, 2, 4, 4)
    np.testing.assert_array_equal(b[0], b[1])


def np_relative_bias_attention(Q, K, V, table, causal=False):
    """float64 reference: softmax(Q K^T + table[bucket(j - i)]) V per head, no scaling."""
    Q, K, V = (np.asarray(x, np.float64) for x in (Q, K, V))
    T = Q.shape[-3]
    rel = np.arange(T)[None, :] - np.arange(T)[:, None]
    bias = np.moveaxis(np.asarray(table, np.float64)[bucket_from_ranges(rel, not causal)], -1, 0)
    s = np.einsum("...qnh,...knh->...nqk", Q, K) + bias
    if causal:
        s = np.where(rel[None] <= 0, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("...nqk,...knh->...qnh", p, V)


@pytest.mark.parametrize("causal", [False, True])
def test_relative_bias_attention_vs_float64(causal):
    # T = 100 reaches every bucket up to "91 onward".
    rng = np.random.default_rng(2)
    T, N, H = 100, 2, 4
    Q, K, V = (rng.standard_normal((2, T, N, H)).astype(np.float32) for _ in range(3))
    table = rng.standard_normal((32, N)).astype(np.float32)
    out = relative_bias_attention(Q, K, V, table, causal=causal)
    assert out.shape == (2, T, N, H) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out),
                               np_relative_bias_attention(Q, K, V, table, causal), atol=2e-5)
    # no leading axes: [T, N, H]
    out1 = relative_bias_attention(Q[1], K[1], V[1], table, causal=causal)
    np.testing.assert_allclose(np.asarray(out1), np.asarray(out[1]), atol=1e-6)


class TransformsTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters((True, 32, 128), (False, 32, 128), (True, 64, 256))
    def test_bucket_eager_and_jit_agree(self, bidirectional, num_buckets, max_distance):
        rel = np.arange(-400, 401, dtype=np.int32)
        f = self.variant(lambda r: t5_bucket(r, bidirectional, num_buckets, max_distance))
        chex.assert_trees_all_equal(np.asarray(f(jnp.asarray(rel))),
                                    t5_bucket(rel, bidirectional, num_buckets, max_distance))

    @chex.variants(with_jit=True, without_jit=True)
    def test_bias_eager_and_jit_agree(self):
        table = np.arange(96, dtype=np.float32).reshape(32, 3)
        q, kv = np.arange(5, dtype=np.int32), np.arange(0, 200, 10, dtype=np.int32)
        f = self.variant(t5_bias)
        rel = kv[None, :] - q[:, None]
        chex.assert_trees_all_equal(np.asarray(f(q, kv, table)),
                                    np.moveaxis(table[bucket_from_ranges(rel)], -1, 0))

    def test_vmap_matches_batched(self):
        rel = jnp.arange(-150, 150, dtype=jnp.int32).reshape(6, 50)
        chex.assert_trees_all_equal(jax.vmap(t5_bucket)(rel), t5_bucket(rel))
        table = jnp.ones((32, 2)) * jnp.arange(32.0)[:, None]
        pos = jnp.array([[0, 3, 9], [100, 0, 40]], jnp.int32)
        chex.assert_trees_all_equal(jax.vmap(lambda p: t5_bias(p, p, table))(pos),
                                    t5_bias(pos, pos, table))

    def test_gradient_reaches_the_table(self):
        # d/d table[b, h] of sum(bias) = number of (i, j) pairs in bucket b.
        pos = np.arange(10)
        g = jax.grad(lambda t: jnp.sum(t5_bias(pos, pos, t)))(jnp.zeros((32, 2)))
        counts = np.bincount(bucket_from_ranges(pos[None, :] - pos[:, None]).ravel(),
                             minlength=32)
        np.testing.assert_array_equal(np.asarray(g), np.stack([counts, counts], -1))


POS = np.arange(4)
TABLE = np.zeros((32, 2), np.float32)
BAD_INPUTS = [
    ("num_buckets", ValueError, lambda: t5_bucket(POS, num_buckets=31), "31"),
    ("num_buckets", ValueError, lambda: t5_bucket(POS, num_buckets=0), "0"),
    ("num_buckets", TypeError, lambda: t5_bucket(POS, num_buckets=32.0), "32.0"),
    ("max_distance", ValueError, lambda: t5_bucket(POS, max_distance=8), "8"),
    ("rel", TypeError, lambda: t5_bucket(np.arange(4.0)), "float64"),
    ("table", ValueError, lambda: t5_bias(POS, POS, np.zeros((16, 2), np.float32)), "(16, 2)"),
    ("q_positions", TypeError, lambda: t5_bias(np.arange(4.0), POS, TABLE), "float64"),
    ("kv_positions", ValueError, lambda: t5_bias(POS, np.zeros((1, 1, 4), np.int32), TABLE),
     "(1, 1, 4)"),
    ("num_buckets", ValueError,
     lambda: t5_bias(POS, POS, np.zeros((33, 2), np.float32), num_buckets=33), "33"),
    ("bias_table", ValueError,
     lambda: relative_bias_attention(*(np.zeros((4, 2, 3), np.float32),) * 3,
                                     np.zeros((32, 3), np.float32)), "(32, 3)"),
]


@pytest.mark.parametrize("argument, error, call, got", BAD_INPUTS,
                         ids=[f"{a}-{e.__name__}-{i}" for i, (a, e, _, _) in enumerate(BAD_INPUTS)])
def test_bad_input(argument, error, call, got):
    with pytest.raises(error) as info:
        call()
    msg = str(info.value)
    assert msg.startswith((argument + " ", argument + "=")), msg
    assert "got" in msg and got in msg, msg


@pytest.mark.parametrize("call", [
    lambda t: jaxpos.T5Bias(t, num_buckets=32),
    lambda t: jaxpos.t5_bias(np.arange(4), np.arange(4), t),
    lambda t: jaxpos.attention(np.ones((1, 4, 8, 16), np.float32),
                               np.ones((1, 4, 8, 16), np.float32),
                               np.ones((1, 4, 8, 16), np.float32), position=jaxpos.T5Bias(t)),
    lambda t: jaxpos.relative_bias_attention(np.ones((1, 4, 8, 16), np.float32),
                                             np.ones((1, 4, 8, 16), np.float32),
                                             np.ones((1, 4, 8, 16), np.float32), t),
], ids=["T5Bias", "t5_bias", "attention", "relative_bias_attention"])
def test_transposed_t5_table_is_named_as_transposed(call):
    """A table in [N, num_buckets] = [8, 32] layout (a transposed checkpoint array): the
    message names the expected [num_buckets, N] layout and says it looks transposed."""
    with pytest.raises(ValueError, match=r"\[num_buckets, N\].*looks transposed"):
        call(np.zeros((8, 32), np.float32))


@pytest.mark.parametrize("bidirectional", [True, False])
def test_scheme_bias_through_score_mod_matches_bucket_ranges(bidirectional):
    table = np.random.default_rng(2).standard_normal((32, 3)).astype(np.float32)
    q, kv = np.array([0, 5, 120]), np.arange(0, 300, 7)
    b = jaxpos.T5Bias(table, bidirectional=bidirectional).bias(q, kv)
    assert b.shape == (1, 3, 3, len(kv)) and b.dtype == jnp.float32
    rel = kv[None, :] - q[:, None]
    want = np.moveaxis(table[bucket_from_ranges(rel, bidirectional)], -1, 0)
    np.testing.assert_array_equal(np.asarray(b)[0], want)


def np_table_gradient(Q, K, V, W, table, q_pos, kv_pos, causal):
    """float64 reference of d sum(W * attention) / d table: the score gradient ``dS = P o
    (dO V^T - rowsum(dO o O))`` summed over every (batch, query, key) in each bucket."""
    Q, K, V, W = (np.asarray(x, np.float64) for x in (Q, K, V, W))
    rel = kv_pos[:, None, :] - q_pos[:, :, None]  # [B, Tq, Tk]
    buckets = bucket_from_ranges(rel, not causal)
    bias = np.moveaxis(np.asarray(table, np.float64)[buckets], -1, 1)  # [B, N, Tq, Tk]
    s = np.einsum("bqnh,bknh->bnqk", Q, K) + bias
    if causal:
        s = np.where(rel[:, None] <= 0, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("bnqk,bknh->bqnh", p, V)
    dp = np.einsum("bqnh,bknh->bnqk", W, V)
    ds = p * (dp - np.einsum("bqnh,bqnh->bnq", W, out)[..., None])
    grad = np.zeros(table.shape)
    for h in range(table.shape[1]):
        np.add.at(grad[:, h], buckets.ravel(), ds[:, h].ravel())
    return grad


@pytest.mark.parametrize("implementation, batch, positions, causal", [
    ("chunked", 3, "shared", True),      # consecutive tiles, one odd batch
    ("chunked", 2, "per_row", False),    # strided positions, a row each
    ("reference", 2, "shared", False),
])
def test_table_gradient_vs_float64(implementation, batch, positions, causal):
    # T = 140 > max_distance: offsets past 128 share the last bucket; 64-wide tiles leave
    # a padded last tile
    rng = np.random.default_rng(5)
    T, N, H = 140, 2, 4
    Q, K, V, W = (rng.standard_normal((batch, T, N, H)).astype(np.float32) for _ in range(4))
    table = rng.standard_normal((32, N)).astype(np.float32)
    if positions == "shared":
        pos = np.broadcast_to(np.arange(T), (batch, T))
        kw = {}
    else:
        pos = 2 * np.arange(T)[None, :] + 7 * np.arange(batch)[:, None]
        kw = {"q_positions": pos.astype(np.int32), "kv_positions": pos.astype(np.int32)}

    def loss(t):
        out = jaxpos.attention(Q, K, V, position=jaxpos.T5Bias(t, bidirectional=not causal),
                               causal=causal, scale=1.0, implementation=implementation,
                               block_q=64, block_k=64, **kw)
        return jnp.sum(out * W)

    got = jax.jit(jax.grad(loss))(jnp.asarray(table))
    want = np_table_gradient(Q, K, V, W, table, pos, pos, causal)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
