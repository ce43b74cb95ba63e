"""Serving benchmark, side by side in one run: the paged KV cache against the dense one.

1. **Decode step, paged vs dense**, per scheme (``none``, ``rope`` rotated on load from
   tables, ``alibi``, ``t5``) at fills 1k .. 16k: one attention call of a decode step
   (batch 4, 8 query heads, 2 KV heads, head_dim 64, float32), jitted, on the same keys
   held four ways: a dense ``[B, fill]`` cache with ``kv_lengths``; pages of 16 placed by
   :class:`jaxpos.serving.PageAllocator` (the four rows booked, then grown a page at a
   time in turn, as decode steps grow them); the same pages shuffled over the pool (the
   worst case: every page boundary a jump); and a plain-JAX peer, the dense cache read by
   ``jax.nn.dot_product_attention`` (keys rotated, ALiBi or T5 bias built in the step).
   Every call is checked against the dense one first. Measurements go round-robin over
   every configuration ``--repeats`` times (the four variants' order rotating), each the
   mean of ``--steps`` calls; a ratio is taken within a repeat (the variants measured
   back to back) and the table gives its median and [min-max] over repeats. Goals: paged
   (the allocator's placement) / dense <= 1.15, paged / peer <= 1.2. The CPU-time ratio
   (``time.process_time``, all of the process's threads) is printed beside the wall-clock
   one: on a shared machine it moves less with other processes' load.
2. **KV memory on the long-tail workload** of ``examples/serve.py`` (64 requests,
   log-normal prompt and output lengths): pages in use x page size / tokens held,
   averaged over decode steps (goal <= 1.1), beside a dense ``[slots, max_len]`` cache /
   tokens held.
3. **Continuous batching vs a static padded batch** on the same workload: the loop with a
   token budget (``--budget``, ``max_num_batched_tokens``: one ragged step per iteration),
   the loop that prefills each admitted prompt in 16-token calls before its decode step,
   and ``schedule="static"`` (a batch admitted only when every slot is idle): generated
   tokens/s (goal: budgeted continuous / static >= 2) and time to first token. Each engine
   first serves the workload once (compiling every shape); then the three loops' runs are
   interleaved, their order rotating per repeat, and each ratio is taken within one
   repeat: median and [min-max].
4. **A long prompt arriving mid-run** (``--long-prompt N``, run instead of 1-3): the
   long-tail workload alone and with one ``N``-token prompt arriving a third of the way
   in, served by today's loop and by the token-budget loop (``--budget``,
   ``max_num_batched_tokens``): p50 / p90 inter-token latency of the running requests
   (goal: p90 with the prompt <= 1.5x without) and tokens/s, runs interleaved.
5. **Prefix sharing** (``--prefix-sharing``, appended): ``--prefix-requests`` requests
   (64) sharing a ``--prefix-system``-token system prompt (512), served with and without
   ``prefix_caching=True``: pages in use, prompt tokens prefilled and read from shared
   pages (the prefill saved), time to first token, tokens/s
   (``benchmarks/prefix_sharing.py``'s ``bench`` and ``render``).
6. **Quantised pages** (``--quantised-pages``, appended): int8 and float8 pages against
   float32 and bfloat16 ones at head_dim 64 and 128 (``--quant-head-dims``): KV bytes per
   token with the scales, a paged decode step at ``--quant-fill``, logit error and greedy
   agreement over 256 teacher-forced tokens (``benchmarks/quantised_pages.py``'s
   ``report``).

Usage::

    python benchmarks/serve.py --out benchmarks/results/serve_cpu.md   # ~6-9 min on 2 cores
    python benchmarks/serve.py --quick                                  # ~1-2 min look
    python benchmarks/serve.py --long-prompt 4096 --requests 32 --budget 256
    python benchmarks/serve.py --prefix-sharing --quantised-pages   # sections 1-3, 5, 6
    python benchmarks/serve.py --no-decode --no-serve --prefix-sharing   # section 5 only
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxpos
from jaxpos.schemes.rope.scaling import default_inv_freq
from jaxpos.schemes.rope.tables import rope_tables
from jaxpos.serving import PageAllocator, PagedDecoder, Request, ServingEngine

B, N, NK, H, PS = 4, 8, 2, 64, 16
ROOT = Path(__file__).resolve().parents[1]


def _example():
    spec = importlib.util.spec_from_file_location("_example_serve", ROOT / "examples" / "serve.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------ 1. decode step
VARIANTS = ("dense", "paged", "shuffled", "peer")


def _scheme_kwargs(name: str, fill: int):
    if name == "none":
        return {}
    if name == "rope":
        inv = jnp.asarray(default_inv_freq(H, 10000.0), jnp.float32)
        return {"rope_tables": rope_tables(jnp.full((B, 1), fill - 1), jnp.arange(fill), inv)}
    if name == "alibi":
        return {"position": jaxpos.ALiBi(N)}
    if name == "t5":
        return {"position": jaxpos.T5Bias(_t5_table(), bidirectional=False)}
    raise ValueError(f"unknown scheme {name!r}; expected none, rope, alibi or t5")


def _t5_table():
    return jnp.linspace(-1, 1, 32 * N).reshape(32, N)


def _t5_causal_bucket(dist):
    """T5's causal bucket (32 buckets, max_distance 128) of ``dist = q_pos - kv_pos >=
    0``, written out in plain JAX: 16 exact, then 16 logarithmic up to 128."""
    large = 16 + (jnp.log(jnp.maximum(dist, 1).astype(jnp.float32) / 16)
                  / np.float32(np.log(128 / 16)) * 16).astype(jnp.int32)
    return jnp.where(dist < 16, dist, jnp.minimum(large, 31))


def peer_step(name: str, fill: int):
    """The plain-JAX peer: ``jax.nn.dot_product_attention`` over the dense ``[B, fill]``
    cache, the scheme applied as a user of plain JAX would (keys rotated from
    precomputed cos/sin tables; an ALiBi or T5 bias ``[1, N, 1, fill]`` built in the
    step)."""
    qpos = fill - 1
    kpos = jnp.arange(fill, dtype=jnp.int32)
    if name == "rope":
        ang = np.arange(fill)[:, None] * default_inv_freq(H, 10000.0)[None, :]
        cos, sin = jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)

        def rot(x, c, s):
            x1, x2 = x[..., :H // 2], x[..., H // 2:]
            c, s = c[:, None, :], s[:, None, :]
            return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)

        return lambda q, k, v, n: jax.nn.dot_product_attention(
            rot(q, cos[qpos:], sin[qpos:]), rot(k, cos, sin), v, key_value_seq_lengths=n)
    if name == "alibi":
        slopes = jnp.asarray(jaxpos.alibi_slopes(N), jnp.float32)

        def bias():
            return (slopes[:, None] * (kpos - qpos).astype(jnp.float32))[None, :, None, :]
    elif name == "t5":
        table = _t5_table()

        def bias():
            return table[_t5_causal_bucket(qpos - kpos)].T[None, :, None, :]
    else:
        bias = None
    return lambda q, k, v, n: jax.nn.dot_product_attention(
        q, k, v, None if bias is None else bias(), key_value_seq_lengths=n)


def allocator_tables(per: int) -> np.ndarray:
    """int32 ``[B, per]``: the pages :class:`PageAllocator` hands ``B`` requests booked
    for ``per`` pages each that grow one page at a time in turn (as decode steps grow
    them), from a pool of ``B * per`` pages."""
    alloc = PageAllocator(B * per)
    rows: list[list[int]] = [[] for _ in range(B)]
    for _ in range(B):
        assert alloc.reserve(per)
    for _ in range(per):
        for b in range(B):
            rows[b] += alloc.allocate(1, after=rows[b][-1] if rows[b] else None,
                                      expect=per - len(rows[b]))
    return np.asarray(rows, np.int32)


def _runs_per_row(table: np.ndarray) -> float:
    return float(np.mean(1 + np.sum(np.diff(table, axis=1) != 1, axis=1)))


def decode_cases(name: str, fill: int, seed: int = 0):
    """``{variant: (jitted fn, args)}`` on the same keys, and the page runs per row of the
    allocator's and the shuffled tables."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, 1, N, H)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, fill, NK, H)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, fill, NK, H)), jnp.float32)
    lens = jnp.full((B,), fill, jnp.int32)
    per = fill // PS
    kw = _scheme_kwargs(name, fill)
    qpos = jnp.full((B, 1), fill - 1, jnp.int32)
    dense = jax.jit(lambda q, k, v, n: jaxpos.attention(
        q, k, v, kv_lengths=n, q_positions=qpos, causal=True, **kw))
    paged = jax.jit(lambda q, kp, vp, t, n: jaxpos.attention(
        q, kp, vp, page_table=t, kv_lengths=n, causal=True, **kw))
    cases, runs = {"dense": (dense, (q, k, v, lens))}, {}
    tables = {"paged": allocator_tables(per),
              "shuffled": rng.permutation(B * per).reshape(B, per).astype(np.int32)}
    for variant, table in tables.items():
        flat = table.reshape(-1)
        kp = jnp.zeros((B * per, PS, NK, H)).at[flat].set(k.reshape(B * per, PS, NK, H))
        vp = jnp.zeros((B * per, PS, NK, H)).at[flat].set(v.reshape(B * per, PS, NK, H))
        cases[variant] = (paged, (q, kp, vp, jnp.asarray(table), lens))
        runs[variant] = _runs_per_row(table)
    cases["peer"] = (jax.jit(peer_step(name, fill)), (q, k, v, lens))
    return cases, runs


