"""Pallas kernels for jaxpos (installed as ``jaxpos.kernels``).

* :func:`attention_via_kernel`: the fused, programmable attention kernel
  (``jaxpos.attention(..., implementation="pallas")``): score_mod / mask_mod traced inside
  the kernel, block-sparse tile skipping, attention sinks; forward and backward.
* :func:`attention_via_xla`: ``jax.nn.dot_product_attention`` (cuDNN on NVIDIA GPUs) with
  jaxpos's semantics (``implementation="xla"``); lives in :mod:`jaxpos.core.xla`, re-exported.
* :func:`choose_implementation`: the dispatch rule behind ``implementation=None``.
* :func:`fused_attention`: the kernel with RoPE / ALiBi / an offset bias given as arrays.
* :func:`supports_scheme`: the scheme protocol's ``fusable``.

``docs/kernel.md`` describes the design and the measurements behind the dispatch rule.
"""

__all__ = [
    "DEFAULT_BLOCK_K",
    "DEFAULT_BLOCK_Q",
    "DENSE_BIAS_BUDGET_BYTES",
    "alibi_score_mod",
    "attention_via_kernel",
    "attention_via_xla",
    "choose_implementation",
    "fused_attention",
    "offset_bias_score_mod",
    "supports_scheme",
]

if __name__ != "jaxpos.kernels":  # pragma: no cover - runs only when misimported
    # This folder is the package ``jaxpos.kernels`` (see pyproject.toml's package-dir). From
    # the repository root (the current directory on ``sys.path``: ``python -c``, ``python -m
    # pytest``, a test that puts the root on the path to import ``examples``) a plain
    # ``import kernels`` would find it first and shadow the PyPI package ``kernels`` that
    # transformers imports. So a folder imported under any other name steps aside: the
    # search goes on as if the repository root were not on the path, and ``import kernels``
    # gives the installed package or ``ModuleNotFoundError``, never this folder.
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _path = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _root]
    _spec = _machinery.PathFinder.find_spec(__name__, _path)
    if _spec is None or _spec.loader is None:
        del _sys.modules[__name__]
        raise ModuleNotFoundError(f"No module named {__name__!r}", name=__name__)
    _module = _util.module_from_spec(_spec)
    _sys.modules[__name__] = _module  # the import statement returns this entry
    _spec.loader.exec_module(_module)
else:
    from jaxpos.core.xla import attention_via_xla
    from jaxpos.kernels.config import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q
    from jaxpos.kernels.convenience import alibi_score_mod, fused_attention, offset_bias_score_mod
    from jaxpos.kernels.dispatch import (
        DENSE_BIAS_BUDGET_BYTES,
        attention_via_kernel,
        choose_implementation,
        supports_scheme,
    )
