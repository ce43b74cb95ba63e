"""Import a script of the repository (``examples/*.py``, ``benchmarks/*.py``: scripts, not
a package) as a module, for the tests that call its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(path: str | Path, module_name: str) -> ModuleType:
    """The script at ``path`` (relative to the repository root, or absolute) imported as
    ``module_name``; registered in ``sys.modules`` first, so its dataclasses and pickling
    find it."""
    path = ROOT / path
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path} as a module")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = mod
    spec.loader.exec_module(mod)
    return mod
