"""The main job of jaxpos: how far does each position scheme generalise past its training length?

For every scheme (NoPE, sinusoidal, learned, RoPE, ALiBi, T5, Shaw, and RoPE with a
context-extension scaling applied at evaluation; on request any other registered scheme
of :data:`jaxpos.REGISTRY`, e.g. KERPLE, FIRE, Sandwich, xPos, the FoX forget gate) this
script trains the same small byte-level decoder-only language model
(:class:`jaxpos.nnx.DecoderLM`) at one training length with optax, then measures held-out
loss in **bits per byte** at 1x, 2x, 4x, 8x and 16x that length. It is the experiment of
Press, Smith & Lewis 2022 ("Train Short, Test Long: Attention with Linear Biases Enables
Input Length Extrapolation", §2 and Fig. 1), scaled down to run on a laptop CPU in a few
minutes.

Seeds: ``--seeds N`` trains every row N times, with seeds ``--seed``, ``--seed + 1``,
... for the initialisation and the training batches (the data split and the held-out
bytes stay those of ``--seed``). The table then shows mean ± sample standard deviation
(``ddof = 1``) over the seeds at every length, the plot draws mean ± one standard
deviation as a band, and ``results.json`` keeps every seed's numbers. Two cells differ
beyond the spread when ``|mean_a - mean_b| > 2 * pooled std``, ``pooled std =
sqrt((std_a**2 + std_b**2) / 2)`` (:func:`compare_cells`).

DroPE (arXiv 2512.12167): the row ``drope`` takes each seed's trained RoPE model, removes
RoPE (the same weights in a NoPE model) and recalibrates it for ``--drope-steps`` more
steps (default ``--steps // 5``) at the training length with a fresh optimizer, then
evaluates it at every length (:func:`recalibrate`, :data:`RECALIBRATED`).

``--preset study`` is the committed study (docs/study.md): the rows of
:data:`STUDY_SCHEMES` with 3 seeds; a row whose scheme this jaxpos does not register is
reported as "not run". ``--report RESULTS_JSON`` prints the table and the paper-claim
comparisons (:data:`CLAIMS`) of a finished run and redraws its plot, training nothing.

Data: real text with no download. By default the Python standard library's own source
files on this machine (found through ``sysconfig``; the ``test``/``tests`` folders and
``site-packages`` are left out), split into training and held-out sets *by file* with a
seeded shuffle of the sorted file list. ``--corpus PATH`` takes any text file or folder
(a single file is split by bytes: the first 90% trains, the rest is held out).

Fairness: within a seed every scheme sees the same training batches (one seeded stream of
random windows), the same initialisation seed, model size, optimizer and number of steps.
Every evaluation length scores exactly the same held-out bytes: ``--eval-bytes`` bytes
are taken as chunks of ``lcm(eval_lens)`` predicted bytes, spaced evenly through the
held-out stream, and each chunk is cut into non-overlapping windows of the evaluation
length (Press et al. call this non-overlapping evaluation, §B). Tokens near the start of
a window have little context, so a model that generalises perfectly gets *lower* loss at
longer windows.

Scheme settings: T5 uses 32 causal buckets with ``max_distance = min(128, train_len)``
(at least 32), so that every bucket is trained, as in Press et al., whose training
lengths (512 and more) exceed T5's 128; Shaw clips at K = 16; RoPE uses base 10,000;
FIRE's threshold is ``init_L = train_len / 4``; every other scheme uses its defaults
unless ``--scheme-options`` says otherwise.

Learned absolute positions have no row past the training length: the library raises
``ValueError`` there, and the table reports "cannot run" instead of clamping.

Bits per byte = mean next-byte cross-entropy in nats / ln 2 (a byte is a token here).

Outputs under ``--out`` (default ``runs/length_generalization/``): ``results.json``
(rewritten after every row; ``--resume`` keeps the finished rows of an interrupted run),
``length_generalization.png`` (loss against evaluation length, one line per scheme, the
training length marked) and the table printed on stdout. Progress bars (tqdm) go to stderr.

Usage::

    python examples/length_generalization.py                       # defaults, ~2 min of CPU time
    python examples/length_generalization.py --schemes rope,alibi --seeds 3
    python examples/length_generalization.py --preset study --out docs/study
    python examples/length_generalization.py --report docs/study/results.json
    python examples/length_generalization.py --schemes rope,fire --steps 2000 --d-model 256 \
        --scheme-options '{"fire": {"init_L": 64}}'

The same script runs unchanged on GPU or TPU; ``--implementation`` defaults to the
library's choice for the backend (the fused Pallas kernel where it supports the scheme,
the chunked online-softmax path otherwise).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import platform
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

VOCAB_SIZE = 256  # byte-level: one token per byte
BASE_SCHEMES = ("nope", "sinusoidal", "learned", "rope", "alibi", "t5", "shaw")
# Schemes whose packed evaluation (windows packed into one row with restarted positions and
# segment ids) is tested equal to running the windows separately (tests/docs/test_examples.py).
# Every other scheme is evaluated one window per row: learned positions (checked against the
# table by value), FoX (its forget gates are indexed by token position, so positions must
# run 0 .. T-1 along a row) and any scheme registered later, whose packed form is untested.
PACKED = ("nope", "sinusoidal", "rope", "alibi", "t5", "shaw", "kerple_log", "kerple_power",
          "fire", "sandwich", "xpos")
# RoPE evaluated with a context-extension scaling at lengths beyond training
# (jaxpos.schemes.rope.scaling).
ROPE_VARIANTS = ("rope+yarn", "rope+ntk", "rope+pi")
DEFAULT_SCHEMES = BASE_SCHEMES + ("rope+yarn",)
# The committed study (docs/study.md): KERPLE is its logarithmic variant (Chi et al. 2022
# report it as the better extrapolator of the two).
STUDY_SCHEMES = ("nope", "sinusoidal", "rope", "rope+yarn", "alibi", "t5", "shaw", "kerple_log",
                 "fire", "sandwich", "xpos", "fox", "ssmax", "stick_breaking", "pope", "path",
                 "path_fox", "cope", "drope")
# Rows that take another row's trained model, drop its position scheme and recalibrate it
# for --drope-steps more steps at the training length before evaluation:
# name -> (trained as, recalibrated as). DroPE (arXiv 2512.12167): RoPE dropped, NoPE after.
RECALIBRATED = {"drope": ("rope", "nope")}
# --preset NAME: defaults that explicit flags override.
PRESETS = {"study": {"schemes": STUDY_SCHEMES, "seeds": 3}}
# A cell differs from another beyond the spread when |mean difference| > SPREAD_FACTOR *
# pooled standard deviation (compare_cells).
SPREAD_FACTOR = 2.0
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests",
                           "idle_test"})


# ----------------------------------------------------------------------------- data
@dataclasses.dataclass(frozen=True)
class Corpus:
    """Training and held-out bytes, each the concatenation of its files (uint8 ``[n]``)."""

    source: str
    train: np.ndarray
    heldout: np.ndarray
    train_files: int
    heldout_files: int


def stdlib_dir() -> Path:
    """Folder of the running interpreter's standard library (``sysconfig`` ``"stdlib"``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is_text(path: Path) -> bool:
    """Git's heuristic: a file with a NUL byte in its first 8 KiB is binary."""
    with open(path, "rb") as f:
        return b"\0" not in f.read(8192)


