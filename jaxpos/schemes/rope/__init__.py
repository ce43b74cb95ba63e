"""Rotary position embedding, RoPE (Su et al. 2024, "RoFormer: Enhanced Transformer with
Rotary Position Embedding", §3.2-3.4), its layouts, and its variants.

Pair ``i`` of the first ``rotary_dim`` features of each head is rotated by the angle
``pos * inv_freq[i]``, ``inv_freq[i] = base ** (-2i / rotary_dim)``. Because a rotation
by ``m`` followed by the transpose of one by ``n`` is a rotation by ``n - m``, the score
``q_m . k_n`` depends on the two contents and on ``m - n`` only. No parameters.

Layouts (which features form a pair):

* ``"half"``: feature ``i`` pairs with ``i + rotary_dim/2`` (GPT-NeoX, Llama in Hugging
  Face, ``rotate_half``).
* ``"interleaved"``: feature ``2i`` pairs with ``2i + 1`` (GPT-J, RoFormer, Meta's
  original Llama code). :func:`interleaved_to_half` / :func:`half_to_interleaved` permute
  q/k projection weights between the two (the Meta-to-HF checkpoint conversion).

Angle precision (``angle_precision``):

* ``"high"`` (default): the angle ``pos * inv_freq`` is formed exactly from 12-bit pieces
  and reduced modulo ``2*pi`` in extended precision with float32 operations only, so the
  angle handed to ``cos``/``sin`` is within 4e-7 rad of the exact value of
  ``pos * inv_freq`` modulo ``2 pi`` (inv_freq taken as the float32 numbers given) for
  ``|pos| < 2**28`` and ``inv_freq <= 1``; about 1e-6 rad at ``|pos| = 2**31``.
* ``"float32"``: ``float32(pos) * inv_freq`` rounded once, exactly as Hugging Face
  transformers computes it. Its error grows with the position: about ``pos * 6e-8`` rad
  for ``inv_freq = 1`` (0.008 rad at 131,072; 0.06 rad at 1,000,000), far above bfloat16
  rounding at long positions. Use it to reproduce HF's numbers to the last digit, given
  the same ``inv_freq``: dynamic NTK's recomputed frequencies can differ from HF's by one
  float32 ulp (a ``pow`` rounding), which this mode multiplies by the position (cos/sin
  differ by ~5e-4 at position 5,000, ~4e-3 at 200,000).

Either way cos, sin and the rotation are computed in float32 and cast back once
(Hugging Face instead casts cos/sin to the input dtype and rotates in it).

Variants: p-RoPE (:func:`p_rope_frequencies`), M-RoPE of Qwen2-VL (:func:`mrope_angles`,
:func:`apply_mrope`) and 2-D axial RoPE for image patches (:func:`axial_rope_frequencies`,
:func:`axial_rope_angles`, :func:`apply_axial_rope`). Context extension (linear, dynamic
NTK, YaRN, Llama 3, LongRoPE) lives in :mod:`jaxpos.schemes.rope.scaling`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos.schemes.base import NoPE, PositionScheme, register
from jaxpos.schemes.rope import scaling as rope_scaling
from jaxpos.schemes.rope.scaling import check_rotary_dim, default_inv_freq, rope_frequencies

__all__ = [
    "ANGLE_PRECISIONS",
    "LAYOUTS",
    "RoPE",
    "apply_axial_rope",
    "apply_mrope",
    "apply_rope",
    "apply_rope_angles",
    "axial_rope_angles",
    "axial_rope_frequencies",
    "half_to_interleaved",
    "interleaved_to_half",
    "mrope_angles",
    "mrope_frequency_axes",
    "p_rope_frequencies",
    "rope_angles",
    "rope_frequencies",
    "rotate",
]

LAYOUTS = ("half", "interleaved")
#: What a KV cache stores for RoPE (:meth:`RoPE.cache_write`).
CACHE_ROTATIONS = ("write", "read")
ANGLE_PRECISIONS = ("high", "float32")


# ------------------------------------------------------------------------- frequencies
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


# ------------------------------------------------------------------------------ angles
# 1/(2*pi) as a sum of float32 pieces, the first three with 12 significant bits, so that a
# 12-bit number times any of them is exact in float32. Their sum equals 1/(2*pi) to 2.7e-20
# (tests/schemes/test_rope.py checks it against 60 decimal digits).
_INV_2PI = (float.fromhex("0x1.45ep-3"), float.fromhex("0x1.306p-15"),
            float.fromhex("0x1.b92p-28"), float.fromhex("0x1.91054ap-40"))
_TWO_PI = 2.0 * np.pi


def _split12(x):
    """``x = hi + lo`` exactly, ``hi`` the top 12 significant bits of float32 ``x``."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    hi = jax.lax.bitcast_convert_type(bits & jnp.int32(-4096), jnp.float32)  # 0xFFFFF000
    return hi, x - hi


