"""Attention under a device mesh: the dispatcher runs an engine per (batch, head) shard.

Inside ``jax.jit`` under a mesh, q, k and v are usually sharded over their batch axis (data
parallelism, FSDP) and their head axis (tensor parallelism). Attention never mixes batch
rows or heads, so each device can compute the rows and heads it holds with no
communication. This module makes every engine do that (:func:`run_sharded`, called by
:func:`jaxpos.core.engines.run` and :func:`jaxpos.core.engines.run_with_lse`):

* **Explicit axes** (``jax.sharding.AxisType.Explicit``, the default of ``jax.make_mesh``
  from JAX 0.10, under ``jax.set_mesh``): the shardings of q, k and v are part of their
  types, so they are read at trace time. Every engine then runs inside ``jax.shard_map``,
  manual over the mesh axes that shard the batch or the heads of q, with the batch and
  head specs of q; its output keeps them. A sequence axis or a head_dim axis sharded over
  the mesh is refused with a ``ValueError`` (naming ``context_parallel``): attention over
  a sharded sequence is context parallelism (:mod:`jaxpos.parallel`), which the caller
  asks for. An Explicit axis of size 1 that the types of q, k or v name counts too (a
  one-device shard is the whole array, but the engine's own constants would lack the
  axis in their types).
* **Auto axes** (``jax.sharding.Mesh``, or ``AxisType.Auto``): the shardings are decided
  by the compiler after tracing. An engine of plain XLA operations (reference and xla:
  ``compiler_partitioned = True``) is left to the compiler, which keeps the batch and
  head sharding of its inputs. An opaque kernel (Mosaic on TPU, Triton on GPU; the Pallas
  engine, and any registered engine that does not declare ``compiler_partitioned``)
  cannot be split by XLA, and the chunked engine's tile loop would be gathered, so they
  run inside ``jax.shard_map`` over every axis of the mesh (the one set with
  ``jax.set_mesh``, else the mesh of q's sharding), with the batch and the heads
  assigned to mesh axes by :func:`auto_axes`: axes named like a data axis
  (:data:`BATCH_AXIS_NAMES`) take the batch, axes named like a model axis
  (:data:`HEAD_AXIS_NAMES`) the heads, others by divisibility (batch first); axes named
  like a sequence axis (:data:`SEQUENCE_AXIS_NAMES`) take neither (q, k and v are
  replicated over them for the kernel). When q arrives sharded otherwise, XLA moves it to
  that layout first; under Explicit axes nothing is guessed.

Inside a shard, the call is the global call restricted to the shard's rows and heads:
positions, segment ids, ``kv_lengths``, RoPE tables and block-mask tables are sliced with
the batch, sinks with the heads, and the score_mod and mask_mod see GLOBAL batch and head
indices (the shard's offsets are added), so per-head parameters captured by a score_mod
(ALiBi slopes, T5 / KERPLE / FIRE tables) follow their heads. The arrays a
score_mod, a mask_mod or the scheme captures (JAX arrays, traced or concrete: RoPE's
``inv_freq`` of a scheme built under ``jax.set_mesh`` outside ``jit`` is committed to the
mesh, and ``shard_map`` may not close over an array of a mesh with Explicit axes) go in
as ``shard_map`` arguments, replicated. Grouped-query heads stay
with their group: when the head shards do not divide ``N_kv``, each shard takes the one
key/value head its query heads share. Gradients come back through ``shard_map``'s
transpose (those of replicated inputs, such as a captured table, are summed over the
shards).

Paged calls (:mod:`jaxpos.core.paged`) and decode steps split the same way: each shard
runs the engine's paged path (the chunked page walk, the Pallas paged kernel, or the
engine on the pages it gathers) on the page table and ``kv_lengths`` of its rows and the
pool's key/value heads of its query heads. The pool ``[num_pages, page_size, N_kv, H]``
is sharded over its key/value heads only: any row may read any page, so its pages are
replicated over the batch axes (a pool sharded over its pages is gathered first, by
``jax.sharding.reshard`` under Explicit axes, by XLA under Auto axes).

Refused (``ValueError`` naming what to do): a sequence- or head_dim-sharded q, k or v
under Explicit axes; head shards that split a grouped-query group in a way no kv head
layout fits; attention dropout with a mask per batch row and head when the batch or the
heads are sharded (use ``broadcast_dropout=True``, or dropout outside attention).
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpos import _checks
from jaxpos._util import varying_axes

if TYPE_CHECKING:
    from jaxpos.core.call import AttentionCall

__all__ = ["BATCH_AXIS_NAMES", "HEAD_AXIS_NAMES", "SEQUENCE_AXIS_NAMES", "ShardPlan",
           "auto_axes", "plan_shards", "run_sharded"]

#: Mesh axis names that take the batch under Auto axes (data parallelism, FSDP).
BATCH_AXIS_NAMES = ("data", "batch", "fsdp", "dp", "replica", "pod")
#: Mesh axis names that take the heads under Auto axes (tensor parallelism).
HEAD_AXIS_NAMES = ("model", "tensor", "heads", "head", "tp", "mp")
#: Mesh axis names that take neither under Auto axes (context parallelism's axes).
SEQUENCE_AXIS_NAMES = ("seq", "sequence", "context", "cp", "sp", "length")


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """How a call is split: the mesh, the axes ``shard_map`` is manual over, the mesh axes
    of the batch and of the heads of q (``()`` for none), whether k and v are sharded with
    q's heads (else each shard slices the one key/value head its query heads share), and
    whether the inputs must be resharded to the plan's specs first (Explicit axes)."""

    mesh: Any
    manual: tuple[str, ...]
    batch: tuple[str, ...]
    heads: tuple[str, ...]
    kv_heads_sharded: bool
    explicit: bool

    def size(self, axes: tuple[str, ...]) -> int:
        sizes = dict(zip(self.mesh.axis_names, self.mesh.axis_sizes))
        return math.prod(sizes[a] for a in axes)


