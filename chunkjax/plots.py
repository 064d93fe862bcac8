"""Figures of a plan: the memory tide, device bytes per moment, the schedule, the placement.

Each function takes what the fit path gives (a :class:`chunkjax.fit.Fitted` from
:func:`chunkjax.fit_step` or the step of :func:`chunkjax.offload`, its :class:`~chunkjax.fit.FitReport`, the
:class:`~chunkjax.offload_plan.OffloadPlan` of :func:`chunkjax.plan_offload`, a
:class:`~chunkjax.fit.FitProblem` from :func:`chunkjax.fit.prepare`, a
:class:`~chunkjax.schedule.Schedule` from :func:`chunkjax.fit.plan`) and returns a
``matplotlib.figure.Figure`` (made without pyplot, so nothing global is kept; ``path=`` also
saves it). Matplotlib is imported inside the functions: ``import chunkjax`` does not need it.

The quantities drawn are PatrickStar's (Fang et al., arXiv 2108.05818): the memory tide of
section 4.2 (non-model bytes per moment), the chunk placement between memory kinds and the
fetches / evictions per moment of section 5 (Belady's rule here), and where each chunk's update
runs (section 4.3). Bytes are those of :mod:`chunkjax.predict` (one rank's under ZeRO).

Example::

    fitted = cj.fit_step(stages, params, batch, host_optimizer=spec, device_budget="4MiB")
    plots.plot_tide(fitted, path="tide.png")
    plots.plot_schedule(fitted)
"""
from __future__ import annotations

import numbers
import pathlib
from typing import Mapping, Sequence

from chunkjax.memory import DEVICE
from chunkjax.schedule import (DEVICE_UPDATE, HOST_UPDATE, NO_UPDATE, STORAGE_UPDATE, STREAMED_UPDATE, UPDATE_LOCATIONS,
                               Schedule)

#: colour of each tide phase (bars of :func:`plot_tide`)
PHASE_COLORS = {"forward": "tab:blue", "forward+backward": "tab:purple", "backward": "tab:orange"}
#: colour of each part of the device bytes (:func:`chunkjax.predict.device_bytes_by_kind`'s keys)
KIND_COLORS = {"resident model data": "tab:green", "non-model (tide)": "tab:blue",
               "gradients held": "tab:red", "fetched chunk buffers": "tab:orange"}
#: colour of each update location (the strip beside :func:`plot_schedule`)
UPDATE_COLORS = {DEVICE_UPDATE: "#546e7a", STREAMED_UPDATE: "#f9a825", HOST_UPDATE: "#1565c0", STORAGE_UPDATE: "#6a1b9a",
                 NO_UPDATE: "#e0e0e0"}
#: colours of a residency image: not on the device, a fetched copy, placed on the device
RESIDENCY_COLORS = ("white", "#b7e4a7", "#2e7d32")
#: fetch marks are drawn this far (moments) left of their moment's centre, release marks right of it
FETCH_EVICT_DX = 0.25
#: the memory kinds of :func:`placement_bytes` (``disk``: the storage directories) and the chunk
#: lists in each (``disk staging``: the near-storage workers' staging buffers, host memory)
PLACEMENT_KINDS = ("device", "pinned_host", "host (pageable)", "disk")
PLACEMENT_LISTS = ("compute params", "master params + optimizer state", "gradients", "disk staging")


# ---- inputs ----------------------------------------------------------------------------------

