"""RoPE context extension (jaxpos.schemes.rope.scaling) against float64 re-implementations of the
published methods, and hand-computed attention factors. No torch needed; the parity
with Hugging Face transformers is in tests/parity/test_parity_rope_hf.py."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpos
from jaxpos.schemes.rope import scaling as S


def base_inv_freq(d, base):
    return base ** (-np.arange(0, d, 2, dtype=np.float64) / d)


# float32 rounding of the exponent in HF's order: relative error <= ln(base) * 2^-24 + 2^-23
def tol(base):
    return math.log(base) * 2.0 ** -24 + 2.0 ** -22


def freqs(d, base, scaling, seq_len=None):
    inv, af = jaxpos.rope_frequencies(d, base, scaling=scaling, seq_len=seq_len)
    assert inv.dtype == jnp.float32 and inv.shape == (d // 2,)
    return np.asarray(inv, np.float64), af


# --------------------------------------------------------------------------------- linear
@pytest.mark.parametrize("factor", [2.0, 4.0, 8.0])
def test_linear_divides_every_frequency(factor):
    inv, af = freqs(64, 10000.0, jaxpos.LinearScaling(factor))
    np.testing.assert_allclose(inv, base_inv_freq(64, 10000.0) / factor, rtol=tol(1e4))
    assert af == 1.0


# ---------------------------------------------------------------------------- dynamic NTK
@pytest.mark.parametrize("seq_len", [4097, 8192, 65536])
def test_dynamic_ntk_base_formula(seq_len):
    s = jaxpos.DynamicNTKScaling(factor=2.0, original_max_position_embeddings=4096)
    inv, af = freqs(128, 10000.0, s, seq_len)
    new_base = 10000.0 * (2.0 * seq_len / 4096 - 1.0) ** (128 / 126)
    np.testing.assert_allclose(inv, base_inv_freq(128, new_base), rtol=tol(new_base))
    assert af == 1.0


@pytest.mark.parametrize("seq_len", [None, 1, 4096])
def test_dynamic_ntk_is_plain_rope_up_to_original_length(seq_len):
    s = jaxpos.DynamicNTKScaling(factor=2.0, original_max_position_embeddings=4096)
    np.testing.assert_array_equal(freqs(64, 10000.0, s, seq_len)[0], freqs(64, 10000.0, None)[0])


def test_dynamic_ntk_traced_length_matches_host_length():
    s = jaxpos.DynamicNTKScaling(factor=4.0, original_max_position_embeddings=256)
    f = jax.jit(lambda n: S.frequencies_for_length(64, 10000.0, s, n)[0])
    for n in (10, 256, 257, 1000, 50000):
        host = freqs(64, 10000.0, s, n)[0]
        np.testing.assert_allclose(np.asarray(f(n), np.float64), host, rtol=2e-6)


# ----------------------------------------------------------------------------------- YaRN
def ref_yarn(d, base, factor, L, beta_fast=32.0, beta_slow=1.0, truncate=True):
    """float64 NTK-by-parts of the YaRN reference code (Peng et al. 2024, §3.2): the ramp
    runs over the dimension index between the dimensions that make beta_fast and
    beta_slow rotations over L positions."""
    def dim_for(rot):
        return d * math.log(L / (rot * 2 * math.pi)) / (2 * math.log(base))
    low, high = dim_for(beta_fast), dim_for(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(d // 2) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (unchanged), 0: interpolate (divide by factor)
    f = base_inv_freq(d, base)
    return f / factor * (1 - keep) + f * keep


@pytest.mark.parametrize("d,base,factor,L,truncate", [
    (64, 10000.0, 4.0, 4096, True), (128, 1e6, 4.0, 32768, True),  # Qwen2.5 YaRN
    (64, 10000.0, 40.0, 4096, True),  # DeepSeek-V3 rope part
    (128, 10000.0, 16.0, 2048, False),
])
def test_yarn_frequencies(d, base, factor, L, truncate):
    s = jaxpos.YaRNScaling(factor, L, truncate=truncate)
    inv, af = freqs(d, base, s)
    np.testing.assert_allclose(inv, ref_yarn(d, base, factor, L, truncate=truncate), rtol=tol(base))
    assert inv[0] == 1.0  # highest frequency untouched
    np.testing.assert_allclose(inv[-1], base_inv_freq(d, base)[-1] / factor, rtol=tol(base))
    assert af == pytest.approx(0.1 * math.log(factor) + 1)


def test_yarn_attention_factors_hand_values():
    # 0.1 ln 4 + 1
    assert freqs(64, 1e4, jaxpos.YaRNScaling(4.0, 4096))[1] == pytest.approx(1.1386294361119891)
    # DeepSeek-V3: mscale = mscale_all_dim = 1 -> 1.0 (the mscale^2 goes to the softmax scale)
    ds = jaxpos.YaRNScaling(40.0, 4096, mscale=1.0, mscale_all_dim=1.0)
    assert freqs(64, 1e4, ds)[1] == 1.0
    # mscale 1, mscale_all_dim 0.707: (0.1 ln 40 + 1) / (0.0707 ln 40 + 1)
    ds2 = jaxpos.YaRNScaling(40.0, 4096, mscale=1.0, mscale_all_dim=0.707)
    assert freqs(64, 1e4, ds2)[1] == pytest.approx(1.3688879454 / 1.2608037774)
    assert freqs(64, 1e4, jaxpos.YaRNScaling(4.0, 4096, attention_factor=0.5))[1] == 0.5


def test_yarn_zero_betas_mean_defaults_as_in_hf():
    a = freqs(64, 1e4, jaxpos.YaRNScaling(8.0, 4096, beta_fast=0.0, beta_slow=0.0))[0]
    b = freqs(64, 1e4, jaxpos.YaRNScaling(8.0, 4096))[0]
    np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------------- Llama 3
def ref_llama3(d, base, factor, low, high, L):
    """float64 of Meta's llama-models ``apply_scaling`` (Llama 3.1)."""
    out = []
    for f in base_inv_freq(d, base):
        wavelen = 2 * math.pi / f
        if wavelen < L / high:
            out.append(f)
        elif wavelen > L / low:
            out.append(f / factor)
        else:
            smooth = (L / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out)


