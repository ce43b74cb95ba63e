"""The schemes that replace softmax attention's scores (PaTH, PaTH-FoX, CoPE) on the
conformance suite's call shapes (``CALL_SHAPES`` of ``_conformance_cases.py``: the same
positions, segments and dtypes), on every path that takes them: the ``"reference"`` and
``"chunked"`` implementations of :func:`jaxpos.path_attention` /
:func:`jaxpos.cope_attention`, forward against the float64 references of
``_replacing_reference.py`` and the chunked gradients against the reference path's (the
reference's gradients are checked against float64 finite differences in
``tests/attention``). PaTH's KV-cache decoding (the modules' path: steps of 3, 1 and 4
tokens over a dense cache, ``jaxpos.layers.cache.path``) takes the shapes a cache row holds
(one sequence, left padding), against the same float64 reference. Every engine of
:func:`jaxpos.attention` refuses them with a ``ValueError`` naming the function and
implementations that run them. A scheme or call shape joins by adding an entry to
``SHAPES`` (``DECODE_SHAPES`` for decoding).

PaTH is causal self-attention by definition (its transforms are the tokens between the
key and the query), so it takes the self-attention shapes; CoPE takes queries aligned to
the end of the keys too (prefill chunks, decoding)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _conformance_cases import CALL_SHAPES, tolerance
from _path_cache_steps import path_cache_steps
from _replacing_reference import np_cope, np_path

import jaxpos
from jaxpos.layers.cache import init_kv_cache

#: scheme -> call shapes it takes (the rest: a clear error, tested below).
SHAPES = {
    "path": ("training", "gqa", "packed", "left_padded", "bfloat16"),
    "path_fox": ("training", "gqa", "packed"),
    "cope": ("training", "gqa", "prefill_chunk", "decode", "offset_positions", "packed",
             "left_padded", "empty_rows_causal_segments", "bfloat16"),
}
#: scheme -> call shapes its KV-cache decoding takes (packed rows are no cache's rows).
DECODE_SHAPES = {"path": ("training", "gqa", "left_padded"),
                 "path_fox": ("training", "gqa", "left_padded")}
CASES = [pytest.param(s, c, i, id=f"{i}-{c}-{s}",
                      marks=() if c == "training" else pytest.mark.slow)
         for s, shapes in SHAPES.items() for c in shapes for i in ("reference", "chunked")]


def _extras(scheme, case):
    """The scheme's own inputs, float64 rounded through float32 (both sides hold them)."""
    r = np.random.default_rng(11)
    H = case.arrays()[0].shape[-1]
    rnd = lambda x: np.asarray(np.asarray(x, np.float32), np.float64)
    if scheme == "cope":
        return {"pos_emb": rnd(r.normal(size=(H, 6)))}
    w = r.normal(size=(case.B, case.Tk, case.Nk, H))
    w /= np.linalg.norm(w, axis=-1, keepdims=True)
    out = {"w": rnd(w), "beta": rnd(2 / (1 + np.exp(-r.normal(size=(case.B, case.Tk,
                                                                     case.Nk)))))}
    if scheme == "path_fox":
        out["log_forget"] = rnd(-0.3 * np.abs(r.normal(size=(case.B, case.Tq, case.N))))
    return out


def _run(scheme, case, impl, q, k, v, extras):
    dt = jnp.dtype(case.dtype)
    cast = lambda x: jnp.asarray(x, dt)
    if scheme == "cope":
        return jaxpos.cope_attention(
            cast(q), cast(k), cast(v), cast(extras["pos_emb"]),
            q_positions=case.np_("q_positions"), kv_positions=case.np_("kv_positions"),
            segment_ids=case.np_("segment_ids"), kv_segment_ids=case.np_("kv_segment_ids"),
            implementation=impl, block_size=4)
    lf = extras.get("log_forget")
    return jaxpos.path_attention(cast(q), cast(k), cast(v), cast(extras["w"]),
                                 cast(extras["beta"]),
                                 log_forget=None if lf is None else cast(lf),
                                 segment_ids=case.np_("segment_ids"), implementation=impl,
                                 block_size=4)


