"""Learned absolute positions (Gehring et al. 2017; GPT-2; BERT): the published table
sizes, and the explicit policy for a position with no row (error / checked / wrap / clip).
JAX clamps out-of-range gather indices, so every test here checks that no lookup
returns another row silently."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from jaxpos import learned_positions


def _table(max_len=6, d=3):
    # Row r is filled with r + 0.25 * column, so every row is distinct and recognisable.
    return (np.arange(max_len, dtype=np.float32)[:, None]
            + 0.25 * np.arange(d, dtype=np.float32)[None, :])


@pytest.mark.parametrize("model, max_len, d, params", [
    ("GPT-2 small", 1024, 768, 786_432),
    ("BERT-base", 512, 768, 393_216),
])
def test_table_sizes_and_last_row(model, max_len, d, params):
    # GPT-2 small (Radford et al. 2019: context 1024, §2.3; d_model 768, Table 2; the
    # released config's n_positions / n_embd) 1024 x 768 = 786,432 parameters; BERT-base
    # (Devlin et al. 2019: H = 768, §3; at most 512 tokens, App. A.2) 512 x 768 = 393,216.
    table = np.zeros((max_len, d), np.float32)
    table[-1] = 1.0
    assert table.size == params
    out = learned_positions(table, np.arange(max_len))
    assert out.shape == (max_len, d)
    np.testing.assert_array_equal(np.asarray(out[-1]), np.ones(d))
    # Rows exist for positions 0..max_len-1 only: there is no row for position max_len.
    with pytest.raises(ValueError, match=rf"positions must lie in \[0, {max_len}\)"):
        learned_positions(table, np.arange(max_len + 1))


def test_lookup_values_batched():
    table = _table()
    positions = np.array([[0, 5, 2], [3, 3, 1]])
    out = learned_positions(table, positions)
    assert out.shape == (2, 3, 3) and out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), table[positions])


def test_error_policy_rejects_each_position_outside():
    table = _table(max_len=6)
    for bad in (6, 7, 100, -1):
        with pytest.raises(ValueError, match=r"positions.*outside.*out_of_range="):
            learned_positions(table, np.array([0, bad, 1]))


def test_wrap_policy():
    # "wrap" is pos % max_len (a periodic table; negative positions wrap from the end).
    table = _table(max_len=6)
    pos = np.array([0, 5, 6, 7, 13, -1])
    out = np.asarray(learned_positions(table, pos, out_of_range="wrap"))
    np.testing.assert_array_equal(out, table[[0, 5, 0, 1, 1, 5]])


def test_clip_policy():
    table = _table(max_len=6)
    pos = np.array([0, 5, 6, 100, -3])
    out = np.asarray(learned_positions(table, pos, out_of_range="clip"))
    np.testing.assert_array_equal(out, table[[0, 5, 5, 5, 0]])


def test_traced_out_of_range_is_nan_never_another_row():
    # Under jit the values are unknown at trace time: rows outside the table are NaN,
    # in-range rows are exact, and no output row equals a row of the table by accident.
    table = _table(max_len=6)
    pos = jnp.array([0, 5, 6, 9, -1, 2], jnp.int32)
    out = np.asarray(jax.jit(learned_positions)(table, pos))
    np.testing.assert_array_equal(out[[0, 1, 5]], table[[0, 5, 2]])
    assert np.isnan(out[[2, 3, 4]]).all()


def test_packed_positions_may_exceed_table_length():
    # Packed sequences restart at 0: ten positions, every one inside a 4-row table.
    table = _table(max_len=4)
    pos = np.array([0, 1, 2, 3, 0, 1, 2, 3, 0, 1])
    np.testing.assert_array_equal(np.asarray(learned_positions(table, pos)), table[pos])


def test_traced_sequence_longer_than_table_raises_at_trace_time():
    # Under "error", a sequence longer than the table fails at
    # trace time (it can only hold a position past the table or a repeat that cannot be
    # checked while tracing); "wrap" is the explicit alternative.
    table = _table(max_len=4)
    pos = jnp.arange(5, dtype=jnp.int32)
    with pytest.raises(ValueError, match=r"sequence length 5.*max_len=4"):
        jax.jit(learned_positions)(table, pos)
    out = jax.jit(functools.partial(learned_positions, out_of_range="wrap"))(table, pos)
    np.testing.assert_array_equal(np.asarray(out), table[[0, 1, 2, 3, 0]])


def test_gradient_reaches_the_looked_up_rows():
    table = _table(max_len=5, d=2)
    pos = np.array([0, 2, 2, 4])
    cot = np.arange(8, dtype=np.float32).reshape(4, 2)
    grad = jax.grad(lambda t: jnp.sum(learned_positions(t, pos) * cot))(jnp.asarray(table))
    expected = np.zeros_like(table)
    np.add.at(expected, pos, cot)
    np.testing.assert_array_equal(np.asarray(grad), expected)


class TransformsTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters("error", "wrap", "clip")
    def test_eager_and_jit_agree(self, policy):
        table = _table(max_len=6)
        pos = np.array([[0, 1, 5], [2, 4, 3]], np.int32)
        f = self.variant(lambda t, p: learned_positions(t, p, out_of_range=policy))
        chex.assert_trees_all_equal(f(table, pos), table[pos])

    def test_vmap_matches_batched(self):
        table = _table(max_len=6)
        pos = jnp.array([[0, 1, 5], [2, 4, 3]], jnp.int32)
        for policy in ("error", "wrap", "clip"):
            f = lambda p, policy=policy: learned_positions(table, p, out_of_range=policy)
            chex.assert_trees_all_equal(jax.vmap(f)(pos), f(pos))


BAD_INPUTS = [
    ("out_of_range", ValueError, {"out_of_range": "ignore"}, "'ignore'"),
    ("table", ValueError, {"table": np.zeros(6, np.float32)}, "(6,)"),
    ("table", TypeError, {"table": np.zeros((6, 3), np.int32)}, "int32"),
    ("positions", TypeError, {"positions": np.array([0.0, 1.0], np.float32)}, "float32"),
    ("positions", TypeError, {"positions": np.array([True, False])}, "bool"),
    ("positions", ValueError, {"positions": np.int32(3)}, "scalar"),
    ("positions", ValueError, {"positions": np.array([0, 6])}, "6"),
]


@pytest.mark.parametrize("argument, error, kwargs, got", BAD_INPUTS,
                         ids=[f"{a}-{e.__name__}-{i}" for i, (a, e, _, _) in enumerate(BAD_INPUTS)])
def test_bad_input(argument, error, kwargs, got):
    args = {"table": _table(max_len=6), "positions": np.array([0, 1])}
    args.update(kwargs)
    policy = args.pop("out_of_range", "error")
    with pytest.raises(error) as info:
        learned_positions(args["table"], args["positions"], out_of_range=policy)
    msg = str(info.value)
    assert msg.startswith(argument + " "), msg
    assert "got" in msg and got in msg, msg


# ------------------------------------------------------ the table exceeded under jit
def test_learned_checked_mode_raises_under_jit():
    from jax.experimental import checkify

    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    f = checkify.checkify(jax.jit(
        lambda t, p: learned_positions(t, p, out_of_range="checked")))
    err, rows = f(table, jnp.array([0, 1, 5, 2]))
    with pytest.raises(Exception, match=r"positions must lie in \[0, 4\).*from 0 to 5"):
        err.throw()
    # Checked by value: a packed sequence longer than the table is fine under jit.
    packed = jnp.array([0, 1, 2, 3, 0, 1])
    err, rows = f(table, packed)
    err.throw()
    np.testing.assert_array_equal(np.asarray(rows), table[np.asarray(packed)])
    # Eagerly, concrete positions raise a ValueError as with "error".
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        learned_positions(table, np.array([0, 4]), out_of_range="checked")


def test_learned_model_past_its_table_under_jit_poisons_the_rows_that_see_them():
    from flax import nnx

    from jaxpos import nnx as jn

    model = jn.DecoderLM(32, d_model=16, num_layers=1, num_heads=2,
                                 position="learned", max_len=8, rngs=nnx.Rngs(0))
    logits = nnx.jit(lambda m, t, p: m(t, positions=p))(
        model, jnp.zeros((1, 6), jnp.int32), jnp.arange(6) + 4)  # positions 4..9, rows 0..7
    bad = np.isnan(np.asarray(logits)).any(-1)[0]
    # Rows at positions past the table, and every row that attends to them, are NaN (the
    # attention NaN rule, docs/attention.md: rows that do not see them may be NaN too).
    assert bad[4:].all()
