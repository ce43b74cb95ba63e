"""Benchmark jaxpos attention on a CUDA GPU against what a GPU user would pick instead.

Bounded by ``--deadline`` (default 300 s, everything included). In order:

1. **Correctness** (stops the script on a failure): on a small shape, the compiled
   Pallas kernel through ``jaxpos.attention(implementation="pallas")`` and the cuDNN/XLA
   path (``jaxpos.kernels.attention_via_xla``) against ``implementation="reference"`` in
   float32, for every position variant: forward and the gradients of q, k, v and of the
   scheme's arrays, every kernel output first filled with NaN (so an unwritten element
   fails). Tolerance: bfloat16 inputs 3e-2 forward / 6e-2 gradients (relative to the
   largest gradient entry); float32 2e-3 / 4e-3.
2. **Speed**, bfloat16, causal, B=4 N=16 H=128 (the shape of the 2026-12-01 H200 table in
   docs/kernel.md), T=8192 first then
   ``--seqs``, forward and forward+backward (gradients of q, k, v), median of ``--reps``
   after a warm-up. Every bias array (ALiBi slopes, T5 table, dense biases) is a jit
   *argument*, never a captured constant (constants are folded at compile time: slow
   compiles and unrepresentative programs). Rows:

   * ``jaxpos.pallas``: the fused kernel, variants none, alibi, t5, rope, rope+alibi (RoPE
     applied to q and k before the kernel, as ``jaxpos.attention`` does);
   * ``jaxpos.core.xla``: ``attention_via_xla`` (cuDNN; the score term as a dense bias built
     from the slopes / table inside the call);
   * ``jaxpos.default``: ``jaxpos.attention(implementation=None)`` (what the dispatch rule
     picks; the pick is printed);
   * ``jax.cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")``, no bias;
     ``jax.cudnn+dense``: with a precomputed dense ``[1, N, T, T]`` bias argument;
     ``jax.xla+dense``: the same with ``implementation="xla"``;
   * ``jax.pallas_mha``: JAX's Pallas Triton attention (``ops/gpu/attention.py``), no bias;
   * ``torch.sdpa``, ``torch.flex``: PyTorch SDPA and FlexAttention with the same score
     function (when torch with CUDA is importable).

   Columns: ms, TFLOP/s (``4 B N T^2 H / 2`` causal forward; forward+backward counted as
   3.5x, as FlashAttention-2 does), ``/ pallas none`` (this row's TFLOP/s over the
   kernel's without position terms: the target is >= 0.85 for every variant) and
   ``/ cudnn dense`` (over cuDNN with a dense bias of the same variant: > 1 means the
   kernel wins).

Without a GPU it runs a tiny interpret-mode version (``--tiny``, the default on CPU) so
CI keeps the script working: the same code paths at B=1, N=2, H=16, T=64. Its timings
measure the Pallas interpreter on a CPU, not kernel speed.

Usage::

    python benchmarks/gpu_attention.py                 # GPU: full; CPU: tiny
    python benchmarks/gpu_attention.py --seqs 8192 2048 --deadline 300
    python benchmarks/gpu_attention.py --tiny --out /tmp/bench.md

Writes a Markdown table to ``benchmarks/results/gpu_attention_<device>.md`` (or
``--out``) and, when ``$OUT`` is set, JSON lines to ``$OUT/gpu_attention.jsonl``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxpos
from jaxpos.kernels import _testing as kernel_testing
from jaxpos.kernels import attention_via_xla, choose_implementation

VARIANTS = ("none", "alibi", "t5", "rope", "rope+alibi")
T0 = time.time()


def left(args):
    return args.deadline - (time.time() - T0)


def emit(args, **row):
    row["t"] = round(time.time() - T0, 1)
    print(json.dumps(row), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_attention.jsonl"), "a") as fh:
            fh.write(json.dumps(row) + "\n")


# ------------------------------------------------------------------- position variants
def make_params(N, H):
    """The arrays of every variant (jit arguments): ALiBi slopes, a T5 table, RoPE's
    inverse frequencies."""
    return {"slopes": jaxpos.alibi_slopes(N),
            "table": jax.random.normal(jax.random.PRNGKey(11), (32, N), jnp.float32) * 0.5,
            "inv_freq": jnp.asarray(1.0 / 10000.0 ** (np.arange(H // 2) / (H // 2)),
                                    jnp.float32)}


def schemes(variant, p):
    """``(transform, scheme)``: RoPE as a scheme applied to q and k, and the bias scheme."""
    rope = jaxpos.RoPE(p["inv_freq"]) if "rope" in variant else None
    if "alibi" in variant:
        bias = jaxpos.ALiBi(slopes=p["slopes"])
    elif variant == "t5":
        bias = jaxpos.T5Bias(p["table"], bidirectional=False)
    else:
        bias = None
    return rope, bias


def rotate(q, k, rope, T):
    if rope is None:
        return q, k
    pos = jnp.arange(T, dtype=jnp.int32)
    return (jaxpos.apply_rope(q, pos, rope.inv_freq), jaxpos.apply_rope(k, pos, rope.inv_freq))


def jaxpos_fn(variant, impl, T, bq, bk):
    """``f(q, k, v, params)`` through ``jaxpos.attention`` (RoPE + a bias: rotate first)."""

    def f(q, k, v, p):
        rope, bias = schemes(variant, p)
        if rope is not None and bias is not None:
            q, k = rotate(q, k, rope, T)
            position = bias
        else:
            position = rope or bias
        kw = {"block_q": bq, "block_k": bk} if impl == "pallas" else {}
        return jaxpos.attention(q, k, v, position=position, causal=True, implementation=impl,
                                **kw)

    return f


def xla_fn(variant, T):
    """``attention_via_xla`` with the scheme's score_mod (the bias built in the call)."""

    def f(q, k, v, p):
        rope, bias = schemes(variant, p)
        q, k = rotate(q, k, rope, T)
        pos = np.arange(T)
        return attention_via_xla(q, k, v, score_mod=None if bias is None else bias.score_mod(),
                                 q_positions=pos, kv_positions=pos, causal=True)

    return f


