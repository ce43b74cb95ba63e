"""Token ids outside ``[0, vocab_size)``: concrete ones raise, traced ones (under ``jit``)
give NaN embedding rows, negative ids exactly like ids ``>= vocab_size`` (``jnp.take``
reads ``-1`` as the last row before its ``mode="fill"`` applies; the library must not)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxpos.linen
from jaxpos.layers.functional import embed_tokens
from jaxpos.nnx import DecoderLM

V = 16


def test_embed_tokens_under_jit_gives_nan_rows_for_negative_and_too_large_ids():
    """A 4-row table: ids 2 and 0 read their rows (times sqrt(d_model) = 2), ids -1, -4,
    -5 and 4 give all-NaN rows, not rows 3, 0 or any other; eagerly the
    same."""
    table = np.arange(16.0, dtype=np.float32).reshape(4, 4)
    ids = jnp.asarray([[2, -1, 0, 4, -4, -5]])
    rows = np.asarray(jax.jit(lambda e, t: embed_tokens(e, t, 4, jnp.float32))(table, ids))[0]
    np.testing.assert_array_equal(rows[0], 2.0 * table[2])
    np.testing.assert_array_equal(rows[2], 2.0 * table[0])
    assert np.isnan(rows[[1, 3, 4, 5]]).all()
    # outside jit the same lookup gives the same rows (check_tokens is what raises there)
    eager = np.asarray(embed_tokens(table, ids, 4, jnp.float32))[0]
    np.testing.assert_array_equal(eager, rows)


@pytest.fixture(scope="module")
def nnx_model():
    return DecoderLM(V, d_model=16, num_layers=1, num_heads=2, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("bad", [-1, V])
def test_nnx_decoder_negative_id_is_nan_under_jit_and_an_error_eagerly(nnx_model, bad):
    """Tokens [3, bad]: under nnx.jit the second position's logits are NaN (before the fix,
    -1 gave exactly the finite logits of [3, 15]; the NaN key may spread to the first row
    too, as the NaN rule allows); eagerly the call raises naming the range."""
    logits = np.asarray(nnx.jit(lambda m, t: m(t))(nnx_model, jnp.asarray([[3, bad]])))[0]
    assert np.isnan(logits[1]).all()
    with pytest.raises(ValueError, match=rf"tokens must lie in \[0, vocab_size={V}\)"):
        nnx_model(jnp.asarray([[3, bad]]))


def test_nnx_decode_step_negative_id_is_nan_under_jit(nnx_model):
    """The cached path embeds through the same lookup: a jitted decode step of token -1
    after the prompt [3] gives NaN logits, token 15 finite ones."""
    cache = nnx_model.init_cache(1, 4)

    @nnx.jit
    def two_steps(m, last):
        _, c = m.decode_step(jnp.asarray([[3]]), cache)
        return m.decode_step(last, c)[0]

    assert np.isnan(np.asarray(two_steps(nnx_model, jnp.asarray([[-1]])))).all()
    assert np.isfinite(np.asarray(two_steps(nnx_model, jnp.asarray([[V - 1]])))).all()


@pytest.mark.parametrize("bad", [-1, V])
def test_linen_decoder_negative_id_is_nan_under_jit_and_an_error_eagerly(bad):
    model = jaxpos.linen.DecoderLM(vocab_size=V, d_model=16, num_layers=1, num_heads=2)
    params = model.init(jax.random.key(0), jnp.asarray([[3, 1]]))["params"]
    apply = jax.jit(lambda p, t: model.apply({"params": p}, t))
    assert np.isnan(np.asarray(apply(params, jnp.asarray([[3, bad]])))[0, 1]).all()
    with pytest.raises(ValueError, match=rf"tokens must lie in \[0, vocab_size={V}\)"):
        model.apply({"params": params}, jnp.asarray([[3, bad]]))


def test_64_bit_ids_out_of_int32_range_give_nan_rows_under_jit():
    """In x64 mode an int64 id of 2**32 + 3 must not wrap to row 3 in the int32 cast."""
    from jaxpos.layers.functional import check_tokens

    old = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        table = np.arange(16.0, dtype=np.float32).reshape(4, 4)
        ids = jnp.asarray([[2 ** 32 + 3, 3, -(2 ** 32) + 1]], jnp.int64)
        look = jax.jit(lambda t, i: embed_tokens(t, check_tokens(i, 4), 4, jnp.float32))
        rows = np.asarray(look(table, ids))[0]
    finally:
        jax.config.update("jax_enable_x64", old)
    np.testing.assert_array_equal(rows[1], 2.0 * table[3])
    assert np.isnan(rows[[0, 2]]).all()
