"""The static offload schedule: placement, fetches, evictions and update locations from the tide.

PatrickStar (arXiv 2108.05818, sections 4.2-4.3 and 5) decides at run time, from a warm-up
iteration, which chunks stay on the GPU, evicts the chunk used furthest in the future and places
each chunk's optimizer update where its state is. chunkjax decides all of it before the first
step, from the traced memory tide (:mod:`chunkjax.tide`), as a pure function of shapes and
budgets (nothing is allocated):

1. **Placement between steps**, chunk by chunk in first-use order: a chunk is either *resident*
   (compute params, master params and optimizer state on the device; update location
   ``device``) or its compute params live in pinned host memory and its update runs ``host``
   (in place on the host: gradients go down, new compute params are read by the next fetch) or
   ``streamed`` (state moved through the device for the update) when no host kernel exists for
   the optimizer. The first chunks are the ones whose gradients complete *last* in the backward
   pass, so placing them on the device also shortens the host update that cannot overlap
   with the backward.
2. **Fetches and evictions per moment**: the device memory left at each moment (budget minus
   resident model data minus the tide) bounds the chunk buffers there; Belady's rule
   (:func:`chunkjax.eviction.belady`) keeps the chunks whose next use is nearest and fetches the
   rest, each ``prefetch`` moments before its use. A chunk fetched for the forward pass can
   stay on the device into the backward pass where the tide leaves room.
3. **Programs**: the step is cut into ``segments`` jitted programs at backward moments, so that
   a host thread updates the chunks whose gradients are complete while the device runs the rest
   of the backward pass (the last program is the shortest: what it leaves for the host is the
   update that cannot overlap).
4. **Prediction**: peak device bytes, bytes moved each way per step and step time from the cost
   model in :mod:`chunkjax.cost`.

Every candidate placement (how many chunks resident) is scheduled and predicted; the fastest one
within the budget is returned.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from chunkjax.cost import PipelinedStepTime, Rates, predict_pipelined_step
from chunkjax.eviction import CapacityError, belady
from chunkjax.layout import ChunkLayout
from chunkjax.memory import DEVICE, PINNED_HOST
from chunkjax.plan import ChunkBytes, Placement, PlanError, StageTrace, _gib_ceil
from chunkjax.stages import first_readers
from chunkjax.tide import Tide, memory_tide

DEVICE_UPDATE, STREAMED_UPDATE, HOST_UPDATE = "device", "streamed", "host"
UPDATE_LOCATIONS = (DEVICE_UPDATE, STREAMED_UPDATE, HOST_UPDATE)
#: predicted step times within this fraction of the fastest count as a tie
NEAR_TIE = 0.02


@dataclasses.dataclass(frozen=True)
class Prediction:
    """What a schedule is predicted to cost per step (bytes, seconds).

    Attributes:
      peak_device_bytes: largest device bytes at any moment or in the update phase.
      device_model_bytes: model data resident on the device between steps.
      host_model_bytes: model data and gradient buffers in host memory.
      h2d_bytes_per_step / d2h_bytes_per_step: bytes moved each way per step.
      fetch_bytes_per_step: part of h2d that is chunk fetches during forward/backward.
      n_fetches: chunk fetches per step.
      device_bytes_per_moment: predicted device bytes at each moment (model + tide + buffers).
      time: predicted step time and where it goes.
    """

    peak_device_bytes: int
    device_model_bytes: int
    host_model_bytes: int
    h2d_bytes_per_step: int
    d2h_bytes_per_step: int
    fetch_bytes_per_step: int
    n_fetches: int
    device_bytes_per_moment: tuple[int, ...]
    time: PipelinedStepTime

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["time"] = self.time.to_dict()
        d["device_bytes_per_moment"] = list(self.device_bytes_per_moment)
        return d


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A static offload schedule for one (model, layout, batch shape, budget).

    Attributes:
      param_kinds: per chunk, memory kind of its compute params between steps.
      update_locations: per chunk, ``"device"``, ``"streamed"`` or ``"host"``.
      fetch: per moment (tide order), host-param chunk ids fetched to the device for it.
      evict: per moment, chunk ids whose device copy is released after it (their next read,
        if any, is a fresh fetch).
      segments: moment index at which each jitted program of the step begins (starts with 0).
      prefetch: moments between issuing a fetch and the moment that reads it (>= 1).
      moments: per moment, ``(phase, stage)`` with phase as in :mod:`chunkjax.tide`.
      predicted: the :class:`Prediction`.
      budget_bytes: the device budget planned for.
    """

    param_kinds: tuple[str, ...]
    update_locations: tuple[str, ...]
    fetch: tuple[tuple[int, ...], ...]
    evict: tuple[tuple[int, ...], ...]
    segments: tuple[int, ...]
    prefetch: int
    moments: tuple[tuple[str, int], ...]
    predicted: Prediction
    budget_bytes: int

    def __post_init__(self):
        if len(self.param_kinds) != len(self.update_locations):
            raise ValueError("param_kinds and update_locations need one entry per chunk")
        for u in self.update_locations:
            if u not in UPDATE_LOCATIONS:
                raise ValueError(f"update location {u!r} is not one of {UPDATE_LOCATIONS}")
        if not self.segments or self.segments[0] != 0 or list(self.segments) != sorted(set(self.segments)):
            raise ValueError(f"segments must start at 0 and increase, got {self.segments}")

    @property
    def n_chunks(self) -> int:
        return len(self.param_kinds)

    @property
    def placement(self) -> Placement:
        """The placement between steps (state of ``host``/``streamed`` chunks is on the host)."""
        return Placement(self.param_kinds,
                         tuple(DEVICE if u == DEVICE_UPDATE else PINNED_HOST for u in self.update_locations))

    def counts(self) -> dict[str, int]:
        """Chunks per (params kind, update location)."""
        out: dict[str, int] = {}
        for p, u in zip(self.param_kinds, self.update_locations):
            k = f"params_{p}/update_{u}"
            out[k] = out.get(k, 0) + 1
        return out

    def residency(self) -> list[list[bool]]:
        """Per chunk, per moment: is a copy of the chunk's compute params on the device."""
        T = len(self.moments)
        res = [[self.param_kinds[c] == DEVICE] * T for c in range(self.n_chunks)]
        live: set[int] = set()
        for t in range(T):
            live |= set(self.fetch[t])
            for c in live:
                res[c][t] = True
            live -= set(self.evict[t])
        return res

    def to_dict(self) -> dict:
        return {"param_kinds": list(self.param_kinds), "update_locations": list(self.update_locations),
                "fetch": [list(f) for f in self.fetch], "evict": [list(e) for e in self.evict],
                "segments": list(self.segments), "prefetch": self.prefetch,
                "moments": [list(m) for m in self.moments], "counts": self.counts(),
                "budget_bytes": self.budget_bytes, "predicted": self.predicted.to_dict()}


