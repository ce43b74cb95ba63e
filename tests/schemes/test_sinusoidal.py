"""Sinusoidal positions (Vaswani et al. 2017, §3.5): table values worked out by hand from
the paper's formula, and the properties that follow from it (a shift is a rotation, dot
products depend on the offset only, relative_head_W); tensor2tensor's spacing
(``get_timing_signal_1d``) and Hugging Face's M2M100 / Marian tables for the variants.

References are float64 NumPy written out in this file, never the library itself.
"""

from __future__ import annotations

import functools
import itertools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpos import relative_head_W, shift_matrix, sinusoidal_pe
from jaxpos.schemes.sinusoidal import sinusoidal_frequencies


def np_sinusoid(positions, d, base=10000.0, layout="interleaved"):
    """float64 reference: column 2i = sin(pos * base**(-2i/d)), 2i+1 = cos.

    Odd d: the last cosine is dropped.
    """
    pos = np.asarray(positions, np.float64)[:, None]
    i = np.arange((d + 1) // 2, dtype=np.float64)
    angle = pos * base ** (-2.0 * i / d)
    s, c = np.sin(angle), np.cos(angle)
    if layout == "interleaved":
        out = np.empty((len(pos), 2 * len(i)))
        out[:, 0::2], out[:, 1::2] = s, c
        return out[:, :d]
    return np.concatenate([s, c[:, : d - len(i)]], axis=1)


# ------------------------------------------------------- values from the paper's formula
def test_d4_table_matches_hand_computed_values():
    # Vaswani et al. 2017, §3.5 with d = 4, base 10000: omega = (1, 0.01); e.g. row 2 is
    # (sin 2, cos 2, sin 0.02, cos 0.02) = (0.909, -0.416, 0.020, 1.000) to 3 decimals.
    expected = np.array([
        [0.0, 1.0, 0.0, 1.0],
        [0.841, 0.540, 0.010, 1.000],
        [0.909, -0.416, 0.020, 1.000],
        [0.141, -0.990, 0.030, 1.000],
    ])
    P = np.asarray(sinusoidal_pe(4, 4))
    assert P.shape == (4, 4) and P.dtype == np.float32
    np.testing.assert_array_equal(np.round(P.astype(np.float64), 3) + 0.0, expected)


@pytest.mark.parametrize("d, wavelength", [(16, 19_869), (512, 60_611)])
def test_slowest_wavelength(d, wavelength):
    # §3.5: the slowest pair has omega = base**(-2(d/2 - 1)/d), wavelength
    # 2*pi*base**(1 - 2/d) = 19,869 positions for d = 16, 60,611 for d = 512.
    omega_last = sinusoidal_frequencies(d)[-1]
    assert round(2 * math.pi / omega_last) == wavelength
    # The table itself: the slowest sine column completes one turn in that many positions.
    quarter = wavelength / 4
    pos = np.round(np.array([0, 1, 2, 3, 4]) * quarter).astype(np.int32)
    col = np.asarray(sinusoidal_pe(1, d, offset=pos))[:, 0, d - 2]
    np.testing.assert_allclose(col, [0, 1, 0, -1, 0], atol=2e-4)


def test_slowest_wavelength_approaches_2pi_base():
    # §3.5 ("wavelengths form a geometric progression from 2*pi to 10000 * 2*pi"): the
    # slowest wavelength approaches 2*pi*10000, about 62,832, as d grows.
    assert round(2 * math.pi * 10000) == 62_832
    waves = [2 * math.pi / sinusoidal_frequencies(d)[-1] for d in (16, 64, 512, 4096, 65536)]
    assert all(a < b for a, b in itertools.pairwise(waves))
    assert all(w < 2 * math.pi * 10000 for w in waves)
    assert abs(waves[-1] / (2 * math.pi * 10000) - 1) < 1e-3


def test_norm_squared_is_half_d():
    # sin^2 + cos^2 = 1 per pair: ||P[t]||^2 = d/2 for every t.
    for d in (4, 64, 512):
        P = np.asarray(sinusoidal_pe(1000, d), np.float64)
        np.testing.assert_allclose(np.sum(P**2, axis=-1), d / 2, rtol=1e-5)


def test_neighbour_distance_constant_d512():
    # ||P[t+1] - P[t]||^2 = sum_i 2 - 2 cos(omega_i) is the same for all t: 13.8 for
    # d = 512 (distance 3.7), from that sum in float64 below.
    t = np.array([0, 1, 7, 100, 999, 4000], np.int32)
    P = np.asarray(sinusoidal_pe(2, 512, offset=t), np.float64)  # [6, 2, 512]
    sq = np.sum((P[:, 1] - P[:, 0]) ** 2, axis=-1)
    np.testing.assert_allclose(sq, sq[0], atol=2e-3)
    exact = np.sum(2 - 2 * np.cos(10000.0 ** (-np.arange(0, 512, 2) / 512)))
    assert round(float(sq[0]), 1) == round(float(exact), 1) == 13.8
    assert round(math.sqrt(sq[0]), 1) == 3.7


@settings(max_examples=30)
@given(t1=st.integers(0, 3000), t2=st.integers(0, 3000), k=st.integers(-500, 500))
def test_dot_product_depends_on_offset_only(t1, t2, k):
    # cos(a) cos(b) + sin(a) sin(b) = cos(a - b): P[t] . P[t+k] = sum_i cos(k omega_i).
    d = 64
    t1, t2 = max(t1, -k), max(t2, -k)  # keep every position >= 0
    P = np.asarray(sinusoidal_pe(1, d, offset=np.array([t1, t1 + k, t2, t2 + k], np.int32)),
                   np.float64)[:, 0]
    expected = np.sum(np.cos(k * 10000.0 ** (-np.arange(0, d, 2) / d)))
    np.testing.assert_allclose(P[0] @ P[1], expected, atol=5e-3)
    np.testing.assert_allclose(P[2] @ P[3], expected, atol=5e-3)


def test_dot_product_symmetric_and_tends_to_fall():
    # sum_i cos(k omega_i) is symmetric in k, and tends to fall with |k| (not
    # monotonically).
    d, t = 64, 2000
    P = np.asarray(sinusoidal_pe(2 * t + 1, d), np.float64)
    k = np.arange(1, t + 1)
    fwd, bwd = P[t + k] @ P[t], P[t - k] @ P[t]
    np.testing.assert_allclose(fwd, bwd, atol=2e-3)
    sim = fwd / (d / 2)
    assert np.any(np.diff(sim) > 0)  # not monotonic
    window_means = [sim[a:b].mean() for a, b in [(0, 16), (16, 64), (64, 256), (256, 1000),
                                                 (1000, 2000)]]
    assert all(a > b for a, b in itertools.pairwise(window_means))


@pytest.mark.parametrize("k, expected", [(64, 0.43), (1000, 0.28)])
def test_base_10000_similarity(k, expected):
    # Normalised similarity P[0].P[k] / (d/2) = mean_i cos(k omega_i) with base 10000 and
    # d = 64 falls gradually: 0.43 at k = 64, 0.28 at k = 1000 (the float64 sum below;
    # d = 32 gives 0.54 and 0.26, d = 128 gives 0.48 and 0.16).
    d = 64
    P = np.asarray(sinusoidal_pe(k + 1, d), np.float64)
    exact = np.mean(np.cos(k * 10000.0 ** (-np.arange(0, d, 2) / d)))
    assert round(float(P[0] @ P[k] / (d / 2)), 2) == round(float(exact), 2) == expected


def test_base_100_similarity_and_wavelength():
    # With base 100 (d = 64) every pair turns fast: offsets 64 and 1000 are both near 0
    # and the longest wavelength is 2*pi*100**(1 - 2/64) = 544 positions.
    d = 64
    P = np.asarray(sinusoidal_pe(1001, d, base=100.0), np.float64)
    for k in (64, 1000):
        assert abs(P[0] @ P[k] / (d / 2)) < 0.05
    wavelength = 2 * math.pi / sinusoidal_frequencies(d, base=100.0)[-1]
    assert round(wavelength, -1) == 540


# -------------------------------------------------------------------- shift matrix
@settings(max_examples=30)
@given(t=st.integers(0, 2000), k=st.integers(-1000, 1000))
def test_shift_property(t, k):
    # §3.5's motivation: P[t + k] is a linear function of P[t], the rotation M_k.
    d = 16
    t = max(t, -k)
    P = np.asarray(sinusoidal_pe(1, d, offset=np.array([t, t + k], np.int32)))[:, 0]
    M = np.asarray(shift_matrix(k, d))
    np.testing.assert_allclose(M @ P[0], P[1], atol=5e-4)
    np.testing.assert_allclose(M @ np_sinusoid([t], d)[0], np_sinusoid([t + k], d)[0],
                               atol=1e-6)


@pytest.mark.parametrize("k", [1, 5, 37, 1000])
def test_shift_matrix_inverse_is_transpose(k):
    # A rotation's inverse is its transpose: M_{-k} = M_k^T (and M_k != M_k^T, so the
    # rotation tells before from after).
    d = 8
    M, Mneg = np.asarray(shift_matrix(k, d)), np.asarray(shift_matrix(-k, d))
    np.testing.assert_allclose(Mneg, M.T, atol=1e-7)
    np.testing.assert_allclose(M @ M.T, np.eye(d), atol=1e-6)
    assert np.abs(M - M.T).max() > 1e-3
    # block diagonal: one 2x2 rotation by k*omega_i per pair, zeros elsewhere
    omega = 10000.0 ** (-np.arange(0, d, 2) / d)
    for i, w in enumerate(omega):
        c, s = math.cos(k * w), math.sin(k * w)
        np.testing.assert_allclose(M[2 * i:2 * i + 2, 2 * i:2 * i + 2], [[c, s], [-s, c]],
                                   atol=1e-7)
    off = M.copy()
    for i in range(d // 2):
        off[2 * i:2 * i + 2, 2 * i:2 * i + 2] = 0
    assert not off.any()


@pytest.mark.parametrize("k", [1, 3, -2, 10])
def test_relative_head_W_peak(k):
    # With W = c M_k, p_m W p_n = c p_{m-k} . p_n (M_k^T = M_{-k}), which peaks at
    # n = m - k with value c * ||p||^2 = c * d / 2.
    d, c, T = 64, 8.0, 64
    P = np.asarray(sinusoidal_pe(T, d), np.float64)
    W = np.asarray(relative_head_W(k, d, c), np.float64)
    scores = P @ W @ P.T  # [m, n]
    for m in (20, 33, 50):
        assert int(np.argmax(scores[m])) == m - k
        np.testing.assert_allclose(scores[m, m - k], c * d / 2, rtol=1e-5)
        assert c * d / 2 == 256.0
    # the score depends on m - n only
    np.testing.assert_allclose(np.diagonal(scores, offset=3), scores[0, 3], atol=2e-3)


# ---------------------------------------------------------- odd d, concat, offset
@pytest.mark.parametrize("d", [1, 3, 5, 7])
@pytest.mark.parametrize("layout", ["interleaved", "concat"])
def test_odd_width_and_layouts(d, layout):
    positions = np.arange(0, 50, 7)
    P = np.asarray(sinusoidal_pe(50, d, layout=layout))[positions]
    np.testing.assert_allclose(P, np_sinusoid(positions, d, layout=layout), atol=2e-6)


def test_concat_layout_is_a_column_permutation():
    # tensor2tensor layout: [sin w0, sin w1, sin w2, cos w0, cos w1, cos w2] for d = 6.
    inter = np.asarray(sinusoidal_pe(20, 6))
    concat = np.asarray(sinusoidal_pe(20, 6, layout="concat"))
    np.testing.assert_array_equal(concat, inter[:, [0, 2, 4, 1, 3, 5]])


def test_offset_scalar_negative_and_batched():
    d = 8
    full = np.asarray(sinusoidal_pe(40, d))
    np.testing.assert_allclose(np.asarray(sinusoidal_pe(10, d, offset=7)), full[7:17], atol=1e-6)
    np.testing.assert_allclose(np.asarray(sinusoidal_pe(3, d, offset=-2)),
                               np_sinusoid([-2, -1, 0], d), atol=1e-6)
    batched = np.asarray(sinusoidal_pe(5, d, offset=np.array([0, 3, 30], np.int32)))
    assert batched.shape == (3, 5, d)
    for b, o in enumerate((0, 3, 30)):
        np.testing.assert_allclose(batched[b], np_sinusoid(np.arange(o, o + 5), d), atol=1e-6)


def test_dtype_option():
    P = sinusoidal_pe(8, 16, dtype=jnp.bfloat16)
    assert P.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(P, np.float32), np_sinusoid(np.arange(8), 16),
                               atol=8e-3)
    assert sinusoidal_pe(0, 4).shape == (0, 4)


# --------------------------------------------------------------- eager, jit, vmap
class TransformsTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_pe_with_traced_offset(self):
        f = self.variant(lambda off: sinusoidal_pe(6, 10, offset=off))
        for off in (0, 5, 123):
            chex.assert_trees_all_close(f(jnp.int32(off)), np_sinusoid(np.arange(off, off + 6), 10),
                                        atol=2e-5)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(1, -4, 250)
    def test_shift_matrix_traced_k(self, k):
        f = self.variant(lambda kk: shift_matrix(kk, 8))
        chex.assert_trees_all_close(f(jnp.int32(k)), shift_matrix(k, 8), atol=1e-5)
        g = self.variant(lambda kk, c: relative_head_W(kk, 8, c))
        chex.assert_trees_all_close(g(jnp.int32(k), jnp.float32(3.0)), 3.0 * shift_matrix(k, 8),
                                    atol=3e-5)

    def test_vmap_matches_batched(self):
        offsets = jnp.array([0, 2, 9], jnp.int32)
        per_row = jax.vmap(functools.partial(sinusoidal_pe, 4, 6))(offset=offsets)
        chex.assert_trees_all_close(per_row, sinusoidal_pe(4, 6, offset=offsets), atol=0)
        ks = jnp.array([-3, 0, 5], jnp.int32)
        stacked = jax.vmap(lambda kk: shift_matrix(kk, 6))(ks)
        chex.assert_trees_all_close(stacked, jnp.stack([shift_matrix(int(k), 6) for k in ks]),
                                    atol=1e-5)


# -------------------------------------------------------------------- bad input
BAD_INPUTS = [
    ("T", ValueError, lambda: sinusoidal_pe(-1, 4), "-1"),
    ("T", TypeError, lambda: sinusoidal_pe(4.0, 4), "4.0"),
    ("d", ValueError, lambda: sinusoidal_pe(4, 0), "0"),
    ("d", TypeError, lambda: sinusoidal_pe(4, np.float32(4)), "float32"),
    ("layout", ValueError, lambda: sinusoidal_pe(4, 4, layout="blocked"), "'blocked'"),
    ("offset", TypeError, lambda: sinusoidal_pe(4, 4, offset=1.5), "float"),
    ("offset", ValueError, lambda: sinusoidal_pe(4, 4, offset=np.zeros((2, 2), np.int32)),
     "(2, 2)"),
    ("base", ValueError, lambda: sinusoidal_pe(4, 4, base=0.0), "0.0"),
    ("d", ValueError, lambda: shift_matrix(1, 5), "5"),
    ("k", TypeError, lambda: shift_matrix(1.5, 4), "float"),
    ("k", ValueError, lambda: shift_matrix(np.array([1, 2]), 4), "(2,)"),
    ("d", ValueError, lambda: relative_head_W(1, 3), "3"),
    ("spacing", ValueError, lambda: sinusoidal_pe(4, 4, spacing="fairseq"), "'fairseq'"),
    ("spacing", ValueError, lambda: sinusoidal_frequencies(4, spacing="t2t"), "'t2t'"),
    ("spacing", ValueError, lambda: shift_matrix(1, 4, spacing=None), "None"),
]


@pytest.mark.parametrize("argument, error, call, got", BAD_INPUTS,
                         ids=[f"{a}-{e.__name__}-{i}" for i, (a, e, _, _) in enumerate(BAD_INPUTS)])
def test_bad_input(argument, error, call, got):
    with pytest.raises(error) as info:
        call()
    msg = str(info.value)
    assert msg.startswith(argument + " "), msg  # names the argument
    assert "got" in msg and got in msg, msg  # and what it got


@pytest.mark.parametrize("spacing", ["vaswani", "tensor2tensor"])
@pytest.mark.parametrize("layout", ["interleaved", "concat"])
def test_high_angle_precision_is_exact_for_the_float64_frequencies(layout, spacing):
    """``angle_precision="high"`` is exact relative to the paper's frequencies in float64
    (not their float32 rounding): at offsets 1e6 and 1e7 the table matches a float64
    table to 1e-6, while the default float32 product, and even the exact product with
    float32-rounded frequencies, are off by more than 1e-2 at 1e6."""
    d, T = 64, 8
    omega = np_frequencies(d, spacing=spacing)  # float64
    omega_f32 = omega.astype(np.float32).astype(np.float64)
    for offset in (1_000_000, 10_000_000):
        pos = np.arange(T, dtype=np.float64) + offset
        want = np_table(pos[:, None] * omega[None], d, layout)
        high = np.asarray(sinusoidal_pe(T, d, offset=offset, layout=layout, spacing=spacing,
                                        angle_precision="high"))
        np.testing.assert_allclose(high, want, atol=1e-6, rtol=0)
        if offset == 1_000_000:
            plain = np.asarray(sinusoidal_pe(T, d, offset=offset, layout=layout,
                                             spacing=spacing))
            assert np.abs(plain - want).max() > 1e-2
            rounded = np_table(pos[:, None] * omega_f32[None], d, layout)
            assert np.abs(rounded - want).max() > 1e-2
    np.testing.assert_array_equal(sinusoidal_pe(T, d, offset=5, angle_precision="float32"),
                                  sinusoidal_pe(T, d, offset=5))
    with pytest.raises(ValueError, match="angle_precision"):
        sinusoidal_pe(T, d, angle_precision="f64")


# ------------------------------------------------------------ tensor2tensor spacing
def np_frequencies(d, base=10000.0, spacing="vaswani"):
    """float64 frequencies: base**(-2i/d), i < ceil(d/2) (Vaswani et al. §3.5), or
    tensor2tensor's get_timing_signal_1d: d//2 timescales from 1 to base in geometric
    progression, log increment log(base) / max(d//2 - 1, 1)."""
    if spacing == "vaswani":
        return base ** (-2.0 * np.arange((d + 1) // 2) / d)
    n = d // 2
    return np.exp(np.arange(n) * -(math.log(base) / max(n - 1, 1)))


def np_table(angle, d, layout):
    """sin/cos of ``angle`` [T, n] in ``layout``, cut to d columns or zero-padded to d."""
    s, c = np.sin(angle), np.cos(angle)
    if layout == "interleaved":
        out = np.stack([s, c], -1).reshape(len(angle), -1)
    else:
        out = np.concatenate([s, c], -1)
    if out.shape[1] >= d:
        return out[:, :d]
    return np.concatenate([out, np.zeros((len(angle), d - out.shape[1]))], -1)


@pytest.mark.parametrize("d", [1, 2, 3, 8, 9, 512])
def test_tensor2tensor_spacing_matches_get_timing_signal_1d(d):
    # tensor2tensor's table: layout "concat" (sines, then cosines), a zero column for odd d.
    T = 40
    got = np.asarray(sinusoidal_pe(T, d, layout="concat", spacing="tensor2tensor"))
    pos = np.arange(T, dtype=np.float64)
    want = np_table(pos[:, None] * np_frequencies(d, spacing="tensor2tensor")[None], d, "concat")
    np.testing.assert_allclose(got, want, atol=5e-6)  # float32 angles up to 40 rad


def test_tensor2tensor_spacing_differs_from_the_paper():
    # The slowest timescale is exactly base in tensor2tensor (wavelength 2*pi*10000 =
    # 62,832) but base**(1 - 2/d) in the paper (60,611 at d = 512): there the paper's
    # frequency is 10000**(2/512) = 1.0366 times tensor2tensor's (3.7% apart).
    t2t = sinusoidal_frequencies(512, spacing="tensor2tensor")
    paper = sinusoidal_frequencies(512)
    assert t2t.shape == paper.shape == (256,)
    assert round(2 * math.pi / t2t[-1]) == 62_832 and round(2 * math.pi / paper[-1]) == 60_611
    np.testing.assert_allclose(paper[-1] / t2t[-1], 10000.0 ** (2 / 512))
    assert round(paper[-1] / t2t[-1] - 1, 3) == 0.037
    assert t2t[0] == paper[0] == 1.0


@pytest.mark.parametrize("k", [1, 7, -30])
def test_shift_matrix_for_tensor2tensor_spacing(k):
    d, t = 16, 100
    P = np.asarray(sinusoidal_pe(1, d, offset=np.array([t, t + k]), spacing="tensor2tensor"))
    M = np.asarray(shift_matrix(k, d, spacing="tensor2tensor"))
    np.testing.assert_allclose(M @ P[0, 0], P[1, 0], atol=5e-5)
    W = np.asarray(relative_head_W(k, d, 2.0, spacing="tensor2tensor"))
    np.testing.assert_allclose(W, 2.0 * M)


@pytest.mark.parity
def test_tables_match_hugging_face_m2m100_and_marian():
    """HF's M2M100 table (tensor2tensor/fairseq) is spacing="tensor2tensor",
    layout="concat"; Marian's is the paper's spacing with layout="concat" (odd d: the
    last cosine dropped). float32 PyTorch vs float32 JAX."""
    pytest.importorskip("torch")
    m2m = pytest.importorskip("transformers.models.m2m_100.modeling_m2m_100")
    marian = pytest.importorskip("transformers.models.marian.modeling_marian")
    for d in (8, 9, 64):
        ref = m2m.M2M100SinusoidalPositionalEmbedding.get_embedding(50, d).numpy()
        got = np.asarray(sinusoidal_pe(50, d, layout="concat", spacing="tensor2tensor"))
        np.testing.assert_allclose(got, ref, atol=5e-6)
        emb = marian.MarianSinusoidalPositionalEmbedding(50, d)
        ref = emb.create_weight().numpy()
        got = np.asarray(sinusoidal_pe(50, d, layout="concat"))
        np.testing.assert_allclose(got, ref, atol=5e-6)
