"""Bad input, everywhere.

One table row per bad-input case: the call, the exception type it must raise, and the
words its message must contain (the argument's name, what it got, what was expected).
Every row runs eagerly; rows whose inputs are arrays also run under ``jax.jit`` to show
the error is raised at trace time, before any device work.

A row is ``Case(id, fn, args, kwargs, exc, words)``. ``fn(*args, **kwargs)`` must raise
``exc``; the message must contain every string in ``words`` (case-insensitive): the
argument's name, the value or shape it received, and usually what was expected.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
import pytest

import jaxpos
from jaxpos import (
    ALiBi,
    RoPE,
    Shaw,
    T5Bias,
    alibi_bias,
    alibi_slopes,
    apply_rope,
    as_scheme,
    attention,
    learned_positions,
    relative_bias_attention,
    relative_head_W,
    rope_frequencies,
    shaw_attention,
    shift_matrix,
    sinusoidal_pe,
    t5_bias,
    t5_bucket,
)

B, T, N, H = 2, 4, 4, 8


def _x(*shape, dtype=np.float32):
    return np.zeros(shape, dtype)


Q = _x(B, T, N, H)
KV = _x(B, T, N, H)
POS = np.arange(T, dtype=np.int32)
TABLE_T5 = _x(32, N)
SHAW = _x(5, H)  # 2K + 1 = 5 rows, K = 2


class Case(NamedTuple):
    id: str
    fn: Callable[..., Any]
    args: tuple = ()
    kwargs: dict = {}
    exc: type = ValueError
    words: tuple = ()
    jit: bool = True  # also run with the array args traced under jax.jit


def att(**kw):
    """An attention case on the standard q, k, v unless overridden."""
    q = kw.pop("q", Q)
    k = kw.pop("k", KV)
    v = kw.pop("v", KV)
    return (q, k, v), kw


def A(id, exc, words, **kw):
    args, kwargs = att(**kw)
    return Case(id, attention, args, kwargs, exc, words)


CASES = [
    # ---------------------------------------------------------------- attention: q, k, v
    A("attention/q-rank3", ValueError, ("q", "rank 4", "(2, 4, 4)"), q=_x(B, T, N)),
    A("attention/k-rank5", ValueError, ("k", "rank 4"), k=_x(B, T, N, H, 1)),
    A("attention/v-rank2", ValueError, ("v", "rank 4"), v=_x(T, H)),
    A("attention/q-int-dtype", TypeError, ("q", "floating", "int32"), q=np.zeros((B, T, N, H), np.int32)),
    A("attention/k-bool-dtype", TypeError, ("k", "floating", "bool"), k=np.zeros((B, T, N, H), bool)),
    A("attention/batch-k", ValueError, ("batch", "k (3, 4, 4, 8)"), k=_x(B + 1, T, N, H)),
    A("attention/batch-v", ValueError, ("batch", "v (3, 4, 4, 8)"), v=_x(B + 1, T, N, H)),
    A("attention/head_dim-k", ValueError, ("head_dim", "k"), k=_x(B, T, N, H + 2)),
    A("attention/seq-v", ValueError, ("v", "sequence length"), v=_x(B, T + 1, N, H)),
    A("attention/heads-v", ValueError, ("v", "heads"), v=_x(B, T, N // 2, H)),
    A("attention/gqa-not-divisible", ValueError, ("multiple of key/value heads", "(3)"),
      k=_x(B, T, 3, H), v=_x(B, T, 3, H)),
    A("attention/gqa-more-kv-heads", ValueError, ("multiple of key/value heads", "(8)"),
      k=_x(B, T, 2 * N, H), v=_x(B, T, 2 * N, H)),
    # ---------------------------------------------------------------- attention: positions
    A("attention/q_positions-length", ValueError, ("q_positions", f"[{T}]", "(5,)"),
      q_positions=np.arange(T + 1)),
    A("attention/q_positions-float", TypeError, ("q_positions", "integer", "float32"),
      q_positions=np.arange(T, dtype=np.float32)),
    A("attention/kv_positions-float64", TypeError, ("kv_positions", "integer", "float64"),
      kv_positions=np.arange(T, dtype=np.float64)),
    A("attention/q_positions-bool", TypeError, ("q_positions", "bool"),
      q_positions=np.ones(T, bool)),
    A("attention/kv_positions-batch", ValueError, ("kv_positions", f"[{B}, {T}]"),
      kv_positions=np.zeros((B + 1, T), np.int32)),
    A("attention/kv_positions-rank3", ValueError, ("kv_positions", "rank 3"),
      kv_positions=np.zeros((B, T, 1), np.int32)),
    A("attention/q_positions-scalar", ValueError, ("q_positions",),
      q_positions=np.int32(0)),
    # ---------------------------------------------------------------- attention: options
    A("attention/implementation-unknown", ValueError, ("implementation", "'flash'", "reference"),
      implementation="flash"),
    A("attention/implementation-case", ValueError, ("implementation", "'Reference'"),
      implementation="Reference"),
    A("attention/position-string", TypeError, ("position", "'rope'"), position="rope"),
    A("attention/position-array", TypeError, ("position", "ndarray"), position=np.zeros(3)),
    A("attention/block_q-zero", ValueError, ("block_q", "positive", "0"), block_q=0,
      implementation="chunked"),
    A("attention/block_k-negative", ValueError, ("block_k", "positive", "-4"), block_k=-4,
      implementation="chunked"),
    A("attention/block_q-float", TypeError, ("block_q", "int", "2.0"), block_q=2.0,
      implementation="chunked"),
    A("attention/block_k-bool", TypeError, ("block_k", "int", "True"), block_k=True,
      implementation="chunked"),
    A("attention/mask-float", TypeError, ("mask", "boolean", "float32"),
      mask=np.ones((T, T), np.float32)),
    A("attention/mask-shape", ValueError, ("mask", "[2, 4, 4, 4]", "3, 4)"), mask=np.ones((3, T), bool)),
    A("attention/mask-rank5", ValueError, ("mask", "broadcastable"), mask=np.ones((1, B, N, T, T), bool)),
    A("attention/segment_ids-shape", ValueError, ("segment_ids", f"[{B}, {T}]"),
      segment_ids=np.zeros((T,), np.int32)),
    A("attention/segment_ids-float", TypeError, ("segment_ids", "float32"),
      segment_ids=np.zeros((B, T), np.float32)),
    A("attention/kv_segment_ids-alone", ValueError, ("segment_ids", "got only kv_segment_ids"),
      kv_segment_ids=np.zeros((B, T), np.int32)),
    A("attention/segment_ids-cross-length", ValueError, ("kv_segment_ids", "Tq != Tk", "4 vs 6"),
      k=_x(B, T + 2, N, H), v=_x(B, T + 2, N, H), segment_ids=np.zeros((B, T), np.int32)),
    # ---------------------------------------------------------------- attention: schemes
    A("attention/rope-rotary_dim>head_dim", ValueError, ("rotary_dim", f"head_dim={H}", "16"),
      position=RoPE(rotary_dim=2 * H)),
    A("attention/alibi-slopes-count", ValueError, ("slopes", f"[{N}]", "(3,)"),
      position=ALiBi(num_heads=3)),
    A("attention/t5-table-heads", ValueError, ("table", f"[32, {N}]", "(32, 3)"),
      position=T5Bias(_x(32, 3))),
    A("attention/shaw-width", ValueError, ("rel_k", f"[2K + 1, {H}]", "(5, 4)"),
      position=Shaw(_x(5, H // 2))),
    A("attention/shaw-rel_v-width-vs-v", ValueError, ("v", f"head_dim {H}", "(2, 4, 4, 4)"),
      v=_x(B, T, N, H // 2), position=Shaw(_x(5, H), _x(5, H))),
    # ---------------------------------------------------------------- RoPE and apply_rope
    Case("RoPE/neither", RoPE, (), {}, ValueError, ("inv_freq", "rotary_dim"), jit=False),
    Case("RoPE/rotary_dim-odd", RoPE, (), {"rotary_dim": 7}, ValueError, ("rotary_dim", "even", "7"), jit=False),
    Case("RoPE/rotary_dim-zero", RoPE, (), {"rotary_dim": 0}, ValueError, ("rotary_dim", "positive", "0"), jit=False),
    Case("RoPE/rotary_dim-float", RoPE, (), {"rotary_dim": 8.0}, TypeError, ("rotary_dim", "int", "8.0"), jit=False),
    Case("RoPE/layout-unknown", RoPE, (), {"rotary_dim": 8, "layout": "gptj"}, ValueError,
         ("layout", "'gptj'", "interleaved"), jit=False),
    Case("RoPE/inv_freq-rank2", RoPE, (_x(2, 4),), {}, ValueError, ("inv_freq", "rank 1"), jit=False),
    Case("RoPE/inv_freq-int", RoPE, (np.arange(4),), {}, TypeError, ("inv_freq", "floating"), jit=False),
    Case("RoPE/inv_freq-vs-rotary_dim", RoPE, (_x(4),), {"rotary_dim": 6}, ValueError,
         ("rotary_dim", "6", "inv_freq"), jit=False),
    Case("rope_frequencies/odd", rope_frequencies, (9,), {}, ValueError, ("rotary_dim", "even", "9"), jit=False),
    Case("rope_frequencies/negative", rope_frequencies, (-4,), {}, ValueError, ("rotary_dim", "-4"), jit=False),
    Case("rope_frequencies/float", rope_frequencies, (8.0,), {}, TypeError, ("rotary_dim", "8.0"), jit=False),
    Case("rope_frequencies/base-zero", rope_frequencies, (8, 0.0), {}, ValueError, ("base", "> 0", "0.0"), jit=False),
    Case("rope_frequencies/base-negative", rope_frequencies, (8, -1e4), {}, ValueError, ("base", "-10000"), jit=False),
    Case("apply_rope/x-rank3", apply_rope, (_x(T, N, H), POS, _x(H // 2)), {}, ValueError, ("x", "rank 4")),
    Case("apply_rope/inv_freq-rank2", apply_rope, (Q, POS, _x(1, H // 2)), {}, ValueError, ("inv_freq", "rank 1")),
    Case("apply_rope/rotary_dim>head", apply_rope, (Q, POS, _x(H)), {}, ValueError,
         ("rotary_dim", f"head_dim={H}", str(2 * H))),
    Case("apply_rope/positions-length", apply_rope, (Q, np.arange(T + 3), _x(H // 2)), {}, ValueError,
         ("positions", f"[{T}]", "(7,)")),
    Case("apply_rope/positions-float", apply_rope, (Q, POS.astype(np.float32), _x(H // 2)), {}, TypeError,
         ("positions", "integer", "float32")),
    Case("apply_rope/positions-batch", apply_rope, (Q, np.zeros((B + 1, T), np.int32), _x(H // 2)), {},
         ValueError, ("positions", f"[{B}, {T}]", "(3, 4)")),
    Case("apply_rope/layout", apply_rope, (Q, POS, _x(H // 2)), {"layout": "neox"}, ValueError,
         ("layout", "'neox'")),
    Case("apply_rope/inv_freq-ragged-tuple", apply_rope, (Q, POS, (_x(H // 2), _x(2))), {}, TypeError,
         ("inv_freq", "rope_frequencies", "tuple", "(4,)", "(2,)"), jit=False),
    Case("apply_rope/attention_factor-twice", apply_rope, (Q, POS, (_x(H // 2), 1.5)),
         {"attention_factor": 2.0}, ValueError, ("attention_factor", "twice", "1.5", "2.0"), jit=False),
    # ---------------------------------------------------------------- ALiBi
    Case("ALiBi/neither", ALiBi, (), {}, ValueError, ("num_heads", "slopes"), jit=False),
    Case("ALiBi/slopes-rank2", ALiBi, (), {"slopes": _x(2, 4)}, ValueError, ("slopes", "rank 1"), jit=False),
    Case("ALiBi/num_heads-zero", ALiBi, (0,), {}, ValueError, ("num_heads", "0"), jit=False),
    Case("alibi_slopes/zero", alibi_slopes, (0,), {}, ValueError, ("num_heads", "positive", "0"), jit=False),
    Case("alibi_slopes/float", alibi_slopes, (8.0,), {}, TypeError, ("num_heads", "int", "8.0"), jit=False),
    Case("alibi_slopes/bool", alibi_slopes, (True,), {}, TypeError, ("num_heads", "int", "True"), jit=False),
    Case("alibi_bias/q_positions-float", alibi_bias, (POS.astype(np.float32), POS, _x(N)), {}, TypeError,
         ("q_positions", "integer", "float32")),
    Case("alibi_bias/kv_positions-rank3", alibi_bias, (POS, np.zeros((1, 1, T), np.int32), _x(N)), {},
         ValueError, ("kv_positions", "rank 1 or 2", "(1, 1, 4)")),
    Case("alibi_bias/slopes-rank2", alibi_bias, (POS, POS, _x(1, N)), {}, ValueError, ("slopes", "rank 1")),
    Case("alibi_bias/batch-mismatch", alibi_bias, (np.zeros((2, T), np.int32), np.zeros((3, T), np.int32),
         _x(N)), {}, ValueError, ("q_positions", "kv_positions", "batch sizes 2 and 3")),
    # ---------------------------------------------------------------- T5
    Case("T5Bias/table-rank1", T5Bias, (_x(32),), {}, ValueError, ("table", "rank 2"), jit=False),
    Case("T5Bias/num_buckets-vs-table", T5Bias, (TABLE_T5,), {"num_buckets": 16}, ValueError,
         ("table", "num_buckets=16", "(32, 4)"), jit=False),
    Case("T5Bias/num_buckets-odd", T5Bias, (_x(31, N),), {}, ValueError, ("num_buckets", "even", "31"), jit=False),
    Case("T5Bias/max_distance-zero", T5Bias, (TABLE_T5,), {"max_distance": 0}, ValueError,
         ("max_distance", "0"), jit=False),
    Case("T5Bias/max_distance-small", T5Bias, (TABLE_T5,), {"max_distance": 8}, ValueError,
         ("max_distance", "8"), jit=False),
    Case("T5Bias/max_distance-float", T5Bias, (TABLE_T5,), {"max_distance": 128.0}, TypeError,
         ("max_distance", "128.0"), jit=False),
    Case("t5_bucket/rel-float", t5_bucket, (np.zeros(3, np.float32),), {}, TypeError, ("rel", "float32")),
    Case("t5_bucket/num_buckets-odd", t5_bucket, (np.zeros(3, np.int32),), {"num_buckets": 33}, ValueError,
         ("num_buckets", "even", "33")),
    Case("t5_bucket/num_buckets-zero", t5_bucket, (np.zeros(3, np.int32),), {"num_buckets": 0}, ValueError,
         ("num_buckets", "positive", "0")),
    Case("t5_bucket/num_buckets-float", t5_bucket, (np.zeros(3, np.int32),), {"num_buckets": 32.0}, TypeError,
         ("num_buckets", "32.0")),
    Case("t5_bucket/num_buckets-too-few", t5_bucket, (np.zeros(3, np.int32),), {"num_buckets": 2}, ValueError,
         ("num_buckets", "2")),
    Case("t5_bucket/max_distance-small", t5_bucket, (np.zeros(3, np.int32),), {"max_distance": 4},
         ValueError, ("max_distance", "4")),
    Case("t5_bucket/max_distance-negative", t5_bucket, (np.zeros(3, np.int32),), {"max_distance": -1},
         ValueError, ("max_distance", "-1")),
    Case("t5_bias/table-rows", t5_bias, (POS, POS, _x(16, N)), {}, ValueError, ("table", "num_buckets=32", "(16, 4)")),
    Case("t5_bias/table-rank3", t5_bias, (POS, POS, _x(32, N, 1)), {}, ValueError, ("table", "rank 2")),
    Case("t5_bias/q_positions-float", t5_bias, (POS.astype(np.float16), POS, TABLE_T5), {}, TypeError,
         ("q_positions", "float16")),
    Case("t5_bias/kv_positions-rank3", t5_bias, (POS, np.zeros((1, 1, T), np.int32), TABLE_T5), {}, ValueError,
         ("kv_positions", "rank 1 or 2")),
    Case("t5_bias/num_buckets-odd", t5_bias, (POS, POS, _x(31, N)), {"num_buckets": 31}, ValueError,
         ("num_buckets", "31")),
    Case("relative_bias_attention/Q-rank2", relative_bias_attention, (_x(T, H), _x(T, H), _x(T, H), TABLE_T5),
         {}, ValueError, ("Q", "[..., T, N, H]")),
    Case("relative_bias_attention/table-rank1", relative_bias_attention, (Q, KV, KV, _x(32)), {}, ValueError,
         ("table", "rank 2")),
    Case("relative_bias_attention/table-heads", relative_bias_attention, (Q, KV, KV, _x(32, N + 1)), {},
         ValueError, ("table", "(32, 5)")),
    # ---------------------------------------------------------------- Shaw
    Case("Shaw/rel_k-even-rows", Shaw, (_x(4, H),), {}, ValueError, ("rel_k", "odd", "(4, 8)"), jit=False),
    Case("Shaw/rel_k-rank3", Shaw, (_x(5, H, 1),), {}, ValueError, ("rel_k", "rank 2"), jit=False),
    Case("Shaw/rel_v-shape", Shaw, (SHAW, _x(7, H)), {}, ValueError, ("rel_v", "(5, 8)", "(7, 8)"), jit=False),
    Case("shaw_attention/q-rank3", shaw_attention, (_x(B, T, H), KV, KV, SHAW, SHAW), {}, ValueError,
         ("q", "rank 4")),
    Case("shaw_attention/rel_k-width", shaw_attention, (Q, KV, KV, _x(5, H + 1), _x(5, H + 1)), {},
         ValueError, ("rel_k", "(5, 9)")),
    # ---------------------------------------------------------------- learned
    Case("learned_positions/out_of_range-unknown", learned_positions, (_x(8, H), POS), {"out_of_range": "ignore"},
         ValueError, ("out_of_range", "'ignore'", "wrap")),
    Case("learned_positions/table-rank1", learned_positions, (_x(8), POS), {}, ValueError, ("table", "rank 2")),
    Case("learned_positions/positions-float", learned_positions, (_x(8, H), POS.astype(np.float32)), {}, TypeError,
         ("positions", "integer", "float32")),
    Case("learned_positions/positions-scalar", learned_positions, (_x(8, H), np.int32(3)), {}, ValueError,
         ("positions", "scalar")),
    Case("learned_positions/sequence-longer-than-table", learned_positions, (_x(4, H), np.arange(6)), {}, ValueError,
         ("positions", "[0, 4)", "0 to 5"), jit=False),
    Case("learned_positions/table-int", learned_positions, (np.zeros((8, H), np.int32), POS), {}, TypeError,
         ("table", "floating", "int32")),
    Case("learned_positions/position-past-table", learned_positions, (_x(8, H), np.array([0, 8])), {}, ValueError,
         ("positions", "[0, 8)", "8"), jit=False),
    Case("learned_positions/position-negative", learned_positions, (_x(8, H), np.array([-1, 2])), {}, ValueError,
         ("positions", "[0, 8)", "-1"), jit=False),
    Case("learned_positions/checked-position-past-table", learned_positions, (_x(8, H), np.array([0, 9])),
         {"out_of_range": "checked"}, ValueError, ("positions", "[0, 8)", "9"), jit=False),
    # ---------------------------------------------------------------- sinusoidal
    Case("sinusoidal_pe/T-negative", sinusoidal_pe, (-1, 8), {}, ValueError, ("T", "-1"), jit=False),
    Case("sinusoidal_pe/d-zero", sinusoidal_pe, (4, 0), {}, ValueError, ("d", "positive", "0"), jit=False),
    Case("sinusoidal_pe/d-float", sinusoidal_pe, (4, 8.0), {}, TypeError, ("d", "int", "8.0"), jit=False),
    Case("sinusoidal_pe/layout", sinusoidal_pe, (4, 8), {"layout": "split"}, ValueError,
         ("layout", "'split'", "concat"), jit=False),
    Case("sinusoidal_pe/base-zero", sinusoidal_pe, (4, 8, 0.0), {}, ValueError, ("base", "0.0"), jit=False),
    Case("sinusoidal_pe/offset-float", sinusoidal_pe, (4, 8), {"offset": 1.5}, TypeError,
         ("offset", "integer"), jit=False),
    Case("sinusoidal_pe/offset-rank2", sinusoidal_pe, (4, 8), {"offset": np.zeros((2, 2), np.int32)},
         ValueError, ("offset", "(2, 2)"), jit=False),
    Case("sinusoidal_pe/spacing", sinusoidal_pe, (4, 8), {"spacing": "t2t"}, ValueError,
         ("spacing", "'t2t'", "tensor2tensor"), jit=False),
    Case("shift_matrix/d-odd", shift_matrix, (1, 7), {}, ValueError, ("d", "even", "7"), jit=False),
    Case("shift_matrix/d-zero", shift_matrix, (1, 0), {}, ValueError, ("d", "0"), jit=False),
    Case("relative_head_W/d-odd", relative_head_W, (1, 5), {}, ValueError, ("d", "even", "5"), jit=False),
    # ---------------------------------------------------------------- as_scheme
    Case("as_scheme/unknown-string", as_scheme, ("alibi",), {}, TypeError, ("position", "'alibi'"), jit=False),
    Case("as_scheme/int", as_scheme, (3,), {}, TypeError, ("position", "int"), jit=False),
]


# ---------------------------------------------------------------- modules and extras
def L(id, thunk, exc, words):
    """A case whose call is a thunk (constructors, modules): eager only."""
    return Case(id, thunk, (), {}, exc, words, jit=False)


def _nnx():
    from flax import nnx

    from jaxpos import nnx as jn
    return nnx, jn


def _decoder(**kw):
    nnx, jn = _nnx()
    kw = dict({"d_model": 16, "num_layers": 1, "num_heads": 2, "rngs": nnx.Rngs(0)}, **kw)
    return jn.DecoderLM(32, **kw)


_TOK = np.zeros((2, 4), np.int32)


def _shaw():
    import sys
    return sys.modules["jaxpos.schemes.shaw"]


def _mha():
    nnx, jn = _nnx()
    return jn.MultiHeadAttention(16, 2, rngs=nnx.Rngs(0))


def _linen_init(position="rope", tokens=_TOK, **kw):
    from jaxpos import linen as jl
    model = jl.DecoderLM(vocab_size=32, d_model=16, num_layers=1, num_heads=2,
                         position=position, **kw)
    return model.init(jax.random.PRNGKey(0), tokens)


def _rs():
    from jaxpos.schemes.rope import scaling as rope_scaling
    return rope_scaling


_LLAMA_CFG = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
              "rope_theta": 10000.0}


def _rope():
    import sys
    return sys.modules["jaxpos.schemes.rope"]


def _sin():
    import sys
    return sys.modules["jaxpos.schemes.sinusoidal"]


def _hf():
    from jaxpos.interop import hf
    return hf


def _kernels():
    from jaxpos import kernels
    return kernels


def _testing():
    from jaxpos import testing
    return testing


def _linen():
    from jaxpos import linen
    return linen


def _fused(**kw):
    from jaxpos.kernels import fused_attention
    q = kw.pop("q", Q)
    k = kw.pop("k", KV)
    return fused_attention(q, k, KV, q_positions=POS, kv_positions=POS, **kw)


CASES += [
    # Pallas through attention(): what the kernel cannot do is refused, never approximated
    A("attention/pallas-block_q-not-power-of-two", ValueError, ("block_q", "power of two", "6"),
      implementation="pallas", block_q=6),
    A("attention/pallas-block_k-not-power-of-two", ValueError, ("block_k", "power of two", "24"),
      implementation="pallas", block_k=24),
    A("attention/pallas-shaw", ValueError, ("Shaw", "implementation='chunked'"),
      implementation="pallas", position=Shaw(SHAW)),
    A("attention/pallas-mask", ValueError, ("mask", "(1, 1, 4, 4)", "segment_ids"),
      implementation="pallas", mask=np.ones((T, T), bool)),
    # jaxpos.kernels.fused_attention directly
    L("fused_attention/dtype-mismatch", lambda: _fused(k=KV.astype(np.float16)), TypeError,
      ("share a dtype", "float16")),
    L("fused_attention/block_q", lambda: _fused(block_q=12), ValueError, ("block_q", "power of two", "12")),
    L("fused_attention/block_k-zero", lambda: _fused(block_k=0), ValueError, ("block_k", "0")),
    L("fused_attention/offset_bias-even", lambda: _fused(offset_bias=_x(N, 6)), ValueError,
      ("offset_bias", "2R + 1", "(4, 6)")),
    L("fused_attention/alibi_slopes-count", lambda: _fused(alibi_slopes=_x(3)), ValueError,
      ("alibi_slopes", f"[{N}]", "(3,)")),
    L("fused_attention/inv_freq-too-long", lambda: _fused(inv_freq=_x(H)), ValueError,
      ("inv_freq", f"H/2 = {H // 2}", "8")),
    L("fused_attention/interpret", lambda: _fused(interpret="yes"), TypeError, ("interpret", "'yes'")),
    L("fused_attention/rope_layout", lambda: _fused(inv_freq=_x(2), rope_layout="gptj"), ValueError,
      ("rope_layout", "'gptj'")),
    L("fused_attention/q-rank3", lambda: _fused(q=_x(B, T, H)), ValueError, ("q", "rank 4")),
    # RoPE scaling dataclasses (field names as HF's rope_scaling keys)
    L("LinearScaling/factor-zero", lambda: _rs().LinearScaling(factor=0.0), ValueError,
      ("LinearScaling.factor", "0.0")),
    L("Llama3Scaling/freq-order", lambda: _rs().Llama3Scaling(
        factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0,
        original_max_position_embeddings=8192), ValueError, ("high_freq_factor", "low_freq_factor")),
    L("YaRNScaling/original_max-float", lambda: _rs().YaRNScaling(
        factor=4.0, original_max_position_embeddings=4096.0), TypeError,
      ("original_max_position_embeddings", "4096.0")),
    L("rope_frequencies/scaling-dict", lambda: rope_frequencies(8, scaling={"factor": 2.0}), TypeError,
      ("scaling", "LinearScaling", "dict")),
    L("scaling_from_dict/rope_type", lambda: _rs().scaling_from_dict({"rope_type": "bogus"}),
      ValueError, ("rope_type", "'bogus'", "yarn")),
    # Flax NNX modules
    L("nnx.DecoderLM/position", lambda: _decoder(position="no_such_scheme"), ValueError, ("position", "'xpos'", "rope")),
    L("nnx.DecoderLM/learned-without-max_len", lambda: _decoder(position="learned"), ValueError,
      ("max_len", "None")),
    L("nnx.DecoderLM/heads-divide-d_model", lambda: _decoder(num_heads=3), ValueError,
      ("num_heads", "(3)", "d_model")),
    L("nnx.DecoderLM/kv_heads", lambda: _decoder(num_heads=4, num_kv_heads=3), ValueError,
      ("num_kv_heads", "(3)")),
    L("nnx.DecoderLM/tokens-float", lambda: _decoder()(_TOK.astype(np.float32)), TypeError,
      ("tokens", "float32")),
    L("nnx.DecoderLM/tokens-rank1", lambda: _decoder()(_TOK[0]), ValueError, ("tokens", "rank 2", "(4,)")),
    L("nnx.DecoderLM/tokens-out-of-vocab", lambda: _decoder()(_TOK + 40), ValueError,
      ("tokens", "vocab_size=32", "40")),
    L("nnx.DecoderLM/positions-float", lambda: _decoder()(_TOK, positions=POS.astype(np.float32)),
      TypeError, ("positions", "float32")),
    L("nnx.DecoderLM/positions-length", lambda: _decoder()(_TOK, positions=np.arange(5)), ValueError,
      ("positions", "[4]", "(5,)")),
    L("nnx.DecoderLM/implementation", lambda: _decoder()(_TOK, implementation="flash"), ValueError,
      ("implementation", "'flash'")),
    L("nnx.RotaryEmbedding/odd", lambda: _nnx()[1].RotaryEmbedding(7), ValueError, ("rotary_dim", "even", "7")),
    L("nnx.ALiBi/zero-heads", lambda: _nnx()[1].ALiBi(0), ValueError, ("num_heads", "0")),
    L("nnx.T5RelativeBias/odd-buckets", lambda: _nnx()[1].T5RelativeBias(
        4, num_buckets=31, rngs=_nnx()[0].Rngs(0)), ValueError, ("num_buckets", "even", "31")),
    L("nnx.LearnedPositionalEmbedding/max_len", lambda: _nnx()[1].LearnedPositionalEmbedding(
        0, 8, rngs=_nnx()[0].Rngs(0)), ValueError, ("max_len", "0")),
    L("nnx.ShawRelativePosition/max_distance", lambda: _nnx()[1].ShawRelativePosition(
        8, max_distance=0, rngs=_nnx()[0].Rngs(0)), ValueError, ("max_distance", "0")),
    L("nnx.MultiHeadAttention/heads", lambda: _nnx()[1].MultiHeadAttention(
        16, 3, rngs=_nnx()[0].Rngs(0)), ValueError, ("num_heads", "(3)")),
    L("nnx.Encoder/position", lambda: _nnx()[1].Encoder(32, d_model=16, num_layers=1, num_heads=2,
      position="no_such_scheme", rngs=_nnx()[0].Rngs(0)), ValueError, ("position", "'xpos'")),
    L("nnx.DecoderLM.decode_step/cache", lambda: _decoder().decode_step(_TOK[:, :1], cache=None),
      ValueError, ("cache", "KVCache", "NoneType")),
    L("nnx.DecoderLM.init_cache/batch", lambda: _decoder().init_cache(0, 8), ValueError, ("batch", "0")),
    L("nnx.SinusoidalEmbedding/d_model", lambda: _nnx()[1].SinusoidalEmbedding(0), ValueError,
      ("d_model", "0")),
    L("nnx.RotaryEmbedding/positions-float", lambda: _nnx()[1].RotaryEmbedding(H)(
        Q, POS.astype(np.float32)), TypeError, ("positions", "float32")),
    # more scaling dataclasses, HF config readers, kernel dispatch, testing helpers
    L("DynamicNTKScaling/factor-negative", lambda: _rs().DynamicNTKScaling(
        factor=-2.0, original_max_position_embeddings=2048), ValueError, ("factor", "-2.0")),
    L("LongRoPEScaling/factor-lengths", lambda: _rs().LongRoPEScaling(
        short_factor=[1.0, 1.0], long_factor=[1.0], original_max_position_embeddings=4096),
      ValueError, ("short_factor", "long_factor", "2 and 1")),
    L("ProportionalScaling/partial_rotary_factor", lambda: _rs().ProportionalScaling(
        partial_rotary_factor=2.0), ValueError, ("partial_rotary_factor", "[0, 1]", "2.0")),
    L("rope_from_hf_config/config-type", lambda: _hf().rope_from_hf_config(3), TypeError,
      ("config", "int")),
    L("rope_from_hf_config/angle_precision", lambda: _hf().rope_from_hf_config(
        _LLAMA_CFG, angle_precision="f64"), ValueError, ("angle_precision", "'f64'")),
    L("rope_from_hf_config/rope_type", lambda: _hf().rope_from_hf_config(
        dict(_LLAMA_CFG, rope_scaling={"rope_type": "bogus"})), ValueError, ("rope_type", "'bogus'")),
    L("rope_from_hf_config/scaling-dict-alone", lambda: _hf().rope_from_hf_config(
        {"rope_type": "llama3", "factor": 8.0}), ValueError,
      ("config", "whole model config", "rope_scaling", "['factor', 'rope_type']")),
    L("attention/pallas-shaw", lambda: jaxpos.attention(Q, KV, KV, position=Shaw(SHAW),
                                                         implementation="pallas"),
      ValueError, ("Shaw", "content bias or value term", "'chunked'")),
    L("default_implementation/string", lambda: jaxpos.default_implementation("rope"), TypeError,
      ("position", "'rope'")),
    L("testing.assert_translation_invariant/atol", lambda: _testing().assert_translation_invariant(
        lambda a, b: a, POS, POS, atol=-1.0), ValueError, ("atol", "-1.0")),
    L("testing.attention_scores/q-rank3", lambda: _testing().attention_scores(Q[0], KV), ValueError,
      ("q", "rank 4", "(4, 4, 8)")),
    L("linen.params_from_nnx/type", lambda: _linen().params_from_nnx(3), TypeError, ("model", "int")),
    L("linen.RotaryEmbedding/odd", lambda: _linen().RotaryEmbedding(rotary_dim=7).init(
        jax.random.PRNGKey(0), Q, POS), ValueError, ("rotary_dim", "even", "7")),
    L("linen.SinusoidalEmbedding/d_model", lambda: _linen().SinusoidalEmbedding(d_model=0).init(
        jax.random.PRNGKey(0), POS), ValueError, ("d_model", "0")),
    # RoPE variants and weight-layout converters (jaxpos.schemes.rope)
    L("half_to_interleaved/head_dim", lambda: jaxpos.half_to_interleaved(_x(2, 8), head_dim=6),
      ValueError, ("head_dim=6", "size 8")),
    L("interleaved_to_half/rotary_dim", lambda: jaxpos.interleaved_to_half(
        _x(2, 8), head_dim=8, rotary_dim=10), ValueError, ("rotary_dim", "head_dim=8", "10")),
    L("rope_angles/positions-float", lambda: _rope().rope_angles(POS.astype(np.float32), _x(4)),
      TypeError, ("positions", "float32")),
    L("apply_mrope/mrope_section", lambda: _rope().apply_mrope(
        Q, np.zeros((3, T), np.int32), _x(4), mrope_section=[1, 1, 1]), ValueError,
      ("mrope_section", "rotary_dim // 2 = 4", "(1, 1, 1)")),
    L("axial_rope_frequencies/head_dim", lambda: _rope().axial_rope_frequencies(6), ValueError,
      ("head_dim", "multiple of 4", "6")),
    L("p_rope_frequencies/p", lambda: _rope().p_rope_frequencies(8, p=2.0), ValueError,
      ("p must be in [0, 1]", "2.0")),
    L("apply_rope_angles/angles-rank", lambda: _rope().apply_rope_angles(Q, _x(4, 3)), ValueError,
      ("angles", "rank 3", "(4, 3)")),
    L("sinusoidal_frequencies/d", lambda: _sin().sinusoidal_frequencies(0), ValueError, ("d", "0")),
    L("softmax_scale_from_hf_config/type", lambda: _hf().softmax_scale_from_hf_config(3), TypeError,
      ("config", "int")),
    # Flax Linen twins: the same checks when the module is initialised
    L("linen.DecoderLM/position", lambda: _linen_init(position="no_such_scheme"), ValueError, ("position", "'xpos'")),
    L("linen.DecoderLM/tokens-float", lambda: _linen_init(tokens=_TOK.astype(np.float32)), TypeError,
      ("tokens", "float32")),
    # transformer blocks (NNX and Linen): wrong input width named before any norm or matmul
    L("nnx.TransformerBlock/heads", lambda: _nnx()[1].TransformerBlock(
        16, 3, rngs=_nnx()[0].Rngs(0)), ValueError, ("num_heads", "(3)", "d_model")),
    L("nnx.TransformerBlock/mlp_dim", lambda: _nnx()[1].TransformerBlock(
        16, 2, mlp_dim=0, rngs=_nnx()[0].Rngs(0)), ValueError, ("mlp_dim", "0")),
    L("nnx.TransformerBlock/x-width", lambda: _nnx()[1].TransformerBlock(
        16, 2, rngs=_nnx()[0].Rngs(0))(_x(2, 4, 12)), ValueError, ("x", "d_model=16", "(2, 4, 12)")),
    L("nnx.TransformerBlock/x-rank", lambda: _nnx()[1].TransformerBlock(
        16, 2, rngs=_nnx()[0].Rngs(0))(_x(4, 16)), ValueError, ("x", "rank 3", "(4, 16)")),
    L("linen.TransformerBlock/heads", lambda: _linen().TransformerBlock(d_model=16, num_heads=3).init(
        jax.random.PRNGKey(0), _x(2, 4, 16)), ValueError, ("num_heads", "(3)", "d_model")),
    L("linen.TransformerBlock/x-width", lambda: _linen().TransformerBlock(d_model=16, num_heads=2).init(
        jax.random.PRNGKey(0), _x(2, 4, 12)), ValueError, ("x", "d_model=16", "(2, 4, 12)")),
    # Linen position modules, attention and encoder
    L("linen.MultiHeadAttention/kv_heads", lambda: _linen().MultiHeadAttention(
        d_model=16, num_heads=4, num_kv_heads=3).init(jax.random.PRNGKey(0), _x(2, 4, 16)),
      ValueError, ("num_kv_heads", "(3)")),
    L("linen.MultiHeadAttention/x-rank", lambda: _linen().MultiHeadAttention(
        d_model=16, num_heads=2).init(jax.random.PRNGKey(0), _x(4, 16)), ValueError,
      ("x", "rank 3", "(4, 16)")),
    L("linen.Encoder/position", lambda: _linen().Encoder(
        vocab_size=32, d_model=16, num_layers=1, num_heads=2, position="no_such_scheme").init(
        jax.random.PRNGKey(0), _TOK), ValueError, ("position", "'xpos'")),
    L("linen.Encoder/tokens-float", lambda: _linen().Encoder(
        vocab_size=32, d_model=16, num_layers=1, num_heads=2).init(
        jax.random.PRNGKey(0), _TOK.astype(np.float32)), TypeError, ("tokens", "float32")),
    L("linen.ALiBi/zero-heads", lambda: _linen().ALiBi(num_heads=0).init(
        jax.random.PRNGKey(0), POS, POS), ValueError, ("num_heads", "0")),
    L("linen.T5RelativeBias/odd-buckets", lambda: _linen().T5RelativeBias(
        num_heads=N, num_buckets=31).init(jax.random.PRNGKey(0), POS, POS), ValueError,
      ("num_buckets", "even", "31")),
    L("linen.LearnedPositionalEmbedding/max_len", lambda: _linen().LearnedPositionalEmbedding(
        max_len=0, d_model=8).init(jax.random.PRNGKey(0), POS), ValueError, ("max_len", "0")),
    L("linen.LearnedPositionalEmbedding/out-of-range", lambda: _linen().LearnedPositionalEmbedding(
        max_len=2, d_model=8).init(jax.random.PRNGKey(0), POS), ValueError,
      ("positions", "no row for position 3")),
    L("linen.ShawRelativePosition/max_distance", lambda: _linen().ShawRelativePosition(
        head_dim=8, max_distance=0).init(jax.random.PRNGKey(0), POS, POS), ValueError,
      ("max_distance", "0")),
    # M-RoPE and axial 2-D RoPE angle builders
    L("mrope_angles/positions-rows", lambda: _rope().mrope_angles(
        np.zeros((2, T), np.int32), _x(4), mrope_section=[2, 1, 1]), ValueError,
      ("positions", "3 rows", "(2, 4)")),
    L("mrope_angles/positions-float", lambda: _rope().mrope_angles(
        _x(3, T), _x(4), mrope_section=[2, 1, 1]), TypeError, ("positions", "float32")),
    L("axial_rope_angles/positions_hw-last-axis", lambda: _rope().axial_rope_angles(
        np.zeros((T, 3), np.int32), _x(2)), ValueError, ("positions_hw", "axis of 2", "(4, 3)")),
    L("axial_rope_angles/positions_hw-float", lambda: _rope().axial_rope_angles(
        _x(T, 2), _x(2)), TypeError, ("positions_hw", "float32")),
    L("apply_axial_rope/x-rank", lambda: _rope().apply_axial_rope(
        Q[0], np.zeros((T, 2), np.int32), _x(2)), ValueError, ("x", "rank 4", "(4, 4, 8)")),
    L("apply_axial_rope/inv_freq-too-long", lambda: _rope().apply_axial_rope(
        Q, np.zeros((T, 2), np.int32), _x(3)), ValueError, ("rotary_dim", "head_dim=8", "12")),
    L("apply_axial_rope/positions-length", lambda: _rope().apply_axial_rope(
        Q, np.zeros((T + 1, 2), np.int32), _x(2)), ValueError, ("(1, 5, 4)", "(2, 4, 4, 8)")),
    L("apply_axial_rope/layout", lambda: _rope().apply_axial_rope(
        Q, np.zeros((T, 2), np.int32), _x(2), layout="x"), ValueError, ("layout", "'x'")),
    # YaRN's mscale helper and the jaxpos.testing assertions
    L("yarn_get_mscale/negative", lambda: _rs().yarn_get_mscale(-2.0), ValueError, ("scale", "-2.0")),
    L("yarn_get_mscale/string", lambda: _rs().yarn_get_mscale("2"), TypeError, ("scale", "str", "'2'")),
    L("testing.assert_permutation_equivariant/fn", lambda: _testing().assert_permutation_equivariant(
        3, Q), TypeError, ("fn", "callable", "int")),
    L("testing.assert_permutation_equivariant/axis", lambda: _testing().assert_permutation_equivariant(
        lambda x: x, Q, axis=7), ValueError, ("axis", "7", "rank 4")),
    L("testing.assert_translation_invariant/fn", lambda: _testing().assert_translation_invariant(
        None, POS, POS), TypeError, ("fn", "callable", "NoneType")),
    L("testing.assert_translation_invariant/shift", lambda: _testing().assert_translation_invariant(
        lambda a, b: a, POS, POS, shift=1.5), TypeError, ("shift", "1.5")),
    L("testing.assert_equal_under_jit/fn", lambda: _testing().assert_equal_under_jit("f", Q), TypeError,
      ("fn", "callable", "str")),
    L("testing.assert_equal_under_vmap/fn", lambda: _testing().assert_equal_under_vmap(3, Q), TypeError,
      ("fn", "callable", "int")),
    # cross-attention and biases in nnx.MultiHeadAttention
    L("nnx.MultiHeadAttention/context-width", lambda: _mha()(_x(2, 4, 16), context=_x(2, 6, 8)),
      ValueError, ("context", "d_model=16", "(2, 6, 8)")),
    L("nnx.MultiHeadAttention/context-batch", lambda: _mha()(_x(2, 4, 16), context=_x(1, 6, 16)),
      ValueError, ("context", "batch size of x (2)", "(1, 6, 16)")),
    L("nnx.MultiHeadAttention/kv_positions-without-context", lambda: _mha()(
        _x(2, 4, 16), kv_positions=POS), ValueError, ("kv_positions", "cross-attention", "context")),
    L("nnx.MultiHeadAttention/kv_positions-float", lambda: _mha()(
        _x(2, 4, 16), context=_x(2, 6, 16), kv_positions=np.arange(6.0)), TypeError,
      ("kv_positions", "float")),
    L("nnx.MultiHeadAttention/use_bias", lambda: _nnx()[1].MultiHeadAttention(
        16, 2, use_bias="yes", rngs=_nnx()[0].Rngs(0)), TypeError, ("use_bias", "bool", "'yes'")),
    L("linen.MultiHeadAttention/context-width", lambda: _linen().MultiHeadAttention(
        d_model=16, num_heads=2).init(jax.random.PRNGKey(0), _x(2, 4, 16), context=_x(2, 6, 8)),
      ValueError, ("context", "d_model=16", "(2, 6, 8)")),
    # Shaw building blocks (jaxpos.schemes.shaw)
    L("shaw_clipped_index/max_distance", lambda: _shaw().shaw_clipped_index(POS, POS, -1), ValueError,
      ("max_distance", "-1")),
    L("shaw_clipped_index/positions-float", lambda: _shaw().shaw_clipped_index(
        POS.astype(np.float32), POS, 2), TypeError, ("q_positions", "float32")),
    L("shaw_logits/rel_k-width", lambda: _shaw().shaw_logits(
        Q, np.zeros((1, T, T), np.int32), _x(5, 6)), ValueError, ("rel_k", "head size 8", "(5, 6)")),
    L("shaw_logits/idx-rank", lambda: _shaw().shaw_logits(Q, np.zeros((T, T), np.int32), SHAW),
      ValueError, ("idx", "rank 3", "(4, 4)")),
    L("shaw_values/p-rank", lambda: _shaw().shaw_values(_x(T, T), np.zeros((1, T, T), np.int32), SHAW),
      ValueError, ("p", "rank 4", "(4, 4)")),
    L("shaw_values/idx-length", lambda: _shaw().shaw_values(
        _x(B, N, T, T), np.zeros((1, T, T + 1), np.int32), SHAW), ValueError, ("idx", "key length 4")),
    L("check_shaw_table/even-rows", lambda: _shaw().check_shaw_table("rel_k", _x(4, H)), ValueError,
      ("rel_k", "odd number of rows", "(4, 8)")),
    # arguments of the wrong kind or value (an array scale, a string or infinite base, ...)
    A("attention/scale-array", ValueError, ("scale", "scalar", "(4,)"), scale=np.ones(4, np.float32)),
    L("RoPE/base-string", lambda: RoPE(rotary_dim=8, base="10000"), TypeError, ("base", "str", "'10000'")),
    L("RoPE/base-inf", lambda: RoPE(rotary_dim=8, base=float("inf")), ValueError, ("base", "inf")),
    L("RoPE/dynamic-rotary_dim-2", lambda: attention(Q[..., :2], KV[..., :2], KV[..., :2], position=RoPE(
        rotary_dim=2, scaling=_rs().DynamicNTKScaling(factor=2.0, original_max_position_embeddings=2))),
      ValueError, ("DynamicNTKScaling", "rotary_dim >= 4", "rotary_dim=2")),
    L("LinearScaling/factor-string", lambda: _rs().LinearScaling("2"), TypeError,
      ("LinearScaling.factor", "str", "'2'")),
    L("t5_bucket/bidirectional-string", lambda: t5_bucket(np.arange(4), bidirectional="no"), TypeError,
      ("bidirectional", "bool", "'no'")),
    L("sinusoidal_pe/offset-past-int32", lambda: sinusoidal_pe(3, 4, offset=np.int64(2 ** 32 + 5)),
      ValueError, ("offset", "int32", "4294967301")),
    L("sinusoidal_pe/base-string", lambda: sinusoidal_pe(4, 8, base="1e4"), TypeError, ("base", "'1e4'")),
    L("nnx.DecoderLM/implementation-at-construction", lambda: _decoder(implementation="fast"),
      ValueError, ("implementation", "'fast'", "chunked")),
    L("linen.MultiHeadAttention/implementation", lambda: _linen().MultiHeadAttention(
        d_model=16, num_heads=2, implementation="fast").init(jax.random.PRNGKey(0), _x(2, 4, 16)),
      ValueError, ("implementation", "'fast'")),
    # length-dependent RoPE frequencies, HF settings reader, kernel predicate, low-level rotate
    L("depends_on_length/dict", lambda: _rs().depends_on_length({"factor": 2.0}), TypeError,
      ("scaling", "dict")),
    L("frequencies_for_length/rotary_dim-odd", lambda: _rs().frequencies_for_length(
        7, 10000.0, None, 5), ValueError, ("rotary_dim", "even", "7")),
    L("frequencies_for_length/seq_len-float", lambda: _rs().frequencies_for_length(
        8, 10000.0, _rs().DynamicNTKScaling(factor=2.0, original_max_position_embeddings=4), 5.5),
      TypeError, ("seq_len", "5.5")),
    L("frequencies_for_length/scaling-str", lambda: _rs().frequencies_for_length(
        8, 10000.0, "dynamic", 5), TypeError, ("scaling", "'dynamic'")),
    L("scaled_frequencies/base", lambda: _rs().scaled_frequencies(8, -1.0, _rs().LinearScaling(
        factor=2.0)), ValueError, ("base", "-1.0")),
    L("hf_rope_settings/config-type", lambda: _hf().hf_rope_settings(3), TypeError, ("config", "int")),
    L("hf_rope_settings/no-head-width", lambda: _hf().hf_rope_settings({}), ValueError,
      ("head_dim", "hidden_size", "num_attention_heads")),
    L("kernels.supports_scheme/string", lambda: _kernels().supports_scheme("rope"), TypeError,
      ("scheme", "PositionScheme", "'rope'")),
    L("rope.rotate/x-rank", lambda: _rope().rotate(Q[0], _x(1, T, 4), _x(1, T, 4), layout="half"),
      ValueError, ("x", "rank 4", "(4, 4, 8)")),
    L("rope.rotate/cos-shape", lambda: _rope().rotate(Q, _x(T, 4), _x(T, 4), layout="half"),
      ValueError, ("cos", "(4, 4)", "half")),
    L("rope.rotate/half-too-wide", lambda: _rope().rotate(Q, _x(1, T, 5), _x(1, T, 5), layout="half"),
      ValueError, ("head_dim=8", "(1, 4, 5)")),
    L("rope.rotate/layout", lambda: _rope().rotate(Q, _x(1, T, 4), _x(1, T, 4), layout="gptj"),
      ValueError, ("layout", "'gptj'")),
    L("nnx.rotate_at_write/scheme", lambda: _nnx()[1].rotate_at_write("rope", Q, KV, POS), TypeError,
      ("scheme", "PositionScheme", "'rope'")),
    L("testing.assert_equal_under_vmap/rtol", lambda: _testing().assert_equal_under_vmap(
        lambda x: x, Q, rtol=-1.0), ValueError, ("rtol", "-1.0")),
]


def _array_argnums(args):
    return tuple(i for i, a in enumerate(args) if isinstance(a, (np.ndarray, jax.Array)) and a.ndim > 0)


def _check_message(err: BaseException, words):
    msg = str(err)
    low = msg.lower()
    for w in words:
        assert w.lower() in low, f"message lacks {w!r}: {msg!r}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_eager(case: Case):
    with pytest.raises(case.exc) as info:
        case.fn(*case.args, **case.kwargs)
    _check_message(info.value, case.words)


JIT_CASES = [c for c in CASES if c.jit and _array_argnums(c.args)]


@pytest.mark.parametrize("case", JIT_CASES, ids=[c.id for c in JIT_CASES])
def test_bad_input_at_trace_time(case: Case):
    """The same error when the array arguments are tracers (raised while tracing under jit)."""
    argnums = _array_argnums(case.args)
    static = {i: a for i, a in enumerate(case.args) if i not in argnums}

    def f(*traced):
        it = iter(traced)
        full = [static[i] if i in static else next(it) for i in range(len(case.args))]
        return case.fn(*full, **case.kwargs)

    with pytest.raises(case.exc) as info:
        jax.jit(f).lower(*(case.args[i] for i in argnums))  # trace + lower only, no compile/run
    _check_message(info.value, case.words)


def test_case_count():
    """The table keeps at least 100 cases (it cannot shrink by accident)."""
    assert len(CASES) >= 100, len(CASES)


def test_learned_traced_out_of_range_is_nan_not_a_clamped_row():
    """Under jit the values are unknown at trace time; the "error" policy must not fall
    back to JAX's silent clamp (row max_len - 1) but poison the result with NaN."""
    table = np.arange(4 * 2, dtype=np.float32).reshape(4, 2)
    out = jax.jit(learned_positions)(table, np.array([0, 3, 4, -1], np.int32))
    np.testing.assert_array_equal(np.asarray(out[:2]), table[[0, 3]])
    assert np.isnan(np.asarray(out[2:])).all(), out
