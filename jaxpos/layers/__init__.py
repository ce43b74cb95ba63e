"""The code behind :mod:`jaxpos.nnx` and :mod:`jaxpos.linen`, split by layer.

* :mod:`jaxpos.layers.spec`: the modules' options declared once (dataclasses that the NNX
  constructors take as keywords and the Linen twins inherit as fields), their checks and
  the one description of each layer's parameters, built by each twin's constructors.
* :mod:`jaxpos.layers.options`: position names, scheme options and the checks of module
  arguments; building a scheme from the registry (``init_params`` / ``from_params``).
* :mod:`jaxpos.layers.functional`: pure functions of the model math (embeddings,
  projections, RMSNorm, MLP, logits) on plain arrays.
* :mod:`jaxpos.layers.cache`: the KV caches behind one protocol
  (:class:`~jaxpos.layers.cache.Cache`): the dense :class:`~jaxpos.layers.cache.KVCache`
  and the StreamingLLM :class:`~jaxpos.layers.cache.StreamingKVCache`, one file each.
* :mod:`jaxpos.layers.cores`: the ``*Core`` classes, the computations of the modules,
  inherited by the NNX classes and their Linen twins (which only declare parameters): a
  layer's in :mod:`~jaxpos.layers.cores.layer`, a stack's in
  :mod:`~jaxpos.layers.cores.stacks`.
* :mod:`jaxpos.layers.stack`: where a stack's scheme lives and the one builder of a
  stack's submodules, called by the NNX and the Linen stacks with their constructors.
* :mod:`jaxpos.layers.nnx_positions` / :mod:`jaxpos.layers.linen_positions`: the NNX
  position modules and their Linen twins (exported by :mod:`jaxpos.nnx` /
  :mod:`jaxpos.linen`).

Nothing here but the position modules is Flax-specific except reading a parameter
(:func:`cores.param_value`).
"""
