"""Pieces shared by the example models: checked token lookup, padding -> positions and
segment ids, decoding on the library's KV caches (:class:`DecoderCall`,
:class:`CachedDecoderMixin`), and loading a Hugging Face PyTorch state dict into an NNX
module with every key and shape checked.

Padding is expressed the jaxpos way, as position and segment arrays (docs/modules.md,
"Using jaxpos in your Flax model"; ``jaxpos.attention``'s docstring): a real token has
segment id 1 and a padding token (or an unwritten cache slot) segment id 0 on the key side,
while every query has segment id 1, so a query sees exactly the real keys, as Hugging
Face's key-padding masks do. Positions of real tokens are ``cumsum(attention_mask) - 1``
(what ``generate`` passes for left padding).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxpos
from jaxpos import _checks
from jaxpos.core.engines import takes_kv_lengths
from jaxpos.layers.cache import CacheRead, check_cache, new_cache, poison_rows
from jaxpos.mods import ChunkedAttentionMask, SlidingWindowMask

__all__ = [
    "CachedDecoderMixin",
    "ChunkedAttentionMask",
    "DecoderCall",
    "SlidingWindowMask",
    "embed_tokens",
    "init_layer_caches",
    "key_segments",
    "linear_kernel",
    "load_params",
    "mask_kwargs",
    "padding_positions",
    "query_segments",
    "to_numpy",
]


# ------------------------------------------------------------------------------ inputs
def check_token_ids(name: str, ids, vocab_size: int) -> jax.Array:
    """Validate integer token ids ``[B, T]``; concrete ids outside ``[0, vocab_size)`` raise.

    Raises:
      ValueError: not rank 2, or (when not traced) an id outside the vocabulary.
      TypeError: non-integer ids.
    """
    _checks.check_integer_positions(name, ids)
    _checks.check_rank(name, ids, (2,), "[batch, seq]")
    if _checks.is_concrete(ids):
        a = np.asarray(ids)
        bad = (a < 0) | (a >= vocab_size)
        if bad.any():
            raise ValueError(f"{name} must lie in [0, {vocab_size}) (the vocabulary); got values "
                             f"from {a.min()} to {a.max()} ({int(bad.sum())} outside).")
    return jnp.asarray(ids, jnp.int32)


def embed_tokens(table, ids) -> jax.Array:
    """Rows of ``table`` ``[vocab, d]`` for ``ids`` ``[B, T]`` -> ``[B, T, d]``.

    ``jnp.take`` would clamp or fill silently; here concrete out-of-range ids raise
    (:func:`check_token_ids`) and traced ones give NaN rows, so the error is loud.
    """
    ids = check_token_ids("input_ids", ids, table.shape[0])
    valid = (ids >= 0) & (ids < table.shape[0])
    rows = table[jnp.clip(ids, 0, table.shape[0] - 1)]
    return jnp.where(valid[..., None], rows, jnp.array(jnp.nan, rows.dtype))


def check_attention_mask(attention_mask, batch: int, seq: int):
    """``attention_mask`` ``[B, T]`` of 0/1 (or bool) -> int32, or ``None``."""
    if attention_mask is None:
        return None
    shp = _checks.shape_of(attention_mask)
    if shp != (batch, seq):
        raise ValueError(f"attention_mask must have shape [B, T] = [{batch}, {seq}] (1 = real "
                         f"token, 0 = padding); got {shp}.")
    return jnp.asarray(attention_mask).astype(jnp.int32)


def padding_positions(attention_mask, start=None) -> jax.Array:
    """Positions of real tokens from a 0/1 mask ``[B, T]``: ``start + cumsum(mask) - 1``,
    0 for padding (padding keys are hidden by segment ids, so their position is unused).

    ``start`` (int32 ``[B]``) is the number of real tokens already in a KV cache.
    """
    m = jnp.asarray(attention_mask, jnp.int32)
    pos = jnp.cumsum(m, axis=-1) - 1
    if start is not None:
        pos = pos + start[:, None]
    return jnp.where(m > 0, pos, 0).astype(jnp.int32)


def query_segments(batch: int, seq: int) -> jax.Array:
    """Every query is in segment 1 (it sees all real keys, as HF's key-padding mask)."""
    return jnp.ones((batch, seq), jnp.int32)


def key_segments(attention_mask, batch: int, seq: int) -> jax.Array:
    """Segment 1 for real keys, 0 for padding (hidden from every query)."""
    if attention_mask is None:
        return jnp.ones((batch, seq), jnp.int32)
    return (jnp.asarray(attention_mask) > 0).astype(jnp.int32)


# ------------------------------------------------------------------------------ masks
def mask_kwargs(mask_mod, *, q_positions, kv_positions, implementation=None, block_q=None,
                block_k=None) -> dict:
    """Keyword arguments of :func:`jaxpos.attention` for one layer's ``mask_mod``: ``{}`` for
    None; a :class:`jaxpos.BlockMask` of it (empty tiles skipped) when a tiled
    implementation (``"chunked"``, ``"pallas"``) runs with both block sizes given; else
    ``{"mask_mod": mask_mod}`` with the block sizes passed through.
    """
    blocks = {"block_q": block_q, "block_k": block_k}
    if mask_mod is None:
        return blocks
    if implementation in ("chunked", "pallas") and block_q and block_k:
        bm = jaxpos.create_block_mask(mask_mod, q_positions=q_positions,
                                      kv_positions=kv_positions, block_q=block_q,
                                      block_k=block_k)
        return {"block_mask": bm}
    return {"mask_mod": mask_mod, **blocks}


# -------------------------------------------------------- decoding on the library caches
def init_layer_caches(batch: int, max_len: int, layers, dtype=jnp.float32, *,
                      keep_first: int | None = None, **cache_options) -> tuple:
    """One empty library cache per attention layer (:func:`jaxpos.layers.cache.new_cache`):
    the dense :class:`jaxpos.layers.cache.KVCache` by default, the StreamingLLM cache with
    ``keep_first``, the paged cache with ``page_size=`` / ``num_pages=`` (what
    :class:`jaxpos.serving.ModuleDecoder` asks for).

    Args:
      batch, max_len: rows and slots per row (prompt, padding and generated tokens).
      layers: ``(num_kv_heads, head_dim)`` per layer (layers may differ).
      dtype: of the stored keys and values.

    Raises:
      ValueError / TypeError: bad sizes, or options that select no cache type or two.
    """
    return tuple(new_cache(batch, max_len, nk, h, dtype, keep_first=keep_first,
                           **cache_options) for nk, h in layers)


def check_layer_caches(cache, num_layers: int, batch: int) -> tuple:
    """``cache`` must be a tuple of ``num_layers`` library caches of ``batch`` rows
    (from ``init_cache``).

    Raises:
      TypeError: not a tuple or list of :class:`jaxpos.layers.cache.Cache`.
      ValueError: the wrong number of layers or rows.
    """
    if not isinstance(cache, (tuple, list)) or len(cache) != num_layers:
        raise ValueError(f"cache must be a tuple of {num_layers} layer caches (from "
                         f"init_cache); got {type(cache).__name__}"
                         f"{f' of {len(cache)}' if isinstance(cache, (tuple, list)) else ''}.")
    return tuple(check_cache(c, batch) for c in cache)


class DecoderCall:
    """The plumbing every decoder port shares for one call: checked ids and padding mask,
    Hugging Face positions (``cumsum(attention_mask) - 1`` after the tokens each row's
    cache holds), segment ids, and one attention call per layer, with or without a library
    cache (:mod:`jaxpos.layers.cache`: dense, StreamingLLM or paged, through the
    :class:`~jaxpos.layers.cache.Cache` protocol only).

    A port computes its layer's raw (unrotated) ``q``, ``k``, ``v`` and calls
    :meth:`attend`; then :meth:`finish` with the logits. Without a cache the call is one
    :func:`jaxpos.attention` over the new tokens (queries in segment 1, padding keys in
    segment 0). With a cache, the layer's cache stores the scheme's
    :meth:`~jaxpos.PositionScheme.cache_write` (RoPE keys rotated once, with the call's
    frequencies, as Hugging Face's decoding does) and attention reads what it hands back
    (:class:`jaxpos.layers.cache.CacheRead`), bounded by the fill counts.

    Args:
      input_ids: int ``[B, T]``; attention_mask: 0/1 ``[B, T]`` or None (all tokens);
      positions: int ``[B, T]`` or None (the default above); cache: a tuple of
      ``num_layers`` caches or None; implementation, block_q, block_k: passed to
      :func:`jaxpos.attention` (with both block sizes and a tiled implementation a
      ``mask_mod`` becomes a :class:`jaxpos.BlockMask`, built once per call and mask).

    Attributes:
      B, T, mask (int32 ``[B, T]``), positions (int32 ``[B, T]``), cache.

    Raises:
      ValueError / TypeError: a bad mask shape, positions, or cache.
    """

    def __init__(self, input_ids, *, attention_mask=None, positions=None, cache=None,
                 num_layers: int, implementation=None, block_q=None, block_k=None):
        _checks.check_rank("input_ids", input_ids, (2,), "[batch, seq]")
        self.B, self.T = B, T = _checks.shape_of(input_ids)
        mask = check_attention_mask(attention_mask, B, T)
        self.mask = jnp.ones((B, T), jnp.int32) if mask is None else mask
        caches = None if cache is None else check_layer_caches(cache, num_layers, B)
        self.cache = caches
        if positions is None:
            positions = padding_positions(
                self.mask, None if caches is None else caches[0].token_count()[:, 0])
        self.positions = jnp.broadcast_to(
            jnp.asarray(_checks.positions_2d("positions", positions, B, T), jnp.int32), (B, T))
        self.implementation, self.block_q, self.block_k = implementation, block_q, block_k
        self._new: list = []
        self._poison = jnp.zeros((B,), bool)
        self._masks: dict = {}

    def _mask_kw(self, mask_mod, q_positions, kv_positions, paged: bool,
                 at_slots: bool = False) -> dict:
        if paged:  # a block mask of gathered rows would not index the pages
            blocks = {"block_q": self.block_q, "block_k": self.block_k}
            return blocks if mask_mod is None else {"mask_mod": mask_mod, **blocks}
        key = (mask_mod, at_slots)
        if key not in self._masks:  # layers of one call share positions
            self._masks[key] = mask_kwargs(
                mask_mod, q_positions=q_positions, kv_positions=kv_positions,
                implementation=self.implementation, block_q=self.block_q, block_k=self.block_k)
        return self._masks[key]

    def write(self, layer: int, scheme, q, k, v) -> CacheRead:
        """Store layer ``layer``'s new tokens in its cache through the
        :class:`~jaxpos.layers.cache.Cache` protocol and return what the cache hands
        attention (:class:`~jaxpos.layers.cache.CacheRead`): for a port that runs its own
        attention call on the cached keys and values (DeepSeek-V3's latent attention).
        :meth:`attend` is this plus the one :func:`jaxpos.attention` call.

        Args:
          layer: the layer's index (layers are written in order, once each).
          scheme: the :class:`jaxpos.PositionScheme` whose ``cache_write`` decides what is
            stored (:class:`jaxpos.NoPE` stores ``k``, ``v`` as given).
          q: ``[B, T, N, H]``; k, v: ``[B, T, N_kv, H]``, the new tokens (raw).

        Raises:
          ValueError: no cache; a layer out of order; the cache's own errors (overflow).
        """
        if self.cache is None:
            raise ValueError("DecoderCall.write needs a cache (the call was made without one).")
        if layer != len(self._new):
            raise ValueError(f"layer {layer} attended out of order (expected layer "
                             f"{len(self._new)}).")
        cache, read = self.cache[layer].write(scheme, q, k, v, self.positions, self.mask > 0)
        self._new.append(cache)
        self._poison = self._poison | read.poison
        return read

    def attend(self, layer: int, q, k, v, *, scheme, mask_mod=None, sinks=None,
               scale=None, at_slots: bool = False) -> jax.Array:
        """Causal attention of layer ``layer``: ``q`` ``[B, T, N, H]``, ``k``, ``v``
        ``[B, T, N_kv, H]`` raw projections of the new tokens, ``scheme`` the layer's
        :class:`jaxpos.PositionScheme`; ``mask_mod``, ``sinks`` ``[N]`` and ``scale`` as in
        :func:`jaxpos.attention`. Returns ``[B, T, N, H]`` (layers must be attended in
        order, once each, when there is a cache).

        ``at_slots``: the layer attends at cache slot indices instead of the text's
        positions: slot ``s`` of a row is the ``s``-th token it was handed, padding
        counted (Hugging Face's ``cache_position``, ``arange(T)`` in a call without a
        cache). Llama 4's NoPE layers take their causality and attention temperature from
        them (HF ``Llama4TextAttention``); they differ from the text's positions by a row's
        left padding. The slots come from the read: the new tokens are the last
        ``T`` of the row's ``kv_lengths`` filled slots (every cache holding rows of slots
        at the text's positions: dense, paged). A cache that re-numbers its tokens
        (StreamingLLM) keeps the read's positions. A ragged step (the token-budget loop)
        never reaches Llama 4's NoPE layers: the ragged cache refuses their
        ``TemperatureTunedNoPE`` scheme (it refuses every scheme with its own
        ``transform_qk``), so :class:`jaxpos.serving.ServingEngine` runs the port's token
        budget in padded steps.
        """
        if self.cache is None:
            pos = (jnp.arange(self.T, dtype=jnp.int32)[None] if at_slots else self.positions)
            kw = self._mask_kw(mask_mod, pos, pos, False, at_slots)
            return jaxpos.attention(
                q, k, v, position=scheme, q_positions=pos, kv_positions=pos, causal=True,
                segment_ids=query_segments(self.B, self.T),
                kv_segment_ids=key_segments(self.mask, self.B, self.T), sinks=sinks,
                scale=scale, implementation=self.implementation, **kw)
        text_positions = type(self.cache[layer]).text_positions
        read = self.write(layer, scheme, q, k, v)
        if at_slots and text_positions and read.cu_q_lengths is None:
            S = read.kv_positions.shape[-1]
            first = read.kv_lengths[:, None] - self.T  # the row's slots before this call
            read = read._replace(
                q_positions=first + jnp.arange(self.T, dtype=jnp.int32)[None],
                kv_positions=jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32),
                                              read.kv_positions.shape))
        extra = read.keywords()
        rq = read.q
        if read.cu_q_lengths is not None:  # a ragged step: packed rows, no segment ids
            return jaxpos.attention(
                rq[0], read.k.astype(rq.dtype), read.v.astype(rq.dtype), position=read.scheme,
                q_positions=read.q_positions[0], kv_positions=read.kv_positions, causal=True,
                mask_mod=mask_mod, sinks=sinks, scale=scale,
                implementation=self.implementation,
                **dict(extra, kv_lengths=read.kv_lengths))[None]
        if takes_kv_lengths(self.implementation):  # a step costs the filled length
            extra["kv_lengths"] = read.kv_lengths
        extra.update(self._mask_kw(mask_mod, read.q_positions, read.kv_positions,
                                   read.page_table is not None, at_slots))
        return jaxpos.attention(
            rq, read.k.astype(rq.dtype), read.v.astype(rq.dtype), position=read.scheme,
            q_positions=read.q_positions, kv_positions=read.kv_positions, causal=True,
            segment_ids=read.segment_ids, kv_segment_ids=read.kv_segment_ids, sinks=sinks,
            scale=scale, implementation=self.implementation, **extra)

    def finish(self, logits) -> tuple[jax.Array, tuple | None]:
        """``(logits float32, caches)``: with a cache, the rows whose write overflowed (a
        traced call; a concrete one raised) are NaN and ``caches`` is the new tuple."""
        logits = jnp.asarray(logits).astype(jnp.float32)
        if self.cache is None:
            return logits, None
        if len(self._new) != len(self.cache):
            raise ValueError(f"{len(self._new)} of {len(self.cache)} layers attended.")
        return poison_rows(logits, self._poison), tuple(self._new)


