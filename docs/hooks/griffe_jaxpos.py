"""A griffe extension for the API reference (mkdocs.yml: mkdocstrings' ``extensions``).

The docstrings of jaxpos are written with Sphinx cross-reference roles (``:func:`x```,
``:class:`~a.B```, ...) and a few reStructuredText forms, while the site renders them as
Markdown (mkdocstrings, Google style). Left alone, a role shows as the text ``:func:``
before a code span. When the ``jaxpos`` package has been loaded, this extension

* grafts the repository's ``kernels/`` folder into it as ``jaxpos.kernels`` (its installed
  name; pyproject.toml maps the package there), so the API pages say ``jaxpos.kernels.*``
  and references to it resolve;
* rewrites every role as an optional cross-reference of mkdocs-autorefs: the role's target,
  resolved in the scope of the docstring's object as Python would (``Cache`` inside
  ``jaxpos.layers.cache.dense`` is the class that module imports), becomes a link where the
  site documents it and a code span where it does not (``flax.nnx.Rngs``, a private helper);
* turns reStructuredText's ``::`` before a literal block into ``:`` (the indented block
  below renders as code in Markdown too) and its simple tables (rows between ``=====``
  rules, cells two spaces apart) into Markdown tables;
* titles "Errors" a ``Raises:`` section that names no exception type ("The errors of
  :func:`x`."), which the Google-style parser cannot split into type and description.

The rewrite touches the docstrings griffe loaded, never the source files. The site test
(tests/docs/test_site.py) checks that the built pages hold no raw role.
"""

from __future__ import annotations

import html
import pathlib
import re
from collections.abc import Iterator
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?P<role>class|func|meth|mod|attr|data|exc|obj|const|type):"
                  r"`(?P<body>[^`]+)`")
LITERAL_BLOCK_INTRO = re.compile(r"(?<=\S)::$", re.M)  # "...the rule::" before an indented block
RAISES_ITEM = re.compile(r"[A-Za-z_][\w.]*(\s*\(.*?\))?\s*:(\s|$)")  # "ValueError: ..."
TABLE_RULE = re.compile(r"^ *=+( +=+)+ *$")  # "=====  =====" of a simple table
KERNELS_DIR = pathlib.Path(__file__).resolve().parents[2] / "kernels"


def _objects(obj: griffe.Object | griffe.Alias, seen: set[int]) -> Iterator[griffe.Object]:
    if isinstance(obj, griffe.Alias) or id(obj) in seen:  # an import: documented where defined
        return
    seen.add(id(obj))
    yield obj
    for member in obj.members.values():
        yield from _objects(member, seen)


def _canonical(collection: Any, path: str) -> str:
    """The path under which the site documents ``path``: an alias's final target, else
    ``path`` itself (an object outside the loaded packages keeps the path written)."""
    try:
        obj = collection[path]
    except Exception:  # noqa: BLE001 - KeyError, AliasResolutionError: not ours
        return path
    try:
        return obj.final_target.path if obj.is_alias else obj.path
    except Exception:  # noqa: BLE001 - an alias to an external object
        return obj.target_path if obj.is_alias else path


def resolve(scope: griffe.Object, collection: Any, target: str) -> str | None:
    """The full path of ``target`` as written in a docstring of ``scope``: first as an
    absolute path in the loaded packages, then with its first name resolved in the scope
    of ``scope`` (its members, its module's imports, its parents). None if neither."""
    target = target.lstrip(".").removesuffix("()")
    try:
        collection[target]
        return _canonical(collection, target)
    except Exception:  # noqa: BLE001, S110 - not an absolute path of a loaded package
        pass
    first, _, rest = target.partition(".")
    try:
        base = scope.resolve(first)
    except Exception:  # noqa: BLE001 - unknown in this scope
        return None
    return _canonical(collection, f"{base}.{rest}" if rest else base)


def render_role(scope: griffe.Object, collection: Any, match: re.Match[str]) -> str:
    """The HTML that replaces one role: an optional autoref around a code span."""
    body = match["body"].strip()
    title = None
    if body.endswith(">") and "<" in body:  # :func:`the entry point <jaxpos.attention>`
        title, _, body = body[:-1].rpartition("<")
        title = title.strip()
    short = body.startswith("~")
    target = body.lstrip("~!")
    if title is None:
        title = target.rsplit(".", 1)[-1] if short else target
    code = f"<code>{html.escape(title)}</code>"
    path = resolve(scope, collection, target)
    if path is None:
        return code
    return f'<autoref identifier="{html.escape(path)}" optional>{code}</autoref>'


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def retitle_untyped_raises(text: str) -> str:
    """``text`` with each ``Raises:`` section none of whose items starts with an exception
    type retitled ``Errors:`` (Google style: an admonition, shown as written)."""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line.strip() != "Raises:":
            continue
        items = []
        for following in lines[i + 1:]:
            if following.strip() and _indent(following) <= _indent(line):
                break
            if following.strip():
                items.append(following)
        if items:
            item_indent = min(map(_indent, items))
            heads = [item.strip() for item in items if _indent(item) == item_indent]
            if not any(RAISES_ITEM.match(head) for head in heads):
                lines[i] = line.replace("Raises:", "Errors:")
    return "\n".join(lines)


def simple_tables_to_markdown(text: str) -> str:
    """``text`` with each reStructuredText simple table (a rule, a header row, a rule, body
    rows, a rule; one line per row) as a Markdown table; a table whose rows do not split
    into the rule's number of cells at runs of two or more spaces is left as written."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        rules = [j for j in range(i, len(lines)) if TABLE_RULE.match(lines[j])][:3]
        if (len(rules) == 3 and rules[0] == i and rules[1] == i + 2
                and all(lines[j].strip() for j in range(i, rules[2]))):
            ncols = len(lines[i].split())
            rows = [re.split(r" {2,}", lines[j].strip())
                    for j in range(i + 1, rules[2]) if j != rules[1]]
            if all(len(row) == ncols for row in rows):
                indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
                table = [rows[0], ["---"] * ncols, *rows[1:]]
                out.extend(indent + "| " + " | ".join(row) + " |" for row in table)
                i = rules[2] + 1
                continue
        out.append(lines[i])
        i += 1
    return "\n".join(out)


def rewrite(scope: griffe.Object, collection: Any, text: str) -> str:
    """``text`` (a docstring of ``scope``) with its roles, ``::``, simple tables and untyped
    ``Raises:`` sections rendered for Markdown."""
    text = simple_tables_to_markdown(text)
    text = ROLE.sub(lambda m: render_role(scope, collection, m), text)
    text = LITERAL_BLOCK_INTRO.sub(":", text)
    return retitle_untyped_raises(text)


class JaxposDocs(griffe.Extension):
    """Graft ``kernels`` as ``jaxpos.kernels``; render Sphinx roles as cross-references."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader,
                   **kwargs: Any) -> None:
        if pkg.name != "jaxpos":
            return
        packages = [pkg]
        if "kernels" not in pkg.members and KERNELS_DIR.is_dir():
            kernels = loader.load(KERNELS_DIR, try_relative_path=False)
            assert isinstance(kernels, griffe.Module)
            pkg.set_member("kernels", kernels)  # its path is now jaxpos.kernels
            packages.append(kernels)
        collection = loader.modules_collection
        seen: set[int] = set()
        for package in packages:
            for obj in _objects(package, seen):
                if obj.docstring is not None:
                    obj.docstring.value = rewrite(obj, collection, obj.docstring.value)