def list_files(root: Path, *, suffix: str | None = None) -> list[Path]:
    """Sorted regular files under ``root`` (skipping hidden and :data:`EXCLUDED_DIRS` folders).

    Only names ending in ``suffix`` when given, otherwise every file that is not binary.
    """
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise ValueError(f"--corpus must be an existing file or folder; got {str(root)!r}.")
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames
                             if d not in EXCLUDED_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            p = Path(dirpath) / name
            if name.startswith(".") or not p.is_file() or p.is_symlink():
                continue
            if suffix is not None and not name.endswith(suffix):
                continue
            if suffix is None and not _is_text(p):
                continue
            files.append(p)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_corpus(path: str | None, *, heldout_fraction: float = 0.1, seed: int = 0) -> Corpus:
    """Read the corpus and split it into training and held-out bytes, deterministically.

    Args:
      path: a text file or folder; ``None`` for the standard library's ``*.py`` files.
      heldout_fraction: share of the files (of the bytes, for a single file) held out.
      seed: seeds the shuffle of the sorted file list that decides the split.

    Raises:
      ValueError: a missing path, no text files, or too little text to split.
    """
    if path is None:
        root, files = stdlib_dir(), list_files(stdlib_dir(), suffix=".py")
        source = f"Python {platform.python_version()} standard library *.py under {root}"
    else:
        root = Path(path).expanduser()
        files = list_files(root)
        source = str(root)
    if not files:
        raise ValueError(f"--corpus {str(root)!r} holds no text files.")
    if len(files) == 1:
        data = np.frombuffer(files[0].read_bytes(), dtype=np.uint8)
        cut = int(len(data) * (1.0 - heldout_fraction))
        if cut < 2 or len(data) - cut < 2:
            raise ValueError(f"--corpus file {str(files[0])!r} is too small to split "
                             f"({len(data)} bytes).")
        return Corpus(source + " (split by bytes)", data[:cut], data[cut:], 1, 1)
    order = np.random.default_rng(seed).permutation(len(files))
    n_held = max(1, round(heldout_fraction * len(files)))
    held = sorted(order[:n_held].tolist())
    train = sorted(order[n_held:].tolist())

    def read(idx):
        return np.frombuffer(b"".join(files[i].read_bytes() for i in idx), dtype=np.uint8)

    return Corpus(source, read(train), read(held), len(train), len(held))


def train_offsets(n_bytes: int, *, steps: int, batch_size: int, train_len: int, seed: int):
    """Start offsets ``[steps, batch_size]`` of the random training windows (``train_len + 1``
    bytes each)."""
    if n_bytes < train_len + 2:
        raise ValueError(f"the training text has {n_bytes} bytes; --train-len {train_len} needs "
                         f"at least {train_len + 2}.")
    rng = np.random.default_rng(seed)
    return rng.integers(0, n_bytes - train_len - 1, size=(steps, batch_size))


def windows(data: np.ndarray, offsets: np.ndarray, length: int) -> np.ndarray:
    """``data[o : o + length]`` for every offset, as int32 ``offsets.shape + (length,)``."""
    return data[offsets[..., None] + np.arange(length)].astype(np.int32)


def eval_chunks(heldout: np.ndarray, eval_lens, eval_bytes: int) -> np.ndarray:
    """Held-out chunks ``[n_chunks, P + 1]`` (uint8), ``P = lcm(eval_lens)``, spaced evenly.

    Each chunk predicts its last ``P`` bytes; cut into non-overlapping windows of any
    evaluation length ``L`` (``P / L`` windows, each predicting ``L`` bytes) it predicts
    those same ``P`` bytes, so every length is scored on identical text.

    Raises:
      ValueError: ``eval_bytes < P``, ``P > 8 * max(eval_lens)``, or a held-out set
      shorter than one chunk.
    """
    period = math.lcm(*eval_lens)
    if period > 8 * max(eval_lens):
        raise ValueError(f"--eval-lens {list(eval_lens)} have lcm {period}; choose lengths whose "
                         f"lcm is at most 8x the largest (e.g. powers of two times --train-len).")
    n_chunks = eval_bytes // period
    if n_chunks < 1:
        raise ValueError(f"--eval-bytes {eval_bytes} is smaller than lcm(--eval-lens) = {period}; "
                         f"pass at least {period}.")
    fit = len(heldout) // (period + 1)
    if fit < 1:
        raise ValueError(f"the held-out text has {len(heldout)} bytes, fewer than one evaluation "
                         f"chunk of {period + 1}; use a larger --corpus or shorter --eval-lens.")
    if fit < n_chunks:
        print(f"warning: held-out text fits {fit} evaluation chunks of {period} bytes, not "
              f"{n_chunks}; using {fit}.", file=sys.stderr)
        n_chunks = fit
    starts = np.linspace(0, len(heldout) - (period + 1), n_chunks).astype(np.int64)
    return windows(heldout, starts, period + 1).astype(np.uint8)


# ---------------------------------------------------------------------------- schemes
def base_scheme(name: str) -> str:
    """The position scheme a model is trained with: ``"rope+yarn"`` -> ``"rope"``,
    ``"drope"`` -> ``"rope"`` (:data:`RECALIBRATED`)."""
    if name in RECALIBRATED:
        return RECALIBRATED[name][0]
    return name.split("+", 1)[0]


def rope_scaling_for(name: str, train_len: int, eval_len: int):
    """The RoPE context-extension dataclass a variant applies at ``eval_len``, or ``None``.

    * ``rope+yarn``: YaRN (Peng et al. 2023, §3.4), ``factor = eval_len / train_len``.
    * ``rope+ntk``: dynamic NTK-aware scaling (the Hugging Face ``"dynamic"`` rope type),
      factor 2, the base raised as the length grows past ``train_len``.
    * ``rope+pi``: position interpolation (Chen et al. 2023), ``factor = eval_len / train_len``.

    Nothing is applied at or below the training length.
    """
    if "+" not in name or eval_len <= train_len:
        return None
    from jaxpos.schemes.rope import scaling as rope_scaling
    factor = eval_len / train_len
    kind = name.split("+", 1)[1]
    if kind == "yarn":
        return rope_scaling.YaRNScaling(factor=factor,
                                        original_max_position_embeddings=train_len)
    if kind == "ntk":
        return rope_scaling.DynamicNTKScaling(factor=2.0,
                                              original_max_position_embeddings=train_len)
    if kind == "pi":
        return rope_scaling.LinearScaling(factor=factor)
    raise ValueError(f"unknown RoPE variant {name!r}; expected one of {ROPE_VARIANTS}.")


