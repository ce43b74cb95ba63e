"""The first hour of a new user (issue 13): each rough edge a newcomer met, as a test.

Item numbers are the issue's. README snippets themselves run in ``tests/docs/test_readme.py``.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpos

ROOT = pathlib.Path(__file__).resolve().parents[2]


# ----------------------------------------------------------- 1: lazy subpackages
def test_subpackages_are_attributes_after_a_plain_import():
    # A fresh interpreter: in this one another test may already have imported them.
    code = (
        "import sys, jaxpos\n"
        "assert callable(jaxpos.nnx.DecoderLM) and callable(jaxpos.linen.params_from_nnx)\n"
        "assert callable(jaxpos.testing.assert_equal_under_jit)\n"
        "assert callable(jaxpos.kernels.fused_attention)\n"
        "assert jaxpos.mods is sys.modules['jaxpos.mods']\n"
        "assert {'nnx', 'linen', 'testing', 'kernels', 'mods'} <= set(dir(jaxpos))\n"
        "try:\n"
        "    jaxpos.no_such_thing\n"
        "except AttributeError as e:\n"
        "    assert 'no_such_thing' in str(e)\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


# ------------------------------------------- 2: apply_rope takes rope_frequencies's pair
def _np_rope_half(x, pos, inv_freq, factor=1.0):
    """float64 RoPE, "half" layout (Su et al. 2024, §3.4.2; HF's rotate_half)."""
    x = np.asarray(x, np.float64)
    half = len(inv_freq)
    ang = np.asarray(pos, np.float64)[:, None] * np.asarray(inv_freq, np.float64)[None]
    cos, sin = factor * np.cos(ang)[None, :, None], factor * np.sin(ang)[None, :, None]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * half:]], -1)


def test_apply_rope_accepts_the_pair_rope_frequencies_returns():
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (1, 5, 2, 8)))
    pos = np.arange(5) + 3
    inv_freq = 10000.0 ** (-np.arange(0, 8, 2) / 8)
    out = jaxpos.apply_rope(x, pos, jaxpos.rope_frequencies(8))
    np.testing.assert_allclose(np.asarray(out), _np_rope_half(x, pos, inv_freq), atol=1e-6)


def test_apply_rope_pair_carries_its_attention_factor():
    # YaRN (Peng et al. 2024, §3.4): attention_factor = 0.1 ln(factor) + 1 multiplies cos
    # and sin; taken from the pair, as if passed by hand.
    yarn = jaxpos.YaRNScaling(factor=4.0, original_max_position_embeddings=16)
    inv_freq, factor = jaxpos.rope_frequencies(8, scaling=yarn)
    assert factor == pytest.approx(0.1 * np.log(4.0) + 1)
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (1, 5, 2, 8)))
    pos = np.arange(5)
    out = jaxpos.apply_rope(x, pos, (inv_freq, factor))
    np.testing.assert_allclose(np.asarray(out),
                               _np_rope_half(x, pos, np.asarray(inv_freq), factor), atol=1e-6)
    same = jaxpos.apply_rope(x, pos, (inv_freq, factor), attention_factor=1.0)
    np.testing.assert_array_equal(np.asarray(same), np.asarray(out))
    with pytest.raises(ValueError, match="attention_factor.*twice"):
        jaxpos.apply_rope(x, pos, (inv_freq, factor), attention_factor=2.0)


# --------------------------------------------- 5: learned table exceeded under jit
def test_learned_checked_mode_raises_under_jit():
    from jax.experimental import checkify

    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    f = checkify.checkify(jax.jit(
        lambda t, p: jaxpos.learned_positions(t, p, out_of_range="checked")))
    err, rows = f(table, jnp.array([0, 1, 5, 2]))
    with pytest.raises(Exception, match=r"positions must lie in \[0, 4\).*from 0 to 5"):
        err.throw()
    # Checked by value: a packed sequence longer than the table is fine under jit.
    packed = jnp.array([0, 1, 2, 3, 0, 1])
    err, rows = f(table, packed)
    err.throw()
    np.testing.assert_array_equal(np.asarray(rows), table[np.asarray(packed)])
    # Eagerly, concrete positions raise a ValueError as with "error".
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        jaxpos.learned_positions(table, np.array([0, 4]), out_of_range="checked")