def _two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Knuth's error-free sum: ``a + b = s + e`` exactly. Additions only, so a compiler
    that contracts ``a * b + c`` into an FMA cannot change it."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _frac(x):
    """``x - n`` for an integer ``n`` nearest ``x`` (ties either way): exact in float32.

    Written with ``floor`` rather than ``round`` so that Pallas Triton lowers it (the
    fused kernel computes RoPE angles in-kernel). ``x + 0.5`` is exact below ``2**23``;
    at or above it every float32 is an integer and the fraction is 0.
    """
    return jnp.where(jnp.abs(x) >= 2.0**23, jnp.zeros_like(x), x - jnp.floor(x + 0.5))


def _turns_per_position(inv_freq):
    """``inv_freq / (2 pi)`` as an unevaluated float32 sum ``hi + lo`` (about 48 bits)."""
    fa, fb = _split12(inv_freq)
    k1, k2, k3, k4 = (jnp.float32(k) for k in _INV_2PI)
    # Every product of two 12-bit numbers is exact; the two k4 terms are 2^-36 smaller.
    terms = (fa * k2, fb * k1, fa * k3, fb * k2, fb * k3, fa * k4 + fb * k4)
    s, e = fa * k1, jnp.zeros_like(inv_freq)
    for t in terms:
        s, err = _two_sum(s, t)
        e = e + err
    hi = s + e
    return hi, e - (hi - s)


def _high_precision_angles(pos, inv_freq):
    """``pos * inv_freq`` reduced to [-pi, pi], float32, error <= 4e-7 rad (|pos| < 2^28).

    The int32 position is cut into 12-bit chunks (bits 0-11, 12-23, 24-31) and
    ``inv_freq / 2pi`` into four 12-bit pieces; each chunk-by-piece product is exact in
    float32, so its fractional part (in turns) is exact too. The fractions are summed
    error-free and the total is reduced once more and converted to radians.
    """
    u_hi, u_lo = _turns_per_position(inv_freq)
    pieces = _split12(u_hi) + _split12(u_lo)
    chunks = ((pos >> 24).astype(jnp.float32) * jnp.float32(2.0 ** 24),
              ((pos >> 12) & 0xFFF).astype(jnp.float32) * jnp.float32(2.0 ** 12),
              (pos & 0xFFF).astype(jnp.float32))
    s = e = None
    for c in chunks:
        c = c[..., None]
        for u in pieces:
            t = _frac(c * u)
            if s is None or e is None:  # (set together, on the first piece)
                s, e = t, jnp.zeros_like(t)
            else:
                s, err = _two_sum(s, t)
                e = e + err
    assert s is not None and e is not None  # three chunks, four pieces: set in the loop
    turns = _frac(_frac(s) + e)
    return turns * jnp.float32(_TWO_PI)


def _reduced_angles(pos, inv_freq):
    # The reduction modulo 2 pi does not change the derivative, d angle / d inv_freq = pos:
    # the value is the reduced angle (the added term is exactly 0), the gradient that of
    # the plain product. Written without custom_jvp so that Mosaic GPU can lower it.
    plain = pos.astype(jnp.float32)[..., None] * inv_freq
    reduced = jax.lax.stop_gradient(_high_precision_angles(pos, inv_freq))
    return reduced + (plain - jax.lax.stop_gradient(plain))


