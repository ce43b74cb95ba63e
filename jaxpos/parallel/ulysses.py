"""Context parallelism by all-to-all (DeepSpeed-Ulysses), and with the ring on a 2-D mesh.

Each device holds ``T / P`` tokens of q, k and v (all heads) with their *global*
positions. :func:`ulysses_attention` re-shards them with one ``jax.lax.all_to_all`` over
the mesh axis ``axis_name``: afterwards every device holds the *whole* sequence of
``N / P`` query heads (and their key/value heads), runs ordinary single-device attention
on them with any engine (``implementation=``: the fused kernel where it runs), and a
second all-to-all returns the output to the sequence sharding (Jacobs et al. 2023,
"DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme Long Sequence
Transformer Models", §3.1). Every device does the same work whatever the mask (each holds
every query of its heads), so a causal mask needs no zigzag layout here.

What follows the heads:

* the scheme's per-token transform (RoPE and its scalings, xPos, PoPE's per-head phase)
  runs before the all-to-all, on the local tokens and all heads, at their global
  positions (extremes over the axis where the transform depends on them), as in
  :func:`jaxpos.parallel.ring_attention`;
* the score_mod (the scheme's composed with the user's) and the mask_mod receive the
  *global* query head: a device holding heads ``[r N / P, (r + 1) N / P)`` calls them
  with ``head + r N / P``, so per-head parameters indexed by ``head`` (ALiBi slopes, the
  T5 table's columns, KERPLE/FIRE parameters, FoX gates, captured per-head tables) follow
  their heads without being sliced; the sinks ``[N]`` are sliced to the local heads;
  gradients of these replicated arrays are summed over the devices;
* grouped-query attention: with ``N_kv`` divisible by ``P`` the key/value heads are split
  like the query heads (each device receives the ``N_kv / P`` heads its queries read).
  Otherwise each key/value head is repeated ``f = lcm(N_kv, P) / N_kv`` times before the
  all-to-all (the fewest copies that make their count divisible by ``P``; e.g. multi-query
  attention, ``N_kv = 1``, on ``P = 4``: every device receives the one head), which costs
  ``f`` times the key/value traffic and is exact (the copies' gradients are summed).

With ``ring_axis`` the local attention of the gathered sequence is itself a ring over a
second mesh axis (USP, Fang & Zhao 2024, "USP: A Unified Sequence Parallelism Approach
for Long Context Generative AI", §3): Ulysses inside a node, the ring across nodes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos.core import engines
from jaxpos.core.call import AttentionCall, validate_call
from jaxpos.core.chunked import varying_zero
from jaxpos.mods import convert_mod, reads_input
from jaxpos.parallel.engine_ring import ring_engine
from jaxpos.parallel.ring import bound_axis_size, ring_core, transform_global
from jaxpos.schemes.base import PositionScheme

__all__ = ["kv_head_repeats", "ulysses_attention"]


def kv_head_repeats(num_kv_heads: int, num_devices: int) -> int:
    """How many times :func:`ulysses_attention` repeats each key/value head before its
    all-to-all: 1 when ``num_devices`` divides ``num_kv_heads``, else
    ``lcm(num_kv_heads, num_devices) / num_kv_heads`` (the fewest copies whose count
    ``P`` divides; the query heads of each copy are a contiguous share of the original
    head's, so attention is unchanged).

    Args:
      num_kv_heads: ``N_kv`` (positive int). num_devices: ``P`` (positive int).

    Returns:
      A positive int ``f``; ``N_kv * f`` key/value heads travel.

    Raises:
      TypeError / ValueError: an argument not a positive int.
    """
    nk = _checks.check_positive_int("num_kv_heads", num_kv_heads)
    p = _checks.check_positive_int("num_devices", num_devices)
    return math.lcm(nk, p) // nk


def _check_heads(call: AttentionCall, P: int, axis_name: str) -> int:
    """``f`` of :func:`kv_head_repeats` for the call; ValueError when ``P`` does not
    divide the query heads."""
    N, Nk = call.num_heads, call.num_kv_heads
    if N % P:
        raise ValueError(
            f"ulysses_attention shards the {N} query heads over the {P} devices of mesh axis "
            f"{axis_name!r}; {N} is not divisible by {P}. Use a head count divisible by the "
            f"axis size, a smaller axis, or ring_attention (which shards the sequence only).")
    return kv_head_repeats(Nk, P)


def _offset_head(fn, kind: str, offset):
    """``fn`` called with the global query head (``head + offset``), or ``fn`` itself when
    it never reads ``head``."""
    if fn is None:
        return None
    head_arg = 2 if kind == "score" else 1
    if not reads_input(convert_mod(fn, kind, 1, 1).jaxpr, head_arg):
        return fn
    if kind == "score":
        return lambda s, b, h, qp, kp: fn(s, b, h + offset, qp, kp)
    return lambda b, h, qp, kp: fn(b, h + offset, qp, kp)


def _seq_to_heads(x, axis):
    """``[B, T / P, n, H] -> [B, T, n / P, H]``: device ``r`` receives head share ``r`` of
    every device's tokens, in the devices' order along ``axis``."""
    return jax.lax.all_to_all(x, axis, 2, 1, tiled=True)


def _heads_to_seq(x, axis):
    """The inverse of :func:`_seq_to_heads`."""
    return jax.lax.all_to_all(x, axis, 1, 2, tiled=True)


def _gather_seq(x, axis, ref):
    """All-gather a per-token ``[B|1, T / P]`` array along its sequence axis (made to vary
    over every axis ``ref`` varies over first, as the collective needs)."""
    if x is None:
        return None
    x = x + varying_zero(ref).astype(x.dtype)
    return jax.lax.all_gather(x, axis, axis=1, tiled=True)


def heads_call(call: AttentionCall, axis_name: str, P: int, repeats: int) -> AttentionCall:
    """The call of this device after the all-to-all: the whole sequence (in the devices'
    order, positions and segment ids gathered with it) of ``N / P`` query heads and their
    key/value heads; mods offset to the global head, sinks sliced. ``call`` is transformed
    (the scheme's per-token transform already applied)."""
    k, v = call.k, call.v
    if repeats > 1:
        k, v = jnp.repeat(k, repeats, axis=2), jnp.repeat(v, repeats, axis=2)
    n = call.num_heads // P
    offset = jax.lax.axis_index(axis_name) * n
    sinks = None if call.sinks is None else jax.lax.dynamic_slice_in_dim(
        jnp.asarray(call.sinks), offset, n)
    ref = (call.q,)
    score_mod = _offset_head(call.score_mod, "score", offset)
    mask_mod = _offset_head(call.mask_mod, "mask", offset)
    # the mods converted anew for this call's tile (the whole gathered sequence): the
    # validation's conversions are of the mods without the head offset, at the local
    # lengths, and an engine whose tile is those lengths would take them
    tile = (max(call.q_len * P, 1), max(call.kv_len * P, 1))
    conv = lambda fn, kind: None if fn is None else convert_mod(fn, kind, *tile)
    return call.replace(
        q=_seq_to_heads(call.q, axis_name), k=_seq_to_heads(k, axis_name),
        v=_seq_to_heads(v, axis_name),
        q_positions=_gather_seq(call.q_positions, axis_name, ref),
        kv_positions=_gather_seq(call.kv_positions, axis_name, ref),
        segment_ids=_gather_seq(call.segment_ids, axis_name, ref),
        kv_segment_ids=_gather_seq(call.kv_segment_ids, axis_name, ref),
        score_mod=score_mod, mask_mod=mask_mod, sinks=sinks,
        score_conv=conv(score_mod, "score"), mask_conv=conv(mask_mod, "mask"),
        mod_tile=tile)


def _local_attention(call: AttentionCall, implementation: str | None) -> jax.Array:
    """Single-device attention of a transformed call with the named (or default) engine."""
    return engines.run(engines.select_engine(call, implementation), call)


def ulysses_attention(
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
    ring_axis: str | None = None,
) -> jax.Array:
    """Ulysses sequence parallelism over the mesh axis ``axis_name``: call it inside
    ``jax.shard_map`` with the sequence of q, k and v sharded over that axis.

    The result on each device is its rows of ``jaxpos.attention(q, k, v, ...)`` of the
    whole sequence with the same arguments, forward and backward, for every position
    scheme, score_mod and mask_mod (Jacobs et al. 2023, "DeepSpeed Ulysses", §3.1): an
    all-to-all from sequence to head sharding, single-device attention of ``N / P``
    heads over the whole sequence with any engine, and an all-to-all back. Per-head
    parameters follow their heads (the mods see the global head index, the sinks are
    sliced); see the module docstring for the rules, grouped-query attention included.

    With ``ring_axis`` (USP, Fang & Zhao 2024, §3) the sequence is sharded over both
    axes (``P(None, (ring_axis, axis_name))``: the ring axis major) and the attention of
    the sequence gathered over ``axis_name`` runs as :func:`ring_attention` over
    ``ring_axis``; a zigzag layout over the ring's ``P_ring`` devices
    (``to_zigzag(x, 1, P_ring)``) balances a causal ring.

    All shapes are LOCAL (this device's shard):

    Args:
      q: ``[B, Tq, N, H]``; k: ``[B, Tk, N_kv, H]``; v: ``[B, Tk, N_kv, H_v]`` (float).
        ``N`` must be divisible by ``P`` (the size of ``axis_name``).
      axis_name: the mesh axis (a str) the heads are re-sharded over.
      position, score_mod, mask_mod, causal, segment_ids, kv_segment_ids, scale, sinks:
        as :func:`jaxpos.attention`, with the scheme, captured arrays and sinks
        replicated (their gradients summed over the devices).
      q_positions, kv_positions: REQUIRED integer ``[Tq]``/``[Tk]`` or ``[B, T]``, the
        global positions of the local tokens.
      implementation: the engine of the local attention: ``None`` (the default rule of
        :func:`jaxpos.attention`) or any registered engine (``"reference"``,
        ``"chunked"``, ``"pallas"``: on CPU the interpreter, which needs
        ``check_vma=False`` on ``shard_map``; ``"xla"``; ...). With ``ring_axis``: the
        ring's block engine (one that returns its log-sum-exp; see
        :func:`jaxpos.parallel.ring_attention`).
      block_q, block_k: the engine's tile sizes.
      ring_axis: a second mesh axis for the ring (USP), or ``None``.

    Returns:
      ``[B, Tq, N, H_v]`` in q's dtype: this device's rows of the global attention.

    Raises:
      ValueError: called outside ``shard_map`` or with an axis the mesh lacks; ``N`` not
        divisible by ``P``; positions or segment ids not of the local lengths; missing
        positions; an engine that cannot run the call (as :func:`jaxpos.attention`); every
        error of :func:`jaxpos.attention`.
      TypeError: a non-str axis name; float positions; non-bool ``causal``; ...
    """
    P = bound_axis_size(axis_name, "ulysses_attention")
    R = None if ring_axis is None else bound_axis_size(ring_axis, "ulysses_attention")
    if ring_axis is not None and ring_axis == axis_name:
        raise ValueError(f"ring_axis must differ from axis_name; both are {axis_name!r}.")
    _checks.check_choice("implementation", implementation, engines.engine_names() + (None,))
    call = validate_call(q, k, v, position=position, score_mod=score_mod, mask_mod=mask_mod,
                         sinks=sinks, q_positions=q_positions, kv_positions=kv_positions,
                         causal=causal, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                         scale=scale, block_q=block_q, block_k=block_k, sharded=True)
    repeats = _check_heads(call, P, axis_name)
    if call.q_len == 0 or call.kv_len == 0:
        return call.zeros()
    axes = axis_name if ring_axis is None else (ring_axis, axis_name)
    qt, kt = transform_global(call.scheme, call.q, call.k, call.q_positions, call.kv_positions,
                              axes)
    local = heads_call(call.replace(q=qt, k=kt), axis_name, P, repeats)
    if ring_axis is None:
        out = _local_attention(local, implementation)
    else:
        assert R is not None
        out = ring_core(local, ring_axis, R, ring_engine(local, implementation))
    return _heads_to_seq(out, axis_name)
