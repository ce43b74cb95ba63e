"""CoPE as a position name of the Flax modules: ``position="cope"`` (Golovneva, Wang,
Weston & Sukhbaatar 2024, "Contextual Position Encoding: Learning to Count What's
Important", arXiv:2405.18719, §3; the attention is :func:`jaxpos.core.cope.cope_attention`).

Each layer owns its position embeddings ``pos_emb [H, npos]``, one table shared by the
layer's heads and initialised to zero, as the reference code (facebookresearch/RAM
``projects/cope``, ``ContextPosSelfAttn``: ``torch.zeros(1, head_dim, npos)``), so a fresh
CoPE layer starts as NoPE. ``npos`` is the option ``cope_npos`` (default 65: a model
trained at length ``L`` wants ``L + 1``, the code's default ``block_size + 1``;
contextual positions past ``npos - 1`` use the last embedding).

KV-cache decoding stores raw keys: a new query's gates and counts are computed from the
cached keys at read time, so decoding equals the full pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos.schemes.base import PositionScheme, register

__all__ = ["CoPE"]

_DEFAULT_NPOS = 65


@register("cope")
class CoPE(PositionScheme):
    """Contextual position encoding (Golovneva et al. 2024, §3) for the Flax modules: the
    layer runs :func:`jaxpos.core.cope.cope_attention` with its ``pos_emb``.

    Args:
      pos_emb: float ``[H, npos]`` or ``[N, H, npos]``.

    ``replaces_softmax`` tells the modules to call :meth:`attention` (the engine registered
    for ``"cope"``, :func:`jaxpos.core.cope.scheme_attention`) instead of
    :func:`jaxpos.attention` (which refuses the scheme: :meth:`transform_qk` raises).

    Raises:
      ValueError: a non-causal layer.
    """

    pos_emb: jax.Array

    _children = ("pos_emb",)
    replaces_softmax = True
    params_per_layer = True

    def __init__(self, pos_emb: ArrayLike):
        _checks.check_floating("pos_emb", pos_emb)
        _checks.check_rank("pos_emb", pos_emb, (2, 3), "[H, npos] or [N, H, npos]")
        self._set(pos_emb=pos_emb)

    #: Logical axis names of the parameters (:mod:`jaxpos.sharding`).
    param_axes = {"pos_emb": ("head_dim", "position_rows")}

    @classmethod
    def init_params(cls, key: jax.Array, *, head_dim: int, param_dtype=jnp.float32,
                    options: dict, **_) -> dict:
        """``{"pos_emb": zeros [head_dim, npos]}``, ``npos`` the option ``cope_npos``."""
        npos = options.get("cope_npos")
        npos = _DEFAULT_NPOS if npos is None else _checks.check_positive_int("cope_npos", npos)
        return {"pos_emb": jnp.zeros((head_dim, npos), param_dtype)}

    @classmethod
    def from_params(cls, params: dict, *, options: dict, **_) -> PositionScheme:
        options.get("cope_npos")  # read by init_params
        return cls(params["pos_emb"])

    def check(self, num_heads: int, head_dim: int) -> None:
        if self.pos_emb.shape[-2] != head_dim:
            raise ValueError(f"CoPE's pos_emb {tuple(self.pos_emb.shape)} is for head_dim "
                             f"{self.pos_emb.shape[-2]}; the layer has head_dim {head_dim}.")

    def check_causal(self, causal: bool) -> None:
        if not causal:
            raise ValueError("CoPE counts the keys from the key up to the query (Golovneva et "
                             "al. 2024, Eq. 3): causal layers only; got a non-causal layer.")

    def transform_qk(self, q: jax.Array, k: jax.Array, q_positions: jax.Array,
                     kv_positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        raise ValueError("CoPE's position term counts the gates of the keys in between, "
                         "which no engine of jaxpos.attention computes; call "
                         "jaxpos.cope_attention (implementation 'reference' or 'chunked'; "
                         "the Flax modules do so for position='cope').")
