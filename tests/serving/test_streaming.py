"""``ServingEngine.stream``, ``cancel`` and the stop conditions: the stream yields each
token as it is produced and holds exactly ``run``'s tokens (greedy ones equal the argmax of
the cacheless full pass); a cancelled request's pages go back to the pool at once and the
other requests' tokens do not change; stop tokens end a request keeping the token; a stop
string ends it at the token that completed it, the text cut before the string (vLLM's
rule). One tiny engine serves every test (compiled once)."""

from __future__ import annotations

import numpy as np
import pytest
from test_serving import _assert_greedy

from jaxpos.serving import PagedDecoder, Request, ServingEngine, StreamEvent


def _detokenize(ids):
    return "".join(f"<{t}>" for t in ids)  # token 7 -> "<7>"


@pytest.fixture(scope="module")
def model():
    return PagedDecoder(vocab_size=32, d_model=16, num_layers=1, num_heads=2, seed=1)


@pytest.fixture(scope="module")
def _engine(model):
    return ServingEngine(model, num_slots=2, num_pages=8, page_size=4, max_len=16,
                         prefill_chunk=4, detokenize=_detokenize)


@pytest.fixture
def engine(_engine):
    yield _engine
    assert _engine.allocator.in_use == 0 and _engine.allocator.reserved == 0


PROMPTS = [[3, 17, 8, 1, 30], [12, 5], [7, 7, 21, 2, 9, 14, 6]]


def _requests(sampled=(1, 2)):
    """Greedy request 0, sampled requests 1 and 2 (temperature 1, their own seeds)."""
    return [Request(p, 6, temperature=1.0 if i in sampled else 0.0, seed=10 + i)
            for i, p in enumerate(PROMPTS)]


def _by_id(events):
    out: dict = {}
    for e in events:
        out.setdefault(e.id, []).append(e)
    return out


def test_stream_yields_tokens_as_produced_and_run_collects_the_same_tokens(engine, model):
    done, stats = engine.run(_requests(sampled=(1,)))
    want = {c.request.id: c.tokens for c in done}
    stream = engine.stream(_requests(sampled=(1,)))
    first = next(stream)
    # the first event comes from the first prefill, before any decode step has run
    assert (first.id, first.index) == (0, 0) and stream.stats.decode_steps == 0
    events = [first, *stream]
    assert all(isinstance(e, StreamEvent) for e in events)
    per = _by_id(events)
    for i, evs in per.items():
        assert [e.index for e in evs] == list(range(6))
        assert [e.finish_reason for e in evs] == [None] * 5 + ["length"]
        assert [e.token for e in evs] == want[i]
    assert len(events) == stats.generated == stream.stats.generated == 18
    assert [c.tokens for c in stream.completions] == [c.tokens for c in done]
    for i in (0, 2):  # the greedy ones: the argmax of the full pass at every step
        _assert_greedy(model, PROMPTS[i], want[i])
    # 2 slots: request 2 starts only after one of the others ended
    ends = {e.id: j for j, e in enumerate(events) if e.finish_reason}
    assert [e.id for e in events].index(2) > min(ends[0], ends[1])


def test_cancel_returns_the_pages_and_leaves_the_other_requests_unchanged(engine):
    alone, _ = engine.run([r for r in _requests() if r.seed != 10])
    want = {c.request.id: c.tokens for c in alone}  # ids 0, 1: requests 1 and 2
    reqs = [Request(r.prompt, r.max_new_tokens, temperature=r.temperature, seed=r.seed,
                    id=("c" if r.seed == 10 else r.seed - 11)) for r in _requests()]
    stream = engine.stream(reqs)
    seen = []
    for e in stream:
        seen.append(e)
        if (e.id, e.index) == ("c", 1):
            in_use, reserved = engine.allocator.in_use, engine.allocator.reserved
            assert engine.cancel("c") is True
            # its pages are back at once: 2 held (a 5-token prompt padded to 2 prefill
            # chunks of 4), 3 booked (5 + 6 tokens)
            assert engine.allocator.in_use == in_use - 2
            assert engine.allocator.reserved == reserved - 3
            assert engine.cancel("c") is False  # already ended
    per = _by_id(seen)
    assert [(e.token, e.index, e.finish_reason) for e in per["c"][2:]] == [
        (None, 2, "cancelled")]
    assert [e.token for e in per["c"][:2]] == stream.completions[0].tokens
    assert stream.completions[0].finish_reason == "cancelled"
    for i in (0, 1):
        assert [e.token for e in per[i]] == want[i]
    assert engine.allocator.in_use == 0 and engine.allocator.reserved == 0
    with pytest.raises(ValueError, match="cancel: id 'nope' is not a request"):
        engine.cancel("nope")


def test_cancelling_a_waiting_request_ends_it_before_its_first_token(engine):
    stream = engine.stream(_requests())
    first = next(stream)
    assert engine.cancel(2) is True  # 2 slots: request 2 is still waiting
    assert next(stream) == StreamEvent(2, None, 0, "cancelled")
    rest = [first, *stream]
    assert {e.id for e in rest} == {0, 1} and len(rest) == 12
    c = [c for c in stream.completions if c.request.id == 2][0]
    assert c.tokens == [] and c.finish_reason == "cancelled" and np.isnan(c.first_token)


