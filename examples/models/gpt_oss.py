"""GPT-OSS in Flax NNX on :func:`jaxpos.attention`, with a converter from a Hugging Face
``GptOssForCausalLM`` state dict.

Architecture (OpenAI 2025, "gpt-oss-120b & gpt-oss-20b Model Card", the architecture section; HF
``modeling_gpt_oss.py``): pre-norm RMSNorm blocks; grouped-query attention with biases on
every projection; rotary positions in the ``"half"`` layout with YaRN scaling (Peng et al.
2024; ``rope_type="yarn"``, ``truncate=False`` in the released configs, which jaxpos's
:class:`jaxpos.YaRNScaling` reads from ``rope_parameters``); a mixture-of-experts MLP
(top-k router with a bias, softmax over the chosen logits, experts with a clamped SwiGLU
``(clip(up) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``).

The two attention features of GPT-OSS are jaxpos arguments, not code in this file:

* **attention sinks**: a learned logit per head in the softmax denominator
  (``softmax([scores, sink])`` with the sink column dropped; Xiao et al. 2024,
  "Efficient Streaming Language Models with Attention Sinks", with a learned sink as in
  the model card), passed as ``sinks=[N]`` to :func:`jaxpos.attention` (every
  implementation, gradient included);
* **banded attention** on alternate layers: ``layer_types`` marks ``"sliding_attention"``
  layers, which see the ``sliding_window`` most recent tokens (the query included). That is
  :class:`examples.models.common.SlidingWindowMask` as a ``mask_mod`` on global positions;
  with block sizes given, a :class:`jaxpos.BlockMask` is built once per call so the
  chunked and Pallas paths skip the tiles outside the band.

Positions are explicit (``cumsum(attention_mask) - 1``), so left padding and KV-cache
decoding need no special case. Decoding uses the library's caches through their protocol
(one per layer: dense, StreamingLLM or paged), so :class:`jaxpos.serving.ModuleDecoder`
serves the model; every layer's cache keeps all its tokens (a sliding layer just masks the
old ones, as HF's mask does; HF's sliding cache drops them).

Example::

    hf = transformers.GptOssForCausalLM(hf_config)
    model = from_hf(hf.state_dict(), hf_config)
    logits, _ = model(input_ids, attention_mask=mask)                  # [B, T, vocab]
    cache = model.init_cache(batch=B, max_len=64)
    logits, cache = model(prompt, attention_mask=mask, cache=cache)    # prefill
    logits, cache = model(next_token[:, None], cache=cache)             # one step
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
from jaxpos import _checks

__all__ = ["GptOssConfig", "GptOssForCausalLM", "from_hf", "param_mapping", "rope_from_config"]

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class GptOssConfig:
    """The fields of HF's ``GptOssConfig`` this model uses (same names and meaning).

    ``layer_types``: one of :data:`LAYER_TYPES` per layer; ``sliding_window``: the band
    width of the ``"sliding_attention"`` layers (tokens, the query included);
    ``rope_parameters``: HF's dict (``rope_type``, ``rope_theta``, YaRN keys).

    Raises:
      ValueError: an unknown layer type (named ``layer_types[i]``), a layer count that does
        not match, a sliding layer without a positive ``sliding_window``, heads that do not
        divide, a non-positive size.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_local_experts: int
    num_experts_per_tok: int
    layer_types: tuple[str, ...]
    sliding_window: int | None = 128
    rms_norm_eps: float = 1e-5
    rope_parameters: Mapping[str, Any] = dataclasses.field(default_factory=lambda: {
        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096})
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_bias: bool = True
    tie_word_embeddings: bool = False
    max_position_embeddings: int | None = 131072

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "num_local_experts", "num_experts_per_tok"):
            _checks.check_positive_int(name, getattr(self, name))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a "
                             f"multiple of num_key_value_heads ({self.num_key_value_heads}).")
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= "
                             f"num_local_experts ({self.num_local_experts}).")
        types = tuple(self.layer_types)
        if len(types) != self.num_hidden_layers:
            raise ValueError(f"layer_types must name {self.num_hidden_layers} layers "
                             f"(num_hidden_layers); got {len(types)}: {list(types)}.")
        for i, t in enumerate(types):
            if t not in LAYER_TYPES:
                raise ValueError(f"layer_types[{i}] must be one of {LAYER_TYPES}; got {t!r}.")
        if "sliding_attention" in types:
            _checks.check_positive_int("sliding_window", self.sliding_window)
        object.__setattr__(self, "layer_types", types)

    @classmethod
    def from_hf(cls, hf_config) -> GptOssConfig:
        """Read a ``transformers.GptOssConfig``.

        Raises:
          ValueError: ``hidden_act`` other than ``"silu"`` (the experts' clamped SwiGLU is
            fixed), and the errors of the constructor.
        """
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act must be 'silu' (GPT-OSS's clamped SwiGLU); got {act!r}.")
        heads = hf_config.num_attention_heads
        rope = dict(getattr(hf_config, "rope_parameters", None) or {})
        if not rope:
            rope = dict(getattr(hf_config, "rope_scaling", None) or {})
            rope.setdefault("rope_theta", getattr(hf_config, "rope_theta", 150000.0))
        rope.setdefault("rope_type", rope.pop("type", "default"))
        layer_types = hf_config.layer_types
        if layer_types is None:  # HF's default: sliding on even layers
            layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                           for i in range(hf_config.num_hidden_layers)]
        return cls(
            vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_hidden_layers=hf_config.num_hidden_layers, num_attention_heads=heads,
            num_key_value_heads=hf_config.num_key_value_heads or heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
            num_local_experts=hf_config.num_local_experts,
            num_experts_per_tok=hf_config.num_experts_per_tok,
            layer_types=tuple(layer_types), sliding_window=hf_config.sliding_window,
            rms_norm_eps=hf_config.rms_norm_eps, rope_parameters=rope,
            swiglu_alpha=float(hf_config.swiglu_alpha), swiglu_limit=float(hf_config.swiglu_limit),
            attention_bias=bool(hf_config.attention_bias),
            tie_word_embeddings=bool(hf_config.tie_word_embeddings),
            max_position_embeddings=getattr(hf_config, "max_position_embeddings", None))


