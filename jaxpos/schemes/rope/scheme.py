"""The RoPE scheme object (Su et al. 2024, "RoFormer", §3.4): rotary embedding of q and k,
its context extensions (:mod:`jaxpos.schemes.rope.scaling`), M-RoPE positions, and what a KV
cache stores for it (keys rotated at write, or raw keys rotated on load from
:class:`jaxpos.schemes.rope.tables.RopeTables`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos.schemes.base import NoPE, PositionScheme, register
from jaxpos.schemes.rope import scaling as rope_scaling
from jaxpos.schemes.rope.angles import ANGLE_PRECISIONS, LAYOUTS, apply_rope
from jaxpos.schemes.rope.scaling import check_rotary_dim, rope_frequencies
from jaxpos.schemes.rope.tables import RopeTables, rope_tables
from jaxpos.schemes.rope.variants import apply_mrope, check_mrope_section, mrope_frequency_axes

__all__ = ["CACHE_ROTATIONS", "RoPE"]

#: What a KV cache stores for RoPE (:meth:`RoPE.cache_write`).
CACHE_ROTATIONS = ("write", "read")


@register("rope")
class RoPE(PositionScheme):
    """Rotary position embedding (Su et al. 2024, §3.4), applied to q and k.

    Args:
      inv_freq: float32 ``[rotary_dim // 2]``; or give ``rotary_dim`` (and ``base``,
        ``scaling``) to compute it with :func:`jaxpos.rope_frequencies`.
      rotary_dim: rotated features per head (the rest pass through: partial rotary).
      base: ``rope_theta``.
      layout: ``"half"`` (Llama/NeoX) or ``"interleaved"`` (GPT-J/Meta).
      scaling: a :mod:`jaxpos.schemes.rope.scaling` dataclass or None. Dynamic NTK and LongRoPE
        recompute their frequencies in every call from ``max(position) + 1`` (no state);
        they need ``rotary_dim``, not ``inv_freq``.
      attention_factor: multiplies cos and sin, so the logits by its square (YaRN /
        LongRoPE); default: the scaling's factor, 1.0 without one.
      angle_precision: ``"high"`` (default; angles reduced modulo 2 pi in extended
        precision, accurate at any position) or ``"float32"`` (HF's plain float32 product,
        for bit-level parity with transformers); see :mod:`jaxpos.schemes.rope.angles`.
      mrope_section: Qwen2-VL's ``(temporal, height, width)`` frequency sections, or None.
        :meth:`rotate` then accepts ``[3, B, T]`` positions (M-RoPE); with ``[T]`` or
        ``[B, T]`` positions (text, and inside :func:`jaxpos.attention`, whose positions
        are 1-D per sequence) it is plain RoPE.
      mrope_interleaved: the Qwen3-VL / Qwen3-Omni layout, T/H/W frequencies interleaved
        rather than in contiguous sections (see :func:`mrope_frequency_axes`).
      cache_rotation: what a KV cache stores (:meth:`cache_write`). ``"write"`` (default):
        keys rotated once, when written, with the frequencies of the call that writes them
        (for a length-dependent scaling this is Hugging Face's ``dynamic_rope_update``
        decoding). ``"read"``: raw keys, every cached key rotated at each step with the
        current call's frequencies (exact dynamic NTK / LongRoPE: each step equals the full
        pass at that length; the Flax modules rotate on load through
        :func:`jaxpos.schemes.rope.tables.rope_tables`).

    Raises:
      ValueError: neither ``inv_freq`` nor ``rotary_dim``; ``rotary_dim`` that does not
        match ``inv_freq``; unknown layout or angle_precision; ``inv_freq`` together with a
        length-dependent scaling; bad ``mrope_section``.
      TypeError: ``inv_freq`` not floating; ``scaling`` of an unknown type.
    """

    # fields, set once in __init__ (the pytree's children and static data)
    inv_freq: jax.Array
    layout: str
    attention_factor: float
    scaling: Any  # a jaxpos.schemes.rope.scaling dataclass, or None
    base: float
    rotary_dim: int
    angle_precision: str
    mrope_section: tuple[int, ...] | None
    mrope_interleaved: bool
    cache_rotation: str

    _children = ("inv_freq",)
    _static = ("layout", "attention_factor", "scaling", "base", "rotary_dim",
               "angle_precision", "mrope_section", "mrope_interleaved", "cache_rotation")

    def __init__(self, inv_freq: ArrayLike | None = None, *, rotary_dim: int | None = None,
                 base: float = 10000.0, layout: str = "half", scaling: Any = None,
                 attention_factor: float | None = None, angle_precision: str = "high",
                 mrope_section: Sequence[int] | None = None, mrope_interleaved: bool = False,
                 cache_rotation: str = "write"):
        _checks.check_choice("layout", layout, LAYOUTS)
        _checks.check_choice("cache_rotation", cache_rotation, CACHE_ROTATIONS)
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
            raise ValueError(f"rotary_dim={rotary_dim} does not match inv_freq of length "
                             f"{rd // 2}.")
        if mrope_section is not None:
            mrope_section = check_mrope_section(mrope_section, rd // 2)
            mrope_frequency_axes(mrope_section, rd // 2,
                                 mrope_interleaved=mrope_interleaved)  # validates
        elif mrope_interleaved:
            raise ValueError("mrope_interleaved=True needs mrope_section (the T/H/W frequency "
                             "counts); got mrope_section=None.")
        self._set(inv_freq=jnp.asarray(inv_freq, jnp.float32), layout=layout,
                  attention_factor=1.0 if attention_factor is None else float(attention_factor),
                  scaling=scaling, base=float(base), rotary_dim=rd,
                  angle_precision=angle_precision, mrope_section=mrope_section,
                  mrope_interleaved=bool(mrope_interleaved), cache_rotation=cache_rotation)

    def check(self, num_heads: int, head_dim: int) -> None:
        check_rotary_dim(self.rotary_dim, head_dim)

    def frequencies(self, q_positions: ArrayLike,
                    kv_positions: ArrayLike) -> tuple[jax.Array, float]:
        """``(inv_freq, attention_factor)`` for this call.

        Dynamic NTK and LongRoPE use ``seq_len = max(q_positions, kv_positions) + 1`` of
        this call (HF's ``max(position_ids) + 1``), traced, selected with ``jnp.where``;
        other schemes return ``self.inv_freq``. The factor is a Python float.
        """
        if self.scaling is None or not rope_scaling.depends_on_length(self.scaling):
            return self.inv_freq, self.attention_factor
        seq_len = jnp.maximum(jnp.max(jnp.asarray(q_positions)),
                              jnp.max(jnp.asarray(kv_positions))) + 1
        inv_freq, _ = rope_scaling.frequencies_for_length(self.rotary_dim, self.base,
                                                          self.scaling, seq_len)
        return inv_freq, self.attention_factor

    def rotate(self, x: jax.Array, positions: ArrayLike, *,
               inv_freq: ArrayLike | None = None) -> jax.Array:
        """Rotate ``x`` ``[B, T, N, H]`` at ``positions`` (``[T]`` or ``[B, T]``; with
        ``mrope_section`` also M-RoPE's ``[3, B, T]``), with this call's frequencies (or
        ``inv_freq`` if given). Returns ``x``'s shape and dtype.

        Raises:
          The errors of :func:`jaxpos.apply_rope` / :func:`jaxpos.schemes.rope.apply_mrope`.
        """
        m_rope = self.mrope_section is not None and np.ndim(positions) == 3
        if inv_freq is None:
            inv_freq, af = self.frequencies(positions, positions)
        else:
            af = self.attention_factor
        if m_rope:
            assert self.mrope_section is not None  # (m_rope)
            return apply_mrope(x, positions, inv_freq, mrope_section=self.mrope_section,
                               mrope_interleaved=self.mrope_interleaved,
                               layout=self.layout, attention_factor=af,
                               angle_precision=self.angle_precision)
        return apply_rope(x, positions, inv_freq, layout=self.layout, attention_factor=af,
                          angle_precision=self.angle_precision)

    def transform_qk(self, q: jax.Array, k: jax.Array, q_positions: jax.Array,
                     kv_positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Rotate ``q`` and ``k`` at their positions with this call's frequencies (one
        ``O(T * H)`` pass per call, before any attention implementation)."""
        inv_freq, af = self.frequencies(q_positions, kv_positions)
        q = apply_rope(q, q_positions, inv_freq, layout=self.layout, attention_factor=af,
                       angle_precision=self.angle_precision)
        k = apply_rope(k, kv_positions, inv_freq, layout=self.layout, attention_factor=af,
                       angle_precision=self.angle_precision)
        return q, k

    @classmethod
    def from_params(cls, params: dict, *, head_dim: int, options: dict, **_: Any) -> PositionScheme:
        """Options ``rotary_dim`` (default ``head_dim``), ``rope_base`` (10000),
        ``rope_scaling`` (a :mod:`jaxpos.schemes.rope.scaling` dataclass), ``rope_layout``."""
        rd = options.get("rotary_dim")
        base = options.get("rope_base")
        return cls(rotary_dim=head_dim if rd is None else rd,
                   base=10000.0 if base is None else base,
                   layout=options.get("rope_layout") or "half",
                   scaling=options.get("rope_scaling"),
                   cache_rotation=options.get("rope_cache_rotation") or "write")

    def cache_write(self, q: jax.Array, k: jax.Array,
                    positions: ArrayLike) -> tuple[jax.Array, jax.Array, PositionScheme]:
        """What a KV cache stores: ``(q, k, scheme_for_reading)``.

        ``cache_rotation="write"`` (default): ``q`` and ``k`` are rotated now, with this
        call's frequencies (a fixed table for the default, linear, YaRN, Llama 3, p-RoPE and
        M-RoPE forms; ``max(positions) + 1`` for dynamic NTK / LongRoPE, Hugging Face's
        decoding), and the cache is read with :class:`NoPE`: a decode step rotates the new
        tokens only, never the cache (a key's rotation depends on its own position only,
        Su et al. 2024, §3.4). ``cache_rotation="read"``: raw keys, the scheme itself for
        reading (every cached key rotated at each step with the current frequencies;
        :meth:`load_tables`)."""
        if self.cache_rotation == "read":
            return q, k, self
        inv_freq, _ = self.frequencies(positions, positions)
        return (self.rotate(q, positions, inv_freq=inv_freq),
                self.rotate(k, positions, inv_freq=inv_freq), NoPE())

    def load_tables(self, q_positions: ArrayLike, kv_positions: ArrayLike,
                    seq_len: ArrayLike | None = None) -> RopeTables:
        """:class:`jaxpos.schemes.rope.tables.RopeTables` rotating unrotated q and k on load, for a
        cache read with this scheme (``cache_rotation="read"``, or a StreamingLLM cache whose
        key positions are its slots; Xiao et al. 2024, §3.2).

        Args:
          q_positions: int ``[B|1, Tq]``; kv_positions: int ``[B|1, Tk]`` or ``[Tk]``.
          seq_len: int scalar (may be traced), the length whose frequencies apply for a
            length-dependent scaling (default ``max(q_positions) + 1``: the newest tokens
            hold the largest positions, so this is the full pass's ``max(position) + 1``
            without a pass over the cached positions).

        Returns:
          :class:`jaxpos.schemes.rope.tables.RopeTables` (``"half"`` layout, attention factor in).

        Raises:
          ValueError: ``layout="interleaved"`` (the tables pair feature ``i`` with
            ``i + rotary_dim // 2``; convert the weights with :func:`interleaved_to_half`).
        """
        if self.layout != "half":
            raise ValueError("RoPE on load (rope tables) takes layout='half'; this RoPE has "
                             "layout='interleaved' (convert q/k weights with "
                             "jaxpos.schemes.rope.interleaved_to_half).")
        if self.scaling is None or not rope_scaling.depends_on_length(self.scaling):
            inv_freq = self.inv_freq
        else:
            if seq_len is None:
                seq_len = jnp.max(jnp.asarray(q_positions)) + 1
            inv_freq, _ = rope_scaling.frequencies_for_length(self.rotary_dim, self.base,
                                                              self.scaling, seq_len)
        return rope_tables(q_positions, kv_positions, inv_freq,
                           attention_factor=self.attention_factor,
                           angle_precision=self.angle_precision)
