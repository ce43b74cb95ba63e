"""The fused kernel over a paged KV cache (forward only, for serving): keys and values
live in fixed-size pages of a shared pool, FlashAttention's paged layout
(``flash_attn_with_kvcache``'s ``block_table``; vLLM, Kwon et al. 2023, §4.1)::

    k_pages, v_pages: [num_pages, page_size, N_kv, H]
    page_table:       int32 [B, pages_per_seq]
    slot s of row b:  page page_table[b, s // page_size], offset s % page_size

The kernel is the dense forward kernel (:mod:`jaxpos.kernels.forward`) with key tiles of
one page: key tile ``j`` of row ``b`` is page ``page_table[b, j]``, read by index from the
pool (``ref.at[page]``; the page table lives in TPU scalar memory). Everything else is
the dense kernel's: the tile schedule built from ``kv_lengths`` (pages past a row's
length are EMPTY tiles, never visited; with ``causal`` or a block mask, pages wholly
hidden are skipped too), score_mod / mask_mod, sinks, GQA (the ``g`` query heads of a KV
head read each page once in decode-shaped calls), RoPE tables on load, key splits.

On GPU (Triton) the pool is a pointer and a page's load is an offset from it; on TPU the
pool is one block of the program (so it must fit the core's VMEM); JAX's TPU
``paged_attention`` instead copies pages from HBM with DMAs driven by its scalar-prefetched
page table, which this kernel does not do.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxpos.core.quantised import is_quantised
from jaxpos.kernels.config import prepare, resolve_mode
from jaxpos.kernels.forward import forward

__all__ = ["paged_attention_kernel", "paged_refusal"]


def _refuse_derivatives(cfg, primals, tangents):
    raise NotImplementedError(
        "the paged kernel runs the forward pass only (serving); it has no gradients. "
        "Differentiate the dense call (jaxpos.attention on contiguous keys) instead.")


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _forward_only(cfg, ops):
    return forward(cfg, ops)


_forward_only.defjvp(_refuse_derivatives)


def paged_refusal(call, page_size: int, pools: tuple[Any, Any] | None = None) -> str | None:
    """Why the paged kernel cannot run ``call`` over pages of ``page_size`` slots (then the
    caller gathers the pages and runs the dense call), or None. ``pools``: the
    ``(k_pages, v_pages)`` it would read (one quantised and the other not is refused).

    The kernel's own limits: a power-of-two page size, the tile along keys equal to it
    (``block_k`` and a block mask's), ``kv_lengths`` given, no dropout (forward only), no
    boolean mask array, and a scheme with no per-token transform of the keys (cached keys
    are stored transformed, e.g. RoPE rotated at write, or rotated on load with
    ``rope_tables``)."""
    from jaxpos.schemes.base import PositionScheme

    if pools is not None and is_quantised(pools[0]) != is_quantised(pools[1]):
        return ("the paged kernel reads both pools quantised (QuantisedPages) or neither; "
                "got one of each.")
    if page_size & (page_size - 1) or page_size < 1:
        return f"the page size must be a power of two (the kernel's key tile); got {page_size}."
    blk = call.block_mask.block_k if call.block_mask is not None else call.block_k
    if blk is not None and blk != page_size:
        return (f"the paged kernel's key tiles are pages: block_k (the block mask's when "
                f"given) must equal the page size {page_size}; got {blk}.")
    if call.kv_lengths is None:
        return "the paged kernel needs kv_lengths (each row's filled slots)."
    if call.dropout is not None:
        return ("the paged kernel is forward-only (serving) and applies no attention "
                "dropout; pass dropout_rate=0.")
    if call.mask is not None:
        return "the paged kernel takes no boolean mask array; express it as a mask_mod."
    if type(call.scheme).transform_qk is not PositionScheme.transform_qk:
        return (f"the paged kernel reads cached keys as stored; the position scheme "
                f"{type(call.scheme).__name__} transforms keys per call.")
    return None


def paged_attention_kernel(call, k_pages: jax.Array, v_pages: jax.Array,
                           page_table: jax.Array, *, interpret: bool | None = None,
                           kv_splits: int | None = None, return_lse: bool = False) -> Any:
    """Attention of ``call``'s queries over keys and values stored in pages.

    It equals the dense kernel (:func:`jaxpos.kernels.fused.kernel_attention`) on the
    keys gathered from the pages (``k[b, s] = k_pages[page_table[b, s // P], s % P]``):
    every score_mod / mask_mod, sinks, causal, GQA, segments, RoPE tables, key splits.

    Args:
      call: a validated, transformed :class:`jaxpos.core.call.AttentionCall` of the
        logical call (its ``k`` and ``v`` are not read): q ``[B, Tq, N, H]``; positions,
        segments and RoPE key tables over the ``Tk = pages_per_seq * page_size`` slots of a
        row; ``kv_lengths`` int32 ``[B]`` (required; values in ``[0, Tk]``);
        ``block_k`` None or the page size.
      k_pages: ``[num_pages, page_size, N_kv, H]`` in q's dtype; ``page_size`` a power of
        two (the kernel's tile along keys).
      v_pages: ``[num_pages, page_size, N_kv, H_v]``. Both may be
        :class:`jaxpos.core.quantised.QuantisedPages` (read as q's dtype): the kernel
        reads their int8 / float8 values and float32 scales and dequantises each page as
        it loads it (before RoPE on load), in float32, to q's dtype.
      page_table: int32 ``[B, pages_per_seq]``: the pages of each row in slot order;
        entries of pages at or past ``ceil(kv_lengths[b] / page_size)`` are never read
        (they may hold anything); the others must be in ``[0, num_pages)`` (the caller
        checks them: an index outside reads another page).
      interpret: True interprets, False compiles (Triton / Mosaic), None interprets on CPU.
      kv_splits: key splits (flash decoding), or None: chosen as for the dense kernel.
      return_lse: also return the float32 ``[B, N, Tq]`` log-sum-exp.

    Returns:
      ``[B, Tq, N, H_v]`` in q's dtype (or ``(out, lse)``). Forward only: differentiating
      raises ``NotImplementedError``.

    Raises:
      ValueError / TypeError: what :func:`paged_refusal` names; ``kv_splits`` not a
        positive integer; ``interpret`` not a bool or None.
    """
    mode = resolve_mode(interpret)
    reason = paged_refusal(call, k_pages.shape[1], (k_pages, v_pages))
    if reason is not None:
        raise ValueError(reason)
    call = call.replace(block_k=call.block_k if call.block_mask is not None
                        else k_pages.shape[1])
    cfg, ops = prepare(call, mode=mode, kv_splits=kv_splits,
                       pages=(k_pages, v_pages, jnp.asarray(page_table, jnp.int32)))
    out, lse = _forward_only(cfg, ops)
    out = out.astype(ops.q.dtype)
    if return_lse:
        return out, lse[:, :, :cfg.Tq, 0]
    return out
