"""Context parallelism: ring attention with global positions, on ``jax.shard_map``.

Each device holds ``T / P`` consecutive (or zigzag-ordered) tokens of q, k and v and
their *global* positions. :func:`ring_attention` passes the key/value blocks around
the ring of the ``P`` devices of one mesh axis (``jax.lax.ppermute``), each device's
queries attending to every block as it passes (Liu, Zaharia & Abbeel 2023, "Ring
Attention with Blockwise Transformers for Near-Infinite Context", §3). Per-device
memory is ``O(T / P)``: no device ever holds more than two key/value blocks.

Every position scheme works as in the single-device :func:`jaxpos.attention`, because
every term is computed from positions and the positions travel with their block:

* the scheme's per-token transform (RoPE and its scalings, xPos) runs once on the local
  q and k at their global positions, before the ring;
* the scheme's score term and the user's score_mod and mask_mod (ALiBi, T5, KERPLE,
  FIRE, Sandwich, FoX, captured tables, sliding windows, ...) and Shaw's content bias and
  value term are evaluated per tile by the chunked path's machinery
  (``jaxpos.core.chunked.chunked_forward`` / ``chunked_backward``), with the passing
  block's global key positions (with ``implementation="pallas"``, each block is one call
  of the fused kernel instead: :mod:`jaxpos.parallel.engine_ring`);
* the per-block outputs and log-sum-exps are merged exactly by log-sum-exp (the online
  softmax of Milakov & Gimelshein 2018 applied across blocks), the attention sinks
  joining the normaliser once, at the end.

The backward pass is a ``jax.custom_vjp``: the FlashAttention-2 backward (Dao 2023,
Alg. 2) needs only the *global* output and log-sum-exp of each query row, so every
device recomputes each passing block's tiles with them, accumulates ``dq`` locally and
adds its share of ``dk``/``dv`` to accumulators that travel with the block and arrive
back at the block's owner after ``P`` hops. Gradients of replicated parameters (the T5
table, ALiBi slopes, KERPLE/FIRE parameters, score_mod captures, sinks) are summed over
the devices (``psum`` over the axes the parameter does not vary over).

Causal load balancing: with a contiguous layout, device ``i`` sees ``i + 1`` of the
``P`` blocks (the others are hidden by the causal mask and skipped with ``lax.cond``),
so the last device does ``P`` times the first one's work. :func:`to_zigzag` lays the
sequence out so that device ``i`` holds chunks ``i`` and ``2P - 1 - i`` of ``2P``
(Brandon et al. 2023, "Striped Attention", discuss the same imbalance; the zigzag
layout is the one of Megatron-LM's context parallelism and zhuzilin/ring-flash-attention):
every device then has the same number of visible tiles. Because masks are computed from
positions, a zigzag layout needs nothing but its positions: pass them
(:func:`zigzag_permutation` gives them).

See docs/parallel.md for when to use the batch, head, all-gather and ring layouts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos._util import match_vma, ring_shift, sink_gradient, zero_cotangent
from jaxpos.core import engines
from jaxpos.core.call import AttentionCall, validate_call
from jaxpos.core.chunked import (
    Blocked,
    ChunkCfg,
    chunk_inputs,
    chunked_backward,
    chunked_forward,
    merge_terms,
    split_terms,
    tile_kind,
    unblocks,
    varying_zero,
)
from jaxpos.core.reference import heads_major, make_terms
from jaxpos.core.tiles import fold_sinks, lse_merge
from jaxpos.mods import EMPTY
from jaxpos.parallel.engine_ring import engine_ring, ring_engine
from jaxpos.schemes.base import PositionScheme

__all__ = ["from_zigzag", "ring_attention", "shard_map", "to_zigzag", "zigzag_permutation"]

#: ``jax.shard_map`` (kept here so that examples and tests have one import).
shard_map = jax.shard_map

_NEG_INF = -jnp.inf


# ----------------------------------------------------------------------------- zigzag
def _check_zigzag_args(T, num_devices, t_name="T"):
    T = _checks.check_positive_int(t_name, T)
    num_devices = _checks.check_positive_int("num_devices", num_devices)
    if T % (2 * num_devices):
        raise ValueError(
            f"{t_name}={T} is not divisible by 2 * num_devices = {2 * num_devices}: the zigzag "
            f"layout cuts the sequence into 2 * num_devices equal chunks (device i holds chunks "
            f"i and {2 * num_devices - 1} - i). Pad the sequence to a multiple of "
            f"{2 * num_devices}.")
    return T, num_devices


def zigzag_permutation(T: int, num_devices: int) -> np.ndarray:
    """The zigzag (load-balanced causal) order of ``T`` tokens over ``num_devices`` devices.

    The sequence is cut into ``2P`` equal chunks (``P = num_devices``); device ``i`` holds
    chunk ``i`` followed by chunk ``2P - 1 - i``, so every device holds as many early
    (cheap) as late (expensive) query rows under a causal mask. ``perm[j]`` is the
    original index of the token at zigzag index ``j``: ``x_zigzag = x[perm]``. Since
    default positions are ``arange(T)``, ``perm`` is also the global positions of the
    tokens in zigzag order (pass it, sharded like q, as ``q_positions`` / ``kv_positions``).

    Args:
      T: the global sequence length (positive int, a multiple of ``2 * num_devices``).
      num_devices: ``P``, the size of the mesh axis the sequence is sharded over.

    Returns:
      int32 NumPy array ``[T]``, a permutation of ``arange(T)``.

    Raises:
      TypeError / ValueError: ``T`` or ``num_devices`` not a positive int; ``T`` not
        divisible by ``2 * num_devices``.
    """
    T, P = _check_zigzag_args(T, num_devices)
    c = T // (2 * P)
    chunks = np.arange(T, dtype=np.int32).reshape(2 * P, c)
    order = np.stack([np.arange(P), 2 * P - 1 - np.arange(P)], axis=1).reshape(-1)
    return chunks[order].reshape(-1)


def _zigzag_take(name, x, axis, num_devices, inverse):
    x = jnp.asarray(x) if not hasattr(x, "shape") else x
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise TypeError(f"axis must be an int; got {type(axis).__name__} {axis!r}.")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis={axis} is out of range for {name} of shape {tuple(x.shape)} "
                         f"(rank {x.ndim}).")
    axis = int(axis) % x.ndim
    perm = _zigzag_permutation_checked(x.shape[axis], num_devices,
                                      f"{name}.shape[{axis}] (the sequence length)")
    if inverse:
        perm = np.argsort(perm).astype(np.int32)
    return jnp.take(x, jnp.asarray(perm), axis=axis)


def _zigzag_permutation_checked(T, num_devices, t_name):
    """:func:`zigzag_permutation` with the length's error message naming ``t_name``."""
    _check_zigzag_args(T, num_devices, t_name)
    return zigzag_permutation(T, num_devices)


