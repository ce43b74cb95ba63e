"""Every ```python block of README.md, examples/README.md and the docs pages (docs/**/*.md)
runs as written, on its own; the README stays a front page and every docs page is on the
site's navigation. A ```py fence is highlighted but not run: use it for a signature.

Blocks are collected from the files at test time, so a new section is tested as soon as
it is written. Each block runs in a fresh namespace (no block may rely on another), with
the repository root on ``sys.path`` (the example models live in ``examples/``, which is
not installed) and a temporary working directory. A block that imports torch,
transformers or ``examples.models`` is a parity test (``-m parity``), skipped without the
``parity`` extra; one that imports optax, matplotlib or tqdm is skipped without the
``examples`` extra.

Some blocks are followed by checks of what they compute (``CHECKS``), against the
mathematics rather than a stored output: zero Shaw tables change nothing, a KV-cache
greedy continuation equals the full forward pass, left padding changes nothing, the
Llama port matches Hugging Face.
"""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ("README.md", "examples/README.md",
        *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")))
_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
_PARITY = re.compile(r"^\s*(import|from)\s+(torch|transformers|examples)\b", re.M)
_EXTRAS = ("optax", "matplotlib", "tqdm")


def python_blocks(doc: str) -> list[tuple[str, str]]:
    """``(id, code)`` for every ```python fence of ``doc``; id is ``file:line``."""
    text = (ROOT / doc).read_text()
    return [(f"{doc}:{text.count(chr(10), 0, m.start()) + 1}", m.group(1))
            for m in _FENCE.finditer(text)]


BLOCKS = [b for doc in DOCS for b in python_blocks(doc)]


# Blocks that compile a training step or build a PyTorch model took 25-30 s each on 2
# shared cores: marked slow (tests/modules/test_nnx.py and tests/parity/test_parity_models.py
# cover the same computations at smaller cost).
SLOW = ("model = llama.from_hf(", "loss = train_step(model, optimizer, tokens)")


def _params():
    for block_id, code in BLOCKS:
        marks = [pytest.mark.parity] if _PARITY.search(code) else []
        if any(key in code for key in SLOW):
            marks.append(pytest.mark.slow)
        yield pytest.param(block_id, code, marks=marks, id=block_id)


# ------------------------------------------------ checks after particular blocks
def _check_usage(env):
    out = np.asarray(env["out"])
    assert out.shape == (2, 128, 8, 64) and np.isfinite(out).all()


def _check_t5_shaw(env):
    # Zero Shaw tables reduce to plain attention: the shifted positions change nothing.
    import jaxpos

    plain = jaxpos.attention(env["q"], env["k"], env["v"], implementation="reference")
    np.testing.assert_allclose(np.asarray(env["out"]), np.asarray(plain), atol=2e-5, rtol=2e-5)
    # Press et al. 2022, §3: 12 heads start with the 8-head slopes 1/2 .. 1/256.
    np.testing.assert_array_equal(np.asarray(env["slopes"])[:8], 2.0 ** -np.arange(1, 9))
    assert env["pe"].shape == (128, 512)
    buckets = np.asarray(env["buckets"])  # T5 §2.1: 32 buckets, 0 for offset 0
    assert buckets.min() >= 0 and buckets.max() < 32 and buckets[200] == 0


def _check_decoder(env):
    assert np.isfinite(float(env["loss"]))
    assert env["logits"].shape == (8, 1, 256)


def _check_generation(env):
    # KV-cache decoding equals the full pass: greedy tokens from one forward pass over
    # the prompt and the continuation (but its last token) are the continuation.
    import jax.numpy as jnp
    from flax import nnx

    cont = np.asarray(env["continuation"])
    assert cont.shape == (8, 16)
    full = nnx.jit(lambda m, t: m(t))(
        env["model"], jnp.concatenate([env["prompt"], env["continuation"][:, :-1]], axis=1))
    np.testing.assert_array_equal(np.asarray(full[:, 15:].argmax(-1)), cont)


def _check_llama_layer(env):
    # Left padding changes nothing: row 0's five real tokens alone, at positions 0..4.
    import jax.numpy as jnp

    y = np.asarray(env["y"])
    assert y.shape == (2, 8, 64) and np.isfinite(y).all()
    alone = env["layer"](env["x"][:1, 3:], env["rope"], jnp.arange(5)[None],
                         segments=jnp.ones((1, 5), jnp.int32))
    np.testing.assert_allclose(y[0, 3:], np.asarray(alone[0]), atol=1e-5)


def _check_llama_hf(env):
    diff = np.abs(np.asarray(env["logits"]) - env["ref"])[env["mask"] > 0].max()
    assert diff < 1e-4, diff


CHECKS = {  # a line that identifies the block -> the check run after it
    "out = jax.jit(jaxpos.attention": _check_usage,
    "shaw = jaxpos.Shaw(": _check_t5_shaw,
    "loss = train_step(model, optimizer, tokens)": _check_decoder,
    "continuation = jnp.concatenate(generated": _check_generation,
    "class Attention(nnx.Module):": _check_llama_layer,
    "model = llama.from_hf(": _check_llama_hf,
}


def test_blocks_are_found():
    ids = [b for b, _ in BLOCKS]
    assert len(ids) >= 6, ids
    for key in CHECKS:  # every check still has its block
        assert any(key in code for _, code in BLOCKS), f"no documented block contains {key!r}"


@pytest.mark.parametrize("block_id, code", list(_params()))
def test_python_block_runs(block_id, code, monkeypatch, tmp_path):
    if _PARITY.search(code):
        pytest.importorskip("torch")
        pytest.importorskip("transformers")
    for extra in _EXTRAS:
        if re.search(rf"^\s*(import|from)\s+{extra}\b|^\s*import .*\b{extra}\b", code, re.M):
            pytest.importorskip(extra)
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.chdir(tmp_path)
    env: dict = {"__name__": "__readme__"}
    exec(compile(code, block_id, "exec"), env)  # noqa: S102 (our own README)
    for key, check in CHECKS.items():
        if key in code:
            check(env)


# ------------------------------------------------ example options = their --help
def _readme_options():
    for extra in _EXTRAS:
        pytest.importorskip(extra)
    import importlib.util

    spec = importlib.util.spec_from_file_location("_readme_options",
                                                  ROOT / "examples" / "readme_options.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_examples_readme_option_tables_match_the_parsers():
    ro = _readme_options()
    text = (ROOT / "examples" / "README.md").read_text()
    scripts = [m.group("script") for m in ro._BLOCK.finditer(text)]
    assert sorted(scripts) == sorted(ro.SCRIPTS), scripts  # one table per script
    assert text == ro.render(text), (
        "examples/README.md's option tables differ from the scripts' parsers; run "
        "python examples/readme_options.py --write")


def test_main_job_page_lists_every_option_of_the_main_job():
    ro = _readme_options()
    parser = ro.parser_of("length_generalization.py")
    flags = {s for a in parser._actions for s in a.option_strings if s.startswith("--")}
    flags -= {"--help"}
    text = (ROOT / "docs" / "length_generalization.md").read_text()
    paragraph = text[text.index("\nOptions ("):]
    paragraph = paragraph[:paragraph.index("Outputs:")]
    assert set(re.findall(r"`(--[a-z0-9-]+)", paragraph)) == flags


# ------------------------------------------------ the README is a front page; the site
def test_readme_is_a_front_page_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    lines = text.count("\n")
    assert lines <= 260, f"README.md has {lines} lines; move the detail to a docs/ page"
    for marker in ("<!-- main-command -->\n```bash\n", "<!-- test-command -->\n```bash\n"):
        assert marker in text, marker
    # every docs page the README links to exists
    for target in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / target).exists(), target


def test_every_docs_page_is_in_the_site_navigation():
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:", 1)[1]
    listed = set(re.findall(r"([\w/.-]+\.md)\s*$", nav, re.M))
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert pages <= listed, f"docs pages missing from mkdocs.yml's nav: {sorted(pages - listed)}"
    assert listed <= pages, f"nav entries without a page: {sorted(listed - pages)}"
