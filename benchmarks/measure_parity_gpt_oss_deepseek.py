"""Print the measured max abs logit differences from Hugging Face of the GPT-OSS and
DeepSeek-V3 ports, per implementation, for the full pass and KV-cache decoding, and the
negative controls: the numbers behind the table in docs/models.md (not a test; run it by hand)::

    python benchmarks/measure_parity_gpt_oss_deepseek.py [reference chunked pallas]

Same tiny models, seeds and inputs as tests/parity/test_parity_gpt_oss.py and
tests/parity/test_parity_deepseek_v3.py.
"""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests" / "parity"))
jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py

import test_parity_deepseek_v3 as tds  # noqa: E402
import test_parity_gpt_oss as tgo  # noqa: E402
from _parity_common import (  # noqa: E402
    BLOCKS,
    decode,
    hf_cached_generation,
    hf_positions,
    jit,
    left_padded_batch,
    max_diff,
    randomize,
)


def _batch(hf, vocab):
    prompt_len, steps = 10, 4
    ids, mask = left_padded_batch(np.random.RandomState(2), [7 + steps, 3 + steps, 10 + steps],
                                  prompt_len + steps, vocab)
    with torch.no_grad():
        ref = hf(torch.tensor(ids), attention_mask=torch.tensor(mask),
                 position_ids=torch.tensor(hf_positions(mask))).logits.numpy()
    return ids, mask, prompt_len, ref


def measure(name, hf, model, vocab, implementations, controls):
    ids, mask, prompt_len, ref = _batch(hf, vocab)
    hf_first, hf_steps = hf_cached_generation(hf, ids, mask, prompt_len)
    print(f"{name}: max |logit| {np.abs(ref).max():.2f}")
    for impl in implementations:
        full, _ = jit(model)(jnp.asarray(ids), attention_mask=jnp.asarray(mask),
                             implementation=impl, **BLOCKS)
        first, steps, _ = decode(model, ids, mask, prompt_len, implementation=impl, **BLOCKS)
        dec = max([max_diff(first, hf_first, mask[:, :prompt_len])]
                  + [max_diff(s, h) for s, h in zip(steps, hf_steps)])
        print(f"  {impl:9s} full pass {max_diff(full, ref, mask):.2e}   KV-cache decoding "
              f"(vs HF generation) {dec:.2e}")
    for label, kw in controls:
        wrong, _ = jit(model)(jnp.asarray(ids), attention_mask=jnp.asarray(mask),
                              implementation="reference", **kw)
        print(f"  control {label}: {max_diff(wrong, ref, mask):.2f}")


def main(implementations):
    torch.manual_seed(0)
    cfg = tgo._config()
    hf = randomize(tgo.transformers.GptOssForCausalLM(cfg), seed=1, std=0.15)
    model = tgo.gpt_oss.from_hf(hf.state_dict(), cfg)
    measure("GPT-OSS", hf, model, tgo.VOCAB, implementations,
            [("no sinks", {"use_sinks": False}),
             (f"window {tgo.WINDOW + 1}", {"sliding_window": tgo.WINDOW + 1}),
             (f"window {tgo.WINDOW - 1}", {"sliding_window": tgo.WINDOW - 1})])
    cfg = tds._config()
    hf, model = tds._build(cfg, seed=1)
    c = model.config
    measure("DeepSeek-V3", hf, model, tds.VOCAB, implementations,
            [("rope in the half layout",
              {"rope": tds.deepseek_v3.rope_from_config(c, layout="half")}),
             ("no mscale**2", {"scale": c.qk_head_dim ** -0.5})])


if __name__ == "__main__":
    main(sys.argv[1:] or ["reference", "chunked", "pallas"])
