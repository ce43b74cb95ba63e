"""The serving loop with a token budget (``ServingEngine(..., max_num_batched_tokens=)``):
one ragged step per iteration holding the running requests' decode tokens and chunks of
new prompts. Each greedy generation must equal the argmax of the cacheless full forward
pass at every step (what the request gets run alone), the step must not retrace for new
prompt lengths, and the scheduler must keep to the budget with decode tokens first."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _serving_reference import assert_greedy_alone, full_pass_logits
from flax import nnx

import jaxpos
from jaxpos.nnx import DecoderLM
from jaxpos.serving import PagedDecoder, Request, ServingEngine
from jaxpos.serving.model import ModuleDecoder
from jaxpos.serving.scheduler import schedule_step, token_bucket


def _full_pass_logits(model: PagedDecoder, seqs: np.ndarray) -> np.ndarray:
    """``[B, T, V]``: the causal forward pass over each row of ``seqs [B, T]`` (dense
    reference attention, no cache; jitted once: rows right-padded, the pass is causal)."""
    run = jax.jit(lambda tokens: full_pass_logits(model, tokens))
    return np.asarray(run(jnp.asarray(seqs, jnp.int32)))


_PROMPT_LENGTHS = (9, 1, 13, 6, 2)
_BUDGETS = (3, 6, 4, 5, 3)


def _requests(vocab: int, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    return [Request(rng.integers(0, vocab, n).tolist(), b)
            for n, b in zip(_PROMPT_LENGTHS, _BUDGETS)]


def test_budgeted_loop_gives_each_request_its_greedy_tokens_alone():
    """RoPE PagedDecoder, 5 requests through 2 slots, budget 8 tokens a step, pages of 4:
    the 13- and 9-token prompts go in chunks beside the other request's decode tokens,
    requests join as others leave; every generation is the full pass's greedy one and
    every page is back at the end."""
    model = PagedDecoder(vocab_size=32, d_model=16, num_layers=1, num_heads=4, num_kv_heads=2,
                         position=jaxpos.RoPE(rotary_dim=4), seed=1)
    reqs = _requests(32)
    eng = ServingEngine(model, num_slots=2, num_pages=12, page_size=4, max_len=20,
                        max_num_batched_tokens=8)
    done, stats = eng.run(reqs)
    assert sorted(len(c.tokens) for c in done) == sorted(_BUDGETS)
    assert_greedy_alone(lambda seqs: _full_pass_logits(model, seqs), done)
    assert stats.generated == sum(_BUDGETS)
    # the 13-token prompt cannot go in one step of 8: more steps than an unchunked loop
    assert stats.decode_steps >= max(_BUDGETS) + 2
    assert eng.allocator.in_use == 0 and eng.allocator.reserved == 0


def test_budgeted_loop_drives_a_decoder_lm_module_through_the_ragged_call():
    """jaxpos.nnx.DecoderLM (RoPE) behind ModuleDecoder: its attention layers get packed
    queries with cu_q_lengths (RaggedPagedCache); each generation is the argmax of the
    module's own full pass at every step."""
    lm = DecoderLM(32, d_model=16, num_layers=1, num_heads=2, position="rope",
                   rngs=nnx.Rngs(0))
    reqs = _requests(32, seed=2)[:3]
    eng = ServingEngine(ModuleDecoder(lm), num_slots=2, num_pages=12, page_size=4,
                        max_len=20, max_num_batched_tokens=8)
    done, _ = eng.run(reqs)
    assert len(done) == 3
    assert_greedy_alone(lambda seqs: np.asarray(nnx.jit(lambda m, t: m(t))(lm, seqs)), done)


@dataclasses.dataclass(frozen=True)
class _CountingDecoder(PagedDecoder):
    """A PagedDecoder counting how often its ragged step is traced (once per compiled
    shape of the jitted step)."""

    traces: list = dataclasses.field(default_factory=list, compare=False, hash=False)

    def forward_ragged(self, *args):
        self.traces.append(args[1].shape)  # the padded token count
        return super().forward_ragged(*args)


def test_new_prompt_lengths_do_not_compile_a_new_step():
    """Budget 16: every step pads its tokens to 8 or 16, so a first run compiles at most
    those two shapes and a second run with prompt lengths it never saw compiles none."""
    model = _CountingDecoder(vocab_size=16, d_model=8, num_layers=1, num_heads=2)
    eng = ServingEngine(model, num_slots=2, num_pages=16, page_size=4, max_len=24,
                        max_num_batched_tokens=16)
    eng.run([Request([1] * 11, 2), Request([2, 3, 4], 3)])
    first = len(model.traces)
    assert first <= 2 and set(model.traces) <= {(8,), (16,)}, model.traces
    eng.run([Request([5] * n, 2) for n in (5, 7, 14, 2, 9)])
    assert len(model.traces) == first, model.traces