def test_llama31_frequencies():
    s = jaxpos.Llama3Scaling(8.0, 1.0, 4.0, 8192)
    inv, af = freqs(128, 500000.0, s)
    np.testing.assert_allclose(inv, ref_llama3(128, 500000.0, 8.0, 1.0, 4.0, 8192), rtol=tol(5e5))
    assert af == 1.0
    f = base_inv_freq(128, 500000.0)
    wavelen = 2 * np.pi / f
    unchanged, divided = wavelen < 2048, wavelen > 8192
    np.testing.assert_allclose(inv[unchanged], f[unchanged], rtol=tol(5e5))
    np.testing.assert_allclose(inv[divided], f[divided] / 8, rtol=tol(5e5))
    band = ~unchanged & ~divided  # the smoothing band lies strictly between the two
    assert band.sum() > 0
    assert np.all((inv[band] < f[band]) & (inv[band] > f[band] / 8))


def test_llama3_bad_band():
    with pytest.raises(ValueError, match="high_freq_factor must be >= low_freq_factor"):
        jaxpos.Llama3Scaling(8.0, 4.0, 1.0, 8192)


def test_llama3_equal_factors_have_no_band():
    """Llama 4 Scout ships low_freq_factor = high_freq_factor = 1.0 (HF only warns): every
    wavelength above L is divided by the factor, every other kept, nothing smoothed."""
    inv, _ = jaxpos.rope_frequencies(128, 5e5, scaling=jaxpos.Llama3Scaling(16.0, 1.0, 1.0, 8192))
    f = np.asarray(jaxpos.rope_frequencies(128, 5e5)[0], np.float64)
    inv = np.asarray(inv, np.float64)
    long = 2 * np.pi / f > 8192
    assert 0 < long.sum() < len(f) and np.all(np.isfinite(inv))
    np.testing.assert_allclose(inv[long], f[long] / 16, rtol=1e-6)
    np.testing.assert_array_equal(inv[~long], f[~long])


# -------------------------------------------------------------------------------- LongRoPE
def test_longrope_short_and_long_factors():
    short = [1.0, 1.5, 2.0, 3.0]
    long = [2.0, 4.0, 8.0, 16.0]
    s = jaxpos.LongRoPEScaling(short, long, original_max_position_embeddings=4096, factor=32.0)
    f = base_inv_freq(8, 10000.0)
    inv_s, af = freqs(8, 10000.0, s, seq_len=4096)
    inv_l, af_l = freqs(8, 10000.0, s, seq_len=4097)
    np.testing.assert_allclose(inv_s, f / np.array(short), rtol=tol(1e4))
    np.testing.assert_allclose(inv_l, f / np.array(long), rtol=tol(1e4))
    # Phi-3 128k: sqrt(1 + ln(131072 / 4096) / ln(4096)), the same for short and long
    assert af == af_l == pytest.approx(1.1902380714238083)


