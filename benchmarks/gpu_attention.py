"""Benchmark the fused Pallas kernel (jaxpos.kernels.fused_attention) on a CUDA GPU.

What it does, in order:

1. Correctness: every variant's output (and, for fwd+bwd, its gradients) against
   ``jaxpos.attention(..., implementation="reference")`` on a small shape; it stops if one
   is off (bfloat16 tolerance 3e-2).
2. Speed, bfloat16, causal, B=4, N=16, H=128, T in 1k, 2k, 4k, 8k, 16k, forward and
   forward+backward, for each position variant (none, ALiBi, T5, RoPE, RoPE+ALiBi):

   * ``fused``: the kernel with the variant fused in;
   * ``fused/nobias``: the same kernel without any position term (the cost of fusing);
   * ``xla``: ``jax.nn.dot_product_attention(implementation="xla")`` with the bias
     materialised as ``[1, N, T, T]`` (RoPE applied to q and k beforehand);
   * ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")``, no bias (only for
     the variants without a bias: none and RoPE);
   * ``flex``: PyTorch FlexAttention (``torch.compile``\\ d) with the same score function,
     when torch with CUDA is importable.

   Columns: median milliseconds, TFLOP/s (model FLOPs: ``4 B N T^2 H``, halved for causal;
   forward+backward counted as 3.5x the forward, as FlashAttention-2 does) and the ratio
   of each row's time to ``fused`` for the same cell.

Without a GPU it runs a tiny interpret-mode version (``--tiny``, the default on CPU) so CI
keeps the script working: the same code paths at B=1, N=2, H=16, T=64.

Usage::

    python benchmarks/gpu_attention.py                # full on GPU, tiny on CPU
    python benchmarks/gpu_attention.py --tiny --out /tmp/bench.md

Writes a Markdown table to ``benchmarks/results/gpu_attention_<device>.md`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jaxpos.kernels import fused_attention, scheme_to_kernel_args
from jaxpos.kernels.dispatch import t5_offset_bias

import jaxpos

VARIANTS = ("none", "alibi", "t5", "rope", "rope+alibi")


def make_schemes(N, H):
    """The position terms of each variant: a list of jaxpos schemes (applied in order)."""
    table = jax.random.normal(jax.random.PRNGKey(11), (32, N), jnp.float32) * 0.5
    alibi = jaxpos.ALiBi(N)
    t5 = jaxpos.T5Bias(table, bidirectional=False)
    rope = jaxpos.RoPE(rotary_dim=H, base=10000.0)
    return {"none": [], "alibi": [alibi], "t5": [t5], "rope": [rope], "rope+alibi": [rope, alibi]}


def kernel_kwargs(schemes, T):
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    kw = {}
    for s in schemes:
        kw.update(scheme_to_kernel_args(s, pos, pos))
    return kw


def fused_fn(schemes, T, *, interpret, block_q, block_k, angle_precision):
    kw = kernel_kwargs(schemes, T)
    if "inv_freq" in kw:
        kw["angle_precision"] = angle_precision
    pos = jnp.arange(T, dtype=jnp.int32)

    def f(q, k, v):
        return fused_attention(q, k, v, q_positions=pos, kv_positions=pos, causal=True,
                               block_q=block_q, block_k=block_k, interpret=interpret, **kw)

    return f


def dense_bias(schemes, T):
    """float32 ``[1, N, T, T]`` sum of the schemes' biases, or None."""
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    bias = None
    for s in schemes:
        b = s.bias(None, pos, pos)
        if b is not None:
            bias = b if bias is None else bias + b
    return bias


def xla_fn(schemes, T, implementation):
    pos = jnp.arange(T, dtype=jnp.int32)
    rope = [s for s in schemes if isinstance(s, jaxpos.RoPE)]
    bias = dense_bias(schemes, T)

    def f(q, k, v):
        if rope:
            q = jaxpos.apply_rope(q, pos, rope[0].inv_freq)
            k = jaxpos.apply_rope(k, pos, rope[0].inv_freq)
        b = None if bias is None else bias.astype(q.dtype)
        return jax.nn.dot_product_attention(q, k, v, bias=b, is_causal=True,
                                            implementation=implementation)

    return f


def reference_fn(schemes):
    def f(q, k, v):
        # one scheme per call in jaxpos.attention; RoPE+ALiBi: rotate first, then ALiBi
        rope = [s for s in schemes if isinstance(s, jaxpos.RoPE)]
        others = [s for s in schemes if not isinstance(s, jaxpos.RoPE)]
        if rope and others:
            T = q.shape[1]
            pos = jnp.arange(T, dtype=jnp.int32)
            q = jaxpos.apply_rope(q, pos, rope[0].inv_freq)
            k = jaxpos.apply_rope(k, pos, rope[0].inv_freq)
            rope = []
        position = (rope or others or [None])[0]
        return jaxpos.attention(q, k, v, position=position, causal=True,
                                implementation="reference")

    return f


