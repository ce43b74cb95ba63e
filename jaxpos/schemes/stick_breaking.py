"""Stick-breaking attention as a position scheme (Tan, Shen, Yang, Courville & Panda 2025,
"Scaling Stick-Breaking Attention: An Efficient Implementation and In-depth Study", ICLR,
arXiv:2410.17980, §2): the keys nearest to the query claim the attention first, so the key
order is the position information and no other scheme is needed.

This module holds the scheme object for the Flax modules (``position="stick_breaking"``);
the attention itself, :func:`jaxpos.stick_breaking_attention`, is an engine of its own
(:mod:`jaxpos.core.stick_breaking`), registered for this scheme's name.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxpos.schemes.base import PositionScheme, register

__all__ = ["StickBreaking"]


@register("stick_breaking")
class StickBreaking(PositionScheme):
    """Stick-breaking attention as a position name for the Flax modules
    (``DecoderLM(position="stick_breaking")``): the layer runs
    :func:`jaxpos.stick_breaking_attention` instead of softmax attention (the ordering of the
    keys is its position information; no parameters).

    Args:
      attend_current, remainder: as :func:`jaxpos.stick_breaking_attention` (the authors'
        defaults, Tan et al. 2025, §2; module options of the same names).

    ``replaces_softmax`` tells the modules to call :meth:`attention` (the engine registered
    for ``"stick_breaking"``, :func:`jaxpos.core.stick_breaking.scheme_attention`) rather than
    :func:`jaxpos.attention`, which refuses this scheme (:meth:`transform_qk` raises):
    softmax attention with it would silently be NoPE. KV-cache decoding stores raw keys;
    the new token's key is in the cache when it attends, so decoding equals the full pass.

    Raises:
      ValueError: a non-causal layer (``check_causal``); :func:`jaxpos.attention` with it.
    """

    attend_current: bool
    remainder: bool

    _static = ("attend_current", "remainder")
    #: The modules call :meth:`attention` instead of :func:`jaxpos.attention`.
    replaces_softmax = True

    def __init__(self, *, attend_current: bool = False, remainder: bool = True):
        self._set(attend_current=bool(attend_current), remainder=bool(remainder))

    @classmethod
    def from_params(cls, params: dict, *, options: dict, **_: Any) -> PositionScheme:
        """Options ``attend_current`` (False) and ``remainder`` (True)."""
        ac, rem = options.get("attend_current"), options.get("remainder")
        return cls(attend_current=bool(ac) if ac is not None else False,
                   remainder=bool(rem) if rem is not None else True)

    def check_causal(self, causal: bool) -> None:
        if not causal:
            raise ValueError("stick-breaking attention is causal by definition (Tan et al. "
                             "2025, §2); got a non-causal layer (an Encoder or causal=False).")

    def transform_qk(self, q: jax.Array, k: jax.Array, q_positions: jax.Array,
                     kv_positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        raise ValueError("StickBreaking replaces softmax attention; call "
                         "jaxpos.stick_breaking_attention (the Flax modules do so for "
                         "position='stick_breaking'), not jaxpos.attention.")
