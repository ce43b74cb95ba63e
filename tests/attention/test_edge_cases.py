"""Edge cases: empty sequences, positions past int32,
non-static flags, and integer tables, each with a clear outcome."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpos


@pytest.mark.parametrize("impl", jaxpos.IMPLEMENTATIONS)
def test_empty_sequences_give_empty_or_zero_outputs(impl):
    x = lambda t: jnp.ones((1, t, 2, 8))
    no_keys = jaxpos.attention(x(4), x(0), x(0), position=jaxpos.ALiBi(2), implementation=impl)
    assert no_keys.shape == (1, 4, 2, 8)
    np.testing.assert_array_equal(np.asarray(no_keys), 0.0)  # no visible key: zeros
    assert jaxpos.attention(x(0), x(4), x(4), implementation=impl).shape == (1, 0, 2, 8)


def test_positions_past_int32_raise_instead_of_wrapping():
    q, kv = jnp.ones((1, 1, 1, 4)), jnp.ones((1, 2, 1, 4))
    with pytest.raises(ValueError, match=r"q_positions must fit in int32.*2147483648"):
        jaxpos.attention(q, kv, kv, causal=True, q_positions=np.array([2**31], np.uint32),
                         kv_positions=np.array([2**31 - 1, 2**31 - 2], np.int64))
    with pytest.raises(ValueError, match=r"rel must fit in int32"):
        jaxpos.t5_bucket(np.array([2**33], np.int64))
    # In range, wide integer dtypes are fine.
    assert int(jaxpos.t5_bucket(np.array([-(2**31) + 1], np.int64))[0]) == 15


@pytest.mark.parametrize("kwargs,error,match", [
    ({"causal": jnp.array(True)}, TypeError, r"causal must be a Python bool.*static_argnames"),
    ({"scale": "x"}, TypeError, r"scale must be a real number.*str 'x'"),
])
def test_flag_types_are_named(kwargs, error, match):
    x = jnp.ones((1, 3, 2, 8))
    with pytest.raises(error, match=match):
        jaxpos.attention(x, x, x, **kwargs)


def test_traced_scale_is_accepted():
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 3, 2, 8))
    out = jax.jit(lambda s: jaxpos.attention(x, x, x, scale=s, implementation="reference"))(0.5)
    ref = jaxpos.attention(x, x, x, scale=0.5, implementation="reference")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-6)


@pytest.mark.parametrize("make,name", [
    (lambda: jaxpos.T5Bias(np.zeros((32, 2), np.int32)), "table"),
    (lambda: jaxpos.Shaw(np.zeros((5, 4), np.float32), np.zeros((5, 4), np.int32)), "rel_v"),
])
def test_integer_tables_are_rejected(make, name):
    with pytest.raises(TypeError, match=rf"{name} must be a floating-point array.*int32"):
        make()


@pytest.mark.parametrize("impl", jaxpos.IMPLEMENTATIONS)
def test_nan_and_inf_inputs_propagate_as_nan_never_as_zero_rows(impl):
    """A NaN in one query, or an inf in one key, makes NaN outputs as in the reference
    (a diverged run must show NaN); it must not look like a row with no visible key, which
    is the only case that returns zeros. The empty row in the same call still gives zeros."""
    q = jax.random.normal(jax.random.key(0), (1, 8, 2, 8))
    k = jax.random.normal(jax.random.key(1), (1, 8, 2, 8))
    seg = jnp.array([[0, 0, 0, 0, 0, 0, 0, 1]])      # query 7's segment has no key
    kseg = jnp.array([[0, 0, 0, 0, 0, 0, 0, 0]])
    kw = dict(implementation=impl, segment_ids=seg, kv_segment_ids=kseg, block_q=4, block_k=4)
    out = jaxpos.attention(q.at[0, 3, 0, 0].set(jnp.nan), k, k, **kw)
    assert np.isnan(np.asarray(out[0, 3, 0])).all()            # the NaN query's row
    assert np.isfinite(np.asarray(out[0, :3])).all()           # other rows unaffected
    np.testing.assert_array_equal(out[0, 7], 0.0)              # the empty row: zeros
    out = jaxpos.attention(q, k.at[0, 2, 1, 0].set(jnp.inf), k, **kw)
    assert np.isnan(np.asarray(out[0, :7, 1])).any()           # head 1 sees the inf key
    assert not (np.asarray(out[0, :7]) == 0).all(-1).any()     # no row silently zeroed
    out = jaxpos.attention(q, k, k, scale=float("nan"), **kw)
    assert np.isnan(np.asarray(out[0, :7])).all()
