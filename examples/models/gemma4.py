"""A Gemma 4 (text) decoder in Flax NNX on :func:`jaxpos.attention`, with a converter from
a Hugging Face ``Gemma4ForCausalLM`` state dict: the dense text stack, full pass only.

Architecture (transformers' ``modeling_gemma4.py``, the reference implementation): Gemma
3's interleaved local and global layers (``layer_types``: five ``"sliding_attention"``
layers per ``"full_attention"`` one by default) with

* **per-layer-type heads**: the global layers' heads are ``global_head_dim`` wide (512
  by default, transformers' ``per_layer_config``) where the local ones are ``head_dim``
  (256); with ``attention_k_eq_v`` the global layers have ``num_global_key_value_heads``
  key heads and no value projection: the values are the key projection, before its norm
  and rotation;
* **per-layer-type RoPE**: default RoPE (base 1e4) on the local layers, proportional
  RoPE (p-RoPE: the first quarter of the frequencies, base 1e6, spaced for the full head)
  on the global ones, read by :func:`jaxpos.hf.rope_per_layer_from_hf_config`;
* **QK-norm and V-norm** (RMSNorm over each head; the value norm has no weight) and no
  softmax scale (``scaling = 1``);
* RMSNorm ``x * (mean(x^2) + eps) ** -0.5 * w`` in float32 (``w`` itself, not Gemma 3's
  ``1 + w``), sandwich norms, a GeGLU MLP (tanh GELU), a per-layer ``layer_scalar``
  multiplying each block's output, embeddings scaled by ``sqrt(hidden_size)`` and tied to
  the head, final logit soft-capping when configured.

Refused (``ValueError``): per-layer embeddings (``hidden_size_per_layer_input > 0``, the
E2B/E4B models), the MoE block, KV-shared layers, bidirectional attention. No KV cache:
a full-pass example (the library caches are one per layer, so the layers' different key
widths would fit them; decoding is not wired here).

Example::

    hf = transformers.Gemma4ForCausalLM(hf_text_config)
    model = from_hf(hf.state_dict(), hf_text_config)
    logits = model(input_ids, attention_mask=mask)
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

__all__ = ["Gemma4Config", "Gemma4ForCausalLM", "from_hf", "position_schemes"]


@dataclasses.dataclass(frozen=True)
class Gemma4Config:
    """The fields of HF's ``Gemma4TextConfig`` this model uses, resolved per layer:
    ``head_dims`` / ``kv_heads`` / ``k_eq_v`` hold each layer's own values.

    ``hf_dict`` keeps the HF config as a dict for the per-layer RoPE reader.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    layer_types: tuple[str, ...]
    head_dims: tuple[int, ...]
    kv_heads: tuple[int, ...]
    k_eq_v: tuple[bool, ...]
    sliding_window: int
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True
    hf_dict: Any = dataclasses.field(default=None, compare=False, repr=False)

    @classmethod
    def from_hf(cls, hf_config) -> Gemma4Config:
        """Read a ``transformers.Gemma4TextConfig`` (or its ``to_dict()``; for the
        multimodal ``Gemma4Config`` pass its ``text_config``).

        Raises:
          ValueError: an activation other than tanh GELU; per-layer embeddings, the MoE
            block, KV-shared layers or bidirectional attention; a layer type other than
            full or sliding attention; a non-positive sliding window or soft-cap.
        """
        d = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
        act = d.get("hidden_activation") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"hidden_activation must be 'gelu_pytorch_tanh' (GeGLU with tanh "
                             f"GELU); got {act!r}.")
        for name, off in (("hidden_size_per_layer_input", 0), ("enable_moe_block", False),
                          ("num_kv_shared_layers", 0), ("use_bidirectional_attention", None)):
            if d.get(name) not in (off, None):
                raise ValueError(f"{name}={d[name]!r} is not supported by this port (the "
                                 f"dense text stack); set it to {off!r}.")
        types = tuple(jaxpos.hf.hf_layer_types(d))
        if "chunked_attention" in types:
            raise ValueError(f"layer_types: Gemma 4 has full and sliding attention layers; got "
                             f"{list(types)}.")
        window = d.get("sliding_window")
        if "sliding_attention" in types:
            common.SlidingWindowMask(window)  # validates sliding_window >= 1
        cap = d.get("final_logit_softcapping")
        if cap is not None and not float(cap) > 0:
            raise ValueError(f"final_logit_softcapping must be positive or None; got {cap!r}.")
        heads = int(d["num_attention_heads"])
        if "per_layer_config" in d:
            overrides = {int(k): v or {} for k, v in (d["per_layer_config"] or {}).items()}
        else:  # a config.json from before per_layer_config: HF's config builder
            glob = {"head_dim": d.get("global_head_dim") or 512}
            if d.get("attention_k_eq_v") and d.get("num_global_key_value_heads"):
                glob["num_key_value_heads"] = d["num_global_key_value_heads"]
            overrides = {i: glob for i, t in enumerate(types) if t == "full_attention"}
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        head_dims, kv_heads = [], []
        for i in range(len(types)):
            o = overrides.get(i, {})
            head_dims.append(int(o.get("head_dim", head_dim)))
            kv_heads.append(int(o.get("num_key_value_heads",
                                      d.get("num_key_value_heads") or heads)))
        k_eq_v = tuple(bool(d.get("attention_k_eq_v")) and t != "sliding_attention"
                       for t in types)
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=len(types),
            num_attention_heads=heads, layer_types=types, head_dims=tuple(head_dims),
            kv_heads=tuple(kv_heads), k_eq_v=k_eq_v, sliding_window=window,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            attention_bias=bool(d.get("attention_bias", False)),
            final_logit_softcapping=cap,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", True)), hf_dict=d)


