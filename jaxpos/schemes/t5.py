"""T5 relative position buckets (Raffel et al. 2020, "Exploring the Limits of Transfer
Learning with a Unified Text-to-Text Transformer", §2.1).

Each head adds one learned scalar to each attention logit, chosen by the bucket of
the offset ``kv_pos - q_pos`` (T5's ``memory_position - context_position``). Small
distances get a bucket each; larger ones share logarithmically wider buckets up to
``max_distance``, beyond which every offset shares the last bucket. One table of
``[num_buckets, num_heads]`` is shared by all layers of a stack, and T5 does not
scale the scores (``scale=1.0``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos._checks import relative_offsets
from jaxpos.mods import offset_score_mod
from jaxpos.schemes.base import PositionScheme, register

__all__ = ["T5Bias", "check_bucket_args", "t5_bias", "t5_bucket"]


def check_bucket_args(num_buckets: int, max_distance: int, bidirectional: bool) -> None:
    """Validate T5 bucket hyperparameters (Raffel et al. 2020, §2.1).

    Raises:
      TypeError: ``num_buckets`` or ``max_distance`` not a Python int; ``bidirectional``
        not a bool.
      ValueError: a non-positive value, an odd ``num_buckets`` when ``bidirectional``
        (half the buckets per direction), fewer than 2 buckets per direction, or
        ``max_distance`` not above the exact range ``num_buckets_per_direction // 2``
        (the logarithmic formula would divide by ``log(1) = 0``).
    """
    _checks.check_positive_int("num_buckets", num_buckets)
    _checks.check_positive_int("max_distance", max_distance)
    if not isinstance(bidirectional, (bool, np.bool_)):
        raise TypeError(f"bidirectional must be a bool; got {type(bidirectional).__name__} "
                        f"{bidirectional!r}.")
    if bidirectional and num_buckets % 2:
        raise ValueError(
            f"num_buckets must be even when bidirectional=True (half per direction); "
            f"got {num_buckets}."
        )
    per_dir = num_buckets // 2 if bidirectional else num_buckets
    if per_dir < 2:
        raise ValueError(
            f"num_buckets must give at least 2 buckets per direction; got num_buckets="
            f"{num_buckets} with bidirectional={bidirectional}."
        )
    if max_distance <= per_dir // 2:
        raise ValueError(
            f"max_distance must exceed the exact range num_buckets_per_direction // 2 = "
            f"{per_dir // 2}; got {max_distance}."
        )


def t5_bucket(rel: ArrayLike, bidirectional: bool = True, num_buckets: int = 32,
              max_distance: int = 128) -> np.ndarray | jax.Array:
    """T5's bucket of a relative offset ``rel = kv_pos - q_pos``.

    Bidirectional: ``num_buckets // 2`` buckets per direction, keys after the query in
    the upper half. Within a direction the first half of the buckets hold distances
    ``0 .. n/2 - 1`` exactly; then ``n/2 + floor(log(dist / (n/2)) / log(max_distance /
    (n/2)) * n/2)`` up to the last bucket. With the defaults that is 0..7 exact, then
    8-11, 12-15, 16-22, 23-31, 32-45, 46-63, 64-90, 91+ (Raffel et al. 2020, §2.1).
    Causal (``bidirectional=False``): keys after the query all fall in bucket 0, and all
    ``num_buckets`` cover keys at or before the query (16 exact, 16 logarithmic).

    The arithmetic is T5's (and Hugging Face's ``_relative_position_bucket``): the
    logarithm in float32, truncation toward zero.

    Args:
      rel: integer NumPy or JAX array (or Python int) of offsets, any shape.

    Returns:
      int32 array of ``rel``'s shape: NumPy in, NumPy out; JAX in, JAX out.

    Raises:
      ValueError: odd ``num_buckets`` when bidirectional, ``max_distance`` too small.
      TypeError: float ``rel``.
    """
    check_bucket_args(num_buckets, max_distance, bidirectional)
    _checks.check_integer_positions("rel", rel)
    _checks.check_int32_range("rel", rel)
    if isinstance(rel, jax.Array):
        return _bucket_jax(rel, bool(bidirectional), int(num_buckets), int(max_distance))
    return _bucket(np, rel, bidirectional, num_buckets, max_distance)


def _bucket(xp, rel, bidirectional, num_buckets, max_distance):
    """The bucket arithmetic on NumPy (``xp = np``) or jax.numpy (``xp = jnp``)."""
    rel = xp.asarray(rel).astype(xp.int32)
    ret = xp.zeros_like(rel)
    n = num_buckets
    if bidirectional:
        n //= 2
        ret = ret + (rel > 0).astype(xp.int32) * n
        dist = xp.abs(rel)
    else:
        dist = -xp.minimum(rel, 0)
    max_exact = n // 2
    is_small = dist < max_exact
    # float32 like T5 / HF; clamp the argument to >= 1 so log(0) is never formed.
    d32 = xp.maximum(dist, 1).astype(xp.float32)
    large = xp.log(d32 / np.float32(max_exact)) / np.float32(math.log(max_distance / max_exact))
    large = large * np.float32(n - max_exact)
    large = max_exact + large.astype(xp.int32)  # truncation toward zero, as T5
    large = xp.minimum(large, n - 1)
    return (ret + xp.where(is_small, dist, large)).astype(xp.int32)


# One compiled computation per shape and configuration, also when called eagerly.
_bucket_jax = jax.jit(functools.partial(_bucket, jnp), static_argnums=(1, 2, 3))


def t5_bias(
    q_positions: ArrayLike,
    kv_positions: ArrayLike,
    table: ArrayLike,
    *,
    bidirectional: bool = True,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> jax.Array:
    """The T5 bias ``table[bucket(kv_pos - q_pos), h]`` for every (query, key) pair.

    Raffel et al. 2020, §2.1: one learned scalar per bucket and head, added to the
    attention logits; the table is shared by all layers of a stack.

    Args:
      q_positions: integer ``[Tq]`` or ``[B, Tq]``.
      kv_positions: integer ``[Tk]`` or ``[B, Tk]``.
      table: float ``[num_buckets, N]`` (the T5 checkpoint layout).
      bidirectional, num_buckets, max_distance: as :func:`t5_bucket`.

    Returns:
      ``[N, Tq, Tk]`` (``[B, N, Tq, Tk]`` with batched positions), float32.

    Raises:
      ValueError: ``table`` not ``[num_buckets, N]``, bad bucket arguments, bad ranks.
      TypeError: float positions.
    """
    check_bucket_args(num_buckets, max_distance, bidirectional)
    check_t5_table(table, num_buckets)
    _checks.check_integer_positions("q_positions", q_positions)
    _checks.check_integer_positions("kv_positions", kv_positions)
    _checks.check_rank("q_positions", q_positions, (1, 2), "[Tq] or [B, Tq]")
    _checks.check_rank("kv_positions", kv_positions, (1, 2), "[Tk] or [B, Tk]")
    rel = relative_offsets(q_positions, kv_positions)
    return t5_bias_from_offsets(rel, table, bidirectional=bidirectional,
                                num_buckets=num_buckets, max_distance=max_distance)


def transposed_hint(shape: tuple[int, ...], *, num_buckets: int | None = None,
                    num_heads: int | None = None) -> str:
    """`` It looks transposed ...`` when a ``[N, num_buckets]`` table was passed where
    ``[num_buckets, N]`` is expected (judged from whichever size is known), else ''."""
    if len(shape) != 2 or shape[0] == shape[1]:
        return ""
    if (num_buckets is not None and shape[1] == num_buckets) or (
            num_heads is not None and shape[0] == num_heads):
        return (f" It looks transposed: the T5 checkpoint layout is [num_buckets, N]; got "
                f"[N, num_buckets] = {list(shape)}? Pass table.T.")
    return ""


def check_t5_table(table: ArrayLike, num_buckets: int) -> None:
    """Raise ``ValueError`` unless ``table`` is ``[num_buckets, num_heads]``."""
    _checks.check_rank("table", table, (2,), "[num_buckets, num_heads]")
    shape = _checks.shape_of(table)
    if shape[0] != num_buckets:
        raise ValueError(
            f"table must have shape [num_buckets, N] = [{num_buckets}, num_heads] "
            f"(num_buckets={num_buckets}); got shape {shape}."
            f"{transposed_hint(shape, num_buckets=num_buckets)}"
        )


@functools.partial(jax.jit, static_argnames=("bidirectional", "num_buckets", "max_distance"))
def t5_bias_from_offsets(rel: ArrayLike, table: ArrayLike, *, bidirectional: bool,
                         num_buckets: int, max_distance: int) -> jax.Array:
    """``table[bucket(rel), h]`` for int offsets ``rel`` ``[..., Tq, Tk]``.

    Args:
      rel: int32 ``kv_pos - q_pos``, ``[..., Tq, Tk]``.
      table: float ``[num_buckets, N]`` (already validated).
      bidirectional, num_buckets, max_distance: as :func:`t5_bucket` (static).

    Returns:
      float32 ``[..., N, Tq, Tk]``. The gather cannot clamp: every bucket lies in
      ``[0, num_buckets)`` by construction.
    """
    b = _bucket(jnp, rel, bidirectional, num_buckets, max_distance)
    # promise_in_bounds: the buckets are in range (above), and the default "fill" gather
    # is about 8x slower on CPU (5.1 ms vs 0.6 ms for a 256 x 256 tile of 8 heads).
    vals = jnp.asarray(table, jnp.float32).at[b].get(mode="promise_in_bounds")  # [..., Tq, Tk, N]
    return jnp.moveaxis(vals, -1, -3)


@register("t5")
class T5Bias(PositionScheme):
    """T5 bucketed relative bias (Raffel et al. 2020, §2.1): ``table[bucket(kv - q), h]``.

    Args:
      table: float ``[num_buckets, N]`` (T5 checkpoint layout), shared by a stack.
      bidirectional: True in the encoder, False in the (causal) decoder.
      num_buckets, max_distance: T5's 32 and 128 by default.

    Use ``scale=1.0`` in :func:`jaxpos.attention` to match T5, which does not scale.
    """

    # fields, set once in __init__ (the pytree's children and static data)
    table: jax.Array
    bidirectional: bool
    num_buckets: int
    max_distance: int

    _children = ("table",)
    _static = ("bidirectional", "num_buckets", "max_distance")

    def __init__(self, table: ArrayLike, *, bidirectional: bool = True,
                 num_buckets: int | None = None, max_distance: int = 128):
        _checks.check_rank("table", table, (2,), "[num_buckets, num_heads]")
        _checks.check_floating("table", table)
        nb = _checks.shape_of(table)[0] if num_buckets is None else num_buckets
        check_bucket_args(nb, max_distance, bidirectional)
        check_t5_table(table, nb)
        self._set(table=table, bidirectional=bool(bidirectional), num_buckets=int(nb),
                  max_distance=int(max_distance))

    def check(self, num_heads: int, head_dim: int) -> None:
        if _checks.shape_of(self.table)[1] != num_heads:
            shape = _checks.shape_of(self.table)
            raise ValueError(f"T5 table must have shape [num_buckets, N] = [{self.num_buckets}, "
                             f"{num_heads}] (one column per query head); got {shape}."
                             f"{transposed_hint(shape, num_heads=num_heads)}")

    #: Logical axis names of the parameters (:mod:`jaxpos.sharding`).
    param_axes = {"table": ("position_rows", "heads")}

    @classmethod
    def init_params(cls, key: jax.Array, *, num_heads: int, d_model: int, causal: bool,
                    param_dtype: Any, options: dict, **_: Any) -> dict:
        """``table [num_buckets, num_heads]`` from ``N(0, 1/d_model)`` (Hugging Face's T5
        initialisation)."""
        nb = options.get("num_buckets")
        nb = 32 if nb is None else _checks.check_positive_int("num_buckets", nb)
        init = jax.nn.initializers.normal(stddev=d_model ** -0.5)
        return {"table": init(key, (nb, num_heads), param_dtype)}

    @classmethod
    def from_params(cls, params: dict, *, causal: bool, options: dict, **_: Any) -> PositionScheme:
        """Causal buckets in a causal stack, bidirectional ones otherwise."""
        md = options.get("max_distance")
        return cls(params["table"], bidirectional=not causal,
                   max_distance=128 if md is None else md)

    def check_causal(self, causal: bool) -> None:
        if causal and self.bidirectional:
            raise ValueError(
                "T5Bias(bidirectional=True) with causal=True: a causal decoder uses T5's causal "
                "buckets (all num_buckets for offsets <= 0), so the bidirectional table would be "
                "read with the wrong buckets. Pass T5Bias(..., bidirectional=False) for a "
                "decoder, or causal=False for an encoder.")

    def offset_vector(self) -> jax.Array:
        """The bias as a per-head vector over clipped offsets: float32 ``[N, 2R + 1]``,
        ``R = max_distance``; entry ``R + r`` is ``table[bucket(r), h]``.

        Exact for every offset: past ``max_distance`` each direction's bucket is its last
        one (Raffel et al. 2020, §2.1), so clipping offsets to ``±R`` changes nothing.
        Differentiable in ``table`` (a gather; autodiff scatters back).
        """
        R = self.max_distance
        rel = jnp.arange(-R, R + 1, dtype=jnp.int32)
        b = t5_bias_from_offsets(rel[None, :], self.table, bidirectional=self.bidirectional,
                                 num_buckets=self.num_buckets, max_distance=R)  # [N, 1, 2R+1]
        return b[:, 0, :]

    @property
    def score_heads(self) -> int:
        """Heads of the score term: one column of the table each."""
        return _checks.shape_of(self.table)[1]

    def score_mod(self) -> Callable[..., jax.Array] | None:
        """``score + table[bucket(kv_pos - q_pos), head]``, as a gather from
        :meth:`offset_vector` (computed once per call, so tiles do no bucket arithmetic)."""
        return offset_score_mod(self.offset_vector(), self.max_distance)
