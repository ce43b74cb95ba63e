"""PaTH's KV-cache decoding (Yang et al. 2025, arXiv:2505.16381, §3.2, "Efficient
inference": every cached key moved by each new token's transform).

* The cache step itself (``write_transforms`` + ``cached_path_attention``), over the
  dense and the paged cache, against the float64 NumPy loop that multiplies the
  Householder matrices explicitly (``_replacing_reference.np_path``), for steps of 3, 1,
  2, 1, 1 tokens with a left-padded row, grouped-query heads and the PaTH-FoX gate; the
  keys the cache holds afterwards are the explicit products ``H_t ... H_{j+1} k_j``.
* The modules (NNX and Linen, ``DecoderLM`` and ``MultiHeadAttention``): decoding with a
  left-padded two-chunk prefill and single steps, eager and jitted, equals the full pass
  with transforms made strong (random ``beta`` biases, larger ``w`` projections).
* The refusals: a StreamingLLM cache (it cannot move its keys in place), a bare
  ``KVCache`` without PaTH's decode state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _replacing_reference import np_path, path_inputs
from flax import nnx

from jaxpos import linen as jl
from jaxpos import nnx as jn
from jaxpos.core.paged import gather_pages
from jaxpos.core.path_decode import cached_path_attention
from jaxpos.layers.cache import SchemeStateCache, init_kv_cache, init_paged_cache
from jaxpos.layers.cache.path import write_transforms

B, T, N, NK, H = 2, 8, 4, 2, 4
MASK = np.array([[1] * 8, [0, 0, 1, 1, 1, 1, 1, 1]], bool)  # row 1 left-padded
STEPS = ((0, 3), (3, 4), (4, 6), (6, 7), (7, 8))


def _inputs(seed=0):
    # float64 copies of the float32 numbers both sides hold
    return [np.asarray(x, np.float64) for x in path_inputs(seed, B, T, N, NK, H, H)]


def _explicit_moved_keys(k, w, beta, mask):
    """``H_{T-1} ... H_{j+1} k_j`` for every token ``j`` (padding transforms skipped)."""
    out = np.array(k)
    for b in range(B):
        for h in range(NK):
            for j in range(T):
                for t in range(j + 1, T):
                    if mask[b, t]:
                        wt = w[b, t, h]
                        out[b, j, h] = out[b, j, h] - beta[b, t, h] * wt * (wt @ out[b, j, h])
    return out


@pytest.mark.parametrize(("fox", "paged"), [
    pytest.param(False, False, id="dense-path", marks=pytest.mark.slow),
    pytest.param(True, False, id="dense-path_fox", marks=pytest.mark.slow),
    pytest.param(False, True, id="paged-path", marks=pytest.mark.slow),
    pytest.param(True, True, id="paged-path_fox")])
def test_cache_steps_equal_the_float64_householder_products(fox, paged):
    q, k, v, w, beta, lf = _inputs()
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    cache = (init_paged_cache(B, 10, NK, H, jnp.float32, page_size=4, num_pages=6) if paged
             else init_kv_cache(B, 10, NK, H, jnp.float32))
    S = 12 if paged else 10
    g_last, g_slots = jnp.zeros((B, N)), jnp.zeros((B, S, N))
    outs = []
    for a, b in STEPS:
        sl = slice(a, b)
        pos = np.broadcast_to(np.arange(a, b), (B, b - a))
        cache, read, gates = write_transforms(
            cache, f32(q[:, sl]), f32(k[:, sl]), f32(v[:, sl]), f32(w[:, sl]),
            f32(beta[:, sl]), f32(lf[:, sl]) if fox else None, pos, MASK[:, sl],
            g_last, g_slots)
        if fox:
            g_last, g_slots = gates
        outs.append(cached_path_attention(read.scheme, read.q, read.k, read.v,
                                          segment_ids=read.segment_ids,
                                          kv_segment_ids=read.kv_segment_ids))
    got = np.concatenate([np.asarray(o) for o in outs], 1)
    want = np_path(q, k, v, w, beta, lf if fox else None, MASK.astype(int))
    np.testing.assert_allclose(got[MASK], want[MASK], atol=3e-6)
    keys = gather_pages(cache.k_pages, cache.page_table) if paged else cache.k
    moved = _explicit_moved_keys(k, w, beta, MASK)
    np.testing.assert_allclose(np.asarray(keys)[:, :T][MASK], moved[MASK], atol=3e-6)


@pytest.mark.slow
def test_float64_cache_steps_keep_float64_precision():
    q, k, v, w, beta, lf = _inputs(1)
    with jax.enable_x64(True):
        cache = init_kv_cache(B, 10, NK, H, jnp.float64)
        g_last, g_slots = jnp.zeros((B, N), jnp.float64), jnp.zeros((B, 10, N), jnp.float64)
        outs = []
        for a, b in STEPS:
            sl = slice(a, b)
            pos = np.broadcast_to(np.arange(a, b), (B, b - a))
            cache, read, (g_last, g_slots) = write_transforms(
                cache, *(jnp.asarray(x[:, sl]) for x in (q, k, v, w, beta, lf)), pos,
                MASK[:, sl], g_last, g_slots)
            outs.append(np.asarray(cached_path_attention(
                read.scheme, read.q, read.k, read.v, segment_ids=read.segment_ids,
                kv_segment_ids=read.kv_segment_ids)))
    got = np.concatenate(outs, 1)
    assert got.dtype == np.float64
    want = np_path(q, k, v, w, beta, lf, MASK.astype(int))
    np.testing.assert_allclose(got[MASK], want[MASK], atol=1e-12)


def _strengthen(model):
    """Make the PaTH transforms far from identity: beta biases in (-2, 2) (``beta`` in
    (0.24, 1.76)), ``w_up`` times 30 (the convolution's SiLU out of its linear range)."""
    for i, blk in enumerate(model.blocks):
        pm = blk.attn.position_module
        pm.beta_b[...] = jax.random.uniform(jax.random.key(10 + i), pm.beta_b[...].shape,
                                            minval=-2.0, maxval=2.0)
        pm.w_up[...] = 30.0 * pm.w_up[...]


def _decode(step, tokens, cache):
    out = []
    for a, b in ((0, 3), (3, 5)):
        logits, cache = step(tokens[:, a:b], cache, MASK[:, a:b])
        out.append(logits)
    for t in range(5, T):
        logits, cache = step(tokens[:, t:t + 1], cache, None)
        out.append(logits)
    return np.asarray(jnp.concatenate(out, 1)), cache


@pytest.mark.parametrize(("position", "cache_options"), [
    pytest.param("path", {}, id="dense-path", marks=pytest.mark.slow),
    pytest.param("path_fox", {}, id="dense-path_fox"),
    pytest.param("path", {"page_size": 2, "num_pages": 8}, id="paged-path",
                 marks=pytest.mark.slow),
    pytest.param("path_fox", {"page_size": 2, "num_pages": 8}, id="paged-path_fox",
                 marks=pytest.mark.slow)])
def test_decoder_decoding_equals_the_full_pass(position, cache_options):
    m = jn.DecoderLM(40, d_model=16, num_layers=2, num_heads=4, num_kv_heads=2,
                     position=position, scheme_options={"num_kv_heads": 2},
                     implementation="chunked", rngs=nnx.Rngs(0))
    _strengthen(m)
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, 40)
    full = np.asarray(m(tokens, attention_mask=MASK))
    step = lambda t, c, mask: m.decode_step(t, c, attention_mask=mask)
    got, cache = _decode(step, tokens, m.init_cache(B, 8, **cache_options))
    np.testing.assert_allclose(got[MASK], full[MASK], atol=2e-5)
    assert isinstance(cache[0], SchemeStateCache)
    np.testing.assert_array_equal(np.asarray(cache[0].token_count())[:, 0], [8, 6])
    # jitted steps give the same logits (the state is a pytree of fixed shapes)
    graphdef, state = nnx.split(m)
    jstep = jax.jit(lambda s, t, c, mask: nnx.merge(graphdef, s).decode_step(
        t, c, attention_mask=mask))
    jitted, _ = _decode(lambda t, c, mask: jstep(state, t, c, mask), tokens,
                        m.init_cache(B, 8, **cache_options))
    np.testing.assert_allclose(jitted[MASK], full[MASK], atol=2e-5)


