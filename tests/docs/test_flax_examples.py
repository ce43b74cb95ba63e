"""The two worked examples of jaxpos in an existing Flax model (examples/flax_nnx_drop_in.py,
examples/flax_linen_drop_in.py): each jaxpos variant trains with attention dropout (the loss
falls), and with no scheme and the model's learned positions kept, jaxpos's attention_fn
leaves the model's output unchanged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _scripts import load_script

pytest.importorskip("optax")


def _load(name: str):
    return load_script(f"examples/{name}.py", f"_example_{name}")


@pytest.fixture(scope="module")
def nnx_example():
    return _load("flax_nnx_drop_in")


@pytest.fixture(scope="module")
def linen_example():
    return _load("flax_linen_drop_in")


def _assert_trained(losses, names):
    assert list(losses) == names
    for name, curve in losses.items():
        assert len(curve) == 8 and all(np.isfinite(curve)), name
        # 8 AdamW steps on the copying task: from ~log(16) = 2.77 (plus the initial
        # logits' spread) clearly down.
        assert curve[-1] < curve[0] - 0.2, (name, curve)


def test_nnx_example_trains_rope_t5_and_score_mod(nnx_example, capsys):
    losses = nnx_example.main(["--variants", "rope,t5,score_mod", "--steps", "8",
                               "--dropout", "0.1"])
    _assert_trained(losses, ["rope", "t5", "score_mod"])
    assert "score_mod" in capsys.readouterr().out


def test_linen_example_trains_alibi_and_rope(linen_example):
    losses = linen_example.main(["--variants", "alibi,rope", "--steps", "8", "--dropout", "0.1"])
    _assert_trained(losses, ["alibi", "rope"])


def test_no_scheme_attention_fn_leaves_the_nnx_model_unchanged(nnx_example):
    from flax import nnx

    import jaxpos

    tokens = jnp.asarray(np.arange(12).reshape(2, 6) % 16)
    as_written = nnx_example.MiniGPT(16, 6, rngs=nnx.Rngs(0))
    with_jaxpos = nnx_example.MiniGPT(16, 6, attention_fn=jaxpos.flax_attention_fn(),
                                      rngs=nnx.Rngs(0))
    np.testing.assert_allclose(with_jaxpos(tokens), as_written(tokens), atol=1e-5)


def test_no_scheme_attention_fn_leaves_the_linen_model_unchanged(linen_example):
    import jaxpos

    tokens = jnp.asarray(np.arange(12).reshape(2, 6) % 16)
    as_written = linen_example.MiniGPT(16, 6)
    with_jaxpos = linen_example.MiniGPT(16, 6, attention_fn=jaxpos.flax_attention_fn())
    params = as_written.init(jax.random.key(0), tokens)
    np.testing.assert_allclose(with_jaxpos.apply(params, tokens),
                               as_written.apply(params, tokens), atol=1e-5)
