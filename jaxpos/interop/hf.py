"""Read the rotary settings of a Hugging Face transformers config into a jaxpos scheme.

``rope_from_hf_config(config)`` turns a config object or its ``config.json`` dict into a
:class:`jaxpos.RoPE`, so converting a checkpoint takes one line::

    position = jaxpos.interop.hf.rope_from_hf_config(json.load(open("config.json")))

It follows HF's own rules (``modeling_rope_utils.py``, ``standardize_rope_params``):

* ``rope_theta`` from ``rope_parameters`` (transformers v5), the top level (v4), or
  GPT-NeoX's ``rotary_emb_base``; 10,000 when absent.
* the scaling dict from ``rope_parameters`` or ``rope_scaling``, type under ``rope_type``
  or the older ``type``; ``"mrope"`` (Qwen2-VL) is default RoPE plus ``mrope_section``;
  ``"su"`` (early Phi-3) is LongRoPE.
* head width: ``head_dim``, else ``hidden_size // num_attention_heads``; DeepSeek-V2/V3
  rotate only ``qk_rope_head_dim`` features of each head. A layer type's own overrides
  come first (transformers >= 5.2's ``per_layer_config``, read as HF's
  ``config.per_layer_config[layer_type]``): Gemma 4's full-attention heads are
  ``global_head_dim`` (512) wide where its sliding ones are ``head_dim`` (256); a Gemma 4
  ``config.json`` with ``global_head_dim`` and no ``per_layer_config`` is read as HF's
  config builder reads it. ``attention_k_eq_v`` (Gemma 4: a full layer's values are its
  unrotated key projection) and ``num_global_key_value_heads`` leave the rotary as is.
* ``rope_type="proportional"`` (Gemma 4's full layers, p-RoPE):
  :class:`~jaxpos.schemes.rope.scaling.ProportionalScaling` over the whole head, its
  ``partial_rotary_factor`` the rotated share; ``"axial"`` (2-D, vision towers) is refused.
* ``rotary_dim = int(head_dim * partial_rotary_factor)`` (also read as GPT-NeoX's
  ``rotary_pct``, default 0.25 for ``model_type="gpt_neox"`` as in HF); GPT-J's explicit
  ``rotary_dim``.
* for YaRN, Llama 3 and LongRoPE a top-level ``original_max_position_embeddings``
  (Phi-3) overrides the one inside the scaling dict; a missing ``factor`` is
  ``max_position_embeddings / original_max_position_embeddings``; dynamic NTK uses
  ``max_position_embeddings`` as its original length.
* layout ``"interleaved"`` for GPT-J / CodeGen and for DeepSeek-V2/V3 with
  ``rope_interleave`` (HF de-interleaves q/k there and then applies ``rotate_half``: a
  permutation of the same rotation, so the attention is identical), ``"half"`` otherwise.
"""

from __future__ import annotations

from typing import Any

from jaxpos.schemes.rope import RoPE
from jaxpos.schemes.rope import scaling as rope_scaling

__all__ = ["LAYER_TYPES", "hf_layer_types", "hf_rope_settings", "rope_from_hf_config",
           "rope_per_layer_from_hf_config", "softmax_scale_from_hf_config"]

# Families whose rotary pairs features (2i, 2i+1): transformers' ``rotate_half`` there is
# ``stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)`` (each family's modeling file).
_INTERLEAVED_MODELS = ("gptj", "codegen", "llama4", "llama4_text", "glm", "glm4", "glm4v",
                       "glm4v_text", "glm_ocr", "glm_ocr_text", "cohere", "cohere2",
                       "cohere2_moe", "ernie4_5", "ernie4_5_moe", "helium", "moonshine",
                       "moonshine_streaming", "moonshine_streaming_encoder", "blt",
                       "blt_local_encoder", "blt_local_decoder", "blt_global_transformer")
