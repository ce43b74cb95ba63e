"""RoPE (Su et al. 2024): frequencies, rotation, layouts, precision, variants, the scheme.

References are float64 NumPy re-implementations of the paper's formulas and values
worked out by hand from them; none is a stored output of jaxpos.
"""

from __future__ import annotations

from decimal import Decimal, getcontext
from fractions import Fraction

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxpos
from jaxpos.schemes import rope as R
from jaxpos.schemes.rope.scaling import DynamicNTKScaling, LongRoPEScaling

# ------------------------------------------------------------------ float64 references


def ref_inv_freq(rotary_dim, base):
    """Su et al. eq. 15: theta_i = base ** (-2i / d), float64."""
    return base ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)


def ref_rope(x, pos, inv_freq, layout="half", factor=1.0):
    """float64 rotation of x [B, T, N, H] at integer positions [B, T] (exact angles)."""
    x = np.asarray(x, np.float64)
    f = np.asarray(inv_freq, np.float64)
    half = f.shape[0]
    ang = np.asarray(pos, np.float64)[..., None] * f  # exact: < 2^53
    c = np.cos(ang)[:, :, None, :] * factor
    s = np.sin(ang)[:, :, None, :] * factor
    out = x.copy()
    if layout == "half":
        i1, i2 = np.arange(half), np.arange(half) + half
    else:
        i1, i2 = np.arange(0, 2 * half, 2), np.arange(1, 2 * half, 2)
    x1, x2 = x[..., i1], x[..., i2]
    out[..., i1] = x1 * c - x2 * s
    out[..., i2] = x2 * c + x1 * s
    return out


# --------------------------------------------------------------------------- frequencies
def test_inv_freq_hand_values():
    # d = 4, base 10,000: omega = (1, 10000^(-1/2)) = (1, 0.01)  (Su et al. 2024, eq. 15)
    inv_freq, factor = jaxpos.rope_frequencies(4, 10000.0)
    np.testing.assert_allclose(np.asarray(inv_freq), [1.0, 0.01], rtol=1e-7)
    assert factor == 1.0 and inv_freq.dtype == jnp.float32


@pytest.mark.parametrize("rotary_dim,base", [(8, 10000.0), (64, 10000.0), (128, 500000.0),
                                             (96, 1e6), (24, 10000.0)])
def test_inv_freq_matches_formula(rotary_dim, base):
    inv_freq, _ = jaxpos.rope_frequencies(rotary_dim, base)
    # HF's order rounds the exponent 2i/d to float32 first: relative error up to
    # ln(base) * 2^-24 (8e-7 at base 1e6) on top of the final rounding.
    tol = np.log(base) * 2.0 ** -24 + 2.0 ** -23
    np.testing.assert_allclose(np.asarray(inv_freq), ref_inv_freq(rotary_dim, base), rtol=tol)


def test_inv_2pi_pieces_sum_to_one_over_two_pi():
    getcontext().prec = 70
    exact = Fraction(Decimal("0.1591549430918953357688837633725143620344596457404564487476673440"))
    total = sum(Fraction(k) for k in R.angles._INV_2PI)
    assert abs(float((total - exact) / exact)) < 2e-19


# ------------------------------------------------------------------------------- rotation
def test_apply_rope_hand_values_half_layout():
    # H = 4, inv_freq (1, 0.01), position 1: pair (x0, x2) turns by 1 rad, (x1, x3) by 0.01.
    x = np.array([1.0, 1.0, 0.0, 0.0], np.float32).reshape(1, 1, 1, 4)
    out = np.asarray(jaxpos.apply_rope(x, np.array([1]), jnp.array([1.0, 0.01])))[0, 0, 0]
    # cos 1, cos 0.01, sin 1, sin 0.01
    np.testing.assert_allclose(out, [0.5403023, 0.99995, 0.8414710, 0.00999983], atol=1e-6)


def test_apply_rope_hand_values_interleaved_layout():
    x = np.array([1.0, 0.0, 1.0, 0.0], np.float32).reshape(1, 1, 1, 4)
    out = np.asarray(jaxpos.apply_rope(x, np.array([2]), jnp.array([1.0, 0.01]),
                                       layout="interleaved"))[0, 0, 0]
    # pair (x0, x1) by 2 rad, (x2, x3) by 0.02 rad: (cos 2, sin 2) = (-0.416, 0.909)
    np.testing.assert_allclose(out, [-0.4161468, 0.9092974, 0.9998000, 0.0199987], atol=1e-6)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("precision", ["high", "float32"])
