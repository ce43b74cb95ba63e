"""PaTH attention decoding from a KV cache (Yang et al. 2025, "PaTH Attention: Position
Encoding via Accumulating Householder Transformations", arXiv:2505.16381, §3.2,
"Efficient inference"): the cache keeps every key moved through the transforms of the
tokens after it, ``k~_j = H_t ... H_{j+1} k_j`` (``t`` the last token written), so that a
new query scores a cached key by a plain dot product, and each step moves the cached
keys on by its own transforms.

A step of ``T`` new tokens is one block of the chunked algorithm of
:mod:`jaxpos.core.path` (``wy_blocks`` with ``C = T``):

* its queries absorb the transforms of the block up to themselves (``q_i^T H_i ...
  H_first``) and score the cached keys by ``q~_i . k~_j`` (the transforms between ``j``
  and the block's first token are already in ``k~_j``);
* the scores among the new tokens are the block's local scores ``q_i^T H_i ... H_{j+1}
  k_j``;
* one softmax over both (PaTH-FoX adds ``c_i - c_j``, ``c`` the cumulative log forget
  gates, the cache keeping ``c_j`` per slot);
* the block's keys are stored moved to its end (``H_last ... H_{j+1} k_j``) and every
  cached key is moved by the block's product ``H_last ... H_first = I - W^T Y``
  (:func:`move_keys`).

A step costs ``O(T (S + T) H)`` for ``S`` cached slots (dense in ``T``: prefill long
prompts in pieces to bound the ``[T, T]`` block).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxpos.core.carried import static_scale
from jaxpos.core.path import (
    compute_dtype,
    group_heads,
    refuse_softmax_options,
    softmax_rows,
    wy_blocks,
)
from jaxpos.schemes.base import REPLACING_IMPLEMENTATIONS, PositionScheme, register_attention

__all__ = ["PaTHCacheRead", "cached_path_attention", "chunk_transforms", "move_keys"]


def chunk_transforms(q: jax.Array, k: jax.Array, w: ArrayLike, beta: ArrayLike
                     ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """The block quantities of one decode step of ``T`` new tokens.

    Args:
      q: ``[B, T, N, H]``; k, w: ``[B, T, N_kv, H]``; beta: ``[B, T, N_kv]`` (0 for a
        padding token: ``H = I``). ``N`` a multiple of ``N_kv``.

    Returns:
      ``(q_t, k_t, y, w_kv, a_local)`` in :func:`jaxpos.core.path.compute_dtype`: the
      queries moved through the block's transforms up to themselves ``[B, T, N, H]``,
      the keys moved to the block's end ``[B, T, N_kv, H]``, ``Y`` and ``W`` of the
      block's product ``I - W^T Y`` ``[B, N_kv, T, H]``, the local scores ``[B, N, T,
      T]`` (zero above the diagonal).
    """
    ct = compute_dtype(q)
    N, Nk = q.shape[2], k.shape[2]
    g = N // Nk
    heads = lambda x: group_heads(x, g, ct)
    qq = jnp.swapaxes(jnp.asarray(q, ct), 1, 2)
    ww = heads(w)
    q_t, k_t, y, a_loc = wy_blocks(qq, heads(k), ww, heads(beta), q.shape[1])
    kv = lambda x: x[:, ::g, 0]  # one copy per key head (the heads of a group repeat it)
    return (jnp.swapaxes(q_t[:, :, 0], 1, 2), jnp.swapaxes(kv(k_t), 1, 2), kv(y),
            ww[:, ::g], a_loc[:, :, 0])


def move_keys(keys: jax.Array, y: jax.Array, w: jax.Array, moved: jax.Array) -> jax.Array:
    """Cached keys moved through a block's transforms: ``k <- (I - W^T Y) k = k - sum_t
    (y_t . k) w_t`` where ``moved`` (bool ``[B, S]``) is True, else as given.

    Args:
      keys: float ``[B, S, N_kv, H]``; y, w: ``[B, N_kv, T, H]`` (:func:`chunk_transforms`).
    """
    proj = jnp.einsum("bsnh,bnth->bsnt", keys, y.astype(keys.dtype))
    new = keys - jnp.einsum("bsnt,bnth->bsnh", proj, w.astype(keys.dtype))
    return jnp.where(moved[:, :, None, None], new, keys)


class PaTHCacheRead(PositionScheme):
    """How a PaTH decode step reads the cache (built by the PaTH cache writer,
    :mod:`jaxpos.layers.cache.path`): the step's local scores and forget sums, so that
    :func:`cached_path_attention` needs only the cached keys and values besides.

    Fields: ``a_local`` float ``[B, N, T, T]``; ``v_new`` ``[B, T, N_kv, Hv]`` the new
    tokens' values; ``g_q`` float ``[B, N, T]`` the new tokens' cumulative log forget
    gates (zeros for PaTH); ``g_k`` float ``[B, N, S]`` the cached slots' (zeros for
    PaTH); ``cached`` bool ``[B, S]``, slots written before this step.
    """

    a_local: jax.Array
    v_new: jax.Array
    g_q: jax.Array
    g_k: jax.Array
    cached: jax.Array

    _children = ("a_local", "v_new", "g_q", "g_k", "cached")
    replaces_softmax = True
    registry_name = "path_cache_read"

    def __init__(self, a_local, v_new, g_q, g_k, cached):
        self._set(a_local=a_local, v_new=v_new, g_q=g_q, g_k=g_k, cached=cached)


@register_attention("path_cache_read")
def cached_path_attention(scheme: PaTHCacheRead, q: jax.Array, k: jax.Array, v: jax.Array, *,
                          position: Any = None, q_positions: Any = None,
                          kv_positions: Any = None, causal: bool = True, mask: Any = None,
                          segment_ids: Any = None, kv_segment_ids: Any = None,
                          scale: float | None = None, mask_mod: Any = None, sinks: Any = None,
                          implementation: str | None = None, **extra: Any) -> jax.Array:
    """One decode step of PaTH attention against the cache (module docstring).

    Args:
      scheme: the step's :class:`PaTHCacheRead`.
      q: ``[B, T, N, H]`` the new queries moved through the step's transforms;
      k, v: ``[B, S, N_kv, H]`` the cache's rows of slots (keys moved to the last token
        before this step); segment_ids: int ``[B, T]`` (1 token, 0 padding);
        kv_segment_ids: int ``[B, S]`` (nonzero: a slot holding a token).
      implementation: ``"reference"``, ``"chunked"`` or None (a step is the same dense
        pass for all).

    Returns:
      ``[B, T, N, Hv]`` in q's dtype.

    Raises:
      ValueError: a softmax-attention option (mask, mask_mod, sinks, dropout), a
        non-causal call, another implementation.
    """
    refuse_softmax_options("PaTH attention", mask, mask_mod, sinks, extra)
    if causal is not True:
        raise ValueError(f"PaTH attention is causal by definition; got causal={causal!r}.")
    if implementation not in REPLACING_IMPLEMENTATIONS + (None,):
        raise ValueError(f"PaTH decoding runs on implementation 'reference' or 'chunked' (or "
                         f"None); got {implementation!r}.")
    B, T, N, H = q.shape
    ct = compute_dtype(q)
    scale = static_scale("PaTH attention", scale, H)
    g = N // k.shape[2]
    heads = lambda x: group_heads(x, g, ct)
    qq = jnp.swapaxes(jnp.asarray(q, ct), 1, 2)
    seg = jnp.ones((B, T), jnp.int32) if segment_ids is None else jnp.asarray(segment_ids)
    kv_seg = jnp.ones(k.shape[:2], jnp.int32) if kv_segment_ids is None else kv_segment_ids
    g_q, g_k = scheme.g_q.astype(ct), scheme.g_k.astype(ct)
    s_c = scale * (jnp.einsum("bnth,bnsh->bnts", qq, heads(k)) + g_q[..., :, None] -
                   g_k[..., None, :])
    vis_c = (seg != 0)[:, None, :, None] & (scheme.cached & (kv_seg != 0))[:, None, None, :]
    s_w = scale * (scheme.a_local.astype(ct) + g_q[..., :, None] - g_q[..., None, :])
    vis_w = (seg[:, :, None] == seg[:, None, :])[:, None] & jnp.tril(jnp.ones((T, T), bool))
    p = softmax_rows(jnp.concatenate([jnp.where(vis_c, s_c, -jnp.inf),
                                      jnp.where(vis_w, s_w, -jnp.inf)], -1))
    vv = jnp.concatenate([heads(v), heads(scheme.v_new)], 2)
    out = jnp.einsum("bnts,bnsh->bnth", p, vv)
    return jnp.swapaxes(out, 1, 2).astype(q.dtype)
