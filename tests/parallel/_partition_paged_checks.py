"""Checks of the paged and decode calls, the kernel's per-head parameters and a Pallas
``DecoderLM`` under a mesh, run inside ``_partition_worker.py``'s 8-device subprocess
(imported after it set ``--xla_force_host_platform_device_count=8``).

Each ``check_*`` adds ``{name: value}`` entries to the worker's result dict:

* ``out/paged/...`` / ``out/decode/...``: the largest difference of a paged call
  (``k_pages``, ``v_pages``, ``page_table``, ``kv_lengths``; T5 with a traced table,
  sinks, causal, grouped-query heads) or a dense-cache decode step (``kv_lengths``, ALiBi,
  sinks) on the mesh from the same call on one device, with ``kept/`` (the output keeps
  q's batch and head sharding) and ``gathers/`` (all-gathers of a rank-4 array in the
  compiled module; the pool is sharded over its key/value heads, the page table and the
  lengths over the batch);
* ``export/...``: the Pallas kernel exported for TPU and CUDA with per-head parameters
  (ALiBi slopes, a T5 table, sinks), a paged call, and a ``DecoderLM`` training step,
  each as ``{"manual", "kernels", "inside"}`` (``inside``: every kernel custom call
  sits inside a ``sdy.manual_computation`` region of the module's text);
* ``step/...``: a ``DecoderLM`` with ``implementation="pallas"`` whose parameters
  :func:`jaxpos.sharding.place` put on the mesh: the loss, the gradients and the updated
  parameters of one SGD step compared with the step on one device (relative to
  ``max(1, max |x|)``).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpos

B, TQ, N, H, PAGE, PAGES_PER_ROW, POOL = 4, 2, 8, 16, 8, 4, 20
RNG = np.random.default_rng(1)
Q = RNG.normal(size=(B, TQ, N, H)).astype(np.float32)
TABLE = RNG.normal(size=(32, N)).astype(np.float32)
SINKS = RNG.normal(size=(N,)).astype(np.float32)
PAGE_TABLE = RNG.permutation(POOL)[:B * PAGES_PER_ROW].reshape(B, PAGES_PER_ROW).astype(np.int32)
LENGTHS = np.array([5, 32, 17, 1], np.int32)  # one full row, one of a single key
CHECKS = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
MARKERS = {"tpu": "tpu_custom_call", "cuda": "xla.gpu.triton"}


def _mesh(shape, names, kind):
    return jax.make_mesh(shape, names, axis_types=(getattr(AxisType, kind),) * len(names))


def gathers_of_rank4(hlo: str) -> int:
    """All-gathers whose result has four dimensions (q, k, v, pages or their cotangents)."""
    return sum(1 for line in hlo.splitlines()
               if re.search(r"= f\w+\[\d+,\d+,\d+,\d+\]\{[^}]*\} all-gather\(", line))


def kernels_inside_manual(text: str, marker: str) -> dict:
    """``{"manual", "kernels", "inside"}`` of an exported module's text: the number of
    ``sdy.manual_computation`` regions and of kernel custom calls, and whether every
    kernel call lies inside a region (by the indentation of the region's body)."""
    open_regions: list[int] = []
    kernels, inside = 0, True
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip())
        while open_regions and indent <= open_regions[-1] and line.lstrip().startswith("}"):
            open_regions.pop()
        if "sdy.manual_computation(" in line:
            open_regions.append(indent)
        if marker in line and "custom_call" in line:
            kernels += 1
            inside = inside and bool(open_regions)
    return {"manual": text.count("sdy.manual_computation("), "kernels": kernels,
            "inside": inside and kernels > 0}


def _entry(axes):
    return None if not axes else axes[0] if len(axes) == 1 else axes


_ONE_DEVICE: dict[str, np.ndarray] = {}  # the single-device outputs, by call


def _kv(nkv: int, rows: int):
    """Keys and values ``[rows, PAGE|32, nkv, H]``, the same for each ``(nkv, rows)``."""
    rng = np.random.default_rng(nkv * 1000 + rows)
    size = (rows, PAGE if rows == POOL else 32, nkv, H)
    return rng.normal(size=size).astype(np.float32), rng.normal(size=size).astype(np.float32)


