"""Tensor parallelism on CPU devices: per-device temporary memory and the bytes each
device sends, for the attention call, the attention layer and a ``DecoderLM`` training
step at tensor parallelism ``P = 1, 2, 4`` (``XLA_FLAGS=--xla_force_host_platform_device_count=8``,
set here before JAX starts). Nothing is timed: everything is read from the compiled
programs (``jax.jit(f).lower(...).compile()``), without running them.

Mesh: the first ``P`` devices as one axis ``tensor`` (``--axis-types``: Auto, the
default, or Explicit, the default of ``jax.make_mesh``), under ``jax.set_mesh``; a program
that fails to compile is recorded in the table with its error. Parameters are placed by
their logical axes (:func:`jaxpos.sharding.place`, :data:`jaxpos.sharding.DEFAULT_RULES`:
heads, key/value heads, the MLP and the vocabulary over ``tensor``); activations' batch and
sequence stay whole (this mesh has no ``data`` or ``seq`` axis). Three programs, each one
step of forward + backward:

* ``attention``: ``jaxpos.attention`` (``--implementation``, causal, ``--scheme``) on q, k, v
  ``[B, T, N, H]`` sharded over heads, ``P(None, None, "tensor", None)``; the gradients of
  ``sum(out * g)`` with respect to q, k and v;
* ``layer``: ``jaxpos.nnx.MultiHeadAttention`` (``d_model = N * H``), the gradients of
  ``sum(out * g)`` with respect to its parameters and its input;
* ``decoder``: ``jaxpos.nnx.DecoderLM`` (``--d-model``, ``--layers``, ``--heads``,
  ``--vocab``), next-token cross-entropy and the gradients of every parameter.

Memory: ``compiled.memory_analysis()`` of the SPMD program, i.e. per device: ``temp``
(every intermediate buffer), ``args`` (parameters, inputs) and ``out``. ``temp x P`` is
``temp(P) * P / temp(1)``: 1.00 when the temporaries fall as ``1 / P``. The goal for the
attention call's activations: within 1.15.

Collectives: every collective of the optimised HLO (``compiled.as_text()``), its result
bytes times the trip count of the loops around it, as bytes each device sends
(:func:`context_parallel.collective_bytes`: all-reduce ``2 (P - 1) / P`` of its operand,
all-gather ``(P - 1) / P`` of its result, reduce-scatter and all-to-all ``(P - 1) / P``
of their operand, collective-permute its operand), beside two formulas; ``b = 4`` bytes,
``f = 2 (P - 1) / P``. ``Megatron``: tensor parallelism as Shoeybi et al. 2019, §3, lay
it out, an all-reduce of the ``[B, T, D]`` activations after each row-parallel projection
(forward) and one of the input gradient of each group of column-parallel projections of
one input (backward). ``as built``: the same with the backward all-reduce once per
column-parallel projection, which is what XLA emits for the modules' separate ``q_proj``,
``k_proj`` and ``v_proj`` (it does not add their partial input gradients before reducing):

* ``attention``: no activation moves (every head is computed where its q, k and v are);
  only the loss, a sum over the head shards: ``f b``, both formulas;
* ``layer``: Megatron ``2 f B T D b`` (the output projection forward, the input gradient
  backward); as built ``4 f B T D b`` (q, k and v's input gradients apiece);
* ``decoder``: Megatron ``(4 L + 2) f B T D b + 3 f B T b``: per block the attention's
  and the MLP's two all-reduces; the embedding lookup in the vocabulary-sharded table
  forward and the tied output layer's input gradient backward; the log-sum-exp (maximum
  and sum) and the target logit over the sharded vocabulary, ``[B, T]`` each. As built
  ``(6 L + 2) f B T D b + 3 f B T b``.

Usage::

    python benchmarks/sharded.py            # the committed table (a few minutes)
    python benchmarks/sharded.py --quick    # small shapes; what the test runs

The table goes to ``benchmarks/results/sharded_cpu.md`` (``--output``).
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import datetime
import importlib.util
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpos
import jaxpos.nnx as jn
from jaxpos import sharding

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results" / "sharded_cpu.md"
PROGRAMS = ("attention", "layer", "decoder")
MiB = 2.0 ** 20
F32 = 4
GOAL = 1.15


def _collective_bytes():
    """:func:`collective_bytes` of ``benchmarks/context_parallel.py`` (one HLO reader)."""
    spec = importlib.util.spec_from_file_location("context_parallel", HERE / "context_parallel.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.collective_bytes


def _mesh(p: int, kind: AxisType) -> Mesh:
    return Mesh(np.array(jax.devices()[:p]), ("tensor",), axis_types=(kind,))


def _scheme(name: str, N: int, H: int):
    if name == "rope":
        return jaxpos.RoPE(rotary_dim=H)
    if name == "alibi":
        return jaxpos.ALiBi(num_heads=N)
    if name == "t5":
        r = np.random.default_rng(1)
        return jaxpos.T5Bias(jnp.asarray(r.normal(size=(32, N)), jnp.float32),
                             bidirectional=False)
    return None


def _zeros(shape, mesh, spec, dtype=jnp.float32):
    return jax.device_put(jnp.zeros(shape, dtype), NamedSharding(mesh, spec))


def compile_attention(a, mesh):
    """The attention call, forward + backward, q/k/v/g sharded over heads."""
    B, T, N, H = a.batch, a.length, a.heads, a.head_dim
    scheme = _scheme(a.scheme, N, H)
    heads = P(None, None, "tensor", None)

    def loss(q, k, v, g):
        out = jaxpos.attention(q, k, v, position=scheme, causal=True,
                               implementation=a.implementation)
        return jnp.sum(out * g)

    args = [_zeros((B, T, N, H), mesh, heads) for _ in range(4)]
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*args).compile()


def compile_layer(a, mesh):
    """``MultiHeadAttention``, forward + backward (parameters and input)."""
    B, T, N, H = a.batch, a.length, a.heads, a.head_dim
    D = N * H
    model = jn.MultiHeadAttention(D, N, position=a.scheme, causal=True,
                                  implementation=a.implementation, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    params = sharding.place(params, mesh)

    def loss(params, x, g):
        return jnp.sum(nnx.merge(graphdef, params)(x) * g)

    x, g = (_zeros((B, T, D), mesh, P()) for _ in range(2))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(params, x, g).compile()


def compile_decoder(a, mesh):
    """``DecoderLM``: next-token cross-entropy and every parameter's gradient."""
    model = jn.DecoderLM(a.vocab, d_model=a.d_model, num_layers=a.layers,
                         num_heads=a.heads, position=a.scheme,
                         implementation=a.implementation, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    params = sharding.place(params, mesh)

    def loss(params, tokens):
        logits = nnx.merge(graphdef, params)(tokens[:, :-1])
        picked = jnp.take_along_axis(logits, tokens[:, 1:, None], axis=-1)[..., 0]
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)

    tokens = _zeros((a.batch, a.length + 1), mesh, P(), jnp.int32)
    return jax.jit(jax.value_and_grad(loss)).lower(params, tokens).compile()


