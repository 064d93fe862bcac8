"""Host memory per step of the front door on the 3B model (issue 22/23 diagnostic): live jax arrays
by memory kind, their count, process RSS and MemAvailable after every step, so a growth per step
shows where it is. ``python experiments/gpu_checks/host_growth.py --batch 8 --steps 12``
(``--tiny`` on a CPU)."""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "experiments", "gpu_checks"))


def rss() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import chunkjax
    import front_door_3b as fd
    from chunkjax.host_memory import host_memory_available_bytes
    from chunkjax.host_update import AdamW
    cfg = fd.CONFIGS["tiny" if a.tiny else "3b"]
    seq = 32 if a.tiny else 1024
    Llama = fd.build_model_classes()
    with jax.default_device(jax.devices("cpu")[0]):
        model = Llama(**cfg, remat=True, rngs=nnx.Rngs(0))
    n = sum(int(np.size(x)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    data = fd.make_batches(cfg, a.batch, seq, a.steps + 1)
    from experiments.gpu_measure import calibrated_rates
    rates, _ = calibrated_rates()  # as front_door_3b and the benchmark (the default Rates elsewhere)
    t0 = time.time()
    budget = int(16 * n / 3)
    try:
        step = chunkjax.offload(model, AdamW(3e-4, weight_decay=0.1), fd.loss_fn, data[0], device_budget=budget,
                                compute_dtype=jnp.bfloat16, rates=rates)
    except chunkjax.PlanError as e:
        step = chunkjax.offload(model, AdamW(3e-4, weight_decay=0.1), fd.loss_fn, data[0],
                                device_budget=int(e.min_budget_bytes * 1.05), compute_dtype=jnp.bfloat16, rates=rates)
    print(step.summary(), flush=True)
    print(f"setup {time.time() - t0:.1f} s; rss {rss() / 2**30:.1f} GiB; plan host bytes "
          f"{step.schedule.predicted.host_bytes / 2**30:.1f} GiB; host need "
          + json.dumps({k: round(v / 2**30, 2) for k, v in (step.report.host or {}).items() if v is not None})
          + f"; released {getattr(step, 'released_bytes', 0) / 2**30:.2f} GiB of the model", flush=True)
    rows = []
    for i, b in enumerate(data):
        t = time.perf_counter()
        loss = float(step(b))
        step.wait()
        dt = time.perf_counter() - t
        gc.collect()
        kinds: dict = {}
        live = jax.live_arrays()
        for x in live:
            k = x.sharding.memory_kind
            kinds[k] = kinds.get(k, 0) + x.nbytes
        n_live = len(live)
        del live, x  # holding them would keep this step's arrays alive into the next count
        row = {"step": i, "loss": loss, "step_s": dt, "live": n_live,
               **{f"{k}_gib": v / 2**30 for k, v in kinds.items()}, "rss_gib": rss() / 2**30,
               "avail_gib": (host_memory_available_bytes() or 0) / 2**30}
        rows.append(row)
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    tail = rows[2:]
    if tail:
        print(f"tokens/s over steps 2..: {a.batch * seq * len(tail) / sum(r['step_s'] for r in tail):,.0f}; "
              f"peak rss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB", flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"summary": step.summary(), "host_need": step.report.host, "rows": rows,
                       "released_bytes": getattr(step, "released_bytes", None)}, fh, indent=1)


if __name__ == "__main__":
    main()
