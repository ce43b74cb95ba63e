"""Exact parity of :func:`jaxpos.t5_bucket` with Hugging Face transformers'
``T5Attention._relative_position_bucket`` (CPU PyTorch), on every offset in
-3000..3000, bidirectional and causal, for several (num_buckets, max_distance).
Both the NumPy path and the JAX path (eager and jit) must give the same integers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpos import t5_bucket

pytestmark = pytest.mark.parity

CONFIGS = [(32, 128), (64, 256), (16, 64), (128, 1024), (8, 20), (32, 32), (6, 7)]


@pytest.fixture(scope="module")
def hf_bucket():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.t5.modeling_t5 import T5Attention

    def bucket(rel, bidirectional, num_buckets, max_distance):
        out = T5Attention._relative_position_bucket(
            torch.tensor(rel, dtype=torch.long), bidirectional=bidirectional,
            num_buckets=num_buckets, max_distance=max_distance)
        return out.numpy()

    return bucket


@pytest.mark.parametrize("bidirectional", [True, False], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("num_buckets, max_distance", CONFIGS)
def test_t5_bucket_equals_hugging_face(hf_bucket, bidirectional, num_buckets, max_distance):
    rel = np.arange(-3000, 3001)
    expected = hf_bucket(rel, bidirectional, num_buckets, max_distance)
    assert expected.min() >= 0 and expected.max() < num_buckets
    got_np = t5_bucket(rel, bidirectional, num_buckets, max_distance)
    np.testing.assert_array_equal(got_np, expected)
    got_jax = t5_bucket(jnp.asarray(rel, jnp.int32), bidirectional, num_buckets, max_distance)
    np.testing.assert_array_equal(np.asarray(got_jax), expected)
    jitted = jax.jit(lambda r: t5_bucket(r, bidirectional, num_buckets, max_distance))
    np.testing.assert_array_equal(np.asarray(jitted(jnp.asarray(rel, jnp.int32))), expected)
