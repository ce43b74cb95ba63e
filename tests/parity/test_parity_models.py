"""Drop-in proof: Flax NNX models built on jaxpos reproduce Hugging Face transformers.

Tiny HF PyTorch models (2 layers, hidden size 64, vocabulary 128) are made from configs
with random weights (no downloads), converted with ``examples.models.*.from_hf`` and run
on random token ids. The reference numbers are HF's own logits on the CPU build of
PyTorch; the bound is a max abs logit difference of 1e-4 in float32, for every
implementation of :func:`jaxpos.attention`.

HF's initialisation (std 0.02) makes attention nearly uniform, which would hide position
errors, so every weight is redrawn with a larger spread first (``_randomize``); a
negative control per family shows that a wrong position treatment misses the bound by
orders of magnitude.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxpos
import jaxpos.nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The example models live in examples/models/ at the repository root (not installed).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
bloom, gpt2, llama, t5 = (importlib.import_module(f"examples.models.{name}")
                          for name in ("bloom", "gpt2", "llama", "t5"))

pytestmark = pytest.mark.parity

TOL = 1e-4  # max abs logit difference, float32
VOCAB, HIDDEN, LAYERS = 128, 64, 2


def _pallas_available() -> bool:
    try:
        return hasattr(importlib.import_module("jaxpos.kernels"), "attention_via_kernel")
    except ImportError:
        return False


_NEEDS_PALLAS = pytest.mark.skipif(
    not _pallas_available(),
    reason="jaxpos.kernels.attention_via_kernel (the Pallas kernel behind "
           "implementation='pallas') is not in this build")
IMPLEMENTATIONS = ["reference", "chunked", pytest.param("pallas", marks=_NEEDS_PALLAS)]
# Pallas in interpret mode compiles slowly on CPU: the decode loop with it runs with -m slow.
DECODE_IMPLEMENTATIONS = ["reference", "chunked",
                          pytest.param("pallas", marks=[_NEEDS_PALLAS, pytest.mark.slow])]
# Small tiles so the chunked and Pallas paths run several key and query blocks.
BLOCKS = {"block_q": 4, "block_k": 4}


EMBED_STD = 0.5


def _randomize(model, seed: int, std: float = 0.3):
    """Redraw every HF parameter: norms' weights around 1 (biases around 0), the rest
    N(0, std^2), embeddings N(0, EMBED_STD^2): scores are O(1), so positions matter,
    while the tied heads' logits stay O(10) (the bound is absolute)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name or "ln_" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * noise)
            elif "embed" in name or name.endswith(("wte.weight", "wpe.weight", "shared.weight")):
                p.copy_(EMBED_STD * noise)
            else:
                p.copy_(std * noise)
    return model.eval()


_JITTED: dict = {}


def _jit(model, method: str = "__call__", *, fresh: bool = False):
    """``model.<method>`` compiled once per shape and implementation (jax.jit over the
    split NNX state, kept per model), so decoding steps and repeated calls reuse one
    executable. ``fresh=True`` traces anew (for monkeypatched negative controls)."""
    key = (id(model), method)
    if fresh or key not in _JITTED:
        graphdef, state = nnx.split(model)

        @functools.partial(jax.jit, static_argnames=("implementation", "block_q", "block_k"))
        def run(state, *args, **kwargs):
            return getattr(nnx.merge(graphdef, state), method)(*args, **kwargs)

        _JITTED[key] = (model, lambda *args, **kwargs: run(state, *args, **kwargs))
    return _JITTED[key][1]


def _max_diff(ours, ref, where=None) -> float:
    d = np.abs(np.asarray(ours, np.float64) - np.asarray(ref, np.float64))
    return float(d[np.asarray(where, bool)].max() if where is not None else d.max())


def _left_padded_batch(rs, lengths, T):
    """Token ids ``[B, T]`` and a 0/1 mask with ``T - length`` pads on the left of each row."""
    ids = rs.randint(0, VOCAB, (len(lengths), T))
    mask = np.zeros((len(lengths), T), np.int64)
    for b, n in enumerate(lengths):
        mask[b, T - n:] = 1
    return ids, mask


def _hf_positions(mask):
    """What ``generate`` passes for left padding: ``cumsum(mask) - 1``, 1 on pads."""
    pos = np.cumsum(mask, -1) - 1
    pos[mask == 0] = 1
    return pos


