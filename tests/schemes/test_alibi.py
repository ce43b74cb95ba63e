"""ALiBi (Press, Smith & Lewis 2022): the slopes of §3, including the rule of the authors'
code (``get_slopes``) for head counts that are not a power of two, and the bias
-m * |i - j|."""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from jaxpos import alibi_bias, alibi_slopes


def press_slopes_float64(n: int) -> np.ndarray:
    """Press et al.'s rule, written independently in float64.

    A power of two n: the geometric sequence starting at 2**(-8/n) with ratio 2**(-8/n).
    Otherwise: the slopes of the closest smaller power of two p, followed by every
    other slope (the 1st, 3rd, 5th, ...) of 2p, until there are n.
    """
    def geometric(m):
        start = 2.0 ** (-8.0 / m)
        return start * start ** np.arange(m, dtype=np.float64)

    if math.log2(n).is_integer():
        return geometric(n)
    p = 2 ** math.floor(math.log2(n))
    return np.concatenate([geometric(p), geometric(2 * p)[0::2][: n - p]])


def test_slopes_8_heads():
    # Press et al. 2022, §3: 8 heads -> 1/2, 1/4, ..., 1/256 (exact in float32).
    s = alibi_slopes(8)
    assert s.shape == (8,) and s.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(s),
                                  [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256])


def test_slopes_12_heads_written_out():
    # The authors' get_slopes for n not a power of two, n = 12: the 8 slopes of 8 heads,
    # then every other slope of 16 heads (2**-0.5, 2**-1, 2**-1.5, ...): 2**-0.5,
    # 2**-1.5, 2**-2.5, 2**-3.5.
    expected = [2.0 ** -e for e in (1, 2, 3, 4, 5, 6, 7, 8, 0.5, 1.5, 2.5, 3.5)]
    np.testing.assert_allclose(np.asarray(alibi_slopes(12)), expected, rtol=1e-7)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 7, 12, 16, 20, 24, 40, 64, 96])
def test_slopes_match_press_rule(n):
    np.testing.assert_allclose(np.asarray(alibi_slopes(n)), press_slopes_float64(n), rtol=1e-7)


def np_alibi(q_pos, kv_pos, slopes, bidirectional):
    rel = np.asarray(kv_pos, np.float64)[None, :] - np.asarray(q_pos, np.float64)[:, None]
    if bidirectional:
        rel = -np.abs(rel)
    return np.asarray(slopes, np.float64)[:, None, None] * rel[None]


def test_bias_causal_values():
    # Press et al. 2022, §3 (Fig. 3): bias -m * (i - j) for the keys j <= i a causal
    # query sees.
    slopes = alibi_slopes(4)
    pos = np.arange(6)
    b = np.asarray(alibi_bias(pos, pos, slopes))
    assert b.shape == (4, 6, 6) and b.dtype == np.float32
    i, j = np.tril_indices(6)
    for h, m in enumerate([2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8]):
        np.testing.assert_allclose(b[h, i, j], -m * (i - j), rtol=1e-7)
    np.testing.assert_allclose(b, np_alibi(pos, pos, slopes, False), rtol=1e-7)


def test_bias_bidirectional_values():
    slopes = alibi_slopes(2)
    q, kv = np.array([0, 3, 7]), np.arange(9)
    b = np.asarray(alibi_bias(q, kv, slopes, bidirectional=True))
    np.testing.assert_allclose(b, np_alibi(q, kv, slopes, True), rtol=1e-7)
    assert b[0, 1, 0] == b[0, 1, 6] == -3 * 2 ** -4  # symmetric around the query


def test_bias_batched_and_decode_positions():
    slopes = alibi_slopes(3)
    q = np.array([[4, 5], [10, 11]])  # [B, Tq]: two decoding steps at different offsets
    kv = np.array([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]])
    b = np.asarray(alibi_bias(q, kv, slopes))
    assert b.shape == (2, 3, 2, 6)
    for r in range(2):
        np.testing.assert_allclose(b[r], np_alibi(q[r], kv[r], slopes, False), rtol=1e-7)
    # translation invariance: both rows have the same offsets
    np.testing.assert_array_equal(b[0], b[1])
    # [B, Tq] queries with shared [Tk] keys broadcast
    b2 = np.asarray(alibi_bias(q, np.arange(12), slopes))
    assert b2.shape == (2, 3, 2, 12)
    np.testing.assert_allclose(b2[1], np_alibi(q[1], np.arange(12), slopes, False), rtol=1e-7)


class TransformsTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(False, True)
    def test_eager_and_jit_agree(self, bidirectional):
        slopes = alibi_slopes(6)
        q, kv = np.arange(3, 8, dtype=np.int32), np.arange(8, dtype=np.int32)
        f = self.variant(lambda a, b, s: alibi_bias(a, b, s, bidirectional=bidirectional))
        chex.assert_trees_all_close(f(q, kv, slopes), np_alibi(q, kv, slopes, bidirectional),
                                    rtol=1e-6)

    def test_vmap_matches_batched(self):
        slopes = alibi_slopes(4)
        q = jnp.array([[0, 1, 2], [5, 6, 7]], jnp.int32)
        chex.assert_trees_all_close(jax.vmap(lambda p: alibi_bias(p, p, slopes))(q),
                                    alibi_bias(q, q, slopes), atol=0)
        f = jax.jit(alibi_slopes, static_argnums=0)
        chex.assert_trees_all_equal(f(12), alibi_slopes(12))


F32 = np.float32
BAD_INPUTS = [
    ("num_heads", ValueError, lambda: alibi_slopes(0), "0"),
    ("num_heads", ValueError, lambda: alibi_slopes(-4), "-4"),
    ("num_heads", TypeError, lambda: alibi_slopes(8.0), "8.0"),
    ("q_positions", TypeError, lambda: alibi_bias(np.arange(3, dtype=F32), np.arange(3),
                                                  alibi_slopes(2)), "float32"),
    ("kv_positions", TypeError, lambda: alibi_bias(np.arange(3), np.arange(3.0),
                                                   alibi_slopes(2)), "float64"),
    ("kv_positions", ValueError, lambda: alibi_bias(np.arange(3), np.zeros((1, 1, 3), np.int32),
                                                    alibi_slopes(2)), "(1, 1, 3)"),
    ("slopes", ValueError, lambda: alibi_bias(np.arange(3), np.arange(3),
                                              np.ones((2, 2), F32)), "(2, 2)"),
    ("q_positions", ValueError, lambda: alibi_bias(np.zeros((2, 3), np.int32),
                                                   np.zeros((3, 3), np.int32), alibi_slopes(2)),
     "2 and 3"),
]


@pytest.mark.parametrize("argument, error, call, got", BAD_INPUTS,
                         ids=[f"{a}-{e.__name__}-{i}" for i, (a, e, _, _) in enumerate(BAD_INPUTS)])
def test_bad_input(argument, error, call, got):
    with pytest.raises(error) as info:
        call()
    msg = str(info.value)
    assert msg.startswith(argument + " "), msg
    assert "got" in msg and got in msg, msg


def test_scheme_bias_through_score_mod_matches_float64():
    from jaxpos import ALiBi

    for bidirectional in (False, True):
        s = ALiBi(3, bidirectional=bidirectional)
        q, kv = np.array([0, 4, 9]), np.arange(11)
        b = s.bias(q, kv)
        assert b.shape == (1, 3, 3, 11) and b.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(b)[0], np_alibi(q, kv, s.slopes, bidirectional),
                                   rtol=1e-7)
    qb, kvb = np.array([[4, 5], [10, 11]]), np.array([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]])
    b = np.asarray(ALiBi(3).bias(qb, kvb))
    assert b.shape == (2, 3, 2, 6)
    for r in range(2):
        np.testing.assert_allclose(b[r], np_alibi(qb[r], kvb[r], alibi_slopes(3), False),
                                   rtol=1e-7)
    assert ALiBi(3).bias(np.arange(2), np.arange(4), batch_size=5).shape == (5, 3, 2, 4)
