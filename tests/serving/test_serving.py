"""``jaxpos.serving``: the page allocator's bookkeeping, the page write, per-request
sampling, and the continuous-batching loop, whose greedy generations must equal a loop
that reruns the full causal forward pass (dense ``jaxpos.attention`` over the whole
sequence, no cache) and appends the argmax, token by token."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _serving_reference import full_pass_logits
from flax import nnx

import jaxpos
from jaxpos.nnx import DecoderLM
from jaxpos.serving import (
    PageAllocator,
    PagedDecoder,
    Request,
    ServingEngine,
    sample_tokens,
    write_pages,
)
from jaxpos.serving.model import ModuleDecoder


# ------------------------------------------------------------------------ allocator
def test_allocator_books_hands_out_and_takes_back_pages():
    a = PageAllocator(5)
    assert a.reserve(3) and not a.reserve(3) and a.available == 2
    got = a.allocate(2)
    assert got == [0, 1] and a.in_use == 2
    a.free(got, reserved=3)
    assert a.in_use == 0 and a.available == 5 and a.peak_in_use == 2
    with pytest.raises(ValueError, match="page 1 is not an allocated page"):
        a.free([1])
    with pytest.raises(ValueError, match="page pool exhausted: 6 page"):
        a.allocate(6)
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(0)


def test_allocator_refuses_negative_bookings_and_a_booking_released_twice():
    # reserve(-3) used to succeed and leave 8 available of a 5-page pool; releasing more
    # bookings than held was clamped to 0, hiding a double release.
    a = PageAllocator(5)
    with pytest.raises(ValueError, match="n must be a non-negative integer"):
        a.reserve(-3)
    with pytest.raises(TypeError, match="n must be a Python int"):
        a.reserve(2.5)
    assert a.available == 5 and a.reserve(2)
    got = a.allocate(1)
    with pytest.raises(ValueError, match="reserved=3 bookings released, but only 2"):
        a.free(got, reserved=3)
    assert a.in_use == 1 and a.reserved == 2  # the refused call changed nothing
    a.free(got, reserved=2)
    with pytest.raises(ValueError, match="reserved=1 bookings released, but only 0"):
        a.free([], reserved=1)
    assert a.available == 5 and a.in_use == 0


# ------------------------------------------------------------------------ page write
def test_write_pages_puts_token_t_at_slot_length_plus_t_and_flags_rows_without_a_page():
    kp = jnp.zeros((4, 2, 1, 1))
    k = jnp.arange(1.0, 7.0).reshape(2, 3, 1, 1)  # row 0: 1, 2, 3; row 1: 4, 5, 6
    table = jnp.asarray([[2, 0], [3, -1]])
    lengths = jnp.asarray([1, 0])
    mask = jnp.asarray([[True, True, True], [True, True, False]])
    kp2, _, new_len, over = write_pages(kp, kp, k, k, table, lengths, mask)
    got = np.asarray(kp2)[..., 0, 0]
    # row 0: slots 1, 2, 3 -> page 2 offset 1, page 0 offsets 0 and 1
    np.testing.assert_array_equal(got, [[2, 3], [0, 0], [0, 1], [4, 5]])
    np.testing.assert_array_equal(np.asarray(new_len), [4, 2])
    np.testing.assert_array_equal(np.asarray(over), [False, False])
    # row 1 writing a third token needs table entry 1 = -1: flagged, and nothing written
    kp3, _, _, over = write_pages(kp, kp, k, k, table, lengths, jnp.ones((2, 3), bool))
    np.testing.assert_array_equal(np.asarray(over), [False, True])
    np.testing.assert_array_equal(np.asarray(kp3)[..., 0, 0], [[2, 3], [0, 0], [0, 1], [4, 5]])


def test_write_pages_flags_a_negative_fill_and_writes_nothing():
    """lengths [-2, 1]: row 0's slots -2 .. 1 would wrap into its own page 0 (offsets 2, 3
    then 0, 1); the row is flagged like a fill past the table and none of its tokens is
    written, while row 1 writes slots 1 .. 4 as usual."""
    kp = jnp.zeros((3, 4, 1, 1))
    k = jnp.arange(1.0, 9.0).reshape(2, 4, 1, 1)  # row 0: 1 .. 4; row 1: 5 .. 8
    table = jnp.asarray([[0, -1], [1, 2]])
    for run in (write_pages, jax.jit(write_pages)):
        kp2, vp2, _, over = run(kp, kp, k, k, table, jnp.asarray([-2, 1]))
        np.testing.assert_array_equal(np.asarray(over), [True, False])
        want = [[0, 0, 0, 0], [0, 5, 6, 7], [8, 0, 0, 0]]
        np.testing.assert_array_equal(np.asarray(kp2)[..., 0, 0], want)
        np.testing.assert_array_equal(np.asarray(vp2)[..., 0, 0], want)


# ------------------------------------------------------------------------- sampling
def test_sampling_greedy_top_k_and_top_p():
    n = 200
    logits = jnp.asarray([[0.0, 3.0, 2.9, -1.0]] * n)
    # n draws of one request: the same seed, counters 0 .. n - 1
    draw = lambda t, k, p: np.asarray(sample_tokens(
        logits, jnp.full((n,), t), jnp.full((n,), k), jnp.full((n,), p), jnp.full((n,), 7),
        jnp.arange(n)))
    assert (draw(0.0, 0, 1.0) == 1).all()  # greedy
    assert (draw(1.0, 1, 1.0) == 1).all()  # top-1 is greedy
    assert (draw(1.0, 0, 0.3) == 1).all()  # p(1) = 0.49 >= 0.3: the nucleus is token 1
    two = draw(1.0, 2, 1.0)
    assert set(two.tolist()) == {1, 2}  # only the two best, both drawn
    every = draw(5.0, 0, 1.0)
    assert set(every.tolist()) == {0, 1, 2, 3}
    # the same seed and counter give the same token, in any batch
    batch = sample_tokens(logits[:4], jnp.full((4,), 5.0), jnp.zeros((4,), jnp.int32),
                          jnp.ones((4,)), jnp.full((4,), 7), jnp.arange(4))
    np.testing.assert_array_equal(np.asarray(batch), every[:4])


# ------------------------------------------------------------------------ the loop
def _full_pass_logits(model: PagedDecoder, seq):
    """float32 ``[T, V]``: the whole causal forward pass over ``seq`` (dense reference
    attention, no cache)."""
    return np.asarray(full_pass_logits(model, jnp.asarray([seq], jnp.int32))[0])


def _assert_greedy(model, prompt, tokens):
    """``tokens`` is what greedy decoding of ``prompt`` generates: at every step the argmax
    of the full pass over the sequence so far (one pass over prompt + tokens gives every
    step's logits: the model is causal)."""
    logits = _full_pass_logits(model, list(prompt) + list(tokens[:-1]))
    want = np.argmax(logits[len(prompt) - 1:], axis=-1)
    np.testing.assert_array_equal(tokens, want)


@pytest.mark.parametrize("position", [
    lambda: jaxpos.RoPE(rotary_dim=4),
    pytest.param(lambda: jaxpos.ALiBi(4), marks=pytest.mark.slow),
    pytest.param(lambda: jaxpos.T5Bias(jnp.linspace(-2, 2, 128).reshape(32, 4),
                                       bidirectional=False), marks=pytest.mark.slow)],
    ids=["rope", "alibi", "t5"])
def test_continuous_batching_greedy_equals_the_full_forward_pass(position):
    """5 requests through 2 slots with pages of 4 slots and prefill chunks of 4: prompts
    of 1-9 tokens span several chunks and pages, requests join as others leave, and each
    generation equals the cacheless full pass; every page is back in the pool at the end."""
    model = PagedDecoder(vocab_size=32, d_model=16, num_layers=2, num_heads=4, num_kv_heads=2,
                         position=position(), seed=1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 32, n).tolist() for n in (9, 1, 4, 6, 2)]
    budgets = [3, 6, 2, 5, 4]
    reqs = [Request(p, b) for p, b in zip(prompts, budgets)]
    eng = ServingEngine(model, num_slots=2, num_pages=8, page_size=4, max_len=16,
                        prefill_chunk=4)
    done, stats = eng.run(reqs)
    got = {c.request.id: c.tokens for c in done}
    for i, (p, b) in enumerate(zip(prompts, budgets)):
        assert len(got[i]) == b
        _assert_greedy(model, p, got[i])
    assert stats.generated == sum(budgets)
    assert eng.allocator.in_use == 0 and eng.allocator.reserved == 0
    assert all(c.finish_reason == "length" for c in done)
    assert 1.0 <= stats.page_ratio < stats.dense_ratio


