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

A step of one token scores the keys after the move with its own query (``q~_1 . k~_j =
q_1^T H_1 k~_j``, and ``H_1 k~_j`` is the moved key), so it reads the cache once, after
the move; a step of several tokens reads the keys as they were before it (a buffer the
compiled step keeps apart from the moved one).

Both the move and the read visit the filled slots only, a block of :data:`BLOCK_SLOTS`
(or of whole pages) at a time up to the longest row's fill: a step costs ``O(T (L + T)
H)`` for ``L`` filled slots, whatever the cache's capacity (dense in ``T``: prefill long
prompts in pieces to bound the ``[T, T]`` block).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxpos._util import over_blocks
from jaxpos.core import engines
from jaxpos.core.carried import static_scale
from jaxpos.core.paged import gather_pages
from jaxpos.core.path import (
    PATH_REFUSAL,
    compute_dtype,
    group_heads,
    refuse_softmax_options,
    wy_blocks,
)
from jaxpos.schemes.base import PositionScheme, register_attention

__all__ = ["BLOCK_SLOTS", "PaTHCacheRead", "cached_path_attention", "chunk_transforms",
           "move_keys"]


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


#: slots a decode step reads at a time (whole pages for a paged cache): the loop over
#: them stops at the longest row's fill, so a step costs the filled slots, not the cache's
BLOCK_SLOTS = 256


def move_keys(keys: jax.Array, slots: jax.Array, first: jax.Array, y: jax.Array,
              w: jax.Array) -> jax.Array:
    """Cached keys moved through a block's transforms: ``k <- (I - W^T Y) k = k - sum_t
    (y_t . k) w_t`` on the slots written before the step (``slots < first[b]``), the
    others as given (a block of slots for :meth:`jaxpos.layers.cache.Cache.update_keys`).

    Args:
      keys: float ``[B, n, N_kv, H]``, the keys of ``slots`` of every row.
      slots: int32 ``[n]``, the slots of the block.
      first: int32 ``[B]``, each row's first slot of the step.
      y: ``[B, N_kv, T, H]``, from :func:`chunk_transforms`.
      w: ``[B, N_kv, T, H]``, from :func:`chunk_transforms`.

    Returns:
      ``[B, n, N_kv, H]``, the moved keys.
    """
    proj = jnp.einsum("bsnh,bnth->bsnt", keys, y.astype(keys.dtype))
    new = keys - jnp.einsum("bsnt,bnth->bsnh", proj, w.astype(keys.dtype))
    moved = slots[None, :] < first[:, None]
    return jnp.where(moved[:, :, None, None], new, keys)


class PaTHCacheRead(PositionScheme):
    """How a PaTH decode step reads the cache (built by the PaTH cache writer,
    :mod:`jaxpos.layers.cache.path`): the step's local scores and forget sums, so that
    :func:`cached_path_attention` needs only the cached keys and values besides.

    Fields: ``a_local`` float ``[B, N, T, T]``; ``v_new`` ``[B, T, N_kv, Hv]`` the new
    tokens' values; ``g_q`` float ``[B, N, T]`` the new tokens' cumulative log forget
    gates (zeros for PaTH); ``g_k`` float ``[B, S, N]`` the slots' (PaTH-FoX), or None
    (PaTH); ``first`` int32 ``[B]``: slots ``< first[b]`` were written before this step
    (the only ones read); ``page_table`` int32 ``[B, pages_per_seq]`` when the keys and
    values are a paged cache's pools (read a block of whole pages at a time), else None.
    """

    a_local: jax.Array
    v_new: jax.Array
    g_q: jax.Array
    g_k: jax.Array | None
    first: jax.Array
    page_table: jax.Array | None

    _children = ("a_local", "v_new", "g_q", "g_k", "first", "page_table")
    replaces_softmax = True
    registry_name = "path_cache_read"

    def __init__(self, a_local, v_new, g_q, g_k, first, page_table=None):
        self._set(a_local=a_local, v_new=v_new, g_q=g_q, g_k=g_k, first=first,
                  page_table=page_table)