class CachedDecoderMixin:
    """``init_cache``, ``decode_step`` and ``vocab_size`` for a port whose ``__call__(ids,
    *, attention_mask, positions, cache, implementation)`` runs a :class:`DecoderCall`, so
    :class:`jaxpos.serving.ModuleDecoder` serves it. A port sets :meth:`cache_layers`
    (default: ``num_hidden_layers`` layers of ``(num_key_value_heads, head_dim)`` from
    ``self.config``)."""

    config: Any

    if TYPE_CHECKING:  # the port's own __call__
        def __call__(self, input_ids, **kw: Any) -> tuple[jax.Array, Any]: ...

    @property
    def vocab_size(self) -> int:
        """Token ids the model takes (the width of the logits)."""
        return int(self.config.vocab_size)

    def cache_layers(self) -> list[tuple[int, int]]:
        """``(num_kv_heads, head_dim)`` of each attention layer's cache."""
        c = self.config
        return [(c.num_key_value_heads, c.head_dim)] * c.num_hidden_layers

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32, *,
                   keep_first: int | None = None, **cache_options) -> tuple:
        """One empty library cache per layer (:func:`init_layer_caches`): dense by default,
        StreamingLLM with ``keep_first``, paged with ``page_size=`` / ``num_pages=``.

        Raises:
          ValueError / TypeError: bad sizes or options.
        """
        return init_layer_caches(batch, max_len, self.cache_layers(), dtype,
                                 keep_first=keep_first, **cache_options)

    def decode_step(self, tokens, cache, *, positions=None, attention_mask=None,
                    implementation=None) -> tuple[jax.Array, tuple]:
        """``tokens [B, T]`` against ``cache`` (from :meth:`init_cache`): ``(logits
        float32 [B, T, vocab_size], cache)``; the protocol of
        :class:`jaxpos.serving.ModuleDecoder`."""
        return self(tokens, attention_mask=attention_mask, positions=positions, cache=cache,
                    implementation=implementation)


