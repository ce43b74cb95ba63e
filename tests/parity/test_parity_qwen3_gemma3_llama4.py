"""Qwen3, Gemma 3 (text) and Llama 4 (text) on jaxpos reproduce Hugging Face transformers.

Tiny HF PyTorch models (2 layers, hidden size 64, vocabulary 128) are built from configs
on the CPU, every weight redrawn (``_randomize``: HF's std-0.02 initialisation makes
attention nearly uniform and would hide position errors), converted with
``examples.models.<family>.from_hf`` and run on left-padded random token ids. The
reference is HF's own float32 logits; the bound is a max abs logit difference of 1e-4 for
every implementation of :func:`jaxpos.attention`, over a full pass and over KV-cache
decoding (prefill, then one token at a time). Negative controls show that each family's
position/attention feature decides the logits: dropping it misses by more than 1e-2.

Windows are small (sliding window 3, chunks of 4 tokens) and sequences 14 tokens long, so
every mask crosses several windows, chunks and 4 x 4 tiles.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxpos

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from examples.models import common, gemma3, llama4, qwen3  # noqa: E402

pytestmark = pytest.mark.parity

TOL = 1e-4  # max abs logit difference, float32
MISS = 1e-2  # a negative control must miss by more than this
VOCAB, HIDDEN = 128, 64
BLOCKS = {"block_q": 4, "block_k": 4}  # several query and key tiles at these lengths


def _pallas_available() -> bool:
    try:
        return hasattr(importlib.import_module("jaxpos.kernels"), "attention_via_kernel")
    except ImportError:
        return False


_NEEDS_PALLAS = pytest.mark.skipif(
    not _pallas_available(),
    reason="jaxpos.kernels.attention_via_kernel (implementation='pallas') is not in this build")
# Pallas runs in interpret mode on CPU and compiles slowly: its cases run with -m slow.
# Each case compiles the model anew; the default run covers every implementation once per
# family (full pass: "reference"; KV-cache decoding, a multi-token prefill over cache slots
# with block masks, then one-token steps: "chunked"); the rest run with -m slow.
IMPLEMENTATIONS = ["reference", pytest.param("chunked", marks=pytest.mark.slow),
                   pytest.param("pallas", marks=[_NEEDS_PALLAS, pytest.mark.slow])]
DECODE_IMPLEMENTATIONS = [pytest.param("reference", marks=pytest.mark.slow), "chunked",
                          pytest.param("pallas", marks=[_NEEDS_PALLAS, pytest.mark.slow])]


def _randomize(model, seed: int, *, std: float = 0.3, embed_std: float = 0.5):
    """Redraw every HF parameter: norm weights ``1 + 0.1 N(0, 1)`` (Gemma's ``1 + w``
    norms then scale by about 2), embeddings ``N(0, embed_std^2)``, the rest
    ``N(0, std^2)``: scores are O(1), so positions matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif "embed" in name:
                p.copy_(embed_std * noise)
            else:
                p.copy_(std * noise)
    return model.eval()


_JITTED: dict = {}
_STATIC = ("implementation", "block_q", "block_k", "qk_norm", "sliding_window",
           "attention_chunk_size", "temperature_tuning")


def _jit(model, *, fresh: bool = False):
    """``model(...)`` compiled once per shape and static argument (jax.jit over the split NNX
    state); ``fresh=True`` traces anew (for monkeypatched negative controls)."""
    key = id(model)
    if fresh or key not in _JITTED:
        graphdef, state = nnx.split(model)
        statics = tuple(n for n in inspect.signature(type(model).__call__).parameters
                        if n in _STATIC)

        @functools.partial(jax.jit, static_argnames=statics)
        def run(state, *args, **kwargs):
            return nnx.merge(graphdef, state)(*args, **kwargs)

        _JITTED[key] = (model, lambda *args, **kwargs: run(state, *args, **kwargs))
    return _JITTED[key][1]


def _max_diff(ours, ref, where=None) -> float:
    d = np.abs(np.asarray(ours, np.float64) - np.asarray(ref, np.float64))
    return float(d[np.asarray(where, bool)].max() if where is not None else d.max())


