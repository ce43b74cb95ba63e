"""The Hugging Face config readers against transformers itself, family by family.

* Families whose ``rotate_half`` pairs features ``(2i, 2i + 1)`` (GLM, GLM-4, GLM-4V text,
  GLM-OCR text, Cohere, Cohere2, Cohere2-MoE, ERNIE 4.5, ERNIE 4.5 MoE, Helium, Moonshine,
  Moonshine-Streaming, BLT; each family's modeling file defines it as
  ``stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)``): ``rope_from_hf_config`` must
  read them as ``layout="interleaved"``; q and k rotated by the family's own rotary module
  and ``apply_rotary_pos_emb`` are the reference (float32, ``angle_precision="float32"``).
* ``no_rope_layers``: Llama 4's no-position layers scale their queries (attention
  temperature tuning); SmolLM3's do not (its attention applies RoPE or nothing).
"""

from __future__ import annotations

import importlib

import jax.numpy as jnp
import numpy as np
import pytest

import jaxpos
from jaxpos.hf import rope_from_hf_config, rope_per_layer_from_hf_config

pytestmark = pytest.mark.parity
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# (family module, config class, rotary class, head_dim, extra config keys)
INTERLEAVED = [
    ("glm", "GlmConfig", "GlmRotaryEmbedding", 32, {}),
    ("glm4", "Glm4Config", "Glm4RotaryEmbedding", 32, {}),
    ("glm4v", "Glm4vTextConfig", "Glm4vTextRotaryEmbedding", 32,
     {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                          "partial_rotary_factor": 0.5, "mrope_section": [2, 3, 3]}}),
    ("glm_ocr", "GlmOcrTextConfig", "GlmOcrTextRotaryEmbedding", 32,
     {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                          "partial_rotary_factor": 0.5, "mrope_section": [2, 3, 3]}}),
    ("cohere", "CohereConfig", "CohereRotaryEmbedding", 32, {}),
    ("cohere2", "Cohere2Config", "Cohere2RotaryEmbedding", 32, {}),
    ("cohere2_moe", "Cohere2MoeConfig", "Cohere2MoeRotaryEmbedding", 32, {}),
    ("ernie4_5", "Ernie4_5Config", "Ernie4_5RotaryEmbedding", 32, {}),
    ("ernie4_5_moe", "Ernie4_5_MoeConfig", "Ernie4_5_MoeRotaryEmbedding", 32, {}),
    ("helium", "HeliumConfig", "HeliumRotaryEmbedding", 32, {}),
    ("moonshine", "MoonshineConfig", "MoonshineRotaryEmbedding", 40, {}),
    ("moonshine_streaming", "MoonshineStreamingConfig", "MoonshineStreamingRotaryEmbedding", 40,
     {}),
    ("blt", "BltConfig", "BltRotaryEmbedding", 32, {}),
]


def _family(fam, cfg_cls, emb_cls, head_dim, extra):
    modeling = importlib.import_module(f"transformers.models.{fam}.modeling_{fam}")
    configuration = importlib.import_module(f"transformers.models.{fam}.configuration_{fam}")
    cfg = getattr(configuration, cfg_cls)(hidden_size=2 * head_dim, num_attention_heads=2,
                                          num_key_value_heads=2, head_dim=head_dim,
                                          num_hidden_layers=1, intermediate_size=64, **extra)
    return modeling, cfg, getattr(modeling, emb_cls)(config=cfg)


@pytest.mark.parametrize("fam,cfg_cls,emb_cls,head_dim,extra", INTERLEAVED,
                         ids=[f[0] for f in INTERLEAVED])
def test_interleaved_families_rotate_as_transformers(fam, cfg_cls, emb_cls, head_dim, extra):
    modeling, cfg, emb = _family(fam, cfg_cls, emb_cls, head_dim, extra)
    rng = np.random.default_rng(0)
    T, N = 6, 2
    q = rng.standard_normal((1, N, T, head_dim)).astype(np.float32)  # HF's [B, N, T, H]
    k = rng.standard_normal((1, N, T, head_dim)).astype(np.float32)
    pos = np.array([[0, 1, 7, 300, 4095, 20000]])
    cos, sin = emb(torch.tensor(q), torch.tensor(pos))
    hq, hk = modeling.apply_rotary_pos_emb(torch.tensor(q), torch.tensor(k), cos, sin)
    scheme = rope_from_hf_config(cfg, angle_precision="float32")
    assert scheme.layout == "interleaved"
    assert scheme.rotary_dim == cos.shape[-1]
    ours_q, ours_k = scheme.transform_qk(jnp.asarray(q.transpose(0, 2, 1, 3)),
                                         jnp.asarray(k.transpose(0, 2, 1, 3)),
                                         jnp.asarray(pos), jnp.asarray(pos))
    for ours, ref in ((ours_q, hq), (ours_k, hk)):
        np.testing.assert_allclose(np.asarray(ours), ref.numpy().transpose(0, 2, 1, 3),
                                   atol=2e-5, rtol=0)
    # control: the half layout (what the reader gave GLM-4 and Cohere2 before) is far off
    half = scheme.replace(layout="half")
    wrong = half.rotate(jnp.asarray(q.transpose(0, 2, 1, 3)), jnp.asarray(pos))
    assert np.abs(np.asarray(wrong) - hq.numpy().transpose(0, 2, 1, 3)).max() > 0.1


