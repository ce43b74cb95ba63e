"""Scalable-Softmax (Nakanishi 2025, "Scalable-Softmax Is Superior for Attention",
arXiv:2501.19399, §3, Eq. 2).

Softmax over ``n`` inputs flattens as ``n`` grows ("attention fading"): its largest
output tends to zero. SSMax replaces ``softmax(z)`` over the ``n`` keys a query sees by::

    SSMax(z)_j = n ** (s z_j) / sum_k n ** (s z_k) = softmax((s log n) z)_j,

with ``s`` a learned scalar per layer and head. In attention this multiplies the query's
scores by ``s_h * log(n)`` before the softmax; ``n`` depends on the query only.

Which ``n``:

* causal (the paper's language models): the number of keys the query sees, ``q_pos + 1``
  with positions counted from 0 within each sequence (the library's convention for packed
  sequences and KV-cache decoding, where positions restart at 0 per segment). Positions
  below 0 (pads) count as ``n = 1``.
* non-causal: pass ``num_keys`` (a scalar or one count per batch row, e.g. the number of
  non-pad tokens); every query of a row then uses that ``n``.

The call's visibility counts too (:meth:`SSMax.for_call`, asked by :func:`jaxpos.attention`
once per call): under a named mask_mod with a closed form (a sliding window:
``min(q_pos + 1, window)``; Llama 4's chunks: ``q_pos mod chunk + 1``; a prefix LM in a
causal call: ``q_pos + 1``) ``n`` is the number of keys in the query's softmax.
``kv_lengths`` (a KV cache's fill) hide slots and leave ``n = q_pos + 1``, so a cached
decode step equals the full pass over the same positions. Segments (packed
sequences, padding) are counted by the positions, which restart at 0 in each segment. A
dense ``mask``, another mask_mod, or a mask_mod in a non-causal call are refused: their
counts are not known without a pass over the keys.

:class:`SSMax` is a score_mod ``score * s[head] * log(n)``, so every implementation runs
it (reference, chunked, the Pallas kernel, ``xla`` with a dense bias), with gradients for
``s``. Composition: it multiplies the score it receives, ``scale * q . k`` (after any
``transform_qk`` of the call: a RoPE layer with SSMax is ``position=SSMax`` plus RoPE'd
q/k); a user ``score_mod`` passed to :func:`jaxpos.attention` runs *after* the scheme's
and is therefore not multiplied. To multiply another bias as well, compose the mods
yourself in that order (``compose_score_mods(bias_mod, ssmax.score_mod())`` with
``position=None``). Llama 4's attention temperature (:mod:`jaxpos.schemes.irope`) is a floored
variant applied to the queries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos.schemes.base import PositionScheme, register

__all__ = ["SSMax", "ssmax_multiplier"]

#: Default initial ``s`` for the Flax modules: 0.43, the value of Nakanishi 2025's
#: Figure 1 (``s log n = 1`` at ``n = 10``).
S_INIT = 0.43


def ssmax_multiplier(n: ArrayLike, s: ArrayLike) -> jax.Array:
    """``s[h] * log(n)``: the factor SSMax multiplies the scores by (Nakanishi 2025, Eq. 2).

    Args:
      n: integer array of any shape (the number of visible keys; values below 1 count
        as 1).
      s: float ``[N]``.

    Returns:
      float32 ``[N, *n.shape]``.

    Raises:
      TypeError: float ``n``; integer ``s``. ValueError: ``s`` not of rank 1.
    """
    _checks.check_integer_positions("n", n)
    _checks.check_rank("s", s, (1,), "[num_heads]")
    _checks.check_floating("s", s)
    n = jnp.maximum(jnp.asarray(n, jnp.int32), 1).astype(jnp.float32)
    s = jnp.asarray(s, jnp.float32)
    return s.reshape((-1,) + (1,) * n.ndim) * jnp.log(n)[None]


@register("ssmax")
class SSMax(PositionScheme):
    """Scalable-Softmax as a score_mod: scores of a query times ``s[head] * log(n)``.

    Args:
      s: float ``[N]``, one learned scale per query head (a child: differentiable).
      num_keys: ``None`` (causal: ``n = q_pos + 1``) or an integer scalar or ``[B]`` array
        (non-causal: the number of keys each batch row sees).

    Raises:
      TypeError: integer ``s``; float ``num_keys``.
      ValueError: ``s`` not ``[N]``; ``num_keys`` not a scalar or ``[B]``, or concrete and
        below 1. ``check``: ``s`` not of length ``num_heads``. ``check_causal``: a
        non-causal call without ``num_keys``.
    """

    # fields, set once in __init__ (the pytree's children and static data)
    s: jax.Array
    num_keys: jax.Array | None
    kv_lengths: jax.Array | None  # the call's fill counts (for_call), int32 [B]
    visible: Any  # the call's named mask_mod (for_call), or None

    _children = ("s", "num_keys", "kv_lengths")
    _static = ("visible",)
    params_per_layer = True  # one s per layer and head (Nakanishi 2025, §3)

    def __init__(self, s: ArrayLike, *, num_keys: ArrayLike | None = None):
        _checks.check_rank("s", s, (1,), "[num_heads], one scale per head")
        _checks.check_floating("s", s)
        if num_keys is not None:
            _checks.check_integer_positions("num_keys", num_keys)
            _checks.check_rank("num_keys", num_keys, (0, 1), "a scalar or [B]")
            if _checks.is_concrete(num_keys) and np.any(np.asarray(num_keys) < 1):
                raise ValueError(f"num_keys must be >= 1 (keys each query sees); got "
                                 f"{np.asarray(num_keys).tolist()}.")
            num_keys = jnp.asarray(num_keys, jnp.int32)
        self._set(s=jnp.asarray(s, jnp.float32), num_keys=num_keys, kv_lengths=None,
                  visible=None)

    # ---- for the Flax modules: one s per head and layer.
    #: Logical axis names of the parameters (:mod:`jaxpos.sharding`).
    param_axes = {"s": ("heads",)}

    @classmethod
    def init_params(cls, key: jax.Array, *, num_heads: int, options: dict,
                    param_dtype: Any = jnp.float32, **_: Any) -> dict:
        """``{"s": [num_heads]}`` filled with option ``s_init`` (default :data:`S_INIT`)."""
        s0 = options.get("s_init")
        s0 = S_INIT if s0 is None else _checks.check_real("s_init", s0)
        return {"s": jnp.full((num_heads,), s0, param_dtype)}

    @classmethod
    def from_params(cls, params: dict, *, causal: bool, options: dict, x: jax.Array | None = None,
                    **_: Any) -> PositionScheme:
        """Causal layers count ``q_pos + 1`` keys; a non-causal layer counts the length of
        its input ``x`` ``[B, T, D]`` (pads included: the modules do not pass the padding
        mask to the scheme)."""
        if causal or x is None:
            return cls(params["s"])
        return cls(params["s"], num_keys=np.int32(np.shape(x)[1]))

    def check(self, num_heads: int, head_dim: int) -> None:
        if _checks.shape_of(self.s)[0] != num_heads:
            raise ValueError(f"SSMax s must have shape [{num_heads}] (one per query head); "
                             f"got {_checks.shape_of(self.s)}.")

    def check_causal(self, causal: bool) -> None:
        if not causal and self.num_keys is None:
            raise ValueError("SSMax in a non-causal call needs num_keys= (the number of keys "
                             "each batch row sees); without it n = q_pos + 1 holds for causal "
                             "attention only.")

    def for_call(self, *, causal: bool, mask: Any = None, mask_mod: Any = None,
                 kv_lengths: Any = None) -> PositionScheme:
        """SSMax counting the keys this call's query sees (Nakanishi 2025, Eq. 2: ``n`` is
        the length of the softmax's input): the named mask_mod's closed form
        (``causal_key_count``). ``kv_lengths`` hide cache slots and leave ``n`` to the
        positions (``q_pos + 1``), so a cached decode step equals the full pass.

        Raises:
          ValueError: a dense ``mask``; a mask_mod without a closed form, or any mask_mod
            in a non-causal call (give the count as ``num_keys`` with no mask_mod instead).
        """
        if mask is not None:
            raise ValueError("SSMax counts the keys each query sees (n); a dense mask hides "
                             "keys it cannot count. Express the mask as segment_ids or a named "
                             "mask_mod (SlidingWindowMask, ChunkedAttentionMask, PrefixLMMask).")
        if mask_mod is not None and (not causal or self.num_keys is not None
                                     or not callable(getattr(mask_mod, "causal_key_count", None))):
            raise ValueError(f"SSMax counts the keys each query sees (n): it knows the count "
                             f"under SlidingWindowMask, ChunkedAttentionMask and PrefixLMMask "
                             f"in a causal call without num_keys; got mask_mod "
                             f"{type(mask_mod).__name__} with causal={causal} and num_keys="
                             f"{'set' if self.num_keys is not None else 'None'}.")
        if mask_mod is None:
            # kv_lengths hide cache slots, not positions: n stays q_pos + 1, the count the
            # full pass over the same positions uses (a decode step equals the full pass,
            # also for rows whose positions start past 0)
            return self
        return self.replace(visible=mask_mod)

    def score_mod(self) -> Callable[..., jax.Array] | None:
        """``score * s[head] * log(n)``: ``n = q_pos + 1`` (causal), the call's mask_mod's
        count (:meth:`for_call`) or ``num_keys[batch]``, at most ``kv_lengths[batch]``."""
        s, num_keys, lengths, visible = self.s, self.num_keys, self.kv_lengths, self.visible

        def ssmax(score, batch, head, q_pos, kv_pos):
            if num_keys is not None:
                n = num_keys if num_keys.ndim == 0 else num_keys[batch]
            elif visible is not None:
                n = visible.causal_key_count(batch, head, q_pos)
            else:
                n = q_pos + 1
            if lengths is not None:
                n = jnp.minimum(n, lengths[batch])
            n = jnp.maximum(n, 1)
            return score * (s[head] * jnp.log(n.astype(jnp.float32)))

        return ssmax