def rope_angles(positions: ArrayLike, inv_freq: ArrayLike, *,
                angle_precision: str = "high") -> jax.Array:
    """RoPE angles ``positions[..., None] * inv_freq`` in radians, float32.

    A small pure function (elementwise float32/int32 operations only), usable inside
    Pallas kernels.

    Args:
      positions: integer array of any shape ``[...]`` (``"float32"`` also accepts floats).
      inv_freq: float ``[half]``, radians per position.
      angle_precision: ``"high"`` (default): the exact product reduced modulo ``2 pi`` to
        [-pi, pi], error <= 4e-7 rad for ``|pos| < 2**28``, ``inv_freq <= 1`` (about 1e-6
        rad at ``2**31``); ``"float32"``: the
        unreduced float32 product, as Hugging Face computes it (see the module docstring).
        Both are differentiable in ``inv_freq`` (d angle / d inv_freq = position).

    Returns:
      float32 ``[..., half]``.

    Raises:
      ValueError: unknown ``angle_precision``. TypeError: float positions with ``"high"``.
    """
    _checks.check_choice("angle_precision", angle_precision, ANGLE_PRECISIONS)
    f = jnp.asarray(inv_freq, jnp.float32)
    if angle_precision == "float32":
        return jnp.asarray(positions).astype(jnp.float32)[..., None] * f
    _checks.check_integer_positions("positions", positions)
    return _reduced_angles(jnp.asarray(positions).astype(jnp.int32), f)


# ---------------------------------------------------------------------------- rotation
def _unpack_frequencies(inv_freq, attention_factor):
    """``(inv_freq, attention_factor)`` from an ``inv_freq`` argument that may be the pair
    :func:`rope_frequencies` returns; other nested sequences raise a ``TypeError``."""
    if not isinstance(inv_freq, (tuple, list)):
        return inv_freq, attention_factor
    if len(inv_freq) == 2 and np.ndim(inv_freq[0]) == 1 and np.ndim(inv_freq[1]) == 0:
        freqs, pair_factor = inv_freq
        one = lambda f: isinstance(f, (int, float, np.floating)) and float(f) == 1.0  # noqa: E731
        if one(pair_factor):
            return freqs, attention_factor
        if one(attention_factor):
            return freqs, pair_factor
        raise ValueError(
            f"attention_factor was given twice: inv_freq is the pair (inv_freq, "
            f"attention_factor={pair_factor!r}) that rope_frequencies returns, and "
            f"attention_factor={attention_factor!r} was passed too; pass one of them.")
    if any(np.ndim(f) != 0 for f in inv_freq):
        raise TypeError(
            f"inv_freq must be a float array [rotary_dim // 2] (or the pair (inv_freq, "
            f"attention_factor) that rope_frequencies returns); got a {type(inv_freq).__name__} "
            f"of {len(inv_freq)} items with shapes {[np.shape(f) for f in inv_freq]}.")
    return inv_freq, attention_factor


