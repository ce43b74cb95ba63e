"""What the serving loop drives: the :class:`PagedModel` interface, and
:class:`PagedDecoder`, a small functional decoder-only LM over a paged KV cache (any
position scheme), for examples, benchmarks and tests.

A :class:`PagedModel` is three things: ``params`` (a pytree), ``init_pool(num_pages,
page_size)`` (the empty page pools of every layer, a pytree) and a pure ``forward(params,
tokens, positions, pool, page_table, lengths, mask) -> (logits, pool)`` that writes the new
tokens' keys and values into the pool at each row's fill and attends through the page
table (:func:`jaxpos.attention` with ``page_table=``). The loop jits ``forward`` once per
shape (a prefill chunk, a decode step over every batch slot).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from jaxpos import _checks
from jaxpos.core.entry import attention
from jaxpos.layers.cache import poison_rows
from jaxpos.layers.functional import (
    embed_tokens,
    merge_heads,
    mlp,
    project_heads,
    rms_norm,
    tied_logits,
)
from jaxpos.schemes.base import PositionScheme, as_scheme
from jaxpos.serving.pages import write_pages

__all__ = ["ModuleDecoder", "PagedDecoder", "PagedModel"]


class PagedModel(Protocol):
    """The model interface of :class:`jaxpos.serving.ServingEngine`.

    Attributes:
      params: the weights, a pytree passed to ``forward``.
      vocab_size: number of token ids (the width of the logits).
    """

    params: Any
    vocab_size: int

    def init_pool(self, num_pages: int, page_size: int) -> Any:
        """Empty page pools for every layer (a pytree)."""
        ...

    def forward(self, params: Any, tokens: jax.Array, positions: jax.Array, pool: Any,
                page_table: jax.Array, lengths: jax.Array,
                mask: jax.Array) -> tuple[jax.Array, Any]:
        """``tokens``, ``positions`` int32 ``[B, T]``; ``page_table`` int32 ``[B,
        pages_per_seq]``; ``lengths`` int32 ``[B]`` slots filled before this call; ``mask``
        bool ``[B, T]`` (False: padding at the end of a row, not written). Returns float32
        logits ``[B, T, vocab_size]`` and the pool with the new tokens written."""
        ...


@dataclasses.dataclass(frozen=True)
class PagedDecoder:
    """A pre-LN decoder-only LM (RMSNorm, GELU MLP, tied embeddings scaled by
    ``sqrt(d_model)``, the architecture of :class:`jaxpos.nnx.DecoderLM`) whose attention
    reads a paged KV cache.

    The scheme's :meth:`~jaxpos.PositionScheme.cache_write` decides what a page stores
    (RoPE keys rotated once, at write; raw keys for the schemes applied inside attention
    from positions, ALiBi, T5, KERPLE, ...); a slot's position is its index in the row.

    Attributes:
      vocab_size, d_model, num_layers, num_heads: sizes (``head_dim = d_model //
        num_heads``).
      num_kv_heads: key/value heads (grouped-query attention), default ``num_heads``.
      mlp_dim: MLP width, default ``4 * d_model``.
      position: a :class:`jaxpos.PositionScheme` (its arrays, e.g. T5's table, are part of
        the model) or None (NoPE).
      dtype: compute and page dtype.
      seed: the weights are ``N(0, 1/fan_in)`` draws from this seed (:attr:`params`).

    Raises:
      ValueError / TypeError: sizes that are not positive ints or do not divide.
    """

    vocab_size: int
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int | None = None
    mlp_dim: int | None = None
    position: Any = None
    dtype: Any = jnp.float32
    seed: int = 0

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "num_layers", "num_heads"):
            _checks.check_positive_int(name, getattr(self, name))
        nk = self.num_kv_heads or self.num_heads
        if self.d_model % self.num_heads or self.num_heads % nk:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of num_heads "
                             f"({self.num_heads}), and num_heads of num_kv_heads ({nk}).")
        as_scheme(self.position).check(self.num_heads, self.d_model // self.num_heads)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def params(self) -> dict:
        """The weights: ``embed [V, D]``, per layer ``attn_norm, q, k, v, o, mlp_norm,
        w_in, w_out``, ``final_norm``, and the scheme (a pytree)."""
        D, H, N, Nk = self.d_model, self.head_dim, self.num_heads, self.kv_heads
        F = self.mlp_dim or 4 * D
        keys = iter(jax.random.split(jax.random.PRNGKey(self.seed), 1 + 6 * self.num_layers))
        init = lambda shape: (jax.random.normal(next(keys), shape, jnp.float32)
                              * shape[0] ** -0.5)
        layers = [dict(attn_norm=jnp.ones((D,)), q=init((D, N * H)), k=init((D, Nk * H)),
                       v=init((D, Nk * H)), o=init((N * H, D)), mlp_norm=jnp.ones((D,)),
                       w_in=init((D, F)), w_out=init((F, D))) for _ in range(self.num_layers)]
        return dict(embed=jax.random.normal(next(keys), (self.vocab_size, D)) * D ** -0.5,
                    layers=layers, final_norm=jnp.ones((D,)),
                    scheme=as_scheme(self.position))

    def init_pool(self, num_pages: int, page_size: int) -> tuple:
        """``num_layers`` pairs of zero pages ``[num_pages, page_size, N_kv, head_dim]``."""
        _checks.check_positive_int("num_pages", num_pages)
        _checks.check_positive_int("page_size", page_size)
        shape = (num_pages, page_size, self.kv_heads, self.head_dim)
        return tuple((jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype))
                     for _ in range(self.num_layers))

    def forward(self, params: dict, tokens: jax.Array, positions: jax.Array, pool: tuple,
                page_table: jax.Array, lengths: jax.Array,
                mask: jax.Array) -> tuple[jax.Array, tuple]:
        """See :meth:`PagedModel.forward`. A row whose tokens find no page (the table is
        too short) gets NaN logits (its tokens are not written)."""
        scheme: PositionScheme = params["scheme"]
        dt, N, Nk, H = self.dtype, self.num_heads, self.kv_heads, self.head_dim
        x = embed_tokens(params["embed"], tokens, self.d_model, dt)
        new_pool, overflow = [], jnp.zeros(tokens.shape[:1], bool)
        for layer, (kp, vp) in zip(params["layers"], pool):
            h = rms_norm(x, layer["attn_norm"])
            q = project_heads(h, layer["q"], N, H, dt)
            k = project_heads(h, layer["k"], Nk, H, dt)
            v = project_heads(h, layer["v"], Nk, H, dt)
            q, k, read = scheme.cache_write(q, k, positions)
            kp, vp, filled, over = write_pages(kp, vp, k, v, page_table, lengths, mask)
            o = attention(q, kp, vp, page_table=page_table, kv_lengths=filled,
                          q_positions=positions, position=read, causal=True)
            x = x + merge_heads(o, layer["o"], dt)
            x = x + mlp(rms_norm(x, layer["mlp_norm"]), layer["w_in"], layer["w_out"], dt)
            new_pool.append((kp, vp))
            overflow = overflow | over
        logits = tied_logits(rms_norm(x, params["final_norm"]), params["embed"])
        return poison_rows(logits, overflow), tuple(new_pool)


class ModuleDecoder:
    """A :class:`PagedModel` over a :class:`jaxpos.nnx.DecoderLM` (any position the module
    builds): each step hands the model one paged cache per layer
    (:func:`jaxpos.layers.cache.paged.paged_view` of the loop's pages, page table and
    lengths) and calls its ``decode_step``.

    Args:
      model: a :class:`jaxpos.nnx.DecoderLM` (its weights are split off as :attr:`params`).

    Raises:
      ValueError: a model whose decoding keeps state beside the keys and values (PaTH:
        the loop owns only the pages).
    """

    def __init__(self, model: Any):
        from flax import nnx

        from jaxpos.layers.cache.paged import PagedKVCache

        kept = [type(c).__name__ for c in model.init_cache(1, 1, page_size=1, num_pages=1)
                if not isinstance(c, PagedKVCache)]
        if kept:
            raise ValueError(f"the serving loop owns only the key and value pages, but this "
                             f"model's layers decode with a cache that keeps more ({kept[0]}: "
                             f"PaTH's decode state, its short convolution's last inputs); "
                             f"decode it with model.decode_step and its own init_cache.")
        self._graphdef, self.params = nnx.split(model)
        vocab = getattr(model, "vocab_size", None)  # DecoderLM and the example ports
        self.vocab_size = int(vocab if vocab is not None else model.embed.embedding.shape[0])
        self._model = model

    def init_pool(self, num_pages: int, page_size: int) -> tuple:
        """The model's empty paged caches' pools: ``num_layers`` pairs of zero pages."""
        caches = self._model.init_cache(1, page_size, page_size=page_size, num_pages=num_pages)
        return tuple((c.k_pages, c.v_pages) for c in caches)

    def forward(self, params: Any, tokens: jax.Array, positions: jax.Array, pool: tuple,
                page_table: jax.Array, lengths: jax.Array,
                mask: jax.Array) -> tuple[jax.Array, tuple]:
        """See :meth:`PagedModel.forward`. Masked tokens (the padding at the end of a
        prefill chunk) are written like tokens: the loop's lengths count the others only,
        so the next step's view hides those slots and later tokens overwrite them."""
        from flax import nnx

        from jaxpos.layers.cache.paged import paged_view

        model = nnx.merge(self._graphdef, params)
        caches = tuple(paged_view(kp, vp, page_table, lengths) for kp, vp in pool)
        del mask  # (see above)
        logits, caches = model.decode_step(tokens, caches, positions=positions)
        return logits, tuple((c.k_pages, c.v_pages) for c in caches)
