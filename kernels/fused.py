"""The fused attention kernel: RoPE rotation, ALiBi and an offset-indexed bias inside one
Pallas kernel, forward and backward (FlashAttention-2, Dao 2023, Alg. 1 and 2).

Layout of the work (``B`` batch, ``N`` query heads, ``bq``/``bk`` tiles):

* forward, grid ``(B, N, Tq / bq)``: one query tile per program, a ``fori_loop`` over
  the key tiles with the online softmax (Milakov & Gimelshein 2018; Rabe & Staats 2021).
  Writes the output and the log-sum-exp ``lse`` of every row.
* backward ``dq``, grid ``(B, N, Tq / bq)``: recomputes the probabilities of each tile
  from ``lse`` and accumulates ``dq``.
* backward ``dk, dv``, grid ``(B, N, Tk / bk)``: one key tile per program, a loop over
  the query tiles; accumulates ``dk``, ``dv`` and, per key tile, the gradients of the
  offset-bias vector (a sum of ``dS`` along each clipped offset) and of the ALiBi slopes.

Nothing of size ``Tq x Tk`` is written to memory: the score tile lives in registers /
VMEM only. The same kernel bodies are lowered by Pallas to Triton (``platforms=["cuda"]``)
and to Mosaic TPU (``["tpu"]``), and run on CPU in interpret mode.

Design choices that keep one body legal for both compilers:

* The key and value sequences of one head are a single block; tiles are read with
  ``pl.ds`` inside the loop (no scratch accumulators, which Triton lacks).
* RoPE pairs ``(a, b)`` are split into separate arrays in the wrapper (``"half"``:
  ``a = x[:, :rd/2]``, ``b = x[:, rd/2:rd]``; ``"interleaved"``: even and odd features;
  the unrotated rest is a third part). The score is the sum of one dot per part, so the
  kernel never slices or concatenates along the feature axis. Permuting the features of
  q and k alike leaves ``q . k`` unchanged, so both layouts use the same kernel.
* Neither Triton nor Mosaic lowers a general gather, so the offset-bias lookup is a
  loop over the offsets present in the tile (``where(idx == r, vec[r], 0)``), and its
  gradient is the matching masked sum. Its cost is ``O(bq * bk * offsets in the tile)``.
* Positions arrive as a column ``[T, 1]`` and as a row ``[1, T]`` so a tile of offsets is
  a broadcast subtraction, never a transpose.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxpos import _checks
from jaxpos.attention import _match_vma, _varying_axes  # shard_map's varying-axis types
from jaxpos.attention import _pad_to as _pad_axis  # one padding helper for both paths
from jaxpos.rope import ANGLE_PRECISIONS, LAYOUTS, rope_angles

__all__ = ["DEFAULT_BLOCK_K", "DEFAULT_BLOCK_Q", "fused_attention"]

DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 128
_MIN_WIDTH = 16  # smallest feature width of a part (Triton dots need K >= 16)


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
    has_rope: bool
    attention_factor: float
    has_alibi: bool
    alibi_bidirectional: bool
    radius: int  # R of the offset-bias vector; -1 when there is none
    has_segments: bool
    qpos_batched: bool
    kvpos_batched: bool
    angle_precision: str  # jaxpos.rope.rope_angles: "high" or "float32"
    precise: bool  # float32 inputs: exact float32 dots
    mode: str  # "interpret", "compiled" or "auto"


# ------------------------------------------------------------------------ kernel pieces
def _dot(a, b, cfg, contract=((1,), (1,))):
    prec = jax.lax.Precision.HIGHEST if cfg.precise else None
    return jax.lax.dot_general(a, b, (contract, ((), ())), precision=prec,
                               preferred_element_type=jnp.float32)


def _cos_sin(pos_col, inv_freq, cfg):
    """float32 ``cos, sin`` ``[t, half]`` times attention_factor; ``pos_col`` int32 ``[t, 1]``."""
    ang = rope_angles(pos_col, inv_freq[0], angle_precision=cfg.angle_precision)[:, 0, :]
    af = jnp.float32(cfg.attention_factor)
    return jnp.cos(ang) * af, jnp.sin(ang) * af


def _rotate(parts, cs):
    """Rotate the (a, b) pair of a part tuple by ``cs``; float32 in and out."""
    if cs is None:
        return parts
    c, s = cs
    a, b = parts[0], parts[1]
    return (a * c - b * s, b * c + a * s) + tuple(parts[2:])


def _unrotate(dparts, cs):
    """Transpose of :func:`_rotate` (the gradient with respect to the unrotated parts)."""
    if cs is None:
        return dparts
    c, s = cs
    da, db = dparts[0], dparts[1]
    return (da * c + db * s, db * c - da * s) + tuple(dparts[2:])


def _bias_and_visibility(s, rel, q_seg, kv_seg, kv_valid, tabs, cfg):
    """Add the relative bias to the scaled score tile ``s`` and mask hidden pairs with -inf.

    ``rel``: int32 ``[bq, bk]`` = kv_pos - q_pos. ``kv_valid``: bool ``[1, bk]`` or None.
    """
    slope_ref, vec_ref = tabs
    if cfg.has_alibi:
        slope = slope_ref[0, 0]
        r = rel.astype(jnp.float32)
        s = s + slope * (-jnp.abs(r) if cfg.alibi_bidirectional else r)
    if cfg.radius >= 0:
        idx = jnp.clip(rel, -cfg.radius, cfg.radius) + cfg.radius
        lo, hi = jnp.min(idx), jnp.max(idx)

        def add(r, acc):
            return acc + jnp.where(idx == r, vec_ref[0, r], 0.0)

        s = jax.lax.fori_loop(lo, hi + 1, add, s)
    vis = None

    def conj(a, b):
        return b if a is None else a & b

    if cfg.causal:
        vis = conj(vis, rel <= 0)
    if kv_valid is not None:
        vis = conj(vis, kv_valid)
    if cfg.has_segments:
        vis = conj(vis, q_seg == kv_seg)
    if vis is None:
        return s
    return jnp.where(vis, s, -jnp.inf)


def _tile_live(cfg, q_pos_col, kv_pos_row):
    """False only when the causal mask hides the whole tile."""
    if not cfg.causal:
        return None
    return jnp.min(kv_pos_row) <= jnp.max(q_pos_col)


def _kv_valid(cfg, j):
    if cfg.nk * cfg.bk == cfg.Tk:
        return None
    idx = j * cfg.bk + jax.lax.broadcasted_iota(jnp.int32, (1, cfg.bk), 1)
    return idx < cfg.Tk


def _q_valid(cfg, i):
    if cfg.nq * cfg.bq == cfg.Tq:
        return None
    idx = i * cfg.bq + jax.lax.broadcasted_iota(jnp.int32, (cfg.bq, 1), 0)
    return idx < cfg.Tq


def _maybe(live, compute, carry):
    if live is None:
        return compute(carry)
    return jax.lax.cond(live, compute, lambda c: c, carry)


def _split_refs(refs, cfg, n_parts, n_extra, n_outs):
    """Name the flat ref list of a kernel (the order of :func:`_inputs`, then outputs)."""
    it = iter(refs)
    d = {}
    d["q"] = tuple(next(it) for _ in range(n_parts))
    d["k"] = tuple(next(it) for _ in range(n_parts))
    d["v"] = next(it)
    d["extra"] = [next(it) for _ in range(n_extra)]
    d["q_pos"] = next(it)
    d["kv_pos_row"] = next(it)
    d["kv_pos_col"] = next(it)
    d["q_seg"] = next(it) if cfg.has_segments else None
    d["kv_seg"] = next(it) if cfg.has_segments else None
    d["inv_freq"] = next(it) if cfg.has_rope else None
    d["slope"] = next(it) if cfg.has_alibi else None
    d["vec"] = next(it) if cfg.radius >= 0 else None
    d["out"] = [next(it) for _ in range(n_outs)]
    assert next(it, None) is None, "kernel argument list out of sync"
    return d


# ------------------------------------------------------------------------------ forward
def _fwd_kernel(*refs, cfg, n_parts):
    r = _split_refs(refs, cfg, n_parts, 0, 2)
    o_ref, lse_ref = r["out"]
    bk = cfg.bk
    q_pos = r["q_pos"][...]  # [bq, 1]
    cs_q = _cos_sin(q_pos, r["inv_freq"][...], cfg) if cfg.has_rope else None
    q = _rotate(tuple(x[...].astype(jnp.float32) for x in r["q"]), cs_q)
    dtype = r["q"][0].dtype
    q = tuple(x.astype(dtype) for x in q)
    q_seg = r["q_seg"][...] if cfg.has_segments else None
    tabs = (r["slope"], r["vec"])
    bq = q_pos.shape[0]
    hv = r["v"].shape[-1]

    def body(j, carry):
        kv_pos = r["kv_pos_row"][:, pl.ds(j * bk, bk)]  # [1, bk]

        def compute(carry):
            m, l, acc = carry
            kv_col = r["kv_pos_col"][pl.ds(j * bk, bk), :]  # [bk, 1]
            cs_k = _cos_sin(kv_col, r["inv_freq"][...], cfg) if cfg.has_rope else None
            k = _rotate(tuple(x[pl.ds(j * bk, bk), :].astype(jnp.float32) for x in r["k"]), cs_k)
            s = sum(_dot(qp, kp.astype(dtype), cfg) for qp, kp in zip(q, k))
            s = s * jnp.float32(cfg.scale)
            kv_seg = r["kv_seg"][:, pl.ds(j * bk, bk)] if cfg.has_segments else None
            s = _bias_and_visibility(s, kv_pos - q_pos, q_seg, kv_seg, _kv_valid(cfg, j),
                                     tabs, cfg)
            m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp(s - m_safe)
            corr = jnp.exp(m - m_safe)
            l = l * corr + jnp.sum(p, axis=1, keepdims=True)
            v = r["v"][pl.ds(j * bk, bk), :]
            acc = acc * corr + _dot(p.astype(v.dtype), v, cfg, ((1,), (0,)))
            return m_new, l, acc

        return _maybe(_tile_live(cfg, q_pos, kv_pos), compute, carry)

    init = (jnp.full((bq, 1), -jnp.inf, jnp.float32), jnp.zeros((bq, 1), jnp.float32),
            jnp.zeros((bq, hv), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, cfg.nk, body, init)
    nonempty = l != 0.0  # exactly 0 only when no key is visible; NaN stays NaN
    l_safe = jnp.where(nonempty, l, 1.0)
    o_ref[...] = jnp.where(nonempty, acc / l_safe, 0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(nonempty, m + jnp.log(l_safe), -jnp.inf)


# ----------------------------------------------------------------------------- backward
def _dq_kernel(*refs, cfg, n_parts):
    r = _split_refs(refs, cfg, n_parts, 3, n_parts)
    do_ref, lse_ref, delta_ref = r["extra"]
    bk = cfg.bk
    q_pos = r["q_pos"][...]
    cs_q = _cos_sin(q_pos, r["inv_freq"][...], cfg) if cfg.has_rope else None
    dtype = r["q"][0].dtype
    q = tuple(x.astype(dtype) for x in _rotate(tuple(x[...].astype(jnp.float32)
                                                     for x in r["q"]), cs_q))
    q_seg = r["q_seg"][...] if cfg.has_segments else None
    tabs = (r["slope"], r["vec"])
    do = do_ref[...]
    lse = lse_ref[...]
    lse_safe = jnp.where(lse == -jnp.inf, 0.0, lse)
    delta = delta_ref[...]

    def body(j, dq):
        kv_pos = r["kv_pos_row"][:, pl.ds(j * bk, bk)]

        def compute(dq):
            kv_col = r["kv_pos_col"][pl.ds(j * bk, bk), :]
            cs_k = _cos_sin(kv_col, r["inv_freq"][...], cfg) if cfg.has_rope else None
            k = tuple(x.astype(dtype) for x in _rotate(
                tuple(x[pl.ds(j * bk, bk), :].astype(jnp.float32) for x in r["k"]), cs_k))
            s = sum(_dot(qp, kp, cfg) for qp, kp in zip(q, k)) * jnp.float32(cfg.scale)
            kv_seg = r["kv_seg"][:, pl.ds(j * bk, bk)] if cfg.has_segments else None
            s = _bias_and_visibility(s, kv_pos - q_pos, q_seg, kv_seg, _kv_valid(cfg, j),
                                     tabs, cfg)
            p = jnp.exp(s - lse_safe)  # 0 where hidden
            v = r["v"][pl.ds(j * bk, bk), :]
            dp = _dot(do, v, cfg)
            ds = (p * (dp - delta)).astype(dtype)
            return tuple(a + _dot(ds, kp, cfg, ((1,), (0,))) for a, kp in zip(dq, k))

        return _maybe(_tile_live(cfg, q_pos, kv_pos), compute, dq)

    init = tuple(jnp.zeros(x.shape, jnp.float32) for x in r["q"])
    dq = jax.lax.fori_loop(0, cfg.nk, body, init)
    dq = _unrotate(tuple(x * jnp.float32(cfg.scale) for x in dq), cs_q)
    for ref, x in zip(r["out"], dq):
        ref[...] = x.astype(ref.dtype)


def _dkv_kernel(*refs, cfg, n_parts):
    r = _split_refs(refs, cfg, n_parts, 3, n_parts + 3)
    do_ref, lse_ref, delta_ref = r["extra"]
    dk_refs = r["out"][:n_parts]
    dv_ref, dvec_ref, dslope_ref = r["out"][n_parts:]
    bq = cfg.bq
    j = pl.program_id(2)
    kv_pos = r["kv_pos_row"][...]  # [1, bk]
    kv_col = r["kv_pos_col"][...]  # [bk, 1]
    cs_k = _cos_sin(kv_col, r["inv_freq"][...], cfg) if cfg.has_rope else None
    dtype = r["q"][0].dtype
    k = tuple(x.astype(dtype) for x in _rotate(tuple(x[...].astype(jnp.float32)
                                                     for x in r["k"]), cs_k))
    v = r["v"][...]
    kv_seg = r["kv_seg"][...] if cfg.has_segments else None
    kv_valid = _kv_valid(cfg, j)
    tabs = (r["slope"], r["vec"])
    lp = dvec_ref.shape[-1]
    bk = kv_pos.shape[1]

    def body(i, carry):
        q_pos = r["q_pos"][pl.ds(i * bq, bq), :]  # [bq, 1]

        def compute(carry):
            dk, dv, dvec, dslope = carry
            cs_q = _cos_sin(q_pos, r["inv_freq"][...], cfg) if cfg.has_rope else None
            q = tuple(x.astype(dtype) for x in _rotate(
                tuple(x[pl.ds(i * bq, bq), :].astype(jnp.float32) for x in r["q"]), cs_q))
            s = sum(_dot(qp, kp, cfg) for qp, kp in zip(q, k)) * jnp.float32(cfg.scale)
            rel = kv_pos - q_pos
            q_seg = r["q_seg"][pl.ds(i * bq, bq), :] if cfg.has_segments else None
            s = _bias_and_visibility(s, rel, q_seg, kv_seg, kv_valid, tabs, cfg)
            lse = lse_ref[pl.ds(i * bq, bq), :]
            p = jnp.exp(s - jnp.where(lse == -jnp.inf, 0.0, lse))
            do = do_ref[pl.ds(i * bq, bq), :]
            dv = dv + _dot(p.astype(do.dtype), do, cfg, ((0,), (0,)))
            dp = _dot(do, v, cfg)
            ds = p * (dp - delta_ref[pl.ds(i * bq, bq), :])  # float32 [bq, bk]
            qv = _q_valid(cfg, i)
            if qv is not None:
                ds = jnp.where(qv, ds, 0.0)
            dsc = ds.astype(dtype)
            dk = tuple(a + _dot(dsc, qp, cfg, ((0,), (0,))) for a, qp in zip(dk, q))
            if cfg.has_alibi:
                rf = rel.astype(jnp.float32)
                dslope = dslope + jnp.sum(ds * (-jnp.abs(rf) if cfg.alibi_bidirectional else rf))
            if cfg.radius >= 0:
                idx = jnp.clip(rel, -cfg.radius, cfg.radius) + cfg.radius
                lanes = jax.lax.broadcasted_iota(jnp.int32, (1, lp), 1)

                def gather_back(rr, acc):
                    g = jnp.sum(jnp.where(idx == rr, ds, 0.0))
                    return acc + jnp.where(lanes == rr, g, 0.0)

                dvec = jax.lax.fori_loop(jnp.min(idx), jnp.max(idx) + 1, gather_back, dvec)
            return dk, dv, dvec, dslope

        return _maybe(_tile_live(cfg, q_pos, kv_pos), compute, carry)

    init = (tuple(jnp.zeros((bk, x.shape[-1]), jnp.float32) for x in r["k"]),
            jnp.zeros((bk, v.shape[-1]), jnp.float32), jnp.zeros((1, lp), jnp.float32),
            jnp.zeros((), jnp.float32))
    dk, dv, dvec, dslope = jax.lax.fori_loop(0, cfg.nq, body, init)
    dk = _unrotate(tuple(x * jnp.float32(cfg.scale) for x in dk), cs_k)
    for ref, x in zip(dk_refs, dk):
        ref[...] = x.astype(ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)
    dvec_ref[...] = dvec
    dslope_ref[...] = jnp.broadcast_to(dslope, dslope_ref.shape)


# ------------------------------------------------------------------------ pallas plumbing
# Test hook: when True (read at trace time), every kernel output starts as NaN (aliased
# NaN-filled inputs), so an element the kernel fails to write shows up as NaN.
POISON_OUTPUTS = False


def _cast_varying(x, axes):
    """``x`` marked as varying over ``axes`` too (``lax.pcast(..., to="varying")``; older
    JAX: ``lax.pvary``). A no-op on the values: each device keeps its own."""
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, tuple(sorted(axes)), to="varying")
    return jax.lax.pvary(x, tuple(sorted(axes)))


def _match_manual_axes(args, out_shape):
    """Make a ``pallas_call`` valid inside ``shard_map`` with ``check_vma=True`` (its
    default): ``pallas_call`` needs every input to vary over the same manual mesh axes and
    each output's ``ShapeDtypeStruct`` to say which axes it varies over. The kernel mixes
    sharded arrays (q, k, v) with replicated ones (positions, slopes), so inputs are cast to
    the union of their axes and the outputs declared to vary over it. Outside ``shard_map``
    (or with ``check_vma=False``) the union is empty and nothing changes. Returns
    ``(args, out_shape, axes)``."""
    vary = [_varying_axes(a) for a in args]
    axes = frozenset().union(*vary)
    if not axes:
        return args, out_shape, axes
    args = tuple(a if v == axes else _cast_varying(a, axes - v) for a, v in zip(args, vary))
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


def _pallas(kernel, cfg, grid, in_specs, out_specs, out_shape, args, name):
    """Run ``kernel`` in interpret mode, or compiled by Triton (CUDA/ROCm) / Mosaic (TPU)."""
    args, out_shape, manual_axes = _match_manual_axes(tuple(args), tuple(out_shape))
    under_vma = bool(manual_axes)
    if under_vma and (cfg.mode == "interpret"
                      or (cfg.mode == "auto" and jax.default_backend() == "cpu")):
        raise ValueError(
            "implementation='pallas' in interpret mode (the CPU path) cannot run inside "
            "shard_map with check_vma=True: JAX's Pallas interpreter does not track varying "
            "mesh axes. Pass check_vma=False to shard_map, or use implementation='chunked' "
            "(the CPU default). Compiled kernels (GPU, TPU) need neither.")
    if POISON_OUTPUTS:
        n_in, n_out = len(args), len(out_shape)
        poison = tuple(jnp.full(o.shape, jnp.nan, o.dtype) for o in out_shape)
        body = kernel

        def kernel(*refs):  # the aliased NaN inputs are the outputs' initial contents
            return body(*refs[:n_in], *refs[n_in + n_out:])

        args = tuple(args) + poison
        in_specs = tuple(in_specs) + tuple(out_specs)
        aliases = {n_in + i: i for i in range(n_out)}
    else:
        aliases = {}

    def build(interpret, compiler_params=None):
        def f(*a):
            return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
                                  out_shape=out_shape, interpret=interpret,
                                  input_output_aliases=aliases,
                                  compiler_params=compiler_params, name=name)(*a)
        return f

    if cfg.mode == "interpret":
        return build(True)(*args)
    from jax.experimental.pallas import triton as pltriton

    warps = 8 if cfg.bq * cfg.bk >= 128 * 128 else 4
    triton = build(False, pltriton.CompilerParams(num_warps=warps, num_stages=2))
    compiled = {"cuda": triton, "rocm": triton, "tpu": build(False)}
    if cfg.mode == "auto" and not under_vma:  # (the interpreter cannot lower under vma)
        compiled["cpu"] = build(True)
    return jax.lax.platform_dependent(*args, **compiled)


def _inputs(cfg, parts_q, parts_k, v, ints, tabs, extra, *, kv_tile):
    """The kernel argument list and its BlockSpecs.

    Order: q parts, k parts, v, extra (dout, lse, delta), q_pos column, kv_pos row, kv_pos
    column, segments, inv_freq, slope, vec.
    ``kv_tile``: True in the dk/dv kernel (a key tile per program, full queries).
    """
    g, bq, bk = cfg.groups, cfg.bq, cfg.bk
    Tq_p, Tk_p = cfg.nq * bq, cfg.nk * bk
    qb = (lambda b: b) if cfg.qpos_batched else (lambda b: 0)
    kb = (lambda b: b) if cfg.kvpos_batched else (lambda b: 0)
    args, specs = [], []

    def add(x, spec):
        args.append(x)
        specs.append(spec)

    if not kv_tile:
        q_spec = lambda w: pl.BlockSpec((None, None, bq, w), lambda b, h, i: (b, h, i, 0))
        k_spec = lambda w: pl.BlockSpec((None, None, Tk_p, w), lambda b, h, i: (b, jax.lax.div(h, g), 0, 0))
        qcol = pl.BlockSpec((None, bq, 1), lambda b, h, i: (qb(b), i, 0))
        krow = pl.BlockSpec((None, 1, Tk_p), lambda b, h, i: (kb(b), 0, 0))
        kcol = pl.BlockSpec((None, Tk_p, 1), lambda b, h, i: (kb(b), 0, 0))
        qseg = pl.BlockSpec((None, bq, 1), lambda b, h, i: (b, i, 0))
        kseg = pl.BlockSpec((None, 1, Tk_p), lambda b, h, i: (b, 0, 0))
        row_spec = lambda w: pl.BlockSpec((None, None, bq, w), lambda b, h, i: (b, h, i, 0))
    else:
        q_spec = lambda w: pl.BlockSpec((None, None, Tq_p, w), lambda b, h, j: (b, h, 0, 0))
        k_spec = lambda w: pl.BlockSpec((None, None, bk, w), lambda b, h, j: (b, jax.lax.div(h, g), j, 0))
        qcol = pl.BlockSpec((None, Tq_p, 1), lambda b, h, j: (qb(b), 0, 0))
        krow = pl.BlockSpec((None, 1, bk), lambda b, h, j: (kb(b), 0, j))
        kcol = pl.BlockSpec((None, bk, 1), lambda b, h, j: (kb(b), j, 0))
        qseg = pl.BlockSpec((None, Tq_p, 1), lambda b, h, j: (b, 0, 0))
        kseg = pl.BlockSpec((None, 1, bk), lambda b, h, j: (b, 0, j))
        row_spec = lambda w: pl.BlockSpec((None, None, Tq_p, w), lambda b, h, j: (b, h, 0, 0))
    for x in parts_q:
        add(x, q_spec(x.shape[-1]))
    for x in parts_k:
        add(x, k_spec(x.shape[-1]))
    add(v, k_spec(v.shape[-1]))
    for x in extra:
        add(x, row_spec(x.shape[-1]))
    add(ints["q_pos_col"], qcol)
    add(ints["kv_pos_row"], krow)
    add(ints["kv_pos_col"], kcol)
    if cfg.has_segments:
        add(ints["q_seg"], qseg)
        add(ints["kv_seg"], kseg)
    if cfg.has_rope:
        add(tabs["inv_freq"], pl.BlockSpec(tabs["inv_freq"].shape, lambda *_: (0, 0)))
    if cfg.has_alibi:
        add(tabs["slope"], pl.BlockSpec((None, 1, 128), lambda b, h, i: (h, 0, 0)))
    if cfg.radius >= 0:
        lp = tabs["vec"].shape[-1]
        add(tabs["vec"], pl.BlockSpec((None, 1, lp), lambda b, h, i: (h, 0, 0)))
    return args, specs


def _forward(cfg, parts_q, parts_k, v, ints, tabs):
    B, N, bq = cfg.B, cfg.N, cfg.bq
    Tq_p = cfg.nq * bq
    hv = v.shape[-1]
    args, specs = _inputs(cfg, parts_q, parts_k, v, ints, tabs, (), kv_tile=False)
    out_specs = (pl.BlockSpec((None, None, bq, hv), lambda b, h, i: (b, h, i, 0)),
                 pl.BlockSpec((None, None, bq, 1), lambda b, h, i: (b, h, i, 0)))
    out_shape = (jax.ShapeDtypeStruct((B, N, Tq_p, hv), v.dtype),
                 jax.ShapeDtypeStruct((B, N, Tq_p, 1), jnp.float32))
    kern = functools.partial(_fwd_kernel, cfg=cfg, n_parts=len(parts_q))
    return _pallas(kern, cfg, (B, N, cfg.nq), specs, out_specs, out_shape, args,
                   "jaxpos_fused_attention_fwd")


def _backward(cfg, parts_q, parts_k, v, ints, tabs, out, lse, dout):
    B, N, bq, bk = cfg.B, cfg.N, cfg.bq, cfg.bk
    Tq_p, Tk_p = cfg.nq * bq, cfg.nk * bk
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
    extra = (dout.astype(v.dtype), lse, delta)
    n = len(parts_q)
    # dq
    args, specs = _inputs(cfg, parts_q, parts_k, v, ints, tabs, extra, kv_tile=False)
    out_specs = tuple(pl.BlockSpec((None, None, bq, x.shape[-1]), lambda b, h, i: (b, h, i, 0))
                      for x in parts_q)
    out_shape = tuple(jax.ShapeDtypeStruct((B, N, Tq_p, x.shape[-1]), jnp.float32)
                      for x in parts_q)
    kern = functools.partial(_dq_kernel, cfg=cfg, n_parts=n)
    dq = _pallas(kern, cfg, (B, N, cfg.nq), specs, out_specs, out_shape, args,
                 "jaxpos_fused_attention_dq")
    # dk, dv, d(offset vector), d(slopes): one row per (batch, query head, key tile)
    lp = tabs["vec"].shape[-1] if cfg.radius >= 0 else 128
    args, specs = _inputs(cfg, parts_q, parts_k, v, ints, tabs, extra, kv_tile=True)
    out_specs = tuple(pl.BlockSpec((None, None, bk, x.shape[-1]), lambda b, h, j: (b, h, j, 0))
                      for x in parts_k + (v,))
    out_specs += (pl.BlockSpec((None, None, None, 1, lp), lambda b, h, j: (b, h, j, 0, 0)),
                  pl.BlockSpec((None, None, None, 1, 128), lambda b, h, j: (b, h, j, 0, 0)))
    out_shape = tuple(jax.ShapeDtypeStruct((B, N, Tk_p, x.shape[-1]), jnp.float32)
                      for x in parts_k + (v,))
    out_shape += (jax.ShapeDtypeStruct((B, N, cfg.nk, 1, lp), jnp.float32),
                  jax.ShapeDtypeStruct((B, N, cfg.nk, 1, 128), jnp.float32))
    kern = functools.partial(_dkv_kernel, cfg=cfg, n_parts=n)
    res = _pallas(kern, cfg, (B, N, cfg.nk), specs, out_specs, out_shape, args,
                  "jaxpos_fused_attention_dkv")
    dk, dv, dvec, dslope = res[:n], res[n], res[n + 1], res[n + 2]
    g = cfg.groups
    if g > 1:  # sum the per-query-head key gradients over each group
        fold = lambda x: x.reshape((B, N // g, g) + x.shape[2:]).sum(axis=2)
        dk, dv = tuple(fold(x) for x in dk), fold(dv)
    dvec = dvec.sum(axis=(0, 2))[:, 0, :]  # [N, lp]
    dslope = dslope[..., 0, 0].sum(axis=(0, 2))  # [N]
    return dq, dk, dv, dvec, dslope


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfg, parts_q, parts_k, v, ints, tabs):
    out, _ = _forward(cfg, parts_q, parts_k, v, ints, tabs)
    return out


def _core_fwd(cfg, parts_q, parts_k, v, ints, tabs):
    out, lse = _forward(cfg, parts_q, parts_k, v, ints, tabs)
    return out, (parts_q, parts_k, v, ints, tabs, out, lse)


def _core_bwd(cfg, res, dout):
    parts_q, parts_k, v, ints, tabs, out, lse = res
    dq, dk, dv, dvec, dslope = _backward(cfg, parts_q, parts_k, v, ints, tabs, out, lse, dout)
    # Under shard_map, a cotangent varies over every axis the kernel's inputs did; a primal
    # that was replicated over some of them (slopes, offset vector, all-gathered keys) gets
    # the sum of the per-shard gradients (_match_vma), as in the chunked path.
    dq = tuple(_match_vma(d.astype(x.dtype), x) for d, x in zip(dq, parts_q))
    dk = tuple(_match_vma(d.astype(x.dtype), x) for d, x in zip(dk, parts_k))
    dv = _match_vma(dv.astype(v.dtype), v)
    dints = jax.tree_util.tree_map(lambda x: np.zeros(x.shape, jax.dtypes.float0), ints)
    dtabs = {}
    for name, x in tabs.items():
        if name == "vec":
            dtabs[name] = dvec[:, None, :].astype(x.dtype)
        elif name == "slope":
            lane0 = jnp.arange(x.shape[-1]) == 0  # the slope was broadcast over 128 lanes
            dtabs[name] = jnp.where(lane0, dslope[:, None, None], 0.0).astype(x.dtype)
        else:  # inv_freq: constant inside the kernel; its gradient flows around it
            dtabs[name] = jnp.zeros(x.shape, x.dtype)
        dtabs[name] = _match_vma(dtabs[name], x)
    return dq, dk, dv, dints, dtabs


_core.defvjp(_core_fwd, _core_bwd)


# --------------------------------------------------------------------------- public API
def _pow2_at_least(n, lo=1):
    return max(lo, 1 << max(0, int(n) - 1).bit_length())


def _check_block(name, blk):
    blk = _checks.check_positive_int(name, blk)
    if blk & (blk - 1):
        raise ValueError(f"{name} must be a power of two (Triton tiles; TPU needs block_q a "
                         f"multiple of 8 and block_k a multiple of 128); got {blk}.")
    return blk


def _resolve_mode(interpret):
    if interpret is None:
        return "auto"
    if not isinstance(interpret, bool):
        raise TypeError(f"interpret must be True, False or None; got {interpret!r}.")
    return "interpret" if interpret else "compiled"


def _inv_freq_gradient_path(x, pos, inv_freq, layout):
    """A term equal to zero whose derivative carries ``inv_freq``'s gradient past the kernel.

    The kernel rotates ``x`` in-kernel and returns the gradient with respect to the
    unrotated ``x``; ``inv_freq`` enters it as a constant. For the rotation
    ``R(theta)``, ``theta = pos * inv_freq``, ``R(theta)^T dR/dtheta = J`` with
    ``J (x1, x2) = (-x2, x1)`` on each pair, whatever theta is, so the true
    ``dL/d inv_freq[i] = sum pos * <dL/dx_pair_i, J x_pair_i>`` (the attention factor
    cancels). This function returns ``P - stop_gradient(P)`` with
    ``P = pos * inv_freq * J stop_gradient(x)``: exactly 0 in value, with exactly that
    derivative with respect to ``inv_freq`` and none with respect to ``x``.
    """
    half = inv_freq.shape[0]
    xs = jax.lax.stop_gradient(x).astype(jnp.float32)
    rd = 2 * half
    if layout == "half":
        x1, x2 = xs[..., :half], xs[..., half:rd]
    else:
        x1, x2 = xs[..., 0:rd:2], xs[..., 1:rd:2]
    ang = pos.astype(jnp.float32)[:, :, None, None] * inv_freq  # [B|1, T, 1, half]
    a, b = -x2 * ang, x1 * ang  # J x scaled by the angle
    if layout == "half":
        p = jnp.concatenate([a, b], axis=-1)
    else:
        p = jnp.stack([a, b], axis=-1).reshape(a.shape[:-1] + (rd,))
    ghost = p - jax.lax.stop_gradient(p)
    ghost = jnp.pad(ghost, [(0, 0)] * (x.ndim - 1) + [(0, x.shape[-1] - rd)])
    return ghost.astype(x.dtype)


def fused_attention(q, k, v, *, q_positions, kv_positions, inv_freq=None, rope_layout="half",
                    attention_factor=1.0, angle_precision="high", alibi_slopes=None,
                    alibi_bidirectional=False, offset_bias=None, causal=False, segment_ids=None, kv_segment_ids=None,
                    scale=None, block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K,
                    interpret=None):
    """Fused attention with in-kernel RoPE, ALiBi and an offset-indexed bias (Pallas).

    Computes, per batch ``b`` and query head ``h`` (key/value head ``h // (N / N_kv)``)::

        q', k' = RoPE(q, q_positions), RoPE(k, kv_positions)        # if inv_freq is given
        s[i, j] = scale * q'_i . k'_j
                  + alibi_slopes[h] * (kv_pos_j - q_pos_i)            # ALiBi, Press et al. 2022 §3
                  + offset_bias[h, clip(kv_pos_j - q_pos_i, -R, R) + R]
        out_i   = softmax_j(s[i, :] over visible j) @ v

    with the online softmax of FlashAttention-2 (Dao 2023, Alg. 1) forward and its
    recomputing backward (Alg. 2) as Pallas kernels under ``jax.custom_vjp``. RoPE is
    Su et al. 2024 §3.4: angles ``pos * inv_freq`` in float32 (via
    :func:`jaxpos.rope.rope_angles`), cos and sin times ``attention_factor``.

    The offset-bias contract: ``offset_bias`` is ``[N, 2R + 1]``, entry ``R + r`` is the
    bias of offset ``r = kv_pos - q_pos``, and every offset beyond ``±R`` uses the end
    entry of its side. This is exact for any bias that depends only on the offset and is
    constant beyond ``R`` (T5 buckets with ``R = max_distance``: every offset past
    ``max_distance`` is in the last bucket of its direction; Shaw's clipped scalar bias
    with ``R = K``), and for any offset bias at all when ``R >= max|kv_pos - q_pos|``
    (``R = max(Tq, Tk) - 1`` for ``arange`` positions). Its gradient is the sum of ``dS``
    over the pairs of each clipped offset, so a T5 table trains through the bucket
    gather by ordinary autodiff.

    Args:
      q: ``[B, Tq, N, H]`` float32, bfloat16 or float16.
      k: ``[B, Tk, N_kv, H]``; v: ``[B, Tk, N_kv, H_v]``, q's dtype; ``N % N_kv == 0``.
      q_positions, kv_positions: integer ``[T]``, ``[1, T]`` or ``[B, T]`` (token index).
      inv_freq: float ``[rotary_dim // 2]`` radians per position, or None (no RoPE).
        The kernel uses it as a constant; its gradient is supplied outside the kernel
        by an exact O(T * H) term (see ``_inv_freq_gradient_path``), so learned
        frequencies train through this path as through the others.
      rope_layout: ``"half"`` (Llama/NeoX) or ``"interleaved"`` (GPT-J/Meta).
      attention_factor: Python float multiplying cos and sin (YaRN/LongRoPE).
      angle_precision: ``"high"`` (default, as :func:`jaxpos.apply_rope`) or ``"float32"``
        (Hugging Face's unreduced product); see :func:`jaxpos.rope.rope_angles`.
      alibi_slopes: float ``[N]`` or None; differentiable.
      alibi_bidirectional: use ``-slopes * |kv_pos - q_pos|`` (encoders).
      offset_bias: float ``[N, 2R + 1]`` or None; differentiable.
      causal: a query at position ``p`` sees keys at positions ``<= p``.
      segment_ids, kv_segment_ids: integer ``[B, Tq]`` / ``[B, Tk]``; equal ids attend.
      scale: Python float, default ``1 / sqrt(H)``.
      block_q, block_k: tile sizes, powers of two (use multiples of 8 and 128 for TPU).
        Lengths that are not multiples are padded; padded keys are masked.
      interpret: True runs the Pallas interpreter, False compiles (Triton on GPU,
        Mosaic on TPU), None interprets on CPU and compiles on GPU/TPU.

    Returns:
      ``[B, Tq, N, H_v]`` in q's dtype. Softmax statistics and accumulators are float32.
      A query row with no visible key returns zeros, with zero gradients.

    Raises:
      ValueError / TypeError: bad ranks or shapes, mismatched dtypes, float positions,
      ``offset_bias`` of even length, block sizes that are not powers of two, segment ids
      given alone, unknown ``rope_layout``.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        _checks.check_rank(name, x, (4,), "[batch, seq, heads, head_dim]")
        _checks.check_floating(name, x)
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}.")
    B, Tq, N, H = q.shape
    _, Tk, Nk, _ = k.shape
    if k.shape[0] != B or v.shape[0] != B or k.shape[3] != H or v.shape[1:3] != (Tk, Nk):
        raise ValueError(f"expected q [B, Tq, N, H], k [B, Tk, N_kv, H], v [B, Tk, N_kv, H_v]; "
                         f"got q {q.shape}, k {k.shape}, v {v.shape}.")
    if N % Nk:
        raise ValueError(f"query heads ({N}) must be a multiple of key/value heads ({Nk}); "
                         f"got q {q.shape}, k {k.shape}.")
    _checks.check_choice("rope_layout", rope_layout, LAYOUTS)
    _checks.check_choice("angle_precision", angle_precision, ANGLE_PRECISIONS)
    block_q = _check_block("block_q", block_q)
    block_k = _check_block("block_k", block_k)
    mode = _resolve_mode(interpret)
    q_pos = _checks.positions_2d("q_positions", q_positions, B, Tq)
    kv_pos = _checks.positions_2d("kv_positions", kv_positions, B, Tk)
    if (segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("segment_ids and kv_segment_ids must be given together; got one.")
    if scale is None:
        scale = 1.0 / math.sqrt(H)

    bq = min(block_q, _pow2_at_least(Tq, 8))
    bk = min(block_k, _pow2_at_least(Tk, 8))
    nq, nk = -(-Tq // bq), -(-Tk // bk)
    Tq_p, Tk_p = nq * bq, nk * bk

    tabs = {}
    radius = -1
    if inv_freq is not None:
        _checks.check_rank("inv_freq", inv_freq, (1,), "[rotary_dim // 2]")
        _checks.check_floating("inv_freq", inv_freq)
        half = _checks.shape_of(inv_freq)[0]
        if not 0 < 2 * half <= H:
            raise ValueError(f"inv_freq must have length in [1, H/2 = {H // 2}]; got {half}.")
        hp = _pow2_at_least(half, _MIN_WIDTH)
        f = jnp.asarray(inv_freq, jnp.float32)
        q = q + _inv_freq_gradient_path(q, q_pos, f, rope_layout)
        k = k + _inv_freq_gradient_path(k, kv_pos, f, rope_layout)
        f = jax.lax.stop_gradient(f)
        tabs["inv_freq"] = _pad_axis(f, 0, hp)[None, :]
    if alibi_slopes is not None:
        _checks.check_rank("alibi_slopes", alibi_slopes, (1,), "[num_heads]")
        if _checks.shape_of(alibi_slopes)[0] != N:
            raise ValueError(f"alibi_slopes must have shape [{N}]; got "
                             f"{_checks.shape_of(alibi_slopes)}.")
        sl = jnp.asarray(alibi_slopes, jnp.float32)
        tabs["slope"] = jnp.broadcast_to(sl[:, None, None], (N, 1, 128))
    if offset_bias is not None:
        _checks.check_rank("offset_bias", offset_bias, (2,), "[num_heads, 2R + 1]")
        nh, length = _checks.shape_of(offset_bias)
        if nh != N or length % 2 == 0:
            raise ValueError(f"offset_bias must have shape [{N}, 2R + 1] (odd length, entry R "
                             f"is offset 0); got {(nh, length)}.")
        radius = (length - 1) // 2
        lp = _pow2_at_least(length, _MIN_WIDTH)
        ob = jnp.asarray(offset_bias, jnp.float32)
        tabs["vec"] = _pad_axis(ob, 1, lp)[:, None, :]

    cfg = _Cfg(B=B, N=N, groups=N // Nk, Tq=Tq, Tk=Tk, bq=bq, bk=bk, nq=nq, nk=nk,
               scale=float(scale), causal=bool(causal), has_rope=inv_freq is not None,
               attention_factor=float(attention_factor), angle_precision=angle_precision,
               has_alibi=alibi_slopes is not None,
               alibi_bidirectional=bool(alibi_bidirectional), radius=radius,
               has_segments=segment_ids is not None, qpos_batched=q_pos.shape[0] > 1,
               kvpos_batched=kv_pos.shape[0] > 1, precise=q.dtype == jnp.float32, mode=mode)

    # [B, T, N, H] -> [B, N, T_padded, w] parts, each width a power of two.
    def to_bnth(x, T_p):
        x = jnp.swapaxes(x, 1, 2)
        return _pad_axis(x, 2, T_p)

    def width(x):
        return _pad_axis(x, 3, _pow2_at_least(x.shape[3], _MIN_WIDTH))

    def split(x):
        if inv_freq is None:
            return (x,)
        rd = 2 * half
        if rope_layout == "half":
            a, b = x[..., :half], x[..., half:rd]
        else:
            a, b = x[..., 0:rd:2], x[..., 1:rd:2]
        return (a, b) + ((x[..., rd:],) if rd < H else ())

    parts_q = tuple(width(to_bnth(x, Tq_p)) for x in split(q))
    parts_k = tuple(width(to_bnth(x, Tk_p)) for x in split(k))
    vv = width(to_bnth(v, Tk_p))

    qp = _pad_axis(q_pos, 1, Tq_p, mode="edge")
    kp = _pad_axis(kv_pos, 1, Tk_p, mode="edge")
    ints = {"q_pos_col": qp[:, :, None], "kv_pos_row": kp[:, None, :], "kv_pos_col": kp[:, :, None]}
    if segment_ids is not None:
        sq = _checks.positions_2d("segment_ids", segment_ids, B, Tq)
        skv = _checks.positions_2d("kv_segment_ids", kv_segment_ids, B, Tk)
        if sq.shape[0] != B or skv.shape[0] != B:
            raise ValueError(f"segment_ids must have shape [B, T] with B = {B}.")
        ints["q_seg"] = _pad_axis(sq, 1, Tq_p)[:, :, None]
        ints["kv_seg"] = _pad_axis(skv, 1, Tk_p)[:, None, :]

    out = _core(cfg, parts_q, parts_k, vv, ints, tabs)  # [B, N, Tq_p, Hv_p]
    out = out[:, :, :Tq, :v.shape[3]]
    return jnp.swapaxes(out, 1, 2).astype(q.dtype)
