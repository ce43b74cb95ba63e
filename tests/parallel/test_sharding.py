"""Sharding and context parallelism, on 8 CPU devices.

The checks run in a subprocess (``tests/parallel/_sharding_worker.py``), which sets
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before importing JAX; this
process keeps its single device. Every sharded result is compared with the same
computation unsharded:

* batch over 8 devices, with ``jax.sharding`` (``jit`` + ``NamedSharding``) and with
  ``shard_map``, forward and gradients;
* heads over a ``model`` axis (2 x 4 mesh, grouped-query heads kept together), per-head
  parameters (ALiBi slopes, T5 table columns) split with them;
* sequence (context) parallel: each device holds T/8 queries with their *global*
  positions and the full keys/values with theirs, for RoPE, ALiBi and T5; and a negative
  control showing that local default positions give a different (wrong) answer;
* one sharded SGD training step of ``jaxpos.nnx.DecoderLM`` (batch over 8 devices).

The default run covers the chunked implementation (the CPU default) on a subset
(about 30 s of CPU); ``-m slow`` runs every implementation, scheme and layout.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _xla_flags import subprocess_env

WORKER = Path(__file__).with_name("_sharding_worker.py")
TOL = 1e-5  # float32 forward; gradients: relative to max(1, max |gradient|) (see the worker)


def _run_worker(tmp_path_factory, *flags):
    out = tmp_path_factory.mktemp("sharding") / "result.json"
    env = subprocess_env()
    proc = subprocess.run([sys.executable, str(WORKER), *flags, str(out)], env=env,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        pytest.fail(f"sharding worker failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _run_worker(tmp_path_factory)


def _entries(res, prefix):
    found = {k: v for k, v in res.items() if k.startswith(prefix + "/")}
    assert found, f"no {prefix} checks ran: {sorted(res)}"
    return found


def test_eight_devices(results):
    assert results["num_devices"] == 8


@pytest.mark.parametrize("kind", ["batch_shard_map", "batch_shard_map_grad", "heads_shard_map",
                                  "heads_jit", "seq_parallel", "seq_parallel_grad"])
def test_sharded_equals_unsharded(results, kind):
    """heads_jit shards batch and heads on a 2 x 4 mesh, so it also covers batch sharding
    with jax.sharding; batch_jit on 8 devices runs with -m slow."""
    for name, diff in _entries(results, kind).items():
        if name.endswith("/sharded_out"):
            assert diff == 1.0, f"{name}: output not spread over 8 devices"
            continue
        assert diff <= TOL, f"{name}: max |sharded - unsharded| = {diff}"


def test_sequence_parallel_covers_rope_alibi_t5(results):
    done = {k.split("/")[-1] for k in _entries(results, "seq_parallel")}
    assert {"rope", "alibi", "t5"} <= done


def test_sequence_parallel_needs_global_positions(results):
    """Negative control: shards that let q_positions default to a local arange get a
    different answer, so the equality above is not vacuous."""
    for name, diff in _entries(results, "seq_parallel_local_positions").items():
        assert diff > 0.1, f"{name}: local positions gave the global answer ({diff})"


def test_sharded_training_step(results):
    if "train_step/skipped" in results:
        pytest.skip(f"jaxpos.nnx.DecoderLM unavailable: {results['train_step/skipped']}")
    entries = _entries(results, "train_step")
    runs = {k.rsplit("/", 1)[0] for k in entries}
    for run in runs:
        assert results[f"{run}/num_devices"] == 8.0
        assert results[f"{run}/loss_diff"] <= 1e-5, run
        assert 0.0 < results[f"{run}/loss"] < 10.0, run
        assert results[f"{run}/param_moved"] > 1e-3, run  # the step changed the parameters
        assert results[f"{run}/param_diff"] <= 1e-5, run  # ... as the unsharded step did


@pytest.mark.slow
def test_every_implementation_and_scheme_sharded(tmp_path_factory):
    res = _run_worker(tmp_path_factory, "--full")
    bad = {}
    for name, diff in res.items():
        if name.startswith(("batch_", "heads_", "seq_parallel/", "seq_parallel_grad/")):
            if name.endswith("/sharded_out"):
                ok = diff == 1.0
            else:
                ok = diff <= TOL
            if not ok:
                bad[name] = diff
        elif (name.startswith("seq_parallel_local_positions/") and diff <= 0.1
              or name.endswith(("/loss_diff", "/param_diff")) and diff > 1e-5):
            bad[name] = diff
    assert not bad, bad
    impls = {k.split("/")[1] for k in res if k.startswith("seq_parallel/")}
    assert {"reference", "chunked"} <= impls, impls
