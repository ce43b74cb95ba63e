"""Entry points of the attention implementations that live in ``jaxpos.kernels``, and the
rule that picks an implementation per backend.

* :func:`attention_via_kernel`: ``jaxpos.attention(..., implementation="pallas")``, the
  fused Pallas kernel (:mod:`jaxpos.kernels.fused`) on already-transformed q and k.
* :func:`attention_via_xla`: ``implementation="xla"``, ``jax.nn.dot_product_attention``
  (cuDNN's fused attention on NVIDIA GPUs) with the score_mod materialised as a dense
  bias and the mask_mod as a dense boolean mask.
* :func:`choose_implementation`: which of ``"pallas"``, ``"xla"``, ``"chunked"`` is the
  fastest correct path on a backend (``docs/kernel.md`` has the measurements behind it).
* :func:`supports_scheme`: whether the kernel can run a scheme (the scheme protocol's
  ``fusable``).

Nothing here names a position scheme: schemes reach the kernel as a per-token transform
(applied by the caller) and a score_mod.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxpos.kernels.fused import is_additive, kernel_attention

from jaxpos import _checks
from jaxpos.mods import apply_mod, convert_mod

__all__ = ["DENSE_BIAS_BUDGET_BYTES", "IMPLEMENTATIONS", "attention_via_kernel",
           "attention_via_xla", "choose_implementation", "supports_scheme"]

IMPLEMENTATIONS = ("pallas", "xla", "chunked")

#: Largest dense bias (or mask) ``attention_via_xla`` may materialise when
#: :func:`choose_implementation` picks it over the kernel: ``B * N * Tq * Tk * 4`` bytes.
#: 1 GiB per attention call (e.g. B=1, N=16, T=4096); see ``docs/kernel.md``.
DENSE_BIAS_BUDGET_BYTES = 1 << 30

_GPU = ("gpu", "cuda")


def supports_scheme(scheme) -> bool:
    """True when the fused kernel can run ``scheme``: the scheme protocol's ``fusable``
    (no term that depends on the query content or on the attention weights).

    Raises:
      TypeError: ``scheme`` is not a position scheme (pass a string or ``None`` through
        :func:`jaxpos.as_scheme` first).
    """
    from jaxpos.scheme import PositionScheme

    if not isinstance(scheme, PositionScheme) or not hasattr(scheme, "fusable"):
        raise TypeError(f"scheme must be a jaxpos PositionScheme (NoPE(), RoPE(...), "
                        f"ALiBi(...), ...); got {type(scheme).__name__} {scheme!r}.")
    return bool(scheme.fusable)


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
    * NVIDIA GPU with a score_mod or mask_mod -> ``"xla"`` (cuDNN with the term
      materialised densely: measured 284 / 197 TFLOP/s for ALiBi, against 164 / 87 for the
      Pallas kernel) while that dense array, ``batch * num_heads * Tq * Tk * 4`` bytes,
      fits ``dense_bias_budget_bytes`` (default :data:`DENSE_BIAS_BUDGET_BYTES`, 1 GiB);
      above it ``"pallas"``, whose memory is ``O(T)``;
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
    if backend in _GPU:
        if not (has_score_mod or has_mask_mod):
            return "xla"
        dense_bytes = int(batch) * int(num_heads) * int(Tq) * int(Tk) * 4
        return "xla" if dense_bytes <= budget else "pallas"
    return "pallas"


def attention_via_kernel(q, k, v, *, score_mod=None, mask_mod=None, block_mask=None, sinks=None,
                         q_positions, kv_positions, causal=False, segment_ids=None,
                         kv_segment_ids=None, scale=None, block_q=None, block_k=None,
                         interpret=None):
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
    _check_qkv(q, k, v)
    return kernel_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod,
                            block_mask=block_mask, sinks=sinks, q_positions=q_positions,
                            kv_positions=kv_positions, causal=causal, segment_ids=segment_ids,
                            kv_segment_ids=kv_segment_ids, scale=scale, block_q=block_q,
                            block_k=block_k, interpret=interpret)


def _check_qkv(q, k, v):
    for name, x in (("q", q), ("k", k), ("v", v)):
        _checks.check_rank(name, x, (4,), "[batch, seq, heads, head_dim]")
        _checks.check_floating(name, x)
    dq, dk, dv = (_checks.dtype_of(x) for x in (q, k, v))
    if not (dq == dk == dv):
        raise TypeError(f"q, k and v must share a dtype; got {dq}, {dk}, {dv}.")
    (B, Tq, N, H), (Bk, Tk, Nk, Hk), (Bv, Tv, Nv, _) = (_checks.shape_of(x) for x in (q, k, v))
    if Bk != B or Bv != B or Hk != H or (Tv, Nv) != (Tk, Nk):
        raise ValueError(f"expected q [B, Tq, N, H], k [B, Tk, N_kv, H], v [B, Tk, N_kv, H_v]; "
                         f"got q {(B, Tq, N, H)}, k {(Bk, Tk, Nk, Hk)}, v {_checks.shape_of(v)}.")
    if N % Nk:
        raise ValueError(f"query heads ({N}) must be a multiple of key/value heads ({Nk}); "
                         f"got q {(B, Tq, N, H)}, k {(Bk, Tk, Nk, Hk)}.")


def _is_arange(pos, T) -> bool:
    """True when ``pos`` is known (not traced) and equals ``arange(T)`` in every row."""
    if not _checks.is_concrete(pos):
        return False
    p = np.asarray(pos)
    return bool(np.all(p == np.arange(T)))


def _uses_arg(conv, index) -> bool:
    """Whether a converted mod's jaxpr reads its ``index``-th argument."""
    var = conv.jaxpr.invars[index]
    return any(var is x for e in conv.jaxpr.eqns for x in e.invars) or any(
        var is x for x in conv.jaxpr.outvars)


