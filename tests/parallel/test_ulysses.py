"""Ulysses all-to-all attention and USP (:mod:`jaxpos.parallel.ulysses`).

The 8-device checks run in ONE subprocess (``tests/parallel/_ring_worker.py --quick``):
Ulysses over 8 devices (8 query heads, 2 key/value heads repeated 4 times each, a
per-head T5 table and a per-head captured table whose rows follow their heads, sinks
sliced to the local heads, packed segments) and USP on a 2 x 4 mesh (Ulysses over 4
devices with the key/value heads split, the ring over 2 in a zigzag layout, RoPE+YaRN,
sinks, a mask_mod); each forward and every gradient against the
single-device ``jaxpos.attention(..., implementation="reference")``. The slow runs of
tests/parallel/test_ring.py add every scheme, the Pallas and XLA engines, and a
(data x seq) mesh.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _xla_flags import subprocess_env
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from test_ring import TOL

from jaxpos import ALiBi, attention
from jaxpos.parallel import kv_head_repeats, shard_map, ulysses_attention


@pytest.fixture
def quick(cp_quick):
    return {k: v for k, v in cp_quick.items() if not k.startswith("modules/")}


def _names(res, method):
    return {k.split("/", 1)[1] for k in res if k.startswith("fwd/") and k.endswith(method)
            or k.startswith("fwd/") and f"/{method}/" in k}


def test_ulysses_and_usp_equal_single_device(quick):
    """Forward and every gradient (scheme table, captured table, sinks, q, k, v) of
    Ulysses and USP equal the single-device call."""
    assert quick["num_devices"] == 8
    bad = {k: v for k, v in quick.items() if k.startswith(("fwd/", "grad/")) and not v <= TOL}
    assert not bad, bad
    uly, usp = _names(quick, "ulysses"), _names(quick, "usp")
    assert uly and usp, sorted(quick)
    for name in uly | usp:
        grads = [k for k in quick if k.startswith(f"grad/{name}/")]
        assert any("'sinks'" in g for g in grads) and len(grads) >= 5, (name, grads)
        assert quick[f"grad_norm/{name}"] > 1.0, name


def test_ulysses_inside_a_mesh_with_a_data_axis_equals_single_device(quick):
    """The modules' context-parallel call (shard_map manual over ``seq`` only) on a
    (data=2) x (seq=4) mesh with Auto axes: Ulysses with ALiBi, output and the gradients
    of q, k, v equal the single-device call (it raised before: a closed-over head offset,
    then the gradients' varying types of a nested shard_map)."""
    keys = [k for k in quick if k.startswith("ctx_data_axis/")]
    assert len(keys) == 2, keys
    bad = {k: quick[k] for k in keys if not quick[k] <= TOL}
    assert not bad, (bad, {k: v for k, v in quick.items() if k.startswith("error/ctx")})


def test_ulysses_heads_not_divisible_raises(quick):
    msg = quick["error/heads_not_divisible"]
    assert "4 query heads over the 8 devices of mesh axis 'seq'" in msg, msg


@pytest.mark.parametrize("nk,p,want", [(8, 4, 1), (2, 8, 4), (1, 4, 4), (6, 4, 2), (3, 3, 1)])
def test_kv_head_repeats_is_fewest_copies_divisible_by_p(nk, p, want):
    f = kv_head_repeats(nk, p)
    assert f == want and (nk * f) % p == 0
    assert all((nk * g) % p for g in range(1, f))  # no fewer copies would do
    assert f == math.lcm(nk, p) // nk


def test_kv_head_repeats_bad_arguments_raise():
    with pytest.raises((TypeError, ValueError), match="num_devices"):
        kv_head_repeats(2, 0)
    with pytest.raises((TypeError, ValueError), match="num_kv_heads"):
        kv_head_repeats(1.5, 2)


# ----------------------------------------------------------------- one device
def _mesh1():
    return Mesh(np.array(jax.devices()[:1]), ("seq",))


def test_ulysses_on_one_device_equals_attention():
    """P = 1 (no exchange): the ALiBi call and its gradients equal jaxpos.attention's."""
    r = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)
    q, k, v = f(1, 8, 4, 4), f(1, 8, 2, 4), f(1, 8, 2, 4)
    pos = jnp.arange(8, dtype=jnp.int32) + 2
    seq = P(None, "seq")

    def uly(q, k, v):
        return shard_map(lambda q, k, v: ulysses_attention(
            q, k, v, axis_name="seq", position=ALiBi(num_heads=4), q_positions=pos,
            kv_positions=pos, causal=True), mesh=_mesh1(), in_specs=(seq, seq, seq),
            out_specs=seq)(q, k, v)

    def plain(q, k, v):
        return attention(q, k, v, position=ALiBi(num_heads=4), q_positions=pos,
                         kv_positions=pos, causal=True, implementation="reference")

    np.testing.assert_allclose(jax.jit(uly)(q, k, v), plain(q, k, v), atol=1e-5)
    g = lambda fn: jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=(0, 1, 2)))
    for a, b in zip(g(uly)(q, k, v), g(plain)(q, k, v)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_ulysses_outside_shard_map_raises():
    q = jnp.zeros((1, 8, 2, 4))
    pos = jnp.arange(8, dtype=jnp.int32)
    with pytest.raises(ValueError, match=r"ulysses_attention must be called inside "
                                         r"jax.shard_map.*axis_name='seq'"):
        ulysses_attention(q, q, q, axis_name="seq", q_positions=pos, kv_positions=pos)


def test_ulysses_ring_axis_equal_to_axis_name_raises():
    q = jnp.zeros((1, 8, 2, 4))
    pos = jnp.arange(8, dtype=jnp.int32)
    seq = P(None, "seq")
    fn = shard_map(lambda q: ulysses_attention(q, q, q, axis_name="seq", ring_axis="seq",
                                               q_positions=pos, kv_positions=pos),
                   mesh=_mesh1(), in_specs=(seq,), out_specs=seq)
    with pytest.raises(ValueError, match="ring_axis must differ from axis_name"):
        fn(q)


def test_ulysses_unknown_implementation_raises():
    q = jnp.zeros((1, 8, 2, 4))
    pos = jnp.arange(8, dtype=jnp.int32)
    seq = P(None, "seq")
    fn = shard_map(lambda q: ulysses_attention(q, q, q, axis_name="seq", q_positions=pos,
                                               kv_positions=pos, implementation="flash"),
                   mesh=_mesh1(), in_specs=(seq,), out_specs=seq)
    with pytest.raises(ValueError, match="implementation"):
        fn(q)


# ------------------------------------------------------- 2 processes, jax.distributed
@pytest.mark.slow  # two processes of 4 CPU devices each (~40 s)
def test_two_process_distributed_ring_and_usp(tmp_path):
    """``jax.distributed`` with 2 CPU processes (gloo collectives) of 4 devices each: the
    ring over all 8 devices and USP (the ring across the processes, Ulysses inside each)
    give each process its shards of the single-device output and gradients."""
    import json
    import socket
    import subprocess
    import sys
    from pathlib import Path

    worker = Path(__file__).with_name("_distributed_worker.py")
    with socket.socket() as s:  # a free port for the coordinator
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = subprocess_env()
    outs = [tmp_path / f"p{i}.json" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, str(worker), str(i), "2", str(port), str(out)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i, out in enumerate(outs)]
    logs = [p.communicate(timeout=900)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    for out in outs:
        res = json.loads(out.read_text())
        assert res.pop("process_count") == 2.0
        assert len(res) == 10, res  # out, dq, dk, dv, dtable for ring and USP
        bad = {k: v for k, v in res.items() if not v <= TOL}
        assert not bad, bad


@pytest.mark.slow  # ~20 compilations on 8 CPU devices (a few minutes on 2 cores)
def test_context_parallel_benchmark_tiny(tmp_path):
    """``benchmarks/context_parallel.py --tiny`` runs and its table shows what
    docs/parallel.md says: zigzag balances the ring (max / mean <= 1.1), Ulysses is
    balanced in any order, the HLO's collective bytes equal each layout's formula, and
    the ring's and Ulysses' temporary memory falls with P while all-gather's does not."""
    import subprocess
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "context_parallel.py"
    out = tmp_path / "cp.md"
    env = subprocess_env()
    proc = subprocess.run([sys.executable, str(path), "--tiny", "--kv-heads", "2", "--output",
                           str(out)], check=False, env=env, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [[c.strip() for c in r.split("|")[1:-1]] for r in out.read_text().splitlines()
            if r.startswith("| ")]
    balance = {(r[0], r[1]): float(r[3]) for r in rows if len(r) == 4 and r[1] in (
        "contiguous", "zigzag")}
    assert balance[("ring", "zigzag")] <= 1.1 < balance[("ring", "contiguous")]
    assert balance[("ulysses", "contiguous")] <= 1.1
    ratios = [float(r[4]) for r in rows if len(r) == 6 and r[0] == "2"]
    assert len(ratios) == 4 and all(abs(x - 1.0) < 0.01 for x in ratios), rows
    mem = [r for r in rows if len(r) == 9 and r[0].isdigit()]
    temp = {p: [float(x) for x in r[1::2]] for p, r in zip((1, 2, 4, 8), mem)}
    ring, uly, ag = 0, 1, 2
    assert temp[8][ring] < temp[1][ring] / 4 and temp[8][uly] < temp[1][uly] / 4
    assert temp[8][ag] > temp[1][ag] / 2
