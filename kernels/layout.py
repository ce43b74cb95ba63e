"""How the kernels see the caller's ``[B, T, N, H]`` arrays on each platform, and the
tile loads and stores that follow from it (no transpose or padding copy of q, k, v, the
output or the gradients; see :mod:`jaxpos.kernels.fused` for the layout rules).

* Triton (CUDA / ROCm): one head of one tile is a strided block of the 4-D array; blocks
  are powers of two, so the feature block is ``next_pow2(max(H, 16))`` wide and every
  load / store is masked on the real rows and columns.
* Interpret mode (CPU): the 4-D array, blocks of the exact width ``H``; rows past ``T`` of
  a last partial tile are zeroed with ``where`` after the load.
* TPU (Mosaic): ``[B, T, N * H]`` (a free reshape) when ``H % 128 == 0``, else a
  ``[B, N, T, H]`` transpose (Mosaic needs the last two block dims aligned to
  ``(8, 128)`` or whole).

With RoPE on load a head's features are read as segments ``(start, width)``: the two
rotated halves and the pass-through rest (Su et al. 2024 §3.4, the ``"half"`` layout).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxpos._util import pow2_at_least

if TYPE_CHECKING:
    from jaxpos.kernels.config import KernelConfig

#: Smallest feature width of a Triton block (Triton dots need K >= 16).
MIN_WIDTH = 16
#: Feature segments ``(start, width)`` of a head.
Segs = tuple[tuple[int, int], ...]


class Plat(NamedTuple):
    """How one platform's kernels see ``[B, T, N, H]`` arrays: ``kind`` is ``"4d"`` (the
    array itself, one head a strided block), ``"flat"`` (``[B, T, N * H]``, TPU with
    ``H % 128 == 0``) or ``"bnth"`` (``[B, N, T, H]``, the TPU fallback); ``masked``:
    Triton, power-of-two feature blocks and masked loads / stores."""

    name: str
    kind: str
    masked: bool


def plat_of(platform: str, cfg: KernelConfig) -> Plat:
    """The layout of ``platform`` (``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``)."""
    if platform == "tpu":
        flat = cfg.H % 128 == 0 and cfg.Hv % 128 == 0
        return Plat(platform, "flat" if flat else "bnth", False)
    return Plat(platform, "4d", platform in ("cuda", "rocm"))


def wb(plat: Plat, w: int) -> int:
    """Block width of a feature segment of width ``w``."""
    return pow2_at_least(w, MIN_WIDTH) if plat.masked else w


def qk_segs(cfg: KernelConfig) -> Segs:
    """Feature segments ``(start, width)`` of q and k: the two RoPE halves and the
    pass-through rest with in-kernel RoPE, else the whole head."""
    if not cfg.rope_half:
        return ((0, cfg.H),)
    r = cfg.rope_half
    return ((0, r), (r, r)) + (((2 * r, cfg.H - 2 * r),) if cfg.H > 2 * r else ())


def v_segs(cfg: KernelConfig) -> Segs:
    """Feature segments of v (the whole head)."""
    return ((0, cfg.Hv),)


def block_width(plat: Plat, segs: Segs, W: int) -> int:
    """The feature width of a token block covering ``segs`` of a ``W``-wide head."""
    if plat.kind != "4d":
        return W
    return pow2_at_least(max(c0 + wb(plat, w) for c0, w in segs), 1) if plat.masked else W


def to_kernel(plat: Plat, x: Any) -> Any:
    """``[B, T, n, W]`` -> this platform's kernel array."""
    if plat.kind == "flat":
        return x.reshape(x.shape[:2] + (-1,))
    if plat.kind == "bnth":
        return jnp.swapaxes(x, 1, 2)
    return x


def from_kernel(plat: Plat, y: Any, n: int) -> Any:
    """This platform's kernel array -> ``[B, T, n, W]``."""
    if plat.kind == "flat":
        return y.reshape(y.shape[:2] + (n, -1))
    if plat.kind == "bnth":
        return jnp.swapaxes(y, 1, 2)
    return y


def token_shape(plat: Plat, B: int, T: int, n: int, W: int) -> tuple[int, ...]:
    """The kernel array shape of a ``[B, T, n, W]`` array."""
    return {"4d": (B, T, n, W), "flat": (B, T, n * W), "bnth": (B, n, T, W)}[plat.kind]


def tok_spec(plat: Plat, rows: Any, heads: int, W: int, Wb: int, imap: Any) -> Any:
    """BlockSpec of ``rows`` tokens of ``heads`` consecutive heads; ``imap(*grid) ->
    (batch, row block, head block)``."""
    hd = None if heads == 1 else heads
    if plat.kind == "4d":
        return pl.BlockSpec((None, rows, hd, Wb), lambda *g: (*imap(*g), 0))
    if plat.kind == "flat":
        return pl.BlockSpec((None, rows, heads * W), lambda *g: imap(*g))

    def bnth(*g):
        b, t, h = imap(*g)
        return b, h, t, 0

    return pl.BlockSpec((None, hd, rows, W), bnth)


