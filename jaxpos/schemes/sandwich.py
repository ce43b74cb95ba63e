"""Sandwich (Chi, Fan, Rudnicky & Ramadge 2023, "Dissecting Transformer Length
Extrapolation via the Lens of Receptive Field Analysis", ACL, the section that defines
Sandwich).

Sandwich keeps only the position-position term of the sinusoidal transformer's score
``(W_q (e_m + p_m))^T (W_k (e_n + p_n))``: the inner product of the sinusoidal vectors
of dimension ``d_bar`` of the query position ``m`` and the key position ``n``,

    p_m . p_n = sum_{i=1}^{d_bar/2} cos((m - n) / base^(2i / d_bar)),   base = 10000,

added to the score as a bias with no parameters. Like ALiBi (Press et al. 2022) it is
compressed per head: head ``h = 1..H`` divides it by ``8h / H`` (the paper borrows
ALiBi's per-head ratio). This module also subtracts ``d_bar / 2``, the value at
``m = n``, so the bias is 0 on the diagonal and negative elsewhere, as NVIDIA NeMo's
Sandwich does; a per-head constant, it changes no attention weight. Implementations
differ in where ``i`` starts (attention-gym's ``generate_sandwich_bias`` sums
``i = 0..d_bar/2 - 1``); this module follows the paper's ``i = 1..d_bar/2``.

So the bias of head ``h`` (0-based index ``h``) is::

    head_scales[h] * (sum_{i=1}^{d_bar/2} cos((m - n) * inv_freq[i]) - d_bar / 2),
    head_scales[h] = H / (8 (h + 1)),   inv_freq[i] = base ** (-2i / d_bar).

It depends on ``m - n`` only (translation invariant) and is even in ``m - n``.

Cost: ``d_bar / 2`` cosines per score (64 for the paper's ``d_bar = 128``), computed on
every tile: exact at any distance, but many times the work of ALiBi's one multiply.
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

__all__ = ["Sandwich", "sandwich_bias", "sandwich_head_scales", "sandwich_inv_freq"]


def sandwich_inv_freq(d_bar: int = 128, base: float = 10000.0) -> jax.Array:
    """``base ** (-2i / d_bar)`` for ``i = 1..d_bar/2``: float32 ``[d_bar // 2]``.

    Raises:
      TypeError: ``d_bar`` not an int; ``base`` not a number.
      ValueError: ``d_bar`` not a positive even number; ``base`` not finite and > 0.
    """
    return jnp.asarray(_inv_freq(d_bar, base))


def _inv_freq(d_bar: int, base: float) -> np.ndarray:
    """:func:`sandwich_inv_freq` as NumPy float32 (static constants for the tiles)."""
    d = _checks.check_positive_int("d_bar", d_bar)
    if d % 2:
        raise ValueError(f"d_bar must be even (sin/cos pairs of the sinusoidal vectors); "
                         f"got {d}.")
    b = _checks.check_positive_float("base", base)
    i = np.arange(1, d // 2 + 1, dtype=np.float64)
    return (b ** (-2.0 * i / d)).astype(np.float32)


def sandwich_head_scales(num_heads: int) -> jax.Array:
    """The per-head factor ``H / (8 h)``, ``h = 1..H`` (ALiBi's compression ratio
    ``8h/H`` inverted): float32 ``[num_heads]``.

    Raises:
      TypeError / ValueError: ``num_heads`` not a positive int.
    """
    n = _checks.check_positive_int("num_heads", num_heads)
    return jnp.asarray(n / (8.0 * np.arange(1, n + 1, dtype=np.float64)), jnp.float32)


def _cos_sum(rel, inv_freq: np.ndarray):
    """``sum_i cos(rel * inv_freq[i]) - len(inv_freq)`` for float32 ``rel`` (any shape),
    through a ``[..., d_bar/2]`` intermediate reduced with a sum: on CPU 5-10x faster to
    run than one elementwise pass per frequency, and faster to compile."""
    w = jnp.asarray(inv_freq, jnp.float32)
    return jnp.sum(jnp.cos(rel[..., None] * w), axis=-1) - jnp.float32(len(inv_freq))


def _check_head_scales(head_scales) -> None:
    _checks.check_rank("head_scales", head_scales, (1,), "[num_heads]")
    _checks.check_floating("head_scales", head_scales)


def sandwich_bias(q_positions: ArrayLike, kv_positions: ArrayLike, head_scales: ArrayLike, *,
                  d_bar: int = 128, base: float = 10000.0) -> jax.Array:
    """The Sandwich bias for every (query, key) pair and head (Chi et al. 2023).

    ``head_scales[h] * (sum_{i=1}^{d_bar/2} cos((kv_pos - q_pos) base^(-2i/d_bar)) -
    d_bar/2)``.

    Args:
      q_positions: integer ``[Tq]`` or ``[B, Tq]``.
      kv_positions: integer ``[Tk]`` or ``[B, Tk]``.
      head_scales: float ``[N]``, e.g. :func:`sandwich_head_scales`.
      d_bar: the dimension of the sinusoidal vectors (even; the paper's 128).
      base: the sinusoid's 10000.

    Returns:
      float32 ``[N, Tq, Tk]``, or ``[B, N, Tq, Tk]`` if either position array has a
      batch axis. The offset is formed in int32 and converted to float32 (exact below
      2**24); each cosine's argument then carries float32 rounding (about ``|m - n| *
      6e-8`` rad).

    Raises:
      TypeError: float positions; integer ``head_scales``; ``d_bar`` not an int.
      ValueError: bad ranks; batch sizes that differ; ``d_bar`` odd or not positive;
        ``base`` not finite and > 0.
    """
    _checks.check_integer_positions("q_positions", q_positions)
    _checks.check_integer_positions("kv_positions", kv_positions)
    _checks.check_rank("q_positions", q_positions, (1, 2), "[Tq] or [B, Tq]")
    _checks.check_rank("kv_positions", kv_positions, (1, 2), "[Tk] or [B, Tk]")
    _check_head_scales(head_scales)
    inv_freq = _inv_freq(d_bar, base)
    rel = relative_offsets(q_positions, kv_positions).astype(jnp.float32)
    s = jnp.asarray(head_scales, jnp.float32)
    return s[:, None, None] * _cos_sum(rel, inv_freq)[..., None, :, :]


@register("sandwich")
class Sandwich(PositionScheme):
    """Sandwich (Chi et al. 2023) as a score_mod scheme. No learned parameters.

    Args:
      num_heads: compute the paper's per-head factors :func:`sandwich_head_scales`; or
      head_scales: float ``[N]`` (a child: may be made learnable).
      d_bar: the sinusoidal dimension (static, even; 128 in the paper).
      base: the sinusoid's 10000 (static).

    Use ``causal=True`` for a decoder, as in the paper; the bias itself is symmetric.

    Raises:
      ValueError: neither ``num_heads`` nor ``head_scales``; bad ``d_bar``/``base``.
      TypeError: integer ``head_scales``.
    """

    # fields, set once in __init__ (the pytree's children and static data)
    head_scales: jax.Array
    d_bar: int
    base: float

    _children = ("head_scales",)
    _static = ("d_bar", "base")

    def __init__(self, num_heads: int | None = None, *, head_scales: ArrayLike | None = None,
                 d_bar: int = 128, base: float = 10000.0):
        if head_scales is None:
            if num_heads is None:
                raise ValueError("Sandwich needs num_heads or head_scales; got neither.")
            head_scales = sandwich_head_scales(num_heads)
        _check_head_scales(head_scales)
        _inv_freq(d_bar, base)  # validates d_bar and base
        self._set(head_scales=jnp.asarray(head_scales, jnp.float32), d_bar=int(d_bar),
                  base=float(base))

    @classmethod
    def from_params(cls, params: dict, *, num_heads: int, options: dict,
                    **_: Any) -> PositionScheme:
        """For the Flax modules (no parameters): options ``d_bar`` (128) and ``base``
        (10000)."""
        d_bar, base = options.get("d_bar"), options.get("base")
        return cls(num_heads, d_bar=128 if d_bar is None else d_bar,
                   base=10000.0 if base is None else base)

    def check(self, num_heads: int, head_dim: int) -> None:
        if _checks.shape_of(self.head_scales)[0] != num_heads:
            raise ValueError(f"Sandwich head_scales must have shape [{num_heads}] (one per "
                             f"query head); got {_checks.shape_of(self.head_scales)}.")

    @property
    def score_heads(self) -> int:
        """Heads of the score term: one scale each."""
        return _checks.shape_of(self.head_scales)[0]

    def score_mod(self) -> Callable[..., jax.Array] | None:
        """``score + head_scales[head] * (sum_i cos((kv_pos - q_pos) inv_freq[i]) -
        d_bar/2)``, computed on the tile."""
        scales, inv_freq = self.head_scales, _inv_freq(self.d_bar, self.base)

        def sandwich(score, batch, head, q_pos, kv_pos):
            rel = (kv_pos - q_pos).astype(jnp.float32)
            return score + scales[head] * _cos_sum(rel, inv_freq)

        return sandwich
