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
* JAX's caches (compiled executables, traces) are cleared after a test module when the
  process holds more than 2 GiB: clearing after every module halved the peak memory on
  six modules (2.9 -> 1.5 GB) for 16% more CPU time (recompiling what the next module
  shares).
* Hypothesis derandomized (a seed fixed per test) and without an example database,
  so every CI run draws the same examples and a red build is reproducible, never a
  dice roll. To explore new examples locally: ``HYPOTHESIS_PROFILE=explore pytest``.
"""

from __future__ import annotations

import os
import pathlib
import re

from _xla_flags import suite_xla_flags

# before JAX starts its CPU client (see tests/_xla_flags.py)
os.environ["XLA_FLAGS"] = suite_xla_flags(os.environ.get("XLA_FLAGS", ""))

import jax  # noqa: E402
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


#: Resident memory above which JAX's caches are cleared after a test module.
_CLEAR_ABOVE_BYTES = 2 * 1024**3


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # not Linux: clear after every module
        return _CLEAR_ABOVE_BYTES + 1


@pytest.fixture(autouse=True, scope="module")
def _clear_jax_caches_after_each_module():
    """JAX's caches are cleared after a test module once the process holds more than
    2 GiB: clearing after every module kept the peak near 1.5 GB but recompiled what the
    next module shares (16% more CPU on six modules), which pytest-xdist, dealing cases
    out one by one, made a switch between modules far more often."""
    yield
    if _resident_bytes() > _CLEAR_ABOVE_BYTES:
        jax.clear_caches()


@pytest.fixture
def rng() -> np.random.Generator:
    """A NumPy generator with a fixed seed, fresh for every test."""
    return np.random.default_rng(0)


_SLOW_CASES = pathlib.Path(__file__).with_name("slow_cases.txt")


_TESTS = pathlib.Path(__file__).parent
_SHARED_FIXTURE = re.compile(r"""scope\s*=\s*["'](module|package|session)["']""")
_CONTEXT_PARALLEL_CASE = re.compile(r"\[(ring|ulysses|usp)-")


def _groups() -> dict[str, str]:
    """``{test file: its xdist work unit}`` for the files whose cases share a costly
    fixture: a module- or session-scoped fixture of the file's own (an 8-device
    subprocess, a Hugging Face model), or the session's ``cp_quick`` subprocess
    (tests/parallel/conftest.py; the files that use it form one unit)."""
    groups = {}
    for path in sorted(_TESTS.rglob("test_*.py")):
        name = path.relative_to(_TESTS.parent).as_posix()
        text = path.read_text()
        if "cp_quick" in text:
            groups[name] = "cp_quick"
        elif _SHARED_FIXTURE.search(text):
            groups[name] = name
    return groups


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scheduler for ``--dist loadgroup``, with this suite's work units:
    a test file whose cases share a costly fixture (see ``_groups``) runs whole in one
    worker, so the fixture is built once and no worker waits on another's; the
    conformance matrix's context-parallel cases (one 8-device subprocess) form one unit;
    every other case is a unit of its own, dealt to whichever worker is free.

    (xdist 3.8 marks a group by appending ``@name`` to ``item._nodeid``, which pytest
    9.2's node ids no longer read, so ``xdist_group`` marks group nothing there; the
    units are therefore set here, from the node ids.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    groups = _groups()

    class _Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if path.endswith("conformance/test_conformance.py"):
                return path + ":context_parallel" if _CONTEXT_PARALLEL_CASE.search(nodeid) \
                    else nodeid
            return groups.get(path, nodeid)

    return _Units(config, log)


@pytest.hookimpl(tryfirst=True)  # before the -m 'not slow' deselection
def pytest_collection_modifyitems(config, items):
    """Marks the cases listed in ``tests/slow_cases.txt`` ``slow``."""
    if not _SLOW_CASES.is_file():
        return
    # "nodeid seconds" per line (a parametrised id may hold spaces)
    names = {line.rsplit(None, 1)[0] for line in _SLOW_CASES.read_text().splitlines()
             if line.strip() and not line.startswith("#")}
    for item in items:
        if item.nodeid in names:
            item.add_marker(pytest.mark.slow)