def test_closing_a_stream_returns_every_page_and_a_second_open_stream_is_refused(engine):
    stream = engine.stream(_requests())
    next(stream), next(stream)
    assert engine.allocator.in_use > 0
    with pytest.raises(RuntimeError, match="still open"):
        engine.stream(_requests())
    stream.close()
    assert engine.allocator.in_use == 0 and engine.allocator.reserved == 0
    assert list(stream) == [] and engine.cancel(0) is False
    with engine.stream(_requests()) as again:  # a new one may start
        assert next(again).index == 0
    assert engine.allocator.in_use == 0


def test_stop_token_ids_and_eos_end_a_request_keeping_the_token(engine):
    (free,), _ = engine.run([Request(PROMPTS[1], 8, temperature=1.0, seed=4)])
    toks = free.tokens
    k = next(i for i in range(1, 8) if toks[i] not in toks[:i])  # its first occurrence
    stop = toks[k]
    other = next(t for t in range(32) if t not in toks)  # never sampled: no effect
    stream = engine.stream([Request(PROMPTS[1], 8, temperature=1.0, seed=4,
                                    stop_token_ids=[other, stop], id="s"),
                            Request(PROMPTS[1], 8, temperature=1.0, seed=4, eos_id=stop,
                                    id="e")])
    events = _by_id(stream)
    for i in ("s", "e"):
        assert [e.token for e in events[i]] == toks[:k + 1]
        assert events[i][-1].finish_reason == "stop"
    assert events["s"][-1].stop_reason == stop and events["e"][-1].stop_reason is None
    got = {c.request.id: (c.finish_reason, c.stop_reason) for c in stream.completions}
    assert got == {"s": ("stop", stop), "e": ("eos", None)}  # run's "eos" is kept


def test_a_stop_string_ends_at_the_token_completing_it_and_cuts_the_text(engine):
    (free,), _ = engine.run([Request(PROMPTS[0], 8, temperature=1.0, seed=6)])
    toks = free.tokens
    # "a><b": the end of token k-1 and the start of token k, so token k completes it
    k = next(i for i in range(2, 8)
             if f"{toks[i - 1]}><{toks[i]}" not in _detokenize(toks[:i]))
    stop = f"{toks[k - 1]}><{toks[k]}"
    done, _ = engine.run([Request(PROMPTS[0], 8, temperature=1.0, seed=6,
                                  stop_strings=["never", stop])])
    (c,) = done
    assert c.tokens == toks[:k + 1]
    assert (c.finish_reason, c.stop_reason) == ("stop_string", stop)
    full = _detokenize(toks[:k + 1])
    assert c.text == full[:full.index(stop)] == _detokenize(toks[:k - 1]) + "<"
    assert free.text == _detokenize(toks) and free.finish_reason == "length"


@pytest.mark.parametrize("fields, error, match", [
    (dict(stop_token_ids="ab"), TypeError, "stop_token_ids must be a sequence of int"),
    (dict(stop_token_ids=[1.5]), TypeError, "stop_token_ids must be a sequence of int"),
    (dict(stop_token_ids=[32]), ValueError, r"stop_token_ids must lie in \[0, vocab_size=32"),
    (dict(stop_strings=[""]), ValueError, "stop_strings must not hold an empty string"),
    (dict(stop_strings=[3]), TypeError, "stop_strings must be a str or a sequence of str"),
])
def test_bad_stop_fields_are_refused_naming_the_request(engine, fields, error, match):
    with pytest.raises(error, match=rf"request 'r'.*{match}"):
        engine.stream([Request([1, 2], 2, id="r", **fields)])


def test_stream_arguments_are_checked(model, engine, monkeypatch):
    eng = ServingEngine(model, num_slots=1, num_pages=4, page_size=4, max_len=12)
    with pytest.raises(ValueError, match="stop_strings .* pass ServingEngine.*detokenize"):
        eng.stream([Request([1, 2], 2, stop_strings="x", id="r")])
    with pytest.raises(TypeError, match="detokenize must be None or a callable"):
        ServingEngine(model, num_slots=1, num_pages=4, page_size=4, max_len=12,
                      detokenize="abc")
    with pytest.raises(ValueError, match="request id 'a' is given to two requests"):
        eng.stream([Request([1], 2, id="a"), Request([2], 2, id="a")])
    with pytest.raises(ValueError, match="request id 1 is given to two requests"):
        eng.stream([Request([1], 2, id=1), Request([2], 2)])  # the default id: the index
    with pytest.raises(TypeError, match="request id must be hashable"):
        eng.stream([Request([1], 2, id=["a"])])
    with pytest.raises(ValueError, match="cancel: id 0 is not a request"):
        eng.cancel(0)  # no stream yet
    (c,), _ = engine.run([Request([1, 2], 2, stop_token_ids=None, stop_strings=None)])
    assert len(c.tokens) == 2 and c.finish_reason == "length"  # None: no stop conditions
    monkeypatch.setattr(engine, "detokenize", lambda ids: ids)
    with pytest.raises(TypeError, match="detokenize must return a str; got list"):
        engine.run([Request([1, 2], 1, stop_strings="x")])
    # (the engine fixture checks that the error ended the loop and freed its pages)