def formula_bytes(program: str, p: int, a) -> tuple[float, float]:
    """Bytes each device sends per step by the module docstring's formulas:
    ``(Megatron, as built)``."""
    f = 2 * (p - 1) / p
    if program == "attention":
        return f * F32, f * F32
    if program == "layer":
        act = f * a.batch * a.length * a.heads * a.head_dim * F32
        return 2 * act, 4 * act
    B, T, D, L = a.batch, a.length, a.d_model, a.layers
    act, small = f * B * T * D * F32, 3 * f * B * T * F32
    return (4 * L + 2) * act + small, (6 * L + 2) * act + small


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensor", type=int, nargs="+", default=[1, 2, 4],
                    help="tensor-parallel sizes P (the first is the baseline)")
    ap.add_argument("--programs", nargs="+", default=list(PROGRAMS), choices=PROGRAMS)
    ap.add_argument("--implementation", default="chunked")
    ap.add_argument("--scheme", default="rope", choices=("nope", "rope", "alibi", "t5"))
    ap.add_argument("--axis-types", choices=("explicit", "auto"), default="auto")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64, help="attention and layer")
    ap.add_argument("--d-model", type=int, default=256, help="decoder")
    ap.add_argument("--layers", type=int, default=2, help="decoder")
    ap.add_argument("--vocab", type=int, default=2048, help="decoder")
    ap.add_argument("--quick", action="store_true",
                    help="T = 128, H = 16, d_model 64, vocab 256, one decoder layer")
    ap.add_argument("--output", type=pathlib.Path, default=RESULTS)
    a = ap.parse_args(argv)
    if a.quick:
        a.length, a.head_dim, a.d_model, a.vocab, a.layers = 128, 16, 64, 256, 1
    if len(jax.devices()) < max(a.tensor):
        raise SystemExit(f"need {max(a.tensor)} devices, have {len(jax.devices())} (XLA_FLAGS)")
    kind = AxisType.Explicit if a.axis_types == "explicit" else AxisType.Auto
    collective_bytes = _collective_bytes()
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    compilers = {"attention": compile_attention, "layer": compile_layer,
                 "decoder": compile_decoder}
    rows, base = [], {}
    for program in a.programs:
        for p in a.tensor:
            mesh = _mesh(p, kind)
            t0 = time.perf_counter()
            try:
                with jax.set_mesh(mesh):
                    compiled = compilers[program](a, mesh)
            except Exception as e:  # recorded in the table: the other rows still count
                error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                rows.append(dict(program=program, P=p, error=error))
                print(f"{program} P={p}: {error}", flush=True)
                continue
            seconds = time.perf_counter() - t0
            ma = compiled.memory_analysis()
            hlo = collective_bytes(compiled.as_text())
            row = dict(program=program, P=p, temp=ma.temp_size_in_bytes,
                       args=ma.argument_size_in_bytes, out=ma.output_size_in_bytes,
                       hlo=sum(hlo.values()), kinds=hlo, compile_s=seconds)
            row["formula"], row["built"] = formula_bytes(program, p, a)
            base.setdefault(program, row["temp"])
            row["temp_x_p"] = row["temp"] * p / base[program]
            rows.append(row)
            kinds = ", ".join(f"{k} {v / MiB:.3f}" for k, v in hlo.items() if v) or "none"
            print(f"{program} P={p}: temp {row['temp'] / MiB:.2f} MiB (x P "
                  f"{row['temp_x_p']:.3f}), collectives {row['hlo'] / MiB:.3f} MiB "
                  f"(Megatron {row['formula'] / MiB:.3f}, as built {row['built'] / MiB:.3f}; "
                  f"{kinds}), compiled in "
                  f"{seconds:.1f} s", flush=True)
    load_after = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average before {load_before}, after {load_after}")

    B, T, N, H = a.batch, a.length, a.heads, a.head_dim
    lines = [
        "# Tensor parallelism on CPU devices: memory and collectives per device", "",
        f"Command: `python benchmarks/sharded.py{' --quick' if a.quick else ''}`", "",
        (f"- Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
         f"{os.cpu_count()} CPUs ({platform.machine()}) as {len(jax.devices())} host "
         f"devices; load average before {load_before}, after {load_after} (nothing is "
         f"timed: the figures are read from the compiled programs, so the load does not "
         f"change them). jax {jax.__version__}."),
        (f"- Mesh: the first P devices as one axis `tensor` ({a.axis_types} axes), "
         f"parameters placed by their logical axes (`jaxpos.sharding.place`). Engine "
         f"`{a.implementation}`, causal, scheme `{a.scheme}`, float32. `attention`: "
         f"`jaxpos.attention` on q, k, v [{B}, {T}, {N}, {H}] sharded over heads; `layer`: "
         f"`MultiHeadAttention(d_model={N * H}, num_heads={N})` on x [{B}, {T}, {N * H}]; "
         f"`decoder`: `DecoderLM(vocab={a.vocab}, d_model={a.d_model}, "
         f"num_layers={a.layers}, num_heads={N})` on tokens [{B}, {T}]. Each: one forward "
         f"+ backward."),
        (f"- Memory per device from `compiled.memory_analysis()` (MiB): `temp` the "
         f"temporaries, `args` / `out` the arguments and outputs; `temp x P` = temp(P) x P "
         f"/ temp(1), 1.00 when the temporaries fall as 1/P (goal for the attention call's "
         f"activations: <= {GOAL})."),
        ("- Collectives: bytes each device sends per step (MiB), read from the compiled HLO "
         "(operand bytes x loop trip counts, by kind) beside the formulas of the "
         "benchmark's docstring: `Megatron`, one all-reduce of the [B, T, D] activations "
         "per row-parallel projection forward and per group of column-parallel projections "
         "backward (Shoeybi et al. 2019, §3); `as built`, the backward one per "
         "column-parallel projection (q, k and v apiece: XLA does not add their partial "
         "input gradients before reducing them)."), "",
        "| program | P | temp | temp x P | args | out | collectives (HLO) | Megatron | "
        "as built | HLO / as built | HLO by kind |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['program']} | {r['P']} | | | | | | | | | "
                         f"{r['error'].replace('|', '/')} |")
            continue
        ratio = (f"{r['hlo'] / r['built']:.3f}" if r["built"] else
                 ("1.000" if not r["hlo"] else "inf"))
        kinds = ", ".join(f"{k} {v / MiB:.3f}" for k, v in r["kinds"].items() if v) or "none"
        lines.append(f"| {r['program']} | {r['P']} | {r['temp'] / MiB:.2f} | "
                     f"{r['temp_x_p']:.3f} | {r['args'] / MiB:.2f} | {r['out'] / MiB:.2f} | "
                     f"{r['hlo'] / MiB:.3f} | {r['formula'] / MiB:.3f} | "
                     f"{r['built'] / MiB:.3f} | {ratio} | {kinds} |")
    done = [r for r in rows if "error" not in r]
    last = {r["program"]: r for r in done}  # each program at its largest P
    lines += ["", "Reading:", ""]
    if "attention" in last:
        r = last["attention"]
        verdict = "met" if r["temp_x_p"] <= GOAL else "not met"
        lines.append(f"- The attention call's temporaries fall as 1/P: temp x P = "
                     f"{r['temp_x_p']:.3f} at P = {r['P']} (goal <= {GOAL}: {verdict}); "
                     f"nothing but the loss's scalar crosses devices.")
    for name in ("layer", "decoder"):
        if name in last:
            more = ", the residual stream and the norms" if name == "decoder" else ""
            lines.append(
                f"- `{name}`: temp x P = {last[name]['temp_x_p']:.3f} at P = "
                f"{last[name]['P']}. The [B, T, D] tensors (the input, its gradient, the "
                f"all-reduced buffers{more}) "
                f"are whole on every device under tensor parallelism without sequence "
                f"parallelism, so that part does not fall with P; the attention inside does.")
    text = "\n".join(lines) + "\n"
    print(text)
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(text)
    return rows


if __name__ == "__main__":
    main()
