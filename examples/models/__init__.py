"""Small Flax NNX re-implementations of published models on :func:`jaxpos.attention`,
each with a converter from a Hugging Face PyTorch state dict (``from_hf``):

* :mod:`examples.models.llama`: Llama decoder, grouped-query attention, RoPE with Llama 3
  scaling, left-padded batches and KV-cache decoding.
* :mod:`examples.models.t5`: T5 encoder-decoder, bucketed relative bias per stack (a
  full-pass example: no decoding).
* :mod:`examples.models.bloom`: BLOOM decoder, ALiBi, decoding on the library caches.
* :mod:`examples.models.gpt2`: GPT-2 decoder, learned absolute positions, decoding on the
  library caches.
* :mod:`examples.models.qwen3`: Qwen3 (dense) decoder, QK-norm, optional sliding-window
  layers (``tests/parity/test_parity_qwen3_gemma3_llama4.py``).
* :mod:`examples.models.gemma3`: Gemma 3 text decoder, local sliding-window / global layers
  with per-layer RoPE, QK-norm, ``query_pre_attn_scalar``, final logit soft-capping.
* :mod:`examples.models.gemma4`: Gemma 4 text decoder (dense, full pass), full layers with
  their own head width and proportional RoPE, QK-norm and V-norm, ``attention_k_eq_v``
  (``tests/parity/test_parity_gemma4.py``).
* :mod:`examples.models.llama4`: Llama 4 text decoder, iRoPE (chunked RoPE layers, NoPE
  layers with attention temperature tuning), QK L2-norm, mixture of experts.
* :mod:`examples.models.gpt_oss`: GPT-OSS decoder, attention sinks, sliding-window layers
  (a mask_mod / block mask), YaRN RoPE, mixture of experts
  (``tests/parity/test_parity_gpt_oss.py``).
* :mod:`examples.models.deepseek_v3`: DeepSeek-V3 decoder, multi-head latent attention with
  decoupled RoPE (:mod:`jaxpos.schemes.mla`), YaRN softmax mscale, a latent KV cache in the
  library caches, DeepSeekMoE
  (``tests/parity/test_parity_deepseek_v3.py``).
* :mod:`examples.models.common`: padding -> positions and segment ids, the shared decoder
  plumbing on the library's caches (:class:`~examples.models.common.DecoderCall`), and the
  checked state-dict loader.
* :mod:`examples.models.pretrained`: :func:`from_pretrained`, a Hugging Face checkpoint
  folder (``config.json`` + ``*.safetensors``, sharded or not) loaded into its port without
  PyTorch.

The decoder-only ports decode through the library's caches (``init_cache``: dense,
StreamingLLM, paged), so :class:`jaxpos.serving.ModuleDecoder` serves them in the
continuous-batching loop.

``tests/parity/test_parity_models.py`` compares all four with transformers on CPU PyTorch.
"""

from examples.models.pretrained import from_pretrained

__all__ = ["bloom", "common", "deepseek_v3", "from_pretrained", "gemma3", "gemma4", "gpt2",
           "gpt_oss", "llama", "llama4", "pretrained", "qwen3", "t5"]