def _parts(obj, schedule=None):
    """(problem or None, schedule or None, budget in force or None) of a Fitted, FitReport,
    OffloadPlan, FitProblem or Schedule; ``schedule`` overrides the one found."""
    from chunkjax.fit import FitProblem, FitReport, Fitted
    from chunkjax.offload_plan import OffloadPlan

    problem = budget = found = None
    if isinstance(obj, Fitted) or (isinstance(getattr(obj, "report", None), FitReport)
                                   and isinstance(getattr(obj, "problem", None), FitProblem)):
        # what fit_step returns, or a step that carries both (chunkjax.offload's)
        problem, found, budget = obj.problem, obj.report.schedule, obj.report.budget_bytes
    elif isinstance(obj, (FitReport, OffloadPlan)):  # OffloadPlan: chunkjax.plan_offload's (problem, schedule)
        problem = obj.problem if isinstance(obj, OffloadPlan) else None
        found, budget = obj.schedule, obj.budget_bytes
    elif isinstance(obj, FitProblem):
        problem = obj
    elif isinstance(obj, Schedule):
        found = obj
    elif obj is not None:
        raise TypeError(f"cannot plot a {type(obj).__name__}: pass what chunkjax.fit_step or chunkjax.offload "
                        "returns, its report, an OffloadPlan (chunkjax.plan_offload), a FitProblem (chunkjax.fit.prepare) or a "
                        "Schedule (chunkjax.fit.plan)")
    s = schedule if schedule is not None else found
    if budget is None and isinstance(s, Schedule):
        budget = s.budget_bytes
    return problem, s, budget


def _need(problem, what: str, s=None):
    if problem is None:
        alone = (" (a Schedule alone holds no stage traces: plot it with plot_device_bytes, plot_schedule or "
                 "plot_step_time)") if isinstance(s, Schedule) else ""
        raise ValueError(f"{what} needs the fit problem: pass what chunkjax.fit_step or chunkjax.offload returns, an "
                         f"OffloadPlan (chunkjax.plan_offload) or the FitProblem of chunkjax.fit.prepare (with "
                         f"schedule=...){alone}")
    return problem


def _need_schedule(s, what: str) -> Schedule:
    if not isinstance(s, Schedule):
        raise ValueError(f"{what} needs a schedule: pass the Fitted of chunkjax.fit_step, or schedule= "
                         "(chunkjax.fit.plan(problem, budget_bytes))")
    return s


def _what(x) -> str:
    if isinstance(x, Mapping):
        return "an empty mapping" if not x else f"a mapping of {type(next(iter(x))).__name__} to " \
            f"{type(next(iter(x.values()))).__name__}"
    return f"a {type(x).__name__}"


def tide_of(problem):
    """The :class:`~chunkjax.tide.Tide` of a fit problem (its traces at its chunk size)."""
    from chunkjax.tide import memory_tide
    return memory_tide(problem.traces, problem.layout.chunk_size)


def byte_unit(max_bytes: float) -> tuple[str, int]:
    """(unit name, bytes per unit) for axes whose largest value is ``max_bytes`` (bytes)."""
    for name, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if max_bytes >= k:
            return name, k
    return "bytes", 1


def _figure(figsize, nrows=1, ncols=1, **kw):
    from matplotlib.figure import Figure
    fig = Figure(figsize=figsize, layout="constrained")
    return fig, fig.subplots(nrows, ncols, squeeze=False, **kw)


def _done(fig, path):
    if path is not None:
        pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    return fig


def _cuts(ax, segments):
    for cut in list(segments)[1:]:
        ax.axvline(cut - 0.5, color="k", ls=":", lw=0.8)


# ---- the memory tide --------------------------------------------------------------------------

