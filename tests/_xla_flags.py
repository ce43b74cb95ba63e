"""The XLA flags the test suite compiles with.

The suite's programs are tiny: compiling them costs far more than running them. At XLA's
backend optimization level 1 (LLVM's ``-O1`` for the machine code) the suite spends
about half the CPU time, measured on its own files (tests/schemes/test_kerple.py: 46.6
CPU seconds at the default level, 21.0 at level 1, 18.9 at level 0). XLA's HLO passes
(fusion, layout) run as before, so the programs checked are the ones users compile; only
the machine code is less tuned. Not level 0: there XLA CPU compiled CoPE's dense
gradient (jaxpos/core/cope.py under ``jit``) to NaN where levels 1 and 2 and op-by-op
execution agree. ``JAXPOS_TESTS_OPTIMIZED=1`` runs the suite with XLA's default level.

tests/conftest.py sets them for the pytest processes; the tests that start a subprocess
(8 CPU devices, a benchmark, ``jax.distributed``) give it ``suite_xla_flags()``.
"""

from __future__ import annotations

import os

FAST_COMPILE = "--xla_backend_optimization_level=1"


def suite_xla_flags(base: str = "") -> str:
    """``base`` (other XLA flags, e.g. a device count) plus the suite's compile flags,
    unless ``JAXPOS_TESTS_OPTIMIZED`` is set."""
    if os.environ.get("JAXPOS_TESTS_OPTIMIZED"):
        return base.strip()
    return f"{base} {FAST_COMPILE}".strip()


def subprocess_env() -> dict[str, str]:
    """The environment for a CPU subprocess the suite starts (an 8-device worker, a
    benchmark, a ``jax.distributed`` process): this one's, with the suite's compile flags
    as its only XLA flags (the worker adds its own device count) and JAX on the CPU."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = suite_xla_flags()
    env["JAX_PLATFORMS"] = "cpu"
    return env
