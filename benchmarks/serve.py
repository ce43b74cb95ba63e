"""Serving benchmark, side by side in one run: the paged KV cache against the dense one.

1. **Decode step, paged vs dense**, per scheme (``none``, ``rope`` rotated on load from
   tables, ``alibi``, ``t5``) at fills 1k .. 16k: one attention call of a decode step
   (batch 4, 8 query heads, 2 KV heads, head_dim 64, float32), jitted, against a dense
   ``[B, max_len]`` cache with ``kv_lengths`` and against the same keys in pages of 16
   scattered over a shuffled pool with a page table. Measurements go round-robin over
   every configuration ``--repeats`` times; the table gives medians and the ratio
   paged / dense (goal <= 1.15).
2. **KV memory on the long-tail workload** of ``examples/serve.py`` (64 requests,
   log-normal prompt and output lengths): pages in use x page size / tokens held,
   averaged over decode steps (goal <= 1.1), beside a dense ``[slots, max_len]`` cache /
   tokens held.
3. **Continuous batching vs a static padded batch** on the same workload (the same
   engine, ``schedule="static"``: a batch is admitted only when every slot is idle):
   generated tokens/s ratio (goal >= 2) and median time to first token, medians over
   ``--serve-repeats`` runs.

Usage::

    python benchmarks/serve.py --out benchmarks/results/serve_cpu.md     # ~5-10 min on CPU
    python benchmarks/serve.py --fills 1024 --repeats 2 --serve-repeats 1  # a quick look
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
from jaxpos.serving import PagedDecoder, ServingEngine

B, N, NK, H, PS = 4, 8, 2, 64, 16
ROOT = Path(__file__).resolve().parents[1]


def _example():
    spec = importlib.util.spec_from_file_location("_example_serve", ROOT / "examples" / "serve.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------ 1. decode step
def _scheme_kwargs(name: str, fill: int):
    if name == "none":
        return {}
    if name == "rope":
        inv = jnp.asarray(default_inv_freq(H, 10000.0), jnp.float32)
        return {"rope_tables": rope_tables(jnp.full((B, 1), fill - 1), jnp.arange(fill), inv)}
    if name == "alibi":
        return {"position": jaxpos.ALiBi(N)}
    if name == "t5":
        table = jnp.linspace(-1, 1, 32 * N).reshape(32, N)
        return {"position": jaxpos.T5Bias(table, bidirectional=False)}
    raise ValueError(name)


def decode_pair(name: str, fill: int, seed: int = 0):
    """Jitted dense and paged decode-step calls on the same keys, and their arguments."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, 1, N, H)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, fill, NK, H)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, fill, NK, H)), jnp.float32)
    lens = jnp.full((B,), fill, jnp.int32)
    per = fill // PS
    order = rng.permutation(B * per)
    table = jnp.asarray(order.reshape(B, per), jnp.int32)
    k_pages = jnp.zeros((B * per, PS, NK, H)).at[order].set(k.reshape(B * per, PS, NK, H))
    v_pages = jnp.zeros((B * per, PS, NK, H)).at[order].set(v.reshape(B * per, PS, NK, H))
    kw = _scheme_kwargs(name, fill)
    qpos = jnp.full((B, 1), fill - 1, jnp.int32)
    dense = jax.jit(lambda q, k, v, n: jaxpos.attention(
        q, k, v, kv_lengths=n, q_positions=qpos, causal=True, **kw))
    paged = jax.jit(lambda q, kp, vp, t, n: jaxpos.attention(
        q, kp, vp, page_table=t, kv_lengths=n, causal=True, **kw))
    return (dense, (q, k, v, lens)), (paged, (q, k_pages, v_pages, table, lens))


