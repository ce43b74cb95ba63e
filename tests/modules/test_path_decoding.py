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
from _path_cache_steps import path_cache_steps
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
    cache = (init_paged_cache(B, 10, NK, H, jnp.float32, page_size=4, num_pages=6) if paged
             else init_kv_cache(B, 10, NK, H, jnp.float32))
    S = 12 if paged else 10
    g_last, g_slots = jnp.zeros((B, N)), jnp.zeros((B, S, N))
    cache, got = path_cache_steps(cache, STEPS, q, k, v, w, beta, lf if fox else None, MASK,
                                  g_last, g_slots)
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
        _, got = path_cache_steps(cache, STEPS, q, k, v, w, beta, lf, MASK, g_last, g_slots,
                                  dtype=jnp.float64)
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


@pytest.mark.parametrize(("position", "cache_options"), [  # each cache, each variant once
    pytest.param("path", {}, id="dense-path", marks=pytest.mark.slow),
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


def _filled_caches(paged, fills, capacity, seed=3):
    """Two caches holding the same ``fills`` tokens per row (random keys and values, every
    slot a token): one of ``capacity`` slots whose unfilled slots (and, paged, unassigned
    pages, page 0 among them) hold NaN, one of exactly ``max(fills) + 4`` slots."""
    rng = np.random.default_rng(seed)
    L = max(fills)
    k = rng.normal(size=(B, L, NK, H)).astype(np.float32)
    v = rng.normal(size=(B, L, NK, H)).astype(np.float32)
    filled = np.arange(L)[None, :] < np.asarray(fills)[:, None]

    def dense(S, fill_value):
        kk = np.full((B, S, NK, H), fill_value, np.float32)
        vv = np.full((B, S, NK, H), fill_value, np.float32)
        kk[:, :L] = np.where(filled[..., None, None], k, fill_value)
        vv[:, :L] = np.where(filled[..., None, None], v, fill_value)
        return kk, vv

    def rows(S):
        pos = np.where(np.arange(S)[None] < np.asarray(fills)[:, None], np.arange(S), 0)
        valid = (np.arange(S)[None] < np.asarray(fills)[:, None]).astype(np.int32)
        n = np.asarray(fills, np.int32)
        return pos.astype(np.int32), valid, n

    exact = init_kv_cache(B, L + 4, NK, H, jnp.float32)
    kk, vv = dense(L + 4, 0.0)
    exact = exact._replace(k=jnp.asarray(kk), v=jnp.asarray(vv),
                           **dict(zip(("positions", "valid", "length"),
                                      map(jnp.asarray, rows(L + 4)))),
                           tokens=jnp.asarray(fills, jnp.int32))
    if not paged:
        big = init_kv_cache(B, capacity, NK, H, jnp.float32)
        kk, vv = dense(capacity, np.nan)
        big = big._replace(k=jnp.asarray(kk), v=jnp.asarray(vv),
                           **dict(zip(("positions", "valid", "length"),
                                      map(jnp.asarray, rows(capacity)))),
                           tokens=jnp.asarray(fills, jnp.int32))
        return exact, big
    ps = 16
    big = init_paged_cache(B, capacity, NK, H, jnp.float32, page_size=ps)
    P, pps = big.num_pages, big.page_table.shape[1]
    need = [-(-(f + 4) // ps) for f in fills]  # the step's tokens take pages too
    pages = 1 + rng.permutation(P - 1)[:sum(need)]  # shuffled, page 0 never assigned
    table = np.full((B, pps), -1, np.int32)
    kp = np.full((P, ps, NK, H), np.nan, np.float32)
    vp = np.full((P, ps, NK, H), np.nan, np.float32)
    kk, vv = dense(pps * ps, np.nan)
    at = 0
    for b in range(B):
        table[b, :need[b]] = pages[at:at + need[b]]
        at += need[b]
        for c in range(need[b]):
            kp[table[b, c]] = kk[b, c * ps:(c + 1) * ps]
            vp[table[b, c]] = vv[b, c * ps:(c + 1) * ps]
    pos, valid, n = rows(pps * ps)
    big = type(big)(jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(table),
                    jnp.asarray(P, jnp.int32), jnp.asarray(pos), jnp.asarray(valid),
                    jnp.asarray(n), jnp.asarray(n))
    return exact, big


@pytest.mark.parametrize(("fox", "paged"), [
    pytest.param(False, False, id="dense-path"),
    pytest.param(True, True, id="paged-path_fox", marks=pytest.mark.slow)])
def test_a_step_reads_and_moves_only_the_filled_slots(fox, paged):
    """A cache of 600 slots (3 blocks of 256 slots, the last shifted back; paged: 16-slot
    pages, shuffled) filled to 300 and 37 tokens, every unfilled slot (and the unassigned
    page 0) NaN: a one-token step and a three-token step give the outputs and moved keys of
    the same steps on a cache of exactly the fill (a step that read or moved an unfilled
    slot would carry the NaN into them)."""
    fills = [300, 37]
    exact, big = _filled_caches(paged, fills, 600)
    q, k, v, w, beta, lf = (jnp.asarray(x, jnp.float32) for x in _inputs(4))
    gates = {}
    for name, S in (("exact", max(fills) + 4), ("big", 600 if not paged else 608)):
        g_slots = np.where(np.arange(S)[None, :, None] < np.asarray(fills)[:, None, None],
                           -0.01 * np.arange(S)[None, :, None], np.nan)
        gates[name] = (jnp.full((B, N), -3.0), jnp.asarray(np.broadcast_to(g_slots, (B, S, N)),
                                                           jnp.float32))

    @jax.jit
    def step(cache, sl_inputs, pos, g_last, g_slots):
        qs, ks, vs, ws, bs, lfs = sl_inputs
        cache, read, gs = write_transforms(cache, qs, ks, vs, ws, bs, lfs if fox else None,
                                           pos, None, g_last, g_slots)
        out = cached_path_attention(read.scheme, read.q, read.k, read.v,
                                    segment_ids=read.segment_ids,
                                    kv_segment_ids=read.kv_segment_ids)
        return cache, out, gs if fox else (g_last, g_slots)

    outs = {}
    for name, cache in (("exact", exact), ("big", big)):
        g_last, g_slots = gates[name]
        got = []
        for a, b in ((0, 1), (1, 4)):
            pos = jnp.asarray(np.asarray(fills)[:, None] + np.arange(a, b)[None], jnp.int32)
            cache, out, (g_last, g_slots) = step(
                cache, tuple(x[:, a:b] for x in (q, k, v, w, beta, lf)), pos, g_last, g_slots)
            got.append(np.asarray(out))
        keys = (gather_pages(cache.k_pages, cache.page_table) if name == "big" and paged
                else cache.k)
        outs[name] = np.concatenate(got, 1), np.asarray(keys)
    assert np.isfinite(outs["big"][0]).all()
    np.testing.assert_allclose(outs["big"][0], outs["exact"][0], atol=2e-6)
    for b, f in enumerate(fills):
        np.testing.assert_allclose(outs["big"][1][b, :f + 4], outs["exact"][1][b, :f + 4],
                                   atol=2e-6)


def _computes_over_axis(jaxpr, size, acc):
    """(primitive, shape) of every equation (loops and calls included) with an input or
    output array holding an axis of ``size``, other than the indexing ones (slices,
    updates, scatters, gathers) and the loops and calls carrying such an array."""
    passing = {"scatter", "dynamic_slice", "dynamic_update_slice", "gather", "while", "pjit",
               "jit", "closed_call"}
    for e in jaxpr.eqns:
        shapes = [tuple(getattr(x.aval, "shape", ())) for x in list(e.invars) + e.outvars
                  if hasattr(x, "aval")]
        if e.primitive.name not in passing:
            acc += [(e.primitive.name, s) for s in shapes if size in s]
        for p in e.params.values():
            for s in (p if isinstance(p, (list, tuple)) else [p]):
                inner = getattr(s, "jaxpr", None)
                if inner is not None:
                    _computes_over_axis(inner if hasattr(inner, "eqns") else inner.jaxpr, size,
                                        acc)
    return acc


@pytest.mark.parametrize(("position", "cache_options", "T"), [
    pytest.param("path", {}, 1, id="dense-path-decode"),
    pytest.param("path_fox", {"page_size": 16, "num_pages": 37}, 3, id="paged-path_fox-chunk",
                 marks=pytest.mark.slow)])
def test_a_step_computes_nothing_over_the_whole_cache(position, cache_options, T):
    """Against a cache of 4112 slots (paged: a pool of 37 pages), no equation of a decode
    step computes on an array with an axis of the capacity: the cache is only sliced,
    updated and scattered into, in loops whose trip count follows the fill. A one-token
    step's compiled program copies no key buffer (it reads the keys after the move)."""
    S = 4112
    mha = jn.MultiHeadAttention(16, 4, num_kv_heads=2, position=position, causal=True,
                                scheme_options={"num_kv_heads": 2}, rngs=nnx.Rngs(0))
    cache = mha.init_cache(1, S, **cache_options)
    graph, state = nnx.split(mha)

    def step(state, x, cache):
        return nnx.merge(graph, state).decode(x, cache)

    x = jnp.ones((1, T, 16))
    jaxpr = jax.make_jaxpr(step)(state, x, cache).jaxpr
    for size in (S, 37) if cache_options else (S,):
        assert _computes_over_axis(jaxpr, size, []) == []
    if T == 1:
        hlo = jax.jit(step, donate_argnums=(2,)).lower(state, x, cache).compile().as_text()
        keys = f"f32[1,{S},2,4]"
        assert not [ln for ln in hlo.splitlines() if keys in ln and " copy(" in ln]