def plot_tide(obj, *, schedule: Schedule | None = None, budget_bytes: int | None = None, path=None,
              names: bool | None = None):
    """The memory tide: non-model bytes at each moment against the device budget.

    Args:
      obj: a ``Fitted`` (:func:`chunkjax.fit_step`) or a ``FitProblem`` (:func:`chunkjax.fit.prepare`).
      schedule: with a ``FitProblem``, a schedule whose resident model data is drawn (optional).
      budget_bytes: the device budget (bytes); default the fitted budget or the schedule's.
      path: also save the figure there (PNG, or any format matplotlib infers from the suffix).
      names: label moments with stage names (default: when at most 40 moments).

    Returns:
      a Figure with two axes: bars of non-model bytes per moment (one bar per moment, coloured by
      phase; height in the unit of the y label), the budget (``label="device budget"``) and, with a
      schedule, the budget minus the model data resident between steps (``label="room beside
      resident model data"``: what fetched chunks and the tide share); below, chunks read per moment.

    Raises:
      ValueError: no fit problem given (a bare Schedule holds no stage traces; one line naming
        the plots that take one).
    """
    problem, s, budget = _parts(obj, schedule)
    tide = tide_of(_need(problem, "plot_tide", s))
    budget = budget_bytes if budget_bytes is not None else budget
    nm = [m.non_model_bytes for m in tide.moments]
    unit, k = byte_unit(max(nm + [budget or 0]))
    fig, axes = _figure((10, 4.2), 2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ax, ax2 = axes[:, 0]
    x = [m.index for m in tide.moments]
    ax.bar(x, [b / k for b in nm], color=[PHASE_COLORS[m.phase] for m in tide.moments], width=0.9)
    if budget is not None:
        ax.axhline(budget / k, color="k", lw=1.2, label="device budget")
        if isinstance(s, Schedule):
            ax.axhline((budget - s.predicted.device_model_bytes) / k, color="tab:green", ls="--", lw=1,
                       label="room beside resident model data")
    from matplotlib.patches import Patch
    handles = [Patch(color=c, label=p) for p, c in PHASE_COLORS.items()]
    fig.legend(handles=handles + ax.get_legend_handles_labels()[0], fontsize=8, loc="outside right upper")
    ax.set_ylabel(f"non-model {unit}")
    ax.set_title(f"memory tide: peak non-model {tide.peak_non_model_bytes / k:.3g} {unit} over "
                 f"{len(tide.moments)} moments, {problem.layout.n_chunks} chunks", fontsize=10)
    ax2.bar(x, [len(m.chunks) for m in tide.moments], color="gray", width=0.9)
    from matplotlib.ticker import MaxNLocator
    ax2.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set_ylabel("chunks read")
    ax2.set_xlabel("moment")
    if names if names is not None else len(x) <= 40:
        ax2.set_xticks(x)
        ax2.set_xticklabels([m.name for m in tide.moments], rotation=60, fontsize=7)
    return _done(fig, path)


# ---- device bytes per moment ------------------------------------------------------------------

def released_bytes(problem, s: Schedule) -> list[int]:
    """Device bytes per moment if fetched copies live only as long as :meth:`Schedule.residency`
    holds them (released after the last read before a fresh fetch), plus fetches in flight; each
    copy is one chunk buffer (``ChunkBytes.buffer`` bytes).

    The prediction (:attr:`Prediction.device_bytes_per_moment`) instead counts every fetched copy
    until Belady's rule has to evict it; this is what the step's programs are told to keep.
    Returns one int (bytes) per moment.
    """
    from chunkjax.predict import device_bytes_by_kind

    parts = device_bytes_by_kind(s, problem.traces, tide_of(problem), problem.cb_rank)
    res, T = s.residency(), len(s.moments)
    out = []
    for t in range(T):
        copies = sum(1 for c in range(s.n_chunks) if res[c][t] and s.param_kinds[c] != DEVICE)
        inflight = sum(len(s.fetch[u]) for u in range(t + 1, min(T, t + 1 + s.prefetch)))
        out.append(parts["resident model data"][t] + parts["non-model (tide)"][t] + parts["gradients held"][t]
                   + (copies + inflight) * problem.cb_rank.buffer)
    return out


def plot_device_bytes(obj, schedule: Schedule | Mapping[str, Schedule] | None = None, *,
                      budget_bytes: int | None = None, released: bool = True, path=None):
    """Predicted device bytes per moment, stacked by kind, against the budget.

    Args:
      obj: a ``Fitted``, a ``FitProblem`` (then ``schedule`` is required) or a ``Schedule`` alone
        (e.g. ``Schedule.from_dict`` of a recorded run: its total bytes per moment, not split).
      schedule: a schedule, or ``{name: schedule}`` to draw several side by side (e.g. the tide plan
        and the ``all_host`` / ``zero_offload`` baselines of the same problem); default the fitted one.
      budget_bytes: the budget line (bytes); default the fitted budget or each schedule's.
      released: also draw :func:`released_bytes` (dashed).
      path: also save the figure there.

    Returns:
      a Figure with one axes per schedule: a stack plot of
      :func:`chunkjax.predict.device_bytes_by_kind` (four layers, in the order of
      :data:`KIND_COLORS`; their sum per moment is ``predicted.device_bytes_per_moment``), the
      budget (``label="budget"``), program cuts (dotted) and the peak and step time in the title.

    Raises:
      ValueError: no schedule given.
    """
    import numpy as np

    from chunkjax.predict import device_bytes_by_kind

    problem, s, budget = _parts(obj, schedule if isinstance(schedule, Schedule) else None)
    scheds = dict(schedule) if isinstance(schedule, Mapping) else {"chunkjax": _need_schedule(s, "plot_device_bytes")}
    tide = tide_of(problem) if problem is not None else None
    top = max(max(x.predicted.device_bytes_per_moment) for x in scheds.values())
    unit, k = byte_unit(max(top, budget_bytes or budget or 0))
    fig, axes = _figure((max(10, 5 * len(scheds) + 1), 3.8), 1, len(scheds), sharey=True)
    for ax, (name, x) in zip(axes[0], scheds.items()):
        b = budget_bytes if budget_bytes is not None else budget if budget is not None else x.budget_bytes
        t = np.arange(len(x.moments))
        if problem is None:  # a schedule alone (e.g. recorded): its total, and the resident model data
            ax.fill_between(t, np.asarray(x.predicted.device_bytes_per_moment) / k, step="mid", color="tab:blue",
                            alpha=0.5, label="predicted device bytes")
            ax.axhline(x.predicted.device_model_bytes / k, color=KIND_COLORS["resident model data"],
                       label="resident model data")
        else:
            parts = device_bytes_by_kind(x, problem.traces, tide, problem.cb_rank)
            ax.stackplot(t, *[np.asarray(v) / k for v in parts.values()], labels=list(parts),
                         colors=[KIND_COLORS[p] for p in parts], step="mid")
        ax.axhline(b / k, color="k", lw=1, label="budget")
        if released and problem is not None:
            ax.step(t, np.asarray(released_bytes(problem, x)) / k, where="mid", color="k", lw=0.8, ls="--",
                    label="copies released as Schedule.evict says")
        _cuts(ax, x.segments)
        p = x.predicted
        ax.set_title(f"{name}: peak {p.peak_device_bytes / k:.3g} {unit} "
                     f"({'fits' if p.peak_device_bytes <= b else 'over budget'}), step {p.time.step_s:.3g} s",
                     fontsize=9)
        ax.set_xlabel("moment")
    axes[0, 0].set_ylabel(f"device {unit}")
    fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="outside lower center", ncol=6, fontsize=8)
    return _done(fig, path)