def dense_bias(variant, p, T, dtype):
    """The variant's bias as a dense ``[1, N, T, T]`` array (computed once, outside)."""
    _, bias = schemes(variant, p)
    if bias is None:
        return None
    mod = bias.score_mod()
    pos = jnp.arange(T, dtype=jnp.int32)
    N = p["slopes"].shape[0]
    rows = []
    for h in range(N):  # one head at a time: [T, T] float32 each
        rows.append(mod(jnp.zeros((T, T), jnp.float32), 0, h, pos[:, None], pos[None, :])
                    .astype(dtype))
    return jnp.stack(rows)[None]


def sdpa_fn(variant, T, implementation):
    """``jax.nn.dot_product_attention`` with a dense bias passed as an argument."""

    def f(q, k, v, p, bias):
        rope, _ = schemes(variant, p)
        q, k = rotate(q, k, rope, T)
        return jax.nn.dot_product_attention(q, k, v, bias=bias, is_causal=True,
                                            implementation=implementation)

    return f


def with_grad(f, n_extra):
    def loss(q, k, v, *extra):
        return jnp.sum(f(q, k, v, *extra).astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2))


def time_jax(fn, args, reps):
    jf = jax.jit(fn)
    t = time.time()
    jax.block_until_ready(jf(*args))
    compile_s = time.time() - t
    jax.block_until_ready(jf(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(jf(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times), compile_s


# ------------------------------------------------------------------------ correctness
def check_correctness(args, poison=True):
    B, N, H, T = (1, 2, 16, 64) if args.tiny else (1, 4, 128, 512)
    bq, bk = (16, 16) if args.tiny else (args.block_q, args.block_k)
    p = make_params(N, H)
    report = []
    for dtype in (jnp.bfloat16, jnp.float32):
        ks = jax.random.split(jax.random.PRNGKey(0), 4)
        q, k, v = (jax.random.normal(kk, (B, T, N, H), jnp.float32).astype(dtype)
                   for kk in ks[:3])
        w = jax.random.normal(ks[3], (B, T, N, H), jnp.float32)
        f32 = tuple(x.astype(jnp.float32) for x in (q, k, v))
        tol_f, tol_g = (3e-2, 6e-2) if dtype == jnp.bfloat16 else (2e-3, 4e-3)
        for variant in args.variants:
            if dtype == jnp.float32 and variant not in ("t5", "rope+alibi"):
                continue  # float32: two variants (the bf16 rows cover every variant)
            if time.time() - T0 > 0.4 * args.deadline:
                report.append(f"{variant} {jnp.dtype(dtype).name}: skipped (deadline)")
                continue

            def run(f, q, k, v, w=w):
                def loss(q, k, v, p):
                    o = f(q, k, v, p)
                    return jnp.sum(o.astype(jnp.float32) * w), o

                (_, o), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3),
                                                       has_aux=True))(q, k, v, p)
                return o, jax.tree_util.tree_leaves(g)

            with jax.default_matmul_precision("highest"):
                o_ref, g_ref = run(jaxpos_fn(variant, "reference", T, bq, bk), *f32)
            with kernel_testing.poison_outputs() if poison else contextlib.nullcontext():
                rows = {"pallas": run(jaxpos_fn(variant, "pallas", T, bq, bk), q, k, v)}
            rows["xla"] = run(xla_fn(variant, T), q, k, v)
            for impl, (o, g) in rows.items():
                ferr = float(jnp.max(jnp.abs(o.astype(jnp.float32) - o_ref)))
                gerr = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b))
                                 / max(1.0, float(jnp.max(jnp.abs(b)))))
                           for a, b in zip(g, g_ref))
                nan = bool(jnp.isnan(o.astype(jnp.float32)).any()) or any(
                    bool(jnp.isnan(a.astype(jnp.float32)).any()) for a in g)
                ok = not nan and ferr <= tol_f and gerr <= tol_g
                line = (f"{impl} {variant} {jnp.dtype(dtype).name}: max |out - ref| = "
                        f"{ferr:.2e}, max relative |grad - ref| = {gerr:.2e} "
                        f"({len(g)} gradients){' NaN' if nan else ''} -> "
                        f"{'ok' if ok else 'FAIL'}")
                emit(args, section="correct", line=line, ok=ok)
                report.append(line)
                if not ok:
                    raise SystemExit(f"correctness check failed: {line}")
    return report


