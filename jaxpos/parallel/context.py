"""Context parallelism a model switches on: attention of global arrays, sequence-parallel
over one axis of the mesh set with ``jax.set_mesh``.

:func:`context_attention` is what the Flax modules call when they are built with
``context_parallel="ring" | "ulysses"``: it takes the whole (global) q, k, v, positions
and segment ids of a layer, as ``jaxpos.attention`` does, and runs
:func:`jaxpos.parallel.ring_attention` or :func:`jaxpos.parallel.ulysses_attention`
inside ``jax.shard_map`` over the mesh axis ``axis`` (manual over that axis only: the
other axes of the mesh, e.g. a data axis, stay with the compiler), the sequence sharded
over it and the positions global. With the zigzag layout (:func:`zigzag_order`) the
model keeps its tokens in zigzag order from the embedding to the logits, so that every
device of a causal ring has the same work (Brandon et al. 2023, "Striped Attention";
the layout of Megatron-LM's context parallelism).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpos import _checks
from jaxpos.core import engines
from jaxpos.parallel.ring import ring_attention, zigzag_permutation
from jaxpos.parallel.ulysses import ulysses_attention
from jaxpos.schemes.base import as_scheme

__all__ = ["CONTEXT_PARALLEL", "check_context_parallel", "check_zigzag", "context_attention",
           "layer_attention",
           "mesh_axis_size",
           "zigzag_order"]

#: The values of the modules' ``context_parallel=`` option (``None``: off).
CONTEXT_PARALLEL = ("ring", "ulysses")
_METHODS: dict[str, Callable[..., jax.Array]] = {"ring": ring_attention,
                                                 "ulysses": ulysses_attention}


def check_context_parallel(context_parallel: Any, context_axis: Any) -> str | None:
    """The checked ``context_parallel`` option of a module (``None`` when off).

    Raises:
      ValueError: ``context_parallel`` not one of ``"ring"``, ``"ulysses"``, ``None``.
      TypeError: ``context_axis`` not a str.
    """
    _checks.check_choice("context_parallel", context_parallel, CONTEXT_PARALLEL + (None,))
    if not isinstance(context_axis, str):
        raise TypeError(f"context_axis must be the name (a str) of the mesh axis to shard the "
                        f"sequence over; got {type(context_axis).__name__} {context_axis!r}.")
    return context_parallel


def mesh_axis_size(axis: str, what: str = "context_parallel") -> int:
    """The size of ``axis`` in the mesh set with ``jax.set_mesh``.

    Raises:
      ValueError: no mesh is set, or it has no axis ``axis``.
    """
    mesh = jax.sharding.get_abstract_mesh()
    names = tuple(getattr(mesh, "axis_names", ()) or ())
    if not names:
        raise ValueError(
            f"{what} needs a device mesh: call the model under `with jax.set_mesh(mesh):` "
            f"with a mesh that has the axis {axis!r} (e.g. jax.make_mesh(({len(jax.devices())},"
            f"), ({axis!r},))).")
    if axis not in names:
        raise ValueError(f"context_axis={axis!r} is not an axis of the mesh set with "
                         f"jax.set_mesh (its axes: {list(names)}).")
    return int(dict(zip(names, mesh.axis_sizes))[axis])


def zigzag_order(T: int, axis: str) -> np.ndarray:
    """The zigzag order of ``T`` tokens over the ``axis`` of the current mesh
    (:func:`jaxpos.parallel.zigzag_permutation`): ``x_zigzag = x[:, order]``, and the
    zigzag-ordered positions are ``order`` itself.

    Raises:
      ValueError: no mesh; ``T`` not divisible by twice the axis size.
    """
    return zigzag_permutation(T, mesh_axis_size(axis, "the zigzag layout"))


def _positions_2d(pos, B, T):
    pos = jnp.asarray(pos, jnp.int32)
    return jnp.broadcast_to(pos.reshape((1,) * (2 - pos.ndim) + pos.shape), (B, T)) \
        if pos.ndim < 2 or pos.shape[0] != B else pos


def context_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, method: str, axis: str,
                      q_positions: jax.Array, kv_positions: jax.Array,
                      segment_ids: jax.Array | None = None,
                      kv_segment_ids: jax.Array | None = None, position: Any = None,
                      sinks: jax.Array | None = None, **kw: Any) -> jax.Array:
    """``jaxpos.attention(q, k, v, ...)`` of global arrays, computed sequence-parallel by
    ``method`` (``"ring"`` or ``"ulysses"``) over the mesh axis ``axis`` of the mesh set
    with ``jax.set_mesh`` (``jax.shard_map`` manual over ``axis`` only).

    Args:
      q: ``[B, Tq, N, H]``; k, v: ``[B, Tk, N_kv, H]`` (global); ``Tq`` and ``Tk``
        divisible by the axis size (Ulysses: ``N`` too).
      method: ``"ring"`` or ``"ulysses"``. axis: the mesh axis.
      q_positions, kv_positions: integer ``[T]`` or ``[B, T]``, global positions (in the
        order of the tokens: zigzag positions for a zigzag layout).
      segment_ids, kv_segment_ids, position, sinks, **kw: as :func:`jaxpos.attention`
        (``causal``, ``score_mod``, ``mask_mod``, ``scale``, ``implementation``, ...).

    Returns:
      ``[B, Tq, N, H_v]`` like ``jaxpos.attention``.

    Raises:
      ValueError: no mesh or no such axis; lengths not divisible by the axis size (naming
        them and what to pad to); every error of the method.
    """
    size = mesh_axis_size(axis)
    position = as_scheme(position)
    B, Tq, Tk = q.shape[0], q.shape[1], k.shape[1]
    for name, t in (("query", Tq), ("key/value", Tk)):
        if t % size:
            raise ValueError(
                f"context_parallel={method!r} shards the sequence over the {size} devices of "
                f"mesh axis {axis!r}: the {name} length {t} is not divisible by {size}. Pad "
                f"the sequence to a multiple of {size} (with attention_mask for the padding).")
    seq = P(None, axis)
    args = [q, k, v, _positions_2d(q_positions, B, Tq), _positions_2d(kv_positions, B, Tk)]
    has_seg = segment_ids is not None
    if has_seg:
        args += [jnp.asarray(segment_ids, jnp.int32),
                 jnp.asarray(segment_ids if kv_segment_ids is None else kv_segment_ids,
                             jnp.int32)]
    fn = _METHODS[method]

    def local(position, sinks, q, k, v, qp, kp, *segs):
        seg = dict(zip(("segment_ids", "kv_segment_ids"), segs))
        return fn(q, k, v, axis_name=axis, position=position, sinks=sinks, q_positions=qp,
                  kv_positions=kp, **seg, **kw)

    rep = lambda tree: jax.tree_util.tree_map(lambda _: P(), tree)
    vma = jax.default_backend() != "cpu" or bool(engines.capability(
        kw.get("implementation"), "varying_types_on_cpu", True))
    sm = jax.shard_map(local, in_specs=(rep(position), rep(sinks)) + (seq,) * len(args),
                       out_specs=seq, axis_names=frozenset({axis}), check_vma=vma)
    args = [_sequence_sharded(x, axis) for x in args]
    return sm(position, sinks, *args)


def _sequence_sharded(x: jax.Array, axis: str) -> jax.Array:
    """``x`` with its sequence (axis 1) sharded over the mesh axis ``axis`` when that axis
    is Explicit (``jax.make_mesh``'s default): ``shard_map`` then takes only inputs whose
    type matches its ``in_specs``; the other dimensions keep their sharding. Under Auto
    axes ``x`` is returned as it is (the compiler places it)."""
    mesh = jax.sharding.get_abstract_mesh()
    types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ()) or ()))
    if "explicit" not in str(getattr(types.get(axis), "name", types.get(axis))).lower():
        return x
    spec = list(jax.typeof(x).sharding.spec) + [None] * x.ndim
    spec = spec[:x.ndim]
    if spec[1] == axis:
        return x
    spec[1] = axis
    return jax.sharding.reshard(x, P(*spec))


def layer_attention(method: str, axis: str, q: jax.Array, k: jax.Array, v: jax.Array, *,
                    softmax: bool = True, mask: Any = None, dropout_rate: float = 0.0,
                    **kw: Any) -> jax.Array:
    """A Flax layer's attention with ``context_parallel=method`` (:func:`context_attention`),
    refusing, with what to do instead, what sequence parallelism cannot take.

    Args:
      method, axis: the layer's ``context_parallel`` and ``context_axis``.
      q, k, v: the layer's global ``[B, T, N, H]`` projections.
      softmax: False for a scheme that replaces softmax attention (stick-breaking).
      mask: the call's dense boolean mask (refused when given).
      dropout_rate: attention dropout (refused when > 0).
      **kw: the rest of :func:`jaxpos.attention`'s keywords the layer passes.

    Returns:
      ``[B, T, N, H_v]``.

    Raises:
      ValueError: a dense ``mask``, attention dropout, a scheme that replaces softmax, no
        mesh set, lengths not divisible by the axis size.
    """
    what = f"context_parallel={method!r}"
    if not softmax:
        raise ValueError(f"{what} runs softmax attention (ring or Ulysses); this layer's "
                         f"scheme replaces softmax attention. Build the model with "
                         f"context_parallel=None.")
    if mask is not None:
        raise ValueError(f"{what} does not take a dense boolean mask (it indexes global rows "
                         f"and columns); express it as a mask_mod of positions, segment_ids "
                         f"or attention_mask, or build the layer with context_parallel=None.")
    if dropout_rate:
        raise ValueError(f"{what} has no attention dropout (dropout_rate={dropout_rate}); "
                         f"call the model with deterministic=True, or use residual dropout "
                         f"only (attention_dropout_rate=0).")
    kw.pop("dropout_rng", None)
    return context_attention(q, k, v, method=method, axis=axis, **kw)


def check_zigzag(context_zigzag: Any, context_parallel: str | None) -> bool:
    """The checked ``context_zigzag`` flag of a stack.

    Raises:
      TypeError: not a bool. ValueError: True without ``context_parallel``.
    """
    if not isinstance(context_zigzag, (bool, np.bool_)):
        raise TypeError(f"context_zigzag must be a bool; got {type(context_zigzag).__name__} "
                        f"{context_zigzag!r}.")
    if context_zigzag and context_parallel is None:
        raise ValueError("context_zigzag=True lays the tokens out for a sequence-parallel "
                         "model; give context_parallel='ring' (or 'ulysses') too.")
    return bool(context_zigzag)
