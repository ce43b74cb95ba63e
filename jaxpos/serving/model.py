"""What the serving loop drives: the :class:`PagedModel` interface, and
:class:`PagedDecoder`, a small functional decoder-only LM over a paged KV cache (any
position scheme), for examples, benchmarks and tests.

A :class:`PagedModel` is three things: ``params`` (a pytree), ``init_pool(num_pages,
page_size)`` (the empty page pools of every layer, a pytree) and a pure ``forward(params,
tokens, positions, pool, page_table, lengths, mask) -> (logits, pool)`` that writes the new
tokens' keys and values into the pool at each row's fill and attends through the page
table (:func:`jaxpos.attention` with ``page_table=``). The loop jits ``forward`` once per
shape (a prefill chunk, a decode step over every batch slot).

A model the loop may run with a token budget (``ServingEngine(...,
max_num_batched_tokens=)``) also has ``forward_ragged(params, tokens, positions, pool,
page_table, lengths, cu_q_lengths, mask, logits_at) -> (logits, pool)``: one step over the
new tokens of every row packed along one axis (prefill chunks and decode tokens together),
written at each row's fill and read by the ragged call (``cu_q_lengths``,
:mod:`jaxpos.core.ragged`); ``ragged_refusal`` (a str, or None) says why a model cannot.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from jaxpos import _checks
from jaxpos.core.entry import attention
from jaxpos.layers.cache import poison_rows
from jaxpos.layers.cache.ragged import ragged_view, write_ragged
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

    def page_sharing_key(self) -> str:
        """What a page of this model's pool depends on besides its tokens and their
        positions (prefix caching, :mod:`jaxpos.serving.prefix`): the sizes, the weights'
        seed and the position scheme (class and static fields: RoPE stores rotated keys)."""
        scheme = as_scheme(self.position)
        return (f"{dataclasses.replace(self, position=None)!r}:{type(scheme).__qualname__}:"
                f"{jax.tree_util.tree_structure(scheme)}")

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
        dt = self.dtype
        x = embed_tokens(params["embed"], tokens, self.d_model, dt)
        new_pool, overflow = [], jnp.zeros(tokens.shape[:1], bool)
        for layer, (kp, vp) in zip(params["layers"], pool):
            q, k, v = self._qkv(x, layer)
            q, k, read = scheme.cache_write(q, k, positions)
            kp, vp, filled, over = write_pages(kp, vp, k, v, page_table, lengths, mask)
            o = attention(q, kp, vp, page_table=page_table, kv_lengths=filled,
                          q_positions=positions, position=read, causal=True)
            x = self._finish_block(x, o, layer)
            new_pool.append((kp, vp))
            overflow = overflow | over
        logits = tied_logits(rms_norm(x, params["final_norm"]), params["embed"])
        return poison_rows(logits, overflow), tuple(new_pool)

    def _qkv(self, x: jax.Array, layer: dict) -> tuple[jax.Array, jax.Array, jax.Array]:
        """A block's q ``[B, T, N, H]`` and k, v ``[B, T, N_kv, H]`` from its input."""
        h = rms_norm(x, layer["attn_norm"])
        return (project_heads(h, layer["q"], self.num_heads, self.head_dim, self.dtype),
                project_heads(h, layer["k"], self.kv_heads, self.head_dim, self.dtype),
                project_heads(h, layer["v"], self.kv_heads, self.head_dim, self.dtype))

    def _finish_block(self, x: jax.Array, o: jax.Array, layer: dict) -> jax.Array:
        """The block's output: the attention output ``o`` projected and added, then the
        MLP's residual."""
        dt = self.dtype
        x = x + merge_heads(o, layer["o"], dt)
        return x + mlp(rms_norm(x, layer["mlp_norm"]), layer["w_in"], layer["w_out"], dt)

    #: why :meth:`forward_ragged` cannot run this model (None: it can)
    ragged_refusal = None

    def forward_ragged(self, params: dict, tokens: jax.Array, positions: jax.Array,
                       pool: tuple, page_table: jax.Array, lengths: jax.Array,
                       cu_q_lengths: jax.Array, mask: jax.Array,
                       logits_at: jax.Array) -> tuple[jax.Array, tuple]:
        """One ragged step (module docstring): ``tokens``, ``positions`` int32 ``[total]``
        packed (row ``b``'s are ``[cu_q_lengths[b], cu_q_lengths[b + 1])``, the tokens
        after its ``lengths[b]`` filled slots), ``mask`` bool ``[total]`` (False: padding,
        not written), ``page_table`` ``[R, pages_per_seq]``, ``lengths`` ``[R]``,
        ``cu_q_lengths`` ``[R + 1]``, ``logits_at`` int32 ``[R]`` packed indices. Returns
        float32 logits ``[R, vocab_size]`` at ``logits_at`` (only those rows go through
        the output layer) and the pool with the new tokens written. A token that finds no
        page makes its row's logits NaN (the ragged call's rule)."""
        scheme: PositionScheme = params["scheme"]
        dt = self.dtype
        x = embed_tokens(params["embed"], tokens[None], self.d_model, dt)
        pos = positions[None]
        new_pool = []
        for layer, (kp, vp) in zip(params["layers"], pool):
            q, k, v = self._qkv(x, layer)
            q, k, read = scheme.cache_write(q, k, pos)
            kp, vp, filled, _ = write_ragged(kp, vp, k[0], v[0], page_table, lengths,
                                             cu_q_lengths, mask)
            o = attention(q[0], kp, vp, page_table=page_table, kv_lengths=filled,
                          cu_q_lengths=cu_q_lengths, q_positions=positions, position=read,
                          causal=True)
            x = self._finish_block(x, o[None], layer)
            new_pool.append((kp, vp))
        last = x[:, logits_at]  # [1, R, D]
        return tied_logits(rms_norm(last, params["final_norm"]), params["embed"])[0], \
            tuple(new_pool)


