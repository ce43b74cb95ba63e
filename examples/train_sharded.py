"""Sharded training of a ``jaxpos.nnx.DecoderLM``: one jitted optax step on a
``(data, fsdp, tensor)`` mesh, or with context parallelism on a ``seq`` axis.

The model's parameters name their logical axes (``embed``, ``heads``, ``kv_heads``,
``mlp``, ``vocab``, ...); :func:`jaxpos.sharding.place` puts each one on the mesh by the
rules table :data:`jaxpos.sharding.DEFAULT_RULES` (``embed`` over ``fsdp``, heads and the
MLP over ``tensor``), and the batch of tokens is sharded over ``data`` and ``fsdp`` (and
its sequence over ``seq`` with ``--context-parallel``). The step is an ordinary
``jax.jit`` of ``jax.value_and_grad`` and ``optax.adamw`` under ``jax.set_mesh(mesh)``:
the compiler partitions the matmuls from the parameters' shardings and every attention
layer runs per (batch, head) shard (``jaxpos.core.partition``), or sequence-parallel
with ``context_parallel="ring" | "ulysses"``.

``--check`` runs the same first step on one device and prints the largest difference of
the loss and of every gradient (relative to ``max(1, max |g|)``), and the loss of every
training step on both; the script exits with status 1 when one exceeds ``--tol``.

On a CPU host the script makes ``--cpu-devices`` CPU devices (default 8). The same run
spans several processes with JAX's multi-controller runtime (``jax.distributed``): start
one process per host (here two on one machine, 4 CPU devices each, a local coordinator)::

    python examples/train_sharded.py --scheme alibi --check
    python examples/train_sharded.py --mesh data=2,seq=4 --context-parallel ring --check
    python examples/train_sharded.py --cpu-devices 4 --num-processes 2 --process-id 0 \\
        --coordinator localhost:12355 --check &
    python examples/train_sharded.py --cpu-devices 4 --num-processes 2 --process-id 1 \\
        --coordinator localhost:12355 --check

Every process builds the same model and batches from ``--seed``; the global arrays are
assembled from the shards each process holds (``jax.make_array_from_callback``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

SCHEMES = ("rope", "alibi", "t5", "fox")
MESH_AXES = ("data", "fsdp", "tensor", "seq")


def parse_mesh(text: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``"data=2,fsdp=2,tensor=2"`` -> ``((2, 2, 2), ("data", "fsdp", "tensor"))``.

    Raises:
      argparse.ArgumentTypeError: a name outside data/fsdp/tensor/seq, a repeated name,
        or a size that is not a positive integer.
    """
    sizes, names = [], []
    for item in text.split(","):
        name, sep, size = item.strip().partition("=")
        if not sep or name not in MESH_AXES or name in names:
            raise argparse.ArgumentTypeError(
                f"--mesh wants distinct NAME=SIZE items with NAME in {', '.join(MESH_AXES)};"
                f" got {text!r}")
        if not size.isdigit() or int(size) < 1:
            raise argparse.ArgumentTypeError(f"--mesh: size of {name!r} must be a positive "
                                             f"integer; got {size!r}")
        names.append(name)
        sizes.append(int(size))
    return tuple(sizes), tuple(names)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scheme", choices=SCHEMES, default="rope", help="position scheme")
    p.add_argument("--mesh", type=parse_mesh, default=None,
                   help="mesh axes and sizes, e.g. data=2,fsdp=2,tensor=2 (the default) or "
                        "data=2,seq=4 with --context-parallel; their product is the number "
                        "of devices of all processes")
    p.add_argument("--axis-types", choices=("explicit", "auto"), default="explicit",
                   help="the mesh axes' type: explicit (jax.make_mesh's default) or auto")
    p.add_argument("--context-parallel", choices=("ring", "ulysses"), default=None,
                   help="every layer's attention sequence-parallel over the mesh axis seq")
    p.add_argument("--implementation", choices=("reference", "chunked", "xla", "pallas"),
                   default=None, help="attention engine (default: the backend's choice)")
    p.add_argument("--steps", type=int, default=5, help="training steps")
    p.add_argument("--check", action="store_true",
                   help="compare the loss and every gradient with the single-device step")
    p.add_argument("--tol", type=float, default=1e-5, help="tolerance of --check")
    p.add_argument("--vocab-size", type=int, default=64, help="token vocabulary")
    p.add_argument("--d-model", type=int, default=64, help="model width")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--heads", type=int, default=4, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default "
                   "--heads)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (global)")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="initialisation and data seed")
    p.add_argument("--cpu-devices", type=int, default=8,
                   help="CPU devices of this process (jax_num_cpu_devices; 0 leaves JAX's "
                        "default); ignored by GPU and TPU backends")
    p.add_argument("--num-processes", type=int, default=1,
                   help="processes of a jax.distributed run (1: no jax.distributed)")
    p.add_argument("--process-id", type=int, default=0, help="this process's index")
    p.add_argument("--coordinator", default="localhost:12355",
                   help="HOST:PORT of process 0's coordinator (jax.distributed)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="also write the losses and differences to this JSON file")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.mesh is None:
        args.mesh = ((2, 2, 2), ("data", "fsdp", "tensor")) if args.context_parallel is None \
            else ((2, 4), ("data", "seq"))
    names = args.mesh[1]
    if ("seq" in names) != (args.context_parallel is not None):
        p.error("a seq axis in --mesh goes with --context-parallel, and --context-parallel "
                f"with a seq axis; got --mesh {names} and --context-parallel "
                f"{args.context_parallel}")
    for flag in ("steps", "vocab_size", "d_model", "layers", "heads", "batch_size", "seq_len"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be positive; got {getattr(args, flag)}")
    if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
        p.error(f"--process-id must be in [0, --num-processes); got {args.process_id} of "
                f"{args.num_processes}")
    return args


# ------------------------------------------------------------------------- model and data
def make_model(args: argparse.Namespace, context_parallel: str | None) -> Any:
    """The ``DecoderLM`` of the flags, with every layer's attention sequence-parallel
    when ``context_parallel`` is given (which changes the graph, not the parameters)."""
    import jaxpos.nnx as jn

    return jn.DecoderLM(args.vocab_size, d_model=args.d_model, num_layers=args.layers,
                        num_heads=args.heads, num_kv_heads=args.kv_heads,
                        position=args.scheme, implementation=args.implementation,
                        context_parallel=context_parallel, rngs=nnx.Rngs(args.seed))


def graph_of(args: argparse.Namespace, context_parallel: str | None) -> Any:
    """The model's graph (``nnx.split``'s first part), traced without computing arrays."""
    return nnx.eval_shape(lambda: nnx.split(make_model(args, context_parallel),
                                            nnx.Param))[0]


def init_params(args: argparse.Namespace) -> Any:
    """The model's parameters as host NumPy arrays, the same in every process
    (``--seed``); the initialisers are compiled once, not one by one."""
    params = jax.jit(lambda: nnx.split(make_model(args, None), nnx.Param)[1])()
    return jax.tree.map(np.asarray, params)


def batches(args: argparse.Namespace) -> np.ndarray:
    """``[steps, batch, seq_len + 1]`` int32 tokens: each row a periodic pattern (period
    8, random symbols) so the loss falls; the same in every process."""
    rng = np.random.default_rng(args.seed)
    period = rng.integers(0, args.vocab_size, size=(args.steps, args.batch_size, 8))
    reps = math.ceil((args.seq_len + 1) / 8)
    return np.tile(period, (1, 1, reps))[..., :args.seq_len + 1].astype(np.int32)


def make_train_step(graphdef: Any, tx: optax.GradientTransformation, *,
                    return_grads: bool = False):
    """``train_step(params, opt_state, inputs, labels) -> (loss, params, opt_state)`` (not
    yet jitted): next-token cross-entropy, its gradients, one ``tx`` update. With
    ``return_grads`` the gradients come back too, ``(loss, grads, params, opt_state)``,
    for ``--check``."""

    def loss_fn(params, inputs, labels):
        logits = nnx.merge(graphdef, params)(inputs)
        logz = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
        return jnp.mean(logz - picked)

    def train_step(params, opt_state, inputs, labels):
        loss, grads = jax.value_and_grad(loss_fn)(params, inputs, labels)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return (loss, grads, params, opt_state) if return_grads else (loss, params, opt_state)

    return train_step


# ------------------------------------------------------------------------------ the runs
def global_array(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """``x`` (the same host array in every process) as a global array of ``sharding``:
    each process fills the shards its devices hold."""
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def train(step, params, opt_state, data, put) -> tuple[list[float], Any]:
    """``--steps`` steps of the jitted ``step`` over ``data`` (each batch's inputs and
    labels placed by ``put``): the losses, and the first step's gradients when ``step``
    returns them."""
    losses, first_grads = [], None
    for tokens in data:
        loss, *rest = step(params, opt_state, put(tokens[:, :-1]), put(tokens[:, 1:]))
        if len(rest) == 3:
            grads, params, opt_state = rest
            first_grads = grads if first_grads is None else first_grads
        else:
            params, opt_state = rest
        losses.append(float(loss))
    return losses, first_grads


def run_one_device(args, graphdef, params, data, tx) -> tuple[list[float], Any]:
    """The losses of ``--steps`` steps on this process's first device, and the first
    step's gradients (host arrays)."""
    device = jax.local_devices()[0]
    params = jax.device_put(params, device)
    step = jax.jit(make_train_step(graphdef, tx, return_grads=True))
    losses, grads = train(step, params, jax.jit(tx.init)(params), data,
                          lambda x: jax.device_put(x, device))
    return losses, jax.tree.map(np.asarray, grads)


def run_sharded(args, graphdef, params, data, tx, reference=None) -> dict[str, Any]:
    """The same steps on the mesh; with ``reference`` (the single-device gradients of the
    first step, host arrays) the largest difference of every gradient, computed on the
    mesh so that every process gets the global maxima."""
    from jaxpos import sharding

    shape, names = args.mesh
    kind = AxisType.Explicit if args.axis_types == "explicit" else AxisType.Auto
    mesh = jax.make_mesh(shape, names, axis_types=(kind,) * len(shape))
    out: dict[str, Any] = {}
    with jax.set_mesh(mesh):
        placed = sharding.place(params, mesh)  # by the parameters' logical axes
        token_spec = sharding.logical_spec(("batch", "seq"), mesh,
                                           shape=(args.batch_size, args.seq_len))
        batch_sharding = NamedSharding(mesh, token_spec)
        out["q_proj_spec"] = str(placed["blocks"][0]["attn"]["q_proj"]["kernel"]
                                 .get_value().sharding.spec)
        out["tokens_spec"] = str(token_spec)
        # the optimizer state lives where its parameters do
        param_shardings = jax.tree.map(lambda x: x.sharding, placed)
        opt_shardings = optax.tree_map_params(tx, lambda _, s: s,
                                              jax.eval_shape(tx.init, params),
                                              param_shardings,
                                              transform_non_params=lambda _: NamedSharding(
                                                  mesh, P()))
        opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(placed)
        replicated = NamedSharding(mesh, P())
        keep = reference is not None
        step = jax.jit(make_train_step(graphdef, tx, return_grads=keep),
                       out_shardings=(replicated, *((param_shardings,) if keep else ()),
                                      param_shardings, opt_shardings))
        start = time.perf_counter()
        out["losses"], grads = train(step, placed, opt_state, data,
                                     lambda x: global_array(x, batch_sharding))
        out["seconds"] = time.perf_counter() - start
        if keep:
            ref = jax.tree.map(lambda r, g: global_array(r, g.sharding), reference, grads)

            def diffs(got, want):
                return jax.tree.map(lambda a, b: jnp.max(jnp.abs(a - b))
                                    / jnp.maximum(1.0, jnp.max(jnp.abs(b))), got, want)

            per_leaf = jax.jit(diffs)(grads, ref)
            out["grad_diffs"] = {jax.tree_util.keystr(path): float(v) for path, v in
                                 jax.tree_util.tree_leaves_with_path(per_leaf)}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_devices:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    if args.num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives
        jax.distributed.initialize(coordinator_address=args.coordinator,
                                   num_processes=args.num_processes,
                                   process_id=args.process_id)
    jax.config.update("jax_default_matmul_precision", "highest")  # float32 matmuls (TPU)
    shape, names = args.mesh
    if math.prod(shape) != jax.device_count():
        print(f"error: --mesh {dict(zip(names, shape))} has {math.prod(shape)} devices; "
              f"this run has {jax.device_count()} ({jax.process_count()} process(es))",
              file=sys.stderr)
        return 2
    pid = jax.process_index()
    say = print if pid == 0 else (lambda *a, **k: None)
    say(f"{args.scheme}: DecoderLM d_model {args.d_model}, {args.layers} layers, "
        f"{args.heads} heads on mesh {dict(zip(names, shape))} ({args.axis_types} axes, "
        f"{jax.process_count()} process(es), {jax.device_count()} {jax.default_backend()} "
        f"devices), context_parallel {args.context_parallel}")

    graphdef, params = graph_of(args, args.context_parallel), init_params(args)
    data = batches(args)
    tx = optax.adamw(args.lr)
    result: dict[str, Any] = {"process_index": pid, "process_count": jax.process_count(),
                              "device_count": jax.device_count()}
    reference = None
    if args.check:
        plain = graphdef if args.context_parallel is None else graph_of(args, None)
        result["ref_losses"], reference = run_one_device(args, plain, params, data, tx)
    result.update(run_sharded(args, graphdef, params, data, tx, reference))
    say(f"parameters: q_proj.kernel {result['q_proj_spec']}, tokens {result['tokens_spec']}")
    for i, value in enumerate(result["losses"]):
        ref = f"  (one device {result['ref_losses'][i]:.6f})" if args.check else ""
        say(f"step {i}: loss {value:.6f}{ref}")
    say(f"{args.steps} steps in {result['seconds']:.2f} s (compilation included)")
    if not args.check:
        return _write(args, result)

    result["loss_diff"] = abs(result["losses"][0] - result["ref_losses"][0])
    result["steps_loss_diff"] = max(abs(a - b) for a, b in zip(result["losses"],
                                                                result["ref_losses"]))
    result["grad_diff"] = max(result["grad_diffs"].values())
    worst = max(result["grad_diffs"], key=result["grad_diffs"].get)
    say(f"check against one device: loss |diff| {result['loss_diff']:.2e}; gradients "
        f"{result['grad_diff']:.2e} at most over {len(result['grad_diffs'])} arrays "
        f"(params{worst}); loss over {args.steps} steps {result['steps_loss_diff']:.2e}")
    ok = max(result["loss_diff"], result["grad_diff"], result["steps_loss_diff"]) <= args.tol
    result["ok"] = ok
    say(f"{'OK' if ok else 'FAILED'} (tolerance {args.tol:g})")
    _write(args, result)
    return 0 if ok else 1


def _write(args: argparse.Namespace, result: dict[str, Any]) -> int:
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    if args.num_processes > 1:
        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
