"""Pieces shared by the example models: checked token lookup, padding -> positions and
segment ids, the KV cache, and loading a Hugging Face PyTorch state dict into an NNX
module with every key and shape checked.

Padding is expressed the jaxpos way, as position and segment arrays (docs/modules.md,
"Using jaxpos in your Flax model"; ``jaxpos.attention``'s docstring): a real token has
segment id 1 and a padding token (or an unwritten cache slot) segment id 0 on the key side,
while every query has segment id 1, so a query sees exactly the real keys, as Hugging
Face's key-padding masks do. Positions of real tokens are ``cumsum(attention_mask) - 1``
(what ``generate`` passes for left padding).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxpos
from jaxpos import _checks
from jaxpos.mods import ChunkedAttentionMask, SlidingWindowMask

__all__ = [
    "ChunkedAttentionMask",
    "KVCache",
    "SlidingWindowMask",
    "embed_tokens",
    "key_segments",
    "linear_kernel",
    "load_params",
    "mask_kwargs",
    "padding_positions",
    "query_segments",
    "to_numpy",
]


# ------------------------------------------------------------------------------ inputs
def check_token_ids(name: str, ids, vocab_size: int) -> jax.Array:
    """Validate integer token ids ``[B, T]``; concrete ids outside ``[0, vocab_size)`` raise.

    Raises:
      ValueError: not rank 2, or (when not traced) an id outside the vocabulary.
      TypeError: non-integer ids.
    """
    _checks.check_integer_positions(name, ids)
    _checks.check_rank(name, ids, (2,), "[batch, seq]")
    if _checks.is_concrete(ids):
        a = np.asarray(ids)
        bad = (a < 0) | (a >= vocab_size)
        if bad.any():
            raise ValueError(f"{name} must lie in [0, {vocab_size}) (the vocabulary); got values "
                             f"from {a.min()} to {a.max()} ({int(bad.sum())} outside).")
    return jnp.asarray(ids, jnp.int32)


def embed_tokens(table, ids) -> jax.Array:
    """Rows of ``table`` ``[vocab, d]`` for ``ids`` ``[B, T]`` -> ``[B, T, d]``.

    ``jnp.take`` would clamp or fill silently; here concrete out-of-range ids raise
    (:func:`check_token_ids`) and traced ones give NaN rows, so the error is loud.
    """
    ids = check_token_ids("input_ids", ids, table.shape[0])
    valid = (ids >= 0) & (ids < table.shape[0])
    rows = table[jnp.clip(ids, 0, table.shape[0] - 1)]
    return jnp.where(valid[..., None], rows, jnp.array(jnp.nan, rows.dtype))


def check_attention_mask(attention_mask, batch: int, seq: int):
    """``attention_mask`` ``[B, T]`` of 0/1 (or bool) -> int32, or ``None``."""
    if attention_mask is None:
        return None
    shp = _checks.shape_of(attention_mask)
    if shp != (batch, seq):
        raise ValueError(f"attention_mask must have shape [B, T] = [{batch}, {seq}] (1 = real "
                         f"token, 0 = padding); got {shp}.")
    return jnp.asarray(attention_mask).astype(jnp.int32)


def padding_positions(attention_mask, start=None) -> jax.Array:
    """Positions of real tokens from a 0/1 mask ``[B, T]``: ``start + cumsum(mask) - 1``,
    0 for padding (padding keys are hidden by segment ids, so their position is unused).

    ``start`` (int32 ``[B]``) is the number of real tokens already in a KV cache.
    """
    m = jnp.asarray(attention_mask, jnp.int32)
    pos = jnp.cumsum(m, axis=-1) - 1
    if start is not None:
        pos = pos + start[:, None]
    return jnp.where(m > 0, pos, 0).astype(jnp.int32)


def query_segments(batch: int, seq: int) -> jax.Array:
    """Every query is in segment 1 (it sees all real keys, as HF's key-padding mask)."""
    return jnp.ones((batch, seq), jnp.int32)


def key_segments(attention_mask, batch: int, seq: int) -> jax.Array:
    """Segment 1 for real keys, 0 for padding (hidden from every query)."""
    if attention_mask is None:
        return jnp.ones((batch, seq), jnp.int32)
    return (jnp.asarray(attention_mask) > 0).astype(jnp.int32)


# ------------------------------------------------------------------------------ masks
def mask_kwargs(mask_mod, *, q_positions, kv_positions, implementation=None, block_q=None,
                block_k=None) -> dict:
    """Keyword arguments of :func:`jaxpos.attention` for one layer's ``mask_mod``: ``{}`` for
    None; a :class:`jaxpos.BlockMask` of it (empty tiles skipped) when a tiled
    implementation (``"chunked"``, ``"pallas"``) runs with both block sizes given; else
    ``{"mask_mod": mask_mod}`` with the block sizes passed through.
    """
    blocks = {"block_q": block_q, "block_k": block_k}
    if mask_mod is None:
        return blocks
    if implementation in ("chunked", "pallas") and block_q and block_k:
        bm = jaxpos.create_block_mask(mask_mod, q_positions=q_positions,
                                      kv_positions=kv_positions, block_q=block_q,
                                      block_k=block_k)
        return {"block_mask": bm}
    return {"mask_mod": mask_mod, **blocks}


# ------------------------------------------------------------------------------ cache
class KVCache(NamedTuple):
    """A fixed-size KV cache for incremental decoding (a pytree: jit/scan friendly).

    Keys are stored **unrotated**: the position scheme (RoPE here) is applied inside
    :func:`jaxpos.attention` from ``positions``, so a cached key never has to be
    re-rotated and any scheme works unchanged.

    Fields:
      k, v: ``[num_layers, B, max_len, kv_heads, head_dim]``.
      positions: int32 ``[B, max_len]``, the position of each written slot.
      segments: int32 ``[B, max_len]``, 1 for a real token, 0 for padding or unwritten.
      index: int32 scalar, the next slot to write.
      next_position: int32 ``[B]``, the number of real tokens so far (next position).
    """

    k: jax.Array
    v: jax.Array
    positions: jax.Array
    segments: jax.Array
    index: jax.Array
    next_position: jax.Array

    @classmethod
    def init(cls, num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
             dtype=jnp.float32) -> KVCache:
        """An empty cache of ``max_len`` slots."""
        for name, val in (("num_layers", num_layers), ("batch", batch), ("max_len", max_len),
                          ("kv_heads", kv_heads), ("head_dim", head_dim)):
            _checks.check_positive_int(name, val)
        shape = (num_layers, batch, max_len, kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                   jnp.zeros((batch, max_len), jnp.int32), jnp.zeros((batch, max_len), jnp.int32),
                   jnp.zeros((), jnp.int32), jnp.zeros((batch,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def write(self, layer: int, k, v):
        """Keys and values of ``layer`` with ``k``, ``v`` ``[B, T, kv_heads, head_dim]``
        written at ``index``: returns the full ``[B, max_len, kv_heads, head_dim]`` pair."""
        start = (0, self.index, 0, 0)
        kl = jax.lax.dynamic_update_slice(self.k[layer], k.astype(self.k.dtype), start)
        vl = jax.lax.dynamic_update_slice(self.v[layer], v.astype(self.v.dtype), start)
        return kl, vl

    def advance(self, new_k, new_v, positions, segments, attention_mask):
        """The cache after writing ``T`` tokens: ``new_k``/``new_v`` are per-layer lists of
        full ``[B, max_len, ...]`` arrays from :meth:`write`."""
        T = positions.shape[1]
        pos = jax.lax.dynamic_update_slice(self.positions, positions, (0, self.index))
        seg = jax.lax.dynamic_update_slice(self.segments, segments, (0, self.index))
        return KVCache(jnp.stack(new_k), jnp.stack(new_v), pos, seg, self.index + T,
                       self.next_position + jnp.sum(attention_mask, axis=-1).astype(jnp.int32))


def check_head_groups(config) -> None:
    """``ValueError`` unless ``config.num_attention_heads`` is a multiple of
    ``config.num_key_value_heads`` (grouped-query attention, Ainslie et al. 2023)."""
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(f"num_attention_heads ({config.num_attention_heads}) must be a multiple "
                         f"of num_key_value_heads ({config.num_key_value_heads}).")


def check_cache_room(cache: KVCache, T: int) -> None:
    """Raise ``ValueError`` when ``T`` more tokens do not fit (concrete index only)."""
    if _checks.is_concrete(cache.index) and int(cache.index) + T > cache.max_len:
        raise ValueError(f"the KV cache holds {cache.max_len} slots and {int(cache.index)} are "
                         f"used; cannot write {T} more tokens. Create a larger cache.")


# ------------------------------------------------------------------------ conversion
def to_numpy(t) -> np.ndarray:
    """A torch tensor (or array) as a float32/int NumPy array, detached, on the CPU."""
    if hasattr(t, "detach"):
        t = t.detach().cpu()
        if str(t.dtype) in ("torch.bfloat16", "torch.float16"):
            t = t.float()
        t = t.numpy()
    return np.asarray(t)


def linear_kernel(w) -> np.ndarray:
    """``torch.nn.Linear`` weight ``[out, in]`` -> Flax ``kernel`` ``[in, out]``."""
    return to_numpy(w).T


def load_params(model: nnx.Module, state_dict: Mapping[str, Any],
                mapping: Mapping[tuple, tuple[str, Callable[[Any], np.ndarray]]],
                *, ignore: Callable[[str], bool] = lambda key: False) -> nnx.Module:
    """Write HF tensors into ``model``'s parameters, checking everything.

    Args:
      model: the NNX module (its parameter values are replaced in place).
      state_dict: Hugging Face ``model.state_dict()`` (torch tensors or arrays).
      mapping: ``{nnx parameter path: (HF key, transform)}``; ``transform`` turns the
        tensor into the parameter's layout (e.g. :func:`linear_kernel`).
      ignore: HF keys that are allowed to stay unused (tied heads, rotary buffers).

    Raises:
      ValueError: a parameter of ``model`` without a mapping, a missing HF key, a shape
        mismatch (naming the key, the shape got and the shape expected), or an HF key
        left unused that ``ignore`` does not accept.
    """
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    missing = [p for p in params if p not in mapping]
    if missing:
        raise ValueError(f"no Hugging Face source for parameters {missing[:5]} "
                         f"({len(missing)} in all).")
    used = set()
    for path, (key, transform) in mapping.items():
        if path not in params:
            raise ValueError(f"mapping names parameter {path}, which the model does not have.")
        if key not in state_dict:
            raise ValueError(f"state_dict has no key {key!r} (needed for parameter {path}).")
        var = params[path]
        arr = np.asarray(transform(state_dict[key]))
        want = tuple(var.get_value().shape)
        if arr.shape != want:
            raise ValueError(f"{key!r} converts to shape {arr.shape}, but parameter {path} "
                             f"has shape {want}.")
        var.set_value(jnp.asarray(arr, var.get_value().dtype))
        used.add(key)
    unused = [k for k in state_dict if k not in used and not ignore(k)]
    if unused:
        raise ValueError(f"state_dict keys not used by the conversion: {unused[:5]} "
                         f"({len(unused)} in all); is this the right model family?")
    return model
