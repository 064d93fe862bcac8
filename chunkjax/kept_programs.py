"""The step's programs as the compiled check compiled them (``jax.stages.Compiled``), run by the
step from then on, so that each program is compiled once (:func:`chunkjax.footprint.compiled_programs`:
a ``ShapeDtypeStruct`` of a ``pinned_host`` sharding lowers with a device-memory aval, so jit
alone traced, lowered and compiled every program taking a pinned chunk again at the first step;
on the H200 that doubled the set-up of the largest models).

The executables live in the step's own program cache (a dict the step owns: nothing global).
An executable refuses arguments it was not compiled for (another batch sharding, a placement
that changed) with a ``TypeError`` or ``ValueError`` before it runs, donating nothing; the
program then falls back to the jitted function for good, which traces for what it is given.
"""
from __future__ import annotations

from typing import Any, Callable

import jax


def _key(batch, k: int) -> tuple:
    return ("compiled", str(jax.tree.map(lambda a: (a.shape, str(a.dtype)), batch)), k)


def runnable(cache: dict, fn: Callable, batch, k: int, compiled: Any = None) -> Callable:
    """Program ``k`` of the step for ``batch``'s shapes as it runs: ``compiled`` (kept in
    ``cache`` from now on) or the executable kept before, falling back to the jitted ``fn`` when
    the executable refuses its arguments; ``fn`` when none was kept."""
    key = _key(batch, k)
    if compiled is not None:
        cache[key] = compiled
    exe = cache.get(key)
    if exe is None:
        return fn

    def call(*args):
        try:
            return exe(*args)
        except (TypeError, ValueError):  # refused before running (arguments it was not compiled for)
            cache.pop(key, None)
            return fn(*args)
    return call
