"""What ``implementation="xla"`` hands to ``jax.nn.dot_product_attention``, checked on CPU
with the backend faked as an NVIDIA GPU: cuDNN never receives a materialised bias (it
would round a float32 score term to bfloat16, and its bias gradient is wrong for
batch > 1: https://github.com/jax-ml/jax/issues/30593), nor a sliding window
(``local_window_size``; cuDNN's non-causal window attends to the future:
https://github.com/jax-ml/jax/pull/39576); a score_mod whose value is not ``score +
term`` is never materialised as a bias."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpos
import jaxpos.core.xla as xla_engine
from jaxpos.mods import convert_mod


@pytest.mark.parametrize("backend,dtype,has_bias,allowed", [
    ("gpu", jnp.bfloat16, False, True),
    ("cuda", jnp.float16, False, True),
    ("gpu", jnp.bfloat16, True, False),   # bias: XLA's attention with a float32 bias
    ("gpu", jnp.float32, False, False),   # float32: XLA (cuDNN's float32 is not faster)
    ("cpu", jnp.bfloat16, False, False),
    ("rocm", jnp.bfloat16, False, False),
])
def test_cudnn_rule(backend, dtype, has_bias, allowed):
    assert xla_engine.cudnn_allowed(backend=backend, dtype=dtype, has_bias=has_bias) is allowed


def _requests(monkeypatch, **kw):
    """The ``implementation=`` and arguments attention(implementation="xla") passes to
    jax.nn.dot_product_attention on a (faked) GPU, for a bfloat16 batch-2 call."""
    calls = []
    real = jax.nn.dot_product_attention

    def spy(*a, implementation=None, **k):
        calls.append({"implementation": implementation, **k})
        return real(*a, implementation="xla", **k)

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 4, 8)), jnp.bfloat16)
    loss = lambda q: jnp.sum(jaxpos.attention(q, x, x, implementation="xla", **kw)
                             .astype(jnp.float32))
    jax.grad(loss)(x)
    return calls


def test_bias_with_gradient_at_batch_2_never_goes_to_cudnn(monkeypatch):
    calls = _requests(monkeypatch, position=jaxpos.ALiBi(4), causal=True)
    assert calls and all(c["implementation"] == "xla" for c in calls)
    assert all(c["bias"].dtype == jnp.float32 for c in calls)
    assert all(c.get("local_window_size") is None for c in calls)


def test_sliding_window_is_a_mask_never_cudnns_window(monkeypatch):
    calls = _requests(monkeypatch, mask_mod=jaxpos.SlidingWindowMask(3), causal=False)
    assert calls and all(c.get("local_window_size") is None for c in calls)
    assert all(c["mask"] is not None for c in calls)


def test_no_score_term_still_uses_cudnn_in_bfloat16(monkeypatch):
    calls = _requests(monkeypatch, causal=True)
    assert calls[0]["implementation"] == "cudnn"


@pytest.mark.parametrize("mod,is_term", [
    (lambda s, b, h, q, k: s + (k - q).astype(jnp.float32), True),
    (lambda s, b, h, q, k: (s - 0.5 * h) + jnp.where(k > q, -jnp.inf, 0.0), True),
    (lambda s, b, h, q, k: s + jax.lax.stop_gradient(jnp.clip(s, -1, 1) - s), False),
    (lambda s, b, h, q, k: 2.0 * jnp.tanh(s / 2.0), False),
    (lambda s, b, h, q, k: s * 1.0 + 0.0 * s, False),  # tangent 1, not a plain term
])
def test_adds_a_term_checks_the_value_not_only_the_derivative(mod, is_term):
    """A straight-through mod ``s + stop_gradient(f(s) - s)`` has derivative 1 but the
    value f(s): it must not be materialised as its value at score 0."""
    assert xla_engine.adds_a_term(convert_mod(mod, "score", 2, 3)) is is_term
