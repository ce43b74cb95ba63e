"""jaxpos: every positional-encoding scheme for JAX/Flax transformers, one attention core.

The package is built in rooms by role:

* :mod:`jaxpos.schemes`: one module per scheme, each with its pure functions and its
  scheme object (RoPE and its context extensions in :mod:`jaxpos.schemes.rope`), and the
  protocol they follow (:mod:`jaxpos.schemes.base`);
* :mod:`jaxpos.mods`: programmable attention (score_mod, mask_mod, block masks);
* :mod:`jaxpos.core`: :func:`jaxpos.attention`, its call record and its engines;
* :mod:`jaxpos.kernels`: the fused Pallas kernel;
* :mod:`jaxpos.nnx` and :mod:`jaxpos.linen`: the Flax modules (shared code in
  :mod:`jaxpos.layers`);
* :mod:`jaxpos.parallel`: context parallelism (ring attention);
* :mod:`jaxpos.interop`: Flax's ``attention_fn`` adapter and Hugging Face config readers.

Importing :mod:`jaxpos` registers every scheme.
"""

from jaxpos.core.cope import cope_attention
from jaxpos.core.entry import (
    ALL_IMPLEMENTATIONS,
    IMPLEMENTATIONS,
    attention,
    default_implementation,
)
from jaxpos.core.path import path_attention
from jaxpos.interop.flax import flax_attention_fn
from jaxpos.interop.hf import rope_from_hf_config
from jaxpos.mods import (
    BlockMask,
    ChunkedAttentionMask,
    PrefixLMMask,
    SlidingWindowMask,
    and_masks,
    create_block_mask,
    or_masks,
)
from jaxpos.schemes.alibi import ALiBi, alibi_bias, alibi_slopes
from jaxpos.schemes.base import REGISTRY, NoPE, PositionScheme, as_scheme, get_scheme
from jaxpos.schemes.cope import CoPE
from jaxpos.schemes.fire import FIRE
from jaxpos.schemes.fox import FoX
from jaxpos.schemes.irope import TemperatureTunedNoPE
from jaxpos.schemes.kerple import KERPLE, KERPLELog, KERPLEPower
from jaxpos.schemes.learned import learned_positions
from jaxpos.schemes.path import PaTH, PaTHFoX
from jaxpos.schemes.pope import PoPE
from jaxpos.schemes.rnope import rnope_swa_layers
from jaxpos.schemes.rope import (
    RoPE,
    apply_rope,
    half_to_interleaved,
    interleaved_to_half,
    rope_frequencies,
)
from jaxpos.schemes.rope.scaling import (
    DynamicNTKScaling,
    LinearScaling,
    Llama3Scaling,
    LongRoPEScaling,
    ProportionalScaling,
    YaRNScaling,
)
from jaxpos.schemes.sandwich import Sandwich
from jaxpos.schemes.shaw import Shaw, shaw_attention
from jaxpos.schemes.sinusoidal import relative_head_W, shift_matrix, sinusoidal_pe
from jaxpos.schemes.ssmax import SSMax
from jaxpos.schemes.stick_breaking import stick_breaking_attention
from jaxpos.schemes.t5 import T5Bias, relative_bias_attention, t5_bias, t5_bucket
from jaxpos.schemes.xpos import XPos

__version__ = "0.1.0"

__all__ = [
    "ALL_IMPLEMENTATIONS",
    "FIRE",
    "IMPLEMENTATIONS",
    "KERPLE",
    "REGISTRY",
    "ALiBi",
    "BlockMask",
    "CoPE",
    "ChunkedAttentionMask",
    "DynamicNTKScaling",
    "FoX",
    "KERPLELog",
    "KERPLEPower",
    "LinearScaling",
    "Llama3Scaling",
    "LongRoPEScaling",
    "NoPE",
    "PaTH",
    "PaTHFoX",
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
    "cope_attention",
    "create_block_mask",
    "default_implementation",
    "flax_attention_fn",
    "get_scheme",
    "half_to_interleaved",
    "interleaved_to_half",
    "learned_positions",
    "or_masks",
    "path_attention",
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
_LAZY_SUBMODULES = ("kernels", "linen", "nnx", "parallel", "testing")


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
