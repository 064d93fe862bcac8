"""The planner: one :func:`plan_schedule`, five policies, every one returning a
:class:`~chunkjax.schedule.Schedule` accounted by :mod:`chunkjax.predict` (pure: allocates nothing).

Policies (``policy=``):

``"tide"`` (default)
    The traced-tide plan (PatrickStar, arXiv 2108.05818, sections 4.2-4.3 and 5, decided before
    the first step). Placement chunk by chunk in first-use order: a chunk is *resident* (compute
    params, master params and optimizer state on the device; update ``device``) or its compute
    params live in pinned host memory and its update runs ``host`` (in place, overlapping the
    backward) or ``streamed`` (state moved through the device) when no host kernel exists; with
    a host kernel the update work is split by rate (:func:`chunkjax.plan_split.split_updates`): the chunks whose
    gradients complete last stream through the device while the host thread updates the rest. The
    device memory the tide leaves at each moment bounds the chunk buffers there; Belady's rule
    (:func:`chunkjax.eviction.belady`) fetches the rest ``prefetch`` moments ahead. The step is
    cut into programs at backward moments (:func:`chunkjax.program_cut.auto_segments`) so a host thread updates
    finished chunks while the backward runs. Every resident prefix is scheduled and predicted;
    the fastest that fits is returned (near-ties, within :data:`chunkjax.plan_split.NEAR_TIE`, to the most resident),
    then its program cut and gradient window are chosen on the step's timeline
    (:func:`chunkjax.program_cut.choose_program_cut`, with ``segments="auto"`` on one device).
``"fixed"``
    The foundation's fixed rule: first the compute params of chunks (first-use order), then
    their master params and optimizer state, go to the device while the stage-window bound
    (:func:`chunkjax.predict.fixed_rule_moment_bytes`) fits; host-param chunks are fetched by
    :func:`fetch_events`; updates ``device`` or ``streamed``; one program.
``"all_host"``
    Every chunk's model data in pinned host memory, fetched at every moment that reads it and
    released after it; gradients go down as they complete, host updates overlap the backward.
``"zero_offload"``
    Every chunk's compute params fetched at the step's start and held to their last read,
    gradients offloaded as they complete, master params and optimizer state updated on the host
    after the backward with no overlap (ZeRO-Offload, arXiv 2101.06840).
``"optimizer_only"``
    The drop-in optimizer's rule (:class:`chunkjax.ChunkedOptimizer`): params and gradients on
    the device (the training loop's, not counted), master params and optimizer state on the
    device in layout order while they fit next to one chunk's update working set, the rest in
    pinned host memory and streamed (ZeRO-Offload's split of the optimizer state).

``ranks > 1`` plans one rank of a ZeRO run (``zero_stage`` 1, 2 or 3): every chunk split over the
ranks, each rank's device budget, per-rank bytes (:mod:`chunkjax.predict`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from chunkjax import predict as pr
from chunkjax.budget import parse_bytes  # noqa: F401 (re-exported: chunkjax.plan.parse_bytes)
from chunkjax.cost import Rates
from chunkjax.errors import HostBudgetError, PinnedLimitError, PlanError, format_bytes
from chunkjax.eviction import CapacityError, belady
from chunkjax.clip_plan import norm_wait
from chunkjax.host_forms import assign_host_forms
from chunkjax.layout import ChunkLayout
from chunkjax.memory import DEVICE, PINNED_HOST
from chunkjax.plan_disk import host_disk_error, place_on_disk
from chunkjax.plan_memo import predictor
from chunkjax.plan_split import NEAR_TIE, split_schedule
from chunkjax.program_cut import auto_segments, cut_and_start
from chunkjax.predict_zero import per_rank
from chunkjax.schedule import DEVICE_UPDATE, HOST_UPDATE, NO_UPDATE, STREAMED_UPDATE, Placement, Schedule
from chunkjax.tide import Tide, memory_tide
from chunkjax.trace import StageTrace

POLICIES = ("tide", "fixed", "all_host", "zero_offload", "optimizer_only")
#: policies whose decisions do not depend on the budget (``must_fit=False`` returns them anyway)
STATIC_POLICIES = ("all_host", "zero_offload")

_MSG_FIXED_INFEASIBLE = (
    "device budget {budget} bytes is below the {need} bytes this step needs with every chunk in "
    "pinned host memory (activations and temporaries {act} bytes, chunk buffers {buf} bytes){why}: "
    "use device_budget >= {need_size}{fix}")
_MSG_OFFLOADED_INFEASIBLE = (
    "device budget {budget} bytes is below the {need} bytes this step needs with every chunk offloaded "
    "(found to within {tol} bytes; non-model peak {act} bytes){why}: use device_budget >= {need_size}{fix}")
_MSG_STATIC_INFEASIBLE = ("the {policy} schedule needs {need} device bytes, above the budget of {budget} bytes: "
                          "use device_budget >= {need_size} or another policy")
_MSG_HOST = ("host budget {host} bytes is below the {need} bytes of model data and gradient buffers the host "
             "must hold at a device budget of {dev} bytes (every chunk that fits stays on the device): use "
             "host_budget >= {need_size}, a larger device_budget, or storage directories (the disk tier)")
_MSG_HOST_ZERO = ("node host budget {host} bytes ({host_rank} per rank over {n} ranks) is below the {need_node} bytes "
                  "({need} per rank) of model data the host must hold at a device budget of {dev} bytes per GPU "
                  "(every chunk that fits stays on the device): use host_budget >= {need_size} (the node's) "
                  "or a larger device_budget")
_MSG_HOST_LIMIT = ("at a device budget of {dev} bytes every placement's pinned host bytes exceed the limit on "
                   "pinned host memory: raise that limit or the device budget, or give storage directories")
#: What a ``host_bytes_of`` measure returns for a placement the host cannot hold at any budget (its
#: pinned bytes exceed the process's limit on pinned host memory).
OVER_HOST_LIMIT = 2**62
_MSG_UPDATE = ("device budget {budget} bytes is below the {need} bytes one chunk's update needs (chunk_size "
               "{cs} elements): use a device budget >= {need} bytes or a smaller chunk_size")
_WHY_ACT = "; activations alone exceed the budget"
_FIX_ACT = " or lower the batch / sequence length (activations are checkpointed per block)"
#: Where the bytes that do not shrink with the batch (chunk buffers, gradients) exceed the budget: only
#: the budget named helps (a 1-byte budget was told to lower the batch); {0}: ``_WHY_ACT`` or "".
_WHY_MODEL = "{0}; the chunk buffers alone ({1} bytes) exceed the budget at any batch size"


def _hint(budget: int, act: int, model: int) -> tuple[str, str, bool]:
    """``(why, fix, activations_alone)`` of an infeasible budget with ``act`` non-model bytes and
    ``model`` bytes that no batch lowers: lowering the batch is suggested only where these fit."""
    alone = act > budget
    if budget < model:
        return _WHY_MODEL.format(_WHY_ACT if alone else "", model), "", alone
    return (_WHY_ACT, _FIX_ACT, alone) if alone else ("", "", alone)


def fetch_events(traces, placement: Placement, prefetch: int) -> tuple[list[list[int]], list[list[int]]]:
    """Host-param chunk fetches per stage, forward and backward, under the fixed rule.

    A chunk read by stage ``s`` is fetched at stage ``s - prefetch`` (forward) unless it is still
    held from the previous stage that read it within the prefetch window; the backward pass
    mirrors this in reverse. Returns (forward, backward) lists of chunk ids fetched, per stage
    (backward indexed by stage too). The last stage runs once (its forward is fused with its
    backward).
    """
    n = len(traces)
    fwd = [[] for _ in range(n)]
    bwd = [[] for _ in range(n)]
    for order, out in ((range(n), fwd), (range(n - 1, -1, -1), bwd)):
        order = list(order)
        if out is bwd:
            order = order[1:]  # head already ran in the forward order's last position
        held: dict[int, int] = {}  # chunk -> position of last use
        for pos, s in enumerate(order):
            needed = traces[s].chunks if out is fwd else traces[s].backward_chunks
            for c in needed:
                if placement.param_kinds[c] != PINNED_HOST:
                    continue
                if c in held and pos - held[c] <= max(prefetch, 1):
                    held[c] = pos
                    continue
                out[s].append(c)
                held[c] = pos
    return fwd, bwd


def _evictions(fetch, accesses, T) -> list[tuple[int, ...]]:
    """After each moment, release the chunks whose next read is a fresh fetch (or never)."""
    evict: list[list[int]] = [[] for _ in range(T)]
    last_read: dict[int, int] = {}
    for t in range(T):
        for c in accesses[t]:
            if c in fetch[t] and c in last_read:
                evict[last_read[c]].append(c)
            last_read[c] = t
    for c, t in last_read.items():
        evict[t].append(c)
    return [tuple(sorted(e)) for e in evict]


def _moments(tide: Tide) -> tuple[tuple[str, int], ...]:
    return tuple((m.phase, m.stage) for m in tide.moments)


def _frozen_none(layout: ChunkLayout, loc) -> tuple[str, ...]:
    """Update locations with ``none`` for the layout's frozen chunks (they have no update). The
    planner reads only ``n_chunks``, ``chunk_size`` and this from a layout: a layout-like object
    without ``chunk_trainable`` (synthetic plans) has every chunk trainable."""
    trainable = getattr(layout, "chunk_trainable", None)
    return tuple(loc) if trainable is None else tuple(u if t else NO_UPDATE for u, t in zip(loc, trainable))


# ---- the tide policy ----------------------------------------------------------------------------

def _tide_one(layout: ChunkLayout, traces, tide: Tide, cb: pr.ChunkBytes, budget: int, resident: set[int],
              host_update: bool, prefetch: int, segments: tuple[int, ...], rates: Rates, flops_per_step: float,
              split: bool = False, streamed_early: bool = False, reserve: int | None = None, micro_batches: int = 1,
              predict=pr.predict, grad_done: dict[int, int] | None = None, host_ok=None):
    """Schedule one placement (``resident`` chunks fully on the device); None if it cannot fit.
    With ``streamed_early`` (and the split) also the placement whose chunk buffers leave the
    streamed pipeline's bytes free during the backward (``reserve``), the faster of the two.
    With ``micro_batches`` > 1 the device-updated chunks' float32 sums are on the device throughout
    (:func:`chunkjax.predict.waiting_grad_bytes`) and every prediction is of that many passes.
    ``predict``: :func:`chunkjax.predict.predict` or its memo (:func:`chunkjax.plan_memo.predictor`);
    ``grad_done``: :func:`chunkjax.predict.grad_done_moments` (computed here when None); ``host_ok``: the
    split's host check."""
    if streamed_early and split and host_update and reserve is None:
        args = (layout, traces, tide, cb, budget, resident, host_update, prefetch, segments, rates, flops_per_step, split)
        kw = dict(micro_batches=micro_batches, predict=predict, grad_done=grad_done, host_ok=host_ok)
        late = _tide_one(*args, streamed_early=False, **kw)
        early = _tide_one(*args, streamed_early=True, reserve=pr.streamed_pipeline_bytes(layout.chunk_size, cb), **kw)
        if early is None or not early.streamed_early or (
                late is not None and late.predicted.time.step_s <= early.predicted.time.step_s):
            return late
        return early
    predict = predict if micro_batches == 1 else (lambda f: lambda *a, **k: f(*a, micro_batches=micro_batches, **k))(predict)
    n, T = layout.n_chunks, len(tide.moments)
    pk = tuple(DEVICE if c in resident else PINNED_HOST for c in range(n))
    loc = _frozen_none(layout, (DEVICE_UPDATE if c in resident else (HOST_UPDATE if host_update else STREAMED_UPDATE)
                                for c in range(n)))
    if HOST_UPDATE not in loc:  # nothing for a host thread to overlap: one program
        segments = (0,)
    model = pr.device_model_bytes(cb, pk, loc)
    grad_done = pr.grad_done_moments(traces, tide) if grad_done is None else grad_done
    waiting = pr.waiting_grad_bytes(cb, loc, grad_done, T, micro_batches)
    accesses = [tuple(c for c in m.chunks if pk[c] == PINNED_HOST) for m in tide.moments]
    max_reads = max((len(a) for a in accesses), default=0)
    caps = []
    for t, m in enumerate(tide.moments):
        avail = budget - model - m.non_model_bytes - waiting[t] - (reserve or 0) * (m.phase != "forward")
        cap = math.floor(avail / cb.buffer) - prefetch * max_reads if cb.buffer else 0
        if cap < len(accesses[t]):
            return None
        caps.append(cap)
    try:
        ev = belady(accesses, caps)
    except CapacityError:
        return None
    held = [len(r) for r in ev.resident_after]
    per_moment = pr.tide_moment_bytes(tide, cb, pk, loc, ev.fetch, prefetch, held, grad_done,
                                      micro_batches=micro_batches)
    pred = predict(layout.chunk_size, traces, tide, cb, pk, loc, ev.fetch, segments, per_moment,
                   flops_per_step=flops_per_step, rates=rates)
    if pred.peak_device_bytes > budget:
        return None
    s = Schedule(pk, loc, tuple(ev.fetch), tuple(_evictions(ev.fetch, accesses, T)), segments, prefetch,
                 _moments(tide), pred, int(budget))
    if split and HOST_UPDATE in loc:
        s = split_schedule(s, layout.chunk_size, traces, tide, cb, per_moment, rates=rates, flops_per_step=flops_per_step,
                           streamed_early=streamed_early, predict=predict, fits=host_ok)
    return s


