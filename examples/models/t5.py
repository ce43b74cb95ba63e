"""T5 (Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified
Text-to-Text Transformer", §2.1) encoder-decoder in Flax NNX on :func:`jaxpos.attention`,
with a converter from a Hugging Face ``T5ForConditionalGeneration`` state dict.

Positions are T5's bucketed relative bias, a :class:`jaxpos.nnx.T5RelativeBias` module
per stack whose :class:`jaxpos.T5Bias` scheme goes to attention:

* one ``[num_buckets, num_heads]`` table per stack, stored in the first block and shared
  by every layer of that stack (HF passes ``position_bias`` from block 0 onwards);
* bidirectional buckets in the encoder, causal buckets (and a causal mask) in the
  decoder's self-attention;
* no position term in cross-attention (:class:`jaxpos.NoPE`);
* ``scale=1.0`` everywhere: T5 folds ``1/sqrt(d_kv)`` into the initialisation.

Layer norms are RMS norms without bias (HF ``T5LayerNorm`` = ``nnx.RMSNorm``). Both the
original ReLU feed-forward and T5 v1.1's gated GELU (``feed_forward_proj="gated-gelu"``)
are supported; the decoder output is scaled by ``d_model ** -0.5`` before the tied head
when HF's ``scale_decoder_outputs`` is set (original T5).
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

__all__ = ["T5Config", "T5ForConditionalGeneration", "from_hf"]

_ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "silu": jax.nn.silu,
}


@dataclasses.dataclass(frozen=True)
class T5Config:
    """The fields of HF's ``T5Config`` this model uses (same names)."""

    vocab_size: int
    d_model: int
    d_kv: int
    d_ff: int
    num_layers: int
    num_decoder_layers: int
    num_heads: int
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    dense_act_fn: str = "relu"
    is_gated_act: bool = False
    scale_decoder_outputs: bool = True

    @classmethod
    def from_hf(cls, hf_config) -> T5Config:
        """Read a ``transformers.T5Config``.

        Raises:
          ValueError: an activation other than relu/gelu/gelu_new/silu.
        """
        if hf_config.dense_act_fn not in _ACTIVATIONS:
            raise ValueError(f"dense_act_fn must be one of {tuple(_ACTIVATIONS)}; got "
                             f"{hf_config.dense_act_fn!r}.")
        return cls(
            vocab_size=hf_config.vocab_size, d_model=hf_config.d_model, d_kv=hf_config.d_kv,
            d_ff=hf_config.d_ff, num_layers=hf_config.num_layers,
            num_decoder_layers=hf_config.num_decoder_layers or hf_config.num_layers,
            num_heads=hf_config.num_heads,
            relative_attention_num_buckets=hf_config.relative_attention_num_buckets,
            relative_attention_max_distance=hf_config.relative_attention_max_distance,
            layer_norm_epsilon=hf_config.layer_norm_epsilon, dense_act_fn=hf_config.dense_act_fn,
            is_gated_act=bool(hf_config.is_gated_act),
            scale_decoder_outputs=bool(getattr(hf_config, "scale_decoder_outputs",
                                               hf_config.tie_word_embeddings)))


def _rms_norm(c: T5Config, dtype, rngs):
    return nnx.RMSNorm(c.d_model, epsilon=c.layer_norm_epsilon, use_fast_variance=False,
                       dtype=dtype, rngs=rngs)


class T5Attention(nnx.Module):
    """``q``, ``k``, ``v``, ``o`` projections without bias; the position scheme is given
    per call (the stack's shared :class:`jaxpos.T5Bias`, or :class:`jaxpos.NoPE`)."""

    def __init__(self, c: T5Config, *, dtype, rngs: nnx.Rngs):
        self.num_heads, self.d_kv = c.num_heads, c.d_kv
        inner = c.num_heads * c.d_kv
        lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, rngs=rngs)
        self.q, self.k, self.v, self.o = (lin(c.d_model, inner), lin(c.d_model, inner),
                                          lin(c.d_model, inner), lin(inner, c.d_model))

    def __call__(self, x, kv_input, *, position, causal, kv_segments, attn_kw):
        B, Tq, _ = x.shape
        Tk = kv_input.shape[1]
        q = self.q(x).reshape(B, Tq, self.num_heads, self.d_kv)
        k = self.k(kv_input).reshape(B, Tk, self.num_heads, self.d_kv)
        v = self.v(kv_input).reshape(B, Tk, self.num_heads, self.d_kv)
        out = jaxpos.attention(q, k, v, position=position,
                               q_positions=jnp.arange(Tq, dtype=jnp.int32),
                               kv_positions=jnp.arange(Tk, dtype=jnp.int32), causal=causal,
                               scale=1.0, segment_ids=common.query_segments(B, Tq),
                               kv_segment_ids=kv_segments, **attn_kw)
        return self.o(out.reshape(B, Tq, -1))


