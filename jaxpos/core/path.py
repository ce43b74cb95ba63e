"""PaTH attention (Yang, Shen, Wen, Tan, Mishra, Ren, Panda & Kim 2025, "PaTH Attention:
Position Encoding via Accumulating Householder Transformations", NeurIPS, arXiv:2505.16381).

Each token ``t`` carries a data-dependent generalised Householder transform
``H_t = I - beta_t w_t w_t^T`` (``w_t`` unit norm, ``beta_t in (0, 2)``), and the score
of query ``i`` and key ``j <= i`` is the query against the key moved through every
transform after it up to the query (§3.1, Eq. 2)::

    s_ij = q_i^T H_i H_{i-1} ... H_{j+1} k_j            (s_ii = q_i^T k_i),

so position is the accumulated product of the transforms between the two tokens
(RoPE is the special case of fixed, data-independent rotations). PaTH-FoX (§3.3) adds
the Forgetting Transformer's gate (Lin et al. 2025): with ``c_i = sum_{t <= i} log f_t``
the logit is ``scale * (s_ij + c_i - c_j)``; as in the authors' code
(flash-linear-attention, ``fla/ops/path_attn/naive.py``, ``naive_path_attn``, where the
gate's cumulative sum is added before the ``scale``), the forget term is scaled too.

Two forms, chosen by the engine's ``replacing_form`` capability
(:func:`jaxpos.core.engines.replacing_form`; the Pallas kernel and ``"xla"`` declare none
and are refused):

* dense (``implementation="reference"``): the scores by the explicit recurrence ``k_j <-
  H_t k_j`` applied to every earlier key at each step ``t`` (the paper's inference rule,
  §3.2 "Efficient inference"), dense ``[B, N, T, T]``, JAX autodiff;
* blocked (``"chunked"``, the default): the blockwise algorithm of §3.2: within a block of
  ``C`` tokens the product of the transforms has the compact WY / UT form (Joffrain et al.
  2006; Bischof & Van Loan 1987) ``H_C ... H_1 = I - W^T Y`` with ``Y = T diag(beta) W``,
  ``T = (I + diag(beta) strict_lower(W W^T))^{-1}``; queries absorb the transforms of
  their own block before them, keys those of their block after them, and a query block
  visits the key blocks right to left multiplying its queries by each block's ``I - W^T
  Y`` (``O(C^2 H)`` per tile), an online softmax over the tiles (``O(T)`` memory). Its
  backward pass is a custom VJP (:mod:`jaxpos.core.carried`) recomputing one query block
  at a time; the per-block WY preprocessing (``O(T C H)``) is differentiated by JAX.

Packed sequences: ``segment_ids`` (only equal ids interact); each segment's tokens must
be contiguous (the transforms between two tokens are those of the tokens between them).
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
from jaxpos.schemes.base import register_attention

__all__ = ["compute_dtype", "group_heads", "path_attention",
           "path_scores", "refuse_softmax_options", "scheme_attention", "softmax_rows",
           "wy_blocks"]

_BLOCK = 64
_NEG_INF = -jnp.inf
#: Why an engine of softmax attention only cannot run PaTH (its refusal's last sentence).
PATH_REFUSAL = ("PaTH's scores depend on the transforms of the tokens in between, not on "
                "a score_mod of positions.")


def compute_dtype(x: ArrayLike) -> jnp.dtype:
    """float32, or float64 for float64 inputs (the float64 checks): the dtype PaTH and
    CoPE compute in."""
    return jnp.promote_types(_checks.dtype_of(x), jnp.float32)


def softmax_rows(s: jax.Array) -> jax.Array:
    """``softmax(s)`` over the last axis with ``-inf`` for hidden entries; a row with no
    visible entry gives zeros (not NaN): the dense references of PaTH, CoPE and PaTH's
    decode step."""
    m = jnp.max(s, -1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    l = jnp.sum(p, -1, keepdims=True)
    return p / jnp.where(l > 0, l, 1.0)


def group_heads(x: ArrayLike, groups: int, dtype: Any) -> jax.Array:
    """``[B, T, N_kv, ...]`` -> ``[B, N_kv * groups, T, ...]`` in ``dtype``: each key head
    repeated for the ``groups`` query heads that share it (grouped-query attention)."""
    return jnp.repeat(jnp.swapaxes(jnp.asarray(x, dtype), 1, 2), groups, axis=1)


def _check_inputs(q, k, v, w, beta, log_forget, segment_ids):
    _checks.check_qkv(q, k, v)
    B, Tq, N, H = _checks.shape_of(q)
    _, Tk, Nk, _ = _checks.shape_of(k)
    if Tq != Tk:
        raise ValueError(f"path_attention is self-attention (the transforms of the tokens "
                         f"between a query and a key move the key): q and k need the same "
                         f"length; got q {(B, Tq, N, H)}, k {_checks.shape_of(k)}.")
    _checks.check_rank("w", w, (4,), "[B, T, N_kv, H]")
    _checks.check_floating("w", w)
    if _checks.shape_of(w) != (B, Tk, Nk, H):
        raise ValueError(f"w must have k's shape [B, T, N_kv, H] = {(B, Tk, Nk, H)}; got "
                         f"{_checks.shape_of(w)}.")
    _checks.check_rank("beta", beta, (3,), "[B, T, N_kv]")
    _checks.check_floating("beta", beta)
    if _checks.shape_of(beta) != (B, Tk, Nk):
        raise ValueError(f"beta must have shape [B, T, N_kv] = {(B, Tk, Nk)}; got "
                         f"{_checks.shape_of(beta)}.")
    if log_forget is not None:
        _checks.check_rank("log_forget", log_forget, (3,), "[B, T, N]")
        _checks.check_floating("log_forget", log_forget)
        if _checks.shape_of(log_forget) != (B, Tq, N):
            raise ValueError(f"log_forget must have shape [B, T, N] = {(B, Tq, N)} (one gate "
                             f"per query head); got {_checks.shape_of(log_forget)}.")
    if segment_ids is not None:
        _checks.check_integer_positions("segment_ids", segment_ids)
        if _checks.shape_of(segment_ids) != (B, Tq):
            raise ValueError(f"segment_ids must have shape [B, T] = [{B}, {Tq}]; got "
                             f"{_checks.shape_of(segment_ids)}.")


def path_scores(q: ArrayLike, k: ArrayLike, w: ArrayLike, beta: ArrayLike) -> jax.Array:
    """The PaTH scores ``s_ij = q_i^T H_i ... H_{j+1} k_j`` for ``j <= i`` (Yang et al.
    2025, Eq. 2), by the recurrence of the paper's inference rule: at each step ``t``
    every earlier key is updated ``k_j <- k_j - beta_t (w_t . k_j) w_t``.

    Args:
      q, k, w: float ``[B, N, T, H]`` (heads already matched); beta: float ``[B, N, T]``.

    Returns:
      ``[B, N, T, T]`` in :func:`compute_dtype` of q; entries with ``j > i`` are
      ``q_i . k_j`` (not a PaTH score: callers mask them).
    """
    ct = compute_dtype(q)
    q, k, w, beta = (jnp.asarray(x, ct) for x in (q, k, w, beta))
    T = q.shape[2]
    idx = jnp.arange(T)

    def step(ks, t):
        wt, bt = w[:, :, t], beta[:, :, t]
        proj = jnp.einsum("bnjh,bnh->bnj", ks, wt)
        upd = ks - (bt[..., None] * proj)[..., None] * wt[:, :, None, :]
        ks = jnp.where((idx < t)[None, None, :, None], upd, ks)
        return ks, jnp.einsum("bnh,bnjh->bnj", q[:, :, t], ks)

    _, rows = jax.lax.scan(step, k, idx)
    return jnp.moveaxis(rows, 0, 2)


def wy_blocks(q: jax.Array, k: jax.Array, w: jax.Array, beta: jax.Array,
              block: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The per-block quantities of the chunked algorithm (Yang et al. 2025, §3.2), for
    blocks of ``block`` tokens (``T`` a multiple of it).

    Args:
      q, k, w: float ``[B, N, T, H]``; beta: float ``[B, N, T]`` (one dtype).

    Returns:
      ``(q_t, k_t, y, a_local)`` with a block axis ``[B, N, n, C, ...]``: the queries
      moved through the transforms of their block up to themselves (``q_i^T H_i ...
      H_first``), the keys through those after them (``H_last ... H_{j+1} k_j``), ``Y``
      of the WY form ``H_last ... H_first = I - W^T Y``, and the within-block scores
      ``q_i^T H_i ... H_{j+1} k_j`` (``[.., C, C]``, zero above the diagonal).
    """
    split = lambda x: x.reshape(x.shape[:2] + (-1, block) + x.shape[3:])
    Q, K, W, b = split(q), split(k), split(w), split(beta)
    C = block
    lower = jnp.tril(jnp.ones((C, C), bool), -1)
    incl = jnp.tril(jnp.ones((C, C), bool))
    WW = jnp.einsum("...ch,...dh->...cd", W, W)
    A = jnp.eye(C, dtype=W.dtype) + jnp.where(lower, b[..., :, None] * WW, 0.0)
    eye = jnp.broadcast_to(jnp.eye(C, dtype=W.dtype), A.shape)
    Tm = jax.scipy.linalg.solve_triangular(A, eye, lower=True, unit_diagonal=True)
    bW = b[..., None] * W
    Y = jnp.einsum("...ts,...sh->...th", Tm, bW)
    D = jnp.einsum("...ts,...sj->...tj", Tm,
                   jnp.where(lower, jnp.einsum("...sh,...jh->...sj", bW, K), 0.0))
    QW = jnp.where(incl, jnp.einsum("...ih,...th->...it", Q, W), 0.0)
    q_t = Q - jnp.einsum("...it,...th->...ih", QW, Y)
    k_t = K - jnp.einsum("...tj,...th->...jh", D, W)
    a_local = jnp.where(incl, jnp.einsum("...ih,...jh->...ij", Q, K), 0.0) - \
        jnp.einsum("...it,...tj->...ij", QW, D)
    return q_t, k_t, Y, a_local


