"""Tests of the example scripts: the main job (examples/length_generalization.py) end to end
with tiny settings, its data and evaluation helpers, and the two demonstration scripts.

Expected numbers come from the papers' formulas worked out by hand (sinusoid similarity,
T5 bucket edges, ALiBi slopes), from closed forms (RoPE's bound at distance 0), or from
the mathematics of the argument (permutation equivariance); none is a recorded output.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _load(name: str):
    """Import ``examples/<name>.py`` as a module (the examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"_example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def lg():
    return _load("length_generalization")


def _is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ the main job, end to end
def test_length_generalization_end_to_end(tmp_path, lg):
    """Issue 6, item 7: the script runs with tiny settings on the default corpus (the
    standard library), writes a table, results.json and a PNG, reports learned positions
    past their table as "cannot run", and every finite value is a plausible loss."""
    schemes = ["learned", "rope+yarn" if lg.rope_scaling_available() else "alibi"]
    out = tmp_path / "run"
    cmd = [sys.executable, str(EXAMPLES / "length_generalization.py"),
           "--steps", "30", "--lr", "1e-2", "--train-len", "8", "--eval-lens", "8,16", "--d-model", "16",
           "--layers", "1", "--heads", "2", "--batch-size", "8", "--eval-bytes", "32",
           "--schemes", ",".join(schemes), "--seed", "1", "--out", str(out), "--no-progress"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]

    res = json.loads((out / "results.json").read_text())
    assert res["eval_lens"] == [8, 16]
    assert list(res["schemes"]) == schemes
    assert res["config"]["train_len"] == 8 and res["config"]["steps"] == 30
    assert res["corpus"]["train_files"] > 0 and res["corpus"]["heldout_files"] > 0
    assert res["corpus"]["eval_bytes_per_length"] == 32  # lcm(8, 16) = 16, two chunks
    for name, entry in res["schemes"].items():
        assert set(entry["bits_per_byte"]) == {"8", "16"} == set(entry["status"])
        for L, value in entry["bits_per_byte"].items():
            if value is None:
                assert entry["status"][L] in ("cannot run", "not finite")
            else:
                assert entry["status"][L] == "ok"
                assert math.isfinite(value) and 0.0 < value < 8.0, (name, L, value)
    learned = res["schemes"]["learned"]
    assert learned["status"] == {"8": "ok", "16": "cannot run"}
    assert "max_len" in learned["messages"]["16"]  # the library's own ValueError
    other = res["schemes"][schemes[1]]
    assert all(s == "ok" for s in other["status"].values())
    assert other["train_tokens_per_s"] > 0
    if "rope+yarn" in schemes:  # trained as plain RoPE, evaluated with YaRN past 1x
        assert res["schemes"]["rope+yarn"]["trained_as"] == "rope"
        assert res["schemes"]["rope+yarn"]["status"]["16"] == "ok"

    assert _is_png(out / "length_generalization.png")
    assert "cannot run" in proc.stdout and "| scheme" in proc.stdout and "16 (2x)" in proc.stdout


def test_same_corpus_split_and_batches_for_every_run(lg):
    """Deterministic data: the same seed gives the same split and the same batches."""
    a = lg.load_corpus(None, seed=3)
    b = lg.load_corpus(None, seed=3)
    assert np.array_equal(a.train, b.train) and np.array_equal(a.heldout, b.heldout)
    assert a.heldout_files == max(1, round(0.1 * (a.train_files + a.heldout_files)))
    o1 = lg.train_offsets(len(a.train), steps=4, batch_size=3, train_len=8, seed=3)
    o2 = lg.train_offsets(len(a.train), steps=4, batch_size=3, train_len=8, seed=3)
    assert np.array_equal(o1, o2) and o1.shape == (4, 3)
    assert o1.min() >= 0 and o1.max() + 9 <= len(a.train)


# ------------------------------------------------------------------------------- data
def test_corpus_folder_is_split_by_file(tmp_path, lg):
    texts = {f"f{i:02d}.txt": (f"file {i} " * (10 + i)).encode() for i in range(20)}
    for name, data in texts.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "image.bin").write_bytes(b"\x89PNG\0\0\0binary")  # skipped: has NUL bytes
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "x.txt").write_text("never read")
    c = lg.load_corpus(str(tmp_path), seed=0)
    assert (c.train_files, c.heldout_files) == (18, 2)
    everything = b"".join(texts.values())
    assert len(c.train) + len(c.heldout) == len(everything)
    held = bytes(c.heldout)
    # the held-out bytes are whole files, none of which is in the training bytes
    held_files = [n for n, d in texts.items() if d in held]
    assert len(held_files) == 2
    assert sum(len(texts[n]) for n in held_files) == len(held)
    for n in held_files:
        assert texts[n] not in bytes(c.train)


