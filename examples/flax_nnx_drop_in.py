"""jaxpos in an existing Flax NNX model: pass ``attention_fn=`` to ``nnx.MultiHeadAttention``.

A small GPT-style decoder written the way Flax's own examples write one (token and learned
position embeddings, pre-LayerNorm blocks of ``nnx.MultiHeadAttention`` with a causal mask
from ``nnx.make_causal_mask`` and an MLP), trained a few steps with optax on a copying task
(each sequence repeats a random pattern of ``--period`` tokens, so the next token is the one
``period`` positions back). The model is trained once as written (Flax's
``dot_product_attention`` and learned positions) and once per jaxpos variant, where the
only changes are::

    attention_fn = jaxpos.flax_attention_fn(jaxpos.ALiBi(num_heads))   # or RoPE, T5, a score_mod
    nnx.MultiHeadAttention(..., attention_fn=attention_fn)
    # and no learned position table (the scheme now carries the positions)

Run: ``python examples/flax_nnx_drop_in.py`` (seconds on a CPU); ``--help`` for options.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxpos


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: causal self-attention and an MLP, each residual."""

    def __init__(self, d_model: int, num_heads: int, *, attention_fn, dropout_rate: float,
                 rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=num_heads, in_features=d_model, decode=False, dropout_rate=dropout_rate,
            attention_fn=attention_fn, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
        self.up = nnx.Linear(d_model, 4 * d_model, rngs=rngs)
        self.down = nnx.Linear(4 * d_model, d_model, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class MiniGPT(nnx.Module):
    """Token (and, as written, learned position) embeddings, blocks, a LayerNorm and the
    output projection. ``attention_fn=None`` keeps Flax's ``nnx.dot_product_attention``."""

    def __init__(self, vocab_size: int, max_len: int, *, d_model: int = 32, num_heads: int = 2,
                 num_layers: int = 1, attention_fn=None, learned_positions: bool = True,
                 dropout_rate: float = 0.0, rngs: nnx.Rngs):
        attention_fn = attention_fn or nnx.dot_product_attention
        self.embed = nnx.Embed(vocab_size, d_model, rngs=rngs)
        self.pos_embed = nnx.Embed(max_len, d_model, rngs=rngs) if learned_positions else None
        self.blocks = nnx.List([Block(d_model, num_heads, attention_fn=attention_fn,
                                      dropout_rate=dropout_rate, rngs=rngs)
                                for _ in range(num_layers)])
        self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab_size, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        if self.pos_embed is not None:
            x = x + self.pos_embed(jnp.arange(tokens.shape[-1]))
        mask = nnx.make_causal_mask(tokens)  # float [B, 1, T, T], as Flax builds it
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


def log_distance_bias(score, batch, head, q_pos, kv_pos):
    """A hand-written score_mod: ``-log(1 + distance)``, a log-distance decay (the shape of
    KERPLE's logarithmic kernel, Chi et al. 2022, Sec. 3.3, with fixed parameters)."""
    return score - jnp.log1p(jnp.abs(q_pos - kv_pos).astype(score.dtype))


def variants(num_heads: int, head_dim: int) -> dict:
    """name -> (attention_fn or None for Flax's own, keep learned positions?)."""
    # T5's bucketed bias with a fixed table: a per-head sqrt decay over the 32 causal buckets.
    # (A trained table lives in jaxpos.nnx.MultiHeadAttention(position="t5").)
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
    repeated."""
    rng = np.random.default_rng(seed)
    pattern = rng.integers(0, vocab_size, (steps, batch_size, period))
    reps = -(-(seq_len + 1) // period)
    return jnp.asarray(np.tile(pattern, (1, 1, reps))[..., :seq_len + 1], jnp.int32)


def train(model: MiniGPT, data, lr: float) -> list[float]:
    """AdamW on next-token cross-entropy; the loss of every step."""
    optimizer = nnx.Optimizer(model, optax.adamw(lr), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, tokens):
        def loss_fn(model):
            logits = model(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    model.train()  # dropout on (Flax's deterministic=False)
    return [float(step(model, optimizer, tokens)) for tokens in data]


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
                   help="attention dropout rate of every nnx.MultiHeadAttention")
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
                        dropout_rate=args.dropout, rngs=nnx.Rngs(args.seed))
        losses[name] = train(model, data, args.lr)
        print(f"{name:<26} {losses[name][0]:>10.3f} {losses[name][-1]:>10.3f} "
              f"{time.perf_counter() - t0:>8.1f}")
    return losses


if __name__ == "__main__":
    jax.config.update("jax_default_matmul_precision", "highest")
    main()