def _compare(res, tag, key, f, args, mesh, specs, out_spec):
    """``f`` on one device (once per ``key``) and, jitted, on ``args`` placed by
    ``specs`` on ``mesh``."""
    if key not in _ONE_DEVICE:
        _ONE_DEVICE[key] = np.asarray(jax.jit(f)(*args))
    want = _ONE_DEVICE[key]
    with jax.set_mesh(mesh):
        placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
        compiled = jax.jit(f).lower(*placed).compile()
        out = compiled(*placed)
        hlo = compiled.as_text()
    res[f"out/{tag}"] = float(np.abs(np.asarray(out) - want).max())
    res[f"kept/{tag}"] = out.sharding.is_equivalent_to(NamedSharding(mesh, out_spec), 4)
    res[f"gathers/{tag}"] = gathers_of_rank4(hlo)


def check_paged(res, shape, names, batch_axes, head_axes, kind, impl, nkv):
    """A paged decode-shaped call (two queries per row) on the mesh equals one device."""
    k_pages, v_pages = _kv(nkv, POOL)

    def f(q, kp, vp, table, lengths, t5, sinks):
        return jaxpos.attention(q, kp, vp, page_table=table, kv_lengths=lengths,
                                position=jaxpos.T5Bias(t5, bidirectional=False),
                                sinks=sinks, causal=True, implementation=impl)

    b, h = _entry(batch_axes), _entry(head_axes)
    sizes = dict(zip(names, shape))
    kvh = h if nkv % int(np.prod([sizes[a] for a in head_axes])) == 0 else None
    specs = (P(b, None, h, None), P(None, None, kvh, None), P(None, None, kvh, None),
             P(b, None), P(b), P(), P())
    tag = f"paged/{'x'.join(map(str, shape))}/{kind}/{impl}/kv{nkv}"
    args = (Q, k_pages, v_pages, PAGE_TABLE, LENGTHS, TABLE, SINKS)
    _compare(res, tag, f"paged/{impl}/{nkv}", f, args, _mesh(shape, names, kind), specs,
             P(b, None, h, None))


def check_decode(res, shape, names, batch_axes, head_axes, kind, impl, nkv=4):
    """One decode step on a dense cache (``kv_lengths``, one query per row)."""
    cache_k, cache_v = _kv(nkv, B)

    def f(q, k, v, lengths, sinks):
        return jaxpos.attention(q, k, v, kv_lengths=lengths, position=jaxpos.ALiBi(N),
                                sinks=sinks, causal=True, implementation=impl)

    b, h = _entry(batch_axes), _entry(head_axes)
    specs = (P(b, None, h, None), P(b, None, h, None), P(b, None, h, None), P(b), P())
    tag = f"decode/{'x'.join(map(str, shape))}/{kind}/{impl}/kv{nkv}"
    _compare(res, tag, f"decode/{impl}/{nkv}", f, (Q[:, :1], cache_k, cache_v, LENGTHS, SINKS),
             _mesh(shape, names, kind), specs, P(b, None, h, None))


