"""Prefix caching in the serving loop (``ServingEngine(..., prefix_caching=True)``): requests
whose prompts start alike share the full pages of that start. Every generation must be
the one an engine without sharing gives, token for token (the pages hold the same keys:
the shared part is whole prefill chunks, so the rest runs in the same chunks); a cached
page is never written while cached; unreferenced pages are evicted least recently used
first, a request's last pages before its first; models whose pages cannot be shared are
refused by name."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import jaxpos
from jaxpos.nnx import DecoderLM
from jaxpos.serving import PageAllocator, PagedDecoder, Request, ServingEngine
from jaxpos.serving.model import ModuleDecoder
from jaxpos.serving.prefix import PrefixCache, check_shareable


# ------------------------------------------------------------------ the cache alone
def test_pages_are_keyed_by_their_prefix_position_and_model_and_referenced_while_held():
    alloc = PageAllocator(6)
    pc = PrefixCache(alloc, 2, "model-a")
    # keys: one per full page; a page's key depends on every earlier token and the model
    k = pc.keys([1, 2, 3, 4, 5])
    assert len(k) == 2 and len(set(k)) == 2
    assert pc.keys([1, 2, 3, 4])[:2] == k
    assert pc.keys([9, 2, 3, 4])[1] != k[1]  # same tokens 3, 4, another parent
    assert PrefixCache(PageAllocator(6), 2, "model-b").keys([1, 2, 3, 4]) != k
    assert pc.keys([3, 4])[0] != k[1]  # the same tokens at position 0, not 2

    assert pc.book([1, 2, 3, 4, 5], 3) == []  # nothing cached yet
    a = pc.allocate(3)
    assert pc.register([1, 2, 3, 4, 5], a) == 2  # the two full pages; the third is partial
    b = pc.book([1, 2, 3, 4, 9], 3)
    assert b == a[:2] and [pc.refs(p) for p in b] == [2, 2]
    assert alloc.reserved == 3 + 1  # the first request's 3; the second's own page
    b += pc.allocate(1, after=b[-1])
    pc.free(a, 3)
    assert [pc.refs(p) for p in b[:2]] == [1, 1] and alloc.in_use == 3
    pc.free(b, 3)
    assert pc.in_use == 0 and alloc.reserved == 0 and alloc.in_use == 2  # kept, unreferenced
    # a whole cached prompt: its last token is recomputed, so its last page is not shared
    assert pc.book([1, 2, 3, 4], 2) == a[:1] and pc.refs(a[0]) == 1
    pc.free(a[:1], 2)


def test_unreferenced_pages_are_evicted_lru_first_and_a_requests_last_pages_first():
    alloc = PageAllocator(5)
    pc = PrefixCache(alloc, 1, "m")
    for prompt in ([1, 2], [5, 6]):  # two requests of 3 pages: 2 prompt pages, cached
        assert pc.book(prompt, 3) == []
        pages = pc.allocate(3)
        assert pc.register(prompt, pages) == 2
        pc.free(pages, 3)
    first, second = pc.keys([1, 2]), pc.keys([5, 6])
    assert alloc.in_use == 4 and pc.in_use == 0 and alloc.reserved == 0
    pc.allocate(2)  # 1 page free: evict the least recently used, its last page first
    assert pc.evictions == 1 and set(pc.cached.values()) == {first[0], *second}
    pc.allocate(2)
    assert pc.evictions == 3 and set(pc.cached.values()) == {second[0]}
    # a page booked again is not evictable while referenced
    assert pc.book([5, 6, 7], 2) == list(pc.cached)
    with pytest.raises(ValueError, match="page pool exhausted"):
        pc.allocate(1)


def test_the_shared_part_is_a_whole_number_of_granules():
    alloc = PageAllocator(8)
    pc = PrefixCache(alloc, 2, "m", granule=4)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    pc.book(prompt, 4)
    pages = pc.allocate(4)
    assert pc.register(prompt, pages) == 3
    # 3 full pages cached, 6 of the next prompt's tokens: 4 shared (2 pages), 2 recomputed
    assert pc.book(prompt, 4) == pages[:2]
    with pytest.raises(ValueError, match="multiple of page_size"):
        PrefixCache(alloc, 2, "m", granule=3)


# ---------------------------------------------------------------------- the loop
def _engines(model) -> tuple[ServingEngine, ServingEngine]:
    """Two engines over ``model``, without and with prefix caching; the second runs the
    first's jitted step (one model, one compilation: the step is the same function of the
    model either way)."""
    plain, shared = (ServingEngine(model, num_slots=2, num_pages=20, page_size=4, max_len=24,
                                   prefill_chunk=4, prefix_caching=caching)
                     for caching in (False, True))
    shared._step = plain._step
    return plain, shared


@pytest.fixture(scope="module")
def rope_engines():
    """An engine without sharing and one with it, over one RoPE model (RoPE caches keys
    rotated at write); the tests clear the prefix cache first."""
    model = PagedDecoder(vocab_size=32, d_model=16, num_layers=1, num_heads=4, num_kv_heads=2,
                         position=jaxpos.RoPE(rotary_dim=4), seed=1)
    return _engines(model)


def _run_checking_cached_pages(eng: ServingEngine, requests: list[Request]) -> tuple:
    """Stream ``requests``; after every event, every cached page of every layer's pool
    holds what it held when it was first seen cached under its key. Returns
    ``(completions, stats)``."""
    assert eng.prefix_cache is not None
    seen: dict[tuple, list[np.ndarray]] = {}
    with eng.stream(requests) as stream:
        for _ in stream:
            leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(eng.pool)]
            for page, key in eng.prefix_cache.cached.items():
                now = [x[page] for x in leaves]
                for was, got in zip(seen.setdefault((page, key), now), now):
                    np.testing.assert_array_equal(got, was, err_msg=f"cached page {page}")
    return stream.completions, stream.stats


def _system_prompt_case(plain: ServingEngine, eng: ServingEngine) -> None:
    """Pages of 4, prefill chunks of 4, a 10-token system prompt S, 2 slots. Cached prompt
    tokens, request by request: S+a (13 tokens) 0 (nothing cached; it caches its 3 full
    pages); S 8 (its 2 full pages; 2 tokens prefilled); S+b (16) 8 (page 2 differs); S+b
    again 12 (its whole prompt is cached: the last page is recomputed); S+a again 12; an
    unrelated prompt 0; S[:6]+c 4 (page 1 differs). One request samples (temperature 0.8):
    its seeded tokens match too."""
    assert eng.prefix_cache is not None
    eng.prefix_cache.clear()
    rng = np.random.default_rng(0)
    S = rng.integers(0, 32, 10).tolist()
    a, b, c = (rng.integers(0, 32, n).tolist() for n in (3, 6, 3))
    prompts = [S + a, S, S + b, S + b, S + a, rng.integers(0, 32, 5).tolist(), S[:6] + c]
    reqs = [Request(p, 4, id=i) for i, p in enumerate(prompts)]
    reqs[4] = Request(prompts[4], 4, temperature=0.8, seed=7, id=4)
    want_done, want_stats = plain.run(reqs)
    done, stats = _run_checking_cached_pages(eng, reqs)
    want = {c.request.id: c.tokens for c in want_done}
    got = {c.request.id: c.tokens for c in done}
    assert got == want and all(len(t) == 4 for t in got.values())
    assert stats.cached_tokens == 8 + 8 + 12 + 12 + 4 and want_stats.cached_tokens == 0
    total = sum(len(p) for p in prompts)
    assert stats.prefill_tokens == total - stats.cached_tokens
    assert want_stats.prefill_tokens == total
    assert eng.prefix_cache.in_use == 0 and eng.allocator.reserved == 0
    assert eng.prefix_cache.evictions == 0
    assert eng.allocator.in_use == len(eng.prefix_cache.cached) == 3 + 2 + 1 + 1


def test_requests_sharing_a_system_prompt_get_the_tokens_of_an_engine_without_sharing(
        rope_engines):
    _system_prompt_case(*rope_engines)


@pytest.mark.slow
def test_requests_sharing_a_system_prompt_with_alibi_in_a_decoder_lm():
    """The same case with ALiBi (raw keys, the bias from positions) in a
    jaxpos.nnx.DecoderLM behind ModuleDecoder."""
    model = ModuleDecoder(DecoderLM(32, d_model=16, num_layers=1, num_heads=2,
                                    position="alibi", rngs=nnx.Rngs(0)))
    _system_prompt_case(*_engines(model))


def test_sharing_equals_no_sharing_when_the_pool_evicts_cached_pages(rope_engines):
    """Five 16-token system prompts (4 pages each), each used by two requests in turn, then
    the first and third again, through 2 slots and 20 pages (a request books 6): the cache
    cannot keep every system prompt, so pages are evicted (least recently used, a
    prompt's last pages first), the later requests still hit what is left, every
    generation is the one without sharing, and no cached page changes while cached."""
    plain, eng = rope_engines
    pc = eng.prefix_cache
    assert pc is not None
    pc.clear()
    evicted = pc.evictions
    rng = np.random.default_rng(1)
    systems = [rng.integers(0, 32, 16).tolist() for _ in range(5)]
    order = [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 0, 2]
    reqs = [Request(systems[s] + rng.integers(0, 32, 2).tolist(), 3, id=i)
            for i, s in enumerate(order)]
    want, _ = plain.run(reqs)
    done, stats = _run_checking_cached_pages(eng, reqs)
    assert {c.request.id: c.tokens for c in done} == {c.request.id: c.tokens for c in want}
    assert pc.evictions > evicted
    # each pair's second request shares its system prompt's 4 pages; the last two find
    # part of theirs, or none
    assert 5 * 16 <= stats.cached_tokens < 7 * 16 and stats.cached_tokens % 4 == 0
    assert pc.in_use == 0 and eng.allocator.reserved == 0
    assert eng.allocator.in_use == len(pc.cached) <= 20


@pytest.mark.slow
def test_a_page_holds_the_same_keys_whether_its_request_shared_a_prefix_or_not():
    """Dynamic NTK RoPE rotated at write (a key's rotation depends on the call that writes
    it, through its largest position), pages of 4, prefill chunks of 8. A 19-token prompt
    R runs alone in one engine; in another, a prompt with R's first 12 tokens runs first
    (caching 3 pages), then R shares 8 tokens (a whole chunk, not 12) and prefills
    [8, 16), [16, 19) as alone. Every cached page is then bit for bit the page of the same
    key computed without sharing (with 12 shared, [12, 19) would rotate with other
    frequencies)."""
    from jaxpos.schemes.rope.scaling import DynamicNTKScaling

    rope = jaxpos.RoPE(rotary_dim=8, base=10.0, scaling=DynamicNTKScaling(8.0, 4))
    model = PagedDecoder(vocab_size=64, d_model=32, num_layers=2, num_heads=4, position=rope,
                         seed=3)
    alone, shared = (ServingEngine(model, num_slots=1, num_pages=12, page_size=4, max_len=24,
                                   prefill_chunk=8, prefix_caching=True) for _ in range(2))
    shared._step = alone._step
    rng = np.random.default_rng(3)
    R = rng.integers(0, 64, 19).tolist()
    alone.run([Request(R, 2)])
    _, stats = shared.run([Request(R[:12] + [5, 6, 7], 2), Request(R, 2)])
    assert stats.cached_tokens == 8
    assert alone.prefix_cache is not None and shared.prefix_cache is not None
    mine = {key: page for page, key in shared.prefix_cache.cached.items()}
    pairs = [(page, mine[key]) for page, key in alone.prefix_cache.cached.items()]
    assert len(pairs) == 4  # R's full pages
    for a, b in zip(jax.tree_util.tree_leaves(alone.pool), jax.tree_util.tree_leaves(shared.pool)):
        for pa, pb in pairs:
            np.testing.assert_array_equal(np.asarray(a)[pa], np.asarray(b)[pb])


@pytest.mark.slow
def test_sharing_with_a_token_budget_gives_the_tokens_of_the_budget_loop_without_it():
    """max_num_batched_tokens=8 (ragged steps): requests still book the cached pages their
    prompts start with and prefill after them, and generate the tokens of the same loop
    without sharing."""
    model = PagedDecoder(vocab_size=32, d_model=16, num_layers=1, num_heads=4, num_kv_heads=2,
                         position=jaxpos.RoPE(rotary_dim=4), seed=1)
    plain, shared = (ServingEngine(model, num_slots=2, num_pages=20, page_size=4, max_len=24,
                                   prefix_caching=caching, max_num_batched_tokens=8)
                     for caching in (False, True))
    rng = np.random.default_rng(0)
    S = rng.integers(0, 32, 10).tolist()
    prompts = [S + rng.integers(0, 32, n).tolist() for n in (3, 0, 6, 1)]
    reqs = [Request(p, 4, id=i) for i, p in enumerate(prompts + [prompts[2]])]
    want, _ = plain.run(reqs)
    got, stats = shared.run(reqs)
    assert {c.request.id: c.tokens for c in got} == {c.request.id: c.tokens for c in want}
    assert stats.cached_tokens > 0 and stats.prefill_tokens + stats.cached_tokens == sum(
        len(r.prompt) for r in reqs)
    assert shared.prefix_cache is not None and shared.prefix_cache.in_use == 0
    assert shared.allocator.reserved == 0


# ------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("position, match", [
    ("path", r"position='path' changes the cached keys after they are written"),
    ("fox", r"position='fox' decodes with per-request state beside the pages \(g_last")])
def test_models_whose_pages_cannot_be_shared_are_refused_by_name(position, match):
    lm = DecoderLM(16, d_model=8, num_layers=1, num_heads=2, position=position,
                   rngs=nnx.Rngs(0))
    model = ModuleDecoder(lm)
    with pytest.raises(ValueError, match=match):
        ServingEngine(model, num_slots=1, num_pages=4, page_size=2, max_len=8,
                      prefix_caching=True)
    ServingEngine(model, num_slots=1, num_pages=4, page_size=2, max_len=8)  # no sharing: fine


def test_a_cache_that_re_places_tokens_and_a_model_that_says_nothing_are_refused():
    lm = DecoderLM(16, d_model=8, num_layers=1, num_heads=2, position="rope",
                   rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="StreamingKVCache re-places its tokens"):
        check_shareable("lm", lm.init_cache(1, 8, keep_first=2))
    assert check_shareable("lm", lm.init_cache(1, 8, page_size=4, num_pages=2)) == "lm:-"

    class Bare:  # a PagedModel without page_sharing_key
        def __init__(self, inner):
            self.params, self.vocab_size, self._inner = inner.params, inner.vocab_size, inner

        def init_pool(self, num_pages, page_size):
            return self._inner.init_pool(num_pages, page_size)

        def forward(self, *args):
            return self._inner.forward(*args)

    bare = Bare(PagedDecoder(vocab_size=16, d_model=8, num_layers=1, num_heads=2))
    with pytest.raises(ValueError, match="Bare has none"):
        ServingEngine(bare, num_slots=1, num_pages=4, page_size=2, max_len=8,
                      prefix_caching=True)