def attention_via_xla(q, k, v, *, score_mod=None, mask_mod=None, q_positions, kv_positions,
                      causal=False, segment_ids=None, kv_segment_ids=None, scale=None,
                      sinks=None, implementation=None):
    """``jax.nn.dot_product_attention`` (cuDNN's fused attention on NVIDIA GPUs) on
    already-transformed ``q``, ``k``, with jaxpos's semantics.

    * no score_mod: no bias; ``causal`` becomes ``is_causal`` when both position arrays
      are known to be ``arange`` and ``Tq == Tk``, else a boolean mask
      ``kv_pos <= q_pos`` built from the positions;
    * a score_mod that adds a term (``d score_mod / d score == 1``, e.g. ALiBi, T5):
      that term materialised as a dense float32 bias ``[B|1, N, Tq, Tk]``
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
      q, k, v, score_mod, mask_mod, q_positions, kv_positions, causal, segment_ids,
        kv_segment_ids, scale, sinks: as :func:`attention_via_kernel`.
      implementation: passed to ``jax.nn.dot_product_attention``; None picks ``"cudnn"``
        on an NVIDIA GPU for bfloat16 / float16 inputs without sinks (falling back to
        ``"xla"`` if cuDNN refuses the shapes at trace time) and ``"xla"`` otherwise.

    Returns:
      ``[B, Tq, N, H]`` in q's dtype.

    Raises:
      ValueError / TypeError: as :func:`attention_via_kernel`.
    """
    _check_qkv(q, k, v)
    B, Tq, N, H = _checks.shape_of(q)
    Tk, Nk = _checks.shape_of(k)[1:3]
    if _checks.shape_of(v)[3] != H:
        raise ValueError(f"attention_via_xla needs v's head_dim equal to q's ({H}); got "
                         f"{_checks.shape_of(v)[3]} (use implementation='pallas' or 'chunked').")
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    scale = 1.0 / math.sqrt(H) if scale is None else float(scale)
    arange = _is_arange(q_positions, Tq) and _is_arange(kv_positions, Tk)
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

    if smod is not None and not is_additive(smod):
        out = _dense_attention(q, k, v, smod, mask, is_causal, q_pos, kv_pos, scale, sinks)
    else:
        bias = None
        if smod is not None:
            bb = B if (_uses_arg(smod, 1) or q_pos.shape[0] > 1 or kv_pos.shape[0] > 1) else 1
            bias = apply_mod(smod, q_pos, kv_pos, score=jnp.zeros((bb, N, Tq, Tk), jnp.float32))
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
        out = _sdpa(q, kk, vv, bias, m2, is_causal, scale, implementation)
    if mask is not None:  # rows with no visible key: zeros (and no gradient)
        seen = jnp.any(mask, axis=-1)  # [B|1, N|1, Tq]
        seen = jnp.broadcast_to(jnp.swapaxes(seen, 1, 2)[..., None], (B, Tq, N, 1))
        out = jnp.where(seen, out, jnp.zeros((), out.dtype))
    return out.astype(q.dtype)


def _sdpa(q, k, v, bias, mask, is_causal, scale, implementation):
    if bias is not None and q.dtype != jnp.float32:
        bias = bias.astype(q.dtype)
    if mask is not None:
        mask = jnp.broadcast_to(mask, mask.shape)
    call = lambda impl: jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=scale,
                                                     is_causal=is_causal, implementation=impl)
    if implementation is not None:
        return call(implementation)
    if jax.default_backend() in _GPU and q.dtype in (jnp.bfloat16, jnp.float16):
        try:
            return call("cudnn")
        except (ValueError, NotImplementedError, RuntimeError, TypeError):
            pass  # cuDNN refuses these shapes / dtypes: XLA's attention is correct too
    return call("xla")


def _dense_attention(q, k, v, smod, mask, is_causal, q_pos, kv_pos, scale, sinks):
    """Dense attention in XLA for a score_mod that is not a pure added term."""
    Tq, N = q.shape[1], q.shape[2]
    g = N // k.shape[2]
    kk, vv = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    prec = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    s = jnp.einsum("bqnh,bknh->bnqk", q, kk, precision=prec,
                   preferred_element_type=jnp.float32) * jnp.float32(scale)
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
