"""Tests of the example scripts: the main job (examples/length_generalization.py) end to end
with tiny settings, its data and evaluation helpers, and the two demonstration scripts.

Expected numbers come from the papers' formulas worked out by hand (sinusoid similarity,
T5 bucket edges, ALiBi slopes), from closed forms (RoPE's bound at distance 0), or from
the mathematics of the argument (permutation equivariance); none is a recorded output.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _load(name: str):
    """Import ``examples/<name>.py`` as a module (the examples are scripts, not a package)."""
    return load_script(EXAMPLES / f"{name}.py", f"_example_{name}")


@pytest.fixture(scope="module")
def lg():
    return _load("length_generalization")


def _is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ the main job, end to end
def test_length_generalization_end_to_end(tmp_path, lg):
    """The script runs with tiny settings on the default corpus (the
    standard library), writes a table, results.json and a PNG, reports learned positions
    past their table as "cannot run", and every finite value is a plausible loss."""
    schemes = ["learned", "rope+yarn" if lg.rope_scaling_available() else "alibi"]
    out = tmp_path / "run"
    cmd = [sys.executable, str(EXAMPLES / "length_generalization.py"),
           "--steps", "30", "--lr", "1e-2", "--train-len", "8", "--eval-lens", "8,16",
           "--d-model", "16", "--layers", "1", "--heads", "2", "--batch-size", "8",
           "--eval-bytes", "32",
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


# ------------------------------------------------------------------- seeds and spread
def _fake_seed(seed, values, status=None):
    """One seed's entry as evaluate() returns it, at lengths 8, 16, 32."""
    keys = ["8", "16", "32"]
    status = status or ["ok"] * 3
    return {"seed": seed, "bits_per_byte": {k: (v if st == "ok" else None)
                                            for k, v, st in zip(keys, values, status)},
            "status": dict(zip(keys, status)), "train_s": 2.0 * (seed + 1), "compile_s": 1.0,
            "num_params": 1000, "eval_s": 0.5, "eval_compile_s": 0.25}


def test_seed_aggregation_is_mean_and_sample_std(lg):
    """Three seeds at 8: 3.0, 3.2, 3.4 -> mean 3.2, std (ddof=1) sqrt(0.08 / 2) = 0.2;
    at 16: 3.1, 3.1, 3.4 -> mean 3.2, std sqrt(0.06 / 2) = 0.17320508...; at 32 one seed
    is not finite, so the cell has no mean and says so."""
    per_seed = [_fake_seed(0, [3.0, 3.1, 3.3], ["ok", "ok", "ok"]),
                _fake_seed(1, [3.2, 3.1, None], ["ok", "ok", "not finite"]),
                _fake_seed(2, [3.4, 3.4, 3.5], ["ok", "ok", "ok"])]
    mean, std, status = lg.aggregate_seeds(per_seed, [8, 16, 32])
    assert mean == {"8": 3.2, "16": 3.2, "32": None}
    assert std == {"8": 0.2, "16": 0.1732, "32": None}
    assert status == {"8": "ok", "16": "ok", "32": "not finite in 1 of 3 seeds"}

    row = lg.summarize_row("alibi", per_seed, [8, 16, 32])
    assert row["seeds"] == [0, 1, 2] and row["per_seed"] == per_seed
    assert row["train_s"] == 4.0  # (2 + 4 + 6) / 3
    assert row["num_params"] == 1000 and row["eval_s"] == 0.5

    # one seed: its own numbers and no spread; a status every seed shares is kept
    mean, std, status = lg.aggregate_seeds([_fake_seed(0, [3.0, 3.1, 3.3])], [8, 16, 32])
    assert mean == {"8": 3.0, "16": 3.1, "32": 3.3} and std == dict.fromkeys(mean)
    cannot = [_fake_seed(s, [3.0, 0, 0], ["ok", "cannot run", "cannot run"]) for s in (0, 1)]
    assert lg.aggregate_seeds(cannot, [8, 16, 32])[2] == {"8": "ok", "16": "cannot run",
                                                          "32": "cannot run"}
    with pytest.raises(ValueError, match="per_seed"):
        lg.aggregate_seeds([], [8])


