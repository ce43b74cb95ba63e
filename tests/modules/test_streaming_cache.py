"""StreamingLLM KV cache (Xiao et al. 2024, §3.2): ``init_cache(batch, max_len,
keep_first=k)`` keeps the first ``k`` tokens and the most recent ones, positions are places
in the cache. In a one-layer model every decode step equals a fresh full pass over the kept
tokens (sinks, then the recent tokens in order, at positions ``0 .. n - 1``), for RoPE
(keys raw in the cache, rotated at read), ALiBi, T5 and NoPE, past many times ``max_len``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpos.layers.cache import streaming_ranks
from jaxpos.nnx import DecoderLM


def _model(position):
    return DecoderLM(40, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2,
                     position=position, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("position", ["rope", pytest.param("alibi", marks=pytest.mark.slow),
                                      pytest.param("t5", marks=pytest.mark.slow),
                                      pytest.param("nope", marks=pytest.mark.slow)])
def test_each_step_equals_a_fresh_pass_over_the_kept_tokens(position):
    S, keep, steps = 6, 2, 12
    m = _model(position)
    toks = jax.random.randint(jax.random.key(3), (2, steps), 0, 40)
    step = nnx.jit(lambda model, t, c: model.decode_step(t, c))
    full = nnx.jit(lambda model, t: model(t))
    cache = m.init_cache(2, S, keep_first=keep)
    logits, cache = step(m, toks[:, :3], cache)
    np.testing.assert_allclose(logits, m(toks[:, :3]), atol=2e-5)
    for t in range(3, steps):
        logits, cache = step(m, toks[:, t:t + 1], cache)
        kept = np.concatenate([np.arange(min(keep, t + 1)),
                               np.arange(max(keep, t + 1 - (S - keep)), t + 1)])
        want = full(m, toks[:, kept])[:, -1:]
        np.testing.assert_allclose(logits, want, atol=2e-5, err_msg=f"step {t}")
    assert cache[0].k.shape[1] == S  # fixed memory


def test_places_in_the_cache_follow_the_ring():
    """Slots -> places after ``written`` tokens: sinks at their slot, the ring's oldest
    token at ``keep_first``, the newest at ``S - 1`` once full (exact integers)."""
    got = np.asarray(streaming_ranks(jnp.asarray([3, 6, 7, 9]), 6, 2))
    np.testing.assert_array_equal(got, [[0, 1, 2, 3, 4, 5],   # not full: slot = place
                                        [0, 1, 2, 3, 4, 5],   # tokens 2..5 in slots 2..5
                                        [0, 1, 5, 2, 3, 4],   # token 6 overwrote slot 2
                                        [0, 1, 3, 4, 5, 2]])  # tokens 5..8 in 3,4,5,2


def test_bad_keep_first_and_evicting_prefill_raise():
    m = _model("rope")
    with pytest.raises(ValueError, match="keep_first"):
        m.init_cache(1, 4, keep_first=4)
    with pytest.raises(TypeError, match="keep_first"):
        m.init_cache(1, 4, keep_first=1.0)  # pyright: ignore[reportArgumentType]
    cache = m.init_cache(1, 4, keep_first=1)
    with pytest.raises(ValueError, match="evict"):
        m.decode_step(jnp.zeros((1, 5), jnp.int32), cache)


def test_evicting_step_under_jit_gives_nan_logits():
    # Traced fill counts cannot raise: a step of several tokens that evicts keys its own
    # queries need gives NaN logits (as KV-cache overflow does); a one-token step that
    # evicts (the ring at work) stays finite and equals the eager step.
    m = _model("rope")
    step = nnx.jit(lambda m, t, c: m.decode_step(t, c))
    _, cache = step(m, jnp.asarray([[1, 2, 3]]), m.init_cache(1, 4, keep_first=1))
    logits, _ = step(m, jnp.asarray([[4, 5]]), cache)
    assert np.isnan(np.asarray(logits)).all()
    _, cache = step(m, jnp.asarray([[4]]), cache)
    logits, _ = step(m, jnp.asarray([[5]]), cache)
    _, eager = m.decode_step(jnp.asarray([[4]]), m.decode_step(jnp.asarray([[1, 2, 3]]),
                                                               m.init_cache(1, 4, keep_first=1))[1])
    assert np.isfinite(np.asarray(logits)).all()
    np.testing.assert_allclose(logits, m.decode_step(jnp.asarray([[5]]), eager)[0],
                               rtol=1e-5, atol=1e-5)


# ------------------------------------------------ left padding, token order, refusals
SMALL = dict(d_model=16, num_layers=1, num_heads=2)


def _fresh_pass_per_step(position, seqs, S, keep, steps, **kw):
    """A left-padded prefill of ``seqs`` into a StreamingLLM cache, then ``steps`` decode
    steps; at every step each row's logits must equal a fresh pass over the row's kept
    *tokens* (its first ``keep`` tokens, then its most recent ``S - keep``, at positions
    ``0 .. n - 1``): the definition of Xiao et al. 2024, §3.2. Returns the largest
    difference seen (for a caller that expects one)."""
    m = DecoderLM(40, position=position, rngs=nnx.Rngs(0), **SMALL, **kw)
    T = max(len(s) for s in seqs)
    tokens = np.zeros((len(seqs), T), np.int32)
    mask = np.zeros((len(seqs), T), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, T - len(s):], mask[i, T - len(s):] = s, 1
    more = np.asarray(jax.random.randint(jax.random.key(7), (len(seqs), steps), 0, 40))
    step = nnx.jit(lambda m, t, c, a=None: m.decode_step(t, c, attention_mask=a))
    full = nnx.jit(lambda m, t: m(t))
    logits, cache = step(m, jnp.asarray(tokens), m.init_cache(len(seqs), S, keep_first=keep),
                         jnp.asarray(mask))
    worst = 0.0
    for i, s in enumerate(seqs):  # the prompt fits the cache: a pass over the row alone
        want = full(m, jnp.asarray(s)[None])[0]
        worst = max(worst, float(np.abs(np.asarray(logits[i, T - len(s):]) - want).max()))
    text = [list(s) for s in seqs]
    for t in range(steps):
        logits, cache = step(m, jnp.asarray(more[:, t:t + 1]), cache)
        for i in range(len(seqs)):
            text[i].append(int(more[i, t]))
            n = len(text[i])
            kept = text[i][:min(keep, n)] + text[i][max(keep, n - (S - keep)):]
            want = full(m, jnp.asarray(kept)[None])[0, -1]
            worst = max(worst, float(np.abs(np.asarray(logits[i, 0]) - want).max()))
    return worst


@pytest.mark.parametrize("position", ["rope", pytest.param("ssmax", marks=pytest.mark.slow),
                                      pytest.param("alibi", marks=pytest.mark.slow)])
def test_left_padded_rows_keep_their_first_tokens_as_sinks(position):
    """Row 1 has two pads: padding takes no slot, so the sinks are its first two tokens and
    its places count tokens only (before the ring wraps and after)."""
    seqs = (np.array([3, 4, 5, 6, 7]), np.array([8, 9, 10]))
    assert _fresh_pass_per_step(position, seqs, S=6, keep=2, steps=6) < 2e-5


def test_stick_breaking_reads_a_wrapped_ring_in_token_order():
    """Stick-breaking weights follow the order of the keys along their axis (Tan et al.
    2025, §2): once the ring wraps, slot order is not token order, so the cache hands the
    keys in place order and every step equals the fresh pass over the kept tokens."""
    seqs = (np.array([3, 4, 5]), np.array([8, 9, 10]))
    assert _fresh_pass_per_step("stick_breaking", seqs, S=6, keep=2, steps=6) < 2e-5


@pytest.mark.parametrize("position", ["sinusoidal", "learned"])
def test_streaming_cache_with_absolute_positions_is_refused(position):
    """Positions added to the embeddings cannot be re-numbered as places in the cache: a
    StreamingLLM cache is refused at init_cache and at decode_step (a cache made by a
    layer), in NNX and Linen."""
    from jaxpos import linen as jl

    m = DecoderLM(40, position=position, max_len=16, rngs=nnx.Rngs(0), **SMALL)
    with pytest.raises(ValueError, match=rf"keep_first=2.*position='{position}'"):
        m.init_cache(1, 6, keep_first=2)
    layer_cache = (m.blocks[0].attn.init_cache(1, 6, keep_first=2),)
    with pytest.raises(ValueError, match=rf"decode_step.*position='{position}'"):
        m.decode_step(jnp.zeros((1, 2), jnp.int32), layer_cache)
    with pytest.raises(ValueError, match=rf"keep_first=2.*position='{position}'"):
        jl.DecoderLM(40, position=position, max_len=16, **SMALL).init_cache(1, 6, keep_first=2)
    assert len(m.init_cache(1, 6)) == 1  # the dense cache stays available
