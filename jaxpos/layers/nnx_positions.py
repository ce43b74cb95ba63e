"""The NNX position modules of :mod:`jaxpos.nnx` (exported there): absolute
positions (:class:`SinusoidalEmbedding`, :class:`LearnedPositionalEmbedding`) and the
attention-position module of any registered scheme (:class:`PositionModule`) with its
classic forms (:class:`RotaryEmbedding`, :class:`ALiBi`, :class:`T5RelativeBias`,
:class:`ShawRelativePosition`). Their computations are the ``*Core`` classes of
:mod:`jaxpos.layers.cores`, shared with the Linen twins.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike, DTypeLike

from jaxpos import _checks
from jaxpos.layers.cores import LearnedCore, PositionCore, SinusoidalCore
from jaxpos.layers.functional import learned_table_init
from jaxpos.layers.options import (
    attention_positions,
    check_module_dims,
    check_options_read,
    check_position_name,
    freeze_options,
    has_params,
    init_scheme_params,
)
from jaxpos.schemes.alibi import alibi_bias
from jaxpos.schemes.base import REGISTRY, PositionScheme
from jaxpos.schemes.rope import apply_rope, check_rotary_dim
from jaxpos.schemes.t5 import check_bucket_args, t5_bias
from jaxpos.sharding import nnx_param, retype, scheme_param_axes

if TYPE_CHECKING:
    from jaxpos.schemes.alibi import ALiBi as ALiBiScheme
    from jaxpos.schemes.rope import RoPE as RoPEScheme

__all__ = [
    "ALiBi",
    "LearnedPositionalEmbedding",
    "PositionModule",
    "RotaryEmbedding",
    "ShawRelativePosition",
    "SinusoidalEmbedding",
    "T5RelativeBias",
    "make_position_module",
]


# ================================================================== position modules

class SinusoidalEmbedding(SinusoidalCore, nnx.Module):
    """Sinusoidal absolute positions (Vaswani et al. 2017, §3.5), computed from the
    positions at every call: the table is **not** a parameter (the module has no state)
    and has no length limit.

    Args:
      d_model: width of the vectors.
      base: wavelength base (10000).
      layout: ``"interleaved"`` (the paper) or ``"concat"`` (tensor2tensor).
      dtype: output dtype (angles in float32).

    Call: ``positions`` int ``[T]`` or ``[B, T]`` -> ``[T, d_model]`` / ``[B, T, d_model]``.
    Raises ``TypeError`` for float positions, ``ValueError`` for bad ``d_model``/``layout``.
    """

    def __init__(self, d_model: int, *, base: float = 10000.0, layout: str = "interleaved",
                 dtype: DTypeLike = jnp.float32):
        self.d_model = _checks.check_positive_int("d_model", d_model)
        _checks.check_choice("layout", layout, ("interleaved", "concat"))
        self.base, self.layout, self.dtype = float(base), layout, dtype

class LearnedPositionalEmbedding(LearnedCore, nnx.Module):
    """Learned absolute positions (Gehring et al. 2017; GPT-2, BERT): a trained table
    ``[max_len, d_model]`` whose row ``t`` is added at position ``t``.

    Args:
      max_len: number of rows; there is no row for position ``max_len``.
      d_model: width.
      out_of_range: ``"error"`` (default: concrete positions outside the table and any
        sequence longer than ``max_len`` raise ``ValueError``; traced positions outside
        give NaN rows), ``"wrap"`` or ``"clip"`` (see :func:`jaxpos.learned_positions`).
      embedding_init: initialiser, default ``N(0, 1/2)`` (the sinusoidal table's variance).
      rngs: :class:`flax.nnx.Rngs` (uses the ``params`` stream).

    Call: ``positions`` int ``[T]`` or ``[B, T]`` -> ``[..., T, d_model]`` (param dtype).
    """

    def __init__(self, max_len: int, d_model: int, *, out_of_range: str = "error",
                 embedding_init: Callable[..., Any] | None = None,
                 param_dtype: DTypeLike = jnp.float32, rngs: nnx.Rngs):
        max_len = _checks.check_positive_int("max_len", max_len)
        d_model = _checks.check_positive_int("d_model", d_model)
        _checks.check_choice("out_of_range", out_of_range, ("error", "wrap", "clip"))
        init = embedding_init or learned_table_init()
        self.table = nnx_param(init(rngs.params(), (max_len, d_model), param_dtype),
                               ("position_rows", "embed"))
        self.max_len, self.d_model, self.out_of_range = max_len, d_model, out_of_range

class PositionModule(PositionCore, nnx.Module):
    """The attention-position module of any registered scheme: holds the scheme's learned
    parameters (``init_params``) as :class:`flax.nnx.Param` attributes of the same names
    (``table`` for T5, ``rel_k``/``rel_v`` for Shaw, ...) and builds the scheme for each
    call with ``from_params`` (:meth:`scheme`).

    Args:
      position: a registered name (:func:`attention_positions`; ``"none"`` = ``"nope"``).
      num_heads, head_dim: the attention layer's query heads and head width (None where
        the scheme does not need them). d_model: model width (initialisers use it).
      causal: the layer is causal (T5 then uses causal buckets, ALiBi ``m (kv - q)``).
      options: the scheme's options, a dict (``rotary_dim``, ``rope_base``,
        ``rope_layout``, ``rope_scaling`` (the default for every call), ``num_buckets``,
        ``max_distance``, or a new scheme's own; None where unset).
      param_init: an initialiser ``(key, shape, dtype)`` replacing the scheme's for every
        parameter; default: the scheme's ``init_params``.
      param_dtype: parameter dtype. rngs: :class:`flax.nnx.Rngs` (``params`` stream),
        required when the scheme has parameters.

    The scheme is built once at construction (with a one-token input) so that bad
    options raise here, not at the first call.

    Raises:
      ValueError: unknown name, a registered scheme without ``from_params``, a scheme
        with parameters and no ``rngs``, options the scheme rejects (its own message).
      TypeError: non-int sizes, ``options`` not a dict.
    """

    def __init__(self, position: str, *, num_heads: int | None = None,
                 head_dim: int | None = None, d_model: int | None = None,
                 causal: bool = False, options: dict | None = None,
                 param_init: Callable[..., Any] | None = None,
                 param_dtype: DTypeLike = jnp.float32, rngs: nnx.Rngs | None = None):
        name = check_position_name("position", position, attention_positions())
        check_module_dims(num_heads, head_dim, d_model)
        frozen = freeze_options(options)
        self.position_name, self.num_heads, self.head_dim = name, num_heads, head_dim
        self.d_model, self.causal, self.options = d_model, bool(causal), frozen
        cls = REGISTRY[name]
        params = {}
        if has_params(cls):
            if rngs is None:
                raise ValueError(f"position={name!r} ({cls.__name__}) has learned parameters; "
                                 f"pass rngs=nnx.Rngs(...).")
            params = init_scheme_params(name, rngs.params(), num_heads=num_heads,
                                        head_dim=head_dim, d_model=d_model, causal=self.causal,
                                        options=frozen, param_dtype=param_dtype)
            if param_init is not None:
                params = {n: param_init(rngs.params(), v.shape, v.dtype)
                          for n, v in params.items()}
        for n, v in params.items():
            if hasattr(self, n):
                raise ValueError(f"{cls.__name__}.init_params returned a parameter named "
                                 f"{n!r}, which is an attribute of PositionModule; rename it.")
            setattr(self, n, nnx_param(v, scheme_param_axes(cls, n, v.ndim)))
        self.param_names = tuple(params)
        self._validate(param_dtype)

    def _spec(self):
        return (self.position_name, self.num_heads, self.head_dim, self.causal, self.options)

    def _scheme_params(self):
        return {n: retype(getattr(self, n)[...]) for n in self.param_names}

    def _validate(self, dtype: DTypeLike):
        x = None if self.d_model is None else jnp.zeros((1, 1, self.d_model), dtype)
        scheme = self.scheme(x=x, positions=jnp.zeros((1, 1), jnp.int32))
        check_options_read(self.position_name, self.options, self._scheme_params(),
                           num_heads=self.num_heads, head_dim=self.head_dim,
                           d_model=self.d_model, causal=self.causal, x=x, dtype=dtype)
        scheme.check_causal(self.causal)
        if self.num_heads is not None and self.head_dim is not None:
            scheme.check(self.num_heads, self.head_dim)


class RotaryEmbedding(PositionModule):
    """Rotary position embedding (Su et al. 2024, §3.4); no parameters. The
    :class:`PositionModule` of ``"rope"``.

    Args:
      rotary_dim: rotated features per head (even); the rest pass through.
      base: ``rope_theta``.
      layout: ``"half"`` (Llama/NeoX) or ``"interleaved"`` (GPT-J/RoFormer).
      scaling: default context-extension dataclass (:mod:`jaxpos.schemes.rope.scaling`) or None.

    ``scheme(scaling=...)`` returns the :class:`jaxpos.RoPE` scheme for attention; calling
    the module rotates one tensor: ``x [B, T, N, H]``, ``positions [T] | [B, T]`` -> ``x``'s
    shape and dtype.
    """

    def __init__(self, rotary_dim: int, *, base: float = 10000.0, layout: str = "half",
                 scaling: Any = None):
        rotary_dim = check_rotary_dim(rotary_dim)
        _checks.check_choice("layout", layout, ("half", "interleaved"))
        base = _checks.check_positive_float("base", base)
        self.rotary_dim, self.base, self.layout, self.scaling = rotary_dim, base, layout, scaling
        super().__init__("rope", head_dim=rotary_dim, options={
            "rotary_dim": rotary_dim, "rope_base": base, "rope_layout": layout,
            "rope_scaling": scaling})

    def scheme(self, scaling: Any = None, *, x: jax.Array | None = None,
               positions: ArrayLike | None = None) -> PositionScheme:
        """The RoPE scheme, with ``scaling`` (this call) or the module's default."""
        return super().scheme(scaling, x=x, positions=positions)

    def __call__(self, x: jax.Array, positions: ArrayLike, *, scaling: Any = None) -> jax.Array:
        s = cast("RoPEScheme", self.scheme(scaling))
        pos = _checks.positions_2d("positions", positions, x.shape[0], x.shape[1])
        inv_freq, af = s.frequencies(pos, pos)
        return apply_rope(x, pos, inv_freq, layout=self.layout, attention_factor=af)


