"""Attention dropout in the fused Pallas kernel (interpret mode): the forward, dq and dk/dv
kernels compute the keep decisions of each tile from the seed and the tile's query / key
indices (jaxpos.core.dropout.keep_tile), so the kernel drops exactly the pairs the reference
path drops for the same key. Checked against the reference path (which builds the whole
``[B, N, Tq, Tk]`` mask) for the output and the gradients of q, k, v, the sinks and a
score_mod's captured array, with GQA, causal masks, padded tiles, a broadcast mask, key
splits (flash decoding), per-row lengths and RoPE tables applied on load."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpos
from jaxpos.core.dropout import Dropout, dropout_seed
from jaxpos.kernels import fused

B, T, N, NKV, H = 2, 12, 4, 2, 16
RATE = 0.3


def qkv(seed=0, Tq=T, Tk=T):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], (B, Tq, N, H)), jax.random.normal(ks[1], (B, Tk, NKV, H)),
            jax.random.normal(ks[2], (B, Tk, NKV, H)))


def weights(shape):
    return jax.random.normal(jax.random.key(42), shape)


def test_kernel_equals_the_reference_on_one_tile():
    """The default-run check (one 8 x 8 tile, GQA, causal): output and d/d(q, k, v)."""
    q, k, v = (x[:1, :8] for x in qkv(seed=4))
    w = weights(q.shape)
    key = jax.random.key(3)

    def loss(impl):
        def f(q, k, v):
            out = jaxpos.attention(q, k, v, causal=True, dropout_rate=RATE, dropout_rng=key,
                                   implementation=impl)
            return jnp.sum(out * w), out
        return f

    (_, want), gw = jax.value_and_grad(loss("reference"), argnums=(0, 1, 2),
                                       has_aux=True)(q, k, v)
    (_, got), gg = jax.value_and_grad(loss("pallas"), argnums=(0, 1, 2), has_aux=True)(q, k, v)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
    for name, a, b in zip(("dq", "dk", "dv"), gg, gw):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4, err_msg=name)
    assert float(jnp.max(jnp.abs(want - jaxpos.attention(
        q, k, v, causal=True, implementation="reference")))) > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("broadcast", [False, True], ids=["per-head", "broadcast"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kernel_output_and_gradients_equal_the_reference_with_the_same_key(broadcast, causal):
    """GQA (4 query heads on 2 KV heads), 12 tokens in 8-wide tiles (a padded tile on
    each axis), sinks: output and d/d(q, k, v, sinks) of sum(O * W)."""
    q, k, v = qkv()
    sinks = jnp.array([0.5, -1.0, 2.0, 0.0])
    w = weights(q.shape)
    key = jax.random.key(7)

    def loss(impl):
        def f(q, k, v, sinks):
            blocks = {} if impl == "reference" else dict(block_q=8, block_k=8)
            out = jaxpos.attention(q, k, v, causal=causal, sinks=sinks, dropout_rate=RATE,
                                   dropout_rng=key, broadcast_dropout=broadcast,
                                   implementation=impl, **blocks)
            return jnp.sum(out * w), out
        return f

    (_, want), gw = jax.value_and_grad(loss("reference"), argnums=(0, 1, 2, 3),
                                       has_aux=True)(q, k, v, sinks)
    (_, got), gg = jax.value_and_grad(loss("pallas"), argnums=(0, 1, 2, 3),
                                      has_aux=True)(q, k, v, sinks)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), gg, gw):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4, err_msg=name)
    undropped = jaxpos.attention(q, k, v, causal=causal, sinks=sinks, implementation="reference")
    assert float(jnp.max(jnp.abs(want - undropped))) > 1e-2  # the mask drops something


@pytest.mark.slow
def test_score_mod_captured_array_gradient_uses_the_keep_mask():
    """The captured arrays' gradient pass (plain XLA outside the kernels) recomputes the
    kernels' keep decisions: d/d(per-head bias table) equals the reference's."""
    q, k, v = qkv(seed=1)
    table = jax.random.normal(jax.random.key(3), (N, 2 * T - 1)) * 0.5
    w = weights(q.shape)
    key = jax.random.key(11)

    def loss(impl):
        def f(q, k, v, table):
            mod = lambda s, b, h, qp, kp: s + table[h, kp - qp + T - 1]
            blocks = {} if impl == "reference" else dict(block_q=8, block_k=8)
            out = jaxpos.attention(q, k, v, score_mod=mod, causal=True, dropout_rate=RATE,
                                   dropout_rng=key, implementation=impl, **blocks)
            return jnp.sum(out * w)
        return f

    want = jax.grad(loss("reference"), argnums=(0, 1, 2, 3))(q, k, v, table)
    got = jax.grad(loss("pallas"), argnums=(0, 1, 2, 3))(q, k, v, table)
    for name, a, b in zip(("dq", "dk", "dv", "dtable"), got, want):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("rope", [False, True], ids=["plain", "rope-tables"])
def test_key_splits_lengths_and_rope_tables_keep_the_reference_mask(rope):
    """A decode-shaped call (2 queries after 30 cached keys, lengths 32 and 20): one
    split and three key splits (each split's tiles keep their global key indices) equal
    the reference, forward and gradients; with RoPE tables the kernel rotates on load."""
    Tq, Tk = 2, 32
    q, k, v = qkv(seed=2, Tq=Tq, Tk=Tk)
    lens = jnp.array([32, 20], jnp.int32)
    q_pos, kv_pos = jnp.arange(Tq) + 30, jnp.arange(Tk)
    tabs = None
    if rope:
        inv_freq = 1.0 / (10000.0 ** (jnp.arange(H // 2) / (H // 2)))
        tabs = jaxpos.schemes.rope.tables.rope_tables(q_pos, kv_pos, inv_freq)
    key = jax.random.key(5)
    drop = Dropout(RATE, dropout_seed(key), False)
    w = weights((B, Tq, N, H))

    def ref(q, k, v):
        out = jaxpos.attention(q, k, v, q_positions=q_pos, kv_positions=kv_pos, causal=True,
                               kv_lengths=lens, rope_tables=tabs, dropout_rate=RATE,
                               dropout_rng=key, implementation="reference")
        return jnp.sum(out * w), out

    def kern(splits):
        def f(q, k, v):
            out = fused.kernel_attention(q, k, v, q_positions=q_pos, kv_positions=kv_pos,
                                         causal=True, kv_lengths=lens, rope_tables=tabs,
                                         block_k=8, kv_splits=splits, interpret=True,
                                         dropout=drop)
            return jnp.sum(out * w), out
        return f

    (_, want), gw = jax.value_and_grad(ref, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    for splits in (1, 3):
        (_, got), gg = jax.value_and_grad(kern(splits), argnums=(0, 1, 2),
                                          has_aux=True)(q, k, v)
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5, err_msg=f"{splits=}")
        for name, a, b in zip(("dq", "dk", "dv"), gg, gw):
            np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4, err_msg=f"{name} {splits=}")


def test_kernel_refuses_a_dropout_that_is_not_a_dropout_record():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="dropout must be a jaxpos.core.dropout.Dropout"):
        fused.kernel_attention(q, k, v, q_positions=jnp.arange(T), kv_positions=jnp.arange(T),
                               interpret=True, dropout=0.1)


@pytest.mark.parametrize("backend,plain,dropping", [
    ("gpu", "xla", "pallas"),  # cuDNN has no attention dropout: the kernel takes it
    ("tpu", "pallas", "pallas"),
    ("cpu", "chunked", "chunked"),  # the kernel only runs in the interpreter there
])
def test_implementation_none_routes_dropout_to_a_path_that_applies_it(monkeypatch, backend,
                                                                      plain, dropping):
    from jaxpos.core.call import validate_call
    from jaxpos.core.engines import select_engine

    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    q, k, v = (x.astype(jnp.bfloat16) for x in qkv())
    assert select_engine(validate_call(q, k, v, causal=True)).name == plain
    call = validate_call(q, k, v, causal=True, dropout_rate=0.1, dropout_rng=jax.random.key(0))
    assert select_engine(call).name == dropping
