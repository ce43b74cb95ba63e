"""The modules' paged KV cache (``init_cache(batch, max_len, page_size=, num_pages=)``):
decoding with it gives the dense cache's logits, which equal the full pass, for the
positions the modules build (each way of writing and reading a cache once), through a
Hugging Face left-padded ``attention_mask``, a prefill in two chunks and single-token
steps; pages are taken as rows grow (a pool smaller than ``batch x max_len``), and
running out of pages raises (concrete) or gives NaN rows (under ``jit``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpos import linen as jl
from jaxpos import nnx as jn
from jaxpos.layers.cache import PagedKVCache

V, D, N = 40, 16, 2
DEFAULT = {"rope", "t5"}  # the rest (and Linen) in the slow run
#: Positions whose layers write and read a cache as one of the others does, left out of
#: the paged-vs-dense sweep (each still decodes in tests/modules/test_decode_equals_full_pass
#: and the conformance suite's module_cached_decode): NoPE and the input-added sinusoid
#: (raw keys, no bias), KERPLE's power form and Sandwich (a bias from positions, as the
#: KERPLE log form and ALiBi), NoPE's temperature and SSMax (a query scale from positions).
SAME_CACHE_PATH = {"nope", "sinusoidal", "kerple_power", "sandwich", "nope_temperature",
                   "ssmax"}
MASK = np.array([[1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1, 1]])  # row 1 left-padded


def _nnx(position, **kw):
    return jn.DecoderLM(V, d_model=D, num_layers=2, num_heads=N, position=position, max_len=32,
                        rngs=nnx.Rngs(0), **kw)


def _decode_all(m, tokens, cache):
    """Prefill the first 5 tokens in two chunks (3 + 2) with the padding mask, then one
    token per step; the logits of every token, ``[B, T, V]``."""
    out = []
    for a, b in ((0, 3), (3, 5)):
        logits, cache = m.decode_step(tokens[:, a:b], cache, attention_mask=MASK[:, a:b])
        out.append(logits)
    for t in range(5, tokens.shape[1]):
        logits, cache = m.decode_step(tokens[:, t:t + 1], cache)
        out.append(logits)
    return np.asarray(jnp.concatenate(out, axis=1)), cache


@pytest.mark.parametrize("position", [
    pytest.param(p, marks=() if p in DEFAULT else pytest.mark.slow)
    for p in jn.POSITIONS if p not in SAME_CACHE_PATH])
def test_paged_cache_decoding_equals_the_dense_cache_and_the_full_pass(position):
    m = _nnx(position)
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, V)
    dense, _ = _decode_all(m, tokens, m.init_cache(2, 12))
    paged, cache = _decode_all(m, tokens, m.init_cache(2, 12, page_size=4, num_pages=5))
    np.testing.assert_allclose(paged, dense, rtol=2e-5, atol=2e-5)
    full = np.asarray(m(tokens, attention_mask=MASK))
    real = MASK.astype(bool)
    np.testing.assert_allclose(paged[real], full[real], rtol=2e-5, atol=2e-5)
    c = getattr(cache[0], "inner", cache[0])  # PaTH's caches carry its decode state around it
    assert isinstance(c, PagedKVCache)
    # 8 slots per row in pages of 4: two pages each, handed out in order
    np.testing.assert_array_equal(np.asarray(c.page_table)[:, :2], [[0, 2], [1, 3]])
    assert int(c.next_page) == 4 and c.k_pages.shape[0] == 5


@pytest.mark.slow
def test_linen_paged_cache_equals_its_dense_cache():
    m = jl.DecoderLM(V, d_model=D, num_layers=2, num_heads=N, position="rope")
    tokens = jax.random.randint(jax.random.key(2), (2, 6), 0, V)
    params = m.init(jax.random.key(0), tokens)

    def run(cache):
        logits, cache = m.apply(params, tokens[:, :4], cache, method="decode_step")
        step, _ = m.apply(params, tokens[:, 4:5], cache, method="decode_step")
        return np.asarray(jnp.concatenate([logits, step], 1))

    np.testing.assert_allclose(run(m.init_cache(2, 8, page_size=2, num_pages=6)),
                               run(m.init_cache(2, 8)), rtol=2e-5, atol=2e-5)


def test_multi_head_attention_takes_a_paged_cache():
    mha = jn.MultiHeadAttention(D, N, num_kv_heads=1, rngs=nnx.Rngs(0), causal=True)
    x = jax.random.normal(jax.random.key(3), (2, 5, D))
    dense, _ = mha.decode(x, mha.init_cache(2, 8))
    paged, cache = mha.decode(x, mha.init_cache(2, 8, page_size=2))
    np.testing.assert_allclose(np.asarray(paged), np.asarray(dense), rtol=2e-5, atol=2e-5)
    assert cache.k_pages.shape == (8, 2, 1, D // N)  # default pool: every row full


def test_running_out_of_pages_raises_or_gives_nan_rows_under_jit():
    m = _nnx("alibi")
    tokens = jnp.ones((2, 5), jnp.int32)
    with pytest.raises(ValueError, match="out of pages: this write needs 4 more page"):
        m.decode_step(tokens, m.init_cache(2, 8, page_size=4, num_pages=3))
    with pytest.raises(ValueError, match="KV cache overflow"):
        m.decode_step(jnp.ones((1, 9), jnp.int32), m.init_cache(1, 8, page_size=4))

    @nnx.jit
    def step(m, tokens, cache):
        return m.decode_step(tokens, cache)

    # 3 pages: row 0 takes pages 0 and 1, row 1 gets page 2 only and cannot hold token 5
    logits, _ = step(m, tokens, m.init_cache(2, 8, page_size=4, num_pages=3))
    logits = np.asarray(logits)
    assert np.isfinite(logits[0]).all() and np.isnan(logits[1]).all()


def test_a_negative_fill_of_a_paged_view_raises_or_writes_nothing_under_jit():
    """A paged cache over a loop's pages (paged_view) with lengths [-1, 2]: eagerly a
    ValueError; under jit row 0's logits are NaN and its pages, positions and validity are
    untouched (a negative slot would wrap to the row's last slots), row 1's logits equal
    those of the same view with row 0 filled to 0."""
    from jaxpos.layers.cache.paged import paged_view

    m = _nnx("rope")
    pool = m.init_cache(2, 8, page_size=4, num_pages=4)
    table = jnp.asarray([[0, 1], [2, 3]])
    views = lambda lengths: tuple(paged_view(c.k_pages, c.v_pages, table, jnp.asarray(lengths))
                                  for c in pool)
    tokens = jnp.asarray([[3], [5]])
    with pytest.raises(ValueError, match=r"lengths must be >= 0.*\[-1, 2\]"):
        m.decode_step(tokens, views([-1, 2]), positions=jnp.asarray([[0], [2]]))

    @nnx.jit
    def step(m, lengths):
        return m.decode_step(tokens, views(lengths), positions=jnp.asarray([[0], [2]]))

    logits, caches = step(m, jnp.asarray([-1, 2]))
    good, _ = step(m, jnp.asarray([0, 2]))
    logits = np.asarray(logits)
    assert np.isnan(logits[0]).all()
    np.testing.assert_array_equal(logits[1], np.asarray(good)[1])
    for c in caches:
        np.testing.assert_array_equal(np.asarray(c.k_pages)[:2], 0.0)  # row 0's pages
        np.testing.assert_array_equal(np.asarray(c.valid)[0], [0] * 8)
        np.testing.assert_array_equal(np.asarray(c.positions)[0], np.arange(8))
