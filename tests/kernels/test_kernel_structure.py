"""Structure of the fused kernel, proved on CPU (what makes it fast on a GPU).

1. No per-tile-pair work that depends on one token: RoPE is applied before the kernel,
   or, with ``rope_tables``, rotates q and k as they are loaded from cos/sin tables
   computed once per call; no kernel body contains ``sin`` / ``cos``.
2. Table biases are gathered (one indexed load per tile), not looped: the kernel bodies
   are identical for a T5-style offset vector of radius 16 and of radius 1024, and hold
   no loop besides the two tile loops.
3. Causal structure bounds the loops: counted inside the kernels, query tile ``i``
   visits key tiles ``0..i`` only (and the diagonal is the only masked one), key tile
   ``j``'s dk/dv loop starts at the diagonal; for arbitrary positions the schedule is
   sound (every tile holding a visible pair is visited; FULL tiles really are full),
   checked against brute force.
4. The captured-array gradients are not reduced inside the kernel loops: the dk/dv
   kernel writes dk and dv only, and the outside pass that computes them is removed
   under ``jit`` when no captured array needs a gradient (no scatter is lowered).
5. The Triton IR itself (printed by Pallas while lowering for ``cuda``): two flat
   ``scf.for`` tile loops per kernel, no ``scf.if`` (a per-tile ``cond`` defeats Triton's
   software pipelining), no sin/cos, and identical operations for table radius 16 and 1024.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.extend import core as jex

from jaxpos.kernels import _testing as kernel_testing
from jaxpos.kernels import attention_via_kernel, fused, fused_attention
from jaxpos.kernels import schedule as sched_lib


def _subjaxprs(eqn):
    for p in eqn.params.values():
        for s in (p if isinstance(p, (list, tuple)) else [p]):
            if isinstance(s, jex.ClosedJaxpr):
                yield s.jaxpr
            elif isinstance(s, jex.Jaxpr):
                yield s


def _kernel_eqns(jaxpr):
    """``{kernel name: pallas_call equation}`` of every kernel in ``jaxpr``."""
    out = {}

    def walk(j):
        for e in j.eqns:
            if e.primitive.name == "pallas_call":
                name = e.params.get("name") or str(e.params.get("name_and_src_info")).split()[0]
                out[name] = e
                continue
            for s in _subjaxprs(e):
                walk(s)

    walk(jaxpr)
    return out


def _kernels(jaxpr):
    """``{kernel name: kernel body jaxpr}``."""
    return {n: e.params["jaxpr"] for n, e in _kernel_eqns(jaxpr).items()}


def _primitives(jaxpr, acc=None):
    acc = {} if acc is None else acc
    for e in jaxpr.eqns:
        acc[e.primitive.name] = acc.get(e.primitive.name, 0) + 1
        for s in _subjaxprs(e):
            _primitives(s, acc)
    return acc


B, T, N, H = 1, 64, 2, 16
POS = jnp.arange(T)


def _grad_jaxpr(f, *args):
    return jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(f(*a)), argnums=tuple(range(len(args)))))(
        *args).jaxpr


def test_rope_is_outside_the_kernels():
    q = jnp.zeros((B, T, N, H))
    inv_freq = jnp.asarray(1.0 / 10000.0 ** (np.arange(H // 2) / (H // 2)), jnp.float32)

    def f(q, k, v, inv_freq):
        return fused_attention(q, k, v, q_positions=POS, kv_positions=POS, inv_freq=inv_freq,
                               causal=True, block_q=16, block_k=16, interpret=True)

    jaxpr = _grad_jaxpr(f, q, q, q, inv_freq)
    kernels = _kernels(jaxpr)
    assert set(kernels) == {"jaxpos_attention_fwd", "jaxpos_attention_dq",
                            "jaxpos_attention_dkv"}
    for name, body in kernels.items():
        prims = _primitives(body)
        assert "sin" not in prims and "cos" not in prims, (name, prims)
    outside = _primitives(jaxpr)  # the rotation is there, once per token
    assert outside.get("sin", 0) > 0 and outside.get("cos", 0) > 0


def _t5_kernels(R):
    q = jnp.zeros((B, T, N, H))
    vec = jnp.zeros((N, 2 * R + 1))

    def f(q, vec):
        mod = lambda s, b, h, qp, kp: s + vec[h][jnp.clip(kp - qp, -R, R) + R]
        return attention_via_kernel(q, q, q, score_mod=mod, q_positions=POS, kv_positions=POS,
                                    causal=True, block_q=16, block_k=16, interpret=True)

    return _kernels(_grad_jaxpr(f, q, vec))


def test_offset_table_is_gathered_not_looped():
    small, large = _t5_kernels(16), _t5_kernels(1024)
    assert set(small) == set(large) and len(small) == 3
    for name in small:
        ps, pl_ = _primitives(small[name]), _primitives(large[name])
        assert ps == pl_, (name, ps, pl_)  # the same body whatever the table size
        assert ps.get("while", 0) == 2, (name, ps)  # the PARTIAL and FULL tile loops only


def _expected_kinds(q_pos, kv_pos, causal, bq, bk, seg_q=None, seg_kv=None):
    """Brute force: the exact kind of every tile from its visible pairs ([nq, nk])."""
    Tq, Tk = len(q_pos), len(kv_pos)
    nq, nk = -(-Tq // bq), -(-Tk // bk)
    vis = np.ones((Tq, Tk), bool)
    if causal:
        vis &= kv_pos[None, :] <= q_pos[:, None]
    if seg_q is not None:
        vis &= seg_q[:, None] == seg_kv[None, :]
    kinds = np.zeros((nq, nk), int)
    for i in range(nq):
        for j in range(nk):
            blk = vis[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
            padded = (j + 1) * bk > Tk
            kinds[i, j] = (sched_lib.EMPTY if not blk.any() else
                           sched_lib.FULL if blk.all() and not padded else sched_lib.PARTIAL)
    return kinds


def test_causal_loops_stop_and_start_at_the_diagonal():
    """Counted inside the kernels (interpret mode): T=64, 16 x 16 tiles, causal, arange
    positions. Query tile i visits i + 1 key tiles, of which only the diagonal is masked;
    key tile j's dk/dv loop visits query tiles j..3, only the diagonal masked."""
    q = jax.random.normal(jax.random.PRNGKey(0), (B, T, N, H))
    fwd, dkv = kernel_testing.tile_visits(q, q, q, q_positions=POS, kv_positions=POS,
                                          causal=True, block_q=16, block_k=16)
    fwd, dkv = np.asarray(fwd), np.asarray(dkv)  # [B, N, tiles, (masked, unmasked)]
    np.testing.assert_array_equal(fwd[0, 0], [[1, 0], [1, 1], [1, 2], [1, 3]])
    np.testing.assert_array_equal(dkv[0, 1], [[1, 3], [1, 2], [1, 1], [1, 0]])