def _left_padded_batch(seed, lengths, T):
    """Token ids ``[B, T]`` and a 0/1 mask with ``T - length`` pads on the left of each row."""
    rs = np.random.RandomState(seed)
    ids = rs.randint(0, VOCAB, (len(lengths), T))
    mask = np.zeros((len(lengths), T), np.int64)
    for b, n in enumerate(lengths):
        mask[b, T - n:] = 1
    return ids, mask


def _hf_positions(mask):
    """What ``generate`` passes for left padding: ``cumsum(mask) - 1``, 1 on pads."""
    pos = np.cumsum(mask, -1) - 1
    pos[mask == 0] = 1
    return pos


PROMPT, STEPS = 10, 4


def _hf_reference(hf, ids, mask):
    with torch.no_grad():
        return hf(torch.tensor(ids), attention_mask=torch.tensor(mask),
                  position_ids=torch.tensor(_hf_positions(mask))).logits.numpy()


def _family(hf_cls, cfg, module, seed):
    """(hf model, jaxpos model, batch): prompts of 7, 3 and 10 real tokens left-padded to
    10, each followed by 4 more tokens, and HF's logits over the whole batch."""
    torch.manual_seed(0)
    hf = _randomize(hf_cls(cfg), seed=seed)
    ids, mask = _left_padded_batch(seed + 1, [7 + STEPS, 3 + STEPS, 10 + STEPS], PROMPT + STEPS)
    return hf, module.from_hf(hf.state_dict(), cfg), (ids, mask, _hf_reference(hf, ids, mask))


def _full_pass(model, batch, implementation, **kw):
    ids, mask, ref = batch
    logits, _ = _jit(model)(jnp.asarray(ids), attention_mask=jnp.asarray(mask),
                            implementation=implementation, **BLOCKS, **kw)
    return _max_diff(logits, ref, mask)


def _decode(model, batch, implementation, **kw):
    """Prefill the left-padded prompts into a KV cache, then feed one token at a time;
    returns the max difference from HF's full pass over every real position."""
    ids, mask, ref = batch
    run = _jit(model)
    call = dict(implementation=implementation, **BLOCKS, **kw)
    cache = model.init_cache(batch=ids.shape[0], max_len=ids.shape[1] + 2)
    logits, cache = run(jnp.asarray(ids[:, :PROMPT]), attention_mask=jnp.asarray(mask[:, :PROMPT]),
                        cache=cache, **call)
    worst = _max_diff(logits, ref[:, :PROMPT], mask[:, :PROMPT])
    for t in range(PROMPT, ids.shape[1]):
        step, cache = run(jnp.asarray(ids[:, t:t + 1]), cache=cache, **call)
        assert step.shape == (ids.shape[0], 1, VOCAB)
        worst = max(worst, _max_diff(step[:, 0], ref[:, t]))
    np.testing.assert_array_equal(_tokens_held(cache), mask.sum(-1))
    return worst


def _tokens_held(cache):
    """Tokens held per row, padding excluded: the library caches' (one per layer, all
    equal)."""
    assert isinstance(cache, tuple), type(cache)
    counts = {tuple(np.asarray(c.token_count())[:, 0].tolist()) for c in cache}
    assert len(counts) == 1, counts
    return np.asarray(counts.pop())


MEASURED: dict = {}


def _record(request, diff: float):
    """Assert the bound and keep the measured maximum (``MEASURED``, printed with -s)."""
    MEASURED[request.node.name] = diff
    print(f"\n{request.node.name}: max abs logit difference {diff:.2e}")
    assert diff <= TOL


def _common_config(**kw):
    return dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                attn_implementation="eager", **kw)


# ------------------------------------------------------------------------------ Qwen3
@pytest.fixture(scope="module")
def qwen3_family():
    """Layer 0 full attention, layer 1 a sliding window of 3 (``use_sliding_window`` with
    ``max_window_layers=1``), QK-norm, theta 1e6, GQA 2:1."""
    cfg = transformers.Qwen3Config(**_common_config(
        intermediate_size=128, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        use_sliding_window=True, sliding_window=3, max_window_layers=1))
    assert cfg.layer_types == ["full_attention", "sliding_attention"]
    return _family(transformers.Qwen3ForCausalLM, cfg, qwen3, seed=10)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_qwen3_logits(request, qwen3_family, implementation):
    _, model, batch = qwen3_family
    _record(request, _full_pass(model, batch, implementation))


