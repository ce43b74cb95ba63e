"""Sinusoidal absolute positions (Vaswani et al. 2017, "Attention Is All You Need", §3.5).

    P[pos, 2i]   = sin(pos * omega_i)        omega_i = base ** (-2i / d)
    P[pos, 2i+1] = cos(pos * omega_i)

Each pair ``(2i, 2i+1)`` is a clock turning at angular speed ``omega_i`` (radians per
position). Shifting a position by ``k`` rotates every pair by ``k * omega_i``, so
``P[t + k] = M_k @ P[t]`` with ``M_k`` block-diagonal (:func:`shift_matrix`).

Two frequency spacings are in use (``spacing``):

* ``"vaswani"`` (default): ``omega_i = base ** (-2i / d)``, the paper's formula (also
  Marian and XLM in Hugging Face transformers); the slowest wavelength is
  ``2 pi base ** (1 - 2/d)``, short of ``2 pi base``.
* ``"tensor2tensor"``: ``omega_i = base ** (-i / (d//2 - 1))``, i.e. ``d//2`` timescales
  in geometric progression from 1 to exactly ``base`` (tensor2tensor's
  ``get_timing_signal_1d``, fairseq's and HF M2M100's ``SinusoidalPositionalEmbedding``).
  The paper's ``omega_i`` is ``base ** (i (1/(d/2 - 1) - 2/d))`` times this one: at the
  slowest pair of ``d = 512``, ``10000 ** (2/512) = 1.037`` (3.7% apart).

Layouts (``layout``): ``"interleaved"`` (the paper: sin, cos, sin, cos, ...) and
``"concat"`` (all sines, then all cosines: tensor2tensor, fairseq, Marian).
tensor2tensor's table is ``layout="concat", spacing="tensor2tensor"``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from jaxpos import _checks

__all__ = ["SPACINGS", "relative_head_W", "shift_matrix", "sinusoidal_frequencies",
           "sinusoidal_pe"]

SPACINGS = ("vaswani", "tensor2tensor")


def sinusoidal_frequencies(d: int, base: float = 10000.0, *,
                           spacing: str = "vaswani") -> np.ndarray:
    """Angular frequencies of the sinusoidal table, float64.

    * ``spacing="vaswani"`` (Vaswani et al. 2017, §3.5): ``omega_i = base ** (-2i / d)``
      for ``i = 0 .. ceil(d/2) - 1``; pair ``i`` has wavelength ``2 * pi / omega_i``
      positions, from ``2 * pi`` (i = 0) to ``2 * pi * base ** (1 - 2/d)`` for the slowest
      pair of an even ``d``.
    * ``spacing="tensor2tensor"`` (tensor2tensor ``common_attention.get_timing_signal_1d``
      with ``min_timescale=1, max_timescale=base``): ``omega_i = base ** (-i / max(d//2 - 1,
      1))`` for ``i = 0 .. d//2 - 1``; the slowest wavelength is exactly ``2 * pi * base``.

    Args:
      d: model width, a positive Python int.
      base: wavelength base, a positive float.
      spacing: ``"vaswani"`` (default) or ``"tensor2tensor"``.

    Returns:
      float64 NumPy ``[ceil(d / 2)]`` (``"vaswani"``) or ``[d // 2]``
      (``"tensor2tensor"``), radians per position.

    Raises:
      TypeError: ``d`` not an int. ValueError: ``d < 1``, ``base <= 0`` or an unknown
        ``spacing``.
    """
    d = _checks.check_positive_int("d", d)
    _checks.check_positive_float("base", base)
    _checks.check_choice("spacing", spacing, SPACINGS)
    if spacing == "tensor2tensor":
        i = np.arange(d // 2, dtype=np.float64)
        return np.power(float(base), -i / max(d // 2 - 1, 1))
    i = np.arange((d + 1) // 2, dtype=np.float64)
    return np.power(float(base), -2.0 * i / d)


def sinusoidal_pe(
    T: int,
    d: int,
    base: float = 10000.0,
    *,
    offset: ArrayLike = 0,
    layout: str = "interleaved",
    dtype: DTypeLike = jnp.float32,
    angle_precision: str = "float32",
    spacing: str = "vaswani",
) -> jax.Array:
    """The sinusoidal position table of Vaswani et al. 2017, §3.5.

    Args:
      T: number of positions (rows), a Python int >= 0.
      d: model width (columns), a Python int >= 1. An odd ``d`` is handled by
        computing ``ceil(d/2)`` pairs and dropping the last cosine column, so
        column ``2i`` is still ``sin(pos * base**(-2i/d))`` (``"vaswani"``, as Marian);
        with ``spacing="tensor2tensor"`` there are ``d // 2`` pairs and the last column
        is zero, as tensor2tensor pads it.
      base: the wavelength base (10000 in the paper).
      offset: integer added to every position (scalar, static or traced, or a
        ``[B]`` integer array for per-row offsets, giving ``[B, T, d]``). Use it
        for KV-cache decoding.
      layout: ``"interleaved"`` (the paper: sin, cos, sin, cos, ...) or
        ``"concat"`` (all sines, then all cosines; tensor2tensor, fairseq and Marian).
      dtype: output dtype. The angles and trigonometry are computed in float32.
      angle_precision: ``"float32"`` (default): ``float32(pos) * float32(omega)``
        rounded once, as every common implementation does; its error grows with the
        position (about 4e-3 in the table at position 100,000 for ``d = 512``).
        ``"high"``: for long offsets, the angle ``pos * omega`` with ``omega`` the exact
        (float64) frequency of ``spacing``, not its float32 rounding: ``omega`` is split
        into a float32 head and tail, ``pos * head`` is formed exactly and reduced modulo
        ``2 pi`` (:func:`jaxpos.schemes.rope.rope_angles`) and ``pos * tail`` added. Measured
        against a float64 NumPy table at ``d = 512``: within 4e-7 for positions below
        ``2**24`` (1.3e-6 at ``2**28``, 1e-5 at ``2**31``), where at 1,000,000
        ``"float32"`` is off by 5e-2 and even an exact product with the float32
        ``omega`` by 3e-2. The default stays ``"float32"`` so tables match published
        code.
      spacing: ``"vaswani"`` (default, the paper) or ``"tensor2tensor"``; see
        :func:`sinusoidal_frequencies`.

    Returns:
      ``[T, d]`` (or ``[B, T, d]`` with a ``[B]`` offset) array of ``dtype``.

    Raises:
      ValueError: ``T < 0``, ``d < 1``, ``base <= 0``, an unknown ``layout``,
        ``angle_precision`` or ``spacing``, or a
        concrete ``offset`` whose positions ``offset .. offset + T - 1`` leave int32.
      TypeError: ``T`` or ``d`` not an int, or a float ``offset``.
    """
    T = _checks.check_nonneg_int("T", T)
    d = _checks.check_positive_int("d", d)
    _checks.check_choice("layout", layout, ("interleaved", "concat"))
    _checks.check_choice("angle_precision", angle_precision, ("float32", "high"))
    omega64 = sinusoidal_frequencies(d, base, spacing=spacing)
    omega = omega64.astype(np.float32)
    omega_tail = (omega64 - omega.astype(np.float64)).astype(np.float32)
    if np.issubdtype(_checks.dtype_of(offset), np.integer):  # before JAX's int32 cast wraps it
        _checks.check_int32_range("offset", offset, span=max(T - 1, 0))
    off = jnp.asarray(offset)
    if not jnp.issubdtype(off.dtype, jnp.integer):
        raise TypeError(f"offset must be an integer (scalar or [B]); got dtype {off.dtype}.")
    if off.ndim > 1:
        raise ValueError(f"offset must be a scalar or a [B] array; got shape {off.shape}.")
    return _table(off.astype(jnp.int32), jnp.asarray(omega), jnp.asarray(omega_tail), T=T, d=d,
                  layout=layout, dtype=jnp.dtype(dtype), angle_precision=angle_precision)


@functools.partial(jax.jit, static_argnames=("T", "d", "layout", "dtype", "angle_precision"))
def _table(off, omega, omega_tail, *, T, d, layout, dtype, angle_precision="float32"):
    """One compiled computation per (T, d, layout, dtype, precision), also when eager.

    ``omega`` float32 ``[n]`` (the rounded frequencies), ``omega_tail`` float32 ``[n]``
    (``omega64 - omega``, used by ``"high"`` only); ``n`` pairs fill ``2n`` columns,
    then the table is cut to ``d`` or padded with zeros to ``d``.
    """
    pos = jnp.arange(T, dtype=jnp.int32) + off[..., None]  # [T] or [B, T]
    if angle_precision == "high":
        from jaxpos.schemes.rope import rope_angles

        angle = rope_angles(pos, omega, angle_precision="high")  # exact, reduced mod 2 pi
        angle = angle + pos.astype(jnp.float32)[..., None] * omega_tail
    else:
        angle = pos.astype(jnp.float32)[..., None] * omega  # [..., T, n]
    s, c = jnp.sin(angle), jnp.cos(angle)
    if layout == "interleaved":
        table = jnp.stack([s, c], axis=-1).reshape(*angle.shape[:-1], 2 * angle.shape[-1])
    else:  # concat: every sine, then every cosine
        table = jnp.concatenate([s, c], axis=-1)
    n = table.shape[-1]
    if n >= d:  # "vaswani" with an odd d: the last cosine is dropped
        return table[..., :d].astype(dtype)
    # "tensor2tensor" with an odd d: a zero column, as tensor2tensor pads
    pad = jnp.zeros((*table.shape[:-1], d - n), table.dtype)
    return jnp.concatenate([table, pad], axis=-1).astype(dtype)


def shift_matrix(k: int, d: int, base: float = 10000.0, *, spacing: str = "vaswani") -> jax.Array:
    """The ``[d, d]`` block-diagonal rotation ``M_k`` with ``P[t + k] = M_k @ P[t]``.

    For the interleaved table of :func:`sinusoidal_pe`, block ``i`` acts on
    ``(sin, cos)`` of angle ``a = t * omega_i`` and adds ``k * omega_i`` to it:
    ``[[cos, sin], [-sin, cos]]`` of ``k * omega_i`` (the angle-addition identity,
    Vaswani et al. 2017, §3.5). ``M_{-k} = M_k^T``.

    Args:
      k: the shift in positions, an integer (may be negative): a Python/NumPy int
        (the angles are then formed in float64 on the host and rounded once) or an
        integer scalar JAX array, possibly traced under ``jit``/``vmap`` (angles in
        float32).
      d: even model width, a Python int.
      base: wavelength base (10000 in the paper).
      spacing: the table's frequency spacing (:func:`sinusoidal_frequencies`).

    Returns:
      float32 ``[d, d]``.

    Raises:
      ValueError: ``d`` odd or < 2 (the rotation needs whole pairs), ``k`` not a scalar,
        unknown ``spacing``.
      TypeError: ``k`` not an integer, ``d`` not an int.
    """
    d = _checks.check_positive_int("d", d)
    if d % 2:
        raise ValueError(f"d must be even for shift_matrix (whole sin/cos pairs); got {d}.")
    if _checks.shape_of(k) != ():
        raise ValueError(f"k must be a scalar shift; got shape {_checks.shape_of(k)}.")
    _checks.check_integer_positions("k", k)
    omega = sinusoidal_frequencies(d, base, spacing=spacing)
    idx = np.arange(d // 2) * 2
    if _checks.is_concrete(k):
        theta = float(np.asarray(k)) * omega  # float64 on the host, then rounded once
        c, s = np.cos(theta), np.sin(theta)
        m = np.zeros((d, d), np.float64)
        # (sin(a + b), cos(a + b)) = (sin a cos b + cos a sin b, cos a cos b - sin a sin b)
        m[idx, idx] = c
        m[idx, idx + 1] = s
        m[idx + 1, idx] = -s
        m[idx + 1, idx + 1] = c
        return jnp.asarray(m, jnp.float32)
    theta = jnp.asarray(k, jnp.int32).astype(jnp.float32) * jnp.asarray(omega, jnp.float32)
    c, s = jnp.cos(theta), jnp.sin(theta)
    m = jnp.zeros((d, d), jnp.float32)
    m = m.at[idx, idx].set(c).at[idx, idx + 1].set(s)
    return m.at[idx + 1, idx].set(-s).at[idx + 1, idx + 1].set(c)


def relative_head_W(k: int, d: int, c: float = 8.0, base: float = 10000.0, *,
                    spacing: str = "vaswani") -> jax.Array:
    """``c * M_k``: a bilinear form under which ``p_m @ W @ p_n`` peaks at ``n = m - k``.

    With rows ``p = sinusoidal_pe(...)``, ``p_m W p_n = c * p_{m-k} . p_n`` (because
    ``M_k^T = M_{-k}``), which depends only on ``m - n`` and equals ``c * d / 2`` at
    ``n = m - k``: a head whose query-key product is ``c * M_k`` on the position
    subspace attends ``k`` tokens back at every position (the "previous-token head"
    for ``k = 1``). Vaswani et al. 2017, §3.5 (the shift hypothesis).

    Args:
      k: integer shift (as :func:`shift_matrix`; may be traced).
      d: even model width.
      c: the gain (a positive float in the construction; any float is accepted).
      base: wavelength base.
      spacing: the table's frequency spacing (:func:`sinusoidal_frequencies`).

    Returns:
      float32 ``[d, d]``.

    Raises:
      As :func:`shift_matrix`.
    """
    return jnp.asarray(c, jnp.float32) * shift_matrix(k, d, base, spacing=spacing)
