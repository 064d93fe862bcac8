"""The clipping a plan expects: whether the step's host updates can overlap its backward.

With global-norm clipping (``max_grad_norm`` of the host kernel spec) a host chunk's update
needs the global gradient norm, known only at the end of the backward. The step speculates
(:mod:`chunkjax.speculate`: update as if clipping does not fire, validate at the end), but
under the default policy (``speculation_policy="after_common"``) only on a step after one whose
clipping did not fire: when clipping fires on every step (GPT training from initialisation
with ``clip_by_global_norm(1.0)``: every step of the recorded GPT3_6B runs) the host thread
waits for the norm and its whole update starts at the backward's end, beside the streamed
pipeline; the next step's forward then waits per program for the host chunks it reads
(:mod:`chunkjax.cross_step`). The planner times the step under one expectation:

``"rare"``
    clipping (or a non-finite skip) rarely fires: the speculation holds and host chunks update
    while the backward runs (:func:`chunkjax.cost.program_timeline`).
``"fires"``
    clipping fires on most steps: every host update starts at the backward's end
    (``norm_wait`` of :func:`chunkjax.predict.predict` and :func:`chunkjax.cost.predict_pipelined_step`);
    the update split (:func:`chunkjax.plan_split.split_updates`) then moves as many host
    chunks to the streamed pipeline as shortens the work left after the norm is known: the
    host kernel and the streamed chunks (both PCIe directions in flight) both run from there.
``"auto"`` (the fit path's default)
    ``"fires"`` when the host kernel clips by global norm, else ``"rare"``: a clipped run is
    planned for the case in which the default policy never speculates (planned for ``"rare"``
    it ran 2.06x slower than its plan: 2.96 s measured against 1.44 s, ``docs/benchmarks.md``).
    Pass ``"rare"`` for a run whose clipping seldom fires (e.g. fine-tuning with small
    gradients): its streamed chunks would otherwise lengthen every step whose speculation holds.

A ``"rare"`` step speculates only as far as its bound lets it (the step's ``speculation_bytes``,
:func:`chunkjax.fit_host.speculation_bytes`): :func:`speculation_bound` gives the bound in
parameters, which the cost model's ``speculation_params`` times (the rest of the host chunks update
from the backward's end, each speculated one also copies its backup). The planner does not use it
(its search times every host chunk speculating, for free); a built step's reported prediction does
(:func:`predicted_time`: the fit path's :class:`chunkjax.fit_report.FitReport` and
``experiments/bench_chunkjax.py``, each keeping the planner's figure as ``step_s_planned``).

Exactness is not affected: the expectation only changes where chunks update (device, host or
streamed), and every location gives optax's result.
"""
from __future__ import annotations

#: The expectations :func:`resolve` takes.
CLIP_EXPECT = ("auto", "fires", "rare")


def resolve(clip_expect: str, host_optimizer=None) -> str:
    """``"fires"`` or ``"rare"`` for a requested expectation (module docstring).

    Args:
      clip_expect: one of :data:`CLIP_EXPECT`.
      host_optimizer: the host kernel spec (:mod:`chunkjax.host_update`; its ``max_grad_norm``)
        or None (no host kernel: nothing waits for the norm on the host).

    Raises:
      ValueError: an unknown expectation (one line naming the accepted ones); ``"fires"`` for a
        host spec that does not clip (its ``max_grad_norm`` None: nothing ever fires, and the plan
        would make every host update wait for a norm no one needs).
    """
    if clip_expect not in CLIP_EXPECT:
        raise ValueError(f"clip_expect={clip_expect!r}: use one of {', '.join(CLIP_EXPECT)}")
    if clip_expect == "fires" and host_optimizer is not None and getattr(host_optimizer, "max_grad_norm", None) is None:
        raise ValueError(f"clip_expect='fires' with a host optimizer that does not clip ({type(host_optimizer).__name__}"
                         "(max_grad_norm=None)): set its max_grad_norm, or use clip_expect='auto'")
    if clip_expect != "auto":
        return clip_expect
    return "fires" if getattr(host_optimizer, "max_grad_norm", None) is not None else "rare"