# Of those, the families whose config's ``rotary_dim`` is the rotated width (GPT-J style).
_ROTARY_DIM_MODELS = ("gptj", "codegen", "llama4", "llama4_text")
# M-RoPE with the temporal/height/width rows interleaved over the frequencies (HF's
# ``recomposition_frequencies``) whether or not the config says ``mrope_interleaved``.
_INTERLEAVED_MROPE_PREFIXES = ("qwen3_vl", "qwen3_5", "qwen3_omni_moe")
_DEEPSEEK_MODELS = ("deepseek_v2", "deepseek_v3")


def _as_dict(config: Any) -> dict:
    if isinstance(config, dict):
        d = dict(config)
    elif hasattr(config, "to_dict"):
        d = config.to_dict()
        for k in ("rope_parameters", "rope_scaling", "head_dim", "max_position_embeddings",
                  "partial_rotary_factor", "rope_theta", "original_max_position_embeddings"):
            if k not in d and hasattr(config, k):  # properties that to_dict may omit
                d[k] = getattr(config, k)
    else:
        raise TypeError(f"config must be a dict or a transformers PretrainedConfig; got "
                        f"{type(config).__name__}.")
    text = d.get("text_config")
    if isinstance(text, dict) or hasattr(text, "to_dict"):
        text = _as_dict(text)
        merged = {k: v for k, v in d.items() if k != "text_config"}
        merged.update({k: v for k, v in text.items() if v is not None})
        return merged
    return d


_WHOLE_CONFIG_KEYS = ("head_dim", "hidden_size", "num_attention_heads", "n_embd", "n_head",
                      "qk_rope_head_dim", "model_type", "rope_parameters", "rope_scaling",
                      "text_config", "max_position_embeddings")


def _check_whole_config(d: dict) -> None:
    """Refuse a bare ``rope_scaling`` / ``rope_parameters`` dict passed as the config."""
    if ("rope_type" in d or "type" in d) and not any(k in d for k in _WHOLE_CONFIG_KEYS):
        raise ValueError(
            f"config must be the whole model config (config.json or a PretrainedConfig), "
            f"not its rope_scaling / rope_parameters dict alone: the head width (head_dim, "
            f"or hidden_size and num_attention_heads) and max_position_embeddings live at "
            f"its top level; got a dict with keys {sorted(d)}. Pass e.g. "
            f"dict(hidden_size=..., num_attention_heads=..., max_position_embeddings=..., "
            f"rope_scaling=<this dict>).")


