"""The default run's one 8-device subprocess (``_ring_worker.py --quick``: Ulysses, USP and
the modules' context-parallel switch), shared by test_ulysses.py and
test_context_parallel_modules.py."""

from __future__ import annotations

import pytest
from test_ring import _run_worker


@pytest.fixture(scope="session")
def cp_quick(tmp_path_factory):
    return _run_worker(tmp_path_factory, "--quick")
