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
            host_budget: int | None = None, unroll: bool = False, chunk_size: int | None = None,
            n_layers: int | None = None):
    """The bench's fit problem for ``model`` (abstract shapes, no host check), as a GPU's (the disk tier
    needs ``host_budget``, bytes; :func:`plan_one` plans at its own; ``chunk_size``: elements, None:
    the layout's search, as the bench's ``--set chunk_size=N``)."""
    import jax
    import jax.numpy as jnp

    from chunkjax import fit
    from chunkjax.host_update import AdamW
    from chunkjax.storage.updater import StorageOptions
    from models import gpt
    cfg = gpt.get_config(model, **({"n_layers": n_layers} if n_layers else {}))
    st = StorageOptions(tuple(storage.split(",")), keep_previous=keep_previous) if storage else None
    p = fit.prepare(gpt.gpt_stages(cfg), gpt.abstract_params(cfg), jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32),
                    host_optimizer=AdamW(1e-4, weight_decay=1e-4), compute_dtype=jnp.bfloat16,
                    micro_batches=micro_batches, flops_per_step=float(cfg.flops_per_token(seq) * batch * seq),
                    host_budget=host_budget, check_host=False, storage=st,
                    unroll_micro_batches=unroll, chunk_size=chunk_size)
    return dataclasses.replace(p, platform="gpu"), cfg


def with_gpu_temps(p, cfg, path: str, batch: int, seq: int):
    """``p`` with the stage temporaries a GPU run of a model of the same width recorded (``path``: a
    results JSON of experiments/bench.py whose ``systems.chunkjax.extra.stage_temp_bytes`` holds
    ``embed``, ``h_0``, ``head``), at the same batch and seq: the blocks of one width are the same
    program whatever their number, so GPT3_12B's recorded block stands for GPT3_18B's. The CPU's
    traces materialise attention's scores (XLA CPU), more than the GPU's cuDNN attention keeps.

    Raises:
      ValueError: the record is of another width, batch or seq, or has no stage temporaries.
    """
    import json as _json

    from models import gpt
    rec = _json.load(open(path))
    s = (rec.get("systems") or {}).get("chunkjax") or {}
    temps = (s.get("extra") or {}).get("stage_temp_bytes")
    other = gpt.get_config(rec.get("model"))
    if not isinstance(temps, dict) or not {"embed", "h_0", "head"} <= set(temps):
        raise ValueError(f"{path} records no stage_temp_bytes of embed, h_0 and head")
    if (other.d_model, other.n_heads, other.vocab_size, rec.get("batch"), rec.get("seq")) != (
            cfg.d_model, cfg.n_heads, cfg.vocab_size, batch, seq):
        raise ValueError(f"{path} is {other.name} at {rec.get('batch')}x{rec.get('seq')}: not {cfg.name}'s width, "
                         f"heads and vocabulary at {batch}x{seq}")
    traces = tuple(dataclasses.replace(t, temp_bytes=int(temps[t.name if t.name in temps else "h_0"]))
                   for t in p.traces)
    return dataclasses.replace(p, traces=traces)


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
    out = {"model": cfg.name, "n_layers": cfg.n_layers, "n_params": cfg.n_params, "device_budget_bytes": budget, "planned_at_bytes": eff,
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
    ap.add_argument("--model", default="GPT3_15B", help="models/gpt.py config, comma-separated to plan several")
    ap.add_argument("--budget", default="138GiB", help="the bench's --device-budget")
    ap.add_argument("--host", default="119e9",
                    help="host budget (bytes; the H200's auto is about 119e9), comma-separated to compare")
    ap.add_argument("--pool", default="38", help="preallocated pinned pool (GiB), comma-separated to compare; 0: growing")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--storage", default="", help="storage directories (the disk tier)")
    ap.add_argument("--disk-gb", type=float, default=None, help="disk budget (GB); default: the directories' free bytes")
    ap.add_argument("--unroll", action="store_true", help="in-program micro-batch loops unrolled (the bench's "
                    "--set unroll_micro_batches=1)")
    ap.add_argument("--gpu-temps", default=None, metavar="RESULTS_JSON",
                    help="stage temporaries recorded on the GPU by a run of a model of the same width at the same "
                         "batch (e.g. experiments/results/bench_s8_largest_12b.json for the 4096-wide GPT3s at 8x1024) "
                         "in place of the CPU's traces")
    ap.add_argument("--layers", type=int, default=None, help="the configs' blocks, overridden (a size between two configs)")
    ap.add_argument("--chunk-size", type=int, default=None,
                    help="elements per chunk (default: the layout's search; the bench's --set chunk_size=N)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from chunkjax.plan import parse_bytes
    hosts = [int(float(x)) for x in a.host.split(",")]
    rows = []
    for model in a.model.split(","):
        p, cfg = prepare(model, a.batch, a.seq, a.micro_batches, a.storage, host_budget=hosts[0], unroll=a.unroll,
                         chunk_size=a.chunk_size, n_layers=a.layers)
        if a.gpu_temps:
            p = with_gpu_temps(p, cfg, a.gpu_temps, a.batch, a.seq)
        for host in hosts:
            for pool in (int(x) for x in a.pool.split(",")):
                r = plan_one(p, cfg, parse_bytes(a.budget), host, pool or None,
                             None if a.disk_gb is None else int(a.disk_gb * 1e9))
                r["stage_temps"] = a.gpu_temps or "cpu traces"
                r["chunk_size"], r["n_chunks"] = p.layout.chunk_size, p.layout.n_chunks
                r["padding_elements"] = p.layout.n_chunks * p.layout.chunk_size - cfg.n_params
                rows.append(r)
                print(json.dumps(r, default=str), flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
