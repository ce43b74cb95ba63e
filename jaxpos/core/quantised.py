"""Quantised KV pages: int8 (or float8 e4m3) keys and values with one symmetric scale per
(token, KV head), quantised when written, dequantised where attention loads a tile.

The scale choice: per (token, KV head), computed when the token is written, as in
LMDeploy's online int8 KV cache (KIVI, Liu et al. 2024, §3, also quantises values per
token), rather than the per-tensor scales of vLLM's and FlashInfer's FP8 caches
(``k_scale``, ``v_scale``, calibrated offline or left at 1):

* ``scale[p, s, h] = max_i |x[p, s, h, i]| / Q`` with ``Q = 127`` for int8 (symmetric:
  ``-128`` is never used) and ``Q = 448`` for ``float8_e4m3fn`` (its largest finite
  value); ``values = round(x / scale)`` (int8; round half to even) or ``x / scale`` cast
  to float8 (round to nearest). A token whose head is all zeros gets scale 0 and zero
  values.
* Each new token is quantised once, by itself, when it is written: no calibration, no
  rescaling of tokens already in a page (a per-page scale would have to rewrite the page
  whenever a larger token arrives), and a token's keys read the same whatever else its
  page holds, so a row decodes the same in any batch.
* Round trip: ``|x - values * scale| <= scale / 2`` per element for int8; for float8
  e4m3 the error is at most half a unit in the last place of ``x / scale`` (3 mantissa
  bits: ``<= 2**-4 |x|`` for normal values, ``<= 2**-10 scale`` in the subnormal range).
* Scales are float32, stored ``[num_pages, page_size, N_kv, 1]`` (the pages' layout with
  a feature axis of one, so a page table, a mesh's partition spec or a page copy treats
  values and scales alike). Bytes per token and layer, keys and values:
  ``2 * N_kv * (H + 4)``; at ``H = 64`` that is ``68 / 256 = 0.27x`` of float32 pages and
  ``0.53x`` of bfloat16 ones, at ``H = 128`` ``0.26x`` and ``0.52x``.

:class:`QuantisedPages` is the pool a paged cache holds and hands attention
(``jaxpos.attention(q, k_pages, v_pages, page_table=, kv_lengths=)`` takes it for either
pool). It reads as an array of its logical ``dtype`` (:attr:`QuantisedPages.dtype`, the
dtype attention computes in), so code that passes pages around needs no case for it; the
engines that read pages themselves dequantise each key block as they load it (the chunked
engine's page loader, the Pallas kernel's paged entry), and the gather fallback
dequantises the rows it gathers: no dequantised copy of the pool is ever made.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["QUANTISED_DTYPES", "QuantisedPages", "as_pool", "check_quantised", "dequantise",
           "empty_quantised_pages", "is_quantised", "kv_storage_dtype", "quantise",
           "set_pages", "take_pages", "write_tokens"]


def _quantised_dtypes() -> dict[str, tuple[Any, float]]:
    """``{name: (storage dtype, largest magnitude used)}`` for the dtypes this JAX has."""
    out: dict[str, tuple[Any, float]] = {"int8": (jnp.dtype(jnp.int8), 127.0)}
    f8 = getattr(jnp, "float8_e4m3fn", None)
    if f8 is not None:
        out["float8_e4m3fn"] = (jnp.dtype(f8), float(jnp.finfo(f8).max))
    return out


#: The quantised KV dtypes: ``{name: (storage dtype, Q)}``, ``scale = amax / Q``.
QUANTISED_DTYPES = _quantised_dtypes()


def kv_storage_dtype(kv_dtype: Any) -> Any:
    """The storage dtype that ``kv_dtype`` names when it is a quantised one (``"int8"``,
    ``"float8_e4m3fn"``, or those dtypes), else None (a float dtype: pages of that dtype).

    Raises:
      TypeError: ``kv_dtype`` is neither a quantised dtype nor a floating-point dtype.
    """
    try:
        dt = jnp.dtype(kv_dtype)
    except TypeError as e:
        raise TypeError(f"kv_dtype must be one of {sorted(QUANTISED_DTYPES)} or a float dtype; "
                        f"got {kv_dtype!r}.") from e
    for stored, _ in QUANTISED_DTYPES.values():
        if dt == stored:
            return stored
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"kv_dtype must be one of {sorted(QUANTISED_DTYPES)} (quantised pages) "
                        f"or a float dtype; got {dt}.")
    return None


def _q_max(dtype: Any) -> float:
    for stored, q in QUANTISED_DTYPES.values():
        if jnp.dtype(dtype) == stored:
            return q
    raise TypeError(f"quantised values must be one of {sorted(QUANTISED_DTYPES)}; got {dtype}.")


def quantise(x: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """Symmetric quantisation of ``x [..., H]`` along its last axis (one scale per
    (token, head) for keys or values ``[..., N_kv, H]``): ``(values [..., H] of dtype,
    scales float32 [..., 1])`` with ``x ~= values * scales`` (module docstring). Computed
    in float32 (float64 inputs are narrowed first)."""
    q_max = _q_max(dtype)
    xf = jnp.asarray(x).astype(jnp.float32)
    scale = jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / jnp.float32(q_max)
    y = xf / jnp.where(scale > 0, scale, jnp.float32(1))
    if jnp.issubdtype(jnp.dtype(dtype), jnp.integer):
        y = jnp.clip(jnp.round(y), -q_max, q_max)
    return y.astype(dtype), scale


def dequantise(values: jax.Array, scales: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
    """``values * scales`` computed in float32 and cast to ``dtype``."""
    return (values.astype(jnp.float32) * scales).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantisedPages:
    """A quantised page pool (a pytree): ``values [num_pages, page_size, N_kv, H]`` of int8
    or float8 e4m3 and ``scales`` float32 ``[num_pages, page_size, N_kv, 1]`` (module
    docstring); ``dtype`` (static) is the logical dtype, the one the pool reads as.

    It quacks like the pool it stands for: :attr:`shape` is ``values``'s, :attr:`dtype`
    the logical one, ``astype(d)`` the same pool read as ``d`` (nothing is converted),
    :attr:`nbytes` counts values and scales. Build one with
    :func:`empty_quantised_pages` or ``init_cache(..., kv_dtype="int8")``.
    """

    values: jax.Array
    scales: jax.Array
    dtype: Any = dataclasses.field(default=jnp.dtype(jnp.float32), metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def ndim(self) -> int:
        return len(self.values.shape)

    @property
    def nbytes(self) -> int:
        """Bytes held: values plus scales."""
        return int(self.values.nbytes) + int(self.scales.nbytes)

    @property
    def storage_dtype(self) -> Any:
        """The dtype of :attr:`values` (int8 or float8_e4m3fn)."""
        return self.values.dtype

    def astype(self, dtype: Any) -> QuantisedPages:
        """The same pool read as ``dtype`` (dequantised to it by attention)."""
        return dataclasses.replace(self, dtype=jnp.dtype(dtype))

    def dequantised(self) -> jax.Array:
        """The whole pool dequantised, ``[num_pages, page_size, N_kv, H]`` of :attr:`dtype`
        (for tests and inspection; attention never makes this copy)."""
        return dequantise(self.values, self.scales, self.dtype)


def is_quantised(x: Any) -> bool:
    """Whether ``x`` is a :class:`QuantisedPages` pool."""
    return isinstance(x, QuantisedPages)


def as_pool(x: Any) -> Any:
    """``x`` as a page pool: a :class:`QuantisedPages` as is, anything else
    ``jnp.asarray(x)``."""
    return x if is_quantised(x) else jnp.asarray(x)


def empty_quantised_pages(shape: tuple[int, ...], kv_dtype: Any,
                          dtype: Any = jnp.float32) -> QuantisedPages:
    """A zero pool ``shape = (num_pages, page_size, N_kv, H)`` stored as ``kv_dtype``
    (``"int8"`` or ``"float8_e4m3fn"``), read as ``dtype``.

    Raises:
      TypeError: ``kv_dtype`` not a quantised dtype; ``dtype`` not a float dtype.
    """
    stored = kv_storage_dtype(kv_dtype)
    if stored is None:
        raise TypeError(f"kv_dtype must be one of {sorted(QUANTISED_DTYPES)}; got {kv_dtype!r}.")
    dt = jnp.dtype(dtype)
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"the dtype quantised pages read as must be a float dtype; got {dt}.")
    return QuantisedPages(jnp.zeros(shape, stored), jnp.zeros(shape[:-1] + (1,), jnp.float32),
                          dt)


def check_quantised(name: str, pages: Any) -> None:
    """``pages`` must hold values of a quantised dtype ``[P, page_size, N_kv, H]`` and
    float32 scales ``[P, page_size, N_kv, 1]``, read as a float dtype.

    Raises:
      TypeError: values not int8 / float8_e4m3fn, scales not float32, a logical dtype
        that is not floating.
      ValueError: values not rank 4, scales of another shape.
    """
    vals, scales = pages.values, pages.scales
    if len(np.shape(vals)) != 4:
        raise ValueError(f"{name}.values must be [num_pages, page_size, kv_heads, head_dim]; "
                         f"got shape {tuple(np.shape(vals))}.")
    if not any(jnp.dtype(vals.dtype) == s for s, _ in QUANTISED_DTYPES.values()):
        raise TypeError(f"{name}.values must be one of {sorted(QUANTISED_DTYPES)}; got dtype "
                        f"{vals.dtype}.")
    want = tuple(np.shape(vals))[:3] + (1,)
    if tuple(np.shape(scales)) != want:
        raise ValueError(f"{name}.scales must be float32 {list(want)} (one scale per token and "
                         f"KV head); got shape {tuple(np.shape(scales))}.")
    if jnp.dtype(scales.dtype) != jnp.float32:
        raise TypeError(f"{name}.scales must be float32; got {scales.dtype}.")
    if not jnp.issubdtype(jnp.dtype(pages.dtype), jnp.floating):
        raise TypeError(f"{name}.dtype (the dtype the pages read as) must be a float dtype; got "
                        f"{pages.dtype}.")


def take_pages(pages: Any, index: jax.Array, dtype: Any = None,
               mode: str | None = None) -> jax.Array:
    """``pages[index]`` (``index`` int ``[...]`` of page numbers), dequantised for a
    :class:`QuantisedPages` pool (the gathered pages only) to ``dtype`` (default the
    pool's); a plain pool is indexed as is. ``mode``: the gather's out-of-bounds mode."""
    if not is_quantised(pages):
        return pages.at[index].get(mode=mode) if mode else pages[index]
    vals = pages.values.at[index].get(mode=mode) if mode else pages.values[index]
    scales = pages.scales.at[index].get(mode=mode) if mode else pages.scales[index]
    return dequantise(vals, scales, pages.dtype if dtype is None else dtype)


def write_tokens(pages: Any, page: jax.Array, offset: jax.Array, x: jax.Array) -> Any:
    """``pages`` with token slots ``(page, offset)`` (int ``[B, T]``; an index past the
    pool is dropped) set to ``x [B, T, N_kv, H]``: quantised first for a
    :class:`QuantisedPages` pool, else cast to the pool's dtype."""
    if not is_quantised(pages):
        return pages.at[page, offset].set(x.astype(pages.dtype), mode="drop")
    vals, scales = quantise(x, pages.values.dtype)
    return dataclasses.replace(
        pages, values=pages.values.at[page, offset].set(vals, mode="drop"),
        scales=pages.scales.at[page, offset].set(scales, mode="drop"))


def set_pages(pages: Any, index: jax.Array, rows: jax.Array) -> Any:
    """``pages`` with whole pages ``index`` (int ``[n]``; past the pool: dropped) set to
    ``rows [n, page_size, N_kv, H]`` (quantised for a :class:`QuantisedPages` pool)."""
    if not is_quantised(pages):
        return pages.at[index].set(rows.astype(pages.dtype), mode="drop")
    vals, scales = quantise(rows, pages.values.dtype)
    return dataclasses.replace(pages, values=pages.values.at[index].set(vals, mode="drop"),
                               scales=pages.scales.at[index].set(scales, mode="drop"))