def to_zigzag(x: ArrayLike, axis: int, num_devices: int) -> jax.Array:
    """Reorder the sequence axis of ``x`` into the zigzag layout (see
    :func:`zigzag_permutation`): sharding the result's ``axis`` over ``num_devices``
    devices gives device ``i`` chunks ``i`` and ``2P - 1 - i``.

    Apply it to q, k, v, positions and segment ids alike (a positions array in zigzag
    order is the global positions the ring needs); :func:`from_zigzag` undoes it.

    Args:
      x: an array whose ``axis`` is the global sequence (length a multiple of
        ``2 * num_devices``); any dtype.
      axis: the sequence axis (negative counts from the end).
      num_devices: ``P``.

    Returns:
      ``x`` reordered along ``axis`` (same shape and dtype).

    Raises:
      TypeError / ValueError: ``axis`` not an int or out of range; the length of ``axis``
        not divisible by ``2 * num_devices``.
    """
    return _zigzag_take("x", x, axis, num_devices, inverse=False)


def from_zigzag(x: ArrayLike, axis: int, num_devices: int) -> jax.Array:
    """The inverse of :func:`to_zigzag`: zigzag order back to sequence order (e.g. the
    output of :func:`ring_attention` gathered from the devices).

    Args / Returns / Raises: as :func:`to_zigzag`.
    """
    return _zigzag_take("x", x, axis, num_devices, inverse=True)


# ---------------------------------------------------------------------- validation
def _bound_axes() -> tuple:
    """Mesh axes bound by the enclosing ``shard_map`` (best effort; () if unknown)."""
    try:
        mesh = jax.sharding.get_abstract_mesh()
        return tuple(getattr(mesh, "manual_axes", None) or getattr(mesh, "axis_names", ()) or ())
    except Exception:  # noqa: BLE001 - only used to word an error message
        return ()


