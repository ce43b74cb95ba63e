"""The fused Pallas kernel (jaxpos.kernels) in interpret mode, against the reference.

Every kernel output starts as NaN (``POISON_OUTPUTS``), so an element the kernel does not
write fails the comparison. Tolerances (measured max errors were about 10x smaller):

* float32: forward and every gradient within ``atol = rtol = 2e-5`` (float32 dots at
  HIGHEST precision; only the summation order differs from the reference).
* bfloat16: inputs and output in bfloat16, the probabilities cast to bfloat16 before
  ``p @ v`` (as FlashAttention does); forward within ``atol = rtol = 3e-2`` of the float32
  reference on the same inputs, gradients within ``6e-2``.

Shapes are tiny because the Pallas interpreter is slow on CPU; one case per scheme
combines several stresses (padding, ``Tq != Tk``, causal with ``block_q > block_k``,
segment ids, grouped-query heads).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jaxpos.kernels import fused, fused_attention, supports_scheme
from jaxpos.kernels.dispatch import t5_offset_bias

import jaxpos
from jaxpos import t5_bucket

F32_TOL = {"atol": 2e-5, "rtol": 2e-5}
BF16_TOL = {"atol": 3e-2, "rtol": 3e-2}
BF16_GRAD_TOL = {"atol": 6e-2, "rtol": 6e-2}


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(fused, "POISON_OUTPUTS", True)


def _qkv(B, Tq, Tk, N, Nk, H, dtype=jnp.float32, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(ks[0], (B, Tq, N, H), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (B, Tk, Nk, H), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (B, Tk, Nk, H), jnp.float32).astype(dtype)
    return q, k, v


def _assert_close(got, want, tol, what):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert not np.isnan(got).any(), f"{what}: NaN (an element the kernel did not write)"
    np.testing.assert_allclose(got, want, err_msg=what, **tol)


def _run(impl, scheme, q, k, v, *, block_q, block_k, **kw):
    """Forward and gradients (q, k, v and the scheme's arrays) of one implementation."""
    if True:
        def loss(q, k, v, sch):
            o = jaxpos.attention(q, k, v, position=sch, implementation=impl, block_q=block_q,
                                 block_k=block_k, **kw)
            w = jnp.cos(jnp.arange(o.size, dtype=jnp.float32).reshape(o.shape))
            return jnp.sum(o.astype(jnp.float32) * w), o

        (_, o), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
            q, k, v, scheme)
        return o, g


def _run_both(scheme, q, k, v, **kw):
    return _run("pallas", scheme, q, k, v, **kw), _run("reference", scheme, q, k, v, **kw)


CASES = {
    # name: (scheme factory of N, attention kwargs, (B, Tq, Tk, N, Nk, H), blocks)
    "t5_causal_192_block_128_gqa": (
        lambda N: jaxpos.T5Bias(jax.random.normal(jax.random.PRNGKey(9), (32, N)),
                                bidirectional=False),
        {"causal": True, "scale": 1.0}, (1, 192, 160, 4, 2, 8), (128, 64)),
    "nope_gqa_tq_ne_tk": (lambda N: jaxpos.NoPE(), {"causal": False},
                          (1, 40, 24, 4, 2, 16), (16, 16)),
    "rope_half_causal_bq_gt_bk_padded": (
        lambda N: jaxpos.RoPE(rotary_dim=12, base=100.0), {"causal": True},
        (1, 192, 192, 2, 1, 16), (128, 64)),
    "rope_interleaved_factor_segments": (
        lambda N: jaxpos.RoPE(jaxpos.rope_frequencies(16)[0], layout="interleaved",
                              attention_factor=1.25),
        {"causal": True, "segment_ids": np.array([[0] * 11 + [1] * 13])},
        (1, 24, 24, 2, 2, 16), (16, 8)),
    "alibi_learned_slopes_bidirectional": (
        lambda N: jaxpos.ALiBi(slopes=jnp.linspace(0.9, 0.1, N), bidirectional=True),
        {"causal": False}, (2, 24, 40, 2, 1, 8), (8, 16)),
    "alibi_causal_segments_gqa": (
        lambda N: jaxpos.ALiBi(N),
        {"causal": True, "segment_ids": np.array([[0] * 9 + [1] * 15, [2] * 24])},
        (2, 24, 24, 4, 2, 8), (16, 8)),
    "t5_bidirectional_padded": (
        lambda N: jaxpos.T5Bias(jax.random.normal(jax.random.PRNGKey(7), (16, N)),
                                num_buckets=16, max_distance=12),
        {"causal": False, "scale": 1.0}, (1, 40, 40, 2, 2, 8), (16, 32)),
    "t5_causal_decoder_gqa": (
        lambda N: jaxpos.T5Bias(jax.random.normal(jax.random.PRNGKey(8), (16, N)),
                                bidirectional=False, num_buckets=16, max_distance=10),
        {"causal": True, "scale": 1.0}, (1, 24, 40, 4, 1, 8), (16, 8)),
}


