"""``benchmarks/sharded.py`` (tensor parallelism on 8 CPU devices, in a subprocess that
sets ``XLA_FLAGS`` before JAX starts): its table and what it reads from the compiled
programs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from _xla_flags import subprocess_env


@pytest.mark.slow  # four compilations on 8 CPU devices
def test_sharded_benchmark_reads_memory_and_collectives_per_device(tmp_path):
    """``--quick`` on P = 1, 2: the head-sharded attention call's temporaries halve (temp x
    P within the benchmark's goal of 1.15) with nothing but the loss's scalar crossing
    devices, and the layer's all-reduced bytes read from the HLO equal its formula: four
    all-reduces of the [4, 128, 128] float32 activations, each sending 2 (P - 1) / P of
    0.25 MiB, 1.000 MiB at P = 2."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "sharded.py"
    out = tmp_path / "sharded.md"
    env = subprocess_env()
    proc = subprocess.run([sys.executable, str(path), "--quick", "--tensor", "1", "2",
                           "--programs", "attention", "layer", "--output", str(out)],
                          check=False, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {(r[0], int(r[1])): r for r in
            ([c.strip() for c in line.split("|")[1:-1]] for line in out.read_text().splitlines()
             if line.startswith("| attention |") or line.startswith("| layer |"))}
    assert set(rows) == {("attention", 1), ("attention", 2), ("layer", 1), ("layer", 2)}
    temp_x_p = float(rows[("attention", 2)][3])
    assert 0.95 <= temp_x_p <= 1.15, rows[("attention", 2)]
    assert float(rows[("attention", 2)][6]) < 0.001  # MiB: the loss's scalar only
    layer = rows[("layer", 2)]
    assert float(layer[6]) == pytest.approx(1.0, abs=1e-3)  # HLO, MiB
    assert float(layer[8]) == pytest.approx(1.0, abs=1e-3)  # the "as built" formula
    assert float(layer[7]) == pytest.approx(0.5, abs=1e-3)  # Megatron's two all-reduces
    assert layer[10] == "all-reduce 1.000"
