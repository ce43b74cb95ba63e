"""The README's "Usage" code runs as written and gives the documented shapes."""

from __future__ import annotations

import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def test_usage_section_runs():
    code = "\n".join(re.findall(r"```python\n(.*?)```", _section("Usage"), re.S))
    assert "jaxpos.attention" in code
    env: dict = {}
    exec(compile(code, "README.md#usage", "exec"), env)
    out = np.asarray(env["out"])
    assert out.shape == (2, 128, 8, 64) and np.isfinite(out).all()
    # Zero Shaw tables reduce to plain attention: the shifted positions change nothing.
    import jaxpos

    plain = jaxpos.attention(env["q"], env["k"], env["v"], implementation="reference")
    np.testing.assert_allclose(out, np.asarray(plain), atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(np.asarray(env["slopes"])[:8], 2.0 ** -np.arange(1, 9))
    assert env["pe"].shape == (128, 512)