@pytest.mark.parametrize("implementation", DECODE_IMPLEMENTATIONS)
def test_qwen3_kv_cache_decoding(request, qwen3_family, implementation):
    """Prefill, then one token at a time: every step equals HF's full pass."""
    _, model, batch = qwen3_family
    _record(request, _decode(model, batch, implementation))


def test_qwen3_needs_qk_norm(qwen3_family):
    """Negative control: the same weights without QK-norm miss HF by far more."""
    _, model, batch = qwen3_family
    assert _full_pass(model, batch, "reference", qk_norm=False) > MISS


# ----------------------------------------------------------------------------- Gemma 3
@pytest.fixture(scope="module")
def gemma3_family():
    """Layer 0 local (sliding window 3, RoPE base 1e4), layer 1 global (base 1e6, linear
    factor 8), QK-norm, query_pre_attn_scalar 24 (not head_dim), final logit soft-capping
    (None in released Gemma 3; configured here to test it)."""
    cfg = transformers.Gemma3TextConfig(**_common_config(
        intermediate_size=128, query_pre_attn_scalar=24, sliding_window=3,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "linear", "factor": 8.0,
                                            "rope_theta": 1e6}},
        final_logit_softcapping=15.0))
    return _family(transformers.Gemma3ForCausalLM, cfg, gemma3, seed=20)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_gemma3_logits(request, gemma3_family, implementation):
    _, model, batch = gemma3_family
    _record(request, _full_pass(model, batch, implementation))


@pytest.mark.parametrize("implementation", DECODE_IMPLEMENTATIONS)
def test_gemma3_kv_cache_decoding(request, gemma3_family, implementation):
    """Prefill, then one token at a time: every step equals HF's full pass."""
    _, model, batch = gemma3_family
    _record(request, _decode(model, batch, implementation))


def test_gemma3_window_off_by_one(gemma3_family):
    """Negative control: a band of 4 instead of 3 (``q - kv <= window`` instead of ``<``)."""
    _, model, batch = gemma3_family
    assert _full_pass(model, batch, "reference", sliding_window=4) > MISS


def test_gemma3_needs_per_layer_rope(gemma3_family, monkeypatch):
    """Negative control: the global layer's RoPE (base 1e6, factor 8) on both layers."""
    _, model, batch = gemma3_family
    ropes = gemma3.position_schemes(model.config)
    assert (ropes[0].base, ropes[1].base) == (1e4, 1e6)
    monkeypatch.setattr(gemma3, "position_schemes", lambda config, **kw: [ropes[1]] * 2)
    ids, mask, ref = batch
    wrong, _ = _jit(model, fresh=True)(jnp.asarray(ids), attention_mask=jnp.asarray(mask),
                                       implementation="reference")
    assert _max_diff(wrong, ref, mask) > MISS


def test_gemma2_attention_soft_capping_score_mod():
    """``gemma3.softcap(cap)`` as a score_mod through jaxpos.attention equals HF's Gemma 2
    attention (``eager_attention_forward`` with ``softcap``, sliding window 3, GQA) in every
    implementation; without the cap it misses. (HF's Gemma 3 does not soft-cap attention.)"""
    from transformers.models.gemma2 import modeling_gemma2 as m

    rs = np.random.RandomState(40)
    B, T, N, Nk, H, cap, window = 2, 11, 4, 2, 8, 3.0, 3
    q, k, v = (3 * rs.standard_normal((B, T, n, H)).astype(np.float32) for n in (N, Nk, Nk))
    pos = np.arange(T)
    visible = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < window)
    module = type("Attn", (), {"num_key_value_groups": N // Nk, "training": False})()
    tt = lambda a: torch.tensor(a).transpose(1, 2)
    with torch.no_grad():
        ref, _ = m.eager_attention_forward(
            module, tt(q), tt(k), tt(v), torch.where(torch.tensor(visible), 0.0, -torch.inf),
            scaling=H ** -0.5, softcap=cap)
    ref = ref.numpy()
    kw = dict(causal=True, mask_mod=common.SlidingWindowMask(window))
    for impl in ("reference", "chunked"):
        out = jaxpos.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                               score_mod=gemma3.softcap(cap), implementation=impl, **BLOCKS, **kw)
        assert _max_diff(out, ref) <= 1e-5, impl
    plain = jaxpos.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                             implementation="reference", **kw)
    assert _max_diff(plain, ref) > MISS