def test_apply_rope_matches_float64_reference(layout, precision, rng):
    B, T, N, H = 2, 5, 3, 8
    x = rng.normal(size=(B, T, N, H)).astype(np.float32)
    pos = rng.integers(0, 5000, size=(B, T)).astype(np.int32)
    inv_freq, _ = jaxpos.rope_frequencies(H, 10000.0)
    out = jaxpos.apply_rope(x, pos, inv_freq, layout=layout, angle_precision=precision)
    # "float32" angles carry HF's error, up to 5000 * 2^-24 rad per unit of |x| here
    tol = 3e-6 if precision == "high" else 5000 * 2.0 ** -24 * 4
    np.testing.assert_allclose(np.asarray(out), ref_rope(x, pos, inv_freq, layout), atol=tol)


class TestVariants(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_jit_and_eager_agree_with_reference(self):
        rng = np.random.default_rng(1)
        x = rng.normal(size=(1, 4, 2, 8)).astype(np.float32)
        pos = np.array([0, 7, 70000, 1_000_000], np.int32)
        inv_freq, _ = jaxpos.rope_frequencies(8, 10000.0)
        f = self.variant(lambda x, p, w: jaxpos.apply_rope(x, p, w))
        np.testing.assert_allclose(np.asarray(f(x, pos, inv_freq)),
                                   ref_rope(x, pos[None], inv_freq), atol=3e-6)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@settings(max_examples=8)
@given(m=st.integers(0, 10**6), n=st.integers(0, 10**6), shift=st.integers(-10**5, 10**5))
def test_scores_depend_only_on_offset(layout, m, n, shift):
    """q_m . k_n after rotation depends on the contents and m - n only (Su et al. §3.4.2)."""
    rng = np.random.default_rng(m % 97)
    q = rng.normal(size=(1, 1, 1, 16)).astype(np.float32)
    k = rng.normal(size=(1, 1, 1, 16)).astype(np.float32)
    inv_freq, _ = jaxpos.rope_frequencies(16, 10000.0)
    m2, n2 = max(m + shift, 0), max(n + shift, 0)
    m2, n2 = (m2, n2) if m2 - n2 == m - n else (m, n)

    def score(a, b):
        qr = jaxpos.apply_rope(q, np.array([a]), inv_freq, layout=layout)
        kr = jaxpos.apply_rope(k, np.array([b]), inv_freq, layout=layout)
        return float(jnp.sum(qr * kr))

    assert score(m, n) == pytest.approx(score(m2, n2), abs=2e-5)
    # and it equals the float64 score of the relative rotation by n - m
    ref = float(np.sum(ref_rope(q, np.array([[0]]), inv_freq, layout)
                       * ref_rope(k, np.array([[n - m]]), inv_freq, layout)))
    assert score(m, n) == pytest.approx(ref, abs=2e-5)


def test_partial_rotary_leaves_rest_unchanged(rng):
    x = rng.normal(size=(2, 3, 2, 10)).astype(np.float32)
    inv_freq, _ = jaxpos.rope_frequencies(4, 10000.0)  # rotary_dim 4 of head 10
    out = np.asarray(jaxpos.apply_rope(x, np.array([5, 6, 900]), inv_freq))
    np.testing.assert_array_equal(out[..., 4:], x[..., 4:])
    np.testing.assert_allclose(out[..., :4], ref_rope(x[..., :4], np.array([[5, 6, 900]]),
                                                      inv_freq), atol=2e-6)


def test_attention_factor_scales_rotated_features(rng):
    x = rng.normal(size=(1, 2, 1, 4)).astype(np.float32)
    inv_freq = jnp.array([1.0, 0.01])
    out = jaxpos.apply_rope(x, np.array([3, 4]), inv_freq, attention_factor=1.25)
    np.testing.assert_allclose(np.asarray(out), ref_rope(x, np.array([[3, 4]]), inv_freq,
                                                         factor=1.25), atol=3e-6)


# -------------------------------------------------------------------------- bad input
Q = np.zeros((1, 3, 2, 8), np.float32)


def test_bad_odd_rotary_width():
    with pytest.raises(ValueError, match="rotary_dim.*even.*7"):
        jaxpos.rope_frequencies(7)


def test_bad_rotary_dim_larger_than_head():
    with pytest.raises(ValueError, match=r"rotary_dim must be <= head_dim=8; got 10"):
        jaxpos.apply_rope(Q, np.arange(3), jnp.ones(5))


def test_bad_float_positions():
    with pytest.raises(TypeError, match="positions.*integer.*float32"):
        jaxpos.apply_rope(Q, np.arange(3, dtype=np.float32), jnp.ones(4))


def test_bad_positions_shape():
    with pytest.raises(ValueError, match=r"positions must have shape \[3\] or \[1, 3\].*\(4,\)"):
        jaxpos.apply_rope(Q, np.arange(4), jnp.ones(4))


def test_bad_unknown_layout():
    with pytest.raises(ValueError, match="layout must be one of.*'gptj'"):
        jaxpos.apply_rope(Q, np.arange(3), jnp.ones(4), layout="gptj")


def test_bad_unknown_angle_precision():
    with pytest.raises(ValueError, match="angle_precision must be one of.*'double'"):
        jaxpos.apply_rope(Q, np.arange(3), jnp.ones(4), angle_precision="double")


def test_bad_float_positions_in_high_precision_angles():
    with pytest.raises(TypeError, match="positions.*integer"):
        R.rope_angles(np.array([1.5]), jnp.ones(2))


# ------------------------------------------------------------------------------ precision
def _exact_angle_mod_2pi(p: int, f: np.float32) -> float:
    getcontext().prec = 70
    inv_2pi = Fraction(Decimal("0.1591549430918953357688837633725143620344596457404564487476673440"))  # noqa: E501 (1/(2 pi), 64 digits)
    turns = Fraction(p) * Fraction(float(f)) * inv_2pi
    return float(turns - round(turns)) * 2 * np.pi


def test_high_precision_angles_against_exact_arithmetic():
    rng = np.random.default_rng(3)
    pos = np.concatenate([[0, 1, 131072, 1_000_000, 2**28 - 1, -(2**27)],
                          rng.integers(0, 2**28, 40)]).astype(np.int32)
    f = np.asarray(jaxpos.rope_frequencies(128, 500000.0)[0])[::9]
    got = np.asarray(jax.jit(R.rope_angles)(pos, f))
    err = np.array([[np.angle(np.exp(1j * (got[i, j] - _exact_angle_mod_2pi(int(p), f[j]))))
                     for j in range(len(f))] for i, p in enumerate(pos)])
    assert np.abs(err).max() < 4e-7  # the documented bound
    assert np.all(np.abs(got) <= np.pi + 1e-6)  # reduced to [-pi, pi]


def test_float32_angles_are_hf_product_and_lose_precision():
    f = np.float32(1.0)
    p = 1_000_001
    got = float(R.rope_angles(np.array([p]), jnp.array([f]), angle_precision="float32")[0, 0])
    assert got == float(np.float32(p) * f)  # plain float32 product, HF's
    # float32 spacing at 1e6 is 0.0625: angles that far out are quantised
    assert np.float32(p + 0.03) == np.float32(p)


def test_bf16_rotation_at_position_one_million_within_bf16_rounding(rng):
    """Precision requirement: a bfloat16 input rotated at position 1,000,000 is within
    bfloat16 rounding of a float64 reference; HF's float32 angles are not."""
    H = 64
    x = rng.normal(size=(1, 4, 2, H)).astype(np.float32)
    xb = jnp.asarray(x, jnp.bfloat16)
    pos = np.array([999_997, 999_998, 999_999, 1_000_000], np.int32)
    inv_freq, _ = jaxpos.rope_frequencies(H, 10000.0)
    ref = ref_rope(np.asarray(xb, np.float64), pos[None], inv_freq)
    # half a bfloat16 ulp at the reference value (8 significant bits), plus float32 slack
    half_ulp = 2.0 ** (np.floor(np.log2(np.abs(ref))) - 8)
    hi = np.asarray(jaxpos.apply_rope(xb, pos, inv_freq), np.float64)
    assert np.all(np.abs(hi - ref) <= half_ulp + 1e-6)
    lo = np.asarray(jaxpos.apply_rope(xb, pos, inv_freq, angle_precision="float32"), np.float64)
    assert np.max(np.abs(lo - ref) / half_ulp) > 100  # HF's float32 angles: ~0.03 rad off


def test_high_precision_angles_gradient_is_position():
    pos = np.array([3, 1_000_000], np.int32)
    g = jax.jit(jax.grad(lambda f: jnp.sum(R.rope_angles(pos, f))))(jnp.array([0.5, 0.25]))
    np.testing.assert_array_equal(np.asarray(g), [1_000_003.0, 1_000_003.0])


# --------------------------------------------------------------------- layout conversion
def hf_permute(w, n_heads, dim1, dim2):
    """HF's convert_llama_weights_to_hf.py ``permute`` (torch [out, in] weights)."""
    return (w.reshape(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(0, 2, 1, 3)
            .reshape(dim1, dim2))


def test_interleaved_to_half_equals_hf_conversion_permute(rng):
    N, H, D = 3, 8, 5
    w = rng.normal(size=(N * H, D))
    np.testing.assert_array_equal(jaxpos.interleaved_to_half(w, head_dim=H, axis=0),
                                  hf_permute(w, N, N * H, D))


def test_layout_helpers_are_inverse_with_partial_rotary(rng):
    w = rng.normal(size=(4, 2 * 10)).astype(np.float32)
    h = jaxpos.interleaved_to_half(w, head_dim=10, rotary_dim=6)
    np.testing.assert_array_equal(h[:, 6:10], w[:, 6:10])  # pass-through features stay
    np.testing.assert_array_equal(jaxpos.half_to_interleaved(h, head_dim=10, rotary_dim=6), w)


def test_permuted_weights_give_same_attention(rng):
    """Meta (interleaved) weights with layout="interleaved" == HF-permuted weights with
    layout="half": equal attention outputs."""
    B, T, D, N, H = 1, 6, 12, 2, 8
    x = rng.normal(size=(B, T, D)).astype(np.float32)
    wq, wk, wv = (rng.normal(size=(D, N * H)).astype(np.float32) / 3 for _ in range(3))

    def run(wq, wk, layout):
        q, k, v = ((x @ w).reshape(B, T, N, H) for w in (wq, wk, wv))
        rope = jaxpos.RoPE(rotary_dim=H, layout=layout)
        return np.asarray(jaxpos.attention(q, k, v, position=rope, causal=True,
                                           implementation="reference"))

    meta = run(wq, wk, "interleaved")
    hf = run(jaxpos.interleaved_to_half(wq, head_dim=H), jaxpos.interleaved_to_half(wk, head_dim=H),
             "half")
    np.testing.assert_allclose(hf, meta, atol=2e-6)
    wrong = run(wq, wk, "half")  # the classic mix-up: unconverted weights, half layout
    assert np.abs(wrong - meta).max() > 1e-2


def test_layout_helper_bad_axis_size():
    with pytest.raises(ValueError, match="not a multiple of head_dim=8"):
        jaxpos.interleaved_to_half(np.zeros((3, 12)), head_dim=8)


# ------------------------------------------------------------------------------- variants
def test_p_rope_hand_values():
    # head_dim 8, base 10,000, p = 0.5: two of four frequencies kept: 1, 10000^(-2/8) = 0.1
    np.testing.assert_allclose(np.asarray(R.p_rope_frequencies(8, 10000.0, p=0.5)),
                               [1.0, 0.1, 0.0, 0.0], rtol=1e-7)


def test_p_rope_bad_fraction():
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\].*1.5"):
        R.p_rope_frequencies(8, p=1.5)


def test_mrope_equal_rows_is_plain_rope(rng):
    x = rng.normal(size=(2, 5, 2, 16)).astype(np.float32)
    pos = rng.integers(0, 1000, size=(2, 5)).astype(np.int32)
    inv_freq, _ = jaxpos.rope_frequencies(16, 10000.0)
    m = R.apply_mrope(x, np.stack([pos] * 3), inv_freq, mrope_section=(2, 3, 3))
    np.testing.assert_allclose(np.asarray(m), np.asarray(jaxpos.apply_rope(x, pos, inv_freq)),
                               atol=1e-6)


def test_mrope_sections_follow_their_rows(rng):
    inv_freq, _ = jaxpos.rope_frequencies(16, 10000.0)  # 8 frequencies: sections (2, 3, 3)
    pos = np.array([[[5]], [[7]], [[11]]], np.int32)  # t=5, h=7, w=11
    ang = np.asarray(R.mrope_angles(pos, inv_freq, mrope_section=(2, 3, 3)))[0, 0]
    f = np.asarray(inv_freq, np.float64)
    want = np.concatenate([5 * f[:2], 7 * f[2:5], 11 * f[5:]])
    np.testing.assert_allclose(np.angle(np.exp(1j * (ang - want))), 0, atol=4e-7)


def test_mrope_bad_sections():
    with pytest.raises(ValueError, match="mrope_section.*summing to rotary_dim // 2 = 8"):
        R.mrope_angles(np.zeros((3, 1, 2), np.int32), jnp.ones(8), mrope_section=(2, 2, 2))


def test_axial_rope_frequencies_hand_values():
    # head_dim 8: spatial dim 4, inv_freq = 1 / 10000 ** (arange(0, 4, 2) / 4) = (1, 0.01)
    np.testing.assert_allclose(np.asarray(R.axial_rope_frequencies(8)), [1.0, 0.01], rtol=1e-7)


def test_axial_rope_scores_depend_on_2d_offset_only(rng):
    inv_freq = R.axial_rope_frequencies(16)
    q = rng.normal(size=(1, 1, 1, 16)).astype(np.float32)
    k = rng.normal(size=(1, 1, 1, 16)).astype(np.float32)

    def score(qhw, khw):
        qr = R.apply_axial_rope(q, np.array([qhw]), inv_freq)
        kr = R.apply_axial_rope(k, np.array([khw]), inv_freq)
        return float(jnp.sum(qr * kr))

    assert score((1, 2), (4, 9)) == pytest.approx(score((11, 30), (14, 37)), abs=1e-5)
    assert abs(score((1, 2), (4, 9)) - score((1, 2), (9, 4))) > 1e-3  # h and w differ


def test_axial_rope_row_moves_first_half_of_pairs_only():
    inv_freq = R.axial_rope_frequencies(8)
    ang = np.asarray(R.axial_rope_angles(np.array([[3, 0]]), inv_freq))[0, 0]
    np.testing.assert_allclose(ang, [3.0, 0.03, 0.0, 0.0], atol=1e-6)


def test_axial_rope_bad_head_dim():
    with pytest.raises(ValueError, match="multiple of 4.*6"):
        R.axial_rope_frequencies(6)


# --------------------------------------------------------------------------- the scheme
def test_rope_scheme_is_pytree_with_static_fields():
    r = jaxpos.RoPE(rotary_dim=8, base=500000.0, angle_precision="float32")
    leaves, treedef = jax.tree_util.tree_flatten(r)
    assert len(leaves) == 1 and leaves[0].shape == (4,)
    r2 = jax.tree_util.tree_unflatten(treedef, leaves)
    assert (r2.base, r2.angle_precision, r2.rotary_dim) == (500000.0, "float32", 8)
    hash(treedef)  # static part hashable


def test_dynamic_ntk_uses_each_calls_length_no_stale_state():
    """A short call after a long one uses the unscaled base (no state kept between calls)."""
    scaling = DynamicNTKScaling(factor=4.0, original_max_position_embeddings=64)
    r = jaxpos.RoPE(rotary_dim=8, base=10000.0, scaling=scaling)
    freqs = jax.jit(lambda s, p: s.frequencies(p, p))
    long, _ = freqs(r, jnp.arange(200))
    short, _ = freqs(r, jnp.arange(10))
    # float64 formula: base' = base * (factor * 200/64 - 3) ** (8/6)
    base_long = 10000.0 * (4.0 * 200 / 64 - 3.0) ** (8 / 6)
    np.testing.assert_allclose(np.asarray(long), ref_inv_freq(8, base_long), rtol=2e-6)
    np.testing.assert_allclose(np.asarray(short), ref_inv_freq(8, 10000.0), rtol=3e-7)
    again, _ = freqs(r, jnp.arange(64))  # exactly L: unscaled
    np.testing.assert_array_equal(np.asarray(again), np.asarray(short))


def test_longrope_scheme_switches_per_call():
    s = LongRoPEScaling(short_factor=[1.0, 2.0], long_factor=[4.0, 8.0],
                        original_max_position_embeddings=16, factor=4.0)
    r = jaxpos.RoPE(rotary_dim=4, base=10000.0, scaling=s)
    short, af = r.frequencies(jnp.arange(16), jnp.arange(16))
    long, _ = r.frequencies(jnp.arange(3), jnp.arange(17))
    np.testing.assert_allclose(np.asarray(short), [1.0, 0.01 / 2.0], rtol=1e-7)
    np.testing.assert_allclose(np.asarray(long), [1 / 4.0, 0.01 / 8.0], rtol=1e-7)
    assert af == pytest.approx(np.sqrt(1 + np.log(4.0) / np.log(16)))


def test_rope_scheme_rejects_inv_freq_with_dynamic_scaling():
    with pytest.raises(ValueError, match="length-dependent scaling"):
        jaxpos.RoPE(jnp.ones(4), scaling=DynamicNTKScaling(2.0, 16))


def test_rope_scheme_in_attention_matches_manual_rotation(rng):
    B, T, N, H = 1, 5, 2, 8
    q, k, v = (rng.normal(size=(B, T, N, H)).astype(np.float32) for _ in range(3))
    pos = np.array([10, 11, 12, 500, 501], np.int32)
    r = jaxpos.RoPE(rotary_dim=6, base=10000.0)
    out = jaxpos.attention(q, k, v, position=r, q_positions=pos, kv_positions=pos,
                           implementation="reference")
    qr = ref_rope(q, pos[None], r.inv_freq)
    kr = ref_rope(k, pos[None], r.inv_freq)
    s = np.einsum("bqnh,bknh->bnqk", qr, kr) / np.sqrt(H)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(out), np.einsum("bnqk,bknh->bqnh", p, v), atol=2e-5)