def hf_rope_settings(config: Any, *, layer_type: str | None = None) -> dict:
    """The RoPE keyword arguments that :func:`rope_from_hf_config` passes to
    :class:`jaxpos.RoPE` (``rotary_dim``, ``base``, ``layout``, ``scaling``,
    ``mrope_section``, ``mrope_interleaved``), plus ``head_dim``. Same arguments and errors.

    ``mrope_interleaved`` (Qwen3-VL / Qwen3-Omni / Qwen3.5: the M-RoPE rows interleaved over
    the frequencies, :func:`jaxpos.schemes.rope.mrope_frequency_axes`) is read from the rope dict's
    ``mrope_interleaved`` (or ``interleaved``) key; when absent it is True for those model
    types, whose HF rotary always interleaves. False without ``mrope_section``."""
    d = _as_dict(config)
    _check_whole_config(d)
    d.update(_layer_overrides(d, layer_type))
    model_type = d.get("model_type")
    params: dict[str, Any] = _rope_parameters(d, layer_type)
    base = params.get("rope_theta", d.get("rope_theta", d.get("rotary_emb_base")))
    base = 10000.0 if base is None else float(base)
    head_dim = _head_dim(d)
    prf = params.get("partial_rotary_factor", d.get("partial_rotary_factor", d.get("rotary_pct")))
    if prf is None:
        prf = 0.25 if model_type == "gpt_neox" else 1.0
    rotary_dim = int(head_dim * float(prf))
    if model_type in _ROTARY_DIM_MODELS and d.get("rotary_dim"):
        rotary_dim = int(d["rotary_dim"])

    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "axial":
        raise ValueError(
            f"rope_type='axial' (layer_type={layer_type!r}) is the 2-D rotary of image patches "
            f"(Gemma 4's and other vision towers: height and width positions); "
            f"rope_from_hf_config builds the 1-D RoPE of text layers. For 2-D patch positions "
            f"see jaxpos.axial_rope_frequencies and jaxpos.apply_axial_rope.")
    max_pos = d.get("max_position_embeddings", d.get("n_positions"))
    if rope_type in ("llama3", "yarn", "longrope", "su"):
        if d.get("original_max_position_embeddings") is not None:  # HF: the top level wins
            params["original_max_position_embeddings"] = d["original_max_position_embeddings"]
        elif max_pos is not None:
            params.setdefault("original_max_position_embeddings", max_pos)
    if rope_type == "proportional":
        params = dict(params, partial_rotary_factor=float(prf))
        rotary_dim = head_dim
    try:
        scaling = rope_scaling.scaling_from_dict(params, max_position_embeddings=max_pos)
    except ValueError as e:
        if "original_max_position_embeddings" not in str(e) or max_pos is not None:
            raise
        raise ValueError(f"{e} HF reads original_max_position_embeddings from the scaling "
                         f"dict, else from the config's top level; some types fall back on "
                         f"max_position_embeddings, which this config lacks too.") from None

    section = params.get("mrope_section")
    interleaved = params.get("mrope_interleaved", params.get("interleaved"))
    if interleaved is None:
        interleaved = str(model_type or "").startswith(_INTERLEAVED_MROPE_PREFIXES)
    return {"rotary_dim": rotary_dim, "base": base, "layout": _layout(d), "scaling": scaling,
            "mrope_section": tuple(section) if section is not None else None,
            "mrope_interleaved": bool(interleaved) and section is not None,
            "head_dim": head_dim}


# Families whose config builder gives full-attention layers their own head width
# (``global_head_dim``, default 512) through ``per_layer_config`` (Gemma 4 and its kin).
_GLOBAL_HEAD_DIM_MODELS = ("gemma4", "diffusion_gemma", "embedding_gemma2")
# Families whose attention leaves the scores unscaled (``scaling = 1.0``, QK-norm instead).
_UNIT_SCALE_MODELS = ("gemma3n", "gemma4", "diffusion_gemma", "embedding_gemma2")
# The per-layer overrides that change a layer's rotary frequencies.
_ROPE_KEYS = ("head_dim", "hidden_size", "num_attention_heads", "partial_rotary_factor",
              "rope_parameters", "rope_scaling", "rope_theta", "max_position_embeddings",
              "original_max_position_embeddings", "rotary_dim", "qk_rope_head_dim")


