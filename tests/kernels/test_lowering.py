"""The fused kernel compiles for GPU and TPU: export forward and backward on this CPU machine.

``jax.export.export(jax.jit(f), platforms=[...])`` runs the Pallas lowering for the target
without the hardware: Pallas Triton for ``cuda`` (selected through
``jax.experimental.pallas.triton.CompilerParams``) and Mosaic TPU for ``tpu``. So a
construct that either compiler rejects (a gather on values, an illegal block shape, an
unsupported primitive) fails here. This proves lowering only; running on the hardware
is not claimed.

The score_mods cover the three ways a captured array is read: ALiBi's ``slopes[head]``
(a scalar load), a T5-style per-head offset vector and a user's ``[offsets, heads]``
table gathered at the clipped offset (one indexed load per tile on GPU; a loop over the
tile's offsets reading TPU scalar memory on TPU). The backward exports include the
captured arrays' and the sinks' gradients. Block shapes are the defaults (128 x 128),
with a length of 192 so the padding path is lowered too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxpos.kernels import attention_via_kernel, fused_attention
from jaxpos.mods import create_block_mask

B, T, N, NKV, H = 1, 192, 4, 2, 128
R = 128
_TRITON_CALL = "__gpu$xla.gpu.triton"


def _export(fn, args, platform):
    # Triton custom calls carry no serialization-compatibility guarantee; we only lower.
    checks = [jax.export.DisabledSafetyCheck.custom_call(_TRITON_CALL)]
    exp = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(*args)
    return exp.mlir_module()


def _kernel_calls(mlir, platform):
    marker = "tpu_custom_call" if platform == "tpu" else "xla.gpu.triton"
    return mlir.count(f'call_target_name = "{marker}"') or mlir.count(marker)


def _args(dtype):
    sds = jax.ShapeDtypeStruct
    return (sds((B, T, N, H), dtype), sds((B, T, NKV, H), dtype), sds((B, T, NKV, H), dtype),
            sds((T,), jnp.int32), sds((B, T), jnp.int32), sds((N,), jnp.float32),
            sds((N, 2 * R + 1), jnp.float32), sds((2 * R + 1, N), jnp.float32))


def _biases(slopes, vec, table):
    def mod(s, b, h, qp, kp):
        rel = kp - qp
        idx = jnp.clip(rel, -R, R) + R
        return s + slopes[h] * rel.astype(jnp.float32) + vec[h][idx] + table[idx, h]
    return mod


def _programmable(q, k, v, pos, seg, slopes, vec, table):
    """Every bias form at once, with segments, GQA, causal and padding."""
    return attention_via_kernel(q, k, v, score_mod=_biases(slopes, vec, table),
                                q_positions=pos, kv_positions=pos, causal=True,
                                segment_ids=seg, kv_segment_ids=seg, interpret=False)


def _masked(q, k, v, pos, seg, slopes, vec, table):
    """A block mask with a sliding-window mask_mod, sinks, and a soft-capped score (a
    score_mod whose derivative in the score is not 1)."""
    bm = create_block_mask(lambda b, h, qp, kp: (qp - kp) < 64, q_positions=pos,
                           kv_positions=pos, block_q=128, block_k=128)
    mod = lambda s, b, h, qp, kp: 30.0 * jnp.tanh(s / 30.0) + vec[h][jnp.clip(kp - qp, -R, R) + R]
    return attention_via_kernel(q, k, v, score_mod=mod, block_mask=bm, sinks=slopes,
                                q_positions=pos, kv_positions=pos, causal=True, interpret=False)


def _grad(fwd):
    return jax.grad(lambda *a: jnp.sum(fwd(*a).astype(jnp.float32)), argnums=(0, 1, 2, 5, 6, 7))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_export_score_mods_segments_gqa(platform, dtype):
    """Forward is one kernel; backward three (forward for the residuals, dq, dk/dv) plus
    the captured arrays' gradient pass in plain XLA. float32 inputs use HIGHEST-precision
    dots (IEEE on Triton rather than TF32)."""
    args = _args(dtype)
    assert _kernel_calls(_export(_programmable, args, platform), platform) == 1
    assert _kernel_calls(_export(_grad(_programmable), args, platform), platform) == 3


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_export_block_mask_sinks_soft_cap(platform):
    args = _args(jnp.bfloat16)
    assert _kernel_calls(_export(_masked, args, platform), platform) == 1
    assert _kernel_calls(_export(_grad(_masked), args, platform), platform) == 3


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_export_fused_attention_rope(platform):
    """fused_attention's RoPE (applied before the kernel, default angle_precision="high")
    plus ALiBi slopes and an offset vector given as arrays."""
    sds = jax.ShapeDtypeStruct

    def f(q, k, v, pos, inv_freq, slopes, ob):
        return fused_attention(q, k, v, q_positions=pos, kv_positions=pos, inv_freq=inv_freq,
                               alibi_slopes=slopes, offset_bias=ob, causal=True,
                               interpret=False)

    args = (sds((B, T, N, H), jnp.bfloat16), sds((B, T, NKV, H), jnp.bfloat16),
            sds((B, T, NKV, H), jnp.bfloat16), sds((T,), jnp.int32), sds((H // 2,), jnp.float32),
            sds((N,), jnp.float32), sds((N, 2 * R + 1), jnp.float32))
    bwd = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2, 4, 5, 6))
    assert _kernel_calls(_export(f, args, platform), platform) == 1
    assert _kernel_calls(_export(bwd, args, platform), platform) == 3


# ----------------------------------------------------------- inside shard_map, check_vma=True
def _sharded(fn, n_args):
    """``fn`` under ``shard_map`` over a one-device mesh axis "b" with the default
    ``check_vma=True``: the batch axis is sharded, every other argument replicated. One
    device suffices: the varying-axis types are checked whatever the axis size."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("b",))
    specs = (P("b"), P("b"), P("b"), P(), P("b")) + (P(),) * (n_args - 5)
    return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P("b")), mesh


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_export_inside_shard_map_with_check_vma(platform):
    """Sharded q/k/v/segments with replicated positions and captured arrays: the kernel
    casts its inputs to one set of varying axes, declares its outputs' axes, and sums the
    gradients of replicated inputs over the axes they do not vary over (the chunked path's
    rule), so forward and backward lower without ``check_vma=False``."""
    args = _args(jnp.bfloat16)
    sharded, mesh = _sharded(_programmable, len(args))
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    args = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(
        mesh, P("b") if i in (0, 1, 2, 4) else P())) for i, a in enumerate(args))
    assert _kernel_calls(_export(sharded, args, platform), platform) >= 1
    assert _kernel_calls(_export(_grad(sharded), args, platform), platform) >= 3


