"""DeepSeek-V3 in Flax NNX on :func:`jaxpos.attention`, with a converter from a Hugging Face
``DeepseekV3ForCausalLM`` state dict.

Architecture (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", §2.1; HF
``modeling_deepseek_v3.py``):

* **multi-head latent attention** (MLA; DeepSeek-V2 §2.1.2-2.1.3): queries through a
  low-rank bottleneck (``q_a_proj`` -> RMSNorm -> ``q_b_proj``, or one ``q_proj`` when
  ``q_lora_rank`` is None), split per head into ``qk_nope_head_dim`` features without
  position and ``qk_rope_head_dim`` rotary ones; keys and values from a latent
  ``c^KV = RMSNorm(W^{DKV} h)`` of ``kv_lora_rank`` features up-projected per head
  (``kv_b_proj`` -> ``[k_nope | v]``, ``v_head_dim`` wide), plus **one** rotary key head
  ``k^R = W^{KR} h`` shared by all heads (decoupled RoPE). :mod:`jaxpos.schemes.mla` assembles
  ``[rope | nope]`` queries and keys and :func:`jaxpos.attention` rotates the rope part
  (interleaved layout, YaRN) at each token's position;
* softmax scale ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5 * mscale**2`` with YaRN's
  ``mscale_all_dim`` (:func:`jaxpos.schemes.mla.mla_softmax_scale`);
* the first ``first_k_dense_replace`` layers have a SwiGLU MLP, the rest a mixture of
  experts (§2.1.2 "DeepSeekMoE": sigmoid affinities, a bias added for the choice only,
  ``n_group`` groups of experts of which ``topk_group`` are kept by the sum of their two
  best scores, top-``num_experts_per_tok`` experts, weights normalised and multiplied by
  ``routed_scaling_factor``, plus ``n_shared_experts`` always-on experts).

The KV cache holds what MLA was designed to cache: the normalised latent ``c^KV`` and the
**unrotated** shared rope key per token (``kv_lora_rank + qk_rope_head_dim`` numbers per
token and layer instead of ``2 * N * head_dim``); every call up-projects the latents it
reads and jaxpos rotates the rope keys from the cached positions. The caches are the
library's (:mod:`jaxpos.layers.cache`: dense, StreamingLLM, paged, through the cache
protocol), so :class:`jaxpos.serving.ModuleDecoder` serves the port: a library cache holds
keys and values of one head width, so each layer's cache has one KV head of
``W = ceil((kv_lora_rank + qk_rope_head_dim) / 2)`` numbers and a token's ``[c^KV | k^R]``
is stored split in two, ``W`` as its key and ``W`` as its value (:func:`pack_latent`;
stored as given: the scheme of the write is :class:`jaxpos.NoPE`). A call reads its rows of
slots (a paged cache's pages gathered, :meth:`jaxpos.layers.cache.CacheRead.unpaged`),
up-projects them and runs :func:`jaxpos.mla_attention`; a ragged step is refused, since it
hands packed rows that this up-projection does not take (the serving loop's token budget
runs the port in padded steps instead).

Example::

    hf = transformers.DeepseekV3ForCausalLM(hf_config)
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
from jaxpos.core.engines import takes_kv_lengths
from jaxpos.schemes import mla

__all__ = ["DeepseekV3Config", "DeepseekV3ForCausalLM", "from_hf", "latent_width",
           "pack_latent", "param_mapping", "rope_from_config", "softmax_scale",
           "unpack_latent"]


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config:
    """The fields of HF's ``DeepseekV3Config`` this model uses (same names and meaning).

    Raises:
      ValueError: ``num_key_value_heads`` different from ``num_attention_heads`` (MLA
        up-projects one key and value per query head), experts or groups that do not
        divide, a non-positive size.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 0
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_parameters: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                     "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                     "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                     "num_experts_per_tok", "n_group", "topk_group"):
            _checks.check_positive_int(name, getattr(self, name))
        for name in ("qk_nope_head_dim", "n_shared_experts", "first_k_dense_replace"):
            _checks.check_nonneg_int(name, getattr(self, name))
        if self.q_lora_rank is not None:
            _checks.check_positive_int("q_lora_rank", self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (RoPE rotates pairs); got "
                             f"{self.qk_rope_head_dim}.")
        if self.n_routed_experts % self.n_group:
            raise ValueError(f"n_routed_experts ({self.n_routed_experts}) must be a multiple of "
                             f"n_group ({self.n_group}).")
        per_group = self.n_routed_experts // self.n_group
        if per_group < 2:
            raise ValueError(f"each of the n_group={self.n_group} expert groups needs >= 2 "
                             f"experts (groups are ranked by their two best scores); got "
                             f"{per_group}.")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) must be <= n_group ({self.n_group}).")
        if self.num_experts_per_tok > self.topk_group * per_group:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= the "
                             f"experts of the kept groups, topk_group * n_routed_experts / "
                             f"n_group = {self.topk_group * per_group}.")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, hf_config) -> DeepseekV3Config:
        """Read a ``transformers.DeepseekV3Config``.

        Raises:
          ValueError: ``hidden_act`` other than ``"silu"``; ``num_key_value_heads`` not
            equal to ``num_attention_heads``; the errors of the constructor.
        """
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act must be 'silu' (SwiGLU experts); got {act!r}.")
        heads = hf_config.num_attention_heads
        kv = getattr(hf_config, "num_key_value_heads", None) or heads
        if kv != heads:
            raise ValueError(f"num_key_value_heads must equal num_attention_heads ({heads}) for "
                             f"MLA (kv_b_proj makes one key and value per query head); got {kv}.")
        rope = dict(getattr(hf_config, "rope_parameters", None) or {})
        if not rope:
            rope = dict(getattr(hf_config, "rope_scaling", None) or {})
            rope.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        rope.setdefault("rope_type", rope.pop("type", "default"))
        get = lambda name, default: (default if getattr(hf_config, name, None) is None
                                     else getattr(hf_config, name))
        return cls(
            vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            moe_intermediate_size=hf_config.moe_intermediate_size,
            num_hidden_layers=hf_config.num_hidden_layers, num_attention_heads=heads,
            kv_lora_rank=hf_config.kv_lora_rank, q_lora_rank=hf_config.q_lora_rank,
            qk_rope_head_dim=hf_config.qk_rope_head_dim,
            qk_nope_head_dim=hf_config.qk_nope_head_dim, v_head_dim=hf_config.v_head_dim,
            n_routed_experts=hf_config.n_routed_experts,
            num_experts_per_tok=hf_config.num_experts_per_tok,
            n_shared_experts=get("n_shared_experts", 0), n_group=get("n_group", 1),
            topk_group=get("topk_group", 1),
            first_k_dense_replace=get("first_k_dense_replace", 0),
            routed_scaling_factor=float(hf_config.routed_scaling_factor),
            norm_topk_prob=bool(hf_config.norm_topk_prob), rms_norm_eps=hf_config.rms_norm_eps,
            rope_parameters=rope, rope_interleave=bool(get("rope_interleave", True)),
            attention_bias=bool(hf_config.attention_bias),
            tie_word_embeddings=bool(hf_config.tie_word_embeddings),
            max_position_embeddings=getattr(hf_config, "max_position_embeddings", None))