def _fake_results(rows, lens=(8, 128)):
    """A results dict with rows {name: (means, stds)} at lengths ``lens`` (train_len 8)."""
    schemes = {}
    for name, (means, stds) in rows.items():
        schemes[name] = {"bits_per_byte": {str(L): m for L, m in zip(lens, means)},
                         "std": {str(L): s for L, s in zip(lens, stds)},
                         "status": {str(L): "ok" if m is not None else "not run"
                                    for L, m in zip(lens, means)}}
    return {"config": {"train_len": lens[0], "steps": 3, "d_model": 8, "layers": 1, "seed": 0},
            "eval_lens": list(lens), "seeds": [0, 1, 2], "schemes": schemes}


def test_spread_rule_and_claim_verdicts(lg):
    """|a - b| > 2 * sqrt((sa^2 + sb^2) / 2): at 128, alibi 3.2 +- 0.2 vs rope 3.5 +- 0.1
    gives -0.3 against 2 * sqrt(0.025) = 0.3162 (not beyond the spread); alibi vs
    sinusoidal 4.0 +- 0.1: -0.8 (beyond, alibi lower: the claim matches)."""
    res = _fake_results({"alibi": ((3.25, 3.2), (0.05, 0.2)),
                         "rope": ((3.1, 3.5), (0.02, 0.1)),
                         "sinusoidal": ((3.3, 4.0), (0.1, 0.1)),
                         "fire": ((3.0, 3.9), (0.0, 0.01)),
                         "kerple_log": ((3.0, 3.1), (0.01, None)),
                         "ssmax": ((None, None), (None, None))})
    c = lg.compare_cells(res, "alibi", 128, "rope", 128)
    assert c == {"difference": -0.3, "pooled_std": 0.1581, "exceeds": False}
    c = lg.compare_cells(res, "alibi", 128, "sinusoidal", 128)
    assert c == {"difference": -0.8, "pooled_std": 0.1581, "exceeds": True}
    c = lg.compare_cells(res, "alibi", 128, "alibi", 8)  # sqrt((0.04 + 0.0025) / 2) = 0.1458
    assert c == {"difference": -0.05, "pooled_std": 0.1458, "exceeds": False}
    assert lg.compare_cells(res, "ssmax", 128, "nope", 128) is None
    assert lg.compare_cells(res, "kerple_log", 128, "alibi", 128)["exceeds"] is None

    verdict = lambda a, b, at_a=-1, at_b=-1: lg.judge(lg.Claim("p", "c", a, b, at_a, at_b),
                                                      res)["verdict"]
    assert verdict("alibi", "sinusoidal") == "matches"
    assert verdict("fire", "alibi") == "does not match"  # +0.7 > 2 * 0.1415
    assert verdict("alibi", "rope") == "cannot be told apart"
    assert verdict("alibi", "alibi", -1, 0) == "cannot be told apart"
    assert verdict("kerple_log", "alibi") == "one seed"
    assert verdict("ssmax", "nope") == "not run"
    rows = [[c.strip() for c in line.split("|")[1:-1]]
            for line in lg.format_claims(res).splitlines()]
    assert rows[0][2:] == ["cells (a vs b)", "verdict", "a - b", "2 × pooled std"]
    assert ["alibi 16x vs sinusoidal 16x", "matches", "-0.800", "0.316"] in [r[2:] for r in rows]
    assert ["ssmax 16x vs nope 16x", "not run", "-", "-"] in [r[2:] for r in rows]


