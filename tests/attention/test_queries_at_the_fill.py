"""Where the queries of a call on a cache sit: with ``kv_lengths`` and no ``q_positions``,
a row's ``Tq`` new queries are the last tokens of its fill, query ``i`` at
``kv_lengths[b] - Tq + i`` (``flash_attn_with_kvcache``'s convention), in the paged call
and in the dense call on the gathered keys alike (``Tq < Tk``); a right-padded training
call (``Tq == Tk``, ``kv_lengths`` as key padding) keeps ``arange``.

Checked with position-dependent schemes (T5's bucketed bias, RoPE) against the float64
contract (``_contract_reference``) on each row's filled keys alone.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from _contract_reference import contract_attention

import jaxpos
from jaxpos.core.paged import gather_pages

N, NK, H, PAGE = 4, 2, 8, 4
_R = np.random.default_rng(5)
_T5 = np.asarray(_R.normal(size=(32, N)).astype(np.float32), np.float64)
_INV = np.asarray((10000.0 ** (-np.arange(0, H, 2) / H)).astype(np.float32), np.float64)
SCHEMES = {  # name -> (jaxpos scheme, contract params, scale)
    "t5": (jaxpos.T5Bias(jnp.asarray(_T5, jnp.float32), bidirectional=False),
           {"table": _T5, "bidirectional": False}, 1.0),
    "rope": (jaxpos.RoPE(jnp.asarray(_INV, jnp.float32)), {"inv_freq": _INV}, None),
}


def _pool(seed=0):
    rng = np.random.default_rng(seed)
    kp, vp = (jnp.asarray(rng.standard_normal((10, PAGE, NK, H)), jnp.float32)
              for _ in range(2))
    table = jnp.array([[3, 1, 5, 7], [0, 2, 4, -1]], jnp.int32)  # 16 slots per row
    return kp, vp, table


def _contract_rows(q, k, v, lens, name, causal):
    """float64 ``[B, Tq, N, H]``: each row on its own filled keys, queries at the end."""
    _, params, scale = SCHEMES[name]
    Tq = q.shape[1]
    out = []
    for b, L in enumerate(lens):
        out.append(contract_attention(
            np.asarray(q[b:b + 1]), np.asarray(k[b:b + 1, :L]), np.asarray(v[b:b + 1, :L]),
            scheme=name, params=params, causal=causal, scale=scale,
            q_positions=(L - Tq + np.arange(Tq))[None], kv_positions=np.arange(L)[None]))
    return np.concatenate(out)


@pytest.mark.parametrize("impl", ["reference", "chunked",
                                  pytest.param("pallas", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("Tq", [1, 3])
def test_paged_and_dense_calls_put_the_queries_at_the_end_of_each_fill(impl, name, Tq):
    kp, vp, table = _pool()
    lens = jnp.array([13, 9], jnp.int32)  # 16-slot rows filled to different lengths
    q = jnp.asarray(np.random.default_rng(1).standard_normal((2, Tq, N, H)), jnp.float32)
    scheme, _, scale = SCHEMES[name]
    kw = dict(kv_lengths=lens, causal=True, position=scheme, scale=scale,
              implementation=impl)
    k, v = gather_pages(kp, table), gather_pages(vp, table)
    paged = jaxpos.attention(q, kp, vp, page_table=table, **kw)
    dense = jaxpos.attention(q, k, v, **kw)
    ref = _contract_rows(q, k, v, [13, 9], name, causal=True)
    np.testing.assert_allclose(paged, ref, rtol=0, atol=2e-5 * max(1, np.abs(ref).max()))
    np.testing.assert_allclose(dense, ref, rtol=0, atol=2e-5 * max(1, np.abs(ref).max()))


@pytest.mark.parametrize("name", list(SCHEMES))
def test_right_padded_training_call_keeps_arange_query_positions(name):
    """``Tq == Tk``: ``kv_lengths`` hides the padding keys, the queries stay at
    ``arange(T)`` (row 0's last queries are padding, past its fill)."""
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 8, n, H)), jnp.float32)
               for n in (N, NK, NK))
    scheme, params, scale = SCHEMES[name]
    lens = jnp.array([5, 8], jnp.int32)
    out = jaxpos.attention(q, k, v, kv_lengths=lens, causal=True, position=scheme,
                           scale=scale, implementation="chunked")
    valid = np.arange(8)[None, None, None, :] < np.asarray(lens)[:, None, None, None]
    ref = contract_attention(np.asarray(q), np.asarray(k), np.asarray(v), scheme=name,
                             params=params, causal=True, scale=scale, mask=valid,
                             q_positions=np.arange(8)[None], kv_positions=np.arange(8)[None])
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-5 * max(1, np.abs(ref).max()))
