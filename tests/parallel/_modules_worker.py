"""Context-parallel Flax models, run by tests/parallel/test_context_parallel_modules.py in a
subprocess with 8 CPU devices. Usage::

    python tests/parallel/_modules_worker.py [--full] OUT.json

(the default test run's cases run in ``_ring_worker.py --quick``'s process instead).

For each case, a ``jaxpos.nnx.DecoderLM`` (or its Linen twin) built with
``context_parallel="ring" | "ulysses"`` is trained one jitted step under
``jax.set_mesh(mesh)`` (an 8-device ``seq`` axis, or a 2 x 4 ``data`` x ``seq`` mesh with
the batch over ``data``) and compared with the same model (same parameters) built with
``context_parallel=None`` and run without a mesh: the loss and every parameter's
gradient (relative to ``max(1, max |gradient|)``). Also ``decode_step`` of a
context-parallel model against the plain one. OUT.json: ``{check: difference}``.
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

jax.config.update("jax_default_matmul_precision", "highest")

V, D, L, N, T, B = 64, 32, 2, 8, 32, 2


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(1.0, float(np.max(np.abs(b)))))


def _data():
    r = np.random.default_rng(0)
    tokens = jnp.asarray(r.integers(0, V, size=(B, T)), jnp.int32)
    return tokens, jnp.roll(tokens, -1, axis=1)


def _loss(logits, targets):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def nnx_case(position, method, mesh, zigzag=False, kv_heads=None, **opts):
    from jaxpos.nnx import DecoderLM

    tokens, targets = _data()
    make = lambda **kw: DecoderLM(V, d_model=D, num_layers=L, num_heads=N, position=position,
                                  max_len=T,
                                  num_kv_heads=kv_heads, rngs=nnx.Rngs(0), **opts, **kw)
    plain, cp = make(), make(context_parallel=method, context_zigzag=zigzag)

    def step(model, tokens, targets):
        return nnx.value_and_grad(lambda m: _loss(m(tokens), targets))(model)

    want_loss, want_g = nnx.jit(step)(plain, tokens, targets)
    graphdef, state = nnx.split(cp)
    pure = jax.jit(lambda state, tokens, targets: step(nnx.merge(graphdef, state), tokens,
                                                       targets))
    with jax.set_mesh(mesh):
        compiled = pure.lower(state, tokens, targets).compile()  # compiled once
        got_loss, got_g = compiled(state, tokens, targets)
        hlo = compiled.as_text()
    res = {"loss": abs(float(got_loss) - float(want_loss)),
           # the step does run sequence-parallel: the method's collectives are compiled in
           "collectives": float(hlo.count("collective-permute(" if method == "ring"
                                          else "all-to-all("))}
    wl, gl = jax.tree_util.tree_leaves(nnx.state(want_g)), jax.tree_util.tree_leaves(
        nnx.state(got_g))
    assert len(wl) == len(gl)
    res["grads"] = max(_rel(g, w) for g, w in zip(gl, wl))
    res["grad_norm"] = float(sum(float(jnp.sum(jnp.abs(w))) for w in wl))
    return res


def linen_case(position, method, mesh, zigzag=False):
    from jaxpos.linen import DecoderLM

    tokens, targets = _data()
    make = lambda **kw: DecoderLM(V, d_model=D, num_layers=L, num_heads=N, position=position,
                                  max_len=T,
                                  **kw)
    plain, cp = make(), make(context_parallel=method, context_zigzag=zigzag)
    params = plain.init(jax.random.key(0), tokens)

    def step(model):
        return jax.jit(jax.value_and_grad(lambda p: _loss(model.apply(p, tokens), targets)))

    want_loss, want_g = step(plain)(params)
    with jax.set_mesh(mesh):
        got_loss, got_g = step(cp)(params)
    wl, gl = jax.tree_util.tree_leaves(want_g), jax.tree_util.tree_leaves(got_g)
    return {"loss": abs(float(got_loss) - float(want_loss)),
            "grads": max(_rel(g, w) for g, w in zip(gl, wl)),
            "grad_norm": float(sum(float(jnp.sum(jnp.abs(w))) for w in wl))}


def decode_case(method, mesh):
    """decode_step of a context-parallel model (one query per step: the ordinary path)."""
    from jaxpos.nnx import DecoderLM

    tokens, _ = _data()
    make = lambda **kw: DecoderLM(V, d_model=D, num_layers=L, num_heads=N, position="rope",
                                  rngs=nnx.Rngs(0), **kw)
    plain, cp = make(), make(context_parallel=method)

    def run(model):
        # one jitted step (eagerly, each of the layers' ops dispatched under the mesh
        # on its own cost most of this worker's time)
        step = nnx.jit(lambda model, token, cache: model.decode_step(token, cache))
        cache = model.init_cache(B, T)
        outs = []
        for t in range(4):
            logits, cache = step(model, tokens[:, t:t + 1], cache)
            outs.append(logits)
        return jnp.concatenate(outs, axis=1)

    want = run(plain)
    with jax.set_mesh(mesh):
        got = run(cp)
    return {"decode": _rel(got, want)}


#: The default test run's cases (run by ``_ring_worker.py --quick``, in its subprocess).
QUICK = [("nnx", "rope", "ring", True), ("linen", "t5", "ulysses", False)]


def run(full: bool) -> dict:
    """``{check: difference}`` of the quick (default test run) or full case list."""
    devices = np.array(jax.devices())
    assert devices.size == 8
    mesh = jax.sharding.Mesh(devices, ("seq",))
    res = {}
    if full:
        from jaxpos.layers.options import stack_positions
        from jaxpos.schemes.base import REGISTRY

        def flag(p, name):
            return getattr(REGISTRY.get(p), name, False)

        # a scheme computed in token order (FoX) runs the contiguous ring, not the zigzag
        # layout (which would give it other gates); a scheme replacing softmax attention
        # (stick-breaking, CoPE, PaTH) is refused by name, checked below
        # each scheme once, the two methods taking turns in the registry's order (both
        # methods for every scheme, about 40 compilations, took 5 minutes of CI), but for
        # the ones whose layers another scheme's case already runs: NoPE (RoPE's layer
        # without the rotation), sinusoidal (added at the input, as learned positions
        # are), KERPLE's power form (the log form's layer)
        same_layer = {"nope", "sinusoidal", "kerple_power"}
        softmax = [p for p in stack_positions()
                   if not flag(p, "replaces_softmax") and p not in same_layer]
        cases = [("nnx", p, m, m == "ring" and not flag(p, "reads_token_order"))
                 for i, p in enumerate(softmax) for m in (("ring", "ulysses")[i % 2],)]
        for p in stack_positions():
            if flag(p, "replaces_softmax"):
                try:
                    nnx_case(p, "ring", mesh)
                    res[f"refused/nnx/{p}/not-refused"] = "ran"
                except ValueError as e:
                    ok = "replaces softmax attention" in str(e)
                    res[f"refusal/nnx/{p}" if ok else f"refused/nnx/{p}"] = str(e)[:300]
        cases += [("linen", "shaw", "ulysses", False)]  # (the quick list has Linen's T5)
    else:
        cases = QUICK
    for twin, pos, method, zz in cases:
        fn = nnx_case if twin == "nnx" else linen_case
        name = f"{twin}/{pos}/{method}{'/zigzag' if zz else ''}"
        try:
            for k, v in fn(pos, method, mesh, zigzag=zz).items():
                res[f"{k}/{name}"] = v
        except ValueError as e:  # a refusal is reported (and fails the test) by name
            res[f"refused/{name}"] = str(e)[:300]
        print(name, {k: v for k, v in res.items() if k.endswith(name)}, flush=True)
    for k, v in decode_case("ring", mesh).items():
        res[f"{k}/nnx/rope/ring"] = v
    if full:  # the batch over a data axis, the sequence over seq
        mesh2 = jax.sharding.Mesh(devices.reshape(2, 4), ("data", "seq"))
        for k, v in nnx_case("rope", "ring", mesh2, zigzag=True, kv_heads=2).items():
            res[f"{k}/nnx/rope/ring/mesh2x4"] = v
    return res


def main(argv):
    out_path = next(a for a in argv if not a.startswith("--"))
    res = run("--full" in argv)
    with open(out_path, "w") as fh:
        json.dump(res, fh, indent=1, sort_keys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
