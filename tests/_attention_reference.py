"""Scheme fixtures for the attention tests: float64 parameters of NoPE, RoPE, ALiBi, T5
and Shaw, the matching jaxpos objects, and :func:`np_attention`, the float64 contract
reference (``tests/_contract_reference.py``) called with these names.

* RoPE, ``rotate_half`` layout: Su et al. 2024, §3.4.2 (GPT-NeoX/Llama pairing).
* ALiBi: Press et al. 2022, §3: ``slopes[h] * (kv_pos - q_pos)``, slopes ``2**(-8(h+1)/N)``.
* T5: Raffel et al. 2020, §2.1 and Mesh TensorFlow's ``_relative_position_bucket``.
* Shaw et al. 2018, §3 (Eqs. 3-4): ``e = q.(k + a_K[r]) * scale``,
  ``z = sum p (v + a_V[r])``, ``r = clip(kv - q, -K, K)``.
"""

from __future__ import annotations

import numpy as np
from _contract_reference import contract_attention

import jaxpos

SCHEMES = ("nope", "rope", "alibi", "t5", "shaw")


def np_alibi_slopes(n: int) -> np.ndarray:
    """Power-of-two head counts only (the test shapes use 4 heads)."""
    assert n & (n - 1) == 0
    return 2.0 ** (-8.0 * np.arange(1, n + 1) / n)


def make_params(name: str, num_heads: int, head_dim: int, rng: np.random.Generator,
                bidirectional: bool = True) -> dict:
    """Random (but fixed-seed) scheme parameters, float64."""
    if name == "nope":
        return {}
    if name == "rope":
        rd = head_dim // 2 if head_dim >= 8 else head_dim  # partial rotation when it can
        return {"inv_freq": 10000.0 ** (-np.arange(0, rd, 2) / rd)}
    if name == "alibi":
        return {"slopes": np_alibi_slopes(num_heads), "bidirectional": bidirectional}
    if name == "t5":
        return {"table": rng.normal(size=(32, num_heads)), "bidirectional": bidirectional}
    if name == "shaw":
        return {"rel_k": 0.5 * rng.normal(size=(7, head_dim)),
                "rel_v": 0.5 * rng.normal(size=(7, head_dim))}
    raise ValueError(name)


def make_scheme(name: str, params: dict):
    f32 = lambda x: np.asarray(x, np.float32)
    if name == "nope":
        return jaxpos.NoPE()
    if name == "rope":
        return jaxpos.RoPE(f32(params["inv_freq"]))
    if name == "alibi":
        return jaxpos.ALiBi(slopes=f32(params["slopes"]), bidirectional=params["bidirectional"])
    if name == "t5":
        return jaxpos.T5Bias(f32(params["table"]), bidirectional=params["bidirectional"])
    if name == "shaw":
        return jaxpos.Shaw(f32(params["rel_k"]), f32(params["rel_v"]))
    raise ValueError(name)


def np_attention(q, k, v, *, name="nope", params=None, **kw):
    """float64 ``[B, Tq, N, H_v]``: the tests' one dense reference
    (:func:`_contract_reference.contract_attention`) with this module's scheme names and
    parameters; keywords (positions, ``causal``, a dense bool ``mask``, segment ids,
    ``scale``) as there. A query row with no visible key gives zeros."""
    return contract_attention(q, k, v, scheme="none" if name == "nope" else name,
                              params=params, **kw)
