"""One attention function for every position scheme, with interchangeable engines.

:func:`attention` validates its arguments once (:func:`jaxpos.core.call.validate_call`, an
immutable :class:`jaxpos.core.call.AttentionCall`), applies the scheme's per-token
transform once (:func:`jaxpos.core.call.transform_call`), picks an engine
(:func:`jaxpos.core.engines.select_engine`: the requested one, or the first of the
backend's preference list that takes the call) and runs it. The engines are registered in
:mod:`jaxpos.core.engines`: ``"reference"`` (the dense ground truth), ``"chunked"`` (the
online softmax over key blocks, Rabe & Staats 2021, with FlashAttention's recomputing
backward, ``O(T)`` memory), ``"xla"`` (``jax.nn.dot_product_attention``, cuDNN on NVIDIA
GPUs, with the score term as a dense bias), ``"pallas"`` (the fused Pallas kernel), and any
engine a user registers with :func:`jaxpos.register_engine`.

All engines ask a scheme the same questions (the protocol of :mod:`jaxpos.schemes.base`):
its per-token transform of q and k, applied once per call, and its score term as a
score_mod (:mod:`jaxpos.mods`), which the engines apply tile by tile with the user's own
``score_mod`` and ``mask_mod``. Nothing here names a scheme or an engine.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos.core import engines
from jaxpos.core.call import transform_call, validate_call
from jaxpos.core.paged import paged_attention
from jaxpos.core.ragged import ragged_attention
from jaxpos.core.xla import DENSE_BIAS_BUDGET_BYTES, GPU_BACKENDS, xla_preferred
from jaxpos.mods import BlockMask
from jaxpos.schemes.base import PositionScheme, as_scheme

__all__ = ["ALL_IMPLEMENTATIONS", "IMPLEMENTATIONS", "attention", "choose_implementation",
           "default_implementation"]

#: The built-in tiled engines (every scheme, mask and feature; compared in the tests),
#: as the registry names them.
IMPLEMENTATIONS = engines.BUILT_IN_TILED
#: The built-in engines: the tiled ones and ``"xla"``, which hands the transformed q and k
#: to ``jax.nn.dot_product_attention`` (cuDNN on NVIDIA GPUs).
#: :func:`jaxpos.core.engines.engine_names` lists these and the registered ones.
ALL_IMPLEMENTATIONS = engines.BUILT_IN


def choose_implementation(*, backend: str, fusable: bool, has_score_mod: bool,
                          has_mask_mod: bool, Tq: int, Tk: int, num_heads: int, batch: int,
                          dense_bias_budget_bytes: int | None = None) -> str:
    """The implementation ``jaxpos.attention(implementation=None)`` should use.

    The rule (measured on an NVIDIA H200, bf16, causal, B=4 N=16 H=128, T=8192; see
    ``docs/kernel.md``):

    * ``backend == "cpu"`` -> ``"chunked"`` (``O(T)`` memory; the kernel only runs in the
      slow Pallas interpreter there);
    * a scheme that is not ``fusable`` (Shaw) -> ``"chunked"``, on every backend;
    * ``"tpu"`` -> ``"pallas"`` (Mosaic; XLA's attention materialises ``T x T`` scores);
    * NVIDIA GPU (``"gpu"`` / ``"cuda"``) with no score_mod and no mask_mod (NoPE, RoPE,
      xPos: their transform is applied before) -> ``"xla"``: cuDNN's flash attention
      (measured 500 TFLOP/s forward, 483 forward+backward) beats the Pallas kernel
      (171 / 172);
    * NVIDIA GPU with a score term (a score_mod, the scheme's included) -> ``"pallas"``:
      the kernel applies it in float32 tile by tile. cuDNN is not used for a bias
      (:func:`jaxpos.core.xla.cudnn_allowed`): it takes the bias in the inputs' dtype, which
      rounds the term (BLOOM's ``slopes[h] * kv_pos`` was 0.64 off in bfloat16), and its
      bias gradient is wrong for batch > 1 (https://github.com/jax-ml/jax/issues/30593);
      the 284 / 197 TFLOP/s once measured for ALiBi through cuDNN came from that path;
    * NVIDIA GPU with a mask_mod only -> ``"xla"`` (cuDNN with the mask materialised
      densely; no bias, so no bias gradient) while that dense array,
      ``batch * num_heads * Tq * Tk * 4`` bytes, fits ``dense_bias_budget_bytes``
      (default :data:`DENSE_BIAS_BUDGET_BYTES`, 1 GiB); above it ``"pallas"``, whose
      memory is ``O(T)``. A window is a mask_mod, never cuDNN's ``local_window_size``
      (its non-causal window attends to the future: https://github.com/jax-ml/jax/pull/39576);
    * any other backend (ROCm, where cuDNN is absent) -> ``"pallas"`` if fusable.

    Args:
      backend: ``jax.default_backend()`` (``"cpu"``, ``"gpu"``, ``"cuda"``, ``"rocm"``,
        ``"tpu"``).
      fusable: the scheme's ``fusable`` property.
      has_score_mod, has_mask_mod: whether the call has a score term / a mask_mod (a
        scheme's own score_mod counts).
      Tq, Tk, num_heads, batch: the call's shape.
      dense_bias_budget_bytes: override of :data:`DENSE_BIAS_BUDGET_BYTES`.

    Returns:
      ``"pallas"``, ``"xla"`` or ``"chunked"``.

    Raises:
      TypeError: ``backend`` not a string; a shape that is not an integer.
      ValueError: a negative shape.
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string such as jax.default_backend(); got "
                        f"{type(backend).__name__} {backend!r}.")
    for name, n in (("Tq", Tq), ("Tk", Tk), ("num_heads", num_heads), ("batch", batch)):
        _checks.check_nonneg_int(name, n)
    budget = DENSE_BIAS_BUDGET_BYTES if dense_bias_budget_bytes is None else \
        _checks.check_nonneg_int("dense_bias_budget_bytes", dense_bias_budget_bytes)
    backend = backend.lower()
    if backend == "cpu" or not fusable:
        return "chunked"
    if backend == "tpu":
        return "pallas"
    if backend in GPU_BACKENDS:
        dense_bytes = int(batch) * int(num_heads) * int(Tq) * int(Tk) * 4
        return "xla" if xla_preferred(has_score_mod=has_score_mod, has_mask_mod=has_mask_mod,
                                      dense_bytes=dense_bytes, budget=budget) else "pallas"
    return "pallas"


def default_implementation(position: PositionScheme | None = None, *,
                           score_mod: Callable[..., Any] | None = None,
                           mask_mod: Callable[..., Any] | None = None, q_len: int = 0,
                           kv_len: int = 0, num_heads: int = 1, batch: int = 1) -> str:
    """The built-in engine ``attention(implementation=None)`` runs for a call with these
    features, by the measured rule of :func:`choose_implementation`
    (``docs/kernel.md``): ``"chunked"`` on CPU and for schemes the kernel cannot fuse
    (Shaw); on an NVIDIA GPU ``"xla"`` (``jax.nn.dot_product_attention``, cuDNN) when
    there is no score term, or for a mask_mod alone while its dense mask fits the
    budget; else ``"pallas"`` (a score term never goes to cuDNN: it would round the
    bias); ``"pallas"`` on TPU. A call with a boolean mask array or a traced
    scale, kv_lengths or dropout is then handed on as
    :func:`jaxpos.core.engines.select_engine` says.

    Args:
      position: the scheme (its own score_mod counts as a score term).
      score_mod, mask_mod: the call's (``None`` if absent).
      q_len, kv_len, num_heads, batch: the call's shape (0 / 1 when unknown: the
        dense-bias budget is then not the deciding factor).

    Returns:
      ``"chunked"``, ``"xla"`` or ``"pallas"``.

    Raises:
      TypeError: ``position`` is not a scheme, ``None`` or ``"none"`` (on every backend).
    """
    scheme = as_scheme(position)
    backend = jax.default_backend()
    if backend == "cpu":
        return "chunked"
    has_score = score_mod is not None or scheme.score_mod() is not None
    return choose_implementation(backend=backend, fusable=scheme.fusable,
                                 has_score_mod=has_score, has_mask_mod=mask_mod is not None,
                                 Tq=q_len, Tk=kv_len, num_heads=num_heads, batch=batch)


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
    cu_q_lengths: ArrayLike | None = None,
) -> jax.Array:
    """Multi-head attention with any position scheme, score_mod and mask_mod.

    ``softmax(score_mod(scale * q k^T) + bias) v`` per head, where the scheme transforms q
    and k per token (RoPE), contributes a score_mod from positions (ALiBi, T5, KERPLE,
    ...; added after scaling, as ``jax.nn.dot_product_attention`` and BLOOM do), and may
    add a content bias and a value term (Shaw). The user's ``score_mod`` runs after the
    scheme's, the ``mask_mod`` and the other masks decide which pairs are visible.

    Args:
      q: ``[B, Tq, N, H]``; k: ``[B, Tk, N_kv, H]``; v: ``[B, Tk, N_kv, H_v]``, of one
        float dtype (float32, bfloat16, float16; float64 under x64). ``N`` must be a
        multiple of ``N_kv`` (grouped-query / multi-query attention).
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
        queries aligned to the end of the keys when ``Tq < Tk`` (decoding); with
        ``kv_lengths`` and ``Tq < Tk`` (a call on a cache, dense or paged) to the end of
        each row's fill: query ``i`` at ``kv_lengths[b] - Tq + i``, as in
        ``flash_attn_with_kvcache`` (a right-padded call with ``Tq == Tk`` keeps
        ``arange``). KV-cache offsets, left padding and packed sequences are all position
        arrays.
      causal: a query at position ``p`` sees keys at positions ``<= p``.
      mask: boolean, broadcastable to ``[B, N, Tq, Tk]``; True means "may attend".
      segment_ids, kv_segment_ids: integer ``[B, Tq]`` / ``[B, Tk]``; only equal ids
        attend (packed sequences). ``kv_segment_ids`` defaults to ``segment_ids``.
      scale: score scale, default ``1 / sqrt(H)``. T5 uses ``scale=1.0``.
      implementation: an engine name (:func:`jaxpos.core.engines.engine_names`):
        ``"reference"``, ``"chunked"``, ``"pallas"``, ``"xla"``
        (``jax.nn.dot_product_attention`` on the transformed q and k, with the score term
        materialised as a dense bias: cuDNN on NVIDIA GPUs), one registered with
        :func:`jaxpos.register_engine`, or ``None``: the first engine of the backend's
        preference list that takes the call (:func:`jaxpos.core.engines.select_engine`;
        :func:`default_implementation` gives the measured rule).
      block_q, block_k: tile sizes for ``"chunked"`` (default 256 x 256; any positive size)
        and ``"pallas"`` (the kernel's 128 x 128 defaults; powers of two). T need not be a
        multiple.
      kv_lengths: integer ``[B]`` in ``[0, Tk]`` or None: keys at index ``>= kv_lengths[b]``
        are invisible to row ``b`` (a KV cache's fill counts; a traced length outside
        ``[0, Tk]`` makes its row NaN, the cache-overflow rule); the chunked and Pallas
        paths never visit them, so a decode step costs the filled length (``docs/decoding.md``); the
        reference path masks them on its full grid. What they hold (NaN included) never
        reaches the output or the gradients on any path: they are not inputs (the NaN
        rule, ``docs/attention.md``, covers the filled keys). Not taken by ``"xla"``.
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
      cu_q_lengths: integer ``[B + 1]`` or None: a ragged call (JAX's
        ``ragged_paged_attention`` layout, :mod:`jaxpos.core.ragged`; needs
        ``page_table``): q is then packed ``[total_q, N, H]``, row ``b``'s queries
        ``q[cu_q_lengths[b]:cu_q_lengths[b + 1]]`` are its newest tokens (counted in
        ``kv_lengths[b]``), ``q_positions`` is ``[total_q]`` (default: the end of each
        row's fill) and the output ``[total_q, N, H_v]``; each row means the dense call of
        that row. Concrete lengths that do not fit raise ``ValueError``; traced ones make
        the row's queries NaN (all of them for a malformed ``cu_q_lengths``).

    Returns:
      ``[B, Tq, N, H_v]`` in q's dtype (softmax and accumulation in float32). A query with
      no visible key returns zeros, with zero gradients.

    Raises:
      ValueError / TypeError: bad ranks, mismatched shapes (naming a likely
        ``[B, N, T, H]`` layout), q, k and v of different dtypes (a ``TypeError``, as
        ``jax.nn.dot_product_attention`` refuses them; cast first), float positions, a
        scheme that does not fit the heads or contradicts ``causal``, unknown
        implementation, bad masks, a score_mod returning the wrong shape or dtype, a
        mask_mod not returning bool, a block mask built for other lengths or blocks,
        sinks of the wrong shape, a dropout_rate outside ``[0, 1)`` or without
        dropout_rng, dropout with ``"xla"``, concrete kv_lengths outside ``[0, Tk]``, an
        engine that refuses the call (its reason).
    """
    if implementation is not None:
        engines.get_engine(implementation)  # an unknown name fails before anything else
    if page_table is not None:  # k and v are pages: jaxpos.core.paged / jaxpos.core.ragged
        run_pages = paged_attention if cu_q_lengths is None else \
            functools.partial(ragged_attention, cu_q_lengths=cu_q_lengths)
        return run_pages(
            q, k, v, page_table=page_table, kv_lengths=kv_lengths,
            implementation=implementation, position=position, score_mod=score_mod,
            mask_mod=mask_mod, block_mask=block_mask, sinks=sinks, q_positions=q_positions,
            kv_positions=kv_positions, causal=causal, mask=mask, segment_ids=segment_ids,
            kv_segment_ids=kv_segment_ids, scale=scale, block_q=block_q, block_k=block_k,
            rope_tables=rope_tables, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
            broadcast_dropout=broadcast_dropout)
    if cu_q_lengths is not None:
        raise ValueError("cu_q_lengths (the packed queries of a ragged call) needs page_table: "
                         "the ragged call reads a paged cache (docs/serving.md).")
    call = validate_call(q, k, v, position=position, score_mod=score_mod, mask_mod=mask_mod,
                         block_mask=block_mask, sinks=sinks, q_positions=q_positions,
                         kv_positions=kv_positions, causal=causal, mask=mask,
                         segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, scale=scale,
                         block_q=block_q, block_k=block_k, kv_lengths=kv_lengths,
                         rope_tables=rope_tables, dropout_rate=dropout_rate,
                         dropout_rng=dropout_rng, broadcast_dropout=broadcast_dropout)
    call = transform_call(call)
    engine = engines.select_engine(call, implementation)
    if call.batch == 0 or call.q_len == 0 or call.kv_len == 0:
        return call.zeros()  # nothing to attend from, or no visible key
    return engines.run(engine, call)
