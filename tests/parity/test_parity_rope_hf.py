"""Parity of jaxpos RoPE with Hugging Face transformers (PyTorch on CPU), the reference
implementation of the long-context rope types.

Checked for every rope type: ``inv_freq`` and the attention factor (1e-6 relative),
q and k rotated by HF's rotary code at positions up to 131,072 in float32 and bfloat16,
partial rotary, M-RoPE, axial RoPE, DeepSeek's interleaved layout, and the rope settings
that ``rope_from_hf_config`` reads from real model families' configs.

``angle_precision="float32"`` is HF's arithmetic. Given the same ``inv_freq`` it matches
HF to float32 rounding of cos/sin (PyTorch's and XLA's ``cos`` differ by at most one
ulp). ``inv_freq`` itself is computed with NumPy's correctly rounded ``pow``; PyTorch's
``pow`` differs from it by one ulp in about 1% of entries, which at position 131,072 moves
an angle by up to ``131072 * ulp(inv_freq)``: the end-to-end bound used below.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

import jaxpos
from jaxpos.hf import rope_from_hf_config, softmax_scale_from_hf_config
from jaxpos.schemes import rope as R
from jaxpos.schemes.rope import scaling as S

pytestmark = pytest.mark.parity
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama import modeling_llama

MAX_POS = 131072
rng0 = np.random.default_rng(0)
# positions up to 131,072: the ends, around the original lengths, and random ones
POSITIONS = np.unique(np.r_[0, 1, 2, 4095, 4096, 4097, 8191, 8192, 32767, 32768,
                            131071, 131072, rng0.integers(0, MAX_POS, 20)]).astype(np.int64)


def llama_config(params, head_dim=64, max_pos=MAX_POS, **extra):
    return transformers.LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2,
                                    head_dim=head_dim, num_hidden_layers=1,
                                    max_position_embeddings=max_pos,
                                    rope_parameters=dict(params), **extra)


def hf_init(cfg, seq_len=None):
    rt = cfg.rope_parameters["rope_type"]
    if rt == "default":
        inv, af = modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        inv, af = ROPE_INIT_FUNCTIONS[rt](cfg, None, seq_len=seq_len)
    return inv.numpy(), float(af)


def ulp32(x):
    return np.spacing(np.abs(np.asarray(x, np.float32))).astype(np.float64)


rng1 = np.random.default_rng(1)
LONG_SF = list(np.round(rng1.uniform(1.0, 2.0, 32), 4))
LONG_LF = list(np.round(rng1.uniform(1.0, 60.0, 32), 4))

# (id, HF rope_parameters, jaxpos scaling, head_dim, partial_rotary_factor, max_pos, seq_len)
CASES = [
    ("default-1e4", {"rope_type": "default", "rope_theta": 1e4}, None, 64, 1.0, MAX_POS, None),
    ("default-5e5-128", {"rope_type": "default", "rope_theta": 5e5}, None, 128, 1.0, MAX_POS, None),
    ("linear-2", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
     S.LinearScaling(2.0), 64, 1.0, MAX_POS, None),
    ("linear-8-partial", {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e4,
                          "partial_rotary_factor": 0.5},
     S.LinearScaling(8.0), 64, 0.5, MAX_POS, None),
    ("dynamic-2-short", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
     S.DynamicNTKScaling(2.0, 4096), 64, 1.0, 4096, 1000),
    ("dynamic-2-long", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
     S.DynamicNTKScaling(2.0, 4096), 64, 1.0, 4096, 20000),
    ("dynamic-4-long-128", {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 5e5},
     S.DynamicNTKScaling(4.0, 8192), 128, 1.0, 8192, 131073),
    ("yarn-4", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                "original_max_position_embeddings": 4096},
     S.YaRNScaling(4.0, 4096), 64, 1.0, 16384, None),
    ("yarn-qwen2.5", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                      "original_max_position_embeddings": 32768},
     S.YaRNScaling(4.0, 32768), 128, 1.0, MAX_POS, None),
    ("yarn-deepseek", {"rope_type": "yarn", "factor": 40.0, "rope_theta": 1e4,
                       "original_max_position_embeddings": 4096, "mscale": 1.0,
                       "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
     S.YaRNScaling(40.0, 4096, mscale=1.0, mscale_all_dim=0.707), 64, 1.0, 163840, None),
    ("yarn-notrunc-af", {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e4,
                         "original_max_position_embeddings": 2048, "truncate": False,
                         "attention_factor": 1.3, "beta_fast": 16.0, "beta_slow": 2.0},
     S.YaRNScaling(8.0, 2048, truncate=False, attention_factor=1.3, beta_fast=16.0,
                   beta_slow=2.0), 64, 1.0, 16384, None),
    ("llama3.1", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                  "rope_theta": 5e5}, S.Llama3Scaling(8.0, 1.0, 4.0, 8192), 128, 1.0, MAX_POS, None),
    ("llama3.2-32", {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                     "rope_theta": 5e5}, S.Llama3Scaling(32.0, 1.0, 4.0, 8192), 64, 1.0, MAX_POS, None),
    ("longrope-short", {"rope_type": "longrope", "short_factor": LONG_SF, "long_factor": LONG_LF,
                        "original_max_position_embeddings": 4096, "rope_theta": 1e4},
     S.LongRoPEScaling(LONG_SF, LONG_LF, 4096, factor=MAX_POS / 4096), 64, 1.0, MAX_POS, 100),
    ("longrope-long", {"rope_type": "longrope", "short_factor": LONG_SF, "long_factor": LONG_LF,
                       "original_max_position_embeddings": 4096, "rope_theta": 1e4},
     S.LongRoPEScaling(LONG_SF, LONG_LF, 4096, factor=MAX_POS / 4096), 64, 1.0, MAX_POS, 5000),
    ("proportional-0.25", {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                           "rope_theta": 1e6},
     S.ProportionalScaling(0.25), 128, 1.0, MAX_POS, None),
]


def _our_freqs(case):
    _, params, scaling, head_dim, prf, _max_pos, seq_len = case
    rotary_dim = head_dim if isinstance(scaling, S.ProportionalScaling) else int(head_dim * prf)
    inv, af = jaxpos.rope_frequencies(rotary_dim, params["rope_theta"], scaling=scaling,
                                      seq_len=seq_len)
    return np.asarray(inv), af


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_inv_freq_and_attention_factor_match_hf(case):
    _, params, scaling, head_dim, _, max_pos, seq_len = case
    cfg = llama_config(params, head_dim, max_pos)
    hf_inv, hf_af = hf_init(cfg, seq_len)
    inv, af = _our_freqs(case)
    assert inv.shape == hf_inv.shape and inv.dtype == np.float32
    np.testing.assert_allclose(inv, hf_inv, rtol=1e-6, atol=0)
    assert np.all(np.abs(inv.astype(np.float64) - hf_inv) <= ulp32(hf_inv))  # at most one ulp
    assert af == pytest.approx(hf_af, rel=1e-6)
    # and the same numbers come out of rope_from_hf_config for this config
    if seq_len is None or not S.depends_on_length(scaling):
        r = rope_from_hf_config(cfg)
        np.testing.assert_allclose(np.asarray(r.inv_freq), hf_inv, rtol=1e-6, atol=0)
        assert r.attention_factor == pytest.approx(hf_af, rel=1e-6)


# ------------------------------------------------------------------- rotated q and k
def hf_rotate(cfg, q, k, positions, rotary_cls=modeling_llama.LlamaRotaryEmbedding,
              apply=modeling_llama.apply_rotary_pos_emb):
    """HF: q, k [B, T, N, H] numpy (float32) -> rotated, via torch in q's dtype."""
    emb = rotary_cls(cfg)
    pos = torch.from_numpy(np.asarray(positions, np.int64))[None]
    qt = torch.from_numpy(np.ascontiguousarray(q.transpose(0, 2, 1, 3)))
    kt = torch.from_numpy(np.ascontiguousarray(k.transpose(0, 2, 1, 3)))
    return emb, pos, qt, kt


