"""``benchmarks/serve.py``'s command line, with the benchmarks replaced by stubs (nothing is
timed): ``--quick`` shrinks defaults only, ``--out`` refuses to write a file without
serve.py's own tables, ``--long-prompt`` keeps the appended sections, every option has
help; and the wording of ``benchmarks/prefix_sharing.py``'s table for one run and a
system prompt shorter than a page."""

from __future__ import annotations

import argparse

import pytest
from _scripts import load_script


def _load(name: str):
    return load_script(f"benchmarks/{name}.py", f"_test_bench_{name}")


class _PrefixStub:
    """Stands in for benchmarks/prefix_sharing.py: records bench's arguments."""

    def __init__(self):
        self.calls = []

    def bench(self, requests, system, repeats):
        self.calls.append((requests, system, repeats))
        return {}

    def render(self, res, args, load, command=None):
        return f"# Prefix sharing stub\n{args.requests} requests, {args.system} tokens"


@pytest.fixture
def serve(monkeypatch):
    mod = _load("serve")
    stub = _PrefixStub()
    monkeypatch.setattr(mod, "_benchmark", lambda name: stub)

    def no_bench(*args, **kw):
        raise AssertionError("a benchmark of serve.py's own ran")

    monkeypatch.setattr(mod, "bench_decode", no_bench)
    monkeypatch.setattr(mod, "bench_serving", no_bench)
    return mod, stub


def test_quick_shrinks_only_the_defaults_the_command_line_leaves(serve, capsys):
    """--quick with --prefix-requests 2 --prefix-system 16: those two stay 2 and 16 (not
    quick's 16 and 128), --serve-repeats takes quick's 1; with --no-decode --no-serve the
    output is the appended table alone (no empty serve-table of serve.py's own)."""
    mod, stub = serve
    mod.main(["--quick", "--no-decode", "--no-serve", "--prefix-sharing",
              "--prefix-requests", "2", "--prefix-system", "16"])
    assert stub.calls == [(2, 16, 1)]
    out = capsys.readouterr().out
    assert "2 requests, 16 tokens" in out
    assert "serve-table" not in out and "# Serving on CPU" not in out
    args = mod.parse_args(["--quick", "--requests", "5"])
    assert (args.requests, args.fills, args.repeats) == (5, [1024, 4096], 3)
    assert mod.parse_args([]).requests == 64


def test_out_is_refused_when_none_of_serve_pys_own_tables_runs(serve, tmp_path):
    mod, stub = serve
    out = tmp_path / "serve_cpu.md"
    with pytest.raises(SystemExit) as e:
        mod.main(["--no-decode", "--no-serve", "--prefix-sharing", "--out", str(out)])
    assert e.value.code == 2
    assert not out.exists() and stub.calls == []


def test_long_prompt_appends_the_sections_asked_for(serve, monkeypatch, capsys):
    mod, stub = serve
    monkeypatch.setattr(mod, "bench_long_prompt", lambda *a: ({}, 0.0))
    monkeypatch.setattr(mod, "render_long_prompt", lambda *a: "# Long prompt stub")
    mod.main(["--long-prompt", "64", "--prefix-sharing", "--prefix-requests", "3"])
    out = capsys.readouterr().out
    assert "# Long prompt stub" in out and "## Prefix sharing stub" in out
    assert stub.calls == [(3, 512, 3)]


def test_every_option_has_help_and_quick_names_what_it_shrinks(serve):
    mod, _ = serve
    ap = mod.build_parser()
    assert [a.dest for a in ap._actions if not a.help] == []
    quick = next(a.help for a in ap._actions if a.dest == "quick")
    for key in mod.QUICK:
        assert "--" + key.replace("_", "-") in quick, key


def test_prefix_table_wording_for_one_run_and_a_prompt_under_a_page():
    ps = _load("prefix_sharing")
    run = dict(pages=3, prefilled=40, cached=0, ttft_mean=0.1, ttft_median=0.1,
               ttft_p90=0.1, wall=1.0, tokens_per_s=10.0)
    res = {"alone": [run], "shared": [run]}
    short = ps.render(res, argparse.Namespace(requests=2, system=ps.PS // 2, quick=False),
                      (0.0, 0.0, 0.0))
    assert "1 run of each engine" in short
    assert f"fills no whole page of {ps.PS} tokens" in short and "0 pages" not in short
    one = ps.render(res, argparse.Namespace(requests=2, system=ps.PS, quick=False),
                    (0.0, 0.0, 0.0))
    assert "system prompt's 1 page," in one
