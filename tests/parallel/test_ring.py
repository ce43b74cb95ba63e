"""Ring attention (context parallelism, :mod:`jaxpos.parallel.ring`).

The 8-device checks run in a subprocess (``tests/parallel/_ring_worker.py``, which sets
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before importing JAX): each
compares ``ring_attention`` inside ``jax.shard_map`` with the single-device
``jaxpos.attention(..., implementation="reference")`` on the whole sequence, forward and
the gradients of q, k, v, the scheme's arrays, a score_mod's captured table and the
sinks. The default run covers every mechanism once (NoPE, RoPE+YaRN, ALiBi, T5, Shaw,
KERPLE; zigzag and contiguous layouts; packed segments; [B, T] positions; a captured
table, sinks and a mask_mod) plus a negative control; ``-m slow`` runs every scheme in
both layouts with and without segments, and a 2 x 4 (data x seq) mesh.

The layout helpers and the bad-input errors are checked here, in this process (one
device, a one-device mesh where a mesh is needed).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _xla_flags import subprocess_env
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpos import Shaw, T5Bias, attention
from jaxpos.parallel import (
    from_zigzag,
    ring_attention,
    shard_map,
    to_zigzag,
    zigzag_permutation,
)

WORKER = Path(__file__).with_name("_ring_worker.py")
TOL = 1e-5  # float32; gradients relative to max(1, max |gradient|) per array


def _run_worker(tmp_path_factory, *flags):
    """Run the 8-device worker (``--modules``: tests/parallel/_modules_worker.py) with
    ``flags``; its JSON result."""
    worker = WORKER.with_name("_modules_worker.py") if "--modules" in flags else WORKER
    flags = tuple(f for f in flags if f != "--modules")
    out = tmp_path_factory.mktemp("ring") / "result.json"
    env = subprocess_env()
    proc = subprocess.run([sys.executable, str(worker), *flags, str(out)], check=False, env=env,
                          capture_output=True, text=True, timeout=3000)
    if proc.returncode != 0:
        pytest.fail(f"ring worker failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _run_worker(tmp_path_factory)


def _check_equal(res):
    bad = {k: v for k, v in res.items() if k.startswith(("fwd/", "grad/")) and not v <= TOL}
    assert not bad, f"ring != single-device attention: {bad}"


# ------------------------------------------------------------------- 8 CPU devices
@pytest.mark.slow  # one 8-device subprocess (~25 s) shared by these five tests
def test_eight_devices(results):
    assert results["num_devices"] == 8


@pytest.mark.slow  # one 8-device subprocess (~25 s) shared by these five tests
def test_ring_equals_single_device(results):
    """Forward and every gradient equal the single-device call (see the worker)."""
    _check_equal(results)
    fwd = {k.split("/", 1)[1] for k in results if k.startswith("fwd/")}
    for scheme in ("nope", "rope_yarn", "alibi", "t5", "shaw"):
        assert any(name.startswith(scheme + "/") for name in fwd), (scheme, fwd)
    assert any("/zigzag" in n for n in fwd) and any("/contiguous" in n for n in fwd)
    assert any("/segments" in n for n in fwd)
    assert any("/table" in n and "/sinks" in n for n in fwd)
    # every gradient compared, and not vacuously: the schemes' gradients are nonzero
    for name in fwd:
        grads = [k for k in results if k.startswith(f"grad/{name}/")]
        assert len(grads) >= 4, (name, grads)  # params, q, k, v
        assert results[f"grad_norm/{name}"] > 1.0, name


@pytest.mark.slow  # one 8-device subprocess (~25 s) shared by these five tests
def test_ring_covers_kerple_when_present(results):
    if "kerple" not in next(k for k in results if k.startswith("available/")):
        pytest.skip("jaxpos.schemes.kerple not in this checkout")
    assert any(k.startswith("grad/kerple/") for k in results)


@pytest.mark.slow  # one 8-device subprocess (~25 s) shared by these five tests
def test_ring_needs_global_positions(results):
    """Negative control: every device passing a local arange(T / P) gets another answer."""
    for name in ("local_positions/rope_yarn", "local_positions/t5"):
        assert results[name] > 0.1, (name, results[name])


@pytest.mark.slow  # one 8-device subprocess (~25 s) shared by these five tests
def test_ring_skips_hidden_blocks(results):
    """NaN values in the last device's keys/values never reach earlier rows under a causal
    mask: hidden blocks (and tiles) are skipped, not computed and masked."""
    assert results["skip/fwd_rows_before_last_device"] <= TOL
    assert results["skip/dq_finite"] == 1.0


@pytest.mark.slow
def test_ring_every_scheme_layout_and_mesh(tmp_path_factory):
    res = _run_worker(tmp_path_factory, "--full")
    _check_equal(res)
    for name in ("local_positions/rope_yarn", "local_positions/t5"):
        assert res[name] > 0.1
    assert res["skip/fwd_rows_before_last_device"] <= TOL
    assert any("/mesh2x4/" in k for k in res if k.startswith("grad/"))
    avail = next(k for k in res if k.startswith("available/")).split("/", 1)[1].split(",")
    for scheme in avail:
        assert f"fwd/{scheme}/causal/zigzag/segments" in res, scheme


# ---------------------------------------------------------------- zigzag layout
def test_zigzag_permutation_layout():
    """T = 16 over P = 4: chunks of 2; device i holds chunks i and 7 - i (the layout of
    Megatron-LM's context parallelism)."""
    perm = zigzag_permutation(16, 4)
    assert perm.dtype == np.int32
    want = [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    np.testing.assert_array_equal(perm, want)


@pytest.mark.parametrize("T,P", [(16, 4), (64, 8), (12, 3), (2, 1)])
def test_zigzag_balances_causal_work(T, P):
    """Under a causal mask a query at position p sees p + 1 keys: with the zigzag layout
    every device's queries see the same number of keys; contiguous shards do not."""
    perm = zigzag_permutation(T, P)
    assert sorted(perm.tolist()) == list(range(T))
    per_device = (perm.reshape(P, T // P) + 1).sum(axis=1)
    assert np.all(per_device == per_device[0])
    contiguous = (np.arange(T).reshape(P, T // P) + 1).sum(axis=1)
    if P > 1:
        assert contiguous[-1] > contiguous[0]


def test_to_from_zigzag_round_trip():
    x = jnp.arange(2 * 24 * 3).reshape(2, 24, 3)
    z = to_zigzag(x, 1, 4)
    np.testing.assert_array_equal(np.asarray(z), np.asarray(x)[:, zigzag_permutation(24, 4)])
    np.testing.assert_array_equal(np.asarray(from_zigzag(z, 1, 4)), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(from_zigzag(to_zigzag(x, -2, 3), -2, 3)),
                                  np.asarray(x))
    # positions: the zigzag order of arange is the permutation itself
    np.testing.assert_array_equal(np.asarray(to_zigzag(jnp.arange(24), 0, 4)),
                                  zigzag_permutation(24, 4))


# --------------------------------------------------------- one-device ring checks
def _mesh1():
    return Mesh(np.array(jax.devices()[:1]), ("seq",))


def _qkv(T=8, N=2, H=4):
    r = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)
    return f(1, T, N, H), f(1, T, N, H), f(1, T, N, H)


def test_ring_on_one_device_equals_attention():
    """P = 1: the ring is one block; equal to jaxpos.attention (and its gradients)."""
    q, k, v = _qkv()
    pos = jnp.arange(8, dtype=jnp.int32) + 3
    table = jnp.asarray(np.random.default_rng(1).normal(size=(32, 2)), jnp.float32)
    sinks = jnp.asarray([0.3, -0.5], jnp.float32)

    def ring(tab, q, k, v):
        f = shard_map(lambda t, q, k, v: ring_attention(
            q, k, v, axis_name="seq", position=T5Bias(t, bidirectional=False), sinks=sinks,
            q_positions=pos, kv_positions=pos, causal=True, block_q=4, block_k=2),
            mesh=_mesh1(), in_specs=(P(), P(None, "seq"), P(None, "seq"), P(None, "seq")),
            out_specs=P(None, "seq"))
        return f(tab, q, k, v)

    def plain(tab, q, k, v):
        return attention(q, k, v, position=T5Bias(tab, bidirectional=False), sinks=sinks,
                         q_positions=pos, kv_positions=pos, causal=True,
                         implementation="reference")

    np.testing.assert_allclose(jax.jit(ring)(table, q, k, v), plain(table, q, k, v), atol=1e-5)
    loss = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2, 3)))
    g1 = loss(ring)(table, q, k, v)
    g2 = loss(plain)(table, q, k, v)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def _in_shard_map(fn, *args):
    f = shard_map(fn, mesh=_mesh1(), in_specs=tuple(P(None, "seq") for _ in args),
                  out_specs=P(None, "seq"))
    return jax.jit(f)(*args)


# ------------------------------------------------------------------------- bad input
def test_outside_shard_map_raises():
    q, k, v = _qkv()
    pos = jnp.arange(8, dtype=jnp.int32)
    with pytest.raises(ValueError, match=r"inside jax.shard_map.*axis_name='seq'"):
        ring_attention(q, k, v, axis_name="seq", q_positions=pos, kv_positions=pos)


def test_unknown_axis_name_raises():
    q, k, v = _qkv()
    pos = jnp.arange(8, dtype=jnp.int32)
    with pytest.raises(ValueError, match=r"axis_name='sequence' is not an axis.*\['seq'\]"):
        _in_shard_map(lambda q, k, v: ring_attention(q, k, v, axis_name="sequence",
                                                     q_positions=pos, kv_positions=pos), q, k, v)


def test_axis_name_type_raises():
    q, k, v = _qkv()
    pos = jnp.arange(8, dtype=jnp.int32)
    with pytest.raises(TypeError, match="axis_name must be the name"):
        _in_shard_map(lambda q, k, v: ring_attention(q, k, v, axis_name=0, q_positions=pos,
                                                     kv_positions=pos), q, k, v)


def test_positions_of_wrong_local_length_raise():
    """Global-length positions passed unsharded: named, with the local length."""
    q, k, v = _qkv()
    glob = jnp.arange(16, dtype=jnp.int32)
    loc = jnp.arange(8, dtype=jnp.int32)
    with pytest.raises(ValueError, match=r"q_positions must have shape \[8\].*local length 8"):
        _in_shard_map(lambda q, k, v: ring_attention(q, k, v, axis_name="seq", q_positions=glob,
                                                     kv_positions=loc), q, k, v)
    with pytest.raises(ValueError, match=r"kv_positions.*local length 8"):
        _in_shard_map(lambda q, k, v: ring_attention(q, k, v, axis_name="seq", q_positions=loc,
                                                     kv_positions=glob), q, k, v)


def test_missing_positions_raise():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="q_positions is required.*GLOBAL positions"):
        _in_shard_map(lambda q, k, v: ring_attention(q, k, v, axis_name="seq", q_positions=None,
                                                     kv_positions=None), q, k, v)


def test_segment_ids_of_wrong_local_length_raise():
    q, k, v = _qkv()
    pos = jnp.arange(8, dtype=jnp.int32)
    seg = jnp.zeros((1, 16), jnp.int32)
    with pytest.raises(ValueError, match=r"segment_ids must have shape \[B, T\] = \[1, 8\]"):
        _in_shard_map(lambda q, k, v: ring_attention(q, k, v, axis_name="seq", q_positions=pos,
                                                     kv_positions=pos, segment_ids=seg), q, k, v)


def test_pallas_ring_refuses_a_scheme_the_kernel_cannot_run():
    """The ring's blocks run on the fused kernel with implementation='pallas'; Shaw's
    content bias and value term are not fusable: a ValueError naming the scheme."""
    q, k, v = _qkv()
    pos = jnp.arange(8, dtype=jnp.int32)
    shaw = Shaw(jnp.zeros((5, 4)), jnp.zeros((5, 4)))
    with pytest.raises(ValueError,
                       match=r"fused Pallas kernel does not support the position scheme Shaw"):
        _in_shard_map(lambda q, k, v: ring_attention(q, k, v, axis_name="seq", q_positions=pos,
                                                     kv_positions=pos, position=shaw,
                                                     implementation="pallas"), q, k, v)


def test_ring_engine_without_lse_raises():
    q, k, v = _qkv()
    pos = jnp.arange(8, dtype=jnp.int32)
    with pytest.raises(ValueError, match="implementation"):
        _in_shard_map(lambda q, k, v: ring_attention(q, k, v, axis_name="seq", q_positions=pos,
                                                     kv_positions=pos, implementation="xla"),
                      q, k, v)


@pytest.mark.parametrize("T,P", [(12, 4), (10, 2), (7, 1)])
def test_zigzag_length_not_divisible_raises(T, P):
    with pytest.raises(ValueError, match=rf"T={T} is not divisible by 2 \* num_devices"):
        zigzag_permutation(T, P)
    with pytest.raises(ValueError, match=rf"x.shape\[1\] \(the sequence length\)={T} is not "
                                         rf"divisible by 2 \* num_devices = {2 * P}"):
        to_zigzag(jnp.zeros((1, T, 2)), 1, P)


def test_zigzag_bad_arguments_raise():
    with pytest.raises((TypeError, ValueError), match="num_devices"):
        zigzag_permutation(16, 0)
    with pytest.raises(ValueError, match="axis=3 is out of range"):
        to_zigzag(jnp.zeros((1, 8, 2)), 3, 2)
    with pytest.raises(TypeError, match="axis must be an int"):
        from_zigzag(jnp.zeros((1, 8, 2)), 1.0, 2)


@pytest.mark.slow
def test_memory_benchmark_runs(tmp_path):
    """``benchmarks/ring_attention_memory.py --tiny`` runs end to end on 8 CPU devices and
    writes its table, in which the ring needs less memory per device than the all-gather
    layout and its memory falls with P."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "ring_attention_memory.py"
    out = tmp_path / "ring.md"
    env = subprocess_env()
    proc = subprocess.run([sys.executable, str(path), "--tiny", "--output", str(out)],
                          check=False, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    text = out.read_text()
    assert "| ring |" in text and "| all_gather |" in text and "Fit: ring peak" in text
    rows = [r.split("|") for r in text.splitlines() if r.startswith("| 512 | ")]
    ratio = {r[4].strip(): float(r[9]) for r in rows}
    assert ratio["ring"] < 1.0 and ratio["all_gather"] == 1.0, ratio


def test_ring_runs_its_blocks_on_a_user_engine_with_lse():
    """An engine registered from outside the package with run_with_lse: the ring calls it
    per block (one-device ring, so the sinks' weights still split the cotangents) and equals
    jaxpos.attention, forward and gradients (T5 table, captured table, sinks, q, k, v)."""
    import _dense_lse_engine  # noqa: F401  (registers "dense_lse")

    q, k, v = _qkv()
    pos = jnp.arange(8, dtype=jnp.int32) + 3
    r = np.random.default_rng(1)
    table = jnp.asarray(r.normal(size=(32, 2)), jnp.float32)
    bias = jnp.asarray(r.normal(size=(2, 9)), jnp.float32)
    sinks = jnp.asarray([0.3, -0.5], jnp.float32)

    def mod(bias):
        return lambda s, b, h, qp, kp: s + bias[h, jnp.clip(kp - qp, -4, 4) + 4]

    def ring(tab, bias, sinks, q, k, v):
        seq = P(None, "seq")
        f = shard_map(lambda t, bb, s, q, k, v: ring_attention(
            q, k, v, axis_name="seq", position=T5Bias(t, bidirectional=False), sinks=s,
            score_mod=mod(bb), q_positions=pos, kv_positions=pos, causal=True,
            implementation="dense_lse"), mesh=_mesh1(),
            in_specs=(P(), P(), P(), seq, seq, seq), out_specs=seq)
        return f(tab, bias, sinks, q, k, v)

    def plain(tab, bias, sinks, q, k, v):
        return attention(q, k, v, position=T5Bias(tab, bidirectional=False), sinks=sinks,
                         score_mod=mod(bias), q_positions=pos, kv_positions=pos, causal=True,
                         implementation="reference")

    args = (table, bias, sinks, q, k, v)
    np.testing.assert_allclose(jax.jit(ring)(*args), plain(*args), atol=1e-5)
    loss = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=range(6)))
    for a, b in zip(loss(ring)(*args), loss(plain)(*args)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
