"""BLOOM (BigScience 2022, "BLOOM: A 176B-Parameter Open-Access Multilingual Language
Model", §3.2) in Flax NNX on :func:`jaxpos.attention`, with a converter from a Hugging
Face ``BloomForCausalLM`` state dict.

Positions enter only through ALiBi (Press et al. 2022, §3), the
:class:`jaxpos.nnx.ALiBi` module's :class:`jaxpos.ALiBi` scheme: no positional vector is
added to the input. BLOOM's code adds
``slope * key_position`` to the scores where jaxpos adds ``slope * (key_position -
query_position)``; the two differ by a constant per query row, which softmax removes,
so the attention weights are the same. With left padding BLOOM counts key positions
from the cumulative attention mask, which is exactly the ``cumsum(mask) - 1`` position
array used here. Head counts that are not a power of two use the paper's slope rule.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxpos
import jaxpos.nnx
from examples.models import common

__all__ = ["BloomConfig", "BloomForCausalLM", "from_hf"]


@dataclasses.dataclass(frozen=True)
class BloomConfig:
    """The fields of HF's ``BloomConfig`` this model uses (``n_head`` = ``num_heads``)."""

    vocab_size: int
    hidden_size: int
    n_layer: int
    n_head: int
    layer_norm_epsilon: float = 1e-5
    apply_residual_connection_post_layernorm: bool = False

    @classmethod
    def from_hf(cls, hf_config) -> BloomConfig:
        """Read a ``transformers.BloomConfig``.

        Raises:
          ValueError: ``hidden_size`` not divisible by ``n_head``.
        """
        if hf_config.hidden_size % hf_config.n_head:
            raise ValueError(f"hidden_size ({hf_config.hidden_size}) must be divisible by "
                             f"n_head ({hf_config.n_head}).")
        return cls(vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
                   n_layer=hf_config.n_layer, n_head=hf_config.n_head,
                   layer_norm_epsilon=hf_config.layer_norm_epsilon,
                   apply_residual_connection_post_layernorm=bool(
                       hf_config.apply_residual_connection_post_layernorm))


def _layer_norm(size, eps, dtype, rngs):
    return nnx.LayerNorm(size, epsilon=eps, use_fast_variance=False, dtype=dtype, rngs=rngs)


class BloomAttention(nnx.Module):
    """Fused ``query_key_value`` projection (per head: q, k, v), ALiBi from jaxpos."""

    def __init__(self, config: BloomConfig, *, dtype, rngs: nnx.Rngs):
        c = config
        self.num_heads, self.head_dim = c.n_head, c.hidden_size // c.n_head
        self.query_key_value = nnx.Linear(c.hidden_size, 3 * c.hidden_size, dtype=dtype,
                                          rngs=rngs)
        self.dense = nnx.Linear(c.hidden_size, c.hidden_size, dtype=dtype, rngs=rngs)

    def __call__(self, x, *, alibi, call: common.DecoderCall, layer: int):
        B, T, _ = x.shape
        # HF's layout: the 3 * hidden features are [num_heads, 3, head_dim].
        qkv = self.query_key_value(x).reshape(B, T, self.num_heads, 3, self.head_dim)
        q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        out = call.attend(layer, q, k, v, scheme=alibi)
        return self.dense(out.reshape(B, T, -1))