def _run_hf(cfg, q, k, positions, dtype, rotary_cls=modeling_llama.LlamaRotaryEmbedding,
            apply=modeling_llama.apply_rotary_pos_emb):
    emb, pos, qt, kt = hf_rotate(cfg, q, k, positions, rotary_cls, apply)
    qt, kt = qt.to(dtype), kt.to(dtype)
    cos, sin = emb(qt, pos)
    qo, ko = apply(qt, kt, cos, sin)
    out = [t.float().numpy().transpose(0, 2, 1, 3) for t in (qo, ko)]
    return out, emb.inv_freq.numpy().copy(), float(emb.attention_scaling)


ROTATION_CASES = [c for c in CASES if c[0] in (
    "default-1e4", "linear-8-partial", "yarn-deepseek", "yarn-qwen2.5", "llama3.1",
    "longrope-short", "proportional-0.25")]


@pytest.mark.parametrize("case", ROTATION_CASES, ids=[c[0] for c in ROTATION_CASES])
def test_rotated_qk_match_hf_float32_and_bf16(case):
    _, params, scaling, head_dim, prf, max_pos, _ = case
    cfg = llama_config(params, head_dim, max_pos)
    if prf != 1.0:  # Llama's rotary ignores partial_rotary_factor: use NeoX-style apply
        from transformers.models.phi3 import modeling_phi3 as m
        rot_cls, apply = m.Phi3RotaryEmbedding, m.apply_rotary_pos_emb
    else:
        rot_cls, apply = modeling_llama.LlamaRotaryEmbedding, modeling_llama.apply_rotary_pos_emb
    rng = np.random.default_rng(2)
    T = len(POSITIONS)
    q = rng.normal(size=(1, T, 2, head_dim)).astype(np.float32)
    k = rng.normal(size=(1, T, 2, head_dim)).astype(np.float32)
    pos = POSITIONS
    scheme = rope_from_hf_config(cfg, angle_precision="float32")
    if isinstance(scaling, S.LongRoPEScaling):  # HF picks the factors from max(position)
        pos = POSITIONS[POSITIONS < 4096]
        q, k = q[:, :len(pos)], k[:, :len(pos)]
    (hq, hk), hf_inv, hf_af = _run_hf(cfg, q, k, pos, torch.float32, rot_cls, apply)

    # (a) same inv_freq: HF's arithmetic to float32 rounding of cos/sin
    same = scheme.replace(inv_freq=jnp.asarray(hf_inv))
    jq, jk = same.transform_qk(q, k, pos.astype(np.int32), pos.astype(np.int32))
    np.testing.assert_allclose(np.asarray(jq), hq, atol=2e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(jk), hk, atol=2e-6, rtol=0)

    # (b) end to end with jaxpos's inv_freq: bounded by one-ulp inv_freq differences
    jq, jk = scheme.transform_qk(q, k, pos.astype(np.int32), pos.astype(np.int32))
    d_inv = np.abs(np.asarray(scheme.inv_freq, np.float64) - hf_inv).max()
    bound = 2e-6 + int(pos.max()) * d_inv * 2 * np.abs(q).max() * hf_af
    assert np.abs(np.asarray(jq) - hq).max() <= bound
    assert np.abs(np.asarray(jk) - hk).max() <= bound

    # (c) bfloat16: HF rounds cos/sin and every product to bf16; jaxpos rounds once.
    qb = np.asarray(jnp.asarray(q, jnp.bfloat16).astype(jnp.float32))
    kb = np.asarray(jnp.asarray(k, jnp.bfloat16).astype(jnp.float32))
    (hqb, _), _, _ = _run_hf(cfg, qb, kb, pos, torch.bfloat16, rot_cls, apply)
    jqb, _ = same.transform_qk(jnp.asarray(qb, jnp.bfloat16), jnp.asarray(kb, jnp.bfloat16),
                            pos.astype(np.int32), pos.astype(np.int32))
    jqb = np.asarray(jqb.astype(jnp.float32))
    # three bf16 roundings of terms up to |x1| + |x2|, relative 2^-9 each
    mag = np.abs(qb).max() * 2 * hf_af
    assert np.abs(jqb - hqb).max() <= 3 * 2.0 ** -9 * mag
    # and jaxpos's bf16 result is within bf16 rounding of its float32 result
    jq32, _ = same.transform_qk(qb, kb, pos.astype(np.int32), pos.astype(np.int32))
    jq32 = np.asarray(jq32)
    assert np.all(np.abs(jqb - jq32) <= 2.0 ** (np.floor(np.log2(np.abs(jq32) + 1e-30)) - 8) + 1e-6)


