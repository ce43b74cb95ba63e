"""The documentation site's sources: docstrings that the API reference (mkdocstrings, Google
style) can parse. CI builds the whole site with ``mkdocs build --strict``; this test gives the
same docstring warnings in the default run, in about a second. Needs the ``docs`` extra
(griffe); skipped without it."""

from __future__ import annotations

import logging
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _objects(obj, seen):
    if obj.path in seen:
        return
    seen.add(obj.path)
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _objects(member, seen)


def test_every_docstring_parses_as_google_style(caplog):
    griffe = pytest.importorskip("griffe")
    loader = griffe.GriffeLoader(
        search_paths=[str(ROOT)], docstring_parser=griffe.Parser.google,
        # as mkdocs.yml: types come from signatures; "a, b: ..." documents two at once
        docstring_options={"warn_unknown_params": False, "warn_missing_types": False})
    packages = [loader.load("jaxpos"), loader.load("kernels")]  # kernels: jaxpos.kernels
    seen: set[str] = set()
    with caplog.at_level(logging.WARNING, logger="griffe"):
        count = 0
        for package in packages:
            for obj in _objects(package, seen):
                if obj.docstring is not None:
                    obj.docstring.parsed  # noqa: B018 (parsing logs the warnings)
                    count += 1
    assert count > 100, count
    problems = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not problems, ("docstrings the API reference cannot parse (indent an entry's "
                          "continuation lines):\n" + "\n".join(problems))
