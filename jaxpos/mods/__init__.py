"""Programmable attention: ``score_mod`` and ``mask_mod`` functions, and block masks.

A **score_mod** rewrites one tile of scaled scores from positions, in the spirit of
PyTorch's FlexAttention (Dong et al. 2024, "Flex Attention: A Programming Model for
Generating Optimized Attention Kernels")::

    score_mod(score, batch, head, q_pos, kv_pos) -> score

* ``score``: float32 ``[tq, tk]``, the scaled score ``scale * q . k`` (plus the terms of
  any score_mod applied before it);
* ``batch``, ``head``: int32 scalars, the batch row and the *query* head;
* ``q_pos``: int32 ``[tq, 1]`` and ``kv_pos``: int32 ``[1, tk]``, the global positions
  of the tile's queries and keys (broadcast ``kv_pos - q_pos`` for the offsets).

It must be elementwise in ``score`` (each output entry depends on the matching input
entry and on positions), written with ``jax.numpy``. It may capture arrays (bias
tables, MLP weights, per-token gates) and index them with ``batch``, ``head`` and
positions; gradients reach every captured array in every implementation.

A **mask_mod** decides visibility the same way and returns bool ``[tq, tk]``
(broadcastable)::

    mask_mod(batch, head, q_pos, kv_pos) -> bool

Every implementation calls the functions on tiles of its own size (the reference on the
whole ``[Tq, Tk]`` score matrix), so they must not depend on the tile shape.

Common mask_mods: :class:`SlidingWindowMask` (Mistral, Gemma 2/3, GPT-OSS),
:class:`ChunkedAttentionMask` (Llama 4) and :class:`PrefixLMMask`; document masks are
``segment_ids``.

:func:`create_block_mask` classifies the tiles of a mask_mod once (empty / full /
partial), so implementations skip empty tiles and evaluate the mask on partial tiles
only.

Functions are traced into a jaxpr at the tile shape and their captured arrays hoisted
out as explicit arguments (:func:`convert_mod`): that is how the chunked path's custom
gradient and the Pallas kernel receive them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, overload

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos._util import cast_varying, varying_axes

__all__ = ["EMPTY", "FULL", "PARTIAL", "BlockMask", "ChunkedAttentionMask", "ConvertedMod",
           "MaskCombination", "PrefixLMMask", "SlidingWindowMask", "and_masks", "apply_mod",
           "combine_kinds", "compose_score_mods", "convert_mod", "create_block_mask",
           "is_additive", "offset_score_mod", "or_masks", "reads_input"]

# Tile kinds of a block mask.
EMPTY, FULL, PARTIAL = 0, 1, 2


class ConvertedMod:
    """A score_mod or mask_mod traced at one tile shape with its captured arrays hoisted.

    A pytree: ``consts`` (the captured arrays, traced and differentiable) are children;
    the jaxpr and the kind (``"score"`` / ``"mask"``) are static. Call it with the
    mod's own arguments: ``converted(score, batch, head, q_pos, kv_pos)``.
    """

    def __init__(self, jaxpr, consts, kind: str, name: str):
        self.jaxpr = jaxpr
        self.consts = tuple(consts)
        self.kind = kind
        self.name = name

    def __call__(self, *args):
        if not any(varying_axes(x) for x in (*args, *self.consts)):
            closed = jex.ClosedJaxpr(self.jaxpr, list(self.consts))
            return jex.jaxpr_as_fun(closed)(*args)[0]
        return _eval_matching_vma(self.jaxpr, self.consts, args)[0]

    def with_consts(self, consts) -> ConvertedMod:
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


def _mod_name(fn) -> str:
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
            raise TypeError(f"{argname} must take {sig}; calling {_mod_name(fn)} "
                            f"failed: {e}") from e
        raise
    if not isinstance(out_shape, jax.ShapeDtypeStruct):
        raise TypeError(f"{argname} must return one array; {_mod_name(fn)} returned "
                        f"{jax.tree_util.tree_structure(out_shape)}.")
    if kind == "score":
        if out_shape.dtype != jnp.float32:
            raise TypeError(f"score_mod must return float32 scores (the dtype of its score "
                            f"argument); {_mod_name(fn)} returned {out_shape.dtype}.")
        if out_shape.shape != (tq, tk):
            raise ValueError(f"score_mod must return the score's shape [tq, tk] = {[tq, tk]} "
                             f"(elementwise in score); {_mod_name(fn)} returned shape "
                             f"{list(out_shape.shape)}.")
    else:
        if out_shape.dtype != jnp.bool_:
            raise TypeError(f"mask_mod must return a bool array (True = may attend); "
                            f"{_mod_name(fn)} returned dtype {out_shape.dtype}.")
        try:
            np.broadcast_shapes(out_shape.shape, (tq, tk))
            ok = (len(out_shape.shape) <= 2
                  and np.broadcast_shapes(out_shape.shape, (tq, tk)) == (tq, tk))
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"mask_mod must return a bool array broadcastable to [tq, tk] = "
                             f"{[tq, tk]}; {_mod_name(fn)} returned shape {list(out_shape.shape)}.")
    return ConvertedMod(closed.jaxpr, closed.consts, kind, _mod_name(fn))


def offset_score_mod(offset_bias: jax.Array, radius: int) -> Callable[..., jax.Array]:
    """``score + offset_bias[head, clip(kv_pos - q_pos, -R, R) + R]`` as a score_mod: a
    bias that depends on the clipped offset only, gathered from a per-head vector
    ``offset_bias`` float ``[N, 2R + 1]`` (captured, differentiable; ``R = radius``). T5's
    bucketed bias is this with ``R = max_distance`` (:meth:`jaxpos.T5Bias.score_mod`)."""

    def offset(score, batch, head, q_pos, kv_pos):
        return score + offset_bias[head][jnp.clip(kv_pos - q_pos, -radius, radius) + radius]

    return offset


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

    composed.__qualname__ = " then ".join(_mod_name(m) for m in mods)
    return composed


@dataclasses.dataclass(frozen=True)
class MaskCombination:
    """A mask_mod that is the conjunction (``op="and"``) or the disjunction (``op="or"``)
    of other mask_mods, FlexAttention's ``and_masks`` / ``or_masks`` (Dong et al. 2024;
    ``torch.nn.attention.flex_attention``). Build it with :func:`and_masks` /
    :func:`or_masks`. A frozen dataclass: equal combinations of equal mask_mods compare and
    hash equal (one trace under ``jit``).

    Call: ``(batch, head, q_pos [tq, 1], kv_pos [1, tk]) -> bool [tq, tk]``; with no
    mask_mods, all True (``"and"``) or all False (``"or"``).
    """

    op: str
    mask_mods: tuple

    def __call__(self, batch: jax.Array, head: jax.Array, q_pos: jax.Array,
                 kv_pos: jax.Array) -> jax.Array:
        out = None
        for m in self.mask_mods:
            r = m(batch, head, q_pos, kv_pos)
            out = r if out is None else (out & r if self.op == "and" else out | r)
        if out is None:
            shape = jnp.broadcast_shapes(jnp.shape(q_pos), jnp.shape(kv_pos))
            return jnp.full(shape, self.op == "and")
        return out


def _combination(op: str, mask_mods) -> MaskCombination:
    for i, m in enumerate(mask_mods):
        if not callable(m):
            raise TypeError(f"{op}_masks takes mask_mods (batch, head, q_pos, kv_pos) -> bool; "
                            f"argument {i} is {type(m).__name__} {m!r}.")
    return MaskCombination(op, tuple(mask_mods))


def and_masks(*mask_mods: Callable) -> MaskCombination:
    """The mask_mod that lets a pair attend when every one of ``mask_mods`` does
    (FlexAttention's ``and_masks``): e.g. ``and_masks(SlidingWindowMask(128),
    document_mask)``. No mask_mods: every pair attends.

    Args:
      mask_mods: ``(batch, head, q_pos, kv_pos) -> bool`` functions (see :mod:`jaxpos.mods`).

    Returns:
      A :class:`MaskCombination`, itself a mask_mod (for :func:`jaxpos.attention`,
      :func:`create_block_mask`, the modules).

    Raises:
      TypeError: an argument that is not callable (naming its index).
    """
    return _combination("and", mask_mods)


def or_masks(*mask_mods: Callable) -> MaskCombination:
    """The mask_mod that lets a pair attend when any of ``mask_mods`` does (FlexAttention's
    ``or_masks``): e.g. ``or_masks(PrefixLMMask(8), causal_mask)``. No mask_mods: no pair
    attends.

    Args / Returns / Raises: as :func:`and_masks`.
    """
    return _combination("or", mask_mods)


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
    batch = jax.vmap(heads, in_axes=(sa, 0, None, qa, ka))
    return batch(score, jnp.arange(B, dtype=jnp.int32), jnp.arange(N, dtype=jnp.int32), qp, kp)


# ------------------------------------------------------------------------- block masks
class BlockMask:
    """Tiles of a mask_mod classified once: ``EMPTY`` (skipped), ``FULL`` (computed with
    no masking) or ``PARTIAL`` (the mask_mod is evaluated on the tile).

    A pytree (arrays are children, so it passes through ``jit``); build it with
    :func:`create_block_mask`. Fields:

    * ``kinds``: int32 ``[B|1, N|1, nq, nk]`` tile kinds;
    * ``kv_num_blocks``: int32 ``[B|1, N|1, nq]``, non-empty key tiles per query tile;
    * ``kv_indices``: int32 ``[B|1, N|1, nq, nk]``, their indices first (ascending), the
      rest filled with the last one (so every entry is a valid tile);
    * ``q_num_blocks``, ``q_indices``: the same per key tile over query tiles
      ``[B|1, N|1, nk]``, ``[B|1, N|1, nk, nq]`` (for the backward pass);
    * ``q_positions``, ``kv_positions``: int32 ``[B|1, T]``, the positions it was built for;
    * static: ``mask_mod``, ``block_q``, ``block_k``, ``q_len``, ``kv_len``.
    """

    kinds: jax.Array
    kv_num_blocks: jax.Array
    kv_indices: jax.Array
    q_num_blocks: jax.Array
    q_indices: jax.Array
    q_positions: jax.Array
    kv_positions: jax.Array
    mask_mod: Callable[..., Any]
    block_q: int
    block_k: int
    q_len: int
    kv_len: int

    _children = ("kinds", "kv_num_blocks", "kv_indices", "q_num_blocks", "q_indices",
                 "q_positions", "kv_positions")
    _static = ("mask_mod", "block_q", "block_k", "q_len", "kv_len")

    def __init__(self, **fields):
        for n in self._children + self._static:
            object.__setattr__(self, n, fields[n])

    def __setattr__(self, name, value):
        raise AttributeError("BlockMask is immutable")

    @property
    def shape(self):
        """``(B|1, N|1, nq, nk)``."""
        return tuple(self.kinds.shape)

    def sparsity(self) -> float:
        """Fraction of tiles that are empty (a concrete float)."""
        return float(np.mean(np.asarray(self.kinds) == EMPTY))

    def check(self, B: int, N: int, Tq: int, Tk: int, block_q: int | None, block_k: int | None,
              q_positions: ArrayLike | None = None,
              kv_positions: ArrayLike | None = None) -> None:
        """Raise ``ValueError`` unless the mask was built for these lengths, blocks and (when
        both are concrete) positions. Under ``jit`` positions are traced and cannot be
        compared: building the mask from the call's own positions is then the caller's
        part."""
        if (self.q_len, self.kv_len) != (Tq, Tk):
            raise ValueError(f"block_mask was built for lengths (Tq, Tk) = ({self.q_len}, "
                             f"{self.kv_len}); the attention call has ({Tq}, {Tk}). Build it "
                             f"with the call's positions.")
        for name, got, own in (("block_q", block_q, self.block_q),
                               ("block_k", block_k, self.block_k)):
            if got is not None and got != own:
                raise ValueError(f"{name}={got} differs from the block mask's {name}={own}; "
                                 f"omit {name} (the block mask's tiles are used) or rebuild the "
                                 f"block mask with {name}={got}.")
        for name, got, own in (("q_positions", q_positions, self.q_positions),
                               ("kv_positions", kv_positions, self.kv_positions)):
            if got is None or not (_checks.is_concrete(got) and _checks.is_concrete(own)):
                continue
            g, o = np.asarray(got), np.asarray(own)
            if not np.array_equal(np.broadcast_to(g, np.broadcast_shapes(g.shape, o.shape)),
                                  np.broadcast_to(o, np.broadcast_shapes(g.shape, o.shape))):
                raise ValueError(f"block_mask was built for other {name} than the call's (e.g. "
                                 f"{o.ravel()[:4].tolist()}... against "
                                 f"{g.ravel()[:4].tolist()}...): its tile kinds would be wrong. "
                                 f"Build it with the call's positions (when decoding, the "
                                 f"positions of the new tokens and of the cache).")
        b, n = self.kinds.shape[:2]
        if b not in (1, B) or n not in (1, N):
            raise ValueError(f"block_mask was built for batch_size={b}, num_heads={n}; the call "
                             f"has B={B}, N={N} (a mask built with 1 broadcasts).")

    def _combine(self, other, op: str) -> BlockMask:
        if not isinstance(other, BlockMask):
            return NotImplemented
        mine = (self.block_q, self.block_k, self.q_len, self.kv_len)
        theirs = (other.block_q, other.block_k, other.q_len, other.kv_len)
        if mine != theirs:
            raise ValueError(f"block masks combine only when built for the same tiles and "
                             f"lengths; got (block_q, block_k, Tq, Tk) = {mine} and {theirs}.")
        other.check(self.kinds.shape[0], self.kinds.shape[1], self.q_len, self.kv_len, None, None,
                    q_positions=self.q_positions, kv_positions=self.kv_positions)
        kinds = combine_kinds(self.kinds, other.kinds, op)
        kv_num, kv_idx = _sorted_live(kinds)
        q_num, q_idx = _sorted_live(jnp.swapaxes(kinds, 2, 3))
        fn = and_masks if op == "and" else or_masks
        return BlockMask(kinds=kinds, kv_num_blocks=kv_num, kv_indices=kv_idx,
                         q_num_blocks=q_num, q_indices=q_idx, q_positions=self.q_positions,
                         kv_positions=self.kv_positions,
                         mask_mod=fn(self.mask_mod, other.mask_mod), block_q=self.block_q,
                         block_k=self.block_k, q_len=self.q_len, kv_len=self.kv_len)

    def __and__(self, other) -> BlockMask:
        """The block mask of ``and_masks(self.mask_mod, other.mask_mod)`` from the two
        masks' tile kinds (:func:`combine_kinds`), without evaluating a mask_mod. Both
        must be built for the same positions and tiles.

        Raises:
          ValueError: other lengths, tiles, positions or batch / head counts."""
        return self._combine(other, "and")

    def __or__(self, other) -> BlockMask:
        """The block mask of ``or_masks(self.mask_mod, other.mask_mod)``; as ``&``."""
        return self._combine(other, "or")

    def __repr__(self):
        return (f"BlockMask(shape={self.shape}, block_q={self.block_q}, block_k={self.block_k}, "
                f"q_len={self.q_len}, kv_len={self.kv_len}, mask_mod={_mod_name(self.mask_mod)})")


jax.tree_util.register_pytree_node(
    BlockMask,
    lambda m: (tuple(getattr(m, n) for n in BlockMask._children),
               tuple(getattr(m, n) for n in BlockMask._static)),
    lambda aux, ch: BlockMask(**dict(zip(BlockMask._children, ch)),
                              **dict(zip(BlockMask._static, aux))),
)


def reads_input(jaxpr, index: int) -> bool:
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


def combine_kinds(kinds_a: jax.Array, kinds_b: jax.Array, op: str = "and") -> jax.Array:
    """Tile kinds of a conjunction (``"and"``: EMPTY if either is, FULL if both are) or a
    disjunction (``"or"``: FULL if either is, EMPTY if both are) of two masks, else
    PARTIAL; int32, broadcasting. Conservative: a PARTIAL tile may be empty or full (its
    mask_mod is evaluated), an EMPTY or FULL one is exact."""
    a, b = jnp.asarray(kinds_a, jnp.int32), jnp.asarray(kinds_b, jnp.int32)
    if op == "and":
        empty, full = (a == EMPTY) | (b == EMPTY), (a == FULL) & (b == FULL)
    else:
        empty, full = (a == EMPTY) & (b == EMPTY), (a == FULL) | (b == FULL)
    return jnp.where(empty, EMPTY, jnp.where(full, FULL, PARTIAL)).astype(jnp.int32)


def _sorted_live(kinds):
    """Indices of non-empty tiles first (ascending), padded with the last live one."""
    n = kinds.shape[-1]
    live = kinds != EMPTY
    count = jnp.sum(live, axis=-1).astype(jnp.int32)
    order = jnp.argsort(jnp.where(live, 0, 1) * n + jnp.arange(n), axis=-1).astype(jnp.int32)
    last = jnp.take_along_axis(order, jnp.maximum(count - 1, 0)[..., None], axis=-1)
    pos = jnp.arange(n)
    idx = jnp.where(pos < jnp.maximum(count, 1)[..., None], order, last)
    return count, idx


def create_block_mask(mask_mod: Callable, *, q_positions: ArrayLike, kv_positions: ArrayLike,
                      block_q: int = 128,
                      block_k: int = 128, batch_size: int | None = None,
                      num_heads: int | None = None) -> BlockMask:
    """Classify every ``block_q x block_k`` tile of ``mask_mod`` as empty, full or partial.

    Evaluates ``mask_mod(batch, head, q_pos, kv_pos)`` once on every tile (one query
    block of ``[B, N, block_q, Tk]`` at a time, so memory stays ``O(T * block)``). Pass
    the same ``block_q``/``block_k`` to nothing else: :func:`jaxpos.attention` takes the
    tiles from the block mask.

    Args:
      mask_mod: ``(batch, head, q_pos, kv_pos) -> bool`` (see :mod:`jaxpos.mods`).
      q_positions, kv_positions: integer ``[T]`` or ``[B, T]``, the positions the
        attention call will use.
      block_q, block_k: tile sizes (positive ints; the Pallas kernel needs powers of two).
      batch_size, num_heads: evaluate per batch row / head; default 1 each, i.e. the
        mask_mod is called with ``batch = 0`` / ``head = 0`` and the result broadcasts.

    Returns:
      A :class:`BlockMask`.

    Raises:
      TypeError: ``mask_mod`` not callable or not returning bool; float positions.
      ValueError: bad block sizes, ranks, or a return shape that is not ``[tq, tk]``.
    """
    block_q = _checks.check_positive_int("block_q", block_q)
    block_k = _checks.check_positive_int("block_k", block_k)
    B = 1 if batch_size is None else _checks.check_positive_int("batch_size", batch_size)
    N = 1 if num_heads is None else _checks.check_positive_int("num_heads", num_heads)
    for name, p in (("q_positions", q_positions), ("kv_positions", kv_positions)):
        _checks.check_rank(name, p, (1, 2), "[T] or [B, T]")
        _checks.check_integer_positions(name, p)
    Tq, Tk = _checks.shape_of(q_positions)[-1], _checks.shape_of(kv_positions)[-1]
    qb = _checks.shape_of(q_positions)[0] if np.ndim(q_positions) == 2 else 1
    kb = _checks.shape_of(kv_positions)[0] if np.ndim(kv_positions) == 2 else 1
    Bp = max(qb, kb)
    qp = _checks.positions_2d("q_positions", q_positions, Bp, Tq)
    kp = _checks.positions_2d("kv_positions", kv_positions, Bp, Tk)
    if Bp > 1 and batch_size is None:
        B = Bp
    elif Bp > 1 and Bp != B:
        raise ValueError(f"batch_size={B} but the positions have batch {Bp}.")
    bq, bk = block_q, block_k
    nq, nk = -(-Tq // bq), -(-Tk // bk)
    conv = convert_mod(mask_mod, "mask", bq, Tk)
    for index, what, given, option in ((0, "batch", batch_size, "batch_size"),
                                       (1, "head", num_heads, "num_heads")):
        if given is None and (what != "batch" or Bp == 1) and reads_input(conv.jaxpr, index):
            raise ValueError(f"mask_mod reads its {what} argument, but create_block_mask was "
                             f"not given {option}=: the tiles would be classified for "
                             f"{what} 0 only. Pass {option}= (the call's).")
    Tq_p, Tk_p = nq * bq, nk * bk
    qp = jnp.pad(qp, ((0, 0), (0, Tq_p - Tq)), mode="edge")
    q_real = jnp.arange(Tq_p) < Tq
    k_real = jnp.arange(Tk_p) < Tk

    def one_q_block(i):
        qpi = jax.lax.dynamic_slice_in_dim(qp, i * bq, bq, axis=1)  # [Bp, bq]
        vis = apply_mod(conv, qpi, kp, batch_index=(B, N))  # [B, N, bq, Tk]
        vis = jnp.pad(vis, ((0, 0), (0, 0), (0, 0), (0, Tk_p - Tk)))
        qr = jax.lax.dynamic_slice_in_dim(q_real, i * bq, bq)[:, None]
        vis_live = vis & qr & k_real[None, :]
        vis_full = vis | ~qr | ~k_real[None, :]
        live = jnp.any(vis_live.reshape(B, N, bq, nk, bk), axis=(2, 4))
        full = jnp.all(vis_full.reshape(B, N, bq, nk, bk), axis=(2, 4))
        return jnp.where(live, jnp.where(full, FULL, PARTIAL), EMPTY).astype(jnp.int32)

    kinds = jax.lax.map(one_q_block, jnp.arange(nq))  # [nq, B, N, nk]
    kinds = jnp.moveaxis(kinds, 0, 2)
    kv_num, kv_idx = _sorted_live(kinds)
    q_num, q_idx = _sorted_live(jnp.swapaxes(kinds, 2, 3))
    return BlockMask(kinds=kinds, kv_num_blocks=kv_num, kv_indices=kv_idx, q_num_blocks=q_num,
                     q_indices=q_idx, q_positions=qp[:, :Tq], kv_positions=kp,
                     mask_mod=mask_mod, block_q=bq, block_k=bk, q_len=Tq,
                     kv_len=Tk)


# ------------------------------------------------------------------ common mask_mods
@dataclasses.dataclass(frozen=True)
class SlidingWindowMask:
    """The mask_mod of a causal sliding window of ``window`` tokens: a query at position
    ``p`` sees keys at positions ``p - window < kv_pos`` (with ``causal=True``, also
    ``kv_pos <= p``: the query and the ``window - 1`` tokens before it).

    Hugging Face's ``sliding_window_overlay`` (``masking_utils.py``): ``kv_idx > q_idx -
    sliding_window``, the layers marked ``"sliding_attention"`` in ``layer_types`` (Mistral,
    Gemma 2/3, GPT-OSS; Beltagy et al. 2020, "Longformer", §3.1 for the pattern). Use it as
    ``jaxpos.attention(..., causal=True, mask_mod=SlidingWindowMask(w))``; with global
    positions it holds for left padding and KV-cache decoding alike. A frozen dataclass, so
    equal windows compare and hash equal (one trace per window under ``jit``).

    Call: ``(batch, head, q_pos [tq, 1], kv_pos [1, tk]) -> bool [tq, tk]``.

    Raises:
      ValueError / TypeError: ``window`` not an int >= 1 (named ``sliding_window``).
    """

    window: int

    def __post_init__(self):
        window = _checks.check_positive_int("sliding_window", self.window)
        object.__setattr__(self, "window", window)

    def __call__(self, batch: jax.Array, head: jax.Array, q_pos: jax.Array,
                 kv_pos: jax.Array) -> jax.Array:
        return q_pos - kv_pos < self.window


@dataclasses.dataclass(frozen=True)
class ChunkedAttentionMask:
    """The mask_mod of Llama 4's chunked attention: a query sees only keys of its own chunk
    of ``chunk_size`` positions, ``q_pos // chunk_size == kv_pos // chunk_size`` (with
    ``causal=True`` also ``kv_pos <= q_pos``).

    Hugging Face's ``chunked_overlay`` (``masking_utils.py``), used on the layers marked
    ``"chunked_attention"`` (Llama 4's RoPE layers, ``attention_chunk_size``): HF counts
    chunks from the first real token (``(idx - left_padding) // chunk_size``), which is the
    position of a real token, so global positions give the same chunks under left padding
    and KV-cache decoding. A frozen dataclass (one trace per chunk size under ``jit``).

    Call: ``(batch, head, q_pos [tq, 1], kv_pos [1, tk]) -> bool [tq, tk]``.

    Raises:
      ValueError / TypeError: ``chunk_size`` not an int >= 1 (named
        ``attention_chunk_size``).
    """

    chunk_size: int

    def __post_init__(self):
        object.__setattr__(self, "chunk_size",
                           _checks.check_positive_int("attention_chunk_size", self.chunk_size))

    def __call__(self, batch: jax.Array, head: jax.Array, q_pos: jax.Array,
                 kv_pos: jax.Array) -> jax.Array:
        return q_pos // self.chunk_size == kv_pos // self.chunk_size


@dataclasses.dataclass(frozen=True)
class PrefixLMMask:
    """The mask_mod of a prefix language model (Raffel et al. 2020, §3.2.1, "prefix LM"):
    every query sees the first ``prefix_len`` positions (bidirectional attention over the
    prefix) and, after them, the keys at positions ``<= q_pos`` (causal). Use it with
    ``causal=False`` (``causal=True`` would hide the prefix's later tokens from its earlier
    ones).

    Call: ``(batch, head, q_pos [tq, 1], kv_pos [1, tk]) -> bool [tq, tk]``.

    Raises:
      ValueError / TypeError: ``prefix_len`` not an int >= 0.
    """

    prefix_len: int

    def __post_init__(self):
        object.__setattr__(self, "prefix_len", _checks.check_nonneg_int("prefix_len",
                                                                         self.prefix_len))

    def __call__(self, batch: jax.Array, head: jax.Array, q_pos: jax.Array,
                 kv_pos: jax.Array) -> jax.Array:
        return (kv_pos < self.prefix_len) | (kv_pos <= q_pos)
