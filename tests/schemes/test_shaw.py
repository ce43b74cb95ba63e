"""Shaw, Uszkoreit & Vaswani 2018 relative keys and values (§3): the efficient form in
jaxpos against the naive form that materialises the ``[T, T, H]`` tensor of relative
vectors, in float64 NumPy, on offsets beyond the clipping distance K in both
directions."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpos import Shaw, shaw_attention
from jaxpos.schemes.shaw import shaw_clipped_index


def np_shaw_naive(q, k, v, rel_k, rel_v, q_pos, kv_pos, causal=False, scale=None):
    """float64, Shaw et al. eq. (3)-(4) with the naive [Tq, Tk, H] tensors a_K, a_V.

    q ``[B, Tq, N, H]``; k, v ``[B, Tk, N, H]``; positions ``[B, T]``.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    H = q.shape[-1]
    scale = 1 / np.sqrt(H) if scale is None else scale
    K = (rel_k.shape[0] - 1) // 2
    out = np.zeros(q.shape[:3] + (v.shape[-1],))
    for b in range(q.shape[0]):
        rel = kv_pos[b][None, :] - q_pos[b][:, None]  # n - m
        r = np.clip(rel, -K, K) + K
        aK = np.asarray(rel_k, np.float64)[r]  # [Tq, Tk, H], the naive tensor
        e = (np.einsum("qnh,knh->nqk", q[b], k[b]) + np.einsum("qnh,qkh->nqk", q[b], aK)) * scale
        if causal:
            e = np.where((rel <= 0)[None], e, -np.inf)
        p = np.exp(e - e.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[b] = np.einsum("nqk,knh->qnh", p, v[b])
        if rel_v is not None:
            aV = np.asarray(rel_v, np.float64)[r]
            out[b] += np.einsum("nqk,qkh->qnh", p, aV)
    return out


# jit once per configuration: eager attention compiles every primitive separately.
shaw_jit = jax.jit(shaw_attention, static_argnames=("causal", "implementation", "block_q",
                                                   "block_k"))


def _inputs(B=2, Tq=9, Tk=9, N=2, H=4, K=2, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    return f(B, Tq, N, H), f(B, Tk, N, H), f(B, Tk, N, H), f(2 * K + 1, H), f(2 * K + 1, H)


def test_clipped_index_values():
    # Shaw et al. 2018, §3.2: clip(n - m, -K, K); row r + K of the table is offset r.
    # K = 1, T = 4.
    idx = np.asarray(shaw_clipped_index(jnp.arange(4), jnp.arange(4), 1))
    np.testing.assert_array_equal(idx, [[1, 2, 2, 2],
                                        [0, 1, 2, 2],
                                        [0, 0, 1, 2],
                                        [0, 0, 0, 1]])


@pytest.mark.parametrize("implementation, causal, values", [
    ("reference", False, True), ("reference", True, False),
    ("chunked", False, False), ("chunked", True, True)])
def test_matches_naive_reference(implementation, causal, values):
    # T = 9 with K = 2: offsets -8..8, far beyond K in both directions.
    q, k, v, rel_k, rel_v = _inputs()
    rel_v = rel_v if values else None
    out = shaw_jit(q, k, v, rel_k, rel_v, causal=causal, implementation=implementation,
                   block_q=4, block_k=4)
    pos = np.broadcast_to(np.arange(9), (2, 9))
    expected = np_shaw_naive(q, k, v, rel_k, rel_v, pos, pos, causal)
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5)


def test_chunked_small_blocks_and_explicit_positions():
    # Decoding 3 queries at positions 6..8 against 9 keys; rows of the batch at
    # different absolute offsets; blocks that do not divide the lengths.
    q, k, v, rel_k, rel_v = _inputs(Tq=3, Tk=9)
    q_pos = np.array([[6, 7, 8], [106, 107, 108]], np.int32)
    kv_pos = np.array([np.arange(9), np.arange(100, 109)], np.int32)
    expected = np_shaw_naive(q, k, v, rel_k, rel_v, q_pos, kv_pos, causal=True)
    for impl, blocks in (("reference", {}), ("chunked", {"block_q": 2, "block_k": 4})):
        out = shaw_jit(q, k, v, rel_k, rel_v, q_positions=q_pos, kv_positions=kv_pos,
                       causal=True, implementation=impl, **blocks)
        np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, err_msg=impl)