def test_high_precision_mode_deviation_from_hf_is_hfs_float32_error():
    """The default angles differ from HF's float32 product by HF's own rounding error
    (|angle| * 2^-24 at most), never more."""
    cfg = llama_config({"rope_type": "default", "rope_theta": 1e4}, 64)
    q = np.random.default_rng(3).normal(size=(1, len(POSITIONS), 2, 64)).astype(np.float32)
    (hq, _), hf_inv, _ = _run_hf(cfg, q, q, POSITIONS, torch.float32)
    jq = np.asarray(jaxpos.apply_rope(q, POSITIONS.astype(np.int32), jnp.asarray(hf_inv)))
    bound = MAX_POS * float(hf_inv.max()) * 2.0 ** -24 * 2 * np.abs(q).max() + 2e-6
    dev = np.abs(jq - hq).max()
    assert dev <= bound
    assert dev > 1e-4  # the precise mode really differs at long positions


# --------------------------------------------------------------------- dynamic NTK
def test_dynamic_ntk_per_call_frequencies_match_hf_module():
    params = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}
    cfg = llama_config(params, 64, max_pos=2048)
    emb = modeling_llama.LlamaRotaryEmbedding(cfg)
    x = torch.zeros(1, 1, 64)
    scheme = rope_from_hf_config(cfg, angle_precision="float32")
    assert scheme.scaling == S.DynamicNTKScaling(4.0, 2048)
    for n in (3000, 10000, 100):  # long, longer, then short: HF resets, jaxpos has no state
        pos = np.arange(n)
        emb(x, torch.from_numpy(pos)[None])
        ours, af = scheme.frequencies(jnp.asarray(pos), jnp.asarray(pos))
        np.testing.assert_allclose(np.asarray(ours), emb.inv_freq.numpy(), rtol=1e-6, atol=0)
        assert af == 1.0
    np.testing.assert_array_equal(np.asarray(ours), emb.original_inv_freq.numpy())


