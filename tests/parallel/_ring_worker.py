"""Context-parallel checks (ring, Ulysses, USP), run by tests/parallel/test_ring.py and
tests/parallel/test_ulysses.py in a subprocess with 8 CPU devices.

``--xla_force_host_platform_device_count`` must be in ``XLA_FLAGS`` before JAX starts,
so these checks live in their own process (as tests/parallel/_sharding_worker.py). Usage::

    python tests/parallel/_ring_worker.py [--quick | --full] OUT.json

Every check compares :func:`jaxpos.parallel.ring_attention` or
:func:`jaxpos.parallel.ulysses_attention` inside ``jax.shard_map`` (default ``check_vma``
on, except for the Pallas interpreter) over an 8-device ``seq`` axis (USP: a 2 x 4
``ring`` x ``uly`` mesh) with the single-device :func:`jaxpos.attention`
(``implementation="reference"``, the whole score matrix) on the unsharded sequence: the
forward output and the gradients of a random linear function of it with respect to q,
k, v, every array of the scheme, a score_mod's captured table and the attention sinks.
Written to OUT.json as ``{check: max difference}`` (gradients relative to ``max(1, max
|gradient|)`` per array) plus a few other numbers.

``--quick`` (the default test run) covers Ulysses and USP (whose inner loop is the
ring) once each, and the modules' Ulysses call on a (data, seq) mesh; no flag
runs a subset chosen to cover every mechanism once (about a minute of CPU); ``--full``
runs every scheme, the base schemes in two layouts each and with Ulysses or USP, every
other scheme in the zigzag layout with packed segments (see :func:`full_cases`), and the
two-axis mesh.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpos import ALiBi, NoPE, RoPE, Shaw, T5Bias, YaRNScaling, attention
from jaxpos.parallel import from_zigzag, ring_attention, shard_map, to_zigzag, ulysses_attention

jax.config.update("jax_default_matmul_precision", "highest")

NDEV = 8
B, T, N, NK, H = 2, 64, 4, 2, 8  # local length 8 on each of 8 devices
BLOCK = 4  # chunked tiles: 2 x 2 tiles per (local queries, passing block) pair
R = 12  # the captured table's clipping radius


def max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def rel_diff(a, b):
    scale = float(np.max(np.abs(np.asarray(b, np.float64)))) if np.size(b) else 0.0
    return max_diff(a, b) / max(scale, 1.0) if np.size(b) else 0.0


def optional_schemes(N=N):
    """Schemes from modules that may not exist in every checkout (``N`` query heads)."""
    out = {}
    try:
        from jaxpos.schemes.kerple import KERPLE
        out["kerple"] = lambda: KERPLE.init(N, key=jax.random.key(3), kind="log")
        out["kerple_power"] = lambda: KERPLE.init(N, key=jax.random.key(4), kind="power")
    except ImportError:
        pass
    try:
        from jaxpos.schemes.fire import FIRE
        out["fire"] = lambda: FIRE.init(N, key=jax.random.key(5), mlp_width=4, init_L=16.0)
    except ImportError:
        pass
    try:
        from jaxpos.schemes.sandwich import Sandwich
        out["sandwich"] = lambda: Sandwich(N, d_bar=8)
    except ImportError:
        pass
    try:
        from jaxpos.schemes.xpos import XPos
        out["xpos"] = lambda: XPos(H, scale_base=16.0)
    except ImportError:
        pass
    try:
        from jaxpos.schemes.fox import FoX
        gates = np.random.default_rng(2).normal(size=(B, T, N)) + 2.0
        out["fox"] = lambda: FoX(jax.nn.log_sigmoid(jnp.asarray(gates, jnp.float32)))
    except ImportError:
        pass
    try:
        from jaxpos.schemes.rope.scaling import DynamicNTKScaling
        out["rope_dynamic_ntk"] = lambda: RoPE(rotary_dim=H, scaling=DynamicNTKScaling(
            factor=2.0, original_max_position_embeddings=16))
    except ImportError:
        pass
    return out


def make_scheme(name, N=N):
    r = np.random.default_rng(1)
    f32 = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)
    base = {
        "nope": lambda: NoPE(),
        "rope_yarn": lambda: RoPE(rotary_dim=H, scaling=YaRNScaling(
            factor=4.0, original_max_position_embeddings=16)),
        "alibi": lambda: ALiBi(num_heads=N),
        "t5": lambda: T5Bias(f32(32, N), bidirectional=False, max_distance=20),
        "t5_bidirectional": lambda: T5Bias(f32(32, N), bidirectional=True, max_distance=20),
        "shaw": lambda: Shaw(f32(2 * 5 + 1, H) * 0.3, f32(2 * 5 + 1, H) * 0.3),
    }
    base.update(optional_schemes(N))
    return base[name]()


def inputs(seed=0, N=N, NK=NK):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.normal(size=(B, T, N, H)), jnp.float32)
    k = jnp.asarray(r.normal(size=(B, T, NK, H)), jnp.float32)
    v = jnp.asarray(r.normal(size=(B, T, NK, H)), jnp.float32)
    w = jnp.asarray(r.normal(size=(B, T, N, H)), jnp.float32)  # the loss's weights
    return q, k, v, w


def packed(seed=0):
    """Packed sequences: [B, T] segment ids and positions that restart in each segment."""
    r = np.random.default_rng(seed)
    seg = np.zeros((B, T), np.int32)
    pos = np.zeros((B, T), np.int32)
    for b in range(B):
        cuts = np.sort(r.choice(np.arange(3, T - 3), size=3, replace=False))
        ids = np.searchsorted(cuts, np.arange(T), side="right")
        seg[b] = ids
        starts = np.concatenate([[0], cuts])
        pos[b] = np.arange(T) - starts[ids]
    return jnp.asarray(seg), jnp.asarray(pos)


def table_score_mod(table):
    """A learned per-head bias over clipped offsets, captured by the score_mod."""

    def mod(score, batch, head, q_pos, kv_pos):
        return score + table[head, jnp.clip(kv_pos - q_pos, -R, R) + R]

    return mod


def window_mask_mod(batch, head, q_pos, kv_pos):
    return jnp.abs(q_pos - kv_pos) < 20


class Case:
    """One comparison: a scheme, the options of the call and the context-parallel method
    (``"ring"``; ``"ulysses"`` over the 8-device axis; ``"usp"``: Ulysses over the 4-device
    axis ``uly`` and the ring over the 2-device axis ``ring`` of a 2 x 4 mesh)."""

    def __init__(self, scheme, *, causal=True, zigzag=False, segments=False, table=False,
                 sinks=False, mask_mod=False, grad=True, batch_positions=False,
                 implementation=None, method="ring", heads=(N, NK), block=BLOCK):
        self.scheme, self.causal, self.zigzag, self.segments = scheme, causal, zigzag, segments
        self.block = block
        self.table, self.sinks, self.mask_mod, self.grad = table, sinks, mask_mod, grad
        self.batch_positions, self.implementation = batch_positions, implementation
        self.method, self.heads = method, heads

    @property
    def name(self):
        parts = [self.scheme, "causal" if self.causal else "bidir",
                 "zigzag" if self.zigzag else "contiguous"]
        for flag in ("segments", "table", "sinks", "mask_mod", "batch_positions"):
            if getattr(self, flag):
                parts.append(flag)
        if self.implementation:
            parts.append(self.implementation)
        if self.method != "ring":
            parts.append(self.method)
        if self.heads != (N, NK):
            parts.append(f"heads{self.heads[0]}x{self.heads[1]}")
        if self.block != BLOCK:
            parts.append(f"block{self.block}")
        return "/".join(parts)


def _method(case: Case, mesh, axis):
    """(attention function inside shard_map, sequence mesh axes, zigzag device count,
    check_vma) of a case."""
    vma = case.implementation != "pallas"  # the Pallas interpreter cannot track vma
    if case.method == "ring":
        return functools.partial(ring_attention, axis_name=axis), axis, mesh.shape[axis], vma
    if case.method == "ulysses":
        return functools.partial(ulysses_attention, axis_name=axis), axis, mesh.shape[axis], vma
    assert case.method == "usp"
    return (functools.partial(ulysses_attention, axis_name="uly", ring_axis="ring"),
            ("ring", "uly"), mesh.shape["ring"], True)


def run_case(case: Case, mesh, axis="seq", batch_axis=None):
    """{check: difference} for one case, over the devices of ``axis`` (or, for USP, of the
    2 x 4 mesh's ``ring`` and ``uly`` axes)."""
    res = {}
    nh, nkv = case.heads
    q, k, v, w = inputs(0, nh, nkv)
    r = np.random.default_rng(7)
    params = {"scheme": make_scheme(case.scheme, nh)}
    if case.table:
        params["table"] = jnp.asarray(r.normal(size=(nh, 2 * R + 1)) * 0.5, jnp.float32)
    if case.sinks:
        params["sinks"] = jnp.asarray(r.normal(size=(nh,)), jnp.float32)
    if case.segments:
        seg, pos = packed()
        if case.scheme == "fox":  # FoX reads its gates at token indices: pack with arange
            pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    elif case.batch_positions:
        seg, pos = None, jnp.asarray(np.arange(T)[None] + 5 * np.arange(B)[:, None], jnp.int32)
    else:
        seg, pos = None, jnp.arange(T, dtype=jnp.int32)
    mask_mod = window_mask_mod if case.mask_mod else None

    def call(attn, prm, q, k, v, pos, seg, **kw):
        return attn(q, k, v, position=prm["scheme"], q_positions=pos, kv_positions=pos,
                    causal=case.causal, segment_ids=seg,
                    score_mod=table_score_mod(prm["table"]) if "table" in prm else None,
                    mask_mod=mask_mod, sinks=prm.get("sinks"), **kw)

    def plain(prm, q, k, v):
        return call(attention, prm, q, k, v, pos, seg, implementation="reference")

    attn, axis, ndev, vma = _method(case, mesh, axis)
    # the sequence laid out for the devices (zigzag or contiguous)
    zz = (lambda x, axis_: to_zigzag(x, axis_, ndev)) if case.zigzag else (lambda x, axis_: x)
    unzz = (lambda x: from_zigzag(x, 1, ndev)) if case.zigzag else (lambda x: x)
    pos_l = zz(pos, pos.ndim - 1)
    seg_l = None if seg is None else zz(seg, 1)
    seq_spec = P(batch_axis, axis)
    pos_spec = P(batch_axis, axis) if pos.ndim == 2 else P(axis)

    def local(prm, q, k, v, p, s):
        return call(functools.partial(attn, block_q=case.block, block_k=case.block), prm, q,
                    k, v, p, s,
                    implementation=case.implementation)

    ring_fn = shard_map(local, mesh=mesh,
                        in_specs=(P(), seq_spec, seq_spec, seq_spec, pos_spec,
                                  None if seg is None else seq_spec),
                        out_specs=seq_spec, check_vma=vma)

    def ring(prm, q, k, v):
        return unzz(ring_fn(prm, zz(q, 1), zz(k, 1), zz(v, 1), pos_l, seg_l))

    want = jax.jit(plain)(params, q, k, v)
    got = jax.jit(ring)(params, q, k, v)
    res[f"fwd/{case.name}"] = max_diff(got, want)
    res[f"scale/{case.name}"] = float(np.max(np.abs(np.asarray(want))))
    if case.grad:
        loss = lambda f: lambda prm, q, k, v: jnp.sum(f(prm, q, k, v) * w)
        g_want = jax.jit(jax.grad(loss(plain), argnums=(0, 1, 2, 3)))(params, q, k, v)
        g_got = jax.jit(jax.grad(loss(ring), argnums=(0, 1, 2, 3)))(params, q, k, v)
        leaves_w = jax.tree_util.tree_leaves_with_path(g_want)
        leaves_g = jax.tree_util.tree_leaves(g_got)
        assert len(leaves_w) == len(leaves_g)
        for (path, gw), gg in zip(leaves_w, leaves_g):
            res[f"grad/{case.name}/{jax.tree_util.keystr(path)}"] = rel_diff(gg, gw)
        # the scheme's arrays must receive nonzero gradients when they matter
        res[f"grad_norm/{case.name}"] = float(sum(
            np.sum(np.abs(np.asarray(x))) for x in jax.tree_util.tree_leaves(g_want[0])))
    return res


def local_positions_control(mesh, scheme):
    """Negative control: every device passes arange(T / P) as its positions."""
    q, k, v, _ = inputs()
    pos = jnp.arange(T, dtype=jnp.int32)
    sch = make_scheme(scheme)
    want = attention(q, k, v, position=sch, q_positions=pos, kv_positions=pos, causal=True,
                     implementation="reference")
    loc = jnp.arange(T // NDEV, dtype=jnp.int32)
    fn = shard_map(lambda s, q, k, v: ring_attention(q, k, v, axis_name="seq", position=s,
                                                     q_positions=loc, kv_positions=loc,
                                                     causal=True, block_q=BLOCK, block_k=BLOCK),
                   mesh=mesh, in_specs=(P(), P(None, "seq"), P(None, "seq"), P(None, "seq")),
                   out_specs=P(None, "seq"))
    return max_diff(jax.jit(fn)(sch, q, k, v), want)


def hidden_blocks_skipped(mesh):
    """Keys/values of the last device's tokens are NaN: under a causal mask, devices 0..6
    never see them, so their rows (and the gradients of everything but those NaN values)
    are finite and equal the reference only if the hidden blocks are skipped (a computed
    hidden tile would give 0 * NaN = NaN in ``p @ v``)."""
    q, k, v, w = inputs()
    pos = jnp.arange(T, dtype=jnp.int32)
    sch = make_scheme("t5")
    last = T - T // NDEV
    v_nan = v.at[:, last:].set(jnp.nan)
    want = attention(q[:, :last], k[:, :last], v[:, :last], position=sch,
                     q_positions=pos[:last], kv_positions=pos[:last], causal=True,
                     implementation="reference")
    fn = shard_map(lambda s, q, k, v, p: ring_attention(q, k, v, axis_name="seq", position=s,
                                                        q_positions=p, kv_positions=p,
                                                        causal=True, block_q=8, block_k=8),
                   mesh=mesh, in_specs=(P(), P(None, "seq"), P(None, "seq"), P(None, "seq"),
                                        P("seq")),
                   out_specs=P(None, "seq"))
    got = jax.jit(fn)(sch, q, k, v_nan, pos)
    loss = lambda q_: jnp.sum(fn(sch, q_, k, v_nan, pos)[:, :last] * w[:, :last])
    dq = jax.jit(jax.grad(loss))(q)
    return {"skip/fwd_rows_before_last_device": max_diff(got[:, :last], want),
            "skip/dq_finite": float(np.all(np.isfinite(np.asarray(dq[:, :last]))))}


def context_attention_with_data_axis(devices):
    """The modules' context-parallel call (:func:`jaxpos.parallel.context.context_attention`,
    ``shard_map`` manual over ``seq`` only) on a (data=2) x (seq=4) mesh with Auto axes
    (examples/train_sharded.py runs Explicit ones, ``-m slow``), Ulysses with ALiBi's
    per-head slopes and grouped heads: forward and the gradients of q, k, v against the
    single-device call. The data axis is left to the compiler inside; a nested per-shard
    ``shard_map`` there once failed (a closed-over head offset; the gradients' varying
    types)."""
    from jax.sharding import AxisType

    from jaxpos.parallel.context import context_attention

    q, k, v, w = inputs(0, 8, 2)
    pos = jnp.arange(T, dtype=jnp.int32)
    kw = dict(position=ALiBi(8), causal=True, implementation="chunked", block_q=BLOCK,
              block_k=BLOCK)
    plain = lambda q, k, v: attention(q, k, v, **{**kw, "implementation": "reference"})
    loss = lambda f: jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) * w), (0, 1, 2)))
    want, g_want = jax.jit(plain)(q, k, v), loss(plain)(q, k, v)
    res = {}
    for kind in (AxisType.Auto,):
        name = f"ctx_data_axis/ulysses/{kind.name.lower()}"
        mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(kind,) * 2,
                             devices=devices)
        cp = lambda q, k, v: context_attention(q, k, v, method="ulysses", axis="seq",
                                               q_positions=pos, kv_positions=pos, **kw)
        try:
            with jax.set_mesh(mesh):
                res[f"{name}/fwd"] = max_diff(jax.jit(cp)(q, k, v), want)
                res[f"{name}/grad"] = max(rel_diff(a, b) for a, b in zip(loss(cp)(q, k, v),
                                                                         g_want))
        except Exception as e:  # noqa: BLE001 (reported, so the other checks still run)
            res[f"{name}/fwd"] = res[f"{name}/grad"] = float("inf")
            res[f"error/{name}"] = f"{type(e).__name__}: {e}"[:500]
    return res


