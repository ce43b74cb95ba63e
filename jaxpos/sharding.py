"""Logical axis names of the modules' parameters and activations, and the one rules table
that maps them to mesh axes.

Every parameter of :mod:`jaxpos.nnx` and :mod:`jaxpos.linen` names its axes with the
logical names below (NNX: the Variable's ``out_sharding`` metadata, as
:func:`flax.nnx.with_partitioning` sets it, so :func:`flax.nnx.get_partition_spec` and
:func:`flax.nnx.get_named_sharding` read it; Linen: :class:`flax.linen.LogicallyPartitioned`
boxes, as :func:`flax.linen.with_logical_partitioning` makes them, read by
:func:`flax.linen.get_partition_spec`; ``nn.unbox`` gives the arrays). The modules
constrain their activations (``batch``, ``seq``, ``heads``, ...) only under a mesh
(``jax.set_mesh``); without one the constraints are not traced at all.

==================  ==============================================  ====================
logical name        axis of                                         mesh axes (default)
==================  ==============================================  ====================
``batch``           activations' batch                              ``("data", "fsdp")``
``seq``             activations' sequence (context parallelism)     ``"seq"``
``vocab``           token embedding rows, logits                    ``"tensor"``
``embed``           the model width of every weight (FSDP)          ``"fsdp"``
``heads``           query heads (projections, per-head tables)      ``"tensor"``
``kv_heads``        key/value heads                                 ``"tensor"``
``mlp``             the MLP's hidden width                          ``"tensor"``
``head_dim``        one head's features (q/k norms, Shaw, CoPE)     replicated
``norm``            RMSNorm scales over the model width             replicated
``position_rows``   rows of position tables (T5 buckets, Shaw's     replicated
                    offsets, learned absolute positions, CoPE)
``rank``            small inner widths (FIRE's MLP, PaTH's rank)    replicated
``taps``            PaTH's convolution taps                         replicated
==================  ==============================================  ====================

This is :data:`DEFAULT_RULES`, the ``(logical name, mesh axes)`` pairs of Flax's
``logical_axis_rules``. A mesh axis the current mesh lacks is skipped (a ``(2, 4)`` mesh
``("data", "tensor")`` shards ``batch`` over ``data`` only), as is one whose size does not
divide the dimension; a mesh axis serves one dimension of an array at most (the first in
the table's order, as in Flax). The user overrides the table with Flax's context
(``with flax.linen.logical_axis_rules(rules):``, the same context as
``flax.nnx.logical_axis_rules``) or with the ``rules=`` argument of the functions here;
a name missing from the rules in force is replicated.

Placing parameters: :func:`named_shardings` gives the :class:`jax.sharding.NamedSharding`
of every array of an NNX state, module or Linen (boxed) tree on a mesh, and
:func:`place` puts them there (``jax.device_put``). ``with
flax.linen.logical_axis_rules(jaxpos.sharding.rules_for(mesh)):`` makes Flax's own
``nnx.get_named_sharding(state, mesh)`` give the same shardings.

Under a mesh with Explicit axes (``jax.make_mesh``'s default in JAX 0.10), the full pass
of a module runs its body with those axes Auto (:func:`jax.sharding.auto_axes`), so the
compiler partitions every operation from the parameters' and inputs' shardings, and
returns its output sharded by the rules (``batch``, ``seq``); attention inside is
partitioned by its engine (:mod:`jaxpos.core.partition`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax.core import spmd as flax_spmd
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "DEFAULT_RULES",
    "LOGICAL_NAMES",
    "active_rules",
    "constrain",
    "linen_init",
    "logical_spec",
    "named_shardings",
    "nnx_init",
    "nnx_param",
    "param_axes",
    "place",
    "retype",
    "rules_for",
    "run_auto",
    "scheme_param_axes",
]

#: The logical names the modules use, and the mesh axes each maps to by default (see the
#: module docstring's table). Order matters: a mesh axis goes to the first name that asks
#: for it.
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("seq", "seq"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("embed", "fsdp"),
    ("head_dim", None),
    ("norm", None),
    ("position_rows", None),
    ("rank", None),
    ("taps", None),
)

#: Every logical name of :data:`DEFAULT_RULES`.
LOGICAL_NAMES: tuple[str, ...] = tuple(name for name, _ in DEFAULT_RULES)


def nnx_init(init: Callable[..., Any], axes: Sequence[str | None]) -> Callable[..., Any]:
    """``init`` whose :class:`flax.nnx.Param` carries the logical ``axes``
    (:func:`flax.nnx.with_partitioning`; Flax's eager sharding off: the values are those of
    ``init``, placed where the caller puts them)."""
    from flax import nnx

    return nnx.with_partitioning(init, tuple(axes), eager_sharding=False)


def nnx_param(value: Any, axes: Sequence[str | None]) -> Any:
    """An :class:`flax.nnx.Param` of ``value`` with the logical ``axes``."""
    from flax import nnx

    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


def linen_init(init: Callable[..., Any], axes: Sequence[str | None]) -> Callable[..., Any]:
    """``init`` returning a :class:`flax.linen.LogicallyPartitioned` box with the logical
    ``axes`` (:func:`flax.linen.with_logical_partitioning`)."""
    from flax import linen as nn

    return nn.with_logical_partitioning(init, tuple(axes))


def scheme_param_axes(scheme_cls: Any, name: str, ndim: int) -> tuple[str | None, ...]:
    """The logical axes of a scheme's parameter ``name`` (its class's ``param_axes``), or
    ``ndim`` Nones (replicated) for one it does not name.

    Raises:
      ValueError: declared names of another rank than the parameter's.
    """
    axes = tuple(getattr(scheme_cls, "param_axes", {}).get(name, (None,) * ndim))
    if len(axes) != ndim:
        raise ValueError(f"{scheme_cls.__name__}.param_axes[{name!r}] = {axes} names "
                         f"{len(axes)} axes; the parameter has {ndim}.")
    return axes


def _check_rules(rules: Any) -> tuple[tuple[str, Any], ...]:
    if not isinstance(rules, (tuple, list)) or not all(
            isinstance(r, (tuple, list)) and len(r) == 2 and isinstance(r[0], str)
            for r in rules):
        raise TypeError(f"rules must be a sequence of (logical name, mesh axes) pairs; got "
                        f"{rules!r}.")
    return tuple((str(a), b) for a, b in rules)


def active_rules(rules: Sequence[tuple[str, Any]] | None = None) -> tuple[tuple[str, Any], ...]:
    """The rules in force: ``rules`` when given, else those of Flax's
    ``logical_axis_rules`` context when one is set, else :data:`DEFAULT_RULES`.

    Raises:
      TypeError: ``rules`` not a sequence of ``(str, mesh axes)`` pairs.
    """
    if rules is not None:
        return _check_rules(rules)
    context = flax_spmd.get_logical_axis_rules()
    return _check_rules(context) if context else DEFAULT_RULES


def _current_mesh() -> Any:
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty else mesh


def _axis_sizes(mesh: Any, usable: Callable[[Any], bool]) -> dict[str, int]:
    return {name: size for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes,
                                                   mesh.axis_types) if usable(kind)}


def logical_spec(names: Sequence[str | None], mesh: Any = None, *,
                 rules: Sequence[tuple[str, Any]] | None = None,
                 shape: Sequence[int] | None = None,
                 usable: Callable[[Any], bool] = lambda kind: kind != AxisType.Manual) -> P:
    """The :class:`jax.sharding.PartitionSpec` of an array whose axes have the logical
    ``names`` (None: replicated), on ``mesh`` (a :class:`jax.sharding.Mesh` or
    ``AbstractMesh``; default the current one, ``jax.set_mesh``; no mesh gives ``P()``)
    under the rules in force (:func:`active_rules`).

    A mesh axis absent from the mesh (or Manual there, inside ``shard_map``) is skipped,
    as is one whose size does not divide that dimension of ``shape`` (when given); a mesh
    axis goes to one dimension at most, the first whose rule comes first.

    Raises:
      ValueError: ``shape`` of another rank than ``names``.
    """
    names = tuple(names)
    if shape is not None and len(shape) != len(names):
        raise ValueError(f"shape {tuple(shape)} must have one entry per logical name "
                         f"{names}.")
    mesh = _current_mesh() if mesh is None else mesh
    if mesh is None:
        return P()
    sizes = _axis_sizes(mesh, usable)
    out: list[Any] = [None] * len(names)
    used: set[str] = set()
    for logical, axes in active_rules(rules):
        if logical not in names or axes is None:
            continue
        i = names.index(logical)
        if out[i] is not None:
            continue
        wanted = (axes,) if isinstance(axes, str) else tuple(axes)
        kept = []
        for a in wanted:
            if a in sizes and a not in used and (shape is None or shape[i] % math.prod(
                    sizes[b] for b in (*kept, a)) == 0):
                kept.append(a)
        if kept:
            used.update(kept)
            out[i] = kept[0] if len(kept) == 1 else tuple(kept)
    return P(*out)


def rules_for(mesh: Any, rules: Sequence[tuple[str, Any]] | None = None
              ) -> tuple[tuple[str, Any], ...]:
    """The rules in force (:func:`active_rules`) restricted to ``mesh``'s axes: a mesh axis
    the mesh lacks is dropped from every rule (a rule left with none maps to None), for
    Flax's ``logical_axis_rules`` context, under which ``nnx.get_partition_spec`` and
    ``nnx.get_named_sharding`` then give the shardings of :func:`named_shardings` (except
    the divisibility check, which needs the shapes)."""
    present = set(mesh.axis_names)
    out = []
    for logical, axes in active_rules(rules):
        wanted = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        kept = tuple(a for a in wanted if a in present)
        out.append((logical, None if not kept else kept[0] if len(kept) == 1 else kept))
    return tuple(out)


def param_axes(variable: Any) -> tuple | None:
    """The logical names of a parameter: an :class:`flax.nnx.Variable`'s ``out_sharding``
    metadata or a :class:`flax.linen.LogicallyPartitioned` box's ``names``; None for a
    plain array (no names)."""
    from flax import linen as nn
    from flax import nnx

    if isinstance(variable, nnx.Variable):
        names = variable.get_metadata().get("out_sharding")
        return None if names is None else tuple(names)
    if isinstance(variable, nn.Partitioned):
        return tuple(variable.names)
    return None


def _is_box(x: Any) -> bool:
    from flax import linen as nn
    from flax import nnx

    return isinstance(x, (nnx.Variable, nn.Partitioned))


def named_shardings(tree: Any, mesh: jax.sharding.Mesh, *,
                    rules: Sequence[tuple[str, Any]] | None = None) -> Any:
    """The :class:`jax.sharding.NamedSharding` on ``mesh`` of every parameter of ``tree``
    (an :class:`flax.nnx.State`, an NNX module's state, a Linen params tree of
    ``LogicallyPartitioned`` boxes), from its logical names and the rules
    (:func:`logical_spec`, with the array's shape); a plain array is replicated. The
    result has ``tree``'s structure with the arrays' places (NNX Variables or Linen boxes)
    holding the shardings, ready for ``jax.device_put`` or ``jax.jit``'s shardings."""
    from flax import nnx

    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree)

    def one(x):
        value = x.get_value() if isinstance(x, nnx.Variable) else getattr(x, "value", x)
        names = param_axes(x)
        spec = P() if names is None else logical_spec(names, mesh, rules=rules,
                                                      shape=np.shape(value))
        sharding = NamedSharding(mesh, spec)
        if isinstance(x, nnx.Variable):
            return x.replace(sharding)
        return x.replace_boxed(sharding) if _is_box(x) else sharding

    return jax.tree.map(one, tree, is_leaf=_is_box)


