"""jaxpos inside Flax's own attention modules: an ``attention_fn`` for
``flax.nnx.MultiHeadAttention`` and ``flax.linen.MultiHeadDotProductAttention``.

Both modules project the inputs to ``query``, ``key``, ``value`` ``[batch..., T, N, H]``
and hand them to ``attention_fn`` with the arguments of ``flax.nnx.dot_product_attention``
(``bias``, ``mask``, ``broadcast_dropout``, ``dropout_rng``, ``dropout_rate``,
``deterministic``, ``dtype``, ``precision``, ``module``, ``is_causal``; Linen passes only
the keywords the function's signature names, plus ``force_fp32_for_softmax`` and its
quantised-einsum hooks). :func:`flax_attention_fn` returns such a function running
:func:`jaxpos.attention` with a position scheme, a score_mod and a mask_mod::

    attn = nnx.MultiHeadAttention(num_heads=4, in_features=32, decode=False, rngs=rngs,
                                  attention_fn=jaxpos.flax_attention_fn(jaxpos.ALiBi(4)))

What the returned function does with Flax's arguments:

* ``mask``: float (Flax's ``make_causal_mask`` / ``make_attention_mask`` / ``combine_masks``
  give float 0/1) or bool, broadcastable to ``[batch..., N, Tq, Tk]``; nonzero means "may
  attend", as in Flax. It is evaluated as a mask_mod reading the array, so it works with
  every implementation, the Pallas kernel included.
* ``bias``: broadcastable to ``[batch..., N, Tq, Tk]``, added to the scaled scores after
  the scheme's own term (a score_mod reading the array; gradients reach it).
* ``is_causal``: ``causal=True`` (Flax's lower-triangular mask when ``Tq == Tk``). An
  ``SSMax`` without ``num_keys`` also runs causal when a concrete ``mask`` hides every
  later key (``make_causal_mask``, a ``decode=True`` step); with a traced mask it cannot
  tell, so pass ``is_causal=True`` or ``num_keys``. SSMax's ``n`` is then the number of
  keys the mask leaves each query (padding excluded).
* ``dropout_rate``, ``dropout_rng``, ``broadcast_dropout``, ``deterministic``: attention
  dropout (:mod:`jaxpos.core.dropout`) when ``not deterministic and dropout_rate > 0``. The
  keep mask has Flax's distribution, not its bits.
* ``dtype``: q, k and v are cast to it (default: their promoted dtype), and the output has
  it; the softmax and accumulation are float32 whatever the dtype, so
  ``force_fp32_for_softmax`` always holds.
* ``precision``: every matrix product jaxpos traces for the call runs under
  ``jax.default_matmul_precision(precision)``. The custom gradients of the ``"chunked"``
  and ``"pallas"`` paths are traced later, by ``jax.grad``, and use the precision in force
  there: wrap the training step in ``jax.default_matmul_precision`` to set both.
* ``module``: Flax passes the module only with ``sow_weights=True``, asking for the
  attention weights to be sown; jaxpos never materialises them (the tiled paths never
  hold a ``[Tq, Tk]`` matrix) and refuses. So are ``qk_attn_weights_einsum`` /
  ``attn_weights_value_einsum`` (Linen's quantised einsums).

Positions. Flax passes no positions. In a full pass queries and keys sit at ``arange(Tq)``
and ``arange(Tk)`` (Flax's top-left convention for ``is_causal``). Under Flax's own
``decode=True`` cache the module calls ``attention_fn`` with one query and the whole cache
(``[batch..., max_len, N, H]``, unfilled slots zero) and a mask that Flax combines with
``arange(max_len) <= cache_index``; the module itself is not passed. The query's position
is therefore read from that mask: a call with ``Tq == 1 < Tk`` and a mask places its query
at the last key it may attend to (the cache index) and the keys at ``arange(max_len)``.
That is what makes decoding equal the full pass for every scheme, RoPE included. Flax's
cache stores keys before any rotation, so RoPE rotates all ``max_len`` cached keys at every
step (``O(max_len * H)`` per step); jaxpos's own modules
(:class:`jaxpos.nnx.MultiHeadAttention`) cache rotated keys and cost the filled length.
The rule assumes self-attention: for cross-attention use ``position=None`` (positions
then only matter to a score_mod or mask_mod of your own).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxpos import _checks
from jaxpos.core.engines import engine_names
from jaxpos.core.entry import attention
from jaxpos.schemes.base import PositionScheme, as_scheme

__all__ = ["flax_attention_fn"]


def _as_bnqk(name: str, x, batch: tuple, N: int, Tq: int, Tk: int):
    """``x`` broadcastable to ``[*batch, N, Tq, Tk]`` as a 4-d ``[B|1, N|1, Tq|1, Tk|1]``."""
    x = jnp.asarray(x)
    want = tuple(batch) + (N, Tq, Tk)
    if x.ndim > len(want):
        raise ValueError(f"{name} must be broadcastable to [batch..., num_heads, q_length, "
                         f"kv_length] = {list(want)}; got shape {x.shape}.")
    x = x.reshape((1,) * (len(want) - x.ndim) + x.shape)
    for got, w in zip(x.shape, want):
        if got not in (1, w):
            raise ValueError(f"{name} must be broadcastable to [batch..., num_heads, q_length, "
                             f"kv_length] = {list(want)}; got shape {x.shape}.")
    lead = x.shape[:len(batch)]
    if all(d == 1 for d in lead):
        return x.reshape((1,) + x.shape[len(batch):])
    x = jnp.broadcast_to(x, tuple(batch) + x.shape[len(batch):])
    return x.reshape((math.prod(batch),) + x.shape[len(batch):])


def _index(arr, axis: int, idx):
    """``idx`` for ``arr``'s axis, or 0 on a broadcast (size-1) axis; clipped into range
    (rows of a partial tile past the sequence end read a real row and are discarded)."""
    n = arr.shape[axis]
    return 0 if n == 1 else jnp.clip(idx, 0, n - 1)


def _array_mods(mask4, bias4, decode: bool):
    """A mask_mod and a score_mod reading Flax's mask and bias arrays ``[B|1, N|1, Tq|1,
    Tk|1]`` at (batch, head, query index, key index). Queries and keys sit at
    ``arange``; in decoding the one query row is row 0."""

    def at(arr, batch, head, q_pos, kv_pos):
        qi = jnp.zeros_like(q_pos) if decode else q_pos
        return arr[_index(arr, 0, batch), _index(arr, 1, head), _index(arr, 2, qi),
                   _index(arr, 3, kv_pos)]

    mask_mod = score_mod = None
    if mask4 is not None:
        def flax_mask(batch, head, q_pos, kv_pos):
            return at(mask4, batch, head, q_pos, kv_pos)

        counts = jnp.sum(mask4, axis=-1, dtype=jnp.int32)[..., None]  # keys each row sees

        def key_count(batch, head, q_pos):  # SSMax's n in a causal call (jaxpos.SSMax)
            return at(counts, batch, head, q_pos, jnp.zeros_like(q_pos))

        flax_mask.causal_key_count = key_count  # pyright: ignore[reportFunctionMemberAccess]
        mask_mod = flax_mask
    if bias4 is not None:
        def flax_bias(score, batch, head, q_pos, kv_pos):
            return score + at(bias4, batch, head, q_pos, kv_pos).astype(jnp.float32)

        score_mod = flax_bias
    return mask_mod, score_mod


def _and_mods(*mods):
    mods = tuple(m for m in mods if m is not None)
    if len(mods) < 2:
        return mods[0] if mods else None

    def both(batch, head, q_pos, kv_pos):
        out = mods[0](batch, head, q_pos, kv_pos)
        for m in mods[1:]:
            out = out & m(batch, head, q_pos, kv_pos)
        return out

    return both


def _then_mods(*mods):
    mods = tuple(m for m in mods if m is not None)
    if len(mods) < 2:
        return mods[0] if mods else None

    def chain(score, batch, head, q_pos, kv_pos):
        for m in mods:
            score = m(score, batch, head, q_pos, kv_pos)
        return score

    return chain


def _decode_q_positions(mask4, B: int, Tk: int):
    """int32 ``[B|1, 1]``: the last key index the single query may attend to (any head)."""
    vis = jnp.any(mask4[:, :, 0, :], axis=1)  # [B|1, Tk]
    last = Tk - 1 - jnp.argmax(vis[:, ::-1], axis=-1)
    return last.astype(jnp.int32)[:, None]


def _mask_makes_causal(scheme, mask4, q_positions, Tk: int) -> bool:
    """True for :class:`SSMax` without ``num_keys`` when ``mask4`` is concrete and hides
    every key after its query (Flax's ``make_causal_mask``; a ``decode=True`` step's
    cache mask): the call is then causal (``causal=True`` hides nothing more) and SSMax
    counts the keys the mask leaves (Nakanishi 2025, §3). Traced masks cannot be read."""
    from jaxpos.schemes.ssmax import SSMax

    if (not isinstance(scheme, SSMax) or scheme.num_keys is not None or mask4 is None
            or not (_checks.is_concrete(mask4) and _checks.is_concrete(q_positions))):
        return False
    qp = np.asarray(q_positions)  # [Tq] (a full pass) or [B|1, 1] (a decode step)
    kv = np.arange(Tk)
    later = (kv > qp[:, None]) if qp.ndim == 1 else (kv > qp[:, :, None])[:, :, None, :]
    return not np.any(np.asarray(mask4) & later)


def _precision_name(precision) -> str | None:
    """A name ``jax.default_matmul_precision`` takes, or None for the default."""
    if precision is None:
        return None
    if isinstance(precision, (tuple, list)):
        names = {_precision_name(p) for p in precision}
        if len(precision) != 2 or len(names) != 1:
            raise ValueError(f"precision: jaxpos applies one precision to both operands of "
                             f"every product; got {precision!r}. Pass a single value.")
        return names.pop()
    if isinstance(precision, str):
        return precision
    name = getattr(precision, "name", None)
    if name is None:
        raise TypeError(f"precision must be None, a string, a jax.lax.Precision or a "
                        f"jax.lax.DotAlgorithmPreset; got {type(precision).__name__}.")
    return name.lower() if isinstance(precision, jax.lax.Precision) else name


def _refuse_flax_extras(module: Any, qk_einsum: Any, av_einsum: Any) -> None:
    """Refuse Flax's ``sow_weights`` module and Linen's quantised einsums.

    Raises:
      ValueError: ``module`` is given (``sow_weights=True``) or either einsum is set.
    """
    if module is not None:
        raise ValueError(
            "module: Flax passes the module to attention_fn when sow_weights=True, to sow "
            "the attention weights; jaxpos's attention never materialises them. Call the "
            "module without sow_weights (or use flax.nnx.dot_product_attention to "
            "inspect the weights).")
    if qk_einsum is not None or av_einsum is not None:
        raise ValueError(
            "qk_attn_weights_einsum / attn_weights_value_einsum (Linen's quantised "
            "einsums) cannot replace jaxpos's fused products; leave them unset.")


def _promoted(query: Any, key: Any, value: Any, dtype: Any,
              promote_dtype: Callable | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``query, key, value`` in one dtype, as Flax promotes them (``promote_dtype`` when
    given, else ``dtype`` or their common type).

    Raises:
      ValueError: an operand of rank under 3, or batch dimensions that differ.
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        if jnp.ndim(x) < 3:
            raise ValueError(f"{name} must have shape [batch..., length, num_heads, "
                             f"head_dim]; got shape {jnp.shape(x)}.")
    if promote_dtype is not None:
        query, key, value = promote_dtype((query, key, value), dtype=dtype)
    else:
        dt = dtype if dtype is not None else jnp.result_type(query, key, value)
        query, key, value = (jnp.asarray(x).astype(dt) for x in (query, key, value))
    batch = query.shape[:-3]
    if key.shape[:-3] != batch or value.shape[:-3] != batch:
        raise ValueError(f"query, key and value must share their batch dimensions; got "
                         f"query {query.shape}, key {key.shape}, value {value.shape}.")
    return query, key, value


def flax_attention_fn(
    position: PositionScheme | Literal["none", "nope"] | None = None,
    *,
    implementation: str | None = None,
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> Callable:
    """An ``attention_fn`` for ``flax.nnx.MultiHeadAttention`` and
    ``flax.linen.MultiHeadDotProductAttention`` running :func:`jaxpos.attention`.

    The returned function has the signature of ``flax.nnx.dot_product_attention``
    (``query [batch..., Tq, N, H]``, ``key [batch..., Tk, N_kv, H]``, ``value [batch...,
    Tk, N_kv, H_v]``; ``bias``, ``mask``, ``broadcast_dropout``, ``dropout_rng``,
    ``dropout_rate``, ``deterministic``, ``dtype``, ``precision``, ``module``,
    ``promote_dtype``, ``is_causal``, and Linen's ``force_fp32_for_softmax``,
    ``qk_attn_weights_einsum``, ``attn_weights_value_einsum``) and returns
    ``[batch..., Tq, N, H_v]``. How each argument is honoured, and how positions are found
    under Flax's ``decode=True`` cache, is described in :mod:`jaxpos.interop.flax`. With
    ``position=None`` and no mods it computes what ``flax.nnx.dot_product_attention``
    computes (Vaswani et al. 2017, Sec. 3.2.1), to float32 rounding.

    Args:
      position: the scheme (``jaxpos.RoPE(...)``, ``jaxpos.ALiBi(...)``,
        ``jaxpos.T5Bias(...)``, ...; ``None`` for none). Its arrays are fixed at
        construction (a learned table trains only inside jaxpos's own modules).
      implementation: ``"reference"``, ``"chunked"``, ``"pallas"``, ``"xla"`` or ``None``
        (:func:`jaxpos.default_implementation`).
      score_mod, mask_mod: as in :func:`jaxpos.attention` (global int32 positions, the
        arange of a full pass or the cache slots while decoding); the mask_mod is combined
        with Flax's ``mask`` (both must allow a pair).
      scale: the score scale, default ``1/sqrt(H)`` as in Flax (T5 uses ``1.0``).
      block_q, block_k: tile sizes for the tiled implementations.

    Returns:
      The ``attention_fn``.

    Raises:
      TypeError / ValueError: at construction, a bad scheme or implementation; at the
        call, shapes that do not match (naming the argument), a ``module`` (Flax's
        ``sow_weights=True``), Linen's quantised einsums, a precision given per operand,
        and whatever :func:`jaxpos.attention` refuses.
    """
    scheme = as_scheme(position)
    _checks.check_choice("implementation", implementation, engine_names() + (None,))
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"score_mod must be callable; got {type(score_mod).__name__}.")
    if mask_mod is not None and not callable(mask_mod):
        raise TypeError(f"mask_mod must be callable; got {type(mask_mod).__name__}.")
    user_score_mod, user_mask_mod = score_mod, mask_mod

    def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True,
                     dropout_rng=None, dropout_rate: float = 0.0, deterministic: bool = False,
                     dtype=None, precision=None, module=None, promote_dtype=None,
                     is_causal: bool = False, force_fp32_for_softmax: bool = False,
                     qk_attn_weights_einsum=None, attn_weights_value_einsum=None):
        _refuse_flax_extras(module, qk_attn_weights_einsum, attn_weights_value_einsum)
        query, key, value = _promoted(query, key, value, dtype, promote_dtype)
        batch = query.shape[:-3]
        Tq, N, _ = query.shape[-3:]
        Tk = key.shape[-3]
        B = math.prod(batch)
        to4 = lambda x: x.reshape((B,) + x.shape[-3:])
        q, k, v = to4(query), to4(key), to4(value)

        mask4 = None if mask is None else _as_bnqk("mask", mask, batch, N, Tq, Tk) != 0
        bias4 = None if bias is None else _as_bnqk("bias", bias, batch, N, Tq, Tk)
        decode = mask4 is not None and Tq == 1 and Tk > 1
        q_positions = _decode_q_positions(mask4, B, Tk) if decode else \
            jnp.arange(Tq, dtype=jnp.int32)
        array_mask, array_bias = _array_mods(mask4, bias4, decode)
        causal = bool(is_causal) or _mask_makes_causal(scheme, mask4, q_positions, Tk)
        dropping = not deterministic and dropout_rate > 0.0

        def run():
            return attention(q, k, v, position=scheme,
                             score_mod=_then_mods(array_bias, user_score_mod),
                             mask_mod=_and_mods(array_mask, user_mask_mod),
                             q_positions=q_positions, kv_positions=jnp.arange(Tk, dtype=jnp.int32),
                             causal=causal, scale=scale, implementation=implementation,
                             block_q=block_q, block_k=block_k,
                             dropout_rate=dropout_rate if dropping else 0.0,
                             dropout_rng=dropout_rng if dropping else None,
                             broadcast_dropout=bool(broadcast_dropout))

        name = _precision_name(precision)
        if name is None:
            out = run()
        else:
            with jax.default_matmul_precision(name):
                out = run()
        return out.reshape(tuple(batch) + out.shape[1:])

    attention_fn.__qualname__ = f"flax_attention_fn({type(scheme).__name__})"
    attention_fn.__doc__ = flax_attention_fn.__doc__
    return attention_fn
