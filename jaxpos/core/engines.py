"""The engine protocol, the registry, and the per-backend preference that picks the engine
of :func:`jaxpos.attention` when ``implementation=None``.

An *engine* runs a validated attention call (:class:`jaxpos.core.call.AttentionCall`, the
scheme's per-token transform already applied). It is any object with

* ``name``: the string ``implementation=`` selects it by;
* ``refuses(call) -> str | TypeError | None``: why it cannot run this call (a sentence
  that names the engine and the engines that can), or None. A request by name for a
  refused call raises ``ValueError(reason)`` (or the ``TypeError`` returned, for a
  value of the wrong kind such as a traced scale); ``implementation=None`` skips the
  engine;
* ``run(call) -> out``: ``[B, Tq, N, H_v]`` in q's dtype;

and optionally

* ``run_with_lse(call) -> (out, lse)``: also the log-sum-exp of each query row's scores,
  float32 ``[B, N, Tq]`` (the sinks included; ``-inf`` for a row with no visible key),
  differentiable in both outputs. Callers that combine partial results over key blocks
  (ring attention, split-K decoding) use it through :func:`run_with_lse`;
* ``prefers(call) -> bool``: the engine's cost rule for ``implementation=None`` (default
  True): False hands the call to the next engine of the backend's list;
* ``rotates_on_load``: True when the engine applies ``call.rope_tables`` itself (as it
  loads the keys); otherwise :func:`run` rotates q and k first (default False);
* ``takes_kv_lengths``: False when the engine refuses ``kv_lengths`` (default True); a
  caller that can express the fill another way asks :func:`takes_kv_lengths`.
* ``run_paged(call, k_pages, v_pages, page_table) -> out | None``: the paged call read
  from the pages themselves (:mod:`jaxpos.core.paged`; ``page_table`` holds only valid
  page indices), or None for a call it does not take that way. Without it (or on None)
  the engine runs on the keys gathered from the pages: the one gather fallback,
  :func:`jaxpos.core.paged.run_paged`. A ragged call (packed queries) reaches it as a
  paged call with one query per row (:mod:`jaxpos.core.ragged`);
* ``second_derivatives``: False when the engine's derivatives are not differentiable
  again (default True); :func:`engines_with` lists the engines that are;
* ``ring_tile(call) -> (block_q, block_k)``: the engine's online-softmax tiles are the
  ring's own (:mod:`jaxpos.parallel.ring` runs them with the global output and
  log-sum-exp, forward and backward); without it the ring makes one call per block
  (:mod:`jaxpos.parallel.engine_ring`);
* ``varying_types_on_cpu``: False when the engine's outputs on CPU carry no
  varying-manual-axes types inside ``shard_map`` (the Pallas interpreter), so
  ``check_vma`` is off there (default True);
* ``compiler_partitioned``: True when the engine is made of XLA operations that the
  compiler's partitioner splits under a mesh with Auto axes (default False: an opaque
  kernel). Under a mesh, :func:`run` runs an engine per (batch, head) shard inside
  ``jax.shard_map`` (:mod:`jaxpos.core.partition`): always under Explicit axes, and under
  Auto axes unless it is ``compiler_partitioned``.
* ``replacing_form``: the form an attention that replaces softmax's scores takes
  when this engine is asked for (stick-breaking, PaTH, CoPE: their scores carry a state
  along the keys, so no score_mod of positions expresses them): ``"dense"`` (the whole
  ``[B, N, Tq, Tk]`` score matrix, JAX autodiff) or ``"blocked"`` (key blocks, ``O(T)``
  memory, a recomputing backward); default None, an engine that computes softmax
  attention only and is refused by those attentions (:func:`replacing_form`). The
  capability only picks which of the library's two programs runs (each attention's own
  dense or blocked code); the engine's ``refuses`` and ``run`` are not consulted for
  these attentions.

A new engine is its own file and one :func:`register_engine` call. The built-in engines
("reference", "chunked", "xla" and the fused Pallas kernel "pallas") register in their own
modules, loaded on first use: the core's three are named here, the kernel's by
:mod:`jaxpos` (:func:`register_engine_module`), since the core never imports the kernel
package (``jaxpos.kernels`` depends on the core, not the other way round).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from jaxpos import _checks
from jaxpos._util import poison_rows

if TYPE_CHECKING:
    from jaxpos.core.call import AttentionCall

__all__ = ["BUILT_IN", "BUILT_IN_TILED", "PREFERENCE", "REPLACING_FORMS", "Engine",
           "capability", "engine_names", "engines_with", "get_engine", "preference",
           "register_engine", "register_engine_module", "replacing_form", "run",
           "run_with_lse", "select_engine", "takes_kv_lengths", "traced_scale",
           "unfusable_scheme", "fused_refusal"]


@runtime_checkable
class Engine(Protocol):
    """What :func:`register_engine` takes (see the module docstring for the optional
    members ``run_with_lse``, ``prefers``, ``rotates_on_load``, ``takes_kv_lengths`` and
    the capabilities ``run_paged``, ``second_derivatives``, ``ring_tile``,
    ``varying_types_on_cpu``, ``compiler_partitioned``, ``replacing_form``)."""

    name: str

    def refuses(self, call: AttentionCall) -> str | TypeError | None:
        """Why this engine cannot run ``call`` (None: it can)."""
        ...

    def run(self, call: AttentionCall) -> jax.Array:
        """``[B, Tq, N, H_v]`` in q's dtype for a validated, transformed call."""
        ...


