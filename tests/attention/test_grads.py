"""Gradients of every learnable position parameter through every implementation,
with ``jax.test_util.check_grads`` (reverse mode, first order): the VJP the code
computes against central finite differences of the forward pass.

Parameters: the learned absolute table (Gehring et al. 2017), the T5 bias table (Raffel
et al. 2020, §2.1), Shaw's relative key and value tables (Shaw et al. 2018, §3), and ALiBi
slopes used as a learnable parameter (Press et al. 2022 fix them; jaxpos lets them train).
Everything is float32; finite differences use ``eps=1e-2`` on inputs of order one, and
tolerances of 2e-2 cover their truncation error.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxpos
from jaxpos import ALiBi, NoPE, Shaw, T5Bias, attention, learned_positions

IMPLS = list(jaxpos.IMPLEMENTATIONS)  # reference, chunked, pallas (interpret mode on CPU)
B, T, N, H = 2, 6, 2, 4
TOL = {"atol": 2e-2, "rtol": 2e-2, "eps": 1e-2}
# The default run checks each parameter once through a blocked implementation; every
# other (parameter, implementation) pair runs with -m slow.
DEFAULT = {("t5", "pallas"), ("shaw", "chunked"), ("alibi", "chunked"), ("learned", "reference")}


def _rng(seed):
    return np.random.default_rng(seed)


def _qkv(seed=0, dtype=jnp.float32):
    r = _rng(seed)
    return tuple(jnp.asarray(r.normal(size=(B, T, N, H)), dtype) for _ in range(3))


def _causal_attention(impl, **kw):
    def f(q, k, v, scheme):
        return attention(q, k, v, position=scheme, causal=True, implementation=impl,
                         block_q=4, block_k=4, **kw)
    return f


def case_t5(impl):
    q, k, v = _qkv(1)
    table = jnp.asarray(_rng(2).normal(size=(32, N)), jnp.float32)
    # kv positions spread so that many buckets (exact and logarithmic) are hit.
    kvpos = np.array([0, 3, 9, 20, 50, 140])
    qpos = kvpos + np.array([0, 1, 2, 5, 12, 40])
    f = _causal_attention(impl, q_positions=qpos, kv_positions=kvpos, scale=1.0)
    return ((lambda table: f(q, k, v, T5Bias(table, bidirectional=False, max_distance=128))),
            (table,))


def case_alibi(impl):
    q, k, v = _qkv(3)
    slopes = jnp.asarray([0.5, 0.125], jnp.float32)
    f = _causal_attention(impl)
    return (lambda slopes: f(q, k, v, ALiBi(slopes=slopes))), (slopes,)


def case_shaw(impl):
    q, k, v = _qkv(4)
    r = _rng(5)
    rel_k = jnp.asarray(r.normal(size=(5, H)), jnp.float32)  # K = 2
    rel_v = jnp.asarray(r.normal(size=(5, H)), jnp.float32)
    f = _causal_attention(impl)
    return (lambda rel_k, rel_v: f(q, k, v, Shaw(rel_k, rel_v))), (rel_k, rel_v)


def case_learned(impl):
    """A learned absolute table feeding q, k, v through fixed projections (GPT-2 style)."""
    r = _rng(6)
    d = N * H
    x = jnp.asarray(r.normal(size=(B, T, d)), jnp.float32)
    wq, wk, wv = (jnp.asarray(r.normal(size=(d, d)) / np.sqrt(d), jnp.float32) for _ in range(3))
    table = jnp.asarray(r.normal(size=(8, d)), jnp.float32)  # max_len 8 > T
    pos = np.tile(np.arange(T), (B, 1))
    pos[1] = np.arange(2, T + 2)  # an offset row

    def f(table):
        h = x + learned_positions(table, pos)
        q, k, v = ((h @ w).reshape(B, T, N, H) for w in (wq, wk, wv))
        return _causal_attention(impl)(q, k, v, NoPE())

    return f, (table,)


CASES = {"t5": case_t5, "alibi": case_alibi, "shaw": case_shaw, "learned": case_learned}
PARAMS = [
    pytest.param(p, i, id=f"{p}-{i}", marks=[] if (p, i) in DEFAULT else [pytest.mark.slow])
    for p, i in itertools.product(CASES, IMPLS)
    # the kernel rejects Shaw (tests/attention/test_bad_input.py)
    if not (i == "pallas" and p == "shaw")
]


@pytest.mark.parametrize("param,impl", PARAMS)
def test_check_grads_reverse_first_order(param, impl):
    f, args = CASES[param](impl)
    check_grads(jax.jit(f), args, order=1, modes=["rev"], **TOL)


@pytest.mark.slow
@pytest.mark.parametrize("param", list(CASES))
def test_parameter_gradients_agree_across_implementations(param):
    """The same parameter gradient from every implementation (tighter than finite
    differences: only float32 summation order differs)."""
    impls = [i for i in IMPLS if not (i == "pallas" and param == "shaw")]
    grads = {}
    for impl in impls:
        f, args = CASES[param](impl)
        w = jnp.asarray(_rng(9).normal(size=(B, T, N, H)), jnp.float32)
        grads[impl] = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * w),
                                       argnums=tuple(range(len(args)))))(*args)
    for impl in impls[1:]:
        for g, g_ref in zip(grads[impl], grads["reference"]):
            np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), atol=2e-5, rtol=2e-4,
                                       err_msg=f"{param}: {impl} vs reference")
            assert np.abs(np.asarray(g_ref)).max() > 1e-3  # a real gradient, not all zeros
