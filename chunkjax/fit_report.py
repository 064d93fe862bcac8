"""What the fit path decided: :class:`FitReport` (the schedule, the budgets, the compiled check,
the predicted step with a speculating step's bound: :func:`with_speculation_bound`) and its
one-line summary (:func:`describe`), as :func:`chunkjax.fit.fit_problem` returns them."""
from __future__ import annotations

import dataclasses
from typing import Any

from chunkjax import clip_plan
from chunkjax.errors import format_bytes, format_moved_bytes, format_step_seconds
from chunkjax.plan_disk import storage_line
from chunkjax.plan_micro import accumulation_line
from chunkjax.predict import disk_file_bytes
from chunkjax.schedule import HOST_UPDATE, STORAGE_UPDATE, STREAMED_UPDATE


@dataclasses.dataclass(frozen=True)
class FitReport:
    """What :func:`chunkjax.fit.fit_problem` decided (bytes; ``_accounted`` = chunkjax's figures).

    Attributes:
      schedule: the :class:`chunkjax.schedule.Schedule` the step runs.
      budget_bytes: the device budget in force, per rank (bytes): the request resolved (an
        ``"auto"`` one after any raise; ``"min"``: :func:`chunkjax.fit.min_budget`).
      requested: the budget as the caller gave it: ``"auto"``, ``"min"`` (:func:`chunkjax.offload`)
        or bytes.
      effective_budget_bytes: the budget the last plan was made for (below ``budget_bytes`` after
        re-plans).
      headroom: :data:`chunkjax.fit.HEADROOM`.
      compiled: the compiled check of the last plan (``peak_bytes``, ``programs``,
        ``resident_state_bytes``, ``update_phase_bytes``), None when not compiled.
      plans: one entry per plan tried (effective budget, predicted and compiled peak, counts).
      host: :func:`chunkjax.fit_host.host_need` of the schedule plus ``available_bytes`` (None: unknown).
      fits: the compiled step fits the headroom (True when not compiled).
      why: when it does not, one line saying so.
      notes: re-plans that failed, budgets raised.
      step_time: the predicted step the report gives (:class:`chunkjax.cost.PipelinedStepTime`,
        seconds; :func:`chunkjax.clip_plan.predicted_time`: a ``"rare"`` plan whose step speculates,
        retimed with the step's bound); None: the schedule's own (``schedule.predicted.time``).
      speculation_bound: :func:`chunkjax.clip_plan.bound_record` of the built step (None: not known).
    """

    schedule: Any
    budget_bytes: int
    requested: Any
    effective_budget_bytes: int
    headroom: float
    compiled: dict | None
    plans: tuple
    host: dict
    fits: bool
    why: str | None
    notes: tuple
    step_time: Any = None
    speculation_bound: dict | None = None

    @property
    def predicted_peak_bytes(self) -> int:
        return int(self.schedule.predicted.peak_device_bytes)

    @property
    def predicted_time(self):
        """The predicted step (:class:`chunkjax.cost.PipelinedStepTime`, seconds): ``step_time``, else
        the planner's (``schedule.predicted.time``)."""
        return self.schedule.predicted.time if self.step_time is None else self.step_time

    def to_dict(self) -> dict:
        """JSON-ready: the plan's counts and predictions, the budgets and the compiled figures.
        ``step_s_predicted`` (seconds) is :attr:`predicted_time`'s, ``step_s_planned`` the planner's
        own (every host chunk speculating, for free; equal where no bound applies)."""
        p = self.schedule.predicted
        return {"device_budget_bytes": self.budget_bytes, "device_budget_requested": self.requested,
                "effective_budget_bytes": self.effective_budget_bytes, "headroom": self.headroom,
                "peak_device_bytes_accounted": p.peak_device_bytes,
                "compiled_peak_bytes": None if self.compiled is None else self.compiled["peak_bytes"],
                "schedule_counts": self.schedule.counts(), "step_s_predicted": self.predicted_time.step_s,
                "step_s_planned": p.time.step_s, "speculation_bound": self.speculation_bound,
                "plans": list(self.plans), "host": dict(self.host), "fits": self.fits, "why": self.why,
                "notes": list(self.notes), "disk_bytes_per_step_predicted": p.disk_bytes_per_step}


