"""The kernel's static configuration (:class:`KernelConfig`, hashable: a ``custom_vjp``
nondiff argument) and its array operands (:class:`Operands`, one pytree), both built by
:func:`prepare` from a validated :class:`jaxpos.core.call.AttentionCall`: tile sizes, the
tile schedule (:mod:`jaxpos.kernels.schedule`), the work split (query heads per program,
key splits), positions, segments and RoPE tables padded to whole tiles. q, k and v keep
the caller's ``[B, T, N, H]`` layout (no copies).

Field names follow the core's blocked inputs: ``q_pos``, ``kv_pos``, ``q_seg``,
``kv_seg``, ``kv_len``, ``drop_seed``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxpos import _checks
from jaxpos._util import pad_axis, pow2_at_least
from jaxpos.core.call import converted_mods
from jaxpos.core.quantised import is_quantised
from jaxpos.kernels import schedule as sched_lib
from jaxpos.mods import is_additive

DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 128
#: A forward program takes all ``g`` query heads of a KV head when ``block_q * g`` rows
#: fit this (decode-shaped calls); otherwise one query head per program.
GROUP_ROWS = 128
#: ``kv_splits=None`` splits the keys of a single-query-tile call until the forward grid
#: has about this many programs (flash decoding: a decode step has ``B * N_kv`` programs
#: otherwise, too few to fill a GPU).
SPLIT_PROGRAMS = 128


class KernelConfig(NamedTuple):
    """Static configuration of one call (hashable: a ``custom_vjp`` nondiff argument)."""

    B: int
    N: int
    groups: int  # N // N_kv
    Tq: int  # real lengths
    Tk: int
    H: int
    Hv: int
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
    heads: int = 1  # query heads per forward program (1, or groups)
    splits: int = 1  # key splits of the forward (flash decoding)
    has_kv_len: bool = False
    rope_half: int = 0  # RoPE pairs rotated in the kernel (0: none)
    rope_qb: bool = False  # the query tables differ per batch row
    rope_kb: bool = False
    dropout_rate: float = 0.0  # attention dropout (0: none); the seed is Operands.drop_seed
    dropout_broadcast: bool = False  # one [Tq, Tk] mask for every batch row and head
    paged: bool = False  # k, v are page pools read through Operands.page_table
    quantised: bool = False  # the pools hold int8 / float8 values, k_scale / v_scale scales


class Operands(NamedTuple):
    """The kernel's arrays (one pytree; the differentiable primals of its custom VJP).

    Fields: ``q [B, Tq, N, H]``, ``k [B, Tk, N_kv, H]``, ``v [B, Tk, N_kv, H_v]`` (the
    caller's layout); ``q_pos`` int32 ``[B|1, Tq_p, 1]``, ``kv_pos`` int32 ``[B|1, 1, Tk_p]``
    (padded to whole tiles with their last value); ``sched`` the tile
    :class:`jaxpos.kernels.schedule.Schedule`; ``q_seg`` / ``kv_seg`` int32 ``[B, Tq_p, 1]``
    / ``[B, 1, Tk_p]``, ``kv_len`` int32 ``[B]``, ``drop_seed`` uint32 ``[2]``, ``sinks``
    float32 ``[N]``, ``smod`` / ``mmod`` the converted mods (their captured arrays are
    leaves), ``tabs`` the RoPE tables padded to ``Tq_p`` / ``Tk_p``, ``page_table`` int32
    ``[B, pages_per_seq]`` with paged keys (then k, v are the ``[num_pages, page_size,
    N_kv, H]`` pools); ``k_scale`` / ``v_scale`` float32 ``[num_pages, page_size, N_kv,
    1]`` with quantised pools (then k, v hold their int8 / float8 values); each None when
    absent.
    """

    q: Any
    k: Any
    v: Any
    q_pos: Any
    kv_pos: Any
    sched: Any = None
    q_seg: Any = None
    kv_seg: Any = None
    kv_len: Any = None
    drop_seed: Any = None
    sinks: Any = None
    smod: Any = None
    mmod: Any = None
    tabs: Any = None
    page_table: Any = None
    k_scale: Any = None
    v_scale: Any = None


def check_block(name: str, blk: Any) -> int:
    """A tile size: a positive power of two.

    Raises:
      TypeError / ValueError: not a positive integer; not a power of two.
    """
    blk = _checks.check_positive_int(name, blk)
    if blk & (blk - 1):
        raise ValueError(f"{name} must be a power of two (Triton tiles; TPU needs block_q a "
                         f"multiple of 8 and block_k a multiple of 128); got {blk}.")
    return blk


def resolve_mode(interpret: Any) -> str:
    """``interpret`` (True / False / None) as the kernel's mode string.

    Raises:
      TypeError: ``interpret`` not a bool or None.
    """
    if interpret is None:
        return "auto"
    if not isinstance(interpret, bool):
        raise TypeError(f"interpret must be True, False or None; got {interpret!r}.")
    return "interpret" if interpret else "compiled"


def float64_refusal(dtypes: Any, mode: str) -> TypeError | None:
    """The refusal of float64 operands where the kernel is compiled (``mode`` "compiled",
    or "auto" off CPU): Triton and Mosaic kernels are built for float32, bfloat16 and
    float16. The Pallas interpreter (CPU) runs float64 operands, with the float32 softmax
    and accumulation of every engine (``jax_enable_x64`` checks against a reference)."""
    if not any(jnp.dtype(d) == jnp.float64 for d in dtypes):
        return None
    if mode == "interpret" or (mode == "auto" and jax.default_backend() == "cpu"):
        return None
    got = ", ".join(str(jnp.dtype(d)) for d in dtypes)
    return TypeError(
        f"implementation='pallas' compiles its kernel (Triton / Mosaic) for float32, bfloat16 "
        f"and float16 operands; got q, k, v dtypes {got}. Cast them to float32, or use "
        f"implementation='chunked' or 'reference' for float64 inputs (the Pallas "
        f"interpreter, interpret=True, runs them too).")


def tile_sizes(call: Any, Tq: int, Tk: int) -> tuple[int, int]:
    """``(bq, bk)``: the block mask's, else ``call.block_q`` / ``block_k`` (default 128)
    shrunk to the sequences (powers of two)."""
    if call.block_mask is not None:
        return (check_block("block_mask.block_q", call.block_mask.block_q),
                check_block("block_mask.block_k", call.block_mask.block_k))
    bq = check_block("block_q", DEFAULT_BLOCK_Q if call.block_q is None else call.block_q)
    bk = check_block("block_k", DEFAULT_BLOCK_K if call.block_k is None else call.block_k)
    return min(bq, pow2_at_least(Tq, 8)), min(bk, pow2_at_least(Tk, 8))


def _padded_operands(call, q, k, v, Tq_p: int, Tk_p: int) -> Operands:
    """Positions, segments, tables, lengths, sinks and the dropout seed of ``call``, padded
    to whole tiles (``O(T)``)."""
    B = q.shape[0]
    qp = pad_axis(call.q_positions, 1, Tq_p, mode="edge")
    kp = pad_axis(call.kv_positions, 1, Tk_p, mode="edge")
    ops = Operands(q, k, v, qp[:, :, None], kp[:, None, :], kv_len=call.kv_lengths)
    if call.segment_ids is not None:
        sq = jnp.broadcast_to(pad_axis(call.segment_ids, 1, Tq_p), (B, Tq_p))
        skv = jnp.broadcast_to(pad_axis(call.kv_segment_ids, 1, Tk_p), (B, Tk_p))
        ops = ops._replace(q_seg=sq[:, :, None], kv_seg=skv[:, None, :])
    if call.rope_tables is not None:
        t = call.rope_tables
        ops = ops._replace(tabs=(pad_axis(t[0], 1, Tq_p), pad_axis(t[1], 1, Tq_p),
                                 pad_axis(t[2], 1, Tk_p), pad_axis(t[3], 1, Tk_p)))
    if call.sinks is not None:
        ops = ops._replace(sinks=jnp.asarray(call.sinks, jnp.float32))
    if call.dropout is not None:
        ops = ops._replace(
            drop_seed=jnp.asarray(call.dropout.seed).astype(jnp.uint32).reshape(2))
    return ops


def _tile_kinds(call, ops: Operands, mmod, Tq, Tk, bq, bk, nq, nk):
    """The ``[S_b, S_h, nq, nk]`` EMPTY / PARTIAL / FULL kinds of the tiles."""
    seg_q = None if ops.q_seg is None else ops.q_seg[:, :, 0]
    seg_kv = None if ops.kv_seg is None else ops.kv_seg[:, 0, :]
    kinds = sched_lib.structural_kinds(
        causal=call.causal, q_pos=ops.q_pos[:, :, 0], kv_pos=ops.kv_pos[:, 0, :], seg_q=seg_q,
        seg_kv=seg_kv, Tq=Tq, Tk=Tk, bq=bq, bk=bk, nq=nq, nk=nk, kv_len=ops.kv_len)
    if call.block_mask is not None:
        return sched_lib.combine(kinds, call.block_mask.kinds)
    if mmod is not None:
        return jnp.where(kinds == sched_lib.FULL, sched_lib.PARTIAL, kinds)
    return kinds


def _work_split(kv_splits, *, B, N, g, nq, nk, bq, sched_h) -> tuple[int, int]:
    """``(heads, splits)``: query heads per forward program and key splits."""
    heads = g if (g > 1 and nq == 1 and not sched_h and bq * g <= GROUP_ROWS) else 1
    if kv_splits is None:
        splits = min(nk, max(1, SPLIT_PROGRAMS // (B * (N // heads)))) if nq == 1 else 1
    else:
        splits = min(nk, _checks.check_positive_int("kv_splits", kv_splits))
    return heads, -(-nk // -(-nk // splits))  # no empty split


def _keys(call, pages):
    """``(k, v, Tk, N_kv, page_table)``: the call's keys, or the page pools with the
    logical length ``pages_per_seq * page_size``."""
    if pages is None:
        k, v = jnp.asarray(call.k), jnp.asarray(call.v)
        return k, v, k.shape[1], k.shape[2], None
    k, v, table = pages  # (QuantisedPages read as their logical dtype here)
    return k, v, table.shape[1] * k.shape[1], k.shape[2], table


def prepare(call: Any, *, mode: str = "auto", kv_splits: int | None = None,
            pages: Any = None) -> tuple[KernelConfig, Operands]:
    """``(cfg, ops)`` of a validated, transformed call (nothing of ``call`` is checked
    again here; the kernel's own limits are: power-of-two tile sizes, ``kv_splits``).
    ``pages``: ``(k_pages, v_pages, page_table)`` read instead of ``call.k``, ``call.v``
    (key tiles are pages: ``call.block_k`` must be the page size).

    Raises:
      ValueError / TypeError: a tile size that is not a power of two; ``kv_splits`` not a
        positive integer; float64 operands where the kernel is compiled
        (:func:`float64_refusal`).
    """
    q = jnp.asarray(call.q)
    k: Any
    v: Any
    k, v, Tk, Nk, table = _keys(call, pages)
    refusal = float64_refusal((q.dtype, k.dtype, v.dtype), mode)
    if refusal is not None:
        raise refusal
    B, Tq, N, H = q.shape
    g = N // Nk
    bq, bk = tile_sizes(call, Tq, Tk)
    nq, nk = max(1, -(-Tq // bq)), max(1, -(-Tk // bk))
    smod, mmod = converted_mods(call, bq, bk)  # the validation's when the tile is the call's
    ops = _padded_operands(call, q, k, v, nq * bq, nk * bk)._replace(smod=smod, mmod=mmod,
                                                                      page_table=table)
    quantised = is_quantised(k)  # both pools or neither (jaxpos.kernels.paged.paged_refusal)
    if quantised:  # the kernel reads values and scales, and dequantises each page it loads
        ops = ops._replace(k=k.values, v=v.values, k_scale=k.scales, v_scale=v.scales)
    kinds = _tile_kinds(call, ops, mmod, Tq, Tk, bq, bk, nq, nk)
    sched_h = kinds.shape[1] > 1
    heads, splits = _work_split(kv_splits, B=B, N=N, g=g, nq=nq, nk=nk, bq=bq, sched_h=sched_h)
    ops = ops._replace(sched=sched_lib.build(kinds, splits=splits))
    tabs, drop = ops.tabs, call.dropout
    cfg = KernelConfig(
        B=B, N=N, groups=g, Tq=Tq, Tk=Tk, H=H, Hv=v.shape[3], bq=bq, bk=bk, nq=nq, nk=nk,
        scale=float(call.scale), causal=bool(call.causal), has_segments=ops.q_seg is not None,
        qpos_batched=ops.q_pos.shape[0] > 1, kvpos_batched=ops.kv_pos.shape[0] > 1,
        sched_b=kinds.shape[0] > 1, sched_h=sched_h, has_sinks=ops.sinks is not None,
        additive=is_additive(smod), precise=q.dtype == jnp.float32, mode=mode, heads=heads,
        splits=splits, has_kv_len=ops.kv_len is not None,
        rope_half=0 if tabs is None else tabs[0].shape[2],
        rope_qb=tabs is not None and tabs[0].shape[0] > 1,
        rope_kb=tabs is not None and tabs[2].shape[0] > 1,
        dropout_rate=0.0 if drop is None else float(drop.rate),
        dropout_broadcast=drop is not None and bool(drop.broadcast), paged=table is not None,
        quantised=quantised)
    return cfg, ops
