"""One attention function for every position scheme, with interchangeable
implementations.

:func:`attention` validates its arguments once (:func:`jaxpos.core.call.validate_call`, an
immutable :class:`jaxpos.core.call.AttentionCall`), picks an implementation
(:func:`choose_implementation`), applies the scheme's per-token transform once
(:func:`jaxpos.core.call.transform_call`) and hands the record to one runner of
:data:`RUNNERS`:

* ``"reference"``: :func:`jaxpos.core.reference.run_reference`, the dense ground truth;
* ``"chunked"``: :func:`jaxpos.core.chunked.run_chunked`, the online softmax over key blocks
  (Rabe & Staats 2021) with FlashAttention's recomputing backward, ``O(T)`` memory;
* ``"pallas"``: ``jaxpos.kernels.dispatch.run_kernel``, the fused Pallas kernel;
* ``"xla"``: :func:`jaxpos.core.xla.run_xla`, ``jax.nn.dot_product_attention`` (cuDNN on
  NVIDIA GPUs) with the score term as a dense bias.

All implementations ask a scheme the same questions (the protocol of
:mod:`jaxpos.schemes.base`): its per-token transform of q and k, applied once per call, and its
score term as a score_mod (:mod:`jaxpos.mods`), which the paths apply tile by tile with
the user's own ``score_mod`` and ``mask_mod``. Nothing here names a scheme.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import jax
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos.core.call import AttentionCall, apply_rope_tables, transform_call, validate_call
from jaxpos.core.chunked import run_chunked
from jaxpos.core.reference import run_reference
from jaxpos.core.xla import run_xla
from jaxpos.mods import BlockMask
from jaxpos.schemes.base import PositionScheme, as_scheme

__all__ = ["ALL_IMPLEMENTATIONS", "IMPLEMENTATIONS", "RUNNERS", "attention",
           "choose_implementation", "default_implementation"]

#: The tiled implementations (every scheme, mask and feature; compared in the tests).
IMPLEMENTATIONS = ("reference", "chunked", "pallas")
#: Every value ``implementation=`` takes: the tiled ones and ``"xla"``, which hands the
#: transformed q and k to ``jax.nn.dot_product_attention`` (cuDNN on NVIDIA GPUs).
ALL_IMPLEMENTATIONS = IMPLEMENTATIONS + ("xla",)


def default_implementation(position: PositionScheme | None = None, *,
                           score_mod: Callable[..., Any] | None = None,
                           mask_mod: Callable[..., Any] | None = None, q_len: int = 0,
                           kv_len: int = 0, num_heads: int = 1, batch: int = 1) -> str:
    """The implementation ``attention(implementation=None)`` runs, by the measured rule of
    :func:`jaxpos.kernels.choose_implementation` (``docs/kernel.md``): ``"chunked"`` on
    CPU and for schemes the kernel cannot fuse (Shaw); on an NVIDIA GPU ``"xla"``
    (``jax.nn.dot_product_attention``, cuDNN) when there is no score term, or for a
    mask_mod alone while its dense mask fits the budget; else ``"pallas"`` (a score term
    never goes to cuDNN: it would round the bias); ``"pallas"`` on TPU.

    Args:
      position: the scheme (its own score_mod counts as a score term).
      score_mod, mask_mod: the call's (``None`` if absent).
      q_len, kv_len, num_heads, batch: the call's shape (0 / 1 when unknown: the
        dense-bias budget is then not the deciding factor).

    Raises:
      TypeError: ``position`` is not a scheme, ``None`` or ``"none"`` (on every backend).
    """
    scheme = as_scheme(position)
    backend = jax.default_backend()
    if backend == "cpu":
        return "chunked"
    from jaxpos.kernels import choose_implementation

    has_score = score_mod is not None or scheme.score_mod() is not None
    return choose_implementation(backend=backend, fusable=scheme.fusable,
                                 has_score_mod=has_score, has_mask_mod=mask_mod is not None,
                                 Tq=q_len, Tk=kv_len, num_heads=num_heads, batch=batch)


def _run_kernel(call: AttentionCall) -> jax.Array:
    # imported at the call: jaxpos.kernels loads Pallas, and its convenience layer imports
    # scheme modules that import this one
    from jaxpos.kernels.dispatch import run_kernel

    return run_kernel(call)


#: Implementation name -> runner: a function of a validated, transformed
#: :class:`jaxpos.core.call.AttentionCall` returning ``[B, Tq, N, H_v]`` in q's dtype.
RUNNERS: dict[str, Callable[[AttentionCall], jax.Array]] = {
    "reference": run_reference,
    "chunked": run_chunked,
    "pallas": _run_kernel,
    "xla": run_xla,
}


def _dense_only(call: AttentionCall) -> bool:
    """What neither the kernel nor ``dot_product_attention`` takes: a boolean mask array,
    mixed dtypes, a traced scale."""
    return call.mask is not None or not (call.q.dtype == call.k.dtype == call.v.dtype) or \
        not _checks.is_concrete(call.scale)


def choose_implementation(call: AttentionCall, requested: str | None) -> str:
    """The runner for ``call``: ``requested`` when given, else
    :func:`default_implementation`, falling back to ``"chunked"`` for what the kernel and
    ``dot_product_attention`` cannot take (a boolean mask array, mixed dtypes, a traced
    scale, a v wider or narrower than q for ``"xla"``).

    Raises:
      TypeError: ``"pallas"`` / ``"xla"`` requested with a traced scale.
    """
    name = requested
    if name is None:
        name = default_implementation(call.scheme, score_mod=call.score_mod,
                                      mask_mod=call.mask_mod, q_len=call.q_len,
                                      kv_len=call.kv_len, num_heads=call.num_heads,
                                      batch=call.batch)
        width_differs = name == "xla" and call.v.shape[-1] != call.q.shape[-1]
        if name == "xla" and call.kv_lengths is not None:
            name = "pallas"  # the kernel bounds its loops by the lengths
        if name in ("xla", "pallas") and (_dense_only(call) or width_differs):
            name = "chunked"  # what the kernel / dot_product_attention cannot take
        if name == "xla" and call.dropout is not None:
            name = "pallas"  # attention dropout: in the kernel, not in dot_product_attention
    if name in ("xla", "pallas") and not _checks.is_concrete(call.scale):
        raise TypeError(f"implementation={name!r} needs a static scale (a Python or "
                        f"concrete number: it is compiled into the kernel); got a traced "
                        f"scale. Use implementation='chunked' or 'reference' to differentiate "
                        f"or trace the scale.")
    return name


def _check_runner(name: str, call: AttentionCall, head_dim: int) -> None:
    """Refuse what the kernel / ``dot_product_attention`` cannot run (after the transform:
    ``head_dim`` is q's width before it)."""
    if name not in ("pallas", "xla"):
        return
    if name == "xla" and call.dropout is not None:
        raise ValueError(
            f"implementation='xla' (jax.nn.dot_product_attention, which has no dropout) "
            f"does not apply attention dropout (dropout_rate={call.dropout.rate}); use "
            f"implementation='chunked' (the same keep mask, tile by tile), 'pallas' or "
            f"'reference', or implementation=None, which picks the kernel (chunked on CPU).")
    if not call.scheme.fusable:
        what = "the fused Pallas kernel" if name == "pallas" else \
            "implementation='xla' (jax.nn.dot_product_attention)"
        raise ValueError(
            f"{what} does not support the position scheme {type(call.scheme).__name__} (its "
            f"content bias or value term depends on the query content or the weights); use "
            f"implementation='chunked' or 'reference'.")
    if name == "xla" and call.kv_lengths is not None:
        raise ValueError(
            "implementation='xla' (jax.nn.dot_product_attention) does not take kv_lengths; "
            "use implementation='pallas' or 'chunked' (they never visit the unfilled keys).")
    if name == "xla" and call.mask is not None:
        raise ValueError(
            "implementation='xla' (jax.nn.dot_product_attention) does not take a boolean "
            "mask array; express the mask as a mask_mod, or use implementation='chunked'.")
    if name == "xla" and call.v.shape[-1] != head_dim:
        raise ValueError(
            f"implementation='xla' (jax.nn.dot_product_attention) needs v's head_dim to "
            f"equal q's ({head_dim}); got v {call.v.shape}. Use implementation='chunked'.")
    if name == "pallas" and call.mask is not None:
        raise ValueError(
            f"implementation='pallas' does not take a boolean mask array (got shape "
            f"{tuple(call.mask.shape)}): express it as a mask_mod from positions (with "
            f"jaxpos.create_block_mask to skip empty tiles), with causal=, positions or "
            f"segment_ids, or use implementation='chunked'.")


def attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    position: PositionScheme | Literal["none", "nope"] | None = None,
    score_mod: Callable[..., Any] | None = None,
    mask_mod: Callable[..., Any] | None = None,
    block_mask: BlockMask | None = None,
    sinks: ArrayLike | None = None,
    q_positions: ArrayLike | None = None,
    kv_positions: ArrayLike | None = None,
    causal: bool = False,
    mask: ArrayLike | None = None,
    segment_ids: ArrayLike | None = None,
    kv_segment_ids: ArrayLike | None = None,
    scale: ArrayLike | None = None,
    implementation: str | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    kv_lengths: ArrayLike | None = None,
    rope_tables: Any = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    broadcast_dropout: bool = False,
    page_table: ArrayLike | None = None,
) -> jax.Array:
    """Multi-head attention with any position scheme, score_mod and mask_mod.

    ``softmax(score_mod(scale * q k^T) + bias) v`` per head, where the scheme transforms q
    and k per token (RoPE), contributes a score_mod from positions (ALiBi, T5, KERPLE,
    ...; added after scaling, as ``jax.nn.dot_product_attention`` and BLOOM do), and may
    add a content bias and a value term (Shaw). The user's ``score_mod`` runs after the
    scheme's, the ``mask_mod`` and the other masks decide which pairs are visible.

    Args:
      q: ``[B, Tq, N, H]``; k: ``[B, Tk, N_kv, H]``; v: ``[B, Tk, N_kv, H_v]`` (float).
        ``N`` must be a multiple of ``N_kv`` (grouped-query / multi-query attention).
      position: a scheme (:class:`NoPE`, :class:`RoPE`, :class:`ALiBi`,
        :class:`T5Bias`, :class:`Shaw`, ... see ``jaxpos.schemes.base.REGISTRY``) or
        ``None``/``"none"``.
      score_mod: ``(score, batch, head, q_pos, kv_pos) -> score`` on float32 tiles, with
        global int32 positions ``q_pos [tq, 1]``, ``kv_pos [1, tk]`` and the query head
        (see :mod:`jaxpos.mods`); may capture arrays, which receive gradients.
      mask_mod: ``(batch, head, q_pos, kv_pos) -> bool``; True means "may attend".
      block_mask: a :class:`jaxpos.BlockMask` from :func:`jaxpos.create_block_mask` for
        these positions: empty tiles are skipped, full ones need no masking. Its
        ``mask_mod`` is used (``mask_mod`` may be omitted or must be the same function);
        its tile sizes are used by the chunked and Pallas paths.
      sinks: float ``[N]``, a learned logit per query head in the softmax denominator
        (attention sinks, as in GPT-OSS): weights ``exp(s_ij) / (exp(sink_h) + sum_j
        exp(s_ij))``. Differentiable.
      q_positions, kv_positions: integer ``[T]`` or ``[B, T]``. Default ``arange``, with
        queries aligned to the end of the keys when ``Tq < Tk`` (decoding). KV-cache
        offsets, left padding and packed sequences are all position arrays.
      causal: a query at position ``p`` sees keys at positions ``<= p``.
      mask: boolean, broadcastable to ``[B, N, Tq, Tk]``; True means "may attend".
      segment_ids, kv_segment_ids: integer ``[B, Tq]`` / ``[B, Tk]``; only equal ids
        attend (packed sequences). ``kv_segment_ids`` defaults to ``segment_ids``.
      scale: score scale, default ``1 / sqrt(H)``. T5 uses ``scale=1.0``.
      implementation: ``"reference"``, ``"chunked"``, ``"pallas"``, ``"xla"``
        (``jax.nn.dot_product_attention`` on the transformed q and k, with the score term
        materialised as a dense bias: cuDNN on NVIDIA GPUs), or ``None`` for
        :func:`default_implementation`.
      block_q, block_k: tile sizes for ``"chunked"`` (default 256 x 256; any positive size)
        and ``"pallas"`` (the kernel's 128 x 128 defaults; powers of two). T need not be a
        multiple.
      kv_lengths: integer ``[B]`` or None: keys at index ``>= kv_lengths[b]`` are invisible
        to row ``b`` (a KV cache's fill counts); the chunked and Pallas paths never visit
        them, so a decode step costs the filled length (``docs/decoding.md``); the
        reference path masks them on its full grid, so a NaN left there can reach the
        rows (the NaN rule, ``docs/attention.md``). Not taken by ``"xla"``.
      rope_tables: a :class:`jaxpos.schemes.rope.tables.RopeTables` or None: q and k are passed
        unrotated and rotated with these cos/sin tables of their positions, by the Pallas
        kernel and the chunked decode path as they are loaded (``docs/decoding.md``); use
        with ``position=None`` (or a scheme without a per-token transform).
      dropout_rate: attention dropout (Flax's and FlashAttention's): each probability is
        dropped with this rate after the softmax and the kept ones scaled by
        ``1 / (1 - rate)``; a Python float in ``[0, 1)``, default 0 (none). The keep
        mask is a counter-based hash of ``(seed, batch, head, query index, key index)``
        (:mod:`jaxpos.core.dropout`): the reference, chunked and Pallas paths drop the same
        pairs (the tiled paths per tile, never storing a ``[Tq, Tk]`` mask), and the
        backward pass recomputes it. ``"xla"`` refuses it; ``implementation=None`` then
        runs ``"pallas"`` (``"chunked"`` on CPU).
      dropout_rng: a JAX PRNG key, required when ``dropout_rate > 0``.
      broadcast_dropout: one ``[Tq, Tk]`` mask for every batch row and head (Flax's
        ``broadcast_dropout``); default False (independent per row and head).
      page_table: integer ``[B, pages_per_seq]`` or None: k and v are then pages
        ``[num_pages, page_size, N_kv, H]`` and ``kv_lengths`` is required; the call means
        the same call on the keys gathered from the pages (:mod:`jaxpos.core.paged`,
        ``docs/serving.md``).

    Returns:
      ``[B, Tq, N, H_v]`` in q's dtype (softmax and accumulation in float32). A query with
      no visible key returns zeros, with zero gradients.

    Raises:
      ValueError / TypeError: bad ranks, mismatched shapes (naming a likely
        ``[B, N, T, H]`` layout), float positions, a scheme that does not fit the heads or
        contradicts ``causal``, unknown implementation, bad masks, a score_mod returning
        the wrong shape or dtype, a mask_mod not returning bool, a block mask built for
        other lengths or blocks, sinks of the wrong shape, a dropout_rate outside
        ``[0, 1)`` or without dropout_rng, dropout with ``"xla"``.
    """
    _checks.check_choice("implementation", implementation, ALL_IMPLEMENTATIONS + (None,))
    if page_table is not None:  # k and v are pages: jaxpos.core.paged
        from jaxpos.core.paged import paged_attention
        kw = {n: x for n, x in locals().items() if n not in ("q", "k", "v", "paged_attention")}
        return paged_attention(q, k, v, **kw)
    call = validate_call(q, k, v, position=position, score_mod=score_mod, mask_mod=mask_mod,
                         block_mask=block_mask, sinks=sinks, q_positions=q_positions,
                         kv_positions=kv_positions, causal=causal, mask=mask,
                         segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, scale=scale,
                         block_q=block_q, block_k=block_k, kv_lengths=kv_lengths,
                         rope_tables=rope_tables, dropout_rate=dropout_rate,
                         dropout_rng=dropout_rng, broadcast_dropout=broadcast_dropout)
    name = choose_implementation(call, implementation)
    if call.batch == 0 or call.q_len == 0 or call.kv_len == 0:
        return call.zeros()  # nothing to attend from, or no visible key
    head_dim = call.q.shape[-1]
    call = transform_call(call)
    if name in ("reference", "xla"):  # the engines that do not rotate on load
        call = apply_rope_tables(call)
    if implementation is None and name == "xla" and call.q.shape[-1] != call.v.shape[-1]:
        name = "pallas"  # a transform that widens q and k (PoPE); cuDNN cannot
    _check_runner(name, call, head_dim)
    return RUNNERS[name](call)
