"""ALiBi: attention with linear biases (Press, Smith & Lewis 2022, "Train Short, Test
Long", §3).

No positional vector enters the network; each head ``h`` adds ``-m_h * (q_pos - kv_pos)``
to the attention score of a key at or before the query. The slopes ``m_h`` form a
geometric sequence fixed before training.
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

__all__ = ["ALiBi", "alibi_bias", "alibi_score_mod", "alibi_slopes"]


def _power_of_two_slopes(n: int) -> list[float]:
    start = 2.0 ** (-8.0 / n)
    return [start ** (i + 1) for i in range(n)]


def alibi_slopes(num_heads: int) -> jax.Array:
    """Head slopes of Press et al. 2022, §3 (and their reference code's rule for any n).

    For ``n`` a power of two: ``2**(-8/n), 2**(-16/n), ..., 2**(-8)`` (8 heads:
    1/2, 1/4, ..., 1/256). Otherwise: the slopes of the closest smaller power of
    two ``p``, followed by every other slope of ``2p`` (its odd-numbered ones
    ``2**(-4/p)``, ``2**(-12/p)``, ...) until there are ``n``.

    Args:
      num_heads: a positive Python int.

    Returns:
      float32 ``[num_heads]``.

    Raises:
      ValueError: ``num_heads <= 0``. TypeError: ``num_heads`` not a Python int.

    References:
      Press, Smith & Lewis 2022, §3 and footnote on head counts; the rule matches
      ``get_slopes`` in their released code (github.com/ofirpress/attention_with_linear_biases).
    """
    n = _checks.check_positive_int("num_heads", num_heads)
    if n & (n - 1) == 0:
        slopes = _power_of_two_slopes(n)
    else:
        p = 1 << (n.bit_length() - 1)  # closest smaller power of two, exact
        slopes = _power_of_two_slopes(p) + _power_of_two_slopes(2 * p)[0::2][: n - p]
    return jnp.asarray(np.array(slopes, np.float64), jnp.float32)


def alibi_bias(q_positions: ArrayLike, kv_positions: ArrayLike, slopes: ArrayLike, *,
               bidirectional: bool = False) -> jax.Array:
    """The ALiBi score bias for every (query, key) pair (Press et al. 2022, §3, Fig. 3).

    ``bidirectional=False`` (causal, the paper): ``slopes[h] * (kv_pos - q_pos)``,
    which is ``-m * (i - j)`` for the visible keys ``j <= i``. Keys after the
    query get a positive bias; they are hidden by the causal mask. (BLOOM adds
    ``m * kv_pos`` instead; it differs by a per-row constant, so the softmax is the
    same.) ``bidirectional=True``: ``-slopes[h] * |kv_pos - q_pos|`` (encoders).

    Args:
      q_positions: integer ``[Tq]`` or ``[B, Tq]``.
      kv_positions: integer ``[Tk]`` or ``[B, Tk]``.
      slopes: float ``[N]``.

    Returns:
      float32 ``[N, Tq, Tk]``, or ``[B, N, Tq, Tk]`` if either position array has a
      batch axis. Offsets are formed in int32, so they are exact.

    Raises:
      TypeError: float positions. ValueError: ranks other than 1 or 2, ``slopes`` not
        rank 1, or batch sizes that differ.
    """
    _checks.check_integer_positions("q_positions", q_positions)
    _checks.check_integer_positions("kv_positions", kv_positions)
    _checks.check_rank("q_positions", q_positions, (1, 2), "[Tq] or [B, Tq]")
    _checks.check_rank("kv_positions", kv_positions, (1, 2), "[Tk] or [B, Tk]")
    _checks.check_rank("slopes", slopes, (1,), "[num_heads]")
    rel = relative_offsets(q_positions, kv_positions)  # [..., Tq, Tk]
    return alibi_bias_from_offsets(rel, slopes, bidirectional=bidirectional)


def alibi_bias_from_offsets(rel: jax.Array, slopes: ArrayLike, *,
                            bidirectional: bool = False) -> jax.Array:
    """ALiBi bias from int offsets (Press et al. 2022, §3), the form the attention paths use.

    Args:
      rel: integer ``kv_pos - q_pos``, ``[..., Tq, Tk]``.
      slopes: float ``[N]`` (already validated).
      bidirectional: ``-slopes * |rel|`` instead of ``slopes * rel``.

    Returns:
      float32 ``[..., N, Tq, Tk]``.
    """
    r = rel.astype(jnp.float32)
    if bidirectional:
        r = -jnp.abs(r)
    m = jnp.asarray(slopes, jnp.float32)
    return m[:, None, None] * r[..., None, :, :]


def alibi_score_mod(slopes: ArrayLike, *,
                    bidirectional: bool = False) -> Callable[..., jax.Array]:
    """``score + slopes[head] * (kv_pos - q_pos)`` (``- slopes[head] * |kv_pos - q_pos|``
    when ``bidirectional``): ALiBi, Press et al. 2022 §3, as a score_mod. ``slopes``:
    float ``[N]``, captured (differentiable).

    Raises:
      ValueError / TypeError: ``slopes`` not a rank-1 float array.
    """
    _checks.check_rank("alibi_slopes", slopes, (1,), "[num_heads]")
    _checks.check_floating("alibi_slopes", slopes)
    slopes = jnp.asarray(slopes, jnp.float32)

    def alibi(score, batch, head, q_pos, kv_pos):
        rel = (kv_pos - q_pos).astype(jnp.float32)
        return score + slopes[head] * (-jnp.abs(rel) if bidirectional else rel)

    return alibi


@register("alibi")
class ALiBi(PositionScheme):
    """ALiBi (Press et al. 2022, §3): ``slopes[h] * (kv_pos - q_pos)`` added to the scores
    (``-slopes[h] * |kv_pos - q_pos|`` when ``bidirectional``).

    Args:
      num_heads: compute the paper's slopes with :func:`jaxpos.alibi_slopes`; or
      slopes: float ``[N]`` (may be a learnable parameter).
    """

    # fields, set once in __init__ (the pytree's children and static data)
    slopes: jax.Array
    bidirectional: bool

    _children = ("slopes",)
    _static = ("bidirectional",)

    def __init__(self, num_heads: int | None = None, *, slopes: ArrayLike | None = None,
                 bidirectional: bool = False):
        if slopes is None:
            if num_heads is None:
                raise ValueError("ALiBi needs num_heads or slopes; got neither.")
            slopes = alibi_slopes(num_heads)
        _checks.check_rank("slopes", slopes, (1,), "[num_heads]")
        self._set(slopes=jnp.asarray(slopes, jnp.float32), bidirectional=bool(bidirectional))

    @classmethod
    def from_params(cls, params: dict, *, num_heads: int, causal: bool, **_: Any) -> PositionScheme:
        """The paper's fixed slopes; bidirectional (``-m |kv - q|``) unless causal."""
        return cls(num_heads, bidirectional=not causal)

    def check(self, num_heads: int, head_dim: int) -> None:
        if _checks.shape_of(self.slopes)[0] != num_heads:
            raise ValueError(f"ALiBi slopes must have shape [{num_heads}] (one per query head); "
                             f"got {_checks.shape_of(self.slopes)}.")

    @property
    def score_heads(self) -> int:
        """Heads of the score term: one slope each."""
        return _checks.shape_of(self.slopes)[0]

    def score_mod(self) -> Callable[..., jax.Array] | None:
        """``score + slopes[head] * (kv_pos - q_pos)`` (``- slopes[head] * |kv_pos - q_pos|``
        when bidirectional), computed in float32 from the positions of each tile."""
        return alibi_score_mod(self.slopes, bidirectional=self.bidirectional)