def _reference(scheme, case, q, k, v, extras):
    if scheme == "cope":
        return np_cope(q, k, v, extras["pos_emb"], q_positions=case.np_("q_positions"),
                       kv_positions=case.np_("kv_positions"),
                       segment_ids=case.np_("segment_ids"),
                       kv_segment_ids=case.np_("kv_segment_ids"))
    return np_path(q, k, v, extras["w"], extras["beta"], extras.get("log_forget"),
                   case.np_("segment_ids"))


@pytest.mark.parametrize(("scheme", "shape", "impl"), CASES)
def test_forward_matches_float64_and_chunked_gradients_match_reference(scheme, shape, impl):
    case = CALL_SHAPES[shape]("none")
    q, k, v, cot = case.arrays()
    extras = _extras(scheme, case)
    out = _run(scheme, case, impl, q, k, v, extras)
    ref = _reference(scheme, case, q, k, v, extras)
    tol = tolerance(case) * max(1.0, float(np.abs(ref).max()))
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), ref, rtol=0, atol=tol)
    if impl == "reference" or case.dtype != "float32":
        return

    def grads(impl):
        def f(q, k, v, extras):
            return jnp.sum(jnp.asarray(cot, jnp.float32) * _run(scheme, case, impl, q, k, v,
                                                                 extras))
        f32 = lambda x: jnp.asarray(x, jnp.float32)
        return jax.grad(f, argnums=(0, 1, 2, 3))(f32(q), f32(k), f32(v),
                                                  jax.tree.map(f32, extras))

    got, want = grads("chunked"), grads("reference")
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=0,
                                   atol=1e-5 * max(1.0, float(np.abs(r).max())))


@pytest.mark.parametrize("impl", jaxpos.ALL_IMPLEMENTATIONS)
def test_softmax_engines_refuse_them_naming_the_paths_that_take_them(impl):
    q = jnp.ones((1, 4, 2, 4))
    cope = jaxpos.CoPE(jnp.zeros((4, 5)))
    path = jaxpos.PaTH(jnp.zeros((1, 4, 8)), jnp.zeros((3, 8)), jnp.ones((1, 4, 2)),
                       num_kv_heads=2)
    for scheme, fn in ((cope, "cope_attention"), (path, "path_attention")):
        with pytest.raises(ValueError, match=rf"jaxpos\.{fn} \(implementation 'reference' or "
                                             rf"'chunked'"):
            jaxpos.attention(q, q, q, position=scheme, causal=True, implementation=impl)
    for fn in (jaxpos.path_attention, jaxpos.cope_attention):
        if impl in ("pallas", "xla"):
            extra = (q, jnp.ones((1, 4, 2))) if fn is jaxpos.path_attention else \
                (jnp.zeros((4, 5)),)
            with pytest.raises(ValueError, match="'reference' or 'chunked'"):
                fn(q, q, q, *extra, implementation=impl)


@pytest.mark.parametrize(("scheme", "shape"), [
    pytest.param(s, c, id=f"cache_decode-{c}-{s}",
                 marks=() if (s, c) == ("path_fox", "left_padded") else pytest.mark.slow)
    for s, shapes in DECODE_SHAPES.items() for c in shapes])
def test_cache_decoding_matches_float64(scheme, shape):
    case = CALL_SHAPES[shape]("none")
    q, k, v, _ = case.arrays()
    extras = _extras(scheme, case)
    seg = case.np_("segment_ids")
    mask = np.ones((case.B, case.Tq), bool) if seg is None else seg != 0
    cache = init_kv_cache(case.B, case.Tk, case.Nk, q.shape[-1], jnp.float32)
    lf = extras.get("log_forget")
    g_last, g_slots = jnp.zeros((case.B, case.N)), jnp.zeros((case.B, case.Tk, case.N))
    _, got = path_cache_steps(cache, ((0, 3), (3, 4), (4, case.Tq)), q, k, v, extras["w"],
                              extras["beta"], lf, mask, g_last, g_slots)
    ref = np_path(q, k, v, extras["w"], extras["beta"], lf, mask.astype(int))
    tol = tolerance(case) * max(1.0, float(np.abs(ref).max()))
    np.testing.assert_allclose(got[mask], ref[mask], rtol=0, atol=tol)