def _layer_overrides(d: dict, layer_type: str | None, layer_index: int | None = None) -> dict:
    """The rotary-relevant per-layer overrides of a heterogeneous HF config.

    transformers >= 5.2 stores per-layer differences as ``per_layer_config`` ``{layer index:
    {attribute: value}}`` (Gemma 4: ``{"head_dim": 512}`` on its full-attention layers) and
    reads a layer type's rotary from ``config.per_layer_config[layer_type]``, which exists only
    when every layer of that type has the same overrides. A Gemma 4 ``config.json`` written
    before that holds ``global_head_dim`` instead (512 when absent), which the config builder
    turns into those overrides.
    """
    plc = d.get("per_layer_config")
    model_type = str(d.get("model_type") or "")
    if plc is None:
        if layer_index is not None:
            layer_type = hf_layer_types(d)[layer_index]
        if model_type.startswith(_GLOBAL_HEAD_DIM_MODELS) and layer_type == "full_attention":
            return {"head_dim": int(d.get("global_head_dim") or 512)}
        return {}
    if not isinstance(plc, dict):
        raise TypeError(f"per_layer_config must be a dict {{layer index: {{attribute: value}}}}; "
                        f"got {type(plc).__name__}.")
    per_layer = {}
    for k, v in plc.items():
        try:
            per_layer[int(k)] = {a: x for a, x in dict(v or {}).items() if a in _ROPE_KEYS}
        except (TypeError, ValueError):
            raise ValueError(f"per_layer_config keys must be layer indices; got {k!r}.") from None
    if layer_index is not None:
        return per_layer.get(layer_index, {})
    if not any(per_layer.values()):
        return {}
    if layer_type is None:
        n = d.get("num_hidden_layers")
        layers = range(int(n)) if n is not None else sorted(per_layer)
        what = "all layers"
        if not layers:
            return {}
    else:
        types = hf_layer_types(d)
        layers = [i for i, t in enumerate(types) if t == layer_type]
        if not layers:
            raise ValueError(f"layer_type={layer_type!r} names no layer of this config; its "
                             f"layer_types hold {sorted(set(types))}.")
        what = f"the {layer_type!r} layers"
    first = per_layer.get(layers[0], {})
    for i in layers:
        if per_layer.get(i, {}) != first:
            raise ValueError(
                f"per_layer_config gives {what} different rotary settings (layer {layers[0]}: "
                f"{first}, layer {i}: {per_layer.get(i, {})})"
                + ("; pass layer_type=" if layer_type is None else "")
                + "; read each layer with rope_per_layer_from_hf_config.")
    return first


def _rope_parameters(d: dict, layer_type: str | None) -> dict[str, Any]:
    """The rope dict of a config (v5 ``rope_parameters`` or v4 ``rope_scaling``), for
    ``layer_type`` when it is given per layer type (Gemma 3); JSON nulls dropped."""
    params: Any = d.get("rope_parameters")  # a dict of rope keys (values of any JSON type)
    if params is None or params == {}:
        params = d.get("rope_scaling")
    params = dict(params or {})
    if params and all(isinstance(v, dict) for v in params.values()):  # per layer type (Gemma 3)
        if layer_type not in params:
            raise ValueError(f"this config has rope parameters per layer type {sorted(params)}; "
                             f"pass layer_type=one of them; got {layer_type!r}.")
        params = dict(params[layer_type])
    return {k: v for k, v in params.items() if v is not None}  # a JSON null means absent


def _head_dim(d: dict) -> int:
    """The width of one attention head (the rope part for MLA, ``qk_rope_head_dim``)."""
    if d.get("qk_rope_head_dim") is not None:
        return int(d["qk_rope_head_dim"])
    if d.get("head_dim") is not None:
        return int(d["head_dim"])
    if d.get("hidden_size") is not None and d.get("num_attention_heads"):
        return int(d["hidden_size"]) // int(d["num_attention_heads"])
    if d.get("n_embd") is not None and d.get("n_head"):  # GPT-J style names
        return int(d["n_embd"]) // int(d["n_head"])
    raise ValueError("config needs head_dim, or hidden_size and num_attention_heads, to "
                     f"know the head width; got keys {sorted(d)}.")


def _layout(d: dict) -> str:
    """``"interleaved"`` for the families whose rotary pairs features ``(2i, 2i + 1)``
    (and DeepSeek's MLA unless ``rope_interleave`` is False), else ``"half"``."""
    model_type = d.get("model_type")
    if model_type in _INTERLEAVED_MODELS:
        return "interleaved"
    if model_type in _DEEPSEEK_MODELS or d.get("qk_rope_head_dim") is not None:
        return "interleaved" if d.get("rope_interleave", True) else "half"
    return "half"


