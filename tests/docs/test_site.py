"""The documentation site: its sources and, in the slow run, the built pages.

CI builds the whole site with ``mkdocs build --strict``. The default run checks its
sources in about a second: every docstring parses as Google style with the options and
the griffe extension of mkdocs.yml (docs/hooks/griffe_jaxpos.py, which renders Sphinx
roles as cross-references), every public module has a place in the API reference, and the
navigation's titles say what their pages hold. The slow run builds the site and counts
what must never reach a reader: raw roles (``:func:``) and literal double backticks.
Needs the ``docs`` extra (griffe, mkdocs); skipped without it.
"""

from __future__ import annotations

import html
import importlib.util
import logging
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
ROLE_TEXT = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const|type):")


def _objects(obj, seen):
    if obj.path in seen:
        return
    seen.add(obj.path)
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _objects(member, seen)


def _mkdocs_config() -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def _python_options() -> dict:
    plugins = [p for p in _mkdocs_config()["plugins"] if isinstance(p, dict)]
    (mkdocstrings,) = [p["mkdocstrings"] for p in plugins if "mkdocstrings" in p]
    return mkdocstrings["handlers"]["python"]["options"]


def _extension_module():
    spec = importlib.util.spec_from_file_location("_griffe_jaxpos",
                                                  ROOT / "docs" / "hooks" / "griffe_jaxpos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def loaded(request):
    """jaxpos as the API reference loads it: mkdocs.yml's parser options and extension;
    the warnings griffe logged while loading and parsing every docstring."""
    griffe = pytest.importorskip("griffe")
    options = _python_options()
    extensions = [_extension_module().JaxposDocs()]
    assert any("griffe_jaxpos.py" in str(e) for e in options["extensions"])
    loader = griffe.GriffeLoader(
        search_paths=[str(ROOT)], docstring_parser=griffe.Parser.google,
        docstring_options=options["docstring_options"],
        extensions=griffe.load_extensions(*extensions))
    handler = _Records()
    logger = logging.getLogger("griffe")
    logger.addHandler(handler)
    try:
        package = loader.load("jaxpos")
        loader.resolve_aliases(implicit=False, external=False)
        docstrings = []
        for obj in _objects(package, set()):
            if obj.docstring is not None:
                obj.docstring.parsed  # noqa: B018 (parsing logs the warnings)
                docstrings.append((obj.path, obj.docstring.value))
    finally:
        logger.removeHandler(handler)
    return package, docstrings, handler.messages


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_every_docstring_parses_as_google_style(loaded):
    package, docstrings, problems = loaded
    assert "kernels" in package.members, "jaxpos.kernels (the kernels/ folder) was not grafted"
    assert any(path.startswith("jaxpos.kernels.dispatch.") for path, _ in docstrings)
    assert len(docstrings) > 100, len(docstrings)
    assert not problems, ("docstrings the API reference cannot parse (indent an entry's "
                          "continuation lines):\n" + "\n".join(problems))


def test_no_docstring_keeps_a_raw_role_for_the_site(loaded):
    _, docstrings, _ = loaded
    raw = [f"{path}: {found[0]}" for path, text in docstrings
           if (found := ROLE_TEXT.search(text))]
    assert not raw, "roles the extension left as text:\n" + "\n".join(raw)


def test_roles_become_optional_references_resolved_in_their_scope(tmp_path):
    """A role's target is resolved as Python resolves the name in the docstring's module
    (an import, a member, an absolute path through an alias to where it is defined);
    an unknown name becomes plain code. Exact HTML, since autorefs reads these tags."""
    griffe = pytest.importorskip("griffe")
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg.a import Cache\n")
    (pkg / "a.py").write_text('class Cache:\n    """A cache."""\n\n    def write(self):\n'
                              '        """Write."""\n\n\ndef f():\n    """F."""\n')
    (pkg / "b.py").write_text(
        '"""Uses :class:`Cache`, :meth:`Cache.write`, :func:`~pkg.a.f`, :class:`pkg.Cache`,\n'
        ':mod:`flax.nnx`, :func:`the writer <pkg.a.Cache.write>`.\n\nRule::\n\n    x = 1\n"""\n\n'
        'from pkg.a import Cache\n')
    loader = griffe.GriffeLoader(search_paths=[str(tmp_path)])
    b = loader.load("pkg")["b"]
    ext = _extension_module()
    got = ext.rewrite(b, loader.modules_collection, b.docstring.value)

    def ref(path, title):
        return f'<autoref identifier="{path}" optional><code>{title}</code></autoref>'

    assert got == (f"Uses {ref('pkg.a.Cache', 'Cache')}, "
                   f"{ref('pkg.a.Cache.write', 'Cache.write')}, {ref('pkg.a.f', 'f')}, "
                   f"{ref('pkg.a.Cache', 'pkg.Cache')},\n"
                   f"<code>flax.nnx</code>, {ref('pkg.a.Cache.write', 'the writer')}.\n\n"
                   "Rule:\n\n    x = 1")
    untyped = "Args:\n  x: one.\n\nRaises:\n  The errors of f.\n"
    typed = "Raises:\n  ValueError: bad x.\n  TypeError(x): worse.\n"
    assert ext.retitle_untyped_raises(untyped) == untyped.replace("Raises:", "Errors:")
    assert ext.retitle_untyped_raises(typed) == typed
    table = ("Modules:\n\n=====  ==========\nname   role\n=====  ==========\n"
             ":class:`A`  the a  \nb      ``b`` too\n=====  ==========\n\nAfter.")
    assert ext.simple_tables_to_markdown(table) == (
        "Modules:\n\n| name | role |\n| --- | --- |\n| :class:`A` | the a |\n"
        "| b | ``b`` too |\n\nAfter.")
    ragged = "=====  ===\na  b  c\n=====  ===\nd  e\n=====  ===\n"
    assert ext.simple_tables_to_markdown(ragged) == ragged


def _public_modules() -> list[str]:
    names = []
    for folder, prefix in (("jaxpos", "jaxpos"), ("kernels", "jaxpos.kernels")):
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            if any(part.startswith("_") for part in parts):
                continue  # private (jaxpos._checks, jaxpos.kernels._testing)
            names.append(".".join([prefix, *parts]))
    return names


def _api_directives() -> dict[str, str]:
    found = {}
    for page in sorted((ROOT / "docs" / "api").glob("*.md")):
        for match in re.finditer(r"^::: *(\S+)", page.read_text(), re.M):
            found[match[1]] = page.name
    return found


def test_every_public_module_has_a_section_in_the_api_reference():
    modules = _public_modules()
    directives = _api_directives()
    assert len(modules) > 80, len(modules)
    missing = [m for m in modules if m not in directives]
    assert not missing, ("modules with no '::: module' section in docs/api/*.md: "
                         + ", ".join(missing))
    bare = sorted(d for d in directives if d == "kernels" or d.startswith("kernels."))
    assert not bare, f"API pages document {bare}: users import them as jaxpos.kernels.*"


def test_every_public_subpackage_is_an_attribute_after_a_plain_import():
    """``import jaxpos`` then ``jaxpos.serving.ServingEngine`` (the docs' spelling) works for
    every subpackage and module, in a fresh interpreter (here the tests may have imported
    them already, which sets the attribute)."""
    names = sorted({m.split(".")[1] for m in _public_modules() if m.count(".") >= 1})
    code = ("import jaxpos\n"
            f"print([n for n in {names!r} if not hasattr(jaxpos, n)])\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", f"not reachable from a plain import jaxpos: {run.stdout}"
    assert {"serving", "hf", "layers", "kernels", "nnx"} <= set(names)


NUMBER_WORDS = {word: i for i, word in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty twenty-one twenty-two twenty-three "
    "twenty-four twenty-five".split())}


def _nav_titles(nav) -> dict[str, str]:
    titles = {}
    for entry in nav:
        for title, target in entry.items():
            if isinstance(target, list):
                titles.update(_nav_titles(target))
            else:
                titles[target] = title
    return titles


def test_the_study_says_in_the_navigation_how_many_rows_its_results_hold():
    import json

    titles = _nav_titles(_mkdocs_config()["nav"])
    heading = (ROOT / "docs" / "study.md").read_text().splitlines()[0].removeprefix("# ")
    assert titles["study.md"] == heading
    rows = json.loads((ROOT / "docs" / "study" / "results.json").read_text())["schemes"]
    said = re.match(r"The study: (\S+) rows", heading)
    assert said is not None, heading
    assert NUMBER_WORDS[said[1]] == len(rows), (heading, len(rows))


def test_readmes_list_the_serving_page_and_the_serving_and_generation_examples():
    readme = (ROOT / "README.md").read_text()
    examples = (ROOT / "examples" / "README.md").read_text()
    for name in ("docs/serving.md", "examples/serve.py", "examples/generate.py"):
        assert name in readme, name
    for name in ("serve.py", "generate.py", "../docs/serving.md"):
        assert f"`{name}`" in examples or f"({name})" in examples, name
    assert "serving.md" in (ROOT / "docs" / "index.md").read_text()


# -- the built site (slow: a build takes 10 to 40 s) ------------------------------------

def _page_text(page_html: str) -> str:
    text = re.sub(r"<script.*?</script>", "", page_html, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", "", text))


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert build.returncode == 0, build.stderr[-4000:]
    return {str(p.relative_to(out)): p.read_text() for p in sorted(out.rglob("*.html"))}


@pytest.mark.slow
def test_built_pages_show_no_raw_role_and_no_literal_double_backticks(site):
    roles, ticks = {}, {}
    for name, page in site.items():
        text = _page_text(page)
        if n := len(ROLE_TEXT.findall(text)):
            roles[name] = n
        if n := text.count("``"):
            ticks[name] = n
    assert len(site) > 20
    assert not roles, f"raw Sphinx roles per page: {roles}"
    leaked = [name for name, page in site.items() if "autoref" in _page_text(page)]
    assert not leaked, f"cross-reference tags shown as text (a role in a code block?): {leaked}"
    assert not ticks, f"literal double backticks per page: {ticks}"


@pytest.mark.slow
def test_built_references_link_every_documented_target(site):
    """A reference left unresolved (autorefs writes ``<span title="target">``) names an
    object the site does not document; the kernel's objects are under jaxpos.kernels."""
    ids = set()
    for page in site.values():
        ids.update(re.findall(r'id="([^"]+)"', page))
    unresolved = set()
    for page in site.values():
        unresolved.update(re.findall(r'<span title="([^"]+)"><code>', page))
    documented = sorted(t for t in unresolved if t in ids)
    assert not documented, f"references to documented objects left as code: {documented}"
    assert "jaxpos.kernels.dispatch.attention_via_kernel" in ids
    assert not [i for i in ids if i.startswith("kernels.")]
    linked = sum(page.count('class="autorefs autorefs-internal"') for page in site.values())
    assert linked > 500, linked


@pytest.mark.slow
def test_readme_states_the_number_of_cases_the_default_run_collects():
    readme = (ROOT / "README.md").read_text()
    stated = re.search(r"<!-- suite-time -->.*?its (\d[\d,]*) cases", readme, re.S)
    assert stated is not None, "README: the sentence after <!-- suite-time --> moved"
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0",
                          "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    collected = re.search(r"^(\d+)(?:/\d+)? tests? collected", run.stdout, re.M)
    assert collected is not None, run.stdout[-2000:] + run.stderr[-2000:]
    assert int(stated[1].replace(",", "")) == int(collected[1])
