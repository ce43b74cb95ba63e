"""Every engine per (batch, head) shard under a mesh, on 8 CPU devices.

The checks run in a subprocess (``tests/parallel/_partition_worker.py``, which sets
``--xla_force_host_platform_device_count=8`` before importing JAX). Each sharded call of
``jaxpos.attention`` (T5 with a traced table, sinks, segment ids, grouped-query heads)
is compared with the same call on one device: the output (and with ``-m slow`` the
gradients of q, k, v, the table and the sinks) to 1e-5, the output's sharding equal to
q's batch and head sharding, and no all-gather of a rank-4 array (q, k, v or their
cotangents) in the compiled module. The default run covers the chunked engine under
Explicit axes (which failed in ``vmap`` before), RoPE built under an Explicit mesh outside
``jit`` with gradients, on (data=2, model=4) and on a one-device ``tensor`` axis, the
refusal of a sequence-sharded q and
the Pallas kernel exported for TPU inside a manual region, and a ``DecoderLM`` with
``context_parallel="ring"`` under a mesh with an Explicit ``seq`` axis; ``-m slow`` covers every
engine, ALiBi, T5 and RoPE with a window mask_mod, Auto and Explicit axes, meshes (8,),
(2, 4) and (2, 2, 2), gradients, and the CUDA export.

The same subprocess runs ``_partition_paged_checks.py``: paged calls (the pool sharded
over its key/value heads, the page table and ``kv_lengths`` over the batch) and
dense-cache decode steps against one device; the kernel with per-head parameters (ALiBi
slopes, a T5 table, sinks) and the paged kernel exported for TPU and CUDA, and a Pallas
``DecoderLM``'s training step (parameters placed by :mod:`jaxpos.sharding`'s rules)
exported for TPU, each kernel inside a ``sdy.manual_computation`` region; with ``-m
slow`` the Pallas kernel on paged and decode calls under both axis types and one
training step of that ``DecoderLM`` against one device.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _xla_flags import subprocess_env

WORKER = Path(__file__).with_name("_partition_worker.py")
TOL = 1e-5


def _run(tmp_path_factory, *flags):
    out = tmp_path_factory.mktemp("partition") / "result.json"
    env = subprocess_env()
    proc = subprocess.run([sys.executable, str(WORKER), *flags, str(out)], env=env,
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        pytest.fail(f"partition worker failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    return _run(tmp_path_factory)


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    return _run(tmp_path_factory, "--full")


def _check(res):
    assert res["num_devices"] == 8
    engines = [k for k in res if k.startswith("out/")]
    assert engines
    for name in engines:
        tag = name[len("out/"):]
        assert res[name] <= TOL, f"{tag}: max |sharded - one device| = {res[name]}"
        if f"grad/{tag}" in res:
            assert res[f"grad/{tag}"] <= TOL, f"{tag}: gradients differ by {res[f'grad/{tag}']}"
        assert res[f"kept/{tag}"] is True, f"{tag}: output lost q's batch/head sharding"
        assert res[f"gathers/{tag}"] == 0, f"{tag}: q, k or v all-gathered"
    assert "context_parallel" in res["seq_refused"], res["seq_refused"]
    cp = {k: v for k, v in res.items() if k.startswith("context_parallel/")}
    assert cp and all(v <= TOL for v in cp.values()), cp
    exports = [k for k in res if k.startswith("export/")]
    assert exports
    for name in exports:
        e = res[name]
        assert e["manual"] >= 1 and e["kernels"] >= 1 and e["inside"], (name, e)


def test_sharded_attention_equals_one_device_and_keeps_its_shards(quick):
    _check(quick)


def test_rope_built_under_an_explicit_mesh_equals_one_device_with_gradients(quick):
    """RoPE built under ``jax.set_mesh`` outside ``jit`` (its ``inv_freq`` a concrete array
    committed to the mesh, closed over by the call; shard_map refuses to close over it) and
    a one-device Explicit ``tensor`` axis that q's type still names (the chunked loop's
    carry lost that axis and its branches' types differed): output and gradients equal
    one device, q's sharding kept."""
    for tag in ("2x4/Explicit/chunked/rope/built_under_mesh",
                "1/Explicit/chunked/rope/built_under_mesh"):
        assert quick[f"out/{tag}"] <= TOL, (tag, quick[f"out/{tag}"])
        assert quick[f"grad/{tag}"] <= TOL, (tag, quick[f"grad/{tag}"])
        assert quick[f"kept/{tag}"] is True and quick[f"gathers/{tag}"] == 0, tag


