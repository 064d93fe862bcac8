# Issue 23, "GPT3_6B, batch 32 x 1024, 24 GiB: at least 500 model TFLOP/s": kept activations
# (chunkjax.remat / chunkjax.plan_remat) against full recompute, in ONE call of < 9 min (one H200):
#   bash experiments/gpu_checks/act_offload_6b.sh <run-id>                  # full and auto, then the table
#   bash experiments/gpu_checks/act_offload_6b.sh <run-id> auto,offload     # only these runs
#   bash experiments/gpu_checks/act_offload_6b.sh <run-id> table            # only the table of the runs under $OUT
# Runs (each experiments.bench, chunkjax alone, one subprocess, the matmul probe in each, 3 timed steps):
#   full     --set remat=full: every block recomputed in its backward (today's step, recorded 391-434 TFLOP/s);
#   auto     --set remat=auto: the planner keeps the blocks' mlp_fc activations where it predicts a faster step
#            (offloaded to pinned host memory for the first blocks, on the device for the last), else recomputes;
#   offload  only when named: every block's mlp_fc offloaded, run as asked (at batch 32 the CPU planner refuses it:
#            42.7 GB of activations beyond a ~114 GiB host budget);
#   save     only when named: every block's kept on the device (does not fit 24 GiB at batch 32: a plan error).
# CPU planner's predictions for the same setting: experiments/results/plan_remat_6b32_cpu.json (docs/design.md).
# HOST=<bytes> passes --host-budget to the bench (default: its "auto", 0.97 x MemAvailable less the process).
#
# Session 17 (s17r, H200): `auto` was killed by the kernel's OOM killer (-9) in its first step. Its plan (22 blocks
# offloaded, 17.72 GB of activations) kept 30.6 GiB pinned: 95 % of the 32 GiB pinned pool it accounted. The pool
# fragments (PINNED_POOL_FRAGMENTATION, 10 %), so it grew its next 32 GiB region with 20.5 GB available. The pool
# model now rounds pinned / 0.9 up to a power of two (chunkjax.host_memory.pinned_pool_bytes), and
# experiments.plan_remat plans with the GPU's host accounting (--platform gpu, the default). Re-planned on the CPU
# (experiments/results/plan_remat_6b32_gpuhost_cpu.json):
#   python -m experiments.plan_remat --model GPT3_6B --batch 32 --seq 1024 --device-budget 24GiB \
#       --host-budget 114GiB --tide-from experiments/results/bench_s14c_6b32.json
#   auto = offload 17 + save 10 (+ full 26), 13.7 GB of activations each way, predicted step 2.715 s (446 model
#   TFLOP/s; full recompute 2.830 s, 428), device peak 23.85 GiB; host: 28.95 GB pinned (26.9 GiB, 84 % of a
#   32 GiB pool = 34.36 GB) + 77.38 GB pageable + 6.22 process + 3.54 system = 121.5 GB needed
#   (the H200 had 133.3 GB MemAvailable when planning; 114 GiB is its "auto" host budget, 0.97 x 133.3 GB less 6.2).
#   Offloading 19, 26, 39 or 53 blocks is refused by the host budget (the pinned pool would double to 64 GiB).
# Next session:  HOST=114GiB bash experiments/gpu_checks/act_offload_6b.sh s18r auto   (full too: drop "auto")
# Each record's extra.remat gives every mode's predicted step at the run's effective budget. A run is skipped
# when less than 60 s of the call's LIMIT (default 520 s) is left. JSON under $OUT: bench_<run>_<tag>.json per
# run and act_offload_6b_<run>.json (rows + the target); the table (model TFLOP/s, predicted and measured step) last.
# CPU smoke test (numbers meaningless): OUT=/tmp/o BIG=micro SEQ=16 BATCH=2 BUDGET=12MiB LIMIT=900 bash ...
set -u
RUN=${1:-ao}
PART=${2:-all}
export PYTHONUNBUFFERED=1
START=$SECONDS
LIMIT=${LIMIT:-520}
B="python -m experiments.bench --seq ${SEQ:-1024} --results-dir $OUT --steps ${STEPS:-3}"
SIX="--model ${BIG:-GPT3_6B} --device-budget ${BUDGET:-24GiB} --batch ${BATCH:-32} --systems chunkjax${HOST:+ --host-budget $HOST}"
run() {  # run <tag> <bench args...>: within the call's time left, else skipped
  local tag=$1; shift
  local left=$((LIMIT - (SECONDS - START)))
  if (( left < 60 )); then echo "skip $tag (time)"; echo "$tag" >> $OUT/skipped.txt; return; fi
  local t0=$SECONDS
  timeout -k 10 $left $B --run-id ${RUN}_$tag --time-limit $((left - 5)) "$@" > $OUT/$tag.log 2>&1
  echo "$tag rc=$? $((SECONDS - t0)) s"
}
want() { [[ $PART == all || ,$PART, == *,$1,* ]]; }
if [[ $PART != table ]]; then
  for mode in full auto; do want $mode && run $mode $SIX --set remat=$mode; done
  for mode in offload save; do [[ ,$PART, == *,$mode,* ]] && run $mode $SIX --set remat=$mode; done