class ALiBi(PositionModule):
    """ALiBi (Press et al. 2022, §3): fixed per-head slopes, a linear score bias; no
    parameters. The :class:`PositionModule` of ``"alibi"``.

    Args:
      num_heads: query heads (slopes by :func:`jaxpos.alibi_slopes`).
      bidirectional: ``-m |kv - q|`` (encoders) instead of the causal ``m (kv - q)``.

    ``scheme()`` returns :class:`jaxpos.ALiBi`; calling the module returns the bias
    float32 ``[N, Tq, Tk]`` (``[B, N, Tq, Tk]`` for batched positions).
    """

    def __init__(self, num_heads: int, *, bidirectional: bool = False):
        num_heads = _checks.check_positive_int("num_heads", num_heads)
        self.bidirectional = bool(bidirectional)
        super().__init__("alibi", num_heads=num_heads, causal=not self.bidirectional)

    def __call__(self, q_positions: ArrayLike, kv_positions: ArrayLike) -> jax.Array:
        return alibi_bias(q_positions, kv_positions, cast("ALiBiScheme", self.scheme()).slopes,
                          bidirectional=self.bidirectional)


class T5RelativeBias(PositionModule):
    """T5 bucketed relative bias (Raffel et al. 2020, §2.1): one learned scalar per
    (bucket, head), one table shared by every layer of a stack. The
    :class:`PositionModule` of ``"t5"``.

    Args:
      num_heads: query heads.
      num_buckets, max_distance: 32 and 128 as in T5.
      bidirectional: True for encoders, False for causal decoders.
      d_model: model width, for the default initialiser ``N(0, 1/d_model)`` (Hugging
        Face's T5 initialisation; ``N(0, 1/num_heads)`` when not given).
      embedding_init: another initialiser.
      rngs: :class:`flax.nnx.Rngs`.

    Parameter ``table`` float ``[num_buckets, num_heads]`` (the T5 checkpoint layout).
    ``scheme()`` returns :class:`jaxpos.T5Bias`; calling the module returns the bias
    float32 ``[N, Tq, Tk]``.
    """

    def __init__(self, num_heads: int, *, num_buckets: int = 32, max_distance: int = 128,
                 bidirectional: bool = True, d_model: int | None = None,
                 embedding_init: Callable[..., Any] | None = None,
                 param_dtype: DTypeLike = jnp.float32, rngs: nnx.Rngs):
        num_heads = _checks.check_positive_int("num_heads", num_heads)
        check_bucket_args(num_buckets, max_distance, bidirectional)
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.bidirectional = bool(bidirectional)
        super().__init__("t5", num_heads=num_heads, d_model=d_model or num_heads,
                         causal=not self.bidirectional,
                         options={"num_buckets": num_buckets, "max_distance": max_distance},
                         param_init=embedding_init, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, q_positions: ArrayLike, kv_positions: ArrayLike) -> jax.Array:
        return t5_bias(q_positions, kv_positions, self.table[...], bidirectional=self.bidirectional,
                       num_buckets=self.num_buckets, max_distance=self.max_distance)


