"""Init speed of a host-resident model on the GPU: GB/s of :meth:`chunkjax.ChunkedStep.init` by part.

Issue 24 (setup time): GPT3_15B's init on the H200 filled its 128 GB of host state at ~0.75 GB/s
(170 s) and GPT3_18B's took ~185 s (its storage chunks' first writes ~50 s of it). This plans
``--model`` (default GPT3_6B, batch 8 x 1024) at a small device budget (``--budget``, default
48 GiB: about half of its ~107 GB of state on the host, most of it master-fetch), optionally with
a storage directory (``--storage DIR --host GB``), then times ``step.init`` with the benchmark's
leaf init (each leaf drawn on the device and read through pinned host memory,
:meth:`experiments.bench_chunkjax.ChunkjaxSystem.init`) and the init's parts wrapped with timers
(:mod:`experiments.init_profile`). Nothing is compiled but the leaf draws. Prints a table and
writes ``$OUT/init_speed.json``; < 3 min on the H200 (plan ~20 s, init ~60-90 s)::

    python experiments/gpu_checks/init_speed.py                                 # GPT3_6B, host only
    python experiments/gpu_checks/init_speed.py --storage $PWD/.scratch_disk --host 30e9   # with the disk tier
    python experiments/gpu_checks/init_speed.py --model tiny --seq 128 --budget 3MiB       # CPU smoke test
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="GPT3_6B")
    ap.add_argument("--budget", default="48GiB", help="device budget")
    ap.add_argument("--host", type=float, default=None, help="host budget (bytes); default: unbounded")
    ap.add_argument("--storage", default="", help="a storage directory (the disk tier; removed afterwards)")
    ap.add_argument("--seq", type=int, default=1024, help="the planned batch's sequence length (batch 8)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    a = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from chunkjax import fit
    from chunkjax.host_ledger import HostLedger
    from chunkjax.host_update import AdamW
    from chunkjax.memory import PINNED_HOST, sharding
    from chunkjax.plan import parse_bytes
    from chunkjax.storage.updater import StorageOptions
    from experiments.init_profile import profile
    from models import gpt

    t0 = time.perf_counter()
    cfg = gpt.get_config(a.model)
    st = StorageOptions((a.storage,), keep_previous=False) if a.storage else None
    p = fit.prepare(gpt.gpt_stages(cfg), gpt.abstract_params(cfg), jax.ShapeDtypeStruct((8, a.seq + 1), jnp.int32),
                    host_optimizer=AdamW(1e-4, weight_decay=1e-4), compute_dtype=jnp.bfloat16,
                    flops_per_step=float(cfg.flops_per_token(a.seq) * 8 * a.seq),
                    host_budget=None if a.host is None else int(a.host), check_host=False, storage=st)
    budget = parse_bytes(a.budget)
    s = fit.plan(p, int(fit.HEADROOM * budget) - p.cb.params)
    step = fit.build_step(p, s)
    plan_s = time.perf_counter() - t0
    print(f"plan {plan_s:.1f} s: {s.counts()}, {len(s.master_fetch)} master-fetch, storage {s.predicted.storage_chunks}",
          flush=True)
    pinned = sharding(PINNED_HOST)
    leaf = gpt.leaf_initializer(cfg, jax.random.key(0), p.layout)
    jax.block_until_ready(leaf(0))  # one draw compiled before the clock starts

    def leaf_np(i):  # as the benchmark's init
        return np.asarray(jax.device_put(leaf(i), pinned))

    ledger = HostLedger()
    ledger.mark("before init")
    r = profile(step, leaf_np, p.layout)
    state = r.pop("state")
    ledger.mark("after init")
    n = p.layout.n_chunks * p.layout.chunk_size
    grown = ledger.growth("before init", "after init") or {}
    out = dict(model=a.model, device_budget_bytes=budget, host_budget_bytes=a.host, counts=s.counts(),
               master_fetch=len(s.master_fetch), storage_chunks=s.predicted.storage_chunks,
               chunk_size=p.layout.chunk_size, n_chunks=p.layout.n_chunks, plan_s=plan_s, init_s=r["total_s"],
               parts=r["parts"], state_gb=16 * n / 1e9, state_gb_per_s=16 * n / 1e9 / r["total_s"],
               host_resident_grown_bytes=grown.get("resident_bytes"),
               host_gb_per_s=(grown.get("resident_bytes") or 0) / 1e9 / r["total_s"],
               disk_bytes_written=(3 * 4 * p.layout.chunk_size * s.predicted.storage_chunks),
               device=str(jax.devices()[0].device_kind))
    print(f"init {r['total_s']:.1f} s: {out['state_gb']:.1f} GB of state (16 B/param) at {out['state_gb_per_s']:.2f} GB/s; "
          f"host resident +{(grown.get('resident_bytes') or 0) / 1e9:.1f} GB at {out['host_gb_per_s']:.2f} GB/s")
    print("| part | s | calls |\n|---|---|---|")
    for k, (sec, c) in sorted(r["parts"].items(), key=lambda x: -x[1][0]):
        print(f"| {k} | {sec:.2f} | {c} |")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "init_speed.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    for x in {id(x): x for x in state.master if hasattr(x, "close")}.values():
        x.close()
    if a.storage:
        shutil.rmtree(a.storage, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
