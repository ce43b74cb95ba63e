"""``jaxpos.attention(..., implementation="xla")``: ``jax.nn.dot_product_attention``
(cuDNN's fused attention on NVIDIA GPUs) on already-transformed q and k, with jaxpos's
semantics: the score_mod materialised as a dense bias (or, when it is not a pure added
term, dense attention in XLA), the mask_mod and segments as a dense boolean mask, sinks as
one extra key.

* :class:`XlaEngine`: the ``"xla"`` engine (registered here) on a validated call;
* :func:`attention_via_xla`: the same computation as a public function that checks its own
  arguments (also ``jaxpos.kernels.attention_via_xla``);
* :func:`xla_preferred`: the engine's cost rule (cuDNN beats the kernel without a score
  term; a mask only while its dense array fits :data:`DENSE_BIAS_BUDGET_BYTES`);
* :func:`sdpa`: ``jax.nn.dot_product_attention`` with the cuDNN-then-XLA fallback;
* :func:`dense_attention`: dense XLA attention for a score_mod that is not an added term.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos.core import engines
from jaxpos.core.call import AttentionCall, converted_mods, validate_call
from jaxpos.core.tiles import online_softmax_step, softmax_finish, softmax_start
from jaxpos.mods import ConvertedMod, apply_mod, is_additive, reads_input

__all__ = ["DENSE_BIAS_BUDGET_BYTES", "GPU_BACKENDS", "XlaEngine", "adds_a_term",
           "attention_via_xla", "cudnn_allowed", "dense_attention", "is_arange", "run_xla",
           "sdpa", "xla_preferred", "xla_refusal"]

#: ``jax.default_backend()`` names of NVIDIA GPUs (where cuDNN is available).
GPU_BACKENDS = ("gpu", "cuda")
#: Largest dense mask :func:`xla_preferred` lets the ``"xla"`` engine materialise rather
#: than hand a mask_mod to the kernel: ``B * N * Tq * Tk * 4`` bytes. 1 GiB per attention
#: call (e.g. B=1, N=16, T=4096); see ``docs/kernel.md``.
DENSE_BIAS_BUDGET_BYTES = 1 << 30


def xla_preferred(*, has_score_mod: bool, has_mask_mod: bool, dense_bytes: int,
                  budget: int | None = None) -> bool:
    """The ``"xla"`` engine's cost rule on an NVIDIA GPU (measured on an H200, bf16, causal,
    B=4 N=16 H=128, T=8192; ``docs/kernel.md``): cuDNN's flash attention (500 TFLOP/s
    forward, 483 forward+backward) beats the Pallas kernel (171 / 172) when the call has
    no score term; a mask_mod alone is materialised as a dense mask while it fits
    ``budget`` (default :data:`DENSE_BIAS_BUDGET_BYTES`); a score term never goes to cuDNN
    (:func:`cudnn_allowed`), so the kernel, which applies it in float32, runs it.

    Args:
      has_score_mod, has_mask_mod: the call has a score term (the scheme's included) / a
        mask_mod. dense_bytes: ``B * N * Tq * Tk * 4``. budget: bytes, or None.
    """
    if has_score_mod:
        return False
    limit = DENSE_BIAS_BUDGET_BYTES if budget is None else budget
    return not has_mask_mod or dense_bytes <= limit


def is_arange(pos: Any, T: int) -> bool:
    """True when ``pos`` is known (not traced) and equals ``arange(T)`` in every row."""
    if not _checks.is_concrete(pos):
        return False
    p = np.asarray(pos)
    return bool(np.all(p == np.arange(T)))


def adds_a_term(conv: ConvertedMod | None) -> bool:
    """True when a converted score_mod is ``score + term`` with ``term`` independent of
    the score, so that it can be materialised as a bias (the mod at score 0).

    Decided from the mod's jaxpr: its output must be reached from the score input
    through ``add`` / ``sub`` only, each adding something that does not depend on the
    score. The derivative alone cannot tell: a straight-through mod
    ``s + stop_gradient(f(s) - s)`` has ``d/ds = 1`` but the value ``f(s)``. Anything
    else (a soft cap, a scale, a mod wrapped in ``jax.jit``) is "not a term" and runs as
    dense attention, which computes every mod exactly."""
    if conv is None:
        return True
    if not is_additive(conv):
        return False
    jaxpr = conv.jaxpr
    score = id(jaxpr.invars[0])
    dep, plus = {score}, {score}  # ids of vars that depend on / are score + term
    for eqn in jaxpr.eqns:
        ins = [id(x) for x in eqn.invars]
        if not any(i in dep for i in ins):
            continue
        dep.update(id(x) for x in eqn.outvars)
        name = eqn.primitive.name
        if len(ins) == 2 and name in ("add", "add_any", "sub"):
            a, b = ins
            if (a in plus and b not in dep) or (name != "sub" and b in plus and a not in dep):
                plus.add(id(eqn.outvars[0]))
    return id(jaxpr.outvars[0]) in plus


def attention_via_xla(q: jax.Array, k: jax.Array, v: jax.Array, *,
                      score_mod: Callable[..., Any] | None = None,
                      mask_mod: Callable[..., Any] | None = None, q_positions: ArrayLike,
                      kv_positions: ArrayLike, causal: bool = False,
                      segment_ids: ArrayLike | None = None,
                      kv_segment_ids: ArrayLike | None = None, scale: Any = None,
                      sinks: jax.Array | None = None,
                      implementation: str | None = None) -> jax.Array:
    """``jax.nn.dot_product_attention`` (cuDNN's fused attention on NVIDIA GPUs) on
    already-transformed ``q``, ``k``, with jaxpos's semantics.

    * no score_mod: no bias; ``causal`` becomes ``is_causal`` when both position arrays
      are known to be ``arange`` and ``Tq == Tk``, else a boolean mask
      ``kv_pos <= q_pos`` built from the positions;
    * a score_mod that adds a term (:func:`adds_a_term`: ``score + term`` with the term
      independent of the score, e.g. ALiBi, T5; an added ``-inf`` hides the pair):
      that term materialised as a dense float32 bias ``[B|1, N, Tq, Tk]``, float32
      whatever q's dtype (XLA's attention, not cuDNN: :func:`cudnn_allowed`)
      (``jaxpos.mods.apply_mod`` on a zero score; ``B`` is 1 when the mod ignores
      ``batch`` and the positions are shared); any other score_mod (e.g. a soft cap)
      runs as dense XLA attention;
    * segments and the mask_mod: a dense boolean mask;
    * sinks: one extra key with zero key and value whose bias is the sink logit;
    * a query row with no visible key returns zeros (``dot_product_attention`` alone
      would average over all keys).

    Gradients reach q, k, v, the sinks and the score_mod's captured arrays by autodiff.
    Memory is ``O(B N Tq Tk)`` whenever a bias or a mask is materialised.

    Args:
      q, k, v: as :func:`attention_via_kernel`, as are score_mod, mask_mod, q_positions,
        kv_positions, causal, segment_ids, kv_segment_ids, scale and sinks.
      implementation: passed to ``jax.nn.dot_product_attention``; None picks ``"cudnn"``
        on an NVIDIA GPU for bfloat16 / float16 inputs without sinks or bias (falling back to
        ``"xla"`` if cuDNN refuses the shapes at trace time) and ``"xla"`` otherwise.

    Returns:
      ``[B, Tq, N, H]`` in q's dtype.

    Raises:
      ValueError / TypeError: as :func:`attention_via_kernel`.
    """
    _checks.check_qkv(q, k, v)
    if (segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("segment_ids and kv_segment_ids must be given together; got one.")
    call = validate_call(q, k, v, score_mod=score_mod, mask_mod=mask_mod,
                         q_positions=q_positions, kv_positions=kv_positions, causal=causal,
                         segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, scale=scale,
                         sinks=sinks)
    reason = xla_refusal(call)
    if reason is not None:
        raise ValueError(reason)
    return run_xla(call, implementation)


def _visibility(B, N, Tq, Tk, mmod, q_pos, kv_pos, causal, seg, is_causal):
    """``(mask, row_vis)``: the dense boolean mask ``[B|1, N|1, Tq, Tk]`` handed to
    ``dot_product_attention`` (None: none), and what decides whether a row has a visible
    key (the mask with causality, even where causality goes to XLA as ``is_causal``)."""
    mask = None

    def conj(m, x):
        return x if m is None else m & x

    if causal and not is_causal:
        mask = conj(mask, kv_pos[:, None, None, :] <= q_pos[:, None, :, None])
    if seg is not None:
        mask = conj(mask, seg[0][:, None, :, None] == seg[1][:, None, None, :])
    if mmod is not None:
        mask = conj(mask, apply_mod(mmod, q_pos, kv_pos, batch_index=(B, N)))
    row_vis = mask
    if is_causal and mask is not None:
        row_vis = mask & jnp.tril(jnp.ones((Tq, Tk), bool))[None, None]
    return mask, row_vis


def _bias(smod: ConvertedMod, B, N, Tq, Tk, q_pos, kv_pos):
    """``(bias, hidden)``: the added term of ``smod`` as a float32 ``[B|1, N, Tq, Tk]``
    bias (``B`` is 1 when the mod ignores ``batch`` and the positions are shared), an added
    ``-inf`` replaced by a finite fill, and where it was ``-inf`` (hidden pairs)."""
    per_row = reads_input(smod.jaxpr, 1) or q_pos.shape[0] > 1 or kv_pos.shape[0] > 1
    bb = B if per_row else 1
    bias = apply_mod(smod, q_pos, kv_pos, score=jnp.zeros((bb, N, Tq, Tk), jnp.float32))
    # an added -inf hides the pair, as a mask does: a finite fill keeps a row hidden
    # everywhere free of NaN (it is zeroed after); gradients stay 0 there
    hidden = bias == -jnp.inf
    return jnp.where(hidden, jnp.finfo(jnp.float32).min, bias), hidden


def _with_sink_key(k, v, bias, mask, sinks, N, Tq, Tk):
    """k, v, bias and mask with one extra key: k = 0, v = 0, bias = the sink logit."""
    B, _, Nk, H = k.shape
    zk = jnp.zeros((B, 1, Nk, H), k.dtype)
    zv = jnp.zeros((B, 1, Nk, v.shape[-1]), v.dtype)
    base = jnp.zeros((1, N, Tq, Tk), jnp.float32) if bias is None else bias
    col = jnp.broadcast_to(sinks[None, :, None, None], base.shape[:3] + (1,))
    if mask is not None:
        mask = jnp.concatenate([mask, jnp.ones(mask.shape[:3] + (1,), bool)], axis=-1)
    return (jnp.concatenate([k, zk], 1), jnp.concatenate([v, zv], 1),
            jnp.concatenate([base, col], axis=-1), mask)


def _xla_attention(q, k, v, smod, mmod, q_pos, kv_pos, causal: bool, seg, scale: float,
                   sinks, implementation, arange: bool) -> jax.Array:
    """The ``"xla"`` computation on checked inputs: converted mods at ``[Tq, Tk]``, int32
    positions ``[B|1, T]``, ``seg`` a pair of int32 ``[B, T]`` or None, a float scale."""
    B, Tq, N, _ = q.shape
    Tk = k.shape[1]
    sinks = None if sinks is None else jnp.asarray(sinks, jnp.float32)
    is_causal = causal and arange and Tq == Tk and sinks is None
    mask, row_vis = _visibility(B, N, Tq, Tk, mmod, q_pos, kv_pos, causal, seg, is_causal)
    # jax.nn.dot_product_attention's float16 gradient asks for a dot precision
    # (F16_F16_F32) the CPU backend lacks: jaxpos's own dense attention runs there instead
    f16_cpu = q.dtype == jnp.float16 and jax.default_backend() == "cpu"
    if (smod is not None and not adds_a_term(smod)) or f16_cpu:
        out = dense_attention(q, k, v, smod, mask, is_causal, q_pos, kv_pos, scale, sinks)
    else:
        bias = None
        if smod is not None:
            bias, hidden = _bias(smod, B, N, Tq, Tk, q_pos, kv_pos)
            row_vis = ~hidden if row_vis is None else row_vis & ~hidden
        if sinks is not None:
            k, v, bias, mask = _with_sink_key(k, v, bias, mask, sinks, N, Tq, Tk)
            if implementation is None:
                implementation = "xla"  # Tk + 1 keys, which cuDNN may refuse
        out = sdpa(q, k, v, bias, mask, is_causal, scale, implementation)
    if row_vis is not None:  # rows with no visible key: zeros (and no gradient)
        seen = jnp.any(row_vis, axis=-1)  # [B|1, N|1, Tq]
        seen = jnp.broadcast_to(jnp.swapaxes(seen, 1, 2)[..., None], (B, Tq, N, 1))
        out = jnp.where(seen, out, jnp.zeros((), out.dtype))
    return out.astype(q.dtype)


def cudnn_allowed(*, backend: str, dtype: Any, has_bias: bool) -> bool:
    """Whether :func:`sdpa` may ask ``jax.nn.dot_product_attention`` for cuDNN.

    Only on an NVIDIA GPU, for bfloat16 / float16 inputs, and never with a materialised
    bias: cuDNN takes the bias in the inputs' dtype, which rounds a score term such as
    BLOOM's ``slopes[h] * kv_pos`` (0.64 off at positions ~1000 in bfloat16), and its
    bias gradient is wrong for batch > 1 (https://github.com/jax-ml/jax/issues/30593).
    With a bias, XLA's attention runs with the bias in float32 (exact). jaxpos never
    passes ``local_window_size`` (windows are mask_mods, materialised as a mask), so
    cuDNN's non-causal sliding window (https://github.com/jax-ml/jax/pull/39576) is
    never reached.

    Args:
      backend: ``jax.default_backend()``. dtype: q's dtype. has_bias: a bias is passed.
    """
    return (backend in GPU_BACKENDS and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
            and not has_bias)


def sdpa(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array | None,
         mask: jax.Array | None, is_causal: bool, scale: float,
         implementation: str | None) -> jax.Array:
    """``jax.nn.dot_product_attention`` with a float32 ``bias`` (or None), cuDNN first
    where :func:`cudnn_allowed` (falling back to XLA if cuDNN refuses the shapes)."""
    if mask is not None:
        mask = jnp.broadcast_to(mask, mask.shape)
    call = lambda impl: jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=scale,
                                                     is_causal=is_causal, implementation=impl)
    if implementation is not None:
        return call(implementation)
    if cudnn_allowed(backend=jax.default_backend(), dtype=q.dtype, has_bias=bias is not None):
        try:
            return call("cudnn")
        except (ValueError, NotImplementedError, RuntimeError, TypeError):
            pass  # cuDNN refuses these shapes / dtypes: XLA's attention is correct too
    return call("xla")


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, smod: ConvertedMod | None,
                    mask: jax.Array | None, is_causal: bool, q_pos: jax.Array,
                    kv_pos: jax.Array, scale: float, sinks: jax.Array | None) -> jax.Array:
    """Dense attention in XLA for a score_mod that is not a pure added term (``smod`` may
    be None: float16 on CPU)."""
    Tq, N = q.shape[1], q.shape[2]
    g = N // k.shape[2]
    kk, vv = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    prec = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    s = jnp.einsum("bqnh,bknh->bnqk", q, kk, precision=prec,
                   preferred_element_type=jnp.float32) * jnp.float32(scale)
    if smod is not None:
        s = apply_mod(smod, q_pos, kv_pos, score=s)
    vis = mask
    if is_causal:
        c = jnp.tril(jnp.ones((Tq, k.shape[1]), bool))[None, None]
        vis = c if vis is None else vis & c
    if vis is not None:
        s = jnp.where(vis, s, -jnp.inf)
    values = lambda p: jnp.einsum("bnqk,bknh->bnqh", p.astype(v.dtype), vv, precision=prec,
                                  preferred_element_type=jnp.float32)
    state = online_softmax_step(softmax_start(s.shape[:3], v.shape[-1], sinks), s, values)
    return jnp.swapaxes(softmax_finish(state)[0], 1, 2).astype(q.dtype)


def run_xla(call: AttentionCall, implementation: str | None = None) -> jax.Array:
    """The ``"xla"`` engine on a validated, transformed call (nothing checked or converted
    again: the record's mods, positions and segments are used as they are).
    ``implementation``: as :func:`attention_via_xla`'s. ``[B, Tq, N, H]`` in q's dtype."""
    smod, mmod = converted_mods(call, call.q_len, call.kv_len)
    seg = None if call.segment_ids is None else (call.segment_ids, call.kv_segment_ids)
    arange = is_arange(call.q_positions, call.q_len) and is_arange(call.kv_positions,
                                                                    call.kv_len)
    return _xla_attention(jnp.asarray(call.q), jnp.asarray(call.k), jnp.asarray(call.v), smod,
                          mmod, call.q_positions, call.kv_positions, call.causal, seg,
                          float(call.scale), call.sinks, implementation, arange)


def xla_refusal(call: AttentionCall) -> str | None:
    """Why ``jax.nn.dot_product_attention`` cannot run ``call``: dropout, kv_lengths, a
    boolean mask array, a v narrower or wider than the (transformed) q; else None."""
    if call.dropout is not None:
        return (f"implementation='xla' (jax.nn.dot_product_attention, which has no dropout) "
                f"does not apply attention dropout (dropout_rate={call.dropout.rate}); use "
                f"implementation='chunked' (the same keep mask, tile by tile), 'pallas' or "
                f"'reference', or implementation=None, which picks the kernel (chunked on "
                f"CPU).")
    if call.kv_lengths is not None:
        return ("implementation='xla' (jax.nn.dot_product_attention) does not take "
                "kv_lengths; use implementation='pallas' or 'chunked' (they never visit the "
                "unfilled keys).")
    if call.mask is not None:
        return ("implementation='xla' (jax.nn.dot_product_attention) does not take a boolean "
                "mask array; express the mask as a mask_mod, or use implementation='chunked'.")
    if call.v.shape[-1] != call.q.shape[-1]:
        return (f"implementation='xla' (jax.nn.dot_product_attention) needs v's head_dim to "
                f"equal q's ({call.q.shape[-1]}, after the scheme's transform); got v "
                f"{tuple(call.v.shape)}. Use implementation='chunked' or 'pallas'.")
    return None


class XlaEngine:
    """``implementation="xla"``: ``jax.nn.dot_product_attention`` (cuDNN's fused attention on
    NVIDIA GPUs) with the score term as a dense float32 bias; the default on an NVIDIA GPU
    for calls without a score term (:func:`xla_preferred`)."""

    name = "xla"
    compiler_partitioned = True  # XLA operations: the compiler splits them under Auto axes
    takes_kv_lengths = False

    def refuses(self, call: AttentionCall) -> str | TypeError | None:
        """What :func:`jaxpos.core.engines.fused_refusal` refuses, and what
        :func:`xla_refusal` says ``dot_product_attention`` lacks."""
        return engines.fused_refusal(
            self.name, "implementation='xla' (jax.nn.dot_product_attention)", call
        ) or xla_refusal(call)

    def prefers(self, call: AttentionCall) -> bool:
        """:func:`xla_preferred` for the call's score term, mask_mod and dense size."""
        dense = call.batch * call.num_heads * call.q_len * call.kv_len * 4
        return xla_preferred(has_score_mod=call.score_mod is not None,
                             has_mask_mod=call.mask_mod is not None, dense_bytes=dense)

    def run(self, call: AttentionCall) -> jax.Array:
        """:func:`run_xla`."""
        return run_xla(call)


engines.register_engine(XlaEngine())