def test_rope_scheme_rotate_mrope_positions(rng):
    x = rng.normal(size=(1, 3, 1, 16)).astype(np.float32)
    r = jaxpos.RoPE(rotary_dim=16, mrope_section=(2, 3, 3))
    pos3 = rng.integers(0, 100, size=(3, 1, 3)).astype(np.int32)
    np.testing.assert_allclose(
        np.asarray(r.rotate(x, pos3)),
        np.asarray(R.apply_mrope(x, pos3, r.inv_freq, mrope_section=(2, 3, 3))), atol=0)


def test_vmap_over_batch_equals_batched_call(rng):
    x = rng.normal(size=(3, 4, 2, 8)).astype(np.float32)
    pos = rng.integers(0, 10**6, size=(3, 4)).astype(np.int32)
    inv_freq, _ = jaxpos.rope_frequencies(8, 10000.0)
    per_row = jax.vmap(lambda xb, pb: jaxpos.apply_rope(xb[None], pb, inv_freq)[0])(x, pos)
    np.testing.assert_allclose(np.asarray(per_row),
                               np.asarray(jaxpos.apply_rope(x, pos, inv_freq)), atol=1e-6)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_gradient_is_inverse_rotation(layout, rng):
    """The rotation is orthogonal: d/dx sum(R_m x * y) = R_m^T y = R_{-m} y."""
    x = rng.normal(size=(1, 3, 1, 8)).astype(np.float32)
    y = rng.normal(size=(1, 3, 1, 8)).astype(np.float32)
    pos = np.array([5, 70000, 1_000_000], np.int32)
    inv_freq, _ = jaxpos.rope_frequencies(8, 10000.0)
    g = jax.grad(lambda x: jnp.sum(jaxpos.apply_rope(x, pos, inv_freq, layout=layout) * y))(x)
    np.testing.assert_allclose(np.asarray(g), ref_rope(y, -pos[None], inv_freq, layout), atol=3e-6)


