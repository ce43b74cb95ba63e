"""Shared pytest configuration for the jaxpos test suite.

* Float32 matrix products at full precision: on GPU/TPU the default may use
  TF32/bfloat16 passes, which would make comparisons with float64 NumPy references
  depend on the backend. On CPU this changes nothing.
* Hypothesis without a per-example deadline: the first example of a test pays
  JAX's compilation time, which is not a property of the code under test.
* The default run's time budget: the test cases listed in ``tests/slow_cases.txt`` (the
  slowest of a measured run, see that file) get the ``slow`` marker, so ``pytest`` skips
  them and ``pytest -m slow`` runs them; one fast case of each parametrised test stays in
  the default run.
* JAX's caches (compiled executables, traces) are cleared after each test module: on
  a subset of six modules this halved the peak memory (2.9 -> 1.5 GB) for 16% more CPU
  time (recompiling what the next module shares).
* Hypothesis derandomized (a seed fixed per test) and without an example database,
  so every CI run draws the same examples and a red build is reproducible, never a
  dice roll. To explore new examples locally: ``HYPOTHESIS_PROFILE=explore pytest``.
"""

from __future__ import annotations

import os
import pathlib

import jax
import numpy as np
import pytest

jax.config.update("jax_default_matmul_precision", "highest")

try:
    from hypothesis import settings

    settings.register_profile("jaxpos", deadline=None, print_blob=True, derandomize=True,
                              database=None)
    settings.register_profile("explore", deadline=None, print_blob=True)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "jaxpos"))
except ImportError:  # hypothesis is a test extra; tests that need it import it themselves
    pass


@pytest.fixture(autouse=True, scope="module")
def _clear_jax_caches_after_each_module():
    yield
    jax.clear_caches()


@pytest.fixture
def rng() -> np.random.Generator:
    """A NumPy generator with a fixed seed, fresh for every test."""
    return np.random.default_rng(0)


_SLOW_CASES = pathlib.Path(__file__).with_name("slow_cases.txt")


@pytest.hookimpl(tryfirst=True)  # before the -m 'not slow' deselection
def pytest_collection_modifyitems(config, items):
    """Marks the cases listed in ``tests/slow_cases.txt`` ``slow``, and groups the cases
    for pytest-xdist's ``--dist loadgroup``: each test file's cases run in one worker (a
    module's fixtures, such as an 8-device subprocess, run once), except the conformance
    matrix, whose single-device cases (about 550 of the slow run's 1550) are dealt out
    to the workers one by one; its context-parallel cases share one 8-device subprocess and stay
    together."""
    for item in items:
        group = item.nodeid.split("::", 1)[0]
        if group.endswith("conformance/test_conformance.py"):
            callspec = getattr(item, "callspec", None)
            if callspec is None or callspec.params.get("impl") not in ("ring", "ulysses",
                                                                         "usp"):
                continue
        item.add_marker(pytest.mark.xdist_group(group))
    if not _SLOW_CASES.is_file():
        return
    # "nodeid seconds" per line (a parametrised id may hold spaces)
    names = {line.rsplit(None, 1)[0] for line in _SLOW_CASES.read_text().splitlines()
             if line.strip() and not line.startswith("#")}
    for item in items:
        if item.nodeid in names:
            item.add_marker(pytest.mark.slow)
