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

from jaxpos.core.quantised import QuantisedPages, kv_storage_dtype
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

__all__ = ["Cache", "CacheRead", "KVCache", "PagedKVCache", "QuantisedPages", "SchemeStateCache",
           "StreamingKVCache", "check_cache", "decode_state_cache", "init_kv_cache",
           "init_paged_cache", "init_streaming_cache", "new_cache", "place_order", "poison_rows",
           "read_positions", "register_cache", "register_state_writer", "rotate_at_write",
           "rotates_on_load", "streaming_ranks", "update_kv_cache", "update_streaming_cache",
           "with_decode_state", "write_fox_step", "write_path_step"]

#: (options owned, builder) for each cache type besides the dense one, in registration order
_CACHES: list[tuple[tuple[str, ...], Callable[..., Cache]]] = []
#: the builders that take ``kv_dtype=`` for quantised storage
_QUANTISED: list[Callable[..., Cache]] = []


def register_cache(options: tuple[str, ...], build: Callable[..., Cache], *,
                   quantised: bool = False) -> None:
    """Make ``init_cache(..., **options)`` build a cache type: ``build(batch, max_len,
    num_kv_heads, head_dim, dtype, **given)`` (returning a :class:`Cache`) is called with
    the options of ``options`` that the caller gave (not None). Registering the same
    options again replaces their builder. ``quantised``: the builder also takes
    ``kv_dtype=`` (``"int8"``, ``"float8_e4m3fn"``) for quantised storage.

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
    if quantised:
        _QUANTISED.append(build)


def new_cache(batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype: Any,
              kv_dtype: Any = None, **options: Any) -> Cache:
    """An empty cache of one layer: the dense :class:`KVCache` when every option is None,
    else the registered cache type that owns the options given (``keep_first``:
    :class:`StreamingKVCache`).

    ``kv_dtype``, an option of every cache type: a float dtype stores keys and values in
    it (instead of ``dtype``); ``"int8"`` or ``"float8_e4m3fn"`` quantises them, which the
    paged cache does (:mod:`jaxpos.core.quantised`: a scale per token and KV head).

    Raises:
      ValueError: options of two cache types at once, or an option no cache type owns; a
        quantised ``kv_dtype`` for a cache type that does not quantise (the dense and
        StreamingLLM caches); the chosen builder's errors for bad sizes.
      TypeError: a ``kv_dtype`` that is neither quantised nor floating.
    """
    if kv_dtype is not None and kv_storage_dtype(kv_dtype) is None:
        dtype, kv_dtype = kv_dtype, None  # a float kv_dtype: the storage dtype
    given = {n: v for n, v in options.items() if v is not None}
    picked = None
    if given:
        picks = [(opts, build) for opts, build in _CACHES if set(given) & set(opts)]
        if len(picks) != 1 or not set(given) <= set(picks[0][0]):
            raise ValueError(f"init_cache options {sorted(given)} do not select one cache "
                             f"type (each option belongs to one: "
                             f"{[list(opts) for opts, _ in _CACHES]}).")
        picked = picks[0][1]
    if kv_dtype is not None:
        if picked is None or picked not in _QUANTISED:
            what = "the dense cache" if picked is None else f"init_cache({sorted(given)})"
            raise ValueError(
                f"kv_dtype={kv_dtype!r} quantises the pages of a paged cache; {what} stores "
                f"keys and values in a float dtype. Give page_size= and/or num_pages= for "
                f"a paged cache, or a float kv_dtype.")
        given["kv_dtype"] = kv_dtype
    if picked is None:
        return init_kv_cache(batch, max_len, num_kv_heads, head_dim, dtype)
    return picked(batch, max_len, num_kv_heads, head_dim, dtype, **given)


register_cache(("keep_first",), init_streaming_cache)
register_cache(("page_size", "num_pages"), init_paged_cache, quantised=True)