def apply_rope(x: ArrayLike, positions: ArrayLike, inv_freq: ArrayLike, *, layout: str = "half",
               attention_factor: ArrayLike = 1.0, angle_precision: str = "high") -> jax.Array:
    """Rotate the first ``2 * len(inv_freq)`` features of each head of ``x`` (Su et al.
    2024, §3.4.2: ``R^d_{Theta,m} x`` computed with cos/sin, not a matrix).

    Args:
      x: ``[B, T, N, H]`` (any float dtype).
      positions: integer ``[T]`` or ``[B, T]``.
      inv_freq: float ``[rotary_dim // 2]`` (radians per position), or the pair
        ``(inv_freq, attention_factor)`` that :func:`rope_frequencies` returns (its factor
        is then used, e.g. ``apply_rope(x, pos, rope_frequencies(64, scaling=yarn))``).
      layout: ``"half"`` or ``"interleaved"`` (see the module docstring).
      attention_factor: multiplies cos and sin (YaRN / LongRoPE ``mscale``), as HF does;
        applied to q and to k, it multiplies the logits by its square.
      angle_precision: ``"high"`` (default) or ``"float32"`` (HF's numbers); see
        :func:`rope_angles`.

    Returns:
      ``x``'s shape and dtype. Angles, cos and sin and the rotation are computed in
      float32 and cast back once; features past ``rotary_dim`` pass through unchanged.

    Raises:
      ValueError: ``x`` not rank 4; ``2 * len(inv_freq)`` larger than ``H``; positions
        of the wrong shape; unknown layout or angle_precision; an attention factor both in
        the pair and as ``attention_factor`` (neither 1). TypeError: float positions;
        ``inv_freq`` a sequence that is neither an array nor the pair above.
    """
    inv_freq, attention_factor = _unpack_frequencies(inv_freq, attention_factor)
    _checks.check_choice("layout", layout, LAYOUTS)
    _checks.check_choice("angle_precision", angle_precision, ANGLE_PRECISIONS)
    _checks.check_rank("x", x, (4,), "[B, T, N, H]")
    _checks.check_rank("inv_freq", inv_freq, (1,), "[rotary_dim // 2]")
    B, T, _, H = _checks.shape_of(x)
    half = _checks.shape_of(inv_freq)[0]
    check_rotary_dim(2 * half, H)
    pos = _checks.positions_2d("positions", positions, B, T)
    return _apply_rope(x, pos, inv_freq, jnp.float32(attention_factor), layout=layout,
                       angle_precision=angle_precision)


@functools.partial(jax.jit, static_argnames=("layout", "angle_precision"))
def _apply_rope(x, pos, inv_freq, attention_factor, *, layout, angle_precision):
    # One compiled program per shape, also when called eagerly.
    ang = rope_angles(pos, inv_freq, angle_precision=angle_precision)  # [B|1, T, half]
    return rotate(x, jnp.cos(ang), jnp.sin(ang), layout=layout, attention_factor=attention_factor)


def apply_rope_angles(x: jax.Array, angles: jax.Array, *, layout: str = "half",
                      attention_factor: ArrayLike = 1.0):
    """Rotate ``x`` ``[B, T, N, H]`` by precomputed float ``angles`` ``[B|1, T, half]``
    (M-RoPE, axial RoPE, or angles a caller built). Same conventions as :func:`apply_rope`.

    Raises:
      ValueError: ranks or shapes that do not match; ``2 * half > H``; unknown layout.
    """
    _checks.check_choice("layout", layout, LAYOUTS)
    _checks.check_rank("x", x, (4,), "[B, T, N, H]")
    _checks.check_rank("angles", angles, (3,), "[B|1, T, rotary_dim // 2]")
    B, T, _, H = _checks.shape_of(x)
    a = _checks.shape_of(angles)
    if a[0] not in (1, B) or a[1] != T:
        raise ValueError(f"angles must have shape [1 or {B}, {T}, rotary_dim // 2] to match x "
                         f"{_checks.shape_of(x)}; got {a}.")
    check_rotary_dim(2 * a[2], H)
    return _apply_angles(x, jnp.asarray(angles, jnp.float32), jnp.float32(attention_factor),
                         layout=layout)


