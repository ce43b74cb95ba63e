"""jaxpos.schemes.mla: decoupled-RoPE multi-head latent attention (DeepSeek-V2 §2.1.3) against a
float64 NumPy reference written from the paper's equations, the softmax scale against
Hugging Face's ``yarn_apply_mscale``, and bad input."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

import jaxpos
from jaxpos.schemes import mla

B, TQ, TK, N, DN, DR, DV = 2, 5, 7, 3, 6, 4, 5
BASE = 100.0


def _rope_np(x, pos, inv_freq, af):
    """Su et al. §3.4.2 on pairs (2i, 2i+1) (DeepSeek's layout), cos/sin scaled by af."""
    ang = pos[..., None].astype(np.float64) * inv_freq  # [B, T, Dr/2]
    c, s = np.cos(ang)[:, :, None] * af, np.sin(ang)[:, :, None] * af
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x2 * c + x1 * s
    return out


def _mla_np(q_nope, q_rope, k_nope, k_rope, v, q_pos, kv_pos, inv_freq, af, scale):
    """DeepSeek-V2 §2.1.3: q_{t,i} = [q^C; R q^R], k_{j,i} = [k^C; R k^R_j] with k^R
    shared by every head, causal softmax(scale * q . k) v."""
    qr = _rope_np(q_rope, q_pos, inv_freq, af)  # [B, Tq, N, Dr]
    kr = _rope_np(k_rope[:, :, None], kv_pos, inv_freq, af)[:, :, 0]  # [B, Tk, Dr]
    s = np.einsum("btnd,bsnd->bnts", q_nope, k_nope) + np.einsum("btnd,bsd->bnts", qr, kr)
    s = s * scale
    s = np.where(q_pos[:, None, :, None] >= kv_pos[:, None, None, :], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnd->btnd", p, v)


@pytest.fixture
def inputs(rng):
    f = lambda *s: rng.standard_normal(s)
    q_pos = np.stack([np.arange(TK - TQ, TK), np.arange(3, 3 + TQ) + 20])  # decoding, offsets
    kv_pos = np.stack([np.arange(TK), np.arange(TK) + 20])
    return (f(B, TQ, N, DN), f(B, TQ, N, DR), f(B, TK, N, DN), f(B, TK, DR), f(B, TK, N, DV),
            q_pos, kv_pos)


@pytest.mark.parametrize("implementation", ["reference", "chunked"])
def test_mla_attention_matches_the_paper(inputs, implementation):
    """With YaRN's cos/sin factor (0.92 here, as DeepSeek-V3's mscale / mscale_all_dim
    gives): it scales the rope part only, the nope part is untouched."""
    attention_factor = 0.92
    q_nope, q_rope, k_nope, k_rope, v, q_pos, kv_pos = inputs
    inv_freq = BASE ** (-np.arange(0, DR, 2) / DR)
    scale = 0.37
    rope = jaxpos.RoPE(rotary_dim=DR, base=BASE, layout="interleaved",
                       attention_factor=attention_factor)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    out = jaxpos.mla_attention(f32(q_nope), f32(q_rope), f32(k_nope), f32(k_rope), f32(v),
                               rope=rope, scale=scale, q_positions=q_pos, kv_positions=kv_pos,
                               causal=True, implementation=implementation, block_q=2, block_k=3)
    ref = _mla_np(q_nope, q_rope, k_nope, k_rope, v, q_pos, kv_pos, inv_freq, attention_factor,
                  scale)
    assert out.shape == (B, TQ, N, DV)
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=0)
    # Control: the rope key rotated per head in the wrong layout is a different attention.
    half = jaxpos.RoPE(rotary_dim=DR, base=BASE, layout="half", attention_factor=attention_factor)
    wrong = jaxpos.mla_attention(f32(q_nope), f32(q_rope), f32(k_nope), f32(k_rope), f32(v),
                                 rope=half, scale=scale, q_positions=q_pos,
                                 kv_positions=kv_pos, causal=True, implementation=implementation)
    assert np.abs(np.asarray(wrong) - ref).max() > 1e-2


def test_mla_qk_layout_and_shared_rope_key(inputs):
    q_nope, q_rope, k_nope, k_rope, *_ = inputs
    q, k = mla.mla_qk(q_nope, q_rope, k_nope, k_rope[:, :, None])
    assert q.shape == (B, TQ, N, DR + DN) and k.shape == (B, TK, N, DR + DN)
    np.testing.assert_array_equal(np.asarray(q[..., :DR]), np.asarray(q_rope, np.float32))
    np.testing.assert_array_equal(np.asarray(q[..., DR:]), np.asarray(q_nope, np.float32))
    for h in range(N):  # one rope key for every head
        np.testing.assert_array_equal(np.asarray(k[:, :, h, :DR]), np.asarray(k_rope, np.float32))
    nope, rope = mla.split_nope_rope(jnp.arange(2 * (DN + DR)).reshape(2, DN + DR), DN, DR)
    assert nope.shape == (2, DN) and rope.shape == (2, DR) and int(rope[0, 0]) == DN


def test_softmax_scale_equals_hf_yarn_apply_mscale():
    """DeepSeek-V3 (qk 128 + 64, YaRN factor 40, mscale_all_dim 1) and DeepSeek-V2
    (mscale_all_dim 0.707: the report's sqrt(t) = 0.0707 ln s + 1) against HF's own
    function; no scaling, or rope_type "default", leaves ``qk_head_dim ** -0.5``."""
    hf_ds = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    for mad in (1.0, 0.707):
        params = {"rope_type": "yarn", "factor": 40.0, "mscale": mad, "mscale_all_dim": mad,
                  "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}
        want = hf_ds.yarn_apply_mscale(params, 192 ** -0.5)
        assert mla.mla_softmax_scale(128, 64, rope_parameters=params) == pytest.approx(want,
                                                                                        rel=1e-12)
        assert want == pytest.approx(192 ** -0.5 * (0.1 * mad * math.log(40) + 1) ** 2)
    assert mla.mla_softmax_scale(128, 64) == pytest.approx(192 ** -0.5)
    default = {"rope_type": "default", "mscale_all_dim": 1.0, "factor": 40.0}
    assert mla.mla_softmax_scale(128, 64, rope_parameters=default) == pytest.approx(
        hf_ds.yarn_apply_mscale(default, 192 ** -0.5))
    assert mla.mla_softmax_scale(0, 64, rope_parameters={"rope_type": "yarn", "factor": 0.5,
                                                         "mscale_all_dim": 1.0}) == 64 ** -0.5


def test_bad_input(inputs):
    q_nope, q_rope, k_nope, k_rope, v, q_pos, kv_pos = inputs
    rope = jaxpos.RoPE(rotary_dim=DR, layout="interleaved")
    with pytest.raises(ValueError, match="qk_nope_head_dim \\+ qk_rope_head_dim = 6 \\+ 2"):
        mla.split_nope_rope(np.zeros((2, 10)), 6, 2)
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        mla.split_nope_rope(np.zeros((2, 10)), 12, -2)
    with pytest.raises(ValueError, match="one head"):
        mla.mla_qk(q_nope, q_rope, k_nope, np.zeros((B, TK, 2, DR)))
    with pytest.raises(ValueError, match="k_rope must have shape"):
        mla.mla_qk(q_nope, q_rope, k_nope, np.zeros((B, TK, DR + 2)))
    with pytest.raises(ValueError, match="k_nope must have shape"):
        mla.mla_qk(q_nope, q_rope, k_nope[:, :, :2], k_rope)
    with pytest.raises(TypeError, match="q_nope"):
        mla.mla_qk(q_nope.astype(np.int32), q_rope, k_nope, k_rope)
    with pytest.raises(ValueError, match="rotary_dim must equal qk_rope_head_dim"):
        jaxpos.mla_attention(q_nope, q_rope, k_nope, k_rope, v,
                          rope=jaxpos.RoPE(rotary_dim=DR + 2), causal=True)
    with pytest.raises(TypeError, match="rope="):
        jaxpos.mla_attention(q_nope, q_rope, k_nope, k_rope, v, rope=rope, position=None)
    with pytest.raises(TypeError, match="jaxpos.RoPE"):
        jaxpos.mla_attention(q_nope, q_rope, k_nope, k_rope, v, rope="rope")
    with pytest.raises(ValueError, match=r"rope_parameters\['factor'\]"):
        mla.mla_softmax_scale(16, 8, rope_parameters={"rope_type": "yarn", "mscale_all_dim": 1.0})
    with pytest.raises(ValueError, match="must be > 0"):
        mla.mla_softmax_scale(0, 0)
    with pytest.raises(TypeError, match="qk_nope_head_dim"):
        mla.mla_softmax_scale(16.0, 8)