def rope_from_hf_config(config: Any, *, layer_type: str | None = None,
                        angle_precision: str = "high") -> RoPE:
    """The :class:`jaxpos.RoPE` scheme of a Hugging Face model config.

    Args:
      config: a ``transformers.PretrainedConfig`` or its ``config.json`` as a dict
        (transformers v4 ``rope_theta`` + ``rope_scaling``, or v5 ``rope_parameters``;
        a ``text_config`` sub-config is read too, as for Qwen2-VL).
      layer_type: for configs with rope parameters or head widths per layer type (Gemma 3
        and Gemma 4's ``"full_attention"`` / ``"sliding_attention"``).
      angle_precision: ``"high"`` (default) or ``"float32"`` for HF's exact numbers.

    Returns:
      ``RoPE(rotary_dim=..., base=..., layout=..., scaling=..., mrope_section=...)``; its
      ``inv_freq`` and ``attention_factor`` equal HF's ``rotary_emb.inv_freq`` and
      ``attention_scaling`` (to one float32 ulp: see :mod:`jaxpos.schemes.rope.scaling`).
      DeepSeek-V2/V3 additionally scale their softmax by ``mscale**2``: get that scale from
      :func:`softmax_scale_from_hf_config` and pass it as ``scale=`` to
      :func:`jaxpos.attention`.

    Raises:
      TypeError: ``config`` neither a dict nor a config object.
      ValueError: no way to know the head width; unknown ``rope_type`` or ``"axial"``; a
        scaling dict missing its keys; per-layer parameters without ``layer_type``; a
        ``layer_type`` whose layers differ in ``per_layer_config`` (use
        :func:`rope_per_layer_from_hf_config`) or that names no layer.
    """
    s = hf_rope_settings(config, layer_type=layer_type)
    s.pop("head_dim")
    return RoPE(angle_precision=angle_precision, **s)


def softmax_scale_from_hf_config(config: Any, *, layer_type: str | None = None) -> float:
    """The softmax scale HF uses: ``head_dim ** -0.5`` of the layer's heads, or

    * for DeepSeek-V2/V3 (MLA) ``qk_head_dim ** -0.5 * mscale**2`` with
      ``mscale = 0.1 * mscale_all_dim * ln(factor) + 1`` when the rope scaling is not
      ``"default"`` and has ``mscale_all_dim`` (HF's ``yarn_apply_mscale``;
      :func:`jaxpos.schemes.mla.mla_softmax_scale`);
    * ``query_pre_attn_scalar ** -0.5`` when the config has it (Gemma 2 / Gemma 3);
    * 1 for Gemma 3n and Gemma 4 (their QK-norm replaces the scale: HF's attention sets
      ``scaling = 1.0`` on every layer).

    Args:
      config: as for :func:`rope_from_hf_config`.
      layer_type: for configs whose head width differs per layer type (Gemma 4's
        ``global_head_dim``); only read by the ``head_dim ** -0.5`` rule.

    Raises:
      The errors of :func:`hf_rope_settings`.
    """
    d = _as_dict(config)
    if d.get("qk_rope_head_dim") is not None:
        from jaxpos.schemes.mla import mla_softmax_scale

        return mla_softmax_scale(int(d.get("qk_nope_head_dim", 0)), int(d["qk_rope_head_dim"]),
                                 rope_parameters=d.get("rope_parameters") or d.get("rope_scaling"))
    if str(d.get("model_type") or "").startswith(_UNIT_SCALE_MODELS):
        return 1.0
    if d.get("query_pre_attn_scalar") is not None:
        return float(d["query_pre_attn_scalar"]) ** -0.5
    _check_whole_config(d)
    return float(_head_dim({**d, **_layer_overrides(d, layer_type)}) ** -0.5)


