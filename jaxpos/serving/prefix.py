"""Automatic prefix caching: requests whose prompts start alike share the pages of that start.

As vLLM's automatic prefix caching does (Kwon et al. 2023, §4.4, shared prefixes; vLLM's
hash-based block cache): each *full* page of a prompt is keyed by a hash of its tokens, its
parent page's key (so a key names the whole prefix up to the page's end), the page's
starting position and what else the cached keys depend on (the model and its position
scheme: a RoPE-at-write cache holds keys rotated by their positions). A new request whose
prompt starts with cached pages maps them into its page table (a reference count per
page) and its prefill starts after them. When a request's prefill ends, its full prompt
pages join the cache; when it ends, a page no running request references stays in the
pool, unreferenced, and is evicted (least recently used first, a request's last pages
before its first) only when the pool needs pages.

No request ever writes into a shared page, so no copy-on-write is needed: a request writes
only at slots past its fill, its shared pages all lie before it, and only full pages are
shared (a prompt's last partial page is always its own). At least one prompt token is
always prefilled (its logits give the first token): when the whole prompt is cached, the
pages holding its last token are recomputed, as vLLM does.

The shared part is also a whole number of prefill chunks (``prefill_chunk`` divides it;
with ``page_size`` a multiple of ``prefill_chunk``, as with the defaults, every cached page
counts). A request's remaining prompt then runs in the same chunks, at the same positions,
as without sharing: every page and logit is the one it computes alone (bit for bit), even
for a scheme whose keys depend on the writing call (dynamic NTK rotated at write).

Models whose pages cannot be shared are refused by name (:func:`check_shareable`):
schemes whose cached keys change after they are written (PaTH moves every cached key at
each step), whose decode keeps per-request state beside the pages (FoX's running forget
gate, at the request's first page), and caches that re-place their tokens (StreamingLLM).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from jaxpos.serving.pages import PageAllocator

__all__ = ["PrefixCache", "check_shareable", "sharing_key"]


def sharing_key(model: Any) -> str:
    """A serving model's ``page_sharing_key()``: what its pages depend on besides the
    tokens and their positions (the model and its position scheme).

    Raises:
      ValueError: a model without ``page_sharing_key``, or one whose pages cannot be
        shared (the model's own error, naming the scheme).
    """
    key = getattr(model, "page_sharing_key", None)
    if not callable(key):
        raise ValueError(f"prefix_caching=True needs a model that says what its pages depend "
                         f"on (page_sharing_key(), as jaxpos.serving's PagedDecoder and "
                         f"ModuleDecoder do); {type(model).__name__} has none.")
    return str(key())


def check_shareable(model_name: str, caches: Iterable[Any]) -> str:
    """The identity of a module's pages for prefix caching (``model_name`` and the scheme
    of each layer's decode state, if any), after refusing the caches whose pages cannot
    be shared.

    Args:
      model_name: names the model (the start of the identity).
      caches: one empty cache per layer (the model's ``init_cache``).

    Raises:
      ValueError: a cache that re-places its tokens (``text_positions`` False:
        StreamingLLM), a layer whose scheme moves cached keys after writing them (PaTH) or
        keeps per-request decode state beside the pages (FoX), naming the scheme.
    """
    from jaxpos.layers.cache.scheme_state import _MOVES_KEYS

    names = []
    for c in caches:
        if not type(c).text_positions:
            raise ValueError(f"prefix_caching=True: {type(c).__name__} re-places its tokens "
                             f"in the cache (positions change after the write), so a page's "
                             f"keys depend on more than the prefix; serve without sharing.")
        name = getattr(c, "scheme_name", None)
        per_request = [n for n in getattr(c, "state", None) or {} if not n.endswith("_slots")]
        if name in _MOVES_KEYS:
            raise ValueError(f"prefix_caching=True: position={name!r} changes the cached keys "
                             f"after they are written (every step moves them by the new "
                             f"token's transform), so a page cannot be shared; serve "
                             f"without sharing.")
        if per_request:
            raise ValueError(f"prefix_caching=True: position={name!r} decodes with "
                             f"per-request state beside the pages ({', '.join(per_request)}, "
                             f"kept at the request's first page), which requests sharing "
                             f"pages would overwrite; serve without sharing.")
        names.append(name or "-")
    return f"{model_name}:{','.join(names)}"


class PrefixCache:
    """The full prompt pages of earlier requests, found by content (module docstring), in
    front of a :class:`PageAllocator`.

    It answers the allocator's calls (``allocate``, ``free``, ``in_use``,
    ``peak_in_use``) for a serving loop, plus :meth:`book` (admission) and
    :meth:`register` (after a prefill). A request's booking counts every page it may hold,
    its shared ones included; the pool's bookings are the running requests' own pages plus
    one per referenced cached page, so a running request always finds its pages among the
    free and the unreferenced cached ones (evicted as needed).

    Args:
      allocator: the page pool.
      page_size: slots per page.
      identity: what the cached keys depend on besides tokens and positions (the model
        and its position scheme): part of every key.
      granule: shared prefixes are a multiple of this many tokens (a multiple of
        ``page_size``; the serving loop gives ``lcm(page_size, prefill_chunk)``).

    Attributes:
      evictions: cached pages evicted so far.
    """

    def __init__(self, allocator: PageAllocator, page_size: int, identity: str,
                 granule: int | None = None):
        self.allocator, self.page_size = allocator, page_size
        self.granule = page_size if granule is None else granule
        if self.granule % page_size:
            raise ValueError(f"granule must be a multiple of page_size={page_size}; got "
                             f"{granule}.")
        self._root = hashlib.sha256(identity.encode()).digest()
        self._page: dict[bytes, int] = {}  # key -> page
        self._key: dict[int, bytes] = {}  # page -> key
        self._refs: dict[int, int] = {}  # cached page -> running requests holding it
        self._idle: OrderedDict[int, None] = OrderedDict()  # refs 0, least recent first
        self.evictions = 0
        self.peak_in_use = 0

    # ---------------------------------------------------------------- the allocator's
    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def in_use(self) -> int:
        """Pages held by running requests (cached unreferenced pages excluded)."""
        return self.allocator.in_use - len(self._idle)

    @property
    def cached(self) -> dict[int, bytes]:
        """``{page: key}`` of every cached page (referenced or not)."""
        return dict(self._key)

    def refs(self, page: int) -> int:
        """Running requests holding cached ``page`` (0 for an unreferenced one)."""
        return self._refs[page]

    def _peak(self) -> None:
        self.peak_in_use = max(self.peak_in_use, self.in_use)

    def allocate(self, n: int, *, after: int | None = None,
                 expect: int | None = None) -> list[int]:
        """:meth:`PageAllocator.allocate`, evicting unreferenced cached pages (least
        recently used first) when fewer than ``n`` pages are free. A run grows in place
        after ``after`` only if no other request holds that page."""
        short = n - (self.allocator.num_pages - self.allocator.in_use)
        for _ in range(max(0, min(short, len(self._idle)))):
            self._evict(next(iter(self._idle)))
        if after is not None and self._refs.get(after, 1) > 1:
            after = None  # a page shared with another request: not this run's end
        out = self.allocator.allocate(n, after=after, expect=expect)
        self._peak()
        return out

    def _evict(self, page: int) -> None:
        del self._idle[page], self._refs[page], self._page[self._key.pop(page)]
        self.allocator.free([page])
        self.evictions += 1

    def free(self, pages: Sequence[int], reserved: int = 0) -> None:
        """A request ends: its own pages go back to the pool, with their booking (its
        ``reserved`` less its cached pages); each cached page loses a reference, and one
        no request holds any more becomes evictable (its booking released; a request's
        last pages queue for eviction before its first)."""
        mine = [p for p in pages if p not in self._key]
        self.allocator.free(mine, max(0, reserved - (len(pages) - len(mine))))
        for p in reversed([p for p in pages if p in self._key]):
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._idle[p] = None
                self.allocator.free([], 1)

    def clear(self) -> int:
        """Evict every unreferenced cached page (e.g. after the model's weights change:
        vLLM's ``reset_prefix_cache``); pages a running request holds stay. Returns the
        number evicted."""
        n = len(self._idle)
        while self._idle:
            self._evict(next(iter(self._idle)))
        return n

    # ------------------------------------------------------------------ prefix caching
    def keys(self, prompt: Sequence[int]) -> list[bytes]:
        """The keys of ``prompt``'s full pages, in order: page ``i`` is keyed by a SHA-256
        of its parent's key (the identity for the first), its starting position and its
        tokens (int64)."""
        ps, parent, out = self.page_size, self._root, []
        tokens = np.asarray(prompt, np.int64)
        for i in range(len(tokens) // ps):
            h = hashlib.sha256(parent)
            h.update(np.int64(i * ps).tobytes())
            h.update(tokens[i * ps:(i + 1) * ps].tobytes())
            parent = h.digest()
            out.append(parent)
        return out

    def book(self, prompt: Sequence[int], need: int) -> list[int] | None:
        """Admit a request of ``need`` pages: the cached pages its prompt starts with (the
        longest run of whole granules that leaves at least one prompt token to prefill),
        each referenced once more, and a booking of the pages it still needs; None (and
        nothing booked) when the pool cannot book them now."""
        shared = []
        for key in self.keys(prompt[:len(prompt) - 1]):
            if key not in self._page:
                break
            shared.append(self._page[key])
        per = self.granule // self.page_size
        shared = shared[:len(shared) // per * per]
        revived = [p for p in shared if self._refs[p] == 0]
        if not self.allocator.reserve(need - len(shared) + len(revived)):
            return None
        for p in shared:
            self._refs[p] += 1
            self._idle.pop(p, None)
        self._peak()
        return shared

    def register(self, prompt: Sequence[int], pages: Sequence[int]) -> int:
        """After a request's prefill: cache its full prompt pages (``pages`` in slot
        order) not cached yet, held by it (the pool's booking moves with them). A page
        whose key another page holds already stays the request's own. Returns the
        number cached."""
        added = 0
        for i, key in enumerate(self.keys(prompt)):
            if key not in self._page:
                self._page[key], self._key[pages[i]], self._refs[pages[i]] = pages[i], key, 1
                added += 1
        return added

