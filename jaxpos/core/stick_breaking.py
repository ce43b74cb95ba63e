"""Stick-breaking attention (Tan, Shen, Yang, Courville & Panda 2025, "Scaling Stick-Breaking
Attention: An Efficient Implementation and In-depth Study", ICLR, arXiv:2410.17980, §2).

Softmax attention normalises over every key; stick-breaking attention lets the keys
nearest to the query claim the attention first. With ``z_ij = scale * q_i . k_j`` and
``beta_ij = sigmoid(z_ij)``, the weight of key ``j`` for query ``i`` is what is left of a
unit "stick" after the keys between them took their share::

    A_ij = beta_ij * prod_{j < k < i} (1 - beta_ik),                    (§2, Eq. 1)
    log A_ij = log sigmoid(z_ij) - sum_{j < k < i} softplus(z_ik),

computed in log space (``1 - sigmoid(z) = sigmoid(-z)``, ``-log sigmoid(-z) =
softplus(z)``). No softmax normalisation: the weights sum to ``1 - prod_k (1 - beta_ik)
<= 1``. Position is implicit in the ordering, so no position scheme is needed.

The diagonal, as the authors' code does (github.com/shawntan/stickbreaking-attention:
``sb_attn(..., attend_current=False)`` masks ``j >= i``, and every model and test there adds
``rem[..., None] * v``):

* ``attend_current=False`` (default): keys strictly before the query, ``j < i``;
  ``attend_current=True``: the query's own key is the first one to break the stick,
  ``A_ii = beta_ii``, and every earlier key is also multiplied by ``1 - beta_ii``;
* ``remainder=True`` (default): the part of the stick no key took, ``rem_i = 1 - sum_j
  A_ij = prod_k (1 - beta_ik)``, goes to the query's own value: ``o_i = sum_j A_ij v_j +
  rem_i v_i`` (the authors' ``o + rem * v``). ``remainder=False`` drops it.

"The query's own key/value" is the key at the query's position in the same segment
(``kv_pos == q_pos``): self-attention and KV-cache decoding (where the new token's key is
in the cache) have it; a query without one gets no remainder. "Between" follows the key
axis order, so keys must be sorted by position along their axis (as in a sequence or a
cache). Stick-breaking is causal by definition: ``causal=False`` is refused.

Two forms, chosen by the engine's ``replacing_form`` capability
(:func:`jaxpos.core.engines.replacing_form`): dense (``implementation="reference"``: the
``[B, N, Tq, Tk]`` log weights, JAX autodiff) and blocked (``"chunked"``, the default:
tiles, key blocks visited right to left carrying the running sum of ``softplus`` per
query, ``O(T)`` memory; a custom VJP recomputes the tiles right to left again, with the
running sums of ``softplus`` and of ``A_ij (do_i . v_j)``, the latter closed by ``do_i .
o_i`` as FlashAttention's ``delta``). An engine without the capability (the Pallas
kernel, ``"xla"``) is refused.

The scheme object
(:class:`jaxpos.schemes.stick_breaking.StickBreaking`, ``position="stick_breaking"`` in the
Flax modules) is in the schemes room; :func:`scheme_attention` is the attention its
``replaces_softmax`` names (registered with :func:`jaxpos.schemes.base.register_attention`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos.core import engines
from jaxpos.schemes.base import register_attention

__all__ = ["scheme_attention", "stick_breaking_attention", "stick_breaking_weights"]

_BLOCK = 128
_NEG_INF = -jnp.inf


def _pair_terms(s, qp, kp, qseg, kseg, attend_current):
    """For scores ``s`` ``[..., tq, tk]`` (float32) and positions/segments broadcastable to
    it: ``a = log sigmoid(s)`` where the key may take a share (else -inf), ``b =
    softplus(s)`` where it breaks the stick for the keys to its left (else 0), and the
    bool mask of the query's own key."""
    same = qseg == kseg
    before = same & (kp < qp)
    diag = same & (kp == qp)
    takes = (before | diag) if attend_current else before
    a = jnp.where(takes, jax.nn.log_sigmoid(s), _NEG_INF)
    b = jnp.where(takes, jax.nn.softplus(s), 0.0)
    return a, b, diag, takes


def _exclusive_suffix_sum(b):
    """``R_ij = sum_{k > j} b_ik`` along the last axis."""
    return jnp.flip(jnp.cumsum(jnp.flip(b, -1), -1), -1) - b


