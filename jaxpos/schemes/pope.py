"""PoPE: polar coordinate position embeddings (Gopalakrishnan, Csordás, Schmidhuber & Mozer
2025, "Decoupling the 'What' and 'Where' With Polar Coordinate Positional Embeddings",
arXiv:2509.10534, §3).

RoPE rotates pairs of query/key features, so a pair's own angle (content) and the
rotation angle (position) add up and are entangled in the score. PoPE makes every one of
the ``d`` features of a head a complex number whose magnitude carries the content and
whose phase carries only the position::

    q~_tc = softplus(q_tc) * exp(i t theta_c),
    k~_sc = softplus(k_sc) * exp(i (s theta_c + delta_c)),     c = 0 .. d - 1,
    a_ts  = Re[ sum_c conj(q~_tc) k~_sc ]
          = sum_c softplus(q_tc) softplus(k_sc) cos((s - t) theta_c + delta_c),

with ``theta_c = base ** (-c / d)`` (``d`` frequencies, twice RoPE's ``d / 2``) and an
optional learned phase bias ``delta_c`` per head and frequency, initialised at 0 and
clamped to ``[-2 pi, 0]`` in the forward pass (as in the public PoPE-pytorch code,
github.com/lucidrains/PoPE-pytorch: clamp with a zero gradient outside the range). The
score depends on ``s - t`` only (translation invariant) and the content term
``softplus(q) softplus(k)`` no longer depends on position.

:class:`PoPE` is a ``transform_qk`` scheme: it maps each ``d``-feature query or key to the
``2d`` real features ``[mu cos(phi) | mu sin(phi)]``, whose dot product is the real part
above, so every implementation (reference, chunked, the fused kernel) runs it as plain
attention with a query/key width of ``2d`` and values of width ``d``. The score scale
stays ``1 / sqrt(d)`` (:func:`jaxpos.attention` takes it from the width before the
transform). ``delta`` is applied to the query phase with the opposite sign (``t theta_c -
delta_c``), which gives the same ``a_ts`` and lets every query head of a grouped-query
group keep its own bias; the keys then depend on position only, so a KV cache can keep
raw keys (this library applies PoPE to cached keys at read time, like RoPE).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos.schemes.base import PositionScheme, register
from jaxpos.schemes.rope.angles import rope_angles

__all__ = ["PoPE", "apply_pope", "clamp_phase_bias", "pope_frequencies"]

#: The range the phase bias is clamped to in the forward pass.
BIAS_RANGE = (-2.0 * math.pi, 0.0)


def pope_frequencies(head_dim: int, base: float = 10000.0) -> np.ndarray:
    """``theta_c = base ** (-c / d)``, ``c = 0 .. d - 1``: NumPy float32 ``[head_dim]``
    (one frequency per feature, Gopalakrishnan et al. 2025, §3).

    Raises:
      TypeError / ValueError: ``head_dim`` not a positive int; ``base`` not > 0.
    """
    d = _checks.check_positive_int("head_dim", head_dim)
    b = _checks.check_positive_float("base", base)
    return (b ** (-np.arange(d, dtype=np.float64) / d)).astype(np.float32)


def clamp_phase_bias(delta: ArrayLike) -> jax.Array:
    """``delta`` clamped to ``[-2 pi, 0]``: float32, gradient 1 inside the range (bounds
    included) and 0 outside, as ``torch.clamp``."""
    delta = jnp.asarray(delta, jnp.float32)
    lo, hi = BIAS_RANGE
    return jnp.where((delta < lo) | (delta > hi), jnp.clip(delta, lo, hi), delta)


def apply_pope(x: jax.Array, positions: ArrayLike, inv_freq: ArrayLike, *,
               phase_bias: ArrayLike | None = None) -> jax.Array:
    """Map ``x`` to PoPE's real features ``[mu cos(phi) | mu sin(phi)]`` with
    ``mu = softplus(x)``, ``phi = pos * inv_freq - phase_bias`` (Gopalakrishnan et al.
    2025, §3). ``pos * inv_freq`` is formed exactly and reduced modulo ``2 pi`` in float32
    (:func:`jaxpos.rope_angles`, ``angle_precision="high"``), so the phase is accurate to
    about 4e-7 rad at any position below ``2**28`` (a plain float32 product loses
    ``pos * 6e-8`` rad: 0.06 rad at position 10**6).

    Args:
      x: ``[B, T, N, H]`` queries or keys (any float dtype).
      positions: integer ``[T]`` or ``[B, T]``.
      inv_freq: float ``[H]`` (:func:`pope_frequencies`).
      phase_bias: float ``[N, H]`` subtracted from the phase (already clamped; queries
        only, see the module docstring), or ``None``.

    Returns:
      ``[B, T, N, 2H]`` in ``x``'s dtype (magnitudes and angles in float32, cast back
      once); the dot product of a query's and a key's features is ``sum_c mu_q mu_k
      cos(phi_k - phi_q)``.

    Raises:
      ValueError / TypeError: ``x`` not rank 4; ``inv_freq`` not ``[H]``; float positions
        or positions of the wrong length; ``phase_bias`` not ``[N, H]``.
    """
    _checks.check_rank("x", x, (4,), "[B, T, N, H]")
    _checks.check_rank("inv_freq", inv_freq, (1,), "[head_dim]")
    B, T, N, H = _checks.shape_of(x)
    if _checks.shape_of(inv_freq)[0] != H:
        raise ValueError(f"inv_freq must have one frequency per feature, shape [{H}]; got "
                         f"{_checks.shape_of(inv_freq)}.")
    pos = _checks.positions_2d("positions", positions, B, T)  # int32 [B|1, T]
    # The phase pos * theta reduced modulo 2 pi exactly (RoPE's float32 range reduction),
    # so it keeps float32 precision at any position; d phase / d theta stays pos.
    phase = rope_angles(pos, jnp.asarray(inv_freq, jnp.float32))[:, :, None, :]
    if phase_bias is not None:
        if _checks.shape_of(phase_bias) != (N, H):
            raise ValueError(f"phase_bias must have shape [{N}, {H}] (heads, features); got "
                             f"{_checks.shape_of(phase_bias)}.")
        phase = phase - jnp.asarray(phase_bias, jnp.float32)
    mu = jax.nn.softplus(jnp.asarray(x, jnp.float32))
    out = jnp.concatenate([mu * jnp.cos(phase), mu * jnp.sin(phase)], axis=-1)
    return out.astype(_checks.dtype_of(x))


@register("pope")
class PoPE(PositionScheme):
    """PoPE (Gopalakrishnan et al. 2025) as a q/k transform from ``H`` to ``2H`` features.

    Args:
      head_dim: ``d``, the width of q and k (every feature is one frequency).
      base: ``theta_c = base ** (-c / d)`` (10000).
      phase_bias: float ``[N, H]``, the learned ``delta`` (a child: differentiable), or
        ``None`` for none; clamped to ``[-2 pi, 0]`` when used.
      inv_freq: float ``[H]`` instead of ``head_dim``/``base`` (a child).

    Raises:
      ValueError: neither ``head_dim`` nor ``inv_freq``, or both disagreeing;
        ``phase_bias`` not rank 2; in ``check``, a head width or head count the arrays
        do not fit.
      TypeError: integer ``phase_bias`` or ``inv_freq``.
    """

    # fields, set once in __init__ (the pytree's children and static data)
    inv_freq: jax.Array
    phase_bias: jax.Array | None

    _children = ("inv_freq", "phase_bias")
    params_per_layer = True  # each layer learns its own delta

    def __init__(self, head_dim: int | None = None, *, base: float = 10000.0,
                 phase_bias: ArrayLike | None = None, inv_freq: ArrayLike | None = None):
        if inv_freq is None:
            if head_dim is None:
                raise ValueError("PoPE needs head_dim (or inv_freq); got neither.")
            inv_freq = pope_frequencies(head_dim, base)
        else:
            _checks.check_rank("inv_freq", inv_freq, (1,), "[head_dim]")
            _checks.check_floating("inv_freq", inv_freq)
            if head_dim is not None and _checks.shape_of(inv_freq)[0] != head_dim:
                raise ValueError(f"head_dim={head_dim} does not match inv_freq of length "
                                 f"{_checks.shape_of(inv_freq)[0]}.")
        if phase_bias is not None:
            _checks.check_rank("phase_bias", phase_bias, (2,), "[num_heads, head_dim]")
            _checks.check_floating("phase_bias", phase_bias)
            phase_bias = jnp.asarray(phase_bias, jnp.float32)
        self._set(inv_freq=jnp.asarray(inv_freq, jnp.float32), phase_bias=phase_bias)

    # ---- for the Flax modules: delta per layer, head and frequency, initialised at 0.
    #: Logical axis names of the parameters (:mod:`jaxpos.sharding`).
    param_axes = {"phase_bias": ("heads", "head_dim")}

    @classmethod
    def init_params(cls, key: jax.Array, *, num_heads: int, head_dim: int, options: dict,
                    param_dtype: Any = jnp.float32, **_: Any) -> dict:
        """``{"phase_bias": zeros [num_heads, head_dim]}`` (the paper's initialisation), or
        ``{}`` with option ``phase_bias=False``."""
        if options.get("phase_bias") is False:
            return {}
        return {"phase_bias": jnp.zeros((num_heads, head_dim), param_dtype)}

    @classmethod
    def from_params(cls, params: dict, *, head_dim: int, options: dict, **_: Any) -> PositionScheme:
        """Options: ``rope_base`` (the frequency base, 10000), ``phase_bias`` (False for
        none)."""
        base = options.get("rope_base")
        return cls(head_dim, base=10000.0 if base is None else base,
                   phase_bias=params.get("phase_bias"))

    def check(self, num_heads: int, head_dim: int) -> None:
        if _checks.shape_of(self.inv_freq)[0] != head_dim:
            raise ValueError(f"PoPE has {_checks.shape_of(self.inv_freq)[0]} frequencies (one "
                             f"per feature); q and k have head_dim {head_dim}.")
        if self.phase_bias is not None and _checks.shape_of(self.phase_bias) != (num_heads,
                                                                                   head_dim):
            raise ValueError(f"PoPE phase_bias must have shape [{num_heads}, {head_dim}] (query "
                             f"heads, features); got {_checks.shape_of(self.phase_bias)}.")

    def transform_qk(self, q: jax.Array, k: jax.Array, q_positions: jax.Array,
                     kv_positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``q`` and ``k`` ``[B, T, N, H]`` to PoPE's ``[B, T, N, 2H]`` features; the clamped
        phase bias is subtracted from the query phase (same score as adding it to the
        key phase)."""
        bias = None if self.phase_bias is None else clamp_phase_bias(self.phase_bias)
        return (apply_pope(q, q_positions, self.inv_freq, phase_bias=bias),
                apply_pope(k, kv_positions, self.inv_freq))