def position_schemes(config: Gemma4Config, *, angle_precision: str = "float32") -> list:
    """One :class:`jaxpos.RoPE` per layer (:func:`jaxpos.hf.rope_per_layer_from_hf_config`):
    each spans its layer's own head width.

    Raises:
      ValueError: an unknown ``rope_type`` or layer type.
    """
    return jaxpos.hf.rope_per_layer_from_hf_config(config.hf_dict,
                                                   angle_precision=angle_precision)


class Gemma4RMSNorm(nnx.Module):
    """``x * (mean(x^2) + eps) ** -0.5 * weight`` in float32, cast back (HF
    ``Gemma4RMSNorm``); ``with_scale=False`` has no weight (the value norm)."""

    def __init__(self, width: int, *, eps: float, with_scale: bool = True):
        self.weight = nnx.Param(jnp.ones((width,), jnp.float32)) if with_scale else None
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        y = xf * jnp.power(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps, -0.5)
        if self.weight is not None:
            y = y * self.weight[...].astype(jnp.float32)
        return y.astype(x.dtype)


class Gemma4Attention(nnx.Module):
    """Grouped-query attention of one layer: its own head width and key heads, QK-norm and
    V-norm, the layer's RoPE and mask applied by jaxpos, no softmax scale."""

    def __init__(self, config: Gemma4Config, layer: int, *, dtype, rngs: nnx.Rngs):
        c = config
        self.num_heads, self.kv_heads = c.num_attention_heads, c.kv_heads[layer]
        self.head_dim, self.k_eq_v = c.head_dims[layer], c.k_eq_v[layer]
        if self.num_heads % self.kv_heads:
            raise ValueError(f"layer {layer}: num_attention_heads ({self.num_heads}) must be "
                             f"a multiple of its key/value heads ({self.kv_heads}).")
        lin = lambda i, o: nnx.Linear(i, o, use_bias=c.attention_bias, dtype=dtype, rngs=rngs)
        H = self.head_dim
        self.q_proj = lin(c.hidden_size, self.num_heads * H)
        self.k_proj = lin(c.hidden_size, self.kv_heads * H)
        self.v_proj = None if self.k_eq_v else lin(c.hidden_size, self.kv_heads * H)
        self.o_proj = lin(self.num_heads * H, c.hidden_size)
        self.q_norm = Gemma4RMSNorm(H, eps=c.rms_norm_eps)
        self.k_norm = Gemma4RMSNorm(H, eps=c.rms_norm_eps)
        self.v_norm = Gemma4RMSNorm(H, eps=c.rms_norm_eps, with_scale=False)

    def __call__(self, x, *, rope, positions, segments, kv_segments, attn_kw):
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, T, self.num_heads, self.head_dim))
        k_raw = self.k_proj(x).reshape(B, T, self.kv_heads, self.head_dim)
        v_raw = k_raw if self.v_proj is None else self.v_proj(x).reshape(k_raw.shape)
        k, v = self.k_norm(k_raw), self.v_norm(v_raw)
        out = jaxpos.attention(q, k, v, position=rope, q_positions=positions,
                               kv_positions=positions, causal=True, segment_ids=segments,
                               kv_segment_ids=kv_segments, scale=1.0, **attn_kw)
        return self.o_proj(out.reshape(B, T, -1))