_ENGINES: dict[str, Engine] = {}
#: Engine name -> the module that registers it, imported on first use: the core's own
#: engines, and those named by :func:`register_engine_module` (the kernel's, by
#: :mod:`jaxpos`).
_ENGINE_MODULES = {"reference": "jaxpos.core.reference", "chunked": "jaxpos.core.chunked",
                   "xla": "jaxpos.core.xla"}

#: The built-in engines that run every scheme, mask and feature (compared in the tests;
#: ``jaxpos.IMPLEMENTATIONS``).
BUILT_IN_TILED = ("reference", "chunked", "pallas")
#: Every built-in engine: the tiled ones and ``"xla"`` (``jax.nn.dot_product_attention``;
#: ``jaxpos.ALL_IMPLEMENTATIONS``).
BUILT_IN = BUILT_IN_TILED + ("xla",)

#: Backend -> engine names in order of preference for ``implementation=None``: the first
#: that neither refuses the call nor declines it by its cost rule runs it. The measured
#: rule behind the order is ``docs/kernel.md``'s (:func:`jaxpos.core.entry.choose_implementation`):
#: on CPU the chunked engine (the kernel runs only in the Pallas interpreter there); on an
#: NVIDIA GPU cuDNN (``"xla"``) while there is no score term and a mask fits the dense
#: budget, else the kernel; on TPU the kernel. ``"default"`` serves any other backend.
PREFERENCE: dict[str, list[str]] = {
    "cpu": ["chunked"],
    "gpu": ["xla", "pallas", "chunked"],
    "tpu": ["pallas", "chunked"],
    "default": ["pallas", "chunked"],
}
_BACKEND_ALIASES = {"cuda": "gpu"}

#: The values of the ``replacing_form`` capability: how an attention that replaces
#: softmax's scores runs on an engine (the module docstring). ``implementation=None``
#: takes the second, ``"blocked"`` (``O(T)`` memory), whatever the backend.
REPLACING_FORMS = ("dense", "blocked")


def _backend_key(backend: str) -> str:
    b = _BACKEND_ALIASES.get(backend.lower(), backend.lower())
    return b if b in PREFERENCE else "default"


def preference(backend: str | None = None) -> tuple[str, ...]:
    """The engine names ``implementation=None`` tries on ``backend`` (default
    ``jax.default_backend()``), in order."""
    return tuple(PREFERENCE[_backend_key(backend or jax.default_backend())])