FAST = ("t5_causal_192_block_128_gqa",)  # the rest run with -m slow (interpret mode is slow)


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow)
                                  for n in CASES])
def test_pallas_matches_reference_float32(name):
    make, kw, (B, Tq, Tk, N, Nk, H), (bq, bk) = CASES[name]
    scheme = make(N)
    q, k, v = _qkv(B, Tq, Tk, N, Nk, H)
    (o, g), (o_ref, g_ref) = _run_both(scheme, q, k, v, block_q=bq, block_k=bk, **kw)
    _assert_close(o, o_ref, F32_TOL, f"{name} forward")
    for what, a, b in zip(("dq", "dk", "dv"), g[:3], g_ref[:3]):
        _assert_close(a, b, F32_TOL, f"{name} {what}")
    for a, b in zip(jax.tree_util.tree_leaves(g[3]), jax.tree_util.tree_leaves(g_ref[3])):
        # the T5 table / ALiBi slopes gradients (inv_freq is a constant of the kernel)
        if isinstance(scheme, jaxpos.RoPE):
            continue
        _assert_close(a, b, {"atol": 1e-4, "rtol": 1e-4}, f"{name} scheme gradient")
        assert np.abs(np.asarray(b)).max() > 0, "the gradient of the scheme is not exercised"


BF16_CASES = {
    "alibi_causal": (lambda N, H: jaxpos.ALiBi(N), True),
    "rope_causal": (lambda N, H: jaxpos.RoPE(rotary_dim=H), True),
    "t5_bidirectional": (
        lambda N, H: jaxpos.T5Bias(jnp.ones((32, N)) * jnp.arange(32.0)[:, None] / 8), False),
}


@pytest.mark.parametrize("name", [n if n == "alibi_causal" else
                                  pytest.param(n, marks=pytest.mark.slow) for n in BF16_CASES])
def test_pallas_bfloat16(name):
    B, T, N, H = 1, 40, 2, 16
    make, causal = BF16_CASES[name]
    scheme = make(N, H)
    q, k, v = _qkv(B, T, T, N, N, H, jnp.bfloat16, seed=3)
    o, g = _run("pallas", scheme, q, k, v, block_q=16, block_k=16, causal=causal)
    f32 = tuple(x.astype(jnp.float32) for x in (q, k, v))
    o_ref, g_ref = _run("reference", scheme, *f32, block_q=16, block_k=16, causal=causal)
    assert o.dtype == jnp.bfloat16 and g[0].dtype == jnp.bfloat16
    _assert_close(o, o_ref, BF16_TOL, f"bf16 {name} forward")
    for what, a, b in zip(("dq", "dk", "dv"), g[:3], g_ref[:3]):
        _assert_close(a, b, BF16_GRAD_TOL, f"bf16 {name} {what}")