@pytest.mark.slow
def test_eos_ends_a_request_and_static_batching_gives_the_same_tokens():
    model = PagedDecoder(vocab_size=16, d_model=16, num_layers=1, num_heads=2, seed=3)
    prompt = [3, 1, 4]
    free_run = []
    for _ in range(6):
        free_run.append(int(np.argmax(_full_pass_logits(model, prompt + free_run)[-1])))
    eos = free_run[2]
    reqs = [Request(prompt, 6, eos_id=eos), Request([5, 9], 4)]
    outs = {}
    for schedule in ("continuous", "static"):
        eng = ServingEngine(model, num_slots=2, num_pages=6, page_size=4, max_len=12,
                            prefill_chunk=4, schedule=schedule)
        done, _ = eng.run(reqs)
        outs[schedule] = {c.request.id: (c.tokens, c.finish_reason) for c in done}
    assert outs["continuous"][0] == (free_run[:free_run.index(eos) + 1], "eos")
    assert outs["continuous"] == outs["static"]


def test_requests_that_can_never_run_are_refused():
    model = PagedDecoder(vocab_size=16, d_model=16, num_layers=1, num_heads=2)
    eng = ServingEngine(model, num_slots=1, num_pages=2, page_size=4, max_len=12,
                        prefill_chunk=4)
    with pytest.raises(ValueError, match="exceeds max_len=12"):
        eng.run([Request([1] * 10, 3)])
    with pytest.raises(ValueError, match="needs 3 pages; the pool holds num_pages=2"):
        eng.run([Request([1] * 9, 3)])
    with pytest.raises(ValueError, match="prompt must hold at least one token"):
        eng.run([Request([], 3)])
    with pytest.raises(ValueError, match="top_p"):
        eng.run([Request([1], 3, top_p=0.0)])
    with pytest.raises(ValueError, match="schedule"):
        ServingEngine(model, num_slots=1, num_pages=2, page_size=4, max_len=12,
                      schedule="fifo")
    assert jax.devices()  # (the refusals happen before any device work)


