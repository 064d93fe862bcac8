"""The plans of ``largest.sh`` on the CPU, with the GPU's host measure (nothing allocated).

    python experiments/gpu_checks/largest_plan.py --model GPT3_15B --budget 138GiB --pool 38
    python experiments/gpu_checks/largest_plan.py --model GPT3_18B --budget 138GiB --pool 56 --storage /tmp/d \\
        --disk-gb 68.67
    python experiments/gpu_checks/largest_plan.py --model GPT3_15B --batch 64 --micro-batches 8 --pool 44 \\
        --storage /tmp/d --disk-gb 68.67
    python experiments/gpu_checks/largest_plan.py --model GPT3_18B --batch 16 --micro-batches 8 --pool 56 \\
        --storage /tmp/d --disk-gb 68.67

The problem is the bench's chunkjax system's (:mod:`experiments.bench_chunkjax`: AdamW host kernel, bf16 compute)
prepared on this machine's traces (XLA CPU's activations: attention materialises its scores, more than the
GPU's), then taken as a GPU's (``platform="gpu"``) so that the host need is what the GPU runtime gives the run:
XLA's pinned pool as ``XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE`` / ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` make it
(:func:`chunkjax.host_memory.pinned_pool_bytes`) plus pageable bytes. The device budget is planned as the fit
path's first plan does: :data:`chunkjax.fit.HEADROOM` of it less one chunk. Prints one JSON line per plan (bytes,
seconds; with micro-batches ``accumulation`` says how they run: :func:`chunkjax.plan_micro.accumulation_line`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def prepare(model: str, batch: int, seq: int, micro_batches: int = 1, storage: str = "", keep_previous=False,
            host_budget: int | None = None, unroll: bool = False):
    """The bench's fit problem for ``model`` (abstract shapes, no host check), as a GPU's (the disk tier
    needs ``host_budget``, bytes; :func:`plan_one` plans at its own)."""
    import jax
    import jax.numpy as jnp

    from chunkjax import fit
    from chunkjax.host_update import AdamW
    from chunkjax.storage.updater import StorageOptions
    from models import gpt
    cfg = gpt.get_config(model)
    st = StorageOptions(tuple(storage.split(",")), keep_previous=keep_previous) if storage else None
    p = fit.prepare(gpt.gpt_stages(cfg), gpt.abstract_params(cfg), jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32),
                    host_optimizer=AdamW(1e-4, weight_decay=1e-4), compute_dtype=jnp.bfloat16,
                    micro_batches=micro_batches, flops_per_step=float(cfg.flops_per_token(seq) * batch * seq),
                    host_budget=host_budget, check_host=False, storage=st,
                    unroll_micro_batches=unroll)
    return dataclasses.replace(p, platform="gpu"), cfg


def plan_one(p, cfg, budget: int, host_budget: int, pool_gib: int | None, disk_bytes: int | None = None) -> dict:
    """Plan ``p`` at the fit path's first planning budget for device budget ``budget`` with a
    preallocated pool of ``pool_gib`` GiB (None: the runtime's default, growing); returns figures."""
    from chunkjax import fit, fit_host
    from chunkjax.errors import PlanError
    from chunkjax.plan_disk import storage_line
    for k in ("XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE", "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"):
        os.environ.pop(k, None)
    if pool_gib:
        os.environ["XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE"] = "true"
        os.environ["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"] = str(pool_gib)
    q = dataclasses.replace(p, host_budget_bytes=int(host_budget),
                            **({"disk_budget_bytes": int(disk_bytes)} if disk_bytes else {}))
    eff = int(fit.HEADROOM * budget) - q.cb.params
    t0 = time.perf_counter()
    out = {"model": cfg.name, "n_params": cfg.n_params, "device_budget_bytes": budget, "planned_at_bytes": eff,
           "host_budget_bytes": int(host_budget), "pool_gib": pool_gib, "micro_batches": q.micro_batches}
    try:
        s = fit.plan(q, eff)
    except PlanError as e:
        return dict(out, refused=str(e), plan_s=time.perf_counter() - t0)
    need, pr = fit_host.host_need(q, s), s.predicted
    from chunkjax.plan_micro import accumulation_line
    return dict(out, counts=s.counts(), master_fetch=len(s.master_fetch), programs=len(s.segments),
                accumulation=accumulation_line(s, q.micro_batches),
                peak_device_bytes_accounted=pr.peak_device_bytes, device_model_bytes=pr.device_model_bytes,
                host_measure_bytes=fit_host.host_bytes_of(q)(s), host_need=need, host_bytes=pr.host_bytes,
                host_working_bytes=pr.host_working_bytes, host_resident_bytes_per_param=pr.host_resident_bytes_per_param,
                storage_chunks=pr.storage_chunks, disk_bytes_per_step=pr.disk_bytes_per_step,
                storage_line=storage_line(s, q.storage_devices, q.host_budget_bytes),
                step_s_predicted=pr.time.step_s, plan_s=time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="GPT3_15B")
    ap.add_argument("--budget", default="138GiB", help="the bench's --device-budget")
    ap.add_argument("--host", type=float, default=119e9, help="host budget (bytes; the H200's auto is about 119e9)")
    ap.add_argument("--pool", default="38", help="preallocated pinned pool (GiB), comma-separated to compare; 0: growing")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--storage", default="", help="storage directories (the disk tier)")
    ap.add_argument("--disk-gb", type=float, default=None, help="disk budget (GB); default: the directories' free bytes")
    ap.add_argument("--unroll", action="store_true", help="in-program micro-batch loops unrolled (the bench's "
                    "--set unroll_micro_batches=1)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from chunkjax.plan import parse_bytes
    p, cfg = prepare(a.model, a.batch, a.seq, a.micro_batches, a.storage, host_budget=int(a.host), unroll=a.unroll)
    rows = []
    for pool in (int(x) for x in a.pool.split(",")):
        r = plan_one(p, cfg, parse_bytes(a.budget), int(a.host), pool or None,
                     None if a.disk_gb is None else int(a.disk_gb * 1e9))
        rows.append(r)
        print(json.dumps(r, default=str), flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