# ------------------------------------------- fused_attention directly, against a dense jnp
def _dense(q, k, v, q_pos, kv_pos, *, inv_freq, slopes, offset_bias, causal, seg_q, seg_kv,
           scale):
    """Plain-jnp float32 attention with RoPE + ALiBi + offset bias, materialising [Tq, Tk]."""
    if inv_freq is not None:
        q = jaxpos.apply_rope(q, q_pos, inv_freq)
        k = jaxpos.apply_rope(k, kv_pos, inv_freq)
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("bqnh,bknh->bnqk", q, k, precision="highest") * scale
    rel = kv_pos[None, :] - q_pos[:, None]
    s = s + slopes[:, None, None] * rel
    R = (offset_bias.shape[1] - 1) // 2
    s = s + offset_bias[:, jnp.clip(rel, -R, R) + R]
    vis = seg_q[:, None, :, None] == seg_kv[:, None, None, :]
    if causal:
        vis = vis & (rel <= 0)
    s = jnp.where(vis, s, -1e30)
    p = jnp.where(vis, jax.nn.softmax(s, axis=-1), 0.0)
    return jnp.einsum("bnqk,bknh->bqnh", p, v, precision="highest")


def test_fused_attention_all_terms_and_offset_bias_gradient():
    """RoPE + ALiBi + an arbitrary offset-bias vector at once, arbitrary (non-arange,
    repeated) positions, GQA, segments, causal with block_q > block_k, padding (20 and 28
    with blocks 16 and 8), Tq != Tk; every gradient including the offset-bias vector (sums
    along clipped diagonals) and the slopes."""
    B, Tq, Tk, N, Nk, H = 1, 20, 28, 4, 2, 16
    q, k, v = _qkv(B, Tq, Tk, N, Nk, H, seed=5)
    rng = np.random.default_rng(0)
    q_pos = jnp.asarray(np.sort(rng.integers(0, 40, Tq)), jnp.int32)
    kv_pos = jnp.asarray(np.sort(rng.integers(0, 40, Tk)), jnp.int32)
    seg_q = jnp.asarray([[0] * 12 + [1] * 8], jnp.int32)
    seg_kv = jnp.asarray([[0] * 15 + [1] * 13], jnp.int32)
    inv_freq = jaxpos.rope_frequencies(8)[0]
    slopes = jnp.asarray([0.5, 0.25, 0.125, 0.0625])
    R = 6
    offset_bias = jnp.asarray(rng.normal(size=(N, 2 * R + 1)), jnp.float32)
    common = {"inv_freq": inv_freq, "causal": True, "scale": 0.3}

    def loss_kernel(q, k, v, slopes, ob):
        o = fused_attention(q, k, v, q_positions=q_pos, kv_positions=kv_pos, alibi_slopes=slopes,
                            offset_bias=ob, segment_ids=seg_q, kv_segment_ids=seg_kv,
                            block_q=16, block_k=8, interpret=True, **common)
        return jnp.sum(o * jnp.sin(jnp.arange(o.size, dtype=jnp.float32).reshape(o.shape))), o

    def loss_dense(q, k, v, slopes, ob):
        o = _dense(q, k, v, q_pos, kv_pos, slopes=slopes, offset_bias=ob, seg_q=seg_q,
                   seg_kv=seg_kv, **common)
        return jnp.sum(o * jnp.sin(jnp.arange(o.size, dtype=jnp.float32).reshape(o.shape))), o

    args = (q, k, v, slopes, offset_bias)
    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4), has_aux=True))(*args)
    (_, o), g = grad(loss_kernel)
    (_, o_ref), g_ref = grad(loss_dense)
    _assert_close(o, o_ref, F32_TOL, "forward")
    for what, a, b in zip(("dq", "dk", "dv", "d slopes", "d offset_bias"), g, g_ref):
        _assert_close(a, b, {"atol": 1e-4, "rtol": 1e-4}, what)
    # Offsets below -R exist here, so the clipped end entry collects several diagonals
    # (entries above offset 0 get no gradient: causal hides those keys).
    assert np.abs(np.asarray(g_ref[4])[:, 0]).min() > 0
    np.testing.assert_array_equal(np.asarray(g[4])[:, R + 1:], 0.0)


