"""One validation of an attention call, shared by :func:`jaxpos.attention` and
:func:`jaxpos.parallel.ring_attention`: :func:`validate_call` checks every argument once
and returns an :class:`AttentionCall`, the immutable record every runner
(:mod:`jaxpos.core.reference`, :mod:`jaxpos.core.chunked`, :mod:`jaxpos.core.xla`,
``jaxpos.kernels.dispatch``) takes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos.core.dropout import check_dropout
from jaxpos.mods import BlockMask, ConvertedMod, compose_score_mods, convert_mod, reads_input
from jaxpos.schemes.base import PositionScheme, as_scheme

__all__ = ["AttentionCall", "apply_rope_tables", "check_attention_inputs", "converted_mods",
           "decode_positions", "fill_positions", "transform_call", "validate_call"]


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """One validated attention call (all checks done; nothing here is checked again).

    Fields:
      q: ``[B, Tq, N, H]``; k: ``[B, Tk, N_kv, H]``; v: ``[B, Tk, N_kv, H_v]`` (float; the
        scheme's per-token transform not yet applied, see :func:`transform_call`).
      scheme: the position scheme (checked against the heads and ``causal``).
      score_mod: the scheme's score_mod composed with the user's (or None).
      mask_mod: the user's mask_mod, or the block mask's (or None).
      block_mask: a checked :class:`jaxpos.BlockMask` or None.
      sinks: float ``[N]`` or None.
      q_positions, kv_positions: int32 ``[B|1, Tq]`` / ``[B|1, Tk]``.
      segment_ids, kv_segment_ids: int32 ``[B, Tq]`` / ``[B, Tk]`` or None (both or none).
      mask: bool ``[B|1, N|1, Tq|1, Tk|1]`` or None.
      causal: Python bool.
      scale: the score scale (a Python float by default; may be traced).
      block_q, block_k: positive tile sizes or None (the block mask's when given).
      kv_lengths: int32 ``[B]`` in ``[0, Tk]`` or None: keys at index
        ``>= kv_lengths[b]`` are invisible to row ``b`` (a KV cache's fill counts).
      kv_overflow: bool ``[B]`` or None: rows whose traced ``kv_lengths`` were outside
        ``[0, Tk]`` (concrete ones raise in the validation); the engines' outputs are NaN
        there (:func:`jaxpos.core.engines.run`), and the lengths above are clipped only so
        that the engines stay in bounds.
      rope_tables: float32 :class:`jaxpos.schemes.rope.tables.RopeTables` or None: q and k are
        unrotated and the engine rotates them (on load where it can).
      dropout: a :class:`jaxpos.core.dropout.Dropout` (rate, seed, broadcast) or None: attention
        dropout on the softmax probabilities.
      score_conv, mask_conv: ``score_mod`` and ``mask_mod`` converted
        (:func:`jaxpos.mods.convert_mod`) at the tile ``mod_tile`` (the call's
        ``[Tq, Tk]``, at least 1 x 1) by the validation; :func:`converted_mods` hands them
        to the engines.
    """

    q: Any
    k: Any
    v: Any
    scheme: PositionScheme
    score_mod: Any
    mask_mod: Any
    block_mask: BlockMask | None
    sinks: Any
    q_positions: jax.Array
    kv_positions: jax.Array
    segment_ids: jax.Array | None
    kv_segment_ids: jax.Array | None
    mask: jax.Array | None
    causal: bool
    scale: Any
    block_q: int | None
    block_k: int | None
    kv_lengths: jax.Array | None = None
    kv_overflow: jax.Array | None = None
    rope_tables: Any = None
    dropout: Any = None
    score_conv: ConvertedMod | None = None
    mask_conv: ConvertedMod | None = None
    mod_tile: tuple[int, int] = (0, 0)

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def q_len(self) -> int:
        return self.q.shape[1]

    @property
    def kv_len(self) -> int:
        return self.k.shape[1]

    @property
    def num_heads(self) -> int:
        return self.q.shape[2]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]

    def replace(self, **changes: Any) -> AttentionCall:
        """A copy with some fields changed (e.g. the transformed q and k)."""
        return dataclasses.replace(self, **changes)

    def zeros(self) -> jax.Array:
        """The output of a call with nothing to attend: ``[B, Tq, N, H_v]`` zeros."""
        return jnp.zeros(self.q.shape[:3] + (self.v.shape[-1],), self.q.dtype)


# ------------------------------------------------------------------------ the checks
def check_attention_inputs(q: Any, k: Any, v: Any) -> None:
    """q ``[B, Tq, N, H]``, k ``[B, Tk, N_kv, H]``, v ``[B, Tk, N_kv, H_v]`` float arrays of
    one dtype, ``N`` a multiple of ``N_kv``.

    Mixed dtypes (a bfloat16 q with float32 k and v) are refused for every engine, as
    ``jax.nn.dot_product_attention`` refuses them: promoting would change the caller's
    precision behind its back (a float32 cache read by bfloat16 queries is either cast
    down or makes the whole call float32).

    Raises:
      ValueError: a wrong rank or mismatched shapes.
      TypeError: a non-floating dtype; q, k and v of different dtypes (naming each).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        _checks.check_rank(name, x, (4,), "[batch, seq, heads, head_dim]")
        _checks.check_floating(name, x)
    _checks.check_one_dtype(q=q, k=k, v=v)
    (B, _Tq, N, H), (Bk, Tk, Nk, Hk), vs = q.shape, k.shape, v.shape
    if Bk != B or vs[0] != B:
        raise ValueError(f"q, k and v must share the batch size; got q {q.shape}, k {k.shape}, "
                         f"v {v.shape}.")
    if Hk != H:
        raise ValueError(f"k must have q's head_dim {H}; got k {k.shape}.")
    if vs[1] != Tk or vs[2] != Nk:
        raise ValueError(f"v must match k in sequence length and heads [B, {Tk}, {Nk}, H_v]; "
                         f"got v {v.shape}.")
    if N % Nk:
        raise ValueError(f"query heads ({N}) must be a multiple of key/value heads ({Nk}) "
                         f"for grouped-query attention; got q {q.shape}, k {k.shape}.")


def decode_positions(Tq: int, Tk: int) -> tuple[jax.Array, jax.Array]:
    """``arange`` positions, queries aligned to the end of the keys (the decode convention):
    ``q_positions = arange(Tq) + (Tk - Tq)`` when ``Tk >= Tq``. int32 ``[Tq]``, ``[Tk]``."""
    kv = jnp.arange(Tk, dtype=jnp.int32)
    q = jnp.arange(Tq, dtype=jnp.int32) + max(Tk - Tq, 0)
    return q, kv


def _layout_hint(q, *, heads=None, seq=None) -> str:
    """A sentence naming the likely ``[B, N, T, H]`` / ``[B, T, N, H]`` swap when axis 1 of
    ``q`` would fit what axis 2 failed (``heads``) or the other way (``seq``); else ''."""
    if q.ndim != 4:
        return ""
    if (heads is not None and q.shape[1] == heads and q.shape[2] != heads) or (
            seq is not None and q.shape[2] == seq and q.shape[1] != seq):
        return (f" q has shape {tuple(q.shape)}: jaxpos expects [B, T, N, H] (batch, sequence, "
                f"heads, head_dim); it looks like [B, N, T, H]. Swap axes 1 and 2 "
                f"(jnp.swapaxes(x, 1, 2)) for q, k and v.")
    return ""


def _check_causal(causal) -> bool:
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(
            f"causal must be a Python bool (it selects the computation, so it is static: under "
            f"jax.jit pass static_argnames=('causal',)); got {type(causal).__name__}.")
    return bool(causal)


def _check_scheme(position, q, v, causal: bool) -> PositionScheme:
    """The call's scheme, checked against q's heads (with a layout hint), ``causal`` and
    v's width (a value term adds vectors of q's head_dim)."""
    scheme = as_scheme(position)
    N, H = q.shape[2], q.shape[3]
    try:
        scheme.check(N, H)
    except ValueError as e:
        hint = ""
        try:
            scheme.check(q.shape[1], H)
            hint = _layout_hint(q, heads=q.shape[1])
        except ValueError:
            pass
        if hint:
            raise ValueError(f"{e}{hint}") from None
        raise
    scheme.check_causal(causal)
    if scheme.has_value_term and v.shape[-1] != H:
        raise ValueError(f"v must have head_dim {H}: {type(scheme).__name__}'s value term adds "
                         f"vectors of width {H} to the output; got v {v.shape}.")
    return scheme


def fill_positions(kv_lengths: Any, Tq: int) -> Any:
    """int32 ``[B, Tq]``: ``kv_lengths[b] - Tq + arange(Tq)``, each row's new queries as the
    last ``Tq`` tokens of its fill (``flash_attn_with_kvcache``'s convention for a call on a
    cache; a row filled to fewer than ``Tq`` slots has its first queries before position
    0). NumPy for concrete non-JAX lengths (positions stay known under ``jit``), else a
    ``jax.Array``."""
    if isinstance(kv_lengths, jax.Array):
        return (jnp.asarray(kv_lengths, jnp.int32)[:, None] - Tq
                + jnp.arange(Tq, dtype=jnp.int32)[None, :])
    return (np.asarray(kv_lengths).astype(np.int32)[:, None] - Tq
            + np.arange(Tq, dtype=np.int32)[None, :])


def _positions(q, q_positions, kv_positions, Tk: int, kv_lengths=None):
    """int32 ``[B|1, Tq]``, ``[B|1, Tk]``: the given positions or the defaults: ``arange``
    keys and :func:`decode_positions`'s queries, or with ``kv_lengths`` and ``Tq < Tk``
    (a call on a cache) each row's queries at the end of its fill
    (:func:`fill_positions`); a length mismatch that looks like a ``[B, N, T, H]``
    layout says so."""
    B, Tq = q.shape[:2]
    # the defaults only when needed (a decode step's given positions make no arange of Tk)
    dq_pos, dkv_pos = decode_positions(Tq, Tk) if q_positions is None or \
        kv_positions is None else (None, None)
    if q_positions is None and kv_lengths is not None and Tq < Tk:
        dq_pos = fill_positions(kv_lengths, Tq)
    try:
        q_pos = _checks.positions_2d("q_positions", dq_pos if q_positions is None else q_positions,
                                     B, Tq)
        kv_pos = _checks.positions_2d("kv_positions",
                                      dkv_pos if kv_positions is None else kv_positions, B, Tk)
    except ValueError as e:
        given = q_positions if q_positions is not None else kv_positions
        shp = _checks.shape_of(given) if given is not None else ()
        hint = _layout_hint(q, seq=shp[-1]) if shp else ""
        raise ValueError(f"{e}{hint}") from None
    return q_pos, kv_pos


def _shard_positions(name: str, positions, B: int, T: int, what: str):
    """int32 ``[B|1, T]``: the REQUIRED global positions of a device's local shard."""
    if positions is None:
        raise ValueError(
            f"{name} is required: ring_attention needs the GLOBAL positions of this device's "
            f"{what} shard (a local arange would make every device believe it holds the start "
            f"of the sequence). Shard the global positions like {what}.")
    try:
        return _checks.positions_2d(name, positions, B, T)
    except ValueError as e:
        raise ValueError(
            f"{e} Inside shard_map, {name} are the global positions of this device's local "
            f"{what} shard: local length {T}, sharded like {what}.") from None


def _segments(name, seg, B, T):
    if seg is None:
        return None
    _checks.check_integer_positions(name, seg)
    if _checks.shape_of(seg) != (B, T):
        raise ValueError(f"{name} must have shape [B, T] = [{B}, {T}]; "
                         f"got {_checks.shape_of(seg)}.")
    return jnp.asarray(seg, jnp.int32)


def _segment_pair(segment_ids, kv_segment_ids, B, Tq, Tk):
    """int32 ``[B, Tq]``, ``[B, Tk]`` segment ids (or None, None); ``kv_segment_ids``
    defaults to ``segment_ids`` when the lengths agree."""
    if kv_segment_ids is None and segment_ids is not None:
        if Tq != Tk:
            raise ValueError(f"kv_segment_ids is required when Tq != Tk ({Tq} vs {Tk}).")
        kv_segment_ids = segment_ids
    if (segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("segment_ids and kv_segment_ids must be given together; got only "
                         + ("segment_ids." if kv_segment_ids is None else "kv_segment_ids."))
    return (_segments("segment_ids", segment_ids, B, Tq),
            _segments("kv_segment_ids", kv_segment_ids, B, Tk))


def _normalize_mask(mask, B, N, Tq, Tk):
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise TypeError(f"mask must be boolean (True = may attend); got dtype {mask.dtype}.")
    if mask.ndim > 4:
        raise ValueError(f"mask must be broadcastable to [B, N, Tq, Tk] = {[B, N, Tq, Tk]}; "
                         f"got shape {mask.shape}.")
    given = mask.shape
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    for got, want in zip(mask.shape, (B, N, Tq, Tk)):
        if got not in (1, want):
            raise ValueError(f"mask must be broadcastable to [B, N, Tq, Tk] = {[B, N, Tq, Tk]}; "
                             f"got shape {given}.")
    return mask


def _check_sinks(sinks, N):
    if sinks is None:
        return None
    _checks.check_floating("sinks", sinks)
    if _checks.shape_of(sinks) != (N,):
        raise ValueError(f"sinks must have shape [num_heads] = [{N}] (one logit per query "
                         f"head); got shape {_checks.shape_of(sinks)}.")
    return jnp.asarray(sinks)


def _check_scale(scale, H):
    """``scale`` (default ``1/sqrt(H)``): a real scalar."""
    if scale is None:
        return 1.0 / math.sqrt(H)
    if isinstance(scale, (str, bytes)) or (
            hasattr(scale, "dtype") and not jnp.issubdtype(scale.dtype, jnp.number)):
        raise TypeError(f"scale must be a real number (default 1/sqrt(head_dim)); got "
                        f"{type(scale).__name__} {scale!r}.")
    if np.ndim(scale) != 0:
        raise ValueError(f"scale must be a scalar (one factor for every score); got shape "
                         f"{np.shape(scale)}.")
    return scale


def _check_block_mask(block_mask, mask_mod, shape: tuple[int, int, int, int], block_q, block_k,
                      q_pos, kv_pos):
    """``(mask_mod, block_q, block_k)`` of a call with a block mask (its own)."""
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a jaxpos.BlockMask (from "
                        f"jaxpos.create_block_mask); got {type(block_mask).__name__}.")
    block_mask.check(*shape, block_q, block_k, q_positions=q_pos, kv_positions=kv_pos)
    if mask_mod is not None and mask_mod is not block_mask.mask_mod:
        raise ValueError("mask_mod differs from block_mask.mask_mod; pass one of them (the "
                         "block mask carries its mask_mod).")
    return block_mask.mask_mod, block_mask.block_q, block_mask.block_k


def _check_mods(scheme: PositionScheme, score_mod, mask_mod, tile: tuple[int, int],
                rows: Any = None):
    """The scheme's score_mod composed with the user's, and both mods converted at
    ``tile`` (traced once: a bad return shape or dtype is reported at the call whatever
    the engine): ``(score_mod, mask_mod, score_conv, mask_conv)``. ``rows``: int32
    ``[B]`` or None, the caller's batch row of each row of the call: a mod that reads its
    ``batch`` argument then sees that row."""
    all_score_mods = compose_score_mods(scheme.score_mod(), score_mod)
    conv = lambda fn, kind: None if fn is None else convert_mod(fn, kind, *tile)
    score_conv, mask_conv = conv(all_score_mods, "score"), conv(mask_mod, "mask")
    if rows is not None and score_conv is not None and reads_input(score_conv.jaxpr, 1):
        inner_score: Callable = cast("Callable", all_score_mods)  # (converted: not None)
        all_score_mods = lambda s, b, h, qp, kp: inner_score(s, rows[b], h, qp, kp)
        score_conv = conv(all_score_mods, "score")
    if rows is not None and mask_conv is not None and reads_input(mask_conv.jaxpr, 0):
        inner_mask = mask_mod
        mask_mod = lambda b, h, qp, kp: inner_mask(rows[b], h, qp, kp)
        mask_conv = conv(mask_mod, "mask")
    return all_score_mods, mask_mod, score_conv, mask_conv


def converted_mods(call: AttentionCall, tq: int, tk: int
                   ) -> tuple[ConvertedMod | None, ConvertedMod | None]:
    """The call's ``(score_mod, mask_mod)`` converted at a ``[tq, tk]`` tile: the ones the
    validation traced when the tile is theirs (a dense engine, a tiled one whose tile is
    the whole call), else traced once at this tile (the jaxprs are shape-specific)."""
    if (tq, tk) == call.mod_tile:
        return call.score_conv, call.mask_conv
    conv = lambda fn, kind: None if fn is None else convert_mod(fn, kind, tq, tk)
    return conv(call.score_mod, "score"), conv(call.mask_mod, "mask")


def validate_call(q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
                  position: PositionScheme | Literal["none", "nope"] | None = None,
                  score_mod: Callable[..., Any] | None = None,
                  mask_mod: Callable[..., Any] | None = None,
                  block_mask: BlockMask | None = None, sinks: ArrayLike | None = None,
                  q_positions: ArrayLike | None = None, kv_positions: ArrayLike | None = None,
                  causal: bool = False, mask: ArrayLike | None = None,
                  segment_ids: ArrayLike | None = None,
                  kv_segment_ids: ArrayLike | None = None, scale: ArrayLike | None = None,
                  block_q: int | None = None, block_k: int | None = None,
                  sharded: bool = False, kv_lengths: ArrayLike | None = None,
                  rope_tables: Any = None, dropout_rate: float = 0.0,
                  dropout_rng: jax.Array | None = None,
                  broadcast_dropout: bool = False, rows: Any = None) -> AttentionCall:
    """Check every argument of an attention call once and return its record.

    Args: as :func:`jaxpos.attention`; ``sharded=True`` for
    :func:`jaxpos.parallel.ring_attention`'s local shards: positions are then required
    (the global positions of the local tokens) and errors say so. ``rows``: None, or
    ``(row_of int32 [B], row_kv_lengths int32 [B_rows])`` for a call whose rows stand for
    rows of another (a ragged call's queries, :mod:`jaxpos.core.ragged`): a score_mod or
    mask_mod reading ``batch`` sees ``row_of[batch]``, and the scheme's
    ``for_call`` gets ``row_kv_lengths`` (indexed by that row).

    Returns:
      An :class:`AttentionCall` (positions int32 ``[B|1, T]``, segments int32 ``[B, T]``,
      the mask ``[B|1, N|1, Tq|1, Tk|1]``, the default scale ``1 / sqrt(H)``, the block
      mask's mask_mod and tile sizes).

    Raises:
      ValueError / TypeError: every error listed by :func:`jaxpos.attention`, naming the
        argument, what it got and what was expected.
    """
    check_attention_inputs(q, k, v)
    (B, Tq, N, H), Tk = _checks.shape_of(q), _checks.shape_of(k)[1]
    causal = _check_causal(causal)
    scheme = _check_scheme(position, q, v, causal)
    if sharded:
        q_pos = _shard_positions("q_positions", q_positions, B, Tq, "q")
        kv_pos = _shard_positions("kv_positions", kv_positions, B, Tk, "k/v")
    else:
        lengths = None
        if kv_lengths is not None and q_positions is None:  # the default follows the fill
            _checks.check_kv_lengths(kv_lengths, B, Tk)
            _checks.check_kv_lengths_range(kv_lengths, Tk)
            lengths = (jnp.clip(kv_lengths, 0, Tk) if isinstance(kv_lengths, jax.Array)
                       else np.clip(np.asarray(kv_lengths), 0, Tk))
        q_pos, kv_pos = _positions(q, q_positions, kv_positions, Tk, lengths)
    seg_q, seg_kv = _segment_pair(segment_ids, kv_segment_ids, B, Tq, Tk)
    mask4 = _normalize_mask(mask, B, N, Tq, Tk)
    for name, blk in (("block_q", block_q), ("block_k", block_k)):
        if blk is not None:
            _checks.check_positive_int(name, blk)
    if block_mask is not None:
        mask_mod, block_q, block_k = _check_block_mask(block_mask, mask_mod, (B, N, Tq, Tk),
                                                       block_q, block_k, q_pos, kv_pos)
    sinks = _check_sinks(sinks, N)
    scale = _check_scale(scale, H)
    tile = (max(Tq, 1), max(Tk, 1))
    kv_overflow = None
    if kv_lengths is not None:
        lengths = _checks.check_kv_lengths(kv_lengths, B, Tk)
        _checks.check_kv_lengths_range(kv_lengths, Tk)
        kv_lengths, kv_overflow = lengths, _checks.kv_lengths_out_of_range(kv_lengths, Tk)
    scheme = scheme.for_call(causal=causal, mask=mask4, mask_mod=mask_mod,
                             kv_lengths=kv_lengths if rows is None else rows[1])
    all_score_mods, mask_mod, score_conv, mask_conv = _check_mods(
        scheme, score_mod, mask_mod, tile, None if rows is None else rows[0])
    rope_tables = _check_rope_tables(rope_tables, scheme, B, Tq, Tk, H)
    dropout = check_dropout(dropout_rate, dropout_rng, broadcast_dropout)
    return AttentionCall(q=q, k=k, v=v, scheme=scheme, score_mod=all_score_mods,
                         mask_mod=mask_mod, block_mask=block_mask, sinks=sinks,
                         q_positions=q_pos, kv_positions=kv_pos, segment_ids=seg_q,
                         kv_segment_ids=seg_kv, mask=mask4, causal=causal, scale=scale,
                         block_q=block_q, block_k=block_k, kv_lengths=kv_lengths,
                         kv_overflow=kv_overflow, rope_tables=rope_tables, dropout=dropout,
                         score_conv=score_conv, mask_conv=mask_conv, mod_tile=tile)


def _check_rope_tables(tabs, scheme: PositionScheme, B: int, Tq: int, Tk: int, H: int):
    if tabs is None:
        return None
    from jaxpos.schemes.rope.tables import check_rope_tables

    if type(scheme).transform_qk is not PositionScheme.transform_qk:
        raise ValueError(f"rope_tables rotate unrotated q and k; the position scheme "
                         f"{type(scheme).__name__} transforms them too. Pass position=None "
                         f"(or a scheme without a per-token transform) with rope_tables.")
    return check_rope_tables(tabs, B, Tq, Tk, H)[0]


def transform_call(call: AttentionCall) -> AttentionCall:
    """The call with the scheme's per-token transform applied to q and k (RoPE rotation,
    xPos scaling; once per call, before any implementation). Nothing reads or rewrites
    the values: the NaN rule (docs/attention.md) costs nothing on the hot path. Keys past
    ``kv_lengths`` are zeroed first (fused into the transform's own pass over k): they
    are not inputs, and a NaN there would reach the gradients of the scheme's parameters
    (``d inv_freq`` multiplies each key by its zero cotangent)."""
    k = call.k
    if call.kv_lengths is not None and type(call.scheme).transform_qk is not \
            PositionScheme.transform_qk:
        filled = jnp.arange(call.kv_len)[None, :] < call.kv_lengths[:, None]
        k = jnp.where(filled[:, :, None, None], k, jnp.zeros((), k.dtype))
    q, k = call.scheme.transform_qk(call.q, k, call.q_positions, call.kv_positions)
    return call.replace(q=q, k=k)


def apply_rope_tables(call: AttentionCall) -> AttentionCall:
    """The call with its ``rope_tables`` applied to q and k before attention (for the
    engines that do not rotate on load) and removed from the record."""
    if call.rope_tables is None:
        return call
    from jaxpos.schemes.rope.tables import rotate_with_tables

    q, k = rotate_with_tables(call.q, call.k, call.rope_tables)
    return call.replace(q=q, k=k, rope_tables=None)