def test_longrope_without_factor_has_unit_attention_factor():
    s = jaxpos.LongRoPEScaling([1.0], [2.0], original_max_position_embeddings=16)
    assert freqs(2, 10000.0, s)[1] == 1.0


def test_longrope_bad_lengths():
    with pytest.raises(ValueError, match="same length; got 2 and 3"):
        jaxpos.LongRoPEScaling([1.0, 1.0], [1.0, 1.0, 1.0], original_max_position_embeddings=16)
    s = jaxpos.LongRoPEScaling([1.0, 1.0], [1.0, 1.0], original_max_position_embeddings=16)
    with pytest.raises(ValueError, match="rotary_dim // 2 = 4 entries; got 2"):
        jaxpos.rope_frequencies(8, scaling=s)


# ---------------------------------------------------------------------------- proportional
def test_proportional_is_p_rope_over_factor():
    inv, _ = freqs(16, 10000.0, jaxpos.ProportionalScaling(partial_rotary_factor=0.25, factor=2.0))
    np.testing.assert_allclose(inv, np.r_[base_inv_freq(16, 1e4)[:2], np.zeros(6)] / 2.0,
                               rtol=tol(1e4))


# ---------------------------------------------------------------------- registry and input
def test_registry_names_follow_hf():
    assert set(S.ROPE_TYPES) == {"linear", "dynamic", "yarn", "llama3", "longrope", "proportional"}
    for name, cls in S.ROPE_TYPES.items():
        assert cls.rope_type == name


def test_dataclasses_are_hashable_static_fields():
    a = jaxpos.LongRoPEScaling([1.0, 2.0], [3.0, 4.0], original_max_position_embeddings=8)
    b = jaxpos.LongRoPEScaling((1.0, 2.0), (3.0, 4.0), original_max_position_embeddings=8)
    assert hash(a) == hash(b) and a == b


@pytest.mark.parametrize("make,err,msg", [
    (lambda: jaxpos.LinearScaling(0.0), ValueError, "LinearScaling.factor must be.*> 0; got 0.0"),
    (lambda: jaxpos.LinearScaling(float("nan")), ValueError, "LinearScaling.factor"),
    (lambda: jaxpos.DynamicNTKScaling(2.0, 4096.0), TypeError,
     "original_max_position_embeddings must be an int; got float"),
    (lambda: jaxpos.YaRNScaling(4.0, 0), ValueError,
     "original_max_position_embeddings must be > 0"),
    (lambda: jaxpos.YaRNScaling(4.0, 4096, beta_fast=-1.0), ValueError, "beta_fast must be"),
    (lambda: jaxpos.ProportionalScaling(partial_rotary_factor=2.0), ValueError, r"in \[0, 1\]"),
])
def test_bad_scaling_fields(make, err, msg):
    with pytest.raises(err, match=msg):
        make()


def test_unknown_scaling_type():
    with pytest.raises(TypeError, match="scaling must be None or one of.*got dict"):
        jaxpos.rope_frequencies(8, scaling={"rope_type": "linear", "factor": 2.0})


def test_scaling_from_dict():
    assert S.scaling_from_dict({"type": "linear", "factor": 2.0}) == jaxpos.LinearScaling(2.0)
    assert S.scaling_from_dict({"rope_type": "default"}) is None
    with pytest.raises(ValueError, match="rope_type must be one of.*'ntk'"):
        S.scaling_from_dict({"rope_type": "ntk", "factor": 2.0})
    with pytest.raises(ValueError, match="missing.*low_freq_factor"):
        S.scaling_from_dict({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192})


# ------------------------------------------------------- reading HF config dicts (no torch)
def test_hf_settings_per_layer_type_gemma3_style():
    from jaxpos.hf import hf_rope_settings, rope_from_hf_config
    cfg = {"head_dim": 256, "hidden_size": 2560, "num_attention_heads": 8,
           "max_position_embeddings": 131072,
           "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                  "rope_theta": 1000000.0},
                               "sliding_attention": {"rope_type": "default",
                                                     "rope_theta": 10000.0}}}
    full = rope_from_hf_config(cfg, layer_type="full_attention")
    assert (full.base, full.scaling, full.rotary_dim) == (1e6, jaxpos.LinearScaling(8.0), 256)
    assert hf_rope_settings(cfg, layer_type="sliding_attention")["scaling"] is None
    with pytest.raises(ValueError, match="per layer type.*layer_type"):
        rope_from_hf_config(cfg)


