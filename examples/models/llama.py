"""A Llama-style decoder in Flax NNX on :func:`jaxpos.attention`, with a converter from a
Hugging Face ``LlamaForCausalLM`` state dict.

Architecture (Touvron et al. 2023, "LLaMA", §2.2; Llama 3: Dubey et al. 2024): pre-norm
RMSNorm blocks, SwiGLU MLP (Shazeer 2020), grouped-query attention (Ainslie et al. 2023)
and rotary positions (Su et al. 2024) in the ``"half"`` layout (HF's ``rotate_half``),
with Llama 3 frequency scaling read from the HF config. Nothing positional lives in this
file: the rotation is a :class:`jaxpos.RoPE` scheme handed to :func:`jaxpos.attention`,
which rotates queries and keys from explicit position arrays, so left padding and KV-cache
decoding are just positions.

One exception, for HF parity: a length-dependent scaling (dynamic NTK, LongRoPE) changes the
frequencies from one call to the next. HF rotates each key once, with the frequencies of the
call that wrote it into the cache, and so do the library caches this model decodes with
(:mod:`jaxpos.layers.cache`: each stores the scheme's ``cache_write``, q and k rotated with
the call's ``max(position) + 1``, and attention reads them with ``NoPE``). Without a cache
jaxpos rotates inside attention (and inside the fused kernel).

Decoding uses the library's caches through their protocol (one per layer from
:meth:`LlamaForCausalLM.init_cache`: dense, StreamingLLM with ``keep_first=``, paged with
``page_size=``/``num_pages=``), so :class:`jaxpos.serving.ModuleDecoder` serves the model
in the continuous-batching loop (:func:`examples.models.from_pretrained` loads a checkpoint
folder).

Example::

    hf = transformers.LlamaForCausalLM(hf_config)
    model = from_hf(hf.state_dict(), hf_config)
    logits, _ = model(input_ids, attention_mask=mask)        # [B, T, vocab]
    cache = model.init_cache(batch=B, max_len=64)
    logits, cache = model(prompt, attention_mask=mask, cache=cache)   # prefill
    logits, cache = model(next_token[:, None], cache=cache)            # one step
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import jaxpos
import jaxpos.hf
from examples.models import common

__all__ = ["LlamaConfig", "LlamaForCausalLM", "from_hf", "rope_from_config"]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The fields of HF's ``LlamaConfig`` this model uses (same names and meaning).

    ``rope_parameters`` is HF's dict (``rope_type``, ``rope_theta`` and the scaling keys).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_parameters: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    max_position_embeddings: int | None = None

    @classmethod
    def from_hf(cls, hf_config) -> LlamaConfig:
        """Read a ``transformers.LlamaConfig`` (v4 ``rope_scaling``/``rope_theta`` or v5
        ``rope_parameters``)."""
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        rope = dict(getattr(hf_config, "rope_parameters", None) or {})
        if not rope:
            rope = dict(getattr(hf_config, "rope_scaling", None) or {})
            rope.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        rope.setdefault("rope_type", rope.pop("type", "default"))
        if hf_config.hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu' (SwiGLU); got {hf_config.hidden_act!r}.")
        return cls(
            vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_hidden_layers=hf_config.num_hidden_layers, num_attention_heads=heads,
            num_key_value_heads=hf_config.num_key_value_heads or heads, head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps, rope_parameters=rope,
            attention_bias=bool(hf_config.attention_bias), mlp_bias=bool(hf_config.mlp_bias),
            tie_word_embeddings=bool(hf_config.tie_word_embeddings),
            hidden_act=hf_config.hidden_act,
            max_position_embeddings=getattr(hf_config, "max_position_embeddings", None))


def rope_from_config(config: LlamaConfig, *, angle_precision: str = "float32") -> jaxpos.RoPE:
    """The :class:`jaxpos.RoPE` scheme of ``config``, read by
    :func:`jaxpos.hf.rope_from_hf_config`
    (any HF ``rope_type``: default, linear, dynamic, yarn, llama3, longrope).

    Llama 3 scaling (Dubey et al. 2024, §3.3; HF ``_compute_llama3_parameters``) keeps
    wavelengths below ``original_max_position_embeddings / high_freq_factor``, divides the
    frequencies of those above ``original_max_position_embeddings / low_freq_factor`` by
    ``factor`` and interpolates the band between.

    Args:
      angle_precision: ``"float32"`` (default) rounds ``position * inv_freq`` to float32 as
        HF does, for the same logits; ``"high"`` reduces angles in extended precision
        (more accurate than HF far from the origin, where the two differ by ~1e-3).

    Raises:
      ValueError: an unknown ``rope_type`` or a scaling dict missing its keys.
    """
    hf_dict = {"rope_parameters": dict(config.rope_parameters), "head_dim": config.head_dim,
               "hidden_size": config.hidden_size,
               "num_attention_heads": config.num_attention_heads,
               "max_position_embeddings": config.max_position_embeddings}
    return jaxpos.hf.rope_from_hf_config(hf_dict, angle_precision=angle_precision)


class LlamaAttention(nnx.Module):
    """Grouped-query self-attention: ``q_proj`` to ``num_attention_heads`` heads,
    ``k_proj``/``v_proj`` to ``num_key_value_heads``, RoPE applied by jaxpos."""

    def __init__(self, config: LlamaConfig, *, dtype, rngs: nnx.Rngs):
        c = config
        self.num_heads, self.kv_heads, self.head_dim = (c.num_attention_heads,
                                                        c.num_key_value_heads, c.head_dim)
        lin = lambda i, o: nnx.Linear(i, o, use_bias=c.attention_bias, dtype=dtype, rngs=rngs)
        self.q_proj = lin(c.hidden_size, c.num_attention_heads * c.head_dim)
        self.k_proj = lin(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.v_proj = lin(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.o_proj = lin(c.num_attention_heads * c.head_dim, c.hidden_size)

    def __call__(self, x, *, rope, call: common.DecoderCall, layer: int):
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(B, T, self.kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(B, T, self.kv_heads, self.head_dim)
        out = call.attend(layer, q, k, v, scheme=rope)
        return self.o_proj(out.reshape(B, T, -1))


class LlamaMLP(nnx.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))`` (Shazeer 2020)."""

    def __init__(self, config: LlamaConfig, *, dtype, rngs: nnx.Rngs):
        c = config
        lin = lambda i, o: nnx.Linear(i, o, use_bias=c.mlp_bias, dtype=dtype, rngs=rngs)
        self.gate_proj = lin(c.hidden_size, c.intermediate_size)
        self.up_proj = lin(c.hidden_size, c.intermediate_size)
        self.down_proj = lin(c.intermediate_size, c.hidden_size)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nnx.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: LlamaConfig, *, dtype, rngs: nnx.Rngs):
        c = config
        self.input_layernorm = nnx.RMSNorm(c.hidden_size, epsilon=c.rms_norm_eps,
                                           use_fast_variance=False, dtype=dtype, rngs=rngs)
        self.self_attn = LlamaAttention(c, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = nnx.RMSNorm(c.hidden_size, epsilon=c.rms_norm_eps,
                                                    use_fast_variance=False, dtype=dtype,
                                                    rngs=rngs)
        self.mlp = LlamaMLP(c, dtype=dtype, rngs=rngs)

    def __call__(self, x, **kw):
        x = x + self.self_attn(self.input_layernorm(x), **kw)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(common.CachedDecoderMixin, nnx.Module):
    """Llama decoder with a language-model head.

    Args:
      config: :class:`LlamaConfig` (``LlamaConfig.from_hf(hf_config)``).
      dtype: computation dtype of the layers (parameters stay float32).
      angle_precision: RoPE angles, ``"float32"`` as HF or ``"high"`` (see
        :func:`rope_from_config`).
      rngs: initialisation randomness (the converter overwrites every parameter).
    """

    def __init__(self, config: LlamaConfig, *, dtype=jnp.float32, angle_precision="float32",
                 rngs: nnx.Rngs):
        c = config
        common.check_head_groups(c)
        self.config = c
        self.angle_precision = angle_precision
        rope_from_config(c, angle_precision=angle_precision)  # validate the rope settings now
        self.embed_tokens = nnx.Embed(c.vocab_size, c.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([LlamaBlock(c, dtype=dtype, rngs=rngs)
                                for _ in range(c.num_hidden_layers)])
        self.norm = nnx.RMSNorm(c.hidden_size, epsilon=c.rms_norm_eps, use_fast_variance=False,
                                dtype=dtype, rngs=rngs)
        self.lm_head = (None if c.tie_word_embeddings else
                        nnx.Linear(c.hidden_size, c.vocab_size, use_bias=False, dtype=dtype,
                                   rngs=rngs))

    def __call__(self, input_ids, *, attention_mask=None, positions=None, cache=None,
                 implementation=None, block_q=None, block_k=None):
        """Logits of the next token.

        Args:
          input_ids: int ``[B, T]`` token ids in ``[0, vocab_size)``.
          attention_mask: 0/1 ``[B, T]``, 0 for padding (left padding for batched
            prompts). Default: all real.
          positions: int ``[B, T]``; default ``cumsum(attention_mask) - 1`` (plus the
            tokens already in ``cache``), as HF's ``generate`` uses.
          cache: the tuple of layer caches from :meth:`init_cache` to write into, or
            ``None`` for a plain forward pass.
          implementation, block_q, block_k: passed to :func:`jaxpos.attention`.

        Returns:
          ``(logits [B, T, vocab_size] float32, cache)``; ``cache`` is the updated cache
          (or ``None``). Logits at padding positions are meaningless; logits of a traced
          call that overflows the cache are NaN (a concrete one raises).

        Raises:
          ValueError / TypeError: bad ids, mask shape, a full cache, bad implementation.
        """
        emb = self.embed_tokens.embedding[...]
        x = common.embed_tokens(emb, input_ids)
        call = common.DecoderCall(input_ids, attention_mask=attention_mask, positions=positions,
                                  cache=cache, num_layers=self.config.num_hidden_layers,
                                  implementation=implementation, block_q=block_q,
                                  block_k=block_k)
        rope = rope_from_config(self.config, angle_precision=self.angle_precision)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope=rope, call=call, layer=i)
        x = self.norm(x)
        return call.finish(x @ emb.T.astype(x.dtype) if self.lm_head is None else self.lm_head(x))


def param_mapping(config: LlamaConfig) -> dict:
    """``{nnx path: (HF key, transform)}`` for ``LlamaForCausalLM`` checkpoints."""
    m = {("embed_tokens", "embedding"): ("model.embed_tokens.weight", common.to_numpy),
         ("norm", "scale"): ("model.norm.weight", common.to_numpy)}
    if not config.tie_word_embeddings:
        m[("lm_head", "kernel")] = ("lm_head.weight", common.linear_kernel)
    for i in range(config.num_hidden_layers):
        hf = f"model.layers.{i}."
        m[("layers", i, "input_layernorm", "scale")] = (hf + "input_layernorm.weight",
                                                        common.to_numpy)
        m[("layers", i, "post_attention_layernorm", "scale")] = (
            hf + "post_attention_layernorm.weight", common.to_numpy)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            m[("layers", i, "self_attn", name, "kernel")] = (f"{hf}self_attn.{name}.weight",
                                                             common.linear_kernel)
            if config.attention_bias:
                m[("layers", i, "self_attn", name, "bias")] = (f"{hf}self_attn.{name}.bias",
                                                               common.to_numpy)
        for name in ("gate_proj", "up_proj", "down_proj"):
            m[("layers", i, "mlp", name, "kernel")] = (f"{hf}mlp.{name}.weight",
                                                       common.linear_kernel)
            if config.mlp_bias:
                m[("layers", i, "mlp", name, "bias")] = (f"{hf}mlp.{name}.bias", common.to_numpy)
    return m


def from_hf(state_dict, hf_config, *, dtype=jnp.float32,
            angle_precision: str = "float32") -> LlamaForCausalLM:
    """Build a :class:`LlamaForCausalLM` holding the weights of an HF PyTorch checkpoint.

    Args:
      state_dict: ``transformers.LlamaForCausalLM(...).state_dict()`` (torch tensors).
      hf_config: its ``transformers.LlamaConfig``.
      dtype: computation dtype; angle_precision: see :func:`rope_from_config`.

    Raises:
      ValueError: a missing or unexpected key or a shape mismatch (see
        :func:`examples.models.common.load_params`); an unsupported rope type.
    """
    config = LlamaConfig.from_hf(hf_config)
    # Abstract parameters (no random initialisation): load_params fills every one.
    model = nnx.eval_shape(lambda: LlamaForCausalLM(
        config, dtype=dtype, angle_precision=angle_precision, rngs=nnx.Rngs(0)))
    ignore = lambda k: k.endswith("rotary_emb.inv_freq") or (
        config.tie_word_embeddings and k == "lm_head.weight")
    return common.load_params(model, state_dict, param_mapping(config), ignore=ignore)