def test_learned_model_past_its_table_under_jit_poisons_only_those_rows():
    from flax import nnx

    model = jaxpos.nnx.DecoderLM(32, d_model=16, num_layers=1, num_heads=2,
                                 position="learned", max_len=8, rngs=nnx.Rngs(0))
    logits = nnx.jit(lambda m, t, p: m(t, positions=p))(
        model, jnp.zeros((1, 6), jnp.int32), jnp.arange(6) + 4)  # positions 4..9, rows 0..7
    bad = np.isnan(np.asarray(logits)).any(-1)[0]
    np.testing.assert_array_equal(bad, [False] * 4 + [True] * 2)


# ------------------------------------------------------- 6: HF config messages
def test_hf_missing_fields_message_does_not_contradict_itself():
    cfg = dict(hidden_size=64, num_attention_heads=4,
               rope_scaling=dict(rope_type="llama3", factor=8.0, rope_theta=500000.0))
    with pytest.raises(ValueError) as info:
        jaxpos.rope_from_hf_config(cfg)
    msg = str(info.value)
    missing = eval(re.search(r"missing (\[.*?\])", msg).group(1))  # noqa: S307 (our message)
    got = eval(re.search(r"got keys (\[.*?\])", msg).group(1))  # noqa: S307
    assert "original_max_position_embeddings" in missing and not set(missing) & set(got), msg


def test_hf_scaling_dict_alone_asks_for_the_whole_config():
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192, rope_theta=500000.0)
    with pytest.raises(ValueError, match="whole model config") as info:
        jaxpos.rope_from_hf_config(scaling)
    assert "head width" not in str(info.value).split(":")[0]
    # The same dict inside a whole config works, and gives Llama 3's frequencies
    # (Meta's llama3 rule: wavelengths above 8192 / 1 divided by 8, below 8192 / 4 kept).
    s = jaxpos.hf.hf_rope_settings(dict(hidden_size=256, num_attention_heads=2,
                                        max_position_embeddings=131072, rope_scaling=scaling))
    assert (s["rotary_dim"], s["base"]) == (128, 500000.0)
    inv = np.asarray(jaxpos.rope_frequencies(128, s["base"], scaling=s["scaling"])[0])
    base = 500000.0 ** (-np.arange(0, 128, 2) / 128)
    wavelen = 2 * np.pi / base
    np.testing.assert_allclose(inv[wavelen < 8192 / 4], base[wavelen < 8192 / 4], rtol=1e-6)
    np.testing.assert_allclose(inv[wavelen > 8192], base[wavelen > 8192] / 8, rtol=1e-6)


# -------------------------------------------------- 7: DeprecationWarnings of jaxpos
def test_params_from_nnx_emits_no_deprecation_warning():
    from flax import nnx

    model = jaxpos.nnx.DecoderLM(16, d_model=8, num_layers=1, num_heads=2, position="rope",
                                 rngs=nnx.Rngs(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        params = jaxpos.linen.params_from_nnx(model)
        grads = nnx.grad(lambda m: m(jnp.zeros((1, 3), jnp.int32)).sum())(model)
        jaxpos.linen.params_from_nnx(grads)
    assert not [w for w in caught if issubclass(w.category, DeprecationWarning)], \
        [str(w.message) for w in caught]
    assert params["blocks_0"]["attn"]["q_proj"]["kernel"].shape == (8, 8)


@pytest.mark.parametrize("module, raises", [
    ("jaxpos.linen", True), ("jaxpos", True), ("examples.models.llama", True),
    ("flax.nnx.statelib", True), ("torch.overrides", False), ("flax.linen.module", False)])
def test_pytest_config_fails_on_deprecation_warnings_of_jaxpos(module, raises):
    # pyproject.toml's filterwarnings: dependencies' DeprecationWarnings are ignored, ours
    # (attributed to a jaxpos or examples module, or from Flax NNX, which warns without a
    # stacklevel) are errors.
    def warn():
        warnings.warn_explicit("old API", DeprecationWarning, "x.py", 1, module=module)

    if raises:
        with pytest.raises(DeprecationWarning):
            warn()
    else:
        warn()


# ---------------------------------------- 10: cite papers and in-repo files only
_FORBIDDEN = re.compile("|".join([
    "DESIGN" + r"\.md", "FACTS" + r"\.md", "course " + "notebook", r"seed[s]? ?0\d\d",
    r"\.\./" + "shared", "shared/" + "seeds", "the seed" + r"s?'", "seed " + "exercise",
    "seed " + "notes"]), re.I)


def test_no_citation_of_files_a_user_does_not_have():
    hits = []
    files = [ROOT / "README.md", ROOT / "pyproject.toml"]
    for folder in ("jaxpos", "kernels", "tests", "examples", "benchmarks", "docs"):
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md")]
    for path in files:
        if path.resolve() == pathlib.Path(__file__).resolve():
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if _FORBIDDEN.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)
