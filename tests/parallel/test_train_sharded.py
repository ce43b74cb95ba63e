"""examples/train_sharded.py: a jitted optax step of ``jaxpos.nnx.DecoderLM`` with its
parameters placed by the logical-axis rules on a ``(data, fsdp, tensor)`` mesh of 8 CPU
devices (and with ``context_parallel`` on a ``seq`` axis) gives the loss, every gradient
and the losses of the following steps of the same step on one device (1e-5).

The default run covers RoPE on ``(2, 2, 2)`` Explicit axes; ``-m slow`` ALiBi, T5 and
FoX (one process), Ulysses context parallelism on ``(fsdp=2, seq=4)`` Explicit axes and
ring on ``(data=2, seq=4)`` Auto axes, and the same step as 2 processes x 4 CPU devices
under ``jax.distributed`` with a local coordinator.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from _xla_flags import subprocess_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_sharded.py"
TOL = 1e-5
TINY = ["--d-model", "32", "--layers", "1", "--heads", "4", "--kv-heads", "2",
        "--batch-size", "4", "--seq-len", "16", "--vocab-size", "64", "--check"]



def _check(res, *, steps):
    """A run's JSON: the sharded step equals the single-device one."""
    assert res["device_count"] == 8
    assert res["ok"] is True
    assert res["loss_diff"] <= TOL and res["steps_loss_diff"] <= TOL, res
    assert res["grad_diff"] <= TOL, res["grad_diffs"]
    assert len(res["losses"]) == len(res["ref_losses"]) == steps
    assert 1.0 < res["losses"][0] < 10.0  # a cross-entropy over 64 tokens, not a zero
    # every parameter's gradient was compared: embedding, final norm, and per layer the
    # two norms, q/k/v/o and the MLP's two kernels (plus a scheme's own parameters)
    assert len(res["grad_diffs"]) >= 10, sorted(res["grad_diffs"])


def test_rope_step_on_a_data_fsdp_tensor_mesh_equals_one_device(tmp_path):
    out = tmp_path / "rope.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--scheme", "rope", "--steps", "1",
                           *TINY, "--json", str(out)], env=subprocess_env(), capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    _check(res, steps=1)
    assert len(res["grad_diffs"]) == 10
    # placed by the rules: q_proj.kernel [embed, heads] over (fsdp, tensor); the batch
    # over (data, fsdp)
    assert res["q_proj_spec"] == "P('fsdp', 'tensor')"
    assert res["tokens_spec"] == "P(('data', 'fsdp'), None)"
    assert "OK (tolerance 1e-05)" in proc.stdout


_DRIVER = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 8)
sys.path.insert(0, {examples!r})
import train_sharded
runs = json.loads(sys.argv[1])
for name, argv in runs.items():
    code = train_sharded.main(argv + ["--cpu-devices", "0", "--json", name])
    assert code == 0, (name, code)
"""


@pytest.mark.slow  # 5 runs (2 compilations each) on 8 CPU devices in one process
def test_alibi_t5_fox_and_context_parallel_steps_equal_one_device(tmp_path):
    runs = {str(tmp_path / f"{s}.json"): ["--scheme", s, "--steps", "2", *TINY]
            for s in ("alibi", "t5", "fox")}
    cp = {"ulysses": ["--scheme", "fox", "--context-parallel", "ulysses", "--mesh",
                      "fsdp=2,seq=4"],
          "ring": ["--scheme", "t5", "--context-parallel", "ring", "--mesh", "data=2,seq=4",
                   "--axis-types", "auto"]}
    for name, argv in cp.items():
        runs[str(tmp_path / f"cp_{name}.json")] = [*argv, "--steps", "2", *TINY]
    code = _DRIVER.format(examples=str(ROOT / "examples"))
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(runs)], env=subprocess_env(),
                          capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for path in runs:
        res = json.loads(Path(path).read_text())
        _check(res, steps=2)
    assert json.loads((tmp_path / "cp_ulysses.json").read_text())["tokens_spec"] == \
        "P('fsdp', 'seq')"
    assert json.loads((tmp_path / "cp_ring.json").read_text())["tokens_spec"] == \
        "P('data', 'seq')"


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two processes of 4 CPU devices each (gloo collectives)
def test_two_processes_under_jax_distributed_give_the_single_device_loss(tmp_path):
    port = _free_port()
    base = [sys.executable, str(SCRIPT), "--scheme", "alibi", "--steps", "2", *TINY,
            "--cpu-devices", "4", "--num-processes", "2", "--coordinator",
            f"localhost:{port}"]
    procs = [subprocess.Popen([*base, "--process-id", str(i), "--json",
                               str(tmp_path / f"p{i}.json")], env=subprocess_env(), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=1200) for p in procs]
    for p, (stdout, stderr) in zip(procs, outs):
        assert p.returncode == 0, stdout[-2000:] + stderr[-4000:]
    results = [json.loads((tmp_path / f"p{i}.json").read_text()) for i in range(2)]
    for i, res in enumerate(results):
        assert res["process_index"] == i and res["process_count"] == 2
        _check(res, steps=2)
    assert results[0]["losses"] == results[1]["losses"]  # one global loss
    assert "OK (tolerance 1e-05)" in outs[0][0]
