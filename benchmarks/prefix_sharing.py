"""Prefix sharing in the serving loop: requests with a common system prompt, served with and
without ``ServingEngine(..., prefix_caching=True)``.

The workload: ``--requests`` requests (64) arriving together, each a ``--system``-token
system prompt (512) shared by all, then a user part of 16-64 random tokens, and 16 new
tokens; 8 batch slots, pages of 16, prefill chunks of 16, a RoPE decoder (``PagedDecoder``,
d_model 256, 4 layers, 8 query / 2 KV heads, float32). Both engines have the same pool,
large enough for 8 requests without sharing. Per engine: pages in use (the most held by
running requests at once; with sharing a shared page counts once), prompt tokens
prefilled and read from shared pages, time to first token (mean, median, p90; requests
queue for slots, so it grows along the queue), wall time and generated tokens/s. The two
engines' runs are interleaved (``--repeats``, alternating which goes first; each engine
compiled by a warm-up request first, its prefix cache cleared before every run); the
table gives medians [min-max]. Every run checks that both engines generate the same
tokens.

Usage::

    python benchmarks/prefix_sharing.py --out benchmarks/results/prefix_sharing_cpu.md
    python benchmarks/prefix_sharing.py --quick        # 16 requests, a 128-token prompt
    python benchmarks/serve.py --prefix-sharing ...    # the same table after serve.py's

:func:`bench` runs the engines and :func:`render` gives the table;
``benchmarks/serve.py --prefix-sharing`` appends it.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import jax
import numpy as np

import jaxpos
from jaxpos.serving import PagedDecoder, Request, ServingEngine

PS, CHUNK, SLOTS, NEW = 16, 16, 8, 16


def workload(requests: int, system: int, vocab: int, seed: int = 0) -> list[Request]:
    """``requests`` greedy requests: one ``system``-token prompt, then 16-64 tokens each."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, vocab, system).tolist()
    return [Request(shared + rng.integers(0, vocab, int(rng.integers(16, 65))).tolist(), NEW,
                    id=i) for i in range(requests)]


def run_once(engine: ServingEngine, reqs: list[Request]) -> dict:
    """Serve ``reqs`` on ``engine`` (prefix cache cleared first); the row's figures."""
    if engine.prefix_cache is not None:
        engine.prefix_cache.clear()
        engine.prefix_cache.peak_in_use = 0
    engine.allocator.peak_in_use = 0
    t0 = time.perf_counter()
    done, stats = engine.run(reqs)
    wall = time.perf_counter() - t0
    ttft = np.asarray([c.time_to_first_token for c in done])
    return dict(tokens={c.request.id: c.tokens for c in done}, pages=stats.peak_pages,
                prefilled=stats.prefill_tokens, cached=stats.cached_tokens,
                ttft_mean=ttft.mean(), ttft_median=np.median(ttft),
                ttft_p90=np.quantile(ttft, 0.9), wall=wall,
                tokens_per_s=stats.tokens_per_second)