def test_glm4v_three_row_positions_rotate_as_transformers():
    """GLM-4V's text rotary with distinct temporal/height/width rows (M-RoPE sections over
    the frequencies, then interleaved pairs)."""
    modeling, cfg, emb = _family(*INTERLEAVED[2])
    rng = np.random.default_rng(1)
    T, N, H = 5, 2, 32
    q = rng.standard_normal((1, N, T, H)).astype(np.float32)
    pos = np.stack([np.arange(T), np.arange(T) * 3 + 1, np.arange(T)[::-1] * 2])[:, None]
    cos, sin = emb(torch.tensor(q), torch.tensor(pos))
    hq, _ = modeling.apply_rotary_pos_emb(torch.tensor(q), torch.tensor(q), cos, sin)
    scheme = rope_from_hf_config(cfg, angle_precision="float32")
    ours = scheme.rotate(jnp.asarray(q.transpose(0, 2, 1, 3)), jnp.asarray(pos))
    np.testing.assert_allclose(np.asarray(ours), hq.numpy().transpose(0, 2, 1, 3), atol=2e-5,
                               rtol=0)


def _no_position_layers(cfg):
    return [i for i, f in enumerate(cfg.no_rope_layers) if not f]


def test_smollm3_no_position_layers_are_not_temperature_scaled():
    """SmolLM3's attention applies RoPE where ``no_rope_layers[i]`` is 1 and nothing else:
    a no-position layer leaves its queries as they are at every position."""
    cfg = transformers.SmolLM3Config(hidden_size=64, num_attention_heads=2,
                                     num_key_value_heads=2, num_hidden_layers=8,
                                     intermediate_size=64)
    schemes = rope_per_layer_from_hf_config(cfg)
    nope = _no_position_layers(cfg)
    assert nope == [3, 7]
    q = jnp.asarray(np.random.default_rng(2).standard_normal((1, 3, 2, 32)), jnp.float32)
    pos = jnp.asarray([[8191, 20000, 10**6]])
    for i, s in enumerate(schemes):
        assert isinstance(s, jaxpos.NoPE) == (i in nope), (i, s)
        if i in nope:
            out, _ = s.transform_qk(q, q, pos, pos)
            np.testing.assert_array_equal(np.asarray(out), np.asarray(q))
    # the config.json form (no no_rope_layers key) defaults the flags as HF does
    d = {k: v for k, v in cfg.to_dict().items() if k != "no_rope_layers"}
    assert [isinstance(s, jaxpos.NoPE) for s in rope_per_layer_from_hf_config(d)] == \
        [i in nope for i in range(8)]


def test_llama4_no_position_layers_keep_temperature_tuning():
    """Llama 4's no-position layers scale queries by HF's ``attn_scales`` (its modeling
    file: ``log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1``)."""
    cfg = transformers.Llama4TextConfig(hidden_size=64, num_attention_heads=2,
                                        num_key_value_heads=2, head_dim=32, num_hidden_layers=4,
                                        intermediate_size=64, intermediate_size_mlp=64)
    schemes = rope_per_layer_from_hf_config(cfg)
    (i,) = _no_position_layers(cfg)
    q = jnp.ones((1, 2, 1, 32), jnp.float32)
    pos = np.array([[8190, 20000]])
    out, _ = schemes[i].transform_qk(q, q, jnp.asarray(pos), jnp.asarray(pos))
    expect = np.log1p(np.floor((pos + 1.0) / cfg.floor_scale)) * cfg.attn_scale + 1.0
    np.testing.assert_allclose(np.asarray(out)[0, :, 0, 0], expect[0], rtol=1e-6)
