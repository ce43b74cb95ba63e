"""q, k and v of different dtypes are refused with the same TypeError on every engine and
call shape, as ``jax.nn.dot_product_attention`` refuses them (before, the reference and
chunked engines computed a bfloat16 q against float32 k and v in float32, while the
Pallas and xla engines refused with a ValueError: two answers to one call)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxpos
from jaxpos.core import engines
from jaxpos.parallel import ring_attention, shard_map, ulysses_attention

B, T, N, H = 1, 8, 2, 8
WORDS = ("q bfloat16", "k float32", "v float32", "share a dtype")


def _qkv(q_dtype=jnp.bfloat16, k_dtype=jnp.float32, v_dtype=jnp.float32):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(B, T, N, H)), jnp.float32)
    return x.astype(q_dtype), x.astype(k_dtype), x.astype(v_dtype)


def _raises_naming(fn, words=WORDS):
    with pytest.raises(TypeError) as info:
        fn()
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_jax_dot_product_attention_refuses_mixed_dtypes_too():
    """The rule followed: JAX's own attention refuses a bfloat16 query with float32 keys."""
    with pytest.raises(ValueError, match="dtype"):
        jax.nn.dot_product_attention(*_qkv())


@pytest.mark.parametrize("impl", [None, *engines.engine_names()])
def test_every_engine_refuses_mixed_dtypes(impl):
    _raises_naming(lambda: jaxpos.attention(*_qkv(), causal=True, implementation=impl))


@pytest.mark.parametrize("impl", [None, "chunked", "pallas"])
def test_mixed_dtypes_are_refused_at_trace_time(impl):
    f = jax.jit(lambda q, k, v: jaxpos.attention(q, k, v, implementation=impl))
    _raises_naming(lambda: f.lower(*_qkv()))


def test_values_of_another_dtype_are_named():
    _raises_naming(lambda: jaxpos.attention(*_qkv(jnp.float32, jnp.float32, jnp.float16)),
                   ("q float32", "k float32", "v float16"))


@pytest.mark.parametrize("impl", ["reference", "chunked", "pallas"])
def test_paged_call_refuses_pages_of_another_dtype(impl):
    q, _, _ = _qkv()
    pages = jnp.zeros((4, 4, N, H), jnp.float32)
    table = jnp.array([[0, 1]], jnp.int32)
    _raises_naming(lambda: jaxpos.attention(q[:, :1], pages, pages, page_table=table,
                                            kv_lengths=jnp.array([5]), implementation=impl))


@pytest.mark.parametrize("parallel", [ring_attention, ulysses_attention])
def test_context_parallel_refuses_mixed_dtypes(parallel):
    mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
    pos = jnp.arange(T, dtype=jnp.int32)
    f = shard_map(lambda q, k, v: parallel(q, k, v, axis_name="seq", q_positions=pos,
                                           kv_positions=pos),
                  mesh=mesh, in_specs=(P(None, "seq"),) * 3, out_specs=P(None, "seq"))
    _raises_naming(lambda: jax.jit(f).lower(*_qkv()))