def stick_breaking_weights(scores: ArrayLike, q_positions: jax.Array, kv_positions: jax.Array, *,
                           segment_ids: jax.Array | None = None,
                           kv_segment_ids: jax.Array | None = None, attend_current: bool = False,
                           remainder: bool = True) -> jax.Array:
    """The dense stick-breaking weights (Tan et al. 2025, Eq. 1) from scaled scores.

    Args:
      scores: float ``[B, N, Tq, Tk]``, ``scale * q . k``.
      q_positions, kv_positions: int32 ``[B|1, Tq]`` / ``[B|1, Tk]``, keys sorted by position.
      segment_ids, kv_segment_ids: int ``[B, Tq]`` / ``[B, Tk]`` or None.
      attend_current, remainder: the diagonal conventions of the module docstring.

    Returns:
      float32 ``[B, N, Tq, Tk]``: ``A_ij``, plus ``rem_i`` on the query's own key when
      ``remainder``; each row sums to 1 when the query's own key is present and
      ``remainder`` is on.
    """
    s = jnp.asarray(scores, jnp.float32)
    qp = q_positions[:, None, :, None]
    kp = kv_positions[:, None, None, :]
    qseg = 0 if segment_ids is None else segment_ids[:, None, :, None]
    kseg = 0 if kv_segment_ids is None else kv_segment_ids[:, None, None, :]
    a, b, diag, _ = _pair_terms(s, qp, kp, qseg, kseg, attend_current)
    w = jnp.exp(a - _exclusive_suffix_sum(b))
    if remainder:
        w = w + jnp.where(diag, jnp.exp(-jnp.sum(b, -1, keepdims=True)), 0.0)
    return w


# ---- chunked: right to left over key blocks, O(T) memory, custom VJP ------------------
def _blocks(x, size, axis):
    """Split ``axis`` of ``x`` into ``[n_blocks, ..., size, ...]`` (leading block axis)."""
    n = x.shape[axis] // size
    x = jnp.moveaxis(x, axis, 0).reshape((n, size) + tuple(np.delete(x.shape, axis)))
    return jnp.moveaxis(x, 1, axis + 1)


def _tile(q, k, qp, kp, qs, ks, scale, attend_current, S):
    """Scores and log weights of one tile given ``S`` ``[B, N, bq]``, the sum of ``b`` over
    the keys to the tile's right."""
    s = jnp.einsum("bnqh,bnkh->bnqk", q, k) * scale
    a, b, diag, takes = _pair_terms(s, qp[:, None, :, None], kp[:, None, None, :],
                                    qs[:, None, :, None], ks[:, None, None, :], attend_current)
    logw = a - (S[..., None] + _exclusive_suffix_sum(b))
    return s, b, diag, takes, jnp.exp(logw)


