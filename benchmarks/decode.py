"""Decode cost per token against the filled length and ``max_len``, per position scheme.

One attention layer of the modules (:class:`jaxpos.nnx.MultiHeadAttention`, ``d_model``
256, 8 query heads, 2 KV heads, head_dim 32, batch 1) decodes one token per step against a
KV cache filled to ``L`` tokens (1k .. 32k), jitted with the cache donated (updated in
place, as generation runs). The baseline, measured in the same run, is plain JAX with the
same shapes: the same projections, the new key rotated once and written into a cache that
holds exactly the filled tokens (pre-rotated keys), ``jax.nn.dot_product_attention`` over
it, the output projection. Each configuration runs ``--steps`` steps per measurement;
measurements go round-robin over every configuration ``--repeats`` times and the table
gives medians, then minima (the machine is shared: a round-robin spreads its load over
every row; the minimum is the run least disturbed by other processes).

Rows: ``none`` (NoPE), ``rope`` (keys rotated at write), ``rope_dynamic_exact`` (dynamic
NTK, raw keys rotated on load with the current length's base, ``rope_cache_rotation=
"read"``), ``alibi``, ``t5``; each at ``max_len = L + slack`` and, for the cost-follows-
fill check, a 32k cache filled to 1k. PaTH (whose decode step moves every cached key by
the new token's transform) has its own cost-follows-fill row: a cache of ``--path-max-len``
slots (8192) filled to ``--path-fill`` (512) against one of ``--path-fill`` + slack, in the
same round-robin (``--path-only``: that row alone).

Usage::

    python benchmarks/decode.py                      # CPU defaults, about 3-5 minutes
    python benchmarks/decode.py --lengths 1024 4096 --repeats 3 --out /tmp/decode.md
    python benchmarks/decode.py --path-only               # the PaTH row, about 30 s

Prints (and with ``--out`` writes) a Markdown table of ms per token and the ratios the
decode goals are stated in: each scheme / the baseline at each length, RoPE / NoPE, and
a 32k cache filled to 1k / a 1k cache.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpos.layers.cache import KVCache, SchemeStateCache
from jaxpos.nnx import MultiHeadAttention
from jaxpos.schemes.rope import apply_rope
from jaxpos.schemes.rope.scaling import DynamicNTKScaling, default_inv_freq

D, N, NK, H, B = 256, 8, 2, 32, 1
SCHEMES = {
    "none": ("nope", {}),
    "rope": ("rope", {}),
    "rope_dynamic_exact": ("rope", {"rope_scaling": DynamicNTKScaling(
        factor=8.0, original_max_position_embeddings=4096), "rope_cache_rotation": "read"}),
    "alibi": ("alibi", {}),
    "t5": ("t5", {}),
}


def filled_cache(L: int, max_len: int, seed: int) -> KVCache:
    """A cache of ``max_len`` slots holding ``L`` tokens (random keys and values)."""
    rng = np.random.default_rng(seed)
    k = np.zeros((B, max_len, NK, H), np.float32)
    v = np.zeros((B, max_len, NK, H), np.float32)
    k[:, :L] = rng.normal(size=(B, L, NK, H))
    v[:, :L] = rng.normal(size=(B, L, NK, H))
    pos = np.zeros((B, max_len), np.int32)
    pos[:, :L] = np.arange(L)
    valid = (np.arange(max_len) < L).astype(np.int32)[None].repeat(B, 0)
    n = np.full((B,), L, np.int32)
    return KVCache(jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos), jnp.asarray(n),
                   jnp.asarray(valid), jnp.asarray(n.copy()))


def jaxpos_case(scheme: str, L: int, max_len: int):
    position, opts = SCHEMES[scheme]
    mha = MultiHeadAttention(D, N, num_kv_heads=NK, position=position, causal=True,
                             scheme_options=opts or None, rngs=nnx.Rngs(0))
    graph, state = nnx.split(mha)

    def step(state, x, cache):
        return nnx.merge(graph, state).decode(x, cache)

    fn = jax.jit(step, donate_argnums=(2,))
    return fn, state, filled_cache(L, max_len, 1)


def path_case(L: int, max_len: int):
    """A PaTH layer (``position="path"``) and its cache of ``max_len`` slots holding ``L``
    tokens (random keys, values; the convolution's tail zeros)."""
    mha = MultiHeadAttention(D, N, num_kv_heads=NK, position="path", causal=True,
                             scheme_options={"num_kv_heads": NK}, rngs=nnx.Rngs(0))
    empty = mha.init_cache(B, max_len)
    assert isinstance(empty, SchemeStateCache)
    graph, state = nnx.split(mha)

    def step(state, x, cache):
        return nnx.merge(graph, state).decode(x, cache)

    fn = jax.jit(step, donate_argnums=(2,))
    return fn, state, SchemeStateCache(filled_cache(L, max_len, 1), empty.state, "path")


def baseline_case(L: int, slack: int):
    """Plain JAX, same shapes: projections, the new token's q/k rotated, its k/v written
    into a cache of pre-rotated keys at its fill count, dot_product_attention over the
    filled cache (a cache exactly as long as what it holds), output projection."""
    rng = np.random.default_rng(0)
    w = {n: jnp.asarray(rng.normal(size=s) / np.sqrt(s[0]), jnp.float32)
         for n, s in (("q", (D, N * H)), ("k", (D, NK * H)), ("v", (D, NK * H)),
                      ("o", (N * H, D)))}
    inv_freq = jnp.asarray(default_inv_freq(H, 10000.0), jnp.float32)

    def step(w, x, cache):
        k_c, v_c, n = cache
        pos = n[None, None]
        q = apply_rope((x @ w["q"]).reshape(B, 1, N, H), pos, inv_freq)
        k = apply_rope((x @ w["k"]).reshape(B, 1, NK, H), pos, inv_freq)
        v = (x @ w["v"]).reshape(B, 1, NK, H)
        k_c = jax.lax.dynamic_update_slice_in_dim(k_c, k, n, axis=1)
        v_c = jax.lax.dynamic_update_slice_in_dim(v_c, v, n, axis=1)
        o = jax.nn.dot_product_attention(q, k_c[:, :L], v_c[:, :L])
        return o.reshape(B, 1, N * H) @ w["o"], (k_c, v_c, n + 1)

    # the new tokens overwrite the last slots of the filled L (the attended length stays L)
    c = filled_cache(L, L, 2)
    fn = jax.jit(step, donate_argnums=(2,))
    return fn, w, (c.k, c.v, jnp.asarray(L - slack, jnp.int32))


def run(lengths, repeats: int, steps: int, big: int, path_fill: int, path_big: int,
        path_only: bool = False):
    slack = repeats * steps + 8
    cases = {}
    if not path_only:
        for L in lengths:
            cases[("baseline", L, "fill")] = baseline_case(L, slack)
            for s in SCHEMES:
                cases[(s, L, "fill")] = jaxpos_case(s, L, L + slack)
        small = lengths[0]
        for s in SCHEMES:
            cases[(s, small, "big")] = jaxpos_case(s, small, big)
    cases[("path", path_fill, "fill")] = path_case(path_fill, path_fill + slack)
    cases[("path", path_fill, "big")] = path_case(path_fill, path_big)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(B, 1, D)), jnp.float32)
    state = {}
    t0 = time.perf_counter()
    for key, (fn, params, cache) in cases.items():  # compile + warm up
        y, cache = fn(params, x, cache)
        y.block_until_ready()
        state[key] = cache
    compile_s = time.perf_counter() - t0
    times = {key: [] for key in cases}
    for _ in range(repeats):
        for key, (fn, params, _) in cases.items():
            cache = state[key]
            t = time.perf_counter()
            for _ in range(steps):
                y, cache = fn(params, x, cache)
            y.block_until_ready()
            times[key].append((time.perf_counter() - t) / steps * 1e3)
            state[key] = cache
    return ({k: float(np.median(v)) for k, v in times.items()},
            {k: float(np.min(v)) for k, v in times.items()}, compile_s)


