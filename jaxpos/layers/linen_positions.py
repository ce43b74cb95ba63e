"""The Linen position modules of :mod:`jaxpos.linen` (exported there), twins of
:mod:`jaxpos.layers.nnx_positions`: absolute positions (:class:`SinusoidalEmbedding`,
:class:`LearnedPositionalEmbedding`) and the attention-position module of any registered
scheme (:class:`PositionModule`) with its classic forms (:class:`RotaryEmbedding`,
:class:`ALiBi`, :class:`T5RelativeBias`, :class:`ShawRelativePosition`). Their
computations are the ``*Core`` classes of :mod:`jaxpos.layers.cores`; their parameters
have the NNX modules' names.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos.layers.cores import (
    LearnedCore,
    PositionCore,
    SinusoidalCore,
)
from jaxpos.layers.functional import (
    learned_table_init,
)
from jaxpos.layers.options import (
    attention_positions,
    check_module_dims,
    check_position_name,
    collect_options,
    freeze_options,
    has_params,
    init_scheme_params,
)
from jaxpos.schemes.alibi import alibi_bias
from jaxpos.schemes.base import REGISTRY, PositionScheme
from jaxpos.schemes.rope import apply_rope, check_rotary_dim
from jaxpos.schemes.t5 import check_bucket_args, t5_bias
from jaxpos.sharding import linen_init, retype, scheme_param_axes

if TYPE_CHECKING:
    from jaxpos.schemes.alibi import ALiBi as ALiBiScheme
    from jaxpos.schemes.rope import RoPE as RoPEScheme

__all__ = ["ALiBi", "LearnedPositionalEmbedding", "PositionModule", "RotaryEmbedding",
           "ShawRelativePosition", "SinusoidalEmbedding", "T5RelativeBias",
           "make_position_module"]

Dtype = Any


class SinusoidalEmbedding(SinusoidalCore, nn.Module):
    """Linen twin of :class:`jaxpos.nnx.SinusoidalEmbedding` (Vaswani et al. 2017, §3.5):
    no parameters; ``positions [T] | [B, T]`` -> ``[..., T, d_model]``."""

    d_model: int
    base: float = 10000.0
    layout: str = "interleaved"
    dtype: Dtype = jnp.float32

    def __call__(self, positions: ArrayLike) -> jax.Array:
        _checks.check_positive_int("d_model", self.d_model)
        _checks.check_choice("layout", self.layout, ("interleaved", "concat"))
        return SinusoidalCore.__call__(self, positions)


class LearnedPositionalEmbedding(LearnedCore, nn.Module):
    """Linen twin of :class:`jaxpos.nnx.LearnedPositionalEmbedding`: parameter ``table
    [max_len, d_model]``; ``positions`` -> rows; out-of-range policy ``out_of_range``."""

    max_len: int
    d_model: int
    out_of_range: str = "error"
    embedding_init: Callable | None = None
    param_dtype: Dtype = jnp.float32

    def setup(self) -> None:
        _checks.check_positive_int("max_len", self.max_len)
        _checks.check_positive_int("d_model", self.d_model)
        _checks.check_choice("out_of_range", self.out_of_range, ("error", "wrap", "clip"))
        self.table = self.param("table", linen_init(
            self.embedding_init or learned_table_init(), ("position_rows", "embed")),
            (self.max_len, self.d_model), self.param_dtype)

    __call__ = LearnedCore.__call__


class _PositionBase(PositionCore, nn.Module):
    """Parameter declarations of a Linen position module: one ``self.param`` per entry of
    the scheme's ``init_params`` (same names as the NNX module's). Subclasses give
    ``_spec()`` (as :class:`jaxpos.nnx.PositionCore`) and ``_init_spec()`` ->
    ``(d_model, param_init, param_dtype)``."""

    def setup(self) -> None:
        position, num_heads, head_dim, causal, options = self._spec()
        d_model, param_init, param_dtype = self._init_spec()
        check_module_dims(num_heads, head_dim, d_model)
        names = ()
        if has_params(REGISTRY[position]):
            init = functools.partial(init_scheme_params, position, num_heads=num_heads,
                                     head_dim=head_dim, d_model=d_model, causal=causal,
                                     options=options, param_dtype=param_dtype)
            shapes = jax.eval_shape(init, jax.random.key(0))
            for n, sd in shapes.items():
                if param_init is None:
                    fn = lambda key, n=n: init(key)[n]
                else:
                    fn = lambda key, sd=sd: param_init(key, sd.shape, sd.dtype)
                axes = scheme_param_axes(REGISTRY[position], n, len(sd.shape))
                setattr(self, n, self.param(n, linen_init(fn, axes)))
            names = tuple(shapes)
        self._param_names = names

    def _scheme_params(self):
        return {n: retype(getattr(self, n)) for n in self._param_names}

    scheme = PositionCore.scheme


class PositionModule(_PositionBase):
    """Linen twin of :class:`jaxpos.nnx.PositionModule`: the attention-position module of
    any registered scheme (fields as the NNX arguments; ``options`` a dict or the tuple of
    :func:`jaxpos.nnx.collect_options`). Parameters: the scheme's ``init_params``, same
    names. ``scheme(rope_scaling=None, *, x=None, positions=None)`` -> the scheme."""

    position: str
    num_heads: int | None = None
    head_dim: int | None = None
    d_model: int | None = None
    causal: bool = False
    options: Any = None
    param_init: Callable | None = None
    param_dtype: Dtype = jnp.float32

    def _spec(self):
        name = check_position_name("position", self.position, attention_positions())
        return name, self.num_heads, self.head_dim, bool(self.causal), freeze_options(
            self.options)

    def _init_spec(self):
        return self.d_model, self.param_init, self.param_dtype

    def __call__(self, rope_scaling: Any = None, *, x: jax.Array | None = None,
                 positions: ArrayLike | None = None) -> PositionScheme:
        return self.scheme(rope_scaling, x=x, positions=positions)


class RotaryEmbedding(_PositionBase):
    """Linen twin of :class:`jaxpos.nnx.RotaryEmbedding` (Su et al. 2024, §3.4): no
    parameters; ``scheme(scaling)`` -> :class:`jaxpos.RoPE`; call rotates ``x [B, T, N, H]``."""

    rotary_dim: int
    base: float = 10000.0
    layout: str = "half"
    scaling: Any = None

    def setup(self) -> None:
        check_rotary_dim(self.rotary_dim)
        _checks.check_choice("layout", self.layout, ("half", "interleaved"))
        _checks.check_positive_float("base", self.base)
        super().setup()

    def _spec(self):
        return "rope", None, self.rotary_dim, False, collect_options(
            rotary_dim=self.rotary_dim, rope_base=self.base,
            scheme_options={"rope_layout": self.layout, "rope_scaling": self.scaling})

    def _init_spec(self):
        return None, None, jnp.float32

    def scheme(self, scaling: Any = None, *, x: jax.Array | None = None,
               positions: ArrayLike | None = None) -> PositionScheme:
        """The RoPE scheme, with ``scaling`` (this call) or the module's default."""
        return PositionCore.scheme(self, scaling, x=x, positions=positions)

    def __call__(self, x: jax.Array, positions: ArrayLike, *, scaling: Any = None) -> jax.Array:
        s = cast("RoPEScheme", self.scheme(scaling))
        pos = _checks.positions_2d("positions", positions, x.shape[0], x.shape[1])
        inv_freq, af = s.frequencies(pos, pos)
        return apply_rope(x, pos, inv_freq, layout=self.layout, attention_factor=af)


