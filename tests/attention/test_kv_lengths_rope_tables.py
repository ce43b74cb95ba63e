"""``attention(..., kv_lengths=, rope_tables=)``: the decode path's fill lengths and RoPE
applied from cos/sin tables, in every tiled implementation.

* ``kv_lengths``: equal to a float64 NumPy softmax over each row's first
  ``kv_lengths[b]`` keys (rows of length 0 give zeros), for decode shapes (the chunked
  decode path) and a training shape (the tiled chunked path), with GQA;
* ``rope_tables``: unrotated q, k plus tables equal ``position=RoPE(...)`` (which rotates
  before attention), forward and gradients, in the chunked decode path (rotating each key
  block as it is sliced) and the Pallas kernel (rotating on load, interpret mode);
* the chunked decode path makes no copy of the cache: no array as large as the cache is
  produced anywhere in its jaxpr.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpos
from jaxpos.schemes.rope.scaling import default_inv_freq
from jaxpos.schemes.rope.tables import rope_tables


def _qkv(B, Tq, Tk, N, Nk, H, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.normal(size=s), jnp.float32)
                 for s in ((B, Tq, N, H), (B, Tk, Nk, H), (B, Tk, Nk, H)))


def _numpy_filled(q, k, v, lens, q_pos, kv_pos, causal):
    """float64: softmax over keys j < lens[b] (and kv_pos_j <= q_pos_i when causal)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, Tq, N, H = q.shape
    g = N // k.shape[2]
    out = np.zeros((B, Tq, N, v.shape[-1]))
    for b in range(B):
        for h in range(N):
            kk, vv = k[b, :lens[b], h // g], v[b, :lens[b], h // g]
            for i in range(Tq):
                s = kk @ q[b, i, h] / np.sqrt(H)
                vis = np.ones(len(s), bool)
                if causal:
                    vis &= kv_pos[:lens[b]] <= q_pos[b, i]
                if not vis.any():
                    continue
                p = np.exp(s[vis] - s[vis].max())
                out[b, i, h] = (p / p.sum()) @ vv[vis]
    return out


@pytest.mark.parametrize("impl", ["reference", "chunked",
                                  pytest.param("pallas", marks=pytest.mark.slow)])
@pytest.mark.parametrize("Tq", [1, 3])
def test_kv_lengths_decode_equals_filled_prefix(impl, Tq):
    B, Tk, N, Nk, H = 3, 40, 4, 2, 16
    q, k, v = _qkv(B, Tq, Tk, N, Nk, H)
    lens = np.asarray([40, 17, 0])
    q_pos = np.maximum(lens[:, None] - Tq, 0) + np.arange(Tq)[None]
    kv_pos = np.arange(Tk)
    out = jaxpos.attention(q, k, v, q_positions=q_pos, kv_positions=kv_pos, causal=True,
                           kv_lengths=jnp.asarray(lens), implementation=impl, block_k=8)
    want = _numpy_filled(q, k, v, lens, q_pos, kv_pos, True)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=2e-5)


def test_kv_lengths_training_shape_chunked():
    """Tq = 20 > the decode path's 16 queries: the tiled chunked path with the lengths as
    key validity (tiles past them EMPTY)."""
    B, T, N, H = 2, 20, 2, 8
    q, k, v = _qkv(B, T, T, N, N, H)
    lens = np.asarray([20, 7])
    pos = np.arange(T)
    out = jaxpos.attention(q, k, v, kv_lengths=jnp.asarray(lens), implementation="chunked",
                           block_q=8, block_k=8)
    want = _numpy_filled(q, k, v, lens, np.broadcast_to(pos, (B, T)), pos, False)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=2e-5)