def test_schedule_puts_decode_tokens_first_and_chunks_prompts_to_the_budget():
    """Slot 0 decodes, slot 1 is 3 tokens into a 20-token prompt, slot 2 just admitted with
    a 5-token prompt: with budget 8 the step holds slot 0's token, 7 of slot 1's prompt
    (it arrived first) and nothing of slot 2's; with budget 30, all of both prompts."""

    @dataclasses.dataclass
    class Run:
        request: Request
        tokens: list
        length: int
        arrival: float

    slots = [Run(Request([1, 2], 4), [7], 2, 0.0), Run(Request(list(range(20)), 2), [], 3, 1.0),
             None, Run(Request([4] * 5, 2), [], 0, 2.0)]
    plan = schedule_step(slots, 8)
    assert [(s.slot, s.start, s.tokens, s.samples) for s in plan] == [
        (0, 2, (7,), True), (1, 3, tuple(range(3, 10)), False)]
    plan = schedule_step(slots, 30)
    assert [(s.slot, len(s.tokens), s.samples) for s in plan] == [
        (0, 1, True), (1, 17, True), (3, 5, True)]
    assert [token_bucket(n, 16) for n in (0, 1, 8, 9, 16)] == [8, 8, 8, 16, 16]
    assert token_bucket(3, 4) == 4 and token_bucket(100, 100) == 128


def test_token_budget_refusals_name_the_problem():
    """A budget below num_slots or not a positive int is refused before any device work."""
    model = PagedDecoder(vocab_size=16, d_model=8, num_layers=1, num_heads=2)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= num_slots"):
        ServingEngine(model, num_slots=4, num_pages=8, page_size=4, max_len=8,
                      max_num_batched_tokens=3)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        ServingEngine(model, num_slots=1, num_pages=8, page_size=4, max_len=8,
                      max_num_batched_tokens=0)


@pytest.mark.parametrize("position, kv_dtype", [("fox", None), ("path", None),
                                                ("rope", "int8")])
def test_budgeted_loop_serves_scheme_states_and_quantised_pages_in_padded_steps(position,
                                                                                kv_dtype):
    """FoX (a cumulative log forget gate per slot), PaTH (every cached key moved by each
    step's Householder transforms) and int8 pages have no packed ragged step: under a token
    budget they run padded [slots, chunk] steps, prompts in chunks beside the other
    requests' decode tokens (3 slots, budget 4: one step leaves a running request with
    nothing scheduled, its row all padding), and each request gets the greedy
    tokens it gets alone (the module's full pass; for int8 pages, the loop without a
    budget, which quantises the same keys)."""
    lm = DecoderLM(16, d_model=8, num_layers=1, num_heads=2, position=position,
                   rngs=nnx.Rngs(0))
    decoder = ModuleDecoder(lm, kv_dtype=kv_dtype)
    reqs = _requests(16, seed=3)
    kw = dict(num_slots=3, num_pages=36, page_size=2, max_len=20, prefill_chunk=4)
    eng = ServingEngine(decoder, max_num_batched_tokens=4, **kw)
    assert not eng.scheduler.packed
    assert re.search("decode state" if kv_dtype is None else "quantised",
                     eng.scheduler.padded_because)
    done, stats = eng.run(reqs)
    assert sorted(len(c.tokens) for c in done) == sorted(_BUDGETS)
    if kv_dtype is None:
        assert_greedy_alone(lambda seqs: np.asarray(nnx.jit(lambda m, t: m(t))(lm, seqs)),
                             done)
    else:
        alone, _ = ServingEngine(decoder, **kw).run(reqs)
        want = {c.request.id: c.tokens for c in alone}
        assert {c.request.id: c.tokens for c in done} == want
    # the 13-token prompt goes in chunks of at most 4 beside decode tokens
    assert stats.decode_steps >= max(_BUDGETS) + 3
    assert eng.allocator.in_use == 0 and eng.allocator.reserved == 0


@dataclasses.dataclass(frozen=True)
class _ForwardOnly:
    """A PagedModel with ``forward`` only (no ragged step), over a PagedDecoder."""

    model: PagedDecoder
    traces: list = dataclasses.field(default_factory=list, compare=False, hash=False)

    @property
    def params(self):
        return self.model.params

    @property
    def vocab_size(self):
        return self.model.vocab_size

    def init_pool(self, num_pages, page_size):
        return self.model.init_pool(num_pages, page_size)

    def forward(self, *args):
        self.traces.append(args[1].shape)  # the step's [slots, T] (once per compiled shape)
        return self.model.forward(*args)


def test_budgeted_loop_runs_a_model_without_forward_ragged_in_padded_steps():
    """A PagedModel with forward only is served under a token budget in padded steps (two
    compiled shapes), each request its greedy tokens alone."""
    model = PagedDecoder(vocab_size=32, d_model=16, num_layers=1, num_heads=4, num_kv_heads=2,
                         position=jaxpos.RoPE(rotary_dim=4), seed=1)
    served = _ForwardOnly(model)
    eng = ServingEngine(served, num_slots=3, num_pages=36, page_size=2,
                        max_len=20, prefill_chunk=4, max_num_batched_tokens=4)
    assert eng.scheduler.padded_because == "_ForwardOnly has no forward_ragged"
    done, _ = eng.run(_requests(32, seed=4))
    assert_greedy_alone(lambda seqs: _full_pass_logits(model, seqs), done)
    assert sorted(served.traces) == [(3, 1), (3, 4)]