def rope_from_config(config: GptOssConfig, *, angle_precision: str = "float32") -> jaxpos.RoPE:
    """The :class:`jaxpos.RoPE` scheme of ``config`` (``"half"`` layout; YaRN per
    ``rope_parameters``, ``truncate`` included), via :func:`jaxpos.hf.rope_from_hf_config`.

    HF's GPT-OSS rotary splits each head in halves (``torch.chunk(x, 2)``) and multiplies
    cos and sin by YaRN's ``attention_factor`` (``0.1 ln(factor) + 1``): exactly
    ``RoPE(layout="half")`` with the scaling's attention factor.

    Raises:
      ValueError: an unknown ``rope_type`` or a scaling dict missing its keys.
    """
    hf_dict = {"model_type": "gpt_oss", "rope_parameters": dict(config.rope_parameters),
               "head_dim": config.head_dim, "hidden_size": config.hidden_size,
               "num_attention_heads": config.num_attention_heads,
               "max_position_embeddings": config.max_position_embeddings}
    return jaxpos.hf.rope_from_hf_config(hf_dict, angle_precision=angle_precision)


def _rms_norm(c: GptOssConfig, dtype, rngs):
    return nnx.RMSNorm(c.hidden_size, epsilon=c.rms_norm_eps, use_fast_variance=False,
                       dtype=dtype, rngs=rngs)


