"""What :func:`chunkjax.plan_offload` returns: a model's discovered stages, its fit problem and, given
a budget, the schedule, with nothing allocated or compiled (:class:`OffloadPlan`), and its one-line
summary in the terms of the built step's (:func:`chunkjax.fit_report.describe`): the model data with
and without the chunks' padding, the budget and the keyword it was resolved from, and the predicted
step with the speculation bound a step would have (:func:`chunkjax.clip_plan.planned_bound`)."""
from __future__ import annotations

import dataclasses
from typing import Any

from chunkjax import clip_plan
from chunkjax.errors import format_bytes, format_flops, format_step_seconds
from chunkjax.fit_report import model_bytes_unpadded, resolved_from, stages_line


@dataclasses.dataclass(frozen=True)
class OffloadPlan:
    """What :func:`chunkjax.plan_offload` found and planned for a model (nothing allocated or compiled).

    Attributes:
      discovery: the :class:`chunkjax.discover.Discovery` (stages, flat parameter keys).
      problem: the :class:`chunkjax.fit.FitProblem` (layout, stage traces, FLOPs, rates).
      schedule: the :class:`chunkjax.Schedule` planned for ``budget_bytes`` (None: no budget given).
      budget_bytes: the per-rank device budget planned for, resolved (bytes; None without a budget).
      requested: the device budget as given: ``"auto"``, ``"min"`` or bytes (a size string's);
        None: none given.
    """

    discovery: Any
    problem: Any
    schedule: Any
    budget_bytes: int | None
    requested: Any = None

    @property
    def predicted_time(self):
        """The predicted step (:class:`chunkjax.cost.PipelinedStepTime`, seconds) as the built step's
        report gives it (:attr:`chunkjax.fit_report.FitReport.predicted_time`): a ``"rare"`` plan
        whose step would speculate (clipping or a non-finite skip, one device) retimed with the
        default speculation bound (:func:`chunkjax.clip_plan.planned_bound`; the run's own bound is
        at most that, so its step at least this); else the planner's (``schedule.predicted.time``,
        every host chunk speculating, for free). None without a schedule."""
        if self.schedule is None:
            return None
        return clip_plan.predicted_time(self.problem, self.schedule, clip_plan.planned_bound(self.problem))

    def summary(self) -> str:
        """One line: stages, chunks, FLOPs, the model data (without and with the chunks' padding)
        and, with a schedule, its counts, the accounted peak against the budget (the keyword it
        was resolved from) and the predicted step (:attr:`predicted_time`; where that is retimed
        with the speculation bound, the planner's unbounded figure beside it, labelled)."""
        names = [s.name for s in self.discovery.stages]
        prob, lay, held = self.problem, self.problem.layout, format_bytes
        head = (f"{stages_line(names)}, {lay.n_chunks} chunks of {lay.chunk_size} "
                f"elements; {format_flops(prob.flops_per_step)} per step; model data "
                f"{held(model_bytes_unpadded(prob.cb_rank, lay))} ({held(prob.cb_rank.model_bytes(lay.n_chunks))} "
                "in chunks, with padding)" + (" per rank" if prob.n_ranks > 1 else ""))
        if self.schedule is None:
            return head
        from chunkjax.speculate import DEFAULT_BACKUP_BYTES
        p, t = self.schedule.predicted, self.predicted_time
        n_host = sum(u == "host" for u in self.schedule.update_locations)
        n_bound = clip_plan.planned_bound(prob)["speculation_params"]
        bounded = "" if t is p.time else (
            f" with the default speculation bound ({held(DEFAULT_BACKUP_BYTES)} backup pool: "
            f"{min(n_host, n_bound // lay.chunk_size)} of {n_host} host chunks; the planner's "
            f"{format_step_seconds(p.time.step_s)} lets every host chunk speculate, for free)")
        return (f"{head}; plan {self.schedule.counts()}; accounted peak {held(p.peak_device_bytes)} of budget "
                f"{held(self.budget_bytes)}{resolved_from(self.requested)}; predicted step {format_step_seconds(t.step_s)}{bounded}"
                + (" (the cost model's GPU rates: a CPU runs far slower)" if prob.platform == "cpu" else ""))

