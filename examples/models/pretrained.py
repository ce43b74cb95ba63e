"""Load a Hugging Face checkpoint folder from disk into the matching example port, without
PyTorch: :func:`from_pretrained`.

A checkpoint folder (what ``transformers``' ``save_pretrained(..., safe_serialization=True)``
writes, or a snapshot of a Hub repository) holds ``config.json`` and the weights in
safetensors files: one ``model.safetensors``, or shards listed by
``model.safetensors.index.json`` (its ``weight_map`` names the shard of every tensor). The
weights are read with the ``safetensors`` package's NumPy backend; ``bfloat16`` tensors
(which NumPy cannot name) are read from the file's bytes and widened to float32 exactly.
``config.json``'s ``model_type`` picks the port (:data:`PORTS`), whose ``from_hf`` converter
checks every key and shape.

Example::

    from examples.models import from_pretrained
    from jaxpos.serving import ModuleDecoder, Request, ServingEngine

    model = from_pretrained("path/to/checkpoint")           # e.g. a Llama, Qwen3, Gemma 3
    engine = ServingEngine(ModuleDecoder(model), num_slots=4, num_pages=64, page_size=16,
                           max_len=256)
    outputs = engine.run([Request(prompt_ids, max_new_tokens=16)])
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["PORTS", "CheckpointConfig", "from_pretrained", "load_config", "load_safetensors"]

#: ``model_type`` of ``config.json`` -> the port module of ``examples.models`` that loads it.
#: The decoder-only ports decode through the library's caches (``init_cache``), so
#: :class:`jaxpos.serving.ModuleDecoder` serves them.
PORTS = {
    "llama": "llama",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "gpt_oss": "gpt_oss",
    "llama4_text": "llama4",
    "deepseek_v3": "deepseek_v3",
    "gemma4_text": "gemma4",
    "bloom": "bloom",
    "gpt2": "gpt2",
    "t5": "t5",
}

#: Multimodal wrappers whose text model has a port of its own: which ``model_type`` to
#: save the text model as.
_MULTIMODAL = {"gemma3": "gemma3_text", "llama4": "llama4_text", "gemma4": "gemma4_text"}

# transformers' defaults for config fields a port reads directly and that older
# config.json files may leave out (the values of the config classes' __init__).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(hidden_act="silu", rms_norm_eps=1e-6, attention_bias=False, mlp_bias=False,
                  tie_word_embeddings=False, num_key_value_heads=None, rope_theta=10000.0,
                  max_position_embeddings=2048),
    "gpt_oss": dict(hidden_act="silu", rms_norm_eps=1e-5, attention_bias=True,
                    tie_word_embeddings=False, layer_types=None, sliding_window=128,
                    swiglu_alpha=1.702, swiglu_limit=7.0, num_key_value_heads=None),
    "gpt2": dict(n_inner=None, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                 scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
                 n_positions=1024),
    "bloom": dict(layer_norm_epsilon=1e-5, apply_residual_connection_post_layernorm=False),
    "t5": dict(num_decoder_layers=None, relative_attention_num_buckets=32,
               relative_attention_max_distance=128, layer_norm_epsilon=1e-6,
               tie_word_embeddings=True),
}


class CheckpointConfig(Mapping):
    """``config.json`` as the ports' ``Config.from_hf`` read a ``transformers`` config:
    keys as attributes (with transformers' defaults for the fields older files omit) and
    :meth:`to_dict`. A field neither in the file nor defaulted is an ``AttributeError``
    naming the field and the file, so ``getattr(config, name, default)`` works.

    Args:
      values: the parsed ``config.json``; source: its path (for messages).
    """

    def __init__(self, values: Mapping[str, Any], source: str = "config.json"):
        d = dict(_DEFAULTS.get(values.get("model_type", ""), {}))
        d.update(values)
        if d.get("model_type") == "t5":  # T5Config derives these from feed_forward_proj
            proj = str(d.get("feed_forward_proj", "relu"))
            gated = proj.startswith("gated-")
            act = proj.split("-")[-1]
            d.setdefault("is_gated_act", gated)
            d.setdefault("dense_act_fn", "gelu_new" if act == "gelu" and gated else act)
        object.__setattr__(self, "_values", d)
        object.__setattr__(self, "_source", source)

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        raise AttributeError(f"{object.__getattribute__(self, '_source')} has no field "
                             f"{name!r} (model_type {values.get('model_type')!r}).")

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def to_dict(self) -> dict:
        """The fields as a plain dict (defaults included)."""
        return dict(self._values)


def load_config(path: str | os.PathLike) -> CheckpointConfig:
    """``config.json`` of a checkpoint folder as a :class:`CheckpointConfig`.

    Raises:
      ValueError: ``path`` is not a folder, it has no ``config.json``, the file is not a
        JSON object, or it names no ``model_type``.
    """
    folder = os.fspath(path)
    if not os.path.isdir(folder):
        raise ValueError(f"path must be a checkpoint folder (config.json and *.safetensors); "
                         f"{folder!r} is not a directory.")
    file = os.path.join(folder, "config.json")
    if not os.path.isfile(file):
        raise ValueError(f"checkpoint folder {folder!r} has no config.json (the model's "
                         f"transformers config, written by save_pretrained).")
    with open(file, encoding="utf-8") as f:
        try:
            values = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file} is not valid JSON: {e}.") from None
    if not isinstance(values, dict) or not isinstance(values.get("model_type"), str):
        raise ValueError(f"{file} must be a JSON object with a 'model_type' string (e.g. "
                         f"'llama'); got {type(values).__name__}"
                         f"{'' if not isinstance(values, dict) else ' without model_type'}.")
    return CheckpointConfig(values, file)


def _weight_files(folder: str) -> list[str]:
    """The safetensors files of a checkpoint: the shards of the index, or the one file."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} must hold a non-empty 'weight_map' (tensor name -> "
                             f"shard file).")
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(folder, s))]
        if missing:
            raise ValueError(f"{index} names shard(s) {missing} that are not in {folder!r}.")
        return [os.path.join(folder, s) for s in shards]
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    found = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if found:
        return [os.path.join(folder, n) for n in found]
    other = sorted(n for n in os.listdir(folder) if n.endswith((".bin", ".pt", ".pth")))
    hint = (f" (it holds PyTorch pickles {other}: re-save with save_pretrained(..., "
            f"safe_serialization=True))" if other else "")
    raise ValueError(f"checkpoint folder {folder!r} has no model.safetensors, no "
                     f"model.safetensors.index.json and no *.safetensors file{hint}.")