def register_engine(engine: Engine, *, backends: Iterable[str] = (),
                    before: str | None = None, replace: bool = False) -> Engine:
    """Make ``engine`` selectable as ``jaxpos.attention(..., implementation=engine.name)``.

    Args:
      engine: an object with ``name``, ``refuses(call)`` and ``run(call)`` (see
        :class:`Engine`; optionally ``run_with_lse``, ``prefers``, ``rotates_on_load``,
        ``takes_kv_lengths``).
      backends: the backends (``"cpu"``, ``"gpu"``, ``"tpu"``, ``"default"`` for any
        other) on whose preference list the engine joins, so that ``implementation=None``
        may pick it; default none (by name only).
      before: the engine name it goes before on those lists (default: first).
      replace: allow replacing an engine registered under the same name.

    Returns:
      ``engine`` (so the call can decorate an instance).

    Raises:
      TypeError: ``engine`` lacks ``name`` (a string), ``refuses`` or ``run``.
      ValueError: the name is taken (without ``replace``), an unknown backend,
        ``before`` not on a list, or a ``replacing_form`` other than None or one of
        :data:`REPLACING_FORMS`.
    """
    name = getattr(engine, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"engine must have a non-empty string name; got {name!r} on "
                        f"{type(engine).__name__}.")
    for method in ("refuses", "run"):
        if not callable(getattr(engine, method, None)):
            raise TypeError(f"engine {name!r} must have a method {method}(call); "
                            f"{type(engine).__name__} has none.")
    if name in _ENGINES and _ENGINES[name] is not engine and not replace:
        raise ValueError(f"an engine named {name!r} is registered already "
                         f"({type(_ENGINES[name]).__name__}); pass replace=True to replace it.")
    form = getattr(engine, "replacing_form", None)
    if form is not None and form not in REPLACING_FORMS:
        raise ValueError(f"engine {name!r} declares replacing_form={form!r}; expected one of "
                         f"{REPLACING_FORMS} or None (it runs no attention that replaces "
                         f"softmax's scores).")
    keys = [_checked_backend(b) for b in ([backends] if isinstance(backends, str)
                                          else backends)]
    for key in keys:
        order = [n for n in PREFERENCE[key] if n != name]
        if before is not None and before not in order:
            raise ValueError(f"before={before!r} is not on the {key!r} preference list "
                             f"{order}.")
        order.insert(0 if before is None else order.index(before), name)
        PREFERENCE[key][:] = order
    _ENGINES[name] = engine
    return engine


def register_engine_module(name: str, module: str) -> None:
    """Name the module whose import registers the engine ``name``: :func:`get_engine`
    imports it the first time the engine is asked for, so a package that depends on the
    core (the kernel's, ``jaxpos.kernels``) provides an engine without the core importing
    it, and without being imported before it is used.

    Raises:
      TypeError: ``name`` or ``module`` is not a non-empty string.
    """
    for arg, value in (("name", name), ("module", module)):
        if not isinstance(value, str) or not value:
            raise TypeError(f"{arg} must be a non-empty string; got {value!r}.")
    _ENGINE_MODULES[name] = module


def _checked_backend(backend: str) -> str:
    if not isinstance(backend, str):
        raise TypeError(f"backends must be strings; got {type(backend).__name__}.")
    key = _BACKEND_ALIASES.get(backend.lower(), backend.lower())
    if key not in PREFERENCE:
        raise ValueError(f"unknown backend {backend!r}; expected one of {sorted(PREFERENCE)}.")
    return key


def engine_names() -> tuple[str, ...]:
    """Every name ``implementation=`` accepts: the built-in engines and the registered ones."""
    return tuple(dict.fromkeys([*_ENGINE_MODULES, *_ENGINES]))


def get_engine(name: str) -> Engine:
    """The engine registered as ``name`` (a built-in one is loaded on first use).

    Raises:
      ValueError: no engine has that name (the message lists the names).
    """
    if not isinstance(name, str):
        _checks.check_choice("implementation", name, engine_names())
    if name not in _ENGINES and name in _ENGINE_MODULES:
        importlib.import_module(_ENGINE_MODULES[name])
    if name not in _ENGINES:
        _checks.check_choice("implementation", name, engine_names())
    return _ENGINES[name]


def capability(name: str | None, attr: str, default=None):
    """The capability ``attr`` that the engine ``name`` declares (an attribute or method
    of the protocol, see the module docstring), or ``default`` where it declares none.
    ``name`` None: the backend's first engine (the default choice on this backend)."""
    name = preference()[0] if name is None else name
    return getattr(get_engine(name), attr, default)


