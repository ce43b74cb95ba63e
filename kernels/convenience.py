""":func:`fused_attention`: the kernel with RoPE, ALiBi and an offset-indexed bias given as
plain arrays (no scheme objects), translated into a per-token rotation and score_mods."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos.kernels.config import resolve_mode
from jaxpos.kernels.fused import kernel_call, run_call
from jaxpos.mods import BlockMask, compose_score_mods, convert_mod, offset_score_mod
from jaxpos.schemes.alibi import alibi_score_mod
from jaxpos.schemes.rope import ANGLE_PRECISIONS, LAYOUTS, apply_rope
from jaxpos.schemes.rope.tables import rope_tables

__all__ = ["alibi_score_mod", "fused_attention", "offset_bias_score_mod"]


def offset_bias_score_mod(offset_bias):
    """``score + offset_bias[head, clip(kv_pos - q_pos, -R, R) + R]`` as a score_mod
    (a gather from a per-head vector over clipped offsets; ``offset_bias`` float
    ``[N, 2R + 1]``, captured and differentiable). T5's bucketed bias is this with
    ``R = max_distance`` (Raffel et al. 2020 §2.1: every offset past ``max_distance`` is
    in the last bucket of its direction).

    Raises:
      ValueError / TypeError: ``offset_bias`` not a float ``[N, 2R + 1]`` array (odd length).
    """
    _checks.check_rank("offset_bias", offset_bias, (2,), "[num_heads, 2R + 1]")
    _checks.check_floating("offset_bias", offset_bias)
    if _checks.shape_of(offset_bias)[1] % 2 == 0:
        raise ValueError(f"offset_bias must have shape [N, 2R + 1] (odd length, entry R is "
                         f"offset 0); got {_checks.shape_of(offset_bias)}.")
    ob = jnp.asarray(offset_bias, jnp.float32)
    return offset_score_mod(ob, (ob.shape[1] - 1) // 2)


def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, q_positions: ArrayLike,
                    kv_positions: ArrayLike, inv_freq: ArrayLike | None = None,
                    rope_layout: str = "half", attention_factor: float = 1.0,
                    angle_precision: str = "high", alibi_slopes: ArrayLike | None = None,
                    alibi_bidirectional: bool = False, offset_bias: ArrayLike | None = None,
                    score_mod: Callable[..., Any] | None = None,
                    mask_mod: Callable[..., Any] | None = None,
                    block_mask: BlockMask | None = None, sinks: ArrayLike | None = None,
                    causal: bool = False, segment_ids: ArrayLike | None = None,
                    kv_segment_ids: ArrayLike | None = None, scale: ArrayLike | None = None,
                    block_q: int | None = None, block_k: int | None = None,
                    interpret: bool | None = None, rope_on_load: bool = False) -> jax.Array:
    """Fused attention (Pallas) with RoPE, ALiBi and an offset-indexed bias given as arrays.

    Computes, per batch ``b`` and query head ``h`` (key/value head ``h // (N / N_kv)``)::

        q', k' = RoPE(q, q_positions), RoPE(k, kv_positions)      # if inv_freq is given
        s[i, j] = scale * q'_i . k'_j
                  + alibi_slopes[h] * (kv_pos_j - q_pos_i)          # ALiBi, Press et al. 2022 §3
                  + offset_bias[h, clip(kv_pos_j - q_pos_i, -R, R) + R]
        s[i, j] = score_mod(s[i, j], b, h, q_pos_i, kv_pos_j)       # if given
        out_i   = softmax over visible j (and the sink) of s[i, :], times v

    RoPE (Su et al. 2024 §3.4) is one :func:`jaxpos.apply_rope` pass over q and k before
    the kernel (``O(T * H)``; learned ``inv_freq`` trains by plain autodiff through it);
    ALiBi and the offset bias become score_mods (:func:`alibi_score_mod`,
    :func:`offset_bias_score_mod`), composed before ``score_mod``; then
    :func:`jaxpos.kernels.attention_via_kernel`.

    The offset-bias contract: entry ``R + r`` of ``offset_bias[h]`` is the bias of offset
    ``r = kv_pos - q_pos``, and offsets beyond ``±R`` use the end entry of their side:
    exact for any offset-only bias constant beyond ``R`` (T5 with ``R = max_distance``)
    and for any offset bias when ``R >= max|kv_pos - q_pos|``.

    Args:
      q: ``[B, Tq, N, H]`` float32, bfloat16 or float16.
      k: ``[B, Tk, N_kv, H]``; v: ``[B, Tk, N_kv, H_v]``, q's dtype; ``N % N_kv == 0``.
      q_positions, kv_positions: integer ``[T]``, ``[1, T]`` or ``[B, T]``.
      inv_freq: float ``[rotary_dim // 2]`` radians per position, or None (no RoPE).
      rope_layout: ``"half"`` (Llama/NeoX) or ``"interleaved"`` (GPT-J/Meta).
      attention_factor: multiplies cos and sin (YaRN / LongRoPE).
      angle_precision: ``"high"`` or ``"float32"`` (see :func:`jaxpos.schemes.rope.rope_angles`).
      alibi_slopes: float ``[N]`` or None; differentiable.
      alibi_bidirectional: use ``-slopes * |kv_pos - q_pos|`` (encoders).
      offset_bias: float ``[N, 2R + 1]`` or None; differentiable.
      score_mod, mask_mod, block_mask, sinks: as :func:`jaxpos.kernels.attention_via_kernel`.
      causal: a query at position ``p`` sees keys at positions ``<= p``.
      segment_ids, kv_segment_ids: integer ``[B, Tq]`` / ``[B, Tk]``; equal ids attend.
      scale: Python float, default ``1 / sqrt(H)``.
      block_q, block_k: tile sizes, powers of two (default 128; the block mask's when given).
      interpret: True interprets, False compiles (Triton / Mosaic), None: interpret on CPU.
      rope_on_load: rotate q and k inside the kernel as they are loaded, from cos/sin
        tables of the positions computed once (``"half"`` layout only; ``inv_freq`` then
        gets no gradient), instead of one rotation pass before the kernel.

    Returns:
      ``[B, Tq, N, H_v]`` in q's dtype. A query row with no visible key returns zeros, with
      zero gradients.

    Raises:
      ValueError / TypeError: bad ranks or shapes, mismatched dtypes, float positions,
        ``offset_bias`` of even length, ``alibi_slopes`` not ``[N]``, ``inv_freq`` longer
        than ``H / 2``, block sizes that are not powers of two, segment ids given alone,
        unknown ``rope_layout`` / ``angle_precision``, ``interpret`` not a bool or None,
        ``rope_on_load`` with ``rope_layout="interleaved"``.
    """
    _checks.check_choice("rope_layout", rope_layout, LAYOUTS)
    _checks.check_choice("angle_precision", angle_precision, ANGLE_PRECISIONS)
    mode = resolve_mode(interpret)
    call = kernel_call(q, k, v, q_positions=q_positions, kv_positions=kv_positions,
                       score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask,
                       sinks=sinks, causal=causal, segment_ids=segment_ids,
                       kv_segment_ids=kv_segment_ids, scale=scale, block_q=block_q,
                       block_k=block_k)
    q, k, q_pos, kv_pos = call.q, call.k, call.q_positions, call.kv_positions
    _, _, N, H = q.shape
    mods = []
    tables = None
    if inv_freq is not None:
        _checks.check_rank("inv_freq", inv_freq, (1,), "[rotary_dim // 2]")
        _checks.check_floating("inv_freq", inv_freq)
        half = _checks.shape_of(inv_freq)[0]
        if not 0 < 2 * half <= H:
            raise ValueError(f"inv_freq must have length in [1, H/2 = {H // 2}]; got {half}.")
        if rope_on_load:
            if rope_layout != "half":
                raise ValueError(f"rope_on_load rotates the 'half' layout only; got "
                                 f"rope_layout={rope_layout!r} (rotate before the kernel, or "
                                 f"permute the features with "
                                 f"jaxpos.schemes.rope.interleaved_to_half).")
            tables = rope_tables(q_pos, kv_pos, inv_freq, attention_factor=attention_factor,
                                 angle_precision=angle_precision)
        else:
            kw = {"layout": rope_layout, "attention_factor": attention_factor,
                  "angle_precision": angle_precision}
            q = apply_rope(q, q_pos, inv_freq, **kw)
            k = apply_rope(k, kv_pos, inv_freq, **kw)
    if alibi_slopes is not None:
        _checks.check_rank("alibi_slopes", alibi_slopes, (1,), "[num_heads]")
        if _checks.shape_of(alibi_slopes)[0] != N:
            raise ValueError(f"alibi_slopes must have shape [{N}]; got "
                             f"{_checks.shape_of(alibi_slopes)}.")
        mods.append(alibi_score_mod(alibi_slopes, bidirectional=bool(alibi_bidirectional)))
    if offset_bias is not None:
        _checks.check_rank("offset_bias", offset_bias, (2,), "[num_heads, 2R + 1]")
        nh, length = _checks.shape_of(offset_bias)
        if nh != N or length % 2 == 0:
            raise ValueError(f"offset_bias must have shape [{N}, 2R + 1] (odd length, entry R "
                             f"is offset 0); got {(nh, length)}.")
        mods.append(offset_bias_score_mod(offset_bias))
    mod = compose_score_mods(*mods, call.score_mod)
    conv = None if mod is None else convert_mod(mod, "score", *call.mod_tile)
    call = call.replace(q=q, k=k, score_mod=mod, score_conv=conv, rope_tables=tables)
    return cast(jax.Array, run_call(call, mode=mode))  # return_lse=False: the output alone
