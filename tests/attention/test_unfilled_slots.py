"""Slots past a row's fill (``kv_lengths``) are not inputs: whatever they hold (NaN in a
freed page, an uninitialised pool, a dense buffer past its fill) never enters the
product, forward or backward, on every engine and call shape.

The pool is filled as a serving loop leaves it (and as JAX's own ragged paged attention
test fills it on purpose): NaN in the tail of each row's last page, in the pages its table
lists past the fill and in the pages nobody owns. Each call must give exactly the output
(and gradients) of the same call with zeros there, all finite. The row shapes are a
serving mix: prefill chunks (q_len, kv_len) = (120, 597), (32, 322), (251, 463),
(99, 123), (117, 229) and decode steps of 1 to 5 new queries.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpos

N, NK, H, PAGE = 4, 2, 8, 16
#: (q_len, kv_len) of each row: prefill chunks, then decode steps of 1-5 queries
PREFILL = ((120, 597), (32, 322), (251, 463), (99, 123), (117, 229))
DECODE = ((1, 50), (2, 77), (3, 16), (4, 101), (5, 33))


def _pool(rows, rng, fill):
    """``(k_pages, v_pages, page_table, kv_lengths)`` for ``rows`` of (q_len, kv_len):
    shuffled pages, two spare table entries per row past its fill, ``fill`` (NaN or 0) in
    every slot past each row's fill and in every page no row owns."""
    pps = max(-(-L // PAGE) for _, L in rows) + 2
    used = sum(-(-L // PAGE) for _, L in rows)
    P = used + 3
    order = rng.permutation(P)
    k = rng.standard_normal((P, PAGE, NK, H)).astype(np.float32)
    v = rng.standard_normal((P, PAGE, NK, H)).astype(np.float32)
    owned = np.zeros((P, PAGE), bool)
    table = np.empty((len(rows), pps), np.int32)
    spare = list(order[used:])
    nxt = 0
    for b, (_, L) in enumerate(rows):
        n = -(-L // PAGE)
        table[b, :n] = order[nxt:nxt + n]
        nxt += n
        table[b, n:] = [spare[(b + i) % len(spare)] for i in range(pps - n)]  # freed pages
        for s in range(L):
            owned[table[b, s // PAGE], s % PAGE] = True
    k[~owned], v[~owned] = fill, fill
    lens = np.array([L for _, L in rows], np.int32)
    return jnp.asarray(k), jnp.asarray(v), jnp.asarray(table), jnp.asarray(lens)


def _cases(shapes, fast):
    """``(impl, *shape)`` params: every engine on every shape; the Pallas interpreter
    (slow on CPU) only on the ``fast`` shape in the default run, per-row calls ``slow``."""
    out = []
    for impl in ("reference", "chunked", "pallas"):
        for sid, shape in shapes.items():
            slow = sid.startswith("each-row") or (impl == "pallas" and sid != fast)
            out.append(pytest.param(impl, *shape, id=f"{impl}-{sid}",
                                    marks=[pytest.mark.slow] if slow else []))
    return out


@pytest.mark.parametrize("impl,tq,rows", _cases({
    "prefill-32": (32, PREFILL),  # a prefill chunk of 32 queries in every row of the mix
    "decode-1": (1, DECODE), "decode-5": (5, DECODE),
    "each-row-prefill": (None, PREFILL),  # each row alone with its own q_len
    "each-row-decode": (None, DECODE)}, fast="decode-5"))
def test_paged_slots_past_the_fill_never_reach_the_output(impl, tq, rows):
    rng = np.random.default_rng(0)
    kn, vn, table, lens = _pool(rows, rng, np.nan)
    kz, vz, _, _ = _pool(rows, np.random.default_rng(0), 0.0)
    q_all = jnp.asarray(rng.standard_normal((len(rows), max(t for t, _ in rows), N, H)),
                        jnp.float32)

    @jax.jit
    def call(q, k_pages, v_pages, t, n):
        return jaxpos.attention(q, k_pages, v_pages, page_table=t, kv_lengths=n, causal=True,
                                position=jaxpos.ALiBi(N), implementation=impl)

    if tq is None:  # each row alone with its own number of new queries
        calls = [(q_all[b:b + 1, :t], table[b:b + 1], lens[b:b + 1], f"row {(t, L)}")
                 for b, (t, L) in enumerate(rows)]
    else:
        calls = [(q_all[:, :tq], table, lens, f"{tq} queries, kv_lengths {rows}")]
    for q, t, n, what in calls:
        got, want = call(q, kn, vn, t, n), call(q, kz, vz, t, n)
        assert np.isfinite(np.asarray(got)).all(), f"{what}: not finite"
        np.testing.assert_array_equal(got, want, err_msg=what)


@pytest.mark.parametrize("impl", ["reference", "chunked"])
@pytest.mark.parametrize("tq", [3, 40])
def test_paged_gradients_ignore_slots_past_the_fill(impl, tq):
    """Gradients with respect to q and the pools: finite, equal to the zero-filled pool's,
    and zero on every slot past the fill (``dq = ds k`` meets ``ds = 0`` there)."""
    rows = ((tq, 53), (tq, 90))
    rng = np.random.default_rng(1)
    kn, vn, table, lens = _pool(rows, rng, np.nan)
    kz, vz, _, _ = _pool(rows, np.random.default_rng(1), 0.0)
    q = jnp.asarray(rng.standard_normal((2, tq, N, H)), jnp.float32)

    @jax.jit
    def grads(k_pages, v_pages):
        f = lambda q, kp, vp: jnp.sum(jnp.sin(jaxpos.attention(
            q, kp, vp, page_table=table, kv_lengths=lens, causal=True,
            position=jaxpos.ALiBi(N), implementation=impl)))
        return jax.grad(f, argnums=(0, 1, 2))(q, k_pages, v_pages)

    got, want = grads(kn, vn), grads(kz, vz)
    unfilled = np.isnan(np.asarray(kn))
    for name, g, w in zip(("q", "k_pages", "v_pages"), got, want):
        g = np.asarray(g)
        assert np.isfinite(g).all(), f"d{name} is not finite"
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-6, err_msg=f"d{name}")
        if name != "q":
            assert (g[unfilled] == 0).all(), f"d{name} past the fill"


@pytest.mark.parametrize("impl,tq", _cases({"decode": (1,), "chunk": (4,), "training": (20,)},
                                           fast="chunk"))
def test_dense_buffer_past_kv_lengths_never_reaches_output_or_gradients(impl, tq):
    """A dense cache ``[B, 24]`` filled to ``kv_lengths = [9, 24]`` with NaN past the fill
    (a decode step, a short prefill chunk, and a right-padded training call)."""
    Tk = 24 if tq != 20 else 20
    lens = jnp.array([9, Tk], jnp.int32)
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((2, tq, N, H)), jnp.float32)
    k, v = (rng.standard_normal((2, Tk, NK, H)).astype(np.float32) for _ in range(2))
    past = (np.arange(Tk)[None, :] >= np.asarray(lens)[:, None])[..., None, None]
    q_pos = None if tq == Tk else np.asarray(lens)[:, None] - tq + np.arange(tq)[None, :]

    @jax.jit
    def run(q, kk, vv):
        f = lambda q, k, v: jaxpos.attention(q, k, v, kv_lengths=lens, causal=True,
                                             q_positions=q_pos, implementation=impl,
                                             block_q=8, block_k=8)
        out, vjp = jax.vjp(f, q, kk, vv)
        return out, vjp(jnp.cos(out))

    (out, grads), (ref, ref_grads) = (
        run(q, *(jnp.asarray(np.where(past, fill, x)) for x in (k, v))) for fill in (np.nan, 0.0))
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(out, ref)
    for name, g, r in zip(("q", "k", "v"), grads, ref_grads):
        assert np.isfinite(np.asarray(g)).all(), f"d{name} is not finite"
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-6, err_msg=f"d{name}")
