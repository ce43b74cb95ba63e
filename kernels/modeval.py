"""Evaluate a converted score_mod / mask_mod inside a Pallas kernel, reading its captured
arrays from kernel refs.

:func:`jaxpos.mods.convert_mod` turns a score_mod into a jaxpr whose captured arrays
(slopes, a T5 offset vector, a user's table, per-token gates) are explicit inputs. The
kernel receives those arrays as refs. Loading a whole table and indexing the loaded value
(``vec[head][idx]`` as a value gather) lowers nowhere: Triton and Mosaic have no general
gather on values. So this module walks the jaxpr itself and keeps every captured array a
*view of its ref* while the jaxpr only indexes it:

* ``dynamic_slice`` / ``slice`` / ``squeeze`` of a view narrow the view (no load);
* ``gather`` from a view becomes **one indexed load** from the ref (``ref[h, idx]``,
  Triton's pointer-tensor load, the same instruction as any tile load), or, where the
  compiler has no indexed load (Mosaic TPU), a loop over the index values present in the
  tile reading scalars from SMEM (``style="loop"``);
* any other use loads the view (a scalar for ``slopes[head]``, a block otherwise) and
  binds the primitive as usual.

Gather index vectors are built by ``jnp`` indexing as ``broadcast_in_dim`` +
``concatenate`` along a trailing axis; those are kept symbolic too, so no concatenation
reaches the compiler. Semantics follow ``lax.gather`` / ``lax.dynamic_slice`` exactly:
dynamic-slice starts are clamped into range, gather indices are clamped
(``PROMISE_IN_BOUNDS``, ``CLIP``) or out-of-range entries filled (``FILL_OR_DROP``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.extend import core as jex

__all__ = ["Loader", "LoopLoader", "RefLoader", "UsageRecorder", "eval_converted"]


# ------------------------------------------------------------------------ lazy values
class _Idx:
    """A ref dimension indexed by one scalar; ``keep`` leaves it as a size-1 dim."""

    def __init__(self, index, keep):
        self.index, self.keep = index, keep


class _Rng:
    """A ref dimension read over ``[start, start + size)``."""

    def __init__(self, start: Any, size):
        self.start, self.size = start, size


class _View:
    """A captured array still in its ref: ``entries[d]`` says how ref dim ``d`` is read."""

    def __init__(self, slot: int, entries: list, dtype: Any):
        self.slot, self.entries, self.dtype = slot, entries, dtype

    @property
    def logical(self) -> list[int]:
        """Ref dims that are dims of the value (in order)."""
        return [d for d, e in enumerate(self.entries)
                if isinstance(e, _Rng) or (isinstance(e, _Idx) and e.keep)]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.entries[d].size if isinstance(self.entries[d], _Rng) else 1
                     for d in self.logical)


class _Bcast:
    """A scalar broadcast to ``shape`` (kept symbolic: a gather index that is a scalar)."""

    def __init__(self, scalar, shape: tuple[int, ...]):
        self.scalar, self.shape = scalar, tuple(shape)


class _Stack:
    """Gather index vectors ``[..., len(comps)]``: one index array (or _Bcast) per entry."""

    def __init__(self, comps: list, shape: tuple[int, ...]):
        self.comps, self.shape = list(comps), tuple(shape)  # shape without the last axis


# -------------------------------------------------------------------------- loaders
class Loader:
    """How views become values. ``refs[slot]`` is the ref of captured array ``slot``."""

    def __init__(self, refs: Sequence[Any]):
        self.refs = list(refs)

    def load(self, view: _View) -> Any:
        """Load a view (scalars and ranges) as a value of ``view.shape``."""
        idx = []
        for e in view.entries:
            if isinstance(e, _Idx):
                idx.append(pl.ds(e.index, 1) if e.keep else e.index)
            else:
                idx.append(pl.ds(e.start, e.size))
        ref = self.refs[view.slot]
        return ref[tuple(_lead(ref, view) + idx)]

    def gather(self, view: _View, per_dim: list, shape: tuple[int, ...], dtype: Any) -> Any:
        """``per_dim[d]``: a scalar or an int32 array (of ``shape``, or a _Bcast) per ref
        dim, already clamped in range. Returns the gathered values, ``shape``."""
        raise NotImplementedError


def _lead(ref, view):
    """Indices of the leading size-1 axes a kernel adds to low-rank captured arrays."""
    return [0] * (len(ref.shape) - len(view.entries))


def _materialize_index(x, shape):
    if isinstance(x, _Bcast):
        return jnp.broadcast_to(x.scalar, shape)
    return jnp.broadcast_to(x, shape)


class RefLoader(Loader):
    """Indexed loads (Triton's pointer-tensor loads; gathers in interpret mode)."""

    def gather(self, view: Any, per_dim: Any, shape: tuple[int, ...], dtype: Any) -> Any:
        ref = self.refs[view.slot]
        lead = [jnp.zeros(shape, jnp.int32)] * (len(ref.shape) - len(view.entries))
        idx = tuple(lead + [_materialize_index(x, shape) for x in per_dim])
        return ref[idx]


def _is_array(x):
    return isinstance(x, _Bcast) or (hasattr(x, "shape") and len(x.shape) > 0)


class LoopLoader(Loader):
    """For compilers without indexed loads (Mosaic TPU): the one array index of a gather
    is looped over the values it takes in the tile, ``min(idx) .. max(idx)``, each step a
    scalar load (the captured array lives in SMEM) selected with ``where``. Cost per tile:
    ``O(index range x index array size)``; the index range of a tile of relative offsets
    is at most ``bq + bk - 1`` whatever the table size."""

    def gather(self, view: Any, per_dim: Any, shape: tuple[int, ...], dtype: Any) -> Any:
        arrays = [d for d, x in enumerate(per_dim) if _is_array(x) and not isinstance(x, _Bcast)]
        scal = [x.scalar if isinstance(x, _Bcast) else x for x in per_dim]
        ref = self.refs[view.slot]
        scal = _lead(ref, view) + scal
        if not arrays:
            return jnp.broadcast_to(ref[tuple(scal)], shape)
        if len(arrays) > 1:
            raise ValueError(
                "a score_mod/mask_mod indexes a captured array with more than one index "
                "array at once (e.g. table[q_pos, kv_pos]); the TPU kernel gathers along one "
                "axis only. Index one axis with a scalar (batch, head) or use "
                "implementation='chunked'.")
        ix = jnp.broadcast_to(per_dim[arrays[0]], shape)
        d = arrays[0] + len(scal) - len(per_dim)  # the looped axis of the captured array

        def step(r, acc):
            at: list[Any] = list(scal)
            at[d] = r
            return jnp.where(ix == r, ref[tuple(at)].astype(dtype), acc)

        return jax.lax.fori_loop(jnp.min(ix), jnp.max(ix) + 1, step, jnp.zeros(shape, dtype))


class UsageRecorder(Loader):
    """A dry run: records, per captured array, whether it is ever loaded as a non-scalar
    block (``dense``) rather than by scalar or indexed loads. The TPU kernel keeps arrays
    that are only indexed in SMEM (scalar memory) and the others in VMEM."""

    def __init__(self, shapes_dtypes: Any):
        super().__init__([None] * len(shapes_dtypes))
        self.avals = list(shapes_dtypes)
        self.dense = [False] * len(shapes_dtypes)

    def load(self, view: Any) -> Any:
        if any(isinstance(e, _Rng) and e.size > 1 for e in view.entries):
            self.dense[view.slot] = True
        return jnp.zeros(view.shape, view.dtype)

    def gather(self, view: Any, per_dim: Any, shape: tuple[int, ...], dtype: Any) -> Any:
        return jnp.zeros(shape, dtype)


# ------------------------------------------------------------------------ evaluation
def _clamp(i, lo, hi):
    return jnp.clip(i, lo, hi) if not isinstance(i, (int, np.integer)) else min(max(i, lo), hi)


def _view_dynamic_slice(view: _View, starts, sizes):
    entries = list(view.entries)
    for ld, rd in enumerate(view.logical):
        e, size = entries[rd], sizes[ld]
        full = e.size if isinstance(e, _Rng) else 1
        if size == full:
            continue
        start = _clamp(jnp.asarray(starts[ld], jnp.int32) if not isinstance(starts[ld], int)
                       else starts[ld], 0, full - size)
        base = e.start
        entries[rd] = (_Idx(base + start, True) if size == 1 else _Rng(base + start, size))
    return _View(view.slot, entries, view.dtype)


def _view_squeeze(view: _View, dims):
    entries = list(view.entries)
    logical = view.logical
    for ld in dims:
        rd = logical[ld]
        e = entries[rd]
        entries[rd] = _Idx(e.index, False) if isinstance(e, _Idx) else _Idx(e.start, False)
    return _View(view.slot, entries, view.dtype)


_FILL_OR_DROP = jax.lax.GatherScatterMode.FILL_OR_DROP


def _gather_fill(dtype, fill_value):
    if fill_value is not None:
        return fill_value
    dt = np.dtype(dtype)
    if np.issubdtype(dt, np.inexact):
        return np.nan
    if dt == np.bool_:
        return True
    if np.issubdtype(dt, np.signedinteger):
        return np.iinfo(dt).min
    return np.iinfo(dt).max


def _try_view_gather(view: _View, indices, params, loader: Loader):
    """The gather as an indexed load, or None when its form is not the plain
    ``x[i0, i1, ...]`` (every operand dim indexed, one element each)."""
    dn = params["dimension_numbers"]
    logical = view.logical
    nd = len(logical)
    if (dn.offset_dims or getattr(dn, "operand_batching_dims", ()) or
            sorted(dn.collapsed_slice_dims) != list(range(nd)) or
            sorted(dn.start_index_map) != list(range(nd)) or
            any(s != 1 for s in params["slice_sizes"])):
        return None
    if isinstance(indices, _Stack):
        comps, shape = indices.comps, indices.shape
    else:
        ind = indices
        shape = tuple(ind.shape[:-1])
        comps = [ind[..., c] for c in range(ind.shape[-1])]
    if len(comps) != nd:
        return None
    mode = params.get("mode")
    per_dim = []
    in_bounds = None
    for rd, e in enumerate(view.entries):
        if rd not in logical:
            per_dim.append(e.index)
            continue
        ld = logical.index(rd)
        comp = comps[dn.start_index_map.index(ld)]
        size = e.size if isinstance(e, _Rng) else 1
        base = e.start if isinstance(e, _Rng) else e.index
        raw = comp.scalar if isinstance(comp, _Bcast) else comp
        raw = jnp.asarray(raw).astype(jnp.int32)
        if mode == _FILL_OR_DROP:
            ok = (raw >= 0) & (raw <= size - 1)
            in_bounds = ok if in_bounds is None else in_bounds & ok
        clamped = jnp.clip(raw, 0, size - 1) + base
        per_dim.append(_Bcast(clamped, shape) if isinstance(comp, _Bcast) else clamped)
    out = loader.gather(view, per_dim, shape, view.dtype)
    if in_bounds is not None:
        fill = _gather_fill(view.dtype, params.get("fill_value"))
        out = jnp.where(jnp.broadcast_to(in_bounds, shape), out, jnp.asarray(fill, view.dtype))
    return out


def _materialize(x, loader: Loader):
    if isinstance(x, _View):
        return loader.load(x)
    if isinstance(x, _Bcast):
        return jnp.broadcast_to(x.scalar, x.shape)
    if isinstance(x, _Stack):
        return jnp.concatenate([_materialize_index(c, x.shape)[..., None] for c in x.comps],
                               axis=-1)
    return x


_CALLS = ("pjit", "jit", "closed_call", "core_call")
# A custom_vjp call (e.g. the offset lookup of jaxpos.mods.offset_score_mod) is evaluated
# through its primal jaxpr: the kernels never take its VJP, and Triton lowers no such call.
_CUSTOM_CALLS = ("custom_vjp_call",)


def _eval(jaxpr, consts, args, loader: Loader):
    env: dict = {}

    def read(v):
        if isinstance(v, jex.Literal):
            return v.val
        return env[v]

    def write(v, val):
        if not isinstance(v, jex.DropVar):
            env[v] = val

    for v, c in zip(jaxpr.constvars, consts):
        write(v, c)
    for v, a in zip(jaxpr.invars, args):
        write(v, a)
    for eqn in jaxpr.eqns:
        vals = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        lazy = [isinstance(x, (_View, _Bcast, _Stack)) for x in vals]
        out = (_lazy_rule(eqn, name, vals, loader)
               if any(lazy) or name == "broadcast_in_dim" else None)
        if out is None and (name in _CALLS and any(lazy) or name in _CUSTOM_CALLS):
            inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
            if isinstance(inner, jex.ClosedJaxpr):
                out = _eval(inner.jaxpr, inner.consts, vals, loader)
            elif inner is not None:
                out = _eval(inner, (), vals, loader)
            else:
                raise NotImplementedError(f"a score_mod/mask_mod calls {name!r} without a "
                                          f"readable jaxpr; use implementation='chunked'.")
            outs = out
        elif out is not None:
            outs = [out]
        else:
            vals = [_materialize(x, loader) for x in vals]
            bp = eqn.primitive.get_bind_params(eqn.params)
            subfuns, bind_params = bp if isinstance(bp, tuple) else ((), bp)
            ctx = getattr(getattr(eqn, "ctx", None), "manager", None)
            if ctx is not None:
                with ctx:
                    outs = eqn.primitive.bind(*subfuns, *vals, **bind_params)
            else:
                outs = eqn.primitive.bind(*subfuns, *vals, **bind_params)
            if not eqn.primitive.multiple_results:
                outs = [outs]
        for v, o in zip(eqn.outvars, outs):
            write(v, o)
    return [read(v) for v in jaxpr.outvars]


def _lazy_rule(eqn, name, vals, loader):
    p = eqn.params
    x = vals[0] if vals else None
    if name == "dynamic_slice" and isinstance(x, _View):
        starts = [_materialize(s, loader) for s in vals[1:]]
        return _view_dynamic_slice(x, starts, p["slice_sizes"])
    if name == "slice" and isinstance(x, _View) and (p.get("strides") is None or
                                                       all(s == 1 for s in p["strides"])):
        sizes = [hi - lo for lo, hi in zip(p["start_indices"], p["limit_indices"])]
        return _view_dynamic_slice(x, list(p["start_indices"]), sizes)
    if name == "squeeze" and isinstance(x, _View):
        return _view_squeeze(x, p["dimensions"])
    if name == "gather" and isinstance(x, _View):
        return _try_view_gather(x, vals[1], p, loader)
    if name == "broadcast_in_dim" and x is not None and not isinstance(x, (_View, _Stack)):
        shape, dims = tuple(p["shape"]), tuple(p["broadcast_dimensions"])
        if isinstance(x, _Bcast):
            if shape == x.shape + (1,) and dims == tuple(range(len(x.shape))):
                return _Stack([x], x.shape)
            return None
        base = tuple(np.shape(x))
        if not base and not dims and shape:
            return _Bcast(x, shape)
        if base and shape == base + (1,) and dims == tuple(range(len(base))):
            return _Stack([x], base)
        return None
    if name == "concatenate" and all(isinstance(v, _Stack) for v in vals) and \
            p["dimension"] == len(vals[0].shape) and len({v.shape for v in vals}) == 1:
        return _Stack([c for v in vals for c in v.comps], vals[0].shape)
    return None


def eval_converted(conv: Any, args: Sequence[Any], loader: Loader) -> Any:
    """Evaluate a :class:`jaxpos.mods.ConvertedMod` on ``args`` (its own arguments) with
    its captured arrays read through ``loader`` (views of ``loader.refs``)."""
    jaxpr = conv.jaxpr
    consts = [_View(i, [_Rng(0, int(s)) for s in v.aval.shape], v.aval.dtype)
              for i, v in enumerate(jaxpr.constvars)]
    out = _eval(jaxpr, consts, list(args), loader)[0]
    return _materialize(out, loader)


def mod_function(conv: Any, loader: Loader) -> Callable:
    """``eval_converted`` as a function of the mod's own arguments."""
    return lambda *args: eval_converted(conv, args, loader)


# -------------------------------------------------------- evaluation inside shard_map
