"""Sinusoidal absolute positions (Vaswani et al. 2017, "Attention Is All You Need", §3.5).

    P[pos, 2i]   = sin(pos * omega_i)        omega_i = base ** (-2i / d)
    P[pos, 2i+1] = cos(pos * omega_i)

Each pair ``(2i, 2i+1)`` is a clock turning at angular speed ``omega_i`` (radians per
position). Shifting a position by ``k`` rotates every pair by ``k * omega_i``, so
``P[t + k] = M_k @ P[t]`` with ``M_k`` block-diagonal (:func:`shift_matrix`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpos import _checks

__all__ = ["sinusoidal_pe", "sinusoidal_frequencies", "shift_matrix", "relative_head_W"]


def sinusoidal_frequencies(d: int, base: float = 10000.0) -> np.ndarray:
    """Angular frequencies ``omega_i = base ** (-2i / d)`` for ``i = 0 .. ceil(d/2) - 1``.

    Returns a float64 NumPy array of length ``ceil(d / 2)`` (radians per position).
    """
    d = _checks.check_positive_int("d", d)
    if not base > 0:
        raise ValueError(f"base must be > 0; got {base!r}.")
    i = np.arange((d + 1) // 2, dtype=np.float64)
    return np.power(float(base), -2.0 * i / d)


def sinusoidal_pe(
    T: int,
    d: int,
    base: float = 10000.0,
    *,
    offset=0,
    layout: str = "interleaved",
    dtype=jnp.float32,
) -> jax.Array:
    """The sinusoidal position table of Vaswani et al. 2017, §3.5.

    Args:
      T: number of positions (rows), a Python int >= 0.
      d: model width (columns), a Python int >= 1. An odd ``d`` is handled by
        computing ``ceil(d/2)`` pairs and dropping the last cosine column, so
        column ``2i`` is still ``sin(pos * base**(-2i/d))``.
      base: the wavelength base (10000 in the paper).
      offset: integer added to every position (scalar, static or traced, or a
        ``[B]`` integer array for per-row offsets, giving ``[B, T, d]``). Use it
        for KV-cache decoding.
      layout: ``"interleaved"`` (the paper: sin, cos, sin, cos, ...) or
        ``"concat"`` (tensor2tensor: all sines, then all cosines).
      dtype: output dtype. The angles and trigonometry are computed in float32.

    Returns:
      ``[T, d]`` (or ``[B, T, d]`` with a ``[B]`` offset) array of ``dtype``.

    Raises:
      ValueError: ``T < 0``, ``d < 1``, ``base <= 0`` or an unknown ``layout``.
      TypeError: ``T`` or ``d`` not an int, or a float ``offset``.
    """
    T = _checks.check_nonneg_int("T", T)
    d = _checks.check_positive_int("d", d)
    _checks.check_choice("layout", layout, ("interleaved", "concat"))
    omega = jnp.asarray(sinusoidal_frequencies(d, base), jnp.float32)
    off = jnp.asarray(offset)
    if not jnp.issubdtype(off.dtype, jnp.integer):
        raise TypeError(f"offset must be an integer (scalar or [B]); got dtype {off.dtype}.")
    if off.ndim > 1:
        raise ValueError(f"offset must be a scalar or a [B] array; got shape {off.shape}.")
    pos = jnp.arange(T, dtype=jnp.int32) + off.astype(jnp.int32)[..., None]  # [T] or [B, T]
    angle = pos.astype(jnp.float32)[..., None] * omega  # [..., T, ceil(d/2)]
    s, c = jnp.sin(angle), jnp.cos(angle)
    if layout == "interleaved":
        table = jnp.stack([s, c], axis=-1).reshape(*angle.shape[:-1], 2 * angle.shape[-1])
    else:
        table = jnp.concatenate([s, c], axis=-1)
        if d % 2:  # drop the last cosine, keeping every sine
            table = jnp.concatenate([s, c[..., :-1]], axis=-1)
            return table.astype(dtype)
    return table[..., :d].astype(dtype)


def shift_matrix(k: int, d: int, base: float = 10000.0) -> jax.Array:
    """The ``[d, d]`` block-diagonal rotation ``M_k`` with ``P[t + k] = M_k @ P[t]``.

    For the interleaved table of :func:`sinusoidal_pe`, block ``i`` acts on
    ``(sin, cos)`` of angle ``a = t * omega_i`` and adds ``k * omega_i`` to it:
    ``[[cos, sin], [-sin, cos]]`` of ``k * omega_i``. ``M_{-k} = M_k^T``.

    Args:
      k: the shift in positions (int, may be negative).
      d: even model width.
      base: wavelength base.

    Returns:
      float32 ``[d, d]``.

    Raises:
      ValueError: ``d`` odd or < 2 (the rotation needs whole pairs).
    """
    d = _checks.check_positive_int("d", d)
    if d % 2:
        raise ValueError(f"d must be even for shift_matrix (whole sin/cos pairs); got {d}.")
    omega = sinusoidal_frequencies(d, base)
    theta = float(k) * omega  # float64 on the host, then rounded once
    c, s = np.cos(theta), np.sin(theta)
    m = np.zeros((d, d), np.float64)
    idx = np.arange(d // 2) * 2
    # (sin(a + b), cos(a + b)) = (sin a cos b + cos a sin b, cos a cos b - sin a sin b)
    m[idx, idx] = c
    m[idx, idx + 1] = s
    m[idx + 1, idx] = -s
    m[idx + 1, idx + 1] = c
    return jnp.asarray(m, jnp.float32)


def relative_head_W(k: int, d: int, c: float = 8.0, base: float = 10000.0) -> jax.Array:
    """``c * M_k``: a bilinear form under which ``p_m @ W @ p_n`` peaks at ``n = m - k``.

    With rows ``p = sinusoidal_pe(...)``, ``p_m W p_n = c * p_{m-k} . p_n``, which
    depends only on ``m - n`` and equals ``c * d / 2`` at ``n = m - k`` (the
    "previous-token head" for ``k = 1``). Float32 ``[d, d]``; errors as
    :func:`shift_matrix`.
    """
    return jnp.float32(c) * shift_matrix(k, d, base)
