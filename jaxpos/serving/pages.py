"""The page pool of a paged KV cache: the host-side allocator and the device-side write.

Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
PagedAttention", §4.2-4.3: the keys and values of every sequence live in fixed-size pages
of one pool; a per-sequence page table maps slot ``s`` to offset ``s % page_size`` of page
``table[s // page_size]``; pages are handed out as a sequence grows and returned when it
ends, so memory follows the tokens held, not ``batch x max_len``.
"""

from __future__ import annotations

import numpy as np

from jaxpos import _checks
from jaxpos.layers.cache.paged import pages_for, write_pages

__all__ = ["PageAllocator", "pages_for", "table_array", "write_pages"]


class PageAllocator:
    """A free list of page indices ``0 .. num_pages - 1`` (host side, plain Python).

    ``reserve(n)`` books pages for a request before it runs (admission control: a running
    request always finds the pages it may still need), ``allocate(n)`` hands out booked
    pages as the request grows, ``free(pages, reserved)`` returns both when it ends.

    Args:
      num_pages: pool size, a positive int.

    Raises:
      ValueError / TypeError: ``num_pages`` not a positive int.
    """

    def __init__(self, num_pages: int):
        self.num_pages = _checks.check_positive_int("num_pages", num_pages)
        self._free = list(range(self.num_pages - 1, -1, -1))  # pop() hands out 0, 1, ...
        self.reserved = 0  # booked by running requests (allocated or not yet)
        self.peak_in_use = 0

    @property
    def in_use(self) -> int:
        """Pages handed out and not yet freed."""
        return self.num_pages - len(self._free)

    @property
    def available(self) -> int:
        """Pages neither booked nor handed out: what a new request may reserve."""
        return self.num_pages - self.reserved

    def reserve(self, n: int) -> bool:
        """Book ``n`` pages; False (nothing booked) when fewer are available."""
        if n > self.available:
            return False
        self.reserved += n
        return True

    def allocate(self, n: int) -> list[int]:
        """Hand out ``n`` booked pages.

        Raises:
          ValueError: the pool has fewer than ``n`` free pages (more handed out than
            booked).
        """
        if n > len(self._free):
            raise ValueError(f"page pool exhausted: {n} page(s) requested, {len(self._free)} "
                             f"free of num_pages={self.num_pages}; reserve pages before "
                             f"allocating them.")
        out = [self._free.pop() for _ in range(n)]
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return out

    def free(self, pages: list[int], reserved: int = 0) -> None:
        """Return ``pages`` to the pool and release ``reserved`` bookings.

        Raises:
          ValueError: a page outside the pool, or one already free.
        """
        free = set(self._free)
        for p in pages:
            if not 0 <= p < self.num_pages or p in free:
                raise ValueError(f"page {p} is not an allocated page of this pool "
                                 f"(num_pages={self.num_pages}).")
            free.add(p)
        self._free.extend(reversed(pages))
        self.reserved = max(0, self.reserved - reserved)


def table_array(rows: list[list[int]], pages_per_seq: int) -> np.ndarray:
    """int32 ``[len(rows), pages_per_seq]`` page table, ``-1`` past each row's pages."""
    out = np.full((len(rows), pages_per_seq), -1, np.int32)
    for b, pages in enumerate(rows):
        out[b, :len(pages)] = pages
    return out
