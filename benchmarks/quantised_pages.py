"""Quantised KV pages (``init_cache(..., kv_dtype="int8")``): bytes, decode step time and
accuracy against unquantised pages, at head_dim 64 and 128.

* **bytes per token**: one layer's key and value pages per cached token, scales
  included (a float32 scale per token and KV head), from the pools' ``nbytes``;
* **decode step**: one paged attention call, ``jaxpos.attention(q, k_pages, v_pages,
  page_table=, kv_lengths=)`` (the default engine: the chunked page loader on CPU, the
  Pallas kernel's paged entry on GPU), batch 8, 8 query heads, 2 KV heads, rows filled to
  ``--fill`` tokens in pages of 16, jitted; variants measured round-robin ``--repeats``
  times (median, then min), ratios against float32 and bfloat16 pages;
* **accuracy**: a 2-layer RoPE :class:`jaxpos.nnx.DecoderLM` (2 heads of head_dim ``H``,
  vocabulary 256, random weights, seeds 0-2), 256 teacher-forced random tokens in one
  call: max |logit error| against float32 pages and greedy agreement.

Usage::

    python benchmarks/quantised_pages.py --out benchmarks/results/quantised_pages_cpu.md
    python benchmarks/quantised_pages.py --quick
    python benchmarks/serve.py --quantised-pages ...   # the same table after serve.py's

:func:`report` gives the table; ``benchmarks/serve.py --quantised-pages`` appends it.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxpos
from jaxpos import nnx as jn
from jaxpos.layers.cache import new_cache

B, N, NK, PAGE = 8, 8, 2, 16
KINDS = ["float32", "bfloat16", "int8", "float8_e4m3fn"]


def _bytes_per_token(H: int, kind: str) -> float:
    c = new_cache(1, PAGE, NK, H, jnp.float32, page_size=PAGE, kv_dtype=kind)
    pools = (c.k_pages, c.v_pages)
    return sum(p.nbytes for p in pools) / (c.num_pages * PAGE)


def _step_case(H: int, fill: int, kind: str, seed: int = 0):
    """``(fn, args)``: a jitted paged decode step over pools of ``kind``."""
    pps = -(-fill // PAGE)
    rng = np.random.default_rng(seed)
    c = new_cache(B, pps * PAGE, NK, H, jnp.float32, page_size=PAGE, kv_dtype=kind)
    k = jnp.asarray(rng.standard_normal((B * pps, PAGE, NK, H)), jnp.float32)
    table = jnp.asarray(rng.permutation(B * pps).reshape(B, pps), jnp.int32)
    dt = jnp.bfloat16 if kind == "bfloat16" else jnp.float32
    if isinstance(c.k_pages, jax.Array):
        kp, vp = k.astype(dt), (k * 0.5).astype(dt)
    else:
        from jaxpos.core.quantised import set_pages

        idx = jnp.arange(B * pps)
        kp, vp = set_pages(c.k_pages, idx, k), set_pages(c.v_pages, idx, k * 0.5)
    q = jnp.asarray(rng.standard_normal((B, 1, N, H)), dt)
    lens = jnp.full((B,), fill, jnp.int32)
    fn = jax.jit(lambda q, kp, vp, t, n: jaxpos.attention(q, kp, vp, page_table=t,
                                                          kv_lengths=n, causal=True))
    return fn, (q, kp, vp, table, lens)


def _time(fn, args, steps: int) -> float:
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(steps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / steps * 1e3


def _accuracy(H: int, kind: str, seeds=(0, 1, 2), T: int = 256) -> tuple[float, float, float]:
    """(max |logit error|, min greedy agreement, max |logit|) over ``seeds``."""
    errs, agree, top = [], [], []
    for s in seeds:
        m = jn.DecoderLM(256, d_model=2 * H, num_layers=2, num_heads=2, position="rope",
                         max_len=T, rngs=nnx.Rngs(s))
        toks = jax.random.randint(jax.random.key(s), (1, T), 0, 256)
        step = nnx.jit(lambda m, t, c: m.decode_step(t, c))
        ref, _ = step(m, toks, m.init_cache(1, T, page_size=PAGE))
        got, _ = step(m, toks, m.init_cache(1, T, page_size=PAGE, kv_dtype=kind))
        errs.append(float(jnp.max(jnp.abs(ref - got))))
        agree.append(float(jnp.mean(jnp.argmax(ref, -1) == jnp.argmax(got, -1))))
        top.append(float(jnp.max(jnp.abs(ref))))
    return max(errs), min(agree), max(top)


def report(head_dims=(64, 128), fill: int = 2048, steps: int = 20, repeats: int = 5,
           quick: bool = False) -> str:
    """The markdown table of this benchmark (bytes, decode step, accuracy per head_dim and
    page kind), with its description and the load average; ``benchmarks/serve.py
    --quantised-pages`` appends it to its own output."""
    load0 = os.getloadavg()[0]
    backend, kind = jax.default_backend(), jax.devices()[0].device_kind
    where = backend if kind.lower() == backend else f"{backend}, {kind}"
    lines = [f"# Quantised pages ({where})", "",
             f"{platform.processor() or platform.machine()}; jax {jax.__version__}; decode: B={B}, "
             f"N={N}, N_kv={NK}, page {PAGE}, fill {fill}, {steps} steps x {repeats} "
             f"repeats round-robin (median [min]); accuracy: 2-layer RoPE DecoderLM, 256 "
             f"teacher-forced tokens, seeds " + ("0" if quick else "0-2") + ".", "",
             "| head_dim | pages | bytes/token (K+V, 1 layer) | vs float32 | vs bfloat16 | "
             "decode step ms | step vs float32 | step vs bfloat16 | max abs logit err | "
             "greedy agreement |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for H in head_dims:
        cases = {k: _step_case(H, fill, k) for k in KINDS}
        times: dict[str, list[float]] = {k: [] for k in KINDS}
        for r in range(repeats):
            order = KINDS[r % len(KINDS):] + KINDS[:r % len(KINDS)]
            for k in order:
                times[k].append(_time(*cases[k], steps))
        med = {k: float(np.median(v)) for k, v in times.items()}
        for k in KINDS:
            nb = _bytes_per_token(H, k)
            if k in ("float32", "bfloat16"):
                acc = "(reference)" if k == "float32" else ""
                err, agree = (acc, "") if k == "float32" else _fmt_acc(H, k, quick)
            else:
                err, agree = _fmt_acc(H, k, quick)
            lines.append(
                f"| {H} | {k} | {nb:.0f} | {nb / _bytes_per_token(H, 'float32'):.3f}x | "
                f"{nb / _bytes_per_token(H, 'bfloat16'):.3f}x | {med[k]:.3f} "
                f"[{min(times[k]):.3f}] | {med[k] / med['float32']:.2f}x | "
                f"{med[k] / med['bfloat16']:.2f}x | {err} | {agree} |")
    lines += ["", f"Load average at start / end: {load0:.1f} / {os.getloadavg()[0]:.1f}."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--fill", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true",
                    help="smaller defaults: fill 512, 2 repeats of 5 steps, one accuracy seed "
                         "(--fill, --repeats, --steps given explicitly win)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.quick:
        ap.set_defaults(fill=512, repeats=2, steps=5)
        a = ap.parse_args(argv)
    text = report(a.head_dims, a.fill, a.steps, a.repeats, a.quick)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


def _fmt_acc(H: int, kind: str, quick: bool) -> tuple[str, str]:
    err, agree, top = _accuracy(H, kind, seeds=(0,) if quick else (0, 1, 2))
    return f"{err:.4f} (logits up to {top:.1f})", f"{agree * 100:.1f}%"


if __name__ == "__main__":
    main()