def auto_segments(n_moments: int, n_stages: int, max_programs: int = 8) -> tuple[int, ...]:
    """Program starts for a pipelined step: the first program holds the forward pass and the
    fused head; the backward is cut from its end in sizes 1, 2, 4, ... (at most ``max_programs``
    programs), the rest of it being one program. The host thread updates a program's chunks
    while the next ones run; the last program's are the update that cannot overlap."""
    starts, size, end = [], 1, n_moments
    first_bwd = n_stages  # moments 0..n-2 forward, n-1 fused, n.. backward
    while len(starts) < max_programs - 2 and end - size >= first_bwd:
        starts.append(end - size)
        end -= size
        size *= 2
    if end > first_bwd:  # the host starts on the head's gradients while the backward runs
        starts.append(first_bwd)
    return tuple([0] + sorted(set(starts)))


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


def grad_done_moments(traces, tide: Tide) -> dict[int, int]:
    """Chunk id -> index of the moment its gradient is complete: the backward (or fused) moment
    of the first stage that reads it."""
    first = first_readers([t.chunks for t in traces])
    done = {}
    for i, m in enumerate(tide.moments):
        if m.phase != "forward":
            for c, s in first.items():
                if s == m.stage:
                    done[c] = i
    return done


def _schedule_one(layout: ChunkLayout, traces, tide: Tide, cb: ChunkBytes, budget: int, resident: set[int],
                  host_update: bool, prefetch: int, segments: tuple[int, ...], rates: Rates,
                  flops_per_step: float):
    """Schedule one placement (``resident`` chunks fully on the device); None if it cannot fit."""
    n = layout.n_chunks
    T = len(tide.moments)
    pk = tuple(DEVICE if c in resident else PINNED_HOST for c in range(n))
    loc = tuple(DEVICE_UPDATE if c in resident else (HOST_UPDATE if host_update else STREAMED_UPDATE)
                for c in range(n))
    if HOST_UPDATE not in loc:  # nothing for a host thread to overlap: one program
        segments = (0,)
    dev_model = sum(cb.params + cb.state for c in resident)
    # gradients of resident chunks wait on the device for the update program
    grad_done_at = grad_done_moments(traces, tide)
    waiting = [sum(cb.grad for c in resident if grad_done_at.get(c, T) <= t) for t in range(T)]
    accesses = [tuple(c for c in m.chunks if pk[c] == PINNED_HOST) for m in tide.moments]
    max_reads = max((len(a) for a in accesses), default=0)
    caps = []
    for t, m in enumerate(tide.moments):
        avail = budget - dev_model - m.non_model_bytes - waiting[t]
        cap = math.floor(avail / cb.params) - prefetch * max_reads if cb.params else 0
        if cap < len(accesses[t]):
            return None
        caps.append(cap)
    try:
        ev = belady(accesses, caps)
    except CapacityError:
        return None
    fetch = ev.fetch
    per_moment = []
    for t, m in enumerate(tide.moments):
        inflight = sum(len(fetch[u]) for u in range(t + 1, min(T, t + 1 + prefetch)))
        bufs = len(ev.resident_after[t]) + inflight
        per_moment.append(dev_model + m.non_model_bytes + waiting[t] + bufs * cb.params)
    dev_grads = sum(cb.grad for c in resident)
    update_peak = dev_model + (dev_grads + 2 * layout.chunk_size * 4 if resident else 0)
    streamed = [c for c in range(n) if loc[c] == STREAMED_UPDATE]
    if streamed:
        update_peak = max(update_peak, dev_model + cb.grad + cb.state + 2 * cb.params)
    peak = max(max(per_moment), update_peak)
    if peak > budget:
        return None
    n_fetch = sum(len(f) for f in fetch)
    offloaded = [c for c in range(n) if c not in resident]
    fetch_b = n_fetch * cb.params
    h2d = fetch_b + sum(cb.grad + cb.state for c in streamed)
    d2h = len(offloaded) * cb.grad + sum(cb.state + cb.params for c in streamed)
    host = sum(cb.params + cb.state + cb.grad for c in offloaded)
    # where the fetch bytes fall (forward vs fused/backward), for the cost model
    n_stages = len(traces)
    fwd_fetch = sum(len(fetch[t]) for t in range(n_stages - 1)) * cb.params
    # the host thread takes each program's host chunks when that program ends
    bounds = list(segments) + [T]
    bwd_moments = T - (n_stages - 1)
    host_ready = []
    for p0, p1 in zip(bounds[:-1], bounds[1:]):
        params = sum(layout.chunk_size for c in offloaded if loc[c] == HOST_UPDATE and p0 <= grad_done_at.get(c, T - 1) < p1)
        if params:
            host_ready.append((min(1.0, max(0.0, (p1 - (n_stages - 1)) / bwd_moments)), params))
    time = predict_pipelined_step(
        flops_per_step, fwd_h2d=fwd_fetch, bwd_h2d=fetch_b - fwd_fetch, bwd_d2h=len(offloaded) * cb.grad,
        streamed_bytes=sum(2 * cb.state + cb.grad + cb.params for c in streamed),
        device_params=len(resident) * layout.chunk_size,
        streamed_params=len(streamed) * layout.chunk_size, host_ready=host_ready, rates=rates)
    pred = Prediction(int(peak), int(dev_model), int(host), int(h2d), int(d2h), int(fetch_b), int(n_fetch),
                      tuple(int(b) for b in per_moment), time)
    return Schedule(pk, loc, tuple(fetch), tuple(_evictions(fetch, accesses, T)), segments, prefetch,
                    tuple((m.phase, m.stage) for m in tide.moments), pred, int(budget))


