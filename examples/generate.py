"""Generate text with a jaxpos decoder and its KV cache: a padded batch of prompts of
different lengths, greedy / temperature / top-k / top-p sampling, an optional StreamingLLM
cache (Xiao et al. 2024, §3.2) that generates past its size in fixed memory.

The model is a byte-level :class:`jaxpos.nnx.DecoderLM`. ``--checkpoint PATH`` loads its
parameters when the file exists (an ``.npz`` this script wrote); otherwise the script
trains a tiny one for ``--train-steps`` steps on the source of Python's ``json`` package
(a few seconds on a CPU) and, with ``--checkpoint``, saves it there.

    python examples/generate.py                                  # greedy, RoPE
    python examples/generate.py --temperature 0.8 --top-k 20 --top-p 0.9 --new-tokens 64
    python examples/generate.py --streaming 4 --max-len 32 --new-tokens 80

Prints each prompt and its continuation, then the decode speed (tokens per second over
the batch, compile excluded). Settings it cannot run with (an empty prompt, a prompt that
does not fit ``--max-len``, sampling settings outside their ranges, a position that cannot
decode from a cache) end with a one-line error and exit status 2, before any training.
"""

from __future__ import annotations

import argparse
import json as _json_pkg
import math
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from jaxpos.nnx import POSITIONS, DecoderLM

PROMPTS = ["def ", "import json\n", "    return self.", "class JSONDecoder"]


def corpus() -> np.ndarray:
    """uint8 bytes: the source files of the ``json`` package."""
    root = Path(_json_pkg.__file__).parent
    return np.frombuffer(b"".join(p.read_bytes() for p in sorted(root.glob("*.py"))), np.uint8)


def build(args) -> DecoderLM:
    return DecoderLM(256, d_model=args.d_model, num_layers=args.layers, num_heads=4,
                     position=args.position, max_len=args.max_len, rngs=nnx.Rngs(args.seed))


