"""Reusable property assertions for attention layers and position schemes.

These are the checks the jaxpos test suite runs on its own attention core, packaged
so that users can run them on their own models. Each one raises ``AssertionError``
(through :mod:`chex`) with the largest deviation when the property fails, and returns
``None`` when it holds.

* :func:`assert_permutation_equivariant`: ``f(x[:, perm]) == f(x)[:, perm]``. Attention
  with no position information and no mask is permutation-equivariant over the
  sequence axis (Vaswani et al. 2017, §3.5: "since our model contains no recurrence
  and no convolution ... we must inject some information about the relative or
  absolute position"); a causal mask breaks it (Haviv et al. 2022).
* :func:`assert_translation_invariant`: ``f(q_pos + c, kv_pos + c) == f(q_pos, kv_pos)``.
  Relative schemes make scores depend on ``kv_pos - q_pos`` only: RoPE (Su et al.
  2024, §3.4.2, Eq. 16), ALiBi (Press et al. 2022, §3), T5 (Raffel et al. 2020,
  §2.1), Shaw et al. 2018 (§3.2).
* :func:`assert_equal_under_jit` and :func:`assert_equal_under_vmap`: a function
  gives the same values traced under :func:`jax.jit` and batched with
  :func:`jax.vmap` as it does eagerly and one example at a time.
* :func:`attention_scores`: the pre-softmax scores ``[B, N, Tq, Tk]`` of
  :func:`jaxpos.attention` (rotation, scale and bias), for score-level checks.

Example::

    import jaxpos, jaxpos.testing as jt
    rope = jaxpos.RoPE(rotary_dim=64)
    scores = lambda qp, kp: jt.attention_scores(q, k, position=rope, q_positions=qp,
                                                kv_positions=kp)
    jt.assert_translation_invariant(scores, jnp.arange(T), jnp.arange(T), shift=1000,
                                    atol=1e-4)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxpos import _checks

if TYPE_CHECKING:
    from jaxpos.schemes.base import PositionScheme

__all__ = [
    "assert_equal_under_jit",
    "assert_equal_under_vmap",
    "assert_permutation_equivariant",
    "assert_translation_invariant",
    "attention_scores",
]


def _check_fn(fn):
    if not callable(fn):
        raise TypeError(f"fn must be callable; got {type(fn).__name__} {fn!r}.")


def _check_tol(atol, rtol):
    for name, val in (("atol", atol), ("rtol", rtol)):
        if isinstance(val, bool) or not isinstance(val, (int, float)) or val < 0:
            raise ValueError(f"{name} must be a non-negative number; got {val!r}.")


def assert_permutation_equivariant(
    fn: Callable[..., Any],
    *args: Any,
    perm: Sequence[int] | np.ndarray | None = None,
    seed: int = 0,
    axis: int = 1,
    atol: float = 1e-5,
    rtol: float = 1e-5,
) -> None:
    """Assert ``fn(*[permute(a) for a in args]) == permute(fn(*args))``.

    Every array in ``args`` is permuted along ``axis`` (the sequence axis, 1 for the
    ``[B, T, ...]`` layout) by the same permutation, and so is every leaf of ``fn``'s
    output (a pytree of arrays whose ``axis`` has the same length ``T``).

    Args:
      fn: a function of the arrays in ``args``, e.g.
        ``lambda x: jaxpos.attention(x, x, x)`` or a Flax module's ``__call__``.
      *args: arrays with a common length ``T`` along ``axis``.
      perm: a permutation of ``range(T)``; by default a random one from ``seed`` that
        is not the identity (when ``T > 1``).
      seed: NumPy seed for the default permutation.
      axis: the sequence axis of the inputs and outputs.
      atol, rtol: float tolerances (``|a - b| <= atol + rtol * |b|``).

    Raises:
      AssertionError: the property does not hold (with the largest deviation).
      ValueError: no arrays, an ``axis`` outside an argument's rank, arrays that disagree
        on ``T``, a ``perm`` that is not a permutation of ``range(T)``, negative tolerances.
      TypeError: ``fn`` not callable.
    """
    _check_fn(fn)
    _check_tol(atol, rtol)
    if not args:
        raise ValueError("assert_permutation_equivariant needs at least one array argument; "
                         "got none.")
    for a in args:
        if not -np.ndim(a) <= axis < np.ndim(a):
            raise ValueError(f"axis must index every argument; got axis={axis} for an argument of "
                             f"shape {np.shape(a)} (rank {np.ndim(a)}).")
    lengths = {np.shape(a)[axis] for a in args}
    if len(lengths) != 1:
        raise ValueError(f"every argument must have the same length along axis {axis}; got "
                         f"shapes {[np.shape(a) for a in args]}.")
    (T,) = lengths
    if perm is None:
        rng = np.random.default_rng(seed)
        perm = rng.permutation(T)
        while T > 1 and np.array_equal(perm, np.arange(T)):
            perm = rng.permutation(T)
    perm = np.asarray(perm)
    if perm.shape != (T,) or not np.array_equal(np.sort(perm), np.arange(T)):
        raise ValueError(f"perm must be a permutation of range({T}); got {perm.tolist()}.")
    permute = lambda x: jnp.take(jnp.asarray(x), jnp.asarray(perm), axis=axis)
    expected = jax.tree_util.tree_map(permute, fn(*args))
    got = fn(*[permute(a) for a in args])
    chex.assert_trees_all_close(got, expected, atol=atol, rtol=rtol,
                                custom_message=f"not permutation-equivariant under {perm.tolist()}")


def assert_translation_invariant(
    fn: Callable[[Any, Any], Any],
    q_positions: Any,
    kv_positions: Any,
    *,
    shift: int = 1000,
    atol: float = 1e-5,
    rtol: float = 1e-5,
) -> None:
    """Assert ``fn(q_positions + shift, kv_positions + shift) == fn(q_positions, kv_positions)``.

    The property of relative position schemes: shifting every position by the same
    integer changes nothing, because scores depend on ``kv_pos - q_pos`` only. ``fn``
    may return scores (see :func:`attention_scores`) or attention outputs.

    RoPE rotates by ``pos * inv_freq`` in float32, so a shift of 1000 perturbs the
    angles by about ``1000 * 2**-24`` rad per unit of ``inv_freq``: scores of unit-scale
    vectors move by about 1e-4. Choose ``atol`` accordingly.

    Args:
      fn: ``fn(q_positions, kv_positions)`` -> a pytree of arrays.
      q_positions, kv_positions: integer arrays (``[T]`` or ``[B, T]``).
      shift: the integer added to every position (may be negative).
      atol, rtol: float tolerances.

    Raises:
      AssertionError: the outputs differ beyond the tolerance.
      TypeError: float positions or a non-integer ``shift``.
      ValueError: negative tolerances.
      TypeError: ``fn`` not callable.
    """
    _check_fn(fn)
    _check_tol(atol, rtol)
    _checks.check_integer_positions("q_positions", q_positions)
    _checks.check_integer_positions("kv_positions", kv_positions)
    if isinstance(shift, bool) or not isinstance(shift, (int, np.integer)):
        raise TypeError(f"shift must be a Python int; got {type(shift).__name__} {shift!r}.")
    qp, kp = jnp.asarray(q_positions), jnp.asarray(kv_positions)
    base = fn(qp, kp)
    moved = fn(qp + shift, kp + shift)
    chex.assert_trees_all_close(moved, base, atol=atol, rtol=rtol,
                                custom_message=f"not invariant under a shift of all positions "
                                               f"by {shift}")


def assert_equal_under_jit(
    fn: Callable[..., Any],
    *args: Any,
    static_argnums: int | Sequence[int] = (),
    atol: float = 1e-6,
    rtol: float = 1e-6,
    **kwargs: Any,
) -> None:
    """Assert ``jax.jit(fn)(*args, **kwargs) == fn(*args, **kwargs)``.

    Keyword arguments are closed over (so they may be Python values such as
    ``causal=True``); positional ones are traced unless listed in ``static_argnums``.

    Raises:
      AssertionError: the traced and eager results differ (or their structures do).
      TypeError: ``fn`` not callable.
      ValueError: negative tolerances.
    """
    _check_fn(fn)
    _check_tol(atol, rtol)
    eager = fn(*args, **kwargs)
    jitted = jax.jit(lambda *a: fn(*a, **kwargs), static_argnums=static_argnums)(*args)
    chex.assert_trees_all_close(jitted, eager, atol=atol, rtol=rtol,
                                custom_message="jit(fn) differs from fn")


def assert_equal_under_vmap(
    fn: Callable[..., Any],
    *args: Any,
    in_axes: int | Sequence[int | None] = 0,
    jit: bool = True,
    atol: float = 1e-6,
    rtol: float = 1e-6,
    **kwargs: Any,
) -> None:
    """Assert ``jax.vmap(fn, in_axes)(*args)[i] == fn(*args at index i)`` for every ``i``.

    Args:
      fn: the per-example function (e.g. attention on one ``[1, T, N, H]`` example, or
        a model's forward pass); keyword arguments are closed over.
      *args: arrays (or pytrees) with a mapped axis as ``in_axes`` says.
      in_axes: as in :func:`jax.vmap`; ``None`` entries are passed unchanged.
      jit: compile both sides with :func:`jax.jit` (one compilation for all the
        per-example calls, so the check isolates ``vmap``); ``False`` runs them eagerly.

    Raises:
      AssertionError: the batched and per-example results differ.
      ValueError: the mapped axes disagree in size, or nothing is mapped; negative
        tolerances.
      TypeError: ``fn`` not callable.
    """
    _check_fn(fn)
    _check_tol(atol, rtol)
    axes = (in_axes,) * len(args) if isinstance(in_axes, int) or in_axes is None else tuple(in_axes)
    if len(axes) != len(args):
        raise ValueError(f"in_axes must have one entry per argument ({len(args)}); "
                         f"got {in_axes!r}.")
    sizes = {leaf.shape[ax] for a, ax in zip(args, axes) if ax is not None
             for leaf in jax.tree_util.tree_leaves(a)}
    if len(sizes) != 1:
        raise ValueError(f"the mapped axes must exist and agree in size; got sizes {sorted(sizes)} "
                         f"for in_axes={in_axes!r}.")
    (n,) = sizes
    f = lambda *a: fn(*a, **kwargs)
    batched_f = jax.vmap(f, in_axes=axes)
    if jit:
        f, batched_f = jax.jit(f), jax.jit(batched_f)
    batched = batched_f(*args)

    def index(a, ax, i):
        if ax is None:
            return a
        return jax.tree_util.tree_map(lambda x: jnp.take(x, i, axis=ax), a)

    singles = [f(*[index(a, ax, i) for a, ax in zip(args, axes)]) for i in range(n)]
    stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *singles)
    chex.assert_trees_all_close(batched, stacked, atol=atol, rtol=rtol,
                                custom_message="vmap(fn) differs from fn applied per example")


def attention_scores(q: jax.Array, k: jax.Array, *,
                     position: PositionScheme | Literal["none", "nope"] | None = None,
                     q_positions: ArrayLike | None = None,
                     kv_positions: ArrayLike | None = None,
                     scale: ArrayLike | None = None) -> jax.Array:
    """Pre-softmax scores of :func:`jaxpos.attention`: ``scale * rot(q) . rot(k) + bias``.

    The same code path as the ``"reference"`` implementation (the scheme's
    ``transform_qk``, ``score_mod`` and ``content_bias``), before masking and softmax.
    Shaw's value term, which acts on the output, is not part of the scores.

    Args:
      q: ``[B, Tq, N, H]``; k: ``[B, Tk, N_kv, H]`` (``N`` a multiple of ``N_kv``).
      position, q_positions, kv_positions, scale: as in :func:`jaxpos.attention`.

    Returns:
      float32 ``[B, N, Tq, Tk]``.

    Raises:
      ValueError / TypeError: as :func:`jaxpos.attention` for bad shapes, dtypes or
        positions.
    """
    from jaxpos.core.call import check_attention_inputs, decode_positions
    from jaxpos.core.reference import make_terms, tile_scores
    from jaxpos.schemes.base import as_scheme

    check_attention_inputs(q, k, k)
    (B, Tq, N, H), (Tk, Nk) = q.shape, k.shape[1:3]
    scheme = as_scheme(position)
    scheme.check(N, H)
    dq, dk = decode_positions(Tq, Tk)
    qp = _checks.positions_2d("q_positions", dq if q_positions is None else q_positions, B, Tq)
    kp = _checks.positions_2d("kv_positions", dk if kv_positions is None else kv_positions, B, Tk)
    q, k = scheme.transform_qk(q, k, qp, kp)
    scale = 1.0 / math.sqrt(H) if scale is None else scale
    qs = jnp.swapaxes(q.astype(jnp.float32), 1, 2) * jnp.float32(scale)
    kk = jnp.repeat(jnp.swapaxes(k.astype(jnp.float32), 1, 2), N // Nk, axis=1)
    terms = make_terms(scheme, scheme.score_mod(), None, Tq, Tk)
    return tile_scores(terms, qs, kk, qp, kp)