@pytest.mark.slow
def test_causal_loops_with_block_q_twice_block_k():
    """32 x 16 tiles: query tile i visits key tiles 0..2i+1 (the two on the diagonal
    masked); key tile j's loop starts at query tile j // 2."""
    q = jax.random.normal(jax.random.PRNGKey(0), (B, T, N, H))
    fwd, dkv = kernel_testing.tile_visits(q, q, q, q_positions=POS, kv_positions=POS,
                                          causal=True, block_q=32, block_k=16)
    np.testing.assert_array_equal(np.asarray(fwd)[0, 0], [[2, 0], [2, 2]])
    np.testing.assert_array_equal(np.asarray(dkv)[0, 0], [[1, 1], [1, 1], [1, 0], [1, 0]])


_structural = jax.jit(sched_lib.structural_kinds, static_argnames=(
    "causal", "Tq", "Tk", "bq", "bk", "nq", "nk"))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), Tq=st.sampled_from([1, 13]),
       Tk=st.sampled_from([21]),
       bq=st.sampled_from([4, 8]), bk=st.sampled_from([4, 8]), causal=st.booleans(),
       monotone=st.booleans(), segments=st.booleans())
def test_schedule_is_sound_and_tight_for_monotone_positions(seed, Tq, Tk, bq, bk, causal,
                                                             monotone, segments):
    """The tile classification against brute force over every pair: a tile holding a
    visible pair is never EMPTY, a FULL tile is entirely visible; with sorted positions
    (and no segments) the classification is exact, so the loops are as short as the
    visible pairs allow."""
    rng = np.random.default_rng(seed)
    qp = rng.integers(0, 50, Tq)
    kp = rng.integers(0, 50, Tk)
    sq = rng.integers(0, 3, Tq) if segments else None
    sk = rng.integers(0, 3, Tk) if segments else None
    if monotone:
        qp, kp = np.sort(qp), np.sort(kp)
        if segments:
            sq, sk = np.sort(sq), np.sort(sk)
    nq, nk = -(-Tq // bq), -(-Tk // bk)
    pad = lambda x, n, b: np.pad(x, (0, n * b - len(x)), mode="edge")[None]
    kinds = _structural(
        causal=causal, q_pos=jnp.asarray(pad(qp, nq, bq)), kv_pos=jnp.asarray(pad(kp, nk, bk)),
        seg_q=None if sq is None else jnp.asarray(np.pad(sq, (0, nq * bq - Tq))[None]),
        seg_kv=None if sk is None else jnp.asarray(np.pad(sk, (0, nk * bk - Tk))[None]),
        Tq=Tq, Tk=Tk, bq=bq, bk=bk, nq=nq, nk=nk)
    got = np.asarray(kinds)[0, 0]
    want = _expected_kinds(qp, kp, causal, bq, bk, sq, sk)
    assert not np.any((want != sched_lib.EMPTY) & (got == sched_lib.EMPTY)), (got, want)
    assert not np.any((got == sched_lib.FULL) & (want != sched_lib.FULL)), (got, want)
    if monotone and not segments:
        np.testing.assert_array_equal(got, want)
    # The lists the kernel loops over hold exactly the tiles of each kind, ascending.
    sch = jax.jit(sched_lib.build)(kinds)
    for i in range(nq):
        for row, kind in ((0, sched_lib.PARTIAL), (1, sched_lib.FULL)):
            n = int(sch.kv_counts[0, 0, i, 0, row])
            np.testing.assert_array_equal(np.asarray(sch.kv_lists[0, 0, i, row, :n]),
                                          np.flatnonzero(got[i] == kind))


def test_captured_array_gradients_are_outside_and_dead_code_when_unused():
    """The dk/dv kernel writes dk and dv only (no per-tile table gradient). The table's
    gradient pass (a gather's transpose is a scatter-add) is lowered when the table is
    differentiated and removed under jit when only q, k, v are."""
    R, T2, H2 = 128, 256, 64
    pos = jnp.arange(T2)

    def loss(q, vec):
        mod = lambda s, b, h, qp, kp: s + vec[h][jnp.clip(kp - qp, -R, R) + R]
        o = attention_via_kernel(q, q, q, score_mod=mod, q_positions=pos, kv_positions=pos,
                                 causal=True, interpret=False)
        return jnp.sum(o.astype(jnp.float32))

    sds = jax.ShapeDtypeStruct
    args = (sds((B, T2, N, H2), jnp.bfloat16), sds((N, 2 * R + 1), jnp.float32))
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    mlir = {}
    for argnums in ((0,), (0, 1)):
        exp = jax.export.export(jax.jit(jax.grad(loss, argnums=argnums)), platforms=["cuda"],
                                disabled_checks=checks)(*args)
        mlir[argnums] = exp.mlir_module()
    assert mlir[(0,)].count("stablehlo.scatter") == 0
    assert mlir[(0, 1)].count("stablehlo.scatter") > 0
    for m in mlir.values():
        assert m.count("xla.gpu.triton") == 3  # forward, dq, dk/dv: the same three kernels
    vec = jnp.zeros((N, 33))
    jaxpr = _grad_jaxpr(lambda q, vec: attention_via_kernel(
        q, q, q, q_positions=POS, kv_positions=POS, block_q=16, block_k=16, interpret=True,
        score_mod=lambda s, b, h, qp, kp: s + vec[h][jnp.clip(kp - qp, -16, 16) + 16]),
        jnp.zeros((B, T, N, H)), vec)
    assert len(_kernel_eqns(jaxpr)["jaxpos_attention_dkv"].outvars) == 2


def _triton_modules(monkeypatch, capsys, R, rope=False):
    """The Triton IR of the forward, dq and dk/dv kernels as Pallas prints it
    (``pallas_call(debug=True)``) while lowering for ``cuda``: ``{name: module text}``."""
    from jaxpos.kernels import plumbing

    real = plumbing.pallas_call
    monkeypatch.setattr(plumbing, "pallas_call",
                        lambda *a, **k: real(*a, **{**k, "debug": True}))
    T2, H2 = 512, 128
    pos = jnp.arange(T2)

    def loss(q, vec, inv_freq):
        mod = lambda s, b, h, qp, kp: s + vec[h][jnp.clip(kp - qp, -R, R) + R]
        o = fused_attention(q, q, q, score_mod=mod, q_positions=pos, kv_positions=pos,
                            inv_freq=inv_freq if rope else None, causal=True, interpret=False)
        return jnp.sum(o.astype(jnp.float32))

    sds = jax.ShapeDtypeStruct
    args = (sds((B, T2, N, H2), jnp.bfloat16), sds((N, 2 * R + 1), jnp.float32),
            sds((H2 // 2,), jnp.float32))
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    capsys.readouterr()
    jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1))), platforms=["cuda"],
                      disabled_checks=checks)(*args)
    text = capsys.readouterr().out
    mods = {}
    for part in text.split("The Triton module for pallas_call ")[1:]:
        name = part.split()[0]
        mods[name] = part.split("\n", 1)[1].split("\nThe ")[0]
    return mods


