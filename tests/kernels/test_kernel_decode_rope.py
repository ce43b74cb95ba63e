"""The fused kernel's decode path, log-sum-exp output and RoPE on load (interpret mode).

* ``kv_lengths``: keys at index ``>= kv_lengths[b]`` are invisible; equal to the dense
  reference with those keys masked (forward and gradients), and the tile loops stop at
  the filled length (counted inside the kernels).
* Decode-shaped calls (one query tile): the query heads sharing a KV head run in one
  program, the keys split into slices combined by their log-sum-exps (flash decoding,
  Dao et al. 2023); every split count gives the same result.
* ``return_lse``: the log-sum-exp of each row's scores (sinks included), against
  ``logsumexp`` of the dense scores, and differentiable (gradients through it match the
  dense reference).
* ``rope_tables``: unrotated q, k plus cos/sin tables equal rotating outside
  (:func:`jaxpos.schemes.rope.rotate`), forward and backward; non-power-of-two head dims and a
  partial rotary dim included.
* Grouped KV heads with a per-head block mask: the dk/dv program of a KV head follows each
  query head's own schedule column.

Reference: ``tests/_kernel_dense.py``. Tolerances as ``test_kernel.py`` (float32, HIGHEST
precision dots): ``2e-5`` forward and gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _kernel_dense import dense_attention

from jaxpos.kernels import _testing as kernel_testing
from jaxpos.kernels import fused
from jaxpos.schemes.rope import rotate
from jaxpos.schemes.rope.scaling import default_inv_freq

TOL = {"atol": 2e-5, "rtol": 2e-5}


@pytest.fixture(autouse=True)
def poison_outputs():
    with kernel_testing.poison_outputs():
        yield


def _qkv(B, Tq, Tk, N, Nk, H, Hv=None, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(ks[0], (B, Tq, N, H)), jax.random.normal(ks[1], (B, Tk, Nk, H)),
            jax.random.normal(ks[2], (B, Tk, Nk, Hv or H)))


def _weights(shape):
    return jnp.cos(jnp.arange(int(np.prod(shape)), dtype=jnp.float32).reshape(shape))


def _value_and_grads(f, args):
    def loss(*a):
        o = f(*a)
        return jnp.sum(o * _weights(o.shape)), o

    (_, o), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*args)
    return o, g


def _close(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    assert not np.isnan(got).any(), f"{what}: NaN (an element the kernel did not write)"
    np.testing.assert_allclose(got, want, err_msg=what, **TOL)


def _length_mask(kv_lengths, Tk):
    lens = jnp.asarray(kv_lengths)
    return lambda b, h, qp, kp: kp < lens[b]  # positions are arange here


# ------------------------------------------------------------------------- kv_lengths
@pytest.mark.slow
def test_kv_lengths_equal_masked_keys_forward_and_gradients():
    """GQA (4 query heads on 2 KV heads), a decode-shaped call (Tq = 2 < block) against
    keys of three fill lengths, one of them empty (zeros, zero gradients)."""
    B, Tq, Tk, N, Nk, H = 3, 2, 21, 4, 2, 16
    q, k, v = _qkv(B, Tq, Tk, N, Nk, H)
    lens = jnp.asarray([21, 9, 0], jnp.int32)
    qp = jnp.broadcast_to(jnp.asarray([30, 31]), (B, Tq))
    kp = jnp.arange(Tk)

    def kern(q, k, v):
        return fused.kernel_attention(q, k, v, q_positions=qp, kv_positions=kp, causal=True,
                                      kv_lengths=lens, block_k=8, interpret=True)

    def dense(q, k, v):
        return dense_attention(q, k, v, q_positions=qp, kv_positions=kp, causal=True,
                               mask_mod=_length_mask(lens, Tk))

    o, g = _value_and_grads(kern, (q, k, v))
    o_ref, g_ref = _value_and_grads(dense, (q, k, v))
    _close(o, o_ref, "forward")
    for name, a, b in zip(("dq", "dk", "dv"), g, g_ref):
        _close(a, b, name)
    assert np.all(np.asarray(o)[2] == 0) and np.all(np.asarray(g[1])[1, 9:] == 0)


def test_kv_lengths_bound_the_tile_loops():
    """Counted inside the kernels: 8-key tiles, lengths 21 / 8 / 0 of a 64-key cache. Row 0
    visits tiles 0, 1 (FULL) and 2 (cut by the length: masked); row 1 tile 0 only (FULL);
    row 2 nothing. The dk/dv programs of tiles past the length visit no query tile."""
    B, Tq, Tk, N, H = 3, 1, 64, 2, 16
    q, k, v = _qkv(B, Tq, Tk, N, N, H)
    lens = jnp.asarray([21, 8, 0], jnp.int32)
    fwd, dkv = kernel_testing.tile_visits(q, k, v, q_positions=jnp.asarray([63]),
                                          kv_positions=jnp.arange(Tk), causal=True,
                                          kv_lengths=lens, block_k=8, kv_splits=1)
    fwd, dkv = np.asarray(fwd), np.asarray(dkv)
    np.testing.assert_array_equal(fwd[:, 0, 0], [[1, 2], [0, 1], [0, 0]])
    np.testing.assert_array_equal(dkv[0, 0, :, 0] + dkv[0, 0, :, 1], [1, 1, 1] + [0] * 5)
    np.testing.assert_array_equal(dkv[2].sum(), 0)


def test_key_splits_cover_the_filled_tiles_once():
    """Four key splits of 2 tiles each over 8 tiles, length 21: split 0 visits tiles 0-1,
    split 1 tile 2 (masked), splits 2-3 nothing; the heads of a KV head share a program."""
    q, k, v = _qkv(1, 1, 64, 4, 2, 16)
    fwd, _ = kernel_testing.tile_visits(q, k, v, q_positions=jnp.asarray([63]),
                                        kv_positions=jnp.arange(64), causal=True,
                                        kv_lengths=jnp.asarray([21]), block_k=8, kv_splits=4)
    fwd = np.asarray(fwd)
    assert fwd.shape == (1, 2, 1, 4, 2)  # [B, N_kv programs (2 heads each), nq, splits, 2]
    np.testing.assert_array_equal(fwd[0, 0, 0], [[0, 2], [1, 0], [0, 0], [0, 0]])


@pytest.mark.slow
@pytest.mark.parametrize("splits", [1, 3])
def test_split_counts_agree_with_dense_attention(splits):
    """Forward of a decode step (Tq = 1, GQA 4:1, sinks, Tk = 40 not a tile multiple) with
    one and three key splits equals the dense reference."""
    q, k, v = _qkv(2, 1, 40, 4, 1, 16)
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0])
    pos = jnp.asarray([39])
    o = fused.kernel_attention(q, k, v, q_positions=pos, kv_positions=jnp.arange(40),
                               causal=True, sinks=sinks, block_k=8, kv_splits=splits,
                               interpret=True)
    o_ref = dense_attention(q, k, v, q_positions=pos, kv_positions=jnp.arange(40), causal=True,
                            sinks=sinks)
    _close(o, o_ref, f"{splits} splits")


# ------------------------------------------------------------------------- log-sum-exp
def _dense_lse(q, k, sinks, qp, kp):
    g = q.shape[2] // k.shape[2]
    kk = jnp.repeat(k, g, axis=2)
    s = jnp.einsum("bqnh,bknh->bnqk", q, kk, precision="highest") / np.sqrt(q.shape[-1])
    s = jnp.where(kp[None, None, None, :] <= qp[None, None, :, None], s, -jnp.inf)
    s = jnp.concatenate([s, jnp.broadcast_to(sinks[None, :, None, None], s.shape[:3] + (1,))], -1)
    return jax.nn.logsumexp(s, axis=-1)


@pytest.mark.slow
def test_lse_equals_logsumexp_of_scores_and_is_differentiable():
    """``return_lse=True``: lse ``[B, N, Tq]`` = logsumexp over visible scores and the sink;
    the gradient of ``sum(out * w) + sum(lse * u)`` matches the dense one."""
    B, T, N, Nk, H = 1, 12, 2, 1, 16
    q, k, v = _qkv(B, T, T, N, Nk, H)
    sinks = jnp.asarray([0.3, -0.7])
    pos = jnp.arange(T)
    u = _weights((B, N, T)) + 0.5

    def kern(q, k, v):
        o, lse = fused.kernel_attention(q, k, v, q_positions=pos, kv_positions=pos, causal=True,
                                        sinks=sinks, block_q=8, block_k=8, interpret=True,
                                        return_lse=True)
        return o, lse

    o, lse = jax.jit(kern)(q, k, v)
    _close(lse, _dense_lse(q, k, sinks, pos, pos), "lse")

    def loss(f):
        def inner(q, k, v):
            o, lse = f(q, k, v)
            return jnp.sum(o * _weights(o.shape)) + jnp.sum(lse * u)
        return jax.jit(jax.grad(inner, argnums=(0, 1, 2)))

    def dense(q, k, v):
        return (dense_attention(q, k, v, q_positions=pos, kv_positions=pos, causal=True,
                                sinks=sinks), _dense_lse(q, k, sinks, pos, pos))

    for name, a, b in zip(("dq", "dk", "dv"), loss(kern)(q, k, v), loss(dense)(q, k, v)):
        _close(a, b, name)


# ------------------------------------------------------------------------- RoPE on load
def _rope_case(B, Tq, Tk, N, Nk, H, rotary_dim, **kw):
    q, k, v = _qkv(B, Tq, Tk, N, Nk, H)
    inv_freq = jnp.asarray(default_inv_freq(rotary_dim, 10000.0), jnp.float32)
    qp = jnp.arange(Tq) + (Tk - Tq)
    kp = jnp.arange(Tk)
    tabs = fused.rope_tables(qp, kp, inv_freq)

    def on_load(q, k, v):
        return fused.kernel_attention(q, k, v, q_positions=qp, kv_positions=kp, causal=True,
                                      rope_tables=tabs, interpret=True, **kw)

    def outside(q, k, v):
        qr = rotate(q, tabs.q_cos, tabs.q_sin, layout="half")
        kr = rotate(k, tabs.k_cos, tabs.k_sin, layout="half")
        return fused.kernel_attention(qr, kr, v, q_positions=qp, kv_positions=kp, causal=True,
                                      interpret=True, **kw)

    return (q, k, v), on_load, outside


@pytest.mark.slow
@pytest.mark.parametrize("H, rotary_dim", [(16, 16), (24, 16)], ids=["full", "partial-h24"])
def test_rope_on_load_equals_rotation_outside_forward_and_backward(H, rotary_dim):
    """Training shape (Tq = Tk = 13, 8-row tiles, GQA 2:1); H = 24 is not a power of two
    and rotates 16 of its 24 features."""
    args, on_load, outside = _rope_case(1, 13, 13, 2, 1, H, rotary_dim, block_q=8, block_k=8)
    o, g = _value_and_grads(on_load, args)
    o_ref, g_ref = _value_and_grads(outside, args)
    _close(o, o_ref, "forward")
    for name, a, b in zip(("dq", "dk", "dv"), g, g_ref):
        _close(a, b, name)


def test_rope_on_load_decode_step_with_lengths():
    """Decode shape (Tq = 1, GQA 2:1, two key splits, per-row lengths): equal to rotating
    outside, forward."""
    args, on_load, outside = _rope_case(2, 1, 24, 4, 2, 16, 16, block_k=8, kv_splits=2,
                                        kv_lengths=jnp.asarray([24, 11]))
    _close(jax.jit(on_load)(*args), jax.jit(outside)(*args), "forward")


def test_bad_decode_arguments_raise():
    q, k, v = _qkv(2, 1, 8, 2, 2, 16)
    kw = dict(q_positions=jnp.asarray([7]), kv_positions=jnp.arange(8), interpret=True)
    with pytest.raises(ValueError, match=r"kv_lengths must have shape \[2\]"):
        fused.kernel_attention(q, k, v, kv_lengths=jnp.asarray([1, 2, 3]), **kw)
    with pytest.raises(TypeError, match="kv_lengths must be integer"):
        fused.kernel_attention(q, k, v, kv_lengths=jnp.asarray([1.0, 2.0]), **kw)
    tabs = fused.rope_tables(jnp.arange(1), jnp.arange(8), jnp.ones((8,)))
    with pytest.raises(ValueError, match="rope_tables.k_cos must have shape"):
        fused.kernel_attention(q, k, v, rope_tables=tabs._replace(
            k_cos=tabs.k_cos[:, :4], k_sin=tabs.k_sin[:, :4]), **kw)
    with pytest.raises(ValueError, match="kv_splits must be"):
        fused.kernel_attention(q, k, v, kv_splits=0, **kw)


# ------------------------------------------- grouped KV heads with a per-head schedule
def test_per_head_block_mask_with_grouped_kv_heads():
    """A block mask whose tiles differ per query head (a window growing with the head)
    over GQA 4:2: the dk/dv program of a KV head loops each of its query heads over that
    head's own column of the schedule. Forward and gradients equal the dense reference."""
    B, T, N, Nk, H = 1, 24, 4, 2, 16
    q, k, v = _qkv(B, T, T, N, Nk, H, seed=3)
    pos = jnp.arange(T)

    def mask_mod(b, h, qp, kp):
        return (qp - kp) < 4 + 6 * h

    from jaxpos.mods import create_block_mask

    bm = create_block_mask(mask_mod, q_positions=pos, kv_positions=pos, block_q=8, block_k=8,
                           num_heads=N)
    assert np.asarray(bm.kinds).shape[1] == N  # the schedule differs per head

    def kern(q, k, v):
        return fused.kernel_attention(q, k, v, block_mask=bm, q_positions=pos,
                                      kv_positions=pos, causal=True, interpret=True)

    def dense(q, k, v):
        return dense_attention(q, k, v, mask_mod=mask_mod, q_positions=pos, kv_positions=pos,
                               causal=True)

    o, g = _value_and_grads(kern, (q, k, v))
    o_ref, g_ref = _value_and_grads(dense, (q, k, v))
    _close(o, o_ref, "forward")
    for name, a, b in zip(("dq", "dk", "dv"), g, g_ref):
        _close(a, b, name)


def test_fused_attention_rope_on_load_equals_rotation_before():
    """``fused_attention(..., rope_on_load=True)`` (tables, rotation inside the kernel)
    equals the default one rotation pass before the kernel, with ALiBi slopes and a YaRN
    style attention factor; the interleaved layout is refused."""
    from jaxpos.kernels import fused_attention

    q, k, v = _qkv(1, 12, 12, 2, 1, 16, seed=4)
    pos = jnp.arange(12)
    kw = dict(q_positions=pos, kv_positions=pos, inv_freq=1.0 / 100.0 ** (jnp.arange(8) / 8),
              attention_factor=1.1, alibi_slopes=jnp.asarray([0.5, 0.25]), causal=True,
              block_q=8, block_k=8, interpret=True)
    _close(fused_attention(q, k, v, rope_on_load=True, **kw), fused_attention(q, k, v, **kw),
           "forward")
    with pytest.raises(ValueError, match="rope_on_load rotates the 'half' layout"):
        fused_attention(q, k, v, rope_on_load=True, rope_layout="interleaved", **kw)