# --------------------------------------------- apply_rope takes rope_frequencies's pair
def _np_rope_half_scaled(x, pos, inv_freq, factor=1.0):
    """float64 RoPE, "half" layout (Su et al. 2024, §3.4.2; HF's rotate_half)."""
    x = np.asarray(x, np.float64)
    half = len(inv_freq)
    ang = np.asarray(pos, np.float64)[:, None] * np.asarray(inv_freq, np.float64)[None]
    cos, sin = factor * np.cos(ang)[None, :, None], factor * np.sin(ang)[None, :, None]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * half:]], -1)


def test_apply_rope_accepts_the_pair_rope_frequencies_returns():
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (1, 5, 2, 8)))
    pos = np.arange(5) + 3
    inv_freq = 10000.0 ** (-np.arange(0, 8, 2) / 8)
    out = jaxpos.apply_rope(x, pos, jaxpos.rope_frequencies(8))
    np.testing.assert_allclose(np.asarray(out), _np_rope_half_scaled(x, pos, inv_freq), atol=1e-6)


def test_apply_rope_pair_carries_its_attention_factor():
    # YaRN (Peng et al. 2024, §3.4): attention_factor = 0.1 ln(factor) + 1 multiplies cos
    # and sin; taken from the pair, as if passed by hand.
    yarn = jaxpos.YaRNScaling(factor=4.0, original_max_position_embeddings=16)
    inv_freq, factor = jaxpos.rope_frequencies(8, scaling=yarn)
    assert factor == pytest.approx(0.1 * np.log(4.0) + 1)
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (1, 5, 2, 8)))
    pos = np.arange(5)
    out = jaxpos.apply_rope(x, pos, (inv_freq, factor))
    np.testing.assert_allclose(np.asarray(out),
                               _np_rope_half_scaled(x, pos, np.asarray(inv_freq), factor),
                               atol=1e-6)
    same = jaxpos.apply_rope(x, pos, (inv_freq, factor), attention_factor=1.0)
    np.testing.assert_array_equal(np.asarray(same), np.asarray(out))
    with pytest.raises(ValueError, match="attention_factor.*twice"):
        jaxpos.apply_rope(x, pos, (inv_freq, factor), attention_factor=2.0)