def bound_axis_size(axis_name: Any, caller: str = "ring_attention") -> int:
    """The size of the bound mesh axis ``axis_name``, or a clear ValueError/TypeError
    naming ``caller`` (the public function that needs the axis)."""
    if not isinstance(axis_name, str):
        raise TypeError(f"axis_name must be the name (a str) of the mesh axis the sequence is "
                        f"sharded over; got {type(axis_name).__name__} {axis_name!r}.")
    try:
        return int(jax.lax.axis_size(axis_name))
    except NameError:
        bound = _bound_axes()
        if bound:
            raise ValueError(
                f"axis_name={axis_name!r} is not an axis of the enclosing shard_map's mesh "
                f"(its axes: {list(bound)}); pass the name of the axis the sequence is sharded "
                f"over.") from None
        raise ValueError(
            f"{caller} must be called inside jax.shard_map with axis_name={axis_name!r} "
            f"an axis of its mesh (the sequence sharded over it); the axis is not bound here. "
            f"Wrap the call: jaxpos.parallel.shard_map(f, mesh=mesh, in_specs=..., "
            f"out_specs=...).") from None


# ------------------------------------------------------------------ global transform
def transform_global(scheme: PositionScheme, q: jax.Array, k: jax.Array, q_pos: jax.Array,
                     kv_pos: jax.Array, axis_name: Any) -> tuple[jax.Array, jax.Array]:
    """``scheme.transform_qk`` on the local q and k at their global positions, as the
    single-device call applies it to the whole sequence.

    A transform may depend on the call's positions as a whole through their extremes
    (dynamic NTK / LongRoPE: ``max(positions) + 1``; xPos: the centre of the smallest and
    largest position). Two phantom tokens at the global smallest and largest positions
    (``pmin``/``pmax`` over ``axis_name``, per batch row) are appended to the local q
    and k for the transform and dropped after, so each device sees the global extremes.
    Per-token transforms (RoPE with a fixed scaling) are unaffected."""
    if type(scheme).transform_qk is PositionScheme.transform_qk:
        return q, k
    ends = lambda f, x: f(x, axis=-1, keepdims=True)
    lo = jnp.minimum(ends(jnp.min, q_pos), ends(jnp.min, kv_pos))
    hi = jnp.maximum(ends(jnp.max, q_pos), ends(jnp.max, kv_pos))
    lo, hi = jax.lax.pmin(lo, axis_name), jax.lax.pmax(hi, axis_name)  # [B|1, 1]
    ext = jnp.concatenate([lo, hi], axis=-1)

    def aug(x, pos):
        rows = max(pos.shape[0], ext.shape[0])
        pos = jnp.concatenate([jnp.broadcast_to(pos, (rows, pos.shape[1])),
                               jnp.broadcast_to(ext, (rows, 2))], axis=-1)
        pad = jnp.zeros((x.shape[0], 2) + x.shape[2:], x.dtype)
        return jnp.concatenate([x, pad], axis=1), pos

    qa, qpa = aug(q, q_pos)
    ka, kpa = aug(k, kv_pos)
    qa, ka = scheme.transform_qk(qa, ka, qpa, kpa)
    return qa[:, :q.shape[1]], ka[:, :k.shape[1]]


# ------------------------------------------------------------------------- the ring
class _RingCfg(NamedTuple):
    cfg: ChunkCfg  # the chunked path's static configuration for one (q shard, kv block) pair
    axis_name: str
    size: int  # P
    groups: int  # query heads per key/value head


def _shift(tree, rc: _RingCfg):
    return ring_shift(tree, rc.axis_name, rc.size)


def _expand(x, groups):
    """Key/value heads to query heads (grouped-query attention), blocked ``[n, B, Nk, ...]``."""
    return x if groups == 1 else jnp.repeat(x, groups, axis=2)


