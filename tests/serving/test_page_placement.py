"""Where the page allocator puts a request's pages: runs of consecutive free pages (best
fit, grown in place), any free pages from a fragmented pool, and the serving loop's
tokens independent of the placement."""

from __future__ import annotations

import numpy as np
import pytest

import jaxpos
from jaxpos.serving import PageAllocator, PagedDecoder, Request, ServingEngine


def _is_run(pages):
    return list(pages) == list(range(pages[0], pages[0] + len(pages)))


def test_fresh_pool_gives_each_growing_request_one_run_of_consecutive_pages():
    """Three requests booked for 4, 6 and 3 pages grow one page at a time, interleaved (as
    decode steps hand out pages): each ends up holding one run; without rooms kept after
    each run they would be striped 0, 3, 6, ... over the pool."""
    a = PageAllocator(16)
    booked = [4, 6, 3]
    held: list[list[int]] = [[], [], []]
    for _ in range(max(booked)):
        for r, want in enumerate(booked):
            if len(held[r]) < want:
                after = held[r][-1] if held[r] else None
                held[r] += a.allocate(1, after=after, expect=want - len(held[r]))
    assert held == [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9], [10, 11, 12]]
    assert a.in_use == 13 and a.peak_in_use == 13
    # and a plain allocation from a fresh pool is a run from page 0
    assert PageAllocator(8).allocate(5) == [0, 1, 2, 3, 4]


def test_a_new_request_goes_to_the_smallest_free_run_that_holds_it():
    """Free runs of 3 (pages 1-3), 5 (5-9) and 2 (11-12) pages plus the tail 14-15: a
    request expecting 4 pages takes the run of 5, one expecting 2 the run of 2, and freed
    pages come back (a request of 16 pages after everything is freed gets 0 .. 15)."""
    a = PageAllocator(16)
    pages = a.allocate(16)
    a.free([p for p in pages if p in (1, 2, 3, 5, 6, 7, 8, 9, 11, 12, 14, 15)])
    assert a.allocate(1, expect=4) == [5]
    assert a.allocate(2) == [11, 12]
    assert a.allocate(1, after=5, expect=3) == [6]  # grows in place
    assert a.allocate(3) == [1, 2, 3]  # not 7 .. 9: 7 and 8 are the growing request's room
    a.free([0, 1, 2, 3, 4, 5, 6, 10, 11, 12, 13])
    assert a.in_use == 0 and a.allocate(16) == list(range(16))


def test_a_fragmented_pool_still_hands_out_every_free_page_once():
    """400 random allocations (1-7 pages, some growing earlier requests) and frees on a
    pool of 40 pages: every allocation the free pages can cover succeeds, no page is held
    twice, the counts agree, and when the pool cannot keep a run (the requests' rooms are
    taken last) allocation still succeeds."""
    rng = np.random.default_rng(0)
    a = PageAllocator(40)
    live: dict[int, list[int]] = {}
    runs = total = 0
    for step in range(400):
        if live and (rng.random() < 0.4 or a.in_use > 34):
            r = int(rng.choice(list(live)))
            a.free(live.pop(r))
            continue
        n = int(rng.integers(1, 8))
        if n > a.num_pages - a.in_use:
            with pytest.raises(ValueError, match="page pool exhausted"):
                a.allocate(n)
            continue
        grow = live and rng.random() < 0.5
        if grow:
            r = int(rng.choice(list(live)))
            live[r] += a.allocate(n, after=live[r][-1], expect=n + int(rng.integers(0, 4)))
        else:
            live[step] = a.allocate(n, expect=n + int(rng.integers(0, 4)))
        held = [p for pages in live.values() for p in pages]
        assert len(held) == len(set(held)) == a.in_use
        assert all(0 <= p < 40 for p in held)
        assert not a._is_free[held].any() and a._is_free.sum() == 40 - len(held)
        total += 1
        runs += all(_is_run(pages) for pages in live.values())
    assert total > 200 and 0 < runs < total  # the pool did fragment
    for pages in live.values():
        a.free(pages)
    assert a.in_use == 0 and a.allocate(40) == list(range(40))


def test_bad_allocator_arguments_raise_naming_them():
    a = PageAllocator(6)
    got = a.allocate(2)
    with pytest.raises(ValueError, match="after must be a page this pool handed out.*got 4"):
        a.allocate(1, after=4)
    with pytest.raises(ValueError, match="after must be .*got 9, outside the pool"):
        a.allocate(1, after=9)
    with pytest.raises(ValueError, match="expect .* must be >= n = 3; got 2"):
        a.allocate(3, expect=2)
    with pytest.raises(TypeError, match="n must be a Python int"):
        a.allocate(1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="page 1 is not an allocated page"):
        a.free([1, 1])
    a.free(got)
    assert a.in_use == 0


@pytest.mark.slow  # compiles the loop's two steps (~6 s of CPU)
def test_the_loop_places_requests_in_runs_and_its_tokens_do_not_depend_on_placement(
        monkeypatch):
    """6 requests (greedy and sampled) through 3 slots, pages of 4 slots, prefill chunks of
    4: with the allocator's placement every request holds one run of pages, and the tokens
    equal those of a pool handed out in descending order (every page boundary a jump)."""
    model = PagedDecoder(vocab_size=32, d_model=16, num_layers=1, num_heads=4, num_kv_heads=2,
                         position=jaxpos.RoPE(rotary_dim=4), seed=2)
    rng = np.random.default_rng(1)
    reqs = [Request(rng.integers(0, 32, n).tolist(), b, temperature=0.0 if i % 2 else 0.9,
                    top_k=8, seed=i)
            for i, (n, b) in enumerate([(9, 6), (3, 11), (6, 4), (13, 7), (2, 9), (5, 5)])]
    eng = ServingEngine(model, num_slots=3, num_pages=24, page_size=4, max_len=24,
                        prefill_chunk=4)
    alloc, free = eng.allocator, eng.allocator.free
    freed: list[list[int]] = []  # each request's pages, as the loop returns them

    def recording_free(pages, reserved=0):
        freed.append(list(pages))
        free(pages, reserved)

    def descending(n, *, after=None, expect=None):  # the highest free pages first
        return alloc._take([int(p) for p in np.flatnonzero(alloc._is_free)[::-1][:n]])

    monkeypatch.setattr(alloc, "free", recording_free)
    outs = []
    for scatter in (False, True):
        if scatter:
            monkeypatch.setattr(alloc, "allocate", descending)
        freed.clear()
        done, _ = eng.run(reqs)
        outs.append({c.request.id: c.tokens for c in done})
        assert len(freed) == len(reqs) and alloc.in_use == 0
        assert all(len(pages) > 1 for pages in freed)
        assert all(_is_run(pages) for pages in freed) != scatter
    assert outs[0] == outs[1]
    assert [len(outs[0][i]) for i in range(len(reqs))] == [r.max_new_tokens for r in reqs]
