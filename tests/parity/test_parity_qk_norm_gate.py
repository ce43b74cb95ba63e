"""The q/k norms and the output gate of :class:`jaxpos.nnx.MultiHeadAttention` reproduce the
attention layers of the Hugging Face families that use them.

For each family a tiny random config builds transformers' own attention module (eager
attention, float32, every weight redrawn so that the norms and the gate matter); its
weights are copied into a jaxpos layer and both run on the same inputs with a causal
mask. Families: Qwen3 (RMSNorm over each head's features, ``qk_norm="head"``), Gemma 3
(the same with the ``(1 + w)`` weights, ``qk_norm_offset=True``, and
``query_pre_attn_scalar``), OLMo 2 (RMSNorm over the whole projection,
``qk_norm="projection"``), Qwen3-Next (``(1 + w)`` head norms, partial RoPE and the
elementwise output gate that its ``q_proj`` packs beside each head's query, with a bias).
A negative control per feature (the layer without it) misses by more than 1e-2.
"""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from jaxpos import nnx as jn

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.parity

TOL = 2e-5  # max abs difference of the layer outputs, float32
MISS = 1e-2
B, T, D, N, NK, H = 2, 7, 32, 4, 2, 8


def _randomize(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(0.3 * noise if "norm" in name else 0.4 * noise)
    return module.eval()


def _hf_run(attn, rotary, x, **rotary_kw):
    """The HF layer on ``x [B, T, D]`` at positions ``arange(T)`` with a causal mask."""
    xt = torch.tensor(np.asarray(x))
    pos = torch.arange(T)[None].expand(B, T)
    cos_sin = rotary(xt, pos, **rotary_kw)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        out = attn(xt, position_embeddings=cos_sin, attention_mask=mask)[0]
    return out.numpy()


def _t(w):
    return np.asarray(w.detach().numpy().T)


def _copy(layer, attn, *, q_kernel=None):
    layer.q_proj.kernel[...] = _t(attn.q_proj.weight) if q_kernel is None else q_kernel
    for name in ("k_proj", "v_proj", "o_proj"):
        getattr(layer, name).kernel[...] = _t(getattr(attn, name).weight)
    for name in ("q_norm", "k_norm"):
        if getattr(layer, name) is not None:
            getattr(layer, name).scale[...] = getattr(attn, name).weight.detach().numpy()


def _config(cls, **kw):
    cfg = cls(hidden_size=D, num_attention_heads=N, num_key_value_heads=NK, head_dim=H,
              intermediate_size=64, num_hidden_layers=1, vocab_size=64, rms_norm_eps=1e-6,
              **kw)
    cfg._attn_implementation = "eager"
    return cfg


def _x(seed):
    return np.random.RandomState(seed).randn(B, T, D).astype(np.float32)


def _layer(**kw):
    return jn.MultiHeadAttention(D, N, num_kv_heads=NK, head_dim=H, position="rope",
                                 causal=True, implementation="reference",
                                 rngs=nnx.Rngs(0), **kw)


def _diff(a, b):
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


def test_qwen3_head_qk_norm_matches_transformers():
    from transformers.models.qwen3 import modeling_qwen3 as m

    cfg = _config(transformers.Qwen3Config, rope_theta=10000.0)
    attn = _randomize(m.Qwen3Attention(cfg, layer_idx=0), 0)
    x = _x(0)
    want = _hf_run(attn, m.Qwen3RotaryEmbedding(cfg), x)
    layer = _layer(qk_norm="head")
    _copy(layer, attn)
    assert _diff(layer(x), want) < TOL
    plain = _layer()
    _copy(plain, attn)
    assert _diff(plain(x), want) > MISS


def test_gemma3_offset_qk_norm_matches_transformers():
    from transformers.models.gemma3 import modeling_gemma3 as m

    cfg = _config(transformers.Gemma3TextConfig, query_pre_attn_scalar=16,
                  layer_types=["full_attention"], sliding_window=4)
    attn = _randomize(m.Gemma3Attention(cfg, layer_idx=0), 1)
    x = _x(1)
    want = _hf_run(attn, m.Gemma3RotaryEmbedding(cfg), x, layer_type="full_attention")
    theta = cfg.rope_parameters["full_attention"]["rope_theta"]
    layer = _layer(qk_norm="head", qk_norm_offset=True, scale=16 ** -0.5, rope_base=theta)
    _copy(layer, attn)
    assert _diff(layer(x), want) < TOL
    # the plain w form (Qwen3's) with Gemma's weights is another function
    plain = _layer(qk_norm="head", scale=16 ** -0.5, rope_base=theta)
    _copy(plain, attn)
    assert _diff(plain(x), want) > MISS


def test_olmo2_projection_qk_norm_matches_transformers():
    from transformers.models.olmo2 import modeling_olmo2 as m

    cfg = _config(transformers.Olmo2Config, rope_theta=10000.0)
    attn = _randomize(m.Olmo2Attention(cfg, layer_idx=0), 2)
    x = _x(2)
    want = _hf_run(attn, m.Olmo2RotaryEmbedding(cfg), x)
    layer = _layer(qk_norm="projection")
    assert layer.q_norm.scale[...].shape == (N * H,)
    _copy(layer, attn)
    assert _diff(layer(x), want) < TOL
    plain = _layer()
    _copy(plain, attn)
    assert _diff(plain(x), want) > MISS


def test_qwen3_next_elementwise_gate_with_bias_matches_transformers():
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    cfg = _config(transformers.Qwen3NextConfig, attention_bias=True,
                  partial_rotary_factor=0.5, layer_types=["full_attention"])
    attn = _randomize(m.Qwen3NextAttention(cfg, layer_idx=0), 3)
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(attn, name).bias.copy_(0.3 * torch.randn(getattr(attn, name).bias.shape))
    x = _x(3)
    want = _hf_run(attn, m.Qwen3NextRotaryEmbedding(cfg), x)
    # q_proj packs [query_h | gate_h] per head: split it into jaxpos's q_proj and gate_proj
    wq = _t(attn.q_proj.weight).reshape(D, N, 2, H)
    bq = attn.q_proj.bias.detach().numpy().reshape(N, 2, H)
    layer = _layer(rotary_dim=H // 2, use_bias=True, output_gate=True, output_gate_bias=True,
                   qk_norm="head", qk_norm_offset=True)
    _copy(layer, attn, q_kernel=wq[:, :, 0].reshape(D, N * H))
    layer.q_proj.bias[...] = bq[:, 0].reshape(-1)
    for name in ("k_proj", "v_proj", "o_proj"):
        getattr(layer, name).bias[...] = getattr(attn, name).bias.detach().numpy()
    layer.gate_proj.kernel[...] = wq[:, :, 1].reshape(D, N * H)
    layer.gate_proj.bias[...] = bq[:, 1].reshape(-1)
    assert _diff(layer(x), want) < TOL
    layer.gate_proj.bias[...] = np.zeros(N * H, np.float32)  # the gate's bias matters
    assert _diff(layer(x), want) > MISS
