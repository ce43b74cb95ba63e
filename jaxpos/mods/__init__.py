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

from jaxpos.mods.blocks import EMPTY, FULL, PARTIAL, BlockMask, combine_kinds, create_block_mask
from jaxpos.mods.convert import (
    ConvertedMod,
    apply_mod,
    compose_score_mods,
    convert_mod,
    is_additive,
    offset_score_mod,
    reads_input,
)
from jaxpos.mods.masks import (
    ChunkedAttentionMask,
    MaskCombination,
    PrefixLMMask,
    SlidingWindowMask,
    and_masks,
    or_masks,
)

__all__ = ["EMPTY", "FULL", "PARTIAL", "BlockMask", "ChunkedAttentionMask", "ConvertedMod",
           "MaskCombination", "PrefixLMMask", "SlidingWindowMask", "and_masks", "apply_mod",
           "combine_kinds", "compose_score_mods", "convert_mod", "create_block_mask",
           "is_additive", "offset_score_mod", "or_masks", "reads_input"]
