"""Small array helpers shared by the attention engines and the kernel package: padding,
powers of two, ``shard_map``'s varying-axis types and the ring's one collective (one home
for each)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["cast_varying", "match_vma", "over_blocks", "pad_axis", "poison_rows",
           "pow2_at_least", "ring_shift", "sink_gradient", "varying_axes", "zero_cotangent"]


def pad_axis(x: jax.Array, axis: int, size: int, value: Any = 0,
             mode: str = "constant") -> jax.Array:
    """Pad ``axis`` of ``x`` at the end to ``size`` (with ``value``, or ``mode="edge"``)."""
    pad = size - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    if mode == "constant":
        return jnp.pad(x, widths, constant_values=value)
    return jnp.pad(x, widths, mode=mode)


def poison_rows(x: jax.Array, bad: jax.Array, axis: int = 0) -> jax.Array:
    """``x`` with NaN in the entries whose index along ``axis`` is a True of ``bad`` (bool
    ``[x.shape[axis]]``): the rule for a traced value that cannot raise (an overflowing KV
    cache, an out-of-range ``kv_lengths``)."""
    shape = [1] * x.ndim
    shape[axis] = -1
    return jnp.where(bad.reshape(shape), jnp.array(jnp.nan, x.dtype), x)


def over_blocks(size: int, block: int, upto: Any, body: Any, init: Any) -> Any:
    """``carry = body(j, start, carry)`` for the blocks ``j = 0, 1, ...`` of ``block``
    entries of an axis of ``size`` that cover ``[0, upto)``: a ``while_loop`` whose trip
    count ``ceil(min(upto, size) / block)`` follows ``upto`` (an int, possibly traced; none
    for ``upto <= 0``), so the work follows the filled part of a buffer, not its size.

    Block ``j`` owns entries ``[j * block, (j + 1) * block)`` and is read at ``start =
    min(j * block, size - block)`` (int32): the last block is shifted back inside the axis,
    and the entries below ``j * block`` it then overlaps belong to block ``j - 1``, which
    ``body`` must leave as they are. ``0 < block <= size`` (static ints)."""
    n = (jnp.minimum(jnp.asarray(upto, jnp.int32), size) + (block - 1)) // block

    def step(c):
        j, carry = c
        return j + 1, body(j, jnp.minimum(j * block, size - block), carry)

    return jax.lax.while_loop(lambda c: c[0] < n, step, (jnp.zeros((), jnp.int32), init))[1]


def pow2_at_least(n: int, lo: int = 1) -> int:
    """The smallest power of two ``>= max(n, lo)``."""
    return max(lo, 1 << max(0, int(n) - 1).bit_length())


def varying_axes(x: Any) -> frozenset:
    """Mesh axes ``x`` varies over inside ``shard_map`` (empty outside and for non-arrays):
    the abstract value's ``manual_axis_type.varying`` (``vma`` where a JAX spells it so)."""
    if not isinstance(x, jax.Array):
        return frozenset()
    aval = jax.typeof(x)
    vma = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
    if vma is None:
        vma = getattr(aval, "vma", None)
    return frozenset(vma or ())


def cast_varying(x: Any, axes: frozenset | tuple | set) -> Any:
    """``x`` marked as varying over ``axes`` too (``lax.pcast(..., to="varying")``). A
    no-op on the values: each device keeps its own."""
    axes = tuple(sorted(frozenset(axes) - varying_axes(x)))
    if not axes:
        return x
    return jax.lax.pcast(jnp.asarray(x), axes, to="varying")


def match_vma(g: Any, x: Any) -> Any:
    """Under ``shard_map``, sum the cotangent ``g`` over the mesh axes it varies over but
    its primal ``x`` does not: the gradient of a replicated input (a scheme table, a
    captured array, keys all-gathered for sequence parallelism) is the sum of the
    per-shard gradients. ``None`` and float0 cotangents pass through."""
    if g is None or getattr(g, "dtype", None) == jax.dtypes.float0:
        return g
    extra = tuple(sorted(varying_axes(g) - varying_axes(x)))
    return jax.lax.psum(g, extra) if extra else g


def zero_cotangent(x: Any) -> Any:
    """The zero cotangent of a non-differentiable input (float0 for integers and bools;
    ``None`` for ``None``)."""
    if x is None:
        return None
    if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
        return jnp.zeros(jnp.shape(x), jnp.result_type(x))
    return np.zeros(jnp.shape(x), jax.dtypes.float0)


def sink_gradient(sinks: jax.Array, lse: jax.Array, delta: jax.Array,
                  head_axis: int) -> jax.Array:
    """``d sink_h = -sum exp(sink_h - lse) * delta``, summed over every axis but
    ``head_axis`` of ``lse`` and ``delta`` (``rowsum(dout * out)``): the sink's softmax
    weight times ``delta`` is the whole gradient of a logit that carries no value vector.
    ``lse`` includes the sink. Returns float32 ``[N]``."""
    flat = lambda x: jnp.moveaxis(x, head_axis, 0).reshape(x.shape[head_axis], -1)
    w = jnp.exp(sinks.astype(jnp.float32)[:, None] - flat(lse))
    return -jnp.sum(jnp.where(jnp.isfinite(w), w, 0.0) * flat(delta), axis=1)


def ring_shift(tree: Any, axis_name: str, size: int) -> Any:
    """Send every leaf to the next device of the ring over ``axis_name`` of ``size``
    devices (device i -> i + 1 mod P), inside ``shard_map``: ring attention's one
    collective (:mod:`jaxpos.parallel.ring`, :mod:`jaxpos.parallel.engine_ring`)."""
    perm = [(i, (i + 1) % size) for i in range(size)]
    return jax.tree_util.tree_map(lambda x: jax.lax.ppermute(x, axis_name, perm), tree)
