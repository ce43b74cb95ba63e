"""Properties of jaxpos.attention, checked with the public jaxpos.testing assertions:
permutation equivariance of unmasked NoPE attention (and that a causal mask breaks it),
translation invariance of the relative schemes, and equality under jit, vmap and grad
(chex.variants).

Tolerances: float32 outputs of unit scale, ``atol = rtol = 2e-5``; a shift of all
positions by 1000 perturbs RoPE's float32 angles by up to ``1000 * 2**-24`` rad per unit
of ``inv_freq``, so RoPE's translation test uses ``atol = 2e-4``.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _attention_reference import make_params, make_scheme
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxpos
import jaxpos.testing as jt

TOL = {"atol": 2e-5, "rtol": 2e-5}
attn = jax.jit(jaxpos.attention,
               static_argnames=("causal", "scale", "implementation", "block_q", "block_k"))


def _x(seed, *shape):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


# ------------------------------------------------------------ permutation equivariance
T_PERM = 7


@settings(max_examples=8)
@given(perm=st.permutations(list(range(T_PERM))))
def test_unmasked_nope_attention_is_permutation_equivariant(perm):
    """No positions, no mask: permuting the tokens permutes the outputs (why Vaswani et
    al. 2017, §3.5, add positions). Both implementations."""
    q, k, v = _x(0, 2, T_PERM, 2, 8), _x(1, 2, T_PERM, 2, 8), _x(2, 2, T_PERM, 2, 8)
    for impl in ("reference", "chunked"):
        fn = lambda q, k, v, impl=impl: attn(q, k, v, implementation=impl, block_q=3, block_k=2)
        jt.assert_permutation_equivariant(fn, q, k, v, perm=perm, **TOL)


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_causal_mask_breaks_permutation_equivariance(impl):
    """A causal mask gives NoPE attention an order: the same check must fail."""
    q = _x(3, 1, T_PERM, 2, 8)
    fn = lambda x: attn(x, x, x, causal=True, implementation=impl, block_q=3, block_k=2)
    with pytest.raises(AssertionError, match="permutation-equivariant"):
        jt.assert_permutation_equivariant(fn, q, perm=[6, 5, 4, 3, 2, 1, 0], **TOL)
    # ... while the unmasked version of the same function passes.
    jt.assert_permutation_equivariant(
        lambda x: attn(x, x, x, implementation=impl, block_q=3, block_k=2), q,
        perm=[6, 5, 4, 3, 2, 1, 0], **TOL)


def test_rope_breaks_permutation_equivariance():
    """Positions enter the scores: RoPE attention is not permutation-equivariant."""
    q = _x(4, 1, T_PERM, 2, 8)
    rope = jaxpos.RoPE(rotary_dim=8)
    with pytest.raises(AssertionError):
        jt.assert_permutation_equivariant(
            lambda x: attn(x, x, x, position=rope, implementation="reference"), q, **TOL)


# ------------------------------------------------------------ translation invariance
@pytest.mark.parametrize("name", ["rope", "alibi", "t5", "shaw"])
def test_relative_schemes_are_translation_invariant(name):
    """All positions + 1000 give the same scores and outputs (reference and chunked,
    causal, GQA, Tq != Tk with per-row offsets)."""
    B, Tq, Tk, N, Nk, H = 2, 4, 6, 4, 2, 8
    q, k, v = _x(5, B, Tq, N, H), _x(6, B, Tk, Nk, H), _x(7, B, Tk, Nk, H)
    scheme = make_scheme(name, make_params(name, N, H, np.random.default_rng(8),
                                           bidirectional=False))
    kv_pos = np.array([np.arange(Tk), np.arange(Tk) + 5], np.int32)
    q_pos = kv_pos[:, -Tq:]
    tol = {"atol": 2e-4, "rtol": 2e-5} if name == "rope" else TOL

    scores = jax.jit(lambda qp, kp: jt.attention_scores(q, k, position=scheme, q_positions=qp,
                                                       kv_positions=kp))
    jt.assert_translation_invariant(scores, q_pos, kv_pos, shift=1000, **tol)
    for impl in ("reference", "chunked"):
        out = lambda qp, kp, impl=impl: attn(q, k, v, position=scheme, q_positions=qp,
                                             kv_positions=kp, causal=True, implementation=impl,
                                             block_q=2, block_k=4)
        jt.assert_translation_invariant(out, q_pos, kv_pos, shift=1000, **tol)


def test_absolute_positions_are_not_translation_invariant():
    """The negative control: sinusoidal encodings added to the inputs (absolute
    positions) fail the same check."""
    B, T, N, H = 1, 5, 2, 8
    x = _x(9, B, T, N, H)

    def out(qp, kp):
        pe = jaxpos.sinusoidal_pe(2000, H)  # rows 0 .. 1999
        xq = x + pe[qp][None, :, None, :]
        xk = x + pe[kp][None, :, None, :]
        return attn(xq, xk, xk, implementation="reference")

    with pytest.raises(AssertionError, match="shift"):
        jt.assert_translation_invariant(out, np.arange(T), np.arange(T), shift=1000, **TOL)


# ------------------------------------------------------------ jit / vmap / grad
class TransformsTest(chex.TestCase):
    """The same values eagerly and under jit (chex.variants), and under vmap."""

    def setUp(self):
        super().setUp()
        B, T, N, H = 2, 6, 2, 8
        self.q, self.k, self.v = _x(10, B, T, N, H), _x(11, B, T, N, H), _x(12, B, T, N, H)
        self.schemes = {
            "alibi": jaxpos.ALiBi(num_heads=N),
            "rope": jaxpos.RoPE(rotary_dim=H),
            "t5": jaxpos.T5Bias(_x(13, 32, N), bidirectional=False),
        }

    @chex.variants(with_jit=True, without_jit=True)
    def test_chunked_forward_and_grad_equal_under_jit(self):
        """Eager and jitted chunked attention (a custom VJP over scans) give the values
        and gradients of the jitted reference, including the T5 table's gradient."""
        scheme = self.schemes["t5"]

        def loss(impl):
            def f(q, k, v, scheme):
                out = jaxpos.attention(q, k, v, position=scheme, causal=True,
                                       implementation=impl, block_q=4, block_k=4)
                return jnp.sum(out ** 2)
            return jax.value_and_grad(f, argnums=(0, 1, 2, 3))

        got = self.variant(loss("chunked"))(self.q, self.k, self.v, scheme)
        want = jax.jit(loss("reference"))(self.q, self.k, self.v, scheme)
        chex.assert_trees_all_close(got, want, atol=1e-4, rtol=1e-4)

    @chex.variants(with_jit=True, without_jit=True)
    def test_reference_equal_under_jit(self):
        for scheme in self.schemes.values():
            f = lambda q, k, v, s: jaxpos.attention(q, k, v, position=s, causal=True,
                                                    implementation="reference")
            chex.assert_trees_all_close(self.variant(f)(self.q, self.k, self.v, scheme),
                                        jax.jit(f)(self.q, self.k, self.v, scheme), **TOL)

    def test_vmap_over_an_extra_batch_axis(self):
        """vmap over a leading axis (e.g. ensembles) equals one call per slice."""
        stack = lambda x: np.stack([x, 2.0 * x[::-1]])
        for impl, name in (("reference", "t5"), ("chunked", "alibi"), ("chunked", "rope")):
            jt.assert_equal_under_vmap(
                lambda q, k, v, s, impl=impl: jaxpos.attention(q, k, v, position=s, causal=True,
                                                               implementation=impl),
                stack(self.q), stack(self.k), stack(self.v), self.schemes[name],
                in_axes=(0, 0, 0, None), atol=2e-5, rtol=2e-5)

    def test_vmap_over_scheme_parameters(self):
        """Schemes are pytrees: vmap over two ALiBi slope vectors."""
        slopes = np.stack([np.asarray(self.schemes["alibi"].slopes),
                           np.array([0.9, 0.1], np.float32)])
        fn = lambda s: jaxpos.attention(self.q, self.k, self.v, position=jaxpos.ALiBi(slopes=s),
                                        causal=True, implementation="chunked")
        jt.assert_equal_under_vmap(fn, slopes, atol=2e-5, rtol=2e-5)