def _hf_dict(config: DeepseekV3Config) -> dict:
    return {"model_type": "deepseek_v3", "rope_parameters": dict(config.rope_parameters),
            "qk_rope_head_dim": config.qk_rope_head_dim,
            "qk_nope_head_dim": config.qk_nope_head_dim,
            "rope_interleave": config.rope_interleave,
            "hidden_size": config.hidden_size, "num_attention_heads": config.num_attention_heads,
            "max_position_embeddings": config.max_position_embeddings}


def rope_from_config(config: DeepseekV3Config, *, angle_precision: str = "float32",
                     layout: str | None = None) -> jaxpos.RoPE:
    """The :class:`jaxpos.RoPE` of the rope part of each head: ``rotary_dim =
    qk_rope_head_dim``, ``"interleaved"`` layout when ``rope_interleave`` (HF's default for
    DeepSeek; ``"half"`` otherwise), YaRN frequencies and ``attention_factor`` =
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` read by
    :func:`jaxpos.hf.rope_from_hf_config`.

    Args:
      angle_precision: ``"float32"`` (HF's numbers) or ``"high"``.
      layout: override the layout (a negative control); default from the config.

    Raises:
      ValueError: an unknown ``rope_type`` or a scaling dict missing its keys.
    """
    rope = jaxpos.hf.rope_from_hf_config(_hf_dict(config), angle_precision=angle_precision)
    if layout is not None and layout != rope.layout:
        rope = jaxpos.RoPE(rope.inv_freq, layout=layout, attention_factor=rope.attention_factor,
                           angle_precision=angle_precision)
    return rope


