"""Hugging Face config readers, the public namespace ``jaxpos.hf``.

The readers live in :mod:`jaxpos.interop.hf` (the interop room, beside the Flax
adapter); this module is their stable import path.
"""

from jaxpos.interop.hf import (
    LAYER_TYPES,
    hf_layer_types,
    hf_rope_settings,
    rope_from_hf_config,
    rope_per_layer_from_hf_config,
    softmax_scale_from_hf_config,
)

__all__ = ["LAYER_TYPES", "hf_layer_types", "hf_rope_settings", "rope_from_hf_config",
           "rope_per_layer_from_hf_config", "softmax_scale_from_hf_config"]
