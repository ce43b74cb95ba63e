"""``benchmarks/train_step.py``: a DecoderLM training step per position scheme, timed
side by side."""

from __future__ import annotations

import pytest
from _scripts import load_script


@pytest.mark.slow  # two DecoderLM gradient compilations
def test_train_step_benchmark_times_every_scheme_against_nope(tmp_path):
    """``--quick`` runs the schemes round-robin (NoPE first, as the baseline, whatever the
    order asked) and writes one row per scheme with its ratios to NoPE (NoPE's own
    exactly 1)."""
    mod = load_script("benchmarks/train_step.py", "train_step_benchmark")
    out = tmp_path / "train_step.md"
    rows = mod.main(["--quick", "--schemes", "rope", "nope", "--output", str(out)])
    assert [r["scheme"] for r in rows] == ["nope", "rope"]
    assert all(r["T"] == 64 and 0 < r["min"] <= r["median"] <= r["max"] for r in rows)
    nope = rows[0]
    assert nope["ratio"] == nope["min_ratio"] == nope["paired"] == 1.0
    table = [line for line in out.read_text().splitlines() if line.startswith("| 64 |")]
    assert [line.split("|")[2].strip() for line in table] == ["nope", "rope"]
    assert "load average before" in out.read_text()
