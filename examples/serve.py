"""Serve a synthetic long-tail workload with continuous batching over a paged KV cache.

64 requests (by default) whose prompt and output lengths are drawn from log-normal
distributions (most short, a few long: the shape of real chat traffic) go through
:class:`jaxpos.serving.ServingEngine`: a fixed number of batch slots, a pool of pages
shared by every request, requests admitted as pages free up and ended on their token
budget, greedy or sampled (temperature / top-k / top-p) per request. The model is a small
random-weight :class:`jaxpos.serving.PagedDecoder` with the chosen position scheme (the
point is the serving loop, not the text).

The tokens are streamed (:meth:`ServingEngine.stream`): the progress bar advances as each
token is produced, and its total shrinks when a request ends before its budget: on one of
``--stop-token-ids`` (kept in its output), or cancelled by the consumer after
``--cancel-after`` tokens (:meth:`ServingEngine.cancel`, its pages back in the pool at
once; here every fifth request, a client that stops reading).

    python examples/serve.py                                # RoPE, 64 requests
    python examples/serve.py --position alibi --slots 16 --page-size 8
    python examples/serve.py --compare-static               # also the static padded batch
    python examples/serve.py --stop-token-ids 7,11 --cancel-after 8
    python examples/serve.py --checkpoint path/to/hf_checkpoint   # a Llama, Qwen3, ... folder

With ``--checkpoint DIR`` the model is a Hugging Face checkpoint folder (``config.json`` and
``*.safetensors``) loaded by :func:`examples.models.from_pretrained` and served through
:class:`jaxpos.serving.ModuleDecoder` (prompts are random ids of its vocabulary).

Prints a summary: generated tokens per second, time to first token (median and p90),
how requests ended (budget, stop token, cancelled), pages in use (peak, and pages *
page_size / tokens held beside a dense ``[slots, max_len]`` cache), the KV memory that
represents, and the process's peak memory. Compilation runs before the clock starts (one
warm-up request).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

import jaxpos
from jaxpos.serving import PagedDecoder, Request, ServingEngine


def long_tail_requests(n: int, *, vocab_size: int, seed: int = 0, prompt_median: float = 64,
                       output_median: float = 32, sigma: float = 0.9, max_prompt: int = 256,
                       max_output: int = 256, stop_token_ids=()) -> list[Request]:
    """``n`` requests with log-normal prompt and output lengths (median ``prompt_median``
    / ``output_median``, log-space standard deviation ``sigma``, clipped to ``[1,
    max_prompt]`` / ``[1, max_output]``); every third request is greedy, the others
    sample with temperature 0.8 and top-k 40 or top-p 0.9; all arrive at time 0 and end
    on any of ``stop_token_ids``."""
    rng = np.random.default_rng(seed)
    plen = np.clip(np.round(rng.lognormal(np.log(prompt_median), sigma, n)), 1, max_prompt)
    olen = np.clip(np.round(rng.lognormal(np.log(output_median), sigma, n)), 1, max_output)
    reqs = []
    for i, (p, o) in enumerate(zip(plen.astype(int), olen.astype(int))):
        style = i % 3
        reqs.append(Request(prompt=rng.integers(0, vocab_size, p).tolist(), max_new_tokens=int(o),
                            temperature=0.0 if style == 0 else 0.8,
                            top_k=40 if style == 1 else 0, top_p=0.9 if style == 2 else 1.0,
                            seed=i, id=i, stop_token_ids=list(stop_token_ids)))
    return reqs


def make_position(name: str, num_heads: int, head_dim: int):
    """The scheme object of ``--position``."""
    if name == "none":
        return None
    if name == "rope":
        return jaxpos.RoPE(rotary_dim=head_dim)
    if name == "alibi":
        return jaxpos.ALiBi(num_heads)
    if name == "t5":
        table = jnp.linspace(-1.0, 1.0, 32 * num_heads).reshape(32, num_heads)
        return jaxpos.T5Bias(table, bidirectional=False)
    raise ValueError(f"unknown --position {name!r}")


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--slots", type=int, default=8, help="batch slots of the decode step")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--num-pages", type=int, default=None,
                    help="pool size (default: half of what slots x max_len would need)")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--prompt-median", type=float, default=64)
    ap.add_argument("--output-median", type=float, default=32)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--prefill-chunk", type=int, default=16)
    ap.add_argument("--position", default="rope", choices=["none", "rope", "alibi", "t5"])
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare-static", action="store_true",
                    help="also serve the workload in static padded batches")
    ap.add_argument("--stop-token-ids", default="",
                    help="comma-separated token ids that end a request (kept in its output)")
    ap.add_argument("--cancel-after", type=int, default=None,
                    help="cancel every fifth request once it has streamed this many tokens")
    ap.add_argument("--json", default=None, help="write the summary here")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--checkpoint", default=None, metavar="DIR",
                    help="serve this Hugging Face checkpoint folder (config.json + "
                         "*.safetensors, examples.models.from_pretrained) instead of the "
                         "random PagedDecoder; --position, --d-model, --layers, --heads, "
                         "--kv-heads, --vocab are then the checkpoint's")
    args = ap.parse_args(argv)
    try:
        args.stop_token_ids = [int(t) for t in args.stop_token_ids.split(",") if t.strip()]
    except ValueError:
        ap.error(f"--stop-token-ids must be comma-separated ints; got {args.stop_token_ids!r}")
    if args.cancel_after is not None and args.cancel_after < 1:
        ap.error(f"--cancel-after must be >= 1; got {args.cancel_after}")
    if args.max_prompt + args.max_output > args.max_len:
        ap.error(f"--max-prompt + --max-output ({args.max_prompt + args.max_output}) must be "
                 f"<= --max-len ({args.max_len})")
    return args


def serve(engine: ServingEngine, requests, *, progress: bool, label: str,
          cancel_after: int | None = None):
    """Stream ``requests`` after a one-request warm-up (compilation), cancelling every
    fifth one after ``cancel_after`` tokens; ``(completions, stats)``."""
    engine.run([Request(prompt=[1] * (engine.prefill_chunk + 1), max_new_tokens=2)])
    budget = {r.id: r.max_new_tokens for r in requests}
    to_cancel = set() if cancel_after is None else set(list(budget)[::5])
    with tqdm(total=sum(budget.values()), desc=label, unit="tok", disable=not progress) as bar, \
            engine.stream(requests) as stream:
        for event in stream:
            if event.token is not None:
                bar.update(1)
                if event.id in to_cancel and event.index + 1 == cancel_after:
                    engine.cancel(event.id)
            if event.finish_reason is not None:  # ended early: its unused budget leaves
                produced = event.index + (event.token is not None)
                bar.total -= budget[event.id] - produced
                bar.set_postfix(done=len(stream.completions), refresh=False)
        return stream.completions, stream.stats


def summarize(done, stats, engine: ServingEngine, model=None) -> dict:
    ttft = np.asarray([c.time_to_first_token for c in done])
    # bytes of one page across every layer's pools (any model: PagedDecoder, a checkpoint)
    page_bytes = (sum(x.nbytes for x in jax.tree.leaves(engine.pool))
                  / engine.allocator.num_pages)
    return {
        "requests": len(done), "generated_tokens": stats.generated,
        "wall_s": round(stats.wall, 3), "tokens_per_s": round(stats.tokens_per_second, 1),
        "ttft_median_s": round(float(np.median(ttft)), 4),
        "ttft_p90_s": round(float(np.percentile(ttft, 90)), 4),
        "decode_steps": stats.decode_steps,
        "ended_on_budget": sum(c.finish_reason == "length" for c in done),
        "ended_on_stop_token": sum(c.finish_reason in ("stop", "eos") for c in done),
        "cancelled": sum(c.finish_reason == "cancelled" for c in done),
        "peak_pages": stats.peak_pages, "num_pages": engine.allocator.num_pages,
        "page_size": engine.page_size,
        "pages_per_token_held": round(stats.page_ratio, 3),
        "dense_slots_per_token_held": round(stats.dense_ratio, 3),
        "peak_kv_mib_paged": round(stats.peak_pages * page_bytes / 2**20, 3),
        "kv_mib_dense": round(engine.num_slots * engine.pages_per_seq * page_bytes / 2**20, 3),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def load_checkpoint(path: str):
    """``(ModuleDecoder over the port of the checkpoint folder, its model_type)``."""
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])  # the repository, for examples.models
    if root not in sys.path:
        sys.path.insert(0, root)
    from examples.models import from_pretrained
    from examples.models.pretrained import load_config
    from jaxpos.serving import ModuleDecoder

    return ModuleDecoder(from_pretrained(path)), load_config(path).model_type


def main(argv=None) -> dict:
    args = parse(argv)
    if args.checkpoint:
        model, args.position = load_checkpoint(args.checkpoint)
        args.vocab = model.vocab_size
    else:
        model = PagedDecoder(vocab_size=args.vocab, d_model=args.d_model,
                             num_layers=args.layers, num_heads=args.heads,
                             num_kv_heads=args.kv_heads,
                             position=make_position(args.position, args.heads,
                                                    args.d_model // args.heads), seed=args.seed)
    requests = long_tail_requests(args.requests, vocab_size=args.vocab, seed=args.seed,
                                  prompt_median=args.prompt_median,
                                  output_median=args.output_median, max_prompt=args.max_prompt,
                                  max_output=args.max_output,
                                  stop_token_ids=args.stop_token_ids)
    per_seq = -(-args.max_len // args.page_size)
    num_pages = args.num_pages or max(per_seq, args.slots * per_seq // 2)
    out = {}
    for schedule in ("continuous", "static") if args.compare_static else ("continuous",):
        engine = ServingEngine(model, num_slots=args.slots, num_pages=num_pages,
                               page_size=args.page_size, max_len=args.max_len,
                               prefill_chunk=args.prefill_chunk, schedule=schedule)
        done, stats = serve(engine, requests, progress=not args.no_progress, label=schedule,
                            cancel_after=args.cancel_after)
        out[schedule] = summarize(done, stats, engine, model)
    width = max(len(k) for k in out["continuous"])
    for schedule, s in out.items():
        print(f"== {schedule} batching ({args.position}, {args.slots} slots, pages of "
              f"{args.page_size})")
        for k, v in s.items():
            print(f"  {k:<{width}}  {v}")
    if args.compare_static:
        ratio = out["continuous"]["tokens_per_s"] / out["static"]["tokens_per_s"]
        out["continuous_over_static_tokens_per_s"] = round(ratio, 2)
        print(f"continuous / static tokens/s: {ratio:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
