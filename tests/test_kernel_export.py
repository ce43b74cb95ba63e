"""The fused kernel compiles for GPU and TPU: export forward and backward on this CPU machine.

``jax.export.export(jax.jit(f), platforms=[...])`` runs the Pallas lowering for the target
without the hardware: Pallas Triton for ``cuda`` (the kernel selects it through
``jax.experimental.pallas.triton.CompilerParams``; Mosaic GPU, the default, does not lower
a generic ``dot_general``) and Mosaic TPU for ``tpu``. So a construct that either compiler
rejects (a gather, an illegal block shape, an unsupported primitive) fails here. This
proves lowering only; running on the hardware is not claimed.

Block shapes are the defaults (128 x 128, legal for TPU's 8 x 128 tiles and Triton's
powers of two), with a length of 192 so the padding path is lowered too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jaxpos.kernels import fused_attention

B, T, N, NKV, H = 1, 192, 4, 2, 128
_TRITON_CALL = "__gpu$xla.gpu.triton"


def _export(fn, args, platform):
    # Triton custom calls carry no serialization-compatibility guarantee; we only lower.
    checks = [jax.export.DisabledSafetyCheck.custom_call(_TRITON_CALL)]
    exp = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(*args)
    return exp.mlir_module()


def _functions(angle_precision, with_rope=True, dtype=jnp.bfloat16):
    """Forward and backward of one call using every kernel feature at once."""
    sds = jax.ShapeDtypeStruct
    args = (sds((B, T, N, H), dtype), sds((B, T, NKV, H), dtype), sds((B, T, NKV, H), dtype), sds((T,), jnp.int32), sds((B, T), jnp.int32),
            sds((H // 2,), jnp.float32), sds((N,), jnp.float32), sds((N, 257), jnp.float32))

    def fwd(q, k, v, pos, seg, inv_freq, slopes, offset_bias):
        return fused_attention(q, k, v, q_positions=pos, kv_positions=pos,
                               inv_freq=inv_freq if with_rope else None,
                               angle_precision=angle_precision, alibi_slopes=slopes,
                               offset_bias=offset_bias, causal=True, segment_ids=seg,
                               kv_segment_ids=seg, interpret=False)

    def loss(*a):
        return jnp.sum(fwd(*a).astype(jnp.float32))

    bwd = jax.grad(loss, argnums=(0, 1, 2, 6, 7))
    return fwd, bwd, args


def _kernel_calls(mlir, platform):
    marker = "tpu_custom_call" if platform == "tpu" else "xla.gpu.triton"
    return mlir.count(f'call_target_name = "{marker}"') or mlir.count(marker)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_export_alibi_t5_segments_gqa(platform, dtype):
    """ALiBi + offset-bias vector + segments + GQA + causal + padding: forward is one
    kernel, backward three (forward for the residuals, dq, dk/dv). float32 inputs use
    HIGHEST-precision dots (IEEE on Triton rather than TF32)."""
    fwd, bwd, args = _functions("high", with_rope=False, dtype=dtype)
    assert _kernel_calls(_export(fwd, args, platform), platform) >= 1
    assert _kernel_calls(_export(bwd, args, platform), platform) >= 3


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_export_rope_float32_angles(platform):
    fwd, bwd, args = _functions("float32")
    assert _kernel_calls(_export(fwd, args, platform), platform) >= 1
    assert _kernel_calls(_export(bwd, args, platform), platform) >= 3


def test_export_rope_high_precision_angles_tpu():
    fwd, bwd, args = _functions("high")
    assert _kernel_calls(_export(fwd, args, "tpu"), "tpu") >= 1
    assert _kernel_calls(_export(bwd, args, "tpu"), "tpu") >= 3


def test_export_rope_high_precision_angles_cuda():
    # jaxpos.rope's extended-precision angle reduction (floor-based, no lax.round) lowers
    # through Pallas Triton, so the default angle_precision="high" compiles for GPU too.
    fwd, bwd, args = _functions("high")
    assert _kernel_calls(_export(fwd, args, "cuda"), "cuda") >= 1
    assert _kernel_calls(_export(bwd, args, "cuda"), "cuda") >= 3




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
    """Sharded q/k/v/segments with replicated positions, slopes and offset bias: the kernel
    casts its inputs to one set of varying axes, declares its outputs' axes, and sums the
    gradients of replicated inputs over the axes they do not vary over (the chunked path's
    rule), so forward and backward lower without ``check_vma=False``."""
    fwd, _, args = _functions("high", dtype=jnp.bfloat16)
    sharded, mesh = _sharded(fwd, len(args))
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    args = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(
        mesh, P("b") if i in (0, 1, 2, 4) else P())) for i, a in enumerate(args))
    bwd = jax.grad(lambda *a: jnp.sum(sharded(*a).astype(jnp.float32)), argnums=(0, 1, 2, 6, 7))
    assert _kernel_calls(_export(sharded, args, platform), platform) >= 1
    assert _kernel_calls(_export(bwd, args, platform), platform) >= 3


def test_interpret_mode_inside_shard_map_with_check_vma_raises_clearly():
    """JAX's Pallas interpreter (the CPU path) cannot lower under varying-axis checks: the
    error says so and names both ways out, instead of an interpreter scan-carry error."""
    import numpy as np

    import jaxpos

    q = jnp.asarray(np.random.default_rng(0).normal(size=(1, 8, 2, 8)), jnp.float32)

    def f(q, k, v, pos, seg):
        return jaxpos.attention(q, k, v, position=jaxpos.ALiBi(2), q_positions=pos,
                                kv_positions=pos, causal=True, implementation="pallas")

    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sharded, mesh = _sharded(f, 5)
    q = jax.device_put(q, NamedSharding(mesh, P("b")))
    pos = jax.device_put(jnp.arange(8, dtype=jnp.int32), NamedSharding(mesh, P()))
    seg = jax.device_put(jnp.zeros((1, 8), jnp.int32), NamedSharding(mesh, P("b")))
    with pytest.raises(ValueError, match="check_vma=False.*implementation='chunked'"):
        jax.jit(sharded)(q, q, q, pos, seg)
