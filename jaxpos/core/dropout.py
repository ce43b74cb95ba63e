"""Attention dropout with a counter-based keep mask: the same mask in every implementation.

Attention dropout (Vaswani et al. 2017, "Attention Is All You Need", Sec. 5.4; Flax's
``dot_product_attention_weights``; FlashAttention's ``dropout_p``, Dao et al. 2022,
Sec. 3.1 and Alg. 2) drops entries of the softmax probabilities ``P`` after
normalisation and rescales the kept ones by ``1 / (1 - rate)``::

    O = (P * Z) V,    Z_bhij = keep_bhij / (1 - rate),    E[Z] = 1

so the expected output equals the output without dropout. The normaliser of the softmax
is the undropped one.

The keep decision of pair ``(b, h, i, j)`` (batch row, query head, query index, key
index; indices count from 0 along the call's sequences) is a pure function of the
dropout seed and those four integers: a counter-based hash, as in Salmon et al. 2011
("Parallel random numbers: as easy as 1, 2, 3") and FlashAttention's per-tile Philox.
The reference path evaluates it on the whole ``[B, N, Tq, Tk]`` grid, the chunked path on
each tile from the tile's offsets, the backward pass recomputes it, and nothing stores a
``[Tq, Tk]`` mask; every implementation therefore drops the same pairs for the same key.

The hash is Wellons's ``lowbias32`` finaliser (public domain,
https://github.com/skeeto/hash-prospector), a 32-bit integer bijection with full
avalanche, chained over the counters::

    r = mix(mix(mix(s0 ^ b) ^ h) ^ i)        # per query row
    c = mix(s1 ^ j)                           # per key column
    keep = (mix(r ^ c) >> 8) >= round(rate * 2**24)

``(s0, s1)`` are two uint32 words drawn from ``dropout_rng`` with
``jax.random.bits``. The keep probability is ``1 - round(rate * 2**24) / 2**24``, within
``3e-8`` of ``1 - rate``. With ``broadcast_dropout=True`` (Flax's default) ``b = h = 0``
for every pair: one ``[Tq, Tk]`` mask shared by all batch rows and heads, as Flax's
``broadcast_dropout`` does. The mask is not bit-equal to Flax's, which draws it with
``jax.random.bernoulli``; it has the same distribution.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from jaxpos import _checks

__all__ = ["Dropout", "check_dropout", "check_dropout_rate", "dropout_seed", "keep_mask",
           "keep_tile", "mix32"]

_M1 = np.uint32(0x7FEB352D)
_M2 = np.uint32(0x846CA68B)
#: Keep decisions compare the top 24 bits of the hash with ``round(rate * 2**24)``.
_BITS = 24


class Dropout(NamedTuple):
    """The dropout of one call: ``rate`` (a Python float in ``(0, 1)``), ``seed`` (uint32
    ``[2]``, traced or not) and ``broadcast`` (one mask for every batch row and head)."""

    rate: float
    seed: jax.Array
    broadcast: bool

    @property
    def threshold(self) -> int:
        """``round(rate * 2**24)``: a pair is kept when the top 24 bits of its hash reach it."""
        return int(round(self.rate * (1 << _BITS)))

    @property
    def scale(self) -> float:
        """``1 / (1 - rate)``, the factor applied to kept probabilities."""
        return 1.0 / (1.0 - self.rate)


def mix32(x: jax.Array) -> jax.Array:
    """Wellons's ``lowbias32`` integer finaliser on uint32 arrays (a bijection of 32-bit
    words with full avalanche); elementwise, any shape."""
    x = x ^ (x >> 16)
    x = x * _M1
    x = x ^ (x >> 15)
    x = x * _M2
    return x ^ (x >> 16)


def _u32(x):
    return jnp.asarray(x).astype(jnp.uint32)


def keep_tile(seed: Any, threshold: int, batch: Any, head: Any, q_index: Any,
              kv_index: Any) -> jax.Array:
    """bool keep decisions for broadcastable integer counters.

    Args:
      seed: uint32 ``[2]``, or a pair ``(s0, s1)`` of scalar words (a kernel reads them
        one by one from scalar memory).
      threshold: ``round(rate * 2**24)`` (Python int).
      batch, head, q_index, kv_index: integer arrays broadcastable against each other
        (e.g. ``[B, 1, 1, 1]``, ``[1, N, 1, 1]``, ``[1, 1, tq, 1]``, ``[1, 1, 1, tk]``);
        ``batch`` and ``head`` may also be scalars. ``q_index``/``kv_index`` count from 0
        along the call's query and key sequences.

    Returns:
      bool, the broadcast shape: True where the probability is kept.
    """
    if isinstance(seed, (tuple, list)):
        s0, s1 = _u32(seed[0]), _u32(seed[1])
    else:
        seed = _u32(seed)
        s0, s1 = seed[0], seed[1]
    row = mix32(mix32(mix32(s0 ^ _u32(batch)) ^ _u32(head)) ^ _u32(q_index))
    col = mix32(s1 ^ _u32(kv_index))
    bits = (mix32(row ^ col) >> (32 - _BITS)).astype(jnp.int32)
    return bits >= jnp.int32(threshold)


def keep_mask(dropout: Dropout, B: int, N: int, Tq: int, Tk: int, *, q_offset: int = 0,
              kv_offset: int = 0) -> jax.Array:
    """The keep mask of a whole call (or of a tile at ``q_offset``, ``kv_offset``): bool
    ``[B, N, Tq, Tk]`` (``[1, 1, Tq, Tk]`` with ``dropout.broadcast``). For tests and for
    the reference path; the tiled paths call :func:`keep_tile` per tile."""
    if dropout.broadcast:
        b = h = jnp.zeros((1, 1, 1, 1), jnp.int32)
    else:
        b = jnp.arange(B, dtype=jnp.int32)[:, None, None, None]
        h = jnp.arange(N, dtype=jnp.int32)[None, :, None, None]
    i = jnp.arange(Tq, dtype=jnp.int32)[None, None, :, None] + q_offset
    j = jnp.arange(Tk, dtype=jnp.int32)[None, None, None, :] + kv_offset
    return keep_tile(dropout.seed, dropout.threshold, b, h, i, j)


def dropout_seed(dropout_rng: Any) -> jax.Array:
    """Two uint32 words drawn from a JAX PRNG key (typed ``jax.random.key`` or a raw
    ``jax.random.PRNGKey``), with ``jax.random.bits``: uint32 ``[2]``."""
    return jax.random.bits(dropout_rng, (2,), jnp.uint32)


def _is_key(x) -> bool:
    dt = getattr(x, "dtype", None)
    if dt is None:
        return False
    if jnp.issubdtype(dt, jax.dtypes.prng_key):
        return _checks.shape_of(x) == ()
    return dt == jnp.uint32 and _checks.shape_of(x) in ((2,), (4,))


def check_dropout_rate(name: str, rate: Any) -> float:
    """``rate`` as a Python float in ``[0, 1)``.

    Raises:
      TypeError: not a real number (a traced rate: it selects the computation).
      ValueError: outside ``[0, 1)``.
    """
    if isinstance(rate, jax.core.Tracer) or isinstance(rate, (str, bytes, bool)) \
            or np.ndim(rate) != 0:
        raise TypeError(f"{name} must be a Python float in [0, 1) (static: it selects the "
                        f"computation); got {type(rate).__name__} {rate!r}.")
    if not 0.0 <= float(rate) < 1.0:
        raise ValueError(f"{name} must be in [0, 1) (the probability of dropping an "
                         f"element); got {rate!r}.")
    return float(rate)


def check_dropout(dropout_rate: Any, dropout_rng: Any,
                  broadcast_dropout: Any = False) -> Dropout | None:
    """Validate attention's dropout arguments; ``None`` when there is no dropout.

    Raises:
      TypeError: ``dropout_rate`` is not a Python/NumPy real number (a traced rate: it
        selects the computation, so it is static); ``dropout_rng`` is not a PRNG key
        (a scalar typed key or a raw uint32 ``[2]``/``[4]`` key); ``broadcast_dropout``
        is not a bool.
      ValueError: ``dropout_rate`` outside ``[0, 1)``; ``dropout_rate > 0`` without
        ``dropout_rng``.
    """
    rate = check_dropout_rate("dropout_rate", dropout_rate)
    if not isinstance(broadcast_dropout, (bool, np.bool_)):
        raise TypeError(f"broadcast_dropout must be a bool; got "
                        f"{type(broadcast_dropout).__name__}.")
    if rate == 0.0:
        return None
    if dropout_rng is None:
        raise ValueError(f"dropout_rate={rate} needs dropout_rng (a JAX PRNG key, e.g. "
                         f"jax.random.key(0)); got None. Pass dropout_rate=0.0 for no dropout.")
    if not _is_key(dropout_rng):
        raise TypeError(f"dropout_rng must be a JAX PRNG key (jax.random.key(seed) or "
                        f"jax.random.PRNGKey(seed)); got {type(dropout_rng).__name__} with shape "
                        f"{_checks.shape_of(dropout_rng)} and dtype "
                        f"{getattr(dropout_rng, 'dtype', None)}.")
    return Dropout(rate, dropout_seed(dropout_rng), bool(broadcast_dropout))