def _time(fn, args, steps: int) -> tuple[float, float]:
    """(wall ms, CPU ms) per call over ``steps`` calls (compiled before)."""
    t, c = time.perf_counter(), time.process_time()
    for _ in range(steps):
        out = fn(*args)
    jax.block_until_ready(out)
    return ((time.perf_counter() - t) / steps * 1e3, (time.process_time() - c) / steps * 1e3)


def bench_decode(schemes, fills, repeats: int, steps: int):
    """``{(scheme, fill): {"ms": {variant: [wall ms per repeat]}, "cpu": {...},
    "runs": {...}}}``."""
    cfgs, res = {}, {}
    for name in schemes:
        for fill in fills:
            cases, runs = decode_cases(name, fill)
            want = np.asarray(cases["dense"][0](*cases["dense"][1]))
            for variant, (fn, args) in cases.items():
                np.testing.assert_allclose(np.asarray(fn(*args)), want, atol=3e-5,
                                           err_msg=f"{name} fill {fill}: {variant}")
            cfgs[name, fill] = cases
            res[name, fill] = {"ms": {v: [] for v in VARIANTS},
                               "cpu": {v: [] for v in VARIANTS}, "runs": runs}
    for r in range(repeats):  # round-robin over every configuration
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        for key, cases in cfgs.items():
            for variant in order:
                wall, cpu = _time(*cases[variant], steps)
                res[key]["ms"][variant].append(wall)
                res[key]["cpu"][variant].append(cpu)
    return res