def test_offsets_beyond_K_share_the_end_rows():
    # Changing row 0 (offset -K) of rel_k changes exactly the scores with n - m <= -K.
    q, _k, _v, rel_k, _ = _inputs(B=1, N=1)
    pos = np.arange(9)[None]
    scheme = Shaw(jnp.asarray(rel_k))
    qs = jnp.swapaxes(jnp.asarray(q), 1, 2)
    base = np.asarray(scheme.content_bias(qs, jnp.asarray(pos), jnp.asarray(pos)))
    bumped_table = rel_k.copy()
    bumped_table[0] += 1.0
    bumped = np.asarray(Shaw(jnp.asarray(bumped_table)).content_bias(qs, jnp.asarray(pos),
                                                              jnp.asarray(pos)))
    rel = pos[0][None, :] - pos[0][:, None]
    changed = ~np.isclose(base, bumped)[0, 0]
    np.testing.assert_array_equal(changed, rel <= -2)


class TransformsTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_eager_and_jit_agree(self):
        q, k, v, rel_k, rel_v = _inputs(B=1, Tq=6, Tk=6)
        f = self.variant(lambda *a: shaw_attention(*a, implementation="reference"))
        pos = np.arange(6)[None]
        chex.assert_trees_all_close(f(q, k, v, rel_k, rel_v),
                                    np_shaw_naive(q, k, v, rel_k, rel_v, pos, pos), atol=2e-5)

    def test_vmap_matches_batched(self):
        q, k, v, rel_k, rel_v = _inputs(B=2, Tq=5, Tk=5)
        f = lambda a, b, c: shaw_attention(a[None], b[None], c[None], rel_k, rel_v,
                                           implementation="reference")[0]
        chex.assert_trees_all_close(jax.jit(jax.vmap(f))(q, k, v),
                                    shaw_jit(q, k, v, rel_k, rel_v, implementation="reference"),
                                    atol=1e-6)

    def test_gradients_of_tables_match_between_implementations(self):
        q, k, v, rel_k, rel_v = _inputs(B=1, Tq=6, Tk=6)

        def loss(tables, impl):
            out = shaw_jit(q, k, v, *tables, causal=True, implementation=impl, block_q=4,
                           block_k=4)
            return jnp.sum(out * jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape))

        grad = jax.jit(jax.grad(loss), static_argnums=1)
        g_ref = grad((rel_k, rel_v), "reference")
        g_chk = grad((rel_k, rel_v), "chunked")
        chex.assert_trees_all_close(g_chk, g_ref, atol=1e-3, rtol=1e-4)


Q, KV, TAB = _inputs(B=1, Tq=4, Tk=4)[0], _inputs(B=1, Tq=4, Tk=4)[1], np.zeros((5, 4), np.float32)
BAD_INPUTS = [
    ("rel_k", ValueError, lambda: shaw_attention(Q, KV, KV, np.zeros((4, 4), np.float32), None),
     "(4, 4)"),
    ("rel_k", ValueError, lambda: shaw_attention(Q, KV, KV, np.zeros((5, 3), np.float32), None),
     "(5, 3)"),
    ("rel_k", ValueError, lambda: shaw_attention(Q, KV, KV, np.zeros(5, np.float32), None), "(5,)"),
    ("rel_k", TypeError, lambda: shaw_attention(Q, KV, KV, np.zeros((5, 4), np.int32), None),
     "int32"),
    ("rel_v", ValueError, lambda: shaw_attention(Q, KV, KV, TAB, np.zeros((7, 4), np.float32)),
     "(7, 4)"),
    ("q_positions", ValueError,
     lambda: shaw_attention(Q, KV, KV, TAB, TAB, q_positions=np.arange(5)), "(5,)"),
    ("kv_positions", ValueError,
     lambda: shaw_attention(Q, KV, KV, TAB, TAB, kv_positions=np.zeros((2, 4), np.int32)),
     "(2, 4)"),
    ("q_positions", TypeError,
     lambda: shaw_attention(Q, KV, KV, TAB, TAB, q_positions=np.arange(4.0)), "float64"),
]


@pytest.mark.parametrize("argument, error, call, got", BAD_INPUTS,
                         ids=[f"{a}-{e.__name__}-{i}" for i, (a, e, _, _) in enumerate(BAD_INPUTS)])
def test_bad_input(argument, error, call, got):
    with pytest.raises(error) as info:
        call()
    msg = str(info.value)
    assert msg.startswith(argument + " "), msg
    assert "got" in msg and got in msg, msg