# ------------------------------------------------------------------- per-layer patterns
#: Attention layer types jaxpos reads from an HF config's ``layer_types``: every key sees
#: all earlier keys; only keys with ``q_pos - kv_pos < sliding_window`` (Gemma 2/3,
#: GPT-OSS, Qwen); only keys of the same ``attention_chunk_size`` chunk (Llama 4).
LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def hf_layer_types(config: Any) -> list[str]:
    """The attention type of each decoder layer of a Hugging Face config.

    ``config.layer_types`` when present (transformers v5 fills it in every config that
    mixes layer kinds); otherwise derived as HF's ``__post_init__`` does for the families
    whose ``config.json`` may lack it: Gemma 2/3 (``sliding_window_pattern``, default 2
    for Gemma 2 and 6 for Gemma 3: layer ``i`` slides unless ``(i + 1) % pattern == 0``),
    Llama 4 (chunked on its RoPE layers when ``attention_chunk_size`` is set, see
    :func:`jaxpos.schemes.irope.no_rope_layers`), Qwen2/Qwen3 (``use_sliding_window``: layers from
    ``max_window_layers`` on slide); all ``"full_attention"`` otherwise.

    Args:
      config: a ``transformers.PretrainedConfig`` or its ``config.json`` dict (a
        ``text_config`` is read, as by :func:`rope_from_hf_config`).

    Returns:
      A list of ``num_hidden_layers`` strings from :data:`LAYER_TYPES`.

    Raises:
      ValueError: an entry of ``layer_types`` not in :data:`LAYER_TYPES` (named with its
        index), a ``layer_types`` whose length is not ``num_hidden_layers``, or neither
        ``layer_types`` nor ``num_hidden_layers``.
      TypeError: ``config`` neither a dict nor a config object.
    """
    d = _as_dict(config)
    n = d.get("num_hidden_layers")
    types = d.get("layer_types")
    model_type = str(d.get("model_type") or "")
    if types is None:
        if n is None:
            raise ValueError(f"config needs layer_types or num_hidden_layers to know its layers; "
                             f"got keys {sorted(d)}.")
        n = int(n)
        pattern = d.get("sliding_window_pattern")
        if pattern is None and model_type.startswith("gemma3"):
            pattern = 6
        elif pattern is None and model_type.startswith("gemma2"):
            pattern = 2
        if pattern is not None:
            types = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention"
                     for i in range(n)]
        elif model_type.startswith("llama4"):
            chunk = d.get("attention_chunk_size")
            types = ["chunked_attention" if r and chunk is not None else "full_attention"
                     for r in _rope_layer_flags(d, n) or [1] * n]
        elif d.get("use_sliding_window") and d.get("sliding_window") is not None:
            first = int(d.get("max_window_layers", n))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
        else:
            types = ["full_attention"] * n
    types = list(types)
    if n is not None and len(types) != int(n):
        raise ValueError(f"layer_types has {len(types)} entries but num_hidden_layers is {n}.")
    for i, t in enumerate(types):
        if t not in LAYER_TYPES:
            raise ValueError(f"layer_types[{i}] = {t!r} is not an attention layer type jaxpos "
                             f"reads; expected one of {LAYER_TYPES}.")
    return types


# Families whose config defaults ``no_rope_layers`` from ``no_rope_layer_interval`` (HF's
# config ``__post_init__``: every ``interval``-th layer has no position), and of those the
# ones whose no-position layers scale their queries (Llama 4's attention temperature tuning).
_NO_ROPE_LAYER_MODELS = ("llama4", "smollm3")
_TEMPERATURE_TUNED_MODELS = ("llama4",)


def _rope_layer_flags(d: dict, n: int) -> list[int] | None:
    """``no_rope_layers`` (1 = RoPE layer; Llama 4, SmolLM3), defaulted as HF does; None
    for families without it."""
    flags = d.get("no_rope_layers")
    if not flags:
        if not str(d.get("model_type") or "").startswith(_NO_ROPE_LAYER_MODELS):
            return None
        from jaxpos.schemes.irope import no_rope_layers

        flags = no_rope_layers(n, int(d.get("no_rope_layer_interval", 4)))
    flags = [int(f) for f in flags]
    if len(flags) != n or any(f not in (0, 1) for f in flags):
        raise ValueError(f"no_rope_layers must hold num_hidden_layers = {n} entries in {{0, 1}} "
                         f"(1 = the layer uses RoPE); got {flags}.")
    return flags