DEFAULT_CASES = [
    Case("t5", segments=True),  # packed sequences, bucketed table gradient
    Case("rope_yarn", zigzag=True),  # a scaled rotation at global positions, zigzag
    Case("alibi", causal=False, batch_positions=True),  # [B, T] positions, bidirectional
    Case("shaw", zigzag=True, segments=True),  # content bias + value term
    Case("nope", table=True, sinks=True, mask_mod=True),  # captured table, sinks, mask_mod
    Case("kerple", zigzag=True),  # learnable kernel parameters
    # Ulysses over 8 devices needs 8 query heads; 2 KV heads are repeated 4 times
    Case("t5", segments=True, table=True, sinks=True, method="ulysses", heads=(8, 2)),
    Case("alibi", zigzag=True, mask_mod=True, method="ulysses", heads=(8, 8)),
    Case("rope_yarn", zigzag=True, sinks=True, method="usp"),
    # the ring's blocks on the fused kernel (the Pallas interpreter on CPU)
    Case("t5", segments=True, table=True, sinks=True, implementation="pallas"),
]

#: The default test run's cases (one subprocess, a few seconds each): the ring once, and
#: Ulysses (per-head table, sinks, GQA repeat, a mask_mod, KV heads split) and USP once.
QUICK_CASES = [  # (USP's inner loop is the ring)
    # tiles of the local length T / 8: the tile at which the call's mods were first traced
    # (without Ulysses' head offset; they were once reused, each device reading heads 0-1)
    Case("t5", segments=True, table=True, sinks=True, method="ulysses", heads=(8, 2),
         block=T // NDEV),
    Case("rope_yarn", zigzag=True, sinks=True, mask_mod=True, method="usp", heads=(8, 4)),
]


def ulysses_errors(mesh):
    """The messages of the bad-input errors that need more than one device."""
    q = jnp.zeros((1, T, 4, H), jnp.float32)
    pos = jnp.arange(T, dtype=jnp.int32)
    fn = shard_map(lambda q, p: ulysses_attention(q, q, q, axis_name="seq", q_positions=p,
                                                  kv_positions=p),
                   mesh=mesh, in_specs=(P(None, "seq"), P("seq")), out_specs=P(None, "seq"))
    try:
        jax.jit(fn)(q, pos)
        msg = "no error"
    except ValueError as e:
        msg = str(e)
    return {"error/heads_not_divisible": msg}


BASE_SCHEMES = ["nope", "rope_yarn", "alibi", "t5", "shaw"]


def full_cases(available):
    """Every scheme on the ring, Ulysses and USP, in a covering rather than the whole
    product (63 cases took about 7 minutes of CI, a first covering of 38 about 4): each
    base scheme in one of the four ring layouts (zigzag or not x packed segments or not,
    taking turns, so every layout runs) and with one of Ulysses or USP (taking turns);
    every other scheme in the zigzag ring with packed segments (the case that exercises
    every mechanism at once), every third of them also with Ulysses."""
    layouts = [(z, g) for z in (False, True) for g in (False, True)]
    cases = []
    for i, s in enumerate(BASE_SCHEMES):
        zigzag, segments = layouts[i % 4]
        cases.append(Case(s, zigzag=zigzag, segments=segments))
        cases.append(Case(s, segments=True, method="ulysses", heads=(8, 4)) if i % 2 == 0
                     else Case(s, zigzag=True, method="usp"))
    for i, s in enumerate(sorted(available)):
        cases.append(Case(s, zigzag=True, segments=True))
        if i % 3 == 0:
            cases.append(Case(s, segments=True, method="ulysses", heads=(8, 4)))
    cases += [Case("t5_bidirectional", causal=False, zigzag=True),
              Case("alibi", causal=False, zigzag=True, segments=True),
              Case("rope_yarn", zigzag=True, table=True, sinks=True, mask_mod=True),
              Case("t5", zigzag=True, implementation="reference"),
              Case("rope_yarn", zigzag=True, mask_mod=True, implementation="pallas",
                   heads=(4, 1)),
              Case("alibi", causal=False, batch_positions=True, implementation="pallas"),
              Case("shaw", causal=False, batch_positions=True),
              Case("t5_bidirectional", causal=False, method="ulysses", heads=(8, 1)),
              Case("alibi", causal=False, batch_positions=True, method="ulysses",
                   heads=(16, 8)),
              Case("t5", table=True, sinks=True, method="ulysses", heads=(8, 8),
                   implementation="pallas"),
              Case("alibi", sinks=True, method="ulysses", heads=(8, 2),
                   implementation="xla"),
              Case("shaw", segments=True, sinks=True, method="usp", heads=(4, 1))]
    return cases


def main(argv):
    full, quick = "--full" in argv, "--quick" in argv
    out_path = next(a for a in argv if not a.startswith("--"))
    devices = jax.devices()
    assert len(devices) == NDEV, devices
    res = {"num_devices": len(devices)}
    t0, cpu0 = time.time(), time.process_time()
    mesh = Mesh(np.array(devices), ("seq",))
    usp_mesh = Mesh(np.array(devices).reshape(2, 4), ("ring", "uly"))
    available = set(optional_schemes())
    res["available/" + ",".join(sorted(available))] = 1.0
    known = set(BASE_SCHEMES) | available
    cases = full_cases(available) if full else [
        c for c in (QUICK_CASES if quick else DEFAULT_CASES) if c.scheme in known]
    for case in cases:
        t1 = time.process_time()
        res.update(run_case(case, usp_mesh if case.method == "usp" else mesh))
        res[f"cpu_seconds/{case.name}"] = time.process_time() - t1
    res.update(ulysses_errors(mesh))
    res.update(context_attention_with_data_axis(devices))
    if quick:  # the modules' context-parallel switch, in the same process
        import _modules_worker

        res.update({f"modules/{k}": v for k, v in _modules_worker.run(full=False).items()})
    if not quick:
        res["local_positions/rope_yarn"] = local_positions_control(mesh, "rope_yarn")
        res["local_positions/t5"] = local_positions_control(mesh, "t5")
        res.update(hidden_blocks_skipped(mesh))
    if full:
        # a (data=2) x (seq=4) mesh: batch over one axis, the ring over the other; the
        # parameters' gradients are summed over both
        mesh2 = Mesh(np.array(devices).reshape(2, 4), ("data", "seq"))
        for case in (Case("t5", zigzag=True, segments=True), Case("shaw", table=True),
                     Case("alibi", segments=True, method="ulysses")):
            res.update({k.replace("/", "/mesh2x4/", 1): v
                        for k, v in run_case(case, mesh2, batch_axis="data").items()})
    res["seconds"] = time.time() - t0
    res["cpu_seconds"] = time.process_time() - cpu0
    with open(out_path, "w") as fh:
        json.dump(res, fh, indent=1, sort_keys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
