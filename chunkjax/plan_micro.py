"""Where a step's micro-batches run (the fit path's choice): looped inside each moment over all
``M`` of them, each chunk fetched once a step and the float32 gradient sums on the device
(``"in_program"``, :class:`chunkjax.walker.Walk` ``micro_batches``); looped inside each moment
over groups of ``G`` of them, the programs run once per group (``"in_program"`` with
``micro_group`` G: ``M / G`` passes, :func:`chunkjax.accumulate.mean_gradients`); or one pass
of every program per micro-batch (``"per_micro_batch"``, the groups' ``G = 1``).

In-program moves each fetch and each offloaded gradient once a step (per pass: ``M`` times) and
keeps no float32 sum outside the programs (per pass: 4 bytes per parameter of host memory for each
offloaded chunk, and a device sum per device-updated chunk held through every program), so for the
model data it is never worse; it costs device memory for activations: the saved stage inputs are
the whole batch's (:func:`chunkjax.trace.in_program_traces`). Groups sit between: the saved stage
inputs are one group's (``G / M`` of the whole batch's), each fetch and offloaded gradient moves
``M / G`` times, and the passes keep the per-pass path's float32 sums (device-updated chunks on
the device, the others in host memory); a storage chunk's state is still read and written once a
step. Hence the rule: the largest ``G`` dividing ``M`` whose plan fits the device budget (and the
host budget the planner enforces), in-program (``G = M``) first, then groups (one device only),
else per pass (:func:`plan_micro_batches`). When every plan is refused for lack of host memory, the
refusal is the one of least host need (in-program's, when the per-pass sums cost more); groups
do not help there: their sums (4 bytes per parameter across the passes) cost more than the
whole-batch stage inputs they save whenever those are below ``4 x parameters`` bytes
(``docs/storage.md``, micro-batch groups).
"""
from __future__ import annotations

import dataclasses

from chunkjax.errors import PlanError
from chunkjax.fit_batch import batch_rows, rows_of
from chunkjax.schedule import IN_PROGRAM, PER_MICRO_BATCH, micro_group_size
from chunkjax.trace import in_program_traces


#: ``unroll_micro_batches="auto"`` traces an in-program plan's micro-batch loops unrolled up to this
#: many micro-batches, while loops above. GPT3_6B b16 as 4 x 4 x 1024 at 24 GiB on the H200: unrolled
#: 0.978x of one micro-batch's tokens/s, compiled in 44 s (s17m); while loops 0.862-0.909x (s16x,
#: s25b: each backward program ~35 ms longer, its fetches after its compute), 25 s. GPT3_18B at 8
#: micro-batches: the unrolled programs compiled for 402 s (s18b2), so larger counts stay looped.
UNROLL_AUTO_MAX_MICRO_BATCHES = 4


def resolve_unroll(unroll_micro_batches, micro_batches: int) -> bool:
    """Whether an in-program plan's micro-batch loops are traced unrolled: ``unroll_micro_batches``
    True / False as given, ``"auto"`` True for ``micro_batches`` (M) from 2 to
    :data:`UNROLL_AUTO_MAX_MICRO_BATCHES` (one micro-batch has no loop: False).

    Raises:
      ValueError: ``unroll_micro_batches`` is not a bool or ``"auto"`` (one line).
    """
    if isinstance(unroll_micro_batches, str):
        if unroll_micro_batches != "auto":
            raise ValueError(f"unroll_micro_batches={unroll_micro_batches!r}: use True, False or 'auto' "
                             f"(unrolled for 2 to {UNROLL_AUTO_MAX_MICRO_BATCHES} micro-batches)")
        return 1 < int(micro_batches) <= UNROLL_AUTO_MAX_MICRO_BATCHES
    if not isinstance(unroll_micro_batches, (bool, int)) or unroll_micro_batches not in (0, 1):
        raise ValueError(f"unroll_micro_batches={unroll_micro_batches!r}: use True, False or 'auto'")
    return bool(unroll_micro_batches)


def passes_of(schedule, micro_batches: int) -> int:
    """Times a step running ``schedule`` runs its programs per call: 1 in-program, ``M / G``
    in-program over groups of G, else ``micro_batches`` (a schedule-like object without
    ``accumulation``: per pass)."""
    acc = getattr(schedule, "accumulation", None) or PER_MICRO_BATCH
    return micro_batches // micro_group_size(acc, getattr(schedule, "micro_group", None), micro_batches)


def group_sizes(micro_batches: int, n_ranks: int = 1) -> tuple[int, ...]:
    """The in-program group sizes the planner tries, largest first: ``micro_batches`` (one pass),
    then on one device every other divisor above 1 (groups run on one device)."""
    m = int(micro_batches)
    if n_ranks > 1:
        return (m,) if m > 1 else ()
    return tuple(g for g in range(m, 1, -1) if m % g == 0)


