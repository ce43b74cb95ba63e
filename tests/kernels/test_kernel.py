"""The fused Pallas kernel (jaxpos.kernels) in interpret mode, against dense references.

References: ``tests/_kernel_dense.py`` (the tests' dense reference,
``tests/_contract_reference.py``, run in float32 at HIGHEST precision with jax.numpy)
for score_mods, mask_mods and sinks, and
``jaxpos.attention(..., implementation="reference")`` for the built-in schemes.

Every kernel output starts as NaN (``jaxpos.kernels._testing.poison_outputs``), so an
element the kernel does not write fails the comparison. Tolerances (measured max errors
were about 10x smaller):

* float32: forward and every gradient within ``atol = rtol = 2e-5`` (float32 dots at
  HIGHEST precision; only the summation order differs); captured-array and sink
  gradients (sums over many tiles) within ``1e-4``.
* bfloat16: inputs and output in bfloat16, probabilities cast to bfloat16 before
  ``p @ v`` (as FlashAttention does): forward within ``3e-2`` of the float32 reference on
  the same inputs, gradients within ``6e-2``.

Shapes are tiny because the Pallas interpreter is slow on CPU; each case combines several
stresses (padding, ``Tq != Tk``, ``block_q != block_k``, GQA, segments, batched positions).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _kernel_dense import dense_attention
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxpos
from jaxpos import t5_bucket
from jaxpos.kernels import _testing as kernel_testing
from jaxpos.kernels import (
    attention_via_kernel,
    fused_attention,
    offset_bias_score_mod,
    supports_scheme,
)
from jaxpos.mods import create_block_mask

F32_TOL = {"atol": 2e-5, "rtol": 2e-5}
SUM_TOL = {"atol": 1e-4, "rtol": 1e-4}
BF16_TOL = {"atol": 3e-2, "rtol": 3e-2}
BF16_GRAD_TOL = {"atol": 6e-2, "rtol": 6e-2}


@pytest.fixture(autouse=True)
def poison_outputs():
    with kernel_testing.poison_outputs():
        yield


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


def _value_and_grads(f, args, argnums):
    """``f(*args)`` and the gradients of a fixed weighted sum of it."""

    def loss(*a):
        o = f(*a)
        w = jnp.cos(jnp.arange(o.size, dtype=jnp.float32).reshape(o.shape))
        return jnp.sum(o.astype(jnp.float32) * w), o

    (_, o), g = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(*args)
    return o, g


def _compare(kernel_fn, dense_fn, args, argnums, names, tols=None):
    o, g = _value_and_grads(kernel_fn, args, argnums)
    o_ref, g_ref = _value_and_grads(dense_fn, args, argnums)
    _assert_close(o, o_ref, F32_TOL, "forward")
    tols = tols or {}
    for name, a, b in zip(names, g, g_ref):
        _assert_close(a, b, tols.get(name, F32_TOL), name)
        assert np.abs(np.asarray(b)).max() > 0, f"{name}: the gradient is not exercised"


# ------------------------------------------------------------------- score_mods, gradients
def test_score_mods_and_captured_array_gradients():
    """ALiBi (slopes[head] * offset), a T5-style per-head offset vector gathered at the
    clipped offset and a user's [offsets, heads] table, composed, against the dense
    reference: forward, dq, dk, dv and the gradients of the three captured arrays.
    Causal with non-arange, batched and traced positions (a KV-cache query block), GQA,
    Tq != Tk, padding (20 and 28 with blocks 16 and 8)."""
    B, Tq, Tk, N, Nk, H = 2, 20, 28, 2, 1, 16
    q, k, v = _qkv(B, Tq, Tk, N, Nk, H, seed=1)
    kv_pos = jnp.stack([jnp.arange(Tk), jnp.arange(Tk) + 3])
    q_pos = kv_pos[:, Tk - Tq:]
    R = 5
    rng = np.random.default_rng(0)
    slopes = jnp.asarray([0.5, 0.125])
    vec = jnp.asarray(rng.normal(size=(N, 2 * R + 1)), jnp.float32)
    table = jnp.asarray(rng.normal(size=(2 * R + 1, N)), jnp.float32)

    def mod(slopes, vec, table):
        def f(s, b, h, qp, kp):
            rel = kp - qp
            s = s + slopes[h] * rel.astype(jnp.float32)
            s = s + vec[h][jnp.clip(rel, -R, R) + R]
            return s + table[jnp.clip(rel, -R, R) + R, h]
        return f

    common = {"causal": True, "scale": 0.3}

    def kern(q, k, v, slopes, vec, table, q_pos, kv_pos):  # positions traced (jit args)
        return attention_via_kernel(q, k, v, score_mod=mod(slopes, vec, table), block_q=16,
                                    block_k=8, interpret=True, q_positions=q_pos,
                                    kv_positions=kv_pos, **common)

    def dense(q, k, v, slopes, vec, table, q_pos, kv_pos):
        return dense_attention(q, k, v, score_mod=mod(slopes, vec, table), q_positions=q_pos,
                               kv_positions=kv_pos, **common)

    _compare(kern, dense, (q, k, v, slopes, vec, table, q_pos, kv_pos), (0, 1, 2, 3, 4, 5),
             ("dq", "dk", "dv", "d slopes", "d vec", "d table"),
             {"d slopes": SUM_TOL, "d vec": SUM_TOL, "d table": SUM_TOL})


def test_block_mask_mask_mod_sinks_and_soft_cap():
    """A sliding-window x document mask_mod through a block mask (EMPTY, FULL and
    PARTIAL tiles all present), attention sinks, and a score_mod that is not a pure added
    term (a tanh soft cap, Gemma 2 style, plus a per-head bias): forward, dq, dk, dv,
    d sinks and d bias. Segments are off; the document ids are captured by the
    mask_mod."""
    B, T, N, H = 1, 48, 2, 16
    q, k, v = _qkv(B, T, T, N, N, H, seed=2)
    pos = jnp.arange(T)
    docs = jnp.asarray([0] * 20 + [1] * 28, jnp.int32)

    def mask_mod(b, h, qp, kp):
        return ((qp - kp) < 24) & (docs[qp] == docs[kp])

    bm = create_block_mask(mask_mod, q_positions=pos, kv_positions=pos, block_q=8, block_k=8)
    kinds = set(np.unique(np.asarray(bm.kinds)).tolist())
    assert kinds == {0, 1, 2}, kinds
    sinks = jnp.asarray([0.7, -0.4])
    bias = jnp.asarray([0.3, -0.2])

    def mod(bias):
        return lambda s, b, h, qp, kp: 4.0 * jnp.tanh(s / 4.0) + bias[h]

    def kern(q, k, v, sinks, bias):
        return attention_via_kernel(q, k, v, score_mod=mod(bias), block_mask=bm, sinks=sinks,
                                    q_positions=pos, kv_positions=pos, causal=True,
                                    interpret=True)

    def dense(q, k, v, sinks, bias):
        return dense_attention(q, k, v, score_mod=mod(bias), mask_mod=mask_mod, sinks=sinks,
                               q_positions=pos, kv_positions=pos, causal=True)

    _compare(kern, dense, (q, k, v, sinks, bias), (0, 1, 2, 3, 4),
             ("dq", "dk", "dv", "d sinks", "d bias"), {"d sinks": SUM_TOL, "d bias": SUM_TOL})


def test_rows_without_visible_keys_are_zero_with_zero_gradients():
    """Query segment 5 meets no key: its rows are zeros with zero gradients (without
    sinks); every other number equals the dense reference."""
    B, T, N, H = 1, 16, 2, 8
    q, k, v = _qkv(B, T, T, N, N, H, seed=3)
    seg_q = jnp.asarray([[0] * 8 + [5] * 8], jnp.int32)
    seg_kv = jnp.zeros((1, T), jnp.int32)
    pos = jnp.arange(T)
    kw = {"q_positions": pos, "kv_positions": pos, "segment_ids": seg_q,
          "kv_segment_ids": seg_kv}
    kern = lambda q, k, v: attention_via_kernel(q, k, v, block_q=8, block_k=8, interpret=True,
                                                **kw)
    o, g = _value_and_grads(kern, (q, k, v), (0, 1, 2))
    np.testing.assert_array_equal(np.asarray(o[:, 8:]), 0.0)
    np.testing.assert_array_equal(np.asarray(g[0][:, 8:]), 0.0)
    o_ref, g_ref = _value_and_grads(lambda q, k, v: dense_attention(q, k, v, **kw), (q, k, v),
                                    (0, 1, 2))
    _assert_close(o, o_ref, F32_TOL, "forward")
    for what, a, b in zip(("dq", "dk", "dv"), g, g_ref):
        _assert_close(a, b, F32_TOL, what)


@pytest.fixture
def tpu_style_loads():
    with kernel_testing.interpret_like_tpu():
        yield


def test_tpu_gather_loop_matches_in_the_interpreter(tpu_style_loads):
    """The TPU form of a gather (a loop over the index values present in the tile, scalar
    loads) run by the interpreter: forward and dq/dk/dv equal the dense reference for a
    T5-style vector and a per-token gate read at q_pos and kv_pos (FoX style)."""
    B, T, N, H = 1, 24, 2, 16
    q, k, v = _qkv(B, T, T, N, N, H, seed=4)
    pos = jnp.arange(T)
    R = 4
    rng = np.random.default_rng(1)
    vec = jnp.asarray(rng.normal(size=(N, 2 * R + 1)), jnp.float32)
    gate = jnp.asarray(np.cumsum(rng.uniform(-0.3, 0.0, size=(B, T)), axis=1), jnp.float32)

    def mod(s, b, h, qp, kp):
        return s + vec[h][jnp.clip(kp - qp, -R, R) + R] + gate[b][qp] - gate[b][kp]

    common = {"q_positions": pos, "kv_positions": pos, "causal": True, "score_mod": mod}
    kern = lambda q, k, v: attention_via_kernel(q, k, v, block_q=8, block_k=8,
                                                interpret=True, **common)
    _compare(kern, lambda q, k, v: dense_attention(q, k, v, **common), (q, k, v), (0, 1, 2),
             ("dq", "dk", "dv"))


def test_nan_input_propagates():
    B, T, N, H = 1, 16, 2, 8
    q, k, v = _qkv(B, T, T, N, N, H, seed=5)
    q = q.at[0, 3, 1, 0].set(jnp.nan)
    pos = jnp.arange(T)
    o = attention_via_kernel(q, k, v, q_positions=pos, kv_positions=pos, causal=True,
                             block_q=8, block_k=8, interpret=True)
    assert np.isnan(np.asarray(o[0, 3, 1])).all()
    assert not np.isnan(np.asarray(o[0, :, 0])).any()


# ------------------------------------------------- fused_attention (arrays, no schemes)
def test_fused_attention_rope_alibi_offset_bias_and_inv_freq_gradient():
    """RoPE (one apply_rope pass before the kernel) + ALiBi + an offset-bias vector at
    once, arbitrary (sorted, repeated) positions, GQA, segments, causal, padding, Tq !=
    Tk; every gradient, including the learned inv_freq (plain autodiff through the
    rotation), the slopes and the offset-bias vector."""
    B, Tq, Tk, N, Nk, H = 1, 20, 28, 2, 1, 16
    q, k, v = _qkv(B, Tq, Tk, N, Nk, H, seed=6)
    rng = np.random.default_rng(0)
    q_pos = jnp.asarray(np.sort(rng.integers(0, 40, Tq)), jnp.int32)
    kv_pos = jnp.asarray(np.sort(rng.integers(0, 40, Tk)), jnp.int32)
    seg_q = jnp.asarray([[0] * 12 + [1] * 8], jnp.int32)
    seg_kv = jnp.asarray([[0] * 15 + [1] * 13], jnp.int32)
    inv_freq = jnp.asarray(1.0 / 100.0 ** (np.arange(4) / 4), jnp.float32)
    slopes = jnp.asarray([0.5, 0.0625])
    R = 6
    ob = jnp.asarray(rng.normal(size=(N, 2 * R + 1)), jnp.float32)
    common = {"q_positions": q_pos, "kv_positions": kv_pos, "causal": True, "scale": 0.3,
              "segment_ids": seg_q, "kv_segment_ids": seg_kv}

    def kern(q, k, v, inv_freq, slopes, ob):
        return fused_attention(q, k, v, inv_freq=inv_freq, alibi_slopes=slopes, offset_bias=ob,
                               block_q=16, block_k=8, interpret=True, **common)

    def dense(q, k, v, inv_freq, slopes, ob):
        q = jaxpos.apply_rope(q, q_pos, inv_freq)
        k = jaxpos.apply_rope(k, kv_pos, inv_freq)

        def mod(s, b, h, qp, kp):
            rel = kp - qp
            return s + slopes[h] * rel.astype(jnp.float32) + ob[h][jnp.clip(rel, -R, R) + R]

        return dense_attention(q, k, v, score_mod=mod, **common)

    _compare(kern, dense, (q, k, v, inv_freq, slopes, ob), (0, 1, 2, 3, 4, 5),
             ("dq", "dk", "dv", "d inv_freq", "d slopes", "d offset_bias"),
             {"d inv_freq": SUM_TOL, "d slopes": SUM_TOL, "d offset_bias": SUM_TOL})


# ----------------------------------------------- built-in schemes through jaxpos.attention
def _schemes():
    from jaxpos.schemes.fire import FIRE
    from jaxpos.schemes.fox import FoX
    from jaxpos.schemes.kerple import KERPLE
    from jaxpos.schemes.sandwich import Sandwich
    from jaxpos.schemes.xpos import XPos

    ks = jax.random.split(jax.random.PRNGKey(9), 4)
    return {
        "alibi": lambda N, B, T: jaxpos.ALiBi(slopes=jnp.linspace(0.9, 0.1, N)),
        "t5": lambda N, B, T: jaxpos.T5Bias(jax.random.normal(ks[0], (16, N)),
                                            bidirectional=False, num_buckets=16, max_distance=10),
        "rope": lambda N, B, T: jaxpos.RoPE(rotary_dim=12, base=100.0),
        "kerple": lambda N, B, T: KERPLE(jnp.linspace(0.5, 1.0, N), jnp.linspace(1.0, 0.5, N)),
        "fire": lambda N, B, T: FIRE(jax.random.normal(ks[1], (32,)) * 0.5, jnp.full(32, 0.1),
                                     jax.random.normal(ks[2], (32, N)) * 0.3, jnp.zeros(N)),
        "sandwich": lambda N, B, T: Sandwich(N, d_bar=16),
        "fox": lambda N, B, T: FoX(jax.random.normal(ks[3], (B, T, N)) * 0.1 - 0.5),
        "xpos": lambda N, B, T: XPos(rotary_dim=16),
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", ["alibi", "t5", "rope", "kerple", "fire", "sandwich", "fox",
                                  "xpos"])
def test_builtin_schemes_pallas_matches_reference(name):
    """Every fusable built-in scheme through ``jaxpos.attention(implementation="pallas")``
    equals ``implementation="reference"``: forward, dq, dk, dv and the scheme's own
    arrays' gradients (GQA, causal, padding: T=24 with 8 x 16 tiles)."""
    B, T, N, Nk, H = 1, 24, 4, 2, 16
    scheme = _schemes()[name](N, B, T)
    q, k, v = _qkv(B, T, T, N, Nk, H, seed=7)

    def run(impl):
        f = lambda q, k, v, s: jaxpos.attention(q, k, v, position=s, causal=True,
                                                implementation=impl, block_q=8, block_k=16)
        return _value_and_grads(f, (q, k, v, scheme), (0, 1, 2, 3))

    (o, g), (o_ref, g_ref) = run("pallas"), run("reference")
    _assert_close(o, o_ref, F32_TOL, f"{name} forward")
    for what, a, b in zip(("dq", "dk", "dv"), g[:3], g_ref[:3]):
        _assert_close(a, b, F32_TOL, f"{name} {what}")
    for a, b in zip(jax.tree_util.tree_leaves(g[3]), jax.tree_util.tree_leaves(g_ref[3])):
        _assert_close(a, b, SUM_TOL, f"{name} scheme gradient")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["alibi", "rope", "t5"])
