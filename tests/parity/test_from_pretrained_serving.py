"""A Hugging Face checkpoint folder, loaded by ``examples.models.from_pretrained`` and served
by the continuous-batching loop with paged caches, generates exactly the greedy tokens of
transformers' own forward pass.

For Llama, Qwen3, Gemma 3 (a sliding layer, window 4), GPT-OSS (attention sinks, a
sliding layer, window 4), BLOOM (ALiBi, 6 heads) and GPT-2 (learned positions), a tiny
random model (2 layers, hidden 32 (48 for BLOOM), vocab 128, every weight
redrawn so that attention, sinks and windows matter) is saved with
``save_pretrained(safe_serialization=True)`` into a temporary folder, loaded from disk
without PyTorch, wrapped in :class:`jaxpos.serving.ModuleDecoder` and served by
:class:`jaxpos.serving.ServingEngine`: 3 prompts of 3, 11 and 7 tokens on 2 batch slots
(the third waits for a free slot), prefilled in chunks of 4 into pages of 4 slots, 5 new
tokens each. The reference is greedy decoding with HF's forward pass over each prompt
alone (the argmax of the last position's logits, the sequence re-run after every token).
"""

from __future__ import annotations

import os
import pathlib
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _parity_common import randomize  # noqa: E402

from examples.models import from_pretrained  # noqa: E402
from jaxpos.serving import ModuleDecoder, Request, ServingEngine  # noqa: E402

pytestmark = pytest.mark.parity

VOCAB, WINDOW, NEW_TOKENS = 128, 4, 5
PROMPT_LENGTHS = (3, 11, 7)
SIZES = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, attn_implementation="eager")


def _families():
    t = transformers
    return {
        "llama": (t.LlamaForCausalLM, t.LlamaConfig(intermediate_size=64, **SIZES), 0.3),
        "qwen3": (t.Qwen3ForCausalLM, t.Qwen3Config(
            intermediate_size=64, use_sliding_window=False, **SIZES), 0.3),
        "gemma3": (t.Gemma3ForCausalLM, t.Gemma3TextConfig(
            intermediate_size=64, sliding_window=WINDOW, query_pre_attn_scalar=8,
            layer_types=["sliding_attention", "full_attention"], **SIZES), 0.3),
        "gpt_oss": (t.GptOssForCausalLM, t.GptOssConfig(
            intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
            sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
            **SIZES), 0.15),
        "bloom": (t.BloomForCausalLM, t.BloomConfig(
            vocab_size=VOCAB, hidden_size=48, n_layer=2, n_head=6,
            attn_implementation="eager"), 0.3),
        "gpt2": (t.GPT2LMHeadModel, t.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
            bos_token_id=0, eos_token_id=0, attn_implementation="eager"), 0.3),
    }


def _hf_greedy(hf, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens of HF's forward pass over the whole sequence, one token at a time."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = hf(torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt):]


# GPT-OSS (sinks, a sliding layer, biases, experts) in the default run; each case compiles
# a prefill and a decode step of the loop, so the other families run with -m slow.
@pytest.mark.parametrize("family", [pytest.param("llama", marks=pytest.mark.slow),
                                    pytest.param("qwen3", marks=pytest.mark.slow),
                                    pytest.param("gemma3", marks=pytest.mark.slow),
                                    "gpt_oss",
                                    pytest.param("bloom", marks=pytest.mark.slow),
                                    pytest.param("gpt2", marks=pytest.mark.slow)])
def test_checkpoint_from_disk_served_with_paged_caches_matches_hf_greedy(family, tmp_path):
    hf_cls, cfg, std = _families()[family]
    torch.manual_seed(0)
    hf = randomize(hf_cls(cfg), seed=7, std=std)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    rs = np.random.RandomState(11)
    prompts = [rs.randint(0, VOCAB, n).tolist() for n in PROMPT_LENGTHS]
    want = [_hf_greedy(hf, p, NEW_TOKENS) for p in prompts]

    model = from_pretrained(tmp_path)
    engine = ServingEngine(ModuleDecoder(model), num_slots=2, num_pages=16, page_size=4,
                           max_len=32, prefill_chunk=4)
    done, _ = engine.run([Request(p, max_new_tokens=NEW_TOKENS) for p in prompts])
    got = {c.request.id: c.tokens for c in done}
    assert [got[i] for i in range(len(prompts))] == want