def _loaded(name: str) -> Engine | ImportError:
    """The engine ``name``, or the ``ImportError`` its module (:func:`register_engine_module`)
    raised."""
    try:
        return get_engine(name)
    except ImportError as e:
        return e


def engines_with(attr: str, default: bool = False) -> tuple[str, ...]:
    """The names of the engines (built-in and registered) whose capability ``attr`` is
    true (``default`` where an engine does not declare it), e.g.
    ``engines_with("second_derivatives", True)``. An engine whose module
    (:func:`register_engine_module`) fails to import is left out, so one broken
    registration does not turn a refusal that lists engines into an ``ImportError``."""
    return tuple(n for n in engine_names()
                 if not isinstance(e := _loaded(n), ImportError) and getattr(e, attr, default))


def replacing_form(what: str, implementation: str | None, why: str = "") -> str:
    """The form (:data:`REPLACING_FORMS`) in which ``what``, an attention that replaces
    softmax's scores (``"path_attention"``, ...), runs for ``implementation=``: the
    engine's ``replacing_form`` capability; None gives ``"blocked"``. ``why`` (a sentence)
    says why an engine without the capability cannot run it.

    The capability picks one of the library's two programs for ``what`` (its dense or its
    blocked form, written in the attention's own module); the engine's ``refuses`` and
    ``run`` are not consulted, so an engine that declares ``replacing_form`` runs these
    attentions exactly as the built-in engine of that form does. Engines whose module
    fails to import are named in the refusal as not loaded.

    Raises:
      ValueError: an unknown engine name (listing them); an engine that declares no
        ``replacing_form`` (naming ``implementation``, what it got and the engines that
        declare one).
    """
    if implementation is None:
        return REPLACING_FORMS[1]
    form = getattr(get_engine(implementation), "replacing_form", None)
    if form in REPLACING_FORMS:
        return form
    names = [repr(n) for n in engines_with("replacing_form", False)]
    listed = " or ".join(names) if len(names) < 3 else \
        ", ".join(names[:-1]) + " or " + names[-1]
    broken = [f"{n!r} ({type(e).__name__}: {e})" for n in engine_names()
              if isinstance(e := _loaded(n), ImportError)]
    raise ValueError(f"{what} runs on implementation {listed} (the engines that declare "
                     f"replacing_form; or None: the blocked form); got implementation="
                     f"{implementation!r}, an engine of softmax attention only." +
                     (f" {why}" if why else "") +
                     (f" Engines whose module failed to import, not listed: "
                      f"{', '.join(broken)}." if broken else ""))


def takes_kv_lengths(name: str | None) -> bool:
    """Whether ``implementation=name`` takes ``kv_lengths`` (``None``, the default
    choice, always does: an engine refusing them is skipped)."""
    return name is None or bool(getattr(get_engine(name), "takes_kv_lengths", True))


def _raise(reason: str | TypeError) -> None:
    if isinstance(reason, TypeError):
        raise reason
    raise ValueError(reason)


def select_engine(call: AttentionCall, requested: str | None = None, *,
                  backend: str | None = None) -> Engine:
    """The engine that runs ``call``: ``requested`` (refusing raises), or the first engine
    of :func:`preference` that neither refuses ``call`` nor declines it by its cost rule.

    Raises:
      ValueError: an unknown name; the requested engine refuses the call (its reason);
        every engine of the backend's list refuses it.
      TypeError: the requested engine refuses a value of the wrong kind (a traced scale).
    """
    if requested is not None:
        engine = get_engine(requested)
        reason = engine.refuses(call)
        if reason is not None:
            _raise(reason)
        return engine
    reasons = []
    for name in preference(backend):
        engine = get_engine(name)
        reason = engine.refuses(call)
        if reason is None and getattr(engine, "prefers", lambda c: True)(call):
            return engine
        reasons.append(f"{name}: {reason or 'declined by its cost rule'}")
    raise ValueError("no engine of the backend's preference list runs this call ("
                     + "; ".join(reasons) + ").")


