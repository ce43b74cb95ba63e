"""The conformance suite's three axes, as module-level tables others extend:

* :data:`SCHEMES`: name -> ``(float64 params, params -> jaxpos scheme)``; the reference
  side is :func:`_contract_reference.scheme_scores` (add the scheme there too).
* :data:`CALL_SHAPES`: name -> a function of the scheme name returning a :class:`Case`.
* :data:`IMPLEMENTATIONS`: name -> :class:`Path` (how to run a case, which cases it
  takes, whether it is slow).

A case is the same inputs for every path; ``run_case`` returns the output and the
gradients of ``sum(out * cotangent)`` with respect to ``q``, ``k``, ``v``, the sinks and
the scheme's floating arrays; ``reference_case`` returns the float64 contract's.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import _dense_float32_engine  # noqa: F401  (registers the "dense_float32" engine)
import jax
import jax.numpy as jnp
import numpy as np
from _contract_reference import contract_attention, visible_any

import jaxpos
from jaxpos.core.quantised import QUANTISED_DTYPES, QuantisedPages, kv_storage_dtype, quantise
from jaxpos.layers.cache.paged import write_pages

# ---------------------------------------------------------------------------- schemes
_R = np.random.default_rng(1234)
_N = 4  # query heads of every case (2 key/value heads in the GQA case)
_H = 8


def _fire_params():
    w = 4
    return {"w1": _R.uniform(-1, 1, w), "b1": _R.uniform(-1, 1, w),
            "w2": _R.uniform(-0.5, 0.5, (w, _N)), "b2": _R.uniform(-0.5, 0.5, _N),
            "c": np.float64(0.1), "L_multiplier": np.float64(1.0), "init_L": 512.0}


_f32 = lambda x: np.asarray(x, np.float32)
#: name -> (params (float64, rounded through float32 so both sides hold the same
#: numbers), params -> jaxpos scheme). The scheme's floating children named like the
#: params receive gradients that are compared.
SCHEMES: dict[str, tuple[dict, Callable]] = {
    "none": ({}, lambda p: None),
    "rope": ({"inv_freq": 10000.0 ** (-np.arange(0, 6, 2) / 6)},  # partial rotation (6 of 8)
             lambda p: jaxpos.RoPE(_f32(p["inv_freq"]))),
    "alibi": ({"slopes": 2.0 ** (-8.0 * np.arange(1, _N + 1) / _N)},
              lambda p: jaxpos.ALiBi(slopes=_f32(p["slopes"]))),
    "t5": ({"table": _R.normal(size=(32, _N)), "bidirectional": False},
           lambda p: jaxpos.T5Bias(_f32(p["table"]), bidirectional=False)),
    "kerple": ({"r1": _R.uniform(0.5, 2.0, _N), "r2": _R.uniform(0.5, 2.0, _N)},
               lambda p: jaxpos.KERPLE(_f32(p["r1"]), _f32(p["r2"]), kind="log")),
    "xpos": ({"inv_freq": 10000.0 ** (-np.arange(0, _H, 2) / _H), "scale_base": 512.0},
             lambda p: jaxpos.XPos(inv_freq=_f32(p["inv_freq"]), scale_base=512.0)),
    "fire": (_fire_params(),
             lambda p: jaxpos.FIRE(_f32(p["w1"]), _f32(p["b1"]), _f32(p["w2"]), _f32(p["b2"]),
                                   c=_f32(p["c"]), L_multiplier=_f32(p["L_multiplier"]),
                                   init_L=p["init_L"])),
    # FoX's gates of 32 tokens (every position a case reads, the slots past a fill too)
    "fox": ({"log_forget": np.log(_R.uniform(0.5, 1.0, (1, 32, _N)))},
            lambda p: jaxpos.FoX(_f32(p["log_forget"]))),
}
#: Schemes that join only some of SCHEME_SHAPES (FoX's gates cover positions 0 .. 31; its
#: training shape runs in tests/schemes/test_fox.py): the decode case on every path.
SCHEME_ONLY = {"fox": ("decode",)}
for _params, _ in SCHEMES.values():  # both sides see exactly the float32 numbers
    for _name, _x in list(_params.items()):
        if isinstance(_x, np.ndarray) or isinstance(_x, np.floating):
            _params[_name] = np.asarray(np.asarray(_x, np.float32), np.float64)


# ------------------------------------------------------------------------------- mods
# Each mod is a pair: the jaxpos form (on a tile, scalars batch/head) and the
# reference's broadcasting form (see contract_attention). Module-level, so every path
# (and every case) traces the same function objects.
def _clip_st(s, b, h, qp, kp):
    """Straight-through clip: the value of clip(s, -0.2, 0.2), the gradient of s."""
    return s + jax.lax.stop_gradient(jnp.clip(s, -0.2, 0.2) - s)


def _clip_st_ref(s, b, h, qp, kp, xp, stop_gradient):
    return s + stop_gradient(xp.clip(s, -0.2, 0.2) - s)


def _softcap(s, b, h, qp, kp):
    return 2.0 * jnp.tanh(s / 2.0)


def _softcap_ref(s, b, h, qp, kp, xp, stop_gradient):
    return 2.0 * xp.tanh(s / 2.0)


def _hide_row3(s, b, h, qp, kp):
    """An additive -inf on every key of the query at position 3 (a whole row)."""
    return s + jnp.where(qp == 3, -jnp.inf, 0.0)


def _hide_row3_ref(s, b, h, qp, kp, xp, stop_gradient):
    return s + xp.where(qp == 3, -np.inf, 0.0)


_BLOOM_SLOPES = np.asarray([0.5, 0.25, 0.125, 0.0625], np.float32)


def _bloom_bias(s, b, h, qp, kp):
    """BLOOM's form of ALiBi: ``slopes[h] * kv_pos`` (a large per-row constant)."""
    return s + jnp.asarray(_BLOOM_SLOPES)[h] * kp.astype(jnp.float32)


