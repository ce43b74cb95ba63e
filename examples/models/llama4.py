"""A Llama 4 (text) decoder in Flax NNX on :func:`jaxpos.attention`, with a converter from a
Hugging Face ``Llama4ForCausalLM`` state dict.

Architecture (Meta AI 2025, "The Llama 4 herd", and the reference code
``llama_models/llama4/model.py``; HF ``modeling_llama4.py``):

* **iRoPE**: every ``no_rope_layer_interval``-th layer is a NoPE layer (HF
  ``no_rope_layers[i] == 0``) attending over the whole causal context; the other layers
  rotate q and k (RoPE in the interleaved, complex-pair layout, Llama 3 frequency
  scaling) and attend **within chunks** of ``attention_chunk_size`` positions
  (:class:`examples.models.common.ChunkedAttentionMask`, a ``mask_mod``; a
  :class:`jaxpos.BlockMask` on tiled implementations so off-chunk tiles are skipped);
  the per-layer schemes come from :func:`jaxpos.hf.rope_per_layer_from_hf_config`.
  :func:`from_hf` permutes each RoPE layer's ``q_proj`` / ``k_proj`` output features head
  by head (:func:`jaxpos.interleaved_to_half`) and the port rotates in the ``"half"``
  layout: the same scores (``q . k`` is unchanged by one permutation of both, and so is
  the QK L2-norm below), and every library cache serves it, the StreamingLLM cache's
  rotation on load included (it takes the half layout);
* **attention temperature tuning** on NoPE layers
  (:class:`jaxpos.schemes.irope.TemperatureTunedNoPE`):
  ``q *= 1 + attn_scale * log(floor((pos + 1) / floor_scale) + 1)``, where HF (and Meta's
  code) take ``pos`` from the cache slot index (``cache_position``: the tokens a row was
  handed before, its left padding counted), not from the position ids; this port does
  the same, so NoPE layers attend at slot indices
  (:meth:`examples.models.common.DecoderCall.attend` with ``at_slots=True``: ``arange(T)``
  without a cache, the row's filled slots before the call plus ``arange(T)`` with one; they
  use positions only for causality and the temperature, and slot order is position order
  for real tokens). Served by the loop (no padding in a row) slots and positions agree;
  the temperature multiplies each query by a factor of its own position only, but the
  ragged step refuses every scheme with its own ``transform_qk``, so the token-budget loop
  (``max_num_batched_tokens``) runs the port in padded steps;
* **QK L2-norm** (``use_qk_norm``, no weight) on RoPE layers after the rotation; the norm of
  a vector is invariant under rotation, so it is applied here before jaxpos rotates
  (equal up to float32 rounding);
* a mixture of experts on ``moe_layers`` (top-k router with sigmoid scores, a shared
  expert; computed densely, each expert on its router-weighted input as HF does) and a
  SwiGLU MLP (``intermediate_size_mlp``) on the others; pre-norm RMSNorm blocks, GQA.

Example::

    hf = transformers.Llama4ForCausalLM(hf_text_config)
    model = from_hf(hf.state_dict(), hf_text_config)
    logits, _ = model(input_ids, attention_mask=mask)
    cache = model.init_cache(batch=B, max_len=64)
    logits, cache = model(prompt, attention_mask=mask, cache=cache)
    logits, cache = model(next_token[:, None], cache=cache)
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
from jaxpos.schemes.irope import TemperatureTunedNoPE, no_rope_layers

__all__ = ["Llama4Config", "Llama4ForCausalLM", "from_hf", "position_schemes"]


@dataclasses.dataclass(frozen=True)
class Llama4Config:
    """The fields of HF's ``Llama4TextConfig`` this model uses (same names and meaning).

    ``no_rope_layers[i]`` is 1 for a RoPE layer and 0 for a NoPE layer (HF's convention);
    ``hf_dict`` keeps the HF config as a dict for the per-layer scheme reader.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    intermediate_size_mlp: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    no_rope_layers: tuple[int, ...]
    moe_layers: tuple[int, ...]
    attention_chunk_size: int | None
    num_local_experts: int = 16
    num_experts_per_tok: int = 1
    rms_norm_eps: float = 1e-5
    use_qk_norm: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    hf_dict: Any = dataclasses.field(default=None, compare=False, repr=False)

    @classmethod
    def from_hf(cls, hf_config) -> Llama4Config:
        """Read a ``transformers.Llama4TextConfig`` (or its ``config.json`` dict; for the
        multimodal ``Llama4Config`` pass its ``text_config``).

        Raises:
          ValueError: ``hidden_act`` other than ``"silu"``; a layer type other than full or
            chunked attention; chunked layers without a positive ``attention_chunk_size``;
            a bad ``no_rope_layers``.
        """
        d = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
        if hasattr(hf_config, "rope_parameters"):
            d["rope_parameters"] = hf_config.rope_parameters
        d.setdefault("model_type", "llama4_text")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be 'silu' (SwiGLU); got {d['hidden_act']!r}.")
        n = d["num_hidden_layers"]
        types = tuple(jaxpos.hf.hf_layer_types(d))
        if "sliding_attention" in types:
            raise ValueError(f"layer_types: Llama 4 has full and chunked attention layers; got "
                             f"{list(types)}.")
        chunk = d.get("attention_chunk_size")
        if "chunked_attention" in types:
            common.ChunkedAttentionMask(chunk)  # validates attention_chunk_size >= 1
        flags = tuple(int(f) for f in (d.get("no_rope_layers") or no_rope_layers(
            n, d.get("no_rope_layer_interval", 4))))
        if len(flags) != n or set(flags) - {0, 1}:
            raise ValueError(f"no_rope_layers must hold num_hidden_layers = {n} entries in "
                             f"{{0, 1}} (1 = the layer uses RoPE); got {list(flags)}.")
        step = d.get("interleave_moe_layer_step", 1)
        moe = d.get("moe_layers")
        moe = tuple(range(step - 1, n, step)) if moe is None else tuple(int(i) for i in moe)
        heads = d["num_attention_heads"]
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            intermediate_size_mlp=d["intermediate_size_mlp"], num_hidden_layers=n,
            num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads, layer_types=types,
            no_rope_layers=flags, moe_layers=moe, attention_chunk_size=chunk,
            num_local_experts=d.get("num_local_experts", 16),
            num_experts_per_tok=d.get("num_experts_per_tok", 1),
            rms_norm_eps=d.get("rms_norm_eps", 1e-5), use_qk_norm=bool(d.get("use_qk_norm", True)),
            attention_bias=bool(d.get("attention_bias", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), hf_dict=d)


def position_schemes(config: Llama4Config, *, angle_precision: str = "float32") -> list:
    """The port's scheme per layer: :class:`jaxpos.RoPE` (the config's scaling) on RoPE
    layers, :class:`jaxpos.schemes.irope.TemperatureTunedNoPE` (or plain NoPE when
    ``attn_temperature_tuning`` is off) on NoPE layers
    (:func:`jaxpos.hf.rope_per_layer_from_hf_config`). The RoPE layers rotate in the
    ``"half"`` layout, not Llama 4's interleaved one: the port's ``q_proj`` / ``k_proj``
    hold the checkpoint's features permuted by :func:`jaxpos.interleaved_to_half`
    (:func:`param_mapping`), which gives the same attention.

    Raises:
      ValueError: an unknown ``rope_type``; a bad ``no_rope_layers``.
    """
    schemes = jaxpos.hf.rope_per_layer_from_hf_config(config.hf_dict,
                                                      angle_precision=angle_precision)
    return [s.replace(layout="half") if isinstance(s, jaxpos.RoPE) else s for s in schemes]


def _rope_rotary_dims(config: Llama4Config) -> list:
    """Per layer: the rotated features per head of an interleaved RoPE layer in the
    checkpoint, else None (the layers whose q/k features :func:`param_mapping` permutes)."""
    schemes = jaxpos.hf.rope_per_layer_from_hf_config(config.hf_dict)
    return [s.rotary_dim if isinstance(s, jaxpos.RoPE) and s.layout == "interleaved" else None
            for s in schemes]


def l2_norm(x, eps: float):
    """``x * rsqrt(mean(x^2) + eps)`` over the last axis in float32 (HF ``Llama4TextL2Norm``:
    an RMS norm without weight)."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def _rms_norm(width, config, dtype, rngs):
    return nnx.RMSNorm(width, epsilon=config.rms_norm_eps, use_fast_variance=False, dtype=dtype,
                       rngs=rngs)


class Llama4Attention(nnx.Module):
    """Grouped-query attention; the layer's scheme (RoPE / temperature-tuned NoPE) and mask
    are applied by jaxpos; QK L2-norm on RoPE layers."""

    def __init__(self, config: Llama4Config, layer: int, *, dtype, rngs: nnx.Rngs):
        c = config
        self.num_heads, self.kv_heads, self.head_dim = (c.num_attention_heads,
                                                        c.num_key_value_heads, c.head_dim)
        self.use_rope = bool(c.no_rope_layers[layer])
        self.qk_norm = c.use_qk_norm and self.use_rope
        self.eps = c.rms_norm_eps
        lin = lambda i, o: nnx.Linear(i, o, use_bias=c.attention_bias, dtype=dtype, rngs=rngs)
        self.q_proj = lin(c.hidden_size, c.num_attention_heads * c.head_dim)
        self.k_proj = lin(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.v_proj = lin(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.o_proj = lin(c.num_attention_heads * c.head_dim, c.hidden_size)

    def __call__(self, x, *, scheme, call: common.DecoderCall, layer: int, mask_mod):
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(B, T, self.kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(B, T, self.kv_heads, self.head_dim)
        if self.qk_norm:  # HF: after the rotation; rotations keep the norm, so same result
            q, k = l2_norm(q, self.eps), l2_norm(k, self.eps)
        # NoPE layers: causality and the temperature at the cache slot index (HF's)
        out = call.attend(layer, q, k, v, scheme=scheme, mask_mod=mask_mod,
                          at_slots=not self.use_rope)
        return self.o_proj(out.reshape(B, T, -1))


class Llama4MLP(nnx.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, hidden: int, inner: int, *, dtype, rngs: nnx.Rngs):
        lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, rngs=rngs)
        self.gate_proj = lin(hidden, inner)
        self.up_proj = lin(hidden, inner)
        self.down_proj = lin(inner, hidden)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Llama4MoE(nnx.Module):
    """Llama 4's mixture of experts (HF ``Llama4TextMoe``): the router keeps each token's
    ``num_experts_per_tok`` largest logits and turns them into sigmoid scores (0 for the
    other experts); expert ``e`` runs a SwiGLU on ``x * score_e``; the shared expert runs on
    ``x``; outputs add. Computed densely over all experts (an expert with score 0 gets a
    zero input and, without biases, returns 0, exactly as in HF)."""

    def __init__(self, config: Llama4Config, *, dtype, rngs: nnx.Rngs):
        c = config
        E, H, inner = c.num_local_experts, c.hidden_size, c.intermediate_size
        self.top_k = c.num_experts_per_tok
        self.router = nnx.Linear(H, E, use_bias=False, dtype=dtype, rngs=rngs)
        init = nnx.initializers.normal(0.02)
        self.gate_up_proj = nnx.Param(init(rngs.params(), (E, H, 2 * inner), jnp.float32))
        self.down_proj = nnx.Param(init(rngs.params(), (E, inner, H), jnp.float32))
        self.shared_expert = Llama4MLP(H, inner, dtype=dtype, rngs=rngs)
        self.dtype = dtype

    def __call__(self, x):
        logits = self.router(x)  # [B, T, E]
        E = logits.shape[-1]
        _, idx = jax.lax.top_k(logits, self.top_k)
        chosen = jnp.sum(jax.nn.one_hot(idx, E, dtype=jnp.int32), axis=-2) > 0
        scores = jnp.where(chosen, jax.nn.sigmoid(logits.astype(jnp.float32)), 0.0)
        routed = x[None] * jnp.moveaxis(scores, -1, 0)[..., None].astype(x.dtype)  # [E,B,T,H]
        gu = jnp.einsum("ebth,ehf->ebtf", routed, self.gate_up_proj[...].astype(x.dtype))
        gate, up = jnp.split(gu, 2, axis=-1)
        out = jnp.einsum("ebtf,efh->bth", up * jax.nn.silu(gate),
                         self.down_proj[...].astype(x.dtype))
        return self.shared_expert(x) + out


class Llama4Block(nnx.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + ffn(norm(x))`` (MoE or MLP)."""

    def __init__(self, config: Llama4Config, layer: int, *, dtype, rngs: nnx.Rngs):
        c = config
        self.input_layernorm = _rms_norm(c.hidden_size, c, dtype, rngs)
        self.self_attn = Llama4Attention(c, layer, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = _rms_norm(c.hidden_size, c, dtype, rngs)
        self.feed_forward = (Llama4MoE(c, dtype=dtype, rngs=rngs) if layer in c.moe_layers else
                             Llama4MLP(c.hidden_size, c.intermediate_size_mlp, dtype=dtype,
                                       rngs=rngs))

    def __call__(self, x, **kw):
        x = x + self.self_attn(self.input_layernorm(x), **kw)
        return x + self.feed_forward(self.post_attention_layernorm(x))


class Llama4ForCausalLM(common.CachedDecoderMixin, nnx.Module):
    """Llama 4 text decoder with a language-model head.

    Args:
      config: :class:`Llama4Config` (``Llama4Config.from_hf(hf_text_config)``).
      dtype: computation dtype of the layers (parameters stay float32).
      angle_precision: RoPE angles, ``"float32"`` as HF or ``"high"``.
      rngs: initialisation randomness (the converter overwrites every parameter).

    Raises:
      ValueError: ``num_attention_heads`` not a multiple of ``num_key_value_heads``; bad
        rope settings.
    """

    def __init__(self, config: Llama4Config, *, dtype=jnp.float32, angle_precision="float32",
                 rngs: nnx.Rngs):
        c = config
        common.check_head_groups(c)
        self.config = c
        self.angle_precision = angle_precision
        position_schemes(c, angle_precision=angle_precision)  # validate the rope settings now
        self.embed_tokens = nnx.Embed(c.vocab_size, c.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([Llama4Block(c, i, dtype=dtype, rngs=rngs)
                                for i in range(c.num_hidden_layers)])
        self.norm = _rms_norm(c.hidden_size, c, dtype, rngs)
        self.lm_head = (None if c.tie_word_embeddings else
                        nnx.Linear(c.hidden_size, c.vocab_size, use_bias=False, dtype=dtype,
                                   rngs=rngs))

    def __call__(self, input_ids, *, attention_mask=None, positions=None, cache=None,
                 implementation=None, block_q=None, block_k=None,
                 attention_chunk_size: int | None = None, temperature_tuning: bool = True):
        """Logits of the next token.

        Args:
          input_ids: int ``[B, T]`` token ids in ``[0, vocab_size)``.
          attention_mask: 0/1 ``[B, T]``, 0 for (left) padding. Default: all real.
          positions: int ``[B, T]``; default ``cumsum(attention_mask) - 1`` (plus the
            tokens already in ``cache``), as HF's ``generate`` uses. NoPE layers use the
            slot index instead (see the module docstring).
          cache: the tuple of layer caches from :meth:`init_cache` (dense, StreamingLLM or
            paged: :class:`jaxpos.serving.ModuleDecoder` serves the model), or ``None``.
            Every layer keeps all its slots; the chunk mask hides what HF's chunked cache
            drops.
          implementation, block_q, block_k: passed to :func:`jaxpos.attention` (with both
            block sizes, chunked layers get a :class:`jaxpos.BlockMask` on dense reads).
          attention_chunk_size: overrides the config's (experiments, negative controls);
          temperature_tuning: ``False`` drops the NoPE layers' temperature (a control).

        Returns:
          ``(logits [B, T, vocab_size] float32, cache)``; logits at padding positions are
          meaningless; a traced call that overflows the cache gives NaN logits.

        Raises:
          ValueError / TypeError: bad ids, mask shape, a full cache, bad implementation or
            chunk size.
        """
        c = self.config
        emb = self.embed_tokens.embedding[...]
        x = common.embed_tokens(emb, input_ids)
        call = common.DecoderCall(input_ids, attention_mask=attention_mask, positions=positions,
                                  cache=cache, num_layers=c.num_hidden_layers,
                                  implementation=implementation, block_q=block_q,
                                  block_k=block_k)
        chunk = c.attention_chunk_size if attention_chunk_size is None else attention_chunk_size
        chunked = common.ChunkedAttentionMask(chunk) if chunk is not None else None
        schemes = position_schemes(c, angle_precision=self.angle_precision)
        for i, layer in enumerate(self.layers):
            scheme = schemes[i]
            if not temperature_tuning and isinstance(scheme, TemperatureTunedNoPE):
                scheme = jaxpos.NoPE()
            mask_mod = chunked if c.layer_types[i] == "chunked_attention" else None
            x = layer(x, scheme=scheme, call=call, layer=i, mask_mod=mask_mod)
        x = self.norm(x)
        return call.finish(x @ emb.T.astype(x.dtype) if self.lm_head is None else self.lm_head(x))


def param_mapping(config: Llama4Config) -> dict:
    """``{nnx path: (HF key, transform)}`` for ``Llama4ForCausalLM`` checkpoints. On a RoPE
    layer the ``q_proj`` / ``k_proj`` weights (and biases) are permuted from the interleaved
    to the half layout per head (:func:`jaxpos.interleaved_to_half`; see
    :func:`position_schemes`)."""
    np_ = common.to_numpy
    rotary = _rope_rotary_dims(config)
    H = config.head_dim

    def to_half(transform, r):
        return lambda w: jaxpos.interleaved_to_half(transform(w), head_dim=H, rotary_dim=r,
                                                    axis=-1)
    m = {("embed_tokens", "embedding"): ("model.embed_tokens.weight", np_),
         ("norm", "scale"): ("model.norm.weight", np_)}
    if not config.tie_word_embeddings:
        m[("lm_head", "kernel")] = ("lm_head.weight", common.linear_kernel)
    for i in range(config.num_hidden_layers):
        hf = f"model.layers.{i}."
        for name in ("input_layernorm", "post_attention_layernorm"):
            m[("layers", i, name, "scale")] = (f"{hf}{name}.weight", np_)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            permute = rotary[i] is not None and name in ("q_proj", "k_proj")
            kernel, bias = ((to_half(common.linear_kernel, rotary[i]), to_half(np_, rotary[i]))
                            if permute else (common.linear_kernel, np_))
            m[("layers", i, "self_attn", name, "kernel")] = (f"{hf}self_attn.{name}.weight",
                                                             kernel)
            if config.attention_bias:
                m[("layers", i, "self_attn", name, "bias")] = (f"{hf}self_attn.{name}.bias", bias)
        ff = ("layers", i, "feed_forward")
        mlp_prefix, mlp_path = f"{hf}feed_forward.", ff
        if i in config.moe_layers:
            m[ff + ("router", "kernel")] = (f"{hf}feed_forward.router.weight", common.linear_kernel)
            m[ff + ("gate_up_proj",)] = (f"{hf}feed_forward.experts.gate_up_proj", np_)
            m[ff + ("down_proj",)] = (f"{hf}feed_forward.experts.down_proj", np_)
            mlp_prefix, mlp_path = f"{hf}feed_forward.shared_expert.", ff + ("shared_expert",)
        for name in ("gate_proj", "up_proj", "down_proj"):
            m[mlp_path + (name, "kernel")] = (f"{mlp_prefix}{name}.weight", common.linear_kernel)
    return m


def from_hf(state_dict, hf_config, *, dtype=jnp.float32,
            angle_precision: str = "float32") -> Llama4ForCausalLM:
    """Build a :class:`Llama4ForCausalLM` holding the weights of an HF PyTorch checkpoint.

    Args:
      state_dict: ``transformers.Llama4ForCausalLM(...).state_dict()`` (torch tensors).
      hf_config: its ``transformers.Llama4TextConfig``.
      dtype: computation dtype; angle_precision: ``"float32"`` (HF) or ``"high"``.

    Raises:
      ValueError: a missing or unexpected key or a shape mismatch
        (:func:`examples.models.common.load_params`); an unsupported config (see
        :meth:`Llama4Config.from_hf`).
    """
    config = Llama4Config.from_hf(hf_config)
    model = nnx.eval_shape(lambda: Llama4ForCausalLM(
        config, dtype=dtype, angle_precision=angle_precision, rngs=nnx.Rngs(0)))
    ignore = lambda k: k.endswith("rotary_emb.inv_freq") or (
        config.tie_word_embeddings and k == "lm_head.weight")
    return common.load_params(model, state_dict, param_mapping(config), ignore=ignore)
