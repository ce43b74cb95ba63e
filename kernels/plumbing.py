"""``pallas_call`` plumbing: the kernel inputs and outputs as named records with a
BlockSpec per platform, TPU scalar memory, ``shard_map`` varying axes, and one
``pallas_call`` per platform chosen by :func:`jax.lax.platform_dependent` (interpret mode
on CPU, Triton on CUDA / ROCm, Mosaic on TPU).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxpos._util import cast_varying, pad_axis, pow2_at_least, varying_axes
from jaxpos.kernels import layout, modeval

if TYPE_CHECKING:
    from jaxpos.kernels.config import KernelConfig, Operands
    from jaxpos.kernels.layout import Segs

#: How a kernel body reads captured arrays by index, per platform: ``"load"`` (indexed
#: loads, the GPU form) or ``"loop"`` (a loop of scalar reads, the TPU form).
LOADER_STYLE = {"cpu": "load", "cuda": "load", "rocm": "load", "tpu": "loop"}

#: The ``pallas_call`` every kernel goes through (one name, so a test harness can wrap it).
pallas_call = pl.pallas_call


def declare_axes(out_shape: Any, axes: Any, like: Any) -> Any:
    """``ShapeDtypeStruct`` outputs declared to vary over the manual mesh ``axes`` (inside
    ``shard_map`` with ``check_vma=True``)."""
    if not axes:
        return out_shape
    params = inspect.signature(jax.ShapeDtypeStruct).parameters
    aval = jax.typeof(like)
    mat = getattr(aval, "manual_axis_type", None) or getattr(aval, "mat", None)
    if "manual_axis_type" in params and mat is not None and hasattr(mat, "update"):  # JAX 0.10
        declare = {"manual_axis_type": mat.update(varying=axes)}
    elif "vma" in params:
        declare = {"vma": axes}
    else:
        return out_shape
    return tuple(jax.ShapeDtypeStruct(o.shape, o.dtype, **declare) for o in out_shape)


def match_manual_axes(args: Any) -> Any:
    """Make a ``pallas_call`` valid inside ``shard_map`` with ``check_vma=True`` (its
    default): every input must vary over the same manual mesh axes and each output's
    ``ShapeDtypeStruct`` must say which axes it varies over. The kernel mixes sharded
    arrays (q, k, v) with replicated ones (positions, captured arrays, the schedule), so
    inputs are cast to the union of their axes and the outputs declared to vary over it
    (:func:`declare_axes`). Outside ``shard_map`` the union is empty and nothing changes.
    Returns ``(args, axes)``."""
    vary = [varying_axes(a) for a in args]
    axes = frozenset().union(*vary)
    if not axes:
        return args, axes
    return tuple(a if v == axes else cast_varying(a, axes) for a, v in zip(args, vary)), axes


class In(NamedTuple):
    """One kernel input. ``spec(plat, x)`` gives ``(array, BlockSpec)`` for a platform (the
    array may be reshaped there: a layout change or power-of-two padding); ``smem`` puts
    it in TPU scalar memory (whole array, or blocks of ``spec``)."""

    name: str
    array: Any
    spec: Any
    smem: bool = False


class Out(NamedTuple):
    """One kernel output: ``make(plat) -> (ShapeDtypeStruct, BlockSpec, post)``; ``post``
    maps the kernel's array back to the canonical layout."""

    name: str
    make: Any


def whole(pow2: bool=False) -> Any:
    """The whole array in every program (captured arrays, sinks; Triton: every dim padded
    to a power of two when ``pow2``)."""

    def spec(plat, x):
        if pow2 and plat.masked:
            for ax in range(x.ndim):
                x = pad_axis(x, ax, pow2_at_least(x.shape[ax]))
        return x, pl.BlockSpec(tuple(x.shape), lambda *_: (0,) * x.ndim)

    spec.whole = True
    return spec


def fixed(shape: tuple[int | None, ...], index_map: Any) -> Any:
    """Blocks of ``shape`` at ``index_map`` on every platform."""
    return lambda plat, x: (x, pl.BlockSpec(shape, index_map))


def _smem_spec(block_spec, is_whole):
    from jax.experimental.pallas import tpu as pltpu

    if is_whole:
        return pl.BlockSpec(memory_space=pltpu.SMEM)
    return pl.BlockSpec(block_spec.block_shape, block_spec.index_map, memory_space=pltpu.SMEM)


def _check_interpretable(cfg, under_vma):
    if under_vma and (cfg.mode == "interpret"
                      or (cfg.mode == "auto" and jax.default_backend() == "cpu")):
        raise ValueError(
            "implementation='pallas' in interpret mode (the CPU path) cannot run inside "
            "shard_map with check_vma=True: JAX's Pallas interpreter does not track varying "
            "mesh axes. Pass check_vma=False to shard_map, or use implementation='chunked' "
            "(the CPU default). Compiled kernels (GPU, TPU) need neither.")


