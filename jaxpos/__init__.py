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
* :mod:`jaxpos.sharding`: the modules' logical axis names and the rules table that maps
  them to mesh axes;
* :mod:`jaxpos.interop`: Flax's ``attention_fn`` adapter and Hugging Face config readers.

Importing :mod:`jaxpos` registers every scheme.
"""

from jaxpos.core.cope import cope_attention
from jaxpos.core.engines import register_engine, register_engine_module
from jaxpos.core.entry import (
    ALL_IMPLEMENTATIONS,
    IMPLEMENTATIONS,
    attention,
    default_implementation,
)
from jaxpos.core.path import path_attention
from jaxpos.core.stick_breaking import stick_breaking_attention, stick_breaking_weights
from jaxpos.core.wrappers import mla_attention, relative_bias_attention, shaw_attention
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
from jaxpos.schemes.alibi import ALiBi, alibi_bias, alibi_score_mod, alibi_slopes
from jaxpos.schemes.base import REGISTRY, NoPE, PositionScheme, as_scheme, get_scheme
from jaxpos.schemes.cope import CoPE
from jaxpos.schemes.fire import FIRE, fire_bias, fire_normalized_distance
from jaxpos.schemes.fox import (
    FoX,
    FoXCacheRead,
    forget_gate,
    fox_bias,
    fox_cumulative,
    place_gates,
)
from jaxpos.schemes.irope import TemperatureTunedNoPE, attention_temperature, no_rope_layers
from jaxpos.schemes.kerple import KERPLE, KERPLELog, KERPLEPower, kerple_bias
from jaxpos.schemes.learned import learned_positions
from jaxpos.schemes.mla import mla_qk, mla_softmax_scale, split_nope_rope
from jaxpos.schemes.path import PaTH, PaTHFoX, l2_normalise, short_causal_conv
from jaxpos.schemes.pope import PoPE, apply_pope, clamp_phase_bias, pope_frequencies
from jaxpos.schemes.rnope import rnope_swa_layers
from jaxpos.schemes.rope import (
    RoPE,
    apply_rope,
    half_to_interleaved,
    interleaved_to_half,
    rope_frequencies,
)
from jaxpos.schemes.rope.angles import (
    apply_rope_angles,
    check_rotary_dim,
    default_inv_freq,
    rope_angles,
    rotate,
)
from jaxpos.schemes.rope.scaling import (
    DynamicNTKScaling,
    LinearScaling,
    Llama3Scaling,
    LongRoPEScaling,
    ProportionalScaling,
    YaRNScaling,
    depends_on_length,
    frequencies_for_length,
    scaled_frequencies,
    scaling_from_dict,
    yarn_get_mscale,
)
from jaxpos.schemes.rope.tables import (
    RopeTables,
    check_rope_tables,
    rope_tables,
    rotate_with_tables,
)
from jaxpos.schemes.rope.variants import (
    apply_axial_rope,
    apply_mrope,
    axial_rope_angles,
    axial_rope_frequencies,
    check_mrope_section,
    mrope_angles,
    mrope_frequency_axes,
    p_rope_frequencies,
)
from jaxpos.schemes.sandwich import Sandwich, sandwich_bias, sandwich_head_scales, sandwich_inv_freq
from jaxpos.schemes.shaw import Shaw, check_shaw_table, shaw_clipped_index, shaw_logits, shaw_values
from jaxpos.schemes.sinusoidal import (
    relative_head_W,
    shift_matrix,
    sinusoidal_frequencies,
    sinusoidal_pe,
)
from jaxpos.schemes.ssmax import SSMax, ssmax_multiplier
from jaxpos.schemes.stick_breaking import StickBreaking
from jaxpos.schemes.t5 import T5Bias, check_bucket_args, t5_bias, t5_bucket
from jaxpos.schemes.xpos import XPos, apply_xpos, xpos_scale, xpos_zeta

# The kernel's engine registers itself when its module is imported; the core never imports
# the kernel package, so the package names the module for the core's registry here.
register_engine_module("pallas", "jaxpos.kernels.dispatch")

__version__ = "0.1.0"

__all__ = [
    "ALL_IMPLEMENTATIONS",
    "ALiBi",
    "BlockMask",
    "CoPE",
    "ChunkedAttentionMask",
    "DynamicNTKScaling",
    "FIRE",
    "FoX",
    "FoXCacheRead",
    "IMPLEMENTATIONS",
    "KERPLE",
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
    "REGISTRY",
    "RoPE",
    "RopeTables",
    "SSMax",
    "Sandwich",
    "Shaw",
    "SlidingWindowMask",
    "StickBreaking",
    "T5Bias",
    "TemperatureTunedNoPE",
    "XPos",
    "YaRNScaling",
    "alibi_bias",
    "alibi_score_mod",
    "alibi_slopes",
    "and_masks",
    "apply_axial_rope",
    "apply_mrope",
    "apply_pope",
    "apply_rope",
    "apply_rope_angles",
    "apply_xpos",
    "as_scheme",
    "attention",
    "cope_attention",
    "attention_temperature",
    "axial_rope_angles",
    "axial_rope_frequencies",
    "check_bucket_args",
    "check_mrope_section",
    "check_rope_tables",
    "check_rotary_dim",
    "check_shaw_table",
    "clamp_phase_bias",
    "create_block_mask",
    "default_implementation",
    "default_inv_freq",
    "depends_on_length",
    "fire_bias",
    "fire_normalized_distance",
    "flax_attention_fn",
    "forget_gate",
    "fox_bias",
    "fox_cumulative",
    "place_gates",
    "frequencies_for_length",
    "get_scheme",
    "half_to_interleaved",
    "interleaved_to_half",
    "kerple_bias",
    "l2_normalise",
    "learned_positions",
    "mla_attention",
    "mla_qk",
    "mla_softmax_scale",
    "mrope_angles",
    "mrope_frequency_axes",
    "no_rope_layers",
    "or_masks",
    "path_attention",
    "p_rope_frequencies",
    "pope_frequencies",
    "register_engine",
    "relative_bias_attention",
    "relative_head_W",
    "rnope_swa_layers",
    "rope_angles",
    "rope_frequencies",
    "rope_from_hf_config",
    "rope_tables",
    "rotate",
    "rotate_with_tables",
    "sandwich_bias",
    "sandwich_head_scales",
    "sandwich_inv_freq",
    "scaled_frequencies",
    "scaling_from_dict",
    "shaw_attention",
    "shaw_clipped_index",
    "shaw_logits",
    "shaw_values",
    "shift_matrix",
    "short_causal_conv",
    "sinusoidal_frequencies",
    "sinusoidal_pe",
    "split_nope_rope",
    "ssmax_multiplier",
    "stick_breaking_attention",
    "stick_breaking_weights",
    "t5_bias",
    "t5_bucket",
    "xpos_scale",
    "xpos_zeta",
    "yarn_get_mscale",
]

# Subpackages imported on first use, so that ``import jaxpos`` stays light (no Flax, no
# Pallas) while ``jaxpos.nnx.DecoderLM``, ``jaxpos.linen.params_from_nnx`` and
# ``jaxpos.serving.ServingEngine`` work after a plain ``import jaxpos`` (PEP 562, module
# ``__getattr__``). Every public subpackage is either imported above or listed here.
_LAZY_SUBMODULES = ("hf", "kernels", "layers", "linen", "nnx", "parallel", "serving",
                    "sharding", "testing")


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
