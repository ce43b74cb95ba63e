"""The cores of a stack of layers: :class:`StackCore` (embedding, the stack's position
scheme, the blocks, the final norm), :class:`DecoderCore` (the causal LM: forward pass,
context-parallel zigzag order, KV caches and ``decode_step``) and :class:`EncoderCore`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos.layers.cache import Cache, check_cache, decode_state_cache, new_cache
from jaxpos.layers.cores.layer import param_value, position_scheme
from jaxpos.layers.functional import (
    check_attention_mask,
    check_tokens,
    default_positions,
    embed_tokens,
    positions_from_mask,
    rms_norm,
    tied_logits,
)
from jaxpos.layers.options import ABSOLUTE_POSITIONS, check_learned_length
from jaxpos.parallel.context import zigzag_order
from jaxpos.schemes.base import REGISTRY
from jaxpos.sharding import constrain, run_auto

__all__ = ["DecoderCore", "EncoderCore", "StackCore"]


class StackCore:
    """The computation shared by :class:`jaxpos.nnx.DecoderLM`, :class:`jaxpos.nnx.Encoder`
    and their Linen twins. Subclasses declare ``embed`` (``embedding``), ``abs_position``,
    ``rel_position`` (the stack's :class:`jaxpos.nnx.PositionModule`, or None when the
    scheme lives in every layer), ``blocks``, ``final_norm`` and fields ``vocab_size``, ``d_model``,
    ``max_len``, ``implementation``, ``dtype``; and give ``_position_name()`` and
    ``_cache_dims()`` -> ``(num_layers, num_kv_heads, head_dim)`` and ``_cache_schemes()``
    -> ``((name, options, num_heads), ...)`` one per layer (the decode state of its
    cache)."""

    if TYPE_CHECKING:  # attributes and methods of the NNX / Linen class mixing this in
        def __getattr__(self, name: str) -> Any: ...

    def _embed(self, tokens, pos):
        tokens = check_tokens(tokens, self.vocab_size)
        x = embed_tokens(param_value(self.embed.embedding), tokens, self.d_model, self.dtype)
        if self.abs_position is not None:
            x = x + self.abs_position(pos).astype(self.dtype)
        return x

    def _scheme(self, rope_scaling, x, pos):
        """``(scheme for every layer, rope_scaling left for the layers)``: the stack's
        scheme, or ``(None, rope_scaling)`` when each layer builds its own."""
        if self.rel_position is None:
            return None, rope_scaling
        return position_scheme(self.rel_position, rope_scaling, x=x, positions=pos), None

    def _hidden(self, tokens, positions, rope_scaling, implementation, mask=None,
                segment_ids=None, attention_mask=None, deterministic=None, rngs=None):
        _checks.check_rank("tokens", tokens, (2,), "[batch, seq] token ids")
        B, T = _checks.shape_of(tokens)
        pad = check_attention_mask(attention_mask, B, T)
        if pad is not None and positions is None:
            positions = positions_from_mask(pad)
        check_learned_length(self._position_name(), self.max_len, T, positions)
        pos = default_positions((B, T), positions)
        hidden = self._activation_axes()
        x = constrain(self._embed(tokens, pos), hidden)
        scheme, layer_scaling = self._scheme(rope_scaling, x, pos)
        impl = implementation or self.implementation
        for block in self.blocks:
            x = block(x, positions=pos, mask=mask, segment_ids=segment_ids, scheme=scheme,
                      rope_scaling=layer_scaling, implementation=impl, attention_mask=pad,
                      deterministic=deterministic, rngs=rngs)
            x = constrain(x, hidden)
        return rms_norm(x, param_value(self.final_norm.scale))

    def _activation_axes(self, last: str | None = None) -> tuple:
        """The logical axes of the stack's ``[B, T, ...]`` activations
        (:mod:`jaxpos.sharding`): ``batch``, ``seq`` when the layers are context-parallel,
        then ``last``."""
        seq = "seq" if getattr(self, "context_parallel", None) else None
        return ("batch", seq, last)

    def _run(self, body, inputs, tokens, width, last=None):
        """``body(inputs)``; under a mesh with Explicit axes run with them Auto and its
        output ``[B, T, width]`` resharded by the logical rules
        (:func:`jaxpos.sharding.run_auto`)."""
        _checks.check_rank("tokens", tokens, (2,), "[batch, seq] token ids")
        shape = (*_checks.shape_of(tokens), width)
        return run_auto(body, inputs, self._activation_axes(last), shape)


class DecoderCore(StackCore):
    """The calls of :class:`jaxpos.nnx.DecoderLM` and its Linen twin."""

    if TYPE_CHECKING:  # attributes and methods of the NNX / Linen class mixing this in
        def __getattr__(self, name: str) -> Any: ...

    def __call__(self, tokens: ArrayLike, *, positions: ArrayLike | None = None,
                 rope_scaling: Any = None, implementation: str | None = None,
                 segment_ids: ArrayLike | None = None, attention_mask: ArrayLike | None = None,
                 deterministic: bool | None = None, rngs: Any = None) -> jax.Array:
        """Causal forward pass.

        Args:
          tokens: int ``[B, T]`` in ``[0, vocab_size)``: concrete ids outside, negative
            ones included, raise ``ValueError``; under ``jit`` their embedding rows are NaN
            (so are their logits; the NaN may reach others through attention).
          positions: int ``[T]`` or ``[B, T]``, default ``arange(T)``, or Hugging Face's
            positions of ``attention_mask`` when it is given (``cumsum - 1``, padding at
            1); offsets and packing are position arrays.
          rope_scaling: a :mod:`jaxpos.schemes.rope.scaling` dataclass applied for this call only;
            ``ValueError`` for a model whose scheme does not take it (not ``"rope"``).
          implementation: overrides the model's attention backend for this call.
          segment_ids: int ``[B, T]`` for packed sequences (optional).
          attention_mask: bool or int ``[B, T]``, 1 for a token and 0 for padding
            (Hugging Face's convention; left or right padding). No token sees padding, so
            every token of a left-padded row gets the logits of its sequence run alone.
            Padding's own logits are meaningless.
          deterministic: dropout off when True (with ``dropout_rate > 0``); default: the
            module's ``deterministic`` (NNX: ``model.train()`` / ``model.eval()``, False at
            construction; Linen: the field, and one of the two must be set).
          rngs: NNX only: an :class:`flax.nnx.Rngs` (its ``dropout`` stream) or stream for
            this call's dropout keys, default the streams the layers keep from
            construction. Linen draws them with ``make_rng("dropout")``.

        Returns:
          float32 logits ``[B, T, vocab_size]``.

        Raises:
          ValueError: ``"learned"`` with ``T > max_len`` or concrete positions outside the
            table (never clamped), bad shapes, ``attention_mask`` values other than 0/1;
            TypeError: float tokens/positions/attention_mask.
        """
        def body(a):
            if getattr(self, "context_zigzag", False):
                return self._zigzag_call(a["tokens"], a["positions"], rope_scaling,
                                         implementation, a["segment_ids"],
                                         a["attention_mask"], deterministic, rngs)
            h = self._hidden(a["tokens"], a["positions"], rope_scaling, implementation,
                             segment_ids=a["segment_ids"], attention_mask=a["attention_mask"],
                             deterministic=deterministic, rngs=rngs)
            return constrain(tied_logits(h, param_value(self.embed.embedding)),
                             self._activation_axes("vocab"))

        inputs = dict(tokens=tokens, positions=positions, segment_ids=segment_ids,
                      attention_mask=attention_mask)
        return self._run(body, inputs, tokens, self.vocab_size)

    def _zigzag_call(self, tokens, positions, rope_scaling, implementation, segment_ids,
                     attention_mask, deterministic, rngs):
        """The forward pass with the tokens in the zigzag order of ``context_axis``
        (:func:`jaxpos.parallel.context.zigzag_order`; positions say where each token is),
        so that every device of a causal ring holds as many early as late tokens; the
        logits are returned in the tokens' own order."""
        name = self._position_name()
        if getattr(REGISTRY.get(name), "reads_token_order", False):
            raise ValueError(f"context_zigzag=True reorders the tokens, but position={name!r} "
                             f"is computed along the tokens in their order; use "
                             f"context_zigzag=False (the contiguous ring) or "
                             f"context_parallel='ulysses'.")
        _checks.check_rank("tokens", tokens, (2,), "[batch, seq] token ids")
        B, T = _checks.shape_of(tokens)
        pad = check_attention_mask(attention_mask, B, T)
        if pad is not None and positions is None:
            positions = positions_from_mask(pad)
        pos = jnp.broadcast_to(default_positions((B, T), positions), (B, T))
        order = zigzag_order(T, self.context_axis)
        take = lambda x: None if x is None else jnp.asarray(x)[:, order]
        h = self._hidden(take(tokens), take(pos), rope_scaling, implementation,
                         segment_ids=take(segment_ids), attention_mask=take(pad),
                         deterministic=deterministic, rngs=rngs)
        logits = tied_logits(h, param_value(self.embed.embedding))
        return logits[:, np.argsort(order)]

    def init_cache(self, batch: int, max_len: int, dtype: Any = None, *,
                   keep_first: int | None = None, **cache_options: Any
                   ) -> tuple[Cache, ...]:
        """One empty :class:`KVCache` per layer, ``max_len`` slots for ``batch`` rows (no
        parameters needed). With ``keep_first``: a StreamingLLM cache per layer
        (:class:`StreamingKVCache`, Xiao et al. 2024, §3.2) that keeps each row's first
        ``keep_first`` tokens (attention sinks; padding takes no slot) and its
        ``max_len - keep_first`` most recent ones, positions being places in the cache, so
        decoding runs unboundedly in fixed memory (one token per step once full). Other
        keyword options select another registered cache type
        (:func:`jaxpos.layers.cache.register_cache`).

        Raises:
          ValueError: ``keep_first`` with ``position="sinusoidal"`` or ``"learned"``
            (positions added to the embeddings cannot be re-numbered as places in the
            cache, so no step could equal a fresh pass over the kept tokens); bad sizes.
        """
        L, Nk, H = self._cache_dims()
        caches = tuple(decode_state_cache(
            new_cache(batch, max_len, Nk, H, dtype or self.dtype, keep_first=keep_first,
                      **cache_options), (name, options), num_heads, H)
            for name, options, num_heads in self._cache_schemes())
        given = {"keep_first": keep_first, **cache_options}
        self._check_cache_positions(caches[0], "init_cache(" + ", ".join(
            f"{n}={val!r}" for n, val in given.items() if val is not None) + ")")
        return caches

    def _check_cache_positions(self, cache: Cache, what: str) -> None:
        """``ValueError`` for a cache that re-numbers positions (StreamingLLM) in a model
        whose positions are added to the token embeddings."""
        name = self._position_name()
        if not cache.text_positions and name in ABSOLUTE_POSITIONS:
            raise ValueError(
                f"{what}: a StreamingLLM cache re-numbers the kept tokens as places in the "
                f"cache (Xiao et al. 2024, §3.2), but position={name!r} adds each token's "
                f"position to its embedding once, at the input, where no later step can "
                f"re-number it: decoding could not equal a pass over the kept tokens. Use a "
                f"relative scheme (rope, alibi, t5, nope, ...) or a dense cache "
                f"(keep_first=None).")

    def decode_step(self, tokens: ArrayLike, cache: tuple[Cache, ...], *,
                    positions: ArrayLike | None = None, rope_scaling: Any = None,
                    implementation: str | None = None, attention_mask: ArrayLike | None = None
                    ) -> tuple[jax.Array, tuple[Cache, ...]]:
        """Run ``tokens [B, T]`` (one or more new tokens per row) against the cache.

        ``attention_mask``: bool or int ``[B, T]`` for the new tokens, 1 = token, 0 =
        padding (Hugging Face's convention; default all tokens); the cache remembers it,
        so no token sees padding in this step or a later one: a left-padded prefill
        followed by steps gives every token the logits of its sequence run alone.
        ``positions`` default to each row's count of cached tokens (padding excluded)
        ``+ cumsum(attention_mask) - 1`` (``arange(T)`` after it without padding; padding
        at 1), Hugging Face's positions; give them to put rows at other offsets. Returns
        ``(logits float32 [B, T, vocab_size], cache)``. Decoding a sequence token by token
        gives the logits of the full forward pass with the same positions, except with a
        length-dependent ``rope_scaling`` (dynamic NTK, LongRoPE) by default: cached keys
        keep the rotation of the call that wrote them, as in Hugging Face's decoding
        (:func:`jaxpos.nnx.rotate_at_write`); with the scheme option
        ``rope_cache_rotation="read"`` every cached key is rotated with the current
        length's frequencies and each step equals the full pass at that length. A step
        costs the filled length, not ``max_len``. Raises as :meth:`__call__`, and
        ``ValueError`` on concrete cache overflow (traced overflow gives NaN rows) and for
        tokens whose batch size is not the cache's.
        """
        L = self._cache_dims()[0]
        if not isinstance(cache, (tuple, list)) or len(cache) != L:
            raise ValueError(f"cache must be a tuple of {L} KVCache (from init_cache); got "
                             f"{type(cache).__name__}.")
        _checks.check_rank("tokens", tokens, (2,), "[batch, seq] token ids")
        B, T = _checks.shape_of(tokens)
        self._check_cache_positions(check_cache(cache[0], B), "decode_step")
        pad = check_attention_mask(attention_mask, B, T)
        if positions is None:
            positions = positions_from_mask(jnp.ones((B, T), bool) if pad is None else pad,
                                            cache[0].token_count())
        pos = _checks.positions_2d("positions", positions, B, T)
        x = self._embed(tokens, pos)
        scheme, layer_scaling = self._scheme(rope_scaling, x, pos)
        impl = implementation or self.implementation
        new = []
        for block, c in zip(self.blocks, cache):
            x, c = block.decode(x, c, positions=pos, scheme=scheme, rope_scaling=layer_scaling,
                                implementation=impl, attention_mask=pad)
            new.append(c)
        h = rms_norm(x, param_value(self.final_norm.scale))
        return tied_logits(h, param_value(self.embed.embedding)), tuple(new)


