"""The KV caches of the modules (:mod:`jaxpos.nnx`, :mod:`jaxpos.linen`), one file per
cache type behind one protocol (:mod:`jaxpos.layers.cache.base`):

* :mod:`~jaxpos.layers.cache.base`: :class:`Cache` (the protocol), :class:`CacheRead`
  (what a cache hands attention), and the scheme rules every cache applies
  (:func:`rotate_at_write`, :func:`read_positions`);
* :mod:`~jaxpos.layers.cache.dense`: :class:`KVCache`, ``[B, max_len]`` slots per row;
* :mod:`~jaxpos.layers.cache.streaming`: :class:`StreamingKVCache` (StreamingLLM, Xiao et
  al. 2024, §3.2);
* :mod:`~jaxpos.layers.cache.paged`: :class:`PagedKVCache` (vLLM's paged cache, Kwon et al.
  2023, §4.2);
* :mod:`~jaxpos.layers.cache.scheme_state`: :class:`SchemeStateCache`, another cache plus
  a scheme's decode state (PaTH's writer: :mod:`~jaxpos.layers.cache.path`; FoX's:
  :mod:`~jaxpos.layers.cache.fox`).

:func:`new_cache` builds the cache that the options of ``init_cache`` ask for. A new cache
type is one file: a :class:`Cache` subclass and its empty-cache function, plus one
:func:`register_cache` call naming the ``init_cache`` options it owns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxpos.layers.cache.base import (
    Cache,
    CacheRead,
    check_cache,
    poison_rows,
    read_positions,
    rotate_at_write,
    rotates_on_load,
)
from jaxpos.layers.cache.dense import KVCache, init_kv_cache, update_kv_cache
from jaxpos.layers.cache.fox import write_fox_step
from jaxpos.layers.cache.paged import PagedKVCache, init_paged_cache
from jaxpos.layers.cache.path import write_path_step
from jaxpos.layers.cache.scheme_state import (
    SchemeStateCache,
    decode_state_cache,
    register_state_writer,
    with_decode_state,
)
from jaxpos.layers.cache.streaming import (
    StreamingKVCache,
    init_streaming_cache,
    place_order,
    streaming_ranks,
    update_streaming_cache,
)

__all__ = ["Cache", "CacheRead", "KVCache", "PagedKVCache", "SchemeStateCache",
           "StreamingKVCache", "check_cache", "decode_state_cache", "init_kv_cache",
           "init_paged_cache", "init_streaming_cache", "new_cache", "place_order", "poison_rows",
           "read_positions", "register_cache", "register_state_writer", "rotate_at_write",
           "rotates_on_load", "streaming_ranks", "update_kv_cache", "update_streaming_cache",
           "with_decode_state", "write_fox_step", "write_path_step"]

#: (options owned, builder) for each cache type besides the dense one, in registration order
_CACHES: list[tuple[tuple[str, ...], Callable[..., Cache]]] = []


def register_cache(options: tuple[str, ...], build: Callable[..., Cache]) -> None:
    """Make ``init_cache(..., **options)`` build a cache type: ``build(batch, max_len,
    num_kv_heads, head_dim, dtype, **given)`` (returning a :class:`Cache`) is called with
    the options of ``options`` that the caller gave (not None). Registering the same
    options again replaces their builder.

    Raises:
      ValueError: no option, or an option another cache type already owns.
    """
    options = tuple(options)
    if not options:
        raise ValueError("register_cache needs the init_cache options that select the cache "
                         "type (the dense KVCache is the one without options).")
    _CACHES[:] = [(opts, b) for opts, b in _CACHES if opts != options]
    taken = {o for opts, _ in _CACHES for o in opts} & set(options)
    if taken:
        raise ValueError(f"cache options {sorted(taken)} are already owned by a registered "
                         f"cache type.")
    _CACHES.append((options, build))


def new_cache(batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype: Any,
              **options: Any) -> Cache:
    """An empty cache of one layer: the dense :class:`KVCache` when every option is None,
    else the registered cache type that owns the options given (``keep_first``:
    :class:`StreamingKVCache`).

    Raises:
      ValueError: options of two cache types at once, or an option no cache type owns;
        the chosen builder's errors for bad sizes.
    """
    given = {n: v for n, v in options.items() if v is not None}
    if not given:
        return init_kv_cache(batch, max_len, num_kv_heads, head_dim, dtype)
    picks = [(opts, build) for opts, build in _CACHES if set(given) & set(opts)]
    if len(picks) != 1 or not set(given) <= set(picks[0][0]):
        raise ValueError(f"init_cache options {sorted(given)} do not select one cache type "
                         f"(each option belongs to one: "
                         f"{[list(opts) for opts, _ in _CACHES]}).")
    return picks[0][1](batch, max_len, num_kv_heads, head_dim, dtype, **given)


register_cache(("keep_first",), init_streaming_cache)
register_cache(("page_size", "num_pages"), init_paged_cache)