def _builder(kernel, ins, outs, grid, name, manual_axes, scalar_prefetch=0):
    """``build(platform, interpret, compiler_params)``: the function running the kernel on
    one platform (the first ``scalar_prefetch`` inputs are scalar-prefetch operands: every
    index map then also receives their refs)."""
    names = tuple(i.name for i in ins) + tuple(o.name for o in outs)
    n_in = len(ins)

    def build(platform, interpret, compiler_params=None):
        plat = layout.plat_of(platform, _cfg_of(kernel))

        def f(*a):
            a = list(a[:n_in])
            specs = []
            for idx, inp in enumerate(ins):
                a[idx], spec = inp.spec(plat, a[idx])
                if inp.smem and platform == "tpu":
                    spec = _smem_spec(spec, getattr(inp.spec, "whole", False))
                specs.append(spec)
            made = [o.make(plat) for o in outs]
            out_shape = declare_axes(tuple(m[0] for m in made), manual_axes, a[0])
            body = functools.partial(kernel, names=names, style=LOADER_STYLE[platform],
                                     plat=plat)
            layout_kw = _grid_kw(grid, specs, [m[1] for m in made], scalar_prefetch)
            res = pallas_call(body, out_shape=out_shape, interpret=interpret,
                              compiler_params=compiler_params, name=name, **layout_kw)(*a)
            return tuple(m[2](x) for m, x in zip(made, res))

        return f

    return build


def _grid_kw(grid, in_specs, out_specs, scalar_prefetch) -> dict[str, Any]:
    """The ``pallas_call`` keywords of the grid: ``grid``, ``in_specs``, ``out_specs``, or
    a ``grid_spec`` with scalar prefetch (the first ``scalar_prefetch`` inputs)."""
    if not scalar_prefetch:
        return {"grid": grid, "in_specs": in_specs, "out_specs": out_specs}
    from jax.experimental.pallas import tpu as pltpu

    return {"grid_spec": pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=scalar_prefetch, grid=grid, in_specs=in_specs[scalar_prefetch:],
        out_specs=out_specs)}


def _cfg_of(kernel):
    return kernel.keywords["cfg"]


def run_pallas(kernel, grid, ins: list[In], outs: list[Out], name, scalar_prefetch=0) -> Any:
    """Run ``kernel`` (a ``functools.partial`` with ``cfg=``; it is given ``names``,
    ``style`` and ``plat``) in interpret mode, or compiled by Triton (CUDA / ROCm) or
    Mosaic (TPU). Returns the outputs, each mapped back by its ``post``."""
    cfg = _cfg_of(kernel)
    args, manual_axes = match_manual_axes(tuple(i.array for i in ins))
    under_vma = bool(manual_axes)
    _check_interpretable(cfg, under_vma)
    build = _builder(kernel, ins, outs, grid, name, manual_axes, scalar_prefetch)
    if cfg.mode == "interpret":
        return build("cpu", True)(*args)
    from jax.experimental.pallas import triton as pltriton

    warps = 8 if cfg.bq * cfg.bk >= 128 * 128 else 4
    params = pltriton.CompilerParams(num_warps=warps, num_stages=2)
    compiled = {"cuda": build("cuda", False, params), "rocm": build("rocm", False, params),
                "tpu": build("tpu", False)}
    if cfg.mode == "auto" and not under_vma:  # (the interpreter cannot lower under vma)
        compiled["cpu"] = build("cpu", True)
    return jax.lax.platform_dependent(*args, **compiled)


# ------------------------------------------------------------------ the kernels' inputs
def _const_inputs(prefix, conv, smem_ok):
    """Kernel inputs for a converted mod's captured arrays (0-d ones as ``[1]``)."""
    if conv is None:
        return []
    out = []
    for i, c in enumerate(conv.consts):
        x = jnp.asarray(c)
        # Captured arrays travel at least 2-D (leading 1s): TPU blocks of rank < 2 need
        # device information to check; the kernel indexes the added axes with 0.
        x = x.reshape((1,) * (2 - x.ndim) + x.shape) if x.ndim < 2 else x
        out.append(In(f"{prefix}{i}", x, whole(pow2=True), smem=smem_ok[i]))
    return out


def _smem_ok(conv):
    """Per captured array: True when the mod only reads it by scalar or indexed loads (it
    may then live in TPU scalar memory)."""
    if conv is None:
        return []
    rec = modeval.UsageRecorder([(np.shape(c), jnp.result_type(c)) for c in conv.consts])
    args = tuple(jax.ShapeDtypeStruct(x.aval.shape, x.aval.dtype) for x in conv.jaxpr.invars)
    jax.eval_shape(lambda *a: modeval.eval_converted(conv, a, rec), *args)
    return [not d for d in rec.dense]


def mod_static(conv: Any) -> Any:
    """The mod with its captured arrays replaced by their shapes (the kernel's static
    copy: values come from refs)."""
    if conv is None:
        return None
    return conv.with_consts(tuple(jax.ShapeDtypeStruct(np.shape(c), jnp.result_type(c))
                                  for c in conv.consts))