class T5FeedForward(nnx.Module):
    """``wo(act(wi(x)))``, or gated ``wo(act(wi_0(x)) * wi_1(x))`` (T5 v1.1)."""

    def __init__(self, c: T5Config, *, dtype, rngs: nnx.Rngs):
        lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, rngs=rngs)
        self.act, self.gated = c.dense_act_fn, c.is_gated_act
        if c.is_gated_act:
            self.wi_0, self.wi_1 = lin(c.d_model, c.d_ff), lin(c.d_model, c.d_ff)
        else:
            self.wi = lin(c.d_model, c.d_ff)
        self.wo = lin(c.d_ff, c.d_model)

    def __call__(self, x):
        act = _ACTIVATIONS[self.act]
        h = act(self.wi_0(x)) * self.wi_1(x) if self.gated else act(self.wi(x))
        return self.wo(h)


class T5Block(nnx.Module):
    """Self-attention, (decoder only) cross-attention, feed-forward; each pre-RMS-norm with a
    residual."""

    def __init__(self, c: T5Config, *, decoder: bool, dtype, rngs: nnx.Rngs):
        self.self_norm = _rms_norm(c, dtype, rngs)
        self.self_attn = T5Attention(c, dtype=dtype, rngs=rngs)
        if decoder:
            self.cross_norm = _rms_norm(c, dtype, rngs)
            self.cross_attn = T5Attention(c, dtype=dtype, rngs=rngs)
        self.ff_norm = _rms_norm(c, dtype, rngs)
        self.ff = T5FeedForward(c, dtype=dtype, rngs=rngs)

    def __call__(self, x, *, position, causal, segments, enc, enc_segments, attn_kw):
        h = self.self_norm(x)
        x = x + self.self_attn(h, h, position=position, causal=causal, kv_segments=segments,
                               attn_kw=attn_kw)
        if enc is not None:
            x = x + self.cross_attn(self.cross_norm(x), enc, position=jaxpos.NoPE(),
                                    causal=False, kv_segments=enc_segments, attn_kw=attn_kw)
        return x + self.ff(self.ff_norm(x))


class T5Stack(nnx.Module):
    """An encoder or decoder stack: blocks, one shared relative-bias table, final norm."""

    def __init__(self, c: T5Config, *, decoder: bool, dtype, rngs: nnx.Rngs):
        self.decoder = decoder
        n = c.num_decoder_layers if decoder else c.num_layers
        # The stack's bias table [num_buckets, num_heads] (HF: block 0's
        # relative_attention_bias), shared by every layer; causal buckets in the decoder.
        self.relative_attention_bias = jaxpos.nnx.T5RelativeBias(
            c.num_heads, num_buckets=c.relative_attention_num_buckets,
            max_distance=c.relative_attention_max_distance, bidirectional=not decoder,
            d_model=c.d_model, rngs=rngs)
        self.block = nnx.List([T5Block(c, decoder=decoder, dtype=dtype, rngs=rngs)
                               for _ in range(n)])
        self.final_layer_norm = _rms_norm(c, dtype, rngs)

    def __call__(self, x, *, segments, enc=None, enc_segments=None, attn_kw):
        bias = self.relative_attention_bias.scheme()
        for blk in self.block:
            x = blk(x, position=bias, causal=self.decoder, segments=segments, enc=enc,
                    enc_segments=enc_segments, attn_kw=attn_kw)
        return self.final_layer_norm(x)


