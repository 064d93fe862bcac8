"""Budget sweep of issue 3: the tide plan against the static baselines, measured in one process.

    python -m experiments.sweep --model GPT3_6B --batch 32 --seq 1024 \\
        --budgets 32GiB,64GiB,96GiB --rounds 2 --steps 4 --run-id s4_sweep

For each device budget, chunkjax's own plan (the one fit path, :mod:`chunkjax.fit`: checked and
re-planned against the compiled peak as in experiments/bench_chunkjax.py); and the same planner's
two static policies (``chunkjax.fit.plan(..., policy=, must_fit=False)``), run by the same runtime: ``all_host`` (every chunk fetched at
every read) and ``zero_offload`` (every chunk up at the step's start, host update after the
backward). A baseline's schedule does not depend on the budget, so it runs once and is marked
``feasible`` at each budget its compiled peak fits.

One process, one initialisation: the model is initialised with every chunk on the host (the
all_host state); each configuration uses those host chunks in place and copies the chunks its
plan keeps on the device (their optimizer moments start fresh: timing does not depend on them).
The device memory fraction is set for the largest budget; a smaller budget is enforced by the
planner and checked against the compiled peak of every program (``compiled_peak_bytes``), the
measured peak being the process's. Configurations run ``--rounds`` times in turn, ``--steps``
timed steps each time, so the spread (``step_s_std``) covers drift over the run; bytes moved each
way come from one profiled step (CUPTI memcpy events, experiments/gpu_measure.py).

Writes ``sweep_<run-id>.json`` under ``--results-dir``; ``--report JSON`` writes its table into
docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

KINDS = ("tide", "all_host", "zero_offload")


def _set_env(max_budget: int, host_limit_gb: int) -> None:
    """Memory fraction for the largest budget and the lifted pinned cap; before jax imports."""
    from experiments.bench import nvidia_smi_total_bytes, worker_env
    card = nvidia_smi_total_bytes()
    os.environ.update(worker_env(max_budget, card, host_limit_gb))


def _state_for(system, base):
    """The TrainState ``system``'s schedule runs on: ``base``'s host chunks in place; chunks the
    schedule updates on the device copied there (fresh optimizer state)."""
    import jax

    from chunkjax import optim
    from chunkjax.memory import DEVICE, sharding
    from chunkjax.step import TrainState

    dev = sharding(DEVICE)
    init_state = jax.jit(lambda m: optim.init_chunk_state(system.step_fn.tx, m), out_shardings=dev)
    ps, ms, os_ = list(base.params), list(base.master), list(base.opt_state)
    for c, u in enumerate(system.schedule.update_locations):
        if u == "host":
            continue
        if u != "device":
            raise ValueError(f"chunk {c}: update location {u!r} is not swept (host or device only)")
        ms[c] = jax.device_put(base.master[c], dev)
        os_[c] = init_state(ms[c])
        ps[c] = jax.device_put(base.params[c], sharding(system.schedule.param_kinds[c]))
    return TrainState(tuple(ps), tuple(ms), tuple(os_))


def _timed(system, state, batch, steps: int, host_s: list | None = None):
    import jax
    out, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, loss = system.step(state, batch)
        jax.block_until_ready((state, loss))
        out.append(time.perf_counter() - t0)
        losses.append(float(loss))
        if host_s is not None and system.last_update_s is not None:
            host_s.append(system.last_update_s)
    return state, out, losses


def run(args, save=lambda res: None, prior: dict | None = None, prior_commands=None, prior_budgets=None) -> dict:
    """Measure every configuration; returns the results dict (see module docstring). ``save`` is
    called with the partial results after every measured configuration; ``prior``: configurations
    of an earlier call with the same run id, kept unless measured again."""
    import jax

    from chunkjax import fit
    from experiments import gpu_measure as gm
    from experiments.bench import parse_bytes
    from experiments.measure import make_batch, profile_one_step
    from experiments.bench_chunkjax import ChunkjaxSystem
    from models import gpt

    cfg = gpt.get_config(args.model)
    budgets = [parse_bytes(b) for b in args.budgets.split(",")]
    on_gpu = jax.default_backend() == "gpu"
    t_start = time.time()
    sys_ = ChunkjaxSystem(cfg, max(budgets), args.batch, args.seq)
    batch = make_batch(cfg, args.batch, args.seq, args.seed, sys_.dev_sh)
    flops = cfg.flops_per_token(args.seq) * args.batch * args.seq

    def baseline(kind):
        # the one fit path's planner on the system's problem (static policies: reported even over the budget)
        return fit.plan(dataclasses.replace(sys_.problem, host_budget_bytes=None), max(budgets), policy=kind,
                        must_fit=False)

    def result(done=False):
        for name, rec in recs.items():
            ts = rec["step_s_all"]
            if ts and name in schedules:
                med = statistics.median(ts)
                hs = rec["host_update_s_all"]
                rec["host_update_s_median"] = statistics.median(hs) if hs else None
                rec.update(step_s_median=med, step_s_mean=statistics.fmean(ts),
                           step_s_std=statistics.stdev(ts) if len(ts) > 1 else 0.0,
                           tokens_per_s=args.batch * args.seq / med,
                           mfu=flops / med / (sys_.matmul_tflops * 1e12) if sys_.matmul_tflops else None,
                           losses_finite=all(x == x and abs(x) != float("inf") for x in rec["losses"]))
        d = jax.devices()[0]
        return {"run_id": args.run_id, "model": args.model, "n_params": cfg.n_params, "batch": args.batch,
                "seq": args.seq, "budgets_bytes": sorted(set(budgets) | set(prior_budgets or [])), "device_kind": d.device_kind,
                "jax_version": jax.__version__, "matmul_tflops": sys_.matmul_tflops, "rates": sys_.rates.__dict__,
                "n_chunks": sys_.layout.n_chunks, "chunk_size": sys_.layout.chunk_size, "init_s": init_s,
                "wall_s": time.time() - t_start, "peak_device_bytes_measured": gm.peak_device_bytes(),
                "rounds": args.rounds, "steps": args.steps, "complete": done,
                "commands": commands + [command], "configs": recs}

    init_s = None
    command = args.command
    commands = [c for c in (prior_commands or []) if c != command]
    plans = args.plans.split(",")
    configs = ([("tide", b) for b in budgets] if "tide" in plans else []) + [(k, None) for k in KINDS[1:] if k in plans]
    recs, schedules = dict(prior or {}), {}
    for kind, b in configs:  # plan and compile-check every configuration first
        name = f"tide@{b / 2**30:g}GiB" if kind == "tide" else kind
        if kind == "tide":
            sys_.use_budget(b)
        else:
            sys_.use_schedule(baseline(kind))
        mem = sys_.compiled_memory(batch)
        p = sys_.schedule.predicted
        schedules[name] = (sys_.schedule, sys_.budget if kind == "tide" else None)
        recs[name] = {
            "kind": kind, "device_budget_bytes": b, "compiled_peak_bytes": mem["peak_bytes"],
            "predicted_peak_device_bytes": p.peak_device_bytes, "h2d_bytes_per_step_predicted": p.h2d_bytes_per_step,
            "d2h_bytes_per_step_predicted": p.d2h_bytes_per_step, "step_s_predicted": p.time.step_s,
            "predicted_time": p.time.to_dict(), "schedule_counts": sys_.schedule.counts(),
            "segments": list(sys_.schedule.segments), "n_fetches": p.n_fetches,
            "plan_history": sys_.plan_history, "rounds": args.rounds, "steps": args.steps,
            "matmul_tflops": sys_.matmul_tflops, "host_update_s_per_param_calibrated": sys_.rates.host_update_s_per_param,
            "feasible_at": {str(x): bool(mem.get("fits", True) and mem["peak_bytes"] <= x) for x in budgets},
            "infeasible_reason": mem.get("why"),
            "step_s_all": [], "step_s_warmup": [], "host_update_s_all": [], "losses": []}
        print(f"[sweep] {time.time() - t_start:.0f} s {name}: compiled peak {mem['peak_bytes'] / 2**30:.2f} GiB, predicted "
              f"{p.time.step_s:.3f} s, h2d {p.h2d_bytes_per_step / 1e9:.2f} GB", flush=True)

    save(result())
    # one initialisation, every chunk on the host
    sys_.use_schedule(baseline("all_host"))
    t0 = time.perf_counter()
    base = sys_.init(jax.random.key(args.seed))
    init_s = time.perf_counter() - t0
    steps = {}  # one step object per configuration: its compiled programs are reused every round
    for r in range(args.rounds):
        for name, (sched, budget) in schedules.items():
            rec = recs[name]
            if not any(rec["feasible_at"].values()):
                continue
            if name in steps:
                sys_.schedule, sys_.step_fn = sched, steps[name]
            else:
                sys_.use_schedule(sched)
                steps[name] = sys_.step_fn
            state = _state_for(sys_, base)
            jax.block_until_ready(state)
            # an untimed warm-up step every round (round 0: compiles; later rounds: the first
            # step after another configuration's)
            state, warm, losses = _timed(sys_, state, batch, 1)
            rec["step_s_warmup"] += warm
            rec["losses"] += losses
            if r == 0:  # one profiled step for the bytes moved
                if on_gpu or args.profile_on_cpu:
                    state, prof = profile_one_step(sys_, state, batch)
                    rec["transfer_source"] = "profiler" if prof["n_device_events"] and not prof["profiler_error"] else None
                    rec["h2d_bytes_per_step_measured"] = prof["h2d_bytes"] if rec["transfer_source"] else None
                    rec["d2h_bytes_per_step_measured"] = prof["d2h_bytes"] if rec["transfer_source"] else None
                    rec["transfer_phases"] = prof.get("transfer_phases")
            state, ts, losses = _timed(sys_, state, batch, args.steps, rec["host_update_s_all"])
            rec["step_s_all"] += ts
            rec["losses"] += losses
            sys_.step_fn.wait(state)
            del state
            print(f"[sweep] {time.time() - t_start:.0f} s round {r} {name}: median {statistics.median(ts):.3f} s", flush=True)
            save(result())  # a run cut short keeps what it measured
    return result(done=True)


# ---- the report --------------------------------------------------------------------------------

def render_markdown(res: dict, results_file: str) -> str:
    """The docs section of a sweep: per budget, the tide plan and each baseline that fits."""
    rid = res["run_id"]
    gib, gb = 2**30, 1e9
    f = lambda v, s=1.0, d=2: "-" if v is None else f"{v / s:,.{d}f}"
    lines = [f"<!-- sweep:{rid}:start -->", f"## Budget sweep `{rid}` (issue 3)", "",
             f"{res['model']} (N = {res['n_params']:,}), batch {res['batch']} x {res['seq']}, {res['n_chunks']} chunks "
             f"of {res['chunk_size']:,} params; {res['device_kind']}, jax {res['jax_version']}; matmul probe "
             f"{f(res['matmul_tflops'], d=1)} TFLOP/s. {res['rounds']} rounds x {res['steps']} timed steps per "
             f"configuration, in turn; +-2 sd is over those steps. Results: `{results_file}`.", "",
             "| budget GiB | schedule | fits | compiled peak GiB | H2D GB/step measured (predicted) | "
             "D2H GB/step measured (predicted) | step s median +- 2 sd | predicted s | host update s measured "
             "(predicted) | tokens/s | MFU |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    cf = res["configs"]
    for b in res["budgets_bytes"]:
        tide = cf.get(f"tide@{b / gib:g}GiB")
        for name, r in [(f"tide@{b / gib:g}GiB", tide)] + [(k, cf[k]) for k in KINDS[1:] if k in cf]:
            if r is None:
                continue
            fits = r["feasible_at"].get(str(b))
            lines.append("| " + " | ".join([
                f"{b / gib:g}", "chunkjax (tide plan)" if r["kind"] == "tide" else r["kind"], "yes" if fits else "**no**",
                f(r["compiled_peak_bytes"], gib),
                f"{f(r.get('h2d_bytes_per_step_measured'), gb)} ({f(r['h2d_bytes_per_step_predicted'], gb)})",
                f"{f(r.get('d2h_bytes_per_step_measured'), gb)} ({f(r['d2h_bytes_per_step_predicted'], gb)})",
                f"{f(r.get('step_s_median'), d=3)} +- {f(2 * r['step_s_std'] if 'step_s_std' in r else None, d=3)}"
                if fits else "-",
                f(r["step_s_predicted"], d=3),
                f"{f(r.get('host_update_s_median'), d=3)} ({f(r['predicted_time']['host_update_s'], d=3)})",
                f(r.get("tokens_per_s") if fits else None, d=0),
                f(r.get("mfu") if fits else None, d=3)]) + " |")
    if res.get("notes"):
        lines += [""] + [f"- {n}" for n in res["notes"]]
    lines += ["", "Commands (one process each):", "", "```", *res["commands"], "```", f"<!-- sweep:{rid}:end -->"]
    return "\n".join(lines) + "\n"


def update_docs(results_file: str, docs_path: str = "docs/benchmarks.md") -> str:
    """Write (or replace) the sweep's section in ``docs_path``."""
    with open(results_file) as fh:
        res = json.load(fh)
    rel = os.path.relpath(os.path.abspath(results_file), os.path.dirname(os.path.dirname(os.path.abspath(docs_path))))
    section = render_markdown(res, rel)
    from experiments.report import replace_marked_section
    rid = res["run_id"]
    replace_marked_section(docs_path, f"<!-- sweep:{rid}:start -->", f"<!-- sweep:{rid}:end -->", section)
    return section


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="GPT3_6B")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--budgets", default="32GiB,64GiB,96GiB", help="comma-separated device budgets")
    ap.add_argument("--plans", default=",".join(KINDS),
                    help="schedules to run: tide (chunkjax's plan at each budget), all_host, zero_offload; a later "
                         "call with the same --run-id adds its configurations to the file (e.g. each baseline in "
                         "a process of its own)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per configuration per round")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-id", default="sweep")
    ap.add_argument("--results-dir", default="experiments/results")
    ap.add_argument("--host-limit-gb", type=int, default=110)
    ap.add_argument("--profile-on-cpu", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--report", metavar="JSON", help="only write JSON's table into docs/benchmarks.md")
    ap.add_argument("--docs", default="docs/benchmarks.md")
    args = ap.parse_args(argv)
    args.command = "python -m experiments.sweep " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.report:
        print(update_docs(args.report, args.docs))
        return 0
    from experiments.bench import UsageError, parse_bytes
    from models import gpt
    try:
        gpt.get_config(args.model)
    except ValueError as e:
        print(f"error: --model: {e}", file=sys.stderr)
        return 2
    try:
        budgets = [parse_bytes(b) for b in args.budgets.split(",")]
    except (UsageError, ValueError) as e:
        print(f"error: --budgets: {e}", file=sys.stderr)
        return 2
    bad = set(args.plans.split(",")) - set(KINDS)
    if bad or args.rounds < 1 or args.steps < 2:
        print(f"error: --plans takes {','.join(KINDS)}; --rounds >= 1; --steps >= 2", file=sys.stderr)
        return 2
    _set_env(max(budgets), args.host_limit_gb)
    os.makedirs(args.results_dir, exist_ok=True)
    path = os.path.join(args.results_dir, f"sweep_{args.run_id}.json")

    def save(res):
        tmp = path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(res, fh, indent=1)
        os.replace(tmp, path)

    prior = None
    if os.path.exists(path):
        with open(path) as fh:
            prior = json.load(fh)
        if (prior.get("model"), prior.get("batch"), prior.get("seq")) != (args.model, args.batch, args.seq):
            print(f"error: {path} holds {prior.get('model')} batch {prior.get('batch')} x {prior.get('seq')}: "
                  "use another --run-id", file=sys.stderr)
            return 2
    res = run(args, save, (prior or {}).get("configs"), (prior or {}).get("commands"), (prior or {}).get("budgets_bytes"))
    save(res)
    print(render_markdown(res, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
