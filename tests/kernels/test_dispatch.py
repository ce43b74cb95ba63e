"""The dispatch rule (``choose_implementation``) and the cuDNN/XLA path
(``attention_via_xla``), against the dense reference in ``tests/_kernel_dense.py``.

On CPU ``attention_via_xla`` runs ``jax.nn.dot_product_attention(implementation="xla")``;
cuDNN itself needs an NVIDIA GPU (the code path and its arguments are the same).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _kernel_dense import dense_attention

from jaxpos.kernels import DENSE_BIAS_BUDGET_BYTES, attention_via_xla, choose_implementation

F32_TOL = {"atol": 2e-5, "rtol": 2e-5}


def _choose(backend, fusable=True, score=False, mask=False, T=8192, N=16, B=4, **kw):
    return choose_implementation(backend=backend, fusable=fusable, has_score_mod=score,
                                 has_mask_mod=mask, Tq=T, Tk=T, num_heads=N, batch=B, **kw)


def test_rule_per_backend():
    # CPU: the O(T)-memory XLA path; the kernel would run in the interpreter.
    for score in (False, True):
        assert _choose("cpu", score=score) == "chunked"
    # A scheme the kernel cannot run (content bias / value term): chunked everywhere.
    for backend in ("cpu", "gpu", "cuda", "tpu", "rocm"):
        assert _choose(backend, fusable=False) == "chunked"
    # TPU: the Pallas kernel (Mosaic).
    assert _choose("tpu") == _choose("tpu", score=True) == "pallas"
    # NVIDIA GPU without a score term: cuDNN (500 vs 171 TFLOP/s measured on an H200).
    assert _choose("gpu") == _choose("cuda") == "xla"
    # ROCm has no cuDNN.
    assert _choose("rocm") == "pallas"


def test_gpu_mask_rule_counts_dense_mask_memory():
    """With a mask_mod only on an NVIDIA GPU: cuDNN with the mask materialised while
    B * N * Tq * Tk * 4 bytes fits the budget, the kernel (O(T) memory) above."""
    assert DENSE_BIAS_BUDGET_BYTES == 1 << 30
    # 1 x 16 x 4096^2 x 4 B = 1 GiB: fits exactly.
    assert _choose("gpu", mask=True, B=1, N=16, T=4096) == "xla"
    assert _choose("gpu", mask=True, B=1, N=16, T=4097) == "pallas"
    assert _choose("gpu", mask=True, dense_bias_budget_bytes=1 << 40) == "xla"


@pytest.mark.parametrize("B", [1, 4])
def test_gpu_score_term_never_goes_to_cudnn(B):
    """A score term needs a bias, which cuDNN would round to the input dtype and whose
    gradient cuDNN gets wrong for batch > 1 (jax issue 30593): the kernel runs it, at any
    size and any budget."""
    for T in (8, 4096, 8192):
        assert _choose("gpu", score=True, B=B, T=T) == "pallas"
        assert _choose("cuda", score=True, mask=True, B=B, T=T,
                       dense_bias_budget_bytes=1 << 40) == "pallas"


def test_rule_bad_input():
    with pytest.raises(TypeError, match="backend"):
        _choose(None)
    with pytest.raises(ValueError, match="Tq"):
        choose_implementation(backend="gpu", fusable=True, has_score_mod=True,
                              has_mask_mod=False, Tq=-1, Tk=4, num_heads=1, batch=1)


def _qkv(B, Tq, Tk, N, Nk, H, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(ks[0], (B, Tq, N, H)), jax.random.normal(ks[1], (B, Tk, Nk, H)),
            jax.random.normal(ks[2], (B, Tk, Nk, H)))


def _grads(f, args, argnums):
    def loss(*a):
        o = f(*a)
        return jnp.sum(o * jnp.cos(jnp.arange(o.size, dtype=jnp.float32).reshape(o.shape)))

    return jax.jit(jax.value_and_grad(loss, argnums=argnums))(*args)


def _check(f, g, args, argnums):
    (vf, gf), (vg, gg) = _grads(f, args, argnums), _grads(g, args, argnums)
    np.testing.assert_allclose(vf, vg, rtol=1e-4)
    for a, b in zip(gf, gg):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)


def test_xla_path_causal_arange_alibi_bias_gqa(monkeypatch):
    """Known arange positions: is_causal (no mask array); ALiBi as a dense bias; GQA.
    Forward and gradients, slopes included."""
    seen = []
    sdpa = jax.nn.dot_product_attention

    def spy(*a, **kw):
        seen.append((kw["is_causal"], kw["mask"] is None, kw["bias"].shape))
        return sdpa(*a, **kw)

    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    B, T, N, Nk, H = 2, 12, 4, 2, 8
    q, k, v = _qkv(B, T, T, N, Nk, H)
    pos = np.arange(T)
    slopes = jnp.asarray([0.5, 0.25, 0.125, 0.0625])

    def mod(slopes):
        return lambda s, b, h, qp, kp: s + slopes[h] * (kp - qp).astype(jnp.float32)

    kw = {"q_positions": pos, "kv_positions": pos, "causal": True}
    _check(lambda q, k, v, s: attention_via_xla(q, k, v, score_mod=mod(s), **kw),
           lambda q, k, v, s: dense_attention(q, k, v, score_mod=mod(s), **kw),
           (q, k, v, slopes), (0, 1, 2, 3))
    assert seen and all(s == (True, True, (1, N, T, T)) for s in seen), seen


def test_xla_path_positions_segments_mask_mod_sinks_and_empty_rows():
    """Traced, batched positions (a boolean mask from positions), segments, a mask_mod,
    sinks, and a query segment that sees no key (zeros, zero gradient)."""
    B, Tq, Tk, N, H = 2, 8, 12, 2, 8
    q, k, v = _qkv(B, Tq, Tk, N, N, H, seed=1)
    kv_pos = jnp.stack([jnp.arange(Tk), jnp.arange(Tk) + 2])
    q_pos = kv_pos[:, Tk - Tq:]
    seg_q = jnp.asarray([[0] * 4 + [1] * 4, [0] * 6 + [7] * 2])
    seg_kv = jnp.asarray([[0] * 6 + [1] * 6, [0] * 12])
    sinks = jnp.asarray([0.3, -0.5])
    kw = {"causal": True, "segment_ids": seg_q, "kv_segment_ids": seg_kv,
          "mask_mod": lambda b, h, qp, kp: (qp - kp) < 6}

    def xla(q, k, v, sinks, q_pos, kv_pos):
        return attention_via_xla(q, k, v, sinks=sinks, q_positions=q_pos,
                                 kv_positions=kv_pos, **kw)

    def dense(q, k, v, sinks, q_pos, kv_pos):
        return dense_attention(q, k, v, sinks=sinks, q_positions=q_pos, kv_positions=kv_pos,
                               **kw)

    f = jax.jit(xla)
    out = f(q, k, v, sinks, q_pos, kv_pos)
    np.testing.assert_array_equal(np.asarray(out[1, 6:]), 0.0)  # segment 7: no key
    _check(lambda *a: xla(*a, q_pos, kv_pos), lambda *a: dense(*a, q_pos, kv_pos),
           (q, k, v, sinks), (0, 1, 2, 3))


def test_xla_path_soft_cap_is_dense_attention():
    """A score_mod that is not a pure added term (a tanh soft cap) cannot be a bias: it
    runs as dense XLA attention, same numbers."""
    B, T, N, H = 1, 10, 2, 8
    q, k, v = _qkv(B, T, T, N, N, H, seed=2)
    pos = jnp.arange(T)
    kw = {"q_positions": pos, "kv_positions": pos, "causal": True,
          "score_mod": lambda s, b, h, qp, kp: 2.0 * jnp.tanh(s / 2.0)}
    _check(lambda q, k, v: attention_via_xla(q, k, v, **kw),
           lambda q, k, v: dense_attention(q, k, v, **kw), (q, k, v), (0, 1, 2))


def test_xla_path_bad_input():
    q, k, v = _qkv(1, 4, 4, 2, 2, 8)
    pos = jnp.arange(4)
    with pytest.raises(ValueError, match="sinks must have shape"):
        attention_via_xla(q, k, v, q_positions=pos, kv_positions=pos, sinks=jnp.zeros(3))
    with pytest.raises(ValueError, match="head_dim"):
        attention_via_xla(q, k, v[..., :4], q_positions=pos, kv_positions=pos)
    with pytest.raises(ValueError, match="segment_ids"):
        attention_via_xla(q, k, v, q_positions=pos, kv_positions=pos,
                          segment_ids=jnp.zeros((1, 4), jnp.int32))