def rope_scaling_available() -> bool:
    try:
        from jaxpos.schemes.rope import scaling as rope_scaling  # noqa: F401
    except ImportError:
        return False
    return True


# ------------------------------------------------------------------------------ model
def registered_positions() -> tuple[str, ...]:
    """Every position a :class:`jaxpos.nnx.DecoderLM` of this jaxpos can be built with:
    ``"nope"``, the absolute ``"sinusoidal"`` and ``"learned"``, and every registered scheme
    the Flax modules build (:func:`jaxpos.nnx.stack_positions`, read from the registry now)."""
    from jaxpos.nnx import stack_positions

    return tuple(stack_positions())


def scheme_options_for(position: str, args) -> dict | None:
    """Options the run gives scheme ``position``: FIRE's threshold ``init_L = train_len / 4``
    (the authors' 512 for 2048-token training, scaled) updated by ``--scheme-options``."""
    options = {"init_L": max(1.0, args.train_len / 4)} if position == "fire" else {}
    if position == "cope":  # one embedding per position 0 .. train_len (the authors' default)
        options = {"cope_npos": args.train_len + 1}
    options.update((getattr(args, "scheme_options", None) or {}).get(position, {}))
    return options or None


def build_model(position: str, args, seed: int | None = None):
    """A fresh :class:`jaxpos.nnx.DecoderLM` with the run's size, initialised from ``seed``
    (default ``args.seed``).

    Registered schemes come from the scheme registry with their defaults (KERPLE's and
    FIRE's parameters shared by the stack, FoX's gate projection per layer, computed from
    the block's normalised input) and the options of :func:`scheme_options_for`.
    """
    import jax.numpy as jnp
    from flax import nnx

    from jaxpos.nnx import DecoderLM

    return DecoderLM(
        VOCAB_SIZE, d_model=args.d_model, num_layers=args.layers, num_heads=args.heads,
        position=position, max_len=args.train_len if position == "learned" else None,
        t5_max_distance=args.t5_max_distance, scheme_options=scheme_options_for(position, args),
        implementation=args.implementation, dtype=jnp.float32,
        rngs=nnx.Rngs(args.seed if seed is None else seed))


def cross_entropy_nats(logits, targets):
    """Per-token next-byte cross-entropy in nats, float32 ``[B, T]``."""
    import jax.numpy as jnp
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)


def make_optimizer(args, steps: int | None = None):
    """AdamW with linear warm-up, cosine decay over ``steps`` (default ``args.steps``) and
    global-norm clipping (optax)."""
    import jax
    import optax

    steps = args.steps if steps is None else steps
    warmup = max(1, min(steps // 10, 100))
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=args.lr, warmup_steps=warmup,
        decay_steps=max(steps, warmup + 1), end_value=args.lr / 10)
    decay_mask = functools.partial(jax.tree.map, lambda p: p.ndim >= 2)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=0.1, mask=decay_mask))


