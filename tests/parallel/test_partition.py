"""Every engine per (batch, head) shard under a mesh, on 8 CPU devices.

The checks run in a subprocess (``tests/parallel/_partition_worker.py``, which sets
``--xla_force_host_platform_device_count=8`` before importing JAX). Each sharded call of
``jaxpos.attention`` (T5 with a traced table, sinks, segment ids, grouped-query heads)
is compared with the same call on one device: the output (and with ``-m slow`` the
gradients of q, k, v, the table and the sinks) to 1e-5, the output's sharding equal to
q's batch and head sharding, and no all-gather of a rank-4 array (q, k, v or their
cotangents) in the compiled module. The default run covers the chunked engine under
Explicit axes (which failed in ``vmap`` before), the refusal of a sequence-sharded q and
the Pallas kernel exported for TPU inside a manual region, and a ``DecoderLM`` with
``context_parallel="ring"`` under a mesh with an Explicit ``seq`` axis; ``-m slow`` covers every
engine, ALiBi, T5 and RoPE with a window mask_mod, Auto and Explicit axes, meshes (8,),
(2, 4) and (2, 2, 2), gradients, and the CUDA export.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("_partition_worker.py")
TOL = 1e-5


def _run(tmp_path_factory, *flags):
    out = tmp_path_factory.mktemp("partition") / "result.json"
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"
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
        assert e["manual"] >= 1 and e["kernels"] >= 1 and e["kernel_after_manual"], (name, e)


def test_sharded_attention_equals_one_device_and_keeps_its_shards(quick):
    _check(quick)


@pytest.mark.slow
def test_every_engine_mesh_and_axis_type_with_gradients(full):
    _check(full)
    tags = {k.split("/", 1)[1] for k in full if k.startswith("out/")}
    for mesh in ("8", "2x4", "2x2x2"):
        for kind in ("Explicit", "Auto"):
            for impl in ("reference", "chunked", "xla", "pallas"):
                assert f"{mesh}/{kind}/{impl}/t5" in tags
    assert {k for k in full if k.startswith("grad/")}
