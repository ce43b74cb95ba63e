"""KERPLE: kernelized relative positional embedding (Chi, Fan, Ramadge & Rudnicky 2022,
"KERPLE: Kernelized Relative Positional Embedding for Length Extrapolation", NeurIPS).

KERPLE adds to the score of head ``h`` a conditionally positive definite kernel of the
distance between the query position ``m`` and the key position ``n`` (the paper's
section "Kernelized Relative Positional Embedding", its two practical variants):

* logarithmic: ``b_h(m, n) = -r1_h * log(1 + r2_h * |m - n|)``, with ``r1_h, r2_h > 0``;
* power: ``b_h(m, n) = -r1_h * |m - n| ** r2_h``, with ``r1_h > 0`` and ``0 < r2_h <= 2``.

``r1`` and ``r2`` are learned, one pair per head. The bias depends on ``m - n`` only, so
scores are invariant to a shift of every position. ALiBi (Press et al. 2022) is the
power variant with ``r2 = 1`` and fixed ``r1``.

Units: positions are integer token indices; the bias is added to the scaled score
``scale * q . k`` (natural-log units of the softmax), after scaling, as in the authors'
GPT-NeoX code, which adds it to the attention scores after the ``1/sqrt(d)`` factor.

Keeping the parameters positive. The authors' code (``ParallelKerpleLog`` and
``ParallelKerplePower`` in github.com/chijames/KERPLE) clamps the parameters in place
before every forward pass: ``r1, r2 >= 1e-2``, and ``r2 <= 2`` for the power variant; an
optimiser step may move them out of range again, and the next forward pass clamps them
back. :class:`KERPLE` does this functionally: it stores the raw values (pytree children,
what an optimiser updates) and uses ``clip(raw, eps, upper)`` in the forward pass with a
straight-through gradient (the gradient taken at the clamped value passes to the raw
value unchanged), so a parameter that steps out of range still receives the gradient
that pulls it back. One difference: the stored raw value is not reset to the bound, so
after a long push past it, it takes as many steps to come back.

:func:`kerple_bias` is the plain formula: it uses ``r1`` and ``r2`` as given and rejects
concrete values out of range.

Initialisation (:meth:`KERPLE.init`): the authors draw ``U(0, 2)`` for the parameter
that multiplies the log (log variant ``r1``) or is the exponent (power variant ``r2``),
and ``U(0, 1)`` for the other, then clamp.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos._checks import relative_offsets
from jaxpos.schemes.base import PositionScheme, register

__all__ = ["KERPLE", "KERPLELog", "KERPLEPower", "KINDS", "kerple_bias"]

#: The two kernel families of Chi et al. 2022.
KINDS = ("log", "power")
#: Lower bound of the authors' in-place clamp (``self.eps = 1e-2`` in their code).
EPS = 1e-2
#: Upper bound of the power variant's exponent (the power kernel is CPD for r2 <= 2).
MAX_POWER = 2.0


def _kernel(dist, r1, r2, kind: str):
    """``-r1 * log(1 + r2 * dist)`` or ``-r1 * dist ** r2`` (float32, broadcasting).

    ``dist ** r2`` is computed as ``where(dist > 0, dist ** r2, 0)`` with a safe base,
    so its gradient with respect to ``r2`` (``dist ** r2 * log(dist)``) is 0 rather than
    NaN at ``dist = 0``, where the value is 0 for every ``r2 > 0``.
    """
    if kind == "log":
        return -r1 * jnp.log1p(r2 * dist)
    pos = dist > 0
    safe = jnp.where(pos, dist, jnp.float32(1.0))
    return -r1 * jnp.where(pos, safe ** r2, jnp.float32(0.0))


def _check_params(r1, r2, kind: str, *, require_concrete_range: bool = True) -> None:
    """Shapes, dtypes and (for concrete values) ranges of ``r1`` and ``r2``."""
    _checks.check_choice("kind", kind, KINDS)
    for name, p in (("r1", r1), ("r2", r2)):
        _checks.check_rank(name, p, (1,), "[num_heads], one value per head")
        _checks.check_floating(name, p)
    if _checks.shape_of(r1) != _checks.shape_of(r2):
        raise ValueError(f"r1 and r2 must have the same shape [num_heads]; got "
                         f"{_checks.shape_of(r1)} and {_checks.shape_of(r2)}.")
    if not require_concrete_range:
        return
    for name, p in (("r1", r1), ("r2", r2)):
        if _checks.is_concrete(p):
            a = np.asarray(p, np.float64)
            if not np.all(np.isfinite(a)) or np.any(a <= 0):
                raise ValueError(f"{name} must be finite and > 0 for every head (Chi et al. "
                                 f"2022, KERPLE's {kind} variant); got {a.tolist()}.")
    if kind == "power" and _checks.is_concrete(r2):
        a = np.asarray(r2, np.float64)
        if np.any(a > MAX_POWER):
            raise ValueError(f"r2 must be <= 2 for the power variant (|m - n|**r2 is "
                             f"conditionally positive definite only for 0 < r2 <= 2); got "
                             f"{a.tolist()}.")


def kerple_bias(q_positions: ArrayLike, kv_positions: ArrayLike, r1: ArrayLike, r2: ArrayLike,
                *, kind: str = "log") -> jax.Array:
    """The KERPLE score bias for every (query, key) pair and head (Chi et al. 2022).

    ``kind="log"``: ``-r1[h] * log(1 + r2[h] * |kv_pos - q_pos|)``;
    ``kind="power"``: ``-r1[h] * |kv_pos - q_pos| ** r2[h]``. Symmetric in the offset: a
    causal model hides the keys after the query with its mask.

    Args:
      q_positions: integer ``[Tq]`` or ``[B, Tq]``.
      kv_positions: integer ``[Tk]`` or ``[B, Tk]``.
      r1, r2: float ``[N]``, one pair per head, used as given (no clamping).
      kind: ``"log"`` or ``"power"``.

    Returns:
      float32 ``[N, Tq, Tk]``, or ``[B, N, Tq, Tk]`` if either position array has a
      batch axis. Distances are formed in int32, then converted to float32 (exact below
      2**24).

    Raises:
      TypeError: float positions; integer ``r1``/``r2``.
      ValueError: unknown ``kind``; ranks other than 1 or 2 for positions or other than
        1 for ``r1``/``r2``; ``r1`` and ``r2`` of different shapes; batch sizes that
        differ; concrete ``r1``/``r2`` not finite and > 0, or ``r2 > 2`` for
        ``kind="power"``.
    """
    _checks.check_integer_positions("q_positions", q_positions)
    _checks.check_integer_positions("kv_positions", kv_positions)
    _checks.check_rank("q_positions", q_positions, (1, 2), "[Tq] or [B, Tq]")
    _checks.check_rank("kv_positions", kv_positions, (1, 2), "[Tk] or [B, Tk]")
    _check_params(r1, r2, kind)
    dist = jnp.abs(relative_offsets(q_positions, kv_positions)).astype(jnp.float32)
    col = lambda p: jnp.asarray(p, jnp.float32)[:, None, None]
    return _kernel(dist[..., None, :, :], col(r1), col(r2), kind)


def _straight_through_clip(x, lo, hi):
    """``clip(x, lo, hi)`` in value, identity in gradient."""
    return x + jax.lax.stop_gradient(jnp.clip(x, lo, hi) - x)


class KERPLE(PositionScheme):
    """KERPLE (Chi et al. 2022) as a score_mod scheme; learnable ``r1``, ``r2`` per head.

    Args:
      r1, r2: float ``[N]`` raw parameters (pytree children: traced, differentiable).
        The forward pass uses them clamped to ``[eps, inf)`` (``r2`` to ``[eps, 2]`` for
        the power variant) with a straight-through gradient, as the authors' in-place
        clamp (module docstring). Concrete values must be finite and > 0 (and
        ``r2 <= 2`` for the power variant) when the scheme is built.
      kind: ``"log"`` or ``"power"`` (default ``"log"``; fixed by the registered
        subclasses :class:`KERPLELog` and :class:`KERPLEPower`).
      eps: the clamp's lower bound (the authors' 1e-2).

    Use ``causal=True`` for a decoder, as in the paper; the bias itself is symmetric.

    Raises:
      TypeError / ValueError: as :func:`kerple_bias` for ``r1``/``r2``/``kind``; a
        ``kind`` other than a subclass's own; ``eps`` not a finite number > 0.
    """

    # fields, set once in __init__ (the pytree's children and static data)
    r1: jax.Array
    r2: jax.Array
    kind: str
    eps: float

    _children = ("r1", "r2")
    _static = ("kind", "eps")
    #: The variant a subclass is registered for (None: chosen by ``kind``).
    fixed_kind: str | None = None

    def __init__(self, r1: ArrayLike, r2: ArrayLike, *, kind: str | None = None, eps: float = EPS,
                 _check_range: bool = True):
        kind = self._kind(kind)
        _check_params(r1, r2, kind, require_concrete_range=_check_range)
        eps = _checks.check_positive_float("eps", eps)
        self._set(r1=jnp.asarray(r1, jnp.float32), r2=jnp.asarray(r2, jnp.float32), kind=kind,
                  eps=eps)

    # ---- for the Flax modules: one (r1, r2) pair per head, shared by the layers of a
    # stack, as the authors' GPT-NeoX model passes one KERPLE module to every layer.
    #: Logical axis names of the parameters (:mod:`jaxpos.sharding`).
    param_axes = {"r1": ("heads",), "r2": ("heads",)}

    @classmethod
    def init_params(cls, key: jax.Array, *, num_heads: int, options: dict,
                    param_dtype: Any = jnp.float32, **_: Any) -> dict:
        """``{"r1", "r2"}``, float ``[num_heads]``, drawn as :meth:`init` does. Options:
        ``kind`` (the generic class only), ``eps``."""
        eps = options.get("eps")
        s = cls.init(num_heads, key=key, kind=options.get("kind"),
                     eps=EPS if eps is None else eps)
        return {"r1": s.r1.astype(param_dtype), "r2": s.r2.astype(param_dtype)}

    @classmethod
    def from_params(cls, params: dict, *, options: dict, **_: Any) -> PositionScheme:
        """The scheme from a module's stored ``r1``, ``r2``: raw values, which may have
        left the range during training (the forward pass clamps them), so their values
        are not checked here, only their shapes and dtypes."""
        eps = options.get("eps")
        return cls(params["r1"], params["r2"], kind=options.get("kind"),
                   eps=EPS if eps is None else eps, _check_range=False)

    @classmethod
    def init(cls, num_heads: int, *, key: jax.Array, kind: str | None = None,
             eps: float = EPS) -> KERPLE:
        """Random parameters as the authors initialise them: the log multiplier (log
        ``r1``) or the exponent (power ``r2``) ``~ U(0, 2)``, the other ``~ U(0, 1)``,
        both clamped to ``>= eps``.

        Args:
          num_heads: N (a positive int). key: a :func:`jax.random.key`.
          kind: ``"log"`` / ``"power"``; fixed by :class:`KERPLELog` / :class:`KERPLEPower`.

        Returns:
          A scheme of this class.
        """
        n = _checks.check_positive_int("num_heads", num_heads)
        kind = cls._kind(kind)
        k1, k2 = jax.random.split(key)
        u2 = jnp.maximum(2.0 * jax.random.uniform(k1, (n,), jnp.float32), eps)
        u1 = jnp.maximum(jax.random.uniform(k2, (n,), jnp.float32), eps)
        r1, r2 = (u2, u1) if kind == "log" else (u1, u2)
        return cls(r1, r2, kind=kind, eps=eps)

    @classmethod
    def _kind(cls, kind: str | None) -> str:
        """``kind`` checked against the class's own variant (default: that, or "log")."""
        if kind is None:
            return cls.fixed_kind or "log"
        _checks.check_choice("kind", kind, KINDS)
        if cls.fixed_kind is not None and kind != cls.fixed_kind:
            raise ValueError(f"{cls.__name__} is KERPLE's {cls.fixed_kind!r} variant; got "
                             f"kind={kind!r} (use KERPLE(..., kind={kind!r})).")
        return kind

    def check(self, num_heads: int, head_dim: int) -> None:
        if _checks.shape_of(self.r1)[0] != num_heads:
            raise ValueError(f"KERPLE r1 and r2 must have shape [{num_heads}] (one per query "
                             f"head); got {_checks.shape_of(self.r1)}.")

    def clamped(self) -> tuple[jax.Array, jax.Array]:
        """``(r1, r2)`` as the forward pass uses them: float32 ``[N]`` each, clamped with a
        straight-through gradient."""
        hi = MAX_POWER if self.kind == "power" else jnp.inf
        return (_straight_through_clip(self.r1, self.eps, jnp.inf),
                _straight_through_clip(self.r2, self.eps, hi))

    @property
    def score_heads(self) -> int:
        """Heads of the score term: one (r1, r2) pair each."""
        return _checks.shape_of(self.r1)[0]

    def score_mod(self) -> Callable[..., jax.Array] | None:
        """``score + kernel(|kv_pos - q_pos|)`` with the head's clamped ``r1``, ``r2``."""
        r1, r2 = self.clamped()
        kind = self.kind

        def kerple(score, batch, head, q_pos, kv_pos):
            dist = jnp.abs(kv_pos - q_pos).astype(jnp.float32)
            return score + _kernel(dist, r1[head], r2[head], kind)

        return kerple


@register("kerple_log")
class KERPLELog(KERPLE):
    """KERPLE's logarithmic variant, ``-r1 * log(1 + r2 |m - n|)`` (see :class:`KERPLE`)."""

    fixed_kind = "log"


@register("kerple_power")
class KERPLEPower(KERPLE):
    """KERPLE's power variant, ``-r1 * |m - n| ** r2`` (see :class:`KERPLE`)."""

    fixed_kind = "power"
