"""Small helpers of the kernel package: padding, and shard_map's varying-axis types."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def pad_axis(x, axis, size, value=0, mode="constant"):
    """Pad ``axis`` of ``x`` at the end to ``size`` (with ``value``, or ``mode="edge"``)."""
    pad = size - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    if mode == "constant":
        return jnp.pad(x, widths, constant_values=value)
    return jnp.pad(x, widths, mode=mode)


def pow2_at_least(n, lo=1):
    """The smallest power of two ``>= max(n, lo)``."""
    return max(lo, 1 << max(0, int(n) - 1).bit_length())


def varying_axes(x) -> frozenset:
    """Mesh axes ``x`` varies over inside ``shard_map`` (empty outside, or on a JAX without
    varying-axis types): ``aval.vma`` in some versions, ``aval.manual_axis_type.varying``
    in others."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
    return frozenset(vma or ())


def match_vma(g, x):
    """Under ``shard_map``, sum the cotangent ``g`` over the mesh axes it varies over but
    its primal ``x`` does not: the gradient of a replicated input (a captured table, keys
    all-gathered for sequence parallelism) is the sum of the per-shard gradients."""
    if g is None or getattr(g, "dtype", None) == jax.dtypes.float0:
        return g
    extra = tuple(sorted(varying_axes(g) - varying_axes(x)))
    return jax.lax.psum(g, extra) if extra else g


def zero_cotangent(x):
    """The zero cotangent of ``x`` (float0 for integers and bools)."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros(x.shape, x.dtype)
    return np.zeros(x.shape, jax.dtypes.float0)