# ------------------------------------------- per-token work once per call (compiled HLO)
def _largest_array_beside_trig(hlo: str) -> list[int]:
    """For every computation of an optimised HLO module that evaluates ``cosine`` or
    ``sine`` (a fusion, a loop body), the element count of its largest array: a fused
    loop evaluates its cos once per element of that array."""
    import re

    sizes = []
    for comp in re.split(r"\n(?=\S)", hlo):
        if not re.search(r" (?:cosine|sine)\(", comp):
            continue
        dims = re.findall(r"f32\[([\d,]*)\]", comp)
        sizes.append(max(int(np.prod([int(d) for d in x.split(",") if d])) for x in dims))
    return sizes


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA CPU's fusion decisions")
@pytest.mark.parametrize("path", ["apply_rope", "rope_tables", "attention_chunked"])
def test_training_step_computes_each_tokens_cos_and_sin_once(path, rng):
    """The compiled gradient step evaluates cos and sin on the [1, T, half] tables only:
    XLA CPU fused the tables into the rotation of q [B, T, N, H] and recomputed each
    token's exact angle, cos and sin B * N times per pass (the chunked training step of a
    RoPE model took 1.3x NoPE's, attention alone 3x), and the values stay those of the
    float64 rotation."""
    B, T, N, H = 2, 16, 4, 8
    q, k, v, g = (jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32) for _ in range(4))
    pos = jnp.arange(T, dtype=jnp.int32) + 100
    scheme = jaxpos.RoPE(rotary_dim=H)
    if path == "apply_rope":
        def loss(q, k, v):
            return jnp.sum(jaxpos.apply_rope(q, pos, scheme.inv_freq) * g)
    elif path == "rope_tables":
        def loss(q, k, v):
            tabs = jaxpos.rope_tables(pos, pos, scheme.inv_freq)
            return jnp.sum(jaxpos.attention(q, k, v, rope_tables=tabs, causal=True,
                                            q_positions=pos, kv_positions=pos,
                                            implementation="chunked", block_q=8, block_k=8) * g)
    else:
        def loss(q, k, v):
            return jnp.sum(jaxpos.attention(q, k, v, position=scheme, causal=True,
                                            q_positions=pos, kv_positions=pos,
                                            implementation="chunked", block_q=8, block_k=8) * g)
    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    sizes = _largest_array_beside_trig(step.lower(q, k, v).compile().as_text())
    assert sizes and max(sizes) <= 2 * T * H // 2, sizes  # cos and sin [1, T, half]
    if path == "apply_rope":
        np.testing.assert_allclose(np.asarray(step(q, k, v)[0]),
                                   ref_rope(g, -np.asarray(pos)[None], scheme.inv_freq),
                                   atol=2e-6)