def check_kernel_exports(res, kinds, platforms, grads):
    """The kernel with per-head parameters (ALiBi slopes, a traced T5 table, traced sinks)
    and the paged kernel, exported on a (data=2, model=4) mesh with q/k/v [4, 256, 8, 64]
    sharded P("data", None, "model", None): each kernel inside a manual region; with
    ``grads`` the gradient of the dense call too (for TPU)."""
    spec = P("data", None, "model", None)

    def dense(q, k, v, t5, sinks):
        a = jaxpos.attention(q, k, v, position=jaxpos.ALiBi(8), causal=True,
                             implementation="pallas")
        b = jaxpos.attention(q, k, v, position=jaxpos.T5Bias(t5, bidirectional=False),
                             sinks=sinks, causal=True, implementation="pallas")
        return a + b

    def paged(q, kp, vp, table, lengths, t5):
        return jaxpos.attention(q, kp, vp, page_table=table, kv_lengths=lengths,
                                position=jaxpos.T5Bias(t5, bidirectional=False),
                                causal=True, implementation="pallas")

    for kind in kinds:
        mesh = _mesh((2, 4), ("data", "model"), kind)
        sds = lambda shape, s, dt=jnp.float32: jax.ShapeDtypeStruct(
            shape, dt, sharding=NamedSharding(mesh, s))
        qkv = sds((4, 256, 8, 64), spec)
        dense_args = (qkv, qkv, qkv, sds((32, 8), P()), sds((8,), P()))
        pool = sds((64, 16, 8, 64), P(None, None, "model", None))
        paged_args = (sds((4, 1, 8, 64), spec), pool, pool, sds((4, 16), P("data", None),
                      jnp.int32), sds((4,), P("data"), jnp.int32), sds((32, 8), P()))
        with jax.set_mesh(mesh):
            for platform in platforms:
                grad = jax.grad(lambda *a: jnp.sum(dense(*a)), argnums=(0, 1, 2, 3, 4))
                cases = [("dense", dense, dense_args), ("paged", paged, paged_args)]
                if grads and platform == "tpu":  # the worker's RoPE case exports for cuda
                    cases.append(("dense_grad", grad, dense_args))
                for what, fn, args in cases:
                    text = jax.export.export(jax.jit(fn), platforms=[platform],
                                             disabled_checks=CHECKS)(*args).mlir_module()
                    res[f"export/{kind}/{platform}/{what}"] = kernels_inside_manual(
                        text, MARKERS[platform])


def _decoder_step(abstract: bool):
    """A tiny Pallas ``DecoderLM`` (ALiBi, grouped-query heads), its state (shapes only
    with ``abstract``: no parameter is drawn) and an SGD step ``(state, tokens) ->
    (new_state, loss, grads)``."""
    import optax
    from flax import nnx

    from jaxpos.nnx import DecoderLM

    vocab = 64

    def build():
        return DecoderLM(vocab, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2,
                         position="alibi", implementation="pallas", rngs=nnx.Rngs(0))

    gdef, state = nnx.split(nnx.eval_shape(build) if abstract else build())
    opt = optax.sgd(0.1)

    def loss_fn(state, tokens):
        logits = nnx.merge(gdef, state)(tokens)
        return jnp.mean(jax.nn.logsumexp(logits, -1)
                        - jnp.sum(logits * jax.nn.one_hot(tokens, vocab), -1))

    def step(state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(state, tokens)
        updates, _ = opt.update(grads, opt.init(state), state)
        return optax.apply_updates(state, updates), loss, grads

    tokens = np.random.default_rng(2).integers(0, vocab, (4, 32)).astype(np.int32)
    return state, tokens, step


def check_decoder(res, kinds, train):
    """A Pallas ``DecoderLM`` placed by the default rules on a (data, fsdp, tensor) =
    (2, 2, 2) mesh: its training step exports for TPU with every kernel inside a manual
    region; with ``train``, one step equals the step on one device."""
    from jaxpos import sharding

    state, tokens, step = _decoder_step(abstract=not train)
    want = jax.jit(step)(state, tokens) if train else None
    for kind in kinds:
        mesh = _mesh((2, 2, 2), ("data", "fsdp", "tensor"), kind)
        with jax.set_mesh(mesh):
            batch = NamedSharding(mesh, P(("data", "fsdp")))
            abstract = jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                (state, tokens), (sharding.named_shardings(state, mesh), batch))
            text = jax.export.export(jax.jit(step), platforms=["tpu"])(*abstract).mlir_module()
            res[f"export/{kind}/tpu/decoder_step"] = kernels_inside_manual(text, MARKERS["tpu"])
            if train:
                placed = sharding.place(state, mesh)
                toks = jax.device_put(tokens, batch)
                got = jax.jit(step)(placed, toks)
                res[f"step/{kind}/loss"] = float(abs(got[1] - want[1]))
                for i, what in ((0, "params"), (2, "grads")):  # relative to max(1, |x|)
                    res[f"step/{kind}/{what}"] = max(
                        float(np.abs(np.asarray(a) - np.asarray(b)).max())
                        / max(1.0, float(np.abs(np.asarray(b)).max()))
                        for a, b in zip(jax.tree.leaves(got[i]), jax.tree.leaves(want[i])))