def test_single_file_corpus_is_split_by_bytes(tmp_path, lg):
    data = bytes(range(256)) * 4
    (tmp_path / "one.txt").write_bytes(data)
    c = lg.load_corpus(str(tmp_path / "one.txt"))
    assert bytes(c.train) == data[:921] and bytes(c.heldout) == data[921:]


def test_corpus_errors(tmp_path, lg):
    with pytest.raises(ValueError, match="--corpus"):
        lg.load_corpus(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no text files"):
        lg.load_corpus(str(tmp_path / "empty"))


@pytest.mark.parametrize("eval_lens", [(8, 16, 32), (4, 8, 12)])
def test_every_length_scores_the_same_bytes(lg, eval_lens):
    """Cut by positions and segment ids, each length predicts each chunk byte exactly once,
    from windows that start at multiples of the length with positions 0..L-1."""
    heldout = (np.arange(5000) * 7 % 251).astype(np.uint8)
    chunks = lg.eval_chunks(heldout, eval_lens, eval_bytes=200)
    P = math.lcm(*eval_lens)
    assert chunks.shape == (200 // P, P + 1)
    for row in chunks:  # every chunk is a contiguous piece of the held-out text
        assert any(np.array_equal(heldout[s:s + P + 1], row)
                   for s in np.flatnonzero(heldout[:len(heldout) - P] == row[0]))
    for L in eval_lens:
        pos, seg = lg.packed_positions(P, L)
        assert pos.shape == seg.shape == (P,)
        for w in range(P // L):
            idx = np.flatnonzero(seg == w)
            assert np.array_equal(idx, np.arange(w * L, (w + 1) * L))
            assert np.array_equal(pos[idx], np.arange(L))


def test_eval_chunk_errors(lg):
    heldout = np.zeros(1000, np.uint8)
    with pytest.raises(ValueError, match="--eval-bytes"):
        lg.eval_chunks(heldout, [64, 128], eval_bytes=100)
    with pytest.raises(ValueError, match="held-out text"):
        lg.eval_chunks(np.zeros(100, np.uint8), [64, 128], eval_bytes=1000)
    with pytest.raises(ValueError, match="lcm"):
        lg.eval_chunks(heldout, [63, 64, 65], eval_bytes=10**6)


def test_bad_arguments_exit_with_a_message(lg, capsys):
    with pytest.raises(SystemExit):
        lg.parse_args(["--d-model", "30", "--heads", "4"])
    assert "divisible" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        lg.parse_args(["--schemes", "rope+magic"])
    assert "variant" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        lg.parse_args(["--eval-lens", "64,-1"])
    args = lg.parse_args(["--train-len", "32"])
    assert args.eval_lens == [32, 64, 128, 256, 512]


# ------------------------------------------------------------- packed = separate windows
@pytest.mark.parametrize("position", ["sinusoidal", "rope", "t5", "shaw"])
def test_packed_evaluation_equals_separate_windows(lg, position):
    """The script scores length L as windows packed into one row with restarted positions
    and segment ids; that must equal running each window as its own sequence."""
    from flax import nnx

    from jaxpos.nnx import DecoderLM

    model = DecoderLM(256, d_model=16, num_layers=1, num_heads=2, position=position,
                      rngs=nnx.Rngs(0))
    _assert_packed_equals_separate(lg, model, P=24, L=8)


def _assert_packed_equals_separate(lg, model, *, P, L):
    """Two rows of P tokens scored as packed windows of L (the script's evaluation) equal
    the same windows run as separate sequences; returns the token ids."""
    import jax
    import jax.numpy as jnp

    x = jax.random.randint(jax.random.PRNGKey(1), (2, P), 0, 256)
    pos, seg = lg.packed_positions(P, L)
    packed = model(x, positions=jnp.broadcast_to(pos, (2, P)),
                   segment_ids=jnp.broadcast_to(seg, (2, P)))
    separate = model(x.reshape(2 * P // L, L)).reshape(2, P, 256)
    np.testing.assert_allclose(np.asarray(packed), np.asarray(separate), rtol=2e-5, atol=2e-5)
    return x


@pytest.mark.slow  # 13-30 s each; the main job's default rows run in the end-to-end test
@pytest.mark.parametrize("name", ["kerple_log", "kerple_power", "fire", "sandwich", "xpos",
                                  "fox"])
def test_registered_scheme_rows_evaluate_and_train(lg, name):
    """The main job's KERPLE, FIRE, Sandwich, xPos and FoX rows (DecoderLM from the scheme
    registry): packed evaluation equals separate windows, except FoX, whose gates are
    indexed by token position: the library refuses its packed rows, and the script runs
    it one window per row (UNPACKED); the scheme's own parameters are trained."""
    import argparse

    import jax
    import jax.numpy as jnp
    from flax import nnx

    assert name in lg.SCHEME_OBJECTS
    args = argparse.Namespace(d_model=16, layers=1, heads=2, train_len=8, seed=0,
                              implementation="reference", t5_max_distance=32)
    model = lg.build_model(name, args)
    if name in lg.UNPACKED:
        pos, seg = lg.packed_positions(16, 8)
        x = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, 256)
        with pytest.raises(ValueError, match="positions must be 0 .. 15"):
            model(x, positions=jnp.asarray(pos)[None], segment_ids=jnp.asarray(seg)[None])
    else:
        x = _assert_packed_equals_separate(lg, model, P=16, L=8)

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss = lambda p: lg.cross_entropy_nats(nnx.merge(graphdef, p, rest)(x[:, :-1]),
                                           x[:, 1:]).mean()
    grads = nnx.to_flat_state(jax.grad(loss)(params))
    own = {k: v for k, v in grads if "rel_position" in k or "position_module" in k}
    assert bool(own) == (name not in ("sandwich", "xpos"))
    for path, g in own.items():
        assert float(jnp.max(jnp.abs(g[...]))) > 0, path
    if name == "fire":  # the script's threshold: train_len / 4
        assert dict(model.rel_position.options)["init_L"] == 2.0
    with pytest.raises(SystemExit):
        lg.parse_args(["--schemes", "kerple"])


# --------------------------------------------------------------------- dog bites man
@pytest.mark.slow  # a dozen encoders; the same maths is unit-tested in test_attention_properties
def test_dog_bites_man(tmp_path):
    dbm = _load("dog_bites_man")
    res = dbm.run(seed=0, out=tmp_path)
    # Attn(Pi X) == Pi Attn(X) without a mask; a causal mask breaks it
    assert res["single_layer"]["unmasked"]["equivariant"]
    assert res["single_layer"]["unmasked"]["max_abs_diff"] < 1e-5
    assert not res["single_layer"]["causal"]["equivariant"]
    enc = res["encoder"]
    # no positions: the same rows reordered, identical pooled vectors
    assert enc["nope"]["outputs_are_permuted"] and enc["nope"]["pooled_distance"] < 1e-5
    # symmetric -m|i-j| is unchanged by reversal, and "man bites dog" is the reversal
    assert enc["alibi"]["pooled_distance"] < 1e-5
    for name in ("sinusoidal", "learned", "rope", "t5", "shaw"):
        assert enc[name]["pooled_distance"] > 1e-3, name
        assert not enc[name]["outputs_are_permuted"], name
    assert res["decoder_nope"]["1_layer"]["last_logits_max_abs_diff"] < 1e-5
    assert res["decoder_nope"]["2_layer"]["last_logits_max_abs_diff"] > 1e-3
    assert _is_png(tmp_path / "dog_bites_man.png")


# -------------------------------------------------------------------- plot encodings
def test_plot_encodings_numbers_and_pngs(tmp_path):
    pe = _load("plot_encodings")
    r = pe.report()
    # Vaswani et al. §3.5, d = 64: mean_i cos(k omega_i) is 0.43 at k = 64 and 0.28 at
    # k = 1,000 with base 10,000; base 100: both near 0, slowest wavelength
    # 2 pi 100**(1 - 2/64) = 544 positions
    assert round(r["similarity"][10000.0][0], 2) == 0.43
    assert round(r["similarity"][10000.0][1], 2) == 0.28
    assert np.all(np.abs(r["similarity"][100.0]) < 0.05)
    assert abs(r["wavelength"][100.0] - 540) < 10
    # T5 §2.1 (HF's _relative_position_bucket): buckets 8..15 of a direction start at
    # distances 8, 12, 16, 23, 32, 46, 64, 91; causal: 16 exact buckets (distances 0..15)
    assert r["t5_starts"][7:] == [8, 12, 16, 23, 32, 46, 64, 91]
    assert r["t5_causal_starts"][:15] == list(range(1, 16))
    assert r["t5_causal_starts"][15] == 16 and r["t5_causal_starts"][16] > 17
    # Press et al. 2022: 8 heads -> 1/2, 1/4, ..., 1/256
    np.testing.assert_allclose(r["alibi_slopes"], 2.0 ** -np.arange(1, 9))
    # Su et al. §3.4.3 at distance 0: |S_j| = j, mean over j = 1..64 is 32.5; then it decays
    assert r["rope_bound"][0] == pytest.approx(32.5, rel=1e-6)
    assert np.all(np.diff(r["rope_bound"]) < 0)
    paths = pe.save_all(tmp_path)
    assert len(paths) == 6 and all(_is_png(p) for p in paths)