class ALiBi(_PositionBase):
    """Linen twin of :class:`jaxpos.nnx.ALiBi` (Press et al. 2022, §3): no parameters;
    ``scheme()`` -> :class:`jaxpos.ALiBi`; call -> bias float32 ``[N, Tq, Tk]``."""

    num_heads: int
    bidirectional: bool = False

    def _spec(self):
        return "alibi", self.num_heads, None, not self.bidirectional, ()

    def _init_spec(self):
        return None, None, jnp.float32

    def __call__(self, q_positions: ArrayLike, kv_positions: ArrayLike) -> jax.Array:
        return alibi_bias(q_positions, kv_positions, cast("ALiBiScheme", self.scheme()).slopes,
                          bidirectional=self.bidirectional)


class T5RelativeBias(_PositionBase):
    """Linen twin of :class:`jaxpos.nnx.T5RelativeBias` (Raffel et al. 2020, §2.1):
    parameter ``table [num_buckets, num_heads]``; ``scheme()`` -> :class:`jaxpos.T5Bias`;
    call -> bias float32 ``[N, Tq, Tk]``. Define it once in a stack to share it."""

    num_heads: int
    num_buckets: int = 32
    max_distance: int = 128
    bidirectional: bool = True
    d_model: int | None = None
    embedding_init: Callable | None = None
    param_dtype: Dtype = jnp.float32

    def setup(self) -> None:
        _checks.check_positive_int("num_heads", self.num_heads)
        check_bucket_args(self.num_buckets, self.max_distance, self.bidirectional)
        super().setup()

    def _spec(self):
        return "t5", self.num_heads, None, not self.bidirectional, collect_options(
            num_buckets=self.num_buckets, max_distance=self.max_distance)

    def _init_spec(self):
        return self.d_model or self.num_heads, self.embedding_init, self.param_dtype

    def __call__(self, q_positions: ArrayLike, kv_positions: ArrayLike) -> jax.Array:
        return t5_bias(q_positions, kv_positions, self.table, bidirectional=self.bidirectional,
                       num_buckets=self.num_buckets, max_distance=self.max_distance)


class ShawRelativePosition(_PositionBase):
    """Linen twin of :class:`jaxpos.nnx.ShawRelativePosition` (Shaw et al. 2018, §3):
    parameters ``rel_k`` (and ``rel_v`` when ``values``) ``[2 * max_distance + 1,
    head_dim]``; ``scheme()`` (or the call) -> :class:`jaxpos.Shaw`."""

    head_dim: int
    max_distance: int = 16
    values: bool = True
    embedding_init: Callable | None = None
    param_dtype: Dtype = jnp.float32

    def setup(self) -> None:
        _checks.check_positive_int("head_dim", self.head_dim)
        _checks.check_positive_int("max_distance", self.max_distance)
        super().setup()
        if "rel_v" not in self._param_names:
            self.rel_v = None

    def _spec(self):
        return "shaw", None, self.head_dim, False, collect_options(
            max_distance=self.max_distance, scheme_options={"values": bool(self.values)})

    def _init_spec(self):
        return None, self.embedding_init, self.param_dtype

    def __call__(self) -> PositionScheme:
        return self.scheme()


def make_position_module(position: Any, *, param_dtype: Dtype, name: str,
                         **kwargs: Any) -> nn.Module | None:
    """The attention-position module of a layer (declared in the calling module's
    ``setup``): a :class:`PositionModule` named ``name`` for a position name (``"nope"``
    included; ``kwargs`` its fields), a position module passed in as it is (shared by
    reference), None for None.

    Raises:
      ValueError / TypeError: an unknown position name.
    """
    if position is None or isinstance(position, _PositionBase):
        return position
    position = check_position_name("position", position, attention_positions())
    return PositionModule(position, param_dtype=param_dtype, name=name, **kwargs)
