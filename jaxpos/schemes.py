"""The built-in scheme classes under one name (each is defined in its own module:
:mod:`jaxpos.rope`, :mod:`jaxpos.alibi`, :mod:`jaxpos.t5`, :mod:`jaxpos.shaw`; the protocol
is :mod:`jaxpos.scheme`). Kept so ``from jaxpos.schemes import RoPE`` goes on working."""

from jaxpos.alibi import ALiBi
from jaxpos.rope import RoPE
from jaxpos.scheme import NoPE, PositionScheme, as_scheme
from jaxpos.shaw import Shaw
from jaxpos.t5 import T5Bias

__all__ = ["ALiBi", "NoPE", "PositionScheme", "RoPE", "Shaw", "T5Bias", "as_scheme"]