def _time(fn, args, steps: int) -> float:
    """ms per call over ``steps`` calls (compiled before)."""
    t = time.perf_counter()
    for _ in range(steps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / steps * 1e3


def bench_decode(schemes, fills, repeats: int, steps: int):
    cfgs = {}
    for name in schemes:
        for fill in fills:
            (d, da), (p, pa) = decode_pair(name, fill)
            np.testing.assert_allclose(np.asarray(d(*da)), np.asarray(p(*pa)), atol=2e-5)
            cfgs[name, fill] = ((d, da), (p, pa))
    times = {key: ([], []) for key in cfgs}
    for _ in range(repeats):  # round-robin over every configuration
        for key, ((d, da), (p, pa)) in cfgs.items():
            times[key][0].append(_time(d, da, steps))
            times[key][1].append(_time(p, pa, steps))
    return {key: (float(np.median(a)), float(np.median(b))) for key, (a, b) in times.items()}


# ------------------------------------------------------- 2, 3. the long-tail workload
def bench_serving(repeats: int, requests: int, slots: int):
    ex = _example()
    model = PagedDecoder(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         position=jaxpos.RoPE(rotary_dim=16), seed=0)
    reqs = ex.long_tail_requests(requests, vocab_size=256, seed=0)
    max_len = 512
    per_seq = -(-max_len // PS)
    res = {}
    for schedule in ("continuous", "static"):
        eng = ServingEngine(model, num_slots=slots, num_pages=slots * per_seq // 2,
                            page_size=PS, max_len=max_len, schedule=schedule)
        runs = []
        for _ in range(repeats):
            done, stats = ex.serve(eng, reqs, progress=False, label=schedule)
            runs.append(ex.summarize(done, stats, eng, model))
        res[schedule] = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
    return res


# ----------------------------------------------------------------------- the table
def render(dec, serve, args) -> str:
    load = os.getloadavg()
    lines = [
        "# Serving on CPU: paged vs dense KV cache, continuous vs static batching",
        "",
        f"`python benchmarks/serve.py {' '.join(args.argv)}` on {platform.machine()} "
        f"({os.cpu_count()} cores, JAX {jax.__version__}, {jax.default_backend()}); load "
        f"average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (a shared "
        f"machine: the timings are medians of round-robin repeats).",
        "",
        f"## Decode step: paged vs dense cache (batch {B}, {N} query / {NK} KV heads, "
        f"head_dim {H}, pages of {PS}; ms per call, medians of {args.repeats})",
        "",
        "| scheme | fill | dense ms | paged ms | paged / dense |",
        "|---|---:|---:|---:|---:|",
    ]
    for (name, fill), (d, p) in dec.items():
        lines.append(f"| {name} | {fill} | {d:.3f} | {p:.3f} | {p / d:.2f} |")
    ratios = [p / d for d, p in dec.values()]
    lines += ["", f"Median ratio {np.median(ratios):.2f}, worst {max(ratios):.2f} "
              f"(goal <= 1.15). `rope`: raw keys rotated on load from tables (a cache that "
              f"rotates at write is the `none` row).", ""]
    if serve:
        c, s = serve["continuous"], serve["static"]
        lines += [
            f"## Long-tail workload ({args.requests} requests, {args.slots} slots, "
            f"examples/serve.py's log-normal lengths; medians of {args.serve_repeats} runs)",
            "",
            "| | continuous | static padded batch |",
            "|---|---:|---:|",
            f"| generated tokens/s | {c['tokens_per_s']:.0f} | {s['tokens_per_s']:.0f} |",
            f"| median time to first token (s) | {c['ttft_median_s']:.3f} | "
            f"{s['ttft_median_s']:.3f} |",
            f"| p90 time to first token (s) | {c['ttft_p90_s']:.3f} | {s['ttft_p90_s']:.3f} |",
            f"| decode steps | {c['decode_steps']:.0f} | {s['decode_steps']:.0f} |",
            f"| pages in use x page size / tokens held | {c['pages_per_token_held']:.3f} | "
            f"{s['pages_per_token_held']:.3f} |",
            f"| dense [slots, max_len] / tokens held | {c['dense_slots_per_token_held']:.2f} | "
            f"{s['dense_slots_per_token_held']:.2f} |",
            f"| peak KV MiB (paged) / dense cache MiB | {c['peak_kv_mib_paged']:.2f} / "
            f"{c['kv_mib_dense']:.2f} | {s['peak_kv_mib_paged']:.2f} / {s['kv_mib_dense']:.2f} |",
            "",
            f"Continuous / static tokens/s: {c['tokens_per_s'] / s['tokens_per_s']:.2f} "
            f"(goal >= 2); paged memory per token held {c['pages_per_token_held']:.3f} "
            f"(goal <= 1.1) against {c['dense_slots_per_token_held']:.2f} for the dense cache.",
            "",
        ]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemes", nargs="+", default=["none", "rope", "alibi", "t5"])
    ap.add_argument("--fills", nargs="+", type=int, default=[1024, 4096, 16384])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--serve-repeats", type=int, default=3)
    ap.add_argument("--no-serve", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    dec = bench_decode(args.schemes, args.fills, args.repeats, args.steps)
    serve = None if args.no_serve else bench_serving(args.serve_repeats, args.requests,
                                                     args.slots)
    text = render(dec, serve, args)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