# ---- the schedule -----------------------------------------------------------------------------

def _draw_residency(ax, resident, *, placed=None, accesses=None, fetch=None, evict=None, segments=(0,)):
    """Draw a residency on ``ax`` (arguments as :func:`plot_residency`); returns its AxesImage."""
    import numpy as np
    from matplotlib.colors import ListedColormap

    res = np.asarray(resident, dtype=bool)
    kept = np.zeros(res.shape[0], bool) if placed is None else np.asarray(placed, bool)
    img = np.where(res, np.where(kept[:, None], 2.0, 1.0), 0.0)
    im = ax.imshow(img, aspect="auto", interpolation="nearest", cmap=ListedColormap(RESIDENCY_COLORS),
                   vmin=0, vmax=2, origin="lower")
    for marks, style, label, dx in ((accesses, dict(marker=".", color="k", ms=2.5), "read", 0.0),
                                    (fetch, dict(marker="^", color="tab:orange", ms=4), "fetch", -FETCH_EVICT_DX),
                                    (evict, dict(marker="v", color="tab:red", ms=3), "evict", FETCH_EVICT_DX)):
        if marks is not None:
            pts = [(t, c) for t, cs in enumerate(marks) for c in cs]
            ax.plot([p[0] + dx for p in pts], [p[1] for p in pts], ls="none", label=label, **style)
    _cuts(ax, segments)
    ax.set_xlabel("moment")
    ax.set_ylabel("chunk")
    return im