# ------------------------------------------------------------------------------- speed
def torch_cells(args, variant, T, N, H, p, q, k, v):
    """``{name: callable(mode)}`` for torch SDPA / FlexAttention, or {}."""
    if args.no_torch:
        return {}
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception:  # noqa: BLE001 - torch is optional
        return {}
    dev = "cuda" if torch.cuda.is_available() else None
    if dev is None:
        return {}
    rope, bias = schemes(variant, p)
    if rope is not None:  # torch rows take q, k already rotated (as jaxpos.core.xla does)
        q, k = rotate(q, k, rope, T)

    def tt(x):
        return torch.from_numpy(np.asarray(x.astype(jnp.float32))).to(dev).to(
            torch.bfloat16).transpose(1, 2).contiguous()

    tq, tk, tv = tt(q), tt(k), tt(v)
    slopes = torch.tensor(np.asarray(p["slopes"]), device=dev)
    R = 128
    vec = None
    if isinstance(bias, jaxpos.T5Bias):
        vec = torch.tensor(np.asarray(bias.offset_vector()), device=dev)

    def score_mod(score, b, h, qi, ki):
        rel = ki - qi
        if isinstance(bias, jaxpos.ALiBi):
            score = score + slopes[h] * rel
        if vec is not None:
            score = score + vec[h, torch.clamp(rel, -R, R) + R]
        return score

    bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, T, T, device=dev)
    flex = torch.compile(flex_attention)
    cells = {"torch.flex": lambda a, b, c: flex(a, b, c, score_mod=score_mod, block_mask=bm)}
    if bias is None:
        cells["torch.sdpa"] = lambda a, b, c: F.scaled_dot_product_attention(a, b, c,
                                                                              is_causal=True)

    def timer(fn, mode, reps):
        sync = torch.cuda.synchronize
        if mode == "fwd":
            def call():
                with torch.no_grad():
                    fn(tq, tk, tv)
        else:
            a, b, c = (x.detach().clone().requires_grad_(True) for x in (tq, tk, tv))

            def call():
                fn(a, b, c).float().sum().backward()
        t = time.time()
        call()
        sync()
        comp = time.time() - t
        times = []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            call()
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times), comp

    return {name: (lambda mode, reps, fn=fn: timer(fn, mode, reps)) for name, fn in cells.items()}


