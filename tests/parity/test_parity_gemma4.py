"""A tiny random Gemma 4 text model on jaxpos (``examples.models.gemma4``) reproduces Hugging
Face transformers' ``Gemma4ForCausalLM`` logits.

Four layers (sliding, full, sliding, full), hidden size 64, vocabulary 128: sliding heads
16 wide with default RoPE (base 1e4, window 3), full heads 32 wide (``global_head_dim``)
with proportional RoPE (a quarter of the frequencies, base 1e6), QK-norm and V-norm,
no softmax scale, ``layer_scalar``, final soft-capping 15; a second model has
``attention_k_eq_v`` (the full layers' values are their key projection, one key head).
Every weight and ``layer_scalar`` redrawn (HF's std-0.02 initialisation makes attention
nearly uniform); left-padded random ids; the bound is 1e-4 max abs logit difference
(float32) at the real tokens. Negative controls: the full layers' RoPE as jaxpos read it
before per-layer-type head widths (frequencies spaced for the sliding width), and a
window of 4, both miss by more than 1e-2.
"""

from __future__ import annotations

import os
import pathlib
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import jaxpos
from jaxpos.schemes.rope import scaling as S

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if getattr(transformers, "Gemma4ForCausalLM", None) is None:
    pytest.skip("this transformers has no Gemma 4", allow_module_level=True)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from _parity_common import NEEDS_PALLAS  # noqa: E402

from examples.models import gemma4  # noqa: E402

pytestmark = pytest.mark.parity

TOL, MISS = 1e-4, 1e-2
VOCAB, T = 128, 12
LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def _config(**kw):
    kw = {"hidden_size_per_layer_input": 0, **kw}
    return transformers.Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        layer_types=list(LAYERS), sliding_window=3, final_logit_softcapping=15.0,
        attn_implementation="eager", **kw)


def _randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else
                    (0.5 if "embed" in name else 0.3) * noise)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
    return model


def _batch(seed):
    rs = np.random.RandomState(seed)
    ids = rs.randint(0, VOCAB, (3, T))
    mask = np.ones((3, T), np.int64)
    mask[0, :4] = 0
    mask[1, :9] = 0
    pos = np.where(mask == 1, np.cumsum(mask, -1) - 1, 1)
    return ids, mask, pos


@pytest.fixture(scope="module", params=[False, True], ids=["k-ne-v", "k-eq-v"])
def family(request):
    kw = {"attention_k_eq_v": True, "num_global_key_value_heads": 1} if request.param else {}
    cfg = _config(**kw)
    torch.manual_seed(0)
    hf = _randomize(transformers.Gemma4ForCausalLM(cfg).eval(), seed=40)
    ids, mask, pos = _batch(41)
    with torch.no_grad():
        ref = hf(torch.tensor(ids), attention_mask=torch.tensor(mask),
                 position_ids=torch.tensor(pos)).logits.numpy()
    model = gemma4.from_hf(hf.state_dict(), cfg)
    return cfg, model, (ids, mask, ref)


def _diff(model, batch, **kw):
    ids, mask, ref = batch
    logits = model(jnp.asarray(ids), attention_mask=jnp.asarray(mask), **kw)
    d = np.abs(np.asarray(logits, np.float64) - ref)
    return float(d[mask == 1].max())


@pytest.mark.parametrize("implementation", [
    "reference", pytest.param("chunked", marks=pytest.mark.slow),
    pytest.param("pallas", marks=[NEEDS_PALLAS, pytest.mark.slow])])
def test_gemma4_logits_match_hf(family, implementation):
    cfg, model, batch = family
    assert model.config.head_dims == (16, 32, 16, 32)
    if cfg.attention_k_eq_v:
        assert model.config.kv_heads == (2, 1, 2, 1)
        assert model.layers[1].self_attn.v_proj is None
    d = _diff(model, batch, implementation=implementation, block_q=4, block_k=4)
    print(f"\ngemma4 {implementation}: max abs logit difference {d:.2e}")
    assert d <= TOL


def test_gemma4_needs_the_full_layers_own_rope_width(family, monkeypatch):
    """Negative control: the full layers' p-RoPE spaced for the sliding width (16), what
    rope_from_hf_config gave before it read per-layer-type head widths."""
    _, model, batch = family
    ropes = gemma4.position_schemes(model.config)
    assert [r.rotary_dim for r in ropes] == [16, 32, 16, 32]
    narrow = jaxpos.RoPE(rotary_dim=16, base=1e6, scaling=S.ProportionalScaling(0.25),
                         angle_precision="float32")
    wrong = [narrow if t == "full_attention" else r for r, t in zip(ropes, LAYERS)]
    monkeypatch.setattr(gemma4, "position_schemes", lambda config, **kw: wrong)
    assert _diff(model, batch, implementation="reference") > MISS


def test_gemma4_window_off_by_one(family):
    _, model, batch = family
    assert _diff(model, batch, implementation="reference", sliding_window=4) > MISS


def test_gemma4_port_refuses_what_it_does_not_run():
    for kw in ({"hidden_size_per_layer_input": 8}, {"num_kv_shared_layers": 2}):
        cfg = _config(**kw)
        with pytest.raises(ValueError, match=next(iter(kw))):
            gemma4.Gemma4Config.from_hf(cfg)
