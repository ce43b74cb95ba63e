"""Per-device memory and step time of ring attention against the all-gather layout, on
``P`` CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``, set here
before JAX starts).

Both layouts shard the sequence of q, k and v over a ``seq`` mesh axis inside
``jax.shard_map`` and pass global positions:

* ``ring``: :func:`jaxpos.parallel.ring_attention` (k/v blocks travel around the ring);
  ``ring_zigzag`` is the same on the zigzag layout (:func:`jaxpos.parallel.to_zigzag`);
* ``all_gather``: ``jax.lax.all_gather`` of k, v and their positions, then
  ``jaxpos.attention(..., implementation="chunked")`` of the local queries against the
  whole sequence (the sequence-parallel layout of tests/parallel/_sharding_worker.py).

One step is forward + backward: the gradients of ``sum(out * g)`` with respect to q, k and
v, under ``jax.jit``. Memory is read from the compiled executable, without running it:
``compiled.memory_analysis()`` of the SPMD program, i.e. per device: ``argument`` (the
local q, k, v, g and positions), ``output`` (the local gradients) and ``temp`` (every
intermediate buffer, the all-gathered or in-flight k/v included) bytes; ``peak`` is their
sum (an upper bound: XLA may reuse argument buffers). Step time is the median of
``--repeats`` runs after one warm-up, round-robin over the layouts; on a CPU the ``P``
"devices" share the host's cores, so times compare the layouts' total work and how
evenly it keeps the cores busy, not a real cluster's wall clock.

Also printed: per-device memory of the ring over ``P = 1, 2, 4, 8`` at a fixed ``T``
(``--p-sweep-length``), and the causal work per device (visible ``block x block`` tiles,
counted from the positions as the ring's tile classification does) for the contiguous
and zigzag layouts.

Shapes: B=1, N=4 query heads, N_kv=2, H=32, float32, causal, ALiBi (a score_mod),
T = 8k..64k (``--lengths``); step time up to ``--time-max-length``.

Usage::

    python benchmarks/ring_attention_memory.py             # the table (a few minutes)
    python benchmarks/ring_attention_memory.py --tiny      # seconds; what the test runs

The table goes to ``benchmarks/results/ring_attention_cpu.md`` (``--output``).
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import datetime
import pathlib
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpos
from jaxpos.parallel import ring_attention, shard_map, zigzag_permutation

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "ring_attention_cpu.md"
LAYOUTS = ("ring", "ring_zigzag", "all_gather")
MiB = 2.0 ** 20


def _step_fn(layout, mesh, N, block):
    """jit(grad of sum(out * g)) w.r.t. q, k, v for one layout, on global arrays."""
    scheme = jaxpos.ALiBi(num_heads=N)
    seq = P(None, "seq")

    if layout.startswith("ring"):
        def local(q, k, v, pos):
            return ring_attention(q, k, v, axis_name="seq", position=scheme, q_positions=pos,
                                  kv_positions=pos, causal=True, block_q=block, block_k=block)
    else:
        def local(q, k, v, pos):
            gather = lambda x, ax: jax.lax.all_gather(x, "seq", axis=ax, tiled=True)
            return jaxpos.attention(q, gather(k, 1), gather(v, 1), position=scheme,
                                    q_positions=pos, kv_positions=gather(pos, 0), causal=True,
                                    implementation="chunked", block_q=block, block_k=block)

    attn = shard_map(local, mesh=mesh, in_specs=(seq, seq, seq, P("seq")), out_specs=seq)

    def loss(q, k, v, g, pos):
        return jnp.sum(attn(q, k, v, pos) * g)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _inputs(mesh, B, T, N, Nk, H, layout, ndev):
    r = np.random.default_rng(0)
    f = lambda *s: r.standard_normal(s, dtype=np.float32)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    seq = P(None, "seq")
    pos = zigzag_permutation(T, ndev) if layout == "ring_zigzag" else np.arange(T, dtype=np.int32)
    # (the zigzag layout reorders the tokens; random data needs no reordering)
    return (put(f(B, T, N, H), seq), put(f(B, T, Nk, H), seq), put(f(B, T, Nk, H), seq),
            put(f(B, T, N, H), seq), put(pos, P("seq")))


def measure(layout, ndev, B, T, N, Nk, H, block):
    """Compile one layout's step; its memory row and ``(compiled, args)`` to time."""
    mesh = Mesh(np.array(jax.devices()[:ndev]), ("seq",))
    fn = _step_fn(layout, mesh, N, block)
    args = _inputs(mesh, B, T, N, Nk, H, layout, ndev)
    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    ma = compiled.memory_analysis()
    row = {"arg": ma.argument_size_in_bytes, "out": ma.output_size_in_bytes,
           "temp": ma.temp_size_in_bytes, "compile_s": compile_s, "step_s": None}
    row["peak"] = row["arg"] + row["out"] + row["temp"]
    return row, (compiled, args)