def with_grad(f):
    def loss(q, k, v):
        return jnp.sum(f(q, k, v).astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2))


def time_fn(fn, args, reps):
    jf = jax.jit(fn)
    jax.block_until_ready(jf(*args))  # compile + warm up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(jf(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# ------------------------------------------------------------------------------- torch flex
def flex_setup(schemes, T, N, H, device):
    """A FlexAttention callable with the same score function, or None without torch."""
    try:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception:  # noqa: BLE001 - torch is optional
        return None
    if device == "cuda" and not torch.cuda.is_available():
        return None
    slopes = offset = None
    R = 0
    rope = None
    for s in schemes:
        if isinstance(s, jaxpos.ALiBi):
            slopes = torch.tensor(np.asarray(s.slopes), device=device)
        elif isinstance(s, jaxpos.T5Bias):
            vec = np.asarray(t5_offset_bias(s))
            R = (vec.shape[1] - 1) // 2
            offset = torch.tensor(vec, device=device)
        elif isinstance(s, jaxpos.RoPE):
            rope = np.asarray(s.inv_freq)

    def score_mod(score, b, h, q_idx, kv_idx):
        rel = kv_idx - q_idx
        if slopes is not None:
            score = score + slopes[h] * rel
        if offset is not None:
            score = score + offset[h, torch.clamp(rel, -R, R) + R]
        return score

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    block_mask = create_block_mask(causal, None, None, T, T, device=device)
    attn = torch.compile(flex_attention) if device == "cuda" else flex_attention

    if rope is not None:
        ang = torch.arange(T, device=device, dtype=torch.float32)[:, None] * torch.tensor(
            rope, device=device)[None]
        cos, sin = torch.cos(ang), torch.sin(ang)

    def rotate(x):  # x [B, N, T, H], "half" layout
        if rope is None:
            return x
        h = x.shape[-1] // 2
        xf = x.float()
        x1, x2 = xf[..., :h], xf[..., h:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)

    def run(q, k, v, scale):  # torch [B, N, T, H]
        return attn(rotate(q), rotate(k), v, score_mod=score_mod, block_mask=block_mask,
                    scale=scale)

    return run


def to_torch(x, device):
    import torch

    t = torch.from_numpy(np.asarray(x.astype(jnp.float32))).to(device)
    return t.to(torch.bfloat16 if x.dtype == jnp.bfloat16 else torch.float32).transpose(1, 2)


def time_torch(fn, reps, device):
    import torch

    fn()
    fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# ------------------------------------------------------------------------------ the script
def check_correctness(args, interpret):
    """Every variant against the reference (and FlexAttention against the kernel)."""
    B, N, H, T = (1, 2, 16, 64) if args.tiny else (1, 4, 128, 512)
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(kk, (B, T, N, H), jnp.float32).astype(jnp.bfloat16)
               for kk in ks)
    schemes_all = make_schemes(N, H)
    bq, bk = (16, 16) if args.tiny else (args.block_q, args.block_k)
    report = []
    for name in args.variants:
        sch = schemes_all[name]
        f = fused_fn(sch, T, interpret=interpret, block_q=bq, block_k=bk,
                     angle_precision=args.angle_precision)
        ref = reference_fn(sch)
        f32 = tuple(x.astype(jnp.float32) for x in (q, k, v))
        err = float(jnp.max(jnp.abs(jax.jit(f)(q, k, v).astype(jnp.float32)
                                    - jax.jit(ref)(*f32))))
        gk, gr = jax.jit(with_grad(f))(q, k, v), jax.jit(with_grad(ref))(*f32)
        gerr = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b))) for a, b in zip(gk, gr))
        line = f"{name}: max |out - reference| = {err:.2e}, max |grad - reference| = {gerr:.2e}"
        if not args.no_torch:
            flex = flex_setup(sch, T, N, H, "cuda" if not args.tiny else "cpu")
            if flex is not None:
                dev = "cuda" if not args.tiny else "cpu"
                o = flex(*(to_torch(x, dev) for x in f32), 1.0 / math.sqrt(H))
                ferr = float(np.max(np.abs(o.transpose(1, 2).float().cpu().numpy()
                                           - np.asarray(jax.jit(ref)(*f32)))))
                line += f", flex (float32) {ferr:.2e}"
                if ferr > 2e-3:
                    raise SystemExit(f"FlexAttention score function disagrees: {line}")
        print(line, flush=True)
        report.append(line)
        if err > 3e-2 or gerr > 6e-2:
            raise SystemExit(f"correctness check failed: {line}")
    return report