# ----------------------------------------------------------------------------- Llama
LLAMA_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}


@pytest.fixture(scope="module")
def llama_pair():
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,  # GQA 2:1
        rope_parameters=dict(LLAMA_ROPE), max_position_embeddings=131072,
        attn_implementation="eager")
    torch.manual_seed(0)
    hf = _randomize(transformers.LlamaForCausalLM(cfg), seed=1)
    return hf, llama.from_hf(hf.state_dict(), cfg), cfg


@pytest.fixture(scope="module")
def llama_batch(llama_pair):
    """Prompts of lengths 7, 3 and 10 left-padded to 10, each followed by 4 more tokens."""
    hf, _, _ = llama_pair
    prompt_len, steps = 10, 4
    ids, mask = _left_padded_batch(np.random.RandomState(2), [7 + steps, 3 + steps, 10 + steps],
                                   prompt_len + steps)
    with torch.no_grad():
        ref = hf(torch.tensor(ids), attention_mask=torch.tensor(mask),
                 position_ids=torch.tensor(_hf_positions(mask))).logits.numpy()
    return ids, mask, prompt_len, ref


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_llama_logits_left_padded(llama_pair, llama_batch, implementation):
    _, model, _ = llama_pair
    ids, mask, _, ref = llama_batch
    logits, _ = _jit(model)(jnp.asarray(ids), attention_mask=jnp.asarray(mask),
                      implementation=implementation, **BLOCKS)
    assert _max_diff(logits, ref, mask) <= TOL


@pytest.mark.parametrize("implementation", DECODE_IMPLEMENTATIONS)
def test_llama_kv_cache_decoding_equals_full_pass(llama_pair, llama_batch, implementation):
    """Prefill the left-padded prompts into a KV cache, then feed one token at a time:
    every step's logits equal the full forward pass (ours and HF's) at that position."""
    _, model, _ = llama_pair
    ids, mask, prompt_len, ref = llama_batch
    model = _jit(model)
    full, _ = model(jnp.asarray(ids), attention_mask=jnp.asarray(mask),
                    implementation="reference", **BLOCKS)
    cache = llama_pair[1].init_cache(batch=ids.shape[0], max_len=ids.shape[1] + 2)
    kw = dict(implementation=implementation, **BLOCKS)
    logits, cache = model(jnp.asarray(ids[:, :prompt_len]),
                          attention_mask=jnp.asarray(mask[:, :prompt_len]), cache=cache, **kw)
    real = mask[:, :prompt_len]
    assert _max_diff(logits, np.asarray(full)[:, :prompt_len], real) <= TOL
    assert _max_diff(logits, ref[:, :prompt_len], real) <= TOL
    for t in range(prompt_len, ids.shape[1]):
        step, cache = model(jnp.asarray(ids[:, t:t + 1]), cache=cache, **kw)
        assert step.shape == (ids.shape[0], 1, VOCAB)
        assert _max_diff(step[:, 0], np.asarray(full)[:, t]) <= TOL, t
        assert _max_diff(step[:, 0], ref[:, t]) <= TOL, t
    for layer_cache in cache:  # tokens held per row, padding excluded
        np.testing.assert_array_equal(np.asarray(layer_cache.token_count())[:, 0],
                                      mask.sum(-1))


def test_llama3_scaling_matters_far_from_the_origin(llama_pair, monkeypatch):
    """At positions around 6,000 the Llama 3 scaled frequencies decide the logits: ours match
    HF there, while plain (unscaled) RoPE misses by far more than the tolerance."""
    hf, model, _ = llama_pair
    rs = np.random.RandomState(3)
    ids = rs.randint(0, VOCAB, (1, 8))
    pos = 6000 + 700 * np.arange(8)[None]  # offsets beyond the unscaled wavelengths
    with torch.no_grad():
        ref = hf(torch.tensor(ids), position_ids=torch.tensor(pos)).logits.numpy()
    ours, _ = _jit(model)(jnp.asarray(ids), positions=jnp.asarray(pos, jnp.int32),
                          implementation="reference")
    assert _max_diff(ours, ref) <= TOL
    plain = llama.rope_from_config(dataclasses.replace(
        model.config, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}))
    assert not np.allclose(plain.inv_freq, llama.rope_from_config(model.config).inv_freq)
    monkeypatch.setattr(llama, "rope_from_config", lambda config, **kw: plain)
    wrong, _ = _jit(model, fresh=True)(jnp.asarray(ids), positions=jnp.asarray(pos, jnp.int32),
                                       implementation="reference")
    assert _max_diff(wrong, ref) > 1e-2


