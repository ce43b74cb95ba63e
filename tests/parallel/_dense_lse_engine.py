"""A user engine with ``run_with_lse``, registered from outside the package, for the
ring's "any engine" tests: dense float32 attention over the whole score matrix with the
core's helpers (the call's masking, the mods, one step of the tile library's online
softmax), returning its output and log-sum-exp."""

from __future__ import annotations

import jax.numpy as jnp

import jaxpos
from jaxpos.core.reference import call_terms, heads_major, tile_output, tile_scores, visible
from jaxpos.core.tiles import online_softmax_step, softmax_finish, softmax_start


class DenseLseEngine:
    """``softmax(scores) v`` and the rows' log-sum-exp, float32 inputs only."""

    name = "dense_lse"

    def refuses(self, call):
        if call.q.dtype != jnp.float32:
            return f"implementation='dense_lse' takes float32 inputs; got {call.q.dtype}."
        if call.dropout is not None:
            return "implementation='dense_lse' has no attention dropout."
        return None

    def run_with_lse(self, call):
        qs, k, v, m = heads_major(call)
        terms = call_terms(call, call.q_len, call.kv_len)
        s = tile_scores(terms, qs, k, m.q_pos, m.kv_pos)
        vis = visible(call.causal, m.q_pos, m.kv_pos, m.kv_valid, m.mask, m.seg_q, m.seg_kv,
                      terms.mask, s.shape[:2])
        s = s if vis is None else jnp.where(vis, s, -jnp.inf)
        start = softmax_start(s.shape[:3], v.shape[-1], call.sinks)
        state = online_softmax_step(start, s, lambda p: tile_output(terms, p, v, m.q_pos,
                                                                    m.kv_pos))
        out, lse = softmax_finish(state)
        return jnp.swapaxes(out, 1, 2).astype(call.q.dtype), lse

    def run(self, call):
        return self.run_with_lse(call)[0]


if "dense_lse" not in jaxpos.core.engines.engine_names():
    jaxpos.register_engine(DenseLseEngine())