def test_pallas_bfloat16(name):
    B, T, N, H = 1, 40, 2, 16
    scheme = _schemes()[name](N, B, T)
    q, k, v = _qkv(B, T, T, N, N, H, jnp.bfloat16, seed=3)

    def run(impl, *args):
        f = lambda q, k, v: jaxpos.attention(q, k, v, position=scheme, causal=True,
                                             implementation=impl, block_q=16, block_k=16)
        return _value_and_grads(f, args, (0, 1, 2))

    o, g = run("pallas", q, k, v)
    o_ref, g_ref = run("reference", *(x.astype(jnp.float32) for x in (q, k, v)))
    assert o.dtype == jnp.bfloat16 and g[0].dtype == jnp.bfloat16
    _assert_close(o, o_ref, BF16_TOL, f"bf16 {name} forward")
    for what, a, b in zip(("dq", "dk", "dv"), g, g_ref):
        _assert_close(a, b, BF16_GRAD_TOL, f"bf16 {name} {what}")


def test_poison_hook_marks_unwritten_outputs():
    """The NaN poisoning used above really starts outputs as NaN in interpret mode."""
    from jax.experimental import pallas as pl

    from jaxpos.kernels import plumbing
    from jaxpos.kernels.config import KernelConfig

    cfg = KernelConfig(*([0] * 22))._replace(mode="interpret")

    def kernel(x_ref, o_ref, cfg, names, style, plat):
        return None

    spec = lambda plat, x: (x, pl.BlockSpec((8, 128), lambda i: (0, 0)))
    out_make = lambda plat: (jax.ShapeDtypeStruct((8, 128), jnp.float32),
                             pl.BlockSpec((8, 128), lambda i: (0, 0)), lambda y: y)
    out = plumbing.run_pallas(functools.partial(kernel, cfg=cfg), (1,),
                              [plumbing.In("x", jnp.zeros((8, 128)), spec)],
                              [plumbing.Out("o", out_make)], "unwritten")
    assert np.isnan(np.asarray(out[0])).all()