def softmax_scale(config: DeepseekV3Config) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN
    (:func:`jaxpos.schemes.mla.mla_softmax_scale`; HF's ``yarn_apply_mscale``)."""
    return mla.mla_softmax_scale(config.qk_nope_head_dim, config.qk_rope_head_dim,
                                 rope_parameters=dict(config.rope_parameters))


def _rms(width, eps, dtype, rngs):
    return nnx.RMSNorm(width, epsilon=eps, use_fast_variance=False, dtype=dtype, rngs=rngs)


class DeepseekV3Attention(nnx.Module):
    """Multi-head latent attention with decoupled RoPE (module docstring)."""

    def __init__(self, config: DeepseekV3Config, *, dtype, rngs: nnx.Rngs):
        c = config
        self.c = c
        lin = lambda i, o, bias=False: nnx.Linear(i, o, use_bias=bias, dtype=dtype, rngs=rngs)
        N = c.num_attention_heads
        if c.q_lora_rank is None:
            self.q_proj = lin(c.hidden_size, N * c.qk_head_dim)
        else:
            self.q_a_proj = lin(c.hidden_size, c.q_lora_rank, c.attention_bias)
            self.q_a_layernorm = _rms(c.q_lora_rank, 1e-6, dtype, rngs)  # HF: default eps
            self.q_b_proj = lin(c.q_lora_rank, N * c.qk_head_dim)
        self.kv_a_proj_with_mqa = lin(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim,
                                      c.attention_bias)
        self.kv_a_layernorm = _rms(c.kv_lora_rank, 1e-6, dtype, rngs)
        self.kv_b_proj = lin(c.kv_lora_rank, N * (c.qk_nope_head_dim + c.v_head_dim))
        self.o_proj = lin(N * c.v_head_dim, c.hidden_size, c.attention_bias)

    def __call__(self, x, *, rope, scale, call: common.DecoderCall, layer: int, attn_kw):
        c = self.c
        B, T, _ = x.shape
        N = c.num_attention_heads
        if c.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = mla.split_nope_rope(q.reshape(B, T, N, c.qk_head_dim),
                                             c.qk_nope_head_dim, c.qk_rope_head_dim)
        ckv = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(ckv[..., :c.kv_lora_rank])
        k_rope = ckv[..., c.kv_lora_rank:]  # [B, T, Dr], one head, unrotated
        if call.cache is None:
            where = {"q_positions": call.positions, "kv_positions": call.positions,
                     "segment_ids": common.query_segments(B, T),
                     "kv_segment_ids": common.key_segments(call.mask, B, T)}
        else:  # cache the latent and the rope key, as MLA is designed to
            k_half, v_half = pack_latent(latent, k_rope)
            read = call.write(layer, jaxpos.NoPE(), q_rope, k_half, v_half)
            if read.cu_q_lengths is not None:
                raise ValueError("DeepSeek-V3's latent attention up-projects each row's "
                                 "cached latents, which a ragged step (packed rows) does not "
                                 "hand it; a token-budget ServingEngine runs this model in "
                                 "padded steps.")
            read = read.unpaged()  # rows of slots [B, S, 1, W] (a paged cache's gathered)
            latent, k_rope = unpack_latent(read.k.astype(x.dtype), read.v.astype(x.dtype),
                                           c.kv_lora_rank, c.qk_rope_head_dim)
            where = {"q_positions": read.q_positions, "kv_positions": read.kv_positions,
                     "segment_ids": read.segment_ids, "kv_segment_ids": read.kv_segment_ids}
            if takes_kv_lengths(attn_kw["implementation"]):  # a step costs the filled length
                where["kv_lengths"] = read.kv_lengths
        S = latent.shape[1]
        kv = self.kv_b_proj(latent).reshape(B, S, N, c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = kv[..., :c.qk_nope_head_dim], kv[..., c.qk_nope_head_dim:]
        out = jaxpos.mla_attention(q_nope, q_rope, k_nope, k_rope, v, rope=rope, scale=scale,
                                   causal=True, **where, **attn_kw)
        return self.o_proj(out.reshape(B, T, N * c.v_head_dim))


def latent_width(config: DeepseekV3Config) -> int:
    """``W = ceil((kv_lora_rank + qk_rope_head_dim) / 2)``: the head width of the library
    cache each layer keeps (one KV head, ``W`` key and ``W`` value numbers a token)."""
    return -(-(config.kv_lora_rank + config.qk_rope_head_dim) // 2)


def pack_latent(latent, k_rope) -> tuple[jax.Array, jax.Array]:
    """What one token of MLA's cache holds, as the ``k`` and ``v`` of a library cache
    (:mod:`jaxpos.layers.cache`): ``[c^KV | k^R]`` (``kv_lora_rank + qk_rope_head_dim``
    numbers, a zero appended when odd) cut into two halves of ``W`` numbers
    (:func:`latent_width`). The library caches hold keys and values of one head width;
    storing the latent as ``k`` and the narrower rope key as ``v`` would pad the rope key
    to the latent's width and double MLA's cache, so both halves carry part of each.

    Args:
      latent: ``[B, T, kv_lora_rank]``; k_rope: ``[B, T, qk_rope_head_dim]`` (unrotated).

    Returns:
      ``(k, v)``, each ``[B, T, 1, W]``.
    """
    both = jnp.concatenate([latent, k_rope.astype(latent.dtype)], axis=-1)
    pad = both.shape[-1] % 2
    if pad:
        both = jnp.pad(both, [(0, 0)] * (both.ndim - 1) + [(0, 1)])
    k, v = jnp.split(both, 2, axis=-1)
    return k[:, :, None], v[:, :, None]


def unpack_latent(k, v, kv_lora_rank: int, qk_rope_head_dim: int
                  ) -> tuple[jax.Array, jax.Array]:
    """The inverse of :func:`pack_latent`: ``k``, ``v`` ``[B, S, 1, W]`` ->
    ``(latent [B, S, kv_lora_rank], k_rope [B, S, qk_rope_head_dim])``."""
    both = jnp.concatenate([k[:, :, 0], v[:, :, 0]], axis=-1)
    return both[..., :kv_lora_rank], both[..., kv_lora_rank:kv_lora_rank + qk_rope_head_dim]


class DeepseekV3MLP(nnx.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, hidden: int, inner: int, *, dtype, rngs: nnx.Rngs):
        lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, rngs=rngs)
        self.gate_proj, self.up_proj, self.down_proj = (lin(hidden, inner), lin(hidden, inner),
                                                        lin(inner, hidden))

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def route(logits, bias, *, n_group: int, topk_group: int, top_k: int, norm_topk_prob: bool,
          routed_scaling_factor: float):
    """DeepSeek-V3's router (§2.1.2, with the bias of its "auxiliary-loss-free
    load balancing"; HF's ``DeepseekV3TopkRouter``).

    Args:
      logits: float32 ``[..., E]`` router logits; bias: ``[E]`` (``e_score_correction_bias``).

    Returns:
      float32 ``[..., E]`` combine weights: ``sigmoid(logit)`` of the chosen experts
      (normalised to sum 1 if ``norm_topk_prob``, times ``routed_scaling_factor``), 0 for
      the others. Choice: experts grouped into ``n_group`` groups, the ``topk_group`` groups
      with the largest sum of their two best ``sigmoid + bias`` kept, then the ``top_k``
      best experts of those.
    """
    E = logits.shape[-1]
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores + bias.astype(jnp.float32)
    grouped = choice.reshape(*choice.shape[:-1], n_group, E // n_group)
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [..., G]
    _, keep = jax.lax.top_k(group_scores, topk_group)
    group_mask = jnp.sum(jax.nn.one_hot(keep, n_group, dtype=jnp.bool_), axis=-2) > 0
    expert_mask = jnp.repeat(group_mask, E // n_group, axis=-1)
    _, idx = jax.lax.top_k(jnp.where(expert_mask, choice, -jnp.inf), top_k)
    chosen = jnp.sum(jax.nn.one_hot(idx, E, dtype=jnp.float32), axis=-2)  # [..., E] 0/1
    w = scores * chosen
    if norm_topk_prob:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return w * routed_scaling_factor


class DeepseekV3MoE(nnx.Module):
    """Routed experts (every expert runs on every token: an exact dense formulation for
    small models) plus shared experts."""

    def __init__(self, config: DeepseekV3Config, *, dtype, rngs: nnx.Rngs):
        c = config
        E, D, F = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size
        self.c, self.dtype = c, dtype
        init = nnx.initializers.normal(0.02)
        self.gate = nnx.Param(init(rngs.params(), (E, D), jnp.float32))
        self.e_score_correction_bias = nnx.Param(jnp.zeros((E,), jnp.float32))
        self.gate_up_proj = nnx.Param(init(rngs.params(), (E, 2 * F, D), jnp.float32))
        self.down_proj = nnx.Param(init(rngs.params(), (E, D, F), jnp.float32))
        self.shared_experts = (DeepseekV3MLP(D, F * c.n_shared_experts, dtype=dtype, rngs=rngs)
                               if c.n_shared_experts else None)

    def __call__(self, x):
        c = self.c
        logits = x.astype(jnp.float32) @ self.gate[...].T
        combine = route(logits, self.e_score_correction_bias[...], n_group=c.n_group,
                        topk_group=c.topk_group, top_k=c.num_experts_per_tok,
                        norm_topk_prob=c.norm_topk_prob,
                        routed_scaling_factor=c.routed_scaling_factor)
        dt = self.dtype
        gu = jnp.einsum("btd,efd->btef", x, self.gate_up_proj[...].astype(dt))
        F = c.moe_intermediate_size
        h = jax.nn.silu(gu[..., :F]) * gu[..., F:]
        out = jnp.einsum("btef,edf->bted", h, self.down_proj[...].astype(dt))
        y = jnp.einsum("bted,bte->btd", out, combine.astype(out.dtype))
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y


class DeepseekV3Block(nnx.Module):
    """Pre-norm block: ``x + mla(norm(x))``, then ``x + mlp_or_moe(norm(x))``."""

    def __init__(self, config: DeepseekV3Config, layer: int, *, dtype, rngs: nnx.Rngs):
        c = config
        self.input_layernorm = _rms(c.hidden_size, c.rms_norm_eps, dtype, rngs)
        self.self_attn = DeepseekV3Attention(c, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = _rms(c.hidden_size, c.rms_norm_eps, dtype, rngs)
        self.mlp = (DeepseekV3MLP(c.hidden_size, c.intermediate_size, dtype=dtype, rngs=rngs)
                    if layer < c.first_k_dense_replace else
                    DeepseekV3MoE(c, dtype=dtype, rngs=rngs))

    def __call__(self, x, **kw):
        x = x + self.self_attn(self.input_layernorm(x), **kw)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV3ForCausalLM(common.CachedDecoderMixin, nnx.Module):
    """DeepSeek-V3 decoder with a language-model head (no multi-token-prediction module:
    HF's ``DeepseekV3ForCausalLM`` has none either).

    Args:
      config: :class:`DeepseekV3Config` (``DeepseekV3Config.from_hf(hf_config)``).
      dtype: computation dtype of the layers (parameters stay float32).
      angle_precision: RoPE angles, ``"float32"`` as HF or ``"high"``.
      rngs: initialisation randomness (the converter overwrites every parameter).
    """

    def __init__(self, config: DeepseekV3Config, *, dtype=jnp.float32,
                 angle_precision="float32", rngs: nnx.Rngs):
        c = config
        self.config = c
        self.angle_precision = angle_precision
        rope_from_config(c, angle_precision=angle_precision)  # validate the rope settings now
        softmax_scale(c)
        self.embed_tokens = nnx.Embed(c.vocab_size, c.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DeepseekV3Block(c, i, dtype=dtype, rngs=rngs)
                                for i in range(c.num_hidden_layers)])
        self.norm = _rms(c.hidden_size, c.rms_norm_eps, dtype, rngs)
        self.lm_head = (None if c.tie_word_embeddings else
                        nnx.Linear(c.hidden_size, c.vocab_size, use_bias=False, dtype=dtype,
                                   rngs=rngs))

    def cache_layers(self) -> list[tuple[int, int]]:
        """One KV head of :func:`latent_width` numbers per layer: each token's latent
        ``c^KV`` and unrotated rope key ``k^R`` (:func:`pack_latent`), ``kv_lora_rank +
        qk_rope_head_dim`` numbers in all (:meth:`init_cache`: dense, StreamingLLM or
        paged)."""
        return [(1, latent_width(self.config))] * self.config.num_hidden_layers

    def __call__(self, input_ids, *, attention_mask=None, positions=None, cache=None,
                 implementation=None, block_q=None, block_k=None, rope=None, scale=None):
        """Logits of the next token.

        Args:
          input_ids: int ``[B, T]`` token ids in ``[0, vocab_size)``.
          attention_mask: 0/1 ``[B, T]``, 0 for padding (left padding). Default: all real.
          positions: int ``[B, T]``; default ``cumsum(attention_mask) - 1`` (plus the
            tokens already in ``cache``).
          cache: the tuple of layer caches from :meth:`init_cache` (dense, StreamingLLM or
            paged, each holding latents and rope keys: :meth:`cache_layers`;
            :class:`jaxpos.serving.ModuleDecoder` serves the model, in padded steps under
            a token budget),
            or ``None``.
          implementation, block_q, block_k: passed to :func:`jaxpos.attention`.
          rope, scale: override the rotary scheme / softmax scale (experiments and
            negative controls); default :func:`rope_from_config` / :func:`softmax_scale`.

        Returns:
          ``(logits [B, T, vocab_size] float32, cache)``; logits at padding positions are
          meaningless; a traced call that overflows the cache gives NaN logits.

        Raises:
          ValueError / TypeError: bad ids, mask shape, a full cache, bad implementation; a
            ragged step's cache (the loop's ``max_num_batched_tokens``).
        """
        emb = self.embed_tokens.embedding[...]
        x = common.embed_tokens(emb, input_ids)
        call = common.DecoderCall(input_ids, attention_mask=attention_mask, positions=positions,
                                  cache=cache, num_layers=self.config.num_hidden_layers,
                                  implementation=implementation)
        attn_kw = {"implementation": implementation, "block_q": block_q, "block_k": block_k}
        if rope is None:
            rope = rope_from_config(self.config, angle_precision=self.angle_precision)
        if scale is None:
            scale = softmax_scale(self.config)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope=rope, scale=scale, call=call, layer=i, attn_kw=attn_kw)
        x = self.norm(x)
        return call.finish(x @ emb.T.astype(x.dtype) if self.lm_head is None else self.lm_head(x))


def param_mapping(config: DeepseekV3Config) -> dict:
    """``{nnx path: (HF key, transform)}`` for ``DeepseekV3ForCausalLM`` checkpoints."""
    c = config
    m = {("embed_tokens", "embedding"): ("model.embed_tokens.weight", common.to_numpy),
         ("norm", "scale"): ("model.norm.weight", common.to_numpy)}
    if not c.tie_word_embeddings:
        m[("lm_head", "kernel")] = ("lm_head.weight", common.linear_kernel)
    for i in range(c.num_hidden_layers):
        hf = f"model.layers.{i}."
        for name in ("input_layernorm", "post_attention_layernorm"):
            m[("layers", i, name, "scale")] = (f"{hf}{name}.weight", common.to_numpy)
        a = ("layers", i, "self_attn")
        lins = ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
        lins += ["q_proj"] if c.q_lora_rank is None else ["q_a_proj", "q_b_proj"]
        for name in lins:
            m[a + (name, "kernel")] = (f"{hf}self_attn.{name}.weight", common.linear_kernel)
        if c.attention_bias:
            for name in ["kv_a_proj_with_mqa", "o_proj"] + (
                    [] if c.q_lora_rank is None else ["q_a_proj"]):
                m[a + (name, "bias")] = (f"{hf}self_attn.{name}.bias", common.to_numpy)
        norms = ["kv_a_layernorm"] + ([] if c.q_lora_rank is None else ["q_a_layernorm"])
        for name in norms:
            m[a + (name, "scale")] = (f"{hf}self_attn.{name}.weight", common.to_numpy)
        mlp = ("layers", i, "mlp")
        if i < c.first_k_dense_replace:
            for name in ("gate_proj", "up_proj", "down_proj"):
                m[mlp + (name, "kernel")] = (f"{hf}mlp.{name}.weight", common.linear_kernel)
        else:
            m[mlp + ("gate",)] = (f"{hf}mlp.gate.weight", common.to_numpy)
            m[mlp + ("e_score_correction_bias",)] = (f"{hf}mlp.gate.e_score_correction_bias",
                                                     common.to_numpy)
            for name in ("gate_up_proj", "down_proj"):  # HF: [E, out, in], as ours
                m[mlp + (name,)] = (f"{hf}mlp.experts.{name}", common.to_numpy)
            if c.n_shared_experts:
                for name in ("gate_proj", "up_proj", "down_proj"):
                    m[mlp + ("shared_experts", name, "kernel")] = (
                        f"{hf}mlp.shared_experts.{name}.weight", common.linear_kernel)
    return m


def from_hf(state_dict, hf_config, *, dtype=jnp.float32,
            angle_precision: str = "float32") -> DeepseekV3ForCausalLM:
    """Build a :class:`DeepseekV3ForCausalLM` holding the weights of an HF PyTorch checkpoint.

    Args:
      state_dict: ``transformers.DeepseekV3ForCausalLM(...).state_dict()`` (torch tensors;
        the router's ``e_score_correction_bias`` buffer included).
      hf_config: its ``transformers.DeepseekV3Config``.
      dtype: computation dtype; angle_precision: ``"float32"`` (HF's numbers) or ``"high"``.

    Raises:
      ValueError: a missing or unexpected key or a shape mismatch (see
        :func:`examples.models.common.load_params`); a bad config.
    """
    config = DeepseekV3Config.from_hf(hf_config)
    model = nnx.eval_shape(lambda: DeepseekV3ForCausalLM(
        config, dtype=dtype, angle_precision=angle_precision, rngs=nnx.Rngs(0)))
    ignore = lambda k: k.endswith("rotary_emb.inv_freq") or (
        config.tie_word_embeddings and k == "lm_head.weight")
    return common.load_params(model, state_dict, param_mapping(config), ignore=ignore)
