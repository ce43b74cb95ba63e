"""The modules' logical axes on 8 CPU devices: a ``DecoderLM`` (NNX and Linen) whose
parameters :func:`jaxpos.sharding.place` puts on a ``(2, 4)`` ``(data, tensor)`` or
``(2, 2, 2)`` ``(data, fsdp, tensor)`` mesh by the default rules, with Auto and Explicit
axes, gives the loss and gradients of one device (1e-5); its parameters keep the rules'
placement (``q_proj.kernel``: ``embed`` over ``fsdp``, ``heads`` over ``tensor``), and
so do their gradients under Explicit axes (under Auto axes the compiler chooses the
gradients' placement unless ``jit`` is given ``out_shardings``).

The checks run in a subprocess (``_logical_axes_worker.py``, which sets
``--xla_force_host_platform_device_count=8``); the default run covers two cases, ``-m
slow`` every scheme (RoPE, ALiBi, T5, FoX), twin, mesh and axis type.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _xla_flags import subprocess_env

WORKER = Path(__file__).with_name("_logical_axes_worker.py")
TOL = 1e-5


def _run(tmp_path, *flags):
    out = tmp_path / "axes.json"
    env = subprocess_env()
    proc = subprocess.run([sys.executable, str(WORKER), *flags, str(out)], env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


def _check(res, expected_cases):
    assert res.pop("num_devices") == 8.0
    cases = {k.rsplit("/", 1)[0] for k in res}
    assert len(cases) == expected_cases, sorted(cases)
    for case in cases:
        assert res[f"{case}/loss"] <= TOL, (case, res[f"{case}/loss"])
        assert res[f"{case}/grad"] <= TOL, (case, res[f"{case}/grad"])
        _, _, mesh, axes = case.split("/")
        want = "P('fsdp', 'tensor')" if mesh == "2x2x2" else "P(None, 'tensor')"
        placed, grad = res[f"{case}/spec"].split(" P")
        assert placed == want, (case, placed)
        if axes == "explicit":  # the gradient's type is the parameter's; under Auto axes
            assert "P" + grad == want, (case, grad)  # the compiler picks (jit out_shardings)


def test_decoder_placed_by_the_rules_trains_as_on_one_device(tmp_path):
    """NNX with RoPE on (2, 2, 2) Explicit axes, Linen with ALiBi on (2, 4) Auto axes."""
    _check(_run(tmp_path, "--quick"), 2)


@pytest.mark.slow  # 8 compilations on 8 CPU devices
def test_every_scheme_twin_and_mesh_trains_as_on_one_device(tmp_path):
    res = _run(tmp_path)
    cases = {k.rsplit("/", 1)[0] for k in res if k != "num_devices"}
    # every (twin, mesh, axis type) once, every scheme twice
    assert {c.split("/", 1)[1] for c in cases} == {
        f"{t}/{m}/{a}" for t in ("nnx", "linen") for m in ("2x4", "2x2x2")
        for a in ("auto", "explicit")}, sorted(cases)
    assert sorted(c.split("/")[0] for c in cases) == sorted(["rope", "alibi", "t5", "fox"] * 2)
    _check(res, 2 * 2 * 2)