# --------------------------------------------------------------- offset-bias contract (T5)
@settings(max_examples=60, deadline=None)
@given(bidirectional=st.booleans(), per_direction=st.integers(2, 40),
       extra=st.integers(1, 300))
def test_t5_buckets_are_constant_beyond_max_distance(bidirectional, per_direction, extra):
    """The claim behind a T5 offset vector of radius R = max_distance: clipping the offset
    to +-max_distance never changes T5's bucket, in both directions, bidirectional and
    causal (Raffel et al. 2020 §2.1: every distance past max_distance shares the last
    bucket of its direction)."""
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
    # Raffel et al. 2020 (Mesh TensorFlow's _relative_position_bucket): 16 buckets per
    # direction, the last covers offsets 91 onward.
    assert list(t5_bucket(np.array([-91, -90, 90, 91, 128, 10_000]), True, 32, 128)) == \
        [15, 14, 30, 31, 31, 31]


def test_offset_bias_score_mod_equals_t5_buckets():
    """The offset-bias score_mod over a T5 vector gives ``table[bucket(kv - q), h]`` for
    offsets inside and far outside ``±max_distance`` (numbers from ``t5_bucket``)."""
    table = np.random.default_rng(1).normal(size=(32, 3)).astype(np.float32)
    rel = np.arange(-128, 129)
    vec = table[t5_bucket(rel, False, 32, 128)].T  # [3, 257]
    mod = offset_bias_score_mod(jnp.asarray(vec))
    qp = jnp.asarray([[0], [500]], jnp.int32)
    kp = jnp.asarray([[-1000, -200, -3, 0, 3, 700]], jnp.int32)
    for h in range(3):
        got = np.asarray(mod(jnp.zeros((2, 6)), 0, h, qp, kp))
        want = table[t5_bucket(np.asarray(kp - qp), False, 32, 128), h]
        np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------------- dispatch, errors
