"""Gemma 4's per-layer-type RoPE read from Hugging Face configs equals transformers' own.

``Gemma4TextConfig`` gives its sliding layers default RoPE (base 1e4) over ``head_dim``
(256) and its full layers proportional RoPE (p-RoPE: ``partial_rotary_factor`` 0.25,
base 1e6) over ``global_head_dim`` (512), stored as transformers' ``per_layer_config``
overrides. The reference is ``Gemma4TextRotaryEmbedding`` (its ``<type>_inv_freq``
buffers and its cos/sin through ``apply_rotary_pos_emb``), CPU PyTorch, float32.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import jaxpos
import jaxpos.hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if getattr(transformers, "Gemma4TextConfig", None) is None:
    pytest.skip("this transformers has no Gemma 4", allow_module_level=True)
from transformers.models.gemma4 import modeling_gemma4 as m4  # noqa: E402

pytestmark = pytest.mark.parity

TYPES = ("sliding_attention", "full_attention")


def _ulp32(x):
    return np.spacing(np.abs(np.asarray(x, np.float32))).astype(np.float64)


def _tiny(**kw):
    """Six layers (five sliding, one full), sliding heads 32 wide, full heads 64 wide."""
    kw = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 6,
          "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
          "global_head_dim": 64, "hidden_size_per_layer_input": 0, **kw}
    return transformers.Gemma4TextConfig(**kw)


def _hf_inv_freq(cfg):
    emb = m4.Gemma4TextRotaryEmbedding(cfg)
    return {t: (getattr(emb, f"{t}_inv_freq").numpy(),
                float(getattr(emb, f"{t}_attention_scaling"))) for t in set(cfg.layer_types)}, emb


def _hub_dict(cfg, global_head_dim):
    """The config.json form released before ``per_layer_config``: ``global_head_dim`` at
    the top level."""
    d = json.loads(cfg.to_json_string())
    d.pop("per_layer_config")
    d["global_head_dim"] = global_head_dim
    return d


CONFIGS = {
    "default": lambda: transformers.Gemma4TextConfig(),
    "tiny": lambda: _tiny(),
    "tiny-partial-0.5-factor-2": lambda: _tiny(rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                           "factor": 2.0, "rope_theta": 500_000.0}}),
    "tiny-k-eq-v": lambda: _tiny(attention_k_eq_v=True, num_global_key_value_heads=2),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_inv_freq_of_every_layer_type_matches_hf(name):
    cfg = CONFIGS[name]()
    hf, _ = _hf_inv_freq(cfg)
    forms = {"config": cfg, "to_dict": cfg.to_dict(), "json": json.loads(cfg.to_json_string()),
             "multimodal": transformers.Gemma4Config(text_config=cfg.to_dict())}
    for t in TYPES:
        hf_inv, hf_af = hf[t]
        width = cfg.per_layer_config[t].head_dim
        assert hf_inv.shape == (width // 2,)
        for form, c in forms.items():
            r = jaxpos.rope_from_hf_config(c, layer_type=t)
            inv = np.asarray(r.inv_freq)
            assert r.rotary_dim == width, (form, t)
            assert inv.shape == hf_inv.shape and inv.dtype == np.float32, (form, t)
            assert np.all(np.abs(inv.astype(np.float64) - hf_inv) <= _ulp32(hf_inv)), (form, t)
            assert np.count_nonzero(inv) == np.count_nonzero(hf_inv), (form, t)
            assert r.attention_factor == pytest.approx(hf_af, rel=1e-7)


def test_default_config_full_layers_rotate_64_of_256_frequencies_spaced_for_512():
    """The numbers of transformers' defaults, written out: a float64 p-RoPE reference."""
    cfg = transformers.Gemma4TextConfig()
    full = jaxpos.rope_from_hf_config(cfg, layer_type="full_attention")
    want = np.zeros(256)
    want[:64] = 1e6 ** -(np.arange(0, 128, 2) / 512)
    np.testing.assert_allclose(np.asarray(full.inv_freq), want, rtol=1e-6, atol=0)
    sliding = jaxpos.rope_from_hf_config(cfg, layer_type="sliding_attention")
    np.testing.assert_allclose(np.asarray(sliding.inv_freq),
                               1e4 ** -(np.arange(0, 256, 2) / 256), rtol=1e-6, atol=0)


@pytest.mark.parametrize("global_head_dim", [512, 64])
def test_config_json_with_global_head_dim_reads_as_hf_builds_it(global_head_dim):
    cfg = transformers.Gemma4TextConfig() if global_head_dim == 512 else _tiny()
    d = _hub_dict(cfg, global_head_dim)
    rebuilt = transformers.Gemma4TextConfig(**d)
    hf, _ = _hf_inv_freq(rebuilt)
    for t in TYPES:
        inv = np.asarray(jaxpos.rope_from_hf_config(d, layer_type=t).inv_freq)
        assert inv.shape == hf[t][0].shape
        assert np.all(np.abs(inv.astype(np.float64) - hf[t][0]) <= _ulp32(hf[t][0]))
    if global_head_dim == 512:  # HF's builder default when config.json omits it
        d.pop("global_head_dim")
        r = jaxpos.rope_from_hf_config(d, layer_type="full_attention")
        assert r.rotary_dim == 512


