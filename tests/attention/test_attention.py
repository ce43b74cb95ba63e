"""jaxpos.attention: the reference against float64 NumPy, the chunked implementation
against the reference (forward and gradients), masks and shapes, empty rows, KV-cache
decoding, packed sequences, and the jit cache.

Tolerances (float32 computation, float64 or float32 ground truth):
* forward outputs (unit-scale values): ``atol = 2e-5``, ``rtol = 2e-5``;
* gradients: ``|g - g_ref| <= 1e-4 * max|g_ref|`` per leaf, relative to the leaf's
  largest entry (sums over many tiles, e.g. ALiBi slopes or RoPE inv_freq, collect
  float32 rounding of every term).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _attention_reference import SCHEMES, make_params, make_scheme, np_attention

import jaxpos

FWD_TOL = {"atol": 2e-5, "rtol": 2e-5}
GRAD_RTOL = 1e-4

# Jitted once: eager calls would compile every primitive for every shape.
attn = jax.jit(jaxpos.attention,
               static_argnames=("causal", "scale", "implementation", "block_q", "block_k"))


def _qkv(rng, B, Tq, Tk, N, Nk, H):
    f = lambda *s: rng.normal(size=s).astype(np.float32)
    return f(B, Tq, N, H), f(B, Tk, Nk, H), f(B, Tk, Nk, H)


def assert_grads_close(got, want, rtol=GRAD_RTOL):
    """Every leaf: ``max|got - want| <= rtol * max|want|`` (and finite)."""
    for path, g, w in zip(jax.tree_util.tree_leaves_with_path(want),
                          jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.all(np.isfinite(g)), f"non-finite gradient at {path[0]}"
        err, ref = np.max(np.abs(g - w)), np.max(np.abs(w))
        assert err <= rtol * ref + 1e-7, (
            f"gradient at {jax.tree_util.keystr(path[0])}: max|diff| {err:.3g} > "
            f"{rtol} * max|ref| {ref:.3g}")


# ----------------------------------------------------------------- reference vs NumPy
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("name", SCHEMES)
def test_reference_matches_float64_numpy(name, causal, rng):
    """GQA (4 query heads, 2 kv heads), Tq != Tk, per-row position offsets."""
    B, Tq, Tk, N, Nk, H = 2, 5, 7, 4, 2, 8
    q, k, v = _qkv(rng, B, Tq, Tk, N, Nk, H)
    params = make_params(name, N, H, rng, bidirectional=not causal)
    kv_pos = np.array([np.arange(Tk), np.arange(Tk) + 3])
    q_pos = kv_pos[:, -Tq:]
    scale = 1.0 if name == "t5" else None  # T5 does not scale its scores
    got = attn(q, k, v, position=make_scheme(name, params), q_positions=q_pos,
                           kv_positions=kv_pos, causal=causal, scale=scale,
                           implementation="reference")
    want = np_attention(q, k, v, name=name, params=params, q_positions=q_pos,
                        kv_positions=kv_pos, causal=causal, scale=scale)
    assert got.shape == (B, Tq, N, H) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, **FWD_TOL)


def test_score_bias_is_added_after_scaling(rng):
    """jax.nn.dot_product_attention adds ``bias`` after scaling, as BLOOM does with ALiBi."""
    B, T, N, H = 1, 6, 4, 16
    q, k, v = _qkv(rng, B, T, T, N, N, H)
    alibi = jaxpos.ALiBi(num_heads=N)
    bias = jaxpos.alibi_bias(np.arange(T), np.arange(T), alibi.slopes)[None]
    for scale in (None, 0.3):
        got = attn(q, k, v, position=alibi, causal=True, scale=scale,
                               implementation="reference")
        want = jax.nn.dot_product_attention(q, k, v, bias=bias, is_causal=True, scale=scale)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), **FWD_TOL)


# -------------------------------------------------------------- chunked vs reference
# Two configurations stress the tiling: self-attention, packed segments, GQA, tiles
# that do not divide T (11 = 4+4+3 queries, 3+3+3+2 keys); and Tq != Tk decoding-style
# with per-row offsets and a boolean mask, where T5/ALiBi are causal.
CONFIGS = {
    "packed-gqa": {"B": 2, "Tq": 11, "Tk": 11, "N": 4, "Nk": 2, "H": 8, "block_q": 4, "block_k": 3},
    "cross-mask": {"B": 2, "Tq": 5, "Tk": 9, "N": 4, "Nk": 1, "H": 8, "block_q": 2, "block_k": 4},
}


def _config_inputs(cfg_name, rng):
    c = CONFIGS[cfg_name]
    q, k, v = _qkv(rng, c["B"], c["Tq"], c["Tk"], c["N"], c["Nk"], c["H"])
    kw = {}
    if cfg_name == "packed-gqa":
        kw["segment_ids"] = np.array([[0] * 5 + [1] * 6, [0] * 3 + [1] * 3 + [2] * 5], np.int32)
        kw["q_positions"] = kw["kv_positions"] = np.array(
            [list(range(5)) + list(range(6)), list(range(3)) * 2 + list(range(5))], np.int32)
    else:
        kw["kv_positions"] = np.array([np.arange(9), np.arange(9) + 20], np.int32)
        kw["q_positions"] = kw["kv_positions"][:, 4:]
        mask = rng.random((c["B"], 1, c["Tq"], c["Tk"])) < 0.8
        mask[1, 0, 2, :] = False  # one row with nothing visible
        kw["mask"] = mask
    return c, (q, k, v), kw


def _slow_unless(name, cfg_name, keep):
    """The default run covers every scheme causal ("packed-gqa") and the parametrised
    tables (T5, Shaw) non-causal too; the rest run under ``pytest -m slow``."""
    marks = [] if (name, cfg_name) in keep or cfg_name == "packed-gqa" else [pytest.mark.slow]
    return pytest.param(name, cfg_name, marks=marks, id=f"{name}-{cfg_name}")


@pytest.mark.parametrize("name, cfg_name", [
    _slow_unless(n, c, keep={("t5", "cross-mask"), ("shaw", "cross-mask")})
    for n in SCHEMES for c in CONFIGS])
def test_chunked_matches_reference(name, cfg_name, rng):
    """Forward and gradients (q, k, v and every scheme array: RoPE inv_freq, ALiBi
    slopes, the T5 table, Shaw's tables), causal in one configuration and not in the
    other, through jit."""
    c, (q, k, v), kw = _config_inputs(cfg_name, rng)
    causal = cfg_name == "packed-gqa"
    scheme = make_scheme(name, make_params(name, c["N"], c["H"], rng, bidirectional=not causal))
    w = rng.normal(size=(c["B"], c["Tq"], c["N"], c["H"])).astype(np.float32)

    @jax.jit
    def both(q, k, v, scheme):  # one compilation for both implementations
        def run(impl, blocks):
            def loss(q, k, v, scheme):
                out = jaxpos.attention(q, k, v, position=scheme, causal=causal,
                                       implementation=impl, **kw, **blocks)
                return jnp.sum(out * w), out
            return jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, scheme)
        return (run("chunked", {"block_q": c["block_q"], "block_k": c["block_k"]}),
                run("reference", {}))

    ((_, out_c), g_c), ((_, out_r), g_r) = both(q, k, v, scheme)
    np.testing.assert_allclose(np.asarray(out_c), np.asarray(out_r), **FWD_TOL)
    assert_grads_close(g_c, g_r)
    if name != "nope":
        assert any(np.max(np.abs(x)) > 0 for x in jax.tree_util.tree_leaves(g_r[3])), \
            "the scheme's parameters must receive a gradient"


@pytest.mark.parametrize("block", [(1, 1), (3, 5), (16, 16)], ids=str)
def test_chunked_block_sizes(block, rng):
    """Any block size gives the reference result, including blocks larger than T."""
    q, k, v = _qkv(rng, 1, 7, 7, 2, 2, 4)
    alibi = jaxpos.ALiBi(num_heads=2)
    got = attn(q, k, v, position=alibi, causal=True, implementation="chunked",
                           block_q=block[0], block_k=block[1])
    want = np_attention(q, k, v, name="alibi", causal=True,
                        params={"slopes": np.asarray(alibi.slopes, np.float64),
                                "bidirectional": False})
    np.testing.assert_allclose(np.asarray(got), want, **FWD_TOL)


def test_chunked_is_the_cpu_default():
    if jax.default_backend() != "cpu":
        pytest.skip("CPU-only expectation")
    assert jaxpos.default_implementation(jaxpos.ALiBi(num_heads=4)) == "chunked"


# ----------------------------------------------------------------- masks and shapes
def test_causal_decode_convention_when_tk_exceeds_tq(rng):
    """Default positions align the queries to the end of the keys: query i of 3 sits at
    position 4 + i of 7 and sees keys 0 .. 4 + i."""
    q, k, v = _qkv(rng, 1, 3, 7, 2, 2, 4)
    visible = np.arange(7)[None, :] <= (np.arange(3) + 4)[:, None]
    want = np_attention(q, k, v, mask=visible)
    for impl in ("reference", "chunked"):
        got = attn(q, k, v, causal=True, implementation=impl)
        np.testing.assert_allclose(np.asarray(got), want, **FWD_TOL)
    # The last query sees everything: it equals unmasked attention of that row.
    full = attn(q, k, v, implementation="reference")
    np.testing.assert_allclose(np.asarray(got)[:, -1], np.asarray(full)[:, -1], **FWD_TOL)


@pytest.mark.parametrize("shape", [(5, 6), (2, 1, 5, 6), (1, 3, 1, 6), (2, 3, 5, 1)],
                         ids=lambda s: "x".join(map(str, s)))
def test_boolean_mask_broadcasts(shape, rng):
    B, Tq, Tk, N, H = 2, 5, 6, 3, 4
    q, k, v = _qkv(rng, B, Tq, Tk, N, N, H)
    mask = rng.random(shape) < 0.7
    want = np_attention(q, k, v, mask=np.broadcast_to(mask, (B, N, Tq, Tk)))
    for impl in ("reference", "chunked"):
        got = attn(q, k, v, mask=mask, implementation=impl, block_q=2, block_k=4)
        np.testing.assert_allclose(np.asarray(got), want, **FWD_TOL)


def test_multi_query_attention_equals_repeated_kv(rng):
    """MQA (one kv head) equals multi-head attention with that head repeated."""
    q, k, v = _qkv(rng, 2, 6, 6, 4, 1, 8)
    rope = jaxpos.RoPE(rotary_dim=8)
    for impl in ("reference", "chunked"):
        got = attn(q, k, v, position=rope, causal=True, implementation=impl)
        want = attn(q, np.repeat(k, 4, 2), np.repeat(v, 4, 2), position=rope,
                                causal=True, implementation="reference")
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), **FWD_TOL)


def _implementations():
    impls = ["reference", "chunked"]
    try:
        from jaxpos.kernels import attention_via_kernel  # noqa: F401
        impls.append("pallas")
    except ImportError:
        pass
    return impls


@pytest.mark.parametrize("impl", _implementations())
def test_rows_with_no_visible_key_give_zeros_and_zero_gradients(impl, rng):
    """Every implementation: a query that sees no key (masked out, or a segment with no
    keys) returns zeros, and gradients are finite, zero for that query."""
    B, T, N, H = 2, 6, 2, 8
    q, k, v = _qkv(rng, B, T, T, N, N, H)
    seg_q = np.array([[0, 0, 1, 1, 9, 9], [0, 0, 0, 1, 1, 1]], np.int32)  # id 9: no keys
    seg_kv = np.array([[0, 0, 1, 1, 2, 2], [0, 0, 0, 1, 1, 1]], np.int32)
    mask = np.ones((B, 1, T, T), bool)
    mask[1, 0, 2] = False  # batch 1, query 2: everything hidden
    alibi = jaxpos.ALiBi(num_heads=N)
    kw = {"position": alibi, "causal": True, "mask": mask, "segment_ids": seg_q,
          "kv_segment_ids": seg_kv, "implementation": impl}
    if impl == "pallas":
        kw.pop("mask")  # the fused kernel takes segments, not dense masks
    empty = [(0, 4), (0, 5)] + ([(1, 2)] if "mask" in kw else [])

    def loss(q, k, v, alibi):
        return jnp.sum(jaxpos.attention(q, k, v, **{**kw, "position": alibi}) ** 2)

    out = attn(q, k, v, **kw)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, alibi)
    for b, t in empty:
        np.testing.assert_array_equal(np.asarray(out)[b, t], 0.0)
        np.testing.assert_array_equal(np.asarray(grads[0])[b, t], 0.0)
    for g in jax.tree_util.tree_leaves(grads):
        assert np.all(np.isfinite(np.asarray(g)))
    assert np.all(np.abs(np.asarray(out)[0, :4]) > 0)  # the other rows are not zeroed


# ----------------------------------------------------------------- decoding, packing
@pytest.mark.parametrize("name", ["rope", "alibi", "t5"])
def test_kv_cache_decoding_matches_full_forward(name, rng):
    """Queries one at a time with their positions against the full keys/values (a KV
    cache: causal hides the not-yet-written slots), batch rows at different offsets,
    equal the full causal forward pass."""
    B, T, N, H = 2, 9, 4, 8
    q, k, v = _qkv(rng, B, T, T, N, N, H)
    scheme = make_scheme(name, make_params(name, N, H, rng, bidirectional=False))
    pos = np.array([np.arange(T), np.arange(T) + 37], np.int32)  # row 1 starts at 37
    full = attn(q, k, v, position=scheme, q_positions=pos, kv_positions=pos,
                            causal=True, implementation="reference")

    @jax.jit
    def step(q_t, q_pos_t):
        return jaxpos.attention(q_t, k, v, position=scheme, q_positions=q_pos_t,
                                kv_positions=pos, causal=True, implementation="chunked",
                                block_k=4)

    steps = [step(q[:, t:t + 1], pos[:, t:t + 1]) for t in range(T)]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), np.asarray(full), **FWD_TOL)


@pytest.mark.parametrize("name", ["rope", "t5", pytest.param("alibi", marks=pytest.mark.slow),
                                  pytest.param("shaw", marks=pytest.mark.slow)])
def test_packed_batch_equals_documents_alone(name, rng):
    """Three documents packed in one row with segment ids and restarting positions give
    what each document gives alone."""
    lengths, N, H = (4, 3, 5), 2, 8
    T = sum(lengths)
    q, k, v = _qkv(rng, 1, T, T, N, N, H)
    scheme = make_scheme(name, make_params(name, N, H, rng, bidirectional=False))
    seg = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)])[None].astype(np.int32)
    pos = np.concatenate([np.arange(n) for n in lengths])[None].astype(np.int32)
    packed = attn(q, k, v, position=scheme, causal=True, segment_ids=seg,
                              q_positions=pos, kv_positions=pos, implementation="chunked",
                              block_q=4, block_k=4)
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        alone = attn(q[:, sl], k[:, sl], v[:, sl], position=scheme, causal=True,
                                 implementation="reference")
        np.testing.assert_allclose(np.asarray(packed)[:, sl], np.asarray(alone), **FWD_TOL)
        start += n


# ----------------------------------------------------------------- jit cache
def test_new_scheme_values_do_not_retrace(rng):
    """Scheme arrays are pytree children: new values reuse the compiled function."""
    N, H = 2, 8
    q, k, v = _qkv(rng, 1, 6, 6, N, N, H)
    traces = []

    @functools.partial(jax.jit, static_argnames="impl")
    def f(q, k, v, scheme, impl):
        traces.append(type(scheme).__name__)
        return attn(q, k, v, position=scheme, causal=True, implementation=impl)

    variants = {
        "RoPE": [jaxpos.RoPE(10000.0 ** (-np.arange(0, 8, 2, dtype=np.float32) / 8)),
                 jaxpos.RoPE(500000.0 ** (-np.arange(0, 8, 2, dtype=np.float32) / 8))],
        "ALiBi": [jaxpos.ALiBi(num_heads=N), jaxpos.ALiBi(slopes=np.array([0.3, 0.7], np.float32))],
        "T5Bias": [jaxpos.T5Bias(rng.normal(size=(32, N)).astype(np.float32), bidirectional=False),
                   jaxpos.T5Bias(rng.normal(size=(32, N)).astype(np.float32), bidirectional=False)],
        "Shaw": [jaxpos.Shaw(*rng.normal(size=(2, 5, H)).astype(np.float32)),
                 jaxpos.Shaw(*rng.normal(size=(2, 5, H)).astype(np.float32))],
    }
    for kind, (a, b) in variants.items():
        out_a = f(q, k, v, a, "chunked")
        out_b = f(q, k, v, b, "chunked")
        assert traces.count(kind) == 1, f"{kind}: traced {traces.count(kind)} times"
        assert not np.allclose(np.asarray(out_a), np.asarray(out_b)), "values must matter"
    # A static field (here RoPE's layout) is part of the cache key: that one retraces.
    f(q, k, v, variants["RoPE"][0].replace(layout="interleaved"), "chunked")
    assert traces.count("RoPE") == 2


# ----------------------------------------------------------------- parity with PyTorch
@pytest.mark.parity
def test_reference_matches_torch_sdpa_with_float_mask(rng):
    """PyTorch ``scaled_dot_product_attention`` with ALiBi as an additive float mask
    (``-inf`` above the diagonal), as BLOOM feeds it."""
    torch = pytest.importorskip("torch")
    B, T, N, H = 2, 10, 4, 16
    q, k, v = _qkv(rng, B, T, T, N, N, H)
    slopes = 2.0 ** (-8.0 * np.arange(1, N + 1) / N)
    rel = np.arange(T)[None, :] - np.arange(T)[:, None]
    bias = np.where(rel <= 0, slopes[:, None, None] * rel, -np.inf)[None]
    t = lambda x: torch.from_numpy(np.ascontiguousarray(np.swapaxes(x, 1, 2)))
    want = torch.nn.functional.scaled_dot_product_attention(
        t(q), t(k), t(v), attn_mask=torch.from_numpy(bias.astype(np.float32)))
    want = np.swapaxes(want.numpy(), 1, 2)
    for impl in ("reference", "chunked"):
        got = attn(q, k, v, position=jaxpos.ALiBi(num_heads=N), causal=True,
                               implementation=impl, block_q=4, block_k=4)
        np.testing.assert_allclose(np.asarray(got), want, **FWD_TOL)


# ----------------------------------------------------------------- the benchmark
def test_cpu_benchmark_tiny_mode_runs(tmp_path):
    """``benchmarks/attention_cpu.py --tiny`` runs end to end and writes its table."""
    from _scripts import load_script

    mod = load_script("benchmarks/attention_cpu.py", "attention_cpu")
    out = tmp_path / "table.md"
    rows = mod.main(["--tiny", "--no-torch", "--schemes", "alibi", "--output", str(out)])
    text = out.read_text()
    assert "| chunked |" in text and "| reference |" in text
    assert {r["implementation"] for r in rows} >= {"reference", "chunked", "jax_dpa"}
    assert all(r["time_ms"] > 0 for r in rows if r["time_ms"] is not None)