def test_ranking_lists_the_rows_inside_the_spread(lg):
    """At 16x: fire 3.1 +- 0.01 and alibi 3.2 +- 0.2 differ by 0.1 <= 2 * 0.1416 (tied);
    rope 3.5 +- 0.1 and alibi by 0.3 <= 2 * 0.1581 (tied); fire and rope by 0.4 > 2 *
    0.0711 (apart); a row without a value is left out."""
    res = _fake_results({"alibi": ((3.25, 3.2), (0.05, 0.2)),
                         "rope": ((3.1, 3.5), (0.02, 0.1)),
                         "fire": ((3.0, 3.1), (0.0, 0.01)),
                         "ssmax": ((None, None), (None, None))})
    rows = [[c.strip() for c in line.split("|")[1:-1]]
            for line in lg.format_ranking(res).splitlines()]
    assert rows[0] == ["scheme", "cannot be told apart at 16x from", "128 (16x)"]
    assert rows[2:] == [["fire", "alibi", "3.100 ± 0.010"],
                        ["alibi", "fire, rope", "3.200 ± 0.200"],
                        ["rope", "alibi", "3.500 ± 0.100"]]


def test_table_shows_mean_and_std(lg):
    res = _fake_results({"alibi": ((3.25, 3.2), (0.05, 0.2)),
                         "ssmax": ((None, None), (None, None))})
    table = lg.format_table(res, timings=False).splitlines()
    assert [c.strip() for c in table[0].split("|")[1:-1]] == ["scheme", "8 (1x)", "128 (16x)"]
    assert table[2] == "| alibi  | 3.250 ± 0.050 | 3.200 ± 0.200 |"
    assert table[3] == "| ssmax  |       not run |       not run |"


def test_drope_row_is_the_rope_model_recalibrated_without_rope(lg):
    # DroPE (arXiv 2512.12167): the row trains as RoPE, is recalibrated as NoPE for
    # --drope-steps steps (default a fifth of --steps) and is evaluated as that model
    assert lg.base_scheme("drope") == "rope" and lg.RECALIBRATED["drope"] == ("rope", "nope")
    args = lg.parse_args(["--schemes", "rope,drope", "--steps", "50"])
    assert args.schemes == ["rope", "drope"] and args.drope_steps == 10
    assert lg.parse_args(["--schemes", "drope", "--drope-steps", "7"]).drope_steps == 7
    with pytest.raises(SystemExit):
        lg.parse_args(["--schemes", "drope", "--drope-steps", "0"])


def test_seeds_preset_and_options_arguments(lg, capsys):
    args = lg.parse_args([])
    assert args.seeds == 1 and args.schemes[:7] == list(lg.BASE_SCHEMES)
    assert args.out == "runs/length_generalization" and args.not_registered == []
    args = lg.parse_args(["--preset", "study"])
    assert args.seeds == 3 and args.schemes == list(lg.STUDY_SCHEMES)
    assert args.out == "runs/study"
    missing = [s for s in lg.STUDY_SCHEMES if "+" not in s and s not in lg.RECALIBRATED
               and s not in lg.registered_positions()]
    assert args.not_registered == missing  # rows reported as "not run"
    args = lg.parse_args(["--preset", "study", "--seeds", "2", "--schemes", "rope,alibi"])
    assert args.seeds == 2 and args.schemes == ["rope", "alibi"]
    args = lg.parse_args(["--schemes", "fire,rope", "--scheme-options", '{"FIRE": {"init_L": 4}}'])
    assert lg.scheme_options_for("fire", args) == {"init_L": 4}
    assert lg.scheme_options_for("rope", args) is None
    assert lg.scheme_options_for("fire", lg.parse_args(["--train-len", "32"])) == {"init_L": 8.0}
    assert lg.parse_args(["--report", "x.json"]).report == "x.json"
    for bad, message in [(["--seeds", "0"], "--seeds must be >= 1"),
                         (["--schemes", "ssmax_typo"], "unknown scheme 'ssmax_typo'"),
                         (["--scheme-options", "{fire}"], "JSON object"),
                         (["--scheme-options", '{"fire": 3}'], "scheme name -> options"),
                         (["--schemes", "rope", "--scheme-options", '{"fire": {}}'],
                          "not one of the rows")]:
        with pytest.raises(SystemExit):
            lg.parse_args(bad)
        assert message in capsys.readouterr().err, bad


