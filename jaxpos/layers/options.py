"""Position names, scheme options and the checks of module arguments, shared by
:mod:`jaxpos.nnx` and :mod:`jaxpos.linen`.

A module reaches a scheme through the registry (:data:`jaxpos.REGISTRY`): a name selects
a scheme class whose ``init_params`` gives the learned parameters and whose
``from_params`` builds the scheme object of one call (:func:`build_scheme`). Options are
held as a sorted tuple of ``(name, value)`` pairs (:func:`collect_options`): static,
hashable module data.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from jaxpos import _checks
from jaxpos.core.engines import engine_names
from jaxpos.schemes.base import REGISTRY, PositionScheme

__all__ = [
    "ABSOLUTE_POSITIONS",
    "NAMED_OPTIONS",
    "attention_dims",
    "attention_positions",
    "build_scheme",
    "buildable",
    "check_attention_options",
    "check_learned_length",
    "check_mask_mod",
    "check_module_dims",
    "check_options_read",
    "check_position_name",
    "GATE_FORMS",
    "QK_NORMS",
    "check_output_gate",
    "check_qk_norm",
    "check_sinks_flag",
    "collect_options",
    "freeze_options",
    "has_params",
    "init_scheme_params",
    "layer_mask_mods_plan",
    "module_scheme",
    "no_rope_scaling",
    "stack_options",
    "stack_positions",
]

#: Absolute position names: vectors added to the token embeddings, not attention schemes.
ABSOLUTE_POSITIONS = ("sinusoidal", "learned")


def buildable(cls: type) -> bool:
    """True when the Flax modules can build scheme class ``cls`` (it implements
    :meth:`jaxpos.PositionScheme.from_params`)."""
    return getattr(cls.from_params, "__func__", None) is not PositionScheme.from_params.__func__


def attention_positions() -> tuple[str, ...]:
    """The names :class:`MultiHeadAttention` accepts now: every registered scheme that
    implements ``from_params``, ``"nope"`` first, then sorted (the registry may grow after
    import: :func:`jaxpos.schemes.base.register`)."""
    names = sorted(n for n, cls in REGISTRY.items() if n != "nope" and buildable(cls))
    return ("nope", *names)


def stack_positions() -> tuple[str, ...]:
    """The names :class:`DecoderLM` / :class:`Encoder` accept now:
    :func:`attention_positions` plus :data:`ABSOLUTE_POSITIONS`."""
    nope, *rest = attention_positions()
    return (nope, *ABSOLUTE_POSITIONS, *rest)


def check_position_name(name: str, value: Any, choices: Iterable[str] | None = None) -> str:
    """Lower-cased position name (``"none"`` means ``"nope"``).

    ``choices`` defaults to :func:`stack_positions` (derived from the registry).

    Raises:
      TypeError: ``value`` is not a string.
      ValueError: an unknown name (the message lists ``choices``), or a registered scheme
        whose class does not implement ``from_params`` (the message names the class).
    """
    if choices is None:
        choices = stack_positions()
    choices = tuple(choices)
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {choices} (a string); got "
                        f"{type(value).__name__} {value!r}.")
    value = value.lower()
    if value == "none":
        value = "nope"
    if value not in choices and value in REGISTRY and not buildable(REGISTRY[value]):
        cls = REGISTRY[value]
        raise ValueError(
            f"{name}={value!r} is a registered scheme ({cls.__module__}.{cls.__name__}) that "
            f"the Flax modules cannot build: {cls.__name__} does not implement "
            f"from_params (and init_params, if it has learned parameters), the hooks of "
            f"jaxpos.PositionScheme that the modules call. Build the scheme yourself and "
            f"pass it at call time (scheme=...), or choose one of {choices}.")
    _checks.check_choice(name, value, choices)
    return value


def check_learned_length(position: str, max_len: int | None, T: int,
                         positions: ArrayLike | None) -> None:
    """With default positions ``arange(T)``, a learned table of ``max_len`` rows cannot
    serve ``T > max_len`` (raised at trace time, inside ``jit`` too)."""
    if position == "learned" and positions is None and max_len is not None and T > max_len:
        raise ValueError(f"tokens have length T={T} but the learned position table has "
                         f"max_len={max_len} rows (positions 0..{max_len - 1}); learned "
                         f"absolute positions cannot run past their table.")


def no_rope_scaling(position: str, rope_scaling: Any) -> None:
    """``ValueError`` when ``rope_scaling`` is given to a model whose scheme ``position``
    (a name, for the message) does not take it."""
    if rope_scaling is not None:
        raise ValueError(f"rope_scaling applies to RoPE models only; this model uses "
                         f"position={position!r}. Got rope_scaling={rope_scaling!r}.")


def collect_options(*, rotary_dim: int | None = None, rope_base: float | None = None,
                    num_buckets: int | None = None, max_distance: int | None = None,
                    scheme_options: Mapping[str, Any] | None = None) -> tuple:
    """A module's scheme options: the named ones (``rotary_dim``, ``rope_base``,
    ``num_buckets``, ``max_distance``; None where unset), then ``scheme_options`` (a dict,
    or any mapping, with string keys, e.g. a new scheme's own options) on top.

    Returns a tuple of ``(name, value)`` pairs sorted by name: static, hashable module
    data; a scheme's ``init_params`` / ``from_params`` receive it as a dict.

    Raises:
      TypeError: ``scheme_options`` is not a dict with string keys; ``rotary_dim``,
        ``num_buckets``, ``max_distance`` not ints, ``rope_base`` not a real number.
      ValueError: those not > 0 (``rope_base`` also finite), when given.
    """
    opts = {"rotary_dim": rotary_dim, "rope_base": rope_base, "num_buckets": num_buckets,
            "max_distance": max_distance}
    if scheme_options is not None:
        if not isinstance(scheme_options, Mapping) or not all(
                isinstance(k, str) for k in scheme_options):
            raise TypeError(f"scheme_options must be a dict with string keys (a scheme's "
                            f"options) or None; got {type(scheme_options).__name__} "
                            f"{scheme_options!r}.")
        opts.update(scheme_options)
    # The named options mean the same for every scheme that reads them: sizes and a base.
    for key in ("rotary_dim", "num_buckets", "max_distance"):
        if opts[key] is not None:
            _checks.check_positive_int(key, opts[key])
    if opts["rope_base"] is not None:
        _checks.check_positive_float("rope_base", opts["rope_base"])
    return tuple(sorted(opts.items(), key=lambda kv: kv[0]))


def freeze_options(options: Mapping[str, Any] | tuple | None) -> tuple:
    """``options`` (a dict, a tuple of pairs from :func:`collect_options`, or None) as a
    sorted tuple of ``(name, value)`` pairs. ``TypeError`` for anything else."""
    if options is None:
        return ()
    if isinstance(options, Mapping):
        return collect_options(scheme_options=options) if options else ()
    if isinstance(options, tuple) and all(
            isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in options):
        return tuple(sorted(options, key=lambda kv: kv[0]))
    raise TypeError(f"options must be a dict of scheme options or None; got "
                    f"{type(options).__name__} {options!r}.")


def stack_options(position: str, *, rope_base: float | None, prefixed: dict,
                  scheme_options: Mapping[str, Any] | None) -> tuple:
    """The scheme options of a stack (:class:`DecoderLM`, :class:`Encoder`).

    ``rope_base`` is passed as is; an argument of ``prefixed`` named
    ``<scheme>_<option>`` (the stacks' ``t5_num_buckets``, ``t5_max_distance``,
    ``shaw_max_distance``) is the option ``<option>`` of the scheme registered as
    ``<scheme>`` and is ignored by every other scheme; ``scheme_options`` go on top
    (:func:`collect_options`, which raises ``TypeError`` for a bad ``scheme_options``).
    """
    collect_options(scheme_options=scheme_options)  # validates it
    extra = {}
    for key, val in prefixed.items():
        scheme, _, option = key.partition("_")
        if scheme == position and val is not None:
            extra[option] = val
    extra.update(scheme_options or {})
    return collect_options(rope_base=rope_base, scheme_options=extra)


#: Options every attention layer passes (its constructor arguments), read or not.
NAMED_OPTIONS = ("rotary_dim", "rope_base", "num_buckets", "max_distance")


def check_options_read(name: str, options: tuple, params: dict, *, num_heads: int | None,
                       head_dim: int | None, d_model: int | None, causal: bool,
                       x: jax.Array | None, dtype: DTypeLike) -> None:
    """Raise ``ValueError`` for a scheme option the scheme never reads (a typo such as
    ``{"rope_lyout": ...}``, or ``{"layout": ...}`` for RoPE's ``rope_layout``): its
    ``init_params`` and ``from_params`` run once with a dict that records each key read.
    The named options of :data:`NAMED_OPTIONS` are exempt (every layer passes them)."""
    read = set()

    class _Recording(dict):
        def get(self, key, default=None):
            read.add(key)
            return super().get(key, default)

        def __getitem__(self, key):
            read.add(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            read.add(key)
            return super().__contains__(key)

    cls = REGISTRY[name]
    given = dict(options)
    if has_params(cls):
        cls.init_params(jax.random.PRNGKey(0), num_heads=num_heads, head_dim=head_dim,
                        d_model=d_model, causal=causal, param_dtype=dtype,
                        options=_Recording(given))
    cls.from_params(params, num_heads=num_heads, head_dim=head_dim, causal=causal,
                    options=_Recording(given), x=x, positions=jnp.zeros((1, 1), jnp.int32))
    unknown = sorted(set(given) - read - set(NAMED_OPTIONS))
    if unknown:
        raise ValueError(f"scheme_options {unknown} are not options of {cls.__name__} "
                         f"(position={name!r}); it reads {sorted(read)}.")


def has_params(cls: type) -> bool:
    """True when scheme class ``cls`` declares learned parameters (overrides
    :meth:`jaxpos.PositionScheme.init_params`)."""
    return getattr(cls.init_params, "__func__", None) is not PositionScheme.init_params.__func__


def init_scheme_params(position: str, key: jax.Array, *, num_heads: int | None,
                       head_dim: int | None, d_model: int | None, causal: bool,
                       options: tuple, param_dtype: DTypeLike) -> dict:
    """``REGISTRY[position].init_params(...)``: the scheme's initial parameters, a dict of
    arrays (``{}`` for none).

    Raises:
      TypeError: the scheme returned something other than a dict of arrays.
    """
    cls = REGISTRY[position]
    params = cls.init_params(key, num_heads=num_heads, head_dim=head_dim, d_model=d_model,
                             causal=causal, param_dtype=param_dtype, options=dict(options))
    if not isinstance(params, dict) or not all(
            isinstance(k, str) and hasattr(v, "shape") for k, v in params.items()):
        raise TypeError(f"{cls.__name__}.init_params must return a dict of arrays keyed by "
                        f"parameter name; got {params!r}.")
    return params


def build_scheme(position: str, params: dict, *, num_heads: int | None, head_dim: int | None,
                 causal: bool, options: tuple, rope_scaling: Any = None,
                 x: jax.Array | None = None,
                 positions: ArrayLike | None = None) -> PositionScheme:
    """The scheme of one call: ``REGISTRY[position].from_params(params, ...)``.

    Args:
      position: a registered name. params: the module's parameter values.
      num_heads, head_dim, causal: the layer's (heads and width may be None for a module
        built without them). options: from :func:`collect_options`.
      rope_scaling: a :mod:`jaxpos.schemes.rope.scaling` dataclass for this call only, passed as
        option ``"rope_scaling"``.
      x: ``[B, T, D]`` the layer's input; positions: int32 ``[B|1, T]`` (for schemes
        computed from the tokens).

    Raises:
      ValueError: ``rope_scaling`` given to a scheme that does not take it (the scheme it
        built has no ``scaling`` holding it, e.g. ALiBi).
    """
    cls = REGISTRY[position]
    opts = dict(options)
    if rope_scaling is not None:
        opts["rope_scaling"] = rope_scaling
    scheme = cls.from_params(dict(params), num_heads=num_heads, head_dim=head_dim,
                             causal=causal, options=opts, x=x, positions=positions)
    if rope_scaling is not None and getattr(scheme, "scaling", None) is not rope_scaling:
        raise ValueError(f"rope_scaling applies to schemes that take a RoPE scaling (RoPE); "
                         f"this layer uses position={position!r} ({cls.__name__}), which does "
                         f"not. Got rope_scaling={rope_scaling!r}.")
    return scheme


def check_attention_options(implementation: str | None, use_bias: Any) -> None:
    """An attention layer's options, checked when it is built (not only at its first call):
    ``implementation`` ``None`` or a registered engine's name
    (:func:`jaxpos.core.engines.engine_names`), ``use_bias`` a bool."""
    if implementation is not None:
        _checks.check_choice("implementation", implementation, engine_names())
    if not isinstance(use_bias, bool):
        raise TypeError(f"use_bias must be a bool; got {type(use_bias).__name__} {use_bias!r}.")


def check_sinks_flag(sinks: Any) -> bool:
    """``sinks`` (a layer option: own a learned sink logit per head) must be a bool.
    ``TypeError`` otherwise (an array of logits belongs to :func:`jaxpos.attention`, not
    to a module, whose logits are its ``sinks`` parameter)."""
    if not isinstance(sinks, (bool, np.bool_)):
        raise TypeError(f"sinks must be a bool (True: the layer learns one sink logit per "
                        f"query head, a parameter 'sinks' [num_heads]); got "
                        f"{type(sinks).__name__} {sinks!r}.")
    return bool(sinks)


#: The forms of the output gate (Qiu et al. 2025, "Gated Attention for Large Language
#: Models", §2.2 and Table 1): one gate per head and feature, or one scalar per head.
GATE_FORMS = ("elementwise", "headwise")


def check_output_gate(output_gate: Any, bias: Any = False) -> str | None:
    """The output gate's form: ``None`` (no gate, ``output_gate=False``),
    ``"elementwise"`` (``True`` or ``"elementwise"``: gate ``[.., N, H]``) or
    ``"headwise"`` (one scalar per head, gate ``[.., N]``).

    Raises:
      TypeError: ``output_gate`` neither a bool nor a string; ``bias`` not a bool.
      ValueError: an unknown form, or ``bias=True`` without a gate.
    """
    if isinstance(output_gate, (bool, np.bool_)):
        form = "elementwise" if output_gate else None
    elif isinstance(output_gate, str):
        _checks.check_choice("output_gate", output_gate, (False, True, *GATE_FORMS))
        form = output_gate
    else:
        raise TypeError(f"output_gate must be a bool or one of {GATE_FORMS} (True: a learned "
                        f"elementwise gate, projection gate_proj [d_model, num_heads * "
                        f"head_dim]; 'headwise': gate_proj [d_model, num_heads]); got "
                        f"{type(output_gate).__name__} {output_gate!r}.")
    if not isinstance(bias, (bool, np.bool_)):
        raise TypeError(f"output_gate_bias must be a bool; got {type(bias).__name__} {bias!r}.")
    if bias and form is None:
        raise ValueError("output_gate_bias=True needs an output gate (output_gate=True, "
                         "'elementwise' or 'headwise'); got output_gate=False.")
    return form


#: What a q/k norm normalises (``qk_norm``): each head's ``head_dim`` features (Qwen3,
#: Gemma 3, Qwen3-Next) or the whole projection ``num_heads * head_dim`` (OLMo 2).
QK_NORMS = ("head", "projection")


def check_qk_norm(qk_norm: Any, offset: Any = False, eps: Any = 1e-6) -> str | None:
    """``qk_norm`` (None, ``"head"`` or ``"projection"``), with ``qk_norm_offset`` a bool
    and ``qk_norm_eps`` a positive float. Returns ``qk_norm``.

    Raises:
      TypeError: ``offset`` not a bool, ``eps`` not a real number.
      ValueError: an unknown ``qk_norm``, ``eps <= 0``, ``offset=True`` without a norm.
    """
    if qk_norm is not None:
        _checks.check_choice("qk_norm", qk_norm, QK_NORMS)
    if not isinstance(offset, (bool, np.bool_)):
        raise TypeError(f"qk_norm_offset must be a bool; got {type(offset).__name__} "
                        f"{offset!r}.")
    _checks.check_positive_float("qk_norm_eps", eps)
    if offset and qk_norm is None:
        raise ValueError("qk_norm_offset=True needs qk_norm ('head' or 'projection'); got "
                         "qk_norm=None.")
    return qk_norm


def check_mask_mod(name: str, mask_mod: Any) -> Callable[..., Any] | None:
    """``mask_mod``: ``None`` or a callable ``(batch, head, q_pos, kv_pos) -> bool``
    (:mod:`jaxpos.mods`, e.g. :class:`jaxpos.SlidingWindowMask`). ``TypeError`` naming
    ``name`` otherwise. Returns it unchanged."""
    if mask_mod is not None and not callable(mask_mod):
        raise TypeError(f"{name} must be a mask_mod, a callable (batch, head, q_pos, kv_pos) "
                        f"-> bool such as jaxpos.SlidingWindowMask(window), or None; got "
                        f"{type(mask_mod).__name__} {mask_mod!r}.")
    return mask_mod


def layer_mask_mods_plan(num_layers: int, mask_mod: Any, layer_mask_mods: Any) -> tuple:
    """The mask_mod of each layer of a stack: ``layer_mask_mods`` (one mask_mod or None
    per layer, e.g. alternating sliding-window and full-attention layers as in Gemma 2/3
    and GPT-OSS, Hugging Face's ``layer_types``) when given, else ``mask_mod`` for every
    layer.

    Returns a tuple of ``num_layers`` entries (callables or None).

    Raises:
      TypeError: ``layer_mask_mods`` not a list or tuple, an entry (or ``mask_mod``)
        neither callable nor None.
      ValueError: ``layer_mask_mods`` of a length other than ``num_layers``, or given
        together with ``mask_mod`` (which would be ambiguous).
    """
    check_mask_mod("mask_mod", mask_mod)
    if layer_mask_mods is None:
        return (mask_mod,) * num_layers
    if not isinstance(layer_mask_mods, (list, tuple)):
        raise TypeError(f"layer_mask_mods must be a list or tuple of num_layers={num_layers} "
                        f"mask_mods (callables or None); got {type(layer_mask_mods).__name__} "
                        f"{layer_mask_mods!r}.")
    if len(layer_mask_mods) != num_layers:
        raise ValueError(f"layer_mask_mods must have one entry per layer (num_layers="
                         f"{num_layers}); got {len(layer_mask_mods)} entries.")
    if mask_mod is not None:
        raise ValueError("pass either mask_mod (every layer) or layer_mask_mods (one per "
                         "layer, None for full attention), not both.")
    for i, mod in enumerate(layer_mask_mods):
        check_mask_mod(f"layer_mask_mods[{i}]", mod)
    return tuple(layer_mask_mods)


def attention_dims(d_model: int, num_heads: int, num_kv_heads: int | None,
                   head_dim: int | None) -> tuple[int, int, int, int]:
    """Validated ``(d_model, num_heads, num_kv_heads, head_dim)``: ``num_kv_heads``
    defaults to ``num_heads`` and must divide it; ``head_dim`` defaults to
    ``d_model // num_heads`` (which must divide). Raises ``ValueError``/``TypeError``."""
    d_model = _checks.check_positive_int("d_model", d_model)
    num_heads = _checks.check_positive_int("num_heads", num_heads)
    num_kv_heads = num_heads if num_kv_heads is None else _checks.check_positive_int(
        "num_kv_heads", num_kv_heads)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads}).")
    if head_dim is None:
        if d_model % num_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads}) "
                             f"when head_dim is not given.")
        head_dim = d_model // num_heads
    head_dim = _checks.check_positive_int("head_dim", head_dim)
    return d_model, num_heads, num_kv_heads, head_dim


def check_module_dims(num_heads: int | None, head_dim: int | None,
                      d_model: int | None) -> None:
    """``num_heads``, ``head_dim``, ``d_model``: positive ints or None (unknown to a
    module built for one scheme, e.g. ALiBi needs no ``head_dim``)."""
    for arg, val in (("num_heads", num_heads), ("head_dim", head_dim), ("d_model", d_model)):
        if val is not None:
            _checks.check_positive_int(arg, val)


def module_scheme(module: Any) -> tuple | None:
    """``(name, options)`` of a position module (``_spec()``), or None for no module or
    one without a spec."""
    spec = getattr(module, "_spec", None)
    if spec is None:
        return None
    name, _, _, _, options = spec()
    return name, options
