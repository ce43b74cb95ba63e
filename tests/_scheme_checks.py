"""Shared checks for the score_mod / transform_qk schemes (KERPLE, FIRE, Sandwich, xPos,
FoX): the float64 dense reference (``tests/_contract_reference.py``) with an additive
bias, a tile application of a scheme's score_mod,
and the agreement of the three implementations on forward values and gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from _contract_reference import contract_attention

import jaxpos
from jaxpos.mods import apply_mod, convert_mod

IMPLS = ["reference", "chunked", "pallas"]


def qkv(seed=0, B=2, T=12, N=4, H=8, Nk=None, Tk=None):
    """Random float32 q ``[B, T, N, H]``, k and v ``[B, Tk, Nk, H]``."""
    Nk = N if Nk is None else Nk
    Tk = T if Tk is None else Tk
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(ks[0], (B, T, N, H), jnp.float32),
            jax.random.normal(ks[1], (B, Tk, Nk, H), jnp.float32),
            jax.random.normal(ks[2], (B, Tk, Nk, H), jnp.float32))


def dense64(q, k, v, bias=None, *, q_pos=None, kv_pos=None, causal=False, scale=None,
            scores=None):
    """float64 ``softmax(scale q.k + bias) v`` per head: the tests' one dense reference
    (:func:`_contract_reference.contract_attention`). ``bias`` broadcastable to
    ``[B, N, Tq, Tk]``; causal by positions (a query at p sees keys at <= p; both
    default to ``arange``). ``scores`` (``[B, N, Tq, Tk]``) replaces ``q.k`` when given
    (a transform of q and k computed by the caller)."""
    Tq, Tk = np.shape(q)[1], np.shape(k)[1]
    return contract_attention(q, k, v, bias=bias, scores=scores, causal=causal, scale=scale,
                              q_positions=np.arange(Tq) if q_pos is None else q_pos,
                              kv_positions=np.arange(Tk) if kv_pos is None else kv_pos)


def attn(impl, q, k, v, **kw):
    """:func:`jaxpos.attention` with small tiles (several per axis) for chunked/pallas."""
    if impl != "reference":
        kw.setdefault("block_q", 8)
        kw.setdefault("block_k", 8)
    return jaxpos.attention(q, k, v, implementation=impl, **kw)


def tile_bias(scheme, q_pos, kv_pos, B, N):
    """The scheme's score_mod applied to a zero score block: float32 ``[B, N, Tq, Tk]``
    (:func:`jaxpos.mods.convert_mod` at the block's shape, then :func:`apply_mod`)."""
    q_pos = jnp.asarray(q_pos, jnp.int32).reshape(-1, np.shape(q_pos)[-1])
    kv_pos = jnp.asarray(kv_pos, jnp.int32).reshape(-1, np.shape(kv_pos)[-1])
    Tq, Tk = q_pos.shape[-1], kv_pos.shape[-1]
    mod = convert_mod(scheme.score_mod(), "score", Tq, Tk)
    return apply_mod(mod, q_pos, kv_pos, jnp.zeros((B, N, Tq, Tk), jnp.float32))


def assert_impl_agrees(impl, make_scheme, params, q, k, v, *, atol=3e-5, rtol=1e-4, **kw):
    """Forward values and gradients (with respect to ``params``, a pytree of the
    scheme's arrays, and q, k, v) of ``impl`` equal the reference path's. Also asserts
    the parameters really receive a gradient."""
    def loss(impl):
        def f(p, q, k, v):
            out = attn(impl, q, k, v, position=make_scheme(p), **kw)
            return jnp.sum(jnp.sin(out) * jnp.cos(0.3 * out)), out
        return f

    (_, ref_out), ref_g = jax.value_and_grad(loss("reference"), argnums=(0, 1, 2, 3),
                                             has_aux=True)(params, q, k, v)
    p_norm = sum(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(ref_g[0]))
    assert p_norm > 1e-4, "the scheme's parameters receive no gradient"
    (_, out), g = jax.value_and_grad(loss(impl), argnums=(0, 1, 2, 3), has_aux=True)(
        params, q, k, v)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=atol, rtol=rtol,
                               err_msg=f"{impl} forward")
    for name, a, b in zip(("params", "q", "k", "v"), g, ref_g):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=rtol,
                                       err_msg=f"{impl} gradient with respect to {name}")


def shifted_outputs(scheme, q, k, v, shift, impl="reference", **kw):
    """Attention outputs at positions ``arange`` and ``arange + shift`` (causal)."""
    T, Tk = q.shape[1], k.shape[1]
    out = []
    for s in (0, shift):
        qp = jnp.arange(Tk - T, Tk, dtype=jnp.int32) + s
        kp = jnp.arange(Tk, dtype=jnp.int32) + s
        out.append(attn(impl, q, k, v, position=scheme, q_positions=qp, kv_positions=kp,
                        causal=True, **kw))
    return out
