"""Every implementation of :func:`jaxpos.attention` against one float64 reference of the
documented contract (``docs/attention.md``; ``_contract_reference.py``), forward and
gradients, on the same cases: implementation x call shape x scheme.

The axes are the module-level tables of ``_conformance_cases.py`` (``IMPLEMENTATIONS``,
``CALL_SHAPES``, ``SCHEMES``): a new path, call shape or scheme joins by adding one entry.
The 8-device ring runs in one subprocess (``_ring_conformance_worker.py``) whose results
every ring case reads; it, the module's cached decode and most Pallas-interpreter cases
are ``slow``. The call forms that wrap an engine (unfilled cache slots, pages) and the
context-parallel methods deal their cases out among themselves (``COVERING``).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path as _FsPath

import numpy as np
import pytest
from _conformance_cases import (
    IMPLEMENTATIONS,
    all_cases,
    cached_reference,
    covered_elsewhere,
    empty_rows,
    run_attention,
    tolerance,
)
from _xla_flags import suite_xla_flags

CASES = dict(all_cases())
#: The context-parallel paths, run by the 8-device worker.
CONTEXT_PARALLEL = ("ring", "ulysses", "usp")


def _params():
    out = []
    for impl, path in IMPLEMENTATIONS.items():
        for cid, case in CASES.items():
            if path.takes is not None and not path.takes(case):
                continue
            if not path.default(cid) and covered_elsewhere(impl, cid):
                continue
            marks = [] if path.default(cid) else [pytest.mark.slow]
            out.append(pytest.param(impl, cid, marks=marks, id=f"{impl}-{cid}"))
    return out


def check_against_contract(cid, out, grads, kv_dtype=None):
    """Forward and every gradient within the dtype's tolerance of the float64 contract;
    rows with no visible key exactly 0 with exactly 0 gradient; the NaN rule. ``kv_dtype``
    (quantised pages): the contract on the keys and values the pages hold (dequantised
    in float64), so the tolerance stays the case dtype's."""
    case = CASES[cid]
    ref, ref_grads = cached_reference(cid, kv_dtype)
    tol = tolerance(case)
    empty = empty_rows(case)  # [B, Tq, N]
    if case.nan_value_at is not None:
        # NaN rule: every query that sees the NaN value row with nonzero weight is
        # non-finite (ref marks them); rows that do not see it are not constrained.
        sees = ~np.isfinite(ref[..., 0, :]).all(-1)  # head 0 holds the NaN
        assert sees.any()
        assert not np.isfinite(out[..., 0, :][sees]).all(-1).any()
        return
    assert np.isfinite(out).all(), "finite inputs gave a non-finite output"
    np.testing.assert_array_equal(out[empty], 0.0, err_msg="row with no visible key")
    scale = max(1.0, float(np.max(np.abs(ref))))
    np.testing.assert_allclose(out, ref, rtol=0, atol=tol * scale, err_msg="forward")
    if grads is None:
        return
    assert set(grads) == set(ref_grads), (sorted(grads), sorted(ref_grads))
    np.testing.assert_array_equal(grads["q"][empty], 0.0, err_msg="dq of an empty row")
    for name, g in grads.items():
        r = ref_grads[name]
        assert np.isfinite(g).all(), f"d{name} is not finite"
        gscale = max(1.0, float(np.max(np.abs(r))))
        if name == "scheme.inv_freq":
            # d/d inv_freq sums terms of size |position| that cancel to the relative
            # offsets: float32 holds each to eps32 * |position| (0.06 at 1e6)
            gscale *= max(1.0, _max_position(case) * 1.2e-7 / tol)
        np.testing.assert_allclose(g, r, rtol=0, atol=tol * gscale * 4, err_msg=f"d{name}")


def _max_position(case):
    pos = [np.abs(case.np_(n)).max() for n in ("q_positions", "kv_positions")
           if case.np_(n) is not None]
    return float(max(pos, default=max(case.Tq, case.Tk)))


@pytest.mark.parametrize("impl,cid", _params())
def test_implementation_follows_the_contract(impl, cid):
    path = IMPLEMENTATIONS[impl]
    if impl in CONTEXT_PARALLEL:
        res = _ring_results()[impl][cid]
        out = np.asarray(res["out"])
        grads = None if res["grads"] is None else {n: np.asarray(g)
                                                  for n, g in res["grads"].items()}
    elif path.run is not None:
        out, grads = path.run(CASES[cid])
    else:
        out, grads = run_attention(CASES[cid], path.attend, jit=path.jit)
    check_against_contract(cid, out, grads, path.kv_dtype)


WORKER = _FsPath(__file__).with_name("_ring_conformance_worker.py")


@functools.lru_cache(maxsize=1)
def _ring_results():
    """Run every ring, Ulysses and USP case in one 8-device subprocess;
    ``{path: {case_id: {"out", "grads"}}}``."""
    env = dict(os.environ, XLA_FLAGS=suite_xla_flags("--xla_force_host_platform_device_count=8"),
               JAX_PLATFORMS="cpu")
    tests_dir = str(WORKER.parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([str(WORKER.parent), tests_dir,
                                         env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "ring.json")
        proc = subprocess.run([sys.executable, str(WORKER), out], env=env, check=False,
                              capture_output=True, text=True, timeout=1200)
        if proc.returncode != 0:
            pytest.fail(f"ring worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)
