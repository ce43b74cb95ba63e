"""Padded steps of the serving loop: budgeted ``[num_slots, prefill_chunk]`` steps
(``ServingEngine(..., max_num_batched_tokens=)`` over a model without a packed ragged
step) and prefill chunks. A padded step writes ``prefill_chunk - 1`` padding slots after
a row's tokens, so a request books its last written slot (``total - 2``: its last sampled
token is never written) plus that padding, and no more; the padding's positions stop at
``max_len - 1``, so a model whose positions end at ``max_len`` (a learned table) gives
its tokens their own logits."""

from __future__ import annotations

import numpy as np
import pytest
from _serving_reference import assert_greedy_alone
from flax import nnx

from jaxpos.nnx import DecoderLM
from jaxpos.serving import Request, ServingEngine
from jaxpos.serving.model import ModuleDecoder


def test_padded_steps_book_the_last_written_slot_plus_one_steps_padding():
    """FoX (padded steps), pages of 4, prefill_chunk 4, budget 3. Request A (6 + 4 tokens)
    writes slots 0..8 and, when its last decode token shares a step with B's prompt chunk,
    padding up to slot 11: 3 pages. A 3-page pool serves it (it was refused as needing 4),
    refuses a 7 + 4 request (its padding reaches slot 12), and a 6-page pool runs A and B
    (7 + 1 tokens, 3 pages) at once, A's last decode in a [2, 4] step whose padding fills
    A's third page: each gets the argmax of the module's own full pass at every step."""
    lm = DecoderLM(16, d_model=8, num_layers=1, num_heads=2, position="fox", rngs=nnx.Rngs(0))
    dec = ModuleDecoder(lm)
    rng = np.random.default_rng(0)
    a = Request(rng.integers(0, 16, 6).tolist(), 4, id="A")
    b = Request(rng.integers(0, 16, 7).tolist(), 1, id="B")
    kw = dict(num_slots=2, page_size=4, max_len=12, prefill_chunk=4, max_num_batched_tokens=3)

    small = ServingEngine(dec, num_pages=3, **kw)
    assert not small.scheduler.packed
    small.stream([a]).close()  # accepted: 3 pages hold slots 0..11
    with pytest.raises(ValueError, match=r"request 'C' needs 4 pages; the pool holds "
                                         r"num_pages=3"):
        small.stream([Request([1] * 7, 4, id="C")])

    eng = ServingEngine(dec, num_pages=6, **kw)
    done, stats = eng.run([a, b])
    # A's 2 prefill steps and 3 decode steps, B's 7-token prompt in 2-token chunks beside
    # A's decode tokens, then its last token: 6 steps, 3 + 2 pages held at the peak (with
    # A booking 4 pages, B waited for A and the run took 8 steps)
    assert (stats.decode_steps, stats.peak_pages) == (6, 5)
    assert eng.allocator.in_use == eng.allocator.reserved == 0
    assert_greedy_alone(lambda seqs: nnx.jit(lambda m, t: m(t))(lm, seqs), done)
    assert [len(c.tokens) for c in sorted(done, key=lambda c: c.request.id)] == [4, 1]


def test_padding_past_max_len_leaves_a_learned_position_table_s_tokens_alone():
    """A learned position table of max_len = 12 rows, int8 pages (padded budgeted steps),
    prefill_chunk 8: a 9- and an 11-token prompt are padded to position 15, past the
    table, whose NaN rows reached the row's own tokens through the padding keys (every
    token came out 0); the padding now stops at position 11. Each request gets the
    argmax of the module's own full pass."""
    lm = DecoderLM(16, d_model=8, num_layers=1, num_heads=2, position="learned", max_len=12,
                   rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    reqs = [Request(rng.integers(0, 16, 11).tolist(), 1),
            Request(rng.integers(0, 16, 9).tolist(), 3)]
    eng = ServingEngine(ModuleDecoder(lm, kv_dtype="int8"), num_slots=2, num_pages=16,
                        page_size=4, max_len=12, prefill_chunk=8, max_num_batched_tokens=3)
    assert not eng.scheduler.packed
    done, _ = eng.run(reqs)
    assert_greedy_alone(lambda seqs: nnx.jit(lambda m, t: m(t))(lm, seqs), done)
    assert sorted(len(c.tokens) for c in done) == [1, 3]
