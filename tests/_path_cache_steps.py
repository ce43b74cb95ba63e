"""PaTH's cache decoding driven step by step, as the tests that check it against
``_replacing_reference.np_path`` run it: :func:`jaxpos.layers.cache.path.write_transforms`
then :func:`jaxpos.core.path_decode.cached_path_attention`, one jitted program per chunk
shape (run eagerly, each op dispatched on its own, the steps cost about 3x)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpos.core.path_decode import cached_path_attention
from jaxpos.layers.cache.path import write_transforms


@jax.jit
def _step(cache, q, k, v, w, beta, log_forget, pos, mask, g_last, g_slots):
    cache, read, gates = write_transforms(cache, q, k, v, w, beta, log_forget, pos, mask,
                                          g_last, g_slots)
    out = cached_path_attention(read.scheme, read.q, read.k, read.v,
                                segment_ids=read.segment_ids,
                                kv_segment_ids=read.kv_segment_ids)
    return cache, out, gates


def path_cache_steps(cache, chunks, q, k, v, w, beta, log_forget, mask, g_last, g_slots,
                     dtype=jnp.float32):
    """Write and read ``cache`` chunk by chunk: ``chunks`` ``(start, stop)`` pairs over the
    token axis of ``q, k, v [B, T, ...]``, ``w``, ``beta``, ``log_forget`` (None: plain
    PaTH) and the bool ``mask [B, T]``, positions ``start .. stop - 1``, the FoX gates
    ``g_last [B, N]`` and ``g_slots [B, S, N]`` carried. Inputs are cast to ``dtype``.
    Returns ``(cache, outputs [B, T, N, H_v] as NumPy)``."""
    cast = lambda x: jnp.asarray(x, dtype)
    B = mask.shape[0]
    outs = []
    for a, b in chunks:
        sl = slice(a, b)
        cache, out, gates = _step(
            cache, cast(q[:, sl]), cast(k[:, sl]), cast(v[:, sl]), cast(w[:, sl]),
            cast(beta[:, sl]), None if log_forget is None else cast(log_forget[:, sl]),
            jnp.asarray(np.broadcast_to(np.arange(a, b), (B, b - a)), jnp.int32),
            jnp.asarray(mask[:, sl]), g_last, g_slots)
        if gates is not None:
            g_last, g_slots = gates
        outs.append(np.asarray(out))
    return cache, np.concatenate(outs, 1)