@functools.partial(jax.jit, static_argnames=("layout",))
def _apply_angles(x, ang, attention_factor, *, layout):
    return rotate(x, jnp.cos(ang), jnp.sin(ang), layout=layout, attention_factor=attention_factor)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array, *, layout: str,
           attention_factor: ArrayLike = 1.0):
    """Rotate ``x`` ``[B, T, N, H]`` by ``cos``/``sin`` ``[B|1, T, half]`` (float32).

    Per pair ``(x1, x2)``: ``(x1 c - x2 s, x2 c + x1 s)``, the order of HF's
    ``q * cos + rotate_half(q) * sin``. Features past ``2 * half`` pass through.

    Raises:
      ValueError: ``x`` not rank 4; ``cos`` and ``sin`` not the same ``[B|1, T, half]``
        shape matching ``x``; ``2 * half > H``; an unknown ``layout``.
    """
    _checks.check_rank("x", x, (4,), "[B, T, N, H]")
    _checks.check_choice("layout", layout, LAYOUTS)
    B, T, _, H = x.shape
    if np.shape(cos) != np.shape(sin) or len(np.shape(cos)) != 3 or \
            np.shape(cos)[0] not in (1, B) or np.shape(cos)[1] != T or 2 * np.shape(cos)[2] > H:
        raise ValueError(f"cos and sin must both have shape [1 or {B}, {T}, half] with "
                         f"2 * half <= head_dim={H} to match x {tuple(x.shape)}; got "
                         f"{np.shape(cos)} and {np.shape(sin)}.")
    dtype = x.dtype
    half = cos.shape[-1]
    r = 2 * half
    xf = x.astype(jnp.float32)
    af = jnp.asarray(attention_factor, jnp.float32)
    c = (cos * af)[:, :, None, :]
    s = (sin * af)[:, :, None, :]
    xr, rest = xf[..., :r], xf[..., r:]
    if layout == "half":
        x1, x2 = xr[..., :half], xr[..., half:]
        out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = jnp.stack([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).reshape(xr.shape)
    return jnp.concatenate([out, rest], axis=-1).astype(dtype)


# ------------------------------------------------------------------- layout conversion
def _layout_perm(head_dim: int, rotary_dim: int | None) -> np.ndarray:
    r = head_dim if rotary_dim is None else rotary_dim
    check_rotary_dim(r, head_dim)
    # new feature j (half layout) = old feature perm[j] (interleaved layout)
    return np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2), np.arange(r, head_dim)])


def _permute_features(w, perm, head_dim: int, axis: int, name: str):
    shp = _checks.shape_of(w)
    if not shp:
        raise ValueError(f"{name}: w must have at least one axis; got a scalar.")
    ax = axis % len(shp)
    if shp[ax] % head_dim:
        raise ValueError(f"{name}: w's axis {axis} has size {shp[ax]}, not a multiple of "
                         f"head_dim={head_dim} (expected num_heads * head_dim).")
    xp = np if isinstance(w, np.ndarray) else jnp
    n = shp[ax] // head_dim
    w4 = xp.reshape(w, shp[:ax] + (n, head_dim) + shp[ax + 1:])
    w4 = xp.take(w4, perm, axis=ax + 1)
    return xp.reshape(w4, shp)


def interleaved_to_half(w: ArrayLike, *, head_dim: int, rotary_dim: int | None = None,
                        axis: int = -1) -> np.ndarray | jax.Array:
    """Permute q/k projection features from the interleaved layout (Meta's Llama, GPT-J,
    RoFormer) to the half layout (HF Llama, GPT-NeoX), head by head.

    Within each head, feature ``2i`` goes to ``i`` and ``2i + 1`` to ``rotary_dim/2 + i``;
    features past ``rotary_dim`` stay. Applied to ``W_q`` and ``W_k`` (and their biases),
    RoPE with ``layout="half"`` on the permuted weights gives the same attention as
    ``layout="interleaved"`` on the original ones, because ``q . k`` is unchanged by the
    same permutation of both. This is the ``permute`` of HF's ``convert_llama_weights_to_hf.py``
    (there on torch's ``[out, in]`` weights: use ``axis=0``).

    Args:
      w: NumPy or JAX array whose ``axis`` has ``num_heads * head_dim`` features (a Flax
        ``[in, N*H]`` kernel: ``axis=-1``; a torch ``[N*H, in]`` weight: ``axis=0``; a bias).
      head_dim: H. rotary_dim: rotated features per head (default H).

    Returns:
      ``w`` permuted, same shape and array type.

    Raises:
      ValueError: the axis is not a multiple of ``head_dim``; bad ``rotary_dim``.
    """
    return _permute_features(w, _layout_perm(head_dim, rotary_dim), head_dim, axis,
                             "interleaved_to_half")