def _path_tile(scale, block, q_blk, kv_blk, qhat, qi, kj):
    """One tile of the chunked algorithm: the scores of query block ``qi`` (its queries
    moved through the key blocks right of ``kj``, ``qhat``) against key block ``kj``."""

    def live(_):
        cross = jnp.einsum("bnqh,bnkh->bnqk", qhat, kv_blk["k"])
        raw = jnp.where(qi == kj, q_blk["a"], cross)
        s = scale * (raw + q_blk["g"][..., None] - kv_blk["g"][..., None, :])
        ii = qi * block + jnp.arange(block)
        jj = kj * block + jnp.arange(block)
        vis = (q_blk["seg"][..., :, None] == kv_blk["seg"][..., None, :]) & \
            (ii[:, None] >= jj[None, :])
        moved = qhat - jnp.einsum("bnqt,bnth->bnqh",
                                  jnp.einsum("bnqh,bnth->bnqt", qhat, kv_blk["w"]),
                                  kv_blk["y"])
        return jnp.where(vis, s, _NEG_INF), jnp.where(kj < qi, moved, qhat)

    def dead(_):
        return jnp.full(q_blk["a"].shape, _NEG_INF, qhat.dtype), qhat

    return jax.lax.cond(kj <= qi, live, dead, None)


