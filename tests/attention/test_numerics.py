"""Numerics: low precision at long positions against float64, empty
rows, very negative logits, all-padding sequences, sequence tails past the last block.

References are float64 NumPy written here from the papers' formulas (RoPE: Su et al.
2024, §3.4; ALiBi: Press et al. 2022, §3), never our own outputs.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpos
from jaxpos import ALiBi, NoPE, RoPE, Shaw, T5Bias, attention

IMPLS = list(jaxpos.IMPLEMENTATIONS)  # reference, chunked, pallas (interpret mode on CPU)
OTHERS = [i for i in IMPLS if i != "reference"]  # the default run's focus; -m slow adds "reference"
FUSED = ("nope", "rope", "alibi", "t5")  # what the Pallas kernel fuses; Shaw and masks raise


def grid(names, values, default, *, skip=lambda combo: None):
    """pytest params over the product of ``values``; combos not in ``default`` are slow.

    Keeps the default run inside its time budget while CI (``-m slow``) still
    covers every combination."""
    import itertools

    out = []
    for combo in itertools.product(*values):
        marks = [] if combo in default or default == "all" else [pytest.mark.slow]
        reason = skip(combo)
        if reason:
            continue
        out.append(pytest.param(*combo, marks=marks, id="-".join(str(c) for c in combo)))
    return names, out


def _dt_name(dtype):
    return {jnp.bfloat16: "bf16", jnp.float16: "f16", jnp.float32: "f32"}[dtype]
BLOCKS = {"block_q": 4, "block_k": 4}  # several blocks even at tiny T; ignored by "reference"
EPS = {jnp.bfloat16: 2.0 ** -8, jnp.float16: 2.0 ** -11, jnp.float32: 2.0 ** -24}
LOW = [pytest.param(jnp.bfloat16, id="bf16"), pytest.param(jnp.float16, id="f16")]


def jattention(q, k, v, **kw):
    """:func:`jaxpos.attention` under ``jit`` (compiling once is cheaper than op-by-op)."""
    return jax.jit(lambda q, k, v: attention(q, k, v, **kw))(q, k, v)


def out_and_grads(f, w, *args):
    """``f(*args)`` and the gradients of ``sum(f(*args) * w)`` w.r.t. every arg, one jit."""
    def loss(*a):
        out = f(*a)
        return jnp.sum(out.astype(jnp.float32) * w), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))),
                                                 has_aux=True))(*args)
    return out, grads


def _rng(seed=0):
    return np.random.default_rng(seed)


def _f64(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


# ------------------------------------------------------------------------ float64 references
def rope64(x, positions, inv_freq, layout):
    """RoPE in float64 with exact angles ``pos * inv_freq`` (Su et al. 2024, eq. 34)."""
    x = np.asarray(x, np.float64)
    half = len(inv_freq)
    ang = np.asarray(positions, np.float64)[..., None] * np.asarray(inv_freq, np.float64)
    c, s = np.cos(ang)[..., None, :], np.sin(ang)[..., None, :]  # [B|., T, 1, half]
    if layout == "half":
        x1, x2 = x[..., :half], x[..., half:2 * half]
    else:
        x1, x2 = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
    r1, r2 = x1 * c - x2 * s, x2 * c + x1 * s
    out = x.copy()
    if layout == "half":
        out[..., :half], out[..., half:2 * half] = r1, r2
    else:
        out[..., 0:2 * half:2], out[..., 1:2 * half:2] = r1, r2
    return out


def attention64(q, k, v, *, scale, bias=None, visible=None):
    """softmax(scale q k^T + bias) v in float64; rows with no visible key are zeros.

    q ``[B, Tq, N, H]``, k/v ``[B, Tk, N, H]``; bias broadcastable to ``[B, N, Tq, Tk]``.
    """
    s = np.einsum("bqnh,bknh->bnqk", q, k) * scale
    if bias is not None:
        s = s + bias
    vis = np.ones(s.shape, bool) if visible is None else np.broadcast_to(visible, s.shape)
    s = np.where(vis, s, -np.inf)
    mx = np.max(s, axis=-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    p = np.where(vis, np.exp(s - mx), 0.0)
    denom = p.sum(-1, keepdims=True)
    p = p / np.where(denom > 0, denom, 1.0)
    return np.einsum("bnqk,bknh->bqnh", p, v)


def alibi_slopes64(n):
    """Press et al. 2022, §3 and their code's rule for n not a power of two."""
    def pow2(m):
        return [2.0 ** (-8.0 * (i + 1) / m) for i in range(m)]
    if n & (n - 1) == 0:
        return np.array(pow2(n))
    p = 2 ** math.floor(math.log2(n))
    return np.array(pow2(p) + pow2(2 * p)[0::2][: n - p])


