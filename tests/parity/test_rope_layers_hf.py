"""Interleaved M-RoPE (Qwen3-VL), per-layer RoPE (Gemma 3) and Llama 4's iRoPE pieces,
checked against Hugging Face transformers' own rotary modules (CPU PyTorch, float32) and
against float64 NumPy written from HF's formulas.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

import jaxpos
import jaxpos.hf
from jaxpos.schemes import irope
from jaxpos.schemes import rope as R

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytestmark = pytest.mark.parity


def _qwen3_vl_text_config(section=(24, 20, 20), head_dim=128, **rope):
    params = {"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": list(section),
              "mrope_interleaved": True, **rope}
    return transformers.Qwen3VLTextConfig(hidden_size=2 * head_dim, num_attention_heads=2,
                                          num_key_value_heads=1, head_dim=head_dim,
                                          rope_parameters=params)


def _hf_qwen3_vl_rotate(cfg, x, pos3):
    """HF's Qwen3-VL text rotary + apply_rotary_pos_emb on ``x`` ``[B, T, N, H]``."""
    from transformers.models.qwen3_vl import modeling_qwen3_vl as m

    rot = m.Qwen3VLTextRotaryEmbedding(cfg)
    xt = torch.tensor(np.asarray(x)).transpose(1, 2)  # [B, N, T, H]
    with torch.no_grad():
        cos, sin = rot(xt, torch.tensor(np.asarray(pos3)))
        out, _ = m.apply_rotary_pos_emb(xt, xt, cos, sin)
    return out.transpose(1, 2).numpy()


def _vision_like_positions(rs, B, T):
    """Rows (temporal, height, width) that differ, as for image tokens: a 2 x 4 x 5 grid
    after some text, then text again (all three rows equal)."""
    pos = np.zeros((3, B, T), np.int64)
    for b in range(B):
        start = rs.randint(0, 20)
        t = np.arange(T) + start
        pos[:, b] = t
        grid = np.stack(np.meshgrid(np.arange(2), np.arange(4), np.arange(5), indexing="ij"))
        grid = grid.reshape(3, -1)[:, : T - 6] + start + 3
        pos[:, b, 3:3 + grid.shape[1]] = grid
    return pos


def test_interleaved_mrope_matches_hf_qwen3_vl():
    """Qwen3-VL-8B's rotary (head_dim 128, sections [24, 20, 20], theta 5e6) on positions
    whose three rows differ: ours equals HF's to float32 rounding; contiguous sections
    (Qwen2-VL's layout) with the same positions miss by far more."""
    cfg = _qwen3_vl_text_config()
    rs = np.random.RandomState(0)
    B, T, N, H = 2, 30, 2, 128
    x = rs.standard_normal((B, T, N, H)).astype(np.float32)
    pos3 = _vision_like_positions(rs, B, T)
    ref = _hf_qwen3_vl_rotate(cfg, x, pos3)
    s = jaxpos.hf.hf_rope_settings(cfg)
    assert s["mrope_section"] == (24, 20, 20) and s["mrope_interleaved"] is True
    inv_freq, _ = jaxpos.rope_frequencies(s["rotary_dim"], s["base"])
    ours = R.apply_mrope(jnp.asarray(x), jnp.asarray(pos3, jnp.int32), inv_freq,
                         mrope_section=s["mrope_section"], mrope_interleaved=True,
                         angle_precision="float32")
    assert np.abs(np.asarray(ours) - ref).max() <= 2e-5
    high = R.apply_mrope(jnp.asarray(x), jnp.asarray(pos3, jnp.int32), inv_freq,
                         mrope_section=s["mrope_section"], mrope_interleaved=True)
    assert np.abs(np.asarray(high) - ref).max() <= 1e-4
    contiguous = R.apply_mrope(jnp.asarray(x), jnp.asarray(pos3, jnp.int32), inv_freq,
                               mrope_section=s["mrope_section"], angle_precision="float32")
    assert np.abs(np.asarray(contiguous) - ref).max() > 1e-2
    # Text only (three equal rows): every layout is plain RoPE.
    text = np.broadcast_to(np.arange(T)[None, None], (3, B, T))
    plain = jaxpos.apply_rope(jnp.asarray(x), jnp.arange(T), inv_freq, angle_precision="float32")
    np.testing.assert_allclose(_hf_qwen3_vl_rotate(cfg, x, text), np.asarray(plain), atol=2e-5)


