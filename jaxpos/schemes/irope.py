"""Llama 4's iRoPE: RoPE layers interleaved with NoPE layers, and the attention
temperature tuning of the NoPE layers.

Llama 4 (Meta AI 2025, "The Llama 4 herd", model card and the reference code
``llama_models/llama4/model.py``; Hugging Face ``Llama4TextAttention``) drops the rotary
embedding on every ``no_rope_layer_interval``-th layer ("interleaved RoPE"): layers
``i`` with ``(i + 1) % interval == 0`` attend without positions (NoPE; a causal decoder
still infers order from its mask, Kazemnejad et al. 2023, "The Impact of Positional
Encoding on Length Generalization in Transformers", §4), see every earlier token, and
carry the long-range information; the RoPE layers attend within chunks of
``attention_chunk_size`` tokens (a mask_mod ``q_pos // C == kv_pos // C``).

On the NoPE layers the queries are scaled by a temperature that grows with the log of
the position, so attention stays sharp over long contexts (HF cites Nakanishi 2025,
"Scalable-Softmax Is Superior for Attention", arXiv:2501.19399, whose SSMax multiplies
logits by ``s * log n``; Llama 4 uses a floored variant)::

    q *= 1 + attn_scale * log(floor((pos + 1) / floor_scale) + 1)

with ``attn_scale = 0.1`` and ``floor_scale = 8192`` in the released models, so the
factor is exactly 1 for the first 8,191 positions.

Which position? Hugging Face (and Meta's reference code) take ``pos`` from the cache
slot index (``arange(T) + past_seen_tokens``), not from ``position_ids``: with left
padding the two differ by the number of pads. :class:`TemperatureTunedNoPE` scales at
the positions it is given; pass slot indices for HF's numbers (``examples/models/
llama4.py`` does).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos.schemes.base import PositionScheme, register

__all__ = ["TemperatureTunedNoPE", "attention_temperature", "no_rope_layers"]


def no_rope_layers(num_hidden_layers: int, no_rope_layer_interval: int) -> list[int]:
    """Hugging Face's ``Llama4TextConfig.no_rope_layers`` default: ``1`` for a layer that
    uses RoPE, ``0`` for a NoPE layer (HF's name, despite the 1 meaning "rope"); layer
    ``i`` is NoPE when ``(i + 1) % no_rope_layer_interval == 0``.

    Args:
      num_hidden_layers: number of decoder layers (positive int).
      no_rope_layer_interval: every this many layers, one is NoPE (positive int; Llama 4
        Scout and Maverick use 4).

    Returns:
      A list of ``num_hidden_layers`` ints in ``{0, 1}``.

    Raises:
      ValueError / TypeError: a non-positive or non-int argument (named).
    """
    n = _checks.check_positive_int("num_hidden_layers", num_hidden_layers)
    k = _checks.check_positive_int("no_rope_layer_interval", no_rope_layer_interval)
    return [int((i + 1) % k != 0) for i in range(n)]


def _check_temperature_args(attn_scale, floor_scale):
    a = _checks.check_real("attn_scale", attn_scale)
    f = _checks.check_positive_float("floor_scale", floor_scale)
    return a, f


def attention_temperature(positions: ArrayLike, *, attn_scale: float = 0.1,
                          floor_scale: float = 8192.0) -> jax.Array:
    """Llama 4's query temperature on NoPE layers (HF ``Llama4TextAttention``, the
    ``attn_temperature_tuning`` branch): ``1 + attn_scale * log1p(floor((pos + 1) /
    floor_scale))``, computed in float32 in HF's order.

    Args:
      positions: integer array of any shape (HF: the cache slot index of each query).
      attn_scale: real (0.1 in Llama 4). floor_scale: positive (8192 in Llama 4).

    Returns:
      float32, ``positions``' shape; 1.0 for positions ``< floor_scale - 1``.

    Raises:
      TypeError: float positions; a non-real ``attn_scale``.
      ValueError: ``floor_scale <= 0``.
    """
    _checks.check_integer_positions("positions", positions)
    a, f = _check_temperature_args(attn_scale, floor_scale)
    p = jnp.asarray(positions).astype(jnp.float32)
    return jnp.log1p(jnp.floor((p + 1.0) / jnp.float32(f))) * jnp.float32(a) + 1.0


@register("nope_temperature")
class TemperatureTunedNoPE(PositionScheme):
    """A NoPE layer with Llama 4's attention temperature tuning: queries are multiplied by
    :func:`attention_temperature` at their positions, keys are left alone, no score term.

    Args:
      attn_scale: real, HF ``config.attn_scale`` (0.1).
      floor_scale: positive, HF ``config.floor_scale`` (8192).

    The positions handed to :func:`jaxpos.attention` drive the temperature (and the
    causal mask, which is all a NoPE layer uses them for). HF takes the temperature from
    the cache slot index; see the module docstring.

    Raises:
      TypeError / ValueError: bad ``attn_scale`` / ``floor_scale`` (named).
    """

    # fields, set once in __init__ (the pytree's children and static data)
    attn_scale: float
    floor_scale: float

    _static = ("attn_scale", "floor_scale")

    def __init__(self, attn_scale: float = 0.1, floor_scale: float = 8192.0):
        a, f = _check_temperature_args(attn_scale, floor_scale)
        self._set(attn_scale=a, floor_scale=f)

    @classmethod
    def from_params(cls, params: dict, *, options: dict, **_: Any) -> PositionScheme:
        """No parameters; ``scheme_options={"attn_scale": ..., "floor_scale": ...}``
        (Llama 4's 0.1 and 8192 when unset).

        Raises:
          TypeError / ValueError: bad ``attn_scale`` / ``floor_scale`` (named).
        """
        a, f = options.get("attn_scale"), options.get("floor_scale")
        return cls(0.1 if a is None else a, 8192.0 if f is None else f)

    def transform_qk(self, q: jax.Array, k: jax.Array, q_positions: jax.Array,
                     kv_positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``q`` ``[B, Tq, N, H]`` times the temperature at ``q_positions`` (int32
        ``[B|1, Tq]``), cast back to ``q``'s dtype; ``k`` unchanged."""
        t = attention_temperature(q_positions, attn_scale=self.attn_scale,
                                  floor_scale=self.floor_scale)
        t = jnp.reshape(t, np.shape(t)[:2] + (1, 1)) if np.ndim(t) == 2 else t[None, :, None, None]
        return (q * t).astype(q.dtype), k