def _fold(dx, groups):
    """The transpose of :func:`_expand`: sum the query heads of each key/value head."""
    if groups == 1:
        return dx
    n, B, N = dx.shape[:3]
    return dx.reshape((n, B, N // groups, groups) + dx.shape[3:]).sum(axis=3)


def _block_inputs(rc: _RingCfg, qs, loc, kv):
    """The chunked path's blocked inputs for the local queries and one passing block."""
    return Blocked(qs=qs, k=_expand(kv["k"], rc.groups), v=_expand(kv["v"], rc.groups),
                   q_pos=loc["q_pos"], kv_pos=kv["kv_pos"], kv_valid=loc["kv_valid"],
                   q_seg=loc["seg_q"], kv_seg=kv["seg_kv"])


def _block_live(rc: _RingCfg, terms, loc, kv):
    """bool scalar: may any local query see any key of the passing block? The chunked
    path's tile classification applied to the whole block (causal: ``min(kv_pos) <=
    max(q_pos)``; segments: the id ranges overlap); conservative."""
    flat = lambda x: None if x is None else unblocks(x, 1)
    kind = tile_kind(rc.cfg.causal, terms.mask is not None, flat(loc["q_pos"]),
                      flat(kv["kv_pos"]), flat(loc["kv_valid"]), flat(loc["seg_q"]),
                      flat(kv["seg_kv"]), None)
    return kind != EMPTY


def _ring_forward(rc: _RingCfg, fl, il, sinks, qs, loc, kv):
    """Global out ``[nq, B, N, bq, Hv]`` and lse ``[nq, B, N, bq]`` (with the sinks)."""
    cfg = rc.cfg
    terms = merge_terms(cfg, fl, il)
    nq, B, N, bq = qs.shape[:4]
    Hv = kv["v"].shape[-1]

    def block(kv):
        z = varying_zero(fl, qs, loc, kv)

        def run(_):
            o, l = chunked_forward(terms, None, _block_inputs(rc, qs, loc, kv), cfg)
            return o + z, l + z

        def skip(_):
            return (jnp.zeros((nq, B, N, bq, Hv), jnp.float32) + z,
                    jnp.full((nq, B, N, bq), _NEG_INF, jnp.float32) + z)

        return jax.lax.cond(_block_live(rc, terms, loc, kv), run, skip, None)

    z = varying_zero(fl, qs, loc, kv)
    out = jnp.zeros((nq, B, N, bq, Hv), jnp.float32) + z
    lse = jnp.full((nq, B, N, bq), _NEG_INF, jnp.float32) + z

    def step(carry, _):
        kv, out, lse = carry
        o, l = block(kv)
        kv = _shift(kv, rc)  # independent of the block's compute: the two can overlap
        out, lse = lse_merge(out, lse, o, l)
        return (kv, out, lse), None

    # P steps, so the block compute is traced once; the P-th hop brings each block home.
    (_, out, lse), _ = jax.lax.scan(step, (kv, out, lse), None, length=rc.size)
    if sinks is not None:  # one more logit per head in every row's normaliser
        out, lse = fold_sinks(out, lse, sinks, head_axis=2)
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_core(rc, fl, il, sinks, qs, loc, kv):
    out, _ = _ring_forward(rc, fl, il, sinks, qs, loc, kv)
    return out


def _ring_core_fwd(rc, fl, il, sinks, qs, loc, kv):
    out, lse = _ring_forward(rc, fl, il, sinks, qs, loc, kv)
    return out, (fl, il, sinks, qs, loc, kv, out, lse)


def _ring_core_bwd(rc, res, dout):
    fl, il, sinks, qs, loc, kv, out, lse = res
    cfg = rc.cfg
    terms = merge_terms(cfg, fl, il)
    z = varying_zero(fl, qs, loc, kv, out, lse, dout)
    zeros = lambda x: jnp.zeros(jnp.shape(x), jnp.float32) + z

    def block(kv):
        """dq, dk, dv (key/value heads) and the terms' gradients from one passing block,
        with the GLOBAL out and lse."""

        def run(_):
            dq, dk, dv, dfl = chunked_backward(cfg, fl, il, _block_inputs(rc, qs, loc, kv),
                                                out, lse, dout)
            return (dq + z, _fold(dk, rc.groups) + z, _fold(dv, rc.groups) + z,
                    [g + z for g in dfl])

        def skip(_):
            return zeros(qs), zeros(kv["k"]), zeros(kv["v"]), [zeros(x) for x in fl]

        return jax.lax.cond(_block_live(rc, terms, loc, kv), run, skip, None)

    def step(carry, _):
        kv, (dk, dv), dq, dfl = carry
        gq, gk, gv, gfl = block(kv)
        dq, dfl = dq + gq, [a + b for a, b in zip(dfl, gfl)]
        # the block moves on with its gradients; after P hops both are back at the owner
        kv, dkv = _shift((kv, (dk + gk, dv + gv)), rc)
        return (kv, dkv, dq, dfl), None

    init = (kv, (zeros(kv["k"]), zeros(kv["v"])), zeros(qs), [zeros(x) for x in fl])
    (_, (dk, dv), dq, dfl), _ = jax.lax.scan(step, init, None, length=rc.size)

    dfl = [match_vma(g.astype(jnp.result_type(x)), x) for g, x in zip(dfl, fl)]
    dq = match_vma(dq, qs)
    dk = match_vma(dk.astype(kv["k"].dtype), kv["k"])
    dv = match_vma(dv.astype(kv["v"].dtype), kv["v"])
    dsinks = None
    if sinks is not None:  # padded query rows have dout = 0, so delta = 0 there
        delta = jnp.sum(dout * out, axis=-1)
        dsinks = match_vma(sink_gradient(sinks, lse, delta, 2).astype(sinks.dtype), sinks)
    dil = [zero_cotangent(x) for x in il]
    dloc = jax.tree_util.tree_map(zero_cotangent, loc)
    dkv_tree = dict(kv, k=dk, v=dv, kv_pos=zero_cotangent(kv["kv_pos"]),
                    seg_kv=zero_cotangent(kv["seg_kv"]))
    return dfl, dil, dsinks, dq, dloc, dkv_tree


_ring_core.defvjp(_ring_core_fwd, _ring_core_bwd)


def _vary_like(tree, ref):
    """``tree`` with every leaf varying over every mesh axis ``ref``'s leaves vary over
    (ppermute and the loop carries need one type for the whole block)."""
    z = varying_zero(ref)
    return jax.tree_util.tree_map(lambda x: x + z.astype(x.dtype), tree)


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    axis_name: str,
    position: PositionScheme | Literal["none", "nope"] | None = None,
    score_mod: Callable[..., Any] | None = None,
    mask_mod: Callable[..., Any] | None = None,
    q_positions: ArrayLike,
    kv_positions: ArrayLike,
    causal: bool = False,
    segment_ids: ArrayLike | None = None,
    kv_segment_ids: ArrayLike | None = None,
    scale: ArrayLike | None = None,
    sinks: ArrayLike | None = None,
    implementation: str | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> jax.Array:
    """Ring attention (context parallelism) over the mesh axis ``axis_name``: call it
    inside ``jax.shard_map`` with the sequence of q, k and v sharded over that axis.

    The result on each device is its rows of ``jaxpos.attention(q, k, v, ...)`` of the
    whole (unsharded) sequence with the same arguments, forward and backward, for every
    position scheme, score_mod and mask_mod (Liu, Zaharia & Abbeel 2023, "Ring Attention
    with Blockwise Transformers for Near-Infinite Context", §3; the blockwise online
    softmax of Rabe & Staats 2021 and the FlashAttention-2 backward of Dao 2023, Alg. 2,
    per passing block). Key/value blocks, with their global positions and segment ids,
    travel around the ring with ``jax.lax.ppermute``, ``P`` hops each (the hop after the
    last block's compute, independent of it, brings the block home; in the backward pass
    the block's ``dk``/``dv`` travel with it and so arrive at its owner), so per-device
    memory is ``O(T / P)``. Key/value blocks a causal or segment mask hides
    from every local query are skipped (``lax.cond``), and hidden tiles inside a block
    too. See the module docstring and docs/parallel.md.

    All shapes are LOCAL (this device's shard):

    Args:
      q: ``[B, Tq, N, H]``; k: ``[B, Tk, N_kv, H]``; v: ``[B, Tk, N_kv, H_v]`` (float);
        ``N`` a multiple of ``N_kv`` (grouped-query attention: k/v travel with ``N_kv``
        heads). Every device holds the same local lengths.
      axis_name: the mesh axis (a str) the sequence is sharded over; its size is ``P``.
      position: a scheme (``jaxpos.schemes.base.REGISTRY``) or ``None``/``"none"``. Its arrays
        are usually replicated over ``axis_name``; their gradients are summed over it.
        A per-token transform runs on the local tokens at their global positions; one
        that depends on the call's smallest/largest position (dynamic NTK, LongRoPE,
        xPos) sees the global ones.
      score_mod, mask_mod: as :func:`jaxpos.attention`, called with global positions;
        captured arrays receive gradients (summed over the devices).
      q_positions, kv_positions: REQUIRED integer ``[Tq]``/``[Tk]`` or ``[B, T]``, the
        global positions of the local tokens (e.g. the shard of ``arange(T)``, or of
        :func:`zigzag_permutation` for a zigzag layout).
      causal: a query at position ``p`` sees keys at positions ``<= p``.
      segment_ids, kv_segment_ids: integer ``[B, Tq]`` / ``[B, Tk]`` local shards of the
        packed-sequence ids; ``kv_segment_ids`` defaults to ``segment_ids``. They travel
        with their block.
      scale: score scale (default ``1 / sqrt(H)``).
      sinks: float ``[N]``, a logit per query head in every row's softmax denominator
        (replicated; gradient summed over the devices).
      implementation: the engine of each (local queries, passing block) pair, any
        registered engine that returns its log-sum-exp: ``"chunked"``
        (``block_q x block_k`` tiles of the chunked path, its backward given the global
        output and log-sum-exp), ``"reference"`` (one tile per pair), ``"pallas"`` (the
        fused kernel, ``return_lse``; its own backward computes each block's share of the
        gradients, see :mod:`jaxpos.parallel.engine_ring`; on CPU the Pallas
        interpreter, which needs ``check_vma=False`` on ``shard_map``), or one a user
        registered with ``run_with_lse``. ``None``: the first such engine of the
        backend's preference list that takes the call (the kernel on GPU/TPU,
        ``"chunked"`` on CPU).
      block_q, block_k: chunked tile sizes (default 256, capped at the local lengths).
        For a zigzag layout, tiles that divide ``T / (2P)`` let hidden tiles be skipped.

    Returns:
      ``[B, Tq, N, H_v]`` in q's dtype: this device's rows of the global attention. A
      query with no visible key anywhere returns zeros.

    Raises:
      ValueError: called outside ``shard_map`` or with an axis name the mesh lacks;
        positions or segment ids whose length is not the local q/k length; missing
        positions; an engine that refuses the call (``"pallas"`` with Shaw: its reason)
        or cannot return its log-sum-exp; and every error of
        :func:`jaxpos.attention` (shapes, scheme/head mismatches, bad mods, sinks).
      TypeError: a non-str ``axis_name``; float positions; non-bool ``causal``; ...
    """
    P = bound_axis_size(axis_name)
    call = validate_call(q, k, v, position=position, score_mod=score_mod, mask_mod=mask_mod,
                         sinks=sinks, q_positions=q_positions, kv_positions=kv_positions,
                         causal=causal, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                         scale=scale, block_q=block_q, block_k=block_k, sharded=True)
    if call.q_len == 0 or call.kv_len == 0:
        return call.zeros()
    return _ring(call, axis_name, P, ring_engine(call, implementation))


def _ring(call: AttentionCall, axis_name: str, P: int, implementation: str) -> jax.Array:
    """The ring on a validated call (positions global, sequence sharded over ``axis_name``)."""
    q, k = transform_global(call.scheme, call.q, call.k, call.q_positions, call.kv_positions,
                            axis_name)
    return ring_core(call.replace(q=q, k=k), axis_name, P, implementation)


def ring_core(call: AttentionCall, axis_name: str, P: int, implementation: str) -> jax.Array:
    """The ring on a validated call whose scheme transform is already applied: this
    device's ``[B, Tq, N, H_v]`` rows (q's dtype)."""
    # An engine that declares ring_tile has its tiles run here (their forward and backward
    # given the global output and log-sum-exp); any other makes one call per block.
    ring_tile = engines.capability(implementation, "ring_tile")
    if ring_tile is None:  # one engine call (with its lse) per block
        return engine_ring(call, axis_name, P, implementation)
    Tq = call.q_len
    qs, kk, vv, m = heads_major(call, repeat_kv=False)
    bq, bk = ring_tile(call)
    terms = make_terms(call.scheme, call.score_mod, call.mask_mod, bq, bk)
    b, nq, nk = chunk_inputs(qs, kk, vv, m, bq, bk)
    fl, il, is_f, treedef = split_terms(terms)
    rc = _RingCfg(ChunkCfg(call.causal, nq, nk, bq, bk, is_f, treedef), axis_name, P,
                  call.num_heads // call.num_kv_heads)
    # One varying type for everything that meets in a tile (positions may be replicated
    # and k/v may vary over fewer axes than q): ppermute, the loop carries and the traced
    # mods need it.
    every = (b.k, b.qs, b.q_pos, b.kv_pos)
    loc = _vary_like({"q_pos": b.q_pos, "seg_q": b.q_seg, "kv_valid": b.kv_valid}, every)
    kv = _vary_like({"k": b.k, "v": b.v, "kv_pos": b.kv_pos, "seg_kv": b.kv_seg},
                    every)
    out = _ring_core(rc, fl, il, call.sinks, b.qs, loc, kv)
    out = unblocks(out, 2)[:, :, :Tq]
    return jnp.swapaxes(out, 1, 2).astype(call.q.dtype)
