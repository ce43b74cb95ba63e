"""A Gemma 3 (text) decoder in Flax NNX on :func:`jaxpos.attention`, with a converter from a
Hugging Face ``Gemma3ForCausalLM`` state dict.

Architecture (Gemma Team 2025, "Gemma 3 Technical Report", §2; Gemma 2: Gemma Team 2024,
§2): interleaved local and global attention layers (``layer_types``; five
``"sliding_attention"`` layers per ``"full_attention"`` one in the released models), with

* **per-layer RoPE**: local layers rotate with base 10,000 (``rope_local_base_freq``),
  global layers with base 1,000,000 and linear scaling (factor 8 in the 4B-27B models),
  read per layer by :func:`jaxpos.hf.rope_per_layer_from_hf_config`;
* **sliding window** on local layers: :class:`examples.models.common.SlidingWindowMask`
  as a ``mask_mod`` (a query sees the ``sliding_window - 1`` tokens before it), as a
  :class:`jaxpos.BlockMask` on tiled implementations so tiles outside the band are skipped;
* **QK-norm** (RMSNorm over ``head_dim``, before the rotation) and the softmax scale
  ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5``;
* **final logit soft-capping** when configured (``final_logit_softcapping``:
  ``cap * tanh(logits / cap)``). Gemma 3 replaced Gemma 2's attention soft-capping with
  QK-norm (report §2): HF's ``Gemma3Attention`` keeps ``attn_logit_softcapping`` in its
  config but never applies it, so neither does this port. Gemma 2's attention soft-cap is
  :func:`softcap`, a ``score_mod`` (tested against HF's Gemma 2 attention);
* Gemma's RMSNorm ``x / rms(x) * (1 + w)`` in float32, "sandwich" norms around attention
  and MLP (pre and post), a GeGLU MLP (tanh GELU), embeddings scaled by
  ``sqrt(hidden_size)`` and tied to the output head.

Bidirectional Gemma 3 (``use_bidirectional_attention``, EmbeddingGemma) is refused.

Example::

    hf = transformers.Gemma3ForCausalLM(hf_text_config)
    model = from_hf(hf.state_dict(), hf_text_config)
    logits, _ = model(input_ids, attention_mask=mask)
    cache = model.init_cache(batch=B, max_len=64)     # library caches, one per layer
    logits, cache = model(prompt, attention_mask=mask, cache=cache)
    logits, cache = model(next_token[:, None], cache=cache)

Every layer's cache keeps all its tokens (dense, StreamingLLM or paged, through the cache
protocol); the sliding layers' mask hides what Hugging Face's sliding cache drops.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import jaxpos
import jaxpos.hf
from examples.models import common

__all__ = ["Gemma3Config", "Gemma3ForCausalLM", "from_hf", "position_schemes", "softcap"]


@dataclasses.dataclass(frozen=True)
class Gemma3Config:
    """The fields of HF's ``Gemma3TextConfig`` this model uses (same names and meaning).

    ``hf_dict`` keeps the HF config as a dict for the per-layer RoPE reader.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int
    query_pre_attn_scalar: float
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True
    hf_dict: Any = dataclasses.field(default=None, compare=False, repr=False)

    @classmethod
    def from_hf(cls, hf_config) -> Gemma3Config:
        """Read a ``transformers.Gemma3TextConfig`` (or its ``config.json`` dict; for a
        multimodal ``Gemma3Config`` pass its ``text_config``).

        Raises:
          ValueError: an activation other than tanh GELU; bidirectional attention; a layer
            type other than full or sliding attention (``layer_types``); a sliding window
            or soft-cap that is not positive.
        """
        d = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
        if hasattr(hf_config, "rope_parameters"):
            d["rope_parameters"] = hf_config.rope_parameters
        act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"hidden_activation must be 'gelu_pytorch_tanh' (GeGLU with tanh "
                             f"GELU); got {act!r}.")
        if d.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention=True (EmbeddingGemma) is not "
                             "supported by this causal port.")
        types = tuple(jaxpos.hf.hf_layer_types(d))
        if "chunked_attention" in types:
            raise ValueError(f"layer_types: Gemma 3 has full and sliding attention layers; got "
                             f"{list(types)}.")
        window = d.get("sliding_window")
        if "sliding_attention" in types:
            common.SlidingWindowMask(window)  # validates sliding_window >= 1
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if d.get(name) is not None and not float(d[name]) > 0:
                raise ValueError(f"{name} must be positive or None; got {d[name]!r}.")
        heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim, layer_types=types, sliding_window=window,
            query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", head_dim)),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            attention_bias=bool(d.get("attention_bias", False)),
            attn_logit_softcapping=d.get("attn_logit_softcapping"),
            final_logit_softcapping=d.get("final_logit_softcapping"),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", True)), hf_dict=d)


