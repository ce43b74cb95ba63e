"""Rotary position embedding, RoPE (Su et al. 2024, "RoFormer: Enhanced Transformer with
Rotary Position Embedding", §3.2-3.4).

Pair ``i`` of the first ``rotary_dim`` features of each head is rotated by the angle
``pos * inv_freq[i]``, ``inv_freq[i] = base ** (-2i / rotary_dim)``. Because a rotation
by ``m`` followed by the transpose of one by ``n`` is a rotation by ``n - m``, the score
``q_m . k_n`` depends on the two contents and on ``m - n`` only. No parameters.

Layouts (which features form a pair):

* ``"half"``: feature ``i`` pairs with ``i + rotary_dim/2`` (GPT-NeoX, Llama in Hugging
  Face, ``rotate_half``).
* ``"interleaved"``: feature ``2i`` pairs with ``2i + 1`` (GPT-J, RoFormer, Meta's
  original Llama code).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpos import _checks

__all__ = ["rope_frequencies", "apply_rope", "rope_angles", "LAYOUTS"]

LAYOUTS = ("half", "interleaved")


def rope_frequencies(rotary_dim: int, base: float = 10000.0, *, scaling=None, seq_len=None):
    """Inverse frequencies of RoPE and the attention factor, as Hugging Face's rope init
    functions return them.

    Args:
      rotary_dim: number of rotated features per head (even, positive).
      base: ``rope_theta`` (10,000 in RoFormer; 500,000 in Llama 3).
      scaling: ``None`` or a context-extension dataclass (see :mod:`jaxpos.rope_scaling`).
      seq_len: sequence length, for scalings that depend on it (dynamic NTK, LongRoPE).

    Returns:
      ``(inv_freq, attention_factor)``: float32 ``[rotary_dim // 2]`` in radians per
      position, computed in float64 on the host and rounded once; and a Python float
      (1.0 without scaling) that multiplies cos and sin (so the scores by its square).

    Raises:
      ValueError: odd or non-positive ``rotary_dim``; ``base <= 0``.
    """
    check_rotary_dim(rotary_dim)
    if not float(base) > 0:
        raise ValueError(f"base must be > 0; got {base!r}.")
    if scaling is not None:
        from jaxpos import rope_scaling  # the registry of context-extension methods

        return rope_scaling.scaled_frequencies(rotary_dim, base, scaling, seq_len=seq_len)
    exps = np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(rotary_dim)
    # HF: 1.0 / (base ** (arange(0, dim, 2).float() / dim)) in float32.
    inv_freq = (1.0 / (np.float32(base) ** exps)).astype(np.float32)
    return jnp.asarray(inv_freq), 1.0


def check_rotary_dim(rotary_dim, head_dim=None) -> int:
    r = _checks.check_positive_int("rotary_dim", rotary_dim)
    if r % 2:
        raise ValueError(f"rotary_dim must be even (features rotate in pairs); got {r}.")
    if head_dim is not None and r > head_dim:
        raise ValueError(f"rotary_dim must be <= head_dim={head_dim}; got {r}.")
    return r


def rope_angles(positions, inv_freq) -> jax.Array:
    """float32 angles ``positions[..., None] * inv_freq`` -> ``[..., T, rotary_dim // 2]``."""
    pos = jnp.asarray(positions).astype(jnp.float32)
    return pos[..., None] * jnp.asarray(inv_freq, jnp.float32)


def apply_rope(x, positions, inv_freq, *, layout: str = "half", attention_factor=1.0):
    """Rotate the first ``2 * len(inv_freq)`` features of each head of ``x``.

    Args:
      x: ``[B, T, N, H]`` (any float dtype).
      positions: integer ``[T]`` or ``[B, T]``.
      inv_freq: float ``[rotary_dim // 2]`` (radians per position).
      layout: ``"half"`` or ``"interleaved"`` (see the module docstring).
      attention_factor: multiplies cos and sin (YaRN / LongRoPE ``mscale``), as HF does.

    Returns:
      ``x``'s shape and dtype. Angles, cos and sin and the rotation are computed in
      float32 and cast back once; features past ``rotary_dim`` pass through unchanged.

    Raises:
      ValueError: ``x`` not rank 4; ``2 * len(inv_freq)`` larger than ``H``; positions
        of the wrong shape; unknown layout. TypeError: float positions.
    """
    _checks.check_choice("layout", layout, LAYOUTS)
    _checks.check_rank("x", x, (4,), "[B, T, N, H]")
    _checks.check_rank("inv_freq", inv_freq, (1,), "[rotary_dim // 2]")
    B, T, N, H = _checks.shape_of(x)
    half = _checks.shape_of(inv_freq)[0]
    check_rotary_dim(2 * half, H)
    pos = _checks.positions_2d("positions", positions, B, T)
    ang = rope_angles(pos, inv_freq)  # [B|1, T, half]
    return rotate(x, jnp.cos(ang), jnp.sin(ang), layout=layout, attention_factor=attention_factor)


def rotate(x, cos, sin, *, layout: str, attention_factor=1.0):
    """Rotate ``x`` ``[B, T, N, H]`` by ``cos``/``sin`` ``[B|1, T, half]`` (float32)."""
    dtype = x.dtype
    half = cos.shape[-1]
    r = 2 * half
    xf = x.astype(jnp.float32)
    c = (cos * attention_factor)[:, :, None, :]
    s = (sin * attention_factor)[:, :, None, :]
    xr, rest = xf[..., :r], xf[..., r:]
    if layout == "half":
        x1, x2 = xr[..., :half], xr[..., half:]
        out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = jnp.stack([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).reshape(xr.shape)
    return jnp.concatenate([out, rest], axis=-1).astype(dtype)
