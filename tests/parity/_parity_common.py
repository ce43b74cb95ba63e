"""Helpers of the parity tests of the 2026 model ports (GPT-OSS, DeepSeek-V3): redraw every
weight of a tiny Hugging Face model, jit an NNX model once per shape, left-padded batches,
and HF's own cached generation, the reference for KV-cache decoding."""

from __future__ import annotations

import functools
import importlib
import inspect

import jax
import numpy as np
import pytest
from flax import nnx

TOL = 1e-4  # max abs logit difference, float32
MISS = 1e-2  # a negative control must miss by more than this
BLOCKS = {"block_q": 4, "block_k": 4}  # several query and key tiles at these lengths


def _pallas_available() -> bool:
    try:
        return hasattr(importlib.import_module("jaxpos.kernels"), "attention_via_kernel")
    except ImportError:
        return False


NEEDS_PALLAS = pytest.mark.skipif(
    not _pallas_available(),
    reason="jaxpos.kernels.attention_via_kernel (implementation='pallas') is not in this build")
# Pallas runs in interpret mode on CPU and compiles slowly: its cases run with -m slow.
IMPLEMENTATIONS = ["reference", "chunked",
                   pytest.param("pallas", marks=[NEEDS_PALLAS, pytest.mark.slow])]
# Decoding compiles a prefill and a one-token step per implementation: the default run
# keeps the chunked path (online softmax, block masks, sinks), the others run with -m slow.
DECODE_IMPLEMENTATIONS = [pytest.param("reference", marks=pytest.mark.slow), "chunked",
                          pytest.param("pallas", marks=[NEEDS_PALLAS, pytest.mark.slow])]


def randomize(model, seed: int, *, std: float = 0.3, embed_std: float = 0.5,
              sink_std: float = 1.0, buffers: tuple[str, ...] = ()):
    """Redraw every parameter of an HF model (and the named buffers): norm weights
    ``1 + 0.1 N(0, 1)``, embeddings ``N(0, embed_std^2)``, attention sinks
    ``N(0, sink_std^2)``, buffers ``N(0, 0.1^2)``, everything else ``N(0, std^2)``.

    HF's initialisation (std 0.02, sinks near 0) makes attention nearly uniform and the
    sinks negligible, which would hide position and sink errors."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tensors = list(model.named_parameters())
    tensors += [(n, b) for n, b in model.named_buffers() if n.endswith(buffers) and buffers]
    with torch.no_grad():
        for name, p in tensors:
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif "embed" in name:
                p.copy_(embed_std * noise)
            elif name.endswith("sinks"):
                p.copy_(sink_std * noise)
            elif not isinstance(p, torch.nn.Parameter):
                p.copy_(0.1 * noise)
            else:
                p.copy_(std * noise)
    return model.eval()


_JITTED: dict = {}


def jit(model, *, fresh: bool = False):
    """``model(...)`` compiled once per shape and static argument (jax.jit over the split
    NNX state)."""
    key = id(model)
    if fresh or key not in _JITTED:
        graphdef, state = nnx.split(model)
        statics = tuple(n for n in inspect.signature(type(model).__call__).parameters
                        if n in ("implementation", "block_q", "block_k", "sliding_window",
                                 "use_sinks"))

        @functools.partial(jax.jit, static_argnames=statics)
        def run(state, *args, **kwargs):
            return nnx.merge(graphdef, state)(*args, **kwargs)

        _JITTED[key] = (model, lambda *args, **kwargs: run(state, *args, **kwargs))
    return _JITTED[key][1]


def max_diff(ours, ref, where=None) -> float:
    d = np.abs(np.asarray(ours, np.float64) - np.asarray(ref, np.float64))
    return float(d[np.asarray(where, bool)].max() if where is not None else d.max())


def left_padded_batch(rs, lengths, T, vocab):
    """Token ids ``[B, T]`` and a 0/1 mask with ``T - length`` pads on the left of each row."""
    ids = rs.randint(0, vocab, (len(lengths), T))
    mask = np.zeros((len(lengths), T), np.int64)
    for b, n in enumerate(lengths):
        mask[b, T - n:] = 1
    return ids, mask


def hf_positions(mask):
    """What ``generate`` passes for left padding: ``cumsum(mask) - 1``, 1 on pads."""
    pos = np.cumsum(mask, -1) - 1
    pos[mask == 0] = 1
    return pos


def hf_cached_generation(hf, ids, mask, prompt_len):
    """HF's own KV-cache decoding: the prompt ``[:, :prompt_len]`` in one call, then one
    token per call with its cache. Returns the prompt's logits ``[B, prompt_len, V]`` and
    a list of one ``[B, V]`` array per later step."""
    import torch

    tt = torch.tensor
    pos = hf_positions(mask)
    # transformers 5.2x renamed ``past_key_values`` to ``cache``
    cache_kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = hf(tt(ids[:, :prompt_len]), attention_mask=tt(mask[:, :prompt_len]),
                 position_ids=tt(pos[:, :prompt_len]), use_cache=True)
        first, cache, steps = out.logits.numpy(), getattr(out, cache_kw), []
        for t in range(prompt_len, ids.shape[1]):
            out = hf(tt(ids[:, t:t + 1]), attention_mask=tt(mask[:, :t + 1]),
                     position_ids=tt(pos[:, t:t + 1]), use_cache=True, **{cache_kw: cache})
            steps.append(out.logits.numpy()[:, 0])
            cache = getattr(out, cache_kw)
    return first, steps


def decode(model, ids, mask, prompt_len, *, implementation, max_len=None, **kw):
    """Our KV-cache decoding: prefill ``[:, :prompt_len]``, then one token per call.
    Returns the prompt's logits, the list of step logits ``[B, V]`` and the final cache."""
    import jax.numpy as jnp

    run = jit(model)
    cache = model.init_cache(batch=ids.shape[0], max_len=max_len or ids.shape[1])
    first, cache = run(jnp.asarray(ids[:, :prompt_len]),
                       attention_mask=jnp.asarray(mask[:, :prompt_len]), cache=cache,
                       implementation=implementation, **kw)
    steps = []
    for t in range(prompt_len, ids.shape[1]):
        step, cache = run(jnp.asarray(ids[:, t:t + 1]), cache=cache,
                          implementation=implementation, **kw)
        steps.append(np.asarray(step)[:, 0])
    return np.asarray(first), steps, cache
