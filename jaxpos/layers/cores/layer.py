"""The cores of one layer: the position modules' (:class:`SinusoidalCore`,
:class:`LearnedCore`, :class:`PositionCore`), attention's (:class:`AttentionCore`: the
projections, the scheme, :func:`jaxpos.attention` or the scheme's own attention, the
cached decode) and the transformer block's (:class:`BlockCore`), with
:func:`param_value`, which reads a parameter of either twin.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos.core.engines import takes_kv_lengths
from jaxpos.core.entry import attention
from jaxpos.layers.cache import (
    Cache,
    CacheRead,
    check_cache,
    decode_state_cache,
    new_cache,
    poison_rows,
)
from jaxpos.layers.functional import (
    attention_inputs,
    check_attention_input,
    check_attention_mask,
    fill_hidden_positions,
    merge_heads,
    mlp,
    padding_segment_ids,
    positions_from_mask,
    project_heads,
    rms_norm,
    sinusoidal_embedding,
)
from jaxpos.layers.options import build_scheme, check_mask_mod, no_rope_scaling
from jaxpos.parallel.context import layer_attention
from jaxpos.schemes.base import NoPE, PositionScheme
from jaxpos.schemes.learned import learned_positions
from jaxpos.sharding import constrain, retype, run_auto

__all__ = ["AttentionCore", "BlockCore", "LearnedCore", "PositionCore", "SinusoidalCore",
           "attention_for", "param_value", "position_scheme"]

def attention_for(scheme: PositionScheme) -> Callable[..., jax.Array]:
    """:func:`jaxpos.attention`, or the scheme's own ``attention`` when the scheme replaces
    softmax attention (``replaces_softmax``: :class:`jaxpos.schemes.stick_breaking.StickBreaking`);
    both take the same keywords."""
    return scheme.attention if getattr(scheme, "replaces_softmax", False) else attention


def param_value(v: Any) -> jax.Array:
    """The array of an :class:`flax.nnx.Variable` (NNX) or the array itself (Linen),
    re-typed for a full pass that runs Explicit mesh axes as Auto
    (:func:`jaxpos.sharding.retype`)."""
    return retype(v[...] if isinstance(v, nnx.Variable) else v)


class SinusoidalCore:
    """The call of :class:`jaxpos.nnx.SinusoidalEmbedding` and its Linen twin (fields ``d_model``,
    ``base``, ``layout``, ``dtype``)."""

    if TYPE_CHECKING:  # attributes and methods of the NNX / Linen class mixing this in
        def __getattr__(self, name: str) -> Any: ...

    def __call__(self, positions: ArrayLike) -> jax.Array:
        return sinusoidal_embedding(positions, self.d_model, self.base, self.layout, self.dtype)


class LearnedCore:
    """The call of :class:`jaxpos.nnx.LearnedPositionalEmbedding` and its Linen twin (``table``,
    ``out_of_range``)."""

    if TYPE_CHECKING:  # attributes and methods of the NNX / Linen class mixing this in
        def __getattr__(self, name: str) -> Any: ...

    def __call__(self, positions: ArrayLike) -> jax.Array:
        return learned_positions(param_value(self.table), positions, out_of_range=self.out_of_range)


class PositionCore:
    """``scheme()`` of :class:`jaxpos.nnx.PositionModule` and its Linen twin. Subclasses give
    ``_spec()`` -> ``(position, num_heads, head_dim, causal, options)`` and
    ``_scheme_params()`` -> ``{name: array}``."""

    if TYPE_CHECKING:  # attributes and methods of the NNX / Linen class mixing this in
        def __getattr__(self, name: str) -> Any: ...

    def scheme(self, rope_scaling: Any = None, *, x: jax.Array | None = None,
               positions: ArrayLike | None = None) -> PositionScheme:
        """The scheme object for one call (:func:`build_scheme`): built from the module's
        parameters by the scheme class's ``from_params`` (gradients flow to them).

        Args:
          rope_scaling: a :mod:`jaxpos.schemes.rope.scaling` dataclass for this call only
            (``ValueError`` for a scheme that does not take it).
          x: ``[B, T, D]`` the layer's input; positions: int ``[B|1, T]``; both optional,
            for schemes computed from the tokens (FoX's forget gates).

        Returns:
          a :class:`jaxpos.PositionScheme`.
        """
        position, num_heads, head_dim, causal, options = self._spec()
        return build_scheme(position, self._scheme_params(), num_heads=num_heads,
                            head_dim=head_dim, causal=causal, options=options,
                            rope_scaling=rope_scaling, x=x, positions=positions)


def position_scheme(module: Any, rope_scaling: Any = None, *, x: jax.Array | None = None,
                    positions: ArrayLike | None = None) -> PositionScheme:
    """The scheme object of an attention-position module for one call: ``module.scheme(
    rope_scaling, x=x, positions=positions)``; ``None`` -> :class:`jaxpos.NoPE`.

    Raises:
      ValueError: ``rope_scaling`` for a scheme that does not take it.
    """
    if module is None:
        no_rope_scaling("nope", rope_scaling)
        return NoPE()
    return module.scheme(rope_scaling, x=x, positions=positions)


# ================================================================== attention

class AttentionCore:
    """The computation of :class:`jaxpos.nnx.MultiHeadAttention` and its Linen twin. Subclasses
    declare ``q_proj``/``k_proj``/``v_proj``/``o_proj`` (``kernel``, ``bias``), fields
    ``causal``, ``scale``, ``implementation``, ``dtype``, ``mask_mod`` (a callable or
    None), and give ``_dims()`` -> ``(d_model, num_heads, num_kv_heads, head_dim)``,
    ``_position()`` (the position module or None), ``_cache_scheme()`` (``(name,
    options)`` of the layer's scheme, or None: the decode state of its cache) and
    ``_sinks()`` (the sink logits ``[num_heads]``, or None for a layer without sinks); for
    dropout a field
    ``dropout_rate`` and ``_is_deterministic(deterministic)`` / ``_dropout_key(rngs)``
    (Flax's conventions of each twin)."""

    if TYPE_CHECKING:  # attributes and methods of the NNX / Linen class mixing this in
        def __getattr__(self, name: str) -> Any: ...

    def _proj(self, layer, x, heads):
        """``x @ layer.kernel (+ bias)`` as ``[B, T, heads, width / heads]``."""
        kernel = param_value(layer.kernel)
        return project_heads(x, kernel, heads, kernel.shape[-1] // heads, self.dtype,
                             param_value(layer.bias))

    def _gated(self, o, x):
        """The output gate of Qiu et al. 2025 ("Gated Attention for Large Language Models",
        §2.2; their best variant G1): each head's output times ``sigmoid(x W_g + b_g)``,
        computed from the layer input ``x`` (the query side), before the output
        projection; elementwise (``W_g [D, N*H]``, head- and feature-specific) or headwise
        (``W_g [D, N]``, one scalar per head). ``o`` unchanged without ``gate_proj``."""
        gate = getattr(self, "gate_proj", None)
        if gate is None:
            return o
        g = self._proj(gate, x, self._dims()[1])  # [B, T, N, H] or [B, T, N, 1]
        return o * jax.nn.sigmoid(g.astype(jnp.float32)).astype(o.dtype)

    def _qk_norm(self, name, t):
        """RMSNorm of queries or keys ``t [B, T, heads, H]`` before the position transform:
        over each head's ``H`` features (Qwen3, Gemma 3, Qwen3-Next) or over the whole
        projection (OLMo 2); ``t`` unchanged without the norm."""
        norm = getattr(self, name, None)
        if norm is None:
            return t
        scale = param_value(norm.scale)
        eps, offset = self.qk_norm_eps, bool(self.qk_norm_offset)
        if np.shape(scale)[-1] == t.shape[-1]:
            return rms_norm(t, scale, eps, offset=offset)
        flat = rms_norm(t.reshape(t.shape[:2] + (-1,)), scale, eps, offset=offset)
        return flat.reshape(t.shape)

    def _out(self, o):
        return merge_heads(o, param_value(self.o_proj.kernel), self.dtype,
                           param_value(self.o_proj.bias))

    def _qkv(self, x, context=None):
        D, N, Nk, _ = self._dims()
        check_attention_input("x", x, D)
        src = x if context is None else context
        return (self._qk_norm("q_norm", self._proj(self.q_proj, x, N)),
                self._qk_norm("k_norm", self._proj(self.k_proj, src, Nk)),
                self._proj(self.v_proj, src, Nk))

    def _scheme(self, scheme, rope_scaling, x, positions) -> PositionScheme:
        if scheme is not None:
            return scheme
        return position_scheme(self._position(), rope_scaling, x=x, positions=positions)

    def _attention_dropout(self, deterministic, rngs) -> dict:
        """The dropout keywords of :func:`jaxpos.attention` for one call: none when the
        layer's ``dropout_rate`` is 0 or the call is deterministic (the twins' Flax
        conventions, ``_is_deterministic`` / ``_dropout_key``)."""
        rate = self.dropout_rate
        if rate == 0.0 or self._is_deterministic(deterministic):
            return {}
        return {"dropout_rate": rate, "dropout_rng": self._dropout_key(rngs)}

    def _mask_mod(self, mask_mod):
        """The call's mask_mod when given (it replaces the layer's), else the layer's."""
        if mask_mod is None:
            return self.mask_mod
        return check_mask_mod("mask_mod", mask_mod)

    def __call__(self, x: jax.Array, *, context: jax.Array | None = None,
                 positions: ArrayLike | None = None, kv_positions: ArrayLike | None = None,
                 mask: ArrayLike | None = None, segment_ids: ArrayLike | None = None,
                 kv_segment_ids: ArrayLike | None = None, scheme: PositionScheme | None = None,
                 rope_scaling: Any = None, implementation: str | None = None,
                 mask_mod: Callable[..., Any] | None = None,
                 attention_mask: ArrayLike | None = None, deterministic: bool | None = None,
                 rngs: Any = None) -> jax.Array:
        # Under a mesh with Explicit axes the pass runs with them Auto (jaxpos.sharding)
        arrays = dict(x=x, context=context, positions=positions, kv_positions=kv_positions,
                      mask=mask, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                      scheme=scheme, attention_mask=attention_mask)
        check_attention_input("x", x, self._dims()[0])
        return run_auto(lambda a: self._full_pass(
            **a, rope_scaling=rope_scaling, implementation=implementation, mask_mod=mask_mod,
            deterministic=deterministic, rngs=rngs), arrays, ("batch", None, None), x.shape)

    def _full_pass(self, x, *, context, positions, kv_positions, mask, segment_ids,
                   kv_segment_ids, scheme, rope_scaling, implementation, mask_mod,
                   attention_mask, deterministic, rngs):
        pad = self._padding(x, context, attention_mask)
        if pad is not None and positions is None:
            positions = positions_from_mask(pad)
        pos, kv_pos = attention_inputs(x, context, positions, kv_positions, kv_segment_ids,
                                       self._dims()[0])
        q, k, v = self._qkv(x, context)
        q = constrain(q, ("batch", None, "heads", None))
        k, v = (constrain(t, ("batch", None, "kv_heads", None)) for t in (k, v))
        # a scheme built from the tokens sees padding as negative positions (FoX gives it
        # no gate)
        scheme = self._scheme(scheme, rope_scaling, x,
                              pos if pad is None else jnp.where(pad, pos, -1))
        if pad is not None:  # tokens never see padding; padding's positions stay in range
            segment_ids = padding_segment_ids(pad, segment_ids)
            pos = kv_pos = fill_hidden_positions(pos, pad)
        attend_fn = attention_for(scheme)
        kw: dict[str, Any] = dict(
                  position=scheme, q_positions=pos, kv_positions=kv_pos, causal=self.causal,
                  mask=mask, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                  scale=self.scale, mask_mod=self._mask_mod(mask_mod), sinks=self._sinks(),
                  implementation=implementation or self.implementation,
                  **self._attention_dropout(deterministic, rngs))
        method = getattr(self, "context_parallel", None)
        if method is None:
            o = attend_fn(q, k, v, **kw)
        else:  # sequence-parallel over the mesh axis context_axis (jaxpos.parallel.context)
            o = layer_attention(method, self.context_axis, q, k, v,
                                softmax=attend_fn is attention, **kw)
        o = constrain(o, ("batch", None, "heads", None))
        return self._out(self._gated(o, x))

    def _padding(self, x, context, attention_mask):
        """The call's padding mask, bool ``[B, T]`` (None without one); self-attention
        only."""
        if attention_mask is None:
            return None
        if context is not None:
            raise ValueError("attention_mask (the padding of x's tokens) applies to "
                             "self-attention only; for cross-attention give segment_ids and "
                             "kv_segment_ids (equal ids attend) or mask.")
        check_attention_input("x", x, self._dims()[0])
        return check_attention_mask(attention_mask, *x.shape[:2])

    def init_cache(self, batch: int, max_len: int, dtype: Any = None, *,
                   keep_first: int | None = None, **cache_options: Any) -> Cache:
        """An empty :class:`KVCache` of ``max_len`` slots for ``batch`` rows (no parameters
        needed); with ``keep_first`` a :class:`StreamingKVCache` (StreamingLLM, Xiao et al.
        2024, §3.2: each row's first ``keep_first`` tokens and its most recent ones,
        positions within the cache; generation runs unboundedly in fixed memory).

        Args:
          batch, max_len: positive ints, rows and slots per row; dtype: of the keys and
            values (default the layer's ``dtype``); keep_first: int in ``[0, max_len)``.
          **cache_options: the options of another registered cache type
            (:func:`jaxpos.layers.cache.register_cache`), which they select.

        Raises:
          ValueError / TypeError: sizes that are not positive ints, a bad ``keep_first``,
            options that select no cache type or two.
        """
        _, N, Nk, H = self._dims()
        cache = new_cache(batch, max_len, Nk, H, dtype or self.dtype, keep_first=keep_first,
                          **cache_options)
        return decode_state_cache(cache, self._cache_scheme(), N, H)

    def _attend_cache(self, read: CacheRead, implementation, mask_mod) -> jax.Array:
        """One attention call of a decode step on what the cache handed
        (:class:`jaxpos.layers.cache.CacheRead`), whatever the cache type."""
        attend_fn = attention_for(read.scheme)
        impl = implementation or self.implementation
        if attend_fn is not attention:
            read = read.unpaged()  # the replacing schemes take rows of slots, not pages
        extra = read.keywords()
        if attend_fn is attention and takes_kv_lengths(impl):
            # the cache's fill counts bound the loop over keys (the segment ids hide the
            # empty slots too, for an engine that takes no lengths)
            extra["kv_lengths"] = read.kv_lengths
        q = read.q
        if read.cu_q_lengths is not None:  # a ragged step: packed rows, no segment ids
            if attend_fn is not attention:
                raise ValueError(f"{type(read.scheme).__name__} replaces softmax attention "
                                 f"and has no ragged form; a token-budget ServingEngine "
                                 f"runs this model in padded steps.")
            return attention(q[0], read.k.astype(q.dtype), read.v.astype(q.dtype),
                             position=read.scheme, q_positions=read.q_positions[0],
                             kv_positions=read.kv_positions, causal=self.causal,
                             scale=self.scale, mask_mod=self._mask_mod(mask_mod),
                             sinks=self._sinks(), implementation=impl,
                             **dict(extra, kv_lengths=read.kv_lengths))[None]
        return attend_fn(q, read.k.astype(q.dtype), read.v.astype(q.dtype),
                         position=read.scheme, q_positions=read.q_positions,
                         kv_positions=read.kv_positions, causal=self.causal,
                         segment_ids=read.segment_ids, kv_segment_ids=read.kv_segment_ids,
                         scale=self.scale, mask_mod=self._mask_mod(mask_mod),
                         sinks=self._sinks(), implementation=impl, **extra)

    def decode(self, x: jax.Array, cache: Cache, *, positions: ArrayLike | None = None,
               scheme: PositionScheme | None = None, rope_scaling: Any = None,
               implementation: str | None = None, mask_mod: Callable | None = None,
               attention_mask: ArrayLike | None = None) -> tuple[jax.Array, Cache]:
        """Attend from ``x [B, T, D]`` (new tokens) to the cache plus themselves.

        ``attention_mask`` (bool or int ``[B, T]``, 1 = token, 0 = padding, Hugging Face's
        convention; default all tokens) is remembered by the cache: no token sees
        padding, in this step or a later one. ``positions`` default to each row's count of
        cached tokens (padding excluded) ``+ cumsum(attention_mask) - 1`` (padding at
        position 1), Hugging Face's positions. The layer's
        mask_mod (or the call's ``mask_mod``) and sinks apply as in the full pass: the
        mask_mod sees the positions of the new tokens and of the cached keys, so a
        sliding window keeps its width at every step. The scheme's
        :meth:`~jaxpos.PositionScheme.cache_write` decides what the cache stores (RoPE keys
        rotated once, at write; raw keys for the schemes applied inside attention from the
        cached positions; see :func:`rotate_at_write`). The cache's fill counts bound the
        attention (``kv_lengths``), so a step costs the filled length, not ``max_len``; a
        :class:`StreamingKVCache` (``init_cache(..., keep_first=k)``) attends at places in
        the cache, RoPE rotated on load. Returns ``(y [B, T, D],
        cache)``. Raises ``ValueError`` when concrete fill counts would overflow the cache;
        traced overflow gives NaN for the rows concerned.
        """
        q, k, v = self._qkv(x)
        B, T = x.shape[:2]
        check_cache(cache, B)
        pad = check_attention_mask(attention_mask, B, T)
        if positions is None:
            positions = positions_from_mask(jnp.ones((B, T), bool) if pad is None else pad,
                                            cache.token_count())
        pos = _checks.positions_2d("positions", positions, B, T)
        # the new tokens' scheme in token order (FoX's gates); the cache places them
        scheme = self._scheme(scheme, rope_scaling, x, None)
        cache, read = cache.write(scheme, q, k, v, pos, pad)
        o = self._attend_cache(read, implementation, mask_mod)
        return poison_rows(self._out(self._gated(o, x)), read.poison), cache


class BlockCore:
    """The computation of :class:`jaxpos.nnx.TransformerBlock` and its Linen twin
    (``attn_norm``, ``attn``, ``mlp_norm``, ``mlp_in``, ``mlp_out``, ``dtype``)."""

    if TYPE_CHECKING:  # attributes and methods of the NNX / Linen class mixing this in
        def __getattr__(self, name: str) -> Any: ...

    def _mlp(self, x, deterministic: bool | None = True, rngs=None):
        h = rms_norm(x, param_value(self.mlp_norm.scale))
        return x + self._residual_dropout(
            mlp(h, param_value(self.mlp_in.kernel), param_value(self.mlp_out.kernel),
                self.dtype), deterministic, rngs)

    def _residual_dropout(self, y, deterministic, rngs):
        """``y`` (a residual branch) with dropout at the block's ``dropout_rate``: each
        element zeroed with that rate, the rest scaled by ``1 / (1 - rate)`` (Srivastava et
        al. 2014; the residual dropout of Vaswani et al. 2017, Sec. 5.4); ``y`` itself when
        the rate is 0 or the call is deterministic."""
        rate = self.dropout_rate
        if rate == 0.0 or self._is_deterministic(deterministic):
            return y
        keep = jax.random.bernoulli(self._dropout_key(rngs), 1.0 - rate, y.shape)
        return jnp.where(keep, y / jnp.asarray(1.0 - rate, y.dtype), 0).astype(y.dtype)

    def __call__(self, x: jax.Array, *, deterministic: bool | None = None, rngs: Any = None,
                 **kw: Any) -> jax.Array:
        a = self.attn(rms_norm(x, param_value(self.attn_norm.scale)),
                      deterministic=deterministic, rngs=rngs, **kw)
        x = x + self._residual_dropout(a, deterministic, rngs)
        return self._mlp(x, deterministic, rngs)

    def decode(self, x: jax.Array, cache: Cache, **kw: Any) -> tuple[jax.Array, Cache]:
        """As :meth:`jaxpos.nnx.MultiHeadAttention.decode`, then the MLP: ``(y, cache)``."""
        a, cache = self.attn.decode(rms_norm(x, param_value(self.attn_norm.scale)), cache, **kw)
        return self._mlp(x + a), cache
