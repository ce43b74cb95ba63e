"""Context parallelism layouts compared: work balance, bytes moved per layer and
per-device memory of the ring, Ulysses, all-gather and hybrid (USP) layouts, on ``P``
CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``, set here before JAX
starts). Nothing is timed: everything is read from the positions, the formulas and the
compiled programs.

Layouts (each inside ``jax.shard_map``, the sequence of q, k, v sharded, global
positions passed):

* ``ring``: :func:`jaxpos.parallel.ring_attention` over the ``P`` devices;
* ``ulysses``: :func:`jaxpos.parallel.ulysses_attention` (all-to-all to ``N / P`` heads
  of the whole sequence, chunked attention, all-to-all back);
* ``all_gather``: ``jax.lax.all_gather`` of k, v and their positions, then the chunked
  ``jaxpos.attention`` of the local queries against the whole sequence;
* ``hybrid``: USP, ``ulysses_attention(..., ring_axis=...)`` on a ``R x U`` mesh
  (Ulysses over ``U`` devices, the ring over ``R``; ``U = 4, R = 2`` at ``P = 8``).

Three tables:

1. **Visible tiles per device** (``block x block`` tiles of one head that a causal mask
   does not hide, counted from the positions as the tiles' classification does, times the
   heads the device computes) and their balance ``max / mean``, for contiguous and zigzag
   layouts. The slowest device sets the step time.
2. **Bytes each device sends per layer** (forward + backward of one attention layer),
   from a formula of the layout (below) and from the compiled HLO: every collective of the
   optimised SPMD program (``compiled.as_text()``), its operand bytes times the trip count
   of the loops around it, converted to bytes sent per device (collective-permute: the
   operand; all-to-all and reduce-scatter: ``(G - 1) / G`` of it; all-gather: ``G - 1``
   times it; all-reduce: ``2 (G - 1) / G`` of it, ``G`` the group size).
3. **Per-device temporary memory against P** at a fixed ``T``
   (``compiled.memory_analysis().temp_size_in_bytes`` of the forward + backward step).

Formulas (``b`` bytes per element, ``t = T / P`` local tokens, positions int32, ``N'``
the key/value heads that travel in Ulysses: ``N_kv`` repeated
``jaxpos.parallel.kv_head_repeats(N_kv, P)`` times):

* ring: ``P`` hops forward of the k/v block and its positions, ``P`` hops backward of the
  block, its positions and its dk/dv: ``P (2 t N_kv H b + 4 t) + P (4 t N_kv H b + 4 t)``;
* Ulysses: all-to-all of q, k, v and the output forward, of their gradients backward,
  ``(P - 1) / P`` of each shard leaves the device: ``2 (P - 1) / P t H b (2 N + 2 N')``,
  plus the all-gather of the positions ``(P - 1) 4 t`` (once: here q and k/v share one
  positions array, and XLA gathers it once);
* all-gather: k, v and positions gathered forward, dk and dv reduce-scattered backward:
  ``4 (P - 1) t N_kv H b + 4 (P - 1) t``;
* hybrid: Ulysses over ``U`` on ``t = T / P`` tokens plus the ring over ``R`` on blocks
  of ``T / R`` tokens and ``N' / U`` key/value heads.

Usage::

    python benchmarks/context_parallel.py           # the committed table (a few minutes)
    python benchmarks/context_parallel.py --tiny    # seconds; what the test runs

The table goes to ``benchmarks/results/context_parallel_cpu.md`` (``--output``).
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
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpos
from jaxpos.parallel import (
    kv_head_repeats,
    ring_attention,
    shard_map,
    ulysses_attention,
    zigzag_permutation,
)

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "context_parallel_cpu.md"
LAYOUTS = ("ring", "ulysses", "all_gather", "hybrid")
MiB = 2.0 ** 20
F32 = 4


class Shape(NamedTuple):
    B: int
    T: int
    N: int
    Nk: int
    H: int


def hybrid_split(P_: int, N: int) -> tuple[int, int]:
    """``(R, U)`` of the hybrid layout on ``P_`` devices: the largest ``U <= 4`` dividing
    both ``P_`` and ``N`` (Ulysses inside a node of 4), the ring over the rest."""
    U = max(u for u in (1, 2, 4) if P_ % u == 0 and N % u == 0)
    return P_ // U, U


# --------------------------------------------------------------------------- layouts
def _mesh(layout, P_, N):
    devs = np.array(jax.devices()[:P_])
    if layout == "hybrid":
        R, U = hybrid_split(P_, N)
        return Mesh(devs.reshape(R, U), ("ring", "uly")), ("ring", "uly")
    return Mesh(devs, ("seq",)), "seq"


def step_fn(layout, mesh, axes, N, block):
    """jit(value and grad of sum(out * g)) w.r.t. q, k, v for one layout, on global arrays."""
    scheme = jaxpos.ALiBi(num_heads=N)
    kw = dict(position=scheme, causal=True, block_q=block, block_k=block)
    seq = P(None, axes)

    if layout == "ring":
        def local(q, k, v, pos):
            return ring_attention(q, k, v, axis_name="seq", q_positions=pos, kv_positions=pos,
                                  **kw)
    elif layout == "ulysses":
        def local(q, k, v, pos):
            return ulysses_attention(q, k, v, axis_name="seq", q_positions=pos,
                                     kv_positions=pos, implementation="chunked", **kw)
    elif layout == "hybrid":
        def local(q, k, v, pos):
            return ulysses_attention(q, k, v, axis_name="uly", ring_axis="ring",
                                     q_positions=pos, kv_positions=pos, **kw)
    else:
        def local(q, k, v, pos):
            gather = lambda x, ax: jax.lax.all_gather(x, "seq", axis=ax, tiled=True)
            return jaxpos.attention(q, gather(k, 1), gather(v, 1), q_positions=pos,
                                    kv_positions=gather(pos, 0), implementation="chunked",
                                    **kw)

    attn = shard_map(local, mesh=mesh, in_specs=(seq, seq, seq, P(axes)), out_specs=seq)
    # the loss's value too: with the gradients alone a linear loss would not need the output
    return jax.jit(jax.value_and_grad(lambda q, k, v, g, pos: jnp.sum(attn(q, k, v, pos) * g),
                                      argnums=(0, 1, 2)))


def compile_step(layout, P_, s: Shape, block):
    mesh, axes = _mesh(layout, P_, s.N)
    put = lambda shape, spec: jax.device_put(jnp.zeros(shape, jnp.float32),
                                            NamedSharding(mesh, spec))
    seq = P(None, axes)
    args = (put((s.B, s.T, s.N, s.H), seq), put((s.B, s.T, s.Nk, s.H), seq),
            put((s.B, s.T, s.Nk, s.H), seq), put((s.B, s.T, s.N, s.H), seq),
            jax.device_put(jnp.arange(s.T, dtype=jnp.int32), NamedSharding(mesh, P(axes))))
    return step_fn(layout, mesh, axes, s.N, block).lower(*args).compile()


# --------------------------------------------------------------------- HLO collectives
_DTYPE_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2,
                "f16": 2, "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1}
_COLLECTIVES = ("collective-permute", "all-to-all", "all-gather", "reduce-scatter",
                "all-reduce")
_INSTR = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = (.*?) (" + "|".join(_COLLECTIVES)
                    + r")(?:-start)?\(")
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")


def _bytes_of(types: str) -> int:
    total = 0
    for dt, dims in _ARRAY.findall(types):
        total += _DTYPE_BYTES[dt] * int(np.prod([int(d) for d in dims.split(",") if d]))
    return total


def _group_size(line: str) -> int:
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if m:
        return int(m.group(2))
    # the mesh form: replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'} (groups over
    # the axes in braces)
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        sizes = {name: int(size) for name, size in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
        return int(np.prod([sizes[name] for name in re.findall(r"'([^']+)'", m.group(2))]))
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    return len(m.group(1).split(",")) if m else 1


def collective_bytes(hlo: str) -> dict[str, float]:
    """Bytes each device sends, per collective kind, in an optimised HLO module: every
    collective's result bytes (one device's share) times the trip counts of the while
    loops around it (``known_trip_count``), by the convention of the module docstring."""
    comps: dict[str, list[str]] = {}
    entry, cur = None, None
    for line in hlo.splitlines():
        m = re.match(r"^(ENTRY )?%([\w.\-]+) .*\{$", line)
        if m:
            cur = m.group(2)
            comps[cur] = []
            entry = cur if m.group(1) else entry
        elif cur is not None:
            comps[cur].append(line)
    out: dict[str, float] = {k: 0.0 for k in _COLLECTIVES}

    def visit(name, mult, depth=0):
        for line in comps.get(name, []):
            m = _INSTR.match(line)
            if m:
                nbytes, kind, g = _bytes_of(m.group(1)), m.group(2), _group_size(line)
                if kind == "all-gather":
                    nbytes = nbytes / g * (g - 1)  # the result is g shards
                elif kind in ("all-to-all", "reduce-scatter"):
                    nbytes = nbytes * (g - 1) / g * (g if kind == "reduce-scatter" else 1)
                elif kind == "all-reduce":
                    nbytes = nbytes * 2 * (g - 1) / g
                out[kind] += mult * nbytes
            if " while(" in line:
                body = re.search(r"body=%([\w.\-]+)", line)
                n = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                if body:
                    visit(body.group(1), mult * (int(n.group(1)) if n else 1), depth + 1)
            for called in re.findall(r"(?:branch_computations=\{|calls=|true_computation=|"
                                     r"false_computation=)([^}]*?)(?:[,}]\s|$)", line):
                for c in re.findall(r"%([\w.\-]+)", called):
                    if c in comps and depth < 20:
                        visit(c, mult, depth + 1)

    if entry is not None:
        visit(entry, 1.0)
    return out


def formula_bytes(layout: str, P_: int, s: Shape) -> float:
    """Bytes each device sends per layer (forward + backward), from the layout's formula
    (module docstring)."""
    B, T, N, Nk, H = s
    t, b = T / P_, F32

    def ring(R, tokens, heads):
        return R * (2 * B * tokens * heads * H * b + 4 * tokens) + \
            R * (4 * B * tokens * heads * H * b + 4 * tokens)

    def ulysses(U, tokens):
        nk = Nk * kv_head_repeats(Nk, U)
        return 2 * (U - 1) / U * B * tokens * H * b * (2 * N + 2 * nk) + (U - 1) * 4 * tokens

    if P_ == 1:
        return 0.0
    if layout == "ring":
        return ring(P_, t, Nk)
    if layout == "ulysses":
        return ulysses(P_, t)
    if layout == "all_gather":
        return 4 * (P_ - 1) * B * t * Nk * H * b + 4 * (P_ - 1) * t
    R, U = hybrid_split(P_, N)
    nk = Nk * kv_head_repeats(Nk, U)
    return ulysses(U, t) + (ring(R, T / R, nk / U) if R > 1 else 0.0)


# ----------------------------------------------------------------------- visible tiles
def visible_tiles(layout: str, P_: int, s: Shape, block: int, zigzag: bool) -> np.ndarray:
    """Visible causal ``block x block`` tiles each device computes (all its heads)."""
    T, N = s.T, s.N

    def live(pos_q, pos_k):
        q = pos_q.reshape(-1, block)
        k = pos_k.reshape(-1, block)
        return int(np.sum(k.min(axis=1)[None, :] <= q.max(axis=1)[:, None]))

    if layout in ("ring", "all_gather"):  # all-gather: the same queries, all keys at once
        pos = zigzag_permutation(T, P_) if zigzag else np.arange(T)
        shards = pos.reshape(P_, -1)
        return np.array([N * live(sh, pos) for sh in shards])
    if layout == "ulysses":  # every device: N / P heads of the whole (gathered) sequence
        pos = zigzag_permutation(T, P_) if zigzag else np.arange(T)
        return np.full(P_, N // P_ * live(pos, pos))
    R, U = hybrid_split(P_, N)
    pos = zigzag_permutation(T, R) if zigzag else np.arange(T)
    shards = pos.reshape(R, -1)
    return np.repeat([N // U * live(sh, pos) for sh in shards], U)


# ------------------------------------------------------------------------------ main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, nargs="+", default=[8, 2])
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--tiny", action="store_true", help="T = 512, H = 16, blocks of 16")
    ap.add_argument("--output", type=pathlib.Path, default=RESULTS)
    a = ap.parse_args(argv)
    if a.tiny:
        a.length, a.head_dim, a.block = 512, 16, 16
    ndev = a.devices
    if len(jax.devices()) < ndev:
        raise SystemExit(f"need {ndev} devices, have {len(jax.devices())} (XLA_FLAGS)")
    T, N, H = a.length, a.heads, a.head_dim
    block = min(a.block, T // (2 * ndev))
    s0 = Shape(1, T, N, a.kv_heads[0], H)
    R8, U8 = hybrid_split(ndev, N)
    lines = [f"# Context parallelism on {ndev} CPU devices: balance, bytes moved, memory", "",
             (f"Generated by `python benchmarks/context_parallel.py{' --tiny' if a.tiny else ''}`"
              f" on {datetime.date.today().isoformat()}, {platform.machine()}, "
              f"JAX {jax.__version__}. Causal ALiBi, B=1, T={T}, N={N}, H={H}, float32, "
              f"chunked tiles {block} x {block}; hybrid = Ulysses over U={U8} x ring over "
              f"R={R8} at P={ndev}. Nothing is timed (the {ndev} devices share the host's "
              f"cores): tiles are counted from the positions, bytes read from the "
              f"formulas and the compiled HLO, memory from `compiled.memory_analysis()`."),
             "", f"## Visible tiles per device (causal, P = {ndev}, all heads)", "",
             "| layout | order | per device | max / mean |", "|---|---|---|---|"]
    balance = {}
    for layout in LAYOUTS:
        for zz in (False, True):
            tiles = visible_tiles(layout, ndev, s0, block, zz)
            balance[(layout, zz)] = tiles.max() / tiles.mean()
            lines.append(f"| {layout} | {'zigzag' if zz else 'contiguous'} | "
                         f"{', '.join(map(str, tiles))} | {balance[(layout, zz)]:.2f} |")

    compiled = {}
    lines += ["", f"## Bytes each device sends per layer (forward + backward, P = {ndev})", "",
              ("Formula: the layout's (module docstring). HLO: the compiled program's "
               "collectives (operand bytes x loop trip counts, as bytes sent per device; "
               "by kind). MiB."), "",
              "| N_kv | layout | formula | HLO | HLO / formula | HLO by kind |",
              "|---|---|---|---|---|---|"]
    for nk in a.kv_heads:
        s = Shape(1, T, N, nk, H)
        for layout in LAYOUTS:
            c = compile_step(layout, ndev, s, block)
            if nk == a.kv_heads[0]:
                compiled[(layout, ndev)] = c
            hlo = collective_bytes(c.as_text())
            got, want = sum(hlo.values()), formula_bytes(layout, ndev, s)
            kinds = ", ".join(f"{k} {v / MiB:.2f}" for k, v in hlo.items() if v)
            lines.append(f"| {nk} | {layout} | {want / MiB:.2f} | {got / MiB:.2f} | "
                         f"{got / want:.3f} | {kinds} |")
            print(lines[-1], flush=True)

    lines += ["", f"## Per-device temporary memory against P (T = {T}, N_kv = {s0.Nk}, "
              "forward + backward)", "",
              "MiB; `x P` is temp x P / temp(P = 1): 1.00 when the memory falls as 1/P.", "",
              "| P | " + " | ".join(f"{la} temp | {la} x P" for la in LAYOUTS) + " |",
              "|---|" + "---|---|" * len(LAYOUTS)]
    base = {}
    for p in [d for d in (1, 2, 4, 8) if d <= ndev]:
        row = [str(p)]
        for layout in LAYOUTS:
            c = compiled.get((layout, p)) or compile_step(layout, p, s0,
                                                          min(a.block, T // (2 * p)))
            temp = c.memory_analysis().temp_size_in_bytes
            base.setdefault(layout, temp)
            row += [f"{temp / MiB:.2f}", f"{temp * p / base[layout]:.2f}"]
        lines.append("| " + " | ".join(row) + " |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(text)
    return balance


if __name__ == "__main__":
    main()