def _slot_blocks(scheme: PaTHCacheRead, k: Any, v: Any) -> tuple[int, int, int, Any]:
    """``(size, block, slots_per_unit, load)`` of the loop over the cached slots: units of
    slots (dense rows) or of pages (a paged pool); ``load(start)`` gives the keys and
    values ``[B, n, N_kv, H]`` of the block read at unit ``start`` and its first slot."""
    if scheme.page_table is None:
        S = k.shape[1]
        n = min(S, BLOCK_SLOTS)
        return S, n, 1, lambda start: (jax.lax.dynamic_slice_in_dim(k, start, n, 1),
                                       jax.lax.dynamic_slice_in_dim(v, start, n, 1), start)
    table = jnp.asarray(scheme.page_table, jnp.int32)
    pps, ps = table.shape[1], k.shape[1]
    n = max(1, min(pps, BLOCK_SLOTS // ps))

    def load(start):
        cols = jax.lax.dynamic_slice_in_dim(table, start, n, 1)
        return gather_pages(k, cols), gather_pages(v, cols), start * ps

    return pps, n, ps, load


@register_attention("path_cache_read")
def cached_path_attention(scheme: PaTHCacheRead, q: jax.Array, k: Any, v: Any, *,
                          position: Any = None, q_positions: Any = None,
                          kv_positions: Any = None, causal: bool = True, mask: Any = None,
                          segment_ids: Any = None, kv_segment_ids: Any = None,
                          scale: float | None = None, mask_mod: Any = None, sinks: Any = None,
                          implementation: str | None = None, **extra: Any) -> jax.Array:
    """One decode step of PaTH attention against the cache (module docstring).

    The cached slots are read a block of :data:`BLOCK_SLOTS` at a time (whole pages for
    a paged cache) up to the longest row's ``scheme.first``, an online softmax over the
    blocks (a ``while_loop``: slots past every row's fill are never read), then the new
    tokens' own block.

    Args:
      scheme: the step's :class:`PaTHCacheRead`.
      q: ``[B, T, N, H]`` the new queries as they score the cached keys by a dot product;
      k, v: ``[B, S, N_kv, H]`` the cache's rows of slots (keys moved to the last token
        before this step), or with ``scheme.page_table`` the pools ``[num_pages,
        page_size, N_kv, H]``; segment_ids: int ``[B, T]`` (1 token, 0 padding);
        kv_segment_ids: int ``[B, S]`` (nonzero: a slot holding a token).
      implementation: an engine that declares ``replacing_form`` (``"reference"``,
        ``"chunked"``) or None: a step is the same pass for all.

    Returns:
      ``[B, T, N, Hv]`` in q's dtype (zeros for a query that sees no key: padding).

    Raises:
      ValueError: a softmax-attention option (mask, mask_mod, sinks, dropout), a
        non-causal call, an implementation that declares no ``replacing_form`` (naming
        those that do).
    """
    refuse_softmax_options("PaTH attention", mask, mask_mod, sinks, extra)
    if causal is not True:
        raise ValueError(f"PaTH attention is causal by definition; got causal={causal!r}.")
    engines.replacing_form("PaTH decoding", implementation, PATH_REFUSAL)  # either form
    B, T, N, H = q.shape
    ct = compute_dtype(q)
    scale = static_scale("PaTH attention", scale, H)
    Nk, Hv = k.shape[2], v.shape[-1]
    g = N // Nk
    qg = jnp.asarray(q, ct).reshape(B, T, Nk, g, H)
    seg = jnp.ones((B, T), jnp.int32) if segment_ids is None else jnp.asarray(segment_ids)
    first = jnp.asarray(scheme.first, jnp.int32)
    g_q = scheme.g_q.astype(ct).reshape(B, Nk, g, T)
    size, block, unit, load = _slot_blocks(scheme, k, v)
    n = block * unit  # slots per block

    def body(j, start, carry):
        m, l, acc = carry
        kb, vb, s0 = load(start)
        slots = s0 + jnp.arange(n, dtype=jnp.int32)
        # the block's own slots (the last block, shifted back, overlaps the one before)
        # written before the step and holding a token
        vis = (slots >= j * n)[None, :] & (slots[None, :] < first[:, None])
        if kv_segment_ids is not None:
            vis &= jax.lax.dynamic_slice_in_dim(jnp.asarray(kv_segment_ids), s0, n, 1) != 0
        s = jnp.einsum("btkgh,bskh->bkgts", qg, kb.astype(ct)) + g_q[..., None]
        if scheme.g_k is not None:
            gk = jax.lax.dynamic_slice_in_dim(scheme.g_k, s0, n, 1).astype(ct)
            s = s - jnp.moveaxis(gk.reshape(B, n, Nk, g), 1, -1)[..., None, :]
        s = jnp.where(vis[:, None, None, None, :] & (seg != 0)[:, None, None, :, None],
                      scale * s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, -1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[..., None])
        # an unfilled slot of a visited block may hold anything: its value is zeroed
        vb = jnp.where(vis[:, :, None, None], vb.astype(ct), 0.0)
        return (m_new, l * alpha + jnp.sum(p, -1),
                acc * alpha[..., None] + jnp.einsum("bkgts,bskh->bkgth", p, vb))

    init = (jnp.full((B, Nk, g, T), -jnp.inf, ct), jnp.zeros((B, Nk, g, T), ct),
            jnp.zeros((B, Nk, g, T, Hv), ct))
    upto = (jnp.max(first) + (unit - 1)) // unit
    m, l, acc = over_blocks(size, block, upto, body, init)
    # the new tokens among themselves
    s_w = scale * (scheme.a_local.astype(ct).reshape(B, Nk, g, T, T) + g_q[..., :, None] -
                   g_q[..., None, :])
    vis_w = (seg[:, :, None] == seg[:, None, :]) & jnp.tril(jnp.ones((T, T), bool))
    s_w = jnp.where(vis_w[:, None, None], s_w, -jnp.inf)
    m_all = jnp.maximum(m, jnp.max(s_w, -1))
    m_safe = jnp.where(jnp.isfinite(m_all), m_all, 0.0)
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s_w - m_safe[..., None])
    l = l * alpha + jnp.sum(p, -1)
    v_new = jnp.asarray(scheme.v_new, ct)
    acc = acc * alpha[..., None] + jnp.einsum("bkgts,bskh->bkgth", p, v_new)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return jnp.moveaxis(out, 3, 1).reshape(B, T, N, Hv).astype(q.dtype)
