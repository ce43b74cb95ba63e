"""The kernel's engine (``implementation="pallas"``, registered here) and the measured rule
that picks a built-in engine per backend (the ``"xla"`` engine lives in
:mod:`jaxpos.core.xla`).

The dependency runs one way: this package imports :mod:`jaxpos.core`, the core never
imports it. :mod:`jaxpos` names this module as the ``"pallas"`` engine's
(:func:`jaxpos.core.engines.register_engine_module`), so the core's registry imports it on
the first call that asks for the engine, and it registers :class:`PallasEngine` itself.

* :class:`PallasEngine`: the ``"pallas"`` engine of :mod:`jaxpos.core.engines`.
* :func:`attention_via_kernel`: the fused Pallas kernel (:mod:`jaxpos.kernels.fused`) on
  already-transformed q and k, as a public function.
* :func:`choose_implementation`: which of ``"pallas"``, ``"xla"``, ``"chunked"`` is the
  fastest correct path on a backend for a call's features (``docs/kernel.md`` has the
  measurements behind it); it lives in :mod:`jaxpos.core.entry` (the core decides which
  engine runs, and never imports this package) and is re-exported here.
* :func:`supports_scheme`: whether the kernel can run a scheme (the scheme protocol's
  ``fusable``).

Nothing here names a position scheme: schemes reach the kernel as a per-token transform
(applied by the caller) and a score_mod.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from jaxpos.core import engines
from jaxpos.core.entry import choose_implementation
from jaxpos.core.xla import DENSE_BIAS_BUDGET_BYTES
from jaxpos.kernels.config import float64_refusal
from jaxpos.kernels.fused import kernel_attention, run_call
from jaxpos.kernels.paged import paged_attention_kernel, paged_refusal

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    import jax
    from jax.typing import ArrayLike

    from jaxpos.core.call import AttentionCall
    from jaxpos.mods import BlockMask

__all__ = ["DENSE_BIAS_BUDGET_BYTES", "PallasEngine", "attention_via_kernel",
           "choose_implementation", "run_kernel", "supports_scheme"]


def supports_scheme(scheme: Any) -> bool:
    """True when the fused kernel can run ``scheme``: the scheme protocol's ``fusable``
    (no term that depends on the query content or on the attention weights).

    Raises:
      TypeError: ``scheme`` is not a position scheme (pass a string or ``None`` through
        :func:`jaxpos.as_scheme` first).
    """
    from jaxpos.schemes.base import PositionScheme

    if not isinstance(scheme, PositionScheme) or not hasattr(scheme, "fusable"):
        raise TypeError(f"scheme must be a jaxpos PositionScheme (NoPE(), RoPE(...), "
                        f"ALiBi(...), ...); got {type(scheme).__name__} {scheme!r}.")
    return bool(scheme.fusable)


def attention_via_kernel(q: jax.Array, k: jax.Array, v: jax.Array, *,
                         score_mod: Callable[..., Any] | None = None,
                         mask_mod: Callable[..., Any] | None = None,
                         block_mask: BlockMask | None = None, sinks: ArrayLike | None = None,
                         q_positions: ArrayLike, kv_positions: ArrayLike, causal: bool = False,
                         segment_ids: ArrayLike | None = None,
                         kv_segment_ids: ArrayLike | None = None, scale: ArrayLike | None = None,
                         block_q: int | None = None, block_k: int | None = None,
                         interpret: bool | None = None) -> jax.Array:
    """``jaxpos.attention(..., implementation="pallas")``: the fused Pallas kernel.

    Computes, per batch ``b`` and query head ``h`` (key/value head ``h // (N / N_kv)``),
    FlashAttention-2 style (Dao 2023) with FlexAttention's programming model (Dong et al.
    2024)::

        s[i, j] = score_mod(scale * q_i . k_j, b, h, q_pos_i, kv_pos_j)
        s[i, j] = -inf unless visible(i, j)      # causal, segments, mask_mod
        out_i   = sum_j exp(s_ij) v_j / (exp(sinks[h]) + sum_j exp(s_ij))

    Args:
      q: ``[B, Tq, N, H]`` float32 / bfloat16 / float16, already transformed by the scheme
        (RoPE rotation etc.: the kernel rotates nothing).
      k: ``[B, Tk, N_kv, H]``; v: ``[B, Tk, N_kv, H_v]``, q's dtype; ``N % N_kv == 0``.
      score_mod: ``(score, batch, head, q_pos, kv_pos) -> score`` or None (see
        :mod:`jaxpos.mods`); traced inside the kernel; its captured arrays are kernel
        inputs and receive gradients.
      mask_mod: ``(batch, head, q_pos, kv_pos) -> bool`` or None (``block_mask.mask_mod``
        when None and a block mask is given).
      block_mask: a :class:`jaxpos.mods.BlockMask` or None: EMPTY tiles are never visited,
        the mask_mod runs on PARTIAL tiles only; its ``block_q`` / ``block_k`` are used.
      sinks: float ``[N]`` or None: a per-head logit in the softmax denominator
        (attention sinks, as in GPT-OSS); differentiable.
      q_positions, kv_positions: integer ``[T]``, ``[1, T]`` or ``[B, T]``.
      causal: keys at positions ``<= q_pos`` only.
      segment_ids, kv_segment_ids: integer ``[B, Tq]`` / ``[B, Tk]`` (equal ids attend)
        or None.
      scale: Python float, default ``1 / sqrt(H)``.
      block_q, block_k: tile sizes, powers of two (default 128, shrunk for short
        sequences; TPU needs multiples of 8 and 128); the block mask's when given.
      interpret: True runs the Pallas interpreter, False compiles (Triton on GPU, Mosaic on
        TPU), None interprets on CPU and compiles elsewhere.

    Returns:
      ``[B, Tq, N, H_v]`` in q's dtype. A query row with no visible key returns zeros
      with zero gradients; NaN inputs propagate as NaN.

    Raises:
      ValueError / TypeError: bad ranks, shapes or dtypes; block sizes that are not powers
        of two; a block mask built for other lengths or blocks; sinks not ``[N]``; a
        score_mod / mask_mod that returns the wrong shape or dtype.
    """
    out = kernel_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod,
                           block_mask=block_mask, sinks=sinks, q_positions=q_positions,
                           kv_positions=kv_positions, causal=causal, segment_ids=segment_ids,
                           kv_segment_ids=kv_segment_ids, scale=scale, block_q=block_q,
                           block_k=block_k, interpret=interpret)
    return cast("jax.Array", out)  # return_lse=False: the output alone


def run_kernel(call: AttentionCall, *, return_lse: bool = False
               ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The ``"pallas"`` engine's run: the fused kernel on a validated, transformed call
    (:func:`jaxpos.core.call.validate_call`, :func:`jaxpos.core.call.transform_call`;
    nothing is checked again here). ``[B, Tq, N, H_v]`` in q's dtype, or ``(out, lse
    float32 [B, N, Tq])`` with ``return_lse``."""
    return run_call(call, return_lse=return_lse)


