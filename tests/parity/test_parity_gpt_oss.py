"""GPT-OSS on jaxpos reproduces Hugging Face's ``GptOssForCausalLM``: attention sinks, a
sliding window on alternate layers, YaRN with ``truncate=False``, mixture of experts.

A tiny HF model (2 layers: one ``"sliding_attention"`` with a window of 4 tokens, one
``"full_attention"``; 4 query and 2 key/value heads; 4 experts, 2 per token) is built from a
config on CPU in float32, every weight redrawn (``N(0, 0.15^2)``: the clamped-SwiGLU
experts stay O(1), so float32 rounding stays ~1e-5; sinks ``N(0, 1)`` so they matter),
converted with ``examples.models.gpt_oss.from_hf`` and run on left-padded prompts of up to
14 tokens, well past the window. The reference numbers are HF's logits; the bound is a max
abs difference of 1e-4 for every implementation, for the full pass and for KV-cache
decoding (against HF's own cached generation, whose sliding layers drop old keys).
Negative controls: without sinks, or with the window one token off, the logits miss HF's
by far more than 1e-2.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxpos

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

from examples.models import common, gpt_oss  # noqa: E402

pytestmark = pytest.mark.parity

VOCAB, WINDOW = 128, 4
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 256}


def _config(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                max_position_embeddings=32 * 256, rope_parameters=dict(YARN),
                attn_implementation="eager")
    base.update(kw)
    return transformers.GptOssConfig(**base)


@pytest.fixture(scope="module")
def pair():
    cfg = _config()
    assert cfg.layer_types == ["sliding_attention", "full_attention"]
    torch.manual_seed(0)
    hf = randomize(transformers.GptOssForCausalLM(cfg), seed=1, std=0.15)
    return hf, gpt_oss.from_hf(hf.state_dict(), cfg), cfg


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


def test_yarn_frequencies_with_truncate_false_equal_hf(pair):
    """GPT-OSS's YaRN has ``truncate=False`` (ramp bounds not floored/ceiled): jaxpos's
    inv_freq and attention factor equal HF's rotary buffers; with ``truncate=True`` the
    frequencies would differ."""
    hf, model, _ = pair
    rope = gpt_oss.rope_from_config(model.config)
    assert rope.layout == "half" and rope.scaling.truncate is False
    np.testing.assert_allclose(np.asarray(rope.inv_freq), hf.model.rotary_emb.inv_freq.numpy(),
                               rtol=1e-6, atol=0)
    assert rope.attention_factor == pytest.approx(hf.model.rotary_emb.attention_scaling, rel=1e-12)
    assert rope.attention_factor == pytest.approx(0.1 * np.log(32.0) + 1)  # Peng et al. §3.4
    yarn = {k: v for k, v in YARN.items() if k not in ("rope_type", "rope_theta")}
    truncated = jaxpos.RoPE(rotary_dim=16, base=150000.0, layout="half",
                            scaling=jaxpos.YaRNScaling(**{**yarn, "truncate": True}))
    assert np.abs(np.asarray(truncated.inv_freq) - np.asarray(rope.inv_freq)).max() > 1e-4


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_logits_left_padded(pair, batch, implementation):
    _, model, _ = pair
    ids, mask, _, ref = batch
    logits, _ = jit(model)(jnp.asarray(ids), attention_mask=jnp.asarray(mask),
                           implementation=implementation, **BLOCKS)
    assert max_diff(logits, ref, mask) <= TOL


@pytest.mark.parametrize("implementation", DECODE_IMPLEMENTATIONS)
def test_kv_cache_decoding_equals_hf_generation(pair, batch, implementation):
    """Prefill 10 left-padded tokens (past the window of 4), then one token per call: every
    step equals HF's own cached decoding (its sliding layer keeps only the last keys; ours
    keeps all and masks them) and our full pass."""
    hf, model, _ = pair
    ids, mask, prompt_len, ref = batch
    hf_first, hf_steps = hf_cached_generation(hf, ids, mask, prompt_len)
    first, steps, cache = decode(model, ids, mask, prompt_len, implementation=implementation,
                                 **BLOCKS)
    real = mask[:, :prompt_len]
    assert max_diff(first, hf_first, real) <= TOL
    assert max_diff(first, ref[:, :prompt_len], real) <= TOL
    for i, t in enumerate(range(prompt_len, ids.shape[1])):
        assert max_diff(steps[i], hf_steps[i]) <= TOL, t
        assert max_diff(steps[i], ref[:, t]) <= TOL, t
    for layer_cache in cache:  # tokens held per row, padding excluded
        np.testing.assert_array_equal(np.asarray(layer_cache.token_count())[:, 0],
                                      mask.sum(-1))


def test_sliding_layers_skip_tiles(pair, batch):
    """The sliding layers' block mask (4 x 4 tiles, 14 tokens, window 4) leaves tiles
    outside the band empty, which the chunked and Pallas paths skip."""
    _, model, _ = pair
    ids, mask, _, _ = batch
    pos = common.padding_positions(jnp.asarray(mask))
    masks = model.layer_masks(pos, pos, implementation="chunked", **BLOCKS)
    assert masks["full_attention"] == BLOCKS
    bm = masks["sliding_attention"]["block_mask"]
    assert bm.sparsity() > 0.1  # the band alone; causality empties the upper tiles too
    kinds = np.asarray(bm.kinds)[2, 0]  # row 2: 14 real tokens, positions 0..13
    assert kinds[3, 0] == jaxpos.mods.EMPTY and kinds[3, 1] == jaxpos.mods.EMPTY
    assert kinds[3, 2] == jaxpos.mods.PARTIAL and kinds[3, 3] != jaxpos.mods.EMPTY


def test_controls_without_sinks_or_window_off_by_one(pair, batch):
    """Negative controls: dropping the sinks, or a window one token wider or narrower,
    misses HF by far more than the tolerance (while the right settings match it)."""
    _, model, _ = pair
    ids, mask, _, ref = batch
    run = jit(model)
    kw = dict(attention_mask=jnp.asarray(mask), implementation="reference")
    ok, _ = run(jnp.asarray(ids), **kw)
    assert max_diff(ok, ref, mask) <= TOL
    no_sinks, _ = run(jnp.asarray(ids), use_sinks=False, **kw)
    assert max_diff(no_sinks, ref, mask) > MISS
    # One token too many: ``kv_pos >= q_pos - window`` instead of HF's ``>`` (the narrower
    # window, WINDOW - 1, misses too: test_controls_window_one_narrower, slow).
    wrong, _ = run(jnp.asarray(ids), sliding_window=WINDOW + 1, **kw)
    assert max_diff(wrong, ref, mask) > MISS


@pytest.mark.slow
def test_controls_window_one_narrower(pair, batch):
    _, model, _ = pair
    ids, mask, _, ref = batch
    wrong, _ = jit(model)(jnp.asarray(ids), attention_mask=jnp.asarray(mask),
                          implementation="reference", sliding_window=WINDOW - 1)
    assert max_diff(wrong, ref, mask) > MISS


@pytest.mark.slow
def test_far_positions_use_yarn(pair):
    """At positions 3000-3011 (past original_max_position_embeddings=256) ours match HF;
    plain RoPE with the same base (no YaRN) misses."""
    hf, model, _ = pair
    ids = np.random.RandomState(3).randint(0, VOCAB, (1, 12))
    pos = 3000 + np.arange(12)[None]
    with torch.no_grad():
        ref = hf(torch.tensor(ids), position_ids=torch.tensor(pos)).logits.numpy()
    ours, _ = jit(model)(jnp.asarray(ids), positions=jnp.asarray(pos, jnp.int32),
                         implementation="reference")
    assert max_diff(ours, ref) <= TOL
    plain = jaxpos.RoPE(rotary_dim=16, base=150000.0, layout="half", angle_precision="float32")
    wrong, _ = jit(model)(jnp.asarray(ids), positions=jnp.asarray(pos, jnp.int32), rope=plain,
                          implementation="reference")
    assert max_diff(wrong, ref) > MISS


def test_router_choices_are_not_near_ties(pair, batch):
    """The expert choice is discontinuous: the test inputs keep every token's k-th and
    (k+1)-th router logits apart, so float32 rounding cannot flip an expert."""
    hf, _, _ = pair
    ids, mask, _, _ = batch
    gaps = []

    def hook(module, args, out):
        logits = out[0]
        top = torch.topk(logits, module.top_k + 1, dim=-1).values
        gaps.append(float((top[:, -2] - top[:, -1]).min()))

    handles = [layer.mlp.router.register_forward_hook(hook) for layer in hf.model.layers]
    try:
        with torch.no_grad():
            hf(torch.tensor(ids), attention_mask=torch.tensor(mask),
               position_ids=torch.tensor(hf_positions(mask)))
    finally:
        for h in handles:
            h.remove()
    assert min(gaps) > 1e-3


def test_bad_input():
    """A window <= 0, an unknown layer type, a layer count that does not match, an unknown
    rope_type: a ValueError naming the field (HF's own config validation may refuse some of
    these first; ours checks them again, for configs read from JSON)."""
    with pytest.raises(ValueError, match="sliding_window"):
        common.SlidingWindowMask(0)
    with pytest.raises(ValueError, match="sliding_window"):
        common.SlidingWindowMask(-3)
    with pytest.raises(TypeError, match="sliding_window"):
        common.SlidingWindowMask(2.5)
    good = gpt_oss.GptOssConfig.from_hf(_config())
    with pytest.raises(ValueError, match=r"layer_types\[1\].*'chunked_attention'"):
        dataclasses.replace(good, layer_types=("sliding_attention", "chunked_attention"))
    with pytest.raises(ValueError, match="sliding_window"):
        dataclasses.replace(good, sliding_window=0)
    with pytest.raises(ValueError, match="layer_types must name 2 layers"):
        dataclasses.replace(good, layer_types=("full_attention",))
    bad = dataclasses.replace(good, rope_parameters={"rope_type": "nonsense", "rope_theta": 1e4})
    with pytest.raises(ValueError, match="rope_type.*'nonsense'"):
        gpt_oss.GptOssForCausalLM(bad, rngs=nnx.Rngs(0))


def test_converter_rejects_wrong_sinks(pair):
    hf, _, cfg = pair
    sd = dict(hf.state_dict())
    sd["model.layers.0.self_attn.sinks"] = sd["model.layers.0.self_attn.sinks"][:3]
    with pytest.raises(ValueError, match=r"sinks.*shape \(3,\).*\(4,\)"):
        gpt_oss.from_hf(sd, cfg)
    sd = dict(hf.state_dict())
    del sd["model.layers.1.mlp.experts.down_proj_bias"]
    with pytest.raises(ValueError, match="down_proj_bias"):
        gpt_oss.from_hf(sd, cfg)


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["reference", "chunked"])
def test_sink_gradients_equal_hf_autograd(pair, batch, implementation):
    """The gradient of a weighted sum of the logits with respect to each layer's sinks (and
    the query projection) equals PyTorch's autograd through HF's model."""
    hf, model, _ = pair
    ids, mask, _, _ = batch
    w = np.random.RandomState(4).standard_normal((*ids.shape, VOCAB)) * mask[..., None]
    hf.zero_grad()
    out = hf(torch.tensor(ids), attention_mask=torch.tensor(mask),
             position_ids=torch.tensor(hf_positions(mask))).logits
    (out * torch.tensor(w, dtype=out.dtype)).sum().backward()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        logits, _ = nnx.merge(graphdef, params, rest)(
            jnp.asarray(ids), attention_mask=jnp.asarray(mask), implementation=implementation,
            **BLOCKS)
        return jnp.sum(logits * jnp.asarray(w, jnp.float32))

    grads = jax.jit(jax.grad(loss))(params)
    for i, layer in enumerate(hf.model.layers):
        g = np.asarray(grads["layers"][i]["self_attn"]["sinks"][...])
        ref = layer.self_attn.sinks.grad.numpy()
        assert np.abs(ref).max() > 1e-2  # the sinks matter
        np.testing.assert_allclose(g, ref, atol=2e-4 * np.abs(ref).max(), rtol=0)
        gq = np.asarray(grads["layers"][i]["self_attn"]["q_proj"]["kernel"][...])
        ref_q = layer.self_attn.q_proj.weight.grad.numpy().T
        np.testing.assert_allclose(gq, ref_q, atol=2e-4 * np.abs(ref_q).max(), rtol=0)
