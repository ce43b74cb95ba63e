"""The XLA flags the test suite compiles with.

The suite's programs are tiny: compiling them costs far more than running them. At XLA's
lowest backend optimization level (LLVM's ``-O0``, its expensive passes off) the suite
spends about half the CPU time, measured on its own files (e.g. tests/schemes/test_kerple.py:
46 -> 21 CPU seconds; the serving loop's tests 43 -> 31). XLA's HLO passes (fusion, layout)
run as before, so the programs checked are the ones users compile; only the machine code
is less tuned. ``JAXPOS_TESTS_OPTIMIZED=1`` runs the suite with XLA's default optimization.

tests/conftest.py sets them for the pytest processes; the tests that start a subprocess
(8 CPU devices, a benchmark, ``jax.distributed``) give it ``suite_xla_flags()``.
"""

from __future__ import annotations

import os

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def suite_xla_flags(base: str = "") -> str:
    """``base`` (other XLA flags, e.g. a device count) plus the suite's compile flags,
    unless ``JAXPOS_TESTS_OPTIMIZED`` is set."""
    if os.environ.get("JAXPOS_TESTS_OPTIMIZED"):
        return base.strip()
    return f"{base} {FAST_COMPILE}".strip()
