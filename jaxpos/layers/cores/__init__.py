"""The computations of the Flax modules, written once: each ``*Core`` class holds the
calls of one module, and the NNX class (:mod:`jaxpos.nnx`) and its Linen twin
(:mod:`jaxpos.linen`) inherit it and only declare their parameters and fields. Given the
same weights both twins therefore give the same outputs.

A core reads its parameters as attributes (``self.q_proj.kernel``, ``self.table``, ...)
through :func:`param_value` (an :class:`flax.nnx.Variable` or a plain array) and its
hyper-parameters through small hooks that each twin gives (``_dims()``, ``_position()``,
``_sinks()``, ``_spec()``, ``_scheme_params()``, ``_position_name()``, ``_cache_dims()``,
``_cache_scheme()`` / ``_cache_schemes()``: the scheme of a layer's / each layer's cache).
"""

from jaxpos.layers.cores.layer import (
    AttentionCore,
    BlockCore,
    LearnedCore,
    PositionCore,
    SinusoidalCore,
    attention_for,
    param_value,
    position_scheme,
)
from jaxpos.layers.cores.stacks import DecoderCore, EncoderCore, StackCore

__all__ = ["AttentionCore", "BlockCore", "DecoderCore", "EncoderCore", "LearnedCore",
           "PositionCore", "SinusoidalCore", "StackCore", "attention_for", "param_value",
           "position_scheme"]
