"""Test harness of the kernels (imported by tests and benchmarks only; no production
module imports it).

* :func:`poison_outputs`: every kernel output starts as NaN (aliased NaN-filled inputs),
  so an element a kernel fails to write shows up as NaN.
* :func:`interpret_like_tpu`: the interpreter reads captured arrays by index the TPU way
  (a loop of scalar reads) instead of by indexed loads, so both forms run on CPU.
* :func:`tile_visits`: how many key tiles each forward program and query tiles each
  dk/dv program visit, counted inside the kernels' loops (interpret mode).
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxpos.kernels import backward, forward, fused, plumbing
from jaxpos.kernels.config import prepare


def _poisoned(pallas_call):
    """``pallas_call`` whose outputs are aliased to NaN-filled (integers: -1) inputs."""

    def call(body, *, grid, in_specs, out_specs, out_shape, **kw):
        n_in, n_out = len(in_specs), len(out_shape)

        def inner(*refs):  # the aliased inputs are the outputs' initial contents
            return body(*refs[:n_in], *refs[n_in + n_out:])

        run = pallas_call(inner, grid=grid, in_specs=list(in_specs) + list(out_specs),
                          out_specs=out_specs, out_shape=out_shape,
                          input_output_aliases={n_in + i: i for i in range(n_out)}, **kw)

        def f(*args):
            poison = [jnp.full(o.shape, jnp.nan if jnp.issubdtype(o.dtype, jnp.inexact) else -1,
                               o.dtype) for o in out_shape]
            return run(*args, *poison)

        return f

    call.poisoned = True
    return call


@contextlib.contextmanager
def poison_outputs() -> Iterator[None]:
    """Within the block, every kernel traced starts its outputs as NaN (nested blocks
    poison once)."""
    if getattr(plumbing.pallas_call, "poisoned", False):
        yield
        return
    with _patched(plumbing, "pallas_call", _poisoned(plumbing.pallas_call)):
        yield


@contextlib.contextmanager
def interpret_like_tpu() -> Iterator[None]:
    """Within the block, interpret mode reads captured arrays the TPU way."""
    real = plumbing.LOADER_STYLE["cpu"]
    plumbing.LOADER_STYLE["cpu"] = "loop"
    try:
        yield
    finally:
        plumbing.LOADER_STYLE["cpu"] = real


@contextlib.contextmanager
def _patched(module, name, value):
    real = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, real)


class _Counter:
    """Loop trips recorded per (kernel, program ids, masked) by host callbacks."""

    def __init__(self):
        self.trips = defaultdict(int)
        self.kernel = ("", 3)

    def loops(self, real):
        def counted(count, item, carry, tile, offset=0):
            kernel = self.kernel
            # (read at the body's top level: the interpreter substitutes program ids there)
            ids = [pl.program_id(a) for a in range(kernel[1])]

            def tile_counted(j, c, masked):
                jax.debug.callback(functools.partial(self._record, kernel[0], masked), *ids)
                return tile(j, c, masked)

            return real(count, item, carry, tile_counted, offset)
        return counted

    def _record(self, name, masked, *ids):
        self.trips[(name, tuple(int(i) for i in ids), masked)] += 1

    def kernel_body(self, name, real):
        def body(*refs, cfg, **kw):
            grid_rank = 4 if name == "fwd" and cfg.splits > 1 else 3
            self.kernel = (name, grid_rank)
            return real(*refs, cfg=cfg, **kw)
        return body

    def table(self, name, shape):
        out = np.zeros(shape + (2,), np.int32)
        for (kname, ids, masked), n in self.trips.items():
            if kname == name:
                out[ids + (0 if masked else 1,)] += n
        return out


@contextlib.contextmanager
def counting_tiles() -> Iterator[_Counter]:
    """Within the block, every kernel traced counts its loop trips (yields the counter:
    ``counter.table(kernel, grid_shape)`` with kernel ``"fwd"``, ``"dq"`` or ``"dkv"``
    gives ``[*grid_shape, (masked, unmasked)]``)."""
    counter = _Counter()
    with contextlib.ExitStack() as stack:
        for mod, name in ((forward, "loops"), (backward, "loops")):
            stack.enter_context(_patched(mod, name, counter.loops(getattr(mod, name))))
        for mod, name, tag in ((forward, "fwd_kernel", "fwd"), (backward, "dq_kernel", "dq"),
                               (backward, "dkv_kernel", "dkv")):
            stack.enter_context(_patched(mod, name, counter.kernel_body(tag, getattr(mod, name))))
        yield counter


def tile_visits(q, k, v, **kw) -> Any:
    """How many key tiles each forward program and how many query tiles each dk/dv program
    visit, as ``(fwd [B, N / G, nq, 2] (or [B, N / G, nq, S, 2] with key splits),
    dkv [B, N_kv, nk, 2])`` (column 0: masked PARTIAL tiles, column 1: unmasked FULL tiles),
    counted inside the kernels' loops in interpret mode. ``kw``: as
    :func:`jaxpos.kernels.fused.kernel_attention`."""
    kv_splits = kw.pop("kv_splits", None)
    call = fused.kernel_call(q, k, v, **kw)
    cfg, ops = prepare(call, mode="interpret", kv_splits=kv_splits)
    with counting_tiles() as counter:
        out, lse = forward.forward(cfg, ops)
        lse_b, delta = backward.backward_rows(cfg, out, lse, jnp.zeros_like(out),
                                              jnp.zeros_like(lse))
        jax.block_until_ready(backward.backward(cfg, ops, lse_b, delta, jnp.zeros_like(out)))
        jax.effects_barrier()
    fwd_shape = (cfg.B, cfg.N // cfg.heads, cfg.nq) + ((cfg.splits,) if cfg.splits > 1 else ())
    return (counter.table("fwd", fwd_shape),
            counter.table("dkv", (cfg.B, cfg.N // cfg.groups, cfg.nk)))
