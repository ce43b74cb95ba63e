"""The pieces of a kernel body, shared by the forward, backward and paged kernels: the
score of a tile (float32 dots, the score_mod), its visibility (causal, key lengths,
segments, the mask_mod), the two loops over a schedule row (PARTIAL tiles masked, FULL
tiles not), attention dropout's keep decisions and the online-softmax state a program
starts from. The online-softmax step itself (FlashAttention-2, Dao 2023, Alg. 1) is the
core's one, :func:`jaxpos.core.tiles.online_softmax_step`, traced inside the kernel body.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from jaxpos.core.dropout import Dropout, keep_tile
from jaxpos.core.tiles import Running
from jaxpos.kernels import modeval

if TYPE_CHECKING:
    from jaxpos.kernels.config import KernelConfig


def dot(a: Any, b: Any, cfg: KernelConfig, contract: Any = ((1,), (1,))) -> Any:
    """``a . b`` over ``contract`` with float32 accumulation (exact float32 dots for
    float32 inputs)."""
    prec = jax.lax.Precision.HIGHEST if cfg.precise else None
    return jax.lax.dot_general(a, b, (contract, ((), ())), precision=prec,
                               preferred_element_type=jnp.float32)


def dots(xs: Any, ys: Any, cfg: KernelConfig) -> Any:
    """``sum_seg xs[seg] . ys[seg]^T`` (the scores over feature segments)."""
    out = dot(xs[0], ys[0], cfg)
    for x, y in zip(xs[1:], ys[1:]):
        out = out + dot(x, y, cfg)
    return out


def _loader(style, refs):
    return (modeval.RefLoader if style == "load" else modeval.LoopLoader)(refs)


class Mods:
    """The score_mod / mask_mod of one kernel body, reading captured arrays from the refs
    ``smod{i}`` / ``mmod{i}`` (``style``: ``"load"`` indexed loads, ``"loop"`` the TPU
    form; :mod:`jaxpos.kernels.modeval`)."""

    def __init__(self, r: dict[str, Any], smod: Any, mmod: Any, style: str):
        self.score: Any = None
        self.mask: Any = None
        if smod is not None:
            refs = [r[f"smod{i}"] for i in range(len(smod.consts))]
            self.score = modeval.mod_function(smod, _loader(style, refs))
        if mmod is not None:
            refs = [r[f"mmod{i}"] for i in range(len(mmod.consts))]
            self.mask = modeval.mod_function(mmod, _loader(style, refs))


def scores(cfg: KernelConfig, mods: Mods, b: Any, h: Any, q: Any, k: Any, q_pos: Any,
           kv_pos: Any) -> tuple[jax.Array, jax.Array]:
    """``(s_raw, s)``: the scaled scores of a tile and the score_mod applied to them."""
    s_raw = dots(q, k, cfg) * jnp.float32(cfg.scale)
    if mods.score is None:
        return s_raw, s_raw
    return s_raw, mods.score(s_raw, b, h, q_pos, kv_pos)


def chain(cfg: KernelConfig, mods: Mods, b: Any, h: Any, ds: Any, s_raw: Any, q_pos: Any,
          kv_pos: Any, vis: Any) -> Any:
    """The gradient with respect to the raw score: ``ds * d score_mod / d score``
    (elementwise; ``ds`` itself when the score_mod is additive or absent)."""
    if cfg.additive or mods.score is None:
        return ds
    _, d = jax.jvp(lambda s: mods.score(s, b, h, q_pos, kv_pos), (s_raw,),
                   (jnp.ones_like(s_raw),))
    ds = ds * d
    return ds if vis is None else jnp.where(vis, ds, 0.0)


def kv_padded(cfg: KernelConfig) -> bool:
    """Whether key tiles may hold keys that do not exist (past ``Tk`` or a row's length)."""
    return cfg.nk * cfg.bk != cfg.Tk or cfg.has_kv_len


def visible(cfg: KernelConfig, mods: Mods, b: Any, h: Any, q_pos: Any, kv_pos: Any, q_seg: Any,
            kv_seg: Any, key_index: Any, kv_lim: Any, shape: tuple[int, ...]) -> Any:
    """bool ``shape`` visibility of a PARTIAL tile; ``key_index`` ``[1, bk]`` the tile's key
    indices along the row (compared with ``kv_lim``, the row's key count)."""
    terms = []
    if cfg.causal:
        terms.append(kv_pos <= q_pos)
    if kv_padded(cfg):
        terms.append(key_index < kv_lim)
    if cfg.has_segments:
        terms.append(q_seg == kv_seg)
    if mods.mask is not None:
        terms.append(mods.mask(b, h, q_pos, kv_pos))
    if not terms:
        return jnp.ones(shape, jnp.bool_)
    vis = terms[0]
    for t in terms[1:]:
        vis = vis & t
    return jnp.broadcast_to(vis, shape)


def key_indices(j: Any, bk: int) -> jax.Array:
    """int32 ``[1, bk]``: the key indices of key tile ``j``."""
    return j * bk + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)