class ShawRelativePosition(PositionModule):
    """Relative keys and values of Shaw et al. 2018, §3: ``2K + 1`` learned vectors of head
    width per table, for clipped offsets ``clip(kv - q, -K, K)``, shared by the heads. The
    :class:`PositionModule` of ``"shaw"``.

    Args:
      head_dim: width of each vector.
      max_distance: the clipping distance ``K`` (the paper finds ``K >= 2`` enough).
      values: also learn the value table ``rel_v`` (the paper's full form).
      embedding_init: another initialiser (default Glorot uniform, tensor2tensor's).
      rngs: :class:`flax.nnx.Rngs`.

    Parameters ``rel_k`` (and ``rel_v``, else ``rel_v is None``) float ``[2K + 1,
    head_dim]``; row ``r + K`` is offset ``r``. ``scheme()`` returns :class:`jaxpos.Shaw`.
    """

    def __init__(self, head_dim: int, *, max_distance: int = 16, values: bool = True,
                 embedding_init: Callable[..., Any] | None = None,
                 param_dtype: DTypeLike = jnp.float32, rngs: nnx.Rngs):
        head_dim = _checks.check_positive_int("head_dim", head_dim)
        K = _checks.check_positive_int("max_distance", max_distance)
        self.max_distance = K
        super().__init__("shaw", head_dim=head_dim,
                         options={"max_distance": K, "values": bool(values)},
                         param_init=embedding_init, param_dtype=param_dtype, rngs=rngs)
        if "rel_v" not in self.param_names:
            self.rel_v = None


def make_position_module(position: Any, *, num_heads: int | None, head_dim: int | None,
                         d_model: int | None, causal: bool, options: Any,
                         param_dtype: DTypeLike,
                         rngs: nnx.Rngs | None) -> PositionModule | None:
    """The attention-position module of a layer: a :class:`PositionModule` for a name
    (``"nope"`` included), a module passed in as it is (shared by reference), None for
    None."""
    if position is None or isinstance(position, PositionModule):
        return position
    name = check_position_name("position", position, attention_positions())
    return PositionModule(name, num_heads=num_heads, head_dim=head_dim, d_model=d_model,
                          causal=causal, options=options, param_dtype=param_dtype, rngs=rngs)