def _bloom_bias_ref(s, b, h, qp, kp, xp, stop_gradient):
    return s + _BLOOM_SLOPES.astype(np.float64)[h] * kp


def _window2(b, h, qp, kp):
    """Sliding window of 2 keys back (with causal=True)."""
    return qp - kp < 2


def _no_key_for_pos0(b, h, qp, kp):
    """Query position 0 sees no key (its row is empty with or without causality)."""
    return qp != 0


def _future_only_for_pos2(b, h, qp, kp):
    """Query position 2 may see only keys 5.. (which causality hides): its row is empty
    only when causality counts too."""
    return (qp != 2) | (kp >= 5)


MODS = {
    "clip_st": (_clip_st, _clip_st_ref),
    "softcap": (_softcap, _softcap_ref),
    "hide_row3": (_hide_row3, _hide_row3_ref),
    "bloom": (_bloom_bias, _bloom_bias_ref),
}
MASK_MODS = {"window2": _window2, "no_key_for_pos0": _no_key_for_pos0,
             "future_only_for_pos2": _future_only_for_pos2}


# ------------------------------------------------------------------------------ cases
@dataclasses.dataclass(frozen=True)
class Case:
    """One call. Positions and segment ids are NumPy ``[B, T]`` (or None)."""

    scheme: str = "none"
    B: int = 1
    Tq: int = 8
    Tk: int = 8
    N: int = _N
    Nk: int = _N
    dtype: str = "float32"
    causal: bool = True
    q_positions: tuple | None = None  # nested tuples (hashable)
    kv_positions: tuple | None = None
    segment_ids: tuple | None = None
    kv_segment_ids: tuple | None = None
    sinks: tuple | None = None
    score_mod: str | None = None
    mask_mod: str | None = None
    nan_value_at: int | None = None  # a NaN in v at this key index (batch 0, head 0)
    grads: bool = True
    self_attention: bool = True  # the last Tq keys are the queries' own tokens

    def arrays(self):
        rng = np.random.default_rng(7)
        H = _H
        q = rng.normal(size=(self.B, self.Tq, self.N, H))
        k = rng.normal(size=(self.B, self.Tk, self.Nk, H))
        v = rng.normal(size=(self.B, self.Tk, self.Nk, H))
        if self.nan_value_at is not None:
            v[0, self.nan_value_at, 0, 0] = np.nan
        cot = rng.normal(size=(self.B, self.Tq, self.N, H))
        dt = jnp.dtype(self.dtype)
        # both sides get the numbers the dtype holds
        rnd = lambda x: np.asarray(jnp.asarray(x, dt).astype(jnp.float32), np.float64)
        return rnd(q), rnd(k), rnd(v), cot

    def np_(self, name):
        x = getattr(self, name)
        return None if x is None else np.asarray(x)


def _t(x):
    return None if x is None else tuple(map(tuple, np.asarray(x).tolist()))


def _pos(B, T, start=0):
    return _t(np.broadcast_to(np.arange(T) + start, (B, T)))


#: name -> scheme -> Case. The call shapes of the contract; every one runs with every
#: scheme of :data:`SCHEME_SHAPES` (the others with "none" only, to keep the run small).
CALL_SHAPES: dict[str, Callable[[str], Case]] = {
    "training": lambda s: Case(scheme=s),
    "non_causal": lambda s: Case(scheme=s, causal=False),
    "prefill_chunk": lambda s: Case(scheme=s, Tq=4, Tk=8),
    "decode": lambda s: Case(scheme=s, Tq=1, Tk=8),
    "gqa": lambda s: Case(scheme=s, Nk=2),
    "offset_positions": lambda s: Case(scheme=s, B=2, q_positions=_pos(2, 8, 1000),
                                       kv_positions=_pos(2, 8, 1000)),
    "positions_1e5_1e6": lambda s: Case(
        scheme=s, B=2, q_positions=_t([np.arange(8) + 100_000, np.arange(8) + 999_990]),
        kv_positions=_t([np.arange(8) + 100_000, np.arange(8) + 999_990])),
    # Hugging Face left padding: pads at position 1 (cumsum(mask) - 1 with masked_fill 1),
    # hidden by segment ids (pads have id 0: an ordinary segment, pads see each other).
    "left_padded": lambda s: Case(
        scheme=s, B=2, q_positions=_t([np.arange(8), [1, 1, 1, 0, 1, 2, 3, 4]]),
        kv_positions=_t([np.arange(8), [1, 1, 1, 0, 1, 2, 3, 4]]),
        segment_ids=_t([[1] * 8, [0, 0, 0, 1, 1, 1, 1, 1]])),
    "packed": lambda s: Case(
        scheme=s, q_positions=_t([[0, 1, 2, 0, 1, 2, 3, 0]]),
        kv_positions=_t([[0, 1, 2, 0, 1, 2, 3, 0]]),
        segment_ids=_t([[1, 1, 1, 2, 2, 2, 2, 3]])),
    # rows with no visible key: causality combined with segments (query 2 is the first
    # token of segment 2 at a position before every key of its segment) ...
    "empty_rows_causal_segments": lambda s: Case(
        scheme=s, q_positions=_t([np.arange(8)]), kv_positions=_t([np.arange(8)]),
        segment_ids=_t([[1, 1, 2, 1, 1, 2, 2, 2]]),
        kv_segment_ids=_t([[1, 1, 1, 1, 1, 2, 2, 2]])),
    # ... and with a mask_mod (query position 2 may see only future keys)
    "empty_rows_causal_mask_mod": lambda s: Case(scheme=s, mask_mod="future_only_for_pos2"),
    "sliding_window": lambda s: Case(scheme=s, mask_mod="window2"),
    "whole_row_minus_inf": lambda s: Case(scheme=s, score_mod="hide_row3"),
    "straight_through_mod": lambda s: Case(scheme=s, score_mod="clip_st"),
    "non_additive_mod": lambda s: Case(scheme=s, score_mod="softcap"),
    "sinks": lambda s: Case(scheme=s, sinks=(0.5, -1.0, 2.0, 0.0)),
    "sinks_minus_inf_empty_rows": lambda s: Case(
        scheme=s, sinks=(-np.inf, 0.5, -np.inf, 1.0), mask_mod="no_key_for_pos0"),
    "bfloat16": lambda s: Case(scheme=s, dtype="bfloat16"),
    "float16": lambda s: Case(scheme=s, dtype="float16"),
    "bfloat16_large_bias": lambda s: Case(
        scheme=s, dtype="bfloat16", score_mod="bloom", q_positions=_pos(1, 8, 1000),
        kv_positions=_pos(1, 8, 1000)),
    "nan_value": lambda s: Case(scheme=s, nan_value_at=5, grads=False),
}
#: Call shapes run with every scheme of SCHEMES (the rest with "none").
SCHEME_SHAPES = ("training", "decode", "positions_1e5_1e6")