def half_to_interleaved(w: ArrayLike, *, head_dim: int, rotary_dim: int | None = None,
                        axis: int = -1) -> np.ndarray | jax.Array:
    """Inverse of :func:`interleaved_to_half` (HF Llama weights back to Meta's layout).

    Same arguments, returns and errors as :func:`interleaved_to_half`.
    """
    inv = np.argsort(_layout_perm(head_dim, rotary_dim))
    return _permute_features(w, inv, head_dim, axis, "half_to_interleaved")


# ------------------------------------------------------------------------------ M-RoPE
def _check_sections(mrope_section, half: int):
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
    sec = _check_sections(mrope_section, half)
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
                 mrope_interleaved: bool = False):
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
                mrope_interleaved: bool = False):
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
                      angle_precision: str = "high"):
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
                     layout: str = "half", angle_precision: str = "high"):
    """Rotate patch queries/keys ``x`` ``[B, T, N, H]`` with 2-D axial RoPE
    (:func:`axial_rope_angles`; Heo et al. 2024, §3). ``4 * len(inv_freq)`` features rotate.

    Raises:
      The errors of :func:`axial_rope_angles` and :func:`apply_rope_angles`.
    """
    ang = axial_rope_angles(positions_hw, inv_freq, angle_precision=angle_precision)
    return apply_rope_angles(x, ang, layout=layout)


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
        for bit-level parity with transformers); see :mod:`jaxpos.schemes.rope`.
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
            sec = tuple(int(v) for v in mrope_section)
            if len(sec) != 3 or min(sec) < 0 or sum(sec) != rd // 2:
                raise ValueError(f"mrope_section must be 3 non-negative ints summing to "
                                 f"rotary_dim // 2 = {rd // 2}; got {tuple(mrope_section)}.")
            mrope_section = sec
            mrope_frequency_axes(sec, rd // 2, mrope_interleaved=mrope_interleaved)  # validates
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

    def frequencies(self, q_positions: ArrayLike, kv_positions: ArrayLike):
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

    def rotate(self, x: jax.Array, positions: ArrayLike, *, inv_freq: ArrayLike | None = None):
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
    def from_params(cls, params: dict, *, head_dim: int, options: dict, **_) -> PositionScheme:
        """Options ``rotary_dim`` (default ``head_dim``), ``rope_base`` (10000),
        ``rope_scaling`` (a :mod:`jaxpos.schemes.rope.scaling` dataclass), ``rope_layout``."""
        rd = options.get("rotary_dim")
        base = options.get("rope_base")
        return cls(rotary_dim=head_dim if rd is None else rd,
                   base=10000.0 if base is None else base,
                   layout=options.get("rope_layout") or "half",
                   scaling=options.get("rope_scaling"),
                   cache_rotation=options.get("rope_cache_rotation") or "write")

    def cache_write(self, q: jax.Array, k: jax.Array, positions: ArrayLike):
        """What a KV cache stores: ``(q, k, scheme_for_reading)``.

        ``cache_rotation="write"`` (default): ``q`` and ``k`` are rotated now, with this
        call's frequencies (a fixed table for the default, linear, YaRN, Llama 3, p-RoPE and
        M-RoPE forms; ``max(positions) + 1`` for dynamic NTK / LongRoPE, Hugging Face's
        decoding), and the cache is read with :class:`NoPE`: a decode step rotates the new
        tokens only, never the cache (a key's rotation depends on its own position only,
        Su et al. 2024, §3.4). ``cache_rotation="read"``: raw keys, the scheme itself for
        reading (every cached key rotated at each step with the current frequencies;
        :meth:`read_tables`)."""
        if self.cache_rotation == "read":
            return q, k, self
        inv_freq, _ = self.frequencies(positions, positions)
        return (self.rotate(q, positions, inv_freq=inv_freq),
                self.rotate(k, positions, inv_freq=inv_freq), NoPE())

    def read_tables(self, q_positions: ArrayLike, kv_positions: ArrayLike,
                    seq_len: ArrayLike | None = None):
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
        from jaxpos.schemes.rope.tables import rope_tables

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