@pytest.mark.parametrize("prompt, bad", [([69, 2, 3], 69), ([-1, 2, 3], -1), ([2, 64], 64)])
def test_prompt_token_ids_outside_the_vocabulary_are_refused_naming_the_request(prompt, bad):
    """With vocab 64, id 69 would give NaN logits (argmax 0) and -1 the last embedding row
    (plausible tokens): the loop refuses both, naming the request and the id."""
    model = PagedDecoder(vocab_size=64, d_model=16, num_layers=1, num_heads=2)
    eng = ServingEngine(model, num_slots=1, num_pages=4, page_size=4, max_len=12,
                        prefill_chunk=4)
    ok = Request([1, 2], 2, id="fine")
    with pytest.raises(ValueError, match=rf"request 'req-7'.*vocab_size=64.*got {bad} at"):
        eng.run([ok, Request(prompt, 4, id="req-7")])
    with pytest.raises(ValueError, match=rf"request 1: .*got {bad} at"):  # default id: index
        eng.run([ok, Request(prompt, 4)])
    assert eng.allocator.in_use == 0 and eng.allocator.reserved == 0  # refused before running


@pytest.mark.parametrize("field, value, error, match", [
    ("prompt", [1.5, 2.0], TypeError, "prompt must be a sequence of int token ids"),
    ("prompt", "abc", TypeError, "prompt must be a sequence of int token ids"),
    ("prompt", [[1, 2]], TypeError, "prompt must be a sequence of int token ids"),
    ("prompt", np.zeros((0,), np.int32), ValueError, "at least one token"),
    ("max_new_tokens", 0, ValueError, "max_new_tokens must be >= 1; got 0"),
    ("max_new_tokens", 2.0, TypeError, "max_new_tokens must be an int"),
    ("temperature", -1.0, ValueError, "finite temperature >= 0"),
    ("temperature", float("nan"), ValueError, "finite temperature >= 0"),
    ("temperature", float("inf"), ValueError, "finite temperature >= 0"),
    ("temperature", 1e39, ValueError, "finite temperature >= 0"),  # inf in float32
    ("top_k", -1, ValueError, "top_k >= 0"),
    ("top_k", 2.5, TypeError, "top_k must be an int"),
    ("top_p", float("nan"), ValueError, r"top_p in \(0, 1\]"),
    ("seed", -1, ValueError, r"seed must lie in \[0, 2\*\*32\)"),
    ("eos_id", 64, ValueError, r"eos_id must lie in \[0, vocab_size=64\)"),
    ("arrival", float("nan"), ValueError, "arrival must be a finite"),
])
def test_bad_request_fields_are_refused_naming_the_request(field, value, error, match):
    model = PagedDecoder(vocab_size=64, d_model=16, num_layers=1, num_heads=2)
    eng = ServingEngine(model, num_slots=1, num_pages=4, page_size=4, max_len=12,
                        prefill_chunk=4)
    fields = dict(prompt=[1, 2], max_new_tokens=2, id="r")
    fields[field] = value
    with pytest.raises(error, match=rf"request 'r'.*{match}"):
        eng.run([Request(**fields)])


