"""GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners", §2.3)
in Flax NNX on :func:`jaxpos.attention`, with a converter from a Hugging Face
``GPT2LMHeadModel`` state dict.

Positions are learned absolute vectors (``wpe``, ``[n_positions, n_embd]``) added to the
token embeddings, held by :class:`jaxpos.nnx.LearnedPositionalEmbedding` (position
``n_positions`` has no row, and asking for it raises instead of being clamped).
Attention itself is :class:`jaxpos.NoPE` with a causal mask.

HF stores GPT-2's projections as ``Conv1D`` weights, ``[in, out]``: already Flax's kernel
layout, so they are copied without a transpose. ``c_attn`` packs ``[q | k | v]``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxpos
import jaxpos.nnx
from examples.models import common
from jaxpos import _checks

__all__ = ["GPT2Config", "GPT2LMHeadModel", "from_hf"]


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    """The fields of HF's ``GPT2Config`` this model uses (same names)."""

    vocab_size: int
    n_positions: int
    n_embd: int
    n_layer: int
    n_head: int
    n_inner: int | None = None
    layer_norm_epsilon: float = 1e-5
    activation_function: str = "gelu_new"
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False

    @classmethod
    def from_hf(cls, hf_config) -> GPT2Config:
        """Read a ``transformers.GPT2Config``.

        Raises:
          ValueError: an activation other than ``gelu_new``/``gelu``/``relu``;
            ``add_cross_attention``.
        """
        if hf_config.activation_function not in _ACTIVATIONS:
            raise ValueError(f"activation_function must be one of {tuple(_ACTIVATIONS)}; got "
                             f"{hf_config.activation_function!r}.")
        if getattr(hf_config, "add_cross_attention", False):
            raise ValueError("add_cross_attention=True is not supported by this example.")
        return cls(vocab_size=hf_config.vocab_size, n_positions=hf_config.n_positions,
                   n_embd=hf_config.n_embd, n_layer=hf_config.n_layer, n_head=hf_config.n_head,
                   n_inner=hf_config.n_inner, layer_norm_epsilon=hf_config.layer_norm_epsilon,
                   activation_function=hf_config.activation_function,
                   scale_attn_weights=bool(hf_config.scale_attn_weights),
                   scale_attn_by_inverse_layer_idx=bool(
                       hf_config.scale_attn_by_inverse_layer_idx))


_ACTIVATIONS = {
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "relu": jax.nn.relu,
}


def _layer_norm(size, eps, dtype, rngs):
    return nnx.LayerNorm(size, epsilon=eps, use_fast_variance=False, dtype=dtype, rngs=rngs)


class GPT2Attention(nnx.Module):
    """Causal self-attention with packed ``c_attn`` (``[q | k | v]``) and ``c_proj``."""

    def __init__(self, config: GPT2Config, layer_idx: int, *, dtype, rngs: nnx.Rngs):
        c = config
        self.num_heads, self.head_dim = c.n_head, c.n_embd // c.n_head
        self.c_attn = nnx.Linear(c.n_embd, 3 * c.n_embd, dtype=dtype, rngs=rngs)
        self.c_proj = nnx.Linear(c.n_embd, c.n_embd, dtype=dtype, rngs=rngs)
        scale = 1.0 / math.sqrt(self.head_dim) if c.scale_attn_weights else 1.0
        if c.scale_attn_by_inverse_layer_idx:
            scale /= float(layer_idx + 1)
        self.scale = scale

    def __call__(self, x, *, call: common.DecoderCall, layer: int):
        B, T, D = x.shape
        q, k, v = (t.reshape(B, T, self.num_heads, self.head_dim)
                   for t in jnp.split(self.c_attn(x), 3, axis=-1))
        out = call.attend(layer, q, k, v, scheme=jaxpos.NoPE(), scale=self.scale)
        return self.c_proj(out.reshape(B, T, D))