def position_schemes(config: Gemma3Config, *, angle_precision: str = "float32") -> list:
    """One :class:`jaxpos.RoPE` per layer from the HF config
    (:func:`jaxpos.hf.rope_per_layer_from_hf_config`): local layers base 1e4, global ones
    base 1e6 with their scaling.

    Raises:
      ValueError: an unknown ``rope_type`` or layer type.
    """
    return jaxpos.hf.rope_per_layer_from_hf_config(config.hf_dict,
                                                           angle_precision=angle_precision)


def softcap(cap: float):
    """The score_mod ``cap * tanh(score / cap)`` of Gemma 2's attention (Gemma Team 2024,
    "Gemma 2", §2, "Logit soft-capping"; HF ``Gemma2Attention`` passes
    ``softcap=attn_logit_softcapping`` to ``eager_attention_forward``), applied to the scaled
    scores before the mask. Not used by Gemma 3 (see the module docstring).

    Raises:
      ValueError: ``cap`` not positive (named ``attn_logit_softcapping``).
    """
    cap = _positive("attn_logit_softcapping", cap)

    def score_mod(score, batch, head, q_pos, kv_pos):
        return jnp.tanh(score / cap) * cap

    score_mod.__qualname__ = f"softcap({cap})"
    return score_mod


def _positive(name, value) -> float:
    v = float(value)
    if not v > 0:
        raise ValueError(f"{name} must be positive; got {value!r}.")
    return v


class GemmaRMSNorm(nnx.Module):
    """``x * rsqrt(mean(x^2) + eps) * (1 + weight)`` in float32, cast back (HF
    ``Gemma3RMSNorm``; the weight is stored as an offset from 1)."""

    def __init__(self, width: int, *, eps: float, dtype):
        self.weight = nnx.Param(jnp.zeros((width,), jnp.float32))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


class Gemma3Attention(nnx.Module):
    """Grouped-query attention: QK-norm, the layer's RoPE and mask applied by jaxpos, scale
    ``query_pre_attn_scalar ** -0.5`` (no attention soft-capping, as HF's Gemma 3)."""

    def __init__(self, config: Gemma3Config, *, dtype, rngs: nnx.Rngs):
        c = config
        self.num_heads, self.kv_heads, self.head_dim = (c.num_attention_heads,
                                                        c.num_key_value_heads, c.head_dim)
        self.scale = c.query_pre_attn_scalar ** -0.5
        lin = lambda i, o: nnx.Linear(i, o, use_bias=c.attention_bias, dtype=dtype, rngs=rngs)
        self.q_proj = lin(c.hidden_size, c.num_attention_heads * c.head_dim)
        self.k_proj = lin(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.v_proj = lin(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.o_proj = lin(c.num_attention_heads * c.head_dim, c.hidden_size)
        self.q_norm = GemmaRMSNorm(c.head_dim, eps=c.rms_norm_eps, dtype=dtype)
        self.k_norm = GemmaRMSNorm(c.head_dim, eps=c.rms_norm_eps, dtype=dtype)

    def __call__(self, x, *, rope, call: common.DecoderCall, layer: int, mask_mod):
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, T, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).reshape(B, T, self.kv_heads, self.head_dim))
        v = self.v_proj(x).reshape(B, T, self.kv_heads, self.head_dim)
        out = call.attend(layer, q, k, v, scheme=rope, mask_mod=mask_mod, scale=self.scale)
        return self.o_proj(out.reshape(B, T, -1))