def check_head_groups(config) -> None:
    """``ValueError`` unless ``config.num_attention_heads`` is a multiple of
    ``config.num_key_value_heads`` (grouped-query attention, Ainslie et al. 2023)."""
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(f"num_attention_heads ({config.num_attention_heads}) must be a multiple "
                         f"of num_key_value_heads ({config.num_key_value_heads}).")


# ------------------------------------------------------------------------ conversion
def to_numpy(t) -> np.ndarray:
    """A torch tensor (or array) as a float32/int NumPy array, detached, on the CPU."""
    if hasattr(t, "detach"):
        t = t.detach().cpu()
        if str(t.dtype) in ("torch.bfloat16", "torch.float16"):
            t = t.float()
        t = t.numpy()
    return np.asarray(t)


def linear_kernel(w) -> np.ndarray:
    """``torch.nn.Linear`` weight ``[out, in]`` -> Flax ``kernel`` ``[in, out]``."""
    return to_numpy(w).T


def load_params(model: nnx.Module, state_dict: Mapping[str, Any],
                mapping: Mapping[tuple, tuple[str, Callable[[Any], np.ndarray]]],
                *, ignore: Callable[[str], bool] = lambda key: False) -> nnx.Module:
    """Write HF tensors into ``model``'s parameters, checking everything.

    Args:
      model: the NNX module (its parameter values are replaced in place).
      state_dict: Hugging Face ``model.state_dict()`` (torch tensors or arrays).
      mapping: ``{nnx parameter path: (HF key, transform)}``; ``transform`` turns the
        tensor into the parameter's layout (e.g. :func:`linear_kernel`).
      ignore: HF keys that are allowed to stay unused (tied heads, rotary buffers).

    Raises:
      ValueError: a parameter of ``model`` without a mapping, a missing HF key, a shape
        mismatch (naming the key, the shape got and the shape expected), or an HF key
        left unused that ``ignore`` does not accept.
    """
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    missing = [p for p in params if p not in mapping]
    if missing:
        raise ValueError(f"no Hugging Face source for parameters {missing[:5]} "
                         f"({len(missing)} in all).")
    used = set()
    for path, (key, transform) in mapping.items():
        if path not in params:
            raise ValueError(f"mapping names parameter {path}, which the model does not have.")
        if key not in state_dict:
            raise ValueError(f"state_dict has no key {key!r} (needed for parameter {path}).")
        var = params[path]
        arr = np.asarray(transform(state_dict[key]))
        want = tuple(var.get_value().shape)
        if arr.shape != want:
            raise ValueError(f"{key!r} converts to shape {arr.shape}, but parameter {path} "
                             f"has shape {want}.")
        var.set_value(jnp.asarray(arr, var.get_value().dtype))
        used.add(key)
    unused = [k for k in state_dict if k not in used and not ignore(k)]
    if unused:
        raise ValueError(f"state_dict keys not used by the conversion: {unused[:5]} "
                         f"({len(unused)} in all); is this the right model family?")
    return model