def view(ref: Any, plat: Plat, heads: int, hi: int, W: int, rows: Any, c0: int, w: int,
         lead: tuple[Any, ...] = ()) -> Any:
    """Kernel side: the ref view of head ``hi`` (of ``heads`` in the block), ``rows``,
    features ``[c0, c0 + block width)``; ``lead``: indices of leading dims before them (a
    page of a page pool). One indexer (Triton takes no chain of them)."""
    if plat.kind == "flat":
        return ref.at[(*lead, rows, pl.ds(hi * W + c0, w))]
    cols = pl.ds(c0, wb(plat, w))
    if heads == 1:
        return ref.at[(*lead, rows, cols)]
    return ref.at[(*lead, rows, hi, cols)] if plat.kind == "4d" else \
        ref.at[(*lead, hi, rows, cols)]


def _tile_mask(plat, shape, w, row_ok):
    """The mask of a masked (Triton) load / store: real rows and real columns."""
    mask = row_ok
    if plat.masked and shape[-1] != w:
        col = jax.lax.broadcasted_iota(jnp.int32, (1, shape[-1]), 1) < w
        mask = col if mask is None else mask & col
    return None if mask is None else jnp.broadcast_to(mask, shape)


def load(ref_view: Any, plat: Plat, w: int, row_ok: Any) -> Any:
    """Load a tile; rows where ``row_ok`` ([r, 1] bool) is False and columns past ``w`` are
    zero (masked loads on Triton; ``where`` elsewhere)."""
    if plat.masked:
        mask = _tile_mask(plat, ref_view.shape, w, row_ok)
        if mask is None:
            return ref_view[...]
        from jax.experimental.pallas import triton as plgpu

        # float8 (quantised pages): Triton casts no int constant to it, so a typed zero
        fp8 = jnp.issubdtype(ref_view.dtype, jnp.floating) and ref_view.dtype.itemsize == 1
        return plgpu.load(ref_view, mask=mask, other=jnp.zeros((), ref_view.dtype) if fp8 else 0)
    x = ref_view[...]
    if row_ok is not None:
        x = jnp.where(row_ok, x, jnp.zeros((), x.dtype))
    return x


def store(ref_view: Any, plat: Plat, w: int, row_ok: Any, val: Any) -> None:
    """Store a tile (masked on Triton: real rows and columns only)."""
    val = val.astype(ref_view.dtype)
    if plat.masked:
        mask = _tile_mask(plat, ref_view.shape, w, row_ok)
        if mask is not None:
            from jax.experimental.pallas import triton as plgpu

            plgpu.store(ref_view, val, mask=mask)
            return
    ref_view[...] = val


def rows_ok(start: Any, n: int, limit: Any) -> jax.Array:
    """bool ``[n, 1]``: rows ``start + [0, n)`` below ``limit``."""
    return (start + jax.lax.broadcasted_iota(jnp.int32, (n, 1), 0)) < limit


def load_feats(ref: Any, plat: Plat, heads: int, hi: int, W: int, rows: Any, segs: Segs,
               row_ok: Any, tab: Any, lead: tuple[Any, ...] = (),
               dequant: Any = None) -> list[jax.Array]:
    """The feature segments of one head's tile (rotated by ``tab = (cos, sin)`` when
    given), each ``[r, block width]`` in the input dtype (``lead``: as :func:`view`).
    ``dequant = (scale [r, 1] float32, dtype)``: quantised values, multiplied by their
    row's scale in float32 and cast to ``dtype`` before the rotation."""
    xs = [load(view(ref, plat, heads, hi, W, rows, c0, w, lead), plat, w, row_ok)
          for c0, w in segs]
    if dequant is not None:
        xs = [(x.astype(jnp.float32) * dequant[0]).astype(dequant[1]) for x in xs]
    if tab is None:
        return xs
    c, s = tab
    dtype = xs[0].dtype
    x1, x2 = xs[0].astype(jnp.float32), xs[1].astype(jnp.float32)
    return [(x1 * c - x2 * s).astype(dtype), (x2 * c + x1 * s).astype(dtype)] + xs[2:]


def unrotate(gs: Any, tab: Any) -> list[Any]:
    """Gradients with respect to the unrotated features (the rotation's transpose)."""
    if tab is None:
        return gs
    c, s = tab
    g1, g2 = gs[0], gs[1]
    return [g1 * c + g2 * s, g2 * c - g1 * s] + list(gs[2:])


def store_feats(ref: Any, plat: Plat, heads: int, hi: int, W: int, rows: Any, segs: Segs,
                row_ok: Any, vals: Any) -> None:
    """Store the feature segments ``vals`` of one head's tile."""
    for (c0, w), val in zip(segs, vals):
        store(view(ref, plat, heads, hi, W, rows, c0, w), plat, w, row_ok, val)