def test_mrope_frequency_axes_follow_hf_recomposition():
    """The row of each frequency, read off HF's recomposition by feeding it row indices."""
    from transformers.models.qwen3_vl import modeling_qwen3_vl as m

    for section, head_dim in (((24, 20, 20), 128), ((6, 5, 5), 32), ((3, 3, 2), 16)):
        rot = m.Qwen3VLTextRotaryEmbedding(_qwen3_vl_text_config(section, head_dim))
        rows = torch.arange(3, dtype=torch.float32)[:, None, None, None].expand(
            3, 1, 1, head_dim // 2).clone()
        hf_axes = rot.recomposition_frequencies(rows)[0, 0, : head_dim // 2].numpy()
        axes = R.mrope_frequency_axes(section, head_dim // 2, mrope_interleaved=True)
        np.testing.assert_array_equal(axes, hf_axes.astype(np.int32))
        assert [int((axes == r).sum()) for r in range(3)] == list(section)
    np.testing.assert_array_equal(R.mrope_frequency_axes((1, 2, 1), 4), [0, 1, 1, 2])


def test_rope_from_hf_config_reads_qwen3_vl():
    """A whole Qwen3VLConfig (text_config inside) and its config.json dict both read as
    interleaved M-RoPE; Qwen2-VL's ``"mrope"`` type stays contiguous."""
    text = dict(hidden_size=256, num_attention_heads=2, head_dim=128,
                rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                 "mrope_section": [24, 20, 20], "mrope_interleaved": True})
    full = transformers.Qwen3VLConfig(text_config=text)
    for cfg in (full, full.to_dict()):
        s = jaxpos.hf.hf_rope_settings(cfg)
        assert (s["mrope_section"], s["mrope_interleaved"], s["base"]) == ((24, 20, 20), True, 5e6)
    # HF's Qwen3-VL interleaves whether or not the flag is written; we do too.
    no_flag = {"model_type": "qwen3_vl_text", "head_dim": 128,
               "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20]}}
    assert jaxpos.hf.hf_rope_settings(no_flag)["mrope_interleaved"] is True
    qwen2 = {"model_type": "qwen2_vl", "head_dim": 128,
             "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}
    assert jaxpos.hf.hf_rope_settings(qwen2)["mrope_interleaved"] is False
    assert jaxpos.hf.hf_rope_settings({"head_dim": 64})["mrope_interleaved"] is False


def test_rope_scheme_rotates_interleaved_mrope():
    """``rope_from_hf_config(qwen3_vl).rotate(x, positions [3, B, T])`` equals HF; text
    positions rotate as plain RoPE either way."""

    cfg = _qwen3_vl_text_config((6, 5, 5), 32)
    scheme = jaxpos.hf.rope_from_hf_config(cfg, angle_precision="float32")
    rs = np.random.RandomState(1)
    x = rs.standard_normal((2, 30, 2, 32)).astype(np.float32)
    text = np.broadcast_to(np.arange(30)[None, None], (3, 2, 30))
    ours = scheme.rotate(jnp.asarray(x), jnp.arange(30, dtype=jnp.int32))
    assert np.abs(np.asarray(ours) - _hf_qwen3_vl_rotate(cfg, x, text)).max() <= 2e-5
    pos3 = _vision_like_positions(rs, 2, 30)
    ours = scheme.rotate(jnp.asarray(x), jnp.asarray(pos3, jnp.int32))
    assert np.abs(np.asarray(ours) - _hf_qwen3_vl_rotate(cfg, x, pos3)).max() <= 2e-5


# ---------------------------------------------------------------------- Gemma 3
def _gemma3_config(**kw):
    args = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                 "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                    "rope_theta": 1e6}})
    args.update(kw)
    return transformers.Gemma3TextConfig(**args)


def test_per_layer_rope_matches_hf_gemma3():
    """Gemma 3 (sliding_window_pattern 6): five local layers at base 1e4, one global layer
    at base 1e6 with linear factor 8; each layer's inv_freq equals HF's buffer for its
    layer type, and the transformers-v4 config.json form reads the same."""
    from transformers.models.gemma3 import modeling_gemma3 as m

    cfg = _gemma3_config()
    assert cfg.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    rot = m.Gemma3RotaryEmbedding(cfg)
    schemes = jaxpos.hf.rope_per_layer_from_hf_config(cfg)
    assert jaxpos.hf.hf_layer_types(cfg) == cfg.layer_types
    for scheme, t in zip(schemes, cfg.layer_types):
        np.testing.assert_array_equal(np.asarray(scheme.inv_freq),
                                      getattr(rot, f"{t}_inv_freq").numpy())
        assert scheme.attention_factor == getattr(rot, f"{t}_attention_scaling")
    local, glob = schemes[0], schemes[5]
    assert (local.base, glob.base) == (1e4, 1e6)
    assert np.abs(np.asarray(local.inv_freq) - np.asarray(glob.inv_freq)).max() > 1e-2
    v4 = {"model_type": "gemma3_text", "num_hidden_layers": 6, "head_dim": 16,
          "hidden_size": 64, "num_attention_heads": 4, "sliding_window_pattern": 6,
          "rope_theta": 1e6, "rope_local_base_freq": 1e4,
          "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    for a, b in zip(jaxpos.hf.rope_per_layer_from_hf_config(v4), schemes):
        np.testing.assert_array_equal(np.asarray(a.inv_freq), np.asarray(b.inv_freq))
    assert jaxpos.hf.hf_layer_types(v4) == cfg.layer_types


def test_layer_types_derived_like_hf():
    """Configs without ``layer_types`` get HF's defaults (Gemma 2 alternates; Qwen3 slides
    from max_window_layers on; Llama 4 chunks its RoPE layers)."""
    assert jaxpos.hf.hf_layer_types({"model_type": "gemma2", "num_hidden_layers": 4}) == \
        ["sliding_attention", "full_attention"] * 2
    q = transformers.Qwen3Config(num_hidden_layers=4, use_sliding_window=True,
                                 max_window_layers=2, sliding_window=8)
    assert jaxpos.hf.hf_layer_types(q) == q.layer_types == \
        ["full_attention"] * 2 + ["sliding_attention"] * 2
    q_dict = {k: v for k, v in q.to_dict().items() if k != "layer_types"}
    assert jaxpos.hf.hf_layer_types(q_dict) == q.layer_types
    ll = transformers.Llama4TextConfig(num_hidden_layers=8, attention_chunk_size=16)
    ll_dict = {k: v for k, v in ll.to_dict().items() if k not in ("layer_types", "no_rope_layers")}
    assert jaxpos.hf.hf_layer_types(ll_dict) == ll.layer_types
    assert jaxpos.hf.hf_layer_types({"num_hidden_layers": 3}) == ["full_attention"] * 3


# ---------------------------------------------------------------------- Llama 4
def _llama4_config(**kw):
    args = dict(vocab_size=64, hidden_size=64, intermediate_size=32, intermediate_size_mlp=64,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_local_experts=2, no_rope_layer_interval=2, attention_chunk_size=4,
                floor_scale=4, attn_scale=0.5,
                rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 16.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192})
    args.update(kw)
    return transformers.Llama4TextConfig(**args)


# Llama 4 Scout / Maverick ship low_freq_factor == high_freq_factor == 1 (no smoothing
# band: wavelengths above 8192 divided by 16, the rest kept); HF only warns about it.
SCOUT_ROPE = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 16.0, "low_freq_factor": 1.0,
              "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}


def test_llama4_scout_rope_scaling_matches_hf():
    from transformers.models.llama4 import modeling_llama4 as m

    cfg = _llama4_config(rope_parameters=dict(SCOUT_ROPE))
    rot = m.Llama4TextRotaryEmbedding(cfg)
    scheme = jaxpos.hf.rope_from_hf_config(cfg)
    np.testing.assert_allclose(np.asarray(scheme.inv_freq), rot.inv_freq.numpy(), rtol=3e-7)


def test_llama4_irope_layers_from_hf_config():
    """NoPE every second layer (HF's no_rope_layers [1, 0, 1, 0]), temperature tuning on
    those, RoPE with Llama 3 scaling in the interleaved (complex-pair) layout elsewhere."""
    cfg = _llama4_config()
    assert cfg.no_rope_layers == irope.no_rope_layers(4, 2) == [1, 0, 1, 0]
    schemes = jaxpos.hf.rope_per_layer_from_hf_config(cfg)
    assert [type(s).__name__ for s in schemes] == ["RoPE", "TemperatureTunedNoPE"] * 2
    assert (schemes[1].attn_scale, schemes[1].floor_scale) == (0.5, 4.0)
    assert schemes[0].layout == "interleaved"
    assert isinstance(schemes[0].scaling, jaxpos.Llama3Scaling)
    assert jaxpos.hf.hf_layer_types(cfg) == ["chunked_attention", "full_attention"] * 2
    off = jaxpos.hf.rope_per_layer_from_hf_config(
        _llama4_config(attn_temperature_tuning=False))
    assert type(off[1]).__name__ == "NoPE"


def test_llama4_rotary_matches_hf():
    """HF's Llama4TextRotaryEmbedding + apply_rotary_emb (complex pairs) equals our RoPE
    from the config; the "half" layout of Llama 1-3 misses."""
    from transformers.models.llama4 import modeling_llama4 as m

    cfg = _llama4_config()
    rs = np.random.RandomState(2)
    B, T, N, H = 2, 12, 4, 16
    x = rs.standard_normal((B, T, N, H)).astype(np.float32)
    pos = np.stack([np.arange(T) + 5, np.arange(T) + 900])
    rot = m.Llama4TextRotaryEmbedding(cfg)
    with torch.no_grad():
        freqs = rot(torch.tensor(x), torch.tensor(pos))
        ref, _ = m.apply_rotary_emb(torch.tensor(x), torch.tensor(x), freqs)
    scheme = jaxpos.hf.rope_from_hf_config(cfg, angle_precision="float32")
    # PyTorch's pow may round one entry differently (one float32 ulp; see jaxpos.schemes.rope).
    np.testing.assert_allclose(np.asarray(scheme.inv_freq), rot.inv_freq.numpy(), rtol=3e-7)
    ours = scheme.rotate(jnp.asarray(x), jnp.asarray(pos, jnp.int32))
    assert np.abs(np.asarray(ours) - ref.numpy()).max() <= 2e-5
    half = jaxpos.RoPE(scheme.inv_freq, layout="half", angle_precision="float32")
    assert np.abs(np.asarray(half.rotate(jnp.asarray(x), jnp.asarray(pos, jnp.int32)))
                  - ref.numpy()).max() > 1e-2


def test_attention_temperature_is_hf_formula():
    """``1 + attn_scale * log(floor((pos + 1) / floor_scale) + 1)`` in float64 from HF's
    Llama4TextAttention; 1 below floor_scale - 1, then a step at every multiple."""
    pos = np.array([0, 1, 8190, 8191, 8192, 16383, 10 ** 6, 2 ** 31 - 2])
    ref = 1.0 + 0.1 * np.log(np.floor((pos + 1.0) / 8192.0) + 1.0)
    ours = np.asarray(irope.attention_temperature(jnp.asarray(pos, jnp.int32)))
    np.testing.assert_allclose(ours, ref, rtol=1e-6)
    assert ours.dtype == np.float32 and ours[2] == 1.0 and ours[3] > 1.0
    small = np.asarray(irope.attention_temperature(np.arange(10), attn_scale=0.5, floor_scale=4))
    np.testing.assert_allclose(small, 1 + 0.5 * np.log(np.floor((np.arange(10) + 1) / 4) + 1),
                               rtol=1e-6)


def test_temperature_tuned_nope_scales_queries_only():
    """Through jaxpos.attention: the scheme equals NoPE with the queries pre-multiplied by
    the temperature at their positions (a float64 NumPy reference), in every implementation."""
    rs = np.random.RandomState(3)
    B, T, N, H = 2, 9, 2, 8
    q, k, v = (rs.standard_normal((B, T, N, H)).astype(np.float32) for _ in range(3))
    pos = np.stack([np.arange(T), np.arange(T) + 20])
    scheme = irope.TemperatureTunedNoPE(attn_scale=0.5, floor_scale=4)
    temp = 1 + 0.5 * np.log(np.floor((pos + 1) / 4) + 1)  # [B, T]
    qs = q.astype(np.float64) * temp[:, :, None, None]
    s = np.einsum("bqnh,bknh->bnqk", qs, k.astype(np.float64)) / np.sqrt(H)
    s = np.where(pos[:, None, None, :] <= pos[:, None, :, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = np.einsum("bnqk,bknh->bqnh", p / p.sum(-1, keepdims=True), v.astype(np.float64))
    for impl in ("reference", "chunked"):
        out = jaxpos.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), position=scheme,
                               q_positions=jnp.asarray(pos, jnp.int32),
                               kv_positions=jnp.asarray(pos, jnp.int32), causal=True,
                               implementation=impl, block_q=4, block_k=4)
        assert np.abs(np.asarray(out) - ref).max() <= 1e-5, impl
    plain = jaxpos.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), position=None,
                             q_positions=jnp.asarray(pos, jnp.int32),
                             kv_positions=jnp.asarray(pos, jnp.int32), causal=True,
                             implementation="reference")
    assert np.abs(np.asarray(plain) - ref).max() > 1e-2


# ------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("call, err, words", [
    (lambda: R.mrope_frequency_axes((2, 3, 2), 8, mrope_interleaved=True), ValueError,
     ("mrope_section", "rotary_dim // 2 = 8", "(2, 3, 2)")),
    (lambda: R.mrope_frequency_axes((0, 4, 4), 8, mrope_interleaved=True), ValueError,
     ("mrope_section", "cannot be interleaved", "height")),
    (lambda: R.mrope_frequency_axes((2, 3, 3), 8, mrope_interleaved="yes"), TypeError,
     ("mrope_interleaved", "bool")),
    (lambda: R.apply_mrope(jnp.ones((1, 2, 1, 16)), np.zeros((3, 1, 2), np.int32),
                           jnp.ones(8), mrope_section=(2, 2, 2), mrope_interleaved=True),
     ValueError, ("mrope_section", "rotary_dim // 2 = 8")),
    (lambda: jaxpos.hf.hf_layer_types({"num_hidden_layers": 2,
                                       "layer_types": ["full_attention", "linear_attention"]}),
     ValueError, ("layer_types[1]", "linear_attention", "sliding_attention")),
    (lambda: jaxpos.hf.hf_layer_types({"num_hidden_layers": 3,
                                               "layer_types": ["full_attention"]}),
     ValueError, ("layer_types has 1", "num_hidden_layers is 3")),
    (lambda: jaxpos.hf.hf_layer_types({"head_dim": 8}), ValueError,
     ("layer_types or num_hidden_layers",)),
    (lambda: jaxpos.hf.rope_per_layer_from_hf_config(
        {"num_hidden_layers": 2, "head_dim": 8, "rope_parameters": {
            "sliding_attention": {"rope_type": "default"},
            "full_attention": {"rope_type": "warp", "rope_theta": 1e6}},
         "layer_types": ["sliding_attention", "full_attention"]}),
     ValueError, ("rope_type", "warp")),
    (lambda: jaxpos.hf.rope_per_layer_from_hf_config(
        {"num_hidden_layers": 2, "head_dim": 8, "rope_parameters": {
            "full_attention": {"rope_type": "default"}},
         "layer_types": ["sliding_attention", "full_attention"]}),
     ValueError, ("layer_type", "sliding_attention")),
    (lambda: jaxpos.hf.rope_per_layer_from_hf_config(
        {"model_type": "llama4_text", "num_hidden_layers": 2, "head_dim": 8,
         "no_rope_layers": [1, 0, 1]}), ValueError, ("no_rope_layers", "2 entries")),
    (lambda: irope.no_rope_layers(4, 0), ValueError, ("no_rope_layer_interval",)),
    (lambda: irope.attention_temperature(jnp.arange(3.0)), TypeError, ("positions", "float32")),
    (lambda: irope.attention_temperature(jnp.arange(3), floor_scale=0), ValueError,
     ("floor_scale",)),
    (lambda: irope.TemperatureTunedNoPE(attn_scale="big"), TypeError, ("attn_scale",)),
])
def test_bad_input(call, err, words):
    with pytest.raises(err) as e:
        call()
    for w in words:
        assert w in str(e.value), (w, str(e.value))
