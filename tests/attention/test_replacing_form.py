"""The attentions that replace softmax's scores (stick-breaking, PaTH, CoPE) choose their
form by the engine capability ``replacing_form`` (:func:`jaxpos.core.engines.replacing_form`),
never by an engine's name: an engine registered from outside with ``replacing_form =
"dense"`` or ``"blocked"`` runs them exactly as the built-in dense (``"reference"``) or
blocked (``"chunked"``) engine does (the same traced program; one of them run against
the float64 loop of ``_replacing_reference.py``); an engine that declares none is
refused naming the engines that can, and a registration declaring an unknown form is
refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _replacing_reference import np_path, path_inputs

import jaxpos
from jaxpos.core import engines


class _UserEngine:
    """A user's engine of softmax attention (its own ``run`` is never reached here)."""

    def __init__(self, name, form=None):
        self.name = name
        if form is not None:
            self.replacing_form = form

    def refuses(self, call):
        return None

    def run(self, call):
        raise AssertionError("the replacing attentions never call an engine's run")


@pytest.fixture
def user_engines():
    made = {"user_dense": "dense", "user_blocked": "blocked", "user_softmax": None}
    for name, form in made.items():
        jaxpos.register_engine(_UserEngine(name, form), replace=True)
    yield
    for name in made:
        engines._ENGINES.pop(name, None)


def _sizes(jaxpr):
    """The element counts of every array ``jaxpr`` makes (nested jaxprs included)."""
    for eqn in jaxpr.eqns:
        yield from (int(np.prod(getattr(v.aval, "shape", ()))) for v in eqn.outvars)
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (list, tuple)) else [p]):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    yield from _sizes(getattr(inner, "jaxpr", inner))


def _traced(run, impl):
    return jax.make_jaxpr(lambda: run(impl))()


def test_a_user_engine_declaring_a_form_runs_them_as_the_built_in_engine_of_that_form(
        user_engines):
    q, k, v, w, beta, lf = path_inputs(3, B=1, T=6, N=2, Nk=1, H=4, Hv=3)
    E = jnp.asarray(np.random.default_rng(4).standard_normal((4, 5)), jnp.float32)
    runs = {
        "path": lambda impl: jaxpos.path_attention(q, k, v, w, beta, log_forget=lf,
                                                   implementation=impl, block_size=2),
        "cope": lambda impl: jaxpos.cope_attention(q, k, v, E, implementation=impl,
                                                   block_size=2),
        "stick_breaking": lambda impl: jaxpos.stick_breaking_attention(
            q, k, v, implementation=impl, block_q=2, block_k=2),
    }
    T2 = q.shape[1] ** 2 * q.shape[2]  # one [B, N, T, T] score matrix
    for what, run in runs.items():
        for user, built_in, dense in (("user_dense", "reference", True),
                                      ("user_blocked", "chunked", False)):
            got = _traced(run, user)
            # the same program as the built-in engine of that form (traced, not run: the
            # built-in ones are checked against float64 in their own tests)
            assert str(got) == str(_traced(run, built_in)), (what, user)
            # and the form was read: only the dense one holds the whole score matrix
            assert (max(_sizes(got.jaxpr)) >= T2) == dense, (what, user)
    # one of them run, against the float64 loops
    np.testing.assert_allclose(np.asarray(runs["path"]("user_dense")),
                               np_path(q, k, v, w, beta, lf), atol=2e-6)


def test_an_engine_declaring_no_form_is_refused_naming_those_that_can(user_engines):
    q, k, v, w, beta, _ = (jnp.asarray(x) for x in path_inputs(5, B=1, T=4, N=2, Nk=1))
    E = jnp.zeros((4, 5))
    calls = {
        "path_attention": lambda impl: jaxpos.path_attention(q, k, v, w, beta,
                                                             implementation=impl),
        "cope_attention": lambda impl: jaxpos.cope_attention(q, k, v, E, implementation=impl),
        "stick_breaking_attention": lambda impl: jaxpos.stick_breaking_attention(
            q, k, v, implementation=impl),
    }
    for what, call in calls.items():
        for impl in ("user_softmax", "xla"):
            with pytest.raises(ValueError, match=rf"{what} runs on implementation "
                               rf"'reference', 'chunked', 'user_dense' or 'user_blocked' "
                               rf"\(.*replacing_form.*\); got implementation='{impl}'"):
                call(impl)
    # the modules' stick-breaking layer hands an engine of softmax attention only to the
    # blocked form, as it does the Pallas kernel
    sb = jaxpos.StickBreaking()
    run = lambda impl: sb.attention(q, k, v, implementation=impl)
    assert str(_traced(run, "user_softmax")) == str(_traced(run, "chunked"))


def test_registering_an_unknown_form_is_refused():
    with pytest.raises(ValueError, match=r"engine 'user_odd' declares replacing_form="
                                         r"'tiled'; expected one of \('dense', 'blocked'\)"):
        jaxpos.register_engine(_UserEngine("user_odd", "tiled"))
    assert "user_odd" not in engines.engine_names()


def test_an_engine_module_that_fails_to_import_does_not_hide_the_refusal():
    """One broken register_engine_module entry: the refusal is still the ValueError naming
    the engines that can, and names the broken one as not loaded; engines_with skips it."""
    engines.register_engine_module("user_broken", "jaxpos_no_such_engine_module")
    try:
        q = jnp.ones((1, 3, 1, 4))
        with pytest.raises(ValueError, match=r"stick_breaking_attention runs on "
                           r"implementation 'reference'.*'chunked'.*got implementation="
                           r"'xla'.* not listed: 'user_broken' \(ModuleNotFoundError"):
            jaxpos.stick_breaking_attention(q, q, q, implementation="xla")
        names = engines.engines_with("replacing_form")
        assert {"reference", "chunked"} <= set(names) and "user_broken" not in names
    finally:
        engines._ENGINE_MODULES.pop("user_broken", None)
