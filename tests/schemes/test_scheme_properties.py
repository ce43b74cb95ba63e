"""Property tests with hypothesis: over shapes (Tq, Tk, N, N_kv, H),
block sizes, position offsets, masks, segments and schemes, every implementation agrees
with ``"reference"``; relative schemes are translation invariant.

Every example compiles new shapes, so the default run draws a few derandomized
examples; the ``slow`` variants draw many more. The suite's hypothesis profile
(tests/conftest.py) derandomizes them too, so CI sees the same examples on every run;
``HYPOTHESIS_PROFILE=explore pytest -m slow`` draws fresh ones.
Tolerances: float32 throughout, 2e-5 absolute / 2e-4 relative (summation order only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxpos
from jaxpos import ALiBi, NoPE, RoPE, Shaw, T5Bias, attention

IMPLS = list(jaxpos.IMPLEMENTATIONS)  # reference, chunked, pallas (interpret mode on CPU)
OTHERS = [i for i in IMPLS if i != "reference"]
SCHEMES = ("nope", "rope", "alibi", "t5", "shaw")
FAST = settings(max_examples=3, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SLOW = settings(max_examples=25, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def make_scheme(name, N, H, rng, *, causal):
    f32 = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    if name == "nope":
        return NoPE()
    if name == "rope":
        rd = 2 * int(rng.integers(1, H // 2 + 1))  # partial rotary widths too
        return RoPE(rotary_dim=rd, base=float(rng.choice([100.0, 10000.0])),
                    layout=str(rng.choice(["half", "interleaved"])))
    if name == "alibi":
        return ALiBi(slopes=jnp.asarray(rng.uniform(0.01, 1.0, N), jnp.float32),
                     bidirectional=not causal)
    if name == "t5":
        nb = int(rng.choice([8, 32]))
        # max_distance must exceed the exact range (num_buckets per direction // 2); 2 * nb
        # does for both directions and both bucket counts.
        return T5Bias(f32(nb, N), bidirectional=not causal,
                      max_distance=int(rng.choice([2 * nb, 128])))
    K = int(rng.integers(1, 4))
    return Shaw(f32(2 * K + 1, H), f32(2 * K + 1, H) if rng.random() < 0.7 else None)


@st.composite
def problems(draw):
    """One attention problem: arrays, positions, visibility options and a scheme."""
    B = draw(st.integers(1, 2))
    Tq = draw(st.integers(1, 11))
    Tk = draw(st.sampled_from([Tq, draw(st.integers(1, 11))]))
    Nk = draw(st.sampled_from([1, 2]))
    N = Nk * draw(st.sampled_from([1, 2]))
    H = draw(st.sampled_from([2, 4, 8]))
    causal = draw(st.booleans())
    scheme = draw(st.sampled_from(SCHEMES))
    kv_offset = draw(st.integers(0, 3000))
    q_offset = kv_offset + draw(st.integers(-3, 20))  # queries near or after the keys
    per_row = draw(st.booleans())  # [B, T] positions with a different shift per row
    mask_kind = draw(st.sampled_from(["none", "mask", "segments"]))
    block_q = draw(st.sampled_from([1, 2, 4, 8, 16]))
    block_k = draw(st.sampled_from([1, 2, 4, 8, 16]))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    return {"B": B, "Tq": Tq, "Tk": Tk, "N": N, "Nk": Nk, "H": H, "causal": causal,
            "scheme": scheme, "kv_offset": kv_offset, "q_offset": q_offset, "per_row": per_row,
            "mask_kind": mask_kind, "block_q": block_q, "block_k": block_k, "seed": seed}


def build(p):
    rng = np.random.default_rng(p["seed"])
    B, Tq, Tk, N, Nk, H = (p[x] for x in ("B", "Tq", "Tk", "N", "Nk", "H"))
    q = jnp.asarray(rng.normal(size=(B, Tq, N, H)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, Tk, Nk, H)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, Tk, Nk, H)), jnp.float32)
    qpos = np.arange(Tq) + p["q_offset"]
    kvpos = np.arange(Tk) + p["kv_offset"]
    if p["per_row"]:
        shift = rng.integers(0, 50, size=(B, 1))
        qpos, kvpos = qpos[None] + shift, kvpos[None] + shift
    kw = {"q_positions": qpos.astype(np.int32), "kv_positions": kvpos.astype(np.int32),
              "causal": p["causal"], "block_q": p["block_q"], "block_k": p["block_k"],
              "position": make_scheme(p["scheme"], N, H, rng, causal=p["causal"])}
    if p["mask_kind"] == "mask":
        kw["mask"] = rng.random((B, 1, Tq, Tk)) < 0.7
    elif p["mask_kind"] == "segments":
        kw["segment_ids"] = np.sort(rng.integers(0, 3, size=(B, Tq)), axis=-1).astype(np.int32)
        kw["kv_segment_ids"] = np.sort(rng.integers(0, 3, size=(B, Tk)), axis=-1).astype(np.int32)
    return (q, k, v), kw


def supported(impl, p):
    """The Pallas kernel takes no boolean mask and no Shaw scheme (it raises a ValueError
    that says so; see tests/attention/test_bad_input.py)."""
    return not (impl == "pallas" and (p["mask_kind"] == "mask" or p["scheme"] == "shaw"))


def run(impl, args, kw):
    kw = dict(kw, implementation=impl)
    return jax.jit(lambda q, k, v: attention(q, k, v, **kw))(*args)


def check_agreement(p):
    args, kw = build(p)
    ref = np.asarray(run("reference", args, kw))
    assert np.isfinite(ref).all()
    for impl in OTHERS:
        if not supported(impl, p):
            continue
        out = np.asarray(run(impl, args, kw))
        np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-4, err_msg=f"{impl}: {p}")


@FAST
@given(problems())
def test_every_implementation_agrees_with_reference(p):
    check_agreement(p)


@pytest.mark.slow
@SLOW
@given(problems())
def test_every_implementation_agrees_with_reference_many(p):
    check_agreement(p)


def check_gradients(p):
    args, kw = build(p)
    scheme = kw.pop("position")
    out_shape = args[0].shape[:3] + (args[2].shape[-1],)
    w = jnp.asarray(np.random.default_rng(p["seed"] + 1).normal(size=out_shape), jnp.float32)

    def grads(impl):
        f = lambda q, k, v, s: jnp.sum(
            attention(q, k, v, position=s, implementation=impl, **kw) * w)
        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)))(*args, scheme)

    ref = grads("reference")
    for impl in OTHERS:
        if not supported(impl, p):
            continue
        got = grads(impl)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5e-5, rtol=5e-4,
                                       err_msg=f"{impl} gradient: {p}")


@settings(max_examples=1, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_every_implementation_gradient_agrees_with_reference(p):
    check_gradients(p)


@pytest.mark.slow
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_every_implementation_gradient_agrees_with_reference_many(p):
    check_gradients(p)


# ----------------------------------------------------------------- translation invariance
_SHIFT_SHAPE = {"B": 1, "Tq": 7, "Tk": 7, "N": 2, "Nk": 2, "H": 8, "per_row": False,
                "block_q": 4, "block_k": 4}


@pytest.mark.parametrize("scheme", ["rope", "t5"] + [pytest.param(s, marks=pytest.mark.slow)
                                                     for s in ("alibi", "shaw")])
@settings(max_examples=4, deadline=None, derandomize=True, database=None)
@given(shift=st.integers(-5000, 5000), causal=st.booleans(), seed=st.integers(0, 1000))
def test_relative_schemes_are_translation_invariant(scheme, shift, causal, seed):
    """Relative schemes depend on kv_pos - q_pos only (Shaw §3, T5 §2.1, ALiBi §3, RoPE
    §3.4): adding one integer to every position leaves the output unchanged. Positions,
    arrays and the scheme are traced arguments, so the examples share one compiled
    function per (scheme, causal)."""
    p = dict(_SHIFT_SHAPE, causal=causal, scheme=scheme, kv_offset=0, q_offset=0,
             mask_kind="none", seed=seed)
    args, kw = build(p)
    qpos, kvpos = kw["q_positions"], kw["kv_positions"]
    sch = make_scheme(scheme, 2, 8, np.random.default_rng(0), causal=causal)  # fixed statics
    f = _shift_fn(causal)
    base = np.asarray(f(*args, qpos + 6000, kvpos + 6000, sch))
    moved = np.asarray(f(*args, qpos + 6000 + shift, kvpos + 6000 + shift, sch))
    # RoPE angles are float32 products: at |pos| ~ 1e4 an angle carries ~5e-4 rad of rounding
    atol = 3e-3 if scheme == "rope" else 2e-5
    np.testing.assert_allclose(moved, base, atol=atol, rtol=0)


_SHIFT_FNS = {}


def _shift_fn(causal):
    if causal not in _SHIFT_FNS:
        @jax.jit
        def f(q, k, v, qp, kp, scheme):
            return attention(q, k, v, position=scheme, q_positions=qp, kv_positions=kp,
                             causal=causal, implementation="chunked", block_q=4, block_k=4)
        _SHIFT_FNS[causal] = f
    return _SHIFT_FNS[causal]
