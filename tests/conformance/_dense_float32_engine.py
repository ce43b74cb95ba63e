"""A small engine registered from outside the package: dense float32 attention written
with the core's helpers (the call's masking, the scheme's and the user's mods, one step of
the tile library's online softmax over all keys). It shows what a new engine is: one
class and one ``jaxpos.register_engine`` call; the conformance suite then runs it as the
path ``"dense_float32"``."""

from __future__ import annotations

import jax.numpy as jnp

import jaxpos
from jaxpos.core.reference import call_terms, heads_major, tile_output, tile_scores, visible
from jaxpos.core.tiles import online_softmax_step, softmax_finish, softmax_start


class DenseFloat32Engine:
    """``softmax(scores) v`` over the whole ``[Tq, Tk]`` score matrix, float32 inputs only."""

    name = "dense_float32"

    def refuses(self, call):
        if call.q.dtype != jnp.float32:
            return f"implementation='dense_float32' takes float32 inputs; got {call.q.dtype}."
        if call.dropout is not None:
            return "implementation='dense_float32' has no attention dropout."
        return None

    def run(self, call):
        qs, k, v, m = heads_major(call)
        terms = call_terms(call, call.q_len, call.kv_len)
        s = tile_scores(terms, qs, k, m.q_pos, m.kv_pos)
        vis = visible(call.causal, m.q_pos, m.kv_pos, m.kv_valid, m.mask, m.seg_q, m.seg_kv,
                      terms.mask, s.shape[:2])
        s = s if vis is None else jnp.where(vis, s, -jnp.inf)
        start = softmax_start(s.shape[:3], v.shape[-1], call.sinks)
        state = online_softmax_step(start, s, lambda p: tile_output(terms, p, v, m.q_pos,
                                                                    m.kv_pos))
        return jnp.swapaxes(softmax_finish(state)[0], 1, 2).astype(call.q.dtype)


jaxpos.register_engine(DenseFloat32Engine())
