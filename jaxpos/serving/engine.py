"""Continuous batching over a paged KV cache (Yu et al. 2022, "Orca: A Distributed Serving
System for Transformer-Based Generative Models", §3: iteration-level scheduling; Kwon et
al. 2023, vLLM, §4.2: paged memory).

:class:`ServingEngine` keeps a fixed number of batch slots. Every iteration it admits
waiting requests into free slots while the page pool can book their worst case (prompt
plus token budget), prefills each admitted prompt in fixed-size chunks, then runs one
jitted decode step over every slot (idle slots masked), samples each running request's
next token with its own settings, and ends requests on EOS, a stop token or stop string,
or their token budget, returning their pages. Pages are handed out as a request grows, so
the pages in use follow the tokens held. ``schedule="static"`` is the baseline it
replaces: a batch of requests is admitted only when every slot is idle, and it runs until
its longest request ends.

:meth:`ServingEngine.stream` yields each token as it is produced
(:class:`jaxpos.serving.stream.StreamEvent`), :meth:`ServingEngine.cancel` ends a request
between events, and :meth:`ServingEngine.run` collects the stream.
"""

from __future__ import annotations

import dataclasses
import math
import time
import weakref
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpos import _checks
from jaxpos.serving.model import PagedModel
from jaxpos.serving.pages import PageAllocator, pages_for
from jaxpos.serving.prefix import PrefixCache, sharing_key
from jaxpos.serving.sampling import sample_tokens, sampling_arrays
from jaxpos.serving.scheduler import RaggedLoop
from jaxpos.serving.stream import (
    StopCondition,
    StreamEvent,
    TokenStream,
    check_ids,
    check_request,
    detokenized,
)

