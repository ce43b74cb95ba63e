"""The layout docs/architecture.md describes, checked on the source files themselves.

* The attention core never imports the kernel package: ``jaxpos.kernels`` depends on
  ``jaxpos.core`` (it registers its engine there), so an import of the kernel from the
  core, even one deferred into a function, would close a circle that static tools miss.
* No source file of ``jaxpos/`` or ``kernels/`` is longer than 600 lines.
* docs/architecture.md names only files, folders and names that exist, and says each
  thing once.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 600


def _imported_modules(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in the file: top-level, inside functions and
    classes, under ``if TYPE_CHECKING``, and string arguments of ``import_module`` /
    ``__import__`` calls; relative imports resolved against the file's package."""
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            found += [(node.lineno, base)] + [(node.lineno, f"{base}.{a.name}")
                                              for a in node.names]
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in ("import_module", "__import__") and node.args and \
                    isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def test_import_scanner_sees_deferred_and_relative_imports(tmp_path):
    """The scanner itself: a deferred import, a relative one and an import_module string
    are all found (so the direction test below cannot pass by not looking)."""
    pkg = tmp_path / "jaxpos" / "core"
    pkg.mkdir(parents=True)
    f = pkg / "sample.py"
    f.write_text("import os\n"
                 "def late():\n"
                 "    from jaxpos.kernels.paged import paged_attention_kernel\n"
                 "    from ..kernels import dispatch\n"
                 "    importlib.import_module('jaxpos.kernels.dispatch')\n")
    mods = [m for _, m in _imported_modules(f, tmp_path)]
    assert "os" in mods
    assert "jaxpos.kernels.paged.paged_attention_kernel" in mods
    assert "jaxpos.kernels.dispatch" in mods
    assert mods.count("jaxpos.kernels.dispatch") == 2  # the relative import and the string


def test_core_never_imports_the_kernel_package():
    """Every module of jaxpos/core, every import in it (deferred ones included): none
    names ``jaxpos.kernels`` or the top-level ``kernels`` folder."""
    files = sorted((ROOT / "jaxpos" / "core").rglob("*.py"))
    assert len(files) > 10  # the core is there to be read
    bad = [f"{f.relative_to(ROOT)}:{line} imports {mod}"
           for f in files for line, mod in _imported_modules(f)
           if mod.split(".")[:2] == ["jaxpos", "kernels"] or mod.split(".")[0] == "kernels"]
    assert not bad, "the core must not depend on the kernel package:\n" + "\n".join(bad)



def test_implementations_is_defined_once():
    """``IMPLEMENTATIONS`` means the engines of :func:`jaxpos.attention`, defined in one
    module; what a scheme's own attention takes has its own name."""
    files = sorted([*(ROOT / "jaxpos").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")])
    where = []
    for f in files:
        text = f.read_text()
        if "IMPLEMENTATIONS" not in text:
            continue
        for node in ast.walk(ast.parse(text, str(f))):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) else []
            where += [f"{f.relative_to(ROOT)}:{node.lineno}" for t in targets
                      if isinstance(t, ast.Name) and t.id == "IMPLEMENTATIONS"]
    assert len(where) == 1 and where[0].startswith("jaxpos/core/entry.py:"), where


def test_source_files_are_at_most_600_lines():
    files = sorted([*(ROOT / "jaxpos").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")])
    assert len(files) > 50
    long = {str(f.relative_to(ROOT)): n for f in files
            if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines (split them along a seam): {long}"


ARCHITECTURE = ROOT / "docs" / "architecture.md"
# a repository path (`jaxpos/core/entry.py`, `kernels/`, `docs/kernel.md`), in backticks or
# in a code block; placeholders (`<scheme>`, `*`) are caught as paths that do not exist
_PATH = re.compile(r"(?<![\w./])((?:jaxpos|kernels|tests|docs|benchmarks|examples)/[\w./<>*-]*)")
_BARE_FILE = re.compile(r"`([\w-]+\.py)`")  # a file named in a room's list: `entry.py`
_DOTTED = re.compile(r"`(jaxpos(?:\.\w+)+)")  # `jaxpos.layers.cores.attention_for(...)`


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for name in parts[i:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def test_architecture_names_only_files_and_names_that_exist():
    """Every path docs/architecture.md names exists (folders too), every file it names
    by its bare name exists somewhere in the source, and every ``jaxpos.x.y`` it names
    imports."""
    text = ARCHITECTURE.read_text()
    paths = {p.rstrip(".,;:)") for p in _PATH.findall(text)}
    assert len(paths) > 40  # the page is read, not skipped
    missing = sorted(p for p in paths if "<" in p or "*" in p or not (ROOT / p).exists())
    names = {f.name for d in ("jaxpos", "kernels") for f in (ROOT / d).rglob("*.py")}
    missing += sorted(f for f in set(_BARE_FILE.findall(text)) if f not in names)
    missing += sorted(d for d in set(_DOTTED.findall(text)) if not _resolves(d))
    assert not missing, f"docs/architecture.md names what does not exist: {missing}"


def test_architecture_says_each_thing_once():
    """No run of 12 words stands twice in docs/architecture.md (the page once carried two
    copies of its layers paragraph and two entries for core/entry.py)."""
    words = re.sub(r"[|`#*-]+", " ", ARCHITECTURE.read_text()).split()
    seen: dict[tuple[str, ...], int] = {}
    repeats = []
    for i in range(len(words) - 11):
        run = tuple(words[i:i + 12])
        if run in seen and i - seen[run] >= 12:
            repeats.append(" ".join(run))
        seen.setdefault(run, i)
    assert not repeats, f"repeated in docs/architecture.md: {repeats[:5]}"