# ------------------------------------------------------------------ the engine
class PallasEngine:
    """``implementation="pallas"``: the fused Pallas kernel (FlashAttention-2 style with
    FlexAttention's programming model; Triton on GPU, Mosaic on TPU, the interpreter on
    CPU). It rotates RoPE tables on load and bounds its loops by ``kv_lengths``."""

    name = "pallas"
    rotates_on_load = True
    second_derivatives = False  # the kernel's backward is not differentiable again
    varying_types_on_cpu = False  # the Pallas interpreter inside shard_map

    def refuses(self, call: AttentionCall) -> str | TypeError | None:
        """What :func:`jaxpos.core.engines.fused_refusal` refuses, a boolean mask array,
        and float64 operands where the kernel is compiled (off CPU;
        :func:`jaxpos.kernels.config.float64_refusal`)."""
        mask = None if call.mask is None else (
            f"implementation='pallas' does not take a boolean mask array (got shape "
            f"{tuple(call.mask.shape)}): express it as a mask_mod from positions (with "
            f"jaxpos.create_block_mask to skip empty tiles), with causal=, positions or "
            f"segment_ids, or use implementation='chunked'.")
        wide = float64_refusal((call.q.dtype, call.k.dtype, call.v.dtype), "auto")
        return engines.fused_refusal(self.name, "the fused Pallas kernel", call) or mask or wide

    def run(self, call: AttentionCall) -> jax.Array:
        """:func:`run_kernel`."""
        return cast("jax.Array", run_kernel(call))

    def run_with_lse(self, call: AttentionCall) -> tuple[jax.Array, jax.Array]:
        """``(out [B, Tq, N, H_v], lse float32 [B, N, Tq])`` from the kernel (the sinks in
        the lse; both differentiable)."""
        return cast("tuple[jax.Array, jax.Array]", run_kernel(call, return_lse=True))

    def run_paged(self, call: AttentionCall, k_pages: jax.Array, v_pages: jax.Array,
                  page_table: jax.Array) -> jax.Array | None:
        """The paged call on the pages themselves (:mod:`jaxpos.kernels.paged`: key tiles
        of one page read through ``page_table``), or None when the paged entry does not
        take it: a page size that is not a power of two, a block mask, dropout, a
        ``block_k`` other than the page size, a scheme that transforms keys per call
        (:func:`jaxpos.kernels.paged.paged_refusal`). The caller then runs the kernel on
        the gathered keys. ``page_table`` holds only valid page indices; the pages are in
        q's dtype (the call's validation refuses mixed dtypes)."""
        if (call.block_mask is not None
                or paged_refusal(call, k_pages.shape[1], (k_pages, v_pages)) is not None):
            return None
        return paged_attention_kernel(call.replace(block_k=None), k_pages, v_pages,
                                      page_table)


engines.register_engine(PallasEngine())
