"""Planner CLI: the schedule chunkjax would run for a model, batch and budget, next to the static
partitions users know, all planned by the same engine on abstract shapes (runs on a CPU).

    python -m experiments.plan --model GPT3_10B --device-budget 24GiB --host-budget 120GiB \\
        --batch 8 --seq 1024 [--json] [--tide-from RESULTS_JSON]

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
      batch, seq: batch shape (tokens per step = batch * seq).
      layout: chunk layout (chunk ids in first-use order).
      traces: per-stage traces (temporaries from the backend, or from a recorded GPU run).
      tide: the memory tide over ``traces``.
      cb: bytes of one chunk per chunk list (AdamW state).
      flops_per_step: training FLOPs of one step.
      rates: cost-model rates.
      tide_source: where the non-model bytes come from ("estimated on cpu", "recorded on gpu ...").
      rates_source: where the rates come from.
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
    program). Returns (``{stage name: bytes}`` or None, a one-line reason when None).
    """
    from models import gpt

    rec, s = _recorded(path)
    temps = (s.get("extra") or {}).get("stage_temp_bytes")
    if not temps:
        return None, f"{path} records no stage_temp_bytes (a chunkjax run of experiments/bench.py does)"
    r_model = s.get("model", rec.get("model"))
    r_batch, r_seq = s.get("batch", rec.get("batch")), s.get("seq", rec.get("seq"))
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
                 min_chunks: int = 8) -> PlanInputs:
    """Trace a model's stages for a batch shape on this backend (abstract shapes only) and build
    its tide, with the default rates.

    Args:
      model: a name of models/gpt.py's table (case-insensitive).
      batch, seq: batch shape.
      chunk_size: elements per chunk (None: chunkjax's search, as experiments/bench.py uses).
      min_chunks: passed to the chunk-size search.

    Raises:
      ValueError: unknown model, or ``seq`` beyond the model's positions.
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
    stages = gpt.gpt_stages(cfg)
    ap = gpt.abstract_params(cfg)
    ab = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
    order = cj.first_use_order(lambda p, b: cj.compose_loss(stages, p, b), ap, ab)
    layout = cj.build_layout(ap, chunk_size, order, min_chunks=min_chunks)
    traces = cj.trace_stages(stages, layout, ab, jnp.bfloat16)
    backend = jax.default_backend()
    spec = AdamW(1e-4, weight_decay=1e-4)  # what experiments/bench.py's chunkjax system runs
    cb = cj.chunk_bytes(layout, jnp.bfloat16, state_bytes_per_chunk(spec.optax(), layout.chunk_size))
    return PlanInputs(cfg, batch, seq, layout, traces, memory_tide(traces, layout.chunk_size), cb,
                      float(cfg.flops_per_token(seq) * batch * seq), Rates(),
                      f"estimated on {backend}" if backend != "gpu" else "traced on gpu",
                      "chunkjax.cost.Rates() defaults (H200)")


def with_recorded(inp: PlanInputs, path, warn=None) -> PlanInputs:
    """``inp`` with the stage temporaries a GPU run recorded in the results JSON ``path`` (when its
    model, batch and seq match; otherwise ``warn`` is called with the reason and the traced tide
    stays) and the rates that run calibrated (when recorded: they describe the machine)."""
    from chunkjax.tide import memory_tide

    temps, why = recorded_stage_temps(path, inp.cfg.name, inp.batch, inp.seq, [t.name for t in inp.traces])
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
            tide_from: str | None = None, warn=None) -> PlanInputs:
    """:func:`trace_inputs`, then :func:`with_recorded` when ``tide_from`` (a results JSON of a GPU
    run of experiments/bench.py) is given."""
    inp = trace_inputs(model, batch, seq, chunk_size=chunk_size, min_chunks=min_chunks)
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

def plan_schedules(inp: PlanInputs, device_budget: int, host_budget: int | None = None, prefetch: int = 1):
    """(chunkjax schedule, {baseline name: schedule}) for one budget.

    Raises:
      chunkjax.PlanError: no chunkjax schedule fits the budgets.
    """
    from chunkjax.plan import PlanError, _gib_ceil
    from chunkjax.schedule import plan_schedule

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
                tide_from: str | None = None, inputs: PlanInputs | None = None, warn=None) -> dict:
    """Plan a step and its baselines; returns the JSON report (bytes, seconds).

    ``inputs`` (from :func:`prepare`) skips the tracing (budget sweeps).

    Raises:
      ValueError: unknown model; chunkjax.PlanError: the budget cannot hold the step.
    """
    inp = inputs or prepare(model, batch, seq, chunk_size=chunk_size, min_chunks=min_chunks,
                            tide_from=tide_from, warn=warn)
    sched, base = plan_schedules(inp, device_budget, host_budget, prefetch)
    cs = inp.layout.chunk_size
    out = figures(sched, device_budget, host_budget, cs)
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
    return out


def _time_unit(step_s: float) -> tuple[str, float]:
    return ("s", 1.0) if step_s >= 0.1 else ("ms", 1e3) if step_s >= 1e-4 else ("us", 1e6)


def _where(t: dict, k: float) -> str:
    other = ("streamed update", t["streamed_update_s"])
    return (f"forward {t['forward_s'] * k:.3f} + backward {t['backward_s'] * k:.3f} + exposed host update "
            f"{t['host_update_exposed_s'] * k:.3f} (of {t['host_update_s'] * k:.3f}) + device update "
            f"{t['device_update_s'] * k:.3f}" + (f" + {other[0]} {other[1] * k:.3f}" if other[1] else ""))


def _summary(r: dict) -> str:
    """The readable form of a :func:`plan_report`."""
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
    ap.add_argument("--device-budget", required=True, help="peak device bytes, e.g. 24GiB")
    ap.add_argument("--host-budget", default=None, help="host memory for model data (default: unbounded)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--prefetch", type=int, default=1, help="moments between a fetch and its use")
    ap.add_argument("--tide-from", default=None, metavar="RESULTS_JSON",
                    help="stage temporaries (and calibrated rates) recorded by a GPU run of experiments/bench.py")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    import chunkjax as cj
    try:
        budget = cj.parse_bytes(a.device_budget)
        host = cj.parse_bytes(a.host_budget) if a.host_budget else None
        t0 = time.time()
        r = plan_report(a.model, budget, host, a.batch, a.seq, a.prefetch, tide_from=a.tide_from,
                        warn=lambda m: print(f"note: {m}", file=sys.stderr))
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