def run_speed(args, interpret):
    B, N, H = (1, 2, 16) if args.tiny else (4, 16, 128)
    seqs = [64] if args.tiny else args.seqs
    reps = 2 if args.tiny else args.reps
    bq, bk = (16, 16) if args.tiny else (args.block_q, args.block_k)
    device = "cuda" if not args.tiny else "cpu"
    rows = []
    for T in seqs:
        ks = jax.random.split(jax.random.PRNGKey(T), 3)
        q, k, v = (jax.random.normal(kk, (B, T, N, H), jnp.float32).astype(jnp.bfloat16)
                   for kk in ks)
        schemes_all = make_schemes(N, H)
        flops_fwd = 4 * B * N * T * T * H / 2  # causal
        for name in args.variants:
            sch = schemes_all[name]
            impls = {
                "fused": fused_fn(sch, T, interpret=interpret, block_q=bq, block_k=bk,
                                  angle_precision=args.angle_precision),
                "fused/nobias": fused_fn([], T, interpret=interpret, block_q=bq, block_k=bk,
                                         angle_precision=args.angle_precision),
                "xla": xla_fn(sch, T, "xla"),
            }
            if not args.tiny and name in ("none", "rope"):
                impls["cudnn"] = xla_fn(sch, T, "cudnn")
            for mode in ("fwd", "fwd+bwd"):
                base = None
                for impl, fn in impls.items():
                    fn = fn if mode == "fwd" else with_grad(fn)
                    try:
                        t = time_fn(fn, (q, k, v), reps)
                    except Exception as e:  # noqa: BLE001 - e.g. out of memory at 16k
                        rows.append((T, name, mode, impl, None, None, None,
                                     type(e).__name__))
                        print(f"T={T} {name} {mode} {impl}: {type(e).__name__}", flush=True)
                        continue
                    base = t if impl == "fused" else base
                    rows.append((T, name, mode, impl, t, t, base, ""))
                    print(f"T={T} {name} {mode} {impl}: {t * 1e3:.3f} ms", flush=True)
                if not args.no_torch:
                    flex = flex_setup(sch, T, N, H, device)
                    if flex is not None:
                        tq, tk, tv = (to_torch(x, device) for x in (q, k, v))
                        if mode == "fwd+bwd":
                            for x in (tq, tk, tv):
                                x.requires_grad_(True)
                        scale = 1.0 / math.sqrt(H)

                        def call(flex=flex, tq=tq, tk=tk, tv=tv, scale=scale, mode=mode):
                            o = flex(tq, tk, tv, scale)
                            if mode == "fwd+bwd":
                                o.float().sum().backward()
                            return o

                        try:
                            t = time_torch(call, reps, device)
                            rows.append((T, name, mode, "flex", t, t, base, ""))
                            print(f"T={T} {name} {mode} flex: {t * 1e3:.3f} ms", flush=True)
                        except Exception as e:  # noqa: BLE001
                            rows.append((T, name, mode, "flex", None, None, None,
                                         type(e).__name__))
                factor = 1.0 if mode == "fwd" else 3.5
                rows[:] = [r if r[0] != T or r[1] != name or r[2] != mode or r[4] is None
                           else (*r[:5], flops_fwd * factor / r[4] / 1e12, base, r[7])
                           for r in rows]
    return rows


def write_table(path, args, correctness, rows, device_desc):
    lines = [f"# Fused attention benchmark ({device_desc})", "",
             f"Command: `python benchmarks/gpu_attention.py {' '.join(sys.argv[1:])}`", "",
             "Correctness (bfloat16 inputs, against the float32 reference):", ""]
    lines += [f"- {c}" for c in correctness]
    lines += ["", "| T | position | pass | implementation | ms | TFLOP/s | time / fused |",
              "|---|---|---|---|---|---|---|"]
    for T, name, mode, impl, t, tflops, base, err in rows:
        if t is None:
            lines.append(f"| {T} | {name} | {mode} | {impl} | {err} | | |")
            continue
        ratio = f"{t / base:.2f}" if base else ""
        lines.append(f"| {T} | {name} | {mode} | {impl} | {t * 1e3:.3f} | {tflops:.3f} | "
                     f"{ratio} |")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print(f"wrote {path}")


def main(argv=None):
    on_gpu = jax.default_backend() in ("gpu", "cuda")
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", default=not on_gpu,
                   help="interpret-mode smoke run (default without a GPU)")
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--block-q", type=int, default=128)
    p.add_argument("--block-k", type=int, default=64)
    p.add_argument("--angle-precision", default="float32", choices=("high", "float32"),
                   help="RoPE angles in the timed kernel (Triton cannot lower 'high' yet)")
    p.add_argument("--no-torch", action="store_true", help="skip FlexAttention")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not args.tiny and not on_gpu:
        raise SystemExit("the full benchmark needs a CUDA GPU; use --tiny on CPU")
    interpret = bool(args.tiny)
    device_desc = (jax.devices()[0].device_kind if on_gpu else "CPU, interpret mode")
    correctness = check_correctness(args, interpret)
    rows = run_speed(args, interpret)
    tag = "cpu_tiny" if args.tiny else device_desc.replace(" ", "_").lower()
    out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                   f"gpu_attention_{tag}.md")
    write_table(out, args, correctness, rows, device_desc)
    return rows


if __name__ == "__main__":
    main()
