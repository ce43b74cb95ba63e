"""Streamed output of the serving loop: the event per produced token, the iterator
:meth:`jaxpos.serving.ServingEngine.stream` returns, and the stop conditions (stop tokens,
stop strings) a request may carry.

The meanings follow vLLM's sampling parameters and streaming outputs (Kwon et al. 2023,
vLLM, ``SamplingParams.stop_token_ids`` / ``stop``, ``CompletionOutput.finish_reason`` /
``stop_reason``): a stop token is kept in the output, like ``eos_id``; a stop string is
matched on the detokenized output text, which is cut before it, while the token output
ends with the token that completed it.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Generator, Sequence
from typing import Any

import numpy as np

from jaxpos import _checks

__all__ = ["FINISH_REASONS", "StopCondition", "StreamEvent", "TokenStream", "check_ids",
           "check_request", "check_stop_fields", "detokenized", "find_stop"]

#: The values of :attr:`StreamEvent.finish_reason` on a request's last event.
FINISH_REASONS = ("stop", "length", "stop_string", "cancelled")


@dataclasses.dataclass(frozen=True)
class StreamEvent:
    """One produced token of one request (or the end of a cancelled one).

    Attributes:
      id: the request's ``id``.
      token: the token id (an int); ``None`` only on the event that ends a cancelled
        request (cancelling produces no token).
      index: the token's position in the request's output (0 for its first token); on a
        ``"cancelled"`` event, the number of tokens the request produced.
      finish_reason: ``None`` while the request runs; on its last event ``"stop"`` (it
        sampled its ``eos_id`` or one of its ``stop_token_ids``: the token is kept),
        ``"stop_string"`` (this token completed one of its ``stop_strings``),
        ``"length"`` (its ``max_new_tokens``-th token) or ``"cancelled"``
        (:meth:`jaxpos.serving.ServingEngine.cancel`).
      stop_reason: on a ``"stop"`` event, the stop token id, or ``None`` for ``eos_id``;
        on a ``"stop_string"`` event, the stop string matched; else ``None`` (vLLM's
        ``stop_reason``).
    """

    id: Any
    token: int | None
    index: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class TokenStream:
    """The iterator :meth:`jaxpos.serving.ServingEngine.stream` returns: the
    :class:`StreamEvent` s of its requests in the order their tokens are produced.

    Requests may be cancelled between events
    (:meth:`jaxpos.serving.ServingEngine.cancel`); closing the stream
    (:meth:`TokenStream.close`, leaving a ``with`` block, or dropping it unfinished) ends
    every request still waiting or running and returns their pages to the pool.

    Attributes:
      completions: the :class:`jaxpos.serving.Completion` of every request ended so far,
        in finishing order.
      stats: the :class:`jaxpos.serving.ServingStats` of the stream (``wall``,
        ``peak_pages`` and the page ratios are set when it is exhausted; ``wall``
        includes the time the consumer spends between events).
    """

    def __init__(self, events: Generator[StreamEvent, None, None], loop: Any):
        self._events, self._loop = events, loop

    @property
    def completions(self) -> list:
        return self._loop.done

    @property
    def stats(self) -> Any:
        return self._loop.stats

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> StreamEvent:
        pending: deque = self._loop.pending  # the ends of requests cancelled meanwhile
        if pending:
            return pending.popleft()
        return next(self._events)

    def close(self) -> None:
        """End the stream: requests still waiting or running are dropped and their pages
        returned to the pool (no more events)."""
        self._events.close()  # runs the loop's cleanup if it started
        self._loop.closed = True
        self._loop.waiting.clear()
        self._loop.pending.clear()

    def __enter__(self) -> TokenStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_int(x: Any) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, np.integer))


def check_stop_fields(who: str, stop_token_ids: Any, stop_strings: Any, vocab_size: int,
                      detokenize: Callable | None) -> None:
    """Validate a request's stop conditions.

    Args:
      who: how errors name the request (``"request 'r'"``).
      stop_token_ids: a sequence of int token ids, each in ``[0, vocab_size)``, or None.
      stop_strings: a str or a sequence of non-empty str (needs ``detokenize``), or None.

    Raises:
      TypeError: ``stop_token_ids`` not a sequence of ints, ``stop_strings`` not a str or
        a sequence of str.
      ValueError: a stop token id outside the vocabulary (it could never be sampled), an
        empty stop string, stop strings with no ``detokenize`` callable on the engine.
    """
    stop_token_ids = () if stop_token_ids is None else stop_token_ids
    if (isinstance(stop_token_ids, (str, bytes)) or not isinstance(
            stop_token_ids, (Sequence, np.ndarray))
            or not all(_is_int(t) for t in stop_token_ids)):
        raise TypeError(f"{who}: stop_token_ids must be a sequence of int token ids; got "
                        f"{type(stop_token_ids).__name__} {stop_token_ids!r:.80}.")
    bad = [int(t) for t in stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{who}: stop_token_ids must lie in [0, vocab_size={vocab_size}) "
                         f"(they could never be sampled); got {bad[0]}.")
    strings = ([stop_strings] if isinstance(stop_strings, str)
               else () if stop_strings is None else stop_strings)
    if not isinstance(strings, Sequence) or not all(isinstance(s, str) for s in strings):
        raise TypeError(f"{who}: stop_strings must be a str or a sequence of str; got "
                        f"{type(stop_strings).__name__} {stop_strings!r:.80}.")
    if any(s == "" for s in strings):
        raise ValueError(f"{who}: stop_strings must not hold an empty string (it would "
                         f"match before any token); got {list(strings)!r:.80}.")
    if strings and detokenize is None:
        raise ValueError(f"{who}: stop_strings {list(strings)!r:.80} are matched on the "
                         f"output text; pass ServingEngine(..., detokenize=fn) (fn: a list "
                         f"of token ids -> str).")


def check_ids(requests: Sequence[Any]) -> None:
    """Refuse request ids that are not hashable or not unique: events and
    :meth:`jaxpos.serving.ServingEngine.cancel` name a request by its id.

    Raises:
      TypeError: an unhashable id. ValueError: an id given to two requests.
    """
    seen: set = set()
    for r in requests:
        try:
            dup = r.id in seen
        except TypeError:
            raise TypeError(f"request id must be hashable (cancel finds a request by it); "
                            f"got {type(r.id).__name__} {r.id!r:.80}.") from None
        if dup:
            raise ValueError(f"request id {r.id!r} is given to two requests; ids must be "
                             f"unique (events and cancel name a request by it).")
        seen.add(r.id)


def detokenized(detokenize: Callable[[list[int]], str], tokens: Sequence[int]) -> str:
    """``detokenize(tokens)``, checked to be a str.

    Raises:
      TypeError: ``detokenize`` returned something else.
    """
    text = detokenize(list(tokens))
    if not isinstance(text, str):
        raise TypeError(f"detokenize must return a str; got {type(text).__name__} "
                        f"{text!r:.80} for tokens {list(tokens)!r:.80}.")
    return text


@dataclasses.dataclass(frozen=True)
class StopCondition:
    """What ends one request: its ``eos_id``, ``stop_token_ids``, ``stop_strings`` and
    ``max_new_tokens`` (of a checked :class:`jaxpos.serving.Request`)."""

    max_new_tokens: int
    eos_id: int | None = None
    stop_ids: frozenset = frozenset()
    stop_strings: tuple[str, ...] = ()

    @classmethod
    def of(cls, request: Any) -> StopCondition:
        ids, strings = request.stop_token_ids, request.stop_strings
        return cls(int(request.max_new_tokens),
                   None if request.eos_id is None else int(request.eos_id),
                   frozenset() if ids is None else frozenset(int(t) for t in ids),
                   (strings,) if isinstance(strings, str)
                   else () if strings is None else tuple(strings))

    def check(self, tokens: Sequence[int], detokenize: Callable | None,
              ) -> tuple[str, int | str | None, str | None] | None:
        """``(finish_reason, stop_reason, text cut before the stop string)`` if the last
        of ``tokens`` ends the request, else None. Checked in vLLM's order: EOS and stop
        tokens, stop strings, the token budget."""
        tok = tokens[-1]
        if tok == self.eos_id:
            return "stop", None, None
        if tok in self.stop_ids:
            return "stop", tok, None
        if self.stop_strings:
            assert detokenize is not None  # (checked with the request)
            text = detokenized(detokenize, tokens)
            hit = find_stop(text, self.stop_strings)
            if hit is not None:
                return "stop_string", hit[1], text[:hit[0]]
        if len(tokens) >= self.max_new_tokens:
            return "length", None, None
        return None


def find_stop(text: str, stop_strings: Sequence[str]) -> tuple[int, str] | None:
    """``(where, stop string)`` of the earliest stop string in ``text`` (on a tie the
    longest), or None."""
    best = None
    for s in stop_strings:
        at = text.find(s)
        if at >= 0 and (best is None or (at, -len(s)) < (best[0], -len(best[1]))):
            best = (at, s)
    return best


def check_request(r: Any, *, vocab_size: int, max_len: int, pages_needed: Callable[[Any], int],
                  num_pages: int, detokenize: Callable | None) -> None:
    """Refuse a :class:`jaxpos.serving.Request` that can never run or would run on garbage
    (:meth:`jaxpos.serving.ServingEngine.run` lists the errors): every error names the
    request (its id) and the field. ``pages_needed(r)``: the pages the engine books for it.

    Raises:
      ValueError / TypeError: the field and what it got.
    """
    who = f"request {r.id!r}"
    try:
        prompt = None if isinstance(r.prompt, (str, bytes)) else np.asarray(r.prompt)
    except ValueError:  # a ragged nesting
        prompt = None
    if prompt is not None and prompt.ndim == 1 and prompt.size == 0:
        raise ValueError(f"{who}: prompt must hold at least one token.")
    if (prompt is None or prompt.ndim != 1 or prompt.dtype == bool
            or not np.issubdtype(prompt.dtype, np.integer)):
        raise TypeError(f"{who}: prompt must be a sequence of int token ids; got "
                        f"{type(r.prompt).__name__} {r.prompt!r:.80}.")
    V = vocab_size
    bad = np.flatnonzero((prompt < 0) | (prompt >= V))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{who}: prompt token ids must lie in [0, vocab_size={V}); got "
                         f"{int(prompt[i])} at index {i} ({bad.size} id(s) out of "
                         f"range).")
    for name in ("max_new_tokens", "top_k", "seed"):
        val = getattr(r, name)
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)):
            raise TypeError(f"{who}: {name} must be an int; got {type(val).__name__} "
                            f"{val!r}.")
    if r.max_new_tokens < 1:
        raise ValueError(f"{who}: max_new_tokens must be >= 1; got {r.max_new_tokens}.")
    if len(prompt) + r.max_new_tokens > max_len:
        raise ValueError(f"{who}: prompt ({len(prompt)}) + max_new_tokens "
                         f"({r.max_new_tokens}) exceeds max_len={max_len}.")
    need = pages_needed(r)
    if need > num_pages:
        raise ValueError(f"{who} needs {need} pages; the pool holds "
                         f"num_pages={num_pages}.")
    temperature = _checks.check_real(f"{who}: temperature", r.temperature)
    top_p = _checks.check_real(f"{who}: top_p", r.top_p)
    f32_max = float(np.finfo(np.float32).max)  # sampled in float32
    if not (0 <= temperature <= f32_max and 0 < top_p <= 1 and r.top_k >= 0):
        raise ValueError(f"{who}: need a finite temperature >= 0 (at most {f32_max:.4g}: "
                         f"sampled in float32), top_k >= 0 and top_p "
                         f"in (0, 1]; got {r.temperature}, {r.top_k}, {r.top_p}.")
    if not 0 <= r.seed < 2 ** 32:
        raise ValueError(f"{who}: seed must lie in [0, 2**32); got {r.seed}.")
    if r.eos_id is not None:
        if isinstance(r.eos_id, bool) or not isinstance(r.eos_id, (int, np.integer)):
            raise TypeError(f"{who}: eos_id must be None or an int; got "
                            f"{type(r.eos_id).__name__} {r.eos_id!r}.")
        if not 0 <= r.eos_id < V:
            raise ValueError(f"{who}: eos_id must lie in [0, vocab_size={V}) (it could "
                             f"never be sampled); got {r.eos_id}.")
    arrival = _checks.check_real(f"{who}: arrival", r.arrival)
    if not np.isfinite(arrival):
        raise ValueError(f"{who}: arrival must be a finite number of seconds; got "
                         f"{r.arrival!r}.")
    check_stop_fields(who, r.stop_token_ids, r.stop_strings, V, detokenize)