fi
for t in full auto offload save; do [ -f $OUT/$t.log ] && { echo "== $t"; tail -3 $OUT/$t.log; }; done
python - "$RUN" <<'P'
import json, os, sys
O, run = os.environ["OUT"], sys.argv[1]
rows, out = [], {"run_id": run}
for tag in ("full", "auto", "offload", "save"):
    f = f"{O}/bench_{run}_{tag}.json"
    r = json.load(open(f)) if os.path.exists(f) else None
    for system, s in ((r or {}).get("systems") or {}).items():
        e = s.get("extra") or {}
        rm = e.get("remat") or {}
        rows.append({"run": tag, "system": system, "remat": rm.get("chosen"), "feasible": s.get("feasible"),
                     "tokens_per_s": s.get("tokens_per_s"), "model_tflops": s.get("model_tflops"),
                     "matmul_tflops": s.get("matmul_tflops"), "step_s": s.get("step_s_median"),
                     "step_s_predicted": e.get("step_s_predicted"), "predicted_time": e.get("predicted_time"),
                     "predicted_by_mode": {k: v for k, v in rm.items() if k in ("full", "save", "offload", "auto")},
                     "peak_device_bytes_measured": s.get("peak_device_bytes_measured"),
                     "peak_device_bytes_accounted": e.get("peak_device_bytes_accounted"),
                     "h2d_bytes_per_step_measured": s.get("h2d_bytes_per_step_measured"),
                     "d2h_bytes_per_step_measured": s.get("d2h_bytes_per_step_measured"),
                     "schedule_counts": e.get("schedule_counts"),
                     "error": (s.get("error") or s.get("infeasible_reason") or "")[:300]})
out["rows"] = rows
best = max((x["model_tflops"] or 0 for x in rows), default=0)
full = next((x for x in rows if x["run"] == "full"), None)
out["targets"] = {"best_model_tflops (>= 500)": best,
                  "full_model_tflops": full and full["model_tflops"],
                  "best_over_full": best / full["model_tflops"] if full and full["model_tflops"] else None}
skipped = f"{O}/skipped.txt"
out["skipped"] = open(skipped).read().split() if os.path.exists(skipped) else []
json.dump(out, open(f"{O}/act_offload_6b_{run}.json", "w"), indent=1)
f = lambda v, d=3: "-" if v is None else f"{v:,.{d}f}"  # noqa: E731
print("| run | remat (blocks) | tokens/s | model TFLOP/s | matmul probe TFLOP/s | step s | predicted s | "
      "peak GB measured (accounted) | H2D / D2H GB per step |")
print("|---|---|---|---|---|---|---|---|---|")
for x in rows:
    gb = lambda v: "-" if v is None else f"{v / 1e9:.1f}"  # noqa: E731
    print(f"| {x['run']} | {x['remat'] or '-'} | {f(x['tokens_per_s'], 0)} | {f(x['model_tflops'], 1)} | "
          f"{f(x['matmul_tflops'], 0)} | {f(x['step_s'])} | {f(x['step_s_predicted'])} | "
          f"{gb(x['peak_device_bytes_measured'])} ({gb(x['peak_device_bytes_accounted'])}) | "
          f"{gb(x['h2d_bytes_per_step_measured'])} / {gb(x['d2h_bytes_per_step_measured'])} | "
          + (x["error"].splitlines()[0] if x["error"] else ""))
for x in [r for r in rows if r["predicted_by_mode"]][:1]:
    print("predicted step by mode at the run's effective budget:",
          json.dumps({k: (v.get("remat"), v.get("step_s_predicted")) if "error" not in v else v["error"][:80]
                      for k, v in x["predicted_by_mode"].items()}))
print(json.dumps(out["targets"], indent=1), "skipped:", out["skipped"])
P
