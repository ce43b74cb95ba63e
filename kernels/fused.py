"""The fused attention kernel's entry: FlashAttention-2 (Dao 2023, Alg. 1 and 2) forward and
backward as Pallas kernels, programmable by a score_mod and a mask_mod (FlexAttention,
Dong et al. 2024), with block-sparse tile skipping, attention sinks, per-row key lengths,
split-K decoding and RoPE applied to q and k as they are loaded.

Layout. The kernels read q, k, v and write the output and the gradients in the caller's
``[B, T, N, H]`` layout through their BlockSpecs (one head of one tile is a strided block,
as in JAX's ``pallas/ops/gpu/attention.py``): no transpose or padding copy of q, k, v, the
output or the gradients. Rows past ``T`` in a last partial tile and feature columns past
``H`` are handled in the kernel:

* Triton (CUDA / ROCm) blocks are powers of two: the feature block is
  ``next_pow2(max(H, 16))`` wide and every load / store of a tile is masked
  (``pl.load(..., mask=..., other=0)``) on the real rows and columns;
* interpret mode (CPU) and TPU take blocks of the exact width ``H``; rows past ``T`` of a
  last tile are zeroed with ``where`` after the load (those reads are padding) and their
  writes are dropped by Pallas;
* TPU (Mosaic) needs the last two block dims aligned to ``(8, 128)`` or whole, so one head
  of ``[B, T, N, H]`` is a block only through the free reshape ``[B, T, N * H]`` when
  ``H % 128 == 0``; for other head dims the TPU lowering keeps a ``[B, N, T, H]``
  transpose (a copy; TPU only).

Work layout (``B`` batch, ``N`` query heads, ``N_kv`` key/value heads, ``g = N / N_kv``,
``bq`` / ``bk`` tiles):

* forward, grid ``(B, N / G, Tq / bq[, S])``: one query tile of ``G`` query heads per
  program (``G = g`` for decode-shaped calls, where the ``g`` heads that share a KV head
  read each K/V tile once; else ``G = 1``), two loops over key tiles, first the PARTIAL
  tiles of its row of the tile schedule (masked), then the FULL ones (no masking at all),
  with the online softmax (Milakov & Gimelshein 2018). EMPTY tiles are never visited:
  with ``causal=True`` and monotone positions the loop of query tile ``i`` stops at the
  diagonal; with ``kv_lengths`` it stops at the row's filled length. With ``S > 1``
  key splits (flash decoding) each program covers a slice of the key tiles and writes a
  partial output with its log-sum-exp; the partials are combined outside by their
  log-sum-exps. Writes the output and the log-sum-exp ``lse``.
* backward ``dq``, grid ``(B, N, Tq / bq)``: the same loops, recomputing the
  probabilities from ``lse``.
* backward ``dk, dv``, grid ``(B, N_kv, Tk / bk)``: one key tile of one KV head per
  program, looping over the query tiles of its column of the schedule (with causal, from
  the diagonal down) for each of the ``g`` query heads of the group, so dk and dv are
  written once per KV head in k's layout (no per-query-head buffer, no group sum).

Scores are ``scale * q . k`` (float32 accumulation), then the score_mod, then ``-inf``
where hidden. RoPE (Su et al. 2024 §3.4, the ``"half"`` layout) is either applied to q and
k before the kernel, or, with ``rope_tables``, inside it: the kernel takes unrotated q and
k and cos/sin tables of their positions (computed once per call outside the kernels, no
sin/cos in a kernel body), rotates the query tile once per program and each key tile as
it is loaded; the backward rotates dq and dk back (the transpose of the rotation).

The score_mod / mask_mod are traced inside the kernel bodies (see
:mod:`jaxpos.kernels.modeval`): captured arrays are kernel inputs, indexing them becomes
indexed loads (one gather instruction per tile on GPU, whatever the table size), and the
mods see the program's batch and query head and the tile's positions.

Gradients of the captured arrays (and of nothing else) are computed *outside* the
kernels by a blockwise plain-JAX pass that recomputes the score tiles from the saved
``lse`` (:mod:`jaxpos.kernels.const_grads`): exact, lowered by XLA on every backend (a gather's
transpose is a scatter-add, which neither Triton nor Mosaic lowers), and removed by
XLA's dead-code elimination under ``jit`` when no captured array needs a gradient, so
training ``q``, ``k``, ``v`` never pays for it. The sink gradient and the gradient
through a returned ``lse`` come from ``lse`` too: with ``dlse`` the cotangent of the
returned log-sum-exp, ``delta' = rowsum(dO * O) - dlse`` replaces ``delta`` in the
backward kernels (``d lse / d s = p``), and ``d sink_h = -sum_{b,i} exp(sink_h -
lse_bhi) * delta'_bhi``.

Nothing of size ``Tq x Tk`` is written by the kernels. The same kernel bodies are lowered
by Pallas to Triton (``platforms=["cuda"]``) and to Mosaic TPU (``["tpu"]``), and run on
CPU in interpret mode.

The kernel is split by job: :mod:`~jaxpos.kernels.config` (the static configuration and
the one operand record, built from a validated call), :mod:`~jaxpos.kernels.layout`
(platform layouts, tile loads and stores), :mod:`~jaxpos.kernels.tiles` (the pieces of a
kernel body), :mod:`~jaxpos.kernels.plumbing` (``pallas_call``),
:mod:`~jaxpos.kernels.forward` (forward and split-K), :mod:`~jaxpos.kernels.backward`,
:mod:`~jaxpos.kernels.const_grads` and this module (the custom VJP and the entries).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, cast

import jax
import jax.numpy as jnp

from jaxpos import _checks
from jaxpos._util import match_vma, sink_gradient, zero_cotangent
from jaxpos.core import engines
from jaxpos.core.dropout import Dropout
from jaxpos.kernels.backward import backward, backward_rows
from jaxpos.kernels.config import (
    DEFAULT_BLOCK_K,
    DEFAULT_BLOCK_Q,
    KernelConfig,
    Operands,
    prepare,
    resolve_mode,
)
from jaxpos.kernels.const_grads import mod_const_grads
from jaxpos.kernels.forward import forward
from jaxpos.schemes.rope.tables import RopeTables, rope_tables

if TYPE_CHECKING:
    from collections.abc import Callable

    from jax.typing import ArrayLike

    from jaxpos.core.call import AttentionCall
    from jaxpos.mods import BlockMask

__all__ = ["DEFAULT_BLOCK_K", "DEFAULT_BLOCK_Q", "RopeTables", "kernel_attention",
           "kernel_call", "rope_tables", "run_call"]


# ----------------------------------------------------------------------- custom VJP core
def _refuse_second_order(cfg, primals, tangents):
    raise NotImplementedError(
        "implementation='pallas' computes first derivatives only: the fused kernel's "
        "forward and backward passes are not differentiable again (a second derivative, a "
        "Hessian or a Hessian-vector product would differentiate them). Use implementation="
        + ", ".join(repr(p) for p in engines.engines_with("second_derivatives", True))
        + " for higher-order derivatives; they give the exact answer.")


def _first_order_only(fn):
    """``fn(cfg, *arrays)`` whose differentiation raises the clear error above (Pallas
    has no JVP of a kernel with a grid; it fails deep inside)."""
    wrapped = jax.custom_jvp(fn, nondiff_argnums=(0,))
    wrapped.defjvp(_refuse_second_order)
    return wrapped


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfg: KernelConfig, ops: Operands):
    return forward(cfg, ops)


_forward_saved = _first_order_only(forward)


def _core_fwd(cfg, ops):
    out, lse = _forward_saved(cfg, ops)
    return (out, lse), (ops, out, lse)


def _gradients(cfg, ops, out, lse, dout, dlse):
    """The cotangent of the operands (an :class:`Operands` of gradients and zeros)."""
    lse_b, delta = backward_rows(cfg, out, lse, dout, dlse)
    dq, dk, dv = backward(cfg, ops, lse_b, delta, dout)
    # Under shard_map, a cotangent varies over every axis the kernel's inputs did; a primal
    # that was replicated over some of them (captured arrays, sinks, all-gathered keys) gets
    # the sum of the per-shard gradients (match_vma), as in the chunked path.
    cts = jax.tree_util.tree_map(zero_cotangent, ops)._replace(
        q=match_vma(dq.astype(ops.q.dtype), ops.q), k=match_vma(dk.astype(ops.k.dtype), ops.k),
        v=match_vma(dv.astype(ops.v.dtype), ops.v))
    if ops.smod is not None:
        grads = mod_const_grads(cfg, ops, lse_b, dout.astype(ops.v.dtype), delta)
        cts = cts._replace(smod=ops.smod.with_consts([
            zero_cotangent(jnp.asarray(c)) if gr is None
            else match_vma(gr.astype(jnp.result_type(c)), c)
            for c, gr in zip(ops.smod.consts, grads)]))
    if ops.sinks is not None:
        # a row with no visible key and a sink of -inf weighs 0
        cts = cts._replace(sinks=match_vma(
            sink_gradient(ops.sinks, lse_b, delta, 1).astype(ops.sinks.dtype), ops.sinks))
    return cts


_gradients_once = _first_order_only(_gradients)


def _core_bwd(cfg, res, cts):
    ops, out, lse = res
    dout, dlse = cts
    return (_gradients_once(cfg, ops, out, lse, dout, dlse),)


_core.defvjp(_core_fwd, _core_bwd)


# --------------------------------------------------------------------------- the entries
def run_call(call: AttentionCall, *, mode: str = "auto", kv_splits: int | None = None,
             return_lse: bool = False) -> Any:
    """The kernel on a validated, transformed :class:`jaxpos.core.call.AttentionCall`
    (nothing of it is checked again): ``[B, Tq, N, H_v]`` in q's dtype, or ``(out, lse)``
    with ``return_lse`` (``lse`` float32 ``[B, N, Tq]``).

    Raises:
      ValueError / TypeError: the kernel's own limits (tile sizes that are not powers of
        two, ``kv_splits`` not a positive integer).
    """
    cfg, ops = prepare(call, mode=mode, kv_splits=kv_splits)
    # (custom_vjp through functools.partial hides the return type from type checkers)
    out, lse = cast("tuple[jax.Array, jax.Array]", _core(cfg, ops))
    out = out.astype(ops.q.dtype)
    if return_lse:
        return out, lse[:, :, :cfg.Tq, 0]
    return out


def kernel_call(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, q_positions: ArrayLike,
                kv_positions: ArrayLike, score_mod: Callable[..., Any] | None = None,
                mask_mod: Callable[..., Any] | None = None, block_mask: BlockMask | None = None,
                sinks: ArrayLike | None = None, causal: bool = False,
                segment_ids: ArrayLike | None = None, kv_segment_ids: ArrayLike | None = None,
                scale: ArrayLike | None = None, block_q: int | None = None,
                block_k: int | None = None, kv_lengths: ArrayLike | None = None,
                rope_tables: RopeTables | None = None,
                dropout: Dropout | None = None) -> AttentionCall:
    """The validated record of a direct kernel call (:func:`kernel_attention`,
    :func:`jaxpos.kernels.attention_via_kernel`, :func:`jaxpos.kernels.fused_attention`):
    :func:`jaxpos.core.call.validate_call` plus what a direct caller must also meet (one
    dtype for q, k, v; segment ids given in pairs; a :class:`jaxpos.core.dropout.Dropout`).

    Raises:
      ValueError / TypeError: as :func:`jaxpos.core.call.validate_call`; q, k, v of
        different dtypes; one of ``segment_ids`` / ``kv_segment_ids`` alone; ``dropout``
        not a ``Dropout`` or None.
    """
    from jaxpos.core.call import validate_call

    _checks.check_qkv(q, k, v)
    if (segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("segment_ids and kv_segment_ids must be given together; got one.")
    if dropout is not None and not isinstance(dropout, Dropout):
        raise TypeError(f"dropout must be a jaxpos.core.dropout.Dropout or None; got "
                        f"{type(dropout).__name__}.")
    call = validate_call(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), score_mod=score_mod,
                         mask_mod=mask_mod, block_mask=block_mask, sinks=sinks,
                         q_positions=q_positions, kv_positions=kv_positions, causal=causal,
                         segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, scale=scale,
                         block_q=block_q, block_k=block_k, kv_lengths=kv_lengths,
                         rope_tables=rope_tables)
    return call.replace(dropout=dropout)


def kernel_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
                     score_mod: Callable[..., Any] | None = None,
                     mask_mod: Callable[..., Any] | None = None,
                     block_mask: BlockMask | None = None, sinks: ArrayLike | None = None,
                     q_positions: ArrayLike, kv_positions: ArrayLike, causal: bool = False,
                     segment_ids: ArrayLike | None = None,
                     kv_segment_ids: ArrayLike | None = None, scale: ArrayLike | None = None,
                     block_q: int | None = None, block_k: int | None = None,
                     interpret: bool | None = None, kv_lengths: ArrayLike | None = None,
                     rope_tables: RopeTables | None = None, kv_splits: int | None = None,
                     return_lse: bool = False, dropout: Dropout | None = None) -> Any:
    """The fused kernel (see :func:`jaxpos.kernels.attention_via_kernel` for the contract
    of the shared arguments).

    Args (beyond the shared ones):
      kv_lengths: integer ``[B]`` or None: keys at index ``>= kv_lengths[b]`` are invisible
        to every query of row ``b`` and their tiles are never visited (a KV cache's fill
        counts: a decode step costs the filled length, not the cache's size).
      rope_tables: :class:`RopeTables` or None: q and k are unrotated and the kernel
        rotates them as they are loaded (``"half"`` layout), forward and backward.
      kv_splits: key splits of the forward (flash decoding), or None: split a call with a
        single query tile until about :data:`jaxpos.kernels.config.SPLIT_PROGRAMS`
        programs run.
      dropout: a :class:`jaxpos.core.dropout.Dropout` (rate, uint32 ``[2]`` seed, broadcast) or
        None: attention dropout (FlashAttention, Dao et al. 2022, Alg. 2): each tile's
        probabilities are multiplied by ``keep / (1 - rate)`` after the (undropped)
        normaliser is updated, the keep decisions computed in the tile from the seed and the
        tile's query / key indices (:func:`jaxpos.core.dropout.keep_tile`, the reference and
        chunked paths' mask, bit for bit; no ``[Tq, Tk]`` mask is stored); the backward
        kernels recompute them. Key splits are compatible (a split's tiles keep their
        global key indices).
      return_lse: also return the log-sum-exp of each query row's scores (the sinks
        included), float32 ``[B, N, Tq]``, ``-inf`` for a row with no visible key;
        differentiable.

    Returns:
      ``[B, Tq, N, H_v]`` in q's dtype, or ``(out, lse)`` with ``return_lse``. First
      derivatives only: differentiating the gradient raises ``NotImplementedError``
      naming the engines that declare ``second_derivatives``.

    Raises:
      ValueError / TypeError: as :func:`kernel_call`; tile sizes that are not powers of
        two; ``kv_splits`` not a positive integer; ``interpret`` not a bool or None.
    """
    mode = resolve_mode(interpret)
    call = kernel_call(q, k, v, q_positions=q_positions, kv_positions=kv_positions,
                       score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask,
                       sinks=sinks, causal=causal, segment_ids=segment_ids,
                       kv_segment_ids=kv_segment_ids, scale=scale, block_q=block_q,
                       block_k=block_k, kv_lengths=kv_lengths, rope_tables=rope_tables,
                       dropout=dropout)
    return run_call(call, mode=mode, kv_splits=kv_splits, return_lse=return_lse)