def test_fully_masked_row_gives_zeros_and_zero_gradients():
    """NoPE through jaxpos.attention(implementation="pallas"): query segment 5 has no key,
    so its rows are zeros with zero gradients; every other number equals the reference."""
    B, T, N, H = 1, 16, 2, 8
    q, k, v = _qkv(B, T, T, N, N, H, seed=2)
    seg_q = jnp.asarray([[0] * 8 + [5] * 8], jnp.int32)
    seg_kv = jnp.asarray([[0] * 16], jnp.int32)
    kw = {"causal": False, "segment_ids": seg_q, "kv_segment_ids": seg_kv}
    (o, g), (o_ref, g_ref) = _run_both(jaxpos.NoPE(), q, k, v, block_q=8, block_k=8, **kw)
    np.testing.assert_array_equal(np.asarray(o[:, 8:]), 0.0)
    np.testing.assert_array_equal(np.asarray(g[0][:, 8:]), 0.0)
    assert np.abs(np.asarray(o[:, :8])).min() > 0
    _assert_close(o, o_ref, F32_TOL, "forward")
    for what, a, b in zip(("dq", "dk", "dv"), g[:3], g_ref[:3]):
        _assert_close(a, b, F32_TOL, what)


def test_poison_hook_marks_unwritten_outputs():
    """The NaN poisoning used above really starts outputs as NaN in interpret mode."""
    cfg = fused._Cfg(*([0] * len(fused._Cfg._fields)))._replace(mode="interpret")
    from jax.experimental import pallas as pl

    out = fused._pallas(lambda x_ref, o_ref: None, cfg, (1,),
                        [pl.BlockSpec((8, 128), lambda i: (0, 0))],
                        (pl.BlockSpec((8, 128), lambda i: (0, 0)),),
                        (jax.ShapeDtypeStruct((8, 128), jnp.float32),),
                        (jnp.zeros((8, 128)),), "unwritten")
    assert np.isnan(np.asarray(out[0])).all()


# --------------------------------------------------------------- offset-bias contract (T5)
@settings(max_examples=60, deadline=None)
@given(bidirectional=st.booleans(), per_direction=st.integers(2, 40),
       extra=st.integers(1, 300))
def test_t5_buckets_are_constant_beyond_max_distance(bidirectional, per_direction, extra):
    """The claim behind R = max_distance: clipping the offset to +-max_distance never
    changes T5's bucket, in both directions, bidirectional and causal (Raffel et al.
    2020 §2.1: every distance past max_distance shares the last bucket of its direction)."""
    num_buckets = 2 * per_direction if bidirectional else per_direction
    max_distance = per_direction // 2 + extra
    rel = np.arange(-6 * max_distance, 6 * max_distance + 1)
    clipped = np.clip(rel, -max_distance, max_distance)
    np.testing.assert_array_equal(t5_bucket(rel, bidirectional, num_buckets, max_distance),
                                  t5_bucket(clipped, bidirectional, num_buckets, max_distance))
    end = t5_bucket(np.array([-max_distance, max_distance]), bidirectional, num_buckets,
                    max_distance)
    assert end[0] == per_direction - 1  # last bucket of the keys before the query
    assert end[1] == (num_buckets - 1 if bidirectional else 0)


def test_t5_defaults_end_buckets():
    # Raffel et al. 2020 / FACTS.md: 16 buckets per direction, the last covers 91 onward.
    assert list(t5_bucket(np.array([-91, -90, 90, 91, 128, 10_000]), True, 32, 128)) == \
        [15, 14, 30, 31, 31, 31]