def plot_residency(resident: Sequence[Sequence[bool]], *, placed: Sequence[bool] | None = None,
                   accesses: Sequence[Sequence[int]] | None = None, fetch: Sequence[Sequence[int]] | None = None,
                   evict: Sequence[Sequence[int]] | None = None, segments: Sequence[int] = (0,),
                   title: str | None = None, path=None):
    """A chunk-by-moment residency of any eviction plan (e.g. :func:`chunkjax.eviction.belady`'s),
    drawn as :func:`plot_schedule` draws a schedule's.

    Args:
      resident: per chunk, per moment: a copy of the chunk is on the device.
      placed: per chunk, placed on the device between steps (darker cells); None: none are.
      accesses: per moment, chunk ids read (black dots, ``label="read"``).
      fetch: per moment, chunk ids fetched for it (``^``, ``label="fetch"``, drawn
        :data:`FETCH_EVICT_DX` left of the moment).
      evict: per moment, chunk ids released after it (``v``, ``label="evict"``, drawn
        :data:`FETCH_EVICT_DX` right of the moment).
      segments: program starts (dotted lines before each but the first).
      title: the axes title.
      path: also save the figure there.

    Returns:
      a Figure with one axes whose image has values 0 (absent), 1 (a fetched copy), 2 (placed).
    """
    n = len(resident)
    fig, axes = _figure((10, min(8.0, max(2.4, 0.16 * n + 1.2))))
    ax = axes[0, 0]
    _draw_residency(ax, resident, placed=placed, accesses=accesses, fetch=fetch, evict=evict, segments=segments)
    if any(ln.get_label() in ("read", "fetch", "evict") for ln in ax.lines):
        fig.legend(fontsize=7, loc="outside right upper")
    if title:
        ax.set_title(title, fontsize=9)
    return _done(fig, path)


def plot_schedule(obj, schedule: Schedule | None = None, *, path=None, title: str | None = None):
    """The schedule per moment: which chunks are on the device, fetches, evictions, update locations.

    Args:
      obj: a ``Fitted``, a ``FitProblem`` with ``schedule``, or a ``Schedule`` alone (then the
        reads of each moment are not drawn).
      schedule: overrides the fitted schedule.
      path: also save the figure there.
      title: the axes title (default: placement counts and fetches).

    Returns:
      a Figure whose first axes holds :func:`plot_residency` of ``schedule.residency()`` (placed
      chunks dark, fetched copies light; reads, fetches and evictions as markers; program cuts),
      and whose second, narrow axes holds one cell per chunk coloured by its update location
      (:data:`UPDATE_COLORS`, ``none``: frozen; image values index
      :data:`chunkjax.schedule.UPDATE_LOCATIONS`).

    Raises:
      ValueError: no schedule given.
    """
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    problem, s, _ = _parts(obj, schedule)
    s = _need_schedule(s, "plot_schedule")
    accesses = tide_of(problem).accesses if problem is not None else None
    fig, axes = _figure((12, min(8.0, max(2.6, 0.16 * s.n_chunks + 1.4))), 1, 2, sharey=True,
                        gridspec_kw={"width_ratios": [40, 1]})
    ax, strip = axes[0]
    _draw_residency(ax, s.residency(), placed=[k == DEVICE for k in s.param_kinds], accesses=accesses,
                   fetch=s.fetch, evict=s.evict, segments=s.segments)
    loc = np.array([[UPDATE_LOCATIONS.index(u)] for u in s.update_locations], float)
    strip.imshow(loc, aspect="auto", interpolation="nearest", origin="lower", vmin=0, vmax=len(UPDATE_LOCATIONS) - 1,
                 cmap=ListedColormap([UPDATE_COLORS[u] for u in UPDATE_LOCATIONS]))
    strip.set_xticks([0])
    strip.set_xticklabels(["update"], fontsize=8)
    strip.tick_params(left=False)
    cells = [Patch(facecolor=c, edgecolor="gray", label=lbl) for c, lbl in
             zip(RESIDENCY_COLORS[1:], ("fetched copy on device", "placed on device"))]
    upd = [Patch(color=UPDATE_COLORS[u], label="frozen (no update)" if u == NO_UPDATE else f"update on {u}")
           for u in UPDATE_LOCATIONS if u in s.update_locations]
    fig.legend(handles=cells + ax.get_legend_handles_labels()[0] + upd, fontsize=7, loc="outside right upper")
    counts = ", ".join(f"{n} {k}" for k, n in s.counts().items())  # a line of its own: wider than the axes
    ax.set_title(title or f"schedule at {s.budget_bytes / byte_unit(s.budget_bytes)[1]:.3g} "
                 f"{byte_unit(s.budget_bytes)[0]}, {s.predicted.n_fetches} fetches, {len(s.segments)} programs\n"
                 f"chunks: {counts}", fontsize=9)
    return _done(fig, path)