def test_hf_settings_gptj_interleaved_rotary_dim():
    from jaxpos.hf import rope_from_hf_config
    r = rope_from_hf_config({"model_type": "gptj", "n_embd": 4096, "n_head": 16, "rotary_dim": 64})
    assert (r.layout, r.rotary_dim, r.base) == ("interleaved", 64, 10000.0)


def test_hf_settings_need_head_width():
    from jaxpos.hf import rope_from_hf_config
    with pytest.raises(ValueError, match="head_dim, or hidden_size and num_attention_heads"):
        rope_from_hf_config({"rope_theta": 10000.0})
    with pytest.raises(TypeError, match="config must be a dict"):
        rope_from_hf_config(["not", "a", "config"])


@pytest.mark.parametrize("rope_scaling,match", [
    ({"rope_type": "linear", "factor": 0.5}, r"factor must be a number >= 1.*got 0.5"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
      "beta_fats": 16}, r"Unrecognized keys.*'yarn'.*\['beta_fats'\]"),
])
def test_hf_rope_dicts_that_hf_warns_about_warn(rope_scaling, match):
    """Hugging Face's rope_config_validation warns for a factor below 1 and for keys the
    type does not read (transformers/modeling_rope_utils.py); so does jaxpos.hf, while
    still building the scheme (as HF does)."""
    from jaxpos.hf import rope_from_hf_config
    cfg = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
           "max_position_embeddings": 16384, "rope_scaling": rope_scaling}
    with pytest.warns(UserWarning, match=match):
        rope = rope_from_hf_config(cfg)
    assert rope.scaling is not None


def test_hf_rope_dict_with_only_known_keys_does_not_warn():
    import warnings

    from jaxpos.hf import rope_from_hf_config
    cfg = {"model_type": "deepseek_v3", "hidden_size": 64, "num_attention_heads": 4,
           "qk_rope_head_dim": 8, "max_position_embeddings": 16384,
           "rope_scaling": {"type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
                            "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 4096}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rope_from_hf_config(cfg)


# ------------------------------------------------ Hugging Face config error messages
def test_hf_missing_fields_message_does_not_contradict_itself():
    cfg = dict(hidden_size=64, num_attention_heads=4,
               rope_scaling=dict(rope_type="llama3", factor=8.0, rope_theta=500000.0))
    with pytest.raises(ValueError) as info:
        jaxpos.rope_from_hf_config(cfg)
    msg = str(info.value)
    missing = eval(re.search(r"missing (\[.*?\])", msg).group(1))  # noqa: S307 (our message)
    got = eval(re.search(r"got keys (\[.*?\])", msg).group(1))  # noqa: S307
    assert "original_max_position_embeddings" in missing and not set(missing) & set(got), msg


def test_hf_scaling_dict_alone_asks_for_the_whole_config():
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192, rope_theta=500000.0)
    with pytest.raises(ValueError, match="whole model config") as info:
        jaxpos.rope_from_hf_config(scaling)
    assert "head width" not in str(info.value).split(":")[0]
    # The same dict inside a whole config works, and gives Llama 3's frequencies
    # (Meta's llama3 rule: wavelengths above 8192 / 1 divided by 8, below 8192 / 4 kept).
    s = jaxpos.hf.hf_rope_settings(dict(hidden_size=256, num_attention_heads=2,
                                        max_position_embeddings=131072, rope_scaling=scaling))
    assert (s["rotary_dim"], s["base"]) == (128, 500000.0)
    inv = np.asarray(jaxpos.rope_frequencies(128, s["base"], scaling=s["scaling"])[0])
    base = 500000.0 ** (-np.arange(0, 128, 2) / 128)
    wavelen = 2 * np.pi / base
    np.testing.assert_allclose(inv[wavelen < 8192 / 4], base[wavelen < 8192 / 4], rtol=1e-6)
    np.testing.assert_allclose(inv[wavelen > 8192], base[wavelen > 8192] / 8, rtol=1e-6)