# ---------------------------------------------------------------------- RoPE at 1,000,000
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("base", [10000.0, 500000.0])
@pytest.mark.parametrize("dtype", LOW)
def test_apply_rope_low_precision_at_position_one_million(dtype, base, layout):
    """Angles must be formed in float32 (one rounding of pos * inv_freq, at most one ulp
    of the angle: <= 0.0625 rad at 1e6) and the result rounded once to the input dtype.
    A bfloat16 angle would be off by hundreds of radians here."""
    rd = 16
    inv_freq, _ = jaxpos.rope_frequencies(rd, base)
    inv64 = np.asarray(inv_freq, np.float64)
    pos = 1_000_000 + np.arange(8)
    x = jnp.asarray(_rng(1).normal(size=(1, 8, 2, rd + 4)), dtype)  # 4 pass-through features
    out = jaxpos.apply_rope(x, pos, inv_freq, layout=layout)
    assert out.dtype == dtype
    ref = rope64(_f64(x), pos, inv64, layout)
    # Bound: angle error (one float32 ulp of |angle|) times the pair's norm, plus two
    # roundings to the output dtype.
    ang = pos[:, None] * inv64
    ulp = np.spacing(np.abs(ang).astype(np.float32)).astype(np.float64)  # [T, half]
    xf = _f64(x)
    if layout == "half":
        pn = np.hypot(xf[..., : rd // 2], xf[..., rd // 2: rd])
        ang_err = np.concatenate([ulp[None, :, None] * pn] * 2, -1)
    else:
        pn = np.hypot(xf[..., 0:rd:2], xf[..., 1:rd:2])
        ang_err = np.repeat(ulp[None, :, None] * pn, 2, axis=-1)
    bound = np.concatenate([ang_err, np.zeros(xf.shape[:-1] + (4,))], -1)
    bound = bound + 2 * EPS[dtype] * np.abs(ref) + 1e-6
    err = np.abs(_f64(out) - ref)
    assert (err <= bound).all(), f"max err {err.max()}, worst err/bound {(err / bound).max()}"
    np.testing.assert_array_equal(_f64(out)[..., rd:], xf[..., rd:])  # untouched tail


@pytest.mark.parametrize(*grid("impl,dtype", [IMPLS, ["bf16", "f16"]],
                               {(i, "bf16") for i in OTHERS}))
def test_rope_attention_low_precision_at_position_one_million(impl, dtype):
    """Causal RoPE attention at positions 1e6..1e6+7 in bf16/f16 against float64 exact
    angles, and against the same call at positions 0..7 (RoPE is relative)."""
    dtype = {"bf16": jnp.bfloat16, "f16": jnp.float16}[dtype]
    B, T, N, H = 1, 8, 2, 16
    r = _rng(2)
    q, k, v = (jnp.asarray(r.normal(size=(B, T, N, H)), dtype) for _ in range(3))
    rope = RoPE(rotary_dim=H, base=10000.0)
    pos = 1_000_000 + np.arange(T)
    out = jattention(q, k, v, position=rope, q_positions=pos, kv_positions=pos, causal=True,
                    implementation=impl, **BLOCKS)
    assert out.dtype == dtype
    inv = np.asarray(rope.inv_freq, np.float64)
    q64, k64 = rope64(_f64(q), pos, inv, "half"), rope64(_f64(k), pos, inv, "half")
    ref = attention64(q64, k64, _f64(v), scale=1 / math.sqrt(H),
                      visible=np.tril(np.ones((T, T), bool)))
    # one float32 ulp of the angle (0.0625 rad) moves a score by at most ~0.06 |q||k|/sqrt(H)
    np.testing.assert_allclose(_f64(out), ref, atol=0.05, rtol=0)
    near = jattention(q, k, v, position=rope, q_positions=pos - 1_000_000,
                     kv_positions=pos - 1_000_000, causal=True, implementation=impl, **BLOCKS)
    np.testing.assert_allclose(_f64(out), _f64(near), atol=0.05, rtol=0)


# ------------------------------------------------------------------------ ALiBi at 65,536
def test_alibi_bias_at_65536_against_float64():
    """The last 4 query rows of a 65,536-token causal ALiBi bias, 12 heads (not a power of
    two), against float64: offsets are exact in float32 and the product is rounded once."""
    T, N = 65536, 12
    qpos = np.arange(T - 4, T)
    kvpos = np.arange(T)
    b = np.asarray(jaxpos.alibi_bias(qpos, kvpos, jaxpos.alibi_slopes(N)), np.float64)
    ref = alibi_slopes64(N)[:, None, None] * (kvpos[None, None, :] - qpos[None, :, None])
    assert b.shape == (N, 4, T)
    np.testing.assert_allclose(b, ref, rtol=3 * 2.0 ** -24, atol=0)
    assert b[0, -1, 0] == pytest.approx(-(2.0 ** (-8 / 8)) * (T - 1), rel=2 ** -23)


@pytest.mark.parametrize(*grid("impl,dtype", [IMPLS, ["f32", "bf16", "f16"]],
                               {(i, "bf16") for i in OTHERS}))
def test_alibi_attention_at_65536_against_float64(impl, dtype):
    """4 queries at positions 65,532..65,535 against all 65,536 keys (never a [T, T] array)."""
    dtype = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}[dtype]
    T, Tq, N, H = 65536, 4, 4, 8
    r = _rng(3)
    q = jnp.asarray(r.normal(size=(1, Tq, N, H)), dtype)
    k = jnp.asarray(r.normal(size=(1, T, N, H)), dtype)
    v = jnp.asarray(r.normal(size=(1, T, N, H)), dtype)
    qpos, kvpos = np.arange(T - Tq, T), np.arange(T)
    out = jattention(q, k, v, position=ALiBi(num_heads=N), q_positions=qpos, kv_positions=kvpos,
                    causal=True, implementation=impl, block_q=4, block_k=4096)
    bias = alibi_slopes64(N)[:, None, None] * (kvpos[None, None, :] - qpos[None, :, None])
    ref = attention64(_f64(q), _f64(k), _f64(v), scale=1 / math.sqrt(H), bias=bias[None],
                      visible=kvpos[None, :] <= qpos[:, None])
    tol = 1e-5 if dtype == jnp.float32 else 2 * EPS[dtype] * np.abs(ref).max()
    np.testing.assert_allclose(_f64(out), ref, atol=tol, rtol=0)


# --------------------------------------------------------------- empty rows, all-padding
def _schemes(N, H, seed=4):
    r = _rng(seed)
    K = 2
    f32 = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)
    return {
        "nope": NoPE(),
        "rope": RoPE(rotary_dim=H),
        "alibi": ALiBi(num_heads=N),
        "t5": T5Bias(f32(32, N), bidirectional=False),
        "shaw": Shaw(f32(2 * K + 1, H), f32(2 * K + 1, H)),
    }