def train(model: DecoderLM, args) -> None:
    """A few Adam steps of next-byte prediction on windows of :func:`corpus`."""
    data = corpus()
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adam(3e-3)
    opt = tx.init(params)

    def loss_fn(p, batch):
        logits = nnx.merge(graph, p, rest)(batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    @jax.jit
    def step(p, s, batch):
        loss, g = jax.value_and_grad(loss_fn)(p, batch)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    rng = np.random.default_rng(args.seed)
    bar = tqdm(range(args.train_steps), desc="train", unit="step", file=sys.stderr,
               disable=args.no_progress, leave=False)
    for _ in bar:
        idx = rng.integers(0, len(data) - 65, size=16)
        batch = jnp.asarray(np.stack([data[i:i + 65] for i in idx]), jnp.int32)
        params, opt, loss = step(params, opt, batch)
        bar.set_postfix(loss=f"{float(loss):.2f}")
    nnx.update(model, params)


def save(model: DecoderLM, path: str) -> None:
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    with open(path, "wb") as f:  # the name as given (np.savez(path) would append .npz)
        np.savez(f, *[np.asarray(x) for x in leaves])


def load(model: DecoderLM, path: str) -> None:
    state = nnx.state(model, nnx.Param)
    with np.load(path) as f:
        arrays = [f[f"arr_{i}"] for i in range(len(f.files))]
    leaves, tree = jax.tree.flatten(state)
    if len(arrays) != len(leaves) or any(a.shape != x.shape for a, x in zip(arrays, leaves)):
        raise ValueError(f"checkpoint {path} does not fit this model's parameters (built with "
                         f"--d-model {model.d_model} --layers {model.num_layers} "
                         f"--position {model.position_name}).")
    nnx.update(model, jax.tree.unflatten(tree, [jnp.asarray(a) for a in arrays]))


def sample(logits, key, *, temperature: float, top_k: int, top_p: float):
    """Next tokens ``[B]`` from logits ``[B, V]``: greedy when ``temperature`` is 0; else
    softmax at ``temperature`` restricted to the ``top_k`` most likely tokens (0: all) and to
    the smallest set whose probability reaches ``top_p`` (nucleus sampling, Holtzman et al.
    2020, §3.1; 1.0: all)."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1)
    # Shifted by the row's maximum before the division: a tiny temperature then sends every
    # other token to -inf and keeps the best at 0 (logits / 1e-45 alone gave inf - inf).
    logits = logits.astype(jnp.float32)
    logits = (logits - logits.max(axis=-1, keepdims=True)) / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        probs = jax.nn.softmax(jnp.take_along_axis(logits, order, axis=-1), axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
        drop_sorted = (before >= top_p).at[:, 0].set(False)  # the best token always stays
        drop = jnp.zeros_like(drop_sorted).at[jnp.arange(logits.shape[0])[:, None],
                                               order].set(drop_sorted)
        logits = jnp.where(drop, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1)


def left_pad(prompts: list[bytes]):
    """int32 tokens ``[B, T]`` and the attention mask (1 token, 0 padding), padded on the
    left so every row's last token is its newest."""
    T = max(len(p) for p in prompts)
    toks = np.zeros((len(prompts), T), np.int32)
    mask = np.zeros((len(prompts), T), np.int32)
    for i, p in enumerate(prompts):
        toks[i, T - len(p):] = np.frombuffer(p, np.uint8)
        mask[i, T - len(p):] = 1
    return jnp.asarray(toks), jnp.asarray(mask)


def generate(model: DecoderLM, prompts: list[bytes], args):
    """``(tokens [B, new_tokens], tokens_per_second or None)``: no decode step is timed
    when ``new_tokens <= 1`` (the first token comes from the prefill).

    Raises:
      FloatingPointError: the model gave non-finite logits (NaN under ``jit`` marks an
        input it could not serve, e.g. a cache too small; they would decode as NUL bytes).
    """
    toks, mask = left_pad(prompts)
    B, T = toks.shape
    if args.new_tokens == 0:
        return np.zeros((B, 0), np.int32), None
    cache = model.init_cache(B, args.max_len, keep_first=args.streaming)
    graph, state = nnx.split(model)

    @jax.jit
    def prefill(state, toks, mask, cache):
        logits, cache = nnx.merge(graph, state).decode_step(toks, cache, attention_mask=mask)
        return logits[:, -1], cache

    @jax.jit
    def step(state, tok, cache, key):
        logits, cache = nnx.merge(graph, state).decode_step(tok[:, None], cache)
        return logits[:, -1], cache

    pick = jax.jit(lambda lg, k: sample(lg, k, temperature=args.temperature, top_k=args.top_k,
                                         top_p=args.top_p))
    finite = jax.jit(lambda ok, lg: ok & jnp.all(jnp.isfinite(lg)))
    key = jax.random.key(args.seed)
    logits, cache = prefill(state, toks, mask, cache)
    ok = finite(jnp.asarray(True), logits)
    key, sub = jax.random.split(key)
    tok = pick(logits, sub)
    out = [tok]
    tps = None
    if args.new_tokens > 1:
        step(state, tok, cache, sub)[0].block_until_ready()  # compile outside the timing
        t0 = time.perf_counter()
        for _ in tqdm(range(args.new_tokens - 1), desc="decode", unit="tok", file=sys.stderr,
                      disable=args.no_progress, leave=False):
            logits, cache = step(state, tok, cache, key)
            ok = finite(ok, logits)
            key, sub = jax.random.split(key)
            tok = pick(logits, sub)
            out.append(tok)
        jax.block_until_ready(out[-1])
        tps = B * (args.new_tokens - 1) / max(time.perf_counter() - t0, 1e-9)
    if not bool(ok):
        raise FloatingPointError("the model gave non-finite logits (NaN: an input it cannot "
                                 "serve); no tokens printed.")
    return np.asarray(jnp.stack(out, axis=1)), tps


def trace_prefill(model: DecoderLM, prompts: list[bytes], args) -> None:
    """Trace (no compile, no run) the cache and the prefill :func:`generate` will run, so
    that what the library refuses (a position that cannot decode from a cache, a cache
    option it does not take) is refused before any training."""
    toks, mask = left_pad(prompts)
    cache = model.init_cache(toks.shape[0], args.max_len, keep_first=args.streaming)
    graph, state = nnx.split(model)
    jax.eval_shape(lambda s, c: nnx.merge(graph, s).decode_step(toks, c, attention_mask=mask),
                   state, cache)


def check_args(p: argparse.ArgumentParser, a: argparse.Namespace,
               prompts: list[bytes]) -> None:
    """One clear ``parser.error`` (exit 2) for every setting the script cannot run with."""
    for name, value, least in (("--d-model", a.d_model, 1), ("--layers", a.layers, 1),
                               ("--train-steps", a.train_steps, 0),
                               ("--new-tokens", a.new_tokens, 0), ("--max-len", a.max_len, 1),
                               ("--top-k", a.top_k, 0), ("--seed", a.seed, 0)):
        if value < least:
            p.error(f"{name} must be >= {least}; got {value}.")
    if a.d_model % 4:
        p.error(f"--d-model must be a multiple of the 4 attention heads; got {a.d_model}.")
    if a.top_k > 256:
        p.error(f"--top-k must be at most the 256 byte values (0 keeps all); got {a.top_k}.")
    if not (math.isfinite(a.temperature) and a.temperature >= 0):
        p.error(f"--temperature must be a finite number >= 0 (0: greedy); got "
                f"{a.temperature}.")
    if not 0 < a.top_p <= 1:
        p.error(f"--top-p must be in (0, 1] (1 keeps every token); got {a.top_p}.")
    empty = [i for i, q in enumerate(prompts) if not q]
    if empty:
        p.error(f"--prompt must not be empty (prompt {empty[0] + 1} is \"\").")
    longest = max(map(len, prompts))
    if a.streaming is None:
        if longest + a.new_tokens > a.max_len:
            p.error(f"--max-len {a.max_len} is too small for the longest prompt ({longest} "
                    f"bytes) and --new-tokens {a.new_tokens}; raise it or use --streaming "
                    f"KEEP_FIRST.")
        return
    if not 0 <= a.streaming < a.max_len:
        p.error(f"--streaming KEEP_FIRST must be in [0, --max-len={a.max_len}) (the cache "
                f"needs a slot for recent tokens); got {a.streaming}.")
    if longest > a.max_len:
        p.error(f"--max-len {a.max_len} is shorter than the longest prompt ({longest} bytes): "
                f"a streaming cache generates past its size, but the prompt's prefill must "
                f"fit in it.")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--position", default="rope", choices=POSITIONS, metavar="NAME",
                   help="position scheme, one of: " + ", ".join(POSITIONS))
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--checkpoint", default=None, help="an .npz to load, or to save to")
    p.add_argument("--train-steps", type=int, default=150)
    p.add_argument("--prompt", action="append", default=None,
                   help="a prompt (repeatable); default: four prompts of different lengths")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--max-len", type=int, default=128, help="KV cache slots")
    p.add_argument("--streaming", type=int, default=None, metavar="KEEP_FIRST",
                   help="a StreamingLLM cache keeping the first KEEP_FIRST tokens")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    prompts = [s.encode() for s in (a.prompt if a.prompt is not None else PROMPTS)]
    check_args(p, a, prompts)
    try:  # the library's own checks of the model, its cache and the prefill, before training
        model = build(a)
        trace_prefill(model, prompts, a)
    except ValueError as e:
        p.error(" ".join(str(e).split()))
    if a.checkpoint and os.path.exists(a.checkpoint):
        try:
            load(model, a.checkpoint)
        except (OSError, ValueError, KeyError) as e:
            p.error(f"--checkpoint {a.checkpoint}: " + " ".join(str(e).split()))
        print(f"loaded {a.checkpoint}", file=sys.stderr)
    else:
        t0 = time.perf_counter()
        train(model, a)
        print(f"trained {a.train_steps} steps in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr)
        if a.checkpoint:
            save(model, a.checkpoint)
    try:
        gen, tps = generate(model, prompts, a)
    except (ValueError, FloatingPointError) as e:  # e.g. a position that cannot decode
        p.error(" ".join(str(e).split()))
    for prompt, row in zip(prompts, gen):
        text = bytes(row.astype(np.uint8)).decode("utf-8", "replace")  # byte ids 0..255
        print(f"{prompt.decode()!r} -> {text!r}")
    cache = f"streaming keep_first={a.streaming}" if a.streaming is not None else "KV"
    speed = "no decode step to time" if tps is None else f"{tps:.0f} tokens/s"
    print(f"{len(prompts)} prompts x {a.new_tokens} tokens, {cache} cache of {a.max_len} "
          f"slots: {speed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
