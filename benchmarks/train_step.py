"""What a position scheme costs in a training step: a ``jaxpos.nnx.DecoderLM`` forward +
backward (next-token cross-entropy, gradients of every parameter) with NoPE, RoPE, ALiBi
and T5 side by side, on one attention engine (``--implementation``, default ``chunked``,
the CPU default).

Model: d_model 128, 2 layers, 4 heads (head_dim 32), vocab 512, batch 4, T = 256 and
1024 (``--lengths``), float32. Every scheme's step is compiled first, then the timed
runs go round-robin: in each of ``--repeats`` rounds every scheme runs once, the order
rotated from round to round, so that the load of a shared machine falls on every scheme
alike. Reported per scheme: the median, minimum and maximum step time, the ratio of its
median to NoPE's (``median / NoPE``), of its minimum to NoPE's, and the median of the
per-round ratios (``paired``: each round's time over NoPE's in the same round, the
figure least moved by load that drifts between rounds). The load average before and
after is printed and written with the table.

Usage::

    python benchmarks/train_step.py            # the committed table (about 2 minutes)
    python benchmarks/train_step.py --quick    # T = 64, 2 rounds; seconds (the test)

The table goes to ``benchmarks/results/train_step_cpu.md`` (``--output``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxpos.nnx as jn

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "train_step_cpu.md"
SCHEMES = ("nope", "rope", "alibi", "t5")
GOAL = 1.05  # every scheme's step within 5% of NoPE's


def make_step(scheme: str, *, vocab: int, d_model: int, layers: int, heads: int,
              implementation: str | None):
    """``(jitted value_and_grad step, params)`` of one DecoderLM."""
    model = jn.DecoderLM(vocab, d_model=d_model, num_layers=layers, num_heads=heads,
                         position=scheme, implementation=implementation, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)

    def loss_fn(params, tokens):
        logits = nnx.merge(graphdef, params)(tokens[:, :-1])
        labels = tokens[:, 1:]
        picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)

    return jax.jit(jax.value_and_grad(loss_fn)), params


def time_round_robin(steps: dict, tokens, repeats: int) -> dict[str, list[float]]:
    """Seconds of every step over ``repeats`` rounds, the order rotated each round (one
    warm-up run each first)."""
    names = list(steps)
    for name in names:
        fn, params = steps[name]
        jax.block_until_ready(fn(params, tokens))
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn, params = steps[name]
            t0 = time.perf_counter()
            jax.block_until_ready(fn(params, tokens))
            times[name].append(time.perf_counter() - t0)
    return times


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    ap.add_argument("--implementation", default="chunked",
                    help="attention engine (reference, chunked, xla, pallas)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=9, help="timed rounds")
    ap.add_argument("--quick", action="store_true", help="T = 64, 2 rounds")
    ap.add_argument("--output", type=pathlib.Path, default=RESULTS)
    a = ap.parse_args(argv)
    if a.quick:
        a.lengths, a.repeats = [64], 2
    schemes = ["nope"] + [s for s in a.schemes if s != "nope"]  # NoPE is the baseline
    load_before = _load()
    print(f"load average before: {load_before}", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    for T in a.lengths:
        tokens = jnp.asarray(rng.integers(0, a.vocab, (a.batch, T + 1)), jnp.int32)
        steps = {s: make_step(s, vocab=a.vocab, d_model=a.d_model, layers=a.layers,
                              heads=a.heads, implementation=a.implementation)
                 for s in schemes}
        times = time_round_robin(steps, tokens, a.repeats)
        base = times["nope"]
        for s in schemes:
            t = times[s]
            paired = statistics.median(x / b for x, b in zip(t, base))
            row = dict(T=T, scheme=s, median=statistics.median(t), min=min(t), max=max(t),
                       ratio=statistics.median(t) / statistics.median(base),
                       min_ratio=min(t) / min(base), paired=paired)
            rows.append(row)
            print(f"T={T} {s}: median {row['median'] * 1e3:.1f} ms (min {row['min'] * 1e3:.1f}"
                  f", max {row['max'] * 1e3:.1f}); / NoPE {row['ratio']:.3f}, min / NoPE "
                  f"{row['min_ratio']:.3f}, paired {paired:.3f}", flush=True)
    load_after = _load()
    print(f"load average after: {load_after}", flush=True)

    lines = [
        "# Training step on CPU: the cost of the position scheme", "",
        f"Command: `python benchmarks/train_step.py{' --quick' if a.quick else ''}`", "",
        (f"- Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
         f"{os.cpu_count()} CPUs ({platform.machine()}), shared with other work: load "
         f"average before {load_before}, after {load_after}. Times on a loaded machine are "
         f"noisy; the schemes run interleaved, so the ratios are the figures to read."),
        (f"- jax {jax.__version__}; `jaxpos.nnx.DecoderLM(vocab={a.vocab}, d_model={a.d_model}"
         f", num_layers={a.layers}, num_heads={a.heads})`, float32, batch {a.batch}, "
         f"implementation `{a.implementation}`; one step = the loss (next-token "
         f"cross-entropy) and the gradients of every parameter, jitted."),
        (f"- {a.repeats} rounds after a warm-up; in each round every scheme runs once, the "
         f"order rotated per round. `median / NoPE` and `min / NoPE`: the scheme's median "
         f"(minimum) over NoPE's; `paired`: the median over rounds of the scheme's time over "
         f"NoPE's in the same round. Goal: every scheme <= {GOAL} x NoPE."), "",
        "| T | scheme | median (ms) | min (ms) | max (ms) | median / NoPE | min / NoPE | "
        "paired |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['T']} | {r['scheme']} | {r['median'] * 1e3:.1f} | "
                     f"{r['min'] * 1e3:.1f} | {r['max'] * 1e3:.1f} | {r['ratio']:.3f} | "
                     f"{r['min_ratio']:.3f} | {r['paired']:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(text)
    return rows


if __name__ == "__main__":
    main()
