# Issue 24 on the GPU: the largest models on one H200 (125.8 GiB host RAM, 64 GiB free disk), in parts of < 9 min.
#   bash experiments/gpu_checks/largest.sh <run-id> a      # GPT3_15B host-only, batch 8 x 1024, 5 steps (then 8 micro-batches)
#   bash experiments/gpu_checks/largest.sh <run-id> a2     # GPT3_15B, batch 64 = 8 micro-batches of 8 x 1024, 3 steps
#   bash experiments/gpu_checks/largest.sh <run-id> b      # GPT3_18B with the disk tier, 3 steps (then 8 micro-batches)
#   bash experiments/gpu_checks/largest.sh <run-id> b2     # GPT3_18B, 8 micro-batches, disk tier, 3 steps
#   bash experiments/gpu_checks/largest.sh <run-id> table  # only the table of the runs under $OUT
# Each part is one experiments.bench --largest call per run (one subprocess per system, the matmul probe in each
# call), its pinned-pool settings in the environment of that call only; the bench's workers take
# XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB from the environment (before session 12's fix they got 110 GiB whatever was
# set). A run gets the time left of the part's $LIMIT s (a run that would start with less than 120 s is skipped
# and named in the table). JSON under $OUT (bench_<run>_<tag>.json, largest_<run>.json); the table is printed last.
#
# Why these settings (CPU plans on CPU traces, the GPU's host measure: `python experiments/gpu_checks/largest_plan.py`):
# * The GPU host measure is XLA's pinned pool + pageable bytes. Unpreallocated, the pool grows to the power of two
#   above the pinned peak (capped by XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB): GPT3_15B's ~41 GB pinned (float32 masters
#   of its master-fetch host chunks + the host gradients of two programs) became a 64 GiB pool, or the 110 GiB cap
#   above 64 GiB, and 176 GB with the bench's 110 GiB preallocated. Preallocated at the pinned peak, the pool costs
#   what is pinned: a host-resident chunk is 12 B/param (float32 master pinned, Adam m + v pageable) plus the
#   working set, which the planner now cuts to 16-32 programs when even all master-fetch does not fit.
# * The fit plans first at 90 % of the device budget less a chunk, and the host need falls as the device holds
#   more: 138 GiB (fraction 0.98 of the card) is what lets GPT3_15B fit ~119 GB of host.
#   GPT3_15B b8x1024, 138 GiB, pool 38 GiB preallocated, host budget 119e9: 137 device / 179 host chunks (170
#   master-fetch), 32 programs; accounted device peak 132.98e9 (0.90 of 148.2e9: no margin for a compiled overshoot
#   of 10 %, which 12B never showed: compiled 123.3e9 vs 127.8e9 accounted); host measure 118.54e9 (pool 40.80e9 +
#   pageable 77.74e9), 12.27 B/param per host-resident chunk incl. 1.59e9 of gradients; predicted 3.45 s/step.
#   At 126 GiB no pool setting fits 119e9 (pools of 43/44 GiB refused on the CPU; ~128.6e9 by hand, finest cut).
#   GPT3_15B b64 (8 micro-batches): each host chunk adds its float32 sum and mean (6 B/param) on the host: it does
#   not fit host-only; part a2 gives it the disk tier (the planner says "storage not needed" if it fits). Planned
#   (138 GiB, pool 40 GiB, host 119e9, disk 68.67e9): 137 device / 100 host (master-fetch) / 79 disk chunks, 32
#   programs, accounted device peak 132.98e9, host measure 118.99e9 (pool 42.95e9 + pageable 76.04e9; working set
#   33.0e9 of it the sums), disk 100.4 GB/step, predicted 94.75 s/step (69.9 s of disk after the 8 micro-batches):
#   5 steps are ~475 s, so the 8-micro-batch runs start only with MB_LEAST (480) s of the part left (not after
#   the b8 run in parts a and b: run a2 and b2 as their own calls; MB_STEPS=2 if a part runs out).
# * GPT3_18B b8x1024 with one 64 GiB storage directory (disk budget 68.67e9, --no-storage-keep-previous), 138 GiB,
#   pool 50 GiB preallocated (48 refused: the pinned peak ~51.7e9 is over it), host 119e9: 128 device / 149 host
#   (all master-fetch) / 87 disk chunks, 32 programs; accounted device peak 133.15e9; host measure 118.71e9
#   (pool 53.69e9 + pageable 65.03e9); disk 110.6 GB/step; predicted 79.25 s/step (75.7 s of disk after the
#   backward): 5 steps (warm-up, 3 timed, 1 profiled) are ~400 s, so part b may only just fit its limit. At 126 GiB
#   (session 12) the re-plan after the compiled check needed 108+ chunks on disk and 138.8e9 of host.
#   With 8 micro-batches the host chunks' float32 sums (6 B/param) do not fit beside a 64 GiB disk: the CPU plan
#   (pool 50 GiB) is refused needing 150.5e9 of host with 108 chunks on disk; b2 records the GPU's refusal (or its
#   plan, if the GPU's traces are smaller than the CPU's).
set -u
RUN=${1:-largest}
PART=${2:-a}
export PYTHONUNBUFFERED=1
START=$SECONDS
LIMIT=${LIMIT:-530}
OUT=${OUT:-/tmp/largest_out}
mkdir -p $OUT
DISK=${DISK:-$PWD/.scratch_disk}
BUDGET=${BUDGET:-138GiB}
# CPU smoke test: OUT=/tmp/o M15=micro M18=tiny BUDGET=64MiB SEQ=16 bash ... a (numbers meaningless)
M15=${M15:-GPT3_15B}
M18=${M18:-GPT3_18B}
B="python -m experiments.bench --largest --systems chunkjax --device-budget $BUDGET --largest-seq ${SEQ:-1024} --results-dir $OUT"
run() {  # run <tag> <pool GiB> <least s> <bench args...>: with at least <least s> of the part left, else skipped
  local tag=$1 pool=$2 least=$3; shift 3
  local left=$((LIMIT - (SECONDS - START)))
  if (( left < least )); then echo "skip $tag (time)"; echo "$tag" >> $OUT/skipped.txt; return; fi
  local t0=$SECONDS
  XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE=true XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=$pool \
    timeout -k 10 $left $B --run-id ${RUN}_$tag --worker-timeout $((left - 15)) "$@" > $OUT/$tag.log 2>&1
  echo "$tag rc=$? $((SECONDS - t0)) s"
}
disk() { rm -rf "$DISK"; mkdir -p "$DISK"; df -B1 --output=avail "$DISK" | tail -1 | sed 's/^/disk free bytes: /'; }
if [[ $PART == a ]]; then
  run 15b ${POOL15:-38} 120 --largest-models $M15 --largest-steps 5
