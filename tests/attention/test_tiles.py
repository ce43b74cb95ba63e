"""The tile library (jaxpos.core.tiles) against a float64 NumPy softmax: the online step
over key tiles in both state forms (``m [.., tq]`` as the plain-JAX engines keep it,
``m [.., tq, 1]`` as the kernel's 2-D tiles do), and the fold of attention sinks into
finished outputs (ring attention, the kernel's key splits)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpos.core.tiles import (
    Running,
    fold_sinks,
    online_softmax_step,
    softmax_finish,
    softmax_start,
)


def _softmax_reference(s, v, sinks=None):
    """float64 ``(out, lse)`` of ``s [N, tq, tk]`` (``-inf`` hidden) and ``v [tk, Hv]``,
    with a sink logit per head in the denominator."""
    s = np.asarray(s, np.float64)
    cols = s if sinks is None else np.concatenate(
        [s, np.broadcast_to(np.asarray(sinks, np.float64)[:, None, None], s.shape[:2] + (1,))],
        -1)
    m = np.max(cols, -1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(cols - m)
    denom = e.sum(-1)
    lse = np.where(denom > 0, np.log(np.where(denom > 0, denom, 1.0)) + m[..., 0], -np.inf)
    w = e[..., :s.shape[-1]] / np.where(denom > 0, denom, 1.0)[..., None]
    return w @ np.asarray(v, np.float64), lse


def _scores(rng, N=2, tq=3, tk=10):
    s = rng.normal(size=(N, tq, tk)).astype(np.float32) * 3
    s[0, 1, :] = -np.inf  # a row with no visible key
    s[1, 2, 4:] = -np.inf  # visible keys in the first tile only
    return s


@pytest.mark.parametrize("keepdims", [False, True], ids=["rows", "kernel-2d"])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_online_step_over_tiles_equals_softmax(keepdims, with_sinks):
    rng = np.random.default_rng(0)
    s = _scores(rng)
    v = rng.normal(size=(10, 4)).astype(np.float32)
    sinks = np.array([0.5, -1.0], np.float32) if with_sinks else None
    start = softmax_start((1, 2, 3), 4, None if sinks is None else jnp.asarray(sinks))
    state = Running(*(x[0] for x in start))  # [N, tq] rows
    if keepdims:
        state = Running(state.m[..., None], state.l[..., None], state.acc)
    for lo in range(0, 10, 4):  # tiles of 4, 4 and 2 keys
        tile = jnp.asarray(s[..., lo:lo + 4])
        state = online_softmax_step(state, tile, lambda p, lo=lo: p @ v[lo:lo + 4])
    assert state.m.shape == ((2, 3, 1) if keepdims else (2, 3))
    out, lse = softmax_finish(state)
    ref_out, ref_lse = _softmax_reference(s, v, sinks)
    np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-5, atol=1e-6)
    got_lse = np.asarray(lse)[..., 0] if keepdims else np.asarray(lse)
    np.testing.assert_allclose(got_lse, ref_lse, rtol=1e-6, atol=1e-6)
    if not with_sinks:  # the empty row: zeros and -inf, never NaN
        assert np.all(np.asarray(out)[0, 1] == 0) and got_lse[0, 1] == -np.inf


@pytest.mark.parametrize("layout", ["BNTq", "nqBNbq"])
def test_fold_sinks_equals_softmax_with_a_sink_logit(layout):
    """The finished softmax over the keys, folded with the sinks, equals the softmax whose
    denominator holds the sink from the start, for lse layouts [B, N, Tq] (the kernel's,
    head axis 1) and [nq, B, N, bq] (the ring's, head axis 2)."""
    rng = np.random.default_rng(1)
    s = _scores(rng)
    v = rng.normal(size=(10, 4)).astype(np.float32)
    sinks = np.array([1.5, -0.25], np.float32)
    out, lse = _softmax_reference(s, v)
    want_out, want_lse = _softmax_reference(s, v, sinks)
    axis = 1 if layout == "BNTq" else 2  # leading axes of size 1 before the heads
    o = jnp.asarray(out.reshape((1,) * axis + out.shape), jnp.float32)
    l = jnp.asarray(lse.reshape((1,) * axis + lse.shape), jnp.float32)
    got_out, got_lse = fold_sinks(o, l, jnp.asarray(sinks), head_axis=axis)
    np.testing.assert_allclose(np.asarray(got_out).reshape(want_out.shape), want_out,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got_lse).reshape(want_lse.shape), want_lse,
                               rtol=1e-6)
    # the empty row [0, 1] now puts all its weight on the sink: output 0, lse = sink
    assert np.all(np.asarray(got_out).reshape(want_out.shape)[0, 1] == 0)
    np.testing.assert_allclose(np.asarray(got_lse).reshape(want_lse.shape)[0, 1], 1.5)


def test_fold_sinks_of_minus_infinity_keeps_an_empty_row_empty():
    out = jnp.zeros((1, 2, 3, 4))
    lse = jnp.full((1, 2, 3), -jnp.inf)
    got_out, got_lse = fold_sinks(out, lse, jnp.array([-jnp.inf, -jnp.inf]), head_axis=1)
    assert np.all(np.asarray(got_out) == 0) and np.all(np.isneginf(np.asarray(got_lse)))
