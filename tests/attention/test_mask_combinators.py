"""``jaxpos.and_masks`` / ``jaxpos.or_masks`` (FlexAttention's mask combinators, Dong et
al. 2024) and block masks combined with ``&`` / ``|``, against dense boolean NumPy masks
written here from each mask's definition."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpos
from jaxpos.mods import EMPTY, FULL, PARTIAL, combine_kinds

T, BQ, BK = 24, 8, 8
POS = np.arange(T)
DOCS = np.array([0] * 7 + [1] * 9 + [2] * 8)  # three packed documents


def window(b, h, q, kv):
    return q - kv < 5


def causal(b, h, q, kv):
    return kv <= q


def document(b, h, q, kv):
    d = jnp.asarray(DOCS)
    return d[q] == d[kv]


def head_stripes(b, h, q, kv):  # reads the head: even heads see even offsets only
    return (h % 2 == 1) | ((q - kv) % 2 == 0)


# dense float64-free references from the definitions, [Tq, Tk] (or [N, Tq, Tk])
I, J = POS[:, None], POS[None, :]
NP = {"window": I - J < 5, "causal": J <= I, "document": DOCS[:, None] == DOCS[None, :]}


def dense(mask_mod, num_heads=1):
    """The mask_mod evaluated on the full position grid: bool [N, T, T]."""
    conv = jaxpos.mods.convert_mod(mask_mod, "mask", T, T)
    pos = jnp.asarray(POS)[None]
    return np.asarray(jaxpos.mods.apply_mod(conv, pos, pos, batch_index=(1, num_heads)))[0]


def tile_kinds_of(vis):
    """Exact tile kinds of a dense bool [..., T, T] mask."""
    t = vis.reshape(vis.shape[:-2] + (T // BQ, BQ, T // BK, BK))
    live, full = t.any(axis=(-3, -1)), t.all(axis=(-3, -1))
    return np.where(live, np.where(full, FULL, PARTIAL), EMPTY)


def test_and_or_match_dense_boolean_references():
    np.testing.assert_array_equal(dense(jaxpos.and_masks(window, causal, document))[0],
                                  NP["window"] & NP["causal"] & NP["document"])
    np.testing.assert_array_equal(dense(jaxpos.or_masks(window, document))[0],
                                  NP["window"] | NP["document"])
    nested = jaxpos.or_masks(jaxpos.and_masks(causal, document), window)
    np.testing.assert_array_equal(dense(nested)[0],
                                  (NP["causal"] & NP["document"]) | NP["window"])


def test_no_masks_is_all_or_nothing_and_one_mask_is_itself():
    assert dense(jaxpos.and_masks()).all()
    assert not dense(jaxpos.or_masks()).any()
    np.testing.assert_array_equal(dense(jaxpos.and_masks(window))[0], NP["window"])
    np.testing.assert_array_equal(dense(jaxpos.or_masks(window))[0], NP["window"])


def test_combination_reads_the_head_of_its_parts():
    got = dense(jaxpos.and_masks(causal, head_stripes), num_heads=2)
    even = (I - J) % 2 == 0
    np.testing.assert_array_equal(got[0], NP["causal"] & even)
    np.testing.assert_array_equal(got[1], NP["causal"])


def test_equal_combinations_compare_and_hash_equal():
    sw = jaxpos.SlidingWindowMask(4)
    assert jaxpos.and_masks(sw, causal) == jaxpos.and_masks(jaxpos.SlidingWindowMask(4), causal)
    assert hash(jaxpos.or_masks(sw)) == hash(jaxpos.or_masks(jaxpos.SlidingWindowMask(4)))
    assert jaxpos.and_masks(sw, causal) != jaxpos.or_masks(sw, causal)


def test_create_block_mask_of_a_combination_has_exact_tile_kinds():
    for mod, want in ((jaxpos.and_masks(window, causal, document),
                       NP["window"] & NP["causal"] & NP["document"]),
                      (jaxpos.or_masks(window, document), NP["window"] | NP["document"])):
        bm = jaxpos.create_block_mask(mod, q_positions=POS, kv_positions=POS, block_q=BQ,
                                      block_k=BK)
        np.testing.assert_array_equal(np.asarray(bm.kinds)[0, 0], tile_kinds_of(want))


def test_block_masks_combine_conservatively_and_attention_matches_the_dense_mask():
    kw = dict(q_positions=POS, kv_positions=POS, block_q=BQ, block_k=BK)
    a = jaxpos.create_block_mask(window, **kw)
    d = jaxpos.create_block_mask(document, **kw)
    for combined, want in ((a & d, NP["window"] & NP["document"]),
                           (a | d, NP["window"] | NP["document"])):
        kinds = np.asarray(combined.kinds)[0, 0]
        exact = tile_kinds_of(want)
        # EMPTY and FULL are exact where claimed; PARTIAL may stand for either
        assert np.all(exact[kinds == EMPTY] == EMPTY) and np.all(exact[kinds == FULL] == FULL)
        np.testing.assert_array_equal(dense(combined.mask_mod)[0], want)
        live = np.asarray(combined.kv_num_blocks)[0, 0]
        np.testing.assert_array_equal(live, (kinds != EMPTY).sum(-1))
    # the and-combination's kinds: EMPTY if either is, FULL if both are
    np.testing.assert_array_equal(np.asarray((a & d).kinds), np.asarray(
        combine_kinds(a.kinds, d.kinds, "and")))
    q, k, v = (jax.random.normal(key, (1, T, 2, 8)) for key in jax.random.split(
        jax.random.PRNGKey(0), 3))
    bm = a & d
    got = jaxpos.attention(q, k, v, block_mask=bm, implementation="chunked")
    want = jaxpos.attention(q, k, v, mask=NP["window"] & NP["document"],
                            implementation="reference")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6)


def test_combine_kinds_truth_table():
    a = jnp.array([EMPTY, EMPTY, EMPTY, FULL, FULL, PARTIAL])
    b = jnp.array([EMPTY, FULL, PARTIAL, FULL, PARTIAL, PARTIAL])
    np.testing.assert_array_equal(np.asarray(combine_kinds(a, b, "and")),
                                  [EMPTY, EMPTY, EMPTY, FULL, PARTIAL, PARTIAL])
    np.testing.assert_array_equal(np.asarray(combine_kinds(a, b, "or")),
                                  [EMPTY, FULL, PARTIAL, FULL, FULL, PARTIAL])


def test_bad_input_names_the_argument():
    with pytest.raises(TypeError, match="argument 1"):
        jaxpos.and_masks(window, 3)
    kw = dict(q_positions=POS, kv_positions=POS, block_k=BK)
    with pytest.raises(ValueError, match="same tiles"):
        _ = jaxpos.create_block_mask(window, block_q=BQ, **kw) & jaxpos.create_block_mask(
            window, block_q=2 * BQ, **kw)
