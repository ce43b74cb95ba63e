"""jaxpos: every positional-encoding scheme for JAX/Flax transformers, one attention core.

Pure functions per scheme (:mod:`jaxpos.sinusoidal`, :mod:`jaxpos.learned`,
:mod:`jaxpos.rope`, :mod:`jaxpos.alibi`, :mod:`jaxpos.t5`, :mod:`jaxpos.shaw`), scheme
objects that plug into :func:`jaxpos.attention`, and Flax modules in :mod:`jaxpos.nnx`
and :mod:`jaxpos.linen`.
"""

from jaxpos.alibi import alibi_bias, alibi_slopes
from jaxpos.attention import IMPLEMENTATIONS, attention, default_implementation
from jaxpos.hf import rope_from_hf_config
from jaxpos.learned import learned_positions
from jaxpos.rope import apply_rope, half_to_interleaved, interleaved_to_half, rope_frequencies
from jaxpos.rope_scaling import (
                                 DynamicNTKScaling,
                                 LinearScaling,
                                 Llama3Scaling,
                                 LongRoPEScaling,
                                 ProportionalScaling,
                                 YaRNScaling,
)
from jaxpos.schemes import ALiBi, NoPE, PositionScheme, RoPE, Shaw, T5Bias, as_scheme
from jaxpos.shaw import shaw_attention
from jaxpos.sinusoidal import relative_head_W, shift_matrix, sinusoidal_pe
from jaxpos.t5 import relative_bias_attention, t5_bias, t5_bucket

__version__ = "0.1.0"

__all__ = [
                                 "IMPLEMENTATIONS",
                                 "ALiBi",
                                 "DynamicNTKScaling",
                                 "LinearScaling",
                                 "Llama3Scaling",
                                 "LongRoPEScaling",
                                 "NoPE",
                                 "PositionScheme",
                                 "ProportionalScaling",
                                 "RoPE",
                                 "Shaw",
                                 "T5Bias",
                                 "YaRNScaling",
                                 "alibi_bias",
                                 "alibi_slopes",
                                 "apply_rope",
                                 "as_scheme",
                                 "attention",
                                 "default_implementation",
                                 "half_to_interleaved",
                                 "interleaved_to_half",
                                 "learned_positions",
                                 "relative_bias_attention",
                                 "relative_head_W",
                                 "rope_frequencies",
                                 "rope_from_hf_config",
                                 "shaw_attention",
                                 "shift_matrix",
                                 "sinusoidal_pe",
                                 "t5_bias",
                                 "t5_bucket",
]