def place(tree: Any, mesh: jax.sharding.Mesh, *,
          rules: Sequence[tuple[str, Any]] | None = None) -> Any:
    """``tree`` (as :func:`named_shardings` takes it; an NNX module's state is taken with
    ``nnx.state``) with every array put on ``mesh`` by its logical names
    (``jax.device_put``). For an NNX module, ``nnx.update(model, place(model, mesh))``
    moves it."""
    from flax import nnx

    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree)
    return jax.device_put(tree, named_shardings(tree, mesh, rules=rules))


def constrain(x: jax.Array, names: Sequence[str | None], *,
              rules: Sequence[tuple[str, Any]] | None = None) -> jax.Array:
    """``x`` constrained to the sharding of its logical axis ``names`` on the current mesh
    (``jax.lax.with_sharding_constraint`` over the mesh's Auto axes; a dimension whose
    name maps to no axis of the mesh stays unconstrained); ``x`` itself,
    untouched and with nothing traced, without a mesh or when no Auto axis applies. Under
    Explicit axes the modules run with those axes Auto (:func:`run_auto`)."""
    mesh = _current_mesh()
    if mesh is None:
        return x
    spec = logical_spec(names, mesh, rules=rules, shape=np.shape(x),
                        usable=lambda kind: kind == AxisType.Auto)
    if all(s is None for s in spec):
        return x
    free = P.UNCONSTRAINED  # a dimension no rule shards is left to the compiler
    spec = P(*(free if s is None else s for s in spec))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def _explicit_axes(mesh: Any) -> tuple[str, ...]:
    return tuple(n for n, kind in zip(mesh.axis_names, mesh.axis_types)
                 if kind == AxisType.Explicit)


