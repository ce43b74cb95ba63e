"""A KV cache that carries a scheme's decode state beside another cache.

Most schemes decode from keys, values and positions alone. A scheme computed along the
token axis needs more: PaTH's short convolution reads the last inputs of the row, and its
inference rule moves every cached key at each step (Yang et al. 2025, arXiv:2505.16381,
§3.2); FoX keeps the cumulative forget gate of every cached token (Lin et al. 2025, §2).
State entries named ``*_slots`` are per slot (``[B, slots, ...]``), the others per row
(``[B, ...]``): the serving loop keeps the first in pages and the second per request
(:class:`jaxpos.serving.ModuleDecoder`). Such a scheme says so with
:meth:`jaxpos.PositionScheme.init_decode_state` and registers a writer here; the modules'
``init_cache`` then wraps each layer's cache (:func:`with_decode_state`), and a step's
:meth:`SchemeStateCache.write` hands the inner cache and the state to the writer. The
modules never ask which cache they hold: the wrapper is a :class:`Cache` like the others.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from jaxpos.layers.cache.base import Cache, CacheRead
from jaxpos.schemes.base import REGISTRY, PositionScheme, get_scheme

__all__ = ["SchemeStateCache", "decode_state_cache", "register_state_writer",
           "with_decode_state"]

#: scheme name -> writer(scheme, inner, state, q, k, v, positions, mask)
#: -> (inner, state, read)
_WRITERS: dict[str, Callable[..., tuple[Cache, Any, CacheRead]]] = {}


#: scheme names whose writer rewrites the cached keys (``Cache.update_keys``)
_MOVES_KEYS: set[str] = set()


def register_state_writer(*names: str, moves_keys: bool = True
                          ) -> Callable[[Callable], Callable]:
    """Function decorator: the writer of the schemes registered as ``names``, called by
    :meth:`SchemeStateCache.write` as ``fn(scheme, inner, state, q, k, v, positions,
    mask)`` and returning ``(inner, state, read)`` (the arguments of
    :meth:`Cache.write`, plus the inner cache and the scheme's state). ``moves_keys``:
    the writer rewrites the cached keys (PaTH), so the inner cache must implement
    ``update_keys``."""

    def deco(fn):
        for name in names:
            _WRITERS[name] = fn
            if moves_keys:
                _MOVES_KEYS.add(name)
            else:
                _MOVES_KEYS.discard(name)
        return fn

    return deco


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SchemeStateCache(Cache):
    """A cache (``inner``, any :class:`Cache` that implements ``update_keys`` and
    ``slots_per_row``) with the decode ``state`` of the scheme ``scheme_name`` (a pytree
    whose arrays have a leading batch axis: rows of two caches concatenate).

    Attributes:
      inner: the cache of keys and values; state: the scheme's state
        (:meth:`jaxpos.PositionScheme.init_decode_state`); scheme_name: static.
    """

    inner: Cache
    state: Any
    scheme_name: str = dataclasses.field(metadata={"static": True})

    @property
    def batch_size(self) -> int:
        return self.inner.batch_size

    @property
    def slots_per_row(self) -> int:
        return self.inner.slots_per_row

    def token_count(self) -> jax.Array:
        return self.inner.token_count()

    def write(self, scheme: PositionScheme, q: jax.Array, k: jax.Array, v: jax.Array,
              positions: jax.Array, mask: jax.Array | None
              ) -> tuple[SchemeStateCache, CacheRead]:
        """:meth:`jaxpos.layers.cache.Cache.write` by the scheme's registered writer.

        Raises:
          ValueError: a scheme other than the one the state was made for.
        """
        if scheme.registry_name != self.scheme_name:
            raise ValueError(f"this cache carries the decode state of position="
                             f"{self.scheme_name!r}; the step's scheme is "
                             f"{type(scheme).__name__} ({scheme.registry_name!r}).")
        inner, state, read = _WRITERS[self.scheme_name](scheme, self.inner, self.state, q, k,
                                                        v, positions, mask)
        return SchemeStateCache(inner, state, self.scheme_name), read


def with_decode_state(cache: Cache, scheme_name: str, options: dict,
                      num_heads: int, head_dim: int) -> Cache:
    """``cache`` wrapped with the decode state of the scheme ``scheme_name`` when its
    class keeps one (:meth:`jaxpos.PositionScheme.init_decode_state`), else ``cache``.

    Raises:
      ValueError: a cache type that cannot carry the state (it does not rewrite its keys
        in place when the scheme's writer moves them, or it re-numbers its tokens at read:
        the StreamingLLM cache), naming the scheme.
    """
    cls = get_scheme(scheme_name)
    if cls.init_decode_state.__func__ is PositionScheme.init_decode_state.__func__:
        return cache
    moves = scheme_name in _MOVES_KEYS
    if (scheme_name not in _WRITERS or not type(cache).text_positions
            or (moves and type(cache).update_keys is Cache.update_keys)):
        what = ("moving the cached keys at each step" if moves else
                "reading a state kept per text position")
        raise ValueError(f"position={scheme_name!r} decodes by {what}, which "
                         f"{type(cache).__name__} cannot carry; use the dense cache "
                         f"(init_cache without options) or the paged one (page_size=, "
                         f"num_pages=).")
    state = cls.init_decode_state(cache.batch_size, cache.slots_per_row,
                                  num_heads=num_heads, head_dim=head_dim,
                                  options=dict(options))
    return SchemeStateCache(cache, state, scheme_name)


def decode_state_cache(cache: Cache, scheme: tuple | None, num_heads: int,
                       head_dim: int) -> Cache:
    """A layer's empty cache with the decode state of its scheme ``(name, options)`` when
    the scheme keeps one (PaTH: :func:`jaxpos.layers.cache.with_decode_state`), else
    ``cache`` (also for ``scheme`` None or a name that is not a registered scheme)."""
    if scheme is None or scheme[0] not in REGISTRY:
        return cache
    return with_decode_state(cache, scheme[0], dict(scheme[1] or ()), num_heads, head_dim)
