"""The planner's remat choice: which stages keep their named activations, and where.

:mod:`chunkjax.remat` gives each stage an option (``"full"`` recompute, ``"save"`` on the device,
``"offload"`` to pinned host memory) and writes it into the stage traces
(:func:`chunkjax.remat.with_remat`): kept device bytes in the memory tide, offloaded bytes on the
PCIe link beside the chunk fetches and gradient offloads, recompute FLOPs removed. Every option set
is planned by the one planner (the caller's ``plan_one``) on those traces, so the placement trades
chunk buffers for kept activations within the same budget, and the set with the fastest predicted
step wins (ties: the fewer kept activations).

Option sets (``mode="auto"``), over the stages that keep anything (the blocks): the first ``a``
offloaded (their activations wait longest, their fetch comes last in the backward), the last ``b``
saved on the device (their backward comes first, right after the head). The search
(:func:`search_sets`): ``a`` over quarters of the blocks then halving steps around the best, then
the largest ``b`` that fits beside it (bisection: device bytes grow with ``b``) and half of it.
``mode="save"`` / ``"offload"``: every block so.
"""
from __future__ import annotations

import dataclasses

from chunkjax.errors import PlanError
from chunkjax.remat import FULL, OFFLOAD, SAVE, with_remat

#: remat modes of the fit path (:attr:`chunkjax.fit.FitProblem.remat`)
REMAT_MODES = ("full", "save", "offload", "auto")
#: parts of the blocks the ``"auto"`` option sets step by (quarters)
AUTO_STEPS = 4


def _blocks(figures) -> list[int]:
    return [s for s, f in enumerate(figures) if f.saved_bytes]


def kept_set(figures, a: int, b: int) -> tuple[str, ...]:
    """One option per stage: the first ``a`` blocks ``"offload"``, the last ``b`` ``"save"``."""
    blocks = _blocks(figures)
    opts = [FULL] * len(figures)
    for s in blocks[:a]:
        opts[s] = OFFLOAD
    for s in blocks[len(blocks) - b:] if b else ():
        opts[s] = SAVE
    return tuple(opts)


def option_sets(figures, mode: str) -> list[tuple[str, ...]]:
    """The fixed option sets of a ``mode`` other than ``"auto"``: all-``"full"``, then (``"save"``,
    ``"offload"``) that option on every block.

    Raises:
      ValueError: an unknown mode.
    """
    if mode not in REMAT_MODES:
        raise ValueError(f"remat={mode!r}: use one of {REMAT_MODES}")
    L = len(_blocks(figures))
    full = (FULL,) * len(figures)
    if mode in ("full", "auto") or not L:
        return [full]
    return [full, kept_set(figures, L, 0) if mode == OFFLOAD else kept_set(figures, 0, L)]