@pytest.mark.parametrize("implementation", DECODE_IMPLEMENTATIONS)
def test_llama_dynamic_ntk_kv_cache_decoding_equals_hf_generation(implementation):
    """Dynamic NTK (HF ``rope_type="dynamic"``) while decoding with a KV cache.

    The base grows with each call's ``max(position) + 1``; HF rotates each key once, with the
    frequencies of the call that cached it, and the Llama example does the same when it has a
    cache and a length-dependent scaling. Every step's logits equal HF's own cached decoding
    (a fresh HF model, so its grown-frequency state starts clean). Control: a cache-free pass
    over the same prefix (every key re-rotated with the newest base) misses by far more.
    """
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 100.0, "factor": 4.0},
        max_position_embeddings=6,  # prompts of 7 and 10 tokens already exceed it
        attn_implementation="eager")
    torch.manual_seed(0)
    hf = _randomize(transformers.LlamaForCausalLM(cfg), seed=4)
    model = llama.from_hf(hf.state_dict(), cfg)
    prompt_len, steps = 10, 4
    ids, mask = _left_padded_batch(np.random.RandomState(5), [7 + steps, 10 + steps],
                                   prompt_len + steps)
    pos = _hf_positions(mask)
    tt = torch.tensor
    # transformers 5.2x renamed ``past_key_values`` to ``cache`` (the old name is deprecated)
    new_api = "cache" in inspect.signature(hf.forward).parameters
    cache_kw = "cache" if new_api else "past_key_values"
    with torch.no_grad():  # HF generation: prefill, then one token at a time
        out = hf(tt(ids[:, :prompt_len]), attention_mask=tt(mask[:, :prompt_len]),
                 position_ids=tt(pos[:, :prompt_len]), use_cache=True)
        hf_steps, hf_cache = [out.logits.numpy()], getattr(out, cache_kw)
        for t in range(prompt_len, ids.shape[1]):
            out = hf(tt(ids[:, t:t + 1]), attention_mask=tt(mask[:, :t + 1]),
                     position_ids=tt(pos[:, t:t + 1]), use_cache=True, **{cache_kw: hf_cache})
            hf_steps.append(out.logits.numpy()[:, 0])
            hf_cache = getattr(out, cache_kw)
        recomputed = hf(tt(ids), attention_mask=tt(mask), position_ids=tt(pos)).logits.numpy()
    run = _jit(model)
    kw = dict(implementation=implementation, **BLOCKS)
    cache = model.init_cache(batch=ids.shape[0], max_len=ids.shape[1])
    logits, cache = run(jnp.asarray(ids[:, :prompt_len]),
                        attention_mask=jnp.asarray(mask[:, :prompt_len]), cache=cache, **kw)
    assert _max_diff(logits, hf_steps[0], mask[:, :prompt_len]) <= TOL
    for i, t in enumerate(range(prompt_len, ids.shape[1])):
        step, cache = run(jnp.asarray(ids[:, t:t + 1]), cache=cache, **kw)
        assert _max_diff(step[:, 0], hf_steps[i + 1]) <= TOL, t
    # Control: the last step recomputed without a cache (same length, so the same newest
    # base, but every key re-rotated with it) is a different answer.
    assert _max_diff(step[:, 0], recomputed[:, -1]) > 1e-2