def _tide(one, n_chunks: int, budget: int, host_fits, resident) -> Schedule:
    """The fastest candidate (first k chunks resident, k = 0..n) that fits; ``one(budget,
    resident)`` schedules one placement (None: does not fit the device)."""
    if resident is not None:
        s = one(budget, set(resident))
        if s is None:
            raise PlanError(f"the forced resident chunks {list(resident)} do not fit {budget} bytes: "
                            "lower the resident set or raise the device budget", budget, False)
        return s
    cands = []
    for k in range(n_chunks + 1):  # the first k chunks (first-use order) resident
        s = one(budget, set(range(k)))
        if s is None:
            if k == 0:
                break
            continue
        if host_fits(s):
            cands.append(s)
    if not cands:
        return None
    # near-ties (within the cost model's resolution) go to the most resident placement:
    # fewer bytes moved, PatrickStar's rule of keeping chunks on the device while memory allows
    fastest = min(c.predicted.time.step_s for c in cands)
    return [c for c in cands if c.predicted.time.step_s <= fastest * (1 + NEAR_TIE)][-1]


def _host_error(host_budget: int, need: int, device_budget: int, ranks: int) -> PlanError:
    """The host budget cannot hold ``need`` bytes (one rank's) of host model data."""
    if ranks == 1:
        msg = _MSG_HOST.format(host=host_budget, need=need, dev=device_budget, need_size=format_bytes(need, up=True))
    else:
        msg = _MSG_HOST_ZERO.format(host=host_budget, host_rank=host_budget // ranks, n=ranks, need_node=need * ranks,
                                    need=need, dev=device_budget, need_size=format_bytes(need * ranks, up=True))
    return HostBudgetError(msg, device_budget, False, need * ranks)