def _cells(args, T, B, N, H, bq, bk, q, k, v, p):
    """Every timed cell at length ``T``: ``(priority, variant, impl, timer(mode, reps))``.
    Priority 0: the rows of the H200 table in docs/kernel.md; 1: the rest."""
    backend = jax.default_backend()
    out = []

    def jax_cell(prio, variant, impl, fn, extra):
        def timer(mode, reps):
            f = fn if mode == "fwd" else with_grad(fn, len(extra))
            return time_jax(f, (q, k, v) + tuple(extra), reps)
        out.append((prio, variant, impl, timer))

    variants = ["none"] + [x for x in args.variants if x != "none"]
    for variant in variants:
        baseline_only = variant == "none" and "none" not in args.variants
        jax_cell(0, variant, "jaxpos.pallas", jaxpos_fn(variant, "pallas", T, bq, bk), (p,))
        if baseline_only:
            continue
        _, bias_scheme = schemes(variant, p)
        pick = choose_implementation(backend=backend, fusable=True,
                                     has_score_mod=bias_scheme is not None, has_mask_mod=False,
                                     Tq=T, Tk=T, num_heads=N, batch=B)
        jax_cell(1, variant, "jaxpos.core.xla", xla_fn(variant, T), (p,))
        jax_cell(1, variant, f"jaxpos.default({pick})", jaxpos_fn(variant, None, T, bq, bk),
                 (p,))
        dense = dense_bias(variant, p, T, jnp.bfloat16) if variant != "none" else None
        if not args.tiny:
            name = "jax.cudnn" if dense is None else "jax.cudnn+dense"
            jax_cell(0 if variant in ("none", "alibi") else 1, variant, name,
                     sdpa_fn(variant, T, "cudnn"), (p, dense))
            if variant in ("none", "rope"):
                try:
                    from jax.experimental.pallas.ops.gpu import attention as pa

                    def mha(q, k, v, p, variant=variant):
                        q, k = rotate(q, k, schemes(variant, p)[0], T)
                        return pa.mha(q, k, v, None, sm_scale=1.0 / math.sqrt(H), causal=True)

                    jax_cell(0 if variant == "none" else 1, variant, "jax.pallas_mha", mha, (p,))
                except Exception as e:  # noqa: BLE001
                    emit(args, section="speed", note=f"no pallas mha: {e}")
        if dense is not None and (args.tiny or (variant == "alibi" and T <= 8192)):
            jax_cell(0, variant, "jax.xla+dense", sdpa_fn(variant, T, "xla"), (p, dense))
        for name, timer in torch_cells(args, variant, T, N, H, p, q, k, v).items():
            prio = 0 if (name == "torch.flex" and variant == "alibi") else 1
            out.append((prio, variant, name, timer))
    return out