def test_supports_scheme_is_the_protocols_fusable():
    from jaxpos.schemes.base import NoPE

    assert supports_scheme(NoPE())
    assert supports_scheme(jaxpos.ALiBi(4))
    assert supports_scheme(jaxpos.T5Bias(jnp.zeros((32, 4))))
    assert supports_scheme(jaxpos.RoPE(rotary_dim=8))
    assert not supports_scheme(jaxpos.Shaw(jnp.zeros((5, 8))))
    with pytest.raises(TypeError, match="PositionScheme"):
        supports_scheme("rope")


def test_bad_input_raises_clear_errors():
    q, k, v = _qkv(1, 8, 8, 2, 2, 8)
    pos = jnp.arange(8)
    call = functools.partial(attention_via_kernel, q, k, v, q_positions=pos, kv_positions=pos,
                             interpret=True)
    with pytest.raises(ValueError, match="block_k must be a power of two.*24"):
        call(block_k=24)
    with pytest.raises(ValueError, match=r"sinks must have shape.*\[2\]"):
        call(sinks=jnp.zeros(3))
    with pytest.raises(TypeError, match="interpret"):
        call(interpret="yes")
    with pytest.raises(ValueError, match="segment_ids"):
        call(segment_ids=jnp.zeros((1, 8), jnp.int32))
    with pytest.raises(TypeError, match="q_positions"):
        attention_via_kernel(q, k, v, q_positions=jnp.arange(8.0), kv_positions=pos)
    with pytest.raises(ValueError, match="score_mod must return the score's shape"):
        call(score_mod=lambda s, b, h, qp, kp: s[:1])
    with pytest.raises(TypeError, match="mask_mod must return a bool"):
        call(mask_mod=lambda b, h, qp, kp: (qp - kp).astype(jnp.float32))
    bm = create_block_mask(lambda b, h, qp, kp: qp >= kp, q_positions=jnp.arange(16),
                           kv_positions=jnp.arange(16), block_q=8, block_k=8)
    with pytest.raises(ValueError, match="block_mask was built for lengths"):
        call(block_mask=bm)
    with pytest.raises(TypeError, match="share a dtype"):
        attention_via_kernel(q, k.astype(jnp.float16), v, q_positions=pos, kv_positions=pos)
    fcall = functools.partial(fused_attention, q, k, v, q_positions=pos, kv_positions=pos,
                              interpret=True)
    with pytest.raises(ValueError, match="offset_bias"):
        fcall(offset_bias=jnp.zeros((2, 4)))
    with pytest.raises(ValueError, match="alibi_slopes"):
        fcall(alibi_slopes=jnp.ones(3))
    with pytest.raises(ValueError, match=r"H/2 = 4"):
        fcall(inv_freq=jnp.ones(8))


