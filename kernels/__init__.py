"""Pallas kernels for jaxpos (installed as ``jaxpos.kernels``).

:func:`fused_attention` is the fused kernel; :func:`attention_via_kernel` is what
``jaxpos.attention(..., implementation="pallas")`` calls, and :func:`supports_scheme`
tells ``jaxpos.default_implementation`` which schemes the kernel fuses.
"""

from jaxpos.kernels.dispatch import attention_via_kernel, scheme_to_kernel_args, supports_scheme
from jaxpos.kernels.fused import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, fused_attention

__all__ = [
           "DEFAULT_BLOCK_K",
           "DEFAULT_BLOCK_Q",
           "attention_via_kernel",
           "fused_attention",
           "scheme_to_kernel_args",
           "supports_scheme",
]