class ModuleDecoder:
    """A :class:`PagedModel` over a :class:`jaxpos.nnx.DecoderLM` (any position the module
    builds): each step hands the model one paged cache per layer
    (:func:`jaxpos.layers.cache.paged.paged_view` of the loop's pages, page table and
    lengths) and calls its ``decode_step``.

    A layer whose decoding keeps a scheme's state beside the keys and values (FoX's
    cumulative forget gates, PaTH's convolution tail; :mod:`jaxpos.layers.cache.scheme_state`)
    keeps it in the pool too: the per-slot entries (``*_slots``, ``[B, S, ...]``) in pages
    of their own beside the keys, read through the page table; the per-row entries in one
    pool row per request, at the index of the request's first page (a new request,
    ``lengths == 0``, starts from the empty state). So every request decodes as it would
    alone, whatever the batch around it.

    Args:
      model: a :class:`jaxpos.nnx.DecoderLM` (its weights are split off as :attr:`params`).
      kv_dtype: the pages' storage, passed to the model's ``init_cache``: None (its dtype),
        a float dtype, or ``"int8"`` / ``"float8_e4m3fn"`` for quantised pages (a scale per
        token and KV head; :mod:`jaxpos.core.quantised`).

    Raises:
      ValueError: a model whose caches are not paged caches (or a scheme state around one).
      TypeError: a ``kv_dtype`` that is neither quantised nor floating.
    """

    def __init__(self, model: Any, kv_dtype: Any = None):
        from flax import nnx

        from jaxpos.layers.cache import PagedKVCache, SchemeStateCache

        #: per layer, the scheme whose decode state the layer's cache keeps (or None)
        self._state_names: list[str | None] = []
        #: the init_cache options of the pool's pages (kv_dtype when given)
        self._pages = {} if kv_dtype is None else {"kv_dtype": kv_dtype}
        for c in model.init_cache(1, 1, page_size=1, num_pages=1, **self._pages):
            inner = c.inner if isinstance(c, SchemeStateCache) else c
            if not isinstance(inner, PagedKVCache):
                raise ValueError(f"the serving loop keeps each layer's cache in pages, but "
                                 f"this model's init_cache(page_size=, num_pages=) gives "
                                 f"{type(c).__name__}.")
            self._state_names.append(c.scheme_name if isinstance(c, SchemeStateCache)
                                     else None)
        #: the refusal of the pool's own kind (scheme states, quantised pages), or None
        self._pool_refusal = _ragged_refusal(self._state_names, inner)
        self._traced_refusal: list[str | None] = []  # the ragged trace's, once computed
        self._graphdef, self.params = nnx.split(model)
        vocab = getattr(model, "vocab_size", None)  # DecoderLM and the example ports
        self.vocab_size = int(vocab if vocab is not None else model.embed.embedding.shape[0])
        self._model = model

    @property
    def ragged_refusal(self) -> str | None:
        """Why the loop cannot run this model in packed ragged steps under a token budget
        (None: it can; else it runs padded steps, :class:`jaxpos.serving.scheduler.RaggedLoop`),
        read when a :class:`jaxpos.serving.ServingEngine` is built with
        ``max_num_batched_tokens``.

        The pool's own reasons first (a scheme's decode state: FoX, PaTH; quantised pages);
        else the ``ValueError`` that tracing :meth:`forward_ragged` once on one token raises
        (``jax.eval_shape``: no compilation, no device work), so the refusals a module's
        layers raise only while a ragged step is traced (DeepSeek-V3's latent attention,
        schemes the ragged cache refuses) come when the engine is built, with the same
        message. The trace runs on first access and is remembered."""
        if self._pool_refusal is not None:
            return self._pool_refusal
        if not self._traced_refusal:
            self._traced_refusal.append(self._trace_ragged())
        return self._traced_refusal[0]

    def _trace_ragged(self) -> str | None:
        """The message of the ``ValueError`` a ragged step of one token (one row of one
        page slot) raises while it is traced, or None (also for any other error of this
        one-token trace, which the loop's real steps then raise themselves)."""
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
        pool = jax.eval_shape(lambda: self.init_pool(1, 1))
        try:
            jax.eval_shape(self.forward_ragged, self.params, i32(1), i32(1), pool, i32(1, 1),
                           i32(1), i32(2), jax.ShapeDtypeStruct((1,), jnp.bool_), i32(1))
        except ValueError as e:  # (the loop's own words are not repeated)
            return re.sub(r"[.;]\s*a token-budget ServingEngine runs this model in padded "
                          r"steps\.?$", "", str(e).strip(), flags=re.IGNORECASE).removesuffix(".")
        except Exception:  # noqa: BLE001 - not a refusal: the real step reports it
            return None
        return None

    def page_sharing_key(self) -> str:
        """What a page of this model's pool depends on besides its tokens and their
        positions (prefix caching, :mod:`jaxpos.serving.prefix`): the module's class and
        position, and the scheme state of each layer's cache.

        Raises:
          ValueError: layers whose pages cannot be shared (PaTH, FoX;
            :func:`jaxpos.serving.prefix.check_shareable`).
        """
        from jaxpos.serving.prefix import check_shareable

        name = f"{type(self._model).__qualname__}:{getattr(self._model, 'position_name', '')}"
        return check_shareable(name, self._model.init_cache(1, 1, page_size=1, num_pages=1))

    def init_pool(self, num_pages: int, page_size: int) -> tuple:
        """The model's empty paged caches' pools: per layer the zero key and value pages,
        and for a layer with a scheme state a third entry ``{name: zeros}``: ``[num_pages,
        page_size, ...]`` for a per-slot entry, ``[num_pages, ...]`` for a per-row one."""
        from jaxpos.layers.cache import SchemeStateCache

        caches = self._model.init_cache(1, page_size, page_size=page_size, num_pages=num_pages,
                                        **self._pages)
        pool = []
        for c in caches:
            if not isinstance(c, SchemeStateCache):
                pool.append((c.k_pages, c.v_pages))
                continue
            state = {n: jnp.zeros((num_pages, page_size) + a.shape[2:], a.dtype)
                     if _per_slot(n) else jnp.zeros((num_pages,) + a.shape[1:], a.dtype)
                     for n, a in c.state.items()}
            inner: Any = c.inner  # a PagedKVCache (checked in __init__)
            pool.append((inner.k_pages, inner.v_pages, state))
        return tuple(pool)

    def forward(self, params: Any, tokens: jax.Array, positions: jax.Array, pool: tuple,
                page_table: jax.Array, lengths: jax.Array,
                mask: jax.Array) -> tuple[jax.Array, tuple]:
        """See :meth:`PagedModel.forward`. Masked tokens (the padding at the end of a
        prefill chunk) are written as padding: the loop's lengths count the others only,
        so the next step's view hides those slots and later tokens overwrite them; a
        scheme's state skips them."""
        from flax import nnx

        from jaxpos.layers.cache import SchemeStateCache
        from jaxpos.layers.cache.paged import paged_view

        model = nnx.merge(self._graphdef, params)
        caches = []
        for layer, name in zip(pool, self._state_names):
            view = paged_view(layer[0], layer[1], page_table, lengths)
            if name is None:
                caches.append(view)
            else:
                state = _read_state(layer[2], page_table, lengths)
                caches.append(SchemeStateCache(view, state, name))
        logits, caches = model.decode_step(tokens, tuple(caches), positions=positions,
                                           attention_mask=mask)
        new_pool = []
        for layer, c in zip(pool, caches):
            if isinstance(c, SchemeStateCache):
                state = _write_state(layer[2], c.state, page_table, lengths, mask)
                inner: Any = c.inner  # a PagedKVCache (checked in __init__)
                new_pool.append((inner.k_pages, inner.v_pages, state))
            else:
                new_pool.append((c.k_pages, c.v_pages))
        return logits, tuple(new_pool)

    def forward_ragged(self, params: Any, tokens: jax.Array, positions: jax.Array,
                       pool: tuple, page_table: jax.Array, lengths: jax.Array,
                       cu_q_lengths: jax.Array, mask: jax.Array,
                       logits_at: jax.Array) -> tuple[jax.Array, tuple]:
        """See :meth:`PagedDecoder.forward_ragged`: the module's ``decode_step`` on the
        packed tokens as one batch row, each layer's cache a
        :class:`jaxpos.layers.cache.ragged.RaggedPagedCache` over its pages (its attention
        is the ragged call). Logits ``[R, vocab_size]`` at ``logits_at``."""
        from flax import nnx

        model = nnx.merge(self._graphdef, params)
        caches = tuple(ragged_view(layer[0], layer[1], page_table, lengths, cu_q_lengths)
                       for layer in pool)
        logits, caches = model.decode_step(tokens[None], caches, positions=positions[None],
                                           attention_mask=mask[None])
        return logits[0, logits_at], tuple((c.k_pages, c.v_pages) for c in caches)