def _prepared(engine: Engine, call: AttentionCall) -> AttentionCall:
    """The call as ``engine`` takes it: RoPE tables applied to q and k first unless the
    engine rotates them as it loads them."""
    if call.rope_tables is None or getattr(engine, "rotates_on_load", False):
        return call
    from jaxpos.core.call import apply_rope_tables

    return apply_rope_tables(call)


def _poisoned(call: AttentionCall, x: jax.Array) -> jax.Array:
    """NaN rows of ``x [B, ...]`` where a traced ``kv_lengths`` was outside ``[0, Tk]``: the
    cache-overflow rule, applied here once for every engine."""
    return x if call.kv_overflow is None else poison_rows(x, call.kv_overflow)


def run(engine: Engine, call: AttentionCall) -> jax.Array:
    """``engine.run`` on ``call`` (a validated, transformed, non-empty call); rows with an
    out-of-range traced ``kv_lengths`` are NaN."""
    from jaxpos.core.partition import run_sharded  # per shard under a mesh

    return _poisoned(call, run_sharded(engine, _prepared(engine, call), engine.run))


def run_with_lse(call: AttentionCall, implementation: str | None = None
                 ) -> tuple[jax.Array, jax.Array]:
    """``(out [B, Tq, N, H_v] in q's dtype, lse float32 [B, N, Tq])`` of a validated,
    transformed call, by the requested or default engine that has ``run_with_lse``.
    The lse includes the sinks and is ``-inf`` for a row with no visible key; both are
    differentiable. Rows with an out-of-range traced ``kv_lengths`` are NaN in both.

    Raises:
      ValueError: the engine refuses the call or has no ``run_with_lse``.
    """
    engine = select_engine(call, implementation)
    fn = getattr(engine, "run_with_lse", None)
    if fn is None:
        names = [n for n in engine_names() if hasattr(get_engine(n), "run_with_lse")]
        raise ValueError(f"implementation={engine.name!r} does not return the log-sum-exp "
                         f"(it has no run_with_lse); engines that do: {names}.")
    if call.batch == 0 or call.q_len == 0 or call.kv_len == 0:  # only the sinks, if any
        rows = (call.batch, call.num_heads, call.q_len)
        lse = jnp.full(rows, -jnp.inf, jnp.float32) if call.sinks is None else \
            jnp.broadcast_to(jnp.asarray(call.sinks, jnp.float32)[None, :, None], rows)
        return call.zeros(), lse
    from jaxpos.core.partition import run_sharded  # per shard under a mesh

    out, lse = run_sharded(engine, _prepared(engine, call), fn, with_lse=True)
    return _poisoned(call, out), _poisoned(call, lse)


# ------------------------------------------------------- refusals engines share
def traced_scale(name: str, call: AttentionCall) -> TypeError | None:
    """The refusal of an engine that compiles the scale in: a ``TypeError`` for a traced
    scale, else None."""
    if _checks.is_concrete(call.scale):
        return None
    return TypeError(f"implementation={name!r} needs a static scale (a Python or concrete "
                     f"number: it is compiled into the kernel); got a traced scale. Use "
                     f"implementation='chunked' or 'reference' to differentiate or trace the "
                     f"scale.")


def unfusable_scheme(what: str, call: AttentionCall) -> str | None:
    """The refusal of an engine that takes a scheme only as a transform and a score_mod
    (the scheme protocol's ``fusable``), else None."""
    if call.scheme.fusable:
        return None
    return (f"{what} does not support the position scheme {type(call.scheme).__name__} (its "
            f"content bias or value term depends on the query content or the weights); use "
            f"implementation='chunked' or 'reference'.")


def fused_refusal(name: str, what: str, call: AttentionCall) -> str | TypeError | None:
    """What every engine that fuses the call into one compiled attention refuses: a traced
    scale (:func:`traced_scale`), a scheme that is not fusable (:func:`unfusable_scheme`;
    ``what`` names the engine there). (Mixed dtypes never reach an engine:
    :func:`jaxpos.core.call.validate_call` refuses them for all.)"""
    return traced_scale(name, call) or unfusable_scheme(what, call)
