"""Planner CLI: the schedule chunkjax would run for a model, batch and budget, next to the static
partitions users know, all planned by the same engine on abstract shapes (runs on a CPU).

    python -m experiments.plan --model GPT3_10B --device-budget 24GiB --host-budget 120GiB \\
        --batch 8 --seq 1024 [--json] [--tide-from RESULTS_JSON] [--ranks N [--zero-stage 3]]

The plan is :func:`chunkjax.schedule.plan_schedule` with the host AdamW kernel (offloaded chunks
update in place on the host, overlapping the backward pass). Baselines, scheduled over the same
tide with the same accounting and cost model (:func:`fixed_schedule`):

``all_host``
    every chunk's model data in pinned host memory; each chunk is fetched at *every* moment that
    reads it and released after it (the fixed fetch rule: no chunk is held between uses);
    gradients go down as they complete and the host updates in place, overlapping the backward.
``zero_offload``
    compute params on the device for the whole step (all uploaded at its start), gradients
    offloaded as they complete, master params and optimizer state on the host, updated there
    after the backward with no overlap (ZeRO-Offload, arXiv 2101.06840; its upload of the new
    params here overlaps the next forward).

An infeasible budget exits 2 and names the smallest budget that works and whether activations
alone are the cause (:class:`chunkjax.PlanError`).

Non-model bytes come from compiling each distinct stage for the backend this runs on. On the CPU
that is an *estimate* of the GPU's, and a high one: XLA CPU's attention materialises the
(B, heads, T, T) scores (GPT3_6B at batch 32x1024: block temporaries ~19 GB on the CPU against
5.06 GB on the H200). ``--tide-from RESULTS_JSON`` takes the per-stage temporaries recorded by a
GPU run of experiments/bench.py (``stage_temp_bytes`` of the chunkjax system) when model, batch
and sequence match, and the cost-model rates that run calibrated; otherwise the plan is labelled
"estimated on cpu".

ZeRO over N GPUs of one node (``--ranks N``, N > 1; ``--zero-stage`` 1, 2 or 3, default 3): the
plan of every rank of :class:`chunkjax.zero_schedule.ZeroScheduledStep`, as
experiments/bench_chunkjax.py plans it on N real devices, here on abstract shapes (no mesh, no
devices: it runs on a one-device CPU). ``--batch`` is the *global* batch (rows per step, split
evenly: each rank traces ``batch / N`` rows), ``--device-budget`` is each GPU's (bytes), and
``--host-budget`` is the node's host memory for model data (bytes; each rank gets 1/N of it).
The layout is :func:`chunkjax.zero.build_zero_layout` (chunks split evenly over the ranks) and
the schedule :func:`chunkjax.zero_schedule.plan_zero_schedule`: per-rank chunk bytes
(:func:`~chunkjax.zero_schedule.rank_chunk_bytes`), one rank's FLOPs (1/N of the step's). The
report gives per rank the peak device bytes, the host bytes of model data, the H2D / D2H bytes
per step and the predicted step (seconds), the collective bytes one rank sends per step
(accounted, ring algorithms), and per node the host bytes (N x a rank's) and tokens/s (global
batch x seq / predicted step). The predicted step does *not* include collectives: the cost model
(:func:`chunkjax.cost.predict_pipelined_step`) times compute, PCIe transfers (each rank its own
link), host and device updates, and nothing of the all-gathers / reduce-scatters (see
:data:`ZERO_TIME_NOTE`). No baselines are planned for N > 1 (they are single-device schedules).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time
from typing import Sequence

BASELINES = ("all_host", "zero_offload")
ZERO_STAGES = (1, 2, 3)
#: what the predicted step of a ZeRO plan counts and leaves out (printed and in the JSON)
ZERO_TIME_NOTE = (
    "predicted step = one rank's step by chunkjax.cost.predict_pipelined_step: compute (1/N of the step's FLOPs "
    "at rates.matmul_flops_per_s, with recompute), the rank's PCIe fetches/offloads (each rank its own link; "
    "host memory bandwidth shared by the N links is not modeled; a ZeRO-3 fetch is timed at the full chunk plus "
    "the rank's shard, rank_chunk_bytes' figure, though only the shard crosses PCIe), the host AdamW of every "
    "offloaded chunk's full chunk_size (one process's host thread updates the slices of all N ranks, at "
    "rates.host_update_s_per_param) and device updates (timed for full chunks; a rank updates its 1/N). "
    "NOT included: collective time (all-gather of params, "
    "reduce-scatter / all-reduce of gradients over NVLink), neither its duration nor its overlap with compute; "
    "their bytes are given (collective_bytes_per_step_per_rank, accounted, not timed)")
_MSG_HOST_ZERO = ("node host budget {host} bytes ({host_rank} per rank over {n} ranks) is below the {need_node} bytes "
                  "({need} per rank) of model data the host must hold at a device budget of {dev} bytes per GPU "
                  "(every chunk that fits stays on the device): use --host-budget >= {need_gib:.3f}GiB (the node's) "
                  "or a larger --device-budget")
_MSG_HOST = ("host budget {host} bytes is below the {need} bytes of model data and gradient buffers the host "
             "must hold at a device budget of {dev} bytes (every chunk that fits stays on the device): use "
             "--host-budget >= {need_gib:.3f}GiB or a larger --device-budget")
#: recorded stage names whose temporaries stand for a group of identical stages
_BLOCK_PREFIX, _BLOCK_REF = "h_", "h_0"


@dataclasses.dataclass(frozen=True)
class PlanInputs:
    """Everything a plan needs for one (model, batch, seq), traced once.

    Attributes:
      cfg: the model config (models/gpt.py).
      batch, seq: batch shape, rows x tokens (tokens per step = batch * seq); with ``n_ranks`` > 1
        the global batch (each rank runs ``batch / n_ranks`` rows).
      layout: chunk layout (chunk ids in first-use order; with ``n_ranks`` > 1 a ZeRO layout whose
        ``chunk_size`` splits evenly over the ranks).
      traces: per-stage traces of one rank's rows (temporaries from the backend, or from a
        recorded GPU run).
      tide: the memory tide over ``traces`` (one rank's non-model bytes).
      cb: bytes of one whole chunk per chunk list (AdamW state).
      flops_per_step: training FLOPs of one step of one rank (FLOPs).
      rates: cost-model rates.
      tide_source: where the non-model bytes come from ("estimated on cpu", "recorded on gpu ...").
      rates_source: where the rates come from.
      n_ranks: data-parallel ranks (GPUs) the step is split over (1: one device, no ZeRO).
    """

    cfg: object
    batch: int
    seq: int
    layout: object
    traces: tuple
    tide: object
    cb: object
    flops_per_step: float
    rates: object
    tide_source: str
    rates_source: str
    n_ranks: int = 1

    @property
    def rank_batch(self) -> int:
        """Rows one rank runs per step."""
        return self.batch // self.n_ranks


def _recorded(path: str | pathlib.Path) -> tuple[dict, dict]:
    """(top-level record, chunkjax system record) of a results JSON."""
    rec = json.loads(pathlib.Path(path).read_text())
    systems = rec.get("systems") or {}
    sys_rec = systems.get("chunkjax") or next(
        (s for s in systems.values() if (s.get("extra") or {}).get("stage_temp_bytes")), {})
    return rec, sys_rec


def recorded_stage_temps(path, model: str, batch: int, seq: int, stage_names: Sequence[str]
                         ) -> tuple[dict[str, int] | None, str]:
    """Per-stage temporaries recorded by a GPU run, when its model, batch and seq match.

    Block stages (``h_<i>``) take the recorded ``h_0`` figure (identical blocks compile to one
    program). ``batch`` is rows per device; a recorded ZeRO run (``extra.zero_stage`` over
    ``extra.n_devices``) traced ``batch / n_devices`` rows per device, which is what it is compared
    with. Returns (``{stage name: bytes}`` or None, a one-line reason when None).
    """
    from models import gpt

    rec, s = _recorded(path)
    temps = (s.get("extra") or {}).get("stage_temp_bytes")
    if not temps:
        return None, f"{path} records no stage_temp_bytes (a chunkjax run of experiments/bench.py does)"
    r_model = s.get("model", rec.get("model"))
    r_batch, r_seq = s.get("batch", rec.get("batch")), s.get("seq", rec.get("seq"))
    extra = s.get("extra") or {}
    r_dev = int(extra.get("n_devices") or 1) if extra.get("zero_stage") else 1
    if r_dev > 1 and isinstance(r_batch, int):
        r_batch //= r_dev  # a ZeRO run traced each device's rows
    try:
        same_model = gpt.get_config(str(r_model)).name == gpt.get_config(model).name
    except ValueError:
        same_model = False
    if not (same_model and r_batch == batch and r_seq == seq):
        return None, (f"{path} was recorded for {r_model} at batch {r_batch}x{r_seq}, "
                      f"not {model} at {batch}x{seq}")
    out = {}
    for n in stage_names:
        key = _BLOCK_REF if n.startswith(_BLOCK_PREFIX) and n not in temps else n
        if key not in temps:
            return None, f"{path} records no temporaries for stage {n!r}"
        out[n] = int(temps[key])
    return out, ""


def recorded_rates(path):
    """The cost-model rates a recorded GPU run calibrated (None if it has none)."""
    from chunkjax.cost import Rates

    _, s = _recorded(path)
    r = (s.get("extra") or {}).get("rates")
    if not r:
        return None
    fields = {f.name for f in dataclasses.fields(Rates)}
    return Rates(**{k: float(v) for k, v in r.items() if k in fields})


def trace_inputs(model: str, batch: int, seq: int, *, chunk_size: int | None = None,
                 min_chunks: int = 8, n_ranks: int = 1) -> PlanInputs:
    """Trace a model's stages for a batch shape on this backend (abstract shapes only) and build
    its tide, with the default rates.

    Args:
      model: a name of models/gpt.py's table (case-insensitive).
      batch, seq: batch shape (rows, tokens per row); with ``n_ranks`` > 1 the global batch.
      chunk_size: elements per chunk (None: chunkjax's search, as experiments/bench.py uses).
      min_chunks: passed to the chunk-size search.
      n_ranks: ZeRO ranks (> 1: the layout of :func:`chunkjax.zero.build_zero_layout`, each rank's
        ``batch / n_ranks`` rows traced and 1/n_ranks of the FLOPs, as
        experiments/bench_chunkjax.py plans a ZeRO run; no devices are needed).

    Raises:
      ValueError: unknown model, ``seq`` beyond the model's positions, ``n_ranks < 1`` or a batch
        that does not split over the ranks.
    """
    import jax
    import jax.numpy as jnp

    import chunkjax as cj
    from chunkjax.cost import Rates
    from chunkjax.host_update import AdamW
    from chunkjax.optim import state_bytes_per_chunk
    from chunkjax.tide import memory_tide
    from models import gpt

    cfg = gpt.get_config(model)
    if seq > cfg.seq_len:
        raise ValueError(f"--seq {seq} exceeds the model's {cfg.seq_len} positions")
    if batch < 1 or seq < 1:
        raise ValueError("--batch and --seq must be >= 1")
    check_ranks(batch, n_ranks)
    stages = gpt.gpt_stages(cfg)
    ap = gpt.abstract_params(cfg)
    ab = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
    order = cj.first_use_order(lambda p, b: cj.compose_loss(stages, p, b), ap, ab)
    layout = cj.build_layout(ap, chunk_size, order, min_chunks=min_chunks)
    if n_ranks > 1:  # chunks that split over the ranks; each rank traces its rows
        from chunkjax.topology import build_zero_layout
        layout = build_zero_layout(ap, n_ranks, layout.chunk_size, order)
        ab = jax.ShapeDtypeStruct((batch // n_ranks, seq + 1), jnp.int32)
    traces = cj.trace_stages(stages, layout, ab, jnp.bfloat16)
    backend = jax.default_backend()
    spec = AdamW(1e-4, weight_decay=1e-4)  # what experiments/bench.py's chunkjax system runs
    cb = cj.chunk_bytes(layout, jnp.bfloat16, state_bytes_per_chunk(spec.optax(), layout.chunk_size))
    return PlanInputs(cfg, batch, seq, layout, traces, memory_tide(traces, layout.chunk_size), cb,
                      float(cfg.flops_per_token(seq) * batch * seq // n_ranks), Rates(),
                      f"estimated on {backend}" if backend != "gpu" else "traced on gpu",
                      "chunkjax.cost.Rates() defaults (H200)", n_ranks)


def check_ranks(batch: int, n_ranks: int, zero_stage: int = 3) -> None:
    """Raise ValueError (one line naming what to use) unless ``n_ranks >= 1``, ``zero_stage`` is
    1, 2 or 3 and the global ``batch`` (rows) splits evenly over the ranks."""
    if not isinstance(n_ranks, int) or n_ranks < 1:
        raise ValueError(f"--ranks must be >= 1 (GPUs the step is split over), got {n_ranks}: "
                         "use --ranks 1 for one GPU")
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"--zero-stage must be 1, 2 or 3, got {zero_stage}: use 3 (params, gradients and "
                         "optimizer state sharded), 2 or 1")
    if batch % n_ranks:
        up = -(-batch // n_ranks) * n_ranks
        raise ValueError(f"--batch {batch} (the global batch) does not split over {n_ranks} ranks: use a "
                         f"multiple of {n_ranks}, e.g. --batch {up}")


def with_recorded(inp: PlanInputs, path, warn=None) -> PlanInputs:
    """``inp`` with the stage temporaries a GPU run recorded in the results JSON ``path`` (when its
    model, batch and seq match; otherwise ``warn`` is called with the reason and the traced tide
    stays) and the rates that run calibrated (when recorded: they describe the machine)."""
    from chunkjax.tide import memory_tide

    temps, why = recorded_stage_temps(path, inp.cfg.name, inp.rank_batch, inp.seq, [t.name for t in inp.traces])
    if temps is None:
        if warn:
            warn(f"--tide-from: {why}; the tide is {inp.tide_source}")
    else:
        traces = tuple(dataclasses.replace(t, temp_bytes=temps[t.name]) for t in inp.traces)
        inp = dataclasses.replace(inp, traces=traces, tide=memory_tide(traces, inp.layout.chunk_size),
                                  tide_source=f"recorded on gpu ({path}: stage temporaries)")
    rates = recorded_rates(path)
    if rates is not None:
        inp = dataclasses.replace(inp, rates=rates, rates_source=f"recorded in {path}")
    return inp


def prepare(model: str, batch: int, seq: int, *, chunk_size: int | None = None, min_chunks: int = 8,
            tide_from: str | None = None, warn=None, n_ranks: int = 1) -> PlanInputs:
    """:func:`trace_inputs`, then :func:`with_recorded` when ``tide_from`` (a results JSON of a GPU
    run of experiments/bench.py) is given."""
    kw = {"n_ranks": n_ranks} if n_ranks != 1 else {}
    inp = trace_inputs(model, batch, seq, chunk_size=chunk_size, min_chunks=min_chunks, **kw)
    return with_recorded(inp, tide_from, warn) if tide_from else inp


# ---- baselines: fixed schedules over the same tide ---------------------------------------------

def grad_done_at(traces, tide) -> dict[int, int]:
    """Chunk -> moment its gradient is complete (:func:`chunkjax.schedule.grad_done_moments`)."""
    from chunkjax.schedule import grad_done_moments
    return grad_done_moments(traces, tide)


def fixed_schedule(kind: str, layout, traces, tide, cb, budget_bytes: int, *, flops_per_step: float,
                   prefetch: int = 1, rates=None):
    """A baseline as a :class:`chunkjax.schedule.Schedule` with its :class:`Prediction`, accounted
    the way :func:`chunkjax.schedule.plan_schedule` accounts its own (pure; the schedule may
    exceed ``budget_bytes``: compare ``predicted.peak_device_bytes``).

    Args:
      kind: ``"all_host"`` (every chunk offloaded, fetched at every moment that reads it, released
        after it, host updates overlapping the backward in :func:`auto_segments` programs) or
        ``"zero_offload"`` (every chunk fetched at the step's start and held to its last read,
        gradients offloaded as they complete, the host update of every chunk after the backward).
      layout, traces, tide, cb: as for ``plan_schedule``.
      budget_bytes: recorded in the schedule.
      flops_per_step: training FLOPs of one step.
      prefetch: moments between issuing a fetch and its use (fetch buffers in flight count).
      rates: cost-model rates.
    """
    from chunkjax.cost import Rates, predict_pipelined_step
    from chunkjax.memory import PINNED_HOST
    from chunkjax.schedule import HOST_UPDATE, Prediction, Schedule, auto_segments

    rates = Rates() if rates is None else rates
    n, T, cs = layout.n_chunks, len(tide.moments), layout.chunk_size
    n_stages = len(traces)
    done = grad_done_at(traces, tide)
    moments = tuple((m.phase, m.stage) for m in tide.moments)
    loc = (HOST_UPDATE,) * n
    if kind == "all_host":
        fetch = tuple(tuple(sorted(set(m.chunks))) for m in tide.moments)
        evict = fetch  # released after every read: the next read is a fresh fetch
        per_moment = []
        for t, m in enumerate(tide.moments):
            inflight = sum(len(fetch[u]) for u in range(t + 1, min(T, t + 1 + prefetch)))
            per_moment.append(m.non_model_bytes + (len(fetch[t]) + inflight) * cb.params)
        n_fetch = sum(len(f) for f in fetch)
        fwd_fetch = sum(len(fetch[t]) for t in range(n_stages - 1)) * cb.params
        segments = auto_segments(T, n_stages)
        bounds = list(segments) + [T]
        bwd_moments = T - (n_stages - 1)
        host_ready = []
        for p0, p1 in zip(bounds[:-1], bounds[1:]):
            params = sum(cs for c in range(n) if p0 <= done.get(c, T - 1) < p1)
            if params:
                host_ready.append((min(1.0, max(0.0, (p1 - (n_stages - 1)) / bwd_moments)), params))
        time_ = predict_pipelined_step(flops_per_step, fwd_h2d=fwd_fetch, bwd_h2d=n_fetch * cb.params - fwd_fetch,
                                       bwd_d2h=n * cb.grad, streamed_bytes=0, device_params=0, streamed_params=0,
                                       host_ready=host_ready, rates=rates)
        pred = Prediction(int(max(per_moment)), 0, int(n * (cb.params + cb.state + cb.grad)),
                          int(n_fetch * cb.params), int(n * cb.grad), int(n_fetch * cb.params), int(n_fetch),
                          tuple(int(b) for b in per_moment), time_)
        return Schedule((PINNED_HOST,) * n, loc, fetch, evict, segments, prefetch, moments, pred, int(budget_bytes))
    if kind == "zero_offload":
        # every chunk's compute params go up at the start of the step (all fetches issued at the
        # first moment: prefetch = T) and stay until their last read; gradients go down as they
        # complete; the host update of all chunks waits for the end of the backward (one
        # program, no overlap): ZeRO-Offload's order, with the param upload of step k+1 (after
        # the update of step k) overlapping step k+1's forward
        params_b = n * cb.params
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for t, m in enumerate(tide.moments):
            for c in m.chunks:
                first.setdefault(c, t)
                last[c] = t
        fetch = tuple(tuple(sorted(c for c in first if first[c] == t)) for t in range(T))
        evict = tuple(tuple(sorted(c for c in last if last[c] == t)) for t in range(T))
        unread = n - len(first)  # chunks no moment reads are never fetched
        per_moment = [m.non_model_bytes + sum(cb.params for c in last if last[c] >= t) for t, m in enumerate(tide.moments)]
        n_fetch = n - unread
        time_ = predict_pipelined_step(flops_per_step, fwd_h2d=n_fetch * cb.params, bwd_h2d=0, bwd_d2h=n * cb.grad,
                                       streamed_bytes=0, device_params=0, streamed_params=0,
                                       host_ready=[(1.0, n * cs)], rates=rates)
        pred = Prediction(int(max(per_moment)), 0, int(n * (cb.params + cb.state + cb.grad)),
                          int(n_fetch * cb.params), int(n * cb.grad), int(n_fetch * cb.params), int(n_fetch),
                          tuple(int(b) for b in per_moment), time_)
        return Schedule((PINNED_HOST,) * n, loc, fetch, evict, (0,), max(T, 1), moments, pred, int(budget_bytes))
    raise ValueError(f"unknown baseline {kind!r}: use one of {BASELINES}")


def device_bytes_by_kind(s, inp: PlanInputs) -> dict[str, list[int]]:
    """Split a schedule's predicted device bytes per moment by kind (for plots).

    Returns lists (one entry per moment) keyed ``resident model data`` (model data placed on the
    device between steps), ``non-model (tide)``, ``gradients held`` (gradients of chunks whose
    compute params stay on the device, waiting for the update) and ``fetched chunk buffers``
    (the rest: fetched copies and fetches in flight).
    """
    from chunkjax.memory import DEVICE

    done = grad_done_at(inp.traces, inp.tide)
    kept = [c for c in range(s.n_chunks) if s.param_kinds[c] == DEVICE]
    model = s.predicted.device_model_bytes
    out = {"resident model data": [], "non-model (tide)": [], "gradients held": [], "fetched chunk buffers": []}
    for t, (m, total) in enumerate(zip(inp.tide.moments, s.predicted.device_bytes_per_moment)):
        held = sum(inp.cb.grad for c in kept if done.get(c, len(inp.tide.moments)) <= t)
        for k, v in zip(out, (model, m.non_model_bytes, held, total - model - m.non_model_bytes - held)):
            out[k].append(int(v))
    return out


def schedule_from_dict(d: dict):
    """The :class:`chunkjax.schedule.Schedule` of ``Schedule.to_dict()`` (e.g. one recorded in a
    results JSON)."""
    from chunkjax.cost import PipelinedStepTime
    from chunkjax.schedule import Prediction, Schedule

    p = dict(d["predicted"])
    t = {f.name: p["time"][f.name] for f in dataclasses.fields(PipelinedStepTime)}
    p["time"] = PipelinedStepTime(**t)
    p["device_bytes_per_moment"] = tuple(p["device_bytes_per_moment"])
    return Schedule(tuple(d["param_kinds"]), tuple(d["update_locations"]), tuple(tuple(f) for f in d["fetch"]),
                    tuple(tuple(e) for e in d["evict"]), tuple(d["segments"]), int(d["prefetch"]),
                    tuple(tuple(m) for m in d["moments"]), Prediction(**p), int(d["budget_bytes"]))


# ---- the report ------------------------------------------------------------------------------

def plan_zero(inp: PlanInputs, device_budget: int, host_budget: int | None = None, prefetch: int = 1,
              zero_stage: int = 3):
    """The ZeRO schedule of every rank (:func:`chunkjax.zero_schedule.plan_zero_schedule`) for
    ``inp`` (traced with ``n_ranks`` > 1), on abstract shapes (no mesh, no devices).

    Args:
      inp: from :func:`prepare` with ``n_ranks`` > 1.
      device_budget: each GPU's device budget (bytes).
      host_budget: the node's host memory for model data (bytes; None: unbounded); a rank may
        hold ``host_budget // n_ranks``.
      prefetch: moments between a fetch and its use.
      zero_stage: 1, 2 or 3.

    The host budget is checked against the rank's host bytes as ``plan_zero_schedule`` reports
    them (the rank's shards); ``plan_zero_schedule(host_budget_bytes=...)`` would pass it to
    ``plan_schedule``, which compares it with the per-rank *device* figure of a stage-3 chunk (the
    gathered chunk plus the shard), twice the host need at 8 ranks. So the device budget alone is
    planned first, and when the rank's host bytes exceed its share, every resident prefix (the
    first k chunks in first-use order, plan_schedule's candidates) is planned and the fastest
    that fits the host is kept (near-ties, within ``chunkjax.schedule.NEAR_TIE``, to the most
    resident, plan_schedule's rule).

    Raises:
      chunkjax.PlanError: no schedule fits a rank's device budget (the message names the smallest
        per-GPU budget) or the node's host budget (the message names the node budget needed).
    """
    from chunkjax.plan import PlanError, _gib_ceil
    from chunkjax.schedule import NEAR_TIE
    from chunkjax.zero_schedule import plan_zero_schedule

    n = inp.n_ranks

    def plan(resident=None):
        return plan_zero_schedule(inp.layout, inp.traces, inp.cb, device_budget, n, zero_stage,
                                  flops_per_step=inp.flops_per_step, host_update=True, prefetch=prefetch,
                                  rates=inp.rates, resident=resident)

    sched = plan()  # the device budget alone (raises with the smallest device budget)
    if host_budget is None or sched.predicted.host_model_bytes <= host_budget // n:
        return sched
    cands = []
    for k in range(inp.layout.n_chunks + 1):  # the first k chunks resident
        try:
            cands.append(plan(range(k)))
        except PlanError:
            continue
    fits = [c for c in cands if c.predicted.host_model_bytes <= host_budget // n]
    if not fits:
        need = min(c.predicted.host_model_bytes for c in cands)
        raise PlanError(_MSG_HOST_ZERO.format(host=host_budget, host_rank=host_budget // n, n=n, need_node=need * n,
                                              need=need, dev=device_budget, need_gib=_gib_ceil(need * n)),
                        device_budget, False)
    fastest = min(c.predicted.time.step_s for c in fits)
    return [c for c in fits if c.predicted.time.step_s <= fastest * (1 + NEAR_TIE)][-1]


def zero_comm_bytes(s, inp: PlanInputs, zero_stage: int = 3, itemsize: int = 2) -> dict[str, int]:
    """Bytes one rank sends per step by collective for the ZeRO schedule ``s``, accounted as
    :meth:`chunkjax.zero_schedule.ZeroScheduledStep.comm_bytes_per_step` does (without building
    the step: no mesh): ring algorithms, an all-gather or reduce-scatter of a C-byte chunk moves
    ``(N-1)/N * C`` per rank, an all-reduce twice that; scalar reductions left out. Stage 3
    gathers a chunk at every fetch and a device-resident chunk at every moment that reads it;
    stages 1/2 gather the new params of each device- or streamed-updated chunk once. Every chunk
    a stage reads has its gradient reduce-scattered (stages 2/3) or all-reduced (stage 1).

    Args:
      s: the schedule (:func:`plan_zero`).
      inp: its inputs (``n_ranks`` > 1).
      zero_stage: 1, 2 or 3.
      itemsize: bytes per compute-dtype element (bf16: 2).

    Returns:
      ``{"all_gather", "reduce_scatter", "all_reduce", "total"}`` (bytes per step per rank).
    """
    from chunkjax.memory import DEVICE
    from chunkjax.schedule import DEVICE_UPDATE, STREAMED_UPDATE

    n, cbytes = inp.n_ranks, inp.layout.chunk_size * itemsize
    part = lambda k: (k * (n - 1) * cbytes) // n  # noqa: E731
    if zero_stage == 3:
        gathers = sum(sum(1 for c in m.chunks if s.param_kinds[c] == DEVICE) + len(s.fetch[t])
                      for t, m in enumerate(inp.tide.moments))
    else:
        gathers = sum(u in (DEVICE_UPDATE, STREAMED_UPDATE) for u in s.update_locations)
    graded = len({c for t in inp.traces for c in t.chunks})
    out = {"all_gather": part(gathers), "reduce_scatter": part(graded) if zero_stage != 1 else 0,
           "all_reduce": 2 * part(graded) if zero_stage == 1 else 0}
    out["total"] = sum(out.values())
    return out


def plan_schedules(inp: PlanInputs, device_budget: int, host_budget: int | None = None, prefetch: int = 1,
                   zero_stage: int = 3):
    """(chunkjax schedule, {baseline name: schedule}) for one budget (bytes).

    With ``inp.n_ranks`` > 1 the schedule is :func:`plan_zero`'s (each rank's; ``device_budget``
    per GPU, ``host_budget`` the node's) and there are no baselines (``{}``).

    Raises:
      chunkjax.PlanError: no chunkjax schedule fits the budgets.
    """
    from chunkjax.plan import PlanError, _gib_ceil
    from chunkjax.schedule import plan_schedule

    if inp.n_ranks > 1:
        return plan_zero(inp, device_budget, host_budget, prefetch, zero_stage), {}

    def plan(host, resident=None):
        return plan_schedule(inp.layout, inp.traces, inp.cb, device_budget, flops_per_step=inp.flops_per_step,
                             host_update=True, prefetch=prefetch, rates=inp.rates, host_budget_bytes=host,
                             resident=resident)

    sched = plan(None)  # the device budget alone (raises with the smallest device budget)
    if host_budget is not None and sched.predicted.host_model_bytes > host_budget:
        try:
            sched = plan(host_budget)
        except PlanError:  # the device budget fits; the host budget does not: name the host budget needed
            least = None
            for k in range(inp.layout.n_chunks, -1, -1):  # most resident first: least on the host
                try:
                    least = plan(None, resident=range(k)).predicted.host_model_bytes
                    break
                except PlanError:
                    continue
            raise PlanError(_MSG_HOST.format(host=host_budget, need=least, dev=device_budget,
                                             need_gib=_gib_ceil(least)), device_budget, False) from None
    base = {k: fixed_schedule(k, inp.layout, inp.traces, inp.tide, inp.cb, device_budget,
                              flops_per_step=inp.flops_per_step, prefetch=prefetch, rates=inp.rates)
            for k in BASELINES}
    return sched, base


def figures(s, device_budget: int, host_budget: int | None, chunk_size: int) -> dict:
    """The report figures of one schedule (bytes, seconds)."""
    p = s.predicted
    t = p.time.to_dict()
    return {"feasible": p.peak_device_bytes <= device_budget
            and (host_budget is None or p.host_model_bytes <= host_budget),
            "predicted_peak_device_bytes": p.peak_device_bytes, "device_budget_bytes": device_budget,
            "device_model_bytes": p.device_model_bytes, "host_bytes": p.host_model_bytes,
            "h2d_bytes_per_step": p.h2d_bytes_per_step, "d2h_bytes_per_step": p.d2h_bytes_per_step,
            "n_fetches": p.n_fetches, "predicted_step_s": p.time.step_s, "time": t,
            "n_chunks": s.n_chunks, "chunk_size": chunk_size, "placement_counts": s.counts(),
            "segments": list(s.segments)}


def plan_report(model: str, device_budget: int, host_budget: int | None, batch: int, seq: int,
                prefetch: int = 1, chunk_size: int | None = None, min_chunks: int = 8,
                tide_from: str | None = None, inputs: PlanInputs | None = None, warn=None,
                n_ranks: int = 1, zero_stage: int = 3) -> dict:
    """Plan a step and its baselines; returns the JSON report (bytes, seconds).

    ``inputs`` (from :func:`prepare`) skips the tracing (budget sweeps).

    With ``n_ranks`` > 1 (ZeRO ``zero_stage`` over that many GPUs of one node): ``batch`` is the
    global batch (rows), ``device_budget`` each GPU's and ``host_budget`` the node's (bytes). The
    top-level figures are then one rank's (as in ``per_rank``), ``baselines`` is empty, and the
    report adds ``n_ranks``, ``zero_stage``, ``batch_per_rank``, ``per_rank`` (bytes, bytes per
    step, seconds), ``node`` (bytes, bytes per step, tokens/s), ``collective_bytes_per_step_per_rank``
    (bytes, accounted, not timed) and ``predicted_time_note`` (:data:`ZERO_TIME_NOTE`). With
    ``n_ranks`` == 1 the report is the single-device one (no ZeRO keys).

    Raises:
      ValueError: unknown model, bad ranks / stage / batch split; chunkjax.PlanError: the budget
        cannot hold the step.
    """
    check_ranks(batch, n_ranks, zero_stage)
    inp = inputs or prepare(model, batch, seq, chunk_size=chunk_size, min_chunks=min_chunks,
                            tide_from=tide_from, warn=warn, n_ranks=n_ranks)
    if inp.n_ranks != n_ranks:
        raise ValueError(f"inputs were traced for {inp.n_ranks} ranks, not {n_ranks}")
    sched, base = plan_schedules(inp, device_budget, host_budget, prefetch, zero_stage)
    cs = inp.layout.chunk_size
    # with ZeRO the figures are one rank's: its share of the node's host budget
    out = figures(sched, device_budget, host_budget if n_ranks == 1 or host_budget is None else host_budget // n_ranks,
                  cs)
    out["baselines"] = {k: figures(b, device_budget, host_budget, cs)
                        for k, b in base.items()}
    out.update({"model": inp.cfg.name, "n_params": inp.cfg.n_params, "batch": inp.batch, "seq": inp.seq,
                "host_budget_bytes": host_budget, "model_bytes": 14 * inp.cfg.n_params,
                "peak_non_model_bytes": inp.tide.peak_non_model_bytes, "n_moments": len(inp.tide.moments),
                "first_backward_moment": len(inp.traces), "tide_source": inp.tide_source,
                "rates_source": inp.rates_source, "rates": dataclasses.asdict(inp.rates),
                "stage_temp_bytes": {t.name: t.temp_bytes for t in inp.traces
                                     if t.name in ("embed", _BLOCK_REF, "head")},
                "schedule": sched.to_dict()})
    if n_ranks > 1:
        out.update(zero_figures(out, inp, sched, zero_stage))
    return out


def zero_figures(r: dict, inp: PlanInputs, sched, zero_stage: int) -> dict:
    """The ZeRO keys of a :func:`plan_report` ``r`` (whose figures are one rank's).

    Returns ``n_ranks``, ``zero_stage``, ``batch_per_rank`` (rows), ``per_rank`` (``peak_device_bytes``,
    ``device_model_bytes``, ``host_bytes`` (model data in host memory), ``h2d_bytes_per_step``,
    ``d2h_bytes_per_step``, ``n_fetches``, ``predicted_step_s`` (seconds, collectives excluded),
    ``tokens_per_s`` (the rank's rows x seq / step)), ``node`` (``n_ranks`` x the per-rank bytes:
    ``host_bytes``, ``h2d_bytes_per_step``, ``d2h_bytes_per_step``, ``device_budget_bytes``; and
    ``tokens_per_s`` = global batch x seq / predicted step), ``collective_bytes_per_step_per_rank``
    (:func:`zero_comm_bytes`) and ``predicted_time_note``.
    """
    n, step = inp.n_ranks, r["predicted_step_s"]
    per = {"peak_device_bytes": r["predicted_peak_device_bytes"], "device_budget_bytes": r["device_budget_bytes"],
           "device_model_bytes": r["device_model_bytes"], "host_bytes": r["host_bytes"],
           "host_budget_bytes": None if r["host_budget_bytes"] is None else r["host_budget_bytes"] // n,
           "h2d_bytes_per_step": r["h2d_bytes_per_step"], "d2h_bytes_per_step": r["d2h_bytes_per_step"],
           "n_fetches": r["n_fetches"], "predicted_step_s": step,
           "tokens_per_s": inp.rank_batch * inp.seq / step if step else None}
    node = {"n_ranks": n, "host_bytes": n * r["host_bytes"], "host_budget_bytes": r["host_budget_bytes"],
            "h2d_bytes_per_step": n * r["h2d_bytes_per_step"], "d2h_bytes_per_step": n * r["d2h_bytes_per_step"],
            "device_budget_bytes": n * r["device_budget_bytes"],
            "tokens_per_step": inp.batch * inp.seq,
            "tokens_per_s": inp.batch * inp.seq / step if step else None}
    return {"n_ranks": n, "zero_stage": zero_stage, "batch_per_rank": inp.rank_batch, "per_rank": per, "node": node,
            "collective_bytes_per_step_per_rank": zero_comm_bytes(sched, inp, zero_stage),
            "predicted_time_note": ZERO_TIME_NOTE}


def _time_unit(step_s: float) -> tuple[str, float]:
    return ("s", 1.0) if step_s >= 0.1 else ("ms", 1e3) if step_s >= 1e-4 else ("us", 1e6)


def _where(t: dict, k: float) -> str:
    other = ("streamed update", t["streamed_update_s"])
    return (f"forward {t['forward_s'] * k:.3f} + backward {t['backward_s'] * k:.3f} + exposed host update "
            f"{t['host_update_exposed_s'] * k:.3f} (of {t['host_update_s'] * k:.3f}) + device update "
            f"{t['device_update_s'] * k:.3f}" + (f" + {other[0]} {other[1] * k:.3f}" if other[1] else ""))


def _summary_zero(r: dict) -> str:
    """The readable form of a ZeRO :func:`plan_report` (``n_ranks`` > 1)."""
    big = r["device_budget_bytes"] >= 2**30
    bu, B, du, D = ("GiB", 2**30, "GB", 1e9) if big else ("MiB", 2**20, "MB", 1e6)
    tu, k = _time_unit(r["predicted_step_s"])
    n, pr, nd, cm = r["n_ranks"], r["per_rank"], r["node"], r["collective_bytes_per_step_per_rank"]
    hb = ("unbounded" if r["host_budget_bytes"] is None else
          f"{r['host_budget_bytes'] / B:.2f} {bu} per node ({pr['host_budget_bytes'] / B:.2f} {bu} per rank)")
    counts = "; ".join(f"{v} with params on {c.split('/')[0][len('params_'):]}, update on "
                       f"{c.split('/')[1][len('update_'):]}" for c, v in r["placement_counts"].items())
    fb = r["first_backward_moment"]
    return "\n".join([
        f"{r['model']}: N={r['n_params'] / 1e9:.3g}B, model data {r['model_bytes'] / B:.2f} {bu} (14 B/param), "
        f"{r['n_chunks']} chunks x {r['chunk_size']} elements, each split over {n} ranks",
        f"ZeRO-{r['zero_stage']} over {n} ranks (planned on abstract shapes, no devices used); global batch "
        f"{r['batch']}x{r['seq']} = {r['batch_per_rank']}x{r['seq']} per rank",
        f"device budget {r['device_budget_bytes'] / B:.2f} {bu} per GPU, host budget {hb}",
        f"tide (per rank): peak non-model {r['peak_non_model_bytes'] / B:.2f} {bu} over {r['n_moments']} moments, "
        f"{r['tide_source']}; rates {r['rates_source']}",
        "",
        f"per rank: feasible {r['feasible']}, peak device {pr['peak_device_bytes'] / B:.2f} {bu}, device model "
        f"{pr['device_model_bytes'] / B:.2f} {bu}, host {pr['host_bytes'] / B:.2f} {bu}, h2d "
        f"{pr['h2d_bytes_per_step'] / D:.2f} {du}, d2h {pr['d2h_bytes_per_step'] / D:.2f} {du} per step, "
        f"{pr['n_fetches']} fetches, predicted step {pr['predicted_step_s'] * k:.3f} {tu} (no collectives)",
        f"node ({n} ranks): host {nd['host_bytes'] / B:.2f} {bu}, h2d {nd['h2d_bytes_per_step'] / D:.2f} {du}, "
        f"d2h {nd['d2h_bytes_per_step'] / D:.2f} {du} per step, {nd['tokens_per_s']:,.0f} tokens/s predicted "
        f"(global batch x seq / step; no collectives)",
        f"collectives per rank per step (accounted, NOT timed): all-gather {cm['all_gather'] / D:.2f} {du}, "
        f"reduce-scatter {cm['reduce_scatter'] / D:.2f} {du}, all-reduce {cm['all_reduce'] / D:.2f} {du}",
        "",
        f"where the time goes, one rank ({tu}): {_where(r['time'], k)}",
        f"note: {r['predicted_time_note']}",
        "",
        f"chunks (each rank): {counts}",
        f"programs: {len(r['segments'])}, starting at moments {r['segments']} "
        f"(fused head at moment {fb - 1}, backward from {fb}); no baselines for --ranks > 1"])


def _summary(r: dict) -> str:
    """The readable form of a :func:`plan_report`."""
    if r.get("n_ranks", 1) > 1:
        return _summary_zero(r)
    big = r["device_budget_bytes"] >= 2**30
    bu, B, du, D = ("GiB", 2**30, "GB", 1e9) if big else ("MiB", 2**20, "MB", 1e6)
    tu, k = _time_unit(r["predicted_step_s"])
    hb = "unbounded" if r["host_budget_bytes"] is None else f"{r['host_budget_bytes'] / B:.2f} {bu}"
    lines = [f"{r['model']}: N={r['n_params'] / 1e9:.3g}B, model data {r['model_bytes'] / B:.2f} {bu} "
             f"(14 B/param), {r['n_chunks']} chunks x {r['chunk_size']} elements; batch {r['batch']}x{r['seq']}",
             f"device budget {r['device_budget_bytes'] / B:.2f} {bu}, host budget {hb}",
             f"tide: peak non-model {r['peak_non_model_bytes'] / B:.2f} {bu} over {r['n_moments']} moments, "
             f"{r['tide_source']}; rates {r['rates_source']}",
             "",
             f"{'plan':13s} {'feasible':>8s} {'peak ' + bu:>9s} {'dev model ' + bu:>13s} {'host ' + bu:>9s} "
             f"{'h2d ' + du:>8s} {'d2h ' + du:>8s} {'fetches':>7s} {'step ' + tu:>8s}"]
    rows = [("chunkjax", r)] + list(r["baselines"].items())
    for name, x in rows:
        lines.append(f"{name:13s} {str(x['feasible']):>8s} {x['predicted_peak_device_bytes'] / B:9.2f} "
                     f"{x['device_model_bytes'] / B:13.2f} {x['host_bytes'] / B:9.2f} "
                     f"{x['h2d_bytes_per_step'] / D:8.2f} {x['d2h_bytes_per_step'] / D:8.2f} "
                     f"{x['n_fetches']:7d} {x['predicted_step_s'] * k:8.3f}")
    lines += ["", f"where the time goes ({tu}):"]
    lines += [f"  {name:13s} {_where(x['time'], k)}" for name, x in rows]
    counts = "; ".join(f"{v} with params on {c.split('/')[0][len('params_'):]}, update on "
                       f"{c.split('/')[1][len('update_'):]}" for c, v in r["placement_counts"].items())
    fb = r["first_backward_moment"]
    lines += ["", f"chunkjax chunks: {counts}",
              f"chunkjax programs: {len(r['segments'])}, starting at moments {r['segments']} "
              f"(fused head at moment {fb - 1}, backward from {fb})"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a name of models/gpt.py's table (case-insensitive)")
    ap.add_argument("--device-budget", required=True, help="peak device bytes (per GPU with --ranks), e.g. 24GiB")
    ap.add_argument("--host-budget", default=None,
                    help="host memory for model data, bytes (the node's with --ranks; default: unbounded)")
    ap.add_argument("--batch", type=int, default=8, help="rows per step (the global batch with --ranks)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--prefetch", type=int, default=1, help="moments between a fetch and its use")
    ap.add_argument("--tide-from", default=None, metavar="RESULTS_JSON",
                    help="stage temporaries (and calibrated rates) recorded by a GPU run of experiments/bench.py")
    ap.add_argument("--ranks", type=int, default=1,
                    help="GPUs of one node the step is split over with ZeRO (default 1: one device, no ZeRO)")
    ap.add_argument("--zero-stage", type=int, default=None, help="ZeRO stage 1, 2 or 3 with --ranks > 1 (default 3)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        if a.zero_stage is not None and a.ranks == 1:
            raise ValueError(f"--zero-stage {a.zero_stage} needs --ranks N > 1 (one GPU has nothing to shard): "
                             "add --ranks or drop --zero-stage")
        a.zero_stage = 3 if a.zero_stage is None else a.zero_stage
        check_ranks(a.batch, a.ranks, a.zero_stage)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import chunkjax as cj
    try:
        budget = cj.parse_bytes(a.device_budget)
        host = cj.parse_bytes(a.host_budget) if a.host_budget else None
        t0 = time.time()
        r = plan_report(a.model, budget, host, a.batch, a.seq, a.prefetch, tide_from=a.tide_from,
                        warn=lambda m: print(f"note: {m}", file=sys.stderr), n_ranks=a.ranks,
                        zero_stage=a.zero_stage)
        r["plan_s"] = time.time() - t0
    except (cj.PlanError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        if a.json and isinstance(e, cj.PlanError):
            print(json.dumps({"feasible": False, "error": str(e), "min_device_budget_bytes": e.min_budget_bytes,
                              "activations_alone": e.activations_alone}))
        return 2
    if a.json:
        print(json.dumps(r, indent=1))
    else:
        print(_summary(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