@pytest.mark.slow
def test_linen_decoder_decoding_equals_the_nnx_twin():
    kw = dict(d_model=16, num_layers=2, num_heads=4, position="path_fox")
    m = jn.DecoderLM(40, rngs=nnx.Rngs(0), **kw)
    _strengthen(m)
    lin = jl.DecoderLM(40, **kw)
    params = {"params": jl.params_from_nnx(m)}
    tokens = jax.random.randint(jax.random.key(2), (B, T), 0, 40)
    want, _ = _decode(lambda t, c, mask: m.decode_step(t, c, attention_mask=mask), tokens,
                      m.init_cache(B, 8))
    got, _ = _decode(lambda t, c, mask: lin.apply(params, t, c, attention_mask=mask,
                                                  method="decode_step"),
                     tokens, lin.init_cache(B, 8))
    np.testing.assert_allclose(got[MASK], want[MASK], atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_multi_head_attention_decoding_equals_the_full_pass(kind):
    kw = dict(num_kv_heads=2, head_dim=4, position="path", causal=True,
              scheme_options={"num_kv_heads": 2, "path_conv_size": 4})
    x = jax.random.normal(jax.random.key(3), (B, T, 16))
    if kind == "nnx":
        mha = jn.MultiHeadAttention(16, 4, rngs=nnx.Rngs(0), **kw)
        full = lambda: mha(x)
        decode = mha.decode
    else:
        mha = jl.MultiHeadAttention(16, 4, **kw)
        params = mha.init(jax.random.key(0), x)
        full = lambda: mha.apply(params, x)
        decode = lambda xs, c: mha.apply(params, xs, c, method="decode")
    cache = mha.init_cache(B, T)
    outs = []
    for a, b in ((0, 2), (2, 3), (3, 8)):
        y, cache = decode(x[:, a:b], cache)
        outs.append(y)
    np.testing.assert_allclose(np.concatenate(outs, 1), full(), atol=2e-5)


def test_path_refuses_caches_without_its_decode_state():
    m = jn.DecoderLM(30, d_model=16, num_layers=1, num_heads=2, position="path",
                     rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="position='path' decodes by moving the cached keys"):
        m.init_cache(1, 8, keep_first=2)
    bare = (init_kv_cache(1, 8, 2, 8, jnp.float32),)
    with pytest.raises(ValueError, match="cache that carries its decode state"):
        m.decode_step(jnp.zeros((1, 2), jnp.int32), bare)