# ----------------------------------------------------------------------------- Llama 4
@pytest.fixture(scope="module")
def llama4_family():
    """Layer 0: RoPE (interleaved layout, Llama 3 scaling), QK L2-norm, chunks of 4 tokens,
    dense SwiGLU; layer 1: NoPE with temperature tuning (floor_scale 4, attn_scale 0.5, so
    the temperature changes within 14 tokens; Llama 4 ships 8192 and 0.1), a mixture of 4
    experts (top-1, sigmoid router) plus the shared expert."""
    cfg = transformers.Llama4TextConfig(**_common_config(
        intermediate_size=64, intermediate_size_mlp=128, num_local_experts=4,
        num_experts_per_tok=1, moe_layers=[1], no_rope_layer_interval=2, attention_chunk_size=4,
        floor_scale=4, attn_scale=0.5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 16.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}))
    assert cfg.layer_types == ["chunked_attention", "full_attention"]
    assert cfg.no_rope_layers == [1, 0]
    return _family(transformers.Llama4ForCausalLM, cfg, llama4, seed=30)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_llama4_logits(request, llama4_family, implementation):
    _, model, batch = llama4_family
    _record(request, _full_pass(model, batch, implementation))


@pytest.mark.parametrize("implementation", DECODE_IMPLEMENTATIONS)
def test_llama4_kv_cache_decoding(request, llama4_family, implementation):
    """Prefill, then one token at a time: every step equals HF's full pass."""
    _, model, batch = llama4_family
    _record(request, _decode(model, batch, implementation))


def test_llama4_needs_temperature_tuning(llama4_family):
    """Negative control: the NoPE layer without ``q *= 1 + 0.5 log(floor((pos+1)/4) + 1)``."""
    _, model, batch = llama4_family
    assert _full_pass(model, batch, "reference", temperature_tuning=False) > MISS


def test_llama4_chunk_size_off_by_one(llama4_family):
    """Negative control: chunks of 5 instead of 4 on the RoPE layer."""
    _, model, batch = llama4_family
    assert _full_pass(model, batch, "reference", attention_chunk_size=5) > MISS


@pytest.mark.slow  # the layout alone is checked against HF's rotary in test_rope_layers_hf.py
def test_llama4_needs_its_q_k_features_in_the_half_layout(llama4_family, monkeypatch):
    """Negative control: the converter permutes the RoPE layer's q/k features from Llama 4's
    interleaved layout to the half one, and the port rotates in the half layout; rotating
    the converted features in the interleaved layout misses HF."""
    _, model, batch = llama4_family
    schemes = llama4.position_schemes(model.config)
    assert schemes[0].layout == "half"
    wrong_layout = [schemes[0].replace(layout="interleaved"), schemes[1]]
    monkeypatch.setattr(llama4, "position_schemes", lambda config, **kw: wrong_layout)
    ids, mask, ref = batch
    wrong, _ = _jit(model, fresh=True)(jnp.asarray(ids), attention_mask=jnp.asarray(mask),
                                       implementation="reference")
    assert _max_diff(wrong, ref, mask) > MISS


# ------------------------------------------------------------------------- bad input
def _dict(hf_config, **changes):
    d = hf_config.to_dict()
    d["rope_parameters"] = hf_config.rope_parameters
    d.update(changes)
    return d