def _ragged_refusal(state_names: list[str | None], inner: Any) -> str | None:
    """Why a ragged step cannot run a module whose layers keep the decode states
    ``state_names`` in paged caches like ``inner`` (None: it can)."""
    if any(state_names):
        return (f"this model's layers keep a scheme's decode state "
                f"({sorted({n for n in state_names if n})}), which the ragged step does not "
                f"carry yet (it writes every row's new tokens as one packed row)")
    if not isinstance(inner.k_pages, jax.Array):
        return "its pages are quantised (kv_dtype), which the ragged step does not write yet"
    return None


def _per_slot(name: str) -> bool:
    """A scheme state's entry named ``*_slots`` is per slot (``[B, S, ...]``)."""
    return name.endswith("_slots")


def _read_state(pool: dict, page_table: jax.Array, lengths: jax.Array) -> dict:
    """The decode state of the batch's rows from the pool: per-slot entries gathered
    through the page table, per-row ones from the row's first page (zeros for a row
    that holds no token yet)."""
    from jaxpos.core.paged import gather_pages

    table = jnp.asarray(page_table, jnp.int32)
    P = next(iter(pool.values())).shape[0]
    first = jnp.clip(table[:, 0], 0, P - 1)
    fresh = jnp.asarray(lengths, jnp.int32) == 0
    out = {}
    for name, a in pool.items():
        if _per_slot(name):
            out[name] = gather_pages(a, table)
        else:
            row = a[first]
            out[name] = jnp.where(fresh.reshape((-1,) + (1,) * (row.ndim - 1)),
                                  jnp.zeros_like(row), row)
    return out


