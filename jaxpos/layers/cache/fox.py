"""FoX's KV-cache decoding (the Forgetting Transformer, Lin et al. 2025, §2), as the state
writer of ``position="fox"`` (:mod:`jaxpos.layers.cache.scheme_state`) over a dense or
paged cache.

The bias of query ``i`` and key ``j`` is ``c_i - c_j`` with ``c`` the cumulative log forget
gate, so a cache needs ``c`` of every token it holds, not the gates themselves. A step of
``T`` new tokens:

1. padding gets a gate of 0 (``f = 1``: it forgets nothing, as in the padded full pass);
2. the new tokens' ``c`` is the row's last ``c`` (``g_last``) plus the running sum of
   their gates, stored at their positions in ``g_slots`` (the row's table of ``c``);
3. the inner cache stores the raw keys and values (FoX adds no per-token transform);
4. attention reads the cache with :class:`jaxpos.schemes.fox.FoXCacheRead`, the bias
   ``c[q_pos] - c[kv_pos]`` from the table, on every engine and through a page table.

Decoding so equals the full pass. Positions index the table, so a token must sit at a
position in ``[0, slots)``: the default positions (the row's token count) always do;
an explicit position outside raises ``ValueError`` when concrete and gives the row NaN
under ``jit``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpos import _checks
from jaxpos.layers.cache.base import Cache, CacheRead
from jaxpos.layers.cache.scheme_state import register_state_writer
from jaxpos.schemes.base import NoPE
from jaxpos.schemes.fox import FoXCacheRead

__all__ = ["write_fox_step"]


@register_state_writer("fox", moves_keys=False)
def write_fox_step(scheme: Any, inner: Cache, state: dict, q: jax.Array, k: jax.Array,
                   v: jax.Array, positions: jax.Array, mask: jax.Array | None
                   ) -> tuple[Cache, dict, CacheRead]:
    """One decode step of a FoX layer (module docstring): ``(inner, state, read)``.

    Args:
      scheme: the layer's :class:`jaxpos.FoX` for the new tokens (``log_forget`` ``[B|1, T,
        N]`` in token order); inner: the cache of keys and values; state:
        :meth:`jaxpos.FoX.init_decode_state`'s (``g_last [B, N]``, ``g_slots [B, S, N]``);
      q: ``[B, T, N, H]``; k, v: ``[B, T, N_kv, H]``; positions: int32 ``[B, T]``; mask:
        bool ``[B, T]`` (False: padding) or None.

    Raises:
      ValueError: gates that are not the new tokens' ``[B|1, T, N]``; a concrete
        position of a token outside ``[0, slots)``; the inner cache's errors (overflow).
    """
    B, T, N = q.shape[:3]
    lf = scheme.log_forget
    if lf.shape[1:] != (T, N) or lf.shape[0] not in (1, B):
        raise ValueError(f"a FoX decode step needs the gates of its {T} new token(s), "
                         f"log_forget [{B} or 1, {T}, {N}]; got {lf.shape}.")
    keep = jnp.ones((B, T), bool) if mask is None else jnp.asarray(mask, bool)
    lf = jnp.where(keep[..., None], jnp.broadcast_to(lf.astype(jnp.float32), (B, T, N)), 0.0)
    g_new = state["g_last"][:, None, :] + jnp.cumsum(lf, axis=1)  # [B, T, N]
    table = state["g_slots"]
    S = table.shape[1]
    pos = jnp.broadcast_to(jnp.asarray(positions, jnp.int32), (B, T))
    outside = keep & ((pos < 0) | (pos >= S))
    if _checks.is_concrete(pos) and (mask is None or _checks.is_concrete(mask)):
        bad = np.asarray(outside)
        if bad.any():
            b, t = (int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"FoX keeps the cumulative forget gate per position in [0, "
                             f"{S}) (the cache's slots); token {t} of row {b} is at position "
                             f"{int(np.asarray(pos)[b, t])}. Decode with the default "
                             f"positions (the row's token count) or a larger cache.")
    rows = jnp.arange(B, dtype=jnp.int32)[:, None]
    index = jnp.where(keep & ~outside, pos, S)  # S: out of range, dropped
    table = table.at[rows, index].set(g_new.astype(table.dtype), mode="drop")
    inner, read = inner.write(NoPE(), q, k, v, positions, mask)
    state = dict(state, g_last=g_new[:, -1].astype(state["g_last"].dtype), g_slots=table)
    return inner, state, read._replace(scheme=FoXCacheRead(table),
                                       poison=read.poison | jnp.any(outside, axis=1))
