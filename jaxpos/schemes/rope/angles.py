"""RoPE angles, the rotation and the two layouts (Su et al. 2024, "RoFormer: Enhanced
Transformer with Rotary Position Embedding", §3.2-3.4).

Pair ``i`` of the first ``rotary_dim`` features of each head is rotated by the angle
``pos * inv_freq[i]``, ``inv_freq[i] = base ** (-2i / rotary_dim)``. Because a rotation
by ``m`` followed by the transpose of one by ``n`` is a rotation by ``n - m``, the score
``q_m . k_n`` depends on the two contents and on ``m - n`` only.
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

"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxpos import _checks

__all__ = ["ANGLE_PRECISIONS", "LAYOUTS", "apply_rope", "apply_rope_angles", "check_rotary_dim",
           "default_inv_freq", "half_to_interleaved", "interleaved_to_half", "rope_angles",
           "rotate"]

LAYOUTS = ("half", "interleaved")
ANGLE_PRECISIONS = ("high", "float32")


# ------------------------------------------------------------------------ frequencies
def default_inv_freq(rotary_dim: int, base: float) -> np.ndarray:
    """NumPy float32 ``1 / base ** (arange(0, rotary_dim, 2) / rotary_dim)``, op for op as
    HF computes it in float32 (the power is correctly rounded here; PyTorch's ``pow`` may
    differ from it by one ulp in about 1% of entries)."""
    exps = np.arange(0, rotary_dim, 2).astype(np.float32) / np.float32(rotary_dim)
    return (np.float32(1.0) / pow32(base, exps)).astype(np.float32)


def pow32(base: float, exps: ArrayLike) -> np.ndarray:
    """float32 ``base ** exps``, correctly rounded: computed in float64 from the float32
    operands and rounded once. NumPy's own float32 power may use a vectorised routine
    that is one ulp off in some entries (AVX-512 builds), which would make the
    frequencies depend on the CPU."""
    b = np.float64(np.float32(base))
    return (b ** np.asarray(exps, np.float32).astype(np.float64)).astype(np.float32)


def check_rotary_dim(rotary_dim: int, head_dim: int | None = None) -> int:
    """Validate ``rotary_dim`` (positive even int, at most ``head_dim``); return it."""
    r = _checks.check_positive_int("rotary_dim", rotary_dim)
    if r % 2:
        raise ValueError(f"rotary_dim must be even (features rotate in pairs); got {r}.")
    if head_dim is not None and r > head_dim:
        raise ValueError(f"rotary_dim must be <= head_dim={head_dim}; got {r}.")
    return r


# ----------------------------------------------------------------------------- angles
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


def cos_sin(angles: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(cos(angles), sin(angles))``, float32, computed once per angle.

    On the CPU backend XLA fuses a table's computation into every elementwise consumer
    and evaluates it once per element of that consumer: the rotation of q ``[B, T, N, H]``
    by tables ``[B|1, T, half]`` would redo each token's angle (about 150 float32
    operations in ``"high"`` precision), cos and sin ``B * N * 2`` times, in the forward
    pass and again in the backward pass (RoPE's training step was 1.3x NoPE's on the
    chunked engine). There the two tables come out of a two-step loop, which XLA neither
    fuses into its consumers nor unrolls, so the per-token work happens once per call.
    Other backends (GPU, TPU) compute the tables inline, where the fused recomputation
    costs nothing measurable next to the memory traffic. The values are the same.

    Args:
      angles: float32 ``[...]`` (radians).

    Returns:
      ``(cos, sin)``, each float32 of ``angles``' shape.
    """
    angles = jnp.asarray(angles, jnp.float32)

    def inline(a):
        return jnp.cos(a), jnp.sin(a)

    def materialised(a):
        both = jax.lax.map(lambda i: jnp.where(i == 0, jnp.cos(a), jnp.sin(a)),
                           jnp.arange(2, dtype=jnp.int32))
        return both[0], both[1]

    return jax.lax.platform_dependent(angles, cpu=materialised, default=inline)


@functools.partial(jax.jit, static_argnames=("layout", "angle_precision"))
def _apply_rope(x, pos, inv_freq, attention_factor, *, layout, angle_precision):
    # One compiled program per shape, also when called eagerly.
    ang = rope_angles(pos, inv_freq, angle_precision=angle_precision)  # [B|1, T, half]
    return rotate(x, *cos_sin(ang), layout=layout, attention_factor=attention_factor)


def apply_rope_angles(x: jax.Array, angles: jax.Array, *, layout: str = "half",
                      attention_factor: ArrayLike = 1.0) -> jax.Array:
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
    return rotate(x, *cos_sin(ang), layout=layout, attention_factor=attention_factor)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array, *, layout: str,
           attention_factor: ArrayLike = 1.0) -> jax.Array:
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

