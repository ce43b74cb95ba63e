"""Pallas kernels for jaxpos (installed as ``jaxpos.kernels``).

* :func:`attention_via_kernel`: the fused, programmable attention kernel
  (``jaxpos.attention(..., implementation="pallas")``): score_mod / mask_mod traced inside
  the kernel, block-sparse tile skipping, attention sinks; forward and backward.
* :func:`attention_via_xla`: ``jax.nn.dot_product_attention`` (cuDNN on NVIDIA GPUs) with
  jaxpos's semantics (``implementation="xla"``); lives in :mod:`jaxpos.core.xla`, re-exported.
* :func:`choose_implementation`: the dispatch rule behind ``implementation=None``.
* :func:`fused_attention`: the kernel with RoPE / ALiBi / an offset bias given as arrays.
* :func:`supports_scheme`: the scheme protocol's ``fusable``.

``docs/kernel.md`` describes the design and the measurements behind the dispatch rule.
"""

from jaxpos.core.xla import attention_via_xla
from jaxpos.kernels.config import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q
from jaxpos.kernels.convenience import alibi_score_mod, fused_attention, offset_bias_score_mod
from jaxpos.kernels.dispatch import (
    DENSE_BIAS_BUDGET_BYTES,
    attention_via_kernel,
    choose_implementation,
    supports_scheme,
)

__all__ = [
    "DEFAULT_BLOCK_K",
    "DEFAULT_BLOCK_Q",
    "DENSE_BIAS_BUDGET_BYTES",
    "alibi_score_mod",
    "attention_via_kernel",
    "attention_via_xla",
    "choose_implementation",
    "fused_attention",
    "offset_bias_score_mod",
    "supports_scheme",
]