# ----------------------------------------------------------------------------- BLOOM
@pytest.fixture(scope="module")
def bloom_pair():
    # 6 heads: not a power of two, so the slopes use Press et al.'s interleaving rule.
    cfg = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=60, n_layer=LAYERS, n_head=6,
                                   attn_implementation="eager")
    torch.manual_seed(0)
    hf = _randomize(transformers.BloomForCausalLM(cfg), seed=4)
    rs = np.random.RandomState(5)
    ids, mask = _left_padded_batch(rs, [12, 5, 9], 12)
    with torch.no_grad():
        ref_pad = hf(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
        ref = hf(torch.tensor(ids)).logits.numpy()
    return bloom.from_hf(hf.state_dict(), cfg), ids, mask, ref_pad, ref


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_bloom_logits(bloom_pair, implementation):
    model, ids, mask, ref_pad, ref = bloom_pair
    model = _jit(model)
    # Rows of 12, 5 and 9 real tokens, left-padded: the full row is the unpadded case.
    out = model(jnp.asarray(ids), attention_mask=jnp.asarray(mask),
                implementation=implementation, **BLOCKS)
    assert _max_diff(out, ref_pad, mask) <= TOL
    if implementation == "reference":  # HF's other alibi path (no attention_mask)
        assert _max_diff(model(jnp.asarray(ids), implementation=implementation), ref) <= TOL


def test_bloom_needs_the_non_power_of_two_slopes(bloom_pair, monkeypatch):
    """Negative control: 6 heads with a naive geometric sequence ``2**(-8(h+1)/6)``
    instead of the paper's rule misses HF by far more than the tolerance."""
    model, ids, _, _, ref = bloom_pair
    np.testing.assert_allclose(  # Press et al.: slopes of 4 heads, then odd ones of 8
        np.asarray(jaxpos.alibi_slopes(6)),
        [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3], rtol=1e-7)
    naive = jaxpos.ALiBi(slopes=2.0 ** (-8.0 * np.arange(1, 7) / 6))
    monkeypatch.setattr(jaxpos.nnx.ALiBi, "scheme", lambda self: naive)
    wrong = _jit(model, fresh=True)(jnp.asarray(ids), implementation="reference")
    assert _max_diff(wrong, ref) > 1e-2


# ----------------------------------------------------------------------------- GPT-2
@pytest.fixture(scope="module")
def gpt2_pair():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=HIDDEN,
                                  n_layer=LAYERS, n_head=4, bos_token_id=0, eos_token_id=0,
                                  attn_implementation="eager")
    torch.manual_seed(0)
    hf = _randomize(transformers.GPT2LMHeadModel(cfg), seed=6)
    ids = np.random.RandomState(7).randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    return gpt2.from_hf(hf.state_dict(), cfg), ids, ref


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_gpt2_logits(gpt2_pair, implementation):
    model, ids, ref = gpt2_pair
    out = _jit(model)(jnp.asarray(ids), implementation=implementation, **BLOCKS)
    assert _max_diff(out, ref) <= TOL


def test_gpt2_needs_its_learned_positions(gpt2_pair):
    """Negative control: the learned positions shifted by one row miss HF by far more than
    the tolerance; a position past the table (row 32 of 32) raises instead of clamping."""
    model, ids, ref = gpt2_pair
    wrong = _jit(model)(jnp.asarray(ids), positions=jnp.arange(1, 17, dtype=jnp.int32),
                        implementation="reference")
    assert _max_diff(wrong, ref) > 1e-2
    with pytest.raises(ValueError, match="no row for position 32"):
        model(jnp.zeros((1, 33), jnp.int32))


# -------------------------------------------------------------------------------- T5
@pytest.fixture(scope="module")
def t5_pair():
    # 16 buckets / max_distance 20 so sequences of 24 reach the exact, logarithmic and
    # clipped buckets in both directions.
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=16, d_ff=128,
                                num_layers=LAYERS, num_heads=4,
                                relative_attention_num_buckets=16,
                                relative_attention_max_distance=20, decoder_start_token_id=0,
                                attn_implementation="eager")
    torch.manual_seed(0)
    # std 0.1: T5 does not scale its scores by 1/sqrt(d_kv), so larger weights push them
    # (and float32 rounding) up fast; 0.1 still gives sharply non-uniform attention.
    hf = _randomize(transformers.T5ForConditionalGeneration(cfg), seed=8, std=0.1)
    rs = np.random.RandomState(9)
    src = rs.randint(0, VOCAB, (2, 24))
    src_mask = np.ones((2, 24), np.int64)
    src_mask[0, 17:] = 0  # right padding in the encoder input
    tgt = rs.randint(0, VOCAB, (2, 22))
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(src), attention_mask=torch.tensor(src_mask),
                 decoder_input_ids=torch.tensor(tgt))
    refs = (out.encoder_last_hidden_state.numpy(), out.logits.numpy())
    return t5.from_hf(hf.state_dict(), cfg), src, src_mask, tgt, refs


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_t5_encoder_and_decoder(t5_pair, implementation):
    model, src, src_mask, tgt, (ref_enc, ref_logits) = t5_pair
    logits, enc = _jit(model)(jnp.asarray(src), jnp.asarray(tgt),
                              attention_mask=jnp.asarray(src_mask),
                              implementation=implementation, **BLOCKS)
    assert _max_diff(enc, ref_enc, src_mask) <= TOL
    assert _max_diff(logits, ref_logits) <= TOL


