"""The one fit path: a budget in, a step that fits it out (issue 20, item 2; issue 21, item 4).

Every entry point that builds a step from a budget (the main job, fine-tuning, the benchmark, the
sweep) goes through here, so that they all plan, check and re-plan by one rule::

    prepare:  params -> layout (first-use order) -> host-memory lower bound -> stage traces
    fit:      budget ("auto" or bytes) -> plan (the tide schedule) -> host-memory check
              -> step -> compile the programs that will run -> re-plan within HEADROOM

Planning is PatrickStar's (Fang et al., arXiv 2108.05818, sections 4.2-4.3 and 5) as :mod:`chunkjax.schedule`
implements it; ZeRO stages 1-3 over a data mesh (Rajbhandari et al., SC 2020) plan each rank's memory
(``plan_schedule(..., ranks=, zero_stage=)``). Nothing here allocates model data: the caller initialises the
returned step (``step.init(params or leaf_init)``) once the plan is known to fit the device and the host.

Why compile: the tide accounts what the traced stages keep alive, but XLA may keep more (fusion buffers, the order
it frees temporaries in). On an accelerator the compiled programs' memory analysis plus the state kept beside them
is checked against :data:`HEADROOM` of the budget; when over, the budget given to the planner shrinks by the
overshoot and the plan is made again. An ``"auto"`` budget (chosen here, not by the user) is raised to what the
compiled step needs instead.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from chunkjax import clip_plan
from chunkjax.cost import Rates
from chunkjax.dtypes import compute_dtype_of
from chunkjax.errors import HostBudgetError, PinnedLimitError, PlanError
from chunkjax.fit_batch import batch_rows, rows_of, step_flops
from chunkjax.fit_report import FitReport, describe, with_speculation_bound  # noqa: F401 (describe re-exported)
from chunkjax.fit_host import fit_host, host_bytes_of, pinned_limit_error, speculation_bytes
from chunkjax.host_memory import available_for_plan, check_host_lower_bound, process_bytes
from chunkjax.layout import ChunkLayout, build_layout, first_use_order
from chunkjax.loss_weight import check_scalar_loss
from chunkjax.nonfinite import skips as nonfinite_skips
from chunkjax.optim import check_elementwise, refuse_masks, state_bytes_per_chunk
from chunkjax.plan import plan_schedule
from chunkjax.plan_micro import passes_of, plan_micro_batches, resolve_unroll
from chunkjax.plan_remat import remat_plan
from chunkjax.remat import remat_figures
from chunkjax.predict import ChunkBytes, chunk_bytes, device_model_bytes, update_phase_bytes
from chunkjax.stages import check_param_keys, compose_loss, differentiated, split_loss
from chunkjax.streamed import starts_early
from chunkjax.trace import trace_stages

#: Fraction of the device budget the compiled step may use (its largest program plus the resident
#: state, and the update phase); the rest is for what no program reports: cuDNN/cuBLAS workspaces,
#: the batch, fragmentation. GPT2_1B to GPT3_12B trained under 0.90 on the H200 (docs/benchmarks.md).
HEADROOM = 0.90
#: Share of the host memory available that an ``"auto"`` host budget plans for; the rest is for what
#: the accounting misses (1 % on the H200's 8B fine-tuning: ``docs/benchmarks.md``, eleventh session).
HOST_HEADROOM = 0.97
#: Re-plans after the first plan when the compiled step exceeds the headroom.
MAX_REPLANS = 4
#: The ``"auto"`` device budget: the smallest budget with every chunk offloaded plus this fraction of
#: the model's chunk bytes (params, master params, optimizer state): most model data stays on the host.
AUTO_BUDGET_MODEL_FRACTION = 0.2


@dataclasses.dataclass(frozen=True)
class FitProblem:
    """What is fitted, everything but the device budget (from :func:`prepare`; allocates nothing).

    Attributes:
      stages: the model's stages.
      layout: the chunk layout (ZeRO: ``chunk_size`` a multiple of the ranks).
      traces: per-stage traces of one rank's micro-batch.
      cb: bytes of one whole chunk in each chunk list.
      cb_rank: bytes of one chunk on one rank (``cb`` without ZeRO).
      batch: the step's batch argument (``ShapeDtypeStruct`` s: (B, T+1) int32 tokens or a
        pytree of leaves with B rows), global over ranks.
      tx: the optax transformation of device (and streamed) updates.
      host_optimizer: the host kernel spec (:mod:`chunkjax.host_update`) or None (offloaded chunks
        then update ``streamed``).
      compute_dtype: compute params / gradients dtype.
      prefetch, segments: fetch distance (moments) and program starts of the schedule.
      micro_batches, nonfinite, loss_scaling: as :func:`chunkjax.make_chunked_step`.
      mesh, zero_stage: a 1-D ``"data"`` mesh and the ZeRO stage (1/2/3), or None and 0.
      flops_per_step, rates: training FLOPs of one rank's step and the rates (the cost model's).
      host_budget_bytes: host memory the model data of all ranks may use (planner bound), or None.
      platform: ``jax.default_backend()``.
      storage: the disk tier (:class:`chunkjax.storage.updater.StorageOptions`) or None.
      storage_devices, disk_budget_bytes: its storage devices (distinct filesystems of its
        directories, timed apart) and the bytes they may hold.
      cross_step: plan (forward cuts, :func:`chunkjax.plan_schedule`) and build the step with
        cross-step overlap (:mod:`chunkjax.cross_step`; the default); False: the step joins each
        previous one.
      remat, remat_names: which blocks keep their activations named ``remat_names`` instead of
        recomputing them (:data:`chunkjax.plan_remat.REMAT_MODES`: ``"auto"`` the planner's choice,
        :func:`chunkjax.plan_remat.plan_remat`); one device, one micro-batch; default ``"full"``.
      unroll_micro_batches: an in-program plan's micro-batch loops traced unrolled, and timed so
        (:attr:`chunkjax.schedule.Schedule.unroll_micro_batches`); False: while loops.
      clip_expect: ``"fires"`` or ``"rare"``, the clipping the plan expects (:mod:`chunkjax.clip_plan`).
      rollback: how a speculative host update is undone when clipping or a skip fires
        (:mod:`chunkjax.speculate`): ``"backup"`` (default, bit-exact, a bounded pool of copies)
        or ``"invert"`` (no copies, every host chunk can speculate, float32-exact), as
        :func:`chunkjax.make_chunked_step`.
      turn_cut: with cross-step overlap, the planner also tries program cuts finer where the forward
        ends and the backward begins (:func:`chunkjax.program_cut.turn_cut`); False: not (comparisons).
      loop_traces: the in-program traces made so far (:func:`chunkjax.plan_micro.grouped_problem`:
        each stage's micro-batch loop compiled once, not per plan), shared by the problems
        ``dataclasses.replace`` makes of this one.
    """

    stages: tuple
    layout: ChunkLayout
    traces: tuple
    cb: ChunkBytes
    cb_rank: ChunkBytes
    batch: jax.ShapeDtypeStruct
    tx: Any
    host_optimizer: Any
    compute_dtype: Any
    prefetch: int
    segments: Any
    micro_batches: int
    nonfinite: str
    loss_scaling: bool
    mesh: Any
    zero_stage: int
    flops_per_step: float
    rates: Rates
    host_budget_bytes: int | None
    platform: str
    storage: Any = None
    storage_devices: int = 0
    disk_budget_bytes: int | None = None
    cross_step: bool = True
    remat: str = "full"
    remat_names: tuple = ()
    unroll_micro_batches: bool = False
    clip_expect: str = "rare"
    rollback: str = "backup"
    turn_cut: bool = True
    loop_traces: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def n_ranks(self) -> int:
        return 1 if self.mesh is None else int(self.mesh.size)

    @property
    def storage_dirs(self) -> int:
        """The disk tier's storage directories: its near-storage worker processes, one each
        (:class:`chunkjax.storage.near.NearStorageOptimizer`; ``storage_devices`` counts filesystems)."""
        return len(self.storage.dirs) if self.storage is not None else 0

    @functools.cached_property
    def streamed_early(self) -> bool:
        """:func:`chunkjax.streamed.starts_early` for this problem's step (it traces ``tx``: once, not per plan)."""
        return starts_early(self.tx, skip=nonfinite_skips(self.nonfinite) or self.loss_scaling, loss_scaling=self.loss_scaling,
                            micro_batches=self.micro_batches, n_ranks=self.n_ranks)

    @functools.cached_property
    def remat_figures(self) -> tuple:
        """Per stage, :func:`chunkjax.remat.remat_figures` of the batch for ``remat_names``."""
        return remat_figures(self.stages, self.layout, self.batch, self.compute_dtype, self.remat_names)

    @property
    def model_chunk_bytes(self) -> int:
        """Compute params, master params and optimizer state of every chunk (padding included; frozen: params only)."""
        return self.cb.model_bytes(self.layout.n_chunks)

    @property
    def batch_sharding(self):
        """Where the step's batch goes: the first device, or split over the mesh's ranks."""
        from chunkjax.memory import DEVICE, sharding
        if self.mesh is None:
            return sharding(DEVICE)
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P
        return NamedSharding(self.mesh, P(self.mesh.axis_names[0]))


class Fitted(NamedTuple):
    """What :func:`fit_step` returns: the step (not initialised), its report and the problem."""

    step: Any
    report: FitReport
    problem: FitProblem


# ---- inputs ----------------------------------------------------------------------------------

def resolve_budget(budget, who: str = "device_budget") -> int | str:
    """``"auto"`` or a byte count (int, whole float, ``"8GiB"``, ``"1e9"``) -> ``"auto"`` or bytes
    (:func:`chunkjax.budget.parse_budget`, the one parser; ``"min"`` is the front door's).

    Raises:
      ValueError, TypeError: as :func:`chunkjax.budget.parse_budget` (one line naming the accepted forms).
    """
    from chunkjax.budget import parse_budget
    return parse_budget(budget, takes=("auto",), who=who, api="the fit path (chunkjax.fit_step; chunkjax.offload takes 'min')")


def prepare(stages, params, batch, *, tx=None, host_optimizer=None, compute_dtype=jnp.bfloat16,
            chunk_size: int | None = None, min_chunks: int = 8, prefetch: int = 1, segments="auto",
            micro_batches: int = 1, nonfinite: str = "ignore", loss_scaling: bool = False, mesh=None,
            zero_stage: int = 0, flops_per_step: float | None = None, rates: Rates | None = None,
            host_budget="auto", device_budget=None, check_host: bool = True, check_tx: bool = True,
            trainable=None, storage=None, cross_step: bool = True, remat: str = "full",
            remat_names=(), unroll_micro_batches: bool | str = "auto", clip_expect: str = "auto") -> FitProblem:
    """Layout and traces for a step (no allocation; the budget comes later).

    Args:
      stages: the model's stages (:class:`chunkjax.Stage`).
      params: the params pytree: arrays or ``jax.ShapeDtypeStruct`` (only shapes are read), or
        a callable ``() -> params`` (evaluated abstractly with ``jax.eval_shape``).
      batch: the step's batch: an int32 (B, T+1) array of tokens, or any pytree of arrays whose
        leaves share the leading (row) axis, B over all ranks (arrays or ``ShapeDtypeStruct`` s).
      tx, host_optimizer: the optax transformation (elementwise: checked by :func:`chunkjax.optim.check_elementwise`
        unless ``check_tx=False``) or the host kernel spec (``chunkjax.host_update.AdamW / Lion / SGDMomentum``; its
        ``optax()`` runs the device chunks), exactly one of them. With a host spec offloaded chunks update ``host``,
        else ``streamed``.
      compute_dtype: dtype of compute params and gradients.
      chunk_size: elements per chunk; None searches (at least ``min_chunks`` chunks if it can).
      prefetch, segments: passed to the planner.
      micro_batches, nonfinite, loss_scaling: as :func:`chunkjax.make_chunked_step`.
      mesh, zero_stage: a 1-D ``"data"`` mesh (:func:`chunkjax.data_mesh`) and ZeRO stage 1/2/3
        (ZeRO, Rajbhandari et al. 2020: every chunk split over the ranks); None and 0: one device.
      flops_per_step: training FLOPs of the whole step (all ranks); None: :func:`step_flops`
        (6 x params x tokens for a token batch, else 3 x the matrix-product FLOPs of the traced loss).
      rates: cost-model rates (default :class:`chunkjax.cost.Rates`).
      host_budget: bytes of host memory for model data, ``"auto"`` (:data:`HOST_HEADROOM` of
        ``MemAvailable``, less the process's own need and on the CPU the device budget) or None.
      device_budget: the budget when known (bytes or "auto"): bounds the host need checked before
        tracing (:func:`check_host_lower_bound`).
      check_host: False plans for another machine (the planner CLI: a GPU node planned from a
        laptop): this machine's ``MemAvailable`` is not read (pass ``host_budget`` as bytes or
        None). With it, ``mesh`` may be a ``jax.sharding.AbstractMesh`` (ranks without devices:
        the problem plans, but :func:`build_step` needs a real mesh).
      trainable: which leaves are trained (:func:`chunkjax.build_layout`): None (floating leaves;
        integer and bool leaves frozen) or a pytree of bools with the params' structure. Frozen
        leaves are fetched like params but get no gradient, master, optimizer state or update
        and keep their dtype.
      storage: the disk tier: storage directories (one per storage device; a list, or a
        comma-separated string) or :class:`chunkjax.storage.updater.StorageOptions`. With a host
        budget (``"auto"`` or bytes), chunks whose master params and optimizer state the host
        cannot hold update ``storage`` (:mod:`chunkjax.plan_disk`); needs an AdamW
        ``host_optimizer`` and one device.
      cross_step: plan and run with cross-step overlap (:attr:`FitProblem.cross_step`, default
        True: the next step waits per program only for the host chunks it reads; exact); False:
        each step joins all of the previous step's host work.
      remat, remat_names: kept activations (:attr:`FitProblem.remat`; e.g. ``"auto"``, ``models.gpt.REMAT_NAMES``).
      unroll_micro_batches: with ``micro_batches`` > 1, an in-program plan's loops traced
        unrolled (:attr:`FitProblem.unroll_micro_batches`); ``"auto"`` (default) unrolls up to
        :data:`chunkjax.plan_micro.UNROLL_AUTO_MAX_MICRO_BATCHES` micro-batches
        (:func:`chunkjax.plan_micro.resolve_unroll`).
      clip_expect: ``"auto"`` (``"fires"`` when ``host_optimizer`` clips by global norm, else
        ``"rare"``), ``"fires"`` or ``"rare"``: the clipping the plan times the step for
        (:mod:`chunkjax.clip_plan`: whether host updates overlap the backward or start at its end).

    Raises:
      ValueError: no optimizer or both, a transformation that is not elementwise, a compute
        dtype that is not floating, a last stage that returns neither a scalar nor a WeightedLoss, a bad ZeRO stage or mesh, a batch that does not split over
        ranks x micro-batches, a chunk size below 1, an unknown ``clip_expect``.
      HostMemoryError: even the least host memory any plan needs exceeds what is available.
    """
    if (tx is None) == (host_optimizer is None):
        raise ValueError("pass either tx (an optax transformation: offloaded chunks update streamed through the "
                         "device) or host_optimizer (a chunkjax.host_update spec: they update on the host; its "
                         "optax() twin runs the device chunks), not " + ("neither" if tx is None else "both"))
    if compute_dtype is not None:  # "bf16" as the planner CLI; one line on a bad one
        compute_dtype = compute_dtype_of(compute_dtype)
    if tx is not None:  # a mask is refused even unchecked: it would silently pick the wrong elements
        refuse_masks(tx)
        if check_tx:
            check_elementwise(tx)
    tx = host_optimizer.optax() if tx is None else tx
    clip_expect = clip_plan.resolve(clip_expect, host_optimizer)
    zero_stage = int(zero_stage or 0)
    if zero_stage not in (0, 1, 2, 3) or (zero_stage > 0) != (mesh is not None):
        raise ValueError(f"zero_stage={zero_stage} with mesh={mesh}: pass a data mesh and zero_stage 1, 2 or 3, "
                         "or neither")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, numbers.Integral) or micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches!r}: pass an int >= 1 (1: no accumulation)")
    unroll_micro_batches = resolve_unroll(unroll_micro_batches, micro_batches)
    n_ranks = 1 if mesh is None else int(mesh.size)
    if callable(params):
        params = jax.eval_shape(params)
    aparams = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    rows = batch_rows(batch)
    if rows == 0:  # a mean over no rows is NaN, and weight decay would still move every param
        raise ValueError("the example batch has 0 rows: pass a batch of the shape every step takes (>= 1 example)")
    if rows % (n_ranks * micro_batches):
        raise ValueError(f"batch of {rows} rows does not split over {n_ranks} rank(s) x {micro_batches} micro-batches: "
                         f"use a multiple of {n_ranks * micro_batches}")
    gbatch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch)
    tbatch = rows_of(gbatch, rows // (n_ranks * micro_batches))  # what one rank traces
    check_param_keys(stages, [jax.tree_util.keystr(k, simple=True, separator="/")
                              for k, _ in jax.tree_util.tree_flatten_with_path(aparams)[0]])

    def loss_of(p, b):
        loss = differentiated(split_loss(compose_loss(stages, p, b))[0])  # a WeightedLoss: its total
        check_scalar_loss(loss, f"the last stage ({stages[-1].name!r})", "it must return the scalar loss (e.g. the "
                          "mean over the batch) or a chunkjax.WeightedLoss of scalars")
        return loss

    order = first_use_order(loss_of, aparams, tbatch)
    layout = build_layout(aparams, chunk_size, order, min_chunks=min_chunks, trainable=trainable)
    if zero_stage:
        from chunkjax.topology import build_zero_layout
        layout = build_zero_layout(aparams, n_ranks, layout.chunk_size, order, trainable=trainable)
    cb = chunk_bytes(layout, compute_dtype, state_bytes_per_chunk(tx, layout.chunk_size))
    cb_rank = cb.per_rank(n_ranks, zero_stage) if zero_stage else cb
    platform = jax.default_backend()
    avail = available_for_plan(platform) if check_host else None
    device_budget = None if device_budget is None else resolve_budget(device_budget)
    from chunkjax.storage.updater import check_storage_inputs, disk_capacity, storage_options
    storage = storage_options(storage)
    check_host_lower_bound(layout, cb, platform, n_ranks, device_budget, None if storage else avail)
    if host_budget == "auto":
        host_budget = None
        if avail is not None:
            on_cpu = n_ranks * device_budget if platform == "cpu" and isinstance(device_budget, int) else 0
            host_budget = max(0, int(HOST_HEADROOM * avail) - process_bytes(layout, platform) - on_cpu)
    elif host_budget is not None:
        host_budget = resolve_budget(host_budget, "host_budget")
    check_storage_inputs(storage, host_optimizer, host_budget, n_ranks)
    if flops_per_step is None:
        flops_per_step = step_flops(loss_of, aparams, gbatch, tbatch, n_ranks * micro_batches)
    traces = trace_stages(stages, layout, tbatch, compute_dtype)
    return FitProblem(tuple(stages), layout, traces, cb, cb_rank, gbatch, tx, host_optimizer, jnp.dtype(compute_dtype),
                      int(prefetch), segments, int(micro_batches), nonfinite, bool(loss_scaling), mesh, zero_stage,
                      float(flops_per_step) / n_ranks, rates or Rates(),
                      None if host_budget is None else int(host_budget), platform, storage,
                      *(disk_capacity(storage) if storage else (0, None)), bool(cross_step), remat, tuple(remat_names),
                      unroll_micro_batches, clip_expect)


# ---- the one planning call -------------------------------------------------------------------

def plan(problem: FitProblem, budget_bytes: int, *, policy: str = "tide", resident=None, must_fit: bool = True,
         split: bool = True):
    """The schedule for one (per-rank) device budget: the only place the fit path plans (with
    micro-batches in-program accumulation where it fits, else over the largest micro-batch group
    that fits, else per pass: :mod:`chunkjax.plan_micro`).

    Args:
      problem: from :func:`prepare`.
      budget_bytes: each rank's device budget (bytes).
      policy: one of :data:`chunkjax.plan.POLICIES` (default ``"tide"``: the tide plan).
      resident: ``"tide"``: force exactly these chunks resident (device-updated); None searches.
      must_fit: False returns a static policy's schedule even over the budget (to report a
        baseline that does not fit).
      split: ``"tide"``: split offloaded updates between host and device by rate
        (:func:`chunkjax.plan_split.split_updates`); False: all on the host.

    Raises:
      chunkjax.PlanError: nothing fits (the message gives the smallest budget that does).
    """
    kw = dict(policy=policy, resident=resident, must_fit=must_fit, split=split)
    if problem.micro_batches > 1:
        return plan_micro_batches(problem, budget_bytes, _plan_passes, **kw)
    if problem.remat != "full" and policy == "tide":  # kept activations: chunkjax.plan_remat
        return remat_plan(problem, lambda tr: _plan_passes(dataclasses.replace(problem, traces=tr), budget_bytes,
                                                           **kw))[0]
    return _plan_passes(problem, budget_bytes, **kw)


def _plan_passes(p: FitProblem, budget_bytes: int, *, split, **kw):
    """:func:`plan` of ``p.micro_batches`` passes (of groups: :func:`chunkjax.plan_micro.grouped_problem`)."""
    try:
        return _plan(p, budget_bytes, split=split, **kw)
    except PlanError as e:
        # a host that cannot hold the streamed chunks' pinned state may hold them updated on the host
        if not (split and p.host_budget_bytes is not None and isinstance(e, HostBudgetError)):
            raise
        try:
            return _plan(p, budget_bytes, split=False, **kw)
        except PlanError as e2:
            if isinstance(e2, PinnedLimitError):
                raise pinned_limit_error(p, budget_bytes) from None
            raise e from None


def _plan(p: FitProblem, budget_bytes: int, *, policy, resident, must_fit, split):
    return plan_schedule(p.layout, p.traces, p.cb, int(budget_bytes), policy=policy, ranks=p.n_ranks,
                         zero_stage=p.zero_stage or None, host_budget_bytes=p.host_budget_bytes,
                         prefetch=p.prefetch, segments=p.segments, flops_per_step=p.flops_per_step, rates=p.rates,
                         host_update=p.host_optimizer is not None, resident=resident, must_fit=must_fit,
                         split=split, micro_batches=p.micro_batches, streamed_early=p.streamed_early,
                         storage_devices=p.storage_devices, disk_budget_bytes=p.disk_budget_bytes,
                         storage_workers=p.storage_dirs,
                         disk_versions=p.storage.disk_versions if p.storage is not None else 2,
                         host_bytes_of=host_bytes_of(p) if p.n_ranks == 1 and p.host_budget_bytes is not None else None,
                         cross_step=p.cross_step, clip_expect=p.clip_expect, turn_cut=p.turn_cut)


def build_step(problem: FitProblem, schedule, speculation_bytes: int | None = None):
    """The step running ``schedule`` (nothing compiled or allocated yet, cross-step overlap as
    ``problem.cross_step``); ``speculation_bytes``: the host backup bound of its speculative
    updates (:func:`chunkjax.fit_host.speculation_bytes`; None: the step's default)."""
    p = problem
    kw = dict(host_optimizer=p.host_optimizer, tx=p.tx, compute_dtype=p.compute_dtype, micro_batches=p.micro_batches,
              nonfinite=p.nonfinite, loss_scaling=p.loss_scaling, storage=p.storage,
              speculation_bytes=speculation_bytes, cross_step=p.cross_step, rollback=p.rollback)
    from chunkjax.step import make_chunked_step
    if p.zero_stage:
        kw.update(mesh=p.mesh, zero_stage=p.zero_stage)
    return make_chunked_step(p.stages, p.layout, schedule, **kw)


def auto_budget(problem: FitProblem, *, policy: str = "tide") -> int:
    """The ``"auto"`` per-rank device budget: the smallest budget with every chunk offloaded
    (the planner's ``PlanError.min_budget_bytes``) plus :data:`AUTO_BUDGET_MODEL_FRACTION` of one
    rank's model chunk bytes."""
    try:
        plan(problem, 1, policy=policy)
        floor = 1
    except PlanError as e:
        floor = e.min_budget_bytes
    cb = problem.cb_rank
    return int(floor + AUTO_BUDGET_MODEL_FRACTION * cb.model_bytes(problem.layout.n_chunks))


def min_budget(problem: FitProblem, *, policy: str = "tide") -> int:
    """The ``"min"`` per-rank device budget (bytes), the one definition of the front door
    (:func:`chunkjax.offload`, :func:`chunkjax.plan_offload`) and the planner CLI
    (``experiments/plan.py``'s device budget ``min``): the least budget a run can be given. The
    planner's smallest budget with every parameter chunk offloaded (its ``PlanError.min_budget_bytes``;
    1 when any budget plans) over :data:`HEADROOM`, rounded up: on an accelerator the fit path
    checks the compiled step against ``HEADROOM`` of the budget, and a plan filling the budget
    fails that check. Raises what :func:`plan` raises other than a device refusal."""
    try:
        plan(problem, 1, policy=policy)
        return 1
    except PlanError as e:
        if not e.min_budget_bytes:
            raise
        return int(math.ceil(e.min_budget_bytes / HEADROOM))


# ---- checks ----------------------------------------------------------------------------------

def compiled_peak(problem: FitProblem, step, schedule) -> dict:
    """Every program of ``step`` compiled for one pass (a micro-batch, or in-program the batch): ``peak_bytes``
    (per rank) = max(the most over programs of argument + output + temp - alias + ``beside_bytes`` (held beside it
    at launch: ``held_beside_programs``) + device-updated chunks' state (per pass with float32 sums), update phase)."""
    passes = passes_of(schedule, problem.micro_batches)
    one_pass = rows_of(problem.batch, batch_rows(problem.batch) // passes)
    progs = [dict(q, beside_bytes=int(b)) for q, b in zip(step.compiled_memory_programs(one_pass),
                                                          step.held_beside_programs(one_pass))]
    locs, cb = schedule.update_locations, problem.cb_rank
    resident_state = sum(u == "device" for u in locs) * (cb.state + (cb.master if passes > 1 else 0))
    update_phase = device_model_bytes(cb, schedule.param_kinds, locs) + update_phase_bytes(  # device gradients,
        problem.layout.chunk_size, cb, locs)  # the streamed pipeline or a device update's temporaries
    largest = max(progs, key=lambda q: q["peak_device_bytes"] + q["beside_bytes"])
    peak = max(largest["peak_device_bytes"] + largest["beside_bytes"] + resident_state, update_phase)
    return {"peak_bytes": int(peak),
            "argument_bytes": largest["argument"], "output_bytes": largest["output"], "temp_bytes": largest["temp"],
            "alias_bytes": largest["alias"], "resident_state_bytes": int(resident_state),
            "beside_bytes": largest["beside_bytes"], "update_phase_bytes": int(update_phase), "programs": progs}


# ---- plan, compile, re-plan ------------------------------------------------------------------

def fit_problem(problem: FitProblem, device_budget="auto", *, policy: str = "tide", resident=None, schedule=None,
                check_compiled: bool | None = None, strict: bool = True, compiled_margin: int = 0) -> Fitted:
    """Plan for ``device_budget``, check host memory, build the step and (on an accelerator)
    compile its programs and re-plan until they fit :data:`HEADROOM` of the budget.

    Args:
      problem: from :func:`prepare`.
      device_budget: each rank's device budget: bytes, a size string or ``"auto"``
        (:func:`auto_budget`; raised, with the plan kept, to what the compiled step needs).
      policy, resident: see :func:`plan`. A forced ``resident`` set is checked, never re-planned.
      schedule: run this schedule (e.g. a static baseline) instead of planning; checked, never
        replaced.
      check_compiled: compile and check; None: on accelerators only (on the CPU the memory kinds
        share one memory and the compiled sizes say nothing about a device).
      strict: raise when the compiled step stays over the headroom; False returns the step with
        ``report.fits`` False and ``report.why``.
      compiled_margin: bytes the first plan leaves below the headroom (less a chunk) for what the
        compiler keeps beyond the accounting, as measured by an earlier compile of this setting (a
        run's ``compiled_peak_bytes - peak_device_bytes_accounted``); saves the refused first plan's
        compile of every program. Used only with a given budget and the compiled check.

    Raises:
      chunkjax.PlanError: no plan fits the budget, or (``strict``) the compiled step exceeds the
        headroom after :data:`MAX_REPLANS` re-plans (one line: what to change).
      HostMemoryError: the plan's host memory exceeds what the machine has available.
    """
    requested = resolve_budget(device_budget)
    auto = requested == "auto"
    budget = auto_budget(problem, policy=policy) if auto else requested
    if check_compiled is None:
        check_compiled = problem.platform != "cpu"
    fixed = schedule is not None or resident is not None
    effective = budget
    if check_compiled and not fixed and not auto:
        # a plan filling the budget cannot pass the check at HEADROOM of it: plan for the headroom
        # (less a chunk, as a re-plan does) first, saving a compile of every program
        first = int(HEADROOM * budget) - problem.cb_rank.params - max(0, int(compiled_margin))
        try:
            sched = plan(problem, first, policy=policy)
            effective = first
        except PlanError:
            pass
    if effective == budget:
        try:
            sched = schedule if schedule is not None else plan(problem, effective, policy=policy, resident=resident)
        except PlanError as e:
            if not check_compiled or (over := e.at_headroom(HEADROOM)) is e:
                raise
            raise over from None
    problem, sched, host = fit_host(problem, sched, None if fixed else (lambda q: plan(q, effective, policy=policy)))
    history, notes, mem, floor_tried = [], [], None, False
    for attempt in range(MAX_REPLANS + 1):
        host = dict(host, speculation_bytes=speculation_bytes(problem, host, sched))
        step = build_step(problem, sched, host["speculation_bytes"])
        if not check_compiled:
            break
        mem = compiled_peak(problem, step, sched)
        history.append({"effective_budget_bytes": int(effective), "compiled_peak_bytes": mem["peak_bytes"],
                        "predicted_peak_bytes": int(sched.predicted.peak_device_bytes), "counts": sched.counts()})
        if mem["peak_bytes"] <= HEADROOM * budget:
            break
        if auto and schedule is None:  # the job chose the budget: keep the plan, raise the budget
            budget = int(math.ceil(mem["peak_bytes"] / HEADROOM)) + 1
            notes.append(f"auto budget raised to {budget} bytes (the compiled step needs {mem['peak_bytes']})")
            break
        if fixed or attempt == MAX_REPLANS:
            break
        # shrink the planning budget by the overshoot (and a chunk) and plan again; at least by what
        # the compiler keeps beyond the accounting (compiled - accounted peak), so the next plan's
        # compiled peak lands under the headroom (one compile of every program per plan)
        missed = mem["peak_bytes"] - int(sched.predicted.peak_device_bytes)
        effective = min(int(effective * HEADROOM * budget / mem["peak_bytes"]),
                        int(HEADROOM * budget) - missed) - problem.cb_rank.params
        effective = max(1, effective)  # the compiler kept more than the whole budget beyond the accounting
        try:
            sched = plan(problem, effective, policy=policy)
        except PlanError as e:
            notes.append(f"re-plan for {effective} bytes failed: {e}")
            if floor_tried or e.min_budget_bytes <= effective:
                break
            # the accounting's smallest plan (every chunk offloaded) may still compile under the headroom
            floor_tried, effective = True, e.min_budget_bytes
            sched = plan(problem, effective, policy=policy)
        problem, sched, host = fit_host(problem, sched, lambda q, b=effective: plan(q, b, policy=policy))
    fits = mem is None or mem["peak_bytes"] <= HEADROOM * budget
    why = None
    if not fits:
        why = (f"compiled peak {mem['peak_bytes']} B exceeds {HEADROOM:.0%} of the budget {budget} B after "
               f"{len(history)} plan(s)" + (f"; {notes[-1]}" if notes else ""))
        if strict:
            raise PlanError(f"{why}: raise the device budget or lower the batch",
                            int(math.ceil(mem["peak_bytes"] / HEADROOM)), False)
    report = FitReport(sched, int(budget), requested, int(effective), HEADROOM, mem, tuple(history), host, fits, why,
                       tuple(notes))  # its predicted step with a speculating step's bound (chunkjax.clip_plan)
    return Fitted(step, with_speculation_bound(report, problem, step), problem)


def fit_step(stages, params, batch, *, device_budget="auto", policy: str = "tide", resident=None,
             check_compiled: bool | None = None, strict: bool = True, **prepare_kw) -> Fitted:
    """The one fit path: ``(step, report, problem)`` for ``stages`` within ``device_budget``.

    :func:`prepare` (layout, host-memory lower bound, traces) then :func:`fit_problem` (plan,
    host-memory check, step, compiled check, re-plans). Nothing is allocated: initialise with
    ``state = step.init(params)`` (a params pytree, or ``leaf_init(i)`` giving leaf ``i`` of
    ``step.layout.slots``).

    Args:
      stages, params, batch: see :func:`prepare`.
      device_budget: each device's budget: bytes, ``"8GiB"`` or ``"auto"``.
      policy, resident, check_compiled, strict: see :func:`fit_problem`.
      **prepare_kw: the rest of :func:`prepare` (tx, host_optimizer, compute_dtype, chunk_size,
        min_chunks, prefetch, segments, micro_batches, nonfinite, loss_scaling, mesh, zero_stage,
        flops_per_step, rates, host_budget, trainable: the frozen leaves, cross_step: False for
        the joined step, clip_expect: the clipping the plan times, :mod:`chunkjax.clip_plan`).

    Example::

        spec = AdamW(3e-4, weight_decay=0.1, max_grad_norm=1.0)
        step, report, _ = cj.fit_step(stages, params, batch, host_optimizer=spec, device_budget="4MiB")
        print(report.schedule.counts(), report.predicted_peak_bytes)
        state = step.init(params)

    Raises:
      ValueError, chunkjax.PlanError, HostMemoryError: see :func:`prepare` and :func:`fit_problem`.
    """
    problem = prepare(stages, params, batch, device_budget=device_budget, **prepare_kw)
    return fit_problem(problem, device_budget, policy=policy, resident=resident, check_compiled=check_compiled,
                       strict=strict)
