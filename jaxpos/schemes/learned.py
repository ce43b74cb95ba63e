"""Learned absolute positions (Gehring et al. 2017; GPT-2, BERT).

A table ``P`` of shape ``[max_len, d]`` is trained like a token embedding and
row ``t`` is added to the token at position ``t``. There is no row for
``max_len``: what happens there is a policy the caller chooses explicitly,
because ``jnp.take`` and friends silently clamp out-of-range indices (JAX's
"out-of-bounds indexing" rule).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify
from jax.typing import ArrayLike

from jaxpos import _checks

__all__ = ["OUT_OF_RANGE_POLICIES", "learned_positions"]

OUT_OF_RANGE_POLICIES = ("error", "checked", "wrap", "clip")
_POLICIES = OUT_OF_RANGE_POLICIES


def learned_positions(table: ArrayLike, positions: ArrayLike, *,
                      out_of_range: str = "error") -> jax.Array:
    """Look up learned position vectors (Gehring et al. 2017, §3.1; GPT-2; BERT).

    Args:
      table: ``[max_len, d]`` floating array (the learned parameter), e.g.
        ``[1024, 768]`` for GPT-2 small, ``[512, 768]`` for BERT-base.
      positions: integer array ``[..., T]`` (any leading batch axes). Positions may
        repeat (padding, packed sequences that restart at 0), so ``T`` may exceed
        ``max_len`` as long as every value lies in the table.
      out_of_range: what to do with a position ``p`` outside ``[0, max_len)``:

        * ``"error"`` (default): if the positions are concrete (NumPy, Python, or a
          JAX array outside ``jit``), raise ``ValueError`` for any value outside the
          table. Traced positions whose sequence axis is longer than ``max_len``
          raise ``ValueError`` at trace time. Traced positions cannot be
          inspected at trace time; the rows of those outside the table (and only
          those rows) are **NaN**, so the error propagates loudly into the loss
          instead of silently reusing another row (``jnp.take`` would clamp to the
          last row).
        * ``"checked"``: as ``"error"`` for concrete positions; traced positions are
          checked by value with :func:`jax.experimental.checkify.check`, so a
          position outside the table raises under ``jit`` too (and a packed sequence
          longer than the table is fine). Functionalize the jitted caller with
          ``checkify.checkify`` and throw its error::

              f = checkify.checkify(jax.jit(
                  lambda t, p: learned_positions(t, p, out_of_range="checked")))
              err, rows = f(table, positions)
              err.throw()  # JaxRuntimeError: positions must lie in [0, max_len) ...

          Without ``checkify.checkify``, ``jax.jit`` refuses the check when it traces
          it (JAX's "Cannot abstractly evaluate a checkify.check which was not
          functionalized"). The returned rows are those of ``"error"``.
        * ``"wrap"``: row ``p % max_len`` (a periodic table; a negative ``p`` wraps
          from the end).
        * ``"clip"``: row ``clip(p, 0, max_len - 1)``.

    Returns:
      ``[..., T, d]`` with ``table``'s dtype.

    Raises:
      ValueError: unknown ``out_of_range``, ``table`` not rank 2, scalar ``positions``,
        or (policies ``"error"`` and ``"checked"``) concrete positions outside
        ``[0, max_len)``; (``"error"``) traced positions longer than the table. Under
        ``checkify.checkify``, ``"checked"`` returns traced positions outside the table
        as a checkify error (``err.throw()`` raises ``JaxRuntimeError``).
      TypeError: ``positions`` not integer, ``table`` not floating.
    """
    _checks.check_choice("out_of_range", out_of_range, _POLICIES)
    _checks.check_rank("table", table, (2,), "[max_len, d]")
    _checks.check_floating("table", table)
    _checks.check_integer_positions("positions", positions)
    if len(_checks.shape_of(positions)) < 1:
        raise ValueError("positions must have rank >= 1 ([..., T]); got a scalar (shape ()).")
    max_len = _checks.shape_of(table)[0]
    T = _checks.shape_of(positions)[-1]
    concrete = _checks.is_concrete(positions)
    if out_of_range == "error" and not concrete and T > max_len:
        # Traced values cannot be inspected; a traced sequence longer than the table is
        # the case that cannot be served, so it fails at trace time, not as NaN later.
        raise ValueError(
            f"positions has sequence length {T}, longer than the learned table (max_len="
            f"{max_len}); learned absolute positions cannot run past their table. Pass "
            f"concrete positions (checked by value, so packed sequences that restart at 0 "
            f"are fine), out_of_range='checked' (checked by value under jit with "
            f"jax.experimental.checkify), or out_of_range='wrap' / 'clip' to choose another "
            f"policy explicitly."
        )
    if out_of_range in ("error", "checked") and concrete:
        p = np.asarray(positions)
        bad = (p < 0) | (p >= max_len)
        if bad.any():
            raise ValueError(
                f"positions must lie in [0, {max_len}) for a table of {max_len} rows; got "
                f"values from {p.min()} to {p.max()} ({int(bad.sum())} outside): there is no "
                f"row for position {p.max() if p.max() >= max_len else p.min()} (rows exist "
                f"only for 0..{max_len - 1}). Pass out_of_range='wrap' or 'clip' to choose "
                f"another policy explicitly."
            )
    pos = jnp.asarray(positions, jnp.int32)
    if out_of_range == "checked" and not concrete:
        checkify.check(
            jnp.all((pos >= 0) & (pos < max_len)),
            f"positions must lie in [0, {max_len}) for a learned table of {max_len} rows; got "
            f"values from {{lo}} to {{hi}} (rows exist only for 0..{max_len - 1}).",
            lo=jnp.min(pos), hi=jnp.max(pos))
    return _lookup(jnp.asarray(table), pos, "error" if out_of_range == "checked" else out_of_range)


@functools.partial(jax.jit, static_argnums=2)
def _lookup(table, pos, out_of_range):
    """The gather, one compiled computation per shape and policy (also when eager)."""
    max_len = table.shape[0]
    if out_of_range == "wrap":
        return table[jnp.mod(pos, max_len)]
    if out_of_range == "clip":
        return table[jnp.clip(pos, 0, max_len - 1)]
    valid = (pos >= 0) & (pos < max_len)
    rows = table[jnp.clip(pos, 0, max_len - 1)]  # clamp made explicit, then masked to NaN
    return jnp.where(valid[..., None], rows, jnp.array(jnp.nan, rows.dtype))
