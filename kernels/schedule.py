"""The tile schedule of one kernel call: which ``(query tile, key tile)`` pairs the kernel
visits, and which of them need masking.

Every tile is classified once per call, in plain JAX outside the kernel, from cheap
per-tile summaries (``O(T)`` work plus ``O(nq * nk)`` small integers):

* **EMPTY**: nothing in the tile is visible; never visited;
* **FULL**: everything is visible; visited with no masking at all (no causal compare, no
  segment compare, no mask_mod);
* **PARTIAL**: visited with every mask applied.

Causal visibility is ``kv_pos <= q_pos`` on the tokens' positions, so a tile is EMPTY
when its smallest key position exceeds its largest query position and FULL when its
largest key position is at most its smallest query position. Segments: EMPTY when the
id ranges of the two tiles do not overlap, FULL when both tiles hold one and the same
id. A key tile holding padding is never FULL. Causal classification is exact for
monotone positions (the ``arange`` default: the forward loop of query tile ``i`` then
stops at the diagonal, and the dk/dv loop of key tile ``j`` starts there); every rule is
conservative otherwise (a tile that might hold a visible pair is visited and masked), so
one rule serves arbitrary positions too. A user's :class:`jaxpos.mods.BlockMask` is
combined tile by tile (EMPTY if either is EMPTY, FULL if both are FULL); a mask_mod without
a block mask makes every tile PARTIAL.

The kernel reads, per query tile, the ascending list of its PARTIAL key tiles and the list
of its FULL ones (and per key tile the same over query tiles, for dk/dv), as in
FlexAttention's ``kv_indices`` / ``full_kv_indices`` (Dong et al. 2024, §3).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxpos._util import pow2_at_least as _pow2
from jaxpos.mods import EMPTY, FULL, PARTIAL

_BIG = 2**30


class Schedule(NamedTuple):
    """Tile lists of one call (int32 arrays; leading dims ``[S_b, S_h]`` are 1 or B / N).

    * ``kinds``: ``[S_b, S_h, nq, nk]``;
    * ``kv_counts``: ``[S_b, S_h, nq, 1, 2]`` (number of PARTIAL, FULL key tiles per
      query tile); ``kv_lists``: ``[S_b, S_h, nq, 2, nk_pad]`` (their indices, ascending);
    * ``q_counts``: ``[S_b, S_h, nk, 1, 2]``; ``q_lists``: ``[S_b, S_h, nk, 2, nq_pad]``;
    * ``split_counts`` / ``split_lists``: the kv lists per key split (flash decoding),
      ``[S_b, S_h, nq, S, 1, 2]`` / ``[S_b, S_h, nq, S, 2, L_pad]``, or None.
    """

    kinds: jax.Array
    kv_counts: jax.Array
    kv_lists: jax.Array
    q_counts: jax.Array
    q_lists: jax.Array
    split_counts: jax.Array | None = None
    split_lists: jax.Array | None = None


def _tile_min_max(x, n, blk, real):
    """Per-tile min / max over the real entries of ``x`` ``[b, n * blk]``."""
    b = x.shape[0]
    xt = x.reshape(b, n, blk)
    rt = real.reshape(1, n, blk)
    lo = jnp.min(jnp.where(rt, xt, _BIG), axis=-1)
    hi = jnp.max(jnp.where(rt, xt, -_BIG), axis=-1)
    return lo, hi


def structural_kinds(*, causal: bool, q_pos: Any, kv_pos: Any, seg_q: Any, seg_kv: Any, Tq: int,
                     Tk: int, bq: int, bk: int, nq: int, nk: int, kv_len: Any = None) -> jax.Array:
    """Tile kinds from causality, segments, padding and per-row key lengths: int32
    ``[S_b, 1, nq, nk]``.

    ``q_pos`` ``[Bq, nq * bq]``, ``kv_pos`` ``[Bk, nk * bk]`` (padded, int32); ``seg_q``,
    ``seg_kv`` ``[B, T_padded]`` or None; ``kv_len`` int32 ``[B]`` or None (keys at index
    ``>= kv_len[b]`` do not exist: key tiles past it are EMPTY, the one it cuts PARTIAL).
    """
    q_real = jnp.arange(nq * bq) < Tq
    k_real = jnp.arange(nk * bk) < Tk
    k_has_pad = jnp.any(~k_real.reshape(nk, bk), axis=-1)  # [nk]
    empty = jnp.zeros((1, nq, nk), bool)
    full = jnp.broadcast_to(~k_has_pad[None, None, :], (1, nq, nk))
    if causal:
        qlo, qhi = _tile_min_max(q_pos, nq, bq, q_real)
        klo, khi = _tile_min_max(kv_pos, nk, bk, k_real)
        empty = empty | (klo[:, None, :] > qhi[:, :, None])
        full = full & (khi[:, None, :] <= qlo[:, :, None])
    if seg_q is not None:
        sqlo, sqhi = _tile_min_max(seg_q, nq, bq, q_real)
        sklo, skhi = _tile_min_max(seg_kv, nk, bk, k_real)
        empty = (empty | (sqhi[:, :, None] < sklo[:, None, :])
                 | (skhi[:, None, :] < sqlo[:, :, None]))
        full = full & ((sqlo == sqhi)[:, :, None] & (sklo == skhi)[:, None, :]
                       & (sqlo[:, :, None] == sklo[:, None, :]))
    if kv_len is not None:
        start = jnp.arange(nk, dtype=jnp.int32) * bk
        lim = kv_len.astype(jnp.int32)[:, None, None]
        empty = empty | (start[None, None, :] >= lim)
        full = full & (start[None, None, :] + bk <= lim)
    kinds = jnp.where(empty, EMPTY, jnp.where(full, FULL, PARTIAL)).astype(jnp.int32)
    return kinds[:, None]


def combine(kinds_a: Any, kinds_b: Any) -> jax.Array:
    """Tile by tile: EMPTY if either is, FULL if both are, else PARTIAL (broadcasting)."""
    if kinds_b is None:
        return kinds_a
    kinds_b = jnp.asarray(kinds_b, jnp.int32)
    empty = (kinds_a == EMPTY) | (kinds_b == EMPTY)
    full = (kinds_a == FULL) & (kinds_b == FULL)
    return jnp.where(empty, EMPTY, jnp.where(full, FULL, PARTIAL)).astype(jnp.int32)


def _lists(kinds, pad_to):
    """Along the last axis: counts ``[..., 1, 2]`` and ascending indices
    ``[..., 2, pad_to]`` of the PARTIAL (row 0) and FULL (row 1) tiles."""
    n = kinds.shape[-1]
    ar = jnp.arange(n, dtype=jnp.int32)
    counts, lists = [], []
    for kind in (PARTIAL, FULL):
        hit = kinds == kind
        order = jnp.argsort(jnp.where(hit, 0, 1) * n + ar, axis=-1).astype(jnp.int32)
        counts.append(jnp.sum(hit, axis=-1).astype(jnp.int32))
        lists.append(jnp.pad(order, [(0, 0)] * (order.ndim - 1) + [(0, pad_to - n)]))
    return (jnp.stack(counts, axis=-1)[..., None, :], jnp.stack(lists, axis=-2))


def build(kinds: Any, splits: int = 1) -> Schedule:
    """The :class:`Schedule` of tile kinds ``[S_b, S_h, nq, nk]``; with ``splits > 1``
    also the forward's lists per key split (split ``s`` holds key tiles ``s * L ..
    (s + 1) * L - 1``, ``L = ceil(nk / splits)``, indices local to the split)."""
    nq, nk = kinds.shape[-2:]
    kv_counts, kv_lists = _lists(kinds, _pow2(nk))
    q_counts, q_lists = _lists(jnp.swapaxes(kinds, -1, -2), _pow2(nq))
    split_counts = split_lists = None
    if splits > 1:
        L = -(-nk // splits)
        ks = jnp.pad(kinds, [(0, 0)] * (kinds.ndim - 1) + [(0, splits * L - nk)],
                     constant_values=EMPTY)
        ks = ks.reshape(kinds.shape[:-1] + (splits, L))
        split_counts, split_lists = _lists(ks, _pow2(L))
    return Schedule(kinds, kv_counts, kv_lists, q_counts, q_lists, split_counts, split_lists)
