"""The package as a user meets it: subpackages are attributes after a plain
``import jaxpos``; jaxpos emits no DeprecationWarning and the pytest configuration turns
one attributed to jaxpos into a failure; code, docs and tests cite papers, public code
and in-repo files only. README snippets run in ``tests/docs/test_readme.py``.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import warnings

import jax.numpy as jnp
import pytest

import jaxpos

ROOT = pathlib.Path(__file__).resolve().parents[2]


# ------------------------------------------------------------- what gets installed
def test_every_subpackage_is_listed_for_installation():
    """A non-editable install copies only the packages pyproject.toml lists: a new
    subpackage of jaxpos/ (or of kernels/, installed as jaxpos.kernels) must be listed."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {"jaxpos"} | {"jaxpos." + str(p.parent.relative_to(ROOT / "jaxpos")).replace("/", ".")
                          for p in (ROOT / "jaxpos").glob("*/**/__init__.py")}
    found |= {"jaxpos.kernels." + str(p.parent.relative_to(ROOT / "kernels")).replace("/", ".")
              for p in (ROOT / "kernels").glob("*/**/__init__.py")} | {"jaxpos.kernels"}
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"


# ------------------------------------------------------------- the top-level kernels/ folder
def _run_from_root(code: str, *path: str) -> subprocess.CompletedProcess:
    """``python -c code`` from the repository root (the current directory first on
    ``sys.path``, as for a user who runs the docs' snippets there), ``path`` prepended."""
    prelude = f"import sys; sys.path[:0] = {list(path)!r}\n"
    return subprocess.run([sys.executable, "-c", prelude + code], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_repository_root_does_not_shadow_the_pypi_kernels_package():
    """transformers >= 5.25 imports the PyPI package ``kernels``; from the repository root
    the folder ``kernels/`` (our ``jaxpos.kernels``) must not stand in for it."""
    pytest.importorskip("transformers")
    pytest.importorskip("kernels")  # from site-packages: this test runs with tests/ first
    code = ("import kernels, transformers\n"
            "from transformers.integrations import hub_kernels\n"
            "transformers.LlamaConfig(); transformers.LlamaForCausalLM\n"
            "import jaxpos.kernels\n"
            "print(kernels.__file__); print(jaxpos.kernels.__file__)\n")
    done = _run_from_root(code, str(ROOT))
    assert done.returncode == 0, done.stderr[-2000:]
    pypi, ours = done.stdout.split()
    assert pathlib.Path(pypi).parent != ROOT / "kernels"
    assert pathlib.Path(ours).parent == ROOT / "kernels"


def test_top_level_kernels_import_without_the_pypi_package_is_not_found():
    """With no installed ``kernels`` on the path, ``import kernels`` from the root fails as
    for any missing module instead of importing ``jaxpos.kernels`` under a second name."""
    code = ("import sys\n"
            "sys.path[:] = [p for p in sys.path if 'site-packages' not in p]\n"
            "try:\n    import kernels\nexcept ModuleNotFoundError as e:\n    print(e.name)\n"
            "else:\n    print('imported', kernels.__file__)\n"
            "print('kernels' in sys.modules)\n")
    done = _run_from_root(code, str(ROOT))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["kernels", "False"]


# ------------------------------------------------------------- lazy subpackages
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


# ---------------------------------------------------- DeprecationWarnings of jaxpos
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


# ------------------------------------------ cite papers and in-repo files only
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
