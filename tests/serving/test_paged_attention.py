"""``jaxpos.attention(q, k_pages, v_pages, page_table=, kv_lengths=)``: the paged call
against a float64 NumPy softmax over each row's filled slots (read through the page
table by hand), its input checks, the NaN rule under ``jit``, rotation on load from
``rope_tables``, and that pages no query sees (past the fill, outside a sliding window)
never reach the result. The scheme x call-shape matrix is in ``tests/conformance``
(``paged_*`` paths)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpos
from jaxpos.core.paged import gather_pages
from jaxpos.schemes.rope.scaling import default_inv_freq
from jaxpos.schemes.rope.tables import rope_tables

B, N, NK, H, PS = 2, 4, 2, 8, 4


def _pages(num_pages=9, seed=0, Hv=H):
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(num_pages, PS, NK, H)).astype(np.float32)
    v = rng.normal(size=(num_pages, PS, NK, Hv)).astype(np.float32)
    return k, v


def _numpy_paged(q, k_pages, v_pages, table, lens, causal=True, window=None):
    """float64: slot s of row b = page table[b, s // PS] at s % PS; queries at positions
    lens - Tq + i; softmax over visible slots s < lens[b]."""
    q = np.asarray(q, np.float64)
    Bq, Tq, Nq, Hq = q.shape
    g = Nq // k_pages.shape[2]
    out = np.zeros(q.shape[:3] + (v_pages.shape[-1],))
    for b in range(Bq):
        slots = np.arange(lens[b])
        kk = np.asarray(k_pages, np.float64)[table[b, slots // PS], slots % PS]
        vv = np.asarray(v_pages, np.float64)[table[b, slots // PS], slots % PS]
        for i in range(Tq):
            qp = lens[b] - Tq + i
            vis = np.ones(len(slots), bool)
            if causal:
                vis &= slots <= qp
            if window is not None:
                vis &= qp - slots < window
            for h in range(Nq):
                if not vis.any():
                    continue
                s = kk[vis, h // g] @ q[b, i, h] / np.sqrt(Hq)
                p = np.exp(s - s.max())
                out[b, i, h] = (p / p.sum()) @ vv[vis, h // g]
    return out


TABLE = np.asarray([[5, 2, 7, 0], [3, 8, -1, -1]], np.int32)  # row 1 uses 2 pages; -1 unused
LENS = np.asarray([14, 6], np.int32)


@pytest.mark.parametrize("impl", ["chunked", "reference"])
@pytest.mark.parametrize("Tq", [1, 3])
def test_paged_call_equals_numpy_softmax_over_the_filled_slots(impl, Tq):
    k, v = _pages()
    q = np.random.default_rng(1).normal(size=(B, Tq, N, H)).astype(np.float32)
    out = jaxpos.attention(q, k, v, page_table=TABLE, kv_lengths=LENS, causal=True,
                           implementation=impl, block_k=PS)
    np.testing.assert_allclose(np.asarray(out), _numpy_paged(q, k, v, TABLE, LENS),
                               atol=2e-5, rtol=2e-5)


def test_paged_call_equals_dense_call_on_gathered_keys_with_alibi_and_sinks():
    k, v = _pages()
    q = jnp.asarray(np.random.default_rng(2).normal(size=(B, 1, N, H)), jnp.float32)
    kw = dict(position=jaxpos.ALiBi(N), sinks=jnp.asarray([0.5, -1.0, 2.0, 0.0]), causal=True)
    out = jaxpos.attention(q, k, v, page_table=TABLE, kv_lengths=LENS, block_k=8, **kw)
    dense = jaxpos.attention(q, gather_pages(k, TABLE), gather_pages(v, TABLE),
                             kv_lengths=LENS, q_positions=LENS[:, None] - 1,
                             implementation="reference", **kw)
    np.testing.assert_allclose(np.asarray(out), np.asarray(dense), atol=2e-6, rtol=2e-6)


def test_gather_pages_reads_slot_s_from_page_table_at_s_over_page_size():
    k, _ = _pages()
    g = np.asarray(gather_pages(k, TABLE))
    assert g.shape == (B, 4 * PS, NK, H)
    np.testing.assert_array_equal(g[0, 9], k[7, 1])  # slot 9: page table[0, 2] = 7, offset 1
    np.testing.assert_array_equal(g[1, 5], k[8, 1])


def test_unread_pages_never_reach_the_result():
    """NaN in every page no row reads, in the unfilled slots of a row's last page, and
    in the pages a sliding window of 5 leaves wholly behind the query: the chunked path
    gives the finite NumPy answer (it never loads them: even 0 * NaN would show)."""
    k, v = _pages()
    table = np.asarray([[5, 2, 7, 0], [3, 8, -1, -1]], np.int32)
    lens = np.asarray([14, 6], np.int32)
    v_nan = v.copy()
    for p in (1, 4, 6):  # owned by nobody
        v_nan[p] = np.nan
    v_nan[0, 2:] = np.nan  # row 0's last page: slots 14, 15 unfilled
    v_nan[8, 2:] = np.nan  # row 1's last page: slots 6, 7 unfilled
    v_nan[5] = np.nan  # row 0, slots 0-3: outside the window of the query at position 13
    q = np.random.default_rng(3).normal(size=(B, 1, N, H)).astype(np.float32)
    out = jaxpos.attention(q, k, v_nan, page_table=table, kv_lengths=lens, causal=True,
                           mask_mod=jaxpos.SlidingWindowMask(5), block_k=PS)
    want = _numpy_paged(q, k, v, table, lens, window=5)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=2e-5)


def test_rope_tables_rotate_paged_keys_on_load_like_the_rope_scheme():
    k, v = _pages()
    q = jnp.asarray(np.random.default_rng(4).normal(size=(B, 1, N, H)), jnp.float32)
    inv_freq = jnp.asarray(default_inv_freq(H, 10000.0), jnp.float32)
    q_pos = jnp.asarray(LENS[:, None] - 1)
    kv_pos = jnp.arange(4 * PS)
    tabs = rope_tables(q_pos, kv_pos, inv_freq)
    out = jaxpos.attention(q, k, v, page_table=TABLE, kv_lengths=LENS, causal=True,
                           rope_tables=tabs, block_k=PS)
    want = jaxpos.attention(q, k, v, page_table=TABLE, kv_lengths=LENS, causal=True,
                            position=jaxpos.RoPE(inv_freq), implementation="reference")
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_paged_decode_gradients_equal_the_gathered_reference():
    k, v = _pages()
    q = jnp.asarray(np.random.default_rng(5).normal(size=(B, 2, N, H)), jnp.float32)

    def loss(impl):
        def f(q, k, v):
            o = jaxpos.attention(q, k, v, page_table=TABLE, kv_lengths=LENS, causal=True,
                                 position=jaxpos.T5Bias(jnp.linspace(-1, 1, 32 * N).reshape(
                                     32, N), bidirectional=False), implementation=impl,
                                 block_k=PS)
            return jnp.sum(o * jnp.cos(jnp.arange(o.size, dtype=jnp.float32).reshape(o.shape)))
        return jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, jnp.asarray(k), jnp.asarray(v))

    for a, b in zip(loss("chunked"), loss("reference")):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5)


# ------------------------------------------------------------------------- bad input
def _call(**over):
    k, v = _pages()
    args = dict(q=np.zeros((B, 1, N, H), np.float32), k=k, v=v, page_table=TABLE,
                kv_lengths=LENS)
    args.update(over)
    return jaxpos.attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


@pytest.mark.parametrize("over, match", [
    (dict(page_table=np.asarray([[5, 2, 7, 0], [3, 9, -1, -1]])), r"page_table\[1, 1\] = 9"),
    (dict(page_table=np.asarray([[5, 2, -3, 0], [3, 8, -1, -1]])), r"page_table\[0, 2\] = -3"),
    (dict(kv_lengths=np.asarray([17, 6])), r"kv_lengths\[0\] = 17.*too short"),
    (dict(kv_lengths=np.asarray([14, -1])), r"kv_lengths\[1\] = -1"),
    (dict(kv_lengths=None), "kv_lengths is required"),
    (dict(page_table=TABLE[:1]), r"page_table must have shape \[B, pages_per_seq\]"),
    (dict(v=np.zeros((9, 3, NK, H), np.float32)), "v_pages must match k_pages"),
    (dict(k=np.zeros((9, PS, NK, 4), np.float32)), "k_pages must have q's head_dim 8"),
    (dict(k=np.zeros((9, PS, 3, H), np.float32), v=np.zeros((9, PS, 3, H), np.float32)),
     r"multiple of the pages' key/value heads \(3\)"),
    (dict(k=np.zeros((PS, NK, H), np.float32)), "k_pages must have rank 4"),
])
def test_bad_paged_input_raises_value_error_naming_the_argument(over, match):
    with pytest.raises(ValueError, match=match):
        _call(**over)


def test_float_page_table_is_a_type_error():
    with pytest.raises(TypeError, match="page_table must be an integer array"):
        _call(page_table=TABLE.astype(np.float32))


def test_traced_bad_lengths_or_page_indices_give_nan_rows_only_there():
    """Under jit the values cannot raise: the row reading page 9 of a pool of 9, and the
    row with kv_lengths 17 > 4 pages x 4 slots, are NaN; the other row is exact."""
    k, v = _pages()
    q = np.random.default_rng(6).normal(size=(B, 1, N, H)).astype(np.float32)
    f = jax.jit(lambda t, n: jaxpos.attention(q, k, v, page_table=t, kv_lengths=n,
                                              causal=True))
    good = _numpy_paged(q, k, v, TABLE, LENS)
    out = np.asarray(f(jnp.asarray([[5, 2, 7, 0], [3, 9, -1, -1]]), jnp.asarray(LENS)))
    assert np.isnan(out[1]).all()
    np.testing.assert_allclose(out[0], good[0], atol=2e-5, rtol=2e-5)
    out = np.asarray(f(jnp.asarray(TABLE), jnp.asarray([17, 6])))
    assert np.isnan(out[0]).all()
    np.testing.assert_allclose(out[1], good[1], atol=2e-5, rtol=2e-5)
    # an unused table entry may hold anything: row 1 reads pages 0-1 only
    out = np.asarray(f(jnp.asarray([[5, 2, 7, 0], [3, 8, 99, -7]]), jnp.asarray(LENS)))
    np.testing.assert_allclose(out, good, atol=2e-5, rtol=2e-5)