def retype(x: Any) -> Any:
    """An array made by the caller under Explicit axes, read inside :func:`run_auto`
    (where those axes are Auto): re-typed for the current mesh (``jax.sharding.reshard``,
    which moves no data; its gradient flows back). Anything else is returned as it is.
    The modules read every parameter through it."""
    mesh = _current_mesh()
    if mesh is None or not hasattr(x, "shape"):
        return x
    try:
        aval_mesh = jax.typeof(x).sharding.mesh
    except (AttributeError, TypeError):
        return x
    if aval_mesh.empty or aval_mesh == mesh or not _explicit_axes(aval_mesh):
        return x
    auto = {n for n, kind in zip(mesh.axis_names, mesh.axis_types) if kind == AxisType.Auto}
    spec = jax.typeof(x).sharding.spec

    def keep(entry):
        if entry is None:
            return None
        axes = (entry,) if isinstance(entry, str) else tuple(entry)
        kept = tuple(a for a in axes if a not in auto)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return jax.sharding.reshard(x, P(*(keep(e) for e in spec)))


def run_auto(fn: Callable[[Any], Any], inputs: Any, out_names: Sequence[str | None],
             out_shape: Sequence[int], *,
             rules: Sequence[tuple[str, Any]] | None = None) -> Any:
    """``fn(inputs)``; under a mesh with Explicit axes, run with those axes Auto
    (:func:`jax.sharding.auto_axes`): the JAX arrays among ``inputs``' leaves (a pytree:
    the call's arrays, None where absent) re-typed for it, and the one array output, of
    shape ``out_shape``, resharded to the logical ``out_names`` over those axes. Arrays
    the body reads from elsewhere (parameters) go through :func:`retype`. The modules'
    full passes run through it, so the compiler partitions them from the parameters' and
    inputs' shardings."""
    mesh = _current_mesh()
    explicit = () if mesh is None else _explicit_axes(mesh)
    if not explicit:
        return fn(inputs)
    leaves, treedef = jax.tree.flatten(inputs)
    is_array = [isinstance(leaf, jax.Array) for leaf in leaves]
    arrays = [leaf for leaf, a in zip(leaves, is_array) if a]

    def body(arrays):
        it = iter(arrays)
        return fn(jax.tree.unflatten(treedef, [next(it) if flag else leaf
                                               for leaf, flag in zip(leaves, is_array)]))

    spec = logical_spec(out_names, mesh, rules=rules, shape=tuple(out_shape),
                        usable=lambda kind: kind == AxisType.Explicit)
    return jax.sharding.auto_axes(body, axes=explicit, out_sharding=spec)(arrays)
