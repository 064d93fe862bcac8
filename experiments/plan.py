"""Planner CLI: the placement chunkjax would use for a model, batch and budget, next to the static
partitions users know, all planned by the same engine on abstract shapes (runs on a CPU).

    python -m experiments.plan --model GPT3_10B --device-budget 24GiB --host-budget 120GiB \\
        --batch 8 --seq 1024 [--json]

Baselines: ``all_host`` (all model data in pinned host memory, streamed each step) and
``zero_offload`` (compute params and gradients on the device, optimizer state and its update on the
host). An infeasible budget exits 2 and names the smallest budget that works and whether
activations alone are the cause. Non-model bytes come from compiling each distinct stage for the
backend this runs on: a CPU plan is an estimate of the GPU's (experiments.train checks the plan
against the GPU compiler before the first step).
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def _feasible(acc, budget, host_budget):
    return acc.peak_device_bytes <= budget and (host_budget is None or acc.host_model_bytes <= host_budget)


def plan_report(model: str, device_budget: int, host_budget: int | None, batch: int, seq: int,
                prefetch: int = 1, chunk_size: int | None = None, min_chunks: int = 8) -> dict:
    """Plan and account a step; returns the JSON report (bytes, seconds).

    Raises:
      ValueError: unknown model; chunkjax.PlanError: the budget cannot hold the step.
    """
    import jax
    import jax.numpy as jnp
    import optax

    import chunkjax as cj
    from chunkjax.cost import predict_step_time
    from chunkjax.optim import state_bytes_per_chunk
    from chunkjax.tide import memory_tide
    from models import gpt

    mcfg = gpt.get_config(model)
    if seq > mcfg.seq_len:
        raise ValueError(f"--seq {seq} exceeds the model's {mcfg.seq_len} positions")
    stages = gpt.gpt_stages(mcfg)
    ap = gpt.abstract_params(mcfg)
    ab = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
    order = cj.first_use_order(lambda p, b: cj.compose_loss(stages, p, b), ap, ab)
    layout = cj.build_layout(ap, chunk_size, order, min_chunks=min_chunks)
    cdt = jnp.bfloat16
    traces = cj.trace_stages(stages, layout, ab, cdt)
    tide = memory_tide(traces, layout.chunk_size)
    cb = cj.chunk_bytes(layout, cdt, state_bytes_per_chunk(optax.adamw(1e-4), layout.chunk_size))
    n = layout.n_chunks
    flops = mcfg.flops_per_token(seq) * batch * seq

    def summarize(placement, acc, host_update=False):
        dev_params = sum(layout.chunk_size for k in placement.state_kinds if k == cj.DEVICE)
        host_params = n * layout.chunk_size - dev_params
        t = predict_step_time(flops, 1 / 3, acc.fwd_bwd_h2d_bytes, acc.fwd_bwd_d2h_bytes,
                              acc.h2d_bytes_per_step - acc.fwd_bwd_h2d_bytes,
                              acc.d2h_bytes_per_step - acc.fwd_bwd_d2h_bytes,
                              dev_params + (0 if host_update else host_params),
                              host_params if host_update else 0)
        return {"feasible": _feasible(acc, device_budget, host_budget),
                "predicted_peak_device_bytes": acc.peak_device_bytes,
                "device_model_bytes": acc.device_model_bytes, "host_bytes": acc.host_model_bytes,
                "h2d_bytes_per_step": acc.h2d_bytes_per_step, "d2h_bytes_per_step": acc.d2h_bytes_per_step,
                "predicted_step_s": t.step_s, "time": t.to_dict(), "placement_counts": placement.counts()}

    base = {}
    for name, pl, hu in [("all_host", cj.Placement.uniform(n, cj.PINNED_HOST, cj.PINNED_HOST), False),
                         ("zero_offload", cj.Placement.uniform(n, cj.DEVICE, cj.PINNED_HOST), True)]:
        base[name] = summarize(pl, cj.account(layout, pl, traces, cb, prefetch, host_update=hu), hu)
    placement, acc = cj.plan_fixed(layout, traces, cb, device_budget, prefetch)
    out = summarize(placement, acc)
    out.update({"model": mcfg.name, "n_params": mcfg.n_params, "batch": batch, "seq": seq,
                "device_budget_bytes": device_budget, "host_budget_bytes": host_budget,
                "model_bytes": 14 * mcfg.n_params, "n_chunks": n, "chunk_size": layout.chunk_size,
                "peak_non_model_bytes": tide.peak_non_model_bytes, "baselines": base,
                "backend": jax.default_backend()})
    return out


def _summary(r: dict) -> str:
    G = 2**30
    lines = [f"{r['model']}: N={r['n_params'] / 1e9:.2f}B, model data {r['model_bytes'] / G:.1f} GiB, "
             f"{r['n_chunks']} chunks x {r['chunk_size']} elements; batch {r['batch']}x{r['seq']}",
             f"device budget {r['device_budget_bytes'] / G:.1f} GiB; peak non-model (tide) "
             f"{r['peak_non_model_bytes'] / G:.2f} GiB (estimated on {r['backend']})",
             f"{'plan':14s} {'feasible':>8s} {'peak GiB':>9s} {'on dev GiB':>10s} {'host GiB':>9s} "
             f"{'h2d GB':>8s} {'d2h GB':>8s} {'step s':>7s}  where the time goes"]
    rows = [("chunkjax", r)] + list(r["baselines"].items())
    for name, x in rows:
        t = x["time"]
        where = (f"compute {t['compute_s']:.2f}s | fwd/bwd transfers {t['fwd_bwd_transfer_s']:.2f}s | "
                 f"update transfers {t['update_transfer_s']:.2f}s | update {t['update_compute_s']:.2f}s")
        lines.append(f"{name:14s} {str(x['feasible']):>8s} {x['predicted_peak_device_bytes'] / G:9.2f} "
                     f"{x['device_model_bytes'] / G:10.2f} {x['host_bytes'] / G:9.2f} "
                     f"{x['h2d_bytes_per_step'] / 1e9:8.2f} {x['d2h_bytes_per_step'] / 1e9:8.2f} "
                     f"{x['predicted_step_s']:7.3f}  {where}")
    lines.append(f"chunkjax placement: {r['placement_counts']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--device-budget", required=True)
    ap.add_argument("--host-budget", default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--prefetch", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    import chunkjax as cj
    try:
        budget = cj.parse_bytes(a.device_budget)
        host = cj.parse_bytes(a.host_budget) if a.host_budget else None
        if a.batch < 1 or a.seq < 1:
            raise ValueError("--batch and --seq must be >= 1")
        t0 = time.time()
        r = plan_report(a.model, budget, host, a.batch, a.seq, a.prefetch)
        r["plan_s"] = time.time() - t0
    except cj.PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(r, indent=1) if a.json else _summary(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