def plan_schedule(layout: ChunkLayout, traces: Sequence[StageTrace], cb: ChunkBytes, budget_bytes: int, *,
                  flops_per_step: float, host_update: bool = True, prefetch: int = 1,
                  segments: Sequence[int] | str | None = "auto", rates: Rates = Rates(),
                  host_budget_bytes: int | None = None, resident: Sequence[int] | None = None) -> Schedule:
    """The fastest predicted schedule whose peak device bytes fit ``budget_bytes``.

    Args:
      layout: the chunk layout (chunk ids in first-use order).
      traces: per-stage traces (:func:`chunkjax.trace_stages`).
      cb: bytes of one chunk in each chunk list (:func:`chunkjax.chunk_bytes`).
      budget_bytes: device budget (peak of all device bytes during the step).
      flops_per_step: training FLOPs of one step (6N + 12LSh per token, times tokens).
      host_update: a host kernel exists for the optimizer (offloaded chunks update ``host``;
        otherwise ``streamed``).
      prefetch: moments between a fetch and its use.
      segments: program starts (moment indices), ``"auto"`` (:func:`auto_segments` when host
        updates can overlap the backward, else one program) or None (one program).
      rates: cost-model rates (:class:`chunkjax.cost.Rates`).
      host_budget_bytes: host memory for model data (None: unbounded).
      resident: force exactly these chunks resident (skips the search).

    Raises:
      PlanError: no placement fits (the message gives the smallest budget that does and whether
        activations alone are the cause), or the host budget is too small.
    """
    n = layout.n_chunks
    tide = memory_tide(tuple(traces), layout.chunk_size)
    T = len(tide.moments)
    if prefetch < 1:
        raise ValueError(f"prefetch must be >= 1 moment, got {prefetch}")
    if segments == "auto":
        segs = auto_segments(T, len(traces)) if host_update else (0,)
    elif segments is None:
        segs = (0,)
    else:
        segs = tuple(segments)
    args = (layout, traces, tide, cb, budget_bytes)
    rest = (host_update, prefetch, segs, rates, flops_per_step)
    if resident is not None:
        s = _schedule_one(*args, set(resident), *rest)
        if s is None:
            raise PlanError(f"the forced resident chunks {list(resident)} do not fit {budget_bytes} bytes: "
                            "lower the resident set or raise the device budget", budget_bytes, False)
        return s
    cands = []
    for k in range(n + 1):  # the first k chunks (first-use order) resident
        s = _schedule_one(*args, set(range(k)), *rest)
        if s is None:
            if k == 0:
                break
            continue
        if host_budget_bytes is not None and s.predicted.host_model_bytes > host_budget_bytes:
            continue
        cands.append(s)
    best = None
    if cands:
        # near-ties (within the cost model's resolution) go to the most resident placement:
        # fewer bytes moved, PatrickStar's rule of keeping chunks on the device while memory allows
        fastest = min(c.predicted.time.step_s for c in cands)
        best = [c for c in cands if c.predicted.time.step_s <= fastest * (1 + NEAR_TIE)][-1]
    if best is None:
        _raise_infeasible(layout, traces, tide, cb, budget_bytes, prefetch, host_budget_bytes, *rest)
    return best