def test_t5_needs_scale_one(t5_pair, monkeypatch):
    """Negative control: the default 1/sqrt(d_kv) scale instead of T5's scale=1.0 misses
    HF's logits by far more than the tolerance."""
    model, src, src_mask, tgt, (_, ref_logits) = t5_pair
    enc = _jit(model, "encode")(jnp.asarray(src), attention_mask=jnp.asarray(src_mask),
                                implementation="reference")
    orig = jaxpos.attention
    monkeypatch.setattr(jaxpos, "attention", lambda *a, **k: orig(*a, **{**k, "scale": None}))
    wrong = _jit(model, "decode", fresh=True)(jnp.asarray(tgt), enc,
                                              attention_mask=jnp.asarray(src_mask),
                                              implementation="reference")
    assert _max_diff(wrong, ref_logits) > 1e-2


# ------------------------------------------------------------------------ converters
def test_converters_reject_the_wrong_checkpoint(gpt2_pair, llama_pair):
    hf_llama, _, cfg = llama_pair
    sd = dict(hf_llama.state_dict())
    key = "model.layers.0.self_attn.q_proj.weight"
    sd[key] = sd[key][:8]
    with pytest.raises(ValueError, match=r"q_proj.weight.*shape \(64, 8\).*\(64, 64\)"):
        llama.from_hf(sd, cfg)
    sd = dict(hf_llama.state_dict())
    del sd["model.norm.weight"]
    with pytest.raises(ValueError, match="model.norm.weight"):
        llama.from_hf(sd, cfg)
    sd = dict(hf_llama.state_dict(), **{"model.extra.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match="not used.*model.extra.weight"):
        llama.from_hf(sd, cfg)


# -------------------------------------------------------------- other config branches
@pytest.mark.slow
def test_variants_t5_v1_1_and_llama_with_biases_and_tied_head():
    """T5 v1.1 (gated GELU, no output rescaling) and a Llama with attention/MLP biases, a
    tied head and plain RoPE: the branches the main fixtures do not take."""
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=16, d_ff=128,
                                num_layers=LAYERS, num_heads=4, feed_forward_proj="gated-gelu",
                                tie_word_embeddings=False, decoder_start_token_id=0,
                                attn_implementation="eager")
    torch.manual_seed(0)
    hf = _randomize(transformers.T5ForConditionalGeneration(cfg), seed=10, std=0.1)
    assert not cfg.scale_decoder_outputs
    rs = np.random.RandomState(11)
    src, tgt = rs.randint(0, VOCAB, (2, 10)), rs.randint(0, VOCAB, (2, 7))
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(src), decoder_input_ids=torch.tensor(tgt))
    logits, enc = _jit(t5.from_hf(hf.state_dict(), cfg))(
        jnp.asarray(src), jnp.asarray(tgt), implementation="reference")
    assert _max_diff(enc, out.encoder_last_hidden_state.numpy()) <= TOL
    assert _max_diff(logits, out.logits.numpy()) <= TOL

    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=1, attention_bias=True, mlp_bias=True,
        tie_word_embeddings=True, attn_implementation="eager")
    torch.manual_seed(0)
    hf = _randomize(transformers.LlamaForCausalLM(cfg), seed=12)
    ids = rs.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    ours, _ = _jit(llama.from_hf(hf.state_dict(), cfg))(jnp.asarray(ids),
                                                         implementation="chunked", **BLOCKS)
    assert _max_diff(ours, ref) <= TOL


def test_llama_cache_overflow_raises_or_poisons(llama_pair):
    """A concrete write past the cache raises; a traced one gives NaN, never a clamped
    write over other slots."""
    _, model, _ = llama_pair
    ids = jnp.zeros((1, 2), jnp.int32)
    _, cache = model(ids, cache=model.init_cache(batch=1, max_len=3),
                     implementation="reference")  # 2 of 3 slots used
    with pytest.raises(ValueError, match="KV cache overflow: writing 2 token"):
        model(ids, cache=cache, implementation="reference")
    logits, _ = _jit(model)(ids, cache=cache, implementation="reference")
    assert np.isnan(np.asarray(logits)).all()