def all_cases():
    """``[(case_id, Case)]``: every call shape with "none", the scheme shapes with every
    scheme."""
    out = []
    for shape, make in CALL_SHAPES.items():
        for scheme in SCHEMES if shape in SCHEME_SHAPES else ("none",):
            if shape in SCHEME_ONLY.get(scheme, (shape,)):
                out.append((f"{shape}-{scheme}", make(scheme)))
    return out


# ---------------------------------------------------------------------------- running
def _jaxpos_kwargs(case: Case):
    kw = dict(causal=case.causal, q_positions=case.np_("q_positions"),
              kv_positions=case.np_("kv_positions"), segment_ids=case.np_("segment_ids"),
              kv_segment_ids=case.np_("kv_segment_ids"))
    if case.segment_ids is not None and case.kv_segment_ids is None:
        kw["kv_segment_ids"] = case.np_("segment_ids")
    if case.score_mod is not None:
        kw["score_mod"] = MODS[case.score_mod][0]
    if case.mask_mod is not None:
        kw["mask_mod"] = MASK_MODS[case.mask_mod]
    return kw


def _float_children(scheme):
    if scheme is None:
        return {}
    return {n: getattr(scheme, n) for n in type(scheme)._children
            if jnp.issubdtype(jnp.result_type(getattr(scheme, n)), jnp.floating)}


def _with_children(scheme, children):
    """``scheme`` with the floating children ``children`` (a dict) put back, through the
    pytree protocol of :class:`jaxpos.PositionScheme` (so traced values pass)."""
    if scheme is None:
        return None
    kids, aux = scheme._flatten()
    kids = tuple(children.get(n, x) for n, x in zip(type(scheme)._children, kids))
    return type(scheme)._unflatten(aux, kids)


def _sinks(case):
    return None if case.sinks is None else jnp.asarray(case.sinks, jnp.float32)


def run_attention(case: Case, attend, *, jit=True):
    """``(out, grads)`` of ``attend(q, k, v, scheme, sinks, **kw)`` (float32 NumPy;
    ``grads``: dict with ``q``, ``k``, ``v``, ``sinks``, ``scheme.<child>``)."""
    q, k, v, cot = case.arrays()
    dt = jnp.dtype(case.dtype)
    scheme = SCHEMES[case.scheme][1](SCHEMES[case.scheme][0])
    children = _float_children(scheme)
    kw = _jaxpos_kwargs(case)

    def f(q, k, v, sinks, children):
        return attend(q, k, v, _with_children(scheme, children), sinks, **kw)

    args = (jnp.asarray(q, dt), jnp.asarray(k, dt), jnp.asarray(v, dt), _sinks(case), children)
    if not case.grads:
        fn = jax.jit(f) if jit else f
        return np.asarray(fn(*args).astype(jnp.float32), np.float64), None

    def fwd_bwd(*a):
        out, vjp = jax.vjp(f, *a)
        return out, vjp(jnp.asarray(cot, out.dtype))

    fn = jax.jit(fwd_bwd) if jit else fwd_bwd
    out, (dq, dk, dv, dsinks, dch) = fn(*args)
    f64 = lambda x: np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
    grads = {"q": f64(dq), "k": f64(dk), "v": f64(dv)}
    if dsinks is not None:
        grads["sinks"] = f64(dsinks)
    grads.update({f"scheme.{n}": f64(g) for n, g in dch.items()})
    return f64(out), grads


def _ref_mods(case):
    smod = None if case.score_mod is None else MODS[case.score_mod][1]
    mmod = None if case.mask_mod is None else MASK_MODS[case.mask_mod]
    return smod, mmod


def reference_case(case: Case, kv_dtype: str | None = None):
    """float64 ``(out, grads)`` of the contract (grads by JAX in float64); with
    ``kv_dtype`` (quantised pages) the contract on the keys and values those pages hold
    (:func:`dequantised_round_trip`), forward only."""
    q, k, v, cot = case.arrays()
    if kv_dtype is not None:
        k, v = (dequantised_round_trip(x, kv_dtype, case.dtype) for x in (k, v))
        case = dataclasses.replace(case, grads=False)
    params = SCHEMES[case.scheme][0]
    smod, mmod = _ref_mods(case)
    kw = dict(scheme=case.scheme, score_mod=smod, mask_mod=mmod, causal=case.causal,
              q_positions=case.np_("q_positions"), kv_positions=case.np_("kv_positions"),
              segment_ids=case.np_("segment_ids"), kv_segment_ids=case.np_("kv_segment_ids"))
    sinks = None if case.sinks is None else np.asarray(case.sinks, np.float64)
    out = contract_attention(q, k, v, params=params, sinks=sinks, **kw)
    if not case.grads:
        return out, None
    diff = {n: x for n, x in params.items() if isinstance(x, np.ndarray)}
    with jax.enable_x64(True):
        def f(q, k, v, sinks, diff):
            return contract_attention(q, k, v, xp=jnp, params={**params, **diff}, sinks=sinks,
                                      stop_gradient=jax.lax.stop_gradient, **kw)

        a = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
             None if sinks is None else jnp.asarray(sinks),
             {n: jnp.asarray(x) for n, x in diff.items()})
        grad = jax.jit(lambda a, c: jax.vjp(f, *a)[1](c))
        dq, dk, dv, dsinks, dch = grad(a, jnp.asarray(cot))
        grads = {"q": np.asarray(dq), "k": np.asarray(dk), "v": np.asarray(dv)}
        if dsinks is not None:
            grads["sinks"] = np.asarray(dsinks)
        grads.update({f"scheme.{n}": np.asarray(g) for n, g in dch.items()})
    return out, grads


