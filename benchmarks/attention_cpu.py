"""CPU speed and memory of causal ALiBi and T5 attention: jaxpos ``"reference"`` and
``"chunked"`` against ``jax.nn.dot_product_attention`` with a materialised bias and,
when PyTorch is importable, ``torch.nn.functional.scaled_dot_product_attention`` with a
float mask and FlexAttention (compiled) with the same score function.

Shapes: B=1, N=8 heads, H=64, float32, causal, T from 1k to 16k (``--lengths``).
Every implementation is timed side by side in one process, round-robin over the
repeats, so that a noisy (shared) machine affects them alike; the table reports medians
and the ratio to ``chunked`` of the same row. Forward (``fwd``) and forward+backward
(``fwd+bwd``: gradients of ``sum(out * g)`` with respect to q, k and v).

``chunked_mod`` is the chunked path given the same score term as a user-written
``score_mod`` (``position=None``): its ``x chunked`` column is the cost of programmable
attention against the built-in scheme. For T5 it computes the bucket per score;
``chunked_mod_vec`` instead gathers from a per-head vector over clipped offsets built once
per call, as the built-in T5 does (for ALiBi the two are the same function).

Memory: for the JAX implementations, the compiled program's temporary buffer size
(``jax.jit(f).lower(...).compile().memory_analysis().temp_size_in_bytes``), which needs
no execution, so ``--memory-lengths`` can go to T = 32768 cheaply. PyTorch memory is
not measured (n/a).

Usage::

    python benchmarks/attention_cpu.py                      # full table (minutes)
    python benchmarks/attention_cpu.py --quick              # T = 1024, 4096; 3 repeats
    python benchmarks/attention_cpu.py --lengths 4096 --schemes alibi --modes fwd
    python benchmarks/attention_cpu.py --tiny --no-torch    # seconds; what the test runs

The table goes to ``benchmarks/results/attention_cpu.md`` (``--output``).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import pathlib
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxpos

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "attention_cpu.md"
JAX_IMPLS = ("chunked", "chunked_mod", "chunked_mod_vec", "reference", "jax_dpa")
TORCH_IMPLS = ("torch_sdpa", "torch_flex")


# ------------------------------------------------------------------------------- JAX
def _scheme(name, N, key):
    if name == "alibi":
        return jaxpos.ALiBi(num_heads=N)
    return jaxpos.T5Bias(0.1 * jax.random.normal(key, (32, N), jnp.float32), bidirectional=False)


def _dense_bias(scheme, T):
    pos = jnp.arange(T, dtype=jnp.int32)
    if isinstance(scheme, jaxpos.ALiBi):
        return jaxpos.alibi_bias(pos, pos, scheme.slopes)[None]
    return jaxpos.t5_bias(pos, pos, scheme.table, bidirectional=False)[None]


def _user_score_mod(scheme, vector=False):
    """The scheme's score term written by a user as a score_mod, FlexAttention style. T5:
    the bucket computed per score (``vector=False``, a logarithm per score), or a gather
    from the per-head vector over clipped offsets computed once per call (``vector=True``,
    what the built-in does and what the torch_flex row does)."""
    if isinstance(scheme, jaxpos.ALiBi):
        slopes = scheme.slopes
        return lambda s, b, h, qp, kp: s + slopes[h] * (kp - qp).astype(jnp.float32)
    table = scheme.table
    if not vector:
        return lambda s, b, h, qp, kp: s + table[jaxpos.t5_bucket(kp - qp, False), h]
    R = 128
    rel = jnp.arange(-R, R + 1)
    vec = table[jaxpos.t5_bucket(rel, False)].T  # [N, 2R + 1]
    return lambda s, b, h, qp, kp: s + vec[h][jnp.clip(kp - qp, -R, R) + R]


@functools.cache
def _jax_fn(impl, mode, block_q, block_k):
    def fwd(q, k, v, scheme):
        if impl.startswith("chunked_mod"):  # the same scores through score_mod=, not position=
            mod = _user_score_mod(scheme, vector=impl.endswith("_vec"))
            return jaxpos.attention(q, k, v, score_mod=mod, causal=True,
                                    implementation="chunked", block_q=block_q, block_k=block_k)
        if impl == "jax_dpa":
            # The bias is materialised inside the program, as a user would build it.
            return jax.nn.dot_product_attention(q, k, v, bias=_dense_bias(scheme, q.shape[1]),
                                                is_causal=True)
        blocks = {"block_q": block_q, "block_k": block_k} if impl == "chunked" else {}
        return jaxpos.attention(q, k, v, position=scheme, causal=True, implementation=impl,
                                **blocks)

    if mode == "fwd":
        return jax.jit(fwd)

    def loss(q, k, v, scheme, g):
        return jnp.sum(fwd(q, k, v, scheme) * g)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _jax_case(impl, mode, name, T, B, N, H, block_q, block_k):
    ks = jax.random.split(jax.random.PRNGKey(T), 5)
    q, k, v, g = (jax.random.normal(kk, (B, T, N, H), jnp.float32) for kk in ks[:4])
    scheme = _scheme(name, N, ks[4])
    f = _jax_fn(impl, mode, block_q, block_k)
    args = (q, k, v, scheme) if mode == "fwd" else (q, k, v, scheme, g)
    compiled = f.lower(*args).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes if compiled.memory_analysis() else None
    run = lambda: jax.block_until_ready(compiled(*args))
    return run, temp


def jax_temp_bytes(impl, mode, name, T, B, N, H, block_q, block_k):
    """Temporary memory of the compiled program (no execution)."""
    spec = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
    scheme = _scheme(name, N, jax.random.PRNGKey(0))
    f = _jax_fn(impl, mode, block_q, block_k)
    args = (spec, spec, spec, scheme) if mode == "fwd" else (spec, spec, spec, scheme, spec)
    ma = f.lower(*args).compile().memory_analysis()
    return None if ma is None else ma.temp_size_in_bytes


# ----------------------------------------------------------------------------- torch
def _torch_case(impl, mode, name, T, B, N, H):
    import torch

    gen = torch.Generator().manual_seed(T)
    shape = (B, N, T, H)  # torch layout [B, N, T, H]
    q, k, v, g = (torch.randn(shape, generator=gen) for _ in range(4))
    slopes = torch.tensor(np.asarray(jaxpos.alibi_slopes(N)))
    table = 0.1 * torch.randn(32, N, generator=gen)
    need_grad = mode != "fwd"
    for x in (q, k, v):
        x.requires_grad_(need_grad)

    def t5_bucket(rel):  # T5's causal bucket (Raffel et al. 2020), in torch ops
        d = torch.clamp(-rel, min=0)
        large = 16 + (torch.log(torch.clamp(d, min=1).float() / 16) / np.log(128 / 16) * 16).to(
            torch.int64)
        return torch.where(d < 16, d, torch.clamp(large, max=31))

    if impl == "torch_sdpa":
        pos = torch.arange(T)
        rel = pos[None, :] - pos[:, None]
        bias = (slopes[:, None, None] * rel if name == "alibi"
                else table[t5_bucket(rel)].permute(2, 0, 1))
        mask = bias.masked_fill(rel > 0, float("-inf"))[None]

        def fwd():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    else:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if name == "alibi":
            def score_mod(score, b, h, q_idx, kv_idx):
                return score + slopes[h] * (kv_idx - q_idx)
        else:
            # Inductor cannot lower the bucket's logarithm inside score_mod (torch 2.13:
            # "'Tensor' object has no attribute 'get_dtype'"), so the score function reads
            # the bias by offset from a [N, 2T - 1] vector, as jaxpos's chunked path does.
            rel = torch.arange(-(T - 1), T)
            offset_bias = table[t5_bucket(rel)].T.contiguous()  # [N, 2T - 1]

            def score_mod(score, b, h, q_idx, kv_idx):
                return score + offset_bias[h, kv_idx - q_idx + (T - 1)]

        block_mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, T, T,
                                       device="cpu")
        flex = torch.compile(flex_attention)

        def fwd():
            return flex(q, k, v, score_mod=score_mod, block_mask=block_mask)

    if mode == "fwd":
        def run():
            with torch.no_grad():
                fwd()
    else:
        def run():
            out = fwd()
            torch.autograd.grad(out, (q, k, v), g)
    return run, None


# ------------------------------------------------------------------------------ main
def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--schemes", nargs="+", default=["alibi", "t5"], choices=["alibi", "t5"])
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    p.add_argument("--impls", nargs="+", default=list(JAX_IMPLS + TORCH_IMPLS),
                   choices=list(JAX_IMPLS + TORCH_IMPLS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-dense", type=int, default=4096,
                   help="largest T for the O(T^2)-memory implementations (reference, jax_dpa, "
                        "torch_sdpa)")
    p.add_argument("--max-torch-bwd", type=int, default=8192,
                   help="largest T for the torch backward passes")
    p.add_argument("--memory-lengths", type=int, nargs="*",
                   default=[1024, 2048, 4096, 8192, 16384, 32768],
                   help="T values for the compile-only JAX memory table (fwd+bwd)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-q", type=int, default=None)
    p.add_argument("--block-k", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="T = 1024 and 4096, 3 repeats")
    p.add_argument("--tiny", action="store_true", help="T = 128, 2 heads of 16; seconds")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--output", type=pathlib.Path, default=RESULTS)
    p.add_argument("--append", action="store_true",
                   help="append this run's table to --output instead of replacing it")
    a = p.parse_args(argv)
    if a.quick:
        a.lengths, a.repeats = [1024, 4096], 3
        a.memory_lengths = [4096, 16384, 32768]
    if a.tiny:
        a.lengths, a.repeats, a.heads, a.head_dim = [128], 1, 2, 16
        a.memory_lengths = [128]
        a.max_dense = 128
    if a.no_torch:
        a.impls = [i for i in a.impls if i not in TORCH_IMPLS]
    return a


def _torch_available():
    try:
        import torch  # noqa: F401
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
        return True
    except Exception:  # noqa: BLE001 (any import failure means "no torch")
        return False


def _load():
    try:
        return "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except OSError:
        return "n/a"


def main(argv=None):
    a = _parse(sys.argv[1:] if argv is None else argv)
    impls = list(a.impls)
    if any(i in TORCH_IMPLS for i in impls) and not _torch_available():
        print("torch not importable: skipping torch_sdpa and torch_flex")
        impls = [i for i in impls if i not in TORCH_IMPLS]
    B, N, H = a.batch, a.heads, a.head_dim
    load_before = _load()
    rows = []
    for name in a.schemes:
        for mode in a.modes:
            for T in a.lengths:
                cases = {}
                for impl in impls:
                    dense = impl in ("reference", "jax_dpa", "torch_sdpa")
                    if dense and T > a.max_dense:
                        continue
                    if impl in TORCH_IMPLS and mode != "fwd" and T > a.max_torch_bwd:
                        continue
                    if impl == "torch_flex" and mode != "fwd":
                        continue  # torch 2.13: "FlexAttention does not support backward on CPU"
                    try:
                        if impl in TORCH_IMPLS:
                            run, temp = _torch_case(impl, mode, name, T, B, N, H)
                        else:
                            run, temp = _jax_case(impl, mode, name, T, B, N, H,
                                                  a.block_q, a.block_k)
                        run()  # warm-up (and compilation for torch.compile)
                        cases[impl] = (run, temp)
                    except Exception as e:  # noqa: BLE001 (a failure is reported as a row)
                        print(f"{name} {mode} T={T} {impl}: failed: {type(e).__name__}: {e}")
                        rows.append({"scheme": name, "mode": mode, "T": T, "implementation": impl,
                                     "time_ms": None, "temp_mib": None,
                                     "error": type(e).__name__})
                times = {impl: [] for impl in cases}
                for _ in range(a.repeats):
                    for impl, (run, _) in cases.items():
                        t0 = time.perf_counter()
                        run()
                        times[impl].append(time.perf_counter() - t0)
                for impl, (_, temp) in cases.items():
                    ms = 1e3 * statistics.median(times[impl])
                    rows.append({"scheme": name, "mode": mode, "T": T, "implementation": impl,
                                     "time_ms": ms,
                                     "temp_mib": None if temp is None else temp / 2**20})
                    print(f"{name:5s} {mode:7s} T={T:6d} {impl:10s} {ms:10.1f} ms"
                          + ("" if temp is None else f"   temp {temp / 2**20:9.1f} MiB"),
                          flush=True)
    memory = []
    for T in a.memory_lengths:
        for impl in [i for i in ("chunked", "reference", "jax_dpa") if i in impls]:
            if impl != "chunked" and T > max(a.max_dense, 16384):
                continue  # the dense programs would still compile, but say nothing new
            temp = jax_temp_bytes(impl, "fwd+bwd", "alibi", T, B, N, H, a.block_q, a.block_k)
            memory.append({"T": T, "implementation": impl, "temp_mib": temp / 2**20})
            print(f"memory fwd+bwd alibi T={T:6d} {impl:10s} temp {temp / 2**20:10.1f} MiB",
                  flush=True)
    text = _table(rows, memory, a, argv, load_before, _load())
    a.output.parent.mkdir(parents=True, exist_ok=True)
    if a.append and a.output.exists():
        text = (a.output.read_text() + "\n"
                + text.replace("# Attention on CPU", "## Additional run", 1))
    a.output.write_text(text)
    print(f"wrote {a.output}")
    return rows


def _table(rows, memory, a, argv, load_before, load_after):
    cmd = "python benchmarks/attention_cpu.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    try:
        import torch
        tv = torch.__version__
    except Exception:  # noqa: BLE001 (version string only)
        tv = "not installed"
    lines = [
        "# Attention on CPU: time and memory",
        "",
        f"Command: `{cmd.strip()}`",
        "",
        (f"- Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
        f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}); "
        f"load average before {load_before}, after {load_after} (the machine is shared)."),
        (f"- jax {jax.__version__}, torch {tv}; B={a.batch}, N={a.heads}, H={a.head_dim}, "
        f"float32, causal; block sizes {a.block_q or 'default'} x {a.block_k or 'default'}."),
        (f"- Time: median of {a.repeats} runs, all implementations of a row group run "
        f"round-robin in one process; `x chunked` is time / chunked time (above 1: slower "
        f"than chunked)."),
        ("- Temp: compiled temporary buffers (`memory_analysis().temp_size_in_bytes`); "
        "inputs and outputs excluded; torch: n/a."),
        ("- `jax_dpa`: `jax.nn.dot_product_attention(q, k, v, bias=<[1, N, T, T] bias>, "
        "is_causal=True)`; `torch_sdpa`: `scaled_dot_product_attention` with a float "
        "`[1, N, T, T]` mask (bias, `-inf` above the diagonal); `torch_flex`: "
        "`torch.compile(flex_attention)` with the same score function as `score_mod` and a "
        "causal block mask (forward only: torch 2.13 has no FlexAttention backward on CPU). "
        "fwd+bwd: gradients with respect to q, k, v."),
        "",
        "| scheme | mode | T | implementation | time (ms) | x chunked | temp (MiB) |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    base = {(r["scheme"], r["mode"], r["T"]): r["time_ms"] for r in rows
            if r["implementation"] == "chunked" and r["time_ms"]}
    for r in rows:
        b = base.get((r["scheme"], r["mode"], r["T"]))
        t = "failed" if r["time_ms"] is None else f"{r['time_ms']:.1f}"
        ratio = f"{r['time_ms'] / b:.2f}" if (b and r["time_ms"]) else ""
        mem = "n/a" if r["temp_mib"] is None else f"{r['temp_mib']:.1f}"
        lines.append(f"| {r['scheme']} | {r['mode']} | {r['T']} | {r['implementation']} | "
                     f"{t} | {ratio} | {mem} |")
    if memory:
        lines += ["", ("Forward+backward temporary memory, causal ALiBi (compile only, no "
                  "execution):"), "", "| T | implementation | temp (MiB) |", "|---:|---|---:|"]
        lines += [f"| {m['T']} | {m['implementation']} | {m['temp_mib']:.1f} |" for m in memory]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