SCHEMES = list(_schemes(2, 8))


@pytest.mark.parametrize(*grid(
    "impl,scheme_name", [IMPLS, SCHEMES],
    {("chunked", "shaw"), ("pallas", "t5")},
    skip=lambda c: c[0] == "pallas" and c[1] not in FUSED))
def test_rows_with_no_visible_key_are_zero_with_finite_gradients(impl, scheme_name):
    """Three ways a query row can see no key, in one batch: (b=0) a mask row of False
    (for Pallas, which takes no mask, a segment id no key has), (b=1) a query segment no
    key has, (b=2) causal queries placed before every key."""
    B, T, N, H = 3, 6, 2, 8
    scheme = _schemes(N, H)[scheme_name]
    r = _rng(5)
    q, k, v = (jnp.asarray(r.normal(size=(B, T, N, H)), jnp.float32) for _ in range(3))
    mask = np.ones((B, 1, T, T), bool)
    seg_q = np.zeros((B, T), np.int32)
    seg_kv = np.zeros((B, T), np.int32)
    if impl == "pallas":
        mask = None
        seg_q[0, 1] = 9
    else:
        mask[0, :, 1, :] = False
    seg_q[1, 2] = 7  # no key has segment 7
    qpos = np.tile(np.arange(T), (B, 1))
    qpos[2] -= 2  # rows 0, 1 of b=2 sit before key 0
    kvpos = np.tile(np.arange(T), (B, 1))
    empty = np.zeros((B, T), bool)
    empty[0, 1] = empty[1, 2] = empty[2, 0] = empty[2, 1] = True

    def f(q, k, v, scheme):
        return attention(q, k, v, position=scheme, q_positions=qpos, kv_positions=kvpos,
                         causal=True, mask=mask, segment_ids=seg_q, kv_segment_ids=seg_kv,
                         implementation=impl, **BLOCKS)

    w = jnp.asarray(r.normal(size=(B, T, N, H)), jnp.float32)
    out, grads = out_and_grads(f, w, q, k, v, scheme)
    out = np.asarray(out)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[empty], 0.0)
    assert np.abs(out[~empty]).sum(-1).min() > 0  # the other rows are real outputs
    for leaf in jax.tree_util.tree_leaves(grads):
        assert np.isfinite(np.asarray(leaf)).all()
    np.testing.assert_array_equal(np.asarray(grads[0])[empty], 0.0)  # d out / d q of empty rows