def _forward(q, k, v, qp, kp, qs, ks, scale, attend_current, bq, bk):
    """``(o, S, vdiag)``: ``o = sum_j A_ij v_j`` ``[B, N, Tq, Hv]``, ``S_i = sum_j b_ij``
    ``[B, N, Tq]`` and the query's own value ``[B, N, Tq, Hv]`` (0 if absent)."""
    kb, vb = _blocks(k, bk, 2), _blocks(v, bk, 2)
    kpb, ksb = _blocks(kp, bk, 1), _blocks(ks, bk, 1)

    def per_q_block(args):
        qi, qpi, qsi = args
        B, N, tq, _ = qi.shape
        init = (jnp.zeros((B, N, tq, v.shape[-1]), jnp.float32),
                jnp.zeros((B, N, tq), jnp.float32),
                jnp.zeros((B, N, tq, v.shape[-1]), jnp.float32))

        def step(carry, blk):
            o, S, vd = carry
            kj, vj, kpj, ksj = blk
            _, b, diag, _, w = _tile(qi, kj, qpi, kpj, qsi, ksj, scale, attend_current, S)
            o = o + jnp.einsum("bnqk,bnkh->bnqh", w, vj)
            vd = vd + jnp.einsum("bnqk,bnkh->bnqh", diag.astype(jnp.float32) *
                                 jnp.ones_like(w), vj)
            return (o, S + jnp.sum(b, -1), vd), None

        (o, S, vd), _ = jax.lax.scan(step, init, (kb, vb, kpb, ksb), reverse=True)
        return o, S, vd

    qb = (_blocks(q, bq, 2), _blocks(qp, bq, 1), _blocks(qs, bq, 1))
    o, S, vd = jax.lax.map(per_q_block, qb)
    unblock = lambda x: jnp.moveaxis(x, 0, 2).reshape(x.shape[1:3] + (-1,) + x.shape[4:])
    return unblock(o), unblock(S), unblock(vd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _chunked_core(q, k, v, qp, kp, qs, ks, scale, attend_current, bq, bk):
    return _forward(q, k, v, qp, kp, qs, ks, scale, attend_current, bq, bk)


def _core_fwd(q, k, v, qp, kp, qs, ks, scale, attend_current, bq, bk):
    out = _forward(q, k, v, qp, kp, qs, ks, scale, attend_current, bq, bk)
    return out, (q, k, v, qp, kp, qs, ks, out[0])


def _core_bwd(scale, attend_current, bq, bk, res, cts):
    q, k, v, qp, kp, qs, ks, o = res
    do, dS, dvd = cts
    delta = jnp.sum(do * o, -1)  # sum_j A_ij (do_i . v_j)
    kb, vb = _blocks(k, bk, 2), _blocks(v, bk, 2)
    kpb, ksb = _blocks(kp, bk, 1), _blocks(ks, bk, 1)

    def per_q_block(carry, args):
        dk_all, dv_all = carry
        qi, qpi, qsi, doi, dSi, dvdi, deltai = args

        def step(c, blk):
            S, G, dq = c
            kj, vj, kpj, ksj = blk
            s, b, diag, takes, w = _tile(qi, kj, qpi, kpj, qsi, ksj, scale, attend_current, S)
            g = jnp.einsum("bnqh,bnkh->bnqk", doi, vj)
            Gt = w * g
            incl_suffix = jnp.flip(jnp.cumsum(jnp.flip(Gt, -1), -1), -1)  # sum_{m >= j}
            P = deltai[..., None] - G[..., None] - incl_suffix  # sum_{m < j} G_m
            sig = jax.nn.sigmoid(s)
            ds = jnp.where(takes, Gt * (1.0 - sig) - sig * P + dSi[..., None] * sig, 0.0)
            dq = dq + scale * jnp.einsum("bnqk,bnkh->bnqh", ds, kj)
            dk = scale * jnp.einsum("bnqk,bnqh->bnkh", ds, qi)
            dv = jnp.einsum("bnqk,bnqh->bnkh", w, doi) + jnp.einsum(
                "bnqk,bnqh->bnkh", diag.astype(jnp.float32) * jnp.ones_like(w), dvdi)
            return (S + jnp.sum(b, -1), G + jnp.sum(Gt, -1), dq), (dk, dv)

        B, N, tq, H = qi.shape
        init = (jnp.zeros((B, N, tq), jnp.float32), jnp.zeros((B, N, tq), jnp.float32),
                jnp.zeros((B, N, tq, H), jnp.float32))
        (_, _, dq), (dk, dv) = jax.lax.scan(step, init, (kb, vb, kpb, ksb), reverse=True)
        dk_all = dk_all + jnp.moveaxis(dk, 0, 2).reshape(dk_all.shape)
        dv_all = dv_all + jnp.moveaxis(dv, 0, 2).reshape(dv_all.shape)
        return (dk_all, dv_all), dq

    args = (_blocks(q, bq, 2), _blocks(qp, bq, 1), _blocks(qs, bq, 1), _blocks(do, bq, 2),
            _blocks(dS, bq, 2), _blocks(dvd, bq, 2), _blocks(delta, bq, 2))
    (dk, dv), dq = jax.lax.scan(per_q_block, (jnp.zeros_like(k), jnp.zeros_like(v)), args)
    dq = jnp.moveaxis(dq, 0, 2).reshape(q.shape)
    zero_int = lambda x: np.zeros(x.shape, jax.dtypes.float0)
    return dq, dk, dv, zero_int(qp), zero_int(kp), zero_int(qs), zero_int(ks)


_chunked_core.defvjp(_core_fwd, _core_bwd)


def _pad_to(x, size, axis, value=0):
    pad = (-x.shape[axis]) % size
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def stick_breaking_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
                             q_positions: ArrayLike | None = None,
                             kv_positions: ArrayLike | None = None,
                             segment_ids: ArrayLike | None = None,
                             kv_segment_ids: ArrayLike | None = None,
                             scale: ArrayLike | None = None, attend_current: bool = False,
                             remainder: bool = True, implementation: str | None = None,
                             block_q: int | None = None,
                             block_k: int | None = None) -> jax.Array:
    """Stick-breaking attention (Tan et al. 2025, §2, Eq. 1), in log space.

    ``o_i = sum_j A_ij v_j (+ rem_i v_i)`` with ``A_ij = sigmoid(z_ij) prod_{j<k<i}
    sigmoid(-z_ik)``, ``z = scale * q . k``; see the module docstring for the diagonal
    (``attend_current``, ``remainder``: the authors' defaults).

    Args:
      q: ``[B, Tq, N, H]``; k: ``[B, Tk, N_kv, H]``; v: ``[B, Tk, N_kv, H_v]`` (float;
        ``N`` a multiple of ``N_kv``: grouped-query attention).
      causal: must be True (stick-breaking orders the keys before the query).
      q_positions, kv_positions: integer ``[T]`` or ``[B, T]``; default ``arange``, queries
        aligned to the end of the keys. Keys must be sorted by position along their axis.
      segment_ids, kv_segment_ids: integer ``[B, Tq]`` / ``[B, Tk]``: packed sequences
        (``kv_segment_ids`` defaults to ``segment_ids``); restart positions per segment or
        not, only equal ids interact.
      scale: default ``1 / sqrt(H)``.
      attend_current: the query's own key takes a share first (default False, as the
        authors' ``sb_attn``).
      remainder: add ``rem_i v_i`` (default True, as the authors' models).
      implementation: an engine that declares ``replacing_form``
        (:func:`jaxpos.core.engines.replacing_form`): ``"reference"`` (dense),
        ``"chunked"`` (blocked: ``O(T)`` memory, custom VJP), or None (blocked).
      block_q, block_k: chunked tile sizes (default 128; any positive int).

    Returns:
      ``[B, Tq, N, H_v]`` in q's dtype (computed in float32).

    Raises:
      ValueError: ``causal=False``; bad ranks or mismatched shapes; positions or segment
        ids of the wrong shape; an unknown implementation or one that declares no
        ``replacing_form`` (naming those that do); non-positive block sizes.
      TypeError: float positions or segment ids; a non-real scale.
    """
    _checks.check_qkv(q, k, v)
    if causal is not True:
        raise ValueError(f"stick_breaking_attention is causal by definition (Tan et al. 2025, "
                         f"§2: the keys before the query break the stick); got causal="
                         f"{causal!r}.")
    form = engines.replacing_form(
        "stick_breaking_attention", implementation,
        "Its weights break a stick along the keys between the key and the query, which "
        "no score_mod of positions expresses.")
    B, Tq, N, H = q.shape
    Tk = k.shape[1]
    qp, kp, qs, ks = _positions_and_segments(q_positions, kv_positions, segment_ids,
                                             kv_segment_ids, B, Tq, Tk)
    scale = _static_scale(scale, H)
    for name, blk in (("block_q", block_q), ("block_k", block_k)):
        if blk is not None:
            _checks.check_positive_int(name, blk)
    if B == 0 or Tq == 0:
        return jnp.zeros((B, Tq, N, v.shape[-1]), q.dtype)
    g = N // k.shape[2]
    to_bnth = lambda x: jnp.swapaxes(jnp.asarray(x, jnp.float32), 1, 2)
    qq, kk, vv = to_bnth(q), to_bnth(k), to_bnth(v)
    if g > 1:
        kk, vv = jnp.repeat(kk, g, axis=1), jnp.repeat(vv, g, axis=1)
    if form == "dense" or Tk == 0:
        s = jnp.einsum("bnqh,bnkh->bnqk", qq, kk) * scale
        w = stick_breaking_weights(s, qp, kp, segment_ids=jnp.broadcast_to(qs, (B, Tq)),
                                   kv_segment_ids=jnp.broadcast_to(ks, (B, Tk)),
                                   attend_current=attend_current, remainder=remainder)
        out = jnp.einsum("bnqk,bnkh->bnqh", w, vv)
    else:
        out = _chunked(qq, kk, vv, qp, kp, qs, ks, scale, attend_current, remainder,
                       min(block_q or _BLOCK, Tq), min(block_k or _BLOCK, Tk))
    return jnp.swapaxes(out, 1, 2).astype(q.dtype)