def norm_wait(clip_expect: str) -> bool:
    """Whether a plan for ``clip_expect`` (``"fires"`` or ``"rare"``) times the host updates at the
    backward's end (:func:`chunkjax.predict.predict`'s ``norm_wait``).

    Raises:
      ValueError: not ``"fires"`` or ``"rare"`` (``"auto"`` is resolved by the fit path: :func:`resolve`).
    """
    if clip_expect not in ("fires", "rare"):
        raise ValueError(f"clip_expect={clip_expect!r}: the planner takes 'fires' or 'rare' "
                         "('auto' is resolved from the host optimizer by chunkjax.fit)")
    return clip_expect == "fires"


def both_ways(s, cb, *, chunk_size: int, traces, tide, rates, flops_per_step: float, micro_batches: int = 1,
              cross_step: bool = False, speculation_params: int | None = None,
              backup_bytes_per_param: float = 0.0) -> dict[str, float]:
    """Predicted seconds of schedule ``s`` (one device) if clipping fires and if it is rare,
    whichever it was planned for: ``{"fires": s, "rare": s}`` (:func:`chunkjax.program_cut.retime`);
    the rare case with the speculation bounded (:func:`speculation_bound`; None: unbounded)."""
    from chunkjax.program_cut import retime
    bound = dict(speculation_params=speculation_params, backup_bytes_per_param=backup_bytes_per_param)
    return {k: retime(s, cb, chunk_size=chunk_size, traces=traces, tide=tide, rates=rates,
                      flops_per_step=flops_per_step, micro_batches=micro_batches, cross_step=cross_step,
                      norm_wait=k == "fires", **({} if k == "fires" else bound)).time.step_s
            for k in ("fires", "rare")}


def speculation_bound(step, cb, chunk_size: int) -> tuple[int | None, float]:
    """``(speculation_params, backup_bytes_per_param)`` of a built step's speculative host updates
    (:mod:`chunkjax.speculate`), for the cost model (:func:`chunkjax.cost.predict_pipelined_step`)
    on one device: ``(None, 0.0)`` when the step does not speculate (no clipping, no non-finite
    skip: every host chunk updates as its gradient completes). Else what its bound
    (``step.speculation_bytes``; None: :func:`chunkjax.speculate.auto_backup_bytes`, read now) lets
    speculate (:func:`params_within`).

    Args:
      step: a :class:`chunkjax.ChunkedStep` (its ``host_optimizer``, ``skips_nonfinite``,
        ``speculation_bytes`` and ``rollback``).
      cb: one chunk's :class:`chunkjax.predict.ChunkBytes`. chunk_size: its elements.
    """
    spec = step.host_optimizer
    if spec is None or (getattr(spec, "max_grad_norm", None) is None and not step.skips_nonfinite):
        return None, 0.0
    from chunkjax.speculate import auto_backup_bytes
    bound = auto_backup_bytes() if step.speculation_bytes is None else int(step.speculation_bytes)
    return params_within(bound, spec, step.rollback, cb, chunk_size)


def params_within(bound_bytes: int, host_optimizer, rollback: str, cb, chunk_size: int) -> tuple[int, float]:
    """``(speculation_params, backup_bytes_per_param)`` of a speculation bounded by ``bound_bytes``:
    the whole chunks the bound lets speculate, in parameters. Rollback ``"backup"``: the pool holds
    each chunk's backup alone (:func:`chunkjax.speculate.backup_bytes_per_param` of the host
    kernel's state, 12 bytes per AdamW parameter; :func:`chunkjax.fit_host.speculation_bytes`
    leaves the kept gradients out of the bound), copied once a step; ``"invert"``: the bound holds
    the kept gradients (``cb.grad`` bytes a chunk) and nothing is copied (0.0).

    Args:
      bound_bytes: the bound (bytes, >= 0). host_optimizer: the host kernel spec
        (:mod:`chunkjax.host_update`). rollback: ``"backup"`` or ``"invert"``.
      cb: one chunk's :class:`chunkjax.predict.ChunkBytes`. chunk_size: its elements.
    """
    if rollback == "invert":
        return int(bound_bytes) // max(1, cb.grad) * chunk_size, 0.0
    from chunkjax.speculate import backup_bytes_per_param
    per = backup_bytes_per_param(host_optimizer.host_state(1))
    return int(bound_bytes) // (per * chunk_size) * chunk_size, float(per)