@pytest.mark.parametrize(*grid("impl,dtype", [IMPLS, ["bf16", "f16"]],
                               {(i, "f16") for i in OTHERS}))
def test_logits_near_minus_6e4_give_uniform_weights(impl, dtype):
    """Every visible logit about -6e4 (near float16's -65504): softmax is uniform over the
    visible keys, not zero (a mask sentinel of -1e4 or finfo(f16).min would break this)."""
    dtype = {"bf16": jnp.bfloat16, "f16": jnp.float16}[dtype]
    B, T, N, H = 1, 6, 2, 8
    r = _rng(6)
    q = jnp.zeros((B, T, N, H), dtype)  # q.k = 0: the logit is the bias alone
    k = jnp.asarray(r.normal(size=(B, T, N, H)), dtype)
    v = jnp.asarray(r.normal(size=(B, T, N, H)), dtype)
    table = jnp.full((32, N), -6.0e4, jnp.float32)
    out = jattention(q, k, v, position=T5Bias(table, bidirectional=False), causal=True,
                    implementation=impl, **BLOCKS)
    v64 = _f64(v)
    ref = np.cumsum(v64, axis=1) / np.arange(1, T + 1)[None, :, None, None]  # running mean
    np.testing.assert_allclose(_f64(out), ref, atol=2 * EPS[dtype] * np.abs(ref).max(), rtol=0)

    # Not all equal: -6e4 plus a different small value per bucket, against float64.
    table = -6.0e4 + jnp.asarray(r.normal(size=(32, N)), jnp.float32)
    q = jnp.asarray(r.normal(size=(B, T, N, H)), dtype)
    scheme = T5Bias(table, bidirectional=False)
    out = jattention(q, k, v, position=scheme, causal=True, implementation=impl, **BLOCKS)
    pos = np.arange(T)
    buckets = jaxpos.t5_bucket(pos[None, :] - pos[:, None], bidirectional=False)
    bias = np.moveaxis(np.asarray(table, np.float64)[buckets], -1, 0)[None]
    ref = attention64(_f64(q), _f64(k), v64, scale=1 / math.sqrt(H), bias=bias,
                      visible=np.tril(np.ones((T, T), bool)))
    # float32 logits near -6e4 carry an ulp of 2**-8, i.e. a relative weight error ~0.4%
    np.testing.assert_allclose(_f64(out), ref, atol=2 * EPS[dtype] * np.abs(ref).max() + 0.02,
                               rtol=0)