def train(position: str, args, corpus: Corpus, offsets: np.ndarray, progress: bool,
          seed: int | None = None, compiled: dict | None = None, init_params=None):
    """Train one model initialised from ``seed`` (default ``args.seed``) on the batches at
    ``offsets`` ``[steps, batch_size]`` (one optimizer step per row, the schedule of
    :func:`make_optimizer` over them); returns ``(graphdef, params, rest, stats)``.

    ``compiled`` caches the compiled training step by model structure across calls (the
    seeds of one row differ only in values, so they compile once). ``init_params``: start
    from these parameters (another model's, of the same structure) instead of the
    initialisation (:func:`recalibrate`).
    """
    import jax
    from flax import nnx
    from tqdm.auto import tqdm

    compiled = {} if compiled is None else compiled
    model = build_model(position, args, seed)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if init_params is not None:
        params = jax.tree.map(lambda a: a.copy(), init_params)  # the training step donates
    steps = len(offsets)
    tx = make_optimizer(args, steps)
    opt_state = tx.init(params)

    def loss_fn(p, r, batch):
        logits = nnx.merge(graphdef, p, r)(batch[:, :-1])
        return cross_entropy_nats(logits, batch[:, 1:]).mean()

    def step(p, s, r, batch):
        loss, grads = jax.value_and_grad(loss_fn)(p, r, batch)
        updates, s = tx.update(grads, s, p)
        return jax.tree.map(lambda a, u: a + u, p, updates), s, loss

    first = windows(corpus.train, offsets[0], args.train_len + 1)
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    key = ("train", graphdef, first.shape)
    if key not in compiled:
        compiled[key] = jax.jit(step, donate_argnums=(0, 1)).lower(
            params, opt_state, rest, first).compile()
    step_fn = compiled[key]
    compile_s = time.perf_counter() - t0

    losses = []
    shown_seed = args.seed if seed is None else seed
    bar = tqdm(range(steps), desc=f"train {position:<10} seed {shown_seed}", unit="step",
               disable=not progress, leave=False, file=sys.stderr, dynamic_ncols=True)
    t0 = time.perf_counter()
    for i in bar:
        batch = first if i == 0 else windows(corpus.train, offsets[i], args.train_len + 1)
        params, opt_state, loss = step_fn(params, opt_state, rest, batch)
        losses.append(loss)
        if progress and (i % 25 == 0 or i == steps - 1):
            bar.set_postfix(bpb=f"{float(loss) / math.log(2):.3f}")
    jax.block_until_ready(params)
    train_s = time.perf_counter() - t0
    cpu_s = time.process_time() - cpu0
    bar.close()
    losses = np.asarray(jax.device_get(losses), np.float64) / math.log(2)
    tail = max(1, len(losses) // 10)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    stats = {
        "num_params": n_params,
        "compile_s": round(compile_s, 3),
        "train_s": round(train_s, 3),
        "train_cpu_s": round(cpu_s, 3),  # process CPU time, compile included (all threads)
        "train_tokens_per_s": round(steps * args.batch_size * args.train_len / train_s, 1),
        "final_train_bits_per_byte": round(float(losses[-tail:].mean()), 4),
        "train_curve_bits_per_byte": [round(float(v), 4)
                                      for v in losses[:: max(1, len(losses) // 50)]],
    }
    return graphdef, params, rest, stats


def recalibrate(name: str, params, args, corpus: Corpus, progress: bool, seed: int,
                compiled: dict):
    """DroPE ("Extending the Context of Pretrained LLMs by Dropping Their Positional
    Embeddings", arXiv 2512.12167, 2025): the trained parameters ``params`` of
    the row's base model (RoPE) put in a model with the position scheme of
    :data:`RECALIBRATED` (NoPE: RoPE removed; the two models have the same parameters) and
    trained ``--drope-steps`` more steps at the training length with a fresh optimizer
    (the same warm-up and cosine schedule over those steps) on batches of their own
    (stream ``seed + 1000``), then evaluated at every length like any row.

    Returns ``(graphdef, params, rest, stats)`` as :func:`train`, with
    ``recalibration_steps`` and ``recalibrated_from`` in ``stats``.
    """
    base, after = RECALIBRATED[name]
    offsets = train_offsets(len(corpus.train), steps=args.drope_steps,
                            batch_size=args.batch_size, train_len=args.train_len,
                            seed=seed + 1000)
    graphdef, new, rest, stats = train(after, args, corpus, offsets, progress, seed=seed,
                                       compiled=compiled, init_params=params)
    stats = {"recalibrated_from": base, "recalibration_steps": args.drope_steps, **stats}
    return graphdef, new, rest, stats


def packed_positions(period: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions and segment ids, int32 ``[period]``, that cut a chunk into windows of ``length``.

    Window ``w`` covers chunk bytes ``[w * length, (w + 1) * length)`` with positions
    ``0 .. length - 1`` and segment id ``w``: a causal model then sees each window as a
    separate sequence (no attention across windows), so one compiled forward pass over
    ``[rows, period]`` evaluates every length.
    """
    if period % length:
        raise ValueError(f"length {length} must divide the chunk length {period}.")
    positions = np.tile(np.arange(length, dtype=np.int32), period // length)
    segment_ids = np.repeat(np.arange(period // length, dtype=np.int32), length)
    return positions, segment_ids


def evaluate(name: str, graphdef, params, rest, args, chunks: np.ndarray, progress: bool,
             compiled: dict | None = None):
    """Bits per byte of one trained model at every evaluation length (same held-out bytes).

    Every length scores the same bytes: the chunks ``[n, P + 1]`` are fed as ``[n, P]``
    inputs with :func:`packed_positions` (one compiled function per RoPE scaling, not per
    length) for the schemes of :data:`PACKED`; every other scheme runs unpacked, one
    window per row (one compiled function per length). Learned positions past their
    table are tried on one unpacked window (``jax.eval_shape``, nothing computed): the
    library raises ``ValueError`` and the length is reported as ``"cannot run"``.

    Returns ``(bits_per_byte, status, stats)``: ``bits_per_byte[str(L)]`` is a float or
    ``None``; ``status[str(L)]`` is ``"ok"``, ``"cannot run"`` or ``"not finite"``.
    ``compiled`` caches compiled functions by model structure, scaling and shape across
    calls (the seeds of one row, and RoPE's variants, share them).
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tqdm.auto import tqdm

    compiled = {} if compiled is None else compiled
    n, period = chunks.shape[0], chunks.shape[1] - 1
    rows = max(d for d in range(1, n + 1)
               if n % d == 0 and (d * period <= args.eval_batch_tokens or d == 1))
    x = chunks[:, :period].astype(np.int32)
    y = chunks[:, 1:].astype(np.int32)
    bpb, status, messages = {}, {}, {}
    compile_s = run_s = 0.0
    tokens = 0
    cpu0 = time.process_time()
    bar = tqdm(args.eval_lens, desc=f"eval  {name:<10}", unit="len", disable=not progress,
               leave=False, file=sys.stderr, dynamic_ncols=True)
    for L in bar:
        key = str(L)
        if base_scheme(name) == "learned" and L > args.train_len:
            try:  # the library must refuse: there is no table row past train_len
                window = jax.ShapeDtypeStruct((1, L), jnp.int32)
                jax.eval_shape(lambda p, t: nnx.merge(graphdef, p, rest)(t), params, window)
            except ValueError as e:
                bpb[key], status[key], messages[key] = None, "cannot run", str(e)
                continue
            raise RuntimeError(f"learned positions ran at length {L} > max_len {args.train_len}; "
                               f"they must raise instead of clamping.")
        scaling = rope_scaling_for(name, args.train_len, L)
        # Packed rows need traced positions and segment ids; only the schemes of PACKED are
        # tested to give the same numbers packed and separate, the others run one window
        # per row.
        packed = base_scheme(name) in PACKED
        shape = (rows, period) if packed else (rows * period // L, L)
        cache_key = ("eval", graphdef, repr(scaling), shape)
        if cache_key not in compiled:
            def loss_sum(p, r, xb, yb, pos, seg, scaling=scaling):
                logits = nnx.merge(graphdef, p, r)(xb, positions=pos, segment_ids=seg,
                                                   rope_scaling=scaling)
                return jnp.sum(cross_entropy_nats(logits, yb), dtype=jnp.float32)

            ints = jax.ShapeDtypeStruct(shape, jnp.int32)
            t0 = time.perf_counter()
            compiled[cache_key] = jax.jit(loss_sum).lower(
                params, rest, ints, ints, *((ints, ints) if packed else (None, None))).compile()
            compile_s += time.perf_counter() - t0
        fn = compiled[cache_key]
        if packed:
            pos, seg = (np.broadcast_to(a, shape) for a in packed_positions(period, L))
        else:
            pos = seg = None
        t0 = time.perf_counter()
        total = 0.0
        for r in range(0, n, rows):
            xb, yb = x[r:r + rows].reshape(shape), y[r:r + rows].reshape(shape)
            total += float(fn(params, rest, xb, yb, pos, seg))
        run_s += time.perf_counter() - t0
        tokens += y.size
        value = total / y.size / math.log(2)
        if math.isfinite(value):
            bpb[key], status[key] = round(value, 4), "ok"
        else:
            bpb[key], status[key] = None, "not finite"
    bar.close()
    stats = {"eval_compile_s": round(compile_s, 3), "eval_s": round(run_s, 3),
             "eval_cpu_s": round(time.process_time() - cpu0, 3),
             "eval_tokens_per_s": round(tokens / run_s, 1) if run_s > 0 else None}
    if messages:
        stats["messages"] = messages
    return bpb, status, stats


# ----------------------------------------------------------------------------- seeds
# Per-seed statistics averaged into a row's summary (mean over the seeds that have them).
_MEAN_STATS = ("num_params", "compile_s", "train_s", "train_cpu_s", "train_tokens_per_s",
               "final_train_bits_per_byte", "eval_compile_s", "eval_s", "eval_cpu_s",
               "eval_tokens_per_s")


def aggregate_seeds(per_seed: list[dict], eval_lens) -> tuple[dict, dict, dict]:
    """Mean, sample standard deviation and status over seeds at every evaluation length.

    Args:
      per_seed: one dict per seed with ``"bits_per_byte"`` and ``"status"``, each keyed by
        ``str(L)`` (what :func:`evaluate` returns).
      eval_lens: the lengths ``L``.

    Returns ``(mean, std, status)``, each keyed by ``str(L)``: where every seed's status is
    ``"ok"``, the mean and the standard deviation with ``ddof = 1`` (``None`` for a single
    seed), rounded to 4 digits, and status ``"ok"``; elsewhere ``None``, ``None`` and the
    seeds' common status, or ``"not finite in k of n seeds"`` when they differ.

    Raises:
      ValueError: ``per_seed`` is empty.
    """
    if not per_seed:
        raise ValueError("per_seed must hold at least one seed's results; got none.")
    mean, std, status = {}, {}, {}
    for L in eval_lens:
        key = str(L)
        states = [e["status"][key] for e in per_seed]
        if all(st == "ok" for st in states):
            values = np.array([e["bits_per_byte"][key] for e in per_seed], np.float64)
            mean[key] = round(float(values.mean()), 4)
            std[key] = round(float(values.std(ddof=1)), 4) if len(values) > 1 else None
            status[key] = "ok"
            continue
        mean[key] = std[key] = None
        bad = [st for st in states if st != "ok"]
        if len(bad) == len(states) and len(set(bad)) == 1:
            status[key] = bad[0]
        else:
            status[key] = f"not finite in {len(bad)} of {len(states)} seeds"
    return mean, std, status


def summarize_row(base: str, per_seed: list[dict], eval_lens) -> dict:
    """A row of ``results["schemes"]``: :func:`aggregate_seeds` of ``per_seed`` as
    ``bits_per_byte`` (the mean), ``std`` and ``status``, the mean over seeds of the timing
    statistics, and every seed's own entry under ``per_seed``."""
    mean, std, status = aggregate_seeds(per_seed, eval_lens)
    row = {"bits_per_byte": mean, "std": std, "status": status, "trained_as": base,
           "seeds": [e["seed"] for e in per_seed]}
    if "same_model_as" in per_seed[0]:
        row["same_model_as"] = per_seed[0]["same_model_as"]
    for k in ("recalibrated_from", "recalibration_steps"):
        if k in per_seed[0]:
            row[k] = per_seed[0][k]
    for k in _MEAN_STATS:
        values = [e[k] for e in per_seed if e.get(k) is not None]
        if values:
            row[k] = round(float(np.mean(values)), 3 if k != "num_params" else None)
    if "messages" in per_seed[0]:
        row["messages"] = per_seed[0]["messages"]
    row["per_seed"] = per_seed
    return row


def not_run_row(base: str, eval_lens, reason: str) -> dict:
    """A row for a scheme this jaxpos does not register: status ``"not run"`` everywhere."""
    keys = [str(L) for L in eval_lens]
    return {"bits_per_byte": dict.fromkeys(keys), "std": dict.fromkeys(keys),
            "status": dict.fromkeys(keys, "not run"), "trained_as": base, "seeds": [],
            "reason": reason, "per_seed": []}


def compare_cells(results: dict, a: str, length_a: int, b: str, length_b: int) -> dict | None:
    """Whether row ``a`` at ``length_a`` and row ``b`` at ``length_b`` differ beyond the spread.

    ``difference = mean_a - mean_b`` (bits per byte; negative: ``a`` is lower, i.e.
    better), ``pooled_std = sqrt((std_a**2 + std_b**2) / 2)`` and ``exceeds = |difference|
    > SPREAD_FACTOR * pooled_std`` (:data:`SPREAD_FACTOR` = 2). With one seed there is no
    spread: ``pooled_std`` and ``exceeds`` are ``None``.

    Returns ``None`` when either cell has no value (a row not run, "cannot run", "not
    finite").
    """
    rows = results["schemes"]
    if a not in rows or b not in rows:
        return None
    ma, mb = rows[a]["bits_per_byte"][str(length_a)], rows[b]["bits_per_byte"][str(length_b)]
    if ma is None or mb is None:
        return None
    sa = rows[a].get("std", {}).get(str(length_a))
    sb = rows[b].get("std", {}).get(str(length_b))
    diff = ma - mb
    if sa is None or sb is None:
        return {"difference": round(diff, 4), "pooled_std": None, "exceeds": None}
    pooled = math.sqrt((sa ** 2 + sb ** 2) / 2)
    return {"difference": round(diff, 4), "pooled_std": round(pooled, 4),
            "exceeds": abs(diff) > SPREAD_FACTOR * pooled}


@dataclasses.dataclass(frozen=True)
class Claim:
    """A paper's claim as one comparison: row ``a`` at ``at_a`` has *lower* loss than row
    ``b`` at ``at_b``; ``at_*`` index ``eval_lens`` (0: the training length, -1: the longest)."""

    paper: str
    claim: str
    a: str
    b: str
    at_a: int = -1
    at_b: int = -1


CLAIMS = (
    Claim("Press et al. 2022 (ALiBi)", "ALiBi extrapolates better than sinusoidal", "alibi",
          "sinusoidal"),
    Claim("Press et al. 2022 (ALiBi)", "ALiBi extrapolates better than rotary", "alibi", "rope"),
    Claim("Press et al. 2022 (ALiBi)", "ALiBi's loss keeps falling past the training length",
          "alibi", "alibi", -1, 0),
    Claim("Chi et al. 2022 (KERPLE)", "the logarithmic kernel extrapolates better than ALiBi",
          "kerple_log", "alibi"),
    Claim("Chi et al. 2022 (KERPLE)", "the logarithmic kernel extrapolates better than T5",
          "kerple_log", "t5"),
    Claim("Li et al. 2023 (FIRE)", "FIRE generalises to longer inputs better than KERPLE",
          "fire", "kerple_log"),
    Claim("Li et al. 2023 (FIRE)", "FIRE generalises to longer inputs better than ALiBi",
          "fire", "alibi"),
    Claim("Li et al. 2023 (FIRE)", "FIRE generalises to longer inputs better than RoPE",
          "fire", "rope"),
    Claim("Lin et al. 2025 (FoX)", "the forget gate extrapolates better than RoPE", "fox",
          "rope"),
    Claim("Lin et al. 2025 (FoX)", "the forget gate extrapolates better than no gate (NoPE)",
          "fox", "nope"),
    Claim("Tan et al. 2025 (stick-breaking)", "stick-breaking extrapolates better than "
          "softmax with RoPE", "stick_breaking", "rope"),
    Claim("Tan et al. 2025 (stick-breaking)", "stick-breaking extrapolates better than "
          "softmax with no positions (NoPE)", "stick_breaking", "nope"),
    Claim("Nakanishi 2025 (SSMax)", "Scalable-Softmax lowers the loss past the training "
          "length against plain softmax (NoPE)", "ssmax", "nope"),
    Claim("Yang et al. 2025 (PaTH)", "PaTH extrapolates better than RoPE", "path", "rope"),
    Claim("Yang et al. 2025 (PaTH)", "PaTH-FoX extrapolates better than FoX", "path_fox",
          "fox"),
    Claim("Yang et al. 2025 (PaTH)", "PaTH-FoX extrapolates better than PaTH", "path_fox",
          "path"),
    Claim("Golovneva et al. 2024 (CoPE)", "CoPE extrapolates better than RoPE", "cope",
          "rope"),
    Claim("DroPE 2025 (arXiv 2512.12167)", "dropping RoPE and recalibrating extends the "
          "context zero-shot better than RoPE scaling (YaRN)", "drope", "rope+yarn"),
    Claim("DroPE 2025 (arXiv 2512.12167)", "dropping RoPE and recalibrating extrapolates "
          "better than keeping RoPE", "drope", "rope"),
)


def judge(claim: Claim, results: dict) -> dict:
    """One claim against a run: the two cells, :func:`compare_cells` and a verdict:
    ``"matches"`` (``a`` lower beyond the spread), ``"does not match"`` (``a`` higher
    beyond the spread), ``"cannot be told apart"``, ``"one seed"`` (no spread) or
    ``"not run"`` (a cell without a value)."""
    lens = results["eval_lens"]
    la, lb = lens[claim.at_a], lens[claim.at_b]
    c = compare_cells(results, claim.a, la, claim.b, lb)
    out = {"paper": claim.paper, "claim": claim.claim, "a": claim.a, "length_a": la,
           "b": claim.b, "length_b": lb, "comparison": c}
    if c is None:
        out["verdict"] = "not run"
    elif c["exceeds"] is None:
        out["verdict"] = "one seed"
    elif not c["exceeds"]:
        out["verdict"] = "cannot be told apart"
    else:
        out["verdict"] = "matches" if c["difference"] < 0 else "does not match"
    return out


# ------------------------------------------------------------------------- reporting
def _markdown(head: list[str], rows: list[list[str]], *, text_columns: int = 1) -> str:
    """Markdown table; the first ``text_columns`` columns left-aligned, the rest right."""
    widths = [max(len(h), *(len(c[i]) for c in rows)) for i, h in enumerate(head)]
    line = lambda cells: "| " + " | ".join(
        c.ljust(w) if i < text_columns else c.rjust(w)
        for i, (c, w) in enumerate(zip(cells, widths))) + " |"
    sep = "|" + "|".join(("-" * (w + 2)) if i < text_columns else ("-" * (w + 1) + ":")
                         for i, w in enumerate(widths)) + "|"
    return "\n".join([line(head), sep] + [line(r) for r in rows])


def format_table(results: dict, *, timings: bool = True) -> str:
    """Markdown table: one row per scheme, bits per byte per evaluation length (mean ±
    standard deviation over seeds when there are several), then the mean time per seed."""
    lens = results["eval_lens"]
    T = results["config"]["train_len"]
    head = ["scheme"] + [f"{L} ({L / T:g}x)" for L in lens]
    if timings:
        head += ["train s", "train tok/s", "eval s"]
    rows = []
    for name, r in results["schemes"].items():
        cells = [name]
        std = r.get("std", {})
        for L in lens:
            v, st, sd = r["bits_per_byte"][str(L)], r["status"][str(L)], std.get(str(L))
            cells.append(st if v is None else f"{v:.3f}" if sd is None else f"{v:.3f} ± {sd:.3f}")
        if timings:
            cells += [f"{r['train_s'] + r['compile_s']:.1f}" if "train_s" in r else "-",
                      f"{r['train_tokens_per_s']:.0f}" if "train_tokens_per_s" in r else "-",
                      f"{r['eval_s'] + r['eval_compile_s']:.1f}" if "eval_s" in r else "-"]
        rows.append(cells)
    return _markdown(head, rows)


def format_claims(results: dict) -> str:
    """Markdown table of :data:`CLAIMS` judged against ``results`` (:func:`judge`)."""
    T = results["config"]["train_len"]
    rows = []
    for claim in CLAIMS:
        j = judge(claim, results)
        c = j["comparison"]
        where = (f"{j['a']} {j['length_a'] / T:g}x vs {j['b']} {j['length_b'] / T:g}x")
        diff = "-" if c is None else f"{c['difference']:+.3f}"
        spread = "-" if c is None or c["pooled_std"] is None else (
            f"{SPREAD_FACTOR * c['pooled_std']:.3f}")
        rows.append([j["paper"], j["claim"], where, j["verdict"], diff, spread])
    head = ["paper", "claim", "cells (a vs b)", "verdict", "a - b", "2 × pooled std"]
    return _markdown(head, rows, text_columns=4)


def format_ranking(results: dict, at: int = -1) -> str:
    """Markdown table: the rows with a value at ``eval_lens[at]`` (default the longest),
    lowest mean first, each with the rows it cannot be told apart from there
    (:func:`compare_cells`: ``|difference| <= 2 * pooled std``)."""
    L = results["eval_lens"][at]
    T = results["config"]["train_len"]
    rows = [n for n, r in results["schemes"].items() if r["bits_per_byte"][str(L)] is not None]
    rows.sort(key=lambda n: results["schemes"][n]["bits_per_byte"][str(L)])
    out = []
    for a in rows:
        r = results["schemes"][a]
        sd = r.get("std", {}).get(str(L))
        tied = [b for b in rows if b != a and not compare_cells(results, a, L, b, L)["exceeds"]]
        out.append([a, (", ".join(tied) or "-") if sd is not None else "(one seed: no spread)",
                    f"{r['bits_per_byte'][str(L)]:.3f}" + ("" if sd is None else f" ± {sd:.3f}")])
    return _markdown(["scheme", f"cannot be told apart at {L / T:g}x from", f"{L} ({L / T:g}x)"],
                     out, text_columns=2)


def plot(results: dict, path: Path) -> None:
    """Bits per byte against evaluation length (log2 axis), one line per scheme, with a band
    of ± one standard deviation over seeds where there are several."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lens = results["eval_lens"]
    T = results["config"]["train_len"]
    rows = {n: r for n, r in results["schemes"].items()
            if any(v is not None for v in r["bits_per_byte"].values())}
    fig, ax = plt.subplots(figsize=(9.5 if len(rows) > 10 else 7.5, 5.2), dpi=110)
    markers = "osv^D<>phX*P"
    colors = plt.get_cmap("tab20").colors  # the ten dark hues first, then their light twins
    colors = colors[0::2] + colors[1::2]
    for i, (name, r) in enumerate(rows.items()):
        xs = [L for L in lens if r["bits_per_byte"][str(L)] is not None]
        ys = np.array([r["bits_per_byte"][str(L)] for L in xs])
        style = "--" if "+" in name else "-"
        label = name + (" (cannot run past its table)" if any(
            r["status"][str(L)] == "cannot run" for L in lens) else "")
        color = colors[i % len(colors)]
        ax.plot(xs, ys, style, marker=markers[i % len(markers)], label=label, lw=1.5, ms=4.5,
                color=color)
        sd = [r.get("std", {}).get(str(L)) for L in xs]
        if xs and all(v is not None for v in sd):
            sd = np.array(sd)
            ax.fill_between(xs, ys - sd, ys + sd, color=color, alpha=0.18, lw=0)
    ax.axvline(T, color="0.4", ls=":", lw=1.2)
    ax.text(T, 0.98, " training length", transform=ax.get_xaxis_transform(), va="top",
            fontsize=8, color="0.3")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lens, [str(L) for L in lens])
    ax.set_xlabel("evaluation length (bytes)")
    ax.set_ylabel("held-out bits per byte (lower is better)")
    c = results["config"]
    n_seeds = len(results.get("seeds", [c["seed"]]))
    seeds = f", mean ± std of {n_seeds} seeds" if n_seeds > 1 else ""
    ax.set_title(f"Length generalisation: trained at {T} bytes, {c['steps']} steps, "
                 f"d_model {c['d_model']}, {c['layers']} layers{seeds}", fontsize=10)
    ax.grid(True, alpha=0.3)
    if len(rows) > 10:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ------------------------------------------------------------------------------- main
def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers; got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers; got {text!r}")
    return values


def _name_list(text: str) -> list[str]:
    names = [v.strip().lower() for v in text.split(",") if v.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated scheme names; got {text!r}")
    return names


def _options(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object; got {text!r} ({e})") from None
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise argparse.ArgumentTypeError(
            f'expected a JSON object of scheme name -> options, e.g. \'{{"fire": {{"init_L": '
            f'16}}}}\'; got {text!r}')
    return {k.lower(): v for k, v in value.items()}


# Configuration entries that must agree for --resume to reuse a finished row.
_RESUME_KEYS = ("steps", "train_len", "eval_lens", "d_model", "layers", "heads", "batch_size",
                "t5_max_distance", "lr", "seed", "seeds", "corpus", "eval_bytes",
                "eval_batch_tokens", "implementation", "scheme_options")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Train a small byte-level LM per position scheme at one length and evaluate "
                    "held-out bits per byte at 1x-16x that length.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--schemes", type=_name_list, default=None,
                   help=f"comma-separated rows: any position jaxpos.nnx.DecoderLM takes (the "
                        f"registered schemes, e.g. kerple_log, fire, fox), or a RoPE variant "
                        f"{','.join(ROPE_VARIANTS)} (the trained RoPE model evaluated with "
                        f"jaxpos.schemes.rope.scaling); default {','.join(DEFAULT_SCHEMES)}")
    p.add_argument("--seeds", type=int, default=None,
                   help="seeds per row (--seed, --seed + 1, ...: initialisation and batches); "
                        "the table shows mean ± std; default 1 (3 for --preset study)")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help=f"study: the rows {','.join(STUDY_SCHEMES)} with 3 seeds (explicit "
                        f"flags override); rows this jaxpos does not register are 'not run'")
    p.add_argument("--scheme-options", type=_options, default=None,
                   help='JSON object of scheme name -> DecoderLM scheme_options, e.g. '
                        '\'{"fire": {"init_L": 16}}\'')
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per scheme")
    p.add_argument("--train-len", type=int, default=64, help="training sequence length (bytes)")
    p.add_argument("--eval-lens", type=_int_list, default=None,
                   help="comma-separated evaluation lengths in bytes (absolute, not multiples); "
                        "default: 1, 2, 4, 8 and 16 times --train-len")
    p.add_argument("--d-model", type=int, default=64, help="model width")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--batch-size", type=int, default=16, help="training sequences per step")
    p.add_argument("--drope-steps", type=int, default=None,
                   help="DroPE's recalibration (the drope row: the trained RoPE model with RoPE "
                        "removed, trained this many more steps at --train-len before "
                        "evaluation); default --steps // 5")
    p.add_argument("--t5-max-distance", type=int, default=None,
                   help="T5's max_distance; default max(32, min(128, --train-len)), so that every "
                        "bucket is trained, as in Press et al. (trained on 512+ tokens)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    p.add_argument("--seed", type=int, default=0,
                   help="data split and held-out bytes; initialisation and batches of the first "
                        "seed")
    p.add_argument("--corpus", default=None,
                   help="text file or folder; default: the Python standard library's source")
    p.add_argument("--eval-bytes", type=int, default=8192,
                   help="held-out bytes scored at every evaluation length")
    p.add_argument("--eval-batch-tokens", type=int, default=8192,
                   help="tokens per evaluation forward pass")
    p.add_argument("--implementation", default=None, choices=("reference", "chunked", "pallas"),
                   help="attention implementation; default: the library's choice for the backend")
    p.add_argument("--out", default=None,
                   help="output folder; default runs/length_generalization (runs/study for "
                        "--preset study)")
    p.add_argument("--resume", action="store_true",
                   help="keep the rows of --out's results.json that were run with the same "
                        "settings and seeds; train only the others")
    p.add_argument("--report", default=None, metavar="RESULTS_JSON",
                   help="print the table and the paper-claim comparisons of a results.json, "
                        "redraw the plot next to it and exit (nothing is trained)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    args = p.parse_args(argv)
    if args.report is not None:
        return args
    preset = PRESETS.get(args.preset, {})
    from_preset = args.schemes is None and "schemes" in preset
    if args.seeds is None:
        args.seeds = preset.get("seeds", 1)
    if args.schemes is None:
        args.schemes = list(preset.get("schemes", DEFAULT_SCHEMES))
    if args.out is None:
        args.out = f"runs/{args.preset}" if args.preset else "runs/length_generalization"
    if args.drope_steps is None:
        args.drope_steps = max(1, args.steps // 5)
    for name in ("steps", "train_len", "d_model", "layers", "heads", "batch_size", "eval_bytes",
                 "eval_batch_tokens", "seeds", "drope_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if args.d_model % args.heads:
        p.error(f"--d-model {args.d_model} must be divisible by --heads {args.heads}")
    if args.t5_max_distance is None:
        args.t5_max_distance = max(32, min(128, args.train_len))
    if args.eval_lens is None:
        args.eval_lens = [args.train_len * m for m in (1, 2, 4, 8, 16)]
    args.eval_lens = sorted(set(args.eval_lens))
    args.schemes = list(dict.fromkeys(args.schemes))
    has_scaling = rope_scaling_available()
    if args.preset is None and args.schemes == list(DEFAULT_SCHEMES) and not has_scaling:
        args.schemes = [s for s in args.schemes if "+" not in s]
    known = registered_positions()
    args.not_registered = []
    for s in args.schemes:
        if s in RECALIBRATED:
            continue
        if "+" in s:
            if s not in ROPE_VARIANTS:
                p.error(f"--schemes: unknown variant {s!r}; the RoPE variants are "
                        f"{ROPE_VARIANTS}")
            if not has_scaling:
                p.error(f"--schemes: {s!r} needs jaxpos.schemes.rope.scaling, "
                        "which is not installed")
        elif s not in known:
            if not from_preset:
                p.error(f"--schemes: unknown scheme {s!r}; this jaxpos builds {known} and the "
                        f"RoPE variants {ROPE_VARIANTS}")
            args.not_registered.append(s)
    for s in args.scheme_options or {}:
        if base_scheme(s) not in [base_scheme(n) for n in args.schemes]:
            p.error(f"--scheme-options: {s!r} is not one of the rows {args.schemes}")
    return args


def _git_commit() -> str | None:
    """The checkout's commit (``+dirty`` when files differ from it), or ``None``."""
    import subprocess

    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, text=True,
                              capture_output=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=here, text=True, capture_output=True, timeout=10,
                               check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty.strip() else "")


def _previous_rows(args, path: Path) -> dict:
    """The rows of ``path`` (a results.json) that ``--resume`` keeps: all of them when its
    configuration agrees with ``args`` on :data:`_RESUME_KEYS`, except rows not run."""
    if not path.is_file():
        return {}
    old = json.loads(path.read_text())
    config = dict(vars(args))
    if any(old["config"].get(k) != config.get(k) for k in _RESUME_KEYS):
        print(f"--resume: {path} was run with other settings; starting afresh", file=sys.stderr)
        return {}
    return {n: r for n, r in old["schemes"].items()
            if r["per_seed"] and r["seeds"] == old["seeds"] and
            r.get("recalibration_steps") in (None, args.drope_steps)}


def run(args) -> dict:
    """Run the experiment described by ``args``; returns the results dictionary."""
    import jax

    progress = not args.no_progress
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    seeds = [args.seed + i for i in range(args.seeds)]
    corpus = load_corpus(args.corpus, seed=args.seed)
    offsets = {s: train_offsets(len(corpus.train), steps=args.steps, batch_size=args.batch_size,
                                train_len=args.train_len, seed=s) for s in seeds}
    chunks = eval_chunks(corpus.heldout, args.eval_lens, args.eval_bytes)
    print(f"corpus: {corpus.source}\n  train {len(corpus.train):,} bytes in {corpus.train_files} "
          f"files; held-out {len(corpus.heldout):,} bytes in {corpus.heldout_files} files; "
          f"{chunks.size - len(chunks):,} held-out bytes scored at every length")
    print(f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind}); attention "
          f"implementation: {args.implementation or 'library default'}")
    print(f"model: d_model {args.d_model}, {args.layers} layers, {args.heads} heads; training "
          f"{args.steps} steps x {args.batch_size} x {args.train_len} bytes, "
          f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}; "
          f"T5 max_distance {args.t5_max_distance}")

    previous = _previous_rows(args, out / "results.json") if args.resume else {}
    results = {
        "config": {k: v for k, v in vars(args).items()
                   if k not in ("no_progress", "resume", "report", "not_registered")},
        "eval_lens": list(args.eval_lens),
        "seeds": seeds,
        "corpus": {"source": corpus.source, "train_bytes": len(corpus.train),
                   "heldout_bytes": len(corpus.heldout), "train_files": corpus.train_files,
                   "heldout_files": corpus.heldout_files,
                   "eval_bytes_per_length": int(chunks.size - len(chunks))},
        "environment": {"jax": jax.__version__, "backend": jax.default_backend(),
                        "device": jax.devices()[0].device_kind, "python": platform.python_version(),
                        "cpu_count": os.cpu_count(), "git_commit": _git_commit()},
        "units": "bits per byte = mean next-byte cross-entropy (nats) / ln 2",
        "spread_rule": f"two cells differ beyond the spread when |mean_a - mean_b| > "
                       f"{SPREAD_FACTOR:g} * sqrt((std_a**2 + std_b**2) / 2), std with ddof=1 "
                       f"over the seeds",
        "schemes": {},
    }

    def write():
        rows = results["schemes"]
        results["schemes"] = {s: rows[s] for s in args.schemes if s in rows}
        results["total_s"] = round(time.perf_counter() - t_start, 1)
        tmp = out / "results.json.tmp"
        with open(tmp, "w") as f:
            json.dump(results, f, indent=1)
        tmp.replace(out / "results.json")

    def shown(bpb, status, std=None):
        return "  ".join(
            f"{L}:{status[str(L)]}" if bpb[str(L)] is None else f"{L}:{bpb[str(L)]:.3f}" + (
                "" if std is None or std[str(L)] is None else f"±{std[str(L)]:.3f}")
            for L in args.eval_lens)

    bases = list(dict.fromkeys(base_scheme(s) for s in args.schemes))
    for base in bases:
        names = [s for s in args.schemes if base_scheme(s) == base]
        if base in args.not_registered:
            for name in names:
                results["schemes"][name] = not_run_row(
                    base, args.eval_lens, f"this jaxpos registers no scheme {base!r}")
                print(f"{name:<14} not run: this jaxpos registers no scheme {base!r}", flush=True)
            write()
            continue
        for name in [n for n in names if n in previous]:
            results["schemes"][name] = previous[name]
            print(f"{name:<14} kept from the previous results.json (--resume)", flush=True)
        names = [n for n in names if n not in previous]
        if not names:
            write()
            continue
        t0 = time.perf_counter()
        per_seed = {name: [] for name in names}
        compiled = {}  # one compilation per row, shared by its seeds
        for seed in seeds:
            graphdef, params, rest, train_stats = train(base, args, corpus, offsets[seed],
                                                        progress, seed=seed, compiled=compiled)
            for name in names:
                model, stats = (graphdef, params, rest), train_stats
                if name in RECALIBRATED:
                    *model, stats = recalibrate(name, params, args, corpus, progress, seed,
                                                compiled)
                bpb, status, eval_stats = evaluate(name, *model, args, chunks, progress,
                                                   compiled)
                entry = {"seed": seed, "bits_per_byte": bpb, "status": status}
                shared = name != base and base in args.schemes and name not in RECALIBRATED
                entry.update({"same_model_as": base} if shared else stats)
                entry.update(eval_stats)
                per_seed[name].append(entry)
                if len(seeds) > 1:
                    print(f"{name:<14} seed {seed}  {shown(bpb, status)}   "
                          f"({time.perf_counter() - t0:.1f} s)", flush=True)
        for name in names:
            row = summarize_row(base, per_seed[name], args.eval_lens)
            row["git_commit"] = results["environment"]["git_commit"]
            results["schemes"][name] = row
            print(f"{name:<14} {shown(row['bits_per_byte'], row['status'], row['std'])}   "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)
        write()
    write()
    plot(results, out / "length_generalization.png")
    print()
    print(format_table(results))
    if len(seeds) > 1 and any(c.a in results["schemes"] for c in CLAIMS):
        print()
        print(format_claims(results))
    print(f"\nwrote {out / 'results.json'} and {out / 'length_generalization.png'} "
          f"({results['total_s']:.0f} s in all)")
    return results


def report(path: str) -> dict:
    """Print the table, the ranking at the longest length (:func:`format_ranking`) and the
    claim comparisons of a finished run's results.json, and redraw its plot,
    ``length_generalization.png``, in the same folder."""
    results = json.loads(Path(path).read_text())
    print(format_table(results))
    print()
    print(format_ranking(results))
    print()
    print(format_claims(results))
    png = Path(path).with_name("length_generalization.png")
    plot(results, png)
    print(f"\nwrote {png}")
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report is not None:
        report(args.report)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
