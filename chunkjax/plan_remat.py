"""The planner's remat choice: which stages keep their named activations, and where.

:mod:`chunkjax.remat` gives each stage an option (``"full"`` recompute, ``"save"`` on the device,
``"offload"`` to pinned host memory) and writes it into the stage traces
(:func:`chunkjax.remat.with_remat`): kept device bytes in the memory tide, offloaded bytes on the
PCIe link beside the chunk fetches and gradient offloads, recompute FLOPs removed. Every option set
is planned by the one planner (the caller's ``plan_one``) on those traces, so the placement trades
chunk buffers for kept activations within the same budget, and the set with the fastest predicted
step wins (ties: the fewer kept activations).

Option sets tried (``mode="auto"``), over the stages that keep anything (the blocks), in order:
the first ``a`` offloaded (their activations wait longest, their fetch comes last in the
backward), the last ``b`` saved on the device (their backward comes first, right after the head),
``a`` and ``b`` from quarters of the blocks. ``mode="save"`` / ``"offload"``: every block so.
"""
from __future__ import annotations

import dataclasses

from chunkjax.errors import PlanError
from chunkjax.remat import FULL, OFFLOAD, SAVE, with_remat

#: remat modes of the fit path (:attr:`chunkjax.fit.FitProblem.remat`)
REMAT_MODES = ("full", "save", "offload", "auto")
#: parts of the blocks the ``"auto"`` option sets step by (quarters)
AUTO_STEPS = 4


def option_sets(figures, mode: str) -> list[tuple[str, ...]]:
    """The option sets (one option per stage) a ``mode`` plans, all-``"full"`` first.

    Args:
      figures: per stage, :class:`chunkjax.remat.RematFigures`.
      mode: one of :data:`REMAT_MODES`.

    Raises:
      ValueError: an unknown mode.
    """
    if mode not in REMAT_MODES:
        raise ValueError(f"remat={mode!r}: use one of {REMAT_MODES}")
    n = len(figures)
    blocks = [s for s, f in enumerate(figures) if f.saved_bytes]
    full = (FULL,) * n
    if mode == "full" or not blocks:
        return [full]
    if mode in (SAVE, OFFLOAD):
        return [full, tuple(mode if s in blocks else FULL for s in range(n))]
    L = len(blocks)
    grid = sorted({L * k // AUTO_STEPS for k in range(AUTO_STEPS + 1)})
    out = [full]
    for a in grid:
        for b in grid:
            if 0 < a + b <= L:
                opts = list(full)
                for s in blocks[:a]:
                    opts[s] = OFFLOAD
                for s in blocks[L - b:]:
                    opts[s] = SAVE
                out.append(tuple(opts))
    return out


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
    best, rows, first_err = None, [], None
    sets = option_sets(figures, mode)
    forced = sets[-1] if mode in (SAVE, OFFLOAD) and len(sets) > 1 else None
    for opts in sets:
        kept = any(o != FULL for o in opts)
        try:
            s = plan_one(with_remat(traces, figures, opts) if kept else tuple(traces))
        except PlanError as e:
            if opts == forced:
                raise
            first_err = first_err or e
            rows.append({"remat": label(opts), "error": str(e).splitlines()[0][:200]})
            continue
        s = dataclasses.replace(s, remat=opts if kept else (), remat_names=tuple(names) if kept else ())
        t = s.predicted.time.step_s
        rows.append({"remat": label(opts), "step_s": t, "peak_device_bytes": s.predicted.peak_device_bytes})
        if (best is None or t < best.predicted.time.step_s * (1 - 1e-9)) if forced is None else opts == forced:
            best = s
    if best is None:
        raise first_err
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
