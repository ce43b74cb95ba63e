"""Routing from a position scheme to the fused kernel's arguments.

``jaxpos.attention(..., implementation="pallas")`` calls :func:`attention_via_kernel`;
``jaxpos.default_implementation`` asks :func:`supports_scheme`. The kernel fuses RoPE
(rotation from positions and ``inv_freq``), ALiBi (from the slopes) and T5 (a per-head
vector over clipped offsets); NoPE needs nothing. Shaw's relative keys and values
depend on the query content and add a value term, and an arbitrary boolean ``mask`` is a
``[Tq, Tk]`` array: the kernel supports neither, and says so.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxpos.kernels.fused import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, fused_attention

from jaxpos.schemes import ALiBi, NoPE, PositionScheme, RoPE, T5Bias

__all__ = ["attention_via_kernel", "scheme_to_kernel_args", "supports_scheme"]

_FUSED = (NoPE, RoPE, ALiBi, T5Bias)


def supports_scheme(scheme: PositionScheme) -> bool:
    """True for the schemes the kernel fuses: :class:`NoPE`, :class:`RoPE` (without
    M-RoPE sections), :class:`ALiBi`, :class:`T5Bias` (and their subclasses). False for
    :class:`Shaw` and anything else, so the default implementation falls back to
    ``"chunked"`` for them.

    Raises:
      TypeError: ``scheme`` is not a :class:`jaxpos.PositionScheme` (pass a string or
        ``None`` through :func:`jaxpos.as_scheme` first).
    """
    if not isinstance(scheme, PositionScheme):
        raise TypeError(f"scheme must be a jaxpos PositionScheme (NoPE, RoPE, ALiBi, T5Bias, "
                        f"Shaw); got {type(scheme).__name__} {scheme!r}.")
    if not isinstance(scheme, _FUSED):
        return False
    return not (isinstance(scheme, RoPE) and getattr(scheme, "mrope_section", None) is not None)


def t5_offset_bias(scheme: T5Bias) -> jnp.ndarray:
    """The T5 bias as the kernel's offset vector: float32 ``[N, 2R + 1]``, ``R = max_distance``.

    Entry ``R + r`` is ``table[bucket(r), h]``, computed by the scheme's own ``bias`` method
    on positions ``q = 0``, ``kv = r``. Exact for every offset: past ``max_distance`` each
    direction's bucket is its last one (Raffel et al. 2020 §2.1), so clipping to ``±R``
    changes nothing. Differentiable in ``scheme.table`` (a gather; autodiff scatters back).
    """
    R = scheme.max_distance
    rel = jnp.arange(-R, R + 1, dtype=jnp.int32)[None, :]
    b = scheme.bias(None, jnp.zeros((1, 1), jnp.int32), rel)  # [1, N, 1, 2R + 1]
    return b[0, :, 0, :]


def scheme_to_kernel_args(scheme: PositionScheme, q_positions, kv_positions) -> dict:
    """Keyword arguments of :func:`fused_attention` that express ``scheme``.

    Raises:
      ValueError: the scheme is not one the kernel fuses (e.g. :class:`Shaw`).
    """
    if not supports_scheme(scheme):
        raise ValueError(
            f"the fused Pallas kernel does not support the position scheme "
            f"{type(scheme).__name__} (it fuses NoPE, RoPE, ALiBi and T5Bias); use "
            f"implementation='chunked' or 'reference'.")
    if isinstance(scheme, RoPE):
        inv_freq, af = scheme.frequencies(q_positions, kv_positions)
        return {"inv_freq": inv_freq, "rope_layout": scheme.layout, "attention_factor": af,
                "angle_precision": scheme.angle_precision}
    if isinstance(scheme, ALiBi):
        return {"alibi_slopes": scheme.slopes, "alibi_bidirectional": scheme.bidirectional}
    if isinstance(scheme, T5Bias):
        return {"offset_bias": t5_offset_bias(scheme)}
    return {}


def attention_via_kernel(q, k, v, *, scheme, q_positions, kv_positions, causal, mask,
                         segment_ids, kv_segment_ids, scale, block_q, block_k):
    """``jaxpos.attention(..., implementation="pallas")``: the fused kernel for ``scheme``.

    Arguments arrive validated by :func:`jaxpos.attention`: q ``[B, Tq, N, H]``, k and v
    ``[B, Tk, N_kv, H]``, positions int32 ``[B|1, T]``, segment ids int32 ``[B, T]`` or
    None, ``mask`` 4-D bool or None, ``scale`` a float, blocks ints or None (128).
    Runs interpreted on CPU and compiled on GPU (Triton) / TPU (Mosaic).

    Returns:
      ``[B, Tq, N, H_v]`` in q's dtype.

    Raises:
      ValueError: a ``mask`` (the kernel has no ``[Tq, Tk]`` input: express it with
        ``causal``, positions or segment ids, or use ``implementation="chunked"``); a
        scheme the kernel does not fuse (Shaw, M-RoPE).
    """
    if mask is not None:
        raise ValueError(
            f"implementation='pallas' does not support an arbitrary boolean mask (got shape "
            f"{tuple(mask.shape)}); express it with causal=, positions or segment_ids, or use "
            f"implementation='chunked'.")
    kw = scheme_to_kernel_args(scheme, q_positions, kv_positions)
    return fused_attention(q, k, v, q_positions=q_positions, kv_positions=kv_positions,
                           causal=causal, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                           scale=scale, block_q=block_q or DEFAULT_BLOCK_Q,
                           block_k=block_k or DEFAULT_BLOCK_K, interpret=None, **kw)
