"""Sharding checks, run by tests/parallel/test_sharding.py in a subprocess with 8 CPU devices.

XLA reads ``--xla_force_host_platform_device_count`` once, when the backend starts, so it
must be in ``XLA_FLAGS`` before ``import jax``; a subprocess keeps the other tests on one
device. Usage::

    python tests/parallel/_sharding_worker.py [--full] OUT.json

Writes ``{check_name: max_abs_difference_vs_unsharded}`` (and a few other numbers) to
OUT.json. ``--full`` runs every implementation and scheme (each scheme on one engine per
kind of sharding, the engines taking turns); the default runs the chunked
path (the CPU default) on the schemes that matter for each kind of sharding, and the
training step on the reference path.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpos import ALiBi, NoPE, RoPE, Shaw, T5Bias, attention

try:  # JAX >= 0.6 (0.10, 0.11): public jax.shard_map
    from jax import shard_map as _shard_map
except ImportError:  # older JAX
    from jax.experimental.shard_map import shard_map as _shard_map


def shard_map(f, *, mesh, in_specs, out_specs, checks=True):
    """``jax.shard_map`` / ``jax.experimental.shard_map.shard_map``, keyword-compatible,
    with its default checks on (``check_vma`` / ``check_rep``) unless ``checks=False`` or
    ``JAXPOS_SHARD_MAP_CHECKS=0``: users run with the defaults, so the tests do too.

    The Pallas kernel is the exception here: on CPU it runs in JAX's Pallas interpreter,
    which cannot lower under varying-axis checks (the compiled kernel can; its lowering
    inside ``shard_map`` is tested in tests/kernels/test_lowering.py), so it runs with the
    checks off (docs/parallel.md, "Sharding with jit and shard_map")."""
    kw = {}
    if not checks or os.environ.get("JAXPOS_SHARD_MAP_CHECKS", "1") == "0":
        import inspect

        params = inspect.signature(_shard_map).parameters
        kw = {"check_vma": False} if "check_vma" in params else {"check_rep": False}
    return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kw)


def spec_tree(scheme, spec):
    """A scheme-shaped pytree of PartitionSpecs (the scheme's own pytree structure, so it
    is a valid ``in_specs`` entry for ``shard_map``). ``spec`` maps a field name to a spec."""
    leaves_with_path = jax.tree_util.tree_flatten_with_path(scheme)[0]
    names = [str(getattr(p[-1], "idx", p[-1])) for p, _ in leaves_with_path]
    treedef = jax.tree_util.tree_structure(scheme)
    fields = [n for n in type(scheme)._children if getattr(scheme, n) is not None]
    specs = [spec(f) for f in fields]
    assert len(specs) == len(names), (names, fields)
    return jax.tree_util.tree_unflatten(treedef, specs)


def max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def grad_diff(g_sharded, g_plain):
    """Largest leaf-wise max |difference| relative to that leaf's max |gradient| (RoPE's
    inv_freq gradient is large: it sums position-weighted terms)."""
    out = 0.0
    for a, b in zip(jax.tree_util.tree_leaves(g_sharded), jax.tree_util.tree_leaves(g_plain)):
        scale = max(float(np.max(np.abs(np.asarray(b, np.float64)))), 1e-30)
        out = max(out, max_diff(a, b) / max(scale, 1.0))
    return out


def make_scheme(name, N, H, seed=0):
    r = np.random.default_rng(seed)
    f32 = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)
    return {
        "nope": lambda: NoPE(),
        "rope": lambda: RoPE(rotary_dim=H),
        "alibi": lambda: ALiBi(num_heads=N),
        "t5": lambda: T5Bias(f32(32, N), bidirectional=False),
        "shaw": lambda: Shaw(f32(5, H), f32(5, H)),
    }[name]()


# For shard_map over heads: how each scheme's parameters split with the heads.
HEAD_SPECS = {"nope": None, "rope": lambda f: P(), "alibi": lambda f: P("model"),
              "t5": lambda f: P(None, "model"), "shaw": lambda f: P()}


def main(argv):
    full = "--full" in argv
    out_path = next(a for a in argv if not a.startswith("--"))
    devices = jax.devices()
    assert len(devices) == 8, devices
    res = {"num_devices": len(devices)}
    impls = ["reference", "chunked", "pallas"] if full else ["chunked"]
    t0 = time.time()
    cpu0 = time.process_time()

    B, T, N, Nk, H = 8, 16, 8, 4, 8
    r = np.random.default_rng(0)
    q = jnp.asarray(r.normal(size=(B, T, N, H)), jnp.float32)
    k = jnp.asarray(r.normal(size=(B, T, Nk, H)), jnp.float32)
    v = jnp.asarray(r.normal(size=(B, T, Nk, H)), jnp.float32)
    pos = jnp.asarray(np.arange(T)[None] + np.arange(B)[:, None] * 3, jnp.int32)  # offsets

    def fits(impl, s, section=0):
        if impl == "pallas" and s == "shaw":
            return False
        if not full:
            return True
        # --full: in each section every scheme runs on one engine, the engines taking
        # turns (shifted by the section so each engine meets several schemes); the whole
        # product took 5 minutes of CI
        able = [m for m in impls if not (m == "pallas" and s == "shaw")]
        order = ["nope", "rope", "alibi", "t5", "shaw"]
        return able[(order.index(s) + section) % len(able)] == impl

    def full_attention(impl, scheme, q, k, v, qp, kp):
        return attention(q, k, v, position=scheme, q_positions=qp, kv_positions=kp, causal=True,
                         implementation=impl, block_q=4, block_k=4)

    # 1. Batch sharding with jax.sharding (jit + NamedSharding): GSPMD partitions it.
    mesh = Mesh(np.array(devices), ("data",))
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    for impl in impls:
        for s in (["nope", "rope", "alibi", "t5", "shaw"] if full else []):
            if not fits(impl, s, 0):
                continue
            scheme = make_scheme(s, N, H)
            f = jax.jit(functools.partial(full_attention, impl, scheme))
            want = f(q, k, v, pos, pos)
            got = f(put(q, P("data")), put(k, P("data")), put(v, P("data")), put(pos, P("data")),
                    put(pos, P("data")))
            res[f"batch_jit/{impl}/{s}"] = max_diff(got, want)
            res[f"batch_jit/{impl}/{s}/sharded_out"] = float(
                len(got.sharding.device_set) == 8)

    res["cpu_seconds/1"] = time.process_time() - cpu0
    # 2. Batch sharding with shard_map: each device runs attention on its own rows.
    for impl in impls:
        for s in (["rope", "alibi", "t5", "shaw"] if full else ["t5"]):
            if not fits(impl, s, 1):
                continue
            scheme = make_scheme(s, N, H)
            want = jax.jit(functools.partial(full_attention, impl, scheme))(q, k, v, pos, pos)
            fn = shard_map(lambda sch, q, k, v, qp, kp: full_attention(impl, sch, q, k, v, qp, kp),
                           mesh=mesh,
                           in_specs=(spec_tree(scheme, lambda f: P()), P("data"), P("data"),
                                     P("data"), P("data"), P("data")),
                           out_specs=P("data"), checks=impl != "pallas")
            got = jax.jit(fn)(scheme, q, k, v, pos, pos)
            res[f"batch_shard_map/{impl}/{s}"] = max_diff(got, want)
            # gradients through shard_map (the custom VJP runs per shard; parameter
            # gradients are summed over the batch shards at the boundary)
            w = jnp.asarray(np.random.default_rng(5).normal(size=want.shape), jnp.float32)
            sharded = lambda sch, q, k, v: jnp.sum(fn(sch, q, k, v, pos, pos) * w)
            plain = lambda sch, q, k, v: jnp.sum(full_attention(impl, sch, q, k, v, pos, pos) * w)
            g_sh = jax.jit(jax.grad(sharded, argnums=(0, 1, 2, 3)))(scheme, q, k, v)
            g_pl = jax.jit(jax.grad(plain, argnums=(0, 1, 2, 3)))(scheme, q, k, v)
            res[f"batch_shard_map_grad/{impl}/{s}"] = grad_diff(g_sh, g_pl)

    res["cpu_seconds/2"] = time.process_time() - cpu0
    # 3. Head sharding (tensor parallel): mesh data=2 x model=4; q heads 2 per device, kv
    #    heads 1 per device (GQA groups stay on one device); per-head parameters (ALiBi
    #    slopes, T5 table columns) split with the heads.
    mesh2 = Mesh(np.array(devices).reshape(2, 4), ("data", "model"))
    hspec = P("data", None, "model", None)
    for impl in impls:
        for s in (["nope", "rope", "alibi", "t5", "shaw"] if full else ["t5"]):
            if not fits(impl, s, 2):
                continue
            scheme = make_scheme(s, N, H)
            want = jax.jit(functools.partial(full_attention, impl, scheme))(q, k, v, pos, pos)
            sspec = spec_tree(scheme, HEAD_SPECS[s]) if HEAD_SPECS[s] else spec_tree(scheme, None)
            fn = shard_map(lambda sch, q, k, v, qp, kp: full_attention(impl, sch, q, k, v, qp, kp),
                           mesh=mesh2,
                           in_specs=(sspec, hspec, hspec, hspec, P("data"), P("data")),
                           out_specs=hspec, checks=impl != "pallas")
            got = jax.jit(fn)(scheme, q, k, v, pos, pos)
            res[f"heads_shard_map/{impl}/{s}"] = max_diff(got, want)
        # the same with jax.sharding alone: inputs sharded over heads, jit propagates
        for s in (["rope", "alibi", "t5"] if full else ["rope"]):
            scheme = make_scheme(s, N, H)
            f = jax.jit(functools.partial(full_attention, impl, scheme))
            want = f(q, k, v, pos, pos)
            p2 = lambda x, spec: jax.device_put(x, NamedSharding(mesh2, spec))
            got = f(p2(q, hspec), p2(k, hspec), p2(v, hspec), p2(pos, P("data")),
                    p2(pos, P("data")))
            res[f"heads_jit/{impl}/{s}"] = max_diff(got, want)

    res["cpu_seconds/3"] = time.process_time() - cpu0
    # 4. Sequence (context) parallel: each device holds T/8 queries and passes their GLOBAL
    #    positions; keys and values are complete (all-gathered) with their global positions.
    #    Causality, RoPE angles and relative biases then come out as in the unsharded call.
    mesh_s = Mesh(np.array(devices), ("seq",))
    Bs = 2
    qpos_g = jnp.arange(T, dtype=jnp.int32)
    for impl in impls:
        for s in (["nope", "rope", "alibi", "t5", "shaw"] if full else ["rope", "alibi", "t5"]):
            if not fits(impl, s, 3):
                continue
            scheme = make_scheme(s, N, H)
            want = jax.jit(functools.partial(full_attention, impl, scheme))(
                q[:Bs], k[:Bs], v[:Bs], qpos_g, qpos_g)

            def local(sch, q_blk, qp_blk, k_all, v_all, kp_all):
                return full_attention(impl, sch, q_blk, k_all, v_all, qp_blk, kp_all)

            fn = shard_map(local, mesh=mesh_s,
                           in_specs=(spec_tree(scheme, lambda f: P()), P(None, "seq"), P("seq"),
                                     P(), P(), P()),
                           out_specs=P(None, "seq"), checks=impl != "pallas")
            got = jax.jit(fn)(scheme, q[:Bs], qpos_g, k[:Bs], v[:Bs], qpos_g)
            res[f"seq_parallel/{impl}/{s}"] = max_diff(got, want)
            if full or s == "t5":
                # gradients: k, v and the scheme are replicated, so each shard's cotangent
                # is summed over "seq" (the reverse of the all-gather)
                w = jnp.asarray(np.random.default_rng(6).normal(size=want.shape), jnp.float32)
                sharded = lambda sch, q_, k_, v_: jnp.sum(fn(sch, q_, qpos_g, k_, v_, qpos_g) * w)
                plain = lambda sch, q_, k_, v_: jnp.sum(
                    full_attention(impl, sch, q_, k_, v_, qpos_g, qpos_g) * w)
                args = (scheme, q[:Bs], k[:Bs], v[:Bs])
                g_sh = jax.jit(jax.grad(sharded, argnums=(0, 1, 2, 3)))(*args)
                g_pl = jax.jit(jax.grad(plain, argnums=(0, 1, 2, 3)))(*args)
                res[f"seq_parallel_grad/{impl}/{s}"] = grad_diff(g_sh, g_pl)
            if s in (("rope", "alibi", "t5") if full else ("rope",)):
                # Negative control: a shard that lets q_positions default (arange aligned to
                # the end of the keys) gets the wrong answer for every shard but the last.
                def local_default(sch, q_blk, k_all, v_all):
                    return attention(q_blk, k_all, v_all, position=sch, causal=True,
                                     implementation=impl, block_q=4, block_k=4)

                bad = shard_map(local_default, mesh=mesh_s,
                                in_specs=(spec_tree(scheme, lambda f: P()), P(None, "seq"),
                                          P(), P()),
                                out_specs=P(None, "seq"), checks=impl != "pallas")
                res[f"seq_parallel_local_positions/{impl}/{s}"] = max_diff(
                    jax.jit(bad)(scheme, q[:Bs], k[:Bs], v[:Bs]), want)

    res["cpu_seconds/4"] = time.process_time() - cpu0
    # 5. One sharded training step of the small Flax model (batch over 8 devices).
    try:
        import optax
        from flax import nnx

        from jaxpos.nnx import DecoderLM
    except ImportError as e:  # the module is not there (yet)
        res["train_step/skipped"] = str(e)
    else:
        # default: the reference path (cheapest to compile; chunked and pallas are
        # covered by the attention checks above and by --full)
        for impl in (["reference", "chunked", "pallas"] if full else ["reference"]):
            res.update(train_step(nnx, optax, DecoderLM, mesh, impl,
                                  ["rope", "alibi", "t5"] if full else ["rope"]))

    res["cpu_seconds/5"] = time.process_time() - cpu0
    res["seconds"] = time.time() - t0
    with open(out_path, "w") as fh:
        json.dump(res, fh, indent=1, sort_keys=True)


def train_step(nnx, optax, DecoderLM, mesh, impl, positions):
    out = {}
    V, Bt, Tt = 32, 8, 9
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, V, size=(Bt, Tt)), jnp.int32)
    for position in positions:
        model = DecoderLM(V, d_model=16, num_layers=1, num_heads=2, position=position,
                          implementation=impl, rngs=nnx.Rngs(0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        tx = optax.sgd(0.5)

        def loss_fn(params, rest, tokens):
            m = nnx.merge(graphdef, params, rest)
            logits = m(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        @jax.jit
        def step(params, rest, opt_state, tokens):
            loss, grads = jax.value_and_grad(loss_fn)(params, rest, tokens)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        opt_state = tx.init(params)
        p1, _, loss1 = step(params, rest, opt_state, tokens)
        rep = NamedSharding(mesh, P())
        put_rep = lambda t: jax.device_put(t, rep)
        p_sh, r_sh, o_sh = (jax.tree_util.tree_map(put_rep, t) for t in (params, rest, opt_state))
        t_sh = jax.device_put(tokens, NamedSharding(mesh, P("data")))
        p2, _, loss2 = step(p_sh, r_sh, o_sh, t_sh)
        diffs = [max_diff(a, b) for a, b in zip(jax.tree_util.tree_leaves(p1),
                                                 jax.tree_util.tree_leaves(p2))]
        moved = [max_diff(a, b) for a, b in zip(jax.tree_util.tree_leaves(p1),
                                                 jax.tree_util.tree_leaves(params))]
        out[f"train_step/{impl}/{position}/loss_diff"] = abs(float(loss1) - float(loss2))
        out[f"train_step/{impl}/{position}/loss"] = float(loss2)
        out[f"train_step/{impl}/{position}/param_diff"] = max(diffs)
        out[f"train_step/{impl}/{position}/param_moved"] = max(moved)
        out[f"train_step/{impl}/{position}/num_devices"] = float(
            len(jax.tree_util.tree_leaves(p2)[0].sharding.device_set))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