def _rope_pair(impl, Tq, Tk, H=16, rotary_dim=16, **kw):
    q, k, v = _qkv(2, Tq, Tk, 4, 2, H, seed=1)
    q_pos = jnp.arange(Tq) + (Tk - Tq)
    kv_pos = jnp.arange(Tk)
    inv_freq = jnp.asarray(default_inv_freq(rotary_dim, 10000.0), jnp.float32)
    tabs = rope_tables(q_pos, kv_pos, inv_freq)
    rope = jaxpos.RoPE(inv_freq)

    def tables(q, k, v):
        return jaxpos.attention(q, k, v, q_positions=q_pos, kv_positions=kv_pos, causal=True,
                                rope_tables=tabs, implementation=impl, **kw)

    def scheme(q, k, v):
        return jaxpos.attention(q, k, v, position=rope, q_positions=q_pos,
                                kv_positions=kv_pos, causal=True, implementation=impl, **kw)

    return (q, k, v), tables, scheme


def _vg(f, args):
    def loss(*a):
        o = f(*a)
        return jnp.sum(o * jnp.cos(jnp.arange(o.size, dtype=jnp.float32).reshape(o.shape))), o

    (_, o), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*args)
    return o, g


@pytest.mark.parametrize("impl, Tq, H, rotary_dim", [
    ("chunked", 1, 16, 16), pytest.param("chunked", 2, 24, 16, marks=pytest.mark.slow),
    ("reference", 2, 16, 16),
    pytest.param("pallas", 2, 16, 16, marks=pytest.mark.slow)])
def test_rope_tables_equal_the_rope_scheme_forward_and_gradients(impl, Tq, H, rotary_dim):
    args, tables, scheme = _rope_pair(impl, Tq, 21, H, rotary_dim, block_k=8)
    o, g = _vg(tables, args)
    o_ref, g_ref = _vg(scheme, args)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), atol=2e-5, rtol=2e-5)
    for name, a, b in zip(("dq", "dk", "dv"), g, g_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5,
                                   err_msg=name)


def test_rope_tables_refused_with_a_rotating_scheme():
    q, k, v = _qkv(1, 1, 8, 2, 2, 16)
    tabs = rope_tables(jnp.arange(1), jnp.arange(8), jnp.ones((8,)))
    with pytest.raises(ValueError, match="position=None"):
        jaxpos.attention(q, k, v, position=jaxpos.RoPE(rotary_dim=16), rope_tables=tabs,
                         q_positions=jnp.arange(1), kv_positions=jnp.arange(8))
    with pytest.raises(ValueError, match=r"kv_lengths must have shape \[1\]"):
        jaxpos.attention(q, k, v, kv_lengths=jnp.asarray([1, 2]))
    with pytest.raises(ValueError, match="does not take kv_lengths"):
        jaxpos.attention(q, k, v, kv_lengths=jnp.asarray([3]), implementation="xla")


def _largest(jaxpr, acc=0):
    for e in jaxpr.eqns:
        for o in e.outvars:
            acc = max(acc, int(np.prod(o.aval.shape)) if hasattr(o.aval, "shape") else 0)
        for p in e.params.values():
            for s in (p if isinstance(p, (list, tuple)) else [p]):
                inner = getattr(s, "jaxpr", None)
                if inner is not None:
                    acc = _largest(inner if hasattr(inner, "eqns") else inner.jaxpr, acc)
    return acc


def test_chunked_decode_copies_no_cache():
    """A decode step against a 4096-slot cache with RoPE tables and lengths: no equation of
    its jaxpr (loops included) produces an array as large as the cache (no pad, transpose,
    rotation or mask of the whole cache)."""
    B, Tk, Nk, H = 2, 4096, 2, 16
    q, k, v = (jnp.zeros((B, 1, 4, H)), jnp.zeros((B, Tk, Nk, H)), jnp.zeros((B, Tk, Nk, H)))
    tabs = rope_tables(jnp.asarray([[100], [5]]), jnp.arange(Tk), jnp.ones((H // 2,)))

    def step(q, k, v, lens):
        return jaxpos.attention(q, k, v, q_positions=jnp.asarray([[100], [5]]),
                                kv_positions=jnp.arange(Tk), causal=True, kv_lengths=lens,
                                rope_tables=tabs, implementation="chunked")

    jaxpr = jax.make_jaxpr(step)(q, k, v, jnp.asarray([101, 6])).jaxpr
    assert _largest(jaxpr) < k.size // 4, _largest(jaxpr)
