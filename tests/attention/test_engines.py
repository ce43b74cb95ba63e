"""The engine registry (``jaxpos.register_engine``, ``jaxpos.core.engines``): selection by
name and by the per-backend preference, refusals, and ``run_with_lse`` (the log-sum-exp
every lse-returning engine gives, and its gradient) against a float64 computation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpos
from jaxpos.core import engines
from jaxpos.core.call import transform_call, validate_call


def _qkv(B=1, T=6, N=2, H=4, seed=0):
    r = np.random.default_rng(seed)
    return tuple(jnp.asarray(r.normal(size=(B, T, N, H)), jnp.float32) for _ in range(3))


class _Echo:
    """An engine returning v (a marker that it ran), refusing calls with sinks."""

    name = "echo_v"

    def refuses(self, call):
        return None if call.sinks is None else "implementation='echo_v' takes no sinks."

    def run(self, call):
        return call.v


@pytest.fixture
def echo():
    saved = {k: list(v) for k, v in engines.PREFERENCE.items()}
    engine = jaxpos.register_engine(_Echo(), backends=("cpu",), replace=True)
    yield engine
    engines.PREFERENCE.update(saved)
    engines._ENGINES.pop("echo_v", None)


def test_a_registered_engine_runs_by_name_and_leads_its_backend_list(echo):
    q, k, v = _qkv()
    np.testing.assert_array_equal(jaxpos.attention(q, k, v, implementation="echo_v"), v)
    assert engines.preference("cpu") == ("echo_v", "chunked")
    np.testing.assert_array_equal(jaxpos.attention(q, k, v), v)  # the default on CPU now
    # a call it refuses goes to the next engine of the list (chunked): not v
    sinks = jnp.zeros((2,))
    out = jaxpos.attention(q, k, v, sinks=sinks)
    ref = jaxpos.attention(q, k, v, sinks=sinks, implementation="reference")
    np.testing.assert_allclose(out, ref, atol=2e-6)
    with pytest.raises(ValueError, match="takes no sinks"):
        jaxpos.attention(q, k, v, sinks=sinks, implementation="echo_v")
    assert "echo_v" in engines.engine_names()


def test_register_engine_before_places_it_on_the_list(echo):
    jaxpos.register_engine(echo, backends=("gpu",), before="pallas", replace=True)
    assert engines.preference("gpu") == ("xla", "echo_v", "pallas", "chunked")
    assert engines.preference("cuda") == engines.preference("gpu")


def test_register_engine_bad_input(echo):
    with pytest.raises(ValueError, match="registered already"):
        jaxpos.register_engine(_Echo())
    with pytest.raises(TypeError, match="string name"):
        jaxpos.register_engine(object())
    with pytest.raises(ValueError, match="unknown backend 'metal'"):
        jaxpos.register_engine(echo, backends=("metal",), replace=True)
    with pytest.raises(ValueError, match="before='ring'"):
        jaxpos.register_engine(echo, backends=("cpu",), before="ring", replace=True)
    with pytest.raises(ValueError, match="implementation must be one of"):
        jaxpos.attention(*_qkv(), implementation="nonexistent")


def test_xla_takes_no_kv_lengths_and_the_others_do():
    assert not engines.takes_kv_lengths("xla")
    assert all(engines.takes_kv_lengths(n) for n in (None, "reference", "chunked", "pallas"))


def _lse64(q, k, v, sinks, causal):
    """float64 log-sum-exp of each row's scaled scores (and its sink): [B, N, Tq]."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    s = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(q.shape[-1])
    if causal:
        T = q.shape[1]
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    if sinks is not None:
        col = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None],
                              s.shape[:3] + (1,))
        s = np.concatenate([s, col], -1)
    mx = s.max(-1, keepdims=True)
    return (mx + np.log(np.exp(s - mx).sum(-1, keepdims=True)))[..., 0]


@pytest.mark.parametrize("name", ["reference", "chunked",
                                  pytest.param("pallas", marks=pytest.mark.slow)])
def test_run_with_lse_gives_the_log_sum_exp_and_its_gradient(name):
    q, k, v = _qkv(B=2, T=8, seed=3)
    sinks = jnp.asarray([0.3, -1.0])
    kw = dict(block_q=4, block_k=4) if name != "reference" else {}

    def lse_of(q, k, sinks, impl):
        call = transform_call(validate_call(q, k, v, sinks=sinks, causal=True, **kw))
        out, lse = engines.run_with_lse(call, impl)
        return out, lse

    out, lse = lse_of(q, k, sinks, name)
    np.testing.assert_allclose(lse, _lse64(q, k, v, sinks, True), atol=2e-5)
    np.testing.assert_allclose(out, jaxpos.attention(q, k, v, sinks=sinks, causal=True,
                                                     implementation="reference"), atol=2e-5)
    # gradients of a loss that reads both outputs, against the reference's autodiff
    w = jnp.cos(jnp.arange(lse.size, dtype=jnp.float32)).reshape(lse.shape)

    def loss(q, k, sinks, impl):
        o, l = lse_of(q, k, sinks, impl)
        return jnp.sum(l * w) + jnp.sum(o * o)

    got = jax.grad(loss, argnums=(0, 1, 2))(q, k, sinks, name)
    want = jax.grad(loss, argnums=(0, 1, 2))(q, k, sinks, "reference")
    for g, r, what in zip(got, want, ("dq", "dk", "dsinks")):
        np.testing.assert_allclose(g, r, atol=5e-5, err_msg=what)


def test_run_with_lse_of_an_engine_without_it_says_which_have_it():
    call = transform_call(validate_call(*_qkv()))
    with pytest.raises(ValueError, match="does not return the log-sum-exp"):
        engines.run_with_lse(call, "xla")


def test_concrete_kv_lengths_outside_the_keys_raise_naming_them():
    q, k, v = _qkv(B=2, T=8)
    for bad in ([200, 3], [-1, 3]):
        with pytest.raises(ValueError, match=r"kv_lengths must lie in \[0, Tk\] = \[0, 8\]"):
            jaxpos.attention(q, k, v, kv_lengths=jnp.asarray(bad))


@pytest.mark.parametrize("name", ["reference", "chunked",
                                  pytest.param("pallas", marks=pytest.mark.slow)])
def test_traced_kv_lengths_outside_the_keys_give_nan_rows(name):
    """Under jit the lengths cannot raise: a row with a length outside [0, Tk] is NaN
    (the cache-overflow rule), never the clipped length's answer; other rows are exact."""
    q, k, v = _qkv(B=3, T=8, seed=5)
    run = jax.jit(lambda n: jaxpos.attention(q[:, :1], k, v, kv_lengths=n,
                                             q_positions=jnp.asarray([7]),
                                             implementation=name))
    out = np.asarray(run(jnp.asarray([200, 5, -1], jnp.int32)))
    assert np.isnan(out[0]).all() and np.isnan(out[2]).all()
    want = jaxpos.attention(q[1:2, :1], k[1:2, :5], v[1:2, :5], q_positions=jnp.asarray([7]),
                            kv_positions=jnp.arange(5), implementation="reference")
    np.testing.assert_allclose(out[1:2], want, atol=2e-6)