@pytest.mark.slow  # about 5 s of CPU time (two compilations, a plot)
def test_seeds_end_to_end_and_resume(tmp_path, lg, capsys):
    """One row, two seeds, three steps: results.json keeps both seeds' numbers, the row is
    their mean and sample std, the plot is written; --resume trains nothing again."""
    argv = ["--schemes", "alibi", "--seeds", "2", "--seed", "1", "--steps", "3",
            "--train-len", "8", "--eval-lens", "8,16", "--d-model", "8", "--layers", "1",
            "--heads", "2", "--batch-size", "4", "--eval-bytes", "32", "--out", str(tmp_path),
            "--no-progress"]
    res = lg.run(lg.parse_args(argv))
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["seeds"] == [1, 2] and saved["schemes"] == res["schemes"]
    row = saved["schemes"]["alibi"]
    assert [e["seed"] for e in row["per_seed"]] == [1, 2]
    for L in ("8", "16"):
        values = np.array([e["bits_per_byte"][L] for e in row["per_seed"]])
        assert values[0] != values[1]  # other initialisation and batches
        assert row["bits_per_byte"][L] == pytest.approx(values.mean(), abs=6e-5)
        assert row["std"][L] == pytest.approx(abs(values[0] - values[1]) / math.sqrt(2),
                                              abs=6e-5)
    assert _is_png(tmp_path / "length_generalization.png")
    assert " ± " in capsys.readouterr().out

    again = lg.run(lg.parse_args(argv + ["--resume"]))
    assert "kept from the previous results.json" in capsys.readouterr().out
    assert again["schemes"] == res["schemes"]


STUDY = ROOT / "docs" / "study" / "results.json"


@pytest.mark.skipif(not STUDY.is_file(), reason="the committed study is not in this checkout")
def test_committed_study_tables_are_generated_from_its_results(lg):
    """The README's table and docs/study.md's tables are the script's own rendering of
    docs/study/results.json (python examples/length_generalization.py --report ...), and
    the committed study has 3 seeds for every row that ran."""
    results = json.loads(STUDY.read_text())
    assert results["seeds"] == [0, 1, 2]
    assert list(results["schemes"]) == list(lg.STUDY_SCHEMES)
    for name, row in results["schemes"].items():
        assert row["seeds"] in ([0, 1, 2], []), name
        assert len(row["per_seed"]) == len(row["seeds"])
    readme = (ROOT / "README.md").read_text()
    study = (ROOT / "docs" / "study.md").read_text()
    assert lg.format_table(results, timings=False) in readme
    assert lg.format_table(results) in study
    assert lg.format_ranking(results) in study
    assert lg.format_claims(results) in study


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
    it one window per row (it is not in PACKED); the scheme's own parameters are trained."""
    import argparse

    import jax
    import jax.numpy as jnp
    from flax import nnx

    assert name in lg.registered_positions()
    args = argparse.Namespace(d_model=16, layers=1, heads=2, train_len=8, seed=0,
                              implementation="reference", t5_max_distance=32)
    model = lg.build_model(name, args)
    if name not in lg.PACKED:
        pos, seg = lg.packed_positions(16, 8)
        x = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, 256)
        with pytest.raises(ValueError, match="positions 0 .. n-1 in order"):
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


