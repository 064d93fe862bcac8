"""Where a step's micro-batches run (the fit path's choice): looped inside each moment, each chunk
fetched once a step and the float32 gradient sums on the device (``"in_program"``,
:class:`chunkjax.walker.Walk` ``micro_batches``), or one pass of every program per micro-batch
(``"per_micro_batch"``, :func:`chunkjax.accumulate.mean_gradients`).

In-program moves each fetch and each offloaded gradient once a step (per pass: ``M`` times) and
keeps no float32 sum outside the programs (per pass: 4 bytes per parameter of host memory for each
offloaded chunk, and a device sum per device-updated chunk held through every program), so for the
model data it is never worse; it costs device memory for activations: the saved stage inputs are
the whole batch's (:func:`chunkjax.trace.in_program_traces`). Hence the rule: in-program wherever
its plan fits the device budget, else per pass.
"""
from __future__ import annotations

import dataclasses

from chunkjax.errors import PlanError
from chunkjax.schedule import IN_PROGRAM
from chunkjax.trace import in_program_traces


def passes_of(schedule, micro_batches: int) -> int:
    """Times a step running ``schedule`` runs its programs per call: 1 in-program, else
    ``micro_batches`` (a schedule-like object without ``accumulation``: per pass)."""
    return 1 if getattr(schedule, "accumulation", None) == IN_PROGRAM else micro_batches


def in_program_plan(problem, budget_bytes: int, plan, **kw):
    """The in-program schedule (``accumulation="in_program"``) of ``problem`` (a
    :class:`chunkjax.fit.FitProblem` with ``micro_batches`` > 1) if it fits ``budget_bytes``
    (bytes, per rank), else None. ``plan(problem, budget_bytes, **kw) -> Schedule``
    (:func:`chunkjax.fit.plan`, raising :class:`~chunkjax.errors.PlanError` when nothing fits)
    is given the problem with the in-program traces and one pass (``micro_batches=1``: no
    float32 sums, each chunk fetched once)."""
    inner = dataclasses.replace(problem, traces=in_program_traces(problem.traces, problem.micro_batches),
                                micro_batches=1)
    try:
        s = plan(inner, budget_bytes, **kw)
    except PlanError:
        return None
    return dataclasses.replace(s, accumulation=IN_PROGRAM) if s.predicted.peak_device_bytes <= budget_bytes else None
