"""One process of the 2-process ``jax.distributed`` check (tests/parallel/test_ulysses.py).

Usage::

    python tests/parallel/_distributed_worker.py PROCESS_ID NUM_PROCESSES PORT OUT.json

Each process has 4 CPU devices (``--xla_force_host_platform_device_count=4``) and joins
the coordinator at ``localhost:PORT``; the 8 devices of both processes form one mesh.
On it, :func:`jaxpos.parallel.ring_attention` (8-device ``seq`` axis, zigzag layout) and
:func:`jaxpos.parallel.ulysses_attention` (USP: Ulysses over the 4 devices of a process,
the ring over the 2 processes) run on global arrays built from the same NumPy inputs in
every process; each process compares the shards it holds of the output and of the
gradients of q, k, v and the T5 table with the single-device ``jaxpos.attention`` of
the whole sequence, computed locally. OUT.json: ``{check: max relative difference}``.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

B, T, N, NK, H = 1, 64, 8, 2, 8


def main(pid: int, nproc: int, port: int, out_path: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=nproc,
                               process_id=pid)
    jax.config.update("jax_default_matmul_precision", "highest")
    from jaxpos import T5Bias, attention
    from jaxpos.parallel import ring_attention, shard_map, ulysses_attention, zigzag_permutation

    devices = np.array(jax.devices())
    assert devices.size == 8 and jax.process_count() == nproc, (devices, jax.process_count())
    r = np.random.default_rng(0)
    q = r.normal(size=(B, T, N, H)).astype(np.float32)
    k = r.normal(size=(B, T, NK, H)).astype(np.float32)
    v = r.normal(size=(B, T, NK, H)).astype(np.float32)
    w = r.normal(size=(B, T, N, H)).astype(np.float32)
    table = r.normal(size=(32, N)).astype(np.float32)
    res = {"process_count": float(jax.process_count())}

    def plain(table, q, k, v):
        pos = jnp.arange(T, dtype=jnp.int32)
        return attention(q, k, v, position=T5Bias(table, bidirectional=False), q_positions=pos,
                         kv_positions=pos, causal=True, implementation="reference")

    loss = lambda f: jax.jit(jax.value_and_grad(
        lambda t, q, k, v, w: jnp.sum(f(t, q, k, v) * w), argnums=(0, 1, 2, 3)))
    (_, want) = loss(plain)(table, q, k, v, w)
    want_out = np.asarray(jax.jit(plain)(table, q, k, v))

    # (ring, 8-device axis, zigzag) and (USP: ring over processes x Ulysses inside one)
    layouts = {
        "ring": (Mesh(devices, ("seq",)), "seq", 8,
                 lambda t, q, k, v, p: ring_attention(
                     q, k, v, axis_name="seq", position=T5Bias(t, bidirectional=False),
                     q_positions=p, kv_positions=p, causal=True, block_q=4, block_k=4)),
        "usp": (Mesh(devices.reshape(2, 4), ("ring", "uly")), ("ring", "uly"), 2,
                lambda t, q, k, v, p: ulysses_attention(
                    q, k, v, axis_name="uly", ring_axis="ring",
                    position=T5Bias(t, bidirectional=False), q_positions=p, kv_positions=p,
                    causal=True, block_q=4, block_k=4)),
    }
    for name, (mesh, axes, zz_devices, fn) in layouts.items():
        perm = zigzag_permutation(T, zz_devices)
        seq = NamedSharding(mesh, P(None, axes))
        put = lambda x, sh: jax.make_array_from_callback(x.shape, sh, lambda i: x[i])
        g_q, g_k, g_v, g_w = (put(x[:, perm], seq) for x in (q, k, v, w))
        g_pos = put(perm.astype(np.int32), NamedSharding(mesh, P(axes)))
        g_tab = put(table, NamedSharding(mesh, P()))
        sm = shard_map(fn, mesh=mesh, in_specs=(P(), P(None, axes), P(None, axes),
                                                  P(None, axes), P(axes)),
                       out_specs=P(None, axes))
        out = jax.jit(sm)(g_tab, g_q, g_k, g_v, g_pos)
        _, grads = jax.jit(jax.value_and_grad(
            lambda t, q, k, v, w, p, sm=sm: jnp.sum(sm(t, q, k, v, p) * w),
            argnums=(0, 1, 2, 3)))(g_tab, g_q, g_k, g_v, g_w, g_pos)
        checks = {"out": (out, want_out[:, perm]), "dq": (grads[1], np.asarray(want[1])[:, perm]),
                  "dk": (grads[2], np.asarray(want[2])[:, perm]),
                  "dv": (grads[3], np.asarray(want[3])[:, perm]),
                  "dtable": (grads[0], np.asarray(want[0]))}
        for check, (got, ref) in checks.items():
            scale = max(1.0, float(np.max(np.abs(ref))))
            worst = 0.0
            for shard in got.addressable_shards:  # this process's shards
                worst = max(worst, float(np.max(np.abs(np.asarray(shard.data) - ref[shard.index]))))
            res[f"{name}/{check}"] = worst / scale
    with open(out_path, "w") as fh:
        json.dump(res, fh)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