class Gemma3MLP(nnx.Module):
    """GeGLU: ``down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))`` (Shazeer 2020)."""

    def __init__(self, config: Gemma3Config, *, dtype, rngs: nnx.Rngs):
        c = config
        lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, rngs=rngs)
        self.gate_proj = lin(c.hidden_size, c.intermediate_size)
        self.up_proj = lin(c.hidden_size, c.intermediate_size)
        self.down_proj = lin(c.intermediate_size, c.hidden_size)

    def __call__(self, x):
        return self.down_proj(jax.nn.gelu(self.gate_proj(x), approximate=True) * self.up_proj(x))


class Gemma3Block(nnx.Module):
    """``x + post_attn_norm(attn(pre_norm(x)))``, then ``x + post_ff_norm(mlp(pre_ff_norm(x)))``."""

    def __init__(self, config: Gemma3Config, *, dtype, rngs: nnx.Rngs):
        c = config
        norm = lambda: GemmaRMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=dtype)
        self.input_layernorm = norm()
        self.self_attn = Gemma3Attention(c, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = Gemma3MLP(c, dtype=dtype, rngs=rngs)
        self.post_feedforward_layernorm = norm()

    def __call__(self, x, **kw):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), **kw))
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class Gemma3ForCausalLM(common.CachedDecoderMixin, nnx.Module):
    """Gemma 3 text decoder with a language-model head.

    Args:
      config: :class:`Gemma3Config` (``Gemma3Config.from_hf(hf_text_config)``).
      dtype: computation dtype of the layers (parameters stay float32).
      angle_precision: RoPE angles, ``"float32"`` as HF or ``"high"``.
      rngs: initialisation randomness (the converter overwrites every parameter).

    Raises:
      ValueError: ``num_attention_heads`` not a multiple of ``num_key_value_heads``; bad
        rope settings.
    """

    def __init__(self, config: Gemma3Config, *, dtype=jnp.float32, angle_precision="float32",
                 rngs: nnx.Rngs):
        c = config
        common.check_head_groups(c)
        self.config = c
        self.angle_precision = angle_precision
        position_schemes(c, angle_precision=angle_precision)  # validate the rope settings now
        self.embed_tokens = nnx.Embed(c.vocab_size, c.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([Gemma3Block(c, dtype=dtype, rngs=rngs)
                                for _ in range(c.num_hidden_layers)])
        self.norm = GemmaRMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=dtype)
        self.lm_head = (None if c.tie_word_embeddings else
                        nnx.Linear(c.hidden_size, c.vocab_size, use_bias=False, dtype=dtype,
                                   rngs=rngs))

    def __call__(self, input_ids, *, attention_mask=None, positions=None, cache=None,
                 implementation=None, block_q=None, block_k=None,
                 sliding_window: int | None = None):
        """Logits of the next token.

        Args:
          input_ids: int ``[B, T]`` token ids in ``[0, vocab_size)``.
          attention_mask: 0/1 ``[B, T]``, 0 for (left) padding. Default: all real.
          positions: int ``[B, T]``; default ``cumsum(attention_mask) - 1`` (plus the
            tokens already in ``cache``), as HF's ``generate`` uses.
          cache: the tuple of layer caches from :meth:`init_cache` (dense, StreamingLLM or
            paged: :class:`jaxpos.serving.ModuleDecoder` serves the model), or ``None``.
          implementation, block_q, block_k: passed to :func:`jaxpos.attention` (with both
            block sizes, the sliding layers get a :class:`jaxpos.BlockMask`).
          sliding_window: overrides ``config.sliding_window`` (experiments, controls).

        Returns:
          ``(logits [B, T, vocab_size] float32, cache)``; soft-capped when
          ``final_logit_softcapping`` is set; logits at padding positions are
          meaningless; a traced call that overflows the cache gives NaN logits.

        Raises:
          ValueError / TypeError: bad ids, mask shape, a full cache, bad implementation or
            sliding window.
        """
        c = self.config
        emb = self.embed_tokens.embedding[...]
        x = common.embed_tokens(emb, input_ids)
        # HF multiplies by sqrt(hidden_size) rounded to the weights' dtype (float32 here).
        x = x * jnp.asarray(c.hidden_size ** 0.5, emb.dtype).astype(x.dtype)
        call = common.DecoderCall(input_ids, attention_mask=attention_mask, positions=positions,
                                  cache=cache, num_layers=c.num_hidden_layers,
                                  implementation=implementation, block_q=block_q,
                                  block_k=block_k)
        window = c.sliding_window if sliding_window is None else sliding_window
        ropes = position_schemes(c, angle_precision=self.angle_precision)
        for i, layer in enumerate(self.layers):
            mask_mod = (common.SlidingWindowMask(window)
                        if c.layer_types[i] == "sliding_attention" else None)
            x = layer(x, rope=ropes[i], call=call, layer=i, mask_mod=mask_mod)
        x = self.norm(x)
        logits = (x @ emb.T.astype(x.dtype) if self.lm_head is None else self.lm_head(x))
        logits = logits.astype(jnp.float32)
        if c.final_logit_softcapping is not None:
            cap = float(c.final_logit_softcapping)
            logits = jnp.tanh(logits / cap) * cap
        return call.finish(logits)


