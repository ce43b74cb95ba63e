"""The conformance cases on :func:`jaxpos.parallel.ring_attention` over 8 CPU devices,
:func:`jaxpos.parallel.ulysses_attention` over 4 and USP (Ulysses with ``ring_axis``) on
a 2 x 2 mesh.

Run by ``test_conformance.py`` (slow) in a subprocess, since
``--xla_force_host_platform_device_count`` must be set before JAX starts::

    python tests/conformance/_ring_conformance_worker.py OUT.json

Every case a path takes (``IMPLEMENTATIONS[path].takes``) runs inside ``jax.shard_map``
with the sequence of q, k, v, their positions and segment ids sharded over the path's
mesh axes (the scheme and the sinks replicated); OUT.json maps the path and the case id
to ``{"out", "grads"}`` of the whole sequence, which the test compares with the float64
contract as it does every other path.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _conformance_cases import (  # noqa: E402
    IMPLEMENTATIONS,
    ULYSSES_DEVICES,
    USP_MESH,
    all_cases,
    covered_elsewhere,
    run_attention,
)
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxpos.parallel import ring_attention, shard_map, ulysses_attention  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def ring_attend(mesh, method=ring_attention, axes="seq", **method_kw):
    """``attend`` of the conformance cases through ``method`` (ring_attention or
    ulysses_attention with ``method_kw``) over the mesh axes ``axes``."""

    def attend(q, k, v, scheme, sinks, *, causal, q_positions, kv_positions, segment_ids=None,
               kv_segment_ids=None, score_mod=None, mask_mod=None):
        B, Tq, Tk = q.shape[0], q.shape[1], k.shape[1]
        qp = jnp.broadcast_to(jnp.asarray(np.arange(Tq) + max(Tk - Tq, 0)
                                          if q_positions is None else q_positions,
                                          jnp.int32), (B, Tq))
        kp = jnp.broadcast_to(jnp.asarray(np.arange(Tk) if kv_positions is None
                                          else kv_positions, jnp.int32), (B, Tk))
        seq = P(None, axes)
        segs = () if segment_ids is None else (jnp.asarray(segment_ids, jnp.int32),
                                               jnp.asarray(kv_segment_ids, jnp.int32))

        def local(scheme, sinks, q, k, v, qp, kp, *segs):
            seg = dict(zip(("segment_ids", "kv_segment_ids"), segs))
            return method(q, k, v, position=scheme, sinks=sinks, q_positions=qp,
                          kv_positions=kp, causal=causal, score_mod=score_mod,
                          mask_mod=mask_mod, block_q=4, block_k=4, **seg, **method_kw)

        fn = shard_map(local, mesh=mesh,
                       in_specs=(P(), P(), seq, seq, seq, seq, seq) + (seq,) * len(segs),
                       out_specs=seq)
        return fn(scheme, sinks, q, k, v, qp, kp, *segs)

    return attend


def main(out_path):
    devices = np.array(jax.devices())
    R, U = USP_MESH
    paths = {
        "ring": ring_attend(Mesh(devices[:8], ("seq",)), axis_name="seq"),
        "ulysses": ring_attend(Mesh(devices[:ULYSSES_DEVICES], ("seq",)), ulysses_attention,
                               axis_name="seq"),
        "usp": ring_attend(Mesh(devices[:R * U].reshape(R, U), ("ring", "uly")),
                           ulysses_attention, ("ring", "uly"), axis_name="uly",
                           ring_axis="ring"),
    }
    results = {}
    for path, attend in paths.items():
        takes = IMPLEMENTATIONS[path].takes
        results[path] = {}
        for cid, case in all_cases():
            if takes is not None and not takes(case) or covered_elsewhere(path, cid):
                continue
            out, grads = run_attention(case, attend)
            results[path][cid] = {"out": out.tolist(),
                                  "grads": None if grads is None else {
                                      n: g.tolist() for n, g in grads.items()}}
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