def test_t5_offset_bias_vector_matches_t5_bias():
    table = jnp.asarray(np.random.default_rng(1).normal(size=(32, 3)), jnp.float32)
    sch = jaxpos.T5Bias(table, bidirectional=False)
    vec = np.asarray(t5_offset_bias(sch))  # [3, 257]
    rel = np.arange(-128, 129)
    want = np.asarray(table)[t5_bucket(rel, False, 32, 128)].T
    np.testing.assert_array_equal(vec, want)


# ------------------------------------------------------------------------- dispatch, errors
def test_supports_scheme():
    assert supports_scheme(jaxpos.NoPE())
    assert supports_scheme(jaxpos.ALiBi(4))
    assert supports_scheme(jaxpos.T5Bias(jnp.zeros((32, 4))))
    assert not supports_scheme(jaxpos.Shaw(jnp.zeros((5, 8))))
    if jax.default_backend() == "cpu":
        assert supports_scheme(jaxpos.RoPE(rotary_dim=8))


def test_unsupported_inputs_raise_clear_errors():
    q, k, v = _qkv(1, 8, 8, 2, 2, 8)
    with pytest.raises(ValueError, match="Shaw"):
        jaxpos.attention(q, k, v, position=jaxpos.Shaw(jnp.zeros((5, 8))),
                         implementation="pallas")
    with pytest.raises(ValueError, match="mask"):
        jaxpos.attention(q, k, v, mask=jnp.ones((8, 8), bool), implementation="pallas")
    pos = jnp.arange(8)
    call = functools.partial(fused_attention, q, k, v, q_positions=pos, kv_positions=pos,
                             interpret=True)
    with pytest.raises(ValueError, match="offset_bias"):
        call(offset_bias=jnp.zeros((2, 4)))
    with pytest.raises(ValueError, match="block_k"):
        call(block_k=24)
    with pytest.raises(ValueError, match="alibi_slopes"):
        call(alibi_slopes=jnp.ones(3))
    with pytest.raises(TypeError, match="interpret"):
        call(interpret="yes")
    with pytest.raises(ValueError, match="segment_ids"):
        call(segment_ids=jnp.zeros((1, 8), jnp.int32))
    with pytest.raises(TypeError, match="q_positions"):
        fused_attention(q, k, v, q_positions=jnp.arange(8.0), kv_positions=pos)


@pytest.mark.slow
def test_gpu_benchmark_script_runs_tiny(tmp_path):
    """benchmarks/gpu_attention.py keeps working on CPU (interpret mode, tiny shapes);
    its own correctness check raises SystemExit if the kernel disagrees."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "gpu_attention.py"
    spec = importlib.util.spec_from_file_location("gpu_attention", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.md"
    rows = bench.main(["--tiny", "--variants", "t5", "rope+alibi", "--out", str(out)])
    assert {r[3] for r in rows} >= {"fused", "fused/nobias", "xla"}
    assert all(r[4] is not None for r in rows if r[3] != "flex")
    assert "| 64 | t5 | fwd | fused |" in out.read_text()


@pytest.mark.parametrize("layout,rotary_dim", [("half", 16), ("interleaved", 8)])
def test_rope_inv_freq_gradient_matches_reference(layout, rotary_dim):
    # The kernel uses inv_freq as a constant; the gradient flows around it through an
    # exact zero-valued term, so learned frequencies train under "pallas" too.
    B, T, N, H = 1, 24, 2, 16
    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (B, T, N, H)) for i in range(3))
    scheme = jaxpos.RoPE(rotary_dim=rotary_dim, layout=layout, base=100.0)
    pos = jnp.arange(T) + 5

    def loss(impl, s):
        out = jaxpos.attention(q, k, v, position=s, causal=True, q_positions=pos,
                               kv_positions=pos, implementation=impl, block_q=8, block_k=8)
        return jnp.sum(jnp.sin(out))

    ref = jax.grad(lambda s: loss("reference", s))(scheme).inv_freq
    got = jax.grad(lambda s: loss("pallas", s))(scheme).inv_freq
    assert float(jnp.max(jnp.abs(ref))) > 1.0  # a real gradient, not zero
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-5, atol=1e-4)
