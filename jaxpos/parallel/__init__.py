"""Context parallelism on ``shard_map``: ring attention (:mod:`jaxpos.parallel.ring`)."""

from jaxpos.parallel.ring import (
    from_zigzag,
    ring_attention,
    shard_map,
    to_zigzag,
    zigzag_permutation,
)

__all__ = ["from_zigzag", "ring_attention", "shard_map", "to_zigzag", "zigzag_permutation"]
