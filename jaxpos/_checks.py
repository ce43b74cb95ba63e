"""Input validation shared by every public function.

Every check runs at trace time on static information (shapes, dtypes, Python
values) and raises ``ValueError`` or ``TypeError`` naming the argument, what it
got and what was expected.
"""

from __future__ import annotations

from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np


def shape_of(x: Any) -> tuple[int, ...]:
    return tuple(np.shape(x))


def dtype_of(x: Any):
    if hasattr(x, "dtype"):
        return np.dtype(x.dtype) if not isinstance(x.dtype, np.dtype) else x.dtype
    return np.asarray(x).dtype


def check_rank(name: str, x: Any, ranks: Iterable[int], what: str) -> None:
    ranks = tuple(ranks)
    r = len(shape_of(x))
    if r not in ranks:
        expected = " or ".join(str(k) for k in ranks)
        raise ValueError(
            f"{name} must have rank {expected} ({what}); got shape {shape_of(x)} (rank {r})."
        )


def check_integer_positions(name: str, positions: Any) -> None:
    dt = dtype_of(positions)
    if not (jnp.issubdtype(dt, jnp.integer) or dt == np.bool_):
        raise TypeError(
            f"{name} must hold integer positions; got dtype {dt}. "
            f"Cast with .astype(jnp.int32) if the values are whole numbers."
        )
    if dt == np.bool_:
        raise TypeError(f"{name} must hold integer positions; got dtype bool.")


def check_floating(name: str, x: Any) -> None:
    dt = dtype_of(x)
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array; got dtype {dt}.")


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> None:
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}; got {value!r}.")


def check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a Python int; got {type(value).__name__} {value!r}.")
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer; got {value}.")
    return int(value)


def check_nonneg_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a Python int; got {type(value).__name__} {value!r}.")
    if value < 0:
        raise ValueError(f"{name} must be a non-negative integer; got {value}.")
    return int(value)


def positions_2d(name: str, positions: Any, batch: int, seq: int) -> jax.Array:
    """Validate ``positions`` ([seq] or [batch, seq], integer) and return int32 [batch|1, seq]."""
    check_integer_positions(name, positions)
    shp = shape_of(positions)
    if len(shp) == 1:
        if shp[0] != seq:
            raise ValueError(
                f"{name} must have shape [{seq}] or [{batch}, {seq}] to match the sequence "
                f"length {seq}; got shape {shp}."
            )
        return jnp.asarray(positions, jnp.int32)[None, :]
    if len(shp) == 2:
        if shp[1] != seq or shp[0] not in (1, batch):
            raise ValueError(
                f"{name} must have shape [{seq}] or [{batch}, {seq}] to match batch {batch} and "
                f"sequence length {seq}; got shape {shp}."
            )
        return jnp.asarray(positions, jnp.int32)
    raise ValueError(
        f"{name} must have shape [{seq}] or [{batch}, {seq}]; got shape {shp} (rank {len(shp)})."
    )


def is_concrete(x: Any) -> bool:
    """True when ``x`` holds known values (NumPy, Python, or a non-traced jax.Array)."""
    return not isinstance(x, jax.core.Tracer)
