"""Per-shard attention under a mesh, run by tests/parallel/test_partition.py in a
subprocess with 8 CPU devices (``XLA_FLAGS`` must be set before ``import jax``).

Usage::

    python tests/parallel/_partition_worker.py [--full] OUT.json

Writes ``{check_name: value}``: for each (mesh, axis types, engine, scheme) the largest
difference of the sharded output and gradients from the single-device call, whether the
output kept q's batch and head sharding, and how many all-gathers of a rank-4 array (q, k,
v or their gradients) the compiled forward+backward holds; the error text of a
sequence-sharded call; the exported kernel's manual regions. The default runs one mesh
(data=2, model=4) with the chunked engine under Explicit axes and the Pallas forward
TPU export; both runs check RoPE built under an Explicit mesh outside ``jit`` (closed
over), with gradients, on (data=2, model=4) and on a one-device ``tensor`` axis;
``--full`` every engine on meshes (8,), (2, 4) and (2, 2, 2), Auto and Explicit, the schemes
ALiBi, T5 and RoPE taking turns. Both run the paged, decode,
export and DecoderLM checks of ``_partition_paged_checks.py`` (:func:`check_paged_and_decode`).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from _partition_paged_checks import gathers_of_rank4, kernels_inside_manual
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpos

B, T, N, NKV, H = 8, 32, 8, 4, 16
RNG = np.random.default_rng(0)
Q = RNG.normal(size=(B, T, N, H)).astype(np.float32)
K = RNG.normal(size=(B, T, NKV, H)).astype(np.float32)
V = RNG.normal(size=(B, T, NKV, H)).astype(np.float32)
TABLE = RNG.normal(size=(32, N)).astype(np.float32)
SINKS = RNG.normal(size=(N,)).astype(np.float32)
SEG = np.repeat(np.array([[0] * 20 + [1] * 12]), B, 0).astype(np.int32)


def _window(b, h, qp, kp):
    return kp > qp - 8


def _scheme(name, table):
    if name == "t5":
        return jaxpos.T5Bias(table, bidirectional=False)
    return {"alibi": jaxpos.ALiBi(N), "rope": jaxpos.RoPE(rotary_dim=H)}[name]


def _call(impl, scheme, built=None):
    """The attention call; ``built``: a scheme object built beforehand (closed over) in
    place of the one built from the traced table inside the call."""
    def f(q, k, v, table, sinks, seg):
        position = _scheme(scheme, table) if built is None else built
        return jaxpos.attention(q, k, v, position=position, causal=True,
                                sinks=sinks if impl != "xla" else None, segment_ids=seg,
                                mask_mod=_window if scheme == "rope" else None,
                                implementation=impl, block_q=16, block_k=16)
    return f


def _grad(f):
    return jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2, 3, 4))


_ONE_DEVICE: dict = {}


def check_engine(res, mesh_shape, names, batch_axes, head_axes, kind, impl, scheme,
                 grads=True, under_mesh=False):
    """``under_mesh``: the scheme is built once under ``jax.set_mesh``, outside ``jit``
    (as a training script builds it), so its arrays are concrete and committed to the
    mesh, and the call closes over them."""
    f = _call(impl, scheme)
    g = _grad(f)
    args = (Q, K, V, TABLE, SINKS, SEG)
    key = (impl, scheme, grads)
    if key not in _ONE_DEVICE:  # the single-device call, once per engine and scheme
        _ONE_DEVICE[key] = (np.asarray(jax.jit(f)(*args)),
                            [np.asarray(x) for x in jax.jit(g)(*args)] if grads else [])
    want, want_g = _ONE_DEVICE[key]
    mesh = jax.make_mesh(mesh_shape, names, axis_types=(getattr(AxisType, kind),) * len(names))
    b = batch_axes if len(batch_axes) != 1 else batch_axes[0]
    h = head_axes if len(head_axes) != 1 else (head_axes[0] if head_axes else None)
    spec = P(b or None, None, h, None)
    tag = f"{'x'.join(map(str, mesh_shape))}/{kind}/{impl}/{scheme}" + \
        ("/built_under_mesh" if under_mesh else "")
    with jax.set_mesh(mesh):
        if under_mesh:
            f = _call(impl, scheme, built=_scheme(scheme, TABLE))
            g = _grad(f)
        put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
        a = (put(Q, spec), put(K, spec), put(V, spec), put(TABLE, P()), put(SINKS, P()),
             put(SEG, P(b or None)))
        out = jax.jit(f)(*a)
        hlo = jax.jit(g if grads else f).lower(*a).compile().as_text()
        got_g = jax.jit(g)(*a) if grads else want_g
    res[f"out/{tag}"] = float(np.abs(np.asarray(out) - want).max())
    if grads:
        scale = max(1.0, max(float(np.abs(x).max()) for x in want_g))
        res[f"grad/{tag}"] = max(float(np.abs(np.asarray(x) - y).max()) for x, y in
                                 zip(got_g, want_g)) / scale
    res[f"kept/{tag}"] = out.sharding.is_equivalent_to(NamedSharding(mesh, spec), 4)
    res[f"gathers/{tag}"] = gathers_of_rank4(hlo)


def check_sequence_refused(res):
    mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        q = jax.device_put(Q, P("data", "seq"))
        try:
            jax.jit(lambda q: jaxpos.attention(q, q, q, causal=True))(q)
            res["seq_refused"] = ""
        except ValueError as e:
            res["seq_refused"] = str(e)


def check_export(res, kind, full):
    """The Pallas kernel exported for TPU and CUDA sits inside a manual region."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(getattr(AxisType, kind),) * 2)
    spec = P("data", None, "model", None)
    sds = lambda s: jax.ShapeDtypeStruct((4, 256, 8, 128), jnp.bfloat16,
                                         sharding=NamedSharding(mesh, s))

    def f(q, k, v):
        return jaxpos.attention(q, k, v, position=jaxpos.RoPE(rotary_dim=128), causal=True,
                                implementation="pallas")
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    with jax.set_mesh(mesh):
        for platform, marker in (("tpu", "tpu_custom_call"), ("cuda", "xla.gpu.triton"))[
                :None if full else 1]:
            grad = jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2))
            for what, fn in (("fwd", f), ("grad", grad)) if full else (("fwd", f),):
                text = jax.export.export(jax.jit(fn), platforms=[platform],
                                         disabled_checks=checks)(*(sds(spec),) * 3
                                                                 ).mlir_module()
                res[f"export/{kind}/{platform}/{what}"] = kernels_inside_manual(text, marker)