def _ops(module):
    import re

    return {op: len(re.findall(rf"\b{re.escape(op)}\b", module))
            for op in ("scf.for", "scf.if", "scf.while", "tt.load", "tt.dot", "math.sin",
                       "math.cos", "__nv_sinf", "__nv_cosf")}


def test_triton_modules_are_flat_tile_loops(monkeypatch, capsys):
    """The kernels as Triton compiles them (lowered on CPU for ``cuda``): each has exactly
    two ``scf.for`` tile loops (PARTIAL, FULL) and no ``scf.if`` / ``scf.while`` (no
    per-tile branch, no offset loop: what keeps Triton's software pipelining on), no
    sin/cos with RoPE, and the same operations for a T5-style table of radius 16 as of
    radius 1024 (the table is one indexed load per tile)."""
    small = _triton_modules(monkeypatch, capsys, 16, rope=True)
    large = _triton_modules(monkeypatch, capsys, 1024, rope=True)
    assert set(small) == {"jaxpos_attention_fwd", "jaxpos_attention_dq",
                          "jaxpos_attention_dkv"}, set(small)
    for name, module in small.items():
        ops = _ops(module)
        assert ops["scf.for"] == 2 and ops["scf.if"] == 0 and ops["scf.while"] == 0, (name, ops)
        # (sin / cos lower to math.* or to libdevice's __nv_sinf / __nv_cosf)
        assert not any(ops[o] for o in ("math.sin", "math.cos", "__nv_sinf", "__nv_cosf")), \
            (name, ops)
        assert ops == _ops(large[name]), (name, ops, _ops(large[name]))


