"""Write the option tables of examples/README.md from the scripts' own argument parsers.

Each example script builds an :mod:`argparse` parser; this reads it (without running the
script) and renders one Markdown table per script between the markers

    <!-- options: SCRIPT -->
    ...
    <!-- /options -->

of ``examples/README.md``, so the documented options are exactly those of ``--help``.
``tests/docs/test_readme.py`` fails when the file and the parsers disagree.

Usage::

    python examples/readme_options.py            # print the tables
    python examples/readme_options.py --write    # rewrite them in examples/README.md
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import re
import sys
from unittest import mock

HERE = pathlib.Path(__file__).resolve().parent
README = HERE / "README.md"
SCRIPTS = ("length_generalization.py", "dog_bites_man.py", "plot_encodings.py",
           "flax_nnx_drop_in.py", "flax_linen_drop_in.py")
_BLOCK = re.compile(r"(<!-- options: (?P<script>[\w.]+) -->\n)(?P<body>.*?)(<!-- /options -->)",
                    re.S)


class _Parser(Exception):
    """Carries the parser out of the script's ``parse_args`` call."""


def parser_of(script: str) -> argparse.ArgumentParser:
    """The :class:`argparse.ArgumentParser` that ``examples/<script>`` builds.

    The script is imported (not run) and its ``parse_args`` or ``main`` function called
    with ``parse_args`` intercepted, so nothing is computed.

    Raises:
      ValueError: the script defines neither ``parse_args`` nor ``main``, or they never
        parse arguments.
    """
    spec = importlib.util.spec_from_file_location(f"_example_{script[:-3]}", HERE / script)
    module = sys.modules.get(spec.name)
    if module is None:
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while defined
        spec.loader.exec_module(module)
    entry = getattr(module, "parse_args", None) or getattr(module, "main", None)
    if entry is None:
        raise ValueError(f"script {script} has neither parse_args nor main.")

    def grab(self, *args, **kwargs):
        raise _Parser(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", grab):
        try:
            entry([])
        except _Parser as found:
            return found.args[0]
    raise ValueError(f"script {script}: {entry.__name__}([]) never parsed arguments.")


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def options_table(script: str) -> str:
    """A Markdown table: one row per option of ``script`` (``-h`` left out), with its
    argument, default and help text as ``--help`` prints them."""
    rows = ["| option | default | what it sets |", "|---|---|---|"]
    for action in parser_of(script)._actions:  # argparse has no public list of actions
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        flag = action.option_strings[-1]
        if action.nargs != 0:
            metavar = action.metavar or (
                "{" + ",".join(action.choices) + "}" if action.choices else action.dest.upper())
            flag = f"{flag} {metavar}"
        default = "" if action.default is None or action.default is False else \
            f"`{action.default}`"
        help_text = (action.help or "").replace("%(default)s", str(action.default))
        rows.append(f"| `{_cell(flag)}` | {_cell(default)} | {_cell(help_text)} |")
    return "\n".join(rows) + "\n"


def render(text: str) -> str:
    """``text`` (examples/README.md) with every options block regenerated."""
    return _BLOCK.sub(lambda m: m.group(1) + options_table(m.group("script")) + m.group(4),
                      text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--write", action="store_true", help="rewrite examples/README.md in place")
    args = p.parse_args(argv)
    if args.write:
        README.write_text(render(README.read_text()))
        print(f"wrote {README}")
    else:
        for script in SCRIPTS:
            print(f"{script}\n\n{options_table(script)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
