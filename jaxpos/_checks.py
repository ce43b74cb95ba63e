"""Input validation shared by every public function.

Every check runs at trace time on static information (shapes, dtypes, Python
values) and raises ``ValueError`` or ``TypeError`` naming the argument, what it
got and what was expected. Also :func:`relative_offsets`, the validated ``kv - q``
offsets every relative scheme starts from (here so that scheme modules import no other
scheme module).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np


def shape_of(x: Any) -> tuple[int, ...]:
    """The static shape of an array, tracer, NumPy array, list or scalar."""
    return tuple(np.shape(x))


def dtype_of(x: Any) -> Any:
    """The NumPy dtype of ``x`` (JAX arrays and tracers included), without converting it."""
    if hasattr(x, "dtype"):
        return np.dtype(x.dtype) if not isinstance(x.dtype, np.dtype) else x.dtype
    return np.asarray(x).dtype


def check_one_dtype(**arrays: Any) -> None:
    """Raise ``TypeError`` unless the arrays (by name, e.g. ``q=q, k=k, v=v``) share one
    dtype, naming each with its dtype. Attention takes no mixed dtypes, as
    ``jax.nn.dot_product_attention`` takes none: either promotion would change the
    precision the caller chose."""
    dtypes = {name: dtype_of(x) for name, x in arrays.items()}
    if len(set(dtypes.values())) > 1:
        names = list(dtypes)
        got = ", ".join(f"{n} {d}" for n, d in dtypes.items())
        raise TypeError(f"{', '.join(names[:-1])} and {names[-1]} must share a dtype (as in "
                        f"jax.nn.dot_product_attention); got {got}. Cast them first, e.g. "
                        f"{names[1]}.astype({names[0]}.dtype).")


def check_rank(name: str, x: Any, ranks: Iterable[int], what: str) -> None:
    """Raise ``ValueError`` unless ``x`` has one of ``ranks`` (``what`` names the layout)."""
    ranks = tuple(ranks)
    r = len(shape_of(x))
    if r not in ranks:
        expected = " or ".join(str(k) for k in ranks)
        raise ValueError(
            f"{name} must have rank {expected} ({what}); got shape {shape_of(x)} (rank {r})."
        )


def check_integer_positions(name: str, positions: Any) -> None:
    """Raise ``TypeError`` unless ``positions`` has an integer dtype (bool is rejected)."""
    dt = dtype_of(positions)
    if dt == np.bool_ or not jnp.issubdtype(dt, jnp.integer):
        raise TypeError(
            f"{name} must hold integer positions (an integer dtype such as int32); got dtype "
            f"{dt}. Cast with .astype(jnp.int32) if the values are whole numbers."
        )


def check_floating(name: str, x: Any) -> None:
    """Raise ``TypeError`` unless ``x`` has a floating-point dtype."""
    dt = dtype_of(x)
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array (e.g. float32); got dtype {dt}.")


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices`` (layouts, policies)."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}; got {value!r}.")


def check_positive_int(name: str, value: Any) -> int:
    """Return ``value`` as an int; ``TypeError`` if not an int, ``ValueError`` if ``<= 0``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a Python int; got {type(value).__name__} {value!r}.")
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer (>= 1); got {value}.")
    return int(value)


def check_real(name: str, value: Any) -> float:
    """Return ``value`` as a float; ``TypeError`` if not a real number (a string, a bool,
    an array with more than one element)."""
    if isinstance(value, (bool, str, bytes)) or not isinstance(
            value, (int, float, np.integer, np.floating)) and np.ndim(value) != 0:
        raise TypeError(f"{name} must be a real number; got {type(value).__name__} {value!r}.")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number; got {type(value).__name__} "
                        f"{value!r}.") from None


def check_positive_float(name: str, value: Any) -> float:
    """Return ``value`` as a float; ``TypeError`` if not a real number (:func:`check_real`),
    ``ValueError`` if not finite or ``<= 0``. Used for ``base`` (``rope_theta``, the
    sinusoid's 10000) and scaling factors."""
    v = check_real(name, value)
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"{name} must be a finite number > 0; got {value!r}.")
    return v


