"""Rollback by inversion on the GPU (issue 23 item 2): GPT3_6B, batch 16 x 1024, AdamW,
clip_by_global_norm(1.0), 24 GiB, one process, the same plan and state throughout; the step's
``rollback`` and ``speculation_policy`` swapped between timed runs (host-side only: the device
programs are the same).

    python experiments/gpu_checks/rollback_6b.py --out $OUT [--model GPT3_6B --budget 24GiB --steps 3]

First the AdamW kernels' ns/param on the host (update_, invert_, canonical_: the waiting chunks'
one-pass update on a speculating step that clips). Runs, each 1 warm-up + ``--steps`` timed steps (wall time of step + host join, as experiments.bench):
  invert_after_common (the default), invert_always, backup_always (the old scheme), backup_after_common.
From init clipping fires on every step (ninth session), so "after_common" waits from the second
step on and "always" redoes every speculated chunk; the table shows what each costs. Prints a
table, writes ``$OUT/rollback_6b.json`` (tokens/s, step seconds, speculated / inverted / redone
chunks, kept gradient bytes, pool bytes per run). A run that would start past ``--limit`` seconds
is skipped. CPU smoke test: ``--model micro --budget 12MiB --seq 16 --batch 2`` (numbers meaningless).
"""
import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())


def kernel_rates(n: int = 1 << 26) -> dict:
    """ns per parameter of the AdamW kernels on this host (bf16 gradient, all numba threads, the
    fastest of 3 after a warm-up): update_, invert_, canonical_ (forward, inverse, forward)."""
    import numpy as np

    from chunkjax.host_update import AdamW
    from chunkjax.kernels import bf16_round_bits, step_hyper, update_
    from chunkjax.kernels_inverse import canonical_, invert_
    rng = np.random.default_rng(0)
    p = rng.standard_normal(n, dtype=np.float32)
    m, v = np.zeros(n, np.float32), np.full(n, 1e-3, np.float32)
    g, out = bf16_round_bits(rng.standard_normal(n, dtype=np.float32)), np.empty(n, np.uint16)
    h, one, half = step_hyper(AdamW(1e-3, weight_decay=0.1), 5, 1e-3), (np.float32(1), np.float32(1)), (
        np.float32(0.5), np.float32(1))
    res = {}
    for name, f in (("update_ns", lambda: update_(h, p, (m, v), g, out, one)),
                    ("invert_ns", lambda: invert_(h, p, (m, v), g, one)),
                    ("canonical_ns", lambda: canonical_(h, p, (m, v), g, out, one, half))):
        f()
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        res[name] = min(ts) / n * 1e9
    print("kernels (ns/param):", {k: round(x, 3) for k, x in res.items()}, flush=True)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--model", default="GPT3_6B")
    ap.add_argument("--budget", default="24GiB")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--limit", type=float, default=270.0, help="seconds after which no new run starts")
    a = ap.parse_args()
    t_start = time.perf_counter()
    rates = kernel_rates(1 << 26 if a.model != "micro" else 1 << 16)
    import jax

    from chunkjax.plan import parse_bytes
    from experiments.bench_chunkjax import ChunkjaxSystem
    from experiments.measure import make_batch
    from models import gpt
    cfg = gpt.get_config(a.model)
    sys_ = ChunkjaxSystem(cfg, parse_bytes(a.budget), a.batch, a.seq, max_grad_norm=1.0)
    batch = make_batch(cfg, a.batch, a.seq, 0, getattr(sys_, "dev_sh", None))
    state = sys_.init(jax.random.key(0))
    base = sys_.step_fn
    rows = []
    for rollback, policy in (("invert", "after_common"), ("invert", "always"), ("backup", "always"),
                             ("backup", "after_common")):
        name = f"{rollback}_{policy}"
        if time.perf_counter() - t_start > a.limit:
            rows.append({"run": name, "skipped": "time"})
            continue
        sys_.step_fn = dataclasses.replace(base, rollback=rollback, speculation_policy=policy)
        times, counts = [], []
        for k in range(a.steps + 1):
            t0 = time.perf_counter()
            state, loss = sys_.step(state, batch)
            float(loss)
            dt = time.perf_counter() - t0
            sp = state.pending.speculation  # None: no host chunks in this plan
            counts.append({k: getattr(sp, k, 0) for k in ("speculated", "inverted", "redone", "fired",
                                                          "kept_bytes_peak")})
            if k:
                times.append(dt)
        step_s = sorted(times)[len(times) // 2]
        rows.append({"run": name, "rollback": rollback, "policy": policy, "step_s_median": step_s,
                     "step_s": times, "tokens_per_s": a.batch * a.seq / step_s, "per_step": counts,
                     "pool_allocated_bytes": getattr(state.pending.backups, "allocated_bytes", 0),
                     "n_host_chunks": len(base.host_chunks)})
        print(f"{name}: {step_s:.3f} s, {a.batch * a.seq / step_s:,.0f} tokens/s, {counts}", flush=True)
    out = {"model": a.model, "budget": a.budget, "batch": a.batch, "seq": a.seq, "max_grad_norm": 1.0,
           "device": str(jax.devices()[0]), "kernel_rates_ns_per_param": rates, "rows": rows}
    with open(os.path.join(a.out, "rollback_6b.json"), "w") as f:
        json.dump(out, f, indent=1)
    print("| run | step s | tokens/s | speculated / inverted / redone (sum) | kept grad GB (peak) | pool GB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "skipped" in r:
            print(f"| {r['run']} | skipped ({r['skipped']}) | | | | |")
            continue
        c = r["per_step"]
        print(f"| {r['run']} | {r['step_s_median']:.3f} | {r['tokens_per_s']:,.0f} | "
              f"{sum(x['speculated'] for x in c)} / {sum(x['inverted'] for x in c)} / {sum(x['redone'] for x in c)} | "
              f"{max(x['kept_bytes_peak'] for x in c) / 1e9:.2f} | {r['pool_allocated_bytes'] / 1e9:.2f} |")


if __name__ == "__main__":
    main()