def test_the_loop_drives_a_decoder_lm_through_its_paged_cache():
    """jaxpos.nnx.DecoderLM (T5 bias) behind ModuleDecoder: each greedy generation is the
    argmax of the module's own full pass at every step."""
    from flax import nnx

    from jaxpos.nnx import DecoderLM
    from jaxpos.serving import ModuleDecoder

    lm = DecoderLM(32, d_model=16, num_layers=2, num_heads=2, position="t5", rngs=nnx.Rngs(0))
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 32, n).tolist() for n in (9, 1, 4)]
    eng = ServingEngine(ModuleDecoder(lm), num_slots=2, num_pages=8, page_size=4, max_len=16,
                        prefill_chunk=4)
    done, _ = eng.run([Request(p, 4) for p in prompts])
    for c in done:
        prompt = list(c.request.prompt)
        full = np.asarray(lm(jnp.asarray([prompt + c.tokens[:-1]])))[0]
        np.testing.assert_array_equal(c.tokens, np.argmax(full[len(prompt) - 1:], axis=-1))


@pytest.mark.parametrize("position", ["fox", "path"])
def test_the_loop_serves_models_whose_decoding_keeps_state(position):
    """FoX (the cumulative forget gate per slot) and PaTH (the convolution's last inputs per
    request, every cached key moved at each step) behind ModuleDecoder: 3 requests through
    2 slots, prompts over one and two prefill chunks, the third request on pages (and the
    state row of its first page) that another request left; each gets the greedy tokens of
    its sequence run alone (the model's jitted full pass, right-padded: causal)."""
    lm = DecoderLM(16, d_model=8, num_layers=1, num_heads=2, position=position,
                   rngs=nnx.Rngs(0))
    prompts = [[3, 1, 4, 1, 5], [9], [2, 6, 5]]
    eng = ServingEngine(ModuleDecoder(lm), num_slots=2, num_pages=8, page_size=2, max_len=8,
                        prefill_chunk=4)
    done, _ = eng.run([Request(p, 3) for p in prompts])
    got = {c.request.id: c.tokens for c in done}
    seqs = np.zeros((3, 8), np.int32)
    for i, p in enumerate(prompts):
        seqs[i, :len(p) + 2] = p + got[i][:2]
    full = np.asarray(nnx.jit(lambda m, t: m(t))(lm, jnp.asarray(seqs)))
    for i, p in enumerate(prompts):
        np.testing.assert_array_equal(got[i], np.argmax(full[i, len(p) - 1:len(p) + 2], -1),
                                      err_msg=f"request {i}")
    assert eng.allocator.in_use == 0


def test_top_k_past_the_vocabulary_samples_as_top_k_zero():
    """top_k >= vocab_size keeps every token, as top_k=0 does (same seed, same tokens), even
    where it does not fit the int32 the loop samples with (2**31, 2**40)."""
    model = PagedDecoder(vocab_size=64, d_model=16, num_layers=1, num_heads=2)
    eng = ServingEngine(model, num_slots=1, num_pages=4, page_size=4, max_len=12,
                        prefill_chunk=4)
    runs = [eng.run([Request([1, 2, 3], 6, temperature=1.0, top_k=k, seed=5, id="r")])
            for k in (0, 64, 2 ** 31, 2 ** 40)]
    tokens = [done[0].tokens for done, _ in runs]
    assert len(tokens[0]) == 6 and all(t == tokens[0] for t in tokens[1:]), tokens
