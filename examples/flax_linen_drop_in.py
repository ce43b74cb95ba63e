"""jaxpos in an existing Flax Linen model: pass ``attention_fn=`` to
``nn.MultiHeadDotProductAttention``.

The Linen twin of ``examples/flax_nnx_drop_in.py``: a small GPT-style decoder written the
way Flax's Linen examples write one (``nn.Embed`` for tokens and learned positions,
pre-LayerNorm blocks of ``nn.MultiHeadDotProductAttention`` with ``nn.make_causal_mask``,
an MLP), trained a few steps with optax on the same copying task, once as written and once
per jaxpos variant. The changes are::

    attention_fn = jaxpos.flax_attention_fn(jaxpos.RoPE(rotary_dim=head_dim))
    nn.MultiHeadDotProductAttention(..., attention_fn=attention_fn)
    # and no learned position table

Run: ``python examples/flax_linen_drop_in.py`` (seconds on a CPU); ``--help`` for options.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxpos


def log_distance_bias(score, batch, head, q_pos, kv_pos):
    """A hand-written score_mod: ``-log(1 + distance)`` (the shape of KERPLE's logarithmic
    kernel, Chi et al. 2022, Sec. 3.3, with fixed parameters)."""
    return score - jnp.log1p(jnp.abs(q_pos - kv_pos).astype(score.dtype))


def variants(num_heads: int, head_dim: int) -> dict:
    """name -> (attention_fn or None for Flax's own, keep learned positions?)."""
    # T5's bucketed bias with a fixed table (a per-head sqrt decay over the 32 buckets).
    t5_table = -jnp.sqrt(jnp.arange(32.0))[:, None] * jnp.linspace(0.5, 2.0, num_heads)
    return {
        "flax (learned positions)": (None, True),
        "alibi": (jaxpos.flax_attention_fn(jaxpos.ALiBi(num_heads)), False),
        "rope": (jaxpos.flax_attention_fn(jaxpos.RoPE(rotary_dim=head_dim)), False),
        "t5": (jaxpos.flax_attention_fn(jaxpos.T5Bias(t5_table, bidirectional=False)), False),
        "score_mod": (jaxpos.flax_attention_fn(score_mod=log_distance_bias), False),
    }


def batches(steps: int, batch_size: int, seq_len: int, period: int, vocab_size: int, seed: int):
    """``[steps, batch_size, seq_len + 1]`` int32: random patterns of ``period`` tokens,
    repeated (the next token is the one ``period`` positions back)."""
    rng = np.random.default_rng(seed)
    pattern = rng.integers(0, vocab_size, (steps, batch_size, period))
    reps = -(-(seq_len + 1) // period)
    return jnp.asarray(np.tile(pattern, (1, 1, reps))[..., :seq_len + 1], jnp.int32)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention and an MLP, each residual."""

    num_heads: int
    attention_fn: Callable = nn.dot_product_attention
    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, x, mask, *, deterministic: bool):
        d_model = x.shape[-1]
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads, dropout_rate=self.dropout_rate,
            attention_fn=self.attention_fn)(h, h, mask=mask, deterministic=deterministic)
        h = nn.Dense(4 * d_model)(nn.LayerNorm()(x))
        return x + nn.Dense(d_model)(nn.gelu(h))


class MiniGPT(nn.Module):
    """Token (and, as written, learned position) embeddings, blocks, a LayerNorm and the
    output projection. ``attention_fn=None`` keeps Flax's ``nn.dot_product_attention``."""

    vocab_size: int
    max_len: int
    d_model: int = 32
    num_heads: int = 2
    num_layers: int = 1
    attention_fn: Callable | None = None
    learned_positions: bool = True
    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, tokens, *, deterministic: bool = True):
        x = nn.Embed(self.vocab_size, self.d_model)(tokens)
        if self.learned_positions:
            x = x + nn.Embed(self.max_len, self.d_model)(jnp.arange(tokens.shape[-1]))
        mask = nn.make_causal_mask(tokens)  # float [B, 1, T, T]
        for _ in range(self.num_layers):
            x = Block(self.num_heads, self.attention_fn or nn.dot_product_attention,
                      self.dropout_rate)(x, mask, deterministic=deterministic)
        return nn.Dense(self.vocab_size)(nn.LayerNorm()(x))


def train(model: MiniGPT, data, lr: float, seed: int) -> list[float]:
    """AdamW on next-token cross-entropy; the loss of every step."""
    params = model.init(jax.random.key(seed), data[0, :, :-1])["params"]
    tx = optax.adamw(lr)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, tokens, dropout_key):
        def loss_fn(params):
            logits = model.apply({"params": params}, tokens[:, :-1], deterministic=False,
                                 rngs={"dropout": dropout_key})
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for i, tokens in enumerate(data):
        params, opt_state, loss = step(params, opt_state, tokens,
                                       jax.random.fold_in(jax.random.key(seed), i))
        losses.append(float(loss))
    return losses


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=None,
                   help="comma-separated subset of: flax, alibi, rope, t5, score_mod "
                        "(default: all)")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per variant")
    p.add_argument("--seq-len", type=int, default=16, help="training sequence length")
    p.add_argument("--period", type=int, default=4, help="length of the repeated pattern")
    p.add_argument("--vocab-size", type=int, default=16, help="token vocabulary")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    p.add_argument("--dropout", type=float, default=0.0,
                   help="attention dropout rate of every nn.MultiHeadDotProductAttention")
    p.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="initialisation and data seed")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """Train every variant; print and return ``{name: [loss per step]}``."""
    args = parse_args(argv)
    d_model, num_heads = 32, 2
    table = variants(num_heads, d_model // num_heads)
    chosen = list(table) if args.variants is None else [
        next(n for n in table if n.split()[0] == v) for v in args.variants.split(",")]
    data = batches(args.steps, args.batch_size, args.seq_len, args.period, args.vocab_size,
                   args.seed)
    losses = {}
    print(f"{'variant':<26} {'first loss':>10} {'last loss':>10} {'seconds':>8}")
    for name in chosen:
        attention_fn, learned = table[name]
        t0 = time.perf_counter()
        model = MiniGPT(args.vocab_size, args.seq_len, d_model=d_model, num_heads=num_heads,
                        attention_fn=attention_fn, learned_positions=learned,
                        dropout_rate=args.dropout)
        losses[name] = train(model, data, args.lr, args.seed)
        print(f"{name:<26} {losses[name][0]:>10.3f} {losses[name][-1]:>10.3f} "
              f"{time.perf_counter() - t0:>8.1f}")
    return losses


if __name__ == "__main__":
    jax.config.update("jax_default_matmul_precision", "highest")
    main()