def _triton_rope_modules(monkeypatch, capsys, on_load):
    """Triton IR of the three kernels for unrotated q/k with cos/sin tables (``on_load``)
    or for q/k rotated before the kernel."""
    from jaxpos.kernels import plumbing

    real = plumbing.pallas_call
    monkeypatch.setattr(plumbing, "pallas_call",
                        lambda *a, **k: real(*a, **{**k, "debug": True}))
    T2, H2 = 256, 128
    pos = jnp.arange(T2)

    def loss(q, inv_freq):
        tabs = fused.rope_tables(pos, pos, inv_freq)
        if not on_load:
            from jaxpos.schemes.rope import rotate

            qr = rotate(q, tabs.q_cos, tabs.q_sin, layout="half")
            o = fused.kernel_attention(qr, qr, q, q_positions=pos, kv_positions=pos,
                                       causal=True, interpret=False)
        else:
            o = fused.kernel_attention(q, q, q, q_positions=pos, kv_positions=pos, causal=True,
                                       rope_tables=tabs, interpret=False)
        return jnp.sum(o.astype(jnp.float32))

    sds = jax.ShapeDtypeStruct
    args = (sds((B, T2, N, H2), jnp.bfloat16), sds((H2 // 2,), jnp.float32))
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    capsys.readouterr()
    exp = jax.export.export(jax.jit(jax.grad(loss)), platforms=["cuda"], disabled_checks=checks)
    exp(*args)
    text = capsys.readouterr().out
    mods = {}
    for part in text.split("The Triton module for pallas_call ")[1:]:
        mods[part.split()[0]] = part.split("\n", 1)[1].split("\nThe ")[0]
    return mods


def test_rope_on_load_kernels_load_tables_and_compute_no_sin_cos(monkeypatch, capsys):
    """With ``rope_tables`` the kernels rotate q and k as they load them: each Triton module
    loads more (the cos/sin table tiles and q/k as two halves), has no sin/cos, and keeps
    the two flat tile loops; the angles are computed once per call outside the kernels."""
    on = _triton_rope_modules(monkeypatch, capsys, True)
    off = _triton_rope_modules(monkeypatch, capsys, False)
    assert set(on) == set(off) == {"jaxpos_attention_fwd", "jaxpos_attention_dq",
                                   "jaxpos_attention_dkv"}
    for name, module in on.items():
        ops, ops_off = _ops(module), _ops(off[name])
        assert not any(ops[o] for o in ("math.sin", "math.cos", "__nv_sinf", "__nv_cosf")), \
            (name, ops)
        assert ops["scf.for"] == 2 and ops["scf.if"] == 0, (name, ops)
        # q and k in two halves (one more load each) plus four table loads
        assert ops["tt.load"] >= ops_off["tt.load"] + 4, (name, ops, ops_off)
        assert ops["tt.dot"] > ops_off["tt.dot"], (name, ops, ops_off)  # one dot per half
