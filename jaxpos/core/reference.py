"""``jaxpos.attention(..., implementation="reference")``: the dense ground truth, and the
per-tile math every tiled engine in plain JAX shares (:mod:`jaxpos.core.chunked`,
:mod:`jaxpos.parallel.ring`).

It materialises the ``[B, N, Tq, Tk]`` scores: ``scale * q . k``, the composed score_mod
(the scheme's score term, then the user's), the scheme's content bias (Shaw's ``q .
a_ij``), every mask, a softmax whose denominator may hold a sink logit per head, ``p @
v`` and the scheme's value term (Shaw's ``sum p_ij a^V_ij``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp

from jaxpos.core.call import AttentionCall, converted_mods
from jaxpos.core.dropout import Dropout, keep_mask
from jaxpos.core.engines import register_engine
from jaxpos.mods import ConvertedMod, apply_mod, convert_mod
from jaxpos.schemes.base import PositionScheme

__all__ = ["Masking", "ReferenceEngine", "Terms", "call_terms", "heads_major", "make_terms",
           "reference_attention", "run_reference", "tile_output", "tile_scores", "visible"]


class Masking(NamedTuple):
    """Everything that decides visibility, in broadcastable form."""

    q_pos: jax.Array  # int32 [B|1, Tq]
    kv_pos: jax.Array  # int32 [B|1, Tk]
    kv_valid: jax.Array | None  # bool [B|1, Tk] (False for padding added by chunking)
    mask: jax.Array | None  # bool [B|1, N|1, Tq|1, Tk|1]
    seg_q: jax.Array | None  # int32 [B, Tq]
    seg_kv: jax.Array | None  # int32 [B, Tk]


class Terms(NamedTuple):
    """What a tile adds to ``scale * q . k``: the scheme (for a content bias and a value
    term, Shaw's), the converted score_mod (the scheme's composed with the user's) and
    the converted mask_mod. A pytree: the mods' captured arrays are its leaves."""

    scheme: PositionScheme
    score: ConvertedMod | None
    mask: ConvertedMod | None


def make_terms(scheme: PositionScheme, score_mod: Callable | None, mask_mod: Callable | None,
               tq: int, tk: int) -> Terms:
    """The terms of a call, with the mods traced at a ``[tq, tk]`` tile."""
    conv = lambda fn, kind: None if fn is None else convert_mod(fn, kind, tq, tk)
    return Terms(scheme, conv(score_mod, "score"), conv(mask_mod, "mask"))


def call_terms(call: AttentionCall, tq: int, tk: int) -> Terms:
    """The terms of a validated call at a ``[tq, tk]`` tile (its mods as converted by the
    validation when the tile is the call's shape: :func:`jaxpos.core.call.converted_mods`)."""
    return Terms(call.scheme, *converted_mods(call, tq, tk))


def visible(causal: bool, q_pos: jax.Array, kv_pos: jax.Array, kv_valid: jax.Array | None,
            mask: jax.Array | None, seg_q: jax.Array | None, seg_kv: Any,
            mask_mod: ConvertedMod | None = None,
            heads: Any = None) -> jax.Array | None:
    """bool ``[B|1, N|1, tq, tk]`` (or None when everything is visible).

    ``mask_mod``: a converted mask_mod evaluated on the tile for ``heads = (B, N)``."""
    vis = None

    def conj(a, b):
        return b if a is None else a & b

    if causal:
        vis = conj(vis, (kv_pos[:, None, :] <= q_pos[:, :, None])[:, None])
    if kv_valid is not None:
        vis = conj(vis, kv_valid[:, None, None, :])
    if seg_q is not None:
        vis = conj(vis, (seg_q[:, :, None] == seg_kv[:, None, :])[:, None])
    if mask is not None:
        vis = conj(vis, mask)
    if mask_mod is not None:
        vis = conj(vis, apply_mod(mask_mod, q_pos, kv_pos, batch_index=heads))
    return vis


def tile_scores(terms: Terms, qs: jax.Array, k: jax.Array, q_pos: jax.Array,
                kv_pos: jax.Array) -> jax.Array:
    """Scaled scores, then the score_mod, then the scheme's content bias: float32
    ``[B, N, tq, tk]``. ``qs``: scaled queries ``[B, N, tq, H]``; ``k``: ``[B, N, tk, H]``
    (float32); positions int32 ``[B|1, t]``.
    """
    s = jnp.einsum("bnqh,bnkh->bnqk", qs, k, preferred_element_type=jnp.float32)
    if terms.score is not None:
        s = apply_mod(terms.score, q_pos, kv_pos, score=s)
    b = terms.scheme.content_bias(qs, q_pos, kv_pos)
    if b is not None:
        s = s + b
    return s


def tile_output(terms: Terms, p: jax.Array, v: jax.Array, q_pos: jax.Array,
                kv_pos: jax.Array) -> jax.Array:
    """``p @ v`` plus the scheme's value term: float32 ``[B, N, tq, H]``."""
    o = jnp.einsum("bnqk,bnkh->bnqh", p, v, preferred_element_type=jnp.float32)
    t = terms.scheme.value_term(p, q_pos, kv_pos)
    if t is not None:
        o = o + t
    return o


def reference_attention(terms: Terms, qs: jax.Array, k: jax.Array, v: jax.Array, m: Masking,
                        causal: bool, sinks: jax.Array | None,
                        dropout: Dropout | None = None, *,
                        with_lse: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Dense attention in the heads-major layout: float32 ``[B, N, Tq, H_v]`` from scaled
    queries ``qs [B, N, Tq, H]``, ``k [B, N, Tk, H]``, ``v [B, N, Tk, H_v]`` (float32, key/
    value heads already repeated to the query heads). ``dropout``: the probabilities are
    multiplied by the keep mask of :func:`jaxpos.core.dropout.keep_mask` and ``1 / (1 - rate)``
    before ``p @ v`` and the value term. ``with_lse``: also the log-sum-exp of each row's
    visible scores and its sink, float32 ``[B, N, Tq]`` (``-inf`` for an empty row)."""
    s = tile_scores(terms, qs, k, m.q_pos, m.kv_pos)
    vis = visible(causal, m.q_pos, m.kv_pos, m.kv_valid, m.mask, m.seg_q, m.seg_kv,
                  terms.mask, s.shape[:2])
    # A score_mod may hide a pair with -inf: such a pair is hidden like a masked one (a row
    # hidden everywhere gives zeros, as in the tiled implementations, not 0/0).
    vis = jnp.broadcast_to(s != -jnp.inf if vis is None else vis & (s != -jnp.inf), s.shape)
    # A finite fill keeps fully masked rows NaN-free in both passes; they are zeroed.
    s = jnp.where(vis, s, jnp.finfo(jnp.float32).min)
    if sinks is not None:  # the sink takes part in the normalisation only
        col = jnp.broadcast_to(jnp.asarray(sinks, jnp.float32)[None, :, None, None],
                               s.shape[:3] + (1,))
        s = jnp.concatenate([s, col], axis=-1)
        vis = jnp.concatenate([vis, jnp.ones(col.shape, bool)], axis=-1)
    p = jnp.where(vis, jax.nn.softmax(s, axis=-1), 0.0)[..., :k.shape[2]]
    if dropout is not None:
        keep = keep_mask(dropout, *p.shape)
        p = jnp.where(keep, p * jnp.float32(dropout.scale), 0.0)
    out = tile_output(terms, p, v, m.q_pos, m.kv_pos)
    if not with_lse:
        return out
    seen = jnp.any(vis, axis=-1)  # s is finite where hidden: no inf - inf below
    mx = jax.lax.stop_gradient(jnp.max(s, axis=-1))
    den = jnp.sum(jnp.where(vis, jnp.exp(s - mx[..., None]), 0.0), axis=-1)
    return out, jnp.where(seen, mx + jnp.log(jnp.where(seen, den, 1.0)), -jnp.inf)


def heads_major(call: AttentionCall, *,
                repeat_kv: bool = True) -> tuple[jax.Array, jax.Array, jax.Array, Masking]:
    """``(qs, k, v, masking)`` of a (transformed) call in the engines' layout: float32
    ``[B, N, T, H]`` with the queries scaled, k and v repeated to the query heads when
    ``repeat_kv`` (grouped-query attention), and the call's :class:`Masking`."""
    to_bnth = lambda x: jnp.swapaxes(x.astype(jnp.float32), 1, 2)
    qs = to_bnth(call.q) * jnp.float32(call.scale)
    kk, vv = to_bnth(call.k), to_bnth(call.v)
    groups = call.num_heads // call.num_kv_heads
    if repeat_kv and groups > 1:
        kk = jnp.repeat(kk, groups, axis=1)
        vv = jnp.repeat(vv, groups, axis=1)
    kv_valid = None
    if call.kv_lengths is not None:  # a KV cache's fill counts
        kv_valid = jnp.arange(call.kv_len)[None, :] < call.kv_lengths[:, None]
        # Slots past the fill are not inputs: whatever they hold (a freed page's NaN) must
        # never meet a zero probability (0 * NaN = NaN), forward or backward. Fused into
        # the cast above: no extra pass over k and v.
        filled = kv_valid[:, None, :, None]
        kk, vv = jnp.where(filled, kk, 0.0), jnp.where(filled, vv, 0.0)
    m = Masking(call.q_positions, call.kv_positions, kv_valid, call.mask, call.segment_ids,
                call.kv_segment_ids)
    return qs, kk, vv, m


def _reference(call: AttentionCall, with_lse: bool):
    qs, kk, vv, m = heads_major(call)
    terms = call_terms(call, call.q_len, call.kv_len)
    return reference_attention(terms, qs, kk, vv, m, call.causal, call.sinks, call.dropout,
                               with_lse=with_lse)


def run_reference(call: AttentionCall) -> jax.Array:
    """The ``"reference"`` engine: ``[B, Tq, N, H_v]`` in q's dtype from a transformed
    call (:func:`jaxpos.core.call.transform_call`)."""
    out = cast("jax.Array", _reference(call, False))
    return jnp.swapaxes(out, 1, 2).astype(call.q.dtype)


class ReferenceEngine:
    """``implementation="reference"``: the dense ground truth (every feature; ``O(Tq Tk)``
    memory), never the default."""

    name = "reference"
    compiler_partitioned = True  # XLA operations: the compiler splits them under Auto axes
    replacing_form = "dense"  # stick-breaking, PaTH, CoPE: their whole score matrix

    def refuses(self, call: AttentionCall) -> None:
        """Nothing: the reference runs every validated call."""
        return None

    def run(self, call: AttentionCall) -> jax.Array:
        """:func:`run_reference`."""
        return run_reference(call)

    def run_with_lse(self, call: AttentionCall) -> tuple[jax.Array, jax.Array]:
        """``(out [B, Tq, N, H_v], lse float32 [B, N, Tq])`` (the sinks in the lse)."""
        out, lse = _reference(call, True)
        return jnp.swapaxes(out, 1, 2).astype(call.q.dtype), lse

    def ring_tile(self, call: AttentionCall) -> tuple[int, int]:
        """The ring runs this engine's tiles itself, one tile per (queries, block) pair."""
        return call.q_len, call.kv_len


register_engine(ReferenceEngine())