def _write_state(pool: dict, state: dict, page_table: jax.Array, lengths: jax.Array,
                 mask: jax.Array) -> dict:
    """``pool`` with the step's state written back: per-slot entries at the new tokens'
    slots (``lengths + t`` where ``mask``), per-row ones at the row's first page (rows
    with a token this step); entries without a page are dropped, never clamped."""
    table = jnp.asarray(page_table, jnp.int32)
    B, T = mask.shape
    rows = jnp.arange(B, dtype=jnp.int32)[:, None]
    out = {}
    for name, a in pool.items():
        P, new = a.shape[0], state[name]
        if _per_slot(name):
            ps = a.shape[1]
            slot = jnp.asarray(lengths, jnp.int32)[:, None] + jnp.arange(T, dtype=jnp.int32)
            col = jnp.clip(slot // ps, 0, table.shape[1] - 1)
            page = table[rows, col]
            ok = mask & (slot // ps < table.shape[1]) & (page >= 0) & (page < P)
            vals = jnp.take_along_axis(
                new, jnp.clip(slot, 0, new.shape[1] - 1).reshape((B, T) + (1,) * (new.ndim - 2)),
                axis=1)
            out[name] = a.at[jnp.where(ok, page, P), slot % ps].set(vals.astype(a.dtype),
                                                                   mode="drop")
        else:
            first = table[:, 0]
            ok = jnp.any(mask, axis=1) & (first >= 0) & (first < P)
            out[name] = a.at[jnp.where(ok, first, P)].set(new.astype(a.dtype), mode="drop")
    return out
