"""xPos: RoPE with an exponential decay per frequency (Sun et al. 2022, "A
Length-Extrapolatable Transformer", ACL 2023, §3, "Extrapolatable Position Embedding").

RoPE (Su et al. 2024) rotates pair ``i`` of a query at position ``m`` and of a key at
position ``n`` by ``m * theta_i`` and ``n * theta_i``. xPos also scales the query pair by
``zeta_i ** (m / scale_base)`` and the key pair by ``zeta_i ** (-n / scale_base)``::

    zeta_i = (2i / d + gamma) / (1 + gamma),   i = 0 .. d/2 - 1,   gamma = 0.4,

(``d`` the rotary dimension; ``zeta_i = (2i + 0.4 d) / (1.4 d)`` in the authors'
torchscale code, ``scale_base = 512`` there). Pair ``i`` of the score ``q_m . k_n`` is
then multiplied by ``zeta_i ** ((m - n) / scale_base)``: below 1 for a key before the
query, decaying with the distance, fastest for the high frequencies (small ``i``),
which stabilises attention at lengths beyond training. Scores still depend on ``m - n``
only (translation invariant).

Numerics: the factors themselves grow or shrink exponentially with the position
(``0.2857 ** (4096 / 512) = 4.4e-5``). As torchscale does (it counts positions from
``-length // 2``), :class:`XPos` measures both exponents from a common centre, the
midpoint of the call's smallest and largest position (per batch row), which leaves
every score unchanged and keeps the factors near 1: float32 holds them up to about
70 * ``scale_base`` positions on either side of the centre. The rotation itself uses
the positions as given (:func:`jaxpos.schemes.rope.apply_rope`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos.schemes.base import PositionScheme, register
from jaxpos.schemes.rope import ANGLE_PRECISIONS, LAYOUTS, apply_rope
from jaxpos.schemes.rope.scaling import check_rotary_dim, rope_frequencies

__all__ = ["XPos", "apply_xpos", "xpos_scale", "xpos_zeta"]


def xpos_zeta(rotary_dim: int, gamma: float = 0.4) -> np.ndarray:
    """``zeta_i = (2i + gamma d) / ((1 + gamma) d)``, ``i = 0..d/2 - 1``: NumPy float32
    ``[rotary_dim // 2]`` (Sun et al. 2022, §3; ``gamma = 0.4``).

    Raises:
      TypeError / ValueError: ``rotary_dim`` not a positive even int; ``gamma`` not a
        finite number > 0.
    """
    d = check_rotary_dim(rotary_dim)
    g = _checks.check_positive_float("gamma", gamma)
    i = np.arange(0, d, 2, dtype=np.float64)
    return ((i + g * d) / ((1.0 + g) * d)).astype(np.float32)


def xpos_scale(positions: ArrayLike, rotary_dim: int, *, scale_base: float = 512.0,
               gamma: float = 0.4, downscale: bool = False) -> jax.Array:
    """Per-pair factors ``zeta_i ** (pos / scale_base)`` (``** (-pos / scale_base)`` when
    ``downscale``), the query's (key's) scale in Sun et al. 2022, §3.

    Args:
      positions: integer ``[..., T]`` (already shifted by any centre).
      rotary_dim: d (even). scale_base: positions per unit exponent (512). gamma: 0.4.
      downscale: the key's inverse factor.

    Returns:
      float32 ``[..., T, rotary_dim // 2]``, computed as ``exp(pos / scale_base *
      log(zeta_i))``.

    Raises:
      TypeError: float positions. ValueError: bad ``rotary_dim``, ``scale_base``,
        ``gamma``.
    """
    _checks.check_integer_positions("positions", positions)
    base = _checks.check_positive_float("scale_base", scale_base)
    log_zeta = jnp.asarray(np.log(xpos_zeta(rotary_dim, gamma).astype(np.float64)), jnp.float32)
    e = jnp.asarray(positions, jnp.int32).astype(jnp.float32) / jnp.float32(base)
    sign = -1.0 if downscale else 1.0
    return jnp.exp(jnp.float32(sign) * e[..., None] * log_zeta)


def apply_xpos(x: jax.Array, positions: ArrayLike, inv_freq: ArrayLike, *,
               scale_base: float = 512.0, gamma: float = 0.4, downscale: bool = False,
               layout: str = "half", scale_offset: ArrayLike = 0,
               angle_precision: str = "high") -> jax.Array:
    """Rotate ``x`` as RoPE does and scale each rotated pair by xPos's factor (Sun et al.
    2022, §3): queries with ``downscale=False``, keys with ``downscale=True``.

    Args:
      x: ``[B, T, N, H]`` (any float dtype).
      positions: integer ``[T]`` or ``[B, T]`` (the rotation angle's positions).
      inv_freq: float ``[rotary_dim // 2]`` (e.g. :func:`jaxpos.rope_frequencies`).
      scale_base, gamma, downscale: as :func:`xpos_scale`.
      layout: ``"half"`` or ``"interleaved"`` (torchscale's code is interleaved); the
        factor of pair ``i`` multiplies both of its features.
      scale_offset: integer scalar or ``[B|1, 1]``: the factor uses ``positions -
        scale_offset`` (the same offset for the queries and keys of one call leaves the
        scores unchanged; :class:`XPos` passes the centre of the call's positions).
      angle_precision: as :func:`jaxpos.apply_rope`.

    Returns:
      ``x``'s shape and dtype (rotation and scaling in float32, cast back once); features
      past ``rotary_dim`` pass through unchanged.

    Raises:
      The errors of :func:`jaxpos.apply_rope` (shapes, layout, positions) and of
      :func:`xpos_scale`.
    """
    _checks.check_rank("x", x, (4,), "[B, T, N, H]")
    _checks.check_rank("inv_freq", inv_freq, (1,), "[rotary_dim // 2]")
    B, T, _, H = _checks.shape_of(x)
    half = _checks.shape_of(inv_freq)[0]
    _checks.check_integer_positions("scale_offset", scale_offset)
    rot = apply_rope(jnp.asarray(x, jnp.float32), positions, inv_freq, layout=layout,
                     angle_precision=angle_precision)
    pos = _checks.positions_2d("positions", positions, B, T)
    s = xpos_scale(pos - jnp.asarray(scale_offset, jnp.int32), 2 * half,
                   scale_base=scale_base, gamma=gamma, downscale=downscale)  # [B|1, T, half]
    feat = jnp.concatenate([s, s], -1) if layout == "half" else jnp.repeat(s, 2, axis=-1)
    feat = jnp.concatenate([feat, jnp.ones(feat.shape[:-1] + (H - 2 * half,), jnp.float32)], -1)
    return (rot * feat[:, :, None, :]).astype(_checks.dtype_of(x))


def _centre(q_positions, kv_positions):
    """Midpoint (int32 ``[B|1, 1]``) of the smallest and largest position of a call."""
    lo = jnp.minimum(jnp.min(q_positions, axis=-1, keepdims=True),
                     jnp.min(kv_positions, axis=-1, keepdims=True))
    hi = jnp.maximum(jnp.max(q_positions, axis=-1, keepdims=True),
                     jnp.max(kv_positions, axis=-1, keepdims=True))
    return lo + (hi - lo) // 2


@register("xpos")
class XPos(PositionScheme):
    """xPos (Sun et al. 2022) as a q/k transform: RoPE plus the per-pair exponential scale
    on queries and its inverse on keys, measured from the call's centre position.

    Args:
      rotary_dim: rotated features per head (even; the paper rotates the whole head).
      base: RoPE's ``theta`` base (10000).
      scale_base: positions per unit exponent of ``zeta`` (torchscale's 512).
      gamma: the 0.4 of ``zeta_i = (2i/d + gamma) / (1 + gamma)``.
      layout: ``"half"`` (default, as :class:`jaxpos.RoPE`) or ``"interleaved"``
        (torchscale's pairing; use it to port torchscale weights).
      angle_precision: as :class:`jaxpos.RoPE`.
      inv_freq: float ``[rotary_dim // 2]`` instead of ``rotary_dim``/``base`` (a child).

    Raises:
      ValueError: neither ``rotary_dim`` nor ``inv_freq``, or both disagreeing; bad
        ``scale_base``/``gamma``/``layout``/``angle_precision``.
      TypeError: non-float ``inv_freq``.
    """

    # fields, set once in __init__ (the pytree's children and static data)
    inv_freq: jax.Array
    rotary_dim: int
    scale_base: float
    gamma: float
    layout: str
    angle_precision: str

    _children = ("inv_freq",)
    _static = ("rotary_dim", "scale_base", "gamma", "layout", "angle_precision")

    def __init__(self, rotary_dim: int | None = None, *, base: float = 10000.0,
                 scale_base: float = 512.0, gamma: float = 0.4, layout: str = "half",
                 angle_precision: str = "high", inv_freq: ArrayLike | None = None):
        _checks.check_choice("layout", layout, LAYOUTS)
        _checks.check_choice("angle_precision", angle_precision, ANGLE_PRECISIONS)
        if inv_freq is None:
            if rotary_dim is None:
                raise ValueError("XPos needs rotary_dim (or inv_freq); got neither.")
            inv_freq, _ = rope_frequencies(rotary_dim, base)
        else:
            _checks.check_rank("inv_freq", inv_freq, (1,), "[rotary_dim // 2]")
            _checks.check_floating("inv_freq", inv_freq)
        rd = 2 * _checks.shape_of(inv_freq)[0]
        if rotary_dim is not None and check_rotary_dim(rotary_dim) != rd:
            raise ValueError(f"rotary_dim={rotary_dim} does not match inv_freq of length "
                             f"{rd // 2}.")
        xpos_zeta(rd, gamma)  # validates gamma
        self._set(inv_freq=jnp.asarray(inv_freq, jnp.float32), rotary_dim=rd,
                  scale_base=_checks.check_positive_float("scale_base", scale_base),
                  gamma=float(gamma), layout=layout, angle_precision=angle_precision)

    @classmethod
    def from_params(cls, params: dict, *, head_dim: int, options: dict, **_: Any) -> PositionScheme:
        """For the Flax modules (no parameters): options ``rotary_dim`` (default
        ``head_dim``), ``rope_base`` (10000), ``rope_layout`` ("half"), ``scale_base``
        (512)."""
        get = lambda name, default: default if options.get(name) is None else options[name]
        return cls(get("rotary_dim", head_dim), base=get("rope_base", 10000.0),
                   scale_base=get("scale_base", 512.0), layout=get("rope_layout", "half"))

    def check(self, num_heads: int, head_dim: int) -> None:
        check_rotary_dim(self.rotary_dim, head_dim)

    def transform_qk(self, q: jax.Array, k: jax.Array, q_positions: jax.Array,
                     kv_positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``q`` rotated and scaled by ``zeta ** ((m - c) / scale_base)``, ``k`` rotated and
        scaled by ``zeta ** (-(n - c) / scale_base)``, ``c`` the centre of the call's
        positions (int32 ``[B|1, T]``). Shapes and dtypes kept."""
        q_positions = jnp.asarray(q_positions, jnp.int32)
        kv_positions = jnp.asarray(kv_positions, jnp.int32)
        if 0 in (q_positions.shape[-1], kv_positions.shape[-1]):
            return q, k
        c = _centre(q_positions, kv_positions)
        kw: dict[str, Any] = dict(scale_base=self.scale_base, gamma=self.gamma, layout=self.layout,
                  scale_offset=c, angle_precision=self.angle_precision)
        return (apply_xpos(q, q_positions, self.inv_freq, downscale=False, **kw),
                apply_xpos(k, kv_positions, self.inv_freq, downscale=True, **kw))