# ------------------------------------------------------------------------ the mesh
def _axis_type_name(t: Any) -> str:
    return str(getattr(t, "name", t)).lower()


def _free_axes(mesh: Any, named: frozenset = frozenset()
               ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(explicit, auto)`` axes of ``mesh`` that are not manual already: those of size >
    1, and Explicit axes of size 1 in ``named`` (the axes q, k and v's types name: an array
    typed as sharded over a one-device axis keeps that axis in the types an engine builds
    from it, which then differ from those of the constants it starts from, e.g. a loop's
    carry; run per shard, the axis is manual and the types agree)."""
    types = getattr(mesh, "axis_types", None) or ("auto",) * len(mesh.axis_names)
    explicit, auto = [], []
    for name, size, t in zip(mesh.axis_names, mesh.axis_sizes, types):
        kind = _axis_type_name(t)
        if kind == "manual":
            continue
        if size > 1 or (kind == "explicit" and name in named):
            (explicit if kind == "explicit" else auto).append(name)
    return tuple(explicit), tuple(auto)


def _mesh_of(x: Any) -> Any:
    """The mesh set with ``jax.set_mesh``, else the one of ``x``'s sharding, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is not None and not mesh.empty:
        return mesh
    sharding = getattr(jax.typeof(x), "sharding", None) if isinstance(x, jax.Array) else None
    mesh = getattr(sharding, "mesh", None)
    return None if mesh is None or getattr(mesh, "empty", True) else mesh


def _spec_axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _spec_of(x: Any) -> tuple[tuple[str, ...], ...]:
    """The mesh axes of each dimension of ``x``'s sharding (empty under Auto axes)."""
    sharding = getattr(jax.typeof(x), "sharding", None) if isinstance(x, jax.Array) else None
    spec = tuple(getattr(sharding, "spec", None) or ())
    spec = spec + (None,) * (x.ndim - len(spec))
    return tuple(_spec_axes(e) for e in spec)


# ------------------------------------------------------------------------ the plan
def auto_axes(axes: tuple[str, ...], mesh: Any, batch: int, num_heads: int,
              num_kv_heads: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(batch_axes, head_axes)``: which of the Auto ``axes`` of ``mesh`` take the batch
    and which the heads of a ``[batch, T, num_heads, H]`` call (see the module
    docstring). An axis takes a role only if the role's size stays divisible."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    b_axes: list[str] = []
    h_axes: list[str] = []
    fits_b = lambda a: batch % (math.prod(sizes[x] for x in b_axes) * sizes[a]) == 0
    fits_h = lambda a: _heads_fit(num_heads, num_kv_heads,
                                  math.prod(sizes[x] for x in h_axes) * sizes[a])
    for a in axes:
        name = a.lower()
        if name in SEQUENCE_AXIS_NAMES:
            continue
        if name in BATCH_AXIS_NAMES:
            order = (b_axes, h_axes)
        elif name in HEAD_AXIS_NAMES:
            order = (h_axes, b_axes)
        else:
            order = (b_axes, h_axes)
        for role in order:
            if (fits_b if role is b_axes else fits_h)(a):
                role.append(a)
                break
    return tuple(b_axes), tuple(h_axes)


def _heads_fit(N: int, N_kv: int, shards: int) -> bool:
    """Whether ``N`` query heads split into ``shards`` keeping each shard's query heads
    with key/value heads it can hold: ``N_kv`` divisible too, or every shard's heads
    inside one group."""
    if N % shards:
        return False
    group = N // N_kv
    return N_kv % shards == 0 or group % (N // shards) == 0


def _context_error(what: str, name: str, axes: tuple[str, ...]) -> ValueError:
    return ValueError(
        f"attention got {name} with its {what} sharded over the mesh axes {list(axes)}; it "
        f"splits batch and heads over a mesh, never the {what}. For a sequence-sharded "
        f"layer use context parallelism: the modules' context_parallel='ring' or "
        f"'ulysses' (context_axis=...), or jaxpos.parallel.ring_attention / "
        f"ulysses_attention inside jax.shard_map; or reshard {name} to P(batch_axes, None, "
        f"head_axes, None) first (jax.sharding.reshard).")


def _explicit_plan(call: AttentionCall, mesh: Any, explicit: tuple[str, ...]
                   ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(batch_axes, head_axes)`` read from q's sharding (Explicit axes), after checking
    that no sequence or head_dim axis of q, k or v is sharded."""
    for name, x in (("q", call.q), ("k", call.k), ("v", call.v)):
        spec = _spec_of(x)
        if spec[1]:
            raise _context_error("sequence", name, spec[1])
        if spec[3]:
            raise ValueError(f"attention got {name} with its head_dim sharded over the mesh "
                             f"axes {list(spec[3])}; shard the batch and the heads instead "
                             f"(reshard {name} to P(batch_axes, None, head_axes, None)).")
    spec = _spec_of(call.q)
    batch, heads = tuple(a for a in spec[0] if a in explicit), \
        tuple(a for a in spec[2] if a in explicit)
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    shards = math.prod(sizes[a] for a in heads)
    if heads and not _heads_fit(call.num_heads, call.num_kv_heads, shards):
        raise ValueError(
            f"q's {call.num_heads} heads are sharded {shards} ways over {list(heads)}, which "
            f"splits its grouped-query groups ({call.num_kv_heads} key/value heads) across "
            f"devices; shard the heads a number of ways that divides {call.num_kv_heads}, "
            f"or that keeps each device's query heads in one group.")
    return batch, heads


def plan_shards(engine: Any, call: AttentionCall) -> ShardPlan | None:
    """How ``engine`` runs ``call`` under the current mesh, or None to run it as it is
    (no mesh, a one-device mesh, or Auto axes with an engine the compiler partitions).

    Raises:
      ValueError: under Explicit axes, a sequence- or head_dim-sharded q, k or v (naming
        ``context_parallel``), or head shards that split a grouped-query group; per-row
        dropout with the batch or heads sharded.
    """
    mesh = _mesh_of(call.q)
    if mesh is None:
        return None
    named = frozenset(a for x in (call.q, call.k, call.v) for e in _spec_of(x) for a in e)
    explicit, auto = _free_axes(mesh, named)
    if not explicit and not auto:
        return None
    if varying_axes(call.q):  # inside a shard_map that checks varying types (context
        # parallelism's, manual over its sequence axis): a nested shard_map's transpose
        # rebinds that axis, so the engine runs on the shard's arrays as the ring's blocks
        # do, the other axes left to the compiler (Auto) or to the arrays' types (Explicit)
        return None
    compiler = bool(getattr(engine, "compiler_partitioned", False))
    if explicit:
        batch, heads = _explicit_plan(call, mesh, explicit)
        manual = tuple(a for a in mesh.axis_names if a in explicit or (a in auto and not compiler))
        if not compiler and auto:  # an opaque kernel: the Auto axes too, by name
            b2, h2 = auto_axes(auto, mesh, call.batch, call.num_heads, call.num_kv_heads)
            batch, heads = batch + b2, heads + h2
    elif compiler:
        return None
    else:
        batch, heads = auto_axes(auto, mesh, call.batch, call.num_heads, call.num_kv_heads)
        manual = tuple(a for a in mesh.axis_names if a in auto)
    if not batch and not heads and not manual:
        return None
    plan = ShardPlan(mesh=mesh, manual=manual, batch=batch, heads=heads,
                     kv_heads_sharded=call.num_kv_heads % max(1, _size(mesh, heads)) == 0,
                     explicit=bool(explicit))
    d = call.dropout
    if d is not None and not d.broadcast and (batch or heads):
        raise ValueError(
            f"attention dropout with a mask per batch row and head (broadcast_dropout=False) "
            f"is not computed per shard: the batch or the heads are sharded over the mesh "
            f"axes {list(batch + heads)}. Pass broadcast_dropout=True (one mask for every row "
            f"and head), or dropout_rate=0 inside attention.")
    return plan


def _size(mesh: Any, axes: tuple[str, ...]) -> int:
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    return math.prod(sizes[a] for a in axes)


# ------------------------------------------------------------------- the shard_map
def _entry(axes: tuple[str, ...]) -> Any:
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _lead_spec(x: Any, B: int, lead: Any, ndim: int | None = None) -> P:
    """``P(lead, None, ...)`` for an array whose first axis is the batch ``B`` (a
    broadcast ``1`` stays replicated)."""
    n = x.ndim if ndim is None else ndim
    first = lead if x.shape[0] == B and B > 1 else None
    return P(first, *([None] * (n - 1)))


def _offset_mod(fn: Callable | None, b_off: Any, h_off: Any, kind: str,
                captured: dict[int, Any]) -> Callable | None:
    """``fn`` taking the shard's local batch and head indices: the global ones are passed on
    (so captured per-head and per-row arrays are indexed as in the global call). The
    arrays ``fn`` captures are swapped for the shard's own copies (``captured``: id of the
    captured array -> the value ``shard_map`` passed in), since a ``shard_map`` body may
    not close over arrays of a mesh with Explicit axes."""
    if fn is None:
        return None

    traced = _swapped(fn, captured, {})

    if kind == "score":
        def score_mod(score, batch, head, q_pos, kv_pos):
            return traced(score, batch + b_off, head + h_off, q_pos, kv_pos)
        score_mod.__qualname__ = getattr(fn, "__qualname__", "score_mod")
        return score_mod

    def mask_mod(batch, head, q_pos, kv_pos):
        return traced(batch + b_off, head + h_off, q_pos, kv_pos)
    mask_mod.__qualname__ = getattr(fn, "__qualname__", "mask_mod")
    return mask_mod


def _swapped(obj: Any, captured: dict[int, Any], seen: dict[int, Any]) -> Any:
    """``obj`` with every captured array of ``captured`` replaced, through the closures of
    functions, tuples, lists and pytrees (a score_mod built by a scheme or composed of
    several closes over its tables that way)."""
    if id(obj) in captured:
        return captured[id(obj)]
    if id(obj) in seen:
        return seen[id(obj)]
    if isinstance(obj, types.FunctionType) and obj.__closure__:
        cells = tuple(types.CellType(_swapped(c.cell_contents, captured, seen))
                      if c.cell_contents is not None else c for c in obj.__closure__)
        new = types.FunctionType(obj.__code__, obj.__globals__, obj.__name__,
                                 obj.__defaults__, cells)
        new.__kwdefaults__, new.__qualname__ = obj.__kwdefaults__, obj.__qualname__
        seen[id(obj)] = new
        return new
    if isinstance(obj, types.MethodType):
        return types.MethodType(_swapped(obj.__func__, captured, seen),
                                _swapped(obj.__self__, captured, seen))
    if isinstance(obj, (tuple, list)) and type(obj) in (tuple, list):
        return type(obj)(_swapped(x, captured, seen) for x in obj)
    if isinstance(obj, (jax.Array, types.FunctionType, str, int, float, type(None))):
        return obj
    leaves, tree = jax.tree_util.tree_flatten(obj)
    if len(leaves) == 1 and leaves[0] is obj:
        return obj
    return jax.tree_util.tree_unflatten(tree, [_swapped(x, captured, seen) for x in leaves])


def _index(axes: tuple[str, ...]) -> Any:
    return jnp.int32(0) if not axes else jax.lax.axis_index(_entry(axes))


def run_sharded(engine: Any, call: AttentionCall, run: Callable[..., Any],
                *, with_lse: bool = False, pages: tuple[Any, Any, Any] | None = None) -> Any:
    """``run(call)`` split over the current mesh as :func:`plan_shards` says (``run(call)``
    itself when it says None).

    ``run`` returns ``out [B, Tq, N, H_v]`` (or ``(out, lse [B, N, Tq])`` with
    ``with_lse``); the result keeps the batch and head sharding of the plan.

    A paged call (:mod:`jaxpos.core.paged`, whose ``k`` and ``v`` are the logical shapes
    only) passes ``pages=(k_pages, v_pages, page_table)`` and is run as ``run(call,
    k_pages, v_pages, page_table)``: each shard gets the page table and ``kv_lengths``
    of its rows and the pool's key/value heads of its query heads (``[num_pages,
    page_size, N_kv / shards, H]``, or the one key/value head its query heads share);
    the pool's pages are replicated over the batch axes (any row may read any page: a
    pool sharded over its pages is gathered first).

    Raises:
      ValueError: see :func:`plan_shards`.
    """
    plan = plan_shards(engine, call)
    if plan is None:
        return run(call) if pages is None else run(call, *pages)
    B, N = call.batch, call.num_heads
    b, h = _entry(plan.batch), _entry(plan.heads)
    nb, nh = plan.size(plan.batch), plan.size(plan.heads)
    kvh = h if plan.kv_heads_sharded else None
    group = N // call.num_kv_heads

    # the call's arrays: (name, value, spec)
    arrays: dict[str, tuple[Any, P]] = {"q": (call.q, P(b, None, h, None))}
    if pages is None:
        arrays["k"] = (call.k, P(b, None, kvh, None))
        arrays["v"] = (call.v, P(b, None, kvh, None))
    else:  # the pool over the kv heads only; the table with the batch
        arrays["k"] = (pages[0], P(None, None, kvh, None))
        arrays["v"] = (pages[1], P(None, None, kvh, None))
        arrays["page_table"] = (pages[2], _lead_spec(pages[2], B, b))
    arrays["q_positions"] = (call.q_positions, _lead_spec(call.q_positions, B, b))
    arrays["kv_positions"] = (call.kv_positions, _lead_spec(call.kv_positions, B, b))
    for name in ("segment_ids", "kv_segment_ids", "kv_lengths"):
        x = getattr(call, name)
        if x is not None:
            arrays[name] = (x, _lead_spec(x, B, b))
    if call.sinks is not None:
        arrays["sinks"] = (call.sinks, P(h))
    if call.mask is not None:
        m = call.mask
        arrays["mask"] = (m, P(b if m.shape[0] == B and B > 1 else None,
                               h if m.shape[1] == N and N > 1 else None, None, None))
    if call.rope_tables is not None:
        for i, t in enumerate(call.rope_tables):
            arrays[f"rope{i}"] = (t, _lead_spec(t, B, b))
    if call.dropout is not None:
        arrays["dropout_seed"] = (call.dropout.seed, P())
    bm = call.block_mask
    if bm is not None:
        for name in bm._children:
            x = getattr(bm, name)
            if name.endswith("positions"):
                arrays[f"bm_{name}"] = (x, _lead_spec(x, B, b))
            else:
                arrays[f"bm_{name}"] = (x, P(b if x.shape[0] == B and B > 1 else None,
                                             h if x.shape[1] == N and N > 1 else None,
                                             *([None] * (x.ndim - 2))))
    consts = [c for conv in (call.score_conv, call.mask_conv) if conv is not None
              for c in conv.consts]
    consts += jax.tree_util.tree_leaves(call.scheme)  # the scheme's tables (RoPE's inv_freq)
    # Traced arrays, and concrete JAX arrays too (a scheme built under jax.set_mesh outside
    # jit holds arrays committed to the mesh, which shard_map may not close over when its
    # axes are Explicit), go in as arguments, replicated; NumPy constants stay captured.
    captured: list[Any] = []
    for c in consts:
        if isinstance(c, jax.Array) and all(c is not x for x in captured):
            captured.append(c)
    for i, c in enumerate(captured):  # a score_mod's traced arrays, replicated
        arrays[f"captured{i}"] = (c, P())
    if not _concrete_scale(call.scale):
        arrays["scale"] = (jnp.asarray(call.scale), P())
    names = tuple(arrays)
    values = [arrays[n][0] for n in names]
    specs = tuple(arrays[n][1] for n in names)
    if plan.explicit:
        values = [_resharded(x, s, plan) for x, s in zip(values, specs)]

    def local(*vals):
        got = dict(zip(names, vals))
        b_off = _index(plan.batch) * (B // nb)
        h_off = _index(plan.heads) * (N // nh)
        k, v = got["k"], got["v"]
        if nh > 1 and not plan.kv_heads_sharded:  # every shard's heads share one kv head
            kv = h_off // group
            k = jax.lax.dynamic_slice_in_dim(k, kv, 1, axis=2)
            v = jax.lax.dynamic_slice_in_dim(v, kv, 1, axis=2)
        swap = {id(c): got[f"captured{i}"] for i, c in enumerate(captured)}
        if pages is not None:  # the shard's logical keys: shapes only, as the call's
            k_pool, v_pool = k, v
            rows = (B // nb, call.kv_len)
            k = jax.ShapeDtypeStruct(rows + k_pool.shape[2:], k_pool.dtype)
            v = jax.ShapeDtypeStruct(rows + v_pool.shape[2:], v_pool.dtype)
        changes: dict[str, Any] = dict(
            q=got["q"], k=k, v=v, q_positions=got["q_positions"],
            kv_positions=got["kv_positions"], kv_overflow=None,
            score_mod=_offset_mod(call.score_mod, b_off, h_off, "score", swap),
            mask_mod=_offset_mod(call.mask_mod, b_off, h_off, "mask", swap),
            score_conv=None, mask_conv=None, mod_tile=(0, 0),
            scheme=_swapped(call.scheme, swap, {}))
        for name in ("segment_ids", "kv_segment_ids", "kv_lengths", "sinks", "mask"):
            if name in got:
                changes[name] = got[name]
        if "scale" in got:
            changes["scale"] = got["scale"]
        if call.rope_tables is not None:
            changes["rope_tables"] = type(call.rope_tables)(
                *(got[f"rope{i}"] for i in range(len(call.rope_tables))))
        if call.dropout is not None:
            changes["dropout"] = call.dropout._replace(seed=got["dropout_seed"])
        if bm is not None:
            fields = {n: got[f"bm_{n}"] for n in bm._children}
            fields.update({n: getattr(bm, n) for n in bm._static})
            fields["mask_mod"] = changes["mask_mod"]
            changes["block_mask"] = type(bm)(**fields)
        if pages is not None:
            return run(call.replace(**changes), k_pool, v_pool, got["page_table"])
        return run(call.replace(**changes))

    out_spec = P(b, None, h, None)
    out_specs = (out_spec, P(b, h, None)) if with_lse else out_spec
    fn = jax.shard_map(local, mesh=plan.mesh, in_specs=specs, out_specs=out_specs,
                       axis_names=frozenset(plan.manual), check_vma=False)
    return fn(*values)


def _concrete_scale(scale: Any) -> bool:
    return _checks.is_concrete(scale)


def _resharded(x: Any, spec: P, plan: ShardPlan) -> Any:
    """``x`` with the sharding ``spec`` on the plan's manual axes (Explicit axes:
    ``shard_map`` takes inputs whose type matches its ``in_specs``); a small array or a
    slice costs nothing, q, k and v were checked not to need a gather."""
    if not isinstance(x, jax.Array):
        x = jnp.asarray(x)
    if _spec_of(x) == tuple(_spec_axes(e) for e in (tuple(spec) + (None,) * (x.ndim - len(spec)))):
        return x
    return jax.sharding.reshard(x, spec)