def _positions_and_segments(q_positions, kv_positions, segment_ids, kv_segment_ids, B, Tq, Tk):
    """Checked int32 ``(q_pos [B|1, Tq], kv_pos [B|1, Tk], q_seg, kv_seg)``; default
    positions ``arange``, queries aligned to the end of the keys (decoding); default
    segments one segment (``[1, T]`` zeros)."""
    dkv_pos = jnp.arange(Tk, dtype=jnp.int32)
    dq_pos = jnp.arange(Tq, dtype=jnp.int32) + max(Tk - Tq, 0)
    qp = _checks.positions_2d("q_positions", dq_pos if q_positions is None else q_positions,
                              B, Tq)
    kp = _checks.positions_2d("kv_positions", dkv_pos if kv_positions is None else
                              kv_positions, B, Tk)
    if kv_segment_ids is None:
        kv_segment_ids = segment_ids
    if (segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("kv_segment_ids needs segment_ids (the queries' segments) too.")
    if segment_ids is None:
        return qp, kp, jnp.zeros((1, Tq), jnp.int32), jnp.zeros((1, Tk), jnp.int32)
    for name, seg, T in (("segment_ids", segment_ids, Tq), ("kv_segment_ids",
                                                           kv_segment_ids, Tk)):
        _checks.check_integer_positions(name, seg)
        if _checks.shape_of(seg) != (B, T):
            raise ValueError(f"{name} must have shape [B, T] = [{B}, {T}]; got "
                             f"{_checks.shape_of(seg)}.")
    return qp, kp, jnp.asarray(segment_ids, jnp.int32), jnp.asarray(kv_segment_ids, jnp.int32)


def _static_scale(scale, H: int) -> float:
    """The score scale as a Python float (default ``1 / sqrt(H)``); a traced one is refused
    (it is a static argument of the custom VJP)."""
    if scale is None:
        return 1.0 / float(np.sqrt(H))
    if not _checks.is_concrete(scale):
        raise TypeError("stick_breaking_attention needs a static scale (a Python or concrete "
                        "number); got a traced one.")
    return float(_checks.check_real("scale", scale))


def _chunked(qq, kk, vv, qp, kp, qs, ks, scale, attend_current, remainder, bq, bk):
    """The chunked path on ``[B, N, T, H]`` float32 operands: whole tiles (padded keys and
    queries get segments no one else has), the custom-VJP core, then the remainder."""
    B, _, Tq, _ = qq.shape
    Tk = kk.shape[2]
    qpad = _pad_to(jnp.broadcast_to(qp, (B, Tq)), bq, 1)
    kpad = _pad_to(jnp.broadcast_to(kp, (B, Tk)), bk, 1)
    qspad = _pad_to(jnp.broadcast_to(qs, (B, Tq)), bq, 1, value=np.iinfo(np.int32).min)
    kspad = _pad_to(jnp.broadcast_to(ks, (B, Tk)), bk, 1, value=np.iinfo(np.int32).max)
    o, S, vd = _chunked_core(  # pyright: ignore[reportGeneralTypeIssues]
        _pad_to(qq, bq, 2), _pad_to(kk, bk, 2), _pad_to(vv, bk, 2), qpad, kpad, qspad, kspad,
        float(scale), bool(attend_current), bq, bk)
    if remainder:
        o = o + jnp.exp(-S)[..., None] * vd
    return o[:, :, :Tq]


@register_attention("stick_breaking")
def scheme_attention(scheme: Any, q: jax.Array, k: jax.Array, v: jax.Array, *,
                     position: Any = None, q_positions: ArrayLike | None = None,
                     kv_positions: ArrayLike | None = None, causal: bool = True,
                     mask: ArrayLike | None = None, segment_ids: ArrayLike | None = None,
                     kv_segment_ids: ArrayLike | None = None, scale: ArrayLike | None = None,
                     mask_mod: Any = None, sinks: ArrayLike | None = None,
                     implementation: str | None = None) -> jax.Array:
    """:func:`stick_breaking_attention` with the diagonal conventions of ``scheme`` (a
    :class:`jaxpos.schemes.stick_breaking.StickBreaking`) and the keywords the Flax modules
    pass to :func:`jaxpos.attention` (``position`` is ignored: the scheme is ``scheme``);
    an ``implementation`` that declares no ``replacing_form`` (the modules' softmax
    engine, e.g. the Pallas kernel) runs the blocked form, as None does.

    Returns:
      ``[B, Tq, N, H_v]`` in q's dtype.

    Raises:
      ValueError: a ``mask``, ``mask_mod`` or ``sinks`` (softmax notions it does not take);
        ``causal=False``; the errors of :func:`stick_breaking_attention`.
    """
    for name, val in (("mask", mask), ("mask_mod", mask_mod), ("sinks", sinks)):
        if val is not None:
            raise ValueError(f"stick-breaking attention takes no {name} (a softmax-"
                             f"attention option); got one.")
    scheme.check_causal(causal)
    return stick_breaking_attention(
        q, k, v, causal=True, q_positions=q_positions, kv_positions=kv_positions,
        segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, scale=scale,
        attend_current=scheme.attend_current, remainder=scheme.remainder,
        implementation=implementation if implementation is not None and engines.capability(
            implementation, "replacing_form") is not None else None)
