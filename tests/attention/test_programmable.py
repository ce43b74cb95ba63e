"""Programmable attention: score_mod, mask_mod, block masks and sinks in every implementation.

The ground truth of each test is the tests' dense float64 NumPy reference
(``tests/_contract_reference.py``, written from the definitions: FlexAttention's score_mod
/ mask_mod semantics, Dong et al. 2024; GPT-OSS attention sinks), not the library's
reference path; each test writes its score term and mask as functions of the positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _contract_reference import contract_attention

import jaxpos
from jaxpos.mods import EMPTY, FULL, PARTIAL

IMPLS = ["reference", "chunked", "pallas", "xla"]
B, T, N, H = 2, 24, 4, 16


def _qkv(seed=0, T=T, N=N, Nk=N, H=H):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(ks[0], (B, T, N, H), jnp.float32)
    k = jax.random.normal(ks[1], (B, T, Nk, H), jnp.float32)
    v = jax.random.normal(ks[2], (B, T, Nk, H), jnp.float32)
    return q, k, v


def _dense64(q, k, v, bias_fn=None, vis_fn=None, sinks=None, scale=None):
    """float64 attention (the tests' dense reference, ``tests/_contract_reference.py``):
    ``bias_fn(b, h, i_pos, j_pos)`` and ``vis_fn(...)`` on position grids
    ``i [Tq, 1]``, ``j [1, Tk]``."""
    B, Tq, N, _ = np.shape(q)
    Tk = np.shape(k)[1]
    i, j = np.arange(Tq)[:, None], np.arange(Tk)[None, :]
    grid = lambda fn: None if fn is None else np.stack([np.stack(
        [np.broadcast_to(fn(b, h, i, j), (Tq, Tk)) for h in range(N)]) for b in range(B)])
    return contract_attention(q, k, v, bias=grid(bias_fn), mask=grid(vis_fn), sinks=sinks,
                              scale=scale, q_positions=np.arange(Tq),
                              kv_positions=np.arange(Tk))


def _attn(impl, *args, **kw):
    if impl == "pallas":
        kw.setdefault("block_q", 8)
        kw.setdefault("block_k", 8)
    elif impl == "chunked" and "block_mask" not in kw:
        kw.setdefault("block_q", 8)
        kw.setdefault("block_k", 8)
    return jaxpos.attention(*args, implementation=impl, **kw)


@pytest.mark.parametrize("impl", IMPLS)
def test_score_mod_with_captured_table_matches_float64_and_trains(impl):
    q, k, v = _qkv(1)
    R = 6
    table = jax.random.normal(jax.random.PRNGKey(7), (N, 2 * R + 1)) * 0.5

    def make(tab):
        def rel_table(score, batch, head, q_pos, kv_pos):
            return score + tab[head][jnp.clip(kv_pos - q_pos, -R, R) + R]
        return rel_table

    out = _attn(impl, q, k, v, score_mod=make(table), causal=True)
    tab64 = np.asarray(table, np.float64)
    want = _dense64(q, k, v, lambda b, h, i, j: tab64[h][np.clip(j - i, -R, R) + R],
                    lambda b, h, i, j: j <= i)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5)

    def loss(tab, q):
        return jnp.sum(_attn(impl, q, k, v, score_mod=make(tab), causal=True) ** 2)

    def loss_ref(tab, q):
        return jnp.sum(jaxpos.attention(q, k, v, score_mod=make(tab), causal=True,
                                        implementation="reference") ** 2)

    g = jax.grad(loss, argnums=(0, 1))(table, q)
    g_ref = jax.grad(loss_ref, argnums=(0, 1))(table, q)
    assert float(jnp.max(jnp.abs(g_ref[0]))) > 1e-3  # the table really gets a gradient
    np.testing.assert_allclose(np.asarray(g[0]), np.asarray(g_ref[0]), atol=5e-5, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(g[1]), np.asarray(g_ref[1]), atol=5e-5, rtol=1e-4)


def test_score_mod_gradient_matches_finite_differences():
    q, k, v = _qkv(2)
    gate = jnp.linspace(-1.0, 1.0, N)

    def loss(gt):
        sm = lambda s, b, h, qp, kp: s * (1.0 + 0.5 * jnp.tanh(gt[h]))
        return jnp.sum(jaxpos.attention(q, k, v, score_mod=sm, implementation="chunked",
                                        block_q=8, block_k=8) * v.mean())

    g = jax.grad(loss)(gate)
    eps = 1e-2
    for h in range(N):
        e = jnp.zeros(N).at[h].set(eps)
        fd = (loss(gate + e) - loss(gate - e)) / (2 * eps)
        np.testing.assert_allclose(float(g[h]), float(fd), rtol=2e-2, atol=2e-4)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("builtin", ["alibi", "t5"])
def test_builtin_equals_its_score_mod_form(impl, builtin):
    """ALiBi (Press et al. 2022, §3) and T5 (Raffel et al. 2020, §2.1) through position= and
    written by hand as score_mods give the same numbers, forward and gradients."""
    q, k, v = _qkv(3)
    if builtin == "alibi":
        slopes = jaxpos.alibi_slopes(N)
        scheme = lambda p: jaxpos.ALiBi(slopes=p)
        p0 = slopes

        def by_hand(p):
            return lambda s, b, h, qp, kp: s + p[h] * (kp - qp).astype(jnp.float32)
        scale = None
    else:
        p0 = jax.random.normal(jax.random.PRNGKey(4), (32, N))
        scheme = lambda p: jaxpos.T5Bias(p, bidirectional=False)

        def by_hand(p):
            return lambda s, b, h, qp, kp: s + p[jaxpos.t5_bucket(kp - qp, False), h]
        scale = 1.0

    f_pos = lambda p, q: _attn(impl, q, k, v, position=scheme(p), causal=True, scale=scale)
    f_mod = lambda p, q: _attn(impl, q, k, v, score_mod=by_hand(p), causal=True, scale=scale)
    np.testing.assert_allclose(np.asarray(f_pos(p0, q)), np.asarray(f_mod(p0, q)), atol=2e-6)
    loss = lambda f: (lambda p, q: jnp.sum(jnp.sin(f(p, q))))
    g_pos = jax.grad(loss(f_pos), argnums=(0, 1))(p0, q)
    g_mod = jax.grad(loss(f_mod), argnums=(0, 1))(p0, q)
    for a, b in zip(g_pos, g_mod):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)


def _window(w):
    return lambda b, h, qp, kp: (kp <= qp) & (qp - kp < w)


@pytest.mark.parametrize("impl", IMPLS)
def test_mask_mod_and_block_mask(impl):
    q, k, v = _qkv(5, T=40)
    w = 9
    want = _dense64(q, k, v, vis_fn=lambda b, h, i, j: (j <= i) & (i - j < w))
    out = _attn(impl, q, k, v, mask_mod=_window(w))
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5)
    pos = jnp.arange(40)
    bm = jaxpos.create_block_mask(_window(w), q_positions=pos, kv_positions=pos, block_q=8,
                                  block_k=8)
    out_bm = jaxpos.attention(q, k, v, block_mask=bm, implementation=impl)
    np.testing.assert_allclose(np.asarray(out_bm), want, atol=2e-5)


def test_block_mask_kinds_for_a_sliding_window():
    pos = jnp.arange(32)
    bm = jaxpos.create_block_mask(_window(8), q_positions=pos, kv_positions=pos, block_q=8,
                                  block_k=8)
    # q tile i sees k tile i (diagonal: partial) and k tile i-1 (partial: offsets 1..15
    # against a window of 8); everything else is empty.
    want = np.full((4, 4), EMPTY)
    for i in range(4):
        want[i, i] = PARTIAL
        if i:
            want[i, i - 1] = PARTIAL
    np.testing.assert_array_equal(np.asarray(bm.kinds[0, 0]), want)
    np.testing.assert_array_equal(np.asarray(bm.kv_num_blocks[0, 0]), [1, 2, 2, 2])
    causal = jaxpos.create_block_mask(lambda b, h, qp, kp: kp <= qp, q_positions=pos,
                                      kv_positions=pos, block_q=8, block_k=8)
    np.testing.assert_array_equal(np.asarray(causal.kinds[0, 0]),
                                  np.where(np.tri(4, k=-1, dtype=bool), FULL,
                                           np.where(np.eye(4, dtype=bool), PARTIAL, EMPTY)))
    assert causal.sparsity() == pytest.approx(6 / 16)


@pytest.mark.parametrize("impl", IMPLS)
def test_sinks_forward_and_gradient(impl):
    q, k, v = _qkv(6)
    sinks = jnp.array([0.5, -1.0, 2.0, 0.0])
    want = _dense64(q, k, v, vis_fn=lambda b, h, i, j: j <= i, sinks=np.asarray(sinks, np.float64))
    out = _attn(impl, q, k, v, sinks=sinks, causal=True)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5)
    loss = lambda f: (lambda s, v: jnp.sum(jnp.cos(f(s, v))))
    f = lambda s, v: _attn(impl, q, k, v, sinks=s, causal=True)
    f_ref = lambda s, v: jaxpos.attention(q, k, v, sinks=s, causal=True, implementation="reference")
    g = jax.grad(loss(f), argnums=(0, 1))(sinks, v)
    g_ref = jax.grad(loss(f_ref), argnums=(0, 1))(sinks, v)
    assert float(jnp.max(jnp.abs(g_ref[0]))) > 1e-3
    np.testing.assert_allclose(np.asarray(g[0]), np.asarray(g_ref[0]), atol=5e-5, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(g[1]), np.asarray(g_ref[1]), atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_composes_with_rope_gqa_segments_and_positions(impl):
    q, k, v = _qkv(8, N=4, Nk=2)
    rope = jaxpos.RoPE(rotary_dim=H)
    qp = jnp.arange(T) + 100
    seg = jnp.repeat(jnp.array([[0, 1]]), T // 2, axis=1).reshape(1, T).repeat(B, 0)
    gate = jnp.array([0.1, 0.2, 0.3, 0.4])
    sm = lambda s, b, h, qpos, kpos: s - gate[h] * jnp.abs(kpos - qpos).astype(jnp.float32)
    out = _attn(impl, q, k, v, position=rope, score_mod=sm, q_positions=qp, kv_positions=qp,
                segment_ids=seg, causal=True)
    # by hand: rotate with apply_rope, then float64 attention with the bias and masks
    qr = jaxpos.apply_rope(q, qp, rope.inv_freq)
    kr = jaxpos.apply_rope(k, qp, rope.inv_freq)
    seg_np = np.asarray(seg)
    g64 = np.asarray(gate, np.float64)
    want = _dense64(qr, kr, v, lambda b, h, i, j: -g64[h] * np.abs(j - i),
                    lambda b, h, i, j: (j <= i) & (seg_np[b][i] == seg_np[b][j]))
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5)


def test_jit_and_vmap():
    q, k, v = _qkv(9)
    table = jnp.linspace(0, 1, N)
    sm = lambda s, b, h, qp, kp: s + table[h] * (kp - qp).astype(jnp.float32)
    ref = jaxpos.attention(q, k, v, score_mod=sm, implementation="reference")
    f = jax.jit(lambda q: jaxpos.attention(q, k, v, score_mod=sm, implementation="chunked",
                                           block_q=8, block_k=8))
    np.testing.assert_allclose(np.asarray(f(q)), np.asarray(ref), atol=2e-5)
    fv = jax.vmap(lambda q1, k1, v1: jaxpos.attention(
        q1[None], k1[None], v1[None], score_mod=sm, implementation="chunked", block_q=8,
        block_k=8)[0])
    np.testing.assert_allclose(np.asarray(fv(q, k, v)), np.asarray(ref), atol=2e-5)


def test_common_mask_mods():
    """Sliding window (Beltagy et al. 2020, §3.1; HF sliding_window_overlay), Llama 4 chunks
    (HF chunked_overlay) and a prefix LM (Raffel et al. 2020, §3.2.1), written out."""
    qp, kp = jnp.arange(6)[:, None], jnp.arange(6)[None, :]
    i, j = np.arange(6)[:, None], np.arange(6)[None, :]
    np.testing.assert_array_equal(jaxpos.SlidingWindowMask(3)(0, 0, qp, kp), i - j < 3)
    np.testing.assert_array_equal(jaxpos.ChunkedAttentionMask(4)(0, 0, qp, kp), i // 4 == j // 4)
    np.testing.assert_array_equal(jaxpos.PrefixLMMask(2)(0, 0, qp, kp), (j < 2) | (j <= i))
    q, k, v = _qkv(11, T=20)
    out = jaxpos.attention(q, k, v, mask_mod=jaxpos.PrefixLMMask(5), implementation="chunked",
                           block_q=8, block_k=8)
    want = _dense64(q, k, v, vis_fn=lambda b, h, i, j: (j < 5) | (j <= i))
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5)
    for bad, name in ((lambda: jaxpos.SlidingWindowMask(0), "sliding_window"),
                      (lambda: jaxpos.ChunkedAttentionMask(-2), "attention_chunk_size"),
                      (lambda: jaxpos.PrefixLMMask(-1), "prefix_len")):
        with pytest.raises(ValueError, match=name):
            bad()


# ------------------------------------------------------------------------- bad input
def test_bad_score_mod_and_mask_mod():
    q, k, v = _qkv(0)
    with pytest.raises(ValueError, match=r"score_mod must return the score's shape"):
        jaxpos.attention(q, k, v, score_mod=lambda s, b, h, qp, kp: s[:1])
    with pytest.raises(TypeError, match=r"score_mod must return float32"):
        jaxpos.attention(q, k, v, score_mod=lambda s, b, h, qp, kp: s.astype(jnp.bfloat16))
    with pytest.raises(TypeError, match=r"score_mod must take \(score, batch, head"):
        jaxpos.attention(q, k, v, score_mod=lambda s, qp, kp: s)
    with pytest.raises(TypeError, match=r"mask_mod must return a bool"):
        jaxpos.attention(q, k, v, mask_mod=lambda b, h, qp, kp: kp - qp)
    with pytest.raises(TypeError, match=r"score_mod must be a function"):
        jaxpos.attention(q, k, v, score_mod=3.0)


def test_bad_block_mask_and_sinks():
    q, k, v = _qkv(0)
    pos = jnp.arange(T + 8)
    bm = jaxpos.create_block_mask(_window(4), q_positions=pos, kv_positions=pos, block_q=8,
                                  block_k=8)
    with pytest.raises(ValueError, match=r"block_mask was built for lengths"):
        jaxpos.attention(q, k, v, block_mask=bm)
    pos = jnp.arange(T)
    bm = jaxpos.create_block_mask(_window(4), q_positions=pos, kv_positions=pos, block_q=8,
                                  block_k=8)
    with pytest.raises(ValueError, match=r"block_q=16 differs from the block mask's block_q=8"):
        jaxpos.attention(q, k, v, block_mask=bm, block_q=16)
    with pytest.raises(TypeError, match=r"block_mask must be a jaxpos.BlockMask"):
        jaxpos.attention(q, k, v, block_mask=np.ones((1, 1, 3, 3)))
    with pytest.raises(ValueError, match=r"sinks must have shape \[num_heads\] = \[4\]"):
        jaxpos.attention(q, k, v, sinks=jnp.zeros(3))
    with pytest.raises(TypeError, match=r"sinks must be a floating-point"):
        jaxpos.attention(q, k, v, sinks=jnp.zeros(4, jnp.int32))
    with pytest.raises(TypeError, match=r"q_positions must hold integer"):
        jaxpos.create_block_mask(_window(4), q_positions=jnp.arange(4.0), kv_positions=pos)


def test_layout_hint_names_the_swap():
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in _qkv(0))  # [B, N, T, H]
    with pytest.raises(ValueError, match=r"looks like \[B, N, T, H\]"):
        jaxpos.attention(q, k, v, position=jaxpos.ALiBi(N))
    with pytest.raises(ValueError, match=r"looks like \[B, N, T, H\]"):
        jaxpos.attention(q, k, v, q_positions=jnp.arange(T), kv_positions=jnp.arange(T))


def test_t5_bidirectional_with_causal_is_refused():
    q, k, v = _qkv(0)
    with pytest.raises(ValueError, match=r"bidirectional=True\) with causal=True"):
        jaxpos.attention(q, k, v, position=jaxpos.T5Bias(jnp.zeros((32, N))), causal=True)


# ------------------------------------------- cases that would otherwise fail silently
def test_block_mask_refuses_a_mask_mod_it_would_classify_for_one_row_only():
    lens = jnp.array([10, 40])
    by_row = lambda b, h, qp, kp: kp < lens[b]
    pos = jnp.arange(40)
    with pytest.raises(ValueError, match=r"mask_mod reads its batch argument.*batch_size="):
        jaxpos.create_block_mask(by_row, q_positions=pos, kv_positions=pos, block_q=8, block_k=8)
    with pytest.raises(ValueError, match=r"mask_mod reads its head argument.*num_heads="):
        jaxpos.create_block_mask(lambda b, h, qp, kp: kp < 10 * (h + 1), q_positions=pos,
                                 kv_positions=pos, block_q=8, block_k=8)
    q, k, v = _qkv(12, T=40)
    bm = jaxpos.create_block_mask(by_row, q_positions=pos, kv_positions=pos, block_q=8,
                                  block_k=8, batch_size=B)
    want = _dense64(q, k, v, vis_fn=lambda b, h, i, j: (j <= i) & (j < [10, 40][b]))
    for impl in ("chunked", "pallas"):
        out = jaxpos.attention(q, k, v, block_mask=bm, causal=True, implementation=impl)
        np.testing.assert_allclose(np.asarray(out), want, atol=2e-5)


def test_block_mask_built_for_other_positions_is_refused():
    q, k, v = _qkv(13, T=32)
    pos = jnp.arange(32)
    bm = jaxpos.create_block_mask(jaxpos.PrefixLMMask(8), q_positions=pos, kv_positions=pos,
                                  block_q=8, block_k=8)
    with pytest.raises(ValueError, match=r"block_mask was built for other q_positions"):
        jaxpos.attention(q, k, v, block_mask=bm, q_positions=pos + 100, kv_positions=pos + 100,
                         implementation="chunked")


@pytest.mark.parametrize("impl", IMPLS)
def test_a_row_hidden_by_the_score_mod_gives_zeros(impl):
    q, k, v = _qkv(14)
    hide_early = lambda s, b, h, qp, kp: jnp.where(qp >= 5, s, -jnp.inf)
    out = np.asarray(_attn(impl, q, k, v, score_mod=hide_early))
    np.testing.assert_array_equal(out[:, :5], 0.0)
    want = _dense64(q, k, v, vis_fn=lambda b, h, i, j: np.broadcast_to(i >= 5, (T, T)))
    np.testing.assert_allclose(out, want, atol=2e-5)


def test_traced_scale_and_empty_batch():
    q, k, v = _qkv(15)
    with pytest.raises(TypeError, match=r"implementation='pallas' needs a static scale"):
        jax.jit(lambda s: jaxpos.attention(q, k, v, scale=s, implementation="pallas"))(0.5)
    traced = jax.jit(lambda s: jaxpos.attention(q, k, v, scale=s, implementation="chunked"))
    np.testing.assert_allclose(np.asarray(traced(0.5)), np.asarray(jaxpos.attention(
        q, k, v, scale=0.5, implementation="reference")), atol=2e-5)
    for impl in IMPLS:
        assert jaxpos.attention(q[:0], k[:0], v[:0], implementation=impl).shape == (0, T, N, H)