class GptOssAttention(nnx.Module):
    """Grouped-query attention with per-head sinks; RoPE, the sliding band (``mask_mod``)
    and the sinks are applied by :func:`jaxpos.attention`."""

    def __init__(self, config: GptOssConfig, *, dtype, rngs: nnx.Rngs):
        c = config
        self.num_heads, self.kv_heads, self.head_dim = (c.num_attention_heads,
                                                        c.num_key_value_heads, c.head_dim)
        lin = lambda i, o: nnx.Linear(i, o, use_bias=c.attention_bias, dtype=dtype, rngs=rngs)
        self.q_proj = lin(c.hidden_size, c.num_attention_heads * c.head_dim)
        self.k_proj = lin(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.v_proj = lin(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.o_proj = lin(c.num_attention_heads * c.head_dim, c.hidden_size)
        self.sinks = nnx.Param(jnp.zeros((c.num_attention_heads,), jnp.float32))

    def __call__(self, x, *, rope, call: common.DecoderCall, layer: int, mask_mod,
                 use_sinks=True):
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(B, T, self.kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(B, T, self.kv_heads, self.head_dim)
        sinks = self.sinks[...] if use_sinks else None
        out = call.attend(layer, q, k, v, scheme=rope, mask_mod=mask_mod, sinks=sinks)
        return self.o_proj(out.reshape(B, T, -1))


class GptOssMLP(nnx.Module):
    """Mixture of experts: router ``x W^T + b``, top-``num_experts_per_tok`` logits, softmax
    over them; each chosen expert ``((clip(u, -l, l) + 1) * g * sigmoid(alpha g)) W_down +
    b_down`` with ``[g, u]`` the even/odd columns of ``x W_gate_up + b`` and ``g`` clipped
    above at ``l = swiglu_limit``.

    Every expert runs on every token (a dense, exact formulation for small models: the
    output is the routing-weighted sum over the chosen experts, the others weigh 0).
    """

    def __init__(self, config: GptOssConfig, *, dtype, rngs: nnx.Rngs):
        c = config
        E, D, F = c.num_local_experts, c.hidden_size, c.intermediate_size
        self.top_k, self.alpha, self.limit, self.dtype = (c.num_experts_per_tok, c.swiglu_alpha,
                                                          c.swiglu_limit, dtype)
        self.router = nnx.Linear(D, E, use_bias=True, dtype=dtype, rngs=rngs)
        init = nnx.initializers.normal(0.02)
        self.gate_up_proj = nnx.Param(init(rngs.params(), (E, D, 2 * F), jnp.float32))
        self.gate_up_proj_bias = nnx.Param(jnp.zeros((E, 2 * F), jnp.float32))
        self.down_proj = nnx.Param(init(rngs.params(), (E, F, D), jnp.float32))
        self.down_proj_bias = nnx.Param(jnp.zeros((E, D), jnp.float32))

    def __call__(self, x):
        logits = self.router(x)  # [B, T, E]
        top, idx = jax.lax.top_k(logits, self.top_k)
        weights = jax.nn.softmax(top.astype(jnp.float32), axis=-1)
        combine = jnp.sum(jax.nn.one_hot(idx, logits.shape[-1], dtype=jnp.float32)
                          * weights[..., None], axis=-2)  # [B, T, E]
        dt = self.dtype
        gu = jnp.einsum("btd,edf->btef", x, self.gate_up_proj[...].astype(dt)) \
            + self.gate_up_proj_bias[...].astype(dt)
        gate = jnp.minimum(gu[..., 0::2], self.limit)
        up = jnp.clip(gu[..., 1::2], -self.limit, self.limit)
        h = (up + 1) * (gate * jax.nn.sigmoid(gate * self.alpha))
        out = jnp.einsum("btef,efd->bted", h, self.down_proj[...].astype(dt)) \
            + self.down_proj_bias[...].astype(dt)
        return jnp.einsum("bted,bte->btd", out, combine.astype(out.dtype))


class GptOssBlock(nnx.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + moe(norm(x))``."""

    def __init__(self, config: GptOssConfig, *, dtype, rngs: nnx.Rngs):
        self.input_layernorm = _rms_norm(config, dtype, rngs)
        self.self_attn = GptOssAttention(config, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = _rms_norm(config, dtype, rngs)
        self.mlp = GptOssMLP(config, dtype=dtype, rngs=rngs)

    def __call__(self, x, **kw):
        x = x + self.self_attn(self.input_layernorm(x), **kw)
        return x + self.mlp(self.post_attention_layernorm(x))


class GptOssForCausalLM(common.CachedDecoderMixin, nnx.Module):
    """GPT-OSS decoder with a language-model head.

    Args:
      config: :class:`GptOssConfig` (``GptOssConfig.from_hf(hf_config)``).
      dtype: computation dtype of the layers (parameters stay float32).
      angle_precision: RoPE angles, ``"float32"`` as HF or ``"high"``.
      rngs: initialisation randomness (the converter overwrites every parameter).

    Raises:
      ValueError: a bad config or rope settings.
    """

    def __init__(self, config: GptOssConfig, *, dtype=jnp.float32, angle_precision="float32",
                 rngs: nnx.Rngs):
        c = config
        self.config = c
        self.angle_precision = angle_precision
        rope_from_config(c, angle_precision=angle_precision)  # validate the rope settings now
        self.embed_tokens = nnx.Embed(c.vocab_size, c.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([GptOssBlock(c, dtype=dtype, rngs=rngs)
                                for _ in range(c.num_hidden_layers)])
        self.norm = _rms_norm(c, dtype, rngs)
        self.lm_head = (None if c.tie_word_embeddings else
                        nnx.Linear(c.hidden_size, c.vocab_size, use_bias=False, dtype=dtype,
                                   rngs=rngs))

    def layer_masks(self, positions, kv_positions, *, implementation=None, block_q=None,
                    block_k=None, sliding_window: int | None = None) -> dict:
        """``{layer type: keyword arguments for jaxpos.attention}``
        (:func:`examples.models.common.mask_kwargs`): the block sizes for full layers; for
        sliding layers ``mask_mod=SlidingWindowMask(window)``, or, with both block sizes
        given and a tiled implementation, a :class:`jaxpos.BlockMask` of it (empty tiles
        skipped) built once for all sliding layers of the call.

        ``sliding_window`` overrides ``config.sliding_window`` (for experiments).
        """
        kw = dict(q_positions=positions, kv_positions=kv_positions,
                  implementation=implementation, block_q=block_q, block_k=block_k)
        masks = {"full_attention": common.mask_kwargs(None, **kw)}
        if "sliding_attention" in self.config.layer_types:
            window = self.config.sliding_window if sliding_window is None else sliding_window
            masks["sliding_attention"] = common.mask_kwargs(common.SlidingWindowMask(window),
                                                            **kw)
        return masks

    def __call__(self, input_ids, *, attention_mask=None, positions=None, cache=None,
                 implementation=None, block_q=None, block_k=None, rope=None,
                 sliding_window=None, use_sinks: bool = True):
        """Logits of the next token.

        Args:
          input_ids: int ``[B, T]`` token ids in ``[0, vocab_size)``.
          attention_mask: 0/1 ``[B, T]``, 0 for padding (left padding for batched
            prompts). Default: all real.
          positions: int ``[B, T]``; default ``cumsum(attention_mask) - 1`` (plus the
            tokens already in ``cache``), as HF's ``generate`` uses.
          cache: the tuple of layer caches from :meth:`init_cache` (dense, StreamingLLM or
            paged: :class:`jaxpos.serving.ModuleDecoder` serves the model), or ``None``.
          implementation, block_q, block_k: passed to :func:`jaxpos.attention`.
          rope: override the rotary scheme (default :func:`rope_from_config`);
            sliding_window: override the band width of the sliding layers; use_sinks:
            ``False`` drops the sinks (experiments and negative controls).

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
        window = c.sliding_window if sliding_window is None else sliding_window
        if rope is None:
            rope = rope_from_config(c, angle_precision=self.angle_precision)
        for i, layer in enumerate(self.layers):
            mask_mod = (common.SlidingWindowMask(window)
                        if c.layer_types[i] == "sliding_attention" else None)
            x = layer(x, rope=rope, call=call, layer=i, mask_mod=mask_mod, use_sinks=use_sinks)
        x = self.norm(x)
        return call.finish(x @ emb.T.astype(x.dtype) if self.lm_head is None else self.lm_head(x))


def param_mapping(config: GptOssConfig) -> dict:
    """``{nnx path: (HF key, transform)}`` for ``GptOssForCausalLM`` checkpoints."""
    m = {("embed_tokens", "embedding"): ("model.embed_tokens.weight", common.to_numpy),
         ("norm", "scale"): ("model.norm.weight", common.to_numpy)}
    if not config.tie_word_embeddings:
        m[("lm_head", "kernel")] = ("lm_head.weight", common.linear_kernel)
    for i in range(config.num_hidden_layers):
        hf = f"model.layers.{i}."
        for ours, theirs in (("input_layernorm", "input_layernorm"),
                             ("post_attention_layernorm", "post_attention_layernorm")):
            m[("layers", i, ours, "scale")] = (f"{hf}{theirs}.weight", common.to_numpy)
        m[("layers", i, "self_attn", "sinks")] = (f"{hf}self_attn.sinks", common.to_numpy)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            m[("layers", i, "self_attn", name, "kernel")] = (f"{hf}self_attn.{name}.weight",
                                                             common.linear_kernel)
            if config.attention_bias:
                m[("layers", i, "self_attn", name, "bias")] = (f"{hf}self_attn.{name}.bias",
                                                               common.to_numpy)
        m[("layers", i, "mlp", "router", "kernel")] = (f"{hf}mlp.router.weight",
                                                       common.linear_kernel)
        m[("layers", i, "mlp", "router", "bias")] = (f"{hf}mlp.router.bias", common.to_numpy)
        for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            # HF stores experts as [E, in, out] (x @ W): the same layout as ours.
            m[("layers", i, "mlp", name)] = (f"{hf}mlp.experts.{name}", common.to_numpy)
    return m


def from_hf(state_dict, hf_config, *, dtype=jnp.float32,
            angle_precision: str = "float32") -> GptOssForCausalLM:
    """Build a :class:`GptOssForCausalLM` holding the weights of an HF PyTorch checkpoint.

    Args:
      state_dict: ``transformers.GptOssForCausalLM(...).state_dict()`` (torch tensors).
      hf_config: its ``transformers.GptOssConfig``.
      dtype: computation dtype; angle_precision: ``"float32"`` (HF's numbers) or ``"high"``.

    Raises:
      ValueError: a missing or unexpected key or a shape mismatch (see
        :func:`examples.models.common.load_params`); a bad config.
    """
    config = GptOssConfig.from_hf(hf_config)
    model = nnx.eval_shape(lambda: GptOssForCausalLM(
        config, dtype=dtype, angle_precision=angle_precision, rngs=nnx.Rngs(0)))
    ignore = lambda k: k.endswith("rotary_emb.inv_freq") or (
        config.tie_word_embeddings and k == "lm_head.weight")
    return common.load_params(model, state_dict, param_mapping(config), ignore=ignore)

