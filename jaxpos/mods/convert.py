"""score_mod / mask_mod conversion (in the spirit of PyTorch's FlexAttention, Dong et al.
2024, "Flex Attention: A Programming Model for Generating Optimized Attention Kernels"): a
mod is traced into a jaxpr at the tile shape and its captured arrays hoisted out as explicit
arguments (:func:`convert_mod`), which is how the chunked path's custom gradient and the
Pallas kernel receive them; :func:`apply_mod` evaluates a converted mod on a
``[B, N, tq, tk]`` block. The contract of the functions is in :mod:`jaxpos.mods`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, overload

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex

from jaxpos._util import cast_varying, varying_axes

__all__ = ["ConvertedMod", "apply_mod", "compose_score_mods", "convert_mod", "is_additive",
           "mod_name", "offset_score_mod", "reads_input"]


class ConvertedMod:
    """A score_mod or mask_mod traced at one tile shape with its captured arrays hoisted.

    A pytree: ``consts`` (the captured arrays, traced and differentiable) are children;
    the jaxpr and the kind (``"score"`` / ``"mask"``) are static. Call it with the
    mod's own arguments: ``converted(score, batch, head, q_pos, kv_pos)``.
    """

    def __init__(self, jaxpr: Any, consts: Any, kind: str, name: str):
        self.jaxpr = jaxpr
        self.consts = tuple(consts)
        self.kind = kind
        self.name = name

    def __call__(self, *args: Any) -> jax.Array:
        if not any(varying_axes(x) for x in (*args, *self.consts)):
            closed = jex.ClosedJaxpr(self.jaxpr, list(self.consts))
            return jex.jaxpr_as_fun(closed)(*args)[0]
        return _eval_matching_vma(self.jaxpr, self.consts, args)[0]

    def with_consts(self, consts: Any) -> ConvertedMod:
        """The same function with other values for the captured arrays (e.g. loaded from
        kernel refs)."""
        return ConvertedMod(self.jaxpr, consts, self.kind, self.name)

    def __repr__(self):
        shapes = [tuple(np.shape(c)) for c in self.consts]
        return f"ConvertedMod({self.kind}_mod {self.name}, captured arrays {shapes})"


jax.tree_util.register_pytree_node(
    ConvertedMod,
    lambda m: (m.consts, (m.jaxpr, m.kind, m.name)),
    lambda aux, consts: ConvertedMod(aux[0], consts, aux[1], aux[2]),
)


def _eval_matching_vma(jaxpr, consts, args):
    """Evaluate ``jaxpr`` as :func:`jax.core.eval_jaxpr` does, inside ``shard_map`` with
    varying-axis checks: before each primitive, operands that vary over fewer mesh axes
    than the others are cast up (what tracing the function there would have inserted).

    The mods are traced once outside the mesh context, so their jaxprs carry no such
    casts; call-like primitives (``jit``, ``custom_jvp``/``custom_vjp`` calls) are inlined
    so their bodies get the same treatment."""
    env = {}

    def read(v):
        return v.val if isinstance(v, jex.Literal) else env[v]

    for var, val in zip(jaxpr.constvars, consts):
        env[var] = val
    for var, val in zip(jaxpr.invars, args):
        env[var] = val
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        inner = (eqn.params.get("jaxpr") if eqn.primitive.name in ("pjit", "jit", "closed_call")
                 else eqn.params.get("call_jaxpr") if "custom" in eqn.primitive.name else None)
        if inner is not None:
            closed = inner if hasattr(inner, "consts") else jex.ClosedJaxpr(inner, [])
            outs = _eval_matching_vma(closed.jaxpr, closed.consts, invals)
        elif eqn.primitive.name in ("pvary", "pcast") and "varying" in str(
                getattr(eqn.params.get("to", "varying"), "name", eqn.params.get("to", "varying"))
        ).lower():
            # a cast recorded at trace time: the operand may vary over those axes already
            outs = [cast_varying(x, eqn.params["axes"]) for x in invals]
        else:
            axes = frozenset().union(*(varying_axes(x) for x in invals))
            if axes:
                invals = [cast_varying(x, axes) if isinstance(
                    x, (jax.Array, np.ndarray, np.generic, int, float, bool)) else x
                    for x in invals]
            bind = eqn.primitive.get_bind_params(eqn.params)  # JAX 0.10: params only
            subfuns, params = bind if isinstance(bind, tuple) else ((), bind)
            outs = eqn.primitive.bind(*subfuns, *invals, **params)
            if not eqn.primitive.multiple_results:
                outs = [outs]
        for var, val in zip(eqn.outvars, outs):
            if not isinstance(var, jex.DropVar):
                env[var] = val
    return [read(v) for v in jaxpr.outvars]


def mod_name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def convert_mod(fn: Callable, kind: str, tq: int, tk: int) -> ConvertedMod:
    """Trace ``fn`` (a score_mod if ``kind == "score"``, else a mask_mod) on a
    ``[tq, tk]`` tile and hoist every captured array.

    Checks, at trace time, that a score_mod returns a float32 array of the score's
    shape and a mask_mod a bool array broadcastable to ``[tq, tk]``.

    Raises:
      TypeError: ``fn`` is not callable; it returns the wrong dtype.
      ValueError: it returns the wrong shape.
    """
    argname = f"{kind}_mod"
    if not callable(fn):
        raise TypeError(f"{argname} must be a function; got {type(fn).__name__} {fn!r}.")
    i32 = jnp.int32
    pos = (jax.ShapeDtypeStruct((), i32), jax.ShapeDtypeStruct((), i32),
           jax.ShapeDtypeStruct((tq, 1), i32), jax.ShapeDtypeStruct((1, tk), i32))
    if kind == "score":
        args = (jax.ShapeDtypeStruct((tq, tk), jnp.float32),) + pos
        sig = "(score, batch, head, q_pos, kv_pos)"
    else:
        args = pos
        sig = "(batch, head, q_pos, kv_pos)"
    try:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    except TypeError as e:
        if "positional argument" in str(e) or "argument" in str(e) and "takes" in str(e):
            raise TypeError(f"{argname} must take {sig}; calling {mod_name(fn)} "
                            f"failed: {e}") from e
        raise
    if not isinstance(out_shape, jax.ShapeDtypeStruct):
        raise TypeError(f"{argname} must return one array; {mod_name(fn)} returned "
                        f"{jax.tree_util.tree_structure(out_shape)}.")
    if kind == "score":
        if out_shape.dtype != jnp.float32:
            raise TypeError(f"score_mod must return float32 scores (the dtype of its score "
                            f"argument); {mod_name(fn)} returned {out_shape.dtype}.")
        if out_shape.shape != (tq, tk):
            raise ValueError(f"score_mod must return the score's shape [tq, tk] = {[tq, tk]} "
                             f"(elementwise in score); {mod_name(fn)} returned shape "
                             f"{list(out_shape.shape)}.")
    else:
        if out_shape.dtype != jnp.bool_:
            raise TypeError(f"mask_mod must return a bool array (True = may attend); "
                            f"{mod_name(fn)} returned dtype {out_shape.dtype}.")
        try:
            np.broadcast_shapes(out_shape.shape, (tq, tk))
            ok = (len(out_shape.shape) <= 2
                  and np.broadcast_shapes(out_shape.shape, (tq, tk)) == (tq, tk))
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"mask_mod must return a bool array broadcastable to [tq, tk] = "
                             f"{[tq, tk]}; {mod_name(fn)} returned shape {list(out_shape.shape)}.")
    return ConvertedMod(closed.jaxpr, closed.consts, kind, mod_name(fn))


def offset_score_mod(offset_bias: jax.Array, radius: int) -> Callable[..., jax.Array]:
    """``score + offset_bias[head, clip(kv_pos - q_pos, -R, R) + R]`` as a score_mod: a
    bias that depends on the clipped offset only, gathered from a per-head vector
    ``offset_bias`` float ``[N, 2R + 1]`` (captured, differentiable; ``R = radius``). T5's
    bucketed bias is this with ``R = max_distance`` (:meth:`jaxpos.T5Bias.score_mod`).

    The gradient of ``offset_bias`` is exact; on a tile whose query and key positions
    each run consecutively (the usual case) it sums the score gradients along the tile's
    diagonals (one offset each) instead of scattering every one (:func:`_offset_lookup`)."""

    def offset(score, batch, head, q_pos, kv_pos):
        return score + _offset_lookup(offset_bias[head], q_pos, kv_pos, radius)

    return offset


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _offset_lookup(row: jax.Array, q_pos: jax.Array, kv_pos: jax.Array,
                   radius: int) -> jax.Array:
    """``row[clip(kv_pos - q_pos, -R, R) + R]``: float ``[2R + 1]`` gathered at the
    clipped offsets of int ``q_pos`` / ``kv_pos`` (broadcast together, e.g. ``[tq, 1]`` and
    ``[1, tk]``). Its VJP is :func:`_offset_lookup_bwd`."""
    return row[jnp.clip(kv_pos - q_pos, -radius, radius) + radius]


def _offset_lookup_fwd(row, q_pos, kv_pos, radius):
    return _offset_lookup(row, q_pos, kv_pos, radius), (q_pos, kv_pos, jnp.shape(row))


def _scatter_offsets(g, q_pos, kv_pos, radius, width):
    """``d row``: every element of ``g`` added at its clipped offset (the gather's own
    transpose, one update per element; any positions)."""
    idx = jnp.broadcast_to(jnp.clip(kv_pos - q_pos, -radius, radius) + radius, g.shape)
    return jnp.zeros((width,), g.dtype).at[idx.reshape(-1)].add(
        g.reshape(-1), mode="promise_in_bounds")


def _diagonal_sums(g: jax.Array) -> jax.Array:
    """Sums of ``g`` ``[tq, tk]`` along its diagonals: ``[tq + tk - 1]``, entry ``c`` the
    sum of ``g[i, j]`` over ``j - i == c - (tq - 1)``. Dense (a pad, a reshape that shifts
    row ``i`` by ``tq - 1 - i`` places, a column sum), no scatter."""
    tq, tk = g.shape
    w = tq + tk - 1
    x = jnp.pad(g[::-1, :], ((0, 0), (0, tq)))  # [tq, w + 1]; row r = query tq - 1 - r
    x = x.reshape(-1)[: tq * w].reshape(tq, w)  # row r shifted right by r places
    return jnp.sum(x, axis=0)


def _offset_lookup_bwd(radius, res, g):
    q_pos, kv_pos, (width,) = res
    g = jnp.asarray(g)
    tq, tk = g.shape[-2:] if g.ndim == 2 else (0, 0)
    if not (g.ndim == 2 and jnp.shape(q_pos) == (tq, 1) and jnp.shape(kv_pos) == (1, tk)):
        return _scatter_offsets(g, q_pos, kv_pos, radius, width), None, None
    qp, kp = q_pos[:, 0], kv_pos[0, :]
    runs = (jnp.all(qp == qp[0] + jnp.arange(tq, dtype=qp.dtype))
            & jnp.all(kp == kp[0] + jnp.arange(tk, dtype=kp.dtype)))

    def by_diagonals(g):
        # diagonal c holds the offset kp[0] - qp[0] + c - (tq - 1); a few scatters only
        rel = kp[0] - qp[0] - (tq - 1) + jnp.arange(tq + tk - 1, dtype=qp.dtype)
        idx = jnp.clip(rel, -radius, radius) + radius
        return jnp.zeros((width,), g.dtype).at[idx].add(_diagonal_sums(g),
                                                        mode="promise_in_bounds")

    d_row = jax.lax.cond(runs, by_diagonals,
                         lambda g: _scatter_offsets(g, q_pos, kv_pos, radius, width), g)
    return d_row, None, None


_offset_lookup.defvjp(_offset_lookup_fwd, _offset_lookup_bwd)


def compose_score_mods(*mods: Callable | None) -> Callable | None:
    """One score_mod applying each non-None mod in turn (left first); None if none."""
    mods = tuple(m for m in mods if m is not None)
    if not mods:
        return None
    if len(mods) == 1:
        return mods[0]

    def composed(score, batch, head, q_pos, kv_pos):
        for m in mods:
            score = m(score, batch, head, q_pos, kv_pos)
        return score

    composed.__qualname__ = " then ".join(mod_name(m) for m in mods)
    return composed


@overload  # no mod and no score: nothing to apply
def apply_mod(mod: None, q_pos: Any, kv_pos: Any, score: None = None,
              batch_index: tuple[int, int] | None = None) -> None: ...
@overload
def apply_mod(mod: ConvertedMod | None, q_pos: Any, kv_pos: Any,
              score: jax.Array | None = None,
              batch_index: tuple[int, int] | None = None) -> jax.Array: ...
def apply_mod(mod: ConvertedMod | None, q_pos: Any, kv_pos: Any,
              score: jax.Array | None = None,
              batch_index: tuple[int, int] | None = None) -> jax.Array | None:
    """Apply a converted mod to a ``[B, N, tq, tk]`` block (vmapped over batch and head).

    ``q_pos``: int32 ``[B|1, tq]``; ``kv_pos``: int32 ``[B|1, tk]``; ``score``: float32
    ``[B, N, tq, tk]`` for a score_mod, or None for a mask_mod, which then needs
    ``batch_index`` = (B, N). Returns ``[B, N, tq, tk]`` (scores, or bool).
    """
    if mod is None:
        return score
    if score is not None:
        B, N = score.shape[:2]
    elif batch_index is not None:
        B, N = batch_index
    else:
        raise TypeError("apply_mod: a mask_mod needs batch_index=(B, N); got None.")

    def per_bh(s, b, h, qp, kp):
        qp, kp = qp[:, None], kp[None, :]
        if s is None:
            return jnp.broadcast_to(mod(b, h, qp, kp), (qp.shape[0], kp.shape[1]))
        return mod(s, b, h, qp, kp)

    qa = 0 if q_pos.shape[0] > 1 else None
    ka = 0 if kv_pos.shape[0] > 1 else None
    qp = q_pos if qa == 0 else q_pos[0]
    kp = kv_pos if ka == 0 else kv_pos[0]
    sa = None if score is None else 0
    heads = jax.vmap(per_bh, in_axes=(sa, None, 0, None, None))
    term_mod = _hoisted_term(mod) if B > 1 and qa is None and ka is None else None
    if score is not None and term_mod is not None:
        # score + term with a term the same for every batch row: computed once per head,
        # broadcast with a gradient that sums the batch rows by adds (see _broadcast_rows)
        zero = jnp.zeros(score.shape[2:], score.dtype)
        term = jax.vmap(lambda h: term_mod(zero, jnp.int32(0), h, qp[:, None], kp[None, :]))(
            jnp.arange(N, dtype=jnp.int32))
        rows: jax.Array = _broadcast_rows(term, B)  # type: ignore[assignment]
        return score + rows
    batch = jax.vmap(heads, in_axes=(sa, 0, None, qa, ka))
    return batch(score, jnp.arange(B, dtype=jnp.int32), jnp.arange(N, dtype=jnp.int32), qp, kp)


def _hoisted_term(mod: ConvertedMod) -> ConvertedMod | None:
    """For a score_mod whose result is ``score + term`` (its last equation an ``add`` of
    the score argument and a term that depends on neither the score nor ``batch``, as
    ALiBi's and T5's): the term alone as a converted mod (same arguments); else None."""
    jaxpr = mod.jaxpr
    if mod.kind != "score" or not jaxpr.eqns:
        return None
    last, out = jaxpr.eqns[-1], jaxpr.outvars[0]
    if last.primitive.name != "add" or last.outvars[0] is not out:
        return None
    score, batch = jaxpr.invars[0], jaxpr.invars[1]
    a, b = last.invars
    term = b if a is score else a if b is score else None
    if term is None or isinstance(term, jex.Literal) or term.aval.shape != score.aval.shape:
        return None
    dep = {score, batch}
    for eqn in jaxpr.eqns[:-1]:
        if any(not isinstance(v, jex.Literal) and v in dep for v in eqn.invars):
            dep.update(eqn.outvars)
    if term in dep:
        return None
    return ConvertedMod(jaxpr.replace(outvars=[term]), mod.consts, mod.kind, mod.name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _broadcast_rows(term: jax.Array, rows: int) -> jax.Array:
    """``term`` repeated ``rows`` times along a new leading axis. Its gradient sums the
    rows by halving adds: XLA's CPU backend runs the plain ``reduce_sum`` over a leading
    axis of a score tile (the transpose of a broadcast) many times slower."""
    return jnp.broadcast_to(term[None], (rows,) + term.shape)


def _broadcast_rows_fwd(term, rows):
    return _broadcast_rows(term, rows), None


def _broadcast_rows_bwd(rows, _, g):
    while g.shape[0] > 1:
        half = g.shape[0] // 2
        s = g[:half] + g[half:2 * half]
        g = s if g.shape[0] % 2 == 0 else jnp.concatenate([s[:1] + g[2 * half:], s[1:]])
    return (g[0],)


_broadcast_rows.defvjp(_broadcast_rows_fwd, _broadcast_rows_bwd)


def reads_input(jaxpr: Any, index: int) -> bool:
    """Whether the jaxpr's input ``index`` reaches any equation or output (e.g. whether a
    converted mod reads ``batch``: ``reads_input(conv.jaxpr, 1)``)."""
    var = jaxpr.invars[index]
    return any(var is v for eqn in jaxpr.eqns for v in eqn.invars) or any(
        var is v for v in jaxpr.outvars)


def is_additive(conv: ConvertedMod | None) -> bool:
    """True when ``d score_mod / d score`` is identically 1 (the mod adds a term that does
    not depend on the score, e.g. ALiBi, T5): decided from the mod's JVP jaxpr, whose
    tangent output is then its tangent input itself. ``None`` counts as additive."""
    if conv is None:
        return True
    args = tuple(jax.ShapeDtypeStruct(x.aval.shape, x.aval.dtype) for x in conv.jaxpr.invars)

    def tangent(s, t, *rest):
        return jax.jvp(lambda x: conv(x, *rest), (s,), (t,))[1]

    jaxpr = jax.make_jaxpr(tangent)(args[0], args[0], *args[1:]).jaxpr
    return jaxpr.outvars[0] is jaxpr.invars[1]

