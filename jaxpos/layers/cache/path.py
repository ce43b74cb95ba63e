"""PaTH's KV-cache decoding (Yang et al. 2025, arXiv:2505.16381, §3.2, "Efficient
inference"), as the state writer of ``position="path"`` and ``"path_fox"``
(:mod:`jaxpos.layers.cache.scheme_state`) over a dense or paged cache.

A step of ``T`` new tokens (one at a time, or a prefill):

1. the short convolution reads the row's last ``K - 1`` inputs from the state (padding
   skipped), giving the new tokens' directions ``w``; padding gets ``beta = 0`` (``H =
   I``) and, for PaTH-FoX, a log forget gate of 0;
2. the step's block quantities (:func:`jaxpos.core.path_decode.chunk_transforms`); the
   inner cache stores the new keys moved to the step's last token and the values;
3. every slot written before the step is moved by the step's transforms
   (:meth:`jaxpos.layers.cache.Cache.update_keys`, up to the longest row's fill), so the
   cache again holds each key moved up to the row's last token;
4. the read (:class:`jaxpos.core.path_decode.PaTHCacheRead`) scores the slots written
   before the step (with the moved queries against the keys before the move, or for a
   one-token step with the raw query against the moved keys: the same numbers) and the
   new tokens among themselves, visiting the filled slots only.

Decoding so equals the full pass of :func:`jaxpos.path_attention` (a row's left padding
is its own segment there, so the convolution restarts at the first token, as the empty
tail does here).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxpos.core.path import compute_dtype
from jaxpos.core.path_decode import PaTHCacheRead, chunk_transforms, move_keys
from jaxpos.layers.cache.base import Cache, CacheRead
from jaxpos.layers.cache.scheme_state import register_state_writer
from jaxpos.schemes.base import NoPE

__all__ = ["write_path_step", "write_transforms"]


@register_state_writer("path", "path_fox")
def write_path_step(scheme: Any, inner: Cache, state: dict, q: jax.Array, k: jax.Array,
                    v: jax.Array, positions: jax.Array, mask: jax.Array | None
                    ) -> tuple[Cache, dict, CacheRead]:
    """One decode step of a PaTH layer (module docstring): ``(inner, state, read)``.

    Args:
      scheme: the layer's :class:`jaxpos.schemes.path.PaTH` for the new tokens; inner: a
        cache with ``update_keys``; state: :meth:`~jaxpos.schemes.path.PaTH.init_decode_state`'s;
      q: ``[B, T, N, H]``; k, v: ``[B, T, N_kv, H]``; positions: int32 ``[B, T]`` (stored;
        PaTH reads only the tokens' order); mask: bool ``[B, T]`` or None.

    Raises:
      ValueError: keys with other than the scheme's ``num_kv_heads`` heads; the inner
        cache's errors (overflow).
    """
    B, T = q.shape[:2]
    scheme.check_kv_heads(k.shape[2])
    keep = jnp.ones((B, T), bool) if mask is None else jnp.asarray(mask, bool)
    w, tail = scheme.decode_directions(state["tail"], keep)
    inner, read, gates = write_transforms(inner, q, k, v, w, scheme.beta, scheme.log_forget,
                                          positions, mask, state.get("g_last"),
                                          state.get("g_slots"))
    state = dict(state, tail=tail)
    if gates is not None:
        state.update(g_last=gates[0], g_slots=gates[1])
    return inner, state, read


def write_transforms(inner: Cache, q: jax.Array, k: jax.Array, v: jax.Array, w: jax.Array,
                     beta: jax.Array, log_forget: jax.Array | None, positions: jax.Array,
                     mask: jax.Array | None, g_last: jax.Array | None = None,
                     g_slots: jax.Array | None = None
                     ) -> tuple[Cache, CacheRead, tuple[jax.Array, jax.Array] | None]:
    """Steps 2-4 of a decode step (module docstring) for given transforms: the new
    tokens' ``w`` ``[B, T, N_kv, H]`` (unit rows), ``beta`` ``[B, T, N_kv]``, and for
    PaTH-FoX ``log_forget`` ``[B, T, N]`` with the row's cumulative gate ``g_last`` ``[B,
    N]`` and the slots' ``g_slots`` ``[B, S, N]`` (None for PaTH). Padding (``mask``
    False) gets ``beta = 0`` and a gate of 0.

    Returns:
      ``(inner, read, gates)``: the cache with the new keys and every earlier key moved,
      the :class:`CacheRead` of the step (its scheme a
      :class:`~jaxpos.core.path_decode.PaTHCacheRead`), and ``(g_last, g_slots)`` after
      the step (None for PaTH).
    """
    B, T, N = q.shape[:3]
    keep = jnp.ones((B, T), bool) if mask is None else jnp.asarray(mask, bool)
    beta = jnp.where(keep[..., None], beta, 0.0)
    q_t, k_t, y, w_kv, a_local = chunk_transforms(q, k, w, beta)
    inner, read = inner.write(NoPE(), q, k_t.astype(k.dtype), v, positions, mask)
    first = read.kv_lengths - T  # the row's first slot of this step
    inner, moved = inner.update_keys(lambda keys, slots: move_keys(keys, slots, first, y, w_kv),
                                     upto=jnp.max(first))
    if T == 1:
        # q~ . k~_j = q^T H k~_j: the raw query scores the moved keys, so the step reads
        # the cache after the move only (no copy of the keys as they were)
        q_read, keys = q, moved
    else:
        q_read, keys = q_t.astype(q.dtype), read.k
    ct = compute_dtype(q)
    gates = None
    g_k = None
    if log_forget is None:
        g_q = jnp.zeros((B, N, T), ct)
    else:
        if g_last is None or g_slots is None:
            raise ValueError("PaTH-FoX decoding needs the state's g_last and g_slots.")
        lf = jnp.where(keep[..., None], jnp.asarray(log_forget, ct), 0.0)
        g_q = g_last[:, :, None].astype(ct) + jnp.cumsum(jnp.swapaxes(lf, 1, 2), -1)
        rows = jnp.arange(B, dtype=jnp.int32)[:, None]
        new_slots = first[:, None] + jnp.arange(T, dtype=jnp.int32)
        g_slots = g_slots.at[rows, new_slots].set(jnp.swapaxes(g_q, 1, 2).astype(
            g_slots.dtype), mode="drop")
        g_k = g_slots
        gates = (g_q[:, :, -1].astype(g_last.dtype), g_slots)
    # a paged cache's pools stay pages: the read visits the filled ones through the table
    reader = PaTHCacheRead(a_local, v, g_q, g_k, first, read.page_table)
    return inner, read._replace(q=q_read, k=keys, scheme=reader, page_table=None), gates
