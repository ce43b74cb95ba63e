"""CoPE: contextual position encoding (Golovneva, Wang, Weston & Sukhbaatar 2024,
"Contextual Position Encoding: Learning to Count What's Important", arXiv:2405.18719, §3;
reference code facebookresearch/RAM ``projects/cope/src/cope/context_position.py``).

A query counts the keys it cares about: each visible key ``t`` gets a gate
``g_it = sigmoid(scale * q_i . k_t)`` and the position of key ``j`` relative to query
``i`` is the sum of the gates from ``j`` up to the query (Eq. 3)::

    p_ij = sum_{t = j}^{i} g_it              (fractional; clamped at npos - 1),

and the position embedding at that fractional position is interpolated between the two
nearest integer ones (Eq. 5), ``e[p] = (ceil(p) - p) e[floor(p)] + (p - floor(p))
e[ceil(p)]`` (``e[floor(p)]`` alone at an integer ``p``), entering the logit through the
query (Eq. 4)::

    z_ij = scale * (q_i . k_j + q_i . e[p_ij]),     o_i = sum_j softmax_j(z_ij) v_j.

As the reference code (its default, ``cope_nodiv=False``), the gates are the scaled
logits' sigmoids and the position term is scaled with the logit; positions past the
last embedding are clamped to it (``npos`` embeddings, ``p_max = npos - 1``, the code's
``positions.clamp(max=npos - 1)``): a model trained at length ``L`` has ``npos = L + 1``.

"Between" follows the key axis (keys sorted by position, as in a sequence or a KV
cache); visible keys are those at positions ``<= `` the query's in its segment; CoPE is
causal here (``causal=False`` is refused).

Two forms, chosen by the engine's ``replacing_form`` capability
(:func:`jaxpos.core.engines.replacing_form`; the Pallas kernel and ``"xla"`` declare none
and are refused): dense (``implementation="reference"``: ``[B, N, Tq, Tk]``, JAX
autodiff) and blocked (``"chunked"``, the default: key blocks right to left carrying each
query's sum of the gates of the keys to the right, :mod:`jaxpos.core.carried`: ``O(T)``
memory besides the per-query position logits ``q . e`` ``[B, N, T, npos]``, custom VJP).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos._util import pad_axis
from jaxpos.core import engines
from jaxpos.core.carried import carried_attention, from_blocks, static_scale, to_blocks
from jaxpos.core.path import compute_dtype, refuse_softmax_options, softmax_rows
from jaxpos.schemes.base import register_attention

__all__ = ["cope_attention", "cope_positions", "interpolate_logits", "scheme_attention"]

_BLOCK = 128
_NEG_INF = -jnp.inf


def cope_positions(gates: jax.Array) -> jax.Array:
    """``p_ij = sum_{t >= j} g_it`` along the last (key) axis (Golovneva et al. 2024, Eq.
    3; the invisible keys' gates must be 0)."""
    return jnp.flip(jnp.cumsum(jnp.flip(gates, -1), -1), -1)


def interpolate_logits(pos_logits: jax.Array, p: jax.Array) -> jax.Array:
    """``l[p]`` interpolated between ``l[floor(p)]`` and ``l[ceil(p)]`` (Eq. 5).

    Args:
      pos_logits: ``[..., tq, npos]`` the logits ``q_i . e[n]`` of the integer positions.
      p: ``[..., tq, tk]`` fractional positions in ``[0, npos - 1]``.

    Returns:
      ``[..., tq, tk]``; differentiable in both (the weight ``p - floor(p)`` carries the
      gradient to ``p``).
    """
    lo = jnp.floor(p)
    frac = p - lo
    lo_i = lo.astype(jnp.int32)
    hi_i = jnp.ceil(p).astype(jnp.int32)
    at_lo = jnp.take_along_axis(pos_logits, lo_i, axis=-1)
    at_hi = jnp.take_along_axis(pos_logits, hi_i, axis=-1)
    return at_lo * (1.0 - frac) + at_hi * frac


def _scores(q, k, pos_logits, vis, S, scale, npos):
    """Logits of a tile given ``S`` ``[B, N, tq]``, the gates of the visible keys to the
    tile's right. Returns ``(logits with -inf where invisible, gates)``."""
    z = scale * jnp.einsum("bnqh,bnkh->bnqk", q, k)
    g = jnp.where(vis, jax.nn.sigmoid(z), 0.0)
    p = jnp.minimum(S[..., None] + cope_positions(g), npos - 1)
    s = z + scale * interpolate_logits(pos_logits, p)
    return jnp.where(vis, s, _NEG_INF), g


def _visible(qp, kp, qs, ks):
    return (qs[..., :, None] == ks[..., None, :]) & (kp[..., None, :] <= qp[..., :, None])


def _cope_tile(scale, npos, q_blk, kv_blk, S, qi, kj):
    vis = _visible(q_blk["pos"], kv_blk["pos"], q_blk["seg"], kv_blk["seg"])
    s, g = _scores(q_blk["q"], kv_blk["k"], q_blk["l"], vis, S, scale, npos)
    return s, S + jnp.sum(g, -1)


def _init_sum(q_blk):
    return jnp.zeros(q_blk["q"].shape[:3], q_blk["q"].dtype)


@functools.partial(jax.jit, static_argnums=(7, 8, 9))
def _chunked(q, k, v, pos_logits, qp, kp, segs, scale, npos, block):
    qs, ks = segs
    bq, bk = block
    q_blocks = {"q": to_blocks(q, bq, 2), "l": to_blocks(pos_logits, bq, 2),
                "pos": to_blocks(qp, bq, 2), "seg": to_blocks(qs, bq, 2)}
    kv_blocks = {"k": to_blocks(k, bk, 2), "pos": to_blocks(kp, bk, 2),
                 "seg": to_blocks(ks, bk, 2)}
    tile = functools.partial(_cope_tile, float(scale), int(npos))
    o, _ = carried_attention(tile, _init_sum, q_blocks, kv_blocks, to_blocks(v, bk, 2),
                             block_q=bq)
    return from_blocks(o, 2)


@functools.partial(jax.jit, static_argnums=(7, 8))
def _reference(q, k, v, pos_logits, qp, kp, segs, scale, npos):
    vis = _visible(qp, kp, *segs)
    s, _ = _scores(q, k, pos_logits, vis, jnp.zeros(q.shape[:3], q.dtype), scale, npos)
    return jnp.einsum("bnqk,bnkh->bnqh", softmax_rows(s), v)


def _segments(segment_ids: ArrayLike | None, kv_segment_ids: ArrayLike | None, B: int,
              Tq: int, Tk: int) -> list[jax.Array]:
    """The checked segment ids as int32 ``[B, 1, T]`` (zeros when absent), queries then keys.

    Raises:
      ValueError: ``kv_segment_ids`` without ``segment_ids``, a shape other than ``[B, T]``.
      TypeError: float ids.
    """
    if kv_segment_ids is None:
        kv_segment_ids = segment_ids
    if (segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("kv_segment_ids needs segment_ids (the queries' segments) too.")
    segs = []
    for name, seg, T in (("segment_ids", segment_ids, Tq), ("kv_segment_ids", kv_segment_ids,
                                                           Tk)):
        if seg is None:
            segs.append(jnp.zeros((B, 1, T), jnp.int32))
            continue
        _checks.check_integer_positions(name, seg)
        if _checks.shape_of(seg) != (B, T):
            raise ValueError(f"{name} must have shape [B, T] = [{B}, {T}]; got "
                             f"{_checks.shape_of(seg)}.")
        segs.append(jnp.asarray(seg, jnp.int32)[:, None, :])
    return segs


def _check_key_order(qp: Any, kp: Any, segment_ids: Any, kv_segment_ids: Any) -> None:
    """Concrete ``kv_positions`` must be sorted along the key axis among the keys some
    query of their segment sees (keys nobody sees, e.g. a cache's empty slots, may hold
    anything): the gates CoPE sums "between" a key and its query are those of the keys
    between them on that axis (Golovneva et al. 2024, Eq. 3).

    Raises:
      ValueError: two such keys of one segment and row out of order, naming both.
    """
    if kv_segment_ids is None:
        kv_segment_ids = segment_ids
    if not all(_checks.is_concrete(x) for x in (qp, kp, segment_ids, kv_segment_ids)):
        return
    qp, kp = np.asarray(qp), np.asarray(kp)
    B = max(qp.shape[0], kp.shape[0])
    qp, kp = np.broadcast_to(qp, (B, qp.shape[-1])), np.broadcast_to(kp, (B, kp.shape[-1]))
    qs = np.zeros(qp.shape, np.int64) if segment_ids is None else np.asarray(segment_ids)
    ks = np.zeros(kp.shape, np.int64) if kv_segment_ids is None else np.asarray(kv_segment_ids)
    for b in range(B):
        ids, inv = np.unique(qs[b], return_inverse=True)
        top = np.full(len(ids), np.iinfo(np.int64).min)
        np.maximum.at(top, inv, qp[b].astype(np.int64))  # each segment's last query
        slot = np.clip(np.searchsorted(ids, ks[b]), 0, len(ids) - 1)
        seen = np.flatnonzero((ids[slot] == ks[b]) & (kp[b] <= top[slot]))
        order = seen[np.argsort(ks[b][seen], kind="stable")]  # by segment, then axis
        same = ks[b][order][1:] == ks[b][order][:-1]
        bad = np.flatnonzero(same & (kp[b][order][1:] < kp[b][order][:-1]))
        if bad.size:
            i, j = order[bad[0]], order[bad[0] + 1]
            raise ValueError(
                f"kv_positions must be sorted along the key axis (CoPE counts the gates of "
                f"the keys between a key and its query on that axis); got row {b}: key {i} "
                f"at position {int(kp[b, i])} before key {j} at position {int(kp[b, j])}, "
                f"both in segment {int(ks[b, i])} and seen by its queries. Sort the keys "
                f"(and their values) by position.")


def cope_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, pos_emb: ArrayLike, *,
                   causal: bool = True, q_positions: ArrayLike | None = None,
                   kv_positions: ArrayLike | None = None,
                   segment_ids: ArrayLike | None = None,
                   kv_segment_ids: ArrayLike | None = None, scale: float | None = None,
                   implementation: str | None = None, block_size: int | None = None,
                   check_order: bool = True) -> jax.Array:
    """CoPE attention (Golovneva et al. 2024, §3, Eqs. 3-5): softmax attention whose
    logits add the query's score against a position embedding interpolated at the
    contextual position ``p_ij = sum_{t=j}^{i} sigmoid(scale * q_i . k_t)``.

    Args:
      q: ``[B, Tq, N, H]``; k: ``[B, Tk, N_kv, H]``; v: ``[B, Tk, N_kv, H_v]`` (one float
        dtype; ``N`` a multiple of ``N_kv``).
      pos_emb: float ``[H, npos]`` (one table for every head, as the reference code) or
        ``[N, H, npos]`` (one per query head): the embeddings of positions ``0 ..
        npos - 1``; contextual positions past ``npos - 1`` use the last one.
      causal: must be True.
      q_positions, kv_positions: integer ``[T]`` or ``[B, T]``; default ``arange``, the
        queries aligned to the end of the keys (decoding). A key is visible to a query at
        a position ``>=`` its own; keys must be sorted by position along their axis (those
        some query sees; concrete positions are checked, traced ones under ``jit`` must
        keep it too).
      segment_ids, kv_segment_ids: integer ``[B, Tq]`` / ``[B, Tk]`` (``kv_segment_ids``
        defaults to ``segment_ids``): only equal ids interact.
      scale: a static number, default ``1 / sqrt(H)``.
      implementation: an engine that declares ``replacing_form``
        (:func:`jaxpos.core.engines.replacing_form`): ``"reference"`` (dense),
        ``"chunked"`` (blocked) or None (blocked). The Pallas kernel and ``"xla"`` do not
        run CoPE (its position term depends on the gates of the keys in between):
        ``ValueError``.
      block_size: the chunked tile size (default 128; any positive int).
      check_order: check the order of concrete ``kv_positions`` (default True). The Flax
        modules pass False: their padding queries see padding and empty cache slots out
        of order, and only padding rows read those.

    Returns:
      ``[B, Tq, N, H_v]`` in q's dtype (float32 inside; float64 for float64 inputs).

    Raises:
      ValueError: bad ranks or shapes (naming the argument), ``pos_emb`` of another width
        or head count, ``causal=False``, an unknown implementation or one that declares
        no ``replacing_form`` (naming those that do), bad block size,
        concrete ``kv_positions`` out of order (see above).
      TypeError: float positions or segment ids, dtypes that differ, a traced scale.
    """
    _checks.check_qkv(q, k, v)
    if causal is not True:
        raise ValueError(f"cope_attention counts the keys from the key up to the query "
                         f"(Golovneva et al. 2024, Eq. 3): causal only; got causal="
                         f"{causal!r}.")
    form = engines.replacing_form(
        "cope_attention", implementation,
        "CoPE's positions count the gates of the keys in between, not a score_mod of "
        "positions.")
    B, Tq, N, H = _checks.shape_of(q)
    Tk, Nk = _checks.shape_of(k)[1:3]
    _checks.check_floating("pos_emb", pos_emb)
    _checks.check_rank("pos_emb", pos_emb, (2, 3), "[H, npos] or [N, H, npos]")
    es = _checks.shape_of(pos_emb)
    if es[-2] != H or (len(es) == 3 and es[0] != N) or es[-1] < 1:
        raise ValueError(f"pos_emb must have shape [H, npos] = [{H}, npos] or [N, H, npos] = "
                         f"[{N}, {H}, npos]; got {es}.")
    if block_size is not None:
        _checks.check_positive_int("block_size", block_size)
    scale = static_scale("cope_attention", scale, H)
    qp = _checks.positions_2d("q_positions", jnp.arange(Tq, dtype=jnp.int32) + max(Tk - Tq, 0)
                              if q_positions is None else q_positions, B, Tq)
    kp = _checks.positions_2d("kv_positions", jnp.arange(Tk, dtype=jnp.int32)
                              if kv_positions is None else kv_positions, B, Tk)
    segs = _segments(segment_ids, kv_segment_ids, B, Tq, Tk)
    if check_order and kv_positions is not None:  # the default arange is sorted
        _check_key_order(qp, kp, segment_ids, kv_segment_ids)
    dtype, Hv = _checks.dtype_of(q), _checks.shape_of(v)[-1]
    if B == 0 or Tq == 0:
        return jnp.zeros((B, Tq, N, Hv), dtype)
    ct = compute_dtype(q)
    g = N // Nk
    qq = jnp.swapaxes(jnp.asarray(q, ct), 1, 2)
    kk = jnp.repeat(jnp.swapaxes(jnp.asarray(k, ct), 1, 2), g, axis=1)
    vv = jnp.repeat(jnp.swapaxes(jnp.asarray(v, ct), 1, 2), g, axis=1)
    E = jnp.asarray(pos_emb, ct)
    pos_logits = jnp.einsum("bnqh,hp->bnqp", qq, E) if E.ndim == 2 else \
        jnp.einsum("bnqh,nhp->bnqp", qq, E)
    npos = es[-1]
    qp3, kp3 = jnp.broadcast_to(qp, (B, Tq))[:, None], jnp.broadcast_to(kp, (B, Tk))[:, None]
    if form == "dense" or Tk == 0:
        out = _reference(qq, kk, vv, pos_logits, qp3, kp3, tuple(segs), scale, npos)
    else:
        bq, bk = min(block_size or _BLOCK, Tq), min(block_size or _BLOCK, Tk)
        nq, nk = -(-Tq // bq) * bq, -(-Tk // bk) * bk
        segp = (pad_axis(jnp.broadcast_to(segs[0], (B, 1, Tq)), 2, nq,
                         value=np.iinfo(np.int32).min),
                pad_axis(jnp.broadcast_to(segs[1], (B, 1, Tk)), 2, nk,
                         value=np.iinfo(np.int32).max))
        out = _chunked(pad_axis(qq, 2, nq), pad_axis(kk, 2, nk), pad_axis(vv, 2, nk),
                       pad_axis(pos_logits, 2, nq), pad_axis(qp3, 2, nq),
                       pad_axis(kp3, 2, nk), segp, scale, npos, (bq, bk))[:, :, :Tq]
    return jnp.swapaxes(out, 1, 2).astype(dtype)


@register_attention("cope")
def scheme_attention(scheme, q: jax.Array, k: jax.Array, v: jax.Array, *,
                     position: Any = None, q_positions: Any = None, kv_positions: Any = None,
                     causal: bool = True, mask: Any = None, segment_ids: Any = None,
                     kv_segment_ids: Any = None, scale: float | None = None,
                     mask_mod: Any = None, sinks: Any = None,
                     implementation: str | None = None, **extra: Any) -> jax.Array:
    """:func:`cope_attention` with ``scheme.pos_emb`` (a :class:`jaxpos.schemes.cope.CoPE`)
    and the keywords the Flax modules pass to :func:`jaxpos.attention` (a KV cache's
    fill counts are not needed: the segment ids hide the empty slots), without the key
    order check (``check_order=False``: the modules' positions are sorted; their padding
    and empty slots are not, and only padding sees them).

    Returns:
      ``[B, Tq, N, H_v]`` in q's dtype.

    Raises:
      ValueError: a ``mask``, ``mask_mod``, ``sinks``, attention dropout; the errors of
        :func:`cope_attention` (an implementation that declares no ``replacing_form``,
        naming those that do).
    """
    refuse_softmax_options("CoPE attention", mask, mask_mod, sinks, extra)
    scheme.check_causal(causal)
    return cope_attention(q, k, v, scheme.pos_emb.astype(q.dtype), q_positions=q_positions,
                          kv_positions=kv_positions, segment_ids=segment_ids,
                          kv_segment_ids=kv_segment_ids, scale=scale,
                          implementation=implementation, check_order=False)
