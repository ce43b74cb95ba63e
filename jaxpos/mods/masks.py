"""Named mask_mods: a sliding window (Mistral, Gemma 2/3, GPT-OSS), Llama 4's chunks, a
prefix LM, and the conjunction / disjunction of mask_mods (FlexAttention's ``and_masks`` /
``or_masks``, Dong et al. 2024).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxpos import _checks

__all__ = ["ChunkedAttentionMask", "MaskCombination", "PrefixLMMask", "SlidingWindowMask",
           "and_masks", "or_masks"]


@dataclasses.dataclass(frozen=True)
class MaskCombination:
    """A mask_mod that is the conjunction (``op="and"``) or the disjunction (``op="or"``)
    of other mask_mods, FlexAttention's ``and_masks`` / ``or_masks`` (Dong et al. 2024;
    ``torch.nn.attention.flex_attention``). Build it with :func:`and_masks` /
    :func:`or_masks`. A frozen dataclass: equal combinations of equal mask_mods compare and
    hash equal (one trace under ``jit``).

    Call: ``(batch, head, q_pos [tq, 1], kv_pos [1, tk]) -> bool [tq, tk]``; with no
    mask_mods, all True (``"and"``) or all False (``"or"``).
    """

    op: str
    mask_mods: tuple

    def __call__(self, batch: jax.Array, head: jax.Array, q_pos: jax.Array,
                 kv_pos: jax.Array) -> jax.Array:
        out = None
        for m in self.mask_mods:
            r = m(batch, head, q_pos, kv_pos)
            out = r if out is None else (out & r if self.op == "and" else out | r)
        if out is None:
            shape = jnp.broadcast_shapes(jnp.shape(q_pos), jnp.shape(kv_pos))
            return jnp.full(shape, self.op == "and")
        return out


def _combination(op: str, mask_mods) -> MaskCombination:
    for i, m in enumerate(mask_mods):
        if not callable(m):
            raise TypeError(f"{op}_masks takes mask_mods (batch, head, q_pos, kv_pos) -> bool; "
                            f"argument {i} is {type(m).__name__} {m!r}.")
    return MaskCombination(op, tuple(mask_mods))


def and_masks(*mask_mods: Callable) -> MaskCombination:
    """The mask_mod that lets a pair attend when every one of ``mask_mods`` does
    (FlexAttention's ``and_masks``): e.g. ``and_masks(SlidingWindowMask(128),
    document_mask)``. No mask_mods: every pair attends.

    Args:
      mask_mods: ``(batch, head, q_pos, kv_pos) -> bool`` functions (see :mod:`jaxpos.mods`).

    Returns:
      A :class:`MaskCombination`, itself a mask_mod (for :func:`jaxpos.attention`,
      :func:`create_block_mask`, the modules).

    Raises:
      TypeError: an argument that is not callable (naming its index).
    """
    return _combination("and", mask_mods)


def or_masks(*mask_mods: Callable) -> MaskCombination:
    """The mask_mod that lets a pair attend when any of ``mask_mods`` does (FlexAttention's
    ``or_masks``): e.g. ``or_masks(PrefixLMMask(8), causal_mask)``. No mask_mods: no pair
    attends.

    Args / Returns / Raises: as :func:`and_masks`.
    """
    return _combination("or", mask_mods)


@dataclasses.dataclass(frozen=True)
class SlidingWindowMask:
    """The mask_mod of a causal sliding window of ``window`` tokens: a query at position
    ``p`` sees keys at positions ``p - window < kv_pos`` (with ``causal=True``, also
    ``kv_pos <= p``: the query and the ``window - 1`` tokens before it).

    Hugging Face's ``sliding_window_overlay`` (``masking_utils.py``): ``kv_idx > q_idx -
    sliding_window``, the layers marked ``"sliding_attention"`` in ``layer_types`` (Mistral,
    Gemma 2/3, GPT-OSS; Beltagy et al. 2020, "Longformer", §3.1 for the pattern). Use it as
    ``jaxpos.attention(..., causal=True, mask_mod=SlidingWindowMask(w))``; with global
    positions it holds for left padding and KV-cache decoding alike. A frozen dataclass, so
    equal windows compare and hash equal (one trace per window under ``jit``).

    Call: ``(batch, head, q_pos [tq, 1], kv_pos [1, tk]) -> bool [tq, tk]``.

    Raises:
      ValueError / TypeError: ``window`` not an int >= 1 (named ``sliding_window``).
    """

    window: int

    def __post_init__(self):
        window = _checks.check_positive_int("sliding_window", self.window)
        object.__setattr__(self, "window", window)

    def __call__(self, batch: jax.Array, head: jax.Array, q_pos: jax.Array,
                 kv_pos: jax.Array) -> jax.Array:
        return q_pos - kv_pos < self.window

    def causal_key_count(self, batch: jax.Array, head: jax.Array,
                         q_pos: jax.Array) -> jax.Array:
        """How many of the keys at positions ``0 .. q_pos`` a causal query at ``q_pos`` sees
        under this window: ``min(q_pos + 1, window)`` (int32, ``q_pos``'s shape)."""
        return jnp.minimum(q_pos + 1, self.window)


@dataclasses.dataclass(frozen=True)
class ChunkedAttentionMask:
    """The mask_mod of Llama 4's chunked attention: a query sees only keys of its own chunk
    of ``chunk_size`` positions, ``q_pos // chunk_size == kv_pos // chunk_size`` (with
    ``causal=True`` also ``kv_pos <= q_pos``).

    Hugging Face's ``chunked_overlay`` (``masking_utils.py``), used on the layers marked
    ``"chunked_attention"`` (Llama 4's RoPE layers, ``attention_chunk_size``): HF counts
    chunks from the first real token (``(idx - left_padding) // chunk_size``), which is the
    position of a real token, so global positions give the same chunks under left padding
    and KV-cache decoding. A frozen dataclass (one trace per chunk size under ``jit``).

    Call: ``(batch, head, q_pos [tq, 1], kv_pos [1, tk]) -> bool [tq, tk]``.

    Raises:
      ValueError / TypeError: ``chunk_size`` not an int >= 1 (named
        ``attention_chunk_size``).
    """

    chunk_size: int

    def __post_init__(self):
        object.__setattr__(self, "chunk_size",
                           _checks.check_positive_int("attention_chunk_size", self.chunk_size))

    def __call__(self, batch: jax.Array, head: jax.Array, q_pos: jax.Array,
                 kv_pos: jax.Array) -> jax.Array:
        return q_pos // self.chunk_size == kv_pos // self.chunk_size

    def causal_key_count(self, batch: jax.Array, head: jax.Array,
                         q_pos: jax.Array) -> jax.Array:
        """How many of the keys at positions ``0 .. q_pos`` a causal query at ``q_pos`` sees
        in its chunk: ``q_pos mod chunk_size + 1`` (int32, ``q_pos``'s shape)."""
        return q_pos % self.chunk_size + 1


@dataclasses.dataclass(frozen=True)
class PrefixLMMask:
    """The mask_mod of a prefix language model (Raffel et al. 2020, §3.2.1, "prefix LM"):
    every query sees the first ``prefix_len`` positions (bidirectional attention over the
    prefix) and, after them, the keys at positions ``<= q_pos`` (causal). Use it with
    ``causal=False`` (``causal=True`` would hide the prefix's later tokens from its earlier
    ones).

    Call: ``(batch, head, q_pos [tq, 1], kv_pos [1, tk]) -> bool [tq, tk]``.

    Raises:
      ValueError / TypeError: ``prefix_len`` not an int >= 0.
    """

    prefix_len: int

    def __post_init__(self):
        object.__setattr__(self, "prefix_len", _checks.check_nonneg_int("prefix_len",
                                                                         self.prefix_len))

    def __call__(self, batch: jax.Array, head: jax.Array, q_pos: jax.Array,
                 kv_pos: jax.Array) -> jax.Array:
        return (kv_pos < self.prefix_len) | (kv_pos <= q_pos)

    def causal_key_count(self, batch: jax.Array, head: jax.Array,
                         q_pos: jax.Array) -> jax.Array:
        """How many of the keys at positions ``0 .. q_pos`` a causal query at ``q_pos`` sees:
        all of them, ``q_pos + 1`` (causal attention hides the prefix's later keys)."""
        return q_pos + 1
