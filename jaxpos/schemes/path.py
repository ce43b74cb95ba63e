"""PaTH as a position name of the Flax modules: ``position="path"`` and ``"path_fox"``
(Yang et al. 2025, "PaTH Attention: Position Encoding via Accumulating Householder
Transformations", NeurIPS, arXiv:2505.16381, §3; the attention itself is
:func:`jaxpos.core.path.path_attention`, which registers itself as these schemes'
attention).

The layer computes each token's transform ``H_t = I - beta_t w_t w_t^T`` from its input
``x_t`` with the paper's parameterisation (§3.1 and the authors' layer,
flash-linear-attention ``fla/layers/path_attn.py``):

* ``w_t = l2_normalise(silu(short_causal_conv(x W_down W_up)))`` per key/value head: a
  low-rank projection (rank ``path_rank``, default 32, capped at ``d_model``), a
  depthwise causal convolution of width ``path_conv_size`` (default 3) without bias, SiLU,
  and an L2 norm (``eps = 1e-6``);
* ``beta_t = 2 * sigmoid(x_t W_beta + b_beta)`` in ``(0, 2)``, so the transform may have
  a negative eigenvalue (§3.1);
* PaTH-FoX (``"path_fox"``, §3.3) adds FoX's forget gate ``log f_t = log_sigmoid(x_t W_f +
  b_f)`` per query head (:func:`jaxpos.schemes.fox.forget_gate`).

The convolution restarts at every segment boundary (packed sequences and the modules'
padding, which they pass as segment ids), as the authors' varlen convolution does.
The layer's keys and values may have fewer heads than its queries: set the scheme option
``num_kv_heads`` to the layer's (default: the number of query heads).

KV-cache decoding follows the paper's inference rule (§3.2): the caches the modules'
``init_cache`` make for a PaTH layer carry its decode state (:meth:`PaTH.init_decode_state`:
the convolution's last ``K - 1`` inputs per row and, for PaTH-FoX, the cumulative forget
gates), and each step moves every cached key by the new tokens' transforms
(:mod:`jaxpos.layers.cache.path`, :mod:`jaxpos.core.path_decode`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos.schemes.base import PositionScheme, register
from jaxpos.schemes.fox import forget_gate

__all__ = ["PaTH", "PaTHFoX", "l2_normalise", "short_causal_conv"]


def short_causal_conv(u: ArrayLike, kernel: ArrayLike,
                      segment_ids: ArrayLike | None = None) -> jax.Array:
    """A depthwise causal convolution: ``out_t = sum_m kernel[m] * u_{t - K + 1 + m}``
    over the taps in ``t``'s segment (zero before a segment's first token), as the
    short convolution of flash-linear-attention's ``ShortConvolution`` (no activation).

    Args:
      u: float ``[B, T, C]``; kernel: float ``[K, C]``.
      segment_ids: int ``[B, T]`` or None (one segment).

    Returns:
      float32 ``[B, T, C]``.
    """
    u = jnp.asarray(u, jnp.float32)
    kernel = jnp.asarray(kernel, jnp.float32)
    K, T = kernel.shape[0], u.shape[1]
    out = jnp.zeros_like(u)
    for m in range(K):
        shift = K - 1 - m
        if shift >= T:
            continue
        tap = jnp.pad(u, ((0, 0), (shift, 0), (0, 0)))[:, :T]
        if segment_ids is not None and shift:
            seg = jnp.asarray(segment_ids)
            same = jnp.pad(seg, ((0, 0), (shift, 0)), constant_values=-1)[:, :T] == seg
            tap = jnp.where(same[..., None], tap, 0.0)
        out = out + kernel[m] * tap
    return out


def l2_normalise(x: ArrayLike, eps: float = 1e-6) -> jax.Array:
    """``x / sqrt(sum(x^2) + eps)`` along the last axis (flash-linear-attention's
    ``l2_norm``), in float32."""
    x = jnp.asarray(x, jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + eps)


def _dense(key, shape, dtype, std=0.02):
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


@register("path")
class PaTH(PositionScheme):
    """PaTH attention for the Flax modules (``DecoderLM(position="path")``): the layer runs
    :func:`jaxpos.core.path.path_attention` with transforms computed from its input.

    Fields (one call's, from :meth:`from_params`): ``u`` float32 ``[B, T, N_kv * H]`` the
    low-rank projection of ``x`` before the convolution, ``conv`` ``[K, N_kv * H]``, ``beta``
    float32 ``[B, T, N_kv]``, ``log_forget`` float32 ``[B, T, N]`` or None (PaTH-FoX).

    ``replaces_softmax`` tells the modules to call :meth:`attention` (the engine registered
    for ``"path"`` and ``"path_fox"``, :func:`jaxpos.core.path.scheme_attention`) instead of
    :func:`jaxpos.attention` (which refuses the scheme: :meth:`transform_qk` raises).

    Raises:
      ValueError: a non-causal layer; a cache without PaTH's decode state
        (:meth:`cache_write`); a layer whose key heads differ from the option
        ``num_kv_heads``.
    """

    reads_token_order = True  # the short causal convolution runs in token order


    u: jax.Array
    conv: jax.Array
    beta: jax.Array
    log_forget: jax.Array | None
    num_kv_heads: int

    _children = ("u", "conv", "beta", "log_forget")
    _static = ("num_kv_heads",)
    replaces_softmax = True
    params_per_layer = True
    #: PaTH-FoX adds the forget gate (the ``"path_fox"`` subclass).
    forget = False

    def __init__(self, u: ArrayLike, conv: ArrayLike, beta: ArrayLike,
                 log_forget: ArrayLike | None = None, *, num_kv_heads: int):
        self._set(u=u, conv=conv, beta=beta, log_forget=log_forget,
                  num_kv_heads=int(num_kv_heads))

    @staticmethod
    def _sizes(num_heads, head_dim, d_model, options):
        nk = options.get("num_kv_heads")
        nk = num_heads if nk is None else _checks.check_positive_int("num_kv_heads", nk)
        rank = options.get("path_rank")
        rank = min(32, d_model) if rank is None else _checks.check_positive_int("path_rank",
                                                                                rank)
        K = options.get("path_conv_size")
        K = 3 if K is None else _checks.check_positive_int("path_conv_size", K)
        return nk, rank, K

    #: Logical axis names of the parameters (:mod:`jaxpos.sharding`).
    param_axes = {"w_down": ("embed", "rank"), "w_up": ("rank", "kv_heads"),
                  "conv": ("taps", "kv_heads"), "beta_w": ("embed", "kv_heads"),
                  "beta_b": ("kv_heads",), "forget_w": ("embed", "heads"),
                  "forget_b": ("heads",)}

    @classmethod
    def init_params(cls, key: jax.Array, *, num_heads: int, head_dim: int, d_model: int,
                    param_dtype=jnp.float32, options: dict, **_) -> dict:
        """``w_down [D, r]``, ``w_up [r, N_kv * H]`` (``N(0, 0.02^2)``), ``conv [K, N_kv *
        H]`` (``U(-1/sqrt(K), 1/sqrt(K))``, PyTorch's ``Conv1d`` default), ``beta_w [D,
        N_kv]`` (``N(0, 0.02^2)``), ``beta_b [N_kv]`` (0: ``beta = 1`` at the start) and,
        for PaTH-FoX, ``forget_w [D, N]``, ``forget_b [N]`` (as FoX's). Options
        ``num_kv_heads``, ``path_rank`` (32), ``path_conv_size`` (3)."""
        nk, rank, K = cls._sizes(num_heads, head_dim, d_model, options)
        ks = jax.random.split(key, 5)
        width = nk * head_dim
        bound = 1.0 / float(np.sqrt(K))
        params = {
            "w_down": _dense(ks[0], (d_model, rank), param_dtype),
            "w_up": _dense(ks[1], (rank, width), param_dtype),
            "conv": jax.random.uniform(ks[2], (K, width), jnp.float32, -bound,
                                       bound).astype(param_dtype),
            "beta_w": _dense(ks[3], (d_model, nk), param_dtype),
            "beta_b": jnp.zeros((nk,), param_dtype),
        }
        if cls.forget:
            params["forget_w"] = _dense(ks[4], (d_model, num_heads), param_dtype)
            params["forget_b"] = jnp.zeros((num_heads,), param_dtype)
        return params

    @classmethod
    def from_params(cls, params: dict, *, num_heads: int, head_dim: int, options: dict,
                    x: jax.Array | None = None, **_) -> PositionScheme:
        """The scheme of one call from the layer's input ``x`` ``[B, T, D]``.

        Raises:
          ValueError: no ``x``.
        """
        nk, _, _ = cls._sizes(num_heads, head_dim, 1, options)
        if x is None:
            raise ValueError(f"{cls.__name__} computes its transforms from the layer's "
                             f"input; from_params got x=None.")
        xf = jnp.asarray(x, jnp.float32)
        u = xf @ jnp.asarray(params["w_down"], jnp.float32) @ jnp.asarray(params["w_up"],
                                                                            jnp.float32)
        beta = 2.0 * jax.nn.sigmoid(xf @ jnp.asarray(params["beta_w"], jnp.float32) +
                                    jnp.asarray(params["beta_b"], jnp.float32))
        lf = forget_gate(xf, params["forget_w"], params["forget_b"]) if cls.forget else None
        return cls(u, jnp.asarray(params["conv"], jnp.float32), beta, lf, num_kv_heads=nk)

    def directions(self, segment_ids: ArrayLike | None = None) -> jax.Array:
        """``w`` float32 ``[B, T, N_kv, H]``: the L2-normalised SiLU of the short causal
        convolution of ``u`` (restarting at segment boundaries)."""
        B, T, width = self.u.shape
        w = jax.nn.silu(short_causal_conv(self.u, self.conv, segment_ids))
        return l2_normalise(w.reshape(B, T, self.num_kv_heads, width // self.num_kv_heads))

    def decode_directions(self, tail: jax.Array, mask: jax.Array
                          ) -> tuple[jax.Array, jax.Array]:
        """``w`` of a decode step's new tokens and the convolution's next tail.

        The convolution of a new token reads the ``K - 1`` tokens before it in its row,
        padding skipped: the last of those written by earlier steps are ``tail``.

        Args:
          tail: float32 ``[B, K - 1, N_kv * H]``, the last ``K - 1`` inputs ``u`` of the
            row's tokens (zeros before a row's first token: the convolution's restart).
          mask: bool ``[B, T]``, True for a token, False for padding (whose ``w`` is
            computed but unused: the writer sets its ``beta`` to 0).

        Returns:
          ``(w float32 [B, T, N_kv, H], tail float32 [B, K - 1, N_kv * H])``.
        """
        B, T, width = self.u.shape
        K = self.conv.shape[0]
        order = jnp.argsort(~mask, axis=1, stable=True)  # tokens first, in their order
        ext = jnp.concatenate([tail, jnp.take_along_axis(self.u, order[..., None], 1)], 1)
        out = short_causal_conv(ext, self.conv)[:, K - 1:]
        out = jnp.take_along_axis(out, jnp.argsort(order, axis=1)[..., None], 1)
        n = jnp.sum(mask, axis=1, dtype=jnp.int32)
        keep = n[:, None] + jnp.arange(K - 1, dtype=jnp.int32)
        new_tail = jnp.take_along_axis(ext, keep[..., None], 1)
        w = l2_normalise(jax.nn.silu(out).reshape(B, T, self.num_kv_heads,
                                                  width // self.num_kv_heads))
        return w, new_tail

    @classmethod
    def init_decode_state(cls, batch: int, slots: int, *, num_heads: int, head_dim: int,
                          options: dict) -> dict:
        """The empty decode state of one layer (:mod:`jaxpos.layers.cache.scheme_state`):
        ``tail`` zeros float32 ``[batch, K - 1, N_kv * H]`` (the convolution's last
        inputs) and, for PaTH-FoX, ``g_last`` ``[batch, N]`` (each row's cumulative log
        forget gate) and ``g_slots`` ``[batch, slots, N]`` (each cached slot's)."""
        nk, _, K = cls._sizes(num_heads, head_dim, 1, options)
        state = {"tail": jnp.zeros((batch, K - 1, nk * head_dim), jnp.float32)}
        if cls.forget:
            state["g_last"] = jnp.zeros((batch, num_heads), jnp.float32)
            state["g_slots"] = jnp.zeros((batch, slots, num_heads), jnp.float32)
        return state

    def check_kv_heads(self, num_kv_heads: int) -> None:
        """The layer's key heads must be the scheme's ``num_kv_heads``.

        Raises:
          ValueError: naming both and the option to set.
        """
        if num_kv_heads != self.num_kv_heads:
            raise ValueError(f"the layer's keys have {num_kv_heads} heads but "
                             f"{type(self).__name__} was built for num_kv_heads="
                             f"{self.num_kv_heads}; pass scheme_options={{'num_kv_heads': "
                             f"{num_kv_heads}}}.")

    def check_causal(self, causal: bool) -> None:
        if not causal:
            raise ValueError("PaTH attention is causal by definition (Yang et al. 2025, Eq. 2); "
                             "got a non-causal layer (an Encoder or causal=False).")

    def transform_qk(self, q: jax.Array, k: jax.Array, q_positions: jax.Array,
                     kv_positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        raise ValueError(f"{type(self).__name__} replaces softmax attention's scores, which "
                         f"no engine of jaxpos.attention computes; call jaxpos.path_attention "
                         f"(implementation 'reference' or 'chunked'; the Flax modules do so "
                         f"for position={self.registry_name!r}).")

    def cache_write(self, q: jax.Array, k: jax.Array, positions: jax.Array):
        """Writing to a cache without PaTH's decode state is refused.

        Raises:
          ValueError: always (decode from the caches of the model's ``init_cache``).
        """
        raise ValueError(
            f"position={self.registry_name!r} decodes from a KV cache that carries its decode "
            f"state (the short convolution's last inputs; PaTH's inference rule, Yang et al. "
            f"2025, §3.2, moves every cached key by each new token's transform): use the "
            f"caches of the layer's or model's init_cache, not a bare KVCache.")


@register("path_fox")
class PaTHFoX(PaTH):
    """PaTH-FoX (Yang et al. 2025, §3.3): PaTH with the Forgetting Transformer's forget
    gate per query head (parameters ``forget_w``, ``forget_b``); otherwise as
    :class:`PaTH`."""

    forget = True
