"""DeepSeek-V3 on jaxpos reproduces Hugging Face's ``DeepseekV3ForCausalLM``: multi-head
latent attention with decoupled RoPE (interleaved, on the rope part of each head only, one
shared rope key), YaRN with ``mscale != mscale_all_dim`` (so both the cos/sin factor and
the softmax ``mscale**2`` differ from 1), ``v_head_dim`` different from the query/key width,
a dense first layer and a DeepSeekMoE layer (grouped top-k routing with a bias, shared
expert).

Tiny HF models are built from configs on CPU in float32 with every weight (and the
router's bias buffer) redrawn; the bound is a max abs logit difference of 1e-4 for every
implementation, for the full pass and for KV-cache decoding (our cache holds the latents
and unrotated rope keys; HF's own cached generation is the reference). Negative controls:
the rope part rotated in the "half" layout, or the softmax scale without ``mscale**2``,
miss HF by far more than 1e-2.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxpos
import jaxpos.hf
import jaxpos.schemes.mla

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _parity_common import (  # noqa: E402
    BLOCKS,
    DECODE_IMPLEMENTATIONS,
    IMPLEMENTATIONS,
    MISS,
    TOL,
    decode,
    hf_cached_generation,
    hf_positions,
    jit,
    left_padded_batch,
    max_diff,
    randomize,
)

from examples.models import deepseek_v3  # noqa: E402

pytestmark = pytest.mark.parity

VOCAB = 128
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32,
        "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 128}


def _config(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                n_shared_experts=1, n_routed_experts=8, n_group=2, topk_group=1,
                num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                kv_lora_rank=24, q_lora_rank=40, qk_rope_head_dim=8, qk_nope_head_dim=16,
                v_head_dim=12, max_position_embeddings=40 * 128, rope_parameters=dict(YARN),
                attn_implementation="eager")
    base.update(kw)
    return transformers.DeepseekV3Config(**base)


def _build(cfg, seed):
    torch.manual_seed(0)
    hf = randomize(transformers.DeepseekV3ForCausalLM(cfg), seed=seed,
                   buffers=("e_score_correction_bias",))
    return hf, deepseek_v3.from_hf(hf.state_dict(), cfg)


@pytest.fixture(scope="module")
def pair():
    cfg = _config()
    hf, model = _build(cfg, seed=1)
    assert isinstance(hf.model.layers[0].mlp, transformers.models.deepseek_v3.modeling_deepseek_v3
                      .DeepseekV3MLP)
    assert isinstance(hf.model.layers[1].mlp, transformers.models.deepseek_v3.modeling_deepseek_v3
                      .DeepseekV3MoE)
    return hf, model, cfg


@pytest.fixture(scope="module")
def batch(pair):
    """Prompts of 7, 3 and 10 tokens left-padded to 10, each followed by 4 more tokens."""
    hf, _, _ = pair
    prompt_len, steps = 10, 4
    ids, mask = left_padded_batch(np.random.RandomState(2), [7 + steps, 3 + steps, 10 + steps],
                                  prompt_len + steps, VOCAB)
    with torch.no_grad():
        ref = hf(torch.tensor(ids), attention_mask=torch.tensor(mask),
                 position_ids=torch.tensor(hf_positions(mask))).logits.numpy()
    return ids, mask, prompt_len, ref


def test_rope_and_softmax_scale_equal_hf(pair):
    """The rope part's frequencies and cos/sin factor equal HF's rotary buffers, and the
    softmax scale equals HF's ``DeepseekV3Attention.scaling``: ``24**-0.5 * mscale**2`` with
    ``mscale = 0.1 * 1.0 * ln 40 + 1`` (DeepSeek-V2's YaRN extension)."""
    hf, model, cfg = pair
    c = model.config
    rope = deepseek_v3.rope_from_config(c)
    assert rope.rotary_dim == 8 and rope.layout == "interleaved"
    np.testing.assert_allclose(np.asarray(rope.inv_freq), hf.model.rotary_emb.inv_freq.numpy(),
                               rtol=1e-6, atol=0)
    assert rope.attention_factor == pytest.approx(hf.model.rotary_emb.attention_scaling, rel=1e-12)
    assert rope.attention_factor == pytest.approx(
        (0.1 * 0.707 * math.log(40) + 1) / (0.1 * 1.0 * math.log(40) + 1), rel=1e-12)
    scale = deepseek_v3.softmax_scale(c)
    assert scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)
    assert scale == pytest.approx(24 ** -0.5 * (0.1 * math.log(40) + 1) ** 2, rel=1e-12)
    assert scale == pytest.approx(jaxpos.hf.softmax_scale_from_hf_config(cfg), rel=1e-12)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_logits_left_padded(pair, batch, implementation):
    _, model, _ = pair
    ids, mask, _, ref = batch
    logits, _ = jit(model)(jnp.asarray(ids), attention_mask=jnp.asarray(mask),
                           implementation=implementation, **BLOCKS)
    assert max_diff(logits, ref, mask) <= TOL


@pytest.mark.parametrize("implementation", DECODE_IMPLEMENTATIONS)
def test_latent_kv_cache_decoding_equals_hf_generation(pair, batch, implementation):
    """Prefill the left-padded prompts into the latent cache, then one token per call:
    every step equals HF's own cached decoding and our full pass."""
    hf, model, _ = pair
    ids, mask, prompt_len, ref = batch
    hf_first, hf_steps = hf_cached_generation(hf, ids, mask, prompt_len)
    first, steps, cache = decode(model, ids, mask, prompt_len, implementation=implementation,
                                 **BLOCKS)
    c = model.config
    # Each layer's library cache holds kv_lora_rank + qk_rope_head_dim = 24 + 8 numbers per
    # token: one KV head of 16 as its key and 16 as its value.
    assert len(cache) == c.num_hidden_layers
    assert all(lc.k.shape[-2:] == (1, 16) and lc.v.shape[-2:] == (1, 16) for lc in cache)
    assert 2 * deepseek_v3.latent_width(c) == c.kv_lora_rank + 8
    real = mask[:, :prompt_len]
    assert max_diff(first, hf_first, real) <= TOL
    assert max_diff(first, ref[:, :prompt_len], real) <= TOL
    for i, t in enumerate(range(prompt_len, ids.shape[1])):
        assert max_diff(steps[i], hf_steps[i]) <= TOL, t
        assert max_diff(steps[i], ref[:, t]) <= TOL, t