def _raise_infeasible(layout, traces, tide, cb, budget, prefetch, host_budget, *rest):
    fits = _schedule_one(layout, traces, tide, cb, budget, set(), *rest)
    if fits is not None and host_budget is not None:  # the device fits; the host does not
        need = min(s.predicted.host_model_bytes for s in
                   (_schedule_one(layout, traces, tide, cb, budget, set(range(k)), *rest)
                    for k in range(layout.n_chunks + 1)) if s is not None)
        raise PlanError(f"host budget {host_budget} bytes is below the {need} bytes of model data that must "
                        f"stay on the host at this device budget: raise --host-budget to >= "
                        f"{_gib_ceil(need):.3f}GiB or the device budget", budget, False)
    # smallest budget with every chunk offloaded: bisect on the all-offloaded schedule
    lo, hi = budget, max(budget, 1) * 2
    while _schedule_one(layout, traces, tide, cb, hi, set(), *rest) is None:
        lo, hi = hi, hi * 2
        if hi > 2**50:
            raise PlanError("no device budget fits this step", hi, True)
    while hi - lo > max(1, cb.params // 64):
        mid = (lo + hi) // 2
        if _schedule_one(layout, traces, tide, cb, mid, set(), *rest) is None:
            lo = mid
        else:
            hi = mid
    s = _schedule_one(layout, traces, tide, cb, hi, set(), *rest)
    if s is not None and budget >= hi and host_budget is not None:
        raise PlanError(f"host budget {host_budget} bytes is below the {s.predicted.host_model_bytes} bytes of "
                        f"model data offloaded at this device budget: raise --host-budget to >= "
                        f"{_gib_ceil(s.predicted.host_model_bytes):.3f}GiB or the device budget", hi, False)
    act = tide.peak_non_model_bytes
    alone = act > budget
    why = "; activations alone exceed the budget" if alone else ""
    fix = " or lower the batch / sequence length (activations are checkpointed per block)" if alone else ""
    raise PlanError(f"device budget {budget} bytes is below the {hi} bytes this step needs with every chunk "
                    f"offloaded (non-model peak {act} bytes){why}: use --device-budget >= {_gib_ceil(hi):.3f}GiB{fix}",
                    hi, alone)
