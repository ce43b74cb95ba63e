"""FoX: the forgetting-gate bias of the Forgetting Transformer (Lin, Nikishin, He &
Courville 2025, "Forgetting Transformer: Softmax Attention with a Forget Gate", ICLR,
§2 "Forgetting Transformer").

Each head ``h`` computes a scalar forget gate per token from the layer's input,
``f_t = sigmoid(w_h . x_t + b_h)`` in ``(0, 1)``, and down-weights the attention of a
query at ``i`` to a key at ``j <= i`` by the product of the gates in between::

    o_i = sum_j F_ij exp(q_i . k_j) v_j / sum_j F_ij exp(q_i . k_j),
    F_ij = prod_{l=j+1}^{i} f_l,

which is softmax attention with the additive bias ``D_ij = log F_ij`` on the logits::

    D_ij = c_i - c_j,     c_i = sum_{l <= i} log f_l     (the cumulative log forget gate).

``log f`` is at most 0, so ``D_ij <= 0`` for ``j <= i``: a data-dependent, learnable
recency bias that replaces position embeddings (FoX uses no RoPE by default). The
model supplies ``log_forget = log f`` (float ``[B, T, N]``; :func:`forget_gate` computes
it with ``jax.nn.log_sigmoid``, in float32 as the authors do); this module turns it into
the score term. FoX is causal: for ``j > i`` the bias would be positive, so the scheme
requires ``causal=True``.

Positions index the sequence of gates: ``c`` is gathered at the query and key
positions, so every position must lie in ``[0, T)`` (``T = log_forget.shape[1]``),
``i`` and ``j`` being the token indices of the sequence the gates were computed for.
Concrete positions out of range, or decreasing along a row (packed segments whose
positions restart would read other tokens' gates: pack with ``arange`` positions and
``segment_ids`` instead), raise ``ValueError``; under ``jit`` a query at a position
outside ``[0, T)``, or one seeing a key there, gets a NaN row (the overflow rule), never
another token's gate.

KV-cache decoding: the modules' caches keep ``c`` of every cached token, per position, and
a step adds its new tokens' gates to the row's last ``c`` (:mod:`jaxpos.layers.cache.fox`;
the read is :class:`FoXCacheRead`). A padded full pass places each token's gate at its
position and gives padding none (:meth:`FoX.from_params`), so a left-padded row equals
the same row unpadded.

The bias is not translation invariant in positions (it depends on the gates between
``j`` and ``i``), but it is invariant to shifting the whole token sequence when the gates
move with it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxpos import _checks
from jaxpos.schemes.base import PositionScheme, register

__all__ = ["FoX", "FoXCacheRead", "fox_bias", "fox_cumulative", "forget_gate",
           "place_gates"]


def forget_gate(x: ArrayLike, w: ArrayLike, b: ArrayLike) -> jax.Array:
    """``log f = log_sigmoid(x @ w + b)``, the log forget gates of Lin et al. 2025, §2.

    Args:
      x: float ``[B, T, D]``, the attention layer's input.
      w: float ``[D, N]``; b: float ``[N]``.

    Returns:
      float32 ``[B, T, N]``, at most 0 (``jax.nn.log_sigmoid`` of a float32 logit).

    Raises:
      ValueError: ranks or widths that do not match. TypeError: integer inputs.
    """
    _checks.check_rank("x", x, (3,), "[B, T, D]")
    _checks.check_rank("w", w, (2,), "[D, num_heads]")
    _checks.check_rank("b", b, (1,), "[num_heads]")
    for name, a in (("x", x), ("w", w), ("b", b)):
        _checks.check_floating(name, a)
    D, N = _checks.shape_of(w)
    if _checks.shape_of(x)[-1] != D or _checks.shape_of(b) != (N,):
        raise ValueError(f"forget_gate needs x [B, T, D], w [D, N], b [N] with matching D and "
                         f"N; got x {_checks.shape_of(x)}, w {_checks.shape_of(w)}, b "
                         f"{_checks.shape_of(b)}.")
    logit = jnp.einsum("btd,dn->btn", jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
    return jax.nn.log_sigmoid(logit + jnp.asarray(b, jnp.float32))


def _check_log_forget(log_forget) -> None:
    _checks.check_rank("log_forget", log_forget, (3,), "[B, T, num_heads]")
    _checks.check_floating("log_forget", log_forget)


def fox_cumulative(log_forget: ArrayLike) -> jax.Array:
    """``c = cumsum(log_forget)`` over the sequence, per head, transposed for gathers:
    float32 ``[B, N, T]``, ``c[b, h, i] = sum_{l <= i} log_forget[b, l, h]``.

    Raises:
      ValueError: ``log_forget`` not rank 3. TypeError: not floating.
    """
    _check_log_forget(log_forget)
    return jnp.cumsum(jnp.swapaxes(jnp.asarray(log_forget, jnp.float32), 1, 2), axis=-1)


def place_gates(log_forget: ArrayLike, positions: ArrayLike) -> jax.Array:
    """The gates indexed by position: float32 ``[B, T, N]`` whose entry ``p`` is the gate
    of the token at position ``p`` (``positions`` int ``[B, T]``, negative for padding),
    zero where no token sits (padding contributes no gate: ``log f = 0``, ``f = 1``).
    Positions outside ``[0, T)`` drop their gate (never clamped onto another)."""
    lf = jnp.asarray(log_forget, jnp.float32)
    B, T = lf.shape[:2]
    pos = jnp.broadcast_to(jnp.asarray(positions, jnp.int32), (B, T))
    index = jnp.where((pos >= 0) & (pos < T), pos, T)  # T: out of range, dropped
    rows = jnp.arange(B, dtype=jnp.int32)[:, None]
    return jnp.zeros_like(lf).at[rows, index].set(lf, mode="drop")


def _check_positions_in_range(name: str, positions, T: int) -> None:
    if _checks.is_concrete(positions):
        a = np.asarray(positions)
        if a.size and (a.min() < 0 or a.max() >= T):
            raise ValueError(f"{name} must lie in [0, T) = [0, {T}) to index the forget gates "
                             f"(log_forget has T = {T} tokens); got values from {a.min()} to "
                             f"{a.max()}.")


def _check_positions_increasing(name: str, positions) -> None:
    """Concrete positions must not decrease along each row, the row's largest position
    aside: the gates are read at the positions, so positions that restart (packed
    segments) would read another token's gates. The modules give hidden padding the row's
    largest visible position (``fill_hidden_positions``), which this rule lets pass."""
    if _checks.is_concrete(positions):
        a = np.asarray(positions)
        rows = a.reshape((-1, a.shape[-1])) if a.ndim else a.reshape((1, 1))
        if any(np.any(np.diff(r[r != r.max()]) < 0) for r in rows):
            raise ValueError(
                f"FoX reads its forget gates at the token positions, so {name} must not "
                f"decrease along a row (token indices into log_forget); got "
                f"{a.tolist()}. For packed sequences pass arange positions with segment_ids "
                f"(the bias c_i - c_j only sums the gates between two tokens of a segment, "
                f"so each segment gets the answer it would get alone).")


def fox_bias(log_forget: ArrayLike, q_positions: ArrayLike, kv_positions: ArrayLike) -> jax.Array:
    """The FoX bias ``D_ij = c_i - c_j`` (Lin et al. 2025, §2) at the given positions.

    ``c`` is :func:`fox_cumulative`; ``i`` runs over ``q_positions``, ``j`` over
    ``kv_positions``. For ``j <= i`` this is ``sum_{l=j+1}^{i} log f_l <= 0``; entries
    with ``j > i`` are positive and must be hidden by a causal mask.

    Args:
      log_forget: float ``[B, T, N]``, ``log f`` (at most 0).
      q_positions, kv_positions: integer ``[Tq]``/``[Tk]`` or ``[B, Tq]``/``[B, Tk]``,
        values in ``[0, T)``.

    Returns:
      float32 ``[B, N, Tq, Tk]``.

    Raises:
      TypeError: float positions; integer ``log_forget``.
      ValueError: bad ranks; position batch sizes other than 1 or B; concrete positions
        outside ``[0, T)``.
    """
    _check_log_forget(log_forget)
    B, T, _ = _checks.shape_of(log_forget)
    for name, p in (("q_positions", q_positions), ("kv_positions", kv_positions)):
        _checks.check_integer_positions(name, p)
        _checks.check_rank(name, p, (1, 2), "[T] or [B, T]")
        _check_positions_in_range(name, p, T)
    qp = _checks.positions_2d("q_positions", q_positions, B, _checks.shape_of(q_positions)[-1])
    kp = _checks.positions_2d("kv_positions", kv_positions, B,
                              _checks.shape_of(kv_positions)[-1])
    c = fox_cumulative(log_forget)  # [B, N, T]
    take = lambda p: jnp.take_along_axis(c, jnp.broadcast_to(p, (B, p.shape[-1]))[:, None, :],
                                         axis=-1)  # [B, N, t]
    return take(qp)[..., :, None] - take(kp)[..., None, :]


@register("fox")
class FoX(PositionScheme):
    """The FoX forget-gate bias (Lin et al. 2025) as a score_mod scheme.

    Args:
      log_forget: float ``[B, T, N]``, the log forget gates of the call's sequence (a
        child: gradients flow back to whatever produced it, e.g. a gate projection).
        ``B`` may be 1 (shared by every batch row).

    A scheme holds the gates of one sequence batch, so build one per layer and call
    (e.g. ``FoX(forget_gate(x, w, b))``). Requires ``causal=True``; positions in
    ``[0, T)`` (module docstring).

    Raises:
      ValueError: ``log_forget`` not rank 3. TypeError: not floating.
    """

    reads_token_order = True  # the gates are summed in token order


    # fields, set once in __init__ (the pytree's children and static data)
    log_forget: jax.Array

    _children = ("log_forget",)

    def __init__(self, log_forget: ArrayLike):
        _check_log_forget(log_forget)
        self._set(log_forget=jnp.asarray(log_forget, jnp.float32))

    # ---- for the Flax modules: a gate projection per layer, the scheme computed from
    # the layer's input at every call.
    params_per_layer = True

    #: Logical axis names of the parameters (:mod:`jaxpos.sharding`).
    param_axes = {"w": ("embed", "heads"), "b": ("heads",)}

    @classmethod
    def init_params(cls, key: jax.Array, *, num_heads: int, d_model: int,
                    param_dtype: Any = jnp.float32, **_: Any) -> dict:
        """The forget-gate projection ``{"w": [d_model, N], "b": [N]}``: ``w ~ N(0,
        0.02^2)``, ``b = 0``, as the authors' code initialises its ``fgate_proj``."""
        w = 0.02 * jax.random.normal(key, (d_model, num_heads), jnp.float32)
        return {"w": w.astype(param_dtype), "b": jnp.zeros((num_heads,), param_dtype)}

    @classmethod
    def from_params(cls, params: dict, *, x: jax.Array | None = None,
                    positions: jax.Array | None = None, **_: Any) -> PositionScheme:
        """``FoX(forget_gate(x, w, b))`` from the layer's input ``x`` ``[B, T, D]``.

        The gates are indexed by position. ``positions`` (int ``[B|1, T]``, optional) are
        the tokens' positions with padding marked by a negative value (the modules' full
        pass with an ``attention_mask``): the gate of the token at position ``p`` is put
        at index ``p`` and padding contributes no gate, so a left-padded row gets the
        bias of the same row unpadded. A row's tokens must sit at ``0 .. n-1`` in order
        (Hugging Face's ``cumsum(attention_mask) - 1``); concrete positions are checked,
        traced ones cannot be (a position past ``T`` drops its gate). None: the gates in
        token order (a full pass at ``arange`` positions, or a decode step's new tokens,
        which the cache places: :mod:`jaxpos.layers.cache.fox`).

        Raises:
          ValueError: no ``x``; concrete token positions other than ``0 .. n-1`` in order.
        """
        if x is None:
            raise ValueError("FoX computes its forget gates from the layer's input; "
                             "from_params got x=None.")
        log_forget = forget_gate(x, params["w"], params["b"])
        if positions is None:
            return cls(log_forget)
        B, T = _checks.shape_of(x)[:2]
        pos = jnp.broadcast_to(jnp.asarray(positions, jnp.int32), (B, T))
        if _checks.is_concrete(positions):
            for row in np.asarray(pos):
                tokens = row[row >= 0]
                if np.any(tokens != np.arange(tokens.size)):
                    raise ValueError(
                        f"FoX indexes its gates by token position, so a row's tokens must "
                        f"sit at positions 0 .. n-1 in order (padding marked negative); got "
                        f"{np.asarray(pos).tolist()}. Run packed or offset sequences as "
                        f"separate rows starting at position 0.")
        return cls(place_gates(log_forget, pos))

    @classmethod
    def init_decode_state(cls, batch: int, slots: int, *, num_heads: int, head_dim: int,
                          options: dict) -> dict:
        """The empty decode state of one layer (:mod:`jaxpos.layers.cache.fox`):
        ``g_last`` float32 ``[batch, N]``, each row's cumulative log forget gate ``c`` up to
        its last token, and ``g_slots`` float32 ``[batch, slots, N]``, ``c`` of the token at
        each position (a position is a slot of the table; slot ``s`` of the serving loop's
        caches holds the token at position ``s``)."""
        return {"g_last": jnp.zeros((batch, num_heads), jnp.float32),
                "g_slots": jnp.zeros((batch, slots, num_heads), jnp.float32)}

    def cache_write(self, q: jax.Array, k: jax.Array,
                    positions: ArrayLike) -> tuple[jax.Array, jax.Array, PositionScheme]:
        """Writing to a cache without FoX's decode state is refused: the bias of a new
        query needs the cumulative gate of every cached token, which the caches of the
        modules' ``init_cache`` keep (:mod:`jaxpos.layers.cache.fox`).

        Raises:
          ValueError: always.
        """
        raise ValueError("FoX decodes from a KV cache that keeps the cumulative forget gate "
                         "of every cached token (the bias is c_i - c_j): use the caches of "
                         "the layer's or model's init_cache, not a bare KVCache.")

    def check(self, num_heads: int, head_dim: int) -> None:
        n = _checks.shape_of(self.log_forget)[2]
        if n != num_heads:
            raise ValueError(f"FoX log_forget must have shape [B, T, {num_heads}] (one gate per "
                             f"query head); got {_checks.shape_of(self.log_forget)}.")

    def check_causal(self, causal: bool) -> None:
        if not causal:
            raise ValueError("FoX(...) needs causal=True: its bias c_i - c_j is a decay only for "
                             "keys at or before the query (Lin et al. 2025, §2); for later keys "
                             "it would be positive.")

    def transform_qk(self, q: jax.Array, k: jax.Array, q_positions: jax.Array,
                     kv_positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Unchanged ``q`` and ``k``; checks that the gates fit the call: batch 1 or ``B``,
        and concrete positions inside ``[0, T)`` and never decreasing along a row (pack
        sequences with arange positions and ``segment_ids``, not restarting positions).

        Raises:
          ValueError: a batch mismatch; concrete positions out of range or decreasing.
        """
        Bg, T, _ = _checks.shape_of(self.log_forget)
        B = _checks.shape_of(q)[0]
        if Bg not in (1, B):
            raise ValueError(f"FoX log_forget has batch {Bg}; the attention call has batch {B} "
                             f"(log_forget must be [1 or {B}, T, N]).")
        for name, p in (("q_positions", q_positions), ("kv_positions", kv_positions)):
            _check_positions_in_range(name, p, T)
            _check_positions_increasing(name, p)
        return q, k

    @property
    def score_heads(self) -> int:
        """Heads of the score term: one forget gate each."""
        return _checks.shape_of(self.log_forget)[2]

    @property
    def score_batch(self) -> int:
        """The gates' batch: the term differs per row (computed from each row's tokens)."""
        return _checks.shape_of(self.log_forget)[0]

    def score_mod(self) -> Callable[..., jax.Array] | None:
        """``score + c[batch, head, q_pos] - c[batch, head, kv_pos]`` with ``c`` from
        :func:`fox_cumulative` (computed once per call); NaN for a (traced) position
        outside ``[0, T)``, so a visible key or a query there makes its row NaN."""
        c = fox_cumulative(self.log_forget)
        Bg, _, T = c.shape

        def fox(score, batch, head, q_pos, kv_pos):
            row = c[jnp.minimum(batch, Bg - 1), head]  # [T]
            ci = row[jnp.clip(q_pos, 0, T - 1)]
            cj = row[jnp.clip(kv_pos, 0, T - 1)]
            # a traced position outside the gates reads no gate: NaN, never a clamped one
            inside = (q_pos >= 0) & (q_pos < T) & (kv_pos >= 0) & (kv_pos < T)
            return score + jnp.where(inside, ci - cj, jnp.nan)

        return fox


class FoXCacheRead(PositionScheme):
    """How a FoX layer reads its KV cache (built by the FoX cache writer,
    :mod:`jaxpos.layers.cache.fox`): the bias ``c_i - c_j`` (Lin et al. 2025, §2) from the
    cumulative log forget gates the cache keeps per position, so a step needs no gate of
    an earlier token besides.

    Args:
      cumulative: float32 ``[B, S, N]``, ``c`` of the token at each position ``0 .. S-1``
        of each row (the cache's ``g_slots``).

    Positions are clamped into ``[0, S)`` inside the score_mod: the writer refuses (or
    poisons, under ``jit``) a token written outside it. Requires ``causal=True``.
    """

    cumulative: jax.Array
    _children = ("cumulative",)

    def __init__(self, cumulative: ArrayLike):
        _checks.check_rank("cumulative", cumulative, (3,), "[B, S, num_heads]")
        _checks.check_floating("cumulative", cumulative)
        self._set(cumulative=jnp.asarray(cumulative, jnp.float32))

    def check(self, num_heads: int, head_dim: int) -> None:
        if _checks.shape_of(self.cumulative)[2] != num_heads:
            raise ValueError(f"FoXCacheRead cumulative must have shape [B, S, {num_heads}] "
                             f"(one gate per query head); got "
                             f"{_checks.shape_of(self.cumulative)}.")

    def check_causal(self, causal: bool) -> None:
        FoX.check_causal(self, causal)  # type: ignore[arg-type]

    @property
    def score_heads(self) -> int:
        return _checks.shape_of(self.cumulative)[2]

    @property
    def score_batch(self) -> int:
        return _checks.shape_of(self.cumulative)[0]

    def score_mod(self) -> Callable[..., jax.Array] | None:
        """``score + c[batch, q_pos, head] - c[batch, kv_pos, head]``."""
        c = self.cumulative
        Bc, S, _ = c.shape

        def fox(score, batch, head, q_pos, kv_pos):
            row = c[jnp.minimum(batch, Bc - 1), :, head]  # [S]
            return score + (row[jnp.clip(q_pos, 0, S - 1)] - row[jnp.clip(kv_pos, 0, S - 1)])

        return fox