# ------------------------------------------------------- 2, 3. the long-tail workload
def _workload_model() -> PagedDecoder:
    """The 2-layer RoPE decoder that serves the long-tail workloads (sections 2-4)."""
    return PagedDecoder(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                        position=jaxpos.RoPE(rotary_dim=16), seed=0)


def _rotated(names: list, r: int) -> list:
    """``names`` starting at ``r`` modulo their count: repeat ``r``'s order of the runs."""
    k = r % len(names)
    return names[k:] + names[:k]


def bench_serving(repeats: int, requests: int, slots: int, budget: int):
    """``{loop: [summary per run]}`` for three loops: continuous batching with a token
    budget (one ragged step per iteration, ``max_num_batched_tokens=budget``), continuous
    batching with prefill calls before each decode step, and the static padded batch. Runs
    interleaved (the loops' order rotating per repeat), every engine first run once on the
    whole workload (every shape compiled)."""
    ex = _example()
    model = _workload_model()
    reqs = ex.long_tail_requests(requests, vocab_size=256, seed=0)
    max_len = 512
    per_seq = -(-max_len // PS)
    kw = dict(num_slots=slots, num_pages=slots * per_seq // 2, page_size=PS, max_len=max_len)
    engines = {"budget": ServingEngine(model, max_num_batched_tokens=budget, **kw),
               "continuous": ServingEngine(model, **kw),
               "static": ServingEngine(model, schedule="static", **kw)}
    for name, eng in engines.items():  # compile every shape the workload meets
        ex.serve(eng, reqs, progress=False, label=name)
    res: dict[str, list[dict]] = {s: [] for s in engines}
    names = list(engines)
    for r in range(repeats):
        for s in _rotated(names, r):
            done, stats = ex.serve(engines[s], reqs, progress=False, label=s)
            res[s].append(ex.summarize(done, stats, engines[s], model))
    return res


# ------------------------------------------- 4. a long prompt arriving mid-run
def _stream_latencies(engine, reqs, long_id) -> dict:
    """Serve ``reqs``; the inter-token gaps (seconds) of every request but ``long_id`` and
    the generated tokens/s."""
    last, gaps, n = {}, [], 0
    t0 = time.perf_counter()
    with engine.stream(reqs) as stream:
        for ev in stream:
            if ev.token is None:
                continue
            now, n = time.perf_counter(), n + 1
            if ev.id != long_id and ev.id in last:
                gaps.append(now - last[ev.id])
            last[ev.id] = now
    wall = time.perf_counter() - t0
    return dict(gaps=np.asarray(gaps), tps=n / wall, wall=wall)


def bench_long_prompt(repeats: int, requests: int, slots: int, long_len: int, budget: int):
    """The long-tail workload with and without one ``long_len``-token prompt arriving a
    third of the way into the run, served by today's loop (prefill in 16-token calls before
    each decode step) and by the budgeted ragged loop (``max_num_batched_tokens=budget``):
    ``{loop: {"alone" | "long": [run summaries]}}``, runs interleaved (the loops' order
    rotating per repeat), every engine warmed up (compiled) on the full workload first."""
    ex = _example()
    model = _workload_model()
    reqs = ex.long_tail_requests(requests, vocab_size=256, seed=0)
    max_len = long_len + 64
    per_seq = -(-max_len // PS)
    pool = per_seq + slots * (512 // PS)
    engines = {
        "today": ServingEngine(model, num_slots=slots, num_pages=pool, page_size=PS,
                               max_len=max_len),
        f"budget {budget}": ServingEngine(model, num_slots=slots, num_pages=pool, page_size=PS,
                                          max_len=max_len, max_num_batched_tokens=budget)}
    rng = np.random.default_rng(1)
    long = Request(rng.integers(0, 256, long_len).tolist(), 16, id="long")
    for eng in engines.values():  # compile every shape
        _stream_latencies(eng, reqs + [long], "long")
    # the prompt arrives a third of the way into today's run without it
    arrival = _stream_latencies(engines["today"], reqs, "long")["wall"] / 3
    late = Request(long.prompt, 16, id="long", arrival=arrival)
    res: dict = {name: {"alone": [], "long": []} for name in engines}
    names = list(engines)
    for r in range(repeats):
        for name in _rotated(names, r):
            for case, work in (("alone", reqs), ("long", reqs + [late])):
                res[name][case].append(_stream_latencies(engines[name], work, "long"))
    return res, arrival


def render_long_prompt(res, arrival, args, load_start) -> str:
    """The table of :func:`bench_long_prompt`: inter-token latency of the running requests
    (ms, median [min-max] over repeats of each run's p50 / p90 / longest gap, the stall a
    prefill causes) and tokens/s."""
    q = lambda runs, p: [1e3 * float(np.percentile(x["gaps"], p)) for x in runs]
    lines = [f"# Long prompt mid-run ({platform.processor() or platform.machine()}, jax "
             f"{jax.__version__})", "",
             f"`python benchmarks/serve.py {' '.join(args.argv)}`: {args.requests} long-tail "
             f"requests, {args.slots} slots, one {args.long_prompt}-token prompt arriving at "
             f"{arrival:.2f} s; {args.serve_repeats} interleaved repeats. Load average "
             f"{load_start[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end.", "",
             "| loop | ITL p50 ms (alone) | ITL p90 ms (alone) | ITL p50 ms (+long) | "
             "ITL p90 ms (+long) | p90 +long / alone | longest gap ms (+long) | tokens/s "
             "(alone) | tokens/s (+long) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, runs in res.items():
        a, lg = runs["alone"], runs["long"]
        ratio = [x / y for x, y in zip(q(lg, 90), q(a, 90))]
        lines.append(f"| {name} | {_mr(q(a, 50))} | {_mr(q(a, 90))} | {_mr(q(lg, 50))} | "
                     f"{_mr(q(lg, 90))} | {_mr(ratio)} | {_mr(q(lg, 100))} | "
                     f"{_mr([x['tps'] for x in a])} | "
                     f"{_mr([x['tps'] for x in lg])} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------- the table
def _mr(x) -> str:
    """median [min-max]"""
    x = np.asarray(x)
    return f"{np.median(x):.2f} [{x.min():.2f}-{x.max():.2f}]"


def _decode_lines(dec, args) -> list[str]:
    """The decode-step table (section 1) of :func:`render`."""
    lines = [
        f"## Decode step: paged vs dense cache (batch {B}, {N} query / {NK} KV heads, "
        f"head_dim {H}, pages of {PS}; ms per call, medians of {args.repeats} repeats of "
        f"{args.steps} calls)",
        "",
        "`paged`: the pages where `PageAllocator` puts four requests that grow together; "
        "`shuffled`: the same pages in random pool order (the worst case); `peer`: the "
        "dense cache read by `jax.nn.dot_product_attention`.",
        "",
        "| scheme | fill | dense ms | paged ms | shuffled ms | peer ms | paged / dense "
        "| shuffled / dense | paged / peer | paged / dense, CPU time |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    summary = {"paged": [], "shuffled": [], "peer": [], "cpu": []}
    for (name, fill), r in dec.items():
        ms = {v: np.asarray(r["ms"][v]) for v in VARIANTS}
        cpu = {v: np.asarray(r["cpu"][v]) for v in VARIANTS}
        ratios = {"paged": ms["paged"] / ms["dense"], "shuffled": ms["shuffled"] / ms["dense"],
                  "peer": ms["paged"] / ms["peer"], "cpu": cpu["paged"] / cpu["dense"]}
        for key, x in ratios.items():
            summary[key].append(float(np.median(x)))
        cells = " | ".join(f"{np.median(ms[v]):.2f}" for v in VARIANTS)
        lines.append(f"| {name} | {fill} | {cells} | {_mr(ratios['paged'])} | "
                     f"{_mr(ratios['shuffled'])} | {_mr(ratios['peer'])} | "
                     f"{np.median(ratios['cpu']):.2f} |")
    runs = {v: max(r["runs"][v] for r in dec.values()) for v in ("paged", "shuffled")}
    med = {k: (np.median(v), max(v)) for k, v in summary.items()}
    lines += [
        "",
        f"Medians over rows (worst row): paged / dense {med['paged'][0]:.2f} "
        f"({med['paged'][1]:.2f}; goal <= 1.15), shuffled / dense {med['shuffled'][0]:.2f} "
        f"({med['shuffled'][1]:.2f}), paged / peer {med['peer'][0]:.2f} "
        f"({med['peer'][1]:.2f}; goal <= 1.2), paged / dense in CPU time "
        f"{med['cpu'][0]:.2f} ({med['cpu'][1]:.2f}). Runs of consecutive pages per row, "
        f"most in any row above: {runs['paged']:.0f} as the allocator places them, "
        f"{runs['shuffled']:.0f} shuffled. `rope`: raw keys rotated on load from tables (a "
        f"cache that rotates at write is the `none` row).",
        "",
    ]
    return lines


def render(dec, serve, args, load_start) -> str:
    load = os.getloadavg()
    la = lambda t: " / ".join(f"{x:.1f}" for x in t)
    lines = [
        "# Serving on CPU: paged vs dense KV cache, continuous vs static batching",
        "",
        f"`python benchmarks/serve.py {' '.join(args.argv)}` on {platform.machine()} "
        f"({os.cpu_count()} cores, JAX {jax.__version__}, {jax.default_backend()}). Load "
        f"average (1 / 5 / 15 min) {la(load_start)} at the start, {la(load)} at the end: "
        f"the machine is shared, so single timings are noisy; every ratio is taken "
        f"between back-to-back measurements and given as median [min-max] over repeats.",
        "",
        "<!-- --8<-- [start:serve-table] -->",
    ]
    if dec:
        lines += _decode_lines(dec, args)
    if serve:
        g, c, s = serve["budget"], serve["continuous"], serve["static"]
        loops = (g, c, s)
        col = lambda runs, key, fmt: fmt.format(float(np.median([x[key] for x in runs])))
        span = lambda runs, key: (f"{np.median([x[key] for x in runs]):.0f} "
                                  f"[{min(x[key] for x in runs):.0f}-"
                                  f"{max(x[key] for x in runs):.0f}]")
        row = lambda label, key, fmt: (f"| {label} | "
                                       + " | ".join(col(x, key, fmt) for x in loops) + " |")
        ratio = lambda a: [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(a, s)]
        lines += [
            f"## Long-tail workload ({args.requests} requests, {args.slots} slots, "
            f"examples/serve.py's log-normal lengths; {len(c)} runs of each loop, "
            f"interleaved, after one run each that compiles; medians [min-max])",
            "",
            f"`continuous, budget {args.budget}`: one ragged step per iteration holding the "
            f"decode tokens and prompt chunks up to the budget (`max_num_batched_tokens`); "
            f"`continuous, prefill calls`: each admitted prompt prefilled in 16-token calls, "
            f"then one decode step; `static`: a batch admitted only when every slot is idle "
            f"(prefill calls, then decode steps until its longest request ends).",
            "",
            f"| | continuous, budget {args.budget} | continuous, prefill calls | static "
            f"padded batch |",
            "|---|---:|---:|---:|",
            "| generated tokens/s | " + " | ".join(span(x, "tokens_per_s") for x in loops)
            + " |",
            row("median time to first token (s)", "ttft_median_s", "{:.3f}"),
            row("p90 time to first token (s)", "ttft_p90_s", "{:.3f}"),
            row("jitted steps (decode, or ragged)", "decode_steps", "{:.0f}"),
            row("pages in use x page size / tokens held", "pages_per_token_held", "{:.3f}"),
            row("dense [slots, max_len] / tokens held", "dense_slots_per_token_held",
                "{:.2f}"),
            "| peak KV MiB (paged) / dense cache MiB | " + " | ".join(
                f"{col(x, 'peak_kv_mib_paged', '{:.2f}')} / {col(x, 'kv_mib_dense', '{:.2f}')}"
                for x in loops) + " |",
            "",
            f"Tokens/s against the static batch, per set of back-to-back runs: continuous with "
            f"budget {args.budget} {_mr(ratio(g))} (goal >= 2), continuous with prefill calls "
            f"{_mr(ratio(c))}; paged memory per token held "
            f"{col(g, 'pages_per_token_held', '{:.3f}')} (goal <= 1.1) against "
            f"{col(g, 'dense_slots_per_token_held', '{:.2f}')} for the dense cache.",
            "",
        ]
    lines.append("<!-- --8<-- [end:serve-table] -->")
    return "\n".join(lines)


QUICK = {"fills": [1024, 4096], "repeats": 3, "steps": 3, "requests": 16, "serve_repeats": 1,
         "prefix_requests": 16, "prefix_system": 128, "quant_fill": 512, "quant_repeats": 2,
         "quant_steps": 5}


# ---------------------------------- 5, 6. prefix sharing and quantised pages (other scripts)
def _benchmark(name: str):
    """``benchmarks/<name>.py`` as a module (this folder is not a package)."""
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", ROOT / "benchmarks" /
                                                  f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _section(text: str) -> str:
    """Another script's report as a section of this one (its ``#`` title one level down)."""
    return "\n".join("#" + line if line.startswith("# ") else line
                     for line in text.splitlines())


def extra_sections(args) -> list[str]:
    """The tables of ``--prefix-sharing`` (``benchmarks/prefix_sharing.py``: requests
    sharing a system prompt, with and without ``prefix_caching=True``) and
    ``--quantised-pages`` (``benchmarks/quantised_pages.py``: bytes, decode step and
    accuracy of int8 / float8 pages), run by those scripts' own functions."""
    out = []
    if args.prefix_sharing:
        ps = _benchmark("prefix_sharing")
        load = os.getloadavg()
        res = ps.bench(args.prefix_requests, args.prefix_system, args.serve_repeats)
        ns = argparse.Namespace(requests=args.prefix_requests, system=args.prefix_system,
                                quick=args.quick)
        out.append(_section(ps.render(res, ns, load, command=(
            f"python benchmarks/serve.py {' '.join(args.argv)}"))))
    if args.quantised_pages:
        qp = _benchmark("quantised_pages")
        out.append(_section(qp.report(args.quant_head_dims, args.quant_fill, args.quant_steps,
                                      args.quant_repeats, args.quick)))
    return out


def _quick_help() -> str:
    names = {"fills": "--fills", "serve_repeats": "--serve-repeats"}
    flag = lambda k: names.get(k, "--" + k.replace("_", "-"))
    val = lambda v: " ".join(map(str, v)) if isinstance(v, list) else str(v)
    return ("a quick look: smaller defaults (" + ", ".join(
        f"{flag(k)} {val(v)}" for k, v in QUICK.items()) + "); flags given explicitly win")


def build_parser() -> argparse.ArgumentParser:
    """The command line of :func:`main` (``--quick`` is applied by :func:`parse_args`)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemes", nargs="+", default=["none", "rope", "alibi", "t5"],
                    help="schemes of the decode-step table (section 1)")
    ap.add_argument("--fills", nargs="+", type=int, default=[1024, 4096, 16384],
                    help=f"cache fills of the decode-step table (multiples of {PS})")
    ap.add_argument("--repeats", type=int, default=7,
                    help="round-robin repeats of the decode-step table")
    ap.add_argument("--steps", type=int, default=5,
                    help="decode calls timed per repeat (their mean)")
    ap.add_argument("--requests", type=int, default=64,
                    help="requests of the long-tail workload (sections 2-4)")
    ap.add_argument("--slots", type=int, default=8, help="batch slots of the engines")
    ap.add_argument("--serve-repeats", type=int, default=3,
                    help="runs of each engine in the serving sections (2-5)")
    ap.add_argument("--no-serve", action="store_true",
                    help="skip the long-tail workload (sections 2 and 3)")
    ap.add_argument("--quick", action="store_true", help=_quick_help())
    ap.add_argument("--out", default=None,
                    help="also write the output to this file (refused when neither the "
                         "decode-step table nor the long-tail workload runs)")
    ap.add_argument("--long-prompt", type=int, default=0,
                    help="instead of sections 1-3: the long-tail workload plus one prompt of "
                         "this many tokens arriving mid-run, today's loop vs the token-budget "
                         "loop (--budget); --prefix-sharing / --quantised-pages are appended")
    ap.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens")
    ap.add_argument("--no-decode", action="store_true", help="skip the decode-step table")
    ap.add_argument("--prefix-sharing", action="store_true",
                    help="append benchmarks/prefix_sharing.py's table: requests sharing a "
                         "system prompt, with and without prefix_caching=True "
                         "(--serve-repeats runs of each)")
    ap.add_argument("--prefix-requests", type=int, default=64,
                    help="requests of --prefix-sharing, each the system prompt then 16-64 "
                         "tokens of its own")
    ap.add_argument("--prefix-system", type=int, default=512,
                    help="tokens of --prefix-sharing's shared system prompt")
    ap.add_argument("--quantised-pages", action="store_true",
                    help="append benchmarks/quantised_pages.py's table: int8 / float8 pages "
                         "against float32 and bfloat16 ones")
    ap.add_argument("--quant-head-dims", type=int, nargs="+", default=[64, 128],
                    help="head_dim of each --quantised-pages row group")
    ap.add_argument("--quant-fill", type=int, default=2048,
                    help="filled slots of --quantised-pages' timed decode step")
    ap.add_argument("--quant-steps", type=int, default=20,
                    help="decode steps timed per repeat of --quantised-pages")
    ap.add_argument("--quant-repeats", type=int, default=5,
                    help="round-robin repeats of --quantised-pages' timing (median [min])")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    """:func:`build_parser`'s arguments; ``--quick`` replaces the defaults of
    :data:`QUICK`'s options only (an option given on the command line keeps its value).
    Exits with a usage error for fills that are not positive multiples of the page size,
    and for ``--out`` when neither of this script's own tables runs (``--no-decode
    --no-serve``: the file's ``serve-table``, which docs/serving.md includes, would be
    empty)."""
    ap = build_parser()
    argv = list(argv if argv is not None else sys.argv[1:])
    if ap.parse_args(argv).quick:
        ap.set_defaults(**QUICK)
    args = ap.parse_args(argv)
    args.argv = argv
    for fill in args.fills:
        if fill <= 0 or fill % PS:
            ap.error(f"--fills must be positive multiples of the page size {PS}; got {fill}")
    if args.out and args.no_decode and args.no_serve and not args.long_prompt:
        ap.error(f"--out {args.out}: with --no-decode --no-serve none of serve.py's own "
                 f"tables runs, and the file's serve-table section (which docs/serving.md "
                 f"includes from benchmarks/results/serve_cpu.md) would be empty; leave out "
                 f"--out, or write the appended tables with benchmarks/prefix_sharing.py / "
                 f"benchmarks/quantised_pages.py --out")
    if args.no_decode and args.no_serve and not args.long_prompt and not (
            args.prefix_sharing or args.quantised_pages):
        ap.error("--no-decode --no-serve leaves nothing to run; add --prefix-sharing or "
                 "--quantised-pages")
    return args


def main(argv=None):
    args = parse_args(argv)
    load_start = os.getloadavg()
    if args.long_prompt:
        own = [render_long_prompt(*bench_long_prompt(args.serve_repeats, args.requests,
                                                     args.slots, args.long_prompt,
                                                     args.budget), args, load_start)]
    elif args.no_decode and args.no_serve:  # the appended tables alone
        own = []
    else:
        dec = None if args.no_decode else bench_decode(args.schemes, args.fills, args.repeats,
                                                       args.steps)
        serve = None if args.no_serve else bench_serving(args.serve_repeats, args.requests,
                                                         args.slots, args.budget)
        own = [render(dec, serve, args, load_start)]
    text = "\n\n".join(own + extra_sections(args))
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