def bench(requests: int, system: int, repeats: int) -> dict[str, list[dict]]:
    model = PagedDecoder(vocab_size=1024, d_model=256, num_layers=4, num_heads=8,
                         num_kv_heads=2, position=jaxpos.RoPE(rotary_dim=32), seed=0)
    reqs = workload(requests, system, model.vocab_size)
    max_len = system + 64 + NEW
    num_pages = SLOTS * -(-max_len // PS) + 32
    engines = {name: ServingEngine(model, num_slots=SLOTS, num_pages=num_pages, page_size=PS,
                                   max_len=max_len, prefill_chunk=CHUNK,
                                   prefix_caching=(name == "shared"))
               for name in ("alone", "shared")}
    for engine in engines.values():  # compile the prefill and decode steps
        engine.run([Request([1] * (CHUNK + 1), 2)])
    res: dict[str, list[dict]] = {name: [] for name in engines}
    for r in range(repeats):
        order = ("alone", "shared") if r % 2 == 0 else ("shared", "alone")
        for name in order:
            res[name].append(run_once(engines[name], reqs))
        if res["alone"][-1]["tokens"] != res["shared"][-1]["tokens"]:
            raise AssertionError("prefix sharing changed the generated tokens")
        print(f"repeat {r + 1}/{repeats}: " + ", ".join(
            f"{n} {res[n][-1]['wall']:.1f} s" for n in order), flush=True)
    return res


def _runs(n: int) -> str:
    return f"{n} run" if n == 1 else f"{n} runs"


def _shared_pages_sentence(system: int) -> str:
    """How the requests share a ``system``-token prompt: only whole pages are shared."""
    pages = system // PS
    if pages == 0:
        return (f"the {system}-token system prompt fills no whole page of {PS} tokens, and "
                f"only whole pages are shared: every request prefills the system prompt "
                f"itself.")
    return (f"the first request computes the system prompt's {pages} "
            f"{'page' if pages == 1 else 'pages'}, every later one maps "
            f"{'it' if pages == 1 else 'them'} into its page table and prefills its own part "
            f"only.")


def render(res: dict[str, list[dict]], args, load_start, command: str | None = None) -> str:
    """The markdown table of :func:`bench`'s runs (``args``: ``requests``, ``system``,
    ``quick``); ``command`` names the command line that ran it (default this script's);
    ``benchmarks/serve.py --prefix-sharing`` appends it to its own output."""
    a, s = res["alone"], res["shared"]
    med = lambda runs, k: float(np.median([x[k] for x in runs]))
    span = lambda runs, k, f: (f"{f.format(med(runs, k))} [{f.format(min(x[k] for x in runs))}"
                               f"-{f.format(max(x[k] for x in runs))}]")
    ratio = lambda k: [x[k] / y[k] for x, y in zip(s, a)]
    rows = [("pages in use (peak)", "pages", "{:.0f}"),
            ("prompt tokens prefilled", "prefilled", "{:.0f}"),
            ("prompt tokens read from shared pages", "cached", "{:.0f}"),
            ("time to first token, mean (s)", "ttft_mean", "{:.2f}"),
            ("time to first token, median (s)", "ttft_median", "{:.2f}"),
            ("time to first token, p90 (s)", "ttft_p90", "{:.2f}"),
            ("wall (s)", "wall", "{:.1f}"),
            ("generated tokens/s", "tokens_per_s", "{:.0f}")]
    total = a[0]["prefilled"]
    load_end = os.getloadavg()
    lines = [
        "# Prefix sharing on CPU: requests with a common system prompt",
        "",
        f"`{command or 'python benchmarks/prefix_sharing.py' + (' --quick' if args.quick else '')}`"
        f" on "
        f"{platform.machine()} ({os.cpu_count()} cores, JAX {jax.__version__}, "
        f"{jax.default_backend()}). Load average (1 / 5 / 15 min) "
        f"{' / '.join(f'{x:.1f}' for x in load_start)} at the start, "
        f"{' / '.join(f'{x:.1f}' for x in load_end)} at the end (a shared machine: "
        f"timings are noisy; ratios are taken between back-to-back runs).",
        "",
        "<!-- --8<-- [start:prefix-table] -->",
        f"{args.requests} requests arriving together, a {args.system}-token system prompt "
        f"then 16-64 user tokens each, {NEW} new tokens; {SLOTS} slots, pages of {PS}, "
        f"prefill chunks of {CHUNK}; RoPE `PagedDecoder` (d_model 256, 4 layers, 8 / 2 "
        f"heads, float32). {_runs(len(a))} of each engine, interleaved; medians [min-max]. "
        f"The generated tokens are the same with and without sharing in every run.",
        "",
        "| | without sharing | `prefix_caching=True` | shared / without |",
        "|---|---:|---:|---:|",
    ]
    for label, key, fmt in rows:
        r = ratio(key) if all(x[key] for x in a) else None
        lines.append(f"| {label} | {span(a, key, fmt)} | {span(s, key, fmt)} | "
                     f"{'-' if r is None else f'{np.median(r):.2f}'} |")
    lines += [
        "",
        f"Prefill tokens saved: {med(s, 'cached'):.0f} of {total} "
        f"({med(s, 'cached') / total:.0%}): " + _shared_pages_sentence(args.system),
        "<!-- --8<-- [end:prefix-table] -->",
        "",
    ]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--system", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true",
                    help="smaller defaults: 16 requests, a 128-token system prompt, one run "
                         "each (--requests, --system, --repeats given explicitly win)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        ap.set_defaults(requests=16, system=128, repeats=1)
        args = ap.parse_args(argv)
    load_start = os.getloadavg()
    res = bench(args.requests, args.system, args.repeats)
    text = render(res, args, load_start)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