@functools.partial(jax.jit, static_argnums=(7, 8))
def _chunked(q, k, v, w, beta, G, seg, scale, block):
    """``[B, N, T, Hv]`` by the blockwise algorithm; inputs float32 ``[B, N, T, ...]``
    padded to whole blocks, ``G`` ``[B, N, T]``, ``seg`` int32 ``[B, 1, T]``."""
    q_t, k_t, Y, a_loc = wy_blocks(q, k, w, beta, block)
    lead = lambda x: jnp.moveaxis(x, 2, 0)  # block axis first
    q_blocks = {"q": lead(q_t), "a": lead(a_loc), "g": to_blocks(G, block, 2),
                "seg": to_blocks(seg, block, 2)}
    kv_blocks = {"k": lead(k_t), "w": to_blocks(w, block, 2), "y": lead(Y),
                 "g": to_blocks(G, block, 2), "seg": to_blocks(seg, block, 2)}
    tile = functools.partial(_path_tile, float(scale), int(block))
    o, _ = carried_attention(tile, _init_qhat, q_blocks, kv_blocks, to_blocks(v, block, 2),
                             block_q=block)
    return from_blocks(o, 2)


def _init_qhat(q_blk):
    return q_blk["q"]


@functools.partial(jax.jit, static_argnums=(7,))
def _reference(q, k, v, w, beta, G, seg, scale):
    s = path_scores(q, k, w, beta)
    s = scale * (s + G[..., :, None] - G[..., None, :])
    T = q.shape[2]
    vis = (seg[..., :, None] == seg[..., None, :]) & jnp.tril(jnp.ones((T, T), bool))
    return jnp.einsum("bnqk,bnkh->bnqh", softmax_rows(jnp.where(vis, s, _NEG_INF)), v)


