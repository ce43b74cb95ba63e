"""RoPE context extension: how long-context models stretch the rotary frequencies.

A registry in the manner of Hugging Face's ``modeling_rope_utils.py``: each method is a
frozen dataclass whose field names are the keys of HF's ``rope_scaling`` /
``rope_parameters`` dict, and one function that returns ``(inv_freq, attention_factor)``.
Adding a method touches one place (a dataclass and its ``@_register`` function).

* ``"linear"``, :class:`LinearScaling`: Chen et al. 2023, "Extending Context Window of
  Large Language Models via Positional Interpolation", §2.2 (and kaiokendev).
* ``"dynamic"``, :class:`DynamicNTKScaling`: NTK-aware scaled RoPE (bloc97, emozilla
  2023); Peng et al. 2024 (YaRN) §3.3.
* ``"yarn"``, :class:`YaRNScaling`: Peng et al. 2024, "YaRN: Efficient Context Window
  Extension of Large Language Models", ICLR, §3.2-3.4.
* ``"llama3"``, :class:`Llama3Scaling`: Meta, Llama 3.1 (``apply_scaling`` in
  llama-models; "The Llama 3 Herd of Models").
* ``"longrope"``, :class:`LongRoPEScaling`: Ding et al. 2024, "LongRoPE: Extending LLM
  Context Window Beyond 2 Million Tokens", ICML; the Phi-3 technical report.
* ``"proportional"``, :class:`ProportionalScaling`: p-RoPE (Barbero et al. 2025); HF's
  Gemma 4 rope type.

**Where the attention factor goes.** ``attention_factor`` (YaRN's ``mscale``, LongRoPE's
scaling) multiplies cos and sin, as HF does (``cos = emb.cos() * attention_scaling``); it
is therefore applied once to q and once to k, and multiplies the attention logits by its
square: YaRN's ``sqrt(1/t) = 0.1 ln(s) + 1`` per side, ``1/t`` on the logits (Peng et al.
§3.4). :func:`jaxpos.apply_rope` and :class:`jaxpos.RoPE` take it as
``attention_factor``; do not also fold it into the softmax ``scale`` (that would apply
it twice). DeepSeek-V2/V3 are the exception by design: with ``mscale == mscale_all_dim``
the factor here is 1.0 and the model instead multiplies its softmax scale by
``(0.1 * mscale_all_dim * ln(factor) + 1) ** 2``
(see :func:`jaxpos.interop.hf.rope_from_hf_config`).

**Numbers.** Every function reproduces HF's float32 arithmetic op for op (NumPy float32
on the host, PyTorch's ``x / t`` as ``reciprocal(t) * x``), so ``inv_freq`` equals HF's to
one float32 ulp: PyTorch's ``pow`` is not always correctly rounded and differs from
NumPy's in about 1% of entries (the parity tests measure it).

**Length-dependent methods.** Dynamic NTK and LongRoPE pick their frequencies from the
sequence length ``seq_len = max(position) + 1`` of each call (HF's rule).
:func:`frequencies_for_length` does that with ``jnp.where`` on a traced length, so there
is no cached state: a short call after a long one gets the unscaled frequencies. (HF's
dynamic NTK keeps the largest length seen so far, ``max_seq_len_cached``, until a call
shorter than ``max_position_embeddings`` resets it; jaxpos does not keep it.)
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos.schemes.rope.angles import check_rotary_dim, default_inv_freq, pow32

__all__ = [
    "ROPE_TYPES",
    "DynamicNTKScaling",
    "LinearScaling",
    "Llama3Scaling",
    "LongRoPEScaling",
    "ProportionalScaling",
    "YaRNScaling",
    "depends_on_length",
    "frequencies_for_length",
    "scaled_frequencies",
    "scaling_from_dict",
    "yarn_get_mscale",
]

_f32 = np.float32


# ------------------------------------------------------------------------- frequencies
def rope_frequencies(rotary_dim: int, base: float = 10000.0, *, scaling: Any = None,
                     seq_len: ArrayLike | None = None) -> tuple[jax.Array, float]:
    """Inverse frequencies of RoPE and the attention factor, as Hugging Face's rope init
    functions return them (Su et al. 2024, eq. 15: ``theta_i = base ** (-2(i-1)/d)``).

    Args:
      rotary_dim: number of rotated features per head (even, positive). With partial
        rotary (GPT-NeoX, Phi) this is ``int(head_dim * partial_rotary_factor)``, and the
        exponent divides by it, not by ``head_dim``.
      base: ``rope_theta`` (10,000 in RoFormer; 500,000 in Llama 3).
      scaling: ``None`` or a context-extension dataclass (:mod:`jaxpos.schemes.rope.scaling`).
      seq_len: Python int, for scalings that depend on the length (dynamic NTK, LongRoPE).

    Returns:
      ``(inv_freq, attention_factor)``: float32 ``[rotary_dim // 2]`` in radians per
      position, computed with float32 operations in HF's order
      (``1 / base ** (arange(0, d, 2) / d)``); and a Python float (1.0 without scaling)
      that multiplies cos and sin, hence the attention logits by its square.

    Raises:
      ValueError: odd or non-positive ``rotary_dim``; ``base <= 0``.
      TypeError: ``rotary_dim`` not an int.
    """
    check_rotary_dim(rotary_dim)
    _checks.check_positive_float("base", base)
    if scaling is not None:
        return scaled_frequencies(rotary_dim, base, scaling, seq_len=seq_len)
    return jnp.asarray(default_inv_freq(rotary_dim, base)), 1.0


def _positive(name, value, *, cls):
    return _checks.check_positive_float(f"{cls}.{name}", value)


def _positive_int(name, value, *, cls):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{cls}.{name} must be an int; got {type(value).__name__} {value!r}.")
    if value <= 0:
        raise ValueError(f"{cls}.{name} must be > 0; got {value}.")
    return int(value)


# ----------------------------------------------------------------------- dataclasses
@dataclasses.dataclass(frozen=True)
class LinearScaling:
    """Position interpolation (Chen et al. 2023, §2.2): every frequency divided by
    ``factor`` (HF ``rope_type="linear"``). Attention factor 1."""

    factor: float
    rope_type: ClassVar[str] = "linear"

    def __post_init__(self):
        object.__setattr__(self, "factor", _positive("factor", self.factor, cls="LinearScaling"))


@dataclasses.dataclass(frozen=True)
class DynamicNTKScaling:
    """Dynamic NTK-aware scaling (HF ``rope_type="dynamic"``): for a sequence of
    ``seq_len > L`` positions the base becomes
    ``base * (factor * seq_len / L - (factor - 1)) ** (d / (d - 2))``; at ``seq_len <= L``
    RoPE is unchanged. ``L`` is ``original_max_position_embeddings``, which HF reads from
    ``config.max_position_embeddings`` for this method (not from ``rope_scaling``).
    Attention factor 1."""

    factor: float
    original_max_position_embeddings: int
    rope_type: ClassVar[str] = "dynamic"

    def __post_init__(self):
        c = "DynamicNTKScaling"
        object.__setattr__(self, "factor", _positive("factor", self.factor, cls=c))
        object.__setattr__(self, "original_max_position_embeddings", _positive_int(
            "original_max_position_embeddings", self.original_max_position_embeddings, cls=c))


@dataclasses.dataclass(frozen=True)
class YaRNScaling:
    """YaRN (Peng et al. 2024, §3.2 "NTK-by-parts" + §3.4 temperature; HF
    ``rope_type="yarn"``). Frequencies whose wavelength is short compared with
    ``original_max_position_embeddings`` (more than ``beta_fast`` rotations) keep their
    value, those with fewer than ``beta_slow`` rotations are divided by ``factor``, with a
    linear ramp between (ramp bounds floored/ceiled when ``truncate``, HF's default).

    ``attention_factor`` defaults to ``0.1 ln(factor) + 1``, or with both ``mscale`` and
    ``mscale_all_dim`` (DeepSeek) to
    ``(0.1 mscale ln f + 1) / (0.1 mscale_all_dim ln f + 1)``. HF quirks kept:
    ``beta_fast=0`` / ``beta_slow=0`` mean the defaults 32 / 1 (HF uses ``or``); the upper
    ramp bound is clipped at ``rotary_dim - 1``, not ``rotary_dim / 2 - 1``.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    rope_type: ClassVar[str] = "yarn"

    def __post_init__(self):
        c = "YaRNScaling"
        object.__setattr__(self, "factor", _positive("factor", self.factor, cls=c))
        object.__setattr__(self, "original_max_position_embeddings", _positive_int(
            "original_max_position_embeddings", self.original_max_position_embeddings, cls=c))
        for n in ("beta_fast", "beta_slow"):
            v = getattr(self, n)
            if v is None or not (float(v) >= 0):
                raise ValueError(f"{c}.{n} must be a number >= 0; got {v!r}.")
            object.__setattr__(self, n, float(v))
        if self.attention_factor is not None:
            object.__setattr__(self, "attention_factor",
                               _positive("attention_factor", self.attention_factor, cls=c))
        object.__setattr__(self, "truncate", bool(self.truncate))


@dataclasses.dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1 frequency scaling (HF ``rope_type="llama3"``): wavelengths shorter than
    ``L / high_freq_factor`` unchanged, longer than ``L / low_freq_factor`` divided by
    ``factor``, and in between ("smoothing band") a blend
    ``(1 - s) inv_freq / factor + s inv_freq`` with ``s = (L / wavelen - low) / (high - low)``;
    ``L = original_max_position_embeddings`` (8192 for Llama 3.1). Attention factor 1."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: ClassVar[str] = "llama3"

    def __post_init__(self):
        c = "Llama3Scaling"
        for n in ("factor", "low_freq_factor", "high_freq_factor"):
            object.__setattr__(self, n, _positive(n, getattr(self, n), cls=c))
        object.__setattr__(self, "original_max_position_embeddings", _positive_int(
            "original_max_position_embeddings", self.original_max_position_embeddings, cls=c))
        if not self.high_freq_factor >= self.low_freq_factor:
            raise ValueError(f"{c}: high_freq_factor must be >= low_freq_factor; got "
                             f"{self.high_freq_factor} and {self.low_freq_factor}.")


@dataclasses.dataclass(frozen=True)
class LongRoPEScaling:
    """LongRoPE (Ding et al. 2024; Phi-3; HF ``rope_type="longrope"``): per-frequency
    rescale factors, ``inv_freq[i] = 1 / (ext[i] * base ** (2i/d))`` with
    ``ext = long_factor`` when ``seq_len > original_max_position_embeddings`` and
    ``short_factor`` otherwise (chosen per call from the positions).

    ``attention_factor`` defaults to ``sqrt(1 + ln(factor) / ln(L))`` (1 if
    ``factor <= 1``), where ``factor`` is HF's ``max_position_embeddings / L`` for Phi-3
    (:func:`jaxpos.interop.hf.rope_from_hf_config` fills it in); with neither ``factor`` nor
    ``attention_factor`` given the factor is 1.0. The same factor is used for short and
    long sequences, as in HF.
    """

    short_factor: tuple
    long_factor: tuple
    original_max_position_embeddings: int
    attention_factor: float | None = None
    factor: float | None = None
    rope_type: ClassVar[str] = "longrope"

    def __post_init__(self):
        c = "LongRoPEScaling"
        for n in ("short_factor", "long_factor"):
            v = getattr(self, n)
            try:
                t = tuple(float(x) for x in np.asarray(v, np.float64).reshape(-1))
            except (TypeError, ValueError):
                raise TypeError(f"{c}.{n} must be a list of numbers; got {v!r}.") from None
            if np.ndim(v) != 1 or not all(x > 0 for x in t):
                raise ValueError(f"{c}.{n} must be a 1-D list of numbers > 0; got {v!r}.")
            object.__setattr__(self, n, t)
        if len(self.short_factor) != len(self.long_factor):
            raise ValueError(f"{c}: short_factor and long_factor must have the same length; "
                             f"got {len(self.short_factor)} and {len(self.long_factor)}.")
        object.__setattr__(self, "original_max_position_embeddings", _positive_int(
            "original_max_position_embeddings", self.original_max_position_embeddings, cls=c))
        for n in ("attention_factor", "factor"):
            if getattr(self, n) is not None:
                object.__setattr__(self, n, _positive(n, getattr(self, n), cls=c))


@dataclasses.dataclass(frozen=True)
class ProportionalScaling:
    """p-RoPE as HF's ``rope_type="proportional"`` (Gemma 4; Barbero et al. 2025): the
    first ``int(partial_rotary_factor * d // 2)`` frequencies of a full-width RoPE
    (exponent over ``d = rotary_dim``), zeros for the rest, all divided by ``factor``.
    ``rotary_dim`` is the full head width here. Attention factor 1."""

    partial_rotary_factor: float = 1.0
    factor: float = 1.0
    rope_type: ClassVar[str] = "proportional"

    def __post_init__(self):
        p = float(self.partial_rotary_factor)
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"ProportionalScaling.partial_rotary_factor must be in [0, 1]; "
                             f"got {self.partial_rotary_factor!r}.")
        object.__setattr__(self, "partial_rotary_factor", p)
        object.__setattr__(self, "factor", _positive("factor", self.factor,
                                                     cls="ProportionalScaling"))


# -------------------------------------------------------------------------- registry
ROPE_TYPES: dict[str, type] = {}
_INIT_FUNCTIONS: dict[type, Callable] = {}


def _register(cls):
    def deco(fn):
        ROPE_TYPES[cls.rope_type] = cls
        _INIT_FUNCTIONS[cls] = fn
        return fn
    return deco


def _exps(dim: int) -> np.ndarray:
    """float32 ``arange(0, dim, 2) / dim`` (HF)."""
    return np.arange(0, dim, 2).astype(_f32) / _f32(dim)


def _recip(x):
    return (_f32(1.0) / np.asarray(x, _f32)).astype(_f32)


@_register(LinearScaling)
def _linear(s: LinearScaling, dim: int, base: float, seq_len):
    return (default_inv_freq(dim, base) / _f32(s.factor)).astype(_f32), 1.0


def _check_dynamic_dim(dim: int) -> None:
    if dim < 4:  # the base is raised to dim / (dim - 2)
        raise ValueError(f"DynamicNTKScaling needs rotary_dim >= 4 (its base grows as "
                         f"(...) ** (rotary_dim / (rotary_dim - 2))); got rotary_dim={dim}.")


@_register(DynamicNTKScaling)
def _dynamic(s: DynamicNTKScaling, dim: int, base: float, seq_len):
    _check_dynamic_dim(dim)
    L = s.original_max_position_embeddings
    if seq_len is None or seq_len <= L:
        return default_inv_freq(dim, base), 1.0
    # HF with a Python int seq_len: the new base in float64, the powers in float32.
    new_base = base * ((s.factor * seq_len / L) - (s.factor - 1)) ** (dim / (dim - 2))
    return _recip(pow32(new_base, _exps(dim))), 1.0


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``); Peng et al. §3.4,
    and DeepSeek-V2/V3's softmax-scale correction.

    Raises:
      TypeError: ``scale`` or ``mscale`` not a real number.
      ValueError: ``scale`` not a finite number > 0 (a context-extension factor).
    """
    scale = _checks.check_positive_float("scale", scale)
    mscale = _checks.check_real("mscale", mscale)
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_attention_factor(s: YaRNScaling) -> float:
    if s.attention_factor is not None:
        return float(s.attention_factor)
    if s.mscale and s.mscale_all_dim:
        return float(yarn_get_mscale(s.factor, s.mscale)
                     / yarn_get_mscale(s.factor, s.mscale_all_dim))
    return float(yarn_get_mscale(s.factor))


@_register(YaRNScaling)
def _yarn(s: YaRNScaling, dim: int, base: float, seq_len):
    beta_fast = s.beta_fast or 32.0  # HF: `or` -- a 0 means the default
    beta_slow = s.beta_slow or 1.0
    L = s.original_max_position_embeddings

    def correction_dim(num_rotations):  # §3.2: the dimension with this many rotations
        return (dim * math.log(L / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: prevent a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=_f32) - _f32(low)) / _f32(high - low), 0, 1)
    extrapolation_factor = (_f32(1) - ramp.astype(_f32)).astype(_f32)
    pos_freqs = pow32(base, _exps(dim))
    inv_extrapolation = _recip(pos_freqs)
    inv_interpolation = _recip(_f32(s.factor) * pos_freqs)
    inv_freq = (inv_interpolation * (_f32(1) - extrapolation_factor)
                + inv_extrapolation * extrapolation_factor)
    return inv_freq.astype(_f32), _yarn_attention_factor(s)


@_register(Llama3Scaling)
def _llama3(s: Llama3Scaling, dim: int, base: float, seq_len):
    inv_freq = default_inv_freq(dim, base)
    L = s.original_max_position_embeddings
    low_freq_wavelen = L / s.low_freq_factor
    high_freq_wavelen = L / s.high_freq_factor
    wavelen = _recip(inv_freq) * _f32(2 * math.pi)  # torch: 2*pi / t == reciprocal(t) * 2*pi
    inv_llama = np.where(wavelen > _f32(low_freq_wavelen), inv_freq / _f32(s.factor), inv_freq)
    # Equal factors (Llama 4 Scout/Maverick ship 1.0 / 1.0) leave no smoothing band: the
    # "medium" wavelengths below are then empty and the 0/0 here is never selected.
    with np.errstate(divide="ignore", invalid="ignore"):
        smooth = (_recip(wavelen) * _f32(L) - _f32(s.low_freq_factor)) / _f32(
            s.high_freq_factor - s.low_freq_factor)
        smoothed = (_f32(1) - smooth) * inv_llama / _f32(s.factor) + smooth * inv_llama
    medium = ~(wavelen < _f32(high_freq_wavelen)) & ~(wavelen > _f32(low_freq_wavelen))
    return np.where(medium, smoothed, inv_llama).astype(_f32), 1.0


def _longrope_attention_factor(s: LongRoPEScaling) -> float:
    if s.attention_factor is not None:
        return float(s.attention_factor)
    if s.factor is None or s.factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(s.factor) / math.log(s.original_max_position_embeddings))


def _longrope_inv_freq(s: LongRoPEScaling, dim: int, base: float, long: bool):
    ext = np.asarray(s.long_factor if long else s.short_factor, _f32)
    if ext.shape[0] != dim // 2:
        raise ValueError(f"LongRoPEScaling factors must have rotary_dim // 2 = {dim // 2} "
                         f"entries; got {ext.shape[0]}.")
    return _recip(ext * pow32(base, _exps(dim)))


@_register(LongRoPEScaling)
def _longrope(s: LongRoPEScaling, dim: int, base: float, seq_len):
    long = bool(seq_len) and seq_len > s.original_max_position_embeddings
    return _longrope_inv_freq(s, dim, base, long), _longrope_attention_factor(s)


@_register(ProportionalScaling)
def _proportional(s: ProportionalScaling, dim: int, base: float, seq_len):
    n_rot = int(s.partial_rotary_factor * dim // 2)
    exps = np.arange(0, 2 * n_rot, 2).astype(_f32) / _f32(dim)
    inv = np.concatenate([_recip(pow32(base, exps)), np.zeros(dim // 2 - n_rot, _f32)])
    return (inv / _f32(s.factor)).astype(_f32), 1.0


# ------------------------------------------------------------------------ public API
def _check_scaling(scaling):
    if type(scaling) not in _INIT_FUNCTIONS:
        names = ", ".join(c.__name__ for c in _INIT_FUNCTIONS)
        raise TypeError(f"scaling must be None or one of {names}; got "
                        f"{type(scaling).__name__} {scaling!r}.")


def scaled_frequencies(rotary_dim: int, base: float, scaling: Any, *,
                       seq_len: ArrayLike | None = None) -> tuple[jax.Array, float]:
    """``(inv_freq, attention_factor)`` of a context-extension method, as HF's
    ``ROPE_INIT_FUNCTIONS[rope_type](config, seq_len=seq_len)`` returns them.

    Args:
      rotary_dim: rotated features per head (``int(head_dim * partial_rotary_factor)``;
        for :class:`ProportionalScaling` the full head width).
      base: ``rope_theta``.
      scaling: one of the dataclasses of this module.
      seq_len: Python int or None; only dynamic NTK and LongRoPE use it (``None``: the
        unscaled / short frequencies, as at HF's init).

    Returns:
      ``(jax.Array float32 [rotary_dim // 2], float)``; the float multiplies cos and sin.

    Raises:
      TypeError: unknown ``scaling`` type; ``seq_len`` not an int.
      ValueError: bad ``rotary_dim`` or ``base``; LongRoPE factors of the wrong length.
    """
    check_rotary_dim(rotary_dim)
    _checks.check_positive_float("base", base)
    _check_scaling(scaling)
    if seq_len is not None:
        seq_len = _checks.check_positive_int("seq_len", seq_len)
    inv_freq, af = _INIT_FUNCTIONS[type(scaling)](scaling, rotary_dim, float(base), seq_len)
    return jnp.asarray(inv_freq, jnp.float32), float(af)


def depends_on_length(scaling: Any) -> bool:
    """True for the methods whose frequencies change with the sequence length (dynamic
    NTK, LongRoPE); False for ``None`` and the fixed ones.

    Raises:
      TypeError: ``scaling`` is neither ``None`` nor a scaling dataclass.
    """
    if scaling is not None:
        _check_scaling(scaling)
    return isinstance(scaling, (DynamicNTKScaling, LongRoPEScaling))


def frequencies_for_length(rotary_dim: int, base: float, scaling, seq_len):
    """Per-call ``(inv_freq, attention_factor)`` from a (possibly traced) length.

    ``seq_len`` is an integer scalar, ``max(position) + 1`` of the call (HF's rule). Dynamic
    NTK builds the scaled frequencies with float32 jnp operations in HF's order (HF also
    switches to float32 there, the length being a tensor) and selects them with
    ``jnp.where(seq_len > L, scaled, unscaled)``; LongRoPE selects ``long_factor`` or
    ``short_factor`` the same way. No state is kept between calls. Other methods return
    their fixed frequencies.

    Returns:
      ``(jax.Array float32 [rotary_dim // 2], float)``.

    Raises:
      The errors of :func:`scaled_frequencies`; ``TypeError`` for a ``seq_len`` that is
        not an integer (a Python int or an integer array).
    """
    if isinstance(seq_len, bool) or not (
            isinstance(seq_len, (int, np.integer))
            or (hasattr(seq_len, "dtype") and jnp.issubdtype(seq_len.dtype, jnp.integer))):
        raise TypeError(f"seq_len must be an integer (max(position) + 1); got "
                        f"{type(seq_len).__name__} {seq_len!r}.")
    if scaling is None:
        return rope_frequencies(rotary_dim, base)
    short, af = scaled_frequencies(rotary_dim, base, scaling, seq_len=None)
    if not depends_on_length(scaling):
        return short, af
    seq_len = jnp.asarray(seq_len).astype(jnp.int32)
    L = scaling.original_max_position_embeddings
    if isinstance(scaling, LongRoPEScaling):
        long = jnp.asarray(_longrope_inv_freq(scaling, rotary_dim, float(base), True))
        return jnp.where(seq_len > L, long, short), af
    # Dynamic NTK, op for op as HF's _compute_dynamic_ntk_parameters with a tensor seq_len.
    _check_dynamic_dim(rotary_dim)
    f32 = jnp.float32
    sl = jnp.maximum(seq_len, L).astype(f32)
    t = (f32(scaling.factor) * sl) / f32(L) - f32(scaling.factor - 1)
    new_base = f32(base) * t ** f32(rotary_dim / (rotary_dim - 2))
    scaled = 1.0 / (new_base ** jnp.asarray(_exps(rotary_dim)))
    return jnp.where(seq_len > L, scaled, short), af


#: Keys any ``rope_scaling`` / ``rope_parameters`` dict may hold besides its type's own
#: (HF's ``_check_received_keys`` accepts these for every type).
_COMMON_ROPE_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})


def _warn_as_hf(rope_type: str, cls, params: dict, fields: set) -> None:
    """Warn where Hugging Face's ``rope_config_validation`` warns
    (``transformers/modeling_rope_utils.py``): keys the type does not read (a typo such
    as ``"beta_fats"`` would otherwise be dropped silently) and a context-extension
    ``factor`` below 1 (which shrinks the context: ``"linear"`` with 0.5 doubles every
    frequency). Proportional RoPE takes factors in ``[0, 1)`` by design."""
    unknown = sorted(set(params) - fields - _COMMON_ROPE_KEYS)
    if unknown:
        warnings.warn(f"Unrecognized keys in rope_scaling for rope_type={rope_type!r}: "
                      f"{unknown} (ignored; {cls.__name__} reads {sorted(fields)}).",
                      UserWarning, stacklevel=3)
    factor = params.get("factor")
    if cls is not ProportionalScaling and isinstance(factor, (int, float)) \
            and not isinstance(factor, bool) and factor < 1:
        warnings.warn(f"rope_scaling's factor must be a number >= 1 for rope_type="
                      f"{rope_type!r} (a context-extension factor, as Hugging Face "
                      f"checks); got {factor}, which shrinks the context.", UserWarning,
                      stacklevel=3)


def scaling_from_dict(params: dict[str, Any], *, max_position_embeddings=None):
    """A scaling dataclass from an HF ``rope_scaling`` / ``rope_parameters`` dict, or None
    for ``"default"`` (and Qwen2-VL's ``"mrope"``). Used by :mod:`jaxpos.interop.hf`.

    Warns (``UserWarning``, where Hugging Face's ``rope_config_validation`` warns): keys
    the type does not read; a ``factor`` below 1 (except proportional RoPE).

    Raises:
      ValueError: unknown ``rope_type``; missing keys.
    """
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in ("default", "mrope", None):
        return None
    if rope_type == "su":  # Phi-3's early name for LongRoPE
        rope_type = "longrope"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type must be one of {('default', 'mrope') + tuple(ROPE_TYPES)}; "
                         f"got {rope_type!r}.")
    cls = ROPE_TYPES[rope_type]
    p = dict(params)
    if cls in (YaRNScaling, LongRoPEScaling) and p.get("factor") is None \
            and max_position_embeddings is not None and p.get("original_max_position_embeddings"):
        p["factor"] = max_position_embeddings / p["original_max_position_embeddings"]
    if cls is DynamicNTKScaling:
        # HF's dynamic NTK uses config.max_position_embeddings as the original length.
        L = max_position_embeddings if max_position_embeddings is not None else \
            p.get("original_max_position_embeddings")
        p["original_max_position_embeddings"] = L
    fields = {f.name for f in dataclasses.fields(cls)}
    _warn_as_hf(rope_type, cls, params, fields)
    kwargs = {k: v for k, v in p.items() if k in fields and v is not None}
    if cls is YaRNScaling:
        for k in ("beta_fast", "beta_slow"):
            if k in p and p[k] is not None:
                kwargs[k] = p[k]
    missing = [f.name for f in dataclasses.fields(cls)
               if f.default is dataclasses.MISSING and f.name not in kwargs]
    if missing:
        raise ValueError(f"rope_scaling of type {rope_type!r} is missing {missing}; got keys "
                         f"{sorted(params)}.")
    return cls(**kwargs)
