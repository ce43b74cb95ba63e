"""The paged kernel (jaxpos.kernels.paged) in interpret mode against the dense kernel on
the keys gathered from the pages (``k[b, s] = k_pages[page_table[b, s // P], s % P]``,
FlashAttention's ``flash_attn_with_kvcache`` layout), and its lowering for cuda and tpu.

Pages are shuffled in the pool (a row's pages are not contiguous nor in order), rows have
different lengths, and the page-table entries past a row's length point at a page of NaN
(so a page read past the length would show). Tolerance: float32, only the summation
order may differ (both kernels run the same tiles), ``2e-6``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpos.kernels import _testing as kernel_testing
from jaxpos.kernels import fused
from jaxpos.kernels.paged import paged_attention_kernel
from jaxpos.mods import create_block_mask
from jaxpos.schemes.alibi import alibi_score_mod

TOL = {"atol": 2e-6, "rtol": 2e-6}
PAGE, PAGES_PER_SEQ, NUM_PAGES = 8, 4, 11
TK = PAGE * PAGES_PER_SEQ


@pytest.fixture(autouse=True)
def poison_outputs():
    with kernel_testing.poison_outputs():
        yield


def _paged_case(B, Tq, N, Nk, H, lengths, seed=0):
    """``(q, k_pages, v_pages, page_table, k, v)``: random pools, each row's pages drawn
    without replacement, the last pool page all NaN and used past each row's length."""
    rng = np.random.default_rng(seed)
    k_pages = rng.standard_normal((NUM_PAGES, PAGE, Nk, H)).astype(np.float32)
    v_pages = rng.standard_normal((NUM_PAGES, PAGE, Nk, H)).astype(np.float32)
    k_pages[-1] = v_pages[-1] = np.nan
    table = np.full((B, PAGES_PER_SEQ), NUM_PAGES - 1, np.int32)
    free = list(rng.permutation(NUM_PAGES - 1))
    for b, n in enumerate(lengths):
        for s in range(-(-n // PAGE)):
            table[b, s] = free.pop()
    k = k_pages[table].reshape(B, TK, Nk, H)  # the gathered dense keys
    v = v_pages[table].reshape(B, TK, Nk, H)
    q = rng.standard_normal((B, Tq, N, H)).astype(np.float32)
    return (jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(table),
            jnp.asarray(np.nan_to_num(k)), jnp.asarray(np.nan_to_num(v)))


def _both(q, k_pages, v_pages, table, k, v, lengths, **kw):
    lens = jnp.asarray(lengths, jnp.int32)
    q_pos = lens[:, None] - q.shape[1] + jnp.arange(q.shape[1])[None, :]
    args = dict(q_positions=q_pos, kv_positions=jnp.arange(TK), kv_lengths=lens, **kw)
    splits = args.pop("kv_splits", None)
    dense = fused.kernel_attention(q, k, v, interpret=True, block_k=PAGE, kv_splits=splits,
                                   return_lse=True, **args)
    call = fused.kernel_call(q, k, v, **args)
    paged = paged_attention_kernel(call, k_pages, v_pages, table, interpret=True,
                                   kv_splits=splits, return_lse=True)
    return dense, paged


def _close(dense, paged):
    for a, b, what in zip(dense, paged, ("out", "lse")):
        a, b = np.asarray(a), np.asarray(b)
        assert np.isfinite(b[np.isfinite(a)]).all(), what
        np.testing.assert_allclose(b, a, err_msg=what, **TOL)


def test_decode_step_equals_the_dense_kernel_on_gathered_keys():
    """Decode (Tq = 1), GQA 4:2, causal, ALiBi, sinks, two key splits; lengths 29, 8, 1
    (a last page partly filled, one page exactly, one slot)."""
    lengths = [29, 8, 1]
    case = _paged_case(3, 1, 4, 2, 16, lengths)
    slopes = jnp.asarray([0.5, 0.25, 0.125, 0.0625])
    _close(*_both(*case, lengths, causal=True, score_mod=alibi_score_mod(slopes),
                  sinks=jnp.asarray([0.3, -1.0, 0.0, 2.0]), kv_splits=2))


@pytest.mark.slow
def test_chunked_prefill_with_a_window_equals_the_dense_kernel():
    """Three queries at the end of each row (chunked prefill), a sliding window of 6 as a
    block mask over the logical slots (pages wholly outside it are EMPTY tiles), a T5-style
    captured per-head offset vector."""
    lengths = [30, 19]
    case = _paged_case(2, 3, 2, 2, 16, lengths, seed=1)
    lens = jnp.asarray(lengths)
    q_pos = lens[:, None] - 3 + jnp.arange(3)[None, :]
    window = lambda b, h, qp, kp: (qp - kp) < 6
    bm = create_block_mask(window, q_positions=q_pos, kv_positions=jnp.arange(TK),
                           block_q=8, block_k=PAGE, batch_size=2)
    vec = jnp.linspace(-1.0, 1.0, 2 * 9).reshape(2, 9)
    mod = lambda s, b, h, qp, kp: s + vec[h, jnp.clip(kp - qp, -4, 4) + 4]
    _close(*_both(*case, lengths, causal=True, block_mask=bm, score_mod=mod))


def test_pages_past_the_length_are_never_visited():
    """Counted inside the kernel: row lengths 17 and 0 over 4 pages of 8: row 0 visits
    pages 0 and 1 (FULL) and page 2 (cut by the length: masked), row 1 nothing."""
    lengths = [17, 0]
    q, k_pages, v_pages, table, k, v = _paged_case(2, 1, 2, 2, 16, lengths)
    call = fused.kernel_call(q, k, v, q_positions=jnp.asarray([[16], [0]]),
                             kv_positions=jnp.arange(TK), causal=True,
                             kv_lengths=jnp.asarray(lengths))
    with kernel_testing.counting_tiles() as counter:
        out = paged_attention_kernel(call, k_pages, v_pages, table, interpret=True,
                                     kv_splits=1)
        jax.block_until_ready(out)
        jax.effects_barrier()
    fwd = counter.table("fwd", (2, 2, 1))  # [B, N programs, nq]
    np.testing.assert_array_equal(fwd[:, 0, 0], [[1, 2], [0, 0]])
    np.testing.assert_array_equal(np.asarray(out[1]), 0.0)  # nothing visible: zeros


def test_bad_paged_arguments_raise():
    q, k_pages, v_pages, table, k, v = _paged_case(1, 1, 2, 2, 16, [5])
    call = fused.kernel_call(q, k, v, q_positions=jnp.asarray([4]),
                             kv_positions=jnp.arange(TK), kv_lengths=jnp.asarray([5]))
    with pytest.raises(ValueError, match="block_k.*page size 8; got 16"):
        paged_attention_kernel(call.replace(block_k=16), k_pages, v_pages, table)
    with pytest.raises(ValueError, match="needs kv_lengths"):
        paged_attention_kernel(call.replace(kv_lengths=None), k_pages, v_pages, table)
    with pytest.raises(ValueError, match="page size must be a power of two"):
        paged_attention_kernel(call, k_pages[:, :6], v_pages[:, :6], table)
    with pytest.raises(NotImplementedError, match="forward pass only"):
        jax.grad(lambda q: jnp.sum(paged_attention_kernel(
            call.replace(q=q), k_pages, v_pages, table, interpret=True)))(q)


_TRITON_CALL = "__gpu$xla.gpu.triton"


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_paged_kernel_lowers(platform):
    """A decode step over 64-slot pages (GQA 8:2, head dim 128, ALiBi, causal) exports for
    the target: one kernel call."""
    B, N, Nk, H, P, pps, num = 2, 8, 2, 128, 64, 4, 16
    slopes = jnp.linspace(0.1, 0.8, N)

    def f(q, k_pages, v_pages, table, lens):
        call = fused.kernel_call(q, jnp.zeros((B, P * pps, Nk, H), q.dtype),
                                 jnp.zeros((B, P * pps, Nk, H), q.dtype),
                                 q_positions=lens[:, None] - 1, kv_positions=jnp.arange(P * pps),
                                 causal=True, kv_lengths=lens,
                                 score_mod=alibi_score_mod(slopes))
        return paged_attention_kernel(call, k_pages, v_pages, table, interpret=False)

    sds = jax.ShapeDtypeStruct
    args = (sds((B, 1, N, H), jnp.bfloat16), sds((num, P, Nk, H), jnp.bfloat16),
            sds((num, P, Nk, H), jnp.bfloat16), sds((B, pps), jnp.int32), sds((B,), jnp.int32))
    checks = [jax.export.DisabledSafetyCheck.custom_call(_TRITON_CALL)]
    mlir = jax.export.export(jax.jit(f), platforms=[platform], disabled_checks=checks)(
        *args).mlir_module()
    marker = "tpu_custom_call" if platform == "tpu" else "xla.gpu.triton"
    assert mlir.count(marker) >= 1


def test_attention_with_a_page_table_runs_the_paged_kernel():
    """``jaxpos.attention(q, k_pages, v_pages, page_table=..., implementation="pallas")``
    (ALiBi, causal, GQA, a decode step) runs the paged kernel (its forward program visits
    the row's pages: 3, 1 and 4 of them) and equals the chunked paged path."""
    import jaxpos

    lengths = [17, 8, 32]
    q, k_pages, v_pages, table, _, _ = _paged_case(3, 1, 4, 2, 16, lengths, seed=2)
    kw = dict(page_table=table, kv_lengths=jnp.asarray(lengths), causal=True,
              position=jaxpos.ALiBi(4))
    with kernel_testing.counting_tiles() as counter:
        out = jaxpos.attention(q, k_pages, v_pages, implementation="pallas", **kw)
        jax.block_until_ready(out)
        jax.effects_barrier()
    visits = [sum(n for (kernel, ids, _), n in counter.trips.items()
                  if kernel == "fwd" and ids[:2] == (b, 0)) for b in range(3)]
    assert visits == [3, 1, 4]  # pages visited by KV head 0's programs (all key splits)
    ref = jaxpos.attention(q, k_pages, v_pages, implementation="chunked", **kw)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)