def test_controls_wrong_layout_or_missing_mscale(pair, batch):
    """Negative controls: the rope part rotated in the "half" layout (pairs ``(i, i + 4)``
    instead of DeepSeek's ``(2i, 2i + 1)``), or the softmax scale without YaRN's
    ``mscale**2``, miss HF by far more than the tolerance."""
    _, model, _ = pair
    ids, mask, _, ref = batch
    c = model.config
    kw = dict(attention_mask=jnp.asarray(mask), implementation="reference")
    half = deepseek_v3.rope_from_config(c, layout="half")
    wrong, _ = jit(model)(jnp.asarray(ids), rope=half, **kw)
    assert max_diff(wrong, ref, mask) > MISS
    wrong, _ = jit(model)(jnp.asarray(ids), scale=c.qk_head_dim ** -0.5, **kw)
    assert max_diff(wrong, ref, mask) > MISS


def test_router_choices_are_not_near_ties(pair, batch):
    """The test inputs keep every token's chosen groups and experts apart from the next
    best by more than float32 rounding, so no expert flips between HF and us."""
    hf, _, _ = pair
    ids, mask, _, _ = batch
    gaps = []

    def hook(module, args, out):
        E, G = module.num_experts, module.num_group
        choice = out[0].sigmoid() + module.e_score_correction_bias
        group_scores = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(-1)
        ranked = group_scores.sort(dim=-1, descending=True).values
        gaps.append(float((ranked[:, module.topk_group - 1] - ranked[:, module.topk_group]).min()))
        keep = group_scores.topk(module.topk_group, dim=-1).indices
        kept = torch.zeros_like(group_scores).scatter(1, keep, 1.0).bool()
        kept = kept.repeat_interleave(E // G, dim=-1)
        top = choice.masked_fill(~kept, -math.inf).topk(module.top_k + 1, dim=-1).values
        gaps.append(float((top[:, -2] - top[:, -1]).min()))

    h = hf.model.layers[1].mlp.gate.register_forward_hook(hook)
    try:
        with torch.no_grad():
            hf(torch.tensor(ids), attention_mask=torch.tensor(mask),
               position_ids=torch.tensor(hf_positions(mask)))
    finally:
        h.remove()
    assert min(gaps) > 1e-4


@pytest.mark.slow
def test_variant_no_q_lora_half_layout_biases_tied_head():
    """The other config branches: queries through one ``q_proj`` (``q_lora_rank=None``),
    ``rope_interleave=False`` (HF's ``rotate_half`` on the rope part), attention biases,
    a tied head, plain RoPE (softmax scale ``qk_head_dim**-0.5``), all-MoE layers."""
    cfg = _config(q_lora_rank=None, rope_interleave=False, attention_bias=True,
                  tie_word_embeddings=True, first_k_dense_replace=0,
                  rope_parameters={"rope_type": "default", "rope_theta": 50.0})
    hf, model = _build(cfg, seed=5)
    assert deepseek_v3.rope_from_config(model.config).layout == "half"
    ids, mask = left_padded_batch(np.random.RandomState(6), [9, 5], 9, VOCAB)
    with torch.no_grad():
        ref = hf(torch.tensor(ids), attention_mask=torch.tensor(mask),
                 position_ids=torch.tensor(hf_positions(mask))).logits.numpy()
    for impl in ("reference", "chunked"):
        ours, _ = jit(model)(jnp.asarray(ids), attention_mask=jnp.asarray(mask),
                             implementation=impl, **BLOCKS)
        assert max_diff(ours, ref, mask) <= TOL, impl
    wrong, _ = jit(model)(jnp.asarray(ids), attention_mask=jnp.asarray(mask),
                          implementation="reference",
                          rope=deepseek_v3.rope_from_config(model.config, layout="interleaved"))
    assert max_diff(wrong, ref, mask) > MISS


def test_bad_input(pair):
    hf, model, cfg = pair
    good = model.config
    with pytest.raises(ValueError, match="num_key_value_heads must equal"):
        deepseek_v3.DeepseekV3Config.from_hf(_config(num_key_value_heads=2))
    with pytest.raises(ValueError, match="n_group"):
        dataclasses.replace(good, n_group=3)
    with pytest.raises(ValueError, match="qk_rope_head_dim must be even"):
        dataclasses.replace(good, qk_rope_head_dim=7)
    bad = dataclasses.replace(good, rope_parameters={"rope_type": "nonsense"})
    with pytest.raises(ValueError, match="rope_type.*'nonsense'"):
        deepseek_v3.DeepseekV3ForCausalLM(bad, rngs=nnx.Rngs(0))
    sd = dict(hf.state_dict())
    del sd["model.layers.1.mlp.gate.e_score_correction_bias"]
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        deepseek_v3.from_hf(sd, cfg)
    sd = dict(hf.state_dict())
    key = "model.layers.0.self_attn.kv_b_proj.weight"
    sd[key] = sd[key][:, :20]
    with pytest.raises(ValueError, match=r"kv_b_proj.*\(20, 112\).*\(24, 112\)"):
        deepseek_v3.from_hf(sd, cfg)