def test_interpret_mode_inside_shard_map_with_check_vma_raises_clearly():
    """JAX's Pallas interpreter (the CPU path) cannot lower under varying-axis checks: the
    error says so and names both ways out, instead of an interpreter scan-carry error."""
    import numpy as np

    q = jnp.asarray(np.random.default_rng(0).normal(size=(1, 8, 2, 8)), jnp.float32)

    def f(q, k, v, pos, seg):
        return attention_via_kernel(q, k, v, q_positions=pos, kv_positions=pos, causal=True,
                                    segment_ids=seg, kv_segment_ids=seg)

    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sharded, mesh = _sharded(f, 5)
    q = jax.device_put(q, NamedSharding(mesh, P("b")))
    pos = jax.device_put(jnp.arange(8, dtype=jnp.int32), NamedSharding(mesh, P()))
    seg = jax.device_put(jnp.zeros((1, 8), jnp.int32), NamedSharding(mesh, P("b")))
    with pytest.raises(ValueError, match="check_vma=False.*implementation='chunked'"):
        jax.jit(sharded)(q, q, q, pos, seg)


# --------------------------------------------- layout, decode path and RoPE on load
def _decode_call(Tq, Tk, H, rope, kv_lengths):
    from jaxpos.kernels import fused

    def f(q, k, v, lens, qc, qs, kc, ks):
        return fused.kernel_attention(
            q, k, v, q_positions=jnp.arange(Tq) + Tk - Tq, kv_positions=jnp.arange(Tk),
            causal=True, interpret=False, kv_lengths=lens if kv_lengths else None,
            rope_tables=fused.RopeTables(qc, qs, kc, ks) if rope else None)

    sds = jax.ShapeDtypeStruct
    args = (sds((2, Tq, 8, H), jnp.bfloat16), sds((2, Tk, 2, H), jnp.bfloat16),
            sds((2, Tk, 2, H), jnp.bfloat16), sds((2,), jnp.int32),
            sds((1, Tq, H // 2), jnp.float32), sds((1, Tq, H // 2), jnp.float32),
            sds((2, Tk, H // 2), jnp.float32), sds((2, Tk, H // 2), jnp.float32))
    return f, args


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("Tq, Tk, H, rope, kv_lengths", [
    (192, 192, 96, False, False),  # H not a power of two (Triton: masked 128-wide blocks)
    (1, 1000, 128, False, True),  # decode: grouped heads, key splits, lengths
    (3, 300, 64, True, True),  # decode with RoPE tables (TPU: the [B, N, T, H] fallback)
    (192, 192, 128, True, False),  # training shape with RoPE on load
], ids=["h96", "decode-lengths", "decode-rope-h64", "rope-h128"])
def test_export_layout_decode_and_rope_on_load(platform, Tq, Tk, H, rope, kv_lengths):
    """The kernel reads [B, T, N, H] through its block specs for any head dim, the decode
    path (grouped query heads, key splits, per-row lengths) and RoPE on load lower to one
    forward kernel and three kernels with the backward."""
    f, args = _decode_call(Tq, Tk, H, rope, kv_lengths)
    grad = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2))
    assert _kernel_calls(_export(f, args, platform), platform) == 1
    assert _kernel_calls(_export(grad, args, platform), platform) == 3


# ------------------------------------------------------------------ attention dropout
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("shape", ["train", "decode"])
def test_export_dropout_forward_and_backward(platform, shape):
    """Attention dropout: the seed is a uint32 [2] kernel input (TPU scalar memory) and
    each of the three kernels hashes its tile's indices (uint32 multiplies, shifts and
    xors, jaxpos.core.dropout.keep_tile); the captured-array gradient pass recomputes the mask
    in XLA. Training shape: GQA, causal, padding, a score_mod with a captured array;
    decode shape: grouped heads, key splits, per-row lengths, RoPE tables on load."""
    from jaxpos.core.dropout import Dropout
    from jaxpos.kernels import fused

    sds = jax.ShapeDtypeStruct
    if shape == "train":
        def f(q, k, v, seed, slopes):
            mod = lambda s, b, h, qp, kp: s + slopes[h] * (kp - qp).astype(jnp.float32)
            return fused.kernel_attention(
                q, k, v, q_positions=jnp.arange(T), kv_positions=jnp.arange(T), causal=True,
                score_mod=mod, interpret=False, dropout=Dropout(0.1, seed, False))

        args = (sds((B, T, N, H), jnp.bfloat16), sds((B, T, NKV, H), jnp.bfloat16),
                sds((B, T, NKV, H), jnp.bfloat16), sds((2,), jnp.uint32),
                sds((N,), jnp.float32))
        argnums = (0, 1, 2, 4)
    else:
        Tq, Tk = 1, 1000

        def f(q, k, v, seed, lens, qc, qs, kc, ks):
            return fused.kernel_attention(
                q, k, v, q_positions=jnp.arange(Tq) + Tk - Tq, kv_positions=jnp.arange(Tk),
                causal=True, interpret=False, kv_lengths=lens,
                rope_tables=fused.RopeTables(qc, qs, kc, ks),
                dropout=Dropout(0.1, seed, True))

        args = (sds((2, Tq, 8, H), jnp.bfloat16), sds((2, Tk, 2, H), jnp.bfloat16),
                sds((2, Tk, 2, H), jnp.bfloat16), sds((2,), jnp.uint32), sds((2,), jnp.int32),
                sds((1, Tq, H // 2), jnp.float32), sds((1, Tq, H // 2), jnp.float32),
                sds((2, Tk, H // 2), jnp.float32), sds((2, Tk, H // 2), jnp.float32))
        argnums = (0, 1, 2)
    grad = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=argnums)
    assert _kernel_calls(_export(f, args, platform), platform) == 1
    assert _kernel_calls(_export(grad, args, platform), platform) == 3