def grouped_problem(problem, group: int):
    """``problem`` (a :class:`chunkjax.fit.FitProblem` with ``micro_batches`` M > 1) as one pass
    of micro-batch groups of ``group`` G sees it: the traces of G micro-batches looped in-program
    (:func:`chunkjax.trace.in_program_traces`, each stage's loop compiled and measured) and ``micro_batches = M / G`` passes (1: no float32
    sums, each chunk fetched once; more: the per-pass path's sums and repeated fetches), the
    loops unrolled as ``problem.unroll_micro_batches`` says (False for an object without it)."""
    unroll = bool(getattr(problem, "unroll_micro_batches", False))
    memo = getattr(problem, "loop_traces", None)
    key = (group, problem.micro_batches, problem.n_ranks, problem.traces, unroll)
    traces = None if memo is None else memo.get(key)
    if traces is None:
        one = rows_of(problem.batch, batch_rows(problem.batch) // (problem.n_ranks * problem.micro_batches))
        traces = in_program_traces(problem.traces, group, problem.stages, problem.layout, one, problem.compute_dtype,
                                   unrolled=unroll)
        if memo is not None:
            memo[key] = traces
    return dataclasses.replace(problem, traces=traces, micro_batches=problem.micro_batches // group)


def in_program_plan(problem, budget_bytes: int, plan, refused: list | None = None, **kw):
    """The in-program schedule of ``problem`` (a :class:`chunkjax.fit.FitProblem` with
    ``micro_batches`` > 1) with the largest micro-batch group (:func:`group_sizes`) whose plan
    fits ``budget_bytes`` (bytes, per rank): ``accumulation="in_program"``, ``micro_group``
    None (all micro-batches in one pass) or G and ``unroll_micro_batches`` the problem's (its
    loops traced unrolled, and so planned); None when no group fits.
    ``plan(problem, budget_bytes, **kw) -> Schedule`` plans one pass (:func:`chunkjax.fit.plan`'s
    per-pass planning, raising :class:`~chunkjax.errors.PlanError` when nothing fits) and is given
    :func:`grouped_problem`; ``refused`` (a list) gets ``(G, PlanError)`` of each group refused."""
    m = problem.micro_batches
    for g in group_sizes(m, problem.n_ranks):
        try:
            s = plan(grouped_problem(problem, g), budget_bytes, **kw)
        except PlanError as e:
            if refused is not None:
                refused.append((g, e))
            continue
        if s.predicted.peak_device_bytes <= budget_bytes:
            return dataclasses.replace(s, accumulation=IN_PROGRAM, micro_group=None if g == m else g,
                                       unroll_micro_batches=bool(getattr(problem, "unroll_micro_batches", False)))
    return None


def plan_micro_batches(problem, budget_bytes: int, plan, **kw):
    """The schedule of ``problem`` (``micro_batches`` M > 1): :func:`in_program_plan`, else
    ``plan(problem, budget_bytes, **kw)`` per micro-batch (``plan`` as :func:`in_program_plan`'s).

    Raises:
      PlanError: nothing fits: the per-pass refusal, or when it and an in-program one are both
        for lack of host memory and the in-program group needs less host (no float32 sums
        across passes), that group's refusal (its host need, the group named: the least host
        budget that would let a plan through).

    A budget of 1 byte or less (the floor probe of :func:`chunkjax.fit.auto_budget` and
    :func:`chunkjax.fit.min_budget`) is planned per pass first: no plan's device peak is that small
    (it holds a chunk's buffer and the batch), so every group is refused and the outcome is the
    per-pass one unless it is a host-need refusal a group's may replace; only then are the groups'
    loops compiled and planned (the same outcome as groups first, without compiling their loops).
    """
    per_pass = None
    if budget_bytes <= 1:  # the floor probe: the per-pass outcome, the groups planned only if it may be replaced
        try:
            return plan(problem, budget_bytes, **kw)
        except PlanError as e:
            if e.host_need_bytes is None:
                raise
            per_pass = e
    refused: list = []
    s = in_program_plan(problem, budget_bytes, plan, refused, **kw)
    if s is not None:
        return s
    try:
        if per_pass is not None:
            raise per_pass
        return plan(problem, budget_bytes, **kw)
    except PlanError as e:
        host = [(r.host_need_bytes, g, r) for g, r in refused if r.host_need_bytes is not None]
        if e.host_need_bytes is None or not host or min(h[0] for h in host) >= e.host_need_bytes:
            raise
        need, g, r = min(host, key=lambda x: x[0])
        raise type(r)(f"{r} (in-program over {g} of the {problem.micro_batches} micro-batches a pass, the least host "
                      f"need; per micro-batch {e.host_need_bytes} bytes)", r.min_budget_bytes, r.activations_alone,
                      need) from None


def accumulation_line(schedule, micro_batches: int) -> str | None:
    """How ``schedule`` runs ``micro_batches`` micro-batches, for the plan's one-line summary:
    ``"accumulation in_program"``, ``"accumulation in_program over groups of G micro-batches
    (P passes)"`` (either with ``", loops unrolled"`` where the schedule's
    ``unroll_micro_batches`` is on) or ``"accumulation per_micro_batch"`` (one pass per
    micro-batch: no loop to unroll, whatever the flag); None for one micro-batch."""
    if micro_batches == 1:
        return None
    p = passes_of(schedule, micro_batches)
    unrolled = ", loops unrolled" if schedule.accumulation == IN_PROGRAM and schedule.unroll_micro_batches else ""
    if schedule.accumulation == IN_PROGRAM and p > 1:
        return f"accumulation in_program over groups of {micro_batches // p} micro-batches ({p} passes){unrolled}"
    return f"accumulation {schedule.accumulation}{unrolled}"
