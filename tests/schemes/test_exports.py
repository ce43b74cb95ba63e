"""The public surface of the schemes room: every public function and class of a scheme
module is exported at the top level of ``jaxpos`` (and listed in ``jaxpos.__all__``), and
the re-exporting packages (``jaxpos.schemes.rope``, ``jaxpos.mods``) hand on the very
objects of their parts."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import jaxpos
import jaxpos.mods
import jaxpos.schemes
import jaxpos.schemes.rope

# The protocol module (registration decorators, the registries) is not a scheme module.
_NOT_SCHEME_MODULES = {"jaxpos.schemes.base"}


def _scheme_modules():
    for info in pkgutil.walk_packages(jaxpos.schemes.__path__, "jaxpos.schemes."):
        if info.name not in _NOT_SCHEME_MODULES:
            yield importlib.import_module(info.name)


def _public_callables(module):
    for name in getattr(module, "__all__", ()):
        obj = getattr(module, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            yield name, obj


@pytest.mark.parametrize("module", list(_scheme_modules()), ids=lambda m: m.__name__)
def test_every_public_function_of_a_scheme_module_is_a_top_level_name(module):
    for name, obj in _public_callables(module):
        assert getattr(jaxpos, name, None) is obj, f"jaxpos.{name} is not {module.__name__}.{name}"
        assert name in jaxpos.__all__, f"{name} missing from jaxpos.__all__"


def test_every_name_of_all_resolves():
    for name in jaxpos.__all__:
        assert hasattr(jaxpos, name), name


@pytest.mark.parametrize("package", [jaxpos.mods, jaxpos.schemes.rope],
                         ids=lambda p: p.__name__)
def test_a_package_face_re_exports_the_objects_of_its_parts(package):
    for name in package.__all__:
        obj = getattr(package, name)
        home = getattr(obj, "__module__", None)
        if home and home.startswith(package.__name__ + ".") and not inspect.ismodule(obj):
            assert getattr(importlib.import_module(home), name) is obj, name