def param_mapping(config: Gemma3Config) -> dict:
    """``{nnx path: (HF key, transform)}`` for ``Gemma3ForCausalLM`` checkpoints."""
    m = {("embed_tokens", "embedding"): ("model.embed_tokens.weight", common.to_numpy),
         ("norm", "weight"): ("model.norm.weight", common.to_numpy)}
    if not config.tie_word_embeddings:
        m[("lm_head", "kernel")] = ("lm_head.weight", common.linear_kernel)
    for i in range(config.num_hidden_layers):
        hf = f"model.layers.{i}."
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            m[("layers", i, name, "weight")] = (f"{hf}{name}.weight", common.to_numpy)
        for name in ("q_norm", "k_norm"):
            m[("layers", i, "self_attn", name, "weight")] = (f"{hf}self_attn.{name}.weight",
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
            angle_precision: str = "float32") -> Gemma3ForCausalLM:
    """Build a :class:`Gemma3ForCausalLM` holding the weights of an HF PyTorch checkpoint.

    Args:
      state_dict: ``transformers.Gemma3ForCausalLM(...).state_dict()`` (torch tensors).
      hf_config: its ``transformers.Gemma3TextConfig``.
      dtype: computation dtype; angle_precision: ``"float32"`` (HF) or ``"high"``.

    Raises:
      ValueError: a missing or unexpected key or a shape mismatch
        (:func:`examples.models.common.load_params`); an unsupported config (see
        :meth:`Gemma3Config.from_hf`).
    """
    config = Gemma3Config.from_hf(hf_config)
    model = nnx.eval_shape(lambda: Gemma3ForCausalLM(
        config, dtype=dtype, angle_precision=angle_precision, rngs=nnx.Rngs(0)))
    ignore = lambda k: ("rotary_emb" in k and k.endswith("inv_freq")) or k.endswith(
        "embed_scale") or (config.tie_word_embeddings and k == "lm_head.weight")
    return common.load_params(model, state_dict, param_mapping(config), ignore=ignore)