def empty_rows(case: Case):
    """bool ``[B, Tq, N]``: query rows with no visible key (masks and -inf mods)."""
    _, mmod = _ref_mods(case)
    vis = visible_any(case.B, case.N, case.Tq, case.Tk, causal=case.causal,
                      q_positions=case.np_("q_positions"), kv_positions=case.np_("kv_positions"),
                      segment_ids=case.np_("segment_ids"),
                      kv_segment_ids=case.np_("kv_segment_ids"), mask_mod=mmod)
    if case.score_mod == "hide_row3":
        qp = case.np_("q_positions")
        qp = (np.arange(case.Tq) + case.Tk - case.Tq)[None] if qp is None else qp
        vis = vis & (np.broadcast_to(qp, (case.B, case.Tq)) != 3)[:, None, :, None]
    return np.swapaxes(~vis.any(-1), 1, 2)


# ------------------------------------------------------------------------ tolerances
def tolerance(case: Case) -> float:
    """Absolute tolerance relative to the largest reference magnitude, from the dtype:
    the inputs are exact in both (rounded to the dtype first), so what differs is the
    rounding of the softmax weights / output to the dtype (``eps / 2`` each) and float32
    accumulation; 8 ulps of the dtype covers both with margin, and a wrong bias of even
    one bf16 ulp of a score (0.0078 at |s| ~ 1) exceeds it only when it moves weights
    by more than that, as a bf16-rounded bias at positions near 1000 does (0.64)."""
    eps = float(jnp.finfo(jnp.dtype(case.dtype)).eps)
    return 8 * eps if case.dtype != "float32" else 2e-5


# ------------------------------------------------------------------------------ paths
def _every_shape_and_training_schemes(cid: str) -> bool:
    """Default-run cases of the reference path: every call shape with no scheme, and the
    training shape with every scheme (decode and far positions per scheme: slow)."""
    return cid.endswith("-none") or cid.startswith("training-")


def _every_shape(cid: str) -> bool:
    """Default-run cases of the chunked and xla paths: every call shape with no scheme,
    and two score-term schemes in training shape (a scheme's transform runs before any
    path, so the reference's scheme cases cover it; every combination runs in the slow
    run)."""
    return cid.endswith("-none") or cid in ("training-alibi", "training-t5")


@dataclasses.dataclass(frozen=True)
class Path:
    """An implementation: ``attend(q, k, v, scheme, sinks, **kw) -> out`` (or ``run``,
    case -> ``(out, grads)``), which cases it takes (``takes``: None = all), which of
    them run in the default run (``default``: a predicate on the case id; the rest are
    ``slow``), whether to ``jit`` the call, and ``kv_dtype`` for quantised pages (the
    reference is then the contract on the keys and values the pages hold)."""

    attend: Callable | None
    takes: Callable[[Case], bool] | None = None
    default: Callable[[str], bool] = _every_shape
    jit: bool = True
    run: Callable | None = None  # case -> (out, grads or None), instead of attend
    kv_dtype: str | None = None  # quantised pages: checked against the dequantised k, v


def _via(impl, **extra):
    def attend(q, k, v, scheme, sinks, **kw):
        return jaxpos.attention(q, k, v, position=scheme, sinks=sinks, implementation=impl,
                                **extra, **kw)
    return attend