def path_table(med, path_fill, path_big, repeats, steps, slack, stat="median") -> str:
    """The PaTH cost-follows-fill row."""
    small, large = med[("path", path_fill, "fill")], med[("path", path_fill, "big")]
    return "\n".join([
        f"PaTH decode step, ms per token ({stat}), a cache filled to {path_fill} (growing by "
        f"{repeats * steps} over the run):", "",
        f"| max_len {path_fill + slack} | max_len {path_big} | ratio (goal <= 1.5) |",
        "|---|---|---|", f"| {small:.3f} | {large:.3f} | {large / small:.2f} |"]) + "\n"


def table(med, lengths, big, repeats, steps, compile_s, wall_s, stat="median") -> str:
    out = [f"Decode, ms per token ({stat} of {repeats} round-robin measurements of {steps} "
           f"steps; one MultiHeadAttention layer, d_model {D}, {N} heads, {NK} KV heads, "
           f"head_dim {H}, batch {B}; jax {jax.__version__}, {jax.default_backend()}, "
           f"{platform.machine()}; compile {compile_s:.0f} s, run {wall_s:.0f} s).", ""]
    hdr = "| scheme | " + " | ".join(f"L={L}" for L in lengths) + \
        f" | max_len {big}, L={lengths[0]} |"
    out += [hdr, "|" + "---|" * (len(lengths) + 2)]
    def at(s, L):
        return med[(s, L, "fill")]

    for s in ["baseline"] + list(SCHEMES):
        cells = [f"{at(s, L):.2f}" for L in lengths]
        big_cell = "" if s == "baseline" else f"{med[(s, lengths[0], 'big')]:.2f}"
        out.append(f"| {s} | " + " | ".join(cells) + f" | {big_cell} |")

    out += ["", "Ratios (goal in brackets):", "",
            "| ratio | " + " | ".join(f"L={L}" for L in lengths) + " |",
            "|" + "---|" * (len(lengths) + 1)]
    for s in SCHEMES:
        out.append(f"| {s} / baseline (<= 1.2) | " +
                   " | ".join(f"{at(s, L) / at('baseline', L):.2f}" for L in lengths) + " |")
    out.append("| rope / none (<= 1.1) | " +
               " | ".join(f"{at('rope', L) / at('none', L):.2f}" for L in lengths) + " |")
    out += ["", f"Cost follows the fill (max_len {big} filled to {lengths[0]} / a cache of "
            f"{lengths[0]} + slack, goal <= 1.2):", ""]
    for s in SCHEMES:
        out.append(f"* {s}: {med[(s, lengths[0], 'big')] / at(s, lengths[0]):.2f}")
    return "\n".join(out) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    p.add_argument("--max-len", type=int, default=32768, dest="big",
                   help="the large cache filled to the first length")
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--path-fill", type=int, default=512, dest="path_fill",
                   help="the filled length of the PaTH row")
    p.add_argument("--path-max-len", type=int, default=8192, dest="path_big",
                   help="the large cache of the PaTH row")
    p.add_argument("--path-only", action="store_true", dest="path_only",
                   help="measure the PaTH row alone")
    p.add_argument("--out", default=None, help="also write the table to this file")
    a = p.parse_args(argv)
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    med, best, compile_s = run(a.lengths, a.repeats, a.steps, a.big, a.path_fill, a.path_big,
                               a.path_only)
    print(json.dumps({"/".join(map(str, k)): round(v, 4) for k, v in med.items()}),
          file=sys.stderr)
    wall = time.perf_counter() - t0
    load1 = os.getloadavg()
    slack = a.repeats * a.steps + 8
    text = (f"Load average (1, 5, 15 min) at the start {load0[0]:.1f}, {load0[1]:.1f}, "
            f"{load0[2]:.1f}; at the end {load1[0]:.1f}, {load1[1]:.1f}, {load1[2]:.1f}; "
            f"{os.cpu_count()} CPUs.\n\n")
    if a.path_only:
        text += (f"{a.repeats} round-robin measurements of {a.steps} steps; jax "
                 f"{jax.__version__}, {jax.default_backend()}; compile {compile_s:.0f} s, run "
                 f"{wall:.0f} s.\n\n")
    else:
        text += table(med, a.lengths, a.big, a.repeats, a.steps, compile_s, wall) + "\n" + \
            table(best, a.lengths, a.big, a.repeats, a.steps, compile_s, wall, stat="minimum")
        text += "\n"
    text += path_table(med, a.path_fill, a.path_big, a.repeats, a.steps, slack) + "\n" + \
        path_table(best, a.path_fill, a.path_big, a.repeats, a.steps, slack, stat="minimum")
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
