"""Block masks: the tiles of a mask_mod classified once as empty, full or partial
(:func:`create_block_mask`), so that every implementation skips empty tiles and evaluates
the mask_mod on partial tiles only (FlexAttention's ``BlockMask``, Dong et al. 2024).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos.mods.convert import apply_mod, convert_mod, mod_name, reads_input
from jaxpos.mods.masks import and_masks, or_masks

__all__ = ["EMPTY", "FULL", "PARTIAL", "BlockMask", "combine_kinds", "create_block_mask"]

# Tile kinds of a block mask.
EMPTY, FULL, PARTIAL = 0, 1, 2


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

    def __init__(self, **fields: Any):
        for n in self._children + self._static:
            object.__setattr__(self, n, fields[n])

    def __setattr__(self, name, value):
        raise AttributeError("BlockMask is immutable")

    @property
    def shape(self) -> tuple[int, ...]:
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
                f"q_len={self.q_len}, kv_len={self.kv_len}, mask_mod={mod_name(self.mask_mod)})")


jax.tree_util.register_pytree_node(
    BlockMask,
    lambda m: (tuple(getattr(m, n) for n in BlockMask._children),
               tuple(getattr(m, n) for n in BlockMask._static)),
    lambda aux, ch: BlockMask(**dict(zip(BlockMask._children, ch)),
                              **dict(zip(BlockMask._static, aux))),
)


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