def rope_per_layer_from_hf_config(config: Any, *, angle_precision: str = "high") -> list:
    """The position scheme of every decoder layer of a Hugging Face config.

    * Per-layer-type rope parameters (Gemma 3: ``rope_parameters = {"sliding_attention":
      {...base 1e4}, "full_attention": {...base 1e6, linear factor 8}}``; the
      transformers-v4 form ``rope_theta`` + ``rope_scaling`` for global layers and
      ``rope_local_base_freq`` for sliding ones is read too): layer ``i`` gets
      ``rope_from_hf_config(config, layer_type=layer_types[i])``.
    * Layers without position (``no_rope_layers``, flag 0; defaulted from
      ``no_rope_layer_interval`` for Llama 4 and SmolLM3, as HF does): Llama 4's iRoPE
      (Meta AI 2025, "The Llama 4 herd") gets
      :class:`jaxpos.schemes.irope.TemperatureTunedNoPE` (``attn_scale``, ``floor_scale``)
      when ``attn_temperature_tuning`` is on (HF's default); every other family (SmolLM3)
      gets :class:`jaxpos.NoPE`: attention-temperature tuning is Llama 4's alone.
    * Otherwise the same :func:`rope_from_hf_config` scheme on every layer.

    Each layer's own ``per_layer_config`` overrides (Gemma 4's ``head_dim`` 512 on full
    layers) are applied to it, so its RoPE spans its own head width.

    Args:
      config: a ``transformers.PretrainedConfig`` or its ``config.json`` dict.
      angle_precision: as for :func:`rope_from_hf_config`.

    Returns:
      A list of ``num_hidden_layers`` schemes (``RoPE`` / ``NoPE`` /
      ``TemperatureTunedNoPE``), one per layer, in order.

    Raises:
      ValueError: an unknown layer type (:func:`hf_layer_types`), an unknown
        ``rope_type``, a layer type without rope parameters, a bad ``no_rope_layers``.
      TypeError: ``config`` neither a dict nor a config object.
    """
    from jaxpos.schemes.base import NoPE
    from jaxpos.schemes.irope import TemperatureTunedNoPE

    d = _as_dict(config)
    types = hf_layer_types(d)
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    per_type = bool(params) and all(isinstance(v, dict) for v in params.values())
    if not per_type and d.get("rope_local_base_freq") is not None:  # Gemma 3, transformers v4
        full = {k: v for k, v in dict(params).items() if v is not None}
        full.setdefault("rope_type", full.pop("type", "default"))
        full.setdefault("rope_theta", d.get("rope_theta", 1_000_000.0))
        sliding = {"rope_type": "default", "rope_theta": d["rope_local_base_freq"]}
        d: dict[str, Any] = dict(d, rope_scaling=None,
                                 rope_parameters={"full_attention": full,
                                                  "sliding_attention": sliding})
        per_type = True
    flags = _rope_layer_flags(d, len(types))
    tuned = (str(d.get("model_type") or "").startswith(_TEMPERATURE_TUNED_MODELS)
             and d.get("attn_temperature_tuning", True))
    cache: dict = {}
    schemes = []
    for i, t in enumerate(types):
        if flags is not None and not flags[i]:
            if tuned:
                schemes.append(TemperatureTunedNoPE(attn_scale=d.get("attn_scale", 0.1),
                                                    floor_scale=d.get("floor_scale", 8192)))
            else:
                schemes.append(NoPE())
            continue
        lt = t if per_type else None
        own = _layer_overrides(d, lt, i)  # this layer's own head width etc. (Gemma 4)
        key = (lt, repr(sorted(own.items())))
        if key not in cache:
            d_i = dict(d, **own, per_layer_config={})
            cache[key] = rope_from_hf_config(d_i, layer_type=lt, angle_precision=angle_precision)
        schemes.append(cache[key])
    return schemes