def path_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, w: ArrayLike, beta: ArrayLike,
                   *, log_forget: ArrayLike | None = None, causal: bool = True,
                   segment_ids: ArrayLike | None = None, scale: float | None = None,
                   implementation: str | None = None,
                   block_size: int | None = None) -> jax.Array:
    """PaTH attention (Yang et al. 2025, arXiv:2505.16381, §3, Eq. 2), optionally with the
    forget gate of PaTH-FoX (§3.3).

    ``o_i = sum_{j <= i} softmax_j(scale * (q_i^T H_i ... H_{j+1} k_j + c_i - c_j)) v_j``
    with ``H_t = I - beta_t w_t w_t^T`` and ``c = cumsum(log_forget)`` (0 without it); the
    same numbers as the authors' ``naive_path_attn`` (flash-linear-attention).

    Args:
      q: ``[B, T, N, H]``; k: ``[B, T, N_kv, H]``; v: ``[B, T, N_kv, H_v]`` (one float
        dtype; ``N`` a multiple of ``N_kv``: grouped-query attention, each query head
        using the keys, values and transforms of its group, as flash-linear-attention).
      w: float ``[B, T, N_kv, H]``, the transforms' directions, used as given (the PaTH
        layer L2-normalises them; a non-unit ``w`` gives ``I - beta w w^T`` all the same).
      beta: float ``[B, T, N_kv]``, the transforms' strengths (the layer's ``2 *
        sigmoid``, in ``(0, 2)``).
      log_forget: float ``[B, T, N]`` or None: the log forget gates of PaTH-FoX (at most
        0; FoX's ``log_sigmoid``), per query head.
      causal: must be True (the product runs from the key to the query).
      segment_ids: int ``[B, T]`` or None: packed sequences, each contiguous (the
        transforms between two tokens are those of every token in between); only equal ids
        attend. Concrete ids are checked; traced ones (under ``jit``) must keep it too.
      scale: a static number, default ``1 / sqrt(H)``.
      implementation: an engine that declares ``replacing_form``
        (:func:`jaxpos.core.engines.replacing_form`): ``"reference"`` (dense),
        ``"chunked"`` (blockwise, ``O(T)`` memory, custom VJP) or None (blockwise). The
        Pallas kernel and ``"xla"`` do not run PaTH (its scores are not a score_mod of
        positions): ``ValueError``.
      block_size: the chunked block size ``C`` (default 64; any positive int).

    Returns:
      ``[B, T, N, H_v]`` in q's dtype (computed in float32; float64 for float64 inputs).

    Raises:
      ValueError: bad ranks or shapes (naming the argument), ``q`` and ``k`` of different
        lengths, ``causal=False``, an implementation that declares no ``replacing_form``
        (naming those that do), a non-positive block size, concrete ``segment_ids`` whose
        segment comes back after another one (``[0, 1, 0, 1, ...]``).
      TypeError: integer inputs, float segment ids, dtypes that differ, a traced scale.
    """
    _check_inputs(q, k, v, w, beta, log_forget, segment_ids)
    _checks.check_contiguous_segments("segment_ids", segment_ids)
    if causal is not True:
        raise ValueError(f"path_attention is causal by definition (Yang et al. 2025, Eq. 2: "
                         f"the transforms from the key up to the query); got causal="
                         f"{causal!r}.")
    form = engines.replacing_form("path_attention", implementation, PATH_REFUSAL)
    if block_size is not None:
        _checks.check_positive_int("block_size", block_size)
    B, T, N, H = _checks.shape_of(q)
    Nk = _checks.shape_of(k)[2]
    scale = static_scale("path_attention", scale, H)
    dtype = _checks.dtype_of(q)
    Hv = _checks.shape_of(v)[-1]
    if B == 0 or T == 0:
        return jnp.zeros((B, T, N, Hv), dtype)
    g, ct = N // Nk, compute_dtype(q)
    heads = lambda x: group_heads(x, g, ct)
    qq = jnp.swapaxes(jnp.asarray(q, ct), 1, 2)
    kk, vv, ww, bb = heads(k), heads(v), heads(w), heads(beta)
    if log_forget is None:
        G = jnp.zeros((B, N, T), ct)
    else:
        G = jnp.cumsum(jnp.swapaxes(jnp.asarray(log_forget, ct), 1, 2), -1)
    seg = jnp.zeros((B, 1, T), jnp.int32) if segment_ids is None else \
        jnp.asarray(segment_ids, jnp.int32)[:, None, :]
    if form == "dense":
        out = _reference(qq, kk, vv, ww, bb, G, seg, scale)
    else:
        C = min(block_size or _BLOCK, T)
        n = -(-T // C) * C
        # padding: w = beta = 0 (H = I) and a segment nobody else has
        pad = lambda x, axis: pad_axis(x, axis, n)
        segp = pad_axis(seg, 2, n, value=np.iinfo(np.int32).min)
        out = _chunked(pad(qq, 2), pad(kk, 2), pad(vv, 2), pad(ww, 2), pad(bb, 2),
                       pad_axis(G, 2, n, mode="edge"), segp, scale, C)[:, :, :T]
    return jnp.swapaxes(out, 1, 2).astype(dtype)


def refuse_softmax_options(what: str, mask, mask_mod, sinks, extra: dict) -> None:
    """``ValueError`` for the keywords of :func:`jaxpos.attention` that the schemes
    replacing softmax attention do not take (a mask array, a mask_mod, sinks, attention
    dropout); a dropout key without a rate and the cache's fill counts pass (the segment
    ids hide the empty slots)."""
    extra = dict(extra)
    rate = extra.pop("dropout_rate", 0.0)
    for key in ("dropout_rng", "broadcast_dropout", "kv_lengths"):
        extra.pop(key, None)
    named = {"mask": mask, "mask_mod": mask_mod, "sinks": sinks,
             "attention dropout": rate or None, **extra}
    for name, val in named.items():
        if val is not None:
            raise ValueError(f"{what} takes no {name} (a softmax-attention option of "
                             f"jaxpos.attention); got {name}={val!r}.")


@register_attention("path")
@register_attention("path_fox")
def scheme_attention(scheme, q: jax.Array, k: jax.Array, v: jax.Array, *,
                     position: Any = None, q_positions: Any = None, kv_positions: Any = None,
                     causal: bool = True, mask: Any = None, segment_ids: Any = None,
                     kv_segment_ids: Any = None, scale: float | None = None,
                     mask_mod: Any = None, sinks: Any = None,
                     implementation: str | None = None, **extra: Any) -> jax.Array:
    """:func:`path_attention` for the Flax modules: ``scheme`` (a
    :class:`jaxpos.schemes.path.PaTH`) gives the transforms (its ``directions`` from the
    call's segments, ``beta``, the forget gates), the rest are the keywords the modules
    pass to :func:`jaxpos.attention` (positions are not used: PaTH's position is the order
    of the tokens). ``implementation``: as :func:`path_attention`.

    Returns:
      ``[B, T, N, H_v]`` in q's dtype.

    Raises:
      ValueError: a ``mask``, ``mask_mod``, ``sinks``, attention dropout; ``kv_segment_ids``
        other than ``segment_ids``; keys with other than the scheme's ``num_kv_heads``
        heads; the errors of :func:`path_attention` (an implementation that declares no
        ``replacing_form``, naming those that do).
    """
    refuse_softmax_options("PaTH attention", mask, mask_mod, sinks, extra)
    scheme.check_causal(causal)
    if kv_segment_ids is not None and kv_segment_ids is not segment_ids:
        raise ValueError("PaTH attention is self-attention: kv_segment_ids must be None or "
                         "segment_ids.")
    scheme.check_kv_heads(k.shape[2])
    w = scheme.directions(segment_ids)
    lf = scheme.log_forget
    return path_attention(q, k, v, w.astype(q.dtype), scheme.beta.astype(q.dtype),
                          log_forget=None if lf is None else lf.astype(q.dtype),
                          segment_ids=segment_ids, scale=scale, implementation=implementation)
