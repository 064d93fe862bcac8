"""Counting jax's traces and lowerings (``jax.monitoring`` events, every thread), for the tests
that a step, once run, traces and compiles nothing again (equinox's ``assert_max_traces``, optax's
``log_compilations`` idea: a count, not a time)."""
from __future__ import annotations

import contextlib

import jax

#: jax's events for one jit trace and for one lowering to MLIR (a lowering precedes every
#: compilation, persistent-cache hits included)
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"


@contextlib.contextmanager
def count_compiles():
    """``with count_compiles() as n: ...``: ``n["traces"]``, ``n["lowerings"]`` of the block, and
    ``n["lowered"]``: the name of each module lowered (``jit_<function name>``), in order."""
    n = {"traces": 0, "lowerings": 0, "lowered": []}

    def listen(event, duration, **kwargs):
        del duration
        if event == TRACE_EVENT:
            n["traces"] += 1
        elif event == LOWER_EVENT:
            n["lowerings"] += 1
            n["lowered"].append(str(kwargs.get("fun_name")))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield n
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def per_step(run_step, n_steps: int) -> list[dict]:
    """``run_step(i)`` for ``i < n_steps``, each counted (:func:`count_compiles`)."""
    out = []
    for i in range(n_steps):
        with count_compiles() as n:
            run_step(i)
        out.append(n)
    return out


def assert_compiles_only_first(counts: list[dict], what: str) -> None:
    """The first step traced (the events are counted at all) and no later step traced or lowered."""
    assert counts[0]["traces"] > 0, f"{what}: no trace counted in the first step (jax's event names changed?)"
    later = [(i, n) for i, n in enumerate(counts) if i and (n["traces"] or n["lowerings"])]
    assert not later, f"{what}: traced or compiled again at step(s) {later}"