class T5ForConditionalGeneration(nnx.Module):
    """T5 encoder-decoder with the tied language-model head.

    Args:
      config: :class:`T5Config` (``T5Config.from_hf(hf_config)``).
      dtype: computation dtype; rngs: initialisation randomness.
    """

    def __init__(self, config: T5Config, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.shared = nnx.Embed(config.vocab_size, config.d_model, dtype=dtype, rngs=rngs)
        self.encoder = T5Stack(config, decoder=False, dtype=dtype, rngs=rngs)
        self.decoder = T5Stack(config, decoder=True, dtype=dtype, rngs=rngs)

    def encode(self, input_ids, *, attention_mask=None, implementation=None, block_q=None,
               block_k=None):
        """Encoder output ``[B, Ts, d_model]`` of ``input_ids`` int ``[B, Ts]``;
        ``attention_mask`` 0/1 ``[B, Ts]`` hides padding keys (left or right)."""
        emb = self.shared.embedding[...]
        B, T = input_ids.shape
        mask = common.check_attention_mask(attention_mask, B, T)
        attn_kw = {"implementation": implementation, "block_q": block_q, "block_k": block_k}
        return self.encoder(common.embed_tokens(emb, input_ids),
                            segments=common.key_segments(mask, B, T), attn_kw=attn_kw)

    def decode(self, decoder_input_ids, encoder_output, *, attention_mask=None,
               decoder_attention_mask=None, implementation=None, block_q=None, block_k=None):
        """Logits ``[B, Tt, vocab_size]`` (float32) of the decoder.

        Args:
          decoder_input_ids: int ``[B, Tt]`` (start with ``decoder_start_token_id``).
          encoder_output: ``[B, Ts, d_model]`` from :meth:`encode`.
          attention_mask: the encoder's 0/1 mask ``[B, Ts]`` (hides padding in
            cross-attention); decoder_attention_mask: 0/1 ``[B, Tt]``.
        """
        emb = self.shared.embedding[...]
        B, T = decoder_input_ids.shape
        Ts = encoder_output.shape[1]
        if encoder_output.shape[0] != B:
            raise ValueError(f"encoder_output must have batch {B}; got shape "
                             f"{encoder_output.shape}.")
        enc_mask = common.check_attention_mask(attention_mask, B, Ts)
        dec_mask = common.check_attention_mask(decoder_attention_mask, B, T)
        attn_kw = {"implementation": implementation, "block_q": block_q, "block_k": block_k}
        x = self.decoder(common.embed_tokens(emb, decoder_input_ids),
                         segments=common.key_segments(dec_mask, B, T), enc=encoder_output,
                         enc_segments=common.key_segments(enc_mask, B, Ts), attn_kw=attn_kw)
        if self.config.scale_decoder_outputs:
            x = x * (self.config.d_model ** -0.5)
        return (x @ emb.T.astype(x.dtype)).astype(jnp.float32)

    def __call__(self, input_ids, decoder_input_ids, *, attention_mask=None,
                 decoder_attention_mask=None, implementation=None, block_q=None, block_k=None):
        """``(logits [B, Tt, vocab], encoder_output [B, Ts, d_model])``.

        Raises:
          ValueError / TypeError: bad ids, mask shapes, or implementation.
        """
        kw = {"implementation": implementation, "block_q": block_q, "block_k": block_k}
        enc = self.encode(input_ids, attention_mask=attention_mask, **kw)
        logits = self.decode(decoder_input_ids, enc, attention_mask=attention_mask,
                             decoder_attention_mask=decoder_attention_mask, **kw)
        return logits, enc


def param_mapping(config: T5Config) -> dict:
    """``{nnx path: (HF key, transform)}`` for ``T5ForConditionalGeneration``
    checkpoints (relative-bias tables from block 0 of each stack)."""
    npy, lin = common.to_numpy, common.linear_kernel
    m = {("shared", "embedding"): ("shared.weight", npy)}
    for stack, n, dec in (("encoder", config.num_layers, False),
                          ("decoder", config.num_decoder_layers, True)):
        m[(stack, "relative_attention_bias", "table")] = (
            f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight", npy)
        m[(stack, "final_layer_norm", "scale")] = (f"{stack}.final_layer_norm.weight", npy)
        for i in range(n):
            hf = f"{stack}.block.{i}.layer."
            ours = (stack, "block", i)
            m[ours + ("self_norm", "scale")] = (hf + "0.layer_norm.weight", npy)
            for p in ("q", "k", "v", "o"):
                m[ours + ("self_attn", p, "kernel")] = (f"{hf}0.SelfAttention.{p}.weight", lin)
            ff = 1
            if dec:
                ff = 2
                m[ours + ("cross_norm", "scale")] = (hf + "1.layer_norm.weight", npy)
                for p in ("q", "k", "v", "o"):
                    m[ours + ("cross_attn", p, "kernel")] = (f"{hf}1.EncDecAttention.{p}.weight",
                                                             lin)
            m[ours + ("ff_norm", "scale")] = (f"{hf}{ff}.layer_norm.weight", npy)
            names = ("wi_0", "wi_1", "wo") if config.is_gated_act else ("wi", "wo")
            for p in names:
                m[ours + ("ff", p, "kernel")] = (f"{hf}{ff}.DenseReluDense.{p}.weight", lin)
    return m


def from_hf(state_dict, hf_config, *, dtype=jnp.float32) -> T5ForConditionalGeneration:
    """Build a :class:`T5ForConditionalGeneration` holding an HF PyTorch checkpoint's
    weights. The stack embeddings and ``lm_head`` are tied to ``shared`` (HF ties them
    always); a different ``lm_head.weight`` raises.

    Raises:
      ValueError: missing/unexpected keys, shape mismatches, an untied head.
    """
    config = T5Config.from_hf(hf_config)
    # Abstract parameters (no random initialisation): load_params fills every one.
    model = nnx.eval_shape(
        lambda: T5ForConditionalGeneration(config, dtype=dtype, rngs=nnx.Rngs(0)))
    shared = (common.to_numpy(state_dict["shared.weight"]) if "shared.weight" in state_dict
              else None)
    tied = ("lm_head.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
    for key in tied:
        if key in state_dict and shared is not None and not np.array_equal(
                common.to_numpy(state_dict[key]), shared):
            raise ValueError(f"{key} differs from shared.weight; this model ties them as HF's "
                             f"T5 does.")
    # Old checkpoints carry an unused bias table in the first cross-attention layer.
    unused = "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"
    return common.load_params(model, state_dict, param_mapping(config),
                              ignore=lambda k: k in tied or k == unused)
