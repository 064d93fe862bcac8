"""The CPU planner's view of GPT3_6B, batch 16 x 1024, with 1 and 4 micro-batches (issue 23).

    python -m experiments.plan_micro_6b [--out experiments/results/plan_micro_6b_cpu.json]

Plans, on abstract shapes (nothing compiled: the stage temporaries are the ones the H200 runs
recorded), what ``experiments.bench`` planned in session 16's call ``s16x``
(``experiments/results/bench_s16x_6b16{,_mb4}.json``): the fit path (:func:`chunkjax.fit.prepare`,
:func:`chunkjax.fit.plan`) at each run's effective device budget and host budget, with cross-step
overlap; 4 micro-batches with the in-program loops as while loops and unrolled
(``unroll_micro_batches``), at the single batch's calibrated rates (one machine, one host kernel
rate) and at the 4-micro-batch run's own. Each row gives the predicted step and its parts, the
programs (forward ones apart), the placement, and the step the GPU measured. Prints one line per
plan and writes the rows as JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
RUNS = (("6b16", 1), ("6b16_mb4", 4))


def _record(tag: str) -> dict:
    return json.loads((RESULTS / f"bench_s16x_{tag}.json").read_text())["systems"]["chunkjax"]


def _rates(rec: dict):
    from chunkjax.cost import Rates
    fields = {f.name for f in dataclasses.fields(Rates)}
    return Rates(**{k: float(v) for k, v in rec["extra"]["rates"].items() if k in fields})


def plan_rows() -> dict:
    """``{"<run>/<rates>[/unrolled]": row}`` (see the module docstring)."""
    import jax
    import jax.numpy as jnp

    from chunkjax import fit
    from chunkjax import trace as trace_mod
    from chunkjax.host_update import AdamW
    from models import gpt

    cfg, out = gpt.get_config("GPT3_6B"), {}
    base_rates = _rates(_record("6b16"))
    real_temp = trace_mod._temp_bytes
    trace_mod._temp_bytes = lambda lowered: 0  # the GPU's recorded figures replace every stage's below
    try:
        for tag, m in RUNS:
            rec = _record(tag)
            e = rec["extra"]
            p = fit.prepare(gpt.gpt_stages(cfg), gpt.abstract_params(cfg), jax.ShapeDtypeStruct((16, 1025), jnp.int32),
                            host_optimizer=AdamW(1e-4, weight_decay=1e-4), compute_dtype=jnp.bfloat16,
                            micro_batches=m, flops_per_step=float(cfg.flops_per_token(1024) * 16 * 1024),
                            host_budget=e["host_budget_bytes"], check_host=False)
            temps = e["stage_temp_bytes"]  # embed, h_0 (every block), head
            p = dataclasses.replace(p, traces=tuple(dataclasses.replace(t, temp_bytes=temps.get(t.name, temps["h_0"]))
                                                    for t in p.traces))
            for rname, rates in (("rates_6b16", base_rates), ("own_rates", _rates(rec)))[:1 if m == 1 else 2]:
                for unroll in (False, True)[:1 if m == 1 else 2]:
                    t0 = time.perf_counter()
                    s = fit.plan(dataclasses.replace(p, rates=rates, unroll_micro_batches=unroll),
                                 e["effective_budget_bytes"])
                    n_stages = (len(s.moments) + 1) // 2
                    out[f"{tag}/{rname}" + ("/unrolled" if unroll else "")] = {
                        "device_budget_bytes": e["effective_budget_bytes"], "micro_batches": m,
                        "accumulation": s.accumulation, "micro_group": s.micro_group,
                        "unroll_micro_batches": s.unroll_micro_batches, "segments": list(s.segments),
                        "forward_programs": sum(1 for t in s.segments if t < n_stages - 1),
                        "grad_window": s.grad_window, "counts": s.counts(), "predicted_time": s.predicted.time.to_dict(),
                        "step_s_predicted": s.predicted.time.step_s, "host_update_s_per_param": rates.host_update_s_per_param,
                        "step_s_measured_s16x": rec["step_s_median"], "step_s_predicted_s16x": e["step_s_predicted"],
                        "plan_s": time.perf_counter() - t0}
    finally:
        trace_mod._temp_bytes = real_temp
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(RESULTS / "plan_micro_6b_cpu.json"))
    args = ap.parse_args(argv)
    rows = plan_rows()
    for k, r in rows.items():
        t = r["predicted_time"]
        print(f"{k:30s} predicted {t['step_s']:.3f} s (forward {t['forward_s']:.3f}, backward {t['backward_s']:.3f}, "
              f"host {t['host_update_s']:.3f}, stall {t['window_stall_s']:.3f}) programs {len(r['segments'])} "
              f"(forward {r['forward_programs']}) {r['accumulation']}; measured s16x {r['step_s_measured_s16x']:.3f} s")
    pathlib.Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