def test_rope_per_layer_gives_each_layer_its_own_width():
    cfg = transformers.Gemma4TextConfig(num_hidden_layers=12)
    hf, _ = _hf_inv_freq(cfg)
    schemes = jaxpos.hf.rope_per_layer_from_hf_config(cfg)
    assert [s.rotary_dim for s in schemes] == [512 if t == "full_attention" else 256
                                               for t in cfg.layer_types]
    for s, t in zip(schemes, cfg.layer_types):
        assert np.all(np.abs(np.asarray(s.inv_freq, np.float64) - hf[t][0]) <= _ulp32(hf[t][0]))


def test_layers_of_one_type_with_different_widths_are_read_per_layer():
    """``per_layer_config[layer_type]`` is refused by HF when the layers of that type
    differ; so is ``layer_type`` here, and the per-layer reader gives each its own."""
    cfg = _tiny(per_layer_config={"1": {"head_dim": 16}, "5": {"head_dim": 64}})
    with pytest.raises(ValueError, match="not homogeneous"):
        cfg.per_layer_config["sliding_attention"]
    with pytest.raises(ValueError, match="per_layer_config gives the 'sliding_attention'"):
        jaxpos.rope_from_hf_config(cfg, layer_type="sliding_attention")
    widths = [s.rotary_dim for s in jaxpos.hf.rope_per_layer_from_hf_config(cfg)]
    assert widths == [32, 16, 32, 32, 32, 64]
    assert jaxpos.rope_from_hf_config(cfg, layer_type="full_attention").rotary_dim == 64


@pytest.mark.parametrize("layer_type", TYPES)
def test_rotated_qk_match_hf_rotary_module(layer_type):
    """q and k rotated by HF's Gemma 4 rotary (cos/sin of the layer type, then
    ``apply_rotary_pos_emb``) at positions up to 131,071, float32."""
    cfg = _tiny(rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                           "rope_theta": 1_000_000.0}})
    width = cfg.per_layer_config[layer_type].head_dim
    rng = np.random.default_rng(0)
    pos = np.unique(np.r_[0, 1, 2, 511, 512, 4097, 131071, rng.integers(0, 131072, 9)])
    q = rng.normal(size=(1, len(pos), 2, width)).astype(np.float32)
    k = rng.normal(size=(1, len(pos), 1, width)).astype(np.float32)
    _, emb = _hf_inv_freq(cfg)
    with torch.no_grad():
        cos, sin = emb(torch.from_numpy(q), torch.from_numpy(pos)[None], layer_type)
        hq = m4.apply_rotary_pos_emb(torch.from_numpy(q), cos, sin, unsqueeze_dim=2).numpy()
        hk = m4.apply_rotary_pos_emb(torch.from_numpy(k), cos, sin, unsqueeze_dim=2).numpy()
    scheme = jaxpos.rope_from_hf_config(cfg, layer_type=layer_type, angle_precision="float32")
    hf_inv = getattr(emb, f"{layer_type}_inv_freq").numpy()
    # the same inv_freq: HF's arithmetic to float32 rounding of cos/sin
    same = scheme.replace(inv_freq=np.asarray(hf_inv))
    jq, jk = same.transform_qk(q, k, pos.astype(np.int32), pos.astype(np.int32))
    np.testing.assert_allclose(np.asarray(jq), hq, atol=2e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(jk), hk, atol=2e-6, rtol=0)
    # end to end: bounded by one-ulp inv_freq differences at the largest position
    jq, jk = scheme.transform_qk(q, k, pos.astype(np.int32), pos.astype(np.int32))
    d_inv = np.abs(np.asarray(scheme.inv_freq, np.float64) - hf_inv).max()
    bound = 2e-6 + int(pos.max()) * d_inv * 2 * max(np.abs(q).max(), np.abs(k).max())
    assert np.abs(np.asarray(jq) - hq).max() <= bound
    assert np.abs(np.asarray(jk) - hk).max() <= bound
    if layer_type == "full_attention":  # p-RoPE: the last 3/4 of each half pass through
        n_rot = width // 8
        tail = np.r_[n_rot:width // 2, width // 2 + n_rot:width]
        np.testing.assert_array_equal(np.asarray(jq)[..., tail], q[..., tail])


def test_softmax_scale_is_hf_attention_scaling():
    cfg = _tiny()
    for t in TYPES:
        assert jaxpos.hf.softmax_scale_from_hf_config(cfg, layer_type=t) == 1.0
    layer = m4.Gemma4TextAttention(cfg, layer_idx=5)
    assert layer.scaling == 1.0 and layer.head_dim == 64
    g3 = transformers.Gemma3TextConfig(head_dim=32, query_pre_attn_scalar=24)
    from transformers.models.gemma3 import modeling_gemma3 as m3
    assert jaxpos.hf.softmax_scale_from_hf_config(g3) == pytest.approx(
        m3.Gemma3Attention(g3, layer_idx=0).scaling, rel=1e-12)


def test_axial_rope_type_is_refused_by_name():
    """Gemma 4's vision tower uses ``rope_type="axial"`` (2-D patch positions)."""
    with pytest.raises(ValueError, match="axial"):
        jaxpos.rope_from_hf_config(transformers.Gemma4VisionConfig())
    text = {"head_dim": 64, "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0}}
    with pytest.raises(ValueError, match="rope_type='axial'"):
        jaxpos.rope_from_hf_config(text)