def search_sets(figures, step_s) -> tuple[int, int]:
    """``(a, b)`` of the ``"auto"`` search (module docstring); ``step_s(a, b)``: the predicted step
    of :func:`kept_set` ``(a, b)``, None when it does not fit."""
    L = len(_blocks(figures))
    inf = float("inf")
    t = lambda a, b: inf if step_s(a, b) is None else step_s(a, b)  # noqa: E731
    if not L:
        return 0, 0
    grid = sorted({L * k // AUTO_STEPS for k in range(AUTO_STEPS + 1)})
    a = min(grid, key=lambda x: (t(x, 0), x))
    step = max(1, L // (2 * AUTO_STEPS))
    while True:  # halving steps around the best offload count
        a = min((x for x in (a - step, a, a + step) if 0 <= x <= L), key=lambda x: (t(x, 0), x))
        if step == 1:
            break
        step = max(1, step // 2)
    lo, hi = 0, L - a  # the largest b that fits beside a
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if step_s(a, mid) is not None else (lo, mid - 1)
    b = min({0, lo // 2, lo}, key=lambda x: (t(a, x), x))
    return a, b


def label(opts) -> str:
    """``"full"``, or e.g. ``"offload 13 + save 26 + full 14"`` (blocks per option)."""
    n = {o: sum(x == o for x in opts) for o in (OFFLOAD, SAVE)}
    return " + ".join(f"{o} {k}" for o, k in n.items() if k) or "full"


def plan_remat(plan_one, traces, figures, mode: str, names) -> tuple:
    """Plan every option set of ``mode`` and keep the fastest predicted step that fits.

    Args:
      plan_one: ``traces -> Schedule`` (the one planner on those traces; raises
        :class:`chunkjax.PlanError` when nothing fits).
      traces: the stage traces (full recompute).
      figures: per stage, :class:`chunkjax.remat.RematFigures` for ``names``.
      mode: one of :data:`REMAT_MODES`.
      names: the ``checkpoint_name`` names kept.

    Returns:
      ``(schedule, rows)``: the chosen schedule (``remat`` and ``remat_names`` set; empty for all
      ``"full"``): with ``"auto"`` the fastest, with ``"save"``/``"offload"`` that option on every
      block whatever its prediction (the all-``"full"`` plan is made beside it, for the rows); and
      one row per option set planned: ``{"remat", "step_s", "peak_device_bytes"}`` or
      ``{"remat", "error"}``.

    Raises:
      PlanError: no option set fits (the all-``"full"`` plan's error), or the forced one does not.
    """
    rows, planned, first_err = [], {}, None
    sets = option_sets(figures, mode)
    forced = sets[-1] if mode in (SAVE, OFFLOAD) and len(sets) > 1 else None

    def plan(opts):
        nonlocal first_err
        if opts in planned:
            return planned[opts]
        kept = any(o != FULL for o in opts)
        try:
            s = plan_one(with_remat(traces, figures, opts) if kept else tuple(traces))
        except PlanError as e:
            if opts == forced:
                raise
            first_err = first_err or e
            rows.append({"remat": label(opts), "error": str(e).splitlines()[0][:200]})
            planned[opts] = None
            return None
        s = dataclasses.replace(s, remat=opts if kept else (), remat_names=tuple(names) if kept else ())
        rows.append({"remat": label(opts), "step_s": s.predicted.time.step_s,
                     "peak_device_bytes": s.predicted.peak_device_bytes})
        planned[opts] = s
        return s

    for opts in sets:
        plan(opts)
    if mode == "auto":
        def step_s(a, b):
            s = plan(kept_set(figures, a, b))
            return None if s is None else s.predicted.time.step_s
        search_sets(figures, step_s)
    if forced is not None:
        return planned[forced], rows
    done = [s for s in planned.values() if s is not None]
    if not done:
        raise first_err
    full = planned.get((FULL,) * len(figures))
    # ties: the fewer kept activations (all-"full" first)
    best = min(done, key=lambda s: (s.predicted.time.step_s, s is not full, sum(o != FULL for o in s.remat)))
    return best, rows


def remat_plan(problem, plan_one) -> tuple:
    """:func:`plan_remat` for a :class:`chunkjax.fit.FitProblem` (its traces, ``remat``,
    ``remat_names`` and ``remat_figures``); ``plan_one(traces) -> Schedule``.

    Raises:
      ValueError: several ranks or micro-batches (kept activations run on one device, one
        micro-batch per pass), or ``"save"``/``"offload"``/``"auto"`` without ``remat_names``.
    """
    if problem.n_ranks > 1 or problem.micro_batches > 1:
        raise ValueError(f"remat={problem.remat!r} plans one device and one micro-batch: use remat='full' there")
    if not problem.remat_names:
        raise ValueError(f"remat={problem.remat!r} needs remat_names (the checkpoint_name names to keep, "
                         "e.g. models.gpt.REMAT_NAMES)")
    return plan_remat(plan_one, problem.traces, problem.remat_figures, problem.remat, problem.remat_names)