def run_module_decode(case: Case):
    """``(out, None)`` of the Flax modules' KV-cache decode on the case: a real
    :class:`jaxpos.nnx.MultiHeadAttention` whose projections select the case's q, k, v
    from the input (0/1 kernels: exact in every dtype) and whose output projection
    selects the attention output; the first ``Tk - Tq`` tokens are written by one
    ``decode`` call (the prefill), the queries' own tokens by a second, into a cache with
    three empty slots holding NaN. Forward only (decoding takes no gradients)."""
    from flax import nnx

    from jaxpos import nnx as jnnx
    from jaxpos.layers.cache import decode_state_cache

    q, k, v, _ = case.arrays()
    dt = jnp.dtype(case.dtype)
    B, Tq, N, H = q.shape
    Tk, Nk = k.shape[1], k.shape[2]
    dq, dkv = N * H, Nk * H
    D = dq + 2 * dkv
    x = np.zeros((B, Tk, D))
    x[:, Tk - Tq:, :dq] = q.reshape(B, Tq, dq)
    x[:, :, dq:dq + dkv] = k.reshape(B, Tk, dkv)
    x[:, :, dq + dkv:] = v.reshape(B, Tk, dkv)
    eye = np.eye(D, dtype=np.float32)
    mha = jnnx.MultiHeadAttention(D, N, num_kv_heads=Nk, head_dim=H, causal=case.causal,
                                  sinks=case.sinks is not None,
                                  mask_mod=None if case.mask_mod is None
                                  else MASK_MODS[case.mask_mod], dtype=dt, rngs=nnx.Rngs(0))
    mha.q_proj.kernel[...] = jnp.asarray(eye[:, :dq])
    mha.k_proj.kernel[...] = jnp.asarray(eye[:, dq:dq + dkv])
    mha.v_proj.kernel[...] = jnp.asarray(eye[:, dq + dkv:])
    mha.o_proj.kernel[...] = jnp.asarray(eye[:dq, :])
    if case.sinks is not None:
        mha.sinks[...] = jnp.asarray(case.sinks, jnp.float32)
    scheme = SCHEMES[case.scheme][1](SCHEMES[case.scheme][0])
    # a scheme computed from the tokens (FoX's gates) is given per call: its new tokens'
    steps = [scheme, scheme]
    if getattr(scheme, "log_forget", None) is not None:
        steps = [scheme.replace(log_forget=scheme.log_forget[:, a:b])
                 for a, b in ((0, Tk - Tq), (Tk - Tq, Tk))]
    kvp = np.broadcast_to(np.arange(Tk) if case.kv_positions is None
                          else case.np_("kv_positions"), (B, Tk))
    # the cache with the decode state of a scheme that keeps one (FoX's gates)
    cache = decode_state_cache(mha.init_cache(B, Tk + 3), (case.scheme, None), N, H)
    inner = getattr(cache, "inner", cache)
    if hasattr(inner, "_replace"):  # the empty slots hold NaN (never read into the result)
        filled = inner._replace(k=jnp.full_like(inner.k, jnp.nan),
                                v=jnp.full_like(inner.v, jnp.nan))
        cache = filled if inner is cache else dataclasses.replace(cache, inner=filled)
    xx = jnp.asarray(x, dt)
    if Tk > Tq:
        _, cache = mha.decode(xx[:, :Tk - Tq], cache, positions=kvp[:, :Tk - Tq],
                              scheme=steps[0])
    y, _ = mha.decode(xx[:, Tk - Tq:], cache, positions=kvp[:, Tk - Tq:], scheme=steps[1])
    out = np.asarray(jnp.asarray(y[..., :dq]).astype(jnp.float32), np.float64)
    return out.reshape(B, Tq, N, H), None


def _with_unfilled_slots(impl, extra=13, **opts):
    """``attend`` through ``impl`` against a cache with ``extra`` unfilled slots after the
    case's keys: k and v NaN there, ``kv_lengths`` = the case's ``Tk``, so any read of an
    unfilled slot into the result or the gradients (even as ``0 * NaN``) shows; key
    positions and segment ids continue past the filled ones. Default query positions
    stay default: with ``kv_lengths`` the queries are the last tokens of the fill."""
    def attend(q, k, v, scheme, sinks, *, q_positions=None, kv_positions=None,
               segment_ids=None, kv_segment_ids=None, **kw):
        B, Tq = q.shape[:2]
        Tk = k.shape[1]
        if kv_positions is None:  # arange; the default q_positions (None) then put the
            kv_positions = np.arange(Tk)  # queries at the end of the fill, not the buffer
        kvp = np.broadcast_to(np.asarray(kv_positions), (B, Tk))
        kvp = np.concatenate([kvp, kvp[:, -1:] + 1 + np.arange(extra)[None].repeat(B, 0)], 1)
        pad = (B, extra) + k.shape[2:]
        k = jnp.concatenate([k, jnp.full(pad, jnp.nan, k.dtype)], axis=1)
        v = jnp.concatenate([v, jnp.full(pad[:3] + v.shape[3:], jnp.nan, v.dtype)], axis=1)
        if kv_segment_ids is not None:
            seg = np.asarray(kv_segment_ids)
            kv_segment_ids = np.concatenate([seg, seg[:, -1:].repeat(extra, 1)], 1)
        return jaxpos.attention(q, k, v, position=scheme, sinks=sinks, implementation=impl,
                                q_positions=q_positions, kv_positions=kvp,
                                segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                                kv_lengths=jnp.full((B,), Tk, jnp.int32), **opts, **kw)
    return attend


def _quantised_pools(k, v, table, num_pages, page_size, kv_dtype):
    """Quantised pools holding the rows ``k``, ``v`` ``[B, Tk, N_kv, H]`` in the pages of
    ``table``, written by the library's own write (:func:`write_pages`: one scale per
    token and KV head, computed at write); every slot nobody wrote has scale NaN, so it
    dequantises to NaN (what reading an unwritten slot must never show)."""
    stored = kv_storage_dtype(kv_dtype)

    def base(x):
        shape = (num_pages, page_size) + x.shape[2:]
        return QuantisedPages(jnp.zeros(shape, stored), jnp.full(shape[:-1] + (1,), jnp.nan,
                                                                 jnp.float32), x.dtype)

    B = k.shape[0]
    kp, vp, _, overflow = write_pages(base(k), base(v), k, v, jnp.asarray(table),
                                      jnp.zeros((B,), jnp.int32))
    del overflow  # the table has a page for every key
    return kp, vp


def dequantised_round_trip(x: np.ndarray, kv_dtype: str, dtype: str) -> np.ndarray:
    """float64 ``x`` as quantised pages hold it: ``x`` in ``dtype`` quantised exactly as
    :func:`write_pages` quantises a token (:func:`jaxpos.core.quantised.quantise`), then
    ``values * scales`` computed in float64."""
    vals, scales = quantise(jnp.asarray(x, jnp.dtype(dtype)), kv_storage_dtype(kv_dtype))
    return np.asarray(vals).astype(np.float64) * np.asarray(scales).astype(np.float64)


