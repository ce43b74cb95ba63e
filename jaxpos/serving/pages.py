"""The page pool of a paged KV cache: the host-side allocator and the device-side write.

Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
PagedAttention", §4.2-4.3: the keys and values of every sequence live in fixed-size pages
of one pool; a per-sequence page table maps slot ``s`` to offset ``s % page_size`` of page
``table[s // page_size]``; pages are handed out as a sequence grows and returned when it
ends, so memory follows the tokens held, not ``batch x max_len``.

Any pages are correct; consecutive ones are faster to read (a key block of a decode step
is then a few long runs of memory, not one short page each from anywhere in the pool), so
the allocator places each request in a run of consecutive free pages where the pool has
one, and a growing request extends its run in place.
"""

from __future__ import annotations

import numpy as np

from jaxpos import _checks
from jaxpos.layers.cache.paged import pages_for, write_pages

__all__ = ["PageAllocator", "pages_for", "table_array", "write_pages"]


def _runs(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, lengths)`` of the maximal runs of True in a bool vector, in order."""
    edges = np.diff(np.concatenate(([0], mask.astype(np.int8), [0])))
    starts = np.flatnonzero(edges == 1)
    return starts, np.flatnonzero(edges == -1) - starts


class PageAllocator:
    """Page indices ``0 .. num_pages - 1`` handed out in runs of consecutive pages (host
    side, plain Python and NumPy).

    ``reserve(n)`` books pages for a request before it runs (admission control: a running
    request always finds the pages it may still need), ``allocate(n, after=, expect=)``
    hands out booked pages as the request grows, ``free(pages, reserved)`` returns both
    when it ends.

    Placement (any pages are correct; consecutive ones read faster): a request's first
    pages go at the start of the smallest free run that holds every page it ``expect`` s
    to take (best fit, as a memory allocator places a block), and the free pages after its
    last page stay its room: other requests are placed elsewhere while the pool has other
    free pages, so the request grows in place (``after``). From a fragmented pool (no run
    long enough) the longest free runs are used first; rooms are given up only when
    nothing else is free. Allocation succeeds whenever the pool has ``n`` free pages.

    Args:
      num_pages: pool size, a positive int.

    Raises:
      ValueError / TypeError: ``num_pages`` not a positive int.
    """

    def __init__(self, num_pages: int):
        self.num_pages = _checks.check_positive_int("num_pages", num_pages)
        self._is_free = np.ones(self.num_pages, bool)
        self._num_free = self.num_pages
        # last page of a request's run -> end (exclusive) of the free pages kept for it
        self._room: dict[int, int] = {}
        self.reserved = 0  # booked by running requests (allocated or not yet)
        self.peak_in_use = 0

    @property
    def in_use(self) -> int:
        """Pages handed out and not yet freed."""
        return self.num_pages - self._num_free

    @property
    def available(self) -> int:
        """Pages neither booked nor handed out: what a new request may reserve."""
        return self.num_pages - self.reserved

    def reserve(self, n: int) -> bool:
        """Book ``n`` pages; False (nothing booked) when fewer are available.

        Raises:
          ValueError / TypeError: ``n`` not an int >= 0.
        """
        n = _checks.check_nonneg_int("n", n)
        if n > self.available:
            return False
        self.reserved += n
        return True

    def _claimed(self) -> np.ndarray:
        """bool ``[num_pages]``: the free pages kept as some request's room."""
        out = np.zeros(self.num_pages, bool)
        for last, end in self._room.items():
            out[last + 1:end] = True
        return out & self._is_free

    def _take(self, pages: list[int]) -> list[int]:
        self._is_free[pages] = False
        self._num_free -= len(pages)
        return pages

    def allocate(self, n: int, *, after: int | None = None,
                 expect: int | None = None) -> list[int]:
        """Hand out ``n`` booked pages, in runs of consecutive pages where the pool has
        them.

        Args:
          n: pages to hand out (an int >= 0).
          after: the last page the request holds (None for its first pages): the free
            pages right after it are taken first, so its run grows in place.
          expect: pages the request may still take, these ``n`` included (default
            ``n``; at least ``n``): a new run starts where that many fit, and the pages
            past the ``n`` handed out are kept as the request's room.

        Returns:
          ``n`` distinct page indices, in slot order (each run ascending).

        Raises:
          ValueError: the pool has fewer than ``n`` free pages (more handed out than
            booked); ``after`` not a page this pool handed out; ``expect < n``.
          TypeError: ``n``, ``after`` or ``expect`` not an int.
        """
        n = _checks.check_nonneg_int("n", n)
        if n > self._num_free:
            raise ValueError(f"page pool exhausted: {n} page(s) requested, {self._num_free} "
                             f"free of num_pages={self.num_pages}; reserve pages before "
                             f"allocating them.")
        expect = n if expect is None else _checks.check_nonneg_int("expect", expect)
        if expect < n:
            raise ValueError(f"expect (pages the request may still take) must be >= n = "
                             f"{n}; got {expect}.")
        end = None
        if after is not None:
            after = _checks.check_nonneg_int("after", after)
            if after >= self.num_pages or self._is_free[after]:
                what = "a free page" if after < self.num_pages else "outside the pool"
                raise ValueError(f"after must be a page this pool handed out (the request's "
                                 f"last page) in [0, num_pages={self.num_pages}); got "
                                 f"{after}, {what}.")
            end = self._room.pop(after, None)
        if n == 0:
            if after is not None and end is not None:
                self._room[after] = end
            return []
        claimed = self._claimed()
        out: list[int] = []
        if after is not None:  # grow in place
            p = after + 1
            while len(out) < n and p < self.num_pages and self._is_free[p] and not claimed[p]:
                out.append(p)
                p += 1
            self._take(out)
        need = n - len(out)
        if need:
            out += self._place(need, max(need, expect - len(out)), claimed)
        room = (out[-1] + 1 + expect - n if expect > n
                else end if end is not None and after is not None and out[0] == after + 1
                else None)
        if room is not None and room > out[-1] + 1:
            self._room[out[-1]] = min(self.num_pages, room)
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return out

    def _place(self, n: int, want: int, claimed: np.ndarray) -> list[int]:
        """``n`` free pages for a new run: the start of the smallest unclaimed free run
        holding ``want`` (else ``n``) pages; else the longest runs first, rooms last."""
        free = self._is_free & ~claimed
        starts, lengths = _runs(free)
        for size in (want, n):
            fits = np.flatnonzero(lengths >= size)
            if fits.size:
                i = fits[np.argmin(lengths[fits])]  # the smallest (then lowest) that fits
                return self._take(list(range(int(starts[i]), int(starts[i]) + n)))
        out: list[int] = []
        for mask in (free, self._is_free):  # a fragmented pool: rooms are given up last
            starts, lengths = _runs(mask & self._is_free)
            for i in np.argsort(-lengths, kind="stable"):
                s = int(starts[i])
                out += self._take(list(range(s, s + min(int(lengths[i]), n - len(out)))))
                if len(out) == n:
                    return out
        raise AssertionError("unreachable: n <= the free pages")

    def free(self, pages: list[int], reserved: int = 0) -> None:
        """Return ``pages`` to the pool (with the room kept after them) and release
        ``reserved`` bookings.

        Raises:
          ValueError: a page outside the pool, one already free, or one given twice;
            ``reserved`` more than the pages booked (a booking released twice).
          TypeError: ``reserved`` not an int.
        """
        reserved = _checks.check_nonneg_int("reserved", reserved)
        if reserved > self.reserved:
            raise ValueError(f"reserved={reserved} bookings released, but only "
                             f"{self.reserved} page(s) are booked (a booking released twice?).")
        seen: set[int] = set()
        for p in pages:
            if not 0 <= p < self.num_pages or self._is_free[p] or p in seen:
                raise ValueError(f"page {p} is not an allocated page of this pool "
                                 f"(num_pages={self.num_pages}).")
            seen.add(p)
        for p in pages:
            self._room.pop(p, None)
        self._is_free[list(seen)] = True
        self._num_free += len(seen)
        self.reserved -= reserved


def table_array(rows: list[list[int]], pages_per_seq: int) -> np.ndarray:
    """int32 ``[len(rows), pages_per_seq]`` page table, ``-1`` past each row's pages."""
    out = np.full((len(rows), pages_per_seq), -1, np.int32)
    for b, pages in enumerate(rows):
        out[b, :len(pages)] = pages
    return out