fi
if [[ $PART == a || $PART == a2 ]]; then
  disk
  run 15b_mb8 ${POOL15MB:-40} ${MB_LEAST:-480} --largest-models $M15 --largest-steps ${MB_STEPS:-3} --largest-batch 64 --set micro_batches=8 \
    --storage "$DISK" --no-storage-keep-previous
  rm -rf "$DISK"
fi
if [[ $PART == b ]]; then
  disk
  run 18b_disk ${POOL18:-50} 120 --largest-models $M18 --largest-steps 3 --storage "$DISK" --no-storage-keep-previous
  rm -rf "$DISK"
fi
if [[ $PART == b || $PART == b2 ]]; then
  disk
  run 18b_disk_mb8 ${POOL18MB:-50} ${MB_LEAST:-480} --largest-models $M18 --largest-steps ${MB_STEPS:-3} --largest-batch 64 \
    --set micro_batches=8 --storage "$DISK" --no-storage-keep-previous
  rm -rf "$DISK"
fi
for t in 15b 15b_mb8 18b_disk 18b_disk_mb8; do [ -f $OUT/$t.log ] && { echo "== $t"; tail -3 $OUT/$t.log; }; done
python - "$RUN" <<'P'
import json, os, sys
O, run = os.environ.get("OUT", "/tmp/largest_out"), sys.argv[1]
rows = []
for tag in ("15b", "15b_mb8", "18b_disk", "18b_disk_mb8"):
    f = f"{O}/bench_{run}_{tag}.json"
    if not os.path.exists(f):
        continue
    blk = json.load(open(f)).get("largest", {}).get("chunkjax", {})
    for model, t in blk.get("tried", {}).items():
        st = t.get("storage") or {}
        gbs = st.get("disk_gb_per_s_measured") or []
        losses = t.get("losses") or []
        rows.append({"run": tag, "model": model, "batch": blk.get("batch"), "micro_batches": t.get("micro_batches"),
                     "ok": t.get("ok"), "step_s": t.get("step_s_median"), "step_s_predicted": t.get("step_s_predicted"),
                     "tokens_per_s": t.get("tokens_per_s"), "loss_first_last": [losses[0], losses[-1]] if losses else None,
                     "host_rss_peak": t.get("host_rss_peak_bytes_measured"), "host_accounted": t.get("host_bytes_accounted"),
                     "host_budget": t.get("host_budget_bytes"), "device_peak": t.get("peak_device_bytes_measured"),
                     "device_accounted": t.get("peak_device_bytes_accounted"), "compiled_peak": t.get("compiled_peak_bytes"),
                     "storage_chunks": st.get("storage_chunks"), "disk_gb_step": (st.get("disk_bytes_per_step_accounted") or 0) / 1e9,
                     "disk_gb_s": gbs[-1] if gbs else None, "counts": t.get("schedule_counts"),
                     "error": (t.get("error") or t.get("infeasible_reason") or "")[:300]})
skipped = f"{O}/skipped.txt"
out = {"run_id": run, "rows": rows, "skipped": open(skipped).read().split() if os.path.exists(skipped) else []}
json.dump(out, open(f"{O}/largest_{run}.json", "w"), indent=1)
g = lambda v, d=2, s=1e9: "-" if v is None else f"{v / s:,.{d}f}"
print("| run | model | batch (micro) | ok | step s | predicted s | tokens/s | loss first -> last | host RSS GB | host plan GB "
      "| device GB (compiled / plan) | disk chunks | disk GB/step | disk GB/s |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for x in rows:
    l = x["loss_first_last"]
    print(f"| {x['run']} | {x['model']} | {x['batch']} ({x['micro_batches'] or 1}) | {x['ok']} | {g(x['step_s'], 2, 1)} | "
          f"{g(x['step_s_predicted'], 2, 1)} | {g(x['tokens_per_s'], 0, 1)} | "
          f"{'-' if not l else f'{l[0]:.3f} -> {l[1]:.3f}'} | {g(x['host_rss_peak'])} | {g(x['host_accounted'])} | "
          f"{g(x['device_peak'])} ({g(x['compiled_peak'])} / {g(x['device_accounted'])}) | {x['storage_chunks'] or 0} | "
          f"{x['disk_gb_step']:.1f} | {g(x['disk_gb_s'], 2, 1)} | " + (x["error"].splitlines()[0] if x["error"] else ""))
print("skipped:", out["skipped"])
P
