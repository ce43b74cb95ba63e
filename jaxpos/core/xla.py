"""``jaxpos.attention(..., implementation="xla")``: ``jax.nn.dot_product_attention``
(cuDNN's fused attention on NVIDIA GPUs) on already-transformed q and k, with jaxpos's
semantics: the score_mod materialised as a dense bias (or, when it is not a pure added
term, dense attention in XLA), the mask_mod and segments as a dense boolean mask, sinks as
one extra key.

* :func:`attention_via_xla`: the runner's engine (also ``jaxpos.kernels.attention_via_xla``).
* :func:`sdpa`: ``jax.nn.dot_product_attention`` with the cuDNN-then-XLA fallback.
* :func:`dense_attention`: dense XLA attention for a score_mod that is not an added term.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos.mods import apply_mod, convert_mod, is_additive, reads_input

__all__ = ["GPU_BACKENDS", "adds_a_term", "attention_via_xla", "cudnn_allowed",
           "dense_attention", "is_arange", "run_xla", "sdpa"]

#: ``jax.default_backend()`` names of NVIDIA GPUs (where cuDNN is available).
GPU_BACKENDS = ("gpu", "cuda")


def is_arange(pos, T) -> bool:
    """True when ``pos`` is known (not traced) and equals ``arange(T)`` in every row."""
    if not _checks.is_concrete(pos):
        return False
    p = np.asarray(pos)
    return bool(np.all(p == np.arange(T)))


def adds_a_term(conv) -> bool:
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
    B, Tq, N, H = _checks.shape_of(q)
    Tk, Nk = _checks.shape_of(k)[1:3]
    if _checks.shape_of(v)[3] != H:
        raise ValueError(f"attention_via_xla needs v's head_dim equal to q's ({H}); got "
                         f"{_checks.shape_of(v)[3]} (use implementation='pallas' or 'chunked').")
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    scale = 1.0 / math.sqrt(H) if scale is None else float(scale)
    arange = is_arange(q_positions, Tq) and is_arange(kv_positions, Tk)
    q_pos = _checks.positions_2d("q_positions", q_positions, B, Tq)
    kv_pos = _checks.positions_2d("kv_positions", kv_positions, B, Tk)
    if (segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("segment_ids and kv_segment_ids must be given together; got one.")
    smod = convert_mod(score_mod, "score", Tq, Tk) if score_mod is not None else None
    mmod = convert_mod(mask_mod, "mask", Tq, Tk) if mask_mod is not None else None
    if sinks is not None:
        _checks.check_rank("sinks", sinks, (1,), "[num_heads]")
        if _checks.shape_of(sinks)[0] != N:
            raise ValueError(f"sinks must have shape [{N}]; got {_checks.shape_of(sinks)}.")
        sinks = jnp.asarray(sinks, jnp.float32)

    mask = None  # bool [B|1, N|1, Tq, Tk]

    def conj(m, x):
        return x if m is None else m & x

    is_causal = bool(causal) and arange and Tq == Tk and sinks is None
    if causal and not is_causal:
        mask = conj(mask, kv_pos[:, None, None, :] <= q_pos[:, None, :, None])
    if segment_ids is not None:
        sq = _checks.positions_2d("segment_ids", segment_ids, B, Tq)
        skv = _checks.positions_2d("kv_segment_ids", kv_segment_ids, B, Tk)
        mask = conj(mask, sq[:, None, :, None] == skv[:, None, None, :])
    if mmod is not None:
        mask = conj(mask, apply_mod(mmod, q_pos, kv_pos, batch_index=(B, N)))

    # what decides whether a row has a visible key: the mask, with causality even where
    # it goes to XLA as is_causal (a causal row may lose every key to segments/mask_mod)
    row_vis = mask
    if is_causal and mask is not None:
        row_vis = mask & jnp.tril(jnp.ones((Tq, Tk), bool))[None, None]
    # jax.nn.dot_product_attention's float16 gradient asks for a dot precision
    # (F16_F16_F32) the CPU backend lacks: jaxpos's own dense attention runs there instead
    f16_cpu = q.dtype == jnp.float16 and jax.default_backend() == "cpu"
    if (smod is not None and not adds_a_term(smod)) or f16_cpu:
        out = dense_attention(q, k, v, smod, mask, is_causal, q_pos, kv_pos, scale, sinks)
    else:
        bias = None
        if smod is not None:
            per_row = reads_input(smod.jaxpr, 1) or q_pos.shape[0] > 1 or kv_pos.shape[0] > 1
            bb = B if per_row else 1
            bias = apply_mod(smod, q_pos, kv_pos, score=jnp.zeros((bb, N, Tq, Tk), jnp.float32))
            # an added -inf hides the pair, as a mask does: a finite fill keeps a row
            # hidden everywhere free of NaN (it is zeroed below); gradients stay 0 there
            hidden = bias == -jnp.inf
            row_vis = ~hidden if row_vis is None else row_vis & ~hidden
            bias = jnp.where(hidden, jnp.finfo(jnp.float32).min, bias)
        kk, vv, m2 = k, v, mask
        if sinks is not None:  # one extra key: k = 0, v = 0, bias = the sink logit
            zk = jnp.zeros((B, 1, Nk, H), k.dtype)
            kk, vv = jnp.concatenate([k, zk], 1), jnp.concatenate([v, zk], 1)
            base = jnp.zeros((1, N, Tq, Tk), jnp.float32) if bias is None else bias
            col = jnp.broadcast_to(sinks[None, :, None, None], base.shape[:3] + (1,))
            bias = jnp.concatenate([base, col], axis=-1)
            if m2 is not None:
                m2 = jnp.concatenate([m2, jnp.ones(m2.shape[:3] + (1,), bool)], axis=-1)
        if sinks is not None and implementation is None:
            implementation = "xla"  # the extra key makes Tk + 1 keys, which cuDNN may refuse
        out = sdpa(q, kk, vv, bias, m2, is_causal, scale, implementation)
    if row_vis is not None:  # rows with no visible key: zeros (and no gradient)
        seen = jnp.any(row_vis, axis=-1)  # [B|1, N|1, Tq]
        seen = jnp.broadcast_to(jnp.swapaxes(seen, 1, 2)[..., None], (B, Tq, N, 1))
        out = jnp.where(seen, out, jnp.zeros((), out.dtype))
    return out.astype(q.dtype)


def cudnn_allowed(*, backend: str, dtype, has_bias: bool) -> bool:
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


def sdpa(q, k, v, bias, mask, is_causal, scale, implementation):
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


def dense_attention(q, k, v, smod, mask, is_causal, q_pos, kv_pos, scale, sinks):
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
    m = jnp.max(s, axis=-1, keepdims=True)
    if sinks is not None:
        m = jnp.maximum(m, sinks[None, :, None, None])
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    e = jnp.exp(s - m)
    den = jnp.sum(e, axis=-1, keepdims=True)
    if sinks is not None:
        den = den + jnp.exp(sinks[None, :, None, None] - m)
    p = e / jnp.where(den == 0, 1.0, den)
    out = jnp.einsum("bnqk,bknh->bqnh", p.astype(v.dtype), vv, precision=prec,
                     preferred_element_type=jnp.float32)
    return out.astype(q.dtype)


def run_xla(call) -> jax.Array:
    """The ``"xla"`` runner of :func:`jaxpos.attention`: :func:`attention_via_xla` on a
    validated, transformed :class:`jaxpos.core.call.AttentionCall`. ``[B, Tq, N, H]`` in q's
    dtype."""
    return attention_via_xla(call.q, call.k, call.v, score_mod=call.score_mod,
                             mask_mod=call.mask_mod, q_positions=call.q_positions,
                             kv_positions=call.kv_positions, causal=call.causal,
                             segment_ids=call.segment_ids, kv_segment_ids=call.kv_segment_ids,
                             scale=call.scale, sinks=call.sinks)
