"""A Qwen3 (dense) decoder in Flax NNX on :func:`jaxpos.attention`, with a converter from a
Hugging Face ``Qwen3ForCausalLM`` state dict.

Architecture (Qwen Team 2025, "Qwen3 Technical Report", §2): the Llama layout (pre-norm
RMSNorm blocks, SwiGLU MLP, grouped-query attention, rotary positions in the ``"half"``
layout) plus **QK-norm**: an RMSNorm with a learned weight over the ``head_dim`` features
of every query and key head, applied before the rotation (HF ``Qwen3Attention.q_norm`` /
``k_norm``; Dehghani et al. 2023, "Scaling Vision Transformers to 22 Billion Parameters",
§3.1, for QK normalisation). Optional sliding-window layers (HF ``use_sliding_window``,
``max_window_layers``, ``layer_types``) attend through
:class:`examples.models.common.SlidingWindowMask` as a ``mask_mod``; the released dense
checkpoints use full attention everywhere.

Nothing positional lives in this file: the rotation is the :class:`jaxpos.RoPE` scheme read
from the HF config by :func:`jaxpos.hf.rope_from_hf_config` and applied inside
:func:`jaxpos.attention` from explicit positions, so left padding and KV-cache decoding
are position arrays (length-dependent scalings rotate at cache-write time as HF does, see
:mod:`examples.models.llama`).

Example::

    hf = transformers.Qwen3ForCausalLM(hf_config)
    model = from_hf(hf.state_dict(), hf_config)
    logits, _ = model(input_ids, attention_mask=mask)          # [B, T, vocab]
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

__all__ = ["Qwen3Config", "Qwen3ForCausalLM", "from_hf", "rope_from_config"]


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """The fields of HF's ``Qwen3Config`` this model uses (same names and meaning).

    ``layer_types`` holds ``"full_attention"`` / ``"sliding_attention"`` per layer
    (:func:`jaxpos.hf.hf_layer_types`); ``sliding_window`` the band of the sliding ones.
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
        default_factory=lambda: {"rope_type": "default", "rope_theta": 1_000_000.0})
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int | None = None
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None

    @classmethod
    def from_hf(cls, hf_config) -> Qwen3Config:
        """Read a ``transformers.Qwen3Config`` (or its ``config.json`` dict).

        Raises:
          ValueError: ``hidden_act`` other than ``"silu"``; a layer type other than full or
            sliding attention; sliding layers without a positive ``sliding_window``.
        """
        d = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
        heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be 'silu' (SwiGLU); got {d['hidden_act']!r}.")
        rope = dict(getattr(hf_config, "rope_parameters", None) or d.get("rope_parameters")
                    or d.get("rope_scaling") or {})
        rope.setdefault("rope_theta", d.get("rope_theta", 1_000_000.0))
        rope.setdefault("rope_type", rope.pop("type", "default"))
        types = tuple(jaxpos.hf.hf_layer_types(d))
        if "chunked_attention" in types:
            raise ValueError(f"layer_types: Qwen3 has full and sliding attention layers; got "
                             f"{list(types)}.")
        window = d.get("sliding_window") if d.get("use_sliding_window", True) else None
        if "sliding_attention" in types:
            common.SlidingWindowMask(window)  # validates sliding_window > 0
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim, rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_parameters=rope,
            attention_bias=bool(d.get("attention_bias", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=d.get("max_position_embeddings"), layer_types=types,
            sliding_window=window)


def rope_from_config(config: Qwen3Config, *, angle_precision: str = "float32") -> jaxpos.RoPE:
    """The :class:`jaxpos.RoPE` of ``config`` via :func:`jaxpos.hf.rope_from_hf_config` (any
    HF ``rope_type``; Qwen3's long-context YaRN included).

    Args:
      angle_precision: ``"float32"`` (default, HF's rounding) or ``"high"``.

    Raises:
      ValueError: an unknown ``rope_type`` or a scaling dict missing its keys.
    """
    hf_dict = {"rope_parameters": dict(config.rope_parameters), "head_dim": config.head_dim,
               "hidden_size": config.hidden_size,
               "num_attention_heads": config.num_attention_heads,
               "max_position_embeddings": config.max_position_embeddings}
    return jaxpos.hf.rope_from_hf_config(hf_dict, angle_precision=angle_precision)


def _rms_norm(width, config, dtype, rngs):
    return nnx.RMSNorm(width, epsilon=config.rms_norm_eps, use_fast_variance=False, dtype=dtype,
                       rngs=rngs)


class Qwen3Attention(nnx.Module):
    """Grouped-query attention with QK-norm (RMSNorm over ``head_dim`` of each q/k head,
    before the rotation) and RoPE applied by jaxpos."""

    def __init__(self, config: Qwen3Config, *, dtype, rngs: nnx.Rngs):
        c = config
        self.num_heads, self.kv_heads, self.head_dim = (c.num_attention_heads,
                                                        c.num_key_value_heads, c.head_dim)
        lin = lambda i, o: nnx.Linear(i, o, use_bias=c.attention_bias, dtype=dtype, rngs=rngs)
        self.q_proj = lin(c.hidden_size, c.num_attention_heads * c.head_dim)
        self.k_proj = lin(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.v_proj = lin(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.o_proj = lin(c.num_attention_heads * c.head_dim, c.hidden_size)
        self.q_norm = _rms_norm(c.head_dim, c, dtype, rngs)
        self.k_norm = _rms_norm(c.head_dim, c, dtype, rngs)

    def __call__(self, x, *, rope, call: common.DecoderCall, layer: int, mask_mod,
                 qk_norm=True):
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(B, T, self.kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(B, T, self.kv_heads, self.head_dim)
        if qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        out = call.attend(layer, q, k, v, scheme=rope, mask_mod=mask_mod)
        return self.o_proj(out.reshape(B, T, -1))


class Qwen3MLP(nnx.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, config: Qwen3Config, *, dtype, rngs: nnx.Rngs):
        c = config
        lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, rngs=rngs)
        self.gate_proj = lin(c.hidden_size, c.intermediate_size)
        self.up_proj = lin(c.hidden_size, c.intermediate_size)
        self.down_proj = lin(c.intermediate_size, c.hidden_size)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3Block(nnx.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: Qwen3Config, *, dtype, rngs: nnx.Rngs):
        c = config
        self.input_layernorm = _rms_norm(c.hidden_size, c, dtype, rngs)
        self.self_attn = Qwen3Attention(c, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = _rms_norm(c.hidden_size, c, dtype, rngs)
        self.mlp = Qwen3MLP(c, dtype=dtype, rngs=rngs)

    def __call__(self, x, **kw):
        x = x + self.self_attn(self.input_layernorm(x), **kw)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3ForCausalLM(common.CachedDecoderMixin, nnx.Module):
    """Qwen3 decoder with a language-model head.

    Args:
      config: :class:`Qwen3Config` (``Qwen3Config.from_hf(hf_config)``).
      dtype: computation dtype of the layers (parameters stay float32).
      angle_precision: RoPE angles, ``"float32"`` as HF or ``"high"``.
      rngs: initialisation randomness (the converter overwrites every parameter).

    Raises:
      ValueError: ``num_attention_heads`` not a multiple of ``num_key_value_heads``; bad
        rope settings.
    """

    def __init__(self, config: Qwen3Config, *, dtype=jnp.float32, angle_precision="float32",
                 rngs: nnx.Rngs):
        c = config
        common.check_head_groups(c)
        self.config = c
        self.angle_precision = angle_precision
        rope_from_config(c, angle_precision=angle_precision)  # validate the rope settings now
        self.embed_tokens = nnx.Embed(c.vocab_size, c.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([Qwen3Block(c, dtype=dtype, rngs=rngs)
                                for _ in range(c.num_hidden_layers)])
        self.norm = _rms_norm(c.hidden_size, c, dtype, rngs)
        self.lm_head = (None if c.tie_word_embeddings else
                        nnx.Linear(c.hidden_size, c.vocab_size, use_bias=False, dtype=dtype,
                                   rngs=rngs))

    def __call__(self, input_ids, *, attention_mask=None, positions=None, cache=None,
                 implementation=None, block_q=None, block_k=None, qk_norm: bool = True):
        """Logits of the next token.

        Args:
          input_ids: int ``[B, T]`` token ids in ``[0, vocab_size)``.
          attention_mask: 0/1 ``[B, T]``, 0 for (left) padding. Default: all real.
          positions: int ``[B, T]``; default ``cumsum(attention_mask) - 1`` (plus the
            tokens already in ``cache``), as HF's ``generate`` uses.
          cache: the tuple of layer caches from :meth:`init_cache` (dense, StreamingLLM or
            paged: :class:`jaxpos.serving.ModuleDecoder` serves the model), or ``None``.
          implementation, block_q, block_k: passed to :func:`jaxpos.attention` (with both
            block sizes, sliding layers get a :class:`jaxpos.BlockMask`).
          qk_norm: ``False`` skips QK-norm (a negative control only).

        Returns:
          ``(logits [B, T, vocab_size] float32, cache)``; logits at padding positions are
          meaningless; a traced call that overflows the cache gives NaN logits.

        Raises:
          ValueError / TypeError: bad ids, mask shape, a full cache, bad implementation.
        """
        c = self.config
        emb = self.embed_tokens.embedding[...]
        x = common.embed_tokens(emb, input_ids)
        call = common.DecoderCall(input_ids, attention_mask=attention_mask, positions=positions,
                                  cache=cache, num_layers=c.num_hidden_layers,
                                  implementation=implementation, block_q=block_q,
                                  block_k=block_k)
        sliding = common.SlidingWindowMask(c.sliding_window) if c.sliding_window else None
        rope = rope_from_config(c, angle_precision=self.angle_precision)
        for i, layer in enumerate(self.layers):
            mask_mod = sliding if c.layer_types[i] == "sliding_attention" else None
            x = layer(x, rope=rope, call=call, layer=i, mask_mod=mask_mod, qk_norm=qk_norm)
        x = self.norm(x)
        return call.finish(x @ emb.T.astype(x.dtype) if self.lm_head is None else self.lm_head(x))


def param_mapping(config: Qwen3Config) -> dict:
    """``{nnx path: (HF key, transform)}`` for ``Qwen3ForCausalLM`` checkpoints."""
    m = {("embed_tokens", "embedding"): ("model.embed_tokens.weight", common.to_numpy),
         ("norm", "scale"): ("model.norm.weight", common.to_numpy)}
    if not config.tie_word_embeddings:
        m[("lm_head", "kernel")] = ("lm_head.weight", common.linear_kernel)
    for i in range(config.num_hidden_layers):
        hf = f"model.layers.{i}."
        for name in ("input_layernorm", "post_attention_layernorm"):
            m[("layers", i, name, "scale")] = (f"{hf}{name}.weight", common.to_numpy)
        for name in ("q_norm", "k_norm"):
            m[("layers", i, "self_attn", name, "scale")] = (f"{hf}self_attn.{name}.weight",
                                                            common.to_numpy)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            m[("layers", i, "self_attn", name, "kernel")] = (f"{hf}self_attn.{name}.weight",
                                                             common.linear_kernel)
            if config.attention_bias:
                m[("layers", i, "self_attn", name, "bias")] = (f"{hf}self_attn.{name}.bias",
                                                               common.to_numpy)
        for name in ("gate_proj", "up_proj", "down_proj"):
            m[("layers", i, "mlp", name, "kernel")] = (f"{hf}mlp.{name}.weight",
                                                       common.linear_kernel)
    return m


def from_hf(state_dict, hf_config, *, dtype=jnp.float32,
            angle_precision: str = "float32") -> Qwen3ForCausalLM:
    """Build a :class:`Qwen3ForCausalLM` holding the weights of an HF PyTorch checkpoint.

    Args:
      state_dict: ``transformers.Qwen3ForCausalLM(...).state_dict()`` (torch tensors).
      hf_config: its ``transformers.Qwen3Config``.
      dtype: computation dtype; angle_precision: see :func:`rope_from_config`.

    Raises:
      ValueError: a missing or unexpected key or a shape mismatch
        (:func:`examples.models.common.load_params`); an unsupported rope type or layer type.
    """
    config = Qwen3Config.from_hf(hf_config)
    model = nnx.eval_shape(lambda: Qwen3ForCausalLM(
        config, dtype=dtype, angle_precision=angle_precision, rngs=nnx.Rngs(0)))
    ignore = lambda k: k.endswith("rotary_emb.inv_freq") or (
        config.tie_word_embeddings and k == "lm_head.weight")
    return common.load_params(model, state_dict, param_mapping(config), ignore=ignore)
