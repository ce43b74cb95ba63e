"""The position-scheme protocol: how any scheme enters :func:`jaxpos.attention`.

A scheme is an immutable pytree (a :class:`PositionScheme` subclass). Array fields are
pytree children (traced under ``jit``, differentiable); the rest (layouts, bucket
counts, flags) are static, so changing only array values never retraces. Every
implementation of attention (reference, chunked, the Pallas kernel) asks a scheme the
same questions and nothing else; none of them names a scheme:

* :meth:`PositionScheme.transform_qk`: a per-token transform of queries and keys
  (RoPE's rotation, xPos's scaled rotation), applied once per call, ``O(T * H)``;
* :meth:`PositionScheme.score_mod`: the scheme's score term as a score_mod
  ``(score, batch, head, q_pos, kv_pos) -> score`` (ALiBi, T5, KERPLE, FIRE, ...; see
  :mod:`jaxpos.mods`), traced per tile by every implementation;
* :meth:`PositionScheme.content_bias` and :meth:`PositionScheme.value_term`: terms that
  depend on the query content or on the attention weights (Shaw et al. 2018), which
  only the reference and chunked paths compute;
* :meth:`PositionScheme.cache_write`: what a KV cache stores and which scheme reads it;
* :meth:`PositionScheme.load_tables`: what the scheme needs where attention loads raw q
  and k (RoPE's cos/sin tables), or ``None``;
* ``replaces_softmax`` and :meth:`PositionScheme.attention`: a scheme that brings its own
  attention (stick-breaking), whose engine registers it with :func:`register_attention`.

Each scheme lives in its own module with its pure functions (``jaxpos.schemes.alibi``,
``jaxpos.schemes.t5``, ``jaxpos.schemes.rope``, ...) and registers itself under a name with
:func:`register`, for the Flax modules and the examples (:func:`get_scheme`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

__all__ = ["ATTENTIONS", "REGISTRY", "NoPE", "PositionScheme",
           "as_scheme", "get_scheme", "register", "register_attention"]

#: name -> scheme class; filled by :func:`register` in each scheme's module.
REGISTRY: dict[str, type] = {}
#: scheme name -> the attention that replaces softmax attention for that scheme
#: (``replaces_softmax``); filled by :func:`register_attention` in the engine's module.
#: The ``implementation=`` values they take are the engines that declare the
#: ``replacing_form`` capability (:func:`jaxpos.core.engines.replacing_form`).
ATTENTIONS: dict[str, Callable[..., Any]] = {}


def register(name: str) -> Callable[[type], type]:
    """Class decorator: make a scheme class available as ``REGISTRY[name]``."""

    def deco(cls):
        if name in REGISTRY and REGISTRY[name] is not cls:
            raise ValueError(f"scheme name {name!r} is already registered by "
                             f"{REGISTRY[name].__name__}")
        REGISTRY[name] = cls
        cls.registry_name = name
        return cls

    return deco


def register_attention(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Function decorator: make ``fn(scheme, q, k, v, **attention_keywords)`` the attention of
    the scheme registered as ``name`` whose class sets ``replaces_softmax = True``
    (:meth:`PositionScheme.attention`). The engine lives in the core room and registers
    itself here, so the scheme's module never imports the core.

    Raises:
      ValueError: ``name`` already has another attention.
    """

    def deco(fn):
        if name in ATTENTIONS and ATTENTIONS[name] is not fn:
            raise ValueError(f"scheme name {name!r} already has an attention: "
                             f"{ATTENTIONS[name].__qualname__}")
        ATTENTIONS[name] = fn
        return fn

    return deco


def get_scheme(name: str) -> type:
    """The scheme class registered under ``name``.

    Raises:
      ValueError: unknown name (the message lists the known ones).
    """
    if not isinstance(name, str) or name not in REGISTRY:
        raise ValueError(f"unknown position scheme {name!r}; expected one of "
                         f"{sorted(REGISTRY)}.")
    return REGISTRY[name]