def test_paged_and_decode_calls_run_per_shard(quick):
    """A paged call (the pool sharded over its key/value heads, here one per shard of
    two query heads; the page table and kv_lengths over the batch) and a dense-cache
    decode step on a (data=2, model=4) mesh with Explicit axes equal one device."""
    for tag in ("paged/2x4/Explicit/chunked/kv2", "decode/2x4/Explicit/chunked/kv4"):
        assert quick[f"out/{tag}"] <= TOL, (tag, quick[f"out/{tag}"])
        assert quick[f"kept/{tag}"] is True and quick[f"gathers/{tag}"] == 0, tag


def test_kernel_with_per_head_parameters_exports_per_shard(quick):
    """ALiBi slopes, a traced T5 table and sinks, the paged kernel, and a Pallas DecoderLM's
    training step with parameters placed by jaxpos.sharding's rules: exported for TPU
    (and the calls for CUDA), every kernel lies inside a manual region."""
    for name in ("tpu/dense", "cuda/dense", "tpu/paged", "cuda/paged", "tpu/decoder_step"):
        e = quick[f"export/Explicit/{name}"]
        assert e["kernels"] >= 1 and e["inside"], (name, e)


@pytest.mark.slow
def test_paged_decode_and_pallas_decoder_step_on_every_axis_type(full):
    """The Pallas kernel (interpreted) on paged and decode calls, Auto and Explicit axes,
    meshes (8,) and (2, 2, 2); the exports with gradients under both axis types; one SGD
    step of a Pallas DecoderLM placed by the rules equals the step on one device."""
    for kind in ("Explicit", "Auto"):
        for impl in ("chunked", "pallas"):
            for what in ("paged", "decode"):
                tag = f"{what}/2x4/{kind}/{impl}/kv4"
                assert full[f"out/{tag}"] <= TOL and full[f"kept/{tag}"], tag
        for name in ("tpu/dense_grad", "tpu/paged", "cuda/paged"):
            assert full[f"export/{kind}/{name}"]["inside"], (kind, name)
    assert full["out/paged/8/Explicit/chunked/kv4"] <= TOL  # one query head per shard
    assert full["out/paged/2x2x2/Auto/chunked/kv2"] <= TOL
    assert full["step/Explicit/loss"] <= TOL, full["step/Explicit/loss"]
    assert full["step/Explicit/grads"] <= TOL, full["step/Explicit/grads"]
    assert full["step/Explicit/params"] <= TOL, full["step/Explicit/params"]


@pytest.mark.slow
def test_every_engine_mesh_and_axis_type_with_gradients(full):
    _check(full)
    tags = {k.split("/", 1)[1] for k in full if k.startswith("out/")}
    runs = {}  # every engine on every mesh and axis type, each scheme on two of them
    for mesh in ("8", "2x4", "2x2x2"):
        for kind in ("Explicit", "Auto"):
            for impl in ("reference", "chunked", "xla", "pallas"):
                found = [t for t in tags if t.startswith(f"{mesh}/{kind}/{impl}/")
                         and not t.endswith("/built_under_mesh")]
                assert len(found) == 1, (mesh, kind, impl, found)
                runs.setdefault(impl, []).append(found[0].rsplit("/", 1)[1])
    for impl, schemes in runs.items():
        want = {"alibi", "t5"} if impl == "xla" else {"alibi", "t5", "rope"}
        assert set(schemes) == want, (impl, schemes)
    assert {k for k in full if k.startswith("grad/")}