@pytest.mark.parametrize(*grid(
    "impl,scheme_name,how", [IMPLS, ["rope", "alibi", "t5"], ["mask", "segments"]],
    {("chunked", "t5", "mask"), ("pallas", "alibi", "segments")},
    skip=lambda c: c[0] == "pallas" and c[2] == "mask"))
def test_all_padding_sequence_gives_zeros_and_no_nan(impl, scheme_name, how):
    """b=1 is padding from end to end (a key-padding mask all False, or key segment ids no
    query has); T=7 is not a multiple of the block. Its output must be exact zeros (not
    NaN, not leftover memory), the gradients finite, and b=0 must equal the same sequence
    computed alone."""
    B, T, N, H = 2, 7, 2, 8
    scheme = _schemes(N, H)[scheme_name]
    r = _rng(7)
    q, k, v = (jnp.asarray(r.normal(size=(B, T, N, H)), jnp.float32) for _ in range(3))
    kv_valid = np.array([[True] * 5 + [False] * 2, [False] * T])  # b=0 left-aligned, 2 pads
    if how == "mask":
        kw = {"mask": kv_valid[:, None, None, :]}
    else:  # queries in segment 1, padding keys in segment 0
        kw = {"segment_ids": np.ones((B, T), np.int32),
                  "kv_segment_ids": kv_valid.astype(np.int32)}

    def f(q, k, v, scheme):
        return attention(q, k, v, position=scheme, causal=True, implementation=impl, **kw,
                         **BLOCKS)

    w = jnp.asarray(r.normal(size=(B, T, N, H)), jnp.float32)
    out, grads = out_and_grads(f, w, q, k, v, scheme)
    out = np.asarray(out)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[1], 0.0)
    alone = jattention(q[:1, :, :, :], k[:1, :5], v[:1, :5], position=scheme, causal=True,
                      q_positions=np.arange(T), kv_positions=np.arange(5), implementation=impl,
                      **BLOCKS)
    np.testing.assert_allclose(out[:1], np.asarray(alone), atol=1e-5, rtol=1e-5)
    for leaf in jax.tree_util.tree_leaves(grads):
        assert np.isfinite(np.asarray(leaf)).all()
    for g in grads[:3]:
        np.testing.assert_array_equal(np.asarray(g)[1], 0.0)


@pytest.mark.parametrize(*grid("impl,T", [[i for i in IMPLS if i != "reference"], [5, 13]],
                               {(i, 13) for i in IMPLS}))
def test_sequence_tail_past_the_last_full_block_is_not_skipped(impl, T):
    """T not a multiple of the block: the last key alone carries the answer (a huge score
    and a distinctive value), and the last query row must be computed too."""
    B, N, H = 1, 2, 4
    r = _rng(8)
    q = jnp.asarray(r.normal(size=(B, T, N, H)), jnp.float32) * 0.1
    k = jnp.asarray(r.normal(size=(B, T, N, H)), jnp.float32) * 0.1
    v = jnp.asarray(r.normal(size=(B, T, N, H)), jnp.float32)
    k = k.at[:, -1].set(10.0)
    q = q.at[:].set(1.0)
    v = v.at[:, -1].set(100.0)
    out = jattention(q, k, v, implementation=impl, **BLOCKS)
    ref = attention64(_f64(q), _f64(k), _f64(v), scale=1 / math.sqrt(H))
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-4)
    assert np.asarray(out)[0, :, :, :].min() > 99.0  # every row, last included, sees key T-1