def check_nonneg_int(name: str, value: Any) -> int:
    """Return ``value`` as an int; ``TypeError`` if not an int, ``ValueError`` if ``< 0``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a Python int; got {type(value).__name__} {value!r}.")
    if value < 0:
        raise ValueError(f"{name} must be a non-negative integer (>= 0); got {value}.")
    return int(value)


def positions_2d(name: str, positions: Any, batch: int, seq: int) -> jax.Array:
    """Validate ``positions`` ([seq] or [batch, seq], integer) and return int32 [batch|1, seq].

    NumPy or Python positions come back as a NumPy array: inside ``jax.jit`` every ``jnp``
    operation on a constant is staged out, and the engines must still see known positions
    as known (e.g. ``is_causal`` for ``arange`` on the XLA path)."""
    check_integer_positions(name, positions)
    check_int32_range(name, positions)
    shp = shape_of(positions)
    if len(shp) == 1:
        if shp[0] != seq:
            raise ValueError(
                f"{name} must have shape [{seq}] or [{batch}, {seq}] to match the sequence "
                f"length {seq}; got shape {shp}."
            )
        return _as_int32(positions)[None, :]
    if len(shp) == 2:
        if shp[1] != seq or shp[0] not in (1, batch):
            raise ValueError(
                f"{name} must have shape [{seq}] or [{batch}, {seq}] to match batch {batch} and "
                f"sequence length {seq}; got shape {shp}."
            )
        return _as_int32(positions)
    raise ValueError(
        f"{name} must have shape [{seq}] or [{batch}, {seq}]; got shape {shp} (rank {len(shp)})."
    )


def _as_int32(positions: Any) -> Any:
    """int32 positions: a NumPy array for NumPy / Python input, else a ``jax.Array``."""
    if isinstance(positions, jax.Array):  # tracers included
        return jnp.asarray(positions, jnp.int32)
    return np.asarray(positions, np.int32)


def is_concrete(x: Any) -> bool:
    """True when ``x`` holds known values (NumPy, Python, or a non-traced jax.Array)."""
    return not isinstance(x, jax.core.Tracer)


def check_int32_range(name: str, x: Any, span: int = 0) -> None:
    """Concrete integer arrays must fit int32 (positions are int32 inside), and so must
    ``x + span`` (an offset followed by ``span`` more positions)."""
    dt = dtype_of(x)
    if not is_concrete(x) or np.iinfo(dt).bits < 32 or (dt == np.int32 and span == 0):
        return
    a = np.asarray(x)
    info = np.iinfo(np.int32)
    if a.size and (int(a.min()) < info.min or int(a.max()) + span > info.max):
        extent = f" + {span} more positions" if span else ""
        raise ValueError(
            f"{name}{extent} must fit in int32 (positions and offsets are int32 inside); got "
            f"values from {a.min()} to {a.max()} (dtype {dt})."
        )


def relative_offsets(q_positions: Any, kv_positions: Any) -> jax.Array:
    """``kv_pos - q_pos`` as int32 ``[Tq, Tk]`` or ``[B, Tq, Tk]`` (T5's memory - context).

    Args:
      q_positions: integer ``[Tq]`` or ``[B|1, Tq]``.
      kv_positions: integer ``[Tk]`` or ``[B|1, Tk]``.

    Returns:
      int32 ``[Tq, Tk]``, or ``[B, Tq, Tk]`` when either input has a batch axis.

    Raises:
      ValueError: batch sizes that differ and are not 1.
    """
    q = jnp.asarray(q_positions, jnp.int32)
    k = jnp.asarray(kv_positions, jnp.int32)
    if q.ndim == 2 and k.ndim == 2 and q.shape[0] != k.shape[0] and 1 not in (q.shape[0],
                                                                              k.shape[0]):
        raise ValueError(
            f"q_positions and kv_positions must have equal batch sizes (or 1); got batch "
            f"sizes {q.shape[0]} and {k.shape[0]} (shapes {q.shape} and {k.shape})."
        )
    return k[..., None, :] - q[..., :, None]


def check_qkv(q: Any, k: Any, v: Any) -> None:
    """q ``[B, Tq, N, H]``, k ``[B, Tk, N_kv, H]``, v ``[B, Tk, N_kv, H_v]``, one floating
    dtype, ``N % N_kv == 0``.

    Raises:
      ValueError: a wrong rank, mismatched shapes, or ``N`` not a multiple of ``N_kv``.
      TypeError: a non-floating dtype, or dtypes that differ.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_rank(name, x, (4,), "[batch, seq, heads, head_dim]")
        check_floating(name, x)
    check_one_dtype(q=q, k=k, v=v)
    (B, Tq, N, H), (Bk, Tk, Nk, Hk), (Bv, Tv, Nv, _) = (shape_of(x) for x in (q, k, v))
    if Bk != B or Bv != B or Hk != H or (Tv, Nv) != (Tk, Nk):
        raise ValueError(f"expected q [B, Tq, N, H], k [B, Tk, N_kv, H], v [B, Tk, N_kv, H_v]; "
                         f"got q {(B, Tq, N, H)}, k {(Bk, Tk, Nk, Hk)}, v {shape_of(v)}.")
    if N % Nk:
        raise ValueError(f"query heads ({N}) must be a multiple of key/value heads ({Nk}); "
                         f"got q {(B, Tq, N, H)}, k {(Bk, Tk, Nk, Hk)}.")


def check_kv_lengths(kv_lengths: Any, B: int, Tk: int) -> jax.Array:
    """``kv_lengths`` (integer ``[B]`` fill lengths: keys at index ``>= kv_lengths[b]`` are
    invisible to row ``b``) as int32 clipped to ``[0, Tk]`` (so that an engine stays in
    bounds; :func:`check_kv_lengths_range` and :func:`kv_lengths_out_of_range` make sure
    no length is clipped silently).

    Raises:
        ValueError: not rank 1, or not ``B`` long.
        TypeError: not an integer dtype.
    """
    check_rank("kv_lengths", kv_lengths, (1,), "[batch]")
    if not jnp.issubdtype(dtype_of(kv_lengths), jnp.integer):
        raise TypeError(f"kv_lengths must be integer [batch] (keys at index >= kv_lengths[b] "
                        f"are invisible); got dtype {dtype_of(kv_lengths)}.")
    if shape_of(kv_lengths)[0] != B:
        raise ValueError(f"kv_lengths must have shape [{B}] (one fill length per batch row); "
                         f"got {shape_of(kv_lengths)}.")
    return jnp.clip(jnp.asarray(kv_lengths, jnp.int32), 0, Tk)


def check_kv_lengths_range(kv_lengths: Any, Tk: int) -> None:
    """Concrete ``kv_lengths`` must lie in ``[0, Tk]``; traced ones cannot raise (see
    :func:`kv_lengths_out_of_range`: the cache-overflow rule, NaN rows).

    Raises:
        ValueError: a concrete length outside ``[0, Tk]``, naming the rows.
    """
    if not is_concrete(kv_lengths):
        return
    lengths = np.asarray(kv_lengths)
    bad = (lengths < 0) | (lengths > Tk)
    if bad.any():
        raise ValueError(f"kv_lengths must lie in [0, Tk] = [0, {Tk}] (the number of filled "
                         f"keys of each row); got {lengths.tolist()} (rows "
                         f"{np.flatnonzero(bad).tolist()} out of range).")


def kv_lengths_out_of_range(kv_lengths: Any, Tk: int) -> jax.Array | None:
    """bool ``[B]``: rows whose traced length lies outside ``[0, Tk]`` (None for concrete
    lengths, which :func:`check_kv_lengths_range` checks)."""
    if is_concrete(kv_lengths):
        return None
    lengths = jnp.asarray(kv_lengths)
    return (lengths < 0) | (lengths > Tk)


def check_contiguous_segments(name: str, segment_ids: Any) -> None:
    """Concrete integer ``[B, T]`` segment ids must give each id one run of consecutive
    tokens per row (schemes whose position is what lies between two tokens, PaTH's
    transforms, read a segment that comes back after another as one sequence). Traced ids
    are not checked (the documented precondition).

    Raises:
      ValueError: an id that comes back after another id, naming the row, the id and the
        token where it comes back.
    """
    if segment_ids is None or not is_concrete(segment_ids):
        return
    s = np.asarray(segment_ids)
    if s.ndim != 2 or s.shape[1] < 3:
        return
    starts = np.ones(s.shape, bool)
    starts[:, 1:] = s[:, 1:] != s[:, :-1]  # the first token of each run
    for b in range(s.shape[0]):
        run_ids = s[b, starts[b]]
        if len(np.unique(run_ids)) == len(run_ids):
            continue
        seen: set = set()
        for t in np.flatnonzero(starts[b]):
            if int(s[b, t]) in seen:
                raise ValueError(
                    f"{name} must keep each segment's tokens together (one run per id and "
                    f"row); got row {b} = {s[b].tolist()}: id {int(s[b, t])} comes back at "
                    f"token {int(t)} after another id. Give each run its own id.")
            seen.add(int(s[b, t]))