def test_dynamic_ntk_jaxpos_has_no_cached_length_unlike_hf():
    """HF keeps the longest length seen while calls stay above max_position_embeddings;
    jaxpos recomputes from each call (documented difference)."""
    cfg = llama_config({"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}, 64, 2048)
    emb = modeling_llama.LlamaRotaryEmbedding(cfg)
    x = torch.zeros(1, 1, 64)
    emb(x, torch.arange(10000)[None])
    emb(x, torch.arange(3000)[None])  # HF: still the 10,000-length frequencies
    scheme = rope_from_hf_config(cfg)
    ours_3000, _ = scheme.frequencies(jnp.arange(3000), jnp.arange(3000))
    fresh = modeling_llama.LlamaRotaryEmbedding(cfg)
    fresh(x, torch.arange(3000)[None])
    np.testing.assert_allclose(np.asarray(ours_3000), fresh.inv_freq.numpy(), rtol=1e-6, atol=0)
    assert not np.allclose(emb.inv_freq.numpy(), fresh.inv_freq.numpy())


# ---------------------------------------------------------------------------- LongRoPE
PHI35_MINI = {  # microsoft/Phi-3.5-mini-instruct config.json (rope settings)
    "model_type": "phi3", "hidden_size": 3072, "num_attention_heads": 32,
    "num_key_value_heads": 32, "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "longrope",
        "long_factor": [
            1.0800000429153442, 1.1100000143051147, 1.1399999856948853, 1.340000033378601,
            1.5899999141693115, 1.600000023841858, 1.6200000047683716, 2.620000123977661,
            3.2300000190734863, 3.2300000190734863, 4.789999961853027, 7.400000095367432,
            7.700000286102295, 9.09000015258789, 12.199999809265137, 17.670000076293945,
            24.46000099182129, 28.57000160217285, 30.420001983642578, 30.840002059936523,
            32.590003967285156, 32.93000411987305, 42.320003509521484, 44.96000289916992,
            50.340003967285156, 50.45000457763672, 57.55000305175781, 57.93000411987305,
            58.21000289916992, 60.1400032043457, 62.61000442504883, 62.62000274658203,
            62.71000289916992, 63.1400032043457, 63.1400032043457, 63.77000427246094,
            63.93000411987305, 63.96000289916992, 63.970001220703125, 64.02999877929688,
            64.06999969482422, 64.08000183105469, 64.12000274658203, 64.41000366210938,
            64.4800033569336, 64.51000213623047, 64.52999877929688, 64.83999633789062],
        "short_factor": [
            1.0, 1.0199999809265137, 1.0299999713897705, 1.0299999713897705,
            1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0499999523162842,
            1.0499999523162842, 1.0699999332427979, 1.0999999046325684, 1.1099998950958252,
            1.1599998474121094, 1.1599998474121094, 1.1699998378753662, 1.2899998426437378,
            1.339999794960022, 1.679999828338623, 1.7899998426437378, 1.8199998140335083,
            1.8499997854232788, 1.8799997568130493, 1.9099997282028198, 1.9399996995925903,
            1.9899996519088745, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346,
            2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0299997329711914,
            2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
            2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
            2.0799996852874756, 2.0899996757507324, 2.189999580383301, 2.2199995517730713,
            2.5899994373321533, 2.729999542236328, 2.749999523162842, 2.8399994373321533]},
}


def test_longrope_phi35_switches_like_hf_module():
    from transformers.models.phi3 import modeling_phi3 as m
    cfg = transformers.Phi3Config(**{k: v for k, v in PHI35_MINI.items() if k != "model_type"})
    emb = m.Phi3RotaryEmbedding(cfg)
    scheme = rope_from_hf_config(PHI35_MINI, angle_precision="float32")
    x = torch.zeros(1, 1, 96)
    for n in (5000, 100, 4096, 4097):
        pos = np.arange(n)
        emb(x, torch.from_numpy(pos)[None])
        ours, af = scheme.frequencies(jnp.asarray(pos), jnp.asarray(pos))
        np.testing.assert_allclose(np.asarray(ours), emb.inv_freq.numpy(), rtol=1e-6, atol=0)
        assert af == pytest.approx(emb.attention_scaling, rel=1e-12)
    # long-context rotation of q at the last positions of a 131,072 sequence
    pos = np.arange(MAX_POS - 16, MAX_POS)
    q = np.random.default_rng(4).normal(size=(1, 16, 2, 96)).astype(np.float32)
    (hq, _), hf_inv, _ = _run_hf(cfg, q, q, pos, torch.float32, m.Phi3RotaryEmbedding,
                                 m.apply_rotary_pos_emb)
    # jaxpos's own frequencies for max(position) + 1 = 131,072 > 4,096: the long factors
    jq, _ = scheme.transform_qk(q, q, pos.astype(np.int32), pos.astype(np.int32))
    d_inv = np.abs(np.asarray(scheme.frequencies(pos, pos)[0], np.float64) - hf_inv).max()
    assert np.abs(np.asarray(jq) - hq).max() <= 2e-6 + MAX_POS * d_inv * 4 * np.abs(q).max()


# ------------------------------------------------------------------ partial rotary (NeoX)
def test_gpt_neox_partial_rotary_matches_hf():
    from transformers.models.gpt_neox import modeling_gpt_neox as m
    d = {"model_type": "gpt_neox", "hidden_size": 128, "num_attention_heads": 2,
         "rotary_pct": 0.25, "rotary_emb_base": 10000, "max_position_embeddings": 2048}
    cfg = transformers.GPTNeoXConfig(**{k: v for k, v in d.items() if k != "model_type"})
    scheme = rope_from_hf_config(d, angle_precision="float32")
    assert scheme.rotary_dim == 16
    q = np.random.default_rng(5).normal(size=(1, len(POSITIONS), 2, 64)).astype(np.float32)
    (hq, _), hf_inv, _ = _run_hf(cfg, q, q, POSITIONS, torch.float32, m.GPTNeoXRotaryEmbedding,
                                 m.apply_rotary_pos_emb)
    jq, _ = scheme.replace(inv_freq=jnp.asarray(hf_inv)).transform_qk(
        q, q, POSITIONS.astype(np.int32), POSITIONS.astype(np.int32))
    np.testing.assert_allclose(np.asarray(jq), hq, atol=2e-6, rtol=0)
    np.testing.assert_array_equal(np.asarray(jq)[..., 16:], q[..., 16:])


# ----------------------------------------------------------------------- Qwen2-VL M-RoPE
QWEN2_VL_7B = {  # Qwen/Qwen2-VL-7B-Instruct config.json (rope settings)
    "model_type": "qwen2_vl", "hidden_size": 3584, "num_attention_heads": 28,
    "num_key_value_heads": 4, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {"depth": 32, "embed_dim": 1280, "num_heads": 16, "hidden_size": 3584,
                      "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
}


def test_qwen2_vl_mrope_matches_hf():
    from transformers.models.qwen2_vl import modeling_qwen2_vl as m
    cfg = transformers.Qwen2VLConfig(**{k: v for k, v in QWEN2_VL_7B.items() if k != "model_type"})
    text = cfg.get_text_config()
    emb = m.Qwen2VLRotaryEmbedding(text)
    scheme = rope_from_hf_config(QWEN2_VL_7B, angle_precision="float32")
    assert scheme.mrope_section == (16, 24, 24) and scheme.rotary_dim == 128
    rng = np.random.default_rng(6)
    T = 24
    pos3 = np.stack([np.repeat(np.arange(4), 6) + 1000, np.tile(np.arange(6), 4) + 1000,
                     rng.integers(1000, 60000, T)])[:, None, :].astype(np.int64)  # [3, 1, T]
    q = rng.normal(size=(1, T, 2, 128)).astype(np.float32)
    qt = torch.from_numpy(np.ascontiguousarray(q.transpose(0, 2, 1, 3)))
    cos, sin = emb(qt, torch.from_numpy(pos3))
    hq, _ = m.apply_rotary_pos_emb(qt, qt, cos, sin)
    hq = hq.numpy().transpose(0, 2, 1, 3)
    jq = scheme.replace(inv_freq=jnp.asarray(emb.inv_freq.numpy())).rotate(q, pos3.astype(np.int32))
    np.testing.assert_allclose(np.asarray(jq), hq, atol=2e-6, rtol=0)


def test_qwen2_vl_vision_axial_rope_matches_hf():
    from transformers.models.qwen2_vl import modeling_qwen2_vl as m
    cfg = transformers.Qwen2VLConfig(**{k: v for k, v in QWEN2_VL_7B.items() if k != "model_type"})
    vcfg = cfg.vision_config
    emb = m.Qwen2VLVisionRotaryEmbedding(vcfg)
    head_dim = vcfg.embed_dim // vcfg.num_heads  # 80
    inv_freq = R.axial_rope_frequencies(head_dim, vcfg.rope_parameters["rope_theta"])
    np.testing.assert_allclose(np.asarray(inv_freq), emb.inv_freq.numpy(), rtol=1e-6, atol=0)
    hw = np.stack(np.meshgrid(np.arange(6), np.arange(5), indexing="ij"), -1).reshape(-1, 2)
    q = np.random.default_rng(7).normal(size=(1, len(hw), 2, head_dim)).astype(np.float32)
    cos, sin = emb(torch.zeros(1), torch.from_numpy(hw.astype(np.int64)))
    qt = torch.from_numpy(q[0])
    hq, _ = m.apply_rotary_pos_emb_vision(qt, qt, cos, sin)
    jq = R.apply_axial_rope(q, hw.astype(np.int32), jnp.asarray(emb.inv_freq.numpy()),
                            angle_precision="float32")
    np.testing.assert_allclose(np.asarray(jq)[0], hq.numpy(), atol=2e-6, rtol=0)


# --------------------------------------------------------------- DeepSeek-V3 interleaved
DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3 config.json (rope and attention settings)
    "model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "max_position_embeddings": 163840, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
}


def test_deepseek_v3_interleaved_rope_matches_hf():
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m
    cfg = transformers.DeepseekV3Config(**{k: v for k, v in DEEPSEEK_V3.items()
                                           if k != "model_type"})
    emb = m.DeepseekV3RotaryEmbedding(cfg)
    scheme = rope_from_hf_config(DEEPSEEK_V3, angle_precision="float32")
    assert (scheme.layout, scheme.rotary_dim) == ("interleaved", 64)
    np.testing.assert_allclose(np.asarray(scheme.inv_freq), emb.inv_freq.numpy(), rtol=1e-6, atol=0)
    assert scheme.attention_factor == pytest.approx(emb.attention_scaling)
    q = np.random.default_rng(8).normal(size=(1, len(POSITIONS), 2, 64)).astype(np.float32)
    qt = torch.from_numpy(np.ascontiguousarray(q.transpose(0, 2, 1, 3)))
    cos, sin = emb(qt, torch.from_numpy(POSITIONS)[None])
    hq, _ = m.apply_rotary_pos_emb_interleave(qt, qt, cos, sin)
    hq = hq.numpy().transpose(0, 2, 1, 3)
    jq, _ = scheme.replace(inv_freq=jnp.asarray(emb.inv_freq.numpy())).transform_qk(
        q, q, POSITIONS.astype(np.int32), POSITIONS.astype(np.int32))
    # HF de-interleaves then rotates in the half layout: the same rotation, permuted
    np.testing.assert_allclose(jaxpos.interleaved_to_half(np.asarray(jq), head_dim=64), hq,
                               atol=2e-6, rtol=0)
    # softmax scale: qk_head_dim^-0.5 * mscale^2, as HF's DeepseekV3Attention.scaling
    mscale = 0.1 * 1.0 * math.log(40) + 1.0
    assert softmax_scale_from_hf_config(DEEPSEEK_V3) == pytest.approx(192 ** -0.5 * mscale ** 2)


# -------------------------------------------------------- real configs via rope_from_hf_config
LLAMA31_8B = {  # meta-llama/Llama-3.1-8B config.json (rope settings)
    "model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
    "num_key_value_heads": 8, "max_position_embeddings": 131072, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}
QWEN2_7B = {  # Qwen/Qwen2-7B config.json (rope settings)
    "model_type": "qwen2", "hidden_size": 3584, "num_attention_heads": 28,
    "num_key_value_heads": 4, "max_position_embeddings": 131072, "rope_theta": 1000000.0,
    "rope_scaling": None,
}
GPT_NEOX_20B = {  # EleutherAI/gpt-neox-20b config.json (rope settings)
    "model_type": "gpt_neox", "hidden_size": 6144, "num_attention_heads": 64,
    "rotary_pct": 0.25, "rotary_emb_base": 10000, "max_position_embeddings": 2048,
}

REAL = [
    ("llama3.1-8b", LLAMA31_8B, "LlamaConfig", "llama", "LlamaRotaryEmbedding", 128, "half"),
    ("qwen2-7b", QWEN2_7B, "Qwen2Config", "qwen2", "Qwen2RotaryEmbedding", 128, "half"),
    ("qwen2-vl-7b", QWEN2_VL_7B, "Qwen2VLConfig", "qwen2_vl", "Qwen2VLRotaryEmbedding", 128, "half"),
    ("deepseek-v3", DEEPSEEK_V3, "DeepseekV3Config", "deepseek_v3", "DeepseekV3RotaryEmbedding",
     64, "interleaved"),
    ("phi3.5-mini", PHI35_MINI, "Phi3Config", "phi3", "Phi3RotaryEmbedding", 96, "half"),
    ("gpt-neox-20b", GPT_NEOX_20B, "GPTNeoXConfig", "gpt_neox", "GPTNeoXRotaryEmbedding", 24, "half"),
]


@pytest.mark.parametrize("name,d,cfg_cls,mod,emb_cls,rotary_dim,layout", REAL,
                         ids=[r[0] for r in REAL])
def test_rope_from_real_configs_matches_hf(name, d, cfg_cls, mod, emb_cls, rotary_dim, layout):
    import importlib
    cfg = getattr(transformers, cfg_cls)(**{k: v for k, v in d.items() if k != "model_type"})
    m = importlib.import_module(f"transformers.models.{mod}.modeling_{mod}")
    emb = getattr(m, emb_cls)(cfg.get_text_config())
    for source in (d, cfg):  # the config.json dict and the HF config object
        scheme = rope_from_hf_config(source)
        assert (scheme.rotary_dim, scheme.layout) == (rotary_dim, layout)
        np.testing.assert_allclose(np.asarray(scheme.inv_freq), emb.inv_freq.numpy(),
                                   rtol=1e-6, atol=0)
        assert scheme.attention_factor == pytest.approx(emb.attention_scaling, rel=1e-12)
