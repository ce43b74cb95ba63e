"""Context parallelism on ``shard_map``: ring attention (:mod:`jaxpos.parallel.ring`),
Ulysses all-to-all and the two combined on a 2-D mesh (:mod:`jaxpos.parallel.ulysses`)."""

from jaxpos.parallel.ring import (
    from_zigzag,
    ring_attention,
    shard_map,
    to_zigzag,
    zigzag_permutation,
)
from jaxpos.parallel.ulysses import kv_head_repeats, ulysses_attention

__all__ = ["from_zigzag", "kv_head_repeats", "ring_attention", "shard_map", "to_zigzag",
           "ulysses_attention", "zigzag_permutation"]
