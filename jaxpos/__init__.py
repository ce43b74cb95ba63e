"""jaxpos: every positional-encoding scheme for JAX/Flax transformers, one attention core.

One module per scheme, each with its pure functions and its scheme object
(:mod:`jaxpos.sinusoidal`, :mod:`jaxpos.learned`, :mod:`jaxpos.rope` and
:mod:`jaxpos.rope_scaling`, :mod:`jaxpos.alibi`, :mod:`jaxpos.t5`, :mod:`jaxpos.shaw`,
:mod:`jaxpos.kerple`, :mod:`jaxpos.fire`, :mod:`jaxpos.sandwich`, :mod:`jaxpos.xpos`,
:mod:`jaxpos.fox`, :mod:`jaxpos.irope`); the protocol they follow (:mod:`jaxpos.scheme`);
programmable attention (:mod:`jaxpos.mods`: score_mod, mask_mod, block masks) and
:func:`jaxpos.attention`; Flax modules in :mod:`jaxpos.nnx` and :mod:`jaxpos.linen`;
ring attention in :mod:`jaxpos.parallel`. Importing :mod:`jaxpos` registers every scheme.
"""

from jaxpos.alibi import ALiBi, alibi_bias, alibi_slopes
from jaxpos.attention import ALL_IMPLEMENTATIONS, IMPLEMENTATIONS, attention, default_implementation
from jaxpos.fire import FIRE
from jaxpos.flax_adapter import flax_attention_fn
from jaxpos.fox import FoX
from jaxpos.hf import rope_from_hf_config
from jaxpos.irope import TemperatureTunedNoPE
from jaxpos.kerple import KERPLE, KERPLELog, KERPLEPower
from jaxpos.learned import learned_positions
from jaxpos.mods import (
    BlockMask,
    ChunkedAttentionMask,
    PrefixLMMask,
    SlidingWindowMask,
    and_masks,
    create_block_mask,
    or_masks,
)
from jaxpos.pope import PoPE
from jaxpos.rnope import rnope_swa_layers
from jaxpos.rope import RoPE, apply_rope, half_to_interleaved, interleaved_to_half, rope_frequencies
from jaxpos.rope_scaling import (
    DynamicNTKScaling,
    LinearScaling,
    Llama3Scaling,
    LongRoPEScaling,
    ProportionalScaling,
    YaRNScaling,
)
from jaxpos.sandwich import Sandwich
from jaxpos.scheme import REGISTRY, NoPE, PositionScheme, as_scheme, get_scheme
from jaxpos.shaw import Shaw, shaw_attention
from jaxpos.sinusoidal import relative_head_W, shift_matrix, sinusoidal_pe
from jaxpos.ssmax import SSMax
from jaxpos.stick_breaking import stick_breaking_attention
from jaxpos.t5 import T5Bias, relative_bias_attention, t5_bias, t5_bucket
from jaxpos.xpos import XPos

__version__ = "0.1.0"

__all__ = [
    "ALL_IMPLEMENTATIONS",
    "FIRE",
    "IMPLEMENTATIONS",
    "KERPLE",
    "REGISTRY",
    "ALiBi",
    "BlockMask",
    "ChunkedAttentionMask",
    "DynamicNTKScaling",
    "FoX",
    "KERPLELog",
    "KERPLEPower",
    "LinearScaling",
    "Llama3Scaling",
    "LongRoPEScaling",
    "NoPE",
    "PoPE",
    "PositionScheme",
    "PrefixLMMask",
    "ProportionalScaling",
    "RoPE",
    "SSMax",
    "Sandwich",
    "Shaw",
    "SlidingWindowMask",
    "T5Bias",
    "TemperatureTunedNoPE",
    "XPos",
    "YaRNScaling",
    "alibi_bias",
    "alibi_slopes",
    "and_masks",
    "apply_rope",
    "as_scheme",
    "attention",
    "create_block_mask",
    "default_implementation",
    "flax_attention_fn",
    "get_scheme",
    "half_to_interleaved",
    "interleaved_to_half",
    "learned_positions",
    "or_masks",
    "relative_bias_attention",
    "relative_head_W",
    "rnope_swa_layers",
    "rope_frequencies",
    "rope_from_hf_config",
    "shaw_attention",
    "shift_matrix",
    "sinusoidal_pe",
    "stick_breaking_attention",
    "t5_bias",
    "t5_bucket",
]

# Subpackages imported on first use, so that ``import jaxpos`` stays light (no Flax, no
# Pallas) while ``jaxpos.nnx.DecoderLM`` and ``jaxpos.linen.params_from_nnx`` work after
# a plain ``import jaxpos`` (PEP 562, module ``__getattr__``).
_LAZY_SUBMODULES = ("irope", "kernels", "linen", "mla", "mods", "nnx", "parallel", "testing")


def __getattr__(name: str):
    """Import the subpackages of ``_LAZY_SUBMODULES`` on first attribute access.

    Raises:
      AttributeError: ``name`` is neither an attribute nor one of those subpackages.
    """
    if name in _LAZY_SUBMODULES:
        import importlib

        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":  # a missing dependency, not a missing module
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    import importlib.util

    present = [m for m in _LAZY_SUBMODULES if importlib.util.find_spec(f"{__name__}.{m}")]
    return sorted(set(globals()) | set(present))