def test_bad_configs_raise_naming_the_field(qwen3_family, gemma3_family, llama4_family):
    q_cfg, g_cfg, l_cfg = (fam[0].config for fam in (qwen3_family, gemma3_family, llama4_family))
    cases = [
        (lambda: common.ChunkedAttentionMask(0), ("attention_chunk_size",)),
        (lambda: common.SlidingWindowMask(-2), ("sliding_window",)),
        (lambda: qwen3.Qwen3Config.from_hf(_dict(q_cfg, sliding_window=0)), ("sliding_window",)),
        (lambda: gemma3.Gemma3Config.from_hf(_dict(
            g_cfg, layer_types=["sliding_attention", "linear_attention"])),
         ("layer_types[1]", "linear_attention")),
        (lambda: gemma3.Gemma3Config.from_hf(_dict(
            g_cfg, layer_types=["chunked_attention", "full_attention"])), ("layer_types",)),
        (lambda: gemma3.Gemma3Config.from_hf(_dict(g_cfg, use_bidirectional_attention=True)),
         ("use_bidirectional_attention",)),
        (lambda: gemma3.from_hf({}, _dict(g_cfg, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "warp", "rope_theta": 1e6}})), ("rope_type", "warp")),
        (lambda: gemma3.softcap(0.0), ("attn_logit_softcapping",)),
        (lambda: llama4.Llama4Config.from_hf(_dict(l_cfg, attention_chunk_size=0)),
         ("attention_chunk_size",)),
        (lambda: llama4.Llama4Config.from_hf(_dict(l_cfg, no_rope_layers=[1, 0, 0])),
         ("no_rope_layers",)),
        (lambda: llama4.Llama4Config.from_hf(_dict(l_cfg, hidden_act="gelu")), ("hidden_act",)),
    ]
    for call, words in cases:
        with pytest.raises(ValueError) as e:
            call()
        for w in words:
            assert w in str(e.value), (w, str(e.value))


def test_converters_reject_the_wrong_checkpoint(gemma3_family, llama4_family):
    """A Gemma 3 state dict is not a Llama 4 one; a missing expert tensor is named."""
    g_hf, l_hf = gemma3_family[0], llama4_family[0]
    with pytest.raises(ValueError, match="feed_forward|not used"):
        llama4.from_hf(g_hf.state_dict(), l_hf.config)
    sd = dict(l_hf.state_dict())
    del sd["model.layers.1.feed_forward.experts.gate_up_proj"]
    with pytest.raises(ValueError, match="experts.gate_up_proj"):
        llama4.from_hf(sd, l_hf.config)


def test_window_and_chunk_masks_skip_tiles():
    """The layers' masks become block masks whose empty tiles (skipped by the tiled
    implementations) are exactly the tiles with no visible pair (NumPy count), e.g. 3/4 of
    the tiles for chunks of 16 over 64 tokens in tiles of 8."""
    T, blk = 64, 8
    pos = np.arange(T)
    sparsity = []
    for mask_mod, vis in ((common.ChunkedAttentionMask(16), pos[:, None] // 16 == pos // 16),
                          (common.SlidingWindowMask(8), pos[:, None] - pos < 8)):
        kw = common.mask_kwargs(mask_mod, q_positions=jnp.asarray(pos[None], jnp.int32),
                                kv_positions=jnp.asarray(pos[None], jnp.int32),
                                implementation="chunked", block_q=blk, block_k=blk)
        tiles = vis.reshape(T // blk, blk, T // blk, blk).any(axis=(1, 3))
        sparsity.append(kw["block_mask"].sparsity())
        assert sparsity[-1] == pytest.approx(1 - tiles.mean())
    # (the sliding band alone also admits later keys; causal=True hides those tiles too)
    assert sparsity[0] == 0.75
    assert common.ChunkedAttentionMask(16).__call__(0, 0, np.array([[15]]), np.array([[16]])) == 0
    assert common.mask_kwargs(mask_mod, q_positions=jnp.asarray(pos[None], jnp.int32),
                              kv_positions=jnp.asarray(pos[None], jnp.int32),
                              implementation="reference", block_q=blk, block_k=blk) == {
        "mask_mod": mask_mod, "block_q": blk, "block_k": blk}