def _paged(impl, page_size=3, spare=2, ragged=False, kv_dtype=None, rope_on_load=False,
           **opts):
    """``attend`` through ``impl`` with k and v stored in pages of ``page_size`` slots
    (FlashAttention's paged layout), ``jaxpos.attention(q, k_pages, v_pages, page_table=,
    kv_lengths=)``: each row's pages are scattered over a pool in a shuffled order, the
    pool holds ``spare`` pages nobody owns, each row's table has one more entry (-1) than
    its keys need, and the last page is only partly filled. Unowned pages and unfilled
    slots hold NaN keys and values (what a freed page holds: any read of them into the
    result or the gradients shows, even as ``0 * NaN``). Key positions and segment ids
    continue past the filled keys; the default positions are the paged call's own
    (queries at the end of each row). ``ragged``: the queries packed ``[B * Tq, N, H]``
    with ``cu_q_lengths`` (the ragged call), the output unpacked. ``kv_dtype``
    (``"int8"``, ``"float8_e4m3fn"``): the pools are :class:`QuantisedPages` written by
    :func:`write_pages` (:func:`_quantised_pools`). ``rope_on_load``: a RoPE scheme is
    passed as its ``rope_tables`` (``RoPE.load_tables`` of the query and slot positions)
    with ``position=None``, so the engine rotates the raw keys as it loads them."""
    def attend(q, k, v, scheme, sinks, *, q_positions=None, kv_positions=None,
               segment_ids=None, kv_segment_ids=None, **kw):
        B, Tk, Nk, H = k.shape
        if ragged:
            Tq = q.shape[1]
            kw["cu_q_lengths"] = np.arange(B + 1, dtype=np.int32) * Tq
            if q_positions is not None:
                q_positions = np.broadcast_to(np.asarray(q_positions), (B, Tq)).reshape(-1)
            out = _paged(impl, page_size, spare, kv_dtype=kv_dtype, **opts)(
                q.reshape((B * Tq,) + q.shape[2:]), k, v, scheme, sinks,
                q_positions=q_positions, kv_positions=kv_positions, **kw)
            return out.reshape((B, Tq) + out.shape[1:])
        used = -(-Tk // page_size)
        pps = used + 1
        S = pps * page_size
        num_pages = B * used + spare
        order = np.random.default_rng(3).permutation(num_pages)[:B * used]
        table = np.full((B, pps), -1, np.int32)
        table[:, :used] = order.reshape(B, used)

        def pool(x, fill):
            xs = jnp.concatenate([x, jnp.full((B, used * page_size - Tk) + x.shape[2:], fill,
                                              x.dtype)], axis=1)
            base = jnp.full((num_pages, page_size) + x.shape[2:], fill, x.dtype)
            return base.at[jnp.asarray(order)].set(
                xs.reshape((B * used, page_size) + x.shape[2:]))

        def extend(x, step):
            x = np.broadcast_to(np.asarray(x), (B, Tk))
            tail = x[:, -1:] + step * (1 + np.arange(S - Tk))[None]
            return np.concatenate([x, tail], 1)

        if kv_positions is not None:
            kv_positions = extend(kv_positions, 1)
        if kv_segment_ids is not None:
            kv_segment_ids = extend(kv_segment_ids, 0)
        if kv_dtype is None:
            k_pages, v_pages = pool(k, jnp.nan), pool(v, jnp.nan)
        else:
            k_pages, v_pages = _quantised_pools(k, v, table, num_pages, page_size, kv_dtype)
        if rope_on_load and isinstance(scheme, jaxpos.RoPE):
            Tq = q.shape[1]
            qp = (np.broadcast_to(np.arange(Tq) + Tk - Tq, (B, Tq)) if q_positions is None
                  else q_positions)  # the paged call's default: the end of each row
            kvp = np.arange(S)[None] if kv_positions is None else kv_positions
            kw["rope_tables"] = scheme.load_tables(qp, kvp)
            scheme = None
        return jaxpos.attention(q, k_pages, v_pages, page_table=table,
                                kv_lengths=np.full((B,), Tk, np.int32), position=scheme,
                                sinks=sinks, implementation=impl, q_positions=q_positions,
                                kv_positions=kv_positions, segment_ids=segment_ids,
                                kv_segment_ids=kv_segment_ids, **opts, **kw)
    return attend


def _forward_only(attend):
    """``run(case) -> (out, None)``: the forward pass of ``attend`` (a path without
    gradients)."""
    def run(case: Case):
        return run_attention(dataclasses.replace(case, grads=False), attend)
    return run


#: Default-run cases of the paged chunked path (the rest run in the slow run).
PAGED_DEFAULT = ("decode-none", "decode-alibi", "decode-t5", "decode-rope", "decode-fox",
                 "gqa-none",
                 "sliding_window-none", "sinks-none", "left_padded-none", "training-none")


def _ragged_cases(*ids: str) -> list[Case]:
    """The cases of these ids (the ragged paths take a few)."""
    cases = dict(all_cases())
    return [cases[i] for i in ids]


#: The cases the int8 paged paths take (decode with every scheme, a few call shapes).
_INT8_SHAPES = tuple(f"decode-{s}" for s in SCHEMES) + (
    "sinks-none", "sliding_window-none", "left_padded-none", "prefill_chunk-none")


def _int8_takes(*ids: str) -> Callable[[Case], bool]:
    """``takes``: the cases of these ids (ids of shapes a scheme does not join are
    ignored)."""
    cases = dict(all_cases())
    chosen = [cases[i] for i in ids if i in cases]
    return lambda case: case in chosen


#: Default-run cases of the kv_lengths paths (a cache with unfilled slots).
KV_LENGTHS_DEFAULT = ("decode-none", "decode-rope", "decode-alibi", "decode-t5", "gqa-none",
                      "training-none", "sinks_minus_inf_empty_rows-none")


def _module_takes(case: Case) -> bool:
    # the cache hides its empty slots with segment ids, so a case with its own segments
    # is not a decode call; the queries must be the last keys' tokens
    # and the module has no score_mod argument
    return case.segment_ids is None and case.self_attention and case.score_mod is None and (
        case.q_positions is None or case.q_positions == case.kv_positions or case.Tq == case.Tk)


def _flax_adapter(q, k, v, scheme, sinks, *, causal, q_positions, kv_positions,
                  segment_ids=None, kv_segment_ids=None, score_mod=None, mask_mod=None):
    """``jaxpos.flax_attention_fn`` called as Flax's attention modules call it, with
    dropout off (``dropout_rate=0.0``, ``deterministic=False``, Flax's default
    ``broadcast_dropout=True``): a full pass with ``is_causal``, or a ``decode=True`` step
    (one query, the whole cache and Flax's cache mask ``arange(max_len) <= cache_index``,
    here every slot filled)."""
    B, Tq = q.shape[:2]
    Tk = k.shape[1]
    fn = jaxpos.flax_attention_fn(scheme, score_mod=score_mod, mask_mod=mask_mod)
    mask = jnp.ones((B, 1, 1, Tk), jnp.float32) if Tq == 1 < Tk else None
    return fn(q, k, v, mask=mask, is_causal=causal and Tq == Tk, dropout_rate=0.0,
              dropout_rng=None, deterministic=False)


def _flax_adapter_takes(case: Case) -> bool:
    # Flax's modules pass no positions, segments or sinks: arange positions, a full pass
    # (Tq == Tk) or a decode step (Tq == 1); its decode step is not causal (a cache mask),
    # which FoX refuses
    return case.q_positions is None and case.segment_ids is None and case.sinks is None and \
        (case.Tq == case.Tk or (case.Tq == 1 and case.scheme != "fox")) and \
        case.self_attention


def _ring_takes(case: Case) -> bool:
    return case.Tq % 8 == 0 and case.Tk % 8 == 0


#: The devices of Ulysses' axis in the conformance run (it must divide the heads).
ULYSSES_DEVICES = 4
#: USP's mesh in the conformance run: (ring, ulysses) devices.
USP_MESH = (2, 2)


def _ulysses_takes(case: Case) -> bool:
    P = ULYSSES_DEVICES
    return case.N % P == 0 and case.Tq % P == 0 and case.Tk % P == 0


def _usp_takes(case: Case) -> bool:
    R, U = USP_MESH
    return case.N % U == 0 and case.Tq % (R * U) == 0 and case.Tk % (R * U) == 0


#: Default-run cases of the Pallas interpreter (slow on CPU): the kernel's findings and
#: one case per family; every case runs in the slow run.
PALLAS_DEFAULT = ("training-alibi", "decode-none", "empty_rows_causal_segments-none",
                  "sinks_minus_inf_empty_rows-none", "bfloat16-none")

#: Default-run cases of the Flax adapter (the rest run in the slow run).
FLAX_ADAPTER_DEFAULT = ("training-none", "training-rope", "training-t5", "decode-rope",
                        "decode-alibi", "sliding_window-none", "bfloat16-none")

#: name -> Path. A new implementation joins here.
IMPLEMENTATIONS: dict[str, Path] = {
    "reference": Path(_via("reference"), default=_every_shape_and_training_schemes),
    "chunked": Path(_via("chunked", block_q=4, block_k=4)),
    "pallas": Path(_via("pallas", block_q=4, block_k=4),
                   default=lambda cid: cid in PALLAS_DEFAULT),
    # eager, as most users call it: under jit the positions are traced and the
    # is_causal route (arange positions) is never taken
    "xla": Path(_via("xla"), jit=False),
    # an engine registered by a test (tests/conformance/_dense_float32_engine.py)
    "dense_float32": Path(_via("dense_float32"), takes=lambda case: case.dtype == "float32"),
    # kv_lengths: a cache with unfilled slots (NaN keys and values) past the case's keys;
    # the chunked decode path (Tq <= 16) and the tiled path (longer Tq) skip them, the
    # reference and the kernel never let them enter the product (forward and backward)
    "chunked_kv_lengths": Path(_with_unfilled_slots("chunked", block_k=4),
                               default=lambda cid: cid in KV_LENGTHS_DEFAULT),
    "reference_kv_lengths": Path(_with_unfilled_slots("reference"),
                                 default=lambda cid: cid in ("decode-none", "training-none",
                                                             "prefill_chunk-none")),
    "pallas_kv_lengths": Path(_with_unfilled_slots("pallas", block_q=4, block_k=4),
                              default=lambda cid: cid == "prefill_chunk-none"),
    "module_cached_decode": Path(None, run=run_module_decode, takes=_module_takes,
                                 default=lambda cid: cid == "decode-fox"),
    # Flax's attention_fn hook with dropout_rate=0 (jaxpos.flax_attention_fn)
    "flax_adapter": Path(_flax_adapter, takes=_flax_adapter_takes,
                         default=lambda cid: cid in FLAX_ADAPTER_DEFAULT),
    # k and v in pages (jaxpos.core.paged), NaN in every slot past the fill: the chunked
    # path walks the page table (decode shapes) or gathers the pages (longer Tq); the
    # reference and the kernel on the gathered keys
    "paged_chunked": Path(_paged("chunked", block_k=6),
                          default=lambda cid: cid in PAGED_DEFAULT),
    "paged_reference": Path(_paged("reference"),
                            default=lambda cid: cid in ("decode-none", "gqa-none",
                                                        "prefill_chunk-none")),
    # the kernel's paged entry (key tiles of one page, forward only: serving)
    "paged_pallas": Path(None, run=_forward_only(_paged("pallas", page_size=4, block_q=4,
                                                        block_k=4)),
                         default=lambda cid: cid == "decode-alibi"),
    # the ragged call (packed queries, cu_q_lengths) over the same pages: a few cases
    "ragged_chunked": Path(_paged("chunked", ragged=True, block_k=6),
                           takes=lambda case: case in _ragged_cases(
                               "decode-alibi", "prefill_chunk-none", "offset_positions-none",
                               "gqa-none", "sinks-none"),
                           default=lambda cid: cid == "decode-alibi"),
    "ragged_reference": Path(_paged("reference", ragged=True),
                             takes=lambda case: case in _ragged_cases("decode-t5",
                                                                      "prefill_chunk-none"),
                             default=lambda cid: True),
    "ragged_pallas": Path(None, run=_forward_only(_paged("pallas", ragged=True, page_size=4,
                                                         block_q=4, block_k=4)),
                          takes=lambda case: case in _ragged_cases("decode-alibi",
                                                                   "prefill_chunk-none"),
                          default=lambda cid: False),
    # quantised pages (int8 values, a float32 scale per token and KV head, written by
    # write_pages): every path against the contract on the dequantised keys and values,
    # forward only (serving); a few call shapes and the decode shape of every scheme
    "paged_int8_chunked": Path(None, run=_forward_only(_paged("chunked", kv_dtype="int8",
                                                              block_k=6)),
                               takes=_int8_takes(*_INT8_SHAPES, "gqa-none"),
                               default=lambda cid: cid in ("decode-none", "decode-rope",
                                                           "gqa-none"),
                               kv_dtype="int8"),
    "paged_int8_reference": Path(None, run=_forward_only(_paged("reference", kv_dtype="int8")),
                                 takes=_int8_takes("decode-none", "decode-alibi", "sinks-none",
                                                   "prefill_chunk-none"),
                                 default=lambda cid: False, kv_dtype="int8"),
    "paged_int8_pallas": Path(None, run=_forward_only(_paged("pallas", kv_dtype="int8",
                                                             page_size=4, block_q=4,
                                                             block_k=4)),
                              takes=_int8_takes("decode-none", "decode-alibi",
                                                "sliding_window-none", "prefill_chunk-none"),
                              default=lambda cid: False, kv_dtype="int8"),
    # RoPE on load over int8 pages: raw keys dequantised, then rotated by rope_tables as
    # each block (chunked) or page tile (the kernel) is loaded
    "paged_int8_rope_on_load_chunked": Path(
        None, run=_forward_only(_paged("chunked", kv_dtype="int8", rope_on_load=True,
                                       block_k=6)),
        takes=_int8_takes("decode-rope", "positions_1e5_1e6-rope"),
        default=lambda cid: cid == "decode-rope", kv_dtype="int8"),
    "paged_int8_rope_on_load_pallas": Path(
        None, run=_forward_only(_paged("pallas", kv_dtype="int8", rope_on_load=True,
                                       page_size=4, block_q=4, block_k=4)),
        takes=_int8_takes("decode-rope"), default=lambda cid: False, kv_dtype="int8"),
    # float8 e4m3 pages where this JAX has the dtype: one case
    "paged_float8_chunked": Path(
        None, run=_forward_only(_paged("chunked", kv_dtype="float8_e4m3fn", block_k=6)),
        takes=lambda case: "float8_e4m3fn" in QUANTISED_DTYPES and _int8_takes(
            "decode-alibi")(case),
        default=lambda cid: True, kv_dtype="float8_e4m3fn"),
    # run by tests/conformance/_ring_conformance_worker.py in an 8-device subprocess
    "ring": Path(None, takes=_ring_takes, default=lambda cid: False),
    "ulysses": Path(None, takes=_ulysses_takes, default=lambda cid: False),
    "usp": Path(None, takes=_usp_takes, default=lambda cid: False),
}


@functools.cache
def cached_reference(case_id: str, kv_dtype: str | None = None):
    """The float64 contract's ``(out, grads)`` of a case (``kv_dtype``: on the values
    quantised pages of that dtype hold; :func:`reference_case`)."""
    return reference_case(dict(all_cases())[case_id], kv_dtype)


@dataclasses.dataclass(frozen=True)
class Covering:
    """A family of paths that deal their slow cases out among themselves: each case runs
    on ``copies`` of the paths that take it, in turn (by the case's index), rather than
    on every one; ``only(cid)`` limits the rule to some cases (None: all)."""

    family: tuple[str, ...]
    copies: int = 1
    only: Any = None


#: The families (see :class:`Covering`):
#: - the call forms that wrap an engine (unfilled cache slots, pages), one each: the
#:   engines themselves run every case;
#: - the context-parallel methods, one each (USP's inner loop is the ring);
#: - the four engines on the cases that vary the scheme (training, decode, positions
#:   near 1e5-1e6 with RoPE, ALiBi, T5, ...): two engines each, so every engine meets
#:   every call shape and about half the schemes in each, and every scheme meets two
#:   engines in every call shape (the ``none`` cases and the default run's still run
#:   everywhere). The whole product cost about 7 minutes of CI (wrappers and methods)
#:   and 3 more (engines).
COVERING = (Covering(("reference_kv_lengths", "chunked_kv_lengths", "pallas_kv_lengths")),
            Covering(("paged_reference", "paged_chunked", "paged_pallas")),
            Covering(("ring", "ulysses", "usp")),
            Covering(("reference", "chunked", "xla", "pallas"), copies=2,
                     only=lambda cid: not cid.endswith("-none")))


@functools.lru_cache(maxsize=1)
def _case_order() -> tuple[dict, dict]:
    cases = dict(all_cases())
    return cases, {cid: i for i, cid in enumerate(cases)}


def covered_elsewhere(impl: str, cid: str) -> bool:
    """Whether case ``cid`` runs on other paths of ``impl``'s family (see COVERING)."""
    cases, index = _case_order()
    for cover in COVERING:
        if impl in cover.family and (cover.only is None or cover.only(cid)):
            able = [m for m in cover.family if IMPLEMENTATIONS[m].takes is None
                    or IMPLEMENTATIONS[m].takes(cases[cid])]
            start = index[cid] % len(able)
            return impl not in {able[(start + j) % len(able)] for j in range(cover.copies)}
    return False
