"""Pallas kernels for jaxpos (installed as ``jaxpos.kernels``)."""
