"""Flax Linen twins of the modules in :mod:`jaxpos.nnx`.

Same names, same arguments (as dataclass fields), the same parameter tree and the same
pure functions underneath (the helpers of :mod:`jaxpos.nnx`), so given the same weights
a Linen module and its NNX twin produce the same outputs. :func:`params_from_nnx` turns
an NNX model's parameters into the Linen ``params`` collection.

Usage::

    model = jaxpos.linen.DecoderLM(vocab_size=256, d_model=64, num_layers=2,
                                   num_heads=4, position="alibi")
    params = model.init(jax.random.key(0), tokens)["params"]
    logits = model.apply({"params": params}, tokens)            # [B, T, vocab]
    cache = model.init_cache(batch, max_len)                    # no params needed
    logits, cache = model.apply({"params": params}, tokens[:, :1], cache,
                                method="decode_step")

See :mod:`jaxpos.nnx` for the architecture (pre-LN RMSNorm blocks, GELU MLP, tied
embeddings scaled by ``sqrt(d_model)``, ``scale = 1/sqrt(head_dim)`` for every scheme,
one T5 table per stack, Shaw tables per layer) and for the KV-cache convention.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from jaxpos import _checks
from jaxpos import schemes as _schemes
from jaxpos.alibi import alibi_bias
from jaxpos.attention import attention
from jaxpos.learned import learned_positions
from jaxpos.nnx import (
    ATTENTION_POSITIONS,
    POSITIONS,
    KVCache,
    attention_dims,
    attention_inputs,
    check_attention_input,
    check_attention_options,
    check_learned_length,
    check_position_name,
    check_tokens,
    default_positions,
    embed_tokens,
    init_kv_cache,
    learned_table_init,
    merge_heads,
    mlp,
    no_rope_scaling,
    poison_rows,
    project_heads,
    rms_norm,
    rope_scheme,
    rotate_at_write,
    shaw_table_init,
    sinusoidal_embedding,
    t5_table_init,
    tied_logits,
    token_embedding_init,
    update_kv_cache,
)
from jaxpos.rope import apply_rope, check_rotary_dim
from jaxpos.t5 import check_bucket_args, t5_bias

__all__ = [
    "POSITIONS",
    "ALiBi",
    "DecoderLM",
    "Encoder",
    "KVCache",
    "LearnedPositionalEmbedding",
    "MultiHeadAttention",
    "RotaryEmbedding",
    "ShawRelativePosition",
    "SinusoidalEmbedding",
    "T5RelativeBias",
    "TransformerBlock",
    "params_from_nnx",
]

Dtype = Any


def params_from_nnx(model) -> dict:
    """The Linen ``params`` dict holding the weights of an NNX twin (:mod:`jaxpos.nnx`).

    NNX keeps lists of layers as ``blocks/0/...``; Linen names them ``blocks_0/...``.
    Everything else already has the same path. Arrays are shared, not copied.

    Args:
      model: an :class:`flax.nnx.Module` from :mod:`jaxpos.nnx`, or an
        :class:`flax.nnx.State` of it (e.g. the gradients from ``nnx.grad``), or that
        state as a nested dict (``nnx.to_pure_dict``).

    Returns:
      nested dict of arrays, for ``linen_model.apply({"params": ...}, ...)``.

    Raises:
      TypeError: ``model`` is neither an NNX module nor a state.
    """
    from flax import nnx

    # nnx.to_pure_dict, not the State method that Flax 0.12 deprecates (Flax plans to
    # replace State by a plain dict: a nested dict of arrays is accepted as it is).
    if isinstance(model, nnx.Module):
        pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    elif isinstance(model, nnx.State):
        pure = nnx.to_pure_dict(model)
    elif isinstance(model, dict):
        pure = jax.tree_util.tree_map(
            lambda v: v.get_value() if isinstance(v, nnx.Variable) else v, model,
            is_leaf=lambda v: isinstance(v, nnx.Variable))
    else:
        raise TypeError(f"model must be a flax.nnx.Module or nnx.State; got "
                        f"{type(model).__name__}.")

    def convert(tree):
        if not isinstance(tree, dict):
            return tree
        out = {}
        for key, val in tree.items():
            if isinstance(val, dict) and val and all(isinstance(k, int) for k in val):
                for i, sub in val.items():
                    out[f"{key}_{i}"] = convert(sub)
            else:
                out[str(key)] = convert(val)
        return out

    return convert(pure)


# ================================================================== parameter holders
# One parameter each, so the trees match NNX's ``q_proj.kernel``, ``attn_norm.scale``,
# ``embed.embedding``; the computation is the shared pure functions.

class _Kernel(nn.Module):
    shape: tuple[int, ...]
    param_dtype: Dtype = jnp.float32
    name_in_tree: str = "kernel"
    init_fn: Callable = nn.initializers.lecun_normal()

    def setup(self):
        self.value = self.param(self.name_in_tree, self.init_fn, self.shape, self.param_dtype)


def _linear(in_features, out_features, param_dtype, name):
    return _Kernel((in_features, out_features), param_dtype, "kernel", name=name)


class _Dense(nn.Module):
    """``kernel [in, out]`` and, with ``use_bias``, ``bias [out]`` (zeros), as
    :class:`flax.nnx.Linear` names them."""
    in_features: int
    out_features: int
    use_bias: bool = False
    param_dtype: Dtype = jnp.float32

    def setup(self):
        self.kernel = self.param("kernel", nn.initializers.lecun_normal(),
                                 (self.in_features, self.out_features), self.param_dtype)
        self.bias = (self.param("bias", nn.initializers.zeros, (self.out_features,),
                                self.param_dtype) if self.use_bias else None)


def _norm(features, param_dtype, name):
    return _Kernel((features,), param_dtype, "scale", nn.initializers.ones, name=name)


# ================================================================== position modules

class SinusoidalEmbedding(nn.Module):
    """Linen twin of :class:`jaxpos.nnx.SinusoidalEmbedding` (Vaswani et al. 2017, §3.5):
    no parameters; ``positions [T] | [B, T]`` -> ``[..., T, d_model]``."""

    d_model: int
    base: float = 10000.0
    layout: str = "interleaved"
    dtype: Dtype = jnp.float32

    def __call__(self, positions) -> jax.Array:
        _checks.check_positive_int("d_model", self.d_model)
        return sinusoidal_embedding(positions, self.d_model, self.base, self.layout, self.dtype)


class LearnedPositionalEmbedding(nn.Module):
    """Linen twin of :class:`jaxpos.nnx.LearnedPositionalEmbedding`: parameter ``table
    [max_len, d_model]``; ``positions`` -> rows; out-of-range policy ``out_of_range``."""

    max_len: int
    d_model: int
    out_of_range: str = "error"
    embedding_init: Callable | None = None
    param_dtype: Dtype = jnp.float32

    def setup(self):
        _checks.check_positive_int("max_len", self.max_len)
        _checks.check_positive_int("d_model", self.d_model)
        _checks.check_choice("out_of_range", self.out_of_range, ("error", "wrap", "clip"))
        self.table = self.param("table", self.embedding_init or learned_table_init(),
                                (self.max_len, self.d_model), self.param_dtype)

    def __call__(self, positions) -> jax.Array:
        return learned_positions(self.table, positions, out_of_range=self.out_of_range)


class RotaryEmbedding(nn.Module):
    """Linen twin of :class:`jaxpos.nnx.RotaryEmbedding` (Su et al. 2024, §3.4): no
    parameters; ``scheme(scaling)`` -> :class:`jaxpos.RoPE`; call rotates ``x [B, T, N, H]``."""

    rotary_dim: int
    base: float = 10000.0
    layout: str = "half"
    scaling: Any = None

    def scheme(self, scaling=None) -> _schemes.RoPE:
        check_rotary_dim(self.rotary_dim)
        return rope_scheme(self.rotary_dim, self.base, self.layout,
                           self.scaling if scaling is None else scaling)

    def __call__(self, x, positions, *, scaling=None) -> jax.Array:
        s = self.scheme(scaling)
        pos = _checks.positions_2d("positions", positions, x.shape[0], x.shape[1])
        inv_freq, af = s.frequencies(pos, pos)
        return apply_rope(x, pos, inv_freq, layout=self.layout, attention_factor=af)


class ALiBi(nn.Module):
    """Linen twin of :class:`jaxpos.nnx.ALiBi` (Press et al. 2022, §3): no parameters;
    ``scheme()`` -> :class:`jaxpos.ALiBi`; call -> bias float32 ``[N, Tq, Tk]``."""

    num_heads: int
    bidirectional: bool = False

    def scheme(self) -> _schemes.ALiBi:
        return _schemes.ALiBi(self.num_heads, bidirectional=self.bidirectional)

    def __call__(self, q_positions, kv_positions) -> jax.Array:
        return alibi_bias(q_positions, kv_positions, self.scheme().slopes,
                          bidirectional=self.bidirectional)


class T5RelativeBias(nn.Module):
    """Linen twin of :class:`jaxpos.nnx.T5RelativeBias` (Raffel et al. 2020, §2.1):
    parameter ``table [num_buckets, num_heads]``; ``scheme()`` -> :class:`jaxpos.T5Bias`;
    call -> bias float32 ``[N, Tq, Tk]``. Define it once in a stack to share it."""

    num_heads: int
    num_buckets: int = 32
    max_distance: int = 128
    bidirectional: bool = True
    d_model: int | None = None
    embedding_init: Callable | None = None
    param_dtype: Dtype = jnp.float32

    def setup(self):
        _checks.check_positive_int("num_heads", self.num_heads)
        check_bucket_args(self.num_buckets, self.max_distance, self.bidirectional)
        init = self.embedding_init or t5_table_init(self.d_model or self.num_heads)
        self.table = self.param("table", init, (self.num_buckets, self.num_heads),
                                self.param_dtype)

    def scheme(self) -> _schemes.T5Bias:
        return _schemes.T5Bias(self.table, bidirectional=self.bidirectional,
                               num_buckets=self.num_buckets, max_distance=self.max_distance)

    def __call__(self, q_positions, kv_positions) -> jax.Array:
        return t5_bias(q_positions, kv_positions, self.table, bidirectional=self.bidirectional,
                       num_buckets=self.num_buckets, max_distance=self.max_distance)


class ShawRelativePosition(nn.Module):
    """Linen twin of :class:`jaxpos.nnx.ShawRelativePosition` (Shaw et al. 2018, §3):
    parameters ``rel_k`` (and ``rel_v`` when ``values``) ``[2 * max_distance + 1,
    head_dim]``; ``scheme()`` -> :class:`jaxpos.Shaw`."""

    head_dim: int
    max_distance: int = 16
    values: bool = True
    embedding_init: Callable | None = None
    param_dtype: Dtype = jnp.float32

    def setup(self):
        _checks.check_positive_int("head_dim", self.head_dim)
        K = _checks.check_positive_int("max_distance", self.max_distance)
        init = self.embedding_init or shaw_table_init()
        shape = (2 * K + 1, self.head_dim)
        self.rel_k = self.param("rel_k", init, shape, self.param_dtype)
        self.rel_v = self.param("rel_v", init, shape, self.param_dtype) if self.values else None

    def scheme(self) -> _schemes.Shaw:
        return _schemes.Shaw(self.rel_k, self.rel_v)

    def __call__(self):
        return self.scheme()


_POSITION_MODULES = (RotaryEmbedding, ALiBi, T5RelativeBias, ShawRelativePosition)


def _scheme_of(module, rope_scaling):
    if module is None:
        no_rope_scaling("nope", rope_scaling)
        return _schemes.NoPE()
    if isinstance(module, RotaryEmbedding):
        return module.scheme(rope_scaling)
    no_rope_scaling(type(module).__name__, rope_scaling)
    return module.scheme()


# ================================================================== attention

class MultiHeadAttention(nn.Module):
    """Linen twin of :class:`jaxpos.nnx.MultiHeadAttention`: grouped-query self- or
    cross-attention with any position scheme over :func:`jaxpos.attention`.

    Fields as the NNX arguments (``d_model``, ``num_heads``, ``num_kv_heads``, ``head_dim``,
    ``position`` (a name, or a Linen position module, shared if defined in a parent),
    ``causal``, ``rotary_dim``, ``rope_base``, ``num_buckets``, ``max_distance``,
    ``scale``, ``implementation``, ``use_bias``, ``dtype``, ``param_dtype``). Parameters
    ``q_proj/k_proj/v_proj/o_proj.kernel`` (and ``.bias`` with ``use_bias``) and
    ``position_module/...`` for a position given by name. A position module passed in lives where it was defined: once in the parent
    that defined it in ``setup`` (shared by every layer it was passed to, like a stack's T5
    table), or under ``position/...`` when it was created unbound for this layer.

    Call: ``x [B, T, D]`` -> ``[B, T, D]`` (keywords ``context``, ``positions``,
    ``kv_positions``, ``mask``, ``segment_ids``, ``kv_segment_ids``, ``scheme``,
    ``rope_scaling``, ``implementation``, as the NNX twin);
    ``decode(x, cache, ...)`` -> ``(y, cache)``; ``init_cache(batch, max_len)`` needs no
    parameters. Raises as the NNX twin.
    """

    d_model: int
    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    position: Any = "nope"
    causal: bool = False
    rotary_dim: int | None = None
    rope_base: float = 10000.0
    num_buckets: int = 32
    max_distance: int | None = None
    scale: float | None = None
    implementation: str | None = None
    use_bias: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    def _dims(self):
        return attention_dims(self.d_model, self.num_heads, self.num_kv_heads, self.head_dim)

    def setup(self):
        D, N, Nk, H = self._dims()
        check_attention_options(self.implementation, self.use_bias)
        dense = lambda i, o, name: _Dense(i, o, self.use_bias, self.param_dtype, name=name)
        self.q_proj = dense(D, N * H, "q_proj")
        self.k_proj = dense(D, Nk * H, "k_proj")
        self.v_proj = dense(D, Nk * H, "v_proj")
        self.o_proj = dense(N * H, D, "o_proj")
        pos = self.position
        if isinstance(pos, _POSITION_MODULES) or pos is None:
            self._pos = pos
            return
        name = check_position_name("position", pos, ATTENTION_POSITIONS)
        if name == "nope":
            self._pos = None
        elif name == "rope":
            self._pos = RotaryEmbedding(H if self.rotary_dim is None else self.rotary_dim,
                                        base=self.rope_base, name="position_module")
        elif name == "alibi":
            self._pos = ALiBi(N, bidirectional=not self.causal, name="position_module")
        elif name == "t5":
            self._pos = T5RelativeBias(
                N, num_buckets=self.num_buckets,
                max_distance=128 if self.max_distance is None else self.max_distance,
                bidirectional=not self.causal, d_model=D, param_dtype=self.param_dtype,
                name="position_module")
        else:
            self._pos = ShawRelativePosition(
                H, max_distance=16 if self.max_distance is None else self.max_distance,
                param_dtype=self.param_dtype, name="position_module")

    def _proj(self, layer, x, heads):
        _, _, _, H = self._dims()
        return project_heads(x, layer.kernel, heads, H, self.dtype, layer.bias)

    def _out(self, o):
        return merge_heads(o, self.o_proj.kernel, self.dtype, self.o_proj.bias)

    def _qkv(self, x, context=None):
        D, N, Nk, _ = self._dims()
        check_attention_input("x", x, D)
        src = x if context is None else context
        return (self._proj(self.q_proj, x, N), self._proj(self.k_proj, src, Nk),
                self._proj(self.v_proj, src, Nk))

    def __call__(self, x, *, context=None, positions=None, kv_positions=None, mask=None,
                 segment_ids=None, kv_segment_ids=None, scheme=None, rope_scaling=None,
                 implementation=None) -> jax.Array:
        pos, kv_pos = attention_inputs(x, context, positions, kv_positions, kv_segment_ids,
                                       self._dims()[0])
        q, k, v = self._qkv(x, context)
        if scheme is None:
            scheme = _scheme_of(self._pos, rope_scaling)
        o = attention(q, k, v, position=scheme, q_positions=pos, kv_positions=kv_pos,
                      causal=self.causal, mask=mask, segment_ids=segment_ids,
                      kv_segment_ids=kv_segment_ids, scale=self.scale,
                      implementation=implementation or self.implementation)
        return self._out(o)

    @nn.nowrap
    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        """An empty :class:`jaxpos.nnx.KVCache` (no parameters needed)."""
        _, _, Nk, H = self._dims()
        return init_kv_cache(batch, max_len, Nk, H, dtype or self.dtype)

    def decode(self, x, cache: KVCache, *, positions=None, scheme=None, rope_scaling=None,
               implementation=None):
        """As :meth:`jaxpos.nnx.MultiHeadAttention.decode`: ``(y [B, T, D], cache)``."""
        q, k, v = self._qkv(x)
        B, T = x.shape[:2]
        if positions is None:
            positions = cache.length[:, None] + jnp.arange(T, dtype=jnp.int32)
        pos = _checks.positions_2d("positions", positions, B, T)
        if scheme is None:
            scheme = _scheme_of(self._pos, rope_scaling)
        q, k, scheme = rotate_at_write(scheme, q, k, pos)
        cache, seg, kv_seg, overflow = update_kv_cache(cache, k, v, pos)
        o = attention(q, cache.k.astype(q.dtype), cache.v.astype(q.dtype), position=scheme,
                      q_positions=pos, kv_positions=cache.positions, causal=self.causal,
                      segment_ids=seg, kv_segment_ids=kv_seg, scale=self.scale,
                      implementation=implementation or self.implementation)
        return poison_rows(self._out(o), overflow), cache


# ================================================================== blocks and stacks

class TransformerBlock(nn.Module):
    """Linen twin of :class:`jaxpos.nnx.TransformerBlock` (pre-LN, RMSNorm, GELU MLP).
    Fields as :class:`MultiHeadAttention` plus ``mlp_dim`` (default ``4 * d_model``)."""

    d_model: int
    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    mlp_dim: int | None = None
    position: Any = "nope"
    causal: bool = False
    rotary_dim: int | None = None
    rope_base: float = 10000.0
    num_buckets: int = 32
    max_distance: int | None = None
    scale: float | None = None
    implementation: str | None = None
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    def setup(self):
        D = _checks.check_positive_int("d_model", self.d_model)
        F = 4 * D if self.mlp_dim is None else _checks.check_positive_int("mlp_dim", self.mlp_dim)
        self.attn_norm = _norm(D, self.param_dtype, "attn_norm")
        self.attn = MultiHeadAttention(
            D, self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            position=self.position, causal=self.causal, rotary_dim=self.rotary_dim,
            rope_base=self.rope_base, num_buckets=self.num_buckets,
            max_distance=self.max_distance, scale=self.scale,
            implementation=self.implementation, dtype=self.dtype,
            param_dtype=self.param_dtype, name="attn")
        self.mlp_norm = _norm(D, self.param_dtype, "mlp_norm")
        self.mlp_in = _linear(D, F, self.param_dtype, "mlp_in")
        self.mlp_out = _linear(F, D, self.param_dtype, "mlp_out")

    def _mlp(self, x):
        h = rms_norm(x, self.mlp_norm.value)
        return x + mlp(h, self.mlp_in.value, self.mlp_out.value, self.dtype)

    def __call__(self, x, **kw) -> jax.Array:
        x = x + self.attn(rms_norm(x, self.attn_norm.value), **kw)
        return self._mlp(x)

    def decode(self, x, cache: KVCache, **kw):
        a, cache = self.attn.decode(rms_norm(x, self.attn_norm.value), cache, **kw)
        return self._mlp(x + a), cache


class _Stack(nn.Module):
    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    position: str = "rope"
    num_kv_heads: int | None = None
    mlp_dim: int | None = None
    max_len: int | None = None
    rope_base: float = 10000.0
    t5_num_buckets: int = 32
    t5_max_distance: int = 128
    shaw_max_distance: int = 16
    implementation: str | None = None
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    _causal = True

    def _name(self):
        return check_position_name("position", self.position)

    def setup(self):
        V = _checks.check_positive_int("vocab_size", self.vocab_size)
        D, N, Nk, H = attention_dims(self.d_model, self.num_heads, self.num_kv_heads, None)
        L = _checks.check_positive_int("num_layers", self.num_layers)
        name, causal = self._name(), self._causal
        if self.max_len is not None:
            _checks.check_positive_int("max_len", self.max_len)
        self.embed = _Kernel((V, D), self.param_dtype, "embedding", token_embedding_init(D),
                             name="embed")
        self.abs_position = None
        self.rel_position = None
        if name == "sinusoidal":
            self.abs_position = SinusoidalEmbedding(D, dtype=self.dtype, name="abs_position")
        elif name == "learned":
            if self.max_len is None:
                raise ValueError("position='learned' needs max_len (the number of table rows); "
                                 "got max_len=None.")
            self.abs_position = LearnedPositionalEmbedding(
                self.max_len, D, param_dtype=self.param_dtype, name="abs_position")
        elif name == "rope":
            self.rel_position = RotaryEmbedding(H, base=self.rope_base, name="rel_position")
        elif name == "alibi":
            self.rel_position = ALiBi(N, bidirectional=not causal, name="rel_position")
        elif name == "t5":
            self.rel_position = T5RelativeBias(
                N, num_buckets=self.t5_num_buckets, max_distance=self.t5_max_distance,
                bidirectional=not causal, d_model=D, param_dtype=self.param_dtype,
                name="rel_position")
        layer_pos = name if name == "shaw" else "nope"
        self.blocks = [
            TransformerBlock(D, N, num_kv_heads=Nk, mlp_dim=self.mlp_dim, position=layer_pos,
                             causal=causal,
                             max_distance=self.shaw_max_distance if layer_pos == "shaw" else None,
                             implementation=self.implementation, dtype=self.dtype,
                             param_dtype=self.param_dtype, name=f"blocks_{i}")
            for i in range(L)]
        self.final_norm = _norm(D, self.param_dtype, "final_norm")

    def _embed(self, tokens, pos):
        tokens = check_tokens(tokens, self.vocab_size)
        x = embed_tokens(self.embed.value, tokens, self.d_model, self.dtype)
        if self.abs_position is not None:
            x = x + self.abs_position(pos).astype(self.dtype)
        return x

    def _scheme(self, rope_scaling):
        name = self._name()
        if name == "shaw":
            no_rope_scaling("shaw", rope_scaling)
            return None
        if self.rel_position is None:
            no_rope_scaling(name, rope_scaling)
            return _schemes.NoPE()
        return _scheme_of(self.rel_position, rope_scaling)

    def _hidden(self, tokens, positions, rope_scaling, implementation, mask=None,
                segment_ids=None):
        _checks.check_rank("tokens", tokens, (2,), "[batch, seq] token ids")
        check_learned_length(self._name(), self.max_len, _checks.shape_of(tokens)[1], positions)
        pos = default_positions(_checks.shape_of(tokens), positions)
        x = self._embed(tokens, pos)
        scheme = self._scheme(rope_scaling)
        impl = implementation or self.implementation
        for block in self.blocks:
            x = block(x, positions=pos, mask=mask, segment_ids=segment_ids, scheme=scheme,
                      implementation=impl)
        return rms_norm(x, self.final_norm.value)


class DecoderLM(_Stack):
    """Linen twin of :class:`jaxpos.nnx.DecoderLM`: a causal decoder-only language model
    with any position scheme (fields = the NNX constructor's arguments).

    ``__call__(tokens [B, T], *, positions=None, rope_scaling=None, implementation=None,
    segment_ids=None)`` -> float32 logits ``[B, T, vocab_size]``;
    ``init_cache(batch, max_len)`` (no parameters needed) and
    ``apply(..., tokens, cache, method="decode_step")`` -> ``(logits, cache)``.
    Raises as the NNX twin (``"learned"`` past ``max_len`` raises ``ValueError``).
    """

    position: str = "rope"
    _causal = True

    def __call__(self, tokens, *, positions=None, rope_scaling=None, implementation=None,
                 segment_ids=None) -> jax.Array:
        h = self._hidden(tokens, positions, rope_scaling, implementation,
                         segment_ids=segment_ids)
        return tied_logits(h, self.embed.value)

    @nn.nowrap
    def init_cache(self, batch: int, max_len: int, dtype=None) -> tuple[KVCache, ...]:
        """One empty :class:`jaxpos.nnx.KVCache` per layer."""
        _, _, Nk, H = attention_dims(self.d_model, self.num_heads, self.num_kv_heads, None)
        L = _checks.check_positive_int("num_layers", self.num_layers)
        return tuple(init_kv_cache(batch, max_len, Nk, H, dtype or self.dtype) for _ in range(L))

    def decode_step(self, tokens, cache, *, positions=None, rope_scaling=None,
                    implementation=None):
        """As :meth:`jaxpos.nnx.DecoderLM.decode_step`."""
        if not isinstance(cache, (tuple, list)) or len(cache) != self.num_layers:
            raise ValueError(f"cache must be a tuple of {self.num_layers} KVCache (from "
                             f"init_cache); got {type(cache).__name__}.")
        _checks.check_rank("tokens", tokens, (2,), "[batch, seq] token ids")
        B, T = _checks.shape_of(tokens)
        if positions is None:
            positions = cache[0].length[:, None] + jnp.arange(T, dtype=jnp.int32)
        pos = _checks.positions_2d("positions", positions, B, T)
        x = self._embed(tokens, pos)
        scheme = self._scheme(rope_scaling)
        impl = implementation or self.implementation
        new = []
        for block, c in zip(self.blocks, cache):
            x, c = block.decode(x, c, positions=pos, scheme=scheme, implementation=impl)
            new.append(c)
        h = rms_norm(x, self.final_norm.value)
        return tied_logits(h, self.embed.value), tuple(new)


class Encoder(_Stack):
    """Linen twin of :class:`jaxpos.nnx.Encoder`: bidirectional stack, default
    ``position="nope"``; returns final-normalised hidden states ``[B, T, d_model]``."""

    position: str = "nope"
    _causal = False

    def __call__(self, tokens, *, positions=None, mask=None, segment_ids=None,
                 rope_scaling=None, implementation=None) -> jax.Array:
        return self._hidden(tokens, positions, rope_scaling, implementation, mask=mask,
                            segment_ids=segment_ids)
