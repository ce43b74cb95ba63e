"""The 8-device checks of the modules' logical axes (tests/parallel/test_sharded_modules.py).

Usage::

    python tests/parallel/_logical_axes_worker.py [--quick] OUT.json

With ``--xla_force_host_platform_device_count=8`` (set here, before JAX is imported), a
small ``DecoderLM`` (NNX and Linen, grouped-query heads) has its parameters placed by
:mod:`jaxpos.sharding`'s rules on a ``(2, 4)`` ``(data, tensor)`` and a ``(2, 2, 2)``
``(data, fsdp, tensor)`` mesh, with Auto and with Explicit axes, and runs a jitted
cross-entropy loss and its gradients on a batch sharded over ``data``/``fsdp``; each is
compared with the same step on one device. OUT.json: ``{check: value}``, the max absolute
differences (``.../loss``, ``.../grad``; gradients relative to ``max(1, max |g|)``) and
the placement of ``q_proj.kernel`` and its gradient (``.../spec``, a string).
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
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import jaxpos.linen as jl  # noqa: E402
import jaxpos.nnx as jn  # noqa: E402
from jaxpos import sharding  # noqa: E402

V, D, LAYERS, N, NK, B, T = 64, 32, 1, 4, 2, 4, 16
MESHES = {"2x4": ((2, 4), ("data", "tensor")), "2x2x2": ((2, 2, 2), ("data", "fsdp", "tensor"))}


def xent(logits, tokens):
    return jnp.mean(jax.nn.logsumexp(logits, -1)
                    - jnp.sum(logits * jax.nn.one_hot(tokens, V), -1))


def models(position):
    kw = dict(d_model=D, num_layers=LAYERS, num_heads=N, num_kv_heads=NK, position=position)
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, V)
    model = jn.DecoderLM(V, rngs=nnx.Rngs(0), **kw)
    gdef, state = nnx.split(model)

    def nnx_loss(state, tokens):
        return xent(nnx.merge(gdef, state)(tokens), tokens)

    lm = jl.DecoderLM(V, **kw)
    params = lm.init(jax.random.key(2), tokens)["params"]  # LogicallyPartitioned boxes

    def linen_loss(params, tokens):
        return xent(lm.apply({"params": params}, tokens), tokens)

    return tokens, {"nnx": (nnx_loss, state), "linen": (linen_loss, params)}


def q_kernel(tree, twin):
    if twin == "nnx":
        return tree["blocks"][0]["attn"]["q_proj"]["kernel"].get_value()
    return tree["blocks_0"]["attn"]["q_proj"]["kernel"].value


def max_rel(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               / max(1.0, float(np.max(np.abs(np.asarray(y))))) for x, y in zip(la, lb))


def main(quick: bool, out_path: str) -> None:
    res: dict[str, object] = {"num_devices": float(jax.device_count())}
    if quick:
        cases = [("rope", "nnx", "2x2x2", AxisType.Explicit),
                 ("alibi", "linen", "2x4", AxisType.Auto)]
    else:
        # every twin on every mesh and axis type, the schemes taking turns (each on two of
        # the eight; the whole product, 32 compilations, took minutes of CI)
        combos = [(twin, m, kind) for twin in ("nnx", "linen") for m in MESHES
                  for kind in (AxisType.Auto, AxisType.Explicit)]
        schemes = ("rope", "alibi", "t5", "fox")
        cases = [(schemes[i % len(schemes)], *c) for i, c in enumerate(combos)]
    built = {}
    for position, twin, mesh_name, kind in cases:
        if position not in built:
            built[position] = models(position)
        tokens, fns = built[position]
        loss, params = fns[twin]
        step = jax.jit(jax.value_and_grad(loss))
        want_loss, want_grad = step(params, tokens)
        shape, names = MESHES[mesh_name]
        mesh = jax.make_mesh(shape, names, axis_types=(kind,) * len(shape))
        axes = "explicit" if kind == AxisType.Explicit else "auto"
        name = f"{position}/{twin}/{mesh_name}/{axes}"
        with jax.set_mesh(mesh):
            placed = sharding.place(params, mesh)
            batch = NamedSharding(mesh, P(tuple(a for a in ("data", "fsdp") if a in names)))
            got_loss, got_grad = step(placed, jax.device_put(tokens, batch))
        res[f"{name}/loss"] = float(abs(got_loss - want_loss))
        res[f"{name}/grad"] = max_rel(got_grad, want_grad)
        res[f"{name}/spec"] = (f"{q_kernel(placed, twin).sharding.spec} "
                               f"{q_kernel(got_grad, twin).sharding.spec}")
    with open(out_path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    args = sys.argv[1:]
    main("--quick" in args, args[-1])
