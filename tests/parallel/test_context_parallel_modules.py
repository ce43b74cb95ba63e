"""The modules' context-parallel switch (``context_parallel="ring" | "ulysses"``,
``context_axis``, ``context_zigzag``; :mod:`jaxpos.parallel.context`).

On 8 CPU devices (the default run's one subprocess, ``_ring_worker.py --quick``, runs the
quick cases of ``tests/parallel/_modules_worker.py``; ``-m slow`` its full list): a
jitted training step of ``DecoderLM`` built with ``context_parallel`` under
``jax.set_mesh(mesh)`` equals the same model's single-device step, loss and every
parameter's gradient, NNX and Linen; the compiled step holds the method's collectives
(so it did run sequence-parallel); and ``decode_step`` of a context-parallel model
equals the plain model's. The default run covers RoPE with the zigzag ring (NNX) and T5
with Ulysses (Linen); ``-m slow`` every scheme the modules build once, the ring and
Ulysses taking turns, and a 2 x 4 (data x seq) mesh. Option errors are checked here, in
this process.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_ring import _run_worker

from jaxpos.nnx import DecoderLM, MultiHeadAttention

WORKER_TOL = 1e-5


def _check(res):
    bad = {k: v for k, v in res.items() if k.startswith("refused/") or (
        k.startswith(("loss/", "grads/", "decode/")) and not v <= WORKER_TOL)}
    assert not bad, bad
    for k, v in res.items():
        if k.startswith("collectives/"):
            assert v >= 1, k  # the step compiled with the method's collectives
        if k.startswith("grad_norm/"):
            assert v > 1.0, k


def test_context_parallel_training_step_equals_single_device(cp_quick):
    res = {k.split("/", 1)[1]: v for k, v in cp_quick.items() if k.startswith("modules/")}
    _check(res)
    names = {k.split("/", 1)[1] for k in res if k.startswith("loss/")}
    assert {"nnx/rope/ring/zigzag", "linen/t5/ulysses"} <= names, names
    assert res["decode/nnx/rope/ring"] <= WORKER_TOL


@pytest.mark.slow
def test_context_parallel_every_scheme_the_modules_build(tmp_path_factory):
    res = _run_worker(tmp_path_factory, "--modules", "--full")
    _check(res)
    assert any("mesh2x4" in k for k in res)
    methods = [k.split("/")[3] for k in res if k.startswith("loss/nnx/")]
    assert methods.count("ring") >= 5 and methods.count("ulysses") >= 5, methods
    # the schemes replacing softmax attention are refused, by name
    assert {"refusal/nnx/stick_breaking", "refusal/nnx/cope", "refusal/nnx/path"} <= set(res)


def test_context_parallel_option_errors():
    with pytest.raises(ValueError, match="context_parallel"):
        MultiHeadAttention(16, 2, context_parallel="ringg", rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="context_axis must be the name"):
        MultiHeadAttention(16, 2, context_parallel="ring", context_axis=0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="context_zigzag=True.*context_parallel"):
        DecoderLM(32, d_model=16, num_layers=1, num_heads=2, context_zigzag=True,
                  rngs=nnx.Rngs(0))


@pytest.mark.parametrize("position", ["fox", "path"])
def test_zigzag_refuses_a_scheme_computed_in_token_order(position):
    model = DecoderLM(32, d_model=16, num_layers=1, num_heads=2, position=position,
                      context_parallel="ring", context_zigzag=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="context_zigzag=True reorders the tokens"):
        model(jnp.zeros((1, 8), jnp.int32))


def test_context_parallel_without_a_mesh_says_what_to_do():
    layer = MultiHeadAttention(16, 2, causal=True, context_parallel="ring", rngs=nnx.Rngs(0))
    x = jnp.zeros((1, 8, 16))
    with pytest.raises(ValueError, match=r"needs a device mesh.*jax.set_mesh"):
        layer(x)


def test_context_parallel_refuses_a_dense_mask():
    layer = MultiHeadAttention(16, 2, context_parallel="ring", rngs=nnx.Rngs(0))
    x = jnp.zeros((1, 8, 16))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("seq",))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="dense boolean mask"):
        layer(x, mask=jnp.ones((1, 1, 8, 8), bool))


def test_context_parallel_one_device_mesh_equals_plain_layer():
    """A one-device ``seq`` mesh: the ring layer equals the plain layer (same parameters)."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 16)), jnp.float32)
    plain = MultiHeadAttention(16, 2, causal=True, position="alibi", rngs=nnx.Rngs(0))
    cp = MultiHeadAttention(16, 2, causal=True, position="alibi", context_parallel="ulysses",
                            rngs=nnx.Rngs(0))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("seq",))
    with jax.set_mesh(mesh):
        got = cp(x)
    np.testing.assert_allclose(got, plain(x), atol=1e-5)
