"""RNoPE-SWA: interleaved NoPE global layers and RoPE sliding-window layers (Yang, Venkitesh,
Talupuru, Lin, Cairuz, Blunsom & Locatelli 2025, "Rope to Nope and Back Again: A New
Hybrid Attention Strategy", arXiv:2501.18795, §5).

The paper finds a division of labour when the two kinds of layer are interleaved: full
(global) attention without positions (NoPE) retrieves over the whole context, while RoPE
layers restricted to a sliding window carry the recency bias and local order. Its
RNoPE-SWA model uses one NoPE global layer for every three RoPE sliding-window layers;
only the global layers keep the whole KV cache. :func:`rnope_swa_layers` writes that
layout as keyword arguments of :class:`jaxpos.nnx.DecoderLM` (and its Linen twin)::

    DecoderLM(vocab, d_model=..., num_layers=8, num_heads=...,
              **rnope_swa_layers(8, window=4096))

Layer ``i`` is a NoPE global layer when ``(i + 1) % global_every == 0`` (the last of each
group, as in Llama 4's interleaved NoPE layers, :func:`jaxpos.schemes.irope.no_rope_layers`), else
a RoPE layer with :class:`jaxpos.SlidingWindowMask` ``(window)``.
"""

from __future__ import annotations

from jaxpos import _checks
from jaxpos.mods import SlidingWindowMask

__all__ = ["rnope_swa_layers"]


def rnope_swa_layers(num_layers: int, window: int, *, global_every: int = 4,
                     local_position: str = "rope") -> dict:
    """The RNoPE-SWA layout (Yang et al. 2025, §5) as stack keyword arguments.

    Args:
      num_layers: layers of the stack (a positive int).
      window: the sliding window of the local layers, in tokens (a query sees itself and
        the ``window - 1`` tokens before it; :class:`jaxpos.SlidingWindowMask`).
      global_every: one NoPE global layer per this many layers (4: the paper's 1:3 ratio),
        the last of each group.
      local_position: the local layers' scheme (``"rope"``; any attention position name).

    Returns:
      ``{"position": "nope", "layer_positions": [...], "layer_mask_mods": [...]}``: for
      ``DecoderLM(**...)``; ``layer_positions[i]`` is ``"nope"`` for a global layer and
      ``local_position`` otherwise, ``layer_mask_mods[i]`` None (full causal attention) or
      ``SlidingWindowMask(window)``.

    Raises:
      TypeError / ValueError: ``num_layers``, ``window`` or ``global_every`` not positive
        ints; ``local_position`` not a string.
    """
    n = _checks.check_positive_int("num_layers", num_layers)
    every = _checks.check_positive_int("global_every", global_every)
    local = SlidingWindowMask(window)  # validates window
    if not isinstance(local_position, str):
        raise TypeError(f"local_position must be a position name such as 'rope'; got "
                        f"{type(local_position).__name__} {local_position!r}.")
    is_global = [(i + 1) % every == 0 for i in range(n)]
    return {"position": "nope",
            "layer_positions": ["nope" if g else local_position for g in is_global],
            "layer_mask_mods": [None if g else local for g in is_global]}
