"""Relative position representations of Shaw, Uszkoreit & Vaswani 2018 ("Self-Attention
with Relative Position Representations", §3).

For the clipped offset ``r = clip(n - m, -K, K)`` between key ``n`` and query ``m``,
two learned tables of ``2K + 1`` vectors of head width, ``a_K`` and ``a_V``, enter
attention as

    e_mn   = q_m . (k_n + a_K[r]) * scale
    z_m    = sum_n alpha_mn (v_n + a_V[r])

The efficient form (§3.3) never builds a ``[T, T, H]`` tensor: the queries are
multiplied with the ``2K + 1`` key vectors once (``[T, 2K+1]`` per head) and the scores
gathered from that; the value term sums the attention weights that fall in each
offset bucket (``[T, 2K+1]`` per head) and multiplies by the ``2K + 1`` value vectors.
Row ``r + K`` of a table is offset ``r``; offsets are clipped explicitly (JAX would wrap
a negative index).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos._checks import relative_offsets
from jaxpos.schemes.base import PositionScheme, register

__all__ = ["Shaw", "check_shaw_table", "shaw_clipped_index", "shaw_logits",
           "shaw_values"]


def check_shaw_table(name: str, table: ArrayLike, head_dim: int | None = None) -> int:
    """Validate a ``[2K + 1, H]`` Shaw table and return ``K`` (the clipping distance).

    Raises:
      ValueError: rank other than 2, an even number of rows, or a width other than
        ``head_dim`` (when given). TypeError: a non-floating table.
    """
    _checks.check_rank(name, table, (2,), "[2 * max_distance + 1, head_dim]")
    _checks.check_floating(name, table)
    rows, h = _checks.shape_of(table)
    if rows % 2 == 0:
        raise ValueError(
            f"{name} must have an odd number of rows 2K + 1 (offsets -K..K); got shape "
            f"{_checks.shape_of(table)}."
        )
    if head_dim is not None and h != head_dim:
        raise ValueError(
            f"{name} must have shape [2K + 1, {head_dim}]; got {_checks.shape_of(table)}."
        )
    return (rows - 1) // 2


def shaw_clipped_index(q_positions: ArrayLike, kv_positions: ArrayLike,
                       max_distance: int) -> jax.Array:
    """Row index ``clip(kv - q, -K, K) + K`` into a ``[2K + 1, H]`` table (Shaw et al. 2018, §3.2).

    Args:
      q_positions: integer ``[Tq]`` or ``[B|1, Tq]``.
      kv_positions: integer ``[Tk]`` or ``[B|1, Tk]``.
      max_distance: the clipping distance ``K`` (a Python int >= 0).

    Returns:
      int32 ``[Tq, Tk]`` or ``[B, Tq, Tk]`` in ``[0, 2K]``; the clip is explicit, so
      no gather ever relies on JAX's index clamping (or NumPy's negative wrap).

    Raises:
      TypeError: float positions, or ``max_distance`` not an int.
      ValueError: a negative ``max_distance``.
    """
    max_distance = _checks.check_nonneg_int("max_distance", max_distance)
    _checks.check_integer_positions("q_positions", q_positions)
    _checks.check_integer_positions("kv_positions", kv_positions)
    rel = relative_offsets(q_positions, kv_positions)
    return jnp.clip(rel, -max_distance, max_distance) + max_distance


def _check_shaw_operands(xname, x, idx, tname, table, width):
    _checks.check_rank(xname, x, (4,), "[B, N, Tq, H]" if xname == "q" else "[B, N, Tq, Tk]")
    _checks.check_rank("idx", idx, (3,), "[B|1, Tq, Tk] from shaw_clipped_index")
    _checks.check_rank(tname, table, (2,), "[2K + 1, H]")
    if width is not None and np.shape(table)[-1] != width:
        raise ValueError(f"{tname} must have q's head size {width} as its width; got "
                         f"{tname} {np.shape(table)}, q {np.shape(x)}.")


def shaw_logits(q: jax.Array, idx: jax.Array, rel_k: jax.Array) -> jax.Array:
    """Relative key term ``q_m . a_K[r]`` in the efficient form (Shaw et al. 2018, §3.3).

    Args:
      q: ``[B, N, Tq, H]`` (already scaled).
      idx: int ``[B|1, Tq, Tk]`` from :func:`shaw_clipped_index`.
      rel_k: ``[2K + 1, H]``.

    Returns:
      float32 ``[B, N, Tq, Tk]``.

    Raises:
      ValueError: wrong ranks, or ``rel_k``'s width not ``q``'s head size.
    """
    _check_shaw_operands("q", q, idx, "rel_k", rel_k, q.shape[-1] if np.ndim(q) == 4 else None)
    qa = jnp.einsum("bnqh,rh->bnqr", q.astype(jnp.float32), rel_k.astype(jnp.float32))
    B, N, Tq, _ = qa.shape
    ix = jnp.broadcast_to(idx[:, None], (B, N, Tq, idx.shape[-1]))
    return jnp.take_along_axis(qa, ix, axis=-1)


def shaw_values(p: jax.Array, idx: jax.Array, rel_v: jax.Array) -> jax.Array:
    """Relative value term ``sum_n p_mn a_V[r_mn]`` -> float32 ``[B, N, Tq, H]`` (§3.1, §3.3).

    ``p``: weights ``[B, N, Tq, Tk]`` (need not be normalised: the term is linear in p).
    The weights are summed per offset bucket (``[B, N, Tq, 2K+1]``) before touching
    the value vectors, so no ``[Tq, Tk, H]`` tensor is formed.

    Raises:
      ValueError: wrong ranks, or ``idx``'s key length not ``p``'s.
    """
    _check_shaw_operands("p", p, idx, "rel_v", rel_v, None)
    if np.shape(idx)[-1] != np.shape(p)[-1]:
        raise ValueError(f"idx must have p's key length {np.shape(p)[-1]} on its last axis; "
                         f"got idx {np.shape(idx)}, p {np.shape(p)}.")
    R = rel_v.shape[0]
    onehot = jax.nn.one_hot(idx, R, dtype=jnp.float32)  # [B|1, Tq, Tk, R]
    w = jnp.einsum("bnqk,bqkr->bnqr", p.astype(jnp.float32), onehot)
    return jnp.einsum("bnqr,rh->bnqh", w, rel_v.astype(jnp.float32))


@register("shaw")
class Shaw(PositionScheme):
    """Shaw et al. 2018 relative keys and values, clipping distance ``K``.

    Args:
      rel_k: ``[2K + 1, H]`` relative key vectors (row ``r + K`` is offset ``r``).
      rel_v: ``[2K + 1, H]`` relative value vectors, or ``None`` for keys only.
    """

    # fields, set once in __init__ (the pytree's children and static data)
    rel_k: jax.Array
    rel_v: jax.Array | None
    max_distance: int

    _children = ("rel_k", "rel_v")
    _static = ("max_distance",)

    def __init__(self, rel_k: ArrayLike, rel_v: ArrayLike | None = None):
        K = check_shaw_table("rel_k", rel_k)
        if rel_v is not None:
            _checks.check_floating("rel_v", rel_v)
        if rel_v is not None and _checks.shape_of(rel_v) != _checks.shape_of(rel_k):
            raise ValueError(f"rel_v must have rel_k's shape {_checks.shape_of(rel_k)}; got "
                             f"{_checks.shape_of(rel_v)}.")
        self._set(rel_k=rel_k, rel_v=rel_v, max_distance=K)

    @property
    def has_value_term(self) -> bool:
        return self.rel_v is not None

    params_per_layer = True  # Shaw et al. 2018, §3.1: shared across heads, not layers

    #: Logical axis names of the parameters (:mod:`jaxpos.sharding`).
    param_axes = {"rel_k": ("position_rows", "head_dim"), "rel_v": ("position_rows", "head_dim")}

    @classmethod
    def init_params(cls, key: jax.Array, *, head_dim: int, param_dtype: Any, options: dict,
                    **_: Any) -> dict:
        """``rel_k`` and ``rel_v`` ``[2K + 1, head_dim]``, Glorot uniform (tensor2tensor's
        default); ``K = options["max_distance"]`` (16 if unset); ``options["values"]``
        False learns the key table only."""
        K = options.get("max_distance")
        K = 16 if K is None else _checks.check_positive_int("max_distance", K)
        init = jax.nn.initializers.glorot_uniform()
        kk, kv = jax.random.split(key)
        params = {"rel_k": init(kk, (2 * K + 1, head_dim), param_dtype)}
        if options.get("values", True):
            params["rel_v"] = init(kv, (2 * K + 1, head_dim), param_dtype)
        return params

    @classmethod
    def from_params(cls, params: dict, **_: Any) -> PositionScheme:
        return cls(params["rel_k"], params.get("rel_v"))

    def check(self, num_heads: int, head_dim: int) -> None:
        check_shaw_table("rel_k", self.rel_k, head_dim)

    def content_bias(self, qs: jax.Array, q_positions: ArrayLike,
                     kv_positions: ArrayLike) -> jax.Array | None:
        idx = shaw_clipped_index(q_positions, kv_positions, self.max_distance)
        return shaw_logits(qs, idx, self.rel_k)

    def value_term(self, p: jax.Array, q_positions: ArrayLike,
                   kv_positions: ArrayLike) -> jax.Array | None:
        if self.rel_v is None:
            return None
        idx = shaw_clipped_index(q_positions, kv_positions, self.max_distance)
        return shaw_values(p, idx, self.rel_v)
