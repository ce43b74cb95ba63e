"""Position schemes: one module per scheme (the protocol in :mod:`jaxpos.schemes.base`)."""
