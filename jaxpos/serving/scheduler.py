"""The serving loop with a token budget: one ragged step per iteration (chunked prefill).

``ServingEngine(..., max_num_batched_tokens=N)`` runs every iteration as ONE jitted step
holding at most ``N`` new tokens: each running request's next token (decode), then the
next chunks of the prompts still being prefilled, oldest request first, then the first
chunks of newly admitted requests, until the budget is spent (vLLM's scheduler with
chunked prefill: Agrawal et al. 2024, "Taming Throughput-Latency Tradeoff in LLM Inference
with Sarathi-Serve", §4; Yu et al. 2022, Orca, §3). A long prompt so arrives as a few
chunks spread over several steps instead of stalling every running request, and a step's
decode tokens never wait behind a prefill.

The step packs the rows' new tokens along one axis and the model runs the ragged call
(``jaxpos.attention(q [total, N, H], k_pages, v_pages, page_table=, kv_lengths=,
cu_q_lengths=)``, :mod:`jaxpos.core.ragged`), through its ``forward_ragged``
(:mod:`jaxpos.serving.model`). Shapes are bucketed so that a new prompt length does not
compile a new step: the packed axis is padded to a power of two (at least
:data:`SMALLEST_BUCKET`, at most the budget's next power of two), with the padding as
unwritten tokens of one extra row; the rows are always the ``num_slots`` batch slots
(idle ones with no tokens) plus that padding row. So a loop compiles at most ``1 +
log2(next_pow2(N) / 8)`` steps, whatever its requests.

A model without a packed ragged step (FoX and PaTH, whose decode state is per request;
quantised pages; see :class:`RaggedLoop`) runs the same schedule as one padded step per
iteration, ``[num_slots, 1]`` or ``[num_slots, prefill_chunk]``: two compiled shapes.

A request samples its first token in the step that holds the end of its prompt; steps
holding an earlier chunk sample nothing for it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpos import _checks
from jaxpos.serving.sampling import sample_tokens, sampling_arrays
from jaxpos.serving.stream import StopCondition, StreamEvent

__all__ = ["SMALLEST_BUCKET", "RaggedLoop", "Scheduled", "padded_reason", "schedule_step",
           "token_bucket"]

#: the smallest padded token count of a ragged step
SMALLEST_BUCKET = 8


def token_bucket(n: int, budget: int) -> int:
    """The padded size of a step of ``n`` new tokens (``0 <= n <= budget``): the next power
    of two ``>= n``, at least ``min(SMALLEST_BUCKET, next_pow2(budget))``."""
    pow2 = lambda m: 1 << max(int(m) - 1, 0).bit_length()
    return max(pow2(n), min(SMALLEST_BUCKET, pow2(budget)))


@dataclasses.dataclass(frozen=True)
class Scheduled:
    """One row of a step: batch slot ``slot`` writes ``tokens`` after its ``start`` filled
    slots; ``samples``: the step's output at its last token is the request's next token
    (a decode token, or the last chunk of its prompt)."""

    slot: int
    start: int
    tokens: tuple[int, ...]
    samples: bool


def schedule_step(slots: Sequence[Any], budget: int,
                  max_chunk: int | None = None) -> list[Scheduled]:
    """Which tokens of which running requests go into the next step: first one decode token
    per request whose prompt is written (slot order), then prompt chunks, the request
    that arrived first first, while ``budget`` tokens remain.

    Args:
      slots: per batch slot a running request (``.request.prompt``, ``.tokens`` generated,
        ``.length`` slots written, ``.arrival``) or None.
      budget: the most new tokens of the step.
      max_chunk: the most prompt tokens of one request in the step (None: the budget).

    Returns:
      the scheduled rows in slot order (requests with nothing to run are left out).
    """
    left, rows = budget, {}
    for b, run in enumerate(slots):
        if run is not None and run.length >= len(run.request.prompt) and left > 0:
            rows[b] = Scheduled(b, run.length, (run.tokens[-1],), True)
            left -= 1
    prefilling = sorted((run.arrival, b) for b, run in enumerate(slots)
                        if run is not None and run.length < len(run.request.prompt))
    for _, b in prefilling:
        if left <= 0:
            break
        run = slots[b]
        prompt = run.request.prompt
        take = left if max_chunk is None else min(left, max_chunk)
        chunk = tuple(int(t) for t in prompt[run.length:run.length + take])
        rows[b] = Scheduled(b, run.length, chunk, run.length + len(chunk) == len(prompt))
        left -= len(chunk)
    return [rows[b] for b in sorted(rows)]


class RaggedLoop:
    """The iterations of a :class:`jaxpos.serving.ServingEngine` with a token budget (module
    docstring); the engine owns the pages, the slots and the events.

    A model that can run the ragged step (a ``forward_ragged`` and no ``ragged_refusal``)
    runs each iteration packed (:attr:`packed`). Any other model (FoX and PaTH, whose decode
    state a packed row does not carry; quantised pages; a module whose layers refuse a
    traced ragged step, :attr:`jaxpos.serving.ModuleDecoder.ragged_refusal`; a
    :class:`~jaxpos.serving.PagedModel` with ``forward`` only) runs the same schedule as
    one padded step: its ``forward`` over ``[num_slots, T]`` tokens, each running request
    in its own batch slot, masked after its scheduled tokens, with ``T = 1`` when the
    step holds decode tokens only and ``T = prefill_chunk`` otherwise (a request's prompt
    then goes at most ``prefill_chunk`` tokens a step). The tokens are the same; a padded
    step computes ``num_slots * T`` tokens where a packed one computes the next power of
    two of the scheduled ones. :attr:`padded_because` says why a loop runs padded.

    Args:
      engine: the engine; budget: ``max_num_batched_tokens``, an int ``>= num_slots`` (a
        step holds every running request's decode token, as vLLM requires).

    Raises:
      ValueError / TypeError: a budget that is not an int ``>= num_slots``.
    """

    def __init__(self, engine: Any, budget: int):
        _checks.check_positive_int("max_num_batched_tokens", budget)
        if budget < engine.num_slots:
            raise ValueError(f"max_num_batched_tokens must be >= num_slots (every running "
                             f"request's decode token fits one step); got {budget} < "
                             f"{engine.num_slots}.")
        self.engine, self.budget = engine, budget
        #: why this loop runs padded steps (None: it runs packed ragged steps)
        self.padded_because = padded_reason(engine.model)
        self.rows = engine.num_slots + 1  # the batch slots and the padding row
        self._step = jax.jit(self._forward_and_sample, donate_argnums=(1,))
        self._cached: dict[int, int] = {}  # id(run) -> prompt tokens read from shared pages

    @property
    def packed(self) -> bool:
        """Whether each step is the packed ragged step (else the padded ``[num_slots, T]``
        step: class docstring)."""
        return self.padded_because is None

    def _forward_and_sample(self, params, pool, tokens, positions, table, lengths, cu, mask,
                            last, temperature, top_k, top_p, seeds, counters):
        logits, pool = self.engine.model.forward_ragged(params, tokens, positions, pool, table,
                                                        lengths, cu, mask, last)
        return sample_tokens(logits, temperature, top_k, top_p, seeds, counters), pool

    def _admit(self, loop: Any) -> None:
        """Give waiting requests that have arrived free slots while the pool can book their
        pages and the budget has tokens left after the running requests' (all slots idle
        for ``schedule="static"``)."""
        eng = self.engine
        if eng.schedule == "static" and any(s is not None for s in loop.slots):
            return
        pending = sum(min(len(s.request.prompt) + len(s.tokens) - s.length, self.budget)
                      for s in loop.slots if s is not None)
        while (loop.waiting and None in loop.slots and pending < self.budget
               and loop.waiting[0].arrival <= loop.now()):
            run = self._book(loop.waiting[0])
            if run is None:
                return
            loop.waiting.popleft()
            loop.slots[loop.slots.index(None)] = run
            self._cached[id(run)] = run.length
            pending += len(run.request.prompt) - run.length

    def _book(self, r: Any) -> Any:
        """The engine's booking of ``r`` (its pages reserved; with prefix caching, the shared
        pages its prompt starts with, filled up to them), or None when the pool is full."""
        eng = self.engine
        book = getattr(eng, "_book", None)
        if book is not None:
            return book(r)
        from jaxpos.serving.engine import _Running  # (the engine imports this module)

        need = eng._pages_needed(r)
        if not eng.allocator.reserve(need):
            return None
        return _Running(r, [], need, 0, [], max(r.arrival, 0.0), stop=StopCondition.of(r))

    def iteration(self, loop: Any) -> Iterator[StreamEvent]:
        """Admit, schedule and run one step; yield the events of the tokens it sampled."""
        eng = self.engine
        self._admit(loop)
        plan = schedule_step(loop.slots, self.budget,
                             None if self.packed else eng.prefill_chunk)
        if not plan:
            if loop.waiting:  # the next request has not arrived yet
                time.sleep(max(0.0, min(loop.waiting[0].arrival - loop.now(), 0.01)))
            return
        n = sum(len(s.tokens) for s in plan)
        out = self._run_packed(loop, plan, n) if self.packed else self._run_padded(loop, plan)
        loop.stats.decode_steps += 1
        held = sum(r.length for r in loop.slots if r is not None) + n
        pages = getattr(eng, "_pages", eng.allocator)  # (the prefix cache, if any)
        loop.page_ratios.append(pages.in_use * eng.page_size / held)
        loop.dense_ratios.append(eng.num_slots * eng.max_len / held)
        runs = [(s, loop.slots[s.slot]) for s in plan]
        for s, run in runs:
            run.length = s.start + len(s.tokens)
        for s, run in runs:
            if not s.samples or loop.slots[s.slot] is not run:  # cancelled meanwhile
                continue
            run.tokens.append(int(out[s.slot]))
            if len(run.tokens) == 1:  # its prompt is written
                run.first_token = loop.now()
                cached = self._cached.pop(id(run), 0)
                if hasattr(eng, "_prefilled"):
                    eng._prefilled(loop, run, cached)
            yield from eng._emit(loop, s.slot)

    def _run_padded(self, loop: Any, plan: list[Scheduled]) -> np.ndarray:
        """The step ``plan`` as the model's ``forward`` over ``[num_slots, T]`` (class
        docstring); the sampled token of every batch slot."""
        eng = self.engine
        S = eng.num_slots
        T = 1 if all(len(s.tokens) == 1 for s in plan) else eng.prefill_chunk
        tokens, mask = np.zeros((S, T), np.int32), np.zeros((S, T), bool)
        lengths, counters = np.zeros(S, np.int32), np.zeros(S, np.int32)
        for b, run in enumerate(loop.slots):  # a running request not in the step: unwritten
            if run is not None:
                lengths[b] = run.length
        for s in plan:
            run = loop.slots[s.slot]
            eng._grow(run, s.start + T)  # the padding takes slots too (overwritten later)
            tokens[s.slot, :len(s.tokens)], mask[s.slot, :len(s.tokens)] = s.tokens, True
            counters[s.slot] = len(run.tokens)
        return eng._run_step(tokens, eng._table(loop.slots), lengths, mask,
                             [None if r is None else r.request for r in loop.slots], counters)

    def _run_packed(self, loop: Any, plan: list[Scheduled], n: int) -> np.ndarray:
        """The step ``plan`` as one packed ragged step of ``token_bucket(n)`` tokens; the
        sampled token of every row (the batch slots, then the padding row)."""
        eng = self.engine
        R, Tb = self.rows, token_bucket(n, self.budget)
        tokens, positions = np.zeros(Tb, np.int32), np.zeros(Tb, np.int32)
        counts, lengths = np.zeros(R, np.int64), np.zeros(R, np.int32)
        last, counters = np.zeros(R, np.int32), np.zeros(R, np.int32)
        for s in plan:
            counts[s.slot], lengths[s.slot] = len(s.tokens), s.start
        counts[R - 1] = Tb - n  # the padding row
        cu = np.concatenate(([0], np.cumsum(counts))).astype(np.int32)
        for s in plan:
            run = loop.slots[s.slot]
            eng._grow(run, s.start + len(s.tokens))
            at = slice(cu[s.slot], cu[s.slot + 1])
            tokens[at] = s.tokens
            positions[at] = s.start + np.arange(len(s.tokens))
            last[s.slot], counters[s.slot] = cu[s.slot + 1] - 1, len(run.tokens)
        mask = np.arange(Tb) < 0
        mask[:cu[R - 1]] = True
        table = np.concatenate([eng._table(loop.slots),
                                np.full((1, eng.pages_per_seq), -1, np.int32)])
        reqs = [None if s is None else s.request for s in loop.slots] + [None]
        out, eng.pool = self._step(
            eng.params, eng.pool, jnp.asarray(tokens), jnp.asarray(positions),
            jnp.asarray(table), jnp.asarray(lengths), jnp.asarray(cu), jnp.asarray(mask),
            jnp.asarray(last), *sampling_arrays(reqs, eng.model.vocab_size),
            jnp.asarray(counters))
        return np.asarray(out)


def padded_reason(model: Any) -> str | None:
    """Why a budgeted loop runs ``model`` in padded steps (:class:`RaggedLoop`), or None
    when it runs packed ragged steps: a model without ``forward_ragged``, or the model's
    ``ragged_refusal``."""
    if not callable(getattr(model, "forward_ragged", None)):
        return f"{type(model).__name__} has no forward_ragged"
    return getattr(model, "ragged_refusal", None) or None
