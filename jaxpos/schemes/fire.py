"""FIRE: functional interpolation for relative positions (Li et al. 2023, "Functional
Interpolation for Relative Positions Improves Long Context Transformers", ICLR 2024).

The bias of head ``h`` for a query at position ``i`` and a key at position ``j`` is a
learned function of the *normalised* distance (the paper's §3, FIRE's definition with
progressive interpolation and its log transform)::

    b_h(i, j) = MLP(psi(i - j) / psi(max(L, i)))[h],      psi(x) = log(c * x + 1)

* ``MLP``: 1 -> ``mlp_width`` (32) -> N, ReLU, shared by the heads (one output per head);
* ``c > 0``: learned, sharpens the log transform (initial value 0.1);
* ``L``: a learned threshold. Dividing by ``psi(i)`` maps every distance a query can see
  into ``[0, 1]`` whatever its position ("progressive interpolation"); ``max(L, i)``
  keeps short contexts from being stretched over the whole range.

As in the authors' PyTorch implementation printed in the paper's appendix, the
parameters enter as ``psi(x) = log(|c * x| + 1)``, ``L = |L_multiplier * init_L|`` with
``init_L`` fixed (512 there) and ``L_multiplier`` learned (initial value 1), and
``eps = 1e-6`` is added to the normaliser. So ``c`` and ``L_multiplier`` may take any
sign; only their magnitudes matter.

FIRE is causal: visible keys have ``j <= i``. For ``j > i`` the formula is evaluated at
``|c (i - j)|`` (symmetric); a decoder hides those keys with ``causal=True``.

Translation invariance: ``b_h(i + s, j + s) = b_h(i, j)`` only while every query
position stays at or below ``L`` (the normaliser is then ``psi(L)`` for all of them);
past ``L`` the normaliser grows with ``i``, so FIRE is *not* translation invariant
there, by design.
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

__all__ = ["FIRE", "fire_bias", "fire_normalized_distance"]

#: Added to the normaliser ``psi(max(L, i))`` (the authors' ``eps``).
EPS = 1e-6


def fire_normalized_distance(q_pos: ArrayLike, kv_pos: ArrayLike, c: ArrayLike,
                             threshold: ArrayLike, eps: float = EPS) -> jax.Array:
    """``log(|c (i - j)| + 1) / (log(|c max(threshold, i)| + 1) + eps)``, float32.

    ``q_pos`` (``i``) and ``kv_pos`` (``j``) are integer arrays that broadcast against
    each other (e.g. ``[tq, 1]`` and ``[1, tk]``); ``c`` and ``threshold`` are float
    scalars (``threshold`` is ``L``). Returns the broadcast shape. The distance is formed
    in int32 and then converted, so it is exact below 2**24.
    """
    i = jnp.asarray(q_pos, jnp.int32)
    rel = (i - jnp.asarray(kv_pos, jnp.int32)).astype(jnp.float32)
    c = jnp.asarray(c, jnp.float32)
    num = jnp.log1p(jnp.abs(c * rel))
    den = jnp.log1p(jnp.abs(c * jnp.maximum(i.astype(jnp.float32), threshold)))
    return num / (den + jnp.float32(eps))


def _check_mlp(w1, b1, w2, b2) -> int:
    """Shapes and dtypes of the MLP; returns ``mlp_width``."""
    for name, p, rank, what in (("w1", w1, 1, "[mlp_width] (the 1 -> mlp_width layer)"),
                                ("b1", b1, 1, "[mlp_width]"),
                                ("w2", w2, 2, "[mlp_width, num_heads]"),
                                ("b2", b2, 1, "[num_heads]")):
        _checks.check_rank(name, p, (rank,), what)
        _checks.check_floating(name, p)
    width, heads = _checks.shape_of(w2)
    if _checks.shape_of(w1) != (width,) or _checks.shape_of(b1) != (width,):
        raise ValueError(f"w1 and b1 must have shape [mlp_width] = [{width}] to match w2 "
                         f"{_checks.shape_of(w2)}; got {_checks.shape_of(w1)} and "
                         f"{_checks.shape_of(b1)}.")
    if _checks.shape_of(b2) != (heads,):
        raise ValueError(f"b2 must have shape [num_heads] = [{heads}] to match w2 "
                         f"{_checks.shape_of(w2)}; got {_checks.shape_of(b2)}.")
    return width


def _option(options: dict, name: str, default):
    """``options[name]``, or ``default`` when it is missing or None."""
    value = options.get(name)
    return default if value is None else value


def _check_scalar(name: str, x, *, positive: bool) -> None:
    if _checks.shape_of(x) != ():
        raise ValueError(f"{name} must be a scalar; got shape {_checks.shape_of(x)}.")
    if isinstance(x, (bool, str, bytes)) or not jnp.issubdtype(_checks.dtype_of(x), jnp.number):
        raise TypeError(f"{name} must be a real number; got {type(x).__name__} {x!r}.")
    if _checks.is_concrete(x):
        v = float(np.asarray(x))
        if not np.isfinite(v) or (positive and v <= 0):
            raise ValueError(f"{name} must be a finite number" + (" > 0" if positive else "")
                             + f"; got {v}.")


def fire_bias(q_positions: ArrayLike, kv_positions: ArrayLike, w1: ArrayLike, b1: ArrayLike,
              w2: ArrayLike, b2: ArrayLike, *, c: ArrayLike, L: ArrayLike,
              eps: float = EPS) -> jax.Array:
    """The FIRE bias ``MLP(psi(i - j) / psi(max(L, i)))`` per head (Li et al. 2023, §3).

    ``i`` is the query position, ``j`` the key position, ``psi(x) = log(|c x| + 1)``,
    ``MLP(x) = relu(x * w1 + b1) @ w2 + b2``.

    Args:
      q_positions: integer ``[Tq]`` or ``[B, Tq]``.
      kv_positions: integer ``[Tk]`` or ``[B, Tk]``.
      w1, b1: float ``[mlp_width]``; w2: float ``[mlp_width, N]``; b2: float ``[N]``.
      c: float scalar, the log transform's scale (its magnitude is used).
      L: float scalar > 0, the threshold of the normaliser (positions; a learned value
        in the paper, ``|L_multiplier * init_L|`` in :class:`FIRE`).
      eps: added to the normaliser.

    Returns:
      float32 ``[N, Tq, Tk]``, or ``[B, N, Tq, Tk]`` if either position array has a
      batch axis.

    Raises:
      TypeError: float positions; integer MLP weights; non-numeric ``c``/``L``.
      ValueError: bad ranks or MLP shapes; batch sizes that differ; ``c`` or ``L`` not
        scalars, a concrete non-finite ``c``, a concrete ``L <= 0``.
    """
    _checks.check_integer_positions("q_positions", q_positions)
    _checks.check_integer_positions("kv_positions", kv_positions)
    _checks.check_rank("q_positions", q_positions, (1, 2), "[Tq] or [B, Tq]")
    _checks.check_rank("kv_positions", kv_positions, (1, 2), "[Tk] or [B, Tk]")
    _check_mlp(w1, b1, w2, b2)
    _check_scalar("c", c, positive=False)
    _check_scalar("L", L, positive=True)
    relative_offsets(q_positions, kv_positions)  # batch sizes
    q = jnp.asarray(q_positions, jnp.int32)[..., :, None]
    k = jnp.asarray(kv_positions, jnp.int32)[..., None, :]
    x = fire_normalized_distance(q, k, c, jnp.asarray(L, jnp.float32), eps)  # [..., Tq, Tk]
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    hidden = jax.nn.relu(x[..., None] * f32(w1) + f32(b1))  # [..., Tq, Tk, W]
    out = jnp.einsum("...w,wn->...n", hidden, f32(w2),
                     precision=jax.lax.Precision.HIGHEST) + f32(b2)
    return jnp.moveaxis(out, -1, -3)


@register("fire")
class FIRE(PositionScheme):
    """FIRE (Li et al. 2023) as a score_mod scheme, with all its parameters learnable.

    Args:
      w1, b1: float ``[mlp_width]`` (first layer, 1 -> mlp_width); w2: float
        ``[mlp_width, N]``; b2: float ``[N]``.
      c: float scalar (initial 0.1 in the paper); ``L_multiplier``: float scalar
        (initial 1.0). Both are children (traced, differentiable); their magnitudes are
        used (module docstring).
      init_L: the fixed threshold scale (static; the threshold is
        ``|L_multiplier * init_L|``, in positions).
      eps: added to the normaliser.

    Build random parameters with :meth:`init`. Use ``causal=True``, as the paper does.

    Raises:
      TypeError / ValueError: as :func:`fire_bias` for the MLP and ``c``;
        ``L_multiplier`` not a finite scalar; ``init_L`` or ``eps`` not a finite number > 0.
    """

    # fields, set once in __init__ (the pytree's children and static data)
    w1: jax.Array
    b1: jax.Array
    w2: jax.Array
    b2: jax.Array
    c: jax.Array
    L_multiplier: jax.Array
    init_L: float
    eps: float

    _children = ("w1", "b1", "w2", "b2", "c", "L_multiplier")
    _static = ("init_L", "eps")

    def __init__(self, w1: ArrayLike, b1: ArrayLike, w2: ArrayLike, b2: ArrayLike, *,
                 c: ArrayLike = 0.1, L_multiplier: ArrayLike = 1.0, init_L: float = 512.0,
                 eps: float = EPS):
        _check_mlp(w1, b1, w2, b2)
        _check_scalar("c", c, positive=False)
        _check_scalar("L_multiplier", L_multiplier, positive=False)
        init_L = _checks.check_positive_float("init_L", init_L)
        eps = _checks.check_positive_float("eps", eps)
        f32 = lambda a: jnp.asarray(a, jnp.float32)
        self._set(w1=f32(w1), b1=f32(b1), w2=f32(w2), b2=f32(b2), c=f32(c),
                  L_multiplier=f32(L_multiplier), init_L=init_L, eps=eps)

    @classmethod
    def init(cls, num_heads: int, *, key: jax.Array, mlp_width: int = 32, init_c: float = 0.1,
             init_L: float = 512.0, eps: float = EPS) -> FIRE:
        """Random MLP weights with PyTorch's ``nn.Linear`` default (the authors' code
        builds the MLP from ``nn.Linear``): weights and biases ``~ U(-1/sqrt(fan_in),
        1/sqrt(fan_in))``; ``c = init_c``, ``L_multiplier = 1``.

        Args:
          num_heads: N. key: a :func:`jax.random.key`. mlp_width: hidden units (32).
          init_c, init_L, eps: as the constructor.
        """
        n = _checks.check_positive_int("num_heads", num_heads)
        w = _checks.check_positive_int("mlp_width", mlp_width)
        k1, k2, k3, k4 = jax.random.split(key, 4)
        u = lambda k, shape, bound: jax.random.uniform(k, shape, jnp.float32, -bound, bound)
        b = 1.0 / np.sqrt(w)
        return cls(u(k1, (w,), 1.0), u(k2, (w,), 1.0), u(k3, (w, n), b), u(k4, (n,), b),
                   c=init_c, L_multiplier=1.0, init_L=init_L, eps=eps)

    # ---- for the Flax modules: one FIRE for the stack (as T5's table), options
    # ``mlp_width``, ``init_c``, ``init_L``, ``eps``.
    #: Logical axis names of the parameters (:mod:`jaxpos.sharding`).
    param_axes = {"w1": ("rank",), "b1": ("rank",), "w2": ("rank", "heads"), "b2": ("heads",),
                  "c": (), "L_multiplier": ()}

    @classmethod
    def init_params(cls, key: jax.Array, *, num_heads: int, options: dict,
                    param_dtype: Any = jnp.float32, **_: Any) -> dict:
        """:meth:`init`'s arrays, ``{"w1", "b1", "w2", "b2", "c", "L_multiplier"}``."""
        s = cls.init(num_heads, key=key, mlp_width=_option(options, "mlp_width", 32),
                     init_c=_option(options, "init_c", 0.1),
                     init_L=_option(options, "init_L", 512.0), eps=_option(options, "eps", EPS))
        return {n: getattr(s, n).astype(param_dtype) for n in cls._children}

    @classmethod
    def from_params(cls, params: dict, *, options: dict, **_: Any) -> PositionScheme:
        return cls(params["w1"], params["b1"], params["w2"], params["b2"], c=params["c"],
                   L_multiplier=params["L_multiplier"],
                   init_L=_option(options, "init_L", 512.0), eps=_option(options, "eps", EPS))

    @property
    def threshold(self) -> jax.Array:
        """``L = |L_multiplier * init_L|``, float32 scalar (positions)."""
        return jnp.abs(self.L_multiplier * jnp.float32(self.init_L))

    def check(self, num_heads: int, head_dim: int) -> None:
        n = _checks.shape_of(self.w2)[1]
        if n != num_heads:
            raise ValueError(f"FIRE's MLP has {n} outputs (w2 {_checks.shape_of(self.w2)}, b2 "
                             f"{_checks.shape_of(self.b2)}); the call has {num_heads} query "
                             f"heads. Build it with num_heads={num_heads}.")

    @property
    def score_heads(self) -> int:
        """Heads of the score term: one output of the MLP each."""
        return _checks.shape_of(self.w2)[1]

    def score_mod(self) -> Callable[..., jax.Array] | None:
        """``score + MLP(normalised distance)[head]`` on the tile.

        The hidden layer is a ``[tq, tk, mlp_width]`` intermediate reduced with a sum (no
        matrix product, so it traces inside a kernel as elementwise ops and one
        reduction). Unrolling the units one at a time instead compiled 5x slower on CPU
        (24 s vs 5 s for a chunked forward+backward) for no gain.
        """
        w1, b1, w2, b2, c = self.w1, self.b1, self.w2, self.b2, self.c
        threshold, eps = self.threshold, self.eps

        def fire(score, batch, head, q_pos, kv_pos):
            x = fire_normalized_distance(q_pos, kv_pos, c, threshold, eps)
            hidden = jax.nn.relu(x[..., None] * w1 + b1)  # [tq, tk, mlp_width]
            return score + (jnp.sum(hidden * w2[:, head], axis=-1) + b2[head])

        return fire