def loops(count: Any, item: Any, carry: Any, tile: Any, offset: Any = 0) -> Any:
    """Run ``tile(index, carry, masked)`` over the PARTIAL then the FULL tiles of this
    program's schedule row (``count(row)``, ``item(row, t)``); each loop's trip count is
    the number of such tiles. ``offset`` is added to every index (a key split's start)."""

    def run(row, carry, masked):
        # The next tile's index is read one iteration ahead and carried (as FlexAttention's
        # kernels advance their pointers), so a tile's addresses never wait on a load
        # issued in the same iteration (what lets Triton pipeline the tile loads).
        def body(t, c):
            j, inner = c
            nxt = item(row, t + 1)
            return nxt, tile(j + offset, inner, masked)

        return jax.lax.fori_loop(0, count(row), body, (item(row, 0), carry))[1]

    return run(1, run(0, carry, True), False)


def sched_fns(counts: Any, lists: Any, lead: tuple[Any, ...] = ()) -> Any:
    """``count(row)`` / ``item(row, t)`` of a counts ref ``[*lead, 1, 2]`` and a lists ref
    ``[*lead, 2, L]`` (``lead``: static indices of a head inside the block)."""
    last = lists.shape[-1] - 1
    return (lambda row: counts[(*lead, 0, row)],
            lambda row, t: lists[(*lead, row, jnp.minimum(t, last))])


def named(refs: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """The kernel's refs by name (inputs then outputs, as the plumbing declared them)."""
    assert len(refs) == len(names), "kernel argument list out of sync"
    return dict(zip(names, refs))


def hd(heads: int, hi: int, *idx: Any) -> tuple[Any, ...]:
    """One index tuple (Triton takes a single indexer): head ``hi`` of a block of ``heads``
    heads (a leading block dim when ``heads > 1``), then ``idx``."""
    return idx if heads == 1 else (hi, *idx)


def dropped(cfg: KernelConfig, r: dict[str, Any], b: Any, h: Any, q0: Any, rq: int, k0: Any,
            rk: int, x: Any) -> Any:
    """``x`` (a ``[rq, rk]`` tile of probabilities or of ``dO V^T``) times the dropout
    factor ``keep / (1 - rate)`` of query rows ``q0 + [0, rq)`` and key columns
    ``k0 + [0, rk)`` (indices along the call's sequences), the keep decisions of
    :func:`jaxpos.core.dropout.keep_tile` for batch row ``b`` and query head ``h`` (both 0
    with a broadcast mask): the same pairs as the reference and chunked paths. ``x``
    unchanged without dropout."""
    if not cfg.dropout_rate:
        return x
    drop = Dropout(cfg.dropout_rate, None, cfg.dropout_broadcast)  # type: ignore[arg-type]
    if cfg.dropout_broadcast:
        b = h = 0
    qi = q0 + jax.lax.broadcasted_iota(jnp.int32, (rq, 1), 0)
    ki = k0 + jax.lax.broadcasted_iota(jnp.int32, (1, rk), 1)
    keep = keep_tile((r["drop_seed"][0], r["drop_seed"][1]), drop.threshold, b, h, qi, ki)
    return jnp.where(keep, x * jnp.float32(drop.scale), 0.0)


def init_state(r: dict[str, Any], cfg: KernelConfig, heads: int, p: Any,
               width: int) -> list[Running]:
    """The online-softmax state (:class:`jaxpos.core.tiles.Running`, ``m`` and ``l`` of
    shape ``[bq, 1]``) of each of ``heads`` query heads: the head's sink as a key of value
    zero (``m = sink, l = 1``) without key splits, else empty (``m = -inf, l = 0``; the
    sinks join when the splits are combined). The sink is read from scalar memory, which
    is why the kernel does not start from :func:`jaxpos.core.tiles.softmax_start`."""
    bq = cfg.bq
    out = []
    for hi in range(heads):
        if cfg.has_sinks and cfg.splits == 1:
            m0 = jnp.full((bq, 1), r["sinks"][p * heads + hi], jnp.float32)
            l0 = jnp.ones((bq, 1), jnp.float32)
        else:
            m0 = jnp.full((bq, 1), -jnp.inf, jnp.float32)
            l0 = jnp.zeros((bq, 1), jnp.float32)
        out.append(Running(m0, l0, jnp.zeros((bq, width), jnp.float32)))
    return out
