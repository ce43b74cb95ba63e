"""KERPLE, FIRE, Sandwich, xPos, FoX, SSMax and PoPE in the fused kernel lower for GPU and
TPU: export ``jaxpos.attention(..., implementation="pallas")`` forward and backward (gradients with
respect to the scheme's arrays and q, k, v) on this CPU machine.

``jax.export.export(..., platforms=[...])`` runs the Pallas lowering for the target
without the hardware (Pallas Triton for ``cuda``, Mosaic for ``tpu``), so a score_mod
construct either compiler rejects fails here; see tests/kernels/test_lowering.py for the
kernel's own exports. Lowering only: running on the hardware is not claimed. Block
shapes are the kernel's defaults, with a length of 192 so the padding path is lowered.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxpos
from jaxpos.schemes.fire import FIRE
from jaxpos.schemes.fox import FoX
from jaxpos.schemes.kerple import KERPLELog, KERPLEPower
from jaxpos.schemes.pope import PoPE
from jaxpos.schemes.sandwich import Sandwich
from jaxpos.schemes.ssmax import SSMax
from jaxpos.schemes.xpos import XPos

B, T, N, H = 1, 192, 4, 128
_TRITON_CALL = "__gpu$xla.gpu.triton"
_KEY = jax.random.PRNGKey(0)
SCHEMES = {
    "kerple_log": lambda: KERPLELog.init(N, key=_KEY),
    "kerple_power": lambda: KERPLEPower.init(N, key=_KEY),
    "fire": lambda: FIRE.init(N, key=_KEY),
    "sandwich": lambda: Sandwich(N),
    "xpos": lambda: XPos(H),
    "fox": lambda: FoX(jnp.zeros((B, T, N))),
    "ssmax": lambda: SSMax(jnp.full((N,), 0.4)),
    "pope": lambda: PoPE(H, phase_bias=jnp.full((N, H), -0.5)),
}


def _export(fn, args, platform):
    checks = [jax.export.DisabledSafetyCheck.custom_call(_TRITON_CALL)]
    exp = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(*args)
    return exp.mlir_module()


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("name", list(SCHEMES))
def test_scheme_lowers_in_the_kernel(name, platform):
    def fwd(s, q, k, v):
        return jaxpos.attention(q, k, v, position=s, causal=True, implementation="pallas")

    bwd = jax.grad(lambda *a: jnp.sum(fwd(*a)), argnums=(0, 1, 2, 3))
    sds = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
    args = (SCHEMES[name](), sds, sds, sds)
    marker = "tpu_custom_call" if platform == "tpu" else "xla.gpu.triton"
    assert _export(fwd, args, platform).count(marker) >= 1
    # backward: the forward kernel (residuals) and the dq and dk/dv kernels
    assert _export(bwd, args, platform).count(marker) >= 3