def describe(report: FitReport, problem) -> str:
    """One line: chunks per (params kind, update location), param chunks off the device, the
    predicted peak against the budget (the keyword it was resolved from, if any), model data on the
    device of the model data in chunks (with padding; :func:`model_bytes_unpadded` beside it, without),
    bytes moved and step time (the
    report's :attr:`FitReport.predicted_time`; where that is retimed with a speculating step's bound,
    the planner's figure beside it)."""
    s, p = report.schedule, report.schedule.predicted
    held, moved = format_bytes, format_moved_bytes  # bytes held in binary units, bytes moved in decimal
    off = sum(k != "device" for k in s.param_kinds)
    comp = "" if report.compiled is None else f" (compiled {held(report.compiled['peak_bytes'])})"
    ranks = f" per rank x {problem.n_ranks} (ZeRO-{problem.zero_stage})" if problem.zero_stage else ""
    model = problem.cb_rank.model_bytes(problem.layout.n_chunks)  # one rank's, padding included
    bare = model_bytes_unpadded(problem.cb_rank, problem.layout)
    return (f"plan: {s.counts()}; {off} of {s.n_chunks} param chunks in pinned_host; accounted peak "
            f"{held(p.peak_device_bytes)}{comp} of budget {held(report.budget_bytes)}{resolved_from(report.requested)}{ranks}; "
            f"model data on device {held(p.device_model_bytes)} of {held(model)} in chunks, with padding "
            f"({held(bare)} without); per step h2d "
            f"{moved(p.h2d_bytes_per_step)}, d2h {moved(p.d2h_bytes_per_step)}; host "
            f"{held(p.host_bytes)} ({resident_figures(s, problem.cb_rank)}, "
            f"{len(s.master_fetch)} without a compute copy, working set {held(p.host_working_bytes)}: "
            f"host gradients in flight and streamed write-back); predicted step "
            f"{format_step_seconds(report.predicted_time.step_s)}{_bounded(report)}"
            + (" (the cost model's GPU rates: a CPU runs far slower)" if problem.platform == "cpu" else "")
            + "".join(f"; {x}" for x in [storage_line(s, problem.storage_dirs, problem.host_budget_bytes),
                                         accumulation_line(s, problem.micro_batches)] if x))


def resolved_from(requested) -> str:
    """`` (resolved from 'min')`` where a budget was requested as a keyword (``"auto"``, ``"min"``),
    else ``""`` (bytes, or none): the suffix of a budget figure in a summary line."""
    return f" (resolved from {requested!r})" if isinstance(requested, str) else ""


def stages_line(names) -> str:
    """``"24 stages (embed .. head)"``, or for one stage (no block list was found) ``"1 stage (pre:
    no block list found; ...)"``: the head of a summary line (``names``: the stages' names, in order)."""
    if len(names) > 1:
        return f"{len(names)} stages ({names[0]} .. {names[-1]})"
    return f"1 stage ({names[0]}: no block list found; blocks= names one, docs/own_model.md)"


def model_bytes_unpadded(cb, layout) -> int:
    """Model data of ``layout``'s parameters without the chunks' padding (bytes): each chunk's
    bytes in ``cb`` (a :class:`chunkjax.predict.ChunkBytes`: compute params, master params and
    optimizer state of a trainable chunk, a frozen one's params) times its share of real elements
    (``layout.chunk_used / chunk_size``). :meth:`~chunkjax.predict.ChunkBytes.model_bytes` is the
    same with the padding (whole chunks): the figure the planner places."""
    per, frozen = cb.params + cb.state, dict(cb.frozen)
    return sum(used * frozen.get(c, per) // layout.chunk_size for c, used in enumerate(layout.chunk_used))


def _bounded(report: FitReport) -> str:
    """Which step figure is which, where the report's is retimed with the speculation bound."""
    if report.step_time is None or report.step_time is report.schedule.predicted.time:
        return ""
    b = report.speculation_bound or {}
    return (f" with the step's speculation bound (up to {b.get('chunks')} chunks; the planner's "
            f"{format_step_seconds(report.schedule.predicted.time.step_s)} lets every host chunk speculate, for free)")


def with_speculation_bound(report: FitReport, problem, step) -> FitReport:
    """``report`` with the predicted step of ``step`` (the built :class:`chunkjax.ChunkedStep` of
    ``report.schedule``) and its speculation bound: :func:`chunkjax.clip_plan.predicted_time` with
    :func:`chunkjax.clip_plan.bound_keywords` (a ``"rare"`` plan whose step speculates, one device
    without micro-batches or storage chunks: retimed with the bound; otherwise the plan's own).
    ``problem``: the plan's :class:`chunkjax.fit.FitProblem`."""
    bound = clip_plan.bound_keywords(problem, step)
    record = clip_plan.bound_record(bound, problem.layout.chunk_size, step.speculation_bytes, step.rollback)
    return dataclasses.replace(report, step_time=clip_plan.predicted_time(problem, report.schedule, bound),
                               speculation_bound=record)


def resident_figures(schedule, cb) -> str:
    """Where the model data off the device lives, per parameter: ``"X B/param of host-resident
    chunks"`` (host and streamed chunks' state in host memory, with the working set:
    ``host_resident_bytes_per_param``) or ``"no host-resident chunks"``, and for ``storage``
    chunks ``"N storage chunks at Y B/param on disk"`` (their master params and optimizer state,
    :func:`chunkjax.predict.disk_file_bytes` over a chunk's (rank's) elements). ``cb``: the
    schedule's (one rank's) :class:`~chunkjax.predict.ChunkBytes`."""
    p, locs = schedule.predicted, schedule.update_locations
    out = (f"{p.host_resident_bytes_per_param:.1f} B/param of host-resident chunks"
           if any(u in (HOST_UPDATE, STREAMED_UPDATE) for u in locs) else "no host-resident chunks")
    n_disk = sum(u == STORAGE_UPDATE for u in locs)
    if n_disk:
        out += f", {n_disk} storage chunks at {disk_file_bytes(cb) / (cb.master // 4):.1f} B/param on disk"
    return out