# ---- placement --------------------------------------------------------------------------------

def placement_bytes(problem, s: Schedule) -> dict[str, dict[str, int]]:
    """Model data per memory kind and chunk list (bytes, one rank's), as :mod:`chunkjax.predict`
    accounts it.

    ``device``: compute params of device-kind chunks, master params + optimizer state of
    device-updated chunks (their sum is ``predicted.device_model_bytes``). ``pinned_host``: compute
    params of host-kind chunks, gradients of every chunk not updated on the device, state of
    ``streamed`` chunks. ``host (pageable)``: state of ``host``-updated chunks (numpy) and the
    near-storage workers' staging buffers (``predicted.storage_host_bytes``). The two host kinds
    sum to ``predicted.host_model_bytes``. ``disk``: master params + optimizer state of
    ``storage``-updated chunks (one committed version; :mod:`chunkjax.plan_disk`). A frozen chunk
    (update location ``none``) has its params only, in their own dtype (``ChunkBytes.params_of``).
    """
    cb = problem.cb_rank
    out = {k: dict.fromkeys(PLACEMENT_LISTS, 0) for k in PLACEMENT_KINDS}
    for c, (kind, upd) in enumerate(zip(s.param_kinds, s.update_locations)):
        out["device" if kind == DEVICE else "pinned_host"]["compute params"] += cb.params_of(c)
        if upd == NO_UPDATE:
            continue
        state_kind = {DEVICE_UPDATE: "device", STREAMED_UPDATE: "pinned_host", HOST_UPDATE: "host (pageable)",
                      STORAGE_UPDATE: "disk"}[upd]
        out[state_kind]["master params + optimizer state"] += cb.state
        if upd != DEVICE_UPDATE:
            out["pinned_host"]["gradients"] += cb.grad
    out["host (pageable)"]["disk staging"] += int(s.predicted.storage_host_bytes or 0)
    return out


def plot_placement(obj, schedule: Schedule | None = None, *, path=None):
    """Where the model data lives: bytes per memory kind and chunk list, chunks per placement.

    Args:
      obj: a ``Fitted``, or a ``FitProblem`` with ``schedule``.
      schedule: overrides the fitted schedule.
      path: also save the figure there.

    Returns:
      a Figure with two axes: horizontal bars, one row per kind of :data:`PLACEMENT_KINDS`, stacked
      by :data:`PLACEMENT_LISTS` (widths are :func:`placement_bytes` in the x label's unit); and one
      horizontal bar per ``schedule.counts()`` key, in its order from the top (width: chunks per
      params kind and update location).

    Raises:
      ValueError: no fit problem or no schedule given.
    """
    problem, s, _ = _parts(obj, schedule)
    problem = _need(problem, "plot_placement", s)
    s = _need_schedule(s, "plot_placement")
    pb = placement_bytes(problem, s)
    unit, k = byte_unit(max(sum(v.values()) for v in pb.values()))
    fig, axes = _figure((11, 2.8), 1, 2, gridspec_kw={"width_ratios": [3, 2]})
    ax, ax2 = axes[0]
    left = [0.0] * len(PLACEMENT_KINDS)
    for lst, c in zip(PLACEMENT_LISTS, ("tab:blue", "tab:green", "tab:red", "tab:purple")):
        w = [pb[kind][lst] / k for kind in PLACEMENT_KINDS]
        ax.barh(PLACEMENT_KINDS, w, left=left, color=c, label=lst)
        left = [a + b for a, b in zip(left, w)]
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    fig.legend(*ax.get_legend_handles_labels(), fontsize=7, loc="outside lower center", ncol=len(PLACEMENT_LISTS))
    ax.set_title(f"model data and gradient buffers: {sum(left):.3g} {unit} ({s.n_chunks} chunks x {problem.layout.chunk_size} elements)",
                 fontsize=9)
    counts = s.counts()  # one row each: side by side, labels as long as "params pinned_host" overlapped
    ax2.barh(range(len(counts)), list(counts.values()), color="gray")
    ax2.set_yticks(range(len(counts)))
    ax2.set_yticklabels([c.replace("params_", "params ").replace("/update_", "\nupdate ") for c in counts], fontsize=7)
    ax2.invert_yaxis()
    ax2.set_xlabel("chunks")
    ax2.set_title("chunks per placement", fontsize=9)
    return _done(fig, path)


