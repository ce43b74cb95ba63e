"""Per-request token sampling inside a jitted step: greedy, temperature, top-k and top-p
(nucleus; Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration", §3.1), each
row with its own settings and its own random stream.

The filters follow Hugging Face's ``TopKLogitsWarper`` and ``TopPLogitsWarper``: logits
are divided by the temperature, the ``top_k`` largest kept, then the smallest set of
tokens whose probability reaches ``top_p`` (the most likely token always kept).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["sample_tokens", "sampling_arrays"]


def sampling_arrays(requests: Sequence[Any], vocab_size: int) -> tuple[jax.Array, ...]:
    """The per-row settings :func:`sample_tokens` takes, for the rows of a step:
    ``(temperature float32, top_k int32, top_p float32, seeds uint32)``, each ``[len(requests)]``,
    from each row's :class:`jaxpos.serving.Request` (None: an idle row, greedy). A
    ``top_k`` past the vocabulary keeps every token, so it is clipped to ``vocab_size``
    (it must also fit int32)."""
    row = lambda f, fill, dt: np.asarray([fill if r is None else f(r) for r in requests], dt)
    return (jnp.asarray(row(lambda r: r.temperature, 0.0, np.float32)),
            jnp.asarray(row(lambda r: min(int(r.top_k), vocab_size), 0, np.int32)),
            jnp.asarray(row(lambda r: r.top_p, 1.0, np.float32)),
            jnp.asarray(row(lambda r: r.seed, 0, np.int64).astype(np.uint32)))


def sample_tokens(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                  top_p: jax.Array, seeds: jax.Array, counters: jax.Array) -> jax.Array:
    """One token per row.

    Args:
      logits: float ``[B, V]``.
      temperature: float ``[B]``; ``0`` is greedy (argmax, no randomness).
      top_k: int ``[B]``; ``0`` keeps every token.
      top_p: float ``[B]`` in ``(0, 1]``; ``1`` keeps every token.
      seeds: int ``[B]``, each row's random stream; counters: int ``[B]``, the index of
        the token being drawn in that stream (a request draws the same tokens whatever
        batch it runs in).

    Returns:
      int32 ``[B]`` token ids.
    """
    logits = logits.astype(jnp.float32)
    V = logits.shape[-1]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    t = jnp.where(temperature > 0, temperature, 1.0).astype(jnp.float32)
    scaled = logits / t[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(V, dtype=jnp.int32)[None, :]
    k = jnp.where(top_k > 0, top_k, V).astype(jnp.int32)
    keep = rank < k[:, None]
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability of the better tokens
    keep = keep & ((before < top_p[:, None].astype(jnp.float32)) | (rank == 0))
    filtered = jnp.where(keep, sorted_logits, -jnp.inf)

    def draw(seed, counter, row):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), counter)
        return jax.random.categorical(key, row)

    pick = jax.vmap(draw)(seeds.astype(jnp.uint32), counters.astype(jnp.uint32), filtered)
    sampled = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)
