"""Planner CLI for kept activations (chunkjax.plan_remat): the predicted step of every remat mode
for a models/gpt.py config, batch and budget, on abstract shapes (runs on a CPU).

    python -m experiments.plan_remat --model GPT3_6B --batch 32 --seq 1024 --device-budget 24GiB \\
        --host-budget 114GiB --tide-from experiments/results/bench_s14c_6b32.json [--json OUT.json]

The problem is experiments/plan.py's (the one fit path's :func:`chunkjax.fit.prepare`, host AdamW,
``--tide-from`` a GPU run's stage temporaries and calibrated rates; ``--platform gpu``, the default: the host budget holds
the GPU's pinned pool, :func:`chunkjax.host_memory.pinned_pool_bytes`) with the blocks' kept names
``models.gpt.REMAT_NAMES``. For each mode (``full``, ``save`` and ``offload`` on every block,
``auto``: the planner's choice) one row: the blocks per option, predicted step (s), forward and
backward (s), activation bytes offloaded each way, recompute removed (s), predicted peak (GiB),
model TFLOP/s (6N per token over the predicted step); then every option set ``auto`` planned.
The block's figures (kept bytes, recompute FLOPs with full recompute and removed) come first.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time


def run(model: str, batch: int, seq: int, device_budget: int, host_budget: int | None, tide_from: str | None,
        warn=None, platform: str = "gpu") -> dict:
    """The rows of every remat mode and of ``auto``'s option sets (see the module docstring);
    ``platform``: whose host accounting the host budget holds (``"gpu"``: the runtime's pinned pool,
    :func:`chunkjax.host_memory.pinned_pool_bytes`; planning on the CPU used to count bare bytes)."""
    from chunkjax import fit
    from chunkjax.fit_host import host_need
    from chunkjax.plan_remat import REMAT_MODES, label, remat_plan
    from experiments.plan import plan_problem, prepare
    from models import gpt

    t0 = time.perf_counter()
    inp = prepare(model, batch, seq, tide_from=tide_from, warn=warn)
    problem = dataclasses.replace(plan_problem(inp, host_budget), remat_names=gpt.REMAT_NAMES, platform=platform)
    trace_s = time.perf_counter() - t0
    figs = problem.remat_figures
    block = next(f for f in figs if f.saved_bytes)
    model_flops = 6 * inp.cfg.n_params * batch * seq
    out = {"model": inp.cfg.name, "batch": batch, "seq": seq, "device_budget_bytes": device_budget,
           "host_budget_bytes": host_budget, "platform": platform, "tide_source": inp.tide_source, "rates_source": inp.rates_source,
           "names": list(gpt.REMAT_NAMES), "trace_s": trace_s,
           "block": {"kept_bytes": block.saved_bytes, "recompute_flops": block.recompute_flops,
                     "saved_flops": block.saved_flops, "blocks": sum(1 for f in figs if f.saved_bytes)},
           "modes": {}}
    for mode in REMAT_MODES:
        t1 = time.perf_counter()
        try:
            s = fit.plan(dataclasses.replace(problem, remat=mode), device_budget)
        except Exception as e:
            out["modes"][mode] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
            continue
        t = s.predicted.time
        out["modes"][mode] = {"remat": label(s.remat), "step_s": t.step_s, "forward_s": t.forward_s,
                              "backward_s": t.backward_s, "activation_bytes": t.activation_bytes,
                              "recompute_saved_s": t.recompute_saved_s,
                              "peak_device_bytes": s.predicted.peak_device_bytes,
                              "model_tflops": model_flops / t.step_s / 1e12, "plan_s": time.perf_counter() - t1,
                              "counts": s.counts(), "host": host_need(problem, s)}
    _, rows = remat_plan(dataclasses.replace(problem, remat="auto"),  # each option set on the one fit path
                         lambda tr: fit.plan(dataclasses.replace(problem, traces=tr, remat="full"), device_budget))
    out["auto_rows"] = [dict(r, model_tflops=model_flops / r["step_s"] / 1e12) if "step_s" in r else r for r in rows]
    return out


def _host(h: dict) -> str:
    gb = lambda b: f"{b / 1e9:.1f}"  # noqa: E731
    return (f"{gb(h['pinned_host_bytes'])} ({gb(h['pinned_pool_bytes'])}) + {gb(h['pageable_bytes'])}, "
            f"{gb(h['need_bytes'])}")


def table(out: dict) -> str:
    b = out["block"]
    lines = [f"{out['model']} batch {out['batch']} x {out['seq']}, device budget "
             f"{out['device_budget_bytes'] / 2**30:.2f} GiB; tide {out['tide_source']}; rates {out['rates_source']}",
             f"block keeps {b['kept_bytes'] / 1e9:.3f} GB ({', '.join(out['names'])}); its backward: "
             f"{b['recompute_flops'] / 1e12:.3f} TFLOP with full recompute, {b['saved_flops'] / 1e12:.3f} TFLOP "
             f"removed; {b['blocks']} blocks",
             "| mode | blocks | step s | fwd s | bwd s | act GB each way | recompute removed s | peak GiB "
             "| model TFLOP/s | host GB: pinned (pool) + pageable, need |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for mode, r in out["modes"].items():
        if "error" in r:
            lines.append(f"| {mode} | {r['error']} |")
            continue
        lines.append(f"| {mode} | {r['remat']} | {r['step_s']:.3f} | {r['forward_s']:.3f} | {r['backward_s']:.3f} | "
                     f"{r['activation_bytes'] / 1e9:.1f} | {r['recompute_saved_s']:.3f} | "
                     f"{r['peak_device_bytes'] / 2**30:.2f} | {r['model_tflops']:.0f} | {_host(r['host'])} |")
    lines.append("auto's option sets: " + "; ".join(
        f"{r['remat']}: {r['step_s']:.3f} s" if "step_s" in r else f"{r['remat']}: {r['error'][:60]}"
        for r in out["auto_rows"]))
    return "\n".join(lines)


def main(argv=None) -> int:
    from chunkjax.plan import parse_bytes
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a models/gpt.py config")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--device-budget", required=True, help="bytes, e.g. 24GiB")
    ap.add_argument("--host-budget", default=None, help="bytes for model data on the host (default: unbounded)")
    ap.add_argument("--tide-from", default=None, metavar="RESULTS_JSON", help="a GPU run's stage temporaries and rates")
    ap.add_argument("--platform", default="gpu", choices=("gpu", "cpu"),
                    help="whose host accounting the host budget holds (default gpu: the runtime's pinned pool)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON here")
    a = ap.parse_args(argv)
    try:
        out = run(a.model, a.batch, a.seq, parse_bytes(a.device_budget),
                  parse_bytes(a.host_budget) if a.host_budget else None, a.tide_from,
                  warn=lambda m: print(f"warning: {m}", file=sys.stderr), platform=a.platform)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