# ---- budgets and time -------------------------------------------------------------------------

def plot_budget_sweep(schedules: Mapping[int, Schedule], baselines: Mapping[str, Schedule] | None = None, *,
                      budget_bytes: int | None = None, path=None):
    """Predicted step time and bytes moved against the device budget.

    Args:
      schedules: ``{budget bytes: schedule planned for it}`` (e.g. ``chunkjax.fit.plan`` at each).
      baselines: ``{name: schedule}`` of static policies (budget-independent: drawn flat from their
        own peak on).
      budget_bytes: a budget to mark (dotted).
      path: also save the figure there.

    Returns:
      a Figure with two axes: predicted step seconds (``label="chunkjax"``) and bytes moved per step
      (``label="chunkjax h2d + d2h"`` and ``"chunkjax h2d"``), x in the budget unit of the x label.

    Raises:
      TypeError: ``schedules`` is not a non-empty ``{budget bytes: Schedule}`` mapping (one line).
    """
    if not isinstance(schedules, Mapping) or not schedules or not all(
            isinstance(b, numbers.Integral) and isinstance(x, Schedule) for b, x in schedules.items()):
        raise TypeError(f"plot_budget_sweep takes {{budget bytes: Schedule}} planned at several budgets (e.g. "
                        f"{{b: chunkjax.fit.plan(problem, b) for b in budgets}}), got {_what(schedules)}: for one "
                        "plan use plot_device_bytes or plot_tide")
    budgets = sorted(schedules)
    unit, k = byte_unit(max(budgets))
    munit, mk = byte_unit(max([schedules[b].predicted.h2d_bytes_per_step + schedules[b].predicted.d2h_bytes_per_step
                               for b in budgets] + [1]))
    fig, axes = _figure((12, 3.8), 1, 2)
    ax, ax2 = axes[0]
    x = [b / k for b in budgets]
    ps = [schedules[b].predicted for b in budgets]
    ax.plot(x, [p.time.step_s for p in ps], "o-", label="chunkjax")
    ax2.plot(x, [(p.h2d_bytes_per_step + p.d2h_bytes_per_step) / mk for p in ps], "o-", label="chunkjax h2d + d2h")
    ax2.plot(x, [p.h2d_bytes_per_step / mk for p in ps], ".--", color="tab:blue", lw=0.8, label="chunkjax h2d")
    for (name, bl), style in zip((baselines or {}).items(), ("s-", "d-", "x-", "*-")):
        p = bl.predicted
        xs = [p.peak_device_bytes / k] + [v for v in x if v * k > p.peak_device_bytes]
        ax.plot(xs, [p.time.step_s] * len(xs), style, ms=3, label=f"{name} (fits from {p.peak_device_bytes / k:.3g} {unit})")
        ax2.plot(xs, [(p.h2d_bytes_per_step + p.d2h_bytes_per_step) / mk] * len(xs), style, ms=3,
                 label=f"{name} h2d + d2h")
    for a in (ax, ax2):
        if budget_bytes is not None:
            a.axvline(budget_bytes / k, color="gray", ls=":", lw=1)
        a.set_xlabel(f"device budget ({unit})")
        a.set_ylim(bottom=0)
        a.legend(fontsize=7)
    ax.set_ylabel("predicted step s")
    ax2.set_ylabel(f"{munit} moved per step")
    return _done(fig, path)


