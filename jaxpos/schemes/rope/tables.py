"""RoPE as cos/sin tables applied where q and k are loaded (Su et al. 2024, §3.4).

Usually the scheme rotates q and k once per token before attention
(:meth:`jaxpos.RoPE.transform_qk`). Where a cached key's rotation changes between decode
steps (exact dynamic NTK: every key rotated with the current length's base; a
StreamingLLM cache: keys at their slot positions), rotating the whole cache per step is a
pass over it. Passing unrotated q and k plus :class:`RopeTables` to
``jaxpos.attention(..., rope_tables=...)`` lets the engines rotate as they load: the
Pallas kernel rotates the query tile once per program and each key tile as it is loaded
(forward and backward), the chunked decode path each key block it visits; no engine
computes a sine or cosine, the tables are computed once per call.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos.schemes.rope.angles import cos_sin, rope_angles, rotate

__all__ = ["RopeTables", "check_rope_tables", "rope_tables", "rotate_with_tables"]


class RopeTables(NamedTuple):
    """cos/sin tables of the query and key positions, ``"half"`` layout (feature
    ``i < half`` pairs with ``i + half``; features past ``2 * half`` pass through).

    ``q_cos``, ``q_sin``: float32 ``[B|1, Tq, half]``; ``k_cos``, ``k_sin``: float32
    ``[B|1, Tk, half]``. An attention factor (YaRN / LongRoPE) is already multiplied in.
    The tables are not differentiated."""

    q_cos: Any
    q_sin: Any
    k_cos: Any
    k_sin: Any


def rope_tables(q_positions: ArrayLike, kv_positions: ArrayLike, inv_freq: ArrayLike, *,
                attention_factor: ArrayLike = 1.0, k_inv_freq: ArrayLike | None = None,
                 angle_precision: str = "high") -> RopeTables:
    """The :class:`RopeTables` of query and key positions.

    Args:
      q_positions, kv_positions: integer ``[T]`` or ``[B|1, T]`` (for a StreamingLLM
        cache: the slots).
      inv_freq: float ``[half]`` radians per position for the queries (and the keys when
        ``k_inv_freq`` is None; exact dynamic NTK passes the current length's).
      attention_factor: multiplies cos and sin (YaRN / LongRoPE).
      k_inv_freq: float ``[half]`` for the keys, or None.
      angle_precision: as :func:`jaxpos.schemes.rope.rope_angles`.

    Returns:
      :class:`RopeTables`, float32 ``[B|1, T, half]``.

    Raises:
      ValueError / TypeError: float positions, frequencies not rank 1 or of two lengths.
    """
    _checks.check_rank("inv_freq", inv_freq, (1,), "[half]")
    k_inv_freq = inv_freq if k_inv_freq is None else k_inv_freq
    _checks.check_rank("k_inv_freq", k_inv_freq, (1,), "[half]")
    if _checks.shape_of(k_inv_freq) != _checks.shape_of(inv_freq):
        raise ValueError(f"k_inv_freq must have inv_freq's shape {_checks.shape_of(inv_freq)}; "
                         f"got {_checks.shape_of(k_inv_freq)}.")
    af = jnp.float32(attention_factor)

    def tab(pos, f, name):
        _checks.check_integer_positions(name, pos)
        p = jnp.asarray(pos, jnp.int32)
        p = p[None] if p.ndim == 1 else p
        ang = rope_angles(p, jnp.asarray(f, jnp.float32), angle_precision=angle_precision)
        cos, sin = cos_sin(ang)  # once per token (see cos_sin)
        return cos * af, sin * af

    qc, qs = tab(q_positions, inv_freq, "q_positions")
    kc, ks = tab(kv_positions, k_inv_freq, "kv_positions")
    return RopeTables(qc, qs, kc, ks)


def check_rope_tables(tabs: Any, B: int, Tq: int, Tk: int, H: int) -> tuple[RopeTables, int]:
    """Validate ``tabs`` for q ``[B, Tq, N, H]`` and k ``[B, Tk, N_kv, H]``: float32
    :class:`RopeTables` and ``half``.

    Raises:
      TypeError: not four tables, or not float. ValueError: shapes that do not match.
    """
    if not isinstance(tabs, (tuple, list)) or len(tabs) != 4:
        raise TypeError(f"rope_tables must be RopeTables(q_cos, q_sin, k_cos, k_sin) (see "
                        f"jaxpos.schemes.rope.tables.rope_tables); got {type(tabs).__name__}.")
    out, halves = [], []
    for name, x, T in zip(RopeTables._fields, tabs, (Tq, Tq, Tk, Tk)):
        _checks.check_rank(f"rope_tables.{name}", x, (3,), "[B|1, T, half]")
        _checks.check_floating(f"rope_tables.{name}", x)
        shp = _checks.shape_of(x)
        if shp[0] not in (1, B) or shp[1] != T or not 0 < 2 * shp[2] <= H:
            raise ValueError(f"rope_tables.{name} must have shape [1 or {B}, {T}, half] with "
                             f"0 < 2 * half <= head_dim={H}; got {shp}.")
        halves.append(shp[2])
        out.append(jnp.asarray(x, jnp.float32))
    if len(set(halves)) != 1:
        raise ValueError(f"rope_tables: the four tables need one half width; got {halves}.")
    if out[0].shape != out[1].shape or out[2].shape != out[3].shape:
        raise ValueError("rope_tables: each cos table and its sin table must have one shape.")
    return RopeTables(*out), halves[0]


def rotate_with_tables(q: jax.Array, k: jax.Array,
                       tabs: RopeTables) -> tuple[jax.Array, jax.Array]:
    """q and k rotated by the tables before attention (the engines that do not rotate on
    load), in their dtypes."""
    return (rotate(q, tabs.q_cos, tabs.q_sin, layout="half"),
            rotate(k, tabs.k_cos, tabs.k_sin, layout="half"))