__all__ = ["Completion", "Request", "ServingEngine", "ServingStats"]


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request.

    Attributes:
      prompt: token ids (at least one), each in ``[0, vocab_size)`` of the model.
      max_new_tokens: the token budget (>= 1).
      temperature: 0 = greedy; else logits are divided by it before sampling.
      top_k: keep the ``top_k`` most likely tokens (0 = all).
      top_p: nucleus sampling, keep the smallest set reaching ``top_p`` (1 = all).
      eos_id: the request ends when it samples this token (kept in the output).
      seed: the request's random stream (the same tokens whatever batch it runs in), an
        int in ``[0, 2**32)``.
      arrival: seconds after the start of :meth:`ServingEngine.run` (or
        :meth:`~ServingEngine.stream`) when it arrives.
      id: anything hashable identifying it, unique among the requests of one call
        (default: its index in the list).
      stop_token_ids: the request also ends when it samples one of these token ids (kept
        in the output, as ``eos_id``; vLLM's ``stop_token_ids``).
      stop_strings: a str or a sequence of str: the request ends at the token whose
        detokenized output text (the engine's ``detokenize`` of its generated tokens)
        first contains one of them; the token output ends with that token and
        the ``text`` of its :class:`Completion` is cut before the stop string (vLLM's ``stop``).
    """

    prompt: Sequence[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    eos_id: int | None = None
    seed: int = 0
    arrival: float = 0.0
    id: Any = None
    stop_token_ids: Sequence[int] | None = ()
    stop_strings: str | Sequence[str] | None = ()


@dataclasses.dataclass
class Completion:
    """A finished request: its generated ``tokens``, ``finish_reason`` and times in
    seconds since the start (``arrival``, ``first_token``, ``finish``; ``first_token`` is
    NaN for a request cancelled before its first token).

    ``finish_reason`` is ``"eos"`` (it sampled its ``eos_id``), ``"stop"`` (one of its
    ``stop_token_ids``), ``"stop_string"``, ``"length"`` or ``"cancelled"``; a stream
    event says ``"stop"`` for both of the first two (as vLLM does) and tells them apart by
    its ``stop_reason``. ``stop_reason``: the stop token id or stop string matched, else
    None. ``text``: the engine's ``detokenize`` of ``tokens``, cut before the stop string
    for ``"stop_string"``; None when the engine has no ``detokenize``."""

    request: Request
    tokens: list[int]
    finish_reason: str
    arrival: float
    first_token: float
    finish: float
    stop_reason: int | str | None = None
    text: str | None = None

    @property
    def time_to_first_token(self) -> float:
        return self.first_token - self.arrival


@dataclasses.dataclass
class ServingStats:
    """What a :meth:`ServingEngine.run` measured.

    Attributes:
      generated: tokens generated; wall: seconds; decode_steps: jitted decode steps.
      peak_pages: most pages in use at once; page_size; num_slots; max_len.
      page_ratio: mean over decode steps of ``pages in use * page_size / tokens held``.
      dense_ratio: mean over the same steps of ``num_slots * max_len / tokens held`` (a
        dense ``[B, max_len]`` cache).
      prefill_tokens: prompt tokens prefilled; cached_tokens: prompt tokens read from
        shared pages instead (``prefix_caching``).
    """

    generated: int = 0
    wall: float = 0.0
    decode_steps: int = 0
    peak_pages: int = 0
    page_size: int = 0
    num_slots: int = 0
    max_len: int = 0
    page_ratio: float = float("nan")
    dense_ratio: float = float("nan")
    prefill_tokens: int = 0
    cached_tokens: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.generated / self.wall if self.wall > 0 else float("nan")


@dataclasses.dataclass
class _Running:
    request: Request
    pages: list[int]
    booked: int
    length: int  # slots written
    tokens: list[int]
    arrival: float
    first_token: float = float("nan")
    stop: StopCondition | None = None


class _Loop:
    """The state of one :meth:`ServingEngine.stream`."""

    def __init__(self, waiting: deque, slots: list, stats: ServingStats):
        self.waiting, self.slots, self.stats = waiting, slots, stats
        self.ids = {r.id for r in waiting}
        self.done: list[Completion] = []
        self.pending: deque[StreamEvent] = deque()  # the ends of cancelled requests
        self.closed = False
        self.page_ratios: list[float] = []
        self.dense_ratios: list[float] = []
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0


class ServingEngine:
    """Continuous batching of :class:`Request` s over a paged KV cache.

    Args:
      model: a :class:`jaxpos.serving.PagedModel` (e.g. :class:`PagedDecoder`).
      num_slots: batch slots of the decode step.
      num_pages, page_size: the page pool.
      max_len: most slots one request may hold (prompt + budget); sets the page table's
        width ``ceil(max_len / page_size)``.
      prefill_chunk: tokens per prefill call (a prompt runs in ``ceil(len / chunk)``
        calls of one compiled shape); default 16 (the chunked decode path's query count).
      schedule: ``"continuous"`` (default) or ``"static"`` (see the module docstring).
      detokenize: ``fn(token_ids: list[int]) -> str``, the text of a request's generated
        tokens; needed by requests with ``stop_strings``, and fills the ``text`` of each
        :class:`Completion`. Called once per produced token of such a request, on all its
        tokens so far.
      prefix_caching: requests share the full pages of their prompts' common prefixes
        (:mod:`jaxpos.serving.prefix`, vLLM's automatic prefix caching), with the tokens
        of an engine without it; :attr:`prefix_cache` is then the
        :class:`~jaxpos.serving.prefix.PrefixCache` (else None).
      max_num_batched_tokens: None (prefill in ``prefill_chunk`` calls, then a decode step),
        or the token budget of one step per iteration: decode tokens and prompt chunks
        together (:mod:`jaxpos.serving.scheduler`; vLLM's option). The step is the packed
        ragged step where the model has one, else one padded ``[num_slots, T]`` step with
        at most ``prefill_chunk`` prompt tokens per request
        (:class:`~jaxpos.serving.scheduler.RaggedLoop`: FoX, PaTH, quantised pages).

    Raises:
      ValueError: ``prefix_caching`` for a model whose pages cannot be shared (PaTH, FoX,
        StreamingLLM: :func:`~jaxpos.serving.prefix.check_shareable`) or that has no
        ``page_sharing_key``.
      ValueError / TypeError: sizes that are not positive ints, an unknown schedule, a
        ``detokenize`` that is not callable, a token budget below ``num_slots``.
    """

    def __init__(self, model: PagedModel, *, num_slots: int, num_pages: int, page_size: int,
                 max_len: int, prefill_chunk: int = 16, schedule: str = "continuous",
                 prefix_caching: bool = False,
                 detokenize: Callable[[list[int]], str] | None = None,
                 max_num_batched_tokens: int | None = None):
        for name, val in (("num_slots", num_slots), ("page_size", page_size),
                          ("max_len", max_len), ("prefill_chunk", prefill_chunk)):
            _checks.check_positive_int(name, val)
        _checks.check_choice("schedule", schedule, ("continuous", "static"))
        if detokenize is not None and not callable(detokenize):
            raise TypeError(f"detokenize must be None or a callable (list of token ids -> "
                            f"str); got {type(detokenize).__name__} {detokenize!r:.80}.")
        self.detokenize = detokenize
        self._loop: _Loop | None = None  # the latest stream's state (for cancel)
        self._stream: weakref.ref[TokenStream] | None = None
        self.model, self.params = model, model.params
        self.num_slots, self.page_size, self.max_len = num_slots, page_size, max_len
        self.prefill_chunk, self.schedule = prefill_chunk, schedule
        #: the :class:`~jaxpos.serving.scheduler.RaggedLoop` running the token budget
        #: (``.packed``, ``.padded_because``), or None without ``max_num_batched_tokens``
        self.scheduler = None if max_num_batched_tokens is None else \
            RaggedLoop(self, max_num_batched_tokens)
        # wide enough for a prompt padded to whole prefill chunks, or for a padded budgeted
        # step's padding after a request's last token
        self.pages_per_seq = pages_for(self._slots_needed(max_len, max_len), page_size)
        self.allocator = PageAllocator(num_pages)
        self.prefix_cache = None if not prefix_caching else PrefixCache(  # whole chunks shared
            self.allocator, page_size, sharing_key(model),  # (a budget's chunks: any pages)
            math.lcm(page_size, prefill_chunk if max_num_batched_tokens is None else 1))
        #: what hands out pages: the allocator, or the prefix cache in front of it
        self._pages = self.allocator if self.prefix_cache is None else self.prefix_cache
        self.pool = model.init_pool(num_pages, page_size)
        self._step = jax.jit(self._forward_and_sample, donate_argnums=(1,))

    # ------------------------------------------------------------------ device step
    def _forward_and_sample(self, params, pool, tokens, table, lengths, mask, temperature,
                            top_k, top_p, seeds, counters):
        B, T = tokens.shape
        # every position below max_len: the padding after a row's written tokens (which
        # lie below max_len - 1) stops at max_len - 1, where a position past the model's
        # (a learned table of max_len rows gives NaN rows) would reach the row's tokens
        # through the padding keys (their weight 0 in p @ v: 0 * NaN, docs/attention.md).
        # The cap does not depend on the row's length, so a chunk's largest position (a
        # dynamic-NTK rotation at write) stays that of its place (prefix caching)
        positions = jnp.minimum(lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :],
                                self.max_len - 1)
        last = jnp.maximum(jnp.sum(mask, axis=1, dtype=jnp.int32) - 1, 0)
        logits, pool = self.model.forward(params, tokens, positions, pool, table, lengths,
                                          mask)
        final = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
        return sample_tokens(final, temperature, top_k, top_p, seeds, counters), pool

    def _run_step(self, tokens, table, lengths, mask, reqs: list[Request | None],
                  counters) -> np.ndarray:
        out, self.pool = self._step(
            self.params, self.pool, jnp.asarray(tokens, jnp.int32), jnp.asarray(table),
            jnp.asarray(lengths, jnp.int32), jnp.asarray(mask),
            *sampling_arrays(reqs, self.model.vocab_size),
            jnp.asarray(np.asarray(counters, np.int32)))
        return np.asarray(out)

    # ------------------------------------------------------------------- host side
    def _check(self, r: Request):
        """Refuse a request that can never run or would run on garbage
        (:func:`jaxpos.serving.stream.check_request`)."""
        check_request(r, vocab_size=self.model.vocab_size, max_len=self.max_len,
                      pages_needed=self._pages_needed, num_pages=self.allocator.num_pages,
                      detokenize=self.detokenize)

    def _slots_needed(self, prompt: int, total: int) -> int:
        """Slots a request of a ``prompt``-token prompt and ``total`` tokens in all may write:
        its tokens, or its prompt padded to whole prefill chunks (a model may write the
        padding), whichever is more; with padded budgeted steps
        (:class:`~jaxpos.serving.scheduler.RaggedLoop`), a step's padding after its last
        written token too (the ``C - 1`` slots after slot ``total - 2``: the last sampled
        token is never written)."""
        C = self.prefill_chunk
        if self.scheduler is not None and not self.scheduler.packed:
            return max(total, total - 2 + C)
        return max(total, -(-prompt // C) * C)

    def _pages_needed(self, r: Request) -> int:
        """Pages a request may hold (:meth:`_slots_needed`)."""
        slots = self._slots_needed(len(r.prompt), len(r.prompt) + r.max_new_tokens)
        return pages_for(slots, self.page_size)

    def _grow(self, run: _Running, slots: int) -> None:
        """Hand ``run`` the pages for ``slots`` filled slots (its run of pages extended in
        place where the pool allows: consecutive pages read faster)."""
        more = pages_for(slots, self.page_size) - len(run.pages)
        if more > 0:
            run.pages.extend(self._pages.allocate(
                more, after=run.pages[-1] if run.pages else None,
                expect=max(more, run.booked - len(run.pages))))

    def _book(self, r: Request) -> _Running | None:
        """Book ``r``'s pages; its run holds the cached pages its prompt starts with
        (``prefix_caching``) and is filled up to them. None when the pool cannot book it."""
        need = self._pages_needed(r)
        shared = (self.prefix_cache.book(r.prompt, need) if self.prefix_cache is not None
                  else [] if self.allocator.reserve(need) else None)
        return None if shared is None else _Running(
            r, shared, need, len(shared) * self.page_size, [], max(r.arrival, 0.0),
            stop=StopCondition.of(r))

    def _prefilled(self, loop: _Loop, run: _Running, cached: int) -> None:
        """``run``'s prompt is written, its first ``cached`` tokens read from shared
        pages: its full pages join the prefix cache."""
        if self.prefix_cache is not None:
            self.prefix_cache.register(run.request.prompt, run.pages)
        loop.stats.cached_tokens += cached
        loop.stats.prefill_tokens += len(run.request.prompt) - cached

    def _table(self, running: list[_Running | None]) -> np.ndarray:
        t = np.full((len(running), self.pages_per_seq), -1, np.int32)
        for b, r in enumerate(running):
            if r is not None:
                t[b, :len(r.pages)] = r.pages
        return t

    def _prefill(self, run: _Running, now: Callable[[], float]) -> None:
        prompt, C = list(run.request.prompt), self.prefill_chunk
        tok = 0
        for start in range(run.length, len(prompt), C):  # after its shared pages
            chunk = prompt[start:start + C]
            self._grow(run, run.length + C)  # the padding too: a model may write it
            tokens = np.zeros((1, C), np.int32)
            tokens[0, :len(chunk)] = chunk
            mask = np.arange(C)[None, :] < len(chunk)
            tok = self._run_step(tokens, self._table([run]), [run.length], mask,
                                 [run.request], [0])[0]
            run.length += len(chunk)
        run.tokens.append(int(tok))
        run.first_token = now()

    def _end(self, loop: _Loop, b: int, reason: str, stop_reason: Any = None,
             text: str | None = None) -> None:
        """Record slot ``b``'s request as finished and return its pages."""
        run = loop.slots[b]
        assert run is not None
        if reason == "stop" and stop_reason is None:
            reason = "eos"  # Completion keeps "eos" for eos_id (events say "stop")
        if text is None and self.detokenize is not None:
            text = detokenized(self.detokenize, run.tokens)
        loop.done.append(Completion(run.request, run.tokens, reason, run.arrival,
                                    run.first_token, loop.now(), stop_reason, text))
        self._pages.free(run.pages, run.booked)
        loop.slots[b] = None

    def _emit(self, loop: _Loop, b: int) -> Iterator[StreamEvent]:
        """The event of slot ``b``'s newest token; ends its request first if it is done
        (its pages are back in the pool when the consumer sees its last event)."""
        run = loop.slots[b]
        assert run is not None
        loop.stats.generated += 1
        assert run.stop is not None
        ended = run.stop.check(run.tokens, self.detokenize)
        if ended is not None:
            self._end(loop, b, *ended)
        reason, stop_reason = (ended[0], ended[1]) if ended is not None else (None, None)
        yield StreamEvent(run.request.id, run.tokens[-1], len(run.tokens) - 1, reason,
                          stop_reason)

    def _admit(self, loop: _Loop) -> Iterator[StreamEvent]:
        """Admit waiting requests into free slots while the pool can book them (all slots
        must be idle for ``schedule="static"``), prefill each and sample its first token."""
        if self.schedule == "static" and any(s is not None for s in loop.slots):
            return
        while loop.waiting and None in loop.slots and loop.waiting[0].arrival <= loop.now():
            run = self._book(loop.waiting[0])
            if run is None:
                return
            loop.waiting.popleft()
            b = loop.slots.index(None)
            loop.slots[b] = run
            cached = run.length
            self._prefill(run, loop.now)
            self._prefilled(loop, run, cached)
            yield from self._emit(loop, b)

    def _decode(self, loop: _Loop, active: list[int]) -> Iterator[StreamEvent]:
        """One jitted decode step over every slot (idle ones masked)."""
        S = self.num_slots
        tokens, mask = np.zeros((S, 1), np.int32), np.zeros((S, 1), bool)
        lengths, counters = np.zeros((S,), np.int32), np.zeros((S,), np.int32)
        runs = {b: loop.slots[b] for b in active}
        for b, run in runs.items():
            assert run is not None
            self._grow(run, run.length + 1)
            tokens[b, 0], lengths[b], mask[b, 0] = run.tokens[-1], run.length, True
            counters[b] = len(run.tokens)
        held = sum(run.length + 1 for run in runs.values() if run is not None)
        loop.page_ratios.append(self._pages.in_use * self.page_size / held)
        loop.dense_ratios.append(self.num_slots * self.max_len / held)
        out = self._run_step(tokens, self._table(loop.slots), lengths, mask,
                             [None if s is None else s.request for s in loop.slots], counters)
        loop.stats.decode_steps += 1
        for b, run in runs.items():
            if loop.slots[b] is not run:  # cancelled while an earlier token was consumed
                continue
            assert run is not None
            run.length += 1
            run.tokens.append(int(out[b]))
            yield from self._emit(loop, b)

    def _events(self, loop: _Loop) -> Generator[StreamEvent, None, None]:
        """The loop itself; whatever ends it (exhaustion, close, an error) returns every
        page it holds."""
        try:
            while loop.waiting or any(s is not None for s in loop.slots):
                if self.scheduler is not None:
                    yield from self.scheduler.iteration(loop)
                    continue
                yield from self._admit(loop)
                active = [b for b, s in enumerate(loop.slots) if s is not None]
                if active:
                    yield from self._decode(loop, active)
                elif loop.waiting:  # the next request has not arrived yet
                    time.sleep(max(0.0, min(loop.waiting[0].arrival - loop.now(), 0.01)))
            stats = loop.stats
            stats.wall = loop.now()
            stats.peak_pages = self._pages.peak_in_use
            if loop.page_ratios:
                stats.page_ratio = float(np.mean(loop.page_ratios))
                stats.dense_ratio = float(np.mean(loop.dense_ratios))
        finally:
            loop.closed = True
            loop.waiting.clear()
            for b, run in enumerate(loop.slots):
                if run is not None:
                    self._pages.free(run.pages, run.booked)
                    loop.slots[b] = None

    def _streaming(self) -> bool:
        """A stream of this engine is open (not exhausted, closed or dropped)."""
        stream = self._stream() if self._stream is not None else None
        return stream is not None and self._loop is not None and not self._loop.closed

    def stream(self, requests: Iterable[Request]) -> TokenStream:
        """Serve ``requests`` (in arrival order), yielding each token as it is produced.

        Every request is checked (as :meth:`run` documents) when this is called, before any
        device work; the loop runs as the stream is iterated. Requests may be cancelled
        between events (:meth:`cancel`); closing the stream ends the rest.

        Args:
          requests: :class:`Request` s; ``id`` s must be hashable and unique (a request
            without one gets its index in the list).

        Returns:
          a :class:`~jaxpos.serving.stream.TokenStream` of
          :class:`~jaxpos.serving.stream.StreamEvent` s (``.id``, ``.token``, ``.index``;
          ``.finish_reason`` on each request's last event), also holding the
          ``completions`` so far and the ``stats``.

        Raises:
          ValueError / TypeError: a bad request (see :meth:`run`), an ``id`` that is not
            hashable or is given to two requests.
          RuntimeError: another stream (or run) of this engine is still open: they share
            the page pool and the batch slots.
        """
        if self._streaming():
            raise RuntimeError("a stream of this ServingEngine is still open (not "
                               "exhausted or closed); close it before starting another: "
                               "they would share its pages and batch slots.")
        reqs = [r if r.id is not None else dataclasses.replace(r, id=i)
                for i, r in enumerate(requests)]
        check_ids(reqs)
        for r in reqs:
            self._check(r)
        loop = _Loop(deque(sorted(reqs, key=lambda r: r.arrival)), [None] * self.num_slots,
                     ServingStats(page_size=self.page_size, num_slots=self.num_slots,
                                  max_len=self.max_len))
        stream = TokenStream(self._events(loop), loop)
        self._loop, self._stream = loop, weakref.ref(stream)
        return stream

    def cancel(self, id: Any) -> bool:
        """End request ``id`` of the open stream now, between two of its events: its pages
        go back to the pool at once, and the stream's next event is its last, with
        ``token=None`` and ``finish_reason="cancelled"`` (a token computed for it and not
        yet yielded is dropped). Its :class:`Completion` holds the tokens yielded so far.

        Returns:
          True if the request was waiting or running; False if it had already ended (or
          the stream did).

        Raises:
          ValueError: ``id`` is not a request of the latest stream.
        """
        loop = self._loop
        try:
            known = loop is not None and id in loop.ids
        except TypeError:  # unhashable: no request has it
            known = False
        if not known:
            raise ValueError(f"cancel: id {id!r:.80} is not a request of this engine's latest "
                             f"stream (or run).")
        assert loop is not None
        if not self._streaming():
            return False
        for r in loop.waiting:
            if r.id == id:
                loop.waiting.remove(r)
                loop.done.append(Completion(r, [], "cancelled", max(r.arrival, 0.0),
                                            float("nan"), loop.now(),
                                            text="" if self.detokenize else None))
                loop.pending.append(StreamEvent(id, None, 0, "cancelled"))
                return True
        for b, run in enumerate(loop.slots):
            if run is not None and run.request.id == id:
                n = len(run.tokens)
                self._end(loop, b, "cancelled")
                loop.pending.append(StreamEvent(id, None, n, "cancelled"))
                return True
        return False

    def run(self, requests: Iterable[Request], *,
            progress: Callable[[int], Any] | None = None) -> tuple[list[Completion],
                                                                  ServingStats]:
        """Serve ``requests`` (in arrival order) to completion: :meth:`stream`, collected.

        Args:
          requests: :class:`Request` s.
          progress: called with the number of tokens generated since its last call (1,
            once per token).

        Returns:
          ``(completions in finishing order, stats)``.

        Raises:
          ValueError: before any device work, for a request that can never run or would
            run on garbage, naming it (its ``id``) and the field: an empty prompt, a
            prompt token id outside ``[0, model.vocab_size)`` (the embedding lookup would
            give NaN logits, or wrap a negative id, instead of failing), longer than
            ``max_len``, more pages than the pool, bad sampling settings (``temperature``
            not finite or < 0, ``top_k < 0``, ``top_p`` outside ``(0, 1]``), ``seed``
            outside ``[0, 2**32)``, ``eos_id`` or a ``stop_token_ids`` entry outside the
            vocabulary, an empty stop string, ``stop_strings`` on an engine without
            ``detokenize``, an ``arrival`` that is not finite, an ``id`` given twice.
          TypeError: a prompt that is not a 1-D sequence of ints, or a non-int
            ``max_new_tokens``, ``top_k``, ``seed`` or ``eos_id``, ``stop_token_ids`` not
            a sequence of ints, ``stop_strings`` not a str or sequence of str, an
            unhashable ``id``.
          RuntimeError: a stream of this engine is still open.
        """
        with self.stream(requests) as stream:
            for event in stream:
                if progress is not None and event.token is not None:
                    progress(1)
        return stream.completions, stream.stats