def plot_step_time(obj, schedule: Schedule | None = None, *, measured_s: Sequence[float] | None = None, path=None):
    """Where the predicted step time goes, against measured step times.

    Args:
      obj: a ``Fitted``, ``FitReport`` or ``Schedule``.
      schedule: overrides the fitted schedule.
      measured_s: measured step times (seconds): their median is drawn with their range.
      path: also save the figure there.

    Returns:
      a Figure with one axes: a ``predicted`` bar stacked by forward, backward (then the gradient
      window's stall, when there is one) and device update, then the exposed host update and the
      streamed update side by side (they run at once); with cross-step overlap
      (``time.cross_step``) the device and streamed updates run beside the exposed host update
      (the next forward's wait for the host tail), and a step bound by the host thread gets a
      thin bar of its whole work. The bars end at ``predicted.time.step_s`` (seconds; a disk
      tier's exposed part is not drawn); with ``measured_s``, a ``measured`` bar at their median.
    """
    import numpy as np

    _, s, _ = _parts(obj, schedule)
    t = _need_schedule(s, "plot_step_time").predicted.time
    fig, axes = _figure((8, 1.9))
    ax = axes[0, 0]
    left = 0.0
    for name, v, c in (("forward", t.forward_s, "tab:blue"), ("backward", t.backward_s, "tab:orange")):
        ax.barh(["predicted"], [v], left=left, color=c, label=f"{name} {v:.3g} s")
        left += v
    after_bwd, left, dev = left, left + t.window_stall_s, t.device_update_s
    # what runs at once is drawn side by side in half-height bars (cost.PipelinedStepTime.step_s):
    # joined, the device updates, then the host thread's exposed tail beside the streamed updates;
    # cross-step, the device then the streamed updates beside the next forward's wait for the host tail
    bars = ((("device update", dev, "tab:green", -0.2, 0.4, left),
             ("exposed host update", t.host_update_exposed_s, "tab:red", 0.2, 0.4, left),
             ("streamed update", t.streamed_update_s, "tab:olive", -0.2, 0.4, left + dev)) if t.cross_step else
            (("device update", dev, "tab:green", 0.0, 0.8, left),
             ("exposed host update", t.host_update_exposed_s, "tab:red", 0.2, 0.4, left + dev),
             ("streamed update", t.streamed_update_s, "tab:olive", -0.2, 0.4, left + dev)))
    for name, v, c, dy, h, x in bars:
        ax.barh([0 + dy], [v], left=x, height=h, color=c, label=f"{name} {v:.3g} s")
    if t.window_stall_s:
        ax.barh([0], [t.window_stall_s], left=after_bwd, color="lightgray",
                label=f"gradient window stall {t.window_stall_s:.3g} s")
    if t.cross_step and t.host_update_s > max(x + v for _, v, _, _, _, x in bars):
        ax.barh([0.45], [t.host_update_s], height=0.1, color="tab:red",
                label=f"host thread's whole work {t.host_update_s:.3g} s (bounds the step)")
    if measured_s is not None and len(measured_s):
        m = float(np.median(measured_s))
        ax.barh(["measured"], [m], color="gray", label=f"measured median {m:.3g} s")
        ax.errorbar([m], ["measured"], xerr=[[m - min(measured_s)], [max(measured_s) - m]], color="k", capsize=3)
    ax.set_xlabel("s per step")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1, 0.5))
    return _done(fig, path)


def save_figures(obj, folder, schedule: Schedule | None = None) -> dict[str, pathlib.Path]:
    """Write the tide, device bytes, schedule and placement figures of a plan into ``folder``.

    Returns ``{name: path}`` of the PNGs written (``tide``, ``device_bytes``, ``schedule``,
    ``placement``). Raises ValueError as the plot functions do.
    """
    folder = pathlib.Path(folder)
    out = {}
    for name, fn in (("tide", plot_tide), ("device_bytes", plot_device_bytes), ("schedule", plot_schedule),
                     ("placement", plot_placement)):
        out[name] = folder / f"{name}.png"
        fn(obj, schedule=schedule, path=out[name])
    return out