def _tide_infeasible(one, offloaded_fits, n_chunks: int, tide: Tide, cb: pr.ChunkBytes, budget: int, host_budget,
                     ranks: int, host_bytes=None):
    """Raise the PlanError of a tide plan that found no candidate: the host budget needed when
    the device fits (``host_bytes(s)``, all ranks: as the plan compared it), else the smallest
    device budget (bisected on the all-offloaded schedule: ``offloaded_fits(budget)`` is
    ``one(budget, set()) is not None``, without scheduling what the bisection does not read)."""
    host_bytes = host_bytes or (lambda s: ranks * s.predicted.host_bytes)
    if offloaded_fits(budget) and host_budget is not None:  # the device fits; the host does not
        need = min(host_bytes(s) for s in
                   (one(budget, set(range(k))) for k in range(n_chunks + 1)) if s is not None) // ranks
        if need * ranks >= OVER_HOST_LIMIT:
            raise PinnedLimitError(_MSG_HOST_LIMIT.format(dev=budget), budget, False)
        raise _host_error(host_budget, need, budget, ranks)
    lo, hi = budget, max(budget, 1) * 2
    while not offloaded_fits(hi):
        lo, hi = hi, hi * 2
        if hi > 2**50:
            raise PlanError("no device budget fits this step", hi, True)
    while hi - lo > max(1, cb.params // 64):
        mid = (lo + hi) // 2
        if not offloaded_fits(mid):
            lo = mid
        else:
            hi = mid
    s = one(hi, set())
    if s is not None and budget >= hi and host_budget is not None:
        raise _host_error(host_budget, host_bytes(s) // ranks, hi, ranks)
    act = tide.peak_non_model_bytes
    # need - act <= the most model bytes of any moment (the bisection's tolerance off): no batch fits below it
    why, fix, alone = _hint(budget, act, hi - act - max(1, cb.params // 64))
    msg = _MSG_OFFLOADED_INFEASIBLE.format(budget=budget, need=hi, act=act, why=why, tol=max(1, cb.params // 64),
                                           need_size=format_bytes(hi, up=True), fix=fix)
    raise PlanError(msg, hi, alone)


# ---- the fixed rule -----------------------------------------------------------------------------

def _fixed_fetch(traces, placement: Placement, prefetch: int) -> tuple[tuple[int, ...], ...]:
    """The fixed rule's fetches per moment (tide order)."""
    fwd, bwd = fetch_events(traces, placement, prefetch)
    n = len(traces)
    return tuple(tuple(x) for x in fwd + [bwd[s] for s in range(n - 2, -1, -1)])


def _fixed_schedule(layout, traces, tide, cb, budget, placement: Placement, prefetch, rates, flops) -> Schedule:
    pk, loc = placement.param_kinds, placement.update_locations
    fetch = _fixed_fetch(traces, placement, prefetch)
    accesses = [tuple(c for c in m.chunks if pk[c] == PINNED_HOST) for m in tide.moments]
    per_moment = pr.fixed_rule_moment_bytes(layout.chunk_size, traces, cb, pk, loc, prefetch)
    pred = pr.predict(layout.chunk_size, traces, tide, cb, pk, loc, fetch, (0,), per_moment,
                      flops_per_step=flops, rates=rates)
    return Schedule(pk, loc, fetch, tuple(_evictions(fetch, accesses, len(tide.moments))), (0,), prefetch,
                    _moments(tide), pred, int(budget))


def _fixed(layout, traces, tide, cb, budget, prefetch, rates, flops) -> Schedule:
    """Compute params first (a resident param chunk saves its fetch in forward and backward for
    ``2 x compute-dtype`` bytes of device memory, the cheapest traffic saved per byte:
    ZeRO-Offload's split when the budget holds all params), then master params and optimizer state
    (which moves the chunk's update to the device: PatrickStar, section 5), chunk by chunk in
    first-use order, each kept while the peak fits."""
    n, cs = layout.n_chunks, layout.chunk_size
    trainable = getattr(layout, "chunk_trainable", None)

    def peak(pk, sk):
        return pr.fixed_rule_peak(cs, traces, cb, Placement(tuple(pk), tuple(sk), trainable), prefetch)

    pk, sk = [PINNED_HOST] * n, [PINNED_HOST] * n
    need = peak(pk, sk)
    if need > budget:
        act = sum(t.input_bytes for t in traces[1:]) + max(t.temp_bytes for t in traces)
        why, fix, alone = _hint(budget, act, need - act)
        msg = _MSG_FIXED_INFEASIBLE.format(budget=budget, need=need, act=act, buf=need - act, why=why,
                                           need_size=format_bytes(need, up=True), fix=fix)
        raise PlanError(msg, need, alone)
    for kinds in (pk, sk):
        for c in range(n):
            kinds[c] = DEVICE
            if peak(pk, sk) > budget:
                kinds[c] = PINNED_HOST
    # the streamed pipeline leaves the update phase when the last state chunk joins the device, so
    # every state on the device can fit where some of them did not (the peak is not monotone)
    if PINNED_HOST in sk and peak(pk, [DEVICE] * n) <= budget:
        sk = [DEVICE] * n
    return _fixed_schedule(layout, traces, tide, cb, budget, Placement(tuple(pk), tuple(sk), trainable),
                           prefetch, rates, flops)


# ---- static baselines ---------------------------------------------------------------------------

def _all_host(layout, traces, tide, cb, budget, prefetch, segments, rates, flops) -> Schedule:
    n, T = layout.n_chunks, len(tide.moments)
    pk, loc = (PINNED_HOST,) * n, _frozen_none(layout, (HOST_UPDATE,) * n)
    fetch = tuple(tuple(sorted(set(m.chunks))) for m in tide.moments)
    evict = fetch  # released after every read: the next read is a fresh fetch
    segs = auto_segments(T, len(traces)) if segments == "auto" else segments
    per_moment = pr.tide_moment_bytes(tide, cb, pk, loc, fetch, prefetch, pr.held_buffers(fetch, evict),
                                      pr.grad_done_moments(traces, tide))
    pred = pr.predict(layout.chunk_size, traces, tide, cb, pk, loc, fetch, segs, per_moment,
                      flops_per_step=flops, rates=rates)
    return Schedule(pk, loc, fetch, evict, segs, prefetch, _moments(tide), pred, int(budget))


def _zero_offload(layout, traces, tide, cb, budget, rates, flops) -> Schedule:
    # every chunk's compute params go up at the start of the step (all fetches issued at the
    # first moment: prefetch = T) and stay until their last read; gradients go down as they
    # complete; the host update of all chunks waits for the end of the backward (one program,
    # no overlap): ZeRO-Offload's order, with the param upload of step k+1 (after the update of
    # step k) overlapping step k+1's forward
    n, T = layout.n_chunks, len(tide.moments)
    pk, loc = (PINNED_HOST,) * n, _frozen_none(layout, (HOST_UPDATE,) * n)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for t, m in enumerate(tide.moments):
        for c in m.chunks:
            first.setdefault(c, t)
            last[c] = t
    fetch = tuple(tuple(sorted(c for c in first if first[c] == t)) for t in range(T))
    evict = tuple(tuple(sorted(c for c in last if last[c] == t)) for t in range(T))
    prefetch = max(T, 1)
    per_moment = pr.tide_moment_bytes(tide, cb, pk, loc, fetch, prefetch, pr.held_buffers(fetch, evict),
                                      pr.grad_done_moments(traces, tide))
    pred = pr.predict(layout.chunk_size, traces, tide, cb, pk, loc, fetch, (0,), per_moment,
                      flops_per_step=flops, rates=rates, forward_fetches=len(first))
    return Schedule(pk, loc, fetch, evict, (0,), prefetch, _moments(tide), pred, int(budget))


# ---- the drop-in optimizer's rule -----------------------------------------------------------------

def _optimizer_only(layout, traces, tide, cb, budget, rates, flops) -> Schedule:
    n, cs = layout.n_chunks, layout.chunk_size
    working = pr.update_working_bytes(cs, cb)
    if budget < working:
        raise PlanError(_MSG_UPDATE.format(budget=budget, need=working, cs=cs), working, False)
    n_dev = min(n, (budget - working) // cb.state) if cb.state else n
    loc = _frozen_none(layout, (DEVICE_UPDATE if c < n_dev else STREAMED_UPDATE for c in range(n)))
    T = 0 if tide is None else len(tide.moments)
    return Schedule((DEVICE,) * n, loc, ((),) * T, ((),) * T, (0,), 1, () if tide is None else _moments(tide),
                    pr.predict_optimizer_only(cs, cb, loc, flops_per_step=flops, rates=rates), int(budget))


# ---- the entry point ----------------------------------------------------------------------------

def plan_schedule(layout: ChunkLayout, traces: Sequence[StageTrace], cb: pr.ChunkBytes, budget_bytes: int, *,
                  policy: str = "tide", ranks: int = 1, zero_stage: int | None = None,
                  host_budget_bytes: int | None = None, prefetch: int = 1,
                  segments: Sequence[int] | str | None = "auto", flops_per_step: float = 0.0,
                  rates: Rates = Rates(), host_update: bool = True, resident: Sequence[int] | None = None,
                  must_fit: bool = True, split: bool = True, micro_batches: int = 1,
                  streamed_early: bool = False, storage_devices: int = 0, disk_budget_bytes: int | None = None,
                  disk_versions: int = 2, host_bytes_of=None, cross_step: bool = False, storage_workers=None,
                  clip_expect: str = "rare", turn_cut: bool = True) -> Schedule:
    """Plan one training step under a device budget: the one entry point for every policy.

    Args:
      layout: the chunk layout (chunk ids in first-use order; under ZeRO a layout whose
        ``chunk_size`` splits over the ranks, :func:`chunkjax.topology.build_zero_layout`).
      traces: per-stage traces (:func:`chunkjax.trace_stages`; under ZeRO of one rank's rows).
        ``policy="optimizer_only"`` accepts ``()`` (the training loop is the user's).
      cb: bytes of one whole chunk in each chunk list (:func:`chunkjax.chunk_bytes`).
      budget_bytes: device budget, the peak of all device bytes during the step (bytes; each
        rank's under ZeRO). For ``"optimizer_only"``: the optimizer's device bytes (resident
        master params and state plus one chunk's update), not the loop's params and gradients.
      policy: one of :data:`POLICIES` (see the module docstring).
      ranks: data-parallel ranks each chunk is split over (1: one device, no ZeRO).
      zero_stage: 1, 2 or 3 with ``ranks > 1`` (default 3); must be None with one rank.
      host_budget_bytes: host memory for model data (bytes; under ZeRO the node's, each rank
        holding 1/ranks of it); None: unbounded.
      prefetch: moments between a fetch and its use (>= 1).
      segments: program starts (moment indices), ``"auto"`` (:func:`auto_segments` when host
        updates can overlap the backward, else one program) or None (one program). Used by the
        host-updating policies ``"tide"`` and ``"all_host"``; the others run one program.
      flops_per_step: training FLOPs of one step of one rank (6N + 12LSh per token, times
        tokens), for the step time; 0 times transfers and updates only.
      rates: cost-model rates (:class:`chunkjax.cost.Rates`).
      host_update: ``"tide"``: a host kernel exists for the optimizer (offloaded chunks update
        ``host``; otherwise ``streamed``).
      resident: ``"tide"``: force exactly these chunks resident, the others updated on the host
        (skips the search and the update split).
      split: ``"tide"`` with a host kernel and no ``resident``: split the offloaded chunks' updates between the host
        thread and the device (:func:`chunkjax.plan_split.split_updates`: some ``streamed``) when the model predicts a
        faster step; False: every offloaded chunk updates on the host.
      streamed_early: ``"tide"`` with the split: the step may start streamed updates as their
        gradients complete (:func:`chunkjax.streamed.starts_early`: no clipping, skip, loss
        scaling or micro-batches); the split takes that or after the backward, whichever is
        predicted faster, and records it (``Schedule.streamed_early``). False: after the backward.
      must_fit: False returns a static baseline (``"all_host"``, ``"zero_offload"``) even when
        its predicted peak exceeds the budgets (for reports that compare them).
      micro_batches: gradient accumulation of the step (its host working set).
      storage_devices: ``"tide"`` on one device with a host kernel and ``host_budget_bytes``:
        storage devices (filesystems) of the disk tier (0: none). Offloaded chunks whose master params and
        state the host budget cannot hold (after master-fetch) update ``storage``
        (:mod:`chunkjax.plan_disk`); a model that fits gets no storage chunk.
      storage_workers: near-storage workers, one per storage directory (default ``storage_devices``): their host bytes.
      disk_budget_bytes: bytes the storage directories may hold (None: unbounded).
      disk_versions: versions of each chunk file on disk during a step (2: the crash-safe commit).
      host_bytes_of: ``schedule -> bytes`` compared with ``host_budget_bytes`` when choosing among
        placements (default ``ranks * predicted.host_bytes``; :func:`chunkjax.fit.plan` passes the
        host memory the machine gives the run, its pinned pool as the runtime grows it).
      cross_step: ``"tide"``: time the step with cross-step overlap (:mod:`chunkjax.cross_step`), try forward cuts.
      clip_expect: ``"tide"``: ``"rare"`` or ``"fires"``, when host updates start (:mod:`chunkjax.clip_plan`).
      turn_cut: ``"tide"`` with ``cross_step``: also try the cuts finer at the forward's end and the
        backward's start (:func:`chunkjax.program_cut.turn_cut`); False for comparisons.

    Host-updated chunks of ``"tide"`` and ``"all_host"`` on one device keep a compute-dtype copy
    while ``host_budget_bytes`` allows and are master-fetch beyond
    (:func:`chunkjax.host_forms.assign_host_forms`); the host budget is compared with
    ``predicted.host_bytes``.

    Returns:
      the :class:`~chunkjax.schedule.Schedule` with its :class:`~chunkjax.schedule.Prediction`
      (one rank's figures under ZeRO; :func:`chunkjax.predict_zero.collective_bytes` gives the rank's
      collective bytes).

    Raises:
      PlanError: no schedule of the policy fits the device budget (the message names the
        smallest budget that works and whether activations alone are the cause;
        ``.min_budget_bytes``) or the host budget (the message names the host budget needed).
      ValueError: an unknown policy, ``prefetch < 1``, bad ``ranks`` / ``zero_stage``, no traces,
        or an option the policy does not take (``storage_devices`` needs the tide policy, one
        device, a host kernel and a host budget).
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}: use one of {', '.join(POLICIES)}")
    if prefetch < 1:
        raise ValueError(f"prefetch must be >= 1 moment, got {prefetch}")
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be an int >= 1, got {ranks!r}: use 1 for one device")
    if ranks == 1 and zero_stage is not None:
        raise ValueError(f"zero_stage={zero_stage} needs ranks > 1 (one device has nothing to shard): "
                         "pass ranks=N or zero_stage=None")
    stage = 3 if zero_stage is None else zero_stage
    if ranks > 1 and stage not in (1, 2, 3):
        raise ValueError(f"zero_stage must be 1, 2 or 3, got {zero_stage}")
    if ranks > 1 and policy == "optimizer_only":
        raise ValueError("policy='optimizer_only' plans one device: use ranks=1")
    if resident is not None and policy != "tide":
        raise ValueError(f"resident= forces the tide plan's resident set: policy={policy!r} takes none")
    if not must_fit and policy not in STATIC_POLICIES:
        raise ValueError(f"must_fit=False returns the static baselines {STATIC_POLICIES}, not {policy!r}")
    if storage_devices and (policy != "tide" or ranks != 1 or not host_update or host_budget_bytes is None):
        raise ValueError("the disk tier (storage_devices > 0) plans with policy='tide', one device (ranks=1), a host "
                         "kernel (host_update=True) and a host_budget_bytes: pass those or no storage")
    if not traces and policy != "optimizer_only":
        raise ValueError(f"policy={policy!r} needs the stage traces (chunkjax.trace_stages)")
    traces = tuple(traces)
    tide = memory_tide(traces, layout.chunk_size) if traces else None
    budget = int(budget_bytes)
    plan_cb = cb.per_rank(ranks, stage) if ranks > 1 else cb

    def finish(s: Schedule) -> Schedule:  # one rank's bytes moved and held under ZeRO
        if ranks == 1:
            return s
        return dataclasses.replace(s, predicted=per_rank(s.predicted, cb, ranks, stage, s.update_locations,
                                                            s.param_kinds))

    def host_bytes(s: Schedule) -> int:
        return ranks * s.predicted.host_bytes if host_bytes_of is None else host_bytes_of(s)

    def host_fits(s: Schedule) -> bool:
        return host_budget_bytes is None or host_bytes(s) <= host_budget_bytes

    def forms(s: Schedule | None, predict=pr.predict) -> Schedule | None:  # copy or master-fetch per host chunk
        if s is None or ranks > 1:
            return s
        return assign_host_forms(s, plan_cb, host_budget_bytes, chunk_size=layout.chunk_size, traces=traces,
                                 tide=tide, rates=rates, flops_per_step=flops_per_step, micro_batches=micro_batches,
                                 host_bytes_of=host_bytes_of, predict=predict)

    if policy == "tide":
        T = len(tide.moments)
        segs = ((auto_segments(T, len(traces)) if host_update else (0,)) if segments == "auto"
                else (0,) if segments is None else tuple(segments))
        workers = int(storage_devices if storage_workers is None else storage_workers)
        disk = (host_budget_bytes, disk_budget_bytes, int(storage_devices), disk_versions, workers) if storage_devices else None
        cross = dict(cross_step=True, prefetch=prefetch) if cross_step else {}
        predict = predictor(norm_wait=norm_wait(clip_expect), **cross)  # each once, timed as the step runs
        ok = (lambda x: host_fits(forms(x, predict))) if ranks == 1 else None  # the split's host check
        done = pr.grad_done_moments(traces, tide)
        placed: dict = {}  # (budget, resident set) -> the schedule of one(), each placement scheduled once

        def one(b, res):
            key = (b, frozenset(res))
            if key not in placed:
                s = forms(_tide_one(layout, traces, tide, plan_cb, b, res, host_update, prefetch, segs, rates,
                                    flops_per_step, split and resident is None, streamed_early,
                                    micro_batches=micro_batches, predict=predict, grad_done=done, host_ok=ok), predict)
                s = s if s is None or disk is None else place_on_disk(
                    s, plan_cb, chunk_size=layout.chunk_size, traces=traces, tide=tide, disk=disk, rates=rates,
                    flops_per_step=flops_per_step, micro_batches=micro_batches, streamed_early=streamed_early,
                    host_bytes_of=None if ranks > 1 else host_bytes_of)
                placed[key] = None if s is None else finish(s)
            return placed[key]

        def offloaded_fits(b) -> bool:
            # one(b, set()) is not None: the update split, the early streamed start (a reserve
            # that only lowers the room), the host forms and the disk never refuse a placement
            # that fits, so the plain all-offloaded placement decides
            return _tide_one(layout, traces, tide, plan_cb, b, set(), host_update, prefetch, segs, rates,
                             flops_per_step, micro_batches=micro_batches, predict=predict, grad_done=done) is not None

        best = _tide(one, layout.n_chunks, budget, host_fits, resident)
        if best is None and disk is not None and one(budget, set()) is not None:  # the device fits; the host does not
            # each placement's least host need over the storage chunks tried (plan_disk.place_on_disk)
            need, least = min(((host_bytes(s), s) for s in (one(budget, set(range(k))) for k in range(layout.n_chunks + 1))
                               if s is not None), key=lambda x: (x[0], x[1].predicted.storage_chunks))
            if need >= OVER_HOST_LIMIT:
                raise PinnedLimitError(_MSG_HOST_LIMIT.format(dev=budget), budget, False)
            held = None if disk_budget_bytes is None else disk_budget_bytes // (disk_versions * max(1, pr.disk_file_bytes(plan_cb)))
            raise host_disk_error(host_budget_bytes, least, need, budget, workers, disk_budget_bytes, held)
        if best is None:
            _tide_infeasible(one, offloaded_fits, layout.n_chunks, tide, plan_cb, budget, host_budget_bytes, ranks,
                             host_bytes)
        if segments == "auto" and ranks == 1 and disk is None:
            best = cut_and_start(best, lambda b, res, **kw: forms(_tide_one(
                layout, traces, tide, plan_cb, b, res, host_update, prefetch, segs, rates, flops_per_step, **kw,
                predict=predict, grad_done=done, host_ok=ok), predict),
                plan_cb, layout=layout, traces=traces, tide=tide, rates=rates, flops_per_step=flops_per_step,
                fits=host_fits, micro_batches=micro_batches, streamed_early=streamed_early and split,
                split=split and resident is None, predict=predict, cross_step=cross_step, turn=turn_cut)
        return best
    if policy == "fixed":
        s = finish(_fixed(layout, traces, tide, plan_cb, budget, prefetch, rates, flops_per_step))
    elif policy == "all_host":
        segs = (0,) if segments is None else segments if segments == "auto" else tuple(segments)
        s = _all_host(layout, traces, tide, plan_cb, budget, prefetch, segs, rates, flops_per_step)
        s = finish(forms(s) or s)
    elif policy == "zero_offload":
        s = finish(_zero_offload(layout, traces, tide, plan_cb, budget, rates, flops_per_step))
    else:
        s = _optimizer_only(layout, traces, tide, cb, budget, rates, flops_per_step)
    if must_fit and s.predicted.peak_device_bytes > budget:  # the static baselines
        need = s.predicted.peak_device_bytes
        raise PlanError(_MSG_STATIC_INFEASIBLE.format(policy=policy, need=need, budget=budget,
                                                      need_size=format_bytes(need, up=True)), need, False)
    if must_fit and not host_fits(s):
        raise _host_error(host_budget_bytes, host_bytes(s) // ranks, budget, ranks)
    return s
