"""The cost model's step time against the recorded GPU runs (issue 23 item 1: "the cost model predicts it and
the prediction is checked against the measurement").

    python -m experiments.prediction_check                 # every recorded chunkjax run: measured vs predicted
    python -m experiments.prediction_check --repredict     # + the GPT3_6B b16 schedules retimed on this CPU
    python -m experiments.prediction_check --repredict --json out.json

Part 1 reads ``experiments/results/bench_*.json`` (the ``chunkjax`` system of :mod:`experiments.bench`, and the
``largest`` records): the measured step (median) against the prediction the run planned with, the host thread's
measured kernel seconds (``update_s``) against the predicted ``host_update_s``, the host kernel's rate inside the
step (``update_s`` over the host-updated params) against the start-up calibration the plan used, and, where the
run recorded a profile (``extra.transfer_phases``, one profiled step: slower than the median), its forward and
backward programs' device seconds and the gaps between programs against the predicted ``forward_s`` /
``backward_s``.

Part 2 (``--repredict``) retimes each recorded GPT3_6B batch-16 schedule (:func:`chunkjax.program_cut.retime`,
the traces of this CPU: the timing reads only FLOPs, chunks and bytes, which match the GPU's) in the mode it ran
(cross-step as recorded; a clipped run whose clipping fired on every step, no chunk speculated, timed with
``norm_wait``; a clipped run that speculated, with the bound its step ran under: :func:`speculated_bound`) with:

- ``recorded``: its recorded rates (reproduces the recorded prediction where the mode is the planned one);
- ``in-step``: the host kernel at the rate the step's host thread measured (:meth:`chunkjax.cost.Rates.from_record`):
  what a perfect host rate gives;
- ``loaded p1`` / ``p2`` / ``p3``: the model of this session (:mod:`chunkjax.host_contention`): the step's host
  thread at the kernel's rate beside the device's compute and both PCIe directions. The recorded runs did not
  measure it; the values are the ones measured on three lent H200 machines
  (``experiments/results/host_rate_probe_s18.json``: p1, p2 over the step's layout, median of 4 passes, 0.2742
  and 0.3588 ns/param; p3 by the start-up measurement's own method, 0.3088), so the columns show what the
  start-up measurement would have given on each machine.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import pathlib
import sys

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
#: the kernel beside the device's matmuls and both PCIe directions, measured on three lent H200 machines
#: (experiments/results/host_rate_probe_s18.json): p1, p2 "all", median of 4 passes over the step's layout; p3 the
#: start-up measurement's method (one 1 GiB buffer set, median of 5 calls; its third repeat)
PROBE_LOADED_S_PER_PARAM = {"loaded p1": 0.2742e-9, "loaded p2": 0.3588e-9, "loaded p3": 0.3088e-9}


def _n_host(extra: dict) -> int:
    return sum(n for k, n in (extra.get("schedule_counts") or {}).items() if k.endswith("update_host"))


def program_seconds(extra: dict) -> dict | None:
    """From a run's profiled step (``extra.transfer_phases``): device seconds of its forward programs (every
    moment forward, or the forward and the fused head) and of the rest, and the seconds between programs (gaps:
    the device waiting for the host thread or the main thread), or None without a profile."""
    tp, sched = extra.get("transfer_phases"), extra.get("schedule") or {}
    if not tp or not sched.get("moments"):
        return None
    progs = [p for p in tp["phases"] if p["phase"].startswith("jit_chunkjax_program_")]
    segs = list(sched["segments"]) + [len(sched["moments"])]
    fwd_moments = sum(m[0] == "forward" for m in sched["moments"])
    fwd = bwd = gaps = 0.0
    prev_end = None
    for p in progs:
        k = int(p["phase"].rsplit("_", 1)[1])
        if k + 1 >= len(segs):
            continue
        start = p["start_us"] / 1e6
        if prev_end is not None:
            gaps += max(0.0, start - prev_end)
        prev_end = start + p["duration_s"]
        if segs[k] < fwd_moments:  # a program with forward moments (the last one may hold the fused head)
            fwd += p["duration_s"]
        else:
            bwd += p["duration_s"]
    if prev_end is None:
        return None
    return {"forward_s": fwd, "backward_s": bwd, "gaps_s": gaps, "profiled_step_s": tp["step"]["duration_s"]}


def recorded_rows(results=RESULTS) -> list[dict]:
    """One row per recorded chunkjax run with a measured and a predicted step (part 1)."""
    rows = []
    for f in sorted(glob.glob(str(pathlib.Path(results) / "bench_*.json"))):
        d = json.loads(pathlib.Path(f).read_text())
        run = pathlib.Path(f).stem
        s = (d.get("systems") or {}).get("chunkjax")
        if isinstance(s, dict) and (s.get("extra") or {}).get("step_s_predicted") and s.get("step_s_median"):
            e = s["extra"]
            t = e.get("predicted_time") or {}
            n_host = _n_host(e) * int(e.get("chunk_size") or 0)
            cal = (e.get("rates") or {}).get("host_update_s_per_param")
            sp = e.get("speculation") or {}
            rows.append({
                "run": run, "model": d.get("model"), "batch": d.get("batch"),
                "micro_batches": e.get("micro_batches") or 1, "clip": e.get("max_grad_norm"),
                "clip_fired": bool(e.get("max_grad_norm")) and sp.get("speculated_chunks") == 0,
                "clip_expect": e.get("clip_expect"), "cross_step": bool(e.get("cross_step")),
                "step_s": s["step_s_median"], "predicted_s": e["step_s_predicted"],
                "update_s": s.get("update_s"), "host_update_s": t.get("host_update_s"),
                "host_update_exposed_s": t.get("host_update_exposed_s"), "window_stall_s": t.get("window_stall_s"),
                "forward_s": t.get("forward_s"), "backward_s": t.get("backward_s"),
                "in_step_ns": s["update_s"] / n_host * 1e9 if s.get("update_s") and n_host else None,
                "calibrated_ns": cal * 1e9 if cal else None, "profile": program_seconds(e)})
        big = (d.get("largest") or {}).get("chunkjax") or {}
        for name, x in (big.get("tried") or {}).items():
            if isinstance(x, dict) and x.get("step_s_median") and x.get("step_s_predicted"):
                st = x.get("storage") or {}
                rows.append({"run": run, "model": name, "batch": big.get("batch"),
                             "micro_batches": x.get("micro_batches") or 1, "clip": None, "clip_fired": False,
                             "cross_step": None, "step_s": x["step_s_median"], "predicted_s": x["step_s_predicted"],
                             "update_s": None, "host_update_s": None,
                             "storage_update_s": st.get("storage_update_s_measured"),
                             "storage_update_s_predicted": st.get("storage_update_s_predicted"),
                             "disk_gb_per_s": st.get("disk_gb_per_s_measured")})
    return rows


def _f(x, d=3):
    return "-" if x is None else f"{x:.{d}f}"


def table(rows) -> str:
    """Part 1 as a markdown table."""
    out = ["| run | model b (mb) | mode | step s measured | predicted | measured / predicted | host update s measured "
           "(predicted) | host ns/param in step (calibrated) | profiled fwd / bwd / gaps s (predicted fwd / bwd) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mode = ("cross-step" if r["cross_step"] else "joined" if r["cross_step"] is not None else "largest")
        if r["clip"]:
            mode += ", clip " + ("fired" if r["clip_fired"] else "speculated") + (f" (planned {r['clip_expect']})"
                                                                                  if r.get("clip_expect") else "")
        p = r.get("profile")
        prof = "-" if not p else (f"{p['forward_s']:.3f} / {p['backward_s']:.3f} / {p['gaps_s']:.3f} "
                                  f"({_f(r['forward_s'])} / {_f(r['backward_s'])})")
        host = (f"{_f(r['update_s'])} ({_f(r['host_update_s'])})" if r.get("update_s") is not None
                else (f"disk {_f(min(r['storage_update_s']), 1)}-{_f(max(r['storage_update_s']), 1)} "
                      f"({_f(r['storage_update_s_predicted'], 1)})" if r.get("storage_update_s") else "-"))
        ns = (f"{_f(r['in_step_ns'])} ({_f(r['calibrated_ns'])})" if r.get("in_step_ns") else "-")
        out.append(f"| {r['run']} | {r['model']} b{r['batch']} ({r['micro_batches']}) | {mode} | {_f(r['step_s'])} | "
                   f"{_f(r['predicted_s'])} | {r['step_s'] / r['predicted_s']:.3f} | {host} | {ns} | {prof} |")
    return "\n".join(out)


def _problem(model, batch, seq, micro_batches, unroll):
    """The bench's problem on this CPU's traces (as experiments/gpu_checks/largest_plan.py), in-program groups'
    traces with micro-batches (chunkjax.plan_micro.grouped_problem)."""
    import jax
    import jax.numpy as jnp

    from chunkjax import fit
    from chunkjax.host_update import AdamW
    from chunkjax.plan_micro import grouped_problem
    from models import gpt
    cfg = gpt.get_config(model)
    p = fit.prepare(gpt.gpt_stages(cfg), gpt.abstract_params(cfg), jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32),
                    host_optimizer=AdamW(1e-4, weight_decay=1e-4), compute_dtype=jnp.bfloat16,
                    micro_batches=micro_batches, flops_per_step=float(cfg.flops_per_token(seq) * batch * seq),
                    check_host=False, unroll_micro_batches=bool(unroll))
    return grouped_problem(p, micro_batches) if micro_batches > 1 else p


def speculated_bound(extra: dict, cb, chunk_size: int) -> dict:
    """The speculation bound a recorded run's step ran under (the cost model's ``speculation_params``
    and ``backup_bytes_per_param``, :func:`chunkjax.clip_plan.speculation_bound`), {} when it did not
    speculate: the record's ``speculation_bound`` where written, else (older records) the chunks its
    backup pool held (``speculation.pool_bytes``, 12 bytes an AdamW parameter) or its kept gradients'
    peak (rollback by inversion)."""
    sp, b = extra.get("speculation") or {}, extra.get("speculation_bound") or {}
    if not (extra.get("max_grad_norm") and sp.get("speculated_chunks")):
        return {}
    if b.get("params") is not None:
        return {"speculation_params": int(b["params"]), "backup_bytes_per_param": float(b["backup_bytes_per_param"])}
    if sp.get("inverted_chunks"):
        return {"speculation_params": int(sp.get("kept_grad_bytes_peak", 0)) // cb.grad * chunk_size,
                "backup_bytes_per_param": 0.0}
    return {"speculation_params": int(sp.get("pool_bytes", 0)) // (12 * chunk_size) * chunk_size,
            "backup_bytes_per_param": 12.0}


def repredict(results=RESULTS, runs=None) -> list[dict]:
    """Part 2: each recorded GPT3_6B batch-16 schedule retimed (module docstring), seconds per step."""
    from chunkjax.cost import Rates
    from chunkjax.program_cut import retime
    from chunkjax.schedule import Schedule
    from chunkjax.tide import memory_tide
    problems, out = {}, []
    for f in sorted(glob.glob(str(pathlib.Path(results) / "bench_*6b16*.json"))):
        run = pathlib.Path(f).stem
        if runs and run not in runs:
            continue
        d = json.loads(pathlib.Path(f).read_text())
        s = (d.get("systems") or {}).get("chunkjax") or {}
        e = s.get("extra") or {}
        if not (e.get("schedule") and e.get("rates") and s.get("step_s_median") and d.get("model") == "GPT3_6B"):
            continue
        sch = Schedule.from_dict(e["schedule"])
        mb = int(e.get("micro_batches") or 1)
        key = (d["batch"], d["seq"], mb, bool(sch.unroll_micro_batches))
        if key not in problems:
            p = _problem("GPT3_6B", d["batch"], d["seq"], mb, sch.unroll_micro_batches)
            problems[key] = (p, memory_tide(p.traces, p.layout.chunk_size))
        p, tide = problems[key]
        if p.layout.chunk_size != e.get("chunk_size") or len(p.traces) != len(set(m[1] for m in sch.moments)):
            print(f"{run}: this CPU's layout differs from the run's: skipped", file=sys.stderr)
            continue
        sp = e.get("speculation") or {}
        fired = bool(e.get("max_grad_norm")) and sp.get("speculated_chunks") == 0
        planned_nw = e.get("clip_expect") == "fires"
        kw = dict(chunk_size=p.layout.chunk_size, traces=p.traces, tide=tide, flops_per_step=p.flops_per_step,
                  micro_batches=p.micro_batches, cross_step=bool(e.get("cross_step")))
        rec = Rates(**{k: float(v) for k, v in e["rates"].items() if k in {x.name for x in dataclasses.fields(Rates)}})
        row = {"run": run, "step_s": s["step_s_median"], "recorded_s": e["step_s_predicted"], "clip_fired": fired,
               "planned": retime(sch, p.cb, rates=rec, norm_wait=planned_nw, **kw).time.step_s}
        cases = {"recorded": rec, "in-step": Rates.from_record(d)}
        cases.update({k: dataclasses.replace(rec, host_update_loaded_s_per_param=v)
                      for k, v in PROBE_LOADED_S_PER_PARAM.items()})
        bound = {} if fired or planned_nw else speculated_bound(e, p.cb, p.layout.chunk_size)
        row["speculation_params"] = bound.get("speculation_params")
        for name, rates in cases.items():  # the in-step rate holds the backups' copies already
            b = dict(bound, backup_bytes_per_param=0.0) if bound and name == "in-step" else bound
            t = retime(sch, p.cb, rates=rates, norm_wait=fired or planned_nw, **kw, **b).time
            row[name] = {"step_s": t.step_s, "host_update_s": t.host_update_s,
                         "host_update_exposed_s": t.host_update_exposed_s, "window_stall_s": t.window_stall_s}
        out.append(row)
    return out


def repredict_table(rows) -> str:
    names = ["recorded", "in-step", *PROBE_LOADED_S_PER_PARAM]
    out = ["| run | step s measured | predicted as planned (recorded) | " + " | ".join(
        f"{n}: step s (host s), measured / predicted" for n in names) + " |", "|---" * (3 + len(names)) + "|"]
    for r in rows:
        cells = [f"{r[n]['step_s']:.3f} ({r[n]['host_update_s']:.3f}), {r['step_s'] / r[n]['step_s']:.3f}"
                 for n in names]
        run = r["run"] + (" (clipping fired: timed with norm_wait)" if r["clip_fired"] else "") + (
            f" (speculation bounded to {r['speculation_params']:,} params)" if r.get("speculation_params") is not None
            else "")
        out.append(f"| {run} | {r['step_s']:.3f} | {r['planned']:.3f} ({r['recorded_s']:.3f}) | "
                   + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repredict", action="store_true", help="retime the GPT3_6B b16 schedules on this CPU")
    ap.add_argument("--runs", default="", help="comma-separated run names (file stems) for --repredict")
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--json", default="", help="write the rows here")
    a = ap.parse_args(argv)
    if not os.path.isdir(a.results):
        print(f"no results directory {a.results}: pass --results DIR", file=sys.stderr)
        return 2
    rows = recorded_rows(a.results)
    print(table(rows))
    out = {"recorded": rows}
    if a.repredict:
        rp = repredict(a.results, set(x for x in a.runs.split(",") if x) or None)
        print()
        print(repredict_table(rp))
        out["repredicted"] = rp
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
