"""The default run's one 8-device subprocess (``_ring_worker.py --quick``: Ulysses, USP and
the modules' context-parallel switch), shared by test_ulysses.py and
test_context_parallel_modules.py.

Under pytest-xdist the workers share it too: the first worker to ask runs it and leaves
its JSON in the run's common temporary folder (one file per run, named by xdist's
``testrun_uid``), the others wait on a lock and read that file."""

from __future__ import annotations

import fcntl
import json
import os

import pytest
from test_ring import _run_worker


@pytest.fixture(scope="session")
def cp_quick(tmp_path_factory):
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if uid is None:  # one process: nothing to share
        return _run_worker(tmp_path_factory, "--quick")
    shared = tmp_path_factory.getbasetemp().parent
    result = shared / f"cp_quick-{uid}.json"
    with open(shared / f"cp_quick-{uid}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.exists():
            result.write_text(json.dumps(_run_worker(tmp_path_factory, "--quick")))
        return json.loads(result.read_text())