class BloomMLP(nnx.Module):
    """``dense_4h_to_h(gelu_tanh(dense_h_to_4h(x)))``."""

    def __init__(self, config: BloomConfig, *, dtype, rngs: nnx.Rngs):
        h = config.hidden_size
        self.dense_h_to_4h = nnx.Linear(h, 4 * h, dtype=dtype, rngs=rngs)
        self.dense_4h_to_h = nnx.Linear(4 * h, h, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.dense_4h_to_h(jax.nn.gelu(self.dense_h_to_4h(x), approximate=True))


class BloomBlock(nnx.Module):
    """Pre-LayerNorm block (residual taken after the norm when
    ``apply_residual_connection_post_layernorm``)."""

    def __init__(self, config: BloomConfig, *, dtype, rngs: nnx.Rngs):
        c = config
        self.post_ln_residual = c.apply_residual_connection_post_layernorm
        self.input_layernorm = _layer_norm(c.hidden_size, c.layer_norm_epsilon, dtype, rngs)
        self.self_attention = BloomAttention(c, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = _layer_norm(c.hidden_size, c.layer_norm_epsilon, dtype,
                                                    rngs)
        self.mlp = BloomMLP(c, dtype=dtype, rngs=rngs)

    def __call__(self, x, **kw):
        h = self.input_layernorm(x)
        x = (h if self.post_ln_residual else x) + self.self_attention(h, **kw)
        h = self.post_attention_layernorm(x)
        return (h if self.post_ln_residual else x) + self.mlp(h)


class BloomForCausalLM(common.CachedDecoderMixin, nnx.Module):
    """BLOOM decoder with its tied language-model head; :meth:`decode_step` decodes with
    the library's caches (ALiBi applied inside attention from the cached positions), so
    :class:`jaxpos.serving.ModuleDecoder` serves it.

    Args:
      config: :class:`BloomConfig` (``BloomConfig.from_hf(hf_config)``).
      dtype: computation dtype; rngs: initialisation randomness.
    """

    def __init__(self, config: BloomConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.word_embeddings = nnx.Embed(c.vocab_size, c.hidden_size, dtype=dtype, rngs=rngs)
        self.word_embeddings_layernorm = _layer_norm(c.hidden_size, c.layer_norm_epsilon, dtype,
                                                     rngs)
        self.h = nnx.List([BloomBlock(c, dtype=dtype, rngs=rngs) for _ in range(c.n_layer)])
        self.ln_f = _layer_norm(c.hidden_size, c.layer_norm_epsilon, dtype, rngs)
        self.alibi = jaxpos.nnx.ALiBi(c.n_head)  # no parameters; causal slopes

    def __call__(self, input_ids, *, attention_mask=None, implementation=None, block_q=None,
                 block_k=None):
        """Logits ``[B, T, vocab_size]`` (float32) of ``input_ids`` int ``[B, T]``.

        ``attention_mask`` (0/1 ``[B, T]``, 0 = padding, left or right) sets the key
        positions to ``cumsum(mask) - 1``, as BLOOM's ``build_alibi_tensor`` does, and hides
        padding keys. ``implementation``, ``block_q``, ``block_k`` go to
        :func:`jaxpos.attention`.

        Raises:
          ValueError / TypeError: bad ids or mask shape.
        """
        return self.forward(input_ids, attention_mask=attention_mask,
                            implementation=implementation, block_q=block_q,
                            block_k=block_k)[0]

    def cache_layers(self) -> list[tuple[int, int]]:
        """``(n_head, hidden_size // n_head)`` per layer (keys and values per head)."""
        c = self.config
        return [(c.n_head, c.hidden_size // c.n_head)] * c.n_layer

    def forward(self, input_ids, *, attention_mask=None, positions=None, cache=None,
                implementation=None, block_q=None, block_k=None):
        """``(logits [B, T, vocab_size] float32, cache)``: the full pass (``cache=None``)
        or a step against the library caches of :meth:`init_cache`; positions default to
        ``cumsum(attention_mask) - 1`` after the tokens each row's cache holds."""
        emb = self.word_embeddings.embedding[...]
        x = self.word_embeddings_layernorm(common.embed_tokens(emb, input_ids))
        call = common.DecoderCall(input_ids, attention_mask=attention_mask, positions=positions,
                                  cache=cache, num_layers=self.config.n_layer,
                                  implementation=implementation, block_q=block_q,
                                  block_k=block_k)
        alibi = self.alibi.scheme()
        for i, block in enumerate(self.h):
            x = block(x, alibi=alibi, call=call, layer=i)
        x = self.ln_f(x)
        return call.finish(x @ emb.T.astype(x.dtype))

    def decode_step(self, tokens, cache, *, positions=None, attention_mask=None,
                    implementation=None):
        """:meth:`forward` with ``cache`` (the protocol of ModuleDecoder)."""
        return self.forward(tokens, attention_mask=attention_mask, positions=positions,
                            cache=cache, implementation=implementation)


def param_mapping(config: BloomConfig) -> dict:
    """``{nnx path: (HF key, transform)}`` for ``BloomForCausalLM`` checkpoints."""
    t = "transformer."
    m = {("word_embeddings", "embedding"): (t + "word_embeddings.weight", common.to_numpy)}
    for ln in ("word_embeddings_layernorm", "ln_f"):
        m[(ln, "scale")] = (f"{t}{ln}.weight", common.to_numpy)
        m[(ln, "bias")] = (f"{t}{ln}.bias", common.to_numpy)
    for i in range(config.n_layer):
        hf = f"{t}h.{i}."
        for ln in ("input_layernorm", "post_attention_layernorm"):
            m[("h", i, ln, "scale")] = (f"{hf}{ln}.weight", common.to_numpy)
            m[("h", i, ln, "bias")] = (f"{hf}{ln}.bias", common.to_numpy)
        for sub, name in (("self_attention", "query_key_value"), ("self_attention", "dense"),
                          ("mlp", "dense_h_to_4h"), ("mlp", "dense_4h_to_h")):
            m[("h", i, sub, name, "kernel")] = (f"{hf}{sub}.{name}.weight", common.linear_kernel)
            m[("h", i, sub, name, "bias")] = (f"{hf}{sub}.{name}.bias", common.to_numpy)
    return m


def from_hf(state_dict, hf_config, *, dtype=jnp.float32) -> BloomForCausalLM:
    """Build a :class:`BloomForCausalLM` holding an HF PyTorch checkpoint's weights
    (``lm_head.weight`` is tied to the word embeddings and not read).

    Raises:
      ValueError: missing/unexpected keys or shape mismatches (see
        :func:`examples.models.common.load_params`).
    """
    config = BloomConfig.from_hf(hf_config)
    # Abstract parameters (no random initialisation): load_params fills every one.
    model = nnx.eval_shape(lambda: BloomForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(0)))
    if "lm_head.weight" in state_dict and not np.array_equal(
            common.to_numpy(state_dict["lm_head.weight"]),
            common.to_numpy(state_dict["transformer.word_embeddings.weight"])):
        raise ValueError("lm_head.weight differs from transformer.word_embeddings.weight; this "
                         "model ties them as BLOOM does.")
    return common.load_params(model, state_dict, param_mapping(config),
                              ignore=lambda k: k == "lm_head.weight")
