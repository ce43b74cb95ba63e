"""The Llama 4 and DeepSeek-V3 example ports, served by the continuous-batching loop
(:class:`jaxpos.serving.ModuleDecoder` over paged caches) with and without a token budget
(``max_num_batched_tokens``: padded steps for these two, a ragged step of packed rows for
the Llama port), generate exactly the greedy tokens of the port's own full pass.

Llama 4: a chunked RoPE layer (chunks of 4) and a NoPE layer with attention temperature
tuning at ``floor_scale`` 2, so the temperature changes every two positions of the served
rows and a wrong slot count changes the tokens. DeepSeek-V3: latent attention whose cache
holds each token's latent and rope key split over a key and a value half
(``deepseek_v3.pack_latent``; ``kv_lora_rank + qk_rope_head_dim`` odd here, so the pad
slot is exercised). Tiny models with their own random weights (no transformers needed; the
ports' parity with Hugging Face is tests/parity's). The reference re-runs the full pass
over each right-padded sequence after every token (one compiled shape) and takes the
argmax at its last real token.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from examples.models import deepseek_v3, llama, llama4
from examples.models.pretrained import CheckpointConfig
from jaxpos.serving import ModuleDecoder, Request, ServingEngine

VOCAB, NEW_TOKENS, PROMPTS = 32, 3, ((5, 11, 19, 2, 7, 3), (9, 1, 30))


def _llama4():
    cfg = llama4.Llama4Config.from_hf(dict(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=16, intermediate_size_mlp=32,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        no_rope_layers=[1, 0], moe_layers=[], attention_chunk_size=4,
        layer_types=["chunked_attention", "full_attention"], attn_temperature_tuning=True,
        floor_scale=2, attn_scale=2.0, rope_parameters={"rope_type": "default",
                                                        "rope_theta": 100.0}))
    return llama4.Llama4ForCausalLM(cfg, rngs=nnx.Rngs(3))


def _deepseek():
    cfg = deepseek_v3.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=16, moe_intermediate_size=8,
        num_hidden_layers=1, num_attention_heads=2, kv_lora_rank=7, q_lora_rank=None,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, n_routed_experts=2,
        num_experts_per_tok=1, first_k_dense_replace=1)
    return deepseek_v3.DeepseekV3ForCausalLM(cfg, rngs=nnx.Rngs(4))


def _llama():
    cfg = llama.LlamaConfig.from_hf(CheckpointConfig(dict(
        model_type="llama", vocab_size=VOCAB, hidden_size=16, intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8)))
    return llama.LlamaForCausalLM(cfg, rngs=nnx.Rngs(5))


def _full_pass_greedy(model, prompts, steps):
    """Greedy tokens of the port's full pass (no cache), all rows at once."""
    graphdef, state = nnx.split(model)
    run = jax.jit(lambda s, ids, m: nnx.merge(graphdef, s)(ids, attention_mask=m)[0])
    L = max(map(len, prompts)) + steps
    seqs = [list(p) for p in prompts]
    for _ in range(steps):
        ids = np.zeros((len(seqs), L), np.int32)
        mask = np.zeros((len(seqs), L), np.int32)
        for b, s in enumerate(seqs):
            ids[b, :len(s)], mask[b, :len(s)] = s, 1
        logits = np.asarray(run(state, jnp.asarray(ids), jnp.asarray(mask)))
        for b, s in enumerate(seqs):
            s.append(int(np.argmax(logits[b, len(s) - 1])))
    return [s[len(p):] for s, p in zip(seqs, prompts)]


@pytest.mark.parametrize("build, budget", [
    (_llama4, None), (_deepseek, None), (_llama, 6), (_llama4, 6), (_deepseek, 6)],
    ids=["llama4", "deepseek_v3", "llama_token_budget", "llama4_token_budget",
         "deepseek_v3_token_budget"])
def test_port_served_with_paged_caches_gives_its_full_pass_greedy_tokens(build, budget):
    """Without a budget (prefill calls, then decode steps) and with one: packed ragged steps
    for Llama, padded [slots, chunk] steps for the ports whose layers refuse a traced
    ragged step (Llama 4's temperature-tuned NoPE has its own transform_qk; DeepSeek-V3's
    latent attention up-projects the cache's latents)."""
    model = build()
    want = _full_pass_greedy(model, PROMPTS, NEW_TOKENS)
    engine = ServingEngine(ModuleDecoder(model), num_slots=2, num_pages=8, page_size=4,
                           max_len=12, prefill_chunk=4, max_num_batched_tokens=budget)
    done, _ = engine.run([Request(list(p), max_new_tokens=NEW_TOKENS) for p in PROMPTS])
    got = {c.request.id: c.tokens for c in done}
    assert [got[i] for i in range(len(PROMPTS))] == want
    if budget is not None:
        assert engine.scheduler.packed == (build is _llama)


@pytest.mark.parametrize("build, reason", [
    (_llama4, r"TemperatureTunedNoPE has its own transform_qk"),
    (_deepseek, r"DeepSeek-V3's latent attention up-projects")], ids=["llama4", "deepseek_v3"])
def test_ports_the_ragged_step_cannot_run_say_why_they_run_padded_steps(build, reason):
    """A token budget for a port whose layers refuse a ragged step while it is traced runs
    padded steps, and the engine says why when it is built (ModuleDecoder.ragged_refusal
    traces one ragged token), with the layer's own reason."""
    engine = ServingEngine(ModuleDecoder(build()), num_slots=1, num_pages=4, page_size=4,
                           max_len=8, max_num_batched_tokens=4)
    assert not engine.scheduler.packed
    assert re.search(reason, engine.scheduler.padded_because)


def test_llama4_port_on_a_streaming_cache_equals_its_full_pass_before_eviction():
    """StreamingLLM caches (``init_cache(..., keep_first=2)``) rotate the RoPE layer's keys
    on load, which takes the half layout (the port holds its q/k features permuted from
    Llama 4's interleaved layout). While nothing is evicted (12 slots, 8 tokens) two calls
    of 4 tokens give the logits of the full pass over all 8 (NoPE temperature included:
    the cache's positions are the slots)."""
    model = _llama4()
    graphdef, state = nnx.split(model)
    run = jax.jit(lambda s, ids, cache: nnx.merge(graphdef, s)(ids, cache=cache))
    ids = jnp.asarray([[5, 11, 19, 2, 7, 3, 30, 9]], jnp.int32)
    want, _ = run(state, ids, None)
    cache = model.init_cache(1, 12, keep_first=2)
    steps = []
    for a, b in ((0, 4), (4, 8)):  # one compiled shape
        step, cache = run(state, ids[:, a:b], cache)
        steps.append(step)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), want, atol=2e-5, rtol=0)