class EncoderCore(StackCore):
    """The call of :class:`jaxpos.nnx.Encoder` and its Linen twin."""

    if TYPE_CHECKING:  # attributes and methods of the NNX / Linen class mixing this in
        def __getattr__(self, name: str) -> Any: ...

    def __call__(self, tokens: ArrayLike, *, positions: ArrayLike | None = None,
                 mask: ArrayLike | None = None, segment_ids: ArrayLike | None = None,
                 rope_scaling: Any = None, implementation: str | None = None,
                 attention_mask: ArrayLike | None = None, deterministic: bool | None = None,
                 rngs: Any = None) -> jax.Array:
        """Bidirectional forward pass: final-normalised hidden states ``[B, T, d_model]``
        (``dtype``); keywords as :meth:`jaxpos.nnx.DecoderLM.__call__` (``attention_mask``,
        ``deterministic`` and ``rngs`` included: no token sees padding) plus ``mask``."""
        inputs = dict(tokens=tokens, positions=positions, mask=mask, segment_ids=segment_ids,
                      attention_mask=attention_mask)
        return self._run(lambda a: self._hidden(
            a["tokens"], a["positions"], rope_scaling, implementation, mask=a["mask"],
            segment_ids=a["segment_ids"], attention_mask=a["attention_mask"],
            deterministic=deterministic, rngs=rngs), inputs, tokens, self.d_model)