def retime_keywords(problem, schedule) -> dict | None:
    """The keywords that retime ``schedule`` as the planner timed it (:func:`chunkjax.program_cut.retime`;
    its traces with the schedule's remat): one device without micro-batches or storage chunks,
    else None (retiming is not valid there).

    Args:
      problem: the plan's :class:`chunkjax.fit.FitProblem`. schedule: its
        :class:`chunkjax.schedule.Schedule`.
    """
    if problem.n_ranks > 1 or problem.micro_batches > 1 or schedule.predicted.storage_chunks:
        return None
    from chunkjax.remat import with_remat
    from chunkjax.tide import memory_tide
    tr = with_remat(problem.traces, problem.remat_figures, schedule.remat) if schedule.remat else problem.traces
    return dict(chunk_size=problem.layout.chunk_size, traces=tr, tide=memory_tide(tr, problem.layout.chunk_size),
                rates=problem.rates, flops_per_step=problem.flops_per_step, cross_step=problem.cross_step)


def bound_keywords(problem, step) -> dict:
    """``{"speculation_params", "backup_bytes_per_param"}`` of a built ``step``'s speculation
    (:func:`speculation_bound` with ``problem.cb_rank``); unbounded (``None, 0.0``) without a step
    (None) or on several devices."""
    n, bpp = (None, 0.0) if step is None or problem.n_ranks > 1 else speculation_bound(
        step, problem.cb_rank, problem.layout.chunk_size)
    return {"speculation_params": n, "backup_bytes_per_param": bpp}


def planned_bound(problem) -> dict:
    """:func:`bound_keywords` of a plan whose step is not built (:func:`chunkjax.plan_offload`, the
    planner CLI on another machine's shapes): the step's default backup pool,
    :data:`chunkjax.speculate.DEFAULT_BACKUP_BYTES` (the most a run's pool holds: a run gets less on
    a host with under twice it available, or where the fit path's host check leaves less), in whole
    chunks by the rollback's rule (:func:`params_within`); unbounded (``None, 0.0``) where nothing
    speculates: several devices, no host kernel, or one that neither clips by global norm nor skips
    non-finite steps (``problem.nonfinite``).

    Args:
      problem: the plan's :class:`chunkjax.fit.FitProblem`.
    """
    from chunkjax.nonfinite import skips
    spec = problem.host_optimizer
    if problem.n_ranks > 1 or spec is None or (getattr(spec, "max_grad_norm", None) is None
                                               and not skips(problem.nonfinite)):
        return {"speculation_params": None, "backup_bytes_per_param": 0.0}
    from chunkjax.speculate import DEFAULT_BACKUP_BYTES
    n, bpp = params_within(DEFAULT_BACKUP_BYTES, spec, problem.rollback, problem.cb_rank, problem.layout.chunk_size)
    return {"speculation_params": n, "backup_bytes_per_param": bpp}


def bound_record(bound: dict, chunk_size: int, bound_bytes: int | None, rollback: str | None) -> dict:
    """A report's ``speculation_bound``: the bound (``bound_bytes``, None: the step's default), the
    chunks and parameters it lets speculate (None: unbounded or no speculation), the rollback and
    the backup bytes copied per speculated parameter. ``bound``: :func:`bound_keywords`'s."""
    n = bound["speculation_params"]
    return {"bytes": bound_bytes, "params": n, "rollback": rollback, "chunks": None if n is None else n // chunk_size,
            "backup_bytes_per_param": bound["backup_bytes_per_param"]}


def predicted_time(problem, schedule, bound: dict):
    """The predicted step a report gives (:class:`chunkjax.cost.PipelinedStepTime`, seconds):
    ``schedule.predicted.time`` (the same object), except for a plan timed with the speculation
    holding (``problem.clip_expect`` ``"rare"``) whose step speculates (``bound``'s
    ``speculation_params`` not None: clipping or a non-finite skip) on one device without
    micro-batches or storage chunks: that plan retimed with the bound
    (:func:`chunkjax.program_cut.retime`: only the bound's chunks update before the norm is known,
    each copying its backup; the rest after the backward). A report keeps the planner's own figure
    (every host chunk speculating, for free) beside this one.

    Args:
      problem: the plan's :class:`chunkjax.fit.FitProblem`. schedule: its one-device
        :class:`chunkjax.schedule.Schedule`. bound: :func:`bound_keywords` (or a dict of the same
        keys from :func:`params_within`).
    """
    kw = retime_keywords(problem, schedule)
    if kw is None or norm_wait(problem.clip_expect) or bound["speculation_params"] is None:
        return schedule.predicted.time
    from chunkjax.program_cut import retime
    return retime(schedule, problem.cb_rank, **kw, **bound).time
