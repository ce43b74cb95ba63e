"""Position schemes as immutable pytrees: the one place that decides how each scheme
enters attention.

A scheme object does up to three things, and every implementation of
:func:`jaxpos.attention` (reference, chunked, Pallas) calls the same methods:

* ``rotate_qk(q, k, q_positions, kv_positions)``: rotate queries and keys (RoPE).
* ``bias(qs, q_positions, kv_positions)``: a float32 term added to the scaled scores
  of a block of queries and keys (ALiBi, T5, Shaw's key term). ``qs`` is the scaled
  query block ``[B, N, tq, H]``; positions are int32 ``[B|1, tq]`` and ``[B|1, tk]``.
  Returns ``None`` or an array broadcastable to ``[B, N, tq, tk]``.
* ``value_term(p, q_positions, kv_positions)``: a term added to the output that is
  linear in the attention weights ``p`` ``[B, N, tq, tk]`` (Shaw's value vectors).

Array fields are pytree children (traced under ``jit``, differentiable); the rest
(layouts, bucket counts, flags) are static, so changing only array values never
retraces.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpos import _checks
from jaxpos.alibi import alibi_bias_from_offsets, alibi_slopes
from jaxpos.rope import LAYOUTS, apply_rope, check_rotary_dim, rope_frequencies
from jaxpos.shaw import check_shaw_table, shaw_clipped_index, shaw_logits, shaw_values
from jaxpos.t5 import check_bucket_args, check_t5_table, t5_bias_from_offsets

__all__ = ["ALiBi", "NoPE", "PositionScheme", "RoPE", "Shaw", "T5Bias", "as_scheme"]


class PositionScheme:
    """Base class: children (array fields) and static fields, immutable, a pytree."""

    _children: tuple[str, ...] = ()
    _static: tuple[str, ...] = ()
    has_bias = False
    has_value_term = False

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        jax.tree_util.register_pytree_node(cls, cls._flatten, cls._unflatten)

    def _flatten(self):
        return (tuple(getattr(self, n) for n in self._children),
                tuple(getattr(self, n) for n in self._static))

    @classmethod
    def _unflatten(cls, aux, children):
        obj = object.__new__(cls)
        for n, val in zip(cls._children, children):
            object.__setattr__(obj, n, val)
        for n, val in zip(cls._static, aux):
            object.__setattr__(obj, n, val)
        return obj

    def _set(self, **fields):
        for n, val in fields.items():
            object.__setattr__(self, n, val)

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable; use .replace(...)")

    def replace(self, **changes):
        """A copy with some fields changed (like ``dataclasses.replace``)."""
        children, aux = self._flatten()
        obj = self._unflatten(aux, children)
        obj._set(**changes)
        return obj

    def __repr__(self):
        parts = []
        for n in self._children:
            v = getattr(self, n)
            parts.append(f"{n}=<{getattr(v, 'dtype', type(v).__name__)}{list(np.shape(v))}>"
                         if v is not None else f"{n}=None")
        parts += [f"{n}={getattr(self, n)!r}" for n in self._static]
        return f"{type(self).__name__}({', '.join(parts)})"

    # ---- the interface -------------------------------------------------------------
    def check(self, num_heads: int, head_dim: int) -> None:
        """Raise ``ValueError`` if the scheme cannot serve ``num_heads`` heads of ``head_dim``."""

    def rotate_qk(self, q, k, q_positions, kv_positions):
        return q, k

    def bias(self, qs, q_positions, kv_positions):
        return None

    def value_term(self, p, q_positions, kv_positions):
        return None


class NoPE(PositionScheme):
    """No position information (Haviv et al. 2022; Kazemnejad et al. 2023). A causal mask
    alone lets a decoder infer position; an unmasked encoder is permutation-equivariant."""

    def __init__(self):
        pass


class RoPE(PositionScheme):
    """Rotary position embedding (Su et al. 2024, §3.4), applied to q and k.

    Args:
      inv_freq: float32 ``[rotary_dim // 2]``; or give ``rotary_dim`` (and ``base``,
        ``scaling``) to compute it with :func:`jaxpos.rope_frequencies`.
      rotary_dim: rotated features per head (the rest pass through: partial rotary).
      base: ``rope_theta``.
      layout: ``"half"`` (Llama/NeoX) or ``"interleaved"`` (GPT-J/Meta).
      scaling: a :mod:`jaxpos.rope_scaling` dataclass or None. Dynamic NTK and LongRoPE
        recompute their frequencies in every call from ``max(position) + 1`` (no state);
        they need ``rotary_dim``, not ``inv_freq``.
      attention_factor: multiplies cos and sin, so the logits by its square (YaRN /
        LongRoPE); default: the scaling's factor, 1.0 without one.
      angle_precision: ``"high"`` (default; angles reduced modulo 2 pi in extended
        precision, accurate at any position) or ``"float32"`` (HF's plain float32 product,
        for bit-level parity with transformers); see :mod:`jaxpos.rope`.
      mrope_section: Qwen2-VL's ``(temporal, height, width)`` frequency sections, or None.
        :meth:`rotate` then accepts ``[3, B, T]`` positions (M-RoPE); with ``[T]`` or
        ``[B, T]`` positions (text, and inside :func:`jaxpos.attention`, whose positions
        are 1-D per sequence) it is plain RoPE.

    Raises:
      ValueError: neither ``inv_freq`` nor ``rotary_dim``; ``rotary_dim`` that does not
        match ``inv_freq``; unknown layout or angle_precision; ``inv_freq`` together with a
        length-dependent scaling; bad ``mrope_section``.
      TypeError: ``inv_freq`` not floating; ``scaling`` of an unknown type.
    """

    _children = ("inv_freq",)
    _static = ("layout", "attention_factor", "scaling", "base", "rotary_dim",
               "angle_precision", "mrope_section")

    def __init__(self, inv_freq=None, *, rotary_dim=None, base=10000.0, layout="half",
                 scaling=None, attention_factor=None, angle_precision="high",
                 mrope_section=None):
        from jaxpos import rope_scaling
        from jaxpos.rope import ANGLE_PRECISIONS

        _checks.check_choice("layout", layout, LAYOUTS)
        _checks.check_choice("angle_precision", angle_precision, ANGLE_PRECISIONS)
        if inv_freq is None:
            if rotary_dim is None:
                raise ValueError("RoPE needs inv_freq or rotary_dim; got neither.")
            inv_freq, af = rope_frequencies(rotary_dim, base, scaling=scaling)
            attention_factor = af if attention_factor is None else attention_factor
        else:
            _checks.check_rank("inv_freq", inv_freq, (1,), "[rotary_dim // 2]")
            _checks.check_floating("inv_freq", inv_freq)
            if scaling is not None and rope_scaling.depends_on_length(scaling):
                raise ValueError(f"RoPE: a length-dependent scaling ({type(scaling).__name__}) "
                                 f"recomputes inv_freq per call; give rotary_dim and base, not "
                                 f"inv_freq.")
        rd = 2 * _checks.shape_of(inv_freq)[0]
        if rotary_dim is not None and rotary_dim != rd:
            raise ValueError(f"rotary_dim={rotary_dim} does not match inv_freq of length {rd // 2}.")
        if mrope_section is not None:
            sec = tuple(int(v) for v in mrope_section)
            if len(sec) != 3 or min(sec) < 0 or sum(sec) != rd // 2:
                raise ValueError(f"mrope_section must be 3 non-negative ints summing to "
                                 f"rotary_dim // 2 = {rd // 2}; got {tuple(mrope_section)}.")
            mrope_section = sec
        self._set(inv_freq=jnp.asarray(inv_freq, jnp.float32), layout=layout,
                  attention_factor=1.0 if attention_factor is None else float(attention_factor),
                  scaling=scaling, base=float(base), rotary_dim=rd,
                  angle_precision=angle_precision, mrope_section=mrope_section)

    def check(self, num_heads, head_dim):
        check_rotary_dim(self.rotary_dim, head_dim)

    def frequencies(self, q_positions, kv_positions):
        """``(inv_freq, attention_factor)`` for this call.

        Dynamic NTK and LongRoPE use ``seq_len = max(q_positions, kv_positions) + 1`` of
        this call (HF's ``max(position_ids) + 1``), traced, selected with ``jnp.where``;
        other schemes return ``self.inv_freq``. The factor is a Python float.
        """
        from jaxpos import rope_scaling

        if self.scaling is None or not rope_scaling.depends_on_length(self.scaling):
            return self.inv_freq, self.attention_factor
        seq_len = jnp.maximum(jnp.max(jnp.asarray(q_positions)),
                              jnp.max(jnp.asarray(kv_positions))) + 1
        inv_freq, _ = rope_scaling.frequencies_for_length(self.rotary_dim, self.base,
                                                          self.scaling, seq_len)
        return inv_freq, self.attention_factor

    def rotate(self, x, positions, *, inv_freq=None):
        """Rotate ``x`` ``[B, T, N, H]`` at ``positions`` (``[T]`` or ``[B, T]``; with
        ``mrope_section`` also M-RoPE's ``[3, B, T]``), with this call's frequencies (or
        ``inv_freq`` if given). Returns ``x``'s shape and dtype.

        Raises:
          The errors of :func:`jaxpos.apply_rope` / :func:`jaxpos.rope.apply_mrope`.
        """
        from jaxpos.rope import apply_mrope

        m_rope = self.mrope_section is not None and np.ndim(positions) == 3
        if inv_freq is None:
            inv_freq, af = self.frequencies(positions, positions)
        else:
            af = self.attention_factor
        if m_rope:
            return apply_mrope(x, positions, inv_freq, mrope_section=self.mrope_section,
                               layout=self.layout, attention_factor=af,
                               angle_precision=self.angle_precision)
        return apply_rope(x, positions, inv_freq, layout=self.layout, attention_factor=af,
                          angle_precision=self.angle_precision)

    def rotate_qk(self, q, k, q_positions, kv_positions):
        inv_freq, af = self.frequencies(q_positions, kv_positions)
        q = apply_rope(q, q_positions, inv_freq, layout=self.layout, attention_factor=af,
                       angle_precision=self.angle_precision)
        k = apply_rope(k, kv_positions, inv_freq, layout=self.layout, attention_factor=af,
                       angle_precision=self.angle_precision)
        return q, k


class ALiBi(PositionScheme):
    """ALiBi (Press et al. 2022, §3): ``slopes[h] * (kv_pos - q_pos)`` added to the scores
    (``-slopes[h] * |kv_pos - q_pos|`` when ``bidirectional``).

    Args:
      num_heads: compute the paper's slopes with :func:`jaxpos.alibi_slopes`; or
      slopes: float ``[N]`` (may be a learnable parameter).
    """

    _children = ("slopes",)
    _static = ("bidirectional",)
    has_bias = True

    def __init__(self, num_heads=None, *, slopes=None, bidirectional=False):
        if slopes is None:
            if num_heads is None:
                raise ValueError("ALiBi needs num_heads or slopes; got neither.")
            slopes = alibi_slopes(num_heads)
        _checks.check_rank("slopes", slopes, (1,), "[num_heads]")
        self._set(slopes=jnp.asarray(slopes, jnp.float32), bidirectional=bool(bidirectional))

    def check(self, num_heads, head_dim):
        if _checks.shape_of(self.slopes)[0] != num_heads:
            raise ValueError(f"ALiBi slopes must have shape [{num_heads}] (one per query head); "
                             f"got {_checks.shape_of(self.slopes)}.")

    def bias(self, qs, q_positions, kv_positions):
        rel = kv_positions[:, None, :] - q_positions[:, :, None]  # [B|1, tq, tk]
        return alibi_bias_from_offsets(rel, self.slopes, bidirectional=self.bidirectional)


class T5Bias(PositionScheme):
    """T5 bucketed relative bias (Raffel et al. 2020, §2.1): ``table[bucket(kv - q), h]``.

    Args:
      table: float ``[num_buckets, N]`` (T5 checkpoint layout), shared by a stack.
      bidirectional: True in the encoder, False in the (causal) decoder.
      num_buckets, max_distance: T5's 32 and 128 by default.

    Use ``scale=1.0`` in :func:`jaxpos.attention` to match T5, which does not scale.
    """

    _children = ("table",)
    _static = ("bidirectional", "num_buckets", "max_distance")
    has_bias = True

    def __init__(self, table, *, bidirectional=True, num_buckets=None, max_distance=128):
        _checks.check_rank("table", table, (2,), "[num_buckets, num_heads]")
        _checks.check_floating("table", table)
        nb = _checks.shape_of(table)[0] if num_buckets is None else num_buckets
        check_bucket_args(nb, max_distance, bidirectional)
        check_t5_table(table, nb)
        self._set(table=table, bidirectional=bool(bidirectional), num_buckets=int(nb),
                  max_distance=int(max_distance))

    def check(self, num_heads, head_dim):
        if _checks.shape_of(self.table)[1] != num_heads:
            raise ValueError(f"T5 table must have shape [{self.num_buckets}, {num_heads}] (one "
                             f"column per query head); got {_checks.shape_of(self.table)}.")

    def bias(self, qs, q_positions, kv_positions):
        rel = kv_positions[:, None, :] - q_positions[:, :, None]
        return t5_bias_from_offsets(rel, self.table, bidirectional=self.bidirectional,
                                    num_buckets=self.num_buckets, max_distance=self.max_distance)


class Shaw(PositionScheme):
    """Shaw et al. 2018 relative keys and values, clipping distance ``K``.

    Args:
      rel_k: ``[2K + 1, H]`` relative key vectors (row ``r + K`` is offset ``r``).
      rel_v: ``[2K + 1, H]`` relative value vectors, or ``None`` for keys only.
    """

    _children = ("rel_k", "rel_v")
    _static = ("max_distance",)
    has_bias = True

    def __init__(self, rel_k, rel_v=None):
        K = check_shaw_table("rel_k", rel_k)
        if rel_v is not None:
            _checks.check_floating("rel_v", rel_v)
        if rel_v is not None and _checks.shape_of(rel_v) != _checks.shape_of(rel_k):
            raise ValueError(f"rel_v must have rel_k's shape {_checks.shape_of(rel_k)}; got "
                             f"{_checks.shape_of(rel_v)}.")
        self._set(rel_k=rel_k, rel_v=rel_v, max_distance=K)

    @property
    def has_value_term(self):
        return self.rel_v is not None

    def check(self, num_heads, head_dim):
        check_shaw_table("rel_k", self.rel_k, head_dim)

    def bias(self, qs, q_positions, kv_positions):
        idx = shaw_clipped_index(q_positions, kv_positions, self.max_distance)
        return shaw_logits(qs, idx, self.rel_k)

    def value_term(self, p, q_positions, kv_positions):
        if self.rel_v is None:
            return None
        idx = shaw_clipped_index(q_positions, kv_positions, self.max_distance)
        return shaw_values(p, idx, self.rel_v)


def as_scheme(position: Any) -> PositionScheme:
    """``None`` / ``"none"`` / ``"nope"`` -> :class:`NoPE`; a scheme passes through."""
    if position is None or (isinstance(position, str) and position.lower() in ("none", "nope")):
        return NoPE()
    if isinstance(position, PositionScheme):
        return position
    raise TypeError(
        f"position must be a scheme object (NoPE(), RoPE(...), ALiBi(...), T5Bias(...), "
        f"Shaw(...)) or None/'none'; got {type(position).__name__} {position!r}."
    )