# ------------------------------------------------------------------ generation
@pytest.mark.slow
def test_generate_example_samples_a_padded_batch_with_a_streaming_cache(tmp_path):
    """examples/generate.py trains a tiny model, saves it, and generates from prompts of
    different lengths with top-k / top-p sampling and a StreamingLLM cache past its 24
    slots; a second run loads the checkpoint and, greedy, gives each prompt the
    continuation it gets alone (padding changes nothing)."""
    ckpt = tmp_path / "m.npz"
    base = [sys.executable, str(EXAMPLES / "generate.py"), "--no-progress", "--d-model", "32",
            "--layers", "1", "--checkpoint", str(ckpt)]
    proc = subprocess.run(base + ["--train-steps", "3", "--new-tokens", "30", "--max-len", "24",
                                  "--streaming", "2", "--temperature", "0.9", "--top-k", "8",
                                  "--top-p", "0.9"],
                          check=False, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ckpt.is_file() and "tokens/s" in proc.stdout
    assert len([ln for ln in proc.stdout.splitlines() if " -> " in ln]) == 4

    def greedy(prompts):
        args = base + ["--new-tokens", "6", "--max-len", "32"]
        for p in prompts:
            args += ["--prompt", p]
        out = subprocess.run(args, check=True, capture_output=True, text=True, timeout=600,
                             cwd=ROOT)
        return [ln for ln in out.stdout.splitlines() if " -> " in ln]

    together = greedy(["def ", "class JSONDecoder"])
    assert together == greedy(["def "]) + greedy(["class JSONDecoder"])


def test_generate_sampling_keeps_the_top_k_and_the_nucleus():
    """examples/generate.py's sampler: greedy is the argmax; top-k 2 draws only the two most
    likely tokens; top-p 0.7 over probabilities (0.5, 0.3, 0.15, 0.05) keeps tokens 0 and 1
    (the smallest set reaching 0.7, Holtzman et al. 2020) in the ratio 5:3."""
    import jax
    import jax.numpy as jnp

    gen = _load("generate")
    logits = jnp.log(jnp.asarray([[0.05, 0.3, 0.5, 0.15]] * 4000))
    key = jax.random.key(0)
    assert (np.asarray(gen.sample(logits, key, temperature=0.0, top_k=0, top_p=1.0)) == 2).all()
    k2 = np.asarray(gen.sample(logits, key, temperature=1.0, top_k=2, top_p=1.0))
    assert set(k2.tolist()) == {1, 2}
    p7 = np.asarray(gen.sample(logits, key, temperature=1.0, top_k=0, top_p=0.7))
    assert set(p7.tolist()) == {1, 2}
    assert abs((p7 == 2).mean() - 0.5 / 0.8) < 0.03  # 4000 draws: 4 standard deviations
    # tiny but legal settings are the argmax (logits / 1e-45 overflowed; a nucleus of
    # 1e-46 kept no token at all): token 0 was drawn for every row
    for t, p in ((1e-45, 1.0), (1.0, 1e-46), (1e-30, 1e-30)):
        tiny = np.asarray(gen.sample(logits[:8], key, temperature=t, top_k=0, top_p=p))
        assert (tiny == 2).all(), (t, p, tiny)


# Each setting examples/generate.py once mishandled (NUL bytes printed for NaN logits or an
# empty nucleus, random bytes for a negative temperature, a ZeroDivisionError for an empty
# prompt, a token printed for --new-tokens 0, a traceback for an unknown position, no
# --max-len check with --streaming): a one-line usage error, or a run that prints no NUL.
_GENERATE_TINY = ["--no-progress", "--d-model", "16", "--layers", "1", "--train-steps", "0"]
_GENERATE_ERRORS = {
    "streaming prompt past max-len": (["--streaming", "4", "--max-len", "8"],
                                      "--max-len 8 is shorter than the longest prompt"),
    "top-p 0": (["--top-p", "0", "--temperature", "0.8"], r"--top-p must be in \(0, 1\]"),
    "top-p -1": (["--top-p", "-1"], r"--top-p must be in \(0, 1\]"),
    "temperature -1": (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    "temperature nan": (["--temperature", "nan"], "--temperature must be a finite number"),
    "empty prompt": (["--prompt", ""], "--prompt must not be empty"),
    "unknown position": (["--position", "bogus"], "invalid choice: 'bogus'"),
    "negative new tokens": (["--new-tokens", "-1"], "--new-tokens must be >= 0"),
    "keep_first past the cache": (["--streaming", "40", "--max-len", "32"],
                                  r"--streaming KEEP_FIRST must be in \[0, --max-len=32\)"),
    "top-k past the bytes": (["--top-k", "300"], "--top-k must be at most the 256"),
    "heads do not divide": (["--d-model", "18"], "--d-model must be a multiple of the 4"),
    "position without a streaming cache": (["--position", "fox", "--streaming", "4"],
                                           "position='fox' decodes by reading a state kept "
                                           "per text position"),
}


def _one_line_usage_error(err: str, match: str) -> None:
    """argparse's usage then exactly one ``prog: error: ...`` line; no traceback."""
    import re

    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert lines[0].startswith("usage:")
    assert [ln for ln in lines if ": error: " in ln] == [lines[-1]], err
    assert re.search(match, lines[-1]), lines[-1]


@pytest.mark.parametrize("case", [  # FoX builds and traces its model first: about 10 s
    pytest.param(c, marks=pytest.mark.slow) if c == "position without a streaming cache" else c
    for c in _GENERATE_ERRORS])
def test_generate_refuses_bad_settings_with_a_one_line_error(case, capsys):
    """main() of examples/generate.py, in this process (the parser runs before any
    training): exit status 2, a one-line message, nothing on stdout."""
    gen = _load("generate")
    argv, match = _GENERATE_ERRORS[case]
    with pytest.raises(SystemExit) as exit_:
        gen.main(_GENERATE_TINY + argv)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == ""
    _one_line_usage_error(err, match)


def test_generate_with_no_new_tokens_prints_empty_continuations(capsys):
    gen = _load("generate")
    assert gen.main(_GENERATE_TINY + ["--new-tokens", "0", "--prompt", "ab", "--prompt", "c"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[:2] == ["'ab' -> ''", "'c' -> ''"]
    assert "0 tokens" in out and "no decode step to time" in out


@pytest.mark.slow  # five interpreters, two of which compile and decode
@pytest.mark.parametrize("argv, code", [
    (["--streaming", "4", "--max-len", "8"], 2),
    (["--top-p", "0", "--temperature", "0.8"], 2),
    (["--temperature", "-1"], 2),
    (["--prompt", ""], 2),
    (["--position", "bogus"], 2),
    (["--new-tokens", "1", "--prompt", "def "], 0),
    (["--streaming", "2", "--max-len", "20", "--new-tokens", "30", "--temperature", "0.7",
      "--top-p", "0.9", "--top-k", "50"], 0),
])
def test_generate_script_exits_cleanly_and_prints_no_nul_byte(argv, code):
    """The script as a user runs it: exit 0 with no NUL byte (raw or as the escape the
    repr of the text would print), or exit 2 with a one-line usage error."""
    cmd = [sys.executable, str(EXAMPLES / "generate.py")] + _GENERATE_TINY[:-1] + ["3"] + argv
    proc = subprocess.run(cmd, check=False, capture_output=True, timeout=600, cwd=ROOT)
    out, err = proc.stdout, proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == code, err[-3000:]
    assert b"\x00" not in out and b"\\x00" not in out, out
    if code == 2:
        assert out == b""
        _one_line_usage_error(err, ".")
    else:
        assert b"tokens/s" in out or b"no decode step" in out


def test_generate_builds_a_learned_position_model_with_its_max_len():
    """``--position learned`` (offered by --help) needs the table's rows: the script passes
    ``--max-len`` (it refused every run before)."""
    import argparse

    gen = _load("generate")
    args = argparse.Namespace(d_model=16, layers=1, position="learned", max_len=24, seed=0)
    model = gen.build(args)
    assert model.max_len == 24