def batch_map(batched: bool) -> Callable[[Any], Any]:
    """The block index of an array with a batch dim of ``B`` (``batched``) or 1."""
    return (lambda b: b) if batched else (lambda b: 0)


def tok(rows: Any, heads: int, W: int, imap: Any, segs: Segs) -> Any:
    """The spec of an ``[B, T, n, W]`` token input (q, k, v, do) in the platform's
    layout."""
    def spec(plat, arr):
        return layout.to_kernel(plat, arr), layout.tok_spec(
            plat, rows, heads, W, layout.block_width(plat, segs, W), imap)
    return spec


def pool(W: int, kv_head: Any, segs: Segs) -> Any:
    """The spec of a ``[num_pages, page_size, N_kv, W]`` page pool: every page of KV head
    ``kv_head(*grid)`` in every program (the kernel reads the pages of its row by index:
    ``ref.at[page]``), in the platform's layout (the pool is ``[B, T, n, W]``-shaped)."""
    def spec(plat, arr):
        P, ps = arr.shape[:2]
        x = layout.to_kernel(plat, arr)
        if plat.kind == "4d":
            Wb = layout.block_width(plat, segs, W)
            return x, pl.BlockSpec((P, ps, None, Wb), lambda *g: (0, 0, kv_head(*g), 0))
        if plat.kind == "flat":
            return x, pl.BlockSpec((P, ps, W), lambda *g: (0, 0, kv_head(*g)))
        return x, pl.BlockSpec((P, None, ps, W), lambda *g: (0, kv_head(*g), 0, 0))
    return spec


def _tables(rows, imap):
    """RoPE table inputs (``q_cos``/``q_sin`` or ``k_cos``/``k_sin``): ``[Bt, T_p, half]``,
    Triton: the width padded to a power of two (zeros: padded columns rotate to 0)."""
    def spec(plat, x):
        x = pad_axis(x, 2, layout.wb(plat, x.shape[2]))
        return x, pl.BlockSpec((None, rows, x.shape[2]), lambda *g: (*imap(*g), 0))
    return spec


def pos_inputs(cfg: KernelConfig, ops: Operands, *, q_rows, q_map, k_rows, k_map) -> list[In]:
    """Positions, segments and RoPE tables; ``q_map(*grid) -> (batch, row block)``."""
    qb, kb = batch_map(cfg.qpos_batched), batch_map(cfg.kvpos_batched)
    ins = [In("q_pos", ops.q_pos, fixed((None, q_rows, 1), lambda *g: (
               qb(q_map(*g)[0]), q_map(*g)[1], 0))),
           In("kv_pos", ops.kv_pos, fixed((None, 1, k_rows), lambda *g: (
               kb(k_map(*g)[0]), 0, k_map(*g)[1])))]
    if cfg.has_segments:
        ins += [In("q_seg", ops.q_seg, fixed((None, q_rows, 1), lambda *g: (
                    q_map(*g)[0], q_map(*g)[1], 0))),
                In("kv_seg", ops.kv_seg, fixed((None, 1, k_rows), lambda *g: (
                    k_map(*g)[0], 0, k_map(*g)[1])))]
    if cfg.rope_half:
        tqb, tkb = batch_map(cfg.rope_qb), batch_map(cfg.rope_kb)
        qm = lambda *g: (tqb(q_map(*g)[0]), q_map(*g)[1])
        km = lambda *g: (tkb(k_map(*g)[0]), k_map(*g)[1])
        tabs = ops.tabs
        ins += [In("q_cos", tabs[0], _tables(q_rows, qm)),
                In("q_sin", tabs[1], _tables(q_rows, qm)),
                In("k_cos", tabs[2], _tables(k_rows, km)),
                In("k_sin", tabs[3], _tables(k_rows, km))]
    return ins


def tail_inputs(cfg: KernelConfig, ops: Operands) -> list[In]:
    """Key lengths, the dropout seed and the mods' captured arrays."""
    ins = []
    if cfg.has_kv_len:
        ins.append(In("kv_len", ops.kv_len, whole(pow2=True), smem=True))
    if cfg.dropout_rate:
        ins.append(In("drop_seed", ops.drop_seed, whole(), smem=True))
    ins += _const_inputs("smod", ops.smod, _smem_ok(ops.smod))
    ins += _const_inputs("mmod", ops.mmod, _smem_ok(ops.mmod))
    return ins


def sched_inputs(counts: Any, lists: Any, heads: int, imap: Any) -> list[In]:
    """Schedule rows: ``imap(*grid) -> (S_b index, S_h index, row[, split])``."""
    hd = None if heads == 1 else heads
    extra = counts.ndim - 5  # a split axis
    lead = (None,) * extra
    c_shape = (None, hd, None) + lead + (1, 2)
    l_shape = (None, hd, None) + lead + (2, lists.shape[-1])
    return [In("counts", counts, fixed(c_shape, lambda *g: (*imap(*g), 0, 0)), smem=True),
            In("lists", lists, fixed(l_shape, lambda *g: (*imap(*g), 0, 0)), smem=True)]