class PositionScheme:
    """Base class of every scheme: an immutable pytree answering the protocol below.

    Subclasses list their array fields in ``_children`` and their static fields in
    ``_static`` and override the methods that apply to them; the defaults add nothing.
    """

    _children: tuple[str, ...] = ()
    _static: tuple[str, ...] = ()
    registry_name: str | None = None

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        jax.tree_util.register_pytree_node(cls, cls._flatten, cls._unflatten)

    def _flatten(self):
        return (tuple(getattr(self, n) for n in self._children),
                tuple(getattr(self, n) for n in self._static))

    @classmethod
    def _unflatten(cls, aux, children):
        obj = object.__new__(cls)
        for n, val in zip(cls._children, children):
            object.__setattr__(obj, n, val)
        for n, val in zip(cls._static, aux):
            object.__setattr__(obj, n, val)
        return obj

    def _set(self, **fields):
        for n, val in fields.items():
            object.__setattr__(self, n, val)

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable; use .replace(...)")

    def replace(self, **changes: Any) -> PositionScheme:
        """A copy with some fields changed (like ``dataclasses.replace``)."""
        children, aux = self._flatten()
        obj = self._unflatten(aux, children)
        obj._set(**changes)
        return obj

    def __repr__(self):
        parts = []
        for n in self._children:
            v = getattr(self, n)
            parts.append(f"{n}=<{getattr(v, 'dtype', type(v).__name__)}{list(np.shape(v))}>"
                         if v is not None else f"{n}=None")
        parts += [f"{n}={getattr(self, n)!r}" for n in self._static]
        return f"{type(self).__name__}({', '.join(parts)})"

    # ---- the protocol --------------------------------------------------------------
    def check(self, num_heads: int, head_dim: int) -> None:
        """Raise ``ValueError`` if the scheme cannot serve ``num_heads`` query heads of
        width ``head_dim``."""

    def check_causal(self, causal: bool) -> None:
        """Raise ``ValueError`` if the scheme contradicts the call's ``causal`` flag (e.g.
        T5's bidirectional buckets in a causal decoder)."""

    def transform_qk(self, q: jax.Array, k: jax.Array, q_positions: jax.Array,
                     kv_positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Per-token transform of ``q`` ``[B, Tq, N, H]`` and ``k`` ``[B, Tk, N_kv, H]``
        at int32 positions ``[B|1, T]``. Returns ``(q, k)``, shapes and dtypes kept."""
        return q, k

    def score_mod(self) -> Callable[..., jax.Array] | None:
        """The scheme's score term as a score_mod ``(score, batch, head, q_pos, kv_pos)
        -> score`` (see :mod:`jaxpos.mods`), or ``None``."""
        return

    @property
    def score_heads(self) -> int | None:
        """The number of heads of the scheme's score term (the length of its per-head
        parameters), or ``None`` for a scheme without one."""
        return None

    @property
    def score_batch(self) -> int:
        """The batch size of the score term's own parameters (FoX's per-row gates); 1 when
        the term is the same for every batch row."""
        return 1

    def bias(self, q_positions: ArrayLike, kv_positions: ArrayLike, *,
             batch_size: int | None = None) -> jax.Array:
        """The scheme's score term as an array: its :meth:`score_mod` evaluated on a zero
        score grid, float32 ``[B|1, N, Tq, Tk]`` (``bias[b, h, i, j]`` is what attention
        adds to ``scale * q_i . k_j`` of head ``h``; for plots, debugging and dense paths).

        Args:
          q_positions, kv_positions: integer ``[Tq]`` / ``[Tk]`` or ``[B|1, T]``.
          batch_size: ``B`` of the result; default the largest batch of the positions and
            of the scheme's own parameters (1 when the term is shared by every row).

        Returns:
          float32 ``[B, N, Tq, Tk]`` (``B`` is 1 unless the positions, the parameters or
          ``batch_size`` have a batch).

        Raises:
          TypeError: the scheme has no score term (RoPE, NoPE: their positions enter
            through :meth:`transform_qk`), or its score_mod does more than add a term
            (SSMax's scaling); float positions.
          ValueError: position ranks or batch sizes that do not fit ``batch_size``.
        """
        from jaxpos import _checks
        from jaxpos.mods import apply_mod, convert_mod, is_additive

        fn, N, name = self.score_mod(), self.score_heads, type(self).__name__
        if fn is None:
            raise TypeError(f"{name} has no score term to show as a bias (its positions enter "
                            f"through transform_qk, or not at all).")
        for pname, p in (("q_positions", q_positions), ("kv_positions", kv_positions)):
            _checks.check_integer_positions(pname, p)
            _checks.check_rank(pname, p, (1, 2), "[T] or [B, T]")
        shapes = [_checks.shape_of(q_positions), _checks.shape_of(kv_positions)]
        batches = [s[0] for s in shapes if len(s) == 2] + [self.score_batch]
        B = max(batches) if batch_size is None else _checks.check_positive_int("batch_size",
                                                                                batch_size)
        if any(b not in (1, B) for b in batches):
            raise ValueError(f"{name}.bias: batch sizes must be 1 or batch_size={B}; got "
                             f"positions {shapes[0]}, {shapes[1]} and parameters of batch "
                             f"{self.score_batch}.")
        Tq, Tk = shapes[0][-1], shapes[1][-1]
        qp = _checks.positions_2d("q_positions", q_positions, B, Tq)
        kp = _checks.positions_2d("kv_positions", kv_positions, B, Tk)
        conv = convert_mod(fn, "score", Tq, Tk)
        if not is_additive(conv):
            raise TypeError(f"{name}'s score_mod is not an added term (it depends on the "
                            f"score), so it has no bias array.")
        if N is None:
            raise TypeError(f"{name}.bias needs the number of heads of its score term: "
                            f"define the score_heads property.")
        return apply_mod(conv, qp, kp, score=jnp.zeros((B, N, Tq, Tk), jnp.float32))

    def for_call(self, *, causal: bool, mask: Any = None, mask_mod: Any = None,
                 kv_lengths: Any = None) -> PositionScheme:
        """The scheme as a call with this visibility needs it (the default: itself).

        A scheme whose term depends on what each query sees (SSMax's number of keys) takes
        the call's ``mask`` (dense), ``mask_mod`` (from :mod:`jaxpos.mods`, or a block
        mask's) and ``kv_lengths`` (int32 ``[B]``) here, once per call, and returns the
        scheme that accounts for them.

        Raises:
          ValueError: visibility the scheme cannot account for (naming what to change).
        """
        return self

    def content_bias(self, qs: jax.Array, q_positions: ArrayLike,
                     kv_positions: ArrayLike) -> jax.Array | None:
        """A score term that depends on the scaled queries ``qs`` ``[B, N, tq, H]``
        (float32): an array broadcastable to ``[B, N, tq, tk]``, or ``None``."""
        return

    def value_term(self, p: jax.Array, q_positions: ArrayLike,
                   kv_positions: ArrayLike) -> jax.Array | None:
        """A term added to the output, linear in the weights ``p`` ``[B, N, tq, tk]``:
        float32 ``[B, N, tq, H_v]``, or ``None``."""
        return

    @property
    def has_content_bias(self) -> bool:
        return type(self).content_bias is not PositionScheme.content_bias

    @property
    def has_value_term(self) -> bool:
        return type(self).value_term is not PositionScheme.value_term

    @property
    def fusable(self) -> bool:
        """True when the fused kernel can run the scheme (no content bias, no value term)."""
        return not (self.has_content_bias or self.has_value_term)

    # ---- for the Flax modules (jaxpos.nnx, jaxpos.linen) --------------------------
    #: True when each layer owns its parameters (Shaw et al. 2018, §3.1); False when one
    #: set is shared by every layer of a stack (T5's table, Raffel et al. 2020, §2.1).
    params_per_layer: bool = False

    #: The logical axis names (:mod:`jaxpos.sharding`) of :meth:`init_params`'s arrays, by
    #: parameter name, e.g. T5's ``{"table": ("position_rows", "heads")}``; a parameter
    #: missing here has unnamed (replicated) axes.
    param_axes: dict[str, tuple[str | None, ...]] = {}

    @classmethod
    def init_params(cls, key: jax.Array, *, num_heads: int, head_dim: int, d_model: int,
                    causal: bool, param_dtype: Any, options: dict) -> dict:
        """Initial values of the scheme's learned parameters, ``{name: array}`` (``{}``
        for none). ``options``: the module's scheme options (``rotary_dim``, ``rope_base``,
        ``num_buckets``, ``max_distance``, ... ; None where unset)."""
        return {}

    @classmethod
    def from_params(cls, params: dict, *, num_heads: int, head_dim: int, causal: bool,
                    options: dict, x: jax.Array | None = None,
                    positions: jax.Array | None = None) -> PositionScheme:
        """The scheme for one call of a module holding ``params`` (from
        :meth:`init_params`). ``x`` ``[B, T, D]`` and ``positions`` ``[B|1, T]`` are the
        layer's input, for schemes computed from the tokens (FoX's forget gates)."""
        raise NotImplementedError(f"{cls.__name__} cannot be built by the Flax modules.")

    def cache_write(self, q: jax.Array, k: jax.Array,
                    positions: ArrayLike) -> tuple[jax.Array, jax.Array, PositionScheme]:
        """KV-cache rule: ``(q, k, scheme_for_reading)``.

        The default stores keys as given and lets the cached attention apply the whole
        scheme at read time (positions travel with the cache). A scheme whose transform
        depends on the length of the call that wrote a key (dynamic NTK, LongRoPE)
        transforms at write time and returns a scheme without that transform.
        """
        return q, k, self

    @classmethod
    def init_decode_state(cls, batch: int, slots: int, *, num_heads: int, head_dim: int,
                          options: dict) -> Any:
        """The empty per-layer state a scheme's KV-cache decoding keeps besides the keys
        and values (a pytree of arrays with a leading batch axis), or None (the default:
        the cache alone suffices). A scheme returning state registers the writer that
        updates it (:func:`jaxpos.layers.cache.scheme_state.register_state_writer`); the
        modules' ``init_cache`` wraps each layer's cache with it. PaTH keeps its
        convolution's last inputs (:meth:`jaxpos.schemes.path.PaTH.init_decode_state`).

        Args:
          batch: rows; slots: slots per row of the cache (``Cache.slots_per_row``);
          num_heads, head_dim: the layer's; options: the scheme's options.
        """
        return None

    def load_tables(self, q_positions: ArrayLike, kv_positions: ArrayLike,
                    seq_len: ArrayLike | None = None) -> Any | None:
        """What the scheme needs where attention loads q and k, for keys stored raw:
        cos/sin tables (:class:`jaxpos.schemes.rope.tables.RopeTables`) that rotate
        unrotated q and k as the engines load them, or ``None`` (the default: the scheme
        has no on-load form and runs through :func:`jaxpos.attention`'s ``position``).

        A caller that gets tables passes them as ``rope_tables=`` with ``position=NoPE()``.
        RoPE has them (exact dynamic NTK with ``cache_rotation="read"``; a StreamingLLM cache
        whose key positions are its slots, Xiao et al. 2024, §3.2).

        Args:
          q_positions: int ``[B|1, Tq]``; kv_positions: int ``[B|1, Tk]`` or ``[Tk]``.
          seq_len: int scalar (may be traced) for a length-dependent transform, or None.
        """
        return None

    @property
    def rotates_on_load(self) -> bool:
        """True when :meth:`load_tables` gives tables: a cache of raw keys is read with
        them rather than with the scheme's per-token transform."""
        return type(self).load_tables is not PositionScheme.load_tables

    #: True for a scheme that brings its own attention in place of softmax attention
    #: (stick-breaking): the Flax modules call :meth:`attention`, not :func:`jaxpos.attention`.
    replaces_softmax: bool = False

    #: True for a scheme computed along the token axis in the tokens' order (FoX's
    #: cumulative forget gates; PaTH's causal convolution), which a reordered layout such as
    #: the zigzag of context parallelism would change: the modules refuse that layout.
    reads_token_order: bool = False

    def attention(self, q: jax.Array, k: jax.Array, v: jax.Array, **kwargs: Any) -> jax.Array:
        """The attention of a ``replaces_softmax`` scheme: the function its engine registered
        under the scheme's name (:func:`register_attention`), called as ``fn(self, q, k, v,
        **kwargs)`` with :func:`jaxpos.attention`'s keywords.

        Raises:
          TypeError: the scheme replaces nothing, or no attention is registered for it.
        """
        fn = ATTENTIONS.get(self.registry_name or "")
        if not self.replaces_softmax or fn is None:
            raise TypeError(f"{type(self).__name__} has no attention of its own (it is applied "
                            f"inside jaxpos.attention); registered: {sorted(ATTENTIONS)}.")
        return fn(self, q, k, v, **kwargs)


@register("nope")
class NoPE(PositionScheme):
    """No position information (Haviv et al. 2022; Kazemnejad et al. 2023). A causal mask
    alone lets a decoder infer position; an unmasked encoder is permutation-equivariant."""

    def __init__(self):
        pass

    @classmethod
    def from_params(cls, params: dict, **_: Any) -> PositionScheme:
        return cls()


def as_scheme(position: Any) -> PositionScheme:
    """``None`` / ``"none"`` / ``"nope"`` -> :class:`NoPE`; a scheme passes through.

    Raises:
      TypeError: anything else.
    """
    if position is None or (isinstance(position, str) and position.lower() in ("none", "nope")):
        return NoPE()
    if isinstance(position, PositionScheme):
        return position
    raise TypeError(
        f"position must be a scheme object (NoPE(), RoPE(...), ALiBi(...), T5Bias(...), "
        f"Shaw(...), ...; registered: {sorted(REGISTRY)}) or None/'none'; got "
        f"{type(position).__name__} {position!r}."
    )