def time_round_robin(runs, repeats):
    """Median step time of each ``(compiled, args)``, one warm-up each, then the repeats
    taken round-robin so that a shared machine's load falls on every layout alike."""
    for compiled, args in runs.values():
        jax.block_until_ready(compiled(*args))
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, (compiled, args) in runs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def causal_tiles(T, ndev, block, zigzag):
    """Visible ``block x block`` tiles per device under a causal mask (a tile is computed
    when its smallest key position is <= its largest query position)."""
    pos = zigzag_permutation(T, ndev) if zigzag else np.arange(T)
    tiles = pos.reshape(T // block, block)
    lo, hi = tiles.min(axis=1), tiles.max(axis=1)
    live = lo[None, :] <= hi[:, None]  # [query tile, key tile]
    per_dev = live.reshape(ndev, -1, T // block).sum(axis=(1, 2))
    return per_dev


def _fmt_mib(x):
    return f"{x / MiB:.2f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    ap.add_argument("--time-max-length", type=int, default=16384,
                    help="time the step only up to this T (memory for every T)")
    ap.add_argument("--p-sweep-length", type=int, default=32768)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="T = 256, 512; blocks of 16")
    ap.add_argument("--output", type=pathlib.Path, default=RESULTS)
    a = ap.parse_args(argv)
    if a.tiny:
        a.lengths, a.time_max_length, a.p_sweep_length = [256, 512], 512, 512
        a.block, a.repeats = 16, 1
    ndev = a.devices
    if len(jax.devices()) < ndev:
        raise SystemExit(f"need {ndev} devices, have {len(jax.devices())} (XLA_FLAGS)")
    B, N, Nk, H = a.batch, a.heads, a.kv_heads, a.head_dim
    kv_bytes = lambda T: 2 * B * T * Nk * H * 4  # k and v, float32

    lines = [f"# Ring attention vs all-gather: per-device memory and step time (CPU, P = {ndev})",
             "",
             (f"Generated by `python benchmarks/ring_attention_memory.py"
              f"{' --tiny' if a.tiny else ''}` "
              f"on {datetime.date.today().isoformat()}, {platform.machine()} "
              f"({os.cpu_count()} cores shared by the {ndev} host devices), "
              f"JAX {jax.__version__}."),
             "",
             (f"Causal ALiBi, B={B}, N={N}, N_kv={Nk}, H={H}, float32, chunked tiles "
              f"{a.block} x {a.block}; one step = forward + backward (gradients of q, k, v). "
              "Memory per device from `compiled.memory_analysis()` (arguments + outputs + "
              "temporaries, MiB); `k/v global` is the size of the whole sequence's k and v, "
              "`k/v local` one device's shard. Times: median of "
              f"{a.repeats} steps per layout after a warm-up, taken round-robin over the "
              f"layouts on a shared machine; the {ndev} devices share the CPU cores, so a "
              "step's time is its total work, stretched when some ring steps keep fewer "
              "devices busy than there are cores (causal attention on contiguous shards; see "
              "the last table)."),
             "",
             ("| T | k/v global | k/v local | layout | args | outputs | temp | peak | "
              "peak vs all_gather | step s | step vs all_gather |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    results = {}
    for T in a.lengths:
        runs = {}
        for layout in LAYOUTS:
            row, runs[layout] = measure(layout, ndev, B, T, N, Nk, H,
                                        min(a.block, T // (2 * ndev)))
            results[(T, layout)] = row
        if T <= a.time_max_length:
            for layout, t in time_round_robin(runs, a.repeats).items():
                results[(T, layout)]["step_s"] = t
        del runs
        for layout in LAYOUTS:
            row = results[(T, layout)]
            print(f"T={T} {layout}: peak {_fmt_mib(row['peak'])} MiB (temp "
                  f"{_fmt_mib(row['temp'])}), step {row['step_s']}", flush=True)
        ag = results[(T, "all_gather")]
        for layout in LAYOUTS:
            row = results[(T, layout)]
            step = "n/a (memory only)" if row["step_s"] is None else f"{row['step_s']:.2f}"
            ratio_s = ("" if row["step_s"] is None or ag["step_s"] is None
                       else f"{row['step_s'] / ag['step_s']:.2f}")
            lines.append(
                f"| {T} | {_fmt_mib(kv_bytes(T))} | {_fmt_mib(kv_bytes(T) / ndev)} | {layout} | "
                f"{_fmt_mib(row['arg'])} | {_fmt_mib(row['out'])} | {_fmt_mib(row['temp'])} | "
                f"{_fmt_mib(row['peak'])} | {row['peak'] / ag['peak']:.3f} | {step} | {ratio_s} |")

    # P sweep at a fixed length: the ring's memory per device falls as 1/P
    Ts = a.p_sweep_length
    lines += ["", f"## Ring memory per device against P (T = {Ts}, forward + backward)", "",
              ("| P | k/v local | ring args | ring temp | ring peak | peak x P / peak(P=1) | "
               "all_gather temp |"), "|---|---|---|---|---|---|---|"]
    base, sweep = None, []
    for p in [d for d in (1, 2, 4, 8) if d <= ndev]:
        blk = min(a.block, Ts // (2 * p))
        ring, _ = measure("ring", p, B, Ts, N, Nk, H, blk)
        ag, _ = measure("all_gather", p, B, Ts, N, Nk, H, blk)
        base = base or ring["peak"]
        lines.append(f"| {p} | {_fmt_mib(kv_bytes(Ts) / p)} | {_fmt_mib(ring['arg'])} | "
                     f"{_fmt_mib(ring['temp'])} | {_fmt_mib(ring['peak'])} | "
                     f"{ring['peak'] * p / base:.2f} | {_fmt_mib(ag['temp'])} |")
        print(f"P={p}: ring peak {_fmt_mib(ring['peak'])} MiB, all_gather temp "
              f"{_fmt_mib(ag['temp'])} MiB", flush=True)
        sweep.append((p, ring["peak"]))
    if len(sweep) >= 2:  # least squares: peak = fixed + per_sequence / P
        ps = np.array([p for p, _ in sweep], float)
        peaks = np.array([x for _, x in sweep], float) / MiB
        (fixed, per_seq), *_ = np.linalg.lstsq(np.stack([np.ones_like(ps), 1 / ps], 1), peaks,
                                               rcond=None)
        worst = np.max(np.abs(fixed + per_seq / ps - peaks) / peaks)
        lines += ["", (f"Fit: ring peak per device = {fixed:.1f} MiB + {per_seq:.1f} MiB / P "
                       f"(largest relative residual {worst:.1%}): everything that grows with "
                       f"the sequence falls as 1/P; the constant is the tiles' scores and "
                       f"their gradients ({a.block} x {a.block} x N floats each).")]

    # causal work balance
    Tw, blk = a.lengths[-1], min(a.block, a.lengths[-1] // (2 * ndev))
    cont, zz = causal_tiles(Tw, ndev, blk, False), causal_tiles(Tw, ndev, blk, True)
    lines += ["", f"## Causal work per device (T = {Tw}, P = {ndev}, {blk} x {blk} tiles)", "",
              ("Visible tiles each device computes (hidden ones are skipped); the slowest "
               "device sets a real cluster's step time."), "",
              "| layout | per device | max / mean |", "|---|---|---|",
              f"| contiguous | {', '.join(map(str, cont))} | {cont.max() / cont.mean():.2f} |",
              f"| zigzag | {', '.join(map(str, zz))} | {zz.max() / zz.mean():.2f} |"]
    text = "\n".join(lines) + "\n"
    print(text)
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(text)
    return results


if __name__ == "__main__":
    main()
