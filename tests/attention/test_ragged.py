"""The ragged call, ``jaxpos.attention(q, k_pages, v_pages, page_table=, kv_lengths=,
cu_q_lengths=)``: packed queries ``[total_q, N, H]`` of rows that prefill a chunk, decode
one token or have no new query, in one call. Each row equals the float64 contract
(``_contract_reference``) on its own filled keys, per scheme and mod; positions given as
data equal the dense call with the same positions; bad lengths raise when concrete and
give NaN queries under ``jit``; the Pallas form lowers for CUDA and TPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _contract_reference import contract_attention

import jaxpos
from jaxpos.core.paged import gather_pages

N, NK, H, PAGE, PPS = 4, 2, 8, 4, 3  # 12 slots per row
S = PAGE * PPS
_R = np.random.default_rng(11)
_f64 = lambda x: np.asarray(np.asarray(x, np.float32), np.float64)
_T5 = _f64(_R.normal(size=(32, N)))
_INV = _f64(10000.0 ** (-np.arange(0, H, 2) / H))
_SLOPES = _f64(2.0 ** (-8.0 * np.arange(1, N + 1) / N))
_R1, _R2 = _f64(_R.uniform(0.5, 2.0, N)), _f64(_R.uniform(0.5, 2.0, N))
_FIRE = {"w1": _f64(_R.uniform(-1, 1, 4)), "b1": _f64(_R.uniform(-1, 1, 4)),
         "w2": _f64(_R.uniform(-0.5, 0.5, (4, N))), "b2": _f64(_R.uniform(-0.5, 0.5, N)),
         "c": np.float64(0.1), "L_multiplier": np.float64(1.0), "init_L": 512.0}
_j = lambda x: jnp.asarray(x, jnp.float32)
#: name -> (jaxpos scheme, the contract's scheme name, its params)
SCHEMES = {
    "none": (None, "none", {}),
    "rope": (jaxpos.RoPE(_j(_INV)), "rope", {"inv_freq": _INV}),
    "alibi": (jaxpos.ALiBi(slopes=_j(_SLOPES)), "alibi", {"slopes": _SLOPES}),
    "t5": (jaxpos.T5Bias(_j(_T5), bidirectional=False), "t5",
           {"table": _T5, "bidirectional": False}),
    "kerple": (jaxpos.KERPLE(_j(_R1), _j(_R2), kind="log"), "kerple", {"r1": _R1, "r2": _R2}),
    "fire": (jaxpos.FIRE(*(_j(_FIRE[n]) for n in ("w1", "b1", "w2", "b2")),
                         c=_j(_FIRE["c"]), L_multiplier=_j(_FIRE["L_multiplier"]),
                         init_L=512.0), "fire", _FIRE),
}

# rows: (filled slots, new queries): a chunk after 2 cached tokens, no new query, a decode
# step, a first chunk from an empty cache
LENS = np.array([7, 3, 10, 4], np.int32)
NEW = np.array([5, 0, 1, 4])
CU = np.concatenate([[0], np.cumsum(NEW)]).astype(np.int32)
ROW_BIAS = np.array([0.5, -1.0, 2.0, 0.25], np.float32)  # a per-row score term (batch)


def _pool(seed=0):
    """Pages shuffled over a pool with NaN in every unowned page and unfilled slot."""
    rng = np.random.default_rng(seed)
    B = len(LENS)
    num = B * PPS + 2
    table = rng.permutation(num)[:B * PPS].reshape(B, PPS).astype(np.int32)
    kp = np.full((num, PAGE, NK, H), np.nan, np.float32)
    vp = np.full((num, PAGE, NK, H), np.nan, np.float32)
    for b, L in enumerate(LENS):
        for s in range(L):
            kp[table[b, s // PAGE], s % PAGE] = rng.normal(size=(NK, H))
            vp[table[b, s // PAGE], s % PAGE] = rng.normal(size=(NK, H))
    q = rng.normal(size=(CU[-1], N, H)).astype(np.float32)
    return q, kp, vp, table


def _window3(b, h, qp, kp):
    return kp > qp - 3


def _softcap(s, b, h, qp, kp):
    return 5.0 * jnp.tanh(s / 5.0)


def _row_bias(s, b, h, qp, kp):
    return s + jnp.asarray(ROW_BIAS)[b]


def _contract_rows(q, kp, vp, table, name, *, q_positions=None, kv_positions=None,
                   sinks=None, mods=False):
    """float64 ``[total_q, N, H]``: each row's queries on its own filled keys."""
    _, cname, params = SCHEMES[name]
    out = []
    for b, L in enumerate(LENS):
        if NEW[b] == 0:
            continue
        slots = np.arange(L)
        k = kp[table[b, slots // PAGE], slots % PAGE][None]
        v = vp[table[b, slots // PAGE], slots % PAGE][None]
        qp = (L - NEW[b] + np.arange(NEW[b])) if q_positions is None \
            else q_positions[CU[b]:CU[b + 1]]
        kvp = slots if kv_positions is None else kv_positions[b, :L]
        kw = {}
        if mods:
            kw = dict(mask_mod=_window3, score_mod=lambda s, bb, h, qp, kp, xp, stop_gradient,
                      b=b: 5.0 * np.tanh(s / 5.0) + ROW_BIAS[b])
        out.append(contract_attention(
            _f64(q[CU[b]:CU[b + 1]])[None], _f64(k), _f64(v), scheme=cname, params=params,
            causal=True, q_positions=qp[None], kv_positions=kvp[None],
            sinks=None if sinks is None else _f64(sinks), **kw)[0])
    return np.concatenate(out)


def _close(got, ref, atol=2e-5):
    np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=0,
                               atol=atol * max(1.0, float(np.abs(ref).max())))


_slow = pytest.mark.slow
CASES = [("chunked", "none"), ("chunked", "rope"), ("chunked", "alibi"), ("chunked", "t5"),
         ("reference", "t5"), pytest.param("pallas", "alibi", marks=_slow),
         pytest.param("chunked", "kerple", marks=_slow),
         pytest.param("chunked", "fire", marks=_slow),
         pytest.param("reference", "rope", marks=_slow)]


@pytest.mark.parametrize("impl,name", CASES)
def test_each_row_of_a_ragged_step_equals_the_float64_contract(impl, name):
    """A prefill chunk, a row with no new query, a decode step and a first chunk in one
    call; NaN in every unfilled slot and unowned page."""
    q, kp, vp, table = _pool()
    out = jax.jit(lambda q, kp, vp: jaxpos.attention(
        q, kp, vp, page_table=table, kv_lengths=LENS, cu_q_lengths=CU, causal=True,
        position=SCHEMES[name][0], implementation=impl))(q, kp, vp)
    assert out.shape == (CU[-1], N, H)
    _close(out, _contract_rows(q, kp, vp, table, name))


@pytest.mark.parametrize("impl", ["chunked", pytest.param("reference", marks=_slow),
                                  pytest.param("pallas", marks=_slow)])
def test_ragged_step_with_sinks_a_window_softcap_and_a_per_row_score_mod(impl):
    """Sinks, a sliding-window mask_mod, a soft cap and a score_mod indexed by ``batch``:
    the mod sees each query's row (not its packed index)."""
    q, kp, vp, table = _pool(1)
    sinks = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
    out = jax.jit(lambda q, kp, vp: jaxpos.attention(
        q, kp, vp, page_table=table, kv_lengths=LENS, cu_q_lengths=CU, causal=True,
        sinks=sinks, mask_mod=_window3,
        score_mod=lambda s, b, h, qp, kp: _row_bias(_softcap(s, b, h, qp, kp), b, h, qp, kp),
        position=SCHEMES["alibi"][0], implementation=impl))(q, kp, vp)
    _close(out, _contract_rows(q, kp, vp, table, "alibi", sinks=sinks, mods=True))


def test_rope_on_load_in_a_ragged_step():
    """Raw keys in the pages, rotated on load by ``rope_tables`` of the packed query
    positions and the slots: equal to the contract's RoPE."""
    q, kp, vp, table = _pool(2)
    qpos = np.concatenate([L - n + np.arange(n) for L, n in zip(LENS, NEW)])
    tabs = jaxpos.rope_tables(qpos, np.arange(S), _j(_INV))
    out = jaxpos.attention(q, kp, vp, page_table=table, kv_lengths=LENS, cu_q_lengths=CU,
                           causal=True, rope_tables=tabs, implementation="chunked")
    _close(out, _contract_rows(q, kp, vp, table, "rope"))


@pytest.mark.parametrize("impl", ["chunked"])
def test_positions_as_data_equal_the_dense_call_with_the_same_positions(impl):
    """Per-row key positions (a shared prefix shifted by 100 in row 2, a StreamingLLM-like
    gap in row 0) and query positions given as data (two speculative branches at the same
    position in row 3): each row equals the dense call on its gathered keys with the
    same positions, and the float64 contract."""
    q, kp, vp, table = _pool(3)
    kvpos = np.tile(np.arange(S), (len(LENS), 1)).astype(np.int32)
    kvpos[0, 4:] += 50  # a gap after 4 kept slots
    kvpos[2] += 100
    qpos = np.concatenate([kvpos[b, L - n:L] for b, (L, n) in enumerate(zip(LENS, NEW))])
    qpos[-2:] = qpos[-3] + 1  # two branches after the same token
    name = "t5"
    kw = dict(causal=True, position=SCHEMES[name][0], implementation=impl)
    out = jaxpos.attention(q, kp, vp, page_table=table, kv_lengths=LENS, cu_q_lengths=CU,
                           q_positions=qpos, kv_positions=kvpos, **kw)
    k, v = gather_pages(kp, table), gather_pages(vp, table)
    for b in range(len(LENS)):
        if NEW[b]:
            dense = jaxpos.attention(q[None, CU[b]:CU[b + 1]], k[b:b + 1], v[b:b + 1],
                                     kv_lengths=LENS[b:b + 1], q_positions=qpos[CU[b]:CU[b + 1]],
                                     kv_positions=kvpos[b], **kw)
            np.testing.assert_allclose(out[CU[b]:CU[b + 1]], dense[0], rtol=0, atol=1e-5)
    _close(out, _contract_rows(q, kp, vp, table, name, q_positions=qpos, kv_positions=kvpos))


@pytest.mark.parametrize("cu,lens,match", [
    ([0, 5, 4, 6, 10], LENS, r"cu_q_lengths must not decrease.*cu_q_lengths\[1\] = 5"),
    ([0, 5, 5, 6, 9], LENS, r"cu_q_lengths must end at total_q = 10"),
    ([1, 5, 5, 6, 10], LENS, r"cu_q_lengths must start at 0"),
    (CU, [7, 3, 10, 3], r"row 3 has 4 new queries .* kv_lengths\[3\] = 3"),
    ([0, 5, 5, 10], LENS, r"cu_q_lengths must have shape \[batch \+ 1\] = \[5\]"),
])
def test_bad_lengths_raise_naming_the_argument(cu, lens, match):
    q, kp, vp, table = _pool()
    with pytest.raises(ValueError, match=match):
        jaxpos.attention(q, kp, vp, page_table=table, kv_lengths=np.asarray(lens, np.int32),
                         cu_q_lengths=np.asarray(cu, np.int32), causal=True)


def test_traced_bad_lengths_make_those_queries_nan():
    """Under ``jit``: a row with more new queries than filled slots is NaN (the others
    exact); a malformed ``cu_q_lengths`` makes every query NaN."""
    q, kp, vp, table = _pool()
    f = jax.jit(lambda lens, cu: jaxpos.attention(q, kp, vp, page_table=table, kv_lengths=lens,
                                                  cu_q_lengths=cu, causal=True))
    good = np.asarray(f(jnp.asarray(LENS), jnp.asarray(CU)))
    assert np.isfinite(good).all()
    out = np.asarray(f(jnp.asarray([4, 3, 10, 4], jnp.int32), jnp.asarray(CU)))
    assert np.isnan(out[:5]).all()
    np.testing.assert_array_equal(out[5:], good[5:])
    assert np.isnan(np.asarray(f(jnp.asarray(LENS), jnp.asarray([0, 5, 4, 6, 10])))).all()


def test_keywords_laid_out_per_row_are_refused():
    q, kp, vp, table = _pool()
    with pytest.raises(ValueError, match="does not take segment_ids"):
        jaxpos.attention(q, kp, vp, page_table=table, kv_lengths=LENS, cu_q_lengths=CU,
                         segment_ids=np.zeros((1, 10), np.int32))
    with pytest.raises(ValueError, match="cu_q_lengths .* needs page_table"):
        jaxpos.attention(q[None], q[None], q[None], cu_q_lengths=CU)



@pytest.mark.parametrize("traced", [False, True])
def test_query_blocks_hold_one_rows_queries_and_give_each_query_back(traced):
    """The blocks a ragged call runs (``_blocks``): rows of 13, 0, 1, 4, 0 and 7 queries in
    blocks of 4 take 4 + 1 + 1 + 2 = 8 of the static 10 = (25 + 6 * 3) // 4; every block
    holds one row's queries in order (slots past its end repeat its last one), and each
    query's output slot holds that query, with concrete and traced lengths."""
    from jaxpos.core.ragged import _blocks, _rows

    new = np.array([13, 0, 1, 4, 0, 7])
    cu = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    B, T, bq = len(new), int(cu[-1]), 4

    def blocks(c):
        row, off = _rows(c, T, B)
        return _blocks(c, row, off, T, B, bq)

    brow, qidx, flat = jax.jit(blocks)(jnp.asarray(cu)) if traced else blocks(cu)
    brow, qidx, flat = np.asarray(brow), np.asarray(qidx), np.asarray(flat)
    assert qidx.shape == (10, 4)
    np.testing.assert_array_equal(brow[:8], [0, 0, 0, 0, 2, 3, 5, 5])
    np.testing.assert_array_equal(qidx[:8], [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11],
                                             [12, 12, 12, 12], [13, 13, 13, 13],
                                             [14, 15, 16, 17], [18, 19, 20, 21],
                                             [22, 23, 24, 24]])
    np.testing.assert_array_equal(qidx.reshape(-1)[flat], np.arange(T))


def test_a_prefill_chunk_reads_its_pages_once_per_block_of_queries(monkeypatch):
    """The paged call behind a ragged step holds blocks of a row's queries: rows of 5, 0, 1
    and 4 queries (10 in all) run as 7 blocks of 2 (not 10 rows of one query), and a
    decode-only step as one query per row."""
    import jaxpos.core.ragged as ragged

    shapes = []
    real = ragged.run_paged
    monkeypatch.setattr(ragged, "run_paged",
                        lambda engine, call, *a: shapes.append(call.q.shape) or
                        real(engine, call, *a))
    q, kp, vp, table = _pool()
    jaxpos.attention(q, kp, vp, page_table=table, kv_lengths=LENS, cu_q_lengths=CU,
                     causal=True, implementation="chunked")
    jaxpos.attention(q[:4], kp, vp, page_table=table, kv_lengths=LENS,
                     cu_q_lengths=np.arange(5, dtype=np.int32), causal=True,
                     implementation="chunked")
    assert shapes == [(7, 2, N, H), (4, 1, N, H)]

@_slow
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_ragged_pallas_step_lowers(platform):
    """The Pallas form of a ragged step (bf16, GQA 8:2, head dim 128, 64-slot pages,
    ALiBi) exports for the target as the paged kernel."""
    B, n, Nk, h, P, pps, num, T = 3, 8, 2, 128, 64, 4, 16, 10
    sds = jax.ShapeDtypeStruct

    def f(q, kp, vp, t, lens, cu):
        return jaxpos.attention(q, kp, vp, page_table=t, kv_lengths=lens, cu_q_lengths=cu,
                                causal=True, position=jaxpos.ALiBi(n), implementation="pallas")

    args = (sds((T, n, h), jnp.bfloat16), sds((num, P, Nk, h), jnp.bfloat16),
            sds((num, P, Nk, h), jnp.bfloat16), sds((B, pps), jnp.int32), sds((B,), jnp.int32),
            sds((B + 1,), jnp.int32))
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    mlir = jax.export.export(jax.jit(f), platforms=[platform], disabled_checks=checks)(
        *args).mlir_module()
    assert mlir.count("tpu_custom_call" if platform == "tpu" else "xla.gpu.triton") == 1
