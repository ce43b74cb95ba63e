"""RoPE's variants: p-RoPE (Barbero et al. 2025), M-RoPE of Qwen2-VL / Qwen3-VL (Wang et al.
2024) and 2-D axial RoPE for image patches (Heo et al. 2024), built on the angles and the
rotation of :mod:`jaxpos.schemes.rope.angles`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos.schemes.rope.angles import (
    apply_rope_angles,
    check_rotary_dim,
    default_inv_freq,
    rope_angles,
)

__all__ = ["apply_axial_rope", "apply_mrope", "axial_rope_angles", "axial_rope_frequencies",
           "check_mrope_section", "mrope_angles", "mrope_frequency_axes", "p_rope_frequencies"]


# ------------------------------------------------------------------------------ p-RoPE
def p_rope_frequencies(head_dim: int, base: float = 10000.0, *, p: float) -> jax.Array:
    """p-RoPE inverse frequencies (Barbero et al. 2025, "Round and Round We Go! What makes
    Rotary Positional Encodings useful?", ICLR, p-RoPE): keep the ``p`` fraction of highest
    frequencies of a full-width RoPE and set the rest to zero (those pairs do not rotate and
    act as semantic channels). HF's ``"proportional"`` rope type (Gemma 4) is this with an
    extra ``factor`` division.

    Unlike partial rotary, the exponent divides by ``head_dim``: the kept frequencies are
    exactly those of full RoPE, ``inv_freq[i] = base ** (-2i / head_dim)`` for
    ``i < int(p * head_dim // 2)`` (HF's rounding), and 0 after.

    Args:
      head_dim: H (even). base: ``rope_theta``. p: fraction in [0, 1].

    Returns:
      float32 ``[head_dim // 2]``.

    Raises:
      ValueError: odd ``head_dim``; ``p`` outside [0, 1]; ``base <= 0``.
    """
    check_rotary_dim(head_dim)
    p = float(p)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be in [0, 1] (the fraction of frequencies that rotate); got {p}.")
    _checks.check_positive_float("base", base)
    n_rot = int(p * head_dim // 2)
    exps = np.arange(0, 2 * n_rot, 2).astype(np.float32) / np.float32(head_dim)
    rot = (np.float32(1.0) / (np.float32(base) ** exps)).astype(np.float32)
    return jnp.asarray(np.concatenate([rot, np.zeros(head_dim // 2 - n_rot, np.float32)]))


# ------------------------------------------------------------------------------ M-RoPE
def check_mrope_section(mrope_section: Sequence[int], half: int) -> tuple[int, ...]:
    """``mrope_section`` as a tuple of three ints.

    Raises:
      ValueError: not three non-negative ints summing to ``half`` (``rotary_dim // 2``).
    """
    sec = tuple(int(s) for s in mrope_section)
    if len(sec) != 3 or any(s < 0 for s in sec) or sum(sec) != half:
        raise ValueError(f"mrope_section must be 3 non-negative ints (temporal, height, width) "
                         f"summing to rotary_dim // 2 = {half}; got {tuple(mrope_section)}.")
    return sec


def mrope_frequency_axes(mrope_section: Sequence[int], half: int, *,
                         mrope_interleaved: bool = False) -> np.ndarray:
    """Which position row (0 temporal, 1 height, 2 width) drives each of the ``half``
    M-RoPE frequencies.

    * contiguous (Qwen2-VL, Wang et al. 2024, §2): ``mrope_section = (t, h, w)``
      consecutive frequencies each, ``[0]*t + [1]*h + [2]*w``;
    * interleaved (Qwen3-VL, Qwen3-Omni; HF's ``Qwen3VLTextRotaryEmbedding``,
      ``recomposition_frequencies``): frequency ``i`` follows the height row when
      ``i % 3 == 1`` and ``i < 3 * h``, the width row when ``i % 3 == 2`` and ``i < 3 * w``,
      the temporal row otherwise, so every row spans high to low frequencies
      (``[24, 20, 20]`` of 64: ``T H W T H W ... T H W T T T T``).

    Args:
      mrope_section: three non-negative ints ``(t, h, w)`` summing to ``half``.
      half: ``rotary_dim // 2``, the number of frequencies.
      mrope_interleaved: the Qwen3-VL layout instead of contiguous sections.

    Returns:
      int32 NumPy ``[half]``; row ``s`` drives exactly ``mrope_section[s]`` frequencies.

    Raises:
      ValueError: ``mrope_section`` not three non-negative ints summing to ``half``; or,
        interleaved, a height/width count too large to interleave (``3 * (n - 1) + row``
        must stay below ``half``), which HF would silently truncate.
      TypeError: ``mrope_interleaved`` not a bool.
    """
    if not isinstance(mrope_interleaved, (bool, np.bool_)):
        raise TypeError(f"mrope_interleaved must be a bool; got "
                        f"{type(mrope_interleaved).__name__} {mrope_interleaved!r}.")
    sec = check_mrope_section(mrope_section, half)
    if not mrope_interleaved:
        return np.repeat(np.arange(3, dtype=np.int32), sec)
    axes = np.zeros(half, np.int32)
    for row in (1, 2):
        if sec[row] and 3 * (sec[row] - 1) + row >= half:
            raise ValueError(
                f"mrope_section={sec} cannot be interleaved over rotary_dim // 2 = {half} "
                f"frequencies: row {row} ({('temporal', 'height', 'width')[row]}) needs "
                f"frequency {3 * (sec[row] - 1) + row}; interleaving needs 3 * (n - 1) + {row} "
                f"< {half} (the temporal row takes the remaining frequencies).")
        axes[row:3 * sec[row]:3] = row
    return axes


def mrope_angles(positions: ArrayLike, inv_freq: ArrayLike, *, mrope_section: Sequence[int],
                 angle_precision: str = "high",
                 mrope_interleaved: bool = False) -> jax.Array:
    """Multimodal RoPE angles of Qwen2-VL (Wang et al. 2024, "Qwen2-VL: Enhancing
    Vision-Language Model's Perception of the World at Any Resolution", §2, M-RoPE).

    The ``rotary_dim // 2`` frequencies are cut into three consecutive sections
    ``mrope_section = (t, h, w)`` (Qwen2-VL-7B: ``(16, 24, 24)``); frequency ``i`` of
    section ``s`` is driven by position row ``s`` (temporal, height, width). For text all
    three rows are equal and this is plain RoPE. Matches HF's ``Qwen2VLRotaryEmbedding``.
    With ``mrope_interleaved=True`` the rows are interleaved over the frequencies instead
    (Qwen3-VL / Qwen3-Omni; :func:`mrope_frequency_axes`), matching HF's
    ``Qwen3VLTextRotaryEmbedding``.

    Args:
      positions: integer ``[3, T]`` or ``[3, B, T]`` (rows: temporal, height, width).
      inv_freq: float ``[half]``. mrope_section: three ints summing to ``half``.
      angle_precision: see :func:`rope_angles`.
      mrope_interleaved: Qwen3-VL's interleaved layout (HF config key of the same name).

    Returns:
      float32 ``[1 or B, T, half]``.

    Raises:
      ValueError: positions not ``[3, ...]``; sections that do not sum to ``half``.
      TypeError: float positions.
    """
    _checks.check_rank("positions", positions, (2, 3), "[3, T] or [3, B, T]")
    _checks.check_integer_positions("positions", positions)
    shp = _checks.shape_of(positions)
    if shp[0] != 3:
        raise ValueError(f"positions must have 3 rows (temporal, height, width) on axis 0; "
                         f"got shape {shp}.")
    half = _checks.shape_of(inv_freq)[0]
    axes = mrope_frequency_axes(mrope_section, half, mrope_interleaved=mrope_interleaved)
    pos = jnp.asarray(positions, jnp.int32)
    if pos.ndim == 2:
        pos = pos[:, None, :]
    return _mrope_angles(pos, jnp.asarray(inv_freq, jnp.float32), axes=tuple(axes.tolist()),
                         angle_precision=angle_precision)


@functools.partial(jax.jit, static_argnames=("axes", "angle_precision"))
def _mrope_angles(pos, inv_freq, *, axes, angle_precision):
    ang = rope_angles(pos, inv_freq, angle_precision=angle_precision)  # [3, B, T, half]
    which = np.asarray(axes)  # position row of each frequency
    return jnp.where(which == 0, ang[0], jnp.where(which == 1, ang[1], ang[2]))


def apply_mrope(x: jax.Array, positions: ArrayLike, inv_freq: ArrayLike, *,
                mrope_section: Sequence[int], layout: str = "half",
                attention_factor: ArrayLike = 1.0, angle_precision: str = "high",
                mrope_interleaved: bool = False) -> jax.Array:
    """Rotate ``x`` ``[B, T, N, H]`` with M-RoPE (:func:`mrope_angles`; Qwen2-VL §2).

    With ``layout="half"`` and positions ``[3, B, T]`` this equals HF's
    ``apply_multimodal_rotary_pos_emb`` (Qwen2-VL); with ``mrope_interleaved=True`` it
    equals Qwen3-VL's text rotary (``Qwen3VLTextRotaryEmbedding`` + ``apply_rotary_pos_emb``).

    Raises:
      The errors of :func:`mrope_angles` and :func:`apply_rope_angles`.
    """
    ang = mrope_angles(positions, inv_freq, mrope_section=mrope_section,
                       angle_precision=angle_precision, mrope_interleaved=mrope_interleaved)
    return apply_rope_angles(x, ang, layout=layout, attention_factor=attention_factor)


# ---------------------------------------------------------------------- 2-D axial RoPE
def axial_rope_frequencies(head_dim: int, base: float = 10000.0) -> jax.Array:
    """Inverse frequencies of 2-D axial RoPE (Heo et al. 2024, "Rotary Position Embedding
    for Vision Transformer", ECCV, §3, "RoPE-Axial"), as Qwen2-VL's vision encoder builds
    them: ``1 / base ** (arange(0, H/2, 2) / (H/2))``, one set shared by both axes.

    Args:
      head_dim: H, a multiple of 4 (half of the pairs per axis). base: ``rope_theta``.

    Returns:
      float32 ``[head_dim // 4]``.

    Raises:
      ValueError: ``head_dim`` not a positive multiple of 4; ``base <= 0``.
    """
    h = _checks.check_positive_int("head_dim", head_dim)
    if h % 4:
        raise ValueError(f"head_dim must be a multiple of 4 for 2-D axial RoPE (pairs split "
                         f"between height and width); got {h}.")
    _checks.check_positive_float("base", base)
    return jnp.asarray(default_inv_freq(h // 2, base))


def axial_rope_angles(positions_hw: ArrayLike, inv_freq: ArrayLike, *,
                      angle_precision: str = "high") -> jax.Array:
    """2-D axial RoPE angles for image patches (Heo et al. 2024, §3, RoPE-Axial): the first half of
    the pairs rotate with the row (height) index, the second half with the column (width)
    index, ``angles = [h * inv_freq, w * inv_freq]``. Rotating with ``layout="half"``
    matches Qwen2-VL's vision rotary embedding in HF.

    Args:
      positions_hw: integer ``[T, 2]`` or ``[B, T, 2]``: (row, column) of each patch.
      inv_freq: float ``[rotary_dim // 4]`` (:func:`axial_rope_frequencies`).

    Returns:
      float32 ``[1 or B, T, 2 * len(inv_freq)]``.

    Raises:
      ValueError: positions not ``[..., T, 2]``. TypeError: float positions.
    """
    _checks.check_rank("positions_hw", positions_hw, (2, 3), "[T, 2] or [B, T, 2]")
    _checks.check_integer_positions("positions_hw", positions_hw)
    shp = _checks.shape_of(positions_hw)
    if shp[-1] != 2:
        raise ValueError(f"positions_hw must end in an axis of 2 (row, column); got shape {shp}.")
    pos = jnp.asarray(positions_hw, jnp.int32)
    if pos.ndim == 2:
        pos = pos[None]
    return _axial_angles(pos, jnp.asarray(inv_freq, jnp.float32), angle_precision=angle_precision)


@functools.partial(jax.jit, static_argnames=("angle_precision",))
def _axial_angles(pos, inv_freq, *, angle_precision):
    ang = rope_angles(pos, inv_freq, angle_precision=angle_precision)  # [B, T, 2, q]
    return jnp.concatenate([ang[:, :, 0], ang[:, :, 1]], axis=-1)


def apply_axial_rope(x: jax.Array, positions_hw: ArrayLike, inv_freq: ArrayLike, *,
                     layout: str = "half", angle_precision: str = "high") -> jax.Array:
    """Rotate patch queries/keys ``x`` ``[B, T, N, H]`` with 2-D axial RoPE
    (:func:`axial_rope_angles`; Heo et al. 2024, §3). ``4 * len(inv_freq)`` features rotate.

    Raises:
      The errors of :func:`axial_rope_angles` and :func:`apply_rope_angles`.
    """
    ang = axial_rope_angles(positions_hw, inv_freq, angle_precision=angle_precision)
    return apply_rope_angles(x, ang, layout=layout)