class GPT2Block(nnx.Module):
    """Pre-LayerNorm block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPT2Config, layer_idx: int, *, dtype, rngs: nnx.Rngs):
        c = config
        inner = c.n_inner or 4 * c.n_embd
        self.act = c.activation_function
        self.ln_1 = _layer_norm(c.n_embd, c.layer_norm_epsilon, dtype, rngs)
        self.attn = GPT2Attention(c, layer_idx, dtype=dtype, rngs=rngs)
        self.ln_2 = _layer_norm(c.n_embd, c.layer_norm_epsilon, dtype, rngs)
        self.c_fc = nnx.Linear(c.n_embd, inner, dtype=dtype, rngs=rngs)
        self.c_proj = nnx.Linear(inner, c.n_embd, dtype=dtype, rngs=rngs)

    def __call__(self, x, **kw):
        x = x + self.attn(self.ln_1(x), **kw)
        return x + self.c_proj(_ACTIVATIONS[self.act](self.c_fc(self.ln_2(x))))


class GPT2LMHeadModel(common.CachedDecoderMixin, nnx.Module):
    """GPT-2 with its tied language-model head; :meth:`decode_step` decodes with the
    library's dense or paged caches (the learned positions are added to the embeddings,
    so a StreamingLLM cache, which re-numbers positions, is refused), so
    :class:`jaxpos.serving.ModuleDecoder` serves it.

    Args:
      config: :class:`GPT2Config` (``GPT2Config.from_hf(hf_config)``).
      dtype: computation dtype; rngs: initialisation randomness.
    """

    def __init__(self, config: GPT2Config, *, dtype=jnp.float32, rngs: nnx.Rngs):
        c = config
        if c.n_embd % c.n_head:
            raise ValueError(f"n_embd ({c.n_embd}) must be divisible by n_head ({c.n_head}).")
        self.config = c
        self.wte = nnx.Embed(c.vocab_size, c.n_embd, dtype=dtype, rngs=rngs)
        # Learned absolute positions; position n_positions has no row and raises.
        self.wpe = jaxpos.nnx.LearnedPositionalEmbedding(c.n_positions, c.n_embd, rngs=rngs)
        self.h = nnx.List([GPT2Block(c, i, dtype=dtype, rngs=rngs) for i in range(c.n_layer)])
        self.ln_f = _layer_norm(c.n_embd, c.layer_norm_epsilon, dtype, rngs)

    def __call__(self, input_ids, *, attention_mask=None, positions=None, implementation=None,
                 block_q=None, block_k=None):
        """Logits ``[B, T, vocab_size]`` (float32) of ``input_ids`` int ``[B, T]``.

        Args:
          attention_mask: 0/1 ``[B, T]``; padding keys are hidden. Positions default to
            ``arange(T)`` as in HF (pass ``positions`` for left padding).
          positions: int ``[T]`` or ``[B, T]`` in ``[0, n_positions)``.
          implementation, block_q, block_k: passed to :func:`jaxpos.attention`.

        Raises:
          ValueError: a position outside the learned table (concrete positions), a
            sequence longer than ``n_positions``, bad ids or mask shape.
        """
        if positions is None:
            positions = jnp.arange(_checks.shape_of(input_ids)[-1], dtype=jnp.int32)
        return self.forward(input_ids, attention_mask=attention_mask, positions=positions,
                            implementation=implementation, block_q=block_q,
                            block_k=block_k)[0]

    def cache_layers(self) -> list[tuple[int, int]]:
        """``(n_head, n_embd // n_head)`` per layer."""
        c = self.config
        return [(c.n_head, c.n_embd // c.n_head)] * c.n_layer

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32, *,
                   keep_first: int | None = None, **cache_options) -> tuple:
        """One dense (or, with ``page_size=``/``num_pages=``, paged) library cache per layer.

        Raises:
          ValueError: ``keep_first`` (a StreamingLLM cache re-numbers positions, which the
            learned table added at the input cannot follow); bad sizes or options.
        """
        if keep_first is not None:
            raise ValueError(f"keep_first={keep_first!r}: GPT-2 adds learned absolute "
                             f"positions to its embeddings, which a StreamingLLM cache's "
                             f"re-numbered places cannot follow; use a dense or paged cache.")
        return super().init_cache(batch, max_len, dtype, **cache_options)

    def forward(self, input_ids, *, attention_mask=None, positions=None, cache=None,
                implementation=None, block_q=None, block_k=None):
        """``(logits [B, T, vocab_size] float32, cache)``: the full pass (``cache=None``)
        or a step against the caches of :meth:`init_cache`; positions default to
        ``cumsum(attention_mask) - 1`` after the tokens each row's cache holds (HF's
        ``generate``), and index the learned table."""
        wte = self.wte.embedding[...]
        x = common.embed_tokens(wte, input_ids)
        call = common.DecoderCall(input_ids, attention_mask=attention_mask, positions=positions,
                                  cache=cache, num_layers=self.config.n_layer,
                                  implementation=implementation, block_q=block_q,
                                  block_k=block_k)
        x = x + self.wpe(call.positions).astype(wte.dtype)
        for i, block in enumerate(self.h):
            x = block(x, call=call, layer=i)
        x = self.ln_f(x)
        return call.finish(x @ wte.T.astype(x.dtype))

    def decode_step(self, tokens, cache, *, positions=None, attention_mask=None,
                    implementation=None):
        """:meth:`forward` with ``cache`` (the protocol of ModuleDecoder)."""
        return self.forward(tokens, attention_mask=attention_mask, positions=positions,
                            cache=cache, implementation=implementation)


def param_mapping(config: GPT2Config) -> dict:
    """``{nnx path: (HF key, transform)}`` for ``GPT2LMHeadModel`` checkpoints. Conv1D
    weights are ``[in, out]`` already: no transpose."""
    t = "transformer."
    conv = common.to_numpy
    m = {("wte", "embedding"): (t + "wte.weight", common.to_numpy),
         ("wpe", "table"): (t + "wpe.weight", common.to_numpy),
         ("ln_f", "scale"): (t + "ln_f.weight", common.to_numpy),
         ("ln_f", "bias"): (t + "ln_f.bias", common.to_numpy)}
    for i in range(config.n_layer):
        hf = f"{t}h.{i}."
        for ln in ("ln_1", "ln_2"):
            m[("h", i, ln, "scale")] = (f"{hf}{ln}.weight", common.to_numpy)
            m[("h", i, ln, "bias")] = (f"{hf}{ln}.bias", common.to_numpy)
        for path, key in ((("attn", "c_attn"), "attn.c_attn"), (("attn", "c_proj"), "attn.c_proj"),
                          (("c_fc",), "mlp.c_fc"), (("c_proj",), "mlp.c_proj")):
            m[("h", i) + path + ("kernel",)] = (f"{hf}{key}.weight", conv)
            m[("h", i) + path + ("bias",)] = (f"{hf}{key}.bias", common.to_numpy)
    return m


def from_hf(state_dict, hf_config, *, dtype=jnp.float32) -> GPT2LMHeadModel:
    """Build a :class:`GPT2LMHeadModel` holding an HF PyTorch checkpoint's weights
    (``lm_head.weight`` is tied to ``wte`` and not read; the causal-mask buffers
    ``attn.bias``/``attn.masked_bias`` of old checkpoints are ignored).

    Raises:
      ValueError: missing/unexpected keys or shape mismatches.
    """
    config = GPT2Config.from_hf(hf_config)
    # Abstract parameters (no random initialisation): load_params fills every one.
    model = nnx.eval_shape(lambda: GPT2LMHeadModel(config, dtype=dtype, rngs=nnx.Rngs(0)))
    if "lm_head.weight" in state_dict and not np.array_equal(
            common.to_numpy(state_dict["lm_head.weight"]),
            common.to_numpy(state_dict["transformer.wte.weight"])):
        raise ValueError("lm_head.weight differs from transformer.wte.weight; GPT-2 ties them.")
    ignore = lambda k: k == "lm_head.weight" or k.endswith((".attn.bias", ".attn.masked_bias"))
    return common.load_params(model, state_dict, param_mapping(config), ignore=ignore)
