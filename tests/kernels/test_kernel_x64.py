"""``implementation="pallas"`` under ``jax_enable_x64`` (how users check against float64
references): float32 inputs give the chunked path's outputs and gradients, dense and
paged; float64 inputs run in the Pallas interpreter (CPU) with the float32 softmax of
every engine, and a compiled kernel refuses them with a ``TypeError``.

x64 is process-wide state: the ``x64`` fixture turns it on for one test and restores
the previous value. Tolerance: float32, only the summation order differs (``1e-5``
relative to the largest value).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpos
from jaxpos.kernels import fused_attention


@pytest.fixture
def x64():
    before = bool(jax.config.read("jax_enable_x64"))
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", before)


def _close(a, b, tol=1e-5):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    np.testing.assert_allclose(a, b, rtol=0, atol=tol * max(1.0, float(np.abs(b).max())))


def _qkv(rng, B, Tq, Tk, N, Nk, H, dtype=np.float32):
    return tuple(jnp.asarray(rng.standard_normal(s).astype(dtype))
                 for s in ((B, Tq, N, H), (B, Tk, Nk, H), (B, Tk, Nk, H)))


def test_dense_kernel_under_x64_equals_chunked_forward_and_gradients(x64, rng):
    q, k, v = _qkv(rng, 2, 8, 8, 2, 1, 8)
    kw = dict(causal=True, position=jaxpos.ALiBi(2), kv_lengths=jnp.array([6, 8]),
              sinks=jnp.array([0.5, -1.0], jnp.float32), block_q=4, block_k=4)

    def run(impl):
        f = lambda q, k, v: jaxpos.attention(q, k, v, implementation=impl, **kw)
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(jnp.ones_like(out))

    out, grads = run("pallas")
    ref, ref_grads = run("chunked")
    assert out.dtype == jnp.float32
    _close(out, ref)
    for g, r in zip(grads, ref_grads):
        assert g.dtype == jnp.float32
        _close(g, r)


@pytest.mark.slow
def test_decode_with_key_splits_under_x64_equals_chunked(x64, rng):
    q, k, v = _qkv(rng, 2, 1, 64, 4, 2, 8)
    lens = jnp.array([37, 64], jnp.int32)
    out, ref = (jaxpos.attention(q, k, v, implementation=impl, kv_lengths=lens, block_k=8,
                                 position=jaxpos.ALiBi(4)) for impl in ("pallas", "chunked"))
    _close(out, ref)


@pytest.mark.parametrize("Tq", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_paged_kernel_under_x64_equals_chunked(x64, rng, Tq):
    B, N, Nk, H, ps, P = 2, 4, 2, 8, 4, 8
    q = jnp.asarray(rng.standard_normal((B, Tq, N, H)).astype(np.float32))
    kp, vp = (jnp.asarray(rng.standard_normal((P, ps, Nk, H)).astype(np.float32))
              for _ in range(2))
    table = jnp.array([[3, 1, 5], [0, 7, -1]], jnp.int32)
    lens = jnp.array([10, 6], jnp.int32)

    @jax.jit
    def paged(q, kp, vp, table, lens):
        return jaxpos.attention(q, kp, vp, page_table=table, kv_lengths=lens, causal=True,
                                implementation="pallas", position=jaxpos.ALiBi(N))

    ref = jaxpos.attention(q, kp, vp, page_table=table, kv_lengths=lens, causal=True,
                           implementation="chunked", position=jaxpos.ALiBi(N))
    _close(paged(q, kp, vp, table, lens), ref)


def _numpy_causal(q, k, v):
    """float64 causal softmax attention, ``[B, T, N, H]`` (one KV head per query head)."""
    s = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(q.shape[-1])
    T = q.shape[1]
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bnqk,bknh->bqnh", p / p.sum(-1, keepdims=True), v)


def test_float64_inputs_run_in_the_interpreter_with_float32_softmax(x64, rng):
    q, k, v = _qkv(rng, 1, 8, 8, 1, 1, 8, dtype=np.float64)
    out = jaxpos.attention(q, k, v, causal=True, implementation="pallas", block_q=4,
                           block_k=4)
    assert out.dtype == jnp.float64
    # the softmax and the accumulation are float32's, as on the other engines
    _close(out, _numpy_causal(*map(np.asarray, (q, k, v))), tol=2e-6)
    chunked = jaxpos.attention(q, k, v, causal=True, implementation="chunked")
    _close(out, chunked, tol=2e-6)


def test_compiled_kernel_refuses_float64_inputs(x64, rng, monkeypatch):
    q, k, v = _qkv(rng, 1, 8, 8, 2, 2, 8, dtype=np.float64)
    pos = np.arange(8)
    with pytest.raises(TypeError, match="float64.*implementation='chunked'"):
        fused_attention(q, k, v, q_positions=pos, kv_positions=pos, interpret=False)
    # the engine, off CPU: requested by name it raises; by default the next engine runs
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(TypeError, match="compiles its kernel.*got q, k, v dtypes float64"):
        jaxpos.attention(q, k, v, implementation="pallas")


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_kernel_lowers_for_gpu_and_tpu_under_x64(x64, platform):
    """Forward and backward (GQA, kv_lengths, sinks, a captured-array score_mod) export
    for Triton and Mosaic with x64 on: no int64 reaches the kernels' index arithmetic."""
    from jaxpos.kernels.fused import kernel_attention

    def fwd(q, k, v, pos, lens, slopes):
        mod = lambda s, b, h, qp, kp: s + slopes[h] * (kp - qp).astype(jnp.float32)
        return kernel_attention(q, k, v, q_positions=pos, kv_positions=pos, causal=True,
                                kv_lengths=lens, sinks=slopes, score_mod=mod, interpret=False)

    bwd = jax.grad(lambda *a: fwd(*a).sum(), argnums=(0, 1, 2, 5))
    sds = jax.ShapeDtypeStruct
    args = (sds((1, 192, 4, 128), jnp.float32), sds((1, 192, 2, 128), jnp.float32),
            sds((1, 192, 2, 128), jnp.float32), sds((192,), jnp.int32), sds((1,), jnp.int32),
            sds((4,), jnp.float32))
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    for fn in (fwd, bwd):
        mlir = jax.export.export(jax.jit(fn), platforms=[platform],
                                 disabled_checks=checks)(*args).mlir_module()
        assert ("tpu_custom_call" if platform == "tpu" else "xla.gpu.triton") in mlir
