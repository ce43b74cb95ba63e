"""Rotary position embedding, RoPE (Su et al. 2024, "RoFormer", §3.2-3.4), in parts:
:mod:`~jaxpos.schemes.rope.angles` (exact angles, the rotation, the two layouts),
:mod:`~jaxpos.schemes.rope.variants` (p-RoPE, M-RoPE, 2-D axial RoPE),
:mod:`~jaxpos.schemes.rope.scaling` (context extension), :mod:`~jaxpos.schemes.rope.tables`
(cos/sin tables to rotate on load) and :mod:`~jaxpos.schemes.rope.scheme` (:class:`RoPE`).
"""

from jaxpos.schemes.rope import scaling
from jaxpos.schemes.rope.angles import (
    ANGLE_PRECISIONS,
    LAYOUTS,
    apply_rope,
    apply_rope_angles,
    half_to_interleaved,
    interleaved_to_half,
    rope_angles,
    rotate,
)
from jaxpos.schemes.rope.scaling import check_rotary_dim, default_inv_freq, rope_frequencies
from jaxpos.schemes.rope.scheme import CACHE_ROTATIONS, RoPE
from jaxpos.schemes.rope.tables import RopeTables, rope_tables
from jaxpos.schemes.rope.variants import (
    apply_axial_rope,
    apply_mrope,
    axial_rope_angles,
    axial_rope_frequencies,
    mrope_angles,
    mrope_frequency_axes,
    p_rope_frequencies,
)

__all__ = ["ANGLE_PRECISIONS", "CACHE_ROTATIONS", "LAYOUTS", "RoPE", "RopeTables",
           "apply_axial_rope", "apply_mrope", "apply_rope", "apply_rope_angles",
           "axial_rope_angles", "axial_rope_frequencies", "check_rotary_dim", "default_inv_freq",
           "half_to_interleaved", "interleaved_to_half", "mrope_angles", "mrope_frequency_axes",
           "p_rope_frequencies", "rope_angles", "rope_frequencies", "rope_tables", "rotate",
           "scaling"]
