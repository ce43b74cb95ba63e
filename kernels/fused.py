"""The fused attention kernel: FlashAttention-2 (Dao 2023, Alg. 1 and 2) forward and
backward as Pallas kernels, programmable by a score_mod and a mask_mod (FlexAttention,
Dong et al. 2024), with block-sparse tile skipping and attention sinks.

Work layout (``B`` batch, ``N`` query heads, ``bq`` / ``bk`` tiles):

* forward, grid ``(B, N, Tq / bq)``: one query tile per program, two loops over key
  tiles, first the PARTIAL tiles of its row of the tile schedule (masked), then the FULL
  ones (no masking at all), with the online softmax (Milakov & Gimelshein 2018). EMPTY
  tiles are never visited: with ``causal=True`` and monotone positions the loop of query
  tile ``i`` stops at the diagonal. Writes the output and the log-sum-exp ``lse``.
* backward ``dq``, grid ``(B, N, Tq / bq)``: the same loops, recomputing the
  probabilities from ``lse``.
* backward ``dk, dv``, grid ``(B, N, Tk / bk)``: one key tile per program, looping over
  the query tiles of its column of the schedule (with causal, from the diagonal down).

Scores are ``scale * q . k`` (float32 accumulation), then the score_mod, then ``-inf``
where hidden. Per-token transforms (RoPE, xPos) are applied to ``q`` and ``k`` *before*
the kernel, once per token (``O(T * H)``); the kernel rotates nothing.

The score_mod / mask_mod are traced inside the kernel bodies (see
:mod:`jaxpos.kernels.modeval`): captured arrays are kernel inputs, indexing them becomes
indexed loads (one gather instruction per tile on GPU, whatever the table size), and the
mods see the program's batch and query head and the tile's positions.

Gradients of the captured arrays (and of nothing else) are computed *outside* the
kernels by a blockwise plain-JAX pass that recomputes the score tiles from the saved
``lse`` (:func:`_mod_const_grads`): exact, lowered by XLA on every backend (a gather's
transpose is a scatter-add, which neither Triton nor Mosaic lowers), and removed by
XLA's dead-code elimination under ``jit`` when no captured array needs a gradient, so
training ``q``, ``k``, ``v`` never pays for it. The sink gradient comes from ``lse``
too: ``d sink_h = -sum_{b,i} exp(sink_h - lse_bhi) * delta_bhi``.

Nothing of size ``Tq x Tk`` is written by the kernels. The same kernel bodies are lowered
by Pallas to Triton (``platforms=["cuda"]``) and to Mosaic TPU (``["tpu"]``), and run on
CPU in interpret mode.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jaxpos.kernels import modeval
from jaxpos.kernels import schedule as sched_lib
from jaxpos.kernels._util import match_vma, pad_axis, pow2_at_least, varying_axes, zero_cotangent

from jaxpos import _checks
from jaxpos.mods import BlockMask, cast_varying, convert_mod, is_additive

__all__ = ["DEFAULT_BLOCK_K", "DEFAULT_BLOCK_Q", "kernel_attention"]

DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 128
_MIN_WIDTH = 16  # smallest feature width (Triton dots need K >= 16)

# Test hooks, read at trace time.
# POISON_OUTPUTS: every kernel output starts as NaN (aliased NaN-filled inputs), so an
# element a kernel fails to write shows up as NaN.
POISON_OUTPUTS = False
# INTERPRET_STYLE: how the interpreter reads captured arrays by index: "load" (indexed
# loads, the GPU form) or "loop" (the TPU form), so both forms are checked on CPU.
INTERPRET_STYLE = "load"
# Bytes of float32 score block the captured-array gradient pass holds per step.
CONST_GRAD_BLOCK_BYTES = 1 << 27


class _Cfg(NamedTuple):
    """Static configuration of one call (hashable: a ``custom_vjp`` nondiff argument)."""

    B: int
    N: int
    groups: int  # N // N_kv
    Tq: int  # real lengths
    Tk: int
    bq: int
    bk: int
    nq: int
    nk: int
    scale: float
    causal: bool
    has_segments: bool
    qpos_batched: bool
    kvpos_batched: bool
    sched_b: bool  # the schedule differs per batch row
    sched_h: bool  # ... per head
    has_sinks: bool
    additive: bool  # d score_mod / d score == 1 (or no score_mod)
    precise: bool  # float32 inputs: exact float32 dots
    mode: str  # "interpret", "compiled" or "auto"
    count_tiles: bool = False  # test hook: kernels also output their loop trip counts


# ------------------------------------------------------------------------ kernel pieces
def _dot(a, b, cfg, contract=((1,), (1,))):
    prec = jax.lax.Precision.HIGHEST if cfg.precise else None
    return jax.lax.dot_general(a, b, (contract, ((), ())), precision=prec,
                               preferred_element_type=jnp.float32)


def _loader(style, refs):
    return (modeval.RefLoader if style == "load" else modeval.LoopLoader)(refs)


class _Mods:
    """The score_mod / mask_mod of one kernel body, reading captured arrays from refs."""

    def __init__(self, r, smod, mmod, style):
        self.score = self.mask = None
        if smod is not None:
            refs = [r[f"smod{i}"] for i in range(len(smod.consts))]
            self.score = modeval.mod_function(smod, _loader(style, refs))
        if mmod is not None:
            refs = [r[f"mmod{i}"] for i in range(len(mmod.consts))]
            self.mask = modeval.mod_function(mmod, _loader(style, refs))


def _scores(cfg, mods, b, h, q, k, q_pos, kv_pos):
    """``(s_raw, s)``: the scaled scores of a tile and the score_mod applied to them."""
    s_raw = _dot(q, k, cfg) * jnp.float32(cfg.scale)
    if mods.score is None:
        return s_raw, s_raw
    return s_raw, mods.score(s_raw, b, h, q_pos, kv_pos)


def _score_derivative(cfg, mods, b, h, s_raw, q_pos, kv_pos):
    """``d score_mod / d score`` on a tile (elementwise), or None when it is 1."""
    if cfg.additive or mods.score is None:
        return None
    _, t = jax.jvp(lambda s: mods.score(s, b, h, q_pos, kv_pos), (s_raw,),
                   (jnp.ones_like(s_raw),))
    return t


def _visible(cfg, mods, b, h, q_pos, kv_pos, q_seg, kv_seg, j):
    """bool ``[bq, bk]`` visibility of a PARTIAL tile (key tile ``j``)."""
    vis = None

    def conj(a, x):
        return x if a is None else a & x

    if cfg.causal:
        vis = conj(vis, kv_pos <= q_pos)
    if cfg.nk * cfg.bk != cfg.Tk:
        idx = j * cfg.bk + jax.lax.broadcasted_iota(jnp.int32, (1, cfg.bk), 1)
        vis = conj(vis, idx < cfg.Tk)
    if cfg.has_segments:
        vis = conj(vis, q_seg == kv_seg)
    if mods.mask is not None:
        vis = conj(vis, mods.mask(b, h, q_pos, kv_pos))
    if vis is None:
        return jnp.ones((cfg.bq, cfg.bk), jnp.bool_)
    return jnp.broadcast_to(vis, (cfg.bq, cfg.bk))


def _loops(r, carry, tile):
    """Run ``tile(index, carry, masked)`` over the PARTIAL then the FULL tiles of this
    program's schedule row; each loop's trip count is the number of such tiles."""
    counts, lists = r["counts"], r["lists"]
    last = lists.shape[-1] - 1

    def run(row, carry, masked):
        # The next tile's index is read one iteration ahead and carried (as FlexAttention's
        # kernels advance their pointers), so a tile's addresses never wait on a load
        # issued in the same iteration (what lets Triton pipeline the tile loads).
        def body(t, c):
            j, inner = c
            nxt = lists[row, jnp.minimum(t + 1, last)]
            return nxt, tile(j, inner, masked)

        return jax.lax.fori_loop(0, counts[0, row], body, (lists[row, 0], carry))[1]

    return run(1, run(0, carry, True), False)


def _count(cfg, carry_cnt, masked):
    if not cfg.count_tiles:
        return carry_cnt
    return carry_cnt + jnp.where(jnp.arange(2) == (0 if masked else 1), 1, 0).astype(jnp.int32)


def _names(refs, names):
    assert len(refs) == len(names), "kernel argument list out of sync"
    return dict(zip(names, refs))


# ------------------------------------------------------------------------------ forward
def _fwd_kernel(*refs, cfg, names, smod, mmod, style):
    r = _names(refs, names)
    b, h = pl.program_id(0), pl.program_id(1)
    bq, bk = cfg.bq, cfg.bk
    mods = _Mods(r, smod, mmod, style)
    q = r["q"][...]
    q_pos = r["q_pos"][...]  # [bq, 1]
    q_seg = r["q_seg"][...] if cfg.has_segments else None
    hv = r["v"].shape[-1]
    if cfg.has_sinks:
        m0 = jnp.full((bq, 1), r["sinks"][h], jnp.float32)
        l0 = jnp.ones((bq, 1), jnp.float32)
    else:
        m0 = jnp.full((bq, 1), -jnp.inf, jnp.float32)
        l0 = jnp.zeros((bq, 1), jnp.float32)

    def tile(j, carry, masked):
        m, l, acc, cnt = carry
        kv_pos = r["kv_pos"][:, pl.ds(j * bk, bk)]  # [1, bk]
        k = r["k"][pl.ds(j * bk, bk), :]
        _, s = _scores(cfg, mods, b, h, q, k, q_pos, kv_pos)
        if masked:
            kv_seg = r["kv_seg"][:, pl.ds(j * bk, bk)] if cfg.has_segments else None
            s = jnp.where(_visible(cfg, mods, b, h, q_pos, kv_pos, q_seg, kv_seg, j), s,
                          -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe)
        corr = jnp.exp(m - m_safe)
        l = l * corr + jnp.sum(p, axis=1, keepdims=True)
        v = r["v"][pl.ds(j * bk, bk), :]
        acc = acc * corr + _dot(p.astype(v.dtype), v, cfg, ((1,), (0,)))
        return m_new, l, acc, _count(cfg, cnt, masked)

    init = (m0, l0, jnp.zeros((bq, hv), jnp.float32), jnp.zeros((2,), jnp.int32))
    m, l, acc, cnt = _loops(r, init, tile)
    l_safe = jnp.where(l == 0.0, 1.0, l)
    r["out"][...] = (acc / l_safe).astype(r["out"].dtype)
    r["lse"][...] = jnp.where(l == 0.0, -jnp.inf, m + jnp.log(l_safe))
    if cfg.count_tiles:
        r["visits"][...] = cnt[None, :]


# ----------------------------------------------------------------------------- backward
def _dq_kernel(*refs, cfg, names, smod, mmod, style):
    r = _names(refs, names)
    b, h = pl.program_id(0), pl.program_id(1)
    bk = cfg.bk
    mods = _Mods(r, smod, mmod, style)
    q = r["q"][...]
    dtype = q.dtype
    q_pos = r["q_pos"][...]
    q_seg = r["q_seg"][...] if cfg.has_segments else None
    do = r["do"][...]
    lse = r["lse"][...]
    lse_safe = jnp.where(lse == -jnp.inf, 0.0, lse)
    delta = r["delta"][...]

    def tile(j, carry, masked):
        dq, cnt = carry
        kv_pos = r["kv_pos"][:, pl.ds(j * bk, bk)]
        k = r["k"][pl.ds(j * bk, bk), :]
        s_raw, s = _scores(cfg, mods, b, h, q, k, q_pos, kv_pos)
        vis = None
        if masked:
            kv_seg = r["kv_seg"][:, pl.ds(j * bk, bk)] if cfg.has_segments else None
            vis = _visible(cfg, mods, b, h, q_pos, kv_pos, q_seg, kv_seg, j)
            s = jnp.where(vis, s, -jnp.inf)
        p = jnp.exp(s - lse_safe)  # 0 where hidden
        v = r["v"][pl.ds(j * bk, bk), :]
        ds = p * (_dot(do, v, cfg) - delta)
        ds = _chain(cfg, mods, b, h, ds, s_raw, q_pos, kv_pos, vis)
        dq = dq + _dot(ds.astype(dtype), k, cfg, ((1,), (0,)))
        return dq, _count(cfg, cnt, masked)

    dq, _ = _loops(r, (jnp.zeros(q.shape, jnp.float32), jnp.zeros((2,), jnp.int32)), tile)
    r["dq"][...] = (dq * jnp.float32(cfg.scale)).astype(r["dq"].dtype)


def _chain(cfg, mods, b, h, ds, s_raw, q_pos, kv_pos, vis):
    """The gradient with respect to the raw score: ``ds * d score_mod / d score``."""
    d = _score_derivative(cfg, mods, b, h, s_raw, q_pos, kv_pos)
    if d is None:
        return ds
    ds = ds * d
    return ds if vis is None else jnp.where(vis, ds, 0.0)


def _dkv_kernel(*refs, cfg, names, smod, mmod, style):
    r = _names(refs, names)
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bq = cfg.bq
    mods = _Mods(r, smod, mmod, style)
    k = r["k"][...]
    v = r["v"][...]
    dtype = k.dtype
    kv_pos = r["kv_pos"][...]  # [1, bk]
    kv_seg = r["kv_seg"][...] if cfg.has_segments else None

    def tile(i, carry, masked):
        dk, dv, cnt = carry
        rows = pl.ds(i * bq, bq)
        q = r["q"][rows, :]
        q_pos = r["q_pos"][rows, :]
        s_raw, s = _scores(cfg, mods, b, h, q, k, q_pos, kv_pos)
        vis = None
        if masked:
            q_seg = r["q_seg"][rows, :] if cfg.has_segments else None
            vis = _visible(cfg, mods, b, h, q_pos, kv_pos, q_seg, kv_seg, j)
            s = jnp.where(vis, s, -jnp.inf)
        lse = r["lse"][rows, :]
        p = jnp.exp(s - jnp.where(lse == -jnp.inf, 0.0, lse))
        do = r["do"][rows, :]
        dv = dv + _dot(p.astype(do.dtype), do, cfg, ((0,), (0,)))
        ds = p * (_dot(do, v, cfg) - r["delta"][rows, :])
        ds = _chain(cfg, mods, b, h, ds, s_raw, q_pos, kv_pos, vis)
        dk = dk + _dot(ds.astype(dtype), q, cfg, ((0,), (0,)))
        return dk, dv, _count(cfg, cnt, masked)

    init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32),
            jnp.zeros((2,), jnp.int32))
    dk, dv, cnt = _loops(r, init, tile)
    r["dk"][...] = (dk * jnp.float32(cfg.scale)).astype(r["dk"].dtype)
    r["dv"][...] = dv.astype(r["dv"].dtype)
    if cfg.count_tiles:
        r["visits"][...] = cnt[None, :]


# ------------------------------------------------------------------------ pallas plumbing
def _match_manual_axes(args, out_shape):
    """Make a ``pallas_call`` valid inside ``shard_map`` with ``check_vma=True`` (its
    default): every input must vary over the same manual mesh axes and each output's
    ``ShapeDtypeStruct`` must say which axes it varies over. The kernel mixes sharded
    arrays (q, k, v) with replicated ones (positions, captured arrays, the schedule), so
    inputs are cast to the union of their axes and the outputs declared to vary over it.
    Outside ``shard_map`` the union is empty and nothing changes. Returns
    ``(args, out_shape, axes)``."""
    vary = [varying_axes(a) for a in args]
    axes = frozenset().union(*vary)
    if not axes:
        return args, out_shape, axes
    args = tuple(a if v == axes else cast_varying(a, axes) for a, v in zip(args, vary))
    params = inspect.signature(jax.ShapeDtypeStruct).parameters
    aval = jax.typeof(args[0])
    mat = getattr(aval, "manual_axis_type", None) or getattr(aval, "mat", None)
    if "manual_axis_type" in params and hasattr(mat, "update"):  # JAX 0.10
        declare = {"manual_axis_type": mat.update(varying=axes)}
    elif "vma" in params:
        declare = {"vma": axes}
    else:
        return args, out_shape, axes
    out_shape = tuple(jax.ShapeDtypeStruct(o.shape, o.dtype, **declare) for o in out_shape)
    return args, out_shape, axes


class _In(NamedTuple):
    """One kernel input: ``spec(platform, shape)`` gives its BlockSpec; ``smem`` puts it
    in TPU scalar memory (whole array, or blocks of ``spec``); ``pow2`` pads every dim to
    a power of two for Triton (captured arrays: Triton blocks are powers of two)."""

    name: str
    array: Any
    spec: Any
    smem: bool = False
    pow2: bool = False


def _whole(platform, shape):
    return pl.BlockSpec(tuple(shape), lambda *_: (0,) * len(shape))


def _smem_spec(block_spec):
    from jax.experimental.pallas import tpu as pltpu

    if block_spec is None:
        return pl.BlockSpec(memory_space=pltpu.SMEM)
    return pl.BlockSpec(block_spec.block_shape, block_spec.index_map, memory_space=pltpu.SMEM)


def _pad_pow2(x):
    for ax in range(x.ndim):
        x = pad_axis(x, ax, pow2_at_least(x.shape[ax]))
    return x


def _pallas(kernel, cfg, grid, ins: list[_In], outs: list[tuple[str, Any, Any]], name):
    """Run ``kernel(style=...)`` (a factory of kernel bodies) in interpret mode, or compiled
    by Triton (CUDA/ROCm) / Mosaic (TPU). ``outs``: ``(name, ShapeDtypeStruct, spec)``."""
    names = tuple(i.name for i in ins) + tuple(o[0] for o in outs)
    args = tuple(i.array for i in ins)
    out_shape = tuple(o[1] for o in outs)
    args, out_shape, manual_axes = _match_manual_axes(args, out_shape)
    under_vma = bool(manual_axes)
    if under_vma and (cfg.mode == "interpret"
                      or (cfg.mode == "auto" and jax.default_backend() == "cpu")):
        raise ValueError(
            "implementation='pallas' in interpret mode (the CPU path) cannot run inside "
            "shard_map with check_vma=True: JAX's Pallas interpreter does not track varying "
            "mesh axes. Pass check_vma=False to shard_map, or use implementation='chunked' "
            "(the CPU default). Compiled kernels (GPU, TPU) need neither.")
    n_in, n_out = len(args), len(out_shape)

    def build(platform, interpret, compiler_params=None):
        style = {"tpu": "loop", "cpu": INTERPRET_STYLE}.get(platform, "load")

        def f(*a):
            a = list(a[:n_in])
            specs = []
            for idx, inp in enumerate(ins):
                x = a[idx]
                if inp.pow2 and platform in ("cuda", "rocm"):
                    x = a[idx] = _pad_pow2(x)
                spec = inp.spec(platform, x.shape)
                if inp.smem and platform == "tpu":
                    spec = _smem_spec(None if inp.spec is _whole else spec)
                specs.append(spec)
            out_specs = [o[2] for o in outs]
            body = functools.partial(kernel, names=names, style=style)
            aliases = {}
            if POISON_OUTPUTS:
                poison = [jnp.full(o.shape, jnp.nan, o.dtype) if jnp.issubdtype(o.dtype, jnp.inexact)
                          else jnp.full(o.shape, -1, o.dtype) for o in out_shape]
                inner = body

                def body(*refs):  # the aliased NaN inputs are the outputs' initial contents
                    return inner(*refs[:n_in], *refs[n_in + n_out:])

                a = a + poison
                specs = specs + out_specs
                aliases = {n_in + i: i for i in range(n_out)}
            return pl.pallas_call(body, grid=grid, in_specs=specs, out_specs=out_specs,
                                  out_shape=out_shape, interpret=interpret,
                                  input_output_aliases=aliases,
                                  compiler_params=compiler_params, name=name)(*a)

        return f

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


def _bspec(shape, index_map):
    return lambda platform, _shape: pl.BlockSpec(shape, index_map)


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
        out.append(_In(f"{prefix}{i}", x, _whole, smem=smem_ok[i], pow2=True))
    return out


def _smem_ok(conv):
    """Per captured array: True when the mod only reads it by scalar or indexed loads (it
    may then live in TPU scalar memory)."""
    if conv is None:
        return []
    rec = modeval.UsageRecorder([(np.shape(c), jnp.result_type(c)) for c in conv.consts])
    args = _abstract_mod_args(conv)
    jax.eval_shape(lambda *a: modeval.eval_converted(conv, a, rec), *args)
    return [not d for d in rec.dense]


def _abstract_mod_args(conv):
    v = conv.jaxpr.invars
    return tuple(jax.ShapeDtypeStruct(x.aval.shape, x.aval.dtype) for x in v)


def _mod_static(conv):
    """The mod with its captured arrays replaced by their shapes (the kernel's static
    copy: values come from refs)."""
    if conv is None:
        return None
    return conv.with_consts(tuple(jax.ShapeDtypeStruct(np.shape(c), jnp.result_type(c))
                                  for c in conv.consts))


def _sched_maps(cfg):
    sb = (lambda b: b) if cfg.sched_b else (lambda b: 0)
    sh = (lambda h: h) if cfg.sched_h else (lambda h: 0)
    return sb, sh


def _common_inputs(cfg, q, k, v, ints, sched, smod, mmod, *, kv_tile):
    """Inputs shared by the three kernels. ``kv_tile``: the dk/dv kernel (a key tile per
    program, every query)."""
    g, bq, bk = cfg.groups, cfg.bq, cfg.bk
    Tq_p, Tk_p = cfg.nq * bq, cfg.nk * bk
    qb = (lambda b: b) if cfg.qpos_batched else (lambda b: 0)
    kb = (lambda b: b) if cfg.kvpos_batched else (lambda b: 0)
    sb, sh = _sched_maps(cfg)
    Hp, Hvp = q.shape[-1], v.shape[-1]
    if not kv_tile:
        ins = [
            _In("q", q, _bspec((None, None, bq, Hp), lambda b, h, i: (b, h, i, 0))),
            _In("k", k, _bspec((None, None, Tk_p, Hp), lambda b, h, i: (b, jax.lax.div(h, g), 0, 0))),
            _In("v", v, _bspec((None, None, Tk_p, Hvp), lambda b, h, i: (b, jax.lax.div(h, g), 0, 0))),
            _In("q_pos", ints["q_pos"], _bspec((None, bq, 1), lambda b, h, i: (qb(b), i, 0))),
            _In("kv_pos", ints["kv_pos"], _bspec((None, 1, Tk_p), lambda b, h, i: (kb(b), 0, 0))),
        ]
        if cfg.has_segments:
            ins += [_In("q_seg", ints["q_seg"], _bspec((None, bq, 1), lambda b, h, i: (b, i, 0))),
                    _In("kv_seg", ints["kv_seg"], _bspec((None, 1, Tk_p), lambda b, h, i: (b, 0, 0)))]
        counts, lists = sched.kv_counts, sched.kv_lists
    else:
        ins = [
            _In("q", q, _bspec((None, None, Tq_p, Hp), lambda b, h, j: (b, h, 0, 0))),
            _In("k", k, _bspec((None, None, bk, Hp), lambda b, h, j: (b, jax.lax.div(h, g), j, 0))),
            _In("v", v, _bspec((None, None, bk, Hvp), lambda b, h, j: (b, jax.lax.div(h, g), j, 0))),
            _In("q_pos", ints["q_pos"], _bspec((None, Tq_p, 1), lambda b, h, j: (qb(b), 0, 0))),
            _In("kv_pos", ints["kv_pos"], _bspec((None, 1, bk), lambda b, h, j: (kb(b), 0, j))),
        ]
        if cfg.has_segments:
            ins += [_In("q_seg", ints["q_seg"], _bspec((None, Tq_p, 1), lambda b, h, j: (b, 0, 0))),
                    _In("kv_seg", ints["kv_seg"], _bspec((None, 1, bk), lambda b, h, j: (b, 0, j)))]
        counts, lists = sched.q_counts, sched.q_lists
    n_list = lists.shape[-1]
    ins += [_In("counts", counts, _bspec((None, None, None, 1, 2),
                                         lambda b, h, x: (sb(b), sh(h), x, 0, 0)), smem=True),
            _In("lists", lists, _bspec((None, None, None, 2, n_list),
                                       lambda b, h, x: (sb(b), sh(h), x, 0, 0)), smem=True)]
    ins += _const_inputs("smod", smod, _smem_ok(smod))
    ins += _const_inputs("mmod", mmod, _smem_ok(mmod))
    return ins


def _forward(cfg, q, k, v, ints, sched, smod, mmod, sinks):
    B, N, bq = cfg.B, cfg.N, cfg.bq
    Tq_p = cfg.nq * bq
    hv = v.shape[-1]
    ins = _common_inputs(cfg, q, k, v, ints, sched, smod, mmod, kv_tile=False)
    if cfg.has_sinks:
        ins.append(_In("sinks", sinks, _whole, smem=True, pow2=True))
    outs = [("out", jax.ShapeDtypeStruct((B, N, Tq_p, hv), v.dtype),
             pl.BlockSpec((None, None, bq, hv), lambda b, h, i: (b, h, i, 0))),
            ("lse", jax.ShapeDtypeStruct((B, N, Tq_p, 1), jnp.float32),
             pl.BlockSpec((None, None, bq, 1), lambda b, h, i: (b, h, i, 0)))]
    if cfg.count_tiles:
        outs.append(("visits", jax.ShapeDtypeStruct((B, N, cfg.nq, 1, 2), jnp.int32),
                     pl.BlockSpec((None, None, None, 1, 2), lambda b, h, i: (b, h, i, 0, 0))))
    kern = functools.partial(_fwd_kernel, cfg=cfg, smod=_mod_static(smod), mmod=_mod_static(mmod))
    return _pallas(kern, cfg, (B, N, cfg.nq), ins, outs, "jaxpos_attention_fwd")


def _backward_kernels(cfg, q, k, v, ints, sched, smod, mmod, out, lse, dout):
    """dq, dk, dv (float32, dk/dv per query head) and delta."""
    B, N, bq, bk = cfg.B, cfg.N, cfg.bq, cfg.bk
    Tq_p, Tk_p = cfg.nq * bq, cfg.nk * bk
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
    do = dout.astype(v.dtype)
    Hp, Hvp = q.shape[-1], v.shape[-1]
    smod_s, mmod_s = _mod_static(smod), _mod_static(mmod)
    # dq
    ins = _common_inputs(cfg, q, k, v, ints, sched, smod, mmod, kv_tile=False)
    row = lambda w: _bspec((None, None, bq, w), lambda b, h, i: (b, h, i, 0))
    ins += [_In("do", do, row(Hvp)), _In("lse", lse, row(1)), _In("delta", delta, row(1))]
    outs = [("dq", jax.ShapeDtypeStruct((B, N, Tq_p, Hp), jnp.float32),
             pl.BlockSpec((None, None, bq, Hp), lambda b, h, i: (b, h, i, 0)))]
    kern = functools.partial(_dq_kernel, cfg=cfg, smod=smod_s, mmod=mmod_s)
    (dq,) = _pallas(kern, cfg, (B, N, cfg.nq), ins, outs, "jaxpos_attention_dq")
    # dk, dv: one key tile of one query head per program
    ins = _common_inputs(cfg, q, k, v, ints, sched, smod, mmod, kv_tile=True)
    col = lambda w: _bspec((None, None, Tq_p, w), lambda b, h, j: (b, h, 0, 0))
    ins += [_In("do", do, col(Hvp)), _In("lse", lse, col(1)), _In("delta", delta, col(1))]
    outs = [("dk", jax.ShapeDtypeStruct((B, N, Tk_p, Hp), jnp.float32),
             pl.BlockSpec((None, None, bk, Hp), lambda b, h, j: (b, h, j, 0))),
            ("dv", jax.ShapeDtypeStruct((B, N, Tk_p, Hvp), jnp.float32),
             pl.BlockSpec((None, None, bk, Hvp), lambda b, h, j: (b, h, j, 0)))]
    if cfg.count_tiles:
        outs.append(("visits", jax.ShapeDtypeStruct((B, N, cfg.nk, 1, 2), jnp.int32),
                     pl.BlockSpec((None, None, None, 1, 2), lambda b, h, j: (b, h, j, 0, 0))))
    kern = functools.partial(_dkv_kernel, cfg=cfg, smod=smod_s, mmod=mmod_s)
    res = _pallas(kern, cfg, (B, N, cfg.nk), ins, outs, "jaxpos_attention_dkv")
    dk, dv = res[0], res[1]
    g = cfg.groups
    if g > 1:  # sum the per-query-head key gradients over each group
        fold = lambda x: x.reshape((B, N // g, g) + x.shape[2:]).sum(axis=2)
        dk, dv = fold(dk), fold(dv)
    return dq, dk, dv, delta, (res[2] if cfg.count_tiles else None)


# ------------------------------------------------- captured-array gradients (outside)
def _tiles_apply(conv, x, q_pos_t, kv_pos_t, kind):
    """Apply a converted mod to every tile: ``x`` ``[B, N, G, nk, bq, bk]`` (scores) or
    None (a mask: then ``kind`` = (B, N, G, nk)); ``q_pos_t`` ``[Bq, G, bq]``,
    ``kv_pos_t`` ``[Bk, nk, bk]``."""
    B, N = x.shape[:2] if x is not None else kind[:2]

    call = conv  # under shard_map, ConvertedMod matches its operands' varying axes itself

    def one(s, b, h, qp, kp):
        args = (b, h, qp[:, None], kp[None, :])
        if s is None:
            return jnp.broadcast_to(call(*args), (qp.shape[0], kp.shape[0]))
        return call(s, *args)

    sa = None if x is None else 0
    f = jax.vmap(one, in_axes=(sa, None, None, None, 0))  # key tiles
    f = jax.vmap(f, in_axes=(sa, None, None, 0, None))  # query tiles
    f = jax.vmap(f, in_axes=(sa, None, 0, None, None))  # heads
    qa = 0 if q_pos_t.shape[0] > 1 else None
    ka = 0 if kv_pos_t.shape[0] > 1 else None
    f = jax.vmap(f, in_axes=(sa, 0, None, qa, ka))  # batch
    qp = q_pos_t if qa == 0 else q_pos_t[0]
    kp = kv_pos_t if ka == 0 else kv_pos_t[0]
    return f(x, jnp.arange(B, dtype=jnp.int32), jnp.arange(N, dtype=jnp.int32), qp, kp)


def _rows_per_step(cfg, width):
    per_tile_row = cfg.B * cfg.N * cfg.bq * width * 4
    G = max(1, min(cfg.nq, CONST_GRAD_BLOCK_BYTES // max(per_tile_row, 1)))
    while cfg.nq % G:
        G -= 1
    return G


def _mod_const_grads(cfg, q, k, v, ints, smod, mmod, lse, do, delta):
    """Gradients of the score_mod's floating captured arrays: ``sum over tiles of
    VJP(score_mod)(dS)``, recomputing each score tile from ``lse`` in plain JAX (a scan
    over groups of query tiles, ``CONST_GRAD_BLOCK_BYTES`` of scores per step). Exact,
    lowered by XLA everywhere, and dead code under ``jit`` when unused."""
    consts = list(smod.consts)
    diff = [i for i, c in enumerate(consts) if jnp.issubdtype(jnp.result_type(c), jnp.inexact)]
    if not diff:
        return [None] * len(consts)
    B, N, g, bq, bk, nq, nk = cfg.B, cfg.N, cfg.groups, cfg.bq, cfg.bk, cfg.nq, cfg.nk
    Nk = N // g
    Tk_p = nk * bk
    G = _rows_per_step(cfg, Tk_p)
    steps, rows = nq // G, G * bq

    def split_rows(x):  # [B, N, Tq_p, w] -> [steps, B, N, rows, w]
        return jnp.moveaxis(x.reshape(x.shape[:2] + (steps, rows) + x.shape[3:]), 2, 0)

    prec = jax.lax.Precision.HIGHEST if cfg.precise else None
    q_pos = ints["q_pos"][..., 0]  # [Bq, Tq_p]
    kv_pos = ints["kv_pos"][:, 0, :]  # [Bk, Tk_p]
    kv_pos_t = kv_pos.reshape(kv_pos.shape[0], nk, bk)
    q_pos_s = jnp.moveaxis(q_pos.reshape(q_pos.shape[0], steps, G, bq), 1, 0)
    xs = {"q": split_rows(q), "do": split_rows(do), "lse": split_rows(lse),
          "delta": split_rows(delta), "q_pos": q_pos_s}
    if cfg.has_segments:
        xs["q_seg"] = jnp.moveaxis(ints["q_seg"][..., 0].reshape(B, steps, G, bq), 1, 0)
    kv_real = jnp.arange(Tk_p) < cfg.Tk
    # Inside shard_map the mods cast their operands to common varying axes themselves
    # (jaxpos.mods.ConvertedMod); the casts of the captured arrays transpose to sums over
    # the shards.

    def to_tiles(x):  # [B, N, rows, Tk_p] -> [B, N, G, nk, bq, bk]
        x = x.reshape(x.shape[:2] + (G, bq, nk, bk))
        return jnp.swapaxes(x, 3, 4)

    def step(acc, x):
        qi = x["q"].reshape(B, Nk, g, rows, -1)
        doi = x["do"].reshape(B, Nk, g, rows, -1)
        s_raw = jnp.einsum("bkgqh,bkth->bkgqt", qi, k, precision=prec,
                           preferred_element_type=jnp.float32) * jnp.float32(cfg.scale)
        dp = jnp.einsum("bkgqh,bkth->bkgqt", doi, v, precision=prec,
                        preferred_element_type=jnp.float32)
        s_raw = to_tiles(s_raw.reshape(B, N, rows, Tk_p))
        dp = to_tiles(dp.reshape(B, N, rows, Tk_p))
        lse_t = x["lse"].reshape(B, N, G, 1, bq, 1)
        delta_t = x["delta"].reshape(B, N, G, 1, bq, 1)
        qp = x["q_pos"]  # [Bq, G, bq]
        vis = kv_real.reshape(1, 1, 1, nk, 1, bk)
        if cfg.causal:
            vis = vis & (kv_pos_t[:, None, None, :, None, :] <= qp[:, None, :, None, :, None])
        if cfg.has_segments:
            kv_seg = ints["kv_seg"][:, 0, :].reshape(B, nk, bk)
            vis = vis & (x["q_seg"][:, None, :, None, :, None] == kv_seg[:, None, None, :, None, :])
        if mmod is not None:
            vis = vis & _tiles_apply(mmod, None, qp, kv_pos_t, (B, N, G, nk))

        def scores(dc):
            cs = list(consts)
            for i, c in zip(diff, dc):
                cs[i] = c
            return _tiles_apply(smod.with_consts(cs), s_raw, qp, kv_pos_t, None)

        s, vjp = jax.vjp(scores, [consts[i] for i in diff])
        lse_safe = jnp.where(lse_t == -jnp.inf, 0.0, lse_t)
        p = jnp.where(vis, jnp.exp(s - lse_safe), 0.0)
        ds = jnp.where(vis, p * (dp - delta_t), 0.0)
        (dc,) = vjp(ds)
        return [a + d for a, d in zip(acc, dc)], None

    acc0 = [jnp.zeros(np.shape(consts[i]), jnp.result_type(consts[i])) for i in diff]
    acc, _ = jax.lax.scan(step, acc0, xs)
    out = [None] * len(consts)
    for i, a in zip(diff, acc):
        out[i] = a
    return out


# ----------------------------------------------------------------------- custom VJP core
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfg, q, k, v, ints, sched, smod, mmod, sinks):
    out, _ = _forward(cfg, q, k, v, ints, sched, smod, mmod, sinks)[:2]
    return out


def _core_fwd(cfg, q, k, v, ints, sched, smod, mmod, sinks):
    out, lse = _forward(cfg, q, k, v, ints, sched, smod, mmod, sinks)[:2]
    return out, (q, k, v, ints, sched, smod, mmod, sinks, out, lse)


def _core_bwd(cfg, res, dout):
    q, k, v, ints, sched, smod, mmod, sinks, out, lse = res
    dq, dk, dv, delta, _ = _backward_kernels(cfg, q, k, v, ints, sched, smod, mmod, out, lse, dout)
    # Under shard_map, a cotangent varies over every axis the kernel's inputs did; a primal
    # that was replicated over some of them (captured arrays, sinks, all-gathered keys) gets
    # the sum of the per-shard gradients (match_vma), as in the chunked path.
    dq = match_vma(dq.astype(q.dtype), q)
    dk = match_vma(dk.astype(k.dtype), k)
    dv = match_vma(dv.astype(v.dtype), v)
    zeros = lambda tree: jax.tree_util.tree_map(zero_cotangent, tree)
    dsmod = None
    if smod is not None:
        grads = _mod_const_grads(cfg, q, k, v, ints, smod, mmod, lse, dout.astype(v.dtype), delta)
        cts = [zero_cotangent(jnp.asarray(c)) if gr is None else match_vma(gr.astype(
            jnp.result_type(c)), c) for c, gr in zip(smod.consts, grads)]
        dsmod = smod.with_consts(cts)
    dsinks = None
    if sinks is not None:
        w = jnp.exp(sinks[None, :, None, None] - lse) * delta  # [B, N, Tq_p, 1]
        dsinks = match_vma(-jnp.sum(w, axis=(0, 2, 3)).astype(sinks.dtype), sinks)
    return (dq, dk, dv, zeros(ints), zeros(sched), dsmod,
            None if mmod is None else zeros(mmod), dsinks)


_core.defvjp(_core_fwd, _core_bwd)


# --------------------------------------------------------------------------- the call
def _check_block(name, blk):
    blk = _checks.check_positive_int(name, blk)
    if blk & (blk - 1):
        raise ValueError(f"{name} must be a power of two (Triton tiles; TPU needs block_q a "
                         f"multiple of 8 and block_k a multiple of 128); got {blk}.")
    return blk


def resolve_mode(interpret):
    """``interpret`` (True / False / None) as the kernel's mode string."""
    if interpret is None:
        return "auto"
    if not isinstance(interpret, bool):
        raise TypeError(f"interpret must be True, False or None; got {interpret!r}.")
    return "interpret" if interpret else "compiled"


