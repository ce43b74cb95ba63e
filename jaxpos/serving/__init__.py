"""Serving: a paged KV cache and continuous batching (``docs/serving.md``).

* :mod:`jaxpos.serving.pages`: the host-side :class:`PageAllocator` and
  :func:`write_pages` (the device-side write of new keys and values into the pool);
* :mod:`jaxpos.serving.sampling`: :func:`sample_tokens`, greedy / temperature / top-k /
  top-p per request inside the jitted step;
* :mod:`jaxpos.serving.model`: the :class:`PagedModel` interface the loop drives,
  :class:`ModuleDecoder` (a :class:`jaxpos.nnx.DecoderLM` with its paged cache) and
  :class:`PagedDecoder`, a small functional decoder over pages;
* :mod:`jaxpos.serving.engine`: :class:`ServingEngine`, continuous batching over a fixed
  number of batch slots;
* :mod:`jaxpos.serving.stream`: :class:`StreamEvent` and :class:`TokenStream`, the
  streamed output of :meth:`ServingEngine.stream`, and the stop conditions.
* :mod:`jaxpos.serving.prefix`: :class:`~jaxpos.serving.prefix.PrefixCache`, the pages
  of common prompt prefixes shared between requests (``prefix_caching=True``).

The paged attention call itself is :func:`jaxpos.attention` with ``page_table=``
(:mod:`jaxpos.core.paged`).
"""

from jaxpos.core.paged import gather_pages
from jaxpos.serving.engine import Completion, Request, ServingEngine, ServingStats
from jaxpos.serving.model import ModuleDecoder, PagedDecoder, PagedModel
from jaxpos.serving.pages import PageAllocator, pages_for, write_pages
from jaxpos.serving.sampling import sample_tokens
from jaxpos.serving.stream import StreamEvent, TokenStream

__all__ = ["Completion", "ModuleDecoder", "PageAllocator", "PagedDecoder", "PagedModel", "Request",
           "ServingEngine", "ServingStats", "StreamEvent", "TokenStream", "gather_pages",
           "pages_for", "sample_tokens", "write_pages"]