class Gemma4MLP(nnx.Module):
    """GeGLU: ``down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, config: Gemma4Config, *, dtype, rngs: nnx.Rngs):
        c = config
        lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, rngs=rngs)
        self.gate_proj = lin(c.hidden_size, c.intermediate_size)
        self.up_proj = lin(c.hidden_size, c.intermediate_size)
        self.down_proj = lin(c.intermediate_size, c.hidden_size)

    def __call__(self, x):
        return self.down_proj(jax.nn.gelu(self.gate_proj(x), approximate=True) * self.up_proj(x))


class Gemma4Block(nnx.Module):
    """Gemma 3's sandwich block, its output multiplied by ``layer_scalar``."""

    def __init__(self, config: Gemma4Config, layer: int, *, dtype, rngs: nnx.Rngs):
        c = config
        norm = lambda: Gemma4RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.input_layernorm = norm()
        self.self_attn = Gemma4Attention(c, layer, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = Gemma4MLP(c, dtype=dtype, rngs=rngs)
        self.post_feedforward_layernorm = norm()
        self.layer_scalar = nnx.Param(jnp.ones((1,), jnp.float32))

    def __call__(self, x, **kw):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), **kw))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x * self.layer_scalar[...].astype(x.dtype)


class Gemma4ForCausalLM(nnx.Module):
    """Gemma 4 text decoder (dense, no per-layer embeddings) with a language-model head.

    Args:
      config: :class:`Gemma4Config` (``Gemma4Config.from_hf(hf_text_config)``).
      dtype: computation dtype of the layers (parameters stay float32).
      angle_precision: RoPE angles, ``"float32"`` as HF or ``"high"``.
      rngs: initialisation randomness (the converter overwrites every parameter).

    Raises:
      ValueError: a layer whose key heads do not divide the query heads; bad rope settings.
    """

    def __init__(self, config: Gemma4Config, *, dtype=jnp.float32, angle_precision="float32",
                 rngs: nnx.Rngs):
        c = config
        self.config = c
        self.angle_precision = angle_precision
        position_schemes(c, angle_precision=angle_precision)  # validate the rope settings now
        self.embed_tokens = nnx.Embed(c.vocab_size, c.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([Gemma4Block(c, i, dtype=dtype, rngs=rngs)
                                for i in range(c.num_hidden_layers)])
        self.norm = Gemma4RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.lm_head = (None if c.tie_word_embeddings else
                        nnx.Linear(c.hidden_size, c.vocab_size, use_bias=False, dtype=dtype,
                                   rngs=rngs))

    def __call__(self, input_ids, *, attention_mask=None, positions=None, implementation=None,
                 block_q=None, block_k=None, sliding_window: int | None = None):
        """Logits of the next token (a full pass).

        Args:
          input_ids: int ``[B, T]`` token ids in ``[0, vocab_size)``.
          attention_mask: 0/1 ``[B, T]``, 0 for (left) padding. Default: all real.
          positions: int ``[B, T]``; default ``cumsum(attention_mask) - 1``.
          implementation, block_q, block_k: passed to :func:`jaxpos.attention`.
          sliding_window: overrides ``config.sliding_window`` (experiments, controls).

        Returns:
          logits ``[B, T, vocab_size]`` float32 (meaningless at padding positions).

        Raises:
          ValueError / TypeError: bad ids, mask shape, implementation or sliding window.
        """
        c = self.config
        emb = self.embed_tokens.embedding[...]
        x = common.embed_tokens(emb, input_ids)
        x = x * jnp.asarray(c.hidden_size ** 0.5, emb.dtype).astype(x.dtype)
        B, T = input_ids.shape
        mask = common.check_attention_mask(attention_mask, B, T)
        mask = jnp.ones((B, T), jnp.int32) if mask is None else mask
        if positions is None:
            positions = common.padding_positions(mask)
        positions = jnp.asarray(positions, jnp.int32)
        segments = common.query_segments(B, T)
        kv_segments = common.key_segments(mask, B, T)
        window = c.sliding_window if sliding_window is None else sliding_window
        masks = {t: common.mask_kwargs(
            common.SlidingWindowMask(window) if t == "sliding_attention" else None,
            q_positions=positions, kv_positions=positions, implementation=implementation,
            block_q=block_q, block_k=block_k) for t in set(c.layer_types)}
        ropes = position_schemes(c, angle_precision=self.angle_precision)
        for i, layer in enumerate(self.layers):
            attn_kw = {"implementation": implementation, **masks[c.layer_types[i]]}
            x = layer(x, rope=ropes[i], positions=positions, segments=segments,
                      kv_segments=kv_segments, attn_kw=attn_kw)
        x = self.norm(x)
        logits = x @ emb.T.astype(x.dtype) if self.lm_head is None else self.lm_head(x)
        logits = logits.astype(jnp.float32)
        if c.final_logit_softcapping is not None:
            cap = float(c.final_logit_softcapping)
            logits = jnp.tanh(logits / cap) * cap
        return logits


def param_mapping(config: Gemma4Config) -> dict:
    """``{nnx path: (HF key, transform)}`` for ``Gemma4ForCausalLM`` checkpoints."""
    m = {("embed_tokens", "embedding"): ("model.embed_tokens.weight", common.to_numpy),
         ("norm", "weight"): ("model.norm.weight", common.to_numpy)}
    if not config.tie_word_embeddings:
        m[("lm_head", "kernel")] = ("lm_head.weight", common.linear_kernel)
    for i in range(config.num_hidden_layers):
        hf = f"model.layers.{i}."
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            m[("layers", i, name, "weight")] = (f"{hf}{name}.weight", common.to_numpy)
        m[("layers", i, "layer_scalar")] = (f"{hf}layer_scalar", common.to_numpy)
        for name in ("q_norm", "k_norm"):
            m[("layers", i, "self_attn", name, "weight")] = (f"{hf}self_attn.{name}.weight",
                                                             common.to_numpy)
        projs = ("q_proj", "k_proj", "o_proj") + (() if config.k_eq_v[i] else ("v_proj",))
        for name in projs:
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
            angle_precision: str = "float32") -> Gemma4ForCausalLM:
    """Build a :class:`Gemma4ForCausalLM` holding the weights of an HF PyTorch checkpoint.

    Args:
      state_dict: ``transformers.Gemma4ForCausalLM(...).state_dict()`` (torch tensors).
      hf_config: its ``transformers.Gemma4TextConfig``.
      dtype: computation dtype; angle_precision: ``"float32"`` (HF) or ``"high"``.

    Raises:
      ValueError: a missing or unexpected key or a shape mismatch
        (:func:`examples.models.common.load_params`); an unsupported config (see
        :meth:`Gemma4Config.from_hf`).
    """
    config = Gemma4Config.from_hf(hf_config)
    model = nnx.eval_shape(lambda: Gemma4ForCausalLM(
        config, dtype=dtype, angle_precision=angle_precision, rngs=nnx.Rngs(0)))
    ignore = lambda k: ("rotary_emb" in k and "inv_freq" in k) or k.endswith(
        "embed_scale") or (config.tie_word_embeddings and k == "lm_head.weight")
    return common.load_params(model, state_dict, param_mapping(config), ignore=ignore)