def check_context_parallel(res, methods):
    """A DecoderLM built with context_parallel= under a mesh with an Explicit ``seq``
    axis (``jax.make_mesh``'s default) equals the plain model."""
    from flax import nnx

    from jaxpos.nnx import DecoderLM

    tokens = jnp.asarray(RNG.integers(0, 50, size=(2, 32)), jnp.int32)
    plain = DecoderLM(50, d_model=32, num_layers=1, num_heads=8, position="alibi",
                      rngs=nnx.Rngs(0))(tokens)
    for method in methods:
        model = DecoderLM(50, d_model=32, num_layers=1, num_heads=8, position="alibi",
                          context_parallel=method, rngs=nnx.Rngs(0))
        with jax.set_mesh(jax.make_mesh((8,), ("seq",), axis_types=(AxisType.Explicit,))):
            out = nnx.jit(lambda m, t: m(t))(model, tokens)
        res[f"context_parallel/{method}"] = float(jnp.abs(out - plain).max())


def check_paged_and_decode(res, full):
    """Paged and decode calls, the kernel's per-head parameters and a Pallas DecoderLM
    under a mesh (``_partition_paged_checks.py``): the default run takes the chunked
    engine on Explicit axes (the pool's one key/value head per shard), the exports for
    TPU and CUDA and the DecoderLM's TPU export; ``--full`` adds the Pallas kernel
    (interpreted), Auto axes, meshes (8,) (one query head per shard) and (2, 2, 2), the
    exported gradients, and one training step."""
    import _partition_paged_checks as pc

    dm = ((2, 4), ("data", "model"), ("data",), ("model",))
    pc.check_paged(res, *dm, "Explicit", "chunked", nkv=2)
    pc.check_decode(res, *dm, "Explicit", "chunked")
    kinds = ("Explicit", "Auto") if full else ("Explicit",)
    pc.check_kernel_exports(res, kinds, ("tpu", "cuda"), grads=full)
    pc.check_decoder(res, ("Explicit",), train=full)
    if not full:
        return
    for kind in ("Explicit", "Auto"):
        for impl in ("chunked", "pallas"):
            pc.check_paged(res, *dm, kind, impl, nkv=4)
            pc.check_decode(res, *dm, kind, impl)
    pc.check_paged(res, (8,), ("model",), (), ("model",), "Explicit", "chunked", nkv=4)
    pc.check_paged(res, (2, 2, 2), ("data", "fsdp", "model"), ("data", "fsdp"), ("model",),
                   "Auto", "chunked", nkv=2)


def main(argv):
    full = "--full" in argv
    res = {"num_devices": jax.device_count()}
    if full:
        meshes = [((8,), ("data",), ("data",), ()),
                  ((2, 4), ("data", "model"), ("data",), ("model",)),
                  ((2, 2, 2), ("data", "fsdp", "model"), ("data", "fsdp"), ("model",))]
        engines, schemes = ("reference", "chunked", "xla", "pallas"), ("alibi", "t5", "rope")
    else:
        meshes = [((2, 4), ("data", "model"), ("data",), ("model",))]
        engines, schemes = ("chunked",), ("t5",)
    for m, (shape, names, bax, hax) in enumerate(meshes):
        for j, kind in enumerate(("Explicit", "Auto") if full else ("Explicit",)):
            for e, impl in enumerate(engines):
                # every engine on every mesh and axis type, the schemes taking turns: each
                # (engine, scheme) pair runs on two of the six (mesh, axis type) pairs (the
                # whole product, 66 compilations, took about 6 minutes of CI)
                scheme = schemes[(m + j + e) % len(schemes)]
                if impl == "xla" and scheme == "rope":
                    scheme = "alibi"  # the window mask_mod: covered by the other engines
                check_engine(res, shape, names, bax, hax, kind, impl, scheme, grads=full)
    # RoPE built under an Explicit mesh (inv_freq committed to it, closed over), with
    # gradients: on (data=2, model=4), and on a one-device axis that still types q's heads
    check_engine(res, (2, 4), ("data", "model"), ("data",), ("model",), "Explicit",
                 "chunked", "rope", grads=True, under_mesh=True)
    check_engine(res, (1,), ("tensor",), (), ("tensor",), "Explicit", "chunked", "rope",
                 grads=True, under_mesh=True)
    check_sequence_refused(res)
    check_context_parallel(res, ("ring", "ulysses") if full else ("ring",))
    for kind in ("Explicit", "Auto") if full else ("Explicit",):
        check_export(res, kind, full)
    check_paged_and_decode(res, full)
    with open(argv[-1], "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