def _read_bf16(file: str, name: str) -> np.ndarray:
    """A ``BF16`` tensor of a safetensors file as float32 (exact: bfloat16 is the top half
    of a float32), from the byte range its header names."""
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        entry = json.loads(f.read(n))[name]
        start, end = entry["data_offsets"]
        f.seek(8 + n + start)
        raw = np.frombuffer(f.read(end - start), dtype="<u2")
    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(entry["shape"])


def load_safetensors(files: list[str]) -> dict[str, np.ndarray]:
    """Every tensor of ``files`` as NumPy arrays (``bfloat16`` widened to float32).

    Raises:
      ValueError: a tensor name in two files; a file safetensors cannot read (truncated,
        not a safetensors file), named.
    """
    from safetensors import SafetensorError, safe_open

    tensors: dict[str, np.ndarray] = {}
    for file in files:
        try:
            with safe_open(file, framework="np") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    if name in tensors:
                        raise ValueError(f"tensor {name!r} is in more than one safetensors "
                                         f"file (again in {file}).")
                    if f.get_slice(name).get_dtype() == "BF16":
                        tensors[name] = _read_bf16(file, name)
                    else:
                        tensors[name] = f.get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"cannot read {file} as a safetensors file (truncated or not "
                             f"written by save_pretrained/safetensors?): {e}") from e
    return tensors


def from_pretrained(path: str | os.PathLike, **options: Any):
    """The example port of a Hugging Face checkpoint folder, with its weights loaded.

    Reads ``config.json`` (:func:`load_config`) and the safetensors weights (one file or
    the shards of ``model.safetensors.index.json``; :func:`load_safetensors`), then calls
    the ``from_hf`` converter of the port that :data:`PORTS` names for ``model_type``,
    which checks every key and shape. No PyTorch is needed. The decoder-only ports
    (Llama, Qwen3, Gemma 3, GPT-OSS, ...) decode with the library's caches, so
    ``jaxpos.serving.ModuleDecoder(model)`` serves what this returns; T5 is a full-pass
    encoder-decoder example.

    Args:
      path: the checkpoint folder.
      **options: passed to the converter (``dtype``, and ``angle_precision`` for the RoPE
        ports).

    Returns:
      The port's model (an ``nnx.Module``), e.g.
      :class:`examples.models.llama.LlamaForCausalLM`.

    Raises:
      ValueError: a missing folder, ``config.json`` or weights file; a ``model_type`` no
        port loads (naming the ones that do); the converter's errors (a missing or
        unexpected tensor, a shape mismatch, an unsupported config).
    """
    config = load_config(path)
    model_type = config.model_type
    if model_type in _MULTIMODAL:
        raise ValueError(f"model_type {model_type!r} is a multimodal checkpoint; the example "
                         f"ports hold its text model only (model_type "
                         f"{_MULTIMODAL[model_type]!r}): save the text model on its own.")
    if model_type not in PORTS:
        raise ValueError(f"model_type {model_type!r} (in {os.fspath(path)}/config.json) has "
                         f"no example port; from_pretrained loads {sorted(PORTS)}.")
    state = load_safetensors(_weight_files(os.fspath(path)))
    port = importlib.import_module(f"examples.models.{PORTS[model_type]}")
    return port.from_hf(state, config, **options)
