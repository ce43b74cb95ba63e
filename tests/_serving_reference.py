"""The serving tests' reference: a :class:`jaxpos.serving.PagedDecoder`'s whole causal
forward pass written out from its parameters (dense reference attention, no cache), so
the loop's tokens are checked against code that shares none of its cache or paging."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxpos
from jaxpos.layers.functional import embed_tokens, merge_heads, mlp, project_heads, rms_norm


def full_pass_logits(model, tokens: jax.Array) -> jax.Array:
    """float32 ``[B, T, V]``: the causal forward pass of ``model`` (a ``PagedDecoder``)
    over each row of the int32 ``tokens [B, T]`` (right padding does not change earlier
    positions: the pass is causal). Traceable: wrap it in ``jax.jit`` to compile once."""
    p = model.params
    x = embed_tokens(p["embed"], tokens, model.d_model, jnp.float32)
    for lyr in p["layers"]:
        h = rms_norm(x, lyr["attn_norm"])
        q = project_heads(h, lyr["q"], model.num_heads, model.head_dim, jnp.float32)
        k = project_heads(h, lyr["k"], model.kv_heads, model.head_dim, jnp.float32)
        v = project_heads(h, lyr["v"], model.kv_heads, model.head_dim, jnp.float32)
        o = jaxpos.attention(q, k, v, position=p["scheme"], causal=True,
                             implementation="reference")
        x = x + merge_heads(o, lyr["o"], jnp.float32)
        x = x + mlp(rms_norm(x, lyr["mlp_norm"]), lyr["w_in"], lyr["w_out"], jnp.float32)
    return rms_norm(x, p["final_norm"]) @ p["embed"].T


def assert_greedy_alone(full_pass, completions) -> None:
    """Each completion's tokens are the greedy tokens of its prompt alone: at every step the
    argmax of one causal pass over prompt + tokens[:-1] (``full_pass(seqs [B, T]) -> [B, T,
    V]``, all requests' sequences right-padded into one batch)."""
    seqs = [list(c.request.prompt) + list(c.tokens[:-1]) for c in completions]
    padded = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
    for i, seq in enumerate(seqs):
        padded[i, :len(seq)] = seq
    logits = np.asarray(full_pass(padded))
    for i, c in enumerate(completions):
        n = len(c.request.prompt)
        want = np.argmax(logits[i, n - 1:n - 1 + len(c.tokens)], axis=-1)
        np.testing.assert_array_equal(c.tokens, want, err_msg=f"request {c.request.id}")