def run_speed(args):
    B, N, H = (1, 2, 16) if args.tiny else (4, 16, 128)
    seqs = [64] if args.tiny else args.seqs
    reps = 2 if args.tiny else args.reps
    bq, bk = (16, 16) if args.tiny else (args.block_q, args.block_k)
    todo = []
    for order, T in enumerate(seqs):
        ks = jax.random.split(jax.random.PRNGKey(T), 3)
        q, k, v = (jax.random.normal(kk, (B, T, N, H), jnp.float32).astype(jnp.bfloat16)
                   for kk in ks)
        p = make_params(N, H)
        for prio, variant, impl, timer in _cells(args, T, B, N, H, bq, bk, q, k, v, p):
            for mode in ("fwd", "fwd+bwd"):
                todo.append(((prio, order), T, variant, impl, mode, timer))
    todo.sort(key=lambda c: c[0])  # the H200 table's rows first, then the rest
    rows = []
    for (_, _), T, variant, impl, mode, timer in todo:
        flops = 4 * B * N * T * T * H / 2 * (1.0 if mode == "fwd" else 3.5)  # causal
        row = {"T": T, "pos": variant, "mode": mode, "impl": impl, "ms": None, "tflops": None,
               "note": ""}
        if left(args) < (5 if args.tiny else 40):
            row["note"] = "skipped (deadline)"
        else:
            try:
                t, comp = timer(mode, reps)
                row.update(ms=t * 1e3, tflops=flops / t / 1e12, note=f"compile {comp:.0f} s")
            except Exception as e:  # noqa: BLE001 - e.g. out of memory, cuDNN refusal
                row["note"] = f"{type(e).__name__}: {str(e)[:120]}"
        emit(args, section="speed", **row)
        rows.append(row)
    order = {v: i for i, v in enumerate(VARIANTS)}
    rows.sort(key=lambda r: (seqs.index(r["T"]), order[r["pos"]], r["mode"] != "fwd"))
    return rows


def write_table(path, args, correctness, rows, device_desc):
    def find(T, pos, mode, impl):
        for r in rows:
            if (r["T"], r["pos"], r["mode"], r["impl"]) == (T, pos, mode, impl) and r["tflops"]:
                return r["tflops"]
        return None

    lines = [f"# jaxpos attention benchmark ({device_desc})", "",
             f"Command: `python benchmarks/gpu_attention.py {' '.join(sys.argv[1:])}`", "",
             (f"JAX {jax.__version__}; bf16, causal, model FLOPs `4 B N T^2 H / 2` (x3.5 "
              f"forward+backward)."), "", "Correctness (against the float32 reference):", ""]
    lines += [f"- {c}" for c in correctness]
    lines += ["", ("| T | position | pass | implementation | ms | TFLOP/s | / pallas none | "
                   "/ cudnn dense | note |"), "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = find(r["T"], "none", r["mode"], "jaxpos.pallas")
        dense = find(r["T"], r["pos"], r["mode"], "jax.cudnn+dense")
        ms = "" if r["ms"] is None else f"{r['ms']:.3f}"
        tf = "" if r["tflops"] is None else f"{r['tflops']:.3f}"
        rb = f"{r['tflops'] / base:.2f}" if r["tflops"] and base else ""
        rd = f"{r['tflops'] / dense:.2f}" if r["tflops"] and dense else ""
        lines.append(f"| {r['T']} | {r['pos']} | {r['mode']} | {r['impl']} | {ms} | {tf} | "
                     f"{rb} | {rd} | {r['note']} |")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print(f"wrote {path}")


def main(argv=None):
    global T0
    T0 = time.time()
    on_gpu = jax.default_backend() in ("gpu", "cuda")
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", default=not on_gpu,
                   help="interpret-mode smoke run (default without a GPU)")
    p.add_argument("--seqs", type=int, nargs="+", default=[8192, 2048])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--block-q", type=int, default=128)
    p.add_argument("--block-k", type=int, default=128)
    p.add_argument("--deadline", type=float, default=300.0, help="seconds for everything")
    p.add_argument("--no-torch", action="store_true", help="skip PyTorch SDPA / FlexAttention")
    p.add_argument("--skip-correctness", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not args.tiny and not on_gpu:
        raise SystemExit("the full benchmark needs a CUDA GPU; use --tiny on CPU")
    device_desc = (jax.devices()[0].device_kind if on_gpu else "CPU, Pallas interpret mode")
    correctness = [] if args.skip_correctness else check_correctness(args)
    rows = run_speed(args)
    tag = "cpu_tiny" if args.tiny else device_desc.replace(" ", "_").lower()
    out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                   f"gpu_attention_{tag}.md")
    write_table(out, args, correctness, rows, device_desc)
    return rows


if __name__ == "__main__":
    main()