@pytest.mark.slow
def test_gpu_benchmark_script_runs_tiny(tmp_path):
    """benchmarks/gpu_attention.py keeps working on CPU (interpret mode, tiny shapes);
    its own correctness check raises SystemExit if the kernel disagrees."""
    from _scripts import load_script

    bench = load_script("benchmarks/gpu_attention.py", "gpu_attention")
    out = tmp_path / "bench.md"
    rows = bench.main(["--tiny", "--variants", "rope+alibi", "--no-torch",
                       "--out", str(out)])
    impls = {r["impl"] for r in rows}
    assert {"jaxpos.pallas", "jaxpos.core.xla", "jax.xla+dense"} <= impls
    assert all(r["ms"] is not None for r in rows)
    assert "| 64 | rope+alibi | fwd | jaxpos.pallas |" in out.read_text()


def test_second_derivatives_are_refused_naming_the_paths_that_have_them():
    """Reverse-over-reverse (the gradient of a gradient norm) and forward-over-reverse (a
    Hessian-vector product) through the kernel raise a clear NotImplementedError naming
    the paths that differentiate twice, not an AssertionError from inside Pallas."""
    q, k, v = _qkv(1, 8, 8, 2, 2, 8)

    def loss(q):
        return jnp.sum(jaxpos.attention(q, k, v, causal=True, implementation="pallas") ** 2)

    match = r"first derivatives only.*'reference', 'chunked', 'xla'"
    with pytest.raises(NotImplementedError, match=match):
        jax.grad(lambda q: jnp.sum(jax.grad(loss)(q) ** 2))(q)
    with pytest.raises(NotImplementedError, match=match):
        jax.jvp(jax.grad(loss), (q,), (q,))
    assert jax.grad(loss)(q).shape == q.shape  # first derivatives still run