def _prepare(q, k, v, *, q_positions, kv_positions, score_mod=None, mask_mod=None,
             block_mask=None, sinks=None, causal=False, segment_ids=None, kv_segment_ids=None,
             scale=None, block_q=None, block_k=None, mode="auto", count_tiles=False):
    """Validate, lay out and classify: ``(cfg, q, k, v, ints, sched, smod, mmod, sinks)``
    in kernel layout."""
    B, Tq, N, H = q.shape
    _, Tk, Nk, _ = k.shape
    Hv = v.shape[3]
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask must be a jaxpos.mods.BlockMask (create_block_mask); "
                            f"got {type(block_mask).__name__}.")
        block_mask.check(B, N, Tq, Tk, block_q, block_k)
        bq = _check_block("block_mask.block_q", block_mask.block_q)
        bk = _check_block("block_mask.block_k", block_mask.block_k)
        if mask_mod is None:
            mask_mod = block_mask.mask_mod
    else:
        bq = _check_block("block_q", DEFAULT_BLOCK_Q if block_q is None else block_q)
        bk = _check_block("block_k", DEFAULT_BLOCK_K if block_k is None else block_k)
        bq = min(bq, pow2_at_least(Tq, 8))
        bk = min(bk, pow2_at_least(Tk, 8))
    nq, nk = max(1, -(-Tq // bq)), max(1, -(-Tk // bk))
    Tq_p, Tk_p = nq * bq, nk * bk
    q_pos = _checks.positions_2d("q_positions", q_positions, B, Tq)
    kv_pos = _checks.positions_2d("kv_positions", kv_positions, B, Tk)
    if (segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("segment_ids and kv_segment_ids must be given together; got one.")
    if scale is None:
        scale = 1.0 / math.sqrt(H)
    smod = convert_mod(score_mod, "score", bq, bk) if score_mod is not None else None
    mmod = convert_mod(mask_mod, "mask", bq, bk) if mask_mod is not None else None
    if sinks is not None:
        _checks.check_rank("sinks", sinks, (1,), "[num_heads]")
        _checks.check_floating("sinks", sinks)
        if _checks.shape_of(sinks)[0] != N:
            raise ValueError(f"sinks must have shape [{N}] (one logit per query head); got "
                             f"{_checks.shape_of(sinks)}.")
        sinks = jnp.asarray(sinks, jnp.float32)

    def layout(x, T_p):  # [B, T, n, w] -> [B, n, T_p, w_pow2]
        x = pad_axis(jnp.swapaxes(x, 1, 2), 2, T_p)
        return pad_axis(x, 3, pow2_at_least(x.shape[3], _MIN_WIDTH))

    qq, kk, vv = layout(q, Tq_p), layout(k, Tk_p), layout(v, Tk_p)
    qp = pad_axis(q_pos, 1, Tq_p, mode="edge")
    kp = pad_axis(kv_pos, 1, Tk_p, mode="edge")
    ints = {"q_pos": qp[:, :, None], "kv_pos": kp[:, None, :]}
    seg_q = seg_kv = None
    if segment_ids is not None:
        sq = _checks.positions_2d("segment_ids", segment_ids, B, Tq)
        skv = _checks.positions_2d("kv_segment_ids", kv_segment_ids, B, Tk)
        seg_q = jnp.broadcast_to(pad_axis(sq, 1, Tq_p), (B, Tq_p))
        seg_kv = jnp.broadcast_to(pad_axis(skv, 1, Tk_p), (B, Tk_p))
        ints["q_seg"] = seg_q[:, :, None]
        ints["kv_seg"] = seg_kv[:, None, :]
    kinds = sched_lib.structural_kinds(causal=bool(causal), q_pos=qp, kv_pos=kp, seg_q=seg_q,
                                       seg_kv=seg_kv, Tq=Tq, Tk=Tk, bq=bq, bk=bk, nq=nq, nk=nk)
    if block_mask is not None:
        kinds = sched_lib.combine(kinds, block_mask.kinds)
    elif mmod is not None:
        kinds = jnp.where(kinds == sched_lib.FULL, sched_lib.PARTIAL, kinds)
    sched = sched_lib.build(kinds)
    cfg = _Cfg(B=B, N=N, groups=N // Nk, Tq=Tq, Tk=Tk, bq=bq, bk=bk, nq=nq, nk=nk,
               scale=float(scale), causal=bool(causal), has_segments=segment_ids is not None,
               qpos_batched=qp.shape[0] > 1, kvpos_batched=kp.shape[0] > 1,
               sched_b=kinds.shape[0] > 1, sched_h=kinds.shape[1] > 1,
               has_sinks=sinks is not None, additive=is_additive(smod),
               precise=q.dtype == jnp.float32, mode=mode, count_tiles=count_tiles)
    return cfg, qq, kk, vv, ints, sched, smod, mmod, sinks, Hv


def kernel_attention(q, k, v, *, score_mod=None, mask_mod=None, block_mask=None, sinks=None,
                     q_positions, kv_positions, causal=False, segment_ids=None,
                     kv_segment_ids=None, scale=None, block_q=None, block_k=None,
                     interpret=None):
    """The fused kernel on already-transformed ``q``, ``k``, ``v`` (see
    :func:`jaxpos.kernels.attention_via_kernel` for the contract). Returns
    ``[B, Tq, N, H_v]`` in q's dtype."""
    cfg, qq, kk, vv, ints, sched, smod, mmod, sinks, Hv = _prepare(
        q, k, v, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask, sinks=sinks,
        q_positions=q_positions, kv_positions=kv_positions, causal=causal,
        segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, scale=scale, block_q=block_q,
        block_k=block_k, mode=resolve_mode(interpret))
    out = _core(cfg, qq, kk, vv, ints, sched, smod, mmod, sinks)  # [B, N, Tq_p, Hv_p]
    out = out[:, :, :cfg.Tq, :Hv]
    return jnp.swapaxes(out, 1, 2).astype(q.dtype)


def tile_visits(q, k, v, **kw):
    """Test hook: how many key tiles each forward program and how many query tiles each
    dk/dv program visit, as ``(fwd [B, N, nq, 2], dkv [B, N, nk, 2])`` (column 0: masked
    PARTIAL tiles, column 1: unmasked FULL tiles), counted inside the kernels' loops
    (interpret mode)."""
    cfg, qq, kk, vv, ints, sched, smod, mmod, sinks, _ = _prepare(
        q, k, v, mode="interpret", count_tiles=True, **kw)
    out, lse, fwd = _forward(cfg, qq, kk, vv, ints, sched, smod, mmod, sinks)
    *_, dkv = _backward_kernels(cfg, qq, kk, vv, ints, sched, smod, mmod, out, lse,
                                jnp.zeros_like(out))
    return fwd[..., 0, :], dkv[..., 0, :]
