"""Multi-head latent attention (MLA) with decoupled RoPE: the position pieces of DeepSeek-V2/V3.

DeepSeek-V2 (DeepSeek-AI 2024, "DeepSeek-V2: A Strong, Economical, and Efficient
Mixture-of-Experts Language Model", §2.1.2 low-rank key-value joint compression and §2.1.3
decoupled rotary position embedding) compresses keys and values into a latent ``c_t^KV``
that a KV cache stores, and up-projects it to per-head keys ``k^C_{t,i}`` and values. RoPE
cannot live in those up-projected keys (it would not commute with absorbing the
up-projection into the query), so each head gets a second, small part that carries
position only:

* ``q_{t,i} = [q^C_{t,i}; RoPE(q^R_{t,i})]``: a per-head "nope" part (``qk_nope_head_dim``
  features) and a per-head rope part (``qk_rope_head_dim``);
* ``k_{t,i} = [k^C_{t,i}; RoPE(k^R_t)]``: the rope part of the key is **one** head
  ``k^R_t = W^{KR} h_t`` shared by every query head (computed from the hidden state, not
  from the latent) and cached next to the latent;
* values ``v_{t,i}`` have their own width ``v_head_dim``;
* scores ``q_{t,i} . k_{j,i} / sqrt(qk_nope_head_dim + qk_rope_head_dim)``,
  times ``mscale**2`` when the rotary uses YaRN with ``mscale_all_dim`` (below).

This module builds those queries and keys for :func:`jaxpos.attention`. It puts the rope
part **first** in each head (``[rope | nope]``; a dot product does not care about the order
of features as long as queries and keys agree), so a plain :class:`jaxpos.RoPE` with
``rotary_dim = qk_rope_head_dim`` rotates exactly the rope part and passes the rest
through, in every implementation (reference, chunked, Pallas) and through a KV cache that
stores unrotated keys.

Rotary layout: DeepSeek's checkpoints pair features ``(2i, 2i+1)`` (``"interleaved"``);
Hugging Face's ``apply_rotary_pos_emb_interleave`` (``rope_interleave=True``, the default)
de-interleaves q and k and rotates halves, a permutation applied to both that leaves every
score unchanged, so ``RoPE(layout="interleaved")`` on the raw features gives HF's scores.
:func:`jaxpos.interop.hf.rope_from_hf_config` reads a DeepSeek config into that scheme (rotary
width ``qk_rope_head_dim``, YaRN scaling, layout from ``rope_interleave``).

Softmax scale: DeepSeek-V2's long-context extension (the "Long Context Extension" part of
the report: YaRN with scale ``s = 40`` and a length scaling factor
``sqrt(t) = 0.0707 ln s + 1``) multiplies the scores by ``t``; in the configs that is
``yarn_get_mscale(factor, mscale_all_dim)**2`` with ``mscale_all_dim = 0.707`` (V2) or
``1.0`` (V3), HF's ``yarn_apply_mscale``. :func:`mla_softmax_scale` computes it.

Example::

    q_nope, q_rope = mla.split_nope_rope(q, qk_nope_head_dim, qk_rope_head_dim)
    rope = jaxpos.interop.hf.rope_from_hf_config(hf_config)
    out = jaxpos.mla_attention(q_nope, q_rope, k_nope, k_rope, v, rope=rope,
                               scale=mla.mla_softmax_scale(16, 8, rope_parameters=params),
                               causal=True)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jaxpos import _checks
from jaxpos.schemes.rope.scaling import yarn_get_mscale

__all__ = ["mla_qk", "mla_softmax_scale", "split_nope_rope"]


def mla_softmax_scale(qk_nope_head_dim: int, qk_rope_head_dim: int, *,
                      rope_parameters: Mapping[str, Any] | None = None) -> float:
    """The softmax scale of MLA: ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times
    ``mscale**2`` with ``mscale = 0.1 * mscale_all_dim * ln(factor) + 1`` when the rotary
    scaling is not ``"default"`` and sets ``mscale_all_dim`` (DeepSeek-V2 §2.1.3,
    and its YaRN long-context extension; Hugging Face's ``yarn_apply_mscale`` in
    ``modeling_deepseek_v3.py``). ``mscale = 1`` when ``factor <= 1``.

    Args:
      qk_nope_head_dim: per-head query/key features without position (``d_h``), int >= 0.
      qk_rope_head_dim: per-head rotary features (``d_h^R``), int >= 0; the sum must be > 0.
      rope_parameters: HF's ``rope_parameters`` / ``rope_scaling`` dict (``rope_type`` or
        the older ``type``, ``factor``, ``mscale_all_dim``), or ``None`` (no scaling).

    Returns:
      A Python float.

    Raises:
      TypeError: a head width that is not an int; ``rope_parameters`` not a mapping.
      ValueError: a negative width, both zero; ``mscale_all_dim`` set without a positive
        ``factor`` (named ``rope_parameters['factor']``).
    """
    dn = _checks.check_nonneg_int("qk_nope_head_dim", qk_nope_head_dim)
    dr = _checks.check_nonneg_int("qk_rope_head_dim", qk_rope_head_dim)
    if dn + dr == 0:
        raise ValueError("qk_nope_head_dim + qk_rope_head_dim must be > 0 (the query/key "
                         "head width); got 0 + 0.")
    scale = (dn + dr) ** -0.5
    if rope_parameters is None:
        return float(scale)
    if not isinstance(rope_parameters, Mapping):
        raise TypeError(f"rope_parameters must be a dict (HF's rope_parameters) or None; got "
                        f"{type(rope_parameters).__name__}.")
    rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
    mscale_all_dim = rope_parameters.get("mscale_all_dim") or 0
    if rope_type in (None, "default") or not mscale_all_dim:
        return float(scale)
    factor = rope_parameters.get("factor")
    if factor is None or isinstance(factor, bool) or not isinstance(factor, (int, float)) \
            or not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"rope_parameters['factor'] must be a finite number > 0 when "
                         f"mscale_all_dim is set (the YaRN scale s of mscale = 0.1 * "
                         f"mscale_all_dim * ln(s) + 1); got {factor!r}.")
    m = yarn_get_mscale(float(factor), float(mscale_all_dim))
    return float(scale * m * m)


def split_nope_rope(x: jax.Array, qk_nope_head_dim: int,
                    qk_rope_head_dim: int) -> tuple[jax.Array, jax.Array]:
    """Split per-head features in DeepSeek's order ``[nope | rope]`` (HF's
    ``torch.split(q, [qk_nope_head_dim, qk_rope_head_dim], dim=-1)``).

    Args:
      x: ``[..., qk_nope_head_dim + qk_rope_head_dim]`` (e.g. queries ``[B, T, N, H]``).
      qk_nope_head_dim, qk_rope_head_dim: the two widths (ints >= 0).

    Returns:
      ``(nope [..., qk_nope_head_dim], rope [..., qk_rope_head_dim])``, ``x``'s dtype.

    Raises:
      ValueError: ``x``'s last axis is not the sum of the widths; a negative width.
      TypeError: a width that is not an int.
    """
    dn = _checks.check_nonneg_int("qk_nope_head_dim", qk_nope_head_dim)
    dr = _checks.check_nonneg_int("qk_rope_head_dim", qk_rope_head_dim)
    shp = _checks.shape_of(x)
    if not shp or shp[-1] != dn + dr:
        raise ValueError(f"x must have qk_nope_head_dim + qk_rope_head_dim = {dn} + {dr} = "
                         f"{dn + dr} features on its last axis; got shape {shp}.")
    return x[..., :dn], x[..., dn:]


def mla_qk(q_nope: jax.Array, q_rope: jax.Array, k_nope: jax.Array,
           k_rope: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Queries and keys of decoupled-RoPE MLA (DeepSeek-V2 §2.1.3), rope part
    first: ``q = [q_rope | q_nope]``, ``k = [k_rope (shared, broadcast to every head) |
    k_nope]``.

    Rotate them with ``RoPE(rotary_dim=qk_rope_head_dim)`` (inside :func:`jaxpos.attention`,
    or :func:`jaxpos.mla_attention`): its first ``rotary_dim`` features are exactly the rope part.

    All inputs are floating; ``Dn`` may be 0.

    Args:
      q_nope: ``[B, Tq, N, Dn]`` (per head).
      q_rope: ``[B, Tq, N, Dr]`` (per head).
      k_nope: ``[B, Tk, N, Dn]`` (per head, from the up-projected latent).
      k_rope: ``[B, Tk, Dr]`` or ``[B, Tk, 1, Dr]``, the one key rope head all query heads
        share (``W^{KR} h_t``), unrotated.

    Returns:
      ``(q [B, Tq, N, Dr + Dn], k [B, Tk, N, Dr + Dn])`` in the dtype the inputs promote to.

    Raises:
      ValueError: wrong ranks; batch, length, head count or widths that do not match
        (the message names the argument and both shapes).
      TypeError: a non-floating input.
    """
    for name, a, ranks, what in (("q_nope", q_nope, (4,), "[B, Tq, N, Dn]"),
                                 ("q_rope", q_rope, (4,), "[B, Tq, N, Dr]"),
                                 ("k_nope", k_nope, (4,), "[B, Tk, N, Dn]"),
                                 ("k_rope", k_rope, (3, 4), "[B, Tk, Dr] or [B, Tk, 1, Dr]")):
        _checks.check_rank(name, a, ranks, what)
        _checks.check_floating(name, a)
    qn, qr, kn = (_checks.shape_of(a) for a in (q_nope, q_rope, k_nope))
    kr = _checks.shape_of(k_rope)
    if len(kr) == 4:
        if kr[2] != 1:
            raise ValueError(f"k_rope must have one head (the rope key is shared by every "
                             f"query head, DeepSeek-V2 §2.1.3): shape [B, Tk, 1, Dr]; got {kr}.")
        k_rope = k_rope[:, :, 0]
        kr = kr[:2] + kr[3:]
    if qr[:3] != qn[:3]:
        raise ValueError(f"q_rope {qr} and q_nope {qn} must share [B, Tq, N].")
    if kn[0] != qn[0] or kn[2] != qn[2] or kn[3] != qn[3]:
        raise ValueError(f"k_nope must have shape [B, Tk, N, Dn] = [{qn[0]}, Tk, {qn[2]}, "
                         f"{qn[3]}] to match q_nope {qn}; got {kn}.")
    if kr != (kn[0], kn[1], qr[3]):
        raise ValueError(f"k_rope must have shape [B, Tk, Dr] = [{kn[0]}, {kn[1]}, {qr[3]}] "
                         f"(batch and length of k_nope {kn}, width of q_rope {qr}); got {kr}.")
    dtype = jnp.result_type(q_nope, q_rope, k_nope, k_rope)
    q = jnp.concatenate([jnp.asarray(q_rope, dtype), jnp.asarray(q_nope, dtype)], axis=-1)
    k_rope = jnp.broadcast_to(jnp.asarray(k_rope, dtype)[:, :, None, :],
                              (kn[0], kn[1], kn[2], kr[2]))
    k = jnp.concatenate([k_rope, jnp.asarray(k_nope, dtype)], axis=-1)
    return q, k
